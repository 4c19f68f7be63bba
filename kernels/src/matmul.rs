//! Quantized matmul `out[t][n] = Σ_k W[n][k] · x[t][k]` that reads each weight block once for all
//! tokens of a batch.
//!
//! Why: speculative verification runs k+1 tokens per request through the target. A kernel that
//! streams the weights once per token (candle's CPU path) makes that cost k+1 decodes. Here the
//! loop order is rows (split across threads) → token tiles → blocks: a chunk of weight rows is
//! fetched from memory once and stays in L1/L2 while every token tile is multiplied with it, and
//! each block is decoded to f32 once per tile (8 tokens on AVX-512, 4 on AVX2) in registers.
//!
//! Activations stay f32. Quantizing them to 8 bits (ggml's approach) costs accuracy on models
//! with massive activation channels — on SmolLM2 it flipped the greedy answer to a chat question
//! away from the f32-dequantized reference — while the f32 path costs the same number of vector
//! instructions per token once the decode is shared by a tile. [`QMatrix::matmul_ref`] is the
//! exact scalar reference: decode as ggml does, dot in f32, sum in block order.

use crate::grouped::{
    self, GROUP_ROWS, Group, Q4KGroup, Q6KGroup, Q41Group, Q50Group, Q80Group, QKK,
};
use crate::quant::{BlockQ4, BlockQ8, QK};
use crate::{Isa, KernelError};

/// Packed weights of one matrix, rows × cols, row-major in blocks of 32 along cols.
#[derive(Clone, Debug)]
pub enum QWeights {
    Q4(Vec<BlockQ4>),
    Q8(Vec<BlockQ8>),
    /// Q4_K super-blocks, 16 rows interleaved, integer kernels ([`crate::grouped`]).
    Q4K(Vec<Q4KGroup>),
    /// Q6_K super-blocks, 16 rows interleaved, integer kernels.
    Q6K(Vec<Q6KGroup>),
    /// Q4_1 blocks, 16 rows interleaved, integer kernels.
    Q41(Vec<Q41Group>),
    /// Q5_0 blocks, 16 rows interleaved, integer kernels.
    Q50(Vec<Q50Group>),
    /// Q8_0 blocks, 16 rows interleaved, integer kernels.
    Q80(Vec<Q80Group>),
}

/// `$body` with `$g` bound to the groups of a grouped format (and `$other` for the rest).
macro_rules! grouped {
    ($w:expr, $g:ident => $body:expr, _ => $other:expr) => {
        match $w {
            QWeights::Q4K($g) => $body,
            QWeights::Q6K($g) => $body,
            QWeights::Q41($g) => $body,
            QWeights::Q50($g) => $body,
            QWeights::Q80($g) => $body,
            QWeights::Q4(_) | QWeights::Q8(_) => $other,
        }
    };
}

impl QWeights {
    /// Elements per block of this format.
    pub fn block_elems(&self) -> usize {
        match self {
            QWeights::Q4(_)
            | QWeights::Q8(_)
            | QWeights::Q41(_)
            | QWeights::Q50(_)
            | QWeights::Q80(_) => QK,
            QWeights::Q4K(_) | QWeights::Q6K(_) => QKK,
        }
    }
    /// Whether this is one of the 16-row grouped formats.
    pub fn is_grouped(&self) -> bool {
        !matches!(self, QWeights::Q4(_) | QWeights::Q8(_))
    }
    fn len(&self) -> usize {
        match self {
            QWeights::Q4(b) => b.len(),
            QWeights::Q8(b) => b.len(),
            QWeights::Q4K(b) => b.len(),
            QWeights::Q6K(b) => b.len(),
            QWeights::Q41(b) => b.len(),
            QWeights::Q50(b) => b.len(),
            QWeights::Q80(b) => b.len(),
        }
    }
}

/// A quantized weight matrix (`rows` outputs, `cols` inputs).
///
/// Built only by [`QMatrix::new`] (and [`QMatrix::concat_rows`]), which check the shape
/// against the weights: the fields stay readable, but a private field keeps other crates from
/// writing a literal that skips the check. The kernels rely on it (the SIMD and portable paths
/// index the weights by it), so [`QMatrix::matmul`] checks it again (see its panics).
#[derive(Clone, Debug)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub w: QWeights,
    /// Private: no literal outside this module.
    _sealed: (),
}

/// From this many tokens on, the bf16 path decodes a chunk of rows once and reuses it.
#[cfg(target_arch = "x86_64")]
const PREDECODE_MIN_TOKENS: usize = 16;

/// Largest token tile (AVX-512 holds 8 tokens × 2 accumulators + 2 decoded halves in 32 zmm).
const MAX_TILE: usize = 8;

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of (token, row) cells of the output; see `matmul`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

fn tile_of(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 => 8,
        _ => 4,
    }
}

