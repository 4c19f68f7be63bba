//! AVX2 twins of the grouped kernels, for CPUs without AVX-512 VNNI (AMD Zen 2/3, Intel before
//! Ice Lake, Skylake-SP's AVX-512 without VNNI).
//!
//! Why: without them those CPUs multiply these weights through the 32-element formats with f32
//! activations, 3.6× slower per decode and 5.4× per 8-token window than the integer kernels on
//! SmolLM2 (measured on one CPU with `--isa avx2` against `--isa avx512`).
//!
//! How: a 64-byte group vector (16 rows × 4 codes) is two ymm halves of 8 rows, each half its
//! own pass over the row group. VNNI's `vpdpbusd` becomes `vpmaddubsw` (u8 × i8 pairs summed to
//! i16) then `vpmaddwd` by ones into i32 lanes. The pair sums cannot saturate: activations are
//! in [−127, 127] ([`BlockA32::quantize`] clamps them), so a pair is at most 2·15·127 = 3810
//! for 4-bit codes, 7874 for 5-bit and 16002 for 6-bit, and runs of 8, 4 and 2 code vectors are
//! summed in i16 before widening (30480, 31496, 32004 < 32767). Q8_0's codes, stored as
//! `q + 128` for VNNI, would reach 2·255·127: its kernel multiplies |q| by x·sign(q) (at most
//! 2·128·127 = 32512) and adds back the 128·Σx that VNNI's unsigned codes carry.
//!
//! CPUs with AVX-VNNI but no AVX-512 (Intel Alder Lake and later clients, Sierra Forest) run the
//! same kernels with `vpdpbusd` on ymm in place of the `vpmaddubsw` pairs (`Isa::Avx2Vnni`).
//!
//! The first of the two passes prefetches the weights ahead, as the VNNI kernels do (the
//! second reads the row group from cache).
//!
//! Every integer sum is exact, and the float steps per row are the VNNI kernels' in the same
//! order, so all these paths give the same bits (tested).

#![allow(unsafe_op_in_unsafe_fn)]

use super::{BlockA32, Q4KGroup, Q6KGroup, Q41Group, Q50Group, Q80Group, Tile};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Rows of a group in one ymm register.
const HALF: usize = 8;

/// Largest token tile one pass keeps in registers (8 decoded code vectors + accumulators);
/// longer tiles run as several passes, each token with the same instructions. Two and eight
/// were slower on SmolLM2's 8-token window. The dispatch below matches 1..=4.
const TILE: usize = 4;

/// The 32-bit word `k` of an activation half (`p` → codes of elements `4k..4k+4`), broadcast.
#[inline(always)]
unsafe fn bcast(p: *const i8, k: usize) -> __m256i {
    _mm256_set1_epi32((p as *const i32).add(k).read_unaligned())
}

/// `Σ_k w[k]·x[k]` per i32 lane: AVX-VNNI's `vpdpbusd` when `VNNI`, else runs of `R` vectors
/// summed in i16 first (see the module docs for why that cannot overflow).
#[inline(always)]
unsafe fn isum<const NV: usize, const R: usize, const VNNI: bool>(
    w: &[__m256i; NV],
    p: *const i8,
) -> __m256i {
    let mut s = _mm256_setzero_si256();
    if VNNI {
        for (k, wk) in w.iter().enumerate() {
            s = _mm256_dpbusd_avx_epi32(s, *wk, bcast(p, k));
        }
        return s;
    }
    let ones = _mm256_set1_epi16(1);
    let mut k = 0;
    while k < NV {
        let mut p16 = _mm256_maddubs_epi16(w[k], bcast(p, k));
        for j in 1..R {
            p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(w[k + j], bcast(p, k + j)));
        }
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p16, ones));
        k += R;
    }
    s
}

/// Codes for a tile: unsigned code vectors (`R` of them summed in i16), or Q8_0's magnitudes
/// and signed codes.
enum Codes<'a, const NV: usize> {
    Unsigned(&'a [__m256i; NV]),
    Signed {
        mag: &'a [__m256i; NV],
        sgn: &'a [__m256i; NV],
    },
}

