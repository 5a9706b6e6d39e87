//! A store that is still loading its shared memory, seen by the real `k3-ctl` and `k3-worker`.
//!
//! A real load of the bundled fixtures takes milliseconds, too fast to talk to. So the store here
//! is this test binary run again as a child process (`LOADING_SOCKET` set): it claims the
//! socket and runs `k3_store::daemon::loading::load_behind_gate` — what `k3-store start` runs
//! between claiming its socket and serving — with a load that never ends, and exits as the
//! store does when stopped: socket removed, status 0.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_tests::{pid_gone, poll_until, send_signal, Sandbox};

/// Set in the child: the socket to claim.
const LOADING_SOCKET: &str = "K3_TEST_LOADING_SOCKET";

/// The child's part (a no-op in the parent run): a store stuck in its load at 1.5 of 6 GB.
#[test]
fn child_store_that_never_finishes_loading() {
    let Some(sock) = std::env::var_os(LOADING_SOCKET) else {
        return;
    };
    let sock = std::path::PathBuf::from(sock);
    k3_store::ipc::prepare_socket_dir(&sock).expect("socket dir");
    let listener = k3_store::ipc::bind(&sock).expect("bind");
    let stop = Arc::new(AtomicBool::new(false));
    let hup = Arc::new(AtomicBool::new(false));
    k3_store::daemon::install_signal_handlers(&stop, &hup).expect("signal handlers");
    let state = k3_store::daemon::loading::LoadState::new("/models/k3", "server");
    state.set(1_500_000_000, 6_000_000_000);
    let dirs = ("/models/k3".to_string(), "/models/k3-trunk".to_string());
    let (loaded, _listener) =
        k3_store::daemon::loading::load_behind_gate(listener, state, stop.clone(), dirs, || {
            std::thread::sleep(Duration::from_secs(3600))
        })
        .expect("gate");
    assert!(matches!(loaded, k3_store::daemon::loading::Loaded::Stopped));
    assert!(stop.load(Ordering::SeqCst));
    std::fs::remove_file(&sock).expect("remove the socket");
    std::process::exit(0);
}

/// A test of this file as the test binary names it: `FILE::NAME` (every file is a module of one
/// binary; `--exact` needs the whole path).
fn test_path(name: &str) -> String {
    match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

/// The child store; killed if a test ends without having stopped it.
struct Store(Child);

impl Drop for Store {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Start the child store; returns once its socket answers.
fn loading_store(sb: &Sandbox) -> Store {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &test_path("child_store_that_never_finishes_loading"),
            "--nocapture",
        ])
        .env(LOADING_SOCKET, &sb.socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the loading store");
    let store = Store(child);
    let up = poll_until(Duration::from_secs(20), || sb.socket.exists().then_some(()));
    assert!(up.is_some(), "the loading store never claimed its socket");
    store
}

fn exited(store: &mut Store, within: Duration) -> Option<i32> {
    poll_until(within, || {
        (store.0)
            .try_wait()
            .expect("wait")
            .map(|s| s.code().unwrap_or(-1))
    })
}

#[test]
fn a_loading_store_says_so_to_status_and_workers_and_k3_ctl_stop_stops_it() {
    let sb = Sandbox::new("loading-stop");
    let mut store = loading_store(&sb);
    // `k3-ctl status`: how far the load is, on stdout, and exit 3 (not serving yet).
    let t0 = Instant::now();
    let r = sb.ctl(&["status"]);
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stdout.contains("store: loading"), "{r:?}");
    assert!(
        r.stdout.contains("loaded: 1.500 of 6.000 GB (25%)"),
        "{r:?}"
    );
    assert!(r.stdout.contains("preset: server"), "{r:?}");
    // A worker is told at once (not after a 30 s handshake timeout), exit 3.
    let w = sb.worker(&["--ids", "1,2,3", "--gen", "2"]);
    assert_eq!(w.code, 3, "{w:?}");
    assert!(w.stderr.contains("still loading"), "{w:?}");
    assert!(w.stderr.contains("(25%)"), "{w:?}");
    // `k3-ctl stats` cannot report a store that is not serving.
    let s = sb.ctl(&["stats"]);
    assert_eq!(s.code, 3, "{s:?}");
    assert!(s.stderr.contains("still loading"), "{s:?}");
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    // `k3-ctl stop` stops it and returns once it has exited and removed its socket.
    let pid = store.0.id();
    let r = sb.ctl(&["stop"]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("store stopped"), "{r:?}");
    assert!(!sb.socket.exists());
    assert_eq!(exited(&mut store, Duration::from_secs(10)), Some(0));
    assert!(pid_gone(pid));
}

#[test]
fn a_loading_store_stops_at_once_on_sigterm() {
    let sb = Sandbox::new("loading-term");
    let mut store = loading_store(&sb);
    let t0 = Instant::now();
    send_signal(store.0.id(), "TERM");
    assert_eq!(exited(&mut store, Duration::from_secs(10)), Some(0));
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(!sb.socket.exists(), "socket left behind");
}
