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
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

/// Why the GPU path is not available or failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver (libcuda) or NVRTC library on this machine")]
    NoDriver,
    #[error("no NVRTC library (libnvrtc) on this machine")]
    NoNvrtc,
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

/// The kernels' CUDA C source, compiled after the block sizes below are prepended as
/// `#define`s ([`source`]), so a kernel's shared arrays and strides and its launches use the
/// same numbers. Two matmuls: per-token (a warp per output element; rows of a weight matrix are
/// contiguous, so a warp reads one row coalesced) and token-tiled; one block per row for
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

// The same product with a block of MM_THREADS threads per (output row, tile of TILE tokens):
// the block's threads split the row's columns, so each weight is read once for the tile's
// tokens, and a small matrix still spreads over every multiprocessor (a warp per output row
// leaves most of a large GPU idle at one or a few tokens, and a decode is then latency-bound,
// not bandwidth-bound). Each thread sums its columns in order, each warp reduces its lanes
// with the shuffle tree, and thread j adds the warps' partials in warp order. One kernel per
// tile size; the host picks the smallest that holds the window, up to 8.
//
// The float4 variant (VEC = 4) is for rows of a multiple of 4 values in buffers whose start
// the host checked is 16-byte aligned (so every row is): a quarter of the load instructions,
// which bound the scalar kernel once a tile holds several tokens. Its threads sum four-column
// groups in order, the four products of a group first.
template <int TILE, int VEC>
__device__ void matmul_tile(const float* w, const float* x, float* y, int rows, int cols,
                            int m) {
    __shared__ float part[MM_THREADS / 32][TILE];
    int r = blockIdx.x, t0 = blockIdx.y * TILE;
    if (r >= rows || t0 >= m) return;
    int tn = min(TILE, m - t0);
    int lane = threadIdx.x % 32, wid = threadIdx.x / 32;
    const float* wr = w + (long)r * cols;
    const float* xt = x + (long)t0 * cols;
    float acc[TILE];
#pragma unroll
    for (int j = 0; j < TILE; j++) acc[j] = 0.0f;
    if (VEC == 4) {
        int c4 = cols / 4;
        const float4* wr4 = (const float4*)wr;
        const float4* xt4 = (const float4*)xt;
        for (int c = threadIdx.x; c < c4; c += MM_THREADS) {
            float4 wv = wr4[c];
#pragma unroll
            for (int j = 0; j < TILE; j++) {
                if (j < tn) {
                    float4 xv = xt4[(long)j * c4 + c];
                    acc[j] += wv.x * xv.x + wv.y * xv.y + wv.z * xv.z + wv.w * xv.w;
                }
            }
        }
    } else if (tn == TILE) {
        for (int c = threadIdx.x; c < cols; c += MM_THREADS) {
            float wv = wr[c];
#pragma unroll
            for (int j = 0; j < TILE; j++) acc[j] += wv * xt[(long)j * cols + c];
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += MM_THREADS) {
            float wv = wr[c];
#pragma unroll
            for (int j = 0; j < TILE; j++)
                if (j < tn) acc[j] += wv * xt[(long)j * cols + c];
        }
    }
#pragma unroll
    for (int j = 0; j < TILE; j++) {
        float a = acc[j];
        for (int o = 16; o > 0; o >>= 1) a += __shfl_down_sync(0xffffffff, a, o);
        if (lane == 0) part[wid][j] = a;
    }
    __syncthreads();
    if (threadIdx.x < tn) {
        float a = 0.0f;
        for (int k = 0; k < MM_THREADS / 32; k++) a += part[k][threadIdx.x];
        y[(long)(t0 + threadIdx.x) * rows + r] = a;
    }
}

#define MATMUL_TILED(NAME, TILE, VEC)                                                      \
extern "C" __global__ void NAME(const float* w, const float* x, float* y,                 \
                                int rows, int cols, int m) {                              \
    matmul_tile<TILE, VEC>(w, x, y, rows, cols, m);                                       \
}
MATMUL_TILED(matmul_f32_t1, 1, 1)
MATMUL_TILED(matmul_f32_t2, 2, 1)
MATMUL_TILED(matmul_f32_t4, 4, 1)
MATMUL_TILED(matmul_f32_t8, 8, 1)
MATMUL_TILED(matmul_f32x4_t1, 1, 4)
MATMUL_TILED(matmul_f32x4_t2, 2, 4)
MATMUL_TILED(matmul_f32x4_t4, 4, 4)
MATMUL_TILED(matmul_f32x4_t8, 8, 4)

extern "C" __global__ void rms_norm(const float* x, const float* w, float* y,
                                    int n, int d, float eps) {
    __shared__ float part[NORM_THREADS];
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

extern "C" __global__ void add_assign(float* y, const float* x, long long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

extern "C" __global__ void add_rows(float* y, const float* b, long long n, int d) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += b[i % d];
}

// RoPE over `heads` heads starting at column `offset` of each of n rows of `width` values;
// row t is position pos0 + t. Angles in double, as the CPU table is built.
extern "C" __global__ void rope(float* x, int n, int width, int offset, int heads, int hd,
                                int pos0, float theta, int interleaved) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int half = hd / 2;
    if (i >= (long)n * heads * half) return;
    int t = (int)(i / (heads * half));
    int r = (int)(i % (heads * half));
    int h = r / half, j = r % half;
    double inv = 1.0 / pow((double)theta, 2.0 * j / hd);
    double a = (double)(pos0 + t) * inv;
    float c = (float)cos(a), s = (float)sin(a);
    float* p = x + (long)t * width + offset + h * hd;
    int ia = interleaved ? 2 * j : j;
    int ib = interleaved ? 2 * j + 1 : j + half;
    float x0 = p[ia], x1 = p[ib];
    p[ia] = x0 * c - x1 * s;
    p[ib] = x0 * s + x1 * c;
}

