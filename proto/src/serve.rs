//! The `k3-ctl serve` protocols (docs/SPEC.md §6.12): serve ⇄ worker (one generation job over a
//! socket pair) and `k3-ctl ps` ⇄ serve (the requests a server holds, queued or running).
//!
//! Framing is the wire protocol's ([`crate::wire::encode`], [`crate::wire::read_frame_limited`]):
//! a u32 little-endian length and a postcard-encoded message, at most [`MAX_JOB_FRAME`] bytes.
//!
//! **serve ⇄ worker.** serve starts `k3-worker --serve-channel` with one end of a Unix socket
//! pair as its standard input (the worker's command line is built by
//! `k3_worker::front::cli::serve_channel_args`, the one definition of its flags). The worker speaks
//! first: [`FromWorker::Hello`] with its [`JOB_PROTOCOL_VERSION`]; serve answers with
//! [`ToWorker::Start`] (a job: prompt ids, sampling, the kept session to run under) or closes
//! the channel when the versions differ. The worker then sends [`FromWorker::Prefilled`] once
//! the prompt is in its state, one [`FromWorker::Token`] per generated id, and ends every job
//! with exactly one [`FromWorker::Done`] per choice (v3: a job of `n` choices — one prompt
//! prefilled once, then `n` sequences — tags each id and each end with its choice) or one
//! [`FromWorker::Error`] (an error is a kind and the exit code the worker ends with, not a line
//! of text; it ends the whole job). [`ToWorker::Cancel`] asks the worker to
//! stop the job at its next step boundary (between two prefill chunks, or after an id): it
//! answers `Done` with [`Finish::Cancelled`] and exits 0, keeping what it prefilled as a session
//! so that the same request, retried, resumes. serve kills a worker that has not ended a
//! cancelled job within its grace. The end of the channel (serve gone) counts as a cancel.
//!
//! Every message names its request (`req_id`): today a worker carries one job, but the messages
//! already allow several on one channel (a worker that batches requests joining and leaving
//! between steps), so that change adds behaviour, not a new protocol.
//!
//! **`k3-ctl ps` ⇄ serve.** serve listens on `serve-PID.sock` in the store's socket directory
//! (private to the user, docs/SPEC.md §6.5); `k3-ctl ps` asks each such socket
//! [`ServeQuery::List`] and prints the [`ServeListing`].
//!
//! Versioning: [`JOB_PROTOCOL_VERSION`] is bumped on any change to these types; variants are
//! only appended.

use serde::{Deserialize, Serialize};

/// The version of the serve protocols this build speaks.
pub const JOB_PROTOCOL_VERSION: u32 = 3;

/// Largest frame on these channels (a `Start` with 32,768 ids is at most 160 KiB).
pub const MAX_JOB_FRAME: u32 = crate::wire::MAX_FRAME;

/// serve's id for one HTTP request (unique within one serve process).
pub type ReqId = u64;

/// How ids are picked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0 = greedy argmax.
    pub temperature: f32,
    /// Nucleus mass, in (0, 1].
    pub top_p: f32,
    /// The generator's seed.
    pub seed: u64,
}

/// Highest temperature a job may ask (the widest API range, OpenAI's 0..=2).
pub const MAX_TEMPERATURE: f32 = 2.0;

/// A request value refused before any work: serve answers 400 naming [`ValueError::field`],
/// the worker refuses the job with [`ErrorKind::Invalid`]. The one statement of what a job's
/// numbers may be, shared by both so that a value serve lets through is never a worker's
/// refusal (and so a server fault).
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum ValueError {
    /// NaN or infinite.
    #[error("{field} = {value} is not a finite number")]
    NotFinite {
        /// The request field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// Outside the field's range.
    #[error("{field} = {value} is outside {range}")]
    Range {
        /// The request field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// The range, as people write it.
        range: &'static str,
    },
    /// A nonzero value the engine's single precision cannot hold: it would become 0 (or lose
    /// its digits as a subnormal, or overflow), a different request from the one sent.
    #[error(
        "{field} = {value:e} cannot be held in single precision (the engine samples in f32: a \
         nonzero value must lie between {:e} and {:e} in magnitude)",
        f32::MIN_POSITIVE,
        f32::MAX
    )]
    Precision {
        /// The request field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
}

