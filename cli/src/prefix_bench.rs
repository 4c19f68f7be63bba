//! `dspark bench prefix`: what automatic prefix caching buys a chat workload whose requests
//! share a system prompt. Both arms (cache off, cache on) run the same requests in the same
//! order, closed loop at a fixed concurrency, on fresh engines each round, the arms' order
//! shuffled per round; greedy outputs must be identical across arms (the command fails
//! otherwise).

use crate::bench::{command_line, prompt_set, write_json};
use crate::config::Global;
use crate::plot::{Series, line_chart};
use kernels::rng::Rng;
use specdec::proposer::NoProposer;
use specdec::{Engine, Event, Request};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct PrefixArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Lengths (tokens, at least) of the system prompt every request shares; 0: none.
    #[arg(long, value_delimiter = ',', default_value = "0,256,1024")]
    pub system_tokens: Vec<usize>,
    /// User messages: chat | code | math.
    #[arg(long, default_value = "chat")]
    pub prompts: String,
    /// Requests per arm and round.
    #[arg(long, default_value_t = 24)]
    pub requests: usize,
    /// Requests in flight at once (closed loop).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// One arm's run of the workload.
struct Run {
    wall_s: f64,
    ttft_s: Vec<f64>,
    completion: usize,
    prompt: usize,
    cached: usize,
    outputs: HashMap<u64, Vec<u32>>,
}

fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// Runs `reqs` closed loop, `concurrency` at a time.
fn run_arm(e: &mut Engine, reqs: &[Vec<u32>], a: &PrefixArgs) -> anyhow::Result<Run> {
    let mut queue: VecDeque<(u64, &Vec<u32>)> = reqs
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64, p))
        .collect();
    let mut in_flight = 0;
    let mut r = Run {
        wall_s: 0.0,
        ttft_s: Vec::new(),
        completion: 0,
        prompt: 0,
        cached: 0,
        outputs: HashMap::new(),
    };
    let t0 = Instant::now();
    loop {
        while in_flight < a.concurrency {
            let Some((id, p)) = queue.pop_front() else {
                break;
            };
            e.add(Request::new(id, p.clone(), a.max_tokens))?;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        for ev in e.step()? {
            match ev {
                Event::Tokens { id, tokens, .. } => {
                    r.outputs.entry(id).or_default().extend(tokens);
                }
                Event::Failed { id, error } => anyhow::bail!("request {id} failed: {error}"),
                Event::Finished { metrics, .. } => {
                    in_flight -= 1;
                    r.ttft_s.push(metrics.ttft_s);
                    r.completion += metrics.completion_tokens;
                    r.prompt += metrics.prompt_tokens;
                    r.cached += metrics.cached_tokens;
                }
            }
        }
    }
    r.wall_s = t0.elapsed().as_secs_f64();
    e.check_kv()?;
    Ok(r)
}

/// A system prompt of at least `n` tokens: instructions, then example questions of the set.
fn system_prompt(tok: &dspark_runtime::Tokenizer, n: usize, examples: &[String]) -> String {
    if n == 0 {
        return String::new();
    }
    let mut s = String::from(
        "You are a careful assistant for a team of engineers. Answer in plain English, keep \
         answers short, show the steps of any arithmetic and never invent references. Questions \
         this team has asked before:\n",
    );
    for ex in examples.iter().cycle() {
        if tok.encode(&s).map(|t| t.len()).unwrap_or(usize::MAX) >= n {
            break;
        }
        s.push_str("- ");
        s.push_str(ex);
        s.push('\n');
    }
    s
}

