//! k3-ctl's integration tests, in one test binary: one link and one copy of what they share,
//! instead of one binary per file (scripts/test.sh's build time). Each file is a module;
//! run one with `cargo test -p k3-ctl --test ctl_suite FILE::`.

mod inspect;
mod pack_trunk;
