//! Command-line flag groups shared by the three binaries, defined once and flattened into each
//! (`#[command(flatten)]`): the store socket and the memory budget. Clap validates them (preset
//! names, policy names, GB ranges); the budget keeps command-line order (a later flag overrides
//! an earlier one) through [`BudgetArgs::budget`].

use std::path::PathBuf;

use clap::builder::PossibleValuesParser;

pub use crate::runtime::experts::Preload;
use crate::runtime::plan::{Budget, BudgetError, PRESETS};

/// `--socket PATH`: where the store listens.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SocketArgs {
    /// The store's socket (default $XDG_RUNTIME_DIR/k3/store.sock, else /tmp/k3-$UID/store.sock).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

impl SocketArgs {
    /// The socket given, or this user's default.
    pub fn path(&self) -> PathBuf {
        (self.socket.clone())
            .unwrap_or_else(|| k3_proto::paths::default_socket(crate::ipc::current_uid()))
    }
}

/// Largest budget accepted on the command line, GB.
pub const MAX_GB: f64 = 1e6;

/// A command-line value clap's parser refused (clap prints it as the reason; exit 2).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ValueError {
    /// Not a number.
    #[error("{text:?} is not a number of {unit}")]
    NotANumber {
        /// The value as given.
        text: String,
        /// `GB`, `MB`, ….
        unit: &'static str,
    },
    /// A number outside its range.
    #[error("{value} {unit} outside {range}")]
    OutOfRange {
        /// The value.
        value: f64,
        /// `GB`, `MB`, ….
        unit: &'static str,
        /// The range, as the help text gives it.
        range: &'static str,
    },
    /// A duration out of range, or not a number.
    #[error("{0}: expected seconds between 0.1 and 86400")]
    Seconds(String),
    /// A cache policy this build does not have.
    #[error(
        "unknown cache policy {0:?} (one of {known}, some take :PARAM; see docs/CACHE_POLICY.md)",
        known = crate::runtime::policy::POLICY_NAMES.join(", ")
    )]
    Policy(String),
}

/// A number of `unit` in `[0, max]` (`range` spells the bounds for the message).
pub fn bounded(
    s: &str,
    unit: &'static str,
    max: f64,
    range: &'static str,
) -> Result<f64, ValueError> {
    let v: f64 = s.parse().map_err(|_| ValueError::NotANumber {
        text: s.to_string(),
        unit,
    })?;
    if !(v.is_finite() && (0.0..=max).contains(&v)) {
        return Err(ValueError::OutOfRange {
            value: v,
            unit,
            range,
        });
    }
    Ok(v)
}

fn gb(s: &str) -> Result<f64, ValueError> {
    bounded(s, "GB", MAX_GB, "0..=1000000")
}

fn policy(s: &str) -> Result<String, ValueError> {
    crate::runtime::policy::policy_by_name(s, 1)
        .map(|_| s.to_string())
        .ok_or_else(|| ValueError::Policy(s.to_string()))
}

fn preset_names() -> PossibleValuesParser {
    PossibleValuesParser::new(PRESETS.iter().map(|p| p.name).chain(["auto"]))
}

/// The memory budget: `--preset NAME`, `--trunk-gb X`, `--cache-gb X` (in command-line order, a
/// later one overrides an earlier one), the packed trunk and the expert-cache policy.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct BudgetArgs {
    /// Packed trunk directory (trunk.bin + trunk.json) to stream layers from.
    #[arg(long, value_name = "DIR")]
    pub trunk: Option<PathBuf>,
    /// Memory preset (see `k3-ctl presets`); `auto` (the default when no memory flag is given)
    /// sizes the trunk and the cache from the memory this process may allocate.
    #[arg(long, value_name = "NAME", value_parser = preset_names())]
    pub preset: Vec<String>,
    /// Trunk budget in GB (pinned layers + ring).
    #[arg(long, value_name = "GB", value_parser = gb)]
    pub trunk_gb: Vec<f64>,
    /// Routed-expert cache budget in GB.
    #[arg(long, value_name = "GB", value_parser = gb)]
    pub cache_gb: Vec<f64>,
    /// Expert-cache eviction policy: lru, lfu, layer, layer-lfu (default), lrfu, layer-lrfu,
    /// layer-age (see docs/CACHE_POLICY.md).
    #[arg(long, value_name = "NAME", value_parser = policy)]
    pub cache_policy: Option<String>,
    /// What the expert cache holds before the first token (docs/SPEC.md §6.3).
    #[arg(long, value_name = "WHEN", value_enum, default_value_t = Preload::Auto)]
    pub preload: Preload,
}

