//! dspark model runtime: real checkpoints (GGUF, Hugging Face safetensors) for the `llama` and
//! `qwen2` architectures, a caller-owned paged KV cache, and one forward over a flattened
//! variable-length batch that returns logits for every new position (and hidden states on request).
//!
//! Weights are repacked at load into the `kernels` block formats; the matmul reads each weight
//! block once per forward whatever the number of tokens, which is what keeps verification of k
//! drafted tokens close to the cost of one decode step.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod chat;
pub mod config;
pub mod device;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod json;
pub mod json_schema;
pub mod kv;
pub mod model;
pub mod safetensors;
pub mod tiny;
pub mod tokenizer;
pub mod tp;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use error::{Result, RuntimeError};
pub use kv::{KvCache, KvConfig, KvDtype, SeqId};
pub use model::{DenseLayer, ForwardOutput, LoadOptions, LogitsMode, Model, SeqInput};
pub use tokenizer::Tokenizer;
