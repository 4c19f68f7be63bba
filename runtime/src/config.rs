//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use crate::gguf::GgufFile;
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "llama" | "LlamaForCausalLM" => Ok(Arch::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Arch::Qwen2),
            other => Err(RuntimeError::UnknownArch(other.to_string())),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// Bounds a configuration is checked against (see [`ModelConfig::validate`]).
pub const MAX_LAYERS: usize = 1024;
pub const MAX_WIDTH: usize = 1 << 16;
pub const MAX_HEADS: usize = 1024;
pub const MAX_VOCAB: usize = 1 << 22;
pub const MAX_CONTEXT: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub max_ctx: usize,
    /// q/k/v projections carry biases (qwen2).
    pub qkv_bias: bool,
    /// RoPE rotates adjacent pairs (GGUF llama) rather than halves (HF layout, qwen2).
    pub rope_interleaved: bool,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(RuntimeError::Config(m));
        if self.n_layers == 0 || self.d_model == 0 || self.n_heads == 0 || self.n_kv_heads == 0 {
            return bad("layers, width and head counts must be positive".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if self.vocab_size == 0 || self.max_ctx == 0 || self.head_dim == 0 || self.ffn_dim == 0 {
            return bad("vocab size, context, head_dim and FFN width must be positive".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0)
            || !(self.rms_eps.is_finite() && self.rms_eps > 0.0)
        {
            return bad(format!(
                "rope theta {} and RMSNorm epsilon {} must be positive numbers",
                self.rope_theta, self.rms_eps
            ));
        }
        // Far past any model served here: a corrupt header must not size the allocations
        // (layers, the RoPE table) before a tensor is read.
        for (what, v, max) in [
            ("layers", self.n_layers, MAX_LAYERS),
            ("width", self.d_model, MAX_WIDTH),
            ("heads", self.n_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEADS),
            ("FFN width", self.ffn_dim, 8 * MAX_WIDTH),
            ("vocabulary", self.vocab_size, MAX_VOCAB),
            ("context", self.max_ctx, MAX_CONTEXT),
        ] {
            if v > max {
                return bad(format!(
                    "{what} {v} is past any model this runtime serves ({max})"
                ));
            }
        }
        Ok(())
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_s = g
            .meta_str("general.architecture")
            .ok_or_else(|| RuntimeError::Corrupt {
                path: g.path.display().to_string(),
                reason: "no general.architecture".into(),
            })?;
        let arch = Arch::parse(&arch_s)?;
        let a = arch.name();
        let need = |k: &str| {
            g.meta_u64(&format!("{a}.{k}"))
                .map(|v| v as usize)
                .ok_or_else(|| RuntimeError::Config(format!("GGUF lacks `{a}.{k}`")))
        };
        let d_model = need("embedding_length")?;
        let n_heads = need("attention.head_count")?;
        let n_kv_heads = g
            .meta_u64(&format!("{a}.attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        let head_dim = g
            .meta_u64(&format!("{a}.attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(d_model / n_heads.max(1));
        let vocab_size = match g.meta("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec().map(|v| v.len()).unwrap_or(0),
            None => 0,
        };
        let vocab_size = if vocab_size > 0 {
            vocab_size
        } else {
            g.meta_u64(&format!("{a}.vocab_size"))
                .map(|v| v as usize)
                .unwrap_or(0)
        };
        // Scaled RoPE (Llama 3.1's frequency table, linear, YaRN) moves positions this runtime
        // does not move: refused, not served with wrong positions.
        let scaling = g
            .meta_str(&format!("{a}.rope.scaling.type"))
            .unwrap_or_default();
        if !(scaling.is_empty() || scaling == "none") || g.has("rope_freqs.weight") {
            return Err(RuntimeError::Config(format!(
                "this GGUF scales RoPE ({}), which this runtime does not implement",
                if scaling.is_empty() {
                    "rope_freqs.weight".to_string()
                } else {
                    format!("{a}.rope.scaling.type = {scaling}")
                }
            )));
        }
        // llama.cpp reads a factor without a type as linear scaling (`rope.scale_linear`, the
        // older key, and `rope.scaling.factor`; 0 and 1 scale nothing).
        if scaling.is_empty() {
            for key in [
                format!("{a}.rope.scaling.factor"),
                format!("{a}.rope.scale_linear"),
            ] {
                if let Some(f) = g.meta_f32(&key)
                    && f != 0.0
                    && f != 1.0
                {
                    return Err(RuntimeError::Config(format!(
                        "this GGUF scales RoPE linearly ({key} = {f}), which this runtime does \
                         not implement"
                    )));
                }
            }
        }
        // Partial rotary (RoPE over part of each head) would rotate channels it must not.
        if let Some(n) = g.meta_u64(&format!("{a}.rope.dimension_count"))
            && n != head_dim as u64
        {
            return Err(RuntimeError::Config(format!(
                "this GGUF rotates {n} of each head's {head_dim} channels \
                 ({a}.rope.dimension_count); this runtime rotates them all"
            )));
        }
        let cfg = Self {
            arch,
            n_layers: need("block_count")?,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: need("feed_forward_length")?,
            vocab_size,
            rope_theta: g
                .meta_f32(&format!("{a}.rope.freq_base"))
                .unwrap_or(10000.0),
            rms_eps: g
                .meta_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            max_ctx: need("context_length")?,
            qkv_bias: arch == Arch::Qwen2,
            rope_interleaved: arch == Arch::Llama,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Hf {
            architectures: Option<Vec<String>>,
            model_type: Option<String>,
            hidden_size: usize,
            intermediate_size: usize,
            num_hidden_layers: usize,
            num_attention_heads: usize,
            num_key_value_heads: Option<usize>,
            head_dim: Option<usize>,
            vocab_size: usize,
            rope_theta: Option<f32>,
            /// transformers 5 keeps theta and scaling here.
            rope_parameters: Option<serde_json::Value>,
            rope_scaling: Option<serde_json::Value>,
            rms_norm_eps: Option<f32>,
            max_position_embeddings: Option<usize>,
            /// LlamaConfig: q/k/v/o projections carry biases.
            attention_bias: Option<bool>,
            /// LlamaConfig: the gate/up/down projections carry biases.
            mlp_bias: Option<bool>,
            /// Qwen2Config: layers from `max_window_layers` on attend to the last
            /// `sliding_window` positions only.
            use_sliding_window: Option<bool>,
            sliding_window: Option<usize>,
            max_window_layers: Option<usize>,
            /// Newer transformers: each layer's attention, `sliding_attention` or full.
            layer_types: Option<Vec<String>>,
            /// The FFN's activation (`hidden_activation` in some configs).
            hidden_act: Option<String>,
            hidden_activation: Option<String>,
        }
        let hf: Hf = serde_json::from_str(text)
            .map_err(|e| RuntimeError::Config(format!("config.json: {e}")))?;
        let arch_name = hf
            .model_type
            .clone()
            .or_else(|| hf.architectures.as_ref().and_then(|a| a.first().cloned()))
            .unwrap_or_default();
        let arch = Arch::parse(&arch_name)?;
        // Biases the forward does not add (llama's optional attention biases, any MLP bias;
        // qwen2's q/k/v biases are its own and always there): refused, not served without them.
        for (key, set, refused) in [
            ("attention_bias", hf.attention_bias, arch == Arch::Llama),
            ("mlp_bias", hf.mlp_bias, true),
        ] {
            if refused && set == Some(true) {
                return Err(RuntimeError::Config(format!(
                    "config.json sets `{key}: true` for a {} model: biases this runtime does \
                     not load",
                    arch.name()
                )));
            }
        }
        // Scaled RoPE moves positions this runtime does not move: refused, not served wrong.
        for v in [&hf.rope_scaling, &hf.rope_parameters]
            .into_iter()
            .flatten()
        {
            let kind = v["rope_type"]
                .as_str()
                .or(v["type"].as_str())
                .unwrap_or("default");
            if kind != "default" {
                return Err(RuntimeError::Config(format!(
                    "config.json scales RoPE (`{kind}`), which this runtime does not implement"
                )));
            }
        }
        // Sliding-window attention hides keys past the window, which this runtime attends to:
        // refused, not served with other logits. A window no shorter than the context, or
        // layers all below `max_window_layers`, never slide.
        let ctx = hf.max_position_embeddings.unwrap_or(2048);
        let slides = hf.use_sliding_window == Some(true)
            && hf.sliding_window.is_some_and(|w| w < ctx)
            && hf.max_window_layers.unwrap_or(0) < hf.num_hidden_layers;
        let sliding_layer = hf
            .layer_types
            .iter()
            .flatten()
            .any(|t| t == "sliding_attention");
        if slides || sliding_layer {
            return Err(RuntimeError::Config(format!(
                "config.json asks for sliding-window attention ({}), which this runtime does not \
                 implement",
                if sliding_layer {
                    "`layer_types` has `sliding_attention`".to_string()
                } else {
                    format!(
                        "`use_sliding_window: true`, `sliding_window: {}`",
                        hf.sliding_window.unwrap_or_default()
                    )
                }
            )));
        }
        // The FFN computes SiLU (transformers' `swish` is the same function).
        for (key, act) in [
            ("hidden_act", &hf.hidden_act),
            ("hidden_activation", &hf.hidden_activation),
        ] {
            if let Some(act) = act
                && act != "silu"
                && act != "swish"
            {
                return Err(RuntimeError::Config(format!(
                    "config.json sets `{key}: {act}`; this runtime's FFN computes silu only"
                )));
            }
        }
        let rope_theta = hf
            .rope_parameters
            .as_ref()
            .and_then(|p| p["rope_theta"].as_f64())
            .map(|t| t as f32)
            .or(hf.rope_theta);
        let cfg = Self {
            arch,
            n_layers: hf.num_hidden_layers,
            d_model: hf.hidden_size,
            n_heads: hf.num_attention_heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            ffn_dim: hf.intermediate_size,
            vocab_size: hf.vocab_size,
            rope_theta: rope_theta.unwrap_or(10000.0),
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            max_ctx: ctx,
            qkv_bias: arch == Arch::Qwen2,
            rope_interleaved: false,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    fn hf(extra: &str) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(&format!(
            r#"{{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100{extra}}}"#
        ))
    }

    #[test]
    fn scaled_rope_is_refused_and_transformers_5_theta_read() {
        assert_eq!(hf("").unwrap().rope_theta, 10000.0);
        assert_eq!(hf(r#","rope_scaling":null"#).unwrap().rope_theta, 10000.0);
        // transformers 5 keeps theta under rope_parameters.
        let c = hf(r#","rope_parameters":{"rope_type":"default","rope_theta":1000000.0}"#).unwrap();
        assert_eq!(c.rope_theta, 1e6);
        for scaled in [
            r#","rope_scaling":{"rope_type":"llama3","factor":8.0}"#,
            r#","rope_scaling":{"type":"linear","factor":2.0}"#,
            r#","rope_parameters":{"rope_type":"yarn","rope_theta":1000000.0}"#,
        ] {
            let e = hf(scaled).unwrap_err().to_string();
            assert!(e.contains("scales RoPE"), "{scaled}: {e}");
        }
    }

    /// `from_gguf` on a metadata-only GGUF: a llama of width 64, 4 heads, plus `extra`.
    fn gguf(name: &str, extra: &[(&str, gguf_file::Value)]) -> Result<ModelConfig> {
        use gguf_file::Value as V;
        let mut md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String("llama".into())),
            ("llama.embedding_length".into(), V::U32(64)),
            ("llama.attention.head_count".into(), V::U32(4)),
            ("llama.block_count".into(), V::U32(2)),
            ("llama.feed_forward_length".into(), V::U32(128)),
            ("llama.context_length".into(), V::U32(256)),
            ("llama.vocab_size".into(), V::U32(100)),
        ];
        md.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let p = std::env::temp_dir().join(format!(
            "dspark-config-unit-{}-{name}.gguf",
            std::process::id()
        ));
        let mut f = std::fs::File::create(&p).unwrap();
        gguf_file::write(&mut f, &refs, &[]).unwrap();
        drop(f);
        let g = GgufFile::open(&p).unwrap();
        let _ = std::fs::remove_file(&p);
        ModelConfig::from_gguf(&g)
    }

    #[test]
    fn gguf_linear_rope_factor_without_a_type_and_partial_rotary_are_refused() {
        use gguf_file::Value as V;
        assert_eq!(gguf("plain", &[]).unwrap().head_dim, 16);
        // Factors that scale nothing, a type of none, a full rotary dimension: served.
        for (name, k, v) in [
            ("factor-1", "llama.rope.scaling.factor", V::F32(1.0)),
            ("linear-0", "llama.rope.scale_linear", V::F32(0.0)),
            ("dims-16", "llama.rope.dimension_count", V::U32(16)),
        ] {
            assert!(gguf(name, &[(k, v)]).is_ok(), "{name}");
        }
        let typed_none = [
            ("llama.rope.scaling.type", V::String("none".into())),
            ("llama.rope.scaling.factor", V::F32(1.0)),
        ];
        assert!(gguf("none", &typed_none).is_ok());
        for (name, k, v) in [
            ("factor-4", "llama.rope.scaling.factor", V::F32(4.0)),
            ("linear-2", "llama.rope.scale_linear", V::F32(2.0)),
            ("dims-8", "llama.rope.dimension_count", V::U32(8)),
        ] {
            let e = gguf(name, &[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{name}: {e}");
        }
    }

    #[test]
    fn sliding_window_attention_and_other_activations_are_refused() {
        // Qwen2.5's own configs: the window is off, or longer than the context.
        for ok in [
            r#","use_sliding_window":false,"sliding_window":4096"#,
            r#","use_sliding_window":true,"sliding_window":null"#,
            r#","use_sliding_window":true,"sliding_window":4096,"max_position_embeddings":4096"#,
            r#","use_sliding_window":true,"sliding_window":64,"max_window_layers":2"#,
            r#","layer_types":["full_attention","full_attention"]"#,
            r#","hidden_act":"silu","hidden_activation":"silu""#,
        ] {
            assert!(hf(ok).is_ok(), "{ok}");
        }
        for (bad, says) in [
            (
                r#","use_sliding_window":true,"sliding_window":64"#,
                "sliding_window: 64",
            ),
            (
                r#","use_sliding_window":true,"sliding_window":64,"max_window_layers":1"#,
                "sliding_window: 64",
            ),
            (
                r#","layer_types":["full_attention","sliding_attention"]"#,
                "sliding_attention",
            ),
            (r#","hidden_act":"gelu""#, "hidden_act: gelu"),
            (
                r#","hidden_activation":"gelu_pytorch_tanh""#,
                "hidden_activation",
            ),
        ] {
            let e = hf(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn degenerate_shapes_and_numbers_are_refused() {
        for bad in [
            r#","attention_bias":true"#,
            r#","mlp_bias":true"#,
            r#","head_dim":0"#,
            r#","rope_theta":-1.0"#,
            r#","rms_norm_eps":0.0"#,
        ] {
            assert!(hf(bad).is_err(), "{bad}");
        }
        let e = hf(r#","attention_bias":true"#).unwrap_err().to_string();
        assert!(e.contains("attention_bias"), "{e}");
        assert!(hf(r#","attention_bias":false,"mlp_bias":false"#).is_ok());
    }
}
