//! Integer matmul over 16-row interleaved weight groups: Q4_K, Q6_K, Q4_1, Q5_0 and Q8_0 weights kept
//! at their own bit widths, activations as 15-bit integers split into two 8-bit halves.
//!
//! AVX2 CPUs run twins of these kernels (`grouped_avx2.rs`), and 64-bit Arm CPUs NEON twins
//! (`grouped_neon.rs`), that give the same bits: [`mirror`] states their float order in
//! portable code, and CPUs with none of them run it.
//!
//! Why: with rows in the i32 lanes of a zmm register, one AVX-512 VNNI `vpdpbusd` (u8 weight ×
//! i8 activation, four products summed per lane) multiplies 4 elements of 16 rows with no
//! horizontal sums, and a sub-block's per-row scales apply with one multiply-add for 16 rows.
//! Decoding weights to floats first (the bf16 path of [`crate::matmul`]) costs more
//! instructions than the weights cost bytes: a Qwen2.5-1.5B decode ran at half llama.cpp's
//! speed that way, and each extra verified token cost a third of a decode on SmolLM2.
//!
//! Accuracy: ggml multiplies K-quants with 8-bit activations (one scale per 256). On
//! Qwen2.5-1.5B that moved 4 % of the greedy tokens away from the f32-dequantized reference,
//! and on SmolLM2 8-bit activations change the answer to a chat question. Here each group of 32
//! activations is `d·(128·q1 + q2)` with `q1, q2` 8-bit — 15 bits, finer than bf16 — for the
//! price of a second `vpdpbusd` (Qwen2.5-1.5B: 100 % top-1 agreement, mean KL below 1e-6 over
//! 512 positions). An activation above [`OUTLIER_RATIO`] times its 256-neighbourhood's mean |x|
//! is split off and multiplied in f32 (a guard; the default models never reach it).
//!
//! Lossless verification: each token is quantized and multiplied on its own with the same
//! instruction sequence whatever the tile, so a batch gives bit-identical rows to the same
//! tokens one by one. The scalar references ([`QMatrix::matmul_ref`](crate::QMatrix)) do the
//! same integer sums exactly; tests hold every path to them.

use crate::quant::{GgmlType, QK, scale_min_k4};
use crate::{Isa, KernelError};
use half::f16;
use std::mem::MaybeUninit;

/// Elements per K-quant super-block.
pub const QKK: usize = 256;

/// Rows interleaved in one group (the i32 lanes of a zmm register).
pub const GROUP_ROWS: usize = 16;

/// Largest token tile of the kernels.
pub(crate) const MAX_TILE: usize = 8;

/// How far ahead of the group being multiplied the x86 kernels prefetch weights (4 to 16 KiB
/// measured alike on Qwen2.5-1.5B).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 8192;

/// An activation counts as an outlier when it exceeds this many times the mean |x| of its 256
/// neighbours (the mean includes it, so this is about 85 times a typical neighbour): left in,
/// it would leave them a few hundred of the 32,767 levels. None of the default models reaches
/// it (an 8-bit split at 12× cost 10 % of a Qwen decode for nothing once activations had 15
/// bits), so it is a guard for other checkpoints, not a hot path.
pub const OUTLIER_RATIO: f32 = 64.0;

/// At most this many outliers are split off per 256 activations (the largest ones).
pub const MAX_OUTLIERS: usize = 4;

/// 16 rows × one Q4_K super-block: `w = d·sc[j]·q − dmin·mn[j]` for element `e`, `j = e / 32`,
/// `q` in 0..16. Sub-block `j`'s codes are `qs[j]`: four 64-byte vectors `g`, whose bytes
/// `4r + i` hold element `8g + i` of row `r` in the low nibble and element `8g + 4 + i` in the
/// high nibble.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
pub struct Q4KGroup {
    pub d: [f32; GROUP_ROWS],
    pub dmin: [f32; GROUP_ROWS],
    pub sc: [[u8; GROUP_ROWS]; 8],
    pub mn: [[u8; GROUP_ROWS]; 8],
    pub qs: [[u8; 256]; 8],
}

/// 16 rows × one Q6_K super-block: `w = d·sc[g]·(q − 32)`, `g = e / 16`, `q` in 0..64. Group
/// `g`'s codes are `q[g]`, 192 contiguous bytes (one stream for the prefetcher): its low 4 bits
/// are two 64-byte vectors `h`, whose bytes `4r + i` hold element `8h + i` of row `r` in the low
/// nibble and element `8h + 4 + i` in the high nibble; its top 2 bits are the third vector,
/// whose byte `4r + i` holds element `4k + i` at bits `2k..2k+2`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
pub struct Q6KGroup {
    pub d: [f32; GROUP_ROWS],
    pub sc: [[i8; GROUP_ROWS]; 16],
    pub q: [[u8; 192]; 16],
}

/// 16 rows × one Q4_1 block of 32: `w = d·q + m`, `q` in 0..16, codes laid out like one Q4_K
/// sub-block. Scales stay f16 (exact: GGUF stores them so).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
pub struct Q41Group {
    pub d: [f16; GROUP_ROWS],
    pub m: [f16; GROUP_ROWS],
    pub qs: [u8; 256],
}

/// 16 rows × one Q8_0 block of 32: `w = d·q`, stored as `q + 128` (VNNI wants unsigned
/// weights; the offset comes back through the activation sums). Vector `k` (64 bytes) holds
/// elements `4k..4k+4`, byte `4r + i` element `4k + i` of row `r`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
pub struct Q80Group {
    pub d: [f16; GROUP_ROWS],
    pub qs: [u8; 512],
}

/// 16 rows × one Q5_0 block of 32: `w = d·(q − 16)`, `q` in 0..32. The low 4 bits are laid
/// out like a Q4_K sub-block; the fifth bits are `qh`, whose byte `4r + i` holds element
/// `4k + i` of row `r` at bit `k`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
pub struct Q50Group {
    pub d: [f16; GROUP_ROWS],
    pub qs: [u8; 256],
    pub qh: [u8; 64],
}

/// One token's 32 activations as `x ≈ d·(128·q1 + q2)`, with the negated, scaled sums the
/// kernels need for mins and offsets: `neg32 = −d·Σ x16` and `neg16x32[h] = −32·d·Σ_{16h..16h+16}
/// x16` (Q6_K's offset of 32).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
pub struct BlockA32 {
    /// Codes in [−127, 127], never −128 ([`BlockA32::quantize`] clamps): the AVX2 and plain
    /// NEON kernels' 16-bit sums are bounded on that.
    pub q1: [i8; QK],
    pub q2: [i8; QK],
    pub d: f32,
    pub neg32: f32,
    pub neg16x32: [f32; 2],
    /// `Σ x16` over the block (AVX2's Q8_0 kernel adds back the codes' offset with it).
    pub sum: i32,
}

/// Round half to even for |v| < 2²², without a libm call: adding 1.5·2²³ leaves no fraction
/// bits, so the FPU rounds (Rust never reassociates float arithmetic).
#[inline(always)]
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

impl BlockA32 {
    /// The 15-bit code of element `e`.
    #[inline]
    pub fn x16(&self, e: usize) -> i32 {
        128 * self.q1[e] as i32 + self.q2[e] as i32
    }

    /// [`BlockA32::quantize`] with the SIMD of `isa` where it has some (and this CPU too); the
    /// same bits either way (NaNs included: every path gives them code 0).
    ///
    /// Quantizes the first 32 values of `x`. A shorter `x` never panics: it is padded with
    /// zeros to 32 values (the codes of the missing elements are 0).
    pub fn quantize_fast(x: &[f32], isa: Isa) -> Self {
        let mut b = [MaybeUninit::uninit()];
        if x.len() < QK {
            let mut pad = [0f32; QK];
            pad[..x.len()].copy_from_slice(x);
            return quantize_into(&pad, isa, &mut b)[0];
        }
        quantize_into(&x[..QK], isa, &mut b)[0]
    }

    /// Fills the sums from the codes (the scalar quantizer).
    fn finish(&mut self, d2: f32) {
        let s0: i32 = (0..16).map(|e| self.x16(e)).sum();
        let s1: i32 = (16..32).map(|e| self.x16(e)).sum();
        self.finish_sums(d2, s0, s1);
    }

    /// Fills the scale and sums from the code sums of each half (shared by both quantizers,
    /// so the same integers give the same bits).
    fn finish_sums(&mut self, d2: f32, s0: i32, s1: i32) {
        // SAFETY: `self` is a live block; writing its fields initializes nothing new.
        unsafe { Self::write_sums(self, d2, s0, s1) }
    }

    /// [`BlockA32::finish_sums`] on a block being built in place, field by field.
    ///
    /// # Safety
    /// `b` must be valid for writes and aligned.
    #[inline(always)]
    unsafe fn write_sums(b: *mut Self, d2: f32, s0: i32, s1: i32) {
        unsafe {
            (&raw mut (*b).d).write(d2);
            (&raw mut (*b).neg16x32).write([-32.0 * d2 * s0 as f32, -32.0 * d2 * s1 as f32]);
            (&raw mut (*b).neg32).write(-d2 * (s0 + s1) as f32);
            (&raw mut (*b).sum).write(s0 + s1);
        }
    }

    /// Two-level quantization of 32 values: `q1 = round(x / d1)` with `d1 = max|x| / 127`, then
    /// the residual in steps of `d1 / 128` (at most half a `d1` step, so `|q2| ≤ 64`). A NaN
    /// gets code 0 and is left out of the maximum.
    ///
    /// # Panics
    /// If `x` holds fewer than 32 values ([`BlockA32::quantize_fast`] pads them instead).
    pub fn quantize(x: &[f32]) -> Self {
        let mut b = Self::zero();
        let x = &x[..QK];
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        if !Self::quantizable(amax) {
            return b;
        }
        let d1 = amax / 127.0;
        let d2 = d1 / 128.0;
        let (i1, i2) = (1.0 / d1, 1.0 / d2);
        for e in 0..QK {
            let q1 = round_even(x[e] * i1).clamp(-127.0, 127.0);
            let r = x[e] - q1 * d1;
            b.q1[e] = q1 as i8;
            b.q2[e] = round_even(r * i2).clamp(-127.0, 127.0) as i8;
        }
        b.finish(d2);
        b
    }

    /// Whether a block of this max |x| gets codes: below ~5e-35 the inverse step overflows
    /// (0·∞ is NaN, which the SIMD clamps and the scalar cast would treat differently), so
    /// every path gives such blocks, as all-zero and non-finite ones, no codes.
    #[inline]
    fn quantizable(amax: f32) -> bool {
        let d1 = amax / 127.0;
        amax != 0.0 && amax.is_finite() && (1.0 / (d1 / 128.0)).is_finite()
    }

    pub(crate) fn zero() -> Self {
        BlockA32 {
            q1: [0; QK],
            q2: [0; QK],
            d: 0.0,
            neg32: 0.0,
            neg16x32: [0.0; 2],
            sum: 0,
        }
    }
}

