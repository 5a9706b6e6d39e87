//! `k3-worker --chat`: multi-turn chat in the XTML format ([`crate::text::xtml`]) on the one
//! engine. A [`Conversation`] carries its sequence from turn to turn (the state, the sampler,
//! the drafter and auto mode's estimates): a turn is one request whose prompt is the whole
//! rendered conversation, started from the state the last turn left, so the engine prefills
//! only the ids after those the state holds — when they are a strict prefix of the conversation;
//! otherwise it prefills everything again. [`run_repl`] is the line-by-line loop; [`run`] the
//! job (sessions in the store, `--out`).

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use k3_store::attach::AttachedSource;

use crate::engine::outputs::{Ended, Flow};
use crate::engine::request::{Held, Request, RequestError, Speculation};
use crate::engine::runner::{Engine, EngineError};
use crate::engine::sampling::{positions_needed, Sampler};
use crate::engine::session;
use crate::engine::shaping::{Shaping, ThinkBudget};
use crate::front::cli::Cli;
use crate::front::error::{refuse, JobError};
use crate::front::job::{job_shape, preflight, prepare, Prepared};
use crate::front::report;
use crate::model::{ModelError, SeqState};
use crate::text::visible;
use crate::text::xtml::{Channel, ChatFormat, Effort, Message, Reply, ReplyParser};
use crate::tokenizer::Tokenizer;

/// Why a turn did not run.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The turn would overflow the context; the conversation is unchanged.
    #[error("turn refused: the conversation is {conversation} tokens and up to {max_new} more may be generated, which exceeds the context of {capacity} positions (raise --ctx or start a new session)")]
    Overflow {
        /// Ids of the rendered conversation with the generation prompt.
        conversation: usize,
        /// Requested generation limit.
        max_new: usize,
        /// The context.
        capacity: usize,
    },
    /// The forward pass failed (the next turn starts afresh).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The engine refused the turn's request.
    #[error(transparent)]
    Request(#[from] RequestError),
}

/// Per-turn settings.
#[derive(Clone, Debug)]
pub struct TurnOptions {
    /// Most ids generated in a turn (≥ 1).
    pub max_new: usize,
    /// Most ids of a reply's think channel (thinking on): when they are spent the reply's
    /// think channel is closed for it and it answers.
    pub think_budget: Option<usize>,
}

/// What one turn did.
#[derive(Clone, Debug)]
pub struct TurnReport {
    /// The parsed reply.
    pub reply: Reply,
    /// Ids of the rendered conversation (with the generation prompt).
    pub conversation_len: usize,
    /// Ids reused from the state (0 on the first turn or a restart).
    pub reused: usize,
    /// Ids prefilled this turn.
    pub prefilled: usize,
    /// True when the state held ids that did not prefix the conversation (re-prefilled).
    pub restarted: bool,
    /// Seconds of the prefill forward(s) plus the first pick.
    pub prefill_seconds: f64,
    /// Seconds of each later decode step.
    pub decode_seconds: Vec<f64>,
}

impl TurnReport {
    /// Mean seconds per generated id after the first (None when only one was generated).
    pub fn seconds_per_token(&self) -> Option<f64> {
        let d = &self.decode_seconds;
        (!d.is_empty()).then(|| d.iter().sum::<f64>() / d.len() as f64)
    }
}

/// A conversation: the history and what its sequence carries from one turn to the next.
#[derive(Debug)]
pub struct Conversation {
    /// The messages so far (the thinking-effort system message is implicit).
    pub history: Vec<Message>,
    held: Option<Held>,
    sampler: Sampler,
    spec: Speculation,
    capacity: usize,
}

impl Conversation {
    /// An empty conversation of at most `capacity` positions.
    pub fn new(capacity: usize, sampler: Sampler, spec: Speculation) -> Conversation {
        Conversation {
            history: Vec::new(),
            held: None,
            sampler,
            spec,
            capacity,
        }
    }

    /// A conversation resumed from a kept session: its history and its state.
    pub fn resumed(
        history: Vec<Message>,
        held: Held,
        capacity: usize,
        sampler: Sampler,
        spec: Speculation,
    ) -> Conversation {
        Conversation {
            history,
            held: Some(held),
            ..Conversation::new(capacity, sampler, spec)
        }
    }

    /// The ids the state holds.
    pub fn held(&self) -> &[u32] {
        self.held.as_ref().map_or(&[], |h| &h.ids[..])
    }

