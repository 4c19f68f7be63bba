//! The transformer (llama / qwen2 family: RMSNorm, RoPE, GQA attention, SwiGLU) over a flattened
//! variable-length batch.
//!
//! One [`Model::forward`] takes several sequences, each with its own number of new tokens (a
//! prefill chunk, 1 for decode, k+1 for verification), writes their K/V into the caller's
//! [`KvCache`] and returns logits for the positions asked for — every new position when verifying.
//! All tokens of the batch go through each matmul together, so each weight block is read once.

use crate::config::{Arch, ModelConfig};
use crate::gguf::GgufFile;
use crate::kv::{KvCache, KvConfig, KvDtype, LayerKv, SeqId};
use crate::tp::{BatchMeta, Group, Local, Part, Shard, TpOptions};
use crate::weights::{Fused, Linear};
use crate::{Result, RuntimeError};
use candle_core::{DType, Device, Tensor};
use kernels::Isa;
use kernels::ops::{self, Rope};
use kernels::par;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Which logits a sequence wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    None,
    Last,
    All,
}

/// One sequence's slice of a batched forward: its new tokens start at the cache's current length.
#[derive(Clone, Debug)]
pub struct SeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: LogitsMode,
}

/// What to capture besides logits.
#[derive(Clone, Debug, Default)]
pub struct ForwardOptions {
    /// Return the final-norm hidden state (the LM head's input) of every new token.
    pub hidden: bool,
    /// Return the residual stream after these layers (0-based) for every new token.
    pub layers: Vec<usize>,
    /// Measure where the forward's time goes ([`ForwardOutput::profile`]).
    pub profile: bool,
}

/// Seconds spent per part of one forward.
#[derive(Clone, Debug, Default)]
pub struct ForwardProfile {
    pub matmul_s: f64,
    pub attention_s: f64,
    pub head_s: f64,
    pub other_s: f64,
}

#[derive(Debug, Default)]
pub struct ForwardOutput {
    /// Rows of `vocab` logits, sequence by sequence, for the positions each asked for.
    pub logits: Vec<f32>,
    /// Per sequence: first logits row and row count.
    pub logit_rows: Vec<(usize, usize)>,
    /// Per sequence: index of its first token in the flattened batch.
    pub token_offsets: Vec<usize>,
    /// n_tokens × d_model, when asked for.
    pub hidden: Option<Vec<f32>>,
    /// One n_tokens × d_model buffer per requested layer.
    pub layer_hidden: Vec<Vec<f32>>,
    pub vocab: usize,
    pub profile: Option<ForwardProfile>,
}

impl ForwardOutput {
    /// Logits row `j` of sequence `i`.
    ///
    /// # Panics
    /// When sequence `i` has no row `j` ([`Self::try_row`] returns the error instead): a row
    /// past its own would be the next sequence's, silently.
    pub fn row(&self, i: usize, j: usize) -> &[f32] {
        match self.try_row(i, j) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        }
    }
    /// Logits row `j` of sequence `i`; an error when the sequence has no such row (it asked
    /// for none, or for the last position only).
    pub fn try_row(&self, i: usize, j: usize) -> Result<&[f32]> {
        let missing = || {
            RuntimeError::Invariant(format!(
                "logits row {j} of sequence {i}: the forward returned {:?} (first row, count) \
                 per sequence",
                self.logit_rows
            ))
        };
        let &(start, n) = self.logit_rows.get(i).ok_or_else(missing)?;
        if j >= n {
            return Err(missing());
        }
        let r = start + j;
        self.logits
            .get(r * self.vocab..(r + 1) * self.vocab)
            .ok_or_else(missing)
    }
    /// All logits rows of sequence `i`.
    pub fn rows_of(&self, i: usize) -> &[f32] {
        let (start, n) = self.logit_rows[i];
        &self.logits[start * self.vocab..(start + n) * self.vocab]
    }
}

#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Threads for this model's pool (0 = all cores).
    pub threads: usize,
    /// Dequantize every weight to f32 (the reference forward).
    pub dense: bool,
    /// Kernel path; `None` picks the fastest the CPU has.
    pub isa: Option<Isa>,
    /// Cap on the context (RoPE table, KV sizing); `None` uses the model's.
    pub max_ctx: Option<usize>,
    /// Element type of the KV caches this model makes; `None`: f16, or f32 for the `dense`
    /// reference forward.
    pub kv_dtype: Option<KvDtype>,
    /// Tensor parallelism: load this rank's slice of the heads and the FFN, and on rank 0 drive
    /// the other ranks ([`crate::tp`]).
    pub tp: Option<TpOptions>,
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Fused,
    qkv_bias: Option<Vec<f32>>,
    wo: Linear,
    /// A tensor-parallel rank whose columns of `wo` cut quantization blocks holds the whole
    /// blocks: its input goes in at this offset, zeros around it.
    wo_pad: usize,
    ffn_norm: Vec<f32>,
    gate_up: Fused,
    down: Linear,
    down_pad: usize,
}

/// One layer's weights in f32 ([`Model::dense_layer`]); matrices row-major, outputs × inputs.
pub struct DenseLayer {
    pub attn_norm: Vec<f32>,
    /// (q_dim + 2·kv_dim) × d_model.
    pub qkv: Vec<f32>,
    pub qkv_bias: Option<Vec<f32>>,
    /// d_model × q_dim.
    pub wo: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    /// 2·ffn_dim × d_model.
    pub gate_up: Vec<f32>,
    /// d_model × ffn_dim.
    pub down: Vec<f32>,
}

pub struct Model {
    pub cfg: ModelConfig,
    embed: Linear,
    head: Option<Linear>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    rope: Rope,
    isa: Isa,
    kv_dtype: KvDtype,
    /// With an `int8` cache: the key offsets its caches subtract (this rank's heads,
    /// `n_layers × kv_dim`), estimated at load ([`Model::calibrate_key_offsets`]).
    key_offsets: Option<Arc<Vec<f32>>>,
    pool: Arc<rayon::ThreadPool>,
    /// The threads the forward's matmuls and attention run on (`kernels::par`): rayon's
    /// workers sleep between loops after ~10 µs, and a forward's serial steps are longer.
    team: Arc<kernels::par::Team>,
    /// Human-readable description of the weights (e.g. "gguf Q4_1+Q8_0").
    pub weights_desc: String,
    /// A hash of the layer matrices as stored (GGUF; 0 otherwise), part of
    /// [`Model::fingerprint`].
    weights_fp: u64,
    /// A logits buffer handed back with [`Model::recycle`], for the next forward: a step's
    /// logits are rows × vocabulary (6 MB for 32 rows of SmolLM2), and a fresh buffer each
    /// step was zeroed or page-faulted in every time.
    spare_logits: std::sync::Mutex<Vec<f32>>,
    /// This rank and the size of its tensor-parallel group (0 of 1 without TP).
    shard: Shard,
    /// This rank's heads and FFN columns (all of them without TP).
    pub(crate) local: Local,
    /// On rank 0 of a group: the links to the other ranks, which every forward drives.
    group: Option<std::sync::Mutex<Group>>,
    /// Signalled when a redial outside the lock ends ([`Self::tp_redial`]).
    redialled: std::sync::Condvar,
    /// Their state, readable while a forward holds the links.
    links: Option<Arc<crate::tp::LinkState>>,
}

/// Scratch rows of one forward, shared by its layers (and by a shard rank's part of them).
pub(crate) struct Bufs {
    pub(crate) xn: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    pub(crate) proj: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    tmp: Vec<f32>,
    pad: Vec<f32>,
}

/// `x` (n rows) as the input of a matrix `width` columns wide whose first `left` columns (and
/// any past `x`'s) belong to other ranks: zeros there. `x` itself when it already fits.
fn padded<'a>(
    x: &'a [f32],
    n: usize,
    left: usize,
    width: usize,
    pad: &'a mut Vec<f32>,
) -> &'a [f32] {
    if n == 0 {
        return x;
    }
    let w = x.len() / n;
    if left == 0 && w == width {
        return x;
    }
    pad.clear();
    pad.resize(n * width, 0.0);
    for (row, src) in pad.chunks_exact_mut(width).zip(x.chunks_exact(w)) {
        row[left..left + w].copy_from_slice(src);
    }
    pad
}

