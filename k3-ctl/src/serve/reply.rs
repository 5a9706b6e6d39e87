//! Generated ids → the reply's text, id by id, for streamed and whole answers alike.
//!
//! A completion's text is every generated id's bytes up to an end id (`[EOS]`,
//! `<|end_of_msg|>`). A chat reply is split at the XTML markers by the worker's own
//! [`ReplyParser`]: the think channel becomes `reasoning_content`, the response channel
//! `content`, structure is dropped. Stop strings apply to `content` (a completion's text); the
//! stop string and everything after it is not part of the reply. `finish_reason` is `stop` for an
//! end id or a stop string, `length` when `max_tokens` ids were generated, `tool_calls` when the
//! reply made at least one well-formed call.
//!
//! Tool calls (SPEC.md §5.5 "Tools"): every chat reply's `tools` element is read by
//! [`CallParser`] whatever the request declared, so a call is never dropped. A well-formed call to
//! a tool the request allows becomes a [`CallOut`] when it closes; a call that does not parse,
//! names an undeclared tool or comes under `tool_choice: "none"` is reported: its text as the
//! model wrote it is appended to `content` (stop strings do not apply to it) and the reason is
//! kept ([`ReplyText::malformed`]). With `parallel_tool_calls: false` the reply ends after its
//! first call.

use std::sync::Arc;

use k3_worker::text::tools::{CallParser, ToolEvent};
use k3_worker::text::visible;
use k3_worker::text::xtml::{Channel, Markers, ReplyParser, END_IDS};
use k3_worker::tokenizer::Tokenizer;

use super::text::{StopText, Utf8Stream};

/// Why the reply ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end id or a stop string.
    Stop,
    /// `max_tokens` ids were generated.
    Length,
    /// The reply ended after well-formed tool calls.
    ToolCalls,
}

impl Finish {
    /// `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// A well-formed generated tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallOut {
    /// Its place among the reply's calls (from 0).
    pub index: usize,
    /// The tool.
    pub name: String,
    /// The arguments as a JSON object's text, with the types the call declared.
    pub arguments: String,
}

/// A generated tool call that was not accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MalformedOut {
    /// Why.
    pub error: String,
    /// The call's text as the model wrote it (also appended to `content`).
    pub text: String,
}

/// Text released by one id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Think-channel text.
    pub reasoning: String,
    /// Response text (a completion's text).
    pub content: String,
    /// Tool calls that closed.
    pub calls: Vec<CallOut>,
    /// The log-probabilities of the content's ids (OpenAI's `logprobs.content` items), when
    /// the request asked for them.
    pub logprobs: Vec<serde_json::Value>,
}

impl Delta {
    /// Nothing to send.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty()
            && self.content.is_empty()
            && self.calls.is_empty()
            && self.logprobs.is_empty()
    }

    /// Append `o`.
    pub fn add(&mut self, o: Delta) {
        self.reasoning.push_str(&o.reasoning);
        self.content.push_str(&o.content);
        self.calls.extend(o.calls);
        self.logprobs.extend(o.logprobs);
    }
}

/// Which tool calls a chat request allows.
#[derive(Clone, Debug)]
pub struct CallRules {
    /// The tools that may be called (empty: none; every call is reported).
    pub allowed: Vec<String>,
    /// More than one call per reply.
    pub parallel: bool,
}

/// The reply being built (a clone before the first id: another choice of the same request).
#[derive(Clone, Debug)]
pub struct ReplyText {
    tok: Arc<Tokenizer>,
    parser: Option<ReplyParser>,
    calls: Option<CallParser>,
    parallel: bool,
    n_calls: usize,
    malformed: Vec<MalformedOut>,
    /// The reply was ended here (a stop string, or the one call `parallel_tool_calls: false`
    /// allows).
    cut: bool,
    markers: Option<Markers>,
    think: Utf8Stream,
    text: Utf8Stream,
    stop: StopText,
    max_new: usize,
    generated: usize,
    finish: Option<Finish>,
    thinking: bool,
    /// The last id was part of the content (the response channel; a completion's text).
    in_content: bool,
    /// Ids of the think channel's contents.
    reasoning_ids: usize,
}

