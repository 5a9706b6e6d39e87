//! The model's content identity (SPEC.md §6.11): one 128-bit value that every session, saved
//! state, packed trunk and store segment is bound to, so that state made for one checkpoint is
//! never used with another — even one of the same shape and shard sizes.
//!
//! Two kinds, and every message says which one it is:
//!
//! - **manifest** (strong): the checkpoint has a `k3-manifest.json` (written by
//!   `scripts/download-model.sh` from the hub's sha256 of every shard). The identity is XXH3-128
//!   over `config.json`'s bytes and every shard's file name, size and reference sha256. Computing
//!   it reads no shard: the manifest must name exactly the index's shards with the sizes they
//!   have on disk (else a refusal), and `k3-ctl verify` is what checks the bytes against the
//!   hashes (1.56 TB are not re-read at every start).
//! - **sampled** (weaker, no manifest): XXH3-128 over `config.json`'s bytes and the sampled
//!   checkpoint id ([`checkpoint_id`]: every shard's name, length, raw
//!   header and 8 blocks of 4 KiB of its data). Two checkpoints of the same shape with other
//!   weights differ in the sampled blocks; a change outside them is not seen.

use std::io::Read;
use std::path::{Path, PathBuf};

use k3_proto::manifest::{Manifest, MANIFEST_FILE};
use sha2::Digest;

use crate::runtime::catalog::Catalog;
use crate::runtime::io::{AlignedBuf, DiskFile, ReadError, ALIGN};

/// How an identity was computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityKind {
    /// From `k3-manifest.json`: the reference sha256 of every shard.
    Manifest,
    /// Without a manifest: headers, sizes and sampled blocks of the shards.
    Sampled,
}

impl IdentityKind {
    /// `"manifest"` / `"sampled"`, as recorded in `trunk.json` and printed.
    pub const fn name(self) -> &'static str {
        match self {
            IdentityKind::Manifest => "manifest",
            IdentityKind::Sampled => "sampled",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<IdentityKind> {
        match s {
            "manifest" => Some(IdentityKind::Manifest),
            "sampled" => Some(IdentityKind::Sampled),
            _ => None,
        }
    }
}

/// A checkpoint's content identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// The 128-bit value.
    pub id: u128,
    /// How it was computed.
    pub kind: IdentityKind,
    /// Shards it covers.
    pub shards: usize,
}

impl std::fmt::Display for ModelIdentity {
    /// `<32 hex digits> (manifest)` / `(sampled)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x} ({})", self.id, self.kind.name())
    }
}

/// A checkpoint whose identity cannot be computed: a manifest that does not describe it, a shard
/// or `config.json` that cannot be read (a refusal, exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct IdentityError(pub String);

/// Blocks sampled from each shard's data region for [`checkpoint_id`].
pub const ID_SAMPLES: u64 = 8;
/// Size of one sampled block.
const ID_SAMPLE_BYTES: u64 = 4096;
/// Largest safetensors header read for the identity (the index reader's own limit is lower).
const MAX_HEADER_BYTES: u64 = 256 << 20;

/// The identity of the checkpoint `cat` was built from: XXH3-128 over, for every shard in
/// file-name order, its name, length, raw safetensors header and [`ID_SAMPLES`] evenly spaced
/// blocks of its data (see the module doc). Reads the shard files; a shard that cannot be read
/// is a refusal.
pub fn checkpoint_id(cat: &Catalog) -> Result<u128, IdentityError> {
    use std::os::unix::fs::FileExt;
    let mut shards: Vec<&PathBuf> = cat.shard_paths().iter().collect();
    shards.sort_by_key(|p| p.file_name().map(|f| f.to_os_string()));
    let mut h = twox_hash::XxHash3_128::new();
    h.write(b"k3-checkpoint-id/1\0");
    h.write(&(shards.len() as u64).to_le_bytes());
    for p in shards {
        let bad = |m: String| IdentityError(format!("{}: {m}", p.display()));
        let f = std::fs::File::open(p).map_err(|e| bad(format!("cannot open: {e}")))?;
        let len = f
            .metadata()
            .map_err(|e| bad(format!("cannot stat: {e}")))?
            .len();
        let mut lenbuf = [0u8; 8];
        f.read_exact_at(&mut lenbuf, 0)
            .map_err(|e| bad(format!("cannot read the header length: {e}")))?;
        let hlen = u64::from_le_bytes(lenbuf);
        if hlen > len.saturating_sub(8) || hlen > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header length {hlen} does not fit the {len}-byte file"
            )));
        }
        let mut header = vec![0u8; hlen as usize];
        f.read_exact_at(&mut header, 8)
            .map_err(|e| bad(format!("cannot read the header: {e}")))?;
        let name = p.file_name().map(|n| n.as_encoded_bytes()).unwrap_or(b"");
        h.write(name);
        h.write(&[0]);
        h.write(&len.to_le_bytes());
        h.write(&hlen.to_le_bytes());
        h.write(&header);
        let data = 8 + hlen;
        let data_len = len - data;
        let blk = data_len.min(ID_SAMPLE_BYTES);
        let mut buf = vec![0u8; blk as usize];
        for i in 0..ID_SAMPLES {
            let at = data + (data_len - blk) * i / (ID_SAMPLES - 1);
            f.read_exact_at(&mut buf, at)
                .map_err(|e| bad(format!("cannot read {blk} bytes at {at}: {e}")))?;
            h.write(&buf);
        }
    }
    Ok(h.finish_128())
}

