//! The store daemon's server: accept loop, handshake, per-connection dispatch and shutdown.
//!
//! Lifecycle: [`Server::run`] serves until a stop is requested — SIGTERM/SIGINT (handlers only set
//! an atomic flag; a second signal exits at once), or a `Stop` request from `k3-ctl stop`. All
//! causes end in one place: stop accepting, wait (time-capped) for in-flight requests to finish,
//! release every connection's leases, unlink the socket. The shared memory goes away with the
//! process (it is a memfd).
//!
//! Every connection is one thread: the first frame must be `Hello` with our protocol version
//! (else `Refused`, naming both versions), and the peer's uid must be ours (`SO_PEERCRED`).
//! Workers receive the read-only shared-memory descriptor with `Welcome`. A connection's leases
//! are released when it closes — including when the worker is killed with SIGKILL.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k3_proto::wire::{self, ClientKind, Request, Response, StatsReport, StatusReport, WireError};

use crate::ipc;

pub mod backend;
pub mod detach;

/// A connection's identity inside the store.
pub type ConnId = u64;

/// What the server needs from the store proper (the expert cache and its bookkeeping).
pub trait Backend: Send + Sync + 'static {
    /// Lease one layer's experts for `conn`, releasing that connection's earlier leases for the
    /// same layer. Answers are in request order.
    fn experts(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Response;
    /// Release every lease `conn` holds (on `ReleaseAll`).
    fn release_all(&self, conn: ConnId);
    /// A client finished its handshake.
    fn opened(&self, _conn: ConnId, _kind: ClientKind, _label: &str) {}
    /// A client disconnected (cleanly or killed): release everything it held.
    fn closed(&self, conn: ConnId) {
        self.release_all(conn);
    }
    /// Lifetime and per-connection counters.
    fn stats(&self, conn: ConnId) -> StatsReport;
    /// Static description (model, preset, plan, memory).
    fn status(&self) -> StatusReport;
    /// The read-only shared-memory descriptor handed to workers and its size.
    fn worker_fd(&self) -> std::io::Result<(OwnedFd, u64)>;
    /// Checkpoint and packed-trunk directories (sent in `Welcome`).
    fn dirs(&self) -> (String, String);
}

/// Shared server state.
struct Shared<B: Backend> {
    backend: B,
    stop: Arc<AtomicBool>,
    in_flight: AtomicUsize,
    next_id: AtomicU64,
    clients: Mutex<Vec<(ConnId, String)>>,
    started: Instant,
}

/// The daemon's server.
pub struct Server<B: Backend> {
    listener: UnixListener,
    socket: PathBuf,
    shared: Arc<Shared<B>>,
    drain_cap: Duration,
}

impl<B: Backend> Server<B> {
    /// Serve `backend` on an already bound `listener` at `socket`. `stop` is the flag that signal
    /// handlers set (see [`install_signal_handlers`]).
    pub fn new(listener: UnixListener, socket: PathBuf, backend: B, stop: Arc<AtomicBool>) -> Self {
        Server {
            listener,
            socket,
            shared: Arc::new(Shared {
                backend,
                stop,
                in_flight: AtomicUsize::new(0),
                next_id: AtomicU64::new(1),
                clients: Mutex::new(Vec::new()),
                started: Instant::now(),
            }),
            drain_cap: Duration::from_secs(10),
        }
    }

    /// Serve until stopped; then drain and remove the socket. Returns the number of requests
    /// still in flight when the drain cap expired (0 on a clean drain).
    pub fn run(self) -> usize {
        self.listener
            .set_nonblocking(true)
            .expect("set_nonblocking on a listening socket");
        while !self.shared.stop.load(Ordering::SeqCst) {
            // Wait for a connection, waking at least every 100 ms to notice a stop request.
            let mut fds = [nix::poll::PollFd::new(
                self.listener.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u16)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    eprintln!("k3-store: poll failed: {e}");
                    continue;
                }
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let shared = self.shared.clone();
                    std::thread::Builder::new()
                        .name("k3-conn".into())
                        .spawn(move || serve_connection(shared, stream))
                        .map(|_| ())
                        .unwrap_or_else(|e| eprintln!("k3-store: cannot spawn a thread: {e}"));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => eprintln!("k3-store: accept failed: {e}"),
            }
        }
        // One place for every shutdown cause: stop accepting, drain, clean up.
        let _ = std::fs::remove_file(&self.socket);
        let deadline = Instant::now() + self.drain_cap;
        while self.shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.shared.in_flight.load(Ordering::SeqCst)
    }
}

