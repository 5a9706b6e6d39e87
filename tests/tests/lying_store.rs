//! An attached worker against a store that lies about where an expert is (SPEC §6.5): a proxy
//! between a real store and the worker rewrites the store's `Leased { slot, at }` answers. The
//! worker reads an expert's bytes at `at` inside `slot` of the memory it mapped, so an answer
//! whose expert would run past its slot, or whose slot does not exist, would hand the kernels
//! another slot's bytes (or bytes outside the arena). The worker must refuse it: the expert is
//! not read, it counts as a failed load (its contribution is left out, as for a disk error), and
//! the run ends with exit 4, the message naming the lie and saying that the ids are unsound
//! (README, exit codes).
//!
//! (A lie that stays inside the slot cannot be told from the truth without hashing every expert;
//! the store is trusted that far: same uid, private socket directory, §6.6.)

use std::net::Shutdown;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;

use k3_proto::exit;
use k3_proto::wire::{Response, SlotAnswer};
use k3_store::ipc;
use k3_tests::{
    ids_arg, path_str, reference_greedy, reference_prompt, slot_stride, tiny_model, Sandbox,
};

/// Serve `listen` (in a private directory made for it): every connection is forwarded to
/// `store`, and every answer of the store reaches the worker through `lie`, with the descriptor
/// it carries (the store's memory travels that way at the handshake).
fn lying_proxy(listen: &Path, store: &Path, lie: fn(&mut Response)) {
    let l = ipc::bind(listen).expect("bind the proxy's socket");
    let store = store.to_path_buf();
    thread::spawn(move || {
        for c in l.incoming() {
            let Ok(worker) = c else { return };
            let Ok(upstream) = UnixStream::connect(&store) else {
                return;
            };
            let (mut w_in, mut s_out) =
                (worker.try_clone().unwrap(), upstream.try_clone().unwrap());
            thread::spawn(move || {
                let _ = std::io::copy(&mut w_in, &mut s_out);
                let _ = s_out.shutdown(Shutdown::Write);
            });
            let (mut s_in, mut w_out) = (upstream, worker);
            thread::spawn(move || loop {
                let Ok((mut msg, fd)) = ipc::recv_frame::<Response>(&mut s_in) else {
                    let _ = w_out.shutdown(Shutdown::Both);
                    return;
                };
                lie(&mut msg);
                if ipc::send_frame(&mut w_out, &msg, fd.as_ref().map(|f| f.as_fd())).is_err() {
                    return;
                }
            });
        }
    });
}

/// Every `Leased` answer of an `Experts` response rewritten by `f`.
fn each_leased(msg: &mut Response, f: fn(&mut u32, &mut u32)) {
    if let Response::Experts { answers, .. } = msg {
        for a in answers {
            if let SlotAnswer::Leased { slot, at } = a {
                f(slot, at);
            }
        }
    }
}

/// A worker on the tiny model through a proxy that applies `lie`; returns its run after
/// checking that the same worker through a proxy that lies about nothing gives the reference.
fn run_through(tag: &str, lie: fn(&mut Response)) -> k3_tests::Run {
    let mut sb = Sandbox::new(tag);
    let trunk = sb.pack_tiny_trunk();
    let model = tiny_model();
    let r = sb.start_store(&[
        path_str(&model),
        "--trunk",
        path_str(&trunk),
        "--preset",
        "laptop",
    ]);
    assert_eq!(r.code, 0, "store: {r:?}");
    let ids = ids_arg(&reference_prompt());
    let n = 4;
    let worker = |proxy: &Path| {
        sb.run(
            "k3-worker",
            &[
                "--ids",
                &ids,
                "--gen",
                &n.to_string(),
                "--threads",
                "1",
                "--socket",
                path_str(proxy),
            ],
        )
    };
    // The proxy itself changes nothing: an honest pass-through gives the reference ids.
    let honest = sb.dir.join("honest").join("proxy.sock");
    lying_proxy(&honest, &sb.socket, |_| {});
    let ok = worker(&honest);
    assert_eq!(ok.code, exit::OK, "through an honest proxy: {ok:?}");
    let printed: Vec<u32> = ok
        .stdout
        .split_whitespace()
        .filter_map(|t| t.parse().ok())
        .collect();
    assert_eq!(printed, reference_greedy()[..n].to_vec(), "{ok:?}");

    let lying = sb.dir.join("lying").join("proxy.sock");
    lying_proxy(&lying, &sb.socket, lie);
    let r = worker(&lying);
    // The store stays healthy for honest workers afterwards.
    let again = worker(&honest);
    assert_eq!(again.code, exit::OK, "after the lie: {again:?}");
    sb.stop_store();
    r
}

/// The worker refused the lie: exit 4, the reason in its message, the ids called unsound.
fn assert_refused(r: &k3_tests::Run, why: &str) {
    assert_eq!(r.code, exit::EXPERT_LOAD_FAILED, "{r:?}");
    assert!(r.stderr.contains(why), "{}", r.stderr);
    let unsound = "the generated ids are unsound";
    assert!(r.stderr.contains(unsound), "{}", r.stderr);
}

#[test]
fn an_expert_said_to_run_past_its_slot_is_an_expert_load_failure() {
    // One slot further on: the next slot's expert, inside the store's memory the worker mapped
    // (the most plausible lie: real expert bytes, of another expert).
    let r = run_through("lie-at", |m| {
        each_leased(m, |_, at| *at += slot_stride() as u32);
    });
    assert_refused(&r, "overrun slot");
}

#[test]
fn a_slot_outside_the_arena_is_an_expert_load_failure() {
    let r = run_through("lie-slot", |m| {
        each_leased(m, |slot, _| *slot = u32::MAX);
    });
    assert_refused(&r, "out of range");
}