    /// The state (to keep it as a session; `None` before the first turn or after a failure).
    pub fn state(&self) -> Option<&SeqState> {
        self.held.as_ref().map(|h| &h.state)
    }

    /// Positions the conversation may take.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// One turn: append `user`, run the rendered conversation as one request from the state the
    /// last turn left (the engine prefills what the state lacks), generate up to `max_new` ids,
    /// append the reply to the history. `on_id` sees each generated id with its channel;
    /// [`Flow::Stop`] ends the reply after that id (it is kept as it is, like a reply cut by
    /// `max_new`).
    pub fn turn(
        &mut self,
        engine: &mut Engine<'_>,
        fmt: &ChatFormat<'_>,
        user: &str,
        opts: &TurnOptions,
        on_id: &mut dyn FnMut(Channel, u32) -> Flow,
    ) -> Result<TurnReport, TurnError> {
        self.history.push(Message::user(user));
        let conversation = fmt.render(&self.history, true);
        if opts.max_new == 0 || positions_needed(conversation.len(), opts.max_new) > self.capacity {
            self.history.pop();
            return Err(TurnError::Overflow {
                conversation: conversation.len(),
                max_new: opts.max_new,
                capacity: self.capacity,
            });
        }
        let n = conversation.len();
        let think = (opts.think_budget)
            .filter(|_| fmt.thinking.is_some())
            .map(|tokens| ThinkBudget {
                tokens,
                close: fmt.think_close(),
            });
        let req = Request {
            shaping: Shaping {
                think,
                ..Shaping::default()
            },
            spec: std::mem::replace(&mut self.spec, Speculation::off()),
            from: self.held.take(),
            reserve: self.capacity,
            hand_back: true,
            ..Request::new(conversation, opts.max_new, self.sampler.clone())
        };
        let mut parser = fmt.parser();
        let tok = fmt.tokenizer();
        let result = run_turn(engine, req, &mut parser, tok, on_id);
        let ended = match result {
            Ok(e) => e,
            Err(e) => {
                // The state is unusable after a failed forward: the next turn starts afresh.
                self.history.pop();
                return Err(e);
            }
        };
        let fin = &ended.finished;
        self.held = ended.held;
        self.sampler = ended.sampler;
        self.spec = ended.spec;
        let reply = parser.finish(tok);
        self.history.push(Message::from_reply(&reply));
        let reused = fin.usage.cached_ids as usize;
        Ok(TurnReport {
            reply,
            conversation_len: n,
            reused,
            prefilled: n - reused,
            restarted: fin.restarted,
            prefill_seconds: fin.report.prefill_seconds(),
            decode_seconds: fin.report.steps.iter().skip(1).map(|s| s.seconds).collect(),
        })
    }
}

/// Run one turn's request to its end, each id through the parser to `on_id`: the reply ends
/// at the end of the message or when `on_id` says so. What it handed back.
fn run_turn(
    engine: &mut Engine<'_>,
    req: Request,
    parser: &mut ReplyParser,
    tok: &Tokenizer,
    on_id: &mut dyn FnMut(Channel, u32) -> Flow,
) -> Result<Ended, TurnError> {
    let ended = engine.run_one(req, &mut |s| {
        let channel = parser.push(tok, s.token);
        let asked = on_id(channel, s.token);
        if parser.done() || asked == Flow::Stop {
            Flow::Stop
        } else {
            Flow::Continue
        }
    });
    ended.map_err(|e| match e {
        EngineError::Model(m) => TurnError::Model(m),
        EngineError::Request(r) => TurnError::Request(r),
    })
}

/// Longest user line accepted, in bytes.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// One line of input.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// The line without its terminator.
    Text(Vec<u8>),
    /// The line exceeded the limit (the rest of it was discarded).
    TooLong,
}

/// Read one `\n`-terminated line of at most `limit` bytes (`None` at end of input).
pub fn read_line_bounded(input: &mut dyn BufRead, limit: usize) -> std::io::Result<Option<Line>> {
    let mut line = Vec::new();
    let mut too_long = false;
    let mut any = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            break;
        }
        any = true;
        let (take, end) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (buf.len(), false),
        };
        if !too_long {
            if line.len() + take > limit {
                too_long = true;
                line = Vec::new();
            } else {
                line.extend_from_slice(&buf[..take]);
            }
        }
        input.consume(take + usize::from(end));
        if end {
            break;
        }
    }
    if !any {
        return Ok(None);
    }
    if too_long {
        return Ok(Some(Line::TooLong));
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(Some(Line::Text(line)))
}

