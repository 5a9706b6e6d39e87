//! Unix-socket plumbing shared by the store, workers and `k3-ctl`: the socket directory's trust
//! check (ours, not writable by others) and file permissions, stale-socket detection, the
//! peer-uid check, and the transport of frames that carry a file descriptor (`SCM_RIGHTS`; the
//! framing itself is `k3_proto::wire`'s).

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use k3_proto::wire::{self, WireError};
use nix::sys::socket::{self, sockopt, ControlMessage, ControlMessageOwned, MsgFlags};

/// What is at a socket path before the store binds it.
#[derive(Debug, PartialEq, Eq)]
pub enum Existing {
    /// Nothing there.
    Nothing,
    /// A socket file nobody listens on (a store that died): safe to remove.
    Stale,
    /// A store answers there.
    Live,
}

/// Look at `path`: nothing, a stale socket, or a live store.
pub fn probe(path: &Path) -> std::io::Result<Existing> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Nothing),
        Err(e) => return Err(e),
        Ok(m) => {
            use std::os::unix::fs::FileTypeExt;
            if !m.file_type().is_socket() {
                return Err(std::io::Error::other(format!(
                    "{} exists and is not a socket; refusing to touch it",
                    path.display()
                )));
            }
        }
    }
    match UnixStream::connect(path) {
        Ok(_) => Ok(Existing::Live),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(Existing::Stale),
        Err(e) => Err(e),
    }
}

/// Why a socket directory is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// The directory does not exist (clients: no store there).
    #[error("{0} does not exist")]
    Missing(String),
    /// The directory cannot be inspected or created.
    #[error("{path}: {err}")]
    Io {
        /// The directory.
        path: String,
        /// What went wrong.
        err: std::io::Error,
    },
    /// Not a directory, another owner, or writable by others.
    #[error("{0}")]
    Untrusted(String),
}

