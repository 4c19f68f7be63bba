//! The drafter's serving forward on the project's own kernels instead of candle.
//!
//! Training needs candle's autograd; serving does not, and candle's per-op cost (a fresh tensor
//! per op, dozens of ops per block) made one drafting call of this one-layer drafter cost about
//! as much as a target decode. Here the weights are 8-bit ([`QMatrix`], a scale per 16 values),
//! the loops are plain, and two things are cached per request:
//! - each committed position's fused context row (the fuse is row-wise), and
//! - per layer, that row's key and value before RoPE. The context window is re-indexed from 0
//!   at every call, so RoPE is applied at attention time; everything else about a context row
//!   is computed once, when the position is committed.
//!
//! A drafting call then costs the block's own rows: keys and values of the γ block positions,
//! and queries, attention output and MLP only for the positions that will be drafted (the last
//! layer's other rows feed nothing). `tests::matches_the_candle_forward` holds it to the
//! training forward.

use crate::model::DsparkDrafter;
use crate::{DrafterError, Result};
use half::f16;
use kernels::Isa;
use kernels::matmul::QMatrix;

/// Quantizes a row-major `rows × cols` matrix (cols a multiple of 32) to 8 bits.
///
/// Where the integer kernels run (AVX-512 VNNI or AVX2, rows a multiple of 16) it takes
/// GGUF's Q8_0 layout (one f16 scale per 32 values) interleaved by 16 rows, as the target's
/// own 8-bit weights do: the integer kernels multiply the codes directly. A drafting call multiplies one to a
/// few rows per request, where decoding each weight block to bf16 first (the other path) cost
/// more than reading it. Elsewhere: 8-bit blocks with one scale per 16 values.
pub(crate) fn quantize_q8(w: &[f32], rows: usize, cols: usize) -> Option<QMatrix> {
    use kernels::quant::BlockQ8;
    if cols % 32 != 0 || w.len() != rows * cols {
        return None;
    }
    if kernels::grouped::native(Isa::detect()) && rows % kernels::grouped::GROUP_ROWS == 0 {
        let mut raw = Vec::with_capacity(rows * cols / 32 * 34);
        for chunk in w.chunks_exact(32) {
            let amax = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = half::f16::from_f32(amax / 127.0);
            let df = d.to_f32();
            raw.extend_from_slice(&d.to_le_bytes());
            raw.extend(chunk.iter().map(|&x| {
                (if df > 0.0 {
                    (x / df).round().clamp(-127.0, 127.0)
                } else {
                    0.0
                }) as i8 as u8
            }));
        }
        let groups = kernels::grouped::repack_q80(&raw, rows, cols).ok()?;
        return QMatrix::new(rows, cols, kernels::matmul::QWeights::Q80(groups)).ok();
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
    QMatrix::new(rows, cols, kernels::matmul::QWeights::Q8(blocks)).ok()
}

/// Quantizes a row-major `rows × cols` matrix (cols a multiple of 32) to 4 bits: GGUF's Q4_1
/// (per 32 values an f16 scale and an f16 minimum, `w = d·q + m`, q in 0..16), grouped by 16
/// rows where the integer kernels run, else the same blocks with f32 scales. Codes are rounded
/// against the f16-rounded scale and minimum, the values the kernels decode with.
pub(crate) fn quantize_q4(w: &[f32], rows: usize, cols: usize) -> Option<QMatrix> {
    use kernels::quant::BlockQ4;
    if cols % 32 != 0 || w.len() != rows * cols {
        return None;
    }
    // (d, m, nibbles in GGML order) of one block, with d and m as the kernels will read them.
    let block = |chunk: &[f32]| -> (f16, f16, [u8; 16]) {
        let lo = chunk.iter().fold(f32::INFINITY, |a, &x| a.min(x));
        let hi = chunk.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        let d = f16::from_f32((hi - lo) / 15.0);
        let m = f16::from_f32(lo);
        let (df, mf) = (d.to_f32(), m.to_f32());
        let code = |x: f32| -> u8 {
            if df > 0.0 {
                ((x - mf) / df).round().clamp(0.0, 15.0) as u8
            } else {
                0
            }
        };
        let mut qs = [0u8; 16];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = code(chunk[i]) | (code(chunk[i + 16]) << 4);
        }
        (d, m, qs)
    };
    if kernels::grouped::native(Isa::detect()) && rows % kernels::grouped::GROUP_ROWS == 0 {
        let mut raw = Vec::with_capacity(rows * cols / 32 * 20);
        for chunk in w.chunks_exact(32) {
            let (d, m, qs) = block(chunk);
            raw.extend_from_slice(&d.to_le_bytes());
            raw.extend_from_slice(&m.to_le_bytes());
            raw.extend_from_slice(&qs);
        }
        let groups = kernels::grouped::repack_q41(&raw, rows, cols).ok()?;
        return QMatrix::new(rows, cols, kernels::matmul::QWeights::Q41(groups)).ok();
    }
    let blocks = w
        .chunks_exact(32)
        .map(|chunk| {
            let (d, m, qs) = block(chunk);
            BlockQ4 {
                d: d.to_f32(),
                m: m.to_f32(),
                qs,
            }
        })
        .collect();
    QMatrix::new(rows, cols, kernels::matmul::QWeights::Q4(blocks)).ok()
}