/// Where the chat loop's lines come from, and its Ctrl-C.
///
/// [`ReplInput::stdin_with_ctrl_c`] reads stdin on a thread of its own and catches SIGINT into a
/// flag, so that a Ctrl-C is seen both while a reply is written (the loop stops that reply at
/// its next token) and while the loop waits for a line (a blocking read would not return for
/// it). [`ReplInput::reader`] reads a `BufRead` in place and knows no Ctrl-C.
pub struct ReplInput<'a> {
    src: InputSrc<'a>,
    interrupted: Option<Arc<AtomicBool>>,
}

enum InputSrc<'a> {
    Reader(&'a mut dyn BufRead),
    Thread(std::sync::mpsc::Receiver<std::io::Result<Option<Line>>>),
}

/// What [`ReplInput::read`] got.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// A line.
    Line(Line),
    /// End of input.
    End,
    /// Ctrl-C while waiting for a line.
    Interrupt,
}

/// How often a wait for a line looks at the Ctrl-C flag.
const INTERRUPT_POLL: std::time::Duration = std::time::Duration::from_millis(50);

impl<'a> ReplInput<'a> {
    /// Lines from `r`; no Ctrl-C handling.
    pub fn reader(r: &'a mut dyn BufRead) -> ReplInput<'a> {
        ReplInput {
            src: InputSrc::Reader(r),
            interrupted: None,
        }
    }

    /// Lines from `rx` (sent by a reader thread) and Ctrl-C from `interrupted` (set by a
    /// signal handler or a test).
    pub fn channel(
        rx: std::sync::mpsc::Receiver<std::io::Result<Option<Line>>>,
        interrupted: Arc<AtomicBool>,
    ) -> ReplInput<'static> {
        ReplInput {
            src: InputSrc::Thread(rx),
            interrupted: Some(interrupted),
        }
    }

    /// Stdin, read on a thread, with SIGINT caught (from now on, for the rest of the process)
    /// as the loop's Ctrl-C.
    pub fn stdin_with_ctrl_c() -> std::io::Result<ReplInput<'static>> {
        let interrupted = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGINT, interrupted.clone())?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("chat-stdin".into())
            .spawn(move || {
                let stdin = std::io::stdin();
                let mut lock = stdin.lock();
                loop {
                    let r = read_line_bounded(&mut lock, MAX_LINE_BYTES);
                    let more = matches!(r, Ok(Some(_)));
                    if tx.send(r).is_err() || !more {
                        break;
                    }
                }
            })?;
        Ok(ReplInput::channel(rx, interrupted))
    }

    /// Whether Ctrl-C was pressed since the last look (clears it).
    pub fn take_interrupt(&self) -> bool {
        (self.interrupted.as_ref()).is_some_and(|f| f.swap(false, Ordering::SeqCst))
    }

    /// The next line, end of input, or a Ctrl-C that came first.
    pub fn read(&mut self) -> std::io::Result<Next> {
        let rx = match &mut self.src {
            InputSrc::Reader(r) => {
                return Ok(read_line_bounded(*r, MAX_LINE_BYTES)?.map_or(Next::End, Next::Line))
            }
            InputSrc::Thread(rx) => rx,
        };
        loop {
            if (self.interrupted.as_ref()).is_some_and(|f| f.swap(false, Ordering::SeqCst)) {
                return Ok(Next::Interrupt);
            }
            match rx.recv_timeout(INTERRUPT_POLL) {
                Ok(r) => return Ok(r?.map_or(Next::End, Next::Line)),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(Next::End),
            }
        }
    }
}

/// What the chat loop prints at the first Ctrl-C at its prompt.
pub const CTRL_C_HINT: &str = "(Ctrl-C again to leave; or type a message)";

/// Settings of the line-by-line loop.
#[derive(Clone, Debug)]
pub struct ReplOptions {
    /// Per-turn settings.
    pub turn: TurnOptions,
    /// Show a `> ` prompt (stdin is a terminal): on `out`, where the replies are read, when
    /// `prompt_on_out`, else on `err`.
    pub prompt: bool,
    /// Write the prompt to `out` (stdout is a terminal) rather than to `err`.
    pub prompt_on_out: bool,
    /// Dim the think text with ANSI escapes (stderr is a terminal); otherwise it is prefixed.
    pub dim_think: bool,
}

