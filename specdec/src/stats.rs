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

/// Total variation between two empirical distributions and the 99.9 % bound it stays under when
/// both come from the same distribution: over m cells with n draws each, E[TV] ≤ ½√(m/n) per
/// sample, and McDiarmid adds 2√(ln 1000 / 2n); so TV < √(m/n) + 2√(ln 1000 / 2n).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_distribution_stays_under_the_bound_and_a_shift_does_not() {
        let mut rng = kernels::rng::Rng::new(4);
        let draw = |rng: &mut kernels::rng::Rng, bias: f64| {
            let mut h = HashMap::new();
            for _ in 0..4000 {
                let t = if rng.uniform() < 0.5 + bias {
                    0
                } else {
                    1 + rng.below(3) as u32
                };
                *h.entry(t).or_default() += 1;
            }
            h
        };
        let (a, b) = (draw(&mut rng, 0.0), draw(&mut rng, 0.0));
        let (tv, bound) = tv_with_bound(&a, &b);
        assert!(tv < bound, "{tv} ≥ {bound}");
        let c = draw(&mut rng, 0.2);
        let (tv, bound) = tv_with_bound(&a, &c);
        assert!(tv > bound, "{tv} ≤ {bound}");
        let h = position_histograms([&vec![1, 2], &vec![1, 3, 4]], 2);
        assert_eq!(h[0][&1], 2);
        assert_eq!(h[1].len(), 2);
    }
}