impl QMatrix {
    pub fn new(rows: usize, cols: usize, w: QWeights) -> Result<Self, KernelError> {
        Self::check_shape(rows, cols, &w)?;
        Ok(Self {
            rows,
            cols,
            w,
            _sealed: (),
        })
    }

    /// The invariants of a matrix (what [`QMatrix::new`] checks and the kernels rely on):
    /// `cols` a multiple of the format's block, `rows` of [`GROUP_ROWS`] for the grouped
    /// formats, and exactly the blocks that shape needs.
    fn check_shape(rows: usize, cols: usize, w: &QWeights) -> Result<(), KernelError> {
        let be = w.block_elems();
        if !cols.is_multiple_of(be) {
            return Err(KernelError::Shape(format!(
                "cols {cols} is not a multiple of {be}"
            )));
        }
        let n = w.len();
        // `cols` is a multiple of `be`, so these are the block counts exactly; checked, so
        // a shape whose count overflows is an error, not a wrapped count.
        let need = match w {
            QWeights::Q4(_) | QWeights::Q8(_) => rows.checked_mul(cols / be),
            _ => {
                if !rows.is_multiple_of(GROUP_ROWS) {
                    return Err(KernelError::Shape(format!(
                        "rows {rows} is not a multiple of {GROUP_ROWS}"
                    )));
                }
                (rows / GROUP_ROWS).checked_mul(cols / be)
            }
        };
        let Some(need) = need else {
            return Err(KernelError::Shape(format!(
                "{rows}x{cols} matrix has more blocks than a usize counts"
            )));
        };
        if n != need {
            return Err(KernelError::Shape(format!(
                "{rows}x{cols} matrix needs {need} blocks, got {n}"
            )));
        }
        Ok(())
    }

    /// Panics unless the fields still satisfy [`QMatrix::new`]'s checks. Every constructor
    /// checks them, so only code that assigned the public fields afterwards can fail here;
    /// no input reaches it.
    fn assert_shape(&self) {
        if let Err(e) = Self::check_shape(self.rows, self.cols, &self.w) {
            panic!("QMatrix fields changed after QMatrix::new checked them: {e}");
        }
    }

    /// Blocks per row.
    pub fn kb(&self) -> usize {
        self.cols / self.w.block_elems()
    }

    /// Bytes of packed weights (what one forward streams from memory).
    pub fn bytes(&self) -> usize {
        match &self.w {
            QWeights::Q4(b) => std::mem::size_of_val(b.as_slice()),
            QWeights::Q8(b) => std::mem::size_of_val(b.as_slice()),
            QWeights::Q4K(b) => std::mem::size_of_val(b.as_slice()),
            QWeights::Q6K(b) => std::mem::size_of_val(b.as_slice()),
            QWeights::Q41(b) => std::mem::size_of_val(b.as_slice()),
            QWeights::Q50(b) => std::mem::size_of_val(b.as_slice()),
            QWeights::Q80(b) => std::mem::size_of_val(b.as_slice()),
        }
    }

