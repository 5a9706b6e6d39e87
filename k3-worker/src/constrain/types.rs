//! The constraint's error and the control ids its grammars name (a leaf both the grammars and
//! the matcher name).

/// Why a constraint could not be built or advanced.
#[derive(Debug, thiserror::Error)]
pub enum ConstrainError {
    /// The tokenizer lacks an id the grammars name.
    #[error("the tokenizer has no {0} token (needed for constrained decoding)")]
    MissingToken(&'static str),
    /// The grammar (e.g. a JSON schema llguidance does not support) was refused.
    #[error("the constraint cannot be compiled: {0}")]
    Grammar(String),
    /// The matcher refused an id or failed (the id is outside the grammar).
    #[error("constrained decoding failed: {0}")]
    Matcher(String),
    /// The mask thread died.
    #[error("the mask computation thread panicked")]
    Thread,
}

/// The ids the grammars name.
#[derive(Clone, Copy, Debug)]
pub struct Ids {
    /// `<|open|>`.
    pub open: u32,
    /// `<|close|>`.
    pub close: u32,
    /// `<|sep|>`.
    pub sep: u32,
    /// `<|end_of_msg|>`.
    pub end_of_msg: u32,
    /// `[EOS]`.
    pub eos: u32,
}
