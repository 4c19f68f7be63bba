//! The model's forward written once over a small set of device operations ([`DeviceOps`]),
//! with two backends: [`CpuOps`] (plain f32 loops on the host) and [`CudaOps`] (the NVRTC
//! kernels of [`kernels::cuda`]).
//!
//! Why two: the CUDA backend can only be checked where a GPU is, which this project's machines
//! rarely have. The CPU backend runs the very same sequence of operations everywhere, and CI
//! checks it against [`Model::forward`] (the paged, batched CPU forward) on every architecture;
//! each CUDA kernel is checked against its CPU reference in `kernels`; on a device
//! (`scripts/gpu-check.sh`) the CUDA forward is checked against [`Model::forward`] directly.
//!
//! The device forward runs one sequence over its own KV cache ([`DeviceCache`]): a prefill,
//! then decode steps and verification windows, with logits at every new position and rollback
//! by truncation. It is f32 over dequantized weights: what a numerical check and a measurement
//! of a window's cost need, not yet a serving path (no paging, no batch of sequences).

use crate::config::ModelConfig;
use crate::model::Model;
use crate::{Result, RuntimeError};
use kernels::cuda::{AttentionArgs, DeviceBuf, DeviceMatrix, Gpu, MatmulKernel, RopeArgs};
use kernels::rng::Rng;
use kernels::sampling::argmax;
use kernels::{Isa, ops};

