//! Unix-socket plumbing shared by the store, workers and `k3-ctl`: the socket directory and file
//! permissions, stale-socket detection, the peer-uid check, and frames that carry a file
//! descriptor (`SCM_RIGHTS`).

use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
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

/// Why the store could not bind its socket.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another store is serving at this path.
    #[error("a store is already running at {0} (stop it with `k3-ctl stop --socket {0}`)")]
    Live(String),
    /// Anything else.
    #[error("cannot listen at {path}: {err}")]
    Io {
        /// The socket path.
        path: String,
        /// What went wrong.
        err: std::io::Error,
    },
}

/// Create the socket's directory (mode 0700, refused if owned by another user), replace a stale
/// socket, refuse a live one, bind, and make the socket 0600.
pub fn bind(path: &Path) -> Result<UnixListener, BindError> {
    let io = |err: std::io::Error| BindError::Io {
        path: path.display().to_string(),
        err,
    };
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io)?;
        }
        let m = std::fs::metadata(dir).map_err(io)?;
        if m.uid() != nix::unistd::getuid().as_raw() {
            return Err(io(std::io::Error::other(format!(
                "directory {} belongs to uid {}, not to us",
                dir.display(),
                m.uid()
            ))));
        }
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

/// The uid of the process at the other end (`SO_PEERCRED`).
pub fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let cred = socket::getsockopt(stream, sockopt::PeerCredentials)?;
    Ok(cred.uid())
}

/// Send one frame, attaching `fd` (if any) to its first byte.
pub fn send_frame<T: serde::Serialize>(
    stream: &mut UnixStream,
    msg: &T,
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), WireError> {
    let frame = wire::encode(msg)?;
    let Some(fd) = fd else {
        stream.write_all(&frame)?;
        return Ok(());
    };
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&frame)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    stream.write_all(&frame[sent..])?;
    Ok(())
}

/// Receive one frame and the descriptor attached to it, if any.
pub fn recv_frame<T: for<'de> serde::Deserialize<'de>>(
    stream: &mut UnixStream,
) -> Result<(T, Option<OwnedFd>), WireError> {
    let mut len = [0u8; 4];
    let mut got = 0usize;
    let mut fd: Option<OwnedFd> = None;
    while got < 4 {
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let mut iov = [IoSliceMut::new(&mut len[got..])];
        let msg = socket::recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        if msg.bytes == 0 {
            return Err(WireError::Closed);
        }
        got += msg.bytes;
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for r in raw {
                    // SAFETY: the kernel just installed `r` in our table for us alone; wrapping it
                    // once makes it closed exactly once (extra descriptors are dropped = closed).
                    let owned = unsafe { crate::shmem::owned_fd(r) };
                    if fd.is_none() {
                        fd = Some(owned);
                    }
                }
            }
        }
    }
    let body = wire::read_body(stream, u32::from_le_bytes(len))?;
    Ok((wire::decode(&body)?, fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_proto::wire::{Request, Response, PROTOCOL_VERSION};
    use std::os::fd::AsFd;

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
