//! CUDA kernels, compiled at run time with NVRTC and launched through the driver API that
//! `cudarc` loads dynamically: a build needs no CUDA toolkit, and a machine without a driver
//! gets [`GpuError::NoDriver`] from [`Gpu::new`] instead of the panic `cudarc` raises when its
//! libraries are missing.
//!
//! Each kernel has a CPU reference in [`crate::ops`] (and a plain loop for the matmul) that the
//! `gpu_*` tests compare against. Those tests are `#[ignore]`d: they need a device, and
//! `scripts/gpu-check.sh` runs them on one.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

/// Why the GPU path is not available or failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver (libcuda) or NVRTC library on this machine")]
    NoDriver,
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("NVRTC compile: {0}")]
    Compile(String),
    #[error("shape error: {0}")]
    Shape(String),
}

type Result<T> = std::result::Result<T, GpuError>;

fn drv(e: impl std::fmt::Debug) -> GpuError {
    GpuError::Driver(format!("{e:?}"))
}

/// The kernels' CUDA C source. One warp per output element for the matmul (rows of a
/// weight matrix are contiguous, so a warp reads one row coalesced); one block per row for
/// RMSNorm; one thread per element for SwiGLU.
const SOURCE: &str = r#"
extern "C" __global__ void matmul_f32(const float* w, const float* x, float* y,
                                      int rows, int cols, int m) {
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (warp >= (long)rows * m) return;
    int t = (int)(warp / rows), r = (int)(warp % rows);
    const float* wr = w + (long)r * cols;
    const float* xt = x + (long)t * cols;
    float acc = 0.0f;
    for (int c = lane; c < cols; c += 32) acc += wr[c] * xt[c];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffff, acc, o);
    if (lane == 0) y[(long)t * rows + r] = acc;
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* y,
                                    int n, int d, float eps) {
    __shared__ float part[256];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long)row * d;
    float* yr = y + (long)row * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    float inv = rsqrtf(part[0] / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void silu_mul(const float* gu, float* out, int n, int f) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * f) return;
    long t = i / f, j = i % f;
    float g = gu[t * 2 * f + j], u = gu[t * 2 * f + f + j];
    out[i] = g / (1.0f + expf(-g)) * u;
}
"#;

/// Threads per block of the RMSNorm kernel (its shared reduction array has this size).
const NORM_THREADS: u32 = 256;

/// Whether the CUDA driver and NVRTC libraries can be loaded here. Everything else in this
/// module needs both; asking `cudarc` for either without them panics.
pub fn available() -> bool {
    // SAFETY: these only try to open the shared libraries, and report whether they could.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nvrtc::sys::is_culib_present() }
}

/// One device with the kernels compiled for it.
pub struct Gpu {
    stream: Arc<CudaStream>,
    matmul: CudaFunction,
    norm: CudaFunction,
    silu: CudaFunction,
    name: String,
}

/// A weight matrix (rows × cols, f32) resident on the device.
pub struct DeviceMatrix {
    w: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
}

