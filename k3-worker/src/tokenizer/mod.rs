//! The Kimi K3 tokenizer: byte-level BPE over `tiktoken.model` with Kimi's pre-tokenizer,
//! giving the same ids as the `tiktoken` package configured like `tokenization_kimi.py`
//! (SPEC.md §5).
//!
//! Encoding, in order:
//! 1. Chunking ([`kimi_chunks`]), as `tokenization_kimi.py::encode` does before calling tiktoken:
//!    400,000-character windows, each split before any character that would make a run of
//!    consecutive whitespace / non-whitespace characters (Python's `str.isspace`) longer than
//!    25,000. It only changes the result for such long runs.
//! 2. Per chunk, with added tokens allowed ([`Tokenizer::encode_with_special`]): the leftmost
//!    occurrence of an added-token string becomes its id and the text between is ordinary. With
//!    them not allowed ([`Tokenizer::encode`], user text) added-token strings are ordinary text.
//! 3. Ordinary text is cut into pieces by Kimi's pattern ([`pretok`]) and each piece is
//!    byte-pair merged by rank ([`bpe`]).
//!
//! Text is Unicode (tiktoken works on `str`): [`Tokenizer::encode_bytes`] refuses bytes that are
//! not UTF-8, naming the offset of the first invalid byte. Decoding is lossless on bytes: a token
//! may hold part of a UTF-8 sequence, so [`Tokenizer::decode`] returns bytes.

mod bpe;
mod error;
mod files;
pub mod pretok;

pub use error::TokError;

use std::path::Path;

pub use files::N_SPECIAL_SLOTS;

/// Characters per window in `tokenization_kimi.py` (`TIKTOKEN_MAX_ENCODE_CHARS`).
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// Longest run of consecutive whitespace or non-whitespace characters kept in one chunk
/// (`MAX_NO_WHITESPACES_CHARS`).
pub const MAX_RUN_CHARS: usize = 25_000;

/// One trie node: children as `(byte, node)` and the id of the token ending here.
#[derive(Debug, Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    id: Option<u32>,
}

/// A trie of the added-token strings, for leftmost-longest matching in text.
#[derive(Debug)]
struct SpecialTrie {
    nodes: Vec<TrieNode>,
    /// Whether a byte can start an added token.
    first: [bool; 256],
}

impl SpecialTrie {
    fn new<'a>(tokens: impl Iterator<Item = (&'a str, u32)>) -> Self {
        let mut t = SpecialTrie {
            nodes: vec![TrieNode::default()],
            first: [false; 256],
        };
        for (s, id) in tokens {
            let mut node = 0usize;
            for &b in s.as_bytes() {
                let found = t.nodes[node]
                    .children
                    .iter()
                    .find(|(c, _)| *c == b)
                    .map(|&(_, n)| n);
                node = match found {
                    Some(n) => n as usize,
                    None => {
                        let n = t.nodes.len();
                        t.nodes.push(TrieNode::default());
                        t.nodes[node].children.push((b, n as u32));
                        n
                    }
                };
            }
            t.nodes[node].id = Some(id);
            if let Some(&b) = s.as_bytes().first() {
                t.first[usize::from(b)] = true;
            }
        }
        t
    }

    /// Longest added token starting at `i`: `(end, id)`.
    fn match_at(&self, s: &[u8], i: usize) -> Option<(usize, u32)> {
        let mut node = 0usize;
        let mut best = None;
        for (k, &b) in s[i..].iter().enumerate() {
            let Some(&(_, next)) = self.nodes[node].children.iter().find(|(c, _)| *c == b) else {
                break;
            };
            node = next as usize;
            if let Some(id) = self.nodes[node].id {
                best = Some((i + k + 1, id));
            }
        }
        best
    }

    /// Leftmost added token at or after `from`: `(start, end, id)`.
    fn find(&self, s: &[u8], from: usize) -> Option<(usize, usize, u32)> {
        (from..s.len())
            .filter(|&i| self.first[usize::from(s[i])])
            .find_map(|i| self.match_at(s, i).map(|(e, id)| (i, e, id)))
    }
}

/// The Kimi K3 tokenizer (see the module docs).
#[derive(Debug)]
pub struct Tokenizer {
    ranks: bpe::Ranks,
    /// Token bytes by rank.
    vocab_bytes: Vec<u8>,
    vocab_offsets: Vec<u32>,
    n_ranks: u32,
    /// Added-token contents, id `n_ranks + k`.
    specials: Vec<String>,
    special_ids: std::collections::HashMap<String, u32>,
    trie: SpecialTrie,
    pretok: pretok::PreTokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
}