/// The directory a socket path lives in (`.` for a bare file name).
pub fn socket_dir(socket: &Path) -> &Path {
    match socket.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Check that `dir` is a directory owned by `uid` that neither group nor others can write.
///
/// This is what keeps another local user out: whoever owns the directory decides what socket
/// (and what log) is there. Symlinks are followed: what counts is the directory itself. Readable
/// directories (0755) are accepted: the socket inside is 0600 and nobody else can add to them.
pub fn check_private_dir(dir: &Path, uid: u32) -> Result<(), TrustError> {
    let m = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(TrustError::Missing(dir.display().to_string()))
        }
        Err(err) => {
            return Err(TrustError::Io {
                path: dir.display().to_string(),
                err,
            })
        }
    };
    if !m.is_dir() {
        return Err(TrustError::Untrusted(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if m.uid() != uid {
        return Err(TrustError::Untrusted(format!(
            "socket directory {} belongs to uid {}, not to uid {uid} (you): another user may \
             have created it; refusing to use it",
            dir.display(),
            m.uid()
        )));
    }
    let mode = m.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(TrustError::Untrusted(format!(
            "socket directory {} has mode {mode:04o}: group or others can write there; refusing \
             to use it (chmod 700 {})",
            dir.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// The store's side: create the socket's directory if missing (mode 0700), then require it to be
/// ours and private ([`check_private_dir`]). Runs before anything is opened there.
pub fn prepare_socket_dir(socket: &Path) -> Result<(), TrustError> {
    let dir = socket_dir(socket);
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|err| TrustError::Io {
                path: dir.display().to_string(),
                err,
            })?;
    }
    check_private_dir(dir, current_uid())
}

/// Why the store could not bind its socket.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another store is serving at this path.
    #[error("a store is already running at {0} (stop it with `k3-ctl stop --socket {0}`)")]
    Live(String),
    /// The socket's directory is not ours or others can write there (refused: exit 2).
    #[error("{0}")]
    Untrusted(TrustError),
    /// Anything else.
    #[error("cannot listen at {path}: {err}")]
    Io {
        /// The socket path.
        path: String,
        /// What went wrong.
        err: std::io::Error,
    },
}

/// Prepare the socket's directory ([`prepare_socket_dir`]), replace a stale socket, refuse a
/// live one, bind, and make the socket 0600.
pub fn bind(path: &Path) -> Result<UnixListener, BindError> {
    let io = |err: std::io::Error| BindError::Io {
        path: path.display().to_string(),
        err,
    };
    match prepare_socket_dir(path) {
        Ok(()) => {}
        Err(TrustError::Io { err, .. }) => return Err(io(err)),
        Err(e) => return Err(BindError::Untrusted(e)),
    }
    match probe(path).map_err(io)? {
        Existing::Live => return Err(BindError::Live(path.display().to_string())),
        Existing::Stale => std::fs::remove_file(path).map_err(io)?,
        Existing::Nothing => {}
    }
    let listener = UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(listener)
}

/// This process's real uid.
pub fn current_uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

/// The uid of the process at the other end (`SO_PEERCRED` on Linux, `getpeereid` elsewhere: for
/// a client, the process that called `listen`).
pub fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    return Ok(peer_cred(stream)?.0);
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    return Ok(nix::unistd::getpeereid(stream)?.0.as_raw());
}

/// The peer's uid and pid, as of its `connect` (`SO_PEERCRED`).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn peer_cred(stream: &UnixStream) -> std::io::Result<(u32, i32)> {
    let cred = socket::getsockopt(stream, sockopt::PeerCredentials)?;
    Ok((cred.uid(), cred.pid()))
}

/// The peer's uid and pid (`getpeereid` and `LOCAL_PEERPID`, as of its `connect`).
#[cfg(target_vendor = "apple")]
pub fn peer_cred(stream: &UnixStream) -> std::io::Result<(u32, i32)> {
    let uid = nix::unistd::getpeereid(stream)?.0.as_raw();
    let pid = socket::getsockopt(stream, sockopt::LocalPeerPid)?;
    Ok((uid, pid))
}

/// Flags of a `sendmsg` that must not raise `SIGPIPE` when the peer is gone: `MSG_NOSIGNAL`
/// where it exists; elsewhere the socket itself is marked ([`no_sigpipe`]). (Rust programs
/// ignore `SIGPIPE` anyway; this keeps the library right inside any program.)
#[cfg(any(target_os = "linux", target_os = "android"))]
fn send_flags(_stream: &UnixStream) -> MsgFlags {
    MsgFlags::MSG_NOSIGNAL
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn send_flags(stream: &UnixStream) -> MsgFlags {
    no_sigpipe(stream);
    MsgFlags::empty()
}

/// `SO_NOSIGPIPE` on `stream` (macOS and the BSDs: a write to a closed peer returns `EPIPE`
/// instead of raising `SIGPIPE`). Best effort.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn no_sigpipe(stream: &UnixStream) {
    let on: libc::c_int = 1;
    // SAFETY: `on` is a live c_int and its size is passed; SO_NOSIGPIPE only sets a flag on
    // this socket.
    let r = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NOSIGPIPE,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == -1 {
        tracing::debug!("SO_NOSIGPIPE: {}", std::io::Error::last_os_error());
    }
}

/// Flags of a `recvmsg` that receives descriptors: `MSG_CMSG_CLOEXEC` where it exists (the
/// descriptors arrive close-on-exec); elsewhere [`recv_keeping_fd`] sets close-on-exec on each
/// right after `recvmsg` returns (a descriptor could leak into a process another thread of
/// this one spawns in that instant; the store and workers spawn none while serving).
#[cfg(any(target_os = "linux", target_os = "android"))]
const RECV_FLAGS: MsgFlags = MsgFlags::MSG_CMSG_CLOEXEC;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const RECV_FLAGS: MsgFlags = MsgFlags::empty();

/// Send one frame ([`wire::encode`]), attaching `fd` (if any) to its first byte.
pub fn send_frame<T: serde::Serialize>(
    stream: &mut UnixStream,
    msg: &T,
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), WireError> {
    let Some(fd) = fd else {
        return wire::write_frame(stream, msg);
    };
    let frame = wire::encode(msg)?;
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&frame)],
        &cmsg,
        send_flags(stream),
        None,
    )
    .map_err(std::io::Error::from)?;
    stream.write_all(&frame[sent..])?;
    Ok(())
}

/// A [`Read`] over a Unix stream that receives with `recvmsg` and keeps the first descriptor that
/// arrives with the bytes (`SCM_RIGHTS`, close-on-exec); any further ones are closed.
struct FdReader<'a> {
    stream: &'a UnixStream,
    fd: Option<OwnedFd>,
}

impl Read for FdReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        recv_keeping_fd(self.stream, buf, &mut self.fd)
    }
}

