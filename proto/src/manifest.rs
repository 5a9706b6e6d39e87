//! The checkpoint manifest `k3-manifest.json` (SPEC.md §6.11): the reference sha256 of every
//! shard, written beside the model by `scripts/download-model.sh` from the hub's own listing (and
//! by the synthetic checkpoint writer). `k3-ctl verify` hashes every shard against it; the
//! model's content identity is computed from it without reading a shard.
//!
//! ```json
//! {"format": 1, "source": "https://huggingface.co/moonshotai/Kimi-K3@main",
//!  "shards": [{"file": "model-00001-of-00096.safetensors", "size": 16262483584,
//!              "sha256": "<64 lowercase hex digits>"}, …]}
//! ```
//!
//! [`Manifest::load`] refuses (never guesses): a file over [`MAX_MANIFEST_BYTES`], another
//! format, a shard name that is not a plain file name, a hash that is not 64 lowercase hex
//! digits, a shard listed twice, an empty list.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

/// The manifest's file name in a checkpoint directory.
pub const MANIFEST_FILE: &str = "k3-manifest.json";
/// The format this build reads and writes.
pub const MANIFEST_FORMAT: u32 = 1;
/// Largest manifest accepted (the release's 96 shards take ~12 KB).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// One shard's reference.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestShard {
    /// Plain file name in the checkpoint directory.
    pub file: String,
    /// Bytes.
    pub size: u64,
    /// SHA-256 of the whole file, 64 lowercase hex digits.
    pub sha256: String,
}

#[derive(Deserialize)]
struct Raw {
    format: u32,
    #[serde(default)]
    source: String,
    shards: Vec<ManifestShard>,
}

/// A checked manifest: shards by file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Where the hashes came from (free text, e.g. the hub repository and revision).
    pub source: String,
    /// Every shard, by file name.
    pub shards: BTreeMap<String, ManifestShard>,
}

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// It cannot be read.
    #[error("{path}: {err}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        err: std::io::Error,
    },
    /// It is not a manifest this build accepts.
    #[error("{path}: {problem}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        problem: ManifestProblem,
    },
}

/// What is wrong with a manifest's text.
#[derive(Debug, thiserror::Error)]
pub enum ManifestProblem {
    /// Larger than [`MAX_MANIFEST_BYTES`].
    #[error("larger than {MAX_MANIFEST_BYTES} bytes")]
    TooLarge,
    /// Not JSON of a manifest's fields.
    #[error("not a manifest: {0}")]
    Json(#[source] serde_json::Error),
    /// Another format.
    #[error("manifest format {0}, this build reads format {MANIFEST_FORMAT}")]
    Format(u32),
    /// No shard listed.
    #[error("lists no shard")]
    NoShard,
    /// A shard name with a path in it.
    #[error("{0:?} is not a plain file name")]
    NotPlain(String),
    /// A digest that is not SHA-256 hex.
    #[error("{file}: sha256 {sha256:?} is not 64 lowercase hex digits")]
    Sha256 {
        /// The shard.
        file: String,
        /// The digest given.
        sha256: String,
    },
    /// A shard listed twice.
    #[error("{0} is listed twice")]
    Twice(String),
}

fn plain_file_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains(['/', '\\', '\0'])
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Manifest {
    /// The manifest of checkpoint directory `dir`: `None` when it has none.
    pub fn load(dir: &Path) -> Result<Option<Manifest>, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let shown = path.display().to_string();
        let io = |err| ManifestError::Io {
            path: shown.clone(),
            err,
        };
        let f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        let mut text = String::new();
        f.take(MAX_MANIFEST_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(ManifestError::Invalid {
                path: shown,
                problem: ManifestProblem::TooLarge,
            });
        }
        Manifest::parse(&text)
            .map(Some)
            .map_err(|problem| ManifestError::Invalid {
                path: shown,
                problem,
            })
    }

    /// Parse and check a manifest's text.
    pub fn parse(text: &str) -> Result<Manifest, ManifestProblem> {
        let raw: Raw = serde_json::from_str(text).map_err(ManifestProblem::Json)?;
        if raw.format != MANIFEST_FORMAT {
            return Err(ManifestProblem::Format(raw.format));
        }
        if raw.shards.is_empty() {
            return Err(ManifestProblem::NoShard);
        }
        let mut shards = BTreeMap::new();
        for s in raw.shards {
            if !plain_file_name(&s.file) {
                return Err(ManifestProblem::NotPlain(s.file));
            }
            if !is_sha256_hex(&s.sha256) {
                return Err(ManifestProblem::Sha256 {
                    file: s.file,
                    sha256: s.sha256,
                });
            }
            let name = s.file.clone();
            if shards.insert(name.clone(), s).is_some() {
                return Err(ManifestProblem::Twice(name));
            }
        }
        Ok(Manifest {
            source: raw.source,
            shards,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_and_refuses() {
        let ok = format!(
            r#"{{"format":1,"source":"hub","shards":[{{"file":"a.safetensors","size":3,"sha256":"{H}"}}]}}"#
        );
        let m = Manifest::parse(&ok).unwrap();
        assert_eq!(m.shards["a.safetensors"].size, 3);
        for (bad, why) in [
            (ok.replace("\"format\":1", "\"format\":2"), "format 2"),
            (ok.replace("a.safetensors", "../a"), "plain file name"),
            (ok.replace(H, &H.to_uppercase()), "lowercase hex"),
            (ok.replace(H, &H[1..]), "lowercase hex"),
            (
                ok.replace(
                    "]}",
                    &format!(r#",{{"file":"a.safetensors","size":3,"sha256":"{H}"}}]}}"#),
                ),
                "twice",
            ),
            (r#"{"format":1,"shards":[]}"#.to_string(), "no shard"),
            (
                ok.replace("\"size\":3", "\"size\":3,\"x\":1"),
                "unknown field",
            ),
        ] {
            let e = Manifest::parse(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn absent_is_none_and_oversized_is_refused() {
        let d = tempfile::tempdir().unwrap();
        assert!(Manifest::load(d.path()).unwrap().is_none());
        std::fs::write(
            d.path().join(MANIFEST_FILE),
            vec![b' '; MAX_MANIFEST_BYTES as usize + 1],
        )
        .unwrap();
        let e = Manifest::load(d.path()).unwrap_err().to_string();
        assert!(e.contains("larger than"), "{e}");
    }
}
