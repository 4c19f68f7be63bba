//! The drafting thread: per-request draft context kept in step with the target, one batched
//! `propose` over every waiting round of every stream.

use crate::{DraftArgs, DraftError, Result};
use dspark_proto::{DraftBlock, DraftCall, DraftItem, DraftReply, Dtype, QKind, Tensor};
use kernels::rng::Rng;
use specdec::proposer::{Dist, NgramProposer, ProposeReq};
use specdec::{MAX_GAMMA, Proposer, ProposerKind};
use std::collections::HashMap;
use std::time::Instant;

/// The loaded drafter and what the wire needs to know about it.
pub struct DraftHost {
    pub proposer: Box<dyn Proposer>,
    pub drafter: String,
    pub vocab: usize,
    pub vocab_hash: String,
    pub feature_layers: Vec<usize>,
    /// Floats per feature row (layers × d_model).
    pub row_len: usize,
    pub max_gamma: usize,
    /// The drafter's greedy copy-run rates (published: target workers make copy runs locally).
    pub copy_runs: Vec<f32>,
    /// Their confidence head, flattened (empty: the rates serve).
    pub copy_head: Vec<f32>,
}

impl DraftHost {
    pub fn load(hub: &drafter::build::ModelHub, a: &DraftArgs) -> Result<Self> {
        let kind = match &a.drafter {
            Some(k) => ProposerKind::parse(k, drafter::build::default_draft_for(&a.target))?,
            None => drafter::build::default_kind_for(&a.target),
        };
        if kind == ProposerKind::None {
            return Err(DraftError::Config(
                "a draft worker needs a drafter (ngram, draft-model, dspark)".into(),
            ));
        }
        let path = hub.resolve(&a.target)?;
        let (proposer, vocab, vocab_hash, d_model): (Box<dyn Proposer>, usize, String, usize) =
            if kind == ProposerKind::Ngram {
                let tok = dspark_runtime::Tokenizer::load(&path)?;
                // The target sends ids up to its model's vocabulary, which can be larger than
                // the tokenizer's (Qwen2.5: 151936 embedding rows, 151665 tokens); n-gram drafts
                // only copy them, so the model's size is the bound.
                let vocab = match model_vocab(&path) {
                    Ok(v) => v.max(tok.vocab_size()),
                    Err(e) => {
                        tracing::warn!(
                            "model configuration unreadable ({e}): token ids are checked \
                             against the tokenizer's vocabulary"
                        );
                        tok.vocab_size()
                    }
                };
                (
                    Box::new(NgramProposer::default()),
                    vocab,
                    tok.vocab_hash(),
                    0,
                )
            } else {
                let target = hub.load(&a.target)?;
                let mut cache = drafter::build::DraftCache::default();
                let p = drafter::build::build_proposer(hub, &kind, &target, &mut cache)?;
                (
                    p,
                    target.model.cfg.vocab_size,
                    target.tok.vocab_hash(),
                    target.model.cfg.d_model,
                )
            };
        let feature_layers = proposer.feature_layers();
        // A trained drafter drafts at most the block it was trained for: advertised, so a
        // target worker asking for longer blocks is refused as it is in process.
        let max_gamma = advertised_max_gamma(&*proposer);
        Ok(Self {
            copy_runs: proposer.copy_runs(),
            copy_head: proposer.copy_head(),
            drafter: kind.label(),
            row_len: feature_layers.len() * d_model,
            feature_layers,
            vocab,
            vocab_hash,
            proposer,
            max_gamma,
        })
    }
}

/// The longest block a draft worker hosting `proposer` drafts: its trained γ
/// ([`Proposer::max_gamma`]), any length the protocol allows ([`MAX_GAMMA`]) otherwise.
pub fn advertised_max_gamma(proposer: &dyn Proposer) -> usize {
    proposer.max_gamma().map_or(MAX_GAMMA, |g| g.min(MAX_GAMMA))
}

/// The model's vocabulary (its embedding rows) from its configuration alone, without loading
/// weights.
fn model_vocab(path: &std::path::Path) -> Result<usize> {
    let cfg = if path.is_dir() {
        let text = std::fs::read_to_string(path.join("config.json"))?;
        dspark_runtime::ModelConfig::from_hf_json(&text)?
    } else {
        dspark_runtime::ModelConfig::from_gguf(&dspark_runtime::gguf::GgufFile::open(path)?)?
    };
    Ok(cfg.vocab_size)
}

/// Work for the drafting thread.
pub enum Job {
    Round {
        stream: u64,
        call: DraftCall,
        reply: tokio::sync::oneshot::Sender<DraftReply>,
    },
    /// A stream's first message passed: it drafts for the target worker named `target`
    /// (empty when it named none), whose streams share one quota of requests.
    Open { stream: u64, target: String },
    /// The stream closed: free its requests.
    Drop { stream: u64 },
    /// Requests a stream finished, sent with a round refused as stale. Answered once applied:
    /// the stream waits for it as for a round, so a client sending stale rounds faster than
    /// the drafting thread works cannot grow the job queue without bound.
    Finish {
        stream: u64,
        seqs: Vec<u64>,
        done: tokio::sync::oneshot::Sender<()>,
    },
}

struct ReqState {
    tokens: Vec<u32>,
    rng: Rng,
    /// Sent with the request's first round.
    params: kernels::sampling::SamplingParams,
    /// Times in a row the drafter failed this request drafted alone.
    fails: u32,
    /// Rounds it is still refused without drafting (2^fails − 1 after a failure): retried
    /// every round, it would cost every request batched with it a failed batch and one call
    /// each.
    sit_out: u32,
}

/// Per-request state and the proposer; owned by the drafting thread.
pub struct Drafting {
    host: DraftHost,
    ids: HashMap<(u64, u64), u64>,
    /// The target worker each open stream drafts for (from its first message).
    targets: HashMap<u64, String>,
    /// Requests held per target worker, over all its streams.
    per_target: HashMap<String, usize>,
    states: HashMap<u64, ReqState>,
    /// Context tokens held over every request.
    held_tokens: usize,
    /// At most this many ([`MAX_HELD_TOKENS`]; lowered in tests).
    max_held_tokens: usize,
    next_id: u64,
}

/// Requests one draft worker keeps state for, over all its streams: a target worker runs a
/// few hundred at most, so a stream opening more is refused before it exhausts memory.
pub const MAX_REQUESTS: usize = 16_384;
/// Requests one target worker may keep state for, over all its streams: a quarter of the
/// worker's, so one target that never finishes its requests (or opens several streams) cannot
/// refuse every other target's. Streams naming no target share one quota.
pub const MAX_TARGET_REQUESTS: usize = MAX_REQUESTS / 4;
/// Longest context one request may sync (tokens), well past any model's context here.
pub const MAX_CONTEXT_TOKENS: usize = 1 << 18;
/// Context tokens the worker holds over all its requests (256 MiB of ids): a request growing
/// past it is refused (drafted at its target), as one past the request quotas is. Without it
/// [`MAX_REQUESTS`] contexts of [`MAX_CONTEXT_TOKENS`] would hold 16 GiB.
pub const MAX_HELD_TOKENS: usize = 1 << 26;
/// Longest list of logit biases or held tokens one request's sampling may carry (the router
/// allows 1024 biases and 64 stop tokens): kept with the request and read at every drafted
/// position, on the one drafting thread every stream shares.
pub const MAX_SAMPLING_LIST: usize = 4096;

/// Feature rows one item may bring beyond what the drafter reads (its context rows and a
/// block): at least the 64 a target keeps per request and resends after a resync. Only the
/// last rows are observed, so a target sending more cannot grow the drafter's buffers.
pub const FEATURE_ROW_MARGIN: usize = 64;

