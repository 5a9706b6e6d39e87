//! Several sequences in one engine (continuous batching) on a tiny random checkpoint with the
//! real tensor graph: every sequence's ids equal its solo run's — mixed prompt lengths, greedy
//! and seeded sampling, speculation (replayed drafts with misses, n-gram drafts) as draft rows of
//! the shared pass, a prompt fed in chunks beside decoding sequences, sequences joining
//! mid-run, one cancelled, one ending on a stop id — and admission follows the state budget: a
//! request longer than a slot waits for the room of several, then runs with its solo ids.

use crate::common;

use std::cell::RefCell;
use std::collections::BTreeMap;

use common::{tiny_dims, Gen, MemSource};
use k3_proto::serve::Finish;
use k3_worker::engine::memory::EnginePlan;
use k3_worker::engine::outputs::{Finished, Flow, Outputs, Sink, StepReport};
use k3_worker::engine::request::{Request, RequestError, Speculation};
use k3_worker::engine::sampling::Sampler;
use k3_worker::engine::spec::{Drafter, NgramDrafter, ReplayDrafter, SpecMode};
use k3_worker::engine::Engine;
use k3_worker::model::{Model, TensorShapes};

fn model(src: &MemSource) -> Model<'_> {
    Model::new(src.dims.clone(), src, Some(src as &dyn TensorShapes)).unwrap()
}

/// What a test asks of one sequence.
#[derive(Clone)]
struct Ask {
    prompt: Vec<u32>,
    max_new: usize,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    /// Draft with replayed ids (`Some(miss rate)`, of the solo ids) or n-gram lookup.
    drafts: Option<Option<f64>>,
}

fn ask(prompt: &[u32], max_new: usize, sampler: Sampler) -> Ask {
    Ask {
        prompt: prompt.to_vec(),
        max_new,
        sampler,
        stop_ids: vec![],
        drafts: None,
    }
}

/// The sequence alone, without drafts.
fn solo(src: &MemSource, a: &Ask) -> Vec<u32> {
    let g = Gen {
        stop_ids: a.stop_ids.clone(),
        ..Gen::new(a.max_new, a.sampler.clone())
    };
    g.run(model(src), &a.prompt, &mut |_| {}).0.generated_ids
}

/// Its request, drafting as asked (replays of `want`).
fn request(a: &Ask, want: &[u32]) -> Request {
    let spec = match a.drafts {
        None => Speculation::off(),
        Some(Some(miss)) => {
            let d: Box<dyn Drafter> = Box::new(ReplayDrafter {
                continuation: want.to_vec(),
                prompt_len: a.prompt.len(),
                miss_rate: miss,
                seed: 3,
            });
            Speculation::with(SpecMode::Fixed(3), Some(d))
        }
        Some(None) => Speculation::with(SpecMode::Fixed(4), Some(Box::new(NgramDrafter))),
    };
    Request {
        stop_ids: a.stop_ids.clone(),
        spec,
        ..Request::new(a.prompt.clone(), a.max_new, a.sampler.clone())
    }
}

/// Collects each sequence's ids and end, by the test's index.
struct Collect<'a> {
    index: usize,
    got: &'a Got,
}

impl Sink for Collect<'_> {
    fn token(&mut self, s: &StepReport) -> Flow {
        self.got
            .borrow_mut()
            .entry(self.index)
            .or_default()
            .0
            .push(s.token);
        Flow::Continue
    }
    fn done(&mut self, f: &Finished) {
        self.got.borrow_mut().entry(self.index).or_default().1 = Some(f.clone());
    }
}

type Got = RefCell<BTreeMap<usize, (Vec<u32>, Option<Finished>)>>;

fn plan(slots: usize, positions: usize, prefill_rows: usize, drafts: usize) -> EnginePlan {
    EnginePlan {
        slots,
        positions,
        longest: positions,
        prefill_rows,
        drafts,
        draft_model: false,
        keep_step0_logits: false,
    }
}

