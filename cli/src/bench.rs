//! Benchmarks: each writes JSON (with the command line that produced it) and prints a table.

use crate::config::Global;
use clap::{Args, Subcommand};
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use dspark_runtime::{KvCache, Model, SeqId};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Cost of one forward over k new tokens per sequence: ctx × k × batch grid.
    VerifyCurve(VerifyCurveArgs),
    /// Autoregressive tokens/s at batch 1 and 8, with llama.cpp on the same GGUF when installed.
    Decode(DecodeArgs),
    /// Speculative decoding end to end: `none` and the drafter at each γ, same prompts, one run.
    Spec(SpecArgs),
    /// Per-position top-1 agreement and KL of the quantized forward against the f32-dequantized
    /// reference forward of the same weights, over real text.
    Accuracy(AccuracyArgs),
    /// Load against a running router (`dspark up`): TTFT, TPOT, ITL, tokens/s, wire bytes.
    Serve(crate::serve_bench::ServeArgs),
    /// Decision time of the hardware-aware admission (requests × γ confidences per call).
    Sched(SchedArgs),
    /// Throughput vs per-user speed across concurrency: no speculation, fixed γ, scheduler.
    Frontier(crate::frontier::FrontierArgs),
    /// Cost of one drafting call against one target decode, per stage, in the serving loop.
    Draft(crate::draft_bench::DraftArgs),
    /// Automatic prefix caching on a chat workload sharing a system prompt: cache off and on.
    Prefix(crate::prefix_bench::PrefixArgs),
    /// Structured output's token mask per position, by format and document state: the plain
    /// token fast path against the validator on every candidate, in one run.
    Mask(MaskArgs),
    /// Forward time with the target split over tensor-parallel ranks (links included), each
    /// degree side by side, and greedy agreement with the whole model.
    Tp(crate::tp_bench::TpArgs),
}

#[derive(Args, Debug)]
pub struct SpecArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Drafters to compare with `none` in the same run (comma list): ngram, draft-model[:NAME],
    /// dspark[:DIR].
    #[arg(long, value_delimiter = ',', default_value = "ngram")]
    pub drafter: Vec<String>,
    /// chat | code | math
    #[arg(long, default_value = "code")]
    pub prompts: String,
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Draft lengths to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub gammas: Vec<usize>,
    /// Use only the first N prompts of the set.
    #[arg(long, value_parser = crate::config::at_least_one)]
    pub limit: Option<usize>,
    /// Fixed γ (no per-request gate).
    #[arg(long)]
    pub no_gate: bool,
    /// Also run each drafter with the hardware-aware scheduler (this target's SPS(B) profile,
    /// confidence-based verification lengths up to the largest γ) instead of the gate.
    #[arg(long)]
    pub scheduler: bool,
    /// SPS(B) profiling grid of the scheduler arms' table (total batch tokens), as the target
    /// worker's `--sps-grid`; profiled once and cached per grid.
    #[arg(long, value_delimiter = ',', default_values_t = target_worker::sps::DEFAULT_GRID.to_vec())]
    pub sps_grid: Vec<usize>,
    /// Passes over the prompts. Prompts run in groups of `--concurrency`, each group on every
    /// arm back to back (shuffled order). A pass repeats the same work on the same prompts, so
    /// passes are not independent samples: each group's log ratio to `none` is averaged over
    /// the passes, and the speedup is the geometric mean over the groups, with a 95 %
    /// t-interval over the groups (n = groups, the prompts at concurrency 1).
    #[arg(long, default_value_t = 1, value_parser = crate::config::at_least_one)]
    pub rounds: usize,
    /// Untimed requests each arm's engine serves before round 0, on the set's prompts in turn
    /// (default: two waves of `--concurrency`, at least 48, as `bench frontier`): the
    /// scheduler's running estimates start from its prior and its probes settle over many
    /// steps, and the first steps warm caches and threads.
    #[arg(long)]
    pub warmup: Option<usize>,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct AccuracyArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Positions of text to score.
    #[arg(long, default_value_t = 512, value_parser = crate::config::at_least_one)]
    pub positions: usize,
    /// Text file to score (default: the repository's evaluation text).
    #[arg(long)]
    pub text: Option<PathBuf>,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct VerifyCurveArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    #[arg(long, value_delimiter = ',', default_value = "256,2048")]
    pub ctx: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,6,8,12,16,24,32")]
    pub k: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16", value_parser = crate::config::at_least_one)]
    pub batch: Vec<usize>,
    /// Timed repetitions per point (after four untimed forwards per k). Each repetition times
    /// every k once, in a seeded shuffled order; the ratio column and the plot use the median.
    #[arg(long, default_value_t = 5, value_parser = crate::config::at_least_one)]
    pub reps: usize,
    /// Give every sequence a context of its own instead of forks of one: a decode of the
    /// batch then reads `batch` contexts' keys and values, as distinct requests do, instead of
    /// one that stays in cache.
    #[arg(long)]
    pub unshared: bool,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// SVG plot of T(k)/T(k0) per (ctx, batch), medians, k0 the smallest --k (1 by default).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Decode steps to time.
    #[arg(long, default_value_t = 64, value_parser = crate::config::at_least_one)]
    pub tokens: usize,
    /// Prompt length before decoding.
    #[arg(long, default_value_t = 64, value_parser = crate::config::at_least_one)]
    pub prompt_len: usize,
    /// Python with `llama_cpp` installed for the peer arm (skipped if it cannot import it).
    #[arg(long, env = "DSPARK_LLAMA_CPP_PYTHON")]
    pub llama_cpp_python: Option<String>,
    /// Paired rounds (ours and llama.cpp back to back, the order alternating): the ratio is the
    /// geometric mean of the per-round ratios, with a 95 % interval. Batch 8 (no peer) is timed
    /// once per round too; each arm's printed tok/s is its best round.
    #[arg(long, default_value_t = 5, value_parser = crate::config::at_least_one)]
    pub rounds: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(g: &Global, cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::VerifyCurve(a) => verify_curve(g, a),
        BenchCmd::Decode(a) => decode(g, a),
        BenchCmd::Accuracy(a) => accuracy(g, a),
        BenchCmd::Spec(a) => spec_bench(g, a),
        BenchCmd::Serve(a) => crate::serve_bench::run(a),
        BenchCmd::Sched(a) => sched_bench(a),
        BenchCmd::Frontier(a) => crate::frontier::run(g, a),
        BenchCmd::Draft(a) => crate::draft_bench::run(g, a),
        BenchCmd::Prefix(a) => crate::prefix_bench::run(g, a),
        BenchCmd::Mask(a) => mask_bench(g, a),
        BenchCmd::Tp(a) => crate::tp_bench::run(g, a),
    }
}

pub(crate) use crate::config::command_line;

