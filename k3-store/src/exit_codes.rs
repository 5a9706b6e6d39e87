//! The exit code of every error the store library hands to a binary
//! ([`k3_proto::exit::ExitStatus`]): the one mapping the three binaries share, printed and
//! applied by [`k3_proto::exit::report`].

use k3_proto::exit::{ExitStatus, EXPERT_LOAD_FAILED, FAILURE, NO_STORE, REFUSED};

use crate::attach::client::ClientError;
use crate::attach::AttachError;
use crate::ipc::BindError;
use crate::runtime::catalog::CatalogError;
use crate::runtime::identity::IdentityError;
use crate::runtime::io::ReadError;
use crate::runtime::standalone::OpenError;
use crate::runtime::trunk::TrunkError;

/// Errors refused before any work, whatever their kind: exit 2.
macro_rules! refused {
    ($($t:ty),* $(,)?) => {$(
        impl ExitStatus for $t {
            fn exit_code(&self) -> i32 {
                REFUSED
            }
        }
    )*};
}

refused!(
    crate::cli::ValueError,
    crate::daemon::detach::LogError,
    crate::daemon::statedir::StateDirError,
    crate::runtime::experts::PreloadRefused,
    crate::runtime::fdlimit::TooFewFiles,
    crate::runtime::plan::BudgetError,
    crate::runtime::plan::MemInfoError,
    crate::runtime::plan::PlanError,
    crate::runtime::ring::ChecksumMismatch,
);

impl ExitStatus for crate::runtime::source::ExpertError {
    /// A routed expert that could not be had: the ids are unsound.
    fn exit_code(&self) -> i32 {
        EXPERT_LOAD_FAILED
    }
}

impl ExitStatus for crate::runtime::ring::RunError {
    /// A trunk layer that could not be read during the work (a damaged one is refused at start).
    fn exit_code(&self) -> i32 {
        match self {
            crate::runtime::ring::RunError::Checksum(e) => e.exit_code(),
            _ => FAILURE,
        }
    }
}

impl ExitStatus for crate::runtime::io::AllocError {
    /// Memory that could not be had once the plan was accepted: a failure.
    fn exit_code(&self) -> i32 {
        FAILURE
    }
}

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
            AttachError::Files(e) => e.exit_code(),
            AttachError::Thread(_) => FAILURE,
            AttachError::Connect(_)
            | AttachError::Handshake(_)
            | AttachError::Map(_)
            | AttachError::Header(_)
            | AttachError::Catalog(_)
            | AttachError::Identity(_)
            | AttachError::Shards(_)
            | AttachError::Trunk(_)
            | AttachError::Mismatch(_) => NO_STORE,
        }
    }
}

impl ExitStatus for OpenError {
    fn exit_code(&self) -> i32 {
        use crate::runtime::source::SourceError;
        match self {
            OpenError::Config { .. }
            | OpenError::Index { .. }
            | OpenError::Shapes { .. }
            | OpenError::Catalog(_)
            | OpenError::Files(_)
            | OpenError::ShardChanged { .. }
            | OpenError::UnknownPolicy(_) => REFUSED,
            OpenError::Trunk(e) => e.exit_code(),
            OpenError::Plan(e) => e.exit_code(),
            OpenError::Preload(e) => e.exit_code(),
            // A pinned layer failing its checksum (or a ring the plan cannot use) is a refusal.
            OpenError::Source(SourceError::Invalid(_)) => REFUSED,
            OpenError::Shards(_)
            | OpenError::Read { .. }
            | OpenError::NotOpen { .. }
            | OpenError::Window(_)
            | OpenError::Embed { .. }
            | OpenError::Thread { .. }
            | OpenError::Source(_) => FAILURE,
        }
    }
}

impl ExitStatus for TrunkError {
    fn exit_code(&self) -> i32 {
        if self.is_refusal() {
            REFUSED
        } else {
            FAILURE
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
        assert_eq!(TrunkError::draft("x").exit_code(), REFUSED);
        let io = std::io::Error::other("x");
        let write = TrunkError::Write {
            path: "f".into(),
            source: io,
        };
        assert_eq!(write.exit_code(), FAILURE);
        assert_eq!(TrunkError::Interrupted("SIGINT").exit_code(), FAILURE);
        assert_eq!(CatalogError("x".into()).exit_code(), REFUSED);
        assert_eq!(BindError::Live("s".into()).exit_code(), REFUSED);
        assert_eq!(
            AttachError::from(ClientError::Store {
                code: ErrorCode::BadRequest,
                message: "x".into(),
            })
            .exit_code(),
            NO_STORE
        );
        assert_eq!(AttachError::Handshake("Welcome").exit_code(), NO_STORE);
        let plan = crate::runtime::plan::PlanError::DoesNotFit {
            plan: String::new(),
            problems: vec!["shortfall".into()],
        };
        assert_eq!(OpenError::from(plan).exit_code(), REFUSED);
        let torn = OpenError::Read {
            what: "model.embed_tokens.weight".into(),
            source: ReadError::msg("short read"),
        };
        assert_eq!(torn.exit_code(), FAILURE);
        let pinned = crate::runtime::source::SourceError::Invalid("checksum".into());
        assert_eq!(OpenError::from(pinned).exit_code(), REFUSED);
        assert_eq!(
            OpenError::from(TrunkError::from(ReadError::msg("x"))).exit_code(),
            FAILURE
        );
        let expert = crate::runtime::source::ExpertError::NotInCheckpoint {
            layer: 1,
            expert: 2,
        };
        assert_eq!(expert.exit_code(), EXPERT_LOAD_FAILED);
        let damaged = crate::runtime::ring::ChecksumMismatch {
            layer: 0,
            file: "trunk.bin".into(),
            bytes: 1,
            got: 1,
            want: 2,
        };
        assert_eq!(damaged.exit_code(), REFUSED);
        let read = crate::runtime::ring::RunError::Read(ReadError::msg("gone"));
        assert_eq!(read.exit_code(), FAILURE);
        assert_eq!(
            crate::runtime::ring::RunError::from(damaged).exit_code(),
            REFUSED
        );
        assert_eq!(
            crate::cli::ValueError::Seconds("x".into()).exit_code(),
            REFUSED
        );
    }
}