/// Refuses a round whose finished list is longer than any worker holds: it is applied (or
/// carried to the drafting thread) before anything else of the round.
pub fn check_finished(call: &DraftCall) -> Result<(), String> {
    if call.finished.len() > MAX_REQUESTS {
        return Err(format!(
            "{} finished requests in one round (at most {MAX_REQUESTS})",
            call.finished.len()
        ));
    }
    Ok(())
}

/// Largest reply to one round (encoded bytes, estimated from above): the message limit less a
/// margin for the reply's own fields. A reply past the limit ends the stream, and the target
/// would reconnect and send the same round again, forever.
pub const REPLY_BYTES: usize = dspark_proto::MAX_MESSAGE_BYTES - (1 << 20);
/// Largest block one request gets: half a message, as the target packs its rounds (its
/// `ROUND_BYTES`), so a sampled request at a long γ over a large vocabulary (Qwen2.5: 608 KB a
/// dense position) is cut to the positions that fit rather than overflow the reply.
pub const ITEM_BYTES: usize = dspark_proto::MAX_MESSAGE_BYTES / 2;
/// A block's encoding beyond its positions, at most: seq, kind, flags, counts, the q tensor's
/// header, the tags and length prefixes (its own within the reply too).
const BLOCK_OVERHEAD: usize = 128;
/// A drafted position beyond its q row, at most: its token (a varint of up to 5 bytes) and its
/// confidence (4).
const POSITION_BYTES: usize = 16;

/// A block that asks the target to resend the request from `have` tokens, drafting nothing:
/// what a request the worker lacks (or refused) gets, so the target drafts it locally.
fn resend_from(seq: u64, have: u32) -> DraftBlock {
    DraftBlock {
        seq,
        need_sync: true,
        have_tokens: have,
        ..Default::default()
    }
}

impl Drafting {
    pub fn new(host: DraftHost) -> Self {
        Self {
            host,
            ids: HashMap::new(),
            targets: HashMap::new(),
            per_target: HashMap::new(),
            states: HashMap::new(),
            held_tokens: 0,
            max_held_tokens: MAX_HELD_TOKENS,
            next_id: 1,
        }
    }

    pub fn active(&self) -> usize {
        self.states.len()
    }

    /// Runs until the job channel closes.
    pub fn run(
        mut self,
        rx: std::sync::mpsc::Receiver<Job>,
        load: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        metrics: &crate::metrics::DraftMetrics,
    ) {
        use crate::metrics::DraftMetrics as M;
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            while let Ok(j) = rx.try_recv() {
                jobs.push(j);
            }
            let mut rounds = Vec::new();
            for j in jobs {
                match j {
                    Job::Open { stream, target } => self.open_stream(stream, target),
                    Job::Drop { stream } => self.drop_stream(stream),
                    Job::Finish { stream, seqs, done } => {
                        self.finish(stream, &seqs);
                        let _ = done.send(());
                    }
                    Job::Round {
                        stream,
                        call,
                        reply,
                    } => rounds.push((stream, call, reply)),
                }
            }
            if !rounds.is_empty() {
                let t0 = Instant::now();
                // A stream's hello (a round with no requests) is no drafting work.
                let work = rounds.iter().filter(|r| !r.1.items.is_empty()).count();
                let items: usize = rounds.iter().map(|r| r.1.items.len()).sum();
                if work > 0 {
                    M::add(&metrics.calls, 1);
                    M::add(&metrics.rounds, work as u64);
                    M::add(&metrics.items, items as u64);
                }
                // One span per drafting call (the rounds of every stream waiting, batched):
                // its own trace, as it serves many targets' requests at once.
                let span = (work > 0)
                    .then(|| tracing::info_span!("draft", rounds = work, requests = items));
                let _g = span.as_ref().map(|s| s.enter());
                for (reply, r) in self.rounds(rounds) {
                    if !r.error.is_empty() {
                        M::add(&metrics.round_errors, 1);
                    }
                    let drafted: usize = r.blocks.iter().map(|b| b.tokens.len()).sum();
                    M::add(&metrics.tokens, drafted as u64);
                    let _ = reply.send(r);
                }
                if work > 0 {
                    metrics.call_seconds.observe(t0.elapsed().as_secs_f64());
                }
            }
            load.store(self.active(), std::sync::atomic::Ordering::Relaxed);
            metrics
                .requests
                .store(self.active() as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Records the target worker `stream` drafts for: its requests count against that
    /// target's quota. A stream never opened counts as one naming no target.
    fn open_stream(&mut self, stream: u64, target: String) {
        self.targets.insert(stream, target);
    }

    /// The target worker `stream` drafts for ("" when none is known).
    fn target_of(&self, stream: u64) -> &str {
        self.targets.get(&stream).map_or("", String::as_str)
    }

    /// Requests the target of `stream` holds, over all its streams.
    fn target_load(&self, stream: u64) -> usize {
        self.per_target
            .get(self.target_of(stream))
            .copied()
            .unwrap_or(0)
    }

    fn drop_stream(&mut self, stream: u64) {
        let gone: Vec<(u64, u64)> = self.ids.keys().filter(|k| k.0 == stream).copied().collect();
        for k in gone {
            self.forget(k);
        }
        self.targets.remove(&stream);
    }

    fn finish(&mut self, stream: u64, seqs: &[u64]) {
        for &seq in seqs {
            self.forget((stream, seq));
        }
    }

    /// Frees one request: its state, its drafter state, its place in its target's quota and
    /// its tokens in the held total.
    fn forget(&mut self, key: (u64, u64)) {
        let Some(g) = self.ids.remove(&key) else {
            return;
        };
        if let Some(st) = self.states.remove(&g) {
            self.held_tokens = self.held_tokens.saturating_sub(st.tokens.len());
        }
        self.host.proposer.finish(g);
        let target = self.target_of(key.0).to_string();
        if let Some(n) = self.per_target.get_mut(&target) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_target.remove(&target);
            }
        }
    }

    /// Checks one item before anything of it is applied; returns its sampling parameters when
    /// it carries them. A bad item is refused alone: the round's other requests still draft.
    fn check_item(
        &self,
        it: &DraftItem,
    ) -> Result<Option<kernels::sampling::SamplingParams>, String> {
        let end = it.sync_from as usize + it.tokens.len();
        if end > MAX_CONTEXT_TOKENS {
            return Err(format!(
                "a context of {end} tokens (at most {MAX_CONTEXT_TOKENS})"
            ));
        }
        if let Some(&t) = it.tokens.iter().find(|&&t| t as usize >= self.host.vocab) {
            return Err(format!(
                "token {t} outside the vocabulary ({})",
                self.host.vocab
            ));
        }
        let params = it
            .sampling
            .as_ref()
            .map(|s| s.to_params())
            .transpose()
            .map_err(|e| e.to_string())?;
        if let Some(p) = &params {
            if p.logit_bias.len() > MAX_SAMPLING_LIST || p.held_ids.len() > MAX_SAMPLING_LIST {
                return Err(format!(
                    "sampling with {} logit biases and {} held tokens (at most \
                     {MAX_SAMPLING_LIST} each)",
                    p.logit_bias.len(),
                    p.held_ids.len()
                ));
            }
            p.validate_vocab(self.host.vocab)
                .map_err(|e| e.to_string())?;
        }
        if let Some(f) = &it.features {
            // Validated here without decoding; decoded once when applied.
            f.check().map_err(|e| format!("features: {e}"))?;
            // Rows of this drafter's width, as the target sends them: a target whose model
            // has another width (one tokenizer, two sizes) would otherwise have its rows
            // reread as garbage wherever the counts happened to divide.
            let rl = self.host.row_len;
            if rl > 0 && (f.shape.len() != 2 || f.shape[1] as usize != rl) {
                return Err(format!("features of shape {:?}, not rows of {rl}", f.shape));
            }
            // Rows are of committed positions: any past the context the item leaves would be
            // kept as the features of positions yet to come.
            let rows = f.shape.first().map_or(0, |&r| r as usize);
            if rl > 0 && it.feat_from as usize + rows > end {
                return Err(format!(
                    "features of positions {}..{} past a context of {end}",
                    it.feat_from,
                    it.feat_from as usize + rows
                ));
            }
        }
        Ok(params)
    }

