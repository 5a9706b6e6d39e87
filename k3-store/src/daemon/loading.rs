//! The store's socket while it loads its shared memory.
//!
//! `k3-store start` claims its socket before the load (a second store on the same socket is
//! refused at once), and the load can take minutes at full scale. Until [`LoadingGate::close`]
//! hands the listener to the [`super::Server`], the gate answers on it, with the server's own
//! handshake (same uid, `Hello` with our protocol version, the same timeouts):
//! - a worker's `Hello` gets [`Response::Loading`] (how far the load is): it reports it and ends;
//! - a control client is welcomed (no memory); `Stop` sets the stop flag — the store then ends
//!   without waiting for the load — and is answered `Stopping`; every other request gets
//!   `Loading`.
//!
//! Without the gate a client would sit in the listen backlog, unanswered, until its handshake
//! timeout, and `k3-ctl stop` could not stop a loading store.
//!
//! The load itself runs on its own thread ([`load_unless_stopped`]) so that a stop ends the
//! store at once, not after the read in progress (one `O_DIRECT` read of a 2.35 GB tensor takes
//! seconds; reading it in smaller pieces to check for a stop between them made the whole load
//! ~30% slower on this machine's disk).

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k3_proto::wire::{self, ClientKind, ErrorCode, LoadingReport, Request, Response};

use super::{accept_one, handshake, read_request, reply, request_name, AcceptBackoff, Limits};

/// How far the load is, shared between the loader (which [`LoadState::set`]s it) and the gate.
pub struct LoadState {
    report: LoadingReport,
    done: AtomicU64,
    total: AtomicU64,
    started: Instant,
}

impl LoadState {
    /// A load of `model_dir` with preset `preset` beginning now, by this process.
    pub fn new(model_dir: &str, preset: &str) -> Arc<LoadState> {
        Arc::new(LoadState {
            report: LoadingReport {
                pid: std::process::id(),
                model_dir: model_dir.to_string(),
                preset: preset.to_string(),
                ..Default::default()
            },
            done: AtomicU64::new(0),
            total: AtomicU64::new(0),
            started: Instant::now(),
        })
    }

    /// `done` of `total` bytes are loaded.
    pub fn set(&self, done: u64, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.done.store(done, Ordering::Relaxed);
    }

    /// The answer a client gets now.
    pub fn report(&self) -> LoadingReport {
        LoadingReport {
            done_bytes: self.done.load(Ordering::Relaxed),
            total_bytes: self.total.load(Ordering::Relaxed),
            seconds: self.started.elapsed().as_secs_f64(),
            ..self.report.clone()
        }
    }
}

/// Answers on the store's socket until the load is done (see the module documentation).
pub struct LoadingGate {
    quit: Arc<AtomicBool>,
    thread: Option<JoinHandle<UnixListener>>,
}

/// What every connection of the gate shares.
struct Gate {
    state: Arc<LoadState>,
    stop: Arc<AtomicBool>,
    limits: Limits,
    /// Checkpoint and packed-trunk directories, for a control client's `Welcome`.
    dirs: (String, String),
    connections: AtomicUsize,
}

impl LoadingGate {
    /// Answer on `listener` (already bound) while the store loads. `stop` is the flag the signal
    /// handlers set; a `Stop` request sets it too. The accept loop ends when `stop` is set or
    /// the gate is closed.
    pub fn open(
        listener: UnixListener,
        state: Arc<LoadState>,
        stop: Arc<AtomicBool>,
        limits: Limits,
        dirs: (String, String),
    ) -> std::io::Result<LoadingGate> {
        listener.set_nonblocking(true)?;
        let quit = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(Gate {
            state,
            stop,
            limits,
            dirs,
            connections: AtomicUsize::new(0),
        });
        let q = quit.clone();
        let thread = std::thread::Builder::new()
            .name("k3-loading".into())
            .spawn(move || accept_loop(listener, &gate, &q))?;
        Ok(LoadingGate {
            quit,
            thread: Some(thread),
        })
    }