/// Writes `v` to `path` (if given), with the run's provenance (see [`provenance`]) added to an
/// object's top level where it does not already hold those keys.
pub(crate) fn write_json(path: &Option<PathBuf>, v: &serde_json::Value) -> anyhow::Result<()> {
    if let Some(p) = path {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create the folder of {}: {e}", p.display()))?;
        }
        let mut v = v.clone();
        if let (Some(obj), serde_json::Value::Object(extra)) = (v.as_object_mut(), provenance(p)) {
            for (k, x) in extra {
                obj.entry(k).or_insert(x);
            }
        }
        std::fs::write(p, serde_json::to_string_pretty(&v)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// Where a result came from: `commit`, the HEAD of the git checkout holding the running binary
/// (else of the current directory) at run time, which is the build's commit unless the
/// checkout moved since; `dirty`, whether tracked files differ from it (untracked files, such
/// as results being written, do not count); `commit_from`, the folder git was asked in; and
/// `output`, the absolute path written. Each is null where git or the path cannot tell.
pub(crate) fn provenance(out: &std::path::Path) -> serde_json::Value {
    fn git(dir: &std::path::Path, args: &[&str]) -> Option<String> {
        let o = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .ok()?;
        if !o.status.success() {
            return None;
        }
        Some(String::from_utf8_lossy(&o.stdout).trim().to_string())
    }
    let dirs: Vec<PathBuf> = [
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.to_path_buf())),
        std::env::current_dir().ok(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let found = dirs.iter().find_map(|d| {
        git(d, &["rev-parse", "HEAD"])
            .filter(|c| !c.is_empty())
            .map(|c| (d, c))
    });
    let (commit, dirty, from) = match found {
        Some((d, c)) => (
            json!(c),
            git(d, &["status", "--porcelain", "--untracked-files=no"])
                .map_or(json!(null), |s| json!(!s.is_empty())),
            json!(d.display().to_string()),
        ),
        None => (json!(null), json!(null), json!(null)),
    };
    let abs = if out.is_absolute() {
        Some(out.to_path_buf())
    } else {
        std::env::current_dir().ok().map(|d| d.join(out))
    };
    // Links and `..` resolved through the folder (which exists by now), the file name kept.
    let output = abs.map(|a| match (a.parent(), a.file_name()) {
        (Some(d), Some(f)) => std::fs::canonicalize(d)
            .map(|d| d.join(f))
            .unwrap_or_else(|_| a.clone()),
        _ => a.clone(),
    });
    json!({
        "commit": commit, "dirty": dirty, "commit_from": from,
        "output": output.map(|p| p.display().to_string()),
    })
}

/// The median: the middle value, or the mean of the two middle values for an even count (0 for
/// none).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// (median, minimum) of timings.
fn stats(mut v: Vec<f64>) -> (f64, f64) {
    let med = median(&mut v);
    (med, v.first().copied().unwrap_or(0.0))
}

/// Deterministic pseudo-text token ids (avoids special tokens at the low end of a real
/// vocabulary; a tiny test vocabulary is used whole).
pub(crate) fn filler(n: usize, vocab: usize, salt: usize) -> Vec<u32> {
    let lo = if vocab > 2000 { 1000 } else { 0 };
    let span = vocab.saturating_sub(lo).max(1);
    (0..n)
        .map(|i| (lo + (i * 7919 + salt * 104_729) % span) as u32)
        .collect()
}

/// One sequence prefilled to `ctx`, forked `batch` times (shared blocks: the KV content is the
/// same for every row, which is all a timing needs).
pub(crate) fn prefilled(
    model: &Model,
    ctx: usize,
    batch: usize,
    max_k: usize,
) -> anyhow::Result<(KvCache, Vec<SeqId>)> {
    let mut cache = model.new_cache(ctx + batch * (max_k + 16) + 64, 16)?;
    let root = cache.new_seq();
    let prompt = filler(ctx, model.cfg.vocab_size, 1);
    for c in prompt.chunks(256) {
        model.forward(
            &mut cache,
            &[SeqInput {
                seq: root,
                tokens: c,
                logits: LogitsMode::None,
            }],
            &ForwardOptions::default(),
        )?;
    }
    let seqs = (0..batch)
        .map(|_| cache.fork(root, ctx))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((cache, seqs))
}

/// `batch` sequences, each prefilled to `ctx` with a filler of its own (no shared blocks).
fn prefilled_unshared(
    model: &Model,
    ctx: usize,
    batch: usize,
    max_k: usize,
) -> anyhow::Result<(KvCache, Vec<SeqId>)> {
    let mut cache = model.new_cache(batch * (ctx + max_k + 16) + 64, 16)?;
    let mut seqs = Vec::with_capacity(batch);
    for b in 0..batch {
        let s = cache.new_seq();
        for c in filler(ctx, model.cfg.vocab_size, b + 1).chunks(256) {
            model.forward(
                &mut cache,
                &[SeqInput {
                    seq: s,
                    tokens: c,
                    logits: LogitsMode::None,
                }],
                &ForwardOptions::default(),
            )?;
        }
        seqs.push(s);
    }
    Ok((cache, seqs))
}

/// The `--k` values in increasing order, each once: every ratio is to the first (the base k).
fn k_list(k: &[usize]) -> anyhow::Result<Vec<usize>> {
    let mut ks = k.to_vec();
    ks.sort_unstable();
    ks.dedup();
    anyhow::ensure!(
        ks.first().is_some_and(|&k| k >= 1),
        "--k values must be at least 1"
    );
    Ok(ks)
}

fn verify_curve(g: &Global, a: VerifyCurveArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref(), a.plot.as_deref()])?;
    let ks = k_list(&a.k)?;
    let k0 = ks[0];
    let path = g.resolve_model(&a.model)?;
    let max_ctx =
        a.ctx.iter().max().copied().unwrap_or(256) + ks.iter().max().copied().unwrap_or(1) + 16;
    let model = Model::load(
        &path,
        &dspark_runtime::LoadOptions {
            max_ctx: Some(max_ctx.max(4096)),
            ..g.load_opts()
        },
    )?;
    let max_k = ks.iter().max().copied().unwrap_or(1);
    // Checked before minutes of prefill: the longest context plus the largest k must fit.
    if let Some(&ctx) = a.ctx.iter().max()
        && ctx + max_k > model.cfg.max_ctx
    {
        anyhow::bail!(
            "--ctx {ctx} with --k {max_k} needs {} positions, more than the model's context of \
             {} tokens",
            ctx + max_k,
            model.cfg.max_ctx
        );
    }
    let mut points = Vec::new();
    out!(
        "{:>6} {:>6} {:>4} {:>10} {:>10} {:>8}",
        "ctx",
        "batch",
        "k",
        "ms_median",
        "ms_min",
        format!("x_k{k0}")
    )?;
    for &ctx in &a.ctx {
        for &batch in &a.batch {
            let (mut cache, seqs) = if a.unshared {
                prefilled_unshared(&model, ctx, batch, max_k)?
            } else {
                prefilled(&model, ctx, batch, max_k)?
            };
            let toks: Vec<Vec<Vec<u32>>> = ks
                .iter()
                .map(|&k| {
                    (0..batch)
                        .map(|b| filler(k, model.cfg.vocab_size, b + 7))
                        .collect()
                })
                .collect();
            let mut forward = |ki: usize| -> anyhow::Result<f64> {
                let inputs: Vec<SeqInput<'_>> = seqs
                    .iter()
                    .zip(&toks[ki])
                    .map(|(&s, t)| SeqInput {
                        seq: s,
                        tokens: t,
                        logits: LogitsMode::All,
                    })
                    .collect();
                let t0 = Instant::now();
                model.forward(&mut cache, &inputs, &ForwardOptions::default())?;
                let dt = t0.elapsed().as_secs_f64() * 1000.0;
                for &s in &seqs {
                    cache.truncate(s, ctx)?;
                }
                Ok(dt)
            };
            // Four untimed forwards per k first, so that the first k measured does not alone
            // pay for what a prefill leaves cold (buffers, caches, sleeping threads).
            for ki in 0..ks.len() {
                for _ in 0..4 {
                    forward(ki)?;
                }
            }
            // Then round-robin: each repetition times every k once, in an order of its own
            // (seeded), so a slow spell of the machine lands on several k alike instead of on
            // whichever k was being repeated then.
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
            for rep in 0..a.reps {
                let seed = ((ctx as u64) << 32) ^ ((batch as u64) << 16) ^ (rep as u64);
                for ki in crate::frontier::arm_order(ks.len(), seed) {
                    let dt = forward(ki)?;
                    times[ki].push(dt);
                }
            }
            let mut base = None;
            for (ki, t) in times.into_iter().enumerate() {
                let k = ks[ki];
                let (med, min) = stats(t);
                let b = *base.get_or_insert(med);
                out!(
                    "{ctx:>6} {batch:>6} {k:>4} {med:>10.2} {min:>10.2} {:>8.2}",
                    med / b
                )?;
                points.push(json!({"ctx": ctx, "batch": batch, "k": k, "ms_median": med,
                    "ms_min": min, "ratio": med / b}));
            }
        }
    }
    let v = json!({
        "model": a.model, "threads": model.threads(), "isa": model.isa().name(),
        "weights": model.weights_desc, "kv_cache_dtype": model.kv_dtype().name(),
        "unshared": a.unshared, "command": command_line(), "base_k": k0, "points": points,
        "ratio_of": "median", "reps": a.reps,
        "order": "each repetition times every k once, in a seeded shuffled order",
    });
    if let Some(p) = &a.plot {
        let mut series = Vec::new();
        for &ctx in &a.ctx {
            for &batch in &a.batch {
                let pts: Vec<(f64, f64)> = points
                    .iter()
                    .filter(|p| p["ctx"] == ctx && p["batch"] == batch)
                    .map(|p| {
                        (
                            p["k"].as_f64().unwrap_or(0.0),
                            p["ms_median"].as_f64().unwrap_or(0.0),
                        )
                    })
                    .collect();
                if let Some(&(_, base)) = pts.first() {
                    let pts = pts.iter().map(|&(k, ms)| (k, ms / base)).collect();
                    series.push(crate::plot::Series {
                        name: format!("ctx {ctx}, batch {batch}"),
                        points: pts,
                    });
                }
            }
        }
        let svg = crate::plot::line_chart(
            &format!("{}: forward cost vs k", a.model),
            "new tokens per sequence (k)",
            &format!("T(k) / T({k0})"),
            &series,
        );
        std::fs::write(p, svg)?;
        eprintln!("wrote {}", p.display());
    }
    write_json(&a.json, &v)
}

