//! The DSpark drafter behind the engine's `Proposer` trait: it keeps the target features of each
//! request's committed positions (reported by the engine after every forward), drafts a block in
//! one parallel forward, then samples left to right with the Markov bias of the previously
//! sampled token, reporting q_k (after the request's sampling transform) and the calibrated
//! confidence c_k, which never depends on x_k.

use crate::calibrate::{CopySample, HeadSample};
use crate::fast::{CtxRow, FastDrafter, quantize_bits, quantize_q8};
use crate::model::{DsparkDrafter, GreedyHead};
use kernels::sampling::{argmax, probs, sample};
use specdec::SpecError;
use specdec::proposer::{Dist, DraftBlock, ProposeReq, Proposer, suffix_match, suffix_match_at};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Longest suffix match the copy prior looks for; matches this long or longer share the last
/// bias bucket.
pub const COPY_MAX_MATCH: usize = 6;
/// How far back (tokens) the copy prior searches.
const COPY_WINDOW: usize = 4096;
/// The requests asking for a block that have a context to draft from.
fn drafting(reqs: &[ProposeReq<'_>]) -> Vec<usize> {
    (0..reqs.len())
        .filter(|&i| reqs[i].k > 0 && !reqs[i].context.is_empty())
        .collect()
}

/// Fitted acceptance rate of a copied token from which a greedy block is drafted by copying
/// alone: there the copy prior's bonus (≈ 10 logits) decides the network's output anyway, so
/// running the network would cost a drafting call for the same tokens.
pub const COPY_RUN_MIN: f32 = 0.5;

/// Inputs of the copy-run confidence head ([`copy_inputs`]).
pub const COPY_HEAD_INPUTS: usize = 5;
/// Names the input set [`copy_inputs`] computes. A copy-run head is only read over the inputs
/// it was fitted on: a stored head carries this tag, and draft workers publish it with the
/// head. Change it whenever [`copy_inputs`] changes meaning, even at the same width. Target
/// workers released before the tag (209e075 to c646b8e) read `WorkerInfo.copy_head` without
/// it: a new input set must also move the head to a new proto field (field 18 reserved), or be
/// rolled out after a tag-aware release everywhere.
pub const COPY_HEAD_SPEC: &str = "copy-v1";

/// The input set a copy-run head's tag names: an absent or empty tag is "copy-v1", the only
/// set before tags (heads stored, and heads published by draft workers, from 209e075 on).
pub fn copy_head_spec(tag: Option<&str>) -> &str {
    match tag {
        None | Some("") => "copy-v1",
        Some(t) => t,
    }
}

/// Whether a head tagged `tag` reads the inputs this release's [`copy_inputs`] computes.
pub fn copy_head_is_ours(tag: Option<&str>) -> bool {
    copy_head_spec(tag) == COPY_HEAD_SPEC
}
/// How far [`copy_inputs`] follows a match back (the rates stop at [`COPY_MAX_MATCH`]).
const COPY_LONG_MATCH: usize = 64;
/// Matched tokens whose earlier occurrences [`copy_inputs`] counts.
const COPY_AGREE_LEN: usize = 3;

/// The copy-run confidence head's inputs at a copied position: `seq` is the context and the
/// run's tokens before it, whose last `len` tokens also end at `src` (the most recent
/// longest match, [`suffix_match_at`]), and `long0` is input 2 at the run's first position.
/// 1. logit of the match length's rate `runs[min(len, runs.len()) − 1]`, clamped to
///    [0.01, 0.99];
/// 2. ln(1 + L), L the length of that match followed back up to 64 tokens: a long
///    verbatim repeat (a loop) goes on more surely than a six-token one;
/// 3. the same at the run's first position;
/// 4. the log-odds that the last min(len, 3) tokens' earlier occurrences were followed by
///    the copied token ((agreeing + ½)/(occurrences + 1)): a suffix that went on in several
///    ways is a fork, one that always went on alike is a formula;
/// 5. ln(1 + occurrences).
///
/// All are functions of `seq` alone, so of x_1..x_{k−1}: the copied token is what followed
/// `src`. Held-out greedy math (first 48 prompts; a logistic regression fitted on the math
/// calibration prompts): ROC-AUC over copied positions 0.72 with the rate alone, 0.83 with
/// these.
pub fn copy_inputs(
    seq: &[u32],
    len: usize,
    src: usize,
    long0: Option<f32>,
    runs: &[f32],
) -> [f32; COPY_HEAD_INPUTS] {
    let n = seq.len();
    let rate = len
        .min(runs.len())
        .checked_sub(1)
        .and_then(|i| runs.get(i))
        .copied()
        .unwrap_or(0.5)
        .clamp(0.01, 0.99);
    if src >= n.saturating_sub(1) {
        // Not an earlier occurrence: no evidence beyond the rate.
        return [
            (rate / (1.0 - rate)).ln(),
            0.0,
            long0.unwrap_or(0.0),
            0.0,
            0.0,
        ];
    }
    let mut long = 0;
    while long < COPY_LONG_MATCH && long <= src && seq[src - long] == seq[n - 1 - long] {
        long += 1;
    }
    let long = (long as f32).ln_1p();
    let cand = seq.get(src + 1).copied();
    let m = len.clamp(1, COPY_AGREE_LEN);
    let suffix = &seq[n.saturating_sub(m)..];
    let (mut occ, mut agree) = (0u32, 0u32);
    let lo = n.saturating_sub(COPY_WINDOW).max(m - 1);
    for i in lo..n.saturating_sub(1) {
        if seq[i] == seq[n - 1] && seq[i + 1 - m..=i] == *suffix {
            occ += 1;
            agree += (Some(seq[i + 1]) == cand) as u32;
        }
    }
    let agreement = (agree as f32 + 0.5) / (occ as f32 + 1.0);
    [
        (rate / (1.0 - rate)).ln(),
        long,
        long0.unwrap_or(long),
        (agreement / (1.0 - agreement)).ln(),
        (occ as f32).ln_1p(),
    ]
}

/// A greedy block drafted by the copy prior alone: while the committed-and-drafted suffix has
/// an earlier occurrence whose match length L has a fitted acceptance rate `runs[L−1]` of at
/// least [`COPY_RUN_MIN`], the token that followed it. Its confidence is that rate, or with a
/// copy-run `head` σ(head over [`copy_inputs`]) (a run then stops at the head's last
/// position); either is a function of x_1..x_{k−1} only. Returns the tokens, the confidences
/// and, with a head or `with_inputs`, the head's inputs; empty when the first position does
/// not qualify.
pub fn copy_run(
    context: &[u32],
    k: usize,
    runs: &[f32],
    head: Option<&GreedyHead>,
    with_inputs: bool,
) -> (Vec<u32>, Vec<f32>, Vec<[f32; COPY_HEAD_INPUTS]>) {
    let (mut toks, mut conf, mut inputs) = (Vec::new(), Vec::new(), Vec::new());
    let k = head.map_or(k, |h| k.min(h.bias.len()));
    if runs.is_empty() || k == 0 {
        return (toks, conf, inputs);
    }
    let mut seq = context.to_vec();
    let mut long0 = None;
    while toks.len() < k {
        let Some((len, src)) = suffix_match_at(&seq, COPY_MAX_MATCH, COPY_WINDOW) else {
            break;
        };
        let Some(&next) = seq.get(src + 1) else {
            break;
        };
        match len.min(runs.len()).checked_sub(1).and_then(|i| runs.get(i)) {
            Some(&p) if p >= COPY_RUN_MIN => {
                let mut c = p;
                if head.is_some() || with_inputs {
                    let x = copy_inputs(&seq, len, src, long0, runs);
                    long0.get_or_insert(x[1]);
                    if let Some(z) = head.and_then(|h| h.logit(&x, None, toks.len())) {
                        c = (1.0 / (1.0 + (-z).exp())).clamp(1e-4, 1.0 - 1e-4);
                    }
                    inputs.push(x);
                }
                toks.push(next);
                conf.push(c);
                seq.push(next);
            }
            _ => break,
        }
    }
    (toks, conf, inputs)
}

/// [`copy_run`] as the engine's block: one-hot draft distributions (greedy verification reads
/// only the tokens), the run's confidences. Empty when no run qualifies.
pub fn copy_block(
    context: &[u32],
    k: usize,
    runs: &[f32],
    head: Option<&GreedyHead>,
) -> DraftBlock {
    copy_block_with_inputs(context, k, runs, head, false).0
}

/// [`copy_block`] and (see [`copy_run`]) the head inputs of its positions.
fn copy_block_with_inputs(
    context: &[u32],
    k: usize,
    runs: &[f32],
    head: Option<&GreedyHead>,
    with_inputs: bool,
) -> (DraftBlock, Vec<[f32; COPY_HEAD_INPUTS]>) {
    let (tokens, conf, inputs) = copy_run(context, k, runs, head, with_inputs);
    if tokens.is_empty() {
        return (DraftBlock::default(), inputs);
    }
    let block = DraftBlock {
        dists: vec![Dist::OneHot; tokens.len()],
        tokens,
        confidence: Some(conf),
        conf_inputs: None,
        fitted_rates: true,
    };
    (block, inputs)
}

pub struct DsparkProposer {
    dr: DsparkDrafter,
    /// The serving forward (8-bit weights, cached context rows).
    fast: FastDrafter,
    /// Per request: the target's feature rows of committed positions, and the context rows
    /// (fused, with per-layer keys and values) of the recent ones.
    feats: HashMap<u64, ReqFeats>,
    /// Feature buffers of finished requests, for the next ones: each grows to a few hundred
    /// kB, above the allocator's mmap threshold, so a fresh one per request page-faults its
    /// way up every time.
    spare_raw: Vec<Vec<f32>>,
    /// The context row of an all-zero feature row: what pads the window of a short request.
    pad: CtxRow,
    label: String,
    /// The target model, whose quantized LM head (the drafter's frozen head) gives the base
    /// logits, and whose thread pool runs the drafter's matmuls.
    target: Option<std::sync::Arc<dspark_runtime::Model>>,
    /// W2ᵀ (V × r) in 8-bit blocks: the Markov bias W1[x]·W2 of a drafted position reads 4×
    /// fewer bytes than from the f32 W2 (it is the drafter's largest per-position cost).
    w2t: Option<kernels::matmul::QMatrix>,
    /// W1 (V × r) when drafting with the Markov head.
    w1: Option<Vec<f32>>,
    /// The draft vocabulary (most frequent tokens) and the head's rows for it in 8-bit
    /// blocks, when the checkpoint has one; `w2t` then holds the same rows only.
    vocab_ids: Option<Vec<u32>>,
    /// Token id → column of the draft vocabulary (`u32::MAX`: not in it).
    vocab_pos: Option<Vec<u32>>,
    head_sub: Option<kernels::matmul::QMatrix>,
    /// Where drafted positions with a copy candidate are recorded once the target has
    /// committed them (the copy prior's fit, [`crate::calibrate::fit_copy`]).
    copy_log: Option<Arc<Mutex<Vec<CopySample>>>>,
    /// Where greedy requests' drafted positions are recorded with their head inputs once the
    /// target has committed them (the fits of the greedy head and of the copy-run head,
    /// [`crate::calibrate::fit_greedy_head`]).
    head_log: Option<Arc<Mutex<Vec<HeadSample>>>>,
    /// Whether `head_log` also takes the network's positions (false: copy runs' only, whose
    /// inputs are 5 numbers where the network's are d_model + rank).
    log_network: bool,
    /// The greedy confidence head of requests in fold 0 and fold 1: the stored one for both,
    /// or, while calibrating, each fitted on the other fold's requests.
    greedy_heads: [Option<GreedyHead>; 2],
    /// Confidence head: weights over [h; W1[x_{k−1}]] (or h alone), and bias.
    conf_w: Vec<f32>,
    conf_b: f32,
    isa: kernels::Isa,
    /// Seconds the last call's context stage spent on rows beyond one per request (catch-up).
    last_catch_up: f64,
    /// Seconds per drafting stage so far: context rows, block forward, head, Markov bias,
    /// sampling and confidence ([`Proposer::stage_seconds`]).
    stages: [f64; 5],
}

const STAGES: [&str; 5] = ["context", "block", "head", "markov", "sample"];

/// A request's context. Context rows are computed row-wise, so a position is processed once,
/// the first time a block is drafted with it in the window, and kept: drafting every step
/// processes one or two new rows, and an engine that stops drafting (the scheduler at K = 0)
/// pays nothing per step but a copy of the features (and nothing at all while its scheduler
/// is backed off: the engine then captures none, [`Proposer::feature_window`]).
#[derive(Default)]
struct ReqFeats {
    /// Feature rows (F·d each) of committed positions `raw0..n`: the context window and a
    /// margin, not the whole request (at 7 kB a position, whole requests grew by reallocation
    /// and page faults on every step that served them).
    raw: Vec<f32>,
    raw0: usize,
    /// Context rows of positions `f0 ..`.
    rows: Vec<CtxRow>,
    f0: usize,
    /// The last block drafted for the request and the context length it was drafted at.
    last_draft: Vec<u32>,
    draft_at: usize,
    /// Running per-position acceptance of the request's blocks (None before the first).
    rate: Option<f32>,
    /// Accepted positions and trials over all the request's verified blocks.
    accepted: u32,
    trials: u32,
    /// Copy candidates of the last drafted block, waiting for the committed tokens.
    pending_copy: Vec<PendingCopy>,
    /// The head inputs of the last drafted block's positions (greedy requests, while logged),
    /// and whether that block was a copy run (whose inputs are [`copy_inputs`]).
    pending_head: Vec<(usize, Vec<f32>)>,
    pending_copy_run: bool,
    /// The request's fold (see [`HeadSample::fold`]), from its context when first seen.
    fold: Option<u8>,
}

/// A drafted position's copy candidate (see [`CopySample`]).
struct PendingCopy {
    k: usize,
    len: usize,
    cand: u32,
    top: u32,
    gap: f32,
    q_c: f32,
}

/// Feature rows kept beyond the context window, for rollbacks (longer ones start the window
/// over, padded): each request holds at most 2·C + this many rows, at 7 kB a row on SmolLM2,
/// and every step a request decodes appends one, so what is held is what the step's
/// caches carry.
const RAW_MARGIN: usize = 8;

/// Feature buffers kept for reuse (about a full batch's worth).
const MAX_SPARE_RAW: usize = 64;

/// Running acceptance assumed before a request's first verified block.
const PRIOR_RATE: f32 = 0.25;

impl ReqFeats {
    /// The request's fold: a hash of its context the first time it is seen (the prompt and
    /// the first token), so reruns of the same prompts put each request in the same fold.
    fn fold(&mut self, context: &[u32]) -> u8 {
        *self.fold.get_or_insert_with(|| {
            let mut h = context.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
                (h ^ t as u64).wrapping_mul(0x0100_0000_01b3)
            });
            // FNV-1a, then SplitMix64's finalizer: FNV's bits barely move with the last tokens.
            h ^= h >> 30;
            h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h ^= h >> 27;
            h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
            h ^= h >> 31;
            (h >> 63) as u8
        })
    }

    /// Turns the last block's logged head inputs into samples: position k counts when the
    /// target committed the drafted x_1..x_{k−1} and one more token.
    fn resolve_head(&mut self, context: &[u32], out: &mut Vec<HeadSample>) {
        let seen = context.get(self.draft_at..).unwrap_or(&[]);
        let fold = self.fold.unwrap_or(0);
        for (k, x) in self.pending_head.drain(..) {
            let reached =
                seen.len() > k && self.last_draft.len() > k && self.last_draft[..k] == seen[..k];
            if reached {
                out.push(HeadSample {
                    fold,
                    k,
                    hit: seen[k] == self.last_draft[k],
                    x,
                    copy_run: self.pending_copy_run,
                });
            }
        }
    }

    /// Turns the last block's copy candidates into samples: position k counts when the target
    /// committed the drafted x_1..x_{k−1} and one more token, the one at k.
    fn resolve_copy(&mut self, context: &[u32], out: &mut Vec<CopySample>) {
        let seen = context.get(self.draft_at..).unwrap_or(&[]);
        for p in self.pending_copy.drain(..) {
            let reached = seen.len() > p.k
                && self.last_draft.len() >= p.k
                && self.last_draft[..p.k] == seen[..p.k];
            if reached {
                out.push(CopySample {
                    len: p.len,
                    k: p.k,
                    gap: p.gap,
                    q_c: p.q_c,
                    hit_c: seen[p.k] == p.cand,
                    hit_top: seen[p.k] == p.top,
                });
            }
        }
    }

    /// Folds the outcome of the last drafted block into the running acceptance rate: its
    /// accepted prefix is where the committed context agrees with it.
    fn observe_acceptance(&mut self, context: &[u32]) {
        if self.last_draft.is_empty() || context.len() <= self.draft_at {
            return;
        }
        let seen = &context[self.draft_at..];
        let n = self.last_draft.len().min(seen.len());
        let a = (0..n)
            .take_while(|&j| self.last_draft[j] == seen[j])
            .count();
        // Trials: the accepted positions and the first rejected one, if it was seen.
        let trials = (a + 1).min(n);
        if trials > 0 {
            let r = self.rate.unwrap_or(PRIOR_RATE);
            self.rate = Some(r + 0.25 * (a as f32 / trials as f32 - r));
            self.accepted += a as u32;
            self.trials += trials as u32;
        }
        self.last_draft.clear();
    }

    /// The engine verified the first `k` drafts of the block drafted at context length `at`:
    /// the rest were never verified and are not counted (a block drafted elsewhere, not at
    /// all).
    fn verified(&mut self, at: usize, k: usize) {
        if self.draft_at == at {
            self.last_draft.truncate(k);
        } else {
            self.last_draft.clear();
        }
    }

    /// Log-odds of the running acceptance rate.
    fn rate_logit(&self) -> f32 {
        let r = self.rate.unwrap_or(PRIOR_RATE).clamp(0.01, 0.99);
        (r / (1.0 - r)).ln()
    }

    /// Log-odds of the whole-history acceptance rate, with PRIOR_RATE worth 4 trials.
    fn history_logit(&self) -> f32 {
        let r = (self.accepted as f32 + 4.0 * PRIOR_RATE) / (self.trials as f32 + 4.0);
        let r = r.clamp(0.01, 0.99);
        (r / (1.0 - r)).ln()
    }
}

