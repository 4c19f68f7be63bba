//! NEON twins of the grouped kernels, for 64-bit Arm servers (AWS Graviton, Ampere Altra,
//! Neoverse) and Apple silicon.
//!
//! Why: without them these CPUs multiply the grouped weight types through the 32-element formats
//! with f32 activations, as x86 CPUs without the integer kernels did (3.6× slower per decode and
//! 5.4× per 8-token window on SmolLM2, measured with `--isa avx2` before its twins existed).
//!
//! How: a 64-byte group vector (16 rows × 4 codes) is four 128-bit quarters of 4 rows, each
//! quarter its own pass over the row group, so a quarter's 4 rows sit in the 4 i32 lanes.
//! - With the dot-product extension (`Isa::NeonDot`: Armv8.2-A's FEAT_DotProd; Graviton 2 and
//!   later, Ampere Altra, Apple M1 and later) one `sdot` by element multiplies 4 codes of 4 rows
//!   by the same 4 activations, as VNNI's `vpdpbusd` does for 16 rows. Rust has no stable
//!   intrinsic for it yet, so it is one instruction of inline assembly.
//! - Plain NEON (`Isa::Neon`, every 64-bit Arm CPU) widens: `smull`/`smlal` multiply 8 codes by
//!   8 activations into i16, runs of `R` vectors are summed there, then `sadalp` adds pairs into
//!   i32 lanes (row `r`'s two pairs in lanes `2r`, `2r + 1` of one of two accumulators) and one
//!   `addp` per sub-block puts each row in its own lane. A product is at most 15·127 = 1905 for
//!   4-bit codes, 31·127 = 3937 for 5-bit, 63·127 = 8001 for 6-bit and 128·127 = 16256 for
//!   Q8_0's signed codes, so runs of 8, 8, 4 and 2 stay below 32767 (15240, 31496, 32004,
//!   32512): no i16 sum can wrap.
//!
//! Both multiply signed bytes, so Q8_0's codes (stored as `q + 128` for VNNI) are flipped back
//! to `q`, and the `128·Σx` that VNNI's offset codes carry is added to the integer sum, as the
//! AVX2 kernel does. Every integer sum is exact and every float step per row is the VNNI
//! kernels' in the same order (a fused multiply-add is one rounding on both), so these paths
//! give the same bits as every x86 path ([`super::mirror`] is the portable statement of that
//! order; tests hold each path to it).

#![allow(unsafe_op_in_unsafe_fn)]

use super::{BlockA32, Q4KGroup, Q6KGroup, Q41Group, Q50Group, Q80Group, Tile};
use std::arch::aarch64::*;
use std::arch::asm;

/// Rows of a group in one 128-bit register.
const QUARTER: usize = 4;

/// Largest token tile one pass keeps in registers; longer tiles run as several passes, each
/// token with the same instructions.
const TILE: usize = 4;

/// How one token's activation half is multiplied by a quarter's code vectors.
trait Mac {
    /// `Σ_k w[k]·x[4k..4k+4]` per i32 lane (row), `x` the activation bytes from `p`, summed in
    /// i16 over runs of `R` vectors where the instruction widens.
    unsafe fn isum<const NV: usize, const R: usize>(w: &[int8x16_t; NV], p: *const i8)
    -> int32x4_t;
}

/// `acc + w·x[4L..4L+4]` per row: `sdot` by element.
///
/// # Safety
/// The CPU must have the dot-product extension.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot<const L: usize>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut a = acc;
    macro_rules! lane {
        ($l:literal) => {
            asm!(
                concat!("sdot {a:v}.4s, {w:v}.16b, {x:v}.4b[", $l, "]"),
                a = inout(vreg) a,
                w = in(vreg) w,
                x = in(vreg) x,
                options(pure, nomem, nostack, preserves_flags)
            )
        };
    }
    match L {
        0 => lane!("0"),
        1 => lane!("1"),
        2 => lane!("2"),
        _ => lane!("3"),
    }
    a
}

