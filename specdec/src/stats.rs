//! Two-sample checks of sampled output: the lossless tests compare token histograms of runs
//! with speculation on and off.

use std::collections::HashMap;

/// Histograms of the first `positions` output tokens of every sequence.
pub fn position_histograms<'a>(
    outputs: impl IntoIterator<Item = &'a Vec<u32>>,
    positions: usize,
) -> Vec<HashMap<u32, u64>> {
    let mut h = vec![HashMap::new(); positions];
    for toks in outputs {
        for (j, t) in toks.iter().take(positions).enumerate() {
            *h[j].entry(*t).or_default() += 1;
        }
    }
    h
}

/// Of requests that verified at most one block of at most one draft (a request of three
/// tokens: the prefill's, one verified draft, the bonus), how many drafts were accepted and
/// how many rejected: whether a sampling test exercised both branches of acceptance.
///
/// # Panics
/// On a request that verified more: the test's setup is not what it assumes.
pub fn one_draft_verdicts<'a>(events: impl IntoIterator<Item = &'a crate::Event>) -> (u64, u64) {
    let (mut accepted, mut rejected) = (0u64, 0u64);
    for ev in events {
        if let crate::Event::Finished { metrics: m, .. } = ev {
            assert!(m.spec_calls <= 1 && m.drafted_tokens <= 1, "{m:?}");
            if m.drafted_tokens == 1 {
                if m.accepted_tokens == 1 {
                    accepted += 1;
                } else {
                    rejected += 1;
                }
            }
        }
    }
    (accepted, rejected)
}

/// The cell of [`position_histograms_with_end`] for sequences that ended before the position.
pub const ENDED: u32 = u32::MAX;

/// Histograms of the first `positions` output tokens of every sequence, those that ended
/// before a position counted there as [`ENDED`]: each histogram counts every sequence, so two
/// runs' histograms compare whether they ended too (and have the same totals).
pub fn position_histograms_with_end<'a>(
    outputs: impl IntoIterator<Item = &'a Vec<u32>>,
    positions: usize,
) -> Vec<HashMap<u32, u64>> {
    let mut h = vec![HashMap::new(); positions];
    for toks in outputs {
        for (j, c) in h.iter_mut().enumerate() {
            *c.entry(toks.get(j).copied().unwrap_or(ENDED)).or_default() += 1;
        }
    }
    h
}

/// Total variation between two empirical distributions and the 99.9 % bound it stays under when
/// both come from the same distribution: over m cells with n draws each, E[TV] ≤ ½√(m/n) per
/// sample, and McDiarmid adds 2√(ln 1000 / 2n); so TV < √(m/n) + 2√(ln 1000 / 2n).
///
/// A loose bound (it holds for any distribution, so it is far above the typical TV): prefer
/// [`chi_square_two_sample`], which has much more power at the same n.
pub fn tv_with_bound(a: &HashMap<u32, u64>, b: &HashMap<u32, u64>) -> (f64, f64) {
    let keys: std::collections::HashSet<u32> = a.keys().chain(b.keys()).copied().collect();
    let (na, nb) = (
        a.values().sum::<u64>().max(1) as f64,
        b.values().sum::<u64>().max(1) as f64,
    );
    let tv = 0.5
        * keys
            .iter()
            .map(|k| {
                (*a.get(k).unwrap_or(&0) as f64 / na - *b.get(k).unwrap_or(&0) as f64 / nb).abs()
            })
            .sum::<f64>();
    let n = na.min(nb);
    let bound = (keys.len() as f64 / n).sqrt() + 2.0 * ((1000f64).ln() / (2.0 * n)).sqrt();
    (tv, bound)
}

/// z with P(Z > z) = `alpha` for a standard normal Z, 0 < alpha < 1 (Abramowitz & Stegun
/// 26.2.23: absolute error below 4.5·10⁻⁴).
pub fn normal_upper_quantile(alpha: f64) -> f64 {
    assert!(alpha > 0.0 && alpha < 1.0, "alpha {alpha} outside (0, 1)");
    if alpha > 0.5 {
        return -normal_upper_quantile(1.0 - alpha);
    }
    let t = (-2.0 * alpha.ln()).sqrt();
    t - (2.515517 + 0.802853 * t + 0.010328 * t * t)
        / (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t)
}

