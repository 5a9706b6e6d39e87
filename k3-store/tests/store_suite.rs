//! k3-store's integration tests, in one test binary: one link and one copy of what they share,
//! instead of one binary per file (scripts/test.sh's build time). Each file is a module;
//! run one with `cargo test -p k3-store --test store_suite FILE::`.

mod attached;
mod bench_io;
mod checkpoint;
mod common;
mod daemon_server;
mod module_graph;
mod policy;
