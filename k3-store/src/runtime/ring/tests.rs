//! The ring's tests: one in-process reader holding pins (a standalone worker's stream) and
//! several readers holding leases (the store's attached workers), on one implementation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::fixture::{self, Rng, Spec};
use crate::runtime::trunk::{
    open_shards, pack_trunk, Interrupt, PackOptions, TrunkCodec, TrunkJson, TrunkLayout, TRUNK_BIN,
};

/// The trunk read straight from the shards.
fn catalog_layout(w: &fixture::Written) -> Arc<TrunkLayout> {
    Arc::new(TrunkLayout::from_catalog(
        &w.catalog,
        open_shards(&w.catalog).unwrap(),
    ))
}

/// A synthetic checkpoint of `n` layers and its trunk read from the shards.
fn small(n: usize, tag: &str) -> (Spec, fixture::Written, Arc<TrunkLayout>) {
    let spec = Spec::small(n, 2);
    let w = fixture::write(&spec, tag);
    let layout = catalog_layout(&w);
    (spec, w, layout)
}

/// The trunk packed into `w.dir/packed` and read from there.
fn packed_layout(w: &fixture::Written) -> Arc<TrunkLayout> {
    let packed_dir = w.dir.join("packed");
    if !packed_dir.exists() {
        pack_trunk(
            &w.catalog,
            &packed_dir,
            &PackOptions::new(TrunkCodec::Raw),
            &Interrupt::never(),
            &mut |_| {},
        )
        .unwrap();
    }
    Arc::new(
        TrunkLayout::from_packed(&w.catalog, open_shards(&w.catalog).unwrap(), &packed_dir)
            .unwrap(),
    )
}

/// A packed trunk of three layers whose `trunk.bin` `damage` changes after it was opened.
fn damaged(
    tag: &str,
    damage: impl FnOnce(&std::fs::File, &TrunkJson),
) -> (Spec, fixture::Written, Arc<TrunkLayout>) {
    let spec = Spec::small(3, 2);
    let w = fixture::write(&spec, tag);
    let layout = packed_layout(&w);
    let packed = w.dir.join("packed");
    let json = std::fs::read_to_string(packed.join("trunk.json")).unwrap();
    let f = (std::fs::OpenOptions::new().write(true))
        .open(packed.join(TRUNK_BIN))
        .unwrap();
    damage(&f, &serde_json::from_str(&json).unwrap());
    (spec, w, layout)
}

/// Arena bytes of layer `l`.
fn ext(layout: &TrunkLayout, l: usize) -> u64 {
    extent_bytes(layout, l)
}

/// A standalone worker's ring: one reader (id 0) reading ahead from `first`, waiting at most
/// `timeout_ms` while its own pins leave no room.
fn private(layout: Arc<TrunkLayout>, first: usize, bytes: u64, timeout_ms: u64) -> Ring {
    let mem = ArenaMem::new(bytes as usize).unwrap();
    let opts = RingOptions::private(Duration::from_millis(timeout_ms));
    let r = Ring::new(layout, first, mem, opts).unwrap();
    r.position(0, first);
    r
}

/// The store's ring: leases last `lease_ms` after a hand-out or a pass.
fn shared(layout: Arc<TrunkLayout>, first: usize, bytes: u64, lease_ms: u64) -> Ring {
    let mem = ArenaMem::new(bytes as usize).unwrap();
    let opts = RingOptions {
        lease_timeout: Duration::from_millis(lease_ms),
        idle_protect: Duration::from_millis(lease_ms),
        demand_timeout: Duration::from_millis(lease_ms),
    };
    Ring::new(layout, first, mem, opts).unwrap()
}

