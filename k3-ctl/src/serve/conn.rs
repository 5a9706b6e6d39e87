//! Connections: how many, from whom, for how long, and whether their client is still there.
//!
//! - **Caps with room kept.** At most [`Limits::total`] connections and [`Limits::per_addr`]
//!   from one client address. A connection that would pass a cap takes the place of the oldest
//!   one that is not busy (idle between requests, or still sending its request), from the same
//!   address first: a client that opens connections and trickles (or stops sending) cannot keep
//!   a fresh request out. Only when every connection is busy with a request is a new one
//!   answered 503 at once.
//! - **Deadlines.** A request head must arrive whole within [`Limits::head`] of its first byte,
//!   a body within [`Limits::body`] (408, `parse` in `http`); a connection that waits for the
//!   first byte of a request is closed after [`Limits::idle`]. The watcher keeps the head's
//!   deadline, not hyper's header timer: that one also runs while a kept-alive connection waits
//!   for its next request, so it would close every idle connection after the head's time.
//! - **Disconnects noticed on every path.** While a request is busy, a watcher looks at the
//!   socket every [`WATCH_EVERY`] without reading it (`MSG_PEEK`). The end of the client's
//!   sending side alone is not a departure (a half-closed client still reads its answer), so when
//!   it is seen before the answer has started, the watcher writes `HTTP/1.1 100 Continue` (an
//!   interim response every HTTP/1.1 client skips): a client that has closed its socket answers
//!   it with a reset (seen through `SO_ERROR`: after the client's end of sending, Linux reads the
//!   socket as ended even once a reset has come). A reset (or any socket error) ends the
//!   connection at once, which drops the
//!   request's future: its queue place is freed and its job cancelled. After the answer has
//!   started, the answer's own bytes (a streamed answer's keep-alive comments included) draw
//!   the reset.
//! - **Framing read from the bytes.** hyper reads a head with both `Content-Length` and
//!   `Transfer-Encoding` as chunked and drops the length before a handler sees it (and closes
//!   the connection after the answer). RFC 9112 §6.1 asks a server to refuse such a message (the
//!   request-smuggling case), so the bytes a connection reads while it waits for a head are kept
//!   (at most [`HEAD_RECORD`]) and that head's own header names are looked at when it arrives
//!   ([`Conn::framing`]). A head read while the request before it is still being answered (a
//!   pipelined one) is not looked at: after a conflicting head hyper closes the connection, so
//!   nothing that follows it on that connection is read as a request.

use std::collections::HashMap;
use std::io;
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// How often a connection's watcher looks at its socket.
pub const WATCH_EVERY: Duration = Duration::from_millis(200);

/// The interim response that draws a reset from a client that has closed its socket.
const PROBE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Most bytes of a request head kept for [`Conn::framing`] (serve's head limit, and room for
/// the bytes read with it).
/// Largest request head (request line + headers), in bytes.
pub(super) const MAX_HEAD_BYTES: usize = 16 << 10;
/// Most request headers.
pub(super) const MAX_HEADERS: usize = 64;

const HEAD_RECORD: usize = MAX_HEAD_BYTES + (4 << 10);

/// How a request head frames its body, read from its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Framing {
    /// `Content-Length` lines.
    pub content_length: usize,
    /// `Transfer-Encoding` lines.
    pub transfer_encoding: usize,
}

impl Framing {
    /// The framing of the first request head in `bytes` (`None` when it is not a whole head).
    pub fn of_head(bytes: &[u8]) -> Option<Framing> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(bytes) {
            Ok(httparse::Status::Complete(_)) => {}
            _ => return None,
        }
        let mut f = Framing::default();
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                f.content_length += 1;
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                f.transfer_encoding += 1;
            }
        }
        Some(f)
    }

    /// Both a length and a transfer coding: refused (RFC 9112 §6.1).
    pub fn conflicts(&self) -> bool {
        self.content_length > 0 && self.transfer_encoding > 0
    }
}

