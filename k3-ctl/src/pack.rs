//! `k3-ctl pack-trunk <model_dir> <out_dir>`: copy every layer's trunk run into `trunk.bin` +
//! `trunk.json` (SPEC.md §6.1). Exit 2 when the checkpoint cannot be packed (a layer's trunk
//! tensors are not one contiguous run in one shard, or the checkpoint cannot be read with
//! confidence), 1 on an I/O failure.

use std::path::PathBuf;

use k3_proto::exit;
use k3_store::catalog::Catalog;
use k3_store::plan::fmt_bytes;
use k3_store::trunk::{pack_trunk, TrunkError};

/// Arguments of `k3-ctl pack-trunk`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, model.safetensors.index.json).
    pub model_dir: PathBuf,
    /// Output directory for trunk.bin and trunk.json.
    pub out_dir: PathBuf,
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
    eprintln!(
        "packing {} layers ({}) from {} into {}",
        cat.n_layers(),
        fmt_bytes(total),
        a.model_dir.display(),
        a.out_dir.display()
    );
    // A bar on a terminal, one log line per tenth otherwise (k3_store::progress).
    let mut bar = k3_store::progress::Progress::new("packing the trunk", total, true);
    let r = pack_trunk(&cat, &a.out_dir, &mut |p| bar.set(p.bytes_done));
    drop(bar);
    match r {
        Ok(s) => {
            println!(
                "packed {} layers, {} bytes ({}), trunk.bin {} bytes, largest run {}, {:.2} s",
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
        });
        assert_eq!(code, exit::REFUSED);
        assert!(!std::env::temp_dir().join("k3-pack-never-written").exists());
    }
}