/// Python's `str.isspace()`: `White_Space` plus the information separators U+001C..U+001F
/// (bidirectional class B/S), as used by `tokenization_kimi.py`'s run splitting.
#[inline]
fn py_isspace(c: char) -> bool {
    matches!(
        c,
        '\t'..='\r'
            | '\u{1c}'..='\u{20}'
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Splits `text` like `tokenization_kimi.py::encode`: 400,000-character windows, each cut
/// by `_split_whitespaces_or_nonwhitespaces(window, 25_000)`. Calls `f` on each chunk in order
/// (never on an empty chunk; an empty one encodes to nothing).
pub fn kimi_chunks<'a>(text: &'a str, mut f: impl FnMut(&'a str)) {
    let mut rest = text;
    while !rest.is_empty() {
        let split = rest
            .char_indices()
            .nth(MAX_ENCODE_CHARS)
            .map_or(rest.len(), |(b, _)| b);
        let (window, tail) = rest.split_at(split);
        split_runs(window, MAX_RUN_CHARS, &mut f);
        rest = tail;
    }
}

/// `_split_whitespaces_or_nonwhitespaces`: a new chunk starts before the character that would
/// make the current run of same-kind characters longer than `max_run`.
fn split_runs<'a>(s: &'a str, max_run: usize, f: &mut impl FnMut(&'a str)) {
    let mut chars = s.char_indices();
    let Some((_, c0)) = chars.next() else {
        return;
    };
    let mut run_is_space = py_isspace(c0);
    let mut run_len = 1usize;
    let mut start = 0usize;
    for (b, c) in chars {
        let sp = py_isspace(c);
        if sp != run_is_space {
            run_is_space = sp;
            run_len = 1;
        } else {
            run_len += 1;
            if run_len > max_run {
                f(&s[start..b]);
                start = b;
                run_len = 1;
            }
        }
    }
    f(&s[start..]);
}

impl Tokenizer {
    /// Loads `dir/tiktoken.model` and `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokError> {
        let vocab_path = dir.join("tiktoken.model");
        let config_path = dir.join("tokenizer_config.json");
        let vocab_data = files::read_bounded(&vocab_path, files::MAX_VOCAB_FILE)?;
        let config_data = files::read_bounded(&config_path, files::MAX_CONFIG_FILE)?;
        Self::from_bytes(&vocab_path, &vocab_data, &config_path, &config_data)
    }

    /// Builds a tokenizer from the contents of the two files (paths are for messages).
    pub fn from_bytes(
        vocab_path: &Path,
        vocab_data: &[u8],
        config_path: &Path,
        config_data: &[u8],
    ) -> Result<Tokenizer, TokError> {
        let vocab = files::parse_vocab(vocab_path, vocab_data)?;
        let n_ranks = u32::try_from(vocab.offsets.len() - 1).map_err(|_| TokError::Format {
            path: vocab_path.to_path_buf(),
            line: None,
            msg: "too many ranks".into(),
        })?;
        let added = files::parse_config(config_path, config_data, n_ranks)?;
        let ranks = bpe::Ranks::new(vocab.map).map_err(|b| TokError::Format {
            path: vocab_path.to_path_buf(),
            line: None,
            msg: format!("byte {b:#04x} has no rank, so some text could not be encoded"),
        })?;
        // An added token whose text is also a rank is fine for tiktoken (different paths), so
        // nothing to check there.
        let special_ids: std::collections::HashMap<String, u32> = added
            .contents
            .iter()
            .enumerate()
            .map(|(k, c)| (c.clone(), n_ranks + k as u32))
            .collect();
        let trie = SpecialTrie::new(special_ids.iter().map(|(s, &id)| (s.as_str(), id)));
        let lookup = |name: Option<String>, field: &str| -> Result<Option<u32>, TokError> {
            match name {
                None => Ok(None),
                Some(n) => special_ids
                    .get(&n)
                    .copied()
                    .map(Some)
                    .ok_or_else(|| TokError::Format {
                        path: config_path.to_path_buf(),
                        line: None,
                        msg: format!("`{field}` {n:?} is not an added token"),
                    }),
            }
        };
        let bos = lookup(added.bos, "bos_token")?;
        let eos = lookup(added.eos, "eos_token")?;
        Ok(Tokenizer {
            ranks,
            vocab_bytes: vocab.bytes,
            vocab_offsets: vocab.offsets,
            n_ranks,
            specials: added.contents,
            special_ids,
            trie,
            pretok: pretok::PreTokenizer::new().map_err(TokError::Setup)?,
            bos,
            eos,
        })
    }

    /// Number of ids: ranks plus the 256 added-token slots (163,840 for Kimi K3).
    pub fn vocab_size(&self) -> usize {
        self.n_ranks as usize + self.specials.len()
    }

    /// Number of BPE ranks (163,584 for Kimi K3); added tokens start at this id.
    pub fn n_ranks(&self) -> u32 {
        self.n_ranks
    }

    /// Id of an added token by its content (e.g. `"<|open|>"` → 163587).
    pub fn special_id(&self, content: &str) -> Option<u32> {
        self.special_ids.get(content).copied()
    }

    /// The `bos_token` id of `tokenizer_config.json` (not prepended by any encode function).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The `eos_token` id of `tokenizer_config.json`.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Bytes of one id (an added token gives its content), `None` if out of range.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        if id < self.n_ranks {
            let (a, b) = (
                self.vocab_offsets[id as usize] as usize,
                self.vocab_offsets[id as usize + 1] as usize,
            );
            self.vocab_bytes.get(a..b)
        } else {
            self.specials
                .get((id - self.n_ranks) as usize)
                .map(|s| s.as_bytes())
        }
    }

    /// Encodes user text: added-token strings are ordinary text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_impl(text, false)
    }

    /// Encodes text in which added-token strings become their ids
    /// (`tokenization_kimi.py`'s `allowed_special="all"`).
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        self.encode_impl(text, true)
    }

    /// Encodes bytes that must be UTF-8 (e.g. a prompt file); otherwise
    /// [`TokError::InvalidUtf8`] with the offset of the first invalid byte.
    pub fn encode_bytes(&self, bytes: &[u8], allow_special: bool) -> Result<Vec<u32>, TokError> {
        let text = std::str::from_utf8(bytes).map_err(|e| TokError::InvalidUtf8 {
            offset: e.valid_up_to(),
        })?;
        Ok(self.encode_impl(text, allow_special))
    }

    fn encode_impl(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        let mut scratch = bpe::Scratch::default();
        kimi_chunks(text, |chunk| {
            if allow_special {
                self.for_each_special_split(chunk, &mut out, |t, seg, out| {
                    t.encode_ordinary_into(seg, out, &mut scratch)
                });
            } else {
                self.encode_ordinary_into(chunk, &mut out, &mut scratch);
            }
        });
        out
    }

    /// Splits `chunk` at added tokens (leftmost, longest at a position), pushing their ids and
    /// passing the ordinary segments in between to `ordinary`.
    fn for_each_special_split(
        &self,
        chunk: &str,
        out: &mut Vec<u32>,
        mut ordinary: impl FnMut(&Self, &str, &mut Vec<u32>),
    ) {
        let s = chunk.as_bytes();
        let mut pos = 0;
        while let Some((st, en, id)) = self.trie.find(s, pos) {
            // Added tokens are valid UTF-8 strings, so st and en are char boundaries.
            ordinary(self, &chunk[pos..st], out);
            out.push(id);
            pos = en;
        }
        ordinary(self, &chunk[pos..], out);
    }

    /// Pre-tokenizes and merges ordinary text (no chunking, no added tokens).
    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>, scratch: &mut bpe::Scratch) {
        let s = text.as_bytes();
        let mut i = 0;
        while i < s.len() {
            let e = self.pretok.piece_end(s, i);
            bpe::encode_piece(&self.ranks, &s[i..e], out, scratch);
            i = e;
        }
    }

    /// The pre-tokenizer pieces of ordinary text (no chunking, no added tokens).
    pub fn pieces<'a>(&'a self, text: &'a str) -> pretok::Pieces<'a> {
        self.pretok.pieces(text)
    }

    /// Like [`Tokenizer::encode_bytes`] but pre-tokenizes with the reference regex
    /// (`fancy-regex` running Kimi's pattern, as tiktoken does) instead of the scanner. For
    /// cross-checking and benchmarks; errors if the regex engine gives up.
    pub fn encode_bytes_with_regex(
        &self,
        splitter: &pretok::RegexSplitter,
        bytes: &[u8],
        allow_special: bool,
    ) -> Result<Vec<u32>, TokError> {
        let text = std::str::from_utf8(bytes).map_err(|e| TokError::InvalidUtf8 {
            offset: e.valid_up_to(),
        })?;
        let mut out = Vec::new();
        let mut scratch = bpe::Scratch::default();
        let mut failure = None;
        let mut ordinary = |t: &Self, seg: &str, out: &mut Vec<u32>| {
            if failure.is_some() {
                return;
            }
            match splitter.pieces(seg) {
                Ok(pieces) => {
                    for p in pieces {
                        bpe::encode_piece(&t.ranks, p.as_bytes(), out, &mut scratch);
                    }
                }
                Err(e) => failure = Some(e),
            }
        };
        kimi_chunks(text, |chunk| {
            if allow_special {
                self.for_each_special_split(chunk, &mut out, &mut ordinary);
            } else {
                ordinary(self, chunk, &mut out);
            }
        });
        match failure {
            Some(e) => Err(TokError::Setup(e)),
            None => Ok(out),
        }
    }

    /// Concatenated bytes of `ids`; added tokens give their literal content.
    pub fn decode(&self, ids: &[u32]) -> Result<Vec<u8>, TokError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for (position, &id) in ids.iter().enumerate() {
            let b = self.token_bytes(id).ok_or(TokError::UnknownId {
                id: u64::from(id),
                position,
                vocab_size: self.vocab_size(),
            })?;
            out.extend_from_slice(b);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
