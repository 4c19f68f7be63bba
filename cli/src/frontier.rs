//! `dspark bench frontier`: throughput against interactivity as concurrency grows, for no
//! speculation, fixed draft lengths and the hardware-aware scheduler, in one run on the same
//! prompts. Writes `{"points":[{"arm","concurrency","tok_s","user_tok_s","committed_per_call"}]}`
//! and an SVG of total tokens/s against per-user tokens/s.

use crate::config::Global;
use clap::Args;
use serde_json::json;
use specdec::{Event, ProposerKind, Request};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct FrontierArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub target: String,
    /// Drafter for the speculative arms: dspark[:DIR] (the shipped one by default), ngram, ...
    #[arg(long, default_value = "dspark")]
    pub drafter: String,
    #[arg(long, default_value = "code")]
    pub prompts: String,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub concurrency: Vec<usize>,
    /// Fixed draft lengths (gate off).
    #[arg(long, value_delimiter = ',', default_value = "1,3,7")]
    pub gammas: Vec<usize>,
    /// Longest block the scheduler arm may verify.
    #[arg(long, default_value_t = 7)]
    pub max_gamma: usize,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Each request's answer length is `--max-tokens` × a factor in [1 − s, 1 + s], fixed per
    /// request (the same in every arm). With one length for all, a wave of requests runs in
    /// lockstep under plain decoding and the next wave's prefill never overlaps anyone's
    /// decoding, while any speculation breaks the lockstep: the benchmark would charge
    /// speculation for prefill interference that real traffic gives every arm.
    #[arg(long, default_value_t = 0.5)]
    pub length_spread: f64,
    /// Requests per point, as a multiple of the concurrency.
    #[arg(long, default_value_t = 2)]
    pub waves: usize,
    /// At least this many timed requests per point, whatever the concurrency: at c = 1 a few
    /// short answers last a fraction of a second, which this machine's noise swamps.
    #[arg(long, default_value_t = 16)]
    pub min_requests: usize,
    /// Untimed requests each arm serves before it is timed (default: one wave, `c`), as a
    /// benchmark of a long-running server would: the scheduler's running estimates start from
    /// its prior, and the first steps warm caches and threads.
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Measure every arm this many times per concurrency, each round in a shuffled order (so no
    /// arm always follows the same one), and report each arm's median round: this machine's
    /// noise moves whole seconds, arms must share it.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Pause before each arm (milliseconds).
    #[arg(long, default_value_t = 500)]
    pub settle_ms: u64,
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

pub fn run(g: &Global, a: FrontierArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.concurrency.is_empty() && a.concurrency.iter().all(|&c| c >= 1),
        "--concurrency takes values ≥ 1"
    );
    anyhow::ensure!(
        a.gammas
            .iter()
            .chain([&a.max_gamma])
            .all(|&x| (1..=specdec::MAX_GAMMA).contains(&x)),
        "draft lengths must be in 1..={}",
        specdec::MAX_GAMMA
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&a.length_spread),
        "--length-spread takes a value in [0, 1)"
    );
    let kind = ProposerKind::parse(&a.drafter, crate::spec::default_draft_for(&a.target))?;
    let target = crate::spec::load_target(g, &a.target)?;
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(&target.tok)?;
    let prompts = crate::bench::prompt_set(&a.prompts)?;
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            Ok(target
                .tok
                .encode(&tmpl.render(&[dspark_runtime::chat::Message::new("user", p)], true)?)?)
        })
        .collect::<anyhow::Result<_>>()?;
    let sps = crate::spec::sps_profile(g, &a.target, &target)?;
    // (arm name, proposer kind, gamma, scheduler on)
    let mut arms: Vec<(String, ProposerKind, usize, bool)> =
        vec![("none".into(), ProposerKind::None, 0, false)];
    for &gm in &a.gammas {
        arms.push((format!("fixed-{gm}"), kind.clone(), gm, false));
    }
    arms.push(("scheduler".into(), kind.clone(), a.max_gamma, true));
    let mut drafts = crate::spec::DraftCache::default();
    let mut points = Vec::new();
    println!(
        "{:<12} {:>5} {:>9} {:>11} {:>9} {:>8}",
        "arm", "conc", "tok/s", "user tok/s", "per_call", "ttft ms"
    );
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let mut paired = Vec::new();
    // Concurrency outside, arms inside: every arm of a concurrency is measured back to back, so
    // a slow spell of the machine does not land on one arm only.
    anyhow::ensure!(a.rounds >= 1, "--rounds takes a value ≥ 1");
    for &c in &a.concurrency {
        let mut measured: Vec<Vec<serde_json::Value>> = vec![Vec::new(); arms.len()];
        for round in 0..a.rounds {
            for ai in arm_order(arms.len(), (c as u64) << 16 | round as u64) {
                // Let the previous arm's after-effects (freed memory, sleeping threads) settle.
                std::thread::sleep(std::time::Duration::from_millis(a.settle_ms));
                let (name, k, gm, sched) = &arms[ai];
                let proposer = crate::spec::build_proposer(g, k, &target, &mut drafts)?;
                let mut e = crate::spec::engine(&target, proposer, (*gm).max(1), false, max_c)?;
                if *sched {
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
                let warm = a.warmup.unwrap_or(c);
                let lengths = Lengths {
                    max_tokens: a.max_tokens,
                    spread: a.length_spread,
                };
                serve(&mut e, &ids, 0, warm, c, lengths)?;
                let (tokens0, calls0) = (e.totals().completion_tokens, e.totals().target_calls);
                let n = (c * a.waves).max(a.min_requests).max(1);
                let t0 = Instant::now();
                let (out_tokens, user, ttft) = serve(&mut e, &ids, warm, n, c, lengths)?;
                let wall = t0.elapsed().as_secs_f64();
                let tok_s = out_tokens as f64 / wall;
                let user_tok_s = if user.is_empty() {
                    0.0
                } else {
                    user.iter().sum::<f64>() / user.len() as f64
                };
                let ttft_ms = 1e3 * ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
                let t = e.totals();
                let calls = t.target_calls - calls0;
                // Tokens after each request's first (its prefill's) per target call after prefill:
                // 1.00 for plain decoding.
                let per_call = if calls == 0 {
                    1.0
                } else {
                    (t.completion_tokens - tokens0).saturating_sub(n) as f64 / calls as f64
                };
                if a.rounds > 1 {
                    eprintln!("  round {round}: {name} c{c} {tok_s:.1} tok/s");
                }
                measured[ai].push(
                    json!({"arm": name, "concurrency": c, "tok_s": tok_s, "user_tok_s": user_tok_s,
                "committed_per_call": per_call, "requests": n, "wall_s": wall, "ttft_ms": ttft_ms}),
                );
            }
        }
        // Rounds interleave the arms, so round i of two arms ran close in time: their ratio is a
        // paired sample, and its spread says how much of a difference the machine's noise makes.
        let rounds_of = |i: usize| -> Vec<f64> {
            measured[i]
                .iter()
                .map(|q| q["tok_s"].as_f64().unwrap_or(0.0))
                .collect()
        };
        if let Some((ratio, lo, hi)) = paired_ratio(&rounds_of(arms.len() - 1), &rounds_of(0)) {
            paired.push(json!({"concurrency": c, "ratio": ratio, "ci95": [lo, hi]}));
        }
        for m in measured {
            let mut p = median_round(&m);
            let (name, tok_s, user_tok_s, per_call) = (
                p["arm"].as_str().unwrap_or("").to_string(),
                p["tok_s"].as_f64().unwrap_or(0.0),
                p["user_tok_s"].as_f64().unwrap_or(0.0),
                p["committed_per_call"].as_f64().unwrap_or(0.0),
            );
            let ttft = p["ttft_ms"].as_f64().unwrap_or(0.0);
            println!(
                "{name:<12} {c:>5} {tok_s:>9.1} {user_tok_s:>11.1} {per_call:>9.2} {ttft:>8.1}"
            );
            p["rounds_tok_s"] = json!(m.iter().map(|q| q["tok_s"].clone()).collect::<Vec<_>>());
            points.push(p);
        }
    }
    let checks = criteria(&points);
    println!(
        "scheduler ≥ none at every concurrency: {}; scheduler above every fixed γ at equal per-user tok/s: {}",
        checks["never_below_none"], checks["above_every_fixed_gamma"]
    );
    for q in &paired {
        println!(
            "scheduler / none at c{}: {:.3} (paired rounds, 95 % interval {:.3}–{:.3})",
            q["concurrency"],
            q["ratio"].as_f64().unwrap_or(f64::NAN),
            q["ci95"][0].as_f64().unwrap_or(f64::NAN),
            q["ci95"][1].as_f64().unwrap_or(f64::NAN)
        );
    }
    let v = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "target": a.target, "drafter": kind.label(), "prompts": a.prompts, "max_tokens": a.max_tokens,
        "length_spread": a.length_spread, "rounds": a.rounds,
        "threads": target.model.threads(), "sps_table": sps.points, "points": points,
        "checks": checks, "paired_vs_none": paired,
    });
    if let Some(p) = &a.json {
        if let Some(d) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d)?;
        }
        std::fs::write(p, serde_json::to_string_pretty(&v)?)?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &a.plot {
        let series: Vec<crate::plot::Series> = arms
            .iter()
            .map(|(name, ..)| crate::plot::Series {
                name: name.clone(),
                points: v["points"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|q| q["arm"] == name.as_str())
                    .map(|q| {
                        (
                            q["user_tok_s"].as_f64().unwrap_or(0.0),
                            q["tok_s"].as_f64().unwrap_or(0.0),
                        )
                    })
                    .collect(),
            })
            .collect();
        std::fs::write(
            p,
            crate::plot::line_chart(
                &format!(
                    "{} · {} · throughput vs interactivity",
                    a.target,
                    kind.label()
                ),
                "per-user tokens/s",
                "total tokens/s",
                &series,
            ),
        )?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// Answer lengths: `max_tokens` scaled per request by a factor in [1 − spread, 1 + spread].
#[derive(Clone, Copy)]
struct Lengths {
    max_tokens: usize,
    spread: f64,
}

impl Lengths {
    /// Request `id`'s length: a function of the id only, so every arm serves the same lengths.
    fn of(&self, id: usize) -> usize {
        let u = kernels::rng::Rng::new(0x1e9 ^ (id as u64).wrapping_mul(0x9e37_79b9)).uniform();
        let f = 1.0 - self.spread + 2.0 * self.spread * u;
        ((self.max_tokens as f64 * f).round() as usize).max(2)
    }
}

/// Serves requests `first..first + n` (prompts taken round-robin) at concurrency `c` to the end;
/// returns the tokens streamed and each multi-token request's decode rate (tokens after the
/// first over the time after it) and time to first token.
fn serve(
    e: &mut specdec::Engine,
    ids: &[Vec<u32>],
    first: usize,
    n: usize,
    c: usize,
    lengths: Lengths,
) -> anyhow::Result<(usize, Vec<f64>, Vec<f64>)> {
    let (mut next, mut in_flight, mut out_tokens) = (0usize, 0usize, 0usize);
    let (mut user, mut ttft) = (Vec::new(), Vec::new());
    while next < n || in_flight > 0 {
        while in_flight < c && next < n {
            let id = first + next;
            e.add(Request::new(
                id as u64,
                ids[id % ids.len()].clone(),
                lengths.of(id),
            ))?;
            next += 1;
            in_flight += 1;
        }
        for ev in e.step()? {
            match ev {
                Event::Tokens { tokens, .. } => out_tokens += tokens.len(),
                Event::Finished { metrics, .. } => {
                    in_flight -= 1;
                    ttft.push(metrics.ttft_s);
                    let dt = metrics.e2e_s - metrics.ttft_s;
                    if metrics.completion_tokens > 1 && dt > 0.0 {
                        user.push((metrics.completion_tokens - 1) as f64 / dt);
                    }
                }
            }
        }
    }
    Ok((out_tokens, user, ttft))
}

/// Geometric mean of the paired ratios a_i / b_i and its 95 % t-interval (on the log ratios);
/// `None` for fewer than two pairs or a non-positive value.
pub(crate) fn paired_ratio(a: &[f64], b: &[f64]) -> Option<(f64, f64, f64)> {
    // Two-sided 95 % Student t quantiles for 1..=10 degrees of freedom, then the normal's.
    const T95: [f64; 10] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    ];
    let n = a.len().min(b.len());
    if n < 2 || a.iter().chain(b).any(|&x| x.is_nan() || x <= 0.0) {
        return None;
    }
    let l: Vec<f64> = a.iter().zip(b).map(|(x, y)| (x / y).ln()).collect();
    let mean = l.iter().sum::<f64>() / n as f64;
    let var = l.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = T95.get(n - 2).copied().unwrap_or(1.96);
    let half = t * (var / n as f64).sqrt();
    Some((mean.exp(), (mean - half).exp(), (mean + half).exp()))
}

