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
    // No `#[from]` (the `From` impls below): a source would print its message a second time
    // under anyhow's `{:#}`.
    #[error("device: {0}")]
    Device(kernels::cuda::GpuError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("tensor: {}", candle_message(.0))]
    Candle(candle_core::Error),
}

impl From<kernels::cuda::GpuError> for RuntimeError {
    fn from(e: kernels::cuda::GpuError) -> Self {
        Self::Device(e)
    }
}

impl From<candle_core::Error> for RuntimeError {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(e)
    }
}

/// A candle error as a user reads it: the backtrace candle attaches when `RUST_BACKTRACE` is
/// set (`WithBacktrace`) left out, and its context and path wrappers on one line.
pub fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        other => other.to_string(),
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_errors_read_without_their_backtrace_or_a_repeat() {
        let inner = candle_core::Error::Msg("bad header".into());
        let wrapped = candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        assert_eq!(candle_message(&wrapped), "bad header");
        let ctx = candle_core::Error::Msg("short read".into()).context("tensor `w`");
        assert_eq!(candle_message(&ctx), "tensor `w`: short read");
        let e = anyhow::Error::from(RuntimeError::from(wrapped));
        assert_eq!(format!("{e:#}"), "tensor: bad header");
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::from(RuntimeError::from(io));
        assert_eq!(format!("{e:#}"), "no such file");
    }
}
