//! `dspark bench tp`: the target's forward split over 1, 2, 3… tensor-parallel ranks, side by
//! side in one run. Ranks 1.. run on threads of this process behind the same loopback TCP links
//! a `dspark tp-shard` serves, so the time includes the per-layer exchanges; the cores are
//! shared among the ranks. Each degree also decodes one prompt greedily, compared with the
//! whole model's tokens.

use crate::bench::{command_line, filler, prefilled, write_json};
use crate::config::Global;
use clap::Args;
use dspark_runtime::generate::{GenerateParams, generate};
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use dspark_runtime::tp::{self, TpOptions};
use dspark_runtime::{LoadOptions, Model, Tokenizer};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct TpArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Tensor-parallel degrees compared (each divides the model's KV heads, or is a multiple
    /// of them dividing its query heads).
    #[arg(long, value_delimiter = ',', default_value = "1,3", value_parser = crate::config::at_least_one)]
    pub degrees: Vec<usize>,
    /// Sequences per forward, one new token each (decode steps), at `--ctx` tokens of context.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32", value_parser = crate::config::at_least_one)]
    pub batch: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    pub ctx: usize,
    /// Forwards timed per degree, batch and round.
    #[arg(long, default_value_t = 8)]
    pub reps: usize,
    /// Rounds over all degrees in turn (so a busy spell of the machine hits them alike).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Tokens decoded greedily per degree for the agreement check.
    #[arg(long, default_value_t = 32, value_parser = crate::config::at_least_one)]
    pub tokens: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One degree's rank 0 (with its ranks served on threads).
struct Split {
    degree: usize,
    threads: usize,
    model: Model,
}

fn split(path: &std::path::Path, g: &Global, degree: usize) -> anyhow::Result<Split> {
    let threads = (g.effective_threads() / degree).max(1);
    let opts = |tp| LoadOptions {
        threads,
        tp,
        ..g.load_opts()
    };
    let mut peers = Vec::new();
    for r in 1..degree {
        let m = Arc::new(Model::load(path, &opts(Some(TpOptions::shard(r, degree))))?);
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        peers.push(l.local_addr()?.to_string());
        std::thread::spawn(move || tp::serve(m, l));
    }
    let tp = (degree > 1).then(|| TpOptions::leader(peers));
    Ok(Split {
        degree,
        threads,
        model: Model::load(path, &opts(tp))?,
    })
}

pub fn run(g: &Global, a: TpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.degrees.is_empty() && !a.batch.is_empty() && a.reps > 0 && a.rounds > 0,
        "--degrees, --batch, --reps and --rounds must not be empty or zero"
    );
    crate::config::check_outputs(&[a.json.as_deref()])?;
    let path = g.resolve_model(&a.model)?;
    let tok = Tokenizer::load(&path)?;
    let splits = a
        .degrees
        .iter()
        .map(|&d| split(&path, g, d))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cfg = splits[0].model.cfg.clone();
    let max_b = a.batch.iter().copied().max().unwrap_or(1);
    let mut caches = splits
        .iter()
        .map(|s| prefilled(&s.model, a.ctx, max_b, 1))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // times[split][batch] in ms.
    let mut times = vec![vec![Vec::new(); a.batch.len()]; splits.len()];
    for _ in 0..a.rounds {
        for (si, s) in splits.iter().enumerate() {
            let (cache, seqs) = &mut caches[si];
            for (bi, &b) in a.batch.iter().enumerate() {
                let toks: Vec<Vec<u32>> =
                    (0..b).map(|i| filler(1, cfg.vocab_size, i + 3)).collect();
                for rep in 0..=a.reps {
                    let inputs: Vec<SeqInput<'_>> = seqs[..b]
                        .iter()
                        .zip(&toks)
                        .map(|(&seq, t)| SeqInput {
                            seq,
                            tokens: t,
                            logits: LogitsMode::Last,
                        })
                        .collect();
                    let t0 = Instant::now();
                    let out = s
                        .model
                        .forward(cache, &inputs, &ForwardOptions::default())?;
                    let dt = t0.elapsed().as_secs_f64() * 1000.0;
                    s.model.recycle(out);
                    for &seq in &seqs[..b] {
                        cache.truncate(seq, a.ctx)?;
                    }
                    // The first of each series warms the caches and links.
                    if rep > 0 {
                        times[si][bi].push(dt);
                    }
                }
            }
        }
    }
    let prompt = tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n")?;
    let p = GenerateParams {
        max_tokens: a.tokens,
        ..Default::default()
    };
    let answers = splits
        .iter()
        .map(|s| Ok(generate(&s.model, &tok, &prompt, &p, &mut |_| {})?.token_ids))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let whole = splits.iter().position(|s| s.degree == 1);
    out!(
        "{:>6} {:>8} {:>6} {:>10} {:>10} {:>14}",
        "degree",
        "threads",
        "batch",
        "ms_median",
        "ms_min",
        "link_kB/fwd"
    )?;
    let mut points = Vec::new();
    for (si, s) in splits.iter().enumerate() {
        for (bi, &b) in a.batch.iter().enumerate() {
            let mut v = times[si][bi].clone();
            v.sort_by(|x, y| x.total_cmp(y));
            let (med, min) = (v[v.len() / 2], v[0]);
            // Per layer: normalized rows out and a partial sum back, twice, per other rank.
            let link = 4 * cfg.n_layers * b * cfg.d_model * 4 * (s.degree - 1);
            out!(
                "{:>6} {:>8} {:>6} {med:>10.2} {min:>10.2} {:>14.1}",
                s.degree,
                s.threads,
                b,
                link as f64 / 1000.0
            )?;
            points.push(serde_json::json!({
                "degree": s.degree, "threads_per_rank": s.threads, "batch": b,
                "median_ms": med, "min_ms": min, "samples": v.len(),
                "link_bytes_per_forward": link,
            }));
        }
    }
    let greedy: Vec<serde_json::Value> = splits
        .iter()
        .zip(&answers)
        .map(|(s, ids)| {
            let same = whole.map(|w| answers[w] == *ids);
            out!(
                "degree {}: {} greedy tokens{}",
                s.degree,
                ids.len(),
                match same {
                    Some(true) => ", the same as the whole model's",
                    Some(false) => ", NOT the same as the whole model's",
                    None => "",
                }
            )
            .ok();
            serde_json::json!({"degree": s.degree, "tokens": ids.len(),
                               "equal_to_whole_model": same})
        })
        .collect();
    write_json(
        &a.json,
        &serde_json::json!({
            "command": command_line(),
            "model": a.model,
            "cpu": kernels::cpu_model(),
            "threads_total": g.effective_threads(),
            "ctx": a.ctx,
            "reps": a.reps,
            "rounds": a.rounds,
            "points": points,
            "greedy": greedy,
        }),
    )
}

#[cfg(test)]
mod tests {
    /// `--tokens 0` has no agreement to check: refused at parse, before the rounds are timed.
    #[test]
    fn zero_agreement_tokens_are_refused_at_parse() {
        let parse = |n: &str| {
            crate::parse_from(["dspark", "bench", "tp", "--tokens", n]).map(|c| match c.cmd {
                crate::Command::Bench(crate::bench::BenchCmd::Tp(t)) => t.tokens,
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(parse("1").expect("parsed"), 1);
        let e = parse("0").expect_err("refused").to_string();
        assert!(e.contains("--tokens") && e.contains("at least 1"), "{e}");
    }
}