/// The operations the forward needs, on buffers of f32 a backend owns.
pub trait DeviceOps {
    type Buf;
    type Mat;
    /// What runs the operations (e.g. the GPU's name).
    fn name(&self) -> String;
    fn upload(&self, x: &[f32]) -> Result<Self::Buf>;
    /// A rows × cols matrix, row-major.
    fn matrix(&self, w: &[f32], rows: usize, cols: usize) -> Result<Self::Mat>;
    fn download(&self, b: &Self::Buf) -> Result<Vec<f32>>;
    /// `y[t][r] = Σ_c W[r][c] x[t][c]` for the `m` rows of `x`.
    fn matmul(&self, w: &Self::Mat, x: &Self::Buf, m: usize) -> Result<Self::Buf>;
    /// RMSNorm of every row (width `w`'s length).
    fn rms_norm(&self, x: &Self::Buf, w: &Self::Buf, eps: f32) -> Result<Self::Buf>;
    /// `y += x`.
    fn add(&self, y: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// Adds one row of values to every row of `y`.
    fn add_rows(&self, y: &mut Self::Buf, b: &Self::Buf) -> Result<()>;
    /// RoPE in place on some heads of every row.
    fn rope(&self, x: &mut Self::Buf, a: &RopeArgs) -> Result<()>;
    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    /// Writes the k and v parts of fused `[q | k | v]` rows into rows pos0.. of a layer's key
    /// and value caches (rows of n_kv_heads · head_dim values).
    fn kv_append(
        &self,
        qkv: &Self::Buf,
        k: &mut Self::Buf,
        v: &mut Self::Buf,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<()>;
    /// Causal attention of fused `[q | k | v]` rows at positions pos0.. over cache rows
    /// 0 ..= each row's position (this window's rows already appended).
    fn attention(
        &self,
        qkv: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<Self::Buf>;
    /// SwiGLU of fused `[gate | up]` rows of 2·f values.
    fn silu_mul(&self, gate_up: &Self::Buf, f: usize) -> Result<Self::Buf>;
}

/// A dense f32 matrix on the host.
pub struct HostMatrix {
    w: Vec<f32>,
    rows: usize,
    cols: usize,
}

/// The host backend: each operation as a plain loop (the kernels' CPU references where they
/// exist), so that its results follow the definitions, not an optimized path.
pub struct CpuOps {
    isa: Isa,
}

impl CpuOps {
    pub fn new() -> Self {
        Self { isa: Isa::detect() }
    }
}

impl Default for CpuOps {
    fn default() -> Self {
        Self::new()
    }
}

fn shape(msg: String) -> RuntimeError {
    RuntimeError::Invalid(msg)
}

impl DeviceOps for CpuOps {
    type Buf = Vec<f32>;
    type Mat = HostMatrix;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn upload(&self, x: &[f32]) -> Result<Vec<f32>> {
        Ok(x.to_vec())
    }

    fn matrix(&self, w: &[f32], rows: usize, cols: usize) -> Result<HostMatrix> {
        if w.len() != rows * cols {
            return Err(shape(format!("{} weights for {rows} × {cols}", w.len())));
        }
        Ok(HostMatrix {
            w: w.to_vec(),
            rows,
            cols,
        })
    }

    fn download(&self, b: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(b.clone())
    }

    fn matmul(&self, w: &HostMatrix, x: &Vec<f32>, m: usize) -> Result<Vec<f32>> {
        if x.len() != m * w.cols {
            return Err(shape(format!(
                "{} inputs for {m} rows of {}",
                x.len(),
                w.cols
            )));
        }
        let mut y = vec![0f32; m * w.rows];
        for t in 0..m {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            for (r, yv) in y[t * w.rows..(t + 1) * w.rows].iter_mut().enumerate() {
                *yv = ops::dot(self.isa, &w.w[r * w.cols..(r + 1) * w.cols], xt);
            }
        }
        Ok(y)
    }

    fn rms_norm(&self, x: &Vec<f32>, w: &Vec<f32>, eps: f32) -> Result<Vec<f32>> {
        let d = w.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            return Err(shape(format!("{} values in rows of {d}", x.len())));
        }
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            ops::rms_norm(Isa::Scalar, xr, w, eps, yr);
        }
        Ok(y)
    }

    fn add(&self, y: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        if y.len() != x.len() {
            return Err(shape(format!("adding {} values to {}", x.len(), y.len())));
        }
        for (a, b) in y.iter_mut().zip(x) {
            *a += b;
        }
        Ok(())
    }

    fn add_rows(&self, y: &mut Vec<f32>, b: &Vec<f32>) -> Result<()> {
        if b.is_empty() || !y.len().is_multiple_of(b.len()) {
            return Err(shape(format!(
                "a bias of {} on {} values",
                b.len(),
                y.len()
            )));
        }
        for row in y.chunks_exact_mut(b.len()) {
            for (a, v) in row.iter_mut().zip(b) {
                *a += v;
            }
        }
        Ok(())
    }

    fn rope(&self, x: &mut Vec<f32>, a: &RopeArgs) -> Result<()> {
        let span = a.heads * a.head_dim;
        if a.width == 0 || !x.len().is_multiple_of(a.width) || a.offset + span > a.width {
            return Err(shape(format!("RoPE span outside rows of {}", a.width)));
        }
        let n = x.len() / a.width;
        let rope = ops::Rope::new(a.head_dim, a.theta, a.pos0 + n, a.interleaved);
        for (t, row) in x.chunks_exact_mut(a.width).enumerate() {
            rope.apply(&mut row[a.offset..a.offset + span], a.pos0 + t);
        }
        Ok(())
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0f32; n])
    }

    fn kv_append(
        &self,
        qkv: &Vec<f32>,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<()> {
        let (width, n) = a.fused_rows(qkv.len())?;
        let (qd, kvd) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
        if k.len() != v.len() || k.len() < (pos0 + n) * kvd {
            return Err(shape(format!(
                "rows {pos0} .. {} in caches of {} values",
                pos0 + n,
                k.len()
            )));
        }
        for t in 0..n {
            let row = &qkv[t * width..(t + 1) * width];
            k[(pos0 + t) * kvd..][..kvd].copy_from_slice(&row[qd..qd + kvd]);
            v[(pos0 + t) * kvd..][..kvd].copy_from_slice(&row[qd + kvd..]);
        }
        Ok(())
    }

    fn attention(
        &self,
        qkv: &Vec<f32>,
        kc: &Vec<f32>,
        vc: &Vec<f32>,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<Vec<f32>> {
        let (width, n) = a.fused_rows(qkv.len())?;
        let (h, kv, hd) = (a.n_heads, a.n_kv_heads, a.head_dim);
        let (qd, kvd) = (h * hd, kv * hd);
        if kc.len() != vc.len() || kc.len() < (pos0 + n) * kvd {
            return Err(shape(format!(
                "{} positions in caches of {} values",
                pos0 + n,
                kc.len()
            )));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; n * qd];
        let mut sc = vec![0f32; pos0 + n];
        for t in 0..n {
            let last = pos0 + t;
            for head in 0..h {
                let g = head / (h / kv);
                let q = &qkv[t * width + head * hd..][..hd];
                for (s, v) in sc.iter_mut().enumerate().take(last + 1) {
                    let k = &kc[s * kvd + g * hd..][..hd];
                    *v = ops::dot(Isa::Scalar, q, k) * scale;
                }
                let mx = sc[..=last]
                    .iter()
                    .cloned()
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut z = 0f32;
                for v in &mut sc[..=last] {
                    *v = (*v - mx).exp();
                    z += *v;
                }
                let o = &mut out[t * qd + head * hd..][..hd];
                for (s, &p) in sc[..=last].iter().enumerate() {
                    let vrow = &vc[s * kvd + g * hd..][..hd];
                    for (ov, vv) in o.iter_mut().zip(vrow) {
                        *ov += p * vv;
                    }
                }
                for ov in o.iter_mut() {
                    *ov /= z;
                }
            }
        }
        Ok(out)
    }

    fn silu_mul(&self, gate_up: &Vec<f32>, f: usize) -> Result<Vec<f32>> {
        if f == 0 || !gate_up.len().is_multiple_of(2 * f) {
            return Err(shape(format!(
                "{} values in rows of 2 × {f}",
                gate_up.len()
            )));
        }
        let mut y = vec![0f32; gate_up.len() / 2];
        for (g, o) in gate_up.chunks_exact(2 * f).zip(y.chunks_exact_mut(f)) {
            ops::silu_mul(Isa::Scalar, g, o);
        }
        Ok(y)
    }
}

/// The CUDA backend: every operation one NVRTC-compiled kernel on the device.
pub struct CudaOps {
    gpu: Gpu,
    matmul: MatmulKernel,
}

impl CudaOps {
    /// Opens device `ordinal`; a clear error where there is no driver or device.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            gpu: Gpu::new(ordinal)?,
            matmul: MatmulKernel::default(),
        })
    }

    /// Chooses the matmul kernel (they differ in how often a window's tokens read the weights,
    /// and by rounding, since they sum in different orders).
    pub fn set_matmul(&mut self, kernel: MatmulKernel) {
        self.matmul = kernel;
    }
}