/// The 4 activation bytes `4L..4L+4` of `x`, repeated over the register.
#[inline(always)]
unsafe fn rep<const L: i32>(x: int8x16_t) -> int8x16_t {
    vreinterpretq_s8_s32(vdupq_laneq_s32::<L>(vreinterpretq_s32_s8(x)))
}

/// The dot-product extension.
struct Dot;
/// Plain NEON.
struct Widen;

impl Mac for Dot {
    #[inline(always)]
    unsafe fn isum<const NV: usize, const R: usize>(
        w: &[int8x16_t; NV],
        p: *const i8,
    ) -> int32x4_t {
        // Two chains, so that a single token's 8 `sdot`s do not wait on each other's latency.
        let mut s = [vdupq_n_s32(0); 2];
        for (k, wk) in w.iter().enumerate() {
            let x = vld1q_s8(p.add(16 * (k / 4)));
            let c = &mut s[k % 2];
            *c = match k % 4 {
                0 => sdot::<0>(*c, *wk, x),
                1 => sdot::<1>(*c, *wk, x),
                2 => sdot::<2>(*c, *wk, x),
                _ => sdot::<3>(*c, *wk, x),
            };
        }
        vaddq_s32(s[0], s[1])
    }
}

impl Mac for Widen {
    #[inline(always)]
    unsafe fn isum<const NV: usize, const R: usize>(
        w: &[int8x16_t; NV],
        p: *const i8,
    ) -> int32x4_t {
        let (mut lo, mut hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
        let mut k = 0;
        while k < NV {
            let (mut plo, mut phi) = (vdupq_n_s16(0), vdupq_n_s16(0));
            for j in k..k + R {
                let x = vld1q_s8(p.add(16 * (j / 4)));
                let xr = match j % 4 {
                    0 => rep::<0>(x),
                    1 => rep::<1>(x),
                    2 => rep::<2>(x),
                    _ => rep::<3>(x),
                };
                // Rows 0 and 1 from the low 8 bytes, rows 2 and 3 from the high ones.
                plo = vmlal_s8(plo, vget_low_s8(w[j]), vget_low_s8(xr));
                phi = vmlal_high_s8(phi, w[j], xr);
            }
            lo = vpadalq_s16(lo, plo);
            hi = vpadalq_s16(hi, phi);
            k += R;
        }
        // [r0 pair sums, r1 pair sums] and [r2, r3] → one row per lane.
        vpaddq_s32(lo, hi)
    }
}

/// One token's integer sum `S = 128·Σ w·q1 + Σ w·q2` for 4 rows; with `offset` (Q8_0's signed
/// codes) plus the `128·Σx` of VNNI's `q + 128` codes.
#[inline(always)]
unsafe fn token_sum<M: Mac, const NV: usize, const R: usize>(
    w: &[int8x16_t; NV],
    xb: &BlockA32,
    off: usize,
    offset: bool,
) -> int32x4_t {
    let s1 = M::isum::<NV, R>(w, xb.q1.as_ptr().add(off));
    let s2 = M::isum::<NV, R>(w, xb.q2.as_ptr().add(off));
    let s = vaddq_s32(vshlq_n_s32::<7>(s1), s2);
    if offset {
        vaddq_s32(s, vdupq_n_s32(128 * xb.sum))
    } else {
        s
    }
}

/// Adds one sub-block's term for every token of the tile, `(scf·d)·S + mnf·neg`, as
/// [`super::x86`]'s `sub_tile` does for 16 rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sub_tile<M: Mac, const TN: usize, const NV: usize, const R: usize>(
    w: &[int8x16_t; NV],
    offset: bool,
    scf: float32x4_t,
    mnf: float32x4_t,
    x: &[BlockA32],
    stride: usize,
    idx: usize,
    off: usize,
    neg: impl Fn(&BlockA32) -> f32,
    acc: &mut [float32x4_t; TN],
) {
    for (t, a) in acc.iter_mut().enumerate() {
        let xb = &x[t * stride + idx];
        let s = token_sum::<M, NV, R>(w, xb, off, offset);
        *a = vfmaq_f32(*a, vcvtq_f32_s32(s), vmulq_f32(scf, vdupq_n_f32(xb.d)));
        *a = vfmaq_f32(*a, mnf, vdupq_n_f32(neg(xb)));
    }
}

