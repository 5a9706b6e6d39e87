//! Output processing: where each sequence's ids go ([`Sink`]: standard output, the serve
//! channel, a `--batch` result line, the chat REPL), the per-id [`StepReport`], and what a
//! sequence ends with ([`Finished`]: the finish, the usage and the timings — built here, in one
//! place, for every front end). [`Outputs`] holds the sinks of the sequences in flight and does
//! what the store is told along the way: sessions kept (after the prefill, at the end), the
//! worker's progress after each step, each finished sequence's ids for later jobs' history
//! drafting.

use std::time::Instant;

use k3_proto::serve::{Finish, Timings, Usage};
use k3_proto::wire::JobProgress;
use k3_store::attach::AttachedSource;
use k3_store::runtime::source::WeightSource;

use crate::engine::request::{Held, SeqId, SessionPlan, Speculation};
use crate::engine::sampling::Sampler;
use crate::engine::session;
use crate::engine::shaping::{MaskCost, Scored};
use crate::engine::spec::SpecTotals;
use crate::model::PhaseSeconds;

/// What a sink wants after an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Generate the next id (up to the limit or a stop id).
    Continue,
    /// End the sequence after this id (the chat reply parser saw the end of the message, or
    /// Ctrl-C): it finishes as [`Finish::Cancelled`].
    Stop,
}

/// One generated id, with what its step cost.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    /// 0 = the first id (after the prefill).
    pub step: usize,
    /// The chosen id.
    pub token: u32,
    /// Wall seconds of the passes that produced this id (the whole pass each time, whoever
    /// else's rows were in it: the sequence waited that long), shared equally among the ids
    /// one pass produced.
    pub seconds: f64,
    /// Weight bytes the source read during those passes, this sequence's share (its rows over
    /// the pass's rows).
    pub bytes_read: u64,
    /// Requested experts already resident / requested (None if none requested).
    pub resident_hit_rate: Option<f64>,
    /// Seconds the passes were blocked waiting for weight bytes (trunk layers not yet read +
    /// routed experts not yet arrived): the I/O they did NOT hide.
    pub io_wait_seconds: f64,
    /// Seconds the source spent reading weight bytes that completed during the passes (reads
    /// run beside compute; 1 − wait ÷ read is the share of I/O hidden behind compute).
    pub io_read_seconds: f64,
    /// The sequence's pass that produced this id (0 = the prefill). A verify pass produces one
    /// id per accepted draft plus one; its seconds, bytes and I/O are shared among them.
    pub pass: usize,
    /// Drafted ids the pass verified (on the pass's first id; 0 on the others).
    pub drafted: usize,
    /// Drafted ids the pass accepted (on the pass's first id; 0 on the others).
    pub accepted: usize,
    /// Bytes the router lookahead's prefetches read (part of `bytes_read`; on a pass's first id).
    pub prefetch_bytes: u64,
    /// Requested experts that a prefetch had loaded (on a pass's first id).
    pub prefetch_used: u64,
    /// Of `bytes_read`, the trunk's (on a pass's first id).
    pub trunk_bytes_read: u64,
    /// Where the passes spent their time (shared equally among a pass's ids, like its seconds).
    pub phases: PhaseSeconds,
    /// The first id its pass produced.
    #[serde(skip)]
    pub first_of_pass: bool,
    /// Its log-probabilities, when the request asked for them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scored: Option<Scored>,
}

/// What a sequence produced.
#[derive(Clone, Debug, Default)]
pub struct GenReport {
    /// The prompt.
    pub prompt_ids: Vec<u32>,
    /// Generated ids (including a final stop id, if one was produced).
    pub generated_ids: Vec<u32>,
    /// Per id.
    pub steps: Vec<StepReport>,
    /// Logits of the last prompt position, when asked for.
    pub step0_logits: Option<Vec<f32>>,
    /// The stop id that ended generation, if any.
    pub stopped_on: Option<u32>,
    /// Speculative decoding's counts.
    pub spec: SpecTotals,
}

impl GenReport {
    /// Seconds of step 0 (prefill + first pick).
    pub fn prefill_seconds(&self) -> f64 {
        self.steps.first().map_or(0.0, |s| s.seconds)
    }

    /// Mean seconds per token over steps ≥ 1 (None with fewer than two steps).
    pub fn seconds_per_token(&self) -> Option<f64> {
        let rest = &self.steps[1.min(self.steps.len())..];
        (!rest.is_empty()).then(|| rest.iter().map(|s| s.seconds).sum::<f64>() / rest.len() as f64)
    }

