//! Proposers: whatever drafts a block of tokens for the target to verify.
//!
//! A proposer returns, per request, the drafted tokens and the distribution each was drawn from
//! (after the same sampling transform the target uses), which is what lossless acceptance needs;
//! optionally a per-position confidence (the DSpark drafter's). Deterministic proposers (n-gram
//! lookup, greedy drafting) report [`Dist::OneHot`].

use crate::{Result, SpecError};
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use dspark_runtime::{KvCache, Model, SeqId, Tokenizer};
use kernels::rng::Rng;
use kernels::sampling::{SamplingParams, argmax, probs, sample};
use std::collections::HashMap;
use std::sync::Arc;

/// A drafted token's proposal distribution.
#[derive(Clone, Debug)]
pub enum Dist {
    Dense(Vec<f32>),
    Sparse(Vec<(u32, f32)>),
    OneHot,
}

impl Dist {
    pub fn as_draft(&self) -> kernels::accept::DraftDist<'_> {
        match self {
            Dist::Dense(v) => kernels::accept::DraftDist::Dense(v),
            Dist::Sparse(v) => kernels::accept::DraftDist::Sparse(v),
            Dist::OneHot => kernels::accept::DraftDist::OneHot,
        }
    }
}

/// How many inputs a drafter's confidence is computed from (see [`ConfInputs`]).
pub const CONF_INPUTS: usize = 6;

/// What a drafter computed one position's confidence from, kept for calibration: the
/// confidence head's logit, the log-odds of the draft distribution's top probability, its
/// entropy (nats), the log-odds of the request's acceptance rate from its earlier blocks,
/// recent (running) and whole-history (what kind of text the request is), and the copy
/// evidence (the length of the suffix match whose continuation is the distribution's top
/// token, 0 when there is none; see [`suffix_match`]). All are functions of the committed
/// tokens and x_1..x_{k−1}, never of the drafted token x_k.
pub type ConfInputs = [f32; CONF_INPUTS];

/// One request's drafted block.
#[derive(Clone, Debug, Default)]
pub struct DraftBlock {
    pub tokens: Vec<u32>,
    pub dists: Vec<Dist>,
    /// Per-position confidence that the token survives verification, when the drafter has one.
    pub confidence: Option<Vec<f32>>,
    /// Per position, what the confidence was computed from (calibration data).
    pub conf_inputs: Option<Vec<ConfInputs>>,
    /// The confidences are a greedy copy run's (its per-match-length acceptance rates, or its
    /// copy-run head's), not a confidence head's over the network: the engine recalibrates them
    /// apart.
    pub fitted_rates: bool,
}

/// What the engine asks of a proposer for one request.
pub struct ProposeReq<'a> {
    pub id: u64,
    /// Every committed token of the request (prompt and output).
    pub context: &'a [u32],
    /// At most this many tokens.
    pub k: usize,
    pub params: &'a SamplingParams,
    /// The request's drafting RNG.
    pub rng: &'a mut Rng,
}