impl ValueError {
    /// The request field at fault.
    pub fn field(&self) -> &'static str {
        match self {
            ValueError::NotFinite { field, .. }
            | ValueError::Range { field, .. }
            | ValueError::Precision { field, .. } => field,
        }
    }
}

/// A request's number (JSON gives f64) as the engine's f32: refused when it is not finite, or
/// is nonzero and would become 0, a subnormal or infinite. Every real-valued field that reaches
/// a job goes through this.
pub fn single(field: &'static str, value: f64) -> Result<f32, ValueError> {
    if !value.is_finite() {
        return Err(ValueError::NotFinite { field, value });
    }
    let s = value as f32;
    if value != 0.0 && !s.is_normal() {
        return Err(ValueError::Precision { field, value });
    }
    Ok(s)
}

impl Sampling {
    /// The sampling of request values `temperature` and `top_p` (as JSON gives them), each
    /// brought to single precision, then [`validated`](Sampling::validate).
    pub fn from_request(temperature: f64, top_p: f64, seed: u64) -> Result<Sampling, ValueError> {
        let s = Sampling {
            temperature: single("temperature", temperature)?,
            top_p: single("top_p", top_p)?,
            seed,
        };
        s.validate()?;
        Ok(s)
    }

    /// What serve checks before sending a job and the worker checks when it arrives:
    /// temperature in 0..=[`MAX_TEMPERATURE`] (0 = greedy), top_p in (0, 1], both normal
    /// single-precision numbers (or a zero temperature).
    pub fn validate(&self) -> Result<(), ValueError> {
        let (t, p) = (self.temperature, self.top_p);
        let t64 = f64::from(t);
        if !t.is_finite() {
            return Err(ValueError::NotFinite {
                field: "temperature",
                value: t64,
            });
        }
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(ValueError::Range {
                field: "temperature",
                value: t64,
                range: "0..=2",
            });
        }
        if t != 0.0 && !t.is_normal() {
            return Err(ValueError::Precision {
                field: "temperature",
                value: t64,
            });
        }
        if p.is_nan() || !(p > 0.0 && p <= 1.0) {
            return Err(ValueError::Range {
                field: "top_p",
                value: f64::from(p),
                range: "(0, 1]",
            });
        }
        if !p.is_normal() {
            return Err(ValueError::Precision {
                field: "top_p",
                value: f64::from(p),
            });
        }
        Ok(())
    }
}

/// One generation job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Start {
    /// The request.
    pub req_id: ReqId,
    /// Prompt ids (rendered and tokenized by serve).
    pub ids: Vec<u32>,
    /// Most ids to generate (≥ 1).
    pub max_new: u32,
    /// Sampling.
    pub sampling: Sampling,
    /// Run under this kept session (docs/SPEC.md §6.6): resume it when the ids it holds are a
    /// strict prefix of `ids`, keep the state after the prefill under it, and the final state
    /// at the end.
    pub session: Option<String>,
    /// v2. Resume this kept session instead of `session` (when the ids it holds are a strict
    /// prefix of `ids`); `session` still names where the states are kept. serve sends a
    /// prompt's prefill snapshot here, so that it is resumed and never overwritten.
    pub resume: Option<String>,
    /// v2. Besides the state after the prefill (the prompt but its last id), also keep the
    /// state when the first `k` prompt ids are in it, for each `k` (serve: where the
    /// conversation's history ends, before the notes only this request renders).
    pub keep_at: Vec<u32>,
    /// v2. The key the sessions this job keeps after its prefill and at `keep_at` are named
    /// under (`prefix-` + an HMAC-SHA256 of the ids they hold; serve draws one at start, so a
    /// name confirms nothing about a prompt). Empty: named by the ids' plain hash.
    pub name_key: Vec<u8>,
    /// v2. What the reply must be beyond sampling: a grammar, a thinking budget, logit edits,
    /// log-probabilities ([`Shape::default`]: none of them, the ids of v1 bit for bit).
    pub shape: Shape,
    /// v3. Choices to generate (OpenAI's `n`; 0 counts as 1): the prompt is prefilled once and
    /// forked; choice `i` samples with seed `sampling.seed + i` (wrapping) and its own copy of
    /// `shape`; every `Token`, `Scored` and `Done` names its choice. Only choice 0 keeps the
    /// final state under `session`. At most [`MAX_CHOICES`], and no more than the worker's
    /// slots (else the job is refused as [`ErrorKind::Invalid`]).
    pub n: u32,
}

