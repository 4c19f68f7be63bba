//! `dspark eval-drafter`: accepted length τ, per-position conditional acceptance, calibration
//! (ECE of the cumulative confidence against observed prefix survival, before and after STS) and
//! ROC-AUC of the confidence head, for the DSpark drafter, its parallel-only ablation, n-gram and
//! (where the target has one) the draft model, in one run on the same prompts.

use crate::config::Global;
use clap::Args;
use drafter::calibrate::{Observed, Score, roc_auc};
use drafter::calibrate::{Sts, cumulative_ece, cumulative_ece_floor, cumulative_means};
use drafter::calibrate::{cumulative_ece_by, cumulative_ece_floor_by, cumulative_means_by};
use drafter::{DsparkDrafter, DsparkProposer};
use specdec::{Event, Proposer, ProposerKind, Request};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub target: String,
    /// `dspark` (the shipped default for the target) or a checkpoint directory.
    #[arg(long, default_value = "dspark")]
    pub drafter: String,
    /// chat | code | math | all (each set reported on its own), or the larger held-out sets
    /// chat-heldout | code-heldout | math-heldout | all-heldout (`prompts/heldout/`).
    #[arg(long, default_value = "all")]
    pub prompts: String,
    #[arg(long, default_value_t = 7)]
    pub gamma: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = crate::config::non_negative_f32)]
    pub temperature: f32,
    /// Prompts skipped at the start of each set (the first half is calibration's held-out
    /// data by default, so evaluation uses the second half).
    #[arg(long, default_value_t = 16)]
    pub offset: usize,
    #[arg(long, default_value_t = 16, value_parser = crate::config::at_least_one)]
    pub limit: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Requests decoded together (acceptance does not depend on it).
    #[arg(long, default_value_t = 8, value_parser = crate::config::at_least_one)]
    pub batch: usize,
    /// Arms to run (comma list of dspark, dspark-nocopy, parallel, ngram, draft-model); default
    /// all that apply (dspark-nocopy: the shipped drafter without its copy prior).
    #[arg(long, value_delimiter = ',')]
    pub arms: Vec<String>,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also write every verified block (set, arm, static and served conditional confidences,
    /// accepted drafts, engine step, request), one JSON object a line, in the order requests
    /// finished: enough to replay the online recalibration offline.
    #[arg(long)]
    pub blocks: Option<PathBuf>,
    /// Evaluate on prompts the drafter was calibrated on (in-sample figures; refused
    /// otherwise).
    #[arg(long)]
    pub allow_calibration_prompts: bool,
}

/// What one drafter did on one prompt set.
pub struct ArmRun {
    pub totals: specdec::RequestMetrics,
    pub obs: Vec<Observed>,
    /// The request each of `obs` came from.
    pub requests: Vec<u64>,
}

/// Runs `proposer` at fixed γ (no gate, no policy) over rendered prompts at `temperature`.
pub fn run_arm(
    target: &crate::spec::Loaded,
    proposer: Box<dyn Proposer>,
    prompts: &[String],
    gamma: usize,
    temperature: f32,
    max_tokens: usize,
    batch: usize,
) -> anyhow::Result<ArmRun> {
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(&target.tok)?;
    let mut eng = crate::spec::engine(target, proposer, gamma, false, batch.max(1))?;
    for (i, p) in prompts.iter().enumerate() {
        let ids = target
            .tok
            .encode(&tmpl.render(&[dspark_runtime::chat::Message::new("user", p)], true)?)?;
        let mut r = Request::new(i as u64, ids, max_tokens);
        r.params.temperature = temperature;
        r.seed = 1000 + i as u64;
        eng.add(r)?;
    }
    let mut blocks = Vec::new();
    let mut requests = Vec::new();
    while !eng.is_idle() {
        for ev in eng.step()? {
            match ev {
                Event::Finished { id, metrics, .. } => {
                    requests.extend(std::iter::repeat_n(id, metrics.conf_blocks.len()));
                    blocks.extend(metrics.conf_blocks);
                }
                Event::Failed { id, error } => anyhow::bail!("request {id} failed: {error}"),
                Event::Tokens { .. } => {}
            }
        }
    }
    let obs = blocks
        .into_iter()
        .map(|b| {
            if b.inputs.len() == b.conf.len() {
                Observed {
                    inputs: b.inputs,
                    accepted: b.accepted,
                    accept_prob: b.accept_prob,
                    fixed: Vec::new(),
                    served: b.conf,
                    step: b.step,
                }
            } else {
                // Confidences without inputs (greedy copy runs, a drafter that reports
                // confidences only) are served as they are, whatever the calibration.
                Observed {
                    inputs: Vec::new(),
                    accepted: b.accepted,
                    accept_prob: b.accept_prob,
                    fixed: b.base,
                    served: b.conf,
                    step: b.step,
                }
            }
        })
        .collect();
    Ok(ArmRun {
        totals: eng.totals().clone(),
        obs,
        requests,
    })
}

