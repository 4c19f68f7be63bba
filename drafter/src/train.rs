//! Training on CPU: the target (frozen, our runtime) runs once over a chunk of text and gives the
//! context features of its feature layers and p_t at every position; random anchors in the chunk
//! give γ-token blocks; loss Σ_k w_k (α_ce·CE + α_tv·TV(p_d, p_t) + α_conf·BCE(c_k, c*_k)) with
//! w_k = exp(−(k−1)/γ), c*_k = 1 − TV (detached), Markov head teacher-forced on the true token.

use crate::model::DsparkDrafter;
use crate::{DrafterError, Result};
use candle_core::Var;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use dspark_runtime::Model;
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use kernels::rng::Rng;
use std::collections::HashMap;
use std::path::Path;

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub steps: usize,
    /// Anchors (blocks) per step.
    pub batch: usize,
    /// Tokens per teacher forward.
    pub chunk: usize,
    pub lr: f64,
    pub warmup: usize,
    pub seed: u64,
    pub alpha_ce: f64,
    pub alpha_tv: f64,
    pub alpha_conf: f64,
    /// Weight of a distillation term H(p_t, p_d) (gradient p_d − p_t). TV's gradient is
    /// p_d-weighted, so it barely moves tokens the drafter does not yet predict; this dense term
    /// makes a CPU-sized training budget go much further. 0 = the objective above alone.
    pub alpha_kl: f64,
    /// Steps drawn from each teacher forward (fresh anchors each time): the target forward
    /// costs about as much as a drafter step, so a chunk serves several.
    pub reuse: usize,
    /// Teacher chunks a step draws its blocks from (one is replaced every `reuse` steps): blocks
    /// cut from one 192-token chunk are strongly correlated, so a batch spread over several
    /// texts gives a far less noisy gradient at the same teacher cost.
    pub pool: usize,
    /// Weight of the auxiliary parallel-only loss (base logits, own confidence head) in a
    /// Markov drafter; 0 trains the Markov drafter alone.
    pub parallel_weight: f64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 1000,
            batch: 16,
            chunk: 192,
            lr: 1e-3,
            warmup: 50,
            seed: 0,
            alpha_ce: 0.1,
            alpha_tv: 0.9,
            alpha_conf: 1.0,
            alpha_kl: 1.0,
            reuse: 4,
            pool: 8,
            parallel_weight: 0.5,
        }
    }
}

/// One step's numbers.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub step: usize,
    pub loss: f64,
    pub ce: f64,
    pub tv: f64,
    pub conf: f64,
    pub tv_parallel: f64,
    pub soft_ce: f64,
    pub lr: f64,
    /// Supervised block positions per second.
    pub tok_s: f64,
}

/// The frozen target's view of a chunk: features (S × F·d) and logits (S × V).
pub struct TeacherChunk {
    pub tokens: Vec<u32>,
    pub feats: Vec<f32>,
    pub logits: Vec<f32>,
}

pub fn teacher(target: &Model, tokens: &[u32], layers: &[usize]) -> Result<TeacherChunk> {
    let mut cache = target.new_cache(tokens.len() + 16, 16)?;
    let s = cache.new_seq();
    let o = target.forward(
        &mut cache,
        &[SeqInput {
            seq: s,
            tokens,
            logits: LogitsMode::All,
        }],
        &ForwardOptions {
            layers: layers.to_vec(),
            ..Default::default()
        },
    )?;
    let d = target.cfg.d_model;
    let n = tokens.len();
    let mut feats = vec![0f32; n * d * layers.len()];
    for t in 0..n {
        for (li, lh) in o.layer_hidden.iter().enumerate() {
            feats[(t * layers.len() + li) * d..(t * layers.len() + li + 1) * d]
                .copy_from_slice(&lh[t * d..(t + 1) * d]);
        }
    }
    Ok(TeacherChunk {
        tokens: tokens.to_vec(),
        feats,
        logits: o.logits,
    })
}

/// The output rows training supervises: the drafter's draft vocabulary when it has one (train
/// what is served; the head and the Markov bias then cost n/V of the full vocabulary's), else
/// every token. Built once per run.
#[derive(Clone)]
pub struct TrainHead {
    /// Head rows (n × d).
    head: Tensor,
    /// W2 columns of those rows (n), when restricted.
    cols: Option<Tensor>,
    /// Full-vocabulary id → row (u32::MAX outside), when restricted.
    row_of: Option<Vec<u32>>,
    /// Full-vocabulary ids of the rows, when restricted.
    ids: Option<Vec<u32>>,
}

impl TrainHead {
    pub fn new(dr: &DsparkDrafter) -> Result<Self> {
        let Some(ids) = dr.draft_vocab.clone() else {
            return Ok(Self {
                head: dr.head().clone(),
                cols: None,
                row_of: None,
                ids: None,
            });
        };
        let mut row_of = vec![u32::MAX; dr.cfg.vocab];
        for (i, &t) in ids.iter().enumerate() {
            if let Some(r) = row_of.get_mut(t as usize) {
                *r = i as u32;
            }
        }
        let cols = Tensor::from_vec(ids.clone(), ids.len(), &Device::Cpu)?;
        Ok(Self {
            head: dr.head().index_select(&cols, 0)?,
            cols: Some(cols),
            row_of: Some(row_of),
            ids: Some(ids),
        })
    }

    /// Rows supervised.
    pub fn rows(&self) -> usize {
        self.ids.as_ref().map_or(self.head.dims()[0], |v| v.len())
    }
}

/// A batch of blocks cut from a teacher chunk.
pub struct Batch {
    pub feats: Tensor,
    pub anchors: Tensor,
    pub prev: Tensor,
    /// Next tokens as rows of the supervised head (u32::MAX: outside the draft vocabulary, which
    /// the drafter can never propose: no CE term).
    pub targets: Tensor,
    /// The target's distribution over the supervised rows (B × γ × n); with a draft vocabulary
    /// the mass outside it is 1 − Σ.
    pub p_t: Tensor,
    pub head: TrainHead,
}

pub fn make_batch(ch: &TeacherChunk, dr: &DsparkDrafter, anchors: &[usize]) -> Result<Batch> {
    make_batch_with(ch, dr, &TrainHead::new(dr)?, anchors)
}

pub fn make_batch_with(
    ch: &TeacherChunk,
    dr: &DsparkDrafter,
    th: &TrainHead,
    anchors: &[usize],
) -> Result<Batch> {
    let picks: Vec<(&TeacherChunk, usize)> = anchors.iter().map(|&j| (ch, j)).collect();
    make_batch_from(dr, th, &picks)
}