/// Connection limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most connections.
    pub total: usize,
    /// Most connections from one client address.
    pub per_addr: usize,
    /// Time to send a request head.
    pub head: Duration,
    /// Time to send a request body.
    pub body: Duration,
    /// Time a connection may stay idle between requests.
    pub idle: Duration,
}

const IDLE: u8 = 0;
/// A request head arrived; its body is still coming.
const READING: u8 = 1;
/// A whole request is being answered.
const BUSY: u8 = 2;
/// The first bytes of a request head arrived; the rest of it is still coming.
const HEAD: u8 = 3;

/// One connection's state, shared by its socket, its requests and its watcher.
#[derive(Debug)]
pub struct Conn {
    phase: AtomicU8,
    since: Mutex<Instant>,
    /// Answer bytes written since the current request's body ended (the answer has started).
    wrote: AtomicBool,
    /// Interim-response bytes still to write, under the write lock.
    probe: Mutex<ProbeState>,
    close: Notify,
    /// A read or write on the socket failed (a reset): the client is gone.
    failed: AtomicBool,
    /// The client's address.
    pub peer: SocketAddr,
    /// Bytes read while waiting for a request head, and the framing of the last head.
    head: Mutex<(Vec<u8>, Option<Framing>)>,
}

#[derive(Debug, Default)]
struct ProbeState {
    pending: Vec<u8>,
    sent: bool,
}

impl Conn {
    fn new(peer: SocketAddr) -> Conn {
        Conn {
            phase: AtomicU8::new(IDLE),
            since: Mutex::new(Instant::now()),
            wrote: AtomicBool::new(false),
            probe: Mutex::new(ProbeState::default()),
            close: Notify::new(),
            failed: AtomicBool::new(false),
            peer,
            head: Mutex::new((Vec::new(), None)),
        }
    }

    /// Keep `bytes` read from the socket when they may hold the next request head (the first
    /// of them start the head's deadline).
    fn record(&self, bytes: &[u8]) {
        match self.phase.load(Ordering::Acquire) {
            IDLE if !bytes.is_empty() => self.set(HEAD),
            HEAD => {}
            _ => return,
        }
        if let Ok(mut h) = self.head.lock() {
            let room = HEAD_RECORD.saturating_sub(h.0.len());
            h.0.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    }

    /// The framing of the current request's head, when its bytes were read while the
    /// connection waited for it (see the module doc).
    pub fn framing(&self) -> Option<Framing> {
        self.head.lock().ok().and_then(|h| h.1)
    }

    fn set(&self, phase: u8) {
        self.phase.store(phase, Ordering::Release);
        if let Ok(mut t) = self.since.lock() {
            *t = Instant::now();
        }
    }

    fn phase(&self) -> (u8, Duration) {
        let since = self.since.lock().map(|t| t.elapsed()).unwrap_or_default();
        (self.phase.load(Ordering::Acquire), since)
    }

    /// A request head arrived (`has_body`: a body follows).
    pub fn request(&self, has_body: bool) {
        if let Ok(mut p) = self.probe.lock() {
            *p = ProbeState::default();
        }
        if let Ok(mut h) = self.head.lock() {
            let bytes = std::mem::take(&mut h.0);
            h.1 = Framing::of_head(&bytes);
        }
        self.set(if has_body { READING } else { BUSY });
        if !has_body {
            self.wrote.store(false, Ordering::Release);
        }
    }

    /// The request's body has been read: the request is busy until its answer ends.
    pub fn body_read(&self) {
        // hyper may have written a `100 Continue` for an `Expect` header before the body: the
        // answer starts after this.
        self.wrote.store(false, Ordering::Release);
        self.set(BUSY);
    }

    /// The answer has ended (its body was sent or dropped).
    pub fn answered(&self) {
        self.set(IDLE);
    }

    /// Close the connection (drops its in-flight request).
    pub fn close(&self) {
        self.close.notify_one();
    }

    /// Resolves when the connection must close.
    pub async fn closed(&self) {
        self.close.notified().await
    }

    fn evictable(&self) -> bool {
        self.phase.load(Ordering::Acquire) != BUSY
    }
}

/// Marks the answer's end when dropped (kept by the response body).
#[derive(Debug)]
pub struct AnswerGuard(pub Arc<Conn>);

impl Drop for AnswerGuard {
    fn drop(&mut self) {
        self.0.answered();
    }
}

/// The connections open now.
#[derive(Debug)]
pub struct Registry {
    limits: Limits,
    open: Mutex<(u64, HashMap<u64, Arc<Conn>>)>,
}

/// A place in the registry; dropping it frees the place.
#[derive(Debug)]
pub struct Slot {
    reg: Arc<Registry>,
    id: u64,
    /// The connection.
    pub conn: Arc<Conn>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut o) = self.reg.open.lock() {
            o.1.remove(&self.id);
        }
    }
}

