//! `k3-ctl pack-trunk <model_dir> <out_dir>`: copy every layer's trunk run into `trunk.bin` +
//! `trunk.json` (SPEC.md §6.1); with `--draft int8|int4`, write a quantized draft of it into
//! `draft.bin` + `draft.json` instead (SPEC.md §6.10, speculative decoding's draft model). Exit 2 when the checkpoint cannot be packed (a layer's trunk
//! tensors are not one contiguous run in one shard, or the checkpoint cannot be read with
//! confidence), 1 on an I/O failure.

use std::path::PathBuf;

use k3_proto::exit;
use k3_proto::quant::QuantKind;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::draft::pack_draft;
use k3_store::runtime::plan::fmt_bytes;
use k3_store::runtime::trunk::{
    pack_trunk, pack_trunk_coded, TrunkError, AUTO_WIDTHS, DEFAULT_MAX_ESCAPE, DEFAULT_WIDTH,
};

use crate::fail::Failed;
use k3_proto::exit::ExitStatus;

/// Arguments of `k3-ctl pack-trunk`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, model.safetensors.index.json).
    pub model_dir: PathBuf,
    /// Output directory for trunk.bin and trunk.json (draft.bin and draft.json with --draft).
    pub out_dir: PathBuf,
    /// Write a quantized draft trunk (int8: a scale per row; int4: a scale per 32 columns) for
    /// `k3-worker --draft model --draft-trunk OUT_DIR`, not a packed copy.
    #[arg(long, value_name = "int8|int4")]
    pub draft: Option<QuantKind>,
    /// How trunk matrices are stored: `ecbf16`, the default (every BF16 weight matrix but
    /// `kv_b_proj` exponent-coded, losslessly, at 12 bits a weight where that is smaller than
    /// raw: trunk format 4, SPEC.md §6.1 and §6.13; measured 0.75x the bytes and 0.52x the
    /// laptop-like decode time on k3slice, docs/BENCHMARKS.md), `raw` (the checkpoint's bytes,
    /// trunk format 3); `ecbf16:W` codes with a `W`-bit index (2, 3 or 4), `ecbf16:auto` picks 3
    /// or 4 per tensor (the smaller whose escapes stay under --max-escape). Not with --draft.
    #[arg(long, value_name = "ecbf16[:W|:auto]|raw", value_parser = parse_codec)]
    pub codec: Option<Codec>,
    /// With `--codec ecbf16`: the largest escape rate (fraction of a matrix's weights) a width
    /// may have; a matrix over it stays raw (escapes are exact, but slow the kernels).
    #[arg(long, value_name = "RATE", default_value_t = DEFAULT_MAX_ESCAPE)]
    pub max_escape: f64,
}

/// What `--codec` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Codec {
    /// The checkpoint's bytes.
    Raw,
    /// EC-BF16, the smallest of these index widths per tensor.
    EcBf16(Vec<u8>),
}

fn parse_codec(s: &str) -> Result<Codec, CodecArgError> {
    let widths = match s.split_once(':') {
        None if s == "raw" => return Ok(Codec::Raw),
        None if s == "ecbf16" => vec![DEFAULT_WIDTH],
        Some(("ecbf16", "auto")) => AUTO_WIDTHS.to_vec(),
        Some(("ecbf16", w)) => match w.parse::<u8>() {
            Ok(w) if k3_proto::ecbf16::WIDTHS.contains(&w) => vec![w],
            _ => return Err(CodecArgError(s.into())),
        },
        _ => return Err(CodecArgError(s.into())),
    };
    Ok(Codec::EcBf16(widths))
}

/// A `--codec` value that is not one.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a codec: raw, ecbf16, ecbf16:2, ecbf16:3, ecbf16:4 or ecbf16:auto")]
pub struct CodecArgError(String);

