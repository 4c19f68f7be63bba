//! The engine loop: admission, chunked prefill, drafting, one flattened forward for every
//! request's verification window, lossless acceptance, per-request commit and rollback.
//!
//! Per request the KV cache holds every committed token but the last one (the "pending" token,
//! fed as the first position of the next window). A cycle feeds `[pending, x_1..x_K]`, gets K+1
//! target distributions, accepts a prefix x_1..x_a plus one more token (residual sample or
//! bonus), keeps `pending, x_1..x_a` in the KV and rolls the rest back. Stop tokens, stop strings
//! and max_tokens are honoured inside a block: nothing after them is committed.

use crate::metrics::RequestMetrics;
use crate::proposer::{Dist, DraftBlock, ProposeReq, Proposer};
use crate::{MAX_GAMMA, Result, SpecError};
use dspark_runtime::json::{Doc, Format, JsonVocab};
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use dspark_runtime::tokenizer::StreamDecoder;
use dspark_runtime::{KvCache, Model, SeqId, Tokenizer};
use kernels::accept::{verify, verify_greedy};
use kernels::rng::Rng;
use kernels::sampling::{SamplingParams, argmax, probs, sample};
use std::cmp::Reverse;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Default draft length (per-request override allowed).
    pub gamma: usize,
    /// Tokens per forward (prefill chunks + every verification window).
    pub max_batch_tokens: usize,
    pub max_running: usize,
    /// KV cache capacity in tokens.
    pub kv_tokens: usize,
    pub block_size: usize,
    pub prefill_chunk: usize,
    /// Per-request gate that turns speculation down (or off) where it cannot pay.
    pub gate: bool,
    /// Check the per-cycle invariants (committed tokens, positions, KV length) every step.
    pub check_invariants: bool,
    /// With a pipelined (remote) proposer, verify two micro-batches in ping-pong so one's
    /// drafting round travels while the other is verified. Each micro-batch reads the weights
    /// again, so this pays only when the drafting hop costs more than that extra pass.
    pub pingpong: bool,
    /// Online recalibration of the proposer's confidences on verdicts as they come
    /// ([`crate::recal`]); None: served as the proposer reports them.
    pub recal: Option<crate::recal::RecalConfig>,
    /// Reuse the KV of whole blocks of earlier requests' prompts and answers that this one
    /// starts with ([`dspark_runtime::KvCache::set_prefix_caching`]). Greedy output is the same
    /// with it on or off; the prefill is shorter.
    pub prefix_caching: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            gamma: 4,
            max_batch_tokens: 512,
            max_running: 64,
            kv_tokens: 32 * 1024,
            block_size: 16,
            prefill_chunk: 256,
            gate: true,
            check_invariants: true,
            pingpong: false,
            recal: Some(crate::recal::RecalConfig::default()),
            prefix_caching: false,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<()> {
        if self.gamma > MAX_GAMMA {
            return Err(SpecError::Invalid(format!(
                "gamma {} out of range 0..={MAX_GAMMA}",
                self.gamma
            )));
        }
        if self.max_batch_tokens < 1 + self.gamma
            || self.max_running == 0
            || self.prefill_chunk == 0
        {
            return Err(SpecError::Invalid("max_batch_tokens must hold one verification window; max_running and prefill_chunk > 0".into()));
        }
        Ok(())
    }
}

/// A generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    /// Stop strings (matched on the decoded output; needs a tokenizer).
    pub stop: Vec<String>,
    /// The stop string that ends the output stays in its text (vLLM's
    /// `include_stop_str_in_output`); otherwise the text ends where it begins.
    pub include_stop: bool,
    pub seed: u64,
    /// Draft length for this request (default: the engine's).
    pub gamma: Option<usize>,
    /// Report each output token's log-probability and this many most likely alternatives
    /// (OpenAI `logprobs`); None: not asked.
    pub logprobs: Option<usize>,
    /// Report the log-probability of every prompt token after the first, with this many
    /// alternatives (OpenAI `echo` with `logprobs`): the prefill computes logits at every
    /// position, and the prompt is not taken from the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// Commit end-of-sequence tokens like any other and go on (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Generate at least this many tokens before an end-of-sequence or stop token (vLLM's
    /// `min_tokens`): the engine holds those tokens back in the sampling transform, so the
    /// output follows the target's distribution with them removed. Stop strings, too, end the
    /// request only from this many tokens on (as vLLM).
    pub min_tokens: usize,
    /// More tokens that end the request (vLLM's `stop_token_ids`); unlike end-of-sequence
    /// tokens they are part of the output.
    pub stop_token_ids: Vec<u32>,
    /// Structured output (OpenAI's `response_format`: `json_object`, or `json_schema` for a
    /// document of a schema): tokens that cannot continue one are masked out of the target's
    /// distribution ([`dspark_runtime::json`]). Needs a tokenizer.
    pub json: Option<Format>,
    /// The last `resumed` prompt tokens are output generated before, elsewhere (the router
    /// continues a request this way when a worker dies): JSON mode reads them as the start
    /// of the document.
    pub resumed: usize,
}

/// Most alternatives a request may ask for per token (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// An output token's log-probability under the target model's raw distribution (log-softmax
/// of its logits, before temperature, penalties or truncation, as vLLM reports by default),
/// and the most likely tokens at that position with theirs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// From the logits row that produced `token`.
    pub fn of(row: &[f32], token: u32, top: usize) -> Self {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
        let lp = |t: u32| row.get(t as usize).map_or(f32::NEG_INFINITY, |&x| x - lse);
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &x) in row.iter().enumerate() {
                if best.len() < top || x > best[best.len() - 1].1 {
                    let at = best.partition_point(|&(_, y)| y >= x);
                    best.insert(at, (i as u32, x));
                    best.truncate(top);
                }
            }
        }
        Self {
            logprob: lp(token),
            top: best.into_iter().map(|(t, x)| (t, x - lse)).collect(),
        }
    }
}

impl Request {
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            id,
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            stop: Vec::new(),
            include_stop: false,
            seed: id,
            gamma: None,
            logprobs: None,
            prompt_logprobs: None,
            ignore_eos: false,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            json: None,
            resumed: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub enum Event {
    /// Tokens committed this cycle and the text they complete.
    Tokens {
        id: u64,
        tokens: Vec<u32>,
        text: String,
        /// One per token when the request asked for log-probabilities, else empty.
        logprobs: Vec<TokenLogprob>,
        /// In a request's first event when it asked for them: prompt tokens 1.. (the first
        /// has no context to be predicted from).
        prompt_logprobs: Vec<TokenLogprob>,
    },
    Finished {
        id: u64,
        reason: FinishReason,
        metrics: RequestMetrics,
    },
    /// The request could not go on (its own tokens broke an invariant); it is released and the
    /// rest of the batch goes on. The tokens sent before stand: a server resumes the request
    /// from them elsewhere.
    Failed { id: u64, error: String },
}

/// Chooses how many drafted tokens of each request to verify this step: the hardware-aware
/// scheduler's hook. It sees confidences only, never the drafted tokens, so whether position k
/// is verified depends on x_1..x_{k−1} (through c_1..c_k) and never on x_k.
pub trait VerifyPolicy: Send {
    fn name(&self) -> &str;
    /// `conf[i]`: confidence per drafted position of the i-th drafting request (a drafter without
    /// a confidence head is given its request's running acceptance rate). `other_tokens`: tokens
    /// in this step's batch besides the pending tokens and drafts (prefill chunks);
    /// `plain_requests`: decoding requests in the batch that drafted nothing (one token each);
    /// `kv_headroom`: free KV slots. Returns K_i ≤ `conf[i].len()` per request.
    fn select(
        &mut self,
        conf: &[&[f32]],
        other_tokens: usize,
        plain_requests: usize,
        kv_headroom: usize,
    ) -> Vec<usize>;
    /// The verification budget K_total of the coming step when it is already known (decided
    /// from confidences of earlier steps). `Some(0)` lets the engine skip drafting altogether;
    /// `Some(k)` caps every block at k, drafted for [`VerifyPolicy::draft_width`] requests.
    /// `None`: not known (or a probe): the engine drafts full blocks.
    fn planned(&mut self) -> Option<usize> {
        None
    }
    /// For a planned budget `k > 0`: how many decoding requests draft (a window rotating over
    /// the batch); all of them by default.
    fn draft_width(&self, _k: usize) -> usize {
        usize::MAX
    }
    /// Whether this policy may have requests draft (a planned budget or a probe) within the
    /// next `steps` steps. A proposer conditioned on the target's hidden states needs them
    /// for the last few positions of whatever request it drafts for; while this answers no,
    /// the engine does not capture them (a plain decoding step then costs what it costs
    /// without a drafter). Yes by default.
    fn drafting_within(&self, _steps: usize) -> bool {
        true
    }
    /// When [`VerifyPolicy::drafting_within`] says yes only because a probe may come within
    /// those steps: how many requests that probe drafts for. The engine then hands target
    /// features to that many requests (its sentinels, which the probe drafts for) instead of
    /// the whole batch: a full batch's feature hand-over costs 0.2–0.3 % of a step, paid
    /// for a window of steps before every probe. A probe that finds drafting paying lets the
    /// others draft from what they hold (a window started over, padded) until theirs fills,
    /// so a policy answers this only where such a probe is rare (a long back-off).
    /// `None`: any request may draft.
    fn probe_only_within(&self, _steps: usize) -> Option<usize> {
        None
    }
    /// When `planned` answered `None` for a probe: draft for at most this many requests, at
    /// most this many positions each (fresh confidences need not cost a whole batch of blocks).
    fn probe(&self) -> Option<(usize, usize)> {
        None
    }
    /// Seconds the proposer took to draft this step for `n` requests, blocks of at most `block`
    /// positions (the engine waits for it, so it is part of the step's cost when drafting
    /// shares the target's hardware; a longer block costs more, so it is priced per length).
    fn observe_draft(&mut self, _secs: f64, _n: usize, _block: usize) {}
    /// Seconds this step's target forward, acceptance and commits took over `batch_tokens`
    /// tokens (drafting apart): the profiled table's time scale can be checked against it.
    fn observe_step(&mut self, _secs: f64, _batch_tokens: usize) {}
    /// What this step's verified drafts were expected to yield (the sum of their survivals,
    /// from the confidences) and how many were accepted; `free`: drafts from
    /// [`crate::Proposer::propose_free`]. Lets a policy correct confidences that prove off for
    /// this workload.
    fn observe_outcome(&mut self, _expected: f64, _accepted: usize, _free: bool) {}
    /// [`VerifyPolicy::select`] for a step planned without drafting whose blocks cost nothing
    /// to draft ([`crate::Proposer::propose_free`]): decided at once, and with no drafting
    /// cost to recover.
    fn select_free(
        &mut self,
        conf: &[&[f32]],
        other_tokens: usize,
        plain_requests: usize,
        kv_headroom: usize,
    ) -> Vec<usize> {
        self.select(conf, other_tokens, plain_requests, kv_headroom)
    }
}

/// Relative forward cost T(n)/T(1) for n tokens, measured at start.
#[derive(Clone, Debug)]
pub struct CostModel {
    pub rel: Vec<f64>,
}

impl CostModel {
    /// Times forwards of 1..=max_n tokens on a scratch sequence (median of `reps`).
    pub fn measure(model: &Model, max_n: usize, reps: usize) -> Result<Self> {
        let mut cache = model.new_cache(128 + max_n + 16, 16)?;
        let s = cache.new_seq();
        let ctx: Vec<u32> = (0..64u32)
            .map(|i| 1 + (i * 7919) % (model.cfg.vocab_size as u32 - 1))
            .collect();
        model.forward(
            &mut cache,
            &[SeqInput {
                seq: s,
                tokens: &ctx,
                logits: LogitsMode::None,
            }],
            &ForwardOptions::default(),
        )?;
        let mut ms = Vec::new();
        for n in 1..=max_n {
            let toks: Vec<u32> = ctx[..n.min(ctx.len())].to_vec();
            let mut t = Vec::new();
            for _ in 0..reps.max(1) {
                let t0 = Instant::now();
                model.forward(
                    &mut cache,
                    &[SeqInput {
                        seq: s,
                        tokens: &toks,
                        logits: LogitsMode::All,
                    }],
                    &ForwardOptions::default(),
                )?;
                t.push(t0.elapsed().as_secs_f64());
                cache.truncate(s, ctx.len())?;
            }
            t.sort_by(|a, b| a.total_cmp(b));
            ms.push(t[t.len() / 2]);
        }
        let base = ms[0].max(1e-9);
        // Enforce monotonicity (noise can make T(n+1) < T(n)).
        let mut rel: Vec<f64> = ms.iter().map(|v| v / base).collect();
        for i in 1..rel.len() {
            rel[i] = rel[i].max(rel[i - 1]);
        }
        rel[0] = 1.0;
        Ok(Self { rel })
    }