impl Registry {
    /// An empty registry.
    pub fn new(limits: Limits) -> Arc<Registry> {
        Arc::new(Registry {
            limits,
            open: Mutex::new((0, HashMap::new())),
        })
    }

    /// The limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.lock().map(|o| o.1.len()).unwrap_or(0)
    }

    /// Admit a connection from `peer`, closing the oldest non-busy connection (of the same
    /// address first) when a cap is reached; `None` when every candidate is busy.
    pub fn admit(self: &Arc<Self>, peer: SocketAddr) -> Option<Slot> {
        let mut o = self.open.lock().ok()?;
        let ip = peer.ip();
        let oldest = |map: &HashMap<u64, Arc<Conn>>, same: Option<IpAddr>| {
            map.iter()
                .filter(|(_, c)| same.is_none_or(|a| c.peer.ip() == a) && c.evictable())
                .max_by_key(|(_, c)| c.phase().1)
                .map(|(id, _)| *id)
        };
        let from_peer = o.1.values().filter(|c| c.peer.ip() == ip).count();
        if from_peer >= self.limits.per_addr {
            let id = oldest(&o.1, Some(ip))?;
            let c = o.1.remove(&id)?;
            tracing::info!(
                "closing connection from {} to make room ({} from that address)",
                c.peer,
                from_peer
            );
            c.close();
        }
        if o.1.len() >= self.limits.total {
            let id = oldest(&o.1, Some(ip)).or_else(|| oldest(&o.1, None))?;
            let c = o.1.remove(&id)?;
            tracing::info!(
                "closing connection from {} to make room ({} open)",
                c.peer,
                o.1.len() + 1
            );
            c.close();
        }
        o.0 += 1;
        let id = o.0;
        let conn = Arc::new(Conn::new(peer));
        o.1.insert(id, conn.clone());
        Some(Slot {
            reg: self.clone(),
            id,
            conn,
        })
    }
}

/// The TCP stream hyper reads and writes, shared with the connection's watcher (which peeks and
/// writes the interim probe between hyper's writes, under the same lock).
#[derive(Debug)]
pub struct Stream {
    tcp: Arc<TcpStream>,
    conn: Arc<Conn>,
}

impl Stream {
    /// Wrap `tcp` for `conn`; returns the stream and the handle the watcher uses.
    pub fn new(tcp: TcpStream, conn: Arc<Conn>) -> (Stream, Arc<TcpStream>) {
        let tcp = Arc::new(tcp);
        (
            Stream {
                tcp: tcp.clone(),
                conn,
            },
            tcp,
        )
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.tcp.poll_read_ready(cx))?;
            match self.tcp.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    self.conn.record(&buf.initialize_unfilled()[..n]);
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(self.failed(e))),
            }
        }
    }
}

