//! Helpers for the end-to-end tests: where the workspace, the fixtures and the built binaries are;
//! a [`Sandbox`] per test (own directory, socket and store), spawned processes that are killed if
//! a test fails, and bounded polling for conditions set by other processes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

/// The workspace binaries the end-to-end tests run, with the package that builds each.
const BINARIES: [(&str, &str); 3] = [
    ("k3-store", "k3-store"),
    ("k3-worker", "k3-worker"),
    ("k3-ctl", "k3-ctl"),
];

/// The path of a workspace binary (`k3-ctl`, `k3-worker`, `k3-store`) that Cargo built for this
/// test run. The first call in a test process runs `cargo build --bins` for the three packages,
/// in the profile this test was built in (through `escargot`, with the `cargo` that runs the
/// tests), and remembers where Cargo put each executable; so editing a binary's source and
/// running `cargo test -p k3-tests` tests the edited binary, never a stale one under `target/`.
/// A build failure fails the test with Cargo's output.
///
/// With `K3_BIN_DIR` set, the binaries are that directory's instead and Cargo is not run (as in
/// the Python tests): `scripts/test.sh` has just built them there, and runs this test binary while
/// Cargo builds the other test binaries, whose lock a `cargo build` would wait on.
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<BTreeMap<String, PathBuf>, String>> = OnceLock::new();
    let built = BUILT
        .get_or_init(|| match std::env::var_os("K3_BIN_DIR") {
            Some(dir) => built_in(Path::new(&dir)),
            None => build_binaries(),
        })
        .as_ref()
        .unwrap_or_else(|e| panic!("building the workspace binaries failed:\n{e}"));
    built
        .get(name)
        .unwrap_or_else(|| panic!("{name} is not one of the binaries built: {built:?}"))
        .clone()
}

/// The three binaries in `dir` (`K3_BIN_DIR`), each checked to be there.
fn built_in(dir: &Path) -> Result<BTreeMap<String, PathBuf>, String> {
    let mut built = BTreeMap::new();
    for (name, _) in BINARIES {
        let exe = dir.join(name);
        if !exe.is_file() {
            return Err(format!(
                "K3_BIN_DIR={} has no {name}: build it (cargo build --workspace --bins) or unset \
                 K3_BIN_DIR",
                dir.display()
            ));
        }
        built.insert(name.to_string(), exe);
    }
    Ok(built)
}

fn build_binaries() -> Result<BTreeMap<String, PathBuf>, String> {
    let mut build = escargot::CargoBuild::new()
        .manifest_path(workspace_root().join("Cargo.toml"))
        .current_release()
        .bins();
    for (_, package) in BINARIES {
        build = build.package(package);
    }
    let mut built = BTreeMap::new();
    for msg in build.exec().map_err(|e| e.to_string())? {
        let msg = msg.map_err(|e| e.to_string())?;
        if let Ok(escargot::format::Message::CompilerArtifact(a)) = msg.decode() {
            if let Some(exe) = a.executable {
                built.insert(a.target.name.to_string(), exe.into_owned());
            }
        }
    }
    for (name, _) in BINARIES {
        if !built.contains_key(name) {
            return Err(format!(
                "cargo reported no executable for {name}: {built:?}"
            ));
        }
    }
    Ok(built)
}

/// The `small` checkpoint (real vocabulary), generated once per generator version and kept
/// under `target/k3-test-models/` (shared by every test binary and run, so no run leaves a copy
/// behind in the temporary directory).
pub fn small_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| cached_checkpoint("small", 1))
}

/// `scripts/make-checkpoint.py --preset PRESET --seed SEED` made once into
/// `target/k3-test-models/PRESET-seedSEED-VERSION` (VERSION: a hash of the generator's source,
/// so an edited generator makes a new one). Made in a temporary directory beside it and renamed
/// into place, so concurrent test binaries never see a half-written checkpoint.
fn cached_checkpoint(preset: &str, seed: u32) -> PathBuf {
    let script = workspace_root().join("scripts/make-checkpoint.py");
    let src = std::fs::read(&script).unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    // FNV-1a: a version tag, not a security boundary.
    let version = src.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let root = workspace_root().join("target/k3-test-models");
    let dir = root.join(format!("{preset}-seed{seed}-{version:016x}"));
    if dir.join("config.json").exists() {
        return dir;
    }
    std::fs::create_dir_all(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display()));
    let tmp = tempfile::Builder::new()
        .prefix(".making-")
        .tempdir_in(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()));
    let out = tmp.path().join("model");
    make_checkpoint(preset, seed, &out);
    // Another test binary may have finished first: then its copy is used and ours dropped.
    if std::fs::rename(&out, &dir).is_err() && !dir.join("config.json").exists() {
        panic!("cannot move {} to {}", out.display(), dir.display());
    }
    dir
}

