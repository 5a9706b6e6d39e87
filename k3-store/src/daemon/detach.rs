//! `k3-store start --detach`: the parent re-executes the store in the background and returns only
//! when the child has said, on a pipe, that it is ready (or why it failed). No polling of the
//! socket file: readiness is a typed message.
//!
//! Protocol on the pipe (one line): `READY <socket path>` or `FAILED <exit code> <message>`.
//! A child that exits without a line (a crash) is reported as a failure with its log's path.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// What the detached child reported.
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

/// The child's end of the readiness pipe (a no-op when not detached).
pub struct Notifier(Option<File>);

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
        Notifier(Some(unsafe { File::from_raw_fd(fd) }))
    }

    /// Tell the parent the store serves at `socket`; closes the pipe.
    pub fn ready(&mut self, socket: &Path) {
        if let Some(mut f) = self.0.take() {
            let _ = writeln!(f, "READY {}", socket.display());
        }
    }

    /// Tell the parent start-up failed; closes the pipe.
    pub fn failed(&mut self, code: i32, message: &str) {
        if let Some(mut f) = self.0.take() {
            let _ = writeln!(f, "FAILED {code} {}", message.replace('\n', " | "));
        }
    }
}

/// Parse one readiness line.
pub fn parse_line(line: &str, pid: u32) -> Option<Readiness> {
    let line = line.trim_end();
    if let Some(sock) = line.strip_prefix("READY ") {
        return Some(Readiness::Ready {
            socket: sock.to_string(),
            pid,
        });
    }
    let rest = line.strip_prefix("FAILED ")?;
    let (code, msg) = rest.split_once(' ').unwrap_or((rest, ""));
    Some(Readiness::Failed {
        code: code.parse().ok()?,
        message: msg.to_string(),
    })
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
/// at `log`), and wait for its readiness line.
pub fn spawn_and_wait(args: &[OsString], logf: File, log: &Path) -> std::io::Result<Readiness> {
    let exe = std::env::current_exe()?;
    let (rd, wr): (OwnedFd, OwnedFd) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
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
    wait_readable(&rd, child.id())?;
    let mut line = String::new();
    BufReader::new(File::from(rd)).read_line(&mut line)?;
    Ok(parse_line(&line, child.id()).unwrap_or(Readiness::Failed {
        code: k3_proto::exit::FAILURE,
        message: format!(
            "the store exited during start-up without a word; see {}",
            log.display()
        ),
    }))
}

/// Wait until the child's readiness pipe has something (its line, or EOF). SIGINT and SIGTERM
/// meanwhile are passed on to the child as SIGTERM: it is in its own process group, so a Ctrl-C
/// at the terminal would otherwise end only this parent and leave the store loading unwatched.
/// The child then abandons its load and reports that on the pipe. A second signal ends this
/// parent at once (status 1).
fn wait_readable(rd: &OwnedFd, child: u32) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
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
    let r = loop {
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
            Ok(_) => break Ok(()),
            Err(e) => break Err(e.into()),
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
    fn lines_parse() {
        assert_eq!(
            parse_line("READY /tmp/k3-0/store.sock\n", 9),
            Some(Readiness::Ready {
                socket: "/tmp/k3-0/store.sock".into(),
                pid: 9
            })
        );
        assert_eq!(
            parse_line("FAILED 2 plan does not fit | need 5 GB\n", 9),
            Some(Readiness::Failed {
                code: 2,
                message: "plan does not fit | need 5 GB".into()
            })
        );
        assert_eq!(parse_line("", 9), None);
        assert_eq!(parse_line("FAILED x y", 9), None);
    }

    /// Ctrl-C while `start --detach` waits reaches the store it started (as SIGTERM), whose
    /// readiness line then ends the wait; the child is not left running. (A child that gets no
    /// SIGTERM exits after ~5 s without a line: the test then fails, it does not hang.)
    #[test]
    fn an_interrupt_while_waiting_is_passed_on_to_the_child() {
        use std::os::fd::AsRawFd;
        let (rd, wr): (OwnedFd, OwnedFd) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        nix::fcntl::fcntl(
            &wr,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .unwrap();
        let script = format!(
            "trap 'echo \"FAILED 1 stopped by SIGTERM\" > /dev/fd/{}; exit 0' TERM; \
             i=0; while [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done",
            wr.as_raw_fd()
        );
        let mut child = Command::new("sh").arg("-c").arg(script).spawn().unwrap();
        drop(wr);
        let interrupt = std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(500));
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGINT).unwrap();
        });
        let t0 = std::time::Instant::now();
        wait_readable(&rd, child.id()).unwrap();
        interrupt.join().unwrap();
        let mut line = String::new();
        BufReader::new(File::from(rd)).read_line(&mut line).unwrap();
        assert_eq!(
            parse_line(&line, child.id()),
            Some(Readiness::Failed {
                code: 1,
                message: "stopped by SIGTERM".into()
            })
        );
        assert!(child.wait().unwrap().success());
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    }
}