/// Where the checkpoint of `cat` lives (for messages): its first shard's directory.
pub fn model_dir_of(cat: &Catalog) -> String {
    cat.shard_paths()
        .first()
        .and_then(|p| p.parent())
        .map(|d| d.display().to_string())
        .unwrap_or_else(|| "the checkpoint".into())
}

impl ModelIdentity {
    /// The identity of the checkpoint `cat` was opened from (its shards' directory holds
    /// `config.json` and, when present, the manifest). A manifest that cannot be read, or that
    /// does not describe exactly these shards at these sizes, is a refusal.
    pub fn of(cat: &Catalog) -> Result<ModelIdentity, IdentityError> {
        let dir = model_dir_of(cat);
        let dir = Path::new(&dir);
        let refuse = |m: String| IdentityError(m);
        let cfg_path = dir.join("config.json");
        let config =
            read_small(&cfg_path).map_err(|e| refuse(format!("{}: {e}", cfg_path.display())))?;
        let manifest = Manifest::load(dir).map_err(|e| refuse(e.to_string()))?;
        let mut h = twox_hash::XxHash3_128::new();
        let kind = match &manifest {
            Some(m) => {
                check_manifest(m, cat, dir)?;
                h.write(b"k3-model-id/manifest/1\0");
                h.write(&(config.len() as u64).to_le_bytes());
                h.write(&config);
                h.write(&(m.shards.len() as u64).to_le_bytes());
                for s in m.shards.values() {
                    h.write(s.file.as_bytes());
                    h.write(&[0]);
                    h.write(&s.size.to_le_bytes());
                    h.write(s.sha256.as_bytes());
                }
                IdentityKind::Manifest
            }
            None => {
                let sampled = checkpoint_id(cat)?;
                h.write(b"k3-model-id/sampled/1\0");
                h.write(&(config.len() as u64).to_le_bytes());
                h.write(&config);
                h.write(&sampled.to_le_bytes());
                IdentityKind::Sampled
            }
        };
        Ok(ModelIdentity {
            id: h.finish_128(),
            kind,
            shards: cat.shard_paths().len(),
        })
    }

    /// One line saying what the identity is and what it rests on (logged at start).
    pub fn describe(&self) -> String {
        match self.kind {
            IdentityKind::Manifest => format!(
                "model identity {:032x} (manifest: config.json and the reference sha256 of {} \
                 shards in {MANIFEST_FILE}; recorded hashes, the shards are checked against them \
                 by `k3-ctl verify`, not at start)",
                self.id, self.shards
            ),
            IdentityKind::Sampled => format!(
                "model identity {:032x} (sampled, weaker: no {MANIFEST_FILE}; config.json and \
                 the headers, sizes and 8 sampled blocks of {} shards)",
                self.id, self.shards
            ),
        }
    }
}

/// A small file (config.json) read whole, at most 16 MiB.
fn read_small(p: &Path) -> std::io::Result<Vec<u8>> {
    const MAX: u64 = 16 << 20;
    let mut v = Vec::new();
    std::fs::File::open(p)?.take(MAX + 1).read_to_end(&mut v)?;
    if v.len() as u64 > MAX {
        return Err(std::io::Error::other(format!("larger than {MAX} bytes")));
    }
    Ok(v)
}

