//! `dspark bench frontier`: throughput against interactivity as concurrency grows, for no
//! speculation, fixed draft lengths and the hardware-aware scheduler, in one run on the same
//! prompts. Writes `{"points":[{"arm","concurrency","tok_s","user_tok_s","committed_per_call",
//! "mean_in_flight","window_s","window_tokens",...}]}` and an SVG of total tokens/s against
//! per-user tokens/s. Each point's rates are its steady state: over a window in which all `c`
//! requests are in flight, the ramp-up and the drain left out (see `Window` and `Measured`);
//! the `point_*` fields give the whole point.

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
    #[arg(long, default_value_t = 32, value_parser = crate::config::at_least_one)]
    pub max_tokens: usize,
    /// Each request's answer length is `--max-tokens` × a factor in [1 − s, 1 + s], fixed per
    /// request (the same in every arm). With one length for all, a wave of requests runs in
    /// lockstep under plain decoding and the next wave's prefill never overlaps anyone's
    /// decoding, while any speculation breaks the lockstep: the benchmark would charge
    /// speculation for prefill interference that real traffic gives every arm.
    #[arg(long, default_value_t = 0.5)]
    pub length_spread: f64,
    /// Requests per point, as a multiple of the concurrency. The point's figures are over its
    /// steady window (all `c` in flight), from the end of the first `c` requests' prefills to
    /// the first request that finishes with none left to submit: more waves, a longer window.
    #[arg(long, default_value_t = 2)]
    pub waves: usize,
    /// At least this many timed requests per point, whatever the concurrency: at c = 1 a few
    /// short answers last a fraction of a second, which this machine's noise swamps.
    #[arg(long, default_value_t = 16)]
    pub min_requests: usize,
    /// Untimed requests each arm serves before it is timed (default: two waves, at least 48),
    /// as a benchmark of a long-running server would: the scheduler's running estimates start
    /// from its prior, its probes back off over a few hundred steps where drafting does not
    /// pay (about 1 % of throughput at c = 8 when timed from the first wave), and the first
    /// steps warm caches and threads.
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Measure every arm this many times per concurrency. Within a round the arms' timed
    /// requests run interleaved (`--slice-ms`); each arm's point pools all its rounds, and the
    /// scheduler/none ratio is also given over paired rounds with its 95 % interval.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Pause after the arms are warmed, before the timed requests (milliseconds).
    #[arg(long, default_value_t = 500)]
    pub settle_ms: u64,
    /// The arms' timed requests run in turns of this many milliseconds each (shuffled order per
    /// turn), so every arm sees the same spells of this shared machine: it has spells a quarter
    /// slower lasting from a few hundred milliseconds to seconds.
    #[arg(long, default_value_t = 50)]
    pub slice_ms: u64,
    /// SPS(B) profiling grid of the scheduler arm's table (total batch tokens), as the target
    /// worker's `--sps-grid`; profiled once and cached per grid.
    #[arg(long, value_delimiter = ',', default_values_t = target_worker::sps::DEFAULT_GRID.to_vec())]
    pub sps_grid: Vec<usize>,
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