/// Our decode tokens/s at a batch size: `batch` sequences of `prompt_len`, then `tokens` steps.
fn our_decode(
    model: &Model,
    batch: usize,
    prompt_len: usize,
    tokens: usize,
) -> anyhow::Result<f64> {
    let mut cache = model.new_cache(batch * (prompt_len + tokens + 32), 16)?;
    let mut seqs = Vec::new();
    let mut last = Vec::new();
    for b in 0..batch {
        let s = cache.new_seq();
        let p = filler(prompt_len, model.cfg.vocab_size, b);
        let o = model.forward(
            &mut cache,
            &[SeqInput {
                seq: s,
                tokens: &p,
                logits: LogitsMode::Last,
            }],
            &ForwardOptions::default(),
        )?;
        last.push(kernels::sampling::argmax(o.row(0, 0)));
        seqs.push(s);
    }
    // One untimed step to warm caches.
    let mut step = |last: &mut Vec<u32>| -> anyhow::Result<()> {
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let inputs: Vec<SeqInput<'_>> = seqs
            .iter()
            .zip(&toks)
            .map(|(&s, t)| SeqInput {
                seq: s,
                tokens: t,
                logits: LogitsMode::Last,
            })
            .collect();
        let o = model.forward(&mut cache, &inputs, &ForwardOptions::default())?;
        for (i, l) in last.iter_mut().enumerate() {
            *l = kernels::sampling::argmax(o.row(i, 0));
        }
        Ok(())
    };
    step(&mut last)?;
    let t0 = Instant::now();
    for _ in 0..tokens {
        step(&mut last)?;
    }
    Ok((batch * tokens) as f64 / t0.elapsed().as_secs_f64())
}

const LLAMA_CPP_SCRIPT: &str = include_str!("../../scripts/llama_cpp_decode.py");

fn llama_cpp_decode(
    python: &str,
    gguf: &std::path::Path,
    threads: usize,
    prompt_len: usize,
    tokens: usize,
) -> Result<f64, String> {
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(LLAMA_CPP_SCRIPT)
        .arg(gguf)
        .arg(threads.to_string())
        .arg(prompt_len.to_string())
        .arg(tokens.to_string())
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if !out.status.success() {
        // A peer killed by a signal (a native build using instructions this CPU lacks dies
        // with SIGILL or SIGSEGV) leaves no stderr: the exit status is then all there is.
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty());
        return Err(match last {
            Some(l) => format!("llama.cpp peer failed ({}): {l}", out.status),
            None => format!("llama.cpp peer failed ({}), no message", out.status),
        });
    }
    let s = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(s.lines().last().unwrap_or("")).map_err(|e| e.to_string())?;
    v["tok_s"]
        .as_f64()
        .ok_or_else(|| "no tok_s in llama.cpp output".to_string())
}