/// Five sequences, two joining at step 3 while a long prompt is still fed 4 rows a step: each
/// gets its solo ids; with `drafting` three of them draft (replays with and without misses,
/// n-gram) as rows of the shared pass.
fn five_sequences(drafting: bool) {
    let src = MemSource::random(&tiny_dims(), 21);
    let long: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 97).collect();
    let mut asks = [
        ask(&[5, 17, 3, 88, 42], 9, Sampler::Greedy),
        ask(&[9], 12, Sampler::new(0.9, 0.95, 7).unwrap()),
        ask(&long, 6, Sampler::Greedy),
        ask(&[61, 2, 8], 10, Sampler::new(1.2, 0.8, 3).unwrap()),
        ask(&[4, 4, 4, 4], 8, Sampler::Greedy),
    ];
    // One sequence ends on a stop id: its solo run's fourth id.
    let first = solo(&src, &asks[4]);
    asks[4].stop_ids = vec![first[3]];
    if drafting {
        asks[0].drafts = Some(Some(0.0));
        asks[1].drafts = Some(Some(0.5));
        asks[3].drafts = Some(None);
    }
    let want: Vec<Vec<u32>> = asks.iter().map(|a| solo(&src, a)).collect();
    assert_eq!(want[4].len(), 4, "the stop id ends it");

    // Four prompt rows a step: the long prompt takes six steps beside the others' decoding.
    let mut e = Engine::new(model(&src), plan(5, 40, 4, if drafting { 4 } else { 0 }));
    let got: Got = RefCell::new(BTreeMap::new());
    let mut out = Outputs::new(None);
    let sink = |i: usize| {
        Box::new(Collect {
            index: i,
            got: &got,
        })
    };
    for i in [0, 1, 2] {
        e.submit(request(&asks[i], &want[i]), sink(i), &mut out)
            .unwrap();
    }
    let (mut step, mut max_seqs, mut draft_rows) = (0, 0, 0);
    while !e.is_idle() || step < 3 {
        // Sequences 3 and 4 join at step 3, while the long prompt is still being fed.
        if step == 3 {
            for i in [3, 4] {
                e.submit(request(&asks[i], &want[i]), sink(i), &mut out)
                    .unwrap();
            }
        }
        let shape = e.step(&mut out).unwrap();
        max_seqs = max_seqs.max(shape.seqs);
        draft_rows += shape.draft_rows;
        // Four prompt rows a step, first come first served; decoding rows beside them.
        assert!(shape.prompt_rows <= 4, "{step}: {shape:?}");
        if !drafting {
            match step {
                0 => assert_eq!((shape.seqs, shape.rows, shape.prompt_rows), (1, 4, 4)),
                1 => assert_eq!((shape.seqs, shape.rows, shape.prompt_rows), (3, 4, 4)),
                2 => assert_eq!((shape.seqs, shape.rows, shape.prompt_rows), (3, 6, 4)),
                _ => assert!(shape.rows <= 4 + shape.seqs, "{step}: {shape:?}"),
            }
        }
        step += 1;
    }
    // Drafting sequences end sooner: fewer are left when the last two join.
    assert!(max_seqs >= if drafting { 3 } else { 5 }, "{max_seqs}");
    assert_eq!(
        draft_rows > 0,
        drafting,
        "draft rows ride in the shared passes"
    );
    drop(out);
    let got = got.into_inner();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[&i].0, w, "sequence {i} (drafting {drafting})");
        let f = got[&i].1.as_ref().expect("its end");
        assert_eq!(f.report.generated_ids, *w);
        assert_eq!(f.usage.generated as usize, w.len());
    }
    let end = |i: usize| got[&i].1.as_ref().unwrap().finish;
    assert_eq!(end(4), Finish::EndId(first[3]));
    assert_eq!(end(0), Finish::Length);
    if drafting {
        let spec = |i: usize| got[&i].1.as_ref().unwrap().report.spec.clone();
        assert!(spec(0).accepted_tokens > 0, "{:?}", spec(0));
        assert!(spec(0).forward_passes < want[0].len() as u64 - 1);
    }
}

#[test]
fn every_sequence_gets_its_solo_ids_whoever_shares_its_steps() {
    five_sequences(false);
}

#[test]
fn drafted_rows_in_a_shared_pass_give_every_sequence_its_solo_ids() {
    five_sequences(true);
}

#[test]
fn a_cancelled_sequence_leaves_and_the_others_go_on_unchanged() {
    let src = MemSource::random(&tiny_dims(), 5);
    let asks = [
        ask(&[1, 2, 3], 8, Sampler::Greedy),
        ask(&[7, 7], 8, Sampler::Greedy),
        ask(&[90, 50, 25, 12], 8, Sampler::new(0.7, 0.9, 11).unwrap()),
    ];
    let want: Vec<Vec<u32>> = asks.iter().map(|a| solo(&src, a)).collect();
    let mut e = Engine::new(model(&src), plan(3, 16, 0, 0));
    let got: Got = RefCell::new(BTreeMap::new());
    let mut out = Outputs::new(None);
    let seqs: Vec<u64> = (asks.iter().enumerate())
        .map(|(i, a)| {
            let sink = Collect {
                index: i,
                got: &got,
            };
            e.submit(request(a, &want[i]), Box::new(sink), &mut out)
                .unwrap()
        })
        .collect();
    for step in 0..8 {
        if step == 3 {
            assert!(e.cancel(seqs[1], &mut out));
            assert!(!e.cancel(seqs[1], &mut out), "gone already");
        }
        let shape = e.step(&mut out).unwrap();
        assert_eq!(shape.seqs, if step < 3 { 3 } else { 2 });
    }
    assert!(e.is_idle());
    drop(out);
    let got = got.into_inner();
    assert_eq!(got[&0].0, want[0]);
    assert_eq!(got[&1].0, want[1][..3]);
    assert_eq!(got[&1].1.as_ref().unwrap().finish, Finish::Cancelled);
    assert_eq!(got[&2].0, want[2]);
}

