//! `k3-ctl presets`: the memory presets (README "Presets").

/// Arguments of `k3-ctl presets`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Print the preset table to stdout.
pub fn run(_a: Args) -> Result<i32, crate::fail::Failed> {
    print!("{}", k3_store::runtime::plan::presets_table());
    Ok(k3_proto::exit::OK)
}
