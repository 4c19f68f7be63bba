//! Training on CPU: the target (frozen, our runtime) runs once over a chunk of text and gives the
//! context features of its feature layers and p_t at every position; random anchors in the chunk
//! give γ-token blocks; loss Σ_k w_k (α_ce·CE + α_tv·TV(p_d, p_t) + α_conf·BCE(c_k, c*_k)) with
//! w_k = exp(−(k−1)/γ), c*_k = 1 − TV (detached), Markov head teacher-forced on the true token.

use crate::model::DsparkDrafter;
use crate::{DrafterError, Result};
use candle_core::{D, Device, Tensor};
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

/// Loss terms (each a scalar tensor) for a batch.
pub fn loss(dr: &DsparkDrafter, bt: &Batch, tc: &TrainConfig) -> Result<(Tensor, [f64; 3])> {
    let (logits, conf) = dr.forward_train(&bt.feats, &bt.anchors, &bt.prev)?;
    let (b, g, _) = logits.dims3()?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let ce = logp
        .gather(&bt.targets.unsqueeze(D::Minus1)?, D::Minus1)?
        .squeeze(D::Minus1)?
        .neg()?; // B × γ
    let pd = logp.exp()?;
    let tv = ((&pd - &bt.p_t)?.abs()?.sum(D::Minus1)? * 0.5)?; // B × γ
    let cstar = (1.0 - tv.detach())?;
    // BCE with logits: softplus(z) − c*·z.
    let z = conf;
    let softplus = (z.exp()? + 1.0)?.log()?;
    let bce = (softplus - (&cstar * &z)?)?;
    let w: Vec<f32> = (0..g).map(|k| (-(k as f32) / g as f32).exp()).collect();
    let wsum: f32 = w.iter().sum();
    let w = Tensor::from_vec(w, (1, g), &Device::Cpu)?;
    let per = ((ce.clone() * tc.alpha_ce)?
        + (tv.clone() * tc.alpha_tv)?
        + (bce.clone() * tc.alpha_conf)?)?;
    let total = (per.broadcast_mul(&w)?.sum_all()? / (b as f64 * wsum as f64))?;
    let scalar = |t: &Tensor| -> Result<f64> { Ok(t.mean_all()?.to_scalar::<f32>()? as f64) };
    Ok((total, [scalar(&ce)?, scalar(&tv)?, scalar(&bce)?]))
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
    for step in start..tc.steps {
        let t0 = std::time::Instant::now();
        let s0 = rng.below(data.len() - tc.chunk);
        let ch = teacher(target, &data[s0..s0 + tc.chunk], &dr.cfg.feature_layers)?;
        let anchors: Vec<usize> = (0..tc.batch)
            .map(|_| c + rng.below(tc.chunk - c - g - 1))
            .collect();
        let bt = make_batch(&ch, dr, &anchors)?;
        let (l, parts) = loss(dr, &bt, tc)?;
        let lr = lr_at(step, tc);
        opt.set_learning_rate(lr);
        opt.backward_step(&l)?;
        let dt = t0.elapsed().as_secs_f64();
        on_step(&StepStats {
            step,
            loss: l.to_scalar::<f32>()? as f64,
            ce: parts[0],
            tv: parts[1],
            conf: parts[2],
            lr,
            tok_s: (tc.batch * g) as f64 / dt,
        })?;
    }
    Ok(())
}
