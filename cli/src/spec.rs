//! Building the speculative engine from command-line choices (`--drafter`, `--gamma`); the
//! shared logic lives in [`drafter::build`].

use crate::config::Global;
pub use drafter::build::{DraftCache, Loaded, default_draft_for};
use specdec::{Engine, Proposer, ProposerKind};

pub fn load_target(g: &Global, name: &str) -> anyhow::Result<Loaded> {
    Ok(g.hub().load(name)?)
}

/// Builds a proposer; a draft model is loaded once per cache.
pub fn build_proposer(
    g: &Global,
    kind: &ProposerKind,
    target: &Loaded,
    drafts: &mut DraftCache,
) -> anyhow::Result<Box<dyn Proposer>> {
    Ok(drafter::build::build_proposer(
        &g.hub(),
        kind,
        target,
        drafts,
    )?)
}

pub fn engine(
    target: &Loaded,
    proposer: Box<dyn Proposer>,
    gamma: usize,
    gate: bool,
    max_running: usize,
) -> anyhow::Result<Engine> {
    Ok(drafter::build::engine(
        target,
        proposer,
        gamma,
        gate,
        max_running,
    )?)
}
