//! Capacity planner: how many target and draft workers a traffic mix needs to meet an SLO, and
//! at which draft:target ratio.
//!
//! Pure and deterministic (seeded). Each target worker is simulated step by step over its
//! profiled SPS(B) table (step seconds = [`SpsTable::seconds`] of the step's batch tokens, prefill
//! chunks included), with the verification lengths chosen by the target worker's own policy
//! object ([`ConfidencePolicy`], fed what the engine feeds it). Drafting is
//! replayed from recorded verifications (`eval-drafter --blocks`): each drafting request draws a
//! real block, whose served confidences the admission sees and whose accepted length decides what
//! commits, so acceptance and calibration are the drafter's own, not a model of them.
//!
//! Draft workers are a shared pool. A drafting round of n requests costs the measured drafting
//! time for n ([`DraftCost`]) plus the network hop, on the target's critical path; the pool's
//! utilization ρ = (target workers × drafting seconds each demands per second) / draft workers
//! adds an M/D/c queueing wait (Erlang C, halved for deterministic service; ρ·s̄ / (2(1 − ρ))
//! for one draft worker) to every round, solved to a fixed point with the simulation. ρ ≥ 1 cannot be served. Rounds drafted from copy runs (the target worker's own
//! prompt lookup) cost the pool nothing.
//!
//! Target workers are symmetric (placement sends each request to the least-loaded one), so one
//! engine at 1/T of the load stands for T of them.

use crate::admission::{ConfidencePolicy, Rule, SpsTable};
use crate::{Result, SchedError};
use kernels::rng::Rng;
use specdec::VerifyPolicy;
use std::collections::VecDeque;

/// One recorded verification: the confidences served for the drafted positions and how many of
/// them the target accepted.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub conf: Vec<f32>,
    pub accepted: u8,
    /// Drafted by the target worker's copy-run lookup: no drafting call.
    pub copy_run: bool,
}

/// One kind of traffic in the mix: its recorded blocks and its share of requests.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSet {
    pub name: String,
    pub weight: f64,
    pub blocks: Vec<Block>,
}

impl BlockSet {
    /// All traffic of one kind.
    pub fn only(blocks: Vec<Block>) -> Vec<BlockSet> {
        vec![BlockSet {
            name: "all".into(),
            weight: 1.0,
            blocks,
        }]
    }
}

/// Drafting seconds per round by block length γ and the number of requests in the round:
/// linear in requests between measured points (the last segment's slope beyond them, the first
/// point's cost below them, proportional above a lone point), linear in γ between measured
/// lengths (the nearest one outside them).
#[derive(Clone, Debug, PartialEq)]
pub struct DraftCost {
    /// (γ, [(requests, seconds)]), γ increasing, requests increasing within each.
    curves: Vec<(u8, Vec<(u32, f64)>)>,
}

impl DraftCost {
    /// From (γ, requests, seconds) measurements.
    pub fn new(points: Vec<(u8, u32, f64)>) -> Result<Self> {
        if points.is_empty()
            || points
                .iter()
                .any(|&(g, n, s)| g == 0 || n == 0 || !s.is_finite() || s < 0.0)
        {
            return Err(SchedError::Config(
                "draft cost: need points (γ ≥ 1, requests ≥ 1, seconds ≥ 0, finite)".into(),
            ));
        }
        let mut curves: Vec<(u8, Vec<(u32, f64)>)> = Vec::new();
        for (g, n, sec) in points {
            match curves.iter_mut().find(|c| c.0 == g) {
                Some(c) => c.1.push((n, sec)),
                None => curves.push((g, vec![(n, sec)])),
            }
        }
        curves.sort_by_key(|c| c.0);
        for c in &mut curves {
            c.1.sort_by_key(|p| p.0);
            c.1.dedup_by_key(|p| p.0);
        }
        Ok(Self { curves })
    }

    /// A cost that does not depend on γ.
    pub fn flat(points: Vec<(u32, f64)>) -> Result<Self> {
        Self::new(points.into_iter().map(|(n, s)| (1, n, s)).collect())
    }

    fn along(p: &[(u32, f64)], n: u32) -> f64 {
        let seg = |i: usize, j: usize| {
            let ((n0, s0), (n1, s1)) = (p[i], p[j]);
            s0 + (n as f64 - n0 as f64) * (s1 - s0) / (n1 as f64 - n0 as f64)
        };
        match p.iter().position(|&(m, _)| m >= n) {
            // Below the first measured round: its cost, not a line through the origin (a
            // drafting call has a fixed cost that fewer requests do not shrink).
            Some(0) => p[0].1,
            Some(i) => seg(i - 1, i),
            None if p.len() >= 2 => seg(p.len() - 2, p.len() - 1).max(p[p.len() - 1].1),
            None => p[0].1 * n as f64 / p[0].0 as f64,
        }
    }

    /// Seconds of a round of `n` requests drafting `gamma` tokens each.
    pub fn seconds(&self, gamma: u8, n: u32) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let c = &self.curves;
        match c.iter().position(|x| x.0 >= gamma) {
            Some(0) => Self::along(&c[0].1, n),
            Some(i) if c[i].0 == gamma => Self::along(&c[i].1, n),
            Some(i) => {
                let (g0, g1) = (c[i - 1].0 as f64, c[i].0 as f64);
                let (s0, s1) = (Self::along(&c[i - 1].1, n), Self::along(&c[i].1, n));
                s0 + (gamma as f64 - g0) * (s1 - s0) / (g1 - g0)
            }
            None => Self::along(&c[c.len() - 1].1, n),
        }
    }
}

/// How a target worker picks verification lengths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verify {
    /// The hardware-aware admission (argmax of Θ on the served confidences).
    Scheduler,
    /// Every drafting request verifies this many tokens.
    Fixed(u8),
}

/// How requests arrive at the cluster.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// Poisson arrivals, requests per second.
    Open { rate: f64 },
    /// A fixed number of requests in flight; each finished one is replaced at once (the
    /// frontier benchmark's setting).
    Closed { concurrency: u32 },
}

/// The traffic mix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    pub load: Load,
    pub prompt_tokens: u32,
    /// Mean answer length; each request's is this × a factor uniform in [1 − spread, 1 + spread].
    pub output_tokens: u32,
    pub output_spread: f64,
}

/// One target worker.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    pub sps: SpsTable,
    /// Requests decoded at once; more wait.
    pub max_running: u32,
    /// Prompt tokens of one request prefilled per step at most (chunked prefill).
    pub prefill_chunk: u32,
    /// Longest block verified.
    pub max_gamma: u8,
    pub verify: Verify,
    /// Network round trip of a drafting round to the draft pool (0 for an in-process drafter).
    pub hop_s: f64,
}

/// Simulated time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimTime {
    /// Not measured: the engine fills up.
    pub warmup_s: f64,
    /// Measured.
    pub measure_s: f64,
    pub seed: u64,
}