// Causal attention of n query rows at positions pos0 .. pos0 + n − 1 over the keys and values
// of positions 0 .. pos0 + n − 1, split over the keys (as flash-decoding does): a decode step
// or a short window has few (query, head) pairs, and one block each would leave most of the
// GPU idle while each walks thousands of keys. Query row t, head h starts at
// q[q_off + t·q_stride + h·hd]; key row s, KV head g at k[k_off + s·kv_stride + g·hd] (values
// likewise from v): fused [q | k | v] rows of a prefill and a KV cache are the same kernel.
//
// attention_part: one block per (query row, head, chunk of cl keys) writes the chunk's score
// maximum m, its sum l of exp(score − m), and its unnormalized output Σ exp(score − m)·v; its
// scores live in dynamic shared memory (cl floats). Chunks past the query's position write
// nothing (attention_merge never reads them). For windows of up to 64 rows cl is fixed
// (ATTN_CHUNK on the host): a query's keys then split the same way whatever window it comes in,
// so its output has the same bits in a decode step and in a verification window, as greedy
// parity with plain decoding needs; a prefill's follow its size.
extern "C" __global__ void attention_part(const float* q, long long q_off, int q_stride,
                                          const float* k, long long k_off, const float* v,
                                          long long v_off, int kv_stride, float* part_o,
                                          float* part_ml, int n, int pos0, int n_heads,
                                          int n_kv, int hd, float scale, int chunks, int cl) {
    extern __shared__ float sc[];
    __shared__ float red[ATTN_THREADS];
    int t = blockIdx.x, h = blockIdx.y, c = blockIdx.z;
    int last = pos0 + t;
    int s0 = c * cl;
    if (s0 > last) return;
    int s1 = min(s0 + cl, last + 1);
    int g = h / (n_heads / n_kv);
    const float* qr = q + q_off + (long)t * q_stride + h * hd;
    const float* kb = k + k_off + g * hd;
    const float* vb = v + v_off + g * hd;
    // Scores: a warp per key, its lanes over the head's values (a key row is read coalesced).
    int lane = threadIdx.x % 32, wid = threadIdx.x / 32, warps = blockDim.x / 32;
    float mx = __int_as_float(0xff800000);  // −∞ (NVRTC has no math.h macros)
    for (int s = s0 + wid; s < s1; s += warps) {
        const float* kr = kb + (long)s * kv_stride;
        float a = 0.0f;
        for (int d = lane; d < hd; d += 32) a += qr[d] * kr[d];
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffff, a, o);
        a *= scale;
        if (lane == 0) sc[s - s0] = a;
        mx = fmaxf(mx, a);
    }
    red[threadIdx.x] = mx;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    mx = red[0];
    __syncthreads();
    float sum = 0.0f;
    for (int s = s0 + threadIdx.x; s < s1; s += blockDim.x) {
        float e = expf(sc[s - s0] - mx);
        sc[s - s0] = e;
        sum += e;
    }
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    long pi = ((long)t * n_heads + h) * chunks + c;
    float* po = part_o + pi * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = s0; s < s1; s++) acc += sc[s - s0] * vb[(long)s * kv_stride + d];
        po[d] = acc;
    }
    if (threadIdx.x == 0) {
        part_ml[2 * pi] = mx;
        part_ml[2 * pi + 1] = red[0];
    }
}

// attention_merge: one block per (query row, head) rescales its chunks to their common maximum
// and normalizes: out = Σ_c exp(m_c − M)·o_c / Σ_c exp(m_c − M)·l_c.
// Row t's output goes to out[out_off + (t·n_heads + h)·hd ..] (windows launched in row groups).
extern "C" __global__ void attention_merge(const float* part_o, const float* part_ml,
                                           float* out, long long out_off, int pos0,
                                           int n_heads, int hd, int chunks, int cl) {
    int t = blockIdx.x, h = blockIdx.y;
    long base = ((long)t * n_heads + h) * chunks;
    int used = (pos0 + t) / cl + 1;
    float mx = __int_as_float(0xff800000);
    for (int c = 0; c < used; c++) mx = fmaxf(mx, part_ml[2 * (base + c)]);
    float l = 0.0f;
    for (int c = 0; c < used; c++)
        l += part_ml[2 * (base + c) + 1] * expf(part_ml[2 * (base + c)] - mx);
    float inv = 1.0f / l;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int c = 0; c < used; c++)
            a += part_o[(base + c) * hd + d] * expf(part_ml[2 * (base + c)] - mx);
        out[out_off + ((long)t * n_heads + h) * hd + d] = a * inv;
    }
}

// Copies the k and v parts of n fused [q | k | v] rows into rows pos0 .. pos0 + n − 1 of a
// layer's key and value caches (rows of kvd values).
extern "C" __global__ void kv_append(const float* qkv, float* kc, float* vc, int n, int width,
                                     int qd, int kvd, int pos0) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * kvd) return;
    long t = i / kvd, j = i % kvd;
    long dst = (long)(pos0 + t) * kvd + j;
    kc[dst] = qkv[t * width + qd + j];
    vc[dst] = qkv[t * width + qd + kvd + j];
}
"#;

/// [`SOURCE`] with the block sizes the launches use defined for the kernels.
fn source() -> String {
    format!(
        "#define NORM_THREADS {NORM_THREADS}\n#define MM_THREADS {MATMUL_THREADS}\n\
         #define ATTN_THREADS {ATTN_THREADS}\n{SOURCE}"
    )
}

/// Threads per block of the RMSNorm kernel (its shared reduction array has this size).
const NORM_THREADS: u32 = 256;

/// Threads per block of the attention kernels (`ATTN_THREADS`: a power of two, since their
/// reductions halve).
const ATTN_THREADS: u32 = 128;