/// One token's integer sum `S = 128·Σ w·q1 + Σ w·q2` for 8 rows.
#[inline(always)]
unsafe fn token_sum<const NV: usize, const R: usize, const VNNI: bool>(
    codes: &Codes<'_, NV>,
    xb: &BlockA32,
    off: usize,
) -> __m256i {
    let p1 = xb.q1.as_ptr().add(off);
    let p2 = xb.q2.as_ptr().add(off);
    match codes {
        Codes::Unsigned(w) => {
            let s1 = isum::<NV, R, VNNI>(w, p1);
            let s2 = isum::<NV, R, VNNI>(w, p2);
            _mm256_add_epi32(_mm256_slli_epi32(s1, 7), s2)
        }
        Codes::Signed { mag, sgn } => {
            let ones = _mm256_set1_epi16(1);
            let mut s1 = _mm256_setzero_si256();
            let mut s2 = _mm256_setzero_si256();
            for k in 0..NV {
                let a1 = _mm256_sign_epi8(bcast(p1, k), sgn[k]);
                let a2 = _mm256_sign_epi8(bcast(p2, k), sgn[k]);
                s1 = _mm256_add_epi32(
                    s1,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(mag[k], a1), ones),
                );
                s2 = _mm256_add_epi32(
                    s2,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(mag[k], a2), ones),
                );
            }
            // Codes stored as q + 128: S = Σ q·x16 + 128·Σ x16, as VNNI sums it.
            let s = _mm256_add_epi32(_mm256_slli_epi32(s1, 7), s2);
            _mm256_add_epi32(s, _mm256_set1_epi32(128 * xb.sum))
        }
    }
}

/// Adds one sub-block's term for every token of the tile, `(scf·d)·S + mnf·neg`, as
/// [`super::x86`]'s `sub_tile` does for 16 rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sub_tile<const TN: usize, const NV: usize, const R: usize, const VNNI: bool>(
    codes: &Codes<'_, NV>,
    scf: __m256,
    mnf: __m256,
    x: &[BlockA32],
    stride: usize,
    idx: usize,
    off: usize,
    neg: impl Fn(&BlockA32) -> f32,
    acc: &mut [__m256; TN],
) {
    for (t, a) in acc.iter_mut().enumerate() {
        let xb = &x[t * stride + idx];
        let s = token_sum::<NV, R, VNNI>(codes, xb, off);
        *a = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(s),
            _mm256_mul_ps(scf, _mm256_set1_ps(xb.d)),
            *a,
        );
        *a = _mm256_fmadd_ps(mnf, _mm256_set1_ps(neg(xb)), *a);
    }
}

#[inline(always)]
unsafe fn store<const TN: usize>(acc: &[__m256; TN], h: usize, out: &mut [[f32; 16]]) {
    for t in 0..TN {
        _mm256_storeu_ps(out[t].as_mut_ptr().add(HALF * h), acc[t]);
    }
}

#[inline(always)]
unsafe fn u8_f32(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

#[inline(always)]
unsafe fn f16_f32(p: *const half::f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Half `h` of the four 64-byte vectors of a 4-bit sub-block as eight code vectors.
#[inline(always)]
unsafe fn nibbles(qs: *const u8, h: usize) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0f);
    let mut w = [_mm256_setzero_si256(); 8];
    for g in 0..4 {
        let v = _mm256_loadu_si256(qs.add(64 * g + 32 * h) as *const __m256i);
        w[2 * g] = _mm256_and_si256(v, m4);
        w[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    w
}

#[inline(always)]
unsafe fn q4k<const TN: usize, const VNNI: bool>(
    groups: &[Q4KGroup],
    x: &[BlockA32],
    out: &mut [[f32; 16]],
) {
    let stride = 8 * groups.len();
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); TN];
        for (b, g) in groups.iter().enumerate() {
            if h == 0 {
                super::x86::prefetch(g);
            }
            let d = _mm256_loadu_ps(g.d.as_ptr().add(HALF * h));
            let dmin = _mm256_loadu_ps(g.dmin.as_ptr().add(HALF * h));
            for j in 0..8 {
                let scf = _mm256_mul_ps(d, u8_f32(g.sc[j].as_ptr().add(HALF * h)));
                let mnf = _mm256_mul_ps(dmin, u8_f32(g.mn[j].as_ptr().add(HALF * h)));
                let w = nibbles(g.qs[j].as_ptr(), h);
                let c = Codes::Unsigned(&w);
                sub_tile::<TN, 8, 8, VNNI>(
                    &c,
                    scf,
                    mnf,
                    x,
                    stride,
                    8 * b + j,
                    0,
                    |a| a.neg32,
                    &mut acc,
                );
            }
        }
        store(&acc, h, out);
    }
}

