//! Calibration of the drafter's confidences.
//!
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
//!
//! Before STS, an optional per-position mix (ours) turns three inputs into the logit:
//! z'_k = a·z_k + b·logit(max p_d,k) + c·H(p_d,k) + d, where z_k is the confidence head's logit and
//! p_d,k the draft distribution at position k. The draft distribution is computed from
//! x_1..x_{k−1} before x_k is drawn, so the confidence still never depends on x_k; how sure the
//! drafter is of its own next token is the strongest single predictor of acceptance we have
//! (a logistic regression per position, fitted on the blocks that reached it).

use specdec::proposer::{CONF_INPUTS, ConfInputs};

/// Per-position mix weights: one per confidence input, then a bias.
pub type Mix = [f32; CONF_INPUTS + 1];

/// Reads stored mixes, including those written before the copy-evidence input existed (one
/// weight fewer: the missing weight is 0, so they mean what they meant).
pub fn de_mixes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Mix>, D::Error> {
    let rows: Vec<Vec<f32>> = serde::Deserialize::deserialize(d)?;
    rows.into_iter()
        .map(|r| {
            let mut m = [0f32; CONF_INPUTS + 1];
            match r.len() {
                n if n == CONF_INPUTS + 1 => m.copy_from_slice(&r),
                n if n == CONF_INPUTS => {
                    m[..CONF_INPUTS - 1].copy_from_slice(&r[..CONF_INPUTS - 1]);
                    m[CONF_INPUTS] = r[CONF_INPUTS - 1];
                }
                n => {
                    return Err(serde::de::Error::custom(format!(
                        "a confidence mix has {} weights and a bias, not {n} numbers",
                        CONF_INPUTS
                    )));
                }
            }
            Ok(m)
        })
        .collect()
}

/// One drafted position with a copy candidate, and what the target committed there (recorded
/// by a drafter running without the copy prior, for [`fit_copy`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopySample {
    /// Length of the suffix match that proposed the candidate.
    pub len: usize,
    /// Block position (0-based).
    pub k: usize,
    /// How far the candidate's logit was below the top logit (≥ 0).
    pub gap: f32,
    /// The candidate's probability under the draft distribution.
    pub q_c: f32,
    /// The target committed the candidate.
    pub hit_c: bool,
    /// The target committed the draft distribution's top token.
    pub hit_top: bool,
}

/// A drafted position of a greedy request with the confidence head's inputs, and whether
/// the target committed the drafted token there (recorded for [`fit_greedy_head`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HeadSample {
    /// The request's fold (0 or 1, from a hash of its prompt): heads fitted on one fold's
    /// requests serve the other's while the input mix is fitted.
    pub fold: u8,
    /// Block position (0-based).
    pub k: usize,
    pub hit: bool,
    /// [h_k; W1[x_{k−1}]], or in a copy run [`crate::proposer::copy_inputs`].
    pub x: Vec<f32>,
    /// The position was drafted by a copy run (its inputs are the copy-run head's).
    pub copy_run: bool,
}

/// L2 weight of the greedy head's logistic regression, on standardized inputs and the summed
/// log loss. Chosen on the first 48 held-out prompts of each set: 1 to 10 ranked alike.
pub const GREEDY_HEAD_L2: f64 = 3.0;