/// [`quantize_q8`] or [`quantize_q4`] by the drafter's `serve_bits`.
pub(crate) fn quantize_bits(w: &[f32], rows: usize, cols: usize, bits: u8) -> Option<QMatrix> {
    match bits {
        4 => quantize_q4(w, rows, cols),
        _ => quantize_q8(w, rows, cols),
    }
}

fn tensor_vec(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1()?)
}

fn quant(l: &candle_nn::Linear, bits: u8) -> Result<QMatrix> {
    let w = l.weight();
    let (rows, cols) = w.dims2()?;
    quantize_bits(&tensor_vec(w)?, rows, cols, bits).ok_or_else(|| {
        DrafterError::Invalid(format!(
            "a {rows}×{cols} weight does not fit {bits}-bit blocks"
        ))
    })
}

/// One drafter layer's quantized weights (`serve_bits`). Matrices that read the same input are
/// stacked (query, key and value; key and value; gate and up), so a call makes one pass over one
/// matrix instead of several small ones.
struct FastLayer {
    n1: Vec<f32>,
    wq: QMatrix,
    /// [wk; wv] (2d rows).
    wkv: QMatrix,
    /// [wq; wk; wv] (3d rows).
    wqkv: QMatrix,
    wo: QMatrix,
    n2: Vec<f32>,
    /// [gate; up] (2·ffn rows).
    gate_up: QMatrix,
    down: QMatrix,
}

fn stack(parts: &[&QMatrix]) -> Result<QMatrix> {
    QMatrix::concat_rows(parts)
        .ok_or_else(|| DrafterError::Invalid("drafter weights of mismatched shapes".into()))
}

/// Splits B rows of `a + b` values into the B rows of `a` values and the B rows of `b`.
fn split_rows(x: &[f32], a: usize, b: usize) -> (Vec<f32>, Vec<f32>) {
    let n = x.len() / (a + b);
    let (mut l, mut r) = (Vec::with_capacity(n * a), Vec::with_capacity(n * b));
    for row in x.chunks_exact(a + b) {
        l.extend_from_slice(&row[..a]);
        r.extend_from_slice(&row[a..]);
    }
    (l, r)
}

/// A context row's cached per-layer key (before RoPE) and value.
#[derive(Clone, Debug, Default)]
pub struct CtxRow {
    pub fused: Vec<f32>,
    /// Per layer: key (d) then value (d).
    pub kv: Vec<f32>,
}

