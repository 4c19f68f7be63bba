//! f32 vector ops for the runtime's non-matmul work (attention, norms, activations, RoPE).
//!
//! Dot and axpy carry attention, so they get AVX2+FMA builds of the same generic body
//! (`#[target_feature]` wrappers let LLVM vectorize it with wide registers); the rest are O(d)
//! per token and stay portable.

use crate::Isa;

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 16];
    let chunks = n / 16;
    for c in 0..chunks {
        let (ca, cb) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for j in 0..16 {
            acc[j] = ca[j].mul_add(cb[j], acc[j]);
        }
    }
    let mut s = 0f32;
    for i in chunks * 16..n {
        s += a[i] * b[i];
    }
    acc.iter().sum::<f32>() + s
}

#[inline(always)]
fn axpy_body(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body(alpha, x, y)
}

/// `Σ a[i]·b[i]` over the shorter length.
#[inline]
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe { dot_avx2(a, b) },
        _ => dot_body(a, b),
    }
}

/// `y += alpha·x`.
#[inline]
pub fn axpy(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe { axpy_avx2(alpha, x, y) },
        _ => axpy_body(alpha, x, y),
    }
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// SwiGLU on a fused `[gate | up]` row: `out[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate_up: &[f32], out: &mut [f32]) {
    let f = out.len();
    let (g, u) = gate_up.split_at(f);
    for i in 0..f {
        let gi = g[i];
        out[i] = gi / (1.0 + (-gi).exp()) * u[i];
    }
}

/// In-place softmax; returns nothing, leaves a probability vector.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Precomputed RoPE cos/sin table for `max_pos` positions.
#[derive(Clone, Debug)]
pub struct Rope {
    pub head_dim: usize,
    /// `true`: rotate adjacent pairs (GGUF llama, whose q/k rows are permuted at conversion);
    /// `false`: rotate halves (NeoX / Hugging Face layout, and qwen2 everywhere).
    pub interleaved: bool,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, max_pos: usize, interleaved: bool) -> Self {
        let half = head_dim / 2;
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        for p in 0..max_pos {
            for i in 0..half {
                let inv = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
                let a = p as f64 * inv;
                cos[p * half + i] = a.cos() as f32;
                sin[p * half + i] = a.sin() as f32;
            }
        }
        Self {
            head_dim,
            interleaved,
            cos,
            sin,
        }
    }

    pub fn max_pos(&self) -> usize {
        self.cos.len() / (self.head_dim / 2)
    }

    /// Rotates every head in `x` (n_heads × head_dim) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.head_dim / 2;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for h in x.chunks_exact_mut(self.head_dim) {
            for i in 0..half {
                let (a, b) = if self.interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x0, x1) = (h[a], h[b]);
                h[a] = x0 * cos[i] - x1 * sin[i];
                h[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn dot_and_axpy_match_naive_on_every_isa() {
        let mut rng = Rng::new(5);
        for n in [1usize, 7, 16, 64, 100] {
            let a: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            for isa in Isa::available() {
                assert!((dot(isa, &a, &b) - want).abs() < 1e-4);
                let mut y = b.clone();
                axpy(isa, 0.5, &a, &mut y);
                for i in 0..n {
                    assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn softmax_sums_to_one_and_rope_preserves_norm() {
        let mut x = vec![1.0, 2.0, 3.0, -1000.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[3] == 0.0);
        for inter in [true, false] {
            let rope = Rope::new(8, 10000.0, 16, inter);
            let mut h: Vec<f32> = (0..16).map(|i| i as f32).collect();
            let n0: f32 = h.iter().map(|v| v * v).sum();
            rope.apply(&mut h, 5);
            let n1: f32 = h.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-2);
            let mut z: Vec<f32> = (0..16).map(|i| i as f32).collect();
            rope.apply(&mut z, 0);
            assert_eq!(z, (0..16).map(|i| i as f32).collect::<Vec<_>>());
        }
    }
}
