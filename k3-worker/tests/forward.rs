//! End-to-end properties of the forward pass on a tiny random checkpoint with the real tensor
//! graph (13 layers, block 3, map KKKMKKKMKKKMM, MXFP4 experts).

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{layer_name, tiny_dims, MemSource};
use k3_store::runtime::source::{
    ByteOwner, ExpertBatch, LayerRun, Region, SourceError, SourceStats, WeightSource,
};
use k3_worker::model::{Logits, Model, ModelError, TensorShapes};

const PROMPT: [u32; 7] = [5, 17, 3, 88, 42, 42, 9];

fn model(src: &MemSource) -> Model<'_> {
    Model::new(src.dims.clone(), src, Some(src as &dyn TensorShapes)).expect("bind globals")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn prefill_logits_equal_token_by_token_decode_bitwise() {
    let src = MemSource::random(&tiny_dims(), 1);
    let v = src.dims.vocab;
    let mut m = model(&src);
    let mut st = m.new_state(16);
    let all = m.forward(&PROMPT, &mut st, Logits::All).unwrap();
    assert_eq!(all.len(), PROMPT.len() * v);
    assert!(all.iter().all(|x| x.is_finite()));

    // One token at a time.
    let mut st1 = m.new_state(16);
    for (t, &id) in PROMPT.iter().enumerate() {
        let row = m.forward(&[id], &mut st1, Logits::Last).unwrap();
        assert_eq!(
            bits(&row),
            bits(&all[t * v..(t + 1) * v]),
            "position {t}: decode differs from prefill"
        );
    }
    // Prefill of T-2 then two single steps (conv history and caches carried, SPEC.md I12).
    let mut st2 = m.new_state(16);
    m.forward(&PROMPT[..5], &mut st2, Logits::Last).unwrap();
    m.forward(&PROMPT[5..6], &mut st2, Logits::Last).unwrap();
    let last = m.forward(&PROMPT[6..], &mut st2, Logits::Last).unwrap();
    assert_eq!(bits(&last), bits(&all[6 * v..]));
    assert_eq!(
        st1, st2,
        "carried state must not depend on how tokens were batched"
    );
}

#[test]
fn logits_do_not_depend_on_thread_count() {
    let src = MemSource::random(&tiny_dims(), 2);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut m = model(&src);
            let mut st = m.new_state(16);
            let mut out = m.forward(&PROMPT, &mut st, Logits::All).unwrap();
            out.extend(m.forward(&[7], &mut st, Logits::Last).unwrap());
            out
        })
    };
    assert_eq!(bits(&run(1)), bits(&run(2)));
}

#[test]
fn engine_asks_each_layer_once_prefetches_the_next_and_experts_once_per_layer() {
    let src = MemSource::random(&tiny_dims(), 3);
    let mut m = model(&src);
    m.trace = Some(Vec::new());
    let mut st = m.new_state(16);
    m.forward(&PROMPT, &mut st, Logits::Last).unwrap();
    let calls = src.calls.lock().unwrap().clone();
    let mut want = Vec::new();
    for l in 0..13 {
        want.push(('L', l));
        if l + 1 < 13 {
            want.push(('P', l + 1));
        }
    }
    assert_eq!(calls, want);
    let trace = m.trace.as_ref().unwrap();
    // One request per MoE layer (1..12) for the whole 7-token prefill; unique ascending ids.
    assert_eq!(
        trace.iter().map(|r| r.layer).collect::<Vec<_>>(),
        (1..13).collect::<Vec<u32>>()
    );
    for r in trace {
        assert!(r.experts.windows(2).all(|w| w[0] < w[1]), "{r:?}");
        assert!(r.experts.len() >= 2 && r.experts.len() <= 8);
    }
    assert_eq!(
        src.stats.lock().unwrap().expert_requests,
        trace.iter().map(|r| r.experts.len() as u64).sum::<u64>()
    );
}