/// ROC-AUC, for "accepted at k | reached k", of the probability each position had of being
/// accepted (1 − TV of the draft and target distributions): the ceiling of any confidence on
/// these blocks, since sampled acceptance is a coin flip with that probability. None when
/// the blocks do not carry it (greedy decoding, where acceptance is not random).
pub fn oracle_auc(obs: &[Observed]) -> Option<f64> {
    let (mut sc, mut lab) = (Vec::new(), Vec::new());
    for o in obs {
        if o.accept_prob.len() != o.len() {
            return None;
        }
        for (k, &p) in o.accept_prob.iter().enumerate() {
            if o.accepted >= k {
                sc.push(p as f64);
                lab.push(o.accepted > k);
            }
        }
    }
    (!sc.is_empty()).then(|| roc_auc(&sc, &lab))
}

/// ROC-AUC of the conditional confidence for "accepted at k | reached k".
pub fn conditional_auc(obs: &[Observed], sts: &Sts) -> f64 {
    conditional_auc_by(obs, Score::Sts(sts))
}

/// [`conditional_auc`] of the confidences `score` reads.
pub fn conditional_auc_by(obs: &[Observed], score: Score<'_>) -> f64 {
    let (mut sc, mut lab) = (Vec::new(), Vec::new());
    for o in obs {
        for k in 0..o.len() {
            if o.accepted >= k {
                sc.push(o.conf(k, score));
                lab.push(o.accepted > k);
            }
        }
    }
    roc_auc(&sc, &lab)
}

/// ECE before (identity STS) and after the static calibration `sts`, ROC-AUC, the ECE floor
/// and the mean predicted and observed survival, on the blocks whose confidences the network
/// computed. Copy-run blocks (greedy; `fixed` confidences, already calibrated and served as
/// they are) are left out: they would read the same before and after, and mix another
/// confidence into the network's. None where no network block was verified.
#[allow(clippy::type_complexity)]
fn static_calibration(
    obs: &[Observed],
    sts: &Sts,
    gamma: usize,
) -> (
    Option<Vec<f64>>,
    Option<Vec<f64>>,
    Option<f64>,
    Option<Vec<(f64, f64)>>,
    Option<Vec<(f64, f64)>>,
) {
    let net: Vec<Observed> = obs.iter().filter(|o| o.fixed.is_empty()).cloned().collect();
    if net.is_empty() {
        return (None, None, None, None, None);
    }
    let b = cumulative_ece(&net, &Sts::identity(gamma));
    // The parallel-only arm shares the checkpoint's temperatures (fitted for the Markov
    // drafter); its ECE after STS says how well they transfer.
    let af = cumulative_ece(&net, sts);
    let auc = conditional_auc(&net, sts);
    // What exactly calibrated confidences would read on these blocks.
    let floor = cumulative_ece_floor(&net, sts, 200);
    let means = cumulative_means(&net, sts);
    (Some(b), Some(af), Some(auc), Some(floor), Some(means))
}

/// Whether the engine decodes at `temperature` greedily ([`kernels::sampling::GREEDY_BELOW`]):
/// the calibration a run reads and fits is the one of the requests the engine serves.
pub(crate) fn is_greedy(temperature: f32) -> bool {
    kernels::sampling::SamplingParams {
        temperature,
        ..Default::default()
    }
    .is_greedy()
}