#[inline(always)]
unsafe fn store<const TN: usize>(acc: &[float32x4_t; TN], q: usize, out: &mut [[f32; 16]]) {
    for t in 0..TN {
        vst1q_f32(out[t].as_mut_ptr().add(QUARTER * q), acc[t]);
    }
}

/// Four unsigned bytes as floats.
#[inline(always)]
unsafe fn u8_f32(p: *const u8) -> float32x4_t {
    let v = vreinterpret_u8_u32(vdup_n_u32((p as *const u32).read_unaligned()));
    vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(v))))
}

/// Four signed bytes as floats.
#[inline(always)]
unsafe fn i8_f32(p: *const i8) -> float32x4_t {
    let v = vreinterpret_s8_u32(vdup_n_u32((p as *const u32).read_unaligned()));
    vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(v))))
}

/// Four f16 as f32 (`fcvtl`, in every Armv8 CPU; the intrinsic needs Rust's unstable `f16`).
#[inline(always)]
unsafe fn f16_f32(p: *const half::f16) -> float32x4_t {
    let h = vld1_u16(p as *const u16);
    let r: float32x4_t;
    asm!(
        "fcvtl {r:v}.4s, {h:v}.4h",
        r = out(vreg) r,
        h = in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    r
}

/// Quarter `q` of the four 64-byte vectors of a 4-bit sub-block as eight code vectors.
#[inline(always)]
unsafe fn nibbles(qs: *const u8, q: usize) -> [int8x16_t; 8] {
    let m4 = vdupq_n_u8(0x0f);
    let mut w = [vdupq_n_s8(0); 8];
    for g in 0..4 {
        let v = vld1q_u8(qs.add(64 * g + 16 * q));
        w[2 * g] = vreinterpretq_s8_u8(vandq_u8(v, m4));
        w[2 * g + 1] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
    }
    w
}

#[inline(always)]
unsafe fn q4k<const TN: usize, M: Mac>(groups: &[Q4KGroup], x: &[BlockA32], out: &mut [[f32; 16]]) {
    let stride = 8 * groups.len();
    for q in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); TN];
        for (b, g) in groups.iter().enumerate() {
            let d = vld1q_f32(g.d.as_ptr().add(QUARTER * q));
            let dmin = vld1q_f32(g.dmin.as_ptr().add(QUARTER * q));
            for j in 0..8 {
                let scf = vmulq_f32(d, u8_f32(g.sc[j].as_ptr().add(QUARTER * q)));
                let mnf = vmulq_f32(dmin, u8_f32(g.mn[j].as_ptr().add(QUARTER * q)));
                let w = nibbles(g.qs[j].as_ptr(), q);
                let neg = |a: &BlockA32| a.neg32;
                sub_tile::<M, TN, 8, 8>(
                    &w,
                    false,
                    scf,
                    mnf,
                    x,
                    stride,
                    8 * b + j,
                    0,
                    neg,
                    &mut acc,
                );
            }
        }
        store(&acc, q, out);
    }
}

