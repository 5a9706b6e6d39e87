//! `k3-ctl verify MODEL [--trunk T] [--json]`: check every byte.
//!
//! The checkpoint: every shard has the size its index recorded and reads end to end, and every
//! tensor the engine uses (model-level, trunk, routed experts) lies inside its shard. The packed
//! trunk, when given: it opens (format, checkpoint identity, run layout: the checks of
//! `TrunkLayout::from_packed`), and every layer's run in `trunk.bin` and in the checkpoint
//! hashes (XXH3-64) to the checksum `trunk.json` records. Prints one OK/BAD line per shard and per
//! layer (or a JSON report); exit 0 when everything is good, 2 on any mismatch or refusal.

use std::path::{Path, PathBuf};

use k3_proto::exit;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::io::{AlignedBuf, DiskFile};
use k3_store::runtime::plan::fmt_bytes;
use k3_store::runtime::trunk::{open_shards, TrunkLayout};
use serde_json::{json, Value};

/// Arguments of `k3-ctl verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, model.safetensors.index.json).
    pub model_dir: PathBuf,
    /// Packed trunk directory (trunk.bin + trunk.json) to check against the checkpoint.
    #[arg(long)]
    pub trunk: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Read chunk for the shards.
const CHUNK: u64 = 64 << 20;

/// Progress on stderr: a bar on a terminal, a line at each tenth otherwise.
struct Progress {
    done: u64,
    bar: k3_store::progress::Progress,
}

impl Progress {
    fn add(&mut self, n: u64) {
        self.done += n;
        self.bar.set(self.done);
    }
}

/// Read `f` end to end; the bytes read.
fn read_whole(f: &DiskFile, buf: &mut AlignedBuf, p: &mut Progress) -> Result<u64, String> {
    let len = f.len();
    let mut at = 0u64;
    while at < len {
        let take = (len - at).min(CHUNK);
        f.read_span(at, take, buf.as_mut_slice()).map_err(|e| e.0)?;
        at += take;
        p.add(take);
    }
    Ok(at)
}

/// Every tensor extent of the catalog that does not lie inside its shard as it is on disk now.
fn tensors_outside(cat: &Catalog, lens: &[Option<u64>]) -> (usize, Vec<String>) {
    let mut n = 0usize;
    let mut bad = Vec::new();
    let mut check = |what: &str, shard: u16, off: u64, nbytes: u64| {
        n += 1;
        let len = lens.get(shard as usize).copied().flatten();
        let inside = len.is_some_and(|len| off.checked_add(nbytes).is_some_and(|e| e <= len));
        if !inside {
            bad.push(format!(
                "{what}: bytes {off}..+{nbytes} lie outside shard {shard} ({})",
                len.map(|l| format!("{l} bytes"))
                    .unwrap_or_else(|| "unreadable".into())
            ));
        }
    };
    for t in cat.model_tensors() {
        check(&t.name, t.shard, t.off, t.nbytes);
    }
    for l in 0..cat.n_layers() {
        for t in cat.trunk(l) {
            check(&t.name, t.shard, t.off, t.nbytes);
        }
        for e in 0..cat.n_experts() {
            if let Some(x) = cat.expert(l, e) {
                for (i, p) in x.parts.iter().enumerate() {
                    check(
                        &format!("layer {l} expert {e} part {i}"),
                        p.shard,
                        p.off,
                        p.nbytes,
                    );
                }
            }
        }
    }
    (n, bad)
}

