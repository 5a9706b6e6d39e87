//! Quality measured as the field measures it (issue 48, item 2): `k3-worker --perplexity FILE`
//! scores a whole text file with teacher forcing — mean negative log-likelihood and perplexity,
//! as llama.cpp's `perplexity` tool — and, given the exact model's saved log-probabilities
//! (`--save-logprobs` of an exact run, `--kl-base` of the compared one), the mean and 99th
//! percentile KL divergence and the top-1 agreement per position, as its KL-divergence mode.
//!
//! **Windowing** (SPEC.md §6.16). The file is tokenized as user text (special tokens off) into
//! ids `t_0 … t_{M−1}`, cut into consecutive windows of `W` ids (`--ppl-window`, default 512;
//! the last may be shorter). Each window runs as its own sequence from a fresh state: `[BOS]`
//! then the window's ids but its last, one forward over all of them (in calls of at most
//! [`CHUNK`] positions, which changes no bit); position `j`'s logits score the window's id `j`,
//! so every id of the text is scored exactly once, its first `j` ids of context before it.
//! (llama.cpp replaces each chunk's first id by BOS and scores only the second half of a chunk;
//! here every id counts, as the trained proxy's validation loss does, and `W` sets how much
//! context the early ids of a window have.)
//!
//! **Figures.** Per position, log-probabilities `log p = l − log Σ exp l` in f64, kept as f32
//! (a saved base's rows, and the compared run's, so a run compared with itself gives KL 0):
//! NLL = `−log p(next id)`; KL(base ‖ run) = `Σ_i p_i (log p_i − log q_i)`; top-1 agreement =
//! the share of positions whose largest log-probability (first index on ties) is the same id.
//! Mean NLL and mean KL are averages over every scored id, the KL percentile is the nearest
//! rank, perplexity = `exp(mean NLL)`.

mod logprobs;
mod score;

pub use logprobs::{ids_hash, Header, LogprobsError, Reader, Writer};
pub use score::{kl, log_softmax_into, percentile, top1};

use std::path::PathBuf;
use std::time::Instant;

use crate::model::{Logits, Model, ModelError, SeqState};

/// Positions per forward call while scoring (their logits, `CHUNK × vocabulary` floats, are
/// held at once: 21 MB for K3's 163,840 ids).
pub const CHUNK: usize = 32;

/// The window without `--ppl-window`.
pub const DEFAULT_WINDOW: usize = 512;

/// What to score and against what.
#[derive(Clone, Debug)]
pub struct PplJob {
    /// The text's ids.
    pub ids: Vec<u32>,
    /// The id each window starts after.
    pub bos: u32,
    /// Window length `W`.
    pub window: usize,
    /// Write every position's log-probabilities here (the base of a later comparison).
    pub save: Option<PathBuf>,
    /// Compare with this base file.
    pub base: Option<PathBuf>,
    /// The codec of the trunk this run's layers come from (recorded in a saved base).
    pub codec: String,
}

/// What comparing with a base gave.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KlReport {
    /// The base file.
    pub base: PathBuf,
    /// The codec the base ran on.
    pub base_codec: String,
    /// Mean KL(base ‖ run), nats.
    pub mean: f64,
    /// 99th percentile (nearest rank), nats.
    pub p99: f64,
    /// Largest, nats.
    pub max: f64,
    /// Positions whose top-1 id is the base's.
    pub top1_same: u64,
    /// `top1_same` ÷ positions.
    pub top1_agreement: f64,
    /// The base's mean NLL over the same ids, nats.
    pub base_mean_nll: f64,
}

/// A scored text.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PplReport {
    /// Ids scored (the text's).
    pub positions: u64,
    /// Windows.
    pub windows: usize,
    /// Window length.
    pub window: usize,
    /// Mean NLL, nats per id.
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Against the base, when given.
    pub kl: Option<KlReport>,
    /// Seconds scoring took.
    pub seconds: f64,
}

/// Why scoring stopped.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The forward pass failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The base file could not be written or used.
    #[error("{}: {source}", path.display())]
    Logprobs {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: LogprobsError,
    },
    /// SIGINT or SIGTERM (a base being saved is removed).
    #[error("interrupted by {0}")]
    Interrupted(&'static str),
}

/// The header a base file of `job` scored with `vocab` ids has.
fn header(job: &PplJob, vocab: usize) -> Header {
    Header {
        vocab: vocab as u32,
        window: job.window as u32,
        positions: job.ids.len() as u64,
        ids_xxh3: ids_hash(&job.ids, job.window),
        codec: job.codec.clone(),
    }
}

/// Running sums over the scored positions.
#[derive(Default)]
struct Sums {
    nll: f64,
    base_nll: f64,
    kls: Vec<f64>,
    top1_same: u64,
    n: u64,
}

/// The base side of a job: the file being written and/or the one read, and the row buffers.
struct Base {
    save: Option<(PathBuf, Writer)>,
    read: Option<(PathBuf, Reader)>,
    row: Vec<f32>,
}

impl Base {
    fn open(job: &PplJob, vocab: usize) -> Result<Base, EvalError> {
        let h = header(job, vocab);
        let at = |path: &PathBuf| {
            let path = path.clone();
            move |source| EvalError::Logprobs { path, source }
        };
        let save = match &job.save {
            Some(p) => Some((p.clone(), Writer::create(p, h.clone()).map_err(at(p))?)),
            None => None,
        };
        let read = match &job.base {
            Some(p) => Some((p.clone(), Reader::open(p, &h).map_err(at(p))?)),
            None => None,
        };
        Ok(Base {
            save,
            read,
            row: Vec::with_capacity(if job.base.is_some() { vocab } else { 0 }),
        })
    }