fn err(e: impl std::fmt::Display) -> SpecError {
    SpecError::Invariant(format!("dspark drafter: {e}"))
}

impl DsparkProposer {
    /// Fails when the drafter's widths do not fit the 8-bit kernels (multiples of 32).
    pub fn new(dr: DsparkDrafter, label: &str) -> crate::Result<Self> {
        let (r, v) = (dr.cfg.rank, dr.cfg.vocab);
        let markov = dr.is_markov();
        let ids = dr.draft_vocab.clone();
        // Vocabulary rows the drafter proposes: the draft vocabulary, or all.
        let rows: Vec<usize> = match &ids {
            Some(ids) => ids.iter().map(|&t| t as usize).collect(),
            None => (0..v).collect(),
        };
        let w2t = if markov {
            dr.markov_w2()?.and_then(|w2| {
                let mut t = vec![0f32; rows.len() * r];
                for (i, row) in w2.chunks_exact(v).enumerate() {
                    for (j, &tok) in rows.iter().enumerate() {
                        t[j * r + i] = row[tok];
                    }
                }
                quantize_q8(&t, rows.len(), r)
            })
        } else {
            None
        };
        let d = dr.cfg.d_model;
        let head_sub = match &ids {
            Some(ids) => {
                let idx = candle_core::Tensor::from_slice(
                    ids.as_slice(),
                    ids.len(),
                    &candle_core::Device::Cpu,
                )?;
                let h: Vec<f32> = dr.head().index_select(&idx, 0)?.flatten_all()?.to_vec1()?;
                let bits = dr.cfg.serve_bits;
                Some(quantize_bits(&h, ids.len(), d, bits).ok_or_else(|| {
                    crate::DrafterError::Invalid(format!(
                        "head width does not fit {bits}-bit blocks"
                    ))
                })?)
            }
            None => None,
        };
        let w1 = match (&dr.w1, markov) {
            (Some(w1), true) => Some(w1.flatten_all()?.to_vec1::<f32>()?),
            _ => None,
        };
        let head = match (&dr.conf_par, dr.parallel_only) {
            (Some(cp), true) => cp,
            _ => &dr.conf,
        };
        let conf_w: Vec<f32> = head.weight().flatten_all()?.to_vec1()?;
        let conf_b = match head.bias() {
            Some(b) => b
                .flatten_all()?
                .to_vec1::<f32>()?
                .first()
                .copied()
                .unwrap_or(0.0),
            None => 0.0,
        };
        let want = dr.cfg.d_model + if w1.is_some() { r } else { 0 };
        if conf_w.len() != want {
            return Err(crate::DrafterError::Invalid(format!(
                "confidence head over {} inputs, expected {want}",
                conf_w.len()
            )));
        }
        let vocab_pos = ids.as_ref().map(|ids| {
            let mut pos = vec![u32::MAX; v];
            for (j, &t) in ids.iter().enumerate() {
                if let Some(p) = pos.get_mut(t as usize) {
                    *p = j as u32;
                }
            }
            pos
        });
        let head_g = dr
            .cfg
            .greedy_calibration
            .as_ref()
            .and_then(|g| g.head.clone())
            .filter(|h| h.w.len() == want);
        let fast = FastDrafter::new(&dr)?;
        let rl = dr.cfg.feature_layers.len() * dr.cfg.d_model;
        let pad = fast
            .context_rows(&vec![0f32; rl], 1)
            .pop()
            .unwrap_or_default();
        Ok(Self {
            w2t,
            w1,
            vocab_ids: ids,
            vocab_pos,
            head_sub,
            copy_log: None,
            head_log: None,
            log_network: false,
            greedy_heads: [head_g.clone(), head_g],
            conf_w,
            conf_b,
            isa: kernels::Isa::detect(),
            stages: [0.0; 5],
            last_catch_up: 0.0,
            fast,
            dr,
            feats: HashMap::new(),
            spare_raw: Vec::new(),
            pad,
            label: label.to_string(),
            target: None,
        })
    }

