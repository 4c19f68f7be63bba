//! CPU kernels for dspark-serve, each with an exact scalar reference that tests compare against.
//!
//! * [`quant`]: the internal 4-bit / 8-bit block formats and exact decoders from GGML types.
//! * [`grouped`]: Q4_K / Q6_K / Q4_1 / Q5_0 / Q8_0 weights interleaved by 16 rows, multiplied
//!   with 15-bit integer activations on AVX-512 VNNI, or on AVX2, AVX-VNNI, NEON and NEON's
//!   dot product with the same bits.
//! * [`matmul`]: quantized matmul that reads each weight block once for all tokens of a batch,
//!   with AVX-512 / AVX2 paths chosen at run time and a portable fallback.
//! * [`par`]: the thread team a forward's parallel loops run on.
//! * [`ops`]: f32 vector ops (dot, axpy, RMSNorm, SiLU, softmax, RoPE) used by the runtime.
//! * [`accept`]: lossless speculative acceptance (min(1, p/q), residual, bonus) and greedy.
//! * [`sampling`]: sampling transforms (temperature, top-k, top-p, penalties) and seeded sampling.
//! * [`rng`]: the seeded RNG injected everywhere randomness is used.
//! * [`cuda`]: GPU kernels compiled at run time (NVRTC), with the CPU references above.
//!
//! This is the one crate where `unsafe` is allowed (SIMD intrinsics, kernel launches).

pub mod accept;
pub mod cuda;
pub mod grouped;
pub mod matmul;
pub mod ops;
pub mod par;
pub mod quant;
pub mod rng;
pub mod sampling;

pub use matmul::{QMatrix, QWeights};

/// Revision of the kernels' numerics and speed, for caches keyed on them (the SPS(B) profile):
/// bump it when a kernel change makes old measurements stale.
pub const REVISION: &str = "team-6";
pub use quant::{BlockQ4, BlockQ8, GgmlType, InternalFormat};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("shape error: {0}")]
    Shape(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid sampling parameter: {0}")]
    InvalidParam(String),
}

/// The CPU's model name (the CPUID brand string on x86_64, else `model name` from
/// /proc/cpuinfo, else "unknown"), whitespace collapsed. Two CPUs with the same instruction
/// sets can run the same kernels at very different speeds (an AMD EPYC and an Intel Xeon, both
/// with AVX-512 BF16, decode SmolLM2 at 330 and 130 tokens/s), so what is measured on one is
/// keyed on this too.
pub fn cpu_model() -> String {
    let mut name = String::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        if __cpuid(0x8000_0000).eax >= 0x8000_0004 {
            let mut bytes = Vec::with_capacity(48);
            for leaf in 0x8000_0002u32..=0x8000_0004 {
                let r = __cpuid(leaf);
                for v in [r.eax, r.ebx, r.ecx, r.edx] {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
            name = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    if name
        .trim_matches(|c: char| c == '\0' || c.is_whitespace())
        .is_empty()
    {
        name = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.to_string())
            })
            .unwrap_or_default();
    }
    let clean: Vec<&str> = name
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|w| !w.is_empty())
        .collect();
    if clean.is_empty() {
        "unknown".into()
    } else {
        clean.join(" ")
    }
}

/// Instruction set a kernel runs with. Detected once at start ([`Isa::detect`]) and passed down
/// explicitly, so tests can run every path the machine supports side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    /// AVX2 with AVX-VNNI (`vpdpbusd` on ymm, no AVX-512): Intel Alder Lake and later clients,
    /// Sierra Forest's E-core Xeons. Only the grouped integer kernels differ from [`Isa::Avx2`].
    Avx2Vnni,
    Avx512,
    /// AVX-512 with BF16 dot products: activations and decoded weights are rounded to bf16
    /// (8-bit mantissa, relative error 2⁻⁹ per element — no shared block scale, so massive
    /// activation channels do not hurt their neighbours) and accumulated in f32.
    Avx512Bf16,
    /// 64-bit Arm's NEON (every aarch64 CPU).
    Neon,
    /// NEON with the dot-product extension (Armv8.2-A FEAT_DotProd: `sdot`; AWS Graviton 2 and
    /// later, Ampere Altra, Apple M1 and later). Only the grouped integer kernels differ from
    /// [`Isa::Neon`].
    NeonDot,
}

impl Isa {
    /// The fastest path this CPU supports.
    pub fn detect() -> Self {
        *Self::available().last().unwrap_or(&Isa::Scalar)
    }

