//! `k3-ctl census MODEL`: what the EC-BF16 code (SPEC.md §6.13) would make of a checkpoint's
//! trunk, measured on its bytes, written nowhere.
//!
//! Every trunk tensor of every layer is read once (streamed from the shards, 64 MiB at a time);
//! each 2-D BF16 matrix gets its high-byte census: entropy, the palettes of widths 2, 3 and 4,
//! their escape rates and exact coded sizes, and the size of a canonical Huffman code of the
//! high bytes (the entropy-code alternative: the low byte raw plus a Huffman-coded high byte).
//! Other tensors (vectors, F32) count at their raw size. Totals per tensor class (the name
//! without its layer number) and for the whole trunk compare each policy with the raw trunk:
//! width 4 everywhere, width 3 where its escapes stay under `--max-escape`, the smallest width
//! under that cap, and raw for a tensor no width helps.
//!
//! `--shapes-only` reports sizes without reading data (a sparse `skeleton-full` checkpoint has
//! none to read). Exit 2 when the checkpoint cannot be opened, 1 on a read failure.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use k3_proto::ecbf16::{
    choose_codec, encoded_len, huffman_lengths, HighBytes, TensorCodec, WIDTHS,
};
use k3_proto::exit;
use k3_proto::safetensors::CheckpointIndex;
use k3_proto::Dtype;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::plan::fmt_bytes;
use serde_json::{json, Value};

use crate::fail::Failed;

/// Arguments of `k3-ctl census`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, model.safetensors.index.json).
    pub model_dir: PathBuf,
    /// Largest escape rate a width may have to be chosen for a tensor (fraction of its weights).
    #[arg(long, value_name = "RATE", default_value_t = 0.01)]
    pub max_escape: f64,
    /// Sizes from the shapes only, no data read (for sparse checkpoints without data).
    #[arg(long)]
    pub shapes_only: bool,
    /// Print one line per tensor, not only per class.
    #[arg(long)]
    pub tensors: bool,
    /// Write the whole census (every tensor) as JSON here.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// Bytes read per `pread`.
const CHUNK: u64 = 64 << 20;

/// One trunk tensor's census.
struct Entry {
    name: String,
    class: String,
    layer: usize,
    shape: Vec<u64>,
    raw: u64,
    /// A 2-D BF16 matrix (what EC-BF16 codes).
    candidate: bool,
    /// Its high-byte counts (`None`: not a candidate, or not read).
    hist: Option<HighBytes>,
}

/// Bits of the high bytes under their Huffman code.
fn huffman_bits(h: &HighBytes) -> u64 {
    let l = huffman_lengths(&h.0);
    h.0.iter().zip(l.iter()).map(|(&c, &b)| c * b as u64).sum()
}

/// The class of a trunk tensor: its name without the `layers.N.` prefix.
fn class_of(name: &str) -> String {
    match name.find("layers.") {
        Some(i) => {
            let rest = &name[i + 7..];
            rest.split_once('.').map_or(rest, |(_, r)| r).to_string()
        }
        None => name.to_string(),
    }
}

/// Run the subcommand; returns the exit code.
pub fn run(a: Args) -> Result<i32, Failed> {
    if !(0.0..=1.0).contains(&a.max_escape) {
        return Err(Failed::refused(format!(
            "--max-escape {} is not a fraction in [0, 1]",
            a.max_escape
        )));
    }
    let (cat, _cfg) =
        Catalog::open_dir(&a.model_dir).map_err(|e| Failed::because("refusing", e))?;
    let index = CheckpointIndex::open(&a.model_dir)
        .map_err(|e| Failed::with_code("refusing", exit::REFUSED, e))?;
    let mut files: Vec<Option<File>> = (0..cat.shard_paths().len()).map(|_| None).collect();
    let mut entries = Vec::new();
    let mut buf = vec![0u8; CHUNK as usize];
    let total: u64 = (0..cat.n_layers()).map(|l| cat.trunk_bytes(l)).sum();
    let mut bar = k3_store::progress::Progress::new("census of the trunk", total, true);
    let mut done = 0u64;
    for l in 0..cat.n_layers() {
        for t in cat.trunk(l) {
            let shape: Vec<u64> = index
                .get(&t.name)
                .map(|i| i.shape().to_vec())
                .unwrap_or_default();
            let candidate = t.dtype == Dtype::BF16 && shape.len() == 2;
            let mut hist = None;
            if candidate && !a.shapes_only {
                let f = match &mut files[t.shard as usize] {
                    Some(f) => f,
                    slot => {
                        let path = &cat.shard_paths()[t.shard as usize];
                        let f = File::open(path).map_err(|e| {
                            Failed::with_code(path.display().to_string(), exit::FAILURE, e)
                        })?;
                        slot.insert(f)
                    }
                };
                let mut h = HighBytes::default();
                let mut at = 0u64;
                while at < t.nbytes {
                    let n = CHUNK.min(t.nbytes - at) as usize;
                    f.read_exact_at(&mut buf[..n], t.off + at).map_err(|e| {
                        Failed::with_code(format!("reading {}", t.name), exit::FAILURE, e)
                    })?;
                    h.add(&buf[..n]);
                    at += n as u64;
                }
                hist = Some(h);
            }
            done += t.nbytes;
            bar.set(done);
            entries.push(Entry {
                name: t.name.clone(),
                class: class_of(&t.name),
                layer: l,
                shape,
                raw: t.nbytes,
                candidate,
                hist,
            });
        }
    }
    drop(bar);
    report(&a, &entries)
}