/// The manifest names exactly the catalog's shards, with the sizes they have.
fn check_manifest(m: &Manifest, cat: &Catalog, dir: &Path) -> Result<(), IdentityError> {
    let mp = dir.join(MANIFEST_FILE);
    let mut problems = Vec::new();
    let mut named = std::collections::BTreeSet::new();
    for (p, &len) in cat.shard_paths().iter().zip(cat.shard_lens()) {
        let name = p
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        match m.shards.get(&name) {
            None => problems.push(format!("{name} is not in it")),
            Some(s) if s.size != len => problems.push(format!(
                "{name} is {len} bytes, the manifest says {}",
                s.size
            )),
            Some(_) => {}
        }
        named.insert(name);
    }
    for f in m.shards.keys().filter(|f| !named.contains(*f)) {
        problems.push(format!("it lists {f}, which the index does not name"));
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(IdentityError(format!(
        "{} does not describe this checkpoint's shards: {} (a manifest of another download, or \
         shards replaced; scripts/download-model.sh … --verify-only rewrites it from the hub)",
        mp.display(),
        problems.join("; ")
    )))
}

/// SHA-256 of the whole of `f`, read (with `O_DIRECT` when the file allows it) in chunks of
/// `buf`'s size less two pages; `on_bytes` is told of each chunk. `k3-ctl verify` compares it
/// with the manifest.
pub fn sha256_disk(
    f: &DiskFile,
    buf: &mut AlignedBuf,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<String, ReadError> {
    let chunk = (buf.as_slice().len().saturating_sub(2 * ALIGN) as u64).max(ALIGN as u64);
    let len = f.len();
    let mut h = sha2::Sha256::new();
    let mut at = 0u64;
    while at < len {
        let take = (len - at).min(chunk);
        let inner = f.read_span(at, take, buf.as_mut_slice())?;
        h.update(&buf.as_slice()[inner..inner + take as usize]);
        at += take;
        on_bytes(take);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Spec};

    fn sha256_file(p: &Path) -> String {
        let mut buf = AlignedBuf::zeroed(3 * ALIGN).unwrap();
        sha256_disk(&DiskFile::open(p).unwrap(), &mut buf, &mut |_| {}).unwrap()
    }

    fn manifest_of(dir: &Path, cat: &Catalog) -> String {
        let shards: Vec<String> = cat
            .shard_paths()
            .iter()
            .map(|p| {
                format!(
                    r#"{{"file":"{}","size":{},"sha256":"{}"}}"#,
                    p.file_name().unwrap().to_string_lossy(),
                    std::fs::metadata(p).unwrap().len(),
                    sha256_file(p)
                )
            })
            .collect();
        let text = format!(
            r#"{{"format":1,"source":"test","shards":[{}]}}"#,
            shards.join(",")
        );
        std::fs::write(dir.join(MANIFEST_FILE), &text).unwrap();
        text
    }

    #[test]
    fn sampled_then_manifest_and_each_is_bound_to_what_it_covers() {
        let w = fixture::write(&Spec::small(3, 2), "identity");
        let sampled = ModelIdentity::of(&w.catalog).unwrap();
        assert_eq!(sampled.kind, IdentityKind::Sampled);
        assert!(
            sampled.describe().contains("sampled, weaker"),
            "{}",
            sampled.describe()
        );
        let text = manifest_of(&w.dir, &w.catalog);
        let m = ModelIdentity::of(&w.catalog).unwrap();
        assert_eq!(m.kind, IdentityKind::Manifest);
        assert_ne!(m.id, sampled.id);
        assert_eq!(ModelIdentity::of(&w.catalog).unwrap(), m, "deterministic");
        // Another reference hash for one shard: another identity.
        let first = text.find("\"sha256\":\"").unwrap() + 10;
        let mut other = text.clone();
        let c = if &other[first..first + 1] == "0" {
            "1"
        } else {
            "0"
        };
        other.replace_range(first..first + 1, c);
        std::fs::write(w.dir.join(MANIFEST_FILE), &other).unwrap();
        assert_ne!(ModelIdentity::of(&w.catalog).unwrap().id, m.id);
        // Another config: another identity.
        std::fs::write(w.dir.join(MANIFEST_FILE), &text).unwrap();
        let cfg = w.dir.join("config.json");
        let before = std::fs::read(&cfg).unwrap();
        let mut after = before.clone();
        after.push(b'\n');
        std::fs::write(&cfg, &after).unwrap();
        assert_ne!(ModelIdentity::of(&w.catalog).unwrap().id, m.id);
        std::fs::write(&cfg, &before).unwrap();
        // A manifest of other sizes, or missing a shard, is refused naming it.
        let name = w.catalog.shard_paths()[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let size = std::fs::metadata(&w.catalog.shard_paths()[0])
            .unwrap()
            .len();
        std::fs::write(
            w.dir.join(MANIFEST_FILE),
            text.replace(
                &format!("\"size\":{size}"),
                &format!("\"size\":{}", size + 1),
            ),
        )
        .unwrap();
        let e = ModelIdentity::of(&w.catalog).unwrap_err().to_string();
        assert!(e.contains(&name) && e.contains("does not describe"), "{e}");
    }

    #[test]
    fn sha256_of_known_inputs_across_chunks() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // 3 chunks and a tail with a one-page chunk, against the one-shot digest.
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let want: String = sha2::Sha256::digest(&data)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let mut n = 0;
        let mut buf = AlignedBuf::zeroed(3 * ALIGN).unwrap();
        let got = sha256_disk(&DiskFile::open(&p).unwrap(), &mut buf, &mut |b| n += b).unwrap();
        assert_eq!((got, n), (want, data.len() as u64));
    }
}