#[test]
fn failed_expert_is_counted_and_the_run_completes() {
    let d = tiny_dims();
    let clean = MemSource::random(&d, 4);
    let mut m = model(&clean);
    m.trace = Some(Vec::new());
    let mut st = m.new_state(16);
    let good = m.forward(&PROMPT, &mut st, Logits::Last).unwrap();
    let victim = m.trace.as_ref().unwrap()[4].experts[0]; // layer 5's first requested expert
    assert_eq!(m.counters.failed_expert_loads, 0);

    let mut bad = MemSource::random(&d, 4);
    bad.fail.insert((5, victim));
    let mut m = model(&bad);
    let mut st = m.new_state(16);
    let out = m.forward(&PROMPT, &mut st, Logits::Last).unwrap();
    assert_eq!(m.counters.failed_expert_loads, 1);
    assert!(m.counters.failure_messages[0].contains(&format!("layer 5 expert {victim}")));
    assert_ne!(
        bits(&out),
        bits(&good),
        "the failed expert's contribution must be gone"
    );
    assert!(out.iter().all(|x| x.is_finite()));
}

fn bind_error(src: &MemSource) -> String {
    let mut m = model(src);
    let mut st = m.new_state(4);
    match m.forward(&[1], &mut st, Logits::Last) {
        Err(e @ ModelError::Bind { .. }) => e.to_string(),
        other => panic!("expected a bind error, got {other:?}"),
    }
}

#[test]
fn transposed_shape_in_the_index_is_a_bind_error_naming_the_tensor() {
    let mut src = MemSource::random(&tiny_dims(), 5);
    let name = layer_name(2, "self_attn.f_b_proj.weight");
    // Same element count (16 × 8 vs 8 × 16), so only a full-shape check catches it.
    src.set_meta(&name, k3_proto::Dtype::BF16, vec![8, 16]);
    let msg = bind_error(&src);
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("[16, 8]") && msg.contains("[8, 16]"), "{msg}");
}

#[test]
fn wrong_size_or_dtype_in_the_layer_layout_is_a_bind_error() {
    let mut src = MemSource::random(&tiny_dims(), 6);
    let name = layer_name(3, "self_attn.kv_b_proj.weight");
    src.set_loc(&name, k3_proto::Dtype::BF16, 2 * 32 * 15);
    let msg = bind_error(&src);
    assert!(
        msg.contains(&name) && msg.contains("found 960 bytes"),
        "{msg}"
    );

    let mut src = MemSource::random(&tiny_dims(), 6);
    let name = layer_name(1, "self_attn.dt_bias");
    // Vectors are accepted as BF16 or F32 (SPEC.md §2); any other dtype is refused.
    src.set_loc(&name, k3_proto::Dtype::F16, 2 * 16);
    let msg = bind_error(&src);
    assert!(
        msg.contains(&name) && msg.contains("expected dtype BF16 or F32, found F16"),
        "{msg}"
    );
}

#[test]
fn missing_model_tensor_or_wrong_vocab_is_refused_at_construction() {
    let src = MemSource::random(&tiny_dims(), 7);
    let mut d = tiny_dims();
    d.vocab = 96;
    let err = Model::new(d, &src, None).unwrap_err().to_string();
    assert!(
        err.contains("language_model.model.embed_tokens.weight"),
        "{err}"
    );
}

#[test]
fn token_outside_the_vocabulary_is_an_input_error() {
    let src = MemSource::random(&tiny_dims(), 8);
    let mut m = model(&src);
    let mut st = m.new_state(4);
    let err = m.forward(&[97], &mut st, Logits::Last).unwrap_err();
    assert!(matches!(err, ModelError::Input(_)), "{err}");
}

#[test]
fn layers_flag_binds_only_a_prefix() {
    let src = MemSource::random(&tiny_dims(), 9);
    let d = tiny_dims().truncated(5).unwrap();
    let mut m = Model::new(d, &src, Some(&src as &dyn TensorShapes)).unwrap();
    let mut st = m.new_state(8);
    m.forward(&PROMPT, &mut st, Logits::Last).unwrap();
    let calls = src.calls.lock().unwrap().clone();
    assert_eq!(calls.iter().filter(|c| c.0 == 'L').count(), 5);
    assert!(!calls.contains(&('P', 5)));
}

