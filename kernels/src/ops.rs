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
    match isa.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni | Isa::Avx512 | Isa::Avx512Bf16 => unsafe { dot_avx2(a, b) },
        _ => dot_body(a, b),
    }
}

/// `y += alpha·x`.
#[inline]
pub fn axpy(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    match isa.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni | Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            axpy_avx2(alpha, x, y)
        },
        _ => axpy_body(alpha, x, y),
    }
}

/// One attention task: `R` query rows (`q`, R × hd) that share one KV head `g`, each attending
/// causally to its first `lims[r]` positions of a paged cache.
///
/// Layout (see the runtime's `KvCache`): the K pool stores each block of `bs` positions
/// transposed per head, `[block][head][dim][bs]`, so the scores of a whole block are `hd` vector
/// FMAs of a broadcast query element against a contiguous row — no horizontal sums. The V pool is
/// `[block][bs][kv_heads·hd]`. Grouping every query of a sequence and KV head (GQA heads ×
/// verified tokens) reads each cached block once per task.
#[allow(clippy::too_many_arguments)]
pub fn attend<KE: KvElem, VE: KvElem>(
    isa: Isa,
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_lse(isa, a, scores, out, &mut [])
}

/// [`attend`], and per query row the log of its softmax's denominator, `m + ln Σ exp(s − m)`
/// over its scores `s` (`lse`, one per row; nothing is recorded when it is empty). Attention
/// over positions split into parts is each part's output weighted by `exp(lse − max lse)`:
/// a long context split over threads (one request has fewer KV heads than a CPU has cores).
/// A row with no positions reads −∞. The outputs' bits are [`attend`]'s.
pub fn attend_lse<KE: KvElem, VE: KvElem>(
    isa: Isa,
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    assert!(
        lse.is_empty() || lse.len() >= a.lims.len(),
        "lse holds {} rows of {}",
        lse.len(),
        a.lims.len()
    );
    match isa.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { attend_avx512(a, scores, out, lse) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni => unsafe { attend_avx2(a, scores, out, lse) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::NeonDot => unsafe { attend_neon(a, scores, out, lse) },
        _ => attend_body(a, scores, out, lse),
    }
}

/// The SIMD attention kernels' arithmetic in portable code (one multiply-add rounding per
/// lane step, as theirs): every SIMD path gives these bits for the shapes they take (tested),
/// so x86 and Arm compute the same attention. `false` when the shape is not one they take.
pub fn attend_mirror<KE: KvElem, VE: KvElem>(
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lse: &mut [f32],
) -> bool {
    // SAFETY: the portable lanes use no instructions beyond the baseline; `run` checks every
    // index against the pools before forming a pointer.
    unsafe { attend_simd::run::<attend_simd::Mirror, KE, VE>(a, scores, out, lse) }
}

/// [`attend_mirror`] with the AVX-512 kernel's pass shape (12 rows, values in column halves).
#[cfg(test)]
fn attend_mirror_wide<KE: KvElem, VE: KvElem>(
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) -> bool {
    // SAFETY: as `attend_mirror`.
    unsafe { attend_simd::run::<attend_simd::MirrorWide, KE, VE>(a, scores, out, &mut []) }
}

/// An element of the KV cache. f16 halves the bytes a decode streams through attention, which
/// at long contexts is most of them (SmolLM2 at ctx 2048: 94 MB of f32 K/V against 96 MB of
/// weights per token); f32 is kept for the f32 reference forward.
///
/// `i8` is an 8-bit code: the element is the code times the scale [`AttendArgs::kscale`] or
/// [`AttendArgs::vscale`] carries.
///
/// # Safety
/// `HALF` is true exactly for IEEE binary16 (the x86 kernel loads such elements with
/// `vcvtph2ps`) and `I8` exactly for `i8` (loaded with a sign extension); both are false
/// exactly for `f32`.
pub unsafe trait KvElem: Copy + Send + Sync + 'static {
    const HALF: bool;
    const I8: bool = false;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// [`KvElem::from_f32`] of every element (the cache writes rows of them).
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(x);
        }
    }
}

// SAFETY: f32 is f32.
unsafe impl KvElem for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

// SAFETY: half::f16 is IEEE binary16.
unsafe impl KvElem for half::f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    /// Eight at a time with F16C where the CPU has it (`half` checks at run time); the same
    /// rounding (to nearest even) as one by one. One by one, a call each, the cache writes of
    /// a 32-token step took 1.4 ms of its 45.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        let n = src.len().min(dst.len());
        dst[..n].convert_from_f32_slice(&src[..n]);
    }
}

// SAFETY: i8 is i8.
unsafe impl KvElem for i8 {
    const HALF: bool = false;
    const I8: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    /// The code nearest `x` (ties to even), saturated to ±127; NaN gives 0. Adding and
    /// taking away 1.5·2²³ rounds in one instruction each, where `f32::round` is a libm call
    /// on baseline x86-64, which made a cache write of 32 tokens cost milliseconds.
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        const MAGIC: f32 = 12_582_912.0;
        ((x.clamp(-127.0, 127.0) + MAGIC) - MAGIC) as i8
    }
}

/// Inputs of [`attend`]. Keys (`KE`) and values (`VE`) are f32, f16 or 8-bit codes.
pub struct AttendArgs<'a, KE: KvElem = f32, VE: KvElem = KE> {
    pub q: &'a [f32],
    pub lims: &'a [usize],
    pub kpool: &'a [KE],
    pub vpool: &'a [VE],
    /// With `i8` keys, the scale of each position's key row per head (the key is its code
    /// times it), `[block][head][position in block]`; empty otherwise. A score is the query's
    /// dot product with the codes, times `scale`, times this.
    pub kscale: &'a [f32],
    /// With `i8` values, the scale of each position's value row per head (the value is its
    /// code times it), `[block][head][position in block]`; empty otherwise.
    pub vscale: &'a [f32],
    /// The sequence's block table.
    pub blocks: &'a [u32],
    pub bs: usize,
    pub n_kv: usize,
    pub g: usize,
    pub hd: usize,
    pub scale: f32,
}