/// A batch of blocks, each cut from its own chunk at its anchor.
pub fn make_batch_from(
    dr: &DsparkDrafter,
    th: &TrainHead,
    picks: &[(&TeacherChunk, usize)],
) -> Result<Batch> {
    let (c, g, v) = (dr.cfg.context, dr.cfg.gamma, dr.cfg.vocab);
    let n = th.rows();
    let fd = dr.cfg.feature_layers.len() * dr.cfg.d_model;
    let b = picks.len();
    let mut feats = Vec::with_capacity(b * c * fd);
    let mut anc = Vec::with_capacity(b);
    let mut prev = Vec::with_capacity(b * g);
    let mut tgt = Vec::with_capacity(b * g);
    let mut pt = Vec::with_capacity(b * g * n);
    let mut p = vec![0f32; v];
    for &(ch, j) in picks {
        if j < c || j + g >= ch.tokens.len() {
            return Err(DrafterError::Invalid(format!(
                "anchor {j} lacks context or continuation"
            )));
        }
        feats.extend_from_slice(&ch.feats[(j - c) * fd..j * fd]);
        anc.push(ch.tokens[j]);
        for k in 0..g {
            prev.push(ch.tokens[j + k]);
            let y = ch.tokens[j + k + 1];
            p.copy_from_slice(&ch.logits[(j + k) * v..(j + k + 1) * v]);
            kernels::ops::softmax(&mut p);
            match (&th.row_of, &th.ids) {
                (Some(row_of), Some(ids)) => {
                    tgt.push(row_of.get(y as usize).copied().unwrap_or(u32::MAX));
                    pt.extend(ids.iter().map(|&t| p[t as usize]));
                }
                _ => {
                    tgt.push(y);
                    pt.extend_from_slice(&p);
                }
            }
        }
    }
    let dev = Device::Cpu;
    Ok(Batch {
        feats: Tensor::from_vec(feats, (b, c, fd), &dev)?,
        anchors: Tensor::from_vec(anc, b, &dev)?,
        prev: Tensor::from_vec(prev, (b, g), &dev)?,
        targets: Tensor::from_vec(tgt, (b, g), &dev)?,
        p_t: Tensor::from_vec(pt, (b, g, n), &dev)?,
        head: th.clone(),
    })
}

/// Per-row gradient of the loss w.r.t. the logits, and the row's loss terms.
///
/// `w·(α_ce·CE + α_tv·TV + α_kl·H)` with CE = −log p_y, TV = ½‖p − p_t‖₁ and
/// H = −Σ p_t log p: dCE/dz = p − 1_y, dTV/dz_u = p_u (s_u − Σ_v p_v s_v) with
/// s = ½ sign(p − p_t), dH/dz = (Σ p_t)·p − p_t. Over a draft vocabulary p_t sums to s < 1: the
/// mass outside adds ½(1 − s) to TV (what the drafter can never match) and is left out of H;
/// y outside (`y ≥ len`) has no CE term. Computed by hand because the frozen head stays
/// outside autograd (its V × d gradient would be built and thrown away).
fn row_grad(
    logits: &[f32],
    pt: &[f32],
    y: usize,
    w: f32,
    tc: &TrainConfig,
    g: &mut [f32],
) -> (f64, f64, f64) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0f64;
    for (gi, &l) in g.iter_mut().zip(logits) {
        let e = (l - m).exp();
        *gi = e;
        z += e as f64;
    }
    let inv = (1.0 / z) as f32;
    let sign = |d: f32| {
        if d > 0.0 {
            0.5
        } else if d < 0.0 {
            -0.5
        } else {
            0.0
        }
    };
    let (mut tv, mut dot, mut soft) = (0f64, 0f64, 0f64);
    for ((gi, &q), &l) in g.iter_mut().zip(pt).zip(logits) {
        let p = *gi * inv;
        *gi = p;
        let d = p - q;
        tv += d.abs() as f64;
        dot += (p * sign(d)) as f64;
        soft += (q * (l - m)) as f64;
    }
    let s_in: f64 = pt.iter().map(|&q| q as f64).sum();
    let tv = 0.5 * (tv + (1.0 - s_in).max(0.0));
    // H(p_t, p_d) = −Σ p_t log p_d = s·log z − Σ p_t (l − m).
    let soft_ce = s_in * z.ln() - soft;
    let ce = g.get(y).map_or(0.0, |&p| -((p.max(1e-30)) as f64).ln());
    let (a_ce, a_tv, a_kl, dot, s_in) = (
        tc.alpha_ce as f32,
        tc.alpha_tv as f32,
        tc.alpha_kl as f32,
        dot as f32,
        s_in as f32,
    );
    let a_ce = if y < g.len() { a_ce } else { 0.0 };
    for (gi, &q) in g.iter_mut().zip(pt) {
        let p = *gi;
        let d = p - q;
        *gi = w * (a_ce * p + a_tv * p * (sign(d) - dot) + a_kl * (s_in * p - q));
    }
    if let Some(gy) = g.get_mut(y) {
        *gy -= w * a_ce;
    }
    (ce, tv, soft_ce)
}

/// Loss terms of a step, averaged over block positions.
#[derive(Clone, Copy, Debug, Default)]
pub struct LossParts {
    /// The weighted objective Σ_k w_k (α_ce·CE + α_tv·TV + α_conf·BCE) / (B·Σw).
    pub total: f64,
    pub ce: f64,
    pub tv: f64,
    pub conf: f64,
    /// TV of the parallel-only logits (the ablation trained beside the Markov drafter).
    pub tv_parallel: f64,
    /// Cross-entropy against the target's distribution, H(p_t, p_d).
    pub soft_ce: f64,
}

/// Binary cross-entropy with logits, elementwise: softplus(z) − c·z. softplus is
/// max(z, 0) + ln(1 + e^−|z|): e^z overflows f32 past z ≈ 88.7 (an infinite loss whose gradient
/// is NaN).
fn bce_with_logits(z: &Tensor, cstar: &Tensor) -> Result<Tensor> {
    let softplus = (z.relu()? + ((z.abs()?.neg()?.exp()? + 1.0)?.log()?))?;
    Ok((softplus - (cstar * z)?)?)
}

