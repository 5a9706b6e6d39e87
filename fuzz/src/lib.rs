//! Helpers shared by the fuzz targets: where the repository's fixtures are and a per-process
//! scratch directory for the parsers that read files (the safetensors index, `trunk.json`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository root (this crate lives in `<root>/fuzz`).
pub fn repo_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// `fixtures/tiny/model`: the small real checkpoint the trunk and index targets check against.
pub fn tiny_model() -> PathBuf {
    repo_root().join("fixtures/tiny/model")
}

/// A scratch directory for this process: `$K3_FUZZ_TMP/<name>-<pid>` (scripts/fuzz.sh sets
/// `K3_FUZZ_TMP` to a directory it removes afterwards), else under `/dev/shm` when it exists
/// (tmpfs: writing the input costs microseconds), else the system temp directory.
pub fn scratch(name: &str) -> PathBuf {
    let base = std::env::var_os("K3_FUZZ_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let shm = Path::new("/dev/shm");
            if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            }
        });
    let dir = base.join(format!("k3-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
    dir
}

/// Writes `bytes` to `path` (replacing it).
pub fn put(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write the fuzz input");
}

/// `fixtures/tokenizer/tiktoken.model` cut to its first `n` lines (ranks `0..n`: the first 256
/// are the single bytes, so the result is a complete vocabulary of `n` ranks).
pub fn vocab_sample(n: usize) -> &'static [u8] {
    static V: OnceLock<Vec<u8>> = OnceLock::new();
    V.get_or_init(|| {
        let all = std::fs::read(repo_root().join("fixtures/tokenizer/tiktoken.model"))
            .expect("read fixtures/tokenizer/tiktoken.model");
        let mut out = Vec::new();
        for line in all.split(|&b| b == b'\n').take(n) {
            out.extend_from_slice(line);
            out.push(b'\n');
        }
        out
    })
}

/// Ranks in [`vocab_sample`] as used by the tokenizer targets (the corpus script renumbers the
/// seed `tokenizer_config.json` to start its added tokens here).
pub const SAMPLE_RANKS: usize = 1024;
