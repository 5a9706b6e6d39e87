//! Where the store listens by default.

use std::path::PathBuf;

/// Environment variables k3 reads, in one place.
pub mod env {
    /// Directory for the store socket (`$XDG_RUNTIME_DIR/k3/`).
    pub const XDG_RUNTIME_DIR: &str = "XDG_RUNTIME_DIR";
    /// Force a SIMD tier: `scalar`, `avx2`, `avx512`.
    pub const K3_SIMD: &str = "K3_SIMD";
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

#[cfg(test)]
mod tests {
    use super::*;

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
