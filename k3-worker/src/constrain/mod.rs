//! Grammar-constrained decoding through llguidance (the structured-output library llama.cpp
//! uses): JSON output (`response_format` `json_object` / `json_schema`) and K3's XTML tool call
//! (`tool_choice` `required` / a named function), over k3's real 163,840-id vocabulary.
//!
//! * [`Vocab`] is built once per tokenizer: llguidance's token trie over every id's bytes (a
//!   special id as `0xFF` + its name, so grammars can name it and no text lexeme can produce
//!   it), with k3's own BPE as the tokenizer.
//! * [`Spec`] says what the reply must be; [`grammar`] writes it as a Lark grammar of the whole
//!   reply after the generation prompt — the think channel (free text) when thinking is on, the
//!   response channel holding the JSON, or a `tools` element of well-formed calls whose
//!   arguments match each tool's JSON schema — then `<|close|>message<|sep|>` and an end id.
//! * [`Constraint`] is one sequence's state. Per step the runner asks for the [`TokenMask`] (the
//!   allowed ids as a bitset), applies it to the logits ([`apply`]; with no constraint this is
//!   a no-op, so unconstrained ids stay bit-identical), picks, and [`Constraint::commit`]s the
//!   id. [`MaskAhead`] computes the next mask on a thread of its own as soon as the id is
//!   committed, so it overlaps the forward pass instead of following it.
//! * [`Constraint::is_accepting`] says whether the reply may end here and
//!   [`Constraint::is_finished`] whether the grammar is complete (only an end may follow).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

pub mod grammar;
mod types;

pub use grammar::Spec;
pub use types::{ConstrainError, Ids};

/// k3's tokenizer as llguidance's token environment.
struct Env {
    tok: Arc<Tokenizer>,
    trie: TokTrie,
}

impl toktrie::TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        // Text: k3's own BPE (specials disabled); bytes that are not UTF-8: the trie's greedy
        // split (llguidance only asks for those when forcing partial characters).
        match self.tok.encode_bytes(s, false) {
            Ok(ids) => ids,
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The token environment and grammar compiler for one tokenizer (build once, share).
#[derive(Clone)]
pub struct Vocab {
    factory: Arc<ParserFactory>,
    ids: Ids,
    size: usize,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("size", &self.size)
            .field("ids", &self.ids)
            .finish()
    }
}

impl Vocab {
    /// The environment over every id of `tok`.
    pub fn new(tok: Arc<Tokenizer>) -> Result<Vocab, ConstrainError> {
        let get = |s: &'static str| tok.special_id(s).ok_or(ConstrainError::MissingToken(s));
        let ids = Ids {
            open: get("<|open|>")?,
            close: get("<|close|>")?,
            sep: get("<|sep|>")?,
            end_of_msg: get("<|end_of_msg|>")?,
            eos: get("[EOS]")?,
        };
        let size = tok.vocab_size();
        let n_ranks = tok.n_ranks();
        let words: Vec<Vec<u8>> = (0..size as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id).unwrap_or(&[]);
                if id < n_ranks {
                    bytes.to_vec()
                } else {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                }
            })
            .collect();
        let info = TokRxInfo {
            tok_end_of_turn: Some(ids.eos),
            ..TokRxInfo::new(size as u32, ids.end_of_msg)
        };
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { tok, trie });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| ConstrainError::Grammar(e.to_string()))?;
        factory.quiet();
        Ok(Vocab {
            factory: Arc::new(factory),
            ids,
            size,
        })
    }

    /// The vocabulary size (the mask's length).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The marker ids.
    pub fn ids(&self) -> Ids {
        self.ids
    }
}

/// The allowed ids of one step, a bitset over the vocabulary.
#[derive(Clone, Debug)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// May `id` be picked?
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.0.len() && self.0.is_allowed(id)
    }

    /// How many ids are allowed.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }

    /// The allowed ids, ascending.
    pub fn allowed(&self) -> Vec<u32> {
        let mut v = Vec::new();
        self.0.iter_set_entries(|i| v.push(i as u32));
        v
    }
}

/// Apply a step's mask to its logits: every id the mask does not allow gets −∞. `None` (no
/// constraint) leaves the logits untouched, bit for bit.
pub fn apply(mask: Option<&TokenMask>, logits: &mut [f32]) {
    if let Some(m) = mask {
        for (id, l) in logits.iter_mut().enumerate() {
            if !m.allows(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// One sequence's constraint.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

fn matcher_err(e: impl std::fmt::Display) -> ConstrainError {
    ConstrainError::Matcher(e.to_string())
}

impl Constraint {
    /// The constraint for `spec` on a reply after the generation prompt (`thinking`: the reply
    /// starts inside the think channel).
    pub fn new(vocab: &Vocab, spec: &Spec, thinking: bool) -> Result<Constraint, ConstrainError> {
        let lark = grammar::lark(spec, &vocab.ids, thinking)?;
        let parser = vocab
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| ConstrainError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstrainError::Grammar(e));
        }
        Ok(Constraint { matcher })
    }

    /// The ids allowed next.
    pub fn mask(&mut self) -> Result<TokenMask, ConstrainError> {
        self.matcher
            .compute_mask()
            .map(TokenMask)
            .map_err(matcher_err)
    }

    /// Take the picked id (one the last mask allowed).
    pub fn commit(&mut self, id: u32) -> Result<(), ConstrainError> {
        self.matcher.consume_token(id).map_err(matcher_err)
    }

    /// May the reply end here?
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// The grammar is complete: nothing but the end can follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The matcher's error, if it failed.
    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }
}

/// A mask being computed off the critical path: started right after an id is committed (while
/// the forward pass of the next step runs), taken when the logits are ready.
#[derive(Debug)]
pub struct MaskAhead(std::thread::JoinHandle<(Constraint, Result<TokenMask, ConstrainError>)>);

impl MaskAhead {
    /// Start computing `c`'s next mask on a thread of its own.
    pub fn start(mut c: Constraint) -> MaskAhead {
        MaskAhead(std::thread::spawn(move || {
            let m = c.mask();
            (c, m)
        }))
    }

    /// Wait for the mask; the constraint comes back for the commit.
    pub fn wait(self) -> Result<(Constraint, TokenMask), ConstrainError> {
        let (c, m) = self.0.join().map_err(|_| ConstrainError::Thread)?;
        Ok((c, m?))
    }
}