    /// Mean seconds per decoded token (steps ≥ 1) by phase, and the rest of the step outside
    /// the phases (embedding, sampling, bookkeeping); `None` without decode steps.
    pub fn time_per_token(&self) -> Option<(PhaseSeconds, f64)> {
        let rest = &self.steps[1.min(self.steps.len())..];
        if rest.is_empty() {
            return None;
        }
        let n = rest.len() as f64;
        let mut sum = PhaseSeconds::default();
        let mut seconds = 0.0;
        for s in rest {
            sum = sum.plus(&s.phases);
            seconds += s.seconds;
        }
        let mean = sum.scaled(1.0 / n);
        Some((mean, (seconds / n - mean.total()).max(0.0)))
    }
}

/// The prompt is in the state (said once, before the first id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefilled {
    /// Prompt ids a state it started from already held (not run again).
    pub cached: usize,
    /// Prompt ids the state held when generation began: all but the last when the state was
    /// kept after the prefill, else `cached`.
    pub held: usize,
    /// Bytes of the session kept after the prefill (`None`: none kept).
    pub kept: Option<u64>,
}

/// How a sequence ended.
#[derive(Clone, Debug)]
pub struct Finished {
    /// Why.
    pub finish: Finish,
    /// Its counts.
    pub usage: Usage,
    /// Its time and bytes.
    pub timings: Timings,
    /// Everything per id.
    pub report: GenReport,
    /// A state it started from did not prefix the prompt: it ran the whole prompt.
    pub restarted: bool,
    /// Its shaping failed (a grammar that allowed no id, or refused one): it ended there, as
    /// cancelled, and this says why.
    pub error: Option<String>,
    /// What its grammar's masks cost (`None`: no grammar).
    pub mask: Option<MaskCost>,
}

/// Where one sequence's output goes: the boundary between the engine and whoever asked.
pub trait Sink {
    /// The prompt is in the state.
    fn prefilled(&mut self, _p: &Prefilled) {}
    /// One generated id; [`Flow::Stop`] ends the sequence after it.
    fn token(&mut self, s: &StepReport) -> Flow;
    /// The sequence ended without an error.
    fn done(&mut self, f: &Finished);
}

/// What a sequence hands back when its request asked for it ([`crate::engine::request::Request::hand_back`]):
/// its report, its final state (the last id picked is not in it: it was never run), its
/// sampler and its speculation state, for a next request that continues it.
#[derive(Debug)]
pub struct Ended {
    /// How it ended.
    pub finished: Finished,
    /// Its final state (`None` when it is unusable).
    pub held: Option<Held>,
    /// Its generator, where the last pick left it.
    pub sampler: Sampler,
    /// Its drafter and auto mode's estimates.
    pub spec: Speculation,
}

/// The engine's view of a sequence when it ends, for [`Outputs::finished`].
pub(crate) struct Ending {
    pub(crate) seq: SeqId,
    pub(crate) finish: Finish,
    pub(crate) report: GenReport,
    pub(crate) usage: Usage,
    /// When it joined, its first id came, and it ended.
    pub(crate) joined: Instant,
    pub(crate) first: Option<Instant>,
    /// Its share of what the passes it was in read.
    pub(crate) bytes: f64,
    pub(crate) requests: f64,
    pub(crate) hits: f64,
    pub(crate) restarted: bool,
    /// The final state, when it is usable (not after a failed pass).
    pub(crate) held: Option<Held>,
    pub(crate) sampler: Sampler,
    pub(crate) spec: Speculation,
    pub(crate) hand_back: bool,
    pub(crate) error: Option<String>,
    pub(crate) mask: Option<MaskCost>,
}

struct Entry<'o> {
    seq: SeqId,
    sink: Box<dyn Sink + 'o>,
    session: Option<SessionPlan>,
    /// Bytes kept after the prefill.
    kept_after_prefill: Option<u64>,
    told_prefilled: bool,
}

/// The sinks of the sequences in flight, and what the store is told on their behalf.
pub struct Outputs<'o> {
    entries: Vec<Entry<'o>>,
    /// Attached: sessions, progress and history go to the store.
    store: Option<&'o AttachedSource>,
    progress: JobProgress,
    ended: Vec<(SeqId, Ended)>,
}

