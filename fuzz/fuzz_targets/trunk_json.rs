//! `trunk.json` as bytes (k3-store/src/runtime/trunk/open.rs, `TrunkLayout::from_packed`),
//! checked against the catalog of `fixtures/tiny/model` with a 16 MiB `trunk.bin` of zeros: any
//! input gives a read plan or an error; an accepted plan's layers fit their buffers and
//! `trunk.bin`. (Past the JSON parser a mutation mostly meets the seal; `trunk_descriptors`
//! reseals its inputs to reach the checks behind it.)
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::io::DiskFile;
use k3_store::runtime::trunk::{open_shards, TrunkLayout, TRUNK_BIN, TRUNK_JSON};
use libfuzzer_sys::fuzz_target;

const BIN_LEN: u64 = 16 << 20;

struct Env {
    dir: PathBuf,
    cat: Catalog,
    shards: Vec<Arc<DiskFile>>,
}

fn env() -> &'static Env {
    static E: OnceLock<Env> = OnceLock::new();
    E.get_or_init(|| {
        let dir = k3_fuzz::scratch("trunk_json");
        let bin = std::fs::File::create(dir.join(TRUNK_BIN)).expect("create trunk.bin");
        bin.set_len(BIN_LEN).expect("size trunk.bin");
        let (cat, _cfg) = Catalog::open_dir(&k3_fuzz::tiny_model()).expect("open the tiny model");
        let shards = open_shards(&cat).expect("open the tiny model's shards");
        Env { dir, cat, shards }
    })
}

fuzz_target!(|data: &[u8]| {
    let e = env();
    k3_fuzz::put(&e.dir.join(TRUNK_JSON), data);
    if let Ok(t) = TrunkLayout::from_packed(&e.cat, e.shards.clone(), &e.dir) {
        assert_eq!(t.n_layers(), e.cat.n_layers());
        for l in 0..t.n_layers() {
            if let Some(p) = t.plan(l) {
                assert!(p.run_len <= BIN_LEN);
                for t in p.layout.tensors() {
                    assert!(
                        t.off + t.nbytes <= p.run_len,
                        "{} lies outside its run",
                        t.name
                    );
                }
                let _ = t.buf_len(l);
                let _ = t.windowed(l);
            }
        }
    }
});
