//! Generated ids → the reply's text, id by id, for streamed and whole answers alike.
//!
//! A completion's text is every generated id's bytes up to an end id (`[EOS]`,
//! `<|end_of_msg|>`). A chat reply is split at the XTML markers by the worker's own
//! [`ReplyParser`]: the think channel becomes `reasoning_content`, the response channel
//! `content`, structure is dropped. Stop strings apply to `content` (a completion's text); the
//! stop string and everything after it is not part of the reply. `finish_reason` is `stop` for an
//! end id or a stop string, `length` when `max_tokens` ids were generated.

use std::sync::Arc;

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
}

impl Finish {
    /// `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// Text released by one id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Think-channel text.
    pub reasoning: String,
    /// Response text (a completion's text).
    pub content: String,
}

impl Delta {
    /// Nothing to send.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }

    fn add(&mut self, o: Delta) {
        self.reasoning.push_str(&o.reasoning);
        self.content.push_str(&o.content);
    }
}

/// The reply being built.
#[derive(Debug)]
pub struct ReplyText {
    tok: Arc<Tokenizer>,
    parser: Option<ReplyParser>,
    think: Utf8Stream,
    text: Utf8Stream,
    stop: StopText,
    max_new: usize,
    generated: usize,
    finish: Option<Finish>,
    thinking: bool,
}

impl ReplyText {
    /// A completion's text.
    pub fn completion(tok: Arc<Tokenizer>, stops: &[String], max_new: usize) -> ReplyText {
        ReplyText::new(tok, None, stops, max_new, false)
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
        ReplyText::new(
            tok,
            Some(ReplyParser::new(markers, thinking)),
            stops,
            max_new,
            thinking,
        )
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
            think: Utf8Stream::default(),
            text: Utf8Stream::default(),
            stop: StopText::new(stops),
            max_new,
            generated: 0,
            finish: None,
        }
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

    /// True when a stop string ended the reply (the worker is still running and must be
    /// stopped).
    pub fn stopped_by_text(&self) -> bool {
        self.stop.stopped()
    }

    /// One generated id; returns the text it releases. Ids after the end are ignored.
    pub fn push(&mut self, id: u32) -> Delta {
        if self.finish.is_some() {
            return Delta::default();
        }
        self.generated += 1;
        let tok = self.tok.clone();
        let bytes = tok.token_bytes(id).unwrap_or(&[]);
        let mut d = Delta::default();
        let mut ended = false;
        match self.parser.as_mut() {
            None => {
                if END_IDS.contains(&id) {
                    ended = true;
                } else {
                    let t = self.text.push(bytes);
                    d.content = self.stop.push(&t);
                }
            }
            Some(p) => {
                match p.push(&tok, id) {
                    Channel::Think => d.reasoning = self.think.push(bytes),
                    Channel::Response => {
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
            }
        }
        if self.stop.stopped() {
            self.finish = Some(Finish::Stop);
        } else if ended {
            self.end(&mut d, Finish::Stop);
        } else if self.generated >= self.max_new {
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
        assert!(!r.stopped_by_text());
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
        assert!(r.stopped_by_text());
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