#[test]
fn bad_requests_are_refused_before_they_join() {
    let src = MemSource::random(&tiny_dims(), 5);
    let mut e = Engine::new(model(&src), plan(2, 8, 0, 0));
    let v = src.dims.vocab as u32;
    let got: Got = RefCell::new(BTreeMap::new());
    let mut out = Outputs::new(None);
    let mut refuse = |prompt: &[u32], n: usize| {
        let sink = Collect {
            index: 0,
            got: &got,
        };
        let req = Request::new(prompt.to_vec(), n, Sampler::Greedy);
        e.submit(req, Box::new(sink), &mut out).unwrap_err()
    };
    assert_eq!(refuse(&[], 4), RequestError::EmptyPrompt);
    assert_eq!(refuse(&[1], 0), RequestError::NothingToGenerate);
    assert!(matches!(refuse(&[1, v], 4), RequestError::Vocab { .. }));
    // More positions than one sequence may take.
    assert!(matches!(refuse(&[1; 6], 4), RequestError::TooLong { .. }));
    assert!(e.is_idle());
}

/// A state handed back continues: a request whose prompt extends it runs only the new ids and
/// gets the solo ids of the whole prompt; one whose prompt does not start with its ids starts
/// afresh (the same ids again); continuing from a state of fewer positions than the request
/// needs gives it room.
#[test]
fn a_handed_back_state_continues_with_the_solo_ids() {
    let src = MemSource::random(&tiny_dims(), 8);
    let prompt = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let mut e = Engine::new(model(&src), plan(2, 64, 3, 0));
    let a = e
        .run_one(
            Request::new(prompt.clone(), 6, Sampler::Greedy),
            &mut |_| Flow::Continue,
        )
        .unwrap();
    let want1 = solo(&src, &ask(&prompt, 6, Sampler::Greedy));
    assert_eq!(a.finished.report.generated_ids, want1);
    let held = a.held.unwrap();
    let mut turn = prompt.clone();
    turn.extend_from_slice(&want1);
    assert_eq!(held.ids, turn[..turn.len() - 1], "all but the last pick");
    turn.extend_from_slice(&[11, 12]);
    let want2 = solo(&src, &ask(&turn, 20, Sampler::Greedy));
    let cap = held.state.capacity;
    assert!(cap < turn.len() + 19, "the state must grow");
    let next = Request {
        from: Some(held),
        ..Request::new(turn.clone(), 20, Sampler::Greedy)
    };
    let b = e.run_one(next, &mut |_| Flow::Continue).unwrap();
    assert_eq!(b.finished.report.generated_ids, want2);
    assert_eq!(b.finished.usage.cached_ids as usize, prompt.len() + 5);
    assert!(!b.finished.restarted);
    // Not a prefix of the next prompt: the whole prompt runs again, same ids.
    let other = vec![7, 7, 7, 7];
    let c = Request {
        from: b.held,
        ..Request::new(other.clone(), 5, Sampler::Greedy)
    };
    let c = e.run_one(c, &mut |_| Flow::Continue).unwrap();
    assert!(c.finished.restarted);
    assert_eq!(c.finished.usage.cached_ids, 0);
    assert_eq!(
        c.finished.report.generated_ids,
        solo(&src, &ask(&other, 5, Sampler::Greedy))
    );
}

