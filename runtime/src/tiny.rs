//! Tiny seeded models generated in code: real GGUF files (written with candle's GGUF writer, with
//! real quantized tensors and a byte-level BPE tokenizer in the metadata) that load through the
//! same path as the real checkpoints. They keep unit and integration tests fast and need no
//! download. Same seed, same file.

use crate::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kernels::rng::Rng;
use std::path::Path;

/// Shape and weight types of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub arch: &'static str,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn_dim: usize,
    pub max_ctx: usize,
    /// Type of the attention / FFN matrices.
    pub dtype: GgmlDType,
    /// Type of the token embedding (also the tied head).
    pub embed_dtype: GgmlDType,
    /// Store a separate `output.weight` instead of tying it to the embedding.
    pub separate_head: bool,
    /// Token-string variant: tiny models with different `vocab_variant` have different vocabularies.
    pub vocab_variant: u8,
    pub seed: u64,
    /// qwen2 only: added to the key bias of each KV head's last channel (the slowest RoPE
    /// pair), the near-constant large key channel of Qwen2.5's layers (about 145 in layer 0).
    pub k_bias_spike: f32,
    /// Standard deviation of the token embedding (also the tied head). 1 makes the next-token
    /// distribution peaked (logits of deviation about √d_model), so greedy decoding varies;
    /// about 0.15 spreads it, for tests of sampled distributions.
    pub embed_scale: f32,
}

impl TinySpec {
    /// A llama-architecture model of width 64 with Q4_1 layers and Q8_0 tied embeddings
    /// (the same quant mix as SmolLM2).
    pub fn llama(seed: u64) -> Self {
        Self {
            arch: "llama",
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_dim: 128,
            max_ctx: 512,
            dtype: GgmlDType::Q4_1,
            embed_dtype: GgmlDType::Q8_0,
            separate_head: false,
            vocab_variant: 0,
            seed,
            k_bias_spike: 0.0,
            embed_scale: 1.0,
        }
    }

    /// A qwen2-architecture model (QKV biases) of width 256 with K-quant layers and a separate
    /// Q6_K head (the Qwen2.5-Coder mix).
    pub fn qwen2(seed: u64) -> Self {
        Self {
            arch: "qwen2",
            n_layers: 2,
            d_model: 256,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_dim: 512,
            max_ctx: 512,
            dtype: GgmlDType::Q4K,
            embed_dtype: GgmlDType::Q8_0,
            separate_head: true,
            vocab_variant: 0,
            seed,
            k_bias_spike: 0.0,
            embed_scale: 1.0,
        }
    }
}

/// GPT-2's byte → printable-char mapping used by byte-level BPE vocabularies.
pub fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs: Vec<u32> = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        out[*b as usize] = char::from_u32(c).unwrap_or('?');
    }
    out
}

pub const TINY_CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Vocabulary: 256 byte tokens, a few merges, and the ChatML specials.
fn vocab(variant: u8) -> (Vec<String>, Vec<String>, Vec<u32>) {
    let bc = byte_chars();
    let mut tokens: Vec<String> = bc.iter().map(|c| c.to_string()).collect();
    let sp = bc[b' ' as usize];
    let merges_src = [
        ("t", "h"),
        ("th", "e"),
        (&*sp.to_string(), "t"),
        ("i", "n"),
        ("e", "r"),
    ];
    let mut merges = Vec::new();
    for (a, b) in merges_src {
        merges.push(format!("{a} {b}"));
        tokens.push(format!("{a}{b}"));
    }
    if variant != 0 {
        tokens.push(format!("variant{variant}"));
    }
    let mut types = vec![1u32; tokens.len()];
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(s.to_string());
        types.push(3);
    }
    (tokens, merges, types)
}

fn qtensor(
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    scale: f32,
    dtype: GgmlDType,
) -> Result<QTensor> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| rng.normal() as f32 * scale)
        .collect();
    let t = if cols == 0 {
        Tensor::from_vec(v, rows, &Device::Cpu)?
    } else {
        Tensor::from_vec(v, (rows, cols), &Device::Cpu)?
    };
    Ok(QTensor::quantize(&t, dtype)?)
}

