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
//! are released when it closes — including when the worker is killed with SIGKILL. Requests are
//! read with `recvmsg`, so a descriptor sent with one (a session's sealed memfd, `PutSession`)
//! arrives with it; one sent with any other request is closed ([`sessions`]).
//!
//! Clients cannot stall the store ([`Limits`]): at most 256 connections; a `Hello` must arrive
//! within 5 s of the accept; a frame whose first byte has arrived must be complete within 5 s,
//! and no request frame may exceed [`wire::MAX_REQUEST_FRAME`] (the body is buffered as it
//! arrives, never reserved from the announced length); a reply not taken within 10 s ends the
//! connection; one request per connection is in flight at a time.
//!
//! **Idle connections.** A connection has not yet done useful work until it has said `Hello`
//! and — a worker — made its first work request (experts, a trunk layer, a session, progress,
//! history), or — a control client — while it waits between requests. At most
//! [`Limits::max_idle_per_uid`] such connections per peer uid (`SO_PEERCRED`) are kept: the
//! next one of that uid closes the oldest; a control client idle for
//! [`Limits::control_idle_timeout`] is closed. A full store closes its oldest idle connection to
//! admit a new one, and keeps [`Limits::reserved`] more places, beyond the cap, for control
//! clients only, so `k3-ctl stop`/`stats` always get through. A worker that has made a work
//! request may then stay idle indefinitely (it holds leases while it computes, a chat waits for
//! its user). Labels are cut at [`wire::MAX_LABEL_BYTES`], stats list at most 64 jobs, and a
//! reply that would exceed the frame limit is replaced by an error. Accept errors back off
//! exponentially (5 ms to 1 s) with one log line per 10 s; out of descriptors, the oldest idle
//! connection is closed to make room. SIGHUP is logged and ignored.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k3_proto::wire::{
    self, ClientKind, ErrorCode, Request, Response, SlotAnswer, StatsReport, StatusReport,
    WireError,
};

use crate::ipc;

pub mod backend;
pub mod detach;
pub mod history;
pub mod loading;
pub mod ring;
mod segment;
pub mod sessions;
pub mod statedir;
pub mod usage;

use sessions::{SessionOptions, Sessions};

/// A connection's identity inside the store.
pub type ConnId = u64;

/// What the server needs from the store proper (the expert cache and its bookkeeping).
pub trait Backend: Send + Sync + 'static {
    /// Lease one layer's experts for `conn`, releasing that connection's earlier leases for the
    /// same layer. Answers are in request order.
    fn experts(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Response;
    /// Release every lease `conn` holds (on `ReleaseAll`).
    fn release_all(&self, conn: ConnId);
    /// A client finished its handshake (`pid`: its process, from `SO_PEERCRED`; 0 unknown).
    fn opened(&self, _conn: ConnId, _kind: ClientKind, _label: &str, _pid: u32) {}
    /// A client disconnected (cleanly or killed): release everything it held.
    fn closed(&self, conn: ConnId) {
        self.release_all(conn);
    }
    /// Lease, of experts `ids` of `layer`, those resident now (`Request::ResidentExperts`).
    /// Default: none is.
    fn resident_experts(&self, _conn: ConnId, layer: u32, ids: &[u32]) -> Response {
        Response::Experts {
            answers: ids
                .iter()
                .map(|e| SlotAnswer::Failed {
                    reason: format!("expert {e} of layer {layer} is not resident"),
                })
                .collect(),
            resident_hits: 0,
        }
    }
    /// A worker predicts it will soon request experts `ids` of `layer`: read them ahead if
    /// slots are free (in the background; must return at once). Default: nothing.
    fn prefetch(&self, _conn: ConnId, _layer: u32, _ids: &[u32]) {}
    /// A worker reported its progress.
    fn progress(&self, _conn: ConnId, _p: k3_proto::wire::JobProgress) {}
    /// Lease streamed trunk layer `layer` to `conn` (blocking until it is in the ring),
    /// releasing that connection's earlier trunk lease. Default: no ring (every layer pinned).
    fn trunk_layer(&self, _conn: ConnId, layer: u32) -> Response {
        Response::Error {
            code: ErrorCode::BadRequest,
            message: format!("layer {layer} is not streamed by this store (no trunk ring)"),
        }
    }
    /// `conn` ended a forward pass: release its trunk lease.
    fn end_pass(&self, _conn: ConnId) -> Response {
        Response::Released
    }
    /// `conn` is done with its trunk lease mid-pass: release it, and nothing else (its expert
    /// leases stay).
    fn release_trunk(&self, _conn: ConnId) -> Response {
        Response::Released
    }
    /// The server stopped accepting: wake requests that wait inside the backend.
    fn stopping(&self) {}
    /// Lifetime and per-connection counters.
    fn stats(&self, conn: ConnId) -> StatsReport;
    /// Static description (model, preset, plan, memory).
    fn status(&self) -> StatusReport;
    /// The read-only shared-memory descriptor handed to workers and its size.
    fn worker_fd(&self) -> std::io::Result<(OwnedFd, u64)>;
    /// Checkpoint and packed-trunk directories (sent in `Welcome`).
    fn dirs(&self) -> (String, String);
    /// The draft-trunk directory whose runs are in shared memory (sent in `Welcome`), or empty.
    fn draft_dir(&self) -> String {
        String::new()
    }
    /// The trunk served: codec, seal, lossy label (sent in `Welcome`).
    fn trunk(&self) -> wire::TrunkInfo {
        wire::TrunkInfo::default()
    }
}

