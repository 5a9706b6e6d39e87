//! `k3-ctl`: control and observation of k3 (see the README for every subcommand).

use clap::{Parser, Subcommand};

mod census;
mod doctor;
mod fail;
mod inspect;
mod pack;
mod presets;
mod replay;
mod serve;
mod store_cmds;
mod tokenize;
mod verify;

/// k3 control: inspect, pack and verify checkpoints, tokenize, talk to the store, serve HTTP.
#[derive(Parser, Debug)]
#[command(name = "k3-ctl", version = k3_proto::VERSION, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the config summary, layer map and tensor census of a checkpoint directory.
    Inspect(inspect::Args),
    /// Encode text as user text and print the ids as one comma-separated line.
    Tokenize(tokenize::TokenizeArgs),
    /// Write the exact bytes of a list of ids.
    Detokenize(tokenize::DetokenizeArgs),
    /// Is a store up: model, preset, memory, clients.
    Status(store_cmds::SocketArg),
    /// The store's counters: TRUE resident hit rate, misses, evictions, bytes read, per job.
    Stats(store_cmds::StatsArgs),
    /// The store's live jobs: tokens so far, seconds per token, bytes read.
    Ps(store_cmds::PsArgs),
    /// The store's kept conversations: name, ids held, size, idle time.
    Sessions(store_cmds::SessionsArgs),
    /// Ask the store to drain and exit; waits until its socket is gone.
    Stop(store_cmds::SocketArg),
    /// Copy every layer's trunk tensors into trunk.bin + trunk.json (one aligned run per layer).
    PackTrunk(pack::Args),
    /// Print the memory presets (trunk / expert-cache budgets).
    Presets(presets::Args),
    /// Replay expert-cache traces: TRUE hit rate per eviction policy and capacity vs Belady.
    ReplayTrace(replay::Args),
    /// CPU, SIMD tiers, RAM -> recommended preset, disk bandwidth measured the way the engine reads.
    Doctor(doctor::Args),
    /// EC-BF16 census of a checkpoint's trunk: bits per weight, escape rate, palette per tensor
    /// and class (nothing written).
    Census(census::Args),
    /// Check every byte: the shards end to end, and each packed trunk layer against its checksum.
    Verify(verify::Args),
    /// OpenAI-compatible HTTP server in front of a running store (one worker, its slots decoded
    /// together).
    Serve(Box<serve::Args>),
}

fn main() {
    k3_store::progress::init_logging();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() {
                k3_proto::exit::REFUSED
            } else {
                k3_proto::exit::OK
            };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    // The one place a subcommand's error is printed and its exit code picked.
    use k3_proto::exit::report;
    let code = match cli.cmd {
        Cmd::Inspect(a) => report("k3-ctl inspect", inspect::run(a)),
        Cmd::Tokenize(a) => report("k3-ctl tokenize", tokenize::run_tokenize(a)),
        Cmd::Detokenize(a) => report("k3-ctl detokenize", tokenize::run_detokenize(a)),
        Cmd::Status(a) => report("k3-ctl status", store_cmds::run_status(a)),
        Cmd::Stats(a) => report("k3-ctl stats", store_cmds::run_stats(a)),
        Cmd::Stop(a) => report("k3-ctl stop", store_cmds::run_stop(a)),
        Cmd::Ps(a) => report("k3-ctl ps", store_cmds::run_ps(a)),
        Cmd::Sessions(a) => report("k3-ctl sessions", store_cmds::run_sessions(a)),
        Cmd::PackTrunk(a) => report("k3-ctl pack-trunk", pack::run(a)),
        Cmd::Presets(a) => report("k3-ctl presets", presets::run(a)),
        Cmd::ReplayTrace(a) => report("k3-ctl replay-trace", replay::run(a)),
        Cmd::Doctor(a) => report("k3-ctl doctor", doctor::run(a)),
        Cmd::Verify(a) => report("k3-ctl verify", verify::run(a)),
        Cmd::Census(a) => report("k3-ctl census", census::run(a)),
        Cmd::Serve(a) => report("k3-ctl serve", serve::run(*a)),
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