/// Fits the greedy confidence head ([`crate::model::GreedyHead`]): a logistic regression of
/// `hit` on the standardized inputs with one bias per position, by Newton's method with an L2
/// penalty `l2` on the weights. None when the samples cannot support a fit (under 200, or
/// under 20 of either outcome).
pub fn fit_greedy_head(
    samples: &[HeadSample],
    gamma: usize,
    l2: f64,
) -> crate::Result<Option<crate::model::GreedyHead>> {
    let hits = samples.iter().filter(|s| s.hit).count();
    let Some(width) = samples.first().map(|s| s.x.len()) else {
        return Ok(None);
    };
    if samples.len() < 200
        || hits < 20
        || samples.len() - hits < 20
        || samples.iter().any(|s| s.x.len() != width || s.k >= gamma)
    {
        return Ok(None);
    }
    let n = samples.len();
    let p = width + gamma;
    // Standardized inputs, then the position's one-hot column.
    let mut mean = vec![0f64; width];
    let mut var = vec![0f64; width];
    for s in samples {
        for (m, &x) in mean.iter_mut().zip(&s.x) {
            *m += x as f64;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n as f64);
    for s in samples {
        for ((v, &x), m) in var.iter_mut().zip(&s.x).zip(&mean) {
            *v += (x as f64 - m).powi(2);
        }
    }
    let sd: Vec<f64> = var
        .iter()
        .map(|v| (v / n as f64).sqrt().max(1e-6))
        .collect();
    let mut z = vec![0f32; n * p];
    for (row, s) in z.chunks_exact_mut(p).zip(samples) {
        for j in 0..width {
            row[j] = ((s.x[j] as f64 - mean[j]) / sd[j]) as f32;
        }
        row[width + s.k] = 1.0;
    }
    let y: Vec<f64> = samples
        .iter()
        .map(|s| if s.hit { 1.0 } else { 0.0 })
        .collect();
    let zt = candle_core::Tensor::from_vec(z.clone(), (n, p), &candle_core::Device::Cpu)?;
    let mut theta = vec![0f64; p];
    for _ in 0..30 {
        let mut grad = vec![0f64; p];
        let mut w = vec![0f32; n];
        for (i, row) in z.chunks_exact(p).enumerate() {
            let eta: f64 = row.iter().zip(&theta).map(|(&a, b)| a as f64 * b).sum();
            let pi = 1.0 / (1.0 + (-eta).exp());
            w[i] = (pi * (1.0 - pi)).max(1e-9) as f32;
            let r = pi - y[i];
            for (g, &a) in grad.iter_mut().zip(row) {
                *g += r * a as f64;
            }
        }
        // Zᵀ diag(w) Z, the log loss's Hessian.
        let wt = candle_core::Tensor::from_vec(w, (n, 1), &candle_core::Device::Cpu)?;
        let hess: Vec<Vec<f32>> = zt.t()?.matmul(&zt.broadcast_mul(&wt)?)?.to_vec2()?;
        let mut h: Vec<f64> = hess.into_iter().flatten().map(|x| x as f64).collect();
        for j in 0..p {
            // The penalty on the weights; a trace on the biases keeps unseen positions at 0 (a
            // position seen rarely and with one outcome only drifts towards ±30 instead).
            let pen = if j < width { l2 } else { 1e-6 };
            grad[j] += pen * theta[j];
            h[j * p + j] += pen;
        }
        let Some(step) = cholesky_solve(&mut h, &grad, p) else {
            return Ok(None);
        };
        let mut biggest = 0f64;
        for (t, d) in theta.iter_mut().zip(&step) {
            *t -= d;
            biggest = biggest.max(d.abs());
        }
        if biggest < 1e-5 {
            break;
        }
    }
    if theta.iter().any(|t| !t.is_finite()) {
        return Ok(None);
    }
    // Back to the raw inputs: w_j = β_j/σ_j, bias_k = b_k − Σ_j β_j μ_j/σ_j.
    let w: Vec<f32> = (0..width).map(|j| (theta[j] / sd[j]) as f32).collect();
    let shift: f64 = (0..width).map(|j| theta[j] * mean[j] / sd[j]).sum();
    let bias = (0..gamma)
        .map(|k| (theta[width + k] - shift) as f32)
        .collect();
    Ok(Some(crate::model::GreedyHead { w, bias }))
}

/// Solves A x = b for a symmetric positive definite `a` (n × n, row-major, overwritten by its
/// Cholesky factor); None when it is not positive definite.
fn cholesky_solve(a: &mut [f64], b: &[f64], n: usize) -> Option<Vec<f64>> {
    for j in 0..n {
        let mut d = a[j * n + j];
        for k in 0..j {
            d -= a[j * n + k] * a[j * n + k];
        }
        if d <= 0.0 || !d.is_finite() {
            return None;
        }
        let d = d.sqrt();
        a[j * n + j] = d;
        for i in j + 1..n {
            let mut s = a[i * n + j];
            for k in 0..j {
                s -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = s / d;
        }
    }
    // L y = b, then Lᵀ x = y.
    let mut x = b.to_vec();
    for i in 0..n {
        for k in 0..i {
            x[i] -= a[i * n + k] * x[k];
        }
        x[i] /= a[i * n + i];
    }
    for i in (0..n).rev() {
        for k in i + 1..n {
            x[i] -= a[k * n + i] * x[k];
        }
        x[i] /= a[i * n + i];
    }
    Some(x)
}

/// The fit of one match-length bucket.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CopyFit {
    pub len: usize,
    pub samples: usize,
    /// How often the target committed the candidate, and the drafter's top token.
    pub precision: f64,
    pub top_precision: f64,
    pub bias: f32,
    /// The objective without and with the bias: greedy, the share of positions whose drafted
    /// token the target commits; sampled, the mean gain in log-likelihood of the committed
    /// token over the drafter alone (0 without the bias).
    pub objective_before: f64,
    pub objective_after: f64,
}

/// Fits the copy prior: per match length (the last bucket holds that length and longer) the
/// logit bonus b ≥ 0 of the candidate. Greedy requests draft the argmax, so b maximizes how
/// often the drafted token is the one the target commits (the candidate wins when its gap to
/// the top logit is at most b). Sampled requests maximize the log-likelihood of the committed
/// token (a sample of the target's distribution, whatever was drafted) under
/// q' ∝ q·e^{b·[x = candidate]}: log q'(y) = log q(y) + b·[y = c] − ln(1 + q_c(e^b − 1)), a
/// proper score, so q'(c) matches how often the candidate is right. Buckets with fewer than
/// `min_samples` samples get no bonus.
pub fn fit_copy(
    samples: &[CopySample],
    buckets: usize,
    greedy: bool,
    min_samples: usize,
) -> (Vec<f32>, Vec<CopyFit>) {
    let mut bias = vec![0f32; buckets];
    let mut fits = Vec::new();
    for (bi, b) in bias.iter_mut().enumerate() {
        let s: Vec<&CopySample> = samples
            .iter()
            .filter(|x| x.len.min(buckets).max(1) - 1 == bi)
            .collect();
        let n = s.len();
        let objective = |beta: f64| -> f64 {
            let sum: f64 = if greedy {
                s.iter()
                    .map(|x| {
                        let hit = if (x.gap as f64) <= beta {
                            x.hit_c
                        } else {
                            x.hit_top
                        };
                        hit as u8 as f64
                    })
                    .sum()
            } else {
                s.iter()
                    .map(|x| {
                        let q = (x.q_c as f64).clamp(0.0, 1.0);
                        beta * x.hit_c as u8 as f64 - (q * beta.exp_m1()).ln_1p()
                    })
                    .sum()
            };
            sum / n.max(1) as f64
        };
        let before = objective(0.0);
        let mut best = (0.0f64, before);
        if n >= min_samples {
            for i in 1..=400 {
                let beta = i as f64 * 0.05;
                let v = objective(beta);
                // Strictly better only: ties keep the smaller bonus.
                if v > best.1 + 1e-12 {
                    best = (beta, v);
                }
            }
        }
        *b = best.0 as f32;
        let rate =
            |f: fn(&CopySample) -> bool| s.iter().filter(|x| f(x)).count() as f64 / n.max(1) as f64;
        fits.push(CopyFit {
            len: bi + 1,
            samples: n,
            precision: rate(|x| x.hit_c),
            top_precision: rate(|x| x.hit_top),
            bias: *b,
            objective_before: before,
            objective_after: best.1,
        });
    }
    (bias, fits)
}

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
    // Over the pairs ranked: labels past the shorter slice are not counted.
    let y = &y[..idx.len()];
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

/// One held-out block: per drafted position the confidence inputs (head logit first), and how
/// many drafts were accepted.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub inputs: Vec<ConfInputs>,
    pub accepted: usize,
    /// Per position, the acceptance probability it had (1 − TV), when known (sampled decoding).
    pub accept_prob: Vec<f32>,
    /// Confidences that came without inputs (greedy copy runs, proposers that report
    /// confidences only): served as they are, whatever the calibration; empty otherwise.
    pub fixed: Vec<f32>,
    /// The confidences the engine served (after its online recalibration); empty when not
    /// recorded.
    pub served: Vec<f32>,
    /// The engine step that verified the block (0 when not recorded).
    pub step: usize,
}