/// The step's surrogate: a scalar whose gradient w.r.t. every trainable variable equals the
/// gradient of the objective. The head products (logits = h·Eᵀ, dh = dlogits·E) run outside
/// autograd; the Markov bias, the backbone and the confidence heads go through it. A Markov
/// drafter also supervises its base logits (weight `parallel_weight`) and a confidence head over
/// h alone, which gives the parallel-only ablation on the same backbone.
pub fn surrogate(dr: &DsparkDrafter, bt: &Batch, tc: &TrainConfig) -> Result<(Tensor, LossParts)> {
    let h = dr.hidden(&bt.feats, &bt.anchors)?; // B × γ × d, tracked
    let (b, g, d) = h.dims3()?;
    let th = &bt.head;
    let v = th.rows();
    let base = h.detach().reshape((b * g, d))?.matmul(&th.head.t()?)?; // untracked
    let mk = dr.markov_terms_cols(&bt.prev, th.cols.as_ref())?;
    let logits = match &mk {
        Some((bias, _)) => (&base + bias.detach().reshape((b * g, v))?)?,
        None => base.clone(),
    };
    let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
    let base_v: Option<Vec<f32>> = match &mk {
        Some(_) if tc.parallel_weight > 0.0 => Some(base.flatten_all()?.to_vec1()?),
        _ => None,
    };
    let pt: Vec<f32> = bt.p_t.flatten_all()?.to_vec1()?;
    let ys: Vec<u32> = bt.targets.flatten_all()?.to_vec1()?;
    let wk: Vec<f32> = (0..g).map(|k| (-(k as f32) / g as f32).exp()).collect();
    let norm = b as f32 * wk.iter().sum::<f32>();
    let rows = b * g;
    let mut gm = vec![0f32; rows * v];
    let mut gb = vec![0f32; if base_v.is_some() { rows * v } else { 0 }];
    let mut stats = vec![(0f64, 0f64, 0f64, 0f64); rows];
    // Rows are independent: two halves on two threads.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4);
    let per = rows.div_ceil(threads);
    std::thread::scope(|sc| {
        let mut gm_rest = gm.as_mut_slice();
        let mut gb_rest = gb.as_mut_slice();
        let mut st_rest = stats.as_mut_slice();
        let mut r0 = 0;
        while r0 < rows {
            let n = per.min(rows - r0);
            let (gm_c, gm_t) = gm_rest.split_at_mut(n * v);
            gm_rest = gm_t;
            let gb_n = if gb_rest.is_empty() { 0 } else { n * v };
            let (gb_c, gb_t) = gb_rest.split_at_mut(gb_n);
            gb_rest = gb_t;
            let (st_c, st_t) = st_rest.split_at_mut(n);
            st_rest = st_t;
            let (logits, pt, ys, wk, base_v) = (&logits, &pt, &ys, &wk, &base_v);
            sc.spawn(move || {
                for i in 0..n {
                    let r = r0 + i;
                    let w = wk[r % g] / norm;
                    let y = ys[r] as usize;
                    let (ce, tv, kl) = row_grad(
                        &logits[r * v..(r + 1) * v],
                        &pt[r * v..(r + 1) * v],
                        y,
                        w,
                        tc,
                        &mut gm_c[i * v..(i + 1) * v],
                    );
                    let mut tvp = 0.0;
                    if let Some(bv) = base_v {
                        let wp = w * tc.parallel_weight as f32;
                        tvp = row_grad(
                            &bv[r * v..(r + 1) * v],
                            &pt[r * v..(r + 1) * v],
                            y,
                            wp,
                            tc,
                            &mut gb_c[i * v..(i + 1) * v],
                        )
                        .1;
                    }
                    st_c[i] = (ce, tv, tvp, kl);
                }
            });
            r0 += n;
        }
    });
    let dev = Device::Cpu;
    // dh = (g_markov + g_base)·E (untracked), then ⟨h, dh⟩ carries it into the backbone.
    let mut gh_src = gm.clone();
    if !gb.is_empty() {
        for (a, b) in gh_src.iter_mut().zip(&gb) {
            *a += *b;
        }
    }
    let dh = Tensor::from_vec(gh_src, (rows, v), &dev)?
        .matmul(&th.head)?
        .reshape((b, g, d))?;
    let mut sur = (&h * &dh)?.sum_all()?;
    if let Some((bias, _)) = &mk {
        let gmt = Tensor::from_vec(gm, (b, g, v), &dev)?;
        sur = (sur + (bias * &gmt)?.sum_all()?)?;
    }
    // Confidence heads: BCE with logits against c* = 1 − TV (detached), through autograd.
    let wt = (Tensor::from_vec(wk.clone(), (1, g), &dev)? / norm as f64)?;
    let bce = bce_with_logits;
    let cstar: Vec<f32> = stats.iter().map(|s| 1.0 - s.1 as f32).collect();
    let cstar = Tensor::from_vec(cstar, (b, g), &dev)?;
    let z = dr.conf_logits(&h, mk.as_ref().map(|m| &m.1))?;
    let l_conf = bce(&z, &cstar)?;
    sur = (sur + (l_conf.broadcast_mul(&wt)?.sum_all()? * tc.alpha_conf)?)?;
    if base_v.is_some() {
        if let Some(zp) = dr.conf_par_logits(&h)? {
            let cp: Vec<f32> = stats.iter().map(|s| 1.0 - s.2 as f32).collect();
            let cp = Tensor::from_vec(cp, (b, g), &dev)?;
            let lp = bce(&zp, &cp)?;
            sur = (sur
                + (lp.broadcast_mul(&wt)?.sum_all()? * (tc.alpha_conf * tc.parallel_weight))?)?;
        }
    }
    let confs: Vec<f32> = l_conf.flatten_all()?.to_vec1()?;
    let mut parts = LossParts::default();
    for (r, s) in stats.iter().enumerate() {
        let w = (wk[r % g] / norm) as f64;
        parts.total += w
            * (tc.alpha_ce * s.0
                + tc.alpha_tv * s.1
                + tc.alpha_kl * s.3
                + tc.alpha_conf * confs[r] as f64);
        parts.ce += s.0 / rows as f64;
        parts.tv += s.1 / rows as f64;
        parts.conf += confs[r] as f64 / rows as f64;
        parts.tv_parallel += s.2 / rows as f64;
        parts.soft_ce += s.3 / rows as f64;
    }
    Ok((sur, parts))
}

/// The objective for a batch (no gradient): what `surrogate` reports as `total`.
pub fn loss(dr: &DsparkDrafter, bt: &Batch, tc: &TrainConfig) -> Result<LossParts> {
    Ok(surrogate(dr, bt, tc)?.1)
}

/// AdamW (decoupled weight decay, bias-corrected moments; candle_nn's `AdamW` rule) as one
/// pass per variable over plain vectors. candle's optimizer builds a dozen full-size temporaries
/// per variable per step; with ~11 M parameters that was 40 % of a training step. Variables are
/// kept by name: a checkpoint's moments must find their variable in another process, where the
/// `VarMap`'s (hash map) order differs.
pub struct FusedAdamW {
    /// Name, variable, first and second moments.
    vars: Vec<(String, Var, Vec<f32>, Vec<f32>)>,
    weight_decay: f32,
    step: i32,
}

impl FusedAdamW {
    const B1: f32 = 0.9;
    const B2: f32 = 0.999;
    const EPS: f32 = 1e-8;

