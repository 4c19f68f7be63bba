//! `dspark plan`: the capacity planner's command line (the simulation itself is
//! `dspark_scheduler::planner`, pure and unit-tested). Inputs are measurements this repository's
//! own tools write: an SPS(B) profile (`dspark profile --json`), drafting cost
//! (`dspark bench draft --json`) and recorded verifications (`dspark eval-drafter --blocks`).

use clap::Args;
use dspark_scheduler::admission::SpsTable;
use dspark_scheduler::planner::{
    self, Block, BlockSet, DraftCost, EngineSpec, Load, Scenario, SimTime, Slo, Verify, Workload,
};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// SPS(B) profile: a `dspark profile --json` artifact (or a `bench frontier` JSON, whose
    /// `sps_table` it planned on).
    #[arg(long)]
    pub sps: PathBuf,
    /// Use the profile's decode points measured at this context length instead of its table
    /// (the slowest context at each B).
    #[arg(long)]
    pub ctx: Option<u32>,
    /// Recorded verifications: an `eval-drafter --blocks FILE` run of the drafter to plan for.
    #[arg(long)]
    pub blocks: PathBuf,
    /// Only the blocks of this prompt set (the `set` field, e.g. code).
    #[arg(long, conflicts_with = "mix")]
    pub set: Option<String>,
    /// The traffic mix: kinds of prompts (the blocks' `set` names) and their shares of
    /// requests, e.g. `chat=2,code=1` (default: every block of the file, as recorded).
    #[arg(long, value_delimiter = ',')]
    pub mix: Vec<String>,
    /// The drafter the blocks are of (their `arm` field): an `eval-drafter` run records
    /// several side by side, and only the one deployed is planned for.
    #[arg(long, default_value = "dspark")]
    pub arm: String,
    /// Drafting cost: a `bench draft --json` file (draft_ms by batch and γ).
    #[arg(long)]
    pub draft_cost: PathBuf,
    /// Cluster arrival rate (requests/s, Poisson). Or --concurrency.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Requests in flight, each replaced when it finishes (closed loop).
    #[arg(long)]
    pub concurrency: Option<u32>,
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: u32,
    #[arg(long, default_value_t = 128)]
    pub output_tokens: u32,
    /// Each answer is --output-tokens × a factor uniform in [1 − s, 1 + s].
    #[arg(long, default_value_t = 0.5)]
    pub output_spread: f64,
    /// Requests one target worker decodes at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: u32,
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: u32,
    /// Longest block verified (the drafter's γ).
    #[arg(long, default_value_t = 7)]
    pub max_gamma: u8,
    /// How target workers pick verification lengths: `scheduler` (the hardware-aware policy,
    /// `verifyPolicy: scheduler` in the chart) or `fixed-K` (every drafting request verifies K; simulated for comparison, no chart values).
    #[arg(long, default_value = "scheduler")]
    pub verify: String,
    /// Round trip of a drafting round between pods (ms).
    #[arg(long, default_value_t = 1.0)]
    pub hop_ms: f64,
    /// SLO: median decode rate per user (tokens/s) at least.
    #[arg(long, default_value_t = 10.0)]
    pub slo_user_tok_s: f64,
    /// SLO: 90th-percentile time to first token (ms) at most.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    #[arg(long, default_value_t = 8)]
    pub max_targets: u32,
    #[arg(long, default_value_t = 4)]
    pub max_drafts: u32,
    /// Price of one target worker and of one draft worker (any unit: $/h, devices).
    #[arg(long, default_value_t = 1.0)]
    pub target_price: f64,
    #[arg(long, default_value_t = 0.25)]
    pub draft_price: f64,
    /// Simulated seconds measured per shape (after --warmup); under --rate, long enough for
    /// each target worker to see 2000 arrivals, whatever this says (at most an hour). At most
    /// 3600: a closed loop (--concurrency) simulates exactly this long.
    #[arg(long, default_value_t = 60.0, allow_negative_numbers = true, value_parser = crate::config::sim_seconds)]
    pub seconds: f64,
    /// Simulated seconds run before each shape is measured (at most 3600).
    #[arg(long, default_value_t = 10.0, allow_negative_numbers = true, value_parser = crate::config::sim_warmup)]
    pub warmup: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Instead of planning: replay a `bench frontier` JSON's arms and concurrencies (one
    /// engine, in-process drafting) and report predicted against measured tokens/s.
    #[arg(long)]
    pub validate: Option<PathBuf>,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Throughput–interactivity frontier per draft:target ratio (SVG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

fn read_json(p: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", p.display()))
}

fn pairs(v: &Value) -> Option<Vec<(u32, f64)>> {
    v.as_array()?
        .iter()
        .map(|p| Some((p.get(0)?.as_u64()? as u32, p.get(1)?.as_f64()?)))
        .collect()
}

/// The SPS table from a profile artifact (`table`, or the decode points at `ctx`) or a frontier
/// JSON (`sps_table`).
pub fn load_sps(path: &Path, ctx: Option<u32>) -> anyhow::Result<SpsTable> {
    let v = read_json(path)?;
    // A profile artifact of another version measured another way (version 1's tables were
    // skewed): refused here as the target worker refuses it.
    if v.get("key").is_some() {
        let want = dspark_scheduler::sps::ARTIFACT_VERSION;
        anyhow::ensure!(
            v["version"].as_u64() == Some(want as u64),
            "{}: profile version {} (this build reads {want}); profile again",
            path.display(),
            v["version"]
        );
    }
    let pts = match ctx {
        Some(c) => {
            let mut pts: Vec<(u32, f64)> = v["points"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["kind"] == "decode" && p["ctx"].as_u64() == Some(c as u64))
                .filter_map(|p| {
                    Some((
                        p["batch_tokens"].as_u64()? as u32,
                        p["steps_per_s"].as_f64()?,
                    ))
                })
                .collect();
            anyhow::ensure!(
                !pts.is_empty(),
                "{}: no decode points at ctx {c}",
                path.display()
            );
            pts.sort_by_key(|p| p.0);
            // A staircase: a bigger batch is never faster than a smaller one.
            for i in 1..pts.len() {
                pts[i].1 = pts[i].1.min(pts[i - 1].1);
            }
            pts
        }
        None => pairs(&v["table"])
            .or_else(|| pairs(&v["sps_table"]))
            .ok_or_else(|| anyhow::anyhow!("{}: no `table` or `sps_table`", path.display()))?,
    };
    let t = SpsTable::new(pts).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    // A profile's decoding steps at its shortest context price verified drafts, as in the
    // engine (absent from a frontier JSON).
    let points: Vec<specdec::profile::SpsPoint> =
        serde_json::from_value(v["points"].clone()).unwrap_or_default();
    Ok(t.with_marginal(specdec::profile::marginal_staircase(&points)))
}

/// Blocks from an `eval-drafter --blocks` file: the served confidences and accepted length, of
/// one arm (a line without an `arm` is taken).
pub fn load_blocks(path: &Path, set: Option<&str>, arm: &str) -> anyhow::Result<Vec<Block>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), i + 1))?;
        if set.is_some_and(|s| v["set"].as_str() != Some(s))
            || v["arm"].as_str().is_some_and(|a| a != arm)
        {
            continue;
        }
        let conf: Vec<f32> = v["served"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("{} line {}: no `served`", path.display(), i + 1))?
            .iter()
            .map(|c| {
                c.as_f64()
                    .filter(|c| c.is_finite() && (0.0..=1.0).contains(c))
                    .map(|c| c as f32)
            })
            .collect::<Option<_>>()
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "{} line {}: a confidence that is not a number in [0, 1]",
                    path.display(),
                    i + 1
                )
            })?;
        let accepted = v["accepted"]
            .as_u64()
            .filter(|&a| a as usize <= conf.len())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "{} line {}: `accepted` missing or > drafted",
                    path.display(),
                    i + 1
                )
            })?;
        if conf.is_empty() {
            continue;
        }
        // The planner counts accepted drafts in a byte: no verified block is that long.
        let accepted = u8::try_from(accepted).map_err(|_| {
            anyhow::anyhow!(
                "{} line {}: {accepted} drafts accepted in one block, more than the planner \
                 replays (255)",
                path.display(),
                i + 1
            )
        })?;
        out.push(Block {
            conf,
            accepted,
            copy_run: v["copy_run"].as_bool().unwrap_or(false),
        });
    }
    anyhow::ensure!(
        !out.is_empty(),
        "{}: no blocks of arm `{arm}`{}",
        path.display(),
        set.map(|s| format!(" in set `{s}`")).unwrap_or_default()
    );
    Ok(out)
}