impl Observed {
    /// A block whose confidences come from head logits alone.
    pub fn from_logits(logits: &[f32], accepted: usize) -> Self {
        Self {
            inputs: logits
                .iter()
                .map(|&z| {
                    let mut x = [0f32; CONF_INPUTS];
                    x[0] = z;
                    x
                })
                .collect(),
            accepted,
            accept_prob: Vec::new(),
            fixed: Vec::new(),
            served: Vec::new(),
            step: 0,
        }
    }

    /// Positions drafted (and verified).
    pub fn len(&self) -> usize {
        self.inputs.len().max(self.fixed.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The confidence of position `k` under `score`.
    pub fn conf(&self, k: usize, score: Score<'_>) -> f64 {
        match score {
            Score::Served => self.served.get(k).map_or(f64::NAN, |&c| c as f64),
            Score::Sts(sts) => match self.fixed.get(k) {
                Some(&c) => c as f64,
                None => self.inputs.get(k).map_or(f64::NAN, |x| sts.conf(k, x)),
            },
        }
    }
}

/// Which confidences a block's evaluation reads.
#[derive(Clone, Copy, Debug)]
pub enum Score<'a> {
    /// The static calibration applied to the recorded inputs (fixed confidences as they are).
    Sts(&'a Sts),
    /// What the engine served.
    Served,
}

/// Per-position calibration: c_k = σ(z'_k / T_k − s_k), z'_k the mixed logit (the head's logit
/// z_k when there is no mix).
#[derive(Clone, Debug, PartialEq)]
pub struct Sts {
    pub temps: Vec<f32>,
    pub shifts: Vec<f32>,
    /// Per position: z' = a·z + b·logit(max p_d) + c·H(p_d) + e·logit(running acceptance) + d
    /// (weights in input order, bias last); empty = z' = z.
    pub mix: Vec<Mix>,
}

impl Sts {
    /// No calibration: T = 1, s = 0 at every position.
    pub fn identity(gamma: usize) -> Self {
        Self {
            temps: vec![1.0; gamma],
            shifts: vec![0.0; gamma],
            mix: Vec::new(),
        }
    }

    /// From stored temperatures and shifts (missing shifts are 0).
    pub fn new(temps: &[f32], shifts: &[f32]) -> Self {
        Self {
            temps: temps.to_vec(),
            shifts: (0..temps.len())
                .map(|k| shifts.get(k).copied().unwrap_or(0.0))
                .collect(),
            mix: Vec::new(),
        }
    }

    /// With a per-position input mix (empty: the head's logit alone).
    pub fn with_mix(mut self, mix: &[Mix]) -> Self {
        self.mix = mix.to_vec();
        self
    }

    /// The first `g` positions.
    pub fn truncated(&self, g: usize) -> Self {
        Self {
            temps: self.temps.iter().take(g).copied().collect(),
            shifts: self.shifts.iter().take(g).copied().collect(),
            mix: self.mix.iter().take(g).copied().collect(),
        }
    }

    /// The mixed logit z'_k of position `k`'s inputs.
    pub fn mixed(&self, k: usize, x: &ConfInputs) -> f64 {
        match self.mix.get(k) {
            Some(w) => {
                x.iter()
                    .zip(w)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    + w[CONF_INPUTS] as f64
            }
            None => x[0] as f64,
        }
    }

    /// The calibrated confidence of a mixed logit `z` at block position `k` (0-based).
    pub fn conf_of_logit(&self, k: usize, z: f64) -> f64 {
        let t = self.temps.get(k).copied().unwrap_or(1.0).max(1e-3) as f64;
        let s = self.shifts.get(k).copied().unwrap_or(0.0) as f64;
        sigmoid(z / t - s)
    }

    /// The calibrated confidence of position `k` (0-based) from its inputs.
    pub fn conf(&self, k: usize, x: &ConfInputs) -> f64 {
        self.conf_of_logit(k, self.mixed(k, x))
    }
}

/// Logistic regression of 0/1 outcomes on rows `x` (each with a trailing 1 for the bias) by
/// Newton's method with a small ridge (keeps separable data finite). Returns the weights.
pub fn fit_logistic<const N: usize>(x: &[[f64; N]], y: &[bool], ridge: f64) -> [f64; N] {
    let mut w = [0f64; N];
    let loss = |w: &[f64; N]| -> f64 {
        let mut l = 0.0;
        for (xi, &yi) in x.iter().zip(y) {
            let z: f64 = (0..N).map(|j| w[j] * xi[j]).sum();
            // log(1 + e^z) − y·z, stable.
            l += z.max(0.0) + (-z.abs()).exp().ln_1p() - if yi { z } else { 0.0 };
        }
        l + 0.5 * ridge * w.iter().map(|v| v * v).sum::<f64>()
    };
    let mut cur = loss(&w);
    for _ in 0..50 {
        let mut g = [0f64; N];
        let mut h = [[0f64; N]; N];
        for (xi, &yi) in x.iter().zip(y) {
            let z: f64 = (0..N).map(|j| w[j] * xi[j]).sum();
            let p = sigmoid(z);
            let r = p - yi as u8 as f64;
            let s = p * (1.0 - p);
            for a in 0..N {
                g[a] += r * xi[a];
                for b in 0..N {
                    h[a][b] += s * xi[a] * xi[b];
                }
            }
        }
        for a in 0..N {
            g[a] += ridge * w[a];
            h[a][a] += ridge;
        }
        let Some(step) = solve(h, g) else {
            break;
        };
        // Damped step: halve until the loss does not rise.
        let mut t = 1.0;
        let mut next = w;
        let mut improved = false;
        for _ in 0..30 {
            for j in 0..N {
                next[j] = w[j] - t * step[j];
            }
            let l = loss(&next);
            if l <= cur {
                improved = cur - l > 1e-10 * cur.abs().max(1.0);
                cur = l;
                w = next;
                break;
            }
            t *= 0.5;
        }
        if !improved {
            break;
        }
    }
    w
}

/// Solves `a·x = b` by Gaussian elimination with partial pivoting; None when singular.
fn solve<const N: usize>(mut a: [[f64; N]; N], mut b: [f64; N]) -> Option<[f64; N]> {
    for c in 0..N {
        let p = (c..N).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        if a[p][c].abs() < 1e-12 {
            return None;
        }
        a.swap(c, p);
        b.swap(c, p);
        for r in c + 1..N {
            let f = a[r][c] / a[c][c];
            for k in c..N {
                a[r][k] -= f * a[c][k];
            }
            b[r] -= f * b[c];
        }
    }
    let mut x = [0f64; N];
    for c in (0..N).rev() {
        let s: f64 = (c + 1..N).map(|k| a[c][k] * x[k]).sum();
        x[c] = (b[c] - s) / a[c][c];
    }
    Some(x)
}

/// Per position, the logistic mix of the three confidence inputs that best predicts "accepted
/// at k | reached k" on the blocks that reached k (positions nobody reached keep z' = z).
pub fn fit_mix(obs: &[Observed], gamma: usize) -> Vec<Mix> {
    (0..gamma)
        .map(|k| {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for o in obs {
                if let Some(v) = o.inputs.get(k) {
                    if o.accepted >= k {
                        let mut row = [1f64; CONF_INPUTS + 1];
                        for (r, &a) in row.iter_mut().zip(v) {
                            *r = a as f64;
                        }
                        x.push(row);
                        y.push(o.accepted > k);
                    }
                }
            }
            let mut mix = [0f32; CONF_INPUTS + 1];
            if x.len() < 20 || y.iter().all(|&v| v) || y.iter().all(|&v| !v) {
                mix[0] = 1.0;
                return mix;
            }
            let w = fit_logistic(&x, &y, 1e-3);
            for (m, v) in mix.iter_mut().zip(w) {
                *m = v as f32;
            }
            mix
        })
        .collect()
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
/// position k uses every block that drafted it (survival of the prefix is observed for every
/// k ≤ drafted length). With `mix`, the per-position input mix is fitted first ([`fit_mix`])
/// and STS calibrates the mixed logits.
pub fn fit_sts(obs: &[Observed], gamma: usize, mix: bool) -> Sts {
    // The geometric grid steps over T = 1 (0.967, 1.035): the identity is offered too.
    let grid: Vec<f64> = (0..=60)
        .map(|i| 0.25 * 1.07f64.powi(i))
        .chain([1.0])
        .collect();
    let shifts: Vec<f64> = (-30..=30).map(|i| i as f64 * 0.1).collect();
    let mut sts = Sts::identity(gamma);
    if mix {
        sts.mix = fit_mix(obs, gamma);
    }
    // The mixed logits, per block and position.
    let z: Vec<Vec<f64>> = obs
        .iter()
        .map(|o| {
            o.inputs
                .iter()
                .enumerate()
                .map(|(k, x)| sts.mixed(k, x))
                .collect()
        })
        .collect();
    // Blocks whose confidences are served as they are take part through their prefix only.
    let fixed_at = |i: usize, k: usize| obs[i].fixed.get(k).map(|&c| c as f64);
    // Running product of the calibrated confidences of positions < k, per block.
    let mut prefix: Vec<f64> = vec![1.0; obs.len()];
    for k in 0..gamma {
        let rows: Vec<usize> = (0..obs.len()).filter(|&i| obs[i].len() > k).collect();
        if rows.is_empty() {
            break;
        }
        let y: Vec<bool> = rows.iter().map(|&i| obs[i].accepted > k).collect();
        let mut best = (f64::MAX, 1.0f64, 0.0f64);
        let mut p = vec![0f64; rows.len()];
        for &t in &grid {
            for &sh in &shifts {
                for (pi, &i) in p.iter_mut().zip(&rows) {
                    *pi = prefix[i] * fixed_at(i, k).unwrap_or_else(|| sigmoid(z[i][k] / t - sh));
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
            prefix[i] *= fixed_at(i, k).unwrap_or_else(|| sts.conf_of_logit(k, z[i][k]));
        }
    }
    sts
}

/// Bins of every reported ECE.
pub const ECE_BINS: usize = 15;

/// Per block position: the cumulative confidence Π_{i≤k} c_i of every block that reached k
/// (`g` positions at most), and whether its prefix survived (accepted > k).
fn cumulative_survival(obs: &[Observed], g: usize, score: Score<'_>) -> Vec<(Vec<f64>, Vec<bool>)> {
    let mut prefix = vec![1.0f64; obs.len()];
    let mut out = Vec::new();
    for k in 0..g {
        let rows: Vec<usize> = (0..obs.len()).filter(|&i| obs[i].len() > k).collect();
        if rows.is_empty() {
            break;
        }
        let mut p = Vec::with_capacity(rows.len());
        let mut y = Vec::with_capacity(rows.len());
        for &i in &rows {
            prefix[i] *= obs[i].conf(k, score);
            p.push(prefix[i]);
            y.push(obs[i].accepted > k);
        }
        out.push((p, y));
    }
    out
}

fn positions(obs: &[Observed], score: Score<'_>) -> usize {
    match score {
        Score::Sts(s) => s.temps.len(),
        Score::Served => obs.iter().map(|o| o.served.len()).max().unwrap_or(0),
    }
}

/// ECE per block position of the cumulative calibrated confidence Π_{i≤k} c_i against observed
/// prefix survival (accepted > k).
pub fn cumulative_ece(obs: &[Observed], sts: &Sts) -> Vec<f64> {
    cumulative_ece_by(obs, Score::Sts(sts))
}

/// [`cumulative_ece`] of the confidences `score` reads.
pub fn cumulative_ece_by(obs: &[Observed], score: Score<'_>) -> Vec<f64> {
    cumulative_survival(obs, positions(obs, score), score)
        .iter()
        .map(|(p, y)| ece(p, y, ECE_BINS))
        .collect()
}

/// Per block position: the mean cumulative calibrated confidence and the observed prefix
/// survival rate over the blocks that reached it. Where the ECE is large these say which way:
/// over-confident (first above second) or under-confident.
pub fn cumulative_means(obs: &[Observed], sts: &Sts) -> Vec<(f64, f64)> {
    cumulative_means_by(obs, Score::Sts(sts))
}

/// [`cumulative_means`] of the confidences `score` reads.
pub fn cumulative_means_by(obs: &[Observed], score: Score<'_>) -> Vec<(f64, f64)> {
    cumulative_survival(obs, positions(obs, score), score)
        .iter()
        .map(|(p, y)| {
            let n = p.len().max(1) as f64;
            (
                p.iter().sum::<f64>() / n,
                y.iter().filter(|&&v| v).count() as f64 / n,
            )
        })
        .collect()
}

/// What [`cumulative_ece`] would read per position if these confidences were exactly
/// calibrated: `(mean, 95th percentile)` of [`ece_floor`] at each position's sample size.
pub fn cumulative_ece_floor(obs: &[Observed], sts: &Sts, draws: usize) -> Vec<(f64, f64)> {
    cumulative_ece_floor_by(obs, Score::Sts(sts), draws)
}

/// [`cumulative_ece_floor`] of the confidences `score` reads.
pub fn cumulative_ece_floor_by(
    obs: &[Observed],
    score: Score<'_>,
    draws: usize,
) -> Vec<(f64, f64)> {
    cumulative_survival(obs, positions(obs, score), score)
        .iter()
        .enumerate()
        .map(|(k, (p, _))| ece_floor(p, ECE_BINS, draws, 0xece0 + k as u64))
        .collect()
}

/// The binned ECE that perfectly calibrated predictions `p` show on `p.len()` outcomes, by
/// consistency resampling (Bröcker & Smith, 2007): outcomes drawn as Bernoulli(p_i), `draws`
/// times; returns the mean and the 95th percentile. Each bin's outcome rate is a sample mean,
/// so the estimate is biased upward: about 2 % for 3,000 blocks at our confidences in 15
/// bins. A measured ECE under the percentile cannot be told from calibration at this size.
pub fn ece_floor(p: &[f64], bins: usize, draws: usize, seed: u64) -> (f64, f64) {
    if p.is_empty() || draws == 0 {
        return (0.0, 0.0);
    }
    let mut rng = kernels::rng::Rng::new(seed);
    let mut y = vec![false; p.len()];
    let mut e: Vec<f64> = (0..draws)
        .map(|_| {
            for (yi, &pi) in y.iter_mut().zip(p) {
                *yi = rng.uniform() < pi;
            }
            ece(p, &y, bins)
        })
        .collect();
    e.sort_by(f64::total_cmp);
    let mean = e.iter().sum::<f64>() / draws as f64;
    let q95 = e[((draws as f64 * 0.95).ceil() as usize).clamp(1, draws) - 1];
    (mean, q95)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    /// Acceptance follows one input (off-centre and wide, so standardization matters) and the
    /// position: the fit finds that input's weight and the biases, and ranks as well as the
    /// truth; too few samples, or one outcome only, give no head.
    #[test]
    fn the_greedy_head_fit_finds_the_input_that_predicts_acceptance() {
        let mut rng = Rng::new(7);
        let (width, gamma) = (12, 4);
        let (mut samples, mut truth) = (Vec::new(), Vec::new());
        for i in 0..4_000 {
            let k = i % gamma;
            let x: Vec<f32> = (0..width)
                .map(|j| {
                    let n = rng.normal() as f32;
                    if j == 3 { 5.0 + 2.0 * n } else { n }
                })
                .collect();
            // On the raw input: 0.75·x₃ − 2.75 − 0.5·k.
            let t = 0.75 * (x[3] - 5.0) + 1.0 - 0.5 * k as f32;
            let hit = rng.uniform() < 1.0 / (1.0 + (-t as f64).exp());
            truth.push(t as f64);
            samples.push(HeadSample {
                fold: (i % 2) as u8,
                k,
                hit,
                x,
                copy_run: false,
            });
        }
        let h = fit_greedy_head(&samples, gamma, GREEDY_HEAD_L2)
            .unwrap()
            .expect("a fit");
        let got: Vec<f64> = samples
            .iter()
            .map(|s| h.logit(&s.x, None, s.k).unwrap() as f64)
            .collect();
        let y: Vec<bool> = samples.iter().map(|s| s.hit).collect();
        let (a_got, a_true) = (roc_auc(&got, &y), roc_auc(&truth, &y));
        assert!(a_got > a_true - 0.01, "fitted {a_got}, truth {a_true}");
        assert!((h.w[3] - 0.75).abs() < 0.15, "{:?}", h.w);
        assert!(
            h.w.iter()
                .enumerate()
                .all(|(j, w)| j == 3 || w.abs() < 0.15),
            "{:?}",
            h.w
        );
        for (k, b) in h.bias.iter().enumerate() {
            assert!((b - (-2.75 - 0.5 * k as f32)).abs() < 0.4, "{:?}", h.bias);
        }
        assert_eq!(h.logit(&samples[0].x[1..], None, 0), None, "wrong width");
        assert!(
            fit_greedy_head(&samples[..100], gamma, GREEDY_HEAD_L2)
                .unwrap()
                .is_none()
        );
        let all_hit: Vec<HeadSample> = samples
            .iter()
            .cloned()
            .map(|mut s| {
                s.hit = true;
                s
            })
            .collect();
        assert!(
            fit_greedy_head(&all_hit, gamma, GREEDY_HEAD_L2)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_ece_floor_separates_sampling_noise_from_miscalibration() {
        let mut rng = Rng::new(7);
        let p: Vec<f64> = (0..3000).map(|_| 0.05 + 0.6 * rng.uniform()).collect();
        let (mean, q95) = ece_floor(&p, ECE_BINS, 200, 1);
        // Calibrated outcomes: the measured ECE is well above 0 and inside the floor's spread.
        let y: Vec<bool> = p.iter().map(|&x| rng.uniform() < x).collect();
        let calibrated = ece(&p, &y, ECE_BINS);
        assert!(mean > 0.01 && mean < 0.03, "{mean}");
        assert!(
            calibrated > 0.005 && calibrated <= q95,
            "{calibrated} vs {q95}"
        );
        // Outcomes 5 points more likely than predicted: far outside it.
        let y: Vec<bool> = p.iter().map(|&x| rng.uniform() < x + 0.05).collect();
        assert!(ece(&p, &y, ECE_BINS) > q95 + 0.015);
        // Ten times the samples: the floor falls by about √10.
        let p10: Vec<f64> = (0..30000).map(|_| 0.05 + 0.6 * rng.uniform()).collect();
        let (mean10, _) = ece_floor(&p10, ECE_BINS, 50, 2);
        assert!(
            mean10 < mean / 2.5 && mean10 > mean / 4.5,
            "{mean10} vs {mean}"
        );
        assert_eq!(ece_floor(&[], ECE_BINS, 10, 0), (0.0, 0.0));
    }

    #[test]
    fn cumulative_means_say_which_way_confidences_are_off() {
        // Logit 0 → c = ½ at both positions: predicted survival ½ then ¼ under identity STS.
        // Outcomes: of four blocks, three pass position 1 and one passes position 2.
        let obs: Vec<Observed> = [1, 1, 2, 0]
            .iter()
            .map(|&a| Observed::from_logits(&[0.0, 0.0], a))
            .collect();
        let m = cumulative_means(&obs, &Sts::identity(2));
        assert_eq!(m.len(), 2);
        assert!(
            (m[0].0 - 0.5).abs() < 1e-9 && (m[0].1 - 0.75).abs() < 1e-9,
            "{m:?}"
        );
        assert!(
            (m[1].0 - 0.25).abs() < 1e-9 && (m[1].1 - 0.25).abs() < 1e-9,
            "{m:?}"
        );
    }

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
    fn the_sampled_copy_bias_makes_the_candidate_as_likely_as_it_is_right() {
        let mut rng = Rng::new(7);
        let mut samples = Vec::new();
        for _ in 0..20_000 {
            let q_c = 0.01 + 0.29 * rng.uniform() as f32;
            // Length 3: the candidate is right 70 % of the time whatever q says.
            samples.push(CopySample {
                len: 3,
                k: 0,
                gap: 1.0,
                q_c,
                hit_c: rng.uniform() < 0.7,
                hit_top: false,
            });
            // Length 1: q is already right about the candidate.
            samples.push(CopySample {
                len: 1,
                k: 0,
                gap: 1.0,
                q_c,
                hit_c: rng.uniform() < q_c as f64,
                hit_top: false,
            });
        }
        let (bias, fits) = fit_copy(&samples, 6, false, 50);
        let mean_q = |b: f32, len: usize| {
            let s: Vec<_> = samples.iter().filter(|x| x.len == len).collect();
            s.iter()
                .map(|x| {
                    let e = (b as f64).exp();
                    x.q_c as f64 * e / (1.0 + x.q_c as f64 * (e - 1.0))
                })
                .sum::<f64>()
                / s.len() as f64
        };
        assert!((mean_q(bias[2], 3) - 0.7).abs() < 0.03, "{bias:?}");
        assert!(bias[0] < 0.3, "{bias:?}");
        assert!(fits[2].objective_after > fits[2].objective_before + 0.1);
        // Buckets without samples get nothing.
        assert_eq!(bias[5], 0.0);
        assert_eq!(fits[5].samples, 0);
    }

    #[test]
    fn the_greedy_copy_bias_drafts_the_candidate_only_where_it_is_right_more_often() {
        let mut rng = Rng::new(8);
        let mut samples = Vec::new();
        for _ in 0..5_000 {
            let gap = 4.0 * rng.uniform() as f32;
            // Long matches: the candidate is right 90 %, the drafter's top token 5 %.
            let u = rng.uniform();
            samples.push(CopySample {
                len: 6,
                k: 2,
                gap,
                q_c: 0.1,
                hit_c: u < 0.9,
                hit_top: u >= 0.95,
            });
            // Short ones: the drafter's top token is right more often than the candidate.
            let u = rng.uniform();
            samples.push(CopySample {
                len: 1,
                k: 0,
                gap,
                q_c: 0.1,
                hit_c: u < 0.1,
                hit_top: u >= 0.5,
            });
        }
        let (bias, fits) = fit_copy(&samples, 6, true, 50);
        assert!(bias[5] >= 3.9, "{bias:?}");
        assert!(bias[0] < 0.2, "{bias:?}");
        assert!((fits[5].precision - 0.9).abs() < 0.02);
        assert!(fits[5].objective_after > 0.85 && fits[5].objective_before < 0.1);
        // Matches of 6 and more share the last bucket.
        let (b2, _) = fit_copy(&samples, 3, true, 50);
        assert!(b2[2] >= 3.9);
    }

    #[test]
    fn mixes_stored_before_the_copy_input_still_load() {
        let c: crate::model::CalibrationCfg =
            serde_json::from_str(r#"{"sts":[1.0],"conf_mix":[[1,2,3,4,5,6]]}"#).unwrap();
        assert_eq!(c.conf_mix, vec![[1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 6.0]]);
        let c: crate::model::CalibrationCfg =
            serde_json::from_str(r#"{"sts":[1.0],"conf_mix":[[1,2,3,4,5,6,7]]}"#).unwrap();
        assert_eq!(c.conf_mix[0][6], 7.0);
        let bad = serde_json::from_str::<crate::model::CalibrationCfg>(
            r#"{"sts":[1.0],"conf_mix":[[1,2]]}"#,
        );
        assert!(bad.unwrap_err().to_string().contains("confidence mix"));
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
                Observed::from_logits(&logits, accepted)
            })
            .collect();
        let sts = fit_sts(&obs, gamma, false);
        let t = &sts.temps;
        assert!((t[0] - 3.0).abs() < 0.5, "{sts:?}");
        // Calibrated cumulative survival has small ECE at every position.
        let mut prefix = vec![1.0f64; obs.len()];
        for k in 0..gamma {
            let p: Vec<f64> = obs
                .iter()
                .zip(prefix.iter_mut())
                .map(|(o, pr)| {
                    *pr *= sts.conf(k, &o.inputs[k]);
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
                Observed::from_logits(&[z], accepted)
            })
            .collect();
        let sts = fit_sts(&obs, 1, false);
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

    #[test]
    fn logistic_regression_recovers_known_weights() {
        let mut rng = Rng::new(5);
        let w = [1.5f64, -0.7, 0.3];
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for _ in 0..40_000 {
            let a = rng.normal();
            let b = rng.normal() * 2.0;
            x.push([a, b, 1.0]);
            y.push(rng.uniform() < sigmoid(w[0] * a + w[1] * b + w[2]));
        }
        let got = fit_logistic(&x, &y, 1e-3);
        for j in 0..3 {
            assert!((got[j] - w[j]).abs() < 0.08, "{got:?} vs {w:?}");
        }
        // Separable data stays finite (the ridge).
        let sep = fit_logistic(&[[1.0, 1.0], [-1.0, 1.0]], &[true, false], 1e-3);
        assert!(sep.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn the_mix_uses_the_draft_distribution_where_the_head_is_weak() {
        // Acceptance driven mostly by the drafter's own top probability, barely by the head's
        // logit: STS on the head alone cannot rank blocks; the mix can, and stays calibrated.
        let mut rng = Rng::new(8);
        let gamma = 3;
        let obs: Vec<Observed> = (0..20_000)
            .map(|_| {
                let mut inputs = Vec::new();
                let mut accepted = 0;
                let mut alive = true;
                for _ in 0..gamma {
                    let lmax = -(rng.uniform() * 4.0) as f32; // log max p_d in (−4, 0]
                    let ent = (-lmax as f64 * 1.5 + rng.uniform()) as f32;
                    let z = (rng.normal() * 0.3) as f32;
                    let p = sigmoid(0.3 * z as f64 + 2.0 * lmax as f64 + 1.0);
                    inputs.push([z, lmax, ent, rng.normal() as f32, rng.normal() as f32, 0.0]);
                    if alive && rng.uniform() < p {
                        accepted += 1;
                    } else {
                        alive = false;
                    }
                }
                Observed {
                    inputs,
                    accepted,
                    ..Default::default()
                }
            })
            .collect();
        let head = fit_sts(&obs, gamma, false);
        let mixed = fit_sts(&obs, gamma, true);
        let auc = |sts: &Sts| {
            let (mut sc, mut lab) = (Vec::new(), Vec::new());
            for o in &obs {
                for (k, x) in o.inputs.iter().enumerate() {
                    if o.accepted >= k {
                        sc.push(sts.conf(k, x));
                        lab.push(o.accepted > k);
                    }
                }
            }
            roc_auc(&sc, &lab)
        };
        let (a_head, a_mix) = (auc(&head), auc(&mixed));
        assert!(a_head < 0.62, "head alone {a_head}");
        assert!(a_mix > 0.8, "mixed {a_mix}");
        for (k, e) in cumulative_ece(&obs, &mixed).iter().enumerate() {
            assert!(*e < 0.02, "position {k}: ECE {e}");
        }
        // No mix fitted: confidences are those of the head logit alone.
        assert_eq!(
            head.conf(0, &[0.5, -3.0, 2.0, 1.0, -1.0, 0.0]),
            head.conf(0, &[0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
        );
    }
}
