//! `dspark train-drafter`: trains a DSpark drafter against a frozen target on CPU.

use crate::config::Global;
use clap::Args;
use drafter::model::{DrafterConfig, DsparkDrafter, target_tensors};
use drafter::train::{TRAINER_STATE_FILE, TrainConfig, TrainerState, train};
use dspark_runtime::{Model, Tokenizer};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Target model name or path.
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub target: String,
    /// Text files or directories (searched recursively for source and documentation files).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 2000, value_parser = crate::config::at_least_one)]
    pub steps: usize,
    #[arg(long, default_value_t = 7)]
    pub gamma: usize,
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Markov head rank (0 = parallel-only ablation).
    #[arg(long, default_value_t = 64)]
    pub rank: usize,
    /// Blocks per step.
    #[arg(long, default_value_t = 16, value_parser = crate::config::at_least_one)]
    pub batch: usize,
    /// Tokens per target forward.
    #[arg(long, default_value_t = 192)]
    pub chunk: usize,
    /// Peak learning rate (finite, > 0).
    #[arg(long, default_value_t = 2e-3, allow_negative_numbers = true, value_parser = crate::config::positive)]
    pub lr: f64,
    /// Stop reading training text after this many bytes.
    #[arg(long, default_value_t = 20_000_000)]
    pub max_bytes: usize,
    #[arg(long, default_value_t = 200, value_parser = crate::config::at_least_one)]
    pub save_every: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Steps drawn from each target forward over a chunk (fresh anchors each step).
    #[arg(long, default_value_t = 4)]
    pub reuse: usize,
    /// Teacher chunks each step draws its blocks from (one replaced every --reuse steps).
    #[arg(long, default_value_t = 8)]
    pub pool: usize,
    /// Weight of the distillation term H(p_t, p_d) added to the CE/TV/confidence objective
    /// (0 = the objective alone).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = crate::config::non_negative)]
    pub alpha_kl: f64,
    /// Weight of the auxiliary parallel-only loss (the ablation sharing the backbone); 0 = off.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true, value_parser = crate::config::non_negative)]
    pub parallel_weight: f64,
    /// Continue from the checkpoint in --out where it stopped: weights (f32), optimizer moments
    /// and data order come back as saved, so the run ends as the uninterrupted one would. (A
    /// checkpoint from before optimizer states were saved resumes at its step with fresh moments
    /// and data order, and its f16 weights.)
    #[arg(long)]
    pub resume: bool,
    /// Start from the checkpoint in --out with a fresh schedule (warm-up, cosine from step 0;
    /// use a lower --lr than the first run's): a second phase on new data or a new vocabulary.
    #[arg(long, conflicts_with = "resume")]
    pub fine_tune: bool,
    /// Train over a draft vocabulary: the N most frequent tokens of the training text (what
    /// `dspark drafter-vocab` keeps), the rows the served drafter's head reads. Each step then
    /// costs far less than over the whole vocabulary. 0 = the whole vocabulary. A resumed
    /// checkpoint keeps the vocabulary it has.
    #[arg(long, default_value_t = 8192)]
    pub draft_vocab: usize,
}

const EXTS: &[&str] = &[
    "rs", "py", "md", "txt", "c", "h", "cpp", "js", "ts", "go", "java", "toml", "json", "sh",
    "rst", "html",
];

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_file() {
        out.push(p.to_path_buf());
        return;
    }
    let Ok(rd) = std::fs::read_dir(p) else { return };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for e in entries {
        if e.is_dir() {
            collect_files(&e, out);
        } else if e
            .extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| EXTS.contains(&x))
        {
            out.push(e);
        }
    }
}

/// Reads training text (files in sorted order, up to `max_bytes`) and tokenizes it, with the
/// end-of-text token between files.
pub fn load_data(
    paths: &[PathBuf],
    tok: &Tokenizer,
    max_bytes: usize,
) -> anyhow::Result<(Vec<u32>, usize, usize)> {
    let mut files = Vec::new();
    for p in paths {
        if !p.exists() {
            anyhow::bail!("training data path {} does not exist", p.display());
        }
        collect_files(p, &mut files);
    }
    let sep = tok.stop_ids.first().copied().unwrap_or(0);
    let (mut ids, mut bytes, mut used) = (Vec::new(), 0usize, 0usize);
    for f in files {
        if bytes >= max_bytes {
            break;
        }
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        if text.len() < 64 {
            continue;
        }
        bytes += text.len();
        used += 1;
        ids.extend(tok.encode(&text)?);
        ids.push(sep);
    }
    Ok((ids, used, bytes))
}