pub trait Proposer: Send {
    fn name(&self) -> &str;
    /// Drafts blocks for several requests at once.
    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>>;
    /// The request's committed tokens after a verification (rejected drafts are gone).
    fn commit(&mut self, _id: u64, _context: &[u32]) -> Result<()> {
        Ok(())
    }
    /// The engine verified the first `k` drafts of the block it was given for request `id` at
    /// context length `at`: fewer than drafted where a verify policy trimmed the block, 0 where
    /// it verified none. Called for every request that drafted in the step, before its tokens
    /// are committed. A drafter that infers acceptance from the committed context learns here
    /// which drafts were never verified: the target's next token matches an unverified draft
    /// only by chance (for a sampled request, with probability Σ p·q, below the 1 − TV a
    /// verification accepts with), so counting them biases its acceptance history down.
    fn verified(&mut self, _id: u64, _at: usize, _k: usize) {}
    /// The request ended; release its state.
    fn finish(&mut self, _id: u64) {}
    /// Whether drafting has latency worth hiding (a remote draft worker). The engine then
    /// verifies the running requests in two alternating micro-batches and calls
    /// [`Proposer::prefetch`] for a micro-batch as soon as its verification is committed, so its
    /// next drafts travel while the other micro-batch is verified.
    fn pipelined(&self) -> bool {
        false
    }
    /// Starts drafting for these requests now; a later `propose` for the same requests and
    /// contexts collects the result.
    fn prefetch(&mut self, _reqs: &mut [ProposeReq<'_>]) {}
    /// Target layers whose hidden states this proposer conditions on (none by default).
    fn feature_layers(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Steps of features a block needs before it is drafted: the engine may skip capturing
    /// them while no request can draft within this many steps (its verify policy says so).
    /// Never, by default.
    fn feature_window(&self) -> usize {
        usize::MAX
    }
    /// Committed positions before a block whose target features the draft reads (0: none).
    /// A request starting from the prefix cache still computes at least this many prompt
    /// positions, so its first draft sees the same features as without the cache.
    fn context_rows(&self) -> usize {
        0
    }
    /// Target features of newly committed positions `start..start + n` of a request, each row
    /// the requested layers side by side (`n × layers·d`). Rows arrive in position order; a
    /// position is reported once, after it is committed.
    fn observe(&mut self, _id: u64, _start: usize, _rows: &[f32]) -> Result<()> {
        Ok(())
    }
    /// [`Proposer::observe`] of rows captured at `layers` (what [`Proposer::feature_layers`]
    /// said before the forward). The engine calls this one: a proposer whose layers can change
    /// meanwhile (a remote one, as its draft workers come and go) labels the rows with the
    /// layers they are of, not with those it would capture now.
    fn observe_captured(
        &mut self,
        id: u64,
        start: usize,
        _layers: &[usize],
        rows: &[f32],
    ) -> Result<()> {
        self.observe(id, start, rows)
    }
    /// Longest block this proposer can draft (a trained drafter's γ); `None`: any length.
    fn max_gamma(&self) -> Option<usize> {
        None
    }
    /// Seconds spent so far per stage of drafting (for `dspark bench draft`); empty when the
    /// proposer does not break its time down.
    fn stage_seconds(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
    /// Seconds of the last [`Proposer::propose`] call spent catching up on context that earlier
    /// steps deferred (a new request's prompt, or tokens committed while drafting was skipped).
    /// That work is paid once, not per step, so a scheduler weighing drafting's per-step cost
    /// leaves it out.
    fn last_catch_up_seconds(&self) -> f64 {
        0.0
    }
    /// Whether the last [`Proposer::propose`] waited out a remote drafter's timeout: its
    /// seconds measured the timeout, not what drafting costs, and are left out of the means
    /// that weigh drafting (one stalled call read as a cost turned speculation off for
    /// hundreds of cycles).
    fn timed_out(&self) -> bool {
        false
    }
    /// Whether [`Proposer::propose_free`] can return anything: drafts that cost next to
    /// nothing to make (a lookup, no network).
    fn has_free_drafts(&self) -> bool {
        false
    }
    /// Only the drafts that cost next to nothing (empty blocks elsewhere). The engine asks for
    /// them on steps the scheduler planned without drafting: a zero budget prices the drafting
    /// call it saves, and these do not need one. Confidences as in [`Proposer::propose`].
    fn propose_free(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>> {
        Ok(reqs.iter().map(|_| DraftBlock::default()).collect())
    }
    /// Greedy copy-run acceptance rates by suffix-match length, when this proposer's free
    /// drafts are copy runs (a calibrated DSpark drafter's). A draft worker publishes them so
    /// the target worker, which holds the context, makes the same free drafts without a call.
    fn copy_runs(&self) -> Vec<f32> {
        Vec::new()
    }
    /// The copy runs' confidence head, flattened (weights, then one bias per block position;
    /// empty: the rates serve), published with [`Proposer::copy_runs`] so that a target
    /// worker's copy runs carry the confidences the drafter's own would.
    fn copy_head(&self) -> Vec<f32> {
        Vec::new()
    }
}

/// Which proposer to build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProposerKind {
    None,
    Ngram,
    /// An independent small model sharing the target's tokenizer (model name or path).
    DraftModel(String),
    /// A trained DSpark drafter checkpoint directory (`dspark` alone: the shipped default).
    Dspark(Option<String>),
}

impl ProposerKind {
    /// `none`, `ngram`, `draft-model[:NAME]` (default draft for the target via `default_draft`).
    pub fn parse(s: &str, default_draft: Option<&str>) -> Result<Self> {
        match s {
            "none" => Ok(Self::None),
            "ngram" => Ok(Self::Ngram),
            "dspark" => Ok(Self::Dspark(None)),
            "draft-model" => default_draft
                .map(|d| Self::DraftModel(d.to_string()))
                .ok_or_else(|| {
                    SpecError::Invalid(
                        "this target has no default draft model; use draft-model:NAME".into(),
                    )
                }),
            other => match (
                other.strip_prefix("draft-model:"),
                other.strip_prefix("dspark:"),
            ) {
                (Some(name), _) if !name.is_empty() => Ok(Self::DraftModel(name.to_string())),
                (_, Some(dir)) if !dir.is_empty() => Ok(Self::Dspark(Some(dir.to_string()))),
                _ => Err(SpecError::Invalid(format!(
                    "unknown drafter `{other}` (none, ngram, draft-model[:NAME], dspark[:DIR])"
                ))),
            },
        }
    }
    pub fn label(&self) -> String {
        match self {
            Self::None => "none".into(),
            Self::Ngram => "ngram".into(),
            Self::DraftModel(m) => format!("draft-model:{m}"),
            Self::Dspark(None) => "dspark".into(),
            Self::Dspark(Some(d)) => format!("dspark:{d}"),
        }
    }
}

/// No speculation.
pub struct NoProposer;

impl Proposer for NoProposer {
    fn name(&self) -> &str {
        "none"
    }
    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>> {
        Ok(reqs.iter().map(|_| DraftBlock::default()).collect())
    }
}

/// The longest suffix of `seq` (at most `max_n` tokens) that also occurs earlier within the
/// last `window` tokens, and the token that followed its most recent earlier occurrence:
/// `(length, next)`. What prompt lookup proposes, and the copy prior of the DSpark drafter:
/// text that repeats itself (code identifiers, quoted input, a small model's greedy loops) is
/// predicted far better by "what came after this the last time" than by a small network.
pub fn suffix_match(seq: &[u32], max_n: usize, window: usize) -> Option<(usize, u32)> {
    suffix_match_at(seq, max_n, window).and_then(|(l, i)| Some((l, *seq.get(i + 1)?)))
}

/// [`suffix_match`] with where the earlier occurrence ends instead of what followed it:
/// `(length, i)`, the token after it being `seq[i + 1]`.
pub fn suffix_match_at(seq: &[u32], max_n: usize, window: usize) -> Option<(usize, usize)> {
    let n = seq.len();
    if n < 2 || max_n == 0 {
        return None;
    }
    let last = seq[n - 1];
    let lo = n.saturating_sub(window.max(2));
    let mut best: Option<(usize, usize)> = None;
    // `i` ends an earlier occurrence; seq[i + 1] is what followed it.
    for i in (lo..n - 1).rev() {
        if seq[i] != last {
            continue;
        }
        let mut l = 1;
        while l < max_n && l <= i && seq[i - l] == seq[n - 1 - l] {
            l += 1;
        }
        if best.is_none_or(|(b, _)| l > b) {
            best = Some((l, i));
            if l == max_n {
                break;
            }
        }
    }
    best
}

/// Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
/// (n = max_n down to 1) and propose what followed it.
pub struct NgramProposer {
    pub max_n: usize,
}

impl Default for NgramProposer {
    fn default() -> Self {
        Self { max_n: 3 }
    }
}

impl NgramProposer {
    pub fn lookup(&self, ctx: &[u32], k: usize) -> Vec<u32> {
        let len = ctx.len();
        for n in (1..=self.max_n.min(len.saturating_sub(1))).rev() {
            let pat = &ctx[len - n..];
            // Most recent match that is not the suffix itself.
            let mut i = len - n;
            while i > 0 {
                i -= 1;
                if &ctx[i..i + n] == pat {
                    let start = i + n;
                    let end = (start + k).min(len);
                    if end > start {
                        return ctx[start..end].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

impl Proposer for NgramProposer {
    fn name(&self) -> &str {
        "ngram"
    }
    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>> {
        Ok(reqs
            .iter()
            .map(|r| {
                let tokens = if r.k == 0 {
                    Vec::new()
                } else {
                    self.lookup(r.context, r.k)
                };
                let dists = tokens.iter().map(|_| Dist::OneHot).collect();
                DraftBlock {
                    tokens,
                    dists,
                    confidence: None,
                    conf_inputs: None,
                    fitted_rates: false,
                }
            })
            .collect())
    }
}

/// An independent small model with the target's tokenizer, drafting autoregressively with its
/// own KV cache (rolled back to the committed prefix after each verification).
pub struct DraftModelProposer {
    model: Arc<Model>,
    cache: KvCache,
    seqs: HashMap<u64, (SeqId, Vec<u32>)>,
    label: String,
    /// Forwards that failed (a full draft cache): warned at powers of two.
    failures: u64,
    /// Requests whose forward failed alone, and how many calls they sit out: a full cache
    /// stays full while its requests live, and retrying them every call would split every
    /// batched step into one forward per request.
    refused: HashMap<u64, u32>,
}

/// Calls a request whose forward failed alone sits out before it is tried again.
const SIT_OUT_CALLS: u32 = 16;

/// The next draft token from a request's logits (and the state that records it).
fn pick(
    seqs: &mut HashMap<u64, (SeqId, Vec<u32>)>,
    r: &mut ProposeReq<'_>,
    out: &mut DraftBlock,
    fed: &[u32],
    logits: &[f32],
) -> u32 {
    if let Some(e) = seqs.get_mut(&r.id) {
        e.1.extend_from_slice(fed);
    }
    let mut seen: Vec<u32> = r.context.to_vec();
    seen.extend_from_slice(&out.tokens);
    let p = probs(logits, &seen, r.params);
    let (tok, dist) = if r.params.is_greedy() {
        (argmax(&p), Dist::OneHot)
    } else {
        let t = sample(&p, r.rng);
        (t, Dist::Dense(p))
    };
    out.tokens.push(tok);
    out.dists.push(dist);
    tok
}

impl DraftModelProposer {
    /// Refuses a draft model whose vocabulary differs from the target's.
    pub fn new(
        model: Arc<Model>,
        draft_tok: &Tokenizer,
        target_tok: &Tokenizer,
        target_vocab: usize,
        kv_tokens: usize,
        label: &str,
    ) -> Result<Self> {
        if model.cfg.vocab_size != target_vocab {
            return Err(SpecError::Incompatible(format!(
                "draft model has {} logits, target has {}",
                model.cfg.vocab_size, target_vocab
            )));
        }
        if draft_tok.vocab_hash() != target_tok.vocab_hash() {
            return Err(SpecError::Incompatible(
                "draft and target tokenizers differ (vocabulary hash mismatch)".into(),
            ));
        }
        let mut cache = model.new_cache(kv_tokens, 16)?;
        // Requests sharing a prompt prefix hold it once here too: admission counts a prefix
        // the target's cache shares once, and N copies of it would overfill this cache.
        cache.set_prefix_caching(true);
        Ok(Self {
            model,
            cache,
            seqs: HashMap::new(),
            label: label.to_string(),
            failures: 0,
            refused: HashMap::new(),
        })
    }
}

impl Proposer for DraftModelProposer {
    fn name(&self) -> &str {
        &self.label
    }

    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>> {
        let mut out: Vec<DraftBlock> = reqs.iter().map(|_| DraftBlock::default()).collect();
        // Catch-up feed: committed tokens the draft KV has not seen (usually 1–2).
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(reqs.len());
        let mut fresh = Vec::new();
        // New requests that start alike in one call (a burst behind one system prompt) would
        // each compute and hold the prefix: the first goes now, the others draft from the
        // next call on, when its blocks are registered.
        let bs = self.cache.config().block_size;
        let mut firsts: Vec<&[u32]> = Vec::new();
        let mut later = vec![false; reqs.len()];
        for (i, r) in reqs.iter().enumerate() {
            if self.seqs.contains_key(&r.id) || r.context.len() <= bs {
                continue;
            }
            let first = &r.context[..bs];
            if firsts.contains(&first) {
                later[i] = true;
            } else {
                firsts.push(first);
            }
        }
        for (i, r) in reqs.iter().enumerate() {
            if later[i] {
                feeds.push(Vec::new());
                continue;
            }
            let entry = match self.seqs.get(&r.id) {
                Some(e) => e.clone(),
                None => {
                    // What another request started with (a shared system prompt, an earlier
                    // turn) is attached from the cache: held and computed once. The last
                    // token is fed (its logits give the first draft).
                    let (s, cached) = self
                        .cache
                        .new_seq_with_prefix(r.context, r.context.len().saturating_sub(1));
                    let fed = r.context[..cached].to_vec();
                    self.seqs.insert(r.id, (s, fed.clone()));
                    fresh.push(r.id);
                    (s, fed)
                }
            };
            let (s, fed) = entry;
            // At least the last token is fed: its logits give the first draft. (A context that
            // ends inside what was fed, a block the verify policy trimmed before a draft the
            // target's next token then matched, backs off one; before, it drafted nothing.)
            let common = fed
                .iter()
                .zip(r.context.iter())
                .take_while(|(a, b)| a == b)
                .count()
                .min(r.context.len().saturating_sub(1));
            self.cache.truncate(s, common)?;
            feeds.push(r.context[common..].to_vec());
            if let Some(e) = self.seqs.get_mut(&r.id) {
                e.1.truncate(common);
            }
        }
        // A request's drafts stop where the draft model's context ends (its KV holds the
        // context and all but the last draft), so one request past it cannot fail the batch.
        let max_ctx = self.model.cfg.max_ctx;
        let mut ks: Vec<usize> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if later[i] {
                    0
                } else {
                    r.k.min((max_ctx + 1).saturating_sub(r.context.len()))
                }
            })
            .collect();
        for (i, r) in reqs.iter().enumerate() {
            if let Some(c) = self.refused.get_mut(&r.id) {
                ks[i] = 0;
                *c -= 1;
                if *c == 0 {
                    self.refused.remove(&r.id);
                }
            }
        }
        let max_k = ks.iter().copied().max().unwrap_or(0);
        let opts = ForwardOptions::default();
        for step in 0..max_k {
            let active: Vec<usize> = (0..reqs.len())
                .filter(|&i| ks[i] > step && !feeds[i].is_empty())
                .collect();
            if active.is_empty() {
                break;
            }
            let seq_of = |i: usize| self.seqs.get(&reqs[i].id).map(|e| e.0);
            let inputs: Vec<SeqInput<'_>> = active
                .iter()
                .filter_map(|&i| {
                    Some(SeqInput {
                        seq: seq_of(i)?,
                        tokens: &feeds[i],
                        logits: LogitsMode::Last,
                    })
                })
                .collect();
            if inputs.len() != active.len() {
                return Err(SpecError::Invariant("draft sequence lost".into()));
            }
            let mut next: Vec<Option<u32>> = vec![None; reqs.len()];
            match self.model.forward(&mut self.cache, &inputs, &opts) {
                Ok(o) => {
                    for (j, &i) in active.iter().enumerate() {
                        let t = pick(
                            &mut self.seqs,
                            &mut reqs[i],
                            &mut out[i],
                            &feeds[i],
                            o.row(j, 0),
                        );
                        next[i] = Some(t);
                    }
                }
                // Drafting only speeds decoding up: a forward that fails (the draft cache is
                // full) is retried per request, and a request that still fails stops drafting
                // here, keeping what it drafted; the others go on.
                Err(e) => {
                    self.failures += 1;
                    if self.failures.is_power_of_two() {
                        tracing::warn!(
                            failures = self.failures,
                            "draft model forward failed, drafting per request: {e}"
                        );
                    }
                    for (j, &i) in active.iter().enumerate() {
                        // Alone in the batch, it failed alone already.
                        let alone = if active.len() == 1 {
                            None
                        } else {
                            let one = [SeqInput {
                                seq: inputs[j].seq,
                                tokens: &feeds[i],
                                logits: LogitsMode::Last,
                            }];
                            self.model.forward(&mut self.cache, &one, &opts).ok()
                        };
                        match alone {
                            Some(o) => {
                                let t = pick(
                                    &mut self.seqs,
                                    &mut reqs[i],
                                    &mut out[i],
                                    &feeds[i],
                                    o.row(0, 0),
                                );
                                next[i] = Some(t);
                            }
                            None => {
                                self.refused.insert(reqs[i].id, SIT_OUT_CALLS);
                            }
                        }
                    }
                }
            }
            for (i, f) in feeds.iter_mut().enumerate() {
                f.clear();
                if let Some(t) = next[i] {
                    f.push(t);
                }
            }
        }
        // A new request's context, now in the cache, can start the next ones.
        for id in fresh {
            if let Some((s, fed)) = self.seqs.get(&id) {
                self.cache.register(*s, fed)?;
            }
        }
        Ok(out)
    }

    fn commit(&mut self, id: u64, context: &[u32]) -> Result<()> {
        if let Some((s, fed)) = self.seqs.get_mut(&id) {
            let common = fed
                .iter()
                .zip(context.iter())
                .take_while(|(a, b)| a == b)
                .count();
            fed.truncate(common);
            self.cache.truncate(*s, common)?;
        }
        Ok(())
    }

    fn finish(&mut self, id: u64) {
        self.refused.remove(&id);
        if let Some((s, fed)) = self.seqs.remove(&id) {
            // The whole conversation so far may start the next turn.
            let _ = self.cache.register(s, &fed);
            let _ = self.cache.remove(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_finds_the_latest_longest_match() {
        let p = NgramProposer::default();
        // ... 1 2 3 [4 5] ... 1 2 3 → propose 4 5
        assert_eq!(p.lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        assert_eq!(p.lookup(&[7, 8, 9], 4), Vec::<u32>::new());
        // Falls back to shorter n; the proposal is capped by k and by the context end.
        assert_eq!(p.lookup(&[5, 6, 7, 5], 3), vec![6, 7, 5]);
    }

    #[test]
    fn suffix_match_takes_the_longest_then_the_most_recent() {
        // "1 2 3" occurred once followed by 4; "3" alone most recently followed by 8.
        assert_eq!(
            suffix_match(&[1, 2, 3, 4, 3, 8, 1, 2, 3], 6, 1024),
            Some((3, 4))
        );
        // Among equally long matches the latest wins.
        assert_eq!(suffix_match(&[5, 1, 5, 2, 5], 6, 1024), Some((1, 2)));
        // The length is capped by max_n; a periodic run matches itself one period back.
        assert_eq!(suffix_match(&[7, 7, 7, 7, 7], 3, 1024), Some((3, 7)));
        // Nothing repeats; too short; a window that leaves out the earlier occurrence.
        assert_eq!(suffix_match(&[1, 2, 3], 6, 1024), None);
        assert_eq!(suffix_match(&[1], 6, 1024), None);
        assert_eq!(suffix_match(&[1, 9, 0, 0, 0, 1], 6, 3), None);
        assert_eq!(suffix_match(&[1, 9, 0, 0, 0, 1], 6, 6), Some((1, 9)));
    }

    #[test]
    fn drafter_names_parse() {
        assert_eq!(
            ProposerKind::parse("ngram", None).unwrap(),
            ProposerKind::Ngram
        );
        assert_eq!(
            ProposerKind::parse("draft-model:x", None).unwrap(),
            ProposerKind::DraftModel("x".into())
        );
        assert!(ProposerKind::parse("draft-model", None).is_err());
        assert!(ProposerKind::parse("medusa", None).is_err());
    }
}