pub fn run(g: &Global, a: FrontierArgs) -> anyhow::Result<()> {
    crate::config::check_outputs(&[a.json.as_deref(), a.plot.as_deref()])?;
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
    anyhow::ensure!(a.rounds >= 1, "--rounds takes a value ≥ 1");
    anyhow::ensure!(a.slice_ms >= 1, "--slice-ms takes a value ≥ 1");
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
    let sps = crate::spec::sps_profile(g, &a.target, &target, &a.sps_grid)?;
    // (arm name, proposer kind, gamma, scheduler on)
    let mut arms: Vec<(String, ProposerKind, usize, bool)> =
        vec![("none".into(), ProposerKind::None, 0, false)];
    for &gm in &a.gammas {
        arms.push((format!("fixed-{gm}"), kind.clone(), gm, false));
    }
    arms.push(("scheduler".into(), kind.clone(), a.max_gamma, true));
    let mut drafts = crate::spec::DraftCache::default();
    let mut points = Vec::new();
    out!(
        "{:<12} {:>5} {:>9} {:>11} {:>9} {:>8} {:>9}",
        "arm",
        "conc",
        "tok/s",
        "user tok/s",
        "per_call",
        "ttft ms",
        "in flight"
    )?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let lengths = Lengths {
        max_tokens: a.max_tokens,
        spread: a.length_spread,
    };
    let mut paired = Vec::new();
    // The KV cache each engine holds: every request's prompt and answer, with room to spare.
    // Sized from the workload, not the model's context (8192 per slot would cost each of the
    // arms' engines gigabytes, and they are all alive at once).
    let longest = ids.iter().map(|p| p.len()).max().unwrap_or(0)
        + (a.max_tokens as f64 * (1.0 + a.length_spread)).ceil() as usize;
    for &c in &a.concurrency {
        let mut measured: Vec<Vec<Measured>> = vec![Vec::new(); arms.len()];
        for round in 0..a.rounds {
            // Every arm's engine is built and warmed first; then the timed requests of all arms
            // run in turns of `--slice-ms`, each arm on its own clock (the time spent in its own
            // steps). A slow spell of this shared machine lasts seconds: it lands on every arm
            // alike instead of on whichever arm ran then.
            let mut drivers = Vec::new();
            for ai in arm_order(arms.len(), (c as u64) << 16 | round as u64) {
                let (name, k, gm, sched) = &arms[ai];
                let proposer = crate::spec::build_proposer(g, k, &target, &mut drafts)?;
                let kv = crate::spec::workload_kv_tokens(max_c, longest, (*gm).max(1));
                let mut e = crate::spec::engine_sized(&target, proposer, (*gm).max(1), max_c, kv)?;
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
                let warm = a.warmup.unwrap_or(default_warmup(c));
                let mut w = Driver::new(e, 0, warm, c);
                w.run_for(&ids, lengths, f64::INFINITY)?;
                let n = (c * a.waves).max(a.min_requests).max(1);
                drivers.push((ai, name.clone(), Driver::new(w.e, warm, n, c)));
            }
            std::thread::sleep(std::time::Duration::from_millis(a.settle_ms));
            let slice = a.slice_ms as f64 / 1e3;
            let mut turn = 0u64;
            while drivers.iter().any(|d| !d.2.done()) {
                for i in arm_order(drivers.len(), turn ^ (round as u64) << 32) {
                    drivers[i].2.run_for(&ids, lengths, slice)?;
                }
                turn += 1;
            }
            for (ai, name, d) in drivers {
                let m = d.measure();
                if m.steady_rounds == 0 {
                    eprintln!(
                        "  note: round {round}: {name} c{c}: no steady window (the drain began \
                         no later than the first {c} requests all had their first token); its \
                         figures are over the whole point"
                    );
                }
                if a.rounds > 1 {
                    eprintln!("  round {round}: {name} c{c} {:.1} tok/s", m.tok_s());
                }
                measured[ai].push(m);
            }
        }
        // Rounds interleave the arms, so round i of two arms ran close in time: their ratio is a
        // paired sample, and its spread says how much of a difference the machine's noise makes.
        let rounds_of = |i: usize| -> Vec<f64> { measured[i].iter().map(|m| m.tok_s()).collect() };
        if let Some((ratio, lo, hi)) = paired_ratio(&rounds_of(arms.len() - 1), &rounds_of(0)) {
            paired.push(json!({"concurrency": c, "ratio": ratio, "ci95": [lo, hi]}));
        }
        for (ai, rounds) in measured.iter().enumerate() {
            let name = &arms[ai].0;
            let m = Measured::pool(rounds);
            out!(
                "{name:<12} {c:>5} {:>9.1} {:>11.1} {:>9.2} {:>8.1} {:>9.2}",
                m.tok_s(),
                m.user_tok_s(),
                m.per_call(),
                m.ttft_ms(),
                m.mean_in_flight()
            )?;
            let mut p = m.json(name, c);
            p["rounds"] = json!(rounds.iter().map(|r| r.json(name, c)).collect::<Vec<_>>());
            p["rounds_tok_s"] = json!(rounds_of(ai));
            points.push(p);
        }
    }
    let checks = criteria(&points);
    out!(
        "scheduler ≥ none at every concurrency: {}; scheduler above every fixed γ at equal per-user tok/s: {}",
        checks["never_below_none"],
        checks["above_every_fixed_gamma"]
    )?;
    for q in &paired {
        out!(
            "scheduler / none at c{}: {:.3} (paired rounds, 95 % interval {:.3}–{:.3})",
            q["concurrency"],
            q["ratio"].as_f64().unwrap_or(f64::NAN),
            q["ci95"][0].as_f64().unwrap_or(f64::NAN),
            q["ci95"][1].as_f64().unwrap_or(f64::NAN)
        )?;
    }
    let v = json!({
        "command": crate::config::command_line(),
        "target": a.target, "drafter": kind.label(), "prompts": a.prompts, "max_tokens": a.max_tokens,
        "length_spread": a.length_spread, "rounds": a.rounds,
        "prompt_tokens_mean": ids.iter().map(Vec::len).sum::<usize>() as f64 / ids.len().max(1) as f64,
        "threads": target.model.threads(), "sps_table": sps.points, "points": points,
        "checks": checks, "paired_vs_none": paired,
    });
    crate::bench::write_json(&a.json, &v)?;
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

/// One arm's timed requests, run a slice at a time: requests `first..first + n` at concurrency
/// `c`, timed on the arm's own clock (the seconds spent in its engine's steps), so the turns of
/// the other arms in between cost it nothing.
struct Driver {
    e: specdec::Engine,
    first: usize,
    n: usize,
    c: usize,
    next: usize,
    in_flight: usize,
    out_tokens: usize,
    /// Seconds spent in this arm's steps so far.
    clock: f64,
    /// Σ over steps of seconds × requests in flight during the step (request-seconds).
    in_flight_s: f64,
    /// Of the first min(c, n) requests (the ramp-up), those without a first token yet.
    ramping: usize,
    window: Window,
    live: std::collections::HashMap<u64, Live>,
    /// Over every request: decode rates ((tokens − 1) / seconds after the first token) and
    /// times to first token.
    user: Vec<f64>,
    ttft: Vec<f64>,
    /// Over the steady window: each request's decode rate clipped to it, and the times to first
    /// token of the requests submitted while it was open.
    user_window: Vec<f64>,
    ttft_window: Vec<f64>,
    tokens0: usize,
    calls0: usize,
}

/// One request in flight.
struct Live {
    /// Clock when submitted, and whether the steady window was open then.
    added: f64,
    added_in_window: bool,
    /// Whether its first token came in a step of the steady window (a refill still in its
    /// prefill when the drain begins has a time to first token partly the drain's).
    first_in_window: bool,
    /// Clock at its first token.
    first: Option<f64>,
    /// Tokens streamed so far.
    tokens: usize,
    /// Where its decoding inside the steady window starts: (clock, tokens so far then).
    span: Option<(f64, usize)>,
}

/// A point on the arm's clock: seconds, tokens streamed and request-seconds in flight so far.
/// [`Window::span`] gives the window's own three as one.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Mark {
    clock: f64,
    tokens: usize,
    in_flight_s: f64,
}

