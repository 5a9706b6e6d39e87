//! `k3-worker`: one generation job (see `k3-worker --help` and the README).
//!
//! Wiring only: set up the log, parse the command line, run the job ([`k3_worker::front::run`]),
//! which maps its result to the documented exit code (`k3_proto::exit::report`): 0 ok; 1
//! bind/forward/I/O failure; 2 refused before any work; 3 cannot attach to the store; 4 the run
//! finished but a routed expert failed to load (the ids are unsound).

fn main() {
    k3_store::progress::init_logging();
    let (cli, matches) = k3_worker::front::cli::Cli::parse_with_matches();
    std::process::exit(k3_worker::front::run(&cli, &matches));
}