/// The traffic mix's block sets: `--mix NAME=W,...`, or one set (`--set NAME`, or the whole
/// file).
pub fn load_mix(
    path: &Path,
    set: Option<&str>,
    mix: &[String],
    arm: &str,
) -> anyhow::Result<Vec<BlockSet>> {
    if mix.is_empty() {
        let blocks = load_blocks(path, set, arm)?;
        return Ok(vec![BlockSet {
            name: set.unwrap_or("all").to_string(),
            weight: 1.0,
            blocks,
        }]);
    }
    mix.iter()
        .map(|m| {
            let (name, w) = m
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--mix `{m}`: expected NAME=WEIGHT"))?;
            let weight: f64 = w
                .parse()
                .ok()
                .filter(|w: &f64| w.is_finite() && *w > 0.0)
                .ok_or_else(|| anyhow::anyhow!("--mix `{m}`: the weight must be a number > 0"))?;
            Ok(BlockSet {
                name: name.to_string(),
                weight,
                blocks: load_blocks(path, Some(name), arm)?,
            })
        })
        .collect()
}

/// Drafting seconds by (γ, batch) from a `bench draft --json` file.
pub fn load_draft_cost(path: &Path) -> anyhow::Result<DraftCost> {
    let v = read_json(path)?;
    let pts: Vec<(u8, u32, f64)> = v["points"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("{}: no `points`", path.display()))?
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let g = p["gamma"].as_u64().filter(|&g| g <= u8::MAX as u64);
            let b = p["batch"].as_u64().filter(|&b| b <= u32::MAX as u64);
            match (g, b, p["draft_ms"].as_f64()) {
                (Some(g), Some(b), Some(ms)) => Ok((g as u8, b as u32, ms / 1e3)),
                _ => anyhow::bail!(
                    "{}: point {i} needs integer `gamma` and `batch` and a number `draft_ms`",
                    path.display()
                ),
            }
        })
        .collect::<anyhow::Result<_>>()?;
    DraftCost::new(pts).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn engine_json(r: &planner::EngineReport) -> Value {
    json!({
        "tok_s": r.tok_s, "user_tok_s_p50": r.user_tok_s_p50, "user_tok_s_p10": r.user_tok_s_p10,
        "ttft_p50_ms": r.ttft_p50_s * 1e3, "ttft_p90_ms": r.ttft_p90_s * 1e3,
        "committed_per_call": r.committed_per_call, "draft_round_ms": r.draft_round_s * 1e3,
        "arrived": r.arrived, "finished": r.finished, "backlog": r.backlog,
    })
}