    /// Tokens of a request this worker holds that the target still has (those before
    /// `sync_from`): where the target resends from after a refusal.
    fn held(&self, key: (u64, u64), sync_from: u32) -> u32 {
        self.ids
            .get(&key)
            .and_then(|g| self.states.get(g))
            .map_or(0, |st| st.tokens.len().min(sync_from as usize) as u32)
    }

    /// Applies every round's syncs, drafts all of them in one `propose`, builds the replies.
    /// A request with bad input is refused alone (a block asking for a resync, so its target
    /// drafts it locally); the round's error is left to failures of the whole call.
    fn rounds(
        &mut self,
        rounds: Vec<(u64, DraftCall, tokio::sync::oneshot::Sender<DraftReply>)>,
    ) -> Vec<(tokio::sync::oneshot::Sender<DraftReply>, DraftReply)> {
        let t0 = Instant::now();
        let mut out = Vec::with_capacity(rounds.len());
        // (round index, item index, global id, k, params)
        let mut want = Vec::new();
        let mut replies: Vec<DraftReply> = Vec::with_capacity(rounds.len());
        for (ri, (stream, call, _)) in rounds.iter().enumerate() {
            let mut rep = DraftReply {
                step: call.step,
                ..Default::default()
            };
            if let Err(e) = check_finished(call) {
                rep.error = e;
                replies.push(rep);
                continue;
            }
            self.finish(*stream, &call.finished);
            // More requests than the worker ever holds: refused whole (their answers alone
            // could pass the message limit).
            if call.items.len() > MAX_REQUESTS {
                rep.error = format!(
                    "{} requests in one round (at most {MAX_REQUESTS})",
                    call.items.len()
                );
                replies.push(rep);
                continue;
            }
            for it in &call.items {
                let key = (*stream, it.seq);
                // A request this worker holds nothing of must start from its first token: it
                // gets state (seed, sampling) only from the round that sends them.
                if it.sync_from > 0 && !self.ids.contains_key(&key) {
                    rep.blocks.push(resend_from(it.seq, 0));
                    continue;
                }
                let sampling = match self.check_item(it) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(
                            stream = *stream,
                            request = it.seq,
                            "draft item refused: {e}"
                        );
                        rep.blocks
                            .push(resend_from(it.seq, self.held(key, it.sync_from)));
                        continue;
                    }
                };
                let mine = self.target_load(*stream);
                if !self.ids.contains_key(&key)
                    && (self.ids.len() >= MAX_REQUESTS || mine >= MAX_TARGET_REQUESTS)
                {
                    tracing::warn!(
                        stream = *stream,
                        target = self.target_of(*stream),
                        request = it.seq,
                        "draft item refused: this draft worker holds {} requests already, {mine} \
                         of them this target's (at most {MAX_REQUESTS}, {MAX_TARGET_REQUESTS} a \
                         target)",
                        self.ids.len()
                    );
                    rep.blocks.push(resend_from(it.seq, 0));
                    continue;
                }
                // The tokens this sync adds to what the worker holds (a sync past what it
                // holds adds nothing: it is answered with a resend below).
                let have = self.held(key, u32::MAX) as usize;
                let end = it.sync_from as usize + it.tokens.len();
                let grows = if it.sync_from as usize > have {
                    0
                } else {
                    end.saturating_sub(have)
                };
                if grows > 0 && self.held_tokens.saturating_add(grows) > self.max_held_tokens {
                    tracing::warn!(
                        stream = *stream,
                        request = it.seq,
                        "draft item refused: this draft worker holds {} context tokens already, \
                         {grows} more would pass its budget of {}",
                        self.held_tokens,
                        self.max_held_tokens
                    );
                    rep.blocks
                        .push(resend_from(it.seq, self.held(key, it.sync_from)));
                    continue;
                }
                if !self.ids.contains_key(&key) {
                    let target = self.target_of(*stream).to_string();
                    *self.per_target.entry(target).or_default() += 1;
                }
                // Past the drafter's longest block: a shorter draft (truncating is lossless).
                let k = (it.k as usize).min(self.host.max_gamma);
                let g = *self.ids.entry(key).or_insert_with(|| {
                    self.next_id += 1;
                    self.next_id
                });
                let st = self.states.entry(g).or_insert_with(|| ReqState {
                    tokens: Vec::new(),
                    rng: Rng::new(it.seed ^ 0x5eed_d4af),
                    params: kernels::sampling::SamplingParams::greedy(),
                    fails: 0,
                    sit_out: 0,
                });
                if let Some(p) = sampling {
                    st.params = p;
                }
                if it.sync_from as usize > st.tokens.len() {
                    rep.blocks.push(resend_from(it.seq, st.tokens.len() as u32));
                    continue;
                }
                let before = st.tokens.len();
                st.tokens.truncate(it.sync_from as usize);
                st.tokens.extend_from_slice(&it.tokens);
                self.held_tokens = (self.held_tokens + st.tokens.len()).saturating_sub(before);
                let keep_rows = self
                    .host
                    .proposer
                    .context_rows()
                    .saturating_add(self.host.max_gamma)
                    .saturating_add(FEATURE_ROW_MARGIN);
                let rl = self.host.row_len;
                let r = self
                    .host
                    .proposer
                    .commit(g, &st.tokens)
                    .and_then(|_| match &it.features {
                        // A drafter that reads no features (n-gram, draft model) ignores them.
                        Some(f) if rl > 0 => match f.to_f32() {
                            Ok(mut rows) => {
                                let skip = (rows.len() / rl).saturating_sub(keep_rows);
                                let tail = rows.get_mut(skip * rl..).unwrap_or_default();
                                finite(tail);
                                self.host
                                    .proposer
                                    .observe(g, it.feat_from as usize + skip, tail)
                            }
                            Err(e) => Err(specdec::SpecError::Invalid(format!("features: {e}"))),
                        },
                        _ => Ok(()),
                    });
                if let Err(e) = r {
                    // Its state may be half applied: dropped, and the target resends it all.
                    tracing::warn!(
                        stream = *stream,
                        request = it.seq,
                        "draft item refused: {e}"
                    );
                    self.finish(*stream, &[it.seq]);
                    rep.blocks.push(resend_from(it.seq, 0));
                    continue;
                }
                // How the target verified this worker's previous block (before drafting the
                // next, which reads the acceptance of that one): drafts it never verified are
                // not counted as rejected. Unknown (an older target): as the context says.
                if let Some(v) = it.verified {
                    self.host
                        .proposer
                        .verified(g, it.verified_at as usize, v as usize);
                }
                // A request the drafter failed alone sits out its next rounds (refused, so its
                // target drafts it locally and backs off), its sync applied.
                if k > 0 && st.sit_out > 0 {
                    st.sit_out -= 1;
                    rep.blocks.push(resend_from(it.seq, st.tokens.len() as u32));
                    continue;
                }
                let params = st.params.clone();
                rep.blocks.push(DraftBlock {
                    seq: it.seq,
                    have_tokens: st.tokens.len() as u32,
                    ..Default::default()
                });
                want.push((ri, rep.blocks.len() - 1, g, k, params));
            }
            replies.push(rep);
        }
        // One propose over every round's requests.
        want.retain(|w| w.3 > 0);
        let mut drafted: Vec<Option<specdec::proposer::DraftBlock>> = vec![None; want.len()];
        // Requests the drafter failed drafted alone (indices into `want`).
        let mut failed = Vec::new();
        if !want.is_empty() {
            let by_g: HashMap<u64, usize> =
                want.iter().enumerate().map(|(i, w)| (w.2, i)).collect();
            let mut order = Vec::with_capacity(want.len());
            let mut reqs = Vec::with_capacity(want.len());
            for (g, st) in self.states.iter_mut() {
                if let Some(&wi) = by_g.get(g) {
                    order.push(wi);
                    reqs.push(ProposeReq {
                        id: *g,
                        context: &st.tokens,
                        k: want[wi].3,
                        params: &want[wi].4,
                        rng: &mut st.rng,
                    });
                }
            }
            match self.host.proposer.propose(&mut reqs) {
                Ok(blocks) => {
                    for (wi, b) in order.into_iter().zip(blocks) {
                        drafted[wi] = Some(b);
                    }
                }
                // One request the drafter cannot serve (a context past the draft model's)
                // must not cost the others their drafts: each is drafted alone, and one that
                // fails is refused (not an empty block, which its target would send again next
                // cycle, costing everyone a failed batch and a call each).
                Err(e) if reqs.len() > 1 => {
                    tracing::warn!("batched drafting failed ({e}); drafting one at a time");
                    for (wi, r) in order.into_iter().zip(reqs) {
                        match self.host.proposer.propose(&mut [r]) {
                            Ok(mut b) if b.len() == 1 => drafted[wi] = b.pop(),
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(request = want[wi].2, "drafting failed: {e}");
                                failed.push(wi);
                            }
                        }
                    }
                }
                // The drafter fails its only request: the round's error, on which the target
                // drafts locally (a drafter broken for every request must not leave targets
                // waiting on empty blocks).
                Err(e) => {
                    for w in &want {
                        replies[w.0].error = format!("drafting failed: {e}");
                    }
                }
            }
        }
        for (w, b) in want.iter().zip(&drafted) {
            if let (Some(_), Some(st)) = (b, self.states.get_mut(&w.2)) {
                st.fails = 0;
            }
        }
        for wi in failed {
            let Some(&(ri, bi, g, _, _)) = want.get(wi) else {
                continue;
            };
            if let Some(st) = self.states.get_mut(&g) {
                st.fails = st.fails.saturating_add(1);
                st.sit_out = (1u32 << st.fails.min(8)) - 1;
            }
            // It holds the whole context the round synced: the target backs off, resending
            // nothing.
            if let Some(m) = replies.get_mut(ri).and_then(|r| r.blocks.get_mut(bi)) {
                *m = resend_from(m.seq, m.have_tokens);
            }
        }
        // The blocks go on the wire in the rounds' item order, each within what is left of its
        // reply's bytes (every block's overhead counted first).
        let mut used: Vec<usize> = replies
            .iter()
            .map(|r| r.blocks.len().saturating_mul(BLOCK_OVERHEAD))
            .collect();
        for (w, b) in want.iter().zip(drafted) {
            let Some(b) = b else { continue };
            let (ri, bi, k) = (w.0, w.1, w.3);
            let (Some(m), Some(u)) = (
                replies.get_mut(ri).and_then(|r| r.blocks.get_mut(bi)),
                used.get_mut(ri),
            ) else {
                continue;
            };
            let budget = (ITEM_BYTES - BLOCK_OVERHEAD).min(REPLY_BYTES.saturating_sub(*u));
            *u = u.saturating_add(fill(m, b, k, self.host.vocab, budget));
        }
        let us = t0.elapsed().as_micros() as u64;
        for ((_, _, tx), mut rep) in rounds.into_iter().zip(replies) {
            rep.compute_us = us;
            out.push((tx, rep));
        }
        out
    }
}