/// The steady window of a point: every step in it runs with all `c` requests in flight. It
/// opens after the step in which the last of the first `c` requests got its first token (the
/// ramp-up: until then some of the `c` are still in their prefill, all of them at once) and
/// closes after the first step in which a request finishes with none left to submit (the
/// drain: from then on fewer than `c` are in flight). A drain that begins before the ramp-up
/// ends leaves no window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Window {
    open: Option<Mark>,
    close: Option<Mark>,
}

impl Window {
    /// Whether the next step falls in the window.
    fn is_open(&self) -> bool {
        self.open.is_some() && self.close.is_none()
    }

    /// After a step, at `now`: `ramped` when every one of the first `c` requests has had its
    /// first token, `draining` when fewer than `c` are in flight and none is left to submit.
    fn step(&mut self, now: Mark, ramped: bool, draining: bool) {
        if ramped && self.open.is_none() && self.close.is_none() {
            self.open = Some(now);
        }
        if draining && self.close.is_none() {
            self.close = Some(now);
        }
    }

    /// The window's seconds, tokens and request-seconds; `None` where it never opened or has no
    /// length.
    fn span(&self) -> Option<Mark> {
        let (a, b) = (self.open?, self.close?);
        (b.clock > a.clock).then(|| Mark {
            clock: b.clock - a.clock,
            tokens: b.tokens.saturating_sub(a.tokens),
            in_flight_s: b.in_flight_s - a.in_flight_s,
        })
    }
}

/// A request's decode rate over a span that started at `start` (clock, tokens then) and ends at
/// `now` with `tokens`: the tokens after the start over the seconds; `None` for no seconds.
fn span_rate(start: (f64, usize), now: f64, tokens: usize) -> Option<f64> {
    let dt = now - start.0;
    (dt > 0.0).then(|| tokens.saturating_sub(start.1) as f64 / dt)
}

/// `x` per second over `secs`; 0 for no seconds.
fn per_second(x: f64, secs: f64) -> f64 {
    if secs > 0.0 { x / secs } else { 0.0 }
}