impl DeviceOps for CudaOps {
    type Buf = DeviceBuf;
    type Mat = DeviceMatrix;

    fn name(&self) -> String {
        self.gpu.name().to_string()
    }
    fn upload(&self, x: &[f32]) -> Result<DeviceBuf> {
        Ok(self.gpu.buf(x)?)
    }
    fn matrix(&self, w: &[f32], rows: usize, cols: usize) -> Result<DeviceMatrix> {
        Ok(self.gpu.upload(w, rows, cols)?)
    }
    fn download(&self, b: &DeviceBuf) -> Result<Vec<f32>> {
        Ok(self.gpu.read(b)?)
    }
    fn matmul(&self, w: &DeviceMatrix, x: &DeviceBuf, m: usize) -> Result<DeviceBuf> {
        Ok(self.gpu.matmul_with(w, x, m, self.matmul)?)
    }
    fn rms_norm(&self, x: &DeviceBuf, w: &DeviceBuf, eps: f32) -> Result<DeviceBuf> {
        Ok(self.gpu.rms_norm_dev(x, w, eps)?)
    }
    fn add(&self, y: &mut DeviceBuf, x: &DeviceBuf) -> Result<()> {
        Ok(self.gpu.add_dev(y, x)?)
    }
    fn add_rows(&self, y: &mut DeviceBuf, b: &DeviceBuf) -> Result<()> {
        Ok(self.gpu.add_rows_dev(y, b)?)
    }
    fn rope(&self, x: &mut DeviceBuf, a: &RopeArgs) -> Result<()> {
        Ok(self.gpu.rope_dev(x, a)?)
    }
    fn zeros(&self, n: usize) -> Result<DeviceBuf> {
        Ok(self.gpu.zeros(n)?)
    }
    fn kv_append(
        &self,
        qkv: &DeviceBuf,
        k: &mut DeviceBuf,
        v: &mut DeviceBuf,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<()> {
        Ok(self.gpu.kv_append_dev(qkv, k, v, a, pos0)?)
    }
    fn attention(
        &self,
        qkv: &DeviceBuf,
        k: &DeviceBuf,
        v: &DeviceBuf,
        a: &AttentionArgs,
        pos0: usize,
    ) -> Result<DeviceBuf> {
        Ok(self.gpu.attention_cached_dev(qkv, k, v, a, pos0)?)
    }
    fn silu_mul(&self, gate_up: &DeviceBuf, f: usize) -> Result<DeviceBuf> {
        Ok(self.gpu.silu_mul_dev(gate_up, f)?)
    }
}

struct Layer<O: DeviceOps> {
    attn_norm: O::Buf,
    qkv: O::Mat,
    qkv_bias: Option<O::Buf>,
    wo: O::Mat,
    ffn_norm: O::Buf,
    gate_up: O::Mat,
    down: O::Mat,
}

/// One sequence's keys and values on a backend: a buffer per layer of `capacity` rows.
pub struct DeviceCache<O: DeviceOps> {
    k: Vec<O::Buf>,
    v: Vec<O::Buf>,
    len: usize,
    capacity: usize,
}

impl<O: DeviceOps> DeviceCache<O> {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Drops every position from `len` on (a rejected draft's tail): the rows stay allocated
    /// and the next forward overwrites them.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(RuntimeError::Invalid(format!(
                "truncating {} positions to {len}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }
}

/// A model's weights on a backend, and its forward there.
pub struct DeviceForward<O: DeviceOps> {
    ops: O,
    cfg: ModelConfig,
    /// The token embedding stays on the host: a prefill gathers its rows there.
    embed: Vec<f32>,
    layers: Vec<Layer<O>>,
    out_norm: O::Buf,
    head: O::Mat,
}

impl<O: DeviceOps> DeviceForward<O> {
    /// Dequantizes `model`'s weights to f32 and hands them to the backend, a layer at a time.
    pub fn new(ops: O, model: &Model) -> Result<Self> {
        let c = model.cfg.clone();
        let (d, qkv_dim) = (c.d_model, c.q_dim() + 2 * c.kv_dim());
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let l = model.dense_layer(i)?;
            layers.push(Layer {
                attn_norm: ops.upload(&l.attn_norm)?,
                qkv: ops.matrix(&l.qkv, qkv_dim, d)?,
                qkv_bias: match &l.qkv_bias {
                    Some(b) => Some(ops.upload(b)?),
                    None => None,
                },
                wo: ops.matrix(&l.wo, d, c.q_dim())?,
                ffn_norm: ops.upload(&l.ffn_norm)?,
                gate_up: ops.matrix(&l.gate_up, 2 * c.ffn_dim, d)?,
                down: ops.matrix(&l.down, d, c.ffn_dim)?,
            });
        }
        Ok(Self {
            embed: model.embedding_f32()?,
            out_norm: ops.upload(model.out_norm_weights())?,
            head: ops.matrix(&model.head_f32()?, c.vocab_size, d)?,
            layers,
            cfg: c,
            ops,
        })
    }