/// One turn that ran, for `--out`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TurnRecord {
    /// The rendered conversation's ids (with the generation prompt).
    pub conversation_ids: Vec<u32>,
    /// Ids reused from the state.
    pub reused: usize,
    /// Ids prefilled this turn.
    pub prefilled: usize,
    /// True when the state did not match and the whole conversation was prefilled.
    pub restarted: bool,
    /// The reply's ids (including a final end id).
    pub generated_ids: Vec<u32>,
    /// Seconds of the prefill and the first pick.
    pub prefill_seconds: f64,
}

/// What a whole chat did.
#[derive(Clone, Debug, Default)]
pub struct ReplSummary {
    /// Turns that ran.
    pub turns: usize,
    /// Turns refused (overflow, bad input).
    pub refused: usize,
    /// Every turn that ran.
    pub records: Vec<TurnRecord>,
}

/// Why the chat loop stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ReplError {
    /// The forward pass failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Reading stdin or writing the reply failed.
    #[error("chat I/O")]
    Io(#[from] std::io::Error),
}

/// The chat loop's streams and settings.
pub struct Repl<'a, 'i> {
    /// Where the lines come from.
    pub input: &'a mut ReplInput<'i>,
    /// The response channel.
    pub out: &'a mut dyn Write,
    /// The think channel and the per-turn report.
    pub err: &'a mut dyn Write,
    /// Settings.
    pub opts: &'a ReplOptions,
}

/// Read user turns until end of input; the response goes to `out`, the think text and the
/// per-turn report to `err`; `after_turn` sees the conversation after each turn that ran (to
/// keep it in the store). Returns on end of input, on a second Ctrl-C at the prompt (the first
/// prints [`CTRL_C_HINT`]), or on a forward/I/O failure. A Ctrl-C while a reply is written
/// stops that reply at its next token; the partial reply stays in the conversation (as a reply
/// cut by `--gen` does) and the loop reads the next turn.
pub fn run_repl(
    engine: &mut Engine<'_>,
    fmt: &ChatFormat<'_>,
    conv: &mut Conversation,
    io: Repl<'_, '_>,
    after_turn: &mut dyn FnMut(&Conversation, &mut dyn Write),
) -> Result<ReplSummary, ReplError> {
    let mut summary = ReplSummary::default();
    let Repl {
        input,
        out,
        err,
        opts,
    } = io;
    // A first Ctrl-C at the prompt arms this; a second one leaves; a line disarms it.
    let mut leaving = false;
    loop {
        let text = match next_line(input, out, err, opts, &mut leaving)? {
            Turn::Leave => break,
            Turn::Refused => {
                summary.refused += 1;
                continue;
            }
            Turn::Skip => continue,
            Turn::Text(t) => t,
        };
        // A Ctrl-C pressed before this turn (while typing it) is not for this reply.
        input.take_interrupt();
        let mut w = ReplyWriter {
            tok: fmt.tokenizer(),
            out: &mut *out,
            err: &mut *err,
            dim_think: opts.dim_think,
            last: Channel::Structure,
            io_err: None,
            interrupted: false,
        };
        let r = conv.turn(engine, fmt, &text, &opts.turn, &mut |ch, id| {
            w.write(ch, id);
            if input.take_interrupt() {
                w.interrupted = true;
                Flow::Stop
            } else {
                Flow::Continue
            }
        });
        match r {
            Ok(r) => {
                w.end()?;
                summary.turns += 1;
                report_turn(w.err, &summary, &r, w.interrupted, conv);
                summary.records.push(TurnRecord {
                    conversation_ids: conv.held()[..r.conversation_len.min(conv.held().len())]
                        .to_vec(),
                    reused: r.reused,
                    prefilled: r.prefilled,
                    restarted: r.restarted,
                    generated_ids: r.reply.ids.clone(),
                    prefill_seconds: r.prefill_seconds,
                });
                after_turn(conv, w.err);
            }
            Err(e @ TurnError::Overflow { .. }) => {
                let _ = writeln!(err, "{e}");
                summary.refused += 1;
            }
            Err(TurnError::Model(e)) => return Err(ReplError::Model(e)),
            Err(e @ TurnError::Request(_)) => {
                let _ = writeln!(err, "turn refused: {e}");
                summary.refused += 1;
            }
        }
    }
    Ok(summary)
}