    /// Flat cost (every window costs one decode): the gate then only reacts to acceptance.
    pub fn flat(max_n: usize) -> Self {
        Self {
            rel: vec![1.0; max_n.max(1)],
        }
    }

    fn of(&self, n: usize) -> f64 {
        self.rel.get(n - 1).copied().unwrap_or_else(|| {
            *self.rel.last().unwrap_or(&1.0) * n as f64 / self.rel.len().max(1) as f64
        })
    }
}

/// Per-request speculation gate: picks K maximizing expected committed tokens per unit cost,
/// E(K)/C(K) with E(K) = Σ_{i≤K} α^i and C(K) = T(K+1)/T(1) + K·draft_cost, from a running
/// estimate α of per-token acceptance. K = 0 turns speculation off; it is re-probed every
/// `PROBE_EVERY` cycles so a request whose text turns repetitive gets speculation back.
#[derive(Clone, Debug)]
struct Gate {
    alpha: f64,
    off_cycles: usize,
}

const PROBE_EVERY: usize = 8;
/// Block length of the gate's probe.
const PROBE_K: usize = 2;

impl Gate {
    fn new() -> Self {
        Self {
            alpha: 0.6,
            off_cycles: 0,
        }
    }

    fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let trials = (accepted + 1).min(drafted) as f64;
        let rate = accepted as f64 / trials;
        let w = 0.3 * trials / (trials + 1.0);
        self.alpha = (1.0 - w) * self.alpha + w * rate;
    }

    /// The K that maximizes E(K)/C(K) at the current α (0: speculation does not pay).
    fn best(&self, gamma: usize, cost: &CostModel, draft_cost: f64) -> usize {
        let mut best = (1.0f64, 0usize);
        let mut e = 1.0;
        let mut ai = 1.0;
        for k in 1..=gamma {
            ai *= self.alpha;
            e += ai;
            let c = cost.of(k + 1) + k as f64 * draft_cost;
            let v = e / c;
            if v > best.0 * 1.02 {
                best = (v, k);
            }
        }
        best.1
    }

    fn choose(&mut self, gamma: usize, cost: &CostModel, draft_cost: f64) -> usize {
        let k = self.best(gamma, cost, draft_cost);
        if k == 0 {
            self.off_cycles += 1;
            if self.off_cycles >= PROBE_EVERY {
                self.off_cycles = 0;
                return gamma.min(PROBE_K);
            }
        } else {
            self.off_cycles = 0;
        }
        k
    }

    /// What the next [`Gate::choose`] returns unless α or the costs move first. A pipelined
    /// proposer is asked to prefetch only that much: a request the gate switched off would
    /// have a full block drafted every step for nothing (its probes are still prefetched).
    fn peek(&self, gamma: usize, cost: &CostModel, draft_cost: f64) -> usize {
        match self.best(gamma, cost, draft_cost) {
            0 if self.off_cycles + 1 >= PROBE_EVERY => gamma.min(PROBE_K),
            k => k,
        }
    }
}

#[derive(PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
}

struct Seq {
    req: Request,
    kv: SeqId,
    /// Prompt and committed output.
    tokens: Vec<u32>,
    prefilled: usize,
    phase: Phase,
    rng_draft: Rng,
    rng_accept: Rng,
    metrics: RequestMetrics,
    gate: Gate,
    text: String,
    /// Bytes of `text` already streamed (the rest may be the start of a stop string).
    sent: usize,
    decoder: StreamDecoder,
    arrived: Instant,
    last_emit: Option<Instant>,
    finished: Option<FinishReason>,
    /// KV blocks its table may grow to (its footprint, cached prefix included), set at
    /// admission.
    reserved_blocks: usize,
    /// Micro-batch (0 or 1) when the engine pipelines drafting with verification.
    group: u8,
    /// Whether the proposer has drafted for this request before (its first drafting call also
    /// catches the drafter up on the whole prompt, which says nothing about steady-state cost).
    drafted_before: bool,
    /// Prompt log-probabilities gathered over the prefill chunks, sent with the first event.
    prompt_lps: Vec<TokenLogprob>,
    /// JSON mode: the document after the committed output.
    json: Option<Doc>,
    /// Set when committing its tokens failed this step: it leaves the batch with
    /// [`Event::Failed`] at the step's end, and the others go on.
    failed: Option<String>,
    /// Its state broke an engine invariant: its KV is not cached when it leaves.
    poisoned: bool,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

pub struct Engine {
    model: Arc<Model>,
    tok: Option<Arc<Tokenizer>>,
    cache: KvCache,
    proposer: Box<dyn Proposer>,
    cfg: EngineConfig,
    cost: CostModel,
    waiting: VecDeque<(Request, Instant)>,
    running: Vec<Seq>,
    totals: RequestMetrics,
    /// EMA of drafting time per drafted token relative to one decode forward.
    draft_cost: f64,
    decode_ema: f64,
    policy: Option<Box<dyn VerifyPolicy>>,
    /// Requests admitted so far (alternates the micro-batch groups).
    admitted: u64,
    pub steps: usize,
    /// Requests handed target features while only a probe may draft soon
    /// ([`VerifyPolicy::probe_only_within`]); the next probe (or budget drafted for a few)
    /// drafts for them first. Empty outside that mode.
    sentinels: Vec<u64>,
    recal: Option<crate::recal::OnlineCalibration>,
    /// Every token's bytes for JSON mode, built on the first request that asks for it.
    json_vocab: Option<Arc<JsonVocab>>,
    /// Steps whose drafting call failed (they verified without drafts).
    pub draft_failures: u64,
}

impl Engine {
    pub fn new(
        model: Arc<Model>,
        tok: Option<Arc<Tokenizer>>,
        proposer: Box<dyn Proposer>,
        cfg: EngineConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let cost = if cfg.gate && cfg.gamma > 0 {
            CostModel::measure(&model, cfg.gamma + 1, 3)?
        } else {
            CostModel::flat(cfg.gamma + 1)
        };
        Self::with_cost(model, tok, proposer, cfg, cost)
    }

    /// Like [`Engine::new`] with a given cost model (tests, or a profile measured elsewhere).
    pub fn with_cost(
        model: Arc<Model>,
        tok: Option<Arc<Tokenizer>>,
        proposer: Box<dyn Proposer>,
        cfg: EngineConfig,
        cost: CostModel,
    ) -> Result<Self> {
        cfg.validate()?;
        if let Some(max) = proposer.max_gamma() {
            if cfg.gamma > max {
                return Err(SpecError::Incompatible(format!(
                    "drafter `{}` was trained for blocks of at most {max} tokens, gamma {} asked",
                    proposer.name(),
                    cfg.gamma
                )));
            }
        }
        let mut cache = model.new_cache(cfg.kv_tokens, cfg.block_size)?;
        cache.set_prefix_caching(cfg.prefix_caching);
        let recal = cfg.recal.map(crate::recal::OnlineCalibration::new);
        Ok(Self {
            model,
            tok,
            cache,
            proposer,
            cfg,
            cost,
            waiting: VecDeque::new(),
            running: Vec::new(),
            totals: RequestMetrics::default(),
            draft_cost: 0.0,
            decode_ema: 0.0,
            policy: None,
            admitted: 0,
            steps: 0,
            sentinels: Vec::new(),
            recal,
            json_vocab: None,
            draft_failures: 0,
        })
    }

