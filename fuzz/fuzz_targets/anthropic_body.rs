//! The Anthropic Messages request body (k3-ctl/src/serve/anthropic.rs, with the shared request
//! code it uses: api.rs, reply.rs, shape.rs, text.rs — compiled here from their files, as serve compiles
//! them): any bytes give a request or a 4xx naming what is wrong, never a panic or a 5xx; a
//! request that passes has settings inside the documented ranges (the shared single-precision
//! validation included), and its conversation renders to a prompt (or a 400 for `messages`),
//! for a generation and for `count_tokens` alike.
#![no_main]

use std::sync::OnceLock;

use k3_fuzz::repo_root;
use k3_worker::text::xtml::{ChatFormat, Options};
use k3_worker::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

// The serve modules the Messages route parses with, from serve's own files (at the crate root:
// their `super::` is serve's module, here the root).
#[allow(dead_code, unused_imports)]
#[path = "../../k3-ctl/src/serve/anthropic.rs"]
mod anthropic;
#[allow(dead_code, unused_imports)]
#[path = "../../k3-ctl/src/serve/api.rs"]
mod api;
#[allow(dead_code, unused_imports)]
#[path = "../../k3-ctl/src/serve/reply.rs"]
mod reply;
#[allow(dead_code, unused_imports)]
#[path = "../../k3-ctl/src/serve/shape.rs"]
mod shape;
#[allow(dead_code, unused_imports)]
#[path = "../../k3-ctl/src/serve/text.rs"]
mod text;

use anthropic::{prepare, settings, MessagesRequest};
use api::ApiError;

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_dir(&repo_root().join("fixtures/tokenizer")).expect("tokenizer"))
}

fn client_error(e: &ApiError, what: &str) {
    assert!(
        e.status.is_client_error(),
        "{what}: a request body gave {} ({})",
        e.status,
        e.message
    );
}

fuzz_target!(|data: &[u8]| {
    let Ok(r) = serde_json::from_slice::<MessagesRequest>(data) else {
        return;
    };
    for count_only in [false, true] {
        match settings(&r, 7, count_only) {
            Ok(s) => {
                assert!((0.0..=1.0).contains(&s.temperature), "{}", s.temperature);
                assert!(s.temperature == 0.0 || s.temperature.is_normal());
                assert!(s.top_p > 0.0 && s.top_p <= 1.0 && s.top_p.is_normal());
                assert!((1..=api::MAX_GEN).contains(&s.max_new));
                assert!(s.stops.iter().all(|t| !t.is_empty()));
                let sampling = k3_proto::serve::Sampling {
                    temperature: s.temperature,
                    top_p: s.top_p,
                    seed: s.seed,
                };
                assert_eq!(sampling.validate(), Ok(()), "the worker would refuse it");
            }
            Err(e) => client_error(&e, "settings"),
        }
    }
    let p = match prepare(&r) {
        Ok(p) => p,
        Err(e) => return client_error(&e, "prepare"),
    };
    let Ok(fmt) = ChatFormat::new(tok(), p.thinking) else {
        panic!("the chat format of the shipped tokenizer");
    };
    let opts = Options {
        tools: p.tools.clone(),
        choice: p.choice,
        format: None,
    };
    // A conversation that cannot be rendered is the route's 400 for `messages`; one that can
    // is a prompt of ids in the vocabulary.
    if let Ok(ids) = fmt.render_with(&p.history, &opts, true) {
        assert!(!ids.is_empty());
    }
});
