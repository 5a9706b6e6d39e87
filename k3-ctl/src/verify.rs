//! `k3-ctl verify MODEL [--trunk T] [--json]`: check every byte.
//!
//! The checkpoint: every tensor the engine reads has the dtype and shape its config says (the
//! shared check, `k3_proto::tensors`), every shard has the size its index recorded and reads end
//! to end, and every tensor the engine uses lies inside its shard. With a manifest
//! (`k3-manifest.json`, SPEC.md §6.11) every shard's SHA-256 is compared with the reference it
//! records; without one the contents cannot be checked against anything, which the report says
//! plainly and the exit code ([`exit::UNVERIFIED`]) tells apart from success. The packed trunk,
//! when given: it opens (format, model identity, trunk identity, seal, run layout: the checks
//! of `TrunkLayout::from_packed`), every layer's run in `trunk.bin` matches its bound checksum,
//! every checkpoint tensor and every raw stored tensor hashes (XXH3-64) to its recorded hash,
//! every EC-BF16 tensor decodes to it, and every int8/int4 tensor is byte for byte the
//! checkpoint's tensor quantized again (each named when it does not). A trunk whose every hash
//! was forged consistently opens and runs; this command is what catches it. Prints one OK/BAD line per shard and per layer (or a JSON report) and progress on
//! stderr; exit 0 when everything is good and checked against the manifest, 5 when good but
//! without a manifest, 2 on any mismatch or refusal.

use std::path::{Path, PathBuf};

use k3_proto::exit;

use crate::fail::Failed;
use k3_proto::manifest::{Manifest, MANIFEST_FILE};
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::identity::{sha256_disk, IdentityKind, ModelIdentity};
use k3_store::runtime::io::{AlignedBuf, DiskFile};
use k3_store::runtime::plan::fmt_bytes;
use k3_store::runtime::source::Storage;
use k3_store::runtime::trunk::{open_shards, TrunkLayout};
use serde_json::{json, Value};

/// Arguments of `k3-ctl verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, model.safetensors.index.json).
    pub model_dir: PathBuf,
    /// Packed trunk directory (trunk.bin + trunk.json) to check against the checkpoint.
    #[arg(long, value_name = "DIR")]
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

/// The lines of the report: printed as they come (unless `--json`) and kept.
struct Lines {
    json: bool,
    text: Vec<String>,
}

impl Lines {
    fn say(&mut self, line: String) {
        if !self.json {
            println!("{line}");
        }
        self.text.push(line);
    }
}

/// Run the subcommand; the exit code (0 verified, 5 read but not checked against a manifest,
/// 2 something BAD).
pub fn run(a: Args) -> Result<i32, Failed> {
    // The shapes, then the reference: the manifest's sha256 of every shard (a malformed one, or
    // one of other shards, is a refusal, as it is at start).
    let refusing = |e| Failed::because("refusing", e);
    let (cat, _cfg) = Catalog::open_dir(&a.model_dir).map_err(refusing)?;
    let identity = ModelIdentity::of(&cat).map_err(|e| Failed::because("refusing", e))?;
    let manifest = Manifest::load(&a.model_dir).map_err(|e| Failed::because("refusing", e))?;
    let mut lines = Lines {
        json: a.json,
        text: Vec::new(),
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
        "verifying {} ({} shards, {}){}: reading {}{}",
        a.model_dir.display(),
        cat.shard_paths().len(),
        fmt_bytes(shard_bytes),
        a.trunk
            .as_ref()
            .map(|t| format!(" and the trunk {}", t.display()))
            .unwrap_or_default(),
        fmt_bytes(total),
        if manifest.is_some() {
            format!(", hashing every shard (sha256) against {MANIFEST_FILE}")
        } else {
            String::new()
        }
    );
    lines.say(format!(
        "checkpoint {}: {} shards, {}",
        a.model_dir.display(),
        cat.shard_paths().len(),
        identity.describe()
    ));
    lines.say(
        "  tensors: OK (dtype and shape of every tensor the engine reads match the config)".into(),
    );
    // 1. The shards, end to end, hashed.
    let Shards {
        mut ok,
        json: shards_json,
        lens,
    } = verify_shards(&cat, manifest.as_ref(), &mut p, &mut lines)?;
    let (n_tensors, outside) = tensors_outside(&cat, &lens);
    if outside.is_empty() {
        lines.say(format!(
            "  tensors: OK ({n_tensors} lie inside their shards)"
        ));
    } else {
        ok = false;
        for m in &outside {
            lines.say(format!("  tensor BAD: {m}"));
        }
    }
    // 2. The trunk, layer by layer and tensor by tensor, in trunk.bin and in the checkpoint.
    let trunk_json = a
        .trunk
        .as_deref()
        .map(|dir| verify_trunk(&cat, dir, &mut p, &mut ok, &mut |l| lines.say(l)));
    let checked = identity.kind == IdentityKind::Manifest;
    let (code, verdict) = verdict(ok, checked, &a.model_dir);
    lines.say(verdict);
    if a.json {
        let v = json!({
            "model": a.model_dir.display().to_string(),
            "ok": ok,
            "checked_against_manifest": checked,
            "identity": format!("{:032x}", identity.id),
            "identity_kind": identity.kind.name(),
            "shards": shards_json,
            "tensors_checked": n_tensors,
            "tensors_outside": outside,
            "trunk": trunk_json.unwrap_or(Value::Null),
        });
        println!("{v}");
    }
    Ok(code)
}