    /// The target model the engine verifies with.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Puts a verification policy (the scheduler) in the loop: every request drafts its full
    /// γ and the policy trims the blocks; the per-request gate steps aside.
    pub fn set_policy(&mut self, policy: Option<Box<dyn VerifyPolicy>>) {
        self.policy = policy;
    }

    pub fn policy_name(&self) -> Option<&str> {
        self.policy.as_ref().map(|p| p.name())
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    pub fn proposer_name(&self) -> &str {
        self.proposer.name()
    }

    pub fn totals(&self) -> &RequestMetrics {
        &self.totals
    }

    /// The totals with the running requests' work so far: counters that move every step (a
    /// long answer's tokens and drafts counted as they are made, as vLLM's are), not only when
    /// a request ends; what a running request has done moves into `totals` unchanged when it
    /// ends, so these never go down.
    /// Counts and sums only: no inter-token latencies (the totals keep up to 2¹⁷, a copy each
    /// step).
    pub fn live_totals(&self) -> RequestMetrics {
        let mut t = RequestMetrics::default();
        t.merge_counts(&self.totals);
        for s in &self.running {
            t.merge_counts(&s.metrics);
            // Set only when a request ends: its tokens so far.
            t.completion_tokens += s.output_len().saturating_sub(s.metrics.completion_tokens);
        }
        t
    }

    /// Starts the totals afresh (a benchmark's warm-up is not measured).
    pub fn reset_totals(&mut self) {
        self.totals = RequestMetrics::default();
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued, not admitted yet.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Blocks of the paged KV cache, in all.
    pub fn kv_total_blocks(&self) -> usize {
        self.cache.config().num_blocks
    }

    /// Validates and queues a request.
    pub fn add(&mut self, mut req: Request) -> Result<()> {
        if req.prompt.is_empty() {
            return Err(SpecError::Invalid("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(SpecError::Invalid("max_tokens must be at least 1".into()));
        }
        req.params.validate()?;
        let vocab = self.model.cfg.vocab_size;
        req.params.validate_vocab(vocab)?;
        // Each committed token is looked up in them.
        if req.stop_token_ids.len() > 1024 {
            return Err(SpecError::Invalid(format!(
                "{} stop token ids (at most 1024)",
                req.stop_token_ids.len()
            )));
        }
        if let Some(&t) = req.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(SpecError::Invalid(format!(
                "stop token id {t} outside the vocabulary"
            )));
        }
        if req.json.is_some() && req.min_tokens > 0 {
            return Err(SpecError::Invalid(
                "min_tokens cannot be combined with JSON mode".into(),
            ));
        }
        if req.min_tokens > req.max_tokens {
            return Err(SpecError::Invalid(format!(
                "min_tokens {} exceeds max_tokens {}",
                req.min_tokens, req.max_tokens
            )));
        }
        // min_tokens holds back what would end the request: end-of-sequence (unless ignored)
        // and the request's stop tokens.
        let mut ends = req.stop_token_ids.clone();
        if !req.ignore_eos
            && let Some(tk) = self.tok.as_deref()
        {
            ends.extend_from_slice(&tk.stop_ids);
        }
        let prompt_len = req.prompt.len();
        req.params
            .hold_end_tokens(prompt_len, req.min_tokens, &ends);
        req.params
            .count_output_from(prompt_len.saturating_sub(req.resumed));
        if req.json.is_some() && self.json_vocab.is_none() {
            let tk = self
                .tok
                .as_deref()
                .ok_or_else(|| SpecError::Invalid("JSON mode needs a tokenizer".into()))?;
            if !tk.is_byte_level() {
                return Err(SpecError::Invalid(
                    "structured output needs a byte-level BPE tokenizer; this model's is not"
                        .into(),
                ));
            }
            self.json_vocab = Some(Arc::new(JsonVocab::new(tk)));
        }
        if req.resumed > req.prompt.len() {
            return Err(SpecError::Invalid(format!(
                "{} resumed tokens in a prompt of {}",
                req.resumed,
                req.prompt.len()
            )));
        }
        if req.json.is_some() && resumed_json(self.json_vocab.as_deref(), &req).is_none() {
            return Err(SpecError::Invalid(
                "the resumed output is not the start of a JSON object".into(),
            ));
        }
        if let Some(g) = req.gamma {
            let max = self
                .proposer
                .max_gamma()
                .unwrap_or(MAX_GAMMA)
                .min(MAX_GAMMA);
            if g > max {
                return Err(SpecError::Invalid(format!(
                    "gamma {g} out of range 0..={max} for drafter `{}`",
                    self.proposer.name()
                )));
            }
        }
        if let Some(n) = req.logprobs.max(req.prompt_logprobs)
            && n > MAX_TOP_LOGPROBS
        {
            return Err(SpecError::Invalid(format!(
                "top_logprobs {n} out of range 0..={MAX_TOP_LOGPROBS}"
            )));
        }
        if !req.stop.is_empty() && self.tok.is_none() {
            return Err(SpecError::Invalid("stop strings need a tokenizer".into()));
        }
        if req.stop.iter().any(|s| s.is_empty()) {
            return Err(SpecError::Invalid("stop strings must not be empty".into()));
        }
        if let Some(&t) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.model.cfg.vocab_size)
        {
            return Err(SpecError::Invalid(format!(
                "token id {t} outside the vocabulary"
            )));
        }
        let ctx = self.model.cfg.max_ctx;
        if req.prompt.len() + 1 > ctx {
            return Err(SpecError::Runtime(
                dspark_runtime::RuntimeError::ContextOverflow {
                    tokens: req.prompt.len() + 1,
                    ctx,
                },
            ));
        }
        if self.footprint(&req) > self.cfg.kv_tokens {
            return Err(SpecError::Invalid(format!(
                "request needs {} KV tokens, the cache holds {}",
                self.footprint(&req),
                self.cfg.kv_tokens
            )));
        }
        if self.waiting.iter().any(|(r, _)| r.id == req.id)
            || self.running.iter().any(|s| s.req.id == req.id)
        {
            return Err(SpecError::Duplicate(req.id));
        }
        self.waiting.push_back((req, Instant::now()));
        Ok(())
    }

    fn footprint(&self, req: &Request) -> usize {
        let gamma = req.gamma.unwrap_or(self.cfg.gamma);
        // Saturating: a library caller's `max_tokens` near usize::MAX must not wrap into a
        // tiny reservation.
        (req.prompt
            .len()
            .saturating_add(req.max_tokens)
            .saturating_add(gamma + 1))
        .min(self.model.cfg.max_ctx + gamma + 1)
            + self.cfg.block_size
    }

    /// Cancels a waiting or running request; its KV blocks are released at once.
    pub fn cancel(&mut self, id: u64) -> Result<Option<Event>> {
        if let Some(i) = self.waiting.iter().position(|(r, _)| r.id == id) {
            self.waiting.remove(i);
            return Ok(Some(Event::Finished {
                id,
                reason: FinishReason::Cancelled,
                metrics: RequestMetrics::default(),
            }));
        }
        if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
            let mut s = self.running.swap_remove(i);
            s.metrics.completion_tokens = s.output_len();
            // The work done for it counts in the totals (the workers' token counters) as a
            // finished request's does: its client leaving does not undo the forwards.
            self.totals.merge(&s.metrics);
            let m = s.metrics.clone();
            self.release(s)?;
            return Ok(Some(Event::Finished {
                id,
                reason: FinishReason::Cancelled,
                metrics: m,
            }));
        }
        Err(SpecError::UnknownRequest(id))
    }

    /// Keeps up to `w` sentinels ([`VerifyPolicy::probe_only_within`]): those still decoding
    /// stay (their features are held), the rest are replaced by the decoding requests with the
    /// most tokens left to write.
    fn pick_sentinels(&mut self, w: usize) {
        let running = &self.running;
        let decoding = |id: &u64| {
            running
                .iter()
                .any(|s| s.req.id == *id && s.phase == Phase::Decode && s.finished.is_none())
        };
        self.sentinels.retain(decoding);
        self.sentinels.truncate(w);
        while self.sentinels.len() < w {
            let next = running
                .iter()
                .filter(|s| {
                    s.phase == Phase::Decode
                        && s.finished.is_none()
                        && !self.sentinels.contains(&s.req.id)
                })
                .max_by_key(|s| {
                    (
                        s.req.max_tokens.saturating_sub(s.output_len()),
                        Reverse(s.req.id),
                    )
                });
            match next {
                Some(s) => self.sentinels.push(s.req.id),
                None => break,
            }
        }
    }

    fn release(&mut self, s: Seq) -> Result<()> {
        // Whatever is in its KV may start a later request (the next turn of a chat): the
        // committed tokens but the pending last one, exactly what the KV holds after a cycle
        // (after a failed one it may hold more, a rejected draft included, which stays out).
        let written = match s.phase {
            Phase::Prefill => s.prefilled,
            Phase::Decode => s.tokens.len().saturating_sub(1),
        };
        // The drafter forgets the request first: a KV error below must not leave its state
        // (a remote draft worker's context) held until the link closes.
        self.proposer.finish(s.req.id);
        // Not one whose state broke an invariant: its KV may not hold its tokens.
        if !s.poisoned {
            self.cache
                .register(s.kv, &s.tokens[..written.min(s.tokens.len())])?;
        }
        self.cache.remove(s.kv)?;
        Ok(())
    }

    /// KV blocks promised: those held now (a block several sequences share, a cached prompt
    /// prefix, counts once) and those each running sequence may still allocate up to its
    /// reservation. Admission keeps this within the cache, so no allocation of an admitted
    /// request can fail: an allocation moves one block from the second term to the first, a
    /// truncation moves it back, a release only lowers it, and what is neither held nor
    /// promised (free blocks, cached ones nobody references) can be taken. That rests on how
    /// blocks are shared here: only whole prompt blocks (attached at admission, registered at
    /// the end of a prefill), never written again and never truncated (rollback stops at the
    /// prompt), so no copy-on-write and no truncation of a block another holds; a fork or a
    /// partial shared block would need its own accounting.
    fn committed_blocks(&self) -> usize {
        let promised: usize = self
            .running
            .iter()
            .map(|s| {
                let have = self.cache.blocks(s.kv).map_or(0, |b| b.len());
                s.reserved_blocks.saturating_sub(have)
            })
            .sum();
        self.cache.held_blocks() + promised
    }

    fn admit(&mut self) -> Result<()> {
        while self.running.len() < self.cfg.max_running {
            let Some((req, _)) = self.waiting.front() else {
                break;
            };
            // The footprint has a block of slack, so its floor covers the blocks the
            // request can fill (prompt, answer and a verification window).
            let need = self.footprint(req) / self.cfg.block_size;
            // Cached prefix: whole blocks, leaving the last prompt token (its logits give the
            // first token) and the proposer's feature window to be computed, so drafting sees
            // the same context rows with the cache or without it.
            let window = self.proposer.context_rows().max(1);
            // Prompt log-probabilities need the logits of every prompt position: no cache.
            let usable = if req.prompt_logprobs.is_some() {
                0
            } else {
                req.prompt.len().saturating_sub(window)
            };
            // A cached prefix is paid for once: blocks another running request holds are
            // counted already, and only those nobody held become taken. Requests sharing a
            // long system prompt then fit as many as their own tokens allow.
            let (matched, idle) = self.cache.prefix_match(&req.prompt, usable);
            let charge = need.saturating_sub(matched) + idle;
            if self.committed_blocks() + charge > self.cache.config().num_blocks {
                break;
            }
            let Some((req, arrived)) = self.waiting.pop_front() else {
                break;
            };
            let (kv, cached) = self.cache.new_seq_with_prefix(&req.prompt, usable);
            let metrics = RequestMetrics {
                prompt_tokens: req.prompt.len(),
                cached_tokens: cached,
                ..Default::default()
            };
            let (text, sent, decoder) = resumed_text(self.tok.as_deref(), &req);
            // A resumed request draws afresh: the first worker's draws went into the output
            // it resumes, and reusing them would tie its tokens to those.
            let seed = if req.resumed > 0 {
                req.seed ^ (req.resumed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            } else {
                req.seed
            };
            self.running.push(Seq {
                kv,
                tokens: req.prompt.clone(),
                prefilled: cached,
                phase: Phase::Prefill,
                rng_draft: Rng::new(seed ^ 0x5eed_d4af_7a11_0001),
                rng_accept: Rng::new(seed),
                metrics,
                gate: Gate::new(),
                text,
                sent,
                decoder,
                arrived,
                last_emit: None,
                finished: None,
                reserved_blocks: need,
                drafted_before: false,
                prompt_lps: Vec::new(),
                group: (self.admitted % 2) as u8,
                json: resumed_json(self.json_vocab.as_deref(), &req),
                failed: None,
                poisoned: false,
                req,
            });
            self.admitted += 1;
        }
        Ok(())
    }

    /// Runs one engine cycle and returns the events it produced.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        // Tensor parallelism: no request adopts prefix blocks the ranks no longer hold.
        self.model.tp_sync(&mut self.cache);
        self.admit()?;
        if self.running.is_empty() {
            return Ok(events);
        }
        self.steps += 1;
        let t_step = Instant::now();
        // 1. Plan: verification windows first (they hold KV already), then prefill chunks.
        let mut budget = self.cfg.max_batch_tokens;
        let mut ks: Vec<Option<usize>> = vec![None; self.running.len()];
        let ctx = self.model.cfg.max_ctx;
        // Ping-pong: with a pipelined proposer, one micro-batch is verified per step while the
        // other's drafts are in flight (both, when one of them has no decoding request).
        let active = if self.cfg.pingpong && self.proposer.pipelined() {
            let g = (self.steps % 2) as u8;
            let has = |g: u8| {
                self.running
                    .iter()
                    .any(|s| s.phase == Phase::Decode && s.group == g)
            };
            (has(g) && has(1 - g)).then_some(g)
        } else {
            None
        };
        // A budget known in advance (two-step lag) shapes the batch before anything is planned:
        // zero means plain decoding (no drafting, and the token budget goes to prefill chunks);
        // a positive budget caps every request's block (no request can have more than K_total
        // of its drafts verified, so drafting more is wasted). A probe drafts for a few requests
        // only, so keeping the confidences fresh costs little at high load.
        let (mut cap, mut probe) = (usize::MAX, usize::MAX);
        // The block cap of a positive planned budget, for the drafts prefetched after this step.
        let mut planned_cap = None;
        // A step planned without drafting still verifies drafts that cost nothing to make.
        let mut free = false;
        if let Some(policy) = self.policy.as_mut() {
            let cfg_gamma = self.cfg.gamma;
            if self
                .running
                .iter()
                .any(|s| s.phase == Phase::Decode && s.req.gamma.unwrap_or(cfg_gamma) > 0)
            {
                match policy.planned() {
                    Some(0) if self.proposer.has_free_drafts() => free = true,
                    // A positive budget: blocks capped at it, drafted for as many requests as
                    // the policy says (a window rotating over the batch).
                    Some(kt) => {
                        (cap, probe) = (kt, policy.draft_width(kt));
                        planned_cap = Some(kt);
                    }
                    None => {
                        if let Some((n, k)) = policy.probe() {
                            (probe, cap) = (n, k);
                        }
                    }
                }
            }
        }
        // The decoding requests this step verifies: with ping-pong, its micro-batch's only (a
        // probe that chose the other's would draft nothing, step after step).
        let in_step = |s: &&Seq| s.phase == Phase::Decode && !active.is_some_and(|g| s.group != g);
        let n_decode = self.running.iter().filter(in_step).count();
        // Which decoding requests a probe (or a budget drafted for a few) drafts for: the
        // sentinels first, which hold the target's features, then a window rotating with the
        // micro-batch's own steps (every other step under ping-pong).
        let turn = if active.is_some() {
            self.steps / 2
        } else {
            self.steps
        };
        let probe_from = if probe < n_decode {
            turn % n_decode.max(1)
        } else {
            0
        };
        let mut chosen: Vec<u64> = Vec::new();
        if probe < n_decode {
            let decoding: Vec<u64> = self
                .running
                .iter()
                .filter(in_step)
                .map(|s| s.req.id)
                .collect();
            // Sentinels in the micro-batch verified this step (ping-pong), if any.
            chosen.extend(
                self.running
                    .iter()
                    .filter(|s| {
                        s.phase == Phase::Decode
                            && !active.is_some_and(|g| s.group != g)
                            && self.sentinels.contains(&s.req.id)
                    })
                    .map(|s| s.req.id)
                    .take(probe),
            );
            for di in 0..n_decode {
                if chosen.len() >= probe {
                    break;
                }
                let id = decoding[(probe_from + di) % n_decode];
                if !chosen.contains(&id) {
                    chosen.push(id);
                }
            }
        }
        // Every decoder of the step gets its one token before any gets a long window, and a
        // waiting prefill a share: windows planned in `running` order would otherwise let the
        // first requests' long γ (a request may ask for up to MAX_GAMMA) take the whole budget
        // step after step, and the others wait for them to finish.
        let mut later = self
            .running
            .iter()
            .filter(|s| s.phase == Phase::Decode && !active.is_some_and(|g| s.group != g))
            .count();
        let reserve = if self.running.iter().any(|s| s.phase == Phase::Prefill) {
            self.cfg
                .prefill_chunk
                .min(self.cfg.max_batch_tokens / 4)
                .max(1)
        } else {
            0
        };
        for (i, s) in self.running.iter_mut().enumerate() {
            if s.phase != Phase::Decode || budget == 0 {
                continue;
            }
            if active.is_some_and(|g| s.group != g) {
                continue;
            }
            later = later.saturating_sub(1);
            let share = budget.saturating_sub(1 + later + reserve);
            let probed = probe >= n_decode || chosen.contains(&s.req.id);
            let gamma = if probed {
                s.req.gamma.unwrap_or(self.cfg.gamma).min(cap)
            } else {
                0
            };
            let remaining = s.req.max_tokens - s.output_len();
            let room = ctx.saturating_sub(s.tokens.len());
            let mut k = if self.policy.is_some() {
                gamma
            } else if self.cfg.gate {
                s.gate.choose(gamma, &self.cost, self.draft_cost)
            } else {
                gamma
            };
            k = k
                .min(remaining.saturating_sub(1))
                .min(room.saturating_sub(1))
                .min(budget - 1)
                .min(share);
            ks[i] = Some(k);
            // Free drafts are verified only where the step has room after the prefill chunks
            // (they are fitted below, once made): reserving their whole block up front would
            // hold chunks back for drafts that mostly do not exist.
            budget -= if free { 1 } else { 1 + k };
        }
        let mut chunks: Vec<Option<(usize, usize)>> = vec![None; self.running.len()];
        for (i, s) in self.running.iter().enumerate() {
            if s.phase != Phase::Prefill || budget == 0 {
                continue;
            }
            let n = (s.req.prompt.len() - s.prefilled)
                .min(self.cfg.prefill_chunk)
                .min(budget);
            chunks[i] = Some((s.prefilled, n));
            budget -= n;
        }
        // What is left after the prefill chunks, for free drafts.
        let mut free_room = if free { budget } else { 0 };
        // 2. Draft.
        let t_draft = Instant::now();
        let drafting: Vec<usize> = (0..self.running.len())
            .filter(|&i| ks[i].is_some_and(|k| k > 0))
            .collect();
        let mut drafted = vec![false; self.running.len()];
        for &i in &drafting {
            drafted[i] = true;
        }
        let mut drafts: Vec<DraftBlock> = vec![DraftBlock::default(); self.running.len()];
        if !drafting.is_empty() {
            let mut reqs: Vec<ProposeReq<'_>> = Vec::with_capacity(drafting.len());
            let mut it = self.running.iter_mut().enumerate();
            for &i in &drafting {
                let s = loop {
                    match it.next() {
                        Some((j, s)) if j == i => break s,
                        Some(_) => continue,
                        None => {
                            return Err(SpecError::Invariant("draft index out of range".into()));
                        }
                    }
                };
                reqs.push(ProposeReq {
                    id: s.req.id,
                    context: &s.tokens,
                    k: ks[i].unwrap_or(0),
                    params: &s.req.params,
                    rng: &mut s.rng_draft,
                });
            }
            let n_reqs = reqs.len();
            let proposed = if free {
                self.proposer.propose_free(&mut reqs)
            } else {
                self.proposer.propose(&mut reqs)
            };
            // Drafting only speeds decoding up: a drafter that fails (a draft model past its
            // context or its cache) leaves this step to verify without drafts rather than
            // failing every request in the batch.
            let blocks = proposed.unwrap_or_else(|e| {
                self.draft_failures += 1;
                if self.draft_failures.is_power_of_two() {
                    tracing::warn!(
                        failures = self.draft_failures,
                        "drafting failed, this step decodes without drafts: {e}"
                    );
                }
                vec![DraftBlock::default(); n_reqs]
            });
            for (&i, mut b) in drafting.iter().zip(blocks) {
                let mut k = ks[i].unwrap_or(0);
                if free {
                    k = k.min(b.tokens.len()).min(free_room);
                    free_room -= k;
                }
                b.tokens.truncate(k);
                b.dists.truncate(k);
                // A block that cannot be verified (a proposer's bug) costs its request the
                // drafts of this step, as a failed drafter does: not the step of everyone.
                let unusable = if b.dists.len() != b.tokens.len() {
                    Some("tokens without distributions".to_string())
                } else {
                    b.tokens
                        .iter()
                        .find(|&&t| t as usize >= self.model.cfg.vocab_size)
                        .map(|t| format!("token {t} outside the vocabulary"))
                };
                if let Some(why) = unusable {
                    self.draft_failures += 1;
                    if self.draft_failures.is_power_of_two() {
                        tracing::warn!(
                            failures = self.draft_failures,
                            request = self.running[i].req.id,
                            "proposer returned an unusable block ({why}); this step \
                             verifies no drafts for the request"
                        );
                    }
                    continue;
                }
                drafts[i] = b;
            }
        }
        // 2a. Served confidences: the proposer's, mapped by what earlier verdicts taught.
        let mut base_conf: Vec<Option<Vec<f32>>> = vec![None; self.running.len()];
        if let Some(recal) = &self.recal {
            for &i in &drafting {
                let greedy = self.running[i].req.params.is_greedy();
                let head = !drafts[i].fitted_rates;
                if let Some(c) = drafts[i].confidence.as_mut() {
                    base_conf[i] = Some(c.clone());
                    recal.apply(greedy, head, c);
                }
            }
        }
        // 2b. The scheduler trims the blocks (confidences only).
        if let Some(policy) = self.policy.as_mut() {
            if !drafting.is_empty() && !free && !self.proposer.timed_out() {
                // Per-step cost only: catching up on deferred context is paid once.
                let secs = t_draft.elapsed().as_secs_f64() - self.proposer.last_catch_up_seconds();
                let block = drafting
                    .iter()
                    .map(|&i| ks[i].unwrap_or(0))
                    .max()
                    .unwrap_or(0);
                policy.observe_draft(secs.max(0.0), drafting.len(), block);
            }
            let confs: Vec<Vec<f32>> = drafting
                .iter()
                .map(|&i| match &drafts[i].confidence {
                    Some(c) if c.len() >= drafts[i].tokens.len() => {
                        c[..drafts[i].tokens.len()].to_vec()
                    }
                    _ => vec![self.running[i].gate.alpha as f32; drafts[i].tokens.len()],
                })
                .collect();
            let refs: Vec<&[f32]> = confs.iter().map(|c| c.as_slice()).collect();
            let other: usize = chunks.iter().flatten().map(|c| c.1).sum();
            // Decoding requests in this batch that drafted nothing: one token each (every
            // drafting request is a decoding one).
            let plain = ks.iter().flatten().count() - drafting.len();
            let headroom = self.cache.free_blocks() * self.cfg.block_size;
            let k = if free {
                policy.select_free(&refs, other, plain, headroom)
            } else {
                policy.select(&refs, other, plain, headroom)
            };
            for (j, &i) in drafting.iter().enumerate() {
                let kk = k.get(j).copied().unwrap_or(0).min(drafts[i].tokens.len());
                drafts[i].tokens.truncate(kk);
                drafts[i].dists.truncate(kk);
                if let Some(c) = drafts[i].confidence.as_mut() {
                    c.truncate(kk);
                }
                if let Some(c) = drafts[i].conf_inputs.as_mut() {
                    c.truncate(kk);
                }
            }
        }
        let draft_s =
            (t_draft.elapsed().as_secs_f64() - self.proposer.last_catch_up_seconds()).max(0.0);
        let n_drafted: usize = drafts.iter().map(|d| d.tokens.len()).sum();
        let steady = drafting.iter().all(|&i| self.running[i].drafted_before);
        for &i in &drafting {
            self.running[i].drafted_before = true;
        }
        // 3. One forward over every window and chunk.
        let mut windows: Vec<Vec<u32>> = vec![Vec::new(); self.running.len()];
        let mut idx = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if ks[i].is_some() {
                let mut w = Vec::with_capacity(1 + drafts[i].tokens.len());
                w.push(
                    *s.tokens
                        .last()
                        .ok_or_else(|| SpecError::Invariant("decode without a token".into()))?,
                );
                w.extend_from_slice(&drafts[i].tokens);
                windows[i] = w;
                idx.push((i, LogitsMode::All));
            } else if let Some((from, n)) = chunks[i] {
                windows[i] = s.req.prompt[from..from + n].to_vec();
                let last = from + n == s.req.prompt.len();
                idx.push((
                    i,
                    if s.req.prompt_logprobs.is_some() {
                        LogitsMode::All
                    } else if last {
                        LogitsMode::Last
                    } else {
                        LogitsMode::None
                    },
                ));
            }
        }
        let inputs: Vec<SeqInput<'_>> = idx
            .iter()
            .map(|&(i, mode)| SeqInput {
                seq: self.running[i].kv,
                tokens: &windows[i],
                logits: mode,
            })
            .collect();
        let t_fwd = Instant::now();
        // Target features only when some request may draft before they leave the proposer's
        // window (a request that missed some starts its window over, padded).
        let window = self.proposer.feature_window();
        let capture = self
            .policy
            .as_ref()
            .is_none_or(|p| p.drafting_within(window));
        // While only a probe may draft soon, features go to its sentinels alone: the decoding
        // requests with the most tokens left to write (they are likeliest to live until it).
        // Not for a proposer that states no window (it is handed every position).
        let probe_width = self
            .policy
            .as_ref()
            .and_then(|p| p.probe_only_within(window))
            .filter(|_| capture && window != usize::MAX);
        let sentinels_only = match probe_width {
            Some(w) if w < n_decode => {
                self.pick_sentinels(w);
                true
            }
            _ => {
                self.sentinels.clear();
                false
            }
        };
        let fopts = ForwardOptions {
            layers: if capture {
                self.proposer.feature_layers()
            } else {
                Vec::new()
            },
            ..Default::default()
        };
        let out = self.model.forward(&mut self.cache, &inputs, &fopts)?;
        let d_model = self.model.cfg.d_model;
        let verify_s = t_fwd.elapsed().as_secs_f64();
        let batch_tokens: usize = windows.iter().map(|w| w.len()).sum();
        if steady && n_drafted > 0 && batch_tokens > 0 && !self.proposer.timed_out() {
            // Drafting cost per drafted token relative to one token's share of a forward.
            let per_tok = verify_s / batch_tokens as f64;
            let rel = (draft_s / n_drafted as f64) / (per_tok * batch_tokens as f64).max(1e-9);
            // One sample moves the mean by at most a factor 1.6: a remote drafter's stalled
            // cycle (a whole timeout) read as a steady cost turned speculation off for hundreds
            // of cycles, the gate's probes too rare to bring the mean back. A cost that stays
            // high reaches it within a few cycles.
            self.draft_cost = if self.draft_cost == 0.0 {
                rel
            } else {
                0.8 * self.draft_cost + 0.2 * rel.min(4.0 * self.draft_cost)
            };
        }
        self.decode_ema = if self.decode_ema == 0.0 {
            verify_s
        } else {
            0.9 * self.decode_ema + 0.1 * verify_s
        };
        // 4. Accept, commit, roll back.
        // (expected, accepted) drafts over this step's verified blocks with confidences.
        let mut outcome = (0.0f64, 0usize);
        // Seconds handing target features to the proposer (trace only).
        let mut features_s = 0.0f64;
        let mut rows_buf: Vec<f32> = Vec::new();
        let t_accept = Instant::now();
        let jv = self.json_vocab.clone();
        for (j, &(i, _)) in idx.iter().enumerate() {
            let vocab = out.vocab;
            let rows = out.rows_of(j);
            let s = &mut self.running[i];
            if let Some((from, n)) = chunks[i] {
                // Of a prompt, a drafter reads only the last `context_rows` positions' features
                // (all of them when it states none): a 360-token prompt's rows are 2.5 MB on
                // SmolLM2, copied twice for the 32 it keeps.
                let keep = self.proposer.context_rows();
                let lo = if keep > 0 {
                    s.req
                        .prompt
                        .len()
                        .saturating_sub(keep)
                        .clamp(from, from + n)
                } else {
                    from
                };
                let hand = !sentinels_only || self.sentinels.contains(&s.req.id);
                if hand && !fopts.layers.is_empty() && lo < from + n {
                    let t0 = Instant::now();
                    feature_rows(
                        &out,
                        out.token_offsets[j] + (lo - from),
                        from + n - lo,
                        d_model,
                        &mut rows_buf,
                    );
                    if let Err(e) =
                        self.proposer
                            .observe_captured(s.req.id, lo, &fopts.layers, &rows_buf)
                    {
                        drafter_lost(self.proposer.as_mut(), &mut self.draft_failures, s, e);
                    }
                    features_s += t0.elapsed().as_secs_f64();
                }
                if let Some(top) = s.req.prompt_logprobs {
                    // Row r predicts prompt position from + r + 1 (the last row, the first
                    // output token).
                    for r in 0..n {
                        if let Some(&t) = s.req.prompt.get(from + r + 1) {
                            let row = rows.get(r * vocab..(r + 1) * vocab).ok_or_else(|| {
                                SpecError::Invariant("no logits row for a prompt token".into())
                            })?;
                            s.prompt_lps.push(TokenLogprob::of(row, t, top));
                        }
                    }
                }
                s.prefilled = from + n;
                if s.prefilled < s.req.prompt.len() {
                    continue;
                }
                // Concurrent requests with the same prompt start can share it from now on.
                self.cache.register(s.kv, &s.req.prompt)?;
                // Prefill done: the first token comes from the last prompt position.
                let t0 = Instant::now();
                let last = if s.req.prompt_logprobs.is_some() {
                    n - 1
                } else {
                    0
                };
                let rows = rows
                    .get(last * vocab..(last + 1) * vocab)
                    .ok_or_else(|| SpecError::Invariant("no logits for the first token".into()))?;
                let fmt = s.req.json.clone();
                let masked = json_row(rows, jv.as_deref().zip(fmt.as_ref()), s.json.as_ref());
                let first = sample_one(&masked, &s.tokens, &s.req.params, &mut s.rng_accept);
                s.metrics.accept_s += t0.elapsed().as_secs_f64();
                s.phase = Phase::Decode;
                s.metrics.ttft_s = s.arrived.elapsed().as_secs_f64();
                if let Err(e) = commit_tokens(
                    s,
                    &[first],
                    (&rows[..vocab], vocab),
                    (self.tok.as_deref(), jv.as_deref()),
                    ctx,
                    &mut events,
                ) {
                    s.failed = Some(e.to_string());
                }
                continue;
            }
            // Verification window.
            let d = &drafts[i];
            let k = d.tokens.len();
            if drafted[i] {
                // Its block as verified (a policy may have trimmed it, to none).
                self.proposer.verified(s.req.id, s.tokens.len(), k);
            }
            let t0 = Instant::now();
            // For calibration data: the probability each position had of being accepted,
            // 1 − TV(q, p) (sampled requests only) — the most any confidence could know.
            let mut accept_prob: Vec<f32> = Vec::new();
            // JSON mode: the document before each verified position (None past a draft that
            // breaks it: that draft is rejected, so what follows is never read).
            let fmt = s.req.json.clone();
            let shape = jv.as_deref().zip(fmt.as_ref());
            let states = json_states(shape, s.json, &d.tokens);
            let verdict = if s.req.params.is_greedy() {
                let mut am = Vec::with_capacity(k + 1);
                for r in 0..=k {
                    let row =
                        json_row(&rows[r * vocab..(r + 1) * vocab], shape, states[r].as_ref());
                    let row = &row[..];
                    if s.req.params.shapes_logits() {
                        let mut seen = s.tokens.clone();
                        seen.extend_from_slice(&d.tokens[..r]);
                        am.push(argmax(&probs(row, &seen, &s.req.params)));
                    } else {
                        am.push(argmax(row));
                    }
                }
                verify_greedy(&d.tokens, &am)
            } else {
                let mut ps: Vec<Vec<f32>> = Vec::with_capacity(k + 1);
                for r in 0..=k {
                    let mut seen = s.tokens.clone();
                    seen.extend_from_slice(&d.tokens[..r]);
                    let row =
                        json_row(&rows[r * vocab..(r + 1) * vocab], shape, states[r].as_ref());
                    ps.push(probs(&row, &seen, &s.req.params));
                }
                let pr: Vec<&[f32]> = ps.iter().map(|v| v.as_slice()).collect();
                let qs: Vec<kernels::accept::DraftDist<'_>> =
                    d.dists.iter().map(|q| q.as_draft()).collect();
                if d.confidence.is_some() {
                    accept_prob = d
                        .dists
                        .iter()
                        .zip(&d.tokens)
                        .zip(&pr)
                        .map(|((q, &t), p)| match q {
                            Dist::Dense(q) => q.iter().zip(*p).map(|(a, b)| a.min(*b)).sum(),
                            Dist::Sparse(q) => q
                                .iter()
                                .map(|&(v, a)| a.min(p.get(v as usize).copied().unwrap_or(0.0)))
                                .sum(),
                            Dist::OneHot => p.get(t as usize).copied().unwrap_or(0.0),
                        })
                        .collect();
                }
                verify(&d.tokens, &qs, &pr, &mut s.rng_accept)
            };
            s.metrics.accept_s += t0.elapsed().as_secs_f64();
            s.metrics.target_calls += 1;
            s.metrics.verify_s += verify_s;
            s.metrics.draft_s += if n_drafted > 0 {
                draft_s * k as f64 / n_drafted as f64
            } else {
                0.0
            };
            s.metrics
                .record_block(k, verdict.accepted, verdict.bonus && k > 0);
            let base = base_conf[i].as_deref().map(|b| &b[..k.min(b.len())]);
            if let (Some(recal), Some(b)) = (self.recal.as_mut(), base) {
                let greedy = s.req.params.is_greedy();
                recal.observe(greedy, !d.fitted_rates, b, verdict.accepted);
            }
            if let Some(c) = &d.confidence {
                let inputs = d
                    .conf_inputs
                    .as_ref()
                    .map(|v| v[..k.min(v.len())].to_vec())
                    .unwrap_or_default();
                s.metrics.conf_blocks.push(crate::metrics::ConfBlock {
                    conf: c[..k.min(c.len())].to_vec(),
                    base: base.unwrap_or(&c[..k.min(c.len())]).to_vec(),
                    inputs,
                    accept_prob: std::mem::take(&mut accept_prob),
                    accepted: verdict.accepted,
                    step: self.steps,
                });
            }
            s.gate.observe(k, verdict.accepted);
            if let Some(c) = d.confidence.as_ref().filter(|_| k > 0) {
                let mut a = 1.0f64;
                for &cj in c.iter().take(k) {
                    a *= (cj as f64).clamp(0.0, 1.0);
                    outcome.0 += a;
                }
                outcome.1 += verdict.accepted;
            }
            let kv_before = s.tokens.len() - 1;
            let mut new: Vec<u32> = d.tokens[..verdict.accepted].to_vec();
            new.push(verdict.next);
            let committed = match commit_tokens(
                s,
                &new,
                (&rows[..new.len() * vocab], vocab),
                (self.tok.as_deref(), jv.as_deref()),
                ctx,
                &mut events,
            ) {
                Ok(c) => c,
                Err(e) => {
                    // Its KV keeps the whole window; releasing it keeps only what its
                    // committed tokens hold.
                    s.failed = Some(e.to_string());
                    continue;
                }
            };
            if committed < new.len() {
                // A stop condition cut the block: the accepted drafts after it are waste too.
                s.metrics.wasted_tokens += verdict.accepted.saturating_sub(committed);
            }
            let hand = !sentinels_only || self.sentinels.contains(&s.req.id);
            if hand && !fopts.layers.is_empty() && s.finished.is_none() {
                // Positions now committed in the KV: the old pending token and the accepted drafts.
                let t0 = Instant::now();
                let n = 1 + verdict.accepted;
                feature_rows(&out, out.token_offsets[j], n, d_model, &mut rows_buf);
                if let Err(e) =
                    self.proposer
                        .observe_captured(s.req.id, kv_before, &fopts.layers, &rows_buf)
                {
                    drafter_lost(self.proposer.as_mut(), &mut self.draft_failures, s, e);
                }
                features_s += t0.elapsed().as_secs_f64();
            }
            let t0 = Instant::now();
            // KV keeps pending + accepted drafts; the new pending token is not in the KV yet.
            self.cache
                .truncate(s.kv, kv_before + 1 + verdict.accepted.min(committed))?;
            s.metrics.rollback_s += t0.elapsed().as_secs_f64();
        }
        self.model.recycle(out);
        let accept_s = t_accept.elapsed().as_secs_f64();
        // The step's cost as the policy prices it: the forward, and acceptance, sampling and
        // commits at every verified position (drafting is measured apart).
        if let Some(policy) = self.policy.as_mut() {
            tracing::trace!(
                batch_tokens,
                forward_s = verify_s,
                step_s = t_fwd.elapsed().as_secs_f64(),
                "step priced"
            );
            policy.observe_step(t_fwd.elapsed().as_secs_f64(), batch_tokens);
            if outcome.0 > 0.0 {
                tracing::trace!(
                    expected = outcome.0,
                    accepted = outcome.1,
                    free,
                    "verified drafts"
                );
                policy.observe_outcome(outcome.0, outcome.1, free);
            }
        }
        // The decoding requests this step verified (before finished ones leave `running`):
        // only they start drafting their next block below. One the token budget left out
        // has not moved, and a second round for the same context would be drafted twice.
        let mut stepped: Vec<u64> = (0..self.running.len())
            .filter(|&i| ks[i].is_some())
            .map(|i| self.running[i].req.id)
            .collect();
        stepped.sort_unstable();
        // 5. Proposer state, finished requests, invariants. A request whose own state broke
        // an invariant (an engine bug) fails alone, before anything of it is cached: the
        // step's other requests, those that finished in it included, go on.
        if self.cfg.check_invariants {
            for i in 0..self.running.len() {
                let s = &self.running[i];
                if s.finished.is_some() || s.failed.is_some() {
                    continue;
                }
                if let Some(why) = self.violation(s)? {
                    self.running[i].failed = Some(format!("engine invariant: {why}"));
                    self.running[i].poisoned = true;
                }
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if let Some(error) = self.running[i].failed.take() {
                let mut s = self.running.swap_remove(i);
                tracing::error!(request = s.req.id, "request failed: {error}");
                s.metrics.completion_tokens = s.output_len();
                self.totals.merge(&s.metrics);
                events.push(Event::Failed {
                    id: s.req.id,
                    error,
                });
                self.release(s)?;
                continue;
            }
            if let Some(reason) = self.running[i].finished {
                let mut s = self.running.swap_remove(i);
                s.metrics.e2e_s = s.arrived.elapsed().as_secs_f64();
                s.metrics.completion_tokens = s.output_len();
                self.totals.merge(&s.metrics);
                events.push(Event::Finished {
                    id: s.req.id,
                    reason,
                    metrics: s.metrics.clone(),
                });
                self.release(s)?;
            } else {
                let s = &self.running[i];
                if s.phase == Phase::Decode
                    && let Err(e) = self.proposer.commit(s.req.id, &s.tokens)
                {
                    drafter_lost(self.proposer.as_mut(), &mut self.draft_failures, s, e);
                }
                i += 1;
            }
        }
        // 6. Pipelining: the micro-batch just verified starts drafting its next block now,
        // unless the policy plans no drafting for its next turn (two steps on under
        // ping-pong): a draft pool asked for full blocks on every plain-decoding step did the
        // work for nothing, and its rounds queued ahead of the next probe's. Blocks are
        // capped as this step's planned budget capped them; without a policy, at what each
        // request's gate will choose (none while it has speculation off, but for a probe).
        let wanted = self.policy.as_ref().is_none_or(|p| p.drafting_within(2));
        let gated = self.policy.is_none() && self.cfg.gate;
        if self.proposer.pipelined() && wanted {
            let ctx = self.model.cfg.max_ctx;
            let gamma = self.cfg.gamma;
            let mut reqs: Vec<ProposeReq<'_>> = Vec::new();
            for s in self.running.iter_mut() {
                let verified = s.phase == Phase::Decode
                    && s.drafted_before
                    && stepped.binary_search(&s.req.id).is_ok();
                if !verified || active.is_some_and(|g| s.group != g) {
                    continue;
                }
                let g = s.req.gamma.unwrap_or(gamma);
                let remaining = s.req.max_tokens - s.output_len();
                let room = ctx.saturating_sub(s.tokens.len());
                let g = if gated {
                    s.gate.peek(g, &self.cost, self.draft_cost)
                } else {
                    g
                };
                let k = g
                    .min(remaining.saturating_sub(1))
                    .min(room.saturating_sub(1))
                    .min(planned_cap.unwrap_or(usize::MAX));
                if k == 0 {
                    continue;
                }
                reqs.push(ProposeReq {
                    id: s.req.id,
                    context: &s.tokens,
                    k,
                    params: &s.req.params,
                    rng: &mut s.rng_draft,
                });
            }
            if !reqs.is_empty() {
                self.proposer.prefetch(&mut reqs);
            }
        }
        if self.cfg.check_invariants {
            self.check_promised()?;
        }
        tracing::trace!(
            total_s = t_step.elapsed().as_secs_f64(),
            forward_s = verify_s,
            draft_s,
            accept_s,
            features_s,
            plan_s = t_draft.duration_since(t_step).as_secs_f64(),
            features = !fopts.layers.is_empty(),
            batch_tokens,
            proposer = self.proposer.name(),
            policy = self.policy.is_some(),
            draft_cost = self.draft_cost,
            "step done"
        );
        Ok(events)
    }

    /// Per-cycle invariants: a decoding request's KV holds exactly its committed tokens but the
    /// pending one; a prefilling request's KV holds exactly its prefilled prompt tokens; no
    /// request outgrows its reservation and the cache is not promised more blocks than it has.
    pub fn check_invariants(&self) -> Result<()> {
        for s in &self.running {
            if let Some(why) = self.violation(s)? {
                return Err(SpecError::Invariant(format!("request {}: {why}", s.req.id)));
            }
        }
        self.check_promised()
    }

    /// What of the per-request invariants `s` breaks, if any.
    fn violation(&self, s: &Seq) -> Result<Option<String>> {
        let kv = self.cache.len(s.kv)?;
        let want = match s.phase {
            Phase::Prefill => s.prefilled,
            Phase::Decode => s.tokens.len().saturating_sub(1),
        };
        if kv != want {
            return Ok(Some(format!("KV length {kv}, expected {want}")));
        }
        if s.tokens.get(..s.req.prompt.len()) != Some(&s.req.prompt[..]) {
            return Ok(Some("prompt tokens changed".into()));
        }
        if s.output_len() > s.req.max_tokens {
            return Ok(Some("more than max_tokens committed".into()));
        }
        let blocks = self.cache.blocks(s.kv)?.len();
        if blocks > s.reserved_blocks {
            return Ok(Some(format!(
                "{blocks} KV blocks, {} reserved",
                s.reserved_blocks
            )));
        }
        Ok(None)
    }

    /// The cache is not promised more blocks than it has (see [`Self::committed_blocks`]).
    fn check_promised(&self) -> Result<()> {
        let (committed, total) = (self.committed_blocks(), self.cache.config().num_blocks);
        if committed > total {
            return Err(SpecError::Invariant(format!(
                "{committed} KV blocks promised, the cache has {total}"
            )));
        }
        Ok(())
    }

    /// Checks the KV allocator (no leaked blocks); with nothing running every block is free.
    pub fn check_kv(&self) -> Result<()> {
        self.cache.check()?;
        if self.running.is_empty() && self.cache.num_seqs() != 0 {
            return Err(SpecError::Invariant(
                "sequences left in the KV cache".into(),
            ));
        }
        Ok(())
    }

    pub fn kv_free_blocks(&self) -> usize {
        self.cache.free_blocks()
    }

    /// Prompt tokens looked up in the prefix cache, and found there, since start.
    pub fn prefix_cache_stats(&self) -> (u64, u64) {
        self.cache.prefix_stats()
    }

    /// Forgets the prefix cache (benchmarks that replay prompts clear it between arms).
    pub fn clear_prefix_cache(&mut self) {
        self.cache.clear_prefix_cache();
    }

    /// Runs until every queued request finishes; returns all events in order.
    pub fn run_to_completion(&mut self) -> Result<Vec<Event>> {
        let mut all = Vec::new();
        while !self.is_idle() {
            all.extend(self.step()?);
        }
        Ok(all)
    }
}

/// A proposer that fails on one request's state (features it cannot take, a context it cannot
/// roll back) forgets that request: drafting only speeds decoding up, so the request decodes
/// on (its drafter starts over from its context at its next drafting call) and the batch with
/// it, instead of the whole step failing.
fn drafter_lost(p: &mut dyn Proposer, failures: &mut u64, s: &Seq, e: SpecError) {
    *failures += 1;
    if failures.is_power_of_two() {
        tracing::warn!(
            request = s.req.id,
            failures = *failures,
            "the drafter failed on a request's state, which starts over: {e}"
        );
    }
    p.finish(s.req.id);
}

/// Rows `off..off + n` of the captured layers into `rows`, each row the layers side by side.
fn feature_rows(
    out: &dspark_runtime::ForwardOutput,
    off: usize,
    n: usize,
    d: usize,
    rows: &mut Vec<f32>,
) {
    rows.clear();
    for t in off..off + n {
        for lh in &out.layer_hidden {
            rows.extend_from_slice(&lh[t * d..(t + 1) * d]);
        }
    }
}

/// A resumed request's earlier output as text, how much of it the worker that made it sent,
/// and the decoder after it. That worker held back what could still begin a stop string and
/// the bytes of an unfinished character; going on from the same state sends them with what
/// follows, ends a stop string that straddles the hand-over, and keeps a split character
/// whole. `sent` is that worker's: what it held back at its last tokens is the longest end of
/// the text that begins a stop string, and an earlier step never sent more (whatever it
/// held back then begins the later text's held-back end or was cleared by it). A token the
/// decoder cannot read leaves a fresh start, as before resuming kept state.
fn resumed_text(tok: Option<&Tokenizer>, req: &Request) -> (String, usize, StreamDecoder) {
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    let (Some(tk), Some(from)) = (tok, req.prompt.len().checked_sub(req.resumed)) else {
        return (text, 0, decoder);
    };
    for &t in &req.prompt[from..] {
        match decoder.push(tk, t) {
            Ok(Some(d)) => text.push_str(&d),
            Ok(None) => {}
            Err(_) => return (String::new(), 0, StreamDecoder::new()),
        }
    }
    let sent = text.len() - held_back(&text, &req.stop);
    (text, sent, decoder)
}

/// A JSON-mode request's document after its resumed output (a fresh one without); None if
/// that output cannot start a JSON object.
fn resumed_json(jv: Option<&JsonVocab>, req: &Request) -> Option<Doc> {
    let (jv, f) = (jv?, req.json.as_ref()?);
    let from = req.prompt.len().checked_sub(req.resumed)?;
    req.prompt[from..]
        .iter()
        .try_fold(f.start(), |st, &t| jv.advance_doc(f, &st, t))
}

/// The logits a JSON-mode request samples from at a position whose document stands at `st`
/// (tokens that would break it at −∞); any other row as it is.
fn json_row<'a>(
    row: &'a [f32],
    shape: Option<(&JsonVocab, &Format)>,
    st: Option<&Doc>,
) -> std::borrow::Cow<'a, [f32]> {
    match (shape, st) {
        (Some((jv, f)), Some(st)) => {
            let mut m = row.to_vec();
            jv.mask_doc(f, st, &mut m);
            std::borrow::Cow::Owned(m)
        }
        _ => std::borrow::Cow::Borrowed(row),
    }
}