impl Stream {
    /// Note a socket failure for the watcher (hyper may keep a request going after a failed
    /// read of a half-closed connection).
    fn failed(&self, e: io::Error) -> io::Error {
        self.conn.failed.store(true, Ordering::Release);
        e
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            let mut probe = match self.conn.probe.lock() {
                Ok(p) => p,
                Err(_) => return Poll::Ready(Err(io::Error::other("connection state poisoned"))),
            };
            // A probe the watcher could not finish goes out first, whole.
            while !probe.pending.is_empty() {
                match self.tcp.try_write(&probe.pending) {
                    Ok(n) => {
                        probe.pending.drain(..n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Poll::Ready(Err(self.failed(e))),
                }
            }
            if !probe.pending.is_empty() {
                continue;
            }
            self.conn.wrote.store(true, Ordering::Release);
            match self.tcp.try_write(buf) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(self.failed(e))),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(socket2::SockRef::from(&*self.tcp).shutdown(std::net::Shutdown::Write))
    }
}

/// What a look at the socket found.
#[derive(Debug, PartialEq, Eq)]
enum Peek {
    /// Bytes wait to be read (or nothing happened).
    Nothing,
    /// The client has ended its sending side.
    Eof,
    /// The socket failed (a reset: the client is gone).
    Gone,
}

fn peek(tcp: &TcpStream) -> Peek {
    let mut b = [MaybeUninit::<u8>::uninit(); 1];
    // The socket is non-blocking (tokio's), so this never waits.
    match socket2::SockRef::from(tcp).peek(&mut b) {
        Ok(0) => Peek::Eof,
        Ok(_) => Peek::Nothing,
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            Peek::Nothing
        }
        Err(_) => Peek::Gone,
    }
}

/// Watch `conn` until it closes: close it when its client is gone, when it stayed idle too
/// long, or when a request body takes too long.
pub async fn watch(conn: Arc<Conn>, tcp: Arc<TcpStream>, limits: Limits) {
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        let (phase, since) = conn.phase();
        let why = match phase {
            _ if conn.failed.load(Ordering::Acquire) => Some("client gone (socket failed)"),
            IDLE if since > limits.idle => Some("idle"),
            HEAD if since > limits.head => Some("request head too slow"),
            READING if since > limits.body + Duration::from_secs(5) => Some("body too slow"),
            BUSY => match peek(&tcp) {
                Peek::Gone => Some("client gone"),
                // After the client's end of sending the socket reads as ended even once a reset
                // has come (Linux reports the reset's error only through SO_ERROR then).
                Peek::Eof if matches!(tcp.take_error(), Ok(Some(_))) => Some("client gone (reset)"),
                Peek::Eof => {
                    probe(&conn, &tcp);
                    None
                }
                Peek::Nothing => None,
            },
            _ => None,
        };
        if let Some(why) = why {
            tracing::debug!("closing the connection from {}: {why}", conn.peer);
            conn.close();
            return;
        }
    }
}

