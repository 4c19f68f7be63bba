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

/// An engine like [`engine`] (gate off) whose KV cache holds `kv_tokens`: for benchmarks that
/// keep several engines alive at once and know how long their requests get.
pub fn engine_sized(
    target: &Loaded,
    proposer: Box<dyn Proposer>,
    gamma: usize,
    max_running: usize,
    kv_tokens: usize,
) -> anyhow::Result<Engine> {
    Ok(drafter::build::engine_sized(
        target,
        proposer,
        gamma,
        false,
        max_running,
        Some(kv_tokens),
    )?)
}

/// The target's SPS(B) profile: the cached one whose key matches, else profiled now.
pub fn sps_profile(
    g: &Global,
    name: &str,
    target: &Loaded,
    grid: &[usize],
) -> anyhow::Result<dspark_scheduler::admission::SpsTable> {
    target_worker::sps::check_grid(grid, target_worker::sps::DEFAULT_CTXS)
        .map_err(anyhow::Error::msg)?;
    let path = g.resolve_model(name)?;
    let key = target_worker::sps::key_for(
        name,
        &path,
        &target.model,
        grid,
        target_worker::sps::DEFAULT_CTXS,
    );
    let (sps, cached) = target_worker::sps::load_or_profile(&g.home, key, &target.model)?;
    eprintln!(
        "SPS(B) table: {} stairs ({})",
        sps.points.len(),
        if cached { "cached" } else { "profiled now" }
    );
    Ok(sps)
}
