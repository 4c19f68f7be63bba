//! The DSpark drafter behind the engine's `Proposer` trait: it keeps the target features of each
//! request's committed positions (reported by the engine after every forward), drafts a block in
//! one parallel forward, then samples left to right with the Markov bias of the previously
//! sampled token, reporting q_k (after the request's sampling transform) and the calibrated
//! confidence c_k, which never depends on x_k.

use crate::model::DsparkDrafter;
use candle_core::{Device, Tensor};
use kernels::sampling::{argmax, probs, sample};
use specdec::SpecError;
use specdec::proposer::{Dist, DraftBlock, ProposeReq, Proposer};
use std::collections::HashMap;

pub struct DsparkProposer {
    dr: DsparkDrafter,
    /// Per request: fused context rows (d each) of committed positions 0..n. Fusing is row-wise,
    /// so each position is fused once when the engine reports it, not once per drafted block.
    feats: HashMap<u64, Vec<f32>>,
    /// The fused row of an all-zero feature row: what pads the window of a short request.
    pad: Vec<f32>,
    label: String,
    /// The target model, whose quantized LM head (the drafter's frozen head) gives the base
    /// logits faster than the f32 copy.
    target: Option<std::sync::Arc<dspark_runtime::Model>>,
    /// W2ᵀ (V × r) in 8-bit blocks: the Markov bias W1[x]·W2 of a drafted position reads 4×
    /// fewer bytes than from the f32 W2 (it is the drafter's largest per-position cost).
    w2t: Option<kernels::matmul::QMatrix>,
    isa: kernels::Isa,
}

/// Quantizes a row-major `rows × cols` matrix (cols a multiple of 32) into 8-bit blocks with one
/// scale per 16 values.
fn quantize_q8(w: &[f32], rows: usize, cols: usize) -> Option<kernels::matmul::QMatrix> {
    use kernels::quant::BlockQ8;
    if cols % 32 != 0 || w.len() != rows * cols {
        return None;
    }
    let mut blocks = Vec::with_capacity(rows * cols / 32);
    for chunk in w.chunks_exact(32) {
        let mut b = BlockQ8::default();
        for h in 0..2 {
            let part = &chunk[h * 16..(h + 1) * 16];
            let amax = part.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = amax / 127.0;
            b.d[h] = d;
            for (i, &x) in part.iter().enumerate() {
                b.qs[h * 16 + i] = if d > 0.0 {
                    (x / d).round().clamp(-127.0, 127.0) as i8
                } else {
                    0
                };
            }
        }
        blocks.push(b);
    }
    kernels::matmul::QMatrix::new(rows, cols, kernels::matmul::QWeights::Q8(blocks)).ok()
}

fn err(e: impl std::fmt::Display) -> SpecError {
    SpecError::Invariant(format!("dspark drafter: {e}"))
}

impl DsparkProposer {
    pub fn new(dr: DsparkDrafter, label: &str) -> Self {
        let (r, v) = (dr.cfg.rank, dr.cfg.vocab);
        let w2t = dr.markov_w2().ok().flatten().and_then(|w2| {
            let mut t = vec![0f32; v * r];
            for (i, row) in w2.chunks_exact(v).enumerate() {
                for (j, &x) in row.iter().enumerate() {
                    t[j * r + i] = x;
                }
            }
            quantize_q8(&t, v, r)
        });
        let rl = dr.cfg.feature_layers.len() * dr.cfg.d_model;
        let pad = (|| -> Option<Vec<f32>> {
            let z = Tensor::zeros((1, 1, rl), candle_core::DType::F32, &Device::Cpu).ok()?;
            dr.fuse_context(&z).ok()?.flatten_all().ok()?.to_vec1().ok()
        })()
        .unwrap_or_else(|| vec![0f32; dr.cfg.d_model]);
        Self {
            w2t,
            isa: kernels::Isa::detect(),
            dr,
            feats: HashMap::new(),
            pad,
            label: label.to_string(),
            target: None,
        }
    }

    /// Computes base logits with the target's own head kernels.
    pub fn with_target_head(mut self, target: std::sync::Arc<dspark_runtime::Model>) -> Self {
        self.target = Some(target);
        self
    }