impl std::fmt::Debug for Outputs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outputs")
            .field("sequences", &self.entries.len())
            .field("attached", &self.store.is_some())
            .finish()
    }
}

impl<'o> Outputs<'o> {
    /// No sinks yet; `store` (attached workers) takes sessions, progress and history.
    pub fn new(store: Option<&'o AttachedSource>) -> Outputs<'o> {
        Outputs {
            entries: Vec::new(),
            store,
            progress: JobProgress::default(),
            ended: Vec::new(),
        }
    }

    /// Sequences with a sink.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No sequence has a sink.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What sequence `seq` handed back when it ended (its request asked for it).
    pub fn take_ended(&mut self, seq: SeqId) -> Option<Ended> {
        let i = self.ended.iter().position(|(s, _)| *s == seq)?;
        Some(self.ended.swap_remove(i).1)
    }

    pub(crate) fn attach(
        &mut self,
        seq: SeqId,
        sink: Box<dyn Sink + 'o>,
        session: Option<SessionPlan>,
    ) {
        self.entries.push(Entry {
            seq,
            sink,
            session,
            kept_after_prefill: None,
            told_prefilled: false,
        });
    }

    fn entry(&mut self, seq: SeqId) -> Option<&mut Entry<'o>> {
        self.entries.iter_mut().find(|e| e.seq == seq)
    }

    /// Every prompt id but the last is in the state: keep it, when asked, as a session of its
    /// own named after its ids ([`prefix_session_name`]), beside the one the sequence runs
    /// under: a retry of the request resumes it, and so does any later prompt that starts with
    /// it — the next turn of a conversation whose reply does not re-render to the ids the
    /// model generated (a tool call, a text that re-encodes otherwise), a regenerated reply.
    pub(crate) fn at_prefill(&mut self, seq: SeqId, state: &crate::model::SeqState, ids: &[u32]) {
        let store = self.store;
        let Some(e) = self.entry(seq) else { return };
        let Some(plan) = e.session.as_ref().filter(|p| p.after_prefill) else {
            return;
        };
        let name = prefix_session_name(&plan.name_key, ids);
        e.kept_after_prefill = store.and_then(|src| keep(src, &name, ids, state));
    }

    /// The first id is about to be emitted: tell the sink the prompt is in.
    pub(crate) fn prefilled(&mut self, seq: SeqId, cached: usize, held: usize) {
        let Some(e) = self.entry(seq) else { return };
        if std::mem::replace(&mut e.told_prefilled, true) {
            return;
        }
        let held = if e.kept_after_prefill.is_some() {
            held
        } else {
            cached
        };
        let p = Prefilled {
            cached,
            held,
            kept: e.kept_after_prefill,
        };
        e.sink.prefilled(&p);
    }

    /// One id of sequence `seq`.
    pub(crate) fn token(&mut self, seq: SeqId, s: &StepReport) -> Flow {
        self.progress.tokens += 1;
        if s.step == 0 {
            self.progress.prefill_seconds += s.seconds;
        } else {
            self.progress.decode_seconds += s.seconds;
            self.progress.forward_passes += u64::from(s.first_of_pass);
            self.progress.drafted_tokens += s.drafted as u64;
            self.progress.accepted_tokens += s.accepted as u64;
        }
        self.progress.trunk_bytes_read += s.trunk_bytes_read;
        match self.entry(seq) {
            Some(e) => e.sink.token(s),
            None => Flow::Continue,
        }
    }

    /// After each step: the worker's progress, for `k3-ctl ps` (summed from the steps: no
    /// extra round trip per id).
    pub(crate) fn after_step(&mut self) {
        if let Some(src) = self.store {
            // Progress is for people watching; a lost connection fails the next expert request.
            if let Err(e) = src.report_progress(self.progress.clone()) {
                tracing::debug!("progress not reported: {e}");
            }
        }
    }

