//! A request's shaping through the engine on a tiny random checkpoint with the real tensor
//! graph (docs/SPEC.md §6.12 "Shaping"): a shaped request whose edits are all neutral gets the
//! plain request's ids bit for bit (greedy and sampled), a logit bias moves the pick, the
//! log-probabilities are the log-softmax of the step's logits (computed here in f64 from the
//! first pick's kept logits), a spent thinking budget forces its closing ids, and speculation
//! (replayed drafts, with misses) gives a shaped sequence the ids it gets without drafts.

use crate::common;

use common::{tiny_dims, MemSource};
use k3_worker::engine::memory::EnginePlan;
use k3_worker::engine::outputs::{Flow, StepReport};
use k3_worker::engine::request::{Request, Speculation};
use k3_worker::engine::sampling::{positions_needed, Sampler};
use k3_worker::engine::shaping::{Scored, Shaping, ThinkBudget};
use k3_worker::engine::spec::{Drafter, ReplayDrafter, SpecMode};
use k3_worker::engine::Engine;
use k3_worker::model::{Model, TensorShapes};

fn model(src: &MemSource) -> Model<'_> {
    Model::new(src.dims.clone(), src, Some(src as &dyn TensorShapes)).unwrap()
}

const PROMPT: [u32; 7] = [3, 17, 42, 8, 8, 61, 5];

/// One run: the ids, each id's scores, and the first pick's raw logits.
struct Run {
    ids: Vec<u32>,
    scored: Vec<Option<Scored>>,
    step0: Vec<f32>,
}

fn run(src: &MemSource, sampler: Sampler, shaping: Shaping, replay: Option<&[u32]>) -> Run {
    let max_new = 12;
    let positions = positions_needed(PROMPT.len(), max_new);
    let drafts = if replay.is_some() { 3 } else { 0 };
    let mut engine = Engine::new(model(src), EnginePlan::one(positions, 0, drafts));
    let spec = match replay {
        None => Speculation::off(),
        Some(want) => {
            let d: Box<dyn Drafter> = Box::new(ReplayDrafter {
                continuation: want.to_vec(),
                prompt_len: PROMPT.len(),
                miss_rate: 0.3,
                seed: 5,
            });
            Speculation::with(SpecMode::Fixed(3), Some(d))
        }
    };
    let req = Request {
        stop_ids: vec![],
        spec,
        shaping,
        keep_step0_logits: true,
        ..Request::new(PROMPT.to_vec(), max_new, sampler)
    };
    let mut scored = Vec::new();
    let ended = engine
        .run_one(req, &mut |s: &StepReport| {
            scored.push(s.scored.clone());
            Flow::Continue
        })
        .unwrap();
    let r = ended.finished.report;
    assert!(ended.finished.error.is_none(), "{:?}", ended.finished.error);
    Run {
        ids: r.generated_ids,
        scored,
        step0: r.step0_logits.expect("kept"),
    }
}

fn greedy() -> Sampler {
    Sampler::Greedy
}

fn sampled() -> Sampler {
    Sampler::new(0.9, 0.95, 11).unwrap()
}

