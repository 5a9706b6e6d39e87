//! The store path end to end without the engine: an in-process daemon (real `StoreBackend` over
//! a memfd, real `Server` on a Unix socket) on the tiny fixture, and a worker's `AttachedSource`
//! next to a `StandaloneSource` over the same checkpoint. Every byte the engine could ask for
//! must be identical, and the TRUE resident hit rate must behave as defined.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use k3_proto::names::MODEL_TENSORS;
use k3_store::attach::{AttachOptions, AttachedSource};
use k3_store::daemon::backend::{BuildOptions, StoreBackend};
use k3_store::daemon::Server;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::plan::{Budget, BudgetFlag};
use k3_store::runtime::source::WeightSource;
use k3_store::runtime::standalone::{StandaloneOptions, StandaloneSource};
use k3_store::runtime::stream::TrunkStream;
use k3_store::runtime::trunk::{open_shards, TrunkLayout};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/model")
}

struct Store {
    /// Removed when the store (after its server thread) is dropped.
    _dir: tempfile::TempDir,
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Drop for Store {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start_store(tag: &str, pinned: usize, slots: usize) -> Store {
    start_store_ring(tag, pinned, slots, None)
}

/// A store whose trunk ring is `ring` bytes (default: twice the largest streamed layer).
fn start_store_ring(tag: &str, pinned: usize, slots: usize, ring: Option<u64>) -> Store {
    let dir = tempfile::Builder::new()
        .prefix(&format!("k3-attach-{tag}-"))
        .tempdir()
        .unwrap();
    let trunk = dir.path().join("trunk");
    let (cat, _) = Catalog::open_dir(&tiny()).unwrap();
    k3_store::runtime::trunk::pack_trunk(
        &cat,
        &trunk,
        &k3_store::runtime::trunk::PackOptions::new(k3_store::runtime::trunk::TrunkCodec::Raw),
        &k3_store::runtime::trunk::Interrupt::never(),
        &mut |_| {},
    )
    .unwrap();
    let layout = TrunkLayout::from_packed(&cat, open_shards(&cat).unwrap(), &trunk).unwrap();
    let backend = StoreBackend::build(
        &BuildOptions {
            model_dir: tiny(),
            trunk_dir: Some(trunk),
            draft: None,
            pinned_layers: pinned,
            slots,
            io_threads: 2,
            cache_policy: "lru".into(),
            preset: "test".into(),
            plan_text: String::new(),
            ring_bytes: ring.unwrap_or(2 * TrunkStream::min_ring_bytes(&layout, pinned)),
            preload: Default::default(),
            usage: None,
            ring: Default::default(),
            identity: k3_store::runtime::identity::ModelIdentity::of(&cat)
                .unwrap()
                .id,
        },
        |_, _| {},
    )
    .unwrap();
    assert_eq!(backend.pinned_layers() as usize, pinned);
    let socket = dir.path().join("store.sock");
    let listener = k3_store::ipc::bind(&socket).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let server = Server::new(listener, socket.clone(), backend, stop.clone());
    let thread = Some(std::thread::spawn(move || server.run()));
    Store {
        _dir: dir,
        socket,
        stop,
        thread,
    }
}

fn standalone() -> StandaloneSource {
    let budget = Budget::from_flags(&[BudgetFlag::TrunkGb(1.0), BudgetFlag::CacheGb(0.5)]).unwrap();
    let opts = StandaloneOptions {
        check_memory: false,
        ..Default::default()
    };
    StandaloneSource::open(&tiny(), None, &budget, None, &opts, &mut |_, _, _| {})
        .unwrap()
        .0
}

#[test]
fn attached_bytes_equal_standalone_bytes() {
    let store = start_store("bytes", 5, 32);
    let (att, info) = AttachedSource::attach(&store.socket, &AttachOptions::default()).unwrap();
    assert_eq!(info.pinned_layers, 5);
    assert!(
        info.ring_bytes > 0,
        "13 layers, 5 pinned: the rest stream through the store's ring"
    );
    let alone = standalone();
    for name in MODEL_TENSORS {
        assert_eq!(
            att.model_tensor(name).unwrap().bytes(),
            alone.model_tensor(name).unwrap().bytes(),
            "{name}"
        );
    }
    // Every layer, pinned (mapped from the store) or streamed (leased from the store's ring), with
    // prefetch of the next layer as the engine does.
    for _pass in 0..2 {
        for l in 0..13 {
            let a = att.layer(l).unwrap();
            att.prefetch_layer(l + 1);
            let b = alone.layer(l).unwrap();
            assert_eq!(a.layer, l);
            for t in b.layout.tensors() {
                let ta = a.layout.get(&t.name).expect("same tensors");
                let ra = &a.region.bytes()[ta.off as usize..(ta.off + ta.nbytes) as usize];
                let rb = &b.region.bytes()[t.off as usize..(t.off + t.nbytes) as usize];
                assert_eq!(ra, rb, "layer {l} {}", t.name);
            }
        }
    }
    // Experts, including layer 1 expert 3 (the fixture's non-contiguous one).
    let mut rng = 0x1234_5678u64;
    for step in 0..40 {
        let l = 1 + (step % 12);
        let mut ids = vec![3u32];
        for _ in 0..3 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            ids.push((rng % 8) as u32);
        }
        let a = att.experts(l, &ids).unwrap();
        let b = alone.experts(l, &ids).unwrap();
        for (i, (x, y)) in a.experts.iter().zip(&b.experts).enumerate() {
            let x = x.as_ref().expect("attached expert loads");
            let y = y.as_ref().expect("standalone expert loads");
            assert_eq!(x.bytes(), y.bytes(), "layer {l} expert {}", ids[i]);
        }
    }
}

#[test]
fn second_job_hits_what_the_first_loaded() {
    let store = start_store("warm", 13, 64);
    let ids: Vec<u32> = vec![0, 5];
    let first_pass = |att: &AttachedSource| {
        for l in 1..13 {
            let b = att.experts(l, &ids).unwrap();
            assert!(b.experts.iter().all(|e| e.is_ok()));
        }
    };
    {
        let (a1, _) = AttachedSource::attach(&store.socket, &AttachOptions::default()).unwrap();
        first_pass(&a1);
        let c = a1.job_counters().unwrap();
        assert_eq!(c.requests, 24);
        assert_eq!(
            c.resident_hits, 0,
            "cold store: nothing resident before the first job"
        );
        let eb = k3_proto::expert::ExpertLayout {
            inter: 64,
            latent: 64,
        }
        .expert_bytes() as u64;
        assert_eq!(
            c.expert_bytes_read,
            24 * eb,
            "every miss read exactly one expert"
        );
        // No trunk bytes were read: all 13 layers are pinned in the store.
        for l in 0..13 {
            a1.layer(l).unwrap();
        }
        assert_eq!(a1.stats().trunk_bytes_read, 0);
    }
    let (a2, _) = AttachedSource::attach(&store.socket, &AttachOptions::default()).unwrap();
    first_pass(&a2);
    let c = a2.job_counters().unwrap();
    assert_eq!(
        (c.requests, c.resident_hits, c.expert_bytes_read),
        (24, 24, 0)
    );
    assert!((c.true_resident_hit_rate() - 1.0).abs() < 1e-12);
}

#[test]
fn leases_block_eviction_until_released() {
    // 2 slots, top-2 batches: a live worker's leases keep another worker from evicting them;
    // when the first disconnects (as after SIGKILL) the second proceeds.
    let store = start_store("lease", 13, 2);
    let (a1, _) = AttachedSource::attach(&store.socket, &AttachOptions::default()).unwrap();
    let held = a1.experts(1, &[0, 1]).unwrap();
    let before: Vec<Vec<u8>> = held
        .experts
        .iter()
        .map(|r| r.as_ref().unwrap().bytes().to_vec())
        .collect();
    let sock = store.socket.clone();
    let other = std::thread::spawn(move || {
        let (a2, _) = AttachedSource::attach(&sock, &AttachOptions::default()).unwrap();
        let t0 = std::time::Instant::now();
        let b = a2.experts(2, &[6, 7]).unwrap();
        assert!(b.experts.iter().all(|e| e.is_ok()));
        t0.elapsed()
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Still leased to us: the bytes have not been overwritten by the other worker.
    for (r, b) in held.experts.iter().zip(&before) {
        assert_eq!(r.as_ref().unwrap().bytes(), &b[..]);
    }
    drop(held);
    drop(a1); // disconnect releases the leases
    let waited = other.join().unwrap();
    assert!(
        waited >= std::time::Duration::from_millis(250),
        "the second worker must have waited for the leases, waited {waited:?}"
    );
}

#[test]
fn bad_requests_are_refused_not_fatal() {
    let store = start_store("bad", 2, 8);
    let (a, _) = AttachedSource::attach(&store.socket, &AttachOptions::default()).unwrap();
    assert!(a.experts(99, &[0]).is_err(), "layer out of range");
    assert!(a.experts(1, &[8]).is_err(), "expert out of range");
    assert!(a
        .experts(1, &[0, 1])
        .unwrap()
        .experts
        .iter()
        .all(|e| e.is_ok()));
}

/// The per-layer cost of the shared ring's synchronisation: a `TrunkLayer` request for a layer
/// already in the ring is one socket round trip and a lock. Measured on a ring that holds every
/// streamed layer (after one pass nothing is read again); printed with `--nocapture`, and bounded
/// far below a layer's compute (tens of ms at `k3slice`'s real dimensions, ~0.1 s and more at
/// full scale).
#[test]
fn a_ring_hand_out_costs_a_socket_round_trip() {
    let (cat, _) = Catalog::open_dir(&tiny()).unwrap();
    let layout = TrunkLayout::from_catalog(&cat, open_shards(&cat).unwrap());
    // Room for every layer (each extent is at most the largest one).
    let all = 13 * TrunkStream::min_ring_bytes(&layout, 0);
    let store = start_store_ring("handout", 0, 32, Some(all));
    let (att, info) = AttachedSource::attach(&store.socket, &AttachOptions::default()).unwrap();
    assert_eq!((info.pinned_layers, info.ring_bytes >= all), (0, true));
    for l in 0..13 {
        att.layer(l).unwrap();
    }
    att.end_pass().unwrap();
    let mut times = Vec::new();
    for _pass in 0..20 {
        for l in 0..13 {
            let t0 = std::time::Instant::now();
            let run = att.layer(l).unwrap();
            times.push(t0.elapsed().as_secs_f64());
            assert_eq!(run.layer, l);
        }
        att.end_pass().unwrap();
    }
    let st = att.stats();
    assert_eq!(st.trunk_layers_served, 21 * 13);
    assert_eq!(
        st.trunk_shared_layers,
        20 * 13,
        "no layer read twice: {st:?}"
    );
    times.sort_by(f64::total_cmp);
    let (median, p90) = (times[times.len() / 2], times[times.len() * 9 / 10]);
    println!(
        "ring hand-out of a present layer: median {:.1} us, p90 {:.1} us over {} hand-outs",
        median * 1e6,
        p90 * 1e6,
        times.len()
    );
    assert!(median < 2e-3, "median hand-out {median} s");
}

/// Raw ring requests a buggy or hostile client could send: a pinned or unknown layer is an error
/// answer and the connection goes on; a control client may not lease trunk layers; a good
/// request is answered with a run inside the mapping's ring.
#[test]
fn bad_trunk_requests_are_refused_not_fatal() {
    use k3_proto::wire::{ClientKind, ErrorCode, Request, Response};
    use k3_store::attach::client::Client;
    let store = start_store("badtrunk", 2, 8);
    let mut w = Client::connect(&store.socket, ClientKind::Worker, "raw worker").unwrap();
    for layer in [1u32, 13, 99, u32::MAX] {
        match w.call(&Request::TrunkLayer { layer }).unwrap() {
            Response::Error { code, message } => {
                assert_eq!(code, ErrorCode::BadRequest, "layer {layer}: {message}");
                assert!(message.contains(&format!("layer {layer}")), "{message}");
            }
            other => panic!("layer {layer}: {other:?}"),
        }
    }
    match w.call(&Request::TrunkLayer { layer: 5 }).unwrap() {
        Response::TrunkLayer { len, fresh, .. } => assert!(len > 0 && fresh),
        other => panic!("{other:?}"),
    }
    // ReleaseTrunk (v6) gives the trunk lease back mid-pass and keeps the expert leases; EndPass
    // gives both back.
    let leased = |w: &mut Client| match w.call(&Request::Stats).unwrap() {
        Response::Stats(s) => s.slots_leased,
        other => panic!("{other:?}"),
    };
    match w
        .call(&Request::Experts {
            layer: 5,
            ids: vec![0, 1],
        })
        .unwrap()
    {
        Response::Experts { answers, .. } => assert_eq!(answers.len(), 2),
        other => panic!("{other:?}"),
    }
    assert_eq!(leased(&mut w), 2);
    assert_eq!(w.call(&Request::ReleaseTrunk).unwrap(), Response::Released);
    assert_eq!(
        leased(&mut w),
        2,
        "ReleaseTrunk gave the expert leases back"
    );
    // Twice is harmless.
    assert_eq!(w.call(&Request::ReleaseTrunk).unwrap(), Response::Released);
    assert_eq!(w.call(&Request::EndPass).unwrap(), Response::Released);
    assert_eq!(leased(&mut w), 0, "EndPass kept expert leases");
    // Ending a pass twice is harmless.
    assert_eq!(w.call(&Request::EndPass).unwrap(), Response::Released);
    let mut c = Client::connect(&store.socket, ClientKind::Control, "raw control").unwrap();
    for req in [
        Request::TrunkLayer { layer: 5 },
        Request::EndPass,
        Request::ReleaseTrunk,
    ] {
        match c.call(&req).unwrap() {
            Response::Error { code, .. } => assert_eq!(code, ErrorCode::NotAllowed, "{req:?}"),
            other => panic!("{req:?}: {other:?}"),
        }
    }
    // The worker's connection still works.
    match w.call(&Request::TrunkLayer { layer: 12 }).unwrap() {
        Response::TrunkLayer { len, .. } => assert!(len > 0),
        other => panic!("{other:?}"),
    }
}
