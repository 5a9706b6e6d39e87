//! The speculation flags (`--spec`, `--draft`, `--draft-trunk`, `--draft-experts`,
//! `--draft-replay`, `--draft-miss-rate`, `--draft-seed`) as a factory of each request's
//! [`Speculation`]: every sequence gets drafters of its own (history, n-gram, replay, and a
//! drafter over the one draft model the job loads, [`DraftModel`]).

use std::sync::Arc;
use std::time::Instant;

use k3_store::attach::AttachedSource;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::draft::DraftSource;
use k3_store::runtime::plan::fmt_bytes;
use k3_store::runtime::source::WeightSource;
use k3_store::runtime::trunk::TrunkError;

use crate::engine::request::Speculation;
use crate::engine::spec::{
    DraftModel, Drafter, FirstOf, HistoryDrafter, ModelDrafter, NgramDrafter, ReplayDrafter,
    SpecMode,
};
use crate::front::cli::{Cli, DraftArg, MAX_PROMPT_FILE};
use crate::front::error::{read_bounded, refuse, JobError};
use crate::model::Dims;

/// What the speculation flags ask for, checked before any work.
#[derive(Clone, Debug)]
pub struct DraftFlags {
    mode: SpecMode,
    list: Vec<DraftArg>,
    /// The replay drafter's continuation (`--draft-replay`).
    replay: Option<Vec<u32>>,
    miss_rate: f64,
    seed: u64,
}

impl DraftFlags {
    /// The flags of `cli`, checked (the replay file read and parsed).
    pub fn from_cli(cli: &Cli) -> Result<DraftFlags, JobError> {
        if !(0.0..=1.0).contains(&cli.draft_miss_rate) {
            return Err(refuse(format!(
                "--draft-miss-rate {} must be in [0, 1]",
                cli.draft_miss_rate
            )));
        }
        match (cli.draft.contains(&DraftArg::Model), &cli.draft_trunk) {
            (true, None) if cli.standalone.is_some() => {
                return Err(refuse("--draft model needs --draft-trunk DIR"))
            }
            (false, Some(_)) => return Err(refuse("--draft-trunk needs model in --draft")),
            _ => {}
        }
        let mode = if cli.full_recompute {
            SpecMode::Off
        } else {
            cli.spec
        };
        Ok(DraftFlags {
            mode,
            list: cli.draft.clone(),
            replay: replay_ids(cli)?,
            miss_rate: cli.draft_miss_rate,
            seed: cli.draft_seed,
        })
    }

    /// The most ids a pass may draft (its memory is planned up front).
    pub fn max_drafts(&self) -> usize {
        self.mode.max_drafts()
    }

    /// True when the job runs a draft model.
    pub fn wants_model(&self) -> bool {
        self.mode != SpecMode::Off && self.list.contains(&DraftArg::Model)
    }
}

/// The `--draft-replay` continuation.
fn replay_ids(cli: &Cli) -> Result<Option<Vec<u32>>, JobError> {
    let wants = cli.draft.contains(&DraftArg::Replay);
    let Some(path) = &cli.draft_replay else {
        if wants {
            return Err(refuse("--draft replay needs --draft-replay FILE"));
        }
        return Ok(None);
    };
    if !wants {
        return Err(refuse("--draft-replay needs replay in --draft"));
    }
    let text = String::from_utf8(read_bounded(path, MAX_PROMPT_FILE)?)
        .map_err(|_| refuse(format!("{}: not UTF-8", path.display())))?;
    let ids: Result<Vec<u32>, _> = text
        .split(|c: char| c == ',' || c == '[' || c == ']' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>())
        .collect();
    let ids = ids.map_err(|e| {
        refuse(format!(
            "{}: expected token ids (a JSON list or ids separated by commas or spaces): {e}",
            path.display()
        ))
    })?;
    if ids.is_empty() {
        return Err(refuse(format!("{}: no ids", path.display())));
    }
    Ok(Some(ids))
}