    /// Over unnamed variables (named by their index).
    pub fn new(vars: Vec<Var>, weight_decay: f64) -> Self {
        let named = vars
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect();
        Self::named(named, weight_decay)
    }

    /// Over every variable of `varmap`, by name.
    pub fn from_varmap(varmap: &VarMap, weight_decay: f64) -> Result<Self> {
        let mut named: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| DrafterError::Invalid("variable map poisoned".into()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Self::named(named, weight_decay))
    }

    fn named(vars: Vec<(String, Var)>, weight_decay: f64) -> Self {
        let vars = vars
            .into_iter()
            .map(|(name, v)| {
                let n = v.elem_count();
                (name, v, vec![0f32; n], vec![0f32; n])
            })
            .collect();
        Self {
            vars,
            weight_decay: weight_decay as f32,
            step: 0,
        }
    }

    /// Sets every variable's weights and moments, and the update count, from a saved state
    /// that must hold exactly these variables, each of its size.
    pub fn restore(&mut self, saved: &HashMap<String, VarState>, step: i32) -> Result<()> {
        if let Some(name) = saved
            .keys()
            .find(|k| !self.vars.iter().any(|(n, ..)| n == *k))
        {
            return Err(DrafterError::Invalid(format!(
                "the trainer state holds variable `{name}`, which this drafter lacks"
            )));
        }
        // Every variable is checked before any is written: a refused state leaves the drafter
        // as it was.
        for (name, var, ..) in &self.vars {
            let s = saved.get(name.as_str()).ok_or_else(|| {
                DrafterError::Invalid(format!("the trainer state lacks variable `{name}`"))
            })?;
            let n = var.elem_count();
            if [s.weight.len(), s.m.len(), s.v.len()] != [n; 3] {
                return Err(DrafterError::Invalid(format!(
                    "the trainer state's `{name}` holds {} weights and moments of {} and {}; \
                     the drafter's has {n}",
                    s.weight.len(),
                    s.m.len(),
                    s.v.len()
                )));
            }
        }
        for (name, var, m, v) in &mut self.vars {
            let Some(s) = saved.get(name.as_str()) else {
                continue;
            };
            var.set(&Tensor::from_slice(
                s.weight.as_slice(),
                var.shape(),
                var.device(),
            )?)?;
            m.copy_from_slice(&s.m);
            v.copy_from_slice(&s.v);
        }
        self.step = step;
        Ok(())
    }

    /// Every variable's weights and moments, by name (a copy, for a checkpoint).
    pub fn var_states(&self) -> Result<HashMap<String, VarState>> {
        self.vars
            .iter()
            .map(|(name, var, m, v)| {
                let weight: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
                Ok((
                    name.clone(),
                    VarState {
                        weight,
                        m: m.clone(),
                        v: v.clone(),
                    },
                ))
            })
            .collect::<Result<_>>()
    }

    /// One update at learning rate `lr`; variables without a gradient are left alone.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let lr = lr as f32;
        let c1 = 1.0 / (1.0 - Self::B1.powi(self.step));
        let c2 = 1.0 / (1.0 - Self::B2.powi(self.step));
        let decay = 1.0 - lr * self.weight_decay;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (_, var, m, v) in &mut self.vars {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
            let mut p: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            let update = |p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]| {
                for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
                    *m = Self::B1 * *m + (1.0 - Self::B1) * g;
                    *v = Self::B2 * *v + (1.0 - Self::B2) * g * g;
                    *p = *p * decay - lr * (*m * c1) / ((*v * c2).sqrt() + Self::EPS);
                }
            };
            let per = p.len().div_ceil(threads).max(1 << 16);
            std::thread::scope(|sc| {
                for (((p, m), v), g) in p
                    .chunks_mut(per)
                    .zip(m.chunks_mut(per))
                    .zip(v.chunks_mut(per))
                    .zip(g.chunks(per))
                {
                    sc.spawn(move || update(p, m, v, g));
                }
            });
            var.set(&Tensor::from_vec(p, var.shape(), var.device())?)?;
        }
        Ok(())
    }
}

/// One variable's f32 weights and AdamW moments in a [`TrainerState`]. The weights travel with
/// the moments because the drafter checkpoint stores f16: resumed from it, a run would not be
/// the run it continues.
#[derive(Clone, Debug, PartialEq)]
pub struct VarState {
    pub weight: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// The file a [`TrainerState`] is saved to, beside the drafter checkpoint.
pub const TRAINER_STATE_FILE: &str = "optimizer.safetensors";

/// Everything besides the config that the training loop carries from one step to the next, so
/// that a run interrupted at a checkpoint and resumed from it ends with the weights of the
/// uninterrupted run (bit for bit, on the same machine and thread count).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainerState {
    /// The next step to run.
    pub step: usize,
    /// Updates the optimizer has taken (its bias correction).
    pub adam_step: i32,
    /// The data-order RNG; None seeds it from the config and `step` (a checkpoint from before
    /// trainer states were saved).
    pub rng: Option<[u64; 4]>,
    /// Start offsets into the token stream of the pool's teacher chunks, in slot order; the
    /// chunks are recomputed from them. Empty: the pool is drawn afresh.
    pub pool: Vec<usize>,
    /// Weights and moments by variable name; empty: fresh moments (and a fresh update count)
    /// over the weights the drafter holds.
    pub vars: HashMap<String, VarState>,
    /// A hash of the token stream trained on ([`text_hash`]): the pool's offsets point into it.
    pub text: Option<u64>,
}

