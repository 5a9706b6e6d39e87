//! The trunk's descriptors bound to its content (issue 47 items 1 and 10; SPEC.md §6.1): the
//! input is a `trunk.json` (a mutation of the packed tiny model's, seed corpus), written with
//! its trunk identity and seal RECOMPUTED — what a careful editor of the file would do — beside
//! the real packed `trunk.bin`. Whatever the descriptors say, opening either refuses them or
//! gives a plan whose tensors lie inside their runs, on 64-byte offsets and disjoint; and a
//! layer whose run passes its bound checksum has exactly the descriptors it was packed with (an
//! edited offset, size, codec, dtype, hash or layer order never reaches the engine).
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::io::{AlignedBuf, DiskFile};
use k3_store::runtime::trunk::{
    open_shards, pack_trunk, seal_json, Interrupt, PackOptions, TrunkCodec, TrunkJson, TrunkLayout,
    TENSOR_ALIGN, TRUNK_JSON,
};
use libfuzzer_sys::fuzz_target;

struct Env {
    dir: PathBuf,
    cat: Catalog,
    shards: Vec<Arc<DiskFile>>,
    good: TrunkJson,
}

fn env() -> &'static Env {
    static E: OnceLock<Env> = OnceLock::new();
    E.get_or_init(|| {
        let dir = k3_fuzz::scratch("trunk_descriptors");
        let (cat, _cfg) = Catalog::open_dir(&k3_fuzz::tiny_model()).expect("open the tiny model");
        pack_trunk(
            &cat,
            &dir,
            &PackOptions::new(TrunkCodec::Int4),
            &Interrupt::never(),
            &mut |_| {},
        )
        .expect("pack the tiny model's trunk");
        let text = std::fs::read_to_string(dir.join(TRUNK_JSON)).expect("read trunk.json");
        let good = serde_json::from_str(&text).expect("parse trunk.json");
        let shards = open_shards(&cat).expect("open the tiny model's shards");
        Env {
            dir,
            cat,
            shards,
            good,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let e = env();
    let Ok(mut j) = serde_json::from_slice::<TrunkJson>(data) else {
        return;
    };
    if seal_json(&mut j).is_err() {
        return;
    }
    let Ok(text) = serde_json::to_vec(&j) else {
        return;
    };
    k3_fuzz::put(&e.dir.join(TRUNK_JSON), &text);
    let Ok(t) = TrunkLayout::from_packed(&e.cat, e.shards.clone(), &e.dir) else {
        return;
    };
    for l in 0..t.n_layers() {
        let Some(p) = t.plan(l) else { continue };
        let mut locs: Vec<_> = p.layout.tensors().to_vec();
        locs.sort_by_key(|t| t.off);
        for (i, loc) in locs.iter().enumerate() {
            assert!(loc.off + loc.nbytes <= p.run_len, "{} outside its run", loc.name);
            assert_eq!(loc.off % TENSOR_ALIGN, 0, "{} off a 64-byte offset", loc.name);
            if let Some(next) = locs.get(i + 1) {
                assert!(loc.off + loc.nbytes <= next.off, "{} over {}", loc.name, next.name);
            }
        }
        let mut buf = AlignedBuf::zeroed(t.buf_len(l) as usize).expect("a read buffer");
        let Ok(inner) = t.read_layer(l, buf.as_mut_slice()) else {
            continue;
        };
        let run = &buf.as_slice()[inner..inner + p.run_len as usize];
        if t.verify_run(l, run).is_ok() {
            assert_eq!(
                j.layers[l], e.good.layers[l],
                "layer {l} passed its checksum with descriptors it was not packed with"
            );
        }
    }
});