/// Sizes of one entry under each policy: (w4, w3-or-w4, best under the cap, Huffman, raw).
#[derive(Clone, Copy, Default)]
struct Sizes {
    raw: u64,
    w: [u64; 3],
    w3_else_4: u64,
    best: u64,
    huffman: u64,
    weights: u64,
    escapes: [u64; 3],
}

impl std::ops::AddAssign for Sizes {
    fn add_assign(&mut self, o: Sizes) {
        self.raw += o.raw;
        for i in 0..3 {
            self.w[i] += o.w[i];
            self.escapes[i] += o.escapes[i];
        }
        self.w3_else_4 += o.w3_else_4;
        self.best += o.best;
        self.huffman += o.huffman;
        self.weights += o.weights;
    }
}

fn sizes(e: &Entry, max_escape: f64) -> Sizes {
    let mut s = Sizes {
        raw: e.raw,
        w: [e.raw; 3],
        w3_else_4: e.raw,
        best: e.raw,
        huffman: e.raw,
        ..Sizes::default()
    };
    if !e.candidate {
        return s;
    }
    let (rows, cols) = (e.shape[0] as usize, e.shape[1] as usize);
    let Some(h) = &e.hist else {
        // Shapes only: each width's size with no escapes (a lower bound); the policies take
        // width 4, the entropy code is unknown (raw).
        for (i, &w) in WIDTHS.iter().enumerate() {
            s.w[i] = encoded_len(rows, cols, w, 0) as u64;
        }
        s.w3_else_4 = s.w[2];
        s.best = s.w[2];
        s.weights = (rows * cols) as u64;
        return s;
    };
    s.weights = h.total();
    for (i, &w) in WIDTHS.iter().enumerate() {
        s.escapes[i] = h.escapes(w);
        s.w[i] = encoded_len(rows, cols, w, s.escapes[i] as usize) as u64;
    }
    let rate3 = s.escapes[1] as f64 / s.weights.max(1) as f64;
    s.w3_else_4 = if rate3 <= max_escape { s.w[1] } else { s.w[2] };
    s.best = choose_codec(h, rows, cols, &WIDTHS, max_escape).1 as u64;
    // Low bytes raw + Huffman-coded high bytes + a 256-entry length table.
    s.huffman = s.weights + huffman_bits(h).div_ceil(8) + 256;
    s
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b.max(1) as f64
}

/// One coded tensor's record (and its line with `--tensors`).
fn tensor_json(a: &Args, e: &Entry, h: &HighBytes, s: &Sizes) -> Value {
    let (rows, cols) = (e.shape[0] as usize, e.shape[1] as usize);
    let chosen = match choose_codec(h, rows, cols, &WIDTHS, a.max_escape).0 {
        TensorCodec::Raw => "raw".to_string(),
        TensorCodec::Coded(w) => format!("w{w}"),
    };
    let widths: Vec<Value> = WIDTHS
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            json!({"width": w, "palette": h.palette(w), "escapes": s.escapes[i],
                   "escape_rate": ratio(s.escapes[i], s.weights), "bytes": s.w[i],
                   "bits_per_weight": 8.0 * s.w[i] as f64 / s.weights.max(1) as f64})
        })
        .collect();
    if a.tensors {
        println!(
            "{:<72} [{rows}, {cols}] H={:.2} bits, escapes w4 {:.4}% w3 {:.3}% w2 {:.2}%, chosen {chosen}",
            e.name,
            h.entropy_bits(),
            100.0 * ratio(s.escapes[2], s.weights),
            100.0 * ratio(s.escapes[1], s.weights),
            100.0 * ratio(s.escapes[0], s.weights),
        );
    }
    json!({
        "name": e.name, "layer": e.layer, "shape": e.shape, "raw_bytes": e.raw,
        "high_byte_entropy_bits": h.entropy_bits(),
        "distinct_high_bytes": h.0.iter().filter(|&&c| c > 0).count(),
        "widths": widths, "huffman_bytes": s.huffman, "chosen": chosen,
    })
}