/// What one target worker did in the measured window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineReport {
    /// Tokens committed per second.
    pub tok_s: f64,
    /// Decode rate per request, (tokens − 1) / (finish − first token): median and the slow tail.
    pub user_tok_s_p50: f64,
    pub user_tok_s_p10: f64,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    /// Tokens committed per decoding request per verification step (1 without drafts).
    pub committed_per_call: f64,
    /// Drafting-pool seconds this worker asks for per second, and the mean round.
    pub draft_demand: f64,
    pub draft_round_s: f64,
    pub finished: usize,
    /// Requests that arrived in the measured window.
    pub arrived: usize,
    /// Requests still waiting for a slot at the end: a queue that grows means overload.
    pub backlog: usize,
    /// Requests waiting when the warm-up ended (the growth from there to `backlog` tells a
    /// stable queue from one that grows).
    pub backlog_start: usize,
    /// An open load this worker cannot keep up with: its queue grew over the window by more
    /// than a stable queue's noise, or passed [`backlog_cap`] and the simulation stopped there
    /// (the report then covers the time up to the stop).
    pub overloaded: bool,
    pub steps: usize,
}

/// Waiting requests per decoding slot at which an open load's simulation stops, judged
/// overloaded (at least [`MIN_BACKLOG_CAP`] in all): what it queues stays bounded whatever the
/// rate.
pub const BACKLOG_PER_SLOT: usize = 64;
/// The least cap on waiting requests, whatever `max_running`.
pub const MIN_BACKLOG_CAP: usize = 4096;

/// Waiting requests past which an open load's simulation stops (overloaded).
pub fn backlog_cap(max_running: u32) -> usize {
    (max_running as usize)
        .saturating_mul(BACKLOG_PER_SLOT)
        .max(MIN_BACKLOG_CAP)
}