/// A plan as the chart's values (helm/dspark-serve), for the policy the chart deploys: the
/// scheduler's (a fixed length is simulated for comparison only; the chart has no fixed-length
/// policy, and the per-request gate it does have is another policy). A shape without draft
/// workers was simulated without speculation, while a target worker without draft workers
/// drafts with its local fallback (n-gram by default): the plan turns the fallback off, so
/// what is deployed is what was simulated.
fn helm_values(targets: u32, drafts: u32, max_running: u32, max_gamma: u8) -> Value {
    let mut target = json!({"replicas": targets, "maxRunning": max_running,
        "verifyPolicy": "scheduler", "gamma": max_gamma});
    if drafts == 0 {
        target["fallback"] = json!("none");
    }
    json!({"targetWorker": target, "draftWorker": {"replicas": drafts}})
}

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref(), a.plot.as_deref()])?;
    let finite = |v: f64, lo: f64, what: &str| {
        anyhow::ensure!(
            v.is_finite() && v >= lo,
            "{what} must be a finite number ≥ {lo}"
        );
        Ok(())
    };
    finite(a.seconds, f64::MIN_POSITIVE, "--seconds")?;
    finite(a.warmup, 0.0, "--warmup")?;
    finite(a.hop_ms, 0.0, "--hop-ms")?;
    finite(a.slo_user_tok_s, 0.0, "--slo-user-tok-s")?;
    finite(a.slo_ttft_ms, 0.0, "--slo-ttft-ms")?;
    finite(a.target_price, 0.0, "--target-price")?;
    finite(a.draft_price, 0.0, "--draft-price")?;
    if let Some(r) = a.rate {
        finite(r, f64::MIN_POSITIVE, "--rate")?;
    }
    anyhow::ensure!(
        (0.0..1.0).contains(&a.output_spread),
        "--output-spread in [0, 1)"
    );
    let verify = match a.verify.as_str() {
        "scheduler" => Verify::Scheduler,
        v => match v.strip_prefix("fixed-").and_then(|k| k.parse::<u8>().ok()) {
            Some(k) if k >= 1 && k <= a.max_gamma => Verify::Fixed(k),
            _ => anyhow::bail!(
                "--verify `{v}`: scheduler or fixed-K with K in 1..={}",
                a.max_gamma
            ),
        },
    };
    anyhow::ensure!(
        a.max_gamma >= 1 && a.max_gamma as usize <= dspark_scheduler::admission::MAX_GAMMA,
        "--max-gamma in 1..={}",
        dspark_scheduler::admission::MAX_GAMMA
    );
    anyhow::ensure!(a.max_targets >= 1, "--max-targets ≥ 1");
    let sps = load_sps(&a.sps, a.ctx)?;
    let blocks = load_mix(&a.blocks, a.set.as_deref(), &a.mix, &a.arm)?;
    let n_blocks: usize = blocks.iter().map(|s| s.blocks.len()).sum();
    let cost = load_draft_cost(&a.draft_cost)?;
    let time = SimTime {
        warmup_s: a.warmup,
        measure_s: a.seconds,
        seed: a.seed,
    };
    let spec = EngineSpec {
        sps,
        max_running: a.max_running,
        prefill_chunk: a.prefill_chunk,
        max_gamma: a.max_gamma,
        verify,
        hop_s: a.hop_ms / 1e3,
    };
    let command = crate::config::command_line();
    if let Some(f) = &a.validate {
        return validate(&a, f, spec, &blocks, &cost, time, command);
    }
    let load = match (a.rate, a.concurrency) {
        (Some(r), None) => Load::Open { rate: r },
        (None, Some(c)) => Load::Closed { concurrency: c },
        _ => anyhow::bail!("give the load: --rate REQ_PER_S or --concurrency N"),
    };
    let w = Workload {
        load,
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.output_tokens,
        output_spread: a.output_spread,
    };
    let slo = Slo {
        min_user_tok_s: a.slo_user_tok_s,
        max_ttft_p90_s: a.slo_ttft_ms / 1e3,
    };
    let prices = (a.target_price, a.draft_price);
    let sc = Scenario {
        spec: &spec,
        workload: w,
        blocks: &blocks,
        cost: &cost,
        time,
        slo,
        prices,
    };
    let p = planner::plan(&sc, a.max_targets, a.max_drafts)?;
    out!(
        "{:>7} {:>6} {:>9} {:>12} {:>10} {:>9} {:>6}  verdict",
        "targets",
        "drafts",
        "tok/s",
        "user tok/s",
        "TTFT p90",
        "ρ draft",
        "cost"
    )?;
    let mut shapes: Vec<Value> = Vec::with_capacity(p.shapes.len());
    for s in &p.shapes {
        out!(
            "{:>7} {:>6} {:>9.1} {:>12.1} {:>8.0}ms {:>9.2} {:>6.2}  {}",
            s.targets,
            s.drafts,
            s.tok_s,
            s.engine.user_tok_s_p50,
            s.engine.ttft_p90_s * 1e3,
            s.draft_util,
            s.cost,
            if s.feasible {
                "meets the SLO"
            } else {
                &s.reason
            }
        )?;
        shapes.push(
            json!({"targets": s.targets, "drafts": s.drafts, "tok_s": s.tok_s,
            "draft_util": s.draft_util, "cost": s.cost, "feasible": s.feasible,
            "reason": s.reason, "engine": engine_json(&s.engine)}),
        );
    }
    let best = p.best.map(|i| &p.shapes[i]);
    let helm = best
        .filter(|_| verify == Verify::Scheduler)
        .map(|b| helm_values(b.targets, b.drafts, a.max_running, a.max_gamma));
    match best {
        Some(b) => out!(
            "plan: {} target worker(s) + {} draft worker(s) (draft:target {}:{}), {:.0} tok/s, \
             median {:.1} tok/s per user, TTFT p90 {:.0} ms, cost {:.2}",
            b.targets,
            b.drafts,
            b.drafts,
            b.targets,
            b.tok_s,
            b.engine.user_tok_s_p50,
            b.engine.ttft_p90_s * 1e3,
            b.cost
        )?,
        None => out!(
            "plan: no shape up to {} target and {} draft workers meets the SLO",
            a.max_targets,
            a.max_drafts
        )?,
    }
    if let Some(h) = &helm {
        let fallback = match h["targetWorker"]["fallback"].as_str() {
            Some(f) => format!(" --set targetWorker.fallback={f}"),
            None => String::new(),
        };
        out!(
            "helm: --set targetWorker.replicas={} --set draftWorker.replicas={} \
             --set targetWorker.maxRunning={} --set targetWorker.verifyPolicy={} \
             --set targetWorker.gamma={}{fallback}",
            h["targetWorker"]["replicas"],
            h["draftWorker"]["replicas"],
            h["targetWorker"]["maxRunning"],
            h["targetWorker"]["verifyPolicy"]
                .as_str()
                .unwrap_or("scheduler"),
            h["targetWorker"]["gamma"]
        )?;
    }
    // The frontier per draft:target ratio at the planned target count: closed-loop load per
    // target worker 1, 2, 4, ... up to max_running.
    let t = best.map(|b| b.targets).unwrap_or(a.max_targets);
    let mut ratios: Vec<u32> = vec![0, t.div_ceil(4), t.div_ceil(2), t];
    if let Some(b) = best {
        ratios.push(b.drafts);
    }
    ratios.sort_unstable();
    ratios.dedup();
    let mut frontier = Vec::new();
    let mut series = Vec::new();
    for &d in &ratios {
        let mut pts = Vec::new();
        let mut c = 1u32;
        while c <= a.max_running {
            let wc = Workload {
                load: Load::Closed { concurrency: c * t },
                ..w
            };
            let r = planner::evaluate(&Scenario { workload: wc, ..sc }, t, d)?;
            if r.reason.contains("saturated") {
                break;
            }
            frontier.push(json!({"targets": t, "drafts": d, "concurrency_per_target": c,
                "tok_s": r.tok_s, "user_tok_s": r.engine.user_tok_s_p50, "draft_util": r.draft_util}));
            pts.push((r.engine.user_tok_s_p50, r.tok_s));
            c *= 2;
        }
        series.push(crate::plot::Series {
            name: if d == 0 {
                "no speculation".into()
            } else {
                format!("{d} draft : {t} target")
            },
            points: pts,
        });
    }
    let v = json!({
        "command": command,
        "inputs": {"verify": a.verify, "sps": a.sps, "ctx": a.ctx, "blocks": a.blocks, "blocks_n": n_blocks,
            "set": a.set, "mix": a.mix, "arm": a.arm, "draft_cost": a.draft_cost,
            "rate": a.rate, "concurrency": a.concurrency, "prompt_tokens": a.prompt_tokens,
            "output_tokens": a.output_tokens, "output_spread": a.output_spread,
            "max_running": a.max_running, "prefill_chunk": a.prefill_chunk,
            "max_gamma": a.max_gamma, "hop_ms": a.hop_ms, "seconds": a.seconds,
            "warmup": a.warmup, "seed": a.seed, "target_price": a.target_price,
            "draft_price": a.draft_price},
        "slo": {"user_tok_s_p50": a.slo_user_tok_s, "ttft_p90_ms": a.slo_ttft_ms},
        "shapes": shapes,
        "best": best.map(|b| json!({"targets": b.targets, "drafts": b.drafts, "tok_s": b.tok_s,
            "cost": b.cost, "engine": engine_json(&b.engine)})),
        "helm_values": helm,
        "frontier": frontier,
    });
    crate::bench::write_json(&a.json, &v)?;
    if let Some(p) = &a.plot {
        let svg = crate::plot::line_chart(
            &format!("Planned frontier, {t} target worker(s), by draft workers"),
            "median tokens/s per user",
            "cluster tokens/s",
            &series,
        );
        std::fs::write(p, svg)?;
        eprintln!("wrote {}", p.display());
    }
    if best.is_none() {
        return Err(NoPlan(format!(
            "no shape up to {} target and {} draft workers meets the SLO (median ≥ {} tokens/s \
             per user, TTFT p90 ≤ {} ms): raise --max-targets or --max-drafts, or relax \
             --slo-user-tok-s or --slo-ttft-ms{}",
            a.max_targets,
            a.max_drafts,
            a.slo_user_tok_s,
            a.slo_ttft_ms,
            if a.json.is_some() {
                " (each shape's reason is in the JSON)"
            } else {
                ""
            }
        ))
        .into());
    }
    Ok(())
}