/// The exit code and the last line: OK against the manifest, read but not checked, or BAD.
fn verdict(ok: bool, checked: bool, model_dir: &Path) -> (i32, String) {
    match (ok, checked) {
        (true, true) => (
            exit::OK,
            format!("verify: OK (every shard matches the sha256 {MANIFEST_FILE} records)"),
        ),
        (true, false) => (
            exit::UNVERIFIED,
            format!(
                "verify: NOT VERIFIED: every byte was read and is consistent, but the contents \
                 were NOT checked against a reference: {} has no {MANIFEST_FILE} \
                 (scripts/download-model.sh writes it from the hub's sha256 of every shard) \
                 (exit {})",
                model_dir.display(),
                exit::UNVERIFIED
            ),
        ),
        (false, _) => (exit::REFUSED, "verify: BAD (see the lines above)".into()),
    }
}

/// What reading every shard found.
struct Shards {
    /// All are good.
    ok: bool,
    /// Their JSON records.
    json: Vec<Value>,
    /// Their lengths (`None`: unreadable).
    lens: Vec<Option<u64>>,
}

/// Every shard read end to end and hashed, against the manifest when there is one.
fn verify_shards(
    cat: &Catalog,
    manifest: Option<&Manifest>,
    p: &mut Progress,
    lines: &mut Lines,
) -> Result<Shards, Failed> {
    let mut buf = AlignedBuf::zeroed(CHUNK as usize + 2 * k3_store::runtime::io::ALIGN)
        .map_err(|e| Failed::because("the read buffer", e))?;
    let mut ok = true;
    let mut shards_json = Vec::new();
    let mut lens = Vec::new();
    for (path, &want) in cat.shard_paths().iter().zip(cat.shard_lens()) {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        let reference = manifest.and_then(|m| m.shards.get(&name));
        let f = DiskFile::open(path).map_err(|e| e.0);
        lens.push(f.as_ref().ok().map(DiskFile::len));
        let r = f.and_then(|f| {
            if f.len() != want {
                return Err(format!(
                    "{} bytes, the index recorded {want} (truncated or replaced)",
                    f.len()
                ));
            }
            sha256_disk(&f, &mut buf, &mut |n| p.add(n)).map_err(|e| e.0)
        });
        let (good, line) = match (&r, reference) {
            (Ok(h), Some(m)) if *h == m.sha256 => (
                true,
                format!("OK sha256 {h} matches {MANIFEST_FILE} ({want} bytes read)"),
            ),
            (Ok(h), Some(m)) => (
                false,
                format!(
                    "BAD: sha256 {h}, {MANIFEST_FILE} records {} (its contents differ from the \
                     reference: damaged, edited or another file)",
                    m.sha256
                ),
            ),
            (Ok(h), None) => (
                true,
                format!(
                    "read end to end ({want} bytes, sha256 {h}); NOT checked against a \
                     reference (no {MANIFEST_FILE})"
                ),
            ),
            (Err(e), _) => (false, format!("BAD: {e}")),
        };
        ok &= good;
        lines.say(format!("  shard {name}: {line}"));
        shards_json.push(json!({
            "shard": name,
            "ok": good,
            "bytes": want,
            "sha256": r.as_ref().ok(),
            "reference_sha256": reference.map(|m| m.sha256.clone()),
            "error": r.err(),
        }));
    }
    Ok(Shards {
        ok,
        json: shards_json,
        lens,
    })
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
        "trunk {}: {} layers, model identity matches the checkpoint, trunk identity {}",
        dir.display(),
        packed.n_layers(),
        packed
            .trunk_id()
            .map_or("(none)".into(), |t| format!("{t:032x}"))
    ));
    let mut layers = Vec::new();
    let mut all = true;
    for l in 0..packed.n_layers() {
        let Some(plan) = packed.plan(l) else { continue };
        let (Some(check), Some(tensors)) = (plan.check, plan.tensor_xxh3.clone()) else {
            continue;
        };
        let in_trunk = packed.checksum_layer_tensors(l, &mut |n| p.add(n));
        let in_ckpt = source.checksum_layer_tensors(l, &mut |n| p.add(n));
        let mut problems = Vec::new();
        match &in_trunk {
            Ok((bound, _)) if *bound != check.want => problems.push(format!(
                "the run in trunk.bin with its descriptors hashes to {bound:016x}, trunk.json \
                 records {:016x}",
                check.want
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!("trunk.bin: {}", e.0)),
        }
        // Every checkpoint tensor hashes to its recorded hash; a raw tensor's stored bytes too.
        for (what, got) in [("the checkpoint", &in_ckpt), ("trunk.bin", &in_trunk)] {
            let Ok((_, sums)) = got else {
                if let Err(e) = got {
                    problems.push(format!("{what}: {}", e.0));
                }
                continue;
            };
            for (name, &rec) in tensors.iter() {
                let raw = (plan.layout.get(name)).is_some_and(|t| t.storage == Storage::Raw);
                if what == "trunk.bin" && !raw {
                    continue;
                }
                match sums.get(name) {
                    Some(&h) if h == rec => {}
                    Some(&h) => problems.push(format!(
                        "{name} in {what} hashes to {h:016x}, trunk.json records {rec:016x}"
                    )),
                    None => problems.push(format!("{name} is not in {what}'s layer")),
                }
            }
        }
        // A coded or quantized tensor is re-derived: EC-BF16 decoded and checked, int8/int4
        // quantized again from the checkpoint's bytes and compared byte for byte.
        let encoded: Vec<_> = (plan.layout.tensors().iter())
            .filter(|t| t.storage != Storage::Raw)
            .collect();
        for t in &encoded {
            let rec = tensors.get(&t.name).copied().unwrap_or_default();
            if let Err(m) = rederive(&packed, &source, l, t, rec, &mut |n| p.add(n)) {
                problems.push(format!(
                    "{} ({}) in trunk.bin: {m}",
                    t.name,
                    t.storage.name()
                ));
            }
        }
        if problems.is_empty() {
            say(format!(
                "  layer {l}: OK xxh3 {:016x} ({} tensors{})",
                check.want,
                tensors.len(),
                if encoded.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", {} coded or quantized re-derived from the checkpoint",
                        encoded.len()
                    )
                }
            ));
        } else {
            all = false;
            say(format!("  layer {l}: BAD: {}", problems.join("; ")));
        }
        let hex = |r: &Result<(u64, _), k3_store::runtime::io::ReadError>| {
            r.as_ref().ok().map(|(h, _)| format!("{h:016x}"))
        };
        layers.push(json!({
            "layer": l,
            "ok": problems.is_empty(),
            "recorded": format!("{:016x}", check.want),
            "trunk_bin": hex(&in_trunk),
            "tensors_checked": tensors.len(),
            "problems": problems,
        }));
    }
    *ok &= all;
    json!({"dir": dir.display().to_string(), "ok": all, "refused": null, "layers": layers})
}