struct Req {
    /// Which set of the mix it belongs to.
    set: usize,
    arrival: f64,
    prompt_left: u32,
    out: u32,
    produced: u32,
    first_token: f64,
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Simulates one target worker. `drafting`: the traffic mix's recorded blocks (each request
/// belongs to one set, drawn by weight, and drafts from its blocks), the draft cost and the
/// extra wait per round the pool adds; `None` decodes without speculation.
pub fn simulate_engine(
    spec: &EngineSpec,
    w: &Workload,
    drafting: Option<(&[BlockSet], &DraftCost, f64)>,
    time: SimTime,
) -> Result<EngineReport> {
    if spec.max_running == 0 || spec.prefill_chunk == 0 || w.output_tokens == 0 {
        return Err(SchedError::Config(
            "planner: max_running, prefill_chunk and output_tokens must be ≥ 1".into(),
        ));
    }
    if !(0.0..1.0).contains(&w.output_spread) {
        return Err(SchedError::Config(
            "planner: output spread in [0, 1)".into(),
        ));
    }
    let max_b = spec.sps.max_batch();
    if max_b <= spec.max_running {
        return Err(SchedError::Config(format!(
            "planner: the SPS table stops at B = {max_b}, not above max_running {}",
            spec.max_running
        )));
    }
    let mut cum_weights = Vec::new();
    if let Some((sets, _, _)) = drafting {
        if sets.is_empty() {
            return Err(SchedError::Config("planner: no recorded blocks".into()));
        }
        let mut total = 0.0;
        for st in sets {
            if st.blocks.is_empty() {
                return Err(SchedError::Config(format!(
                    "planner: no recorded blocks for `{}`",
                    st.name
                )));
            }
            if !(st.weight.is_finite() && st.weight > 0.0) {
                return Err(SchedError::Config(format!(
                    "planner: the weight of `{}` must be > 0",
                    st.name
                )));
            }
            total += st.weight;
            cum_weights.push(total);
        }
        for c in &mut cum_weights {
            *c /= total;
        }
    }
    // Two streams: the traffic (arrivals, answer lengths, sets) is the same whatever the
    // drafting draws, so shapes compared under one seed see the same requests.
    let mut rng = Rng::new(time.seed);
    let mut block_rng = Rng::new(time.seed ^ 0x9E37_79B9_7F4A_7C15);
    let end = time.warmup_s + time.measure_s;
    let new_req = |arrival: f64, rng: &mut Rng| {
        let f = 1.0 + w.output_spread * (2.0 * rng.uniform() - 1.0);
        let u = if cum_weights.len() > 1 {
            rng.uniform()
        } else {
            0.0
        };
        Req {
            set: cum_weights.iter().position(|&c| u < c).unwrap_or(0),
            arrival,
            prompt_left: w.prompt_tokens.max(1),
            out: ((w.output_tokens as f64 * f).round() as u32).max(1),
            produced: 0,
            first_token: 0.0,
        }
    };
    let mut arrived = 0usize;
    let mut waiting: VecDeque<Req> = VecDeque::new();
    let mut running: Vec<Req> = Vec::new();
    let mut next_arrival = f64::INFINITY;
    match w.load {
        Load::Open { rate } => {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(SchedError::Config(
                    "planner: arrival rate must be > 0".into(),
                ));
            }
            next_arrival = -rng.uniform().max(1e-300).ln() / rate;
        }
        Load::Closed { concurrency } => {
            if concurrency == 0 {
                return Err(SchedError::Config(
                    "planner: concurrency must be ≥ 1".into(),
                ));
            }
            for _ in 0..concurrency {
                let r = new_req(0.0, &mut rng);
                arrived += usize::from(time.warmup_s <= 0.0);
                waiting.push_back(r);
            }
        }
    }
    // The real verify policy of a target worker (`DSPARK_VERIFY_POLICY=scheduler`): the same
    // object, fed what the engine feeds it.
    let mut policy = match (spec.verify, drafting) {
        (Verify::Scheduler, Some(_)) => Some(ConfidencePolicy::new(
            spec.sps.clone(),
            Rule::Argmax,
            2,
            u32::MAX,
            spec.max_gamma,
        )),
        _ => None,
    };
    let free_capable =
        drafting.is_some_and(|(s, _, _)| s.iter().any(|s| s.blocks.iter().any(|b| b.copy_run)));
    let mut copy: Vec<bool> = Vec::new();
    let (mut t, mut committed, mut steps) = (0.0f64, 0u64, 0usize);
    let (mut dec_calls, mut dec_tokens) = (0u64, 0u64);
    let (mut draft_busy, mut rounds) = (0.0f64, 0u64);
    let (mut user, mut ttft, mut finished) = (Vec::new(), Vec::new(), 0usize);
    let mut conf_buf: Vec<Vec<f32>> = Vec::new();
    let mut accepted: Vec<u8> = Vec::new();
    // Open loads: a queue past the cap is overload (a stable queue stays far below it), and
    // keeping every arrival of an absurd rate would not fit in memory; the run stops there.
    let max_backlog = backlog_cap(spec.max_running);
    let mut backlog_start: Option<usize> = None;
    let mut overloaded = false;
    while t < end {
        if let Load::Open { rate } = w.load {
            while next_arrival <= t && waiting.len() <= max_backlog {
                let r = new_req(next_arrival, &mut rng);
                arrived += usize::from(r.arrival >= time.warmup_s && r.arrival < end);
                waiting.push_back(r);
                next_arrival += -rng.uniform().max(1e-300).ln() / rate;
            }
            if waiting.len() > max_backlog {
                overloaded = true;
                break;
            }
            if running.is_empty() && waiting.is_empty() {
                t = next_arrival;
                continue;
            }
        }
        while running.len() < spec.max_running as usize {
            match waiting.pop_front() {
                Some(r) => running.push(r),
                None => break,
            }
        }
        // The engine's step, as `specdec::Engine` plans it: decoding requests first (each its
        // pending token plus its drafts), then prompt chunks in what room is left.
        let decoding: Vec<usize> = (0..running.len())
            .filter(|&i| running[i].prompt_left == 0)
            .collect();
        let n_dec = decoding.len();
        let mut budget = max_b;
        // Per decoding request: drafts asked for (k), and the block it draws.
        let mut ks = vec![0u32; n_dec];
        // Decoding requests this step holds (the engine leaves out those the budget cannot fit).
        let mut active = vec![false; n_dec];
        let mut free = false;
        if let Some((sets, _, _)) = drafting {
            let (mut cap, mut width) = (spec.max_gamma as u32, usize::MAX);
            if n_dec > 0 {
                if let Some(p) = policy.as_mut() {
                    match p.planned() {
                        Some(0) if free_capable => free = true,
                        Some(kt) => (cap, width) = (kt as u32, p.draft_width(kt)),
                        None => {
                            if let Some((n, k)) = p.probe() {
                                (width, cap) = (n, k as u32);
                            }
                        }
                    }
                }
            }
            let from = if width < n_dec { steps % n_dec } else { 0 };
            // The engine's fairness rule, formula for formula: each window leaves one token
            // for every later decoding request and, while a prompt is still prefilling, a
            // chunk's reserve; otherwise the first requests' blocks take the whole step.
            let mut later = n_dec as u32;
            let reserve = if running.iter().any(|r| r.prompt_left > 0) {
                spec.prefill_chunk.min(max_b / 4).max(1)
            } else {
                0
            };
            for (di, &i) in decoding.iter().enumerate() {
                if budget == 0 {
                    break;
                }
                later = later.saturating_sub(1);
                let share = budget.saturating_sub(1 + later + reserve);
                let probed = width >= n_dec || (di + n_dec - from) % n_dec < width;
                let gamma = match spec.verify {
                    Verify::Fixed(k) => k as u32,
                    Verify::Scheduler => spec.max_gamma as u32,
                };
                let r = &running[i];
                let k = if probed { gamma.min(cap) } else { 0 }
                    .min((r.out - r.produced).saturating_sub(1))
                    .min(budget - 1)
                    .min(share);
                ks[di] = k;
                active[di] = true;
                budget -= if free { 1 } else { 1 + k };
            }
            conf_buf.clear();
            accepted.clear();
            copy.clear();
            for (di, &k) in ks.iter().enumerate() {
                let blocks = &sets[running[decoding[di]].set].blocks;
                let b = &blocks[block_rng.below(blocks.len())];
                let usable = if free && !b.copy_run { 0 } else { b.conf.len() };
                let n = (k as usize).min(usable);
                conf_buf.push(b.conf[..n].to_vec());
                accepted.push(b.accepted.min(n as u8));
                copy.push(b.copy_run);
            }
        } else {
            let n = (n_dec as u32).min(budget);
            active[..n as usize].fill(true);
            budget -= n;
        }
        let n_active = active.iter().filter(|&&a| a).count();
        // Prompt chunks: at most `prefill_chunk` per request, in the room left.
        let mut prefill = 0u32;
        let mut prefill_done = Vec::new();
        for (i, r) in running.iter_mut().enumerate() {
            if r.prompt_left > 0 && budget > 0 {
                let take = r.prompt_left.min(spec.prefill_chunk).min(budget);
                r.prompt_left -= take;
                budget -= take;
                prefill += take;
                if r.prompt_left == 0 {
                    prefill_done.push(i);
                }
            }
        }
        // Free drafts fit in what the chunks left.
        let mut free_room = if free { budget } else { 0 };
        if free {
            for c in conf_buf.iter_mut() {
                let n = c.len().min(free_room as usize);
                c.truncate(n);
                free_room -= n as u32;
            }
            for (a, c) in accepted.iter_mut().zip(&conf_buf) {
                *a = (*a).min(c.len() as u8);
            }
        }
        let drafting_idx: Vec<usize> = (0..conf_buf.len())
            .filter(|&j| !conf_buf[j].is_empty())
            .collect();
        // Drafting time: a round for the requests whose block is not a copy run.
        let mut draft_s = 0.0;
        if let Some((_, cost, wait)) = drafting {
            let n_net = drafting_idx.iter().filter(|&&j| !copy[j]).count() as u32;
            if !free && n_net > 0 {
                let block = drafting_idx
                    .iter()
                    .map(|&j| conf_buf[j].len())
                    .max()
                    .unwrap_or(0) as u8;
                let d = cost.seconds(block, n_net);
                draft_s = d + spec.hop_s + wait;
                if let Some(p) = policy.as_mut() {
                    p.observe_draft(draft_s, drafting_idx.len(), block as usize);
                }
                if t >= time.warmup_s {
                    draft_busy += d;
                    rounds += 1;
                }
            }
        }
        // Verification lengths: the policy trims the blocks (confidences only); fixed lengths
        // verify every drafted token.
        let mut verify = vec![0u32; n_dec];
        match policy.as_mut() {
            // Every step, as the engine does (with no drafts too: a step without confidences
            // moves the policy's two-step budget queue on).
            Some(p) => {
                let refs: Vec<&[f32]> = drafting_idx
                    .iter()
                    .map(|&j| conf_buf[j].as_slice())
                    .collect();
                let plain = n_active - drafting_idx.len();
                let k = if free {
                    p.select_free(&refs, prefill as usize, plain, usize::MAX / 2)
                } else {
                    p.select(&refs, prefill as usize, plain, usize::MAX / 2)
                };
                for (x, &j) in drafting_idx.iter().enumerate() {
                    verify[j] =
                        (k.get(x).copied().unwrap_or(0) as u32).min(conf_buf[j].len() as u32);
                }
            }
            None => {
                for &j in &drafting_idx {
                    verify[j] = conf_buf[j].len() as u32;
                }
            }
        }
        // Within the table by construction: every token above came out of `budget`.
        let batch = n_active as u32 + verify.iter().sum::<u32>() + prefill;
        let fwd_s = spec.sps.seconds(batch.max(1));
        let step_s = fwd_s + draft_s;
        if let Some(p) = policy.as_mut() {
            p.observe_step(fwd_s, batch as usize);
            if verify.iter().any(|&v| v > 0) {
                let mut expected = 0.0f64;
                let mut got = 0usize;
                for &j in &drafting_idx {
                    let mut a = 1.0f64;
                    for &c in &conf_buf[j][..verify[j] as usize] {
                        a *= c as f64;
                        expected += a;
                    }
                    got += verify[j].min(accepted[j] as u32) as usize;
                }
                p.observe_outcome(expected, got, free);
            }
        }
        let ks = verify;
        t += step_s;
        steps += 1;
        let measured = t >= time.warmup_s && t <= end;
        for (j, &i) in decoding.iter().enumerate() {
            if !active[j] {
                continue;
            }
            let r = &mut running[i];
            let acc = accepted.get(j).copied().unwrap_or(0) as u32;
            let n = (1 + ks[j].min(acc)).min(r.out - r.produced);
            r.produced += n;
            if measured {
                committed += n as u64;
                dec_calls += 1;
                dec_tokens += n as u64;
            }
        }
        for &i in &prefill_done {
            let r = &mut running[i];
            r.produced = 1;
            r.first_token = t;
            if measured {
                committed += 1;
            }
        }
        let mut i = 0;
        while i < running.len() {
            let r = &running[i];
            if r.prompt_left == 0 && r.produced >= r.out {
                if r.arrival >= time.warmup_s && measured {
                    finished += 1;
                    ttft.push(r.first_token - r.arrival);
                    if r.out > 1 && t > r.first_token {
                        user.push((r.out - 1) as f64 / (t - r.first_token));
                    }
                } else if r.arrival >= time.warmup_s && r.arrival < end && t > end {
                    // Arrived in the window, finished in the step that ran past it: its first
                    // token is known, and counts like those still in flight (below).
                    ttft.push(r.first_token - r.arrival);
                }
                running.swap_remove(i);
                if let Load::Closed { .. } = w.load {
                    let r = new_req(t, &mut rng);
                    arrived += usize::from(r.arrival >= time.warmup_s && r.arrival < end);
                    waiting.push_back(r);
                }
            } else {
                i += 1;
            }
        }
        // Measured at the same point of a step as the final backlog (after it, before the
        // arrivals it let in), so that the two compare.
        if backlog_start.is_none() && t >= time.warmup_s {
            backlog_start = Some(waiting.len());
        }
    }
    if let Load::Open { .. } = w.load {
        // Over the window a stable queue's backlog moves by noise: arrivals are Poisson, so
        // their count over n arrivals is off by ~sqrt(n), and service times add a variance of
        // the same order; the queue's drift pulls it back. An overloaded one grows linearly,
        // by (λ − μ)·window, which passes 3·sqrt(n) once the window is long enough (n ≳
        // 9/(1 − μ/λ)² arrivals: about 90 000 at 1 % above capacity). The end-of-window check
        // in `evaluate` (more waiting than slots) alone let such a queue through whenever the
        // window ended before it passed max_running.
        let start = backlog_start.unwrap_or(0);
        let growth = waiting.len() as f64 - start as f64;
        if growth > 3.0 * (arrived.max(1) as f64).sqrt() {
            overloaded = true;
        }
    }
    // Time to first token over every request that arrived in the window, not only those that
    // finished in it (which leaves out the ones that waited longest): those still in flight
    // count with their first token, those not started with a lower bound (now − arrival).
    let now = t.min(end);
    for r in running.iter().chain(waiting.iter()) {
        if r.arrival >= time.warmup_s && r.arrival < end {
            ttft.push(if r.prompt_left == 0 {
                r.first_token - r.arrival
            } else {
                (now - r.arrival).max(0.0)
            });
        }
    }
    let span = time.measure_s.max(1e-9);
    Ok(EngineReport {
        tok_s: committed as f64 / span,
        user_tok_s_p50: quantile(&mut user, 0.5),
        user_tok_s_p10: quantile(&mut user, 0.1),
        ttft_p50_s: quantile(&mut ttft, 0.5),
        ttft_p90_s: quantile(&mut ttft, 0.9),
        committed_per_call: if dec_calls > 0 {
            dec_tokens as f64 / dec_calls as f64
        } else {
            0.0
        },
        draft_demand: draft_busy / span,
        draft_round_s: if rounds > 0 {
            draft_busy / rounds as f64
        } else {
            0.0
        },
        finished,
        arrived,
        backlog: waiting.len(),
        backlog_start: backlog_start.unwrap_or(0),
        overloaded,
        steps,
    })
}

