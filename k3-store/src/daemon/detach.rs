//! `k3-store start --detach`: the parent re-executes the store in the background and returns only
//! when the child has said, on a pipe, that it is ready (or why it failed). No polling of the
//! socket file: readiness is a typed message.
//!
//! Protocol on the pipe: one JSON [`Message`] per line. The child sends its memory plan once
//! (`plan`), then `loading` progress (bytes done of total, at most ten a second plus the last),
//! then exactly one of `ready` or `failed`, and closes the pipe. The parent prints the plan once
//! and shows the progress (a bar on a terminal, plain lines otherwise) until that last line. Both
//! ends are the same executable (the parent re-executes itself), so the two cannot disagree on
//! the format. A child that exits without `ready`/`failed` (a crash) is reported as a failure
//! with its log's path.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One line on the readiness pipe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Message {
    /// The memory plan the store will load (sent once, before the load).
    Plan {
        /// The plan as the store logs it (several lines).
        text: String,
    },
    /// Load progress.
    Loading {
        /// Bytes loaded into shared memory so far.
        done_bytes: u64,
        /// Bytes to load in total.
        total_bytes: u64,
    },
    /// Serving at this socket (the last line).
    Ready {
        /// Socket path.
        socket: String,
    },
    /// Failed before serving (the last line).
    Failed {
        /// The exit code the child used.
        code: i32,
        /// Why.
        message: String,
    },
}

/// What the detached child reported in the end.
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Serving at this socket; the child's pid.
    Ready {
        /// Socket path.
        socket: String,
        /// Child pid.
        pid: u32,
    },
    /// Failed before serving.
    Failed {
        /// The exit code the child used.
        code: i32,
        /// Why.
        message: String,
    },
}

/// Progress lines are sent at most this often (plus the last one).
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct Pipe {
    file: Option<File>,
    last_progress: Option<Instant>,
}

/// The child's end of the readiness pipe (a no-op when not detached). Clones share the pipe:
/// the load's progress callback holds one while `start` keeps another for the last line.
#[derive(Debug, Clone)]
pub struct Notifier(Option<Arc<Mutex<Pipe>>>);

impl Notifier {
    /// Not detached: messages go nowhere.
    pub fn none() -> Notifier {
        Notifier(None)
    }

    /// Take ownership of the descriptor passed as `--ready-fd`.
    ///
    /// # Safety
    /// `fd` must be an open descriptor inherited from the parent for this purpose and used by
    /// nothing else in this process.
    pub unsafe fn from_fd(fd: i32) -> Notifier {
        // SAFETY: guaranteed by the caller.
        let file = unsafe { File::from_raw_fd(fd) };
        Notifier(Some(Arc::new(Mutex::new(Pipe {
            file: Some(file),
            last_progress: None,
        }))))
    }

    /// Send `msg`; `last` closes the pipe afterwards (for every clone).
    fn send(&self, msg: &Message, last: bool) {
        let Some(pipe) = &self.0 else { return };
        let mut p = pipe.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = p.file.as_mut() {
            if let Ok(line) = serde_json::to_string(msg) {
                // A parent that is gone (EPIPE) is not the child's failure: ignored.
                let _ = writeln!(f, "{line}");
            }
        }
        if last {
            p.file = None;
        }
    }

    /// Tell the parent the memory plan (once, before the load).
    pub fn plan(&self, text: &str) {
        self.send(&Message::Plan { text: text.into() }, false);
    }

    /// Tell the parent how far the load is (rate-limited; the last one always goes).
    pub fn loading(&self, done_bytes: u64, total_bytes: u64) {
        if let Some(pipe) = &self.0 {
            let mut p = pipe.lock().unwrap_or_else(|e| e.into_inner());
            let due = p
                .last_progress
                .is_none_or(|t| t.elapsed() >= PROGRESS_EVERY);
            if !due && done_bytes < total_bytes {
                return;
            }
            p.last_progress = Some(Instant::now());
        }
        self.send(
            &Message::Loading {
                done_bytes,
                total_bytes,
            },
            false,
        );
    }

    /// Tell the parent the store serves at `socket`; closes the pipe.
    pub fn ready(&mut self, socket: &Path) {
        let socket = socket.display().to_string();
        self.send(&Message::Ready { socket }, true);
    }