/// The limits the server enforces on its clients (README, "k3-store start").
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once; one more is answered with an error and closed.
    pub max_connections: usize,
    /// From accept to a complete `Hello`: a client that says nothing is closed after this.
    pub handshake_timeout: Duration,
    /// A frame whose first byte arrived must be complete within this. Between frames an
    /// attached client may stay idle as long as it likes (a worker holds leases while it
    /// computes, a chat waits for its user).
    pub frame_timeout: Duration,
    /// A reply the client does not take within this ends the connection (a client that sends
    /// requests and never reads the answers).
    pub write_timeout: Duration,
    /// Per-job entries in a stats reply (live jobs first, then the most recent finished ones);
    /// also the most client labels a status reply lists.
    pub max_listed_jobs: usize,
    /// Ids of earlier jobs' token streams kept for history drafting (0 keeps none).
    pub history_tokens: usize,
    /// Connections of one peer uid that have not yet done useful work (no `Hello` yet, a worker
    /// before its first work request, a control client between requests); one more closes the
    /// oldest of them.
    pub max_idle_per_uid: usize,
    /// A control client that sends no request for this long is closed.
    pub control_idle_timeout: Duration,
    /// Places beyond `max_connections` for control clients only (`k3-ctl stop`, `stats`).
    pub reserved: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            max_listed_jobs: 64,
            history_tokens: history::DEFAULT_HISTORY_TOKENS,
            max_idle_per_uid: 64,
            control_idle_timeout: Duration::from_secs(60),
            reserved: 8,
        }
    }
}

/// A connection that has not yet done useful work (see the module doc).
#[derive(Clone, Copy, Debug)]
struct Idle {
    /// Its descriptor (open while the entry exists: the owner removes it before closing).
    fd: RawFd,
    /// Since when it is idle (accept, or its last control request).
    since: Instant,
    /// The peer's uid.
    uid: u32,
}

/// Shared server state.
struct Shared<B: Backend> {
    backend: B,
    stop: Arc<AtomicBool>,
    limits: Limits,
    in_flight: AtomicUsize,
    connections: AtomicUsize,
    next_id: AtomicU64,
    clients: Mutex<Vec<(ConnId, String)>>,
    /// Connections that have not yet done useful work. An entry is removed (under this lock)
    /// before its descriptor is closed, so a descriptor found here is still open.
    idle: Mutex<BTreeMap<ConnId, Idle>>,
    /// Idle connections closed to make room, and when that was last logged.
    evicted: Mutex<(u64, Option<Instant>)>,
    started: Instant,
    /// Earlier jobs' token streams (history drafting).
    history: Mutex<history::History>,
    /// Kept conversations.
    sessions: Arc<Sessions>,
}

impl<B: Backend> Shared<B> {
    /// `id` did useful work (a worker's first work request): no longer idle.
    fn working(&self, id: ConnId) {
        lock(&self.idle).remove(&id);
    }

