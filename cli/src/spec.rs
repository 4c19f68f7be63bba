//! Building the speculative engine from command-line choices (`--drafter`, `--gamma`).

use crate::config::Global;
use dspark_runtime::{Model, Tokenizer};
use specdec::proposer::{DraftModelProposer, NgramProposer, NoProposer};
use specdec::{Engine, EngineConfig, Proposer, ProposerKind};
use std::sync::Arc;

/// The draft model paired with a target by default (`--drafter draft-model`).
pub fn default_draft_for(target: &str) -> Option<&'static str> {
    match target {
        "qwen2.5-coder-1.5b" => Some("qwen2.5-coder-0.5b"),
        _ => None,
    }
}

pub struct Loaded {
    pub name: String,
    pub model: Arc<Model>,
    pub tok: Arc<Tokenizer>,
}

/// The shipped DSpark drafter of a target, if the repository has one.
pub fn default_dspark_for(target: &str) -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../drafters")
        .join(target);
    p.join("drafter.json").exists().then_some(p)
}

pub fn load_target(g: &Global, name: &str) -> anyhow::Result<Loaded> {
    let path = g.resolve_model(name)?;
    Ok(Loaded {
        name: name.to_string(),
        model: Arc::new(Model::load(&path, &g.load_opts())?),
        tok: Arc::new(Tokenizer::load(&path)?),
    })
}

/// Builds a proposer; a draft model is loaded once per call (cache it across arms with `DraftCache`).
pub fn build_proposer(
    g: &Global,
    kind: &ProposerKind,
    target: &Loaded,
    drafts: &mut DraftCache,
) -> anyhow::Result<Box<dyn Proposer>> {
    Ok(match kind {
        ProposerKind::None => Box::new(NoProposer),
        ProposerKind::Ngram => Box::new(NgramProposer::default()),
        ProposerKind::Dspark(dir) => {
            let dir = match dir {
                Some(d) => std::path::PathBuf::from(d),
                None => default_dspark_for(&target.name).ok_or_else(|| {
                    anyhow::anyhow!(
                        "no shipped DSpark drafter for `{}` yet; train one with `dspark train-drafter` and pass --drafter dspark:DIR",
                        target.name
                    )
                })?,
            };
            let (e, h) = drafter::model::target_tensors(&target.model)?;
            let dr = drafter::DsparkDrafter::load(
                &dir,
                target.model.cfg.arch.name(),
                &target.tok.vocab_hash(),
                e,
                h,
            )?;
            Box::new(drafter::DsparkProposer::new(dr, &kind.label()))
        }
        ProposerKind::DraftModel(name) => {
            let d = drafts.get(g, name)?;
            Box::new(DraftModelProposer::new(
                d.model.clone(),
                &d.tok,
                &target.tok,
                target.model.cfg.vocab_size,
                64 * 1024,
                &kind.label(),
            )?)
        }
    })
}

/// Draft models loaded so far (bench arms reuse them).
#[derive(Default)]
pub struct DraftCache {
    loaded: Vec<(String, Loaded)>,
}

impl DraftCache {
    fn get(&mut self, g: &Global, name: &str) -> anyhow::Result<&Loaded> {
        if let Some(i) = self.loaded.iter().position(|(n, _)| n == name) {
            return Ok(&self.loaded[i].1);
        }
        let l = load_target(g, name)?;
        self.loaded.push((name.to_string(), l));
        Ok(&self.loaded.last().expect("just pushed").1)
    }
}

pub fn engine(
    target: &Loaded,
    proposer: Box<dyn Proposer>,
    gamma: usize,
    gate: bool,
    max_running: usize,
) -> anyhow::Result<Engine> {
    let gamma = if proposer.name() == "none" { 0 } else { gamma };
    let cfg = EngineConfig {
        gamma,
        gate,
        max_running,
        max_batch_tokens: 512.max(max_running * (gamma + 1)),
        kv_tokens: max_running * (target.model.cfg.max_ctx.min(8192) + gamma + 32),
        ..Default::default()
    };
    Ok(Engine::new(
        target.model.clone(),
        Some(target.tok.clone()),
        proposer,
        cfg,
    )?)
}