/// `--preload auto|on|off`: the runtime's [`Preload`], parsed here (the runtime knows no
/// command line).
impl clap::ValueEnum for Preload {
    fn value_variants<'a>() -> &'a [Self] {
        &[Preload::Auto, Preload::On, Preload::Hot, Preload::Off]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let (name, help) = preload_help(*self);
        Some(clap::builder::PossibleValue::new(name).help(help))
    }
}

/// The name and meaning of a `--preload` value: the one text `--help` shows and the README's
/// flag tables repeat (`preload_values_are_documented_in_the_readme` checks them).
pub fn preload_help(p: Preload) -> (&'static str, &'static str) {
    match p {
        Preload::Auto => (
            "auto",
            "every routed expert when the cache holds them all; else, in a store with \
             --state-dir, as hot; else none",
        ),
        Preload::On => (
            "on",
            "every routed expert; a cache that cannot hold them all is refused (exit 2)",
        ),
        Preload::Hot => (
            "hot",
            "the most used experts of the store's usage history (--state-dir) that fit; \
             refused (exit 2) without --state-dir and in a standalone worker",
        ),
        Preload::Off => ("off", "none: each expert is read on first use"),
    }
}

impl BudgetArgs {
    /// Ids of the flags in this group (for `requires`/`conflicts_with` in a binary).
    pub const IDS: [&'static str; 6] = [
        "trunk",
        "preset",
        "trunk_gb",
        "cache_gb",
        "cache_policy",
        "preload",
    ];

    /// True when any memory flag (preset or GB) was given.
    pub fn any_budget(&self) -> bool {
        !(self.preset.is_empty() && self.trunk_gb.is_empty() && self.cache_gb.is_empty())
    }

    /// The budget the flags describe, in command-line order (`matches` are the parsed matches of
    /// the command this group was flattened into).
    pub fn budget(&self, matches: &clap::ArgMatches) -> Result<Budget, BudgetError> {
        if !self.any_budget() {
            return Ok(Budget::auto());
        }
        if self.preset.iter().any(|p| p == "auto") {
            if self.preset.len() == 1 && self.trunk_gb.is_empty() && self.cache_gb.is_empty() {
                return Ok(Budget::auto());
            }
            return Err(BudgetError::AutoCombined);
        }
        Budget::from_matches(matches, "preset", "trunk_gb", "cache_gb")
    }