/// The bundled tiny checkpoint.
pub fn tiny_model() -> PathBuf {
    fixture("tiny/model")
}

/// `scripts/make-checkpoint.py --preset tiny --seed N` into `dir/tiny-seedN`: the tiny shape
/// (config, tensors, shard sizes) with other weights; returns that directory.
pub fn tiny_with_seed(dir: &Path, seed: u32) -> PathBuf {
    let out = dir.join(format!("tiny-seed{seed}"));
    make_checkpoint("tiny", seed, &out);
    out
}

/// `scripts/make-checkpoint.py --preset PRESET --seed SEED OUT`; panics with its stderr if it
/// fails.
fn make_checkpoint(preset: &str, seed: u32, out: &Path) {
    let st = Command::new("python3")
        .arg(workspace_root().join("scripts/make-checkpoint.py"))
        .args([
            "--preset",
            preset,
            "--seed",
            &seed.to_string(),
            path_str(out),
        ])
        .output()
        .expect("run python3 scripts/make-checkpoint.py");
    assert!(
        st.status.success(),
        "make-checkpoint.py: {}",
        String::from_utf8_lossy(&st.stderr)
    );
}

fn read_ids(rel: &str) -> Vec<u32> {
    let p = fixture(rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The tiny fixture's reference prompt ids.
pub fn reference_prompt() -> Vec<u32> {
    read_ids("tiny/reference/prompt_ids.json")
}

/// The tiny fixture's reference greedy continuation of [`reference_prompt`] (20 ids).
pub fn reference_greedy() -> Vec<u32> {
    read_ids("tiny/reference/greedy_ids.json")
}

/// Ids as the comma list `--ids` takes.
pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// True once process `pid` has exited (gone, or a zombie waiting to be reaped).
pub fn pid_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit_once(") ")
            .map(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
            .unwrap_or(true),
    }
}

/// Poll `cond` every 20 ms until it returns `Some` or `timeout` passes (then `None`). For
/// conditions another process sets (a disconnect being processed, a process exiting).
pub fn poll_until<T>(timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Send `sig` (e.g. `"KILL"`, `"TERM"`) to `pid` with kill(1).
pub fn send_signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -{sig} {pid} failed");
}

/// True when the tests run as root (tests that need a second uid skip otherwise).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Resident memory of process `pid` in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/pid/status");
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .expect("VmRSS in /proc/pid/status")
        * 1024
}

/// A process started with [`Sandbox::spawn`]; killed (SIGKILL) and reaped on drop if still
/// running. Its stdout and stderr go to files in the sandbox.
pub struct Spawned {
    child: Child,
    /// File holding its stdout.
    pub stdout_path: PathBuf,
    /// File holding its stderr.
    pub stderr_path: PathBuf,
}

impl Spawned {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL it and reap it; returns what it had written.
    pub fn kill9(mut self) -> Run {
        let _ = self.child.kill();
        let st = self.child.wait().expect("wait for killed child");
        self.collect(st.code().unwrap_or(-1))
    }

    /// Wait (at most `timeout`) for it to exit; panics (after killing it) on timeout.
    pub fn wait(mut self, timeout: Duration) -> Run {
        let code = poll_until(timeout, || self.child.try_wait().expect("try_wait"));
        match code {
            Some(st) => self.collect(st.code().unwrap_or(-1)),
            None => {
                let pid = self.pid();
                let r = self.kill9();
                panic!("pid {pid} did not exit within {timeout:?}: {r:?}")
            }
        }
    }