    /// `id` (a control client) answered a request: idle again from now.
    fn idle_again(&self, id: ConnId) {
        if let Some(e) = lock(&self.idle).get_mut(&id) {
            e.since = Instant::now();
        }
    }

    /// Shut down the idle connection idle the longest — of `uid` only, when given — if it has
    /// been idle at least `min_age` (so a client whose `Hello` is being read is spared when
    /// room is made for any client). True if one was.
    fn evict_oldest_idle(&self, uid: Option<u32>, min_age: Duration) -> bool {
        let mut idle = lock(&self.idle);
        let oldest = idle
            .iter()
            .filter(|(_, e)| uid.is_none_or(|u| e.uid == u))
            .min_by_key(|(_, e)| e.since)
            .map(|(&id, &e)| (id, e));
        let Some((id, e)) = oldest else {
            return false;
        };
        if e.since.elapsed() < min_age {
            return false;
        }
        // The owner removes its entry under this lock before closing `fd`: it is still open.
        let _ = nix::sys::socket::shutdown(e.fd, nix::sys::socket::Shutdown::Both);
        idle.remove(&id);
        drop(idle);
        let mut ev = lock(&self.evicted);
        ev.0 += 1;
        if ev
            .1
            .is_none_or(|t| t.elapsed() >= AcceptBackoff::LOG_PERIOD)
        {
            tracing::warn!(
                "closed an idle connection (uid {}, idle {:.1} s) to make room; {} closed so far \
                 (clients that connect and do nothing; at most {} idle per uid are kept)",
                e.uid,
                e.since.elapsed().as_secs_f64(),
                ev.0,
                self.limits.max_idle_per_uid
            );
            ev.1 = Some(Instant::now());
        }
        true
    }