    /// Base logits of the first `kmax` positions (B·kmax rows of V) and hidden states
    /// (B × kmax × d) of one block forward: the head, the costly part, runs only for positions
    /// some request will draft.
    fn block(&self, ft: &Tensor, at: &Tensor, kmax: usize) -> specdec::Result<(Vec<f32>, Tensor)> {
        let h = self.dr.hidden_fused(ft, at).map_err(err)?;
        let (b, g, d) = h.dims3().map_err(err)?;
        let kmax = kmax.clamp(1, g);
        let h = if kmax < g {
            h.narrow(1, 0, kmax)
                .map_err(err)?
                .contiguous()
                .map_err(err)?
        } else {
            h
        };
        let base = match &self.target {
            Some(m) => {
                let rows: Vec<f32> = h.flatten_all().map_err(err)?.to_vec1().map_err(err)?;
                m.head_logits(&rows, b * kmax).map_err(err)?
            }
            None => h
                .reshape((b * kmax, d))
                .map_err(err)?
                .matmul(&self.dr.head().t().map_err(err)?)
                .map_err(err)?
                .flatten_all()
                .map_err(err)?
                .to_vec1()
                .map_err(err)?,
        };
        Ok((base, h))
    }

    fn row_len(&self) -> usize {
        self.dr.cfg.feature_layers.len() * self.dr.cfg.d_model
    }

    /// Fused context window (C rows of d, padded at the front, with the fused zero row, when
    /// the request is shorter).
    fn window(&self, id: u64) -> Vec<f32> {
        let (c, d) = (self.dr.cfg.context, self.dr.cfg.d_model);
        let mut w = Vec::with_capacity(c * d);
        let f = self.feats.get(&id).map(|f| f.as_slice()).unwrap_or(&[]);
        let n = f.len() / d;
        let take = n.min(c);
        for _ in take..c {
            w.extend_from_slice(&self.pad);
        }
        w.extend_from_slice(&f[(n - take) * d..]);
        w
    }
}

impl Proposer for DsparkProposer {
    fn name(&self) -> &str {
        &self.label
    }

    fn feature_layers(&self) -> Vec<usize> {
        self.dr.cfg.feature_layers.clone()
    }