/// v3. Most choices a job may ask for, whatever the worker's slots.
pub const MAX_CHOICES: u32 = 128;

impl Start {
    /// The choices the job generates (`n`, at least 1).
    pub fn choices(&self) -> u32 {
        self.n.max(1)
    }

    /// Choice `i`'s sampling: the job's, with seed `seed + i`.
    pub fn choice_sampling(&self, i: u32) -> Sampling {
        Sampling {
            seed: self.sampling.seed.wrapping_add(u64::from(i)),
            ..self.sampling.clone()
        }
    }
}

/// v2. How a job's ids are shaped beyond its [`Sampling`] (docs/SPEC.md §6.12 "Shaping"). Per
/// pick, in this order: the logit bias and the penalties edit the row, the grammar's mask sets
/// every id it forbids to −∞, the log-probabilities are read, then the sampler picks; a forced
/// id (a spent thinking budget) replaces the pick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    /// The reply starts inside the think channel (the chat format's generation prompt opened
    /// it): the grammar lets it think first, and the thinking budget counts from the start.
    pub thinking: bool,
    /// The grammar the reply must follow.
    pub grammar: Option<Grammar>,
    /// Most ids of the think channel; when they are spent the worker forces its closing ids.
    pub think_budget: Option<ThinkBudget>,
    /// Added to the logits of these ids (OpenAI's `logit_bias`: −100..=100).
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every id the reply generated so far (−2..=2).
    pub presence_penalty: f32,
    /// Subtracted from the logit of every id per time the reply generated it (−2..=2).
    pub frequency_penalty: f32,
    /// Send each id's log-probability and this many of the most likely ids with theirs
    /// ([`FromWorker::Scored`] instead of `Token`; at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<u8>,
}

/// Most alternatives [`Shape::logprobs`] asks for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// v2. A grammar for the whole reply after the generation prompt (the worker compiles it over
/// its vocabulary with llguidance).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Grammar {
    /// A JSON object in the response channel.
    JsonObject,
    /// JSON matching a schema in the response channel.
    JsonSchema {
        /// The schema as JSON text.
        schema: String,
        /// Refuse a schema keyword the grammar cannot enforce (else it is skipped).
        strict: bool,
    },
    /// A `tools` element of well-formed calls to these tools.
    ToolCall {
        /// The tools that may be called.
        tools: Vec<ToolGrammar>,
        /// More than one call.
        parallel: bool,
    },
}

/// v2. One tool a [`Grammar::ToolCall`] may call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolGrammar {
    /// Its name.
    pub name: String,
    /// Its arguments' JSON schema as JSON text (`None`: any object).
    pub parameters: Option<String>,
    /// OpenAI's `strict`.
    pub strict: bool,
}

/// v2. A bound on the think channel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThinkBudget {
    /// Most ids inside the think channel.
    pub tokens: u32,
    /// The ids that close the think channel and open the response, as the chat format renders
    /// them; the channel counts as closed by the model when it generates the first of them.
    pub close: Vec<u32>,
}