    /// Stop answering and give the listener back (within ~100 ms). Clients that connect from now
    /// on wait in its backlog for the server.
    pub fn close(mut self) -> UnixListener {
        self.quit.store(true, Ordering::SeqCst);
        let t = self.thread.take().expect("closed once");
        match t.join() {
            Ok(l) => l,
            // The accept loop does not panic; if it did, there is no listener to serve on.
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

impl Drop for LoadingGate {
    fn drop(&mut self) {
        self.quit.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: UnixListener, gate: &Arc<Gate>, quit: &AtomicBool) -> UnixListener {
    let mut backoff = AcceptBackoff::new();
    while !quit.load(Ordering::SeqCst) && !gate.stop.load(Ordering::SeqCst) {
        // Nothing to evict out of descriptors: a gate's connections end within seconds.
        if let Some(stream) = accept_one(&listener, &mut backoff, " while loading", &|| false) {
            admit(stream, gate);
        }
    }
    listener
}

/// Decrements the gate's connection count when a connection ends.
struct Counted(Arc<Gate>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

fn admit(mut stream: UnixStream, gate: &Arc<Gate>) {
    let accepted = Instant::now();
    if gate.connections.load(Ordering::SeqCst) >= gate.limits.max_connections {
        let _ = stream.set_nonblocking(true);
        reply(
            &mut stream,
            &Response::Error {
                code: ErrorCode::Busy,
                message: format!(
                    "the store is loading and already answers {} connections; try again later",
                    gate.limits.max_connections
                ),
            },
            None,
        );
        return;
    }
    let _ = stream.set_nonblocking(false);
    gate.connections.fetch_add(1, Ordering::SeqCst);
    let counted = Counted(gate.clone());
    if let Err(e) = std::thread::Builder::new()
        .name("k3-loading-conn".into())
        .spawn(move || answer(stream, accepted, &counted.0))
    {
        tracing::warn!("cannot start a connection thread while loading: {e}");
    }
}

/// One connection during the load.
fn answer(mut stream: UnixStream, accepted: Instant, gate: &Gate) {
    let limits = &gate.limits;
    let Some((kind, _label)) = handshake(&mut stream, accepted, limits) else {
        return;
    };
    let loading = || Response::Loading(gate.state.report());
    if kind == ClientKind::Worker {
        reply(&mut stream, &loading(), None);
        return;
    }
    let welcome = Response::Welcome {
        protocol_version: wire::PROTOCOL_VERSION,
        model_dir: gate.dirs.0.clone(),
        trunk_dir: gate.dirs.1.clone(),
        shm_bytes: 0,
        draft_dir: String::new(),
        trunk: Default::default(),
    };
    if !reply(&mut stream, &welcome, None) {
        return;
    }
    // A control client asks at once; one idle for a handshake timeout is closed.
    loop {
        let idle = Some(Instant::now() + limits.handshake_timeout);
        let req = match read_request(&stream, idle, limits.frame_timeout) {
            Ok((req, _fd)) => req,
            Err(_) => return,
        };
        let resp = match req {
            Request::Stop => {
                tracing::info!("stop requested during the load");
                gate.stop.store(true, Ordering::SeqCst);
                Response::Stopping
            }
            Request::Hello { .. } => Response::Error {
                code: ErrorCode::NotAllowed,
                message: "Hello was already exchanged".into(),
            },
            other => {
                tracing::debug!("{} while loading", request_name(&other));
                loading()
            }
        };
        if !reply(&mut stream, &resp, None) {
            return;
        }
    }
}

/// Run `load` (see [`load_unless_stopped`]) while a [`LoadingGate`] answers on `listener`; the
/// listener comes back with the outcome, for the server (or to be dropped on a stop). This is
/// what `k3-store start` does between claiming its socket and serving.
pub fn load_behind_gate<T: Send + 'static>(
    listener: UnixListener,
    state: Arc<LoadState>,
    stop: Arc<AtomicBool>,
    dirs: (String, String),
    load: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<(Loaded<T>, UnixListener)> {
    let gate = LoadingGate::open(listener, state, stop.clone(), Limits::default(), dirs)?;
    let loaded = load_unless_stopped(&stop, load);
    let listener = gate.close();
    Ok((loaded?, listener))
}

/// How [`load_unless_stopped`] ended.
#[derive(Debug)]
pub enum Loaded<T> {
    /// The load returned this.
    Done(T),
    /// `stop` was set first; the load's thread is left to finish or to end with the process.
    Stopped,
    /// The load panicked (the message).
    Panicked(String),
}

/// Run `load` on a thread of its own and wait for it, or only until `stop` is set (checked
/// every 50 ms): a load owns nothing that must be cleaned up — its shared memory goes with the
/// process — so a stop need not wait for the read in progress.
pub fn load_unless_stopped<T: Send + 'static>(
    stop: &AtomicBool,
    load: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<Loaded<T>> {
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("k3-load".into())
        .spawn(move || {
            // Dropping `tx` (at return or in a panic) also wakes the waiter.
            let _tx = tx;
            load()
        })?;
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(Loaded::Stopped);
        }
        match rx.recv_timeout(Duration::from_millis(50)) {
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    Ok(match thread.join() {
        Ok(v) => Loaded::Done(v),
        Err(p) => Loaded::Panicked(
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into()),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_ends_the_wait_without_waiting_for_the_load() {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            s.store(true, Ordering::SeqCst);
        });
        let t0 = Instant::now();
        let r = load_unless_stopped(&stop, || std::thread::sleep(Duration::from_secs(20))).unwrap();
        assert!(matches!(r, Loaded::Stopped), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_finished_load_is_returned_and_a_panic_is_reported() {
        let stop = AtomicBool::new(false);
        let r = load_unless_stopped(&stop, || {
            std::thread::sleep(Duration::from_millis(80));
            7
        })
        .unwrap();
        assert!(matches!(r, Loaded::Done(7)), "{r:?}");
        let r = load_unless_stopped(&stop, || -> u32 { panic!("shard 3 vanished") }).unwrap();
        assert!(
            matches!(&r, Loaded::Panicked(m) if m.contains("shard 3")),
            "{r:?}"
        );
    }
}