fn load_dspark(
    target: &crate::spec::Loaded,
    dir: &std::path::Path,
) -> anyhow::Result<DsparkDrafter> {
    let (e, h) = drafter::model::target_tensors(&target.model)?;
    Ok(DsparkDrafter::load(
        dir,
        &target.model.cfg,
        &target.tok.vocab_hash(),
        e,
        h,
    )?)
}

pub fn run(g: &Global, a: EvalArgs) -> anyhow::Result<()> {
    if a.gamma == 0 || a.gamma > specdec::MAX_GAMMA {
        anyhow::bail!("--gamma must be in 1..={}", specdec::MAX_GAMMA);
    }
    crate::config::check_outputs(&[a.json.as_deref(), a.blocks.as_deref()])?;
    let target = crate::spec::load_target(g, &a.target)?;
    let dir = match a.drafter.as_str() {
        "dspark" => drafter::build::default_dspark_for(&target.name).ok_or_else(|| {
            anyhow::anyhow!(
                "no shipped DSpark drafter for `{}`; pass --drafter DIR",
                target.name
            )
        })?,
        d => PathBuf::from(d.strip_prefix("dspark:").unwrap_or(d)),
    };
    let probe = load_dspark(&target, &dir)?;
    if a.gamma > probe.cfg.gamma {
        anyhow::bail!(
            "--gamma {} is larger than the drafter was trained for ({})",
            a.gamma,
            probe.cfg.gamma
        );
    }
    // Held-out figures (ECE after STS above all) mean nothing on the calibration's own
    // prompts: refused unless asked for.
    let calibrated: std::collections::HashSet<u64> =
        probe.cfg.calibration_prompts.iter().copied().collect();
    if !calibrated.is_empty() && !a.allow_calibration_prompts {
        for set in crate::bench::prompt_sets(&a.prompts) {
            let prompts = crate::bench::prompt_set(set)?;
            let shared: Vec<usize> = prompts
                .iter()
                .enumerate()
                .skip(a.offset)
                .take(a.limit)
                .filter(|(_, p)| calibrated.contains(&drafter::model::prompt_hash(p)))
                .map(|(i, _)| i)
                .collect();
            if let Some(first) = shared.first() {
                anyhow::bail!(
                    "{} of the `{set}` prompts evaluated ({}..{}) calibrated this drafter (the \
                     first: prompt {first}); evaluate on others (--offset, or the -heldout \
                     sets), or pass --allow-calibration-prompts for in-sample figures",
                    shared.len(),
                    a.offset,
                    a.offset + a.limit.min(prompts.len().saturating_sub(a.offset))
                );
            }
        }
    }
    let greedy = is_greedy(a.temperature);
    let sts = probe.cfg.calibration_for(greedy);
    let has_markov = probe.is_markov() && probe.cfg.parallel_trained;
    let has_copy = !probe.cfg.copy_bias_for(greedy).is_empty();
    drop(probe);
    let sets = crate::bench::prompt_sets(&a.prompts);
    let draft_model = crate::spec::default_draft_for(&target.name);
    let mut arms: Vec<&str> = vec!["dspark"];
    if has_copy {
        arms.push("dspark-nocopy");
    }
    if has_markov {
        arms.push("parallel");
    }
    arms.push("ngram");
    if draft_model.is_some() {
        arms.push("draft-model");
    }
    if !a.arms.is_empty() {
        for x in &a.arms {
            if !arms.contains(&x.as_str()) {
                anyhow::bail!(
                    "arm `{x}` does not apply here (available: {})",
                    arms.join(", ")
                );
            }
        }
        arms.retain(|x| a.arms.iter().any(|y| y == x));
    }
    let mut drafts = crate::spec::DraftCache::default();
    let mut results = Vec::new();
    let mut block_lines = String::new();
    out!(
        "{:<6} {:<12} {:>5} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6}  accept/pos",
        "set",
        "drafter",
        "gamma",
        "tau",
        "ece_bef",
        "ece_aft",
        "ece_onl",
        "floor_q95",
        "auc",
        "oracle"
    )?;
    for set in &sets {
        let mut prompts = crate::bench::prompt_set(set)?;
        prompts = prompts.into_iter().skip(a.offset).take(a.limit).collect();
        if prompts.is_empty() {
            anyhow::bail!("--offset {} leaves no `{set}` prompts", a.offset);
        }
        for arm in &arms {
            let proposer: Box<dyn Proposer> = match *arm {
                "dspark" | "dspark-nocopy" | "parallel" => {
                    // As served: calibrated, with the copy runs (the head's raw logit is
                    // among the recorded inputs, so the ECE before STS is computed below).
                    let mut dr = load_dspark(&target, &dir)?;
                    if *arm == "dspark-nocopy" {
                        dr.cfg = dr.cfg.without_copy();
                    }
                    if *arm == "parallel" {
                        dr = dr.into_parallel()?;
                    }
                    Box::new(DsparkProposer::new(dr, arm)?.with_target_head(target.model.clone()))
                }
                "ngram" => {
                    crate::spec::build_proposer(g, &ProposerKind::Ngram, &target, &mut drafts)?
                }
                _ => {
                    let name = draft_model.unwrap_or_default().to_string();
                    crate::spec::build_proposer(
                        g,
                        &ProposerKind::DraftModel(name),
                        &target,
                        &mut drafts,
                    )?
                }
            };
            let r = run_arm(
                &target,
                proposer,
                &prompts,
                a.gamma,
                a.temperature,
                a.max_tokens,
                a.batch,
            )?;
            if a.blocks.is_some() {
                let sts = sts.truncated(a.gamma);
                for (o, req) in r.obs.iter().zip(&r.requests) {
                    let c: Vec<f64> = (0..o.len()).map(|k| o.conf(k, Score::Sts(&sts))).collect();
                    block_lines.push_str(&serde_json::to_string(&BlockLine {
                        set: set.to_string(),
                        arm: arm.to_string(),
                        conf: c,
                        served: o.served.iter().map(|&x| x as f64).collect(),
                        copy_run: !o.fixed.is_empty(),
                        accepted: o.accepted,
                        step: o.step as u64,
                        request: *req,
                    })?);
                    block_lines.push('\n');
                }
            }
            let tau = r.totals.committed_per_call();
            let acc = r.totals.accept_per_pos();
            let survival = r.totals.survival_per_pos();
            let oracle = oracle_auc(&r.obs);
            let (eb, ea, auc, floor, means) =
                static_calibration(&r.obs, &sts.truncated(a.gamma), a.gamma);
            // What the engine served: the static calibration mapped online by the verdicts of
            // the blocks verified before (prequential; `specdec::recal`).
            let served = !r.obs.is_empty() && r.obs.iter().all(|o| o.served.len() == o.len());
            let (eo, auco, flo, meo) = if served {
                (
                    Some(cumulative_ece_by(&r.obs, Score::Served)),
                    Some(conditional_auc_by(&r.obs, Score::Served)),
                    Some(cumulative_ece_floor_by(&r.obs, Score::Served, 200)),
                    Some(cumulative_means_by(&r.obs, Score::Served)),
                )
            } else {
                (None, None, None, None)
            };
            let mx = |v: &Option<Vec<f64>>| {
                v.as_ref().map_or("-".to_string(), |v| {
                    format!("{:.3}", v.iter().cloned().fold(0.0, f64::max))
                })
            };
            // The calibrated floor's 95th percentile at the position of the worst ECE.
            let worst_floor = match (&ea, &floor) {
                (Some(e), Some(f)) => e
                    .iter()
                    .enumerate()
                    .max_by(|x, y| x.1.total_cmp(y.1))
                    .and_then(|(k, _)| f.get(k))
                    .map_or("-".to_string(), |x| format!("{:.3}", x.1)),
                _ => "-".to_string(),
            };
            out!(
                "{:<6} {:<12} {:>5} {:>6.2} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6}  {}",
                set,
                arm,
                a.gamma,
                tau,
                mx(&eb),
                mx(&ea),
                mx(&eo),
                worst_floor,
                auc.map_or("-".into(), |x| format!("{x:.3}")),
                oracle.map_or("-".into(), |x| format!("{x:.3}")),
                acc.iter()
                    .map(|x| format!("{x:.2}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )?;
            results.push(serde_json::json!({
                "drafter": arm, "prompts": set, "gamma": a.gamma, "temperature": a.temperature,
                "tau": tau, "accept_per_pos": acc, "survival_per_pos": survival,
                "ece_before": eb, "ece_after": ea, "auc": auc, "auc_oracle": oracle,
                "ece_floor": floor.as_ref().map(|f| f.iter().map(|x| x.0).collect::<Vec<_>>()),
                "ece_floor_q95": floor.as_ref().map(|f| f.iter().map(|x| x.1).collect::<Vec<_>>()),
                "survival_predicted": means.as_ref().map(|m| m.iter().map(|x| x.0).collect::<Vec<_>>()),
                "survival_observed": means.as_ref().map(|m| m.iter().map(|x| x.1).collect::<Vec<_>>()),
                "ece_online": eo, "auc_online": auco,
                "ece_floor_online": flo.as_ref().map(|f| f.iter().map(|x| x.0).collect::<Vec<_>>()),
                "ece_floor_q95_online": flo.as_ref().map(|f| f.iter().map(|x| x.1).collect::<Vec<_>>()),
                "survival_predicted_online": meo.as_ref().map(|m| m.iter().map(|x| x.0).collect::<Vec<_>>()),
                "copy_run_blocks": r.obs.iter().filter(|o| !o.fixed.is_empty()).count(),
                "network_blocks": r.obs.iter().filter(|o| o.fixed.is_empty()).count(),
                "blocks": r.obs.len(), "completion_tokens": r.totals.completion_tokens,
                "target_calls": r.totals.target_calls,
            }));
        }
    }
    if let Some(p) = &a.blocks {
        std::fs::write(p, &block_lines)?;
    }
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "target": target.name, "drafter_dir": dir.display().to_string(),
            "offset": a.offset, "limit": a.limit, "max_tokens": a.max_tokens,
            "results": results,
            "command": crate::config::command_line(),
        });
        crate::bench::write_json(&Some(p.clone()), &v)?;
    }
    Ok(())
}

