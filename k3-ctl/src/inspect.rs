//! `k3-ctl inspect` (being written).

/// Arguments of `k3-ctl inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory.
    pub model_dir: std::path::PathBuf,
    /// Print a JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_a: Args) -> i32 {
    eprintln!("k3-ctl inspect: not available in this build");
    k3_proto::exit::FAILURE
}
