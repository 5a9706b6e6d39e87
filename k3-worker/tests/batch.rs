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
        pause_before_last: false,
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
        let st = b.step(&mut m).unwrap();
        let (out, shape) = (st.emitted, st.shape);
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
            assert!(b.leave(h[1]).is_some());
            assert!(b.leave(h[1]).is_none(), "gone already");
        }
        let st = b.step(&mut m).unwrap();
        let (out, shape) = (st.emitted, st.shape);
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

/// A sequence pauses before its prompt's last id (its state there can be kept, as a session a
/// retry resumes from), goes on when resumed; a kept state — the pause's, or the final one of a
/// finished sequence — starts a longer prompt that extends it, and every id is the solo run's.
#[test]
fn pause_keep_and_resume_give_the_solo_ids() {
    use k3_worker::batch::Resumed;
    let src = MemSource::random(&tiny_dims(), 8);
    let prompt = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let first = req(&prompt, 6, Sampler::Greedy);
    let want = solo(&src, &first);
    let mut m = model(&src);
    let mut b = Batch::new(3);
    let other = b.join(&m, req(&[7, 7, 7], 10, Sampler::Greedy)).unwrap();
    let mut r = first.clone();
    r.pause_before_last = true;
    let seq = b.join(&m, r.clone()).unwrap();
    // Three prompt ids a step (the other sequence's three first): the pause comes after 7 ids.
    let mut paused_at = None;
    for step in 0..6 {
        let out = b.step(&mut m).unwrap();
        assert!(
            out.emitted.iter().all(|e| e.seq == other),
            "{step}: {:?}",
            out.emitted
        );
        if out.paused.contains(&seq) {
            paused_at = Some(step);
            break;
        }
    }
    assert!(paused_at.is_some());
    let (state, held) = b.state(seq).unwrap();
    assert_eq!(held, &prompt[..7]);
    assert_eq!(state.pos, 7);
    // A paused sequence sits steps out.
    let out = b.step(&mut m).unwrap();
    assert!(out.shares.iter().all(|(s, _)| *s != seq));
    // Kept and resumed in a new sequence (as a retry would): the solo ids.
    let kept = b.leave(seq).unwrap();
    let seq2 = b.join_from(&m, first.clone(), Some(kept)).unwrap();
    let mut got = Vec::new();
    let mut last = None;
    while last.is_none() {
        let out = b.step(&mut m).unwrap();
        got.extend(
            out.emitted
                .iter()
                .filter(|e| e.seq == seq2)
                .map(|e| e.token),
        );
        last = out.ended.into_iter().find(|(s, _)| *s == seq2);
    }
    assert_eq!(got, want);
    // The final state holds the prompt and every id but the last; a next turn extends it.
    let (_, fin): (u64, Resumed) = last.unwrap();
    let mut turn: Vec<u32> = prompt.clone();
    turn.extend_from_slice(&want);
    assert_eq!(fin.held, turn[..turn.len() - 1]);
    turn.extend_from_slice(&[11, 12]);
    let next = req(&turn, 5, Sampler::Greedy);
    let want2 = solo(&src, &next);
    // Its capacity was sized for the first request only: refused, not overrun.
    assert!(b.join_from(&m, next.clone(), Some(fin)).is_err());
    let mut b2 = Batch::new(0);
    let seq3 = b2.join(&m, next.clone()).unwrap();
    let mut got2 = Vec::new();
    while !b2.is_empty() {
        got2.extend(
            b2.step(&mut m)
                .unwrap()
                .emitted
                .iter()
                .filter(|e| e.seq == seq3)
                .map(|e| e.token),
        );
    }
    assert_eq!(got2, want2);
    // A kept state that is not a prefix of the prompt is refused.
    let wrong = Resumed {
        state: m.new_state(64),
        held: vec![],
    };
    let mut bad = req(&[5], 2, Sampler::Greedy);
    assert!(b.join_from(&m, bad.clone(), Some(wrong)).is_ok());
    bad.prompt = vec![1, 2];
    let mut st = m.new_state(64);
    m.forward(&[9], &mut st, k3_worker::model::Logits::Last)
        .unwrap();
    let e = b
        .join_from(
            &m,
            bad,
            Some(Resumed {
                state: st,
                held: vec![9],
            }),
        )
        .unwrap_err();
    assert!(e.to_string().contains("cannot start"), "{e}");
}
