//! What of the generated ids is shown as text: the bytes of ordinary (BPE) ids only.
//!
//! An added token — a control marker such as `<|im_end|>` or `[EOS]`, or one of the unnamed
//! `<|reserved_token_N|>` slots — is a signal, not text: printing its content would show a
//! reply's reader a string the model never wrote as text (and a random-weight or confused model
//! does sample reserved slots). As llama.cpp and ollama do by default, such ids are left out of
//! every text shown (stdout of a prompt, a chat reply, a `--batch` line's `text`, a serve reply's
//! content, reasoning and tool-call text);
//! the ids themselves stay in the JSON reports.

use crate::tokenizer::{TokError, Tokenizer};

/// Whether `id` is one of the tokenizer's added tokens (control markers and reserved slots).
pub fn is_added(tok: &Tokenizer, id: u32) -> bool {
    id >= tok.n_ranks() && (id as usize) < tok.vocab_size()
}

/// The text bytes of one id: empty for an added token; `None` when the id is out of range.
pub fn token_bytes(tok: &Tokenizer, id: u32) -> Option<&[u8]> {
    if is_added(tok, id) {
        Some(&[])
    } else {
        tok.token_bytes(id)
    }
}

/// The text of `ids` with added tokens left out; an id outside the vocabulary is an error, as in
/// [`Tokenizer::decode`].
pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<Vec<u8>, TokError> {
    tok.decode(ids)?;
    let shown: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| !is_added(tok, id))
        .collect();
    tok.decode(&shown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn kimi() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
        Tokenizer::from_dir(&dir).expect("fixtures/tokenizer loads")
    }

    #[test]
    fn reserved_and_control_ids_are_never_text() {
        let t = kimi();
        let hello = t.encode("Hello world");
        let reserved = t
            .special_id("<|reserved_token_163597|>")
            .expect("a reserved slot");
        let eos = t.eos_id().expect("an eos id");
        let open = t.special_id("<|open|>").expect("the <|open|> marker");
        let mut ids = vec![reserved];
        ids.extend(&hello);
        ids.extend([open, eos]);
        let text = String::from_utf8(decode(&t, &ids).unwrap()).unwrap();
        assert_eq!(text, "Hello world", "added tokens printed as text");
        for id in [reserved, eos, open] {
            assert!(is_added(&t, id), "{id}");
            assert_eq!(token_bytes(&t, id), Some(&[][..]), "{id}");
        }
        // Ordinary ids keep their bytes; an id beyond the vocabulary is still refused.
        assert_eq!(token_bytes(&t, hello[0]), t.token_bytes(hello[0]));
        assert!(token_bytes(&t, t.vocab_size() as u32).is_none());
        assert!(decode(&t, &[t.vocab_size() as u32]).is_err());
    }
}
