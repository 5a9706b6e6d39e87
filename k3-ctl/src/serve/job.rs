//! One request's `k3-worker` child, attached to the store.
//!
//! The worker is run with `--ids` (serve renders and tokenizes) and no tokenizer, so its stdout
//! is the generated ids, each followed by a space and flushed as it is generated, then one
//! newline at the end (the worker's documented output without `--tok`). Its stderr (a line per
//! step and the run report) is drained beside it, keeping the last lines for error messages.
//! Dropping a [`Job`] that has not finished kills the child (SIGKILL) and reaps it: that is how a
//! client that goes away cancels its job.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::task::JoinHandle;

/// Longest token the worker's stdout may hold (a u32 is at most 10 digits).
const MAX_ITEM: usize = 16;
/// Stderr lines kept for error messages.
const KEEP_LINES: usize = 16;
/// Most ids per `--ids` argument (a single argument is limited to 128 KiB on Linux; the worker
/// appends repeated `--ids` lists).
const IDS_PER_ARG: usize = 4096;

/// How to run a worker.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// The `k3-worker` binary.
    pub exe: PathBuf,
    /// The store's socket.
    pub socket: PathBuf,
    /// `--threads` for the worker (None: its default, all cores).
    pub threads: Option<usize>,
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// Prompt ids.
    pub ids: Vec<u32>,
    /// Most ids to generate.
    pub max_new: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Sampling seed.
    pub seed: u64,
    /// Run under this kept session (`--session`).
    pub session: Option<String>,
}

/// Why a job failed, with the worker's exit code when it exited.
#[derive(Debug)]
pub struct JobError {
    /// The worker's exit code (None: could not run it, killed by a signal, or bad output).
    pub code: Option<i32>,
    /// What went wrong (the worker's last error line when it printed one).
    pub message: String,
}

/// A running worker.
pub struct Job {
    child: Option<Child>,
    stdout: BufReader<ChildStdout>,
    stderr: Option<JoinHandle<VecDeque<String>>>,
    item: Vec<u8>,
    pid: u32,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("pid", &self.pid).finish()
    }
}

