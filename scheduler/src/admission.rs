//! Confidence-scheduled verification: which drafted tokens to verify this step.
//!
//! Pure functions, no I/O. For request r with calibrated per-position confidences c_{r,1..γ},
//! the survival of position j is a_{r,j} = Π_{i≤j} c_{r,i} (the probability that the first j
//! drafts are all accepted). Verifying K_r tokens of every request makes a batch of
//! B = Σ_r (1 + K_r) tokens and commits τ = Σ_r (1 + Σ_{j≤K_r} a_{r,j}) tokens in expectation;
//! the hardware turns B into SPS(B) steps per second, so the rate is Θ = τ · SPS(B).
//!
//! Because a_{r,j} never grows with j, the best set of a given size is the top entries by
//! survival, and it is prefix-closed (ties go to the earlier position). The choice is therefore
//! one sort and a scan over sizes: the global argmax of Θ over the sorted prefix, or the paper's
//! greedy that stops at the first entry that lowers Θ (on a staircase SPS these differ exactly
//! when Θ dips at a stair and recovers further on).

use std::fmt;

/// Steps per second at a total batch of B tokens: a staircase from profiling.
#[derive(Clone, Debug, PartialEq)]
pub struct SpsTable {
    /// (B, steps/s), B strictly increasing, steps/s non-increasing; SPS(B) for B between two
    /// points is the value of the next point up (the stair B falls on).
    pub points: Vec<(u32, f64)>,
    /// The same for decoding steps at the shortest profiled context (empty: not known). Its
    /// relative steps are the steepest: attention over long contexts adds a cost per request
    /// that does not grow with the verified tokens, so the staircase above (the slowest
    /// shape per B) dilutes what one more token costs. On SmolLM2 (2 threads) the 33rd token
    /// of a step costs a ninth pass over the weights: +6.4 % at context 256, +1.7 % in the
    /// slowest shape (context 1024).
    pub marginal: Vec<(u32, f64)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AdmissionError {
    EmptyTable,
    NotMonotone(String),
}

impl fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EmptyTable => write!(f, "the SPS table is empty"),
            Self::NotMonotone(m) => write!(f, "the SPS table is not a staircase: {m}"),
        }
    }
}

impl std::error::Error for AdmissionError {}

impl SpsTable {
    /// Validates: non-empty, B strictly increasing from ≥ 1, steps/s finite, positive and
    /// non-increasing.
    pub fn new(points: Vec<(u32, f64)>) -> Result<Self, AdmissionError> {
        if points.is_empty() {
            return Err(AdmissionError::EmptyTable);
        }
        for (i, &(b, s)) in points.iter().enumerate() {
            if b == 0 || !s.is_finite() || s <= 0.0 {
                return Err(AdmissionError::NotMonotone(format!(
                    "point {i}: B = {b}, steps/s = {s}"
                )));
            }
            if i > 0 {
                let (pb, ps) = points[i - 1];
                if b <= pb || s > ps {
                    return Err(AdmissionError::NotMonotone(format!(
                        "point {i} (B = {b}, {s:.3}/s) after (B = {pb}, {ps:.3}/s)"
                    )));
                }
            }
        }
        Ok(Self {
            points,
            marginal: Vec::new(),
        })
    }

    /// With the decoding staircase at the shortest context ([`SpsTable::marginal`]), when it
    /// is a valid staircase (else without one, with the reason logged: it refines prices, the
    /// table stands without it).
    pub fn with_marginal(mut self, points: Vec<(u32, f64)>) -> Self {
        if points.is_empty() {
            self.marginal = Vec::new();
            return self;
        }
        match Self::new(points) {
            Ok(t) => self.marginal = t.points,
            Err(e) => {
                tracing::warn!("SPS table: decoding staircase at short context dropped: {e}");
                self.marginal = Vec::new();
            }
        }
        self
    }

    /// Seconds of a step of `b1` tokens over one of `b0` in the short-context decoding
    /// staircase (between points linearly), when it covers both.
    pub fn marginal_ratio(&self, b0: u32, b1: u32) -> Option<f64> {
        if self.marginal.is_empty() || b0 == 0 {
            return None;
        }
        let r = seconds_in(&self.marginal, b1) / seconds_in(&self.marginal, b0);
        r.is_finite().then_some(r)
    }

    /// Largest batch the table covers.
    pub fn max_batch(&self) -> u32 {
        self.points.last().map(|p| p.0).unwrap_or(0)
    }

    /// Seconds of a step of B tokens, linear between the profiled points (1/SPS at each);
    /// infinite beyond the table. Admission plans on the staircase; this prices batch sizes
    /// that fall between two points for comparing nearby ones, where the staircase would call
    /// every B up to the next point equally dear (a CPU pays for every token).
    pub fn seconds(&self, b: u32) -> f64 {
        seconds_in(&self.points, b)
    }

    /// SPS(B); 0 beyond the table (such batches are never chosen).
    pub fn sps(&self, b: u32) -> f64 {
        match self.points.binary_search_by(|p| p.0.cmp(&b)) {
            Ok(i) => self.points[i].1,
            Err(i) if i < self.points.len() => self.points[i].1,
            Err(_) => 0.0,
        }
    }
}

/// Seconds of a step of B tokens on a staircase of (B, steps/s): 1/SPS at the points, linear
/// between them, infinite beyond the last.
fn seconds_in(points: &[(u32, f64)], b: u32) -> f64 {
    let t = |i: usize| 1.0 / points[i].1;
    match points.binary_search_by(|p| p.0.cmp(&b)) {
        Ok(i) => t(i),
        Err(0) if !points.is_empty() => t(0),
        Err(i) if i < points.len() => {
            let (b0, b1) = (points[i - 1].0 as f64, points[i].0 as f64);
            t(i - 1) + (b as f64 - b0) / (b1 - b0) * (t(i) - t(i - 1))
        }
        Err(_) => f64::INFINITY,
    }
}

/// SPS(B) for B increasing one step at a time: a pointer walks the stairs (O(1) amortized).
struct StairWalk<'a> {
    pts: &'a [(u32, f64)],
    i: usize,
}

impl<'a> StairWalk<'a> {
    fn new(t: &'a SpsTable) -> Self {
        Self {
            pts: &t.points,
            i: 0,
        }
    }
    fn at(&mut self, b: u32) -> f64 {
        while self.i < self.pts.len() && self.pts[self.i].0 < b {
            self.i += 1;
        }
        self.pts.get(self.i).map(|p| p.1).unwrap_or(0.0)
    }
}

/// Per-request limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReqLimits {
    /// Verify at least this many (SLO tier), if drafted.
    pub min_k: u8,
    /// Verify at most this many.
    pub max_k: u8,
}

impl Default for ReqLimits {
    fn default() -> Self {
        Self {
            min_k: 0,
            max_k: u8::MAX,
        }
    }
}

/// Global limits of one step.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Largest batch in tokens (B), including each request's pending token.
    pub max_batch_tokens: u32,
    /// KV slots free for drafted tokens this step.
    pub kv_headroom: u32,
    /// Tokens in the batch besides pending tokens and drafts (prefill chunks).
    pub other_tokens: u32,
    /// Decoding requests in the batch that drafted nothing: one token in B and one committed
    /// token in τ each.
    pub plain_requests: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Global argmax of Θ over the sorted prefix.
    Argmax,
    /// The paper's greedy: stop at the first entry that lowers Θ.
    GreedyEarlyStop,
}

/// The decision: verification length per request, and its predicted value.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub k: Vec<u32>,
    pub batch_tokens: u32,
    pub expected_tokens: f64,
    pub theta: f64,
}

/// Confidence clamp: calibrated confidences live in (0, 1); NaN counts as "no confidence".
pub const CONF_EPS: f32 = 1e-6;

/// Clamps a confidence into (0, 1); returns whether it had to.
pub fn clamp_conf(c: f32) -> (f32, bool) {
    if c.is_nan() {
        (CONF_EPS, true)
    } else if c < CONF_EPS {
        (CONF_EPS, true)
    } else if c > 1.0 - CONF_EPS {
        (1.0 - CONF_EPS, c > 1.0)
    } else {
        (c, false)
    }
}

/// Reusable scratch so a decision allocates nothing in steady state.
#[derive(Default)]
pub struct Admission {
    /// (request, survival) of the entries considered, in order.
    taken: Vec<(u32, f32)>,
    bufs: MergeBufs,
    /// Confidences that had to be clamped (NaN or out of (0, 1)) among those the last call
    /// looked at.
    pub clamped: usize,
}

const POS_BITS: u32 = 5;
const REQ_BITS: u32 = 11;
/// Largest request count and γ one decision takes.
pub const MAX_REQUESTS: usize = 1 << REQ_BITS;
pub const MAX_GAMMA: usize = 1 << POS_BITS;

/// Heap entry: survival bits (positive floats order like their bits) above, the request's
/// complement below, so the max-heap pops the highest survival and, on ties, the lowest request.
#[inline]
fn head(a: f32, r: usize) -> u64 {
    (a.to_bits() as u64) << 32 | (u32::MAX - r as u32) as u64
}

#[inline]
fn head_r(key: u64) -> usize {
    (u32::MAX - (key & 0xffff_ffff) as u32) as usize
}

/// Entries in descending survival: a k-way merge of the requests' survival sequences (each is
/// already non-increasing), so only the entries actually considered are ever ordered. Within a
/// request positions come out in order, so every prefix of the output is prefix-closed.
struct Merge<'c> {
    conf: &'c [&'c [f32]],
    cap: Vec<u8>,
    next: Vec<u8>,
    a: Vec<f32>,
    /// Confidences clamped among the entries looked at.
    clamped: usize,
    /// A 4-ary winner tree over the requests' head keys: `leaves` internal nodes first (root
    /// at 0, children of i at 4i+1..=4i+4), then one leaf per request (0 = exhausted). A pop
    /// replays one leaf's path: log₄(requests) branch-free maxima of four, no indirection.
    tree: Vec<u64>,
    leaves: usize,
}

/// The merge's buffers, kept between calls so a decision allocates only its answer.
#[derive(Default)]
struct MergeBufs {
    cap: Vec<u8>,
    next: Vec<u8>,
    a: Vec<f32>,
    tree: Vec<u64>,
}

impl<'c> Merge<'c> {
    /// Takes every request's forced prefix (SLO minimum) out first; returns the forced count,
    /// their survival sum, and K per request so far.
    fn new(
        conf: &'c [&'c [f32]],
        limits: &[ReqLimits],
        clamped: &mut usize,
        bufs: MergeBufs,
    ) -> (Self, u32, f64, Vec<u32>) {
        let m = conf.len().min(MAX_REQUESTS);
        let mut k = vec![0u32; conf.len()];
        let (mut forced, mut tau) = (0u32, 0f64);
        let mut n4 = 1usize;
        while n4 < m {
            n4 *= 4;
        }
        let inner = (n4 - 1) / 3;
        let MergeBufs {
            mut cap,
            mut next,
            mut a,
            mut tree,
        } = bufs;
        cap.clear();
        cap.resize(m, 0);
        next.clear();
        next.resize(m, 0);
        a.clear();
        a.resize(m, 0.0);
        tree.clear();
        tree.resize(inner + n4, 0);
        let mut me = Self {
            conf: &conf[..m],
            cap,
            next,
            a,
            tree,
            leaves: inner,
            clamped: 0,
        };
        for (r, c) in conf.iter().enumerate().take(m) {
            let lim = limits.get(r).copied().unwrap_or_default();
            let cap = c.len().min(MAX_GAMMA).min(lim.max_k as usize);
            let mut a = 1f32;
            let mut j = 0;
            while j < cap {
                let (cj, cl) = clamp_conf(c[j]);
                *clamped += cl as usize;
                let aj = a * cj;
                if j < lim.min_k as usize {
                    k[r] += 1;
                    forced += 1;
                    tau += aj as f64;
                    a = aj;
                    j += 1;
                } else {
                    a = aj;
                    break;
                }
            }
            me.cap[r] = cap as u8;
            if j < cap {
                me.next[r] = j as u8;
                me.a[r] = a;
                me.tree[inner + r] = head(a, r);
            }
        }
        let t = &mut me.tree;
        for i in (0..inner).rev() {
            let c = 4 * i + 1;
            t[i] = t[c].max(t[c + 1]).max(t[c + 2].max(t[c + 3]));
        }
        (me, forced, tau, k)
    }

    fn pop(&mut self) -> Option<(usize, f32)> {
        let top = self.tree[0];
        if top == 0 {
            return None;
        }
        let r = head_r(top);
        let a = self.a[r];
        let j = self.next[r] as usize + 1;
        let leaf = self.leaves + r;
        let mut v = if j < self.cap[r] as usize {
            let (cj, cl) = clamp_conf(self.conf[r][j]);
            self.clamped += cl as usize;
            self.a[r] = a * cj;
            self.next[r] = j as u8;
            head(self.a[r], r)
        } else {
            0
        };
        // Replay the leaf's path carrying the new value in a register: a node is the max of the
        // value coming up and its other three children, read before the child is written (so
        // they are old values, ready early, not a store reloaded). The chain from one pop to
        // the next is then one max a level.
        let t = &mut self.tree[..];
        let mut i = leaf;
        while i > 0 {
            let p = (i - 1) / 4;
            let c = 4 * p + 1;
            let q: [u64; 4] = match t.get(c..c + 4).and_then(|q| q.try_into().ok()) {
                Some(q) => q,
                None => break,
            };
            t[i] = v;
            let k = i - c;
            let sib = |n: usize| if n == k { 0 } else { q[n] };
            v = v.max(sib(0).max(sib(1)).max(sib(2).max(sib(3))));
            i = p;
        }
        t[i] = v;
        Some((r, a))
    }

    fn into_bufs(self) -> MergeBufs {
        MergeBufs {
            cap: self.cap,
            next: self.next,
            a: self.a,
            tree: self.tree,
        }
    }

    fn peek_a(&self) -> f32 {
        match self.tree[0] {
            0 => 0.0,
            k => f32::from_bits((k >> 32) as u32),
        }
    }
}

/// Largest Θ a larger set could reach: at most `left` more entries, none with a survival above
/// `a_next`, on the stairs from B = `b + 1` on (within a stair the best is its right end).
fn upper_bound(t: f64, a_next: f64, b: u32, left: u32, sps: &SpsTable) -> f64 {
    let mut best = 0f64;
    let end = b.saturating_add(left);
    for &(sb, s) in &sps.points {
        if sb <= b {
            continue;
        }
        let top = sb.min(end);
        best = best.max((t + (top - b) as f64 * a_next) * s);
        if sb >= end {
            break;
        }
    }
    best
}