#[inline(always)]
unsafe fn q6k<const TN: usize, M: Mac>(groups: &[Q6KGroup], x: &[BlockA32], out: &mut [[f32; 16]]) {
    let stride = 8 * groups.len();
    let m4 = vdupq_n_u8(0x0f);
    let m30 = vdupq_n_u8(0x30);
    for q in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); TN];
        for (b, g) in groups.iter().enumerate() {
            let d = vld1q_f32(g.d.as_ptr().add(QUARTER * q));
            for gg in 0..16 {
                let scf = vmulq_f32(d, i8_f32(g.sc[gg].as_ptr().add(QUARTER * q)));
                let qp = g.q[gg].as_ptr().add(16 * q);
                let l0 = vld1q_u8(qp);
                let l1 = vld1q_u8(qp.add(64));
                let hb = vld1q_u8(qp.add(128));
                let w = [
                    vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8::<4>(hb), m30)),
                    vorrq_u8(vshrq_n_u8::<4>(l0), vandq_u8(vshlq_n_u8::<2>(hb), m30)),
                    vorrq_u8(vandq_u8(l1, m4), vandq_u8(hb, m30)),
                    vorrq_u8(vshrq_n_u8::<4>(l1), vandq_u8(vshrq_n_u8::<2>(hb), m30)),
                ]
                .map(|v| vreinterpretq_s8_u8(v));
                let half = gg % 2;
                let neg = move |a: &BlockA32| a.neg16x32[half];
                let idx = 8 * b + gg / 2;
                sub_tile::<M, TN, 4, 4>(
                    &w,
                    false,
                    scf,
                    scf,
                    x,
                    stride,
                    idx,
                    16 * half,
                    neg,
                    &mut acc,
                );
            }
        }
        store(&acc, q, out);
    }
}

#[inline(always)]
unsafe fn q41<const TN: usize, M: Mac>(groups: &[Q41Group], x: &[BlockA32], out: &mut [[f32; 16]]) {
    let stride = groups.len();
    for q in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); TN];
        for (j, g) in groups.iter().enumerate() {
            let scf = f16_f32(g.d.as_ptr().add(QUARTER * q));
            let mnf = vsubq_f32(vdupq_n_f32(0.0), f16_f32(g.m.as_ptr().add(QUARTER * q)));
            let w = nibbles(g.qs.as_ptr(), q);
            let neg = |a: &BlockA32| a.neg32;
            sub_tile::<M, TN, 8, 8>(&w, false, scf, mnf, x, stride, j, 0, neg, &mut acc);
        }
        store(&acc, q, out);
    }
}

#[inline(always)]
unsafe fn q50<const TN: usize, M: Mac>(groups: &[Q50Group], x: &[BlockA32], out: &mut [[f32; 16]]) {
    let stride = groups.len();
    let m10 = vdupq_n_u8(0x10);
    for q in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); TN];
        for (j, g) in groups.iter().enumerate() {
            let scf = f16_f32(g.d.as_ptr().add(QUARTER * q));
            let mnf = vmulq_f32(scf, vdupq_n_f32(16.0));
            let mut w = nibbles(g.qs.as_ptr(), q);
            let hb = vld1q_u8(g.qh.as_ptr().add(16 * q));
            // Bit k of each byte is the fifth bit of vector k: move it to bit 4.
            let hs = [
                vshlq_n_u8::<4>(hb),
                vshlq_n_u8::<3>(hb),
                vshlq_n_u8::<2>(hb),
                vshlq_n_u8::<1>(hb),
                hb,
                vshrq_n_u8::<1>(hb),
                vshrq_n_u8::<2>(hb),
                vshrq_n_u8::<3>(hb),
            ];
            for (wk, hk) in w.iter_mut().zip(hs) {
                *wk = vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(*wk), vandq_u8(hk, m10)));
            }
            let neg = |a: &BlockA32| a.neg32;
            sub_tile::<M, TN, 8, 8>(&w, false, scf, mnf, x, stride, j, 0, neg, &mut acc);
        }
        store(&acc, q, out);
    }
}

#[inline(always)]
unsafe fn q80<const TN: usize, M: Mac>(groups: &[Q80Group], x: &[BlockA32], out: &mut [[f32; 16]]) {
    let stride = groups.len();
    let flip = vdupq_n_u8(0x80);
    for q in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); TN];
        for (j, g) in groups.iter().enumerate() {
            let scf = f16_f32(g.d.as_ptr().add(QUARTER * q));
            let mnf = vmulq_f32(scf, vdupq_n_f32(128.0));
            let mut w = [vdupq_n_s8(0); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                // q = u − 128 as i8.
                let u = vld1q_u8(g.qs.as_ptr().add(64 * k + 16 * q));
                *wk = vreinterpretq_s8_u8(veorq_u8(u, flip));
            }
            let neg = |a: &BlockA32| a.neg32;
            sub_tile::<M, TN, 8, 2>(&w, true, scf, mnf, x, stride, j, 0, neg, &mut acc);
        }
        store(&acc, q, out);
    }
}