#[test]
fn documented_variants_bind_bf16_router_bias_and_a_log_per_head() {
    use k3_worker::model::bind::{Attn, BoundLayer, Mlp};
    let mut src = MemSource::random(&tiny_dims(), 10);
    // SPEC.md §10 C5: the router bias may be BF16.
    let bias = layer_name(1, "block_sparse_moe.gate.e_score_correction_bias");
    src.set_loc(&bias, k3_proto::Dtype::BF16, 16);
    src.set_meta(&bias, k3_proto::Dtype::BF16, vec![8]);
    let vals = [0.5f32, -0.25, 1.0, 2.0, -3.0, 0.125, 0.0, 7.0];
    src.set(&bias, &vals);
    // §10 C2: A_log declared [num_heads] (HF module) instead of the release's [head_dim].
    let alog = layer_name(1, "self_attn.A_log");
    let want_a = src.get(&alog)[..2].to_vec();
    src.set_loc(&alog, k3_proto::Dtype::F32, 8);
    src.set_meta(&alog, k3_proto::Dtype::F32, vec![2]);
    let d = tiny_dims();
    let run = k3_store::runtime::source::WeightSource::layer(&src, 1).unwrap();
    let bound = BoundLayer::bind(&d, &run, Some(&src as &dyn TensorShapes), false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Mlp::Moe(moe) = &lw.mlp else { panic!() };
    assert_eq!(moe.bias, vals);
    let Attn::Kda(kda) = &lw.attn else { panic!() };
    assert_eq!(kda.a_log, want_a);
    // A third A_log length is still refused.
    src.set_loc(&alog, k3_proto::Dtype::F32, 12);
    src.set_meta(&alog, k3_proto::Dtype::F32, vec![3]);
    let run = k3_store::runtime::source::WeightSource::layer(&src, 1).unwrap();
    let e = BoundLayer::bind(&d, &run, None, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("A_log") && e.contains("[8]") && e.contains("[2]"),
        "{e}"
    );
}

/// A source over [`MemSource`] with a cache of `cap` experts: it counts the expert regions alive
/// (held by the engine) and records, for every request, its layer, its size and how many were
/// alive when it was made.
struct Capped<'a> {
    inner: &'a MemSource,
    cap: usize,
    overlap: bool,
    live: Arc<AtomicUsize>,
    log: Mutex<Vec<(usize, usize, usize)>>,
}

struct Counted {
    bytes: Vec<u8>,
    live: Arc<AtomicUsize>,
}

impl ByteOwner for Counted {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl WeightSource for Capped<'_> {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.inner.model_tensor(name)
    }
    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        self.inner.layer(l)
    }
    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        let live = self.live.load(Ordering::SeqCst);
        self.log.lock().unwrap().push((l, ids.len(), live));
        assert!(ids.len() <= self.cap, "a request larger than the cache");
        let b = self.inner.experts(l, ids)?;
        let experts = b
            .experts
            .into_iter()
            .map(|r| {
                r.map(|region| {
                    self.live.fetch_add(1, Ordering::SeqCst);
                    let owner = Counted {
                        bytes: region.bytes().to_vec(),
                        live: self.live.clone(),
                    };
                    Region::whole(Arc::new(owner))
                })
            })
            .collect();
        Ok(ExpertBatch { experts })
    }
    fn max_expert_batch(&self) -> usize {
        self.cap
    }
    fn overlap_expert_groups(&self) -> bool {
        self.overlap
    }
    fn stats(&self) -> SourceStats {
        self.inner.stats()
    }
}