    /// Idle connections of `uid` now.
    fn idle_of(&self, uid: u32) -> usize {
        lock(&self.idle).values().filter(|e| e.uid == uid).count()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The daemon's server.
pub struct Server<B: Backend> {
    listener: UnixListener,
    socket: PathBuf,
    shared: Arc<Shared<B>>,
    hup: Arc<AtomicBool>,
    drain_cap: Duration,
}

/// Accept failures: exponential back-off (5 ms doubling to 1 s) and at most one log line per
/// [`AcceptBackoff::LOG_PERIOD`] while they last.
struct AcceptBackoff {
    delay: Duration,
    failures: u64,
    unlogged: u64,
    /// A line was logged during the current run of failures (its end is then logged too).
    announced: bool,
    last_log: Option<Instant>,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_secs(1);
    const LOG_PERIOD: Duration = Duration::from_secs(10);

    fn new() -> Self {
        AcceptBackoff {
            delay: Self::FIRST,
            failures: 0,
            unlogged: 0,
            announced: false,
            last_log: None,
        }
    }

    /// A failure; returns how long to wait before the next accept.
    fn failed(&mut self, what: &str) -> Duration {
        self.failures += 1;
        self.unlogged += 1;
        let due = self
            .last_log
            .is_none_or(|t| t.elapsed() >= Self::LOG_PERIOD);
        if due {
            if self.failures == 1 {
                tracing::warn!(
                    "{what}; backing off (at most one line per {} s while this lasts)",
                    Self::LOG_PERIOD.as_secs()
                );
            } else {
                tracing::warn!(
                    "{what} ({} times since the last line; {} in a row)",
                    self.unlogged,
                    self.failures
                );
            }
            self.unlogged = 0;
            self.announced = true;
            self.last_log = Some(Instant::now());
        }
        let wait = self.delay;
        self.delay = (self.delay * 2).min(Self::MAX);
        wait
    }

    fn succeeded(&mut self) {
        if self.announced {
            tracing::info!("accepting again after {} failed attempts", self.failures);
        }
        *self = AcceptBackoff {
            last_log: self.last_log,
            ..AcceptBackoff::new()
        };
    }
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
                limits: Limits::default(),
                in_flight: AtomicUsize::new(0),
                connections: AtomicUsize::new(0),
                next_id: AtomicU64::new(1),
                clients: Mutex::new(Vec::new()),
                idle: Mutex::new(BTreeMap::new()),
                evicted: Mutex::new((0, None)),
                started: Instant::now(),
                history: Mutex::new(history::History::new(Limits::default().history_tokens)),
                sessions: Arc::new(Sessions::new(SessionOptions::off(), 0)),
            }),
            hup: Arc::new(AtomicBool::new(false)),
            drain_cap: Duration::from_secs(10),
        }
    }

    /// Use these limits instead of [`Limits::default`].
    pub fn with_limits(mut self, limits: Limits) -> Self {
        let shared = Arc::get_mut(&mut self.shared).expect("limits are set before serving");
        shared.history = Mutex::new(history::History::new(limits.history_tokens));
        shared.limits = limits;
        self
    }

    /// Keep conversations in `sessions` (without this, session requests are refused).
    pub fn with_sessions(mut self, sessions: Arc<Sessions>) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("sessions are set before serving")
            .sessions = sessions;
        self
    }

    /// The flag a SIGHUP handler sets (see [`install_signal_handlers`]): the server logs it and
    /// carries on.
    pub fn with_hup(mut self, hup: Arc<AtomicBool>) -> Self {
        self.hup = hup;
        self
    }

    /// Serve until stopped; then drain and remove the socket. Returns the number of requests
    /// still in flight when the drain cap expired (0 on a clean drain).
    pub fn run(self) -> usize {
        self.listener
            .set_nonblocking(true)
            .expect("set_nonblocking on a listening socket");
        let mut backoff = AcceptBackoff::new();
        while !self.shared.stop.load(Ordering::SeqCst) {
            if self.hup.swap(false, Ordering::SeqCst) {
                tracing::info!(
                    "SIGHUP received and ignored (there is nothing to reload; stop the \
                     store with `k3-ctl stop`)"
                );
            }
            // Wait for a connection, waking at least every 100 ms to notice a stop request.
            let make_room = || (self.shared).evict_oldest_idle(None, Duration::from_millis(50));
            if let Some(stream) = accept_one(&self.listener, &mut backoff, "", &make_room) {
                self.admit(stream);
            }
        }
        // One place for every shutdown cause: stop accepting, drain, clean up.
        let _ = std::fs::remove_file(&self.socket);
        self.shared.backend.stopping();
        let deadline = Instant::now() + self.drain_cap;
        while self.shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// A new connection: room is made for it (the oldest idle connection of its uid past the
    /// per-uid cap; the oldest idle one at the connection cap), a control client may take a
    /// reserved place, else it is refused with an error; admitted, it is served by a thread.
    fn admit(&self, mut stream: UnixStream) {
        let limits = &self.shared.limits;
        // Another uid is refused by the handshake at once; it is counted under its own uid.
        let uid = ipc::peer_uid(&stream).unwrap_or(u32::MAX);
        if self.shared.idle_of(uid) >= limits.max_idle_per_uid {
            self.shared.evict_oldest_idle(Some(uid), Duration::ZERO);
        }
        let open = self.shared.connections.load(Ordering::SeqCst);
        let mut reserved = false;
        if open >= limits.max_connections
            && !self
                .shared
                .evict_oldest_idle(None, Duration::from_millis(50))
        {
            if open >= limits.max_connections + limits.reserved {
                // The reply fits an empty socket buffer; never wait for it.
                let _ = stream.set_nonblocking(true);
                let _ = wire::write_frame(
                    &mut stream,
                    &Response::Error {
                        code: ErrorCode::Busy,
                        message: format!(
                            "the store already serves {} connections, its limit; try again later",
                            limits.max_connections
                        ),
                    },
                );
                return;
            }
            reserved = true;
        }
        let _ = stream.set_nonblocking(false);
        self.shared.connections.fetch_add(1, Ordering::SeqCst);
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let now = Instant::now();
        lock(&self.shared.idle).insert(
            id,
            Idle {
                fd: stream.as_raw_fd(),
                since: now,
                uid,
            },
        );
        let conn = Conn {
            shared: self.shared.clone(),
            id,
            accepted: now,
            reserved,
            stream,
        };
        // If the thread cannot start, the closure (and with it `conn`) is dropped: closed.
        if let Err(e) = std::thread::Builder::new()
            .name("k3-conn".into())
            .spawn(move || serve_connection(conn))
        {
            tracing::error!("cannot start a connection thread: {e}");
        }
    }
}