tile_passes!(dispatch_q4k, "neon", q4k, Widen, Q4KGroup, TILE);
tile_passes!(dispatch_q6k, "neon", q6k, Widen, Q6KGroup, TILE);
tile_passes!(dispatch_q41, "neon", q41, Widen, Q41Group, TILE);
tile_passes!(dispatch_q50, "neon", q50, Widen, Q50Group, TILE);
tile_passes!(dispatch_q80, "neon", q80, Widen, Q80Group, TILE);
tile_passes!(dispatch_q4k_dot, "neon,dotprod", q4k, Dot, Q4KGroup, TILE);
tile_passes!(dispatch_q6k_dot, "neon,dotprod", q6k, Dot, Q6KGroup, TILE);
tile_passes!(dispatch_q41_dot, "neon,dotprod", q41, Dot, Q41Group, TILE);
tile_passes!(dispatch_q50_dot, "neon,dotprod", q50, Dot, Q50Group, TILE);
tile_passes!(dispatch_q80_dot, "neon,dotprod", q80, Dot, Q80Group, TILE);

/// NEON twin of [`BlockA32::quantize`]: the same operations in the same order per element
/// (multiply, magic-number rounding, clamp, multiply, subtract; never fused), so the same bits.
/// `fmaxnm` for the maximum ignores a NaN as `f32::max` does, and the clamp's `fmin`/`fmax`
/// keep it so the conversion gives 0 as the scalar cast does.
#[target_feature(enable = "neon")]
pub(super) unsafe fn quantize(x: &[f32]) -> BlockA32 {
    let v: [float32x4_t; 8] = std::array::from_fn(|i| vld1q_f32(x.as_ptr().add(4 * i)));
    let mut m = vdupq_n_f32(0.0);
    for vi in v {
        m = vmaxnmq_f32(m, vabsq_f32(vi));
    }
    let amax = vmaxnmvq_f32(m);
    let mut b = BlockA32::zero();
    if !BlockA32::quantizable(amax) {
        return b;
    }
    let d1 = amax / 127.0;
    let d2 = d1 / 128.0;
    let (i1, i2) = (vdupq_n_f32(1.0 / d1), vdupq_n_f32(1.0 / d2));
    let magic = vdupq_n_f32(12_582_912.0);
    let (lo, hi) = (vdupq_n_f32(-127.0), vdupq_n_f32(127.0));
    let d1v = vdupq_n_f32(d1);
    let mut sums = [0i32; 2];
    let mut c1 = [vdupq_n_s32(0); 8];
    let mut c2 = [vdupq_n_s32(0); 8];
    for (i, vi) in v.iter().enumerate() {
        let q1 = vsubq_f32(vaddq_f32(vmulq_f32(*vi, i1), magic), magic);
        let q1 = vmaxq_f32(vminq_f32(q1, hi), lo);
        let r = vsubq_f32(*vi, vmulq_f32(q1, d1v));
        let q2 = vsubq_f32(vaddq_f32(vmulq_f32(r, i2), magic), magic);
        let q2 = vmaxq_f32(vminq_f32(q2, hi), lo);
        c1[i] = vcvtq_s32_f32(q1);
        c2[i] = vcvtq_s32_f32(q2);
        sums[i / 4] += vaddvq_s32(vaddq_s32(vshlq_n_s32::<7>(c1[i]), c2[i]));
    }
    for j in 0..4 {
        let n1 = vcombine_s16(vmovn_s32(c1[2 * j]), vmovn_s32(c1[2 * j + 1]));
        let n2 = vcombine_s16(vmovn_s32(c2[2 * j]), vmovn_s32(c2[2 * j + 1]));
        vst1_s8(b.q1.as_mut_ptr().add(8 * j), vmovn_s16(n1));
        vst1_s8(b.q2.as_mut_ptr().add(8 * j), vmovn_s16(n2));
    }
    b.finish_sums(d2, sums[0], sums[1]);
    b
}