/// FNV-1a over a token stream's length and tokens: ties a trainer state to its training text.
pub fn text_hash(data: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in std::iter::once(data.len() as u64).chain(data.iter().map(|&t| u64::from(t))) {
        h ^= x;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl TrainerState {
    /// A run that goes on at `step` with a fresh optimizer, RNG and pool: how a checkpoint from
    /// before trainer states were saved resumes.
    pub fn fresh_at(step: usize) -> Self {
        Self {
            step,
            ..Default::default()
        }
    }

    /// Writes [`TRAINER_STATE_FILE`] into `dir` in one file (a temporary, then renamed), so a
    /// save interrupted midway leaves the previous state whole: f32 vectors `w.{var}`,
    /// `m.{var}`, `v.{var}`, and i64 vectors `step`, `adam_step`, `rng` (bits), `pool`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let dev = Device::Cpu;
        let ints = |v: Vec<i64>| {
            let n = v.len();
            Tensor::from_vec(v, n, &dev)
        };
        let mut t: HashMap<String, Tensor> = HashMap::new();
        t.insert("step".into(), ints(vec![self.step as i64])?);
        t.insert("adam_step".into(), ints(vec![i64::from(self.adam_step)])?);
        if let Some(rng) = self.rng {
            t.insert("rng".into(), ints(rng.iter().map(|&x| x as i64).collect())?);
        }
        if !self.pool.is_empty() {
            t.insert(
                "pool".into(),
                ints(self.pool.iter().map(|&x| x as i64).collect())?,
            );
        }
        if let Some(h) = self.text {
            t.insert("text".into(), ints(vec![h as i64])?);
        }
        for (name, s) in &self.vars {
            for (prefix, x) in [("w", &s.weight), ("m", &s.m), ("v", &s.v)] {
                t.insert(
                    format!("{prefix}.{name}"),
                    Tensor::from_slice(x.as_slice(), x.len(), &dev)?,
                );
            }
        }
        let tmp = dir.join(format!("{TRAINER_STATE_FILE}.tmp"));
        candle_core::safetensors::save(&t, &tmp)?;
        std::fs::rename(&tmp, dir.join(TRAINER_STATE_FILE))?;
        Ok(())
    }

    /// Reads what [`TrainerState::save`] wrote; a missing file, entry or moment, or vectors of
    /// unequal sizes, are errors naming the entry. Whether the variables are the drafter's is
    /// checked when training restores them.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(TRAINER_STATE_FILE);
        let bad = |reason: String| DrafterError::Checkpoint {
            path: path.display().to_string(),
            reason,
        };
        let file = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| bad(format!("{TRAINER_STATE_FILE}: {e}")))?;
        let ints = |key: &str| -> Result<Option<Vec<i64>>> {
            file.get(key)
                .map(|t| t.flatten_all()?.to_vec1::<i64>())
                .transpose()
                .map_err(|e| bad(format!("`{key}`: {e}")))
        };
        let one = |key: &str| -> Result<i64> {
            match ints(key)?.as_deref() {
                Some(&[x]) => Ok(x),
                _ => Err(bad(format!("`{key}` is missing or not one number"))),
            }
        };
        let step = usize::try_from(one("step")?).map_err(|_| bad("`step` is negative".into()))?;
        let text = match ints("text")? {
            None => None,
            Some(_) => Some(one("text")? as u64),
        };
        let adam_step = i32::try_from(one("adam_step")?)
            .map_err(|_| bad("`adam_step` is out of range".into()))?;
        let rng = match ints("rng")? {
            None => None,
            Some(v) => Some(
                <[i64; 4]>::try_from(v.as_slice())
                    .map_err(|_| bad(format!("`rng` holds {} numbers, not 4", v.len())))?
                    .map(|x| x as u64),
            ),
        };
        let pool = ints("pool")?
            .unwrap_or_default()
            .into_iter()
            .map(|x| usize::try_from(x).map_err(|_| bad(format!("`pool` holds offset {x}"))))
            .collect::<Result<Vec<_>>>()?;
        let mut parts: HashMap<String, [Option<Vec<f32>>; 3]> = HashMap::new();
        for (key, t) in &file {
            let slot = match key.split_once('.') {
                Some(("w", name)) => Some((0, name)),
                Some(("m", name)) => Some((1, name)),
                Some(("v", name)) => Some((2, name)),
                None if matches!(key.as_str(), "step" | "adam_step" | "rng" | "pool" | "text") => {
                    None
                }
                _ => return Err(bad(format!("unknown entry `{key}`"))),
            };
            let Some((i, name)) = slot else {
                continue;
            };
            if t.dtype() != DType::F32 || t.rank() != 1 {
                return Err(bad(format!(
                    "`{key}` is {:?} of shape {:?}, not an f32 vector",
                    t.dtype(),
                    t.dims()
                )));
            }
            let x = t.to_vec1().map_err(|e| bad(format!("`{key}`: {e}")))?;
            parts.entry(name.to_string()).or_default()[i] = Some(x);
        }
        let mut vars = HashMap::with_capacity(parts.len());
        for (name, [w, m, v]) in parts {
            let (Some(weight), Some(m), Some(v)) = (w, m, v) else {
                return Err(bad(format!(
                    "variable `{name}` lacks its weights or a moment"
                )));
            };
            if m.len() != weight.len() || v.len() != weight.len() {
                return Err(bad(format!(
                    "variable `{name}` has {} weights and moments of {} and {}",
                    weight.len(),
                    m.len(),
                    v.len()
                )));
            }
            vars.insert(name, VarState { weight, m, v });
        }
        // xoshiro's all-zero state draws zeros forever.
        if rng == Some([0; 4]) {
            return Err(bad("`rng` is all zeros".into()));
        }
        if vars.is_empty() {
            return Err(bad("no variables (weights and moments)".into()));
        }
        Ok(Self {
            step,
            adam_step,
            rng,
            pool,
            vars,
            text,
        })
    }
}

/// The trainer's state after a step, lent to `on_step` so that a checkpoint can save it.
pub struct Snapshot<'a> {
    step: usize,
    text: u64,
    opt: &'a FusedAdamW,
    rng: &'a Rng,
    pool: &'a [usize],
}

impl Snapshot<'_> {
    /// The step a run resumed from this state runs first.
    pub fn next_step(&self) -> usize {
        self.step
    }

    /// A copy of the state (weights and moments included: three times the parameters' bytes).
    pub fn state(&self) -> Result<TrainerState> {
        Ok(TrainerState {
            step: self.step,
            adam_step: self.opt.step,
            rng: Some(self.rng.state()),
            pool: self.pool.to_vec(),
            vars: self.opt.var_states()?,
            text: Some(self.text),
        })
    }

    /// Saves the state into `dir` ([`TrainerState::save`]).
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.state()?.save(dir)
    }
}

/// Cosine schedule with linear warm-up.
pub fn lr_at(step: usize, tc: &TrainConfig) -> f64 {
    if step < tc.warmup {
        return tc.lr * (step + 1) as f64 / tc.warmup as f64;
    }
    let p = (step - tc.warmup) as f64 / (tc.steps.saturating_sub(tc.warmup)).max(1) as f64;
    tc.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p.min(1.0)).cos()))
}

