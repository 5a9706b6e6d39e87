//! SIMD tier: CPU detection and the `K3_SIMD` switch, decided once per process.

use std::fmt;
use std::sync::OnceLock;

/// Environment variable that forces a tier: `scalar`, `avx2`, `avx512` or `neon` (`auto`, empty
/// or unset: the best tier this CPU supports).
pub const SIMD_ENV: &str = k3_proto::paths::env::K3_SIMD;

/// A kernel implementation level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Portable Rust; the reference every other tier is tested against.
    Scalar,
    /// AVX2 + FMA (256-bit).
    Avx2,
    /// AVX-512 F + BW + VL, with AVX2 and FMA (512-bit; its coded-row decode is the AVX2
    /// tier's). Never the AVX-512 BF16 dot instructions: they
    /// would round the activations to bf16.
    Avx512,
    /// aarch64 NEON (Advanced SIMD, 128-bit; every aarch64 CPU has it): the AVX2 tier's
    /// operation sequence on two vectors of 4 lanes, so the same bits as AVX2. Never the
    /// BF16 extension's dot instructions (`BFMLAL`/`BFDOT`): they round the activations to bf16.
    Neon,
}

impl Tier {
    /// Every tier, slowest first (of the tiers of one architecture).
    pub const ALL: [Tier; 4] = [Tier::Scalar, Tier::Avx2, Tier::Avx512, Tier::Neon];

    /// The name used by `K3_SIMD` and in run reports.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Neon => "neon",
        }
    }

    /// Parses a `K3_SIMD` name.
    pub fn from_name(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Whether this CPU can run the tier (runtime detection; cached by std).
    pub fn is_available(self) -> bool {
        match self {
            Tier::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
            Tier::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)] // every tier of this architecture is matched above
            _ => false,
        }
    }

    /// The fastest tier this CPU supports.
    pub fn best_available() -> Tier {
        Tier::ALL
            .into_iter()
            .rev()
            .find(|t| t.is_available())
            .unwrap_or(Tier::Scalar)
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why `K3_SIMD` cannot be honoured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// The value names no tier.
    #[error("{SIMD_ENV}={0:?} is not a SIMD tier (expected scalar, avx2, avx512, neon or auto)")]
    Unknown(String),
    /// The named tier needs instructions this CPU lacks.
    #[error("{SIMD_ENV}={tier} was requested but this CPU lacks the instructions it needs (best available: {best})")]
    Unavailable {
        /// The tier asked for.
        tier: Tier,
        /// What the CPU can run.
        best: Tier,
    },
}

/// Chooses the tier from an explicit `K3_SIMD` value (`None` = unset). Pure apart from CPU
/// detection; [`select_tier`] caches its result for the process.
pub fn choose_tier(env: Option<&str>) -> Result<Tier, TierError> {
    let best = Tier::best_available();
    match env.map(str::trim) {
        None | Some("") | Some("auto") => Ok(best),
        Some(v) => {
            let tier = Tier::from_name(v).ok_or_else(|| TierError::Unknown(v.to_string()))?;
            if tier.is_available() {
                Ok(tier)
            } else {
                Err(TierError::Unavailable { tier, best })
            }
        }
    }
}

static SELECTED: OnceLock<Result<Tier, TierError>> = OnceLock::new();

/// The process's tier: read `K3_SIMD` and detect the CPU on first call, then cached. Binaries
/// call this at start-up and refuse to run (exit 2, message = the error) when it fails.
pub fn select_tier() -> Result<Tier, TierError> {
    SELECTED
        .get_or_init(|| {
            let v = std::env::var_os(SIMD_ENV).map(|v| v.to_string_lossy().into_owned());
            choose_tier(v.as_deref())
        })
        .clone()
}

/// The tier the free kernel functions run (for run reports).
///
/// # Panics
/// If [`select_tier`] fails. Binaries must call `select_tier` first and refuse to start on an
/// error, so this only fires in a program that skipped that check; running a different tier than
/// the one explicitly forced would silently compute a (slightly) different model.
pub fn active_tier() -> Tier {
    match select_tier() {
        Ok(t) => t,
        Err(e) => panic!("{e} (call kernels::select_tier() at start-up to report this)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values() {
        let best = Tier::best_available();
        assert_eq!(choose_tier(None), Ok(best));
        assert_eq!(choose_tier(Some("")), Ok(best));
        assert_eq!(choose_tier(Some("auto")), Ok(best));
        assert_eq!(choose_tier(Some(" scalar ")), Ok(Tier::Scalar));
        assert!(matches!(
            choose_tier(Some("avx9")),
            Err(TierError::Unknown(v)) if v == "avx9"
        ));
        assert!(matches!(
            choose_tier(Some("AVX2")),
            Err(TierError::Unknown(_))
        ));
        for t in Tier::ALL {
            let r = choose_tier(Some(t.name()));
            if t.is_available() {
                assert_eq!(r, Ok(t));
            } else {
                assert_eq!(r, Err(TierError::Unavailable { tier: t, best }));
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for t in Tier::ALL {
            assert_eq!(Tier::from_name(t.name()), Some(t));
            assert_eq!(t.to_string(), t.name());
        }
        assert!(Tier::Scalar.is_available());
        assert!(Tier::best_available().is_available());
    }
}