    fn observe(&mut self, id: u64, start: usize, rows: &[f32]) -> specdec::Result<()> {
        let (rl, d) = (self.row_len(), self.dr.cfg.d_model);
        if rows.len() % rl != 0 {
            return Err(err(format!(
                "feature rows of {} values, not a multiple of {rl}",
                rows.len()
            )));
        }
        let n = rows.len() / rl;
        let fused: Vec<f32> = if n == 0 {
            Vec::new()
        } else {
            let t = Tensor::from_slice(rows, (1, n, rl), &Device::Cpu).map_err(err)?;
            self.dr
                .fuse_context(&t)
                .map_err(err)?
                .flatten_all()
                .map_err(err)?
                .to_vec1()
                .map_err(err)?
        };
        let f = self.feats.entry(id).or_default();
        // Positions past `start` were rolled back; a gap (never expected) is padded.
        if f.len() > start * d {
            f.truncate(start * d);
        }
        while f.len() < start * d {
            f.extend_from_slice(&self.pad);
        }
        f.extend_from_slice(&fused);
        Ok(())
    }

    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> specdec::Result<Vec<DraftBlock>> {
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].k > 0 && !reqs[i].context.is_empty())
            .collect();
        let mut out: Vec<DraftBlock> = reqs.iter().map(|_| DraftBlock::default()).collect();
        if active.is_empty() {
            return Ok(out);
        }
        let (c, g) = (self.dr.cfg.context, self.dr.cfg.gamma);
        let rl = self.dr.cfg.d_model;
        let mut feats = Vec::with_capacity(active.len() * c * rl);
        let mut anchors = Vec::with_capacity(active.len());
        for &i in &active {
            feats.extend(self.window(reqs[i].id));
            anchors.push(*reqs[i].context.last().unwrap_or(&0));
        }
        let b = active.len();
        let ft = Tensor::from_vec(feats, (b, c, rl), &Device::Cpu).map_err(err)?;
        let at = Tensor::from_vec(anchors.clone(), b, &Device::Cpu).map_err(err)?;
        let kmax = active.iter().map(|&i| reqs[i].k.min(g)).max().unwrap_or(1);
        let (base_all, h_all) = self.block(&ft, &at, kmax)?;
        let v = self.dr.cfg.vocab;
        let d = self.dr.cfg.d_model;
        // Positions outside, requests inside: the Markov bias of every request's previous token
        // at position k is one (B × r)·(r × V) product, reading W2 once per position instead of
        // once per request and position.
        let ks: Vec<usize> = active.iter().map(|&i| reqs[i].k.min(g)).collect();
        let mut prev = anchors;
        let mut seen: Vec<Vec<u32>> = active.iter().map(|&i| reqs[i].context.to_vec()).collect();
        let mut conf: Vec<Vec<f32>> = ks.iter().map(|&k| Vec::with_capacity(k)).collect();
        let sts = self.dr.cfg.calibration();
        for kk in 0..kmax {
            let pt = Tensor::from_vec(prev.clone(), (b, 1), &Device::Cpu).map_err(err)?;
            let e = self.dr.markov_rows(&pt).map_err(err)?;
            let bias: Option<Vec<f32>> = match (&e, &self.w2t) {
                (Some(e), Some(w2t)) => {
                    let ev: Vec<f32> = e.flatten_all().map_err(err)?.to_vec1().map_err(err)?;
                    let mut out = vec![0f32; b * v];
                    w2t.matmul(&ev, b, &mut out, self.isa);
                    Some(out)
                }
                (Some(_), None) => match self.dr.markov(&pt).map_err(err)? {
                    Some((bias, _)) => {
                        Some(bias.flatten_all().map_err(err)?.to_vec1().map_err(err)?)
                    }
                    None => None,
                },
                _ => None,
            };
            let hk = h_all
                .narrow(1, kk, 1)
                .map_err(err)?
                .reshape((b, 1, d))
                .map_err(err)?;
            let z: Vec<f32> = self
                .dr
                .conf_logits(&hk, e.as_ref())
                .map_err(err)?
                .flatten_all()
                .map_err(err)?
                .to_vec1()
                .map_err(err)?;

            for (bi, &i) in active.iter().enumerate() {
                if kk >= ks[bi] {
                    continue;
                }
                let r = &mut reqs[i];
                let row = (bi * kmax + kk) * v;
                let mut logits = base_all[row..row + v].to_vec();
                if let Some(bias) = &bias {
                    for (l, x) in logits.iter_mut().zip(&bias[bi * v..(bi + 1) * v]) {
                        *l += x;
                    }
                }
                conf[bi].push(sts.conf(kk, z[bi] as f64) as f32);
                let p = probs(&logits, &seen[bi], r.params);
                let (tok, dist) = if r.params.is_greedy() {
                    (argmax(&p), Dist::OneHot)
                } else {
                    (sample(&p, r.rng), Dist::Dense(p))
                };
                out[i].tokens.push(tok);
                out[i].dists.push(dist);
                seen[bi].push(tok);
                prev[bi] = tok;
            }
        }
        for (bi, &i) in active.iter().enumerate() {
            out[i].confidence = Some(std::mem::take(&mut conf[bi]));
        }
        Ok(out)
    }

    fn max_gamma(&self) -> Option<usize> {
        Some(self.dr.cfg.gamma)
    }

    fn finish(&mut self, id: u64) {
        self.feats.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_bit_markov_bias_matches_the_f32_product() {
        let (r, v, b) = (64usize, 300usize, 3usize);
        let mut rng = kernels::rng::Rng::new(2);
        let w2: Vec<f32> = (0..r * v).map(|_| rng.normal() as f32 * 0.1).collect();
        let e: Vec<f32> = (0..b * r).map(|_| rng.normal() as f32).collect();
        let mut t = vec![0f32; v * r];
        for i in 0..r {
            for j in 0..v {
                t[j * r + i] = w2[i * v + j];
            }
        }
        let q = quantize_q8(&t, v, r).expect("64 columns quantize");
        let mut got = vec![0f32; b * v];
        q.matmul(&e, b, &mut got, kernels::Isa::detect());
        let mut worst = 0f32;
        for bi in 0..b {
            for j in 0..v {
                let want: f32 = (0..r).map(|i| e[bi * r + i] * w2[i * v + j]).sum();
                worst = worst.max((got[bi * v + j] - want).abs());
            }
        }
        // 8-bit codes with a scale per 16 values: error ≈ ½·(max|w|/127)·Σ|e| ≪ the bias scale.
        assert!(worst < 0.05, "worst abs error {worst}");
        assert!(
            quantize_q8(&t[..v * 16], v, 16).is_none(),
            "needs 32-wide rows"
        );
    }
}