#[test]
fn expert_groups_overlap_within_the_cache_and_leave_the_logits_bitwise_unchanged() {
    let src = MemSource::random(&tiny_dims(), 5);
    let shapes = Some(&src as &dyn TensorShapes);
    let reference = {
        let mut m = model(&src);
        let mut st = m.new_state(16);
        m.forward(&PROMPT, &mut st, Logits::All).unwrap()
    };
    // (source allows overlap, the engine's switch) -> the request log.
    let run = |overlap: bool, engine: bool| {
        let cap = 4;
        let s = Capped {
            inner: &src,
            cap,
            overlap,
            live: Arc::new(AtomicUsize::new(0)),
            log: Mutex::new(Vec::new()),
        };
        let mut m = Model::new(src.dims.clone(), &s, shapes).unwrap();
        m.options.overlap_groups = engine;
        let mut st = m.new_state(16);
        let logits = m.forward(&PROMPT, &mut st, Logits::All).unwrap();
        assert_eq!(
            bits(&logits),
            bits(&reference),
            "grouping changed the logits (overlap {overlap}, engine {engine})"
        );
        drop(m);
        assert_eq!(s.live.load(Ordering::SeqCst), 0, "an expert region leaked");
        s.log.into_inner().unwrap()
    };
    // The 7-token prefill routes more than 4 distinct experts in some layers.
    let sequential = run(false, true);
    assert!(
        sequential.windows(2).any(|w| w[0].0 == w[1].0),
        "no layer needed two groups"
    );
    // Without overlap a group is requested only once the previous one is dropped.
    assert!(
        sequential.iter().all(|&(_, n, live)| n <= 4 && live == 0),
        "{sequential:?}"
    );
    assert_eq!(
        run(true, false),
        sequential,
        "K3_EXPERT_OVERLAP=off must not overlap"
    );
    // With overlap: a layer whose union exceeds the cache takes it in half-cache groups, the
    // next requested while the current one is held; never more alive than the cache holds.
    let overlapped = run(true, true);
    let split = |l: usize| overlapped.iter().filter(|r| r.0 == l).count() > 1;
    assert!(
        overlapped
            .iter()
            .all(|&(l, n, live)| live + n <= 4 && (!split(l) || n <= 2)),
        "{overlapped:?}"
    );
    assert!(
        overlapped.iter().any(|&(_, _, live)| live > 0),
        "{overlapped:?}"
    );
    let per_layer = |log: &[(usize, usize, usize)]| {
        let mut m = std::collections::BTreeMap::new();
        for &(l, n, _) in log {
            *m.entry(l).or_insert(0) += n;
        }
        m
    };
    assert_eq!(
        per_layer(&overlapped),
        per_layer(&sequential),
        "the same experts per layer"
    );
}

/// A source that streams: each layer run is a copy whose drop is logged, the experts answer in
/// groups of at most `cap`, and `releases_layers_early` says what the test asks.
struct Streamed<'a> {
    inner: &'a MemSource,
    frees: bool,
    cap: usize,
    /// ("run", layer) when a run is dropped; ("experts", layer) when experts are asked for.
    log: Arc<Mutex<Vec<(&'static str, usize)>>>,
}

struct LoggedRun {
    bytes: Vec<u8>,
    layer: usize,
    log: Arc<Mutex<Vec<(&'static str, usize)>>>,
}

impl ByteOwner for LoggedRun {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for LoggedRun {
    fn drop(&mut self) {
        self.log.lock().unwrap().push(("run", self.layer));
    }
}

impl WeightSource for Streamed<'_> {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.inner.model_tensor(name)
    }
    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        let run = self.inner.layer(l)?;
        let owner = LoggedRun {
            bytes: run.region.bytes().to_vec(),
            layer: l,
            log: self.log.clone(),
        };
        Ok(LayerRun {
            layer: l,
            region: Region::whole(Arc::new(owner)),
            layout: run.layout,
        })
    }
    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        self.log.lock().unwrap().push(("experts", l));
        self.inner.experts(l, ids)
    }
    fn max_expert_batch(&self) -> usize {
        self.cap
    }
    fn releases_layers_early(&self, _l: usize) -> bool {
        self.frees
    }
    fn stats(&self) -> SourceStats {
        self.inner.stats()
    }
}