pub fn run(g: &Global, a: PrefixArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref(), a.plot.as_deref()])?;
    anyhow::ensure!(
        a.requests >= 1 && a.concurrency >= 1 && a.rounds >= 1 && a.max_tokens >= 1,
        "--requests, --concurrency, --rounds and --max-tokens take values ≥ 1"
    );
    anyhow::ensure!(!a.system_tokens.is_empty(), "--system-tokens is empty");
    let target = crate::spec::load_target(g, &a.model)?;
    // The system prompt is grown a question at a time; one past the context would take hours
    // to build before the engine refused it.
    if let Some(&n) = a
        .system_tokens
        .iter()
        .find(|&&n| n >= target.model.cfg.max_ctx)
    {
        anyhow::bail!(
            "--system-tokens {n} is not below the model's context of {} tokens",
            target.model.cfg.max_ctx
        );
    }
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(&target.tok)?;
    let questions = prompt_set(&a.prompts)?;
    anyhow::ensure!(!questions.is_empty(), "prompt set `{}` is empty", a.prompts);
    // Example questions in the system prompt come from the end of the set, the user messages
    // from its start.
    let examples: Vec<String> = questions.iter().rev().take(64).cloned().collect();
    out!(
        "{:>8} {:>4} {:>9} {:>10} {:>10} {:>9} {:>8}",
        "system",
        "arm",
        "prompt",
        "ttft p50",
        "ttft p90",
        "tok/s",
        "cached"
    )?;
    let mut points = Vec::new();
    let mut paired = Vec::new();
    let mut rng = Rng::new(0x9ef1);
    for &sys_n in &a.system_tokens {
        let system = system_prompt(&target.tok, sys_n, &examples);
        let reqs: Vec<Vec<u32>> = (0..a.requests)
            .map(|i| {
                let q = &questions[i % questions.len()];
                let mut msgs = Vec::new();
                if !system.is_empty() {
                    msgs.push(dspark_runtime::chat::Message::new("system", &system));
                }
                msgs.push(dspark_runtime::chat::Message::new("user", q));
                Ok(target.tok.encode(&tmpl.render(&msgs, true)?)?)
            })
            .collect::<anyhow::Result<_>>()?;
        let longest = reqs.iter().map(|r| r.len()).max().unwrap_or(0);
        let kv = a.concurrency * (longest + a.max_tokens + 64) + 2 * longest + 1024;
        let mut runs: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
        for _round in 0..a.rounds {
            let mut order = [0usize, 1];
            if rng.below(2) == 1 {
                order.swap(0, 1);
            }
            for arm in order {
                let mut cfg = drafter::build::engine_config(&target.model, 0, false, a.concurrency);
                cfg.kv_tokens = kv;
                cfg.prefix_caching = arm == 1;
                let mut e = Engine::new(
                    target.model.clone(),
                    Some(target.tok.clone()),
                    Box::new(NoProposer),
                    cfg,
                )?;
                // Warm up on an unrelated prompt (the system prompt stays uncached).
                e.add(Request::new(
                    u64::MAX,
                    target.tok.encode("Hello there.")?,
                    4,
                ))?;
                e.run_to_completion()?;
                runs[arm].push(run_arm(&mut e, &reqs, &a)?);
            }
        }
        // Lossless: the cache changes no output.
        for (off, on) in runs[0].iter().zip(&runs[1]) {
            anyhow::ensure!(
                off.outputs == on.outputs,
                "greedy outputs differ with the prefix cache (system prompt {sys_n} tokens)"
            );
        }
        let mut summary = Vec::new();
        for (arm, name) in ["off", "on"].iter().enumerate() {
            let rs = &runs[arm];
            let ttft: Vec<f64> = rs.iter().flat_map(|r| r.ttft_s.iter().copied()).collect();
            let completion: usize = rs.iter().map(|r| r.completion).sum();
            let wall: f64 = rs.iter().map(|r| r.wall_s).sum();
            let prompt: usize = rs.iter().map(|r| r.prompt).sum();
            let cached: usize = rs.iter().map(|r| r.cached).sum();
            let (p50, p90) = (quantile(&ttft, 0.5), quantile(&ttft, 0.9));
            let tok_s = completion as f64 / wall.max(1e-9);
            let prompt_mean = prompt as f64 / (a.requests * a.rounds) as f64;
            out!(
                "{:>8} {:>4} {:>9.0} {:>8.1}ms {:>8.1}ms {:>9.1} {:>7.1}%",
                sys_n,
                name,
                prompt_mean,
                p50 * 1e3,
                p90 * 1e3,
                tok_s,
                100.0 * cached as f64 / prompt.max(1) as f64
            )?;
            summary.push((p50, tok_s));
            points.push(serde_json::json!({
                "system_tokens": sys_n, "arm": name, "prompt_tokens_mean": prompt_mean,
                "ttft_p50_ms": p50 * 1e3, "ttft_p90_ms": p90 * 1e3, "tok_s": tok_s,
                "cached_fraction": cached as f64 / prompt.max(1) as f64,
                "requests": ttft.len(), "wall_s": wall,
            }));
        }
        // Per round, on against off (same requests, same minutes of this machine).
        let ratio = |f: &dyn Fn(&Run) -> f64| -> Vec<f64> {
            runs[1]
                .iter()
                .zip(&runs[0])
                .map(|(on, off)| f(on) / f(off).max(1e-12))
                .collect()
        };
        paired.push(serde_json::json!({
            "system_tokens": sys_n,
            "ttft_p50_ratio_per_round": ratio(&|r: &Run| quantile(&r.ttft_s, 0.5)),
            "tok_s_ratio_per_round": ratio(&|r: &Run| r.completion as f64 / r.wall_s),
            "ttft_p50_ratio": summary[1].0 / summary[0].0.max(1e-12),
            "tok_s_ratio": summary[1].1 / summary[0].1.max(1e-12),
        }));
    }
    write_json(
        &a.json,
        &serde_json::json!({
            "model": a.model, "prompts": a.prompts, "requests": a.requests,
            "concurrency": a.concurrency, "max_tokens": a.max_tokens, "rounds": a.rounds,
            "threads": target.model.threads(), "command": command_line(),
            "greedy_outputs_identical": true, "points": points, "paired": paired,
        }),
    )?;
    if let Some(p) = &a.plot {
        let series: Vec<Series> = ["off", "on"]
            .iter()
            .map(|arm| Series {
                name: format!("prefix cache {arm}"),
                points: points
                    .iter()
                    .filter(|p| p["arm"] == *arm)
                    .map(|p| {
                        (
                            p["system_tokens"].as_f64().unwrap_or(0.0),
                            p["ttft_p50_ms"].as_f64().unwrap_or(0.0),
                        )
                    })
                    .collect(),
            })
            .collect();
        let svg = line_chart(
            &format!(
                "{}: median TTFT, shared system prompt, concurrency {}",
                a.model, a.concurrency
            ),
            "system prompt tokens",
            "TTFT p50 (ms)",
            &series,
        );
        std::fs::write(p, svg)?;
    }
    Ok(())
}