/// A batch of activations ready for the kernels: `cols / 32` blocks per token, and per token
/// the outliers split off them as `(column, value)` (non-finite values among them, so that
/// they reach the outputs).
pub struct QuantRows {
    pub blocks: Vec<BlockA32>,
    pub outliers: Vec<Vec<(usize, f32)>>,
}

/// Quantizes the blocks of 32 of `x` into `out`, with the SIMD of `isa` where it has some
/// (and this CPU too): the same bits on every path. Every block of `out` is written (those
/// past the end of `x` as zeros), and returned initialized.
///
/// The blocks are built where they stay, field by field. Built on the stack and copied out,
/// each cost a store-forwarding stall (16-byte loads over its 4-byte scale stores); and a
/// zeroed buffer that another core fills moves every line between the cores twice.
pub fn quantize_into<'a>(
    x: &[f32],
    isa: Isa,
    out: &'a mut [MaybeUninit<BlockA32>],
) -> &'a mut [BlockA32] {
    let n = out.len().min(x.len() / QK);
    let (head, tail) = out.split_at_mut(n);
    for b in tail {
        b.write(BlockA32::zero());
    }
    fill_blocks(&x[..n * QK], isa, head);
    // SAFETY: every block of `out` was written above (the SIMD rows write each of theirs).
    unsafe { &mut *(out as *mut [MaybeUninit<BlockA32>] as *mut [BlockA32]) }
}

/// Writes every block of `out` from the 32 values each of `x` (which holds exactly those).
fn fill_blocks(x: &[f32], isa: Isa, out: &mut [MaybeUninit<BlockA32>]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_supported() {
        match isa {
            // SAFETY: `is_supported` checked this CPU has the ISA's features; `x` holds 32
            // values per block of `out`.
            Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { x86::quantize_row(x, out) },
            Isa::Avx2 | Isa::Avx2Vnni => return unsafe { avx2::quantize_row(x, out) },
            Isa::Scalar | Isa::Neon | Isa::NeonDot => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if matches!(isa, Isa::Neon | Isa::NeonDot) && isa.is_supported() {
        for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
            // SAFETY: `is_supported` checked this CPU has NEON; `xb` holds 32 values.
            b.write(unsafe { neon::quantize(xb) });
        }
        return;
    }
    let _ = isa;
    for (xb, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        b.write(BlockA32::quantize(xb));
    }
}

/// Where [`quantize_rows`] writes a row's blocks from the parallel loop.
struct BlocksPtr(*mut BlockA32);
// SAFETY: each index of the loop writes only its own row's `cols / 32` blocks.
unsafe impl Send for BlocksPtr {}
unsafe impl Sync for BlocksPtr {}

/// Blocks from which [`quantize_rows`] quantizes on the forward's threads (split by rows):
/// below, a parallel loop's hand-over and the lines it moves between cores cost more than
/// the ~20 ns a block it saves (`cargo run --release -p kernels --example opsbench`).
const PAR_BLOCKS: usize = 256;

/// Quantizes `m` rows of `cols` activations (cols a multiple of 32), with the SIMD of `isa`
/// (the same bits on every path), rows in parallel from [`PAR_BLOCKS`] blocks.
pub fn quantize_rows(x: &[f32], m: usize, cols: usize, isa: Isa) -> QuantRows {
    let nblk = cols / QK;
    let total = m * nblk;
    let mut blocks: Vec<BlockA32> = Vec::with_capacity(total);
    let rows = &x[..m * cols];
    let tasks = crate::par::threads().min(m);
    let outliers = if nblk == 0 {
        vec![Vec::new(); m]
    } else if m * nblk >= PAR_BLOCKS && m > 1 && tasks > 1 {
        // One run of consecutive rows per thread: a claim costs about 0.1 µs.
        let per = m.div_ceil(tasks);
        let dst = BlocksPtr(blocks.spare_capacity_mut().as_mut_ptr().cast());
        let runs = crate::par::map(m.div_ceil(per), |t| {
            let dst = &dst;
            let (r0, r1) = (t * per, ((t + 1) * per).min(m));
            // SAFETY: the capacity holds m · nblk blocks and outlives the loop; index t
            // writes only the blocks of rows r0..r1, which no other index touches.
            let out = unsafe {
                std::slice::from_raw_parts_mut(
                    dst.0.add(r0 * nblk).cast::<MaybeUninit<BlockA32>>(),
                    (r1 - r0) * nblk,
                )
            };
            rows[r0 * cols..r1 * cols]
                .chunks_exact(cols)
                .zip(out.chunks_exact_mut(nblk))
                .map(|(row, out)| quantize_row(row, isa, out))
                .collect::<Vec<_>>()
        });
        runs.into_iter().flatten().collect()
    } else {
        rows.chunks_exact(cols)
            .zip(blocks.spare_capacity_mut().chunks_exact_mut(nblk))
            .map(|(row, out)| quantize_row(row, isa, out))
            .collect()
    };
    // SAFETY: the loops above wrote all m · nblk blocks (each row's `quantize_into` writes
    // every block of its slice, and the rows tile the capacity); a panic in them leaves the
    // length at 0.
    unsafe { blocks.set_len(total) };
    QuantRows { blocks, outliers }
}

/// One row of [`quantize_rows`]: its blocks into `out`, and its outliers.
///
/// Non-finite activations are split off as outliers too, whatever their size: a block
/// quantizer has no code for them (a NaN gets code 0, an infinity leaves its block without
/// codes), and through the f32 half of the product they reach the row's outputs as they would
/// through an f32 dot (±∞ or NaN) instead of vanishing.
fn quantize_row(row: &[f32], isa: Isa, out: &mut [MaybeUninit<BlockA32>]) -> Vec<(usize, f32)> {
    let mut o = Vec::new();
    // A row is copied only to split values off (none of the default models has any). Every
    // span is scanned, so a non-finite value after an outlier is still seen.
    let mut split = false;
    for span in row.chunks(QKK) {
        split |= !matches!(scan_span(span, isa), Span::Plain);
    }
    if split {
        let mut rest = row.to_vec();
        for (c, span) in rest.chunks_mut(QKK).enumerate() {
            split_outliers(span, c * QKK, isa, &mut o);
        }
        quantize_into(&rest, isa, out);
    } else {
        quantize_into(row, isa, out);
    }
    o
}

/// Partial sums (and maxima) of [`scan_span`]: independent enough that the adds of a
/// 256-value span are not one chain of 32 (eight lanes left it latency-bound, a quarter of a
/// row's quantization).
const OUTLIER_LANES: usize = 32;

/// What [`scan_span`] finds in a span of activations.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Span {
    /// Nothing to split off.
    Plain,
    /// Values above this threshold ([`OUTLIER_RATIO`] × the span's mean |x|).
    Outliers(f32),
    /// A NaN or an infinity (all of them are split off, whatever else the span holds).
    NonFinite,
}

