//! Training on CPU: the target (frozen, our runtime) runs once over a chunk of text and gives the
//! context features of its feature layers and p_t at every position; random anchors in the chunk
//! give γ-token blocks; loss Σ_k w_k (α_ce·CE + α_tv·TV(p_d, p_t) + α_conf·BCE(c_k, c*_k)) with
//! w_k = exp(−(k−1)/γ), c*_k = 1 − TV (detached), Markov head teacher-forced on the true token.

use crate::model::DsparkDrafter;
use crate::{DrafterError, Result};
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use dspark_runtime::Model;
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use kernels::rng::Rng;

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

/// A batch of blocks cut from a teacher chunk.
pub struct Batch {
    pub feats: Tensor,
    pub anchors: Tensor,
    pub prev: Tensor,
    pub targets: Tensor,
    pub p_t: Tensor,
}

pub fn make_batch(ch: &TeacherChunk, dr: &DsparkDrafter, anchors: &[usize]) -> Result<Batch> {
    let (c, g, v) = (dr.cfg.context, dr.cfg.gamma, dr.cfg.vocab);
    let fd = dr.cfg.feature_layers.len() * dr.cfg.d_model;
    let b = anchors.len();
    let mut feats = Vec::with_capacity(b * c * fd);
    let mut anc = Vec::with_capacity(b);
    let mut prev = Vec::with_capacity(b * g);
    let mut tgt = Vec::with_capacity(b * g);
    let mut pt = Vec::with_capacity(b * g * v);
    for &j in anchors {
        if j < c || j + g >= ch.tokens.len() {
            return Err(DrafterError::Invalid(format!(
                "anchor {j} lacks context or continuation"
            )));
        }
        feats.extend_from_slice(&ch.feats[(j - c) * fd..j * fd]);
        anc.push(ch.tokens[j]);
        for k in 0..g {
            prev.push(ch.tokens[j + k]);
            tgt.push(ch.tokens[j + k + 1]);
            let row = &ch.logits[(j + k) * v..(j + k + 1) * v];
            let mut p = row.to_vec();
            kernels::ops::softmax(&mut p);
            pt.extend_from_slice(&p);
        }
    }
    let dev = Device::Cpu;
    Ok(Batch {
        feats: Tensor::from_vec(feats, (b, c, fd), &dev)?,
        anchors: Tensor::from_vec(anc, b, &dev)?,
        prev: Tensor::from_vec(prev, (b, g), &dev)?,
        targets: Tensor::from_vec(tgt, (b, g), &dev)?,
        p_t: Tensor::from_vec(pt, (b, g, v), &dev)?,
    })
}

/// Per-row gradient of the loss w.r.t. the logits, and the row's loss terms.
///
/// `w·(α_ce·CE + α_tv·TV)` with CE = −log p_y and TV = ½‖p − p_t‖₁: dCE/dz = p − 1_y,
/// dTV/dz_u = p_u (s_u − Σ_v p_v s_v) with s = ½ sign(p − p_t). Computed by hand because the
/// frozen head stays outside autograd (its V × d gradient would be built and thrown away).
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
    let tv = 0.5 * tv;
    // H(p_t, p_d) = −Σ p_t log p_d = log z − Σ p_t (l − m) (p_t sums to 1).
    let soft_ce = z.ln() - soft;
    let ce = -((g[y].max(1e-30)) as f64).ln();
    let (a_ce, a_tv, a_kl, dot) = (
        tc.alpha_ce as f32,
        tc.alpha_tv as f32,
        tc.alpha_kl as f32,
        dot as f32,
    );
    for (gi, &q) in g.iter_mut().zip(pt) {
        let p = *gi;
        let d = p - q;
        *gi = w * (a_ce * p + a_tv * p * (sign(d) - dot) + a_kl * d);
    }
    g[y] -= w * a_ce;
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

/// The step's surrogate: a scalar whose gradient w.r.t. every trainable variable equals the
/// gradient of the objective. The head products (logits = h·Eᵀ, dh = dlogits·E) run outside
/// autograd; the Markov bias, the backbone and the confidence heads go through it. A Markov
/// drafter also supervises its base logits (weight `parallel_weight`) and a confidence head over
/// h alone, which gives the parallel-only ablation on the same backbone.
pub fn surrogate(dr: &DsparkDrafter, bt: &Batch, tc: &TrainConfig) -> Result<(Tensor, LossParts)> {
    let h = dr.hidden(&bt.feats, &bt.anchors)?; // B × γ × d, tracked
    let (b, g, d) = h.dims3()?;
    let v = dr.cfg.vocab;
    let base = h.detach().reshape((b * g, d))?.matmul(&dr.head().t()?)?; // untracked
    let mk = dr.markov_terms(&bt.prev)?;
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
        .matmul(dr.head())?
        .reshape((b, g, d))?;
    let mut sur = (&h * &dh)?.sum_all()?;
    if let Some((bias, _)) = &mk {
        let gmt = Tensor::from_vec(gm, (b, g, v), &dev)?;
        sur = (sur + (bias * &gmt)?.sum_all()?)?;
    }
    // Confidence heads: BCE with logits against c* = 1 − TV (detached), through autograd.
    let wt = (Tensor::from_vec(wk.clone(), (1, g), &dev)? / norm as f64)?;
    let bce = |z: &Tensor, cstar: &Tensor| -> Result<Tensor> {
        let softplus = (z.exp()? + 1.0)?.log()?;
        Ok((softplus - (cstar * z)?)?)
    };
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

/// Cosine schedule with linear warm-up.
pub fn lr_at(step: usize, tc: &TrainConfig) -> f64 {
    if step < tc.warmup {
        return tc.lr * (step + 1) as f64 / tc.warmup as f64;
    }
    let p = (step - tc.warmup) as f64 / (tc.steps.saturating_sub(tc.warmup)).max(1) as f64;
    tc.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p.min(1.0)).cos()))
}

