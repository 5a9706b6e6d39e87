//! Continuous batching inside one worker (`k3_worker::batch`) on a tiny random checkpoint with
//! the real tensor graph: every sequence's ids equal its solo run's — mixed prompt lengths,
//! greedy and seeded sampling, a prompt fed in chunks beside decoding sequences, a sequence
//! joining mid-batch, one cancelled, one ending on a stop id.

mod common;

use std::collections::BTreeMap;

use common::{tiny_dims, MemSource};
use k3_worker::batch::{Batch, Finish, SeqRequest};
use k3_worker::generate::{generate, GenOptions, Sampler};
use k3_worker::model::{Model, TensorShapes};

fn model(src: &MemSource) -> Model<'_> {
    Model::new(src.dims.clone(), src, Some(src as &dyn TensorShapes)).unwrap()
}

/// The sequence alone, through the one-shot generation loop.
fn solo(src: &MemSource, r: &SeqRequest) -> Vec<u32> {
    let mut m = model(src);
    let opts = GenOptions {
        max_new: r.max_new,
        full_recompute: false,
        sampler: r.sampler.clone(),
        stop_ids: r.stop_ids.clone(),
        keep_step0_logits: false,
        prefill_chunk: 0,
        spec: k3_worker::spec::SpecMode::Off,
    };
    generate(&mut m, &r.prompt, &opts, &mut |_| {})
        .unwrap()
        .generated_ids
}

fn req(prompt: &[u32], max_new: usize, sampler: Sampler) -> SeqRequest {
    SeqRequest {
        prompt: prompt.to_vec(),
        max_new,
        sampler,
        stop_ids: vec![],
    }
}

#[test]
fn every_sequence_gets_its_solo_ids_whoever_shares_its_steps() {
    let src = MemSource::random(&tiny_dims(), 21);
    let long: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 97).collect();
    let mut reqs = [
        req(&[5, 17, 3, 88, 42], 9, Sampler::Greedy),
        req(&[9], 12, Sampler::new(0.9, 0.95, 7).unwrap()),
        req(&long, 6, Sampler::Greedy),
        req(&[61, 2, 8], 10, Sampler::new(1.2, 0.8, 3).unwrap()),
        req(&[4, 4, 4, 4], 8, Sampler::Greedy),
    ];
    // One sequence ends on a stop id: its solo run's fourth id.
    let first = solo(&src, &reqs[4]);
    reqs[4].stop_ids = vec![first[3]];
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| solo(&src, r)).collect();
    assert_eq!(want[4].len(), 4, "the stop id ends it");

    let mut m = model(&src);
    // Four prompt rows per step: the long prompt takes six steps beside the others' decoding.
    let mut b = Batch::new(4);
    let mut handle = BTreeMap::new();
    for i in [0, 1, 2] {
        handle.insert(b.join(&m, reqs[i].clone()).unwrap(), i);
    }
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 5];
    let mut ends = BTreeMap::new();
    let mut step = 0;
    let mut max_seqs = 0;
    while !b.is_empty() || step < 3 {
        // Sequences 3 and 4 join at step 3, while the long prompt is still being fed.
        if step == 3 {
            for i in [3, 4] {
                handle.insert(b.join(&m, reqs[i].clone()).unwrap(), i);
            }
        }
        let (out, shape) = b.step(&mut m).unwrap();
        max_seqs = max_seqs.max(shape.seqs);
        // Four prompt rows a step, first come first served; decoding rows beside them.
        match step {
            0 => assert_eq!((shape.seqs, shape.rows, shape.prompt_rows), (1, 4, 4)),
            1 => assert_eq!((shape.seqs, shape.rows, shape.prompt_rows), (3, 4, 4)),
            2 => assert_eq!((shape.seqs, shape.rows, shape.prompt_rows), (3, 6, 4)),
            _ => assert!(shape.prompt_rows <= 4 && shape.rows <= 4 + shape.seqs),
        }
        for e in out {
            let i = handle[&e.seq];
            got[i].push(e.token);
            if let Some(f) = e.finish {
                ends.insert(i, f);
            }
        }
        step += 1;
    }
    assert_eq!(max_seqs, 5);
    for i in 0..5 {
        assert_eq!(got[i], want[i], "sequence {i}");
    }
    assert_eq!(ends[&4], Finish::Stop(first[3]));
    assert_eq!(ends[&0], Finish::Length);
}

#[test]
fn a_cancelled_sequence_leaves_and_the_others_go_on_unchanged() {
    let src = MemSource::random(&tiny_dims(), 5);
    let reqs = [
        req(&[1, 2, 3], 8, Sampler::Greedy),
        req(&[7, 7], 8, Sampler::Greedy),
        req(&[90, 50, 25, 12], 8, Sampler::new(0.7, 0.9, 11).unwrap()),
    ];
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| solo(&src, r)).collect();
    let mut m = model(&src);
    let mut b = Batch::new(0);
    let h: Vec<u64> = reqs
        .iter()
        .map(|r| b.join(&m, r.clone()).unwrap())
        .collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    for step in 0..8 {
        if step == 3 {
            assert!(b.leave(h[1]));
            assert!(!b.leave(h[1]), "gone already");
        }
        let (out, shape) = b.step(&mut m).unwrap();
        assert_eq!(shape.seqs, if step < 3 { 3 } else { 2 });
        for e in out {
            got[h.iter().position(|&x| x == e.seq).unwrap()].push(e.token);
        }
    }
    assert!(b.is_empty());
    assert_eq!(got[0], want[0]);
    assert_eq!(got[1], want[1][..3]);
    assert_eq!(got[2], want[2]);
}

#[test]
fn bad_requests_are_refused_before_they_join() {
    let src = MemSource::random(&tiny_dims(), 5);
    let m = model(&src);
    let mut b = Batch::new(0);
    let v = src.dims.vocab as u32;
    assert!(b.join(&m, req(&[], 4, Sampler::Greedy)).is_err());
    assert!(b.join(&m, req(&[1], 0, Sampler::Greedy)).is_err());
    assert!(b.join(&m, req(&[1, v], 4, Sampler::Greedy)).is_err());
    assert!(b.is_empty());
}