/// `run` is layer `l`'s run as the checkpoint has it.
fn verify(spec: &Spec, layout: &TrunkLayout, l: usize, run: &[u8]) {
    let plan = layout.plan(l).unwrap();
    assert_eq!(
        plan.layout.tensors().len(),
        fixture::trunk_tensors(spec, l).len()
    );
    assert_eq!(run.len() as u64, plan.run_len);
    for t in plan.layout.tensors() {
        let got = &run[t.off as usize..(t.off + t.nbytes) as usize];
        assert!(
            got == &fixture::expected_tensor(spec, &t.name)[..],
            "layer {l}: {} has other bytes",
            t.name
        );
    }
}

/// The bytes a lease points at are layer `l`'s run (read through an arena guard: the reader
/// thread is refused a write over them meanwhile, so a wrong lease shows as a failed read).
fn check(spec: &Spec, layout: &TrunkLayout, r: &Ring, l: usize, g: Grant) {
    let run = r.sh.mem.read(g.offset as usize, g.len as usize).unwrap();
    verify(spec, layout, l, &run);
}

impl Ring {
    /// Wait until the reader thread has nothing left to do (read-ahead done as far as the arena
    /// allows, or parked on a partial read).
    fn quiesce(&self) {
        let sh = &self.sh;
        let mut g = sh.lock();
        while g.reading
            || (g.next_read(&sh.geo, Instant::now()).is_some()
                && !g.extents.iter().any(|e| e.parked))
        {
            g = sh.wait(g, Duration::from_millis(20));
        }
    }

    /// Streamed layers in the arena (any state), ascending.
    fn present(&self) -> Vec<usize> {
        self.sh.lock().present()
    }
}

// ---- One reader holding pins (a standalone worker's stream) ----