/// SIGTERM and SIGINT set `stop`; a second one exits the process at once (status 1).
pub fn install_signal_handlers(stop: &Arc<AtomicBool>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    for sig in [SIGTERM, SIGINT] {
        // Order matters: the conditional shutdown fires only if `stop` is already set.
        signal_hook::flag::register_conditional_shutdown(sig, 1, stop.clone())?;
        signal_hook::flag::register(sig, stop.clone())?;
    }
    Ok(())
}

struct InFlight<'a>(&'a AtomicUsize);
impl<'a> InFlight<'a> {
    fn enter(c: &'a AtomicUsize) -> InFlight<'a> {
        c.fetch_add(1, Ordering::SeqCst);
        InFlight(c)
    }
}
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_connection<B: Backend>(shared: Arc<Shared<B>>, mut stream: UnixStream) {
    let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
    let me = nix::unistd::getuid().as_raw();
    match ipc::peer_uid(&stream) {
        Ok(uid) if uid == me => {}
        Ok(uid) => {
            let _ = ipc::send_frame(
                &mut stream,
                &Response::Error {
                    message: format!("peer uid {uid} is not the store's uid {me}"),
                },
                None,
            );
            return;
        }
        Err(e) => {
            eprintln!("k3-store: cannot read peer credentials: {e}");
            return;
        }
    }
    // Handshake first.
    let (kind, label) = match ipc::recv_frame::<Request>(&mut stream) {
        Ok((
            Request::Hello {
                protocol_version,
                kind,
                label,
            },
            _,
        )) => {
            if let Some(refusal) = wire::check_version(protocol_version) {
                let _ = ipc::send_frame(&mut stream, &refusal, None);
                return;
            }
            (kind, label)
        }
        Ok((other, _)) => {
            let _ = ipc::send_frame(
                &mut stream,
                &Response::Error {
                    message: format!("the first message must be Hello, got {other:?}"),
                },
                None,
            );
            return;
        }
        Err(_) => return,
    };
    let (model_dir, trunk_dir) = shared.backend.dirs();
    let welcome = |shm_bytes| Response::Welcome {
        protocol_version: wire::PROTOCOL_VERSION,
        model_dir: model_dir.clone(),
        trunk_dir: trunk_dir.clone(),
        shm_bytes,
    };
    let sent = match kind {
        ClientKind::Worker => match shared.backend.worker_fd() {
            Ok((fd, len)) => ipc::send_frame(&mut stream, &welcome(len), Some(fd.as_fd())),
            Err(e) => ipc::send_frame(
                &mut stream,
                &Response::Error {
                    message: format!("cannot share memory: {e}"),
                },
                None,
            ),
        },
        ClientKind::Control => ipc::send_frame(&mut stream, &welcome(0), None),
    };
    if sent.is_err() {
        return;
    }
    shared.backend.opened(id, kind, &label);
    shared
        .clients
        .lock()
        .expect("clients lock")
        .push((id, label));
    loop {
        let req = match ipc::recv_frame::<Request>(&mut stream) {
            Ok((r, _)) => r,
            Err(WireError::Closed) => break,
            Err(e) => {
                let _ = ipc::send_frame(
                    &mut stream,
                    &Response::Error {
                        message: e.to_string(),
                    },
                    None,
                );
                break;
            }
        };
        let _busy = InFlight::enter(&shared.in_flight);
        let resp = match req {
            Request::Hello { .. } => Response::Error {
                message: "Hello was already exchanged".into(),
            },
            Request::Experts { layer, ids } => {
                if kind != ClientKind::Worker {
                    Response::Error {
                        message: "only workers lease experts".into(),
                    }
                } else if shared.stop.load(Ordering::SeqCst) {
                    Response::Error {
                        message: "the store is stopping".into(),
                    }
                } else {
                    shared.backend.experts(id, layer, &ids)
                }
            }
            Request::Stats => {
                let mut s = shared.backend.stats(id);
                s.uptime_seconds = shared.started.elapsed().as_secs_f64();
                Response::Stats(s)
            }
            Request::Status => {
                let mut s = shared.backend.status();
                s.clients = shared
                    .clients
                    .lock()
                    .expect("clients lock")
                    .iter()
                    .map(|(_, l)| l.clone())
                    .collect();
                s.uptime_seconds = shared.started.elapsed().as_secs_f64();
                Response::Status(s)
            }
            Request::Stop => {
                shared.stop.store(true, Ordering::SeqCst);
                Response::Stopping
            }
            Request::ReleaseAll => {
                shared.backend.release_all(id);
                Response::Released
            }
        };
        if ipc::send_frame(&mut stream, &resp, None).is_err() {
            break;
        }
    }
    // Disconnect (clean or SIGKILL): every lease goes.
    shared.backend.closed(id);
    shared
        .clients
        .lock()
        .expect("clients lock")
        .retain(|(c, _)| *c != id);
}
