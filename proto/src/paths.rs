//! Where the store listens by default, and how the paths given to it are made absolute.

use std::path::{Path, PathBuf};

/// Environment variables k3 reads, in one place.
pub mod env {
    /// Directory for the store socket (`$XDG_RUNTIME_DIR/k3/`).
    pub const XDG_RUNTIME_DIR: &str = "XDG_RUNTIME_DIR";
    /// Force a SIMD tier: `scalar`, `avx2`, `avx512`, `neon`.
    pub const K3_SIMD: &str = "K3_SIMD";
    /// When streamed trunk layers are checked against their checksum: `first`, `every`, `off`.
    pub const K3_TRUNK_VERIFY: &str = "K3_TRUNK_VERIFY";
    /// Router lookahead prefetch of the worker: `off`, `on` (= `mlp-in`, the default),
    /// `attn-in`, `mlp-in` (which hidden state predicts the next layer's experts).
    pub const K3_LOOKAHEAD: &str = "K3_LOOKAHEAD";
    /// Read a pass's next group of experts while the current group computes, when the union
    /// exceeds the cache (standalone): `on` (the default) or `off` (for A/B runs).
    pub const K3_EXPERT_OVERLAP: &str = "K3_EXPERT_OVERLAP";
    /// Give a streamed MoE layer's trunk lease back before its expert wait: `on` (the default)
    /// or `off` (the lease is held to the end of the layer; for A/B runs).
    pub const K3_EARLY_RELEASE: &str = "K3_EARLY_RELEASE";
    /// The shared-memory kind of the store's segment and of session handovers: `memfd` (Linux
    /// only, its default) or `posix` (`shm_open`; the default elsewhere).
    pub const K3_SHM: &str = "K3_SHM";
    /// How checkpoint and trunk files are read: `direct` (`O_DIRECT`; Linux only, its default)
    /// or `advise` (buffered reads with advice: `F_NOCACHE` + `F_RDADVISE` on macOS, where it
    /// is the default, `posix_fadvise` on Linux).
    pub const K3_DISK_IO: &str = "K3_DISK_IO";
    /// Log level filter of the three binaries (`tracing_subscriber::EnvFilter` syntax).
    pub const RUST_LOG: &str = "RUST_LOG";
}

/// The default socket path: `$XDG_RUNTIME_DIR/k3/store.sock` when `XDG_RUNTIME_DIR` is set to an
/// absolute path, else `/tmp/k3-$UID/store.sock`.
pub fn default_socket(uid: u32) -> PathBuf {
    default_socket_from(std::env::var_os(env::XDG_RUNTIME_DIR), uid)
}

/// [`default_socket`] with the environment passed in (testable).
pub fn default_socket_from(xdg: Option<std::ffi::OsString>, uid: u32) -> PathBuf {
    match xdg.map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir.join("k3").join("store.sock"),
        _ => PathBuf::from(format!("/tmp/k3-{uid}")).join("store.sock"),
    }
}

/// An environment variable set to a value it cannot take (a refusal, exit 2).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// A value the variable does not know.
    #[error("{name}={value:?}: expected {expected}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
    /// A value that is not Unicode.
    #[error("{name}: {source}")]
    Unreadable {
        /// The variable.
        name: &'static str,
        /// Why.
        source: std::env::VarError,
    },
}

/// `p` made absolute without depending on the current directory later: canonical (symlinks
/// and `..` resolved) when it exists, else joined to the current directory.
pub fn resolve(p: &Path) -> Result<PathBuf, PathError> {
    match std::fs::canonicalize(p) {
        Ok(c) => Ok(c),
        Err(_) => std::path::absolute(p).map_err(|source| PathError::Absolute {
            path: p.to_path_buf(),
            source,
        }),
    }
}

/// Why a path given on the command line cannot be made absolute (a refusal, exit 2).
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// The current directory is unknown (or the path is empty).
    #[error("{}: {source}", path.display())]
    Absolute {
        /// The path as given.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file path that ends in `..` or `/`.
    #[error("{} names no file", path.display())]
    NoFileName {
        /// The path as given.
        path: PathBuf,
    },
}

/// A file path (a socket, a log) made absolute: its directory canonical when it exists, the file
/// name kept as given (the file itself may not exist yet, and a symlink there must stay visible
/// as one).
pub fn resolve_file(p: &Path) -> Result<PathBuf, PathError> {
    let abs = std::path::absolute(p).map_err(|source| PathError::Absolute {
        path: p.to_path_buf(),
        source,
    })?;
    let name = abs.file_name().ok_or_else(|| PathError::NoFileName {
        path: p.to_path_buf(),
    })?;
    let dir = abs.parent().unwrap_or(Path::new("/"));
    Ok(std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_become_absolute() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            resolve_file(Path::new("r.sock")).unwrap(),
            cwd.canonicalize().unwrap().join("r.sock")
        );
        assert_eq!(
            resolve(Path::new(".")).unwrap(),
            cwd.canonicalize().unwrap()
        );
        let missing = resolve(Path::new("no/such/dir")).unwrap();
        assert!(missing.is_absolute() && missing.ends_with("no/such/dir"));
        assert!(resolve_file(Path::new("/")).is_err());
        let dir = std::env::temp_dir().join(format!("k3-paths-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("real")).unwrap();
        let _ = std::fs::remove_file(dir.join("link"));
        std::os::unix::fs::symlink(dir.join("real"), dir.join("link")).unwrap();
        // The directory is resolved, the file name kept.
        assert_eq!(
            resolve_file(&dir.join("link").join("s.sock")).unwrap(),
            dir.canonicalize().unwrap().join("real").join("s.sock")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn xdg_wins_when_absolute() {
        assert_eq!(
            default_socket_from(Some("/run/user/5".into()), 5),
            PathBuf::from("/run/user/5/k3/store.sock")
        );
        assert_eq!(
            default_socket_from(Some("relative".into()), 5),
            PathBuf::from("/tmp/k3-5/store.sock")
        );
        assert_eq!(
            default_socket_from(None, 1000),
            PathBuf::from("/tmp/k3-1000/store.sock")
        );
    }
}