impl ReplyText {
    /// A completion's text.
    pub fn completion(tok: Arc<Tokenizer>, stops: &[String], max_new: usize) -> ReplyText {
        ReplyText::new(tok, None, stops, max_new, false)
    }

    /// Read tool calls by `rules` (a chat reply; without this every call is reported).
    pub fn with_calls(mut self, rules: CallRules) -> ReplyText {
        if let Some(m) = self.markers {
            self.calls = Some(CallParser::new(m, Some(rules.allowed)));
            self.parallel = rules.parallel;
        }
        self
    }

    /// A chat reply after the generation prompt (`thinking`: the reply starts in the think
    /// channel).
    pub fn chat(
        tok: Arc<Tokenizer>,
        markers: Markers,
        thinking: bool,
        stops: &[String],
        max_new: usize,
    ) -> ReplyText {
        let mut r = ReplyText::new(
            tok,
            Some(ReplyParser::new(markers, thinking)),
            stops,
            max_new,
            thinking,
        );
        r.calls = Some(CallParser::new(markers, Some(Vec::new())));
        r.markers = Some(markers);
        r
    }

    fn new(
        tok: Arc<Tokenizer>,
        parser: Option<ReplyParser>,
        stops: &[String],
        max_new: usize,
        thinking: bool,
    ) -> ReplyText {
        ReplyText {
            thinking,
            tok,
            parser,
            calls: None,
            markers: None,
            parallel: true,
            n_calls: 0,
            malformed: Vec::new(),
            cut: false,
            think: Utf8Stream::default(),
            text: Utf8Stream::default(),
            stop: StopText::new(stops),
            max_new,
            generated: 0,
            finish: None,
            in_content: false,
            reasoning_ids: 0,
        }
    }

    /// Ids of the think channel's contents (OpenAI's `reasoning_tokens`).
    pub fn reasoning_ids(&self) -> usize {
        self.reasoning_ids
    }

    /// The last id pushed was part of the content (its log-probability belongs to it).
    pub fn in_content(&self) -> bool {
        self.in_content
    }

    /// A chat reply with the think channel on (it has `reasoning_content`).
    pub fn thinking(&self) -> bool {
        self.thinking
    }

    /// Ids consumed (the `completion_tokens`).
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Set once the reply is complete.
    pub fn finish(&self) -> Option<Finish> {
        self.finish
    }

    /// True when the reply was ended here — a stop string, or the one tool call
    /// `parallel_tool_calls: false` allows — while the worker is still running (it must be
    /// stopped).
    pub fn cut_short(&self) -> bool {
        self.stop.stopped() || self.cut
    }

    /// The stop string that ended the reply.
    pub fn stop_sequence(&self) -> Option<&str> {
        self.stop.matched()
    }

    /// Tool calls that were reported instead of returned (see the module doc).
    pub fn malformed(&self) -> &[MalformedOut] {
        &self.malformed
    }

    /// Take a tool call event into `d`.
    fn on_call(&mut self, e: ToolEvent, d: &mut Delta) {
        match e {
            ToolEvent::Call(c) => {
                d.calls.push(CallOut {
                    index: self.n_calls,
                    name: c.name,
                    arguments: serde_json::Value::Object(c.arguments).to_string(),
                });
                self.n_calls += 1;
                if !self.parallel {
                    self.cut = true;
                }
            }
            ToolEvent::Malformed(m) => {
                tracing::warn!("a generated tool call was not accepted: {}", m.reason);
                d.content.push_str(&m.raw);
                self.malformed.push(MalformedOut {
                    error: m.reason.to_string(),
                    text: m.raw,
                });
            }
        }
    }