/// Hidden states clamped to f16's range (what the target captures them in; f32 rows past it
/// overflow the drafter's f16 kernels), NaN read as 0, so one bad value does not turn a
/// request's cached context rows into NaN or ∞.
fn finite(rows: &mut [f32]) {
    const F16_MAX: f32 = 65504.0;
    for v in rows.iter_mut() {
        *v = if v.is_nan() {
            0.0
        } else {
            v.clamp(-F16_MAX, F16_MAX)
        };
    }
}

/// How a block's q rows travel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum QWire {
    OneHot,
    Sparse,
    Dense,
}

/// Puts a drafted block on the wire: tokens, confidences, and q: one-hot; (token, probability)
/// pairs when every row is sparse (a draft vocabulary or truncated sampling: 8 bytes per kept
/// token instead of 4 per vocabulary entry); dense rows otherwise.
///
/// Only a prefix goes (a shorter draft is still lossless): up to the first malformed position
/// (a token outside the vocabulary, a dense row shorter than it), which would otherwise panic
/// here, and within `budget` bytes beyond [`BLOCK_OVERHEAD`], since a reply past the message
/// limit ends the stream. Returns the bytes it takes (an upper bound).
fn fill(
    m: &mut DraftBlock,
    b: specdec::proposer::DraftBlock,
    k: usize,
    vocab: usize,
    budget: usize,
) -> usize {
    let n = b.tokens.len().min(k).min(b.dists.len());
    let ok = b
        .tokens
        .iter()
        .zip(&b.dists)
        .take(n)
        .take_while(|(t, d)| {
            (**t as usize) < vocab
                && match d {
                    Dist::Dense(v) => v.len() >= vocab,
                    Dist::Sparse(v) => v.iter().all(|&(x, _)| (x as usize) < vocab),
                    Dist::OneHot => true,
                }
        })
        .count();
    let dists = b.dists.get(..ok).unwrap_or(&[]);
    // Position k goes when every prefix up to it fits, each priced at its own kind: whether it
    // fits never depends on later rows (which depend on the token drafted at k), as it would
    // if a dense row after it made the whole block dense.
    let mut kind = QWire::OneHot;
    let mut used = 0usize;
    let mut n = 0usize;
    // The prefix's q as sparse rows: a length (a varint), then a varint id and a float each.
    let mut sparse = 0usize;
    for (i, d) in dists.iter().enumerate() {
        let k = match (kind, d) {
            (QWire::Dense, _) | (_, Dist::Dense(_)) => QWire::Dense,
            (QWire::Sparse, _) | (_, Dist::Sparse(_)) => QWire::Sparse,
            (QWire::OneHot, Dist::OneHot) => QWire::OneHot,
        };
        sparse = sparse.saturating_add(match d {
            Dist::Sparse(v) => 5usize.saturating_add(v.len().saturating_mul(9)),
            _ => 5 + 9,
        });
        let q = match k {
            QWire::OneHot => 0,
            QWire::Sparse => sparse,
            QWire::Dense => vocab.saturating_mul(4).saturating_mul(i + 1),
        };
        let next = POSITION_BYTES.saturating_mul(i + 1).saturating_add(q);
        if next > budget {
            break;
        }
        (kind, used, n) = (k, next, i + 1);
    }
    let tokens = b.tokens.get(..n).unwrap_or(&[]).to_vec();
    let dists = dists.get(..n).unwrap_or(&[]);
    m.confidence = b
        .confidence
        .map(|c| c.get(..n.min(c.len())).unwrap_or(&[]).to_vec())
        .unwrap_or_default();
    m.fitted_rates = b.fitted_rates;
    match kind {
        _ if n == 0 => m.q_kind = QKind::OneHot as i32,
        QWire::OneHot => m.q_kind = QKind::OneHot as i32,
        QWire::Sparse => {
            for (&t, d) in tokens.iter().zip(dists) {
                let before = m.q_ids.len();
                match d {
                    Dist::Sparse(v) => {
                        for &(x, p) in v {
                            m.q_ids.push(x);
                            m.q_probs.push(p);
                        }
                    }
                    _ => {
                        m.q_ids.push(t);
                        m.q_probs.push(1.0);
                    }
                }
                m.q_lens.push((m.q_ids.len() - before) as u32);
            }
            m.q_kind = QKind::Sparse as i32;
        }
        QWire::Dense => {
            let mut rows = vec![0f32; n * vocab];
            for ((row, d), &t) in rows.chunks_exact_mut(vocab).zip(dists).zip(&tokens) {
                match d {
                    Dist::Dense(v) => {
                        let c = vocab.min(v.len());
                        row[..c].copy_from_slice(&v[..c]);
                    }
                    Dist::Sparse(v) => {
                        for &(x, p) in v {
                            if let Some(slot) = row.get_mut(x as usize) {
                                *slot = p;
                            }
                        }
                    }
                    Dist::OneHot => {
                        if let Some(slot) = row.get_mut(t as usize) {
                            *slot = 1.0;
                        }
                    }
                }
            }
            m.q_kind = QKind::Dense as i32;
            m.q = Some(Tensor::from_f32(&rows, &[n, vocab], Dtype::F32));
        }
    }
    m.tokens = tokens;
    used
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drafter that cannot draft past a context of 8 tokens (as a draft model past its own
    /// context): it fails any batch holding such a request.
    struct Short;
    impl Proposer for Short {
        fn name(&self) -> &str {
            "short"
        }
        /// Refuses a context holding token 9 (as a drafter refuses input it cannot take).
        fn commit(&mut self, _id: u64, context: &[u32]) -> specdec::Result<()> {
            if context.contains(&9) {
                return Err(specdec::SpecError::Invalid("token 9".into()));
            }
            Ok(())
        }
        fn propose(
            &mut self,
            reqs: &mut [ProposeReq<'_>],
        ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
            if reqs.iter().any(|r| r.context.len() > 8) {
                return Err(specdec::SpecError::Invalid("context too long".into()));
            }
            Ok(reqs
                .iter()
                .map(|r| specdec::proposer::DraftBlock {
                    tokens: vec![1; r.k],
                    dists: vec![Dist::OneHot; r.k],
                    confidence: None,
                    conf_inputs: None,
                    fitted_rates: false,
                })
                .collect())
        }
    }

    fn drafting() -> Drafting {
        Drafting::new(DraftHost {
            proposer: Box::new(Short),
            drafter: "short".into(),
            vocab: 10,
            vocab_hash: "v".into(),
            feature_layers: Vec::new(),
            row_len: 0,
            max_gamma: 4,
            copy_runs: Vec::new(),
            copy_head: Vec::new(),
        })
    }

    fn round(items: Vec<DraftItem>) -> Vec<DraftReply> {
        let mut d = drafting();
        let (tx, _rx) = tokio::sync::oneshot::channel();
        let call = DraftCall {
            step: 1,
            items,
            ..Default::default()
        };
        d.rounds(vec![(7, call, tx)])
            .into_iter()
            .map(|(_, r)| r)
            .collect()
    }

    fn item(seq: u64, tokens: usize) -> DraftItem {
        DraftItem {
            seq,
            tokens: vec![2; tokens],
            k: 3,
            ..Default::default()
        }
    }

    /// One request the drafter cannot serve is refused; the others in the same batch still
    /// get theirs.
    #[test]
    fn one_request_the_drafter_fails_costs_the_others_nothing() {
        let r = round(vec![item(1, 4), item(2, 20), item(3, 5)]);
        assert!(r[0].error.is_empty(), "{:?}", r[0].error);
        let lens: Vec<usize> = r[0].blocks.iter().map(|b| b.tokens.len()).collect();
        assert_eq!(lens, vec![3, 0, 3]);
        let b = &r[0].blocks[1];
        assert!(b.need_sync && b.have_tokens == 20, "{b:?}");
        // Alone, the failure is the round's error: the target drafts locally.
        let r = round(vec![item(2, 20)]);
        assert!(r[0].error.contains("drafting failed"), "{:?}", r[0].error);
    }

    fn call(step: u64, items: Vec<DraftItem>) -> DraftCall {
        DraftCall {
            step,
            items,
            ..Default::default()
        }
    }

    fn run(d: &mut Drafting, c: DraftCall) -> DraftReply {
        let (tx, _rx) = tokio::sync::oneshot::channel();
        d.rounds(vec![(7, c, tx)]).remove(0).1
    }

    /// A request this worker holds nothing of is asked for its whole context and gets no state
    /// (no load, no seed) until that comes; a finished request's state is freed.
    #[test]
    fn state_comes_from_the_first_token_and_goes_with_finished() {
        let mut d = drafting();
        let mut late = item(1, 2);
        late.sync_from = 6;
        let r = run(&mut d, call(1, vec![late]));
        assert!(r.error.is_empty(), "{}", r.error);
        assert!(r.blocks[0].need_sync);
        assert_eq!(d.active(), 0);
        let mut whole = item(1, 8);
        whole.seed = 42;
        let r = run(&mut d, call(2, vec![whole]));
        assert_eq!(r.blocks[0].tokens.len(), 3);
        assert_eq!(d.active(), 1);
        // A finished list arriving with a round refused as stale still frees: Job::Finish
        // through the drafting thread's loop, as the service sends it.
        let (tx, rx) = std::sync::mpsc::channel();
        let load = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(99));
        let metrics = crate::metrics::DraftMetrics::default();
        let (done, applied) = tokio::sync::oneshot::channel();
        tx.send(Job::Finish {
            stream: 7,
            seqs: vec![1],
            done,
        })
        .unwrap();
        drop(tx);
        d.run(rx, load.clone(), &metrics);
        assert_eq!(load.load(std::sync::atomic::Ordering::Relaxed), 0);
        // The stream waiting on it learns it was applied.
        assert!(applied.blocking_recv().is_ok());
    }

    /// Features sent to a drafter that reads none are ignored, not a refused round.
    #[test]
    fn features_for_a_drafter_without_them_are_ignored() {
        let mut d = drafting();
        let mut it = item(1, 4);
        it.features = Some(dspark_proto::Tensor::from_f32(
            &[1.0; 6],
            &[2, 3],
            dspark_proto::Dtype::F32,
        ));
        let r = run(&mut d, call(1, vec![it]));
        assert!(r.error.is_empty(), "{}", r.error);
        assert_eq!(r.blocks[0].tokens.len(), 3);
    }

    #[test]
    fn features_are_clamped_to_f16() {
        let mut v = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.5, 3e38, -1e5];
        finite(&mut v);
        assert_eq!(v, vec![0.0, 65504.0, -65504.0, 1.5, 65504.0, -65504.0]);
    }

    /// Counts the `propose` calls of the drafter it wraps.
    struct Counted(
        Box<dyn Proposer>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    );
    impl Proposer for Counted {
        fn name(&self) -> &str {
            "counted"
        }
        fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
            self.0.commit(id, context)
        }
        fn propose(
            &mut self,
            reqs: &mut [ProposeReq<'_>],
        ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.propose(reqs)
        }
    }

    /// A request the drafter fails alone is refused (its target backs off) and sits out its
    /// next round: that round is one batched call, not a failed batch and one call each.
    #[test]
    fn a_request_the_drafter_fails_sits_out_the_next_round() {
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut d = drafting();
        d.host.proposer = Box::new(Counted(Box::new(Short), calls.clone()));
        let count = || calls.swap(0, std::sync::atomic::Ordering::Relaxed);
        let r = run(&mut d, call(1, vec![item(1, 4), item(2, 20), item(3, 5)]));
        assert!(r.error.is_empty(), "{:?}", r.error);
        let b = &r.blocks[1];
        assert!(
            b.need_sync && b.have_tokens == 20 && b.tokens.is_empty(),
            "{b:?}"
        );
        assert_eq!(count(), 4, "a failed batch, then each alone");
        // The target sends the same requests again, nothing new synced.
        let again = |seq, at| DraftItem {
            sync_from: at,
            ..item(seq, 0)
        };
        let r = run(
            &mut d,
            call(2, vec![again(1, 4), again(2, 20), again(3, 5)]),
        );
        assert!(r.error.is_empty(), "{:?}", r.error);
        let lens: Vec<usize> = r.blocks.iter().map(|b| b.tokens.len()).collect();
        assert_eq!(lens, vec![3, 0, 3]);
        let b = &r.blocks[1];
        assert!(b.need_sync && b.have_tokens == 20, "{b:?}");
        assert_eq!(count(), 1, "one batch without the failing request");
    }

    /// Feature rows past the context the item leaves (positions not yet committed) refuse
    /// that request; rows up to its end are taken.
    #[test]
    fn features_ahead_of_the_context_are_refused() {
        let mut d = drafting();
        d.host.row_len = 2;
        let with_rows = |seq, from| DraftItem {
            feat_from: from,
            features: Some(Tensor::from_f32(&[0.5; 6], &[3, 2], Dtype::F32)),
            ..item(seq, 4)
        };
        let r = run(&mut d, call(1, vec![with_rows(1, 2), with_rows(2, 1)]));
        assert!(r.error.is_empty(), "{:?}", r.error);
        let b = &r.blocks[0];
        assert!(
            b.need_sync && b.have_tokens == 0 && b.tokens.is_empty(),
            "{b:?}"
        );
        assert!(!r.blocks[1].need_sync && r.blocks[1].tokens.len() == 3);
    }

    /// A finished list longer than the requests any worker holds refuses the round before
    /// any of it is applied.
    #[test]
    fn a_round_finishing_too_many_requests_is_refused() {
        let mut d = drafting();
        run(&mut d, call(1, vec![item(1, 4)]));
        let c = DraftCall {
            finished: (0..=MAX_REQUESTS as u64).collect(),
            ..call(2, vec![item(2, 4)])
        };
        let r = run(&mut d, c);
        assert!(r.error.contains("finished"), "{:?}", r.error);
        assert!(r.blocks.is_empty(), "{r:?}");
        assert_eq!(d.active(), 1, "request 1 still held");
        assert!(
            check_finished(&DraftCall {
                finished: vec![1; MAX_REQUESTS],
                ..Default::default()
            })
            .is_ok()
        );
    }

    /// A context past [`MAX_CONTEXT_TOKENS`] refuses that request alone: it is asked to resend
    /// from what this worker holds, and the round's other requests draft.
    #[test]
    fn a_context_past_the_limit_is_refused() {
        let mut d = drafting();
        let r = run(&mut d, call(1, vec![item(1, 4)]));
        assert_eq!(r.blocks[0].tokens.len(), 3);
        let mut big = item(1, 0);
        big.sync_from = 4;
        big.tokens = vec![2; MAX_CONTEXT_TOKENS];
        let r = run(&mut d, call(2, vec![big, item(2, 5)]));
        assert!(r.error.is_empty(), "{:?}", r.error);
        let b = &r.blocks[0];
        assert!(
            b.need_sync && b.have_tokens == 4 && b.tokens.is_empty(),
            "{b:?}"
        );
        assert_eq!(r.blocks[1].tokens.len(), 3);
        assert_eq!(d.active(), 2);
    }

    /// Bad input of one request (a token outside the vocabulary, invalid sampling, a commit
    /// the drafter refuses) is that request's refusal, never the round's: the others draft,
    /// and a k past the drafter's γ drafts γ tokens.
    #[test]
    fn one_bad_item_costs_the_round_nothing() {
        let mut d = drafting();
        let mut outside = item(2, 3);
        outside.tokens.push(99);
        let mut sampling = item(3, 3);
        sampling.sampling = Some(dspark_proto::Sampling {
            temperature: -1.0,
            ..Default::default()
        });
        let mut uncommitted = item(4, 3);
        uncommitted.tokens.push(9);
        let mut long = item(5, 4);
        long.k = 100;
        let r = run(
            &mut d,
            call(
                1,
                vec![item(1, 4), outside, sampling, uncommitted, long, item(6, 5)],
            ),
        );
        assert!(r.error.is_empty(), "{:?}", r.error);
        let lens: Vec<usize> = r.blocks.iter().map(|b| b.tokens.len()).collect();
        assert_eq!(lens, vec![3, 0, 0, 0, 4, 3]);
        for b in &r.blocks[1..4] {
            assert!(b.need_sync && b.have_tokens == 0, "{b:?}");
        }
        // The refused requests hold nothing here (the one whose commit failed was dropped).
        assert_eq!(d.active(), 3);
        // Resent well, a refused request drafts.
        let r = run(&mut d, call(2, vec![item(2, 4)]));
        assert_eq!(r.blocks[0].tokens.len(), 3);
    }

    /// One target worker holds at most a quarter of the worker's requests, over all its
    /// streams: past that its new ones are refused (drafted at the target) on any of its
    /// streams, while another target's are taken; finishing one, or closing a stream, makes
    /// room again.
    #[test]
    fn one_target_cannot_take_every_request_slot_over_several_streams() {
        let mut d = drafting();
        d.open_stream(7, "a".into());
        d.open_stream(9, "a".into());
        d.open_stream(8, "b".into());
        let on = |d: &mut Drafting, stream, c| {
            let (tx, _rx) = tokio::sync::oneshot::channel();
            d.rounds(vec![(stream, c, tx)]).remove(0).1
        };
        let half = MAX_TARGET_REQUESTS as u64 / 2;
        let r = on(&mut d, 7, call(1, (1..=half).map(|s| item(s, 3)).collect()));
        assert!(r.blocks.iter().all(|b| !b.need_sync), "{r:?}");
        // Target a's second stream gets the rest of its quota, and no more.
        let items = (1..=MAX_TARGET_REQUESTS as u64 - half + 1)
            .map(|s| item(s, 3))
            .collect();
        let r = on(&mut d, 9, call(1, items));
        assert!(r.error.is_empty(), "{:?}", r.error);
        let (last, before) = r.blocks.split_last().expect("blocks");
        assert!(last.need_sync && last.have_tokens == 0, "{last:?}");
        assert!(before.iter().all(|b| !b.need_sync));
        assert_eq!(d.active(), MAX_TARGET_REQUESTS);
        let more = on(&mut d, 7, call(2, vec![item(half + 1, 3)]));
        assert!(more.blocks[0].need_sync, "{:?}", more.blocks[0]);
        // Another target's request is taken.
        let other = on(&mut d, 8, call(1, vec![item(1, 3)]));
        assert!(!other.blocks[0].need_sync, "{:?}", other.blocks[0]);
        // A finished request makes room on either of a's streams.
        d.finish(9, &[1]);
        let r = on(&mut d, 7, call(3, vec![item(half + 1, 3)]));
        assert!(!r.blocks[0].need_sync, "{:?}", r.blocks[0]);
        assert_eq!(d.active(), MAX_TARGET_REQUESTS + 1);
        // A closed stream frees its share of a's quota.
        d.drop_stream(9);
        assert_eq!(d.target_load(7), half as usize + 1);
        let r = on(&mut d, 7, call(4, vec![item(half + 2, 3)]));
        assert!(!r.blocks[0].need_sync, "{:?}", r.blocks[0]);
        d.drop_stream(7);
        d.drop_stream(8);
        assert!(d.per_target.is_empty() && d.active() == 0 && d.held_tokens == 0);
    }

    /// Streams that name no target share one quota: opening more of them takes no more slots.
    #[test]
    fn streams_naming_no_target_share_one_quota() {
        let mut d = drafting();
        for stream in 1..=5u64 {
            d.open_stream(stream, String::new());
            let (tx, _rx) = tokio::sync::oneshot::channel();
            let items = (1..=MAX_TARGET_REQUESTS as u64 / 4)
                .map(|s| item(s, 3))
                .collect();
            d.rounds(vec![(stream, call(1, items), tx)]);
        }
        assert_eq!(d.active(), MAX_TARGET_REQUESTS);
    }

    /// Context tokens held over all requests are bounded: a sync growing past the budget is
    /// refused (its target backs off and drafts locally), one that shrinks or stays is taken,
    /// and finishing a request frees its tokens.
    #[test]
    fn held_tokens_stay_within_the_budget() {
        let mut d = drafting();
        d.max_held_tokens = 10;
        let r = run(&mut d, call(1, vec![item(1, 6), item(2, 4)]));
        assert!(r.blocks.iter().all(|b| !b.need_sync), "{r:?}");
        assert_eq!(d.held_tokens, 10);
        // A new request, and request 1 growing: refused, request 1 asked for nothing again.
        let grow = DraftItem {
            sync_from: 6,
            ..item(1, 1)
        };
        let r = run(&mut d, call(2, vec![item(3, 1), grow]));
        let (a, b) = (&r.blocks[0], &r.blocks[1]);
        assert!(a.need_sync && a.have_tokens == 0, "{a:?}");
        assert!(b.need_sync && b.have_tokens == 6, "{b:?}");
        assert_eq!((d.active(), d.held_tokens), (2, 10));
        // Rewritten shorter it is taken (the budget counts what is held after the sync).
        let shorter = DraftItem {
            sync_from: 2,
            ..item(1, 3)
        };
        let r = run(&mut d, call(3, vec![shorter]));
        assert!(!r.blocks[0].need_sync, "{:?}", r.blocks[0]);
        assert_eq!(d.held_tokens, 9);
        d.finish(7, &[2]);
        assert_eq!(d.held_tokens, 5);
        let r = run(&mut d, call(4, vec![item(3, 5)]));
        assert!(!r.blocks[0].need_sync, "{:?}", r.blocks[0]);
        assert_eq!(d.held_tokens, 10);
    }

    /// Sampling lists past the limit, a logit bias outside the vocabulary and feature rows of
    /// another width are their own request's refusal (each came through before: kept with the
    /// request and read at every drafted position, or drafted from rows read at the wrong
    /// width).
    #[test]
    fn oversized_sampling_and_features_of_another_width_are_refused() {
        let mut d = drafting();
        d.host.row_len = 4;
        let mut held = item(1, 3);
        held.sampling = Some(dspark_proto::Sampling {
            hold_until: 5,
            held_ids: vec![1; MAX_SAMPLING_LIST + 1],
            ..Default::default()
        });
        let mut bias = item(2, 3);
        bias.sampling = Some(dspark_proto::Sampling {
            logit_bias: HashMap::from([(10, 1.0)]),
            ..Default::default()
        });
        // 12 floats split into rows of 4, but they are 2 rows of 6.
        let mut wide = item(3, 3);
        wide.features = Some(Tensor::from_f32(&[0.5; 12], &[2, 6], Dtype::F32));
        let mut fits = item(4, 3);
        fits.features = Some(Tensor::from_f32(&[0.5; 12], &[3, 4], Dtype::F32));
        let r = run(&mut d, call(1, vec![held, bias, wide, fits]));
        assert!(r.error.is_empty(), "{:?}", r.error);
        for b in &r.blocks[..3] {
            assert!(b.need_sync && b.tokens.is_empty(), "{b:?}");
        }
        assert!(!r.blocks[3].need_sync, "{:?}", r.blocks[3]);
    }

    #[test]
    fn a_block_goes_on_the_wire_with_its_confidences_and_their_kind() {
        let b = specdec::proposer::DraftBlock {
            tokens: vec![4, 5, 6],
            dists: vec![Dist::OneHot; 3],
            confidence: Some(vec![0.6, 0.7, 0.8]),
            conf_inputs: None,
            fitted_rates: true,
        };
        let mut m = DraftBlock::default();
        fill(&mut m, b, 2, 10, ITEM_BYTES);
        assert_eq!(m.tokens, vec![4, 5]);
        assert_eq!(m.confidence, vec![0.6, 0.7]);
        assert!(m.fitted_rates);
        assert_eq!(m.q_kind, QKind::OneHot as i32);
    }

    /// Whether position 1 fits does not depend on the row after it: [sparse, sparse] and
    /// [sparse, dense] at one budget send the same first position (sparse), the dense row
    /// cut.
    #[test]
    fn the_cut_of_a_position_does_not_depend_on_later_rows() {
        let sparse = || Dist::Sparse(vec![(1, 1.0)]);
        let mut dense = vec![0f32; 100];
        dense[1] = 1.0;
        let mut sent = Vec::new();
        for second in [sparse(), Dist::Dense(dense)] {
            let b = specdec::proposer::DraftBlock {
                tokens: vec![1, 1],
                dists: vec![sparse(), second],
                ..Default::default()
            };
            let mut m = DraftBlock::default();
            fill(&mut m, b, 2, 100, 100);
            assert_eq!(m.q_kind, QKind::Sparse as i32, "{m:?}");
            sent.push(m);
        }
        assert_eq!(sent[0].tokens, vec![1, 1]);
        assert_eq!(sent[1].tokens, vec![1]);
        assert_eq!(sent[1].q_ids[..], sent[0].q_ids[..1]);
        assert_eq!(sent[1].q_probs[..], sent[0].q_probs[..1]);
        assert_eq!(sent[1].q_lens[..], sent[0].q_lens[..1]);
    }

    /// Qwen2.5's vocabulary: a dense q row is 608 KB.
    const WIDE: usize = 151_936;

    fn one_hot_row(t: u32) -> Dist {
        let mut q = vec![0f32; WIDE];
        q[t as usize] = 1.0;
        Dist::Dense(q)
    }

    /// A sampling drafter's dense rows at γ = 28 over Qwen2.5's vocabulary (17 MB) are cut to
    /// the positions that fit half a message, not sent past the message limit.
    #[test]
    fn dense_rows_are_cut_to_the_byte_limit() {
        let b = specdec::proposer::DraftBlock {
            tokens: (0..28).collect(),
            dists: (0..28).map(one_hot_row).collect(),
            confidence: Some(vec![0.5; 28]),
            conf_inputs: None,
            fitted_rates: false,
        };
        let mut m = DraftBlock::default();
        let used = fill(&mut m, b, 28, WIDE, ITEM_BYTES - BLOCK_OVERHEAD);
        let n = m.tokens.len();
        assert!(n > 0 && n < 28, "{n} positions");
        assert_eq!(m.confidence.len(), n);
        assert_eq!(m.q_kind, QKind::Dense as i32);
        let q = m.q.as_ref().expect("dense q");
        assert_eq!(q.shape, vec![n as u32, WIDE as u32]);
        assert!(q.data.len() <= used && used + BLOCK_OVERHEAD <= ITEM_BYTES);
        assert_eq!(m.tokens, (0..n as u32).collect::<Vec<_>>());
    }

    /// Draws dense rows over [`WIDE`] tokens (a sampling draft model).
    struct Wide;
    impl Proposer for Wide {
        fn name(&self) -> &str {
            "wide"
        }
        fn propose(
            &mut self,
            reqs: &mut [ProposeReq<'_>],
        ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
            Ok(reqs
                .iter()
                .map(|r| specdec::proposer::DraftBlock {
                    tokens: vec![1; r.k],
                    dists: (0..r.k).map(|_| one_hot_row(1)).collect(),
                    ..Default::default()
                })
                .collect())
        }
    }

    /// A round of several sampled requests fits one reply: later requests get what is left
    /// (possibly nothing), never a reply past the message limit.
    #[test]
    fn a_round_of_dense_blocks_stays_under_the_reply_limit() {
        let mut d = Drafting::new(DraftHost {
            proposer: Box::new(Wide),
            drafter: "wide".into(),
            vocab: WIDE,
            vocab_hash: "v".into(),
            feature_layers: Vec::new(),
            row_len: 0,
            max_gamma: MAX_GAMMA,
            copy_runs: Vec::new(),
            copy_head: Vec::new(),
        });
        let items = (1..=3)
            .map(|s| DraftItem {
                k: 20,
                ..item(s, 4)
            })
            .collect();
        let r = run(&mut d, call(1, items));
        assert!(r.error.is_empty(), "{:?}", r.error);
        assert!(!r.blocks[0].tokens.is_empty());
        let mut total = 0;
        for b in &r.blocks {
            let q = b.q.as_ref().map_or(0, |q| q.data.len());
            assert_eq!(q, b.tokens.len() * WIDE * 4);
            assert!(q + BLOCK_OVERHEAD <= ITEM_BYTES, "{q}");
            total += q + BLOCK_OVERHEAD;
        }
        assert!(total <= REPLY_BYTES, "{total}");
        let drafted: usize = r.blocks.iter().map(|b| b.tokens.len()).sum();
        assert!(drafted < 60, "every request cut: {drafted}");
    }

    /// Malformed drafter output (fewer distributions than tokens, a dense row shorter than
    /// the vocabulary, a token outside it) ends the block where it starts, without a panic.
    #[test]
    fn malformed_positions_cut_the_block() {
        let row = || Dist::Dense(vec![0.0, 1.0, 0.0, 0.0]);
        let cases = [
            (vec![1, 1, 1], vec![row(), Dist::Dense(vec![0.0; 2]), row()]),
            (vec![1, 7, 1], vec![row(), Dist::OneHot, row()]),
            (vec![1, 1, 1], vec![row()]),
            (
                vec![1, 1],
                vec![Dist::OneHot, Dist::Sparse(vec![(1, 0.5), (9, 0.5)])],
            ),
        ];
        for (i, (tokens, dists)) in cases.into_iter().enumerate() {
            let b = specdec::proposer::DraftBlock {
                tokens,
                dists,
                ..Default::default()
            };
            let mut m = DraftBlock::default();
            fill(&mut m, b, 3, 4, ITEM_BYTES);
            assert_eq!(m.tokens, vec![1], "case {i}");
        }
    }

    /// Records the calls it gets, in order.
    struct Recording(std::sync::Arc<std::sync::Mutex<Vec<String>>>);
    impl Recording {
        fn log(&self, e: String) {
            self.0.lock().expect("log").push(e);
        }
    }
    impl Proposer for Recording {
        fn name(&self) -> &str {
            "recording"
        }
        fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
            self.log(format!("commit {id} {}", context.len()));
            Ok(())
        }
        fn verified(&mut self, id: u64, at: usize, k: usize) {
            self.log(format!("verified {id} {at} {k}"));
        }
        fn observe(&mut self, id: u64, start: usize, rows: &[f32]) -> specdec::Result<()> {
            self.log(format!("observe {id} {start} {}", rows.len()));
            Ok(())
        }
        fn propose(
            &mut self,
            reqs: &mut [ProposeReq<'_>],
        ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
            for r in reqs.iter() {
                self.log(format!("propose {} {}", r.id, r.context.len()));
            }
            Ok(reqs
                .iter()
                .map(|r| specdec::proposer::DraftBlock {
                    tokens: vec![1; r.k],
                    dists: vec![Dist::OneHot; r.k],
                    ..Default::default()
                })
                .collect())
        }
    }

    /// Of more feature rows than the drafter reads (its context rows, a block and
    /// [`FEATURE_ROW_MARGIN`]), only the last are observed; fewer go whole.
    #[test]
    fn only_the_last_feature_rows_are_observed() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut d = Drafting::new(DraftHost {
            proposer: Box::new(Recording(log.clone())),
            drafter: "recording".into(),
            vocab: 10,
            vocab_hash: "v".into(),
            feature_layers: vec![1],
            row_len: 2,
            max_gamma: 4,
            copy_runs: Vec::new(),
            copy_head: Vec::new(),
        });
        let keep = 4 + FEATURE_ROW_MARGIN;
        let big = DraftItem {
            features: Some(Tensor::from_f32(&[0.5; 200], &[100, 2], Dtype::F32)),
            ..item(5, 100)
        };
        let r = run(&mut d, call(1, vec![big]));
        assert_eq!(r.blocks[0].tokens.len(), 3, "{:?}", r.blocks[0]);
        let g = d.ids[&(7u64, 5u64)];
        let observed = |log: &std::sync::Mutex<Vec<String>>| {
            std::mem::take(&mut *log.lock().expect("log"))
                .into_iter()
                .filter(|e| e.starts_with("observe"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            observed(&log),
            vec![format!("observe {g} {} {}", 100 - keep, keep * 2)]
        );
        let next = DraftItem {
            sync_from: 100,
            feat_from: 100,
            features: Some(Tensor::from_f32(&[0.5; 6], &[3, 2], Dtype::F32)),
            ..item(5, 3)
        };
        run(&mut d, call(2, vec![next]));
        assert_eq!(observed(&log), vec![format!("observe {g} 100 6")]);
    }

    /// The target's verdict on the previous block reaches the drafter after the context it
    /// synced and before the next block is drafted, under the drafter's id for the request;
    /// an item without one (an older target) calls nothing.
    #[test]
    fn the_targets_verdict_reaches_the_drafter_before_it_drafts() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut d = Drafting::new(DraftHost {
            proposer: Box::new(Recording(log.clone())),
            drafter: "recording".into(),
            vocab: 10,
            vocab_hash: "v".into(),
            feature_layers: Vec::new(),
            row_len: 0,
            max_gamma: 4,
            copy_runs: Vec::new(),
            copy_head: Vec::new(),
        });
        let take = || std::mem::take(&mut *log.lock().expect("log"));
        let r = run(&mut d, call(1, vec![item(5, 4)]));
        assert_eq!(r.blocks[0].tokens.len(), 3);
        let g = d.ids[&(7u64, 5u64)];
        assert_eq!(
            take(),
            vec![format!("commit {g} 4"), format!("propose {g} 4")]
        );
        // 1 of the 3 drafts made at context length 4 verified.
        let next = DraftItem {
            sync_from: 4,
            tokens: vec![2, 2],
            verified_at: 4,
            verified: Some(1),
            ..item(5, 0)
        };
        let r = run(&mut d, call(2, vec![next]));
        assert_eq!(r.blocks[0].tokens.len(), 3);
        assert_eq!(
            take(),
            vec![
                format!("commit {g} 6"),
                format!("verified {g} 4 1"),
                format!("propose {g} 6")
            ]
        );
        // None verified is a verdict too; no verdict at all calls nothing.
        let none = DraftItem {
            sync_from: 6,
            tokens: vec![2],
            verified_at: 6,
            verified: Some(0),
            ..item(5, 0)
        };
        run(&mut d, call(3, vec![none]));
        assert_eq!(
            take(),
            vec![
                format!("commit {g} 7"),
                format!("verified {g} 6 0"),
                format!("propose {g} 7")
            ]
        );
        let unknown = DraftItem {
            sync_from: 7,
            tokens: vec![2],
            verified_at: 7,
            ..item(5, 0)
        };
        run(&mut d, call(4, vec![unknown]));
        assert_eq!(
            take(),
            vec![format!("commit {g} 8"), format!("propose {g} 8")]
        );
    }
}