/// Run the subcommand; returns the exit code.
pub fn run(a: Args) -> Result<i32, Failed> {
    if a.draft.is_some() && a.codec.is_some() {
        return Err(Failed::refused(
            "refusing: --codec applies to the packed trunk, not --draft",
        ));
    }
    let codec = match (&a.draft, a.codec.clone()) {
        (Some(_), _) => Codec::Raw,
        (None, Some(c)) => c,
        (None, None) => Codec::EcBf16(vec![DEFAULT_WIDTH]),
    };
    if !(0.0..=1.0).contains(&a.max_escape) {
        return Err(Failed::refused(format!(
            "refusing: --max-escape {} is not a fraction in 0..1",
            a.max_escape
        )));
    }
    let (cat, _cfg) =
        Catalog::open_dir(&a.model_dir).map_err(|e| Failed::because("refusing", e))?;
    let total: u64 = (0..cat.n_layers()).map(|l| cat.trunk_bytes(l)).sum();
    let what = match (a.draft, &codec) {
        (Some(k), _) => format!("an {} draft of", k.name()),
        (None, Codec::Raw) => "packing".into(),
        (None, Codec::EcBf16(w)) => format!("packing (ecbf16, index widths {w:?})"),
    };
    eprintln!(
        "{what} {} layers ({}) from {} into {}",
        cat.n_layers(),
        fmt_bytes(total),
        a.model_dir.display(),
        a.out_dir.display()
    );
    // A bar on a terminal, one log line per tenth otherwise (k3_store::progress).
    let label = if a.draft.is_some() {
        "quantizing the trunk"
    } else {
        "packing the trunk"
    };
    let mut bar = k3_store::progress::Progress::new(label, total, true);
    let r = match a.draft {
        Some(kind) => pack_draft(&a.model_dir, &a.out_dir, kind, &mut |p| {
            bar.set(p.bytes_done)
        }),
        None if codec != Codec::Raw => {
            let widths = match &codec {
                Codec::EcBf16(w) => &w[..],
                Codec::Raw => &[],
            };
            match k3_proto::safetensors::CheckpointIndex::open(&a.model_dir) {
                Ok(index) => {
                    pack_trunk_coded(&cat, &index, &a.out_dir, widths, a.max_escape, &mut |p| {
                        bar.set(p.bytes_done)
                    })
                }
                Err(e) => Err(TrunkError::Refused(format!(
                    "checkpoint index {}: {e}",
                    a.model_dir.display()
                ))),
            }
        }
        None => pack_trunk(&cat, &a.out_dir, &mut |p| bar.set(p.bytes_done)),
    };
    drop(bar);
    let file = if a.draft.is_some() {
        "draft.bin"
    } else {
        "trunk.bin"
    };
    let s = r.map_err(|e| {
        let what = if e.exit_code() == exit::REFUSED {
            "refusing"
        } else {
            "I/O failure"
        };
        Failed::because(what, e)
    })?;
    println!(
        "packed {} layers, {} bytes ({}), {file} {} bytes, largest run {}, {:.2} s",
        s.layers,
        s.bytes,
        fmt_bytes(s.bytes),
        s.file_bytes,
        fmt_bytes(s.largest_run),
        s.seconds
    );
    if a.draft.is_none() && codec != Codec::Raw {
        println!(
            "coded: {} of the checkpoint's {} trunk bytes ({:.3}x)",
            s.bytes,
            total,
            s.bytes as f64 / total.max(1) as f64
        );
    }
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_checkpoint_is_a_refusal() {
        let code = exit::report(
            "k3-ctl pack-trunk",
            run(Args {
                model_dir: PathBuf::from("/nonexistent/k3-model"),
                out_dir: std::env::temp_dir().join("k3-pack-never-written"),
                draft: None,
                codec: None,
                max_escape: DEFAULT_MAX_ESCAPE,
            }),
        );
        assert_eq!(code, exit::REFUSED);
        assert!(!std::env::temp_dir().join("k3-pack-never-written").exists());
    }
}