    /// Random weights of `cfg`'s shapes (seeded; unit RMSNorm weights, rows scaled by
    /// 1/√cols): for measuring what a forward of that model costs on a backend where its
    /// checkpoint cannot be carried. Its logits mean nothing.
    pub fn random(ops: O, cfg: &ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let c = cfg.clone();
        let (d, qkv_dim) = (c.d_model, c.q_dim() + 2 * c.kv_dim());
        let mut rng = Rng::new(seed);
        let mut mat = |rows: usize, cols: usize| -> Vec<f32> {
            let scale = 2.0 / (cols as f32).sqrt();
            (0..rows * cols)
                .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
                .collect()
        };
        let ones = vec![1f32; d];
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(Layer {
                attn_norm: ops.upload(&ones)?,
                qkv: ops.matrix(&mat(qkv_dim, d), qkv_dim, d)?,
                qkv_bias: if c.qkv_bias {
                    Some(ops.upload(&mat(1, qkv_dim))?)
                } else {
                    None
                },
                wo: ops.matrix(&mat(d, c.q_dim()), d, c.q_dim())?,
                ffn_norm: ops.upload(&ones)?,
                gate_up: ops.matrix(&mat(2 * c.ffn_dim, d), 2 * c.ffn_dim, d)?,
                down: ops.matrix(&mat(d, c.ffn_dim), d, c.ffn_dim)?,
            });
        }
        Ok(Self {
            embed: mat(c.vocab_size, d),
            out_norm: ops.upload(&ones)?,
            head: ops.matrix(&mat(c.vocab_size, d), c.vocab_size, d)?,
            layers,
            cfg: c,
            ops,
        })
    }

    /// The backend's name.
    pub fn backend(&self) -> String {
        self.ops.name()
    }