    /// Stacks matrices with the same cols and format along rows (fused QKV, gate+up).
    pub fn concat_rows(parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        let cols = first.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let w = match &first.w {
            QWeights::Q4(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q4(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q4(all)
            }
            QWeights::Q8(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q8(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q8(all)
            }
            QWeights::Q4K(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q4K(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q4K(all)
            }
            QWeights::Q6K(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q6K(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q6K(all)
            }
            QWeights::Q41(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q41(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q41(all)
            }
            QWeights::Q50(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q50(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q50(all)
            }
            QWeights::Q80(_) => {
                let mut all = Vec::new();
                for p in parts {
                    let QWeights::Q80(b) = &p.w else { return None };
                    all.extend_from_slice(b);
                }
                QWeights::Q80(all)
            }
        };
        // Valid parts stack to a valid matrix; checked anyway (a part's fields are public).
        QMatrix::new(rows, cols, w).ok()
    }

    /// Dequantizes one row (embedding lookups of a tied head, references).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let kb = self.kb();
        match &self.w {
            QWeights::Q4(b) => {
                for (j, o) in out.chunks_exact_mut(QK).enumerate().take(kb) {
                    b[row * kb + j].dequantize(o);
                }
            }
            QWeights::Q8(b) => {
                for (j, o) in out.chunks_exact_mut(QK).enumerate().take(kb) {
                    b[row * kb + j].dequantize(o);
                }
            }
            w => grouped!(w, g => {
                let (rg, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
                let gs = &g[rg * kb..(rg + 1) * kb];
                for (e, o) in out.iter_mut().enumerate().take(self.cols) {
                    *o = Group::element_of(gs, r, e);
                }
            }, _ => {}),
        }
    }

    /// `out[t * rows + r] = Σ_c W[r][c] x[t * cols + c]` for `m` tokens.
    ///
    /// # Panics
    /// If `x` or `out` is too small, or if the public fields were assigned after
    /// [`QMatrix::new`] into a shape the weights do not have (the SIMD and portable paths
    /// would otherwise index the weights differently and disagree).
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32], isa: Isa) {
        self.assert_shape();
        let n = self.rows;
        let kb = self.kb();
        // Checked: sizes whose product wraps would pass a wrapping check and write past `out`.
        assert!(
            m.checked_mul(self.cols).is_some_and(|v| v <= x.len())
                && m.checked_mul(n).is_some_and(|v| v <= out.len()),
            "matmul buffers too small"
        );
        // An `Isa` built by hand for features this CPU lacks takes the portable path.
        let isa = isa.or_scalar();
        if self.w.is_grouped() {
            return grouped!(&self.w, g => self.matmul_grouped(g, x, m, out, isa), _ => {});
        }
        let threads = crate::par::threads().max(1);
        // Enough chunks to balance threads, big enough that a task amortizes its scheduling cost.
        let chunk = (n / (threads * 4)).clamp(16, 512);
        let tile = tile_of(isa);
        #[cfg(target_arch = "x86_64")]
        let xb: Vec<u16> = if isa == Isa::Avx512Bf16 {
            to_bf16(&x[..m * self.cols])
        } else {
            Vec::new()
        };
        let optr = OutPtr(out.as_mut_ptr());
        let n_chunks = n.div_ceil(chunk);
        let cols = self.cols;
        let work = |c: usize| {
            let r0 = c * chunk;
            let r1 = (r0 + chunk).min(n);
            let optr = optr;
            // Many tokens: decode this chunk's rows to bf16 once, then every token tile reuses
            // them (otherwise each block is re-decoded once per tile).
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx512Bf16 && m >= PREDECODE_MIN_TOKENS {
                let mut wb = vec![0u16; (r1 - r0) * cols];
                for r in r0..r1 {
                    let dst = &mut wb[(r - r0) * cols..(r - r0 + 1) * cols];
                    // SAFETY: Avx512Bf16 is only constructed when the CPU reports it.
                    unsafe {
                        match &self.w {
                            QWeights::Q4(b) => {
                                x86::decode_row_q4_bf16(&b[r * kb..(r + 1) * kb], dst)
                            }
                            QWeights::Q8(b) => {
                                x86::decode_row_q8_bf16(&b[r * kb..(r + 1) * kb], dst)
                            }
                            _ => {}
                        }
                    }
                }
                let mut t0 = 0;
                while t0 < m {
                    let tn = (m - t0).min(tile);
                    let xbt = &xb[t0 * cols..(t0 + tn) * cols];
                    for r in r0..r1 {
                        let mut res = [0f32; MAX_TILE];
                        // SAFETY: as above.
                        unsafe {
                            x86::dispatch_pre_bf16(
                                &wb[(r - r0) * cols..(r - r0 + 1) * cols],
                                xbt,
                                cols,
                                tn,
                                &mut res,
                            )
                        };
                        for (j, v) in res.iter().enumerate().take(tn) {
                            // SAFETY: (t0 + j, r) is inside m × n and owned by this chunk alone.
                            unsafe { *optr.0.add((t0 + j) * n + r) = *v };
                        }
                    }
                    t0 += tn;
                }
                return;
            }
            let mut t0 = 0;
            while t0 < m {
                let tn = (m - t0).min(tile);
                let xt = &x[t0 * cols..(t0 + tn) * cols];
                for r in r0..r1 {
                    let mut res = [0f32; MAX_TILE];
                    #[cfg(target_arch = "x86_64")]
                    if isa == Isa::Avx512Bf16 {
                        let xbt = &xb[t0 * cols..(t0 + tn) * cols];
                        // SAFETY: Avx512Bf16 is only constructed when the CPU reports it.
                        unsafe {
                            match &self.w {
                                QWeights::Q4(b) => x86::dispatch_q4_bf16(
                                    &b[r * kb..(r + 1) * kb],
                                    xbt,
                                    cols,
                                    tn,
                                    &mut res,
                                ),
                                QWeights::Q8(b) => x86::dispatch_q8_bf16(
                                    &b[r * kb..(r + 1) * kb],
                                    xbt,
                                    cols,
                                    tn,
                                    &mut res,
                                ),
                                _ => {}
                            }
                        }
                        for (j, v) in res.iter().enumerate().take(tn) {
                            // SAFETY: (t0 + j, r) is inside m × n and owned by this chunk alone.
                            unsafe { *optr.0.add((t0 + j) * n + r) = *v };
                        }
                        continue;
                    }
                    match &self.w {
                        QWeights::Q4(b) => {
                            dot_q4(isa, &b[r * kb..(r + 1) * kb], xt, cols, tn, &mut res)
                        }
                        QWeights::Q8(b) => {
                            dot_q8(isa, &b[r * kb..(r + 1) * kb], xt, cols, tn, &mut res)
                        }
                        _ => {}
                    }
                    for (j, v) in res.iter().enumerate().take(tn) {
                        // SAFETY: (t0 + j, r) is inside m × n and owned by this chunk alone.
                        unsafe { *optr.0.add((t0 + j) * n + r) = *v };
                    }
                }
                t0 += tn;
            }
        };
        if n_chunks == 1 || m * n * kb < 2048 {
            (0..n_chunks).for_each(work);
        } else {
            crate::par::for_each(n_chunks, work);
        }
    }

    /// The grouped path: activations quantized once per call (per token, so a row's result
    /// never depends on the other tokens of the batch), then groups of 16 rows split across
    /// threads.
    fn matmul_grouped<G: Group + Sync>(
        &self,
        groups: &[G],
        x: &[f32],
        m: usize,
        out: &mut [f32],
        isa: Isa,
    ) {
        let n = self.rows;
        let kb = self.kb();
        let nblk = self.cols / QK;
        let xq = grouped::quantize_rows(x, m, self.cols, isa);
        let n_groups = n / GROUP_ROWS;
        let threads = crate::par::threads().max(1);
        let chunk = (n_groups / (threads * 4)).clamp(1, 32);
        let optr = OutPtr(out.as_mut_ptr());
        let n_chunks = n_groups.div_ceil(chunk);
        let work = |c: usize| {
            let g0 = c * chunk;
            let g1 = (g0 + chunk).min(n_groups);
            let optr = optr;
            let mut t0 = 0;
            while t0 < m {
                let tn = (m - t0).min(grouped::MAX_TILE);
                let xt = &xq.blocks[t0 * nblk..(t0 + tn) * nblk];
                let outl = &xq.outliers[t0..t0 + tn];
                for rg in g0..g1 {
                    let gs = &groups[rg * kb..(rg + 1) * kb];
                    let mut res = [[0f32; GROUP_ROWS]; grouped::MAX_TILE];
                    grouped::dot(isa, gs, xt, tn, &mut res);
                    for (rt, o) in res.iter_mut().zip(outl).filter(|(_, o)| !o.is_empty()) {
                        for (r, v) in rt.iter_mut().enumerate() {
                            *v += grouped::outlier_sum(o, |e| G::element_of(gs, r, e));
                        }
                    }
                    for (j, rt) in res.iter().enumerate().take(tn) {
                        // SAFETY: the 16 cells (t0 + j, rg·16 ..) are inside m × n and owned by
                        // this chunk alone.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                rt.as_ptr(),
                                optr.0.add((t0 + j) * n + rg * GROUP_ROWS),
                                GROUP_ROWS,
                            )
                        };
                    }
                }
                t0 += tn;
            }
        };
        if n_chunks == 1 || m * n * kb < 256 {
            (0..n_chunks).for_each(work);
        } else {
            crate::par::for_each(n_chunks, work);
        }
    }

    /// Scalar reference of the grouped path: exact integer sums, outliers in f32.
    fn matmul_ref_grouped<G: Group>(&self, groups: &[G], x: &[f32], m: usize, out: &mut [f32]) {
        let kb = self.kb();
        let nblk = self.cols / QK;
        let xq = grouped::quantize_rows(x, m, self.cols, Isa::Scalar);
        for row in 0..self.rows {
            let (rg, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
            let gs = &groups[rg * kb..(rg + 1) * kb];
            for t in 0..m {
                let xt = &xq.blocks[t * nblk..(t + 1) * nblk];
                out[t * self.rows + row] = G::reference(gs, r, xt)
                    + grouped::outlier_sum(&xq.outliers[t], |e| G::element_of(gs, r, e));
            }
        }
    }

    /// Exact scalar reference of [`QMatrix::matmul`]: each block decoded exactly as ggml does,
    /// multiplied in f32 and summed in element order. The SIMD paths differ from it only by
    /// f32 summation order (and a fused multiply-add in the decode). For the K-quant formats it
    /// is the reference of their 8-bit-activation kernel: exact integer dots per super-block.
    pub fn matmul_ref(&self, x: &[f32], m: usize, out: &mut [f32]) {
        self.assert_shape();
        if self.w.is_grouped() {
            return grouped!(&self.w, g => self.matmul_ref_grouped(g, x, m, out), _ => {});
        }
        let mut wrow = vec![0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut wrow);
            for t in 0..m {
                let xr = &x[t * self.cols..(t + 1) * self.cols];
                let mut acc = 0f32;
                for (a, b) in wrow.iter().zip(xr) {
                    acc += a * b;
                }
                out[t * self.rows + r] = acc;
            }
        }
    }
}

/// f32 → bf16 bits, round to nearest even (what `vcvtne2ps2bf16` does; NaN stays NaN).
pub fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[cfg(target_arch = "x86_64")]
fn to_bf16(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| bf16_bits(v)).collect()
}

impl QMatrix {
    /// Scalar reference of the bf16 path: weights and activations rounded to bf16, products
    /// accumulated in f32.
    pub fn matmul_ref_bf16(&self, x: &[f32], m: usize, out: &mut [f32]) {
        if self.w.is_grouped() {
            // The grouped kernels do not use bf16 on any ISA.
            return self.matmul_ref(x, m, out);
        }
        let mut wrow = vec![0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut wrow);
            for w in wrow.iter_mut() {
                *w = bf16_to_f32(bf16_bits(*w));
            }
            for t in 0..m {
                let xr = &x[t * self.cols..(t + 1) * self.cols];
                let mut acc = 0f32;
                for (a, b) in wrow.iter().zip(xr) {
                    acc += a * bf16_to_f32(bf16_bits(*b));
                }
                out[t * self.rows + r] = acc;
            }
        }
    }
}