fn vector(rng: &mut Rng, n: usize, base: f32, jitter: f32) -> Result<QTensor> {
    let v: Vec<f32> = (0..n)
        .map(|_| base + rng.normal() as f32 * jitter)
        .collect();
    Ok(QTensor::quantize(
        &Tensor::from_vec(v, n, &Device::Cpu)?,
        GgmlDType::F32,
    )?)
}

/// Writes the tiny model to `path` (a GGUF file).
pub fn write_gguf(spec: &TinySpec, path: &Path) -> Result<()> {
    let mut rng = Rng::new(spec.seed);
    let (tokens, merges, types) = vocab(spec.vocab_variant);
    let vocab_size = tokens.len();
    let a = spec.arch;
    let hd = spec.d_model / spec.n_heads;
    let kvd = hd * spec.n_kv_heads;
    let d = spec.d_model;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    // Embedding scale large enough that greedy decoding is not a constant token.
    tensors.push((
        "token_embd.weight".into(),
        qtensor(&mut rng, vocab_size, d, spec.embed_scale, spec.embed_dtype)?,
    ));
    if spec.separate_head {
        tensors.push((
            "output.weight".into(),
            qtensor(&mut rng, vocab_size, d, 0.5, GgmlDType::Q6K.min_for(d))?,
        ));
    }
    tensors.push(("output_norm.weight".into(), vector(&mut rng, d, 1.0, 0.1)?));
    let ws = 1.0 / (d as f32).sqrt();
    for i in 0..spec.n_layers {
        let p = |n: &str| format!("blk.{i}.{n}");
        tensors.push((p("attn_norm.weight"), vector(&mut rng, d, 1.0, 0.1)?));
        tensors.push((p("attn_q.weight"), qtensor(&mut rng, d, d, ws, spec.dtype)?));
        tensors.push((
            p("attn_k.weight"),
            qtensor(&mut rng, kvd, d, ws, spec.dtype)?,
        ));
        tensors.push((
            p("attn_v.weight"),
            qtensor(&mut rng, kvd, d, ws, spec.dtype)?,
        ));
        if a == "qwen2" {
            tensors.push((p("attn_q.bias"), vector(&mut rng, d, 0.0, 0.1)?));
            let mut kb: Vec<f32> = (0..kvd).map(|_| rng.normal() as f32 * 0.1).collect();
            for h in 0..spec.n_kv_heads {
                kb[(h + 1) * (d / spec.n_heads) - 1] += spec.k_bias_spike;
            }
            tensors.push((
                p("attn_k.bias"),
                QTensor::quantize(&Tensor::from_vec(kb, kvd, &Device::Cpu)?, GgmlDType::F32)?,
            ));
            tensors.push((p("attn_v.bias"), vector(&mut rng, kvd, 0.0, 0.1)?));
        }
        tensors.push((
            p("attn_output.weight"),
            qtensor(&mut rng, d, d, ws, spec.dtype)?,
        ));
        tensors.push((p("ffn_norm.weight"), vector(&mut rng, d, 1.0, 0.1)?));
        tensors.push((
            p("ffn_gate.weight"),
            qtensor(&mut rng, spec.ffn_dim, d, ws, spec.dtype)?,
        ));
        tensors.push((
            p("ffn_up.weight"),
            qtensor(&mut rng, spec.ffn_dim, d, ws, spec.dtype)?,
        ));
        let fs = 1.0 / (spec.ffn_dim as f32).sqrt();
        tensors.push((
            p("ffn_down.weight"),
            qtensor(
                &mut rng,
                d,
                spec.ffn_dim,
                fs,
                spec.dtype.min_for(spec.ffn_dim),
            )?,
        ));
    }
    let u = |v: usize| Value::U32(v as u32);
    let strs = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (
            "general.name".into(),
            Value::String(format!("tiny-{a}-{}", spec.seed)),
        ),
        (format!("{a}.block_count"), u(spec.n_layers)),
        (format!("{a}.embedding_length"), u(d)),
        (format!("{a}.feed_forward_length"), u(spec.ffn_dim)),
        (format!("{a}.attention.head_count"), u(spec.n_heads)),
        (format!("{a}.attention.head_count_kv"), u(spec.n_kv_heads)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        (format!("{a}.rope.freq_base"), Value::F32(10000.0)),
        (format!("{a}.context_length"), u(spec.max_ctx)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::String(if a == "qwen2" { "qwen2" } else { "smollm" }.into()),
        ),
        ("tokenizer.ggml.tokens".into(), strs(&tokens)),
        ("tokenizer.ggml.merges".into(), strs(&merges)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.iter().map(|&t| Value::I32(t as i32)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), u(vocab_size - 2)),
        ("tokenizer.ggml.eos_token_id".into(), u(vocab_size - 1)),
        (
            "tokenizer.chat_template".into(),
            Value::String(TINY_CHAT_TEMPLATE.into()),
        ),
    ];
    write_file(path, &metadata, &tensors)
}

