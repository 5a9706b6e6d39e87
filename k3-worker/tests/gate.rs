//! GATE: the engine against the independent float64 reference on the bundled tiny checkpoint
//! (`fixtures/tiny/model`, outputs in `fixtures/tiny/reference/`, from `scripts/k3_reference.py`).

use crate::common::{ckpt, gen};

use std::path::PathBuf;

use ckpt::CkptSource;
use k3_worker::engine::sampling::Sampler;
use k3_worker::model::{Dims, Logits, Model, TensorShapes};
use k3_worker::text::xtml::END_IDS;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn ids(name: &str) -> Vec<u32> {
    let p = root().join("fixtures/tiny/reference").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn open() -> CkptSource {
    CkptSource::open(&root().join("fixtures/tiny/model"))
}

fn model(src: &CkptSource) -> Model<'_> {
    let d = Dims::from_config(&src.config).unwrap();
    Model::new(d, src, Some(&src.index as &dyn TensorShapes)).unwrap()
}

fn argmax_rows(logits: &[f32], v: usize) -> Vec<u32> {
    logits
        .chunks_exact(v)
        .map(k3_worker::engine::sampling::argmax)
        .collect()
}

#[test]
fn teacher_forcing_32_of_32_positions() {
    let src = open();
    let full: Vec<u32> = [ids("prompt_ids.json"), ids("greedy_ids.json")].concat();
    let want = ids("teacher_forcing.json");
    assert_eq!(full.len(), 32);
    let mut m = model(&src);
    let mut st = m.new_state(full.len());
    let logits = m.forward(&full, &mut st, Logits::All).unwrap();
    let got = argmax_rows(&logits, m.dims.vocab);
    let agree = got.iter().zip(&want).filter(|(a, b)| a == b).count();
    assert_eq!(agree, 32, "teacher forcing: got {got:?}\nwant {want:?}");
}

fn gen(full_recompute: bool) -> (Vec<u32>, Vec<f32>) {
    let src = open();
    let m = model(&src);
    let g = gen::Gen {
        full_recompute,
        stop_ids: END_IDS.to_vec(),
        keep_step0_logits: true,
        ..gen::Gen::new(20, Sampler::Greedy)
    };
    let (r, m) = g.run(m, &ids("prompt_ids.json"), &mut |_| {});
    assert_eq!(m.counters.failed_expert_loads, 0);
    (r.generated_ids, r.step0_logits.unwrap())
}

#[test]
fn greedy_20_of_20_full_recompute() {
    let (got, _) = gen(true);
    assert_eq!(got, ids("greedy_ids.json"));
}

#[test]
fn incremental_20_of_20() {
    let (got, _) = gen(false);
    assert_eq!(got, ids("greedy_ids.json"));
}

#[test]
fn step0_logits_within_1e4_of_the_reference() {
    let (_, logits) = gen(false);
    let raw = std::fs::read(root().join("fixtures/tiny/reference/logits_step0.f32")).unwrap();
    let want: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(logits.len(), want.len());
    let num = logits
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let den = want.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    eprintln!(
        "step-0 logits: max|Δ| = {num:e}, max|ref| = {den}, ratio {:e}",
        num / den
    );
    assert!(num / den <= 1e-4, "max|Δ|/max|ref| = {}", num / den);
}
