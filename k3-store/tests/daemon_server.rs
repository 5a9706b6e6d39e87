//! The daemon's server against a fake backend: handshake, version refusal, dispatch, release on
//! disconnect (including an abrupt close), stop and socket removal.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use k3_proto::wire::{
    ClientKind, Request, Response, SlotAnswer, StatsReport, StatusReport, PROTOCOL_VERSION,
};
use k3_store::attach::client::{Client, ClientError};
use k3_store::daemon::{Backend, ConnId, Server};
use k3_store::shmem::Segment;

#[derive(Default)]
struct Log {
    leased: Vec<(ConnId, u32, Vec<u32>)>,
    released: Vec<ConnId>,
}

struct Fake {
    log: Arc<Mutex<Log>>,
    seg: Segment,
}

impl Backend for Fake {
    fn experts(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Response {
        self.log
            .lock()
            .unwrap()
            .leased
            .push((conn, layer, ids.to_vec()));
        Response::Experts {
            answers: ids
                .iter()
                .map(|&e| SlotAnswer::Leased {
                    slot: e * 10,
                    at: 0,
                })
                .collect(),
            resident_hits: 0,
        }
    }
    fn release_all(&self, conn: ConnId) {
        self.log.lock().unwrap().released.push(conn);
    }
    fn stats(&self, _conn: ConnId) -> StatsReport {
        StatsReport {
            slots_total: 7,
            ..Default::default()
        }
    }
    fn status(&self) -> StatusReport {
        StatusReport {
            preset: "test".into(),
            ..Default::default()
        }
    }
    fn worker_fd(&self) -> std::io::Result<(OwnedFd, u64)> {
        Ok((self.seg.read_only_fd()?, self.seg.len() as u64))
    }
    fn dirs(&self) -> (String, String) {
        ("/model".into(), "/trunk".into())
    }
}

type Started = (
    std::path::PathBuf,
    Arc<AtomicBool>,
    Arc<Mutex<Log>>,
    std::thread::JoinHandle<usize>,
    tempfile::TempDir,
);

fn start(tag: &str) -> Started {
    let dir = tempfile::Builder::new()
        .prefix(&format!("k3-srv-{tag}-"))
        .tempdir()
        .unwrap();
    // The server creates the socket's directory itself.
    let sock = dir.path().join("run").join("store.sock");
    let listener = k3_store::ipc::bind(&sock).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Log::default()));
    let mut seg = Segment::create("k3-srv-test", 4096).unwrap();
    seg.bytes_mut()[0] = 42;
    let server = Server::new(
        listener,
        sock.clone(),
        Fake {
            log: log.clone(),
            seg,
        },
        stop.clone(),
    );
    let h = std::thread::spawn(move || server.run());
    (sock, stop, log, h, dir)
}