/// Trains `dr` on the token stream `data` for steps `start..tc.steps`, calling `on_step` after
/// each step (progress, checkpoints).
pub fn train(
    target: &Model,
    dr: &DsparkDrafter,
    data: &[u32],
    tc: &TrainConfig,
    start: usize,
    on_step: &mut dyn FnMut(&StepStats) -> Result<()>,
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
    let params = ParamsAdamW {
        lr: tc.lr,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = AdamW::new(dr.varmap.all_vars(), params)?;
    let mut rng = Rng::new(tc.seed ^ (start as u64).wrapping_mul(0x9e37_79b9));
    let mut ch: Option<TeacherChunk> = None;
    for step in start..tc.steps {
        let t0 = std::time::Instant::now();
        if ch.is_none() || step % tc.reuse.max(1) == 0 {
            let s0 = rng.below(data.len() - tc.chunk);
            ch = Some(teacher(
                target,
                &data[s0..s0 + tc.chunk],
                &dr.cfg.feature_layers,
            )?);
        }
        let Some(chunk) = ch.as_ref() else {
            return Err(DrafterError::Invalid("no teacher chunk".into()));
        };
        let anchors: Vec<usize> = (0..tc.batch)
            .map(|_| c + rng.below(tc.chunk - c - g - 1))
            .collect();
        let bt = make_batch(chunk, dr, &anchors)?;
        let (sur, parts) = surrogate(dr, &bt, tc)?;
        let lr = lr_at(step, tc);
        opt.set_learning_rate(lr);
        opt.backward_step(&sur)?;
        let dt = t0.elapsed().as_secs_f64();
        on_step(&StepStats {
            step,
            loss: parts.total,
            ce: parts.ce,
            tv: parts.tv,
            conf: parts.conf,
            tv_parallel: parts.tv_parallel,
            soft_ce: parts.soft_ce,
            lr,
            tok_s: (tc.batch * g) as f64 / dt,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::a_max;
    use crate::model::{DrafterConfig, target_tensors};
    use candle_core::D;

    /// The objective written out with candle autograd end to end (head included).
    fn reference(dr: &DsparkDrafter, bt: &Batch, tc: &TrainConfig) -> Tensor {
        let h = dr.hidden(&bt.feats, &bt.anchors).unwrap();
        let (b, g, _) = h.dims3().unwrap();
        let base = h.broadcast_matmul(&dr.head().t().unwrap()).unwrap();
        let (bias, e) = dr.markov_terms(&bt.prev).unwrap().unwrap();
        let w: Vec<f32> = (0..g).map(|k| (-(k as f32) / g as f32).exp()).collect();
        let norm = b as f64 * w.iter().sum::<f32>() as f64;
        let w = Tensor::from_vec(w, (1, g), &Device::Cpu).unwrap();
        let terms = |logits: &Tensor| {
            let logp = candle_nn::ops::log_softmax(logits, D::Minus1).unwrap();
            let ce = logp
                .gather(&bt.targets.unsqueeze(D::Minus1).unwrap(), D::Minus1)
                .unwrap()
                .squeeze(D::Minus1)
                .unwrap()
                .neg()
                .unwrap();
            let tv = ((logp.exp().unwrap() - &bt.p_t)
                .unwrap()
                .abs()
                .unwrap()
                .sum(D::Minus1)
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
    fn surrogate_gradient_equals_the_autograd_gradient_of_the_objective() {
        let (m, tok) = crate::model::tests::tiny_target(23, "drafter-grad");
        let (e, h) = target_tensors(&m).unwrap();
        let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, 1, 8);
        cfg.feature_layers = vec![0, 1];
        cfg.context = 6;
        let dr = DsparkDrafter::new(cfg, e, h, 9).unwrap();
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
        let ch = teacher(&m, &data[..40], &dr.cfg.feature_layers).unwrap();
        let bt = make_batch(&ch, &dr, &[6, 10, 17, 25, 30]).unwrap();
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
            checked += 1;
        }
        assert!(checked >= 10);
    }
}