fn decode(g: &Global, a: DecodeArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref()])?;
    let path = g.resolve_model(&a.model)?;
    let model = Model::load(&path, &g.load_opts())?;
    let threads = model.threads();
    // Arms paired per round, the order alternating (ours first, then llama.cpp first), so
    // drift on a shared machine hits both.
    let python = a
        .llama_cpp_python
        .clone()
        .unwrap_or_else(|| g.python.clone());
    let mut ours1 = Vec::new();
    let mut ours8 = Vec::new();
    let mut peer = Vec::new();
    let mut peer_err = None;
    for r in 0..a.rounds {
        let peer_first = r % 2 == 1 && peer_err.is_none();
        let run_peer = |peer: &mut Vec<f64>, peer_err: &mut Option<String>| {
            if path.is_file() && peer_err.is_none() {
                match llama_cpp_decode(&python, &path, threads, a.prompt_len, a.tokens) {
                    Ok(v) => peer.push(v),
                    Err(e) => *peer_err = Some(e),
                }
            }
        };
        if peer_first {
            run_peer(&mut peer, &mut peer_err);
        }
        ours1.push(our_decode(&model, 1, a.prompt_len, a.tokens)?);
        if !peer_first {
            run_peer(&mut peer, &mut peer_err);
        }
        // Batch 8 gets as many rounds as batch 1 (it has no peer to pair with).
        ours8.push(our_decode(&model, 8, a.prompt_len, a.tokens.min(32))?);
    }
    let paired = if peer.len() == ours1.len() {
        crate::frontier::paired_ratio(&ours1, &peer)
    } else {
        None
    };
    let best = |v: &[f64]| v.iter().cloned().fold(f64::NAN, f64::max);
    let o1 = best(&ours1);
    let o8 = best(&ours8);
    let p = if peer.is_empty() {
        None
    } else {
        Some(best(&peer))
    };
    out!(
        "model {}  threads {threads}  isa {}",
        a.model,
        model.isa().name()
    )?;
    // Each arm's best round is shown for its own speed; the arms are compared only by the
    // paired ratio (a quotient of two maxima favours the noisier arm).
    out!(
        "ours      batch 1: {o1:8.1} tok/s  (best of {} rounds)",
        ours1.len()
    )?;
    out!(
        "ours      batch 8: {o8:8.1} tok/s  (best of {} rounds)",
        ours8.len()
    )?;
    match (&p, &peer_err) {
        (Some(v), _) => {
            out!(
                "llama.cpp batch 1: {v:8.1} tok/s  (best of {} rounds)",
                peer.len()
            )?;
            if let Some((m, lo, hi)) = paired {
                out!(
                    "paired over {} rounds: ours/llama.cpp = {m:.3} [95 %: {lo:.3}, {hi:.3}]",
                    ours1.len()
                )?;
            }
        }
        (None, Some(e)) => out!("llama.cpp: not measured ({e})")?,
        _ => out!("llama.cpp: not measured")?,
    }
    let v = json!({
        "model": a.model, "threads": threads, "isa": model.isa().name(), "command": command_line(),
        "ours_tok_s": o1, "ours_batch8_tok_s": o8, "llama_cpp_tok_s": p,
        "llama_cpp_error": peer_err, "runs": {"ours_batch1": ours1, "ours_batch8": ours8, "llama_cpp": peer},
        "tok_s_note": "ours_tok_s, ours_batch8_tok_s and llama_cpp_tok_s are each the best of that arm's rounds; compare ours with llama.cpp by paired_ratio, not by their quotient",
        "paired_ratio": paired.map(|(m, lo, hi)| json!({"ratio": m, "ci95": [lo, hi], "rounds": ours1.len()})),
    });
    write_json(&a.json, &v)
}

const EVAL_TEXT: &str = include_str!("../../runtime/tests/data/eval_text.txt");

fn accuracy(g: &Global, a: AccuracyArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref()])?;
    let text = match &a.text {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("--text {}: {e}", p.display()))?,
        None => EVAL_TEXT.to_string(),
    };
    let path = g.resolve_model(&a.model)?;
    let tok = dspark_runtime::Tokenizer::load(&path)?;
    let mut ids = tok.encode(&text)?;
    if ids.is_empty() {
        anyhow::bail!("the text to score holds no tokens");
    }
    while ids.len() < a.positions {
        let more = tok.encode(&text)?;
        ids.extend(more);
    }
    ids.truncate(a.positions);
    let mut result = Vec::new();
    for dense in [false, true] {
        // `--kv-cache-dtype` picks the cache of the forward under test; the reference keeps
        // f32 elements, so the cache's own rounding shows in the comparison.
        let kv_dtype = if dense {
            Some(dspark_runtime::KvDtype::F32)
        } else {
            g.kv_dtype
        };
        let m = Model::load(
            &path,
            &dspark_runtime::LoadOptions {
                dense,
                // The model's whole context, as served: an `int8` cache keeps key offsets only
                // for channels that stay constant over all of it.
                max_ctx: None,
                kv_dtype,
                ..g.load_opts()
            },
        )?;
        let mut c = m.new_cache(a.positions + 16, 16)?;
        let s = c.new_seq();
        let mut logits = Vec::new();
        for chunk in ids.chunks(128) {
            let o = m.forward(
                &mut c,
                &[SeqInput {
                    seq: s,
                    tokens: chunk,
                    logits: LogitsMode::All,
                }],
                &ForwardOptions::default(),
            )?;
            logits.extend_from_slice(&o.logits);
        }
        result.push((
            m.isa().name(),
            m.cfg.vocab_size,
            logits,
            m.kv_dtype().name(),
            m.threads(),
        ));
    }
    let v = result[0].1;
    let (q, d) = (&result[0].2, &result[1].2);
    let mut agree = 0usize;
    let mut kl = 0f64;
    let mut kl_max = 0f64;
    for p in 0..ids.len() {
        let (ra, rb) = (&d[p * v..(p + 1) * v], &q[p * v..(p + 1) * v]);
        agree += (kernels::sampling::argmax(ra) == kernels::sampling::argmax(rb)) as usize;
        let (mut pa, mut pb) = (ra.to_vec(), rb.to_vec());
        kernels::ops::softmax(&mut pa);
        kernels::ops::softmax(&mut pb);
        let k: f64 = pa
            .iter()
            .zip(&pb)
            .filter(|(x, _)| **x > 0.0)
            .map(|(x, y)| *x as f64 * ((*x as f64).ln() - (y.max(1e-30) as f64).ln()))
            .sum();
        kl += k;
        kl_max = kl_max.max(k);
    }
    let n = ids.len() as f64;
    out!(
        "{}: {} positions, top-1 agreement {:.4}, mean KL {:.6}, max KL {:.5} (isa {})",
        a.model,
        ids.len(),
        agree as f64 / n,
        kl / n,
        kl_max,
        result[0].0
    )?;
    // The forward under test's cache and threads (the reference's cache is f32).
    let out = json!({
        "model": a.model, "positions": ids.len(), "isa": result[0].0, "command": command_line(),
        "kv_cache_dtype": result[0].3, "reference_kv_cache_dtype": result[1].3,
        "threads": result[0].4,
        "top1_agreement": agree as f64 / n, "mean_kl": kl / n, "max_kl": kl_max,
    });
    write_json(&a.json, &out)
}

