//! How the next id is chosen (greedy argmax or seeded top-p sampling with PCG32), and the
//! positions a request needs.

/// PCG32 (XSH-RR), a small deterministic generator for sampling.
#[derive(Clone, Debug)]
pub struct Pcg32 {
    state: u64,
    inc: u64,
}

impl Pcg32 {
    const MUL: u64 = 6_364_136_223_846_793_005;

    /// Seeded generator (stream 54, the reference default).
    pub fn new(seed: u64) -> Pcg32 {
        let mut g = Pcg32 {
            state: 0,
            inc: (54 << 1) | 1,
        };
        g.next_u32();
        g.state = g.state.wrapping_add(seed);
        g.next_u32();
        g
    }

    /// Next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(Self::MUL).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        let hi = (self.next_u32() >> 5) as u64; // 27 bits
        let lo = (self.next_u32() >> 6) as u64; // 26 bits
        ((hi << 26) | lo) as f64 / (1u64 << 53) as f64
    }
}

pub use crate::kernels::argmax;

/// How the next token is chosen.
#[derive(Clone, Debug)]
pub enum Sampler {
    /// Argmax.
    Greedy,
    /// Temperature + nucleus sampling with a seeded PCG32.
    TopP {
        /// Softmax temperature (> 0).
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
        /// Generator.
        rng: Pcg32,
    },
}

/// Sampling settings out of range (a refusal before any work).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A negative or non-finite temperature.
    #[error("--temperature {0} must be ≥ 0")]
    Temperature(f32),
    /// A top-p outside (0, 1].
    #[error("--top-p {0} must be in (0, 1]")]
    TopP(f32),
}

impl Sampler {
    /// Greedy when `temperature` is 0, else top-p sampling; rejects out-of-range values.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Result<Sampler, SamplingError> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(SamplingError::Temperature(temperature));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(SamplingError::TopP(top_p));
        }
        Ok(if temperature == 0.0 {
            Sampler::Greedy
        } else {
            Sampler::TopP {
                temperature,
                top_p,
                rng: Pcg32::new(seed),
            }
        })
    }

    /// Pick a token from `logits`.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        match self {
            Sampler::Greedy => argmax(logits),
            Sampler::TopP {
                temperature,
                top_p,
                rng,
            } => {
                let m = logits[argmax(logits) as usize] as f64;
                let t = *temperature as f64;
                let p: Vec<f64> = logits
                    .iter()
                    .map(|&l| {
                        if l.is_nan() {
                            0.0
                        } else {
                            ((l as f64 - m) / t).exp()
                        }
                    })
                    .collect();
                let z: f64 = p.iter().sum();
                let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
                idx.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
                // Smallest prefix whose mass reaches top_p (at least one token).
                let mut mass = 0.0;
                let mut keep = 0;
                for &i in &idx {
                    mass += p[i as usize] / z;
                    keep += 1;
                    if mass >= *top_p as f64 {
                        break;
                    }
                }
                let kept = &idx[..keep];
                let total: f64 = kept.iter().map(|&i| p[i as usize]).sum();
                let r = rng.next_f64() * total;
                let mut acc = 0.0;
                for &i in kept {
                    acc += p[i as usize];
                    if r < acc {
                        return i;
                    }
                }
                kept[keep - 1]
            }
        }
    }
}

/// Positions a request needs: the prompt (or conversation) plus every generated token fed back
/// (the last one is never fed).
pub fn positions_needed(prompt_len: usize, max_new: usize) -> usize {
    prompt_len + max_new.saturating_sub(1)
}

/// Default prompt rows a step runs (`--prefill-chunk`): about half a GB of activations per
/// chunk at full scale.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_first_index_wins_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(
            argmax(&[0.5, f32::NAN, 2.0, f32::INFINITY, 7.0, f32::INFINITY]),
            3
        );
    }

    #[test]
    fn pcg32_matches_the_reference_sequence() {
        // pcg32_srandom(42, 54) → first outputs of the PCG reference demo.
        let mut g = Pcg32::new(42);
        let got: Vec<u32> = (0..6).map(|_| g.next_u32()).collect();
        assert_eq!(
            got,
            [0xa15c02b7, 0x7b47f409, 0xba1d3330, 0x83d2f293, 0xbfa4784b, 0xcbed606e]
        );
    }

    #[test]
    fn tiny_top_p_is_greedy_and_sampling_is_seeded() {
        let logits = [0.1f32, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(1.0, 1e-6, 7).unwrap();
        assert!((0..50).all(|_| s.pick(&logits) == 1));
        let draw = |seed| {
            let mut s = Sampler::new(1.0, 1.0, seed).unwrap();
            (0..64).map(|_| s.pick(&logits)).collect::<Vec<u32>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        let d = draw(3);
        // Both high-probability tokens show up; the p≈0.3% token rarely does.
        assert!(d.contains(&1) && d.contains(&2), "{d:?}");
        assert!(Sampler::new(-1.0, 1.0, 0).is_err());
        assert!(Sampler::new(1.0, 0.0, 0).is_err());
        assert!(matches!(
            Sampler::new(0.0, 1.0, 0).unwrap(),
            Sampler::Greedy
        ));
    }
}