    /// The backend, e.g. to choose its kernels between measurements.
    pub fn ops_mut(&mut self) -> &mut O {
        &mut self.ops
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// An empty cache for up to `capacity` positions (at most the model's context, and the
    /// attention kernel's [`kernels::cuda::MAX_ATTENTION_TOKENS`]).
    pub fn new_cache(&self, capacity: usize) -> Result<DeviceCache<O>> {
        let c = &self.cfg;
        let most = c.max_ctx.min(kernels::cuda::MAX_ATTENTION_TOKENS);
        if capacity == 0 || capacity > most {
            return Err(RuntimeError::ContextOverflow {
                tokens: capacity,
                ctx: most,
            });
        }
        let rows = capacity * c.kv_dim();
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..c.n_layers {
            k.push(self.ops.zeros(rows)?);
            v.push(self.ops.zeros(rows)?);
        }
        Ok(DeviceCache {
            k,
            v,
            len: 0,
            capacity,
        })
    }

    /// Logits at every position of `tokens` (a prefill from position 0): n × vocab.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.len() > self.cfg.max_ctx {
            return Err(RuntimeError::ContextOverflow {
                tokens: tokens.len(),
                ctx: self.cfg.max_ctx,
            });
        }
        let mut cache = self.new_cache(tokens.len().max(1))?;
        self.forward(&mut cache, tokens)
    }

    /// Appends `tokens` to the sequence in `cache` (a prefill chunk, a decode step or a
    /// verification window) and returns the logits at each of their positions: n × vocab.
    pub fn forward(&self, cache: &mut DeviceCache<O>, tokens: &[u32]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (d, n) = (c.d_model, tokens.len());
        if n == 0 {
            return Err(RuntimeError::Invalid("no tokens".into()));
        }
        if cache.k.len() != c.n_layers {
            return Err(RuntimeError::Invalid(format!(
                "a cache of {} layers for a model of {}",
                cache.k.len(),
                c.n_layers
            )));
        }
        let pos0 = cache.len;
        if pos0 + n > cache.capacity {
            return Err(RuntimeError::ContextOverflow {
                tokens: pos0 + n,
                ctx: cache.capacity,
            });
        }
        let mut x0 = Vec::with_capacity(n * d);
        for &t in tokens {
            let row = self
                .embed
                .get(t as usize * d..(t as usize + 1) * d)
                .ok_or_else(|| {
                    RuntimeError::Invalid(format!(
                        "token id {t} outside the vocabulary of {}",
                        c.vocab_size
                    ))
                })?;
            x0.extend_from_slice(row);
        }
        let o = &self.ops;
        let mut x = o.upload(&x0)?;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        // The query heads and the key heads are adjacent in a fused row: one launch.
        let rope = RopeArgs {
            width: qd + 2 * kvd,
            offset: 0,
            heads: c.n_heads + c.n_kv_heads,
            head_dim: c.head_dim,
            pos0,
            theta: c.rope_theta,
            interleaved: c.rope_interleaved,
        };
        let attn = AttentionArgs {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        for (i, l) in self.layers.iter().enumerate() {
            let xn = o.rms_norm(&x, &l.attn_norm, c.rms_eps)?;
            let mut qkv = o.matmul(&l.qkv, &xn, n)?;
            if let Some(b) = &l.qkv_bias {
                o.add_rows(&mut qkv, b)?;
            }
            o.rope(&mut qkv, &rope)?;
            o.kv_append(&qkv, &mut cache.k[i], &mut cache.v[i], &attn, pos0)?;
            let att = o.attention(&qkv, &cache.k[i], &cache.v[i], &attn, pos0)?;
            o.add(&mut x, &o.matmul(&l.wo, &att, n)?)?;
            let xn = o.rms_norm(&x, &l.ffn_norm, c.rms_eps)?;
            let act = o.silu_mul(&o.matmul(&l.gate_up, &xn, n)?, c.ffn_dim)?;
            o.add(&mut x, &o.matmul(&l.down, &act, n)?)?;
        }
        let xn = o.rms_norm(&x, &self.out_norm, c.rms_eps)?;
        let logits = o.download(&o.matmul(&self.head, &xn, n)?)?;
        cache.len = pos0 + n;
        Ok(logits)
    }
}

/// How far one set of logits is from another, position by position.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitsDiff {
    pub positions: usize,
    /// Share of positions whose argmax agrees.
    pub top1_agreement: f64,
    /// Largest |a − b| / max(1, |b|) over every logit (infinite on NaN or a length mismatch).
    pub max_rel: f64,
}

