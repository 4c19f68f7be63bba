//! The DSpark drafter (../shared/DESIGN.md §4): a parallel backbone that drafts a whole block in
//! one forward, conditioned on hidden states of a few target layers, plus a low-rank Markov head
//! that restores dependency inside the block and a confidence head that predicts per-position
//! survival. The target's embedding and LM head are frozen and shared.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod build;
pub mod calibrate;
pub mod fast;
pub mod model;
pub mod proposer;
pub mod train;

pub use model::{DrafterConfig, DsparkDrafter};
pub use proposer::DsparkProposer;

#[derive(Debug, thiserror::Error)]
pub enum DrafterError {
    #[error("drafter checkpoint {path}: {reason}")]
    Checkpoint { path: String, reason: String },
    #[error("drafter belongs to another target: {0}")]
    WrongTarget(String),
    #[error("invalid: {0}")]
    Invalid(String),
    /// Candle's own text, without the backtrace it carries under RUST_BACKTRACE.
    #[error("{}", dspark_runtime::error::candle_message(.0))]
    Candle(candle_core::Error),
    #[error(transparent)]
    Runtime(#[from] dspark_runtime::RuntimeError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl From<candle_core::Error> for DrafterError {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(e)
    }
}

pub type Result<T, E = DrafterError> = std::result::Result<T, E>;