/// The portable attention.
#[inline(always)]
fn attend_body<KE: KvElem, VE: KvElem>(
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let r_n = a.lims.len();
    let l = a.lims.iter().copied().max().unwrap_or(0);
    let (hd, bs) = (a.hd, a.bs);
    let kvd = a.n_kv * hd;
    let nb = l.div_ceil(bs);
    let lp = nb * bs;
    scores.clear();
    scores.resize(r_n * lp, 0.0);
    let mut acc = vec![0f32; bs];
    for (bi, &blk) in a.blocks[..nb].iter().enumerate() {
        let kt = &a.kpool[(blk as usize * a.n_kv + a.g) * hd * bs..][..hd * bs];
        for r in 0..r_n {
            if bi * bs >= a.lims[r] {
                continue;
            }
            let q = &a.q[r * hd..(r + 1) * hd];
            let dst = &mut scores[r * lp + bi * bs..r * lp + (bi + 1) * bs];
            if bs == 16 {
                // Fixed-width accumulator: stays in one vector register.
                block_scores::<16, KE>(q, kt, a.scale, dst);
            } else {
                acc.fill(0.0);
                for (d, &qd) in q.iter().enumerate() {
                    for (x, k) in acc.iter_mut().zip(&kt[d * bs..(d + 1) * bs]) {
                        *x = qd.mul_add(k.to_f32(), *x);
                    }
                }
                for (s, x) in dst.iter_mut().zip(&acc) {
                    *s = x * a.scale;
                }
            }
        }
    }
    if KE::I8 {
        for r in 0..r_n {
            for (p, x) in scores[r * lp..r * lp + a.lims[r]].iter_mut().enumerate() {
                *x *= key_scale(a, p);
            }
        }
    }
    for r in 0..r_n {
        let l = softmax_body_lse(&mut scores[r * lp..r * lp + a.lims[r]]);
        if let Some(x) = lse.get_mut(r) {
            *x = l;
        }
    }
    out[..r_n * hd].fill(0.0);
    for r in 0..r_n {
        let w = &scores[r * lp..r * lp + a.lims[r]];
        let o = &mut out[r * hd..(r + 1) * hd];
        match hd {
            64 => weighted_values::<64, KE, VE>(w, a, kvd, o),
            128 => weighted_values::<128, KE, VE>(w, a, kvd, o),
            _ => {
                for (p, &wp) in w.iter().enumerate() {
                    let slot = a.blocks[p / bs] as usize * bs + p % bs;
                    let v = &a.vpool[slot * kvd + a.g * hd..][..hd];
                    let wp = wp * value_scale(a, p);
                    for (oi, vi) in o.iter_mut().zip(v) {
                        *oi = wp.mul_add(vi.to_f32(), *oi);
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn block_scores<const BS: usize, E: KvElem>(q: &[f32], kt: &[E], scale: f32, dst: &mut [f32]) {
    // Four partial sums break the FMA latency chain over the head dimension.
    let mut acc = [[0f32; BS]; 4];
    let hd4 = q.len() / 4 * 4;
    for d in (0..hd4).step_by(4) {
        for (u, a) in acc.iter_mut().enumerate() {
            let qd = q[d + u];
            let row: [f32; BS] = std::array::from_fn(|j| kt[(d + u) * BS + j].to_f32());
            for j in 0..BS {
                a[j] = qd.mul_add(row[j], a[j]);
            }
        }
    }
    for d in hd4..q.len() {
        let row: [f32; BS] = std::array::from_fn(|j| kt[d * BS + j].to_f32());
        for j in 0..BS {
            acc[0][j] = q[d].mul_add(row[j], acc[0][j]);
        }
    }
    for j in 0..BS {
        dst[j] = ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j])) * scale;
    }
}

/// The scale of position `p`'s key row (8-bit keys only).
#[inline(always)]
fn key_scale<KE: KvElem, VE: KvElem>(a: &AttendArgs<'_, KE, VE>, p: usize) -> f32 {
    a.kscale[(a.blocks[p / a.bs] as usize * a.n_kv + a.g) * a.bs + p % a.bs]
}

/// The scale of position `p`'s value row (1 for float values).
#[inline(always)]
fn value_scale<KE: KvElem, VE: KvElem>(a: &AttendArgs<'_, KE, VE>, p: usize) -> f32 {
    if VE::I8 {
        a.vscale[(a.blocks[p / a.bs] as usize * a.n_kv + a.g) * a.bs + p % a.bs]
    } else {
        1.0
    }
}

/// `out = Σ_p w[p] · V[p]` for one query row, accumulators in registers (two chains).
#[inline(always)]
fn weighted_values<const HD: usize, KE: KvElem, VE: KvElem>(
    w: &[f32],
    a: &AttendArgs<'_, KE, VE>,
    kvd: usize,
    out: &mut [f32],
) {
    let mut a0 = [0f32; HD];
    let mut a1 = [0f32; HD];
    let row = |p: usize| -> [f32; HD] {
        let slot = a.blocks[p / a.bs] as usize * a.bs + p % a.bs;
        let v = &a.vpool[slot * kvd + a.g * HD..][..HD];
        std::array::from_fn(|i| v[i].to_f32())
    };
    let n2 = w.len() / 2 * 2;
    for p in (0..n2).step_by(2) {
        let (v0, v1) = (row(p), row(p + 1));
        let (w0, w1) = (w[p] * value_scale(a, p), w[p + 1] * value_scale(a, p + 1));
        for i in 0..HD {
            a0[i] = w0.mul_add(v0[i], a0[i]);
            a1[i] = w1.mul_add(v1[i], a1[i]);
        }
    }
    if n2 < w.len() {
        let v0 = row(n2);
        let w0 = w[n2] * value_scale(a, n2);
        for i in 0..HD {
            a0[i] = w0.mul_add(v0[i], a0[i]);
        }
    }
    for i in 0..HD {
        out[i] = a0[i] + a1[i];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_avx512<KE: KvElem, VE: KvElem>(
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    // SAFETY (for the calls below): AVX-512F is enabled on this function; the shapes are
    // checked by `attend_simd::run` before any pointer is formed.
    if !unsafe { attend_simd::run::<attend_simd::Zmm, KE, VE>(a, scores, out, lse) } {
        attend_body(a, scores, out, lse)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2<KE: KvElem, VE: KvElem>(
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    // SAFETY: AVX2, FMA and F16C are enabled on this function (`Isa::Avx2` and
    // `Isa::Avx2Vnni` checked them); shapes as above.
    if !unsafe { attend_simd::run::<attend_simd::Ymm2, KE, VE>(a, scores, out, lse) } {
        attend_body(a, scores, out, lse)
    }
}

#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn attend_neon<KE: KvElem, VE: KvElem>(
    a: &AttendArgs<'_, KE, VE>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    // SAFETY: NEON is enabled on this function (every aarch64 CPU has it); shapes as above.
    if !unsafe { attend_simd::run::<attend_simd::Neon4, KE, VE>(a, scores, out, lse) } {
        attend_body(a, scores, out, lse)
    }
}

/// SIMD attention for the common shape (blocks of 16 keys, head_dim 64 or 128), on 16 f32
/// lanes: one zmm on AVX-512, two ymm on AVX2, four NEON registers on Arm, plain arrays in the
/// portable mirror. Rows go in groups (four for scores, four or two for values; two and one on
/// AVX2 and NEON, whose registers hold less) so each K and V row loaded from the cache feeds
/// several query rows; the portable body reloads them per row and, written generically, the
/// compiler does not vectorize across rows. Per row the arithmetic is the same whatever the
/// grouping and the register width — the same fused multiply-adds in the same order per lane,
/// and weights exactly zero past a row's own limit — so a verification's rows equal the same
/// tokens decoded one by one, and every ISA gives the same bits.
#[allow(unsafe_op_in_unsafe_fn)]
mod attend_simd {
    use super::{AttendArgs, KvElem, fast_exp};
    #[cfg(target_arch = "aarch64")]
    use std::arch::aarch64::*;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::*;

    const BS: usize = 16;

    /// 16 f32 lanes. Callers enable the target features of the implementation they use
    /// (AVX-512F for [`Zmm`]; AVX2, FMA and F16C for [`Ymm2`]; NEON for [`Neon4`]).
    pub(super) trait Lanes: Copy {
        /// Most query rows one pass of scores keeps in registers (two accumulators a row).
        const ROWS: usize;
        /// 16-lane vectors of a value row one pass accumulates (2 or 4: a quarter or a half of
        /// head_dim 128, a half or all of 64).
        const VALUE_COLS: usize;
        /// Most query rows one pass of values keeps in registers (`VALUE_COLS` vectors a row).
        const VALUE_ROWS: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(x: f32) -> Self;
        /// 16 consecutive cache elements as f32 lanes.
        unsafe fn load<E: KvElem>(p: *const E) -> Self;
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
        unsafe fn add(a: Self, b: Self) -> Self;
        unsafe fn mul(a: Self, b: Self) -> Self;
        unsafe fn store(self, p: *mut f32);
        /// Asks for the cache lines of `bytes` bytes from `p` ahead of use (a hint: `p` is
        /// never read, and may point anywhere). The next cache block's keys and values: the
        /// block table scatters them, so the hardware prefetcher does not see them coming.
        #[inline(always)]
        unsafe fn prefetch(p: *const u8, bytes: usize) {
            let _ = (p, bytes);
        }
    }

    /// x86's prefetch of every line `bytes` bytes from `p` touch (the cache pools need not
    /// start on a line, so the first line is `p`'s, rounded down).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn prefetch_x86(p: *const u8, bytes: usize) {
        let lead = p as usize & 63;
        let first = p.wrapping_sub(lead);
        let mut off = 0;
        while off < bytes + lead {
            _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(off) as *const i8);
            off += 64;
        }
    }

    /// The portable statement of the kernels' arithmetic: `f32::mul_add` is one rounding, as
    /// every SIMD fused multiply-add. The pass shape is a parameter: [`Mirror`] takes one,
    /// [`MirrorWide`] the AVX-512 kernel's, so hosts without AVX-512 test those passes too.
    #[derive(Clone, Copy)]
    pub(super) struct Portable<const R: usize, const C: usize, const VR: usize>([f32; 16]);

    pub(super) type Mirror = Portable<4, 4, 4>;
    #[cfg(test)]
    pub(super) type MirrorWide = Portable<12, 2, 12>;

    impl<const R: usize, const C: usize, const VR: usize> Lanes for Portable<R, C, VR> {
        const ROWS: usize = R;
        const VALUE_COLS: usize = C;
        const VALUE_ROWS: usize = VR;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Self([0.0; 16])
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Self([x; 16])
        }
        #[inline(always)]
        unsafe fn load<E: KvElem>(p: *const E) -> Self {
            Self(std::array::from_fn(|i| (*p.add(i)).to_f32()))
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            Self(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Self(std::array::from_fn(|i| a.0[i] + b.0[i]))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Self(std::array::from_fn(|i| a.0[i] * b.0[i]))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            std::ptr::copy_nonoverlapping(self.0.as_ptr(), p, 16)
        }
    }

    /// Four NEON registers.
    #[cfg(target_arch = "aarch64")]
    #[derive(Clone, Copy)]
    pub(super) struct Neon4([float32x4_t; 4]);

    /// Eight f16 (raw bits) as two sets of four f32: `fcvtl` / `fcvtl2`, in every Armv8 CPU
    /// (Rust's intrinsic for them needs its unstable `f16`).
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn f16x8_f32(h: uint16x8_t) -> [float32x4_t; 2] {
        let (lo, hi): (float32x4_t, float32x4_t);
        std::arch::asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        [lo, hi]
    }

    #[cfg(target_arch = "aarch64")]
    impl Lanes for Neon4 {
        // 32 registers of 4 lanes hold as many 16-lane values as AVX2's 16 of 8.
        const ROWS: usize = 2;
        const VALUE_COLS: usize = 4;
        const VALUE_ROWS: usize = 1;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Neon4([vdupq_n_f32(0.0); 4])
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Neon4([vdupq_n_f32(x); 4])
        }
        #[inline(always)]
        unsafe fn load<E: KvElem>(p: *const E) -> Self {
            if E::HALF {
                let h = p as *const u16;
                let [a, b] = f16x8_f32(vld1q_u16(h));
                let [c, d] = f16x8_f32(vld1q_u16(h.add(8)));
                Neon4([a, b, c, d])
            } else if E::I8 {
                let c = vld1q_s8(p as *const i8);
                let (lo, hi) = (vmovl_s8(vget_low_s8(c)), vmovl_high_s8(c));
                Neon4([
                    vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
                    vcvtq_f32_s32(vmovl_high_s16(lo)),
                    vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                    vcvtq_f32_s32(vmovl_high_s16(hi)),
                ])
            } else {
                let f = p as *const f32;
                Neon4(std::array::from_fn(|i| vld1q_f32(f.add(4 * i))))
            }
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            Neon4(std::array::from_fn(|i| vfmaq_f32(c.0[i], a.0[i], b.0[i])))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Neon4(std::array::from_fn(|i| vaddq_f32(a.0[i], b.0[i])))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Neon4(std::array::from_fn(|i| vmulq_f32(a.0[i], b.0[i])))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            for i in 0..4 {
                vst1q_f32(p.add(4 * i), self.0[i]);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[derive(Clone, Copy)]
    pub(super) struct Zmm(__m512);

    #[cfg(target_arch = "x86_64")]
    impl Lanes for Zmm {
        // 24 accumulators and two key rows of the 32 registers: one pass over the keys
        // serves a verification window of 4 tokens × 3 GQA heads, so each key is converted
        // from f16 once per 12 rows (the conversion shares the FMA ports).
        const ROWS: usize = 12;
        // Half a 64-wide row per pass: 24 accumulators again, each value vector converted
        // once per 12 rows instead of once per 4.
        const VALUE_COLS: usize = 2;
        const VALUE_ROWS: usize = 12;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Zmm(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Zmm(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load<E: KvElem>(p: *const E) -> Self {
            Zmm(if E::HALF {
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
            } else if E::I8 {
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
            } else {
                _mm512_loadu_ps(p as *const f32)
            })
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            Zmm(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Zmm(_mm512_add_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Zmm(_mm512_mul_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8, bytes: usize) {
            prefetch_x86(p, bytes)
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[derive(Clone, Copy)]
    pub(super) struct Ymm2([__m256; 2]);

    #[cfg(target_arch = "x86_64")]
    impl Lanes for Ymm2 {
        const ROWS: usize = 2;
        // Head dim 64 is eight ymm per row already.
        const VALUE_COLS: usize = 4;
        const VALUE_ROWS: usize = 1;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Ymm2([_mm256_setzero_ps(); 2])
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Ymm2([_mm256_set1_ps(x); 2])
        }
        #[inline(always)]
        unsafe fn load<E: KvElem>(p: *const E) -> Self {
            Ymm2(std::array::from_fn(|h| {
                if E::HALF {
                    _mm256_cvtph_ps(_mm_loadu_si128(
                        (p as *const u16).add(8 * h) as *const __m128i
                    ))
                } else if E::I8 {
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        (p as *const i8).add(8 * h) as *const __m128i,
                    )))
                } else {
                    _mm256_loadu_ps((p as *const f32).add(8 * h))
                }
            }))
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            Ymm2(std::array::from_fn(|h| {
                _mm256_fmadd_ps(a.0[h], b.0[h], c.0[h])
            }))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Ymm2(std::array::from_fn(|h| _mm256_add_ps(a.0[h], b.0[h])))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Ymm2(std::array::from_fn(|h| _mm256_mul_ps(a.0[h], b.0[h])))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0[0]);
            _mm256_storeu_ps(p.add(8), self.0[1]);
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8, bytes: usize) {
            prefetch_x86(p, bytes)
        }
    }

    /// Runs the grouped kernel; `false` (nothing written) when the shape is not one it takes or
    /// an index would leave the pools, so the caller falls back to the portable body.
    #[inline(always)]
    pub(super) unsafe fn run<V: Lanes, KE: KvElem, VE: KvElem>(
        a: &AttendArgs<'_, KE, VE>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> bool {
        // The value passes' dispatch below has arms for these shapes only.
        const {
            assert!(V::VALUE_COLS == 2 || (V::VALUE_COLS == 4 && V::VALUE_ROWS <= 4));
        };
        let hd = a.hd;
        if a.bs != BS || !(hd == 64 || hd == 128) || a.g >= a.n_kv {
            return false;
        }
        let r_n = a.lims.len();
        let l = a.lims.iter().copied().max().unwrap_or(0);
        let nb = l.div_ceil(BS);
        let Some(kvd) = a.n_kv.checked_mul(hd) else {
            return false;
        };
        if a.blocks.len() < nb || out.len() < r_n * hd || a.q.len() < r_n * hd {
            return false;
        }
        // Checked arithmetic: shapes whose offsets wrap around would pass a wrapping check
        // and send the kernels' pointers out of the pools.
        let fits = a.blocks[..nb].iter().all(|&b| {
            let b = b as usize;
            let head_end = b.checked_mul(a.n_kv).and_then(|x| x.checked_add(a.g + 1));
            let k_end = head_end.and_then(|x| x.checked_mul(hd * BS));
            let scale_end = head_end.and_then(|x| x.checked_mul(BS));
            let v_end = b
                .checked_mul(BS)
                .and_then(|x| x.checked_add(BS - 1))
                .and_then(|x| x.checked_mul(kvd))
                .and_then(|x| x.checked_add(a.g * hd + hd));
            k_end.is_some_and(|e| e <= a.kpool.len())
                && v_end.is_some_and(|e| e <= a.vpool.len())
                && (!VE::I8 || scale_end.is_some_and(|e| e <= a.vscale.len()))
                && (!KE::I8 || scale_end.is_some_and(|e| e <= a.kscale.len()))
        });
        if !fits {
            return false;
        }
        // Scratch: the scores, block-major (`[block][row][BS]`, so a pass finds its rows'
        // weights for one position at fixed offsets from one pointer), then the queries
        // transposed (`[dim][row]`, likewise for one dimension).
        scores.clear();
        scores.resize(nb * r_n * BS + hd * r_n, 0.0);
        let (sc, qt) = scores.split_at_mut(nb * r_n * BS);
        for (r, q) in a.q[..r_n * hd].chunks_exact(hd).enumerate() {
            for (d, &x) in q.iter().enumerate() {
                qt[d * r_n + r] = x;
            }
        }
        let mut r = 0;
        while r < r_n {
            r += match pass_rows(r_n - r, V::ROWS) {
                1 => scores_rows::<V, 1, KE, VE>(a, qt, r, sc),
                2 => scores_rows::<V, 2, KE, VE>(a, qt, r, sc),
                3 => scores_rows::<V, 3, KE, VE>(a, qt, r, sc),
                4 => scores_rows::<V, 4, KE, VE>(a, qt, r, sc),
                6 => scores_rows::<V, 6, KE, VE>(a, qt, r, sc),
                8 => scores_rows::<V, 8, KE, VE>(a, qt, r, sc),
                _ => scores_rows::<V, 12, KE, VE>(a, qt, r, sc),
            };
        }
        for r in 0..r_n {
            if KE::I8 {
                // Each live score takes its position's key scale (the pass multiplied codes).
                scale_row(a, a.kscale, sc, r_n, r);
            }
            let l = softmax_row(sc, r_n, r, a.lims[r], nb);
            if let Some(x) = lse.get_mut(r) {
                *x = l;
            }
            if VE::I8 {
                // Each live weight takes its position's value scale, so the values pass
                // multiplies codes.
                scale_row(a, a.vscale, sc, r_n, r);
            }
        }
        let scores = &*sc;
        // Each output element's sum runs over the positions in order whatever the pass
        // shape, so the shape changes no bits.
        for c0 in (0..hd).step_by(16 * V::VALUE_COLS) {
            let mut r = 0;
            while r < r_n {
                r += match (V::VALUE_COLS, pass_rows(r_n - r, V::VALUE_ROWS)) {
                    (2, 1) => values_rows::<V, 2, 1, KE, VE>(a, scores, r, c0, out),
                    (2, 2) => values_rows::<V, 2, 2, KE, VE>(a, scores, r, c0, out),
                    (2, 3) => values_rows::<V, 2, 3, KE, VE>(a, scores, r, c0, out),
                    (2, 4) => values_rows::<V, 2, 4, KE, VE>(a, scores, r, c0, out),
                    (2, 6) => values_rows::<V, 2, 6, KE, VE>(a, scores, r, c0, out),
                    (2, 8) => values_rows::<V, 2, 8, KE, VE>(a, scores, r, c0, out),
                    (2, _) => values_rows::<V, 2, 12, KE, VE>(a, scores, r, c0, out),
                    (_, 1) => values_rows::<V, 4, 1, KE, VE>(a, scores, r, c0, out),
                    (_, 2) => values_rows::<V, 4, 2, KE, VE>(a, scores, r, c0, out),
                    (_, 3) => values_rows::<V, 4, 3, KE, VE>(a, scores, r, c0, out),
                    _ => values_rows::<V, 4, 4, KE, VE>(a, scores, r, c0, out),
                };
            }
        }
        true
    }

    /// Multiplies row `r`'s live entries of block-major scores by their positions' scales
    /// (`[block][head][position]`, as the cache keeps them).
    #[inline(always)]
    fn scale_row<KE: KvElem, VE: KvElem>(
        a: &AttendArgs<'_, KE, VE>,
        scales: &[f32],
        sc: &mut [f32],
        r_n: usize,
        r: usize,
    ) {
        let lim = a.lims[r];
        for (bi, &blk) in a.blocks[..lim.div_ceil(BS)].iter().enumerate() {
            let s = &scales[(blk as usize * a.n_kv + a.g) * BS..][..BS];
            let n = BS.min(lim - bi * BS);
            for (x, s) in sc[(bi * r_n + r) * BS..][..n].iter_mut().zip(s) {
                *x *= s;
            }
        }
    }

    /// Softmax of row `r` of block-major scores over its first `lim` positions, with the
    /// bits of `softmax_body` on the row laid out flat (the same maximum, the same sum in
    /// the same order: 16 partial sums over whole blocks, the partial block's sum added
    /// last); the row's positions from `lim` up to `nb` blocks become exactly 0 (a pass with
    /// a longer row walks them; `values_rows` skips them). Returns the row's log-sum-exp, as
    /// `softmax_body_lse`.
    #[inline(always)]
    fn softmax_row(sc: &mut [f32], r_n: usize, r: usize, lim: usize, nb: usize) -> f32 {
        let at = |bi: usize| (bi * r_n + r) * BS;
        let (full, part) = (lim / BS, lim % BS);
        // The partial block's live positions (none when `lim` ends a block, which may be
        // the last one).
        let tail_at = if part > 0 { at(full) } else { 0 };
        let mut mx = [f32::NEG_INFINITY; BS];
        for bi in 0..full {
            let b = &sc[at(bi)..at(bi) + BS];
            for j in 0..BS {
                mx[j] = if b[j] > mx[j] { b[j] } else { mx[j] };
            }
        }
        let m = sc[tail_at..tail_at + part]
            .iter()
            .chain(mx.iter())
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let mut acc = [0f32; BS];
        for bi in 0..full {
            let b = &mut sc[at(bi)..at(bi) + BS];
            for j in 0..BS {
                b[j] = fast_exp(b[j] - m);
                acc[j] += b[j];
            }
        }
        let tail = &mut sc[tail_at..tail_at + part];
        for v in tail.iter_mut() {
            *v = fast_exp(*v - m);
        }
        let rem: f32 = tail.iter().sum();
        let total = acc.iter().sum::<f32>() + rem;
        let inv = 1.0 / total;
        for bi in 0..full {
            for v in &mut sc[at(bi)..at(bi) + BS] {
                *v *= inv;
            }
        }
        for v in &mut sc[tail_at..tail_at + part] {
            *v *= inv;
        }
        if part > 0 {
            sc[tail_at + part..tail_at + BS].fill(0.0);
        }
        for bi in lim.div_ceil(BS)..nb {
            sc[at(bi)..at(bi) + BS].fill(0.0);
        }
        m + total.ln()
    }

    /// Rows for the next pass: the largest instantiated count that `left` rows and the
    /// lanes' register budget `max` allow.
    #[inline(always)]
    fn pass_rows(left: usize, max: usize) -> usize {
        let m = left.min(max);
        [12, 8, 6, 4, 3, 2]
            .into_iter()
            .find(|&c| c <= m)
            .unwrap_or(1)
    }

    /// Scores of rows `r0..r0 + R` for every key block up to the largest of their limits; two
    /// partial sums per row (even and odd dimensions) break the FMA latency chain. Returns `R`.
    #[inline(always)]
    unsafe fn scores_rows<V: Lanes, const R: usize, KE: KvElem, VE: KvElem>(
        a: &AttendArgs<'_, KE, VE>,
        qt: &[f32],
        r0: usize,
        scores: &mut [f32],
    ) -> usize {
        let hd = a.hd;
        let r_n = a.lims.len();
        let lim = a.lims[r0..r0 + R].iter().copied().max().unwrap_or(0);
        let scale = V::splat(a.scale);
        let nb = lim.div_ceil(BS);
        let tile = hd * BS * std::mem::size_of::<KE>();
        for (bi, &blk) in a.blocks[..nb].iter().enumerate() {
            let kt = a
                .kpool
                .as_ptr()
                .add((blk as usize * a.n_kv + a.g) * hd * BS);
            if let Some(&next) = a.blocks[..nb].get(bi + 1) {
                let nk = a
                    .kpool
                    .as_ptr()
                    .wrapping_add((next as usize * a.n_kv + a.g) * hd * BS);
                V::prefetch(nk as *const u8, tile);
            }
            let mut a0 = [V::zero(); R];
            let mut a1 = [V::zero(); R];
            for d in (0..hd).step_by(2) {
                let k0 = V::load(kt.add(d * BS));
                let k1 = V::load(kt.add((d + 1) * BS));
                let (q0, q1) = (
                    qt.as_ptr().add(d * r_n + r0),
                    qt.as_ptr().add((d + 1) * r_n + r0),
                );
                for u in 0..R {
                    a0[u] = V::fmadd(V::splat(*q0.add(u)), k0, a0[u]);
                    a1[u] = V::fmadd(V::splat(*q1.add(u)), k1, a1[u]);
                }
            }
            let dst = scores.as_mut_ptr().add((bi * r_n + r0) * BS);
            for u in 0..R {
                V::mul(V::add(a0[u], a1[u]), scale).store(dst.add(u * BS));
            }
        }
        R
    }

    /// `out[r][c0..c0 + 16·NV] = Σ_p w[r][p] · V[p][c0..]` for rows `r0..r0 + R`, walking
    /// the block table block by block. Returns `R`.
    ///
    /// Each row sums only its own positions (below its limit), as `attend_body` does: the
    /// pass walks up to the largest limit, and a shorter row's weight there is 0, but
    /// 0 · ∞ is NaN (an f16 value above 65504 is ∞). Skipping a zero weight changes no bits
    /// otherwise: the sums start at +0 and never become −0, so adding 0 · v leaves them.
    #[inline(always)]
    unsafe fn values_rows<V: Lanes, const NV: usize, const R: usize, KE: KvElem, VE: KvElem>(
        a: &AttendArgs<'_, KE, VE>,
        scores: &[f32],
        r0: usize,
        c0: usize,
        out: &mut [f32],
    ) -> usize {
        let hd = a.hd;
        let kvd = a.n_kv * hd;
        let r_n = a.lims.len();
        let lims: [usize; R] = std::array::from_fn(|u| a.lims[r0 + u]);
        let lim = lims.iter().copied().max().unwrap_or(0);
        let mut acc = [[V::zero(); NV]; R];
        for (bi, &blk) in a.blocks.iter().enumerate() {
            let p0 = bi * BS;
            if p0 >= lim {
                break;
            }
            let base = a
                .vpool
                .as_ptr()
                .add(blk as usize * BS * kvd + a.g * hd + c0);
            if let Some(&next) = a.blocks.get(bi + 1).filter(|_| p0 + BS < lim) {
                let nv = a
                    .vpool
                    .as_ptr()
                    .wrapping_add(next as usize * BS * kvd + a.g * hd + c0);
                for j in 0..BS {
                    V::prefetch(
                        nv.wrapping_add(j * kvd) as *const u8,
                        16 * NV * std::mem::size_of::<VE>(),
                    );
                }
            }
            let wb = scores.as_ptr().add((bi * r_n + r0) * BS);
            for j in 0..BS.min(lim - p0) {
                let vr = base.add(j * kvd);
                let v: [V; NV] = std::array::from_fn(|i| V::load(vr.add(16 * i)));
                let p = p0 + j;
                for u in 0..R {
                    if p >= lims[u] {
                        continue;
                    }
                    let w = V::splat(*wb.add(u * BS + j));
                    for i in 0..NV {
                        acc[u][i] = V::fmadd(w, v[i], acc[u][i]);
                    }
                }
            }
        }
        for u in 0..R {
            for i in 0..NV {
                acc[u][i].store(out.as_mut_ptr().add((r0 + u) * hd + c0 + 16 * i));
            }
        }
        R
    }
}

#[inline(always)]
fn rms_norm_body(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot_body(x, x) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

#[inline(always)]
fn silu_mul_body(gate_up: &[f32], out: &mut [f32]) {
    let f = out.len();
    let (g, u) = gate_up.split_at(f);
    for i in 0..f {
        let gi = g[i];
        out[i] = gi / (1.0 + fast_exp(-gi)) * u[i];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_norm_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_body(x, w, eps, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate_up: &[f32], out: &mut [f32]) {
    silu_mul_body(gate_up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn silu_mul_avx512(gate_up: &[f32], out: &mut [f32]) {
    silu_mul_body(gate_up, out)
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(isa: Isa, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    match isa.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni | Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            rms_norm_avx2(x, w, eps, out)
        },
        _ => rms_norm_body(x, w, eps, out),
    }
}

/// SwiGLU on a fused `[gate | up]` row: `out[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(isa: Isa, gate_up: &[f32], out: &mut [f32]) {
    match isa.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { silu_mul_avx512(gate_up, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni => unsafe { silu_mul_avx2(gate_up, out) },
        _ => silu_mul_body(gate_up, out),
    }
}

/// `e^x` without a libm call (Cephes `expf` polynomial, ≤ 2 ulp on [-87, 88]), written so
/// the compiler vectorizes loops over it. Inputs below -87 give 0.
#[inline(always)]
pub fn fast_exp(x0: f32) -> f32 {
    let x = x0.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r2 + r + 1.0;
    // 2^n from the bits of n + 127 + 1.5·2²³ (n + 127 is in 2..=254 here, so it sits in the
    // low mantissa bits and the shift drops the rest): `n as i32` is a saturating conversion
    // that keeps loops over this function from vectorizing.
    let v = f32::from_bits((n + (127.0 + 12_582_912.0)).to_bits() << 23) * e;
    if x0 < -87.0 { 0.0 } else { v }
}

/// Sum with 16 independent partial sums (a plain `+=` loop does not vectorize: float addition
/// is not reassociated).
#[inline(always)]
fn sum_body(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let rem: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for j in 0..16 {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + rem
}

#[inline(always)]
pub(crate) fn max_body(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rem = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    for c in chunks {
        for j in 0..16 {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    acc.iter().fold(rem, |a, &b| if b > a { b } else { a })
}

#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    softmax_body_lse(x);
}

/// [`softmax_body`], returning the log of its denominator: `max + ln Σ exp(x − max)`
/// (−∞ for an empty row).
#[inline(always)]
fn softmax_body_lse(x: &mut [f32]) -> f32 {
    let max = max_body(x);
    for v in x.iter_mut() {
        *v = fast_exp(*v - max);
    }
    let total = sum_body(x);
    let inv = 1.0 / total;
    for v in x.iter_mut() {
        *v *= inv;
    }
    max + total.ln()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    softmax_body(x)
}

/// The normalized Walsh–Hadamard transform of `x` in place (`x.len()` a power of two): an
/// orthogonal matrix that is its own inverse, so `H·q · H·k = q · k`. An 8-bit cache stores
/// each key row rotated by it (and attention rotates the queries alike): the rotation spreads
/// the few channels that are tens of times larger than the rest over all of them, so one
/// scale per row fits the whole row (QuaRot, Ashkboos et al. 2024). Plain adds in a fixed
/// order: the same bits on every machine.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    assert!(
        n.is_power_of_two(),
        "hadamard of {n} elements: not a power of two"
    );
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// In-place softmax (leaves a probability vector).
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { softmax_avx2(x) };
    }
    softmax_body(x)
}

#[inline(always)]
fn logit_stats_body(x: &[f32]) -> (f32, f32) {
    let max = max_body(x);
    // Σ e^{l−m} and Σ e^{l−m}·(l−m), 16 lanes each so the loop vectorizes.
    let (mut s, mut a) = ([0f32; 16], [0f32; 16]);
    let chunks = x.chunks_exact(16);
    let (mut rs, mut ra) = (0f32, 0f32);
    for &v in chunks.remainder() {
        let d = v - max;
        let e = fast_exp(d);
        rs += e;
        ra += e * d;
    }
    for c in chunks {
        for j in 0..16 {
            let d = c[j] - max;
            let e = fast_exp(d);
            s[j] += e;
            a[j] += e * d;
        }
    }
    let sum = s.iter().sum::<f32>() + rs;
    let acc = a.iter().sum::<f32>() + ra;
    let ln_s = sum.ln();
    (-ln_s, ln_s - acc / sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn logit_stats_avx2(x: &[f32]) -> (f32, f32) {
    logit_stats_body(x)
}

/// Of softmax(`x`) without materializing it: (log of the top probability, entropy in nats).
/// Empty or non-finite input gives non-finite values; callers check.
pub fn logit_stats(x: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { logit_stats_avx2(x) };
    }
    logit_stats_body(x)
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
    fn attend_matches_naive_causal_attention() {
        // The generic shape, the grouped fast paths (head_dim 64 and 128, blocks of 16) with
        // every count of rows left over after a pass's rows (12, 8, 6, 4, 3, 2 or 1 on some
        // path), limits that end a block (the last one too) and uneven limits within a pass.
        let long: Vec<usize> = (0..25)
            .map(|i| [48, 16, 33, 1, 47, 32, 20][i % 7])
            .collect();
        let shapes = [
            (16usize, 8usize, vec![5usize, 17, 30, 1, 48]),
            // A head_dim the SIMD passes do not take (the portable body), blocks of 16.
            (32, 16, vec![5, 17, 30, 1, 48]),
            (64, 16, vec![5, 17, 30, 1, 48, 48, 47, 2, 33]),
            (64, 16, vec![40, 41, 42]),
            (128, 16, vec![9, 48, 1]),
            (64, 16, long[..14].to_vec()),
            (64, 16, long[..11].to_vec()),
            (64, 16, long[..7].to_vec()),
            (64, 16, long.clone()),
            (128, 16, long[..13].to_vec()),
        ];
        for (hd, bs, lims) in shapes {
            attend_case::<f32, f32>(hd, bs, &lims);
            attend_case::<half::f16, half::f16>(hd, bs, &lims);
            attend_case::<half::f16, i8>(hd, bs, &lims);
            attend_case::<i8, i8>(hd, bs, &lims);
        }
    }

    #[test]
    fn an_infinite_value_past_a_rows_limit_leaves_that_row_finite() {
        // f16 values, one of them ∞ (a value above 65504) at position 20: rows that end
        // before it share passes with rows that reach it, and get the scalar path's finite
        // outputs on every path (0 · ∞ would be NaN).
        let (hd, bs, n_kv, g) = (64usize, 16usize, 2usize, 1usize);
        let kvd = n_kv * hd;
        let blocks = [2u32, 0, 1];
        let n = blocks.len() * bs;
        let mut rng = Rng::new(13);
        let kpool: Vec<half::f16> = (0..n * kvd)
            .map(|_| half::f16::from_f32(rng.normal() as f32))
            .collect();
        let mut vpool: Vec<half::f16> = (0..n * kvd)
            .map(|_| half::f16::from_f32(rng.normal() as f32))
            .collect();
        let p_inf = 20;
        let slot = blocks[p_inf / bs] as usize * bs + p_inf % bs;
        vpool[slot * kvd + g * hd + 5] = half::f16::INFINITY;
        let lims = [5usize, 40, 3, 48, 16, 21, 20, 1, 33];
        let q: Vec<f32> = (0..lims.len() * hd).map(|_| rng.normal() as f32).collect();
        let args = AttendArgs {
            q: &q,
            lims: &lims,
            kpool: &kpool,
            vpool: &vpool,
            kscale: &[],
            vscale: &[],
            blocks: &blocks,
            bs,
            n_kv,
            g,
            hd,
            scale: 0.25,
        };
        let run = |isa: Isa| {
            let mut out = vec![0f32; lims.len() * hd];
            attend(isa, &args, &mut Vec::new(), &mut out);
            out
        };
        let want = run(Isa::Scalar);
        let mut mirror = vec![0f32; lims.len() * hd];
        assert!(attend_mirror(&args, &mut Vec::new(), &mut mirror, &mut []));
        let mut wide = vec![0f32; lims.len() * hd];
        assert!(attend_mirror_wide(&args, &mut Vec::new(), &mut wide));
        let mut paths = vec![("mirror".to_string(), mirror), ("wide".to_string(), wide)];
        for isa in Isa::available() {
            paths.push((format!("{isa:?}"), run(isa)));
        }
        for (r, &lim) in lims.iter().enumerate() {
            let w = &want[r * hd..(r + 1) * hd];
            if lim <= p_inf {
                assert!(w.iter().all(|x| x.is_finite()), "scalar r{r}");
            }
            for (name, got) in &paths {
                let got = &got[r * hd..(r + 1) * hd];
                for i in 0..hd {
                    if w[i].is_finite() {
                        assert!(
                            (got[i] - w[i]).abs() < 1e-4,
                            "{name} lim {lim} r{r} i{i}: {} against {}",
                            got[i],
                            w[i]
                        );
                    } else {
                        assert_eq!(got[i].to_bits(), w[i].to_bits(), "{name} r{r} i{i}");
                    }
                }
            }
        }
    }

    /// The reference takes K and V as stored (rounded through their types, or 8-bit codes
    /// times their scales), so one bound holds for every element type.
    fn attend_case<KE: KvElem, VE: KvElem>(hd: usize, bs: usize, lims: &[usize]) {
        let mut rng = Rng::new(9);
        let (n_kv, g, n_blocks) = (3usize, 1usize, 48usize.div_ceil(bs));
        let kvd = n_kv * hd;
        let blocks: Vec<u32> = [4u32, 0, 5, 2, 1, 3]
            .into_iter()
            .filter(|&b| (b as usize) < n_blocks)
            .collect();
        // Value codes over their whole range with scales around 1/40, as the cache quantizes
        // rows of unit size (no scales for float values).
        let vscale: Vec<f32> = if VE::I8 {
            (0..n_blocks * n_kv * bs)
                .map(|_| (0.015 + 0.02 * rng.uniform()) as f32)
                .collect()
        } else {
            Vec::new()
        };
        // Key codes likewise, with scales around 1/60 (scores of a few units).
        let kscale: Vec<f32> = if KE::I8 {
            (0..n_blocks * n_kv * bs)
                .map(|_| (0.01 + 0.013 * rng.uniform()) as f32)
                .collect()
        } else {
            Vec::new()
        };
        // The cache's layout, then the logical K/V per position it holds.
        let mut kpool = vec![KE::from_f32(0.0); n_blocks * bs * kvd];
        let mut vpool = vec![VE::from_f32(0.0); n_blocks * bs * kvd];
        let (mut k, mut v) = (
            vec![0f32; n_blocks * bs * kvd],
            vec![0f32; n_blocks * bs * kvd],
        );
        for p in 0..n_blocks * bs {
            let (b, off) = (blocks[p / bs] as usize, p % bs);
            for h in 0..n_kv {
                for d in 0..hd {
                    let (e, s) = if KE::I8 {
                        let e = KE::from_f32((rng.uniform() * 254.0 - 127.0) as f32);
                        (e, kscale[(b * n_kv + h) * bs + off])
                    } else {
                        (KE::from_f32(rng.normal() as f32), 1.0)
                    };
                    kpool[((b * n_kv + h) * hd + d) * bs + off] = e;
                    k[p * kvd + h * hd + d] = e.to_f32() * s;
                }
                for d in 0..hd {
                    let (e, s) = if VE::I8 {
                        let e = VE::from_f32((rng.uniform() * 254.0 - 127.0) as f32);
                        (e, vscale[(b * n_kv + h) * bs + off])
                    } else {
                        (VE::from_f32(rng.normal() as f32), 1.0)
                    };
                    vpool[(b * bs + off) * kvd + h * hd + d] = e;
                    v[p * kvd + h * hd + d] = e.to_f32() * s;
                }
            }
        }
        let q: Vec<f32> = (0..lims.len() * hd).map(|_| rng.normal() as f32).collect();
        let args = AttendArgs {
            q: &q,
            lims,
            kpool: &kpool,
            vpool: &vpool,
            kscale: &kscale,
            vscale: &vscale,
            blocks: &blocks,
            bs,
            n_kv,
            g,
            hd,
            scale: 0.25,
        };
        let mut outs: Vec<(Isa, Vec<f32>)> = Vec::new();
        let mut lses: Vec<(Isa, Vec<f32>)> = Vec::new();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for isa in Isa::available() {
            let mut out = vec![0f32; lims.len() * hd];
            let mut sc = Vec::new();
            attend(isa, &args, &mut sc, &mut out);
            // With the log-sum-exp recorded: the same outputs, and each row's denominator.
            let mut with = vec![0f32; lims.len() * hd];
            let mut lse = vec![0f32; lims.len()];
            attend_lse(isa, &args, &mut sc, &mut with, &mut lse);
            assert_eq!(bits(&with), bits(&out), "{isa:?}: attend_lse's outputs");
            // The positions split into parts of two blocks, each attended on its own slice of
            // the block table, then weighted by exp(lse − max lse): the whole row again.
            let part = 2 * bs;
            let n_parts = lims.iter().copied().max().unwrap_or(0).div_ceil(part);
            let mut parts = Vec::new();
            for pi in 0..n_parts {
                let plims: Vec<usize> = lims
                    .iter()
                    .map(|&l| l.saturating_sub(pi * part).min(part))
                    .collect();
                let pargs = AttendArgs {
                    lims: &plims,
                    blocks: &blocks[pi * 2..],
                    ..args
                };
                let mut o = vec![0f32; lims.len() * hd];
                let mut l = vec![0f32; lims.len()];
                attend_lse(isa, &pargs, &mut sc, &mut o, &mut l);
                parts.push((plims, o, l));
            }
            for (r, &lim) in lims.iter().enumerate() {
                let live: Vec<&(Vec<usize>, Vec<f32>, Vec<f32>)> =
                    parts.iter().filter(|(pl, _, _)| pl[r] > 0).collect();
                let m = live
                    .iter()
                    .map(|p| p.2[r])
                    .fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = live.iter().map(|p| (p.2[r] - m).exp()).collect();
                let z: f32 = w.iter().sum();
                assert!(
                    (m + z.ln() - lse[r]).abs() < 1e-4 * (1.0 + lse[r].abs()),
                    "{isa:?} r{r}: parts' lse {} against {}",
                    m + z.ln(),
                    lse[r]
                );
                for i in 0..hd {
                    let merged: f32 = live
                        .iter()
                        .zip(&w)
                        .map(|(p, w)| w * p.1[r * hd + i])
                        .sum::<f32>()
                        / z;
                    assert!(
                        (merged - out[r * hd + i]).abs() < 1e-5,
                        "{isa:?} lim {lim} r{r} i{i}: split {merged} whole {}",
                        out[r * hd + i]
                    );
                }
            }
            lses.push((isa, lse));
            for (r, &lim) in lims.iter().enumerate() {
                let mut s: Vec<f64> = (0..lim)
                    .map(|p| {
                        0.25 * (0..hd)
                            .map(|d| (q[r * hd + d] * k[p * kvd + g * hd + d]) as f64)
                            .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                let want_lse = m + z.ln();
                let got_lse = lses.last().map(|(_, l)| l[r]).unwrap_or(f32::NAN) as f64;
                assert!(
                    (want_lse - got_lse).abs() < 1e-4 * (1.0 + want_lse.abs()),
                    "{isa:?} r{r}: lse {got_lse} against {want_lse}"
                );
                for x in s.iter_mut() {
                    *x = (*x - m).exp() / z;
                }
                for i in 0..hd {
                    let want: f64 = (0..lim)
                        .map(|p| s[p] * v[p * kvd + g * hd + i] as f64)
                        .sum();
                    assert!(
                        (want - out[r * hd + i] as f64).abs() < 1e-4,
                        "{isa:?} half {} i8 keys {} values {} hd{hd} bs{bs} r{r} i{i}",
                        KE::HALF,
                        KE::I8,
                        VE::I8
                    );
                }
            }
            outs.push((isa, out));
        }
        // The SIMD kernels (AVX2 on two ymm, AVX-512 on one zmm, NEON on four registers) do
        // the portable mirror's operations per lane, so they give its bits.
        let mut mirror = vec![0f32; lims.len() * hd];
        let mut mirror_lse = vec![0f32; lims.len()];
        let took = attend_mirror(&args, &mut Vec::new(), &mut mirror, &mut mirror_lse);
        assert_eq!(took, bs == 16 && (hd == 64 || hd == 128), "hd{hd} bs{bs}");
        // Passes of 12 rows and half columns (the AVX-512 shape) give the same bits as passes
        // of 4, on any host.
        let mut wide = vec![0f32; lims.len() * hd];
        assert_eq!(attend_mirror_wide(&args, &mut Vec::new(), &mut wide), took);
        if took {
            assert_eq!(bits(&wide), bits(&mirror), "hd{hd}: wide passes");
        }
        if took {
            let simd: Vec<&(Isa, Vec<f32>)> =
                outs.iter().filter(|(i, _)| *i != Isa::Scalar).collect();
            for (isa, lse) in lses.iter().filter(|(i, _)| *i != Isa::Scalar) {
                assert_eq!(
                    bits(lse),
                    bits(&mirror_lse),
                    "{isa:?}: lse against the mirror"
                );
            }
            for (isa, out) in &simd {
                assert_eq!(
                    bits(out),
                    bits(&mirror),
                    "{isa:?} half {} i8 keys {} values {} hd{hd} against the mirror",
                    KE::HALF,
                    KE::I8,
                    VE::I8
                );
            }
        }
    }

    #[test]
    fn hadamard_is_orthogonal_and_its_own_inverse() {
        let mut rng = Rng::new(3);
        for n in [1usize, 2, 64, 128] {
            let q: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let mut k: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            // One large channel, as keys have.
            k[n / 2] = 40.0;
            let (mut hq, mut hk) = (q.clone(), k.clone());
            hadamard(&mut hq);
            hadamard(&mut hk);
            let d = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
            assert!((d(&hq, &hk) - d(&q, &k)).abs() < 1e-3 * (1.0 + d(&q, &k).abs()));
            if n >= 64 {
                // The large channel is spread: no rotated element is near it.
                let m = hk.iter().fold(0f32, |a, x| a.max(x.abs()));
                assert!(m < 40.0 / 2.0, "n {n}: {m}");
            }
            let mut back = hk.clone();
            hadamard(&mut back);
            for (a, b) in back.iter().zip(&k) {
                assert!((a - b).abs() < 1e-4, "n {n}");
            }
        }
        // A fixed vector's transform (n = 4): [1, 2, 3, 4] → [10, -2, -4, 0] / 2.
        let mut x = [1f32, 2.0, 3.0, 4.0];
        hadamard(&mut x);
        assert_eq!(x, [5.0, -1.0, -2.0, 0.0]);
    }

    #[test]
    fn norm_and_silu_match_naive() {
        let x: Vec<f32> = (0..96).map(|i| (i as f32 * 0.3).sin() * 4.0).collect();
        let w: Vec<f32> = (0..48).map(|i| 1.0 + i as f32 * 0.01).collect();
        for isa in Isa::available() {
            let mut o = vec![0f32; 48];
            rms_norm(isa, &x[..48], &w, 1e-5, &mut o);
            let ms: f32 = x[..48].iter().map(|v| v * v).sum::<f32>() / 48.0;
            for i in 0..48 {
                assert!((o[i] - x[i] / (ms + 1e-5).sqrt() * w[i]).abs() < 1e-5);
            }
            silu_mul(isa, &x, &mut o);
            for i in 0..48 {
                let g = x[i];
                assert!((o[i] - g / (1.0 + (-g).exp()) * x[48 + i]).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn logit_stats_match_the_softmax() {
        let mut rng = crate::rng::Rng::new(4);
        for n in [1usize, 7, 16, 100, 4099] {
            let x: Vec<f32> = (0..n).map(|_| (rng.normal() * 3.0) as f32).collect();
            let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
            let p: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp() / z).collect();
            let top = p.iter().cloned().fold(0.0, f64::max).ln();
            let h: f64 = -p
                .iter()
                .filter(|&&q| q > 0.0)
                .map(|q| q * q.ln())
                .sum::<f64>();
            let (lt, lh) = logit_stats(&x);
            assert!((lt as f64 - top).abs() < 1e-4, "n {n}: {lt} vs {top}");
            assert!(
                (lh as f64 - h).abs() < 1e-3 * (1.0 + h),
                "n {n}: {lh} vs {h}"
            );
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = fast_exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(fast_exp(-1000.0), 0.0);
        assert!(fast_exp(-87.0) < 1e-37);
    }

    /// The shift-based 2^n gives the bits the saturating `n as i32` form gave (checked over
    /// every f32 once; here over a spread of 2^20 of them): SiLU and softmax outputs did not
    /// move when loops over `fast_exp` started to vectorize.
    #[test]
    fn fast_exp_keeps_the_bits_of_the_integer_form() {
        fn int_form(x0: f32) -> f32 {
            let x = x0.clamp(-87.0, 88.0);
            let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
            let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
            let r2 = r * r;
            let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r
                + 4.166_579_6e-2)
                * r
                + 1.666_666_5e-1)
                * r
                + 0.5;
            let e = p * r2 + r + 1.0;
            let v = f32::from_bits(((n as i32 + 127) << 23) as u32) * e;
            if x0 < -87.0 { 0.0 } else { v }
        }
        for b in (0..=u32::MAX)
            .step_by(4096)
            .chain([0x42ae_0000, 0xc2ae_0000, 0x42b0_0000])
        {
            let x = f32::from_bits(b);
            let (got, want) = (fast_exp(x), int_form(x));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "fast_exp({x:e}) = {got:e}, the integer form {want:e}"
            );
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