/// serve → worker.
// A message built and read once per job: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ToWorker {
    /// v1. Run a job.
    Start(Start),
    /// v1. Stop the job at its next step boundary (answered by `Done` with
    /// [`Finish::Cancelled`]).
    Cancel {
        /// The request.
        req_id: ReqId,
    },
}

/// Why a job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finish {
    /// `max_new` ids were generated.
    Length,
    /// The model generated this end id (the last id sent).
    EndId(u32),
    /// serve cancelled it (or the channel closed).
    Cancelled,
}

/// The job's counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt ids.
    pub prompt_ids: u32,
    /// Prompt ids a kept session already held (not prefilled again).
    pub cached_ids: u32,
    /// Ids generated (those sent as `Token`).
    pub generated: u32,
}

/// Where the job's time went, and what it read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Seconds of the prefill (including the first pick).
    pub prefill_seconds: f64,
    /// Seconds of the decode steps (after the first id).
    pub decode_seconds: f64,
    /// Weight bytes read for this job (trunk and experts).
    pub bytes_read: u64,
    /// Routed experts requested.
    pub expert_requests: u64,
    /// Of those, already resident (TRUE resident hits).
    pub resident_hits: u64,
    /// Bytes of the session kept at the end (`None`: none kept).
    pub kept_session_bytes: Option<u64>,
}

/// What kind of failure ended a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// Refused before any work: a bad job, a state that does not fit in memory (exit 2).
    Refused,
    /// Cannot attach to the store (exit 3).
    NoStore,
    /// The forward pass, a bind or an I/O failed after work started (exit 1).
    Failed,
    /// A routed expert failed to load: the ids sent are unsound (exit 4).
    ExpertLoad,
    /// The channel broke its protocol (an undecodable frame, another version; exit 2).
    Protocol,
    /// v2. A value of the job outside what [`Sampling::validate`] (and the checks beside it)
    /// allow: the client's fault, never a server's (exit 2, the job alone; serve answers 400).
    Invalid,
}

impl ErrorKind {
    /// The kind of a failure that ends a process with exit code `code` (`crate::exit`).
    pub fn of_exit_code(code: i32) -> ErrorKind {
        match code {
            crate::exit::REFUSED => ErrorKind::Refused,
            crate::exit::NO_STORE => ErrorKind::NoStore,
            crate::exit::EXPERT_LOAD_FAILED => ErrorKind::ExpertLoad,
            _ => ErrorKind::Failed,
        }
    }
}

/// worker → serve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FromWorker {
    /// v1. The first message: the worker's protocol version and process id.
    Hello {
        /// [`JOB_PROTOCOL_VERSION`] of the worker.
        protocol_version: u32,
        /// Its process id.
        pid: u32,
    },
    /// v1. The prompt is in the state (sent before the first `Token`, or before `Done` when
    /// the job was cancelled during the prefill).
    Prefilled {
        /// The request.
        req_id: ReqId,
        /// Prompt ids a kept session already held.
        cached_ids: u32,
        /// Prompt ids the state holds now (all but the last one when the state was kept for a
        /// retry: the last is run with the first pick).
        held_ids: u32,
        /// Bytes of the session kept after the prefill (`None`: not kept).
        kept_bytes: Option<u64>,
    },
    /// v1. One generated id.
    Token {
        /// The request.
        req_id: ReqId,
        /// v3. The choice (0 when the job asked one).
        choice: u32,
        /// The id.
        id: u32,
    },
    /// v1. One choice of the job ended normally (or was cancelled); the job ends with the
    /// `Done` of its last choice.
    Done {
        /// The request.
        req_id: ReqId,
        /// v3. The choice.
        choice: u32,
        /// Why.
        finish: Finish,
        /// Counts.
        usage: Usage,
        /// Time and bytes.
        timings: Timings,
    },
    /// v2. One generated id with its log-probability and the most likely ids of its step (a
    /// job whose [`Shape::logprobs`] asked for them; sent instead of `Token`).
    Scored {
        /// The request.
        req_id: ReqId,
        /// v3. The choice.
        choice: u32,
        /// The id.
        id: u32,
        /// Its natural log-probability under the shaped logits at temperature 1.
        logprob: f32,
        /// The most likely ids and their log-probabilities, most likely first.
        top: Vec<(u32, f32)>,
    },
    /// v1. The job failed; the worker exits with `exit_class`.
    Error {
        /// The request (`None`: before any job started).
        req_id: Option<ReqId>,
        /// What kind of failure.
        kind: ErrorKind,
        /// The worker's exit code (`k3_proto::exit`).
        exit_class: i32,
        /// For people.
        message: String,
    },
}

