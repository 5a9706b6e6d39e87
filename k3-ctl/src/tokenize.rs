//! `k3-ctl tokenize` / `detokenize` (being written).

/// Arguments of `k3-ctl tokenize`.
#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// Tokenizer directory (holds `tiktoken.model` and `tokenizer_config.json`).
    #[arg(long)]
    pub tok: std::path::PathBuf,
}

/// Arguments of `k3-ctl detokenize`.
#[derive(clap::Args, Debug)]
pub struct DetokenizeArgs {
    /// Tokenizer directory.
    #[arg(long)]
    pub tok: std::path::PathBuf,
}

pub fn run_tokenize(_a: TokenizeArgs) -> i32 {
    eprintln!("k3-ctl tokenize: not available in this build");
    k3_proto::exit::FAILURE
}

pub fn run_detokenize(_a: DetokenizeArgs) -> i32 {
    eprintln!("k3-ctl detokenize: not available in this build");
    k3_proto::exit::FAILURE
}