/// Whether a span has values to split off: the same answer on every path (the same function,
/// with the SIMD of `isa` where this CPU has it).
fn scan_span(span: &[f32], isa: Isa) -> Span {
    #[cfg(target_arch = "x86_64")]
    if isa.is_supported() {
        match isa {
            // SAFETY: `is_supported` checked this CPU has the features.
            Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { scan_span_avx512(span) },
            Isa::Avx2 | Isa::Avx2Vnni => return unsafe { scan_span_avx2(span) },
            Isa::Scalar | Isa::Neon | Isa::NeonDot => {}
        }
    }
    let _ = isa;
    scan_span_body(span)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scan_span_avx512(span: &[f32]) -> Span {
    scan_span_body(span)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scan_span_avx2(span: &[f32]) -> Span {
    scan_span_body(span)
}

#[inline(always)]
fn scan_span_body(span: &[f32]) -> Span {
    // Fixed partial sums (vectorizable, and the same bits on every path: Rust neither
    // reassociates nor fuses float arithmetic) and the largest |x| per lane: one pass, with
    // no early exit to keep it from vectorizing.
    let (mut part, mut top) = ([0f32; OUTLIER_LANES], [0f32; OUTLIER_LANES]);
    let chunks = span.chunks_exact(OUTLIER_LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for ((p, t), v) in part.iter_mut().zip(top.iter_mut()).zip(c) {
            let a = v.abs();
            *p += a;
            *t = t.max(a);
        }
    }
    for ((p, t), v) in part.iter_mut().zip(top.iter_mut()).zip(tail) {
        let a = v.abs();
        *p += a;
        *t = t.max(a);
    }
    let mean = part.iter().sum::<f32>() / span.len() as f32;
    let thr = OUTLIER_RATIO * mean;
    if !thr.is_finite() {
        // A NaN or an infinity makes the mean, and so the threshold, non-finite; so can a sum
        // of huge finite values, which the exact check (off the finite path) tells apart.
        return if span.iter().any(|v| !v.is_finite()) {
            Span::NonFinite
        } else {
            Span::Plain
        };
    }
    if top.iter().any(|&t| t > thr) {
        Span::Outliers(thr)
    } else {
        Span::Plain
    }
}

/// Moves from `span` to `out` its non-finite values, or else those above [`OUTLIER_RATIO`] ×
/// its mean |x| (at most [`MAX_OUTLIERS`], the largest).
fn split_outliers(span: &mut [f32], base: usize, isa: Isa, out: &mut Vec<(usize, f32)>) {
    let big: Vec<usize> = match scan_span(span, isa) {
        Span::Plain => return,
        Span::NonFinite => (0..span.len()).filter(|&e| !span[e].is_finite()).collect(),
        Span::Outliers(thr) => {
            let mut big: Vec<usize> = (0..span.len()).filter(|&e| span[e].abs() > thr).collect();
            big.sort_by(|&a, &b| span[b].abs().total_cmp(&span[a].abs()).then(a.cmp(&b)));
            big.truncate(MAX_OUTLIERS);
            big.sort_unstable();
            big
        }
    };
    for e in big {
        out.push((base + e, span[e]));
        span[e] = 0.0;
    }
}

/// Byte `4r + i` of the four 64-byte vectors of a 32-element 4-bit sub-block: element
/// `8g + i` in the low nibble, `8g + 4 + i` in the high one.
#[inline]
fn nibble_of(qs: &[u8; 256], r: usize, l: usize) -> u8 {
    let (g, k) = (l / 8, l % 8);
    let byte = qs[64 * g + 4 * r + k % 4];
    if k < 4 { byte & 0x0f } else { byte >> 4 }
}

fn pack_nibbles(qs: &mut [u8; 256], r: usize, code: impl Fn(usize) -> u8) {
    for g in 0..4 {
        for i in 0..4 {
            let e = 8 * g + i;
            qs[64 * g + 4 * r + i] = (code(e) & 0x0f) | ((code(e + 4) & 0x0f) << 4);
        }
    }
}

impl Q4KGroup {
    /// The 4-bit code of element `e` of row `r`.
    #[inline]
    pub fn code(&self, r: usize, e: usize) -> u8 {
        nibble_of(&self.qs[e / 32], r, e % 32)
    }
    /// Element `e` of row `r`, exactly as ggml's dequantizer gives it: `(d·sc)·q − dmin·m`.
    #[inline]
    pub fn element(&self, r: usize, e: usize) -> f32 {
        let (scf, mnf) = self.sub(r, e / 32);
        scf * self.code(r, e) as f32 - mnf
    }
    /// Row `r`'s scale and min of sub-block `j` as the kernels form them.
    #[inline]
    fn sub(&self, r: usize, j: usize) -> (f32, f32) {
        (
            self.d[r] * self.sc[j][r] as f32,
            self.dmin[r] * self.mn[j][r] as f32,
        )
    }
}

impl Q6KGroup {
    /// The 6-bit code of element `e` of row `r`.
    #[inline]
    pub fn code(&self, r: usize, e: usize) -> u8 {
        let (g, l) = (e / 16, e % 16);
        let (h, k) = (l / 8, l % 8);
        let byte = self.q[g][64 * h + 4 * r + k % 4];
        let lo = if k < 4 { byte & 0x0f } else { byte >> 4 };
        let hi = (self.q[g][128 + 4 * r + l % 4] >> (2 * (l / 4))) & 3;
        lo | (hi << 4)
    }
    /// Element `e` of row `r`, exactly as ggml's dequantizer gives it: `(d·sc)·(q − 32)`.
    #[inline]
    pub fn element(&self, r: usize, e: usize) -> f32 {
        self.d[r] * self.sc[e / 16][r] as f32 * (self.code(r, e) as i32 - 32) as f32
    }
}

impl Q41Group {
    #[inline]
    pub fn code(&self, r: usize, e: usize) -> u8 {
        nibble_of(&self.qs, r, e)
    }
    /// Element `e` of row `r`, as [`crate::quant::BlockQ4`] decodes it: `d·q + m`.
    #[inline]
    pub fn element(&self, r: usize, e: usize) -> f32 {
        self.d[r].to_f32() * self.code(r, e) as f32 + self.m[r].to_f32()
    }
}

impl Q50Group {
    /// The 5-bit code of element `e` of row `r`.
    #[inline]
    pub fn code(&self, r: usize, e: usize) -> u8 {
        nibble_of(&self.qs, r, e) | (((self.qh[4 * r + e % 4] >> (e / 4)) & 1) << 4)
    }
    /// Element `e` of row `r`, as ggml decodes it: `d·(q − 16)`.
    #[inline]
    pub fn element(&self, r: usize, e: usize) -> f32 {
        self.d[r].to_f32() * (self.code(r, e) as i32 - 16) as f32
    }
}

impl Q80Group {
    /// The stored (offset) code of element `e` of row `r`: `q + 128`.
    #[inline]
    pub fn code(&self, r: usize, e: usize) -> u8 {
        self.qs[64 * (e / 4) + 4 * r + e % 4]
    }
    /// Element `e` of row `r`, as ggml decodes it: `d·q`.
    #[inline]
    pub fn element(&self, r: usize, e: usize) -> f32 {
        self.d[r].to_f32() * (self.code(r, e) as i32 - 128) as f32
    }
}

fn f16_at(b: &[u8], off: usize) -> f16 {
    f16::from_le_bytes([b[off], b[off + 1]])
}

/// Elements per block of the types with a grouped layout (`None` for the others).
fn group_block(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => Some(QKK),
        GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => Some(QK),
        _ => None,
    }
}

/// Whether a `rows × cols` matrix of this type can take the grouped layout.
pub fn fits(ty: GgmlType, rows: usize, cols: usize) -> bool {
    group_block(ty).is_some_and(|be| rows.is_multiple_of(GROUP_ROWS) && cols.is_multiple_of(be))
}

/// Which grouped kernels run on an ISA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedKernels {
    /// AVX-512 with VNNI: `vpdpbusd` over 16 rows.
    Vnni,
    /// AVX2 (with FMA and F16C): `vpmaddubsw` over 8 rows at a time (`grouped_avx2.rs`).
    Avx2,
    /// The AVX2 kernels with AVX-VNNI's `vpdpbusd` on ymm in place of `vpmaddubsw`.
    AvxVnni,
    /// NEON: `smull`/`smlal` over 4 rows at a time (`grouped_neon.rs`).
    Neon,
    /// The NEON kernels with the dot-product extension's `sdot` in place of the widening pairs.
    NeonDot,
}

impl GroupedKernels {
    /// The kernels for `isa` on this CPU, if any: VNNI where AVX-512 has it, the AVX2 twins with
    /// AVX-VNNI for [`Isa::Avx2Vnni`], else the plain AVX2 twins.
    pub fn for_isa(isa: Isa) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            // An `Isa` built by hand for features this CPU lacks gets the references, never an
            // instruction it cannot run (the kernels below are chosen from this).
            if !isa.is_supported() {
                return None;
            }
            if matches!(isa, Isa::Avx512 | Isa::Avx512Bf16)
                && is_x86_feature_detected!("avx512vnni")
            {
                return Some(Self::Vnni);
            }
            if isa == Isa::Avx2Vnni && is_x86_feature_detected!("avxvnni") {
                return Some(Self::AvxVnni);
            }
            // `Isa::Avx2` and up imply AVX2, FMA and F16C (`Isa::is_supported`).
            (isa != Isa::Scalar).then_some(Self::Avx2)
        }
        #[cfg(target_arch = "aarch64")]
        {
            match isa {
                Isa::NeonDot if isa.is_supported() => Some(Self::NeonDot),
                Isa::Neon if isa.is_supported() => Some(Self::Neon),
                _ => None,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            let _ = isa;
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Vnni => "avx512-vnni",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
            Self::Neon => "neon",
            Self::NeonDot => "neon-dotprod",
        }
    }
}

/// Whether grouped kernels run on this ISA ([`GroupedKernels::for_isa`]). Elsewhere the weights
/// take the 32-element formats of [`crate::quant`] and the f32 kernels.
pub fn native(isa: Isa) -> bool {
    GroupedKernels::for_isa(isa).is_some()
}

/// Checks a raw tensor of `rows × cols` and returns its blocks per row.
fn check_shape(ty: GgmlType, raw: &[u8], rows: usize, cols: usize) -> Result<usize, KernelError> {
    if !fits(ty, rows, cols) {
        return Err(KernelError::Shape(format!(
            "{} matrix {rows}x{cols} does not fit the grouped layout (rows a multiple of \
             {GROUP_ROWS}, cols a multiple of the block)",
            ty.name()
        )));
    }
    let nb = cols / ty.block_elems();
    // Checked: the shape comes from a file header, and a wrapped product could match `raw`.
    let need = rows
        .checked_mul(nb)
        .and_then(|v| v.checked_mul(ty.block_bytes()))
        .ok_or_else(|| {
            KernelError::Shape(format!(
                "{} matrix {rows}x{cols} overflows its byte size",
                ty.name()
            ))
        })?;
    if raw.len() != need {
        return Err(KernelError::Shape(format!(
            "{} matrix {rows}x{cols} needs {need} bytes, got {}",
            ty.name(),
            raw.len()
        )));
    }
    Ok(nb)
}

/// Calls `f(group, row in group, raw block)` for every block, groups ordered
/// `[row group][block]`.
fn for_blocks<G>(
    ty: GgmlType,
    raw: &[u8],
    rows: usize,
    cols: usize,
    empty: impl Fn() -> G,
    f: impl Fn(&mut G, usize, &[u8]),
) -> Result<Vec<G>, KernelError> {
    let nb = check_shape(ty, raw, rows, cols)?;
    let bb = ty.block_bytes();
    let mut out = Vec::with_capacity(rows / GROUP_ROWS * nb);
    for rg in 0..rows / GROUP_ROWS {
        for b in 0..nb {
            let mut g = empty();
            for r in 0..GROUP_ROWS {
                let off = ((rg * GROUP_ROWS + r) * nb + b) * bb;
                f(&mut g, r, &raw[off..off + bb]);
            }
            out.push(g);
        }
    }
    Ok(out)
}

/// Raw GGUF Q4_K bytes of a `rows × cols` matrix → groups.
pub fn repack_q4k(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<Q4KGroup>, KernelError> {
    let empty = || Q4KGroup {
        d: [0.0; GROUP_ROWS],
        dmin: [0.0; GROUP_ROWS],
        sc: [[0; GROUP_ROWS]; 8],
        mn: [[0; GROUP_ROWS]; 8],
        qs: [[0; 256]; 8],
    };
    for_blocks(GgmlType::Q4K, raw, rows, cols, empty, |g, r, blk| {
        g.d[r] = f16_at(blk, 0).to_f32();
        g.dmin[r] = f16_at(blk, 2).to_f32();
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &blk[4..16]);
            g.sc[j][r] = s;
            g.mn[j][r] = m;
        }
        // GGML: element 64c + l (l < 32) is the low nibble of qs[32c + l], element 64c + 32 + l
        // its high nibble.
        let q = &blk[16..144];
        let code = |e: usize| {
            let (c, l) = (e / 64, e % 64);
            if l < 32 {
                q[32 * c + l] & 0x0f
            } else {
                q[32 * c + l - 32] >> 4
            }
        };
        for j in 0..8 {
            pack_nibbles(&mut g.qs[j], r, |l| code(32 * j + l));
        }
    })
}