    /// One generated id; returns the text it releases. Ids after the end are ignored.
    pub fn push(&mut self, id: u32) -> Delta {
        if self.finish.is_some() {
            return Delta::default();
        }
        self.generated += 1;
        self.in_content = false;
        let tok = self.tok.clone();
        let bytes = visible::token_bytes(&tok, id).unwrap_or(&[]);
        let mut d = Delta::default();
        let mut ended = false;
        match self.parser.as_mut() {
            None => {
                if END_IDS.contains(&id) {
                    ended = true;
                } else {
                    self.in_content = !self.stop.stopped();
                    let t = self.text.push(bytes);
                    d.content = self.stop.push(&t);
                }
            }
            Some(p) => {
                let call = self.calls.as_mut().and_then(|c| c.push(&tok, id));
                match p.push(&tok, id) {
                    Channel::Think => {
                        self.reasoning_ids += 1;
                        d.reasoning = self.think.push(bytes);
                    }
                    Channel::Response => {
                        self.in_content = !self.stop.stopped();
                        let t = self.text.push(bytes);
                        d.content = self.stop.push(&t);
                    }
                    Channel::Structure => {
                        // A channel ended: a character left incomplete in it is U+FFFD.
                        d.reasoning = self.think.finish();
                        let t = self.text.finish();
                        d.content = self.stop.push(&t);
                    }
                }
                ended = p.done();
                if let Some(e) = call {
                    self.on_call(e, &mut d);
                }
            }
        }
        if self.stop.stopped() {
            self.finish = Some(Finish::Stop);
        } else if self.cut {
            self.end(&mut d, Finish::ToolCalls);
        } else if ended {
            let why = if self.n_calls > 0 {
                Finish::ToolCalls
            } else {
                Finish::Stop
            };
            self.end(&mut d, why);
        } else if self.generated >= self.max_new {
            // A call left open at the limit is reported.
            if let Some(e) = self.calls.as_mut().and_then(|c| c.end(&tok)) {
                self.on_call(e, &mut d);
            }
            self.end(&mut d, Finish::Length);
        }
        d
    }

    fn end(&mut self, d: &mut Delta, why: Finish) {
        let mut rest = Delta {
            reasoning: self.think.finish(),
            ..Delta::default()
        };
        let t = self.text.finish();
        rest.content = self.stop.push(&t);
        if self.stop.stopped() {
            self.finish = Some(Finish::Stop);
        } else {
            rest.content.push_str(&self.stop.finish());
            self.finish = Some(why);
        }
        d.add(rest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_worker::text::xtml::{ChatFormat, Message};
    use std::path::PathBuf;

    fn tok() -> Arc<Tokenizer> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
        Arc::new(Tokenizer::from_dir(&dir).expect("shipped tokenizer"))
    }

    fn collect(r: &mut ReplyText, ids: &[u32]) -> Delta {
        let mut all = Delta::default();
        for &id in ids {
            all.add(r.push(id));
        }
        all
    }

    #[test]
    fn completion_text_stops_at_an_end_id_and_counts_it() {
        let t = tok();
        let mut ids = t.encode("Hello, wörld €");
        let n = ids.len();
        ids.push(END_IDS[0]);
        ids.extend(t.encode(" after"));
        let mut r = ReplyText::completion(t.clone(), &[], 100);
        let d = collect(&mut r, &ids);
        assert_eq!(d.content, "Hello, wörld €");
        assert_eq!(r.finish(), Some(Finish::Stop));
        assert_eq!(r.generated(), n + 1);
        assert!(!r.cut_short());
    }

    #[test]
    fn max_tokens_ends_with_length_and_stop_strings_cut() {
        let t = tok();
        let ids = t.encode("one two three four five");
        let mut r = ReplyText::completion(t.clone(), &[], 3);
        let d = collect(&mut r, &ids);
        assert_eq!(r.finish(), Some(Finish::Length));
        assert_eq!(r.generated(), 3);
        assert_eq!(
            d.content.as_bytes(),
            t.decode(&ids[..3]).unwrap().as_slice()
        );

        let mut r = ReplyText::completion(t.clone(), &[" thr".to_string()], 100);
        let d = collect(&mut r, &ids);
        assert_eq!(d.content, "one two");
        assert_eq!(r.finish(), Some(Finish::Stop));
        assert!(r.cut_short());
    }

    /// A forced reply (fixed ids, no model): thinking, a response, two calls, the end.
    #[test]
    fn reserved_slots_and_control_markers_are_never_reply_text() {
        // A random-weight model samples reserved slots; their names are not text (issue 49).
        let t = tok();
        let reserved = t.special_id("<|reserved_token_163597|>").unwrap();
        let mut ids = t.encode("Hi");
        ids.push(reserved);
        ids.extend(t.encode(" there"));
        let mut r = ReplyText::completion(t.clone(), &[], 100);
        assert_eq!(collect(&mut r, &ids).content, "Hi there");
        let m = Markers::from_tokenizer(&t).unwrap();
        let mut ids = t.encode_with_special("plan<|close|>think<|sep|><|open|>response<|sep|>A");
        ids.push(reserved);
        ids.extend(t.encode("B"));
        let mut r = ReplyText::chat(t.clone(), m, true, &[], 100);
        let d = collect(&mut r, &ids);
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("plan", "AB"));
        assert_eq!(r.generated(), ids.len(), "the reserved id is still counted");
    }

