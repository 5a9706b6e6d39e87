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

/// One test's private world: its own temporary directory, socket path and store. Dropping it
/// stops the store (if one was started) and checks that nothing was left behind: the socket file
/// is gone and the store process has exited.
pub struct Sandbox {
    /// The temporary directory (removed on drop).
    pub dir: PathBuf,
    /// The socket path this sandbox's store listens on.
    pub socket: PathBuf,
    store_pid: Option<u32>,
}

/// A finished process: exit code and captured output.
#[derive(Debug)]
pub struct Run {
    /// Exit code (-1 if killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Run {
    fn from(o: std::process::Output) -> Run {
        Run {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

impl Sandbox {
    /// A fresh sandbox named after the test.
    pub fn new(tag: &str) -> Sandbox {
        let dir = std::env::temp_dir().join(format!(
            "k3-e2e-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("create sandbox dir");
        let socket = dir.join("run").join("store.sock");
        Sandbox {
            dir,
            socket,
            store_pid: None,
        }
    }

    /// Run a workspace binary with `args` to completion.
    pub fn run(&self, bin_name: &str, args: &[&str]) -> Run {
        Run::from(
            std::process::Command::new(bin(bin_name))
                .args(args)
                .env("XDG_RUNTIME_DIR", self.dir.join("xdg"))
                .output()
                .expect("spawn"),
        )
    }

    /// `k3-store start … --socket <ours> --detach`; returns the readiness output. Panics (with
    /// the store's output) if it did not become ready.
    pub fn start_store(&mut self, args: &[&str]) -> Run {
        let sock = self.socket.to_str().expect("utf-8 path").to_string();
        let mut full: Vec<&str> = vec!["start"];
        full.extend_from_slice(args);
        full.extend_from_slice(&["--socket", &sock, "--detach"]);
        let r = self.run("k3-store", &full);
        assert_eq!(r.code, 0, "store did not start: {r:?}");
        let pid = r
            .stdout
            .split("pid ")
            .nth(1)
            .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no pid in readiness output: {r:?}"));
        self.store_pid = Some(pid);
        r
    }

    /// The store's pid, if started.
    pub fn store_pid(&self) -> Option<u32> {
        self.store_pid
    }

    /// `k3-ctl <args> --socket <ours>`.
    pub fn ctl(&self, args: &[&str]) -> Run {
        let sock = self.socket.to_str().expect("utf-8 path").to_string();
        let mut full = args.to_vec();
        full.extend_from_slice(&["--socket", &sock]);
        self.run("k3-ctl", &full)
    }

    /// `k3-worker <args> --socket <ours>`.
    pub fn worker(&self, args: &[&str]) -> Run {
        let sock = self.socket.to_str().expect("utf-8 path").to_string();
        let mut full = args.to_vec();
        full.extend_from_slice(&["--socket", &sock]);
        self.run("k3-worker", &full)
    }

    /// Stop the store and check nothing is left: returns the `k3-ctl stop` run.
    pub fn stop_store(&mut self) -> Option<Run> {
        let pid = self.store_pid.take()?;
        let r = self.ctl(&["stop"]);
        let gone = (0..300).any(|_| {
            let dead = !std::path::Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|s| s.contains(") Z "))
                    .unwrap_or(true);
            if !dead {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            dead
        });
        assert!(gone, "store pid {pid} still running after stop: {r:?}");
        assert!(
            !self.socket.exists(),
            "socket {} left behind",
            self.socket.display()
        );
        Some(r)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(pid) = self.store_pid {
            let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.stop_store();
            }));
            if stopped.is_err() {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