    /// The cache policy, [`crate::runtime::policy::DEFAULT_POLICY`] when not given.
    pub fn policy(&self) -> String {
        self.cache_policy
            .clone()
            .unwrap_or_else(|| crate::runtime::policy::DEFAULT_POLICY.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        budget: BudgetArgs,
        #[command(flatten)]
        socket: SocketArgs,
    }

    fn parse(args: &[&str]) -> Result<(T, clap::ArgMatches), clap::Error> {
        let m =
            T::command().try_get_matches_from(std::iter::once("t").chain(args.iter().copied()))?;
        Ok((T::from_arg_matches(&m)?, m))
    }

    #[test]
    fn later_memory_flags_override_earlier_ones() {
        let (t, m) = parse(&["--cache-gb", "40", "--preset", "server"]).unwrap();
        let later_preset = t.budget.budget(&m).unwrap();
        let (t, m) = parse(&["--preset", "server", "--cache-gb", "40"]).unwrap();
        let later_cache = t.budget.budget(&m).unwrap();
        assert_eq!(later_cache.cache_bytes, 40_000_000_000);
        assert_ne!(later_preset.cache_bytes, later_cache.cache_bytes);
        assert_eq!(later_preset.trunk_bytes, later_cache.trunk_bytes);
    }

    #[test]
    fn clap_refuses_unknown_presets_policies_and_bad_sizes() {
        assert!(parse(&["--preset", "huge"]).is_err());
        assert!(parse(&["--cache-policy", "fifo"]).is_err());
        assert!(parse(&["--trunk-gb", "-1"]).is_err());
        assert!(parse(&["--trunk-gb", "nan"]).is_err());
        assert!(parse(&["--cache-gb", "1e9"]).is_err());
        let (t, m) = parse(&[]).unwrap();
        assert!(t.budget.budget(&m).unwrap().auto, "no memory flag = auto");
        let (t, m) = parse(&["--preset", "auto"]).unwrap();
        assert!(t.budget.budget(&m).unwrap().auto);
        let (t, m) = parse(&["--preset", "auto", "--cache-gb", "3"]).unwrap();
        assert!(t.budget.budget(&m).is_err());
        let (t, _) = parse(&["--cache-policy", "layer-lfu"]).unwrap();
        assert_eq!(t.budget.policy(), "layer-lfu");
        assert!(t.socket.path().ends_with("store.sock"));
    }

    #[test]
    fn preload_auto_when_every_expert_fits_on_insists_off_never() {
        let (t, _) = parse(&[]).unwrap();
        assert_eq!(t.budget.preload, Preload::Auto);
        assert!(parse(&["--preload", "always"]).is_err());
        assert_eq!(Preload::Auto.wanted(96, 96), Ok(true));
        assert_eq!(Preload::Auto.wanted(95, 96), Ok(false));
        assert_eq!(Preload::On.wanted(100, 96), Ok(true));
        let e = Preload::On.wanted(3, 96).unwrap_err().to_string();
        assert!(
            e.contains("holds 3 experts") && e.contains("96 routed experts"),
            "{e}"
        );
        assert_eq!(Preload::Off.wanted(96, 96), Ok(false));
        let (t, _) = parse(&["--preload", "off"]).unwrap();
        assert_eq!(t.budget.preload, Preload::Off);
        // `hot` parses, and a standalone process (no usage history) refuses it.
        let (t, _) = parse(&["--preload", "hot"]).unwrap();
        assert_eq!(t.budget.preload, Preload::Hot);
        let e = Preload::Hot.wanted(96, 96).unwrap_err().to_string();
        assert!(
            e.contains("usage history") && e.contains("standalone"),
            "{e}"
        );
    }

    #[test]
    fn preload_values_are_documented_in_the_readme() {
        // Every value --help lists is named in the README's `--preload a|b|…` spellings, and
        // its meaning there is the one --help gives (one source: `preload_help`).
        let readme = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"),
        )
        .unwrap();
        let names: Vec<&str> = <Preload as clap::ValueEnum>::value_variants()
            .iter()
            .map(|p| preload_help(*p).0)
            .collect();
        let spelled = format!("--preload {}", names.join("|"));
        let escaped = format!("--preload {}", names.join("\\|"));
        let spellings = readme.matches(&spelled).count() + readme.matches(&escaped).count();
        assert!(
            spellings >= 2,
            "the README spells {spelled:?} {spellings} times"
        );
        for p in <Preload as clap::ValueEnum>::value_variants() {
            let (name, help) = preload_help(*p);
            assert!(
                readme.contains(&format!("`{name}`: {help}")),
                "the README does not give `{name}`: {help}"
            );
        }
    }
}