/// A seeded shuffle of 0..n: the order of the arms in one round.
pub(crate) fn arm_order(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = kernels::rng::Rng::new(seed ^ 0x5eed_f00d);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i + 1);
        v.swap(i, j);
    }
    v
}

/// The round whose total tokens/s is the median of an arm's rounds (the lower middle one for an
/// even count), whole, so its per-user tokens/s and tokens per call stay consistent with it.
pub(crate) fn median_round(rounds: &[serde_json::Value]) -> serde_json::Value {
    let mut v: Vec<&serde_json::Value> = rounds.iter().collect();
    v.sort_by(|a, b| {
        let t = |x: &serde_json::Value| x["tok_s"].as_f64().unwrap_or(0.0);
        t(a).total_cmp(&t(b))
    });
    v.get(v.len().saturating_sub(1) / 2)
        .map(|x| (*x).clone())
        .unwrap_or_default()
}

/// Total tokens/s of a curve at per-user tokens/s `u`, by linear interpolation between its
/// measured points (`None` outside their range).
fn interpolate(curve: &[(f64, f64)], u: f64) -> Option<f64> {
    let mut c = curve.to_vec();
    c.sort_by(|a, b| a.0.total_cmp(&b.0));
    c.windows(2).find_map(|w| {
        let ((u0, t0), (u1, t1)) = (w[0], w[1]);
        (u0 <= u && u <= u1).then(|| {
            if u1 > u0 {
                t0 + (t1 - t0) * (u - u0) / (u1 - u0)
            } else {
                t0.max(t1)
            }
        })
    })
}

