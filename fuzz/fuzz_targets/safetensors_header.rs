//! A safetensors shard header (proto/src/safetensors.rs, `CheckpointIndex::open`): the input is
//! the head of the only shard of a checkpoint — `[u64 LE header length][JSON header]` and maybe
//! some data — and the file is extended with zeros to 4 MiB past the input, so data offsets up
//! to there are in bounds. Any input gives an index or an error; an accepted index answers
//! lookups of every tensor it lists, each inside the shard.
#![no_main]

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::OnceLock;

use k3_proto::safetensors::CheckpointIndex;
use libfuzzer_sys::fuzz_target;

/// Zero data after the input.
const PAD: u64 = 4 << 20;

fn dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| k3_fuzz::scratch("safetensors_header"))
}

fuzz_target!(|data: &[u8]| {
    let shard = dir().join("model.safetensors");
    k3_fuzz::put(&shard, data);
    OpenOptions::new()
        .write(true)
        .open(&shard)
        .and_then(|f| f.set_len(data.len() as u64 + PAD))
        .expect("extend the shard");
    if let Ok(index) = CheckpointIndex::open(dir()) {
        let file_len = index.shard_len(0);
        assert!(index.shard_data_start(0) <= file_len);
        for t in index.iter() {
            assert!(
                t.offset + t.nbytes <= file_len,
                "{} lies past the file",
                t.name
            );
            let again = index.get(t.name).expect("a listed tensor is found by name");
            assert_eq!((again.offset, again.nbytes), (t.offset, t.nbytes));
        }
        let _ = index.heap_bytes();
    }
});