    /// Score one position whose log-probabilities are `logp` and whose next id is `next`.
    fn position(&mut self, logp: &[f32], next: u32, s: &mut Sums) -> Result<(), EvalError> {
        s.nll -= logp[next as usize] as f64;
        s.n += 1;
        if let Some((path, w)) = &mut self.save {
            w.row(logp).map_err(|source| EvalError::Logprobs {
                path: path.clone(),
                source,
            })?;
        }
        if let Some((path, r)) = &mut self.read {
            r.row(&mut self.row).map_err(|source| EvalError::Logprobs {
                path: path.clone(),
                source,
            })?;
            s.kls.push(kl(&self.row, logp));
            s.base_nll -= self.row[next as usize] as f64;
            s.top1_same += u64::from(top1(&self.row) == top1(logp));
        }
        Ok(())
    }
}

/// Score `job` on `model` (each window from a fresh state, [`CHUNK`] positions a call); `stop`
/// is polled between calls.
pub fn run(
    model: &mut Model<'_>,
    job: &PplJob,
    stop: &dyn Fn() -> Option<&'static str>,
) -> Result<PplReport, EvalError> {
    let t0 = Instant::now();
    let vocab = model.dims.vocab;
    let mut base = Base::open(job, vocab)?;
    let mut sums = Sums::default();
    let mut logp = Vec::with_capacity(vocab);
    let windows: Vec<&[u32]> = job.ids.chunks(job.window.max(1)).collect();
    for w in &windows {
        let mut input = Vec::with_capacity(w.len());
        input.push(job.bos);
        input.extend_from_slice(&w[..w.len() - 1]);
        let mut st = SeqState::new(&model.dims, input.len());
        for (c, ids) in input.chunks(CHUNK).enumerate() {
            if let Some(sig) = stop() {
                return Err(EvalError::Interrupted(sig));
            }
            let logits = model.forward(ids, &mut st, Logits::All)?;
            for (j, row) in logits.chunks_exact(vocab).enumerate() {
                log_softmax_into(row, &mut logp);
                base.position(&logp, w[c * CHUNK + j], &mut sums)?;
            }
        }
    }
    if let Some((path, w)) = base.save.take() {
        w.finish()
            .map_err(|source| EvalError::Logprobs { path, source })?;
    }
    let n = sums.n.max(1) as f64;
    let mean_nll = sums.nll / n;
    let kl = base.read.map(|(path, r)| KlReport {
        base: path,
        base_codec: r.header.codec.clone(),
        mean: sums.kls.iter().sum::<f64>() / n,
        p99: percentile(&sums.kls, 0.99).unwrap_or(0.0),
        max: sums.kls.iter().copied().fold(0.0, f64::max),
        top1_same: sums.top1_same,
        top1_agreement: sums.top1_same as f64 / n,
        base_mean_nll: sums.base_nll / n,
    });
    Ok(PplReport {
        positions: sums.n,
        windows: windows.len(),
        window: job.window,
        mean_nll,
        perplexity: mean_nll.exp(),
        kl,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The report's lines on stderr.
pub fn print(r: &PplReport, trunk: &k3_proto::wire::TrunkInfo) {
    if trunk.is_lossy() {
        eprintln!("{}", trunk.lossy);
    }
    eprintln!(
        "perplexity: {} ids in {} windows of {} (each after [BOS], from a fresh state), {:.1} s: \
         mean NLL {:.6} nats/id, perplexity {:.4}",
        r.positions, r.windows, r.window, r.seconds, r.mean_nll, r.perplexity
    );
    if let Some(k) = &r.kl {
        eprintln!(
            "against {} (base trunk {}): mean KL {:.6} nats, 99th percentile {:.6}, max {:.6}; \
             top-1 agreement {:.3}% ({} of {}); mean NLL {:+.6} nats/id from the base's {:.6}",
            k.base.display(),
            if k.base_codec.is_empty() {
                "the shards"
            } else {
                &k.base_codec
            },
            k.mean,
            k.p99,
            k.max,
            100.0 * k.top1_agreement,
            k.top1_same,
            r.positions,
            r.mean_nll - k.base_mean_nll,
            k.base_mean_nll
        );
    }
}

/// The buffers of a scoring job's largest pass over windows of `window` positions: a call of
/// [`CHUNK`] rows returning every row's logits, and [`extra_bytes`].
pub fn pass_bytes(d: &crate::model::Dims, window: usize) -> u64 {
    let rows = CHUNK.min(window.max(1));
    let pass = crate::model::state::Work::bytes_for(
        d,
        &crate::model::state::PassShape {
            rows,
            logits_rows: rows,
            context: window,
            journaled: false,
            threads: rayon::current_num_threads(),
        },
    );
    pass + extra_bytes(d.vocab)
}

/// Bytes a scoring job holds beyond the model's pass buffers: a call's logits (`CHUNK` rows),
/// one row of log-probabilities and one of the base's, and the writer's and reader's buffers.
pub fn extra_bytes(vocab: usize) -> u64 {
    let row = 4 * vocab as u64;
    (CHUNK as u64 + 3) * row + 2 * (1 << 20)
}