fn average(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// What one arm measured over its timed requests (one round, or several pooled).
///
/// The rates over time (`tok_s`, `mean_in_flight`) are over each round's steady window (see
/// [`Window`]), not over the whole point: at its start the first `c` requests all prefill at
/// once, at its end the last ones drain with fewer than `c` in flight, and a whole-point figure
/// would mix lower concurrencies into concurrency `c`'s. A round without a window (its drain
/// began before its ramp-up ended) contributes its whole point instead; `steady_rounds` counts
/// the rounds that had one. The `point_*` figures keep the whole point, ramp-up and drain
/// included (what `tok_s`, `user_tok_s` and `ttft_ms` meant before the window).
#[derive(Clone, Debug, Default, PartialEq)]
struct Measured {
    /// Tokens streamed, seconds of the arm's own clock and request-seconds in flight that
    /// `tok_s` and `mean_in_flight` are over: the steady window's (the whole point's in a round
    /// without one).
    tokens: usize,
    active_s: f64,
    in_flight_s: f64,
    /// The steady windows' seconds and tokens (0 for a round without one), and the number of
    /// rounds that had one.
    window_s: f64,
    window_tokens: usize,
    steady_rounds: usize,
    /// The same as `tokens`, `active_s`, `in_flight_s` over the whole point.
    point_tokens: usize,
    point_s: f64,
    point_in_flight_s: f64,
    /// Per-request figures in the window: each request's decode rate over the part of its
    /// decoding inside the window (tokens after its first token or the window's start, over the
    /// seconds from then to its end or the window's end), and the time to first token of the
    /// requests submitted inside it: the first wave's is the ramp-up's burst of `c` prefills at
    /// once, a refill's its prefill beside `c` − 1 decoding requests, as under steady load.
    /// Every request's instead where the round had no window or none of its requests qualify.
    user: Vec<f64>,
    ttft: Vec<f64>,
    /// Per multi-token request of the whole point: its decode rate (tokens after the first over
    /// the seconds after it), and every request's time to first token.
    point_user: Vec<f64>,
    point_ttft: Vec<f64>,
    /// Tokens after each request's first (its prefill's), and target calls: over every request
    /// of the point (the engine adds a request's counts to its totals when it finishes, not per
    /// step, so they cannot be cut at the window).
    after_first: usize,
    calls: usize,
    requests: usize,
}

impl Measured {
    /// Total tokens/s in the steady window (see [`Measured`]).
    fn tok_s(&self) -> f64 {
        self.tokens as f64 / self.active_s.max(1e-9)
    }
    /// Time-weighted mean of the requests in flight over the seconds `tok_s` is over: `c` in a
    /// steady window, by its definition (recorded so that a reader can check it).
    fn mean_in_flight(&self) -> f64 {
        per_second(self.in_flight_s, self.active_s)
    }
    fn point_tok_s(&self) -> f64 {
        self.point_tokens as f64 / self.point_s.max(1e-9)
    }
    fn point_mean_in_flight(&self) -> f64 {
        per_second(self.point_in_flight_s, self.point_s)
    }
    fn user_tok_s(&self) -> f64 {
        average(&self.user)
    }
    fn ttft_ms(&self) -> f64 {
        1e3 * average(&self.ttft)
    }
    fn point_user_tok_s(&self) -> f64 {
        average(&self.point_user)
    }
    fn point_ttft_ms(&self) -> f64 {
        1e3 * average(&self.point_ttft)
    }
    /// Committed tokens per target call after prefill: 1.00 for plain decoding.
    fn per_call(&self) -> f64 {
        if self.calls == 0 {
            1.0
        } else {
            self.after_first as f64 / self.calls as f64
        }
    }
    /// Several rounds as one: their tokens over their seconds, every request's rates. Rounds
    /// run every arm in interleaved turns, so a slow spell of the machine weighs on all arms
    /// alike within each round; pooling uses every round (a median round would compare one
    /// arm's round with another's).
    fn pool(rounds: &[Measured]) -> Measured {
        let mut m = Measured::default();
        for r in rounds {
            m.tokens += r.tokens;
            m.active_s += r.active_s;
            m.in_flight_s += r.in_flight_s;
            m.window_s += r.window_s;
            m.window_tokens += r.window_tokens;
            m.steady_rounds += r.steady_rounds;
            m.point_tokens += r.point_tokens;
            m.point_s += r.point_s;
            m.point_in_flight_s += r.point_in_flight_s;
            m.user.extend(&r.user);
            m.ttft.extend(&r.ttft);
            m.point_user.extend(&r.point_user);
            m.point_ttft.extend(&r.point_ttft);
            m.after_first += r.after_first;
            m.calls += r.calls;
            m.requests += r.requests;
        }
        m
    }
    /// `tok_s`, `user_tok_s`, `ttft_ms`, `active_s`, `tokens` and `mean_in_flight` are the
    /// steady window's (see [`Measured`]); `window_s`, `window_tokens` and `steady_rounds`
    /// describe the windows; `ttft_requests` and `user_spans` count the samples behind
    /// `ttft_ms` and `user_tok_s`; the `point_*` fields are over the whole point;
    /// `committed_per_call` and `requests` are over every request.
    fn json(&self, arm: &str, c: usize) -> serde_json::Value {
        json!({"arm": arm, "concurrency": c, "tok_s": self.tok_s(), "user_tok_s": self.user_tok_s(),
            "committed_per_call": self.per_call(), "requests": self.requests,
            "active_s": self.active_s, "ttft_ms": self.ttft_ms(), "tokens": self.tokens,
            "mean_in_flight": self.mean_in_flight(), "window_s": self.window_s,
            "window_tokens": self.window_tokens, "steady_rounds": self.steady_rounds,
            "ttft_requests": self.ttft.len(), "user_spans": self.user.len(),
            "point_s": self.point_s, "point_tokens": self.point_tokens,
            "point_tok_s": self.point_tok_s(), "point_mean_in_flight": self.point_mean_in_flight(),
            "point_user_tok_s": self.point_user_tok_s(), "point_ttft_ms": self.point_ttft_ms()})
    }
}

impl Driver {
    fn new(e: specdec::Engine, first: usize, n: usize, c: usize) -> Self {
        let (tokens0, calls0) = (e.totals().completion_tokens, e.totals().target_calls);
        Self {
            e,
            first,
            n,
            c,
            next: 0,
            in_flight: 0,
            out_tokens: 0,
            clock: 0.0,
            in_flight_s: 0.0,
            ramping: c.min(n),
            window: Window::default(),
            live: Default::default(),
            user: Vec::new(),
            ttft: Vec::new(),
            user_window: Vec::new(),
            ttft_window: Vec::new(),
            tokens0,
            calls0,
        }
    }

    fn done(&self) -> bool {
        self.next >= self.n && self.in_flight == 0
    }

    /// Runs steps until `slice` seconds of this arm's clock have passed or its requests are done.
    fn run_for(&mut self, ids: &[Vec<u32>], lengths: Lengths, slice: f64) -> anyhow::Result<()> {
        let end = self.clock + slice;
        while !self.done() && self.clock < end {
            while self.in_flight < self.c && self.next < self.n {
                let id = self.first + self.next;
                self.e.add(Request::new(
                    id as u64,
                    ids[id % ids.len()].clone(),
                    lengths.of(id),
                ))?;
                self.live.insert(
                    id as u64,
                    Live {
                        added: self.clock,
                        added_in_window: self.window.is_open(),
                        first_in_window: false,
                        first: None,
                        tokens: 0,
                        span: None,
                    },
                );
                self.next += 1;
                self.in_flight += 1;
            }
            // Whether this step falls in the steady window, and how many requests it serves.
            let in_window = self.window.is_open();
            let running = self.in_flight;
            let t0 = Instant::now();
            let events = self.e.step()?;
            let dt = t0.elapsed().as_secs_f64();
            self.clock += dt;
            self.in_flight_s += dt * running as f64;
            // Requests first..first + c are the ramp-up's.
            let ramp_end = self.first + self.c;
            for ev in events {
                match ev {
                    Event::Tokens { id, tokens, .. } => {
                        self.out_tokens += tokens.len();
                        if let Some(r) = self.live.get_mut(&id) {
                            r.tokens += tokens.len();
                            if r.first.is_none() {
                                r.first = Some(self.clock);
                                r.first_in_window = in_window;
                                if in_window {
                                    r.span = Some((self.clock, r.tokens));
                                }
                                if (id as usize) < ramp_end {
                                    self.ramping = self.ramping.saturating_sub(1);
                                }
                            }
                        }
                    }
                    Event::Failed { id, error } => {
                        anyhow::bail!("request {id} failed: {error}")
                    }
                    Event::Finished { id, .. } => {
                        self.in_flight -= 1;
                        if let Some(r) = self.live.remove(&id) {
                            if let Some(first) = r.first {
                                self.ttft.push(first - r.added);
                                if r.added_in_window && r.first_in_window {
                                    self.ttft_window.push(first - r.added);
                                }
                                let dt = self.clock - first;
                                if r.tokens > 1 && dt > 0.0 {
                                    self.user.push((r.tokens - 1) as f64 / dt);
                                }
                                if in_window
                                    && let Some(u) =
                                        r.span.and_then(|s| span_rate(s, self.clock, r.tokens))
                                {
                                    self.user_window.push(u);
                                }
                            } else if (id as usize) < ramp_end {
                                // Finished without a token: it no longer holds the ramp-up open.
                                self.ramping = self.ramping.saturating_sub(1);
                            }
                        }
                    }
                }
            }
            let now = Mark {
                clock: self.clock,
                tokens: self.out_tokens,
                in_flight_s: self.in_flight_s,
            };
            let (was_opened, was_closed) =
                (self.window.open.is_some(), self.window.close.is_some());
            self.window.step(
                now,
                self.ramping == 0,
                self.next >= self.n && self.in_flight < self.c,
            );
            if !was_opened && self.window.open.is_some() {
                // The requests already decoding enter the window here.
                for r in self.live.values_mut() {
                    if r.first.is_some() {
                        r.span = Some((self.clock, r.tokens));
                    }
                }
            }
            if !was_closed && self.window.close.is_some() {
                // The requests still decoding leave it here.
                for r in self.live.values_mut() {
                    if let Some(u) = r
                        .span
                        .take()
                        .and_then(|s| span_rate(s, self.clock, r.tokens))
                    {
                        self.user_window.push(u);
                    }
                }
            }
        }
        Ok(())
    }

    fn measure(&self) -> Measured {
        let t = self.e.totals();
        let window = self.window.span();
        let whole = Mark {
            clock: self.clock,
            tokens: self.out_tokens,
            in_flight_s: self.in_flight_s,
        };
        let used = window.unwrap_or(whole);
        // The window's per-request figures where it has any, else every request's.
        let pick = |in_window: &[f64], all: &[f64]| -> Vec<f64> {
            if window.is_some() && !in_window.is_empty() {
                in_window.to_vec()
            } else {
                all.to_vec()
            }
        };
        Measured {
            tokens: used.tokens,
            active_s: used.clock,
            in_flight_s: used.in_flight_s,
            window_s: window.map_or(0.0, |w| w.clock),
            window_tokens: window.map_or(0, |w| w.tokens),
            steady_rounds: usize::from(window.is_some()),
            point_tokens: whole.tokens,
            point_s: whole.clock,
            point_in_flight_s: whole.in_flight_s,
            user: pick(&self.user_window[..], &self.user[..]),
            ttft: pick(&self.ttft_window[..], &self.ttft[..]),
            point_user: self.user.clone(),
            point_ttft: self.ttft.clone(),
            after_first: (t.completion_tokens - self.tokens0).saturating_sub(self.n),
            calls: t.target_calls - self.calls0,
            requests: self.n,
        }
    }
}

/// Geometric mean of the paired ratios a_i / b_i and its 95 % t-interval (on the log ratios);
/// `None` for fewer than two pairs or a non-positive value.
pub(crate) fn paired_ratio(a: &[f64], b: &[f64]) -> Option<(f64, f64, f64)> {
    let n = a.len().min(b.len());
    if n < 2 || a.iter().chain(b).any(|&x| x.is_nan() || x <= 0.0) {
        return None;
    }
    let l: Vec<f64> = a.iter().zip(b).map(|(x, y)| (x / y).ln()).collect();
    log_interval(&l)
}

/// Paired ratio of units (prompts, or groups of prompts run together) each measured in several
/// rounds: `a` and `b` hold `rounds × units` rates, round-major (round r's unit u at
/// `r * units + u`). The rounds of one unit repeat the same work (greedy, or seeded sampling),
/// so they are not independent samples: each unit's log ratios are averaged over its rounds,
/// and the geometric mean and the 95 % t-interval are over the units (n = `units`). `None`
/// for fewer than two units, a length that is not a multiple of `units`, or a non-positive
/// value.
pub(crate) fn paired_ratio_by_unit(a: &[f64], b: &[f64], units: usize) -> Option<(f64, f64, f64)> {
    if units < 2
        || a.is_empty()
        || a.len() != b.len()
        || a.len() % units != 0
        || a.iter().chain(b).any(|&x| x.is_nan() || x <= 0.0)
    {
        return None;
    }
    let rounds = a.len() / units;
    let l: Vec<f64> = (0..units)
        .map(|u| {
            (0..rounds)
                .map(|r| (a[r * units + u] / b[r * units + u]).ln())
                .sum::<f64>()
                / rounds as f64
        })
        .collect();
    log_interval(&l)
}

/// Warm-up requests per arm before timing, at concurrency `c`: two waves, at least 48 (see
/// `FrontierArgs::warmup`).
pub(crate) fn default_warmup(c: usize) -> usize {
    (2 * c).max(48)
}

/// exp of the mean of the log ratios `l` and the exp of its 95 % t-interval's ends; `None` for
/// fewer than two values or a non-finite one.
fn log_interval(l: &[f64]) -> Option<(f64, f64, f64)> {
    // Two-sided 95 % Student t quantiles for 1..=30 degrees of freedom; past 30, the
    // Cornish–Fisher expansion z + (z³ + z)/4ν + (5z⁵ + 16z³ + 3z)/96ν² (within 1e-4 there).
    const T95: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let n = l.len();
    if n < 2 || l.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let mean = l.iter().sum::<f64>() / n as f64;
    let var = l.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = T95.get(n - 2).copied().unwrap_or_else(|| {
        let (z, v) = (1.959_964f64, (n - 1) as f64);
        z + (z.powi(3) + z) / (4.0 * v)
            + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * v * v)
    });
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

    /// `--max-tokens 0` would run answers of two tokens and record 0: refused at parse.
    #[test]
    fn a_zero_answer_length_is_refused_at_parse() {
        let parse = |n: &str| {
            crate::parse_from(["dspark", "bench", "frontier", "--max-tokens", n]).map(|c| {
                match c.cmd {
                    crate::Command::Bench(crate::bench::BenchCmd::Frontier(f)) => f.max_tokens,
                    other => panic!("{other:?}"),
                }
            })
        };
        assert_eq!(parse("1").expect("parsed"), 1);
        let e = parse("0").expect_err("refused").to_string();
        assert!(
            e.contains("--max-tokens") && e.contains("at least 1"),
            "{e}"
        );
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
        // 12 pairs (11 degrees of freedom): t = 2.201, not the normal's 1.96.
        let a: Vec<f64> = (0..12).map(|i| 100.0 + (i % 3) as f64 * 10.0).collect();
        let b = vec![100.0; 12];
        let (m, lo, hi) = paired_ratio(&a, &b).unwrap();
        let l: Vec<f64> = a.iter().map(|x| (x / 100.0f64).ln()).collect();
        let mean = l.iter().sum::<f64>() / 12.0;
        let sd = (l.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 11.0).sqrt();
        assert!((m.ln() - mean).abs() < 1e-12);
        assert!(((hi.ln() - lo.ln()) / 2.0 - 2.201 * sd / 12f64.sqrt()).abs() < 1e-9);
        // Past the table, the expansion meets it at 30 degrees of freedom.
        let (a, b) = (vec![1.0, 2.0].repeat(16), vec![1.0; 32]);
        let (_, lo, hi) = paired_ratio(&a, &b).unwrap();
        let l: Vec<f64> = a.iter().map(|x| x.ln()).collect();
        let mean = l.iter().sum::<f64>() / 32.0;
        let sd = (l.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 31.0).sqrt();
        let t = (hi.ln() - lo.ln()) / 2.0 / (sd / 32f64.sqrt());
        assert!((t - 2.0395).abs() < 1e-3, "{t}");
        assert!(paired_ratio(&[1.0, 0.0], &[1.0, 1.0]).is_none());
    }

    #[test]
    fn repeated_rounds_of_the_same_prompts_are_one_sample_per_prompt() {
        // Four prompts (units), one round: the same as the plain paired ratio.
        let a1 = [110.0, 95.0, 130.0, 100.0];
        let b1 = [100.0; 4];
        let one = paired_ratio_by_unit(&a1, &b1, 4).unwrap();
        let plain = paired_ratio(&a1, &b1).unwrap();
        assert!((one.0 - plain.0).abs() < 1e-12 && (one.1 - plain.1).abs() < 1e-12);
        assert!((one.2 - plain.2).abs() < 1e-12);
        // Three identical rounds give the same estimate and interval as one round (n = 4
        // prompts, not 12 samples); pooling the 12 as independent would narrow it.
        let (a3, b3) = (a1.repeat(3), b1.repeat(3));
        let three = paired_ratio_by_unit(&a3, &b3, 4).unwrap();
        for (x, y) in [(one.0, three.0), (one.1, three.1), (one.2, three.2)] {
            assert!((x - y).abs() < 1e-12, "{one:?} {three:?}");
        }
        let pooled = paired_ratio(&a3, &b3).unwrap();
        assert!(pooled.2 - pooled.1 < three.2 - three.1);
        // Rounds that differ: each prompt's log ratios are averaged over its rounds (round-major
        // layout), and the t-interval has n − 1 = 2 degrees of freedom (3 prompts).
        let a = [110.0, 90.0, 120.0, 130.0, 100.0, 120.0];
        let b = [100.0; 6];
        let (m, lo, hi) = paired_ratio_by_unit(&a, &b, 3).unwrap();
        let l = [
            (1.1f64.ln() + 1.3f64.ln()) / 2.0,
            (0.9f64.ln() + 1.0f64.ln()) / 2.0,
            1.2f64.ln(),
        ];
        let mean = l.iter().sum::<f64>() / 3.0;
        let sd = (l.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
        assert!((m.ln() - mean).abs() < 1e-12, "{m}");
        assert!(((hi.ln() - lo.ln()) / 2.0 - 4.303 * sd / 3f64.sqrt()).abs() < 1e-9);
        // Not a whole number of rounds, one prompt, or a zero rate: no interval.
        assert!(paired_ratio_by_unit(&a[..5], &b[..5], 3).is_none());
        assert!(paired_ratio_by_unit(&a, &b, 1).is_none());
        assert!(paired_ratio_by_unit(&[1.0, 0.0], &[1.0, 1.0], 2).is_none());
        assert_eq!(default_warmup(1), 48);
        assert_eq!(default_warmup(32), 64);
    }

    #[test]
    fn pooled_rounds_weigh_every_round_by_its_tokens_and_seconds() {
        let r = |tokens, secs, user: &[f64], calls| Measured {
            tokens,
            active_s: secs,
            user: user.to_vec(),
            ttft: vec![0.1; user.len()],
            after_first: 2 * calls,
            calls,
            requests: user.len(),
            ..Default::default()
        };
        let a = r(300, 1.0, &[10.0, 20.0], 100);
        let b = r(100, 1.0, &[30.0], 50);
        let m = Measured::pool(&[a.clone(), b]);
        // 400 tokens in 2 s, not the mean of 300 and 100 tokens/s rounds weighted alike by
        // requests, and every request's rate.
        assert_eq!(m.tok_s(), 200.0);
        assert_eq!(m.user_tok_s(), 20.0);
        assert_eq!(m.per_call(), 2.0);
        assert!((m.ttft_ms() - 100.0).abs() < 1e-9);
        assert_eq!(m.requests, 3);
        assert_eq!(Measured::pool(std::slice::from_ref(&a)), a);
        assert_eq!(Measured::default().per_call(), 1.0);
        // The window's request-seconds pool like its tokens: two windows of 1 s at c = 4 and a
        // whole point of 1 s at a mean of 2 in flight (a round without a window) read 10 / 3.
        let w = |in_flight_s: f64, window_s: f64, steady_rounds: usize| Measured {
            tokens: 100,
            active_s: 1.0,
            in_flight_s,
            window_s,
            window_tokens: if steady_rounds == 1 { 100 } else { 0 },
            steady_rounds,
            point_tokens: 150,
            point_s: 2.0,
            point_in_flight_s: 5.0,
            ..Default::default()
        };
        let m = Measured::pool(&[w(4.0, 1.0, 1), w(4.0, 1.0, 1), w(2.0, 0.0, 0)]);
        assert!((m.mean_in_flight() - 10.0 / 3.0).abs() < 1e-12);
        assert_eq!(
            (m.window_s, m.window_tokens, m.steady_rounds),
            (2.0, 200, 2)
        );
        assert_eq!(m.tok_s(), 100.0);
        assert_eq!(m.point_tok_s(), 75.0);
        assert_eq!(m.point_mean_in_flight(), 2.5);
        assert_eq!(Measured::default().mean_in_flight(), 0.0);
    }

    #[test]
    fn the_steady_window_runs_from_the_ramp_up_to_the_drain() {
        // c = 2, step by step as a driver feeds it: (seconds, requests in flight during the
        // step, tokens streamed, all of the first two have had their first token, draining).
        let steps = [
            (0.5, 2, 2, true, false), // both prefills at once: the ramp-up ends here
            (0.1, 2, 2, true, false), // both decode
            (0.1, 2, 2, true, false), // one finishes; the last request is submitted
            (0.2, 2, 2, true, false), // its prefill beside the other's decoding
            (0.1, 2, 2, true, true),  // one finishes with none left to submit: the drain
            (0.3, 1, 3, true, true),  // the last one alone
        ];
        let (mut w, mut now) = (Window::default(), Mark::default());
        for (dt, n, tokens, ramped, draining) in steps {
            now.clock += dt;
            now.tokens += tokens;
            now.in_flight_s += dt * n as f64;
            w.step(now, ramped, draining);
        }
        assert!(!w.is_open());
        // From 0.5 s (2 tokens, 1.0 request-seconds) to 1.0 s (10 tokens, 2.0): 8 tokens in
        // 0.5 s, 16 tokens/s, two in flight throughout.
        let s = w.span().unwrap();
        assert!((s.clock - 0.5).abs() < 1e-9, "{s:?}");
        assert_eq!(s.tokens, 8);
        assert!(
            (per_second(s.in_flight_s, s.clock) - 2.0).abs() < 1e-9,
            "{s:?}"
        );
        assert!((s.tokens as f64 / s.clock - 16.0).abs() < 1e-6);
        // The whole point: 13 tokens in 1.3 s (10 tokens/s), 2.3 request-seconds: a mean of
        // 1.77 in flight, ramp-up and drain included.
        assert_eq!(now.tokens, 13);
        assert!((per_second(now.in_flight_s, now.clock) - 2.3 / 1.3).abs() < 1e-9);
        assert_eq!(per_second(1.0, 0.0), 0.0);

        let at = |t: f64| Mark {
            clock: t,
            tokens: 0,
            in_flight_s: 0.0,
        };
        // A drain that begins before the ramp-up ends leaves no window, and none opens later.
        let mut w = Window::default();
        w.step(at(0.1), false, true);
        w.step(at(0.2), true, true);
        assert_eq!(w.span(), None);
        assert!(w.open.is_none() && !w.is_open());
        // Ramp-up and drain in the same step: a window of no length.
        let mut w = Window::default();
        w.step(at(0.1), true, true);
        assert!(w.open.is_some() && !w.is_open() && w.span().is_none());
    }

    #[test]
    fn a_requests_rate_in_the_window_counts_the_tokens_after_its_start() {
        // Entered at 1.0 s with 3 tokens, 8 at 1.5 s: 5 tokens in 0.5 s.
        assert_eq!(span_rate((1.0, 3), 1.5, 8), Some(10.0));
        // No time in the window: no rate (a request that entered in the closing step).
        assert_eq!(span_rate((1.0, 3), 1.0, 3), None);
        // Time but no token (a stalled request) reads 0.
        assert_eq!(span_rate((1.0, 3), 1.25, 3), Some(0.0));
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
