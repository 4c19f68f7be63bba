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
            // Refuses a drafter of another target, including one of the same architecture and
            // tokenizer at another depth or width (`DsparkDrafter::load` checks the shapes).
            let loaded =
                DsparkDrafter::load(&dir, &target.model.cfg, &target.tok.vocab_hash(), e, h);
            let dr = match loaded {
                Err(DrafterError::WrongTarget(m)) => {
                    return Err(DrafterError::WrongTarget(format!(
                        "{m} (target `{}`)",
                        target.name
                    )));
                }
                r => r?,
            };
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

    /// A drafter loads only against the target it was trained on: same architecture and
    /// tokenizer but another depth is refused with a message, not a shape error later.
    #[test]
    fn a_drafter_is_refused_by_a_target_of_another_shape() {
        use super::*;
        use dspark_runtime::tiny::{TinySpec, tiny_model_path};
        let load = |spec: &TinySpec, name: &str| {
            let p = tiny_model_path(spec, name).unwrap();
            let opts = LoadOptions {
                threads: 1,
                ..Default::default()
            };
            Loaded {
                name: name.into(),
                model: Arc::new(Model::load(&p, &opts).unwrap()),
                tok: Arc::new(Tokenizer::load(&p).unwrap()),
            }
        };
        let a = load(&TinySpec::llama(21), "drafter-target");
        let deeper = TinySpec {
            n_layers: TinySpec::llama(21).n_layers + 1,
            ..TinySpec::llama(21)
        };
        let b = load(&deeper, "drafter-target-deeper");
        assert_eq!(a.tok.vocab_hash(), b.tok.vocab_hash());
        let dr = crate::model::tests::tiny_drafter(&a.model, &a.tok, 6, 5);
        let dir = std::env::temp_dir().join(format!("dspark-build-shape-{}", std::process::id()));
        dr.save(&dir).unwrap();
        let hub = ModelHub {
            home: std::env::temp_dir(),
            python: "python3".into(),
            opts: LoadOptions::default(),
        };
        let kind = ProposerKind::Dspark(Some(dir.display().to_string()));
        let mut drafts = DraftCache::default();
        assert!(build_proposer(&hub, &kind, &a, &mut drafts).is_ok());
        let e = build_proposer(&hub, &kind, &b, &mut drafts)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("trained on a target of"), "{e}");
        // Every path loads through `DsparkDrafter::load` (eval-drafter, calibrate-drafter,
        // train-drafter --resume, drafter-vocab): the check is there, not only here.
        let wider = TinySpec {
            d_model: 2 * TinySpec::llama(21).d_model,
            ffn_dim: 2 * TinySpec::llama(21).ffn_dim,
            ..TinySpec::llama(21)
        };
        let c = load(&wider, "drafter-target-wider");
        assert_eq!(a.tok.vocab_hash(), c.tok.vocab_hash());
        let direct = |t: &Loaded| {
            let (e, h) = crate::model::target_tensors(&t.model).unwrap();
            DsparkDrafter::load(&dir, &t.model.cfg, &t.tok.vocab_hash(), e, h)
        };
        assert!(direct(&a).is_ok());
        for t in [&b, &c] {
            match direct(t) {
                Err(DrafterError::WrongTarget(m)) => {
                    assert!(m.contains("trained on a target of"), "{m}");
                    // Both shapes are named: the drafter's width and the target's.
                    assert!(m.contains(&format!("× {}", a.model.cfg.d_model)), "{m}");
                    assert!(m.contains(&format!("× {}", t.model.cfg.d_model)), "{m}");
                }
                Err(e) => panic!("{}: refused, but not as another target: {e}", t.name),
                Ok(_) => panic!("{}: a drafter of another shape loaded", t.name),
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