/// What the next line asks for.
enum Turn {
    /// End of input, or a second Ctrl-C.
    Leave,
    /// A line that cannot be a turn (said on stderr).
    Refused,
    /// An empty line, or a first Ctrl-C.
    Skip,
    /// A user turn.
    Text(String),
}

/// Prompt (on a terminal) and read the next line.
fn next_line(
    input: &mut ReplInput<'_>,
    out: &mut dyn Write,
    err: &mut dyn Write,
    opts: &ReplOptions,
    leaving: &mut bool,
) -> Result<Turn, ReplError> {
    if opts.prompt {
        let w: &mut dyn Write = if opts.prompt_on_out { out } else { &mut *err };
        let _ = write!(w, "> ");
        let _ = w.flush();
    }
    let line = match input.read()? {
        Next::End => {
            if opts.prompt {
                let _ = writeln!(err);
            }
            return Ok(Turn::Leave);
        }
        Next::Interrupt if *leaving => {
            let _ = writeln!(err);
            return Ok(Turn::Leave);
        }
        Next::Interrupt => {
            *leaving = true;
            let _ = writeln!(err, "\n{CTRL_C_HINT}");
            return Ok(Turn::Skip);
        }
        Next::Line(l) => {
            *leaving = false;
            l
        }
    };
    let line = match line {
        Line::TooLong => {
            let _ = writeln!(err, "turn refused: the line exceeds {MAX_LINE_BYTES} bytes");
            return Ok(Turn::Refused);
        }
        Line::Text(l) => l,
    };
    match String::from_utf8(line) {
        Ok(t) if t.trim().is_empty() => Ok(Turn::Skip),
        Ok(t) => Ok(Turn::Text(t)),
        Err(e) => {
            let _ = writeln!(
                err,
                "turn refused: the line is not UTF-8 (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            );
            Ok(Turn::Refused)
        }
    }
}

/// Writes a reply as it comes: the response channel to `out`, the think channel to `err`
/// (dimmed, or prefixed once).
struct ReplyWriter<'a> {
    tok: &'a Tokenizer,
    out: &'a mut dyn Write,
    err: &'a mut dyn Write,
    dim_think: bool,
    last: Channel,
    io_err: Option<std::io::Error>,
    interrupted: bool,
}

impl ReplyWriter<'_> {
    fn write(&mut self, ch: Channel, id: u32) {
        let bytes = visible::token_bytes(self.tok, id).unwrap_or(&[]);
        let (out, err) = (&mut *self.out, &mut *self.err);
        let r = match ch {
            Channel::Response => out.write_all(bytes).and_then(|_| out.flush()),
            Channel::Think => {
                let start = self.last != Channel::Think;
                let r = if self.dim_think {
                    err.write_all(b"\x1b[2m")
                        .and_then(|_| err.write_all(bytes))
                        .and_then(|_| err.write_all(b"\x1b[0m"))
                } else if start {
                    err.write_all(b"think: ").and_then(|_| err.write_all(bytes))
                } else {
                    err.write_all(bytes)
                };
                r.and_then(|_| err.flush())
            }
            Channel::Structure => Ok(()),
        };
        if self.last == Channel::Think && ch != Channel::Think {
            let _ = writeln!(err); // the think text ended
        }
        self.last = ch;
        if let (Err(e), None) = (r, &self.io_err) {
            self.io_err = Some(e);
        }
    }

    /// The reply ended: close the lines; a write that failed ends the chat.
    fn end(&mut self) -> Result<(), ReplError> {
        if self.last == Channel::Think {
            let _ = writeln!(self.err);
        }
        writeln!(self.out)?;
        let _ = self.out.flush();
        match self.io_err.take() {
            Some(e) => Err(ReplError::Io(e)),
            None => Ok(()),
        }
    }
}