/// The worker's command line for `p` (without the program).
pub fn worker_args(spec: &WorkerSpec, p: &GenParams) -> Vec<String> {
    let mut args = vec!["--socket".to_string(), spec.socket.display().to_string()];
    for chunk in p.ids.chunks(IDS_PER_ARG) {
        args.push("--ids".into());
        args.push(
            chunk
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    args.extend([
        "--gen".into(),
        p.max_new.to_string(),
        "--temperature".into(),
        p.temperature.to_string(),
        "--top-p".into(),
        p.top_p.to_string(),
        "--seed".into(),
        p.seed.to_string(),
    ]);
    if let Some(t) = spec.threads {
        args.extend(["--threads".into(), t.to_string()]);
    }
    if let Some(s) = &p.session {
        args.extend(["--session".into(), s.clone()]);
    }
    args
}

impl Job {
    /// Start the worker.
    pub fn spawn(spec: &WorkerSpec, p: &GenParams) -> Result<Job, JobError> {
        let mut child = Command::new(&spec.exe)
            .args(worker_args(spec, p))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| JobError {
                code: None,
                message: format!("cannot start {}: {e}", spec.exe.display()),
            })?;
        let pid = child.id().unwrap_or(0);
        let stdout = child.stdout.take().expect("stdout was piped");
        let stderr = child.stderr.take().expect("stderr was piped");
        let stderr = tokio::spawn(async move {
            let mut lines = BufReader::new(stderr);
            let mut kept = VecDeque::with_capacity(KEEP_LINES);
            let mut line = Vec::new();
            loop {
                line.clear();
                // A line longer than 4 KiB is cut (read in pieces); the worker's are short.
                match (&mut lines).take(4096).read_until(b'\n', &mut line).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if kept.len() == KEEP_LINES {
                            kept.pop_front();
                        }
                        kept.push_back(String::from_utf8_lossy(&line).trim_end().to_string());
                    }
                }
            }
            kept
        });
        Ok(Job {
            child: Some(child),
            stdout: BufReader::new(stdout),
            stderr: Some(stderr),
            item: Vec::new(),
            pid,
        })
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The next generated id; `Ok(None)` once the worker has exited with code 0.
    pub async fn next(&mut self) -> Result<Option<u32>, JobError> {
        loop {
            self.item.clear();
            let n = (&mut self.stdout)
                .take(MAX_ITEM as u64)
                .read_until(b' ', &mut self.item)
                .await
                .map_err(|e| JobError {
                    code: None,
                    message: format!("reading the worker's output: {e}"),
                })?;
            if n == 0 {
                return self.exit().await.map(|()| None);
            }
            let text = String::from_utf8_lossy(&self.item);
            let text = text.trim();
            if text.is_empty() {
                continue; // the final newline
            }
            if self.item.len() >= MAX_ITEM && self.item.last() != Some(&b' ') {
                return Err(self.bad_output(text)); // no id is this long
            }
            return match text.parse::<u32>() {
                Ok(id) => Ok(Some(id)),
                Err(_) => Err(self.bad_output(text)),
            };
        }
    }

    fn bad_output(&self, text: &str) -> JobError {
        JobError {
            code: None,
            message: format!("unexpected output from the worker: {text:?}"),
        }
    }

    /// Wait for the worker after its stdout closed; an exit code other than 0 is an error.
    async fn exit(&mut self) -> Result<(), JobError> {
        let status = match self.child.as_mut() {
            Some(c) => c.wait().await,
            None => return Ok(()),
        };
        self.child = None;
        let lines = match self.stderr.take() {
            Some(h) => h.await.unwrap_or_default(),
            None => VecDeque::new(),
        };
        let status = status.map_err(|e| JobError {
            code: None,
            message: format!("waiting for the worker: {e}"),
        })?;
        if status.success() {
            return Ok(());
        }
        let said = lines
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix("k3-worker: "))
            .or_else(|| lines.back().map(String::as_str))
            .unwrap_or("")
            .to_string();
        let message = match status.code() {
            Some(code) => format!("the worker exited with code {code}: {said}"),
            None => format!("the worker was killed ({status}): {said}"),
        };
        Err(JobError {
            code: status.code(),
            message,
        })
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // Still running (or exited and not yet reaped): kill and reap it.
        let _ = child.start_kill();
        if let Some(h) = self.stderr.take() {
            h.abort();
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let pid = self.pid;
                rt.spawn(async move {
                    let _ = child.wait().await;
                    tracing::warn!("worker pid {pid} stopped before its end (killed and reaped)");
                });
            }
            Err(_) => {
                // No runtime (shutdown): the SIGKILL was sent; tokio reaps orphans when it can.
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_prompts_are_split_over_several_ids_arguments() {
        let spec = WorkerSpec {
            exe: "k3-worker".into(),
            socket: "/s".into(),
            threads: None,
        };
        let p = GenParams {
            ids: (0..(IDS_PER_ARG as u32 * 2 + 1)).collect(),
            max_new: 5,
            temperature: 0.5,
            top_p: 0.9,
            seed: 7,
            session: Some("http-1".into()),
        };
        let args = worker_args(&spec, &p);
        let lists: Vec<&String> = args
            .iter()
            .zip(args.iter().skip(1))
            .filter(|(k, _)| *k == "--ids")
            .map(|(_, v)| v)
            .collect();
        assert_eq!(lists.len(), 3);
        let all: Vec<u32> = lists
            .iter()
            .flat_map(|l| l.split(',').map(|x| x.parse::<u32>().unwrap()))
            .collect();
        assert_eq!(all, p.ids);
        assert!(args.windows(2).any(|w| w[0] == "--gen" && w[1] == "5"));
        assert!(args.windows(2).any(|w| w[0] == "--seed" && w[1] == "7"));
        assert!(args.windows(2).any(|w| w[0] == "--top-p" && w[1] == "0.9"));
        assert!(args
            .windows(2)
            .any(|w| w[0] == "--session" && w[1] == "http-1"));
    }
}