/// `k3-ctl ps` → serve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ServeQuery {
    /// v1. The requests serve holds: answered [`ServeAnswer::List`].
    List {
        /// The asker's [`JOB_PROTOCOL_VERSION`].
        protocol_version: u32,
    },
}

/// Where a request is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RequestState {
    /// Waiting for a job slot; 1 = next.
    Queued {
        /// Place in the queue.
        position: u32,
    },
    /// A worker runs it.
    Running {
        /// The worker's process id (0 while it starts).
        worker_pid: u32,
    },
}

/// One request serve holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestInfo {
    /// The request id (the `X-Request-Id` header).
    pub request_id: String,
    /// The route (`/v1/chat/completions`, …).
    pub route: String,
    /// Queued or running.
    pub state: RequestState,
    /// Prompt ids.
    pub prompt_ids: u32,
    /// Most ids to generate.
    pub max_new: u32,
    /// Ids generated so far.
    pub generated: u32,
    /// Seconds since the request arrived.
    pub age_seconds: f64,
}

/// A server and its requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServeListing {
    /// serve's process id.
    pub pid: u32,
    /// The HTTP address it listens on.
    pub listen: String,
    /// Jobs that run at once (`--max-jobs`).
    pub max_jobs: u32,
    /// Queue places (`--queue`).
    pub queue: u32,
    /// Its requests, running first, then queued in order.
    pub requests: Vec<RequestInfo>,
}

/// serve → `k3-ctl ps`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ServeAnswer {
    /// v1. The listing.
    List(ServeListing),
    /// v1. The asker speaks another version.
    Refused {
        /// serve's version.
        serve_version: u32,
        /// The reason, naming both versions.
        reason: String,
    },
}

/// The file name of serve `pid`'s listing socket in the store's socket directory.
pub fn listing_socket_name(pid: u32) -> String {
    format!("serve-{pid}.sock")
}