/// x with P(X > x) = `alpha` for X ~ χ²(df): exact for df 1 (z²_{α/2}) and 2 (−2 ln α), the
/// Wilson–Hilferty approximation df·(1 − 2/9df + z_α·√(2/9df))³ above (within 2 % at α = 0.001
/// for df ≥ 3, on the high side: the test it gives is a little conservative). ∞ for df 0.
pub fn chi_square_upper_quantile(df: usize, alpha: f64) -> f64 {
    match df {
        0 => f64::INFINITY,
        1 => normal_upper_quantile(alpha / 2.0).powi(2),
        2 => -2.0 * alpha.ln(),
        _ => {
            let k = df as f64;
            let v = 2.0 / (9.0 * k);
            k * (1.0 - v + normal_upper_quantile(alpha) * v.sqrt()).powi(3)
        }
    }
}

/// Cells whose expected count in either sample is below this are pooled into one.
pub const MIN_EXPECTED: f64 = 5.0;

/// Outcome of [`chi_square_two_sample`].
#[derive(Clone, Debug, PartialEq)]
pub struct Homogeneity {
    /// Pearson's X² over the compared cells.
    pub stat: f64,
    /// Cells compared − 1 (0: nothing to compare, and the test passes vacuously).
    pub df: usize,
    /// The χ²(df) upper `alpha` quantile: the test fails when `stat` exceeds it.
    pub critical: f64,
    pub alpha: f64,
    /// Draws in each sample.
    pub n: (u64, u64),
    /// Keys pooled into one cell: those of small expected count (and the smallest others
    /// while the pool's own was still small).
    pub pooled: usize,
}

impl Homogeneity {
    /// Whether the two samples are consistent with one distribution at level `alpha`.
    pub fn passes(&self) -> bool {
        self.stat <= self.critical
    }
}

impl std::fmt::Display for Homogeneity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "X² {:.2} vs χ²({}) {} quantile {:.2} (n {} and {}, {} rare keys pooled)",
            self.stat,
            self.df,
            1.0 - self.alpha,
            self.critical,
            self.n.0,
            self.n.1,
            self.pooled
        )
    }
}

