//! The client side of the store protocol, used by `k3-ctl` and attached workers.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use k3_proto::wire::{ClientKind, Request, Response, WireError, PROTOCOL_VERSION};

use crate::ipc;

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
    /// The store refused the handshake (e.g. protocol version).
    #[error("the store refused the connection: {0}")]
    Refused(String),
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
        let mut stream = UnixStream::connect(socket).map_err(|err| ClientError::Unreachable {
            path: socket.display().to_string(),
            err,
        })?;
        ipc::send_frame(
            &mut stream,
            &Request::Hello {
                protocol_version: version,
                kind,
                label: label.to_string(),
            },
            None,
        )?;
        let (welcome, shm_fd) = ipc::recv_frame::<Response>(&mut stream)?;
        match welcome {
            Response::Welcome { .. } => Ok(Client {
                stream,
                welcome,
                shm_fd,
            }),
            Response::Refused { reason, .. } => Err(ClientError::Refused(reason)),
            Response::Error { message } => Err(ClientError::Refused(message)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Send a request and wait for its response.
    pub fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        ipc::send_frame(&mut self.stream, req, None)?;
        let (resp, _) = ipc::recv_frame::<Response>(&mut self.stream)?;
        Ok(resp)
    }
}