/// Raw GGUF Q6_K bytes of a `rows × cols` matrix → groups.
pub fn repack_q6k(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<Q6KGroup>, KernelError> {
    let empty = || Q6KGroup {
        d: [0.0; GROUP_ROWS],
        sc: [[0; GROUP_ROWS]; 16],
        q: [[0; 192]; 16],
    };
    for_blocks(GgmlType::Q6K, raw, rows, cols, empty, |g, r, blk| {
        let (ql_all, qh_all, sc_all) = (&blk[0..128], &blk[128..192], &blk[192..208]);
        g.d[r] = f16_at(blk, 208).to_f32();
        // GGML: element 128h + 32k + l takes ql[64h + l (+32 for k odd)] (low nibble for k < 2)
        // and bits 2k..2k+2 of qh[32h + l]; scale sc[e / 16].
        let mut v = [0u8; QKK];
        for h in 0..2 {
            let (ql, qh) = (&ql_all[64 * h..], &qh_all[32 * h..]);
            for l in 0..32 {
                v[128 * h + l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                v[128 * h + 32 + l] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                v[128 * h + 64 + l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                v[128 * h + 96 + l] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        for gg in 0..16 {
            g.sc[gg][r] = sc_all[gg] as i8;
            let c = &v[16 * gg..16 * gg + 16];
            for h in 0..2 {
                for i in 0..4 {
                    g.q[gg][64 * h + 4 * r + i] =
                        (c[8 * h + i] & 0x0f) | ((c[8 * h + 4 + i] & 0x0f) << 4);
                }
            }
            for i in 0..4 {
                let mut hb = 0u8;
                for k in 0..4 {
                    hb |= ((c[4 * k + i] >> 4) & 3) << (2 * k);
                }
                g.q[gg][128 + 4 * r + i] = hb;
            }
        }
    })
}

/// Raw GGUF Q4_1 bytes of a `rows × cols` matrix → groups.
pub fn repack_q41(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<Q41Group>, KernelError> {
    let empty = || Q41Group {
        d: [f16::ZERO; GROUP_ROWS],
        m: [f16::ZERO; GROUP_ROWS],
        qs: [0; 256],
    };
    for_blocks(GgmlType::Q4_1, raw, rows, cols, empty, |g, r, blk| {
        g.d[r] = f16_at(blk, 0);
        g.m[r] = f16_at(blk, 2);
        // GGML: element i < 16 is the low nibble of qs[i], element i >= 16 the high nibble of
        // qs[i - 16].
        let q = &blk[4..20];
        pack_nibbles(&mut g.qs, r, |e| {
            if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 }
        });
    })
}

/// Raw GGUF Q5_0 bytes of a `rows × cols` matrix → groups.
pub fn repack_q50(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<Q50Group>, KernelError> {
    let empty = || Q50Group {
        d: [f16::ZERO; GROUP_ROWS],
        qs: [0; 256],
        qh: [0; 64],
    };
    for_blocks(GgmlType::Q5_0, raw, rows, cols, empty, |g, r, blk| {
        g.d[r] = f16_at(blk, 0);
        // GGML: element j < 16 is the low nibble of qs[j] with bit j of qh as its fifth bit;
        // element j + 16 the high nibble with bit j + 16.
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let q = &blk[6..22];
        let code = |e: usize| {
            let lo = if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 };
            lo | ((((qh >> e) & 1) as u8) << 4)
        };
        pack_nibbles(&mut g.qs, r, code);
        for i in 0..4 {
            let mut hb = 0u8;
            for k in 0..8 {
                hb |= (code(4 * k + i) >> 4) << k;
            }
            g.qh[4 * r + i] = hb;
        }
    })
}

/// Raw GGUF Q8_0 bytes of a `rows × cols` matrix → groups.
pub fn repack_q80(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<Q80Group>, KernelError> {
    let empty = || Q80Group {
        d: [f16::ZERO; GROUP_ROWS],
        qs: [0; 512],
    };
    for_blocks(GgmlType::Q8_0, raw, rows, cols, empty, |g, r, blk| {
        g.d[r] = f16_at(blk, 0);
        for e in 0..QK {
            g.qs[64 * (e / 4) + 4 * r + e % 4] = (blk[2 + e] as i8 as i16 + 128) as u8;
        }
    })
}

/// `Σ w(e)·x` over a token's outliers, in their order (the f32 half of the split product).
#[inline]
pub(crate) fn outlier_sum(o: &[(usize, f32)], w: impl Fn(usize) -> f32) -> f32 {
    let mut acc = 0f32;
    for &(e, x) in o {
        acc += w(e) * x;
    }
    acc
}

/// One sub-block's term as every path forms it: `(scf·d)·S + mnf·neg`, in f64 here.
#[inline]
fn term(scf: f32, mnf: f32, a: &BlockA32, s: i64, neg: f32) -> f64 {
    (scf * a.d) as f64 * s as f64 + mnf as f64 * neg as f64
}

/// Exact references of one row `r` of a row group against one token's blocks `x`: integer
/// sums per sub-block, the scale products in f32 as the kernels form them, summed in f64.
pub(crate) fn ref_q4k(groups: &[Q4KGroup], r: usize, x: &[BlockA32]) -> f32 {
    let mut acc = 0f64;
    for (b, g) in groups.iter().enumerate() {
        for j in 0..8 {
            let a = &x[8 * b + j];
            let s: i64 = (0..32)
                .map(|l| g.code(r, 32 * j + l) as i64 * a.x16(l) as i64)
                .sum();
            let (scf, mnf) = g.sub(r, j);
            acc += term(scf, mnf, a, s, a.neg32);
        }
    }
    acc as f32
}

pub(crate) fn ref_q6k(groups: &[Q6KGroup], r: usize, x: &[BlockA32]) -> f32 {
    let mut acc = 0f64;
    for (b, g) in groups.iter().enumerate() {
        for gg in 0..16 {
            let (a, h) = (&x[8 * b + gg / 2], gg % 2);
            let s: i64 = (0..16)
                .map(|l| g.code(r, 16 * gg + l) as i64 * a.x16(16 * h + l) as i64)
                .sum();
            let scf = g.d[r] * g.sc[gg][r] as f32;
            acc += term(scf, scf, a, s, a.neg16x32[h]);
        }
    }
    acc as f32
}

pub(crate) fn ref_q41(groups: &[Q41Group], r: usize, x: &[BlockA32]) -> f32 {
    let mut acc = 0f64;
    for (g, a) in groups.iter().zip(x) {
        let s: i64 = (0..32).map(|e| g.code(r, e) as i64 * a.x16(e) as i64).sum();
        acc += term(g.d[r].to_f32(), -g.m[r].to_f32(), a, s, a.neg32);
    }
    acc as f32
}

pub(crate) fn ref_q50(groups: &[Q50Group], r: usize, x: &[BlockA32]) -> f32 {
    let mut acc = 0f64;
    for (g, a) in groups.iter().zip(x) {
        let s: i64 = (0..32).map(|e| g.code(r, e) as i64 * a.x16(e) as i64).sum();
        let d = g.d[r].to_f32();
        acc += term(d, 16.0 * d, a, s, a.neg32);
    }
    acc as f32
}

pub(crate) fn ref_q80(groups: &[Q80Group], r: usize, x: &[BlockA32]) -> f32 {
    let mut acc = 0f64;
    for (g, a) in groups.iter().zip(x) {
        let s: i64 = (0..32).map(|e| g.code(r, e) as i64 * a.x16(e) as i64).sum();
        let d = g.d[r].to_f32();
        acc += term(d, 128.0 * d, a, s, a.neg32);
    }
    acc as f32
}

/// One sub-block's float steps as every kernel takes them: `acc + (scf·d)·S`, then `+ mnf·neg`,
/// each a fused multiply-add (one rounding), `S` converted to f32 with round-to-nearest-even.
#[inline]
fn step(acc: f32, scf: f32, mnf: f32, a: &BlockA32, s: i32, neg: f32) -> f32 {
    let acc = (s as f32).mul_add(scf * a.d, acc);
    mnf.mul_add(neg, acc)
}

/// The kernels' arithmetic in portable code, row `r` of a row group against one token's blocks
/// `x`: the exact integer sums of the references, then [`step`] per sub-block in order. Every
/// SIMD path (AVX-512 VNNI, AVX2, AVX-VNNI, NEON, NEON dot product) gives these bits, so a model
/// computes the same numbers on x86 and Arm; CPUs without grouped kernels run this.
pub(crate) mod mirror {
    use super::*;

    /// `Σ code(e)·x16(e)` over `n` elements from `e0` (activations from `a0`): below 2³¹ for
    /// every type (Q8_0's offset codes: 32·255·16383).
    #[inline]
    fn isum(code: impl Fn(usize) -> u8, e0: usize, a: &BlockA32, a0: usize, n: usize) -> i32 {
        (0..n).map(|l| code(e0 + l) as i32 * a.x16(a0 + l)).sum()
    }

    pub(crate) fn q4k(groups: &[Q4KGroup], r: usize, x: &[BlockA32]) -> f32 {
        let mut acc = 0f32;
        for (b, g) in groups.iter().enumerate() {
            for j in 0..8 {
                let a = &x[8 * b + j];
                let s = isum(|e| g.code(r, e), 32 * j, a, 0, 32);
                let (scf, mnf) = g.sub(r, j);
                acc = step(acc, scf, mnf, a, s, a.neg32);
            }
        }
        acc
    }

    pub(crate) fn q6k(groups: &[Q6KGroup], r: usize, x: &[BlockA32]) -> f32 {
        let mut acc = 0f32;
        for (b, g) in groups.iter().enumerate() {
            for gg in 0..16 {
                let (a, h) = (&x[8 * b + gg / 2], gg % 2);
                let s = isum(|e| g.code(r, e), 16 * gg, a, 16 * h, 16);
                let scf = g.d[r] * g.sc[gg][r] as f32;
                acc = step(acc, scf, scf, a, s, a.neg16x32[h]);
            }
        }
        acc
    }

    pub(crate) fn q41(groups: &[Q41Group], r: usize, x: &[BlockA32]) -> f32 {
        let mut acc = 0f32;
        for (g, a) in groups.iter().zip(x) {
            let s = isum(|e| g.code(r, e), 0, a, 0, 32);
            let mnf = 0.0 - g.m[r].to_f32();
            acc = step(acc, g.d[r].to_f32(), mnf, a, s, a.neg32);
        }
        acc
    }

    pub(crate) fn q50(groups: &[Q50Group], r: usize, x: &[BlockA32]) -> f32 {
        let mut acc = 0f32;
        for (g, a) in groups.iter().zip(x) {
            let s = isum(|e| g.code(r, e), 0, a, 0, 32);
            let d = g.d[r].to_f32();
            acc = step(acc, d, d * 16.0, a, s, a.neg32);
        }
        acc
    }

    pub(crate) fn q80(groups: &[Q80Group], r: usize, x: &[BlockA32]) -> f32 {
        let mut acc = 0f32;
        for (g, a) in groups.iter().zip(x) {
            let s = isum(|e| g.code(r, e), 0, a, 0, 32);
            let d = g.d[r].to_f32();
            acc = step(acc, d, d * 128.0, a, s, a.neg32);
        }
        acc
    }
}

/// The grouped weight formats, for the generic dispatch below.
pub(crate) trait Group: Sized {
    fn reference(groups: &[Self], r: usize, x: &[BlockA32]) -> f32;
    /// [`mirror`]: the kernels' bits in portable code.
    fn mirror(groups: &[Self], r: usize, x: &[BlockA32]) -> f32;
    /// Element `e` (column within the row) of row `r` of a row group's blocks.
    fn element_of(groups: &[Self], r: usize, e: usize) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL and VNNI ([`GroupedKernels::Vnni`]).
    unsafe fn simd(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile);
    #[cfg(target_arch = "x86_64")]
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C ([`GroupedKernels::Avx2`]).
    unsafe fn avx2(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile);
    #[cfg(target_arch = "x86_64")]
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-VNNI ([`GroupedKernels::AvxVnni`]).
    unsafe fn avx_vnni(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile);
    #[cfg(target_arch = "aarch64")]
    /// # Safety
    /// The CPU must have NEON ([`GroupedKernels::Neon`]; every 64-bit Arm CPU).
    unsafe fn neon(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile);
    #[cfg(target_arch = "aarch64")]
    /// # Safety
    /// The CPU must have NEON and the dot-product extension ([`GroupedKernels::NeonDot`]).
    unsafe fn neon_dot(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile);
}

/// Results of one row group for a tile of tokens: `out[t][r]`.
pub(crate) type Tile = [[f32; GROUP_ROWS]; MAX_TILE];

macro_rules! group_impl {
    ($g:ty, $refn:ident, $mirror:ident, $simd:ident, $vnni:ident, $dot:ident, $elems:expr) => {
        impl Group for $g {
            fn reference(groups: &[Self], r: usize, x: &[BlockA32]) -> f32 {
                $refn(groups, r, x)
            }
            fn mirror(groups: &[Self], r: usize, x: &[BlockA32]) -> f32 {
                mirror::$mirror(groups, r, x)
            }
            #[inline]
            fn element_of(groups: &[Self], r: usize, e: usize) -> f32 {
                groups[e / $elems].element(r, e % $elems)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn simd(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile) {
                // SAFETY: the caller checked the CPU features.
                unsafe { x86::$simd(groups, x, tn, out) }
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn avx2(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile) {
                // SAFETY: the caller checked the CPU features.
                unsafe { avx2::$simd(groups, x, tn, out) }
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn avx_vnni(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile) {
                // SAFETY: the caller checked the CPU features.
                unsafe { avx2::$vnni(groups, x, tn, out) }
            }
            #[cfg(target_arch = "aarch64")]
            unsafe fn neon(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile) {
                // SAFETY: the caller checked the CPU features.
                unsafe { neon::$simd(groups, x, tn, out) }
            }
            #[cfg(target_arch = "aarch64")]
            unsafe fn neon_dot(groups: &[Self], x: &[BlockA32], tn: usize, out: &mut Tile) {
                // SAFETY: the caller checked the CPU features.
                unsafe { neon::$dot(groups, x, tn, out) }
            }
        }
    };
}
group_impl!(
    Q4KGroup,
    ref_q4k,
    q4k,
    dispatch_q4k,
    dispatch_q4k_vnni,
    dispatch_q4k_dot,
    QKK
);
group_impl!(
    Q6KGroup,
    ref_q6k,
    q6k,
    dispatch_q6k,
    dispatch_q6k_vnni,
    dispatch_q6k_dot,
    QKK
);
group_impl!(
    Q41Group,
    ref_q41,
    q41,
    dispatch_q41,
    dispatch_q41_vnni,
    dispatch_q41_dot,
    QK
);
group_impl!(
    Q50Group,
    ref_q50,
    q50,
    dispatch_q50,
    dispatch_q50_vnni,
    dispatch_q50_dot,
    QK
);
group_impl!(
    Q80Group,
    ref_q80,
    q80,
    dispatch_q80,
    dispatch_q80_vnni,
    dispatch_q80_dot,
    QK
);

/// One row group's dot products with `tn` tokens into `out[..tn]`. `x` holds the tile's tokens
/// one after another, `cols / 32` blocks each.
pub(crate) fn dot<G: Group>(isa: Isa, groups: &[G], x: &[BlockA32], tn: usize, out: &mut Tile) {
    #[cfg(target_arch = "x86_64")]
    match GroupedKernels::for_isa(isa) {
        // SAFETY: `for_isa` checked the CPU features each set of kernels is compiled for.
        Some(GroupedKernels::Vnni) => return unsafe { G::simd(groups, x, tn, out) },
        Some(GroupedKernels::Avx2) => return unsafe { G::avx2(groups, x, tn, out) },
        Some(GroupedKernels::AvxVnni) => return unsafe { G::avx_vnni(groups, x, tn, out) },
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    match GroupedKernels::for_isa(isa) {
        // SAFETY: `for_isa` checked the CPU features each set of kernels is compiled for.
        Some(GroupedKernels::Neon) => return unsafe { G::neon(groups, x, tn, out) },
        Some(GroupedKernels::NeonDot) => return unsafe { G::neon_dot(groups, x, tn, out) },
        _ => {}
    }
    let _ = isa;
    let per = x.len() / tn.max(1);
    for (t, o) in out.iter_mut().enumerate().take(tn) {
        for (r, v) in o.iter_mut().enumerate() {
            *v = G::mirror(groups, r, &x[t * per..(t + 1) * per]);
        }
    }
}

/// The entry point of a set of twin kernels that keep at most `$tile` tokens in registers
/// (`$f::<TN, $x>`, `$x` choosing the instruction variant): a tile of `tn` tokens runs as
/// passes of at most `$tile`, each token with the same instructions.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! tile_passes {
    ($name:ident, $features:literal, $f:ident, $x:tt, $w:ty, $tile:ident) => {
        /// # Safety
        /// The CPU must have the features enabled here.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name(w: &[$w], x: &[BlockA32], tn: usize, out: &mut Tile) {
            const _: () = assert!($tile == 4);
            let per = x.len() / tn.max(1);
            let mut t0 = 0;
            while t0 < tn {
                let n = (tn - t0).min($tile);
                let xs = &x[t0 * per..];
                let o = &mut out[t0..];
                match n {
                    1 => $f::<1, $x>(w, xs, o),
                    2 => $f::<2, $x>(w, xs, o),
                    3 => $f::<3, $x>(w, xs, o),
                    _ => $f::<$tile, $x>(w, xs, o),
                }
                t0 += n;
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[path = "grouped_avx2.rs"]
mod avx2;

#[cfg(target_arch = "aarch64")]
#[path = "grouped_neon.rs"]
mod neon;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use super::{BlockA32, MAX_TILE, Q4KGroup, Q6KGroup, Q41Group, Q50Group, Q80Group, Tile};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// [`quantize`] over every block of a row (`x` holds 32 values per block of `out`), 16
    /// blocks at a time by [`quantize16`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize_row(x: &[f32], out: &mut [MaybeUninit<BlockA32>]) {
        let n = out.len().min(x.len() / 32);
        let mut j = 0;
        while j + 16 <= n {
            quantize16(&x[32 * j..32 * (j + 16)], &mut out[j..j + 16]);
            j += 16;
        }
        for (xb, b) in x[32 * j..32 * n].chunks_exact(32).zip(&mut out[j..n]) {
            quantize(xb, b);
        }
    }

    /// `v` with its NaN lanes zeroed. The quantizers apply it on load: `vmaxps`/`vminps`
    /// return their second operand when either is NaN, so left in, a NaN would become code
    /// +127 through the clamp, or (in the maximum) a NaN scale that zeroes the block. The
    /// scalar quantizer ignores a NaN in the maximum (`f32::max`) and casts it to code 0,
    /// which is exactly what a 0 gives: so the same bits.
    #[inline(always)]
    unsafe fn no_nan(v: __m512) -> __m512 {
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v), v)
    }

    /// Lane `k` of the result is `op` folded over the 16 lanes of `v[k]` (the reductions of
    /// 16 vectors at once: four levels of shuffles, each halving the lanes per input).
    #[inline(always)]
    unsafe fn fold16(v: &[__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
        // Pairs of inputs: 256-bit halves hold each input's eight partials.
        let w: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            op(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        // 128-bit lane k of u[i]: four partials of input 4i + k.
        let u: [__m512; 4] = std::array::from_fn(|i| {
            let (c, d) = (w[2 * i], w[2 * i + 1]);
            op(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(c, d),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(c, d),
            )
        });
        let t: [__m512; 2] = std::array::from_fn(|i| {
            let (e, f) = (u[2 * i], u[2 * i + 1]);
            op(_mm512_unpacklo_ps(e, f), _mm512_unpackhi_ps(e, f))
        });
        // Lane 4k + i: input 4i + k.
        let r = op(
            _mm512_shuffle_ps::<0b01_00_01_00>(t[0], t[1]),
            _mm512_shuffle_ps::<0b11_10_11_10>(t[0], t[1]),
        );
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(idx, r)
    }

    /// [`quantize`] for 16 consecutive blocks with the same operations per element, so the
    /// same bits; but the reductions (maxima, code sums) and the scale divisions run for the
    /// 16 at once. One block at a time was a chain of two reductions and four divisions
    /// (about 60 cycles a block); a window's activations are quantized before every matmul.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quantize16(x: &[f32], out: &mut [MaybeUninit<BlockA32>]) {
        let (x, out) = (&x[..512], &mut out[..16]);
        let v: [[__m512; 2]; 16] = std::array::from_fn(|j| {
            [
                no_nan(_mm512_loadu_ps(x.as_ptr().add(32 * j))),
                no_nan(_mm512_loadu_ps(x.as_ptr().add(32 * j + 16))),
            ]
        });
        let a: [__m512; 16] =
            std::array::from_fn(|j| _mm512_max_ps(_mm512_abs_ps(v[j][0]), _mm512_abs_ps(v[j][1])));
        let amax = fold16(&a, |p, q| _mm512_max_ps(p, q));
        // As `BlockA32::quantizable` (NaN compares false both times).
        let ok = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(amax, _mm512_setzero_ps())
            & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(amax, _mm512_set1_ps(f32::INFINITY));
        let d1 = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
        let d2 = _mm512_div_ps(d1, _mm512_set1_ps(128.0));
        let one = _mm512_set1_ps(1.0);
        let (i1, i2) = (_mm512_div_ps(one, d1), _mm512_div_ps(one, d2));
        let abs_i2 = _mm512_abs_ps(i2);
        let ok = ok & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(abs_i2, _mm512_set1_ps(f32::INFINITY));
        let (mut d1s, mut i1s, mut i2s) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        _mm512_storeu_ps(d1s.as_mut_ptr(), d1);
        _mm512_storeu_ps(i1s.as_mut_ptr(), i1);
        _mm512_storeu_ps(i2s.as_mut_ptr(), i2);
        let mut x16 = [[_mm512_setzero_ps(); 16]; 2];
        for j in 0..16 {
            let b = out[j].as_mut_ptr();
            if ok & (1 << j) == 0 {
                b.write(BlockA32::zero());
                continue;
            }
            let (i1, i2, d1v) = (
                _mm512_set1_ps(i1s[j]),
                _mm512_set1_ps(i2s[j]),
                _mm512_set1_ps(d1s[j]),
            );
            for (h, vh) in v[j].iter().enumerate() {
                x16[h][j] = codes_half(*vh, i1, i2, d1v, b, h);
            }
        }
        let add = |p, q| _mm512_add_ps(p, q);
        let s0 = _mm512_cvtps_epi32(fold16(&x16[0], add));
        let s1 = _mm512_cvtps_epi32(fold16(&x16[1], add));
        let (mut s0s, mut s1s) = ([0i32; 16], [0i32; 16]);
        _mm512_storeu_si512(s0s.as_mut_ptr().cast(), s0);
        _mm512_storeu_si512(s1s.as_mut_ptr().cast(), s1);
        let mut d2s = [0f32; 16];
        _mm512_storeu_ps(d2s.as_mut_ptr(), d2);
        for j in 0..16 {
            if ok & (1 << j) != 0 {
                BlockA32::write_sums(out[j].as_mut_ptr(), d2s[j], s0s[j], s1s[j]);
            }
        }
    }

    /// The codes of half a block (16 values, `h` = 0 or 1) stored into `b`, and per lane
    /// 128·q1 + q2: the same operations in the same order per element as
    /// [`BlockA32::quantize`] (multiply, magic-number rounding, clamp, multiply, subtract), so
    /// the same bits. Those are integers below 2²⁴ in magnitude: their float sums are exact in
    /// any order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn codes_half(
        vh: __m512,
        i1: __m512,
        i2: __m512,
        d1: __m512,
        b: *mut BlockA32,
        h: usize,
    ) -> __m512 {
        let magic = _mm512_set1_ps(12_582_912.0);
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let q1 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(vh, i1), magic), magic);
        let q1 = _mm512_max_ps(_mm512_min_ps(q1, hi), lo);
        let r = _mm512_sub_ps(vh, _mm512_mul_ps(q1, d1));
        let q2 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(r, i2), magic), magic);
        let q2 = _mm512_max_ps(_mm512_min_ps(q2, hi), lo);
        let p1 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q1));
        let p2 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q2));
        _mm_storeu_si128((&raw mut (*b).q1).cast::<i8>().add(16 * h).cast(), p1);
        _mm_storeu_si128((&raw mut (*b).q2).cast::<i8>().add(16 * h).cast(), p2);
        _mm512_add_ps(_mm512_mul_ps(q1, _mm512_set1_ps(128.0)), q2)
    }

    /// SIMD twin of [`BlockA32::quantize`] for one block ([`codes_half`] per half). Writes
    /// `b` in place (see [`super::quantize_into`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quantize(x: &[f32], b: &mut MaybeUninit<BlockA32>) {
        let v = [
            no_nan(_mm512_loadu_ps(x.as_ptr())),
            no_nan(_mm512_loadu_ps(x.as_ptr().add(16))),
        ];
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        if !BlockA32::quantizable(amax) {
            b.write(BlockA32::zero());
            return;
        }
        let b = b.as_mut_ptr();
        let d1 = amax / 127.0;
        let d2 = d1 / 128.0;
        let (i1, i2) = (_mm512_set1_ps(1.0 / d1), _mm512_set1_ps(1.0 / d2));
        let d1v = _mm512_set1_ps(d1);
        let mut sums = [0i32; 2];
        for (h, vh) in v.iter().enumerate() {
            // The half's code sum Σ 128·q1 + q2: integers below 2²⁴ in magnitude, so the
            // float sum is exact in any order.
            sums[h] = _mm512_reduce_add_ps(codes_half(*vh, i1, i2, d1v, b, h)) as i32;
        }
        BlockA32::write_sums(b, d2, sums[0], sums[1]);
    }

    /// Prefetches the bytes [`super::PREFETCH_BYTES`] ahead of group `g`, as many as a group
    /// holds, so the weight stream keeps flowing while the cores multiply (without it a
    /// window's time is about the stream's plus the arithmetic's, not the larger of the two).
    /// The address may run past the slice (into the next row group's, or nowhere): a prefetch
    /// never faults and the pointer is never read.
    #[inline(always)]
    pub(super) unsafe fn prefetch<G>(g: &G) {
        let p = (g as *const G as *const i8).wrapping_add(super::PREFETCH_BYTES);
        let mut off = 0;
        while off < std::mem::size_of::<G>() {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
            off += 64;
        }
    }

    #[inline(always)]
    unsafe fn bcast(p: *const i8, k: usize) -> __m512i {
        _mm512_set1_epi32((p as *const i32).add(k).read_unaligned())
    }

    /// The four 64-byte vectors of a 4-bit sub-block as eight code vectors (`w[k]`: elements
    /// `4k..4k+4`, 16 rows × 4 bytes).
    #[inline(always)]
    unsafe fn nibbles(qs: *const u8) -> [__m512i; 8] {
        let m4 = _mm512_set1_epi8(0x0f);
        let mut w = [_mm512_setzero_si512(); 8];
        for g in 0..4 {
            let v = _mm512_loadu_si512(qs.add(64 * g) as *const _);
            w[2 * g] = _mm512_and_si512(v, m4);
            w[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        w
    }

    /// Adds one sub-block's term for every token of the tile: `NV` code vectors against the
    /// activations of block `idx` of each token (from byte `off`), `(scf·d)·S + mnf·neg`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn sub_tile<const TN: usize, const NV: usize>(
        w: &[__m512i; NV],
        scf: __m512,
        mnf: __m512,
        x: &[BlockA32],
        stride: usize,
        idx: usize,
        off: usize,
        neg: impl Fn(&BlockA32) -> f32,
        acc: &mut [__m512; TN],
    ) {
        for (t, a) in acc.iter_mut().enumerate() {
            let xb = &x[t * stride + idx];
            let p1 = xb.q1.as_ptr().add(off);
            let p2 = xb.q2.as_ptr().add(off);
            let mut s1 = _mm512_setzero_si512();
            let mut s2 = _mm512_setzero_si512();
            for (k, wk) in w.iter().enumerate() {
                s1 = _mm512_dpbusd_epi32(s1, *wk, bcast(p1, k));
                s2 = _mm512_dpbusd_epi32(s2, *wk, bcast(p2, k));
            }
            let s = _mm512_add_epi32(_mm512_slli_epi32(s1, 7), s2);
            *a = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(s),
                _mm512_mul_ps(scf, _mm512_set1_ps(xb.d)),
                *a,
            );
            *a = _mm512_fmadd_ps(mnf, _mm512_set1_ps(neg(xb)), *a);
        }
    }

    #[inline(always)]
    unsafe fn store<const TN: usize>(acc: &[__m512; TN], out: &mut Tile) {
        for t in 0..TN {
            _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
        }
    }

    #[inline(always)]
    unsafe fn u8_f32(p: *const u8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn q4k<const TN: usize>(groups: &[Q4KGroup], x: &[BlockA32], out: &mut Tile) {
        let stride = 8 * groups.len();
        let mut acc = [_mm512_setzero_ps(); TN];
        for (b, g) in groups.iter().enumerate() {
            prefetch(g);
            let d = _mm512_loadu_ps(g.d.as_ptr());
            let dmin = _mm512_loadu_ps(g.dmin.as_ptr());
            for j in 0..8 {
                let scf = _mm512_mul_ps(d, u8_f32(g.sc[j].as_ptr()));
                let mnf = _mm512_mul_ps(dmin, u8_f32(g.mn[j].as_ptr()));
                let w = nibbles(g.qs[j].as_ptr());
                sub_tile(&w, scf, mnf, x, stride, 8 * b + j, 0, |a| a.neg32, &mut acc);
            }
        }
        store(&acc, out);
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn q6k<const TN: usize>(groups: &[Q6KGroup], x: &[BlockA32], out: &mut Tile) {
        let stride = 8 * groups.len();
        let m4 = _mm512_set1_epi8(0x0f);
        let m30 = _mm512_set1_epi8(0x30);
        let mut acc = [_mm512_setzero_ps(); TN];
        for (b, g) in groups.iter().enumerate() {
            prefetch(g);
            let d = _mm512_loadu_ps(g.d.as_ptr());
            for gg in 0..16 {
                let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(g.sc[gg].as_ptr() as *const __m128i));
                let scf = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                let qp = g.q[gg].as_ptr();
                let l0 = _mm512_loadu_si512(qp as *const _);
                let l1 = _mm512_loadu_si512(qp.add(64) as *const _);
                let h = _mm512_loadu_si512(qp.add(128) as *const _);
                let w = [
                    _mm512_or_si512(
                        _mm512_and_si512(l0, m4),
                        _mm512_and_si512(_mm512_slli_epi16(h, 4), m30),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                        _mm512_and_si512(_mm512_slli_epi16(h, 2), m30),
                    ),
                    _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(h, m30)),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                        _mm512_and_si512(_mm512_srli_epi16(h, 2), m30),
                    ),
                ];
                let half = gg % 2;
                let neg = move |a: &BlockA32| a.neg16x32[half];
                sub_tile(
                    &w,
                    scf,
                    scf,
                    x,
                    stride,
                    8 * b + gg / 2,
                    16 * half,
                    neg,
                    &mut acc,
                );
            }
        }
        store(&acc, out);
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn q41<const TN: usize>(groups: &[Q41Group], x: &[BlockA32], out: &mut Tile) {
        let stride = groups.len();
        let mut acc = [_mm512_setzero_ps(); TN];
        for (j, g) in groups.iter().enumerate() {
            prefetch(g);
            let scf = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr() as *const __m256i));
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(g.m.as_ptr() as *const __m256i));
            let mnf = _mm512_sub_ps(_mm512_setzero_ps(), m);
            let w = nibbles(g.qs.as_ptr());
            sub_tile(&w, scf, mnf, x, stride, j, 0, |a| a.neg32, &mut acc);
        }
        store(&acc, out);
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn q50<const TN: usize>(groups: &[Q50Group], x: &[BlockA32], out: &mut Tile) {
        let stride = groups.len();
        let m10 = _mm512_set1_epi8(0x10);
        let mut acc = [_mm512_setzero_ps(); TN];
        for (j, g) in groups.iter().enumerate() {
            prefetch(g);
            let scf = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr() as *const __m256i));
            let mnf = _mm512_mul_ps(scf, _mm512_set1_ps(16.0));
            let mut w = nibbles(g.qs.as_ptr());
            let h = _mm512_loadu_si512(g.qh.as_ptr() as *const _);
            // Bit k of each byte is the fifth bit of vector k: move it to bit 4.
            let hs = [
                _mm512_slli_epi16(h, 4),
                _mm512_slli_epi16(h, 3),
                _mm512_slli_epi16(h, 2),
                _mm512_slli_epi16(h, 1),
                h,
                _mm512_srli_epi16(h, 1),
                _mm512_srli_epi16(h, 2),
                _mm512_srli_epi16(h, 3),
            ];
            for (wk, hk) in w.iter_mut().zip(hs) {
                *wk = _mm512_or_si512(*wk, _mm512_and_si512(hk, m10));
            }
            sub_tile(&w, scf, mnf, x, stride, j, 0, |a| a.neg32, &mut acc);
        }
        store(&acc, out);
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn q80<const TN: usize>(groups: &[Q80Group], x: &[BlockA32], out: &mut Tile) {
        let stride = groups.len();
        let mut acc = [_mm512_setzero_ps(); TN];
        for (j, g) in groups.iter().enumerate() {
            prefetch(g);
            let scf = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr() as *const __m256i));
            let mnf = _mm512_mul_ps(scf, _mm512_set1_ps(128.0));
            let mut w = [_mm512_setzero_si512(); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                *wk = _mm512_loadu_si512(g.qs.as_ptr().add(64 * k) as *const _);
            }
            sub_tile(&w, scf, mnf, x, stride, j, 0, |a| a.neg32, &mut acc);
        }
        store(&acc, out);
    }

    macro_rules! dispatch {
        ($name:ident, $f:ident, $w:ty) => {
            pub(super) unsafe fn $name(w: &[$w], x: &[BlockA32], tn: usize, out: &mut Tile) {
                match tn {
                    1 => $f::<1>(w, x, out),
                    2 => $f::<2>(w, x, out),
                    3 => $f::<3>(w, x, out),
                    4 => $f::<4>(w, x, out),
                    5 => $f::<5>(w, x, out),
                    6 => $f::<6>(w, x, out),
                    7 => $f::<7>(w, x, out),
                    _ => $f::<MAX_TILE>(w, x, out),
                }
            }
        };
    }
    dispatch!(dispatch_q4k, q4k, Q4KGroup);
    dispatch!(dispatch_q6k, q6k, Q6KGroup);
    dispatch!(dispatch_q41, q41, Q41Group);
    dispatch!(dispatch_q50, q50, Q50Group);
    dispatch!(dispatch_q80, q80, Q80Group);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;
    use crate::rng::Rng;
    use crate::{QMatrix, QWeights};

    const TYPES: [GgmlType; 5] = [
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
    ];

    /// Random raw GGUF bytes (scales kept small and finite).
    fn random_raw(rng: &mut Rng, ty: GgmlType, n_blocks: usize) -> Vec<u8> {
        let mut raw = Vec::with_capacity(n_blocks * ty.block_bytes());
        for _ in 0..n_blocks {
            let mut b: Vec<u8> = (0..ty.block_bytes())
                .map(|_| (rng.next_u64() & 0xff) as u8)
                .collect();
            let d = f16::from_f32(0.001 + 0.01 * rng.uniform() as f32).to_le_bytes();
            let m = f16::from_f32(0.02 * (rng.uniform() as f32 - 0.5)).to_le_bytes();
            match ty {
                GgmlType::Q6K => b[208..210].copy_from_slice(&d),
                GgmlType::Q8_0 | GgmlType::Q5_0 => b[0..2].copy_from_slice(&d),
                _ => {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&m);
                }
            }
            raw.extend_from_slice(&b);
        }
        raw
    }

    fn matrix(raw: &[u8], ty: GgmlType, rows: usize, cols: usize) -> QMatrix {
        let w = match ty {
            GgmlType::Q4K => QWeights::Q4K(repack_q4k(raw, rows, cols).expect("repack")),
            GgmlType::Q6K => QWeights::Q6K(repack_q6k(raw, rows, cols).expect("repack")),
            GgmlType::Q4_1 => QWeights::Q41(repack_q41(raw, rows, cols).expect("repack")),
            GgmlType::Q5_0 => QWeights::Q50(repack_q50(raw, rows, cols).expect("repack")),
            _ => QWeights::Q80(repack_q80(raw, rows, cols).expect("repack")),
        };
        QMatrix::new(rows, cols, w).expect("shape")
    }

    fn random_matrix(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, QMatrix) {
        let raw = random_raw(rng, ty, rows * cols / ty.block_elems());
        let mat = matrix(&raw, ty, rows, cols);
        (raw, mat)
    }

    #[test]
    fn repacked_groups_decode_exactly_like_ggml() {
        let mut rng = Rng::new(7);
        for ty in TYPES {
            let (rows, cols) = (32, 512);
            let (raw, mat) = random_matrix(&mut rng, ty, rows, cols);
            let want = dequantize(ty, &raw, rows * cols).expect("reference decode");
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                mat.dequantize_row(r, &mut got);
                assert_eq!(got, want[r * cols..(r + 1) * cols], "{ty:?} row {r}");
            }
        }
    }

    #[test]
    fn activations_keep_fifteen_bits() {
        let mut rng = Rng::new(3);
        let x: Vec<f32> = (0..QK).map(|_| 3.0 * rng.normal() as f32).collect();
        let b = BlockA32::quantize(&x);
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (e, v) in x.iter().enumerate() {
            assert!(b.q2[e].abs() <= 64);
            // Half a step of d1/128, plus f32 rounding.
            assert!((b.d * b.x16(e) as f32 - v).abs() <= 0.5 * amax / 127.0 / 128.0 + 1e-6 * amax);
        }
        let s: i32 = (0..32).map(|e| b.x16(e)).sum();
        assert_eq!(b.neg32, -b.d * s as f32);
        let z = BlockA32::quantize(&[0.0; QK]);
        assert_eq!(z.d, 0.0);
        assert!(z.q1.iter().chain(&z.q2).all(|&q| q == 0));
    }

    #[test]
    fn the_simd_quantizer_gives_the_scalar_bits() {
        let mut rng = Rng::new(9);
        let scales = [1e-37f32, 1e-35, 1e-34, 1e-30, 1e-3, 1.0, 7.5, 3e4];
        // Many blocks per scale: a fused multiply-subtract for the residual changes a code
        // only now and then.
        for scale in scales.iter().flat_map(|&s| std::iter::repeat_n(s, 64)) {
            let mut x: Vec<f32> = (0..QK).map(|_| scale * rng.normal() as f32).collect();
            x[5] = 0.0;
            x[6] = -x.iter().fold(0f32, |a, v| a.max(v.abs())); // the extreme, negative
            let a = BlockA32::quantize(&x);
            for isa in Isa::available() {
                let b = BlockA32::quantize_fast(&x, isa);
                assert_eq!(
                    (a.q1, a.q2, a.sum),
                    (b.q1, b.q2, b.sum),
                    "scale {scale} {isa:?}"
                );
                assert_eq!(
                    (
                        a.d.to_bits(),
                        a.neg32.to_bits(),
                        a.neg16x32.map(f32::to_bits)
                    ),
                    (
                        b.d.to_bits(),
                        b.neg32.to_bits(),
                        b.neg16x32.map(f32::to_bits)
                    ),
                    "{isa:?}"
                );
            }
            assert_eq!(a.sum, (0..QK).map(|e| a.x16(e)).sum::<i32>());
        }
        // Every SIMD quantizer keeps the scalar one's bits for a NaN too (its code is 0).
        let mut x: Vec<f32> = (0..QK).map(|_| rng.normal() as f32).collect();
        x[3] = f32::NAN;
        let a = BlockA32::quantize(&x);
        for isa in Isa::available() {
            let b = BlockA32::quantize_fast(&x, isa);
            assert_eq!(block_bits(&a), block_bits(&b), "NaN {isa:?}");
        }
    }

    #[test]
    fn a_nan_activation_gets_code_zero_on_every_path() {
        // The largest value is not in the NaN's lanes: a NaN that knocked other lanes out of
        // the maximum, or clamped to +127, would change the block.
        let mut x: Vec<f32> = (0..QK).map(|i| 0.1 + 0.001 * i as f32).collect();
        x[0] = 1.0;
        x[8] = f32::NAN;
        let a = BlockA32::quantize(&x);
        assert_eq!((a.q1[8], a.q2[8]), (0, 0));
        assert_eq!(a.q1[0], 127);
        for isa in Isa::available() {
            let b = BlockA32::quantize_fast(&x, isa);
            assert_eq!(block_bits(&a), block_bits(&b), "{isa:?}");
        }
        // Whole rows (the AVX-512 rows go 16 blocks at a time), NaNs in some blocks, and one
        // block of NaNs only (no codes, as the scalar quantizer).
        let mut rng = Rng::new(5);
        let cols = 17 * QK;
        let mut row: Vec<f32> = (0..cols).map(|_| rng.normal() as f32).collect();
        for (k, i) in [8, 40, 77, 200, 511, 530].into_iter().enumerate() {
            row[i] = if k % 2 == 0 { f32::NAN } else { -f32::NAN };
        }
        for v in &mut row[3 * QK..4 * QK] {
            *v = f32::NAN;
        }
        let want: Vec<BlockA32> = row.chunks_exact(QK).map(BlockA32::quantize).collect();
        assert!(want[3].q1.iter().chain(&want[3].q2).all(|&q| q == 0));
        for isa in Isa::available() {
            let mut out: Vec<MaybeUninit<BlockA32>> = vec![MaybeUninit::uninit(); cols / QK];
            let got = quantize_into(&row, isa, &mut out);
            for (i, (a, b)) in want.iter().zip(got.iter()).enumerate() {
                assert_eq!(block_bits(a), block_bits(b), "block {i} {isa:?}");
            }
        }
    }

    #[test]
    fn quantize_fast_pads_a_short_input_with_zeros() {
        let x: Vec<f32> = (0..20).map(|i| 0.25 * i as f32 - 2.0).collect();
        let mut padded = x.clone();
        padded.resize(QK, 0.0);
        let a = BlockA32::quantize(&padded);
        for isa in Isa::available() {
            assert_eq!(
                block_bits(&BlockA32::quantize_fast(&x, isa)),
                block_bits(&a)
            );
            assert_eq!(
                block_bits(&BlockA32::quantize_fast(&[], isa)),
                block_bits(&BlockA32::zero())
            );
        }
    }

    /// Every block's fields, bit for bit.
    fn block_bits(b: &BlockA32) -> ([i8; QK], [i8; QK], i32, [u32; 4]) {
        (
            b.q1,
            b.q2,
            b.sum,
            [
                b.d.to_bits(),
                b.neg32.to_bits(),
                b.neg16x32[0].to_bits(),
                b.neg16x32[1].to_bits(),
            ],
        )
    }

    #[test]
    fn whole_rows_get_the_scalar_bits_on_every_path() {
        // On a team of two, as in a forward, so the rows of 256 blocks or more are split.
        let team = crate::par::Team::new(2, "quantize-test").unwrap();
        team.install(whole_rows_case);
    }

    fn whole_rows_case() {
        // Rows of 1 … 49 blocks (the SIMD rows go 16 blocks at a time, then one by one), with
        // blocks at every scale, all-zero ones, ones too small to quantize, infinite ones and
        // outliers; and enough rows to be quantized in parallel.
        let mut rng = Rng::new(21);
        let scales = [0.0f32, 1e-37, 1e-34, 1e-3, 1.0, 7.5, 3e4, f32::INFINITY];
        let shapes = [
            (1, 32),
            (1, 64),
            (3, 15 * 32),
            (2, 16 * 32),
            (1, 17 * 32),
            (5, 576),
        ];
        let shapes = shapes
            .into_iter()
            .chain([(4, 33 * 32), (16, 576), (9, 1536), (1, 49 * 32)]);
        for (m, cols) in shapes {
            let mut x = vec![0f32; m * cols];
            for b in x.chunks_mut(QK) {
                let scale = scales[rng.below(scales.len())];
                for v in b.iter_mut() {
                    *v = if scale.is_infinite() {
                        scale
                    } else {
                        scale * rng.normal() as f32
                    };
                }
                if scale == 1.0 && rng.below(4) == 0 {
                    b[7] = 5e4; // an outlier of its span
                }
            }
            let want = quantize_rows(&x, m, cols, Isa::Scalar);
            assert_eq!(want.blocks.len(), m * cols / QK);
            for isa in Isa::available() {
                let got = quantize_rows(&x, m, cols, isa);
                assert_eq!(got.outliers, want.outliers, "{m} × {cols} {isa:?}");
                assert_eq!(got.blocks.len(), want.blocks.len());
                for (i, (a, b)) in want.blocks.iter().zip(&got.blocks).enumerate() {
                    assert_eq!(
                        block_bits(a),
                        block_bits(b),
                        "{m} × {cols} block {i} {isa:?}"
                    );
                }
            }
            // Each row on its own gives the same as the rows together.
            for r in 0..m {
                let one = quantize_rows(&x[r * cols..(r + 1) * cols], 1, cols, Isa::detect());
                let nb = cols / QK;
                for (a, b) in one.blocks.iter().zip(&want.blocks[r * nb..(r + 1) * nb]) {
                    assert_eq!(block_bits(a), block_bits(b));
                }
                assert_eq!(one.outliers[0], want.outliers[r]);
            }
        }
        // A row shorter than a block gets no blocks; no row at all, nothing.
        assert!(
            quantize_rows(&[1.0; 20], 2, 10, Isa::detect())
                .blocks
                .is_empty()
        );
        assert!(quantize_rows(&[], 0, 576, Isa::detect()).blocks.is_empty());
    }

    #[test]
    fn massive_channels_are_split_off_and_multiplied_in_f32() {
        let mut x = vec![0.5f32; 512];
        x[263] = 90_000.0;
        let q = quantize_rows(&x, 1, 512, Isa::detect());
        assert_eq!(q.outliers, vec![vec![(263, 90_000.0)]]);
        assert_eq!(q.blocks[8].x16(7), 0);
        assert!((q.blocks[8].d * q.blocks[8].x16(0) as f32 - 0.5).abs() < 1e-5);
        let plain = quantize_rows(&[0.5f32; 512], 1, 512, Isa::detect());
        assert!(plain.outliers[0].is_empty());
    }

    #[test]
    fn the_product_is_within_the_activation_rounding_of_the_f32_dot() {
        let mut rng = Rng::new(11);
        for ty in TYPES {
            let (rows, cols) = (16, 768);
            let (raw, mat) = random_matrix(&mut rng, ty, rows, cols);
            let w = dequantize(ty, &raw, rows * cols).expect("decode");
            let mut x: Vec<f32> = (0..cols).map(|_| rng.normal() as f32).collect();
            x[300] = 2.0e5;
            let mut got = vec![0f32; rows];
            mat.matmul_ref(&x, 1, &mut got);
            let amax = x
                .iter()
                .filter(|v| v.abs() < 1e4)
                .fold(0f32, |a, v| a.max(v.abs()));
            for r in 0..rows {
                let wr = &w[r * cols..(r + 1) * cols];
                let want: f64 = wr.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wr
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                // Each activation is off by at most amax/(2·127·128) of its block.
                let bound = wr.iter().map(|a| a.abs() as f64).sum::<f64>() * amax as f64 / 32512.0
                    + 1e-5 * mag;
                assert!(
                    (got[r] as f64 - want).abs() <= bound,
                    "{ty:?} row {r}: {} vs {want} (bound {bound})",
                    got[r]
                );
            }
        }
    }

    #[test]
    fn simd_paths_equal_the_scalar_reference_and_batches_equal_single_tokens() {
        let mut rng = Rng::new(5);
        for ty in TYPES {
            for &(rows, cols) in &[(16usize, 256usize), (48, 512), (64, 1536)] {
                let (_, mat) = random_matrix(&mut rng, ty, rows, cols);
                // Every token-tile width of every kernel (1 to 8) and a tail after full tiles.
                for &m in &[1usize, 2, 3, 4, 5, 6, 7, 8, 9, 17] {
                    let mut x: Vec<f32> = (0..m * cols).map(|_| rng.normal() as f32).collect();
                    x[1] = 3.0e5; // a massive channel, split off
                    let mut want = vec![0f32; m * rows];
                    mat.matmul_ref(&x, m, &mut want);
                    let mut wrow = vec![0f32; cols];
                    let mut scale = vec![0f32; m * rows];
                    for r in 0..rows {
                        mat.dequantize_row(r, &mut wrow);
                        for t in 0..m {
                            scale[t * rows + r] = wrow
                                .iter()
                                .zip(&x[t * cols..])
                                .map(|(w, v)| (w * v).abs())
                                .sum();
                        }
                    }
                    // Every path's results, to hold them to the same bits: the scalar path runs
                    // the portable mirror of the kernels' float order.
                    let mut by_kernels: Vec<(Isa, Vec<f32>)> = Vec::new();
                    for isa in Isa::available() {
                        let mut got = vec![f32::NAN; m * rows];
                        mat.matmul(&x, m, &mut got, isa);
                        by_kernels.push((isa, got.clone()));
                        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                            let tol = 2e-6 * scale[i] + 1e-6;
                            assert!(
                                (a - b).abs() <= tol,
                                "{ty:?} {rows}x{cols} m={m} {isa:?} elem {i}: ref {a} got {b}"
                            );
                        }
                        // Every token alone gives the same bits as inside the batch.
                        for t in 0..m {
                            let mut one = vec![f32::NAN; rows];
                            mat.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one, isa);
                            assert_eq!(one, got[t * rows..(t + 1) * rows], "{ty:?} {isa:?} t={t}");
                        }
                    }
                    assert_eq!(by_kernels[0].0, Isa::Scalar);
                    for (isa, got) in &by_kernels {
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(got),
                            bits(&by_kernels[0].1),
                            "{ty:?} m={m} {isa:?} ({:?}) against the mirror",
                            GroupedKernels::for_isa(*isa)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_non_finite_activation_reaches_its_row_outputs_only() {
        let mut rng = Rng::new(17);
        let (rows, cols, m) = (32, 512, 3);
        for ty in TYPES {
            let (_, mat) = random_matrix(&mut rng, ty, rows, cols);
            let clean: Vec<f32> = (0..m * cols).map(|_| rng.normal() as f32).collect();
            let mut x = clean.clone();
            x[cols + 100] = f32::INFINITY; // token 1
            x[2 * cols + 300] = f32::NAN; // token 2
            x[2 * cols + 7] = 5e4; // and an outlier of another span
            for isa in std::iter::once(None).chain(Isa::available().into_iter().map(Some)) {
                let run = |x: &[f32]| {
                    let mut out = vec![0f32; m * rows];
                    match isa {
                        Some(isa) => mat.matmul(x, m, &mut out, isa),
                        None => mat.matmul_ref(x, m, &mut out),
                    }
                    out
                };
                let (want, got) = (run(&clean), run(&x));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got[..rows]), bits(&want[..rows]), "{ty:?} {isa:?}");
                assert!(
                    got[rows..2 * rows].iter().all(|v| !v.is_finite()),
                    "{ty:?} {isa:?}: {:?}",
                    &got[rows..2 * rows]
                );
                assert!(got[2 * rows..].iter().all(|v| v.is_nan()), "{ty:?} {isa:?}");
            }
        }
    }

    /// Raw bytes with every code byte `fill` (the largest codes for 0xff; Q8_0's −128 for
    /// 0x80) and small finite scales.
    fn filled_raw(ty: GgmlType, n_blocks: usize, fill: u8) -> Vec<u8> {
        let mut raw = Vec::with_capacity(n_blocks * ty.block_bytes());
        for _ in 0..n_blocks {
            let mut b = vec![fill; ty.block_bytes()];
            let d = f16::from_f32(0.004).to_le_bytes();
            match ty {
                GgmlType::Q6K => b[208..210].copy_from_slice(&d),
                GgmlType::Q8_0 | GgmlType::Q5_0 => b[0..2].copy_from_slice(&d),
                _ => {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&f16::from_f32(-0.003).to_le_bytes());
                }
            }
            raw.extend_from_slice(&b);
        }
        raw
    }

    #[test]
    fn extreme_codes_and_activations_do_not_saturate_any_path() {
        // Every activation at ±127 codes and every weight at its largest code: the AVX2 pair
        // sums in i16 are at their bounds (grouped_avx2.rs), so a saturating or wrapping sum
        // would be far off the exact reference.
        let (rows, cols) = (32, 512);
        for ty in TYPES {
            let fills: &[u8] = if ty == GgmlType::Q8_0 {
                &[0x80, 0x7f, 0xff]
            } else {
                &[0xff]
            };
            for &fill in fills {
                let raw = filled_raw(ty, rows * cols / ty.block_elems(), fill);
                let mat = matrix(&raw, ty, rows, cols);
                for sign in [1.0f32, -1.0] {
                    let x: Vec<f32> = (0..2 * cols)
                        .map(|i| {
                            if i < cols {
                                sign
                            } else {
                                -sign * (1 + i % 3) as f32
                            }
                        })
                        .collect();
                    let mut want = vec![0f32; 2 * rows];
                    mat.matmul_ref(&x, 2, &mut want);
                    let mut mirror = vec![f32::NAN; 2 * rows];
                    mat.matmul(&x, 2, &mut mirror, Isa::Scalar);
                    for isa in Isa::available() {
                        let mut got = vec![f32::NAN; 2 * rows];
                        mat.matmul(&x, 2, &mut got, isa);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&mirror), "{ty:?} fill {fill:#x} {isa:?}");
                        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                            assert!(
                                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                                "{ty:?} fill {fill:#x} sign {sign} {isa:?} elem {i}: ref {a} got {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shapes_the_grouped_layout_cannot_take_are_errors() {
        assert!(repack_q4k(&[0u8; 144 * 16], 16, 255).is_err());
        assert!(repack_q4k(&[0u8; 144 * 8], 8, 256).is_err());
        assert!(repack_q6k(&[0u8; 209 * 16], 16, 256).is_err());
        assert!(repack_q41(&[0u8; 20 * 8], 8, 32).is_err());
        assert!(repack_q80(&[0u8; 34 * 16], 16, 64).is_err());
        assert!(QMatrix::new(16, 256, QWeights::Q4K(vec![])).is_err());
        assert!(!fits(GgmlType::Q4K, 8, 256) && !fits(GgmlType::Q4K, 16, 128));
        assert!(fits(GgmlType::Q4_1, 16, 576) && !fits(GgmlType::Q5_0, 16, 577));
        assert!(!fits(GgmlType::F16, 16, 576));
    }

    #[test]
    fn a_byte_size_past_usize_is_a_shape_error() {
        // 2^(B−2) rows of one 20-byte block are 5·2^B bytes: wrapped, 0, as an empty tensor.
        let huge = 1usize << (usize::BITS - 2);
        assert!(matches!(
            repack_q41(&[], huge, 32),
            Err(KernelError::Shape(_))
        ));
        assert!(matches!(
            repack_q80(&[], huge, 32 * 7),
            Err(KernelError::Shape(_))
        ));
    }
}