#[test]
fn neutral_shaping_keeps_the_plain_ids_bit_for_bit() {
    let src = MemSource::random(&tiny_dims(), 31);
    for sampler in [greedy(), sampled()] {
        let plain = run(&src, sampler.clone(), Shaping::default(), None);
        assert!(plain.scored.iter().all(Option::is_none));
        // Not plain (a zero bias, log-probabilities asked), yet nothing moves a logit.
        let neutral = Shaping {
            bias: vec![(plain.ids[0], 0.0)],
            logprobs: Some(3),
            ..Shaping::default()
        };
        let shaped = run(&src, sampler, neutral, None);
        assert_eq!(shaped.ids, plain.ids);
        assert!(shaped
            .scored
            .iter()
            .all(|s| s.as_ref().is_some_and(|s| s.top.len() == 3)));
        assert_eq!(
            shaped.step0.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            plain.step0.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn logprobs_are_the_log_softmax_of_the_step() {
    let src = MemSource::random(&tiny_dims(), 32);
    let r = run(
        &src,
        greedy(),
        Shaping {
            logprobs: Some(5),
            ..Shaping::default()
        },
        None,
    );
    // An independent log-softmax of the first pick's logits, in f64.
    let l: Vec<f64> = r.step0.iter().map(|&x| f64::from(x)).collect();
    let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lz = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    let s = r.scored[0].as_ref().unwrap();
    assert_eq!(
        r.ids[0] as usize, order[0],
        "greedy picks the most likely id"
    );
    assert!((f64::from(s.logprob) - (l[order[0]] - lz)).abs() < 1e-5);
    for (k, &(id, lp)) in s.top.iter().enumerate() {
        assert_eq!(id as usize, order[k]);
        assert!((f64::from(lp) - (l[order[k]] - lz)).abs() < 1e-5, "{k}");
    }
    // Greedy: every pick is its step's most likely id.
    for (id, s) in r.ids.iter().zip(&r.scored) {
        let s = s.as_ref().unwrap();
        assert_eq!(s.top[0].0, *id);
        assert_eq!(s.top[0].1, s.logprob);
    }
}

#[test]
fn a_logit_bias_moves_the_pick() {
    let src = MemSource::random(&tiny_dims(), 33);
    let plain = run(&src, greedy(), Shaping::default(), None);
    let forced = run(
        &src,
        greedy(),
        Shaping {
            bias: vec![(77, 100.0)],
            ..Shaping::default()
        },
        None,
    );
    assert!(forced.ids.iter().all(|&id| id == 77), "{:?}", forced.ids);
    let banned = plain.ids[0];
    let without = run(
        &src,
        greedy(),
        Shaping {
            bias: vec![(banned, -100.0)],
            ..Shaping::default()
        },
        None,
    );
    assert!(!without.ids.contains(&banned), "{:?}", without.ids);
}

#[test]
fn a_spent_thinking_budget_forces_the_closing_ids() {
    let src = MemSource::random(&tiny_dims(), 34);
    let plain = run(&src, greedy(), Shaping::default(), None);
    // Closing ids the plain run never picks in its first ids, so that the model does not close
    // the channel itself.
    let close: Vec<u32> = (90..97)
        .filter(|id| !plain.ids.contains(id))
        .take(3)
        .collect();
    assert_eq!(close.len(), 3);
    for budget in [0usize, 2, 5] {
        let r = run(
            &src,
            greedy(),
            Shaping {
                think: Some(ThinkBudget {
                    tokens: budget,
                    close: close.clone(),
                }),
                ..Shaping::default()
            },
            None,
        );
        assert_eq!(r.ids[..budget], plain.ids[..budget], "budget {budget}");
        assert_eq!(r.ids[budget..budget + 3], close[..], "budget {budget}");
    }
}

#[test]
fn speculation_keeps_a_shaped_sequence_s_ids() {
    let src = MemSource::random(&tiny_dims(), 35);
    let plain = run(&src, greedy(), Shaping::default(), None);
    let close = vec![plain.ids[1], 94, 95];
    let shaping = || Shaping {
        think: Some(ThinkBudget {
            tokens: 4,
            close: close.clone(),
        }),
        bias: vec![(plain.ids[2], -3.0), (40, 1.5)],
        presence: 0.7,
        frequency: 0.4,
        logprobs: Some(2),
        ..Shaping::default()
    };
    for sampler in [greedy(), sampled()] {
        let alone = run(&src, sampler.clone(), shaping(), None);
        let drafted = run(&src, sampler, shaping(), Some(&alone.ids));
        assert_eq!(drafted.ids, alone.ids);
        assert_eq!(drafted.scored, alone.scored);
    }
}