/// The prompt sets shipped with the repository (`prompts/*.txt`, one prompt per line), and the
/// larger held-out sets (`prompts/heldout/*.txt`, `chat-heldout` …): new prompts, none of them
/// among the drafter's training prompts or the first sets, which calibration and the
/// benchmarks use. A binned ECE read on a few thousand blocks is biased upward by about 2 %
/// even for exact confidences; these sets hold 144 prompts each, nine times an evaluation
/// half of a first set. Their first 48 were the whole held-out sets until session 22. The
/// calibration sets (`prompts/calib/*.txt`, `chat-calib` …, 96 prompts each) are more new
/// prompts for calibration alone, which the greedy head's fit needs more of than the first
/// sets hold.
pub fn prompt_set(name: &str) -> anyhow::Result<Vec<String>> {
    let text = match name {
        "chat" => include_str!("../../prompts/chat.txt"),
        "code" => include_str!("../../prompts/code.txt"),
        "math" => include_str!("../../prompts/math.txt"),
        "chat-heldout" => include_str!("../../prompts/heldout/chat.txt"),
        "code-heldout" => include_str!("../../prompts/heldout/code.txt"),
        "math-heldout" => include_str!("../../prompts/heldout/math.txt"),
        "chat-calib" => include_str!("../../prompts/calib/chat.txt"),
        "code-calib" => include_str!("../../prompts/calib/code.txt"),
        "math-calib" => include_str!("../../prompts/calib/math.txt"),
        "all" | "all-heldout" | "all-calib" => {
            return Ok(prompt_sets(name)
                .iter()
                .map(|s| prompt_set(s))
                .collect::<anyhow::Result<Vec<_>>>()?
                .concat());
        }
        other => anyhow::bail!(
            "unknown prompt set `{other}` (chat, code, math, all, the held-out chat-heldout, \
             code-heldout, math-heldout, all-heldout, or the calibration sets chat-calib, \
             code-calib, math-calib, all-calib)"
        ),
    };
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.to_string())
        .collect())
}

/// The sets a name stands for, each reported on its own: `all` and `all-heldout` are the three
/// kinds; any other name is itself.
pub fn prompt_sets(name: &str) -> Vec<&str> {
    match name {
        "all" => vec!["chat", "code", "math"],
        "all-heldout" => vec!["chat-heldout", "code-heldout", "math-heldout"],
        "all-calib" => vec!["chat-calib", "code-calib", "math-calib"],
        s => vec![s],
    }
}

