//! Incremental text for streamed ids: UTF-8 reassembly across tokens and `stop` strings.
//!
//! A token's bytes may end inside a multi-byte character (byte-level BPE), so text is released
//! only up to the last complete character; an invalid sequence becomes U+FFFD, as a lossy
//! decode of the whole reply would give. A `stop` string is matched on the released text and is
//! not part of the output: text that could still be the start of a stop string is held back until
//! the next token decides it, so a streamed reply and a non-streamed one are the same text.

/// Bytes in, complete characters out.
#[derive(Clone, Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Append `bytes`; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // `good` is the prefix from_utf8 validated.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            rest = bad;
                            break;
                        }
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &bad[n..];
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// The end of the reply: a character left incomplete becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Releases text while watching for stop strings.
#[derive(Clone, Debug)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
    stopped: bool,
    matched: Option<usize>,
}

impl StopText {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopText {
        StopText {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            stopped: false,
            matched: None,
        }
    }

    /// True once a stop string was seen (nothing more is released).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that was seen (the earliest match; the first listed on a tie).
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|k| self.stops[k].as_str())
    }

    /// Add text; returns what can be released now. After a stop string it returns the text
    /// before it and [`StopText::stopped`] turns true.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        // Any match starts inside `held`: released text never ended with a stop's prefix.
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(k, s)| self.held.find(s.as_str()).map(|at| (at, k)))
            .min();
        if let Some((at, k)) = first {
            self.stopped = true;
            self.matched = Some(k);
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        out
    }

    /// The end of the reply: whatever was held back is released (it never became a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_split_across_tokens_are_joined() {
        let mut u = Utf8Stream::default();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(u.push(b"a"), "a");
        assert_eq!(u.push(&euro[..1]), "");
        assert_eq!(u.push(&euro[1..2]), "");
        assert_eq!(u.push(&[euro[2], b'b']), "€b");
        assert_eq!(u.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters_like_a_lossy_decode() {
        let bytes: &[u8] = b"x\xffy\xe2\x82";
        let mut u = Utf8Stream::default();
        let mut got = String::new();
        for b in bytes {
            got.push_str(&u.push(&[*b]));
        }
        got.push_str(&u.finish());
        assert_eq!(got, String::from_utf8_lossy(bytes));
        assert_eq!(got, "x\u{fffd}y\u{fffd}");
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopText::new(&stops);
        let mut out = String::new();
        for p in pieces {
            out.push_str(&m.push(p));
            if m.stopped() {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_text_is_cut_with_everything_after_it() {
        assert_eq!(
            run(&["END"], &["ab", "cE", "N", "Dxyz"]),
            ("abc".into(), true)
        );
        assert_eq!(run(&["\n\n", "."], &["one", ". two"]), ("one".into(), true));
        // The earliest match wins whichever stop string it is.
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        let stops = vec!["cd".to_string(), "b".to_string()];
        let mut m = StopText::new(&stops);
        m.push("abcd");
        assert_eq!(m.matched(), Some("b"));
    }

    #[test]
    fn a_partial_match_is_held_then_released() {
        let stops = vec!["END".to_string()];
        let mut m = StopText::new(&stops);
        assert_eq!(m.push("xE"), "x");
        assert_eq!(m.push("N"), "");
        assert_eq!(m.push("d"), "ENd");
        assert_eq!(m.push("EN"), "");
        assert!(!m.stopped());
        assert_eq!(m.finish(), "EN");
    }

    #[test]
    fn no_stops_release_everything_at_once() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
        let stops = vec!["ü!".to_string()];
        let mut m = StopText::new(&stops);
        assert_eq!(m.push("aü"), "a");
        assert_eq!(m.push("?"), "ü?");
    }
}