#[inline(always)]
unsafe fn q6k<const TN: usize, const VNNI: bool>(
    groups: &[Q6KGroup],
    x: &[BlockA32],
    out: &mut [[f32; 16]],
) {
    let stride = 8 * groups.len();
    let m4 = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); TN];
        for (b, g) in groups.iter().enumerate() {
            if h == 0 {
                super::x86::prefetch(g);
            }
            let d = _mm256_loadu_ps(g.d.as_ptr().add(HALF * h));
            for gg in 0..16 {
                let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    g.sc[gg].as_ptr().add(HALF * h) as *const __m128i
                ));
                let scf = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                let qp = g.q[gg].as_ptr().add(32 * h);
                let l0 = _mm256_loadu_si256(qp as *const __m256i);
                let l1 = _mm256_loadu_si256(qp.add(64) as *const __m256i);
                let hb = _mm256_loadu_si256(qp.add(128) as *const __m256i);
                let w = [
                    _mm256_or_si256(
                        _mm256_and_si256(l0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                        _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30),
                    ),
                    _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(hb, m30)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30),
                    ),
                ];
                let half = gg % 2;
                let neg = move |a: &BlockA32| a.neg16x32[half];
                let c = Codes::Unsigned(&w);
                let idx = 8 * b + gg / 2;
                sub_tile::<TN, 4, 2, VNNI>(&c, scf, scf, x, stride, idx, 16 * half, neg, &mut acc);
            }
        }
        store(&acc, h, out);
    }
}

#[inline(always)]
unsafe fn q41<const TN: usize, const VNNI: bool>(
    groups: &[Q41Group],
    x: &[BlockA32],
    out: &mut [[f32; 16]],
) {
    let stride = groups.len();
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); TN];
        for (j, g) in groups.iter().enumerate() {
            if h == 0 {
                super::x86::prefetch(g);
            }
            let scf = f16_f32(g.d.as_ptr().add(HALF * h));
            let mnf = _mm256_sub_ps(_mm256_setzero_ps(), f16_f32(g.m.as_ptr().add(HALF * h)));
            let w = nibbles(g.qs.as_ptr(), h);
            let c = Codes::Unsigned(&w);
            sub_tile::<TN, 8, 8, VNNI>(&c, scf, mnf, x, stride, j, 0, |a| a.neg32, &mut acc);
        }
        store(&acc, h, out);
    }
}

#[inline(always)]
unsafe fn q50<const TN: usize, const VNNI: bool>(
    groups: &[Q50Group],
    x: &[BlockA32],
    out: &mut [[f32; 16]],
) {
    let stride = groups.len();
    let m10 = _mm256_set1_epi8(0x10);
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); TN];
        for (j, g) in groups.iter().enumerate() {
            if h == 0 {
                super::x86::prefetch(g);
            }
            let scf = f16_f32(g.d.as_ptr().add(HALF * h));
            let mnf = _mm256_mul_ps(scf, _mm256_set1_ps(16.0));
            let mut w = nibbles(g.qs.as_ptr(), h);
            let hb = _mm256_loadu_si256(g.qh.as_ptr().add(32 * h) as *const __m256i);
            // Bit k of each byte is the fifth bit of vector k: move it to bit 4.
            let hs = [
                _mm256_slli_epi16(hb, 4),
                _mm256_slli_epi16(hb, 3),
                _mm256_slli_epi16(hb, 2),
                _mm256_slli_epi16(hb, 1),
                hb,
                _mm256_srli_epi16(hb, 1),
                _mm256_srli_epi16(hb, 2),
                _mm256_srli_epi16(hb, 3),
            ];
            for (wk, hk) in w.iter_mut().zip(hs) {
                *wk = _mm256_or_si256(*wk, _mm256_and_si256(hk, m10));
            }
            let c = Codes::Unsigned(&w);
            sub_tile::<TN, 8, 4, VNNI>(&c, scf, mnf, x, stride, j, 0, |a| a.neg32, &mut acc);
        }
        store(&acc, h, out);
    }
}

#[inline(always)]
unsafe fn q80<const TN: usize, const VNNI: bool>(
    groups: &[Q80Group],
    x: &[BlockA32],
    out: &mut [[f32; 16]],
) {
    let stride = groups.len();
    let flip = _mm256_set1_epi8(-128);
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); TN];
        for (j, g) in groups.iter().enumerate() {
            if h == 0 {
                super::x86::prefetch(g);
            }
            let scf = f16_f32(g.d.as_ptr().add(HALF * h));
            let mnf = _mm256_mul_ps(scf, _mm256_set1_ps(128.0));
            let mut u = [_mm256_setzero_si256(); 8];
            let mut mag = [_mm256_setzero_si256(); 8];
            let mut sgn = [_mm256_setzero_si256(); 8];
            for k in 0..8 {
                u[k] = _mm256_loadu_si256(g.qs.as_ptr().add(64 * k + 32 * h) as *const __m256i);
                if !VNNI {
                    // q = u − 128 as i8; |q| as u8 keeps −128 as 128.
                    sgn[k] = _mm256_xor_si256(u[k], flip);
                    mag[k] = _mm256_abs_epi8(sgn[k]);
                }
            }
            // `vpdpbusd` takes the offset codes as they are, as the AVX-512 kernel does.
            let c = if VNNI {
                Codes::Unsigned(&u)
            } else {
                Codes::Signed {
                    mag: &mag,
                    sgn: &sgn,
                }
            };
            sub_tile::<TN, 8, 1, VNNI>(&c, scf, mnf, x, stride, j, 0, |a| a.neg32, &mut acc);
        }
        store(&acc, h, out);
    }
}

