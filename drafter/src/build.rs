//! Building targets and proposers from names (`--model NAME|PATH`, `--drafter KIND`): shared by
//! the CLI, the target worker (in-process drafting) and the draft worker.

use crate::{DrafterError, DsparkDrafter, DsparkProposer, Result};
use dspark_runtime::{LoadOptions, Model, Tokenizer};
use specdec::proposer::{DraftModelProposer, NgramProposer, NoProposer};
use specdec::{Proposer, ProposerKind, SpecError};
use std::path::PathBuf;
use std::sync::Arc;

/// Where models come from: the cache directory, the Python used to fetch, load options.
#[derive(Clone, Debug)]
pub struct ModelHub {
    pub home: PathBuf,
    pub python: String,
    pub opts: LoadOptions,
}

impl ModelHub {
    /// Resolves `NAME|PATH`, fetching known names on first use.
    pub fn resolve(&self, model: &str) -> Result<PathBuf> {
        Ok(dspark_runtime::fetch::resolve(
            model,
            &self.home,
            &self.python,
            &mut |m| eprintln!("{m}"),
        )?)
    }

    pub fn load(&self, name: &str) -> Result<Loaded> {
        let path = self.resolve(name)?;
        Ok(Loaded {
            name: name.to_string(),
            model: Arc::new(Model::load(&path, &self.opts)?),
            tok: Arc::new(Tokenizer::load(&path)?),
        })
    }
}

/// A loaded model with its tokenizer.
pub struct Loaded {
    pub name: String,
    pub model: Arc<Model>,
    pub tok: Arc<Tokenizer>,
}

/// The draft model paired with a target by default (`--drafter draft-model`).
pub fn default_draft_for(target: &str) -> Option<&'static str> {
    match target {
        "qwen2.5-coder-1.5b" => Some("qwen2.5-coder-0.5b"),
        _ => None,
    }
}

/// The shipped DSpark drafter of a target, if the repository has one: `drafters/TARGET`
/// beside the source tree the binary was built from (the container image keeps only that
/// directory, so the path names no `..` through this crate's own, absent there).
pub fn default_dspark_for(target: &str) -> Option<PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .join("drafters")
        .join(target);
    p.join("drafter.json").exists().then_some(p)
}

/// The drafter `dspark up` and the workers use when none is named: the shipped DSpark drafter
/// when the repository has one for the target, n-gram lookup otherwise.
pub fn default_kind_for(target: &str) -> ProposerKind {
    if default_dspark_for(target).is_some() {
        ProposerKind::Dspark(None)
    } else {
        ProposerKind::Ngram
    }
}

/// Draft models loaded so far (bench arms reuse them).
#[derive(Default)]
pub struct DraftCache {
    loaded: Vec<(String, Loaded)>,
}

impl DraftCache {
    pub fn get(&mut self, hub: &ModelHub, name: &str) -> Result<&Loaded> {
        if let Some(i) = self.loaded.iter().position(|(n, _)| n == name) {
            return Ok(&self.loaded[i].1);
        }
        let l = hub.load(name)?;
        self.loaded.push((name.to_string(), l));
        Ok(&self.loaded.last().expect("just pushed").1)
    }
}

/// Builds a proposer for `target`; a draft model is loaded once per cache.
pub fn build_proposer(
    hub: &ModelHub,
    kind: &ProposerKind,
    target: &Loaded,
    drafts: &mut DraftCache,
) -> Result<Box<dyn Proposer>> {
    Ok(match kind {
        ProposerKind::None => Box::new(NoProposer),
        ProposerKind::Ngram => Box::new(NgramProposer::default()),
        ProposerKind::Dspark(dir) => {
            let dir = match dir {
                Some(d) => PathBuf::from(d),
                None => default_dspark_for(&target.name).ok_or_else(|| {
                    DrafterError::Invalid(format!(
                        "no shipped DSpark drafter for `{}` yet; train one with `dspark train-drafter` and pass --drafter dspark:DIR",
                        target.name
                    ))
                })?,
            };
            let (e, h) = crate::model::target_tensors(&target.model)?;
            let dr = DsparkDrafter::load(
                &dir,
                target.model.cfg.arch.name(),
                &target.tok.vocab_hash(),
                e,
                h,
            )?;
            Box::new(DsparkProposer::new(dr, &kind.label())?.with_target_head(target.model.clone()))
        }
        ProposerKind::DraftModel(name) => {
            let d = drafts.get(hub, name)?;
            Box::new(
                DraftModelProposer::new(
                    d.model.clone(),
                    &d.tok,
                    &target.tok,
                    target.model.cfg.vocab_size,
                    64 * 1024,
                    &kind.label(),
                )
                .map_err(spec_err)?,
            )
        }
    })
}

fn spec_err(e: SpecError) -> DrafterError {
    DrafterError::Invalid(e.to_string())
}

/// The engine configuration the CLI and the target worker share: KV sized for `max_running`
/// full contexts, a token budget that holds every request's verification window.
pub fn engine_config(
    model: &Model,
    gamma: usize,
    gate: bool,
    max_running: usize,
) -> specdec::EngineConfig {
    specdec::EngineConfig {
        gamma,
        gate,
        max_running,
        max_batch_tokens: 512.max(max_running * (gamma + 1)),
        kv_tokens: max_running * (model.cfg.max_ctx.min(8192) + gamma + 32),
        ..Default::default()
    }
}

/// An engine over `target` with `proposer` (γ forced to 0 without speculation).
pub fn engine(
    target: &Loaded,
    proposer: Box<dyn Proposer>,
    gamma: usize,
    gate: bool,
    max_running: usize,
) -> Result<specdec::Engine> {
    engine_sized(target, proposer, gamma, gate, max_running, None)
}

/// [`engine`] with a KV cache of `kv_tokens` when given: for callers that know how long their
/// requests get and keep several engines alive at once (the default holds `max_running` full
/// contexts, gigabytes on a model with a long context).
pub fn engine_sized(
    target: &Loaded,
    proposer: Box<dyn Proposer>,
    gamma: usize,
    gate: bool,
    max_running: usize,
    kv_tokens: Option<usize>,
) -> Result<specdec::Engine> {
    let gamma = if proposer.name() == "none" { 0 } else { gamma };
    let mut cfg = engine_config(&target.model, gamma, gate, max_running);
    if let Some(kv) = kv_tokens {
        cfg.kv_tokens = kv;
    }
    specdec::Engine::new(
        target.model.clone(),
        Some(target.tok.clone()),
        proposer,
        cfg,
    )
    .map_err(spec_err)
}

#[cfg(test)]
mod tests {
    /// The shipped drafter's path walks no `..`: the container image copies `drafters/` but
    /// not this crate's directory, and a path through an absent directory does not resolve.
    #[test]
    fn the_shipped_drafter_is_found_without_walking_through_this_crate() {
        let p = super::default_dspark_for("smollm2-135m").expect("shipped drafter");
        assert!(
            !p.components().any(|c| c == std::path::Component::ParentDir),
            "{}",
            p.display()
        );
        assert!(p.ends_with("drafters/smollm2-135m"), "{}", p.display());
        assert!(super::default_dspark_for("no-such-model").is_none());
    }
}
