//! Sequential Temperature Scaling (DSpark): per block position k a temperature T_k on the
//! confidence logit, fitted left to right by 1-D grid search so that the cumulative product
//! Π_{j≤k} σ(z_j / T_j) — the predicted survival of the prefix — matches observed prefix survival
//! in expected calibration error. Dividing a logit by T > 0 keeps the order of confidences.

/// Expected calibration error of predictions `p` against 0/1 outcomes `y`, with `bins` equal-width
/// bins: Σ_b (n_b / n) · |mean(p in b) − mean(y in b)|.
pub fn ece(p: &[f64], y: &[bool], bins: usize) -> f64 {
    let n = p.len().min(y.len());
    if n == 0 {
        return 0.0;
    }
    let mut sp = vec![0f64; bins];
    let mut sy = vec![0f64; bins];
    let mut cnt = vec![0usize; bins];
    for i in 0..n {
        let b = ((p[i] * bins as f64) as usize).min(bins - 1);
        sp[b] += p[i];
        sy[b] += y[i] as u8 as f64;
        cnt[b] += 1;
    }
    (0..bins)
        .filter(|&b| cnt[b] > 0)
        .map(|b| (sp[b] - sy[b]).abs() / n as f64)
        .sum()
}

/// Area under the ROC curve of scores against 0/1 labels (ties count ½). NaN-free input expected.
pub fn roc_auc(score: &[f64], y: &[bool]) -> f64 {
    let mut idx: Vec<usize> = (0..score.len().min(y.len())).collect();
    idx.sort_by(|&a, &b| score[a].total_cmp(&score[b]));
    let (pos, neg) = (
        y.iter().filter(|&&v| v).count() as f64,
        y.iter().filter(|&&v| !v).count() as f64,
    );
    if pos == 0.0 || neg == 0.0 {
        return 0.5;
    }
    // Rank-sum with average ranks for ties.
    let mut rank_sum = 0f64;
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && score[idx[j + 1]] == score[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            if y[k] {
                rank_sum += avg;
            }
        }
        i = j + 1;
    }
    (rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg)
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// One held-out block: confidence logits z_1..z_K and how many drafts were accepted.
#[derive(Clone, Debug)]
pub struct Observed {
    pub logits: Vec<f32>,
    pub accepted: usize,
}

/// Fits T_1..T_γ left to right; position k uses the blocks that reached it (all blocks: survival
/// of the prefix is observed for every k ≤ drafted length).
pub fn fit_sts(obs: &[Observed], gamma: usize, bins: usize) -> Vec<f32> {
    let grid: Vec<f64> = (0..=60).map(|i| 0.25 * 1.07f64.powi(i)).collect();
    let mut temps = vec![1.0f32; gamma];
    // Running product of the calibrated confidences of positions < k, per block.
    let mut prefix: Vec<f64> = vec![1.0; obs.len()];
    for k in 0..gamma {
        let rows: Vec<usize> = (0..obs.len())
            .filter(|&i| obs[i].logits.len() > k)
            .collect();
        if rows.is_empty() {
            break;
        }
        let y: Vec<bool> = rows.iter().map(|&i| obs[i].accepted > k).collect();
        let mut best = (f64::MAX, 1.0f64);
        for &t in &grid {
            let p: Vec<f64> = rows
                .iter()
                .map(|&i| prefix[i] * sigmoid(obs[i].logits[k] as f64 / t))
                .collect();
            let e = ece(&p, &y, bins);
            if e < best.0 - 1e-12 {
                best = (e, t);
            }
        }
        temps[k] = best.1 as f32;
        for &i in &rows {
            prefix[i] *= sigmoid(obs[i].logits[k] as f64 / best.1);
        }
    }
    temps
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    #[test]
    fn ece_and_auc_on_known_cases() {
        assert!(ece(&[0.9, 0.9, 0.1, 0.1], &[true, true, false, false], 10) < 0.11);
        assert!((ece(&[1.0, 1.0], &[false, false], 10) - 1.0).abs() < 1e-12);
        assert_eq!(
            roc_auc(&[0.1, 0.2, 0.8, 0.9], &[false, false, true, true]),
            1.0
        );
        assert_eq!(roc_auc(&[0.5, 0.5], &[false, true]), 0.5);
    }

    #[test]
    fn sts_recovers_overconfident_logits() {
        // True per-position acceptance σ(z/3): the raw logits are 3× overconfident.
        let mut rng = Rng::new(2);
        let gamma = 4;
        let obs: Vec<Observed> = (0..20_000)
            .map(|_| {
                let logits: Vec<f32> = (0..gamma).map(|_| (rng.normal() * 3.0) as f32).collect();
                let mut accepted = 0;
                for &z in &logits {
                    if rng.uniform() < sigmoid(z as f64 / 3.0) {
                        accepted += 1;
                    } else {
                        break;
                    }
                }
                Observed { logits, accepted }
            })
            .collect();
        let t = fit_sts(&obs, gamma, 15);
        assert!((t[0] - 3.0).abs() < 0.5, "{t:?}");
        // Calibrated cumulative survival has small ECE at every position.
        let mut prefix = vec![1.0f64; obs.len()];
        for k in 0..gamma {
            let p: Vec<f64> = obs
                .iter()
                .zip(prefix.iter_mut())
                .map(|(o, pr)| {
                    *pr *= sigmoid(o.logits[k] as f64 / t[k] as f64);
                    *pr
                })
                .collect();
            let y: Vec<bool> = obs.iter().map(|o| o.accepted > k).collect();
            assert!(
                ece(&p, &y, 15) < 0.02,
                "position {k}: ECE {}",
                ece(&p, &y, 15)
            );
        }
    }
}