/// Wait up to 100 ms for a connection on the non-blocking `listener` and accept it. A failure
/// backs off (`backoff`; `during` is appended to its log line). Out of descriptors, `make_room`
/// may close a connection to make room (it says whether it did): then the accept is retried
/// soon, without backing off.
fn accept_one(
    listener: &UnixListener,
    backoff: &mut AcceptBackoff,
    during: &str,
    make_room: &dyn Fn() -> bool,
) -> Option<UnixStream> {
    let mut fds = [nix::poll::PollFd::new(
        listener.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u16)) {
        Ok(0) | Err(nix::errno::Errno::EINTR) => return None,
        Ok(_) => {}
        Err(e) => {
            std::thread::sleep(backoff.failed(&format!("poll failed{during}: {e}")));
            return None;
        }
    }
    match listener.accept() {
        Ok((stream, _)) => {
            backoff.succeeded();
            Some(stream)
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => None,
        Err(e) => {
            let out_of_fds = matches!(
                e.raw_os_error(),
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
            );
            // Out of descriptors: make room by closing the oldest connection that has not said
            // Hello (a well-behaved client says it at once), then retry soon.
            if out_of_fds && make_room() {
                std::thread::sleep(Duration::from_millis(2));
            } else {
                std::thread::sleep(backoff.failed(&format!("accept failed{during}: {e}")));
            }
            None
        }
    }
}

/// SIGTERM and SIGINT set `stop`; a second one exits the process at once (status 1). SIGHUP sets
/// `hup`, which the server logs and otherwise ignores (the store has nothing to reload; a
/// detached store must not die with the terminal that started it).
pub fn install_signal_handlers(
    stop: &Arc<AtomicBool>,
    hup: &Arc<AtomicBool>,
) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    for sig in [SIGTERM, SIGINT] {
        // Order matters: the conditional shutdown fires only if `stop` is already set.
        signal_hook::flag::register_conditional_shutdown(sig, 1, stop.clone())?;
        signal_hook::flag::register(sig, stop.clone())?;
    }
    signal_hook::flag::register(SIGHUP, hup.clone())?;
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

/// One connection. Dropping it takes it off the idle list and the connection count before its
/// descriptor is closed (fields drop after `drop` runs).
struct Conn<B: Backend> {
    shared: Arc<Shared<B>>,
    id: ConnId,
    accepted: Instant,
    /// Admitted beyond the connection cap: a control client only.
    reserved: bool,
    stream: UnixStream,
}

impl<B: Backend> Drop for Conn<B> {
    fn drop(&mut self) {
        self.shared.working(self.id);
        self.shared.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Reads from a stream, failing with `TimedOut` once `deadline` has passed, and keeps the first
/// descriptor that arrives with the bytes (a session's memfd).
struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
    fd: Option<OwnedFd>,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        match ipc::recv_keeping_fd(self.stream, buf, &mut self.fd) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                Err(std::io::ErrorKind::TimedOut.into())
            }
            r => r,
        }
    }
}

/// Read one request of at most [`wire::MAX_REQUEST_FRAME`] bytes and the descriptor sent with it,
/// if any. Waits for its first byte until `idle_deadline` (forever if `None`); once it has
/// started, the frame must be complete within the frame timeout (and the idle deadline).
fn read_request(
    stream: &UnixStream,
    idle_deadline: Option<Instant>,
    frame_timeout: Duration,
) -> Result<(Request, Option<OwnedFd>), WireError> {
    loop {
        let timeout = match idle_deadline {
            None => nix::poll::PollTimeout::NONE,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(WireError::Io(std::io::ErrorKind::TimedOut.into()));
                }
                nix::poll::PollTimeout::try_from(left).unwrap_or(nix::poll::PollTimeout::MAX)
            }
        };
        let mut fds = [nix::poll::PollFd::new(
            stream.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut fds, timeout) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => break,
            Err(e) => return Err(WireError::Io(e.into())),
        }
    }
    let started = Instant::now() + frame_timeout;
    let deadline = idle_deadline.map_or(started, |d| d.min(started));
    let mut r = DeadlineReader {
        stream,
        deadline,
        fd: None,
    };
    let req = wire::read_frame_limited(&mut r, wire::MAX_REQUEST_FRAME)?;
    Ok((req, r.fd))
}