/// After the client's end of sending, before the answer: write the interim response once (a
/// client that closed its socket answers it with a reset).
fn probe(conn: &Conn, tcp: &TcpStream) {
    let Ok(mut p) = conn.probe.lock() else {
        return;
    };
    if p.sent || conn.wrote.load(Ordering::Acquire) {
        return;
    }
    p.sent = true;
    let n = match tcp.try_write(PROBE) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(_) => {
            conn.close();
            return;
        }
    };
    p.pending = PROBE[n..].to_vec();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_addr: usize) -> Limits {
        Limits {
            total,
            per_addr,
            head: Duration::from_secs(1),
            body: Duration::from_secs(1),
            idle: Duration::from_secs(1),
        }
    }

    #[test]
    fn caps_close_the_oldest_non_busy_connection_from_the_same_address_first() {
        let reg = Registry::new(limits(3, 2));
        let a: SocketAddr = "127.0.0.2:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.3:1".parse().unwrap();
        let a1 = reg.admit(a).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let a2 = reg.admit(a).unwrap();
        a2.conn.request(false); // busy
                                // A third from `a` replaces a1 (a2 is busy).
        let a3 = reg.admit(a).unwrap();
        assert_eq!(reg.open(), 2);
        assert!(tokio_test_notified(&a1.conn));
        // The total cap: b's first connection fits; its second takes the place of b's first
        // (the same address first), not a3's.
        let b1 = reg.admit(b).unwrap();
        assert_eq!(reg.open(), 3);
        assert!(!tokio_test_notified(&a3.conn));
        let b2 = reg.admit(b).unwrap();
        assert!(tokio_test_notified(&b1.conn));
        assert_eq!(reg.open(), 3);
        // Every connection busy: refused.
        for s in [&a2, &a3, &b2] {
            s.conn.request(false);
        }
        assert!(reg.admit(b).is_none());
        drop((a1, b1));
        a3.conn.answered();
        assert!(reg.admit(a).is_some(), "a3 is idle again");
        assert!(tokio_test_notified(&a3.conn));
    }

    #[test]
    fn a_head_with_a_length_and_a_transfer_coding_conflicts() {
        let f = |head: &str| Framing::of_head(head.as_bytes());
        let both = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\
                    transfer-encoding: chunked\r\n\r\n0\r\n\r\n";
        assert!(f(both).unwrap().conflicts());
        // Whichever comes first.
        let te_first = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\ncontent-length: 5\r\n\r\n";
        assert!(f(te_first).unwrap().conflicts());
        let cl = "POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
        assert!(!f(cl).unwrap().conflicts());
        let te = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(!f(te).unwrap().conflicts());
        // A body that looks like a head does not count: only the head's lines.
        let body =
            "POST / HTTP/1.1\r\nContent-Length: 31\r\n\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(!f(body).unwrap().conflicts());
        assert_eq!(f("POST / HTTP/1.1\r\nContent-Le"), None);
        // Bytes are kept only while the connection waits for a head, at most HEAD_RECORD.
        let c = Conn::new("127.0.0.1:1".parse().unwrap());
        c.record(both.as_bytes());
        c.request(true);
        assert!(c.framing().unwrap().conflicts());
        c.record(cl.as_bytes()); // READING: the body, not a head
        c.body_read();
        c.answered();
        c.record(&vec![b'x'; 2 * HEAD_RECORD]);
        c.request(true);
        assert_eq!(c.framing(), None);
        c.answered();
        c.record(cl.as_bytes());
        c.request(true);
        assert!(!c.framing().unwrap().conflicts());
    }

    #[test]
    fn the_heads_deadline_starts_at_its_first_byte_not_while_the_connection_waits() {
        let c = Conn::new("127.0.0.1:1".parse().unwrap());
        c.record(b"");
        assert_eq!(
            c.phase().0,
            IDLE,
            "nothing read: still waiting (the idle deadline)"
        );
        std::thread::sleep(Duration::from_millis(300));
        c.record(b"GET / HT");
        let (phase, since) = c.phase();
        assert_eq!(phase, HEAD);
        assert!(
            since < Duration::from_millis(300),
            "the head's clock starts at its first byte"
        );
        c.record(b"TP/1.1\r\n");
        assert_eq!(c.phase().0, HEAD);
        c.request(false);
        assert_eq!(c.phase().0, BUSY);
        c.record(b"GET /next HTTP/1.1\r\n"); // pipelined while busy: not a head yet
        assert_eq!(c.phase().0, BUSY);
        c.answered();
        assert_eq!(c.phase().0, IDLE, "kept alive: back to the idle deadline");
        assert!(c.evictable());
        c.record(b"G");
        assert!(
            c.evictable(),
            "a head still coming may be closed to make room"
        );
    }

    /// True when `close` was called (the permit is stored).
    fn tokio_test_notified(c: &Conn) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(10), c.closed())
                .await
                .is_ok()
        })
    }
}