    fn call_reply(t: &Tokenizer, second: &str) -> Vec<u32> {
        t.encode_with_special(&format!(
            "plan<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>\
             <|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument \
             key=\"q\" type=\"string\"<|sep|>K3<|close|>argument<|sep|><|open|>argument \
             key=\"n\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>\
             {second}<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        ))
    }

    fn rules(allowed: &[&str], parallel: bool) -> CallRules {
        CallRules {
            allowed: allowed.iter().map(|s| s.to_string()).collect(),
            parallel,
        }
    }

    #[test]
    fn tool_calls_come_out_when_they_close_and_finish_the_reply_as_tool_calls() {
        let t = tok();
        let m = Markers::from_tokenizer(&t).unwrap();
        let second =
            "<|open|>call tool=\"g\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>\
                      {\"a\": [1]}<|close|>json<|sep|><|close|>call<|sep|>";
        let ids = call_reply(&t, second);
        let mut r =
            ReplyText::chat(t.clone(), m, true, &[], 1000).with_calls(rules(&["f", "g"], true));
        let mut deltas = Vec::new();
        for &id in &ids {
            deltas.push(r.push(id));
        }
        let calls: Vec<&CallOut> = deltas.iter().flat_map(|d| d.calls.iter()).collect();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (
                calls[0].index,
                calls[0].name.as_str(),
                calls[0].arguments.as_str()
            ),
            (0, "f", r#"{"q":"K3","n":2}"#)
        );
        assert_eq!((calls[1].index, calls[1].name.as_str()), (1, "g"));
        // Each call arrives with the id that closed it, not before.
        let first_at = deltas.iter().position(|d| !d.calls.is_empty()).unwrap();
        let close_call = t.encode_with_special("<|close|>call<|sep|>");
        assert_eq!(ids[first_at], *close_call.last().unwrap());
        let all = collect(
            &mut ReplyText::chat(t.clone(), m, true, &[], 1000)
                .with_calls(rules(&["f", "g"], true)),
            &ids,
        );
        assert_eq!(
            (all.reasoning.as_str(), all.content.as_str()),
            ("plan", "On it.")
        );
        assert_eq!(r.finish(), Some(Finish::ToolCalls));
        assert!(r.malformed().is_empty());
    }

    #[test]
    fn one_call_only_ends_the_reply_after_it() {
        let t = tok();
        let m = Markers::from_tokenizer(&t).unwrap();
        let ids = call_reply(
            &t,
            "<|open|>call tool=\"f\" index=\"2\"<|sep|><|close|>call<|sep|>",
        );
        let mut r = ReplyText::chat(t.clone(), m, true, &[], 1000).with_calls(rules(&["f"], false));
        let d = collect(&mut r, &ids);
        assert_eq!(d.calls.len(), 1);
        assert_eq!(r.finish(), Some(Finish::ToolCalls));
        assert!(
            r.cut_short(),
            "the worker is still running and must be stopped"
        );
        assert!(r.generated() < ids.len());
    }

    #[test]
    fn malformed_and_forbidden_calls_are_reported_in_content() {
        let t = tok();
        let m = Markers::from_tokenizer(&t).unwrap();
        let bad = "<|open|>call tool=\"f\" index=\"2\"<|sep|><|open|>argument key=\"n\" \
                   type=\"number\"<|sep|>lots<|close|>argument<|sep|><|close|>call<|sep|>";
        let ids = call_reply(&t, bad);
        let mut r = ReplyText::chat(t.clone(), m, true, &[], 1000).with_calls(rules(&["f"], true));
        let d = collect(&mut r, &ids);
        assert_eq!(d.calls.len(), 1);
        assert_eq!(d.content, format!("On it.{bad}"));
        assert_eq!(r.malformed().len(), 1);
        assert!(
            r.malformed()[0].error.contains("\"n\""),
            "{:?}",
            r.malformed()
        );
        assert_eq!(r.finish(), Some(Finish::ToolCalls));
        // tool_choice none (no tool allowed): both calls are reported, the reply is a stop.
        let mut r = ReplyText::chat(t.clone(), m, true, &[], 1000).with_calls(rules(&[], true));
        let d = collect(&mut r, &ids);
        assert!(d.calls.is_empty());
        assert_eq!(r.malformed().len(), 2);
        assert_eq!(r.finish(), Some(Finish::Stop));
        // The token limit inside a call: reported, finish length.
        let cut = ids.len() - 12;
        let mut r = ReplyText::chat(t.clone(), m, true, &[], cut).with_calls(rules(&["f"], true));
        let d = collect(&mut r, &ids);
        assert_eq!(r.finish(), Some(Finish::Length));
        assert_eq!(r.malformed().len(), 1);
        assert!(d.content.ends_with(&r.malformed()[0].text));
    }

    #[test]
    fn chat_reply_splits_channels_like_the_worker() {
        let t = tok();
        let fmt = ChatFormat::new(&t, Some(k3_worker::text::xtml::Effort::Low)).unwrap();
        // A reply as the model writes it after the generation prompt (inside <think>).
        let history = [Message::from_reply(&k3_worker::text::xtml::Reply {
            ids: vec![],
            think_ids: t.encode("let me think"),
            response_ids: t.encode("The answer is 4."),
            think: Some("let me think".into()),
            response: "The answer is 4.".into(),
            stopped_on: None,
        })];
        let prompt = fmt.render(&[], true);
        let full = fmt.render(&history, false);
        // The reply's ids follow the generation prompt's `<|open|>message role="assistant"<|sep|>
        // <|open|>think<|sep|>`.
        let opening = prompt.len() - fmt.render(&[], false).len();
        let mut reply_ids = full[fmt.render(&[], false).len() + opening..].to_vec();
        assert_eq!(reply_ids.last(), Some(&fmt.markers.end_of_msg));
        reply_ids.push(99); // never read: the end id came first
        let mut r = ReplyText::chat(t.clone(), fmt.markers, true, &[], 1000);
        let d = collect(&mut r, &reply_ids);
        assert_eq!(d.reasoning, "let me think");
        assert_eq!(d.content, "The answer is 4.");
        assert_eq!(r.finish(), Some(Finish::Stop));
        assert_eq!(r.generated(), reply_ids.len() - 1);

        let mut r = ReplyText::chat(t.clone(), fmt.markers, true, &["is".to_string()], 1000);
        let d = collect(&mut r, &reply_ids);
        assert_eq!(
            (d.reasoning.as_str(), d.content.as_str()),
            ("let me think", "The answer ")
        );
    }
}