    /// Sequence `seq` ended: keep its session (unless cancelled: then what was kept after the
    /// prefill stands, for a retry), record its ids in the store's history, tell its sink, and
    /// hand its state back when asked.
    pub(crate) fn finished(&mut self, end: Ending) {
        let store = self.store;
        let i = self.entries.iter().position(|e| e.seq == end.seq);
        let mut entry = i.map(|i| self.entries.swap_remove(i));
        let kept = match (&entry, &end.held) {
            (Some(e), Some(h)) if end.finish != Finish::Cancelled => e
                .session
                .as_ref()
                .zip(store)
                .and_then(|(plan, src)| keep(src, &plan.name, &h.ids, &h.state)),
            (Some(e), _) => e.kept_after_prefill,
            (None, _) => None,
        };
        if let Some(src) = store {
            // The sequence's stream, for later jobs' history drafting (SPEC.md §3.12).
            let mut stream = end.report.prompt_ids.clone();
            stream.extend_from_slice(&end.report.generated_ids);
            if let Err(e) = src.record_history(&stream) {
                tracing::warn!("token stream not recorded in the store's history: {e}");
            }
        }
        let now = Instant::now();
        let first = end.first.unwrap_or(now);
        let finished = Finished {
            finish: end.finish,
            usage: end.usage,
            timings: Timings {
                prefill_seconds: (first - end.joined).as_secs_f64(),
                decode_seconds: (now - first).as_secs_f64(),
                bytes_read: end.bytes.round() as u64,
                expert_requests: end.requests.round() as u64,
                resident_hits: end.hits.round() as u64,
                kept_session_bytes: kept,
            },
            report: end.report,
            restarted: end.restarted,
            error: end.error,
            mask: end.mask,
        };
        if let Some(e) = entry.as_mut() {
            if !e.told_prefilled && finished.finish == Finish::Cancelled {
                // Cancelled before its first id: the prefill it did is still said.
                let p = Prefilled {
                    cached: finished.usage.cached_ids as usize,
                    held: finished.usage.cached_ids as usize,
                    kept: e.kept_after_prefill,
                };
                e.sink.prefilled(&p);
            }
            e.sink.done(&finished);
        }
        if end.hand_back {
            let held = end.held;
            self.ended.push((
                end.seq,
                Ended {
                    finished,
                    held,
                    sampler: end.sampler,
                    spec: end.spec,
                },
            ));
        }
    }

    /// Sequence `seq` left without finishing (its pass failed): forget its sink.
    pub(crate) fn dropped(&mut self, seq: SeqId) {
        self.entries.retain(|e| e.seq != seq);
    }
}

/// The name of the session that keeps a prompt's prefill ([`Outputs::at_prefill`]): `prefix-`
/// and 16 hex digits of its ids' HMAC-SHA256 under `key` (serve's: a name confirms nothing
/// about a prompt), or of their plain hash without a key; so that the same prefix is kept once.
pub fn prefix_session_name(key: &[u8], ids: &[u32]) -> String {
    if key.is_empty() {
        return format!("prefix-{:016x}", k3_store::session::ids_hash(ids) as u64);
    }
    format!("prefix-{:016x}", k3_store::session::ids_mac(key, ids))
}

/// A name [`prefix_session_name`] makes.
pub fn is_prefix_session_name(name: &str) -> bool {
    name.strip_prefix("prefix-")
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Keep `state` (holding `ids`) as session `name`; the bytes kept, or `None` (said in the log).
fn keep(
    src: &AttachedSource,
    name: &str,
    ids: &[u32],
    state: &crate::model::SeqState,
) -> Option<u64> {
    match session::keep(src, name, ids, state, &session::Meta::default()) {
        Ok(k) => {
            tracing::info!("{}", k.line(name, ids.len()));
            Some(k.bytes)
        }
        Err(e) => {
            tracing::warn!("session {name}: NOT kept: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{is_prefix_session_name, prefix_session_name};

    /// A keyed prefix name is the same for the same key and ids, differs across keys (so a name
    /// seen on one server confirms nothing about a prompt guessed with another key, or with
    /// the plain hash), and keeps the shape serve recognises.
    #[test]
    fn prefix_names_are_keyed() {
        let ids = [1u32, 2, 3, 163_584];
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let plain = prefix_session_name(&[], &ids);
        assert_eq!(prefix_session_name(&a, &ids), prefix_session_name(&a, &ids));
        assert_ne!(prefix_session_name(&a, &ids), prefix_session_name(&b, &ids));
        assert_ne!(prefix_session_name(&a, &ids), plain);
        assert_ne!(
            prefix_session_name(&a, &ids),
            prefix_session_name(&a, &ids[..3])
        );
        for n in [plain, prefix_session_name(&a, &ids)] {
            assert!(is_prefix_session_name(&n), "{n}");
        }
    }
}
