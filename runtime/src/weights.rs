//! Linear layers over either the quantized kernels or dense f32 (dequantized reference weights
//! and Hugging Face checkpoints).

use crate::Result;
use crate::gguf::RawTensor;
use candle_core::{Device, Tensor};
use kernels::GgmlType;
use kernels::grouped::{repack_q4k, repack_q6k, repack_q41, repack_q50, repack_q80};
use kernels::quant::{repack_q4, repack_q8};
use kernels::{InternalFormat, Isa, QMatrix, QWeights};

/// One weight matrix, `rows` outputs × `cols` inputs.
pub enum Linear {
    /// Quantized blocks: 16-row groups with integer kernels, or 32-element blocks with f32 /
    /// bf16 kernels (see [`Linear::from_raw`]).
    Quant(QMatrix),
    /// Dense f32 `[rows, cols]`, multiplied with candle's f32 GEMM.
    Dense(Tensor),
}

impl Linear {
    /// Builds from raw GGUF bytes. Quantized types are repacked unless `dense` asks for the
    /// f32-dequantized reference: into the 16-row grouped layout of the integer kernels when
    /// `grouped` (the CPU has AVX-512 VNNI or AVX2) and the shape fits, else into the
    /// 32-element formats of the f32 / bf16 kernels.
    pub fn from_raw(raw: &RawTensor, dense: bool, grouped: bool) -> Result<Self> {
        let (rows, cols) = match raw.dims.as_slice() {
            [r, c] => (*r, *c),
            d => {
                return Err(crate::RuntimeError::Config(format!(
                    "expected a matrix, got dims {d:?}"
                )));
            }
        };
        let Some(fmt) = raw.ty.internal().filter(|_| !dense) else {
            let v = kernels::quant::dequantize(raw.ty, &raw.data, rows * cols)?;
            return Ok(Linear::Dense(Tensor::from_vec(
                v,
                (rows, cols),
                &Device::Cpu,
            )?));
        };
        let (data, n) = (&raw.data, rows * cols);
        let w = if grouped && kernels::grouped::fits(raw.ty, rows, cols) {
            match raw.ty {
                GgmlType::Q4K => QWeights::Q4K(repack_q4k(data, rows, cols)?),
                GgmlType::Q6K => QWeights::Q6K(repack_q6k(data, rows, cols)?),
                GgmlType::Q4_1 => QWeights::Q41(repack_q41(data, rows, cols)?),
                GgmlType::Q5_0 => QWeights::Q50(repack_q50(data, rows, cols)?),
                _ => QWeights::Q80(repack_q80(data, rows, cols)?),
            }
        } else {
            match fmt {
                InternalFormat::Q4 | InternalFormat::Q4K => {
                    QWeights::Q4(repack_q4(raw.ty, data, n)?)
                }
                InternalFormat::Q8 | InternalFormat::Q6K => {
                    QWeights::Q8(repack_q8(raw.ty, data, n)?)
                }
            }
        };
        Ok(Linear::Quant(QMatrix::new(rows, cols, w)?))
    }

    pub fn rows(&self) -> usize {
        match self {
            Linear::Quant(q) => q.rows,
            Linear::Dense(t) => t.dims()[0],
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Linear::Quant(q) => q.cols,
            Linear::Dense(t) => t.dims()[1],
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Linear::Quant(q) => q.bytes(),
            Linear::Dense(t) => t.elem_count() * 4,
        }
    }

    /// The weights in f32, row-major (dequantized when quantized).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        match self {
            Linear::Quant(q) => {
                let mut out = vec![0f32; q.rows * q.cols];
                for (r, o) in out.chunks_exact_mut(q.cols).enumerate() {
                    q.dequantize_row(r, o);
                }
                Ok(out)
            }
            Linear::Dense(t) => Ok(t.flatten_all()?.to_vec1::<f32>()?),
        }
    }

    /// Stacks along rows when every part has the same representation (fused QKV / gate-up).
    pub fn concat(parts: Vec<Linear>) -> Result<Vec<Linear>> {
        let all_quant = parts.iter().all(|p| matches!(p, Linear::Quant(_)));
        let all_dense = parts.iter().all(|p| matches!(p, Linear::Dense(_)));
        if all_quant {
            let qs: Vec<&QMatrix> = parts
                .iter()
                .filter_map(|p| match p {
                    Linear::Quant(q) => Some(q),
                    Linear::Dense(_) => None,
                })
                .collect();
            if let Some(q) = QMatrix::concat_rows(&qs) {
                return Ok(vec![Linear::Quant(q)]);
            }
        } else if all_dense {
            let ts: Vec<&Tensor> = parts
                .iter()
                .filter_map(|p| match p {
                    Linear::Dense(t) => Some(t),
                    Linear::Quant(_) => None,
                })
                .collect();
            return Ok(vec![Linear::Dense(Tensor::cat(&ts, 0)?)]);
        }
        Ok(parts)
    }

    /// `out[t][r] = Σ_c W[r][c] x[t][c]` for `m` rows of `x`.
    pub fn forward(&self, x: &[f32], m: usize, out: &mut [f32], isa: Isa) -> Result<()> {
        match self {
            Linear::Quant(q) => {
                q.matmul(&x[..m * q.cols], m, &mut out[..m * q.rows], isa);
                Ok(())
            }
            Linear::Dense(w) => {
                let cols = w.dims()[1];
                let rows = w.dims()[0];
                let xt = Tensor::from_slice(&x[..m * cols], (m, cols), &Device::Cpu)?;
                let y = xt.matmul(&w.t()?)?;
                let v = y.flatten_all()?.to_vec1::<f32>()?;
                out[..m * rows].copy_from_slice(&v);
                Ok(())
            }
        }
    }
}

/// A group of linears applied to the same input whose outputs are laid side by side
/// (`[q | k | v]`, `[gate | up]`), fused into one matmul when their formats agree.
pub struct Fused {
    parts: Vec<Linear>,
    pub out_dim: usize,
}

impl Fused {
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let out_dim = parts.iter().map(|p| p.rows()).sum();
        Ok(Self {
            parts: Linear::concat(parts)?,
            out_dim,
        })
    }

    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes()).sum()
    }

    /// The fused matrix in f32: the parts' rows one after another (out_dim × cols).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for p in &self.parts {
            out.extend(p.to_f32()?);
        }
        Ok(out)
    }

    pub fn forward(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        isa: Isa,
        tmp: &mut Vec<f32>,
    ) -> Result<()> {
        if self.parts.len() == 1 {
            return self.parts[0].forward(x, m, out, isa);
        }
        let mut off = 0;
        for p in &self.parts {
            let r = p.rows();
            tmp.resize(m * r, 0.0);
            p.forward(x, m, tmp, isa)?;
            for t in 0..m {
                out[t * self.out_dim + off..t * self.out_dim + off + r]
                    .copy_from_slice(&tmp[t * r..(t + 1) * r]);
            }
            off += r;
        }
        Ok(())
    }
}