/// True for a file name [`listing_socket_name`] makes.
pub fn is_listing_socket_name(name: &str) -> bool {
    name.strip_prefix("serve-")
        .and_then(|r| r.strip_suffix(".sock"))
        .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{encode, read_frame_limited};

    #[test]
    fn job_messages_round_trip_in_frames() {
        let to = vec![
            ToWorker::Start(Start {
                req_id: 7,
                ids: (0..32_768).map(|i| 163_000 + i % 800).collect(),
                max_new: 4096,
                sampling: Sampling {
                    temperature: 0.6,
                    top_p: 0.95,
                    seed: u64::MAX,
                },
                session: Some("http-00".into()),
                resume: Some("prefix-00".into()),
                keep_at: vec![30_000],
                name_key: vec![7; 32],
                shape: Shape {
                    thinking: true,
                    grammar: Some(Grammar::ToolCall {
                        tools: vec![ToolGrammar {
                            name: "get_weather".into(),
                            parameters: Some(r#"{"type":"object"}"#.into()),
                            strict: true,
                        }],
                        parallel: false,
                    }),
                    think_budget: Some(ThinkBudget {
                        tokens: 64,
                        close: vec![163_587, 1, 163_589],
                    }),
                    logit_bias: vec![(5, -100.0)],
                    presence_penalty: 0.5,
                    frequency_penalty: -0.25,
                    logprobs: Some(5),
                },
                n: 3,
            }),
            ToWorker::Cancel { req_id: 7 },
        ];
        let from = vec![
            FromWorker::Hello {
                protocol_version: JOB_PROTOCOL_VERSION,
                pid: 9,
            },
            FromWorker::Token {
                req_id: 7,
                choice: 2,
                id: 5,
            },
            FromWorker::Scored {
                req_id: 7,
                choice: 1,
                id: 5,
                logprob: -0.5,
                top: vec![(5, -0.5), (9, -1.25)],
            },
            FromWorker::Done {
                req_id: 7,
                choice: 0,
                finish: Finish::EndId(163_586),
                usage: Usage {
                    prompt_ids: 3,
                    cached_ids: 2,
                    generated: 1,
                },
                timings: Timings::default(),
            },
            FromWorker::Error {
                req_id: None,
                kind: ErrorKind::NoStore,
                exit_class: crate::exit::NO_STORE,
                message: "no store".into(),
            },
        ];
        let mut buf = Vec::new();
        for m in &to {
            let f = encode(m).unwrap();
            assert!(f.len() < MAX_JOB_FRAME as usize);
            buf.extend(f);
        }
        let mut r = &buf[..];
        for m in &to {
            assert_eq!(
                &read_frame_limited::<ToWorker, _>(&mut r, MAX_JOB_FRAME).unwrap(),
                m
            );
        }
        let mut buf = Vec::new();
        for m in &from {
            buf.extend(encode(m).unwrap());
        }
        let mut r = &buf[..];
        for m in &from {
            assert_eq!(
                &read_frame_limited::<FromWorker, _>(&mut r, MAX_JOB_FRAME).unwrap(),
                m
            );
        }
    }

    #[test]
    fn request_values_are_refused_where_single_precision_changes_them() {
        let ok = Sampling::from_request(0.7, 0.95, 1).unwrap();
        assert_eq!((ok.temperature, ok.top_p), (0.7, 0.95));
        assert!(Sampling::from_request(0.0, 1.0, 1).is_ok(), "greedy");
        // 1e-300 is a valid f64 in range, but 0 in f32: a top_p of 0, or a temperature that
        // silently means greedy.
        for (t, p, field) in [
            (1.0, 1e-300, "top_p"),
            (1e-300, 1.0, "temperature"),
            (1.0, 1e-40, "top_p"), // subnormal in f32
            (1e-39, 1.0, "temperature"),
            (1.0, f64::NAN, "top_p"),
            (f64::INFINITY, 1.0, "temperature"),
            (2.5, 1.0, "temperature"),
            (-0.5, 1.0, "temperature"),
            (1.0, 0.0, "top_p"),
            (1.0, 1.5, "top_p"),
        ] {
            let e = Sampling::from_request(t, p, 1).unwrap_err();
            assert_eq!(e.field(), field, "{t} {p}: {e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        // What arrives at the worker is checked alike.
        for (t, p) in [
            (0.5, 0.0),
            (0.5, f32::NAN),
            (1e-40, 0.5),
            (3.0, 0.5),
            (0.5, 1e-40),
        ] {
            let s = Sampling {
                temperature: t,
                top_p: p,
                seed: 0,
            };
            assert!(s.validate().is_err(), "{t} {p}");
        }
        assert_eq!(single("x", 0.0), Ok(0.0));
        assert!(matches!(
            single("x", 1e39),
            Err(ValueError::Precision { field: "x", .. })
        ));
    }

    #[test]
    fn listing_socket_names() {
        assert_eq!(listing_socket_name(42), "serve-42.sock");
        assert!(is_listing_socket_name("serve-42.sock"));
        for bad in [
            "serve-.sock",
            "serve-4x.sock",
            "store.sock",
            "serve-42.sock.tmp",
        ] {
            assert!(!is_listing_socket_name(bad), "{bad}");
        }
    }
}