#[test]
fn worker_handshake_gets_memory_and_leases() {
    let (sock, stop, log, h, _dir) = start("worker");
    let mut c = Client::connect(&sock, ClientKind::Worker, "test worker").unwrap();
    let fd = c.shm_fd.take().expect("workers receive the shared memory");
    let view = k3_store::shmem::ReadOnlySegment::map(fd, 4096).unwrap();
    assert_eq!(view.bytes()[0], 42);
    match c
        .call(&Request::Experts {
            layer: 3,
            ids: vec![5, 1],
        })
        .unwrap()
    {
        Response::Experts { answers, .. } => assert_eq!(
            answers,
            vec![
                SlotAnswer::Leased { slot: 50, at: 0 },
                SlotAnswer::Leased { slot: 10, at: 0 }
            ]
        ),
        other => panic!("{other:?}"),
    }
    match c.call(&Request::Stats).unwrap() {
        Response::Stats(s) => assert_eq!(s.slots_total, 7),
        other => panic!("{other:?}"),
    }
    // An abrupt close (as after SIGKILL) releases the connection's leases.
    drop(c);
    for _ in 0..200 {
        if !log.lock().unwrap().released.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(log.lock().unwrap().released.len(), 1);
    assert_eq!(log.lock().unwrap().leased[0].1, 3);
    stop.store(true, Ordering::SeqCst);
    assert_eq!(h.join().unwrap(), 0);
    assert!(!sock.exists(), "socket removed on shutdown");
}

#[test]
fn version_mismatch_is_refused_naming_both() {
    let (sock, stop, _log, h, _dir) = start("version");
    let err = Client::connect_with_version(&sock, ClientKind::Worker, "old", PROTOCOL_VERSION + 7)
        .err()
        .expect("refused");
    match err {
        ClientError::Refused(msg) => {
            assert!(msg.contains(&format!("v{}", PROTOCOL_VERSION + 7)), "{msg}");
            assert!(msg.contains(&format!("v{PROTOCOL_VERSION}")), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
}

#[test]
fn control_clients_cannot_lease_and_stop_drains() {
    let (sock, _stop, _log, h, _dir) = start("ctl");
    let mut c = Client::connect(&sock, ClientKind::Control, "k3-ctl").unwrap();
    assert!(c.shm_fd.is_none(), "control clients get no memory");
    assert!(matches!(
        c.call(&Request::Experts {
            layer: 0,
            ids: vec![1]
        })
        .unwrap(),
        Response::Error { .. }
    ));
    match c.call(&Request::Status).unwrap() {
        Response::Status(s) => {
            assert_eq!(s.preset, "test");
            assert_eq!(s.clients, vec!["k3-ctl".to_string()]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.call(&Request::Stop).unwrap(), Response::Stopping);
    drop(c);
    assert_eq!(h.join().unwrap(), 0);
    assert!(!sock.exists());
    assert!(matches!(
        Client::connect(&sock, ClientKind::Control, "late"),
        Err(ClientError::Unreachable { .. })
    ));
}

#[test]
fn first_message_must_be_hello() {
    let (sock, stop, _log, h, _dir) = start("hello");
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    k3_store::ipc::send_frame(&mut s, &Request::Stats, None).unwrap();
    let (resp, _) = k3_store::ipc::recv_frame::<Response>(&mut s).unwrap();
    assert!(
        matches!(resp, Response::Error { code: k3_proto::wire::ErrorCode::BadRequest, message } if message.contains("Hello"))
    );
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
}

/// While the store loads, its socket answers: a worker is told how far the load is (exit 3, not
/// a 30 s silence), a control client's requests get the same, a version mismatch is still
/// refused, `Stop` sets the stop flag; once the gate closes, the same listener serves normally.
#[test]
fn a_loading_store_answers_and_stops_then_hands_its_socket_to_the_server() {
    use k3_store::daemon::loading::{LoadState, LoadingGate};
    use k3_store::daemon::Limits;
    let dir = tempfile::Builder::new()
        .prefix("k3-srv-loading-")
        .tempdir()
        .unwrap();
    let sock = dir.path().join("run").join("store.sock");
    let listener = k3_store::ipc::bind(&sock).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let load = LoadState::new("/model", "server");
    load.set(1_500_000_000, 6_000_000_000);
    let gate = LoadingGate::open(
        listener,
        load.clone(),
        stop.clone(),
        Limits::default(),
        ("/model".into(), "/trunk".into()),
    )
    .unwrap();
    let t0 = std::time::Instant::now();
    match Client::connect(&sock, ClientKind::Worker, "early worker") {
        Err(ClientError::Loading(r)) => {
            assert_eq!(r.pid, std::process::id());
            assert_eq!(
                (r.done_bytes, r.total_bytes),
                (1_500_000_000, 6_000_000_000)
            );
            assert_eq!(r.preset, "server");
            let e = ClientError::Loading(r);
            assert_eq!(k3_proto::exit::ExitStatus::exit_code(&e), 3);
            let msg = e.to_string();
            assert!(
                msg.contains("still loading") && msg.contains("(25%)"),
                "{msg}"
            );
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a loading store welcomed a worker"),
    }
    assert!(t0.elapsed() < std::time::Duration::from_secs(2));
    let refused = Client::connect_with_version(&sock, ClientKind::Control, "old", 1);
    assert!(matches!(refused, Err(ClientError::Refused(_))));
    let mut c = Client::connect(&sock, ClientKind::Control, "k3-ctl").unwrap();
    assert!(c.shm_fd.is_none());
    load.set(3_000_000_000, 6_000_000_000);
    for req in [Request::Status, Request::Stats, Request::ListSessions] {
        match c.call(&req) {
            Err(ClientError::Loading(r)) => assert_eq!(r.done_bytes, 3_000_000_000),
            other => panic!("{req:?}: {:?}", other.map(|_| ())),
        }
    }
    assert!(!stop.load(Ordering::SeqCst));
    assert_eq!(c.call(&Request::Stop).unwrap(), Response::Stopping);
    assert!(
        stop.load(Ordering::SeqCst),
        "Stop during the load sets the stop flag"
    );
    drop(c);
    // The load finished after all (the flag is the caller's to act on): the server takes over.
    let listener = gate.close();
    let log = Arc::new(Mutex::new(Log::default()));
    let seg = Segment::create("k3-srv-loading", 4096).unwrap();
    let stop2 = Arc::new(AtomicBool::new(false));
    let server = Server::new(listener, sock.clone(), Fake { log, seg }, stop2.clone());
    let h = std::thread::spawn(move || server.run());
    let c = Client::connect(&sock, ClientKind::Worker, "worker").unwrap();
    assert!(
        c.shm_fd.is_some(),
        "served by the server once the gate is closed"
    );
    drop(c);
    stop2.store(true, Ordering::SeqCst);
    assert_eq!(h.join().unwrap(), 0);
    assert!(!sock.exists());
}
