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
            max_ctx: hf.max_position_embeddings.unwrap_or(2048),
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