/// The per-turn report on stderr.
fn report_turn(
    err: &mut dyn Write,
    summary: &ReplSummary,
    r: &TurnReport,
    interrupted: bool,
    conv: &Conversation,
) {
    if interrupted {
        let _ = writeln!(
            err,
            "(reply interrupted by Ctrl-C; the conversation goes on)"
        );
    }
    if r.restarted {
        let _ = writeln!(
            err,
            "state: the rendered conversation does not start with the ids the state held; re-prefilled the whole conversation"
        );
    }
    let n = r.reply.ids.len();
    let _ = writeln!(
        err,
        "turn {}: prefill {} tokens (reused {}) in {:.3} s; generated {} tokens, {}; stop {}; context {}/{}",
        summary.turns,
        r.prefilled,
        r.reused,
        r.prefill_seconds,
        n,
        r.seconds_per_token()
            .map_or("no decode steps".into(), |s| format!("{s:.3} s/token")),
        match r.reply.stopped_on {
            Some(id) => id.to_string(),
            None if interrupted => "Ctrl-C".into(),
            None => "token limit".into(),
        },
        conv.held().len(),
        conv.capacity()
    );
}

/// Tokens of a chat reply when `--gen` is not given (`--gen`'s own default, 8, is a one-shot
/// prompt's).
pub const DEFAULT_CHAT_GEN: usize = 256;

/// A reply's thinking budget: `--think-budget`, else half of its tokens.
fn think_budget(cli: &Cli, gen: usize) -> usize {
    cli.think_budget.map_or((gen / 2).max(1), |b| b as usize)
}

/// The `--chat` job: stdin lines are user turns; exit 0 at end of input. With `--session` the
/// conversation is resumed from the store and kept there after every turn.
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, JobError> {
    let wall = std::time::Instant::now();
    let pre = preflight(cli)?;
    let tok = pre
        .tok
        .as_ref()
        .ok_or_else(|| refuse("--chat needs --tok DIR"))?;
    crate::text::xtml::Markers::from_tokenizer(tok)?;
    let thinking = if cli.no_think {
        None
    } else {
        Some(cli.effort.map_or(Effort::Low, Effort::from))
    };
    // Without --gen a chat reply may be long enough to think and answer.
    let gen = match matches.value_source("gen") {
        Some(clap::parser::ValueSource::DefaultValue) | None => DEFAULT_CHAT_GEN,
        Some(_) => cli.gen as usize,
    };
    let ctx = cli.ctx as usize;
    let shape = job_shape(cli, &pre, 1, ctx, ctx, ctx);
    let job = prepare(cli, matches, pre, shape, wall)?;
    run_chat(cli, &job, thinking, gen)
}

/// The REPL over the prepared job.
fn run_chat(
    cli: &Cli,
    job: &Prepared,
    thinking: Option<Effort>,
    gen: usize,
) -> Result<i32, JobError> {
    use std::io::IsTerminal;
    let drafters = job.drafters(cli)?;
    let tok = (job.pre.tok.as_ref()).ok_or_else(|| refuse("--chat needs --tok DIR"))?;
    let fmt = ChatFormat::new(tok, thinking)?;
    let capacity = job.opened.positions;
    tracing::info!(
        "chat: thinking {}; context {capacity} positions; up to {} tokens per reply; end of input ends the session",
        thinking.map_or("off".to_string(), |e| format!(
            "on (effort {}, at most {} tokens of it per reply)",
            e.as_str(),
            think_budget(cli, gen)
        )),
        gen
    );
    let mut engine = Engine::new(job.model()?, job.shape.engine);
    let store = job.opened.source.store();
    let kept_in = cli.session.as_deref().zip(store);
    let spec = drafters.for_request(0, capacity);
    let sampler = job.pre.sampler.clone();
    let (mut conv, resumed) = match kept_in {
        Some((name, src)) => resume(src, name, &engine, capacity, sampler, spec),
        None => (Conversation::new(capacity, sampler, spec), None),
    };
    let mut after_turn = |c: &Conversation, err: &mut dyn Write| {
        if let Some((name, src)) = kept_in {
            keep(src, name, c, err);
        }
    };
    let opts = ReplOptions {
        turn: TurnOptions {
            max_new: gen,
            think_budget: thinking.map(|_| think_budget(cli, gen)),
        },
        prompt: std::io::stdin().is_terminal(),
        prompt_on_out: std::io::stdout().is_terminal(),
        dim_think: std::io::stderr().is_terminal(),
    };
    // Ctrl-C: see `ReplInput::stdin_with_ctrl_c` (stops a reply; twice at the prompt leaves).
    let mut input = ReplInput::stdin_with_ctrl_c().map_err(|source| JobError::Output {
        path: "<stdin>".into(),
        source,
        before_work: true,
    })?;
    let io = Repl {
        input: &mut input,
        out: &mut std::io::stdout(),
        err: &mut std::io::stderr(),
        opts: &opts,
    };
    let summary =
        run_repl(&mut engine, &fmt, &mut conv, io, &mut after_turn).map_err(|e| match e {
            ReplError::Model(m) => JobError::Model(m),
            ReplError::Io(source) => JobError::Output {
                path: "<stdio>".into(),
                source,
                before_work: false,
            },
        })?;
    eprintln!(
        "chat: {} turns ({} refused); PEAK RSS for the whole run: {}",
        summary.turns,
        summary.refused,
        k3_store::runtime::plan::fmt_bytes(report::peak_rss_bytes())
    );
    if let Some(path) = &cli.out {
        let v = serde_json::json!({
            "mode": "chat",
            "session": cli.session,
            "resumed_positions": resumed,
            "turns": summary.records,
            "refused": summary.refused,
            "peak_rss_bytes": report::peak_rss_bytes(),
            "memory_plan_bytes": job.opened.plan_bytes,
            "trunk": report::trunk_json(&engine.model().source().trunk()),
        });
        report::written(report::write_json(path, &v))?;
    }
    Ok(report::expert_failures(&engine.model().counters))
}