fn spec_bench(g: &Global, a: SpecArgs) -> anyhow::Result<()> {
    use specdec::{Event, ProposerKind, Request};
    crate::config::check_outputs(&[a.json.as_deref()])?;
    if a.concurrency == 0 {
        anyhow::bail!("--concurrency must be at least 1");
    }
    if let Some(&bad) = a.gammas.iter().find(|&&x| x == 0 || x > specdec::MAX_GAMMA) {
        anyhow::bail!("gamma {bad} out of range 1..={}", specdec::MAX_GAMMA);
    }
    let sampling = kernels::sampling::SamplingParams {
        temperature: a.temperature,
        ..Default::default()
    };
    sampling.validate()?;
    let kinds = a
        .drafter
        .iter()
        .map(|d| ProposerKind::parse(d, crate::spec::default_draft_for(&a.model)))
        .collect::<Result<Vec<_>, _>>()?;
    let target = crate::spec::load_target(g, &a.model)?;
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(&target.tok)?;
    let mut prompts = prompt_set(&a.prompts)?;
    if let Some(n) = a.limit {
        prompts.truncate(n);
    }
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            Ok(target
                .tok
                .encode(&tmpl.render(&[dspark_runtime::chat::Message::new("user", p)], true)?)?)
        })
        .collect::<anyhow::Result<_>>()?;
    // (drafter, γ, scheduler on)
    let mut arms: Vec<(ProposerKind, usize, bool)> = vec![(ProposerKind::None, 0, false)];
    for kind in &kinds {
        for &gm in &a.gammas {
            arms.push((kind.clone(), gm, false));
        }
        if a.scheduler {
            arms.push((
                kind.clone(),
                a.gammas.iter().copied().max().unwrap_or(1),
                true,
            ));
        }
    }
    let sps = if a.scheduler {
        Some(crate::spec::sps_profile(g, &a.model, &target, &a.sps_grid)?)
    } else {
        None
    };
    let mut drafts = crate::spec::DraftCache::default();
    out!(
        "{:<28} {:>5} {:>9} {:>9} {:>9} {:>10}  accept/pos",
        "drafter",
        "gamma",
        "tok/s",
        "tpot_ms",
        "ttft_ms",
        "per_call"
    )?;
    let rounds = a.rounds;
    // Every arm's engine is built first (setup is not timed). The prompts then go in groups of
    // `concurrency`, and each group runs on every arm back to back, in a seeded shuffled order:
    // arms are compared on the same prompts within seconds of each other, so a slow spell of
    // this shared machine hits them alike instead of landing on one arm.
    // Every engine is alive at once: each one's KV cache holds this workload (the longest
    // prompt and answer per running request), not `concurrency` whole contexts.
    let longest = ids.iter().map(|p| p.len()).max().unwrap_or(0) + a.max_tokens;
    let mut engines = Vec::with_capacity(arms.len());
    for (k, gm, sched) in &arms {
        let proposer = crate::spec::build_proposer(g, k, &target, &mut drafts)?;
        let mut e = crate::spec::engine_for_workload(
            &target,
            proposer,
            (*gm).max(1),
            !a.no_gate,
            a.concurrency,
            longest,
        )?;
        if let (true, Some(sps)) = (*sched, &sps) {
            e.set_policy(Some(Box::new(
                dspark_scheduler::admission::ConfidencePolicy::new(
                    sps.clone(),
                    dspark_scheduler::admission::Rule::Argmax,
                    2,
                    u32::MAX,
                    *gm as u8,
                ),
            )));
        }
        engines.push(e);
    }
    let labels: Vec<String> = arms
        .iter()
        .map(|(k, _, sched)| {
            if *sched {
                format!("{}+scheduler", k.label())
            } else {
                k.label()
            }
        })
        .collect();
    let n = ids.len();
    let groups: Vec<std::ops::Range<usize>> = (0..n)
        .step_by(a.concurrency)
        .map(|s| s..(s + a.concurrency).min(n))
        .collect();
    #[derive(Default)]
    struct Acc {
        secs: f64,
        tokens: usize,
        /// Tokens/s of each (round, group), in the same order for every arm.
        rates: Vec<f64>,
        round_rates: Vec<f64>,
        tpot: Vec<f64>,
        ttft: Vec<f64>,
        /// Round 0's output of each prompt; later rounds must reproduce it (greedy).
        outputs: Vec<Vec<u32>>,
    }
    let mut acc: Vec<Acc> = arms
        .iter()
        .map(|_| Acc {
            outputs: vec![Vec::new(); n],
            ..Default::default()
        })
        .collect();
    // Untimed: `--warmup` requests on every arm (the set's prompts in turn, in groups of
    // `concurrency`), so round 0 is not measured cold while later rounds are warm, and the
    // scheduler arms are timed with settled estimates, as in a long-running server.
    let warmup = a
        .warmup
        .unwrap_or_else(|| crate::frontier::default_warmup(a.concurrency));
    if n > 0 {
        for e in engines.iter_mut() {
            let mut next = 0usize;
            while next < warmup {
                let end = (next + a.concurrency).min(warmup);
                for w in next..end {
                    let i = w % n;
                    let mut r = Request::new((rounds * n + w) as u64, ids[i].clone(), a.max_tokens);
                    r.params = sampling.clone();
                    r.seed = i as u64;
                    e.add(r)?;
                }
                let mut left = end - next;
                while left > 0 {
                    for ev in e.step()? {
                        match ev {
                            Event::Finished { .. } => left -= 1,
                            Event::Failed { id, error } => {
                                anyhow::bail!("warm-up request {id} failed: {error}")
                            }
                            Event::Tokens { .. } => {}
                        }
                    }
                }
                next = end;
            }
            e.reset_totals();
        }
    }
    for round in 0..rounds {
        let mut round_secs = vec![0f64; arms.len()];
        let mut round_tokens = vec![0usize; arms.len()];
        for (gi, grp) in groups.iter().enumerate() {
            let order = crate::frontier::arm_order(arms.len(), (round * groups.len() + gi) as u64);
            for ai in order {
                let e = &mut engines[ai];
                let ac = &mut acc[ai];
                let mut outs: Vec<Vec<u32>> = vec![Vec::new(); grp.len()];
                let t0 = Instant::now();
                for i in grp.clone() {
                    let mut r = Request::new((round * n + i) as u64, ids[i].clone(), a.max_tokens);
                    r.params = sampling.clone();
                    r.seed = i as u64;
                    e.add(r)?;
                }
                let mut left = grp.len();
                let mut tokens = 0usize;
                while left > 0 {
                    for ev in e.step()? {
                        match ev {
                            Event::Tokens { id, tokens: t, .. } => {
                                tokens += t.len();
                                outs[id as usize % n - grp.start].extend(t);
                            }
                            Event::Failed { id, error } => {
                                anyhow::bail!("request {id} failed: {error}")
                            }
                            Event::Finished { metrics, .. } => {
                                left -= 1;
                                // One token has no time per output token (not a zero).
                                if metrics.completion_tokens > 1 {
                                    ac.tpot.push(metrics.tpot_s());
                                }
                                ac.ttft.push(metrics.ttft_s);
                            }
                        }
                    }
                }
                let dt = t0.elapsed().as_secs_f64();
                ac.secs += dt;
                ac.tokens += tokens;
                ac.rates.push(tokens as f64 / dt.max(1e-9));
                round_secs[ai] += dt;
                round_tokens[ai] += tokens;
                for (j, o) in outs.into_iter().enumerate() {
                    let i = grp.start + j;
                    if round == 0 {
                        ac.outputs[i] = o;
                    } else if a.temperature == 0.0 && ac.outputs[i] != o {
                        anyhow::bail!(
                            "{}: greedy output of prompt {i} differs between rounds",
                            labels[ai]
                        );
                    }
                }
            }
        }
        for (ai, ac) in acc.iter_mut().enumerate() {
            ac.round_rates
                .push(round_tokens[ai] as f64 / round_secs[ai].max(1e-9));
        }
        if rounds > 1 {
            out!("  round {} of {rounds} done", round + 1)?;
        }
    }
    // Per arm: tokens/s over every group, and the speedup over `none` (paired: same prompts,
    // run back to back). Rounds repeat the same work on the same prompts, so each group's log
    // ratio is averaged over the rounds first; the geometric mean and the 95 % t-interval are
    // over the groups (n = groups.len(), the prompts at concurrency 1).
    let base = acc[0].rates.clone();
    let n_groups = groups.len();
    let mut results = Vec::new();
    for (ai, ac) in acc.into_iter().enumerate() {
        let (label, gm, sched) = (&labels[ai], arms[ai].1, arms[ai].2);
        let tot = engines[ai].totals();
        let mean = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let tok_s = ac.tokens as f64 / ac.secs.max(1e-9);
        let (speedup, lo, hi) = crate::frontier::paired_ratio_by_unit(&ac.rates, &base, n_groups)
            .unwrap_or_else(|| {
                // Under two groups (or a zero rate): the geometric mean of the pairs there
                // are, with no interval.
                let l: Vec<f64> = ac
                    .rates
                    .iter()
                    .zip(&base)
                    .filter(|(x, y)| **x > 0.0 && **y > 0.0)
                    .map(|(x, y)| (x / y).ln())
                    .collect();
                let r = if l.is_empty() {
                    0.0
                } else {
                    (l.iter().sum::<f64>() / l.len() as f64).exp()
                };
                (r, f64::NAN, f64::NAN)
            });
        let acc_pos = tot.accept_per_pos();
        let ci = if lo.is_finite() {
            format!(" [{lo:.2}, {hi:.2}]")
        } else {
            String::new()
        };
        out!(
            "{:<28} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>10.2}  {:?}   ({:.2}x{ci})",
            label,
            gm,
            tok_s,
            mean(&ac.tpot) * 1e3,
            mean(&ac.ttft) * 1e3,
            tot.committed_per_call(),
            acc_pos
                .iter()
                .map(|v| (v * 100.0).round() / 100.0)
                .collect::<Vec<_>>(),
            speedup
        )?;
        let arm = json!({
            "drafter": label, "scheduler": sched, "gamma": gm, "tok_s": tok_s, "tpot_ms": mean(&ac.tpot) * 1e3, "ttft_ms": mean(&ac.ttft) * 1e3,
            "committed_per_call": tot.committed_per_call(), "accept_per_pos": acc_pos,
            "survival_per_pos": tot.survival_per_pos(), "speedup": speedup,
            "speedup_ci95": if lo.is_finite() { json!([lo, hi]) } else { json!(null) },
            "paired_groups": ac.rates.len(), "ci_groups": n_groups, "tok_s_rounds": ac.round_rates,
            "tok_s_by_round_group": ac.rates.chunks(n_groups.max(1)).map(|c| c.to_vec()).collect::<Vec<_>>(),
            "drafted_tokens": tot.drafted_tokens, "accepted_tokens": tot.accepted_tokens, "wasted_tokens": tot.wasted_tokens,
            "accepted_prefix_hist": tot.prefix_hist, "draft_s": tot.draft_s, "verify_s": tot.verify_s, "wall_s": ac.secs,
            "output_tokens": ac.tokens,
        });
        results.push((label.clone(), gm, ac.outputs, arm));
    }
    let unit = if a.concurrency == 1 {
        "prompts".to_string()
    } else {
        format!("groups of {} prompts", a.concurrency)
    };
    out!(
        "speedup vs none: geometric mean over {n_groups} {unit} (each one's log ratio averaged \
         over its {rounds} round(s)), 95 % t-interval over the {n_groups}"
    )?;
    // Greedy runs must agree token for token across arms (lossless check on real prompts).
    let greedy_identical = a.temperature == 0.0 && results.iter().all(|r| r.2 == results[0].2);
    if a.temperature == 0.0 {
        out!("greedy outputs identical across arms: {greedy_identical}")?;
    }
    let v = json!({
        "model": a.model, "drafters": a.drafter, "prompts": a.prompts, "n_prompts": ids.len(), "concurrency": a.concurrency,
        "temperature": a.temperature, "max_tokens": a.max_tokens, "gate": !a.no_gate, "threads": target.model.threads(),
        "rounds": a.rounds, "command": command_line(), "greedy_outputs_identical": if a.temperature == 0.0 { json!(greedy_identical) } else { json!(null) },
        "warmup_requests": warmup,
        "groups": groups.iter().map(|g| [g.start, g.end]).collect::<Vec<_>>(),
        "speedup_method": "per arm, each prompt group's log ratio of tok/s to none averaged over the rounds; speedup = exp of the mean over the groups, speedup_ci95 = 95 % t-interval over the groups (n = ci_groups); paired_groups counts the (round, group) ratios",
        "tok_s_by_round_group_layout": "tok_s_by_round_group[round][group], group g = prompts groups[g][0]..groups[g][1] (end exclusive)",
        "arms": results.iter().map(|r| r.3.clone()).collect::<Vec<_>>(),
    });
    write_json(&a.json, &v)?;
    if a.temperature == 0.0 && !greedy_identical {
        anyhow::bail!("greedy outputs differ between arms: speculation was not lossless");
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct MaskArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Masks timed per case and path (after one warm-up).
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Microseconds per mask over the model's vocabulary at document states that structured
/// output meets: before a key, inside strings (free, with a `maxLength`, under a `format`), in
/// a bounded number, and a whole-answer choice. Each state is timed with the plain-token fast
/// path and with the validator run on every candidate token, alternating, and both must allow
/// the same tokens.
pub fn mask_bench(g: &Global, a: MaskArgs) -> anyhow::Result<()> {
    use dspark_runtime::json::{Format, JsonVocab};
    use dspark_runtime::json_schema::{Pattern, Schema};
    use std::sync::Arc;
    anyhow::ensure!(a.iters >= 1, "--iters must be at least 1");
    crate::config::check_outputs(&[a.json.as_deref()])?;
    let path = g.resolve_model(&a.model)?;
    let tok = dspark_runtime::Tokenizer::load(&path)?;
    let jv = JsonVocab::new(&tok);
    let schema = Schema::compile(&serde_json::json!({"type": "object",
        "required": ["name", "note", "id", "age"],
        "properties": {"name": {"type": "string", "maxLength": 16},
            "note": {"type": "string"},
            "id": {"type": "string", "format": "uuid"},
            "age": {"type": "integer", "minimum": 0, "maximum": 30}}}))
    .map_err(|e| anyhow::anyhow!(e))?;
    let schema = Format::Schema(Arc::new(schema));
    let choice = Format::Regex(Arc::new(
        Pattern::one_of(&["positive".into(), "negative".into(), "neutral".into()])
            .map_err(|e| anyhow::anyhow!(e))?,
    ));
    let cases: Vec<(&str, &Format, &str)> = vec![
        ("json_object: before a key", &Format::Object, "{"),
        (
            "json_object: inside a string",
            &Format::Object,
            "{\"a\": \"Lu",
        ),
        (
            "json_object: inside a number",
            &Format::Object,
            "{\"a\": 12",
        ),
        ("json_schema: before a key", &schema, "{"),
        (
            "json_schema: string with maxLength",
            &schema,
            "{\"name\": \"Lu",
        ),
        (
            "json_schema: string",
            &schema,
            "{\"name\": \"L\", \"note\": \"Lu",
        ),
        (
            "json_schema: format uuid",
            &schema,
            "{\"name\": \"L\", \"note\": \"\", \"id\": \"12",
        ),
        (
            "json_schema: bounded integer",
            &schema,
            "{\"name\": \"L\", \"note\": \"\", \"id\": \"123e4567-e89b-12d3-a456-426614174000\", \"age\": 1",
        ),
        ("guided_choice: start", &choice, ""),
        ("guided_choice: inside", &choice, "pos"),
    ];
    let vocab = tok.vocab_size();
    let mut out_cases = Vec::new();
    for (name, f, prefix) in cases {
        let mut d = f.start();
        anyhow::ensure!(f.feed(&mut d, prefix.as_bytes()), "{name}: bad prefix");
        let mut times = [Vec::new(), Vec::new()];
        let mut allowed: [Vec<bool>; 2] = [Vec::new(), Vec::new()];
        for i in 0..=a.iters {
            // The two paths in alternating order.
            let order = if i % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for fast in order {
                let mut logits = vec![0f32; vocab];
                let t0 = std::time::Instant::now();
                jv.mask_doc_with(f, &d, &mut logits, fast);
                let us = t0.elapsed().as_secs_f64() * 1e6;
                let slot = if fast { 0 } else { 1 };
                if i > 0 {
                    times[slot].push(us);
                }
                allowed[slot] = logits.iter().map(|l| l.is_finite()).collect();
            }
        }
        anyhow::ensure!(
            allowed[0] == allowed[1],
            "{name}: the paths allow different tokens"
        );
        let n_allowed = allowed[0].iter().filter(|&&x| x).count();
        out_cases.push(serde_json::json!({"case": name, "allowed": n_allowed,
            "fast_us": median(&mut times[0]), "validator_us": median(&mut times[1])}));
    }
    let out = serde_json::json!({
        "command": crate::config::command_line(),
        "model": a.model, "vocab": vocab, "iters": a.iters, "cases": out_cases,
    });
    out!("{}", serde_json::to_string_pretty(&out)?)?;
    write_json(&a.json, &out)
}

#[derive(Args, Debug)]
pub struct SchedArgs {
    #[arg(long, default_value_t = 256)]
    pub requests: usize,
    #[arg(long, default_value_t = 16)]
    pub gamma: usize,
    #[arg(long, default_value_t = 2000, value_parser = crate::config::at_least_one)]
    pub iters: usize,
    /// SPS table (a `dspark profile` JSON); default: a synthetic 2-core-CPU-like staircase.
    #[arg(long)]
    pub sps: Option<std::path::PathBuf>,
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Decision time of the admission: `requests` × `gamma` random calibrated confidences per call,
/// on two table shapes: compute-bound (a CPU profile's shape: few drafts pay at this load) and
/// memory-bound (flat up to 1024 tokens, an accelerator's shape: most drafts are admitted, the
/// expensive case). The headline figures are the slower case.
pub fn sched_bench(a: SchedArgs) -> anyhow::Result<()> {
    use dspark_scheduler::admission::{Admission, ReqLimits, Rule, SpsTable, StepLimits};
    crate::config::check_outputs(&[a.json.as_deref()])?;
    anyhow::ensure!(
        a.requests >= 1 && a.requests <= dspark_scheduler::admission::MAX_REQUESTS,
        "--requests must be in 1..={}",
        dspark_scheduler::admission::MAX_REQUESTS
    );
    anyhow::ensure!(
        a.gamma >= 1 && a.gamma <= dspark_scheduler::admission::MAX_GAMMA,
        "--gamma must be in 1..={}",
        dspark_scheduler::admission::MAX_GAMMA
    );
    let grid = [
        1u32, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
        2048, 3072, 4096, 6144, 8192,
    ];
    let mut tables: Vec<(String, SpsTable)> = vec![
        (
            "compute-bound".into(),
            SpsTable::new(
                grid.iter()
                    .map(|&b| (b, 150.0 / (1.0 + b as f64 / 24.0)))
                    .collect(),
            )?,
        ),
        (
            "memory-bound".into(),
            SpsTable::new(
                grid.iter()
                    .map(|&b| (b, 50.0 * (1024.0 / b.max(1024) as f64)))
                    .collect(),
            )?,
        ),
    ];
    if let Some(p) = &a.sps {
        tables.push((p.display().to_string(), crate::profile::load_table(p)?));
    }
    let limits = vec![ReqLimits::default(); a.requests];
    let step = StepLimits {
        max_batch_tokens: u32::MAX,
        kv_headroom: u32::MAX,
        other_tokens: 0,
        plain_requests: 0,
    };
    let pct = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(|x, y| x.total_cmp(y));
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    let mut cases = Vec::new();
    let (mut head_med, mut head_p99) = (0f64, 0f64);
    for (name, sps) in &tables {
        let mut rng = kernels::rng::Rng::new(5);
        let mut adm = Admission::default();
        let (mut times, mut lag_times, mut chosen) = (Vec::new(), Vec::new(), 0u64);
        for _ in 0..a.iters {
            let conf: Vec<Vec<f32>> = (0..a.requests)
                .map(|_| {
                    (0..a.gamma)
                        .map(|_| (0.6 + 0.39 * rng.uniform()) as f32)
                        .collect()
                })
                .collect();
            let refs: Vec<&[f32]> = conf.iter().map(|c| c.as_slice()).collect();
            let t0 = std::time::Instant::now();
            let d = adm.decide(&refs, &limits, step, sps, Rule::Argmax);
            times.push(t0.elapsed().as_secs_f64() * 1e6);
            let k_total: u32 = d.k.iter().sum();
            chosen += k_total as u64;
            let t0 = std::time::Instant::now();
            std::hint::black_box(adm.select_top(&refs, &limits, k_total));
            lag_times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        let (med, p99) = (pct(&mut times, 0.5), pct(&mut times, 0.99));
        if med > head_med {
            (head_med, head_p99) = (med, p99);
        }
        cases.push(serde_json::json!({
            "table": name, "median_us": med, "p99_us": p99,
            "select_top_median_us": pct(&mut lag_times, 0.5),
            "mean_k_total": chosen as f64 / a.iters as f64,
        }));
    }
    let out = serde_json::json!({
        "command": crate::config::command_line(),
        "requests": a.requests,
        "gamma": a.gamma,
        "median_us": head_med,
        "p99_us": head_p99,
        "cases": cases,
    });
    out!("{}", serde_json::to_string_pretty(&out)?)?;
    write_json(&a.json, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bench accuracy` records the cache element type and the threads of the forward it
    /// tested (a tiny seeded model, a few positions).
    #[test]
    fn accuracy_records_its_cache_type_and_threads() {
        let dir = std::env::temp_dir().join(format!("dspark-acc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = dir.join("tiny.gguf");
        dspark_runtime::tiny::write_gguf(&dspark_runtime::tiny::TinySpec::llama(3), &m).unwrap();
        let g = crate::config::GlobalArgs {
            home: Some(dir.clone()),
            python: "python3".into(),
            threads: 1,
            isa: None,
            kv_cache_dtype: Some("int8v".into()),
        }
        .validate()
        .unwrap();
        let out = dir.join("acc.json");
        accuracy(
            &g,
            AccuracyArgs {
                model: m.display().to_string(),
                positions: 8,
                text: None,
                json: Some(out.clone()),
            },
        )
        .unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(v["kv_cache_dtype"], "int8v", "{v}");
        assert_eq!(v["reference_kv_cache_dtype"], "f32", "{v}");
        assert_eq!(v["threads"], 1, "{v}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn held_out_prompt_sets_are_distinct_from_every_other_set() {
        let mut seen = std::collections::HashSet::new();
        for set in prompt_sets("all")
            .into_iter()
            .chain(prompt_sets("all-heldout"))
            .chain(prompt_sets("all-calib"))
        {
            let prompts = prompt_set(set).expect("a shipped set");
            assert!(prompts.len() >= 32, "{set}: {} prompts", prompts.len());
            for p in prompts {
                assert!(seen.insert(p.clone()), "`{p}` appears twice ({set})");
            }
        }
        assert_eq!(prompt_set("all-heldout").unwrap().len(), 3 * 144);
        assert_eq!(prompt_set("all-calib").unwrap().len(), 3 * 96);
        assert_eq!(prompt_sets("code-heldout"), vec!["code-heldout"]);
        let err = prompt_set("poetry").unwrap_err().to_string();
        assert!(err.contains("chat-heldout"), "{err}");
    }

    #[test]
    fn medians_average_the_two_middle_values_of_an_even_count() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(stats(vec![5.0, 1.0, 4.0, 2.0]), (3.0, 1.0));
    }

    #[test]
    fn provenance_gives_the_absolute_output_and_a_commit_or_null() {
        let v = provenance(std::path::Path::new("some-dir/result.json"));
        let out = v["output"].as_str().expect("a path");
        assert!(
            std::path::Path::new(out).is_absolute() && out.ends_with("result.json"),
            "{v}"
        );
        match v["commit"].as_str() {
            Some(c) => {
                assert!(
                    c.len() >= 40 && c.chars().all(|x| x.is_ascii_hexdigit()),
                    "{v}"
                );
                assert!(v["dirty"].is_boolean() || v["dirty"].is_null(), "{v}");
            }
            None => assert!(v["commit"].is_null() && v["dirty"].is_null(), "{v}"),
        }
    }

    #[test]
    fn verify_curve_ratios_are_to_the_smallest_k_listed() {
        assert_eq!(k_list(&[8, 2, 4, 2]).unwrap(), vec![2, 4, 8]);
        assert_eq!(k_list(&[1, 2, 3, 4, 6, 8]).unwrap()[0], 1);
        let e = k_list(&[0, 1]).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
    }
}
