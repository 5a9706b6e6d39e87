//! `k3-ctl pack-trunk <model_dir> <out_dir>`: write every layer's trunk into `trunk.bin` +
//! `trunk.json` (SPEC.md §6.1), EC-BF16 coded by default, raw, or — lossy, opt-in — int8/int4
//! quantized (`--codec`); with `--draft int8|int4`, write a quantized draft of it into
//! `draft.bin` + `draft.json` instead (SPEC.md §6.10, speculative decoding's draft model). Exit 2
//! when the checkpoint cannot be packed (a layer's trunk tensors are not one contiguous run in
//! one shard, or the checkpoint cannot be read with confidence), 1 on an I/O failure or when
//! interrupted (SIGINT, SIGTERM: the temporary files are removed; a second signal exits at once).

use std::path::PathBuf;

use k3_proto::exit;
use k3_proto::quant::QuantKind;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::draft::pack_draft;
use k3_store::runtime::plan::fmt_bytes;
use k3_store::runtime::trunk::{
    pack_trunk, Interrupt, PackOptions, PackSummary, TrunkCodec, TrunkError, AUTO_WIDTHS,
    DEFAULT_MAX_ESCAPE, DEFAULT_WIDTH,
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
    /// How trunk matrices are stored. Exact: `ecbf16`, the default (every BF16 weight matrix but
    /// `kv_b_proj` exponent-coded, losslessly, at 12 bits a weight where that is smaller than
    /// raw, SPEC.md §6.13; measured 0.75x the bytes and 0.52x the laptop-like decode time on
    /// k3slice, docs/BENCHMARKS.md), `raw` (the checkpoint's bytes); `ecbf16:W` codes with a
    /// `W`-bit index (2, 3 or 4), `ecbf16:auto` picks 3 or 4 per tensor. LOSSY, opt-in: `int8`
    /// (a scale per row) or `int4` (a scale per 32 columns) quantize every trunk weight matrix
    /// but the router and `kv_b_proj` (SPEC.md §6.15; the routed experts stay MXFP4 as always);
    /// every run on such a trunk is labelled lossy, with its measured quality
    /// (docs/BENCHMARKS.md, "Quality of the quantized trunk"). Not with --draft.
    #[arg(long, value_name = "ecbf16[:W|:auto]|raw|int8|int4", value_parser = parse_codec)]
    pub codec: Option<PackOptions>,
    /// With an EC-BF16 codec: the largest escape rate (fraction of a matrix's weights) a width
    /// may have; a matrix over it stays raw (escapes are exact, but slow the kernels).
    #[arg(long, value_name = "RATE", default_value_t = DEFAULT_MAX_ESCAPE)]
    pub max_escape: f64,
}

fn parse_codec(s: &str) -> Result<PackOptions, CodecArgError> {
    let (codec, widths) = match s.split_once(':') {
        None if s == "raw" => (TrunkCodec::Raw, vec![DEFAULT_WIDTH]),
        None if s == "int8" => (TrunkCodec::Int8, vec![DEFAULT_WIDTH]),
        None if s == "int4" => (TrunkCodec::Int4, vec![DEFAULT_WIDTH]),
        None if s == "ecbf16" => (TrunkCodec::Ecbf16, vec![DEFAULT_WIDTH]),
        Some(("ecbf16", "auto")) => (TrunkCodec::Ecbf16, AUTO_WIDTHS.to_vec()),
        Some(("ecbf16", w)) => match w.parse::<u8>() {
            Ok(w) if k3_proto::ecbf16::WIDTHS.contains(&w) => (TrunkCodec::Ecbf16, vec![w]),
            _ => return Err(CodecArgError(s.into())),
        },
        _ => return Err(CodecArgError(s.into())),
    };
    Ok(PackOptions {
        codec,
        widths,
        max_escape: DEFAULT_MAX_ESCAPE,
    })
}

/// A `--codec` value that is not one.
#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?} is not a codec: raw, ecbf16, ecbf16:2, ecbf16:3, ecbf16:4, ecbf16:auto, int8 or int4"
)]
pub struct CodecArgError(String);

/// Run the subcommand; returns the exit code.
pub fn run(a: Args) -> Result<i32, Failed> {
    if a.draft.is_some() && a.codec.is_some() {
        return Err(Failed::refused(
            "refusing: --codec applies to the packed trunk, not --draft",
        ));
    }
    if !(0.0..=1.0).contains(&a.max_escape) {
        return Err(Failed::refused(format!(
            "refusing: --max-escape {} is not a fraction in 0..1",
            a.max_escape
        )));
    }
    let mut opts = (a.codec.clone()).unwrap_or_else(|| PackOptions::new(TrunkCodec::Ecbf16));
    opts.max_escape = a.max_escape;
    let (cat, _cfg) =
        Catalog::open_dir(&a.model_dir).map_err(|e| Failed::because("refusing", e))?;
    let stop = Interrupt::on_signals()
        .map_err(|e| Failed::with_code("cannot handle SIGINT/SIGTERM", exit::FAILURE, e))?;
    let total: u64 = (0..cat.n_layers()).map(|l| cat.trunk_bytes(l)).sum();
    let what = match (a.draft, opts.codec) {
        (Some(k), _) => format!("an {} draft of", k.name()),
        (None, TrunkCodec::Raw) => "packing (raw)".into(),
        (None, TrunkCodec::Ecbf16) => format!("packing (ecbf16, index widths {:?})", opts.widths),
        (None, c) => format!(
            "packing (LOSSY: {} quantized weight matrices; the rest ecbf16 where smaller)",
            c.name()
        ),
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
        Some(kind) => pack_draft(&a.model_dir, &a.out_dir, kind, &stop, &mut |p| {
            bar.set(p.bytes_done)
        }),
        None => pack_trunk(&cat, &a.out_dir, &opts, &stop, &mut |p| {
            bar.set(p.bytes_done)
        }),
    };
    drop(bar);
    report(&a, opts.codec, total, r)
}

/// Print the outcome of a pack; its exit code.
fn report(
    a: &Args,
    codec: TrunkCodec,
    total: u64,
    r: Result<PackSummary, TrunkError>,
) -> Result<i32, Failed> {
    let file = if a.draft.is_some() {
        "draft.bin"
    } else {
        "trunk.bin"
    };
    let s = r.map_err(|e| {
        let what = if e.exit_code() == exit::REFUSED {
            "refusing"
        } else {
            "failed"
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
    if a.draft.is_none() && codec != TrunkCodec::Raw {
        let kinds: Vec<String> = (s.stored_as.iter())
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        println!(
            "{}: {} of the checkpoint's {} trunk bytes ({:.3}x); tensors: {}",
            codec.name(),
            s.bytes,
            total,
            s.bytes as f64 / total.max(1) as f64,
            kinds.join(", ")
        );
    }
    if let Some(kind) = codec.quant().filter(|_| a.draft.is_none()) {
        println!("{}", k3_proto::quant::lossy_label(kind));
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