/// SPEC.md I38: whatever the arena size, the reader thread reading ahead while the engine
/// "computes" a layer (random sleeps) never overwrites the layer in use.
#[test]
fn read_ahead_never_overwrites_the_layer_in_use() {
    let spec = Spec::small(3, 2);
    let w = fixture::write(&spec, "i38");
    for layout in [packed_layout(&w), catalog_layout(&w)] {
        let min = Ring::min_bytes(&*layout, 0);
        let all: u64 = (0..3).map(|l| ext(&layout, l)).sum();
        for (k, bytes) in [min, ext(&layout, 1) + ext(&layout, 2), all - 4096, all]
            .into_iter()
            .enumerate()
        {
            let bytes = bytes.max(min);
            let r = private(layout.clone(), 0, bytes, 10_000);
            let mut rng = Rng(7 + k as u64);
            for step in 0..60 {
                let l = step % 3;
                let pin = r.pin(0, l).unwrap();
                verify(&spec, &layout, l, pin.bytes());
                r.position(0, (l + 1) % 3);
                std::thread::sleep(Duration::from_micros(rng.below(3000)));
                // Still this layer's bytes after the reader had time to run.
                verify(&spec, &layout, l, pin.bytes());
                drop(pin);
                if rng.below(4) == 0 {
                    std::thread::sleep(Duration::from_micros(rng.below(2000)));
                }
            }
            let lt = r.lifetime();
            assert_eq!(r.len() as u64, bytes);
            assert_eq!(lt.evicted_unused, 0, "{lt:?}");
            assert_eq!(lt.served, 60);
            if bytes >= all {
                // Everything fits: each layer is read once.
                assert_eq!(lt.layer_reads, 3, "{lt:?}");
            } else {
                // At most once per layer per pass (+ read-ahead into the next pass), at least
                // once per pass (the three never fit together).
                assert!((20..=63).contains(&lt.layer_reads), "{lt:?}");
            }
        }
    }
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// The reader thread works ahead in scan order as far as the arena allows, without being
/// asked, and the layer handed out next is then already in memory.
#[test]
fn the_next_layers_are_read_while_the_current_one_is_in_use() {
    let (spec, w, layout) = small(6, "ahead");
    let n = 6;
    let exts: Vec<u64> = (0..n).map(|l| ext(&layout, l)).collect();
    // Arena: layer 1 plus the two after it, exactly (layer 0 is not streamed).
    let bytes = exts[1] + exts[2] + exts[3];
    let r = private(layout.clone(), 1, bytes, 10_000);
    let pin1 = r.pin(0, 1).unwrap();
    r.quiesce();
    // While layer 1 is held, 2 and 3 were read ahead; 4 does not fit.
    assert_eq!(r.present(), vec![1, 2, 3]);
    assert_eq!(r.lifetime().layer_reads, 3);
    verify(&spec, &layout, 1, pin1.bytes());
    drop(pin1);
    r.quiesce();
    // Layer 1 (needed last in the scan 2, 3, 4, 5, 1) may now go: 4 is read, if it fits in the
    // space 1 left; nothing needed sooner than 4 was dropped.
    assert!(r.present().contains(&2) && r.present().contains(&3));
    assert_eq!(r.lifetime().evicted_unused, 0);
    // A whole pass: 2 and 3 were ready on demand.
    let before = r.lifetime().ready_on_demand;
    for l in 2..n {
        verify(&spec, &layout, l, r.pin(0, l).unwrap().bytes());
    }
    assert!(
        r.lifetime().ready_on_demand >= before + 2,
        "{:?}",
        r.lifetime()
    );
    // Many passes: each streamed layer read once per pass, no read-ahead wasted.
    let reads0 = r.lifetime().layer_reads;
    // The reader is given time to read ahead between layers (as a forward's compute gives it):
    // without it, how much read-ahead wins the race against the next demand is up to the
    // scheduler, and a loaded machine (CI) reads on demand.
    for _ in 0..10 {
        for l in 1..n {
            verify(&spec, &layout, l, r.pin(0, l).unwrap().bytes());
            r.quiesce();
        }
    }
    let lt = r.lifetime();
    let passes = lt.layer_reads - reads0;
    // At most one read per layer per pass (+ the read-ahead into the next pass); fewer when a
    // layer was still in the arena from the previous pass.
    assert!(
        passes <= 10 * 5 + 3,
        "{passes} reads for 10 passes of 5 streamed layers: {lt:?}"
    );
    assert_eq!(lt.evicted_unused, 0, "{lt:?}");
    assert!(lt.ready_on_demand >= 10 * 3, "{lt:?}");
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// The next layer does not fit beside the one in use: its free part is read at once, the rest
/// after the layer in use is released — and the layer in use is never touched.
#[test]
fn a_partial_read_ahead_fills_around_the_layer_in_use() {
    let spec = Spec::small(6, 2);
    let w = fixture::write(&spec, "partial");
    for layout in [packed_layout(&w), catalog_layout(&w)] {
        assert!((0..6).all(|l| layout.windowed(l)));
        let (e1, e2) = (ext(&layout, 1), ext(&layout, 2));
        let min = Ring::min_bytes(&*layout, 1);
        // Layer 2 overlaps the held layer 1 by two pages.
        let bytes = (e1 + e2 - 2 * 4096).max(min);
        let r = private(layout.clone(), 1, bytes, 300);
        let pin1 = r.pin(0, 1).unwrap();
        r.quiesce();
        let lt = r.lifetime();
        assert_eq!(lt.early_bytes, e2 - (e1 + e2 - bytes), "{lt:?}");
        assert_eq!(lt.partial_reads, 1, "{lt:?}");
        assert_eq!(r.present(), vec![1, 2]);
        // Asking for layer 2 while holding the layer it waits for fails instead of hanging.
        let e = r.pin(0, 2).err().unwrap();
        assert!(
            matches!(&e, RingError::Stuck(m) if m.contains("layers in use fill")),
            "{e}"
        );
        verify(&spec, &layout, 1, pin1.bytes());
        drop(pin1);
        let pin2 = r.pin(0, 2).unwrap();
        verify(&spec, &layout, 2, pin2.bytes());
        assert_eq!(r.lifetime().layer_reads, 2);
        drop(pin2);
        // The scan goes on from layer 3, then five whole passes.
        // Each layer is held until the reader has begun the next one around it (as a forward's
        // compute gives it time to), so every step of the scan is a partial read; without the
        // wait, whether the read-ahead wins the race against the next demand is up to the
        // scheduler, and a loaded machine (CI) reads on demand.
        for l in (3..6).chain((0..5).flat_map(|_| 1..6)) {
            let pin = r.pin(0, l).unwrap();
            r.quiesce();
            verify(&spec, &layout, l, pin.bytes());
        }
        let lt = r.lifetime();
        assert!(lt.early_bytes > e2 && lt.evicted_unused == 0, "{lt:?}");
    }
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// A layer asked out of scan order is read at once, over read-ahead nobody used if need be.
#[test]
fn an_out_of_order_demand_takes_the_space_of_unused_read_ahead() {
    let (spec, w, layout) = small(5, "order");
    let min = Ring::min_bytes(&*layout, 0);
    let r = private(layout.clone(), 0, min, 10_000);
    r.quiesce();
    // Nothing asked yet: the reader thread read layer 0 ahead.
    assert_eq!(r.present(), vec![0]);
    let pin3 = r.pin(0, 3).unwrap();
    verify(&spec, &layout, 3, pin3.bytes());
    assert_eq!(r.lifetime().evicted_unused, 1);
    drop(pin3);
    // The scan continues after 3: 4 is read next to 3 (both fit in the dense layer 0's size);
    // 0, the largest, would need 4's space and 4 is needed sooner.
    r.quiesce();
    assert_eq!(r.present(), vec![3, 4]);
    verify(&spec, &layout, 0, r.pin(0, 0).unwrap().bytes());
    std::fs::remove_dir_all(&w.dir).unwrap();
}

#[test]
fn holding_a_layer_that_leaves_no_room_errors_instead_of_hanging() {
    let (spec, w, layout) = small(3, "hold");
    let min = Ring::min_bytes(&*layout, 0);
    assert!(ext(&layout, 0) + ext(&layout, 1) > min);
    let r = private(layout.clone(), 0, min, 200);
    let pin0 = r.pin(0, 0).unwrap();
    let e = r.pin(0, 1).err().unwrap();
    assert!(e.to_string().contains("layers in use fill"), "{e}");
    verify(&spec, &layout, 0, pin0.bytes());
    // The same layer twice shares the extent.
    let again = r.pin(0, 0).unwrap();
    assert_eq!(again.bytes().as_ptr(), pin0.bytes().as_ptr());
    verify(&spec, &layout, 0, again.bytes());
    drop((pin0, again));
    verify(&spec, &layout, 1, r.pin(0, 1).unwrap().bytes());
    assert!(matches!(r.pin(0, 3), Err(RingError::BadLayer(_))));
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// A byte flipped in `trunk.bin` after the trunk was opened: the layer fails its read (every
/// time it is asked for), the other layers are served.
#[test]
fn a_damaged_layer_fails_its_reads() {
    let (spec, w, layout) = damaged("sflip", |f, json| {
        use std::os::unix::fs::FileExt;
        let at = json.layers[1].file_off + 7;
        f.write_all_at(&[0xa5, 0x5a, 0xa5], at).unwrap();
    });
    let min = Ring::min_bytes(&*layout, 0);
    for bytes in [min, 3 * min] {
        let r = private(layout.clone(), 0, bytes, 5000);
        verify(&spec, &layout, 0, r.pin(0, 0).unwrap().bytes());
        let e = r.pin(0, 1).err().unwrap().to_string();
        assert!(e.contains("trunk layer 1") && e.contains("checksum"), "{e}");
        verify(&spec, &layout, 2, r.pin(0, 2).unwrap().bytes());
        assert!(matches!(r.pin(0, 1), Err(RingError::Read(_))));
        assert!(r.lifetime().verify_seconds > 0.0);
    }
    // Leased the same way: every worker waiting for it gets the error.
    let r = Arc::new(shared(layout.clone(), 0, 3 * min, 10_000));
    std::thread::scope(|s| {
        for wkr in 1..=2u64 {
            let r = r.clone();
            s.spawn(move || {
                let e = r.acquire(wkr, 1).unwrap_err().to_string();
                assert!(e.contains("checksum"), "{e}");
            });
        }
    });
    std::fs::remove_dir_all(&w.dir).unwrap();
}

#[test]
fn read_failure_is_reported_for_that_layer() {
    // Truncate trunk.bin inside layer 2's run.
    let (spec, w, layout) = damaged("sfail", |f, json| {
        f.set_len(json.layers[2].file_off + 10).unwrap();
    });
    let min = Ring::min_bytes(&*layout, 0);
    for bytes in [min, 3 * min] {
        let r = private(layout.clone(), 0, bytes, 5000);
        verify(&spec, &layout, 0, r.pin(0, 0).unwrap().bytes());
        let e = r.pin(0, 2).err().unwrap().to_string();
        assert!(
            e.contains("trunk.bin") && e.contains("trunk layer 2"),
            "{e}"
        );
        verify(&spec, &layout, 1, r.pin(0, 1).unwrap().bytes());
        // Asked again, the failed layer is read again (and fails again).
        assert!(r.pin(0, 2).is_err());
        verify(&spec, &layout, 0, r.pin(0, 0).unwrap().bytes());
    }
    std::fs::remove_dir_all(&w.dir).unwrap();
}

// ---- Several readers holding leases (the store's attached workers) ----

/// Several workers, each running passes over the streamed layers with random compute times,
/// always get their layer's bytes, never someone else's, whatever the ring size; and workers
/// that run together share reads.
#[test]
fn concurrent_workers_get_their_layers_and_share_reads() {
    let (spec, w, lay) = small(5, "ring-conc");
    let first = 1;
    let largest = (first..5).map(|l| ext(&lay, l)).max().unwrap();
    // Ring sizes: one layer; a layer and a quarter (partial claims beside a leased layer); two;
    // four.
    let quarter = crate::runtime::io::align_up(largest / 4).unwrap();
    let sizes = [largest, largest + quarter, 2 * largest, 4 * largest];
    for (k, bytes) in sizes.into_iter().enumerate() {
        let r = Arc::new(shared(lay.clone(), first, bytes, 10_000));
        let passes = 6;
        let jobs: Vec<RingCounters> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3u64)
                .map(|wkr| {
                    let (r, spec, lay) = (r.clone(), &spec, &lay);
                    s.spawn(move || {
                        let mut rng = Rng(11 + wkr + 7 * k as u64);
                        for _ in 0..passes {
                            for l in first..5 {
                                let g = r.acquire(wkr, l).unwrap();
                                check(spec, lay, &r, l, g);
                                std::thread::sleep(Duration::from_micros(rng.below(1500)));
                                check(spec, lay, &r, l, g);
                            }
                            r.end_pass(wkr).unwrap();
                        }
                        r.remove(wkr)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let lt = r.lifetime();
        assert_eq!(lt.served, 3 * passes * 4, "{lt:?}");
        for j in &jobs {
            // Every hand-out is either the first use of a read (charged) or a shared one.
            assert_eq!(j.served, passes * 4, "{j:?}");
            assert_eq!(j.layer_reads + j.shared, j.served, "{j:?}");
        }
        // Each read is charged to one job at most.
        let charged: u64 = jobs.iter().map(|j| j.layer_reads).sum();
        assert!(charged <= lt.layer_reads, "{charged} > {lt:?}");
        assert!(jobs.iter().map(|j| j.bytes_read).sum::<u64>() <= lt.bytes_read);
        // Three workers that run together: far fewer reads than three private streams.
        assert!(
            lt.layer_reads <= 2 * passes * 4,
            "ring {bytes}: {} reads for {} hand-outs",
            lt.layer_reads,
            lt.served
        );
        assert_eq!(lt.broken, 0);
    }
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// One worker alone: each streamed layer is read once per pass (ring of one layer) or once in
/// all (a ring holding them all); in a ring of a layer and a quarter the next layer's read
/// begins beside the held one (a partial claim) and its bytes are right.
#[test]
fn one_worker_reads_each_layer_once_per_pass() {
    let (spec, w, lay) = small(4, "ring-one");
    let all: u64 = (0..4).map(|l| ext(&lay, l)).sum();
    let largest = Ring::min_bytes(&*lay, 0);
    assert!((0..4).all(|l| lay.windowed(l)), "contiguous runs");
    let quarter = crate::runtime::io::align_up(largest / 4).unwrap();
    // (ring, reads in all, some reads begin beside the leased layer: must, must not, may)
    for (bytes, want, partial) in [
        (largest, 4 * 5, None),
        (largest + quarter, 4 * 5, Some(true)),
        (all, 4, Some(false)),
    ] {
        let r = shared(lay.clone(), 0, bytes, 10_000);
        for _ in 0..5 {
            for l in 0..4 {
                let g = r.acquire(1, l).unwrap();
                check(&spec, &lay, &r, l, g);
                // Compute on it a while: the reader reads ahead meanwhile where it can.
                std::thread::sleep(Duration::from_millis(2));
                check(&spec, &lay, &r, l, g);
            }
            r.end_pass(1).unwrap();
        }
        let lt = r.lifetime();
        // (+1: the next pass's first layer may already have been read ahead.)
        assert!((want..=want + 1).contains(&lt.layer_reads), "{lt:?}");
        if let Some(p) = partial {
            assert_eq!(lt.partial_reads > 0, p, "ring {bytes}: {lt:?}");
        }
        assert_eq!(r.job(1).served, 20);
        assert_eq!(r.remove(1).layer_reads, want);
    }
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// A worker that keeps its lease past the limit while another waits loses it: the other goes on,
/// and the holder's next call fails with `Broken`, whether it is its next layer's `acquire` or
/// its `release_lease` (`ReleaseTrunk` after the expert wait the lease outlived).
#[test]
fn a_stalled_lease_is_broken_and_reported() {
    let (spec, w, lay) = small(3, "ring-stall");
    let largest = Ring::min_bytes(&*lay, 0);
    for (k, by_release) in [false, true].into_iter().enumerate() {
        // Room for one layer: a held lease blocks every other read.
        let r = Arc::new(shared(lay.clone(), 0, largest, 300));
        let g = r.acquire(1, 0).unwrap();
        check(&spec, &lay, &r, 0, g);
        let t0 = Instant::now();
        let g2 = r.acquire(2, 1).unwrap();
        check(&spec, &lay, &r, 1, g2);
        assert!(
            t0.elapsed() >= Duration::from_millis(250),
            "{:?}",
            t0.elapsed()
        );
        let reported = if by_release {
            r.release_lease(1)
        } else {
            r.acquire(1, 1).map(|_| ())
        };
        match reported {
            Err(RingError::Broken(m)) => assert!(m.contains("broke its lease"), "{m}"),
            other => panic!("release {by_release}: {other:?}"),
        }
        assert_eq!(r.lifetime().broken, 1, "round {k}");
        // Reported once: the worker may start over.
        r.end_pass(2).unwrap();
        r.release_lease(1).unwrap();
        let g = r.acquire(1, 2).unwrap();
        check(&spec, &lay, &r, 2, g);
        assert!(matches!(r.acquire(1, 7), Err(RingError::BadLayer(_))));
    }
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// A pin is never broken: a leasing worker waiting for the room a pin holds waits for it,
/// however short the lease limit.
#[test]
fn a_pin_is_never_broken() {
    let (spec, w, lay) = small(3, "ring-pin");
    let largest = Ring::min_bytes(&*lay, 0);
    let opts = RingOptions {
        lease_timeout: Duration::from_millis(100),
        idle_protect: Duration::from_millis(100),
        demand_timeout: Duration::from_secs(60),
    };
    let mem = ArenaMem::new(largest as usize).unwrap();
    let r = Arc::new(Ring::new(lay.clone(), 0, mem, opts).unwrap());
    let pin = r.pin(9, 0).unwrap();
    let r2 = r.clone();
    let waiter = std::thread::spawn(move || r2.acquire(1, 1));
    std::thread::sleep(Duration::from_millis(600));
    verify(&spec, &lay, 0, pin.bytes());
    assert_eq!(r.lifetime().broken, 0);
    assert!(!waiter.is_finished(), "a lease was handed out over a pin");
    drop(pin);
    let g = waiter.join().unwrap().unwrap();
    check(&spec, &lay, &r, 1, g);
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// `release_lease` (`ReleaseTrunk`) frees the extent mid-pass: in a ring of one layer, another
/// worker's layer is read at once instead of waiting for the holder's lease to time out, and the
/// holder's next request is not a broken lease.
#[test]
fn a_lease_given_back_mid_pass_frees_the_extent_at_once() {
    let (spec, w, lay) = small(3, "ring-release");
    let largest = Ring::min_bytes(&*lay, 0);
    // Room for one layer, and a lease limit far beyond the test's patience.
    let r = shared(lay.clone(), 0, largest, 60_000);
    let g = r.acquire(1, 0).unwrap();
    check(&spec, &lay, &r, 0, g);
    r.release_lease(1).unwrap();
    let t0 = Instant::now();
    let g2 = r.acquire(2, 1).unwrap();
    check(&spec, &lay, &r, 1, g2);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(r.lifetime().broken, 0);
    r.end_pass(2).unwrap();
    // The holder goes on with its pass.
    let g = r.acquire(1, 1).unwrap();
    check(&spec, &lay, &r, 1, g);
    r.end_pass(1).unwrap();
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// A worker starting its pass while another is mid-pass joins the convoy within one sweep: after
/// that every layer is read once for both.
#[test]
fn a_late_worker_joins_the_convoy() {
    let (_, w, lay) = small(6, "ring-join");
    let largest = Ring::min_bytes(&*lay, 0);
    let r = Arc::new(shared(lay.clone(), 0, 2 * largest, 10_000));
    let passes = 8;
    std::thread::scope(|s| {
        for (wkr, delay_ms) in [(1u64, 0u64), (2, 30)] {
            let r = r.clone();
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(delay_ms));
                for _ in 0..passes {
                    for l in 0..6 {
                        r.acquire(wkr, l).unwrap();
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    r.end_pass(wkr).unwrap();
                }
                r.remove(wkr);
            });
        }
    });
    let lt = r.lifetime();
    assert_eq!(lt.served, 2 * passes * 6);
    // Private streams would read 96; the convoy reads each layer once per sweep plus at most
    // about a sweep and a half while the second worker joins and the first leaves.
    assert!(lt.layer_reads <= passes * 6 + 9, "{lt:?}");
    std::fs::remove_dir_all(&w.dir).unwrap();
}

/// A stopped ring wakes its waiters with `Stopping`.
#[test]
fn a_shutdown_wakes_the_waiters() {
    let (_, w, lay) = small(3, "ring-stop");
    let largest = Ring::min_bytes(&*lay, 0);
    let r = Arc::new(shared(lay.clone(), 0, largest, 60_000));
    let _held = r.acquire(1, 0).unwrap();
    let r2 = r.clone();
    let waiter = std::thread::spawn(move || r2.acquire(2, 1));
    std::thread::sleep(Duration::from_millis(100));
    r.shutdown();
    assert_eq!(waiter.join().unwrap(), Err(RingError::Stopping));
    std::fs::remove_dir_all(&w.dir).unwrap();
}