/// Source of named tensors during loading.
trait TensorSource {
    fn linear(&mut self, name: &str, dense: bool) -> Result<Linear> {
        self.linear_part(name, dense, Part::Whole)
    }
    /// A slice of a matrix (a tensor-parallel rank's rows or columns).
    fn linear_part(&mut self, name: &str, dense: bool, part: Part) -> Result<Linear>;
    /// Columns `a..b` widened to whole quantization blocks, and where `a` falls in them: the
    /// weights stay exactly as stored, and the caller pads its input with zeros.
    fn linear_cols(&mut self, name: &str, dense: bool, part: Part) -> Result<(Linear, usize)> {
        Ok((self.linear_part(name, dense, part)?, 0))
    }
    fn vector(&mut self, name: &str) -> Result<Vec<f32>>;
    fn has(&self, name: &str) -> bool;
    /// The checkpoint ties the LM head to the embedding: a stored head is not read
    /// (transformers ties it over whatever is stored).
    fn tied_head(&self) -> bool {
        false
    }
    /// A tensor's shape as stored, whole (before any rank takes its slice), outermost first.
    fn dims(&mut self, name: &str) -> Result<Vec<usize>>;
    /// Checks layer `layer`'s matrix `name` is stored, whole, exactly `rows` × `cols`: a rank's
    /// slice of a larger one would load, and silently leave the rest out.
    fn expect_matrix(
        &mut self,
        layer: usize,
        what: &str,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let dims = self.dims(name)?;
        if dims != [rows, cols] {
            return Err(RuntimeError::Config(format!(
                "layer {layer}: {what} `{name}` is {dims:?}, the config expects [{rows}, {cols}]"
            )));
        }
        Ok(())
    }
}

struct GgufSource<'a> {
    g: &'a mut GgufFile,
    types: HashMap<&'static str, usize>,
    /// Whether the grouped integer kernels run here ([`kernels::grouped::native`]).
    grouped: bool,
    /// FNV-1a over the layer matrices as stored: name, type, dims and bytes from both ends.
    fp: u64,
}

/// FNV-1a step over `b`.
fn fnv(h: &mut u64, b: &[u8]) {
    for &x in b {
        *h = (*h ^ x as u64).wrapping_mul(0x100_0000_01b3);
    }
}

impl GgufSource<'_> {
    /// Every rank reads each layer matrix whole before taking its part: its type, shape and
    /// stored bytes at both ends, hashed, tell one checkpoint from another of the same shape
    /// (another quantization, a merged fine-tune). The embedding and head, which only rank 0
    /// loads, are left out.
    fn note(&mut self, name: &str, raw: &crate::gguf::RawTensor) {
        if name == GGUF_NAMES.embed || name == GGUF_NAMES.head {
            return;
        }
        fnv(&mut self.fp, name.as_bytes());
        fnv(&mut self.fp, raw.ty.name().as_bytes());
        for d in &raw.dims {
            fnv(&mut self.fp, &(*d as u64).to_le_bytes());
        }
        let n = raw.data.len();
        fnv(&mut self.fp, &raw.data[..n.min(256)]);
        fnv(&mut self.fp, &raw.data[n.saturating_sub(256)..]);
    }
}

impl TensorSource for GgufSource<'_> {
    fn linear_part(&mut self, name: &str, dense: bool, part: Part) -> Result<Linear> {
        let raw = self.g.read(name)?;
        self.note(name, &raw);
        let raw = crate::tp::slice_raw(raw, part, name)?;
        *self.types.entry(raw.ty.name()).or_default() += 1;
        Linear::from_raw(&raw, dense, self.grouped)
    }
    fn linear_cols(&mut self, name: &str, dense: bool, part: Part) -> Result<(Linear, usize)> {
        let raw = self.g.read(name)?;
        self.note(name, &raw);
        let (part, left) = crate::tp::block_aligned(part, raw.ty.block_elems());
        let raw = crate::tp::slice_raw(raw, part, name)?;
        *self.types.entry(raw.ty.name()).or_default() += 1;
        Ok((Linear::from_raw(&raw, dense, self.grouped)?, left))
    }
    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let raw = self.g.read(name)?;
        Ok(kernels::quant::dequantize(raw.ty, &raw.data, raw.elems())?)
    }
    fn has(&self, name: &str) -> bool {
        self.g.has(name)
    }
    fn dims(&mut self, name: &str) -> Result<Vec<usize>> {
        self.g
            .content
            .tensor_infos
            .get(name)
            .map(|t| t.shape.dims().to_vec())
            .ok_or_else(|| RuntimeError::MissingTensor(name.to_string()))
    }
}

/// A Hugging Face checkpoint, read tensor by tensor (a rank's row slice reads only its rows).
struct SafetensorsSource {
    ck: crate::safetensors::Checkpoint,
    /// config.json sets `tie_word_embeddings: true`.
    tied: bool,
    /// The matrices' fingerprint, as [`GgufSource`] keeps it.
    fp: u64,
}

impl SafetensorsSource {
    fn get(&mut self, name: &str) -> Result<Tensor> {
        self.ck.file(name)?.read(name)
    }

    /// Fingerprints a layer matrix as stored (the embedding and head, which only rank 0
    /// loads, are left out).
    fn note(&mut self, name: &str) -> Result<()> {
        if name == HF_NAMES.embed || name == HF_NAMES.head {
            return Ok(());
        }
        let (dtype, shape, head, tail) = self.ck.file(name)?.ends(name)?;
        fnv(&mut self.fp, name.as_bytes());
        fnv(&mut self.fp, dtype.as_bytes());
        for d in shape {
            fnv(&mut self.fp, &(d as u64).to_le_bytes());
        }
        fnv(&mut self.fp, &head);
        fnv(&mut self.fp, &tail);
        Ok(())
    }
}

impl TensorSource for SafetensorsSource {
    fn linear_part(&mut self, name: &str, _dense: bool, part: Part) -> Result<Linear> {
        self.note(name)?;
        let f = self.ck.file(name)?;
        let dims = f.shape(name).unwrap_or_default().to_vec();
        if dims.len() != 2 {
            return Err(RuntimeError::Config(format!("`{name}` is not a matrix")));
        }
        let t = match part {
            Part::Whole => f.read(name)?,
            Part::Rows(a, b) if a <= b && b <= dims[0] => f.read_rows(name, a, b)?,
            Part::Cols(a, b) if a <= b && b <= dims[1] => {
                f.read(name)?.narrow(1, a, b - a)?.contiguous()?
            }
            _ => {
                return Err(RuntimeError::Config(format!(
                    "`{name}` is {dims:?}, too small for {part:?}"
                )));
            }
        };
        Ok(Linear::Dense(t))
    }
    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self.get(name)?.flatten_all()?.to_vec1::<f32>()?)
    }
    fn has(&self, name: &str) -> bool {
        self.ck.has(name)
    }
    fn tied_head(&self) -> bool {
        self.tied
    }
    fn dims(&mut self, name: &str) -> Result<Vec<usize>> {
        self.ck
            .file(name)?
            .shape(name)
            .map(|d| d.to_vec())
            .ok_or_else(|| RuntimeError::MissingTensor(name.to_string()))
    }
}

/// Per-layer tensors ([`Names::layer`] keys) the forward has no place for: biases of the
/// output projection and of the FFN, and of q/k/v unless the architecture adds them.
/// A checkpoint that holds one is refused rather than served without it.
const UNUSED_BIASES: [&str; 7] = [
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "gate_bias",
    "up_bias",
    "down_bias",
];

/// Tensor names of one checkpoint convention.
struct Names {
    embed: &'static str,
    head: &'static str,
    out_norm: &'static str,
    layer: fn(usize, &str) -> String,
}

const GGUF_NAMES: Names = Names {
    embed: "token_embd.weight",
    head: "output.weight",
    out_norm: "output_norm.weight",
    layer: |i, n| {
        let n = match n {
            "attn_norm" => "attn_norm.weight",
            "q" => "attn_q.weight",
            "k" => "attn_k.weight",
            "v" => "attn_v.weight",
            "q_bias" => "attn_q.bias",
            "k_bias" => "attn_k.bias",
            "v_bias" => "attn_v.bias",
            "o" => "attn_output.weight",
            "o_bias" => "attn_output.bias",
            "ffn_norm" => "ffn_norm.weight",
            "gate" => "ffn_gate.weight",
            "up" => "ffn_up.weight",
            "gate_bias" => "ffn_gate.bias",
            "up_bias" => "ffn_up.bias",
            "down_bias" => "ffn_down.bias",
            _ => "ffn_down.weight",
        };
        format!("blk.{i}.{n}")
    },
};

const HF_NAMES: Names = Names {
    embed: "model.embed_tokens.weight",
    head: "lm_head.weight",
    out_norm: "model.norm.weight",
    layer: |i, n| {
        let n = match n {
            "attn_norm" => "input_layernorm.weight",
            "q" => "self_attn.q_proj.weight",
            "k" => "self_attn.k_proj.weight",
            "v" => "self_attn.v_proj.weight",
            "q_bias" => "self_attn.q_proj.bias",
            "k_bias" => "self_attn.k_proj.bias",
            "v_bias" => "self_attn.v_proj.bias",
            "o" => "self_attn.o_proj.weight",
            "o_bias" => "self_attn.o_proj.bias",
            "ffn_norm" => "post_attention_layernorm.weight",
            "gate" => "mlp.gate_proj.weight",
            "up" => "mlp.up_proj.weight",
            "gate_bias" => "mlp.gate_proj.bias",
            "up_bias" => "mlp.up_proj.bias",
            "down_bias" => "mlp.down_proj.bias",
            _ => "mlp.down_proj.weight",
        };
        format!("model.layers.{i}.{n}")
    },
};

