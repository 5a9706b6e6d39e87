//! The exit code of every error the store library hands to a binary
//! ([`k3_proto::exit::ExitStatus`]): the one mapping the three binaries share, printed and
//! applied by [`k3_proto::exit::report`].

use k3_proto::exit::{ExitStatus, FAILURE, NO_STORE, REFUSED};

use crate::attach::client::ClientError;
use crate::attach::AttachError;
use crate::ipc::BindError;
use crate::runtime::catalog::CatalogError;
use crate::runtime::identity::IdentityError;
use crate::runtime::io::ReadError;
use crate::runtime::standalone::OpenError;
use crate::runtime::trunk::TrunkError;

impl ExitStatus for ClientError {
    /// The store is unreachable, untrusted or refused us: 3; a typed error answer: its code's.
    fn exit_code(&self) -> i32 {
        match self {
            ClientError::Store { code, .. } => code.exit_code(),
            ClientError::Unexpected(_) => FAILURE,
            _ => NO_STORE,
        }
    }
}

impl ExitStatus for AttachError {
    fn exit_code(&self) -> i32 {
        match self {
            AttachError::Refused(_) => REFUSED,
            _ => NO_STORE,
        }
    }
}

impl ExitStatus for OpenError {
    fn exit_code(&self) -> i32 {
        OpenError::exit_code(self)
    }
}

impl ExitStatus for TrunkError {
    fn exit_code(&self) -> i32 {
        match self {
            TrunkError::Refused(_) => REFUSED,
            TrunkError::Io(_) => FAILURE,
        }
    }
}

impl ExitStatus for IdentityError {
    /// A checkpoint whose identity cannot be established is refused before any work.
    fn exit_code(&self) -> i32 {
        REFUSED
    }
}

impl ExitStatus for CatalogError {
    /// A checkpoint that cannot be read with confidence is refused before any work.
    fn exit_code(&self) -> i32 {
        REFUSED
    }
}

impl ExitStatus for ReadError {
    fn exit_code(&self) -> i32 {
        FAILURE
    }
}

impl ExitStatus for BindError {
    /// A live store or an untrusted directory is a refusal; anything else a failure.
    fn exit_code(&self) -> i32 {
        match self {
            BindError::Live(_) | BindError::Untrusted(_) => REFUSED,
            _ => FAILURE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_proto::wire::ErrorCode;

    #[test]
    fn each_error_kind_has_its_documented_code() {
        let unreachable = ClientError::Unreachable {
            path: "s".into(),
            err: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(unreachable.exit_code(), NO_STORE);
        let busy = ClientError::Store {
            code: ErrorCode::Busy,
            message: "limit".into(),
        };
        assert_eq!(busy.exit_code(), NO_STORE);
        let bad = ClientError::Store {
            code: ErrorCode::BadRequest,
            message: "layer".into(),
        };
        assert_eq!(bad.exit_code(), FAILURE);
        assert_eq!(TrunkError::Refused("x".into()).exit_code(), REFUSED);
        assert_eq!(TrunkError::Io("x".into()).exit_code(), FAILURE);
        assert_eq!(CatalogError("x".into()).exit_code(), REFUSED);
        assert_eq!(BindError::Live("s".into()).exit_code(), REFUSED);
        assert_eq!(AttachError::NoStore("x".into()).exit_code(), NO_STORE);
    }
}