/// One `recvmsg` into `buf`: the first descriptor that arrives (`SCM_RIGHTS`, close-on-exec) is
/// kept in `slot` if it is empty; any other is closed. Returns the bytes received.
pub fn recv_keeping_fd(
    stream: &UnixStream,
    buf: &mut [u8],
    slot: &mut Option<OwnedFd>,
) -> std::io::Result<usize> {
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), RECV_FLAGS)
        .map_err(std::io::Error::from)?;
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for r in raw {
                // SAFETY: the kernel just installed `r` in our table for us alone; wrapping it
                // once makes it closed exactly once (extra descriptors are dropped = closed).
                let owned = unsafe { crate::shmem::owned_fd(r) };
                if RECV_FLAGS.is_empty() {
                    crate::shmem::set_cloexec(owned.as_fd())?;
                }
                if slot.is_none() {
                    *slot = Some(owned);
                }
            }
        }
    }
    Ok(msg.bytes)
}

/// Receive one frame ([`wire::read_frame`]) and the descriptor attached to it, if any.
pub fn recv_frame<T: for<'de> serde::Deserialize<'de>>(
    stream: &mut UnixStream,
) -> Result<(T, Option<OwnedFd>), WireError> {
    let mut r = FdReader { stream, fd: None };
    let msg = wire::read_frame(&mut r)?;
    Ok((msg, r.fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_proto::wire::{Request, Response, PROTOCOL_VERSION};

    fn tmpdir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("k3-ipc-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn bind_sets_modes_and_detects_stale_and_live() {
        let dir = tmpdir("bind");
        let sock = dir.join("s").join("store.sock");
        let l = bind(&sock).unwrap();
        let dmode = std::fs::metadata(sock.parent().unwrap()).unwrap().mode() & 0o777;
        let smode = std::fs::metadata(&sock).unwrap().mode() & 0o777;
        assert_eq!((dmode, smode), (0o700, 0o600));
        assert_eq!(probe(&sock).unwrap(), Existing::Live);
        assert!(matches!(bind(&sock), Err(BindError::Live(_))));
        drop(l); // the file stays: a dead store's socket
        assert_eq!(probe(&sock).unwrap(), Existing::Stale);
        let _l2 = bind(&sock).expect("stale socket replaced");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn socket_directory_must_be_ours_and_private() {
        let dir = tmpdir("trust");
        let me = current_uid();
        assert!(matches!(
            check_private_dir(&dir, me),
            Err(TrustError::Missing(_))
        ));
        let sock = dir.join("store.sock");
        prepare_socket_dir(&sock).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_private_dir(&dir, me).expect("0755: others cannot write");
        for mode in [0o777, 0o775, 0o1777, 0o730] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = prepare_socket_dir(&sock).unwrap_err();
            assert!(e.to_string().contains("can write"), "{mode:o}: {e}");
            assert!(matches!(bind(&sock), Err(BindError::Untrusted(_))));
            assert!(!sock.exists());
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = check_private_dir(&dir, me + 1).unwrap_err();
        assert!(
            e.to_string().contains(&format!("belongs to uid {me}")),
            "{e}"
        );
        let file = dir.join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(check_private_dir(&file, me).is_err());
        assert_eq!(socket_dir(Path::new("r.sock")), Path::new("."));
        assert_eq!(socket_dir(Path::new("/a/r.sock")), Path::new("/a"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn refuses_to_remove_a_non_socket() {
        let dir = tmpdir("nonsock");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("store.sock");
        std::fs::write(&p, b"precious").unwrap();
        assert!(bind(&p).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"precious");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn frame_with_fd_round_trips() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        assert_eq!(peer_uid(&a).unwrap(), nix::unistd::getuid().as_raw());
        let mut seg = crate::shmem::Segment::create("k3-ipc-test", 4096).unwrap();
        seg.bytes_mut()[..3].copy_from_slice(b"k3!");
        let ro = seg.read_only_fd().unwrap();
        let msg = Response::Welcome {
            protocol_version: PROTOCOL_VERSION,
            model_dir: "/m".into(),
            trunk_dir: "/t".into(),
            shm_bytes: 4096,
            draft_dir: String::new(),
            trunk: Default::default(),
        };
        send_frame(&mut a, &msg, Some(ro.as_fd())).unwrap();
        send_frame(&mut a, &Request::Stats, None).unwrap();
        let (got, fd): (Response, _) = recv_frame(&mut b).unwrap();
        assert_eq!(got, msg);
        let view = crate::shmem::ReadOnlySegment::map(fd.expect("fd attached"), 4096).unwrap();
        assert_eq!(&view.bytes()[..3], b"k3!");
        let (got2, fd2): (Request, _) = recv_frame(&mut b).unwrap();
        assert_eq!(got2, Request::Stats);
        assert!(fd2.is_none());
        drop(a);
        assert!(matches!(
            recv_frame::<Request>(&mut b),
            Err(WireError::Closed)
        ));
    }
}