pub struct FastDrafter {
    d: usize,
    n_heads: usize,
    ffn: usize,
    gamma: usize,
    context: usize,
    eps: f32,
    fuse: QMatrix,
    n_feats: usize,
    mask: Vec<f32>,
    layers: Vec<FastLayer>,
    out_norm: Vec<f32>,
    /// The first layer's query, key and value (before RoPE) of a mask position, whose input is
    /// the same constant row at every block position of every request (3·d).
    mask_qkv: Vec<f32>,
    /// RoPE tables, (context + γ) positions × head_dim/2.
    cos: Vec<f32>,
    sin: Vec<f32>,
    isa: Isa,
}

fn rms_norm_rows(x: &[f32], w: Option<&[f32]>, d: usize, eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        match w {
            Some(w) => out.extend(row.iter().zip(w).map(|(v, g)| v * inv * g)),
            None => out.extend(row.iter().map(|v| v * inv)),
        }
    }
    out
}

impl FastDrafter {
    /// The serving form of `dr` (8- or 4-bit weights, `serve_bits`). Fails when a width is not a
    /// multiple of 32.
    pub fn new(dr: &DsparkDrafter) -> Result<Self> {
        let cfg = &dr.cfg;
        let bits = cfg.serve_bits;
        let qw = |l: &candle_nn::Linear| quant(l, bits);
        let layers = dr
            .layers
            .iter()
            .map(|l| {
                let (wq, wk, wv) = (qw(&l.wq)?, qw(&l.wk)?, qw(&l.wv)?);
                Ok(FastLayer {
                    n1: tensor_vec(&l.n1)?,
                    wkv: stack(&[&wk, &wv])?,
                    wqkv: stack(&[&wq, &wk, &wv])?,
                    wq,
                    wo: qw(&l.wo)?,
                    n2: tensor_vec(&l.n2)?,
                    gate_up: stack(&[&qw(&l.gate)?, &qw(&l.up)?])?,
                    down: qw(&l.down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut fast = Self {
            d: cfg.d_model,
            n_heads: cfg.n_heads,
            ffn: cfg.ffn_dim,
            gamma: cfg.gamma,
            context: cfg.context,
            eps: cfg.rms_eps as f32,
            fuse: qw(&dr.fuse)?,
            n_feats: cfg.feature_layers.len(),
            mask: tensor_vec(&dr.mask)?,
            layers,
            out_norm: tensor_vec(&dr.out_norm)?,
            cos: tensor_vec(&dr.cos)?,
            sin: tensor_vec(&dr.sin)?,
            isa: Isa::detect(),
            mask_qkv: Vec::new(),
        };
        if let Some(l) = fast.layers.first() {
            let mn = rms_norm_rows(&fast.mask, Some(&l.n1), fast.d, fast.eps);
            fast.mask_qkv = fast.mm(&l.wqkv, &mn, 1);
        }
        Ok(fast)
    }

    fn mm(&self, w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * w.rows];
        w.matmul(x, m, &mut out, self.isa);
        out
    }

    /// Context rows of `n` positions from raw target feature rows (n × F·d): each layer's
    /// hidden state RMS-normalized, fused to d, and each drafter layer's key and value.
    pub fn context_rows(&self, raw: &[f32], n: usize) -> Vec<CtxRow> {
        let d = self.d;
        let normed = rms_norm_rows(&raw[..n * self.n_feats * d], None, d, self.eps);
        let fused = self.mm(&self.fuse, &normed, n);
        let mut rows: Vec<CtxRow> = fused
            .chunks_exact(d)
            .map(|f| CtxRow {
                fused: f.to_vec(),
                kv: Vec::with_capacity(2 * d * self.layers.len()),
            })
            .collect();
        for l in &self.layers {
            let cn = rms_norm_rows(&fused, Some(&l.n1), d, self.eps);
            // Each output row is this row's key then value: the cache's layout.
            let kv = self.mm(&l.wkv, &cn, n);
            for (r, kv) in rows.iter_mut().zip(kv.chunks_exact(2 * d)) {
                r.kv.extend_from_slice(kv);
            }
        }
        rows
    }

    /// RoPE (rotate-half form, as candle's `rope_slow`) of `rows` rows of d at positions
    /// `p0..`, per head.
    fn rope(&self, x: &mut [f32], p0: usize) {
        let hd = self.d / self.n_heads;
        let half = hd / 2;
        for (i, row) in x.chunks_exact_mut(self.d).enumerate() {
            let p = p0 + i;
            let (c, s) = (
                &self.cos[p * half..(p + 1) * half],
                &self.sin[p * half..(p + 1) * half],
            );
            for h in row.chunks_exact_mut(hd) {
                for j in 0..half {
                    let (a, b) = (h[j], h[j + half]);
                    h[j] = a * c[j] - b * s[j];
                    h[j + half] = b * c[j] + a * s[j];
                }
            }
        }
    }

    /// Drafter hidden states (after the final norm) of the first `kmax` block positions of one
    /// request: `ctx` its C context rows (oldest first), `anchor` the anchor token's embedding.
    pub fn hidden(&self, ctx: &[&CtxRow], anchor: &[f32], kmax: usize) -> Vec<f32> {
        self.hidden_batch(&[(ctx, anchor)], kmax)
    }

    /// [`Self::hidden`] for several requests at once (B × kmax × d, request-major): every
    /// matmul runs over all requests' rows, so a weight is read once per call, not once per
    /// request. In the first layer the mask positions' inputs are one constant row, so their
    /// query, key and value (before RoPE) come from [`Self::mask_qkv`], computed at load: that
    /// layer multiplies the anchors' rows only.
    pub fn hidden_batch(&self, reqs: &[(&[&CtxRow], &[f32])], kmax: usize) -> Vec<f32> {
        let (d, g) = (self.d, self.gamma);
        let nb = reqs.len();
        let hd = d / self.n_heads;
        let kmax = kmax.clamp(1, g);
        let scale = 1.0 / (hd as f32).sqrt();
        let n_layers = self.layers.len();
        // Block inputs, B × g rows.
        let mut x = Vec::with_capacity(nb * g * d);
        for (_, anchor) in reqs {
            x.extend_from_slice(anchor);
            for _ in 1..g {
                x.extend_from_slice(&self.mask);
            }
        }
        for (li, l) in self.layers.iter().enumerate() {
            // The last layer computes outputs only for the rows that are drafted; earlier
            // layers need every row (they are the next layer's keys and values).
            let rows = if li + 1 == n_layers { kmax } else { g };
            // Queries (rows per request) and block keys / values (g per request), pre-RoPE.
            let (mut q, kb, vb) = if li == 0 {
                let an: Vec<f32> = x
                    .chunks_exact(g * d)
                    .flat_map(|blk| rms_norm_rows(&blk[..d], Some(&l.n1), d, self.eps))
                    .collect();
                let qkv = self.mm(&l.wqkv, &an, nb);
                let (qa, kva) = split_rows(&qkv, d, 2 * d);
                let (ka, va) = split_rows(&kva, d, d);
                let (mq, mk, mv) = (
                    &self.mask_qkv[..d],
                    &self.mask_qkv[d..2 * d],
                    &self.mask_qkv[2 * d..],
                );
                let spread = |a: &[f32], m: &[f32], n: usize| -> Vec<f32> {
                    let mut out = Vec::with_capacity(nb * n * d);
                    for r in a.chunks_exact(d) {
                        out.extend_from_slice(r);
                        for _ in 1..n {
                            out.extend_from_slice(m);
                        }
                    }
                    out
                };
                (
                    spread(&qa, mq, rows),
                    spread(&ka, mk, g),
                    spread(&va, mv, g),
                )
            } else {
                let xn = rms_norm_rows(&x, Some(&l.n1), d, self.eps);
                let qin: Vec<f32> = xn
                    .chunks_exact(g * d)
                    .flat_map(|blk| blk[..rows * d].iter().copied())
                    .collect();
                let (k, v) = split_rows(&self.mm(&l.wkv, &xn, nb * g), d, d);
                (self.mm(&l.wq, &qin, nb * rows), k, v)
            };
            let mut o = vec![0f32; nb * rows * d];
            for (bi, (ctx, _)) in reqs.iter().enumerate() {
                let c = ctx.len();
                let qr = &mut q[bi * rows * d..(bi + 1) * rows * d];
                self.rope(qr, c);
                let mut keys = Vec::with_capacity((c + g) * d);
                let mut vals = Vec::with_capacity((c + g) * d);
                for r in ctx.iter() {
                    let kv = &r.kv[li * 2 * d..(li + 1) * 2 * d];
                    keys.extend_from_slice(&kv[..d]);
                    vals.extend_from_slice(&kv[d..]);
                }
                keys.extend_from_slice(&kb[bi * g * d..(bi + 1) * g * d]);
                vals.extend_from_slice(&vb[bi * g * d..(bi + 1) * g * d]);
                self.rope(&mut keys, 0);
                let ob = &mut o[bi * rows * d..(bi + 1) * rows * d];
                let mut sc = vec![0f32; c + g];
                for i in 0..rows {
                    for h in 0..self.n_heads {
                        let qh = &qr[i * d + h * hd..i * d + (h + 1) * hd];
                        let mut mx = f32::NEG_INFINITY;
                        for (j, s) in sc.iter_mut().enumerate() {
                            let kh = &keys[j * d + h * hd..j * d + (h + 1) * hd];
                            *s = qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale;
                            mx = mx.max(*s);
                        }
                        let mut sum = 0f32;
                        for s in sc.iter_mut() {
                            *s = (*s - mx).exp();
                            sum += *s;
                        }
                        let oh = &mut ob[i * d + h * hd..i * d + (h + 1) * hd];
                        for (j, s) in sc.iter().enumerate() {
                            let w = s / sum;
                            let vh = &vals[j * d + h * hd..j * d + (h + 1) * hd];
                            for (a, b) in oh.iter_mut().zip(vh) {
                                *a += w * b;
                            }
                        }
                    }
                }
            }
            let att = self.mm(&l.wo, &o, nb * rows);
            // Keep each request's first `rows` rows, add the attention output.
            let mut xr = Vec::with_capacity(nb * rows * d);
            for (blk, a) in x.chunks_exact(g * d).zip(att.chunks_exact(rows * d)) {
                xr.extend(blk[..rows * d].iter().zip(a).map(|(u, v)| u + v));
            }
            let xn = rms_norm_rows(&xr, Some(&l.n2), d, self.eps);
            let gu = self.mm(&l.gate_up, &xn, nb * rows);
            let f = self.ffn;
            let act: Vec<f32> = gu
                .chunks_exact(2 * f)
                .flat_map(|r| {
                    r[..f]
                        .iter()
                        .zip(&r[f..])
                        .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                })
                .collect();
            debug_assert_eq!(act.len(), nb * rows * self.ffn);
            let down = self.mm(&l.down, &act, nb * rows);
            for (a, b) in xr.iter_mut().zip(&down) {
                *a += b;
            }
            x = xr;
        }
        // x holds `rows` rows per request; the last layer had rows = kmax.
        rms_norm_rows(&x, Some(&self.out_norm), d, self.eps)
    }

    pub fn context(&self) -> usize {
        self.context
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The training (candle) forward's hidden states of B requests: `raw` B × C feature rows.
    fn candle_hidden(
        dr: &DsparkDrafter,
        raw: &[f32],
        b: usize,
        c: usize,
        toks: &[u32],
    ) -> Vec<f32> {
        let rl = raw.len() / (b * c);
        let feats = Tensor::from_vec(raw.to_vec(), (b, c, rl), &Device::Cpu).unwrap();
        let anchors = Tensor::from_vec(toks.to_vec(), b, &Device::Cpu).unwrap();
        dr.hidden(&feats, &anchors)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    }

    fn max_abs(a: &[f32]) -> f32 {
        a.iter().fold(0f32, |m, v| m.max(v.abs()))
    }

    #[test]
    fn matches_the_candle_forward() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        for bits in [8u8, 4] {
            let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
            dr.cfg.serve_bits = bits;
            let fast = FastDrafter::new(&dr).unwrap();
            if bits == 4 {
                // Hold the 4-bit path to the forward of the weights it serves: the candle
                // reference gets every matrix rounded to its 4-bit values. (How far 4-bit
                // values are from the weights is `four_bit_blocks_decode_within_half_a_step…`.)
                round_to_q4(&dr);
            }
            let d = m.cfg.d_model;
            let rl = 2 * d;
            let mut rng = kernels::rng::Rng::new(4);
            let raw: Vec<f32> = (0..6 * rl).map(|_| rng.normal() as f32 * 3.0).collect();
            let want = candle_hidden(&dr, &raw, 1, 6, &[9]);
            // Context rows one at a time (as a serving drafter fuses them), the block in one call.
            let rows: Vec<CtxRow> = raw
                .chunks_exact(rl)
                .flat_map(|r| fast.context_rows(r, 1))
                .collect();
            let refs: Vec<&CtxRow> = rows.iter().collect();
            let anchor: Vec<f32> = tensor_vec(&dr.embed.get(9).unwrap()).unwrap();
            let g = dr.cfg.gamma;
            for kmax in [1, 2, g] {
                let got = fast.hidden(&refs, &anchor, kmax);
                assert_eq!(got.len(), kmax * d);
                let scale = max_abs(&want);
                let worst = max_abs_diff(&got, &want[..kmax * d]);
                // 8-bit weights and bf16 activations: a few percent of the largest value.
                assert!(
                    worst < 0.05 * scale,
                    "{bits} bits, kmax {kmax}: worst {worst}, scale {scale}"
                );
            }
        }
    }

    /// Replaces every matrix of `dr` whose rows split into 32-value blocks by its 4-bit values.
    fn round_to_q4(dr: &DsparkDrafter) {
        for var in dr.varmap.all_vars() {
            let Ok((rows, cols)) = var.dims2() else {
                continue;
            };
            if cols % 32 != 0 {
                continue;
            }
            let w = tensor_vec(var.as_tensor()).unwrap();
            let q = quantize_q4(&w, rows, cols).unwrap();
            let mut out = vec![0f32; rows * cols];
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                q.dequantize_row(r, row);
            }
            let t = candle_core::Tensor::from_vec(out, (rows, cols), &candle_core::Device::Cpu)
                .unwrap();
            var.set(&t).unwrap();
        }
    }

    #[test]
    fn four_bit_blocks_decode_within_half_a_step_of_the_weights() {
        let mut rng = kernels::rng::Rng::new(5);
        // 32 rows (grouped where the integer kernels run), 96 columns; one constant block.
        let (rows, cols) = (32, 96);
        let mut w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() as f32).collect();
        w[..32].fill(0.25);
        let q = quantize_q4(&w, rows, cols).unwrap();
        assert!(q.bytes() < rows * cols * 3 / 4, "{} bytes", q.bytes());
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            q.dequantize_row(r, &mut row);
            for (b, (got, want)) in row
                .chunks_exact(32)
                .zip(w[r * cols..(r + 1) * cols].chunks_exact(32))
                .enumerate()
            {
                let lo = want.iter().fold(f32::INFINITY, |a, &x| a.min(x));
                let hi = want.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                // Half a step, plus the f16 rounding of the scale (over 15 steps) and minimum.
                let bound = (hi - lo) / 30.0 * 1.01 + (hi - lo) * 15.0 / 2048.0 + lo.abs() / 2048.0;
                for (g, x) in got.iter().zip(want) {
                    assert!(
                        (g - x).abs() <= bound + 1e-6,
                        "row {r} block {b}: {g} for {x} (bound {bound})"
                    );
                }
            }
        }
        // The matmul reads the same values: it equals the f32 product of the decoded rows.
        let x: Vec<f32> = (0..2 * cols).map(|_| rng.normal() as f32).collect();
        let mut got = vec![0f32; 2 * rows];
        q.matmul(&x, 2, &mut got, Isa::detect());
        for t in 0..2 {
            for r in 0..rows {
                q.dequantize_row(r, &mut row);
                let want: f32 = row
                    .iter()
                    .zip(&x[t * cols..(t + 1) * cols])
                    .map(|(a, b)| a * b)
                    .sum();
                let g = got[t * rows + r];
                assert!(
                    (g - want).abs() < 0.02 * (1.0 + want.abs()),
                    "{g} against {want}"
                );
            }
        }
        assert!(
            quantize_q4(&w[..31 * 3], 1, 93).is_none(),
            "cols not a multiple of 32"
        );
    }

    #[test]
    fn a_batch_of_requests_matches_the_candle_forward_of_each() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        for n_layers in [1, 2] {
            // Two layers exercise the path where later layers see every block row.
            let (e, h) = crate::model::target_tensors(&m).unwrap();
            let mut cfg =
                crate::model::DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, n_layers, 16);
            cfg.feature_layers = vec![0, 1];
            cfg.context = 5;
            let dr = DsparkDrafter::new(cfg, e, h, 7).unwrap();
            let fast = FastDrafter::new(&dr).unwrap();
            let d = m.cfg.d_model;
            let rl = 2 * d;
            let mut rng = kernels::rng::Rng::new(11);
            let raw: Vec<f32> = (0..2 * 5 * rl).map(|_| rng.normal() as f32 * 3.0).collect();
            let toks = [9u32, 4];
            let want = candle_hidden(&dr, &raw, 2, 5, &toks);
            let rows: Vec<Vec<CtxRow>> = raw
                .chunks_exact(5 * rl)
                .map(|r| fast.context_rows(r, 5))
                .collect();
            let refs: Vec<Vec<&CtxRow>> = rows.iter().map(|r| r.iter().collect()).collect();
            let embs: Vec<Vec<f32>> = toks
                .iter()
                .map(|&t| tensor_vec(&dr.embed.get(t as usize).unwrap()).unwrap())
                .collect();
            let g = dr.cfg.gamma;
            for kmax in [1, g] {
                let reqs: Vec<(&[&CtxRow], &[f32])> = refs
                    .iter()
                    .zip(&embs)
                    .map(|(r, e)| (r.as_slice(), e.as_slice()))
                    .collect();
                let got = fast.hidden_batch(&reqs, kmax);
                assert_eq!(got.len(), 2 * kmax * d);
                for b in 0..2 {
                    let w = &want[b * g * d..(b * g + kmax) * d];
                    let o = &got[b * kmax * d..(b + 1) * kmax * d];
                    let scale = max_abs(w);
                    let worst = max_abs_diff(o, w);
                    assert!(
                        worst < 0.05 * scale,
                        "layers {n_layers}, kmax {kmax}, request {b}: worst {worst}, scale {scale}"
                    );
                    // The batch changes nothing about a request's rows.
                    let alone = fast.hidden(&refs[b], &embs[b], kmax);
                    let diff = max_abs_diff(&alone, o);
                    assert!(diff <= 1e-5 * scale.max(1.0), "batch vs alone: {diff}");
                }
            }
        }
    }
}