/// Run the subcommand; returns the exit code.
pub fn run(a: Args) -> i32 {
    let (cat, _cfg) = match Catalog::open_dir(&a.model_dir) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("k3-ctl verify: refusing: {e}");
            return exit::REFUSED;
        }
    };
    let mut ok = true;
    let mut text = Vec::new();
    let say = |text: &mut Vec<String>, line: String| {
        if !a.json {
            println!("{line}");
        }
        text.push(line);
    };

    // What will be read, for the progress lines.
    let shard_bytes: u64 = cat.shard_lens().iter().sum();
    let trunk_bytes: u64 = (0..cat.n_layers()).map(|l| cat.trunk_bytes(l)).sum();
    let total = shard_bytes
        + if a.trunk.is_some() {
            2 * trunk_bytes
        } else {
            0
        };
    let mut p = Progress {
        done: 0,
        bar: k3_store::progress::Progress::new("verifying", total, true),
    };
    eprintln!(
        "verifying {} ({} shards, {}){}: reading {}",
        a.model_dir.display(),
        cat.shard_paths().len(),
        fmt_bytes(shard_bytes),
        a.trunk
            .as_ref()
            .map(|t| format!(" and the trunk {}", t.display()))
            .unwrap_or_default(),
        fmt_bytes(total)
    );

    // 1. The shards, end to end.
    let mut buf = match AlignedBuf::zeroed(CHUNK as usize + 2 * k3_store::runtime::io::ALIGN) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("k3-ctl verify: {e}");
            return exit::FAILURE;
        }
    };
    say(
        &mut text,
        format!(
            "checkpoint {}: {} shards",
            a.model_dir.display(),
            cat.shard_paths().len()
        ),
    );
    let mut shards_json = Vec::new();
    let mut lens = Vec::new();
    for (path, &want) in cat.shard_paths().iter().zip(cat.shard_lens()) {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        let f = DiskFile::open(path).map_err(|e| e.0);
        lens.push(f.as_ref().ok().map(DiskFile::len));
        let r = f.and_then(|f| {
            if f.len() != want {
                return Err(format!(
                    "{} bytes, the index recorded {want} (truncated or replaced)",
                    f.len()
                ));
            }
            read_whole(&f, &mut buf, &mut p)
        });
        match &r {
            Ok(n) => say(&mut text, format!("  shard {name}: OK ({n} bytes read)")),
            Err(e) => {
                ok = false;
                say(&mut text, format!("  shard {name}: BAD: {e}"));
            }
        }
        shards_json.push(json!({
            "shard": name,
            "ok": r.is_ok(),
            "bytes": want,
            "error": r.err(),
        }));
    }
    let (n_tensors, outside) = tensors_outside(&cat, &lens);
    if outside.is_empty() {
        say(
            &mut text,
            format!("  tensors: OK ({n_tensors} lie inside their shards)"),
        );
    } else {
        ok = false;
        for m in &outside {
            say(&mut text, format!("  tensor BAD: {m}"));
        }
    }

    // 2. The trunk, layer by layer, in trunk.bin and in the checkpoint.
    let trunk_json = a
        .trunk
        .as_deref()
        .map(|dir| verify_trunk(&cat, dir, &mut p, &mut ok, &mut |l| say(&mut text, l)));

    if ok {
        say(&mut text, "verify: OK".into());
    } else {
        say(&mut text, "verify: BAD (see the lines above)".into());
    }
    if a.json {
        let v = json!({
            "model": a.model_dir.display().to_string(),
            "ok": ok,
            "shards": shards_json,
            "tensors_checked": n_tensors,
            "tensors_outside": outside,
            "trunk": trunk_json.unwrap_or(Value::Null),
        });
        println!("{v}");
    }
    if ok {
        exit::OK
    } else {
        exit::REFUSED
    }
}

/// Check the packed trunk in `dir` against `cat`; clears `ok` on any problem. Returns the JSON
/// part of the report.
fn verify_trunk(
    cat: &Catalog,
    dir: &Path,
    p: &mut Progress,
    ok: &mut bool,
    say: &mut dyn FnMut(String),
) -> Value {
    let opened = open_shards(cat).map_err(|e| e.0).and_then(|shards| {
        let packed =
            TrunkLayout::from_packed(cat, shards.clone(), dir).map_err(|e| e.to_string())?;
        Ok((packed, TrunkLayout::from_catalog(cat, shards)))
    });
    let (packed, source) = match opened {
        Ok(x) => x,
        Err(m) => {
            *ok = false;
            say(format!("trunk {}: BAD: {m}", dir.display()));
            return json!({"dir": dir.display().to_string(), "ok": false, "refused": m});
        }
    };
    say(format!(
        "trunk {}: {} layers, identity matches the checkpoint",
        dir.display(),
        packed.n_layers()
    ));
    let mut layers = Vec::new();
    let mut all = true;
    for l in 0..packed.n_layers() {
        let Some(want) = packed.plan(l).and_then(|pl| pl.xxh3) else {
            continue;
        };
        let in_trunk = packed.checksum_layer(l, &mut |n| p.add(n));
        let in_ckpt = source.checksum_layer(l, &mut |n| p.add(n));
        let mut problems = Vec::new();
        match &in_trunk {
            Ok(h) if *h == want => {}
            Ok(h) => problems.push(format!(
                "trunk.bin hashes to {h:016x}, trunk.json records {want:016x}"
            )),
            Err(e) => problems.push(format!("trunk.bin: {}", e.0)),
        }
        match &in_ckpt {
            Ok(h) if *h == want => {}
            Ok(h) => problems.push(format!(
                "the checkpoint's run hashes to {h:016x}, trunk.json records {want:016x}"
            )),
            Err(e) => problems.push(format!("checkpoint: {}", e.0)),
        }
        if problems.is_empty() {
            say(format!("  layer {l}: OK xxh3 {want:016x}"));
        } else {
            all = false;
            say(format!("  layer {l}: BAD: {}", problems.join("; ")));
        }
        let hex = |r: &Result<u64, k3_store::runtime::io::ReadError>| {
            r.as_ref().ok().map(|h| format!("{h:016x}"))
        };
        layers.push(json!({
            "layer": l,
            "ok": problems.is_empty(),
            "recorded": format!("{want:016x}"),
            "trunk_bin": hex(&in_trunk),
            "checkpoint": hex(&in_ckpt),
            "problems": problems,
        }));
    }
    *ok &= all;
    json!({"dir": dir.display().to_string(), "ok": all, "refused": null, "layers": layers})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_checkpoint_is_a_refusal() {
        let code = run(Args {
            model_dir: PathBuf::from("/nonexistent/k3-model"),
            trunk: None,
            json: false,
        });
        assert_eq!(code, exit::REFUSED);
    }
}