#[test]
fn a_streamed_moe_layer_gives_its_run_back_before_the_expert_wait_with_the_same_logits() {
    let src = MemSource::random(&tiny_dims(), 5);
    let shapes = Some(&src as &dyn TensorShapes);
    let run = |frees: bool| {
        let s = Streamed {
            inner: &src,
            frees,
            cap: 4,
            log: Arc::new(Mutex::new(Vec::new())),
        };
        let mut m = Model::new(src.dims.clone(), &s, shapes).unwrap();
        m.options.overlap_groups = false;
        let mut st = m.new_state(16);
        let prefill = m.forward(&PROMPT, &mut st, Logits::All).unwrap();
        // The prefill's events: every run is dropped by the end of its pass.
        let log = std::mem::take(&mut *s.log.lock().unwrap());
        let decode = m.forward(&[7], &mut st, Logits::Last).unwrap();
        (bits(&prefill), bits(&decode), log)
    };
    let (p_keep, d_keep, keep) = run(false);
    let (p_free, d_free, free) = run(true);
    assert_eq!(
        p_free, p_keep,
        "giving the run back early changed the prefill"
    );
    assert_eq!(
        d_free, d_keep,
        "giving the run back early changed the decode step"
    );
    // Where a layer's experts come in two groups or more, the later groups are asked for after
    // the first group's wait: the run is gone by then when the source frees it on drop, and
    // still held when it does not.
    let dropped_before_second_group = |log: &[(&str, usize)], l: usize| {
        let asks: Vec<usize> = (0..log.len())
            .filter(|&i| log[i] == ("experts", l))
            .collect();
        let gone = log.iter().position(|&e| e == ("run", l));
        (asks.len() >= 2).then(|| gone.is_some_and(|g| g < asks[1]))
    };
    let layers = src.dims.n_layers;
    let split: Vec<usize> = (0..layers)
        .filter(|&l| dropped_before_second_group(&free, l).is_some())
        .collect();
    assert!(!split.is_empty(), "no layer needed two groups: {free:?}");
    for &l in &split {
        assert_eq!(
            dropped_before_second_group(&free, l),
            Some(true),
            "layer {l}: {free:?}"
        );
        assert_eq!(
            dropped_before_second_group(&keep, l),
            Some(false),
            "layer {l}: {keep:?}"
        );
    }
}

