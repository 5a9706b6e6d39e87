//! I/O measurements on a synthetic checkpoint with full-size experts (17,547,264 bytes each).
//! Ignored by default; run with
//! `cargo test --release -p k3-store --test store_suite bench_io:: -- --ignored --nocapture`.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fixture::{self, Spec};
use k3_proto::expert::ExpertLayout;
use k3_store::runtime::experts::{CacheOptions, ExpertCache};
use k3_store::runtime::trunk::{open_shards, pack_trunk, Interrupt, PackOptions, TrunkCodec};

#[test]
#[ignore]
fn expert_miss_throughput_and_pack_speed() {
    let mut spec = Spec::small(2, 48);
    spec.layout = ExpertLayout {
        inter: 3072,
        latent: 3584,
    };
    spec.hidden = 2048;
    spec.n_shards = 1;
    let t = Instant::now();
    let w = fixture::write(&spec, "bench");
    let eb = spec.layout.expert_bytes() as f64;
    eprintln!(
        "wrote {:.2} GB checkpoint in {:.1} s",
        std::fs::metadata(&w.catalog.shard_paths()[0])
            .unwrap()
            .len() as f64
            / 1e9,
        t.elapsed().as_secs_f64()
    );
    for threads in [1usize, 4, 8] {
        // A fresh cache (cold): every request is a miss read with O_DIRECT.
        let c = ExpertCache::new(
            Arc::new(w.catalog.clone()),
            open_shards(&w.catalog).unwrap(),
            CacheOptions {
                slots: 16,
                io_threads: threads,
                busy_timeout: Duration::from_secs(10),
            },
        )
        .unwrap();
        let t = Instant::now();
        for batch in 0..3u32 {
            let ids: Vec<u32> = (0..16).map(|i| batch * 16 + i).collect();
            let b = c.get(1, &ids).unwrap();
            for (e, r) in ids.iter().zip(&b.experts) {
                let r = r.as_ref().unwrap();
                let want: Vec<u8> = (0..4096)
                    .map(|i| fixture::expert_byte(1, *e as usize, i))
                    .collect();
                assert_eq!(r.bytes()[..4096], want[..]);
            }
        }
        let s = c.stats();
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "expert misses, {threads} reader threads: {} x {:.2} MB in {:.3} s wall = {:.0} MB/s \
             (read phase {:.0} MB/s)",
            s.table.misses,
            eb / 1e6,
            secs,
            s.bytes_read as f64 / 1e6 / secs,
            s.bytes_read as f64 / 1e6 / s.read_seconds
        );
        assert_eq!(s.table.misses, 48);
    }
    let out = w.dir.join("packed");
    let s = pack_trunk(
        &w.catalog,
        &out,
        &PackOptions::new(TrunkCodec::Raw),
        &Interrupt::never(),
        &mut |_| {},
    )
    .unwrap();
    eprintln!(
        "pack-trunk: {} layers, {:.1} MB in {:.3} s",
        s.layers,
        s.bytes as f64 / 1e6,
        s.seconds
    );
}
