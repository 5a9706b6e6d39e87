//! `k3-worker`: one generation job (see `k3-worker --help` and the README).
//!
//! Wiring only: parse the command line, run the job ([`k3_worker::job::run`]), map its result to
//! the documented exit code ([`k3_proto::exit::report`]): 0 ok; 1 bind/forward/I/O failure;
//! 2 refused before any work; 3 cannot attach to the store; 4 the run finished but a routed
//! expert failed to load (the ids are unsound).

fn main() {
    k3_store::progress::init_logging();
    let (cli, matches) = k3_worker::cli::Cli::parse_with_matches();
    if cli.serve_channel {
        // The job arrives from k3-ctl serve; the result goes back as a typed message.
        std::process::exit(k3_worker::serve_channel::run(&cli, &matches));
    }
    let result = k3_worker::job::run(&cli, &matches);
    std::process::exit(k3_proto::exit::report("k3-worker", result));
}