/// Trains `dr` on the token stream `data` for steps `resume.step..tc.steps` (from step 0 with a
/// fresh optimizer when `resume` is None), calling `on_step` after each step (progress;
/// checkpoints save the [`Snapshot`]). A resumed state's weights, moments, RNG and teacher pool
/// are restored first, so the run goes on as if it had never stopped.
pub fn train(
    target: &Model,
    dr: &DsparkDrafter,
    data: &[u32],
    tc: &TrainConfig,
    resume: Option<TrainerState>,
    on_step: &mut dyn FnMut(&StepStats, &Snapshot<'_>) -> Result<()>,
) -> Result<()> {
    let (c, g) = (dr.cfg.context, dr.cfg.gamma);
    if data.len() < tc.chunk + 1 || tc.chunk < c + g + 2 {
        return Err(DrafterError::Invalid(format!(
            "need at least {} training tokens and chunk > context + γ (have {} tokens, chunk {})",
            tc.chunk + 1,
            data.len(),
            tc.chunk
        )));
    }
    let TrainerState {
        step: first,
        adam_step,
        rng,
        pool: saved_pool,
        vars,
        text,
    } = resume.unwrap_or_default();
    let text_now = text_hash(data);
    if text.is_some_and(|h| h != text_now) {
        return Err(DrafterError::Invalid(
            "the trainer state was saved training on other text (its data order points into \
             it): resume on the same --data and --max-bytes, or remove optimizer.safetensors \
             to go on from the checkpoint with fresh optimizer moments and data order"
                .into(),
        ));
    }
    let mut opt = FusedAdamW::from_varmap(&dr.varmap, 0.01)?;
    if !vars.is_empty() {
        opt.restore(&vars, adam_step)?;
    }
    // The optimizer holds its own copy now.
    drop(vars);
    // Without a saved RNG (a fresh run, or a checkpoint from before trainer states) the data
    // order is seeded from the step: a run from 0 draws from `tc.seed`.
    let mut rng = match rng {
        Some(s) => Rng::from_state(s),
        None => Rng::new(tc.seed ^ (first as u64).wrapping_mul(0x9e37_79b9)),
    };
    let th = TrainHead::new(dr)?;
    let pool = tc.pool.max(1);
    let reuse = tc.reuse.max(1);
    // Each pool slot's chunk and the offset it was cut at (what a checkpoint saves).
    let mut chunks: Vec<TeacherChunk> = Vec::with_capacity(pool);
    let mut offsets: Vec<usize> = Vec::with_capacity(pool);
    for &s0 in saved_pool.iter().take(pool) {
        if s0 > data.len() - tc.chunk {
            return Err(DrafterError::Invalid(format!(
                "the trainer state's teacher chunk at token {s0} runs past the training text \
                 ({} tokens, chunk {}): resume on the text and chunk size it was trained with",
                data.len(),
                tc.chunk
            )));
        }
        chunks.push(teacher(
            target,
            &data[s0..s0 + tc.chunk],
            &dr.cfg.feature_layers,
        )?);
        offsets.push(s0);
    }
    let fresh = |rng: &mut Rng| -> Result<(usize, TeacherChunk)> {
        let s0 = rng.below(data.len() - tc.chunk);
        let ch = teacher(target, &data[s0..s0 + tc.chunk], &dr.cfg.feature_layers)?;
        Ok((s0, ch))
    };
    for step in first..tc.steps {
        let t0 = std::time::Instant::now();
        // A pool short of chunks (a fresh run) is filled; a full one has a slot replaced every
        // `reuse` steps. Which depends on the pool and the step alone, not on where the run
        // started, so a resumed run (its pool restored full) draws what the uninterrupted did.
        if chunks.len() < pool {
            while chunks.len() < pool {
                let (s0, ch) = fresh(&mut rng)?;
                chunks.push(ch);
                offsets.push(s0);
            }
        } else if step % reuse == 0 {
            let slot = (step / reuse) % pool;
            let (s0, ch) = fresh(&mut rng)?;
            chunks[slot] = ch;
            offsets[slot] = s0;
        }
        let picks: Vec<(&TeacherChunk, usize)> = (0..tc.batch)
            .map(|_| {
                (
                    &chunks[rng.below(pool)],
                    c + rng.below(tc.chunk - c - g - 1),
                )
            })
            .collect();
        let bt = make_batch_from(dr, &th, &picks)?;
        let (sur, parts) = surrogate(dr, &bt, tc)?;
        // A loss that is not finite would write NaN into every weight (and the next
        // checkpoint): stop with the last saved checkpoint intact.
        if !parts.total.is_finite() {
            return Err(DrafterError::Invalid(format!(
                "the loss at step {step} is {} (a teacher's logits or the batch are not \
                 finite); stopping before it reaches the weights",
                parts.total
            )));
        }
        let lr = lr_at(step, tc);
        opt.step(&sur.backward()?, lr)?;
        let dt = t0.elapsed().as_secs_f64();
        let snapshot = Snapshot {
            step: step + 1,
            text: text_now,
            opt: &opt,
            rng: &rng,
            pool: &offsets,
        };
        on_step(
            &StepStats {
                step,
                loss: parts.total,
                ce: parts.ce,
                tv: parts.tv,
                conf: parts.conf,
                tv_parallel: parts.tv_parallel,
                soft_ce: parts.soft_ce,
                lr,
                tok_s: (tc.batch * g) as f64 / dt,
            },
            &snapshot,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::a_max;
    use crate::model::{DrafterConfig, target_tensors};
    use candle_core::D;

    #[test]
    fn the_confidence_loss_stays_finite_at_large_logits() {
        let dev = Device::Cpu;
        let z = Var::new(&[100.0f32, -100.0, 0.0, 3.0], &dev).unwrap();
        let c = Tensor::new(&[1.0f32, 0.0, 0.5, 0.25], &dev).unwrap();
        let l = bce_with_logits(z.as_tensor(), &c).unwrap();
        let v: Vec<f32> = l.to_vec1().unwrap();
        let want = |z: f64, c: f64| (1.0 + z.exp()).ln() - c * z;
        assert!(v[0].abs() < 1e-6 && v[1].abs() < 1e-6, "{v:?}");
        assert!((v[2] as f64 - want(0.0, 0.5)).abs() < 1e-6);
        assert!((v[3] as f64 - want(3.0, 0.25)).abs() < 1e-5);
        // d/dz = σ(z) − c.
        let g = l.sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = g.get(&z).unwrap().to_vec1().unwrap();
        let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
        for (i, (&zi, &ci)) in [100.0, -100.0, 0.0, 3.0]
            .iter()
            .zip(&[1.0, 0.0, 0.5, 0.25])
            .enumerate()
        {
            assert!((g[i] as f64 - (sig(zi) - ci)).abs() < 1e-5, "{i}: {g:?}");
        }
    }

    /// The objective written out with candle autograd end to end (head included).
    fn reference(dr: &DsparkDrafter, bt: &Batch, tc: &TrainConfig) -> Tensor {
        let h = dr.hidden(&bt.feats, &bt.anchors).unwrap();
        let (b, g, _) = h.dims3().unwrap();
        let base = h.broadcast_matmul(&bt.head.head.t().unwrap()).unwrap();
        let (bias, e) = dr
            .markov_terms_cols(&bt.prev, bt.head.cols.as_ref())
            .unwrap()
            .unwrap();
        // Targets outside the draft vocabulary have no CE term.
        let ys: Vec<u32> = bt.targets.flatten_all().unwrap().to_vec1().unwrap();
        let n = bt.head.rows() as u32;
        let mask: Vec<f32> = ys.iter().map(|&y| f32::from(u8::from(y < n))).collect();
        let safe: Vec<u32> = ys.iter().map(|&y| if y < n { y } else { 0 }).collect();
        let mask = Tensor::from_vec(mask, (b, g), &Device::Cpu).unwrap();
        let safe = Tensor::from_vec(safe, (b, g, 1), &Device::Cpu).unwrap();
        let outside = (1.0 - bt.p_t.sum(D::Minus1).unwrap())
            .unwrap()
            .relu()
            .unwrap();
        let w: Vec<f32> = (0..g).map(|k| (-(k as f32) / g as f32).exp()).collect();
        let norm = b as f64 * w.iter().sum::<f32>() as f64;
        let w = Tensor::from_vec(w, (1, g), &Device::Cpu).unwrap();
        let terms = |logits: &Tensor| {
            let logp = candle_nn::ops::log_softmax(logits, D::Minus1).unwrap();
            let ce = (logp
                .gather(&safe, D::Minus1)
                .unwrap()
                .squeeze(D::Minus1)
                .unwrap()
                .neg()
                .unwrap()
                * &mask)
                .unwrap();
            let tv = (((logp.exp().unwrap() - &bt.p_t)
                .unwrap()
                .abs()
                .unwrap()
                .sum(D::Minus1)
                .unwrap()
                + &outside)
                .unwrap()
                * 0.5)
                .unwrap();
            let soft = (logp.neg().unwrap() * &bt.p_t)
                .unwrap()
                .sum(D::Minus1)
                .unwrap();
            (ce, tv, soft)
        };
        let bce = |z: &Tensor, tv: &Tensor| {
            let cstar = (1.0 - tv.detach()).unwrap();
            ((z.exp().unwrap() + 1.0).unwrap().log().unwrap() - (cstar * z).unwrap()).unwrap()
        };
        let (ce_m, tv_m, kl_m) = terms(&(&base + &bias).unwrap());
        let (ce_b, tv_b, kl_b) = terms(&base);
        let z = dr.conf_logits(&h, Some(&e)).unwrap();
        let zp = dr.conf_par_logits(&h).unwrap().unwrap();
        let per = ((ce_m * tc.alpha_ce).unwrap()
            + (tv_m.clone() * tc.alpha_tv).unwrap()
            + (kl_m * tc.alpha_kl).unwrap()
            + (bce(&z, &tv_m) * tc.alpha_conf).unwrap())
        .unwrap();
        let par = ((ce_b * tc.alpha_ce).unwrap()
            + (tv_b.clone() * tc.alpha_tv).unwrap()
            + (kl_b * tc.alpha_kl).unwrap()
            + (bce(&zp, &tv_b) * tc.alpha_conf).unwrap())
        .unwrap();
        let all = (per + (par * tc.parallel_weight).unwrap()).unwrap();
        (all.broadcast_mul(&w).unwrap().sum_all().unwrap() / norm).unwrap()
    }

    #[test]
    fn fused_adamw_takes_candles_adamw_steps() {
        use candle_nn::{AdamW, Optimizer, ParamsAdamW};
        let dev = Device::Cpu;
        let init = Tensor::randn(0f32, 1.0, (3, 70_000), &dev).unwrap();
        let (a, b) = (
            Var::from_tensor(&init).unwrap(),
            Var::from_tensor(&init).unwrap(),
        );
        let mut theirs = AdamW::new(
            vec![a.clone()],
            ParamsAdamW {
                lr: 0.01,
                weight_decay: 0.01,
                ..Default::default()
            },
        )
        .unwrap();
        let mut ours = FusedAdamW::new(vec![b.clone()], 0.01);
        for i in 0..4 {
            let lr = 0.01 / (i + 1) as f64;
            theirs.set_learning_rate(lr);
            // A loss whose gradient varies with the parameters: Σ θ³ + Σ θ.
            let loss = |x: &Var| {
                (x.as_tensor().powf(3.0).unwrap().sum_all().unwrap()
                    + x.as_tensor().sum_all().unwrap())
                .unwrap()
            };
            theirs.backward_step(&loss(&a)).unwrap();
            ours.step(&loss(&b).backward().unwrap(), lr).unwrap();
            let diff = a_max(&(a.as_tensor() - b.as_tensor()).unwrap());
            assert!(diff < 1e-5, "step {i}: {diff}");
        }
        let moved = a_max(&(a.as_tensor() - &init).unwrap());
        assert!(moved > 1e-3, "the parameters moved ({moved})");
    }

    /// Every variable's bits, by name.
    fn bits(dr: &DsparkDrafter) -> Vec<(String, Vec<u32>)> {
        let mut out: Vec<(String, Vec<u32>)> = dr
            .varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let x: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                (k.clone(), x.iter().map(|f| f.to_bits()).collect())
            })
            .collect();
        out.sort();
        out
    }

    /// A run stopped right after a checkpoint and resumed from its files (the f16 drafter and
    /// the trainer state) ends with the uninterrupted run's weights, bit for bit, with pool
    /// slots replaced on both sides of the stop; resumed with fresh moments it does not.
    #[test]
    fn a_resumed_run_ends_with_the_uninterrupted_runs_weights() {
        use crate::model::tests::{tiny_drafter, tiny_target};
        let (m, tok) = tiny_target(21, "drafter-resume");
        let data = tok
            .encode(&"the theater in there then rather inner bit tin ".repeat(20))
            .unwrap();
        // γ = 4 and context 6: chunk 24 > 6 + 4 + 2. Slots are replaced at steps 2 and 4.
        let tc = TrainConfig {
            steps: 6,
            batch: 4,
            chunk: 24,
            lr: 3e-3,
            warmup: 2,
            seed: 7,
            reuse: 2,
            pool: 3,
            ..Default::default()
        };
        assert!(data.len() > 2 * tc.chunk, "{} tokens", data.len());
        let straight = tiny_drafter(&m, &tok, 6, 3);
        train(&m, &straight, &data, &tc, None, &mut |_, _| Ok(())).unwrap();

        let dir = std::env::temp_dir().join(format!("dspark-resume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let load = || {
            let (e, h) = target_tensors(&m).unwrap();
            DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e, h).unwrap()
        };
        // Stopped after step 2 (resumed at 3) and after step 3 (resumed at 4, a step that
        // replaces a pool slot).
        let mut state = TrainerState::default();
        for stop in [3, 2] {
            let first = tiny_drafter(&m, &tok, 6, 3);
            let stopped = train(&m, &first, &data, &tc, None, &mut |s, snap| {
                if s.step == stop {
                    assert_eq!(snap.next_step(), stop + 1);
                    first.save(&dir)?;
                    snap.save(&dir)?;
                    return Err(DrafterError::Invalid("stopped".into()));
                }
                Ok(())
            });
            assert!(
                matches!(&stopped, Err(DrafterError::Invalid(e)) if e == "stopped"),
                "{stopped:?}"
            );
            state = TrainerState::load(&dir).unwrap();
            assert_eq!((state.step, state.adam_step), (stop + 1, stop as i32 + 1));
            assert_eq!(state.pool.len(), 3);
            assert!(state.rng.is_some());
            let resumed = load();
            assert_ne!(
                bits(&resumed),
                bits(&first),
                "the drafter checkpoint is f16"
            );
            train(
                &m,
                &resumed,
                &data,
                &tc,
                Some(state.clone()),
                &mut |_, _| Ok(()),
            )
            .unwrap();
            assert!(
                bits(&resumed) == bits(&straight),
                "resumed at {}: not the uninterrupted run's weights",
                stop + 1
            );
        }

        // The moments matter: zeroed (with the update count), the weights come out elsewhere.
        let mut zeroed = state.clone();
        zeroed.adam_step = 0;
        for s in zeroed.vars.values_mut() {
            s.m.fill(0.0);
            s.v.fill(0.0);
        }
        let afresh = load();
        train(&m, &afresh, &data, &tc, Some(zeroed), &mut |_, _| Ok(())).unwrap();
        assert!(bits(&afresh) != bits(&straight));

        // A state that lacks a variable, or a file whose moment is short, names the variable.
        let (name, _) = state
            .vars
            .iter()
            .max_by_key(|(_, s)| s.weight.len())
            .unwrap();
        let mut lacking = state.clone();
        lacking.vars.remove(name);
        let err = train(&m, &load(), &data, &tc, Some(lacking), &mut |_, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains(name.as_str()), "{err}");
        let other: Vec<u32> = data.iter().rev().copied().collect();
        let err = train(
            &m,
            &load(),
            &other,
            &tc,
            Some(state.clone()),
            &mut |_, _| Ok(()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("other text"), "{err}");
        let mut short = state.clone();
        short.vars.get_mut(name).unwrap().m.pop();
        short.save(&dir).unwrap();
        let err = TrainerState::load(&dir).unwrap_err();
        assert!(err.to_string().contains(name.as_str()), "{err}");
        assert!(matches!(
            TrainerState::load(&dir.join("nowhere")),
            Err(DrafterError::Checkpoint { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn surrogate_gradient_equals_the_autograd_gradient_of_the_objective() {
        check_surrogate(false);
    }

    /// Over a draft vocabulary (some next tokens outside it), the surrogate still carries the
    /// exact gradient of the restricted objective, W2 columns outside get none, and a step over
    /// the restricted head costs what its rows do.
    #[test]
    fn surrogate_over_a_draft_vocabulary_is_exact() {
        check_surrogate(true);
    }

    fn check_surrogate(restricted: bool) {
        let (m, tok) = crate::model::tests::tiny_target(23, "drafter-grad");
        let (e, h) = target_tensors(&m).unwrap();
        let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, 1, 8);
        cfg.feature_layers = vec![0, 1];
        cfg.context = 6;
        let mut dr = DsparkDrafter::new(cfg, e, h, 9).unwrap();
        // Non-zero W2 so the Markov path carries gradient into W1 too.
        for v in dr.varmap.all_vars() {
            if v.dims() == [8, m.cfg.vocab_size] {
                let r = (v.randn_like(0.0, 0.05).unwrap()).detach();
                v.set(&r).unwrap();
            }
        }
        let data = tok
            .encode(&"a cat sat on the mat and the dog ran ".repeat(6))
            .unwrap();
        let anchors = [6, 10, 17, 25, 30];
        let mut dropped = None;
        if restricted {
            // Every token but two that occur as next tokens, in a scrambled order.
            let out = [data[12], data[27]];
            let mut ids: Vec<u32> = (0..m.cfg.vocab_size as u32)
                .filter(|t| !out.contains(t))
                .collect();
            ids.reverse();
            ids.swap(0, 3);
            dr.set_draft_vocab(Some(ids)).unwrap();
            dropped = Some(out);
        }
        let ch = teacher(&m, &data[..40], &dr.cfg.feature_layers).unwrap();
        let bt = make_batch(&ch, &dr, &anchors).unwrap();
        if let Some(out) = dropped {
            let ys: Vec<u32> = bt.targets.flatten_all().unwrap().to_vec1().unwrap();
            assert!(ys.contains(&u32::MAX), "some next tokens fall outside");
            assert_eq!(bt.p_t.dims()[2], m.cfg.vocab_size - 2);
            let mass: Vec<f32> = bt
                .p_t
                .sum(D::Minus1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(
                mass.iter().all(|&s| s <= 1.0 + 1e-5) && mass.iter().any(|&s| s < 0.99),
                "p_t keeps only the inside mass: {mass:?}"
            );
            let _ = out;
        }
        let tc = TrainConfig::default();
        let (sur, parts) = surrogate(&dr, &bt, &tc).unwrap();
        let full = reference(&dr, &bt, &tc);
        // The reported total is the Markov drafter's objective (auxiliary terms left out).
        let markov_only = TrainConfig {
            parallel_weight: 0.0,
            ..tc.clone()
        };
        let want = reference(&dr, &bt, &markov_only)
            .to_scalar::<f32>()
            .unwrap() as f64;
        assert!(
            (parts.total - want).abs() < 1e-4 * want.abs().max(1.0),
            "{} vs {want}",
            parts.total
        );
        let gs = sur.backward().unwrap();
        let gr = full.backward().unwrap();
        let mut checked = 0;
        let names: Vec<(String, candle_core::Var)> = dr
            .varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (name, v) in names {
            let (Some(a), Some(b)) = (gs.get(v.as_tensor()), gr.get(v.as_tensor())) else {
                panic!(
                    "{name}: surrogate grad {}, objective grad {}",
                    gs.get(v.as_tensor()).is_some(),
                    gr.get(v.as_tensor()).is_some()
                );
            };
            let scale = a_max(b);
            let diff = a_max(&(a - b).unwrap());
            assert!(
                diff <= 1e-3 * scale + 1e-7,
                "{name}: diff {diff}, scale {scale}"
            );
            if let (Some(out), "markov.w2") = (dropped, name.as_str()) {
                for t in out {
                    let col = a.narrow(1, t as usize, 1).unwrap();
                    assert_eq!(
                        a_max(&col),
                        0.0,
                        "W2 column of token {t} outside the vocabulary"
                    );
                }
            }
            checked += 1;
        }
        assert!(checked >= 10);
    }
}