    /// Tell the parent start-up failed; closes the pipe.
    pub fn failed(&mut self, code: i32, message: &str) {
        let message = message.to_string();
        self.send(&Message::Failed { code, message }, true);
    }
}

/// Parse one line of the pipe (`None`: not a message).
pub fn parse_line(line: &str) -> Option<Message> {
    serde_json::from_str(line.trim_end()).ok()
}

/// Why the detached store's log was refused (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A symbolic link at the path.
    #[error("log {} is a symbolic link; refusing to write through it", .0.display())]
    Symlink(std::path::PathBuf),
    /// It cannot be opened.
    #[error("cannot open the log {}: {source}", path.display())]
    Open {
        /// The log.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Its metadata cannot be read.
    #[error("log {}: {source}", path.display())]
    Stat {
        /// The log.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A FIFO, device or directory.
    #[error("log {} is not a regular file", .0.display())]
    NotFile(std::path::PathBuf),
    /// Another user's file.
    #[error("log {} belongs to uid {uid}, not to uid {me}; refusing to write to it", path.display())]
    Owner {
        /// The log.
        path: std::path::PathBuf,
        /// Its owner.
        uid: u32,
        /// Ours.
        me: u32,
    },
    /// A hard link to another file.
    #[error("log {} has {links} hard links; refusing to write to it", path.display())]
    Links {
        /// The log.
        path: std::path::PathBuf,
        /// Its links.
        links: u64,
    },
}

/// Open (append, create 0600) the detached store's log without following a symlink
/// (`O_NOFOLLOW`, close-on-exec), and only if what is there is a regular file of ours with one
/// link: a planted symlink, FIFO, another user's file or a hard link to one is refused. Call it
/// after the directory's owner was checked ([`crate::ipc::prepare_socket_dir`]).
pub fn open_log(path: &Path) -> Result<File, LogError> {
    use nix::errno::Errno;
    use nix::fcntl::OFlag;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        // O_NONBLOCK: a FIFO planted at the path must not block the open (it is refused below).
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).bits())
        .open(path)
        .map_err(|source| {
            if source.raw_os_error() == Some(Errno::ELOOP as i32) {
                LogError::Symlink(path.to_path_buf())
            } else {
                LogError::Open {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })?;
    let m = f.metadata().map_err(|source| LogError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    let me = crate::ipc::current_uid();
    if !m.is_file() {
        return Err(LogError::NotFile(path.to_path_buf()));
    }
    if m.uid() != me {
        return Err(LogError::Owner {
            path: path.to_path_buf(),
            uid: m.uid(),
            me,
        });
    }
    if m.nlink() != 1 {
        return Err(LogError::Links {
            path: path.to_path_buf(),
            links: m.nlink(),
        });
    }
    nix::fcntl::fcntl(
        &f,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_APPEND),
    )
    .map_err(|e| LogError::Stat {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    Ok(f)
}

/// Re-run this executable with `args` plus `--ready-fd N` in its own process group, in `/` (every
/// path in `args` is absolute), stdout and stderr appended to `logf` (opened with [`open_log`]
/// at `log`), and wait for its readiness line, showing its plan (stdout) and load progress
/// (stderr) meanwhile ([`Shown`]).
pub fn spawn_and_wait(args: &[OsString], logf: File, log: &Path) -> std::io::Result<Readiness> {
    let exe = std::env::current_exe()?;
    // std's pipe is close-on-exec on both ends (pipe2 where it exists).
    let (rd, wr) = std::io::pipe()?;
    let (rd, wr) = (OwnedFd::from(rd), OwnedFd::from(wr));
    // The child must inherit the write end: clear close-on-exec on it only.
    nix::fcntl::fcntl(
        &wr,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .arg("--ready-fd")
        .arg(wr.as_raw_fd().to_string())
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(logf.try_clone()?)
        .stderr(logf)
        .process_group(0);
    let child = cmd.spawn()?;
    drop(wr); // only the child holds the write end now: EOF means it is gone
    let mut shown = Shown::default();
    let last = read_messages(&rd, child.id(), |m| shown.show(m))?;
    Ok(last.unwrap_or(Readiness::Failed {
        code: k3_proto::exit::FAILURE,
        message: format!(
            "the store exited during start-up without a word; see {}",
            log.display()
        ),
    }))
}

/// What the waiting parent shows of the child's messages: the plan once, on stdout; the load as
/// a [`crate::progress::Progress`] on stderr (a bar with bytes, rate and ETA on a terminal,
/// plain lines in human units otherwise).
#[derive(Debug, Default)]
pub struct Shown {
    plan: bool,
    bar: Option<crate::progress::Progress>,
}

impl Shown {
    /// Show one progress message (`ready`/`failed` are the caller's).
    pub fn show(&mut self, m: Message) {
        match m {
            Message::Plan { text } if !self.plan => {
                self.plan = true;
                println!("{}", text.trim_end_matches('\n'));
                let _ = std::io::stdout().flush();
            }
            Message::Loading {
                done_bytes,
                total_bytes,
            } => self
                .bar
                .get_or_insert_with(|| {
                    crate::progress::Progress::new("loading shared memory", total_bytes, true)
                })
                .set(done_bytes),
            _ => {}
        }
    }
}

/// Read the child's messages until its last one (`Ok(Some)`) or EOF without one (`Ok(None)`),
/// handing the others to `on`. SIGINT and SIGTERM meanwhile are passed on to the child as
/// SIGTERM: it is in its own process group, so a Ctrl-C at the terminal would otherwise end only
/// this parent and leave the store loading unwatched. The child then abandons its load and
/// reports that on the pipe. A second signal ends this parent at once (status 1).
fn read_messages(
    rd: &OwnedFd,
    child: u32,
    mut on: impl FnMut(Message),
) -> std::io::Result<Option<Readiness>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    let asked = Arc::new(AtomicBool::new(false));
    let mut ids = Vec::new();
    for sig in [SIGINT, SIGTERM] {
        // Order matters: the conditional shutdown fires only if `asked` is already set.
        ids.push(signal_hook::flag::register_conditional_shutdown(
            sig,
            1,
            asked.clone(),
        )?);
        ids.push(signal_hook::flag::register(sig, asked.clone())?);
    }
    let mut passed_on = false;
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 4096];
    let r = 'wait: loop {
        if asked.load(Ordering::SeqCst) && !passed_on {
            passed_on = true;
            eprintln!("interrupted: stopping the store being started (pid {child})");
            let pid = nix::unistd::Pid::from_raw(child as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        let mut fds = [nix::poll::PollFd::new(
            rd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u16)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => break Err(e.into()),
        }
        let n = match nix::unistd::read(rd, &mut buf) {
            Ok(0) => break Ok(None),
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => break Err(e.into()),
        };
        pending.extend_from_slice(&buf[..n]);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            match parse_line(&String::from_utf8_lossy(&line)) {
                Some(Message::Ready { socket }) => {
                    break 'wait Ok(Some(Readiness::Ready { socket, pid: child }))
                }
                Some(Message::Failed { code, message }) => {
                    break 'wait Ok(Some(Readiness::Failed { code, message }))
                }
                Some(m) => on(m),
                None => tracing::warn!(
                    "ignoring a malformed line from the store being started: {:?}",
                    String::from_utf8_lossy(&line)
                ),
            }
        }
    };
    for id in ids {
        signal_hook::low_level::unregister(id);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_refuses_symlinks_and_fifos_and_appends_to_files() {
        let dir = std::env::temp_dir().join(format!("k3-detach-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("precious");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.join("link.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = open_log(&link).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        let fifo = dir.join("fifo.log");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = open_log(&fifo).unwrap_err().to_string();
        assert!(e.contains("fifo.log"), "{e}");
        let hard = dir.join("hard.log");
        std::fs::hard_link(&target, &hard).unwrap();
        let e = open_log(&hard).unwrap_err().to_string();
        assert!(e.contains("hard links"), "{e}");
        let log = dir.join("store.log");
        std::fs::write(&log, b"old\n").unwrap();
        let mut f = open_log(&log).unwrap();
        f.write_all(b"new\n").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"old\nnew\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn messages_round_trip_through_lines() {
        let msgs = [
            Message::Plan {
                text: "memory plan (laptop):\n  trunk 1.00 GB\n".into(),
            },
            Message::Loading {
                done_bytes: 5,
                total_bytes: 9,
            },
            Message::Ready {
                socket: "/tmp/k3-0/store.sock".into(),
            },
            Message::Failed {
                code: 2,
                message: "plan does not fit\n  problem: need 5 GB".into(),
            },
        ];
        for m in msgs {
            let line = serde_json::to_string(&m).unwrap() + "\n";
            assert_eq!(line.matches('\n').count(), 1, "{line}");
            assert_eq!(parse_line(&line), Some(m));
        }
        assert_eq!(parse_line(""), None);
        assert_eq!(parse_line("READY /tmp/x"), None);
        assert_eq!(parse_line(r#"{"kind":"failed","code":"x"}"#), None);
    }

    /// The child's side through a real pipe: plan, rate-limited progress (the last always
    /// sent), the last line closing the pipe for every clone; the parent's reader hands the
    /// progress over and returns the last line.
    #[test]
    fn a_notifier_and_the_reader_agree_over_a_pipe() {
        let (rd, wr): (OwnedFd, OwnedFd) = {
            let (r, w) = std::io::pipe().unwrap();
            (OwnedFd::from(r), OwnedFd::from(w))
        };
        let raw = std::os::fd::IntoRawFd::into_raw_fd(wr); // owned by the notifier from here
                                                           // SAFETY: `raw` is the write end just created, used by nothing else.
        let mut n = unsafe { Notifier::from_fd(raw) };
        let progress = n.clone();
        n.plan("memory plan (test):\n  TOTAL 1.00 GB\n");
        for done in 0..=1000u64 {
            progress.loading(done, 1000);
        }
        n.ready(Path::new("/tmp/s.sock"));
        progress.loading(1000, 1000); // after the last line: dropped, the pipe is closed
        let mut seen = Vec::new();
        let last = read_messages(&rd, 7, |m| seen.push(m)).unwrap();
        assert_eq!(
            last,
            Some(Readiness::Ready {
                socket: "/tmp/s.sock".into(),
                pid: 7
            })
        );
        assert!(matches!(&seen[0], Message::Plan { text } if text.contains("TOTAL")));
        let loads: Vec<_> = seen[1..]
            .iter()
            .map(|m| match m {
                Message::Loading {
                    done_bytes,
                    total_bytes: 1000,
                } => *done_bytes,
                other => panic!("{other:?}"),
            })
            .collect();
        // The first and the last go; the thousand in between are rate-limited.
        assert_eq!((loads[0], *loads.last().unwrap()), (0, 1000));
        assert!(loads.len() < 10, "{loads:?}");
        // Closed: EOF now.
        assert_eq!(read_messages(&rd, 7, |_| {}).unwrap(), None);
    }

    /// Ctrl-C while `start --detach` waits reaches the store it started (as SIGTERM), whose
    /// readiness line then ends the wait; the child is not left running. (A child that gets no
    /// SIGTERM exits after ~5 s without a line: the test then fails, it does not hang.)
    #[test]
    fn an_interrupt_while_waiting_is_passed_on_to_the_child() {
        use std::os::fd::AsRawFd;
        let (rd, wr): (OwnedFd, OwnedFd) = {
            let (r, w) = std::io::pipe().unwrap();
            (OwnedFd::from(r), OwnedFd::from(w))
        };
        nix::fcntl::fcntl(
            &wr,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .unwrap();
        let script = format!(
            "trap 'echo \"$LAST\" > /dev/fd/{}; exit 0' TERM; \
             i=0; while [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done",
            wr.as_raw_fd()
        );
        let last = r#"{"kind":"failed","code":1,"message":"stopped by SIGTERM"}"#;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("LAST", last)
            .spawn()
            .unwrap();
        drop(wr);
        let interrupt = std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(500));
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGINT).unwrap();
        });
        let t0 = std::time::Instant::now();
        let last = read_messages(&rd, child.id(), |_| {}).unwrap();
        interrupt.join().unwrap();
        assert_eq!(
            last,
            Some(Readiness::Failed {
                code: 1,
                message: "stopped by SIGTERM".into()
            })
        );
        assert!(child.wait().unwrap().success());
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    }
}