    fn collect(&self, code: i32) -> Run {
        Run {
            code,
            stdout: std::fs::read_to_string(&self.stdout_path).unwrap_or_default(),
            stderr: std::fs::read_to_string(&self.stderr_path).unwrap_or_default(),
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

static UNIQUE: AtomicUsize = AtomicUsize::new(0);

fn unique() -> usize {
    UNIQUE.fetch_add(1, Ordering::SeqCst)
}

/// One test's private world: its own temporary directory, socket path and store. Dropping it
/// stops the store (if one was started) and checks that nothing was left behind: the socket file
/// is gone and the store process has exited.
pub struct Sandbox {
    /// The temporary directory (removed on drop).
    pub dir: PathBuf,
    /// Owns `dir`: removes it when the sandbox (after stopping its store) is dropped.
    _tmp: tempfile::TempDir,
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
        let tmp = tempfile::Builder::new()
            .prefix(&format!("k3-e2e-{tag}-"))
            .tempdir()
            .expect("create sandbox dir");
        let dir = tmp.path().to_path_buf();
        let socket = dir.join("run").join("store.sock");
        Sandbox {
            dir,
            _tmp: tmp,
            socket,
            store_pid: None,
        }
    }

    /// Every command that reads a checkpoint's headers, run on `model`, as (what, run):
    /// `k3-ctl inspect`, `verify`, `pack-trunk`, `k3-store start --detach` (on this sandbox's
    /// socket) and a standalone worker on the reference prompt.
    pub fn every_header_command(&self, model: &Path) -> Vec<(&'static str, Run)> {
        let m = path_str(model);
        let out = self.dir.join("packed-never");
        let sock = path_str(&self.socket).to_string();
        let ids = ids_arg(&reference_prompt());
        vec![
            ("inspect", self.run("k3-ctl", &["inspect", m])),
            ("verify", self.run("k3-ctl", &["verify", m])),
            (
                "pack-trunk",
                self.run("k3-ctl", &["pack-trunk", m, path_str(&out)]),
            ),
            (
                "store start",
                self.run("k3-store", &["start", m, "--socket", &sock, "--detach"]),
            ),
            (
                "standalone worker",
                self.run(
                    "k3-worker",
                    &["--standalone", m, "--ids", &ids, "--gen", "2"],
                ),
            ),
        ]
    }

    /// Run a workspace binary with `args` to completion.
    pub fn run(&self, bin_name: &str, args: &[&str]) -> Run {
        Run::from(
            self.command(bin_name, args)
                .stdin(Stdio::null())
                .output()
                .expect("spawn"),
        )
    }

    /// The command [`Sandbox::run`] and [`Sandbox::spawn`] use: the binary with `args` and
    /// `XDG_RUNTIME_DIR=<sandbox>/xdg`, for a test to adjust (working directory, uid, …) and
    /// run with [`Sandbox::run_command`] or [`Sandbox::spawn_command`].
    pub fn command(&self, bin_name: &str, args: &[&str]) -> Command {
        let mut c = Command::new(bin(bin_name));
        c.args(args).env("XDG_RUNTIME_DIR", self.xdg_dir());
        c
    }

    /// The sandbox's `XDG_RUNTIME_DIR` (not created): the default socket is `<it>/k3/store.sock`.
    pub fn xdg_dir(&self) -> PathBuf {
        self.dir.join("xdg")
    }

    /// Run a prepared command to completion (stdin closed).
    pub fn run_command(&self, mut c: Command) -> Run {
        Run::from(c.stdin(Stdio::null()).output().expect("spawn"))
    }

    /// Start a workspace binary with `args` in the background, output to files in the sandbox.
    pub fn spawn(&self, bin_name: &str, args: &[&str]) -> Spawned {
        self.spawn_command(bin_name, self.command(bin_name, args))
    }

    /// Start a prepared command in the background (`tag` names its output files).
    pub fn spawn_command(&self, tag: &str, mut c: Command) -> Spawned {
        let n = unique();
        let stdout_path = self.dir.join(format!("{tag}-{n}.stdout"));
        let stderr_path = self.dir.join(format!("{tag}-{n}.stderr"));
        let out = std::fs::File::create(&stdout_path).expect("create stdout file");
        let err = std::fs::File::create(&stderr_path).expect("create stderr file");
        let child = c
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn");
        Spawned {
            child,
            stdout_path,
            stderr_path,
        }
    }

    /// `k3-worker <args> --socket <ours>` in the background.
    pub fn spawn_worker(&self, args: &[&str]) -> Spawned {
        self.spawn_worker_env(args, &[])
    }

    /// [`Sandbox::spawn_worker`] with environment variables set.
    pub fn spawn_worker_env(&self, args: &[&str], env: &[(&str, &str)]) -> Spawned {
        let sock = self.socket.to_str().expect("utf-8 path").to_string();
        let mut full = args.to_vec();
        full.extend_from_slice(&["--socket", &sock]);
        let mut c = self.command("k3-worker", &full);
        c.envs(env.iter().copied());
        self.spawn_command("k3-worker", c)
    }

    /// An attached worker that runs far longer than any test waits: the reference prompt, up to
    /// 4000 ids by O(T²) full recompute on one thread. Tests stop or kill it mid-generation.
    pub fn spawn_long_worker(&self) -> Spawned {
        self.spawn_long_worker_env(&[])
    }

    /// [`Sandbox::spawn_long_worker`] with environment variables set.
    pub fn spawn_long_worker_env(&self, env: &[(&str, &str)]) -> Spawned {
        let ids = ids_arg(&reference_prompt());
        let args = [
            "--ids",
            &ids,
            "--gen",
            "4000",
            "--full-recompute",
            "--threads",
            "1",
        ];
        self.spawn_worker_env(&args, env)
    }

    /// Pack the tiny fixture's trunk into `<sandbox>/trunk` (`k3-ctl pack-trunk`); returns it.
    pub fn pack_tiny_trunk(&self) -> PathBuf {
        self.pack_trunk(&tiny_model(), "trunk")
    }

    /// Pack `model`'s trunk into `<sandbox>/<name>`, raw (`--codec raw`: the tests written
    /// against format 3's layout; `tests/coded_trunk.rs` packs the default, ecbf16); returns
    /// that directory.
    pub fn pack_trunk(&self, model: &Path, name: &str) -> PathBuf {
        self.pack_trunk_with(model, name, &["--codec", "raw"])
    }

    /// Pack `model`'s trunk into `<sandbox>/<name>` with more `pack-trunk` flags (e.g.
    /// `--codec ecbf16`); returns that directory.
    pub fn pack_trunk_with(&self, model: &Path, name: &str, flags: &[&str]) -> PathBuf {
        let out = self.dir.join(name);
        let mut args = vec![
            "pack-trunk",
            model.to_str().expect("utf-8 path"),
            out.to_str().expect("utf-8 path"),
        ];
        args.extend_from_slice(flags);
        let r = self.run("k3-ctl", &args);
        assert_eq!(r.code, 0, "pack-trunk failed: {r:?}");
        out
    }

    /// Run `k3-worker` (attached to our store unless `args` has `--standalone`) with
    /// `--out <file>`; returns the run and the parsed report (`Null` when none was written).
    pub fn worker_json(&self, args: &[&str]) -> (Run, serde_json::Value) {
        let out = self.dir.join(format!("report-{}.json", unique()));
        let out_s = out.to_str().expect("utf-8 path").to_string();
        let mut full = args.to_vec();
        full.extend_from_slice(&["--out", &out_s]);
        let r = if args.contains(&"--standalone") {
            self.run("k3-worker", &full)
        } else {
            self.worker(&full)
        };
        let json = std::fs::read_to_string(&out)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null);
        (r, json)
    }

    /// `k3-ctl stats --json`, parsed; panics if the store does not answer.
    pub fn stats(&self) -> serde_json::Value {
        let r = self.ctl(&["stats", "--json"]);
        assert_eq!(r.code, 0, "k3-ctl stats failed: {r:?}");
        serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("stats JSON: {e}: {r:?}"))
    }