fn dim(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| GpuError::Shape(format!("{what} {x} does not fit a kernel index")))
}

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels for it.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !available() {
            return Err(GpuError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let name = ctx.name().map_err(drv)?;
        let ptx =
            cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| GpuError::Compile(format!("{e:?}")))?;
        let module = ctx.load_module(ptx).map_err(drv)?;
        let f = |n: &str| module.load_function(n).map_err(drv);
        Ok(Self {
            matmul: f("matmul_f32")?,
            norm: f("rms_norm")?,
            silu: f("silu_mul")?,
            stream: ctx.default_stream(),
            name,
        })
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Copies a rows × cols weight matrix (row-major) to the device.
    pub fn upload(&self, w: &[f32], rows: usize, cols: usize) -> Result<DeviceMatrix> {
        if w.len() != rows * cols {
            return Err(GpuError::Shape(format!(
                "{} weights for a {rows} × {cols} matrix",
                w.len()
            )));
        }
        Ok(DeviceMatrix {
            w: self.stream.clone_htod(w).map_err(drv)?,
            rows,
            cols,
        })
    }

    /// `y[t][r] = Σ_c W[r][c] x[t][c]` for the `m` rows of `x`: the same product as
    /// [`crate::QMatrix::matmul`], on weights held in f32.
    pub fn matmul(&self, w: &DeviceMatrix, x: &[f32], m: usize) -> Result<Vec<f32>> {
        if x.len() != m * w.cols {
            return Err(GpuError::Shape(format!(
                "{} inputs for {m} rows of {}",
                x.len(),
                w.cols
            )));
        }
        if m == 0 || w.rows == 0 {
            return Ok(vec![0.0; m * w.rows]);
        }
        let xd = self.stream.clone_htod(x).map_err(drv)?;
        let mut y = self.stream.alloc_zeros::<f32>(m * w.rows).map_err(drv)?;
        let (rows, cols, mm) = (dim(w.rows, "rows")?, dim(w.cols, "cols")?, dim(m, "m")?);
        let threads = (m * w.rows)
            .checked_mul(32)
            .ok_or_else(|| GpuError::Shape("matmul too large".into()))?;
        let cfg = LaunchConfig::for_num_elems(
            u32::try_from(threads).map_err(|_| GpuError::Shape("matmul too large".into()))?,
        );
        let mut b = self.stream.launch_builder(&self.matmul);
        b.arg(&w.w)
            .arg(&xd)
            .arg(&mut y)
            .arg(&rows)
            .arg(&cols)
            .arg(&mm);
        // SAFETY: the arguments match the kernel's signature; every index the kernel reads or
        // writes is below rows × cols (w), m × cols (x) or m × rows (y), the sizes allocated.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        self.stream.clone_dtoh(&y).map_err(drv)
    }

    /// RMSNorm of each of the `n` rows of `x` (width `w.len()`), as [`crate::ops::rms_norm`].
    pub fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
        let d = w.len();
        if d == 0 || x.len() % d != 0 {
            return Err(GpuError::Shape(format!(
                "{} values in rows of {d}",
                x.len()
            )));
        }
        let n = x.len() / d;
        if n == 0 {
            return Ok(Vec::new());
        }
        let xd = self.stream.clone_htod(x).map_err(drv)?;
        let wd = self.stream.clone_htod(w).map_err(drv)?;
        let mut y = self.stream.alloc_zeros::<f32>(x.len()).map_err(drv)?;
        let (nn, dd) = (dim(n, "rows")?, dim(d, "width")?);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(n).map_err(|_| GpuError::Shape("too many rows".into()))?,
                1,
                1,
            ),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.norm);
        b.arg(&xd).arg(&wd).arg(&mut y).arg(&nn).arg(&dd).arg(&eps);
        // SAFETY: one block of NORM_THREADS (the shared array's size) per row; reads and writes
        // stay within row × d + d of buffers of n × d values.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        self.stream.clone_dtoh(&y).map_err(drv)
    }

    /// SwiGLU of each fused `[gate | up]` row of `gate_up` (2·f values a row), as
    /// [`crate::ops::silu_mul`].
    pub fn silu_mul(&self, gate_up: &[f32], f: usize) -> Result<Vec<f32>> {
        if f == 0 || gate_up.len() % (2 * f) != 0 {
            return Err(GpuError::Shape(format!(
                "{} values in fused rows of 2 × {f}",
                gate_up.len()
            )));
        }
        let n = gate_up.len() / (2 * f);
        if n == 0 {
            return Ok(Vec::new());
        }
        let gd = self.stream.clone_htod(gate_up).map_err(drv)?;
        let mut out = self.stream.alloc_zeros::<f32>(n * f).map_err(drv)?;
        let (nn, ff) = (dim(n, "rows")?, dim(f, "width")?);
        let cfg = LaunchConfig::for_num_elems(
            u32::try_from(n * f).map_err(|_| GpuError::Shape("too many values".into()))?,
        );
        let mut b = self.stream.launch_builder(&self.silu);
        b.arg(&gd).arg(&mut out).arg(&nn).arg(&ff);
        // SAFETY: one thread per output; thread i reads gate_up[t·2f + j] and [t·2f + f + j]
        // with t < n, j < f, inside the n × 2f values copied.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        self.stream.clone_dtoh(&out).map_err(drv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::{Isa, ops};

    fn randn(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// Largest |a − b| over max(1, |b|); infinite when the lengths differ or a value is not
    /// finite (`f32::max` would skip a NaN).
    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        if a.len() != b.len() {
            return f32::INFINITY;
        }
        a.iter()
            .zip(b)
            .map(|(x, y)| {
                let e = (x - y).abs() / y.abs().max(1.0);
                if e.is_finite() { e } else { f32::INFINITY }
            })
            .fold(0.0, f32::max)
    }

    #[test]
    fn without_a_driver_the_gpu_is_a_clear_error_not_a_panic() {
        match Gpu::new(0) {
            Ok(g) => {
                assert!(available());
                assert!(!g.name().is_empty());
            }
            Err(e) => {
                let msg = e.to_string();
                if !available() {
                    assert!(matches!(e, GpuError::NoDriver), "{msg}");
                    assert!(msg.contains("CUDA"), "{msg}");
                }
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA device (scripts/gpu-check.sh)"]
    fn gpu_kernels_match_their_cpu_references() {
        let gpu = Gpu::new(0).expect("a CUDA device");
        let mut rng = Rng::new(7);
        for &(rows, cols, m) in &[(1, 1, 1), (37, 65, 3), (576, 576, 8), (1536, 576, 17)] {
            let w = randn(&mut rng, rows * cols);
            let x = randn(&mut rng, m * cols);
            let dw = gpu.upload(&w, rows, cols).expect("upload");
            let y = gpu.matmul(&dw, &x, m).expect("matmul");
            let mut r = vec![0f32; m * rows];
            for t in 0..m {
                for i in 0..rows {
                    r[t * rows + i] = (0..cols)
                        .map(|c| w[i * cols + c] as f64 * x[t * cols + c] as f64)
                        .sum::<f64>() as f32;
                }
            }
            let e = max_rel(&y, &r);
            assert!(e < 1e-4, "matmul {rows}×{cols}, m {m}: {e}");
        }
        for &(n, d) in &[(1, 1), (3, 576), (9, 1000)] {
            let x = randn(&mut rng, n * d);
            let w = randn(&mut rng, d);
            let y = gpu.rms_norm(&x, &w, 1e-5).expect("rms_norm");
            let mut r = vec![0f32; n * d];
            for (xr, rr) in x.chunks_exact(d).zip(r.chunks_exact_mut(d)) {
                ops::rms_norm(Isa::Scalar, xr, &w, 1e-5, rr);
            }
            let e = max_rel(&y, &r);
            assert!(e < 1e-5, "rms_norm {n}×{d}: {e}");
        }
        for &(n, f) in &[(1, 1), (4, 1536)] {
            let gu = randn(&mut rng, n * 2 * f);
            let y = gpu.silu_mul(&gu, f).expect("silu_mul");
            let mut r = vec![0f32; n * f];
            for (g, o) in gu.chunks_exact(2 * f).zip(r.chunks_exact_mut(f)) {
                ops::silu_mul(Isa::Scalar, g, o);
            }
            // Both exps are within a few ulp; the division and product add a few more.
            let e = max_rel(&y, &r);
            assert!(e < 1e-5, "silu_mul {n}×{f}: {e}");
        }
        // Bad shapes are errors, not launches.
        let dw = gpu.upload(&[1.0; 6], 2, 3).expect("upload");
        assert!(gpu.matmul(&dw, &[1.0; 4], 1).is_err());
        assert!(gpu.upload(&[1.0; 5], 2, 3).is_err());
        assert!(gpu.rms_norm(&[1.0; 5], &[1.0; 2], 1e-5).is_err());
    }
}