/// Keys per chunk of `attention_part` for windows of up to [`ATTN_FIXED_ROWS`] rows (decode
/// steps and verification windows), the same whatever their size: chunks that depended on the
/// window summed a query's keys in another order in a decode step than in a verification
/// window, and a near tie could then turn the other way. 64 keys are 32 chunks for a decode
/// step at 2048 positions. Also the shortest chunk a longer window (a prefill, which plain and
/// speculative decoding run alike) is split into.
const ATTN_CHUNK: usize = 64;

/// Windows longer than this are prefills: their chunks follow the window (few long ones when
/// there are many query rows, one of every key for a long prefill), so their partials stay
/// small.
const ATTN_FIXED_ROWS: usize = 64;

/// Blocks `attention_part` aims for on a prefill: a few waves over an H100/H200's 132
/// multiprocessors.
const ATTN_TARGET_BLOCKS: usize = 2048;

/// Partial results (one per query row, head and chunk, head_dim floats each) a launch of
/// `attention_part` keeps: a long prefill goes in groups of rows under this (128 MiB at a
/// head_dim of 64). The tests' few hundred rows take several groups.
#[cfg(not(test))]
const ATTN_MAX_PARTIALS: usize = 1 << 19;
#[cfg(test)]
const ATTN_MAX_PARTIALS: usize = 1 << 10;

/// Longest sequence the attention kernels take: one chunk's scores (up to every key, for a
/// long prefill) must fit the 48 KiB of dynamic shared memory a launch gets without opting in
/// to more.
pub const MAX_ATTENTION_TOKENS: usize = 8192;

/// Compiles the kernels' source with NVRTC alone (no driver, no device) and returns the PTX's
/// length: what a machine with only the NVRTC library can check of the CUDA path.
pub fn compile_check() -> Result<usize> {
    // SAFETY: only tries to open the shared library, and reports whether it could.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::NoNvrtc);
    }
    let ptx =
        cudarc::nvrtc::compile_ptx(source()).map_err(|e| GpuError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src().len())
}

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
    /// The tiled matmul for tiles of 1, 2, 4 and 8 tokens.
    matmul_tiled: [CudaFunction; 4],
    /// The same with 16-byte loads, for rows of a multiple of 4 values.
    matmul_tiled4: [CudaFunction; 4],
    kv_append: CudaFunction,
    norm: CudaFunction,
    silu: CudaFunction,
    add: CudaFunction,
    add_rows: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    attention_merge: CudaFunction,
    name: String,
}

/// A buffer of f32 values resident on the device.
pub struct DeviceBuf {
    d: CudaSlice<f32>,
    len: usize,
}

impl DeviceBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where RoPE applies inside rows of fused projections, and how.
#[derive(Clone, Copy, Debug)]
pub struct RopeArgs {
    /// Values per row (e.g. q_dim + 2·kv_dim for fused QKV rows).
    pub width: usize,
    /// First column of the heads to rotate.
    pub offset: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Position of the first row.
    pub pos0: usize,
    pub theta: f32,
    /// Adjacent pairs (GGUF llama) rather than halves.
    pub interleaved: bool,
}

/// Shapes of fused `[q | k | v]` rows for [`Gpu::attention_dev`] and
/// [`Gpu::attention_cached_dev`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Which matmul kernel [`Gpu::matmul_with`] launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulKernel {
    /// A warp per output element: every token of a window reads its weight row again. One
    /// launch takes at most 2³² threads, so m · rows < 2²⁷ (a prefill of 883 tokens through
    /// Qwen2.5's 151,936-row head is the most); past that it is an error.
    PerToken,
    /// A block per (output row, tile of up to [`MATMUL_TILE`] tokens), its threads splitting
    /// the columns: a row is read once a tile, so a verification window of up to that many
    /// tokens reads the weights once, as a decode does.
    #[default]
    TokenTiled,
}

/// Most tokens a block of the tiled matmul multiplies against one read of a weight row.
pub const MATMUL_TILE: usize = 8;

/// Threads per block of the tiled matmul (`MM_THREADS`: a multiple of 32, at least
/// [`MATMUL_TILE`]).
const MATMUL_THREADS: u32 = 128;