/// Compares `got` against `want` (both positions × vocab).
pub fn compare_logits(got: &[f32], want: &[f32], vocab: usize) -> LogitsDiff {
    if vocab == 0 || got.len() != want.len() || !want.len().is_multiple_of(vocab) {
        return LogitsDiff {
            positions: 0,
            top1_agreement: 0.0,
            max_rel: f64::INFINITY,
        };
    }
    let positions = want.len() / vocab;
    let mut agree = 0usize;
    let mut max_rel = 0f64;
    for (g, w) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)) {
        agree += usize::from(argmax(g) == argmax(w));
        for (a, b) in g.iter().zip(w) {
            let e = ((a - b).abs() / b.abs().max(1.0)) as f64;
            max_rel = if e.is_finite() {
                max_rel.max(e)
            } else {
                f64::INFINITY
            };
        }
    }
    LogitsDiff {
        positions,
        top1_agreement: agree as f64 / positions as f64,
        max_rel,
    }
}

/// Logits at every position of `tokens` from [`Model::forward`] (one sequence, position 0).
pub fn model_logits(model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut cache = model.new_cache(tokens.len().max(1), 16)?;
    let seq = cache.new_seq();
    let out = model.forward(
        &mut cache,
        &[crate::SeqInput {
            seq,
            tokens,
            logits: crate::LogitsMode::All,
        }],
        &Default::default(),
    )?;
    Ok(out.logits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LoadOptions;
    use crate::tiny::{TinySpec, tiny_model_path};

    fn tiny(spec: TinySpec, name: &str, dense: bool) -> Model {
        let path = tiny_model_path(&spec, name).expect("tiny model");
        Model::load(
            &path,
            &LoadOptions {
                dense,
                threads: 1,
                ..Default::default()
            },
        )
        .expect("load")
    }

    fn tokens(n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
    }

    /// Logits at every position of `toks` (at least 31 of them) the way a speculative decoder
    /// asks for them: a prefill of all but 23, a decode step, a verification window of 8, a
    /// rejected window of 5 rolled back, then the last 14 in one window.
    fn windowed_logits<O: DeviceOps>(fwd: &DeviceForward<O>, toks: &[u32]) -> Vec<f32> {
        let mut cache = fwd.new_cache(toks.len()).expect("cache");
        let mut out = Vec::new();
        let p = toks.len() - 23;
        for (a, b) in [(0, p), (p, p + 1), (p + 1, p + 9)] {
            out.extend(fwd.forward(&mut cache, &toks[a..b]).expect("forward"));
        }
        let junk: Vec<u32> = toks[p + 9..p + 14].iter().rev().copied().collect();
        fwd.forward(&mut cache, &junk).expect("rejected window");
        assert_eq!(cache.len(), p + 14);
        cache.truncate(p + 9).expect("rollback");
        out.extend(fwd.forward(&mut cache, &toks[p + 9..]).expect("forward"));
        assert_eq!(cache.len(), toks.len());
        out
    }

    /// Logits of `toks` from a prefill of all but the last 23, then one token at a time: the
    /// plain decoding that [`windowed_logits`]'s verification windows must match bit for bit
    /// past the prefill (greedy parity rests on it).
    fn stepped_logits<O: DeviceOps>(fwd: &DeviceForward<O>, toks: &[u32]) -> Vec<f32> {
        let mut cache = fwd.new_cache(toks.len()).expect("cache");
        let p = toks.len() - 23;
        let mut out = fwd.forward(&mut cache, &toks[..p]).expect("prefill");
        for i in p..toks.len() {
            out.extend(
                fwd.forward(&mut cache, &toks[i..i + 1])
                    .expect("decode step"),
            );
        }
        out
    }

    /// Random weights of a config's shapes run, and are seeded.
    #[test]
    fn random_weights_follow_the_config() {
        let cfg = tiny(TinySpec::qwen2(12), "device-qwen2", true).cfg.clone();
        let a = DeviceForward::random(CpuOps::new(), &cfg, 3).expect("random");
        let b = DeviceForward::random(CpuOps::new(), &cfg, 3).expect("random");
        let toks = tokens(9, cfg.vocab_size);
        let (la, lb) = (a.logits(&toks).expect("a"), b.logits(&toks).expect("b"));
        assert_eq!(la.len(), 9 * cfg.vocab_size);
        assert!(la.iter().all(|v| v.is_finite()));
        assert_eq!(la, lb);
        let c = DeviceForward::random(CpuOps::new(), &cfg, 4).expect("random");
        assert_ne!(la, c.logits(&toks).expect("c"));
        let mut bad = cfg.clone();
        bad.n_kv_heads = 5;
        assert!(DeviceForward::random(CpuOps::new(), &bad, 1).is_err());
    }

    /// The device forward's sequence of operations, run on the host backend, computes what the
    /// paged batched forward computes: RoPE layout, GQA head mapping, QKV biases, tied or
    /// separate head, in one prefill and in windows over its KV cache. A mistake there would
    /// fail here, before any GPU runs it.
    #[test]
    fn host_backend_forward_matches_the_model_forward() {
        for (spec, name) in [
            (TinySpec::llama(11), "device-llama"),
            (TinySpec::qwen2(12), "device-qwen2"),
        ] {
            let model = tiny(spec, name, true);
            let toks = tokens(40, model.cfg.vocab_size);
            let want = model_logits(&model, &toks).expect("model forward");
            let fwd = DeviceForward::new(CpuOps::new(), &model).expect("weights");
            assert_eq!(fwd.backend(), "cpu");
            let got = fwd.logits(&toks).expect("device forward");
            let diff = compare_logits(&got, &want, model.cfg.vocab_size);
            assert_eq!(diff.positions, 40, "{name}");
            assert_eq!(diff.top1_agreement, 1.0, "{name}: {diff:?}");
            assert!(diff.max_rel < 1e-4, "{name}: {diff:?}");
            // A broken forward is told apart: dropping the last token shifts every logit row.
            let short = fwd.logits(&toks[1..]).expect("device forward");
            let off = compare_logits(&short, &want[model.cfg.vocab_size..], model.cfg.vocab_size);
            assert!(off.max_rel > 1e-2, "{name}: {off:?}");
            // Decode steps and verification windows over the device cache, with a rollback
            // between, give the logits one prefill of the whole sequence gives.
            let got = windowed_logits(&fwd, &toks);
            let diff = compare_logits(&got, &want, model.cfg.vocab_size);
            assert_eq!(diff.positions, 40, "{name}");
            assert_eq!(diff.top1_agreement, 1.0, "{name}: {diff:?}");
            assert!(diff.max_rel < 1e-4, "{name}: {diff:?}");
            let p = (toks.len() - 23) * model.cfg.vocab_size;
            assert!(
                got[p..] == stepped_logits(&fwd, &toks)[p..],
                "{name}: windows differ from decode steps"
            );
            // Without the rollback the window after it sees the rejected tokens.
            let mut cache = fwd.new_cache(45).expect("cache");
            fwd.forward(&mut cache, &toks[..26]).expect("forward");
            fwd.forward(&mut cache, &toks[..5]).expect("forward");
            let stale = fwd.forward(&mut cache, &toks[26..]).expect("forward");
            let v = model.cfg.vocab_size;
            assert!(compare_logits(&stale, &want[26 * v..], v).max_rel > 1e-2);
            // Bad use is an error.
            assert!(cache.truncate(46).is_err());
            assert!(fwd.forward(&mut cache, &[0; 10]).is_err(), "past capacity");
            assert!(fwd.forward(&mut cache, &[]).is_err());
            assert!(fwd.new_cache(0).is_err());
            assert!(fwd.new_cache(model.cfg.max_ctx + 1).is_err());
        }
    }

    /// A checkpoint cut to its first layers loads with that many layers, keeps the first
    /// layer's weights as they were, and runs.
    #[test]
    fn a_sliced_checkpoint_keeps_its_first_layers() {
        let src = tiny_model_path(&TinySpec::qwen2(12), "device-qwen2").expect("tiny model");
        let dst = src.with_file_name("device-qwen2-1layer.gguf");
        crate::tiny::slice_gguf(&src, &dst, 1).expect("slice");
        let opts = LoadOptions {
            dense: true,
            threads: 1,
            ..Default::default()
        };
        let (full, cut) = (
            Model::load(&src, &opts).expect("load"),
            Model::load(&dst, &opts).expect("load sliced"),
        );
        assert_eq!(cut.cfg.n_layers, 1);
        assert_eq!(full.cfg.n_layers, 2);
        let (a, b) = (
            full.dense_layer(0).expect("layer"),
            cut.dense_layer(0).expect("layer"),
        );
        assert_eq!(a.qkv, b.qkv);
        assert_eq!(a.down, b.down);
        assert_eq!(a.qkv_bias, b.qkv_bias);
        assert!(cut.dense_layer(1).is_err());
        let toks = tokens(8, cut.cfg.vocab_size);
        let got = DeviceForward::new(CpuOps::new(), &cut)
            .expect("weights")
            .logits(&toks)
            .expect("forward");
        let want = model_logits(&cut, &toks).expect("forward");
        assert!(compare_logits(&got, &want, cut.cfg.vocab_size).max_rel < 1e-4);
        assert!(crate::tiny::slice_gguf(&src, &dst, 3).is_err());
        assert!(crate::tiny::slice_gguf(&src, &dst, 0).is_err());
    }

    #[test]
    fn bad_input_is_an_error() {
        let model = tiny(TinySpec::llama(11), "device-llama", true);
        let fwd = DeviceForward::new(CpuOps::new(), &model).expect("weights");
        assert!(fwd.logits(&[]).is_err());
        assert!(fwd.logits(&[u32::MAX]).is_err());
        let long = tokens(model.cfg.max_ctx + 1, model.cfg.vocab_size);
        assert!(matches!(
            fwd.logits(&long),
            Err(RuntimeError::ContextOverflow { .. })
        ));
        let d = compare_logits(&[1.0, f32::NAN], &[1.0, 2.0], 2);
        assert!(d.max_rel.is_infinite());
        assert!(compare_logits(&[1.0], &[1.0, 2.0], 2).max_rel.is_infinite());
        // Without a driver the CUDA backend is a clear error.
        if !kernels::cuda::available() {
            assert!(CudaOps::new(0).is_err());
        }
    }

    /// On a GPU: the CUDA forward against [`Model::forward`] on the CPU, over 320 positions (a
    /// prefill of 297, then windows), on the tiny models and,
    /// when `DSPARK_GPU_MODEL` names a GGUF file, on that real checkpoint.
    #[test]
    #[ignore = "needs a CUDA device (scripts/gpu-check.sh)"]
    fn cuda_forward_matches_the_cpu_forward() {
        let mut models: Vec<(String, Model)> = vec![
            (
                "tiny llama".into(),
                tiny(TinySpec::llama(11), "device-llama", true),
            ),
            (
                "tiny qwen2".into(),
                tiny(TinySpec::qwen2(12), "device-qwen2", true),
            ),
        ];
        if let Some(p) = std::env::var_os("DSPARK_GPU_MODEL") {
            let path = std::path::PathBuf::from(p);
            let m = Model::load(
                &path,
                &LoadOptions {
                    dense: true,
                    ..Default::default()
                },
            )
            .expect("DSPARK_GPU_MODEL loads");
            models.push((path.display().to_string(), m));
        }
        for (name, model) in &models {
            // Past 64 positions the CUDA attention splits a decode step's keys into chunks.
            let toks = tokens(320.min(model.cfg.max_ctx), model.cfg.vocab_size);
            let want = model_logits(model, &toks).expect("cpu forward");
            let mut fwd = DeviceForward::new(CudaOps::new(0).expect("a CUDA device"), model)
                .expect("weights on the device");
            let got = fwd.logits(&toks).expect("cuda forward");
            let diff = compare_logits(&got, &want, model.cfg.vocab_size);
            println!("{name} on {}, one prefill: {diff:?}", fwd.backend());
            assert!(diff.top1_agreement >= 0.99, "{name}: {diff:?}");
            assert!(diff.max_rel < 1e-3, "{name}: {diff:?}");
            // Decode steps and verification windows over the device's KV cache, a rollback
            // between them, with each matmul kernel.
            for kernel in [MatmulKernel::TokenTiled, MatmulKernel::PerToken] {
                fwd.ops_mut().set_matmul(kernel);
                let got = windowed_logits(&fwd, &toks);
                let diff = compare_logits(&got, &want, model.cfg.vocab_size);
                println!("{name}, windows, {kernel:?}: {diff:?}");
                assert!(diff.top1_agreement >= 0.99, "{name} {kernel:?}: {diff:?}");
                assert!(diff.max_rel < 1e-3, "{name} {kernel:?}: {diff:?}");
                // The same bits as decoding one token at a time (past 64 positions the
                // attention splits keys into chunks: the same ones in both).
                let p = (toks.len() - 23) * model.cfg.vocab_size;
                let stepped = stepped_logits(&fwd, &toks);
                let same = got[p..]
                    .iter()
                    .zip(&stepped[p..])
                    .filter(|(a, b)| a.to_bits() == b.to_bits())
                    .count();
                println!(
                    "{name}, windows vs decode steps, {kernel:?}: {same} of {} equal",
                    got.len() - p
                );
                assert_eq!(
                    same,
                    got.len() - p,
                    "{name} {kernel:?}: windows differ from decode steps"
                );
            }
        }
    }
}