/// The JSON document before each position of a verification window (k drafts + 1): the
/// committed state, then each draft applied; None from the first draft that breaks it.
fn json_states(
    shape: Option<(&JsonVocab, &Format)>,
    st: Option<Doc>,
    drafts: &[u32],
) -> Vec<Option<Doc>> {
    let mut out = vec![None; drafts.len() + 1];
    let (Some((jv, f)), Some(mut cur)) = (shape, st) else {
        return out;
    };
    out[0] = Some(cur);
    for (r, &t) in drafts.iter().enumerate() {
        match jv.advance_doc(f, &cur, t) {
            Some(n) => cur = n,
            None => break,
        }
        out[r + 1] = Some(cur);
    }
    out
}

fn sample_one(logits: &[f32], seen: &[u32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.is_greedy() {
        if p.shapes_logits() {
            argmax(&probs(logits, seen, p))
        } else {
            argmax(logits)
        }
    } else {
        sample(&probs(logits, seen, p), rng)
    }
}

/// Appends tokens in order until a stop condition; returns how many were committed (a stop
/// token itself counts as consumed but is not part of the output). Text that could still be the
/// start of a stop string is held back until it is not (or the request ends).
/// Commits `new` (token i produced by logits row i of `rows`: `(rows, vocab)`), up to a stop
/// condition; returns how many were consumed.
/// Appends decoded text and cuts it at the first stop string it completes (once `min_tokens`
/// are out). True when cut: the request is finished and nothing after the stop is sent.
fn append_text(s: &mut Seq, delta: &str) -> bool {
    if delta.is_empty() {
        return false;
    }
    let before = s.text.len();
    s.text.push_str(delta);
    if s.output_len() >= s.req.min_tokens
        && let Some((cut, len)) = find_stop(&s.text, &s.req.stop, before)
    {
        s.text
            .truncate(if s.req.include_stop { cut + len } else { cut });
        s.finished = Some(FinishReason::Stop);
        return true;
    }
    false
}

fn commit_tokens(
    s: &mut Seq,
    new: &[u32],
    (rows, vocab): (&[f32], usize),
    (tok, json): (Option<&Tokenizer>, Option<&JsonVocab>),
    ctx: usize,
    events: &mut Vec<Event>,
) -> Result<usize> {
    let mut emitted = Vec::new();
    let mut logprobs = Vec::new();
    let mut consumed = 0;
    let mut cut_at_stop = false;
    for (i, &t) in new.iter().enumerate() {
        consumed += 1;
        if !s.req.ignore_eos && tok.is_some_and(|tk| tk.is_stop(t)) {
            s.finished = Some(FinishReason::Stop);
            break;
        }
        s.tokens.push(t);
        emitted.push(t);
        if let (Some(jv), Some(f), Some(st)) = (json, s.req.json.as_ref(), s.json.as_mut()) {
            *st = jv.advance_doc(f, st, t).ok_or_else(|| {
                SpecError::Invariant(format!("token {t} breaks the request's JSON document"))
            })?;
        }
        let stop_token = s.req.stop_token_ids.contains(&t);
        if let Some(top) = s.req.logprobs {
            let row = rows.get(i * vocab..(i + 1) * vocab).ok_or_else(|| {
                SpecError::Invariant("no logits row for a committed token".into())
            })?;
            logprobs.push(TokenLogprob::of(row, t, top));
        }
        if let Some(tk) = tok {
            if let Some(delta) = s.decoder.push(tk, t)?
                && append_text(s, &delta)
            {
                cut_at_stop = true;
                break;
            }
        }
        if stop_token {
            s.finished = Some(FinishReason::Stop);
            break;
        }
        if s.output_len() >= s.req.max_tokens || s.tokens.len() >= ctx {
            s.finished = Some(FinishReason::Length);
            break;
        }
    }
    // The end: text the decoder held back (a character cut by the token limit, a token that
    // decodes to U+FFFD) goes out; nothing will complete it. Not past a stop string (cut).
    if s.finished.is_some()
        && !cut_at_stop
        && let Some(tk) = tok
    {
        let rest = s.decoder.finish(tk)?;
        append_text(s, &rest);
    }
    let safe = if s.finished.is_some() {
        s.text.len()
    } else {
        s.text.len() - held_back(&s.text, &s.req.stop)
    };
    let text = if safe > s.sent {
        s.text[s.sent..safe].to_string()
    } else {
        String::new()
    };
    s.sent = s.sent.max(safe);
    let prompt_logprobs = std::mem::take(&mut s.prompt_lps);
    if !emitted.is_empty() || !text.is_empty() || !prompt_logprobs.is_empty() {
        let now = Instant::now();
        if let Some(prev) = s.last_emit {
            s.metrics.itl_s.push((now - prev).as_secs_f64());
        }
        s.last_emit = Some(now);
        events.push(Event::Tokens {
            id: s.req.id,
            tokens: emitted.clone(),
            text,
            logprobs,
            prompt_logprobs,
        });
    }
    Ok(if s.finished.is_some() {
        emitted.len()
    } else {
        consumed
    })
}

/// Length of the longest suffix of `text` that is a proper prefix of a stop string.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for st in stops {
        for l in (1..st.len()).rev() {
            if l <= best || l > text.len() {
                continue;
            }
            if text.is_char_boundary(text.len() - l)
                && st.is_char_boundary(l)
                && text.ends_with(&st[..l])
            {
                best = l;
                break;
            }
        }
    }
    best
}

