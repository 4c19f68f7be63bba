//! Sampling transforms and seeded sampling.
//!
//! The transform pipeline (penalties → temperature → top-k → top-p → renormalize) is one pure
//! function, [`probs`], so the speculative verifier can apply exactly the same transform to the
//! target's p and the drafter's q before acceptance. Temperature 0 means greedy: [`argmax`], with
//! ties broken toward the lowest token id so greedy output is deterministic.

use crate::KernelError;
use crate::rng::Rng;

/// User-facing sampling parameters, validated once ([`SamplingParams::validate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off; must lie in (0, 1].
    pub top_p: f32,
    /// 1 = off; > 0. Divides positive logits (multiplies negative ones) of seen tokens.
    pub repetition_penalty: f32,
    /// 0 = off. Subtracted once from the logit of every seen token.
    pub presence_penalty: f32,
    /// 0 = off. Subtracted per occurrence.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |m: String| Err(KernelError::InvalidParam(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }
}

/// Index of the largest logit; ties go to the lowest index. NaN never wins.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// Applies repetition / presence / frequency penalties for the tokens seen so far.
pub fn apply_penalties(logits: &mut [f32], seen: &[u32], p: &SamplingParams) {
    if !p.has_penalties() {
        return;
    }
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &t in seen {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &c) in &counts {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if p.repetition_penalty != 1.0 {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
        *l -= p.presence_penalty + p.frequency_penalty * c as f32;
    }
}

/// The sampling distribution for one position: penalties, temperature, top-k, top-p, renormalized.
/// For greedy parameters it is the one-hot of [`argmax`]. `seen` are the tokens that count for
/// the penalties (prompt and output so far).
pub fn probs(logits: &[f32], seen: &[u32], p: &SamplingParams) -> Vec<f32> {
    let mut l = logits.to_vec();
    apply_penalties(&mut l, seen, p);
    let n = l.len();
    if p.is_greedy() {
        let mut out = vec![0f32; n];
        if n > 0 {
            out[argmax(&l) as usize] = 1.0;
        }
        return out;
    }
    let inv_t = 1.0 / p.temperature;
    let max = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0f64;
    for v in l.iter_mut() {
        let e = if v.is_nan() {
            0.0
        } else {
            ((*v - max) * inv_t).exp()
        };
        *v = e;
        sum += e as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in l.iter_mut() {
        *v *= inv;
    }
    if (p.top_k > 0 && p.top_k < n) || p.top_p < 1.0 {
        // Sort descending by probability, ties by lower id, then keep a prefix.
        let mut idx: Vec<u32> = (0..n as u32).collect();
        let k = if p.top_k > 0 { p.top_k.min(n) } else { n };
        let cmp = |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b));
        if k < n {
            idx.select_nth_unstable_by(k - 1, cmp);
            idx.truncate(k);
        }
        idx.sort_unstable_by(cmp);
        let mut keep = idx.len();
        if p.top_p < 1.0 {
            let kept_mass: f64 = idx.iter().map(|&i| l[i as usize] as f64).sum();
            let mut cum = 0f64;
            for (j, &i) in idx.iter().enumerate() {
                cum += l[i as usize] as f64 / kept_mass;
                if cum >= p.top_p as f64 {
                    keep = j + 1;
                    break;
                }
            }
        }
        let mut out = vec![0f32; n];
        let mut s = 0f64;
        for &i in &idx[..keep] {
            out[i as usize] = l[i as usize];
            s += l[i as usize] as f64;
        }
        let inv = (1.0 / s) as f32;
        for &i in &idx[..keep] {
            out[i as usize] *= inv;
        }
        return out;
    }
    l
}

/// Draws one index from a probability vector (inverse CDF with one uniform).
pub fn sample(probs: &[f32], rng: &mut Rng) -> u32 {
    let total: f64 = probs.iter().map(|&v| v as f64).sum();
    let u = rng.uniform() * total;
    let mut cum = 0f64;
    let mut last = 0u32;
    for (i, &v) in probs.iter().enumerate() {
        if v > 0.0 {
            cum += v as f64;
            last = i as u32;
            if u < cum {
                return i as u32;
            }
        }
    }
    last
}

/// One sampled token from logits under `p` (argmax when greedy).
pub fn sample_logits(logits: &[f32], seen: &[u32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.is_greedy() && !p.has_penalties() {
        return argmax(logits);
    }
    let pr = probs(logits, seen, p);
    if p.is_greedy() {
        return argmax(&pr);
    }
    sample(&pr, rng)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..Default::default()
        }
    }

    #[test]
    fn validation_rejects_bad_values() {
        assert!(params(-1.0, 0, 1.0).validate().is_err());
        assert!(params(f32::NAN, 0, 1.0).validate().is_err());
        assert!(params(1.0, 0, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.5).validate().is_err());
        assert!(params(0.7, 40, 0.9).validate().is_ok());
    }

    #[test]
    fn greedy_ties_go_to_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_keep_the_right_sets() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let pr = probs(&logits, &[], &params(1.0, 2, 1.0));
        assert_eq!(pr[0], 0.0);
        assert_eq!(pr[1], 0.0);
        assert!((pr[2] + pr[3] - 1.0).abs() < 1e-6 && pr[3] > pr[2]);
        // Softmax of 0..3 ≈ [0.032, 0.087, 0.237, 0.644]: top_p 0.7 keeps {3, 2}.
        let pr = probs(&logits, &[], &params(1.0, 0, 0.7));
        assert!(pr[0] == 0.0 && pr[1] == 0.0 && pr[2] > 0.0);
        let pr = probs(&logits, &[], &params(1.0, 0, 0.5));
        assert_eq!(pr[3], 1.0);
    }

    #[test]
    fn sampling_frequencies_follow_probs() {
        let pr = [0.1f32, 0.2, 0.3, 0.4];
        let mut rng = Rng::new(11);
        let mut c = [0usize; 4];
        let n = 200_000;
        for _ in 0..n {
            c[sample(&pr, &mut rng) as usize] += 1;
        }
        for i in 0..4 {
            assert!((c[i] as f64 / n as f64 - pr[i] as f64).abs() < 0.005);
        }
    }

    #[test]
    fn penalties_lower_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            ..Default::default()
        };
        let mut l = [2.0f32, -2.0, 1.0];
        apply_penalties(&mut l, &[0, 1, 1], &p);
        assert_eq!(l, [0.5, -4.5, 1.0]);
    }
}
