//! `dspark profile`: the SPS(B) staircase of a model on this machine, as a versioned artifact.

use crate::config::Global;
use clap::Args;
use dspark_scheduler::admission::SpsTable;
use dspark_scheduler::sps::SpsArtifact;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Total batch tokens B.
    #[arg(long, value_delimiter = ',', default_values_t = target_worker::sps::DEFAULT_GRID.to_vec())]
    pub batch: Vec<usize>,
    /// Context lengths.
    #[arg(long, value_delimiter = ',', default_values_t = target_worker::sps::DEFAULT_CTXS.to_vec())]
    pub ctx: Vec<usize>,
    /// Passes over the whole grid; each point is its fastest pass (a busy spell of the machine
    /// lasting seconds lands on one pass of a point, not on all of them).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Also write the artifact here (it always goes to the cache the workers read).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Profile the model split over tensor-parallel ranks (`dspark tp-shard`) at these
    /// addresses, rank 1 first, as a target worker with the same `--tp-peers` runs it: the
    /// table the scheduler and the capacity planner need for that group. The ranks must not
    /// be serving a worker meanwhile: a rank serves one rank 0 at a time.
    #[arg(long, value_delimiter = ',')]
    pub tp_peers: Vec<String>,
}

pub fn run(g: &Global, a: ProfileArgs) -> anyhow::Result<()> {
    target_worker::sps::check_grid(&a.batch, &a.ctx).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(a.reps >= 1, "--reps takes a value ≥ 1");
    crate::config::check_outputs(&[a.json.as_deref()])?;
    let path = g.resolve_model(&a.model)?;
    let model = dspark_runtime::Model::load(
        &path,
        &dspark_runtime::LoadOptions {
            tp: (!a.tp_peers.is_empty())
                .then(|| dspark_runtime::tp::TpOptions::leader(a.tp_peers.clone())),
            ..g.load_opts()
        },
    )?;
    let key = target_worker::sps::key_for(&a.model, &path, &model, &a.batch, &a.ctx);
    let cmd = crate::config::command_line();
    let art = target_worker::sps::profile(&model, key.clone(), a.reps, &cmd)?;
    out!(
        "{:>6} {:>12}   (staircase: slowest shape and context per B, non-increasing)",
        "B",
        "steps/s"
    )?;
    for (b, s) in &art.table {
        out!("{b:>6} {s:>12.2}")?;
    }
    let cache = dspark_scheduler::sps::cache_path(&g.home, &key);
    art.save(&cache)?;
    eprintln!("cached {}", cache.display());
    if let Some(p) = &a.json {
        art.save(p)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// A table from an artifact file, whatever its key (benchmarks, tools).
pub fn load_table(p: &Path) -> anyhow::Result<SpsTable> {
    Ok(SpsArtifact::load(p, None)?.1)
}
