//! The client side of the store protocol, used by `k3-ctl` and attached workers.
//!
//! A client trusts only its own user's store: before connecting it checks that the socket's
//! directory is owned by its uid and not writable by group or others, and after connecting that
//! the listening process runs as its uid (`SO_PEERCRED`). Either failing is
//! [`ClientError::Untrusted`] (exit 3).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use k3_proto::wire::{
    self, ClientKind, LoadingReport, Request, Response, WireError, PROTOCOL_VERSION,
};

use crate::ipc;

/// How long a client waits for the store's `Welcome` (a store that accepts but never answers
/// is reported, not waited on forever).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// A connected, handshaken client.
pub struct Client {
    stream: UnixStream,
    /// The store's `Welcome`.
    pub welcome: Response,
    /// The shared-memory descriptor (workers only).
    pub shm_fd: Option<OwnedFd>,
}

/// Why a client could not talk to the store.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens at the path (exit 3).
    #[error("no store answers at {path}: {err} (start one with `k3-store start …`)")]
    Unreachable {
        /// Socket path.
        path: String,
        /// Underlying error.
        err: std::io::Error,
    },
    /// The socket's directory or the process listening there is not this user's (exit 3).
    #[error("untrusted store at {path}: {reason}")]
    Untrusted {
        /// Socket path.
        path: String,
        /// Why (owner, mode, peer uid).
        reason: String,
    },
    /// The store refused the handshake (e.g. protocol version).
    #[error("the store refused the connection: {0}")]
    Refused(String),
    /// The store answered with an error of a kind a client can match.
    #[error("the store answered {code:?}: {message}")]
    Store {
        /// What kind of failure.
        code: k3_proto::wire::ErrorCode,
        /// Why.
        message: String,
    },
    /// The store is still loading its shared memory (exit 3): nothing is served before it is
    /// ready.
    #[error("{}; retry once it is ready (`k3-ctl status` answers then)", .0.line())]
    Loading(LoadingReport),
    /// A protocol error.
    #[error("store protocol: {0}")]
    Wire(#[from] WireError),
    /// An unexpected answer.
    #[error("unexpected answer from the store: {0}")]
    Unexpected(String),
}

impl Client {
    /// Connect to the store at `socket` and handshake as `kind`.
    pub fn connect(socket: &Path, kind: ClientKind, label: &str) -> Result<Client, ClientError> {
        Self::connect_with_version(socket, kind, label, PROTOCOL_VERSION)
    }

    /// As [`Client::connect`], claiming `version` (tests use this to check refusals).
    pub fn connect_with_version(
        socket: &Path,
        kind: ClientKind,
        label: &str,
        version: u32,
    ) -> Result<Client, ClientError> {
        let path = socket.display().to_string();
        let untrusted = |reason: String| ClientError::Untrusted {
            path: path.clone(),
            reason,
        };
        // Before connecting: the directory must be ours and private, or someone else chose what
        // listens there.
        let me = ipc::current_uid();
        match ipc::check_private_dir(ipc::socket_dir(socket), me) {
            Ok(()) => {}
            Err(ipc::TrustError::Missing(d)) => {
                return Err(ClientError::Unreachable {
                    path,
                    err: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("directory {d} does not exist"),
                    ),
                })
            }
            Err(e) => return Err(untrusted(e.to_string())),
        }
        let mut stream = UnixStream::connect(socket).map_err(|err| ClientError::Unreachable {
            path: path.clone(),
            err,
        })?;
        // After connecting: the process that listens must run as us (`SO_PEERCRED`).
        let peer = ipc::peer_uid(&stream)
            .map_err(|e| untrusted(format!("cannot read the store's credentials: {e}")))?;
        if peer != me {
            return Err(untrusted(format!(
                "the store there runs as uid {peer}, not as uid {me} (you); refusing its weights"
            )));
        }
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(WireError::Io)?;
        ipc::send_frame(
            &mut stream,
            &Request::Hello {
                protocol_version: version,
                kind,
                label: wire::bounded_label(label).to_string(),
            },
            None,
        )?;
        let (welcome, shm_fd) = ipc::recv_frame::<Response>(&mut stream).map_err(|e| match e {
            WireError::Io(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                ClientError::Unreachable {
                    path: path.clone(),
                    err: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the store accepted but did not answer within {} s (overloaded?)",
                            HANDSHAKE_TIMEOUT.as_secs()
                        ),
                    ),
                }
            }
            e => ClientError::Wire(e),
        })?;
        stream.set_read_timeout(None).map_err(WireError::Io)?;
        match welcome {
            Response::Welcome { .. } => Ok(Client {
                stream,
                welcome,
                shm_fd,
            }),
            Response::Refused { reason, .. } => Err(ClientError::Refused(reason)),
            Response::Error { code, message } => Err(ClientError::Store { code, message }),
            Response::Loading(r) => Err(ClientError::Loading(r)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Send a request and wait for its response. A store still loading answers
    /// [`ClientError::Loading`].
    pub fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        Ok(self.call_with_fd(req, None)?.0)
    }

    /// Send a request with `fd` attached (if any) and wait for its response and the descriptor
    /// that came with it (a kept session travels this way).
    pub fn call_with_fd(
        &mut self,
        req: &Request,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<(Response, Option<OwnedFd>), ClientError> {
        ipc::send_frame(&mut self.stream, req, fd)?;
        match ipc::recv_frame::<Response>(&mut self.stream)? {
            (Response::Loading(r), _) => Err(ClientError::Loading(r)),
            answer => Ok(answer),
        }
    }
}