/// Two-sample χ² test of homogeneity: whether histograms `a` and `b` (independent samples)
/// come from the same distribution, at false-alarm rate `alpha`. Keys whose expected count in
/// either sample is below [`MIN_EXPECTED`] are pooled into one cell (with the smallest other
/// cells while that one is still below it); X² = Σ_cells Σ_s (O − E)² / E is then referred to
/// χ²(cells − 1).
///
/// Power: the noncentrality against two distributions at total variation δ (over the cells
/// compared) is λ ≈ Σ_i (a_i − b_i)² / (a_i/n_b + b_i/n_a) ≥ 4δ²·n_a·n_b/(n_a + n_b) (Cauchy–
/// Schwarz; 2nδ² for n draws each), whatever the distributions — more when the difference sits
/// in a few cells. With n draws each, a TV δ over c cells is detected with at least the power of
/// a noncentral χ²(c − 1, 2nδ²) beyond the critical value.
pub fn chi_square_two_sample(
    a: &HashMap<u32, u64>,
    b: &HashMap<u32, u64>,
    alpha: f64,
) -> Homogeneity {
    let (na, nb) = (a.values().sum::<u64>(), b.values().sum::<u64>());
    let mut keys: Vec<u32> = a.keys().chain(b.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let count = |h: &HashMap<u32, u64>, k: u32| h.get(&k).copied().unwrap_or(0);
    // (count in a, count in b) per key, the rarest first (ties by key: deterministic).
    let mut cells: Vec<(u64, u64)> = keys.iter().map(|&k| (count(a, k), count(b, k))).collect();
    cells.sort_by_key(|&(x, y)| x + y);
    let total = (na + nb) as f64;
    let smaller = na.min(nb) as f64;
    let rare = |(x, y): (u64, u64)| ((x + y) as f64) * smaller / total < MIN_EXPECTED;
    let mut pool = (0u64, 0u64);
    let mut pooled = 0;
    let mut rest = cells.into_iter().peekable();
    while let Some(&c) = rest.peek() {
        if !rare(c) && !(pooled > 0 && rare(pool)) {
            break;
        }
        pool = (pool.0 + c.0, pool.1 + c.1);
        pooled += 1;
        rest.next();
    }
    let mut cells: Vec<(u64, u64)> = rest.collect();
    if pooled > 0 {
        cells.push(pool);
    }
    let df = cells.len().saturating_sub(1);
    let stat = if df == 0 || na == 0 || nb == 0 {
        0.0
    } else {
        cells
            .iter()
            .map(|&(x, y)| {
                let t = (x + y) as f64;
                let (ea, eb) = (t * na as f64 / total, t * nb as f64 / total);
                (x as f64 - ea).powi(2) / ea + (y as f64 - eb).powi(2) / eb
            })
            .sum()
    };
    let df = if na == 0 || nb == 0 { 0 } else { df };
    Homogeneity {
        stat,
        df,
        critical: chi_square_upper_quantile(df, alpha),
        alpha,
        n: (na, nb),
        pooled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    fn draw(rng: &mut Rng, n: u64, bias: f64) -> HashMap<u32, u64> {
        let mut h = HashMap::new();
        for _ in 0..n {
            let t = if rng.uniform() < 0.5 + bias {
                0
            } else {
                1 + rng.below(3) as u32
            };
            *h.entry(t).or_default() += 1;
        }
        h
    }

    #[test]
    fn same_distribution_stays_under_the_bound_and_a_shift_does_not() {
        let mut rng = Rng::new(4);
        let (a, b) = (draw(&mut rng, 4000, 0.0), draw(&mut rng, 4000, 0.0));
        let (tv, bound) = tv_with_bound(&a, &b);
        assert!(tv < bound, "{tv} ≥ {bound}");
        let c = draw(&mut rng, 4000, 0.2);
        let (tv, bound) = tv_with_bound(&a, &c);
        assert!(tv > bound, "{tv} ≤ {bound}");
        let h = position_histograms([&vec![1, 2], &vec![1, 3, 4]], 2);
        assert_eq!(h[0][&1], 2);
        assert_eq!(h[1].len(), 2);
        let h = position_histograms_with_end([&vec![1], &vec![1, 3, 4]], 3);
        assert_eq!(h[1], [(ENDED, 1), (3, 1)].into());
        assert_eq!(h[2], [(ENDED, 1), (4, 1)].into());
    }

    #[test]
    fn quantiles_match_the_tables() {
        for (alpha, z) in [
            (0.05, 1.6449),
            (0.001, 3.0902),
            (0.0005, 3.2905),
            (0.5, 0.0),
        ] {
            let got = normal_upper_quantile(alpha);
            assert!((got - z).abs() < 5e-4, "z_{alpha}: {got} vs {z}");
        }
        assert!((normal_upper_quantile(0.95) + 1.6449).abs() < 5e-4);
        // χ²(df) upper 0.001 and 0.05 quantiles (tables).
        for (df, alpha, x) in [
            (1, 0.001, 10.828),
            (2, 0.001, 13.816),
            (3, 0.001, 16.266),
            (5, 0.001, 20.515),
            (10, 0.001, 29.588),
            (30, 0.001, 59.703),
            (100, 0.001, 149.449),
            (1, 0.05, 3.841),
            (4, 0.05, 9.488),
            (20, 0.05, 31.410),
        ] {
            let got = chi_square_upper_quantile(df, alpha);
            // At α = 0.001 on the high side (a conservative test), elsewhere within 1 %.
            let low = if alpha <= 0.001 { 0.999 } else { 0.99 };
            assert!(
                got >= x * low && got < x * 1.02,
                "χ²({df}) {alpha}: {got} vs {x}"
            );
        }
        assert_eq!(chi_square_upper_quantile(0, 0.001), f64::INFINITY);
    }

    #[test]
    fn homogeneity_passes_the_same_distribution_and_fails_a_shift() {
        let mut rng = Rng::new(9);
        // Unequal sample sizes; two rare keys (expected count < 5) get pooled, with the
        // smallest other cell since the pool itself is still rare.
        let (mut a, mut b) = (draw(&mut rng, 3000, 0.0), draw(&mut rng, 2000, 0.0));
        *a.entry(99).or_default() += 2;
        *b.entry(98).or_default() += 1;
        let h = chi_square_two_sample(&a, &b, 0.001);
        assert!(h.passes(), "{h}");
        assert_eq!((h.df, h.pooled, h.n), (3, 3, (3002, 2001)), "{h}");
        // A shift of TV 0.1 (from 0.5 to 0.6 on the first cell): noncentrality ≈ 48 against a
        // critical 16.3 on 3 degrees of freedom, power > 0.999.
        let c = draw(&mut rng, 2000, 0.1);
        let h = chi_square_two_sample(&a, &c, 0.001);
        eprintln!("shifted: {h}");
        assert!(!h.passes(), "{h}");
        // Identical histograms: X² = 0; nothing to compare: df 0, passes.
        let h = chi_square_two_sample(&a, &a, 0.001);
        assert_eq!(h.stat, 0.0);
        let one: HashMap<u32, u64> = [(5, 10)].into();
        let h = chi_square_two_sample(&one, &one, 0.001);
        assert_eq!(h.df, 0);
        assert!(h.passes());
        // Only rare keys: pooled to one cell.
        let r: HashMap<u32, u64> = [(1, 1), (2, 2)].into();
        assert_eq!(chi_square_two_sample(&r, &r, 0.001).df, 0);
    }

    /// Under the null the test rejects about `alpha` of the time (here 5 %, over 2000 pairs of
    /// 200-draw samples of a distribution with rare cells to pool).
    #[test]
    fn false_alarm_rate_is_about_alpha() {
        let mut rng = Rng::new(11);
        let p = [0.4, 0.3, 0.2, 0.06, 0.03, 0.01];
        let sample = |rng: &mut Rng| {
            let mut h = HashMap::new();
            for _ in 0..200 {
                let mut u = rng.uniform();
                let mut t = 0;
                while t + 1 < p.len() && u >= p[t] {
                    u -= p[t];
                    t += 1;
                }
                *h.entry(t as u32).or_default() += 1u64;
            }
            h
        };
        let trials = 2000;
        let rejected = (0..trials)
            .filter(|_| {
                let (a, b) = (sample(&mut rng), sample(&mut rng));
                !chi_square_two_sample(&a, &b, 0.05).passes()
            })
            .count();
        // Binomial(2000, 0.05): mean 100, sd 9.7.
        assert!((65..=135).contains(&rejected), "{rejected} of {trials}");
    }

    /// The engine's lossless tests in small: an n-gram proposer drafts token d (one-hot q) at a
    /// position where the target has p. A verifier that draws a rejected position from p instead
    /// of the residual p − q gives d probability p_d(2 − p_d) (TV p_d(1 − p_d)); with 300 draws
    /// per arm at α = 0.001 the test catches it, and passes the correct verifier.
    #[test]
    fn homogeneity_catches_a_verifier_that_ignores_the_residual() {
        use kernels::accept::{DraftDist, verify};
        use kernels::sampling::sample;
        let p = [0.55f32, 0.2, 0.1, 0.08, 0.05, 0.02];
        let pb = [1.0 / 6.0f32; 6];
        let d = 0u32;
        let n = 300;
        let mut rng = Rng::new(21);
        let mut plain = HashMap::new();
        let (mut good, mut bad) = (HashMap::new(), HashMap::new());
        for _ in 0..n {
            *plain.entry(sample(&p, &mut rng)).or_default() += 1u64;
            let v = verify(&[d], &[DraftDist::OneHot], &[&p, &pb], &mut rng);
            *good
                .entry(if v.accepted == 1 { d } else { v.next })
                .or_default() += 1u64;
            // The bug: accept d with probability p_d, else draw from p itself.
            let t = if rng.uniform() < p[0] as f64 {
                d
            } else {
                sample(&p, &mut rng)
            };
            *bad.entry(t).or_default() += 1u64;
        }
        let h = chi_square_two_sample(&plain, &good, 0.001);
        eprintln!("correct verifier: {h}");
        assert!(h.passes(), "correct verifier: {h}");
        let h = chi_square_two_sample(&plain, &bad, 0.001);
        eprintln!("residual ignored: {h}");
        assert!(!h.passes(), "residual ignored: {h}");
    }
}
