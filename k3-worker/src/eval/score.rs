//! The arithmetic of scoring one position: log-softmax (in f64), the negative log-likelihood of
//! the next id, the KL divergence from a base distribution and the top-1 id; and the summary of
//! many positions (mean, nearest-rank 99th percentile). Pure functions: tested here against
//! hand-computed values.

/// One position's log-probabilities `log p_i = l_i − log Σ_j exp(l_j)` of the logits `l`,
/// computed in f64 (the maximum subtracted first) and rounded to f32 into `out` — the form both
/// a saved base and a compared run use, so a run compared with itself has a KL of exactly 0.
pub fn log_softmax_into(logits: &[f32], out: &mut Vec<f32>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    let log_z = m + sum.ln();
    out.clear();
    out.extend(logits.iter().map(|&l| (l as f64 - log_z) as f32));
}

/// The first index of the largest value (the engine's greedy rule; NaN never wins).
pub fn top1(v: &[f32]) -> u32 {
    crate::kernels::argmax(v)
}

/// `KL(P ‖ Q) = Σ_i p_i (log p_i − log q_i)` in nats, in f64, from the log-probabilities of the
/// base `log_p` and of the compared run `log_q` (ids where `p_i = 0` add nothing).
pub fn kl(log_p: &[f32], log_q: &[f32]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&a, &b)| {
            let p = (a as f64).exp();
            if p == 0.0 {
                0.0
            } else {
                p * (a as f64 - b as f64)
            }
        })
        .sum()
}

/// The value at the nearest rank `⌈q·n⌉` of the sorted `v` (q in (0, 1]; `None` when empty):
/// the 99th percentile of n = 1000 KL values is the 990th smallest.
pub fn percentile(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    Some(s[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_normalises_and_matches_a_hand_computation() {
        let mut out = Vec::new();
        log_softmax_into(&[1.0, 2.0, 3.0], &mut out);
        let z = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        for (i, &v) in out.iter().enumerate() {
            assert!((v as f64 - ((i + 1) as f64 - z)).abs() < 1e-6, "{out:?}");
        }
        let s: f64 = out.iter().map(|&v| (v as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
        // Large logits do not overflow.
        log_softmax_into(&[1000.0, 1000.0], &mut out);
        assert!((out[0] as f64 - (0.5f64).ln()).abs() < 1e-6, "{out:?}");
    }

    #[test]
    fn kl_is_zero_for_the_same_distribution_and_matches_a_hand_computation() {
        let p = [0.5f64.ln() as f32, 0.25f64.ln() as f32, 0.25f64.ln() as f32];
        assert_eq!(kl(&p, &p), 0.0);
        let q = [0.25f64.ln() as f32, 0.5f64.ln() as f32, 0.25f64.ln() as f32];
        // 0.5·ln 2 + 0.25·ln 0.5 = 0.25·ln 2.
        assert!((kl(&p, &q) - 0.25 * 2f64.ln()).abs() < 1e-7);
        // An id the base gives no mass adds nothing, whatever the other says.
        let p0 = [0.0f32, f32::NEG_INFINITY];
        assert_eq!(kl(&p0, &[-1.0, -0.5]), 1.0);
    }

    #[test]
    fn percentile_is_the_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), Some(990.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[5.0], 0.5), Some(5.0));
        assert_eq!(percentile(&[], 0.99), None);
    }

    #[test]
    fn top1_takes_the_first_of_equal_values() {
        assert_eq!(top1(&[0.1, 0.7, 0.7, 0.2]), 1);
    }
}
