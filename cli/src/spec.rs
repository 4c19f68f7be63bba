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

/// The KV cache (tokens) an engine needs that runs at most `max_running` requests at once,
/// none longer than `longest` tokens, prompt and answer: each request's tokens with the
/// block drafted past them (`gamma`) and a margin, twice over, as `bench frontier` sizes its
/// engines. The default ([`engine`]) holds `max_running` whole contexts (up to 8192 tokens
/// each), filled when the engine is built: hundreds of megabytes per request on a small model.
pub fn workload_kv_tokens(max_running: usize, longest: usize, gamma: usize) -> usize {
    max_running
        .max(1)
        .saturating_mul(longest.saturating_add(gamma).saturating_add(64))
        .saturating_mul(2)
}

/// [`engine`] with its KV cache sized by [`workload_kv_tokens`] (never above the default):
/// for commands that know how long their requests get.
pub fn engine_for_workload(
    target: &Loaded,
    proposer: Box<dyn Proposer>,
    gamma: usize,
    gate: bool,
    max_running: usize,
    longest: usize,
) -> anyhow::Result<Engine> {
    let default = drafter::build::engine_config(&target.model, gamma, gate, max_running).kv_tokens;
    let kv = workload_kv_tokens(max_running, longest, gamma).min(default);
    Ok(drafter::build::engine_sized(
        target,
        proposer,
        gamma,
        gate,
        max_running,
        Some(kv),
    )?)
}

/// Which drafter `--drafter` names: a kind [`ProposerKind::parse`] takes (`none`, `ngram`,
/// `draft-model[:NAME]`, `dspark[:DIR]`), else an existing directory, taken as a DSpark
/// checkpoint (as `eval-drafter --drafter DIR` takes it).
pub fn parse_drafter(s: &str, default_draft: Option<&str>) -> anyhow::Result<ProposerKind> {
    match ProposerKind::parse(s, default_draft) {
        Ok(k) => Ok(k),
        Err(_) if !s.is_empty() && std::path::Path::new(s).is_dir() => {
            Ok(ProposerKind::Dspark(Some(s.to_string())))
        }
        Err(e) if e.to_string().contains("unknown drafter") => Err(anyhow::anyhow!(
            "{e}, or a DSpark checkpoint directory (there is no directory `{s}`)"
        )),
        Err(e) => Err(e.into()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A workload's cache holds its longest request and the drafted block twice over per
    /// running request: a few thousand tokens, not `max_running` whole contexts.
    #[test]
    fn the_cache_is_sized_from_the_workload() {
        assert_eq!(workload_kv_tokens(1, 200, 4), 2 * (200 + 4 + 64));
        assert_eq!(workload_kv_tokens(16, 300, 8), 16 * 2 * (300 + 8 + 64));
        assert_eq!(workload_kv_tokens(0, 10, 0), 2 * (10 + 64));
        assert_eq!(workload_kv_tokens(usize::MAX, usize::MAX, 7), usize::MAX);
    }

    /// `--drafter DIR` is the DSpark drafter at that directory; the kinds keep their names,
    /// and anything else is refused with the choices.
    #[test]
    fn a_directory_names_a_dspark_drafter() {
        let dir = std::env::temp_dir().join(format!("dspark-drafter-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.display().to_string();
        assert_eq!(
            parse_drafter(&d, None).unwrap(),
            ProposerKind::Dspark(Some(d.clone()))
        );
        assert_eq!(
            parse_drafter(&format!("dspark:{d}"), None).unwrap(),
            ProposerKind::Dspark(Some(d.clone()))
        );
        assert_eq!(parse_drafter("ngram", None).unwrap(), ProposerKind::Ngram);
        assert_eq!(
            parse_drafter("dspark", None).unwrap(),
            ProposerKind::Dspark(None)
        );
        let missing = dir.join("missing").display().to_string();
        let e = parse_drafter(&missing, None).unwrap_err().to_string();
        assert!(
            e.contains("unknown drafter") && e.contains("directory"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