fn dot_q4(isa: Isa, w: &[BlockQ4], x: &[f32], cols: usize, tn: usize, res: &mut [f32; MAX_TILE]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::dispatch_q4_avx512(w, x, cols, tn, res) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni => unsafe { x86::dispatch_q4_avx2(w, x, cols, tn, res) },
        _ => dot_scalar(w, x, cols, tn, res, |b: &BlockQ4, o: &mut [f32; QK]| {
            b.dequantize(o)
        }),
    }
}

fn dot_q8(isa: Isa, w: &[BlockQ8], x: &[f32], cols: usize, tn: usize, res: &mut [f32; MAX_TILE]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::dispatch_q8_avx512(w, x, cols, tn, res) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni => unsafe { x86::dispatch_q8_avx2(w, x, cols, tn, res) },
        _ => dot_scalar(w, x, cols, tn, res, |b: &BlockQ8, o: &mut [f32; QK]| {
            b.dequantize(o)
        }),
    }
}

/// Portable fallback with the same loop order: decode a block once, use it for every token.
fn dot_scalar<B>(
    w: &[B],
    x: &[f32],
    cols: usize,
    tn: usize,
    res: &mut [f32; MAX_TILE],
    dec: impl Fn(&B, &mut [f32; QK]),
) {
    let mut buf = [0f32; QK];
    let mut acc = [[0f32; 8]; MAX_TILE];
    for (b, wb) in w.iter().enumerate() {
        dec(wb, &mut buf);
        for (j, a) in acc.iter_mut().enumerate().take(tn) {
            let xb = &x[j * cols + b * QK..j * cols + (b + 1) * QK];
            for i in 0..QK {
                a[i % 8] += buf[i] * xb[i];
            }
        }
    }
    for j in 0..tn {
        res[j] = acc[j].iter().sum();
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use super::{BlockQ4, BlockQ8, MAX_TILE};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    // ---- AVX-512: a block decodes to two zmm (elements 0..16 and 16..32). ----

    #[inline(always)]
    unsafe fn dec_q4_512(b: &BlockQ4) -> (__m512, __m512) {
        let q = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, m);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
        let d = _mm512_set1_ps(b.d);
        let mn = _mm512_set1_ps(b.m);
        (
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, mn),
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, mn),
        )
    }

    #[inline(always)]
    unsafe fn dec_q8_512(b: &BlockQ8) -> (__m512, __m512) {
        let lo = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
        let hi = _mm_loadu_si128(b.qs.as_ptr().add(16) as *const __m128i);
        (
            _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)),
                _mm512_set1_ps(b.d[0]),
            ),
            _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                _mm512_set1_ps(b.d[1]),
            ),
        )
    }

    macro_rules! body512 {
        ($w:ident, $x:ident, $cols:ident, $res:ident, $tn:ident, $dec:ident) => {{
            let mut a0 = [_mm512_setzero_ps(); $tn];
            let mut a1 = [_mm512_setzero_ps(); $tn];
            let xp = $x.as_ptr();
            for (b, wb) in $w.iter().enumerate() {
                let (w0, w1) = $dec(wb);
                for j in 0..$tn {
                    let p = xp.add(j * $cols + b * 32);
                    a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(p), a0[j]);
                    a1[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(p.add(16)), a1[j]);
                }
            }
            for j in 0..$tn {
                $res[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
            }
        }};
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn q4_512<const TN: usize>(
        w: &[BlockQ4],
        x: &[f32],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        body512!(w, x, cols, res, TN, dec_q4_512)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn q8_512<const TN: usize>(
        w: &[BlockQ8],
        x: &[f32],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        body512!(w, x, cols, res, TN, dec_q8_512)
    }

    // ---- AVX-512 BF16: a block decodes to one vector of 32 bf16; one dot per token. ----

    macro_rules! body_bf16 {
        ($w:ident, $x:ident, $cols:ident, $res:ident, $tn:ident, $dec:ident) => {{
            let mut a0 = [_mm512_setzero_ps(); $tn];
            let mut a1 = [_mm512_setzero_ps(); $tn];
            let xp = $x.as_ptr();
            let kb = $w.len();
            let mut b = 0;
            // Two blocks per step: two independent accumulator chains per token.
            while b + 1 < kb {
                let (l0, h0) = $dec($w.get_unchecked(b));
                let (l1, h1) = $dec($w.get_unchecked(b + 1));
                let w0 = _mm512_cvtne2ps_pbh(h0, l0);
                let w1 = _mm512_cvtne2ps_pbh(h1, l1);
                for j in 0..$tn {
                    let p = xp.add(j * $cols + b * 32);
                    a0[j] = _mm512_dpbf16_ps(
                        a0[j],
                        w0,
                        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _)),
                    );
                    a1[j] = _mm512_dpbf16_ps(
                        a1[j],
                        w1,
                        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                            p.add(32) as *const _
                        )),
                    );
                }
                b += 2;
            }
            if b < kb {
                let (l0, h0) = $dec($w.get_unchecked(b));
                let w0 = _mm512_cvtne2ps_pbh(h0, l0);
                for j in 0..$tn {
                    let p = xp.add(j * $cols + b * 32);
                    a0[j] = _mm512_dpbf16_ps(
                        a0[j],
                        w0,
                        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _)),
                    );
                }
            }
            for j in 0..$tn {
                $res[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
            }
        }};
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn q4_bf16<const TN: usize>(
        w: &[BlockQ4],
        x: &[u16],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        body_bf16!(w, x, cols, res, TN, dec_q4_512)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn q8_bf16<const TN: usize>(
        w: &[BlockQ8],
        x: &[u16],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        body_bf16!(w, x, cols, res, TN, dec_q8_512)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    pub(super) unsafe fn decode_row_q4_bf16(w: &[BlockQ4], out: &mut [u16]) {
        for (b, wb) in w.iter().enumerate() {
            let (l, h) = dec_q4_512(wb);
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
            _mm512_storeu_si512(out.as_mut_ptr().add(b * 32) as *mut _, v);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    pub(super) unsafe fn decode_row_q8_bf16(w: &[BlockQ8], out: &mut [u16]) {
        for (b, wb) in w.iter().enumerate() {
            let (l, h) = dec_q8_512(wb);
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
            _mm512_storeu_si512(out.as_mut_ptr().add(b * 32) as *mut _, v);
        }
    }

    /// Dot of one pre-decoded bf16 row with TN bf16 token rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    unsafe fn pre_bf16<const TN: usize>(
        w: &[u16],
        x: &[u16],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        let mut a0 = [_mm512_setzero_ps(); TN];
        let mut a1 = [_mm512_setzero_ps(); TN];
        let ld = |p: *const u16| {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _))
        };
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let kb = cols / 32;
        let mut b = 0;
        while b + 1 < kb {
            let w0 = ld(wp.add(b * 32));
            let w1 = ld(wp.add(b * 32 + 32));
            for j in 0..TN {
                let p = xp.add(j * cols + b * 32);
                a0[j] = _mm512_dpbf16_ps(a0[j], w0, ld(p));
                a1[j] = _mm512_dpbf16_ps(a1[j], w1, ld(p.add(32)));
            }
            b += 2;
        }
        if b < kb {
            let w0 = ld(wp.add(b * 32));
            for j in 0..TN {
                a0[j] = _mm512_dpbf16_ps(a0[j], w0, ld(xp.add(j * cols + b * 32)));
            }
        }
        for j in 0..TN {
            res[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
        }
    }

    // ---- AVX2: a block decodes to four ymm (8 elements each). ----

    #[inline(always)]
    unsafe fn dec_q4_256(b: &BlockQ4) -> [__m256; 4] {
        let q = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, m);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
        let d = _mm256_set1_ps(b.d);
        let mn = _mm256_set1_ps(b.m);
        let cv = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, mn);
        [
            cv(lo),
            cv(_mm_srli_si128(lo, 8)),
            cv(hi),
            cv(_mm_srli_si128(hi, 8)),
        ]
    }

    #[inline(always)]
    unsafe fn dec_q8_256(b: &BlockQ8) -> [__m256; 4] {
        let lo = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
        let hi = _mm_loadu_si128(b.qs.as_ptr().add(16) as *const __m128i);
        let d0 = _mm256_set1_ps(b.d[0]);
        let d1 = _mm256_set1_ps(b.d[1]);
        let cv =
            |v: __m128i, d: __m256| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
        [
            cv(lo, d0),
            cv(_mm_srli_si128(lo, 8), d0),
            cv(hi, d1),
            cv(_mm_srli_si128(hi, 8), d1),
        ]
    }

    macro_rules! body256 {
        ($w:ident, $x:ident, $cols:ident, $res:ident, $tn:ident, $dec:ident) => {{
            let mut a0 = [_mm256_setzero_ps(); $tn];
            let mut a1 = [_mm256_setzero_ps(); $tn];
            let xp = $x.as_ptr();
            for (b, wb) in $w.iter().enumerate() {
                let wv = $dec(wb);
                for j in 0..$tn {
                    let p = xp.add(j * $cols + b * 32);
                    a0[j] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(p), a0[j]);
                    a1[j] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(p.add(8)), a1[j]);
                    a0[j] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(p.add(16)), a0[j]);
                    a1[j] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(p.add(24)), a1[j]);
                }
            }
            for j in 0..$tn {
                $res[j] = hsum256(_mm256_add_ps(a0[j], a1[j]));
            }
        }};
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_256<const TN: usize>(
        w: &[BlockQ4],
        x: &[f32],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        body256!(w, x, cols, res, TN, dec_q4_256)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn q8_256<const TN: usize>(
        w: &[BlockQ8],
        x: &[f32],
        cols: usize,
        res: &mut [f32; MAX_TILE],
    ) {
        body256!(w, x, cols, res, TN, dec_q8_256)
    }

    /// `tn` (1..=max tile) → the const-generic kernel instantiated for it.
    macro_rules! dispatch {
        ($name:ident, $f:ident, $w:ty, $x:ty, [$($n:literal),*], $last:literal) => {
            pub(super) unsafe fn $name(w: &[$w], x: &[$x], cols: usize, tn: usize, res: &mut [f32; MAX_TILE]) {
                match tn {
                    $($n => $f::<$n>(w, x, cols, res),)*
                    _ => $f::<$last>(w, x, cols, res),
                }
            }
        };
    }
    dispatch!(
        dispatch_q4_avx512,
        q4_512,
        BlockQ4,
        f32,
        [1, 2, 3, 4, 5, 6, 7],
        8
    );
    dispatch!(
        dispatch_q8_avx512,
        q8_512,
        BlockQ8,
        f32,
        [1, 2, 3, 4, 5, 6, 7],
        8
    );
    dispatch!(
        dispatch_pre_bf16,
        pre_bf16,
        u16,
        u16,
        [1, 2, 3, 4, 5, 6, 7],
        8
    );
    dispatch!(
        dispatch_q4_bf16,
        q4_bf16,
        BlockQ4,
        u16,
        [1, 2, 3, 4, 5, 6, 7],
        8
    );
    dispatch!(
        dispatch_q8_bf16,
        q8_bf16,
        BlockQ8,
        u16,
        [1, 2, 3, 4, 5, 6, 7],
        8
    );
    dispatch!(dispatch_q4_avx2, q4_256, BlockQ4, f32, [1, 2, 3], 4);
    dispatch!(dispatch_q8_avx2, q8_256, BlockQ8, f32, [1, 2, 3], 4);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{BlockQ4, BlockQ8};
    use crate::rng::Rng;

    fn random_q4(rng: &mut Rng, n: usize) -> Vec<BlockQ4> {
        (0..n)
            .map(|_| {
                let mut qs = [0u8; 16];
                for q in qs.iter_mut() {
                    *q = (rng.next_u64() & 0xff) as u8;
                }
                BlockQ4 {
                    d: rng.uniform() as f32 * 0.1,
                    m: (rng.uniform() as f32 - 0.5) * 0.2,
                    qs,
                }
            })
            .collect()
    }

    fn random_q8(rng: &mut Rng, n: usize) -> Vec<BlockQ8> {
        (0..n)
            .map(|_| {
                let mut qs = [0i8; 32];
                for q in qs.iter_mut() {
                    *q = (rng.next_u64() & 0xff) as u8 as i8;
                }
                BlockQ8 {
                    d: [rng.uniform() as f32 * 0.01, rng.uniform() as f32 * 0.01],
                    qs,
                }
            })
            .collect()
    }

    fn check(mat: &QMatrix, m: usize, rng: &mut Rng) {
        let mut x: Vec<f32> = (0..m * mat.cols).map(|_| rng.normal() as f32).collect();
        // A massive-activation channel, as real models have.
        if m > 0 && mat.cols > 3 {
            x[3] = 5000.0;
        }
        let mut want = vec![0f32; m * mat.rows];
        mat.matmul_ref(&x, m, &mut want);
        // Tolerance: f32 reassociation error, relative to Σ|w·x|.
        let mut wrow = vec![0f32; mat.cols];
        let mut scale = vec![0f32; m * mat.rows];
        for r in 0..mat.rows {
            mat.dequantize_row(r, &mut wrow);
            for t in 0..m {
                scale[t * mat.rows + r] = wrow
                    .iter()
                    .zip(&x[t * mat.cols..])
                    .map(|(a, b)| (a * b).abs())
                    .sum();
            }
        }
        let mut big = vec![0f32; m * mat.rows];
        for r in 0..mat.rows {
            mat.dequantize_row(r, &mut wrow);
            for t in 0..m {
                big[t * mat.rows + r] = wrow
                    .iter()
                    .zip(&x[t * mat.cols..])
                    .map(|(a, b)| (a * b).abs())
                    .fold(0.0, f32::max);
            }
        }
        let mut want_bf16 = vec![0f32; m * mat.rows];
        mat.matmul_ref_bf16(&x, m, &mut want_bf16);
        for (i, (a, b)) in want.iter().zip(&want_bf16).enumerate() {
            // bf16 rounds each operand by at most 2^-8 relative (unit roundoff).
            assert!(
                (a - b).abs() <= 8e-3 * scale[i] + 1e-6,
                "bf16 ref vs f32 ref {a} {b}"
            );
        }
        for isa in Isa::available() {
            let mut got = vec![f32::NAN; m * mat.rows];
            mat.matmul(&x, m, &mut got, isa);
            let want = if isa == Isa::Avx512Bf16 {
                &want_bf16
            } else {
                &want
            };
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                // The SIMD decode fuses d·q + m into one rounding; where that lands a weight on the
                // other side of a bf16 rounding boundary it moves by one bf16 ulp (2^-8 relative),
                // so the bf16 path also allows a few such flips (bounded by the largest product).
                let flips = if isa == Isa::Avx512Bf16 {
                    4.0 * (1.0 / 256.0) * big[i]
                } else {
                    0.0
                };
                let tol = 1e-5 * scale[i] + 1e-6 + flips;
                assert!(
                    (a - b).abs() <= tol,
                    "{isa:?} elem {i}: ref {a} got {b} tol {tol}"
                );
            }
        }
    }

    #[test]
    fn simd_paths_equal_the_scalar_reference_on_random_shapes() {
        let mut rng = Rng::new(7);
        for &(rows, cols) in &[
            (1usize, 32usize),
            (3, 64),
            (17, 576),
            (64, 96),
            (130, 896),
            (9, 256),
        ] {
            for &m in &[1usize, 2, 3, 4, 5, 7, 8, 9, 17, 40] {
                let q4 = QMatrix::new(
                    rows,
                    cols,
                    QWeights::Q4(random_q4(&mut rng, rows * cols / QK)),
                )
                .unwrap();
                check(&q4, m, &mut rng);
                let q8 = QMatrix::new(
                    rows,
                    cols,
                    QWeights::Q8(random_q8(&mut rng, rows * cols / QK)),
                )
                .unwrap();
                check(&q8, m, &mut rng);
            }
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(bf16_bits(1.0 + 1.0 / 256.0)), 1.0); // tie → even
        assert_eq!(bf16_to_f32(bf16_bits(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
        assert!(bf16_to_f32(bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn concat_rows_keeps_rows_in_order() {
        let mut rng = Rng::new(1);
        let a = QMatrix::new(2, 64, QWeights::Q4(random_q4(&mut rng, 4))).unwrap();
        let b = QMatrix::new(3, 64, QWeights::Q4(random_q4(&mut rng, 6))).unwrap();
        let c = QMatrix::concat_rows(&[&a, &b]).unwrap();
        assert_eq!(c.rows, 5);
        let (mut r1, mut r2) = (vec![0f32; 64], vec![0f32; 64]);
        b.dequantize_row(1, &mut r1);
        c.dequantize_row(3, &mut r2);
        assert_eq!(r1, r2);
        let q8 = QMatrix::new(1, 64, QWeights::Q8(random_q8(&mut rng, 2))).unwrap();
        assert!(QMatrix::concat_rows(&[&a, &q8]).is_none());
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(QMatrix::new(2, 33, QWeights::Q4(vec![])).is_err());
        assert!(QMatrix::new(2, 64, QWeights::Q4(vec![BlockQ4::default(); 3])).is_err());
        assert!(QMatrix::new(usize::MAX, 64, QWeights::Q4(vec![])).is_err());
    }

    /// One Q4_K group of 16 rows × 256 columns, every weight 1.
    fn one_q4k_group() -> QWeights {
        QWeights::Q4K(vec![Q4KGroup {
            d: [1.0; GROUP_ROWS],
            dmin: [0.0; GROUP_ROWS],
            sc: [[1; GROUP_ROWS]; 8],
            mn: [[0; GROUP_ROWS]; 8],
            qs: [[0x11; 256]; 8],
        }])
    }

    #[test]
    fn a_matrix_whose_fields_no_longer_fit_its_weights_is_refused() {
        // The reviewer's shape: one Q4_K group (16 × 256) labelled 16 × 288.
        assert!(QMatrix::new(16, 288, one_q4k_group()).is_err());
        let good = QMatrix::new(16, 256, one_q4k_group()).unwrap();
        let x = vec![1f32; 288];
        let mut out = vec![0f32; 16];
        for isa in Isa::available() {
            good.matmul(&x[..256], 1, &mut out, isa);
            assert!(
                out.iter().all(|&v| (v - 256.0).abs() < 0.5),
                "{isa:?}: {out:?}"
            );
        }
        let mut bad = good.clone();
        bad.cols = 288;
        for isa in Isa::available() {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                bad.matmul(&x, 1, &mut out, isa)
            }));
            assert!(r.is_err(), "{isa:?}");
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bad.matmul_ref(&x, 1, &mut out)
        }));
        assert!(r.is_err());
        // Stacking checks the result too.
        assert!(QMatrix::concat_rows(&[&bad]).is_none());
        assert_eq!(QMatrix::concat_rows(&[&good, &good]).unwrap().rows, 32);
    }
}