impl Model {
    /// Loads a GGUF file or a Hugging Face directory (config.json + *.safetensors).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        if path.is_dir() {
            Self::load_hf(path, opts)
        } else {
            let mut g = GgufFile::open(path)?;
            Self::load_gguf(&mut g, opts)
        }
    }

    pub fn load_gguf(g: &mut GgufFile, opts: &LoadOptions) -> Result<Self> {
        let cfg = ModelConfig::from_gguf(g)?;
        let mut src = GgufSource {
            g,
            types: HashMap::new(),
            grouped: kernels::grouped::native(opts.isa.unwrap_or_else(Isa::detect)),
            fp: 0xcbf2_9ce4_8422_2325,
        };
        let mut m = Self::build(cfg, &mut src, &GGUF_NAMES, opts)?;
        m.weights_fp = src.fp;
        let mut types: Vec<String> = src.types.iter().map(|(k, v)| format!("{k}×{v}")).collect();
        types.sort();
        m.weights_desc = format!(
            "gguf {}{}",
            types.join(" "),
            if opts.dense { " (dequantized f32)" } else { "" }
        );
        m.connect_group(opts)?;
        if m.needs_key_offsets() {
            m.calibrate_key_offsets()?;
        }
        Ok(m)
    }

    pub fn load_hf(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => RuntimeError::NotFound(cfg_path.display().to_string()),
            _ => RuntimeError::Corrupt {
                path: cfg_path.display().to_string(),
                reason: e.to_string(),
            },
        })?;
        let cfg = ModelConfig::from_hf_json(&text)?;
        // An untied head that is missing must not be replaced by the embedding (wrong logits).
        let tie = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["tie_word_embeddings"].as_bool());
        let tied = tie.unwrap_or(true);
        let mut files = safetensors_files(dir)?;
        files.sort();
        if files.is_empty() {
            return Err(RuntimeError::NotFound(format!(
                "{}/*.safetensors",
                dir.display()
            )));
        }
        let ck = crate::safetensors::Checkpoint::open(&files, dir)?;
        if !tied && !ck.has(HF_NAMES.head) {
            return Err(RuntimeError::MissingTensor(format!(
                "{} (config.json: tie_word_embeddings is false)",
                HF_NAMES.head
            )));
        }
        let mut src = SafetensorsSource {
            ck,
            tied: tie == Some(true),
            fp: 0xcbf2_9ce4_8422_2325,
        };
        let mut m = Self::build(cfg, &mut src, &HF_NAMES, opts)?;
        m.weights_fp = src.fp;
        m.weights_desc = "safetensors (f32)".into();
        m.connect_group(opts)?;
        if m.needs_key_offsets() {
            m.calibrate_key_offsets()?;
        }
        Ok(m)
    }

    fn build(
        mut cfg: ModelConfig,
        src: &mut dyn TensorSource,
        names: &Names,
        opts: &LoadOptions,
    ) -> Result<Self> {
        if let Some(c) = opts.max_ctx {
            cfg.max_ctx = cfg.max_ctx.min(c);
        }
        // Biases the forward would not add: refused before anything is read, not ignored
        // (the model would load and compute wrong logits).
        for i in 0..cfg.n_layers {
            for s in UNUSED_BIASES {
                if cfg.qkv_bias && matches!(s, "q_bias" | "k_bias" | "v_bias") {
                    continue;
                }
                let name = (names.layer)(i, s);
                if src.has(&name) {
                    let kind = if matches!(s, "gate_bias" | "up_bias" | "down_bias") {
                        "MLP"
                    } else {
                        "attention"
                    };
                    return Err(RuntimeError::Config(format!(
                        "{} checkpoint has {kind} biases ({name}), which this runtime does \
                         not load",
                        cfg.arch.name()
                    )));
                }
            }
        }
        let isa = opts.isa.unwrap_or_else(Isa::detect);
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            opts.threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("dspark-model-{i}"))
            .build()
            .map_err(|e| RuntimeError::Config(format!("thread pool: {e}")))?;
        let team = kernels::par::Team::new(threads, "dspark-team")
            .map_err(|e| RuntimeError::Config(format!("thread team: {e}")))?;
        let dense = opts.dense;
        // Shard ranks (1..) never embed a token nor compute logits: they skip the two largest
        // matrices of a small model (a vocabulary of 150k × d).
        let shard_rank = opts.tp.as_ref().is_some_and(|t| t.rank > 0);
        let embed = if shard_rank {
            Linear::Dense(Tensor::zeros((0, cfg.d_model), DType::F32, &Device::Cpu)?)
        } else {
            src.linear(names.embed, dense)?
        };
        if !shard_rank && (embed.rows() != cfg.vocab_size || embed.cols() != cfg.d_model) {
            return Err(RuntimeError::Config(format!(
                "embedding is {}x{}, config says vocab {} × width {}",
                embed.rows(),
                embed.cols(),
                cfg.vocab_size,
                cfg.d_model
            )));
        }
        let head = if !shard_rank && !src.tied_head() && src.has(names.head) {
            Some(src.linear(names.head, dense)?)
        } else {
            None
        };
        let shard = opts
            .tp
            .as_ref()
            .map(|t| Shard {
                rank: t.rank,
                world: t.world,
            })
            .unwrap_or_default();
        let local = shard.local(&cfg)?;
        let hd = cfg.head_dim;
        let (qr, kvr, fr) = (
            local.head0 * hd..(local.head0 + local.heads) * hd,
            local.kv_head0 * hd..(local.kv_head0 + local.kv_heads) * hd,
            local.ffn0..local.ffn0 + local.ffn,
        );
        let rows = |r: &std::ops::Range<usize>| Part::rows(shard, r.clone());
        let cols = |r: &std::ops::Range<usize>| Part::cols(shard, r.clone());
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| (names.layer)(i, s);
            // Whole stored shapes first, exactly: a rank's slice (or a block-aligned widening
            // of it) is cut from these, and a larger matrix would load with its rest ignored.
            let (d, q_dim, kv_dim, ffn) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim);
            for (what, s, r, c) in [
                ("q/k/v projection", "q", q_dim, d),
                ("q/k/v projection", "k", kv_dim, d),
                ("q/k/v projection", "v", kv_dim, d),
                ("FFN gate/up", "gate", ffn, d),
                ("FFN gate/up", "up", ffn, d),
                ("output projection", "o", d, q_dim),
                ("FFN down", "down", d, ffn),
            ] {
                src.expect_matrix(i, what, &n(s), r, c)?;
            }
            let q = src.linear_part(&n("q"), dense, rows(&qr))?;
            let k = src.linear_part(&n("k"), dense, rows(&kvr))?;
            let v = src.linear_part(&n("v"), dense, rows(&kvr))?;
            if q.rows() != local.q_dim(hd)
                || k.rows() != local.kv_dim(hd)
                || v.rows() != local.kv_dim(hd)
                || [&q, &k, &v].iter().any(|m| m.cols() != cfg.d_model)
            {
                return Err(RuntimeError::Config(format!(
                    "layer {i}: q/k/v shapes disagree with the config"
                )));
            }
            let qkv_bias = if cfg.qkv_bias {
                // Each bias whole, of exactly its projection's rows; then this rank's part.
                let mut bias =
                    |key: &str, full: usize, r: &std::ops::Range<usize>| -> Result<Vec<f32>> {
                        let name = n(key);
                        let v = src.vector(&name)?;
                        if v.len() != full {
                            return Err(RuntimeError::Config(format!(
                                "layer {i}: q/k/v bias `{name}` has {} values, the config \
                                 expects {full}",
                                v.len()
                            )));
                        }
                        v.get(r.clone()).map(|p| p.to_vec()).ok_or_else(|| {
                            RuntimeError::Invariant(format!(
                                "layer {i}: rows {r:?} of the {full} of `{name}`"
                            ))
                        })
                    };
                let mut b = bias("q_bias", q_dim, &qr)?;
                b.extend(bias("k_bias", kv_dim, &kvr)?);
                b.extend(bias("v_bias", kv_dim, &kvr)?);
                Some(b)
            } else {
                None
            };
            let gate = src.linear_part(&n("gate"), dense, rows(&fr))?;
            let up = src.linear_part(&n("up"), dense, rows(&fr))?;
            if [&gate, &up]
                .iter()
                .any(|m| m.rows() != fr.len() || m.cols() != cfg.d_model)
            {
                return Err(RuntimeError::Config(format!(
                    "layer {i}: FFN gate/up shapes disagree with the config"
                )));
            }
            let (wo, wo_pad) = src.linear_cols(&n("o"), dense, cols(&qr))?;
            let (down, down_pad) = src.linear_cols(&n("down"), dense, cols(&fr))?;
            // The whole matrices are exact (above); a rank's part holds its columns, widened
            // at most to whole quantization blocks around them.
            for (m, pad, want, s) in [
                (&wo, wo_pad, qr.len(), "o"),
                (&down, down_pad, fr.len(), "down"),
            ] {
                if m.rows() != cfg.d_model || pad + want > m.cols() {
                    return Err(RuntimeError::Config(format!(
                        "layer {i}: `{}` loaded as [{}, {}] (input at column {pad}), the config \
                         expects [{}, {want}]",
                        n(s),
                        m.rows(),
                        m.cols(),
                        cfg.d_model
                    )));
                }
            }
            let mut norm = |s: &str| -> Result<Vec<f32>> {
                let v = src.vector(&n(s))?;
                if v.len() != cfg.d_model {
                    return Err(RuntimeError::Config(format!(
                        "layer {i}: {s} has {} weights, the width is {}",
                        v.len(),
                        cfg.d_model
                    )));
                }
                Ok(v)
            };
            layers.push(Layer {
                attn_norm: norm("attn_norm")?,
                qkv: Fused::new(vec![q, k, v])?,
                qkv_bias,
                wo,
                wo_pad,
                ffn_norm: norm("ffn_norm")?,
                gate_up: Fused::new(vec![gate, up])?,
                down,
                down_pad,
            });
        }
        let out_norm = src.vector(names.out_norm)?;
        if out_norm.len() != cfg.d_model {
            return Err(RuntimeError::Config(format!(
                "the output norm has {} weights, the width is {}",
                out_norm.len(),
                cfg.d_model
            )));
        }
        if let Some(h) = &head
            && (h.rows() != cfg.vocab_size || h.cols() != cfg.d_model)
        {
            return Err(RuntimeError::Config(format!(
                "the LM head is {}x{}, config says vocab {} × width {}",
                h.rows(),
                h.cols(),
                cfg.vocab_size,
                cfg.d_model
            )));
        }
        let rope = Rope::new(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.max_ctx,
            cfg.rope_interleaved,
        );
        Ok(Self {
            cfg,
            embed,
            head,
            layers,
            out_norm,
            rope,
            isa,
            kv_dtype: opts
                .kv_dtype
                .unwrap_or(if dense { KvDtype::F32 } else { KvDtype::F16 }),
            key_offsets: None,
            pool: Arc::new(pool),
            team: Arc::new(team),
            weights_desc: String::new(),
            weights_fp: 0,
            spare_logits: Default::default(),
            shard,
            local,
            group: None,
            redialled: std::sync::Condvar::new(),
            links: None,
        })
    }

    /// On rank 0 of a tensor-parallel group: connects the other ranks (waiting up to the
    /// options' connect timeout for them to come up) and checks they hold this checkpoint.
    fn connect_group(&mut self, opts: &LoadOptions) -> Result<()> {
        let Some(t) = opts.tp.as_ref().filter(|t| t.world > 1 && t.rank == 0) else {
            return Ok(());
        };
        let g = Group::connect(t, self.cfg.clone(), self.fingerprint())?;
        self.links = Some(Arc::clone(&g.state));
        self.group = Some(std::sync::Mutex::new(g));
        Ok(())
    }

    /// On rank 0 of a tensor-parallel group: the links' state (`None` without TP).
    pub fn tp_links(&self) -> Option<Arc<crate::tp::LinkState>> {
        self.links.clone()
    }

    /// On rank 0, between forwards (it does not wait for one): checks the idle links, so a
    /// rank lost meanwhile shows as down ([`crate::tp::LinkState::up`]).
    pub fn tp_check(&self) {
        if let Some(g) = &self.group
            && let Ok(mut g) = g.try_lock()
        {
            g.probe();
        }
    }

    /// On rank 0: dials the other ranks again if the links are down, so a worker whose rank
    /// came back serves again before a request has to find out. `Ok(true)` when it relinked.
    pub fn tp_redial(&self) -> Result<bool> {
        let Some(g) = &self.group else {
            return Ok(false);
        };
        let lock = || {
            g.lock()
                .map_err(|_| RuntimeError::Tp("the shard links' lock is poisoned".into()))
        };
        let Some(dialer) = lock()?.start_redial() else {
            return Ok(false);
        };
        // Clears the flag if the dial panics, or forwards would read "being dialled" for ever.
        struct Abandon<'a>(Option<&'a std::sync::Mutex<Group>>);
        impl Drop for Abandon<'_> {
            fn drop(&mut self) {
                if let Some(g) = self.0 {
                    g.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .abandon_redial();
                }
            }
        }
        let mut abandon = Abandon(Some(g));
        // Dialled without the lock: a rank that is slow to answer (up to its hello timeout per
        // rank) holds up neither admission nor forwards, which wait a moment and then fail.
        let dialled = dialer.dial();
        abandon.0 = None;
        let r = lock()?.finish_redial(dialled);
        self.redialled.notify_all();
        r
    }

    /// On rank 0, before new sequences adopt cached prefix blocks: if the ranks went down or
    /// reconnected since `cache` last synced with them, they hold none of its blocks, so its
    /// prefix cache is dropped now (the next forward syncs it again). Otherwise a request
    /// arriving after a rank came back while the worker was idle would adopt blocks the rank
    /// lost, and its forward, with every other request in it, would fail. Without TP, nothing.
    pub fn tp_sync(&self, cache: &mut KvCache) {
        let Some(g) = &self.group else {
            return;
        };
        let Ok(g) = g.lock() else {
            return;
        };
        if cache.tp_tag().is_some() && !g.holds(cache) {
            cache.mark_tp_lost();
        }
    }

    /// A hash of the configuration, the norm weights every rank loads whole and the layer
    /// matrices as stored (type, shape, bytes at both ends): ranks of one group must hold the
    /// same checkpoint, not only one of the same shape.
    pub fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        fnv(&mut h, &self.weights_fp.to_le_bytes());
        let mut eat = |b: &[u8]| fnv(&mut h, b);
        eat(serde_json::to_string(&self.cfg)
            .unwrap_or_default()
            .as_bytes());
        for v in self
            .out_norm
            .iter()
            .chain(self.layers.iter().flat_map(|l| l.attn_norm.iter()))
        {
            eat(&v.to_le_bytes());
        }
        h
    }

    /// This rank and its group's size ({0, 1} without tensor parallelism).
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Ranks in this model's tensor-parallel group (1 without TP).
    pub fn tp_degree(&self) -> usize {
        self.shard.world
    }

    /// The final RMSNorm weights (the LM head's input scale).
    pub fn out_norm_weights(&self) -> &[f32] {
        &self.out_norm
    }

    /// Logits of `m` hidden rows (m × d_model, already normalized) through the LM head, with the
    /// runtime's kernels and threads: a drafter sharing the frozen head reads its quantized
    /// weights once per call instead of an f32 copy four times their size.
    pub fn head_logits(&self, h: &[f32], m: usize) -> Result<Vec<f32>> {
        self.whole_ends()?;
        let (d, v) = (self.cfg.d_model, self.cfg.vocab_size);
        if h.len() != m * d {
            return Err(crate::RuntimeError::Config(format!(
                "head input has {} values, expected {m} × {d}",
                h.len()
            )));
        }
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let mut out = vec![0f32; m * v];
        self.install(|| head.forward(h, m, &mut out, self.isa))?;
        Ok(out)
    }

    /// Runs `f` on this model's thread pool (e.g. a drafter's matmuls, so they share the
    /// model's threads instead of waking a second pool on the same cores).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let team = &self.team;
        self.pool.install(|| team.install(f))
    }

    /// The token embedding, dequantized to f32 (vocab × d_model), e.g. for a drafter that shares it.
    pub fn embedding_f32(&self) -> Result<Vec<f32>> {
        self.whole_ends()?;
        Self::dense_rows(&self.embed, self.cfg.vocab_size, self.cfg.d_model)
    }

    /// The LM head, dequantized to f32 (vocab × d_model); the embedding when tied.
    pub fn head_f32(&self) -> Result<Vec<f32>> {
        self.whole_ends()?;
        Self::dense_rows(
            self.head.as_ref().unwrap_or(&self.embed),
            self.cfg.vocab_size,
            self.cfg.d_model,
        )
    }

    /// Refuses on a shard rank, which holds neither the embedding nor the LM head.
    fn whole_ends(&self) -> Result<()> {
        if self.shard.rank > 0 {
            return Err(RuntimeError::Tp(format!(
                "rank {} holds no embedding or LM head (rank 0 does)",
                self.shard.rank
            )));
        }
        Ok(())
    }

    fn dense_rows(l: &Linear, rows: usize, cols: usize) -> Result<Vec<f32>> {
        if l.rows() != rows || l.cols() != cols {
            return Err(RuntimeError::Invariant(format!(
                "a {} × {} matrix where {rows} × {cols} was expected",
                l.rows(),
                l.cols()
            )));
        }
        l.to_f32()
    }

    /// Layer `i`'s weights in f32 (dequantized), in the layout the forward uses: fused
    /// `[q | k | v]` and `[gate | up]` rows. For a second implementation of the forward (the
    /// device one in [`crate::device`]) that must compute exactly what this model computes.
    pub fn dense_layer(&self, i: usize) -> Result<DenseLayer> {
        if self.shard.world > 1 {
            return Err(RuntimeError::Tp(
                "a tensor-parallel rank holds a slice of each layer, not the layer".into(),
            ));
        }
        let l = self.layers.get(i).ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "layer {i} out of range (model has {})",
                self.layers.len()
            ))
        })?;
        Ok(DenseLayer {
            attn_norm: l.attn_norm.clone(),
            qkv: l.qkv.to_f32()?,
            qkv_bias: l.qkv_bias.clone(),
            wo: l.wo.to_f32()?,
            ffn_norm: l.ffn_norm.clone(),
            gate_up: l.gate_up.to_f32()?,
            down: l.down.to_f32()?,
        })
    }

    /// Element type of the KV caches [`Model::new_cache`] makes.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Bytes of weights one forward streams.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        layers + self.head.as_ref().unwrap_or(&self.embed).bytes()
    }

    /// A KV cache sized for `tokens` positions in blocks of `block_size`.
    pub fn new_cache(&self, tokens: usize, block_size: usize) -> Result<KvCache> {
        let mut c = KvCache::new(KvConfig {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.local.kv_heads,
            head_dim: self.cfg.head_dim,
            block_size,
            num_blocks: tokens.div_ceil(block_size).max(1),
            dtype: self.kv_dtype,
        })?;
        if let Some(o) = &self.key_offsets {
            c.set_key_offsets(o)?;
        }
        Ok(c)
    }

    /// The key offsets this rank's `int8` caches subtract (`n_layers × kv_dim`), if any.
    pub fn key_offsets(&self) -> Option<&[f32]> {
        self.key_offsets.as_deref().map(|v| v.as_slice())
    }

    fn needs_key_offsets(&self) -> bool {
        self.kv_dtype == KvDtype::Int8 && self.shard.rank == 0
    }

    /// Estimates the key offsets of `int8` caches (see `kv::QPool`): one forward over
    /// [`CALIBRATION_TOKENS`] tokens spread over the vocabulary into an f32 cache, then each
    /// layer's and channel's mean key. Any offset keeps attention exact; a good one shrinks what
    /// the 8-bit rows must span. The large channels it removes come from the model (biases, the
    /// residual stream's constant directions), not from the text: offsets estimated on a
    /// paragraph of prose, code and arithmetic gave the same accuracy as these (Qwen2.5-0.5B:
    /// top-1 0.986 both, mean KL 2.9·10⁻⁴ and 2.7·10⁻⁴), and building the tokenizer to encode
    /// it took 5 s of Qwen's load. With tensor parallelism every rank returns its heads' means,
    /// which rank 0 hands back with each new cache.
    ///
    /// Keys are cached after RoPE, so a constant channel stays one only where its pair turns
    /// slowly: μ is kept for the channels whose pair turns by at most [`OFFSET_MAX_TURN`] over
    /// the model's whole context (`max_ctx`), where the constant left after the subtraction is
    /// at most 2·sin(¼)|μ| ≈ |μ|/2 at every position, and set to 0 for the rest. On
    /// Qwen2.5 (θ = 10⁶, 32k positions) that keeps the 6 slowest of 32 pairs, which hold its
    /// large channels; on SmolLM2 (θ = 10⁵, 8k) the 5 slowest, while its channels of about 15
    /// turn by about 2 radians over 8k positions and are left alone.
    fn calibrate_key_offsets(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let hd = self.cfg.head_dim;
        if !(hd.is_power_of_two() && hd <= 256) {
            return Err(RuntimeError::Config(format!(
                "an int8 KV cache needs a head_dim that is a power of two up to 256 (this \
                 model's is {hd}): use int8v"
            )));
        }
        let vocab = self.cfg.vocab_size.max(1) as u64;
        let n = CALIBRATION_TOKENS.min(self.cfg.max_ctx);
        let ids: Vec<u32> = (0..n as u64)
            .map(|i| ((i * 7919 + 13) % vocab) as u32)
            .collect();
        let mut cache = KvCache::new(KvConfig {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.local.kv_heads,
            head_dim: self.cfg.head_dim,
            block_size: 16,
            num_blocks: n.div_ceil(16).max(1),
            dtype: KvDtype::F32,
        })?;
        let seq = cache.new_seq();
        let set = |g: &Option<std::sync::Mutex<Group>>, on: bool| -> Result<()> {
            if let Some(g) = g {
                g.lock()
                    .map_err(|_| RuntimeError::Tp("the shard links' lock is poisoned".into()))?
                    .calibrate = on;
            }
            Ok(())
        };
        set(&self.group, true)?;
        let run = self.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &ids,
                logits: LogitsMode::None,
            }],
            &ForwardOptions::default(),
        );
        set(&self.group, false)?;
        run?;
        let slots = (0..ids.len())
            .map(|p| cache.slot(seq, p))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // Channels whose RoPE pair turns too far over the context get no offset.
        let half = hd / 2;
        let slow: Vec<bool> = (0..hd)
            .map(|j| {
                let i = if self.cfg.rope_interleaved {
                    j / 2
                } else {
                    j % half
                };
                let inv = (self.cfg.rope_theta as f64).powf(-2.0 * i as f64 / hd as f64);
                inv * self.cfg.max_ctx.saturating_sub(1) as f64 <= OFFSET_MAX_TURN
            })
            .collect();
        let keep_slow = |m: &mut Vec<f32>| {
            for (j, x) in m.iter_mut().enumerate() {
                if !slow[j % hd] {
                    *x = 0.0;
                }
            }
        };
        let mut own = crate::kv::key_means(&cache, &slots);
        keep_slow(&mut own);
        if let Some(g) = &self.group {
            let mut g = g
                .lock()
                .map_err(|_| RuntimeError::Tp("the shard links' lock is poisoned".into()))?;
            g.key_offsets.iter_mut().for_each(keep_slow);
        }
        self.key_offsets = Some(Arc::new(own));
        tracing::info!(
            tokens = ids.len(),
            ms = t0.elapsed().as_millis() as u64,
            "int8 KV cache: key offsets estimated"
        );
        Ok(())
    }

    /// Forward over a flattened batch; see the module docs.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        batch: &[SeqInput<'_>],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput> {
        if self.shard.rank != 0 {
            return Err(RuntimeError::Tp(format!(
                "rank {} of {} holds a slice of the model; forwards run on rank 0",
                self.shard.rank, self.shard.world
            )));
        }
        let kc = cache.config();
        if (kc.n_layers, kc.n_kv_heads, kc.head_dim)
            != (self.cfg.n_layers, self.local.kv_heads, self.cfg.head_dim)
        {
            return Err(RuntimeError::Invalid(format!(
                "a KV cache of {} layers × {} KV heads × {} for a model (rank) of {} × {} × {}",
                kc.n_layers,
                kc.n_kv_heads,
                kc.head_dim,
                self.cfg.n_layers,
                self.local.kv_heads,
                self.cfg.head_dim
            )));
        }
        for l in &opts.layers {
            if *l >= self.cfg.n_layers {
                return Err(RuntimeError::Invalid(format!(
                    "layer {l} out of range (model has {})",
                    self.cfg.n_layers
                )));
            }
        }
        // A sequence twice would have both entries write their K/V from the same start, each
        // over the other's.
        let mut seqs: Vec<SeqId> = batch.iter().map(|s| s.seq).collect();
        seqs.sort_unstable();
        if let Some(w) = seqs.windows(2).find(|w| w[0] == w[1]) {
            return Err(RuntimeError::Invalid(format!(
                "sequence {} appears twice in one forward batch",
                w[0].0
            )));
        }
        // Positions and validation first, then all-or-nothing KV reservation.
        let mut starts = Vec::with_capacity(batch.len());
        for s in batch {
            let start = cache.len(s.seq)?;
            let end = start + s.tokens.len();
            if end > self.cfg.max_ctx {
                return Err(RuntimeError::ContextOverflow {
                    tokens: end,
                    ctx: self.cfg.max_ctx,
                });
            }
            if let Some(&t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(RuntimeError::Invalid(format!(
                    "token id {t} outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
            starts.push(start);
        }
        for (i, s) in batch.iter().enumerate() {
            if let Err(e) = cache.reserve(s.seq, starts[i] + s.tokens.len()) {
                for (j, s2) in batch.iter().enumerate().take(i) {
                    cache.truncate(s2.seq, starts[j])?;
                }
                return Err(e);
            }
        }
        let out = self.install(|| self.forward_inner(cache, batch, &starts, opts));
        match out {
            Ok(o) => {
                for (i, s) in batch.iter().enumerate() {
                    cache.set_len(s.seq, starts[i] + s.tokens.len())?;
                }
                Ok(o)
            }
            Err(e) => {
                for (i, s) in batch.iter().enumerate() {
                    cache.truncate(s.seq, starts[i])?;
                }
                Err(e)
            }
        }
    }

    fn forward_inner(
        &self,
        cache: &mut KvCache,
        batch: &[SeqInput<'_>],
        starts: &[usize],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput> {
        let c = &self.cfg;
        let d = c.d_model;
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let isa = self.isa;
        // Flattened token metadata.
        let mut token_offsets = Vec::with_capacity(batch.len());
        let mut x = vec![0f32; n * d];
        let mut ti = 0;
        for s in batch {
            token_offsets.push(ti);
            for &t in s.tokens {
                self.embed_row(t as usize, &mut x[ti * d..(ti + 1) * d])?;
                ti += 1;
            }
        }
        let mut out = ForwardOutput {
            token_offsets,
            vocab: c.vocab_size,
            ..Default::default()
        };
        if n == 0 {
            out.logit_rows = vec![(0, 0); batch.len()];
            return Ok(out);
        }
        let blocks: Vec<Vec<u32>> = batch
            .iter()
            .map(|s| cache.blocks(s.seq).map(|b| b.to_vec()))
            .collect::<Result<_>>()?;
        let meta = BatchMeta::new(
            batch
                .iter()
                .zip(starts)
                .map(|(s, &st)| (st, s.tokens.len()))
                .collect(),
            blocks,
            cache.config().block_size,
        );
        fn poisoned<T>(_: T) -> RuntimeError {
            RuntimeError::Tp("the shard links' lock is poisoned".into())
        }
        let mut group = match &self.group {
            Some(g) => {
                let mut g = g.lock().map_err(poisoned)?;
                // A redial under way usually ends within milliseconds: worth waiting for
                // rather than failing the step (a hung rank's, up to its timeout, is not).
                let until = Instant::now() + std::time::Duration::from_millis(500);
                while g.dialing() {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    g = self.redialled.wait_timeout(g, left).map_err(poisoned)?.0;
                }
                Some(g)
            }
            None => None,
        };
        if let Some(g) = group.as_deref_mut() {
            g.begin(cache, &meta)?;
        }
        let mut bufs = self.bufs(n);
        let mut layer_hidden: Vec<Vec<f32>> = vec![Vec::new(); opts.layers.len()];
        let mut prof = ForwardProfile::default();
        let mut clock = Clock::new(opts.profile);
        // Once the ranks have the forward, a failure anywhere (theirs, a link, this rank's own
        // compute) leaves their frames out of step with ours: the links are dropped and the
        // cache's part on the ranks counts as lost.
        let looped = (|| -> Result<()> {
            let par_rows = n >= PAR_TOKENS;
            for (li, layer) in self.layers.iter().enumerate() {
                let xs = &x;
                par::rows_mut(&mut bufs.xn[..n * d], d, par_rows, |t, xn| {
                    ops::rms_norm(
                        isa,
                        &xs[t * d..(t + 1) * d],
                        &layer.attn_norm,
                        c.rms_eps,
                        xn,
                    )
                });
                clock.lap(&mut prof.other_s);
                if let Some(g) = group.as_deref_mut() {
                    g.broadcast(&bufs.xn)?;
                }
                self.attn_part(li, cache, &meta, &mut bufs, &mut clock, &mut prof)?;
                if let Some(g) = group.as_deref_mut() {
                    g.reduce_add(&mut bufs.proj)?;
                }
                let proj = &bufs.proj;
                par::rows2_mut(
                    &mut x[..n * d],
                    d,
                    &mut bufs.xn[..n * d],
                    d,
                    par_rows,
                    |t, xr, xn| {
                        for (xv, pv) in xr.iter_mut().zip(&proj[t * d..(t + 1) * d]) {
                            *xv += pv;
                        }
                        ops::rms_norm(isa, xr, &layer.ffn_norm, c.rms_eps, xn);
                    },
                );
                clock.lap(&mut prof.other_s);
                if let Some(g) = group.as_deref_mut() {
                    g.broadcast(&bufs.xn)?;
                }
                self.ffn_part(li, n, &mut bufs, &mut clock, &mut prof)?;
                if let Some(g) = group.as_deref_mut() {
                    g.reduce_add(&mut bufs.proj)?;
                }
                let proj = &bufs.proj;
                par::rows_mut(&mut x[..n * d], d, par_rows, |t, xr| {
                    for (xv, pv) in xr.iter_mut().zip(&proj[t * d..(t + 1) * d]) {
                        *xv += pv;
                    }
                });
                // In the caller's requested order (a layer asked for twice gets the copy twice).
                for (slot, _) in opts.layers.iter().enumerate().filter(|(_, l)| **l == li) {
                    layer_hidden[slot] = x.clone();
                }
            }
            if let Some(g) = group.as_deref_mut()
                && g.calibrate
            {
                let per_rank = c.n_layers * self.local.kv_heads * c.head_dim;
                g.key_offsets = g.key_means(per_rank)?;
            }
            Ok(())
        })();
        if let Err(e) = looped {
            if let Some(g) = group.as_deref_mut() {
                g.reset();
                cache.mark_tp_lost();
            }
            return Err(e);
        }
        drop(group);
        let mut xn = std::mem::take(&mut bufs.xn);
        out.layer_hidden = layer_hidden;
        for t in 0..n {
            ops::rms_norm(
                isa,
                &x[t * d..(t + 1) * d],
                &self.out_norm,
                c.rms_eps,
                &mut xn[t * d..(t + 1) * d],
            );
        }
        // Gather the rows that want logits, then one head matmul over all of them.
        let mut rows = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            let first = rows.len();
            let off = out.token_offsets[i];
            match s.logits {
                LogitsMode::None => {}
                LogitsMode::Last => {
                    if !s.tokens.is_empty() {
                        rows.push(off + s.tokens.len() - 1);
                    }
                }
                LogitsMode::All => rows.extend(off..off + s.tokens.len()),
            }
            out.logit_rows.push((first, rows.len() - first));
        }
        clock.lap(&mut prof.other_s);
        if !rows.is_empty() {
            let mut hsel = vec![0f32; rows.len() * d];
            for (j, &r) in rows.iter().enumerate() {
                hsel[j * d..(j + 1) * d].copy_from_slice(&xn[r * d..(r + 1) * d]);
            }
            // The head writes every element, so a recycled buffer needs no zeroing.
            let need = rows.len() * c.vocab_size;
            let mut logits = self
                .spare_logits
                .lock()
                .map(|mut v| std::mem::take(&mut *v))
                .unwrap_or_default();
            if logits.len() < need {
                logits.resize(need, 0.0);
            }
            logits.truncate(need);
            self.head.as_ref().unwrap_or(&self.embed).forward(
                &hsel,
                rows.len(),
                &mut logits,
                isa,
            )?;
            out.logits = logits;
        }
        clock.lap(&mut prof.head_s);
        if opts.profile {
            out.profile = Some(prof);
        }
        if opts.hidden {
            out.hidden = Some(xn);
        }
        Ok(out)
    }

    /// Scratch for a forward of `n` tokens, sized to this rank's slice.
    pub(crate) fn bufs(&self, n: usize) -> Bufs {
        let (d, hd, l) = (self.cfg.d_model, self.cfg.head_dim, &self.local);
        Bufs {
            xn: vec![0f32; n * d],
            qkv: vec![0f32; n * (l.q_dim(hd) + 2 * l.kv_dim(hd))],
            att: vec![0f32; n * l.q_dim(hd)],
            proj: vec![0f32; n * d],
            gu: vec![0f32; n * 2 * l.ffn],
            act: vec![0f32; n * l.ffn],
            tmp: Vec::new(),
            pad: Vec::new(),
        }
    }

    /// Attention of layer `li` from the normalized rows in `b.xn`: this rank's heads project,
    /// rotate and cache their K/V, attend, and leave their share of the output projection in
    /// `b.proj` (the whole of it without tensor parallelism; ranks' shares add up to it).
    pub(crate) fn attn_part(
        &self,
        li: usize,
        cache: &mut KvCache,
        meta: &BatchMeta,
        b: &mut Bufs,
        clock: &mut Clock,
        prof: &mut ForwardProfile,
    ) -> Result<()> {
        let layer = &self.layers[li];
        let (n, hd, isa) = (meta.tok_pos.len(), self.cfg.head_dim, self.isa);
        let qd = self.local.q_dim(hd);
        let kvd = self.local.kv_dim(hd);
        let qkv_dim = qd + 2 * kvd;
        layer.qkv.forward(&b.xn, n, &mut b.qkv, isa, &mut b.tmp)?;
        clock.lap(&mut prof.matmul_s);
        par::rows_mut(
            &mut b.qkv[..n * qkv_dim],
            qkv_dim,
            n >= PAR_TOKENS,
            |t, row| {
                if let Some(bias) = &layer.qkv_bias {
                    for (r, bv) in row.iter_mut().zip(bias) {
                        *r += bv;
                    }
                }
                let (q, kv) = row.split_at_mut(qd);
                self.rope.apply(q, meta.tok_pos[t]);
                self.rope.apply(&mut kv[..kvd], meta.tok_pos[t]);
            },
        );
        for (t, row) in b.qkv[..n * qkv_dim].chunks_exact(qkv_dim).enumerate() {
            let kv = &row[qd..];
            cache.write(li, meta.tok_slot[t], &kv[..kvd], &kv[kvd..]);
        }
        clock.lap(&mut prof.other_s);
        self.attention(cache, li, meta, &b.qkv, &mut b.att);
        clock.lap(&mut prof.attention_s);
        let att = padded(&b.att, n, layer.wo_pad, layer.wo.cols(), &mut b.pad);
        layer.wo.forward(att, n, &mut b.proj, isa)?;
        clock.lap(&mut prof.matmul_s);
        Ok(())
    }

    /// The FFN of layer `li` over this rank's columns, from `b.xn` into `b.proj`.
    pub(crate) fn ffn_part(
        &self,
        li: usize,
        n: usize,
        b: &mut Bufs,
        clock: &mut Clock,
        prof: &mut ForwardProfile,
    ) -> Result<()> {
        let layer = &self.layers[li];
        let isa = self.isa;
        layer
            .gate_up
            .forward(&b.xn, n, &mut b.gu, isa, &mut b.tmp)?;
        clock.lap(&mut prof.matmul_s);
        let f = self.local.ffn;
        let gu = &b.gu;
        par::rows_mut(&mut b.act[..n * f], f, n >= PAR_TOKENS_SWIGLU, |t, act| {
            ops::silu_mul(isa, &gu[t * 2 * f..(t + 1) * 2 * f], act)
        });
        clock.lap(&mut prof.other_s);
        let act = padded(&b.act, n, layer.down_pad, layer.down.cols(), &mut b.pad);
        layer.down.forward(act, n, &mut b.proj, isa)?;
        clock.lap(&mut prof.matmul_s);
        Ok(())
    }

    /// Hands a finished forward's logits buffer back for the next forward to fill.
    pub fn recycle(&self, out: ForwardOutput) {
        if let Ok(mut v) = self.spare_logits.lock()
            && out.logits.capacity() > v.capacity()
        {
            *v = out.logits;
        }
    }

    fn embed_row(&self, t: usize, out: &mut [f32]) -> Result<()> {
        match &self.embed {
            Linear::Quant(q) => {
                q.dequantize_row(t, out);
                Ok(())
            }
            Linear::Dense(w) => {
                let v = w.get(t)?.to_vec1::<f32>()?;
                out.copy_from_slice(&v);
                Ok(())
            }
        }
    }

    /// Causal GQA attention of every new token over its own sequence's cached positions `0..=pos`.
    /// One task per (sequence, KV head, chunk of queries, part of the positions): all query
    /// heads of the group and all new tokens of the sequence share each K/V row read.
    ///
    /// Positions split into parts of [`ATTN_PART`] (rounded up to whole blocks; the last part
    /// of a row runs on to its end), each part a task, merged by their log-sum-exp: one request decoding has only as many tasks as KV
    /// heads (3 for SmolLM2, 2 for Qwen2.5), fewer than a CPU has threads, or a number they do
    /// not divide. The parts depend on a query row's own position only, never on the batch,
    /// so a row gets the same bits in a decode, a verification window or a prefill chunk (what
    /// keeps speculative decoding token-for-token equal to plain decoding); a row within one
    /// part is computed exactly as without parts.
    fn attention(
        &self,
        cache: &KvCache,
        layer: usize,
        meta: &BatchMeta,
        qkv: &[f32],
        att: &mut [f32],
    ) {
        let c = &self.cfg;
        let hd = c.head_dim;
        let (n_heads, n_kv) = (self.local.heads, self.local.kv_heads);
        let qd = self.local.q_dim(hd);
        let qkv_dim = qd + 2 * self.local.kv_dim(hd);
        let group = n_heads / n_kv;
        let (batch_tokens, tok_pos) = (&meta.seqs, &meta.tok_pos);
        let scale = 1.0 / (hd as f32).sqrt();
        let pools = cache.layer(layer);
        let isa = self.isa;
        let bs = cache.config().block_size;
        let part = ATTN_PART.div_ceil(bs) * bs;
        // Tasks: (sequence index, kv head, first token, token count, part, parts).
        const QROWS: usize = 12;
        let mut tasks = Vec::new();
        for (si, &(t0, nt)) in batch_tokens.iter().enumerate() {
            let per = (QROWS / group).max(1);
            for g in 0..n_kv {
                let mut a = 0;
                while a < nt {
                    let b = (a + per).min(nt);
                    let longest = tok_pos[t0 + a..t0 + b].iter().max().map_or(1, |p| p + 1);
                    let parts = (longest / part).max(1);
                    for p in 0..parts {
                        tasks.push((si, g, t0 + a, b - a, p, parts));
                    }
                    a = b;
                }
            }
        }
        // Positions of token `t`'s row in part `p` of its task. A row of `l`
        // positions has max(1, ⌊l / part⌋) parts: whole ones of `part`, the last one running
        // on to `l` (at most 2·part − 1), so no part is a sliver.
        let own_parts = |t: usize| ((tok_pos[t] + 1) / part).max(1);
        let lim_in = |t: usize, p: usize| -> usize {
            let (l, own) = (tok_pos[t] + 1, own_parts(t));
            if p + 1 == own {
                l - p * part
            } else if p < own {
                part
            } else {
                0
            }
        };
        type Task = (usize, usize, usize, usize, usize, usize);
        let run = |&(si, g, t0, nt, p, parts): &Task| -> (Vec<f32>, Vec<f32>) {
            let mut q = Vec::with_capacity(nt * group * hd);
            let mut lims = Vec::with_capacity(nt * group);
            for t in t0..t0 + nt {
                for h in g * group..(g + 1) * group {
                    q.extend_from_slice(&qkv[t * qkv_dim + h * hd..t * qkv_dim + (h + 1) * hd]);
                    lims.push(lim_in(t, p));
                }
            }
            if matches!(pools, LayerKv::Int8 { .. }) {
                // The cache holds rotated keys: rotated queries give the same scores.
                q.chunks_exact_mut(hd).for_each(ops::hadamard);
            }
            let mut out = vec![0f32; nt * group * hd];
            let mut lse = vec![0f32; if parts > 1 { nt * group } else { 0 }];
            let mut scores = Vec::new();
            let blocks = &meta.blocks[si][p * part / bs..];
            // The same call for either element type of the pools.
            macro_rules! attend_over {
                ($kpool:expr, $kscale:expr, $vpool:expr, $vscale:expr) => {
                    ops::attend_lse(
                        isa,
                        &ops::AttendArgs {
                            q: &q,
                            lims: &lims,
                            kpool: $kpool,
                            vpool: $vpool,
                            kscale: $kscale,
                            vscale: $vscale,
                            blocks,
                            bs,
                            n_kv,
                            g,
                            hd,
                            scale,
                        },
                        &mut scores,
                        &mut out,
                        &mut lse,
                    )
                };
            }
            match pools {
                LayerKv::F16(kpool, vpool) => attend_over!(kpool, &[], vpool, &[]),
                LayerKv::F32(kpool, vpool) => attend_over!(kpool, &[], vpool, &[]),
                LayerKv::Int8V { k, v, vscale } => attend_over!(k, &[], v, vscale),
                LayerKv::Int8 {
                    k,
                    kscale,
                    v,
                    vscale,
                } => attend_over!(k, kscale, v, vscale),
            }
            (out, lse)
        };
        let total_work: usize = tok_pos.iter().map(|p| p + 1).sum::<usize>() * n_heads * hd;
        let results: Vec<(Vec<f32>, Vec<f32>)> = if total_work < 100_000 || tasks.len() == 1 {
            tasks.iter().map(run).collect()
        } else {
            kernels::par::map(tasks.len(), |i| run(&tasks[i]))
        };
        let mut i = 0;
        let mut w = Vec::new();
        while i < tasks.len() {
            let (_, g, t0, nt, _, parts) = tasks[i];
            let done = &results[i..i + parts];
            for (j, t) in (t0..t0 + nt).enumerate() {
                for (hh, h) in (g * group..(g + 1) * group).enumerate() {
                    let row = j * group + hh;
                    let dst = &mut att[t * qd + h * hd..t * qd + (h + 1) * hd];
                    // The row's own parts are the task's first `own`; one is copied as it is.
                    let own = own_parts(t);
                    if own == 1 {
                        dst.copy_from_slice(&done[0].0[row * hd..(row + 1) * hd]);
                        continue;
                    }
                    let m = (0..own)
                        .map(|p| done[p].1[row])
                        .fold(f32::NEG_INFINITY, f32::max);
                    w.clear();
                    w.extend((0..own).map(|p| (p, (done[p].1[row] - m).exp())));
                    let z: f32 = w.iter().map(|x| x.1).sum();
                    dst.fill(0.0);
                    for &(p, wp) in &w {
                        let wp = wp / z;
                        for (d, s) in dst.iter_mut().zip(&done[p].0[row * hd..(row + 1) * hd]) {
                            *d = wp.mul_add(*s, *d);
                        }
                    }
                }
            }
            i += parts;
        }
    }
}

/// Positions per part of an attention task (see `Model::attention`). Measured on 2 threads
/// (`decode_profile`, `bench/results/attn-split-s44/`): parts of 512 made 32 requests at
/// context 1024 about 3 % slower (twice the tasks, each with its own scratch and merge) and
/// gained little at 2048; parts of 2048 took SmolLM2's attention at one request and context
/// 6000 from 12.2 to 9.5 ms and at 8 requests and 4096 from 59.5 to 51.8 ms, but a last part
/// of a few positions (context 2048 and a decode) cost 4 %: a row's last part now takes the
/// remainder, so contexts under 4096 run in one part as before.
const ATTN_PART: usize = 2048;

/// The most a RoPE pair may turn over the context, in radians, for its channels to keep a key
/// offset (see [`Model::calibrate_key_offsets`]).
const OFFSET_MAX_TURN: f64 = 0.5;

/// Tokens [`Model::calibrate_key_offsets`] runs: the large channels it removes are near
/// constants, which a few dozen positions pin down.
const CALIBRATION_TOKENS: usize = 128;

/// Tokens from which a forward's per-token steps between matmuls (norms, residuals, RoPE) run
/// on the team: handing a loop over costs about 0.5 µs, and these steps about 0.1 µs a token.
/// Done on one thread, they left the other idle for a tenth of a 32-token step.
const PAR_TOKENS: usize = 16;

/// The same for SwiGLU, about 1 µs a token at SmolLM2's width.
const PAR_TOKENS_SWIGLU: usize = 4;

/// Lap timer that costs nothing when disabled.
pub(crate) struct Clock {
    last: Option<Instant>,
}

impl Clock {
    pub(crate) fn new(on: bool) -> Self {
        Self {
            last: on.then(Instant::now),
        }
    }
    fn lap(&mut self, acc: &mut f64) {
        if let Some(l) = self.last {
            let now = Instant::now();
            *acc += (now - l).as_secs_f64();
            self.last = Some(now);
        }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cfg", &self.cfg)
            .field("weights", &self.weights_desc)
            .finish()
    }
}

/// Convenience: the architecture name for display.
pub fn arch_name(a: Arch) -> &'static str {
    a.name()
}

/// The weight files of a Hugging Face directory: those its `model.safetensors.index.json`
/// names when it has one (a sharded checkpoint; other `.safetensors` files beside the shards,
/// such as Mistral's `consolidated.safetensors`, are not this model's and were read too, each
/// tensor of the last one read winning), else every `*.safetensors` file.
fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect());
    }
    let corrupt = |reason: String| RuntimeError::Corrupt {
        path: index.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(&index)?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
    let map = v["weight_map"]
        .as_object()
        .ok_or_else(|| corrupt("no weight_map object".into()))?;
    let mut names = Vec::new();
    for f in map.values() {
        let name = f
            .as_str()
            .ok_or_else(|| corrupt("a weight_map value is not a file name".into()))?;
        // A bare file name in this directory: an index must not reach outside it.
        let plain = Path::new(name)
            .file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(name));
        if !plain {
            return Err(corrupt(format!("`{name}` is not a file of this directory")));
        }
        names.push(name.to_string());
    }
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(corrupt("weight_map names no files".into()));
    }
    let files: Vec<std::path::PathBuf> = names.iter().map(|n| dir.join(n)).collect();
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(RuntimeError::NotFound(format!(
            "{} (named by {})",
            missing.display(),
            index.display()
        )));
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::{TinySpec, tiny_model_path};

    fn opts() -> LoadOptions {
        LoadOptions {
            threads: 1,
            ..Default::default()
        }
    }

    #[test]
    fn a_logits_row_past_its_sequence_is_refused() {
        // Two sequences of one row each (vocabulary 2): row 1 of the first is not the second's.
        let o = ForwardOutput {
            logits: vec![1.0, 2.0, 3.0, 4.0],
            logit_rows: vec![(0, 1), (1, 1)],
            vocab: 2,
            ..Default::default()
        };
        assert_eq!(o.row(1, 0), [3.0, 4.0]);
        assert_eq!(o.try_row(0, 0).unwrap(), [1.0, 2.0]);
        for (i, j) in [(0, 1), (1, 1), (2, 0)] {
            let e = o.try_row(i, j).unwrap_err().to_string();
            assert!(
                e.contains(&format!("logits row {j} of sequence {i}")),
                "{e}"
            );
            let r = std::panic::catch_unwind(|| o.row(i, j).to_vec());
            assert!(r.is_err(), "row({i}, {j}) gave {r:?}");
        }
    }

    #[test]
    fn one_sequence_twice_in_a_batch_is_refused() {
        let p = tiny_model_path(&TinySpec::llama(3), "model-unit-dup").unwrap();
        let m = Model::load(&p, &opts()).unwrap();
        let mut c = m.new_cache(64, 16).unwrap();
        let (s, t) = (c.new_seq(), c.new_seq());
        let input = |seq, tokens| SeqInput {
            seq,
            tokens,
            logits: LogitsMode::Last,
        };
        let batch = [input(s, &[1u32, 2][..]), input(t, &[3]), input(s, &[4])];
        let e = m
            .forward(&mut c, &batch, &ForwardOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("appears twice"), "{e}");
        assert_eq!((c.len(s).unwrap(), c.len(t).unwrap()), (0, 0));
        let o = m
            .forward(&mut c, &batch[..2], &ForwardOptions::default())
            .unwrap();
        assert_eq!(o.logit_rows.len(), 2);
        assert_eq!((c.len(s).unwrap(), c.len(t).unwrap()), (2, 1));
    }

    /// A one-layer Hugging Face llama directory whose stored `lm_head.weight` (zeros) differs
    /// from its embedding (ones), with `extra` added to its config.json.
    fn hf_with_head(name: &str, extra: &str) -> std::path::PathBuf {
        let (d, heads, kvh, ffn, vocab) = (64usize, 4usize, 2usize, 96usize, 300usize);
        let kvd = kvh * d / heads;
        let dir =
            std::env::temp_dir().join(format!("dspark-model-unit-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = |r: usize, c: usize| Tensor::ones((r, c), DType::F32, &Device::Cpu).unwrap();
        let v = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
        let mut ts: HashMap<String, Tensor> = HashMap::new();
        ts.insert("model.embed_tokens.weight".into(), m(vocab, d));
        ts.insert(
            "lm_head.weight".into(),
            Tensor::zeros((vocab, d), DType::F32, &Device::Cpu).unwrap(),
        );
        ts.insert("model.norm.weight".into(), v(d));
        for (n, t) in [
            ("input_layernorm.weight", v(d)),
            ("post_attention_layernorm.weight", v(d)),
            ("self_attn.q_proj.weight", m(d, d)),
            ("self_attn.k_proj.weight", m(kvd, d)),
            ("self_attn.v_proj.weight", m(kvd, d)),
            ("self_attn.o_proj.weight", m(d, d)),
            ("mlp.gate_proj.weight", m(ffn, d)),
            ("mlp.up_proj.weight", m(ffn, d)),
            ("mlp.down_proj.weight", m(d, ffn)),
        ] {
            ts.insert(format!("model.layers.0.{n}"), t);
        }
        candle_core::safetensors::save(&ts, dir.join("model.safetensors")).unwrap();
        std::fs::write(
            dir.join("config.json"),
            format!(
                r#"{{"model_type":"llama","hidden_size":{d},"intermediate_size":{ffn},"num_hidden_layers":1,"num_attention_heads":{heads},"num_key_value_heads":{kvh},"vocab_size":{vocab},"max_position_embeddings":256{extra}}}"#
            ),
        )
        .unwrap();
        dir
    }

    #[test]
    fn a_tied_head_is_the_embedding_even_when_one_is_stored() {
        for (name, extra, tied) in [
            ("tied", r#","tie_word_embeddings":true"#, true),
            ("untied", r#","tie_word_embeddings":false"#, false),
            ("unset", "", false),
        ] {
            let dir = hf_with_head(name, extra);
            let m = Model::load(&dir, &opts()).unwrap();
            let head = m.head_f32().unwrap();
            assert_eq!(head == m.embedding_f32().unwrap(), tied, "{name}");
            assert_eq!(head.iter().all(|&x| x == 0.0), !tied, "{name}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