    /// Computes base logits with the target's own head kernels, and runs the drafter's
    /// matmuls on the target's threads.
    pub fn with_target_head(mut self, target: std::sync::Arc<dspark_runtime::Model>) -> Self {
        self.target = Some(target);
        self
    }

    /// Records every drafted position that had a copy candidate, with what the target then
    /// committed there, into `log` (run without the copy prior to fit it).
    pub fn with_copy_log(mut self, log: Arc<Mutex<Vec<CopySample>>>) -> Self {
        self.copy_log = Some(log);
        self
    }

    /// Records the positions of greedy requests' blocks that the target reached, with the
    /// confidence head's inputs (a copy run's: [`copy_inputs`], marked
    /// [`HeadSample::copy_run`]) and whether it committed the drafted token there, into `log`
    /// (a request's last block is not recorded).
    pub fn with_head_log(mut self, log: Arc<Mutex<Vec<HeadSample>>>) -> Self {
        self.head_log = Some(log);
        self.log_network = true;
        self
    }

    /// [`Self::with_head_log`] for copy runs' positions alone (the copy-run head's fit).
    pub fn with_copy_run_log(mut self, log: Arc<Mutex<Vec<HeadSample>>>) -> Self {
        self.head_log = Some(log);
        self.log_network = false;
        self
    }

    /// Serves greedy requests of fold f (see [`HeadSample::fold`]) with `heads[f]` (while
    /// calibrating: each fold's confidences from a head fitted without its requests, so the
    /// input mix fitted on them sees the head as it does on new prompts).
    pub fn with_fold_heads(mut self, heads: [GreedyHead; 2]) -> Self {
        self.greedy_heads = heads.map(Some);
        self
    }

    /// Drafts a copy run (see [`copy_run`]) for each greedy request of `active` that has one,
    /// into `out`, and removes it from `active`; returns the samples those requests' previous
    /// blocks resolved.
    fn copy_runs_into(
        &mut self,
        reqs: &[ProposeReq<'_>],
        active: &mut Vec<usize>,
        out: &mut [DraftBlock],
    ) -> (Vec<CopySample>, Vec<HeadSample>) {
        let (mut copy_samples, mut head_samples) = (Vec::new(), Vec::new());
        let (runs, head) = (self.dr.cfg.copy_runs(), self.dr.cfg.copy_head());
        if runs.is_empty() {
            return (copy_samples, head_samples);
        }
        let (g, feats, logged) = (self.dr.cfg.gamma, &mut self.feats, self.head_log.is_some());
        active.retain(|&i| {
            let r = &reqs[i];
            if !r.params.is_greedy() || r.params.shapes_logits() {
                return true;
            }
            let (block, inputs) = copy_block_with_inputs(r.context, r.k.min(g), runs, head, logged);
            if block.tokens.is_empty() {
                return true;
            }
            let f = feats.entry(r.id).or_default();
            f.fold(r.context);
            f.resolve_copy(r.context, &mut copy_samples);
            f.resolve_head(r.context, &mut head_samples);
            f.observe_acceptance(r.context);
            f.last_draft = block.tokens.clone();
            f.draft_at = r.context.len();
            if logged {
                f.pending_head = inputs.iter().map(|x| x.to_vec()).enumerate().collect();
                f.pending_copy_run = true;
            }
            out[i] = block;
            false
        });
        (copy_samples, head_samples)
    }

    fn log_samples(&self, copy: Vec<CopySample>, head: Vec<HeadSample>) {
        if let (Some(log), false) = (&self.copy_log, copy.is_empty())
            && let Ok(mut l) = log.lock()
        {
            l.extend(copy);
        }
        if let (Some(log), false) = (&self.head_log, head.is_empty())
            && let Ok(mut l) = log.lock()
        {
            l.extend(head);
        }
    }

    /// `f` on the target's thread pool when there is one.
    fn on_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.target {
            Some(m) => m.install(f),
            None => f(),
        }
    }

    /// Base logits of `rows` rows of d (B·kmax hidden states).
    fn head_logits(&self, h: &[f32], rows: usize) -> specdec::Result<Vec<f32>> {
        match &self.target {
            Some(m) => m.head_logits(h, rows).map_err(err),
            None => {
                let d = self.dr.cfg.d_model;
                let t = candle_core::Tensor::from_slice(h, (rows, d), &candle_core::Device::Cpu)
                    .map_err(err)?;
                t.matmul(&self.dr.head().t().map_err(err)?)
                    .map_err(err)?
                    .flatten_all()
                    .map_err(err)?
                    .to_vec1()
                    .map_err(err)
            }
        }
    }

    fn row_len(&self) -> usize {
        self.dr.cfg.feature_layers.len() * self.dr.cfg.d_model
    }

    /// Computes, for each request in `ids`, the context rows of its window not computed yet
    /// (one batched call for all of them) and drops rows that left the window.
    /// Returns the rows fused, and how many of them were beyond one per request.
    fn fuse_windows(&mut self, ids: &[u64]) -> specdec::Result<(usize, usize)> {
        let (c, rl) = (self.dr.cfg.context, self.row_len());
        let mut todo: Vec<(u64, usize)> = Vec::new(); // (id, rows)
        let mut raw: Vec<f32> = Vec::new();
        for &id in ids {
            let Some(f) = self.feats.get_mut(&id) else {
                continue;
            };
            let n = f.raw0 + f.raw.len() / rl;
            let lo = n.saturating_sub(c).max(f.raw0);
            let have = f.rows.len();
            if f.f0 > lo || f.f0 + have < lo {
                f.rows.clear();
                f.f0 = lo;
            } else if f.f0 < lo {
                f.rows.drain(..lo - f.f0);
                f.f0 = lo;
            }
            let from = f.f0 + f.rows.len();
            if from < n {
                raw.extend_from_slice(&f.raw[(from - f.raw0) * rl..(n - f.raw0) * rl]);
                todo.push((id, n - from));
            }
        }
        if todo.is_empty() {
            return Ok((0, 0));
        }
        let total = raw.len() / rl;
        let extra: usize = todo.iter().map(|t| t.1.saturating_sub(1)).sum();
        let fast = &self.fast;
        let mut rows = self.on_pool(|| fast.context_rows(&raw, total)).into_iter();
        for (id, n) in todo {
            if let Some(f) = self.feats.get_mut(&id) {
                f.rows.extend(rows.by_ref().take(n));
            }
        }
        Ok((total, extra))
    }

    /// Starts `id`'s window over (padded, as for a short request) when its rows stop short of
    /// its anchor's predecessor (position `ctx_len − 2`): features went to other requests
    /// while it decoded (a sentinel that finished leaves its place in a probe to a request
    /// whose rows are from before the back-off), and a window of positions far behind the
    /// anchor drafts from the wrong text, confidently. True when it did.
    fn restart_stale(&mut self, id: u64, ctx_len: usize) -> bool {
        let rl = self.row_len().max(1);
        let end = ctx_len.saturating_sub(1);
        match self.feats.get_mut(&id) {
            Some(f) if f.raw0 + f.raw.len() / rl < end => {
                f.raw.clear();
                f.raw0 = end;
                f.rows.clear();
                f.f0 = end;
                true
            }
            _ => false,
        }
    }

    /// Context window (C rows, padded at the front with the zero row's, when the request is
    /// shorter). [`Self::fuse_windows`] must have run for `id`.
    fn window(&self, id: u64) -> Vec<&CtxRow> {
        let c = self.dr.cfg.context;
        let f = self
            .feats
            .get(&id)
            .map(|f| f.rows.as_slice())
            .unwrap_or(&[]);
        let take = f.len().min(c);
        let mut w: Vec<&CtxRow> = Vec::with_capacity(c);
        w.extend(std::iter::repeat_n(&self.pad, c - take));
        w.extend(&f[f.len() - take..]);
        w
    }
}

impl Proposer for DsparkProposer {
    fn name(&self) -> &str {
        &self.label
    }

