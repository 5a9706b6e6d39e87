//! Helpers for the end-to-end tests: where the workspace, the fixtures and the built binaries are.

use std::path::PathBuf;

/// The workspace root (the directory holding the top-level `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A path under `fixtures/`.
pub fn fixture(rel: &str) -> PathBuf {
    workspace_root().join("fixtures").join(rel)
}

/// The path of a workspace binary (`k3-ctl`, `k3-worker`, `k3-store`) built into the same
/// target directory as this test executable. The test command (`scripts/test.sh`) builds every
/// binary before running the tests.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test-binary> -> target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test binary lives in target/<profile>/deps");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built; run `cargo build --workspace --bins` first (scripts/test.sh does)",
        p.display()
    );
    p
}