/// Send `resp`; a reply too large for one frame is replaced by an error saying so. False when the
/// client is gone (or did not take the reply within the write timeout).
fn reply(
    stream: &mut UnixStream,
    resp: &Response,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> bool {
    match ipc::send_frame(stream, resp, fd) {
        Ok(()) => true,
        Err(WireError::TooLong { len, limit }) => ipc::send_frame(
            stream,
            &Response::Error {
                code: ErrorCode::TooLarge,
                message: format!("the reply ({len} bytes) exceeds the {limit}-byte frame limit"),
            },
            None,
        )
        .is_ok(),
        Err(_) => false,
    }
}

/// A worker's request that is work (it leases, reads, keeps or reports something): the first
/// one takes the connection off the idle list.
fn is_work(r: &Request) -> bool {
    !matches!(
        r,
        Request::Hello { .. }
            | Request::Stats
            | Request::Status
            | Request::Stop
            | Request::ListSessions
    )
}

fn request_name(r: &Request) -> &'static str {
    match r {
        Request::Hello { .. } => "Hello",
        Request::Experts { .. } => "Experts",
        Request::ResidentExperts { .. } => "ResidentExperts",
        Request::Stats => "Stats",
        Request::Status => "Status",
        Request::Stop => "Stop",
        Request::ReleaseAll => "ReleaseAll",
        Request::Progress(_) => "Progress",
        Request::Draft { .. } => "Draft",
        Request::Record { .. } => "Record",
        Request::PutSession { .. } => "PutSession",
        Request::GetSession { .. } => "GetSession",
        Request::ListSessions => "ListSessions",
        Request::Prefetch { .. } => "Prefetch",
        Request::TrunkLayer { .. } => "TrunkLayer",
        Request::EndPass => "EndPass",
        Request::ReleaseTrunk => "ReleaseTrunk",
    }
}

/// Keep at most `max` job entries: live ones first (oldest first), then the most recent finished
/// ones; listed in connection order.
fn bound_jobs(jobs: &mut Vec<k3_proto::wire::JobStats>, max: usize) {
    for j in jobs.iter_mut() {
        if j.label.len() > wire::MAX_LABEL_BYTES {
            j.label = wire::bounded_label(&j.label).to_string();
        }
    }
    if jobs.len() > max {
        jobs.sort_by_key(|j| (!j.live, if j.live { j.conn } else { u64::MAX - j.conn }));
        jobs.truncate(max);
        jobs.sort_by_key(|j| j.conn);
    }
}

/// The first exchange on a connection accepted at `accepted`: the peer must run as our uid and
/// say `Hello` with our protocol version within the handshake timeout. Answers a failure itself
/// (refusal, error) and returns `None`; else the client's kind and (bounded) label, with the
/// write timeout set.
fn handshake(
    stream: &mut UnixStream,
    accepted: Instant,
    limits: &Limits,
) -> Option<(ClientKind, String)> {
    let me = nix::unistd::getuid().as_raw();
    let _ = stream.set_write_timeout(Some(limits.write_timeout));
    match ipc::peer_uid(stream) {
        Ok(uid) if uid == me => {}
        Ok(uid) => {
            reply(
                stream,
                &Response::Error {
                    code: ErrorCode::NotAllowed,
                    message: format!("peer uid {uid} is not the store's uid {me}"),
                },
                None,
            );
            return None;
        }
        Err(_) => return None,
    }
    // Handshake first, complete within the handshake timeout.
    let hello = read_request(
        stream,
        Some(accepted + limits.handshake_timeout),
        limits.frame_timeout,
    );
    match hello.map(|(r, _fd)| r) {
        Ok(Request::Hello {
            protocol_version,
            kind,
            label,
        }) => {
            if let Some(refusal) = wire::check_version(protocol_version) {
                reply(stream, &refusal, None);
                return None;
            }
            Some((kind, wire::bounded_label(&label).to_string()))
        }
        Ok(other) => {
            reply(
                stream,
                &Response::Error {
                    code: ErrorCode::BadRequest,
                    message: format!(
                        "the first message must be Hello, got {}",
                        request_name(&other)
                    ),
                },
                None,
            );
            None
        }
        Err(e @ (WireError::TooLong { .. } | WireError::Malformed(_))) => {
            reply(
                stream,
                &Response::Error {
                    code: if matches!(e, WireError::TooLong { .. }) {
                        ErrorCode::TooLarge
                    } else {
                        ErrorCode::BadRequest
                    },
                    message: e.to_string(),
                },
                None,
            );
            None
        }
        Err(_) => None,
    }
}