/// `dspark plan` found no shape that meets the SLO (what it measured is still written): the
/// command exits with [`NoPlan::EXIT`], apart from a bad input's 1.
#[derive(Debug)]
pub struct NoPlan(pub String);

impl NoPlan {
    pub const EXIT: u8 = 3;
}

impl std::fmt::Display for NoPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NoPlan {}

/// Predicted against measured, arm by arm, for a `bench frontier` run: one engine, the drafter
/// in process (its cost on the critical path, no pool, no hop).
fn validate(
    a: &PlanArgs,
    path: &Path,
    mut spec: EngineSpec,
    blocks: &[BlockSet],
    cost: &DraftCost,
    time: SimTime,
    command: String,
) -> anyhow::Result<()> {
    let f = read_json(path)?;
    let out_tokens = f["max_tokens"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("{}: no max_tokens", path.display()))?;
    let spread = f["length_spread"].as_f64().unwrap_or(0.5);
    let prompt = f["prompt_tokens_mean"]
        .as_f64()
        .map(|p| p.round() as u32)
        .unwrap_or(a.prompt_tokens);
    spec.hop_s = 0.0;
    let mut rows = Vec::new();
    let mut errs = Vec::new();
    out!(
        "{:>10} {:>4} {:>10} {:>10} {:>7} {:>9} {:>9}",
        "arm",
        "c",
        "measured",
        "predicted",
        "ratio",
        "τ meas.",
        "τ pred."
    )?;
    for p in f["points"].as_array().into_iter().flatten() {
        let (Some(arm), Some(c), Some(meas)) = (
            p["arm"].as_str(),
            p["concurrency"].as_u64(),
            p["tok_s"].as_f64(),
        ) else {
            continue;
        };
        let verify = match arm {
            "none" => None,
            "scheduler" => Some(Verify::Scheduler),
            s => match s.strip_prefix("fixed-").and_then(|g| g.parse::<u64>().ok()) {
                // Only in 1..=--max-gamma: the simulation would cap a longer length at
                // --max-gamma and draft nothing at fixed-0, another arm than the one measured.
                Some(g) => match u8::try_from(g) {
                    Ok(g) if (1..=spec.max_gamma).contains(&g) => Some(Verify::Fixed(g)),
                    _ => {
                        eprintln!(
                            "{arm} c {c}: not replayed: fixed lengths replay in 1..={} \
                             (--max-gamma); skipped",
                            spec.max_gamma
                        );
                        continue;
                    }
                },
                None => continue,
            },
        };
        let w = Workload {
            load: Load::Closed {
                concurrency: c as u32,
            },
            prompt_tokens: prompt,
            output_tokens: out_tokens as u32,
            output_spread: spread,
        };
        let r = match verify {
            None => planner::simulate_engine(&spec, &w, None, time)?,
            Some(v) => {
                spec.verify = v;
                planner::simulate_engine(&spec, &w, Some((blocks, cost, 0.0)), time)?
            }
        };
        if !(meas > 0.0 && r.tok_s > 0.0) {
            eprintln!(
                "{arm} c {c}: measured {meas} or predicted {} tok/s is not positive; skipped",
                r.tok_s
            );
            continue;
        }
        let ratio = r.tok_s / meas;
        errs.push(ratio.ln().abs());
        out!(
            "{arm:>10} {c:>4} {meas:>10.1} {:>10.1} {ratio:>7.3} {:>9.2} {:>9.2}",
            r.tok_s,
            p["committed_per_call"].as_f64().unwrap_or(f64::NAN),
            r.committed_per_call
        )?;
        rows.push(json!({"arm": arm, "concurrency": c, "measured_tok_s": meas,
            "predicted_tok_s": r.tok_s, "ratio": ratio,
            "measured_committed_per_call": p["committed_per_call"],
            "predicted_committed_per_call": r.committed_per_call,
            "measured_user_tok_s": p["user_tok_s"], "predicted_user_tok_s": r.user_tok_s_p50}));
    }
    anyhow::ensure!(!rows.is_empty(), "{}: no points to replay", path.display());
    errs.sort_by(f64::total_cmp);
    let median_err = (errs[errs.len() / 2]).exp() - 1.0;
    let max_err = errs.last().map(|e| e.exp() - 1.0).unwrap_or(0.0);
    out!(
        "predicted / measured tokens/s: median error {:.1} %, worst {:.1} % over {} points",
        median_err * 100.0,
        max_err * 100.0,
        rows.len()
    )?;
    let v = json!({"command": command, "frontier": path, "sps": a.sps, "ctx": a.ctx,
        "blocks": a.blocks, "blocks_n": blocks.iter().map(|s| s.blocks.len()).sum::<usize>(),
        "draft_cost": a.draft_cost,
        "prompt_tokens": prompt, "points": rows,
        "median_abs_error": median_err, "max_abs_error": max_err});
    crate::bench::write_json(&a.json, &v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `eval-drafter --blocks` file holds several arms side by side; a plan reads the one
    /// deployed.
    #[test]
    fn blocks_are_read_for_one_arm() {
        let dir = std::env::temp_dir().join(format!("dspark-plan-arms-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("blocks.jsonl");
        let line = |arm: &str, acc: u8| {
            format!(
                r#"{{"set":"code","arm":"{arm}","conf":[0.9,0.8],"served":[0.9,0.8],"copy_run":false,"accepted":{acc},"step":0,"request":0}}"#
            )
        };
        let text = [line("dspark", 2), line("parallel", 0), line("parallel", 0)].join("\n");
        std::fs::write(&p, text).unwrap();
        let d = load_blocks(&p, None, "dspark").unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].accepted, 2);
        assert_eq!(load_blocks(&p, Some("code"), "parallel").unwrap().len(), 2);
        let e = load_blocks(&p, None, "ngram").unwrap_err().to_string();
        assert!(e.contains("no blocks of arm `ngram`"), "{e}");
        // More drafts accepted in one block than the planner counts: refused, not wrapped.
        let long = dir.join("long.jsonl");
        let served = ["0.9"; 300].join(",");
        std::fs::write(
            &long,
            format!(r#"{{"set":"code","arm":"dspark","served":[{served}],"accepted":256}}"#),
        )
        .unwrap();
        let e = load_blocks(&long, None, "dspark").unwrap_err().to_string();
        assert!(e.contains("256 drafts accepted"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A closed-loop plan simulates what `--seconds` and `--warmup` say: more than an hour
    /// of either is refused when the command line is parsed, not run for hours.
    #[test]
    fn simulated_time_is_bounded_at_parse() {
        let base = [
            "dspark",
            "plan",
            "--sps",
            "s.json",
            "--blocks",
            "b.jsonl",
            "--draft-cost",
            "d.json",
            "--concurrency",
            "4",
        ];
        let parse = |extra: &[&str]| {
            crate::parse_from(base.iter().chain(extra).copied()).map(|c| match c.cmd {
                crate::Command::Plan(p) => (p.seconds, p.warmup),
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(parse(&[]).expect("defaults"), (60.0, 10.0));
        assert_eq!(
            parse(&["--seconds", "3600", "--warmup", "0"]).expect("bounds"),
            (3600.0, 0.0)
        );
        for extra in [
            &["--seconds", "1e7"][..],
            &["--seconds", "0"],
            &["--warmup", "3601"],
            &["--warmup", "-1"],
        ] {
            let e = parse(extra).expect_err("refused").to_string();
            assert!(e.contains(extra[0]), "{e}");
        }
    }

    /// Without draft workers the plan was simulated without speculation: the chart's values
    /// turn the target workers' local fallback drafter off; with draft workers they leave it.
    #[test]
    fn a_plan_without_draft_workers_deploys_no_fallback_drafter() {
        let none = helm_values(3, 0, 16, 7);
        assert_eq!(none["targetWorker"]["fallback"], "none", "{none}");
        assert_eq!(none["draftWorker"]["replicas"], 0);
        let some = helm_values(2, 1, 16, 7);
        assert!(some["targetWorker"].get("fallback").is_none(), "{some}");
        assert_eq!(some["targetWorker"]["replicas"], 2);
        assert_eq!(some["targetWorker"]["gamma"], 7);
    }
}