/// Slots and the state budget: with two slots of 16 positions, a third request waits for a
/// slot; a request of 30 positions (the room of two slots) waits until both are free, then runs
/// alone; every one gets its solo ids.
#[test]
fn admission_waits_for_room_and_a_long_request_takes_several_slots() {
    let src = MemSource::random(&tiny_dims(), 9);
    let long: Vec<u32> = (0..25).map(|i| (i * 11 + 2) % 97).collect();
    let asks = [
        ask(&[1, 2, 3], 10, Sampler::Greedy),
        ask(&[4, 5], 12, Sampler::Greedy),
        ask(&[6], 6, Sampler::Greedy),
        ask(&long, 6, Sampler::Greedy),
    ];
    let want: Vec<Vec<u32>> = asks.iter().map(|a| solo(&src, a)).collect();
    let p = EnginePlan {
        longest: 30,
        ..plan(2, 16, 8, 0)
    };
    let mut e = Engine::new(model(&src), p);
    let got: Got = RefCell::new(BTreeMap::new());
    let mut out = Outputs::new(None);
    for (i, a) in asks.iter().enumerate() {
        let sink = Collect {
            index: i,
            got: &got,
        };
        e.submit(request(a, &want[i]), Box::new(sink), &mut out)
            .unwrap();
    }
    let mut alone = false;
    while !e.is_idle() {
        let (running, waiting) = e.load();
        let shape = e.step(&mut out).unwrap();
        assert!(shape.seqs <= 2, "{shape:?}");
        if shape.prompt_rows > 0 && shape.seqs == 1 && running + waiting == 1 {
            alone = true;
        }
    }
    drop(out);
    let got = got.into_inner();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[&i].0, w, "sequence {i}");
    }
    assert!(alone, "the long request ran once the others had left");
}

/// `n` choices of one prompt (the OpenAI API's `n`): the prompt is prefilled once — its rows
/// run in the passes once, not once per choice — and forked into every choice; choice `i`
/// sampled with seed `s + i` gets the ids of that request run alone, beside another sequence
/// and with the prompt fed in chunks. A group larger than the slots is refused; a group whose
/// first sequence is cancelled before its prefill ends still gives the others their solo ids.
#[test]
fn choices_of_one_prompt_are_prefilled_once_and_each_gets_its_solo_ids() {
    let src = MemSource::random(&tiny_dims(), 13);
    let prompt: Vec<u32> = (0..11).map(|i| (i * 29 + 3) % 97).collect();
    let seed = 40;
    let asks: Vec<Ask> = (0..3)
        .map(|i| ask(&prompt, 9, Sampler::new(0.9, 0.95, seed + i).unwrap()))
        .collect();
    let want: Vec<Vec<u32>> = asks.iter().map(|a| solo(&src, a)).collect();
    assert!(
        want[0] != want[1] && want[1] != want[2],
        "the seeds must give different choices for this test to mean anything"
    );
    let other = ask(&[5, 6, 7], 6, Sampler::Greedy);
    let want_other = solo(&src, &other);
    let mut e = Engine::new(model(&src), plan(4, 24, 4, 0));
    let got: Got = RefCell::new(BTreeMap::new());
    let mut out = Outputs::new(None);
    let sink = |index| Box::new(Collect { index, got: &got }) as Box<dyn Sink + '_>;
    e.submit(request(&other, &[]), sink(9), &mut out).unwrap();
    let choices = (asks.iter().enumerate())
        .map(|(i, a)| (request(a, &[]), sink(i)))
        .collect();
    let seqs = e.submit_choices(choices, &mut out).unwrap();
    assert_eq!(seqs.len(), 3);
    let mut prompt_rows = 0;
    while !e.is_idle() {
        prompt_rows += e.step(&mut out).unwrap().prompt_rows;
    }
    drop(out);
    assert_eq!(
        prompt_rows,
        prompt.len() + 3,
        "the choices' prompt runs once (and the other sequence's)"
    );
    let got = got.into_inner();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[&i].0, w, "choice {i}");
        let f = got[&i].1.as_ref().unwrap();
        assert_eq!(f.usage.prompt_ids as usize, prompt.len());
        assert_eq!(f.usage.generated as usize, w.len());
    }
    assert_eq!(got[&9].0, want_other);

    // More choices than slots: refused whole, nothing queued.
    let mut e = Engine::new(model(&src), plan(2, 24, 4, 0));
    let got: Got = RefCell::new(BTreeMap::new());
    let mut out = Outputs::new(None);
    let sink = |index| Box::new(Collect { index, got: &got }) as Box<dyn Sink + '_>;
    let choices = (asks.iter().enumerate())
        .map(|(i, a)| (request(a, &[]), sink(i)))
        .collect();
    let err = e.submit_choices(choices, &mut out).unwrap_err();
    assert!(
        matches!(err, RequestError::TooManyChoices { n: 3, slots: 2, .. }),
        "{err:?}"
    );
    assert!(e.is_idle());
    // The first choice cancelled before its prefill ends: the second prefills itself.
    let choices = (asks[..2].iter().enumerate())
        .map(|(i, a)| (request(a, &[]), sink(i)))
        .collect();
    let seqs = e.submit_choices(choices, &mut out).unwrap();
    e.step(&mut out).unwrap();
    assert!(e.cancel(seqs[0], &mut out));
    e.run_to_end(&mut out).unwrap();
    drop(out);
    assert_eq!(got.into_inner()[&1].0, want[1]);
}