    /// Send `sig` to the store and wait (≤ 10 s) until its process has exited and its socket
    /// accepts no connection (a killed process's main thread shows as a zombie before its other
    /// threads have exited and its listening socket is closed: a store started then would find
    /// the socket live). The store is then considered stopped (Drop does not stop it again).
    /// Returns its pid.
    pub fn signal_store(&mut self, sig: &str) -> u32 {
        let pid = self.store_pid.take().expect("a store was started");
        send_signal(pid, sig);
        let closed = || std::os::unix::net::UnixStream::connect(&self.socket).is_err();
        assert!(
            poll_until(Duration::from_secs(10), || (pid_gone(pid) && closed())
                .then_some(()))
            .is_some(),
            "store pid {pid} still running (or its socket answering) 10 s after SIG{sig}"
        );
        pid
    }

    /// `k3-store start … --socket <ours> --detach`; returns the readiness output. Panics (with
    /// the store's output) if it did not become ready.
    pub fn start_store(&mut self, args: &[&str]) -> Run {
        let sock = self.socket.to_str().expect("utf-8 path").to_string();
        let mut full: Vec<&str> = vec!["start"];
        full.extend_from_slice(args);
        full.extend_from_slice(&["--socket", &sock, "--detach"]);
        let r = self.run("k3-store", &full);
        self.adopt_store(r)
    }