/// One class's line of the table, and its record.
fn class_line(class: &str, s: &Sizes, es: &[&Entry]) -> Value {
    let mut h = HighBytes::default();
    es.iter()
        .filter_map(|e| e.hist.as_ref())
        .for_each(|x| h.merge(x));
    let esc = |i: usize| 100.0 * ratio(s.escapes[i], s.weights);
    println!(
        "{:<58} {:>10} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>8.3} {:>9.4} {:>9.3} {:>9.2}",
        class,
        fmt_bytes(s.raw),
        ratio(s.w[2], s.raw),
        ratio(s.w3_else_4, s.raw),
        ratio(s.best, s.raw),
        ratio(s.huffman, s.raw),
        h.entropy_bits(),
        esc(2),
        esc(1),
        esc(0)
    );
    json!({
        "class": class, "tensors": es.len(), "raw_bytes": s.raw, "weights": s.weights,
        "w4_bytes": s.w[2], "w3_bytes": s.w[1], "w2_bytes": s.w[0],
        "w3_else_w4_bytes": s.w3_else_4, "best_bytes": s.best, "huffman_bytes": s.huffman,
        "escape_rate": {"w4": ratio(s.escapes[2], s.weights), "w3": ratio(s.escapes[1], s.weights),
                        "w2": ratio(s.escapes[0], s.weights)},
        "high_byte_entropy_bits": h.entropy_bits(),
    })
}

fn report(a: &Args, entries: &[Entry]) -> Result<i32, Failed> {
    let mut by_class: BTreeMap<&str, (Sizes, Vec<&Entry>)> = BTreeMap::new();
    let mut total = Sizes::default();
    let mut tensors_json = Vec::new();
    for e in entries {
        let s = sizes(e, a.max_escape);
        total += s;
        let c = by_class.entry(&e.class).or_default();
        c.0 += s;
        c.1.push(e);
        if let Some(h) = &e.hist {
            tensors_json.push(tensor_json(a, e, h, &s));
        }
    }
    let read = !a.shapes_only;
    println!(
        "trunk of {}: {} tensors, {} raw ({} in 2-D BF16 matrices){}",
        a.model_dir.display(),
        entries.len(),
        fmt_bytes(total.raw),
        fmt_bytes(
            entries
                .iter()
                .filter(|e| e.shape.len() == 2)
                .map(|e| e.raw)
                .sum()
        ),
        if read {
            ""
        } else {
            " — SHAPES ONLY, no data read: coded sizes assume no escapes (lower bounds); escapes, entropy and Huffman unknown"
        }
    );
    println!(
        "{:<58} {:>10} {:>7} {:>7} {:>7} {:>7} {:>8} {:>9} {:>9} {:>9}",
        "class",
        "raw",
        "w4",
        "w3|w4",
        "best",
        "huff",
        "H(high)",
        "esc w4 %",
        "esc w3 %",
        "esc w2 %"
    );
    let classes_json: Vec<Value> = (by_class.iter())
        .map(|(class, (s, es))| class_line(class, s, es))
        .collect();
    println!(
        "TOTAL trunk: raw {} · width 4 {:.4}× · width 3 where escapes ≤ {:.2}% else 4 {:.4}× · best {:.4}× · Huffman high byte {:.4}×",
        fmt_bytes(total.raw),
        ratio(total.w[2], total.raw),
        100.0 * a.max_escape,
        ratio(total.w3_else_4, total.raw),
        ratio(total.best, total.raw),
        ratio(total.huffman, total.raw)
    );
    if let Some(path) = &a.json {
        let doc = json!({
            "model_dir": a.model_dir.display().to_string(),
            "shapes_only": a.shapes_only,
            "max_escape": a.max_escape,
            "total": {"raw_bytes": total.raw, "w4_bytes": total.w[2], "w3_bytes": total.w[1],
                      "w2_bytes": total.w[0], "w3_else_w4_bytes": total.w3_else_4,
                      "best_bytes": total.best, "huffman_bytes": total.huffman,
                      "weights_coded": total.weights},
            "classes": classes_json,
            "tensors": tensors_json,
        });
        let text = serde_json::to_string_pretty(&doc).expect("JSON of plain values");
        std::fs::write(path, text).map_err(|e| {
            Failed::with_code(format!("cannot write {}", path.display()), exit::FAILURE, e)
        })?;
        println!("wrote {}", path.display());
    }
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_drops_the_layer_number() {
        assert_eq!(
            class_of("language_model.model.layers.12.self_attn.q_proj.weight"),
            "self_attn.q_proj.weight"
        );
        assert_eq!(class_of("lm_head.weight"), "lm_head.weight");
    }

    #[test]
    fn missing_checkpoint_is_a_refusal() {
        let code = exit::report(
            "k3-ctl census",
            run(Args {
                model_dir: PathBuf::from("/nonexistent/k3-model"),
                max_escape: 0.01,
                shapes_only: false,
                tensors: false,
                json: None,
            }),
        );
        assert_eq!(code, exit::REFUSED);
    }
}
