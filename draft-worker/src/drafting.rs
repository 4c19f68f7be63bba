//! The drafting thread: per-request draft context kept in step with the target, one batched
//! `propose` over every waiting round of every stream.

use crate::{DraftArgs, DraftError, Result};
use dspark_proto::{DraftBlock, DraftCall, DraftReply, Dtype, QKind, Tensor};
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
                (
                    Box::new(NgramProposer::default()),
                    tok.vocab_size(),
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
        Ok(Self {
            copy_runs: proposer.copy_runs(),
            copy_head: proposer.copy_head(),
            drafter: kind.label(),
            row_len: feature_layers.len() * d_model,
            feature_layers,
            vocab,
            vocab_hash,
            proposer,
            max_gamma: MAX_GAMMA,
        })
    }
}

/// Work for the drafting thread.
pub enum Job {
    Round {
        stream: u64,
        call: DraftCall,
        reply: tokio::sync::oneshot::Sender<DraftReply>,
    },
    /// The stream closed: free its requests.
    Drop { stream: u64 },
    /// Requests a stream finished, sent with a round refused as stale.
    Finish { stream: u64, seqs: Vec<u64> },
}

struct ReqState {
    tokens: Vec<u32>,
    rng: Rng,
    /// Sent with the request's first round.
    params: kernels::sampling::SamplingParams,
}

/// Per-request state and the proposer; owned by the drafting thread.
pub struct Drafting {
    host: DraftHost,
    ids: HashMap<(u64, u64), u64>,
    states: HashMap<u64, ReqState>,
    next_id: u64,
}

/// Requests one draft worker keeps state for, over all its streams: a target worker runs a
/// few hundred at most, so a stream opening more is refused before it exhausts memory.
pub const MAX_REQUESTS: usize = 16_384;
/// Longest context one request may sync (tokens), well past any model's context here.
pub const MAX_CONTEXT_TOKENS: usize = 1 << 18;

fn bad(m: impl Into<String>) -> String {
    m.into()
}