/// `dspark recal-replay`: the engine's online recalibration replayed on the blocks an
/// `eval-drafter --blocks FILE` run wrote, for other half-lives. With a fixed γ and no
/// scheduler what that run drafted and verified does not depend on the served confidences, so
/// the settings compare side by side on the same blocks.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The blocks file of an `eval-drafter --blocks FILE` run.
    pub blocks: PathBuf,
    /// The run was greedy (`--temperature 0`): blocks map by the greedy kinds.
    #[arg(long)]
    pub greedy: bool,
    /// Half-lives to replay, in verified positions.
    #[arg(long, value_delimiter = ',', default_values_t = [1000.0, 4000.0])]
    pub half_life: Vec<f64>,
}

/// One line of `eval-drafter --blocks FILE`: a verified block, as `recal-replay` reads it back.
#[derive(serde::Serialize, serde::Deserialize)]
struct BlockLine {
    set: String,
    arm: String,
    /// The static calibration's confidences (what the engine's recalibration maps).
    conf: Vec<f64>,
    /// What the engine served.
    served: Vec<f64>,
    copy_run: bool,
    accepted: usize,
    step: u64,
    request: u64,
}

/// What a block line must hold for a replay to mean anything (as `plan` reads blocks): a
/// served confidence for each static one, every one a number in [0, 1], and no more drafts
/// accepted than were drafted.
fn check_block(b: &BlockLine) -> Result<(), String> {
    if b.conf.len() != b.served.len() {
        return Err(format!(
            "{} confidences but {} served ones",
            b.conf.len(),
            b.served.len()
        ));
    }
    if b.conf
        .iter()
        .chain(&b.served)
        .any(|c| !(c.is_finite() && (0.0..=1.0).contains(c)))
    {
        return Err("a confidence that is not a number in [0, 1]".into());
    }
    if b.accepted > b.conf.len() {
        return Err(format!(
            "{} drafts accepted of {} drafted",
            b.accepted,
            b.conf.len()
        ));
    }
    Ok(())
}

