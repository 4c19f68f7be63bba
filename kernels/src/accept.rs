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
    /// q(tok). A sparse support that repeats a token counts every entry, as
    /// [`sample_residual`] subtracts every entry: the two must see the same q to stay lossless.
    fn q_of(&self, tok: u32, draft: u32) -> f32 {
        match self {
            DraftDist::Dense(q) => q.get(tok as usize).copied().unwrap_or(0.0),
            DraftDist::Sparse(s) => s.iter().filter(|(t, _)| *t == tok).map(|(_, v)| *v).sum(),
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
///
/// Total on short inputs (a caller bug, but no reason to panic a server): only the first
/// `n = min(K, q.len(), p.len() − 1)` drafts are verified, and `next` is sampled from `p[n]`
/// (the target's own distribution after the accepted prefix, so still lossless), with
/// `bonus` false when `n < K`. With no `p` at all nothing can be sampled: `next` is token 0,
/// as [`sample`] gives for an empty distribution.
pub fn verify(draft: &[u32], q: &[DraftDist<'_>], p: &[&[f32]], rng: &mut Rng) -> Verdict {
    let n = draft.len().min(q.len()).min(p.len().saturating_sub(1));
    for (k, &x) in draft[..n].iter().enumerate() {
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
    let next = sample(p.get(n).copied().unwrap_or(&[]), rng);
    Verdict {
        accepted: n,
        next,
        bonus: n == draft.len(),
    }
}

/// Greedy verification: accept while x_k equals the target's argmax; the next token is the
/// target's argmax at the first mismatch (or after the last draft).
///
/// Total like [`verify`]: with fewer than K+1 argmaxes only the drafts that have a following
/// argmax are checked, and an empty `target_argmax` gives token 0.
pub fn verify_greedy(draft: &[u32], target_argmax: &[u32]) -> Verdict {
    let n = draft.len().min(target_argmax.len().saturating_sub(1));
    for (k, &x) in draft[..n].iter().enumerate() {
        if x != target_argmax[k] {
            return Verdict {
                accepted: k,
                next: target_argmax[k],
                bonus: false,
            };
        }
    }
    Verdict {
        accepted: n,
        next: target_argmax.get(n).copied().unwrap_or(0),
        bonus: n == draft.len(),
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

    /// Pearson's goodness-of-fit X² of `counts` (n draws) against `p`, with cells of expected
    /// count under 5 pooled into one, and the χ² upper `alpha` quantile for its degrees of
    /// freedom (Wilson–Hilferty; `specdec::stats` has the same for two samples). A draw in a
    /// cell of probability 0 gives X² = ∞.
    fn chi_square_gof(counts: &[u64], p: &[f64], alpha: f64) -> (f64, f64) {
        let n: u64 = counts.iter().sum();
        let (mut stat, mut cells) = (0.0, 0usize);
        let (mut pooled_c, mut pooled_e) = (0u64, 0.0f64);
        for (&c, &pi) in counts.iter().zip(p) {
            let e = pi * n as f64;
            if pi <= 0.0 {
                if c > 0 {
                    stat = f64::INFINITY;
                }
            } else if e < 5.0 {
                (pooled_c, pooled_e) = (pooled_c + c, pooled_e + e);
            } else {
                stat += (c as f64 - e).powi(2) / e;
                cells += 1;
            }
        }
        if pooled_e > 0.0 {
            stat += (pooled_c as f64 - pooled_e).powi(2) / pooled_e;
            cells += 1;
        }
        let k = (cells - 1) as f64;
        // z_alpha (Abramowitz & Stegun 26.2.23), then Wilson–Hilferty.
        let t = (-2.0 * alpha.ln()).sqrt();
        let z = t
            - (2.515517 + 0.802853 * t + 0.010328 * t * t)
                / (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t);
        let v = 2.0 / (9.0 * k);
        (stat, k * (1.0 - v + z * v.sqrt()).powi(3))
    }

    #[test]
    fn two_token_window_with_its_bonus_is_exact() {
        // The joint law of (drafts accepted A, three committed tokens a, b, c) when the drafter
        // proposes two tokens from q1, q2 (context-independent toy model; after a rejection the
        // target samples on by itself). Exactly: A = 2 with min(p1, q1)(a)·min(p2, q2)(b)·p3(c)
        // (c is the bonus, from the third row); A = 1 with min(p1, q1)(a)·(p2 − q2)⁺(b)·p3(c);
        // A = 0 with (p1 − q1)⁺(a)·p2(b)·p3(c). Summed over A, p1(a)·p2(b)·p3(c). The three
        // rows differ, so a bonus drawn from the wrong row (here: p1 or p2 in its place, as a
        // verifier indexing the rows off by one would) moves mass P(A = 2) = 0.3 by
        // TV(p3, p1) = 0.6 or TV(p3, p2) = 0.4, and fails.
        // X² over the 3 × 27 cells at α = 0.001 (54 of positive probability; the rest must stay
        // empty): with 10⁶ draws it detects any TV δ ≥ 0.004 between the law and the target
        // (noncentrality ≥ 4nδ² = 64 on 53 degrees of freedom: power ≥ 0.9), as the TV bound
        // it replaces did (0.0034 at this n), and the wrong bonus rows by far (X² in the 10⁵).
        let n = 1_000_000u64;
        let p1 = [0.6f32, 0.3, 0.1];
        let p2 = [0.2f32, 0.5, 0.3];
        let q1 = [0.2f32, 0.3, 0.5];
        let q2 = [0.7f32, 0.2, 0.1];
        let p3 = [0.1f32, 0.2, 0.7];
        let (f, m, r) = (
            |v: &[f32], i: usize| v[i] as f64,
            |p: &[f32], q: &[f32], i: usize| p[i].min(q[i]) as f64,
            |p: &[f32], q: &[f32], i: usize| (p[i] - q[i]).max(0.0) as f64,
        );
        let want: Vec<f64> = (0..81)
            .map(|i| {
                let (acc, a, b, c) = (i / 27, i / 9 % 3, i / 3 % 3, i % 3);
                let (x, y) = match acc {
                    2 => (m(&p1, &q1, a), m(&p2, &q2, b)),
                    1 => (m(&p1, &q1, a), r(&p2, &q2, b)),
                    _ => (r(&p1, &q1, a), f(&p2, b)),
                };
                x * y * f(&p3, c)
            })
            .collect();
        assert!((want.iter().sum::<f64>() - 1.0).abs() < 1e-6);
        // `bonus_row`: where a bonus comes from (2: the right one; 0, 1: the bugs).
        let run = |seed: u64, bonus_row: usize| {
            let rows: [&[f32]; 3] = [&p1, &p2, &p3];
            let mut rng = Rng::new(seed);
            let mut counts = vec![0u64; 81];
            for _ in 0..n {
                let x1 = sample(&q1, &mut rng);
                let x2 = sample(&q2, &mut rng);
                let v = verify(
                    &[x1, x2],
                    &[DraftDist::Dense(&q1), DraftDist::Dense(&q2)],
                    &[&p1, &p2, &p3],
                    &mut rng,
                );
                let (a, b, c) = match v.accepted {
                    0 => (v.next, sample(&p2, &mut rng), sample(&p3, &mut rng)),
                    1 => (x1, v.next, sample(&p3, &mut rng)),
                    _ => {
                        assert!(v.bonus);
                        let c = if bonus_row == 2 {
                            v.next
                        } else {
                            sample(rows[bonus_row], &mut rng)
                        };
                        (x1, x2, c)
                    }
                };
                counts[v.accepted * 27 + (a * 9 + b * 3 + c) as usize] += 1;
            }
            counts
        };
        let (stat, crit) = chi_square_gof(&run(5, 2), &want, 0.001);
        eprintln!("joint X² {stat:.1} (critical {crit:.1})");
        assert!(stat <= crit, "joint X² {stat} > {crit}");
        for wrong in [0, 1] {
            let (stat, crit) = chi_square_gof(&run(6 + wrong as u64, wrong), &want, 0.001);
            eprintln!("bonus from row {wrong}: X² {stat:.1}");
            assert!(stat > crit, "bonus from row {wrong}: X² {stat} ≤ {crit}");
        }
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
    fn a_sparse_proposal_repeating_a_token_acts_as_its_summed_entry() {
        // p(3) = 0.35 lies between the first entry (0.2) and the sum (0.5): reading only the
        // first entry would always accept, while the residual subtracts both.
        let p = [0.1f32, 0.2, 0.35, 0.35];
        let pb = [0.25f32; 4];
        let split = [(3u32, 0.2f32), (1, 0.1), (3, 0.3)];
        let merged = [(3u32, 0.5f32), (1, 0.1)];
        let (mut ra, mut rb) = (Rng::new(12), Rng::new(12));
        let mut rejected = 0;
        for _ in 0..2000 {
            let a = verify(&[3], &[DraftDist::Sparse(&split)], &[&p, &pb], &mut ra);
            let b = verify(&[3], &[DraftDist::Sparse(&merged)], &[&p, &pb], &mut rb);
            assert_eq!(a, b);
            rejected += (a.accepted == 0) as usize;
        }
        assert!(rejected > 0);
    }

    #[test]
    fn short_inputs_verify_only_the_drafts_they_have_rows_for() {
        let p0 = [0.0f32, 1.0, 0.0];
        let p1 = [0.0f32, 0.0, 1.0];
        let q = [0.0f32, 1.0, 0.0];
        let mut rng = Rng::new(4);
        // Rows for one draft and the next token: the first draft is verified, the rest not.
        let v = verify(
            &[1, 1, 1],
            &[DraftDist::Dense(&q); 3],
            &[&p0, &p1],
            &mut rng,
        );
        assert_eq!(
            v,
            Verdict {
                accepted: 1,
                next: 2,
                bonus: false
            }
        );
        // Fewer draft distributions than drafts.
        let v = verify(&[1, 1], &[DraftDist::Dense(&q)], &[&p0, &p1, &p1], &mut rng);
        assert_eq!((v.accepted, v.next, v.bonus), (1, 2, false));
        // A single row: nothing verified, the next token from it.
        let v = verify(&[1, 1], &[DraftDist::OneHot; 2], &[&p1], &mut rng);
        assert_eq!((v.accepted, v.next, v.bonus), (0, 2, false));
        // No row at all.
        let v = verify(&[1], &[DraftDist::OneHot], &[], &mut rng);
        assert_eq!((v.accepted, v.next, v.bonus), (0, 0, false));
        assert_eq!(
            verify_greedy(&[3, 4, 5], &[3, 4]),
            Verdict {
                accepted: 1,
                next: 4,
                bonus: false
            }
        );
        assert_eq!(
            verify_greedy(&[3], &[]),
            Verdict {
                accepted: 0,
                next: 0,
                bonus: false
            }
        );
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