/// Re-derive the encoded tensor `t` of layer `l` (its stored bytes in `packed`) from the
/// checkpoint (`source`): an EC-BF16 matrix must verify (every block, escape and palette entry,
/// the decode against its header's hash) and its header name the recorded source hash `rec`; an
/// int8/int4 matrix must be byte for byte what quantizing the checkpoint's tensor gives.
// String error: each problem becomes one clause of the layer's BAD line.
fn rederive(
    packed: &TrunkLayout,
    source: &TrunkLayout,
    l: usize,
    t: &k3_store::runtime::source::TensorLoc,
    rec: u64,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<(), String> {
    let (buf, inner, len) = packed.read_tensor(l, &t.name).map_err(|e| e.0)?;
    on_bytes(len);
    let stored = &buf.as_slice()[inner..inner + len as usize];
    match t.storage.quant() {
        None => {
            let m = k3_proto::ecbf16::CodedMatrix::parse(stored).map_err(|e| e.to_string())?;
            m.verify().map_err(|e| e.to_string())?;
            if m.raw_checksum() != rec {
                return Err(format!(
                    "decodes to xxh3 {:016x}, trunk.json records {rec:016x}",
                    m.raw_checksum()
                ));
            }
            Ok(())
        }
        Some(kind) => {
            let m = k3_proto::quant::QuantMatrix::parse(stored).map_err(|e| e.to_string())?;
            if m.kind() != kind || m.source_xxh3() != rec {
                return Err(format!(
                    "its header says {} from xxh3 {:016x}; trunk.json says {} from {rec:016x}",
                    m.kind().name(),
                    m.source_xxh3(),
                    kind.name()
                ));
            }
            let (cbuf, cinner, clen) = source.read_tensor(l, &t.name).map_err(|e| e.0)?;
            on_bytes(clen);
            let raw = &cbuf.as_slice()[cinner..cinner + clen as usize];
            let want = k3_proto::quant::encode_matrix(kind, raw, m.rows(), m.cols())
                .map_err(|e| e.to_string())?;
            if want != stored {
                let at = (want.iter().zip(stored)).position(|(a, b)| a != b);
                return Err(format!(
                    "differs from the checkpoint's tensor quantized again (first at byte {at:?})"
                ));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_checkpoint_is_a_refusal() {
        let r = run(Args {
            model_dir: PathBuf::from("/nonexistent/k3-model"),
            trunk: None,
            json: false,
        });
        assert_eq!(exit::report("t", r), exit::REFUSED);
    }
}