/// Cumulative ECE per position of `served` confidences against observed prefix survival.
fn replay_ece(blocks: &[&BlockLine], served: &[Vec<f64>]) -> Vec<f64> {
    let gamma = served.iter().map(Vec::len).max().unwrap_or(0);
    (0..gamma)
        .map(|k| {
            let (mut p, mut y) = (Vec::new(), Vec::new());
            for (b, s) in blocks.iter().zip(served) {
                if s.len() > k {
                    p.push(s[..=k].iter().product::<f64>());
                    y.push(b.accepted > k);
                }
            }
            drafter::calibrate::ece(&p, &y, drafter::calibrate::ECE_BINS)
        })
        .collect()
}

pub fn recal_replay(a: ReplayArgs) -> anyhow::Result<()> {
    use specdec::recal::{OnlineCalibration, RecalConfig};
    let text = std::fs::read_to_string(&a.blocks)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", a.blocks.display()))?;
    let mut lines = Vec::new();
    for (i, l) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let b: BlockLine = serde_json::from_str(l)
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", a.blocks.display(), i + 1))?;
        check_block(&b)
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", a.blocks.display(), i + 1))?;
        lines.push(b);
    }
    anyhow::ensure!(
        !lines.is_empty(),
        "{}: no blocks (is it an `eval-drafter --blocks` file?)",
        a.blocks.display()
    );
    // Each (set, arm) on its own: every arm ran its own engine (its steps count from 0) and
    // its own drafter, whose verdicts one calibration must not learn together.
    let mut sets: Vec<(&str, &str)> = Vec::new();
    for b in &lines {
        if !sets.contains(&(b.set.as_str(), b.arm.as_str())) {
            sets.push((&b.set, &b.arm));
        }
    }
    let pct = |v: &[f64]| {
        let worst = v.iter().cloned().fold(0.0, f64::max);
        let per: Vec<String> = v.iter().map(|x| format!("{:.2}", 100.0 * x)).collect();
        format!("worst {:.2} %, {}", 100.0 * worst, per.join(" "))
    };
    for (set, arm) in sets {
        // Blocks of one engine step are served before any of them is observed.
        let mut blocks: Vec<&BlockLine> = lines
            .iter()
            .filter(|b| b.set == set && b.arm == arm)
            .collect();
        blocks.sort_by_key(|b| b.step);
        let set = format!("{set} ({arm})");
        let engine: Vec<Vec<f64>> = blocks.iter().map(|b| b.served.clone()).collect();
        out!(
            "{set}: {} blocks; served by the engine: {}",
            blocks.len(),
            pct(&replay_ece(&blocks, &engine))
        )?;
        for &hl in &a.half_life {
            let cfg = RecalConfig::with_half_life(hl)?
                .ok_or_else(|| anyhow::anyhow!("a half-life of 0 turns the recalibration off"))?;
            let mut cal = OnlineCalibration::new(cfg);
            let mut served = Vec::with_capacity(blocks.len());
            let mut i = 0;
            while i < blocks.len() {
                let j = i + blocks[i..]
                    .iter()
                    .take_while(|b| b.step == blocks[i].step)
                    .count();
                for b in &blocks[i..j] {
                    let mut c: Vec<f32> = b.conf.iter().map(|&x| x as f32).collect();
                    cal.apply(a.greedy, !b.copy_run, &mut c);
                    served.push(c.iter().map(|&x| x as f64).collect::<Vec<f64>>());
                }
                for b in &blocks[i..j] {
                    let base: Vec<f32> = b.conf.iter().map(|&x| x as f32).collect();
                    cal.observe(a.greedy, !b.copy_run, &base, b.accepted);
                }
                i = j;
            }
            let mut err: Vec<f64> = blocks
                .iter()
                .zip(&served)
                .map(|(b, s)| {
                    b.served
                        .iter()
                        .zip(s)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0, f64::max)
                })
                .collect();
            err.sort_by(f64::total_cmp);
            out!(
                "  half-life {hl}: {}   (median |replay − served| {:.1e})",
                pct(&replay_ece(&blocks, &served)),
                err.get(err.len() / 2).copied().unwrap_or(0.0)
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod replay_tests {
    use super::*;

    fn args(path: &std::path::Path) -> ReplayArgs {
        ReplayArgs {
            blocks: path.to_path_buf(),
            greedy: false,
            half_life: vec![1000.0],
        }
    }

    #[test]
    fn replay_reads_blocks_and_refuses_bad_lines_and_settings() {
        let dir = std::env::temp_dir().join(format!("dspark-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jsonl");
        let line = |step: u64, acc: usize| {
            format!(
                r#"{{"set":"s","arm":"dspark","conf":[0.5,0.4],"served":[0.5,0.4],"copy_run":false,"accepted":{acc},"step":{step},"request":0}}"#
            )
        };
        let text: Vec<String> = (0..40).map(|i| line(i / 4, (i % 3) as usize)).collect();
        std::fs::write(&good, text.join("\n")).unwrap();
        assert!(recal_replay(args(&good)).is_ok());
        let mut off = args(&good);
        off.half_life = vec![0.0];
        assert!(
            recal_replay(off).is_err(),
            "a half-life of 0 replays nothing"
        );
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, format!("{}\n{{\"set\":\"s\"}}\n", line(0, 1))).unwrap();
        let e = recal_replay(args(&bad)).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        // Lines that parse but cannot be (a served confidence short, more accepted than
        // drafted, a confidence past 1), and a file of none: refused, naming what is wrong.
        let ok = line(0, 1);
        for (bad_line, want) in [
            (
                ok.replace(r#""served":[0.5,0.4]"#, r#""served":[0.5]"#),
                "served",
            ),
            (
                ok.replace(r#""accepted":1"#, r#""accepted":3"#),
                "3 drafts accepted",
            ),
            (
                ok.replace(r#""conf":[0.5,0.4]"#, r#""conf":[0.5,1.5]"#),
                "[0, 1]",
            ),
        ] {
            std::fs::write(&bad, format!("{ok}\n{bad_line}\n")).unwrap();
            let e = recal_replay(args(&bad)).unwrap_err().to_string();
            assert!(e.contains("line 2") && e.contains(want), "{e}");
        }
        std::fs::write(&bad, "\n").unwrap();
        let e = recal_replay(args(&bad)).unwrap_err().to_string();
        assert!(e.contains("no blocks"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_replayed_ece_reads_zero_where_confidences_match_survival() {
        // Two blocks at position 1: confidence 0.5, one accepted and one not.
        let b = |acc| BlockLine {
            set: "s".into(),
            arm: "dspark".into(),
            conf: vec![0.5],
            served: vec![0.5],
            copy_run: false,
            accepted: acc,
            step: 0,
            request: 0,
        };
        let (x, y) = (b(1), b(0));
        let e = replay_ece(&[&x, &y], &[vec![0.5], vec![0.5]]);
        assert!(e[0].abs() < 1e-12, "{e:?}");
        let e = replay_ece(&[&x, &y], &[vec![0.9], vec![0.9]]);
        assert!((e[0] - 0.4).abs() < 1e-9, "{e:?}");
    }
}

#[cfg(test)]
mod calibration_tests {
    use super::*;

    #[test]
    fn calibration_figures_leave_out_copy_run_blocks() {
        // Network blocks: head logits, 0 to 2 drafts accepted.
        let net: Vec<Observed> = (0..40)
            .map(|i| Observed::from_logits(&[(i % 5) as f32 - 2.0, (i % 3) as f32 - 1.0], i % 3))
            .collect();
        let sts = Sts::identity(2);
        let only = static_calibration(&net, &sts, 2);
        assert!(only.0.is_some() && only.2.is_some());
        // Greedy copy runs: fixed confidences of 0.99, every one rejected at once. They must
        // change none of the figures.
        let mut mixed = net.clone();
        mixed.extend((0..40).map(|_| Observed {
            fixed: vec![0.99, 0.99],
            accepted: 0,
            ..Default::default()
        }));
        let with = static_calibration(&mixed, &sts, 2);
        assert_eq!(only.0, with.0, "ece_before");
        assert_eq!(only.1, with.1, "ece_after");
        assert_eq!(only.2, with.2, "auc");
        assert_eq!(only.3, with.3, "ece floor");
        assert_eq!(only.4, with.4, "survival means");
        // Copy runs alone: no network confidence to report on.
        assert!(static_calibration(&mixed[40..], &sts, 2).0.is_none());
    }
}
