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
    /// Per request: the target's feature rows of committed positions, and the fused rows of
    /// the recent ones.
    feats: HashMap<u64, ReqFeats>,
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

/// A request's context. Fusing is row-wise, so a position is fused once, the first time a block
/// is drafted with it in the window, and kept: drafting every step fuses one or two new rows,
/// and an engine that stops drafting (the scheduler at K = 0) pays nothing per step but a copy.
#[derive(Default)]
struct ReqFeats {
    /// Feature rows (F·d each) of committed positions 0..n.
    raw: Vec<f32>,
    /// Fused rows (d each) of positions `f0 ..`.
    fused: Vec<f32>,
    f0: usize,
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

    /// Fuses, for each request in `ids`, the rows of its context window not fused yet (one
    /// batched fuse for all of them) and drops fused rows that left the window.
    fn fuse_windows(&mut self, ids: &[u64]) -> specdec::Result<()> {
        let (c, d, rl) = (self.dr.cfg.context, self.dr.cfg.d_model, self.row_len());
        let mut todo: Vec<(u64, usize, usize)> = Vec::new(); // (id, first row, rows)
        let mut rows: Vec<f32> = Vec::new();
        for &id in ids {
            let Some(f) = self.feats.get_mut(&id) else {
                continue;
            };
            let n = f.raw.len() / rl;
            let lo = n.saturating_sub(c);
            let have = f.fused.len() / d;
            if f.f0 > lo || f.f0 + have < lo {
                f.fused.clear();
                f.f0 = lo;
            } else if f.f0 < lo {
                f.fused.drain(..(lo - f.f0) * d);
                f.f0 = lo;
            }
            let from = f.f0 + f.fused.len() / d;
            if from < n {
                rows.extend_from_slice(&f.raw[from * rl..n * rl]);
                todo.push((id, from, n - from));
            }
        }
        if todo.is_empty() {
            return Ok(());
        }
        let total = rows.len() / rl;
        let t = Tensor::from_vec(rows, (1, total, rl), &Device::Cpu).map_err(err)?;
        let fused: Vec<f32> = self
            .dr
            .fuse_context(&t)
            .map_err(err)?
            .flatten_all()
            .map_err(err)?
            .to_vec1()
            .map_err(err)?;
        let mut at = 0;
        for (id, _, n) in todo {
            if let Some(f) = self.feats.get_mut(&id) {
                f.fused.extend_from_slice(&fused[at * d..(at + n) * d]);
            }
            at += n;
        }
        Ok(())
    }

    /// Fused context window (C rows of d, padded at the front, with the fused zero row, when
    /// the request is shorter). [`Self::fuse_windows`] must have run for `id`.
    fn window(&self, id: u64) -> Vec<f32> {
        let (c, d) = (self.dr.cfg.context, self.dr.cfg.d_model);
        let mut w = Vec::with_capacity(c * d);
        let f = self
            .feats
            .get(&id)
            .map(|f| f.fused.as_slice())
            .unwrap_or(&[]);
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
        let f = self.feats.entry(id).or_default();
        // Positions past `start` were rolled back; a gap (never expected) is zero-filled (the
        // fused zero row is the pad).
        f.raw.resize(start * rl, 0.0);
        f.raw.extend_from_slice(rows);
        let keep = start.saturating_sub(f.f0);
        if f.fused.len() > keep * d {
            f.fused.truncate(keep * d);
        }
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
        let ids: Vec<u64> = active.iter().map(|&i| reqs[i].id).collect();
        self.fuse_windows(&ids)?;
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
    fn the_fused_window_follows_commits_and_rollbacks() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        let dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let rl = 2 * m.cfg.d_model;
        let mut p = DsparkProposer::new(dr, "t");
        let mut rng = kernels::rng::Rng::new(9);
        let mut row = || -> Vec<f32> { (0..rl).map(|_| rng.normal() as f32 * 2.0).collect() };
        // What the window must be: the last C raw rows (zero rows in front), fused in one go.
        let expect = |p: &DsparkProposer, raw: &[f32]| -> Vec<f32> {
            let c = p.dr.cfg.context;
            let n = raw.len() / rl;
            let mut w = vec![0f32; c * rl];
            let take = n.min(c);
            w[(c - take) * rl..].copy_from_slice(&raw[(n - take) * rl..]);
            let t = Tensor::from_vec(w, (1, c, rl), &Device::Cpu).unwrap();
            p.dr.fuse_context(&t)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let mut raw: Vec<f32> = Vec::new();
        // (rows committed from `start`, how many) — appends, a rollback into the fused part, a
        // window that slides past old fused rows, a long stretch without drafting.
        let plan: [(Option<usize>, usize, bool); 7] = [
            (None, 3, true),
            (None, 1, true),
            (Some(2), 2, true),
            (None, 5, true),
            (Some(7), 1, false),
            (None, 9, false),
            (Some(12), 2, true),
        ];
        for (step, &(start, n, draft)) in plan.iter().enumerate() {
            let start = start.unwrap_or(raw.len() / rl);
            raw.truncate(start * rl);
            let rows: Vec<f32> = (0..n).flat_map(|_| row()).collect();
            raw.extend_from_slice(&rows);
            p.observe(1, start, &rows).unwrap();
            if draft {
                p.fuse_windows(&[1]).unwrap();
                let got = p.window(1);
                let want = expect(&p, &raw);
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert_eq!(got.len(), want.len());
                assert!(worst < 1e-4, "step {step}: worst {worst}");
                let f = &p.feats[&1];
                assert!(
                    f.fused.len() / m.cfg.d_model <= 6,
                    "fused rows stay within the window"
                );
            }
        }
    }

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
