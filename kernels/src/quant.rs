//! Weight formats used by the CPU matmul kernels, and exact decoders from the GGML block types.
//!
//! Every GGML type the default models ship is repacked at load time into one of two internal
//! block formats over 32 consecutive input elements:
//!
//! * [`BlockQ4`]: unsigned 4-bit codes with an f32 scale and an f32 offset, `w = d·q + m`.
//!   Q4_1 and Q4_K (whose 32-wide sub-blocks carry 6-bit scales and mins) map onto it exactly.
//! * [`BlockQ8`]: signed 8-bit codes with one f32 scale per 16-element half, `w = d[i/16]·q`.
//!   Q8_0 and Q5_0 (one scale) and Q6_K (one scale per 16) map onto it exactly.
//!
//! "Exactly" means the f32 value every element decodes to equals what ggml's (and candle's)
//! dequantizer produces bit for bit: the scale products are formed in the same order. Two formats
//! instead of five keep the SIMD kernels few and lets one kernel read each block once for every
//! token of a batch.

use crate::KernelError;
use half::f16;

/// Elements per block of both internal formats.
pub const QK: usize = 32;

/// 4-bit block: `w[i] = d * q[i] + m`, `q[i]` in 0..16. Element `i < 16` is the low nibble of
/// `qs[i]`, element `i >= 16` the high nibble of `qs[i - 16]` (the GGML Q4 layout).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ4 {
    pub d: f32,
    pub m: f32,
    pub qs: [u8; 16],
}

/// 8-bit block: `w[i] = d[i / 16] * qs[i]`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: [f32; 2],
    pub qs: [i8; 32],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        Self {
            d: [0.0; 2],
            qs: [0; 32],
        }
    }
}

impl BlockQ4 {
    #[inline]
    pub fn code(&self, i: usize) -> u8 {
        if i < 16 {
            self.qs[i] & 0x0f
        } else {
            self.qs[i - 16] >> 4
        }
    }
    pub fn dequantize(&self, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate().take(QK) {
            *o = self.d * self.code(i) as f32 + self.m;
        }
    }
    fn from_codes(d: f32, m: f32, q: &[u8; 32]) -> Self {
        let mut qs = [0u8; 16];
        for i in 0..16 {
            qs[i] = (q[i] & 0x0f) | ((q[i + 16] & 0x0f) << 4);
        }
        Self { d, m, qs }
    }
}

impl BlockQ8 {
    pub fn dequantize(&self, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate().take(QK) {
            *o = self.d[i / 16] * self.qs[i] as f32;
        }
    }
}

/// GGML block types this runtime reads. The numeric ids are GGUF's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
}

impl GgmlType {
    /// Elements per GGML block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 => 1,
            Self::Q4_1 | Self::Q5_0 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }
    /// Bytes per GGML block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }
    /// Which internal format the type repacks into (`None` for float types).
    pub fn internal(self) -> Option<InternalFormat> {
        match self {
            Self::Q4_1 => Some(InternalFormat::Q4),
            Self::Q5_0 | Self::Q8_0 => Some(InternalFormat::Q8),
            Self::Q4K => Some(InternalFormat::Q4K),
            Self::Q6K => Some(InternalFormat::Q6K),
            Self::F32 | Self::F16 => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q6K => "Q6_K",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InternalFormat {
    Q4,
    Q8,
    /// Kept as native super-blocks ([`crate::kquant`]).
    Q4K,
    Q6K,
}

fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

fn check_len(ty: GgmlType, raw: &[u8], n_elems: usize) -> Result<usize, KernelError> {
    let be = ty.block_elems();
    if !n_elems.is_multiple_of(be) {
        return Err(KernelError::Shape(format!(
            "{} tensor with {n_elems} elements is not a multiple of its block size {be}",
            ty.name()
        )));
    }
    let n_blocks = n_elems / be;
    // Checked: `n_elems` comes from a file header, and a wrapped product could match `raw`.
    let need = n_blocks.checked_mul(ty.block_bytes()).ok_or_else(|| {
        KernelError::Shape(format!(
            "{} tensor of {n_elems} elements overflows its byte size",
            ty.name()
        ))
    })?;
    if raw.len() != need {
        return Err(KernelError::Shape(format!(
            "{} tensor of {n_elems} elements needs {need} bytes, got {}",
            ty.name(),
            raw.len()
        )));
    }
    Ok(n_blocks)
}

/// Repacks raw GGML bytes of a 4-bit type into [`BlockQ4`] blocks (one per 32 elements).
pub fn repack_q4(ty: GgmlType, raw: &[u8], n_elems: usize) -> Result<Vec<BlockQ4>, KernelError> {
    let n_blocks = check_len(ty, raw, n_elems)?;
    let mut out = Vec::with_capacity(n_elems / QK);
    match ty {
        GgmlType::Q4_1 => {
            for b in raw.chunks_exact(20) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let mut qs = [0u8; 16];
                qs.copy_from_slice(&b[4..20]);
                out.push(BlockQ4 { d, m, qs });
            }
        }
        GgmlType::Q4K => {
            for b in raw.chunks_exact(144) {
                let d = f16_at(b, 0);
                let dmin = f16_at(b, 2);
                let scales = &b[4..16];
                let q = &b[16..144];
                for j in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let d1 = d * sc1 as f32;
                    let mm1 = dmin * m1 as f32;
                    let d2 = d * sc2 as f32;
                    let mm2 = dmin * m2 as f32;
                    let qq = &q[32 * j..32 * j + 32];
                    let mut lo = [0u8; 32];
                    let mut hi = [0u8; 32];
                    for l in 0..32 {
                        lo[l] = qq[l] & 0x0f;
                        hi[l] = qq[l] >> 4;
                    }
                    out.push(BlockQ4::from_codes(d1, -mm1, &lo));
                    out.push(BlockQ4::from_codes(d2, -mm2, &hi));
                }
            }
        }
        other => {
            return Err(KernelError::Unsupported(format!(
                "{} does not repack into the 4-bit format",
                other.name()
            )));
        }
    }
    debug_assert_eq!(out.len(), n_blocks * ty.block_elems() / QK);
    Ok(out)
}