tile_passes!(dispatch_q4k, "avx2,fma,f16c", q4k, false, Q4KGroup, TILE);
tile_passes!(dispatch_q6k, "avx2,fma,f16c", q6k, false, Q6KGroup, TILE);
tile_passes!(dispatch_q41, "avx2,fma,f16c", q41, false, Q41Group, TILE);
tile_passes!(dispatch_q50, "avx2,fma,f16c", q50, false, Q50Group, TILE);
tile_passes!(dispatch_q80, "avx2,fma,f16c", q80, false, Q80Group, TILE);
tile_passes!(
    dispatch_q4k_vnni,
    "avx2,fma,f16c,avxvnni",
    q4k,
    true,
    Q4KGroup,
    TILE
);
tile_passes!(
    dispatch_q6k_vnni,
    "avx2,fma,f16c,avxvnni",
    q6k,
    true,
    Q6KGroup,
    TILE
);
tile_passes!(
    dispatch_q41_vnni,
    "avx2,fma,f16c,avxvnni",
    q41,
    true,
    Q41Group,
    TILE
);
tile_passes!(
    dispatch_q50_vnni,
    "avx2,fma,f16c,avxvnni",
    q50,
    true,
    Q50Group,
    TILE
);
tile_passes!(
    dispatch_q80_vnni,
    "avx2,fma,f16c,avxvnni",
    q80,
    true,
    Q80Group,
    TILE
);

/// [`quantize`] over every block of a row (`x` holds 32 values per block of `out`).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_row(x: &[f32], out: &mut [MaybeUninit<BlockA32>]) {
    for (xb, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        quantize(xb, b);
    }
}

/// SIMD twin of [`BlockA32::quantize`] on AVX2: the same operations in the same order per
/// element, so the same bits (NaN included). Writes `b` in place (see
/// [`super::quantize_into`]).
///
/// A NaN lane is zeroed on load: `maxps`/`minps` return their second operand when either is
/// NaN, so left in, a NaN would knock other lanes out of the maximum and clamp to code +127.
/// The scalar quantizer ignores it in the maximum (`f32::max`) and casts it to code 0, which
/// is exactly what a 0 gives.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize(x: &[f32], b: &mut MaybeUninit<BlockA32>) {
    let mut v = [
        _mm256_loadu_ps(x.as_ptr()),
        _mm256_loadu_ps(x.as_ptr().add(8)),
        _mm256_loadu_ps(x.as_ptr().add(16)),
        _mm256_loadu_ps(x.as_ptr().add(24)),
    ];
    for vi in v.iter_mut() {
        // All ones where `vi` is not NaN (ordered with itself), zero where it is.
        *vi = _mm256_and_ps(*vi, _mm256_cmp_ps::<_CMP_ORD_Q>(*vi, *vi));
    }
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let m = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
        _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
    );
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let amax = lanes.iter().fold(0f32, |a, &b| a.max(b));
    if !BlockA32::quantizable(amax) {
        b.write(BlockA32::zero());
        return;
    }
    let b = b.as_mut_ptr();
    let d1 = amax / 127.0;
    let d2 = d1 / 128.0;
    let (i1, i2) = (_mm256_set1_ps(1.0 / d1), _mm256_set1_ps(1.0 / d2));
    let magic = _mm256_set1_ps(12_582_912.0);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let d1v = _mm256_set1_ps(d1);
    let mut sums = [0i32; 2];
    for (q, vq) in v.iter().enumerate() {
        let q1 = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(*vq, i1), magic), magic);
        let q1 = _mm256_max_ps(_mm256_min_ps(q1, hi), lo);
        let r = _mm256_sub_ps(*vq, _mm256_mul_ps(q1, d1v));
        let q2 = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(r, i2), magic), magic);
        let q2 = _mm256_max_ps(_mm256_min_ps(q2, hi), lo);
        let (mut c1, mut c2) = ([0i32; 8], [0i32; 8]);
        _mm256_storeu_si256(c1.as_mut_ptr() as *mut __m256i, _mm256_cvttps_epi32(q1));
        _mm256_storeu_si256(c2.as_mut_ptr() as *mut __m256i, _mm256_cvttps_epi32(q2));
        for i in 0..8 {
            (*b).q1[8 * q + i] = c1[i] as i8;
            (*b).q2[8 * q + i] = c2[i] as i8;
            // Integers below 2²⁴ in magnitude: exact, as the other quantizers' sums.
            sums[q / 2] += 128 * c1[i] + c2[i];
        }
    }
    BlockA32::write_sums(b, d2, sums[0], sums[1]);
}