/// Byte offset and length of the earliest stop string that ends after `from` (only new text
/// can complete one); of two starting there, the shorter (it ends first).
fn find_stop(text: &str, stops: &[String], from: usize) -> Option<(usize, usize)> {
    stops
        .iter()
        .filter_map(|st| {
            let start = from.saturating_sub(st.len() - 1);
            let start = (start..=from)
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(from);
            text[start..]
                .find(st.as_str())
                .map(|p| (start + p, st.len()))
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proposer::NoProposer;
    use dspark_runtime::LoadOptions;
    use dspark_runtime::tiny::{TinySpec, tiny_model_path};

    /// A request whose state breaks an invariant fails alone: the step goes on, a request
    /// finishing in the same step is answered, the others run to the end, no block leaks,
    /// and nothing of the broken request enters the prefix cache.
    /// Plain decoding (no proposer) of the tiny llama, one thread, and its tokenizer.
    fn tiny_engine() -> (Engine, Arc<Tokenizer>) {
        let p = tiny_model_path(&TinySpec::llama(11), "engine-unit").unwrap();
        let opts = LoadOptions {
            threads: 1,
            ..Default::default()
        };
        let model = Arc::new(Model::load(&p, &opts).unwrap());
        let tok = Arc::new(Tokenizer::load(&p).unwrap());
        let e = Engine::with_cost(
            model,
            Some(tok.clone()),
            Box::new(NoProposer),
            EngineConfig::default(),
            CostModel::flat(4),
        )
        .unwrap();
        (e, tok)
    }

    /// Live totals count a running request's tokens step by step, never fall back when it
    /// ends, and equal the totals once nothing runs.
    #[test]
    fn live_totals_move_every_step_and_never_go_down() {
        let (mut e, tok) = tiny_engine();
        let prompt = tok.encode("the theater in there").unwrap();
        let mut r = Request::new(0, prompt, 12);
        r.ignore_eos = true;
        e.add(r).unwrap();
        let mut last = 0;
        let mut moved_while_running = false;
        while !e.is_idle() {
            e.step().unwrap();
            let live = e.live_totals().completion_tokens;
            assert!(live >= last, "{live} after {last}");
            if !e.is_idle() && live > e.totals().completion_tokens {
                moved_while_running = true;
            }
            last = live;
        }
        assert!(moved_while_running, "counted only at the end");
        assert_eq!(last, 12);
        assert_eq!(
            e.live_totals().completion_tokens,
            e.totals().completion_tokens
        );
        assert_eq!(e.live_totals().target_calls, e.totals().target_calls);
    }

    #[test]
    fn a_request_that_breaks_an_invariant_fails_alone() {
        let (mut e, tok) = tiny_engine();
        let prompt = tok
            .encode("the theater in there then rather inner")
            .unwrap();
        for (id, max) in [(0u64, 2usize), (1, 20), (2, 20)] {
            let mut r = Request::new(id, prompt.clone(), max);
            r.ignore_eos = true;
            e.add(r).unwrap();
        }
        let first = e.step().unwrap();
        assert_eq!(
            first
                .iter()
                .filter(|ev| matches!(ev, Event::Tokens { .. }))
                .count(),
            3,
            "all three prefilled in one step"
        );
        // Request 1's prompt no longer what its KV holds (as an engine bug would leave it).
        let s = e.running.iter_mut().find(|s| s.req.id == 1).unwrap();
        s.tokens[1] ^= 1;
        let evs = e.step().unwrap();
        assert!(
            evs.iter().any(
                |ev| matches!(ev, Event::Failed { id: 1, error } if error.contains("invariant"))
            ),
            "{evs:?}"
        );
        assert!(
            evs.iter()
                .any(|ev| matches!(ev, Event::Finished { id: 0, .. })),
            "{evs:?}"
        );
        let rest = e.run_to_completion().unwrap();
        assert!(
            rest.iter()
                .any(|ev| matches!(ev, Event::Finished { id: 2, .. })),
            "{rest:?}"
        );
        e.check_kv().unwrap();
    }

    /// With `include_stop`, the stop string that ends the answer stays in its text; without,
    /// the text ends where it begins. Either way nothing after it is sent and the request
    /// stops there.
    #[test]
    fn the_stop_string_is_kept_when_asked() {
        let (mut e, tok) = tiny_engine();
        let prompt = tok.encode("the theater in there then").unwrap();
        let run = |e: &mut Engine, stop: Vec<String>, include: bool| {
            let mut r = Request::new(0, prompt.clone(), 24);
            r.ignore_eos = true;
            r.stop = stop;
            r.include_stop = include;
            e.add(r).unwrap();
            let mut text = String::new();
            let mut reason = None;
            for ev in e.run_to_completion().unwrap() {
                match ev {
                    Event::Tokens { text: t, .. } => text.push_str(&t),
                    Event::Finished { reason: r, .. } => reason = Some(r),
                    _ => {}
                }
            }
            (text, reason)
        };
        let (whole, _) = run(&mut e, Vec::new(), false);
        let chars: Vec<(usize, char)> = whole.char_indices().collect();
        assert!(chars.len() >= 6, "{whole:?}");
        // A stop string of two characters from the middle, and where it first completes.
        let (a, b) = (chars[3].0, chars[5].0);
        let stop = whole[a..b].to_string();
        let at = whole.find(&stop).unwrap();
        let (cut, reason) = run(&mut e, vec![stop.clone()], false);
        assert_eq!(cut, whole[..at], "{whole:?} / {stop:?}");
        assert_eq!(reason, Some(FinishReason::Stop));
        let (kept, reason) = run(&mut e, vec![stop.clone()], true);
        assert_eq!(kept, whole[..at + stop.len()], "{whole:?} / {stop:?}");
        assert_eq!(reason, Some(FinishReason::Stop));
    }
}