impl Admission {
    /// Chooses K_r for every request. `conf[r]` are request r's drafted positions' confidences
    /// (cumulative survival is computed here). Requests beyond [`MAX_REQUESTS`] or positions
    /// beyond [`MAX_GAMMA`] are not drafted (they still decode).
    pub fn decide(
        &mut self,
        conf: &[&[f32]],
        limits: &[ReqLimits],
        step: StepLimits,
        sps: &SpsTable,
        rule: Rule,
    ) -> Decision {
        self.clamped = 0;
        let bufs = std::mem::take(&mut self.bufs);
        let (mut merge, forced, forced_tau, mut k) =
            Merge::new(conf, limits, &mut self.clamped, bufs);
        // Saturating: the counts come over the wire in a budget request.
        let base_b = (conf.len() as u32)
            .saturating_add(step.plain_requests)
            .saturating_add(step.other_tokens);
        let tau = (conf.len() as f64 + step.plain_requests as f64) + forced_tau;
        let room = step
            .max_batch_tokens
            .min(sps.max_batch())
            .saturating_sub(base_b.saturating_add(forced))
            .min(step.kv_headroom.saturating_sub(forced));
        let b0 = base_b.saturating_add(forced);
        let mut best = (tau * sps.sps(b0), 0u32);
        let mut t = tau;
        let mut stair = StairWalk::new(sps);
        let mut stair_val = stair.at(b0);
        self.taken.clear();
        let mut i = 0u32;
        while i < room {
            let s = stair.at(b0 + i + 1);
            // Entering a new stair: stop when no larger set can beat the best.
            if rule == Rule::Argmax
                && s != stair_val
                && upper_bound(t, merge.peek_a() as f64, b0 + i, room - i, sps) <= best.0
            {
                break;
            }
            stair_val = s;
            let Some((r, a)) = merge.pop() else { break };
            t += a as f64;
            i += 1;
            self.taken.push((r as u32, a));
            let th = t * s;
            if th > best.0 {
                best = (th, i);
            } else if rule == Rule::GreedyEarlyStop && th < best.0 {
                break;
            }
        }
        let mut expected = tau;
        for &(r, a) in &self.taken[..best.1 as usize] {
            k[r as usize] += 1;
            expected += a as f64;
        }
        self.clamped += merge.clamped;
        self.bufs = merge.into_bufs();
        let batch_tokens = b0 + best.1;
        Decision {
            theta: expected * sps.sps(batch_tokens),
            k,
            batch_tokens,
            expected_tokens: expected,
        }
    }

    /// The top `k_total` entries by cumulative survival (prefix-closed), within per-request
    /// limits (forced minimums first): the selection half of the two-step lag.
    pub fn select_top(&mut self, conf: &[&[f32]], limits: &[ReqLimits], k_total: u32) -> Vec<u32> {
        self.clamped = 0;
        let bufs = std::mem::take(&mut self.bufs);
        let (mut merge, forced, _, mut k) = Merge::new(conf, limits, &mut self.clamped, bufs);
        for _ in 0..k_total.saturating_sub(forced) {
            match merge.pop() {
                Some((r, _)) => k[r] += 1,
                None => break,
            }
        }
        self.clamped += merge.clamped;
        self.bufs = merge.into_bufs();
        k
    }
}
/// The scheduler in the engine's loop ([`specdec::VerifyPolicy`]): the budget K_total for
/// step t is the argmax decision on the confidences of step t − `lag` (so with lag 2 the next
/// batch shape is known before the current step ends); step t verifies the top-K_total entries
/// by the latest cumulative confidences. With lag 0 the decision is made on the spot.
pub struct ConfidencePolicy {
    pub sps: SpsTable,
    pub rule: Rule,
    pub lag: usize,
    pub max_batch_tokens: u32,
    /// Per-request verification cap (γ of the drafter).
    pub max_k: u8,
    adm: Admission,
    budgets: std::collections::VecDeque<u32>,
    /// Budgets computed elsewhere (the central scheduler), used while fresh.
    pub external: Option<std::sync::Arc<std::sync::Mutex<ExternalBudget>>>,
    steps: u64,
    pub last_decision_us: f64,
    pub clamped_total: usize,
    /// Where this step's confidences go for the central scheduler (dropped when it is busy).
    pub report: Option<tokio::sync::mpsc::Sender<ConfReport>>,
    /// Steps that used a central / a local budget.
    pub central_steps: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub local_steps: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Drafting seconds per drafted request (running mean over every block length), when
    /// drafting shares the target's hardware: a step that drafts costs its step seconds plus
    /// the drafting seconds, one that skips drafting its step seconds alone.
    pub draft_s_per_req: f64,
    /// The same per block length drafted (index = positions; 0 = not seen yet). A block of 7
    /// costs three times a block of 1 on SmolLM2's drafter (0.68 against 0.23 ms at batch 1),
    /// and a planned budget of K drafts blocks of K + 1 while probes draft one position: one
    /// mean over both priced a budget of 1 at 0.38–0.46 ms a request where its blocks of 2
    /// cost about 0.3.
    draft_s_by_len: Vec<f64>,
    /// Calls measured per block length: a length's own mean is trusted from
    /// [`DRAFT_LEN_TRUSTED`] calls on (one slow first call at a new length, priced as it came,
    /// could keep that budget from ever being planned, and so from ever being corrected).
    draft_n_by_len: Vec<u32>,
    /// Whether to count the drafting cost (co-located drafter) in Θ.
    pub count_draft_cost: bool,
    /// Consecutive steps planned at K_total = 0 (drafting skipped). After `probe_every` such
    /// steps a probe drafts one position for one request so fresh confidences can lift the budget
    /// again; each probe that leaves the budget at 0 doubles the wait (up to 128 steps), so an
    /// engine where speculation does not pay spends almost nothing on probing.
    zero_run: usize,
    next_probe: usize,
    pub probe_every: usize,
    /// Requests a probe drafts for (the rest of the batch decodes plainly meanwhile), and the
    /// positions it drafts: enough to see whether the first tokens pay; blocks grow from there.
    pub probe_width: usize,
    pub probe_k: usize,
    /// The last budget decided from real confidences: steps that drafted nothing carry it
    /// forward (they have no confidences to decide from).
    last_real: u32,
    /// The coming step is a probe: its fresh decision applies at once.
    probing: bool,
    /// Seconds the last probe's drafting took, and a running mean of step seconds: probes are
    /// spaced so they take at most `probe_share` of the time.
    last_probe_s: f64,
    step_s: f64,
    pub probe_share: f64,
    /// Where the last planned budget came from (the central scheduler or the local queue).
    planned_central: bool,
    /// Measured step seconds ÷ the table's 1/SPS(B) for the same B (running mean; 0 = none yet).
    pub step_scale: f64,
    /// The same ratio per batch-token count B below [`SCALE_BUCKETS`] (0 = not seen yet). The
    /// engine's per-step work beyond the profiled forward (sampling and acceptance at every
    /// verified position, feature rows for the drafter) grows with B, so one ratio fitted on
    /// drafting steps would price a plain step as dear as a drafting one, and make drafting
    /// look better than it measures.
    step_scales: Vec<f64>,
    /// The machine's drift, shared by every B: measured ratio = `step_scales[B]` × this. A
    /// bucket is refreshed only on steps of its own B, so without it a B seen while the
    /// machine was slow (a cold start, a noisy neighbour) keeps that price after plain steps
    /// have shown the machine sped up, and drafting, once stopped, never looks worth
    /// retrying. Followed on the reference size `step_ref` (the last B seen twice in a row:
    /// the load's steady shape), whose own ratio then stays; a step of another B updates that
    /// B's ratio against it, as the decoding prices do (`decode_drift`). Splitting each
    /// residual three quarters to the drift and one quarter to the B left a quarter of every
    /// slowdown in the common B's ratio and none in the rare ones'.
    step_drift: f64,
    step_ref: usize,
    last_step_size: usize,
    /// Running mean of what drafting gained on the steps that drafted: Θ with the chosen
    /// verification and the drafting seconds, over Θ of plain decoding, minus 1. A zero budget
    /// decided from one step's confidences says little about the next step's; while this mean
    /// is positive, steps whose lagged budget is zero still draft, as probes (their fresh
    /// decision applies at once), instead of waiting out the probe back-off.
    gain_ema: f64,
    gain_seen: u64,
    /// Running variance of the per-step gains (same weights as the mean): drafting stops only
    /// once the mean is below zero by more than its standard error. One step's gain swings by
    /// ±20 % with its confidences; a mean that stopped at the first dip below zero switched
    /// drafting off at c = 1 where γ = 1 on every step gained 11 %, and the back-off probes
    /// were too few to switch it on again.
    gain_var: f64,
    /// Free drafts' accepted tokens against their expected ones (running sums, starting at
    /// one pseudo-draft each): their confidences come from rates calibrated on another
    /// workload, so survivals are scaled by what this one realizes.
    free_expected: f64,
    free_accepted: f64,
    /// Measured seconds of steps without prefill chunks, per batch-token count, relative to
    /// the machine's speed at the time (`decode_drift`; running mean; 0 = none yet), and
    /// whether the step under way has none. Every token of such a step needs its logits, as a
    /// verified draft does; a prefill token does not (and is cheaper), so a slope fitted over
    /// prefill steps understates what a draft costs. Relative, because sizes are seen at
    /// different moments: at c = 2 a 3-token step is seen only when a free draft is verified,
    /// and in raw seconds its price was a stale one from a faster spell set against the
    /// 2-token step's fresh one; their difference came out at about 1 ms where 3-token steps
    /// cost 1.8 ms more, and single free drafts chosen on it lost 10 % of those steps'
    /// throughput.
    decode_secs: Vec<f64>,
    /// The machine's speed on decoding steps (seconds over a size's relative price), followed
    /// on the reference size (the last one seen twice in a row: the load's steady shape),
    /// whose relative price then stays; a step of another size updates its own relative price
    /// against this speed instead. Splitting each residual between a
    /// drift and the size's price left a quarter of a slowdown in the common size's price and
    /// none in the rare ones', which priced a draft on top 0.5 ms low after a 34 % slowdown.
    decode_drift: f64,
    decode_ref: usize,
    last_decode_size: usize,
    step_is_decode: bool,
}

/// Drafting calls at a block length before its own mean prices it (else the line over every
/// length measured does).
const DRAFT_LEN_TRUSTED: u32 = 3;

/// Least-squares line through `pts` (x, y): the means of x and y, and the slope, at least 0
/// (a cost never falls as its size grows; noise that says so is read as flat).
fn line_fit(pts: &[(f64, f64)]) -> (f64, f64, f64) {
    let n = pts.len().max(1) as f64;
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    (mx, my, slope)
}

/// Weight of each drafting step's gain in the running mean and variance (about the last
/// twenty steps).
const GAIN_ALPHA: f64 = 0.1;

/// Steps whose drafting gain is measured before its running mean may stop drafting: one
/// unlucky first probe must not turn speculation off for the whole back-off.
const EXPLORE_STEPS: u64 = 8;

/// Below this mean gain (drafting costing a quarter of the throughput) exploring further is
/// pointless: the running mean could not turn positive within the exploration steps.
const EXPLORE_FLOOR: f64 = -0.25;

/// Zero-budget steps before the next probe from which the window ahead of it hands target
/// features to the probe's requests alone ([`specdec::VerifyPolicy::probe_only_within`]):
/// by then the probes at 16 and 32 steps both found drafting not paying, so a probe that
/// lets every request draft, most of them from a window started over, is rare.
const SENTINEL_BACKOFF: usize = 64;

/// Batch-token counts with a measured step-time ratio of their own ([`ConfidencePolicy`]).
const SCALE_BUCKETS: usize = 256;

/// One step's confidences, as reported to the central scheduler.
#[derive(Clone, Debug)]
pub struct ConfReport {
    pub step: u64,
    /// Steps on, the step whose budget these confidences decide (the policy's lag).
    pub lag: u32,
    pub rows: Vec<Vec<f32>>,
    pub other_tokens: u32,
    pub plain_requests: u32,
    pub kv_headroom: u32,
    pub max_batch_tokens: u32,
    pub max_k: u8,
    /// The step's measured prices when drafting seconds count ([`StepPrices`]).
    pub prices: Option<StepPrices>,
}

/// A worker's measured prices for one step, sent with its confidences so the central
/// scheduler weighs drafting as the worker's own decision does: the profiled table prices
/// verification, not drafting, and a worker whose drafting makes speculation lose would
/// otherwise be told to keep drafting.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPrices {
    /// Seconds of the step decoding plainly.
    pub plain_s: f64,
    /// Seconds of the step verifying K drafts, drafting included (index K − 1).
    pub spec_s: Vec<f64>,
}

/// Most verified drafts a step's prices are sent for (the profiled grid stops at 256 tokens).
pub const MAX_PRICED: usize = 1024;

impl StepPrices {
    /// Whether a decision `d` of `reqs` decoding requests decodes faster plainly at these
    /// prices (`None` when they do not price it: no drafts, beyond the curve, or not finite
    /// and positive).
    pub fn plain_wins(&self, d: &Decision, reqs: u32) -> Option<bool> {
        let k = d.k.iter().sum::<u32>() as usize;
        let spec_s = *self.spec_s.get(k.checked_sub(1)?)?;
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !ok(spec_s) || !ok(self.plain_s) {
            return None;
        }
        Some(reqs as f64 / self.plain_s >= d.expected_tokens / spec_s)
    }
}

/// The central scheduler's budget for a worker's reported step: the global argmax over the
/// profiled table, 0 when the worker's measured prices say plain decoding is faster (the same
/// comparison the worker's own [`ConfidencePolicy`] makes). Also whether the prices judged
/// it (`None`: no prices, or none for this budget).
pub fn central_budget(
    adm: &mut Admission,
    rows: &[&[f32]],
    max_k: u8,
    step: StepLimits,
    sps: &SpsTable,
    prices: &StepPrices,
) -> (u32, Option<bool>) {
    let limits = vec![ReqLimits { min_k: 0, max_k }; rows.len()];
    let d = adm.decide(rows, &limits, step, sps, Rule::Argmax);
    let reqs = (rows.len() as u32).saturating_add(step.plain_requests);
    let judged = prices.plain_wins(&d, reqs);
    let k: u32 = d.k.iter().sum();
    (if judged == Some(true) { 0 } else { k }, judged)
}

/// Budgets pushed by the central scheduler, each for one engine step, the last few kept by
/// step: a budget answered for step t+2 while the one for t+1 is still to be used leaves that
/// one in place (a single slot overwrote it, and the step before used the newer budget: a lag
/// of one, and under ping-pong the other micro-batch's).
#[derive(Clone, Copy, Debug)]
pub struct ExternalBudget {
    /// `(for_step, k_total)` at `for_step % RECENT`; `u64::MAX`: none.
    recent: [(u64, u32); ExternalBudget::RECENT],
}

impl ExternalBudget {
    pub(crate) const RECENT: usize = 8;

    /// Stores the budget for `for_step`.
    pub fn set(&mut self, for_step: u64, k_total: u32) {
        self.recent[(for_step % Self::RECENT as u64) as usize] = (for_step, k_total);
    }

    /// The budget for `step`, when one was answered for exactly that step.
    pub fn at(&self, step: u64) -> Option<u32> {
        let (s, k) = self.recent[(step % Self::RECENT as u64) as usize];
        (s == step).then_some(k)
    }
}

/// No budget yet: one for no step. A default for step 0 was taken as the central budget of
/// the first step, counted as central before the scheduler had answered.
impl Default for ExternalBudget {
    fn default() -> Self {
        Self {
            recent: [(u64::MAX, 0); Self::RECENT],
        }
    }
}