fn serve_connection<B: Backend>(mut conn: Conn<B>) {
    let shared = conn.shared.clone();
    let id = conn.id;
    let limits = shared.limits.clone();
    let Some(kind) = welcome(&shared, &mut conn) else {
        return;
    };
    let stream = &mut conn.stream;
    // One request at a time per connection: it is read, served and answered before the next is
    // read (requests a client pipelines wait in the kernel's socket buffer, not in the store).
    let mut working = false;
    loop {
        // A control client's next request is due within the control idle timeout.
        let idle_deadline =
            (kind == ClientKind::Control).then(|| Instant::now() + limits.control_idle_timeout);
        let (req, fd) = match read_request(stream, idle_deadline, limits.frame_timeout) {
            Ok(r) => r,
            Err(WireError::Closed) => break,
            Err(WireError::Io(_)) => break,
            Err(e) => {
                let code = if matches!(e, WireError::TooLong { .. }) {
                    ErrorCode::TooLarge
                } else {
                    ErrorCode::BadRequest
                };
                reply(stream, &error(code, e.to_string()), None);
                break;
            }
        };
        let _busy = InFlight::enter(&shared.in_flight);
        if !working && kind == ClientKind::Worker && is_work(&req) {
            working = true;
            shared.working(id);
        }
        // A fetched session's memfd goes out with the answer.
        let (resp, blob) = answer(&shared, id, kind, req, fd);
        let fd_out = blob.as_ref().map(|b| b.fd());
        if !reply(stream, &resp, fd_out) {
            break;
        }
        if kind == ClientKind::Control {
            shared.idle_again(id);
        }
    }
    // Disconnect (clean, SIGKILL or cut off by a timeout): every lease goes.
    shared.backend.closed(id);
    lock(&shared.clients).retain(|(c, _)| *c != id);
}

/// An error answer.
fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

/// The handshake and the `Welcome` (a worker's carries the shared memory); the client's kind,
/// registered, or `None` when the connection ends here.
fn welcome<B: Backend>(shared: &Shared<B>, conn: &mut Conn<B>) -> Option<ClientKind> {
    let limits = &shared.limits;
    let stream = &mut conn.stream;
    let (kind, label) = handshake(stream, conn.accepted, limits)?;
    if conn.reserved && kind != ClientKind::Control {
        let m = format!(
            "the store already serves {} connections, its limit (the places beyond it are kept \
             for k3-ctl); try again later",
            limits.max_connections
        );
        reply(stream, &error(ErrorCode::Busy, m), None);
        return None;
    }
    let (model_dir, trunk_dir) = shared.backend.dirs();
    let welcome = |shm_bytes| Response::Welcome {
        protocol_version: wire::PROTOCOL_VERSION,
        model_dir: model_dir.clone(),
        trunk_dir: trunk_dir.clone(),
        shm_bytes,
        draft_dir: shared.backend.draft_dir(),
        trunk: shared.backend.trunk(),
    };
    let sent = match kind {
        ClientKind::Worker => match shared.backend.worker_fd() {
            Ok((fd, len)) => reply(stream, &welcome(len), Some(fd.as_fd())),
            Err(e) => reply(
                stream,
                &error(ErrorCode::Internal, format!("cannot share memory: {e}")),
                None,
            ),
        },
        ClientKind::Control => reply(stream, &welcome(0), None),
    };
    if !sent {
        return None;
    }
    let pid = ipc::peer_cred(stream).map_or(0, |(_, pid)| pid.max(0) as u32);
    shared.backend.opened(conn.id, kind, &label, pid);
    lock(&shared.clients).push((conn.id, label));
    Some(kind)
}