    fn feature_layers(&self) -> Vec<usize> {
        self.dr.cfg.feature_layers.clone()
    }

    fn verified(&mut self, id: u64, at: usize, k: usize) {
        if let Some(f) = self.feats.get_mut(&id) {
            f.verified(at, k);
        }
    }

    fn observe(&mut self, id: u64, start: usize, rows: &[f32]) -> specdec::Result<()> {
        let rl = self.row_len();
        if rows.len() % rl != 0 {
            return Err(err(format!(
                "feature rows of {} values, not a multiple of {rl}",
                rows.len()
            )));
        }
        let c = self.dr.cfg.context;
        let spare = &mut self.spare_raw;
        let f = self.feats.entry(id).or_insert_with(|| ReqFeats {
            raw: spare.pop().unwrap_or_default(),
            ..Default::default()
        });
        if start < f.raw0 || start > f.raw0 + f.raw.len() / rl {
            // A rollback below the rows kept (never expected: rollbacks are shorter than the
            // margin), or a gap (positions committed while the engine captured no features,
            // its policy planning no drafting): start over from `start`; the window pads
            // what it lacks, as for a short request.
            f.raw.clear();
            f.raw0 = start;
        }
        // Positions past `start` were rolled back.
        f.raw.truncate((start - f.raw0) * rl);
        f.raw.extend_from_slice(rows);
        // Only the last C positions are ever fused; keep C + RAW_MARGIN (rollbacks stay
        // above), trimmed once C more are held so the shift is paid once every C positions.
        let held = f.raw.len() / rl;
        if held > 2 * c + RAW_MARGIN {
            let drop = held - c - RAW_MARGIN;
            f.raw.drain(..drop * rl);
            f.raw0 += drop;
        }
        let keep = start.saturating_sub(f.f0);
        f.rows.truncate(keep);
        Ok(())
    }

    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> specdec::Result<Vec<DraftBlock>> {
        self.last_catch_up = 0.0;
        let g = self.dr.cfg.gamma;
        let mut active = drafting(reqs);
        let mut out: Vec<DraftBlock> = reqs.iter().map(|_| DraftBlock::default()).collect();
        // Greedy requests whose text repeats itself here take a copy run, and skip the network.
        let (mut copy_samples, mut head_samples) = self.copy_runs_into(reqs, &mut active, &mut out);
        if active.is_empty() {
            self.log_samples(copy_samples, head_samples);
            return Ok(out);
        }
        let (d, v, rank) = (self.dr.cfg.d_model, self.dr.cfg.vocab, self.dr.cfg.rank);
        let ids: Vec<u64> = active.iter().map(|&i| reqs[i].id).collect();
        let stages0 = self.stages;
        let mut t = std::time::Instant::now();
        let mut lap = |stages: &mut [f64; 5], i: usize| {
            let now = std::time::Instant::now();
            stages[i] += (now - t).as_secs_f64();
            t = now;
        };
        let ctx0 = self.stages[0];
        for &i in &active {
            if self.restart_stale(reqs[i].id, reqs[i].context.len()) {
                tracing::debug!(
                    request = reqs[i].id,
                    "context features behind the anchor: window started over"
                );
            }
        }
        let (fused, catch_up_rows) = self.fuse_windows(&ids)?;
        lap(&mut self.stages, 0);
        // In steady state each request brings one new context row; the rest was deferred work.
        self.last_catch_up = if fused > 0 {
            (self.stages[0] - ctx0) * catch_up_rows as f64 / fused as f64
        } else {
            0.0
        };
        // Each request's running acceptance, from how its previous block fared, and its fold.
        let (hist, folds): (Vec<(f32, f32)>, Vec<u8>) = active
            .iter()
            .map(|&i| {
                let f = self.feats.entry(reqs[i].id).or_default();
                let fold = f.fold(reqs[i].context);
                f.resolve_copy(reqs[i].context, &mut copy_samples);
                f.resolve_head(reqs[i].context, &mut head_samples);
                f.observe_acceptance(reqs[i].context);
                ((f.rate_logit(), f.history_logit()), fold)
            })
            .unzip();
        self.log_samples(copy_samples, head_samples);
        let b = active.len();
        let kmax = active.iter().map(|&i| reqs[i].k.min(g)).max().unwrap_or(1);
        let mut anchors = Vec::with_capacity(b);
        let mut embs = Vec::with_capacity(b);
        for &i in &active {
            let a = *reqs[i].context.last().unwrap_or(&0);
            if a as usize >= v {
                return Err(err(format!("anchor token {a} outside the vocabulary")));
            }
            anchors.push(a);
            embs.push(self.dr.embed_row(a).map_err(err)?);
        }
        let windows: Vec<Vec<&CtxRow>> = ids.iter().map(|&id| self.window(id)).collect();
        let fast = &self.fast;
        // B × kmax × d, request-major.
        let h_all: Vec<f32> = self.on_pool(|| {
            let reqs: Vec<(&[&CtxRow], &[f32])> = windows
                .iter()
                .zip(&embs)
                .map(|(w, e)| (w.as_slice(), e.as_slice()))
                .collect();
            fast.hidden_batch(&reqs, kmax)
        });
        drop(windows);
        lap(&mut self.stages, 1);
        // Base logits over the draft vocabulary (nv columns per row).
        let nv = self.vocab_ids.as_ref().map_or(v, |ids| ids.len());
        let base_all = match &self.head_sub {
            Some(hq) => {
                let mut out = vec![0f32; b * kmax * nv];
                let isa = self.isa;
                self.on_pool(|| hq.matmul(&h_all, b * kmax, &mut out, isa));
                out
            }
            None => self.head_logits(&h_all, b * kmax)?,
        };
        lap(&mut self.stages, 2);
        // Positions outside, requests inside: the Markov bias of every request's previous token
        // at position k is one (B × r)·(r × V) product, reading W2 once per position instead of
        // once per request and position.
        let ks: Vec<usize> = active.iter().map(|&i| reqs[i].k.min(g)).collect();
        let mut prev = anchors;
        // Committed and drafted tokens, for penalties only.
        let mut seen: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| {
                if reqs[i].params.shapes_logits() {
                    reqs[i].context.to_vec()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let mut conf: Vec<Vec<f32>> = ks.iter().map(|&k| Vec::with_capacity(k)).collect();
        let mut inputs: Vec<Vec<specdec::proposer::ConfInputs>> =
            ks.iter().map(|&k| Vec::with_capacity(k)).collect();
        let (sts_sampled, sts_greedy) = (
            self.dr.cfg.calibration_for(false),
            self.dr.cfg.calibration_for(true),
        );
        let (copy_sampled, copy_greedy) = (
            self.dr.cfg.copy_bias_for(false).to_vec(),
            self.dr.cfg.copy_bias_for(true).to_vec(),
        );
        // Committed and drafted tokens: what the copy prior searches.
        let mut seqs: Vec<Vec<u32>> = active.iter().map(|&i| reqs[i].context.to_vec()).collect();
        let mut pending: Vec<Vec<PendingCopy>> = active.iter().map(|_| Vec::new()).collect();
        let mut pending_head: Vec<Vec<(usize, Vec<f32>)>> =
            active.iter().map(|_| Vec::new()).collect();
        // Ranks that do not fit 8-bit blocks (tiny test drafters) take W2 in f32: read once per
        // call (it was rebuilt at every drafted position: r × V floats each time).
        let w2_f32 = if self.w1.is_some() && self.w2t.is_none() {
            self.dr.markov_w2().map_err(err)?.unwrap_or_default()
        } else {
            Vec::new()
        };
        for kk in 0..kmax {
            // W1 rows of each request's previous token (B × r).
            let e: Option<Vec<f32>> = self.w1.as_ref().map(|w1| {
                prev.iter()
                    .flat_map(|&t| {
                        w1[t as usize * rank..(t as usize + 1) * rank]
                            .iter()
                            .copied()
                    })
                    .collect()
            });
            let bias: Option<Vec<f32>> = match (&e, &self.w2t) {
                (Some(e), Some(w2t)) => {
                    let mut out = vec![0f32; b * nv];
                    let isa = self.isa;
                    self.on_pool(|| w2t.matmul(e, b, &mut out, isa));
                    Some(out)
                }
                (Some(e), None) => {
                    let mut out = vec![0f32; b * nv];
                    for bi in 0..b {
                        for (i, row) in w2_f32.chunks_exact(v).enumerate() {
                            let x = e[bi * rank + i];
                            let o = &mut out[bi * nv..(bi + 1) * nv];
                            match &self.vocab_ids {
                                Some(ids) => {
                                    for (o, &t) in o.iter_mut().zip(ids) {
                                        *o += x * row[t as usize];
                                    }
                                }
                                None => {
                                    for (o, w) in o.iter_mut().zip(row) {
                                        *o += x * w;
                                    }
                                }
                            }
                        }
                    }
                    Some(out)
                }
                _ => None,
            };
            lap(&mut self.stages, 3);
            // Confidence logits: σ⁻¹ of c_k = w·[h_k; W1[x_{k−1}]] + b, never a function of x_k.
            let z: Vec<f32> = (0..b)
                .map(|bi| {
                    let hk = &h_all[(bi * kmax + kk) * d..(bi * kmax + kk + 1) * d];
                    let mut acc = self.conf_b
                        + self.conf_w[..d]
                            .iter()
                            .zip(hk)
                            .map(|(a, b)| a * b)
                            .sum::<f32>();
                    if let Some(e) = &e {
                        acc += self.conf_w[d..]
                            .iter()
                            .zip(&e[bi * rank..(bi + 1) * rank])
                            .map(|(a, b)| a * b)
                            .sum::<f32>();
                    }
                    acc
                })
                .collect();

            for (bi, &i) in active.iter().enumerate() {
                if kk >= ks[bi] {
                    continue;
                }
                let r = &mut reqs[i];
                let row = (bi * kmax + kk) * nv;
                let mut logits = base_all[row..row + nv].to_vec();
                if let Some(bias) = &bias {
                    for (l, x) in logits.iter_mut().zip(&bias[bi * nv..(bi + 1) * nv]) {
                        *l += x;
                    }
                }
                // The copy prior: the token that followed the longest earlier occurrence of
                // the committed-and-drafted suffix gets a bonus fitted per match length.
                let cand =
                    suffix_match(&seqs[bi], COPY_MAX_MATCH, COPY_WINDOW).and_then(|(len, c)| {
                        let j = match &self.vocab_pos {
                            Some(pos) => *pos.get(c as usize)?,
                            None => c,
                        } as usize;
                        (j < nv).then_some((len, c, j))
                    });
                if let Some((len, c, j)) = cand {
                    if self.copy_log.is_some() {
                        let top = argmax(&logits) as usize;
                        // log softmax of the top logit, so q_c = e^(l_c − l_top + that).
                        let (log_top, _) = kernels::ops::logit_stats(&logits);
                        let gap = logits[top] - logits[j];
                        pending[bi].push(PendingCopy {
                            k: kk,
                            len,
                            cand: c,
                            top: self.vocab_ids.as_ref().map_or(top as u32, |ids| ids[top]),
                            gap,
                            q_c: (log_top - gap).exp(),
                        });
                    }
                    let cb = if r.params.is_greedy() {
                        &copy_greedy
                    } else {
                        &copy_sampled
                    };
                    if let Some(&b) = cb.get(len.min(cb.len()).saturating_sub(1)) {
                        logits[j] += b;
                    }
                }
                // The top token (read once: the copy evidence and greedy drafting both use it).
                let top = (cand.is_some() || r.params.is_greedy()).then(|| argmax(&logits));
                // Copy evidence: the match length when its candidate is the top token.
                let copy_ev = match (cand, top) {
                    (Some((len, _, j)), Some(t)) if t as usize == j => len as f32,
                    _ => 0.0,
                };
                // How sure the drafter is of position kk: its distribution before x_kk is
                // drawn (a function of x_1..x_{kk−1} only, like the head's logit).
                let (lmax, ent) = kernels::ops::logit_stats(&logits);
                // Log-odds of the top probability: greedy acceptance is roughly that
                // probability, so on the logistic's scale it is its log-odds.
                let odds = lmax - (-lmax.exp_m1()).max(1e-12).ln();
                // Greedy requests: their own head's logit, when the calibration has one.
                let hk = &h_all[(bi * kmax + kk) * d..(bi * kmax + kk + 1) * d];
                let ek = e.as_ref().map(|e| &e[bi * rank..(bi + 1) * rank]);
                let zk = match &self.greedy_heads[folds[bi] as usize] {
                    Some(h) if r.params.is_greedy() => h.logit(hk, ek, kk).unwrap_or(z[bi]),
                    _ => z[bi],
                };
                if self.log_network && self.head_log.is_some() && r.params.is_greedy() {
                    let mut x = hk.to_vec();
                    x.extend_from_slice(ek.unwrap_or(&[]));
                    pending_head[bi].push((kk, x));
                }
                let x = [
                    zk,
                    if odds.is_finite() {
                        odds.clamp(-30.0, 30.0)
                    } else {
                        -30.0
                    },
                    if ent.is_finite() { ent } else { 30.0 },
                    hist[bi].0,
                    hist[bi].1,
                    copy_ev,
                ];
                let sts = if r.params.is_greedy() {
                    &sts_greedy
                } else {
                    &sts_sampled
                };
                conf[bi].push(sts.conf(kk, &x) as f32);
                inputs[bi].push(x);
                let (tok, dist) = match &self.vocab_ids {
                    // Without penalties the draft vocabulary is all there is to look at: q is
                    // 0 outside it, and q travels as (token, probability) pairs.
                    Some(ids) if !r.params.shapes_logits() => {
                        if r.params.is_greedy() {
                            let t = top.unwrap_or_else(|| argmax(&logits));
                            (ids[t as usize], Dist::OneHot)
                        } else {
                            let p = probs(&logits, &[], r.params);
                            let j = sample(&p, r.rng) as usize;
                            let mut q: Vec<(u32, f32)> = Vec::with_capacity(p.len());
                            q.extend(
                                ids.iter()
                                    .zip(&p)
                                    .filter(|(_, v)| **v > 0.0)
                                    .map(|(&t, &v)| (t, v)),
                            );
                            (ids[j], Dist::Sparse(q))
                        }
                    }
                    // Penalties see ordinary token ids: over the whole vocabulary (tokens
                    // outside the draft vocabulary: q = 0).
                    _ => {
                        let logits = match &self.vocab_ids {
                            Some(ids) => {
                                let mut full = vec![f32::NEG_INFINITY; v];
                                for (&t, &l) in ids.iter().zip(&logits) {
                                    full[t as usize] = l;
                                }
                                full
                            }
                            None => logits,
                        };
                        let p = probs(&logits, &seen[bi], r.params);
                        if r.params.is_greedy() {
                            (argmax(&p), Dist::OneHot)
                        } else {
                            (sample(&p, r.rng), Dist::Dense(p))
                        }
                    }
                };
                out[i].tokens.push(tok);
                out[i].dists.push(dist);
                seen[bi].push(tok);
                seqs[bi].push(tok);
                prev[bi] = tok;
            }
            lap(&mut self.stages, 4);
        }
        for (bi, &i) in active.iter().enumerate() {
            out[i].confidence = Some(std::mem::take(&mut conf[bi]));
            out[i].conf_inputs = Some(std::mem::take(&mut inputs[bi]));
            if let Some(f) = self.feats.get_mut(&reqs[i].id) {
                f.last_draft = out[i].tokens.clone();
                f.draft_at = reqs[i].context.len();
                f.pending_copy = std::mem::take(&mut pending[bi]);
                f.pending_head = std::mem::take(&mut pending_head[bi]);
                f.pending_copy_run = false;
            }
        }
        let d = |i: usize| self.stages[i] - stages0[i];
        tracing::trace!(
            requests = b,
            k = kmax,
            context_s = d(0),
            block_s = d(1),
            head_s = d(2),
            markov_s = d(3),
            sampling_s = d(4),
            "drafted"
        );
        Ok(out)
    }

    fn stage_seconds(&self) -> Vec<(&'static str, f64)> {
        STAGES.iter().copied().zip(self.stages).collect()
    }

    fn last_catch_up_seconds(&self) -> f64 {
        self.last_catch_up
    }

    fn max_gamma(&self) -> Option<usize> {
        Some(self.dr.cfg.gamma)
    }

    /// The context window: a block conditions on the features of the last C positions.
    fn feature_window(&self) -> usize {
        self.dr.cfg.context
    }

    fn context_rows(&self) -> usize {
        self.dr.cfg.context
    }

    fn finish(&mut self, id: u64) {
        if let Some(mut f) = self.feats.remove(&id)
            && self.spare_raw.len() < MAX_SPARE_RAW
        {
            f.raw.clear();
            self.spare_raw.push(f.raw);
        }
    }

    fn has_free_drafts(&self) -> bool {
        !self.dr.cfg.copy_runs().is_empty()
    }

    fn copy_runs(&self) -> Vec<f32> {
        self.dr.cfg.copy_runs().to_vec()
    }

    fn copy_head(&self) -> Vec<f32> {
        self.dr
            .cfg
            .copy_head()
            .map(GreedyHead::flat)
            .unwrap_or_default()
    }

    fn propose_free(&mut self, reqs: &mut [ProposeReq<'_>]) -> specdec::Result<Vec<DraftBlock>> {
        let mut active = drafting(reqs);
        let mut out: Vec<DraftBlock> = reqs.iter().map(|_| DraftBlock::default()).collect();
        let (copy_samples, head_samples) = self.copy_runs_into(reqs, &mut active, &mut out);
        self.log_samples(copy_samples, head_samples);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One block of `k` tokens for request 1 at `temperature`, drafted with RNG `seed`.
    fn block_at(
        p: &mut DsparkProposer,
        ctx: &[u32],
        k: usize,
        temperature: f32,
        seed: u64,
    ) -> DraftBlock {
        let params = kernels::sampling::SamplingParams {
            temperature,
            ..kernels::sampling::SamplingParams::greedy()
        };
        let mut r = kernels::rng::Rng::new(seed);
        let mut reqs = [ProposeReq {
            id: 1,
            context: ctx,
            k,
            params: &params,
            rng: &mut r,
        }];
        p.propose(&mut reqs).unwrap().remove(0)
    }

    /// One sampled (T = 1) block of `k` tokens for request 1, drafted with RNG `seed`.
    fn sampled_block(p: &mut DsparkProposer, ctx: &[u32], k: usize, seed: u64) -> DraftBlock {
        block_at(p, ctx, k, 1.0, seed)
    }

    /// One greedy block of `k` tokens for request 1.
    fn greedy_block(p: &mut DsparkProposer, ctx: &[u32], k: usize) -> DraftBlock {
        block_at(p, ctx, k, 0.0, 0)
    }

    #[test]
    fn the_copy_prior_drafts_what_followed_the_suffix_last_time() {
        let (m, tok) = crate::model::tests::tiny_target(22, "drafter-target");
        let rl = 2 * m.cfg.d_model;
        let mut rng = kernels::rng::Rng::new(4);
        let rows: Vec<f32> = (0..7 * rl).map(|_| rng.normal() as f32).collect();
        // 5 9 2 7 5 9 2 → a repeat continues 7 5 9 2 …
        let ctx: Vec<u32> = vec![5, 9, 2, 7, 5, 9, 2];
        let draft = |bias: Vec<f32>, greedy_bias: Option<Vec<f32>>| {
            let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
            dr.cfg.copy_bias = bias;
            if let Some(b) = greedy_bias {
                let mut c = dr.cfg.sampled_calibration();
                c.copy_bias = b;
                dr.cfg.greedy_calibration = Some(c);
            }
            dr.cfg.validate().unwrap();
            let mut p = DsparkProposer::new(dr, "t").unwrap();
            p.observe(1, 0, &rows).unwrap();
            greedy_block(&mut p, &ctx, 4)
        };
        let plain = draft(Vec::new(), None);
        assert_ne!(
            plain.tokens,
            vec![7, 5, 9, 2],
            "the untrained drafter alone"
        );
        let copied = draft(vec![100.0; 3], None);
        assert_eq!(copied.tokens, vec![7, 5, 9, 2]);
        // Each position's copy evidence is its match length (3 and more: the suffix grows).
        let ev: Vec<f32> = copied.conf_inputs.unwrap().iter().map(|x| x[5]).collect();
        assert!(ev.iter().all(|&e| e >= 3.0), "{ev:?}");
        // Greedy requests use the greedy calibration's prior when it has one.
        assert_eq!(draft(vec![100.0; 3], Some(Vec::new())).tokens, plain.tokens);
        assert_eq!(
            draft(Vec::new(), Some(vec![100.0; 3])).tokens,
            vec![7, 5, 9, 2]
        );
        // A negative or non-finite bias is refused.
        let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        dr.cfg.copy_bias = vec![-1.0];
        assert!(dr.cfg.validate().is_err());
        dr.cfg.copy_bias = vec![f32::NAN];
        assert!(dr.cfg.validate().is_err());
    }

    #[test]
    fn greedy_copy_runs_skip_the_network_and_carry_their_fitted_rates() {
        // 5 9 2 7 5 9 2 → the repeat continues 7 5 9 2 …, with match lengths 3, 4, 5, 6.
        let ctx: Vec<u32> = vec![5, 9, 2, 7, 5, 9, 2];
        let runs = [0.2, 0.55, 0.6, 0.7, 0.8, 0.9];
        let (toks, conf, inputs) = copy_run(&ctx, 4, &runs, None, true);
        assert_eq!((toks, conf), (vec![7, 5, 9, 2], vec![0.6, 0.7, 0.8, 0.9]));
        assert_eq!(inputs.len(), 4);
        assert_eq!(copy_run(&ctx, 2, &runs, None, false).0, vec![7, 5]);
        // A run starts only where its rate reaches COPY_RUN_MIN, and stops where it falls.
        assert!(
            copy_run(&ctx, 4, &[0.2, 0.55, 0.45], None, false)
                .0
                .is_empty()
        );
        assert_eq!(
            copy_run(&ctx, 4, &[0.2, 0.55, 0.6, 0.3], None, false).0,
            vec![7],
            "the second position has a 4-token match"
        );
        assert!(
            copy_run(&[1, 2, 3], 4, &runs, None, false).0.is_empty(),
            "no repeat"
        );
        assert!(copy_run(&ctx, 4, &[], None, false).0.is_empty());

        let (m, tok) = crate::model::tests::tiny_target(22, "drafter-target");
        let rl = 2 * m.cfg.d_model;
        let mut rng = kernels::rng::Rng::new(4);
        let rows: Vec<f32> = (0..7 * rl).map(|_| rng.normal() as f32).collect();
        let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let mut c = dr.cfg.sampled_calibration();
        c.copy_runs = runs.to_vec();
        dr.cfg.greedy_calibration = Some(c);
        dr.cfg.validate().unwrap();
        let mut p = DsparkProposer::new(dr, "t").unwrap();
        p.observe(1, 0, &rows).unwrap();
        let b = greedy_block(&mut p, &ctx, 4);
        assert_eq!(b.tokens, vec![7, 5, 9, 2]);
        assert_eq!(b.confidence, Some(vec![0.6, 0.7, 0.8, 0.9]));
        assert!(b.dists.iter().all(|d| matches!(d, Dist::OneHot)));
        assert!(
            p.stage_seconds().iter().all(|s| s.1 == 0.0),
            "the network did not run"
        );
        // Sampled requests draft through the network (a copy is no sample of q).
        let s = block_at(&mut p, &ctx, 4, 1.0, 3);
        assert!(s.conf_inputs.is_some_and(|v| v.len() == 4));
        assert!(p.stage_seconds().iter().any(|s| s.1 > 0.0));
        // Rates outside [0, 1] are refused.
        let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let mut c = dr.cfg.sampled_calibration();
        c.copy_runs = vec![1.5];
        dr.cfg.greedy_calibration = Some(c.clone());
        assert!(dr.cfg.validate().is_err());
        c.copy_runs = vec![f32::NAN];
        dr.cfg.greedy_calibration = Some(c);
        assert!(dr.cfg.validate().is_err());
        // Without the copy prior there are no copy runs either.
        assert!(dr.cfg.without_copy().copy_runs().is_empty());
    }

    #[test]
    fn the_copy_log_records_candidates_with_what_was_committed() {
        let (m, tok) = crate::model::tests::tiny_target(22, "drafter-target");
        let rl = 2 * m.cfg.d_model;
        let mut rng = kernels::rng::Rng::new(4);
        let rows: Vec<f32> = (0..9 * rl).map(|_| rng.normal() as f32).collect();
        let dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut p = DsparkProposer::new(dr, "t")
            .unwrap()
            .with_copy_log(log.clone());
        p.observe(1, 0, &rows[..7 * rl]).unwrap();
        let ctx: Vec<u32> = vec![5, 9, 2, 7, 5, 9, 2];
        let b = greedy_block(&mut p, &ctx, 3);
        assert!(log.lock().unwrap().is_empty(), "nothing committed yet");
        // The target commits the first drafted token and then the copy candidate 5 at
        // position 2: position 1 (candidate 7) and position 2 were reached, position 3 not.
        let mut next = ctx.clone();
        next.push(b.tokens[0]);
        next.push(5);
        p.observe(1, 7, &rows[7 * rl..]).unwrap();
        greedy_block(&mut p, &next, 1);
        let got = log.lock().unwrap().clone();
        assert!(!got.is_empty() && got.len() <= 2, "{got:?}");
        let first = got.iter().find(|s| s.k == 0).unwrap();
        assert_eq!(first.len, 3);
        assert_eq!(first.hit_c, b.tokens[0] == 7);
        assert!(
            first.hit_top,
            "greedy: the drafter's top token is what it drafted"
        );
        assert!(first.gap >= 0.0 && first.q_c > 0.0 && first.q_c <= 1.0);
        if let Some(second) = got.iter().find(|s| s.k == 1) {
            assert_eq!(second.hit_top, b.tokens[1] == 5);
        }
        assert!(got.iter().all(|s| s.k < 2));
    }

    /// Copy runs' inputs on hand-worked sequences (a fork and a formula); a head's confidence
    /// at each position from the inputs of the prefix; the proposer serves the stored head and
    /// the head log records copy-run positions apart.
    #[test]
    fn copy_run_confidences_read_the_copy_head_over_inputs_of_the_prefix() {
        let runs = [0.2, 0.55, 0.6, 0.7, 0.8, 0.9];
        // "1 2 3" went on once with 4, once with 5: a fork. Its most recent occurrence (ending
        // at 6) matches 3 tokens back.
        let fork: Vec<u32> = vec![1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3];
        let x = copy_inputs(&fork, 3, 6, None, &runs);
        let close = |a: f32, b: f32| (a - b).abs() < 1e-5;
        assert!(close(x[0], (0.6f32 / 0.4).ln()), "{x:?}");
        assert!(close(x[1], 4f32.ln()) && close(x[2], x[1]), "{x:?}");
        assert!(close(x[3], 0.0) && close(x[4], 3f32.ln()), "{x:?}");
        // "1 2 3" went on with 5 both times: a formula, matched 7 tokens back.
        let formula: Vec<u32> = vec![1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 3];
        let y = copy_inputs(&formula, 3, 6, Some(1.0), &runs);
        assert!(close(y[1], 8f32.ln()) && close(y[2], 1.0), "{y:?}");
        assert!(close(y[3], 5f32.ln()) && close(y[4], 3f32.ln()), "{y:?}");

        // A head on the agreement alone ranks the formula above the fork, position by position.
        let head = GreedyHead {
            w: vec![0.0, 0.0, 0.0, 1.0, 0.0],
            bias: vec![0.0, -1.0, 0.0, 0.0],
        };
        let (ft, fc, fx) = copy_run(&fork, 1, &runs, Some(&head), false);
        assert_eq!(ft, vec![5]);
        assert!(close(fc[0], 0.5) && fx[0] == x, "{fc:?}");
        let (tt, tc, _) = copy_run(&formula, 2, &runs, Some(&head), false);
        assert_eq!(tt, vec![5, 1]);
        assert!(close(tc[0], 5.0 / 6.0), "{tc:?}");
        // Position 1 takes its own bias; its inputs are those of the prefix with the first copy.
        let mut seq = formula.clone();
        seq.push(5);
        let (len, src) = suffix_match_at(&seq, COPY_MAX_MATCH, COPY_WINDOW).unwrap();
        let x1 = copy_inputs(&seq, len, src, Some(8f32.ln()), &runs);
        let z1 = x1[3] - 1.0;
        assert!(close(tc[1], 1.0 / (1.0 + (-z1).exp())), "{tc:?} {x1:?}");
        // Without a head the rates serve, as before (a 6-token match here).
        assert_eq!(copy_run(&formula, 1, &runs, None, false).1, vec![0.9]);

        // The proposer serves the stored head, and logs copy-run positions with their inputs.
        let (m, tok) = crate::model::tests::tiny_target(22, "drafter-target");
        let rl = 2 * m.cfg.d_model;
        let mut rng = kernels::rng::Rng::new(4);
        let rows: Vec<f32> = (0..13 * rl).map(|_| rng.normal() as f32).collect();
        let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let mut c = dr.cfg.sampled_calibration();
        c.copy_runs = runs.to_vec();
        c.copy_head = Some(GreedyHead {
            w: head.w.clone(),
            bias: vec![0.0; 4],
        });
        dr.cfg.greedy_calibration = Some(c.clone());
        dr.cfg.validate().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut p = DsparkProposer::new(dr, "t")
            .unwrap()
            .with_copy_run_log(log.clone());
        p.observe(1, 0, &rows[..11 * rl]).unwrap();
        let b = greedy_block(&mut p, &formula, 2);
        assert_eq!(b.tokens, vec![5, 1]);
        assert!(close(b.confidence.as_ref().unwrap()[0], 5.0 / 6.0), "{b:?}");
        // The target commits the first copied token and another than the second.
        let mut next = formula.clone();
        next.extend([5, 7]);
        p.observe(1, 11, &rows[11 * rl..]).unwrap();
        greedy_block(&mut p, &next, 2);
        let got = log.lock().unwrap().clone();
        let ks: Vec<(usize, bool, bool)> = got.iter().map(|s| (s.k, s.hit, s.copy_run)).collect();
        assert_eq!(ks, vec![(0, true, true), (1, false, true)]);
        assert!(got.iter().all(|s| s.x.len() == COPY_HEAD_INPUTS));
        // A head fitted over another input set is refused, though of the same width; its own
        // tag and an untagged one ("copy-v1") are taken. Loading drops such a head, so that
        // the rates serve and calibrate-drafter can refit it.
        let dr_with = |c: crate::model::CalibrationCfg| {
            let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
            dr.cfg.greedy_calibration = Some(c);
            dr.cfg.validate()
        };
        for (tag, ok) in [
            (None, true),
            (Some(COPY_HEAD_SPEC), true),
            (Some("copy-v0"), false),
        ] {
            c.copy_head_inputs = tag.map(str::to_string);
            dr_with(c.clone()).map_or_else(
                |e| assert!(!ok && e.to_string().contains("copy-v0"), "{e}"),
                |_| assert!(ok, "{tag:?} taken"),
            );
            let mut cfg = crate::model::tests::tiny_drafter(&m, &tok, 6, 5).cfg;
            cfg.greedy_calibration = Some(c.clone());
            assert_eq!(cfg.drop_foreign_copy_head().is_some(), !ok, "{tag:?}");
            assert_eq!(cfg.copy_head().is_some(), ok, "{tag:?}");
            cfg.validate().unwrap();
        }
        // A head of another width is refused.
        c.copy_head_inputs = None;
        c.copy_head = Some(GreedyHead {
            w: vec![0.0; 4],
            bias: vec![0.0; 4],
        });
        assert!(dr_with(c).is_err());
    }

    /// Greedy requests read their own head's logit when the calibration has one (sampled ones
    /// the trained head's); while calibrating each fold reads its own head; the head log
    /// records each reached position with the head's inputs and whether it was committed.
    #[test]
    fn greedy_requests_read_the_greedy_head_and_the_log_records_its_inputs() {
        let (m, tok) = crate::model::tests::tiny_target(22, "drafter-target");
        let rl = 2 * m.cfg.d_model;
        let width = m.cfg.d_model + 16;
        let mut rng = kernels::rng::Rng::new(4);
        let rows: Vec<f32> = (0..9 * rl).map(|_| rng.normal() as f32).collect();
        let head = |b: f32| GreedyHead {
            w: vec![0.0; width],
            bias: (0..4).map(|k| b + k as f32).collect(),
        };
        let drafter = || {
            let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
            let mut c = dr.cfg.sampled_calibration();
            c.head = Some(head(10.0));
            dr.cfg.greedy_calibration = Some(c);
            dr.cfg.validate().unwrap();
            dr
        };
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut p = DsparkProposer::new(drafter(), "t")
            .unwrap()
            .with_head_log(log.clone());
        p.observe(1, 0, &rows[..7 * rl]).unwrap();
        let ctx: Vec<u32> = vec![5, 9, 2, 7, 3, 8, 1];
        let z = |b: &DraftBlock| -> Vec<f32> {
            b.conf_inputs
                .as_ref()
                .unwrap()
                .iter()
                .map(|x| x[0])
                .collect()
        };
        let b = greedy_block(&mut p, &ctx, 4);
        assert_eq!(z(&b), vec![10.0, 11.0, 12.0, 13.0]);
        assert!(log.lock().unwrap().is_empty(), "nothing committed yet");
        // The target commits the first drafted token, then another than the second.
        let mut next = ctx.clone();
        next.push(b.tokens[0]);
        next.push(if b.tokens[1] == 4 { 6 } else { 4 });
        p.observe(1, 7, &rows[7 * rl..]).unwrap();
        let s = sampled_block(&mut p, &next, 4, 3);
        assert!(
            z(&s).iter().zip([10.0, 11.0]).all(|(a, b)| *a != b),
            "sampled requests keep the trained head: {:?}",
            z(&s)
        );
        let got = log.lock().unwrap().clone();
        let ks: Vec<(usize, bool)> = got.iter().map(|s| (s.k, s.hit)).collect();
        assert_eq!(ks, vec![(0, true), (1, false)]);
        assert!(
            got.iter()
                .all(|s| s.x.len() == width && s.fold == got[0].fold)
        );
        // A copy-run log leaves the network's positions out.
        let copy_log = Arc::new(Mutex::new(Vec::new()));
        let mut p = DsparkProposer::new(drafter(), "t")
            .unwrap()
            .with_copy_run_log(copy_log.clone());
        p.observe(1, 0, &rows[..7 * rl]).unwrap();
        assert_eq!(greedy_block(&mut p, &ctx, 4).tokens, b.tokens);
        p.observe(1, 7, &rows[7 * rl..]).unwrap();
        greedy_block(&mut p, &next, 4);
        assert!(copy_log.lock().unwrap().is_empty());

        // Fold heads: each request reads its fold's.
        let mut p = DsparkProposer::new(drafter(), "t")
            .unwrap()
            .with_fold_heads([head(10.0), head(20.0)]);
        let params = kernels::sampling::SamplingParams::greedy();
        let ctxs: Vec<Vec<u32>> = (0..8u32).map(|i| vec![5, 9, 2, 7, 3, 8, i + 1]).collect();
        for id in 0..8u64 {
            p.observe(id, 0, &rows[..7 * rl]).unwrap();
        }
        let mut rngs: Vec<kernels::rng::Rng> = (0..8).map(kernels::rng::Rng::new).collect();
        let mut reqs: Vec<ProposeReq<'_>> = ctxs
            .iter()
            .zip(rngs.iter_mut())
            .enumerate()
            .map(|(i, (c, r))| ProposeReq {
                id: i as u64,
                context: c,
                k: 2,
                params: &params,
                rng: r,
            })
            .collect();
        let firsts: std::collections::BTreeSet<i32> = p
            .propose(&mut reqs)
            .unwrap()
            .iter()
            .map(|b| z(b)[0] as i32)
            .collect();
        assert_eq!(firsts, [10, 20].into());
    }

    #[test]
    fn the_running_acceptance_follows_what_was_committed() {
        let mut f = ReqFeats {
            last_draft: vec![5, 6, 7],
            draft_at: 2,
            ..Default::default()
        };
        // Nothing committed since the draft: nothing learnt.
        f.observe_acceptance(&[1, 2]);
        assert_eq!(f.rate, None);
        // Two of three accepted, the third replaced by the target's token.
        f.observe_acceptance(&[1, 2, 5, 6, 9]);
        let want = PRIOR_RATE + 0.25 * (2.0 / 3.0 - PRIOR_RATE);
        assert!((f.rate.unwrap() - want).abs() < 1e-6);
        assert!(f.last_draft.is_empty(), "a block is counted once");
        // A block rejected at its first token pulls the rate down.
        f.last_draft = vec![4, 4];
        f.draft_at = 5;
        f.observe_acceptance(&[1, 2, 5, 6, 9, 8]);
        assert!(f.rate.unwrap() < want);
        assert!(f.rate_logit() < 0.0);
        // The whole history: 2 of 3, then 0 of 1, with the prior worth 4 trials at PRIOR_RATE.
        assert_eq!((f.accepted, f.trials), (2, 4));
        let r = (2.0 + 4.0 * PRIOR_RATE) / 8.0;
        assert!((f.history_logit() - (r / (1.0 - r)).ln()).abs() < 1e-6);
    }

    /// Drafts a verify policy trimmed were never verified: they count neither as accepted nor
    /// as rejected (a sampled request's next token matches one only by chance).
    #[test]
    fn trimmed_drafts_are_no_trials() {
        let mut f = ReqFeats {
            last_draft: vec![5, 6, 7],
            draft_at: 2,
            ..Default::default()
        };
        // One of three verified, and accepted; the target's next token, 9, stood where the
        // second draft (never verified) was.
        f.verified(2, 1);
        f.observe_acceptance(&[1, 2, 5, 9]);
        assert_eq!((f.accepted, f.trials), (1, 1));
        let want = PRIOR_RATE + 0.25 * (1.0 - PRIOR_RATE);
        assert!((f.rate.unwrap() - want).abs() < 1e-6);
        // A block trimmed to nothing: no trial at all.
        f.last_draft = vec![4, 4];
        f.draft_at = 4;
        f.verified(4, 0);
        f.observe_acceptance(&[1, 2, 5, 9, 8]);
        assert_eq!((f.accepted, f.trials), (1, 1));
        assert!((f.rate.unwrap() - want).abs() < 1e-6);
        // A verdict for another block than the one held: nothing is counted.
        f.last_draft = vec![3];
        f.draft_at = 5;
        f.verified(6, 1);
        f.observe_acceptance(&[1, 2, 5, 9, 8, 3]);
        assert_eq!((f.accepted, f.trials), (1, 1));
        // Without a verdict (all verified), as before: 2 of 2 more.
        f.last_draft = vec![3, 3];
        f.draft_at = 6;
        f.observe_acceptance(&[1, 2, 5, 9, 8, 3, 3, 3, 7]);
        assert_eq!((f.accepted, f.trials), (3, 3));
    }

    #[test]
    fn a_finished_request_leaves_its_feature_buffer_to_the_next_one() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        let dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let rl = 2 * m.cfg.d_model;
        let mut p = DsparkProposer::new(dr, "t").unwrap();
        p.observe(1, 0, &vec![0.5; 10 * rl]).unwrap();
        let cap = p.feats[&1].raw.capacity();
        assert!(cap >= 10 * rl);
        p.finish(1);
        assert!(!p.feats.contains_key(&1));
        p.observe(2, 0, &vec![0.25; rl]).unwrap();
        let f = &p.feats[&2];
        assert_eq!(f.raw.capacity(), cap, "the buffer is reused");
        assert_eq!(
            f.raw,
            vec![0.25; rl],
            "and holds only the new request's rows"
        );
        assert_eq!(f.raw0, 0);
    }

    #[test]
    fn the_context_window_follows_commits_and_rollbacks() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        let dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let rl = 2 * m.cfg.d_model;
        let mut p = DsparkProposer::new(dr, "t").unwrap();
        let mut rng = kernels::rng::Rng::new(9);
        let mut row = || -> Vec<f32> { (0..rl).map(|_| rng.normal() as f32 * 2.0).collect() };
        // What the window must be: the last C raw rows (zero rows in front), in one batch.
        let expect = |p: &DsparkProposer, raw: &[f32]| -> Vec<CtxRow> {
            let c = p.dr.cfg.context;
            let n = raw.len() / rl;
            let mut w = vec![0f32; c * rl];
            let take = n.min(c);
            w[(c - take) * rl..].copy_from_slice(&raw[(n - take) * rl..]);
            p.fast.context_rows(&w, c)
        };
        let mut raw: Vec<f32> = Vec::new();
        // (rows committed from `start`, how many) — appends, a rollback into the computed part,
        // a window that slides past old rows, a long stretch without drafting.
        // Then a request long past two windows and the margin (the raw rows kept are trimmed), with
        // a rollback just after a trim.
        let plan: [(Option<usize>, usize, bool); 11] = [
            (None, 3, true),
            (None, 1, true),
            (Some(2), 2, true),
            (None, 5, true),
            (Some(7), 1, false),
            (None, 9, false),
            (Some(12), 2, true),
            (None, 13, false),
            (None, 2, true),
            (Some(27), 3, true),
            (None, 30, true),
        ];
        for (step, &(start, n, draft)) in plan.iter().enumerate() {
            let start = start.unwrap_or(raw.len() / rl);
            raw.truncate(start * rl);
            let rows: Vec<f32> = (0..n).flat_map(|_| row()).collect();
            raw.extend_from_slice(&rows);
            p.observe(1, start, &rows).unwrap();
            if draft {
                let (fused, extra) = p.fuse_windows(&[1]).unwrap();
                // One request: every row past its first was deferred work.
                assert_eq!(extra, fused.saturating_sub(1), "step {step}");
                if step == 1 {
                    assert_eq!((fused, extra), (1, 0), "one new row: steady state");
                }
                let got = p.window(1);
                let want = expect(&p, &raw);
                assert_eq!(got.len(), want.len());
                let mut worst = 0f32;
                for (a, b) in got.iter().zip(&want) {
                    for (x, y) in a.fused.iter().chain(&a.kv).zip(b.fused.iter().chain(&b.kv)) {
                        worst = worst.max((x - y).abs());
                    }
                }
                assert!(worst < 1e-4, "step {step}: worst {worst}");
                let f = &p.feats[&1];
                assert!(f.rows.len() <= 6, "rows stay within the window");
                assert!(
                    f.raw.len() / rl <= 2 * 6 + RAW_MARGIN,
                    "step {step}: {} raw rows kept",
                    f.raw.len() / rl
                );
                assert_eq!(f.raw0 + f.raw.len() / rl, raw.len() / rl, "step {step}");
            }
        }
        // Rows up to the anchor's predecessor are current; rows that stop short of it (the
        // request decoded while features went elsewhere) start the window over, padded.
        let n = raw.len() / rl;
        assert!(!p.restart_stale(1, n + 1), "current");
        assert!(p.restart_stale(1, n + 40), "40 positions behind");
        p.fuse_windows(&[1]).unwrap();
        let w = p.window(1);
        let pad = expect(&p, &[]);
        let worst = w
            .iter()
            .zip(&pad)
            .flat_map(|(a, b)| a.fused.iter().zip(&b.fused).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "the stale rows are gone: {worst}");
    }

    #[test]
    fn catch_up_on_deferred_context_is_reported_apart_from_drafting() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-catch-up");
        let dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let rl = 2 * m.cfg.d_model;
        let mut p = DsparkProposer::new(dr, "t").unwrap();
        let rows: Vec<f32> = (0..5 * rl).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        p.observe(1, 0, &rows).unwrap();
        let ctx: Vec<u32> = (1..=5).collect();
        sampled_block(&mut p, &ctx, 2, 1);
        assert!(
            p.last_catch_up_seconds() > 0.0,
            "four of five rows were deferred"
        );
        p.observe(1, 5, &rows[..rl]).unwrap();
        let ctx: Vec<u32> = (1..=6).collect();
        sampled_block(&mut p, &ctx, 2, 2);
        assert_eq!(p.last_catch_up_seconds(), 0.0, "one new row: steady state");
    }

    #[test]
    fn served_confidence_at_k_never_depends_on_the_drawn_token_at_k() {
        // At temperature 1 different drafting RNGs draw different tokens. The confidence of
        // position k (head logit and draft-distribution inputs, mixed) must agree between two
        // runs wherever x_1..x_{k−1} agree, whatever x_k was drawn.
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        dr.cfg.conf_mix = vec![[0.7, 1.3, -0.4, 0.5, 0.3, 0.4, 0.2]; dr.cfg.gamma];
        // The copy prior too: its candidates follow the drafted prefix, never x_k.
        dr.cfg.copy_bias = vec![0.5, 1.0, 2.0];
        let g = dr.cfg.gamma;
        let rl = 2 * m.cfg.d_model;
        let mut p = DsparkProposer::new(dr, "t").unwrap();
        let mut rng = kernels::rng::Rng::new(3);
        let rows: Vec<f32> = (0..5 * rl).map(|_| rng.normal() as f32).collect();
        p.observe(1, 0, &rows).unwrap();
        let ctx: Vec<u32> = vec![3, 8, 13, 3, 8];
        let mut runs = Vec::new();
        for seed in 0..24 {
            let b = sampled_block(&mut p, &ctx, g, seed);
            let inputs = b.conf_inputs.clone().unwrap();
            assert_eq!(inputs.len(), g);
            runs.push((b.tokens, b.confidence.unwrap(), inputs));
        }
        let mut differing = 0;
        for a in &runs {
            for b in &runs {
                for k in 0..g {
                    if a.0[..k] == b.0[..k] {
                        assert_eq!(a.1[k], b.1[k], "position {k}");
                        assert_eq!(a.2[k], b.2[k], "position {k}");
                        differing += (a.0[k] != b.0[k]) as usize;
                    }
                }
            }
        }
        assert!(
            differing > 0,
            "the draws must differ somewhere for the test to mean anything"
        );
    }

    #[test]
    fn a_draft_vocabulary_bounds_what_is_proposed() {
        let (m, tok) = crate::model::tests::tiny_target(21, "drafter-target");
        let mut dr = crate::model::tests::tiny_drafter(&m, &tok, 6, 5);
        let v = dr.cfg.vocab;
        let ids: Vec<u32> = (0..v as u32).rev().step_by(4).collect();
        dr.set_draft_vocab(Some(ids.clone())).unwrap();
        assert!(dr.set_draft_vocab(Some(vec![1, 1])).is_err(), "duplicates");
        assert!(
            dr.set_draft_vocab(Some(vec![v as u32])).is_err(),
            "out of range"
        );
        let g = dr.cfg.gamma;
        let rl = 2 * m.cfg.d_model;
        let mut p = DsparkProposer::new(dr, "t").unwrap();
        let mut rng = kernels::rng::Rng::new(3);
        let rows: Vec<f32> = (0..4 * rl).map(|_| rng.normal() as f32).collect();
        p.observe(1, 0, &rows).unwrap();
        let ctx: Vec<u32> = vec![3, 8, 13, 21];
        let allowed: std::collections::HashSet<u32> = ids.iter().copied().collect();
        for seed in 0..8 {
            let b = sampled_block(&mut p, &ctx, g, seed);
            assert_eq!(b.tokens.len(), g);
            for (t, q) in b.tokens.iter().zip(&b.dists) {
                assert!(
                    allowed.contains(t),
                    "drafted {t} outside the draft vocabulary"
                );
                let q: Vec<f32> = match q {
                    Dist::Dense(q) => q.clone(),
                    Dist::Sparse(pairs) => {
                        let mut q = vec![0f32; v];
                        for &(t, p) in pairs {
                            assert_eq!(q[t as usize], 0.0, "token {t} listed twice");
                            q[t as usize] = p;
                        }
                        q
                    }
                    Dist::OneHot => panic!("sampled drafts carry their distribution"),
                };
                assert!(q[*t as usize] > 0.0, "drafted {t} with q = 0");
                let outside: f32 = (0..v)
                    .filter(|i| !allowed.contains(&(*i as u32)))
                    .map(|i| q[i])
                    .sum();
                let total: f32 = q.iter().sum();
                assert_eq!(outside, 0.0);
                assert!((total - 1.0).abs() < 1e-4, "q sums to {total}");
            }
        }
    }

    #[test]
    fn eight_bit_markov_bias_matches_the_f32_product() {
        let (r, v, b) = (64usize, 300usize, 3usize);
        let mut rng = kernels::rng::Rng::new(2);
        let w2: Vec<f32> = (0..r * v).map(|_| rng.normal() as f32 * 0.1).collect();
        let e: Vec<f32> = (0..b * r).map(|_| rng.normal() as f32).collect();
        let mut t = vec![0f32; v * r];
        for i in 0..r {
            for j in 0..v {
                t[j * r + i] = w2[i * v + j];
            }
        }
        let q = quantize_q8(&t, v, r).expect("64 columns quantize");
        let mut got = vec![0f32; b * v];
        q.matmul(&e, b, &mut got, kernels::Isa::detect());
        let mut worst = 0f32;
        for bi in 0..b {
            for j in 0..v {
                let want: f32 = (0..r).map(|i| e[bi * r + i] * w2[i * v + j]).sum();
                worst = worst.max((got[bi * v + j] - want).abs());
            }
        }
        // 8-bit codes with a scale per 16 values: error ≈ ½·(max|w|/127)·Σ|e| ≪ the bias scale.
        assert!(worst < 0.05, "worst abs error {worst}");
        assert!(
            quantize_q8(&t[..v * 16], v, 16).is_none(),
            "needs 32-wide rows"
        );
    }
}
