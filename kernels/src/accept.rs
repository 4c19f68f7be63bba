//! Lossless speculative acceptance (Leviathan et al. 2023, Chen et al. 2023): accept draft token
//! x_k with probability min(1, p_k(x_k) / q_k(x_k)); on the first rejection sample from the
//! residual norm(max(0, p_k − q_k)) and stop; if all K pass, sample a bonus token from p_{K+1}.
//! The committed tokens are then distributed exactly as the target's own sampling.
//!
//! `p` and `q` must already carry the same sampling transform (temperature, top-k, top-p,
//! penalties — see [`crate::sampling::probs`]). Greedy decoding (temperature 0) is the special
//! case [`verify_greedy`]: accept iff x_k is the target's argmax, which reproduces plain greedy
//! decoding token for token.

use crate::rng::Rng;
use crate::sampling::sample;

/// The drafter's distribution at one position.
#[derive(Clone, Copy, Debug)]
pub enum DraftDist<'a> {
    /// Full vocabulary probabilities.
    Dense(&'a [f32]),
    /// Support and probabilities of a truncated proposal (e.g. top-k sampling); all other tokens
    /// have q = 0.
    Sparse(&'a [(u32, f32)]),
    /// A deterministic proposer (n-gram lookup, greedy drafter): q is one-hot at the draft token.
    OneHot,
}

impl DraftDist<'_> {
    fn q_of(&self, tok: u32, draft: u32) -> f32 {
        match self {
            DraftDist::Dense(q) => q.get(tok as usize).copied().unwrap_or(0.0),
            DraftDist::Sparse(s) => s
                .iter()
                .find(|(t, _)| *t == tok)
                .map(|(_, v)| *v)
                .unwrap_or(0.0),
            DraftDist::OneHot => (tok == draft) as u32 as f32,
        }
    }
}

/// Outcome of verifying one window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Draft tokens accepted (a prefix of the draft).
    pub accepted: usize,
    /// The token after the accepted prefix: the residual sample on a rejection, the bonus
    /// otherwise.
    pub next: u32,
    /// Whether `next` is a bonus token (all drafts accepted).
    pub bonus: bool,
}

/// Samples from norm(max(0, p − q)). When the residual mass vanishes (p ≤ q everywhere, which
/// only happens when p = q up to rounding, and then rejection has probability ~0) falls back to p.
pub fn sample_residual(p: &[f32], q: &DraftDist<'_>, draft: u32, rng: &mut Rng) -> u32 {
    let mut r: Vec<f32> = p.to_vec();
    match q {
        DraftDist::Dense(qd) => {
            for (ri, qi) in r.iter_mut().zip(qd.iter()) {
                *ri = (*ri - qi).max(0.0);
            }
        }
        DraftDist::Sparse(s) => {
            for &(t, v) in s.iter() {
                if let Some(ri) = r.get_mut(t as usize) {
                    *ri = (*ri - v).max(0.0);
                }
            }
        }
        DraftDist::OneHot => {
            if let Some(ri) = r.get_mut(draft as usize) {
                *ri = (*ri - 1.0).max(0.0);
            }
        }
    }
    if crate::sampling::positive_mass(&r) <= 1e-12 {
        return sample(p, rng);
    }
    sample(&r, rng)
}

