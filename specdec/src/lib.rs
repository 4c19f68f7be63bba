//! Speculative-decoding core: the [`Proposer`] seam (n-gram lookup, an independent draft model,
//! none — the DSpark drafter plugs in through the same trait), the continuous-batching
//! [`engine::Engine`] that drafts, verifies many requests in one flattened forward, accepts
//! losslessly and commits / rolls back KV per request, and the metrics it reports.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod engine;
pub mod metrics;
pub mod profile;
pub mod proposer;
pub mod recal;
pub mod stats;

pub use engine::{
    Engine, EngineConfig, Event, FinishReason, MAX_TOP_LOGPROBS, Request, TokenLogprob,
    VerifyPolicy,
};
pub use metrics::{ConfBlock, RequestMetrics};
pub use proposer::{DraftBlock, Proposer, ProposerKind};

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("incompatible drafter: {0}")]
    Incompatible(String),
    #[error("unknown request id {0}")]
    UnknownRequest(u64),
    #[error("duplicate request id {0}")]
    Duplicate(u64),
    #[error("invariant violated: {0}")]
    Invariant(String),
    #[error(transparent)]
    Runtime(#[from] dspark_runtime::RuntimeError),
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
}

pub type Result<T, E = SpecError> = std::result::Result<T, E>;

/// Largest draft length a request may ask for.
pub const MAX_GAMMA: usize = 32;