/// The service level a plan must meet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slo {
    /// Median decode rate per request (tokens/s) at least this.
    pub min_user_tok_s: f64,
    /// 90th-percentile time to first token at most this (seconds).
    pub max_ttft_p90_s: f64,
}

/// One cluster shape, simulated.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolReport {
    pub targets: u32,
    pub drafts: u32,
    /// One target worker's report (each carries 1/targets of the load).
    pub engine: EngineReport,
    /// Cluster tokens/s.
    pub tok_s: f64,
    /// Draft pool utilization ρ (0 without drafts).
    pub draft_util: f64,
    pub cost: f64,
    pub feasible: bool,
    /// Why not, when not.
    pub reason: String,
}

/// Arrivals one simulated engine sees at least, under an open load.
pub const MIN_REQUESTS: f64 = 2000.0;
/// Longest simulated window (seconds).
pub const MAX_MEASURE_S: f64 = 3600.0;

/// Everything a plan is computed from.
#[derive(Clone, Copy)]
pub struct Scenario<'a> {
    pub spec: &'a EngineSpec,
    pub workload: Workload,
    /// Recorded verifications of the drafter, by kind of traffic (the mix).
    pub blocks: &'a [BlockSet],
    pub cost: &'a DraftCost,
    pub time: SimTime,
    pub slo: Slo,
    /// Price of one target worker, of one draft worker.
    pub prices: (f64, f64),
}

/// Longest queueing wait per drafting round the pool solver considers (seconds): a pool that
/// would need more is saturated.
pub const MAX_WAIT_S: f64 = 1.0;

/// Mean queueing wait of an M/D/c queue with `c` servers, offered `a` = λ·s server-seconds
/// per second, service time `s`: the Erlang-C wait of M/M/c halved (exact for c = 1, the
/// usual approximation above it); infinite when a ≥ c (saturated), and wherever the wait
/// is not a finite number.
pub fn mdc_wait(c: u32, a: f64, s: f64) -> f64 {
    if a <= 0.0 || s <= 0.0 {
        return 0.0;
    }
    let c_f = c as f64;
    if a >= c_f || a.is_nan() {
        return f64::INFINITY;
    }
    // Erlang B by its recursion, B_0 = 1, B_k = a·B_{k−1} / (k + a·B_{k−1}): every B_k lies
    // in (0, 1], where the series Σ a^k/k! overflows (to inf/inf = NaN) once a passes ~710.
    // Then Erlang C = c·B / (c − a·(1 − B)), the denominator > 0 since a < c.
    let mut b = 1.0f64;
    for k in 1..=c {
        let ab = a * b;
        b = ab / (k as f64 + ab);
    }
    let erlang_c = c_f * b / (c_f - a * (1.0 - b));
    let wait = erlang_c * s / (c_f - a) / 2.0;
    if wait.is_finite() {
        wait
    } else {
        f64::INFINITY
    }
}

