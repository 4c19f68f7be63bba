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
    /// Per request: feature rows of committed positions 0..n (row = layers side by side).
    feats: HashMap<u64, Vec<f32>>,
    label: String,
    /// The target model, whose quantized LM head (the drafter's frozen head) gives the base
    /// logits faster than the f32 copy.
    target: Option<std::sync::Arc<dspark_runtime::Model>>,
}

fn err(e: impl std::fmt::Display) -> SpecError {
    SpecError::Invariant(format!("dspark drafter: {e}"))
}

impl DsparkProposer {
    pub fn new(dr: DsparkDrafter, label: &str) -> Self {
        Self {
            dr,
            feats: HashMap::new(),
            label: label.to_string(),
            target: None,
        }
    }

    /// Computes base logits with the target's own head kernels.
    pub fn with_target_head(mut self, target: std::sync::Arc<dspark_runtime::Model>) -> Self {
        self.target = Some(target);
        self
    }

    /// Base logits (B·γ rows of V) and hidden states (B × γ × d) of one block forward.
    fn block(&self, ft: &Tensor, at: &Tensor) -> specdec::Result<(Vec<f32>, Tensor)> {
        match &self.target {
            Some(m) => {
                let h = self.dr.hidden(ft, at).map_err(err)?;
                let (b, g, _) = h.dims3().map_err(err)?;
                let rows: Vec<f32> = h.flatten_all().map_err(err)?.to_vec1().map_err(err)?;
                let base = m.head_logits(&rows, b * g).map_err(err)?;
                Ok((base, h))
            }
            None => {
                let o = self.dr.block(ft, at).map_err(err)?;
                let base = o.base.flatten_all().map_err(err)?.to_vec1().map_err(err)?;
                Ok((base, o.h))
            }
        }
    }

    fn row_len(&self) -> usize {
        self.dr.cfg.feature_layers.len() * self.dr.cfg.d_model
    }

    /// Context window (C rows, zero-padded at the front when the request is shorter).
    fn window(&self, id: u64) -> Vec<f32> {
        let (c, rl) = (self.dr.cfg.context, self.row_len());
        let mut w = vec![0f32; c * rl];
        if let Some(f) = self.feats.get(&id) {
            let n = f.len() / rl;
            let take = n.min(c);
            w[(c - take) * rl..].copy_from_slice(&f[(n - take) * rl..]);
        }
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
        let rl = self.row_len();
        let f = self.feats.entry(id).or_default();
        // Positions past `start` were rolled back; a gap (never expected) is zero-filled.
        f.resize(start * rl, 0.0);
        f.extend_from_slice(rows);
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
        let (c, rl, g) = (self.dr.cfg.context, self.row_len(), self.dr.cfg.gamma);
        let mut feats = Vec::with_capacity(active.len() * c * rl);
        let mut anchors = Vec::with_capacity(active.len());
        for &i in &active {
            feats.extend(self.window(reqs[i].id));
            anchors.push(*reqs[i].context.last().unwrap_or(&0));
        }
        let b = active.len();
        let ft = Tensor::from_vec(feats, (b, c, rl), &Device::Cpu).map_err(err)?;
        let at = Tensor::from_vec(anchors.clone(), b, &Device::Cpu).map_err(err)?;
        let (base_all, h_all) = self.block(&ft, &at)?;
        let v = self.dr.cfg.vocab;
        let d = self.dr.cfg.d_model;
        // Positions outside, requests inside: the Markov bias of every request's previous token
        // at position k is one (B × r)·(r × V) product, reading W2 once per position instead of
        // once per request and position.
        let ks: Vec<usize> = active.iter().map(|&i| reqs[i].k.min(g)).collect();
        let kmax = ks.iter().copied().max().unwrap_or(0);
        let mut prev = anchors;
        let mut seen: Vec<Vec<u32>> = active.iter().map(|&i| reqs[i].context.to_vec()).collect();
        let mut conf: Vec<Vec<f32>> = ks.iter().map(|&k| Vec::with_capacity(k)).collect();
        for kk in 0..kmax {
            let pt = Tensor::from_vec(prev.clone(), (b, 1), &Device::Cpu).map_err(err)?;
            let mk = self.dr.markov(&pt).map_err(err)?;
            let bias: Option<Vec<f32>> = match &mk {
                Some((bias, _)) => Some(bias.flatten_all().map_err(err)?.to_vec1().map_err(err)?),
                None => None,
            };
            let hk = h_all
                .narrow(1, kk, 1)
                .map_err(err)?
                .reshape((b, 1, d))
                .map_err(err)?;
            let z: Vec<f32> = self
                .dr
                .conf_logits(&hk, mk.as_ref().map(|m| &m.1))
                .map_err(err)?
                .flatten_all()
                .map_err(err)?
                .to_vec1()
                .map_err(err)?;
            let t = self.dr.cfg.sts.get(kk).copied().unwrap_or(1.0).max(1e-3);
            for (bi, &i) in active.iter().enumerate() {
                if kk >= ks[bi] {
                    continue;
                }
                let r = &mut reqs[i];
                let row = (bi * g + kk) * v;
                let mut logits = base_all[row..row + v].to_vec();
                if let Some(bias) = &bias {
                    for (l, x) in logits.iter_mut().zip(&bias[bi * v..(bi + 1) * v]) {
                        *l += x;
                    }
                }
                conf[bi].push(1.0 / (1.0 + (-z[bi] / t).exp()));
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