/// Makes sure `--out` can hold a checkpoint before anything is loaded: a regular file there,
/// or a folder that cannot be created or written in, would otherwise fail only at the first
/// save, minutes into the run.
fn prepare_out_dir(out: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    if out.exists() && !out.is_dir() {
        anyhow::bail!(
            "--out {} is a file, not a directory: a drafter checkpoint is a directory \
             (drafter.json, drafter.safetensors, train_state.json); give another --out",
            out.display()
        );
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("--out {}: cannot create the directory", out.display()))?;
    let probe = out.join(format!(".dspark-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("--out {}: cannot write in the directory", out.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The flags that shape a training run's trajectory, by flag name, as `train_state.json`
/// records them (under `settings`) for `--resume` to compare. `--steps` is among them but may
/// change (see [`check_resume_settings`]); `--data` and `--max-bytes` are checked by the
/// trainer state's hash of the text; `--draft-vocab` does not apply to a resumed checkpoint.
fn run_settings(a: &TrainArgs) -> serde_json::Value {
    serde_json::json!({
        "steps": a.steps, "batch": a.batch, "chunk": a.chunk, "lr": a.lr, "seed": a.seed,
        "reuse": a.reuse, "pool": a.pool, "alpha-kl": a.alpha_kl,
        "parallel-weight": a.parallel_weight, "gamma": a.gamma, "layers": a.layers,
        "rank": a.rank,
    })
}

/// Compares the settings a resumed run was saved with (`saved`, the state's `settings`; None
/// for a state from before they were recorded) with this run's (`now`, from
/// [`run_settings`]). A flag that differs (other than `--steps`) is refused, each one named
/// with both values: the run would not end as the one it continues. Returns the warnings to
/// print: a changed `--steps` (the learning rate's decay is spread over the new count), or no
/// settings to compare.
fn check_resume_settings(
    saved: Option<&serde_json::Value>,
    now: &serde_json::Value,
    saved_command: Option<&str>,
) -> Result<Vec<String>, String> {
    let Some(saved) = saved.and_then(|v| v.as_object()) else {
        return Ok(vec![format!(
            "warning: train_state.json was saved before runs recorded their settings: the \
             flags are not compared with the run being resumed; give the ones it had{}",
            saved_command.map_or(String::new(), |c| format!(" ({c})"))
        )]);
    };
    // Through the same JSON text as the saved values, so a float compares bit for bit.
    let now: serde_json::Value =
        serde_json::from_str(&now.to_string()).map_err(|e| e.to_string())?;
    let (mut differ, mut warnings) = (Vec::new(), Vec::new());
    for (flag, v) in now.as_object().into_iter().flatten() {
        let Some(was) = saved.get(flag) else { continue };
        // The checkpoint's shape (γ, depth, rank) is loaded from it: those flags are unused.
        if was == v || matches!(flag.as_str(), "gamma" | "layers" | "rank") {
            continue;
        }
        if flag == "steps" {
            warnings.push(format!(
                "warning: --steps {v} differs from the resumed run's --steps {was}: the \
                 learning rate's decay after warm-up spans {v} steps instead of {was}, so past \
                 warm-up the run does not end as that one would have"
            ));
        } else {
            differ.push(format!("--{flag} {v} (the run being resumed had {was})"));
        }
    }
    if differ.is_empty() {
        Ok(warnings)
    } else {
        Err(format!(
            "--resume: {}: a resumed run keeps the settings of the run it continues, or it \
             would not end as that run would have; give the flags it had, or --fine-tune to \
             train its checkpoint further from step 0",
            differ.join(", ")
        ))
    }
}

pub fn run(g: &Global, a: TrainArgs) -> anyhow::Result<()> {
    if a.gamma == 0 || a.gamma > 32 {
        anyhow::bail!("--gamma must be in 1..=32");
    }
    // Everything about --out is checked before minutes of loading.
    prepare_out_dir(&a.out)?;
    let state = a.out.join("train_state.json");
    if a.fine_tune && !a.out.join("drafter.json").exists() {
        anyhow::bail!("--fine-tune needs a checkpoint in {}", a.out.display());
    }
    // A checkpoint without a training state (copied, or finished and trimmed) is not started
    // over silently: the first save would overwrite it.
    if a.resume && !state.exists() && a.out.join("drafter.json").exists() {
        anyhow::bail!(
            "--resume: {} holds a checkpoint but no train_state.json; --fine-tune trains it \
             further from step 0, or give another --out",
            a.out.display()
        );
    }
    let settings = run_settings(&a);
    let saved_state: Option<serde_json::Value> = if a.resume && state.exists() {
        let text = std::fs::read_to_string(&state)
            .map_err(|e| anyhow::anyhow!("{}: {e}", state.display()))?;
        let st: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", state.display()))?;
        let warnings = check_resume_settings(st.get("settings"), &settings, st["command"].as_str())
            .map_err(anyhow::Error::msg)?;
        for w in warnings {
            eprintln!("{w}");
        }
        Some(st)
    } else {
        None
    };
    let path = g.resolve_model(&a.target)?;
    let target = Model::load(&path, &g.load_opts())?;
    let tok = Tokenizer::load(&path)?;
    let (embed, head) = target_tensors(&target)?;
    let (data, files, bytes) = load_data(&a.data, &tok, a.max_bytes)?;
    eprintln!(
        "training text: {files} files, {:.1} MB, {} tokens",
        bytes as f64 / 1e6,
        data.len()
    );
    let loaded = a.fine_tune || saved_state.is_some();
    let (mut dr, resume) = if loaded {
        let resume = if a.fine_tune {
            eprintln!("fine-tuning the checkpoint in {}", a.out.display());
            None
        } else {
            let st = saved_state.unwrap_or_default();
            let step = st["step"].as_u64().unwrap_or(0) as usize;
            let ts = if a.out.join(TRAINER_STATE_FILE).exists() {
                let ts = TrainerState::load(&a.out)?;
                // Saved after the drafter and before train_state.json, so it is never behind:
                // one that is was left by another run (or a build that did not save it), and
                // its weights would roll the checkpoint back.
                if ts.step < step {
                    anyhow::bail!(
                        "{} is at step {}, behind the checkpoint's step {step}: it is another \
                         run's; remove it to resume from the checkpoint with fresh optimizer \
                         moments",
                        a.out.join(TRAINER_STATE_FILE).display(),
                        ts.step
                    );
                }
                // A save cut off between the two leaves the trainer state one checkpoint
                // ahead, whole (it carries its own weights): the run goes on from there.
                if ts.step != step {
                    eprintln!(
                        "train_state.json says step {step}, {TRAINER_STATE_FILE} step {}: \
                         resuming from {TRAINER_STATE_FILE}",
                        ts.step
                    );
                }
                ts
            } else {
                eprintln!(
                    "warning: {} has no {TRAINER_STATE_FILE} (saved before optimizer states \
                     were): the optimizer's moments and the data order start afresh at step \
                     {step}, from the checkpoint's f16 weights",
                    a.out.display()
                );
                TrainerState::fresh_at(step)
            };
            if ts.step >= a.steps {
                anyhow::bail!(
                    "the checkpoint in {} is at step {} already; give --steps above it to \
                     train on",
                    a.out.display(),
                    ts.step
                );
            }
            eprintln!("resuming from step {}", ts.step);
            Some(ts)
        };
        (
            DsparkDrafter::load(&a.out, &target.cfg, &tok.vocab_hash(), embed, head)?,
            resume,
        )
    } else {
        let cfg =
            DrafterConfig::for_target(&target.cfg, &tok.vocab_hash(), a.gamma, a.layers, a.rank);
        (DsparkDrafter::new(cfg, embed, head, a.seed)?, None)
    };
    if loaded {
        // The calibration was fitted to the features these weights made; training moves them.
        // Served as is, the confidences would read other features: dropped, to be fitted
        // again (`dspark calibrate-drafter`).
        eprintln!(
            "the checkpoint's confidence calibration is dropped: run calibrate-drafter after"
        );
        dr.cfg = dr.cfg.clone().uncalibrated();
    }
    dr.cfg.parallel_trained = dr.cfg.rank > 0 && a.parallel_weight > 0.0;
    // A resumed checkpoint keeps the vocabulary it has (a new one mid-schedule would change the
    // objective); a fine-tuning phase, which starts its schedule afresh, may take one.
    let resumed = loaded && !a.fine_tune;
    if !resumed && dr.draft_vocab.is_none() && a.draft_vocab > 0 && a.draft_vocab < dr.cfg.vocab {
        let keep = frequent_tokens(&data, dr.cfg.vocab, &tok.stop_ids, a.draft_vocab);
        let kept: std::collections::HashSet<u32> = keep.iter().copied().collect();
        let covered = data.iter().filter(|t| kept.contains(t)).count();
        eprintln!(
            "draft vocabulary: the {} most frequent tokens cover {:.2} % of the training text",
            keep.len(),
            100.0 * covered as f64 / data.len().max(1) as f64
        );
        dr.set_draft_vocab(Some(keep))?;
    }
    if let Some(ids) = &dr.draft_vocab {
        eprintln!("training over a draft vocabulary of {} tokens", ids.len());
    }
    eprintln!(
        "drafter: {:.2} M trainable parameters, γ = {}, rank {}",
        dr.num_params() as f64 / 1e6,
        dr.cfg.gamma,
        dr.cfg.rank
    );
    let tc = TrainConfig {
        steps: a.steps,
        batch: a.batch,
        chunk: a.chunk,
        lr: a.lr,
        seed: a.seed,
        reuse: a.reuse,
        pool: a.pool,
        parallel_weight: a.parallel_weight,
        alpha_kl: a.alpha_kl,
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let mut ema: Option<f64> = None;
    let out = a.out.clone();
    let cmd = crate::config::command_line();
    train(&target, &dr, &data, &tc, resume, &mut |s, snap| {
        let e = ema.map_or(s.loss, |e| 0.95 * e + 0.05 * s.loss);
        ema = Some(e);
        if s.step % 10 == 0 || s.step + 1 == tc.steps {
            eprintln!(
                "step {:>6}/{}  loss {:.4} (ema {:.4})  ce {:.3}  H(pt,pd) {:.3}  tv {:.3} (parallel {:.3})  conf {:.3}  lr {:.2e}  {:.0} blocks·pos/s  {:.0}s",
                s.step + 1,
                tc.steps,
                s.loss,
                e,
                s.ce,
                s.soft_ce,
                s.tv,
                s.tv_parallel,
                s.conf,
                s.lr,
                s.tok_s,
                t0.elapsed().as_secs_f64()
            );
        }
        if (s.step + 1) % a.save_every == 0 || s.step + 1 == tc.steps {
            // The drafter, then the trainer state (weights, moments, data order), then the step:
            // each renamed into place, so a save cut off anywhere leaves a state to resume.
            dr.save(&out)?;
            snap.save(&out)?;
            let st = serde_json::json!({"step": s.step + 1, "loss_ema": e, "command": cmd,
                "settings": settings});
            let tmp = out.join("train_state.json.tmp");
            std::fs::write(&tmp, st.to_string())?;
            std::fs::rename(&tmp, out.join("train_state.json"))?;
        }
        Ok(())
    })?;
    eprintln!("saved {}", a.out.display());
    Ok(())
}

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub target: String,
    /// Drafter checkpoint directory (its drafter.json gets the fitted temperatures).
    #[arg(long)]
    pub drafter: PathBuf,
    /// Held-out prompt set: chat | code | math | all, the calibration sets chat-calib |
    /// code-calib | math-calib | all-calib (`prompts/calib/`), or chat-heldout | code-heldout |
    /// math-heldout | all-heldout (`prompts/heldout/`, which evaluation uses: keep them apart).
    #[arg(long, default_value = "all")]
    pub prompts: String,
    /// Prompts of each set used for calibration: the first `limit` after `offset` (evaluation
    /// takes the second half by default, so the two never share prompts).
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    #[arg(long, default_value_t = 16, value_parser = crate::config::at_least_one)]
    pub limit: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Decoding temperature of the calibration run: 0 fits the calibration greedy requests
    /// use, anything else the one sampled requests use (the other is kept).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = crate::config::non_negative_f32)]
    pub temperature: f32,
    /// Calibrate the confidence head's logit alone (the paper's STS), without mixing in the
    /// draft distribution's top probability and entropy.
    #[arg(long)]
    pub head_only: bool,
    /// Leave this kind of request without a copy prior (otherwise a first run without it
    /// fits it, and the confidences are then calibrated on drafts made with it).
    #[arg(long)]
    pub no_copy: bool,
    /// Greedy: keep the trained confidence head rather than fit one on greedy acceptance
    /// (the ablation; see `GreedyHead`).
    #[arg(long)]
    pub no_greedy_head: bool,
    /// Bits of the serving forward's weights, 4 or 8, stored in the checkpoint before it is
    /// calibrated (confidences are fitted on the forward that will serve). Default: keep the
    /// checkpoint's (8 for a new one).
    #[arg(long)]
    pub serve_bits: Option<u8>,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn calibrate(g: &Global, a: CalibrateArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref()])?;
    if let Some(b) = a.serve_bits
        && !matches!(b, 4 | 8)
    {
        anyhow::bail!("--serve-bits {b}: the serving forward takes 4 or 8 bits");
    }
    let target = crate::spec::load_target(g, &a.target)?;
    let (e, h) = drafter::model::target_tensors(&target.model)?;
    let load_stored = || -> anyhow::Result<DsparkDrafter> {
        Ok(DsparkDrafter::load(
            &a.drafter,
            &target.model.cfg,
            &target.tok.vocab_hash(),
            e.clone(),
            h.clone(),
        )?)
    };
    let serve = |mut dr: DsparkDrafter| {
        if let Some(b) = a.serve_bits {
            dr.cfg.serve_bits = b;
        }
        dr
    };
    let load = || -> anyhow::Result<DsparkDrafter> { Ok(serve(load_stored()?)) };
    let stored = load_stored()?;
    let stored_bits = stored.cfg.serve_bits;
    let mut dr = serve(stored);
    let gamma = dr.cfg.gamma;
    let cfg_before = dr.cfg.clone();
    dr.cfg = dr.cfg.uncalibrated().without_copy();
    // The engine's threshold: a temperature it decodes greedily is calibrated as greedy.
    let greedy = crate::eval::is_greedy(a.temperature);
    let sets = crate::bench::prompt_sets(&a.prompts);
    let mut prompts = Vec::new();
    for set in sets {
        prompts.extend(
            crate::bench::prompt_set(set)?
                .into_iter()
                .skip(a.offset)
                .take(a.limit),
        );
    }
    let run_with = |proposer: Box<dyn specdec::Proposer>| {
        crate::eval::run_arm(
            &target,
            proposer,
            &prompts,
            gamma,
            a.temperature,
            a.max_tokens,
            8,
        )
    };
    // The copy prior first: drafts without it, and at every drafted position with a copy
    // candidate, what the target committed there.
    let (copy_bias, copy_fit) = if a.no_copy {
        (Vec::new(), Vec::new())
    } else {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut plain = load()?;
        plain.cfg = plain.cfg.uncalibrated().without_copy();
        run_with(Box::new(
            drafter::DsparkProposer::new(plain, "dspark")?
                .with_target_head(target.model.clone())
                .with_copy_log(log.clone()),
        ))?;
        let samples = log
            .lock()
            .map_err(|_| anyhow::anyhow!("copy log poisoned"))?
            .clone();
        let (bias, fits) =
            drafter::calibrate::fit_copy(&samples, drafter::proposer::COPY_MAX_MATCH, greedy, 100);
        out!(
            "copy prior ({} drafted positions with a candidate; {}):",
            samples.len(),
            if greedy {
                "objective: share of drafted tokens committed"
            } else {
                "objective: mean log-likelihood gain of the committed token over the drafter alone"
            }
        )?;
        for f in &fits {
            out!(
                "  match {}{}: {:>6} samples  candidate right {:.3}  drafter's top right {:.3}  bias {:.2}  objective {:.4} → {:.4}",
                f.len,
                if f.len == drafter::proposer::COPY_MAX_MATCH {
                    "+"
                } else {
                    " "
                },
                f.samples,
                f.precision,
                f.top_precision,
                f.bias,
                f.objective_before,
                f.objective_after
            )?;
        }
        (bias, fits)
    };
    // The prior of the kind of request calibrated (a greedy calibration that is there already
    // keeps its own, emptied above, and would hide one set on the sampled side).
    dr.cfg.set_copy_bias(greedy, copy_bias.clone());
    // Greedy copy runs: each match length's rate of a right candidate, where it was seen often
    // enough to trust (30 samples). They are on while the confidences are fitted, as they are
    // served: the blocks they draft leave the network's, and the repeats that make them
    // (long matches, near-certain continuations) are the easiest positions the network would
    // otherwise be fitted on. Fitted with them in, the input mix ranked the network's own
    // blocks worse (held-out greedy math, prompts 1–48: ROC-AUC of those blocks 0.725; a
    // logistic regression on the same inputs fitted on the blocks as served, 0.759).
    let copy_runs: Vec<f32> = if greedy {
        copy_fit
            .iter()
            .map(|f| {
                if f.samples >= 30 {
                    f.precision as f32
                } else {
                    0.0
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    if let Some(g) = dr.cfg.greedy_calibration.as_mut()
        && greedy
    {
        g.copy_runs = copy_runs.clone();
    }
    // Greedy: a confidence head fitted on greedy acceptance, from the blocks drafted as served;
    // then the input mix and STS are fitted on a run in which each fold of the prompts is
    // served by a head fitted on the other fold (fitted on the same requests, the head looked
    // better than on new prompts and the mix leaned on it: held-out ROC-AUC fell).
    let mut head_fit = serde_json::Value::Null;
    let mut greedy_head = None;
    let proposer = if greedy && !a.head_only && !a.no_greedy_head {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut logged = load()?;
        logged.cfg = dr.cfg.clone();
        run_with(Box::new(
            drafter::DsparkProposer::new(logged, "dspark")?
                .with_target_head(target.model.clone())
                .with_head_log(log.clone()),
        ))?;
        let samples = log
            .lock()
            .map_err(|_| anyhow::anyhow!("head log poisoned"))?
            .clone();
        let l2 = drafter::calibrate::GREEDY_HEAD_L2;
        let fit = |fold: Option<u8>| {
            let s: Vec<_> = samples
                .iter()
                .filter(|s| !s.copy_run && fold.is_none_or(|f| s.fold != f))
                .cloned()
                .collect();
            drafter::calibrate::fit_greedy_head(&s, gamma, l2)
        };
        let (all, f0, f1) = (fit(None)?, fit(Some(0))?, fit(Some(1))?);
        let samples: Vec<_> = samples.into_iter().filter(|s| !s.copy_run).collect();
        let folds = samples.iter().filter(|s| s.fold == 0).count();
        out!(
            "greedy head: {} drafted positions ({folds} in fold 0), {}",
            samples.len(),
            if all.is_some() && f0.is_some() && f1.is_some() {
                "fitted"
            } else {
                "too few to fit: the trained head serves"
            }
        )?;
        head_fit = serde_json::json!({"samples": samples.len(), "fold0": folds, "l2": l2});
        match (all, f0, f1) {
            (Some(all), Some(f0), Some(f1)) => {
                greedy_head = Some(all);
                drafter::DsparkProposer::new(dr, "dspark")?.with_fold_heads([f0, f1])
            }
            _ => drafter::DsparkProposer::new(dr, "dspark")?,
        }
    } else {
        drafter::DsparkProposer::new(dr, "dspark")?
    };
    // Greedy copy runs' confidences: a head over their inputs, fitted on the positions this
    // run's copy runs draft (the rates serve them meanwhile; the drafts do not depend on it).
    let run_log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let proposer = if greedy && !copy_runs.is_empty() {
        proposer.with_copy_run_log(run_log.clone())
    } else {
        proposer
    };
    let run = run_with(Box::new(proposer.with_target_head(target.model.clone())))?;
    let copied: Vec<_> = std::mem::take(
        &mut *run_log
            .lock()
            .map_err(|_| anyhow::anyhow!("copy-run log poisoned"))?,
    );
    let CopyHeadFit {
        head: copy_head,
        inputs: copy_head_inputs,
        report: copy_head_fit,
        line,
    } = fit_copy_head(&copied, gamma)?;
    if let Some(line) = line {
        out!("{line}")?;
    }
    let obs = run.obs;
    if obs.is_empty() {
        anyhow::bail!("no verified blocks with confidences were observed");
    }
    use drafter::calibrate::{Sts, cumulative_ece};
    let before = cumulative_ece(&obs, &Sts::identity(gamma));
    let sts = drafter::calibrate::fit_sts(&obs, gamma, !a.head_only);
    let after = cumulative_ece(&obs, &sts);
    let floor = drafter::calibrate::cumulative_ece_floor(&obs, &sts, 200);
    let auc = crate::eval::conditional_auc(&obs, &sts);
    // The paper's STS on the head's logit alone, for comparison.
    let head = drafter::calibrate::fit_sts(&obs, gamma, false);
    let auc_head = crate::eval::conditional_auc(&obs, &head);
    let ece_head = cumulative_ece(&obs, &head);
    let temps = sts.temps.clone();
    let tau = run.totals.committed_per_call();
    let oracle = crate::eval::oracle_auc(&obs);
    let copy_run_blocks = obs.iter().filter(|o| !o.fixed.is_empty()).count();
    // Fitted and read on the same blocks: optimistic; eval-drafter's held-out prompts tell.
    out!("in-sample (the blocks the fit was made on; `eval-drafter` measures held-out prompts):")?;
    out!(
        "blocks {} ({copy_run_blocks} copy runs, served at their rates)  τ {:.2}  ROC-AUC {:.3} (head logit alone {:.3}; of the true acceptance probabilities {})",
        obs.len(),
        tau,
        auc,
        auc_head,
        oracle.map_or("-".into(), |x| format!("{x:.3}"))
    )?;
    for k in 0..after.len() {
        let mix = sts.mix.get(k).map_or(String::new(), |w| {
            format!(
                "  mix z {:+.2} top-odds {:+.2} H {:+.2} running {:+.2} history {:+.2} copy {:+.2} bias {:+.2}",
                w[0], w[1], w[2], w[3], w[4], w[5], w[6]
            )
        });
        out!(
            "position {}: T {:.2}  shift {:+.1}  ECE before {:.3}  after {:.3} (calibrated would read {:.3}, 95 % ≤ {:.3}; head alone {:.3}){mix}",
            k + 1,
            temps[k],
            sts.shifts[k],
            before[k],
            after[k],
            floor.get(k).map_or(0.0, |f| f.0),
            floor.get(k).map_or(0.0, |f| f.1),
            ece_head[k]
        )?;
    }
    // Greedy requests get their own calibration; the other one is kept.
    let mut cfg = cfg_before;
    let mut cal = drafter::model::CalibrationCfg::from_sts(&sts);
    cal.copy_bias = copy_bias.clone();
    cal.copy_runs = copy_runs.clone();
    cal.head = greedy_head;
    cal.copy_head_inputs = copy_head_inputs;
    cal.copy_head = copy_head;
    cfg.set_calibration(greedy, cal);
    // What it was fitted on, so that evaluation keeps to other prompts.
    for p in &prompts {
        let h = drafter::model::prompt_hash(p);
        if !cfg.calibration_prompts.contains(&h) {
            cfg.calibration_prompts.push(h);
        }
    }
    // The other kind of request's calibration was fitted on the forward of the old width: it
    // would read confidences this forward does not make, under a file that names the new one.
    if cfg.serve_bits != stored_bits && cfg.drop_calibration(!greedy) {
        out!(
            "the calibration of {} requests was fitted on the {stored_bits}-bit forward and is \
             dropped: run calibrate-drafter --temperature {} to fit it for {} bits",
            if greedy { "sampled" } else { "greedy" },
            if greedy { "1" } else { "0" },
            cfg.serve_bits
        )?;
    }
    let tmp = a.drafter.join("drafter.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&cfg)?)?;
    std::fs::rename(&tmp, a.drafter.join("drafter.json"))?;
    let v = serde_json::json!({"in_sample": true, "blocks": obs.len(), "copy_run_blocks": copy_run_blocks, "tau": tau, "auc": auc, "auc_head_only": auc_head, "auc_oracle": oracle, "ece_after_head_only": ece_head, "ece_before": before, "ece_after": after,
        "ece_floor": floor.iter().map(|f| f.0).collect::<Vec<_>>(), "ece_floor_q95": floor.iter().map(|f| f.1).collect::<Vec<_>>(),
        "sts": temps, "sts_shift": sts.shifts, "conf_mix": sts.mix, "greedy": greedy, "copy_bias": copy_bias, "copy_fit": copy_fit, "copy_runs": copy_runs, "greedy_head": head_fit, "copy_head": copy_head_fit, "command": crate::config::command_line()});
    crate::bench::write_json(&a.json, &v)?;
    Ok(())
}

#[derive(Args, Debug)]
pub struct GenDataArgs {
    /// Target model name or path (its own answers become training text).
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub target: String,
    /// File with one user prompt per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Output text file: each conversation rendered with the chat template, answer included.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 192)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = crate::config::non_negative_f32)]
    pub temperature: f32,
    /// Requests decoded together.
    #[arg(long, default_value_t = 32, value_parser = crate::config::at_least_one)]
    pub batch: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The copy-run head fitted on a calibration run's copied positions, what `--json` reports of
/// the fit, and the line printed (None for both when no copy run was drafted).
struct CopyHeadFit {
    head: Option<drafter::model::GreedyHead>,
    /// The input set the head reads, stored beside it (None without a head).
    inputs: Option<String>,
    report: serde_json::Value,
    line: Option<String>,
}

/// Fits the copy-run head ([`drafter::model::CalibrationCfg::copy_head`]) on `copied` and
/// ranks the copied positions by the rates (input 1) and by the head, in sample.
fn fit_copy_head(
    copied: &[drafter::calibrate::HeadSample],
    gamma: usize,
) -> anyhow::Result<CopyHeadFit> {
    let head =
        drafter::calibrate::fit_greedy_head(copied, gamma, drafter::calibrate::GREEDY_HEAD_L2)?;
    let inputs = head
        .is_some()
        .then(|| drafter::proposer::COPY_HEAD_SPEC.to_string());
    if copied.is_empty() {
        return Ok(CopyHeadFit {
            head,
            inputs,
            report: serde_json::Value::Null,
            line: None,
        });
    }
    let hits: Vec<bool> = copied.iter().map(|s| s.hit).collect();
    let rates: Vec<f64> = copied
        .iter()
        .map(|s| s.x.first().copied().unwrap_or(0.0) as f64)
        .collect();
    let auc_rates = drafter::calibrate::roc_auc(&rates, &hits);
    let auc_head = head.as_ref().map(|h| {
        let z: Vec<f64> = copied
            .iter()
            .map(|s| h.logit(&s.x, None, s.k).unwrap_or(0.0) as f64)
            .collect();
        drafter::calibrate::roc_auc(&z, &hits)
    });
    let line = format!(
        "copy-run head: {} copied positions, ROC-AUC there {:.3} with the rates, {} with the head (in-sample){}",
        copied.len(),
        auc_rates,
        auc_head.map_or("-".into(), |a| format!("{a:.3}")),
        if head.is_some() {
            ""
        } else {
            "; too few to fit: the rates serve"
        }
    );
    let report = serde_json::json!({"samples": copied.len(), "auc_rates": auc_rates, "auc_head_in_sample": auc_head, "head": head});
    Ok(CopyHeadFit {
        head,
        inputs,
        report,
        line: Some(line),
    })
}

/// `dspark gen-data`: the target answers a prompt file (plain decoding, sampled), and the
/// rendered conversations become drafter training text that matches what the drafter will see
/// when serving chat requests.
pub fn gen_data(g: &Global, a: GenDataArgs) -> anyhow::Result<()> {
    use specdec::{Event, Request};
    use std::io::Write;
    let target = crate::spec::load_target(g, &a.target)?;
    let text = std::fs::read_to_string(&a.prompts)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.prompts.display()))?;
    let prompts: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if prompts.is_empty() {
        anyhow::bail!("{} holds no prompts", a.prompts.display());
    }
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(&target.tok)?;
    let mut rendered = Vec::with_capacity(prompts.len());
    let mut ids = Vec::with_capacity(prompts.len());
    for p in &prompts {
        let r = tmpl.render(&[dspark_runtime::chat::Message::new("user", p)], true)?;
        ids.push(target.tok.encode(&r)?);
        rendered.push(r);
    }
    // The KV cache holds `--batch` of the longest conversation, not `--batch` whole contexts.
    let longest = ids.iter().map(|p| p.len()).max().unwrap_or(0) + a.max_tokens;
    let mut eng = crate::spec::engine_for_workload(
        &target,
        Box::new(specdec::proposer::NoProposer),
        1,
        false,
        a.batch.max(1),
        longest,
    )?;
    for (i, p) in ids.into_iter().enumerate() {
        let mut req = Request::new(i as u64, p, a.max_tokens);
        req.params.temperature = a.temperature;
        req.seed = a.seed.wrapping_add(i as u64);
        eng.add(req)?;
    }
    let mut answers = vec![String::new(); prompts.len()];
    let (t0, mut tokens, mut done) = (std::time::Instant::now(), 0usize, 0usize);
    let mut out = std::io::BufWriter::new(std::fs::File::create(&a.out)?);
    while !eng.is_idle() {
        for ev in eng.step()? {
            match ev {
                Event::Tokens {
                    id,
                    tokens: t,
                    text,
                    ..
                } => {
                    tokens += t.len();
                    if let Some(s) = answers.get_mut(id as usize) {
                        s.push_str(&text);
                    }
                }
                Event::Failed { id, error } => anyhow::bail!("request {id} failed: {error}"),
                Event::Finished { id, .. } => {
                    let i = id as usize;
                    writeln!(out, "{}{}\n", rendered[i], answers[i])?;
                    done += 1;
                    if done % 32 == 0 {
                        eprintln!(
                            "{done}/{} conversations, {tokens} tokens, {:.0} tok/s",
                            prompts.len(),
                            tokens as f64 / t0.elapsed().as_secs_f64()
                        );
                    }
                }
            }
        }
    }
    out.flush()?;
    eprintln!(
        "wrote {} conversations ({tokens} answer tokens) to {} in {:.0}s",
        prompts.len(),
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct VocabArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub target: String,
    /// Drafter checkpoint directory (gets `draft_vocab.json` and `draft_vocab` in drafter.json).
    #[arg(long)]
    pub drafter: PathBuf,
    /// Text to count tokens in: files or directories (the training-data recipe's paths).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Tokens kept (the most frequent; the stop tokens always). 0 drops the draft vocabulary.
    #[arg(long, default_value_t = 8192)]
    pub size: usize,
    /// Stop reading text after this many bytes.
    #[arg(long, default_value_t = 8_000_000)]
    pub max_bytes: usize,
}

/// The `size` most frequent tokens of `ids` (ties by id, so stable across runs), the stop
/// tokens always among them.
pub fn frequent_tokens(ids: &[u32], vocab: usize, stop_ids: &[u32], size: usize) -> Vec<u32> {
    let mut count = vec![0u64; vocab];
    for &t in ids {
        if let Some(c) = count.get_mut(t as usize) {
            *c += 1;
        }
    }
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    order.sort_by(|&x, &y| count[y as usize].cmp(&count[x as usize]).then(x.cmp(&y)));
    let mut keep: Vec<u32> = stop_ids
        .iter()
        .copied()
        .filter(|&t| (t as usize) < vocab)
        .collect();
    keep.sort_unstable();
    keep.dedup();
    for t in order {
        if keep.len() >= size {
            break;
        }
        if !keep.contains(&t) {
            keep.push(t);
        }
    }
    keep
}

/// `dspark drafter-vocab`: the draft vocabulary (FR-Spec's frequency-ranked subset) — the
/// `size` most frequent target tokens in the given text. The drafter's head then reads
/// size/vocab of the target's head per drafted position; tokens outside it are never drafted
/// (verification still commits them), so coverage of the text decides what it costs.
pub fn drafter_vocab(g: &Global, a: VocabArgs) -> anyhow::Result<()> {
    let path = g.resolve_model(&a.target)?;
    let tok = Tokenizer::load(&path)?;
    let target = Model::load(&path, &g.load_opts())?;
    let (e, h) = drafter::model::target_tensors(&target)?;
    let mut dr = DsparkDrafter::load(&a.drafter, &target.cfg, &tok.vocab_hash(), e, h)?;
    let vocab = target.cfg.vocab_size;
    if a.size == 0 {
        dr.set_draft_vocab(None)?;
    } else {
        if a.size > vocab {
            anyhow::bail!("--size {} is larger than the vocabulary ({vocab})", a.size);
        }
        let (ids, files, bytes) = load_data(&a.data, &tok, a.max_bytes)?;
        if ids.is_empty() {
            anyhow::bail!("no text found under the --data paths");
        }
        let keep = frequent_tokens(&ids, vocab, &tok.stop_ids, a.size);
        let kept: std::collections::HashSet<u32> = keep.iter().copied().collect();
        let covered = ids.iter().filter(|t| kept.contains(t)).count();
        out!(
            "{} tokens of text ({} files, {:.1} MB): the {} most frequent of {vocab} cover {:.2} %",
            ids.len(),
            files,
            bytes as f64 / 1e6,
            keep.len(),
            100.0 * covered as f64 / ids.len() as f64
        )?;
        dr.set_draft_vocab(Some(keep))?;
    }
    // Only the config and the vocabulary change; the weights stay as they are on disk.
    if let Some(ids) = &dr.draft_vocab {
        drafter::model::write_draft_vocab(&a.drafter, ids)?;
    }
    let tmp = a.drafter.join("drafter.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&dr.cfg)?)?;
    std::fs::rename(&tmp, a.drafter.join("drafter.json"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use drafter::calibrate::HeadSample;

    fn train_args(extra: &[&str]) -> TrainArgs {
        let base = ["dspark", "train-drafter", "--data", "d.txt", "--out", "o"];
        match crate::parse_from(base.iter().chain(extra))
            .expect("parsed")
            .cmd
        {
            crate::Command::TrainDrafter(a) => a,
            other => panic!("{other:?}"),
        }
    }

    /// `--out` at a regular file is refused before anything loads; a new folder is created.
    #[test]
    fn the_checkpoint_folder_is_checked_first() {
        let dir = std::env::temp_dir().join(format!("dspark-train-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, "x").unwrap();
        let e = prepare_out_dir(&file).unwrap_err().to_string();
        assert!(e.contains("is a file, not a directory"), "{e}");
        let e = format!("{:#}", prepare_out_dir(&file.join("under")).unwrap_err());
        assert!(e.contains("cannot create"), "{e}");
        let nested = dir.join("a/b");
        prepare_out_dir(&nested).unwrap();
        assert!(nested.is_dir());
        assert_eq!(
            std::fs::read_dir(&nested).unwrap().count(),
            0,
            "probe left behind"
        );
        prepare_out_dir(&nested).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `--resume` compares the flags that shape the run with those saved: a difference is
    /// refused naming the flag and both values; a longer `--steps` goes on with a warning; a
    /// state from before settings were saved resumes with a warning.
    #[test]
    fn a_resumed_run_keeps_the_settings_it_was_started_with() {
        let first = train_args(&["--lr", "0.0017", "--batch", "4", "--alpha-kl", "0.3"]);
        // Saved, as the state file holds it (JSON text).
        let saved: serde_json::Value =
            serde_json::from_str(&run_settings(&first).to_string()).unwrap();
        // The run's own settings, with `more` flags after them.
        let with = |more: &[&str]| {
            let mut args = vec!["--lr", "0.0017", "--batch", "4", "--alpha-kl", "0.3"];
            args.extend_from_slice(more);
            train_args(&args)
        };
        let same = with(&[]);
        assert_eq!(
            check_resume_settings(Some(&saved), &run_settings(&same), None),
            Ok(vec![])
        );
        let longer = with(&["--steps", "5000"]);
        let w = check_resume_settings(Some(&saved), &run_settings(&longer), None).unwrap();
        assert!(w.len() == 1 && w[0].contains("--steps 5000"), "{w:?}");
        let other = train_args(&["--lr", "0.002", "--batch", "8", "--alpha-kl", "0.3"]);
        let e = check_resume_settings(Some(&saved), &run_settings(&other), None).unwrap_err();
        assert!(
            e.contains("--lr 0.002 (the run being resumed had 0.0017)")
                && e.contains("--batch 8 (the run being resumed had 4)")
                && !e.contains("--alpha-kl"),
            "{e}"
        );
        for (flag, value) in [
            ("--chunk", "100"),
            ("--pool", "2"),
            ("--reuse", "1"),
            ("--parallel-weight", "0.25"),
            ("--seed", "9"),
        ] {
            let e = check_resume_settings(Some(&saved), &run_settings(&with(&[flag, value])), None)
                .unwrap_err();
            assert!(e.contains(&format!("{flag} {value} (")), "{e}");
        }
        // The checkpoint's shape comes from the checkpoint: other flags for it are not refused.
        let shaped = with(&["--gamma", "4", "--layers", "2", "--rank", "32"]);
        assert!(check_resume_settings(Some(&saved), &run_settings(&shaped), None).is_ok());
        let w = check_resume_settings(None, &run_settings(&other), Some("dspark train-drafter"))
            .unwrap();
        assert!(
            w.len() == 1 && w[0].contains("not compared") && w[0].contains("dspark train-drafter"),
            "{w:?}"
        );
    }

    /// Copied positions whose outcome follows inputs 2 and 3 (the match followed back) and
    /// not the rate: the head ranks them far better than the rates, and is reported as fitted
    /// and tagged with its input set; too few positions, or none, leave the rates serving.
    #[test]
    fn the_copy_run_head_is_fitted_where_its_inputs_predict_acceptance() {
        let mut rng = kernels::rng::Rng::new(7);
        let samples: Vec<HeadSample> = (0..600)
            .map(|i| {
                let long = (i % 10) as f32 * 0.4;
                let p = 1.0 / (1.0 + (-(2.0 * long - 4.0)).exp());
                HeadSample {
                    fold: (i % 2) as u8,
                    k: i % 3,
                    hit: rng.uniform() < p as f64,
                    x: vec![0.8, long, long, rng.normal() as f32, rng.normal() as f32],
                    copy_run: true,
                }
            })
            .collect();
        let fit = fit_copy_head(&samples, 7).expect("fit");
        let head = fit.head.expect("a head");
        assert_eq!(
            (head.w.len(), head.bias.len()),
            (drafter::proposer::COPY_HEAD_INPUTS, 7)
        );
        let (rates, headed) = (
            fit.report["auc_rates"].as_f64().unwrap_or(1.0),
            fit.report["auc_head_in_sample"].as_f64().unwrap_or(0.0),
        );
        assert!(rates == 0.5 && headed > 0.8, "{}", fit.report);
        assert_eq!(fit.report["samples"], 600);
        assert_eq!(
            fit.inputs.as_deref(),
            Some(drafter::proposer::COPY_HEAD_SPEC)
        );
        assert!(fit.line.is_some_and(|l| !l.contains("too few")));
        let few = fit_copy_head(&samples[..100], 7).expect("fit");
        assert!(few.head.is_none() && few.inputs.is_none() && few.report["head"].is_null());
        assert!(few.line.is_some_and(|l| l.contains("too few")));
        let none = fit_copy_head(&[], 7).expect("fit");
        assert!(none.head.is_none() && none.report.is_null() && none.line.is_none());
    }
}