/// The 6-bit scale and min of sub-block `j` from Q4_K's 12 packed bytes (ggml's
/// `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Repacks raw GGML bytes of an 8-bit-representable type into [`BlockQ8`] blocks.
pub fn repack_q8(ty: GgmlType, raw: &[u8], n_elems: usize) -> Result<Vec<BlockQ8>, KernelError> {
    check_len(ty, raw, n_elems)?;
    let mut out = Vec::with_capacity(n_elems / QK);
    match ty {
        GgmlType::Q8_0 => {
            for b in raw.chunks_exact(34) {
                let d = f16_at(b, 0);
                let mut qs = [0i8; 32];
                for i in 0..32 {
                    qs[i] = b[2 + i] as i8;
                }
                out.push(BlockQ8 { d: [d, d], qs });
            }
        }
        GgmlType::Q5_0 => {
            for b in raw.chunks_exact(22) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let ql = &b[6..22];
                let mut qs = [0i8; 32];
                for j in 0..16 {
                    let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                    qs[j] = ((ql[j] & 0x0f) | xh0) as i8 - 16;
                    qs[j + 16] = ((ql[j] >> 4) | xh1) as i8 - 16;
                }
                out.push(BlockQ8 { d: [d, d], qs });
            }
        }
        GgmlType::Q6K => {
            for b in raw.chunks_exact(210) {
                let ql_all = &b[0..128];
                let qh_all = &b[128..192];
                let sc_all = &b[192..208];
                let d = f16_at(b, 208);
                let mut vals = [0i8; 256];
                let mut scales = [0f32; 16];
                for half in 0..2 {
                    let ql = &ql_all[64 * half..];
                    let qh = &qh_all[32 * half..];
                    let y = &mut vals[128 * half..];
                    for l in 0..32 {
                        let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
                        let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                        y[l] = q1;
                        y[l + 32] = q2;
                        y[l + 64] = q3;
                        y[l + 96] = q4;
                    }
                    // Element 128*half + 32*g + l uses sc[8*half + l/16 + 2*g].
                    for g in 0..4 {
                        for s in 0..2 {
                            scales[8 * half + 2 * g + s] =
                                d * (sc_all[8 * half + s + 2 * g] as i8) as f32;
                        }
                    }
                }
                for blk in 0..8 {
                    let mut qs = [0i8; 32];
                    qs.copy_from_slice(&vals[32 * blk..32 * blk + 32]);
                    out.push(BlockQ8 {
                        d: [scales[2 * blk], scales[2 * blk + 1]],
                        qs,
                    });
                }
            }
        }
        other => {
            return Err(KernelError::Unsupported(format!(
                "{} does not repack into the 8-bit format",
                other.name()
            )));
        }
    }
    Ok(out)
}

/// Decodes any supported GGML tensor to f32 (reference path, embeddings, float weights).
pub fn dequantize(ty: GgmlType, raw: &[u8], n_elems: usize) -> Result<Vec<f32>, KernelError> {
    match ty {
        GgmlType::F32 => {
            check_len(ty, raw, n_elems)?;
            Ok(raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        }
        GgmlType::F16 => {
            check_len(ty, raw, n_elems)?;
            Ok(raw
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect())
        }
        _ => match ty.internal() {
            Some(InternalFormat::Q4 | InternalFormat::Q4K) => {
                let blocks = repack_q4(ty, raw, n_elems)?;
                let mut out = vec![0f32; n_elems];
                for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
                    b.dequantize(o);
                }
                Ok(out)
            }
            _ => {
                let blocks = repack_q8(ty, raw, n_elems)?;
                let mut out = vec![0f32; n_elems];
                for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
                    b.dequantize(o);
                }
                Ok(out)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_codes_round_trip() {
        let mut q = [0u8; 32];
        for (i, v) in q.iter_mut().enumerate() {
            *v = (i * 7 % 16) as u8;
        }
        let b = BlockQ4::from_codes(0.5, -1.0, &q);
        for (i, &v) in q.iter().enumerate() {
            assert_eq!(b.code(i), v);
        }
        let mut out = [0f32; 32];
        b.dequantize(&mut out);
        assert_eq!(out[3], 0.5 * q[3] as f32 - 1.0);
    }

    #[test]
    fn wrong_length_is_an_error() {
        assert!(repack_q4(GgmlType::Q4_1, &[0u8; 19], 32).is_err());
        assert!(repack_q8(GgmlType::Q8_0, &[0u8; 34], 31).is_err());
        assert!(repack_q8(GgmlType::Q4_1, &[0u8; 20], 32).is_err());
    }

    #[test]
    fn a_byte_size_past_usize_is_a_shape_error() {
        // 2^(B−2) f32s are 2^B bytes: wrapped, 0, which an empty tensor would match.
        let huge = 1usize << (usize::BITS - 2);
        assert!(matches!(
            dequantize(GgmlType::F32, &[], huge),
            Err(KernelError::Shape(_))
        ));
        assert!(matches!(
            repack_q4(GgmlType::Q4_1, &[], huge),
            Err(KernelError::Shape(_))
        ));
    }
}