/// The answer to one request of connection `id` (a client of `kind`), and a session's memfd
/// to send with it.
fn answer<B: Backend>(
    shared: &Shared<B>,
    id: ConnId,
    kind: ClientKind,
    req: Request,
    fd: Option<OwnedFd>,
) -> (Response, Option<Arc<crate::session::Blob>>) {
    let worker = kind == ClientKind::Worker;
    let only = |what: &str| error(ErrorCode::NotAllowed, format!("only workers {what}"));
    let stopping = || shared.stop.load(Ordering::SeqCst);
    let resp = match req {
        Request::Hello { .. } => error(ErrorCode::NotAllowed, "Hello was already exchanged"),
        Request::Experts { .. } | Request::ResidentExperts { .. } if !worker => {
            only("lease experts")
        }
        Request::TrunkLayer { .. } | Request::EndPass | Request::ReleaseTrunk if !worker => {
            only("lease trunk layers")
        }
        Request::Prefetch { .. } if !worker => only("prefetch experts"),
        Request::Progress(_) if !worker => only("report progress"),
        Request::Record { .. } if !worker => only("record token streams"),
        Request::PutSession { .. } | Request::GetSession { .. } if !worker => {
            only("store and fetch sessions")
        }
        Request::Experts { .. } | Request::TrunkLayer { .. } if stopping() => {
            error(ErrorCode::Stopping, "the store is stopping")
        }
        Request::Experts { layer, ids } => shared.backend.experts(id, layer, &ids),
        Request::ResidentExperts { layer, ids } => shared.backend.resident_experts(id, layer, &ids),
        Request::TrunkLayer { layer } => shared.backend.trunk_layer(id, layer),
        Request::EndPass => shared.backend.end_pass(id),
        Request::ReleaseTrunk => shared.backend.release_trunk(id),
        Request::Prefetch { layer, ids } => {
            if !stopping() {
                shared.backend.prefetch(id, layer, &ids);
            }
            Response::Noted
        }
        Request::Progress(p) => {
            shared.backend.progress(id, p);
            Response::Noted
        }
        Request::GetSession { name } => {
            return match shared.sessions.get(&name) {
                Ok(Some(b)) => (Response::Session { bytes: b.len() }, Some(b)),
                Ok(None) => (Response::NoSession, None),
                Err(e) => (error(ErrorCode::BadRequest, e.to_string()), None),
            };
        }
        Request::PutSession { name, bytes } => shared.sessions.put(&name, fd, bytes),
        other => answer_common(shared, id, other),
    };
    (resp, None)
}

/// The answers any client may ask for (and a worker's `Record`).
fn answer_common<B: Backend>(shared: &Shared<B>, id: ConnId, req: Request) -> Response {
    let limits = &shared.limits;
    match req {
        Request::Stats => {
            let mut s = shared.backend.stats(id);
            s.uptime_seconds = shared.started.elapsed().as_secs_f64();
            s.history = lock(&shared.history).stats();
            bound_jobs(&mut s.jobs, limits.max_listed_jobs);
            s.sessions = shared.sessions.stats();
            Response::Stats(Box::new(s))
        }
        Request::Status => {
            let mut s = shared.backend.status();
            let clients = lock(&shared.clients);
            s.clients = (clients.iter())
                .take(limits.max_listed_jobs)
                .map(|(_, l)| l.clone())
                .collect();
            if clients.len() > limits.max_listed_jobs {
                let more = clients.len() - limits.max_listed_jobs;
                s.clients.push(format!("(and {more} more)"));
            }
            drop(clients);
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
        Request::Draft { context, max } => {
            if context.len() > wire::MAX_DRAFT_CONTEXT || max > wire::MAX_DRAFT_IDS {
                let m = format!(
                    "a draft request carries at most {} context ids and asks for at most {} ids",
                    wire::MAX_DRAFT_CONTEXT,
                    wire::MAX_DRAFT_IDS
                );
                error(ErrorCode::BadRequest, m)
            } else {
                let ids = lock(&shared.history).draft(&context, max as usize);
                Response::Draft { ids }
            }
        }
        Request::Record { ids } => {
            if ids.len() > wire::MAX_RECORD_IDS {
                let m = format!(
                    "a recorded stream holds at most {} ids",
                    wire::MAX_RECORD_IDS
                );
                error(ErrorCode::BadRequest, m)
            } else {
                lock(&shared.history).record(&ids);
                Response::Noted
            }
        }
        Request::ListSessions => Response::Sessions(shared.sessions.list()),
        // Every other request is answered by `answer`.
        other => error(
            ErrorCode::Internal,
            format!("no answer for {}", request_name(&other)),
        ),
    }
}