/// The conversation kept as session `name`, or a new one; says which.
fn resume(
    src: &AttachedSource,
    name: &str,
    engine: &Engine<'_>,
    capacity: usize,
    sampler: Sampler,
    spec: Speculation,
) -> (Conversation, Option<usize>) {
    match session::fetch(src, name, &engine.model().dims, capacity) {
        Ok(Some(r)) => {
            let (n, m) = (r.held.len(), r.meta.history.len());
            tracing::info!(
                "session {name}: resumed {n} positions and {m} messages ({:.3} MB)",
                r.bytes as f64 / 1e6
            );
            let history = r.meta.history.clone();
            let conv = Conversation::resumed(history, r.into_held(), capacity, sampler, spec);
            (conv, Some(n))
        }
        Ok(None) => {
            tracing::info!("session {name}: new (the store has none of that name)");
            (Conversation::new(capacity, sampler, spec), None)
        }
        Err(e) => {
            tracing::warn!("session {name}: not resumed ({e}); starting afresh");
            (Conversation::new(capacity, sampler, spec), None)
        }
    }
}

/// Hand the conversation (its state and history) to the store as session `name`, saying so on
/// `err` (the chat's own report).
fn keep(src: &AttachedSource, name: &str, c: &Conversation, err: &mut dyn Write) {
    let Some(state) = c.state() else {
        let _ = writeln!(
            err,
            "session {name}: NOT kept (the state is unusable after a failed forward)"
        );
        return;
    };
    let meta = session::Meta {
        history: c.history.clone(),
    };
    match session::keep(src, name, c.held(), state, &meta) {
        Ok(k) => {
            let _ = writeln!(err, "{}", k.line(name, c.held().len()));
        }
        Err(e) => {
            let _ = writeln!(err, "session {name}: NOT kept: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Ctrl-C is reported before a line already queued, once (the flag is cleared), and a
    /// closed reader is the end of input.
    #[test]
    fn repl_input_reports_ctrl_c_first_then_lines_then_the_end() {
        let (tx, rx) = std::sync::mpsc::channel();
        let flag = Arc::new(AtomicBool::new(false));
        let mut input = ReplInput::channel(rx, flag.clone());
        tx.send(Ok(Some(Line::Text(b"hi".to_vec())))).unwrap();
        flag.store(true, Ordering::SeqCst);
        assert_eq!(input.read().unwrap(), Next::Interrupt);
        assert_eq!(
            input.read().unwrap(),
            Next::Line(Line::Text(b"hi".to_vec()))
        );
        // Waiting for a line: a Ctrl-C arriving meanwhile ends the wait.
        let f = flag.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            f.store(true, Ordering::SeqCst);
        });
        assert_eq!(input.read().unwrap(), Next::Interrupt);
        t.join().unwrap();
        assert!(!input.take_interrupt());
        drop(tx);
        assert_eq!(input.read().unwrap(), Next::End);
        let mut bytes: &[u8] = b"one\n";
        let mut plain = ReplInput::reader(&mut bytes);
        assert_eq!(
            plain.read().unwrap(),
            Next::Line(Line::Text(b"one".to_vec()))
        );
        assert_eq!(plain.read().unwrap(), Next::End);
        assert!(!plain.take_interrupt());
    }
}
