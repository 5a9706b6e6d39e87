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
use k3_store::runtime::trunk::{pack_trunk, TrunkError};

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
}

/// Run the subcommand; returns the exit code.
pub fn run(a: Args) -> i32 {
    let (cat, _cfg) = match Catalog::open_dir(&a.model_dir) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("k3-ctl pack-trunk: refusing: {e}");
            return exit::REFUSED;
        }
    };
    let total: u64 = (0..cat.n_layers()).map(|l| cat.trunk_bytes(l)).sum();
    let what = match a.draft {
        Some(k) => format!("an {} draft of", k.name()),
        None => "packing".into(),
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
        None => pack_trunk(&cat, &a.out_dir, &mut |p| bar.set(p.bytes_done)),
    };
    drop(bar);
    let file = if a.draft.is_some() {
        "draft.bin"
    } else {
        "trunk.bin"
    };
    match r {
        Ok(s) => {
            println!(
                "packed {} layers, {} bytes ({}), {file} {} bytes, largest run {}, {:.2} s",
                s.layers,
                s.bytes,
                fmt_bytes(s.bytes),
                s.file_bytes,
                fmt_bytes(s.largest_run),
                s.seconds
            );
            exit::OK
        }
        Err(TrunkError::Refused(m)) => {
            eprintln!("k3-ctl pack-trunk: refusing: {m}");
            exit::REFUSED
        }
        Err(TrunkError::Io(m)) => {
            eprintln!("k3-ctl pack-trunk: I/O failure: {m}");
            exit::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_checkpoint_is_a_refusal() {
        let code = run(Args {
            model_dir: PathBuf::from("/nonexistent/k3-model"),
            out_dir: std::env::temp_dir().join("k3-pack-never-written"),
            draft: None,
        });
        assert_eq!(code, exit::REFUSED);
        assert!(!std::env::temp_dir().join("k3-pack-never-written").exists());
    }
}
