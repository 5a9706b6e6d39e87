//! k3-proto's integration tests, in one test binary: one link and one copy of what they share,
//! instead of one binary per file (scripts/test.sh's build time). Each file is a module;
//! run one with `cargo test -p k3-proto --test proto_suite FILE::`.

mod common;
mod config;
mod index_basic;
mod index_errors;
mod index_scale;
mod names;
