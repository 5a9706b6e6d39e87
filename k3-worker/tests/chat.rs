//! XTML chat (SPEC.md §5.5) on the real Kimi vocabulary (`fixtures/tokenizer/`): rendering,
//! reply parsing, the reuse rule that lets a conversation keep its state between turns, and
//! the `--chat` refusals. The end-to-end test on the `small` checkpoint is `#[ignore]`d (it needs a
//! ~190 MB generated checkpoint); run it with
//!
//! ```text
//! python3 scripts/make-checkpoint.py --preset small --seed 1 /tmp/k3small   # once, ~4 s
//! K3_SMALL=/tmp/k3small cargo test --release -p k3-worker --test worker_suite chat:: -- --ignored --nocapture
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use k3_worker::engine::outputs::Flow;
use k3_worker::engine::request::reusable;
use k3_worker::front::chat::{read_line_bounded, Line};
use k3_worker::text::xtml::{
    effort_body, escape_attr, tag_text, Channel, ChatFormat, Effort, Message, ReplyParser,
};
use k3_worker::tokenizer::Tokenizer;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
        Tokenizer::from_dir(&dir).expect("fixtures/tokenizer loads")
    })
}

// The control ids of SPEC.md §5.3, written out (the renderer looks them up in the tokenizer).
const EOS: u32 = 163_585;
const EOM: u32 = 163_586;
const OPEN: u32 = 163_587;
const CLOSE: u32 = 163_588;
const SEP: u32 = 163_589;

/// The §5.5 effort body, written out independently of the library.
const BODY_MAX: &str = "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.";

/// An expected id sequence built from the §5.5 rules: markers as ids, every text segment
/// encoded on its own with specials disabled.
#[derive(Default)]
struct Expect(Vec<u32>);

impl Expect {
    fn m(&mut self, id: u32) -> &mut Self {
        self.0.push(id);
        self
    }
    fn t(&mut self, s: &str) -> &mut Self {
        self.0.extend(tok().encode(s));
        self
    }
    fn open(&mut self, tag: &str) -> &mut Self {
        self.m(OPEN).t(tag).m(SEP)
    }
    fn close(&mut self, tag: &str) -> &mut Self {
        self.m(CLOSE).t(tag).m(SEP)
    }
}

fn two_turn_history() -> Vec<Message> {
    vec![
        Message::user("Hi"),
        Message::assistant("Hello!", Some("The user greets me.".into())),
        Message::user("And now?"),
    ]
}

#[test]
fn markers_are_the_release_ids() {
    let f = ChatFormat::new(tok(), Some(Effort::Max)).unwrap();
    assert_eq!(
        (
            f.markers.open,
            f.markers.close,
            f.markers.sep,
            f.markers.end_of_msg
        ),
        (OPEN, CLOSE, SEP, EOM)
    );
}