impl ConfidencePolicy {
    pub fn new(sps: SpsTable, rule: Rule, lag: usize, max_batch_tokens: u32, max_k: u8) -> Self {
        Self {
            sps,
            rule,
            lag,
            max_batch_tokens,
            max_k,
            adm: Admission::default(),
            // Speculation has to prove itself: plain decoding until the first probe.
            budgets: std::iter::repeat_n(0, lag).collect(),
            external: None,
            steps: 0,
            last_decision_us: 0.0,
            clamped_total: 0,
            report: None,
            central_steps: Default::default(),
            local_steps: Default::default(),
            draft_s_per_req: 0.0,
            draft_s_by_len: vec![0.0; u8::MAX as usize + 1],
            draft_n_by_len: vec![0; u8::MAX as usize + 1],
            count_draft_cost: true,
            zero_run: 0,
            next_probe: 16,
            probe_every: 16,
            probe_width: 1,
            probe_k: 1,
            last_real: 0,
            probing: false,
            last_probe_s: 0.0,
            step_s: 0.0,
            probe_share: 0.01,
            planned_central: false,
            step_scale: 0.0,
            step_scales: vec![0.0; SCALE_BUCKETS],
            step_drift: 1.0,
            step_ref: 0,
            last_step_size: 0,
            gain_ema: 0.0,
            gain_seen: 0,
            gain_var: 0.0,
            free_expected: 1.0,
            free_accepted: 1.0,
            decode_secs: vec![0.0; SCALE_BUCKETS],
            decode_drift: 1.0,
            decode_ref: 0,
            last_decode_size: 0,
            step_is_decode: false,
        }
    }

    /// Standard error of the running mean gain: its variance over the steps it holds (at most
    /// the weights' effective count, (2 − α)/α).
    fn gain_se(&self) -> f64 {
        let n = (self.gain_seen as f64)
            .min((2.0 - GAIN_ALPHA) / GAIN_ALPHA)
            .max(1.0);
        (self.gain_var / n).sqrt()
    }

    /// The running mean gain of drafting (see the field), when any step has measured it.
    pub fn drafting_gain(&self) -> Option<f64> {
        (self.gain_seen > 0).then_some(self.gain_ema)
    }

