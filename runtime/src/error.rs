use thiserror::Error;

/// Every failure of the runtime, classified once at its cause.
#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("model file not found: {0}")]
    NotFound(String),
    #[error("cannot read model file {path}: {reason}")]
    Corrupt { path: String, reason: String },
    #[error("unknown architecture `{0}` (supported: llama, qwen2)")]
    UnknownArch(String),
    #[error(
        "unsupported tensor type {dtype} for `{tensor}` (supported: F32, F16, BF16, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0)"
    )]
    UnsupportedQuant { tensor: String, dtype: String },
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    #[error("bad config: {0}")]
    Config(String),
    #[error("prompt of {tokens} tokens does not fit the context of {ctx} tokens")]
    ContextOverflow { tokens: usize, ctx: usize },
    #[error("KV cache is full")]
    KvFull,
    #[error("unknown sequence {0}")]
    UnknownSeq(u64),
    #[error("invariant violated: {0}")]
    Invariant(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("fetch: {0}")]
    Fetch(String),
    #[error("checksum mismatch for {path}: expected {expected}, got {got}")]
    Checksum {
        path: String,
        expected: String,
        got: String,
    },
    #[error("invalid input: {0}")]
    Invalid(String),
    #[error("tensor parallelism: {0}")]
    Tp(String),
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    #[error("device: {0}")]
    Device(#[from] kernels::cuda::GpuError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
