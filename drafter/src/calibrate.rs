//! Sequential Temperature Scaling (DSpark): per block position k a temperature T_k on the
//! confidence logit, fitted left to right by grid search so that the cumulative product
//! Π_{j≤k} σ(z_j / T_j − s_j) — the predicted survival of the prefix — matches observed prefix
//! survival. Dividing a logit by T > 0 and shifting it keeps the order of confidences.
//!
//! The shift s_k extends the paper's temperature: a temperature pivots around c = ½, so a head
//! whose confidences sit mostly below ½ and are off on average (ours at position 1) cannot be
//! fixed by T alone. With two parameters the grid search minimizes the log loss of the
//! predicted prefix survival, not the ECE: the ECE alone is minimized by a constant confidence at
//! the base rate (a large T and a shift), which is calibrated and tells the scheduler nothing;
//! log loss is a proper scoring rule, so it keeps whatever resolution the logits have. The ECE
//! is what is reported.

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

/// Per-position calibration of confidence logits: c_k = σ(z_k / T_k − s_k).
#[derive(Clone, Debug, PartialEq)]
pub struct Sts {
    pub temps: Vec<f32>,
    pub shifts: Vec<f32>,
}

impl Sts {
    /// No calibration: T = 1, s = 0 at every position.
    pub fn identity(gamma: usize) -> Self {
        Self {
            temps: vec![1.0; gamma],
            shifts: vec![0.0; gamma],
        }
    }

    /// From stored temperatures and shifts (missing shifts are 0).
    pub fn new(temps: &[f32], shifts: &[f32]) -> Self {
        Self {
            temps: temps.to_vec(),
            shifts: (0..temps.len())
                .map(|k| shifts.get(k).copied().unwrap_or(0.0))
                .collect(),
        }
    }

    /// The calibrated confidence of logit `z` at block position `k` (0-based).
    pub fn conf(&self, k: usize, z: f64) -> f64 {
        let t = self.temps.get(k).copied().unwrap_or(1.0).max(1e-3) as f64;
        let s = self.shifts.get(k).copied().unwrap_or(0.0) as f64;
        sigmoid(z / t - s)
    }
}

/// Mean negative log-likelihood of 0/1 outcomes `y` under probabilities `p`.
pub fn log_loss(p: &[f64], y: &[bool]) -> f64 {
    let n = p.len().min(y.len()).max(1);
    p.iter()
        .zip(y)
        .map(|(&p, &y)| {
            let p = p.clamp(1e-7, 1.0 - 1e-7);
            -if y { p.ln() } else { (1.0 - p).ln() }
        })
        .sum::<f64>()
        / n as f64
}

/// Fits (T_k, s_k) left to right by grid search on the log loss of the cumulative product;
/// position k uses the blocks that reached it (all blocks: survival of the prefix is observed
/// for every k ≤ drafted length). `bins` is unused by the fit (kept for the ECE it reports).
pub fn fit_sts(obs: &[Observed], gamma: usize, _bins: usize) -> Sts {
    let grid: Vec<f64> = (0..=60).map(|i| 0.25 * 1.07f64.powi(i)).collect();
    let shifts: Vec<f64> = (-30..=30).map(|i| i as f64 * 0.1).collect();
    let mut sts = Sts::identity(gamma);
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
        let mut best = (f64::MAX, 1.0f64, 0.0f64);
        let mut p = vec![0f64; rows.len()];
        for &t in &grid {
            for &sh in &shifts {
                for (pi, &i) in p.iter_mut().zip(&rows) {
                    *pi = prefix[i] * sigmoid(obs[i].logits[k] as f64 / t - sh);
                }
                let e = log_loss(&p, &y);
                if e < best.0 {
                    best = (e, t, sh);
                }
            }
        }
        sts.temps[k] = best.1 as f32;
        sts.shifts[k] = best.2 as f32;
        for &i in &rows {
            prefix[i] *= sts.conf(k, obs[i].logits[k] as f64);
        }
    }
    sts
}

/// ECE per block position of the cumulative calibrated confidence Π_{i≤k} c_i against observed
/// prefix survival (accepted > k).
pub fn cumulative_ece(obs: &[Observed], sts: &Sts) -> Vec<f64> {
    let g = sts.temps.len();
    let mut prefix = vec![1.0f64; obs.len()];
    let mut out = Vec::new();
    for k in 0..g {
        let rows: Vec<usize> = (0..obs.len())
            .filter(|&i| obs[i].logits.len() > k)
            .collect();
        if rows.is_empty() {
            break;
        }
        let mut p = Vec::with_capacity(rows.len());
        let mut y = Vec::with_capacity(rows.len());
        for &i in &rows {
            prefix[i] *= sts.conf(k, obs[i].logits[k] as f64);
            p.push(prefix[i]);
            y.push(obs[i].accepted > k);
        }
        out.push(ece(&p, &y, 15));
    }
    out
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
        let sts = fit_sts(&obs, gamma, 15);
        let t = &sts.temps;
        assert!((t[0] - 3.0).abs() < 0.5, "{sts:?}");
        // Calibrated cumulative survival has small ECE at every position.
        let mut prefix = vec![1.0f64; obs.len()];
        for k in 0..gamma {
            let p: Vec<f64> = obs
                .iter()
                .zip(prefix.iter_mut())
                .map(|(o, pr)| {
                    *pr *= sts.conf(k, o.logits[k] as f64);
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

    #[test]
    fn a_shift_fixes_what_a_temperature_cannot() {
        // True acceptance σ(z/2 − 1.5): overconfident and offset (mostly below ½, like a weak
        // drafter's first position). A temperature alone pivots around ½ and stays off.
        let mut rng = Rng::new(3);
        let obs: Vec<Observed> = (0..20_000)
            .map(|_| {
                let z = (rng.normal() * 2.0 + 1.0) as f32;
                let accepted = (rng.uniform() < sigmoid(z as f64 / 2.0 - 1.5)) as usize;
                Observed {
                    logits: vec![z],
                    accepted,
                }
            })
            .collect();
        let sts = fit_sts(&obs, 1, 15);
        assert!((sts.temps[0] - 2.0).abs() < 0.5, "{sts:?}");
        assert!((sts.shifts[0] - 1.5).abs() < 0.3, "{sts:?}");
        let affine = cumulative_ece(&obs, &sts)[0];
        let mut best_t_only = f64::MAX;
        for i in 0..=60 {
            let t = (0.25 * 1.07f64.powi(i)) as f32;
            let e = cumulative_ece(&obs, &Sts::new(&[t], &[]))[0];
            best_t_only = best_t_only.min(e);
        }
        assert!(affine < 0.015, "ECE with the shift {affine}");
        assert!(
            best_t_only > 2.0 * affine,
            "temperature only {best_t_only} vs {affine}"
        );
    }
}
