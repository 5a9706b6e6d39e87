//! `model.safetensors.index.json` (proto/src/safetensors.rs, `CheckpointIndex::open`), next to
//! the three real shards of `fixtures/tiny/model`: any input gives an index or an error (the
//! weight_map is cross-checked against the shard headers).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use k3_proto::safetensors::{CheckpointIndex, INDEX_JSON};
use libfuzzer_sys::fuzz_target;

fn dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let d = k3_fuzz::scratch("safetensors_index");
        for e in std::fs::read_dir(k3_fuzz::tiny_model()).expect("read fixtures/tiny/model") {
            let p = e.expect("list fixtures/tiny/model").path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                std::fs::copy(&p, d.join(p.file_name().unwrap())).expect("copy a shard");
            }
        }
        d
    })
}

fuzz_target!(|data: &[u8]| {
    k3_fuzz::put(&dir().join(INDEX_JSON), data);
    if let Ok(index) = CheckpointIndex::open(dir()) {
        assert!(index.n_shards() >= 1);
        for t in index.iter() {
            assert!(t.offset + t.nbytes <= index.shard_len(t.shard));
        }
    }
});