/// What the draft model is loaded against: the target's dims and positions a slot, the
/// checkpoint's catalog (its identity check), the store (whose draft trunk an attached job
/// maps when it has none of its own) and the target's weights (the model-level tensors).
#[derive(Clone, Copy)]
pub struct DraftAt<'a> {
    /// The target's dims.
    pub dims: &'a Dims,
    /// Positions a slot is planned for.
    pub positions: usize,
    /// The checkpoint's catalog, read when a draft model runs.
    pub catalog: Option<&'a Catalog>,
    /// The store, when attached.
    pub store: Option<&'a AttachedSource>,
    /// The target's weights.
    pub target: &'a dyn WeightSource,
}

/// Each request's drafters.
#[derive(Debug)]
pub struct Drafters {
    flags: DraftFlags,
    model: Option<Arc<DraftModel>>,
}

impl Drafters {
    /// No drafting.
    pub fn off(flags: DraftFlags) -> Drafters {
        Drafters { flags, model: None }
    }

    /// Load the draft model when the flags ask for one (`--draft-trunk DIR`, or the store's),
    /// made from the checkpoint `at` describes, with the target's model-level tensors.
    pub fn load(cli: &Cli, flags: DraftFlags, at: &DraftAt<'_>) -> Result<Drafters, JobError> {
        let cat = at.catalog.filter(|_| flags.wants_model());
        let model = match cat {
            Some(cat) => Some(load_model(cli, at, cat)?),
            None => None,
        };
        Ok(Drafters { flags, model })
    }

    /// The most ids a pass may draft.
    pub fn max_drafts(&self) -> usize {
        self.flags.max_drafts()
    }

    /// A request's speculation: the drafters `--draft` names, in order (the replay drafter
    /// knows the prompt's length; a draft model's drafter has room for `capacity` positions).
    pub fn for_request(&self, prompt_len: usize, capacity: usize) -> Speculation {
        if self.flags.mode == SpecMode::Off {
            return Speculation::off();
        }
        let mut list: Vec<Box<dyn Drafter>> = Vec::new();
        for d in &self.flags.list {
            match d {
                DraftArg::History => list.push(Box::new(HistoryDrafter::default())),
                DraftArg::Ngram => list.push(Box::new(NgramDrafter)),
                DraftArg::Replay => list.push(Box::new(ReplayDrafter {
                    continuation: self.flags.replay.clone().unwrap_or_default(),
                    prompt_len,
                    miss_rate: self.flags.miss_rate,
                    seed: self.flags.seed,
                })),
                DraftArg::Model => {
                    if let Some(m) = &self.model {
                        let d: ModelDrafter = m.drafter(capacity + self.max_drafts());
                        list.push(Box::new(d));
                    }
                }
            }
        }
        Speculation::with(self.flags.mode, Some(Box::new(FirstOf(list))))
    }

    /// The draft model's forward calls and seconds so far, summed from `spec` (a request's).
    pub fn model_cost(spec: &Speculation) -> Option<(u64, f64)> {
        spec.drafter.as_ref().and_then(|d| d.model_cost())
    }
}

/// Load the draft model (its own `--draft-trunk DIR`, or the store's).
fn load_model(cli: &Cli, at: &DraftAt<'_>, cat: &Catalog) -> Result<Arc<DraftModel>, JobError> {
    let t0 = Instant::now();
    let n = at.dims.n_layers;
    let target = at.target;
    let src = match (&cli.draft_trunk, at.store) {
        (Some(dir), _) => DraftSource::open(dir, cat, n, &|t| target.model_tensor(t)),
        (None, Some(store)) => store.draft_source(cat, n).ok_or_else(|| {
            refuse(
                "--draft model: the store holds no draft trunk (start it with --draft-trunk DIR, \
                 or give this job --draft-trunk DIR)",
            )
        })?,
        (None, None) => return Err(refuse("--draft model needs --draft-trunk DIR")),
    }
    .map_err(|e: TrunkError| match e.is_refusal() {
        true => refuse(e.to_string()),
        false => JobError::DraftIo(e.to_string()),
    })?;
    tracing::info!(
        "draft model: {} trunk {} loaded and checked in {:.2} s",
        src.kind().name(),
        fmt_bytes(src.bytes()),
        t0.elapsed().as_secs_f64()
    );
    let chunk =
        crate::engine::memory::prefill_rows(cli.prefill_chunk.rows_or_default(), at.positions);
    Ok(DraftModel::new(
        src,
        at.dims.clone(),
        chunk,
        cli.draft_experts.into(),
    )?)
}
