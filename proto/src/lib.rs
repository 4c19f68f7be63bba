//! The `dspark.v1` wire protocol (generated from `proto/dspark/v1/dspark.proto`) and the tensor
//! codec: raw little-endian bytes with dtype and shape, checked on decode.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("dspark.v1");
}

pub use v1::*;

/// Largest gRPC message either side accepts (a drafting round for many requests fits easily;
/// anything bigger is a bug or an attack and is refused with `OUT_OF_RANGE`).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("tensor: {0}")]
    Tensor(String),
    #[error("{0}")]
    Invalid(String),
}

impl Tensor {
    /// Encodes f32 values in the given dtype (f16/bf16 halve the bytes).
    pub fn from_f32(values: &[f32], shape: &[usize], dtype: Dtype) -> Self {
        let mut data = Vec::with_capacity(values.len() * 4);
        match dtype {
            Dtype::F16 => {
                for v in values {
                    data.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                }
            }
            Dtype::Bf16 => {
                for v in values {
                    data.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                }
            }
            Dtype::F32 | Dtype::Unspecified => {
                for v in values {
                    data.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        let dtype = if dtype == Dtype::Unspecified {
            Dtype::F32
        } else {
            dtype
        };
        Self {
            dtype: dtype as i32,
            shape: shape.iter().map(|&s| s as u32).collect(),
            data,
        }
    }

    /// Element count; `None` when the shape overflows.
    pub fn numel(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |n, &s| n.checked_mul(s as usize))
    }

    /// Checks that dtype, shape and byte length agree, without decoding; returns the dtype
    /// and element count.
    pub fn check(&self) -> Result<(Dtype, usize), WireError> {
        let dtype = Dtype::try_from(self.dtype)
            .map_err(|_| WireError::Tensor(format!("unknown dtype {}", self.dtype)))?;
        let width = match dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Unspecified => return Err(WireError::Tensor("dtype unspecified".into())),
        };
        let n = self
            .numel()
            .ok_or_else(|| WireError::Tensor("shape overflows".into()))?;
        if n.checked_mul(width) != Some(self.data.len()) {
            return Err(WireError::Tensor(format!(
                "shape {:?} × {width} bytes ≠ {} bytes of data",
                self.shape,
                self.data.len()
            )));
        }
        Ok((dtype, n))
    }

    /// Decodes to f32 (after [`Tensor::check`]).
    pub fn to_f32(&self) -> Result<Vec<f32>, WireError> {
        let (dtype, _) = self.check()?;
        Ok(match dtype {
            Dtype::F32 => self
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => self
                .data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => self
                .data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A top_k past 32 bits reaches the worker as no truncation, never wrapped to a small k.
    #[test]
    fn a_huge_top_k_stays_huge_on_the_wire() {
        for (k, want) in [
            (40usize, 40u32),
            (u32::MAX as usize + 2, u32::MAX),
            (1usize << 32, u32::MAX),
        ] {
            let p = kernels::sampling::SamplingParams {
                top_k: k,
                ..Default::default()
            };
            assert_eq!(Sampling::from(&p).top_k, want, "{k}");
        }
        // Where the answer starts (presence and frequency penalties count from there) crosses
        // the wire, so a draft worker shapes q as the target shapes p.
        let mut p = kernels::sampling::SamplingParams {
            presence_penalty: 1.0,
            ..Default::default()
        };
        p.count_output_from(17);
        assert_eq!(Sampling::from(&p).to_params().unwrap().output_from, 17);
    }

    #[test]
    fn tensor_round_trip_each_dtype() {
        let v: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
        for dt in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let t = Tensor::from_f32(&v, &[4, 6], dt);
            assert_eq!(t.to_f32().unwrap(), v, "{dt:?}");
        }
        assert_eq!(Tensor::from_f32(&v, &[4, 6], Dtype::F16).data.len(), 48);
    }

    #[test]
    fn tensor_rejects_bad_shapes_and_dtypes() {
        let mut t = Tensor::from_f32(&[1.0, 2.0, 3.0], &[3], Dtype::F32);
        t.shape = vec![4];
        assert!(t.to_f32().is_err());
        t.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        assert!(t.to_f32().is_err());
        t.shape = vec![3];
        t.dtype = 99;
        assert!(t.to_f32().is_err());
    }
}

impl From<&kernels::sampling::SamplingParams> for Sampling {
    fn from(p: &kernels::sampling::SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            // Beyond any vocabulary: no truncation either way.
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            min_p: p.min_p,
            logit_bias: p.logit_bias.iter().copied().collect(),
            hold_until: p.hold_until as u64,
            held_ids: p.held_ids.clone(),
            output_from: p.output_from as u64,
        }
    }
}

impl Sampling {
    /// The sampling parameters, validated (a zero `top_p` / `repetition_penalty` on the wire
    /// means "off", as proto3 defaults are zero).
    pub fn to_params(&self) -> Result<kernels::sampling::SamplingParams, WireError> {
        let p = kernels::sampling::SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k as usize,
            top_p: if self.top_p == 0.0 { 1.0 } else { self.top_p },
            repetition_penalty: if self.repetition_penalty == 0.0 {
                1.0
            } else {
                self.repetition_penalty
            },
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            min_p: self.min_p,
            logit_bias: Vec::new(),
            hold_until: usize::try_from(self.hold_until)
                .map_err(|_| WireError::Invalid("sampling: hold_until out of range".into()))?,
            held_ids: self.held_ids.clone(),
            output_from: usize::try_from(self.output_from)
                .map_err(|_| WireError::Invalid("sampling: output_from out of range".into()))?,
        };
        let mut p = p;
        p.set_logit_bias(self.logit_bias.iter().map(|(&t, &b)| (t, b)));
        p.validate()
            .map_err(|e| WireError::Invalid(format!("sampling: {e}")))?;
        Ok(p)
    }
}