/// One pass over `rows`: each sequence's logits (the pass returns them one after another).
fn batch(
    m: &mut Model<'_>,
    rows: &mut [k3_worker::model::SeqRows<'_>],
    scratch: &mut k3_worker::model::Scratch,
) -> Vec<Vec<f32>> {
    let v = m.dims.vocab;
    let sizes: Vec<usize> = rows
        .iter()
        .map(|r| r.logits.rows(r.ids.len()) * v)
        .collect();
    let flat = m.forward_batch(rows, scratch).unwrap();
    assert_eq!(flat.len(), sizes.iter().sum::<usize>());
    let mut at = 0;
    (sizes.iter())
        .map(|&k| {
            at += k;
            flat[at - k..at].to_vec()
        })
        .collect()
}

/// A batched pass gives each sequence, bit for bit, the logits a pass of that sequence alone
/// gives — mixed prompt lengths, decode rows beside prefill rows, a chunk that asks for no
/// logits, a sequence joining later and one leaving — and leaves each state where its solo run
/// leaves it.
#[test]
fn batched_pass_gives_each_sequence_its_solo_logits_bitwise() {
    use k3_worker::model::{Scratch, SeqRows, SeqState};
    let src = MemSource::random(&tiny_dims(), 3);
    let v = src.dims.vocab;
    let mut m = model(&src);
    let prompts: [&[u32]; 3] = [&PROMPT, &[9, 1], &[77, 3, 12, 5, 5, 61, 2, 8, 30, 4]];
    // Each sequence alone: the prompt in one pass, then four single ids.
    let next = |i: usize, step: usize| ((i * 31 + step * 7) % v) as u32;
    let solo: Vec<Vec<Vec<u32>>> = (0..3)
        .map(|i| {
            let mut st = m.new_state(32);
            let mut out = vec![bits(&m.forward(prompts[i], &mut st, Logits::All).unwrap())];
            for step in 0..4 {
                out.push(bits(
                    &m.forward(&[next(i, step)], &mut st, Logits::Last).unwrap(),
                ));
            }
            out
        })
        .collect();
    let mut states: Vec<SeqState> = (0..3).map(|_| m.new_state(32)).collect();
    let mut scratch = Scratch::default();
    let [s0, s1, s2] = &mut states[..] else {
        unreachable!()
    };
    // Pass 1: sequence 0's whole prompt, sequence 1's whole prompt; 2 is not here yet.
    let got = batch(
        &mut m,
        &mut [
            SeqRows {
                ids: prompts[0],
                state: s0,
                logits: Logits::All,
            },
            SeqRows {
                ids: prompts[1],
                state: s1,
                logits: Logits::All,
            },
        ],
        &mut scratch,
    );
    assert_eq!(bits(&got[0]), solo[0][0]);
    assert_eq!(bits(&got[1]), solo[1][0]);
    // Pass 2: 0 and 1 decode; 2 joins with the first 6 ids of its prompt (no logits). Each
    // layer is asked for once and each MoE layer's experts once, for the three sequences.
    src.calls.lock().unwrap().clear();
    m.trace = Some(Vec::new());
    let got = batch(
        &mut m,
        &mut [
            SeqRows {
                ids: &[next(0, 0)],
                state: s0,
                logits: Logits::Last,
            },
            SeqRows {
                ids: &prompts[2][..6],
                state: s2,
                logits: Logits::None,
            },
            SeqRows {
                ids: &[next(1, 0)],
                state: s1,
                logits: Logits::Last,
            },
        ],
        &mut scratch,
    );
    assert_eq!((bits(&got[0]), got[1].len()), (solo[0][1].clone(), 0));
    assert_eq!(bits(&got[2]), solo[1][1]);
    let layers = src
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.0 == 'L')
        .count();
    assert_eq!(layers, 13);
    let trace = m.trace.take().unwrap();
    assert_eq!(
        trace.iter().map(|r| r.layer).collect::<Vec<_>>(),
        (1..13).collect::<Vec<u32>>()
    );
    // Pass 3: 2's prompt ends (all its rows' logits), 0 decodes; 1 sits this one out.
    let got = batch(
        &mut m,
        &mut [
            SeqRows {
                ids: &prompts[2][6..],
                state: s2,
                logits: Logits::All,
            },
            SeqRows {
                ids: &[next(0, 1)],
                state: s0,
                logits: Logits::Last,
            },
        ],
        &mut scratch,
    );
    assert_eq!(bits(&got[0]), solo[2][0][6 * v..]);
    assert_eq!(bits(&got[1]), solo[0][2]);
    // 0 leaves; 1 and 2 go on together to the end.
    for step in 1..4 {
        let got = batch(
            &mut m,
            &mut [
                SeqRows {
                    ids: &[next(2, step - 1)],
                    state: s2,
                    logits: Logits::Last,
                },
                SeqRows {
                    ids: &[next(1, step)],
                    state: s1,
                    logits: Logits::Last,
                },
            ],
            &mut scratch,
        );
        assert_eq!(bits(&got[0]), solo[2][step]);
        assert_eq!(bits(&got[1]), solo[1][step + 1]);
    }
    // The states equal the solo runs' at the same positions.
    let mut alone = m.new_state(32);
    m.forward(prompts[1], &mut alone, Logits::Last).unwrap();
    for step in 0..4 {
        m.forward(&[next(1, step)], &mut alone, Logits::Last)
            .unwrap();
    }
    assert!(
        *s1 == alone,
        "sequence 1's state differs from its solo run's"
    );
    // A batch of nothing, and an id outside the vocabulary, are refused.
    assert!(m.forward_batch(&mut [], &mut scratch).is_err());
    let bad = [v as u32];
    let e = m
        .forward_batch(
            &mut [SeqRows {
                ids: &bad,
                state: s0,
                logits: Logits::Last,
            }],
            &mut scratch,
        )
        .unwrap_err();
    assert!(matches!(e, ModelError::Input(_)), "{e}");
}