/// Verifies a window of `draft.len() = K` tokens. `p` holds K+1 target distributions (the last
/// one for the bonus), `q` the K draft distributions.
pub fn verify(draft: &[u32], q: &[DraftDist<'_>], p: &[&[f32]], rng: &mut Rng) -> Verdict {
    debug_assert_eq!(q.len(), draft.len());
    debug_assert_eq!(p.len(), draft.len() + 1);
    for (k, &x) in draft.iter().enumerate() {
        let px = p[k].get(x as usize).copied().unwrap_or(0.0);
        let qx = q[k].q_of(x, x);
        // u < p/q with u ∈ [0, 1): a token the drafter could not have proposed (q = 0) is
        // rejected; p ≥ q always accepts. In f64: rounding u to f32 would reject the draws
        // within half an ulp below p/q.
        let accept = qx > 0.0 && (px >= qx || rng.uniform() * (qx as f64) < px as f64);
        if !accept {
            let next = sample_residual(p[k], &q[k], x, rng);
            return Verdict {
                accepted: k,
                next,
                bonus: false,
            };
        }
    }
    let next = sample(p[draft.len()], rng);
    Verdict {
        accepted: draft.len(),
        next,
        bonus: true,
    }
}

/// Greedy verification: accept while x_k equals the target's argmax; the next token is the
/// target's argmax at the first mismatch (or after the last draft).
pub fn verify_greedy(draft: &[u32], target_argmax: &[u32]) -> Verdict {
    debug_assert_eq!(target_argmax.len(), draft.len() + 1);
    for (k, &x) in draft.iter().enumerate() {
        if x != target_argmax[k] {
            return Verdict {
                accepted: k,
                next: target_argmax[k],
                bonus: false,
            };
        }
    }
    Verdict {
        accepted: draft.len(),
        next: target_argmax[draft.len()],
        bonus: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{SamplingParams, probs};

    /// Total-variation distance between an empirical histogram of `n` draws and `p`.
    fn tv(counts: &[u64], p: &[f64], n: u64) -> f64 {
        0.5 * counts
            .iter()
            .zip(p)
            .map(|(&c, &pi)| (c as f64 / n as f64 - pi).abs())
            .sum::<f64>()
    }

    /// 99.9% bound on TV for n draws over a support of size m: by the DKW-style bound
    /// E[TV] ≤ ½·Σ sqrt(p(1-p)/n) ≤ ½·sqrt(m/n), and McDiarmid gives
    /// P(TV ≥ E[TV] + t) ≤ exp(−2 n t²); t = sqrt(ln(1000)/(2n)).
    fn tv_bound(m: usize, n: u64) -> f64 {
        0.5 * (m as f64 / n as f64).sqrt() + ((1000f64).ln() / (2.0 * n as f64)).sqrt()
    }

    fn normalize(v: &mut [f32]) {
        let s: f32 = v.iter().sum();
        for x in v.iter_mut() {
            *x /= s;
        }
    }

    /// Draws the first committed token of a 1-token window through the acceptance rule and
    /// checks it is distributed as p.
    fn check_first_token(p: &[f32], q: &[f32], n: u64, seed: u64) -> f64 {
        let mut rng = Rng::new(seed);
        let mut counts = vec![0u64; p.len()];
        let pb = vec![1.0 / p.len() as f32; p.len()];
        for _ in 0..n {
            let x = sample(q, &mut rng);
            let v = verify(&[x], &[DraftDist::Dense(q)], &[p, &pb], &mut rng);
            let tok = if v.accepted == 1 { x } else { v.next };
            counts[tok as usize] += 1;
        }
        let pd: Vec<f64> = p.iter().map(|&v| v as f64).collect();
        tv(&counts, &pd, n)
    }

    #[test]
    fn acceptance_preserves_the_target_distribution_over_a_transform_matrix() {
        let n = 1_000_000u64;
        let mut rng = Rng::new(1);
        let vocab = 12;
        let logits_p: Vec<f32> = (0..vocab).map(|_| rng.normal() as f32 * 2.0).collect();
        let logits_q: Vec<f32> = (0..vocab).map(|_| rng.normal() as f32 * 2.0).collect();
        let mut case = 0;
        for &t in &[0.5f32, 1.0, 1.7] {
            for &k in &[0usize, 3, 8] {
                for &tp in &[1.0f32, 0.9, 0.5] {
                    let sp = SamplingParams {
                        temperature: t,
                        top_k: k,
                        top_p: tp,
                        ..Default::default()
                    };
                    let p = probs(&logits_p, &[], &sp);
                    let q = probs(&logits_q, &[], &sp);
                    case += 1;
                    let d = check_first_token(&p, &q, n, 100 + case);
                    let b = tv_bound(vocab, n);
                    assert!(d < b, "T={t} top_k={k} top_p={tp}: TV {d} ≥ bound {b}");
                }
            }
        }
    }

    #[test]
    fn acceptance_preserves_the_target_distribution_under_min_p_and_logit_bias() {
        let n = 1_000_000u64;
        let mut rng = Rng::new(2);
        let vocab = 12;
        let logits_p: Vec<f32> = (0..vocab).map(|_| rng.normal() as f32 * 2.0).collect();
        let logits_q: Vec<f32> = (0..vocab).map(|_| rng.normal() as f32 * 2.0).collect();
        let mut biased = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        biased.set_logit_bias([(0, 3.0), (5, -100.0), (7, 1.5)]);
        let cases = [
            SamplingParams {
                temperature: 1.0,
                min_p: 0.15,
                ..Default::default()
            },
            biased.clone(),
            SamplingParams {
                min_p: 0.05,
                top_p: 0.9,
                temperature: 0.8,
                ..biased
            },
        ];
        for (i, sp) in cases.iter().enumerate() {
            let p = probs(&logits_p, &[], sp);
            let q = probs(&logits_q, &[], sp);
            let d = check_first_token(&p, &q, n, 200 + i as u64);
            let b = tv_bound(vocab, n);
            assert!(d < b, "{sp:?}: TV {d} ≥ bound {b}");
        }
    }

    #[test]
    fn edge_cases_q_equals_p_and_residual_near_zero() {
        let n = 1_000_000u64;
        let mut p = vec![0.5f32, 0.25, 0.125, 0.125];
        normalize(&mut p);
        // q = p: every draft is accepted; output is p.
        let d = check_first_token(&p, &p, n, 7);
        assert!(d < tv_bound(4, n), "q=p TV {d}");
        // q almost p: the residual has tiny mass.
        let mut q = vec![0.5f32 + 1e-6, 0.25, 0.125, 0.125 - 1e-6];
        normalize(&mut q);
        let d = check_first_token(&p, &q, n, 8);
        assert!(d < tv_bound(4, n), "near TV {d}");
        // q puts mass where p has none (top-k'd target).
        let p2 = vec![0.6f32, 0.4, 0.0, 0.0];
        let q2 = vec![0.1f32, 0.1, 0.4, 0.4];
        let d = check_first_token(&p2, &q2, n, 9);
        assert!(d < tv_bound(4, n), "disjoint TV {d}");
    }

    #[test]
    fn second_token_of_a_two_token_window_is_exact() {
        // Joint distribution of the first two committed tokens equals p1(a)·p2(b | a) when the
        // drafter proposes two tokens from q1, q2 (context-independent toy model).
        let n = 1_000_000u64;
        let p1 = [0.6f32, 0.3, 0.1];
        let p2 = [0.2f32, 0.5, 0.3];
        let q1 = [0.2f32, 0.3, 0.5];
        let q2 = [0.7f32, 0.2, 0.1];
        let p3 = [1.0f32 / 3.0; 3];
        let mut rng = Rng::new(5);
        let mut counts = vec![0u64; 9];
        for _ in 0..n {
            let x1 = sample(&q1, &mut rng);
            let x2 = sample(&q2, &mut rng);
            let v = verify(
                &[x1, x2],
                &[DraftDist::Dense(&q1), DraftDist::Dense(&q2)],
                &[&p1, &p2, &p3],
                &mut rng,
            );
            let (a, b) = match v.accepted {
                0 => (v.next, sample(&p2, &mut rng)), // target continues on its own
                1 => (x1, v.next),
                _ => (x1, x2),
            };
            counts[(a * 3 + b) as usize] += 1;
        }
        let want: Vec<f64> = (0..9)
            .map(|i| p1[i / 3] as f64 * p2[i % 3] as f64)
            .collect();
        let d = tv(&counts, &want, n);
        assert!(d < tv_bound(9, n), "joint TV {d}");
    }

    #[test]
    fn one_hot_and_sparse_proposals_are_lossless() {
        let n = 1_000_000u64;
        let p = [0.1f32, 0.6, 0.2, 0.1];
        let pb = [0.25f32; 4];
        let pd: Vec<f64> = p.iter().map(|&v| v as f64).collect();
        let mut rng = Rng::new(3);
        // Deterministic proposer always proposing token 2.
        let mut counts = vec![0u64; 4];
        for _ in 0..n {
            let v = verify(&[2], &[DraftDist::OneHot], &[&p, &pb], &mut rng);
            counts[if v.accepted == 1 { 2 } else { v.next as usize }] += 1;
        }
        assert!(tv(&counts, &pd, n) < tv_bound(4, n));
        // Sparse top-2 proposal.
        let sq = [(1u32, 0.3f32), (3, 0.7)];
        let mut counts = vec![0u64; 4];
        for _ in 0..n {
            let x = if rng.uniform() < 0.3 { 1 } else { 3 };
            let v = verify(&[x], &[DraftDist::Sparse(&sq)], &[&p, &pb], &mut rng);
            counts[if v.accepted == 1 {
                x as usize
            } else {
                v.next as usize
            }] += 1;
        }
        assert!(tv(&counts, &pd, n) < tv_bound(4, n));
    }

    #[test]
    fn greedy_accepts_exactly_the_argmax_prefix() {
        assert_eq!(
            verify_greedy(&[3, 4, 5], &[3, 4, 9, 1]),
            Verdict {
                accepted: 2,
                next: 9,
                bonus: false
            }
        );
        assert_eq!(
            verify_greedy(&[3, 4], &[3, 4, 7]),
            Verdict {
                accepted: 2,
                next: 7,
                bonus: true
            }
        );
        assert_eq!(
            verify_greedy(&[], &[5]),
            Verdict {
                accepted: 0,
                next: 5,
                bonus: true
            }
        );
    }
}