    /// Queues `next` as the budget `lag` steps on and returns this step's: the central
    /// scheduler's when fresh, else the one queued `lag` steps ago (counted either way).
    fn queue_and_take(&mut self, next: u32) -> u32 {
        self.budgets.push_back(next);
        let lagged = if self.budgets.len() > self.lag {
            self.budgets.pop_front().unwrap_or(next)
        } else {
            next
        };
        let (counter, budget) = match self.central_budget_now() {
            Some(b) => (&self.central_steps, b),
            None => (&self.local_steps, lagged),
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        budget
    }

    /// The central scheduler's budget for this step (in `select`, after `steps` counted it).
    fn central_budget_now(&self) -> Option<u32> {
        self.central_budget_for(self.steps)
    }

    /// The central scheduler's budget for the coming step.
    fn central_budget(&self) -> Option<u32> {
        self.central_budget_for(self.steps + 1)
    }

    /// The budget answered for exactly `step`: one for a step before or after it was decided
    /// from other confidences (under ping-pong, the other micro-batch's).
    fn central_budget_for(&self, step: u64) -> Option<u32> {
        self.external
            .as_ref()
            .and_then(|e| e.lock().ok().and_then(|b| b.at(step)))
    }

    /// Drafting seconds of a step that drafts blocks of `block` positions for `width`
    /// requests (0 when drafting seconds do not count): per request, the mean measured at that
    /// length once it has [`DRAFT_LEN_TRUSTED`] calls; else what the other lengths say (a line
    /// fitted over them, no cheaper than the nearest shorter length and, below the shortest,
    /// than the shortest's cost scaled down by length, where the line can reach 0; one other
    /// length: its mean), capped by this length's own mean so far; with none measured, the
    /// mean over every call.
    fn draft_seconds(&self, width: usize, block: usize) -> f64 {
        if !self.count_draft_cost || width == 0 {
            return 0.0;
        }
        width as f64 * self.draft_s_at(block)
    }

    fn draft_s_at(&self, block: usize) -> f64 {
        let at = |l: usize| self.draft_s_by_len.get(l).copied().filter(|&s| s > 0.0);
        let own = at(block);
        let trusted = self
            .draft_n_by_len
            .get(block)
            .is_some_and(|&n| n >= DRAFT_LEN_TRUSTED);
        if trusted && let Some(s) = own {
            return s;
        }
        let others: Vec<(f64, f64)> = (1..self.draft_s_by_len.len())
            .filter(|&l| l != block)
            .filter_map(|l| at(l).map(|s| (l as f64, s)))
            .collect();
        let est = match others.len() {
            0 => own.unwrap_or(self.draft_s_per_req),
            1 => others[0].1,
            _ => {
                let (mx, my, slope) = line_fit(&others);
                let (l0, s0) = others[0];
                let floor = if (block as f64) < l0 {
                    s0 * block as f64 / l0
                } else {
                    (1..block.min(self.draft_s_by_len.len()))
                        .rev()
                        .find_map(at)
                        .unwrap_or(0.0)
                };
                (my + slope * (block as f64 - mx)).max(floor)
            }
        };
        // A length not yet trusted is priced no dearer than the other lengths say: a slow
        // first call must not keep its budget from being tried again.
        own.map_or(est, |o| o.min(est))
    }

    /// Measured seconds of a decoding step (no prefill chunk) of `b` tokens, when seen.
    fn decode_at(&self, b: u32) -> Option<f64> {
        self.decode_secs
            .get(b as usize)
            .copied()
            .filter(|&s| s > 0.0)
            .map(|s| s * self.decode_drift)
    }

    /// Seconds of a step of `reqs` decoding requests and `other` prefill tokens that verifies
    /// `added` drafts. On a step without prefill whose two sizes (with and without the drafts)
    /// have both been measured on decoding steps, the plain step's price plus their measured
    /// difference: rescaling the table per size priced a 2-token step at 1.23–1.30 plain
    /// ones at c = 1 where the engine's steps measured 1.14 (each size's ratio follows its
    /// own steps' noise, and the difference of two noisy prices is noisier than a measured
    /// difference), no less than the short-context staircase says
    /// ([`ConfidencePolicy::marginal_floor`]). Else the table's price at B, on the measured
    /// scale.
    fn verify_seconds(&self, reqs: u32, other: u32, added: u32) -> f64 {
        let b0 = reqs.saturating_add(other);
        if added == 0 {
            return self.step_seconds(b0);
        }
        if other == 0
            && let (Some(a), Some(b)) = (
                self.decode_at(reqs),
                self.decode_at(reqs.saturating_add(added)),
            )
        {
            let above = reqs.saturating_add(added);
            return self.step_seconds(b0) + (b - a).max(self.marginal_floor(a, reqs, above));
        }
        self.step_seconds(b0.saturating_add(added))
    }

    /// Seconds of an engine step of B tokens: the table's, between points linearly, on the
    /// engine's measured scale.
    fn step_seconds(&self, b: u32) -> f64 {
        self.scale_for(b) * self.sps.seconds(b)
    }

    /// Seconds one more verified token costs above B, fitted (least squares) on the seconds
    /// measured for steps without prefill chunks at batch sizes from B to 2B (at least B + 8),
    /// or, with fewer than three of those, from B/2 (at least 4 below); 0 with fewer than three
    /// either way. The table's shape rescaled by a measured ratio misprices a token: its
    /// profiled steps carry a fixed cost (long contexts) that short ones do not, so its slope
    /// times the ratio came out at 0.58 ms a token where decoding steps of 16 to 32 tokens
    /// measured 0.75 to 1 ms (SmolLM2, 2 threads). Sizes below B are a fallback only: small
    /// batches read the weights at the same cost whatever their size, so the curve is flat
    /// there and steep above; fitted from B/4 at B = 8 it gave 0.9 ms a token where steps of
    /// 8 to 12 tokens added 1.2 ms each.
    fn measured_slope(&self, b: u32) -> f64 {
        let b = b as usize;
        let hi = (2 * b).max(b + 8);
        let fit = |lo: usize| -> Option<f64> {
            let pts: Vec<(f64, f64)> = (lo..=hi)
                .filter_map(|i| Some((i as f64, self.decode_at(i as u32)?)))
                .collect();
            if pts.len() < 3 {
                return None;
            }
            Some(line_fit(&pts).2)
        };
        fit(b.max(1))
            .or_else(|| fit((b / 2).min(b.saturating_sub(4)).max(1)))
            .unwrap_or(0.0)
    }

    /// Seconds `n` verified drafts add to a step of `reqs` decoding requests, from decoding
    /// steps: measured at both sizes when both have been seen (the flat part of the curve then
    /// costs nothing); else the slope above, or the table's step from `reqs` to `reqs + n` on
    /// the scale of the decoding step measured at `reqs`, whichever is dearer. The kernels
    /// multiply 8 tokens per pass over the weights, so a full batch of 8 requests pays a
    /// second pass for its first draft: four drafts on such a step cost 3.1 ms where a slope
    /// fitted on the sizes below said 1.8 (c = 8, SmolLM2), and verified at 63 % of their
    /// confidence they did not pay. The profiled table has that stair.
    ///
    /// Never below the short-context decoding staircase's step from `reqs` to `reqs + n` on
    /// the measured plain step ([`ConfidencePolicy::marginal_floor`]): two sizes' running
    /// means differ by their noise, and the choice then goes to the sizes that read cheapest
    /// (at c = 32 two free drafts were priced at 0–0.5 ms on steps that measured 1.9 ms above
    /// plain ones, for 1.1 accepted tokens worth 1.3 ms each).
    fn decode_added(&self, reqs: u32, n: u32, slope: f64) -> f64 {
        let above = reqs.saturating_add(n);
        match (self.decode_at(reqs), self.decode_at(above)) {
            (Some(a), Some(b)) => (b - a).max(self.marginal_floor(a, reqs, above)),
            (Some(a), None) => {
                let stair = a * (self.sps.seconds(above) / self.sps.seconds(reqs.max(1)) - 1.0);
                (slope * n as f64)
                    .max(if stair.is_finite() { stair } else { 0.0 })
                    .max(self.marginal_floor(a, reqs, above))
            }
            _ => slope * n as f64,
        }
    }

    /// What the short-context decoding staircase says a step of `above` tokens adds to one of
    /// `reqs` measured at `a` seconds: its own step there, or the drafts' share of its mean
    /// step per token from `reqs` to `2·reqs`, whichever is larger (0 without that
    /// staircase). The mean over a span: the profile's fastest of three passes still moves
    /// by a millisecond from run to run, enough to hide a one-token stair (33 read 48.7 ms
    /// against 32's 49.2 in one profile, +2.8 ms in another). No wider: small batches read
    /// the weights at about the same cost whatever their size, and a mean from 1 to 9 tokens
    /// (13 % of a step a token) priced drafting at c = 1 out (1.06 tokens a call against
    /// 1.28, 1.01× plain decoding against 1.06×).
    fn marginal_floor(&self, a: f64, reqs: u32, above: u32) -> f64 {
        let n = above.saturating_sub(reqs) as f64;
        let hi = reqs.saturating_mul(2).max(reqs.saturating_add(1));
        let direct = self
            .sps
            .marginal_ratio(reqs, above)
            .map_or(0.0, |r| r - 1.0);
        let mean = self
            .sps
            .marginal_ratio(reqs, hi)
            .map_or(0.0, |r| (r - 1.0) * n / (hi - reqs) as f64);
        (a * direct.max(mean)).max(0.0)
    }

    /// Accepted over expected free drafts, recently (1 before any; at most 1.5).
    pub fn free_realized(&self) -> f64 {
        (self.free_accepted / self.free_expected).clamp(0.0, 1.5)
    }

    /// Seconds a decoding token costs in a plain decoding step of `reqs` requests (the step's
    /// seconds over its tokens): measured at that batch when steps without prefill have been
    /// seen there, else the table's on the measured scale. A draft accepted saves its request
    /// one such token: one step fewer in its slot, which the next request takes over. The
    /// prefill seconds are the same either way, so the engine's overall output rate (prefill
    /// time included) undervalues the seconds a draft costs: at c = 8 on 32-token answers it
    /// read 466 tokens/s where decoding steps ran at 790, and verified drafts at 40 % survival
    /// that lost 2 % of throughput.
    fn decode_token_seconds(&self, reqs: u32) -> f64 {
        let r = reqs.max(1);
        self.decode_at(r).unwrap_or_else(|| self.step_seconds(r)) / r as f64
    }

    /// Per-request caps (γ) for `n` drafting requests and the step's limits.
    fn limits(
        &self,
        n: usize,
        other_tokens: usize,
        plain_requests: usize,
        kv_headroom: usize,
    ) -> (Vec<ReqLimits>, StepLimits) {
        let cap = |x: usize| x.min(u32::MAX as usize) as u32;
        let req = ReqLimits {
            min_k: 0,
            max_k: self.max_k,
        };
        let step = StepLimits {
            max_batch_tokens: self.max_batch_tokens,
            kv_headroom: cap(kv_headroom),
            other_tokens: cap(other_tokens),
            plain_requests: cap(plain_requests),
        };
        (vec![req; n], step)
    }

    /// The table's steps are profiled shapes (the slowest per B); the engine's own step times
    /// put drafting seconds and step seconds on one scale: the ratio measured at this B when
    /// there is one; else the larger of the nearest measured ratios within a quarter of B
    /// either side (a B never seen is priced like its neighbours, and no cheaper than the
    /// dearer of them: the mean over all steps, prefill-heavy ones included, priced a few
    /// verified tokens on top of a plain batch as nearly free); else the one over all steps;
    /// else 1.
    fn scale_for(&self, b: u32) -> f64 {
        let b = b as usize;
        if let Some(&r) = self.step_scales.get(b)
            && r > 0.0
        {
            return r * self.step_drift;
        }
        let reach = (b / 4).max(4);
        let measured = |i: usize| self.step_scales.get(i).copied().filter(|&r| r > 0.0);
        let below = (b.saturating_sub(reach)..b).rev().find_map(measured);
        let above = (b + 1..=b + reach).find_map(measured);
        match below.into_iter().chain(above).reduce(f64::max) {
            Some(r) => r * self.step_drift,
            None if self.step_scale > 0.0 => self.step_scale,
            None => 1.0,
        }
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// This step's prices for the central scheduler: plain decoding's seconds, and for every
    /// budget K it could decide (up to the drafts on offer within the step's room) the seconds
    /// of verifying K drafts plus drafting blocks of K + 1, as [`specdec::VerifyPolicy::select`]'s
    /// comparison with plain decoding prices them.
    fn step_prices(
        &self,
        conf: &[&[f32]],
        reqs: u32,
        step: StepLimits,
        plain_s: f64,
    ) -> StepPrices {
        let b0 = reqs.saturating_add(step.other_tokens);
        let room = step
            .max_batch_tokens
            .min(self.sps.max_batch())
            .saturating_sub(b0)
            .min(step.kv_headroom) as usize;
        let offered: usize = conf.iter().map(|c| c.len().min(self.max_k as usize)).sum();
        let n = conf.len();
        let max_block = self.max_k.max(1) as usize;
        // Per block length once (at most γ of them), not per budget: each fits a line.
        let mut per_block: Vec<Option<f64>> = vec![None; max_block + 1];
        let spec_s = (1..=room.min(offered).min(MAX_PRICED))
            .map(|k| {
                let block = (k + 1).min(max_block);
                let width = specdec::VerifyPolicy::draft_width(self, k + 1).min(n);
                let drafting = if !self.count_draft_cost || width == 0 {
                    0.0
                } else {
                    width as f64 * *per_block[block].get_or_insert_with(|| self.draft_s_at(block))
                };
                self.verify_seconds(reqs, step.other_tokens, k as u32) + drafting
            })
            .collect();
        StepPrices { plain_s, spec_s }
    }

    /// Whether any request may draft within the next `steps` steps (see
    /// [`specdec::VerifyPolicy::drafting_within`]): `Some(true)` when only the back-off's next
    /// probe may and the back-off is long ([`SENTINEL_BACKOFF`]), `Some(false)` when a budget,
    /// a probe under way, the exploration, a paying drafting gain or a probe early in the
    /// back-off may have any request draft sooner, `None` when nothing drafts.
    fn drafting_soon(&self, steps: usize) -> Option<bool> {
        if self.lag == 0 || self.probing || self.budgets.len() < self.lag {
            return Some(false);
        }
        // Central answers held for any of the coming steps the local queue covers (or the
        // `steps` asked about), as far as answers are kept.
        let ahead = steps.max(self.lag).min(ExternalBudget::RECENT) as u64;
        if self.last_real > 0
            || self.budgets.iter().any(|&b| b > 0)
            || (1..=ahead).any(|d| {
                self.central_budget_for(self.steps + d)
                    .is_some_and(|b| b > 0)
            })
        {
            return Some(false);
        }
        let exploring = self.gain_seen < EXPLORE_STEPS && self.gain_ema > EXPLORE_FLOOR;
        if self.gain_seen > 0 && (self.gain_ema + self.gain_se() > 0.0 || exploring) {
            return Some(false);
        }
        // `planned` probes once `zero_run` reaches `next_probe`; a step that drafted nothing
        // counts one more on each call.
        (self.zero_run.saturating_add(steps).saturating_add(1) >= self.next_probe)
            .then_some(self.next_probe >= SENTINEL_BACKOFF)
    }

    /// Fewest zero-budget steps between probes so that probing takes at most `probe_share` of
    /// the time (from the last probe's drafting seconds and the mean step), at most 1024.
    fn probe_spacing(&self) -> usize {
        if self.last_probe_s <= 0.0 || self.step_s <= 0.0 || self.probe_share <= 0.0 {
            return 0;
        }
        (self.last_probe_s / (self.probe_share * self.step_s))
            .ceil()
            .min(1024.0) as usize
    }
}

impl specdec::VerifyPolicy for ConfidencePolicy {
    fn name(&self) -> &str {
        "dspark-scheduler"
    }

    fn select(
        &mut self,
        conf: &[&[f32]],
        other_tokens: usize,
        plain_requests: usize,
        kv_headroom: usize,
    ) -> Vec<usize> {
        let t0 = std::time::Instant::now();
        self.steps += 1;
        // Whether `planned` took this step's budget from the central scheduler: only this
        // step's (a step the engine did not plan, with no decoding request, inherited it).
        let planned_central = std::mem::take(&mut self.planned_central);
        self.step_is_decode = other_tokens == 0 && conf.len() + plain_requests > 0;
        if conf.is_empty() && self.lag > 0 {
            // Nothing drafted (a planned zero budget, or no decoding request): no confidences to
            // decide from, so the step two ahead inherits the last real decision, and nothing is
            // reported (an empty report would make the central scheduler answer 0 for it).
            self.budgets.push_back(self.last_real);
            while self.budgets.len() > self.lag {
                self.budgets.pop_front();
            }
            // The step still ran on a budget (a planned zero): count where it came from.
            let counter = if planned_central {
                &self.central_steps
            } else {
                &self.local_steps
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.last_decision_us = t0.elapsed().as_secs_f64() * 1e6;
            return Vec::new();
        }
        let (limits, step) = self.limits(conf.len(), other_tokens, plain_requests, kv_headroom);
        // A step past the profiled table (a long prompt's chunk beside the decoders: the
        // grid stops at 256 tokens and a chunk is 256) is decided from no data, and its zero
        // would become the budget two steps on, when the chunk has gone. It verifies what was
        // planned for it; the steps ahead keep the last real decision (a probe stays due), and
        // nothing is reported (the central scheduler would answer the same zero).
        let base = (conf.len() as u32)
            .saturating_add(step.plain_requests)
            .saturating_add(step.other_tokens);
        if self.lag > 0 && base > self.sps.max_batch() {
            let budget = self.queue_and_take(self.last_real);
            let k = self.adm.select_top(conf, &limits, budget);
            self.last_decision_us = t0.elapsed().as_secs_f64() * 1e6;
            return k.into_iter().map(|x| x as usize).collect();
        }
        // Without a lag this step's own drafts are verified by its own decision, and the global
        // argmax keeps an entry for what the entries after it add: whether x_j is verified
        // would depend on c_{j+1}, a function of x_j (a sampled-output bias). The greedy scan
        // decides each entry from the ones before it.
        let rule = if self.lag == 0 {
            Rule::GreedyEarlyStop
        } else {
            self.rule
        };
        let d = self.adm.decide(conf, &limits, step, &self.sps, rule);
        self.clamped_total += self.adm.clamped;
        if self.adm.clamped > 0 {
            tracing::debug!(
                clamped = self.adm.clamped,
                "confidences outside (0, 1) or NaN clamped"
            );
        }
        let mut now: u32 = d.k.iter().sum();
        // What this step verifies when its decision applies at once (a probe): its drafting is
        // paid already, so the drafts are worth verifying when they beat plain decoding at the
        // measured step prices alone; whether to keep drafting is the decision below, with the
        // drafting seconds counted.
        // Chosen by the greedy scan, as a decision without a lag is: these are the step's own
        // drafts, and the global argmax would keep one for what the next (whose confidence is
        // a function of its token) adds.
        let own = if self.lag > 0 && self.probing {
            self.adm
                .decide(conf, &limits, step, &self.sps, Rule::GreedyEarlyStop)
        } else {
            d.clone()
        };
        let mut now_sunk: u32 = own.k.iter().sum();
        let mut prices = None;
        if self.lag > 0 && self.count_draft_cost && self.draft_s_per_req > 0.0 {
            // Skipping drafting saves its cost: keep speculation only if it still pays. Priced
            // as the steps it plans would run: blocks one longer than the budget, for at most
            // that many requests.
            let n = conf.len();
            let reqs = n as u32 + step.plain_requests;
            let b0 = reqs + step.other_tokens;
            let added = d.batch_tokens.saturating_sub(b0);
            let step_spec = self.verify_seconds(reqs, step.other_tokens, added);
            let step_plain = self.step_seconds(b0);
            let block = (now as usize + 1).min(self.max_k.max(1) as usize);
            let drafting = self.draft_seconds(self.draft_width(now as usize + 1).min(n), block);
            let spec = d.expected_tokens / (step_spec + drafting);
            let plain = reqs as f64 / step_plain;
            if plain > 0.0 && spec.is_finite() {
                let g = spec / plain - 1.0;
                if self.gain_seen == 0 {
                    self.gain_ema = g;
                } else {
                    let d = g - self.gain_ema;
                    self.gain_ema += GAIN_ALPHA * d;
                    self.gain_var = (1.0 - GAIN_ALPHA) * (self.gain_var + GAIN_ALPHA * d * d);
                }
                self.gain_seen += 1;
            }
            tracing::debug!(
                drafted = n,
                k_total = now,
                expected = d.expected_tokens,
                batch_tokens = d.batch_tokens,
                spec,
                plain,
                draft_s = drafting,
                block,
                step_spec_s = step_spec,
                step_plain_s = step_plain,
                gain_ema = self.gain_ema,
                "drafting against plain decoding"
            );
            if now > 0 && plain >= spec {
                now = 0;
            }
            let own_spec =
                self.verify_seconds(reqs, step.other_tokens, own.batch_tokens.saturating_sub(b0));
            if now_sunk > 0 && plain >= own.expected_tokens / own_spec {
                now_sunk = 0;
            }
            if self.report.is_some() {
                prices = Some(self.step_prices(conf, reqs, step, step_plain));
            }
        }
        // Without a lag this step's decision is its own: no budget for a later step to ask for.
        if let Some(tx) = self.report.as_ref().filter(|_| self.lag > 0) {
            let _ = tx.try_send(ConfReport {
                prices,
                step: self.steps,
                lag: self.lag as u32,
                rows: conf.iter().map(|c| c.to_vec()).collect(),
                other_tokens: step.other_tokens,
                plain_requests: step.plain_requests,
                kv_headroom: step.kv_headroom,
                max_batch_tokens: self.max_batch_tokens,
                max_k: self.max_k,
            });
        }
        self.last_real = now;
        let k = if self.lag == 0 {
            // Decided here, from this step's drafts: a local budget.
            self.local_steps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            d.k
        } else if std::mem::take(&mut self.probing) {
            // A probe drafted to refresh the confidences: its decision applies now and to the
            // steps already queued.
            self.budgets.clear();
            self.budgets.extend(std::iter::repeat_n(now, self.lag));
            self.local_steps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.adm.select_top(conf, &limits, now_sunk)
        } else {
            let budget = self.queue_and_take(now);
            self.adm.select_top(conf, &limits, budget)
        };
        self.last_decision_us = t0.elapsed().as_secs_f64() * 1e6;
        k.into_iter().map(|x| x as usize).collect()
    }

    fn select_free(
        &mut self,
        conf: &[&[f32]],
        other_tokens: usize,
        plain_requests: usize,
        kv_headroom: usize,
    ) -> Vec<usize> {
        // For the lagged budgets this stays a step that drafted nothing: the queue moves on
        // with the last real decision, and drafting's running gain is not credited with
        // drafts that needed no drafting call.
        self.select(&[], other_tokens, plain_requests + conf.len(), kv_headroom);
        if conf.is_empty() {
            return Vec::new();
        }
        // Entries by survival, as admission orders them (ties: earlier positions first, so every
        // prefix of the order is prefix-closed per request), capped per request and by the
        // step's token and KV room.
        let mut entries: Vec<(f64, usize, usize)> = Vec::new();
        let realized = self.free_realized();
        for (r, c) in conf.iter().enumerate() {
            let mut a = realized;
            for (j, &cj) in c.iter().take(self.max_k as usize).enumerate() {
                let (cj, cl) = clamp_conf(cj);
                self.clamped_total += cl as usize;
                a *= cj as f64;
                entries.push((a, j, r));
            }
        }
        entries.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        let reqs = conf.len() + plain_requests;
        let b0 = (reqs + other_tokens).min(u32::MAX as usize) as u32;
        let room = (self.max_batch_tokens as usize)
            .saturating_sub(b0 as usize)
            .min(kv_headroom);
        // What n drafts add to the step: the larger of the step's price at B + n (measured at
        // that size when it has been, else the table's stairs on B's own scale: pricing B + n
        // on a neighbour's ratio put a jump between B and B + 1 that no step has) and what
        // decoding steps measured. A verified draft needs its
        // logits like a decoding token, unlike a prefill token, so the measured part comes from
        // decoding steps around the step's decoding requests, whatever prefill rides along
        // (around B with the chunk no decoding step is measured, and the table alone priced a
        // draft on a prefill step at under half what it costs).
        let scale = self.scale_for(b0);
        let t0 = self.step_seconds(b0);
        let priced = |b: u32| match self.step_scales.get(b as usize) {
            Some(&r) if r > 0.0 => self.step_seconds(b),
            _ => scale * self.sps.seconds(b),
        };
        let decoding = reqs.min(u32::MAX as usize) as u32;
        let slope = self.measured_slope(decoding);
        let per_token = self.decode_token_seconds(decoding);
        // The best count n of top entries: the decoding seconds their expected tokens save,
        // less the seconds they add to this step.
        let (mut best, mut best_n, mut gain, mut best_added) = (0.0f64, 0usize, 0.0f64, 0.0f64);
        for (i, e) in entries.iter().take(room).enumerate() {
            gain += e.0;
            let n = i as u32 + 1;
            let added = (priced(b0 + n) - t0).max(self.decode_added(decoding, n, slope));
            let v = gain * per_token - added;
            if v.is_finite() && v > best {
                (best, best_n, best_added) = (v, i + 1, added);
            }
        }
        let mut k = vec![0usize; conf.len()];
        for e in &entries[..best_n] {
            k[e.2] += 1;
        }
        tracing::debug!(
            k_total = best_n,
            drafted = entries.len(),
            batch_tokens = b0,
            value_s = best,
            added_s = best_added,
            slope,
            per_token,
            realized,
            "free drafts"
        );
        k
    }

    /// A probe's width and depth. One position while drafting seconds count: whether a probe's
    /// drafts are verified then turns on the expected tokens of all it drafted (the check
    /// against plain decoding), and past the first position those are functions of the
    /// drafted tokens (c_{j+1} reads x_j): verifying x_j would depend on x_j.
    fn probe(&self) -> Option<(usize, usize)> {
        let k = if self.count_draft_cost {
            1
        } else {
            self.probe_k.max(1)
        };
        self.probing.then_some((self.probe_width.max(1), k))
    }

    /// When drafting seconds count (the default: an in-process drafter's time, or a remote
    /// one's that the step waits for), a budget of K_total tokens drafts for at most as many
    /// requests (the budget is one more than K_total: one spare candidate): drafting
    /// every request of a full batch for a budget of one or two, after a probe found one draft
    /// that paid, cost a whole drafting call and catching up every request's context for a
    /// token or two (c = 16: 3–4 ms drafting and 9 ms in all on an 18 ms step, twice per such
    /// probe). With drafting seconds left out (`count_draft_cost` off) every request drafts.
    fn draft_width(&self, k: usize) -> usize {
        if self.count_draft_cost {
            k.max(1)
        } else {
            usize::MAX
        }
    }

    /// No while plain decoding is planned and the next probe is more than `steps` zero-budget
    /// steps away (the back-off of [`Self::planned`]); yes whenever a budget, a probe, the
    /// exploration or a paying drafting gain may have a request draft sooner.
    fn drafting_within(&self, steps: usize) -> bool {
        self.drafting_soon(steps).is_some()
    }

    /// A probe of `probe_width` requests, when the back-off's next probe is all that may
    /// draft within `steps` steps.
    fn probe_only_within(&self, steps: usize) -> Option<usize> {
        self.drafting_soon(steps)
            .is_some_and(|probe_only| probe_only)
            .then_some(self.probe_width.max(1))
    }

    fn planned(&mut self) -> Option<usize> {
        if self.lag == 0 {
            return None;
        }
        let local = (self.budgets.len() >= self.lag).then(|| self.budgets[0]);
        let central = self.central_budget();
        self.planned_central = central.is_some();
        let Some(b) = central.or(local) else {
            // No budget yet (the first steps): probe, and decide from that at once.
            self.probing = true;
            return None;
        };
        if b > 0 {
            self.zero_run = 0;
            self.next_probe = self.probe_every.max(1);
            // A probe that drafted nothing is not this step: a planned one (its drafting time
            // is no probe's, and its decision waits its turn).
            self.probing = false;
            // Blocks one longer than the budget: the confidences of the next position let the
            // budget grow when they are high (a block capped at K_total could never show it).
            return Some(b as usize + 1);
        }
        if self.probing {
            // The last probe drafted nothing (no request could draft then): probe again.
            return None;
        }
        let exploring = self.gain_seen < EXPLORE_STEPS && self.gain_ema > EXPLORE_FLOOR;
        if self.gain_seen > 0 && (self.gain_ema + self.gain_se() > 0.0 || exploring) {
            // Drafting has paid on average lately (or has not had a fair trial yet): this
            // step's zero came from one step's confidences. Draft anyway, as a probe deciding
            // from its own fresh confidences.
            self.zero_run = 0;
            self.next_probe = self.probe_every.max(1);
            self.probing = true;
            return None;
        }
        self.zero_run += 1;
        if self.zero_run >= self.next_probe {
            self.zero_run = 0;
            self.next_probe = (self.next_probe * 2)
                .min(128)
                .max(self.probe_spacing())
                .max(1);
            self.probing = true;
            None
        } else {
            Some(0)
        }
    }

    fn observe_step(&mut self, secs: f64, batch_tokens: usize) {
        if batch_tokens == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        self.step_s = if self.step_s == 0.0 {
            secs
        } else {
            0.95 * self.step_s + 0.05 * secs
        };
        let r = secs / self.sps.seconds(batch_tokens.min(u32::MAX as usize) as u32);
        if r.is_finite() && r > 0.0 {
            self.step_scale = if self.step_scale == 0.0 {
                r
            } else {
                0.9 * self.step_scale + 0.1 * r
            };
            let b = batch_tokens;
            if let Some(&x) = self.step_scales.get(b) {
                // A fifth of the log residual per step, as the single-bucket mean had: to the
                // drift on the reference size, to this B's own ratio on any other.
                if x == 0.0 {
                    self.step_scales[b] = r / self.step_drift;
                } else {
                    let e = (r / (x * self.step_drift)).ln().clamp(-2.0, 2.0);
                    if b == self.step_ref {
                        self.step_drift *= (0.2 * e).exp();
                    } else {
                        self.step_scales[b] = x * (0.2 * e).exp();
                        if b == self.last_step_size {
                            self.step_ref = b;
                        }
                    }
                }
                self.last_step_size = b;
            }
        }
        if std::mem::take(&mut self.step_is_decode)
            && let Some(&x) = self.decode_secs.get(batch_tokens)
        {
            let b = batch_tokens;
            if x == 0.0 {
                self.decode_secs[b] = secs / self.decode_drift;
            } else if b == self.decode_ref {
                self.decode_drift = 0.8 * self.decode_drift + 0.2 * secs / x;
            } else {
                self.decode_secs[b] = 0.8 * x + 0.2 * secs / self.decode_drift;
                if b == self.last_decode_size {
                    self.decode_ref = b;
                }
            }
            self.last_decode_size = b;
        }
    }

    fn observe_outcome(&mut self, expected: f64, accepted: usize, free: bool) {
        // About the last fifty verifying steps.
        const KEEP: f64 = 0.98;
        if free && expected.is_finite() && expected > 0.0 {
            self.free_expected = KEEP * self.free_expected + expected;
            self.free_accepted = KEEP * self.free_accepted + accepted as f64;
        }
    }

    fn observe_draft(&mut self, secs: f64, n: usize, block: usize) {
        // A call whose time was all catch-up (or a clock that did not move) says nothing about
        // a steady call's cost, and would pull the means towards free.
        if n == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let per = secs / n as f64;
        // One sample moves a mean by at most a factor 1.6 (a remote drafter's stalled call, a
        // whole timeout, would price drafting out for a long back-off); a cost that stays
        // high reaches it within a few calls.
        if self.probing {
            self.last_probe_s = if self.draft_s_per_req > 0.0 {
                secs.min(4.0 * self.draft_s_per_req * n as f64)
            } else {
                secs
            };
        }
        let ema = |x: &mut f64| {
            *x = if *x == 0.0 {
                per
            } else {
                0.8 * *x + 0.2 * per.min(4.0 * *x)
            }
        };
        ema(&mut self.draft_s_per_req);
        if block > 0
            && let (Some(x), Some(c)) = (
                self.draft_s_by_len.get_mut(block),
                self.draft_n_by_len.get_mut(block),
            )
        {
            ema(x);
            *c = c.saturating_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    #[test]
    fn a_budget_known_ahead_skips_drafting_and_draft_cost_can_turn_speculation_off() {
        use specdec::VerifyPolicy;
        // Flat SPS up to 64 tokens: verification is free, so confident drafts are worth it.
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        let rows = [[0.9f32; 4]; 4];
        let conf: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        // The engine's loop: ask for the planned budget, draft unless it is 0, then select
        // (with no rows when nothing was drafted). Returns the steps that drafted.
        let run = |p: &mut ConfidencePolicy, steps: usize| -> Vec<bool> {
            (0..steps)
                .map(|_| {
                    let drafted = p.planned() != Some(0);
                    let rows: &[&[f32]] = if drafted { &conf } else { &[] };
                    p.select(rows, 0, 0, 1 << 20);
                    drafted
                })
                .collect()
        };
        // Plain decoding until the first probe (one request, one position) after 16 steps;
        // its decision applies at once.
        let first = run(&mut p, 16);
        assert_eq!(first.iter().filter(|&&x| x).count(), 1, "{first:?}");
        assert!(first[15]);
        assert_eq!(run(&mut p, 2), [true; 2]);
        // Decided two steps ago: every position (16), and blocks one longer so the budget can
        // grow past what was drafted.
        assert_eq!(p.planned(), Some(17));
        assert!(p.probe().is_none(), "a planned budget is not a probe");
        // Drafting that costs 10 s per request never pays: two steps later the budget is 0 and
        // drafting stops on every step (no half of the steps left drafting), except probes
        // after 16, then 32 zero-budget steps.
        p.observe_draft(40.0, 4, 1);
        let d = run(&mut p, 60);
        let drafting: Vec<usize> = (0..d.len()).filter(|&i| d[i]).collect();
        // Steps 0 and 1 still use budgets decided before the cost was known; then the 16th
        // zero-budget step probes, and each probe that confirms 0 doubles the wait.
        assert_eq!(drafting, [0, 1, 17, 49]);
        // A probe that costs 5 steps: the next ones are spaced so probing takes ≤ 1 % of the
        // time (500 steps apart).
        p.observe_step(0.01, 8);
        p.probing = true;
        p.observe_draft(0.05, 1, 1);
        p.probing = false;
        assert_eq!(p.probe_spacing(), 500);
        // Without the cost counted (a remote drafter that overlaps), the next probe's fresh
        // decision applies at once and every later step drafts again.
        p.count_draft_cost = false;
        let d = run(&mut p, 80);
        let first = d.iter().position(|&x| x).expect("a probe");
        assert!(d[first..].iter().all(|&x| x), "{d:?}");
    }

    /// Without a lag, whether a request's first draft is verified must not depend on the
    /// confidence of its second (computed from the first draft's token). With S(1) = 100 and
    /// S(2) = S(3) = 60 and c_1 = 0.5, the global argmax verifies both drafts when c_2 = 0.9
    /// (Θ = 117 against 100) and none when c_2 = 0.1.
    #[test]
    fn without_a_lag_a_draft_is_verified_whatever_the_token_after_it() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (3, 60.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 0, 4096, 4);
        p.count_draft_cost = false;
        let first =
            |p: &mut ConfidencePolicy, c2: f32| p.select(&[&[0.5, c2]], 0, 0, 1 << 20)[0].min(1);
        assert_eq!(first(&mut p, 0.9), first(&mut p, 0.1));
        // The argmax itself does depend on it (what the lagged budgets may use).
        let mut adm = Admission::default();
        let step = StepLimits {
            max_batch_tokens: 4096,
            kv_headroom: 1 << 20,
            other_tokens: 0,
            plain_requests: 0,
        };
        let lim = [ReqLimits { min_k: 0, max_k: 4 }];
        let k = |c2: f32, adm: &mut Admission| {
            adm.decide(&[&[0.5, c2]], &lim, step, &sps, Rule::Argmax).k[0]
        };
        assert_eq!((k(0.9, &mut adm), k(0.1, &mut adm)), (2, 0));
    }

    /// A central scheduler answering a policy's reports at once (before its next step), as
    /// the service does: the budget for the step the report's lag names.
    struct Central {
        rx: tokio::sync::mpsc::Receiver<ConfReport>,
        slot: std::sync::Arc<std::sync::Mutex<ExternalBudget>>,
        adm: Admission,
    }

    impl Central {
        /// Wires `p` to it when `on` (else `p` decides alone, and nothing is reported).
        fn wire(p: &mut ConfidencePolicy, on: bool) -> Self {
            let (tx, rx) = tokio::sync::mpsc::channel(64);
            let slot = std::sync::Arc::new(std::sync::Mutex::new(ExternalBudget::default()));
            if on {
                p.report = Some(tx);
                p.external = Some(slot.clone());
            }
            Self {
                rx,
                slot,
                adm: Admission::default(),
            }
        }

        /// Answers every report waiting, with the worker's prices when `send_prices`; whether
        /// any answer was priced by them.
        fn answer(&mut self, sps: &SpsTable, send_prices: bool) -> bool {
            let mut priced = false;
            while let Ok(r) = self.rx.try_recv() {
                let refs: Vec<&[f32]> = r.rows.iter().map(|c| c.as_slice()).collect();
                let step = StepLimits {
                    max_batch_tokens: r.max_batch_tokens,
                    kv_headroom: r.kv_headroom,
                    other_tokens: r.other_tokens,
                    plain_requests: r.plain_requests,
                };
                let prices = r.prices.filter(|_| send_prices).unwrap_or_default();
                let (k, judged) = central_budget(&mut self.adm, &refs, r.max_k, step, sps, &prices);
                priced |= judged.is_some();
                self.slot.lock().unwrap().set(r.step + u64::from(r.lag), k);
            }
            priced
        }
    }

    /// The central scheduler decides from the worker's reports; a worker whose drafting costs
    /// more than it gains must be told 0, as its own decision would be (the table prices
    /// verification, not drafting). Answered from the table alone, the central budget kept a
    /// costly drafter drafting on every step.
    #[test]
    fn central_budgets_weigh_the_workers_drafting_as_its_own_decision_does() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let rows = [[0.9f32; 4]; 4];
        let conf: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        // Steps that drafted, and the central budgets used, with or without the worker's
        // prices sent along.
        let scenario = |central: bool, send_prices: bool| -> (Vec<bool>, Vec<bool>, u64) {
            let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 4);
            let mut c = Central::wire(&mut p, central);
            let mut priced = false;
            let mut run = |p: &mut ConfidencePolicy, steps: usize| -> Vec<bool> {
                (0..steps)
                    .map(|_| {
                        let drafted = p.planned() != Some(0);
                        let rows: &[&[f32]] = if drafted { &conf } else { &[] };
                        p.select(rows, 0, 0, 1 << 20);
                        priced |= c.answer(&sps, send_prices);
                        drafted
                    })
                    .collect()
            };
            // The first probe after 16 plain steps; drafting that costs next to nothing pays.
            run(&mut p, 16);
            p.observe_draft(4e-6, 4, 1);
            let cheap = run(&mut p, 6);
            // Drafting that costs 10 s a request never pays (measured again and again: one
            // sample moves the means by a factor 1.6 at most).
            for _ in 0..60 {
                p.observe_draft(40.0, 4, 1);
            }
            let dear = run(&mut p, 60);
            assert_eq!(priced, central && send_prices);
            (
                cheap,
                dear,
                p.central_steps.load(std::sync::atomic::Ordering::Relaxed),
            )
        };
        let (cheap, dear, central) = scenario(true, true);
        let (local_cheap, local_dear, _) = scenario(false, false);
        assert!(cheap.iter().all(|&d| d), "{cheap:?}");
        assert!(central > 0, "central budgets were used");
        // Step for step as the worker alone decides: drafting runs on while its mean gain
        // from the cheap steps fades, then only the back-off's probes draft.
        assert_eq!((&cheap, &dear), (&local_cheap, &local_dear));
        let tail = dear[30..].iter().filter(|&&d| d).count();
        assert!(tail <= 2, "{tail} of the last 30 steps drafted: {dear:?}");
        // The table alone keeps it drafting.
        let (_, dear, _) = scenario(true, false);
        let tail = dear[30..].iter().filter(|&&d| d).count();
        assert!(tail > 20, "{dear:?}");
    }

    /// A central budget is used at the step it was answered for, two steps after the
    /// confidences it came from, as the local queue uses its own; under ping-pong that is the
    /// same micro-batch's last turn. With one slot, the answer for step t+2 overwrote the one
    /// for t+1 and was taken at t+1: each step ran on the other micro-batch's budget.
    #[test]
    fn central_budgets_apply_at_their_own_step_under_alternating_batches() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(16, 100.0), (256, 20.0)]).unwrap();
        // Micro-batch A: four confident requests; B: one doubtful one.
        let a = [[0.95f32; 4]; 4];
        let b = [[0.2f32; 4]; 1];
        let rows_a: Vec<&[f32]> = a.iter().map(|r| r.as_slice()).collect();
        let rows_b: Vec<&[f32]> = b.iter().map(|r| r.as_slice()).collect();
        let run = |central: bool| -> (Vec<Vec<usize>>, u64) {
            let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 4);
            let mut c = Central::wire(&mut p, central);
            let mut out = Vec::new();
            for i in 0..60 {
                let drafted = p.planned() != Some(0);
                let rows: &[&[f32]] = match (drafted, i % 2) {
                    (false, _) => &[],
                    (true, 0) => &rows_a,
                    (true, _) => &rows_b,
                };
                out.push(p.select(rows, 0, 0, 1 << 20));
                c.answer(&sps, false);
            }
            (
                out,
                p.central_steps.load(std::sync::atomic::Ordering::Relaxed),
            )
        };
        let (central, used) = run(true);
        let (local, _) = run(false);
        assert!(used > 10, "central budgets were used: {used}");
        // Both micro-batches drafted and were verified at their own budgets.
        let verified = |ks: &[Vec<usize>], parity: usize| -> usize {
            ks.iter()
                .skip(parity)
                .step_by(2)
                .map(|k| k.iter().sum::<usize>())
                .sum()
        };
        assert!(verified(&local, 0) > verified(&local, 1), "{local:?}");
        assert_eq!(central, local);
    }

    /// A central budget answered for a step two on counts as drafting soon (the engine then
    /// prefetches that micro-batch's round and captures its features), as a local one queued
    /// there does; only the next step's was looked at.
    #[test]
    fn a_central_budget_two_steps_on_is_drafting_soon() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        let slot = std::sync::Arc::new(std::sync::Mutex::new(ExternalBudget::default()));
        p.external = Some(slot.clone());
        assert!(!p.drafting_within(2), "nothing planned, no probe due");
        slot.lock().unwrap().set(p.steps + 2, 3);
        assert!(p.drafting_within(2));
        assert!(
            p.drafting_within(1),
            "within the lag's reach whatever is asked"
        );
        // An answer for a step past the lag and the question is not looked at.
        let mut q = ConfidencePolicy::new(p.sps.clone(), Rule::Argmax, 2, 4096, 4);
        let far = std::sync::Arc::new(std::sync::Mutex::new(ExternalBudget::default()));
        far.lock().unwrap().set(q.steps + 5, 3);
        q.external = Some(far);
        assert!(!q.drafting_within(2));
    }

    /// A worker whose scheduler has not answered runs on local budgets, and counts them so.
    #[test]
    fn an_unanswered_central_slot_is_no_central_budget() {
        use specdec::VerifyPolicy;
        use std::sync::atomic::Ordering::Relaxed;
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        p.external = Some(std::sync::Arc::new(std::sync::Mutex::new(
            ExternalBudget::default(),
        )));
        for _ in 0..4 {
            assert_eq!(p.planned(), Some(0));
            p.select(&[], 0, 4, 1 << 20);
        }
        assert_eq!(p.central_steps.load(Relaxed), 0);
        assert_eq!(p.local_steps.load(Relaxed), 4);
    }

    #[test]
    fn a_step_past_the_table_leaves_the_budgets_ahead_alone() {
        use specdec::VerifyPolicy;
        // Profiled up to 32 tokens; a 256-token prompt chunk beside 4 decoders is past it.
        let sps = SpsTable::new(vec![(16, 100.0), (32, 100.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        let rows = [[0.9f32; 4]; 4];
        let conf: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        // Plain decoding until the first probe (after 16 steps), whose decision applies at once.
        for _ in 0..20 {
            let drafted = p.planned() != Some(0);
            let r: &[&[f32]] = if drafted { &conf } else { &[] };
            p.select(r, 0, 0, 1 << 20);
        }
        // Every position of the 4 requests fits the table: 16, blocks one longer.
        assert_eq!(p.planned(), Some(17));
        // The chunk's step verifies what was planned for it...
        let k = p.select(&conf, 256, 0, 1 << 20);
        assert_eq!(k.iter().sum::<usize>(), 16, "{k:?}");
        // ...and the steps after it, the chunk gone, keep the budget (its decision, from no
        // data, was 0).
        p.select(&conf, 0, 0, 1 << 20);
        assert_eq!(p.planned(), Some(17));
        p.select(&conf, 0, 0, 1 << 20);
        assert_eq!(p.planned(), Some(17));
    }

    #[test]
    fn features_are_wanted_only_within_their_window_before_a_drafting_step() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        let rows = [[0.9f32; 4]; 4];
        let conf: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        // Drafting that never pays: after the first probes, spaced probes only (as in the
        // test above). Per step: whether it drafted, and whether features were wanted after it.
        p.observe_draft(40.0, 4, 1);
        const W: usize = 4;
        let mut probe_only = Vec::new();
        let steps: Vec<(bool, bool)> = (0..200)
            .map(|_| {
                let drafted = p.planned() != Some(0);
                let rows: &[&[f32]] = if drafted { &conf } else { &[] };
                p.select(rows, 0, 0, 1 << 20);
                probe_only.push(p.probe_only_within(W));
                (drafted, p.drafting_within(W))
            })
            .collect();
        let drafts: Vec<usize> = (0..steps.len()).filter(|&i| steps[i].0).collect();
        assert!(drafts.len() >= 3, "{drafts:?}");
        // Every step of the window before a drafting step wanted features: the drafter has
        // the last W positions of whatever request it drafts for.
        for &j in &drafts {
            for i in j.saturating_sub(W)..j {
                assert!(steps[i].1, "step {i}, {} before drafting step {j}", j - i);
            }
        }
        // Before a probe that ends a long back-off they wanted them for the probe's request
        // alone, before one early in the back-off for every request; a step that wanted none
        // wanted none for a probe either.
        let mut kinds = (0, 0);
        for k in 1..drafts.len() {
            let (a, j) = (drafts[k - 1], drafts[k]);
            if j - a <= W {
                continue;
            }
            let long = j - a >= SENTINEL_BACKOFF;
            if long {
                kinds.0 += 1;
            } else {
                kinds.1 += 1;
            }
            for i in j - W..j {
                let want = long.then_some(1);
                assert_eq!(probe_only[i], want, "step {i} before {j}: {drafts:?}");
            }
        }
        assert!(kinds.0 >= 1 && kinds.1 >= 1, "{kinds:?}: {drafts:?}");
        for (i, s) in steps.iter().enumerate() {
            assert!(s.1 || probe_only[i].is_none(), "step {i}");
        }
        // And most steps of the back-off did not.
        let wanted = steps.iter().filter(|s| s.1).count();
        assert!(
            wanted * 4 < steps.len(),
            "{wanted} of {} steps",
            steps.len()
        );
        // A proposer that states no window (usize::MAX) always gets its features.
        assert!(p.drafting_within(usize::MAX));
        // A positive budget planned ahead wants them.
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        for _ in 0..18 {
            let drafted = p.planned() != Some(0);
            let rows: &[&[f32]] = if drafted { &conf } else { &[] };
            p.select(rows, 0, 0, 1 << 20);
        }
        assert!(p.planned().is_some_and(|b| b > 0));
        assert!(p.drafting_within(0));
        assert_eq!(p.probe_only_within(0), None, "every request may draft");
    }

    #[test]
    fn a_zero_budget_from_one_step_does_not_stop_drafting_that_pays_on_average() {
        use specdec::VerifyPolicy;
        // A 2-token step costs 7.5 % more than a 1-token one; drafting costs 15 % of a step.
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        p.observe_draft(0.0015, 1, 1);
        // One request; the engine's loop as above (a step that does not draft decodes plainly).
        let step = |p: &mut ConfidencePolicy, c: f32| -> (bool, usize) {
            let drafted = p.planned() != Some(0);
            let row = [c];
            let k = if drafted {
                p.select(&[&row], 0, 0, 1 << 20)
            } else {
                p.select(&[], 0, 1, 1 << 20)
            };
            (drafted, k.first().copied().unwrap_or(0))
        };
        // Confident on two steps of three (worth +31 % each), not on the third (drafting
        // then costs 13 %): on average drafting pays, though every third decision says 0.
        let conf = |i: usize| if i % 3 == 1 { 0.05f32 } else { 0.6 };
        let first: Vec<(bool, usize)> = (0..64).map(|i| step(&mut p, conf(i))).collect();
        let start = first.iter().position(|x| x.0).expect("a first probe");
        assert_eq!(start, 15, "plain decoding until the first probe");
        assert!(
            first[start..].iter().all(|x| x.0),
            "every step drafts once drafting has paid: {first:?}"
        );
        assert!(first[start..].iter().filter(|x| x.1 > 0).count() > 20);
        assert!(p.drafting_gain().is_some_and(|g| g > 0.0));
        // Confidence collapses: the mean gain turns negative beyond its noise within a dozen
        // steps or so, and drafting falls back to spaced probes.
        let late: Vec<bool> = (0..64).map(|_| step(&mut p, 0.05).0).collect();
        assert!(p.drafting_gain().is_some_and(|g| g < 0.0));
        assert!(late.iter().filter(|&&d| d).count() <= 16, "{late:?}");
        assert!(late[16..].iter().filter(|&&d| d).count() <= 2, "{late:?}");
        // One unlucky first probe (drafting cost 13 % then) does not turn drafting off for the
        // whole back-off: the next steps explore, find it pays, and keep drafting.
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        p.observe_draft(0.0015, 1, 1);
        let d: Vec<bool> = (0..40)
            .map(|i| step(&mut p, if i == 15 { 0.05 } else { 0.6 }).0)
            .collect();
        assert!(d[15] && d[16..].iter().all(|&x| x), "{d:?}");
        assert!(p.drafting_gain().is_some_and(|g| g > 0.0));
        // Drafting that pays 3 % on average, in swings: six steps at +22 %, six at −17 %.
        // A mean that stopped at its first dip below zero would stop here; one that stops only
        // below its noise keeps drafting.
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        p.observe_draft(0.0015, 1, 1);
        let conf = |i: usize| if i % 12 < 6 { 0.5f32 } else { 0.02 };
        let d: Vec<bool> = (0..160).map(|i| step(&mut p, conf(i)).0).collect();
        let start = d.iter().position(|&x| x).expect("a first probe");
        assert!(d[start..].iter().all(|&x| x), "{d:?}");
        assert!(p.gain_se() > 0.01, "{}", p.gain_se());
    }

    #[test]
    fn plain_steps_are_priced_at_their_own_measured_cost() {
        use specdec::VerifyPolicy;
        // The table: a 2-token step costs 7.5 % more than a 1-token one. Measured, a plain
        // step takes what the table says (10 ms), a drafting step 16 % more than the table
        // (acceptance and sampling work per verified position), and drafting 1.5 ms. At a
        // confidence of 0.3, drafting then loses 7 %; priced with one ratio fitted on the
        // drafting steps, a plain step would look as dear and drafting would gain 8 %.
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let run = |per_b: bool| -> Vec<bool> {
            let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 1);
            p.observe_draft(0.0015, 1, 1);
            (0..200)
                .map(|_| {
                    let drafted = p.planned() != Some(0);
                    let row = [0.3f32];
                    let k = if drafted {
                        p.select(&[&row], 0, 0, 1 << 20)
                    } else {
                        p.select(&[], 0, 1, 1 << 20)
                    };
                    let b = 1 + k.first().copied().unwrap_or(0);
                    let secs = if b == 1 { 0.010 } else { 0.0125 };
                    p.observe_step(secs, b);
                    if !per_b {
                        p.step_scales.iter_mut().for_each(|x| *x = 0.0);
                        p.decode_secs.iter_mut().for_each(|x| *x = 0.0);
                        p.decode_drift = 1.0;
                        p.step_drift = 1.0;
                    }
                    drafted
                })
                .collect()
        };
        let with = run(true);
        let without = run(false);
        // Plain decoding first, then a probe; priced per B, drafting is seen not to pay and
        // only spaced probes remain.
        assert!(with[100..].iter().filter(|&&d| d).count() <= 4, "{with:?}");
        // The single ratio keeps drafting on almost every step.
        assert!(
            without[100..].iter().filter(|&&d| d).count() >= 90,
            "{without:?}"
        );
    }

    #[test]
    fn verification_is_priced_at_the_measured_difference_of_decoding_steps() {
        // The table prices a 2-token step at 1.3 one-token steps; the engine's decoding steps
        // measure 10 and 11.4 ms (1.14), the first 2-token one slow (14 ms, a cold cache).
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (2, 77.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        let step = |p: &mut ConfidencePolicy, secs: f64, b: usize| {
            p.step_is_decode = true;
            p.observe_step(secs, b);
        };
        step(&mut p, 0.010, 1);
        step(&mut p, 0.014, 2);
        for _ in 0..10 {
            for _ in 0..20 {
                step(&mut p, 0.010, 1);
            }
            step(&mut p, 0.0114, 2);
        }
        let plain = p.step_seconds(1);
        assert!((plain - 0.010).abs() < 2e-4, "{plain}");
        // The measured difference reads within 3 % of 1.14.
        let measured = p.verify_seconds(1, 0, 1) / plain;
        assert!((measured - 1.14).abs() < 0.035, "{measured}");
        // The per-size scale, following its own steps against the drift of the 1-token
        // reference, has left the slow first step behind as well (it read above 1.2 while
        // three quarters of each residual went to the shared drift).
        let scaled = p.step_seconds(2) / plain;
        assert!((scaled - 1.14).abs() < 0.035, "{scaled}");
        // With a prefill chunk in the step (no decoding step of that shape measured), or at
        // a size never measured, the scaled table prices it.
        assert_eq!(p.verify_seconds(1, 16, 1), p.step_seconds(18));
        assert_eq!(p.verify_seconds(1, 0, 3), p.step_seconds(4));
    }

    #[test]
    fn a_rarely_seen_size_is_priced_at_the_machine_speed_of_now() {
        // c = 2: 3-token steps (a free draft) are seen once, in a fast spell (5 ms plain, 6.5 ms
        // with the draft); then the machine slows by a third and only 2-token steps run.
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (2, 100.0), (3, 70.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        let step = |p: &mut ConfidencePolicy, secs: f64, b: usize| {
            p.step_is_decode = true;
            p.observe_step(secs, b);
        };
        for _ in 0..50 {
            step(&mut p, 0.005, 2);
        }
        step(&mut p, 0.0065, 3);
        for _ in 0..200 {
            step(&mut p, 0.0067, 2);
        }
        // Now a 3-token step costs about 8.7 ms: the draft adds 2 ms, not the 6.5 − 6.7 of
        // the raw seconds (nothing at all, floored at 0).
        let plain = p.decode_at(2).unwrap();
        assert!((plain - 0.0067).abs() < 3e-4, "{plain}");
        let added = p.decode_added(2, 1, 0.0);
        assert!((added - 0.002).abs() < 3e-4, "{added}");
        let v = p.verify_seconds(2, 0, 1) - p.step_seconds(2);
        assert!((v - 0.002).abs() < 3e-4, "{v}");
    }

    #[test]
    fn drafting_is_priced_by_the_block_length_it_drafts() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (2, 90.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 7);
        // Blocks of 7 cost 6.8 ms, blocks of 2 cost 2 ms (one request each), three calls each.
        for _ in 0..3 {
            p.observe_draft(0.0068, 1, 7);
        }
        for _ in 0..3 {
            p.observe_draft(0.002, 1, 2);
        }
        assert!((p.draft_s_at(7) - 0.0068).abs() < 1e-9);
        assert!((p.draft_s_at(2) - 0.002).abs() < 1e-9);
        // Lengths between or outside: the line through the measured ones.
        let four = p.draft_s_at(4);
        assert!((four - 0.00392).abs() < 1e-6, "{four}");
        let one = p.draft_s_at(1);
        assert!((one - 0.00104).abs() < 1e-6, "{one}");
        // A probe at c = 1 whose first position is at 0.4: a budget of 1 drafts blocks of 2
        // (2 ms) on 11.1 ms steps against 10 ms plain ones, 1.4 tokens in 13.1 ms: +7 %. The
        // mean over every length (4.5 ms, though its last three calls were the cheap ones) said
        // 1.4 tokens in 15.6 ms, −10 %.
        assert!(p.draft_s_per_req > 0.0044, "{}", p.draft_s_per_req);
        p.probing = true;
        p.select(&[&[0.4f32, 0.01][..]], 0, 0, 1 << 20);
        assert_eq!(p.last_real, 1);
        assert!(p.drafting_gain().is_some_and(|g| g > 0.05 && g < 0.09));
        // With one length measured, every length is priced at it.
        let mut q = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 7);
        q.observe_draft(0.003, 2, 1);
        assert!((q.draft_s_at(5) - 0.0015).abs() < 1e-9);
        assert!((q.draft_seconds(2, 5) - 0.003).abs() < 1e-9);
        // A length's own mean prices it only after three calls: one slow first call at length
        // 3 (9 ms, a cold start) is read through the line until then.
        q.observe_draft(0.009, 1, 3);
        assert!(q.draft_s_at(3) < 0.009, "{}", q.draft_s_at(3));
        // Calls that measured no time at all are not costs.
        let before = q.draft_s_per_req;
        q.observe_draft(0.0, 1, 1);
        assert_eq!(q.draft_s_per_req, before);
        // Below the shortest measured length the line can reach 0; the shortest's cost scaled
        // by length is the floor. Longer blocks measured cheaper than shorter ones (noise):
        // the nearest shorter length is the floor.
        let mut r = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 7);
        for _ in 0..3 {
            r.observe_draft(0.001, 1, 3);
            r.observe_draft(0.0068, 1, 7);
        }
        assert!(
            (r.draft_s_at(1) - 0.001 / 3.0).abs() < 1e-9,
            "{}",
            r.draft_s_at(1)
        );
        let mut u = ConfidencePolicy::new(
            SpsTable::new(vec![(1, 100.0), (64, 20.0)]).unwrap(),
            Rule::Argmax,
            2,
            4096,
            7,
        );
        for _ in 0..3 {
            u.observe_draft(0.005, 1, 2);
            u.observe_draft(0.003, 1, 7);
        }
        assert!(
            (u.draft_s_at(5) - 0.005).abs() < 1e-9,
            "{}",
            u.draft_s_at(5)
        );
    }

    #[test]
    fn free_drafts_are_decided_at_once_at_measured_prices_and_leave_the_plan_alone() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let fresh = || {
            let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 4);
            // Drafting calls are dear (a zero budget is planned), steps cost what the table says.
            p.observe_draft(0.05, 1, 1);
            p.observe_step(0.010, 1);
            p.observe_step(1.0 / 93.0, 2);
            p
        };
        // The same steps, one with free drafts on its zero-planned steps: the lagged plan and
        // drafting's running gain do not move with them.
        let (mut a, mut b) = (fresh(), fresh());
        let row = [0.9f32];
        for _ in 0..6 {
            a.planned();
            b.planned();
            a.select(&[], 0, 1, 1 << 20);
            assert_eq!(b.select_free(&[&row], 0, 0, 1 << 20), vec![1]);
        }
        assert_eq!(a.planned(), b.planned());
        assert_eq!((a.gain_seen, a.gain_ema), (b.gain_seen, b.gain_ema));
        // Where the measured price of one more token exceeds what it is expected to bring, a
        // free draft is not verified either: a 2-token step at 1.5 times a 1-token one pays
        // for a draft at 0.9 (1.9 tokens), not at 0.3.
        let mut c = fresh();
        for _ in 0..50 {
            c.observe_step(0.015, 2);
            c.observe_step(0.010, 1);
        }
        assert_eq!(c.select_free(&[&row], 0, 0, 1 << 20), vec![1]);
        assert_eq!(c.select_free(&[&[0.3f32][..]], 0, 0, 1 << 20), vec![0]);
        assert_eq!(c.select_free(&[], 0, 1, 1 << 20), Vec::<usize>::new());
    }

    #[test]
    fn a_price_seen_while_the_machine_was_slow_follows_it_when_it_speeds_up() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        // Cold start: both shapes measured 30 % slower than the table, a 2-token step 10 %
        // dearer than a 1-token one.
        for _ in 0..20 {
            p.observe_step(0.013, 1);
            p.observe_step(0.013 * 1.1, 2);
        }
        let ratio = p.scale_for(2) / p.scale_for(1);
        assert!((ratio - 1.1 * 0.93).abs() < 0.01, "{ratio}");
        // Warm: only plain steps are seen now, at the table's own speed.
        for _ in 0..200 {
            p.observe_step(0.010, 1);
        }
        assert!((p.scale_for(1) - 1.0).abs() < 0.01, "{}", p.scale_for(1));
        // The 2-token price came down with the machine, most of the way (a drift seen on one
        // B cannot be told apart from a change of that B alone).
        let slow = 0.013 * 1.1;
        assert!(
            p.scale_for(2) / 93.0 < 0.0125 && p.scale_for(2) / 93.0 > 0.010,
            "2-token step priced at {} s (cold: {slow} s, warm: 0.011 s)",
            p.scale_for(2) / 93.0
        );
        // Steps of that B then set its price on their own.
        for _ in 0..100 {
            p.observe_step(0.011, 2);
            p.observe_step(0.010, 1);
        }
        assert!(
            (p.scale_for(2) / 93.0 - 0.011).abs() < 0.0002,
            "{}",
            p.scale_for(2) / 93.0
        );
        assert!((p.scale_for(1) / 100.0 - 0.010).abs() < 0.0002);
    }

    #[test]
    fn a_rarely_seen_batch_size_follows_the_machine_speed_of_now() {
        // c = 8: one 9-token step (a free draft) is measured in a fast spell, at 0.9 of the
        // table's price; then the machine slows by 34 % and only 8-token steps run. The
        // 9-token price follows the whole slowdown (split three quarters to the drift, it
        // stayed 7 % low, and drafts on top of the batch looked that much cheaper).
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(8, 100.0), (9, 60.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps.clone(), Rule::Argmax, 2, 4096, 1);
        for _ in 0..50 {
            p.observe_step(0.010, 8);
        }
        p.observe_step(0.9 / 60.0, 9);
        for _ in 0..200 {
            p.observe_step(0.0134, 8);
        }
        let eight = p.step_seconds(8);
        assert!((eight - 0.0134).abs() < 2e-4, "{eight}");
        let nine = p.step_seconds(9);
        let want = 0.9 / 60.0 * 1.34;
        assert!(
            (nine - want).abs() < 3e-4,
            "9-token step priced at {nine} s, not {want}"
        );
    }

    #[test]
    fn a_batch_size_never_measured_is_priced_like_its_measured_neighbours() {
        use specdec::VerifyPolicy;
        // 40 batch tokens profile 10 % slower than 32.
        let sps = SpsTable::new(vec![(32, 10.0), (40, 9.0), (256, 2.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        // Plain decoding steps of 32 requests measure at the table's price; the prefill steps
        // mixed in (B = 200) at a quarter of it, which pulls the mean over all steps down.
        for _ in 0..40 {
            p.observe_step(0.100, 32);
            p.observe_step(0.125, 200);
        }
        assert!(p.step_scale < 0.8, "{}", p.step_scale);
        // 33 tokens (one free draft on top of the plain batch) were never measured: priced like
        // 32 (and a step of 33 costs an eighth of the profiled 10 % more than one of 32), not
        // at the mean, so a draft that brings a third of a token on top of 32 is not verified.
        assert!((p.scale_for(33) - p.scale_for(32)).abs() < 1e-9);
        assert!((p.scale_for(32) - 1.0).abs() < 0.02, "{}", p.scale_for(32));
        let row = [0.3f32];
        assert_eq!(p.select_free(&[&row], 0, 31, 1 << 20), vec![0]);
        // Between two measured neighbours the dearer one sets the price; far from any, the
        // mean over all steps.
        p.observe_step(1.5 / 9.0, 36);
        assert!(p.scale_for(34) > p.scale_for(32) * 1.2);
        assert!((p.scale_for(100) - p.step_scale).abs() < 1e-12);
    }

    /// A table of `fixed` seconds plus `per` seconds a token, profiled at a few batch sizes.
    fn linear_table(fixed: f64, per: f64) -> SpsTable {
        let pts: Vec<(u32, f64)> = [1u32, 8, 16, 32, 64, 128, 256]
            .iter()
            .map(|&b| (b, 1.0 / (fixed + per * b as f64)))
            .collect();
        SpsTable::new(pts).unwrap()
    }

    #[test]
    fn free_drafts_are_weighed_against_the_decoding_seconds_they_save() {
        use specdec::VerifyPolicy;
        // 10 ms a step plus 1 ms a token: a decoding token costs 11 ms at one request, 2 ms
        // at 10 and 1.33 ms at 30, and a verified draft adds 1 ms whatever the batch.
        let mut p = ConfidencePolicy::new(linear_table(0.010, 0.001), Rule::Argmax, 2, 4096, 4);
        let row = [0.6f32];
        // One request: a draft saves a whole 11 ms step for 1 ms; even 0.15 is worth it.
        assert_eq!(p.select_free(&[&[0.15f32][..]], 0, 0, 1 << 20), vec![1]);
        // Ten: a draft is worth its 1 ms at survival above one half.
        assert_eq!(p.select_free(&[&row], 0, 9, 1 << 20), vec![1]);
        assert_eq!(p.select_free(&[&[0.4f32][..]], 0, 9, 1 << 20), vec![0]);
        // Thirty: above three quarters. A 150-token prefill chunk in the step changes what the
        // draft costs, not what it saves (the prefill's seconds are spent either way): with it
        // the step's own rate is low, and the overall rate (prefill seconds included) would
        // price a token at 2.4 ms and take the draft at 0.6.
        assert_eq!(p.select_free(&[&row], 150, 29, 1 << 20), vec![0]);
        assert_eq!(p.select_free(&[&[0.8f32][..]], 150, 29, 1 << 20), vec![1]);
        // Within a block, verification stops where the survival drops below one half.
        assert_eq!(
            p.select_free(&[&[0.9f32, 0.9, 0.5, 0.9][..]], 0, 9, 1 << 20),
            vec![2]
        );
        // Decoding steps measured at 2 ms plus 1 ms a token (1.2 ms a token at ten requests,
        // where the table said 2 ms): a draft at 0.6 no longer pays for its 1 ms.
        for _ in 0..40 {
            for b in [8usize, 10, 12] {
                p.select(&[], 0, b, 1 << 20);
                p.observe_step(0.002 + 0.001 * b as f64, b);
            }
        }
        assert!((p.decode_token_seconds(10) - 0.0012).abs() < 1e-6);
        assert_eq!(p.select_free(&[&row], 0, 9, 1 << 20), vec![0]);
        assert_eq!(p.select_free(&[&[0.95f32][..]], 0, 9, 1 << 20), vec![1]);
    }

    #[test]
    fn free_drafts_that_realize_less_than_their_confidence_are_discounted() {
        use specdec::VerifyPolicy;
        let mut p = ConfidencePolicy::new(linear_table(0.010, 0.001), Rule::Argmax, 2, 4096, 4);
        // Ten requests: a token's 1 ms is worth half a token, a draft at 0.7 is verified...
        let row = [0.7f32];
        assert_eq!(p.select_free(&[&row], 0, 9, 1 << 20), vec![1]);
        // ... until free drafts are seen to be accepted at 60 % of their confidence (0.42).
        for _ in 0..100 {
            p.observe_outcome(10.0, 6, true);
            // Drafts from a drafting call do not count.
            p.observe_outcome(10.0, 1, false);
        }
        assert!(
            (p.free_realized() - 0.6).abs() < 0.01,
            "{}",
            p.free_realized()
        );
        assert_eq!(p.select_free(&[&row], 0, 9, 1 << 20), vec![0]);
        assert_eq!(p.select_free(&[&[0.95f32][..]], 0, 9, 1 << 20), vec![1]);
    }

    #[test]
    fn drafts_on_a_full_batch_cost_no_less_than_the_short_context_staircase_says() {
        use specdec::VerifyPolicy;
        // The engine's 32- and 33-token decoding steps measured alike, 40 ms (each size's
        // running mean has its own noise).
        let run = |table: SpsTable| {
            let mut p = ConfidencePolicy::new(table, Rule::Argmax, 2, 4096, 4);
            for _ in 0..30 {
                for b in [32usize, 33] {
                    p.select(&[], 0, b, 1 << 20);
                    p.observe_step(0.040, b);
                }
            }
            p
        };
        let table = linear_table(0.010, 0.001);
        // Read as measured, a draft on a full batch of 32 is free: verified at any survival.
        let mut p = run(table.clone());
        assert_eq!(p.select_free(&[&[0.3f32][..]], 0, 31, 1 << 20), vec![1]);
        // Short-context decoding steps of 4 ms + 1 ms a token: over 32 to 64 a token adds 2.8 %
        // of a 32-token step, 1.11 ms of the measured 40. A decoding token costs 1.25 ms, so a
        // draft pays above a survival of 0.89.
        let flat: Vec<(u32, f64)> = [1u32, 32, 33, 64]
            .iter()
            .map(|&b| (b, 1.0 / (0.004 + 0.001 * b as f64)))
            .collect();
        let mut p = run(table.clone().with_marginal(flat.clone()));
        assert_eq!(p.select_free(&[&[0.8f32][..]], 0, 31, 1 << 20), vec![0]);
        assert_eq!(p.select_free(&[&[0.95f32][..]], 0, 31, 1 << 20), vec![1]);
        // With a stair at the 33rd token (a pass over the weights: 40 ms where 32 take 36) the
        // first draft costs 11 % of the step, 4.4 ms: not even a sure one pays.
        let mut stair = flat;
        stair[2].1 = 1.0 / 0.040;
        let mut p = run(table.with_marginal(stair));
        assert_eq!(p.select_free(&[&[0.99f32][..]], 0, 31, 1 << 20), vec![0]);
        // An invalid staircase is dropped, not trusted.
        let t = linear_table(0.010, 0.001).with_marginal(vec![(1, 10.0), (2, 20.0)]);
        assert!(t.marginal.is_empty());
    }

    #[test]
    fn a_token_is_priced_at_the_measured_slope_where_the_table_understates_it() {
        use specdec::VerifyPolicy;
        // A profiled staircase with a large fixed cost (long contexts): 20 ms + 0.5 ms a token.
        let mut p = ConfidencePolicy::new(linear_table(0.020, 0.0005), Rule::Argmax, 2, 4096, 4);
        // The engine's steps: 6 ms + 1 ms a token. At 32 requests a decoding token costs
        // 1.19 ms and a draft 1 ms: a draft at 0.8 does not pay for itself.
        for _ in 0..30 {
            for b in [16usize, 20, 24, 28, 32] {
                p.select(&[], 0, b, 1 << 20);
                p.observe_step(0.006 + 0.001 * b as f64, b);
            }
            // Steps with a prefill chunk (whose tokens need no logits) are cheaper a token;
            // they price their own B but not a verified token.
            p.select(&[], 24, 16, 1 << 20);
            p.observe_step(0.030, 40);
        }
        assert!(
            (p.measured_slope(32) - 0.001).abs() < 1e-4,
            "{}",
            p.measured_slope(32)
        );
        // The table's slope on the measured scale: 0.5 ms × (38 ms / 36 ms) ≈ 0.53 ms a token,
        // for which a draft at 0.8 would look worth verifying.
        let table = p.step_seconds(33) - p.step_seconds(32);
        assert!(table < 0.0006, "{table}");
        assert_eq!(p.select_free(&[&[0.8f32][..]], 0, 31, 1 << 20), vec![0]);
        assert_eq!(p.select_free(&[&[0.95f32][..]], 0, 31, 1 << 20), vec![1]);
        // Too few measured sizes around B: no slope, the table's shape prices alone.
        assert_eq!(p.measured_slope(200), 0.0);
        // With a 150-token prefill chunk no decoding step was ever measured around B = 182,
        // and the table's slope there says 0.5 ms. The draft still needs its logits: it is
        // priced at the decoding slope around the step's 32 decoding requests.
        assert_eq!(p.measured_slope(182), 0.0);
        assert_eq!(p.select_free(&[&[0.8f32][..]], 150, 31, 1 << 20), vec![0]);
        assert_eq!(p.select_free(&[&[0.95f32][..]], 150, 31, 1 << 20), vec![1]);
    }

    #[test]
    fn a_draft_that_crosses_a_stair_of_the_table_is_priced_at_the_stair() {
        use specdec::VerifyPolicy;
        // SmolLM2's profiled staircase on this CPU: the kernels take 8 tokens per pass over
        // the weights, so B = 9..12 costs a stair more than B = 8.
        let sps = SpsTable::new(vec![
            (1, 189.4),
            (2, 189.4),
            (4, 113.1),
            (8, 54.2),
            (12, 38.8),
            (16, 29.5),
            (32, 19.6),
            (64, 12.3),
        ])
        .unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        // Decoding steps measured up to the full batch of 8 (0.45 ms a token below it), and
        // steps of 8 decoding requests with a 4-token prefill chunk, cheap (a chunk needs no
        // logits): they price B = 12 at 0.2 ms above B = 8.
        for _ in 0..30 {
            for b in 4..=8usize {
                p.select(&[], 0, b, 1 << 20);
                p.observe_step(0.0072 + 0.00045 * b as f64, b);
            }
            p.select(&[], 4, 8, 1 << 20);
            p.observe_step(0.0110, 12);
        }
        assert!((p.measured_slope(8) - 0.00045).abs() < 5e-5);
        // One request of the 8 has a free block of four at 0.7 each (expected 1.77 tokens,
        // 2.4 ms of decoding saved). At the slope, or at the prefill steps' price of B = 12,
        // all four pay; at the table's stair on the decoding steps' scale (about 4.3 ms for
        // four) none does.
        let row = [0.7f32; 4];
        assert_eq!(p.select_free(&[&row[..]], 0, 7, 1 << 20), vec![0]);
        // Certain drafts still pay for the stair.
        let sure = [0.99f32; 4];
        assert_eq!(p.select_free(&[&sure[..]], 0, 7, 1 << 20), vec![4]);
        // Once decoding steps of 12 tokens have been measured, their price is used.
        for _ in 0..30 {
            p.select(&[], 0, 12, 1 << 20);
            p.observe_step(0.0115, 12);
        }
        assert_eq!(p.select_free(&[&row[..]], 0, 7, 1 << 20), vec![4]);
    }

    #[test]
    fn a_small_budget_drafts_for_few_requests_when_drafting_shares_the_hardware() {
        use specdec::VerifyPolicy;
        let mut p = ConfidencePolicy::new(linear_table(0.010, 0.001), Rule::Argmax, 2, 4096, 4);
        assert_eq!(p.draft_width(2), 2);
        assert_eq!(p.draft_width(0), 1);
        // A drafter on its own device: drafting more costs the target nothing.
        p.count_draft_cost = false;
        assert_eq!(p.draft_width(2), usize::MAX);
    }

    #[test]
    fn the_slope_is_fitted_where_the_cost_curve_is_steep() {
        use specdec::VerifyPolicy;
        let mut p = ConfidencePolicy::new(linear_table(0.003, 0.0005), Rule::Argmax, 2, 4096, 4);
        // Flat while the weights' reading dominates (3 ms up to 3 tokens), then 1.25 ms a token.
        let secs = |b: usize| 0.003 + 0.00125 * b.saturating_sub(3) as f64;
        for _ in 0..30 {
            for b in 1..=16usize {
                p.select(&[], 0, b, 1 << 20);
                p.observe_step(secs(b), b);
            }
        }
        // Around B = 8 the fit starts at 4: the steep part only.
        let slope = p.measured_slope(8);
        assert!((slope - 0.00125).abs() < 1e-5, "{slope}");
        // At B = 8 a decoding token costs 9.25 / 8 = 1.16 ms, less than a draft adds: no free
        // draft pays, however confident.
        assert_eq!(p.select_free(&[&[0.99f32][..]], 0, 7, 1 << 20), vec![0]);
        // At two requests a step of three was measured at what a step of two costs: a draft
        // adds nothing, and even one at 0.2 is verified, though a slope fitted across the knee
        // (from 1 to 10 tokens) would say about 1 ms against the 0.3 ms it saves.
        let across = p.measured_slope(1);
        assert!(across > 0.0008, "{across}");
        assert_eq!(p.select_free(&[&[0.2f32][..]], 0, 1, 1 << 20), vec![1]);
        // A block stops where a step's measured seconds start to climb: three drafts at
        // 0.9, 0.9, 0.9 on two requests, of which the second and third cost 1.25 ms each for
        // 1.5 ms × survivals of 0.81 and 0.73.
        assert_eq!(
            p.select_free(&[&[0.9f32, 0.9, 0.9][..]], 0, 1, 1 << 20),
            vec![1]
        );
    }

    #[test]
    fn a_probe_verifies_what_pays_once_drafted_and_plans_with_the_drafting_cost() {
        use specdec::VerifyPolicy;
        // A 2-token step costs 7.5 % more than a 1-token one; drafting 30 % of a step.
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        p.observe_draft(0.003, 1, 1);
        // A probe. A draft at 0.2 does not pay for a drafting call (1.2 tokens in 13.75 ms
        // against 1 in 10 ms) but, drafted already, pays for its verification (1.2 in
        // 10.75 ms): it is verified, and the budget carried forward is 0.
        p.probing = true;
        assert_eq!(p.select(&[&[0.2f32][..]], 0, 0, 1 << 20), vec![1]);
        assert_eq!(p.last_real, 0);
        // A draft at 0.05 does not pay even for its verification.
        assert_eq!(p.planned(), None, "exploring: the next step probes too");
        assert_eq!(p.select(&[&[0.05f32][..]], 0, 0, 1 << 20), vec![0]);
    }

    /// While drafting seconds count, a probe drafts one position whatever `probe_k` says:
    /// deeper, whether x_j is verified would turn on c_{j+1} (a function of x_j).
    #[test]
    fn a_probe_that_counts_drafting_cost_drafts_one_position() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(1, 100.0), (2, 93.0), (64, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 1);
        p.probing = true;
        p.probe_k = 3;
        assert_eq!(p.probe().map(|(_, k)| k), Some(1));
        p.count_draft_cost = false;
        assert_eq!(p.probe().map(|(_, k)| k), Some(3));
    }

    #[test]
    fn a_probe_that_could_not_draft_is_carried_to_the_next_step() {
        use specdec::VerifyPolicy;
        let sps = SpsTable::new(vec![(64, 100.0), (256, 20.0)]).unwrap();
        let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, 4);
        for _ in 0..15 {
            assert_eq!(p.planned(), Some(0));
            p.select(&[], 0, 4, 1 << 20);
        }
        assert_eq!(p.planned(), None, "the 16th zero step probes");
        // No request could draft on that step (say, all at their last token).
        p.select(&[], 0, 4, 1 << 20);
        assert_eq!(p.planned(), None, "still probing");
        let row = [0.9f32; 4];
        p.select(&[&row], 0, 3, 1 << 20);
        assert!(p.probe().is_none());
        assert!(
            p.planned().is_some_and(|b| b > 0),
            "the probe's decision applies"
        );
    }

    fn staircase(rng: &mut Rng, max_b: u32) -> SpsTable {
        let mut pts = Vec::new();
        let mut s = 100.0 + rng.uniform() * 50.0;
        let mut b = 0;
        while b < max_b {
            b += 1 + rng.below(4) as u32;
            pts.push((b.min(max_b), s));
            if rng.uniform() < 0.5 {
                s *= 0.5 + rng.uniform() * 0.5;
            }
            if b >= max_b {
                break;
            }
        }
        pts.dedup_by_key(|p| p.0);
        SpsTable::new(pts).expect("valid staircase")
    }

    fn theta(conf: &[Vec<f32>], k: &[u32], sps: &SpsTable) -> f64 {
        let mut tau = conf.len() as f64;
        let mut b = conf.len() as u32;
        for (c, &kr) in conf.iter().zip(k) {
            let mut a = 1f32;
            for &x in &c[..kr as usize] {
                a *= clamp_conf(x).0;
                tau += a as f64;
            }
            b += kr;
        }
        tau * sps.sps(b)
    }

    /// Every K vector within limits, the best Θ.
    fn brute(conf: &[Vec<f32>], lim: &[ReqLimits], step: StepLimits, sps: &SpsTable) -> f64 {
        let n = conf.len();
        let lo: Vec<u32> = (0..n)
            .map(|r| (lim[r].min_k as usize).min(conf[r].len()) as u32)
            .collect();
        let hi: Vec<u32> = (0..n)
            .map(|r| (lim[r].max_k as usize).min(conf[r].len()) as u32)
            .collect();
        let forced: u32 = lo.iter().sum();
        let room = step
            .max_batch_tokens
            .min(sps.max_batch())
            .saturating_sub(
                (n as u32)
                    .saturating_add(step.other_tokens)
                    .saturating_add(forced),
            )
            .min(step.kv_headroom.saturating_sub(forced));
        let mut k = lo.clone();
        let mut best = f64::MIN;
        loop {
            let extra: u32 = k.iter().sum::<u32>() - forced;
            if extra <= room {
                best = best.max(theta(conf, &k, sps));
            }
            let mut i = 0;
            loop {
                if i == n {
                    return best;
                }
                if k[i] < hi[i].max(lo[i]) {
                    k[i] += 1;
                    break;
                }
                k[i] = lo[i];
                i += 1;
            }
        }
    }

    fn instance(rng: &mut Rng) -> (Vec<Vec<f32>>, Vec<ReqLimits>, StepLimits, SpsTable) {
        let n = 1 + rng.below(4);
        let conf: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..rng.below(5)).map(|_| rng.uniform() as f32).collect())
            .collect();
        let lim: Vec<ReqLimits> = (0..n)
            .map(|_| ReqLimits {
                min_k: if rng.uniform() < 0.2 { 1 } else { 0 },
                max_k: if rng.uniform() < 0.2 { 2 } else { u8::MAX },
            })
            .collect();
        let step = StepLimits {
            max_batch_tokens: 4 + rng.below(20) as u32,
            kv_headroom: rng.below(20) as u32,
            other_tokens: 0,
            plain_requests: 0,
        };
        let sps = staircase(rng, 24);
        (conf, lim, step, sps)
    }

    #[test]
    fn argmax_is_the_best_prefix_closed_set_and_greedy_never_beats_it() {
        let mut rng = Rng::new(11);
        let mut adm = Admission::default();
        let mut differ = 0;
        for _ in 0..3000 {
            let (conf, lim, step, sps) = instance(&mut rng);
            let refs: Vec<&[f32]> = conf.iter().map(|c| c.as_slice()).collect();
            let d = adm.decide(&refs, &lim, step, &sps, Rule::Argmax);
            // Prefix-closed and within limits by construction of the output: K_r ≤ drafted.
            for (r, &kr) in d.k.iter().enumerate() {
                assert!(kr as usize <= conf[r].len());
            }
            let got = theta(&conf, &d.k, &sps);
            assert!(
                (got - d.theta).abs() <= 1e-9 * got.max(1.0),
                "{got} vs {}",
                d.theta
            );
            let want = brute(&conf, &lim, step, &sps);
            assert!(
                (got - want).abs() <= 1e-9 * want.max(1.0),
                "argmax Θ {got} < brute force {want}: {conf:?} {lim:?} {step:?} {sps:?} → {:?}",
                d.k
            );
            let g = adm.decide(&refs, &lim, step, &sps, Rule::GreedyEarlyStop);
            assert!(g.theta <= d.theta + 1e-9 * d.theta);
            if g.theta < d.theta - 1e-9 * d.theta {
                differ += 1;
            }
        }
        assert!(
            differ > 0,
            "random staircases must make greedy stop early sometimes"
        );
    }

    #[test]
    fn greedy_and_argmax_differ_exactly_at_a_dip_in_theta() {
        // Θ(K) over the sorted prefix with survivals 0.9, 0.8, 0.7, 0.6 for one request:
        // SPS 100 up to B = 2, 60 at B = 3, 60 at B = 5 ⇒ Θ = 190, 171, 240, 300 → greedy stops
        // at K = 1, argmax takes all four.
        let sps = SpsTable::new(vec![(2, 100.0), (5, 60.0)]).unwrap();
        let c = [0.9f32, 0.8 / 0.9, 0.7 / 0.8, 0.6 / 0.7];
        let step = StepLimits {
            max_batch_tokens: 64,
            kv_headroom: 64,
            other_tokens: 0,
            plain_requests: 0,
        };
        let mut adm = Admission::default();
        let g = adm.decide(
            &[&c],
            &[ReqLimits::default()],
            step,
            &sps,
            Rule::GreedyEarlyStop,
        );
        let a = adm.decide(&[&c], &[ReqLimits::default()], step, &sps, Rule::Argmax);
        assert_eq!(g.k, vec![1]);
        assert_eq!(a.k, vec![4]);
        // A flat table: both keep going while Θ grows.
        let flat = SpsTable::new(vec![(64, 100.0)]).unwrap();
        let g = adm.decide(
            &[&c],
            &[ReqLimits::default()],
            step,
            &flat,
            Rule::GreedyEarlyStop,
        );
        assert_eq!(g.k, vec![4]);
    }

    #[test]
    fn load_trims_low_confidence_and_can_fall_to_plain_decoding() {
        // SPS halves once the batch passes 8: with 8 requests only the most confident tokens
        // are worth verifying; with one request everything is.
        let sps = SpsTable::new(vec![(8, 100.0), (16, 50.0), (64, 25.0)]).unwrap();
        let hi = [0.95f32; 7];
        let lo = [0.2f32; 7];
        let step = StepLimits {
            max_batch_tokens: 64,
            kv_headroom: 1000,
            other_tokens: 0,
            plain_requests: 0,
        };
        let mut adm = Admission::default();
        let one = adm.decide(&[&hi], &[], step, &sps, Rule::Argmax);
        assert_eq!(one.k, vec![7]);
        let reqs: Vec<&[f32]> = vec![&lo; 8];
        let many = adm.decide(&reqs, &[], step, &sps, Rule::Argmax);
        assert_eq!(
            many.k,
            vec![0; 8],
            "low confidence under load: plain decoding"
        );
        // Limits: per-request max and KV headroom.
        let capped = adm.decide(
            &[&hi],
            &[ReqLimits { min_k: 0, max_k: 3 }],
            step,
            &sps,
            Rule::Argmax,
        );
        assert_eq!(capped.k, vec![3]);
        let kv = adm.decide(
            &[&hi],
            &[],
            StepLimits {
                max_batch_tokens: 64,
                kv_headroom: 2,
                other_tokens: 0,
                plain_requests: 0,
            },
            &sps,
            Rule::Argmax,
        );
        assert_eq!(kv.k, vec![2]);
        let tier = adm.decide(
            &[&lo],
            &[ReqLimits { min_k: 2, max_k: 9 }],
            step,
            &sps,
            Rule::Argmax,
        );
        assert!(tier.k[0] >= 2);
    }

    #[test]
    fn requests_that_did_not_draft_still_weigh_on_the_decision() {
        // SPS(B) = 1000 / (B + 8). One drafting request alone: a 0.5-survival token pays
        // (1.5·1000/10 > 1·1000/9). Beside 31 requests decoding plainly it does not
        // (32.5·1000/41 < 32·1000/40): the probe of one request must see the whole batch.
        let sps =
            SpsTable::new((1..=64).map(|b| (b, 1000.0 / (b as f64 + 8.0))).collect()).unwrap();
        let c = [0.5f32];
        let mut adm = Admission::default();
        let step = |plain| StepLimits {
            max_batch_tokens: 64,
            kv_headroom: 1000,
            other_tokens: 0,
            plain_requests: plain,
        };
        let alone = adm.decide(&[&c], &[], step(0), &sps, Rule::Argmax);
        assert_eq!(alone.k, vec![1]);
        let crowd = adm.decide(&[&c], &[], step(31), &sps, Rule::Argmax);
        assert_eq!(crowd.k, vec![0]);
        assert!((crowd.expected_tokens - 32.0).abs() < 1e-9);
        assert_eq!(crowd.batch_tokens, 32);
    }

    #[test]
    fn bad_tables_and_confidences_are_refused_or_clamped() {
        assert_eq!(SpsTable::new(vec![]), Err(AdmissionError::EmptyTable));
        assert!(SpsTable::new(vec![(4, 10.0), (2, 5.0)]).is_err());
        assert!(SpsTable::new(vec![(2, 10.0), (4, 20.0)]).is_err());
        assert!(SpsTable::new(vec![(0, 10.0)]).is_err());
        assert!(SpsTable::new(vec![(2, f64::NAN)]).is_err());
        let sps = SpsTable::new(vec![(64, 100.0)]).unwrap();
        let mut adm = Admission::default();
        let c = [f32::NAN, 2.0, -1.0, 0.5];
        let d = adm.decide(
            &[&c],
            &[],
            StepLimits {
                max_batch_tokens: 64,
                kv_headroom: 64,
                other_tokens: 0,
                plain_requests: 0,
            },
            &sps,
            Rule::Argmax,
        );
        assert_eq!(adm.clamped, 3);
        assert!(d.theta.is_finite() && d.k[0] <= 4);
    }
}