#[test]
fn two_turn_example_thinking_on_matches_the_spec() {
    let f = ChatFormat::new(tok(), Some(Effort::Max)).unwrap();
    let got = f.render(&two_turn_history(), true);
    let mut e = Expect::default();
    e.open(r#"message role="system" type="thinking-effort""#)
        .t(BODY_MAX)
        .close("message")
        .m(EOM);
    e.open(r#"message role="user""#)
        .t("Hi")
        .close("message")
        .m(EOM);
    e.open(r#"message role="assistant""#)
        .open("think")
        .t("The user greets me.")
        .close("think")
        .open("response")
        .t("Hello!")
        .close("response")
        .close("message")
        .m(EOM);
    e.open(r#"message role="user""#)
        .t("And now?")
        .close("message")
        .m(EOM);
    e.open(r#"message role="assistant""#).open("think");
    assert_eq!(got, e.0);

    // The same conversation as the §5.5 text (line breaks removed) decodes byte-exactly.
    let text = [
        "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>",
        BODY_MAX,
        "<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>The user greets me.<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"user\"<|sep|>And now?<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>",
    ]
    .concat();
    assert_eq!(tok().decode(&got).unwrap(), text.as_bytes());
    // Exactly the structural markers are control ids (8 opens, 6 closes, one separator each).
    let count = |id| got.iter().filter(|&&x| x == id).count();
    assert_eq!(count(OPEN), 8);
    assert_eq!(count(CLOSE), 6);
    assert_eq!(count(SEP), 14);
    assert_eq!(count(EOM), 4);
    // The tag text is one segment: `message role="user"` is not split at its spaces into
    // separately encoded words.
    let tag = tok().encode(r#"message role="user""#);
    assert!(got
        .windows(tag.len() + 2)
        .any(|w| w[0] == OPEN && w[1..=tag.len()] == tag[..] && w[tag.len() + 1] == SEP));
}

#[test]
fn thinking_off_omits_the_think_channel_and_the_effort_message() {
    let f = ChatFormat::new(tok(), None).unwrap();
    let got = f.render(&two_turn_history(), true);
    let mut e = Expect::default();
    e.open(r#"message role="user""#)
        .t("Hi")
        .close("message")
        .m(EOM);
    e.open(r#"message role="assistant""#)
        .open("response")
        .t("Hello!")
        .close("response")
        .close("message")
        .m(EOM);
    e.open(r#"message role="user""#)
        .t("And now?")
        .close("message")
        .m(EOM);
    e.open(r#"message role="assistant""#).open("response");
    assert_eq!(got, e.0);
    let text = String::from_utf8(tok().decode(&got).unwrap()).unwrap();
    assert!(!text.contains("think"), "{text}");
    assert!(!text.contains("greets"), "reasoning leaked: {text}");
}

#[test]
fn every_effort_has_the_exact_body() {
    assert_eq!(effort_body(Effort::Max), BODY_MAX);
    for (name, e) in [
        ("low", Effort::Low),
        ("medium", Effort::Medium),
        ("high", Effort::High),
        ("max", Effort::Max),
    ] {
        assert_eq!(Effort::parse(name).unwrap(), e);
        let want = BODY_MAX.replace(
            "`thinking_effort=max`",
            &format!("`thinking_effort={name}`"),
        );
        assert_eq!(effort_body(e), want);
        let f = ChatFormat::new(tok(), Some(e)).unwrap();
        let mut x = Expect::default();
        x.open(r#"message role="system" type="thinking-effort""#)
            .t(&want)
            .close("message")
            .m(EOM);
        assert_eq!(f.render(&[], false), x.0, "{name}");
    }
    assert!(Effort::parse("extreme").is_err());
    assert!(Effort::parse("MAX").is_err());
}

#[test]
fn attribute_values_are_escaped_once() {
    assert_eq!(escape_attr(r#"a"b&c"#), "a&quot;b&amp;c");
    // `&` first: the `&` of `&quot;` is not escaped again.
    assert_eq!(escape_attr("\""), "&quot;");
    assert_eq!(escape_attr("&quot;"), "&amp;quot;");
    assert_eq!(
        tag_text("call", &[("tool", r#"x"y&z"#), ("index", "1")]),
        r#"call tool="x&quot;y&amp;z" index="1""#
    );
    assert_eq!(tag_text("think", &[]), "think");
}

#[test]
fn user_typed_markers_stay_bytes() {
    let f = ChatFormat::new(tok(), None).unwrap();
    let content = "a<|open|>b<|end_of_msg|>c[EOS]";
    let got = f.render(&[Message::user(content)], false);
    let mut e = Expect::default();
    e.open(r#"message role="user""#)
        .t(content)
        .close("message")
        .m(EOM);
    assert_eq!(got, e.0);
    // One OPEN (the structural one) and one EOM; no [EOS] at all.
    assert_eq!(got.iter().filter(|&&x| x == OPEN).count(), 1);
    assert_eq!(got.iter().filter(|&&x| x == EOM).count(), 1);
    assert!(!got.contains(&EOS));
    assert_eq!(
        tok().decode(&got).unwrap(),
        format!(
            "<|open|>message role=\"user\"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>"
        )
        .as_bytes()
    );
}

/// The completion §5.5 expects after the generation prompt (thinking on), ending with `end`.
fn completion(think: &str, answer: &str, end: u32) -> Vec<u32> {
    let mut e = Expect::default();
    e.t(think)
        .close("think")
        .open("response")
        .t(answer)
        .close("response")
        .close("message")
        .m(end);
    e.0
}

fn parse(thinking: bool, ids: &[u32]) -> (ReplyParser, Vec<Channel>) {
    let f = ChatFormat::new(tok(), thinking.then_some(Effort::Max)).unwrap();
    let mut p = f.parser();
    let mut chans = Vec::new();
    for &id in ids {
        chans.push(p.push(tok(), id));
        if p.done() {
            break;
        }
    }
    (p, chans)
}

#[test]
fn replies_split_into_think_and_response_and_stop_on_both_end_ids() {
    for end in [EOM, EOS] {
        let mut ids = completion("Reasoning here.", "The answer is 4.", end);
        ids.extend(tok().encode(" never seen"));
        let (p, chans) = parse(true, &ids);
        let r = p.finish(tok());
        assert_eq!(r.think.as_deref(), Some("Reasoning here."));
        assert_eq!(r.response, "The answer is 4.");
        assert_eq!(r.stopped_on, Some(end));
        assert_eq!(r.ids.last(), Some(&end), "nothing after the end id is kept");
        assert_eq!(r.think_ids, tok().encode("Reasoning here."));
        assert_eq!(r.response_ids, tok().encode("The answer is 4."));
        let n_think = r.think_ids.len();
        assert!(chans[..n_think].iter().all(|&c| c == Channel::Think));
        assert_eq!(chans[n_think], Channel::Structure);
        assert_eq!(
            chans.iter().filter(|&&c| c == Channel::Response).count(),
            r.response_ids.len()
        );
    }
    // Thinking off: the reply starts inside the response channel.
    let mut e = Expect::default();
    e.t("Plain.").close("response").close("message").m(EOM);
    let r = parse(false, &e.0).0.finish(tok());
    assert_eq!((r.think, r.response.as_str()), (None, "Plain."));
    // Cut by the token limit inside the think channel: no stop id, empty response.
    let r = parse(true, &tok().encode("Still thinking")).0.finish(tok());
    assert_eq!(r.stopped_on, None);
    assert_eq!(r.think.as_deref(), Some("Still thinking"));
    assert_eq!(r.response, "");
}

#[test]
fn prefill_plan_reuses_only_a_strict_prefix() {
    assert_eq!(reusable(&[], &[1, 2, 3]), None);
    assert_eq!(reusable(&[1, 2], &[1, 2, 3]), Some(2));
    assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3]), None);
    assert_eq!(reusable(&[1, 9], &[1, 2, 3]), None);
    assert_eq!(reusable(&[1, 2, 3, 4], &[1, 2, 3]), None);
    use k3_worker::engine::sampling::positions_needed;
    assert_eq!(positions_needed(10, 1), 10);
    assert_eq!(positions_needed(10, 8), 17);
}

/// What the state holds after a turn: the prompt plus every generated id but the last.
fn held_after(prompt: &[u32], generated: &[u32]) -> Vec<u32> {
    let mut h = prompt.to_vec();
    h.extend_from_slice(&generated[..generated.len() - 1]);
    h
}

#[test]
fn the_next_turn_extends_what_the_state_holds() {
    for thinking in [true, false] {
        let f = ChatFormat::new(tok(), thinking.then_some(Effort::High)).unwrap();
        let mut history = vec![Message::user("What is 2+2?")];
        let prompt = f.render(&history, true);
        let reply_ids = if thinking {
            completion("Add them.", "4", EOM)
        } else {
            let mut e = Expect::default();
            e.t("4").close("response").close("message").m(EOS);
            e.0
        };
        let (p, _) = parse(thinking, &reply_ids);
        history.push(Message::from_reply(&p.finish(tok())));
        history.push(Message::user("And 3+3?"));
        let next = f.render(&history, true);
        let held = held_after(&prompt, &reply_ids);
        assert_eq!(
            reusable(&held, &next),
            Some(held.len()),
            "thinking {thinking}"
        );
        // The new ids: the end-of-message marker (the end id is never fed), the next user
        // message and the generation prompt.
        let mut e = Expect::default();
        e.m(EOM)
            .open(r#"message role="user""#)
            .t("And 3+3?")
            .close("message")
            .m(EOM)
            .open(r#"message role="assistant""#)
            .open(if thinking { "think" } else { "response" });
        assert_eq!(next[held.len()..], e.0[..]);
    }
}

#[test]
fn a_reply_cut_at_the_token_limit_still_reuses_the_state() {
    let f = ChatFormat::new(tok(), Some(Effort::Max)).unwrap();
    let mut history = vec![Message::user("Tell me a story")];
    let prompt = f.render(&history, true);
    // Non-canonical ids (re-encoding "Once upon" would merge them differently) are kept verbatim.
    let mut reply_ids = tok().encode("Once");
    reply_ids.extend(tok().encode(" up"));
    reply_ids.extend(tok().encode("on"));
    let (p, _) = parse(true, &reply_ids);
    let reply = p.finish(tok());
    assert_eq!(reply.stopped_on, None);
    history.push(Message::from_reply(&reply));
    history.push(Message::user("Go on"));
    let next = f.render(&history, true);
    let held = held_after(&prompt, &reply_ids);
    assert_eq!(reusable(&held, &next), Some(held.len()));
    // The last generated id (not yet fed) comes first, then the channels are closed.
    assert_eq!(next[held.len()], *reply_ids.last().unwrap());
    assert_eq!(next[held.len() + 1], CLOSE);
}

#[test]
fn a_reply_that_breaks_the_structure_forces_a_full_prefill() {
    let f = ChatFormat::new(tok(), Some(Effort::Max)).unwrap();
    let mut history = vec![Message::user("Hi")];
    let prompt = f.render(&history, true);
    // The model skips `<|close|>think<|sep|>` and opens the response channel directly.
    let mut e = Expect::default();
    e.t("hmm")
        .open("response")
        .t("Hello")
        .close("response")
        .close("message")
        .m(EOM);
    let (p, _) = parse(true, &e.0);
    let reply = p.finish(tok());
    assert_eq!(reply.think.as_deref(), Some("hmm"));
    assert_eq!(reply.response, "Hello");
    history.push(Message::from_reply(&reply));
    history.push(Message::user("Again"));
    let next = f.render(&history, true);
    let held = held_after(&prompt, &e.0);
    assert_eq!(reusable(&held, &next), None);
    // The canonical rendering closes the think channel where the model did not.
    assert!(next.starts_with(&prompt));
    assert_eq!(next[prompt.len() + tok().encode("hmm").len()], CLOSE);
}

#[test]
fn lines_are_read_bounded() {
    let mut input: &[u8] = b"one\r\ntwo\n\nxxxxxxxxxx\nlast";
    let mut read = || read_line_bounded(&mut input, 8).unwrap();
    assert_eq!(read(), Some(Line::Text(b"one".to_vec())));
    assert_eq!(read(), Some(Line::Text(b"two".to_vec())));
    assert_eq!(read(), Some(Line::Text(Vec::new())));
    assert_eq!(read(), Some(Line::TooLong));
    assert_eq!(read(), Some(Line::Text(b"last".to_vec())));
    assert_eq!(read(), None);
}

fn worker(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3-worker"))
        .args(args)
        .output()
        .expect("k3-worker runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn chat_flags_are_refused_before_any_work() {
    let tokdir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
    let tokdir = tokdir.to_str().unwrap();
    let base = ["--standalone", "/nonexistent/model", "--preset", "laptop"];
    let cases: &[(&[&str], &str)] = &[
        (&["--chat"], "--tok <DIR>"),
        (
            &["--chat", "--tok", tokdir, "--ids", "1"],
            "cannot be used with",
        ),
        (
            &["--chat", "--tok", tokdir, "--effort", "extreme"],
            "invalid value 'extreme'",
        ),
        (
            &["--chat", "--tok", tokdir, "--no-think", "--effort", "max"],
            "cannot be used with",
        ),
        (
            &["--chat", "--tok", tokdir, "--ctx", "0"],
            "invalid value '0'",
        ),
        (&["--no-think", "--ids", "1"], "--chat"),
        (&["--ctx", "64", "--ids", "1"], "--chat"),
        // With --tok too: clap-rs/clap#4707 let these through, and the flag was ignored.
        (
            &["--ctx", "64", "--ids", "1", "--tok", tokdir],
            "cannot be used with",
        ),
        (
            &["--effort", "low", "--ids", "1", "--tok", tokdir],
            "cannot be used with",
        ),
    ];
    for (extra, want) in cases {
        let args: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
        let (code, err) = worker(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// The generated `small` checkpoint (vocab 163,840, so the real special ids run), if present.
fn small_checkpoint() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var("K3_SMALL").unwrap_or_else(|_| "/tmp/k3small".into()));
    p.join("config.json").exists().then_some(p)
}

#[test]
#[ignore = "needs the generated small checkpoint (see the module doc)"]
fn second_turn_reuses_the_state_and_gives_the_ids_of_a_full_prefill() {
    use k3_store::runtime::plan::{Budget, BudgetFlag};
    use k3_store::runtime::standalone::{StandaloneOptions, StandaloneSource};
    use k3_worker::engine::memory::EnginePlan;
    use k3_worker::engine::request::Speculation;
    use k3_worker::engine::sampling::Sampler;
    use k3_worker::engine::Engine;
    use k3_worker::front::chat::{Conversation, TurnOptions};
    use k3_worker::model::bind::ShapeTable;
    use k3_worker::model::{Dims, Model, TensorShapes};

    let dir = small_checkpoint().expect("set K3_SMALL to a `small` checkpoint directory");
    let budget = Budget::from_flags(&[BudgetFlag::Preset("laptop".into())]).unwrap();
    let (src, _plan) = StandaloneSource::open(
        &dir,
        None,
        &budget,
        None,
        &StandaloneOptions::default(),
        &mut |_, _, _| {},
    )
    .unwrap();
    let cfg = k3_proto::config::ModelConfig::load(&dir.join("config.json")).unwrap();
    let dims = Dims::from_config(&cfg).unwrap();
    let index = k3_proto::safetensors::CheckpointIndex::open(&dir).unwrap();
    let shapes = ShapeTable::from_index(&index, dims.n_layers);
    let model = Model::new(dims, &src, Some(&shapes as &dyn TensorShapes)).unwrap();
    let f = ChatFormat::new(tok(), Some(Effort::Max)).unwrap();
    let opts = TurnOptions {
        max_new: 16,
        think_budget: None,
    };
    let capacity = 1024;
    let mut model = Engine::new(model, EnginePlan::one(capacity, 512, 0));
    let conv = |history: Vec<Message>| {
        let mut c = Conversation::new(capacity, Sampler::Greedy, Speculation::off());
        c.history = history;
        c
    };

    // Warm the expert cache so the timings below compare compute, not first loads.
    let mut warm = conv(vec![]);
    warm.turn(&mut model, &f, "warm up", &opts, &mut |_, _| Flow::Continue)
        .unwrap();

    let mut s = conv(vec![]);
    let t1 = s
        .turn(&mut model, &f, "Hi", &opts, &mut |_, _| Flow::Continue)
        .unwrap();
    assert_eq!((t1.reused, t1.restarted), (0, false));
    assert_eq!(t1.prefilled, t1.conversation_len);
    let after_t1 = s.history.clone();
    let t2 = s
        .turn(&mut model, &f, "And now?", &opts, &mut |_, _| {
            Flow::Continue
        })
        .unwrap();
    assert!(
        !t2.restarted,
        "the rendered conversation must extend the state"
    );
    assert!(
        t2.reused > t1.conversation_len,
        "{} vs {}",
        t2.reused,
        t1.conversation_len
    );
    assert_eq!(t2.reused + t2.prefilled, t2.conversation_len);
    // The state holds exactly the conversation plus the fed-back reply.
    let mut want_held = f.render(&s.history[..3], true);
    want_held.extend_from_slice(&t2.reply.ids[..t2.reply.ids.len() - 1]);
    assert_eq!(s.held(), &want_held[..]);

    // The same second turn from a fresh state: a full prefill must give the same ids.
    let mut fresh = conv(after_t1);
    let full = fresh
        .turn(&mut model, &f, "And now?", &opts, &mut |_, _| {
            Flow::Continue
        })
        .unwrap();
    assert_eq!((full.reused, full.prefilled), (0, t2.conversation_len));
    assert_eq!(full.reply.ids, t2.reply.ids, "state reuse changed the ids");
    assert!(
        t2.reply.ids.iter().any(|&t| t != t2.reply.ids[0]),
        "degenerate reply {:?}",
        t2.reply.ids
    );

    // An edited history no longer extends the state: the next turn re-prefills everything
    // and gives the ids of a fresh session on that history.
    s.history[0] = Message::user("Hello");
    let edited = s.history.clone();
    let t3 = s
        .turn(&mut model, &f, "Once more", &opts, &mut |_, _| {
            Flow::Continue
        })
        .unwrap();
    assert!(t3.restarted);
    assert_eq!((t3.reused, t3.prefilled), (0, t3.conversation_len));
    let mut fresh = conv(edited);
    let t3_fresh = fresh
        .turn(&mut model, &f, "Once more", &opts, &mut |_, _| {
            Flow::Continue
        })
        .unwrap();
    assert!(!t3_fresh.restarted);
    assert_eq!(t3_fresh.reply.ids, t3.reply.ids);

    assert_eq!(model.model().counters.failed_expert_loads, 0);
    eprintln!(
        "turn 2 with reuse: prefill {} tokens in {:.4} s (reused {}); without: {} tokens in {:.4} s; speed-up {:.2}x",
        t2.prefilled,
        t2.prefill_seconds,
        t2.reused,
        full.prefilled,
        full.prefill_seconds,
        full.prefill_seconds / t2.prefill_seconds
    );
}