/// Simulates `targets` target workers sharing `drafts` draft workers (0: no speculation, as
/// target workers deployed with their local fallback drafter off: `dspark plan` says so).
pub fn evaluate(sc: &Scenario<'_>, targets: u32, drafts: u32) -> Result<PoolReport> {
    let (spec, w, blocks, cost) = (sc.spec, &sc.workload, sc.blocks, sc.cost);
    let (time, slo, prices) = (sc.time, sc.slo, sc.prices);
    if targets == 0 {
        return Err(SchedError::Config(
            "planner: at least one target worker".into(),
        ));
    }
    // Engine classes (how many engines, at which load): an open load splits evenly; a closed
    // one puts ⌈c/T⌉ requests on c mod T engines and ⌊c/T⌋ on the rest (idle ones left out).
    let classes: Vec<(u32, Workload)> = match w.load {
        Load::Open { rate } => vec![(
            targets,
            Workload {
                load: Load::Open {
                    rate: rate / targets as f64,
                },
                ..*w
            },
        )],
        Load::Closed { concurrency } => {
            let (lo, hi_n) = (concurrency / targets, concurrency % targets);
            [(hi_n, lo + 1), (targets - hi_n, lo)]
                .into_iter()
                .filter(|&(n, c)| n > 0 && c > 0)
                .map(|(n, c)| {
                    let load = Load::Closed { concurrency: c };
                    (n, Workload { load, ..*w })
                })
                .collect()
        }
    };
    if classes.is_empty() {
        return Err(SchedError::Config(
            "planner: concurrency must be ≥ 1".into(),
        ));
    }
    // One engine's share of an open load must see enough requests that T × its rate is not
    // T × its noise: at least MIN_REQUESTS arrivals in the measured window.
    let time = match classes[0].1.load {
        Load::Open { rate } => SimTime {
            measure_s: time.measure_s.max(MIN_REQUESTS / rate).min(MAX_MEASURE_S),
            ..time
        },
        Load::Closed { .. } => time,
    };
    let run = |wait: Option<f64>| -> Result<Vec<(u32, EngineReport)>> {
        classes
            .iter()
            .map(|(n, cw)| {
                let d = wait.map(|x| (blocks, cost, x));
                Ok((*n, simulate_engine(spec, cw, d, time)?))
            })
            .collect()
    };
    let (mut util, mut saturated) = (0.0, false);
    let mut reports;
    if drafts == 0 {
        reports = run(None)?;
    } else {
        // The wait a round spends in the pool's queue slows the rounds that make the queue:
        // solve wait = W(rounds(wait)) by bisection (W falls as the wait grows).
        let pool = |r: &[(u32, EngineReport)]| {
            let demand: f64 = r.iter().map(|(n, e)| *n as f64 * e.draft_demand).sum();
            let rounds: f64 = r
                .iter()
                .filter(|(_, e)| e.draft_round_s > 0.0)
                .map(|(n, e)| *n as f64 * e.draft_demand / e.draft_round_s)
                .sum();
            let mean = if rounds > 0.0 { demand / rounds } else { 0.0 };
            (demand / drafts as f64, mdc_wait(drafts, demand, mean))
        };
        let r0 = run(Some(0.0))?;
        let (rho0, w0) = pool(&r0);
        (reports, util) = (r0, rho0);
        if w0 > 1e-9 {
            let (mut lo, mut hi) = (0.0f64, MAX_WAIT_S);
            let rh = run(Some(hi))?;
            let (rho_h, wh) = pool(&rh);
            if wh > hi {
                // Even a queue this long does not slow the rounds enough: the pool cannot keep up.
                (saturated, util, reports) = (true, rho_h, rh);
            } else {
                for _ in 0..24 {
                    let mid = 0.5 * (lo + hi);
                    let r = run(Some(mid))?;
                    let (rho, wm) = pool(&r);
                    (reports, util) = (r, rho);
                    if wm > mid {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                    if hi - lo <= 1e-3 * hi.max(1e-6) {
                        break;
                    }
                }
            }
        }
    }
    // The busiest engine speaks for the SLO; the cluster's rate is every engine's.
    let tok_s: f64 = reports.iter().map(|(n, e)| *n as f64 * e.tok_s).sum();
    let engine = reports.first().map(|r| r.1.clone()).unwrap_or_default();
    let mut reason = Vec::new();
    if saturated {
        reason.push(format!("draft pool saturated (ρ = {util:.2})"));
    }
    let open = matches!(w.load, Load::Open { .. });
    let max_backlog = backlog_cap(spec.max_running);
    if open && engine.backlog > max_backlog {
        reason.push(format!(
            "queue grows without bound (over {max_backlog} waiting: simulation stopped)"
        ));
    } else if open && (engine.overloaded || engine.backlog > spec.max_running as usize) {
        reason.push(format!(
            "queue grows ({} waiting after warm-up, {} at the end)",
            engine.backlog_start, engine.backlog
        ));
    }
    if engine.finished == 0 {
        reason.push("no request finished in the window".into());
    }
    if engine.user_tok_s_p50 < slo.min_user_tok_s {
        reason.push(format!(
            "median {:.1} tok/s per user < {:.1}",
            engine.user_tok_s_p50, slo.min_user_tok_s
        ));
    }
    if engine.ttft_p90_s > slo.max_ttft_p90_s {
        reason.push(format!(
            "TTFT p90 {:.0} ms > {:.0} ms",
            engine.ttft_p90_s * 1e3,
            slo.max_ttft_p90_s * 1e3
        ));
    }
    Ok(PoolReport {
        targets,
        drafts,
        tok_s,
        draft_util: util,
        cost: targets as f64 * prices.0 + drafts as f64 * prices.1,
        feasible: reason.is_empty(),
        reason: reason.join("; "),
        engine,
    })
}

/// Every shape up to the limits, and the cheapest feasible one (ties: more tokens/s).
pub struct Plan {
    pub shapes: Vec<PoolReport>,
    pub best: Option<usize>,
}

pub fn plan(sc: &Scenario<'_>, max_targets: u32, max_drafts: u32) -> Result<Plan> {
    let mut shapes = Vec::new();
    for t in 1..=max_targets {
        for d in 0..=max_drafts {
            shapes.push(evaluate(sc, t, d)?);
        }
    }
    let best = shapes
        .iter()
        .enumerate()
        .filter(|(_, s)| s.feasible)
        .min_by(|(_, a), (_, b)| a.cost.total_cmp(&b.cost).then(b.tok_s.total_cmp(&a.tok_s)))
        .map(|(i, _)| i);
    Ok(Plan { shapes, best })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> EngineSpec {
        // A CPU-like cost, profiled at every B (no free room up to a stair): a step costs
        // 5 ms + 1 ms per token.
        let pts = (1u32..=256)
            .map(|b| (b, 1.0 / (0.005 + 0.001 * b as f64)))
            .collect();
        EngineSpec {
            sps: SpsTable::new(pts).unwrap(),
            max_running: 16,
            prefill_chunk: 64,
            max_gamma: 7,
            verify: Verify::Scheduler,
            hop_s: 0.0,
        }
    }

    fn blocks(conf: f32, accepted: u8, n: usize) -> Vec<BlockSet> {
        BlockSet::only(
            (0..n)
                .map(|_| Block {
                    conf: vec![conf; 7],
                    accepted,
                    copy_run: false,
                })
                .collect(),
        )
    }

    const T: SimTime = SimTime {
        warmup_s: 2.0,
        measure_s: 20.0,
        seed: 7,
    };
    const LOOSE: Slo = Slo {
        min_user_tok_s: 0.0,
        max_ttft_p90_s: f64::INFINITY,
    };

    fn closed(c: u32) -> Workload {
        Workload {
            load: Load::Closed { concurrency: c },
            prompt_tokens: 32,
            output_tokens: 64,
            output_spread: 0.0,
        }
    }

    #[test]
    fn a_lone_request_decodes_at_the_table_rate() {
        // Closed loop, one request: every step is B = 1 (6 ms) apart from its prefill.
        let r = simulate_engine(&spec(), &closed(1), None, T).unwrap();
        let per_token = 0.006;
        assert!((r.user_tok_s_p50 * per_token - 1.0).abs() < 0.01, "{r:?}");
        assert!((r.committed_per_call - 1.0).abs() < 1e-9);
        // Prefill of 32 tokens in one 37 ms step, then 63 decode steps: 64 tokens per 0.415 s.
        let want = 64.0 / (0.037 + 63.0 * per_token);
        assert!((r.tok_s / want - 1.0).abs() < 0.03, "{} vs {want}", r.tok_s);
    }

    #[test]
    fn shapes_compared_under_one_seed_see_the_same_requests() {
        // Drafting draws its blocks from a stream of its own: how many it draws (which depends
        // on what was accepted) leaves the arrivals alone.
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let w = Workload {
            load: Load::Open { rate: 20.0 },
            prompt_tokens: 32,
            output_tokens: 64,
            output_spread: 0.5,
        };
        let never = blocks(0.9, 0, 16);
        let always = blocks(0.9, 7, 16);
        let a = simulate_engine(&spec(), &w, Some((&never, &free, 0.0)), T).unwrap();
        let b = simulate_engine(&spec(), &w, Some((&always, &free, 0.0)), T).unwrap();
        let c = simulate_engine(&spec(), &w, None, T).unwrap();
        assert!(a.arrived > 300, "{a:?}");
        assert_eq!(a.arrived, b.arrived);
        assert_eq!(a.arrived, c.arrived);
        assert!(
            b.committed_per_call > a.committed_per_call + 1.0,
            "{a:?} {b:?}"
        );
    }

    #[test]
    fn drafts_that_are_never_accepted_are_never_verified() {
        // Honest confidences near 0 on a table without free room: admission verifies nothing,
        // so speculation costs only the drafting calls it never makes (a round is skipped when
        // no request verifies a draft). (On a staircase it would fill a stair's free room.)
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let plain = simulate_engine(&spec(), &closed(8), None, T).unwrap();
        let b = blocks(0.001, 0, 64);
        let spec_r = simulate_engine(&spec(), &closed(8), Some((&b, &free, 0.0)), T).unwrap();
        assert!((spec_r.committed_per_call - 1.0).abs() < 1e-9);
        assert!(
            (spec_r.tok_s / plain.tok_s - 1.0).abs() < 0.01,
            "{spec_r:?} vs {plain:?}"
        );
    }

    #[test]
    fn accepted_confident_drafts_multiply_what_a_step_commits() {
        // Every drafted token accepted with confidence 0.95: at c = 1 admission verifies long
        // blocks and each step commits several tokens, at little extra cost per step.
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let b = blocks(0.95, 7, 64);
        let plain = simulate_engine(&spec(), &closed(1), None, T).unwrap();
        let r = simulate_engine(&spec(), &closed(1), Some((&b, &free, 0.0)), T).unwrap();
        assert!(r.committed_per_call > 4.0, "{r:?}");
        assert!(
            r.tok_s > 2.5 * plain.tok_s,
            "{} vs {}",
            r.tok_s,
            plain.tok_s
        );
        // A draft that is confidently wrong: verified, rejected, one token per step.
        let liar = blocks(0.95, 0, 64);
        let l = simulate_engine(&spec(), &closed(1), Some((&liar, &free, 0.0)), T).unwrap();
        assert!((l.committed_per_call - 1.0).abs() < 1e-9);
        assert!(l.tok_s < plain.tok_s);
    }

    #[test]
    fn a_small_draft_pool_queues_and_more_drafts_relieve_it() {
        // Fixed blocks of 3, each round 20 ms: four target workers at c = 4 each ask for more
        // than one draft worker gives; the closed loop slows down behind the pool's queue
        // until it balances (ρ near 1), which the per-user SLO refuses. (The scheduler policy
        // would stop drafting at that price instead.)
        let slow = DraftCost::flat(vec![(1, 0.02), (4, 0.02)]).unwrap();
        let b = blocks(0.9, 5, 64);
        let mut s = spec();
        s.verify = Verify::Fixed(3);
        let sc = Scenario {
            spec: &s,
            workload: closed(16),
            blocks: &b,
            cost: &slow,
            time: T,
            slo: Slo {
                min_user_tok_s: 60.0,
                max_ttft_p90_s: f64::INFINITY,
            },
            prices: (1.0, 1.0),
        };
        let one = evaluate(&sc, 4, 1).unwrap();
        let many = evaluate(&sc, 4, 8).unwrap();
        assert!(one.draft_util > 0.8 && one.draft_util < 1.0, "{one:?}");
        assert!(!one.feasible && one.reason.contains("per user"), "{one:?}");
        assert!(many.feasible, "{many:?}");
        assert!(
            many.draft_util < 0.5 && many.tok_s > 1.5 * one.tok_s,
            "{many:?}"
        );
        // An open load the pool cannot serve at any wait is refused as saturated.
        let open = Scenario {
            workload: Workload {
                load: Load::Open { rate: 400.0 },
                ..closed(1)
            },
            slo: LOOSE,
            ..sc
        };
        let r = evaluate(&open, 4, 1).unwrap();
        assert!(!r.feasible, "{r:?}");
    }

    #[test]
    fn mdc_wait_matches_md1_and_falls_with_servers() {
        let (rho, s) = (0.6, 0.01);
        assert!((mdc_wait(1, rho, s) - rho * s / (2.0 * (1.0 - rho))).abs() < 1e-12);
        let w: Vec<f64> = (1..=4).map(|c| mdc_wait(c, 0.9, s)).collect();
        assert!(w.windows(2).all(|p| p[1] < p[0]), "{w:?}");
        assert!(mdc_wait(2, 2.0, s).is_infinite());
        assert_eq!(mdc_wait(3, 0.0, s), 0.0);
    }

    #[test]
    fn mdc_wait_stays_finite_for_large_pools_and_matches_the_series() {
        // The series a^k/k! overflowed past a ≈ 710: inf/inf = NaN, read as no queue.
        let w = mdc_wait(800, 790.0, 0.01);
        assert!(w.is_finite() && w > 0.0, "{w}");
        assert!(mdc_wait(800, 799.0, 0.01) > w);
        assert!(mdc_wait(800, 800.0, 0.01).is_infinite());
        assert!(mdc_wait(800, f64::NAN, 0.01).is_infinite());
        // Where the series does not overflow, the recursion gives what it gave.
        let series = |c: u32, a: f64, s: f64| {
            let c_f = c as f64;
            let (mut sum, mut term) = (0.0f64, 1.0f64);
            for k in 0..c {
                sum += term;
                term *= a / (k as f64 + 1.0);
            }
            let tail = term * c_f / (c_f - a);
            tail / (sum + tail) * s / (c_f - a) / 2.0
        };
        for c in 1..=20u32 {
            for f in [0.05, 0.3, 0.6, 0.9, 0.99] {
                let a = f * c as f64;
                let (x, y) = (mdc_wait(c, a, 0.01), series(c, a, 0.01));
                assert!((x / y - 1.0).abs() < 1e-9, "c {c} a {a}: {x} vs {y}");
            }
        }
    }

    /// A wide, cheap worker: a step costs 1 ms + 1 µs per token (linear between the two
    /// points), `m` requests decoded at once.
    fn wide(m: u32) -> EngineSpec {
        let top = 16_384u32;
        EngineSpec {
            sps: SpsTable::new(vec![
                (1, 1.0 / 0.001_001),
                (top, 1.0 / (0.001 + 1e-6 * top as f64)),
            ])
            .unwrap(),
            max_running: m,
            prefill_chunk: 1,
            max_gamma: 7,
            verify: Verify::Scheduler,
            hop_s: 0.0,
        }
    }

    #[test]
    fn an_open_load_just_past_capacity_is_refused_and_one_below_is_served() {
        // One-token prompts and four-token answers on 16 000 slots: a full worker steps 16 000
        // tokens (17 ms) whatever the phase of its requests and finishes 4 000 of them a step,
        // so its capacity μ is the closed loop's. At 1.01 μ the queue grows ~2 400 a second:
        // ~9 500 over the 4 s window (~950 000 arrivals), well above 3·sqrt(n) ≈ 2 900, yet
        // still under the 16 000 slots the end-of-window check alone compared it with.
        let m = 16_000u32;
        let s = wide(m);
        let w = |load: Load| Workload {
            load,
            prompt_tokens: 1,
            output_tokens: 4,
            output_spread: 0.0,
        };
        let closed_t = SimTime {
            warmup_s: 2.0,
            measure_s: 20.0,
            seed: 7,
        };
        let mu = simulate_engine(&s, &w(Load::Closed { concurrency: m }), None, closed_t)
            .unwrap()
            .tok_s
            / 4.0;
        assert!((mu / (4000.0 / 0.017) - 1.0).abs() < 0.01, "{mu}");
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let base = Scenario {
            spec: &s,
            workload: w(Load::Open { rate: mu }),
            blocks: &[],
            cost: &free,
            time: SimTime {
                warmup_s: 2.0,
                measure_s: 4.0,
                seed: 7,
            },
            slo: LOOSE,
            prices: (1.0, 1.0),
        };
        let over = Scenario {
            workload: w(Load::Open { rate: 1.01 * mu }),
            ..base
        };
        let r = evaluate(&over, 1, 0).unwrap();
        assert!(!r.feasible && r.engine.overloaded, "{r:?}");
        assert!(r.reason.contains("queue grows"), "{r:?}");
        // What the end-of-window check alone saw: fewer waiting than slots.
        assert!(r.engine.backlog < m as usize, "{r:?}");
        let under = Scenario {
            workload: w(Load::Open { rate: 0.8 * mu }),
            ..base
        };
        let r = evaluate(&under, 1, 0).unwrap();
        assert!(r.feasible && !r.engine.overloaded, "{r:?}");
    }

    #[test]
    fn requests_still_queued_at_the_end_count_in_the_ttft() {
        // 40 requests/s on a worker that serves ~9: after 20 s of warm-up the queue holds over
        // a minute of work, and nothing arriving in the 4 s window starts in it. Each waited
        // at least its time in the window (p90 ≈ 0.9 × 4 s, p50 ≈ 2 s); counted from the
        // finished ones only, the TTFT was that of none: 0.
        let t = SimTime {
            warmup_s: 20.0,
            measure_s: 4.0,
            seed: 7,
        };
        let w = Workload {
            load: Load::Open { rate: 40.0 },
            ..closed(1)
        };
        let r = simulate_engine(&spec(), &w, None, t).unwrap();
        assert_eq!(r.finished, 0, "{r:?}");
        assert!(r.ttft_p90_s > 3.0 && r.ttft_p90_s <= 4.0, "{r:?}");
        assert!(r.ttft_p50_s > 1.5 && r.ttft_p50_s < 2.5, "{r:?}");
    }

    #[test]
    fn an_absurd_rate_stops_at_the_backlog_cap() {
        // 10^5 requests/s on a worker that serves ~9: kept whole, 2.2 million requests would
        // queue over the window (220 million at 10^7/s). The run stops once the queue passes
        // the cap, judged overloaded.
        let w = Workload {
            load: Load::Open { rate: 1e5 },
            ..closed(1)
        };
        let r = simulate_engine(&spec(), &w, None, T).unwrap();
        assert!(r.overloaded && r.backlog == backlog_cap(16) + 1, "{r:?}");
        let b = blocks(0.9, 3, 8);
        let c = DraftCost::flat(vec![(1, 0.001)]).unwrap();
        let s = spec();
        let sc = Scenario {
            spec: &s,
            workload: Workload {
                load: Load::Open { rate: 1e7 },
                ..closed(1)
            },
            blocks: &b,
            cost: &c,
            time: T,
            slo: LOOSE,
            prices: (1.0, 1.0),
        };
        for d in [0, 1] {
            let p = evaluate(&sc, 1, d).unwrap();
            assert!(!p.feasible && p.reason.contains("without bound"), "{p:?}");
        }
    }

    #[test]
    fn a_closed_load_splits_unevenly_without_inventing_requests() {
        // Three requests on two target workers: one engine holds two, the other one. The
        // cluster's rate is theirs, not two engines of two each.
        let sc = Scenario {
            spec: &spec(),
            workload: closed(3),
            blocks: &[],
            cost: &DraftCost::flat(vec![(1, 0.0)]).unwrap(),
            time: T,
            slo: LOOSE,
            prices: (1.0, 1.0),
        };
        let two = simulate_engine(&spec(), &closed(2), None, T).unwrap();
        let one = simulate_engine(&spec(), &closed(1), None, T).unwrap();
        let r = evaluate(&sc, 2, 0).unwrap();
        assert!((r.tok_s - (two.tok_s + one.tok_s)).abs() < 1e-6, "{r:?}");
        // More target workers than requests: the idle ones add nothing.
        let r = evaluate(&sc, 5, 0).unwrap();
        assert!((r.tok_s - 3.0 * one.tok_s).abs() < 1e-6, "{r:?}");
    }

    #[test]
    fn open_load_beyond_capacity_is_refused_and_more_targets_serve_it() {
        // One worker decodes ~16 × 48 tok/s at most; 60 requests/s of 64 tokens is ~3800 tok/s.
        let w = Workload {
            load: Load::Open { rate: 60.0 },
            prompt_tokens: 32,
            output_tokens: 64,
            output_spread: 0.5,
        };
        let b = blocks(0.5, 1, 8);
        let c = DraftCost::flat(vec![(1, 0.0005)]).unwrap();
        let slo = Slo {
            min_user_tok_s: 20.0,
            max_ttft_p90_s: 1.0,
        };
        let s = spec();
        let sc = Scenario {
            spec: &s,
            workload: w,
            blocks: &b,
            cost: &c,
            time: T,
            slo,
            prices: (4.0, 1.0),
        };
        let p = plan(&sc, 8, 1).unwrap();
        let one = &p.shapes[0];
        assert!(!one.feasible, "{one:?}");
        let best = &p.shapes[p.best.expect("some shape serves it")];
        assert!(best.targets > 1 && best.feasible);
        // Cheapest: no feasible shape costs less.
        for s in &p.shapes {
            assert!(!s.feasible || s.cost >= best.cost, "{s:?} beats {best:?}");
        }
        // Served load: what arrives, ~60 × 64 tokens/s.
        assert!(
            (best.tok_s / (60.0 * 64.0) - 1.0).abs() < 0.1,
            "{}",
            best.tok_s
        );
    }

    #[test]
    fn a_traffic_mix_commits_between_its_parts_by_their_weights() {
        // Some requests draft blocks accepted in full, the rest blocks never accepted; fixed
        // blocks of 3, so every step verifies 3 per request.
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let mut s = spec();
        s.verify = Verify::Fixed(3);
        let good = blocks(0.9, 7, 16).remove(0).blocks;
        let bad = blocks(0.9, 0, 16).remove(0).blocks;
        let mix = |wg: f64, wb: f64| {
            vec![
                BlockSet {
                    name: "good".into(),
                    weight: wg,
                    blocks: good.clone(),
                },
                BlockSet {
                    name: "bad".into(),
                    weight: wb,
                    blocks: bad.clone(),
                },
            ]
        };
        // A long window, so the shares the mix draws come near its weights (about 9000 requests
        // at half and half: the share's σ ≈ 0.5 %, about 1 % of what a call commits).
        let long = SimTime {
            measure_s: 2000.0,
            ..T
        };
        let run = |m: &[BlockSet]| {
            simulate_engine(&s, &closed(8), Some((m, &free, 0.0)), long)
                .unwrap()
                .committed_per_call
        };
        let (all_good, all_bad) = (run(&mix(1.0, 1e-9)), run(&mix(1e-9, 1.0)));
        assert!(
            all_good > 3.5 && (all_bad - 1.0).abs() < 1e-9,
            "{all_good} {all_bad}"
        );
        // Per request the same tokens, in 1/rate steps: the mix commits the weighted harmonic
        // mean per call (the slow kind holds the batch longer).
        let want = |wg: f64| 1.0 / (wg / all_good + (1.0 - wg) / all_bad);
        let half = run(&mix(1.0, 1.0));
        assert!(
            (half / want(0.5) - 1.0).abs() < 0.03,
            "{half} vs {}",
            want(0.5)
        );
        let quarter = run(&mix(1.0, 3.0));
        assert!(
            (quarter / want(0.25) - 1.0).abs() < 0.03,
            "{quarter} vs {}",
            want(0.25)
        );
        let mut zero = mix(1.0, 1.0);
        zero[1].weight = 0.0;
        assert!(simulate_engine(&s, &closed(1), Some((&zero, &free, 0.0)), T).is_err());
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(DraftCost::new(vec![]).is_err());
        assert!(DraftCost::new(vec![(1, 0, 0.1)]).is_err());
        assert!(DraftCost::new(vec![(0, 1, 0.1)]).is_err());
        assert!(DraftCost::flat(vec![(1, f64::NAN)]).is_err());
        let mut w = closed(1);
        w.output_spread = 1.5;
        assert!(simulate_engine(&spec(), &w, None, T).is_err());
        let w = Workload {
            load: Load::Open { rate: 0.0 },
            ..closed(1)
        };
        assert!(simulate_engine(&spec(), &w, None, T).is_err());
        let c = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        assert!(simulate_engine(&spec(), &closed(1), Some((&[], &c, 0.0)), T).is_err());
        let mut s = spec();
        s.max_running = 300;
        assert!(simulate_engine(&s, &closed(1), None, T).is_err());
    }

    #[test]
    fn draft_cost_interpolates_and_extrapolates() {
        let c = DraftCost::new(vec![
            (7, 4, 0.008),
            (1, 4, 0.004),
            (1, 1, 0.001),
            (7, 1, 0.002),
        ])
        .unwrap();
        assert!((c.seconds(1, 1) - 0.001).abs() < 1e-12);
        assert!((c.seconds(1, 2) - 0.002).abs() < 1e-12);
        assert!((c.seconds(1, 8) - 0.008).abs() < 1e-12);
        assert!((c.seconds(7, 4) - 0.008).abs() < 1e-12);
        // Halfway in γ: halfway in cost.
        assert!((c.seconds(4, 4) - 0.006).abs() < 1e-12);
        assert!((c.seconds(9, 1) - 0.002).abs() < 1e-12);
        assert_eq!(c.seconds(3, 0), 0.0);
    }

    #[test]
    fn draft_cost_below_the_first_point_is_its_cost() {
        // A round of 1 costs at least the first measured round (8 requests): the call's fixed
        // cost does not shrink with fewer requests.
        let c = DraftCost::flat(vec![(8, 0.004), (16, 0.006)]).unwrap();
        assert!((c.seconds(1, 1) - 0.004).abs() < 1e-12);
        assert!((c.seconds(1, 8) - 0.004).abs() < 1e-12);
        assert!((c.seconds(1, 12) - 0.005).abs() < 1e-12);
        let lone = DraftCost::flat(vec![(4, 0.004)]).unwrap();
        assert!((lone.seconds(1, 2) - 0.004).abs() < 1e-12);
        assert!((lone.seconds(1, 8) - 0.008).abs() < 1e-12);
    }

    #[test]
    fn long_fixed_blocks_at_saturation_leave_every_request_its_token_and_prefill_a_share() {
        // 16 requests asking for 1 + 31 tokens each on a table that stops at 64: as in the
        // engine, each decoder gets its token every step and a prompt still prefilling a
        // reserve (16), rather than the first two requests' blocks taking every step.
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let b = BlockSet::only(vec![
            Block {
                conf: vec![0.9; 31],
                accepted: 31,
                copy_run: false,
            };
            4
        ]);
        let mut s = spec();
        (s.verify, s.max_gamma) = (Verify::Fixed(31), 31);
        s.sps = SpsTable::new(
            (1u32..=64)
                .map(|b| (b, 1.0 / (0.005 + 0.001 * b as f64)))
                .collect(),
        )
        .unwrap();
        let w = Workload {
            output_tokens: 256,
            output_spread: 0.5,
            ..closed(16)
        };
        let r = simulate_engine(&s, &w, Some((&b, &free, 0.0)), T).unwrap();
        // No step is longer than 69 ms, and each commits a token for every decoder.
        let slowest_step = 0.005 + 0.001 * 64.0;
        assert!(r.user_tok_s_p10 * slowest_step >= 0.99, "{r:?}");
        // A 32-token prompt takes two steps at the reserve (more when several prefill at once),
        // not the time the decoders ahead of it take to finish.
        assert!(r.ttft_p90_s <= 8.0 * slowest_step, "{r:?}");
    }

    #[test]
    fn fixed_lengths_verify_what_they_are_told_and_pay_for_it() {
        let free = DraftCost::flat(vec![(1, 0.0)]).unwrap();
        let b = blocks(0.01, 2, 64);
        for k in [1u8, 3, 7] {
            let mut s = spec();
            s.verify = Verify::Fixed(k);
            let r = simulate_engine(&s, &closed(1), Some((&b, &free, 0.0)), T).unwrap();
            // Two of every block accepted: 1 + min(k, 2) per step, whatever the confidences;
            // the 63 tokens after the prefill's take ⌈63 / that⌉ steps.
            let per = 1 + k.min(2) as u32;
            let want = 63.0 / 63u32.div_ceil(per) as f64;
            // (The window's edges cut one request: within 1 %.)
            assert!(
                (r.committed_per_call / want - 1.0).abs() < 0.01,
                "k {k}: {r:?}"
            );
        }
        // The scheduler verifies nothing of drafts it is told are hopeless.
        let r = simulate_engine(&spec(), &closed(1), Some((&b, &free, 0.0)), T).unwrap();
        assert!((r.committed_per_call - 1.0).abs() < 1e-9);
        // Blocks never push a step beyond the table: they are cut to the batch's room.
        let mut s = spec();
        s.verify = Verify::Fixed(31);
        s.max_gamma = 31;
        s.sps = SpsTable::new(
            (1u32..=24)
                .map(|b| (b, 1.0 / (0.005 + 0.001 * b as f64)))
                .collect(),
        )
        .unwrap();
        let long = BlockSet::only(vec![
            Block {
                conf: vec![0.5; 31],
                accepted: 31,
                copy_run: false,
            };
            4
        ]);
        let r = simulate_engine(&s, &closed(4), Some((&long, &free, 0.0)), T).unwrap();
        assert!(r.committed_per_call > 1.0 && r.tok_s > 0.0, "{r:?}");
    }
}
