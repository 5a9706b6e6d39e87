//! Records the commit the binaries were built from, for `--version` (`K3_COMMIT`).

use std::path::Path;
use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown commit".into());
    println!("cargo:rustc-env=K3_COMMIT={commit}");
    // Rebuild when HEAD moves (a worktree's .git is a file pointing elsewhere: HEAD then lives
    // there, and a clean rebuild picks it up).
    let head = Path::new("../.git/HEAD");
    if head.exists() {
        println!("cargo:rerun-if-changed=../.git/HEAD");
        if let Some(r) = std::fs::read_to_string(head)
            .ok()
            .and_then(|h| h.strip_prefix("ref: ").map(|r| r.trim().to_string()))
        {
            println!("cargo:rerun-if-changed=../.git/{r}");
        }
    }
}