/// Writes a GGUF file through a temporary name, so a reader never sees half of one.
fn write_file(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[(String, QTensor)],
) -> Result<()> {
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    gguf_file::write(&mut f, &md, &ts)?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Writes a GGUF checkpoint cut to its first `layers` layers (embedding, output norm and head
/// kept, tensors copied as they are): real weights in a file small enough to carry to a
/// machine without network (the GPU check's real-model case).
pub fn slice_gguf(src: &Path, dst: &Path, layers: usize) -> Result<()> {
    let corrupt = |e: candle_core::Error| crate::RuntimeError::Corrupt {
        path: src.display().to_string(),
        reason: crate::error::candle_message(&e),
    };
    let mut f = std::fs::File::open(src)
        .map_err(|_| crate::RuntimeError::NotFound(src.display().to_string()))?;
    let content = gguf_file::Content::read(&mut f).map_err(corrupt)?;
    let arch = match content.metadata.get("general.architecture") {
        Some(Value::String(a)) => a.clone(),
        _ => {
            return Err(crate::RuntimeError::Config(
                "no general.architecture".into(),
            ));
        }
    };
    let key = format!("{arch}.block_count");
    let total = match content.metadata.get(&key) {
        Some(Value::U32(n)) => *n as usize,
        Some(Value::U64(n)) => *n as usize,
        _ => return Err(crate::RuntimeError::Config(format!("no {key}"))),
    };
    if layers == 0 || layers > total {
        return Err(crate::RuntimeError::Invalid(format!(
            "{layers} layers of a {total}-layer model"
        )));
    }
    let mut metadata: Vec<(String, Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in &mut metadata {
        if *k == key {
            *v = Value::U32(layers as u32);
        }
    }
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let keep = |name: &str| match name.strip_prefix("blk.") {
        Some(rest) => rest
            .split('.')
            .next()
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i < layers),
        None => true,
    };
    let mut names: Vec<&String> = content.tensor_infos.keys().filter(|n| keep(n)).collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    for n in names {
        tensors.push((
            n.clone(),
            content.tensor(&mut f, n, &Device::Cpu).map_err(corrupt)?,
        ));
    }
    write_file(dst, &metadata, &tensors)
}

/// Writes (once per process, name and spec) and returns the path of a tiny model in the temp
/// dir. The file is named by `name` and a hash of every field of `spec`, so two specs never
/// share one; it is written by this process before its first use here (never taken from disk:
/// a file left by an earlier process of the same id may come from another generator, or be cut
/// short by a crash), through a temporary file renamed into place, so it is whole once it
/// exists.
pub fn tiny_model_path(spec: &TinySpec, name: &str) -> Result<std::path::PathBuf> {
    use std::collections::HashSet;
    use std::path::PathBuf;
    // Tests run in parallel threads: one writer at a time, and the paths this process wrote.
    static WRITTEN: std::sync::Mutex<Option<HashSet<PathBuf>>> = std::sync::Mutex::new(None);
    let mut written = WRITTEN.lock().unwrap_or_else(|e| e.into_inner());
    let written = written.get_or_insert_with(HashSet::new);
    let dir = std::env::temp_dir().join(format!("dspark-tiny-{}", std::process::id()));
    let path = dir.join(format!("{name}-{:016x}.gguf", spec_hash(spec)));
    if !written.contains(&path) {
        // Through a temporary file renamed into place (`write_file`).
        write_gguf(spec, &path)?;
        written.insert(path.clone());
    }
    Ok(path)
}

/// A stable hash (FNV-1a, 64-bit) of every field of `spec`, through its `Debug` form (floats
/// print exactly there): the same across processes and builds, unlike `std`'s hasher.
fn spec_hash(spec: &TinySpec) -> u64 {
    format!("{spec:?}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

trait MinFor {
    /// K-quants need rows that are multiples of 256; fall back to Q8_0 for narrower ones.
    fn min_for(self, cols: usize) -> GgmlDType;
}

impl MinFor for GgmlDType {
    fn min_for(self, cols: usize) -> GgmlDType {
        match self {
            GgmlDType::Q4K | GgmlDType::Q6K if !cols.is_multiple_of(256) => GgmlDType::Q8_0,
            other => other,
        }
    }
}

/// The tiny models [`scenario_bits`] is run on across kernel paths, with a file name each: a
/// llama of width 128 (head dim 64, which the vectorized attention takes) and a qwen2 (biases,
/// Q8_0).
pub fn scenario_specs() -> [(TinySpec, &'static str); 2] {
    let llama = TinySpec {
        d_model: 128,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_dim: 256,
        ..TinySpec::llama(5)
    };
    [(llama, "isa-llama"), (TinySpec::qwen2(6), "isa-qwen2")]
}

/// The bits a fixed scenario computes: a 37-token prefill, then an 8-token verification window
/// over its cache; the final hidden state (the LM head's input) of every new token, and with
/// `logits` the logits too. Kernel paths that claim the same arithmetic (every ISA with grouped
/// kernels, on x86 and on Arm) are compared on it (`runtime/tests/runtime.rs`,
/// `runtime/tests/aarch64.rs`, `examples/forward_bits.rs`).
pub fn scenario_bits(model: &crate::Model, logits: bool) -> Result<Vec<u32>> {
    use crate::model::ForwardOptions;
    use crate::{LogitsMode, SeqInput};
    let mut c = model.new_cache(128, 16)?;
    let s = c.new_seq();
    let mut bits = Vec::new();
    let vocab = model.cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..37u32).map(|i| i * 53 % vocab.min(250)).collect();
    let window: Vec<u32> = [7u32, 9, 11, 13, 17, 19, 23, 29]
        .iter()
        .map(|t| t % vocab)
        .collect();
    for toks in [&prompt[..], &window[..]] {
        let o = model.forward(
            &mut c,
            &[SeqInput {
                seq: s,
                tokens: toks,
                logits: LogitsMode::All,
            }],
            &ForwardOptions {
                hidden: true,
                ..Default::default()
            },
        )?;
        bits.extend(o.hidden.unwrap_or_default().iter().map(|v| v.to_bits()));
        if logits {
            bits.extend(o.logits.iter().map(|v| v.to_bits()));
        }
    }
    Ok(bits)
}

/// FNV-1a over a slice of words: a short fingerprint of [`scenario_bits`] to compare across
/// processes.
pub fn fingerprint(bits: &[u32]) -> u64 {
    bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, w| {
        w.to_le_bytes()
            .iter()
            .fold(h, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file already on the path (left by an earlier process of the same id, cut short by a
    /// crash) is written over on first use; the same name with another spec is another file.
    #[test]
    fn tiny_model_path_writes_its_own_file_per_spec() {
        let spec = TinySpec::llama(71);
        let dir = std::env::temp_dir().join(format!("dspark-tiny-{}", std::process::id()));
        let stale = dir.join(format!("tiny-path-test-{:016x}.gguf", spec_hash(&spec)));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&stale, b"GGUF truncated").unwrap();
        let p = tiny_model_path(&spec, "tiny-path-test").unwrap();
        assert_eq!(p, stale);
        let whole = std::fs::read(&p).unwrap();
        assert!(
            whole.len() > 1000 && whole.starts_with(b"GGUF"),
            "{}",
            whole.len()
        );
        let opts = crate::LoadOptions {
            threads: 1,
            ..Default::default()
        };
        crate::Model::load(&p, &opts).unwrap();
        // Once written, the same spec is the same file, not written again.
        let modified = std::fs::metadata(&p).unwrap().modified().unwrap();
        assert_eq!(tiny_model_path(&spec, "tiny-path-test").unwrap(), p);
        assert_eq!(std::fs::metadata(&p).unwrap().modified().unwrap(), modified);
        // Any field changed (here the last one): another file.
        let other = TinySpec {
            embed_scale: 0.5,
            ..spec.clone()
        };
        let q = tiny_model_path(&other, "tiny-path-test").unwrap();
        assert_ne!(q, p);
        assert_ne!(std::fs::read(&q).unwrap(), whole);
        assert_ne!(spec_hash(&spec), spec_hash(&TinySpec::llama(72)));
    }
}