impl Drafting {
    pub fn new(host: DraftHost) -> Self {
        Self {
            host,
            ids: HashMap::new(),
            states: HashMap::new(),
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
                    Job::Drop { stream } => self.drop_stream(stream),
                    Job::Finish { stream, seqs } => self.finish(stream, &seqs),
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

    fn drop_stream(&mut self, stream: u64) {
        let gone: Vec<(u64, u64)> = self.ids.keys().filter(|k| k.0 == stream).copied().collect();
        for k in gone {
            if let Some(g) = self.ids.remove(&k) {
                self.states.remove(&g);
                self.host.proposer.finish(g);
            }
        }
    }

    fn finish(&mut self, stream: u64, seqs: &[u64]) {
        for &seq in seqs {
            if let Some(g) = self.ids.remove(&(stream, seq)) {
                self.states.remove(&g);
                self.host.proposer.finish(g);
            }
        }
    }

    fn check(&self, call: &DraftCall) -> Result<(), String> {
        for it in &call.items {
            if it.k as usize > self.host.max_gamma {
                return Err(bad(format!(
                    "request {}: k = {} exceeds the drafter's maximum {}",
                    it.seq, it.k, self.host.max_gamma
                )));
            }
            if let Some(&t) = it.tokens.iter().find(|&&t| t as usize >= self.host.vocab) {
                return Err(bad(format!(
                    "request {}: token {t} outside the vocabulary ({})",
                    it.seq, self.host.vocab
                )));
            }
            if let Some(s) = &it.sampling {
                s.to_params()
                    .map_err(|e| bad(format!("request {}: {e}", it.seq)))?;
            }
            if let Some(f) = &it.features {
                // Validated here without decoding; decoded once when applied.
                let (_, n) = f
                    .check()
                    .map_err(|e| bad(format!("request {}: features: {e}", it.seq)))?;
                if self.host.row_len > 0 && n % self.host.row_len != 0 {
                    return Err(bad(format!(
                        "request {}: features of {n} floats do not split into rows of {}",
                        it.seq, self.host.row_len
                    )));
                }
            }
        }
        Ok(())
    }

    /// Applies every round's syncs, drafts all of them in one `propose`, builds the replies.
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
            self.finish(*stream, &call.finished);
            if let Err(e) = self.check(call) {
                rep.error = e;
                replies.push(rep);
                continue;
            }
            for it in &call.items {
                // A request this worker holds nothing of must start from its first token: it
                // gets state (seed, sampling) only from the round that sends them.
                if it.sync_from > 0 && !self.ids.contains_key(&(*stream, it.seq)) {
                    rep.blocks.push(DraftBlock {
                        seq: it.seq,
                        need_sync: true,
                        have_tokens: 0,
                        ..Default::default()
                    });
                    continue;
                }
                if !self.ids.contains_key(&(*stream, it.seq)) && self.ids.len() >= MAX_REQUESTS {
                    rep.error = format!(
                        "request {}: this draft worker holds {} requests already (at most \
                         {MAX_REQUESTS}); finish some first",
                        it.seq,
                        self.ids.len()
                    );
                    break;
                }
                let g = *self.ids.entry((*stream, it.seq)).or_insert_with(|| {
                    self.next_id += 1;
                    self.next_id
                });
                let st = self.states.entry(g).or_insert_with(|| ReqState {
                    tokens: Vec::new(),
                    rng: Rng::new(it.seed ^ 0x5eed_d4af),
                    params: kernels::sampling::SamplingParams::greedy(),
                });
                if let Some(p) = it.sampling.as_ref().and_then(|s| s.to_params().ok()) {
                    st.params = p;
                }
                if it.sync_from as usize > st.tokens.len() {
                    rep.blocks.push(DraftBlock {
                        seq: it.seq,
                        need_sync: true,
                        have_tokens: st.tokens.len() as u32,
                        ..Default::default()
                    });
                    continue;
                }
                if it.sync_from as usize + it.tokens.len() > MAX_CONTEXT_TOKENS {
                    rep.error = format!(
                        "request {}: a context of {} tokens (at most {MAX_CONTEXT_TOKENS})",
                        it.seq,
                        it.sync_from as usize + it.tokens.len()
                    );
                    break;
                }
                st.tokens.truncate(it.sync_from as usize);
                st.tokens.extend_from_slice(&it.tokens);
                let r = self
                    .host
                    .proposer
                    .commit(g, &st.tokens)
                    .and_then(|_| match &it.features {
                        // A drafter that reads no features (n-gram, draft model) ignores them.
                        Some(f) if self.host.row_len > 0 => match f.to_f32() {
                            Ok(mut rows) => {
                                finite(&mut rows);
                                self.host.proposer.observe(g, it.feat_from as usize, &rows)
                            }
                            Err(e) => Err(specdec::SpecError::Invalid(format!("features: {e}"))),
                        },
                        _ => Ok(()),
                    });
                if let Err(e) = r {
                    rep.error = format!("request {}: {e}", it.seq);
                    break;
                }
                let params = st.params.clone();
                rep.blocks.push(DraftBlock {
                    seq: it.seq,
                    have_tokens: st.tokens.len() as u32,
                    ..Default::default()
                });
                want.push((ri, rep.blocks.len() - 1, g, it.k as usize, params));
            }
            replies.push(rep);
        }
        // One propose over every round's requests.
        want.retain(|w| replies[w.0].error.is_empty() && w.3 > 0);
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
                        let (ri, bi, _, k, _) = want[wi];
                        fill(&mut replies[ri].blocks[bi], b, k, self.host.vocab);
                    }
                }
                // One request the drafter cannot serve (a context past the draft model's)
                // must not cost the others their drafts: each is drafted alone, and one that
                // fails gets an empty block (its target decodes without a draft this step).
                Err(e) if reqs.len() > 1 => {
                    tracing::warn!("batched drafting failed ({e}); drafting one at a time");
                    for (wi, r) in order.into_iter().zip(reqs) {
                        let (ri, bi, g, k, _) = want[wi];
                        match self.host.proposer.propose(&mut [r]) {
                            Ok(mut b) if b.len() == 1 => {
                                let b = b.remove(0);
                                fill(&mut replies[ri].blocks[bi], b, k, self.host.vocab);
                            }
                            Ok(_) => {}
                            Err(e) => tracing::warn!(request = g, "drafting failed: {e}"),
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
        let us = t0.elapsed().as_micros() as u64;
        for ((_, _, tx), mut rep) in rounds.into_iter().zip(replies) {
            rep.compute_us = us;
            out.push((tx, rep));
        }
        out
    }
}

/// Hidden states that overflowed f16 (±∞) or came as NaN: clamped to f16's range, NaN read as
/// 0, so one bad value does not turn a request's cached context rows into NaN.
fn finite(rows: &mut [f32]) {
    const F16_MAX: f32 = 65504.0;
    for v in rows.iter_mut() {
        if !v.is_finite() {
            *v = if v.is_nan() {
                0.0
            } else {
                v.clamp(-F16_MAX, F16_MAX)
            };
        }
    }
}

/// Puts a drafted block on the wire: tokens, confidences, and q: one-hot; (token, probability)
/// pairs when every row is sparse (a draft vocabulary or truncated sampling: 8 bytes per kept
/// token instead of 4 per vocabulary entry); dense rows otherwise.
fn fill(m: &mut DraftBlock, b: specdec::proposer::DraftBlock, k: usize, vocab: usize) {
    let n = b.tokens.len().min(k);
    m.tokens = b.tokens[..n].to_vec();
    m.confidence = b
        .confidence
        .map(|c| c[..n.min(c.len())].to_vec())
        .unwrap_or_default();
    m.fitted_rates = b.fitted_rates;
    let dists = &b.dists[..n];
    if dists.iter().all(|d| matches!(d, Dist::OneHot)) {
        m.q_kind = QKind::OneHot as i32;
        return;
    }
    if !dists.iter().any(|d| matches!(d, Dist::Dense(_))) {
        for (i, d) in dists.iter().enumerate() {
            let before = m.q_ids.len();
            match d {
                Dist::Sparse(v) => {
                    for &(t, p) in v.iter().filter(|(t, _)| (*t as usize) < vocab) {
                        m.q_ids.push(t);
                        m.q_probs.push(p);
                    }
                }
                _ => {
                    m.q_ids.push(m.tokens[i]);
                    m.q_probs.push(1.0);
                }
            }
            m.q_lens.push((m.q_ids.len() - before) as u32);
        }
        m.q_kind = QKind::Sparse as i32;
        return;
    }
    let mut rows = vec![0f32; n * vocab];
    for (i, d) in dists.iter().enumerate() {
        let row = &mut rows[i * vocab..(i + 1) * vocab];
        match d {
            Dist::Dense(v) => row.copy_from_slice(&v[..vocab.min(v.len())]),
            Dist::Sparse(v) => {
                for &(t, p) in v {
                    if (t as usize) < vocab {
                        row[t as usize] = p;
                    }
                }
            }
            Dist::OneHot => row[m.tokens[i] as usize] = 1.0,
        }
    }
    m.q_kind = QKind::Dense as i32;
    m.q = Some(Tensor::from_f32(&rows, &[n, vocab], Dtype::F32));
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspark_proto::DraftItem;

    /// A drafter that cannot draft past a context of 8 tokens (as a draft model past its own
    /// context): it fails any batch holding such a request.
    struct Short;
    impl Proposer for Short {
        fn name(&self) -> &str {
            "short"
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

    /// One request the drafter cannot serve leaves its block empty; the others in the same
    /// batch still get theirs.
    #[test]
    fn one_request_the_drafter_fails_costs_the_others_nothing() {
        let r = round(vec![item(1, 4), item(2, 20), item(3, 5)]);
        assert!(r[0].error.is_empty(), "{:?}", r[0].error);
        let lens: Vec<usize> = r[0].blocks.iter().map(|b| b.tokens.len()).collect();
        assert_eq!(lens, vec![3, 0, 3]);
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
        tx.send(Job::Finish {
            stream: 7,
            seqs: vec![1],
        })
        .unwrap();
        drop(tx);
        d.run(rx, load.clone(), &metrics);
        assert_eq!(load.load(std::sync::atomic::Ordering::Relaxed), 0);
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
    fn non_finite_features_are_clamped() {
        let mut v = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.5];
        finite(&mut v);
        assert_eq!(v, vec![0.0, 65504.0, -65504.0, 1.5]);
    }

    /// A context past [`MAX_CONTEXT_TOKENS`] is refused with a message, nothing kept for it.
    #[test]
    fn a_context_past_the_limit_is_refused() {
        let mut d = drafting();
        let (tx, _rx) = tokio::sync::oneshot::channel();
        d.rounds(vec![(
            7,
            DraftCall {
                step: 1,
                items: vec![item(1, 4)],
                ..Default::default()
            },
            tx,
        )]);
        let (tx, _rx) = tokio::sync::oneshot::channel();
        let mut big = item(1, 0);
        big.sync_from = 4;
        big.tokens = vec![2; MAX_CONTEXT_TOKENS];
        let r = d.rounds(vec![(
            7,
            DraftCall {
                step: 2,
                items: vec![big],
                ..Default::default()
            },
            tx,
        )]);
        assert!(r[0].1.error.contains("at most"), "{:?}", r[0].1.error);
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
        fill(&mut m, b, 2, 10);
        assert_eq!(m.tokens, vec![4, 5]);
        assert_eq!(m.confidence, vec![0.6, 0.7]);
        assert!(m.fitted_rates);
        assert_eq!(m.q_kind, QKind::OneHot as i32);
    }
}