    /// Take charge of a store started (with `--detach`) by the test itself, listening at
    /// [`Sandbox::socket`]: panics unless `r` is a successful start; the store is then stopped
    /// and checked on drop like one from [`Sandbox::start_store`].
    pub fn adopt_store(&mut self, r: Run) -> Run {
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

    /// The detached store's log (the default one, beside the socket).
    pub fn store_log(&self) -> PathBuf {
        self.socket.with_file_name("store.log")
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
        // `k3-ctl stop` returns once the store has exited (its memory is free for a next start).
        assert!(
            r.code != 0 || pid_gone(pid),
            "k3-ctl stop returned while store pid {pid} still ran: {r:?}"
        );
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
            if std::thread::panicking() {
                // A failing test: do not risk a second panic (an abort); just kill the store.
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                return;
            }
            let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.stop_store();
            }));
            if stopped.is_err() {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// Bytes of one tiny routed expert (MXFP4 w1/w2/w3 packed + scales).
pub const TINY_EXPERT_BYTES: u64 = 6528;
/// I/O alignment of the store.
pub const ALIGN: u64 = 4096;

/// `x` rounded up to [`ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bytes between tiny expert slots in the arena (`ExpertReader::slot_stride`).
pub fn slot_stride() -> u64 {
    align_up(TINY_EXPERT_BYTES) + ALIGN
}

/// A byte count as a `--*-gb` argument that rounds back to exactly `bytes`.
pub fn gb_arg(bytes: u64) -> String {
    format!("{:.9}", bytes as f64 / 1e9)
}

/// `--cache-gb` value that buys exactly `n` tiny expert slots.
pub fn cache_gb_for_slots(n: u64) -> String {
    gb_arg(n * slot_stride())
}

/// A path as a command-line argument (the sandboxes' paths are UTF-8).
pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The integer `key` of a JSON report; panics naming the report when it is missing.
pub fn json_u64(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer {key:?} in {v}"))
}

/// The `generated_ids` of a worker's `--out` report.
pub fn generated_ids(v: &serde_json::Value) -> Vec<u32> {
    v["generated_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no generated_ids in {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Each layer's trunk read-buffer size (the plan's unit), from the packed `trunk.json`.
pub fn trunk_layer_bufs(trunk: &Path) -> Vec<u64> {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap()).unwrap();
    j["layers"]
        .as_array()
        .expect("trunk.json layers")
        .iter()
        .map(|l| {
            let off = l["file_off"].as_u64().expect("file_off");
            let n = l["nbytes"].as_u64().expect("nbytes");
            align_up(off % ALIGN + n)
        })
        .collect()
}

/// The trunk budget that pins exactly layers `0..p` and rings the rest through a ring of the
/// largest of them.
pub fn trunk_budget_pinning(bufs: &[u64], p: usize) -> u64 {
    let ring = bufs[p..].iter().copied().max().unwrap_or(0);
    let budget = bufs[..p].iter().sum::<u64>() + ring;
    // The plan pins the longest prefix that leaves a ring for the largest remaining layer: p + 1
    // must not fit.
    if p < bufs.len() {
        let next_ring = bufs[p + 1..].iter().copied().max().unwrap_or(0);
        assert!(
            bufs[..=p].iter().sum::<u64>() + next_ring > budget,
            "budget for {p} pinned layers would pin {}",
            p + 1
        );
    }
    budget
}

/// The ids a worker printed on stdout (no tokenizer: space-separated ids).
pub fn printed_ids(r: &Run) -> Vec<u32> {
    r.stdout
        .split_whitespace()
        .map(|t| {
            t.parse()
                .unwrap_or_else(|_| panic!("stdout {:?}", r.stdout))
        })
        .collect()
}

/// The live job of worker `pid` in a stats report.
pub fn live_job(s: &serde_json::Value, pid: u32) -> Option<serde_json::Value> {
    let label = format!("pid {pid}");
    s["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["label"].as_str().is_some_and(|l| l.ends_with(&label)))
        .cloned()
}