/// The two frontier criteria, from the measured points: the scheduler arm is never below
/// no speculation at the same concurrency, and at equal per-user tokens/s (each fixed-γ curve
/// interpolated at the scheduler's points, where it reaches them) it gives more total tokens/s.
pub fn criteria(points: &[serde_json::Value]) -> serde_json::Value {
    let arm = |name: &str| -> Vec<(usize, f64, f64)> {
        points
            .iter()
            .filter(|p| p["arm"] == name)
            .map(|p| {
                (
                    p["concurrency"].as_u64().unwrap_or(0) as usize,
                    p["user_tok_s"].as_f64().unwrap_or(0.0),
                    p["tok_s"].as_f64().unwrap_or(0.0),
                )
            })
            .collect()
    };
    let sched = arm("scheduler");
    let none = arm("none");
    let mut below_none = Vec::new();
    for &(c, _, t) in &sched {
        if let Some(&(_, _, tn)) = none.iter().find(|x| x.0 == c) {
            if t < tn {
                below_none.push(json!({"concurrency": c, "scheduler": t, "none": tn}));
            }
        }
    }
    let mut fixed_names: Vec<String> = points
        .iter()
        .filter_map(|p| p["arm"].as_str())
        .filter(|n| n.starts_with("fixed-"))
        .map(|n| n.to_string())
        .collect();
    // Points come concurrency by concurrency, so the same arm recurs: sort, then dedup.
    fixed_names.sort();
    fixed_names.dedup();
    let mut below_fixed = Vec::new();
    let mut compared = 0;
    for f in &fixed_names {
        let curve: Vec<(f64, f64)> = arm(f).iter().map(|x| (x.1, x.2)).collect();
        for &(c, u, t) in &sched {
            if let Some(tf) = interpolate(&curve, u) {
                compared += 1;
                if t <= tf {
                    below_fixed.push(json!({"arm": f, "concurrency": c, "user_tok_s": u, "scheduler": t, "fixed": tf}));
                }
            }
        }
    }
    json!({
        "never_below_none": below_none.is_empty() && !sched.is_empty(),
        "below_none": below_none,
        "above_every_fixed_gamma": below_fixed.is_empty() && compared > 0,
        "comparisons_with_fixed": compared,
        "below_fixed": below_fixed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(arm: &str, c: usize, u: f64, t: f64) -> serde_json::Value {
        json!({"arm": arm, "concurrency": c, "user_tok_s": u, "tok_s": t})
    }

    #[test]
    fn answer_lengths_spread_around_the_maximum_and_repeat_per_request() {
        let l = Lengths {
            max_tokens: 32,
            spread: 0.5,
        };
        let v: Vec<usize> = (0..200).map(|i| l.of(i)).collect();
        assert!(v.iter().all(|&x| (16..=48).contains(&x)), "{v:?}");
        assert!(v.iter().any(|&x| x < 24) && v.iter().any(|&x| x > 40));
        assert_eq!(v, (0..200).map(|i| l.of(i)).collect::<Vec<_>>());
        let fixed = Lengths {
            max_tokens: 32,
            spread: 0.0,
        };
        assert!((0..50).all(|i| fixed.of(i) == 32));
    }

    #[test]
    fn criteria_compare_at_equal_concurrency_and_equal_interactivity() {
        // Concurrency by concurrency, as a run writes them.
        let mut pts = vec![
            pt("none", 1, 100.0, 100.0),
            pt("fixed-3", 1, 120.0, 120.0),
            pt("scheduler", 1, 125.0, 125.0),
            pt("none", 8, 20.0, 160.0),
            pt("fixed-3", 8, 15.0, 120.0),
            pt("scheduler", 8, 21.0, 168.0),
        ];
        let c = criteria(&pts);
        assert_eq!(c["never_below_none"], true);
        assert_eq!(c["above_every_fixed_gamma"], true);
        // Each (fixed arm, scheduler point) pair is compared once, although fixed-3 recurs with
        // other arms between: only the c = 8 point (21 user tok/s) lies on fixed-3's curve.
        assert_eq!(c["comparisons_with_fixed"], 1);
        // fixed-3 interpolated at 21 user tok/s: 120 + 0 … the scheduler's 168 beats it; now make
        // the scheduler's high-concurrency point worse than both.
        pts[5] = pt("scheduler", 8, 21.0, 100.0);
        let c = criteria(&pts);
        assert_eq!(c["never_below_none"], false);
        assert_eq!(c["above_every_fixed_gamma"], false);
        assert!(interpolate(&[(10.0, 100.0), (20.0, 200.0)], 15.0) == Some(150.0));
        assert!(interpolate(&[(10.0, 100.0), (20.0, 200.0)], 25.0).is_none());
    }

    #[test]
    fn paired_ratios_give_a_geometric_mean_and_an_interval() {
        let (r, lo, hi) = paired_ratio(&[110.0, 99.0, 121.0], &[100.0, 90.0, 110.0]).unwrap();
        assert!((r - 1.1).abs() < 1e-9, "{r}");
        assert!(
            (lo - 1.1).abs() < 1e-9 && (hi - 1.1).abs() < 1e-9,
            "no spread: {lo} {hi}"
        );
        let (r, lo, hi) = paired_ratio(&[100.0, 120.0, 80.0], &[100.0, 100.0, 100.0]).unwrap();
        assert!(lo < r && r < hi && lo < 1.0 && hi > 1.0, "{lo} {r} {hi}");
        assert!(paired_ratio(&[1.0], &[1.0]).is_none());
        assert!(paired_ratio(&[1.0, 0.0], &[1.0, 1.0]).is_none());
    }

    #[test]
    fn the_median_round_is_one_whole_measured_round() {
        let r = |t: f64, u: f64| json!({"arm": "none", "tok_s": t, "user_tok_s": u});
        let m = median_round(&[r(300.0, 10.0), r(250.0, 8.0), r(320.0, 11.0)]);
        assert_eq!(m["tok_s"], 300.0);
        assert_eq!(m["user_tok_s"], 10.0);
        let m = median_round(&[r(300.0, 10.0), r(250.0, 8.0)]);
        assert_eq!(m["tok_s"], 250.0);
        assert_eq!(median_round(&[r(1.0, 1.0)])["tok_s"], 1.0);
    }

    #[test]
    fn arm_orders_are_permutations_with_varying_neighbours() {
        let mut before_last = std::collections::HashSet::new();
        for r in 0..6u64 {
            let o = arm_order(5, r);
            let mut sorted = o.clone();
            sorted.sort();
            assert_eq!(sorted, vec![0, 1, 2, 3, 4]);
            let p = o.iter().position(|&x| x == 4).unwrap();
            before_last.insert(if p == 0 { usize::MAX } else { o[p - 1] });
        }
        assert!(before_last.len() > 1, "arm 4 always follows the same arm");
    }
}
