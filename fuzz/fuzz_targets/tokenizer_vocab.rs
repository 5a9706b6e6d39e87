//! `tiktoken.model` (k3-worker/src/tokenizer/files.rs via `Tokenizer::from_bytes`): any bytes
//! give a tokenizer or an error. An accepted vocabulary is used: encoding and decoding a short
//! text round-trips.
#![no_main]

use std::path::Path;

use k3_worker::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

const CONFIG: &[u8] = br#"{"added_tokens_decoder": {}, "bos_token": null}"#;

fuzz_target!(|data: &[u8]| {
    let tok = Tokenizer::from_bytes(
        Path::new("tiktoken.model"),
        data,
        Path::new("tokenizer_config.json"),
        CONFIG,
    );
    if let Ok(tok) = tok {
        let text = "Hello, wörld! 123 \u{1F600}";
        let ids = tok.encode(text);
        assert_eq!(tok.decode(&ids).expect("decodes"), text.as_bytes());
        assert!(tok.vocab_size() >= tok.n_ranks() as usize);
    }
});
