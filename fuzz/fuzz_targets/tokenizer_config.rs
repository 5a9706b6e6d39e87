//! `tokenizer_config.json` (k3-worker/src/tokenizer/files.rs via `Tokenizer::from_bytes`), with
//! the first 1024 ranks of the real `tiktoken.model`: any bytes give a tokenizer or an error;
//! an accepted one knows its `bos_token`/`eos_token` by content and can encode them.
#![no_main]

use std::path::Path;

use k3_fuzz::{vocab_sample, SAMPLE_RANKS};
use k3_worker::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tok = Tokenizer::from_bytes(
        Path::new("tiktoken.model"),
        vocab_sample(SAMPLE_RANKS),
        Path::new("tokenizer_config.json"),
        data,
    );
    if let Ok(tok) = tok {
        assert_eq!(tok.n_ranks() as usize, SAMPLE_RANKS);
        for id in [tok.bos_id(), tok.eos_id()].into_iter().flatten() {
            let b = tok
                .token_bytes(id)
                .expect("an added token has bytes")
                .to_vec();
            let text = String::from_utf8(b).expect("added-token contents are strings");
            assert_eq!(tok.special_id(&text), Some(id));
            let _ = tok.encode_with_special(&text);
        }
    }
});