impl AttentionArgs {
    /// The width and count of the rows in `len` values of fused `[q | k | v]` rows; an error
    /// for head counts that do not group or a length that is not whole rows.
    pub fn fused_rows(&self, len: usize) -> Result<(usize, usize)> {
        let (h, kv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        if h == 0 || kv == 0 || hd == 0 || h % kv != 0 {
            return Err(GpuError::Shape(format!(
                "{h} query heads over {kv} KV heads of {hd}"
            )));
        }
        let width = (h + 2 * kv) * hd;
        if !len.is_multiple_of(width) {
            return Err(GpuError::Shape(format!(
                "{len} values in fused rows of {width}"
            )));
        }
        Ok((width, len / width))
    }
}

fn launch_1d(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig::for_num_elems(u32::try_from(n).map_err(
        |_| GpuError::Shape(format!("{n} elements exceed one launch")),
    )?))
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
        // cudarc looks each driver function up on its first call and panics when the library
        // lacks it (a driver older than the bindings): an error here, not a crash.
        std::panic::catch_unwind(|| Self::open(ordinal)).unwrap_or_else(|p| {
            let why = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            Err(GpuError::Driver(format!(
                "the CUDA driver library lacks what this build calls ({why})"
            )))
        })
    }

    fn open(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let name = ctx.name().map_err(drv)?;
        let ptx = cudarc::nvrtc::compile_ptx(source())
            .map_err(|e| GpuError::Compile(format!("{e:?}")))?;
        let module = ctx.load_module(ptx).map_err(drv)?;
        let f = |n: &str| module.load_function(n).map_err(drv);
        Ok(Self {
            matmul: f("matmul_f32")?,
            matmul_tiled: [
                f("matmul_f32_t1")?,
                f("matmul_f32_t2")?,
                f("matmul_f32_t4")?,
                f("matmul_f32_t8")?,
            ],
            matmul_tiled4: [
                f("matmul_f32x4_t1")?,
                f("matmul_f32x4_t2")?,
                f("matmul_f32x4_t4")?,
                f("matmul_f32x4_t8")?,
            ],
            kv_append: f("kv_append")?,
            norm: f("rms_norm")?,
            silu: f("silu_mul")?,
            add: f("add_assign")?,
            add_rows: f("add_rows")?,
            rope: f("rope")?,
            attention: f("attention_part")?,
            attention_merge: f("attention_merge")?,
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

    /// Copies values to the device.
    pub fn buf(&self, x: &[f32]) -> Result<DeviceBuf> {
        if x.is_empty() {
            return Err(GpuError::Shape("an empty buffer".into()));
        }
        Ok(DeviceBuf {
            d: self.stream.clone_htod(x).map_err(drv)?,
            len: x.len(),
        })
    }

    /// An output buffer of `n` values whose readers read only values a kernel wrote first
    /// (every output of a matmul, say, or the partials of the chunks attention uses): no
    /// memset launch, as `zeros` needs.
    fn output(&self, n: usize) -> Result<DeviceBuf> {
        if n == 0 {
            return Err(GpuError::Shape("an empty buffer".into()));
        }
        // SAFETY: uninitialized device memory; each caller hands it to a kernel that writes
        // every value later read or copied back (each launch covers those indices).
        let d = unsafe { self.stream.alloc::<f32>(n) }.map_err(drv)?;
        Ok(DeviceBuf { d, len: n })
    }

    /// A buffer of `n` zeros on the device.
    pub fn zeros(&self, n: usize) -> Result<DeviceBuf> {
        if n == 0 {
            return Err(GpuError::Shape("an empty buffer".into()));
        }
        Ok(DeviceBuf {
            d: self.stream.alloc_zeros::<f32>(n).map_err(drv)?,
            len: n,
        })
    }

    /// Copies a buffer back to the host.
    pub fn read(&self, b: &DeviceBuf) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&b.d).map_err(drv)
    }

    /// `y[t][r] = Σ_c W[r][c] x[t][c]` for the `m` rows of `x`, on the device (the tiled
    /// kernel).
    pub fn matmul_dev(&self, w: &DeviceMatrix, x: &DeviceBuf, m: usize) -> Result<DeviceBuf> {
        self.matmul_with(w, x, m, MatmulKernel::TokenTiled)
    }

    /// [`Gpu::matmul_dev`] with the kernel chosen (they sum in different orders, so their
    /// values differ by rounding).
    pub fn matmul_with(
        &self,
        w: &DeviceMatrix,
        x: &DeviceBuf,
        m: usize,
        kernel: MatmulKernel,
    ) -> Result<DeviceBuf> {
        // `rows` and `cols` are public: a matrix whose fields no longer describe its buffer
        // would send every kernel reading `w[r·cols + c]` past it.
        if w.rows.checked_mul(w.cols) != Some(w.w.len()) {
            return Err(GpuError::Shape(format!(
                "a {} × {} matrix over {} values",
                w.rows,
                w.cols,
                w.w.len()
            )));
        }
        if m == 0 || w.rows == 0 || m.checked_mul(w.cols) != Some(x.len) {
            return Err(GpuError::Shape(format!(
                "{} inputs for {m} rows of {} (a {} × {} matrix)",
                x.len, w.cols, w.rows, w.cols
            )));
        }
        let mut y = self.output(m * w.rows)?;
        let (rows, cols, mm) = (dim(w.rows, "rows")?, dim(w.cols, "cols")?, dim(m, "m")?);
        let (f, cfg) = match kernel {
            MatmulKernel::PerToken => {
                let threads = (m * w.rows)
                    .checked_mul(32)
                    .ok_or_else(|| GpuError::Shape("matmul too large".into()))?;
                (&self.matmul, launch_1d(threads)?)
            }
            MatmulKernel::TokenTiled => {
                let tile = m.next_power_of_two().min(MATMUL_TILE);
                // 16-byte loads need every row start aligned: the buffers' starts (stream-
                // ordered allocations are, but that is checked, not assumed) and rows of a
                // multiple of 4 values.
                let aligned = |b: &CudaSlice<f32>| b.device_ptr(&self.stream).0 % 16 == 0;
                let kernels = if w.cols.is_multiple_of(4) && aligned(&w.w) && aligned(&x.d) {
                    &self.matmul_tiled4
                } else {
                    &self.matmul_tiled
                };
                let f = &kernels[tile.trailing_zeros() as usize];
                let grid = |n: usize| {
                    u32::try_from(n).map_err(|_| GpuError::Shape("matmul too large".into()))
                };
                let tiles = m.div_ceil(tile);
                if tiles > 65_535 {
                    return Err(GpuError::Shape(format!(
                        "{m} tokens in one matmul (at most {} in tiles of {tile})",
                        65_535 * tile
                    )));
                }
                let cfg = LaunchConfig {
                    grid_dim: (grid(w.rows)?, grid(tiles)?, 1),
                    block_dim: (MATMUL_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                (f, cfg)
            }
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&w.w)
            .arg(&x.d)
            .arg(&mut y.d)
            .arg(&rows)
            .arg(&cols)
            .arg(&mm);
        // SAFETY: the arguments match both kernels' signatures; every index either kernel reads
        // or writes is below rows × cols (w), m × cols (x) or m × rows (y), the sizes
        // allocated (the tiled kernel skips tokens at or past m); together their threads or
        // blocks write every one of the m × rows outputs.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(y)
    }

    /// RMSNorm of each row of `x` (width `w.len()`), on the device.
    pub fn rms_norm_dev(&self, x: &DeviceBuf, w: &DeviceBuf, eps: f32) -> Result<DeviceBuf> {
        let d = w.len;
        if !x.len.is_multiple_of(d) {
            return Err(GpuError::Shape(format!("{} values in rows of {d}", x.len)));
        }
        let n = x.len / d;
        let mut y = self.output(x.len)?;
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
        b.arg(&x.d)
            .arg(&w.d)
            .arg(&mut y.d)
            .arg(&nn)
            .arg(&dd)
            .arg(&eps);
        // SAFETY: one block of NORM_THREADS (the shared array's size) per row; reads and writes
        // stay within row × d + d of buffers of n × d values.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(y)
    }

    /// SwiGLU of each fused `[gate | up]` row (2·f values a row), on the device.
    pub fn silu_mul_dev(&self, gate_up: &DeviceBuf, f: usize) -> Result<DeviceBuf> {
        if f == 0 || !gate_up.len.is_multiple_of(2 * f) {
            return Err(GpuError::Shape(format!(
                "{} values in fused rows of 2 × {f}",
                gate_up.len
            )));
        }
        let n = gate_up.len / (2 * f);
        let mut out = self.output(n * f)?;
        let (nn, ff) = (dim(n, "rows")?, dim(f, "width")?);
        let cfg = launch_1d(n * f)?;
        let mut b = self.stream.launch_builder(&self.silu);
        b.arg(&gate_up.d).arg(&mut out.d).arg(&nn).arg(&ff);
        // SAFETY: one thread per output; thread i reads gate_up[t·2f + j] and [t·2f + f + j]
        // with t < n, j < f, inside the n × 2f values.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(out)
    }

    /// `y += x`, element by element.
    pub fn add_dev(&self, y: &mut DeviceBuf, x: &DeviceBuf) -> Result<()> {
        if y.len != x.len {
            return Err(GpuError::Shape(format!(
                "adding {} values to {}",
                x.len, y.len
            )));
        }
        let n = y.len as i64;
        let mut b = self.stream.launch_builder(&self.add);
        b.arg(&mut y.d).arg(&x.d).arg(&n);
        // SAFETY: one thread per element below n, the length of both buffers.
        unsafe { b.launch(launch_1d(y.len)?) }.map_err(drv)?;
        Ok(())
    }

    /// Adds `bias` (one row of d values) to every row of `y`.
    pub fn add_rows_dev(&self, y: &mut DeviceBuf, bias: &DeviceBuf) -> Result<()> {
        if !y.len.is_multiple_of(bias.len) {
            return Err(GpuError::Shape(format!(
                "a bias of {} values on {} values",
                bias.len, y.len
            )));
        }
        let (n, d) = (y.len as i64, dim(bias.len, "width")?);
        let mut b = self.stream.launch_builder(&self.add_rows);
        b.arg(&mut y.d).arg(&bias.d).arg(&n).arg(&d);
        // SAFETY: thread i < n writes y[i] and reads bias[i mod d], d the bias length.
        unsafe { b.launch(launch_1d(y.len)?) }.map_err(drv)?;
        Ok(())
    }

    /// Rotates heads in place, as [`crate::ops::Rope::apply`] at positions pos0, pos0 + 1, ….
    pub fn rope_dev(&self, x: &mut DeviceBuf, a: &RopeArgs) -> Result<()> {
        let hd = a.head_dim;
        if hd == 0 || !hd.is_multiple_of(2) || a.width == 0 || !x.len.is_multiple_of(a.width) {
            return Err(GpuError::Shape(format!(
                "RoPE over heads of {hd} in rows of {} ({} values)",
                a.width, x.len
            )));
        }
        if a.offset + a.heads * hd > a.width {
            return Err(GpuError::Shape(format!(
                "{} heads of {hd} from column {} overflow rows of {}",
                a.heads, a.offset, a.width
            )));
        }
        let n = x.len / a.width;
        let total = n * a.heads * (hd / 2);
        if total == 0 {
            return Ok(());
        }
        dim(a.pos0 + n, "last position")?;
        let (nn, w, off, heads, hdi, pos0) = (
            dim(n, "rows")?,
            dim(a.width, "width")?,
            dim(a.offset, "offset")?,
            dim(a.heads, "heads")?,
            dim(hd, "head_dim")?,
            dim(a.pos0, "position")?,
        );
        let inter = i32::from(a.interleaved);
        let mut b = self.stream.launch_builder(&self.rope);
        b.arg(&mut x.d)
            .arg(&nn)
            .arg(&w)
            .arg(&off)
            .arg(&heads)
            .arg(&hdi)
            .arg(&pos0)
            .arg(&a.theta)
            .arg(&inter);
        // SAFETY: thread i < n·heads·hd/2 touches two values of row t < n inside columns
        // offset .. offset + heads·hd ≤ width (checked), in a buffer of n × width values.
        unsafe { b.launch(launch_1d(total)?) }.map_err(drv)?;
        Ok(())
    }

    /// Causal self-attention of one sequence from position 0 over fused `[q | k | v]` rows:
    /// n × (n_heads · head_dim) outputs, GQA mapping head h to KV head h / (n_heads / n_kv).
    pub fn attention_dev(&self, qkv: &DeviceBuf, a: &AttentionArgs) -> Result<DeviceBuf> {
        let (width, n) = a.fused_rows(qkv.len)?;
        let (qd, kvd) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
        self.attention_launch((qkv, 0, width), (qkv, qd, qkv, qd + kvd, width), n, 0, a)
    }

    /// Causal attention of the n fused `[q | k | v]` rows of `qkv`, at positions pos0 ..
    /// pos0 + n − 1, over rows 0 .. pos0 + n − 1 of a layer's key and value caches (rows of
    /// n_kv_heads · head_dim values, this window's rows already appended by
    /// [`Gpu::kv_append_dev`]).
    pub fn attention_cached_dev(
        &self,
        qkv: &DeviceBuf,
        k_cache: &DeviceBuf,
        v_cache: &DeviceBuf,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<DeviceBuf> {
        let (width, n) = a.fused_rows(qkv.len)?;
        let kvd = a.n_kv_heads * a.head_dim;
        let keys = pos0 + n;
        if k_cache.len != v_cache.len || k_cache.len < keys * kvd {
            return Err(GpuError::Shape(format!(
                "{keys} positions in caches of {} and {} values (rows of {kvd})",
                k_cache.len, v_cache.len
            )));
        }
        self.attention_launch((qkv, 0, width), (k_cache, 0, v_cache, 0, kvd), n, pos0, a)
    }

    /// Writes the k and v parts of the n fused rows of `qkv` into rows pos0 .. pos0 + n − 1 of
    /// a layer's key and value caches.
    pub fn kv_append_dev(
        &self,
        qkv: &DeviceBuf,
        k_cache: &mut DeviceBuf,
        v_cache: &mut DeviceBuf,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<()> {
        let (width, n) = a.fused_rows(qkv.len)?;
        let (qd, kvd) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
        if k_cache.len != v_cache.len || k_cache.len < (pos0 + n) * kvd {
            return Err(GpuError::Shape(format!(
                "rows {pos0} .. {} in caches of {} and {} values (rows of {kvd})",
                pos0 + n,
                k_cache.len,
                v_cache.len
            )));
        }
        let (nn, w, q, kvi, p) = (
            dim(n, "rows")?,
            dim(width, "width")?,
            dim(qd, "q width")?,
            dim(kvd, "kv width")?,
            dim(pos0, "position")?,
        );
        let mut b = self.stream.launch_builder(&self.kv_append);
        b.arg(&qkv.d)
            .arg(&mut k_cache.d)
            .arg(&mut v_cache.d)
            .arg(&nn)
            .arg(&w)
            .arg(&q)
            .arg(&kvi)
            .arg(&p);
        // SAFETY: thread i < n·kvd reads qkv[t·width + qd + kvd + j] < n·width and writes
        // index (pos0 + t)·kvd + j < (pos0 + n)·kvd ≤ both caches' length (checked).
        unsafe { b.launch(launch_1d(n * kvd)?) }.map_err(drv)?;
        Ok(())
    }

    /// Launches the attention kernel: queries (buffer, offset, stride), keys and values
    /// (buffer, offset, buffer, offset, shared stride). The callers have checked that every
    /// row they name lies inside its buffer.
    fn attention_launch(
        &self,
        (q, q_off, q_stride): (&DeviceBuf, usize, usize),
        (k, k_off, v, v_off, kv_stride): (&DeviceBuf, usize, &DeviceBuf, usize, usize),
        n: usize,
        pos0: usize,
        a: &AttentionArgs,
    ) -> Result<DeviceBuf> {
        let (h, kv, hd) = (a.n_heads, a.n_kv_heads, a.head_dim);
        let keys = pos0 + n;
        if keys > MAX_ATTENTION_TOKENS {
            return Err(GpuError::Shape(format!(
                "{keys} positions (the attention kernel takes at most {MAX_ATTENTION_TOKENS})"
            )));
        }
        // Fixed chunks for decode steps and verification windows (see ATTN_CHUNK); a prefill's
        // chunks enough for ATTN_TARGET_BLOCKS blocks, at most ⌈keys / ATTN_CHUNK⌉ of them
        // (one for a long prefill). Rows go in groups whose partials fit ATTN_MAX_PARTIALS.
        let cl = if n <= ATTN_FIXED_ROWS {
            ATTN_CHUNK
        } else {
            let want = ATTN_TARGET_BLOCKS
                .div_ceil(n * h)
                .clamp(1, keys.div_ceil(ATTN_CHUNK));
            keys.div_ceil(want)
        };
        let chunks = keys.div_ceil(cl);
        let group = (ATTN_MAX_PARTIALS / (h * chunks).max(1)).clamp(1, n.max(1));
        let mut part_o = self.output(group * h * chunks * hd)?;
        let mut part_ml = self.output(group * h * chunks * 2)?;
        let mut out = self.output(n * h * hd)?;
        let grid = |x: usize| u32::try_from(x).map_err(|_| GpuError::Shape("too many rows".into()));
        let scale = 1.0 / (hd as f32).sqrt();
        let cli = dim(cl, "chunk")?;
        let (qs, kvs, hh, kk, hdi, ch) = (
            dim(q_stride, "query stride")?,
            dim(kv_stride, "kv stride")?,
            dim(h, "heads")?,
            dim(kv, "kv heads")?,
            dim(hd, "head_dim")?,
            dim(chunks, "chunks")?,
        );
        let (ko, vo) = (k_off as i64, v_off as i64);
        for r0 in (0..n).step_by(group) {
            let rows = group.min(n - r0);
            let (qo, oo) = ((q_off + r0 * q_stride) as i64, (r0 * h * hd) as i64);
            let (nn, p) = (dim(rows, "rows")?, dim(pos0 + r0, "position")?);
            let cfg = LaunchConfig {
                grid_dim: (grid(rows)?, grid(h)?, grid(chunks)?),
                block_dim: (ATTN_THREADS, 1, 1),
                shared_mem_bytes: (cl * 4) as u32,
            };
            let mut b = self.stream.launch_builder(&self.attention);
            b.arg(&q.d)
                .arg(&qo)
                .arg(&qs)
                .arg(&k.d)
                .arg(&ko)
                .arg(&v.d)
                .arg(&vo)
                .arg(&kvs)
                .arg(&mut part_o.d)
                .arg(&mut part_ml.d)
                .arg(&nn)
                .arg(&p)
                .arg(&hh)
                .arg(&kk)
                .arg(&hdi)
                .arg(&scale)
                .arg(&ch)
                .arg(&cli);
            // SAFETY: block (t, h, c) reads query row r0 + t < n and key/value rows
            // s < pos0 + r0 + t + 1 ≤ pos0 + n at the offsets and strides given, which the
            // callers checked lie inside their buffers; it writes partials
            // (t·h_count + h)·chunks + c < group·h·chunks, the sizes allocated, and its dynamic
            // shared memory holds its cl scores (cl ≤ keys ≤ MAX_ATTENTION_TOKENS keeps it
            // under 48 KiB) and its static array ATTN_THREADS (its block size) partials.
            unsafe { b.launch(cfg) }.map_err(drv)?;
            let cfg = LaunchConfig {
                grid_dim: (grid(rows)?, grid(h)?, 1),
                block_dim: (ATTN_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&self.attention_merge);
            b.arg(&part_o.d)
                .arg(&part_ml.d)
                .arg(&mut out.d)
                .arg(&oo)
                .arg(&p)
                .arg(&hh)
                .arg(&hdi)
                .arg(&ch)
                .arg(&cli);
            // SAFETY: block (t, h) reads the partials of chunks c ≤ (pos0 + r0 + t) / cl <
            // chunks, exactly those attention_part wrote for it in this group, and writes row
            // r0 + t < n, head h of the n × h·hd output.
            unsafe { b.launch(cfg) }.map_err(drv)?;
        }
        Ok(out)
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
        let y = self.matmul_dev(w, &self.buf(x)?, m)?;
        self.read(&y)
    }

    /// RMSNorm of each of the `n` rows of `x` (width `w.len()`), as [`crate::ops::rms_norm`].
    pub fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
        let d = w.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            return Err(GpuError::Shape(format!(
                "{} values in rows of {d}",
                x.len()
            )));
        }
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let y = self.rms_norm_dev(&self.buf(x)?, &self.buf(w)?, eps)?;
        self.read(&y)
    }

    /// SwiGLU of each fused `[gate | up]` row of `gate_up` (2·f values a row), as
    /// [`crate::ops::silu_mul`].
    pub fn silu_mul(&self, gate_up: &[f32], f: usize) -> Result<Vec<f32>> {
        if f == 0 || !gate_up.len().is_multiple_of(2 * f) {
            return Err(GpuError::Shape(format!(
                "{} values in fused rows of 2 × {f}",
                gate_up.len()
            )));
        }
        if gate_up.is_empty() {
            return Ok(Vec::new());
        }
        let y = self.silu_mul_dev(&self.buf(gate_up)?, f)?;
        self.read(&y)
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

    /// The kernels' source compiles under NVRTC wherever the library is (no device needed):
    /// CI installs it (`nvidia-cuda-nvrtc` from PyPI) and sets `DSPARK_REQUIRE_NVRTC=1`, so a
    /// syntax or type error in the CUDA source fails there, not first on a GPU draw.
    #[test]
    fn kernel_source_compiles_under_nvrtc() {
        match compile_check() {
            Ok(n) => assert!(n > 1000, "PTX of {n} bytes"),
            Err(GpuError::NoNvrtc) => {
                assert!(
                    std::env::var_os("DSPARK_REQUIRE_NVRTC").is_none(),
                    "DSPARK_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
                );
                eprintln!("no libnvrtc here: the CUDA source was not compiled");
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Plain causal GQA attention over fused [q | k | v] rows from position 0.
    fn attention_ref(qkv: &[f32], n: usize, h: usize, kv: usize, hd: usize) -> Vec<f32> {
        let width = (h + 2 * kv) * hd;
        let (qd, kvd) = (h * hd, kv * hd);
        let mut out = vec![0f32; n * qd];
        for t in 0..n {
            for head in 0..h {
                let g = head / (h / kv);
                let q = &qkv[t * width + head * hd..][..hd];
                let sc: Vec<f64> = (0..=t)
                    .map(|s| {
                        let k = &qkv[s * width + qd + g * hd..][..hd];
                        q.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let acc: f64 = (0..=t)
                        .map(|s| e[s] * qkv[s * width + qd + kvd + g * hd + d] as f64)
                        .sum();
                    out[t * qd + head * hd + d] = (acc / z) as f32;
                }
            }
        }
        out
    }

    #[test]
    #[ignore = "needs a CUDA device (scripts/gpu-check.sh)"]
    fn gpu_kernels_match_their_cpu_references() {
        let gpu = Gpu::new(0).expect("a CUDA device");
        let mut rng = Rng::new(7);
        for &(rows, cols, m) in &[
            (1, 1, 1),
            (37, 65, 3),
            (576, 576, 8),
            (1536, 576, 17),
            (5, 100, 9),
            (64, 33, 32),
            (100, 64, 2),
            (33, 70, 5),
            (3, 4, 3),
            (7, 1032, 4),
            // One token over rows of a multiple of 4 (every decode step: the 16-byte kernel),
            // and two tokens over rows of no such multiple.
            (64, 64, 1),
            (5, 33, 2),
        ] {
            let w = randn(&mut rng, rows * cols);
            let x = randn(&mut rng, m * cols);
            let dw = gpu.upload(&w, rows, cols).expect("upload");
            let y = gpu.matmul(&dw, &x, m).expect("matmul");
            let xd = gpu.buf(&x).expect("buf");
            let per_token = gpu
                .read(
                    &gpu.matmul_with(&dw, &xd, m, MatmulKernel::PerToken)
                        .expect("matmul"),
                )
                .expect("read");
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
            let e = max_rel(&per_token, &r);
            assert!(e < 1e-4, "per-token matmul {rows}×{cols}, m {m}: {e}");
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
        // RoPE on the k heads of fused rows, both layouts, from position 5.
        for interleaved in [false, true] {
            let (n, h, kv, hd) = (6, 4, 2, 8);
            let width = (h + 2 * kv) * hd;
            let x = randn(&mut rng, n * width);
            let mut xd = gpu.buf(&x).expect("buf");
            let a = RopeArgs {
                width,
                offset: h * hd,
                heads: kv,
                head_dim: hd,
                pos0: 5,
                theta: 10000.0,
                interleaved,
            };
            gpu.rope_dev(&mut xd, &a).expect("rope");
            let y = gpu.read(&xd).expect("read");
            let rope = ops::Rope::new(hd, 10000.0, 5 + n, interleaved);
            let mut r = x.clone();
            for t in 0..n {
                rope.apply(&mut r[t * width + h * hd..t * width + (h + kv) * hd], 5 + t);
            }
            let e = max_rel(&y, &r);
            assert!(e < 1e-5, "rope (interleaved {interleaved}): {e}");
        }
        // Attention: MHA and GQA, one to a few hundred positions.
        for &(n, h, kv, hd) in &[(1, 1, 1, 4), (7, 4, 2, 8), (300, 9, 3, 64)] {
            let qkv = randn(&mut rng, n * (h + 2 * kv) * hd);
            let a = AttentionArgs {
                n_heads: h,
                n_kv_heads: kv,
                head_dim: hd,
            };
            let y = gpu
                .read(
                    &gpu.attention_dev(&gpu.buf(&qkv).expect("buf"), &a)
                        .expect("attention"),
                )
                .expect("read");
            let e = max_rel(&y, &attention_ref(&qkv, n, h, kv, hd));
            assert!(e < 1e-4, "attention n {n}, {h}/{kv} heads of {hd}: {e}");
        }
        // The same attention over a KV cache filled in windows, each window's rows appended
        // first: a prefill, a decode step, windows. Past 64 positions a decode step or a short
        // window splits the keys into chunks (5 of 64 keys at position 300).
        let short: &[(usize, usize)] = &[(0, 5), (5, 6), (6, 14)];
        let long: &[(usize, usize)] = &[(0, 300), (300, 301), (301, 309), (309, 320)];
        for &(h, kv, hd, windows) in &[
            (4, 2, 8, short),
            (9, 3, 64, short),
            (9, 3, 64, long),
            (4, 2, 40, long),
            (2, 1, 256, long),
        ] {
            let width = (h + 2 * kv) * hd;
            let n = windows.last().map_or(0, |w| w.1);
            let qkv = randn(&mut rng, n * width);
            let want = attention_ref(&qkv, n, h, kv, hd);
            let a = AttentionArgs {
                n_heads: h,
                n_kv_heads: kv,
                head_dim: hd,
            };
            let cap = n * kv * hd;
            let (mut kc, mut vc) = (
                gpu.zeros(cap).expect("zeros"),
                gpu.zeros(cap).expect("zeros"),
            );
            let run = |windows: &[(usize, usize)], kc: &mut DeviceBuf, vc: &mut DeviceBuf| {
                let mut got = Vec::new();
                for &(p0, p1) in windows {
                    let rows = gpu.buf(&qkv[p0 * width..p1 * width]).expect("buf");
                    gpu.kv_append_dev(&rows, kc, vc, &a, p0).expect("kv_append");
                    let out = gpu
                        .attention_cached_dev(&rows, kc, vc, &a, p0)
                        .expect("attention");
                    got.extend(gpu.read(&out).expect("read"));
                }
                got
            };
            let got = run(windows, &mut kc, &mut vc);
            let e = max_rel(&got, &want);
            assert!(
                e < 1e-4,
                "cached attention {h}/{kv} heads of {hd}, {n} rows: {e}"
            );
            // Windows give the bits decode steps give (fixed chunks): what greedy parity
            // between verification and plain decoding rests on.
            let first = windows[0].1;
            let steps: Vec<(usize, usize)> = std::iter::once((0, first))
                .chain((first..n).map(|i| (i, i + 1)))
                .collect();
            let stepped = run(&steps, &mut kc, &mut vc);
            let at = first * h * hd;
            assert!(
                got[at..]
                    .iter()
                    .zip(&stepped[at..])
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "cached attention {h}/{kv} heads of {hd}: windows differ from decode steps"
            );
            // Past the cache's rows is an error, not a launch.
            let rows = gpu.buf(&qkv[..3 * width]).expect("buf");
            assert!(gpu.kv_append_dev(&rows, &mut kc, &mut vc, &a, n).is_err());
            assert!(gpu.attention_cached_dev(&rows, &kc, &vc, &a, n).is_err());
        }
        // Residual and bias adds.
        let (x, z, bias) = (randn(&mut rng, 12), randn(&mut rng, 12), randn(&mut rng, 4));
        let mut xd = gpu.buf(&x).expect("buf");
        gpu.add_dev(&mut xd, &gpu.buf(&z).expect("buf"))
            .expect("add");
        gpu.add_rows_dev(&mut xd, &gpu.buf(&bias).expect("buf"))
            .expect("add_rows");
        let r: Vec<f32> = (0..12).map(|i| x[i] + z[i] + bias[i % 4]).collect();
        assert!(max_rel(&gpu.read(&xd).expect("read"), &r) < 1e-6);
        // Bad shapes are errors, not launches.
        let mut small = gpu.buf(&[1.0; 5]).expect("buf");
        assert!(
            gpu.add_dev(&mut small, &gpu.buf(&[1.0; 4]).expect("buf"))
                .is_err()
        );
        assert!(
            gpu.add_rows_dev(&mut small, &gpu.buf(&[1.0; 2]).expect("buf"))
                .is_err()
        );
        let bad = AttentionArgs {
            n_heads: 3,
            n_kv_heads: 2,
            head_dim: 4,
        };
        assert!(
            gpu.attention_dev(&gpu.buf(&[0.0; 28]).expect("buf"), &bad)
                .is_err()
        );
        let dw = gpu.upload(&[1.0; 6], 2, 3).expect("upload");
        assert!(gpu.matmul(&dw, &[1.0; 4], 1).is_err());
        assert!(gpu.upload(&[1.0; 5], 2, 3).is_err());
        assert!(gpu.rms_norm(&[1.0; 5], &[1.0; 2], 1e-5).is_err());
    }
}