    /// Every path, slowest first within an architecture.
    pub const ALL: [Isa; 7] = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::Avx2Vnni,
        Isa::Avx512,
        Isa::Avx512Bf16,
        Isa::Neon,
        Isa::NeonDot,
    ];

    /// Every path this CPU supports, slowest first.
    pub fn available() -> Vec<Isa> {
        Self::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// This path if the CPU runs it, else the portable one. Every dispatcher that enters a
    /// `#[target_feature]` kernel goes through this: an `Isa` built by hand for features the
    /// CPU lacks computes the same values slower, never executes an instruction it cannot run.
    #[inline]
    pub fn or_scalar(self) -> Isa {
        if self.is_supported() {
            self
        } else {
            Isa::Scalar
        }
    }

    /// Whether this CPU runs this path (what [`Isa::available`] lists), without allocating.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            // Every AVX2 CPU has F16C too (Haswell, Piledriver on); the kernels use it.
            let avx2 = || {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            };
            let avx512 = || {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512bw")
            };
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2(),
                Isa::Avx2Vnni => avx2() && is_x86_feature_detected!("avxvnni"),
                Isa::Avx512 => avx2() && avx512(),
                Isa::Avx512Bf16 => avx2() && avx512() && is_x86_feature_detected!("avx512bf16"),
                Isa::Neon | Isa::NeonDot => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected;
            match self {
                Isa::Scalar => true,
                Isa::Neon => is_aarch64_feature_detected!("neon"),
                Isa::NeonDot => {
                    is_aarch64_feature_detected!("neon") && is_aarch64_feature_detected!("dotprod")
                }
                _ => false,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == Isa::Scalar
        }
    }

    /// Parses a name (`scalar`, `avx2`, `avx2vnni`, `avx512`, `avx512bf16`, `neon`, `neondot`);
    /// refuses paths this CPU lacks.
    pub fn parse(name: &str) -> Result<Self, KernelError> {
        let isa = match name {
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx2vnni" => Isa::Avx2Vnni,
            "avx512" => Isa::Avx512,
            "avx512bf16" => Isa::Avx512Bf16,
            "neon" => Isa::Neon,
            "neondot" => Isa::NeonDot,
            other => return Err(KernelError::Unsupported(format!("unknown ISA `{other}`"))),
        };
        if !Self::available().contains(&isa) {
            return Err(KernelError::Unsupported(format!(
                "this CPU does not support {name}"
            )));
        }
        Ok(isa)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx2Vnni => "avx2vnni",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Neon => "neon",
            Isa::NeonDot => "neondot",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_named_runs_as_this_cpu_can() {
        // Paths this CPU lacks (built by hand) fall back to the portable ones and agree with
        // them; none executes an instruction the CPU cannot run.
        let a: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32 * 0.11).cos()).collect();
        let want = ops::dot(Isa::Scalar, &a, &b);
        let w = vec![1.0f32; 67];
        let mut norm_want = vec![0.0; 67];
        ops::rms_norm(Isa::Scalar, &a, &w, 1e-6, &mut norm_want);
        for isa in Isa::ALL {
            assert_eq!(isa.or_scalar() == isa, isa.is_supported(), "{isa:?}");
            let got = ops::dot(isa, &a, &b);
            assert!((got - want).abs() < 1e-4, "{isa:?}: {got} vs {want}");
            let mut norm = vec![0.0; 67];
            ops::rms_norm(isa, &a, &w, 1e-6, &mut norm);
            for (x, y) in norm.iter().zip(&norm_want) {
                assert!((x - y).abs() < 1e-4, "{isa:?}");
            }
        }
    }

    #[test]
    fn the_cpu_model_is_one_clean_line() {
        let m = super::cpu_model();
        assert!(!m.is_empty());
        assert!(!m.chars().any(|c| c.is_control()), "{m:?}");
        assert_eq!(m, m.split_whitespace().collect::<Vec<_>>().join(" "));
    }

    #[test]
    fn every_available_path_parses_from_its_name_and_the_baseline_is_there() {
        use super::Isa;
        let avail = Isa::available();
        assert_eq!(avail[0], Isa::Scalar);
        for isa in &avail {
            assert_eq!(Isa::parse(isa.name()).expect("available"), *isa);
        }
        assert!(Isa::parse("sse9").is_err());
        // Every 64-bit Arm CPU has NEON, and it runs the grouped kernels.
        #[cfg(target_arch = "aarch64")]
        {
            assert!(avail.contains(&Isa::Neon), "{avail:?}");
            assert!(crate::grouped::native(Isa::detect()));
        }
        // What the test harness says this CPU is (scripts/test-aarch64.sh runs qemu as two
        // CPUs), so that a detection mistake cannot silently test one path twice.
        if let Ok(want) = std::env::var("DSPARK_EXPECT_ISA") {
            assert_eq!(Isa::detect().name(), want, "{avail:?}");
        }
    }
}
