//! Drafting through remote draft workers: a [`Proposer`] the engine calls like any other.
//!
//! Each draft worker address gets one long-lived bidirectional stream (a [`Link`], run by a
//! tokio task that reconnects with backoff). A round sends, per request, only what the draft
//! worker does not have yet: committed tokens since the last acknowledged length, and feature
//! rows since the last acknowledged position. The engine thread waits for the replies up to a
//! deadline; a request whose draft worker is gone, late, or confused drafts locally (n-gram by
//! default) for that cycle and resumes remote drafting when the link is back — a new link
//! generation resends its state in full. A request whose draft worker stays down past a grace
//! (replaced at a new address) moves to another up draft worker, which gets its state in full.
//! Nothing here can fail a request.

use dspark_proto::draft_worker_client::DraftWorkerClient;
use dspark_proto::{DraftCall, DraftItem, DraftReply, Dtype, InfoRequest, QKind, WorkerInfo};
use prost::Message;
use specdec::proposer::{Dist, DraftBlock, ProposeReq};
use specdec::{Proposer, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Estimated bytes (either way) one drafting round carries at most: half of what a gRPC
/// message may hold (the estimates are upper bounds). One round for every request on a link overflowed the message limit on
/// sampled traffic (dense q rows of the whole vocabulary come back: 196 KB a drafted position
/// on SmolLM2, about 20 requests at γ = 4), and the link dropped and resent everything,
/// every step.
const ROUND_BYTES: u64 = dspark_proto::MAX_MESSAGE_BYTES as u64 / 2;

/// Finished request ids one round carries: well under a draft worker's per-round limit
/// (draft-worker `MAX_REQUESTS`, 16 384), which refuses a round past it whole.
const FINISHED_PER_ROUND: usize = 4096;

/// Rounds of (link, bytes, request index) items: per link in order, a new round whenever
/// the next item would take the round past `limit` (an item larger than `limit` goes alone).
fn pack_rounds(items: Vec<(String, u64, usize)>, limit: u64) -> Vec<(String, Vec<usize>)> {
    let mut rounds: Vec<(String, u64, Vec<usize>)> = Vec::new();
    let mut open: HashMap<String, usize> = HashMap::new();
    for (addr, bytes, i) in items {
        match open.get(&addr).map(|&r| &mut rounds[r]) {
            Some(r) if r.1 + bytes <= limit => {
                r.1 += bytes;
                r.2.push(i);
            }
            _ => {
                open.insert(addr.clone(), rounds.len());
                rounds.push((addr, bytes, vec![i]));
            }
        }
    }
    rounds.into_iter().map(|(a, _, idx)| (a, idx)).collect()
}

/// Feature rows kept per request for resending after a draft worker lost its state (DSpark
/// conditions on the last few dozen positions only).
const KEEP_ROWS: usize = 64;

/// Per-request wire statistics (reported in the usage extension).
#[derive(Clone, Debug, Default)]
pub struct WireStats {
    pub remote_cycles: u32,
    pub fallback_cycles: u32,
    pub bytes_to_draft: u64,
    pub bytes_from_draft: u64,
    pub rtt_us: u64,
    pub compute_us: u64,
}

/// State the gRPC service and the engine thread share with the proposer.
#[derive(Default)]
pub struct RemoteShared {
    /// Engine request id → draft worker address chosen by placement.
    pub assign: Mutex<HashMap<u64, String>>,
    pub stats: Mutex<HashMap<u64, WireStats>>,
}

#[derive(Default)]
struct LinkShared {
    up: AtomicBool,
    /// A round on this link ran past the drafting timeout and nothing has come back in time
    /// since: its requests draft locally, without waiting, until a reply in time or a new
    /// stream shows the worker answers again; every [`STALL_RETRY`] one more round probes it,
    /// not waited for (its requests draft locally that cycle too). A draft worker that stalls
    /// with its connection open (a paused or overloaded process) otherwise cost every step of
    /// the whole batch the full timeout. Set and cleared by the engine thread (which knows
    /// whether a reply came in time), cleared by a new stream.
    stalled: Mutex<Option<Instant>>,
    generation: AtomicU64,
    /// Since when the link has been down without a break (from its spawn if it never came
    /// up; `None` while up): a request paired with it past [`REPAIR_GRACE`] moves to
    /// another draft worker.
    down_since: Mutex<Option<Instant>>,
    calls: Mutex<Option<tokio::sync::mpsc::Sender<DraftCall>>>,
    pending: Mutex<HashMap<u64, std::sync::mpsc::Sender<(DraftReply, Instant)>>>,
    info: Mutex<Option<WorkerInfo>>,
}

/// How long a stalled link's requests draft locally before one round probes it again.
const STALL_RETRY: Duration = Duration::from_secs(2);

/// How long a round no longer waited for (late, out of time, or a probe) keeps its reply slot:
/// its reply's acknowledgements are applied when it comes (a draft worker that answers just
/// past the timeout would otherwise be resent the same tokens and rows every try).
const LATE_KEEP: Duration = Duration::from_secs(30);

/// How long a link stays down before its requests move to another draft worker: past a
/// reconnect after a blip (backoff reaches 1 s, plus a 500 ms connect timeout), so only a
/// draft worker that is gone (a pod replaced at a new address in a rolling update) loses
/// its requests; otherwise they would draft locally for the rest of their lives.
const REPAIR_GRACE: Duration = Duration::from_secs(2);

impl LinkShared {
    /// Stalled, and not yet due for another try.
    fn is_stalled(&self) -> bool {
        self.stalled
            .lock()
            .map(|s| s.is_some_and(|t| t.elapsed() < STALL_RETRY))
            .unwrap_or(false)
    }

    /// Stalled, and due for a probe (another round, not waited for).
    fn probe_due(&self) -> bool {
        self.stalled
            .lock()
            .map(|s| s.is_some_and(|t| t.elapsed() >= STALL_RETRY))
            .unwrap_or(false)
    }

    /// Hands a reply to whoever waits for its round: the engine, or its list of rounds it no
    /// longer waits for but still reads the acknowledgements of. A reply nobody waits for (the
    /// hello's, or a forgotten round's) is dropped.
    fn deliver(&self, rep: DraftReply) -> std::result::Result<(), String> {
        let waiter = self
            .pending
            .lock()
            .map_err(|e| e.to_string())?
            .remove(&rep.step);
        if let Some(w) = waiter {
            let _ = w.send((rep, Instant::now()));
        }
        Ok(())
    }

    /// How long the link has been down without a break (`None`: up, or not known).
    fn down_for(&self) -> Option<Duration> {
        if self.up.load(Ordering::SeqCst) {
            return None;
        }
        self.down_since.lock().ok()?.map(|t| t.elapsed())
    }
}

struct Link {
    shared: Arc<LinkShared>,
    finished: Vec<u64>,
    task: tokio::task::JoinHandle<()>,
    /// Said (once) that its drafter reads other target layers than the ones captured.
    mismatch_said: bool,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Who we are, sent on every new stream.
#[derive(Clone, Debug)]
pub struct Hello {
    pub worker: String,
    pub model: String,
    pub vocab_hash: String,
    /// The target's layers: a draft worker asking for the hidden states of others is refused.
    pub n_layers: usize,
    /// The cluster token every call to a draft worker carries.
    pub auth: dspark_scheduler::ClusterAuth,
}

/// Most target layers a drafter may condition on (DSpark's drafters take three).
pub const MAX_FEATURE_LAYERS: usize = 16;

/// The draft worker's feature layers, if this target can give them: each a layer it has,
/// none twice, at most [`MAX_FEATURE_LAYERS`]. A forward asked for a missing layer fails every
/// request in its batch, so a link that would ask for one is not opened.
fn check_feature_layers(layers: &[u32], n_layers: usize) -> std::result::Result<(), String> {
    if layers.len() > MAX_FEATURE_LAYERS {
        return Err(format!(
            "{} feature layers (at most {MAX_FEATURE_LAYERS})",
            layers.len()
        ));
    }
    for (i, &l) in layers.iter().enumerate() {
        if l as usize >= n_layers {
            return Err(format!(
                "feature layer {l} (this target has {n_layers} layers)"
            ));
        }
        if layers[..i].contains(&l) {
            return Err(format!("feature layer {l} listed twice"));
        }
    }
    Ok(())
}

/// The target layers an up link's drafter reads (None: down, or not yet known).
fn link_layers(l: &Link) -> Option<Vec<usize>> {
    if !l.shared.up.load(Ordering::SeqCst) {
        return None;
    }
    let i = l.shared.info.lock().ok()?;
    i.as_ref()
        .map(|i| i.feature_layers.iter().map(|&x| x as usize).collect())
}

/// Whether an up link's drafter reads other target layers than those captured (`ours`): its
/// requests get no rounds (a drafter that reads none takes any).
fn reads_other_layers(l: &Link, ours: &[usize]) -> bool {
    link_layers(l).is_some_and(|ls| !ls.is_empty() && ls != ours)
}

/// Whether a link would be sent rounds now (as [`RemoteProposer::groups`] decides).
fn takes_rounds(l: &Link, ours: &[usize]) -> bool {
    l.shared.up.load(Ordering::SeqCst) && !l.shared.is_stalled() && !reads_other_layers(l, ours)
}

fn spawn_link(rt: &tokio::runtime::Handle, addr: String, hello: Hello) -> Link {
    let shared = Arc::new(LinkShared {
        down_since: Mutex::new(Some(Instant::now())),
        ..Default::default()
    });
    let s = Arc::clone(&shared);
    let task = rt.spawn(async move {
        let mut backoff = Duration::from_millis(50);
        loop {
            match run_link(&addr, &hello, &s).await {
                Ok(()) => tracing::info!(draft = addr, "draft stream ended"),
                Err(e) => tracing::debug!(draft = addr, "draft link: {e}"),
            }
            let was_up = s.up.swap(false, Ordering::SeqCst);
            if was_up && let Ok(mut d) = s.down_since.lock() {
                *d = Some(Instant::now());
            }
            if let Ok(mut c) = s.calls.lock() {
                *c = None;
            }
            if let Ok(mut p) = s.pending.lock() {
                p.clear();
            }
            if was_up {
                tracing::warn!(
                    draft = addr,
                    "draft worker lost; drafting locally until it is back"
                );
                backoff = Duration::from_millis(50);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    });
    Link {
        shared,
        finished: Vec::new(),
        task,
        mismatch_said: false,
    }
}

async fn run_link(
    addr: &str,
    hello: &Hello,
    s: &Arc<LinkShared>,
) -> std::result::Result<(), String> {
    let url = dspark_scheduler::discovery::normalize_url(addr);
    let ch = tonic::transport::Endpoint::from_shared(url)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true)
        // A draft worker that vanished without closing the connection ends the link (and
        // requests draft locally) instead of leaving it waiting on a dead socket.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut client = DraftWorkerClient::new(hello.auth.channel(ch))
        .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(dspark_proto::MAX_MESSAGE_BYTES);
    let info = client
        .info(InfoRequest {})
        .await
        .map_err(|e| e.message().to_string())?
        .into_inner();
    if info.vocab_hash != hello.vocab_hash {
        return Err(format!(
            "draft worker {} has vocabulary {}, this target {}",
            info.id, info.vocab_hash, hello.vocab_hash
        ));
    }
    if let Err(e) = check_feature_layers(&info.feature_layers, hello.n_layers) {
        tracing::warn!(draft = addr, "draft worker {} refused: {e}", info.id);
        return Err(format!("draft worker {}: {e}", info.id));
    }
    if !info.copy_head.is_empty()
        && !drafter::proposer::copy_head_is_ours(Some(&info.copy_head_inputs))
    {
        tracing::warn!(
            draft = addr,
            inputs = info.copy_head_inputs,
            ours = drafter::proposer::COPY_HEAD_SPEC,
            "the draft worker's copy-run head reads other inputs than this release computes: \
             copy runs made here take its rates as confidences"
        );
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<DraftCall>(64);
    tx.send(DraftCall {
        step: 0,
        target_worker: hello.worker.clone(),
        model: hello.model.clone(),
        vocab_hash: hello.vocab_hash.clone(),
        ..Default::default()
    })
    .await
    .map_err(|e| e.to_string())?;
    let mut replies = client
        .draft(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|e| e.message().to_string())?
        .into_inner();
    *s.info.lock().map_err(|e| e.to_string())? = Some(info);
    *s.calls.lock().map_err(|e| e.to_string())? = Some(tx);
    s.generation.fetch_add(1, Ordering::SeqCst);
    if let Ok(mut st) = s.stalled.lock() {
        *st = None;
    }
    if let Ok(mut d) = s.down_since.lock() {
        *d = None;
    }
    s.up.store(true, Ordering::SeqCst);
    tracing::info!(draft = addr, "draft worker connected");
    while let Some(rep) = replies
        .message()
        .await
        .map_err(|e| e.message().to_string())?
    {
        // A late reply still reaches its round (its acknowledgements hold); whether it came
        // in time, and so ends a stall, the engine thread judges.
        s.deliver(rep)?;
    }
    Ok(())
}

struct ReqSync {
    link: String,
    generation: u64,
    tokens_acked: usize,
    /// Feature rows of positions `feat_base..feat_base + rows`, each of `feat_width` floats.
    feats: Vec<f32>,
    feat_base: usize,
    /// The length of the kept rows (0: none kept yet): the captured layers times the model
    /// width when they were observed.
    feat_width: usize,
    /// The target layers the kept rows hold (two drafters may read as many layers, others).
    feat_layers: Vec<usize>,
    feats_acked: usize,
    /// Rounds in a row whose answer for this request was a refusal (the draft worker held
    /// everything the round synced from, and still took none of it) or a block unusable here.
    refusals: u32,
    /// Drafting cycle before which it drafts locally (after n refusals in a row, the next
    /// 2^n − 1 cycles, at most 255): a request the draft worker keeps refusing was resent in
    /// full every cycle.
    skip_until: u64,
    /// Context length of the last item sent on this stream with drafts asked for, while no
    /// verdict on its block is recorded: the draft worker's latest block, as far as this side
    /// knows.
    sent_at: Option<usize>,
    /// Context length of the draft worker's block put into the drafts of the last cycle, if
    /// one was (the block the engine then verified, when `verified` names that length).
    used_at: Option<usize>,
    /// For the next item: the draft worker's block drafted at this context length had this
    /// many drafts verified (`DraftItem.verified_at` / `verified`).
    verdict: Option<(usize, usize)>,
}

impl ReqSync {
    fn new(link: String, generation: u64, feat_base: usize) -> Self {
        Self {
            link,
            generation,
            tokens_acked: 0,
            feats: Vec::new(),
            feat_base,
            feat_width: 0,
            feat_layers: Vec::new(),
            feats_acked: 0,
            refusals: 0,
            skip_until: 0,
            sent_at: None,
            used_at: None,
            verdict: None,
        }
    }

    /// Pairs it with stream `generation` of `link`, which holds nothing of it: its context
    /// and feature rows go again from the start, and no block or verdict of the last stream
    /// carries over (the drafter there starts afresh).
    fn rebind(&mut self, link: &str, generation: u64) {
        self.generation = generation;
        self.link = link.to_string();
        self.tokens_acked = 0;
        self.feats_acked = 0;
        self.refusals = 0;
        self.skip_until = 0;
        self.sent_at = None;
        self.used_at = None;
        self.verdict = None;
    }

    /// Rows kept of `rl` floats each (none when the kept rows are of another width).
    fn rows_of(&self, rl: usize) -> usize {
        if rl > 0 && self.feat_width == rl {
            self.feats.len() / rl
        } else {
            0
        }
    }

    /// Keeps rows of `layers` (`rl` floats each) from now on. Rows of other layers (captured
    /// before the feature layers changed: a rolling update between drafters reading other
    /// layers, of another count or as many) are dropped, never mixed with the new ones, and
    /// what the draft worker acknowledged of features is forgotten: the rows kept from now on
    /// go from the first.
    fn set_layers(&mut self, layers: &[usize], rl: usize) {
        if self.feat_width != rl || self.feat_layers != layers {
            self.feats.clear();
            self.feats_acked = 0;
            self.feat_width = rl;
            self.feat_layers = layers.to_vec();
        }
    }

    /// One more refusal in a row: local drafting for the next 2^refusals cycles (at most 256).
    fn back_off(&mut self, cycle: u64) {
        self.refusals = self.refusals.saturating_add(1);
        self.skip_until = cycle + (1u64 << self.refusals.min(8));
    }

    /// The verdict the next item carries, forgotten once taken: the one recorded, or else, for
    /// the block last asked for when no verdict on it came (the engine never verified it: the
    /// request did not draft in that step), none of its drafts verified.
    fn take_verdict(&mut self) -> Option<(usize, usize)> {
        let sent = self.sent_at.take().map(|at| (at, 0));
        self.verdict.take().or(sent)
    }
}

/// The remote proposer.
pub struct RemoteProposer {
    rt: tokio::runtime::Handle,
    shared: Arc<RemoteShared>,
    hello: Hello,
    links: HashMap<String, Link>,
    reqs: HashMap<u64, ReqSync>,
    fallback: Box<dyn Proposer>,
    timeout: Duration,
    feature_dtype: Dtype,
    d_model: usize,
    vocab: usize,
    step: u64,
    /// Drafting cycles (`propose` calls): prefetched rounds age by these, not by rounds sent
    /// (a cycle may send several per link).
    cycle: u64,
    /// The last `propose` waited out the timeout ([`Proposer::timed_out`]).
    timed_out: bool,
    /// Rounds sent ahead by `prefetch`, collected by a later `propose`.
    prefetched: Vec<Round>,
    /// Rounds no longer waited for (past the timeout, out of time, probes of a stalled link):
    /// their replies' acknowledgements are applied when they come, for up to [`LATE_KEEP`].
    late: Vec<Round>,
    /// Requests the fallback drafted for in the last cycle, with the context length it drafted
    /// at: its blocks' verdicts are its own.
    local: HashMap<u64, usize>,
    /// Requests a draft worker answered with an empty block this cycle: they draft locally
    /// without a second round.
    declined: std::collections::HashSet<u64>,
}

impl RemoteProposer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rt: tokio::runtime::Handle,
        shared: Arc<RemoteShared>,
        hello: Hello,
        fallback: Box<dyn Proposer>,
        timeout: Duration,
        feature_dtype: Dtype,
        d_model: usize,
        vocab: usize,
    ) -> Self {
        Self {
            rt,
            shared,
            hello,
            links: HashMap::new(),
            reqs: HashMap::new(),
            fallback,
            timeout,
            feature_dtype,
            d_model,
            vocab,
            step: 0,
            cycle: 0,
            timed_out: false,
            prefetched: Vec::new(),
            late: Vec::new(),
            local: HashMap::new(),
            declined: std::collections::HashSet::new(),
        }
    }

    /// Drops the links that are down and that no request or pending round uses: draft pods
    /// come and go at new addresses, and each link would otherwise redial its dead address
    /// every second for the life of the worker. A request paired with it again redials. An up
    /// link stays, used or not: its draft worker's description (the layers its drafter reads)
    /// is there for a request paired with it again, whose prefill captures the features it
    /// needs; an idle one does not decide the layers captured (`layers`).
    fn forget_idle_links(&mut self, finishing: Option<u64>) {
        // The request finishing now still has its pairing (the engine loop drops it after).
        let assigned: std::collections::HashSet<String> = self
            .shared
            .assign
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|(id, _)| Some(**id) != finishing)
                    .map(|(_, addr)| addr.clone())
                    .collect()
            })
            .unwrap_or_default();
        let (reqs, rounds, late) = (&self.reqs, &self.prefetched, &self.late);
        self.links.retain(|addr, l| {
            l.shared.up.load(Ordering::SeqCst)
                || assigned.contains(addr)
                || reqs.values().any(|r| &r.link == addr)
                || rounds.iter().chain(late).any(|r| &r.addr == addr)
        });
    }

    /// Re-pairs those of `ids` whose draft worker has been down past [`REPAIR_GRACE`] with the
    /// up link that would take their rounds (drafter reading `ours` or no layers, not stalled)
    /// and has the fewest requests here, ties by address: a draft pod replaced in a rolling
    /// update comes back at a new address, and the old pairing would leave them drafting
    /// locally to the end. They start there as new requests. With no such link they stay.
    fn repair_gone(&mut self, ids: &[u64], ours: &[usize]) {
        let gone: std::collections::HashSet<&String> = self
            .links
            .iter()
            .filter(|(_, l)| l.shared.down_for().is_some_and(|d| d > REPAIR_GRACE))
            .map(|(a, _)| a)
            .collect();
        if gone.is_empty() {
            return;
        }
        let mut load: HashMap<String, usize> = self
            .links
            .iter()
            .filter(|(_, l)| takes_rounds(l, ours))
            .map(|(a, _)| (a.clone(), 0))
            .collect();
        if load.is_empty() {
            return;
        }
        let mut moves = Vec::new();
        if let Ok(mut assign) = self.shared.assign.lock() {
            for a in assign.values() {
                if let Some(n) = load.get_mut(a) {
                    *n += 1;
                }
            }
            for &id in ids {
                if !assign.get(&id).is_some_and(|a| gone.contains(a)) {
                    continue;
                }
                let Some((new, n)) = load.iter_mut().min_by(|x, y| (*x.1, x.0).cmp(&(*y.1, y.0)))
                else {
                    break;
                };
                *n += 1;
                let new = new.clone();
                if let Some(old) = assign.insert(id, new.clone()) {
                    moves.push((id, old, new));
                }
            }
        }
        if moves.is_empty() {
            return;
        }
        for (id, old, new) in moves {
            tracing::info!(
                request = id,
                from = old,
                to = new,
                "draft worker gone: request moved to another draft worker"
            );
            // A stale acknowledgement must not carry over: the new worker holds nothing of it.
            let generation = self.links[&new].shared.generation.load(Ordering::SeqCst);
            if let Some(rs) = self.reqs.get_mut(&id) {
                rs.rebind(&new, generation);
            }
            // Nor may a late reply of the old stream be applied to it.
            for r in self
                .prefetched
                .iter_mut()
                .chain(self.late.iter_mut())
                .filter(|r| r.addr == old)
            {
                r.sent.remove(&id);
                r.verdicts.remove(&id);
            }
        }
        self.drop_empty_rounds();
        // The gone link stops redialing once none of its requests is left.
        self.forget_idle_links(None);
    }

    /// Drops the pending rounds (prefetched or late) left with no request: their replies have
    /// nowhere to go.
    fn drop_empty_rounds(&mut self) {
        for late in [false, true] {
            let list = if late {
                &mut self.late
            } else {
                &mut self.prefetched
            };
            let (done, keep): (Vec<Round>, Vec<Round>) = std::mem::take(list)
                .into_iter()
                .partition(|r| r.sent.is_empty());
            *list = keep;
            for r in &done {
                self.forget(r);
            }
        }
    }

    fn link_for(&mut self, id: u64) -> Option<String> {
        let addr = self.shared.assign.lock().ok()?.get(&id).cloned()?;
        if !self.links.contains_key(&addr) {
            let l = spawn_link(&self.rt, addr.clone(), self.hello.clone());
            self.links.insert(addr.clone(), l);
        }
        Some(addr)
    }

    /// The target layers the forward captures for the draft workers: those of the up link
    /// first by address among those in use — a request paired with it, or syncing with it
    /// (one set for every request; not whichever the map yields first). A link nobody uses
    /// does not decide: a draft worker paired once with a request, whose drafter reads other
    /// layers, would otherwise leave every other draft worker's requests without rounds for as
    /// long as it stays up. A draft worker whose drafter reads other layers (a rolling update
    /// between drafters) is not sent rounds: its requests draft locally, rather than its
    /// drafter read the wrong layers' features.
    fn layers(&self) -> Vec<usize> {
        // A drafter that reads no features (a draft model, n-gram) takes any.
        let mut known: Vec<(&String, Vec<usize>)> = self
            .links
            .iter()
            .filter_map(|(a, l)| Some((a, link_layers(l).filter(|ls| !ls.is_empty())?)))
            .collect();
        if known.is_empty() {
            return Vec::new();
        }
        known.sort_unstable_by(|x, y| x.0.cmp(y.0));
        let assign = self.shared.assign.lock().ok();
        let in_use = |addr: &String| {
            self.reqs.values().any(|r| &r.link == addr)
                || assign
                    .as_ref()
                    .is_some_and(|a| a.values().any(|x| x == addr))
        };
        known
            .into_iter()
            .find(|(a, _)| in_use(a))
            .map(|(_, ls)| ls)
            .unwrap_or_default()
    }

    /// The copy-run rates the request's draft worker published (empty: none, or not known
    /// while its link is down), and their confidence head if it published one over the inputs
    /// this release computes.
    fn copy_runs_for(&mut self, id: u64) -> (Vec<f32>, Option<drafter::model::GreedyHead>) {
        let Some(addr) = self.link_for(id) else {
            return (Vec::new(), None);
        };
        self.links
            .get(&addr)
            .filter(|l| l.shared.up.load(Ordering::SeqCst))
            .and_then(|l| {
                let i = l.shared.info.lock().ok()?;
                i.as_ref().map(|i| {
                    // A head over other inputs (another release's) is not read: the rates serve.
                    let ours = drafter::proposer::copy_head_is_ours(Some(&i.copy_head_inputs));
                    let head = ours
                        .then(|| {
                            drafter::model::GreedyHead::from_flat(
                                &i.copy_head,
                                drafter::proposer::COPY_HEAD_INPUTS,
                            )
                        })
                        .flatten();
                    (i.copy_runs.clone(), head)
                })
            })
            .unwrap_or_default()
    }

    fn stat(&self, id: u64, f: impl FnOnce(&mut WireStats)) {
        if let Ok(mut m) = self.shared.stats.lock() {
            f(m.entry(id).or_default());
        }
    }

    /// Converts a reply block into the engine's block; `None` when it is unusable.
    fn block_from_wire(&self, b: &dspark_proto::DraftBlock, k: usize) -> Option<DraftBlock> {
        let n = b.tokens.len().min(k);
        if b.tokens[..n].iter().any(|&t| t as usize >= self.vocab) {
            return None;
        }
        // Only an explicit one-hot kind reads as one-hot: an unspecified or unknown kind may
        // carry drafts sampled from a real q, and verifying those as one-hot is not lossless.
        let dists = if n == 0 {
            Vec::new()
        } else if b.q_kind == QKind::OneHot as i32 {
            vec![Dist::OneHot; n]
        } else {
            let rows = if b.q_kind == QKind::Dense as i32 {
                dense_rows(b, n, self.vocab)
            } else if b.q_kind == QKind::Sparse as i32 {
                sparse_rows(b, n, self.vocab)
            } else {
                None
            };
            if rows.is_none() {
                tracing::debug!(
                    request = b.seq,
                    q_kind = b.q_kind,
                    "q rows unusable: the request drafts locally"
                );
            }
            rows?
        };
        // Cut at the first unusable row.
        let n = dists.len().min(n);
        let confidence = (b.confidence.len() >= n && n > 0).then(|| {
            b.confidence[..n]
                .iter()
                .map(|c| {
                    if c.is_finite() {
                        c.clamp(0.0, 1.0)
                    } else {
                        0.0
                    }
                })
                .collect()
        });
        Some(DraftBlock {
            tokens: b.tokens[..n].to_vec(),
            dists,
            confidence,
            conf_inputs: None,
            fitted_rates: b.fitted_rates,
        })
    }
}

/// A drafting round in flight: what each request's state was when it was sent.
struct Round {
    addr: String,
    /// The stream generation of `addr` it was sent on.
    generation: u64,
    step: u64,
    /// The drafting cycle it was sent in.
    cycle: u64,
    rx: std::sync::mpsc::Receiver<(DraftReply, Instant)>,
    t0: Instant,
    /// Per request: context length and feature rows covered, k, and the tokens it synced
    /// from.
    sent: HashMap<u64, (usize, usize, usize, usize)>,
    /// Per request, the verdict its item carried: one the draft worker did not apply (it
    /// answered need_sync) goes again with the next item.
    verdicts: HashMap<u64, (usize, usize)>,
    /// The reply, once drained.
    ready: Option<(DraftReply, Instant)>,
    /// Whether its acknowledgements were applied when it was drained: applying the reply
    /// again (for its blocks) must not record them (nor a need_sync, nor a back-off) a second
    /// time, after newer replies of its link.
    drained: bool,
    /// Sent to a stalled link to see whether it answers in time again, not waited for.
    probe: bool,
}

impl Round {
    /// Whether it went on the stream `rs` is paired with now: a round of an earlier stream
    /// (before a reconnect, or a re-pairing with another draft worker) says nothing of what
    /// this one holds.
    fn is_current(&self, rs: &ReqSync) -> bool {
        rs.link == self.addr && rs.generation == self.generation
    }
}

impl RemoteProposer {
    /// Applies the acknowledgements of prefetched and late rounds whose replies are in, for
    /// requests that are not drafting this cycle (so their next round does not resend what the
    /// draft worker already has); prefetched rounds' blocks stay available for a `propose`
    /// that wants them.
    fn drain_ready(&mut self) {
        self.catch_up(None, u64::MAX);
    }

    /// Applies the acknowledgements of the replies in for rounds nobody waits on — prefetched
    /// ones not collected yet and late ones — on `addr` (any link: `None`) and sent before step
    /// `before`, in the order they were sent. A draft worker answers a stream's rounds in
    /// order, so this, called before a reply is applied, applies every earlier reply of its
    /// link first: an earlier one applied after a later need_sync would record more than the
    /// worker (which lost the state in between) holds. A late probe's reply in time ends its
    /// link's stall; a late round is done with once its reply is in, or past [`LATE_KEEP`].
    fn catch_up(&mut self, addr: Option<&str>, before: u64) {
        let late = std::mem::take(&mut self.late);
        let prefetched = std::mem::take(&mut self.prefetched);
        let mut rounds: Vec<(bool, Round)> = late
            .into_iter()
            .map(|r| (true, r))
            .chain(prefetched.into_iter().map(|r| (false, r)))
            .collect();
        rounds.sort_by_key(|(_, r)| r.step);
        for (late, mut round) in rounds {
            let due = round.ready.is_none()
                && round.step < before
                && addr.is_none_or(|a| a == round.addr);
            let rep = if due {
                round.rx.try_recv()
            } else {
                Err(std::sync::mpsc::TryRecvError::Empty)
            };
            match rep {
                Ok(rep) => {
                    let mut none: Vec<Option<DraftBlock>> = Vec::new();
                    self.apply(&round, &rep, &[], &HashMap::new(), &mut none);
                    if !late {
                        // Nobody had given up on it (as for a reply collected by `propose`).
                        self.answered(&round);
                        round.drained = true;
                        round.ready = Some(rep);
                        self.prefetched.push(round);
                    } else if round.probe
                        && rep.1.saturating_duration_since(round.t0) <= self.timeout
                    {
                        self.answered(&round);
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if !late {
                        self.prefetched.push(round);
                    } else if due && round.t0.elapsed() > LATE_KEEP {
                        self.forget(&round);
                    } else {
                        self.late.push(round);
                    }
                }
                // Its stream ended: the new one holds nothing it acknowledges.
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {}
            }
        }
    }

    /// A reply came in time for a round on the link's current stream: a stall ends.
    fn answered(&self, round: &Round) {
        let Some(l) = self.links.get(&round.addr) else {
            return;
        };
        if l.shared.generation.load(Ordering::SeqCst) != round.generation {
            return;
        }
        if l.shared
            .stalled
            .lock()
            .map(|mut s| s.take().is_some())
            .unwrap_or(false)
        {
            tracing::info!(draft = round.addr, "draft worker answers again");
        }
    }

    /// Applies a reply collected by `propose` (every earlier reply of its link first), and
    /// ends its link's stall: it came in time.
    fn collect(
        &mut self,
        round: &Round,
        rep: &(DraftReply, Instant),
        reqs: &[ProposeReq<'_>],
        ids: &HashMap<u64, usize>,
        out: &mut [Option<DraftBlock>],
    ) {
        self.catch_up(Some(&round.addr), round.step);
        self.apply(round, rep, reqs, ids, out);
        self.answered(round);
    }

    /// The links of `groups` due for a probe: stalled, and not tried for [`STALL_RETRY`].
    fn probe_due(&self, groups: &[(String, Vec<usize>)]) -> std::collections::HashSet<String> {
        groups
            .iter()
            .map(|(a, _)| a)
            .filter(|a| self.links.get(*a).is_some_and(|l| l.shared.probe_due()))
            .cloned()
            .collect()
    }

    /// Sends nothing; leaves a round just sent to a stalled link as a probe: not waited for
    /// (its requests draft locally this cycle, and the engine waits on no link that has been
    /// late), its acknowledgements applied when its reply comes, which ends the stall if it
    /// came within the timeout. The next probe goes [`STALL_RETRY`] from now.
    fn probe(&mut self, mut round: Round) {
        if let Some(l) = self.links.get(&round.addr)
            && let Ok(mut s) = l.shared.stalled.lock()
        {
            *s = Some(Instant::now());
        }
        tracing::debug!(
            draft = round.addr,
            step = round.step,
            "draft worker late: probed"
        );
        round.probe = true;
        self.late.push(round);
    }

    /// Requests by the (up) draft worker they are paired with (re-pairing those whose draft
    /// worker is gone), in rounds of at most [`ROUND_BYTES`] estimated each way; the rest
    /// draft locally.
    fn groups(&mut self, reqs: &[ProposeReq<'_>]) -> Vec<(String, Vec<usize>)> {
        let mut items = Vec::new();
        let ours = self.layers();
        let rl = ours.len() * self.d_model;
        let drafting: Vec<u64> = reqs.iter().filter(|r| r.k > 0).map(|r| r.id).collect();
        self.repair_gone(&drafting, &ours);
        let mut mismatched = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.k == 0 {
                continue;
            }
            if let Some(a) = self.link_for(r.id) {
                let l = &self.links[&a].shared;
                // Backing off from this link's stream; another link or a new stream (a
                // restarted worker) is tried at once.
                let generation = l.generation.load(Ordering::SeqCst);
                if self.reqs.get(&r.id).is_some_and(|rs| {
                    rs.skip_until > self.cycle && rs.link == a && rs.generation == generation
                }) {
                    continue;
                }
                if l.up.load(Ordering::SeqCst) && !l.is_stalled() {
                    if reads_other_layers(&self.links[&a], &ours) {
                        mismatched.push(a);
                        continue;
                    }
                    let b = self.round_bytes(r, &a, rl);
                    items.push((a, b, i));
                }
            }
        }
        for a in mismatched {
            if let Some(l) = self.links.get_mut(&a)
                && !std::mem::replace(&mut l.mismatch_said, true)
            {
                tracing::warn!(
                    draft = a,
                    layers = ?link_layers(l),
                    captured = ?ours,
                    "this draft worker's drafter reads other target layers than the other \
                     draft workers': its requests draft locally until the pool agrees"
                );
            }
        }
        pack_rounds(items, ROUND_BYTES)
    }

    /// What drafting `r` on `addr` puts on the wire, at most, one way: its unacknowledged
    /// tokens and feature rows going, or its drafts coming back (dense q rows of the whole
    /// vocabulary when it samples), whichever is larger. `rl`: the floats of a feature row
    /// (the captured layers', computed once per round by the caller).
    fn round_bytes(&self, r: &ProposeReq<'_>, addr: &str, rl: usize) -> u64 {
        let generation = self
            .links
            .get(addr)
            .map(|l| l.shared.generation.load(Ordering::SeqCst));
        // On a new stream (a reconnect) everything is resent, as `send_round` does.
        let (tokens, rows) = match self.reqs.get(&r.id) {
            Some(rs) if rs.link == addr && Some(rs.generation) == generation => {
                let fed = rs.feat_base + rs.rows_of(rl);
                (
                    r.context.len().saturating_sub(rs.tokens_acked),
                    fed.saturating_sub(rs.feats_acked.max(rs.feat_base)),
                )
            }
            Some(rs) => (r.context.len(), rs.rows_of(rl)),
            None => (r.context.len(), 0),
        };
        let elem = match self.feature_dtype {
            Dtype::F32 => 4,
            _ => 2,
        };
        let going = 4 * tokens as u64 + (rows * rl * elem) as u64;
        let q = if r.params.temperature > 0.0 {
            4 * self.vocab as u64
        } else {
            0
        };
        let coming = r.k as u64 * (16 + q);
        going.max(coming) + 64
    }

    /// Sends one round for `idx` of `reqs` to `addr`: per request only what the draft worker
    /// has not acknowledged.
    fn send_round(
        &mut self,
        addr: &str,
        reqs: &mut [ProposeReq<'_>],
        idx: &[usize],
    ) -> Option<Round> {
        self.step += 1;
        let step = self.step;
        let layers = self.layers();
        let generation = self
            .links
            .get(addr)?
            .shared
            .generation
            .load(Ordering::SeqCst);
        let mut items = Vec::with_capacity(idx.len());
        let mut sent = HashMap::new();
        let mut verdicts = HashMap::new();
        // Counted once the round is on its way (a refused one carried nothing).
        let mut bytes = Vec::with_capacity(idx.len());
        for &i in idx {
            let r = &mut reqs[i];
            let (item, feat_end, acked) = self.build_item(addr, generation, &layers, r);
            bytes.push((r.id, item.encoded_len() as u64));
            sent.insert(r.id, (r.context.len(), feat_end, r.k, acked));
            if let Some(v) = item.verified {
                verdicts.insert(r.id, (item.verified_at as usize, v as usize));
            }
            items.push(item);
        }
        // At most FINISHED_PER_ROUND of them (a draft worker refuses a round with more than
        // its MAX_REQUESTS, and the ids would be lost with it); the rest go with the next.
        let finished = {
            let l = &mut self.links.get_mut(addr)?.finished;
            let n = l.len().min(FINISHED_PER_ROUND);
            l.drain(..n).collect::<Vec<u64>>()
        };
        let link = &self.links[addr];
        let call = DraftCall {
            step,
            items,
            finished,
            ..Default::default()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        if let Ok(mut p) = link.shared.pending.lock() {
            p.insert(step, tx);
        }
        let refused = match link.shared.calls.lock() {
            Ok(c) => match c.as_ref() {
                Some(tx) => tx.try_send(call).err().map(|e| e.into_inner()),
                None => Some(call),
            },
            Err(_) => Some(call),
        };
        if let Some(call) = refused {
            if let Ok(mut p) = link.shared.pending.lock() {
                p.remove(&step);
            }
            // The verdicts it carried go with the requests' next items (and it asked for no
            // block).
            for it in &call.items {
                if let Some(rs) = self.reqs.get_mut(&it.seq) {
                    rs.sent_at = None;
                    if let Some(v) = it.verified {
                        rs.verdict = Some((it.verified_at as usize, v as usize));
                    }
                }
            }
            // The ids that finished did not leave: they go with the next round, or the draft
            // worker would hold their state until the stream closes (a late draft worker
            // fills the channel, and every refused round would leak them).
            if let Some(l) = self.links.get_mut(addr) {
                l.finished.extend(call.finished);
            }
            return None;
        }
        if let Ok(mut m) = self.shared.stats.lock() {
            for (id, b) in bytes {
                m.entry(id).or_default().bytes_to_draft += b;
            }
        }
        Some(Round {
            addr: addr.to_string(),
            generation,
            step,
            cycle: self.cycle,
            rx,
            t0: Instant::now(),
            sent,
            verdicts,
            ready: None,
            drained: false,
            probe: false,
        })
    }

    /// The item that drafts `r` on `addr`'s stream of `generation` (feature rows of `rl`
    /// floats): only what the draft worker has not acknowledged, and the verdict on its previous
    /// block. Returns it with the feature rows it covers and the tokens it syncs from.
    fn build_item(
        &mut self,
        addr: &str,
        generation: u64,
        layers: &[usize],
        r: &mut ProposeReq<'_>,
    ) -> (DraftItem, usize, usize) {
        let rl = layers.len() * self.d_model;
        let rs = self
            .reqs
            .entry(r.id)
            .or_insert_with(|| ReqSync::new(addr.to_string(), generation, 0));
        if rs.generation != generation || rs.link != addr {
            rs.rebind(addr, generation);
        }
        let verdict = rs.take_verdict();
        if r.k > 0 {
            rs.sent_at = Some(r.context.len());
        }
        let acked = rs.tokens_acked.min(r.context.len());
        if rl > 0 {
            // Rows kept of other layers (they changed since the rows were observed) are not
            // sent as rows of these.
            rs.set_layers(layers, rl);
        }
        let feat_end = if rl > 0 {
            rs.feat_base + rs.feats.len() / rl
        } else {
            0
        };
        let features = if rl > 0 && !rs.feats.is_empty() {
            let from = rs.feats_acked.max(rs.feat_base);
            // All of width `rl` (`set_layers`).
            let rows = rs.feats.get((from - rs.feat_base) * rl..).unwrap_or(&[]);
            (!rows.is_empty()).then(|| {
                (
                    from,
                    dspark_proto::Tensor::from_f32(
                        rows,
                        &[rows.len() / rl, rl],
                        self.feature_dtype,
                    ),
                )
            })
        } else {
            None
        };
        let item = DraftItem {
            seq: r.id,
            sync_from: acked as u32,
            tokens: r.context[acked..].to_vec(),
            feat_from: features.as_ref().map(|f| f.0 as u32).unwrap_or(0),
            features: features.map(|f| f.1),
            k: r.k as u32,
            // Sampling parameters and seed travel once, with the request's first tokens
            // (the draft worker keeps them with its state).
            sampling: (acked == 0).then(|| r.params.into()),
            seed: if acked == 0 { r.rng.next_u64() } else { 0 },
            verified_at: verdict.map_or(0, |v| v.0 as u32),
            verified: verdict.map(|v| v.1 as u32),
        };
        (item, feat_end, acked)
    }

    /// A round that ran past the drafting timeout: no longer waited for (its reply's
    /// acknowledgements still count when it comes), and its link marked stalled.
    fn stall(&mut self, round: Round) {
        self.timed_out = true;
        if let Some(l) = self.links.get(&round.addr) {
            let was = l
                .shared
                .stalled
                .lock()
                .map(|mut s| s.replace(Instant::now()).is_some())
                .unwrap_or(true);
            if !was {
                tracing::warn!(
                    draft = round.addr,
                    step = round.step,
                    timeout_ms = self.timeout.as_millis() as u64,
                    "draft worker late; drafting locally until it answers"
                );
            } else {
                tracing::debug!(
                    draft = round.addr,
                    step = round.step,
                    "draft worker still late"
                );
            }
        }
        self.late.push(round);
    }

    fn forget(&self, round: &Round) {
        if let Some(l) = self.links.get(&round.addr) {
            if let Ok(mut p) = l.shared.pending.lock() {
                p.remove(&round.step);
            }
        }
    }

    /// Records acknowledgements and turns blocks for requests whose context is unchanged since
    /// the round was sent into drafts. A drained round's acknowledgements (and need_sync) were
    /// recorded when it was drained: only its blocks are read again.
    fn apply(
        &mut self,
        round: &Round,
        rep: &(DraftReply, Instant),
        reqs: &[ProposeReq<'_>],
        ids: &HashMap<u64, usize>,
        out: &mut [Option<DraftBlock>],
    ) {
        let (rep, arrived) = rep;
        let rtt = arrived.saturating_duration_since(round.t0).as_micros() as u64;
        // A refused round drafts nothing, but the blocks it has still say what the draft
        // worker holds (a worker that refuses the round for one request has applied the ones
        // before it; one whose drafter failed, all): acknowledged, so they are not resent.
        let refused = !rep.error.is_empty();
        if refused {
            tracing::warn!(
                draft = round.addr,
                step = round.step,
                "draft worker refused a round: {}",
                rep.error
            );
        }
        for b in &rep.blocks {
            let Some(&(ctx_len, feat_end, _, synced_from)) = round.sent.get(&b.seq) else {
                continue;
            };
            let cycle = self.cycle;
            let Some(rs) = self.reqs.get_mut(&b.seq) else {
                continue;
            };
            // A reply of an earlier stream than the request's now (before a reconnect or a
            // re-pairing) acknowledges nothing on this one, nor refuses anything: applied, it
            // would have the stream sent tokens and rows from another offset (need_sync then
            // costs a round) or back off for another worker's refusal. Its block, drafted for
            // a context still current, is drafts like any other, but not this stream's.
            let current = round.is_current(rs);
            if b.need_sync {
                // A drained round's acknowledgements and need_sync were applied when it was
                // drained, in send order: applied again now, after newer replies of its link,
                // they would record what the worker held then, not now.
                if !current || round.drained {
                    continue;
                }
                // A worker that lost the request's state holds less than the round synced
                // from; one that holds all of it refused the request (bad input, full): that
                // is not healed by resending.
                if b.have_tokens as usize >= synced_from {
                    rs.back_off(cycle);
                }
                // The item was not applied: its verdict goes with the next one (unless a newer
                // one is recorded), or the drafter reads its block's outcome off the context. It
                // drafted no block at this context either: a verdict on the block drafted here
                // instead (the local fallback's) must not replace that one.
                if rs.verdict.is_none() {
                    rs.verdict = round.verdicts.get(&b.seq).copied();
                }
                if rs.sent_at == Some(ctx_len) {
                    rs.sent_at = None;
                }
                rs.tokens_acked = b.have_tokens as usize;
                rs.feats_acked = 0;
                continue;
            }
            if current && !round.drained {
                rs.tokens_acked = ctx_len;
                rs.feats_acked = feat_end;
            }
            if refused {
                continue;
            }
            let Some(&i) = ids.get(&b.seq) else { continue };
            if reqs[i].context.len() != ctx_len || out[i].is_some() {
                continue; // drafted for a context that has moved on
            }
            // A block that is not usable leaves the request to draft locally (backing off).
            let Some(blk) = self.block_from_wire(b, reqs[i].k) else {
                if let Some(rs) = self.reqs.get_mut(&b.seq)
                    && current
                {
                    rs.back_off(cycle);
                }
                continue;
            };
            if blk.tokens.is_empty() && reqs[i].k > 0 {
                // The remote drafter sat this one out (a draft model without room for it):
                // the local drafter may still have something, and this cycle asks the draft
                // worker no more (the current stream's: an earlier one's says nothing of it).
                if current {
                    self.declined.insert(b.seq);
                }
                continue;
            }
            // The verdict on it is not the current stream's block's.
            if let Some(rs) = self.reqs.get_mut(&b.seq)
                && current
            {
                rs.refusals = 0;
                // The engine verifies this block (or what its policy leaves of it).
                rs.used_at = Some(ctx_len);
            }
            let bytes = b.encoded_len() as u64;
            let compute = rep.compute_us;
            self.stat(b.seq, |s| {
                s.remote_cycles += 1;
                s.bytes_from_draft += bytes;
                s.rtt_us += rtt;
                s.compute_us += compute;
            });
            out[i] = Some(blk);
        }
        if refused && !round.drained {
            // A worker whose drafter failed the round is not asked again every step: its
            // requests draft locally for 2, 4, … 256 cycles, as after a refusal of one.
            let cycle = self.cycle;
            for seq in round.sent.keys() {
                if let Some(rs) = self.reqs.get_mut(seq)
                    && round.is_current(rs)
                {
                    rs.back_off(cycle);
                }
            }
        }
    }
}

impl Proposer for RemoteProposer {
    fn name(&self) -> &str {
        "remote"
    }

    fn feature_layers(&self) -> Vec<usize> {
        self.layers()
    }

    /// The rows kept per request for the draft worker (at least any drafter's context).
    fn context_rows(&self) -> usize {
        if self.layers().is_empty() {
            0
        } else {
            KEEP_ROWS
        }
    }

    fn observe(&mut self, id: u64, start: usize, rows: &[f32]) -> Result<()> {
        let layers = self.layers();
        self.observe_captured(id, start, &layers, rows)
    }

    /// Keeps the rows as rows of `layers`, those the forward captured: the links' layers may
    /// have changed since (a link went down or came up), and rows labelled with the new ones
    /// would reach a drafter reading those as features of layers they are not.
    fn observe_captured(
        &mut self,
        id: u64,
        start: usize,
        layers: &[usize],
        rows: &[f32],
    ) -> Result<()> {
        let rl = layers.len() * self.d_model;
        if rl == 0 || rows.len() % rl != 0 {
            return Ok(());
        }
        let link = self.link_for(id).unwrap_or_default();
        let r = self
            .reqs
            .entry(id)
            .or_insert_with(|| ReqSync::new(link, 0, start));
        // Rows of other layers are dropped, never truncated or extended at these.
        r.set_layers(layers, rl);
        if start < r.feat_base {
            r.feats.clear();
            r.feat_base = start;
        }
        let have = r.feat_base + r.feats.len() / rl;
        if start > have {
            // A gap: keep only what follows it.
            r.feats.clear();
            r.feat_base = start;
        } else {
            r.feats.truncate((start - r.feat_base) * rl);
        }
        r.feats_acked = r.feats_acked.min(start);
        r.feats.extend_from_slice(rows);
        let n = r.feats.len() / rl;
        if n > KEEP_ROWS {
            r.feats.drain(..(n - KEEP_ROWS) * rl);
            r.feat_base += n - KEEP_ROWS;
        }
        Ok(())
    }

    /// Records the verdict on the draft worker's block for its next item: the block verified
    /// when it was the one drafted remotely at `at`, none of its drafts otherwise (the engine
    /// verified a block made here: the fallback's, a copy run, or none after a late reply).
    fn verified(&mut self, id: u64, at: usize, k: usize) {
        if let Some(rs) = self.reqs.get_mut(&id) {
            if rs.used_at.take() == Some(at) {
                rs.verdict = Some((at, k));
                rs.sent_at = None;
            } else if let Some(sent) = rs.sent_at.take() {
                rs.verdict = Some((sent, 0));
            }
        }
        if self.local.remove(&id) == Some(at) {
            self.fallback.verified(id, at, k);
        }
    }

    fn finish(&mut self, id: u64) {
        self.local.remove(&id);
        for r in self.prefetched.iter_mut().chain(self.late.iter_mut()) {
            r.sent.remove(&id);
        }
        self.drop_empty_rounds();
        if let Some(r) = self.reqs.remove(&id) {
            // Only a request the draft worker holds on the current stream has state to free
            // there; ids for a stream that is gone (or a worker never reached) would pile up.
            if let Some(l) = self.links.get_mut(&r.link)
                && r.generation == l.shared.generation.load(Ordering::SeqCst)
                && l.shared.up.load(Ordering::SeqCst)
            {
                l.finished.push(id);
            }
            // The link's last request: no round would carry the ids soon (a target that
            // falls idle sends none), and the draft worker would hold their state, counted as
            // load, until the stream closes. A round of finished ids alone frees them now.
            if !self.reqs.values().any(|x| x.link == r.link) {
                if let Some(round) = self.send_round(&r.link, &mut [], &[]) {
                    self.forget(&round);
                }
            }
        }
        self.forget_idle_links(Some(id));
        self.fallback.finish(id);
    }

    fn pipelined(&self) -> bool {
        true
    }

    fn timed_out(&self) -> bool {
        self.timed_out
    }

    fn has_free_drafts(&self) -> bool {
        self.links.values().any(|l| {
            l.shared.up.load(Ordering::SeqCst)
                && l.shared
                    .info
                    .lock()
                    .is_ok_and(|i| i.as_ref().is_some_and(|i| !i.copy_runs.is_empty()))
        })
    }

    /// Copy runs with the rates (and copy-run head) the draft worker published, made here where
    /// the context is: the same drafts its drafter would make on a drafting call, without the
    /// call.
    fn propose_free(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>> {
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs.iter() {
            if r.k == 0 || !r.params.is_greedy() || r.params.shapes_logits() {
                out.push(DraftBlock::default());
                continue;
            }
            let (runs, head) = self.copy_runs_for(r.id);
            out.push(drafter::proposer::copy_block(
                r.context,
                r.k,
                &runs,
                head.as_ref(),
            ));
        }
        Ok(out)
    }

    fn prefetch(&mut self, reqs: &mut [ProposeReq<'_>]) {
        self.drain_ready();
        let groups = self.groups(reqs);
        let due = self.probe_due(&groups);
        for (addr, idx) in groups {
            if let Some(r) = self.send_round(&addr, reqs, &idx) {
                if due.contains(&addr) {
                    self.probe(r);
                } else {
                    self.prefetched.push(r);
                }
            }
        }
    }

    fn propose(&mut self, reqs: &mut [ProposeReq<'_>]) -> Result<Vec<DraftBlock>> {
        let mut out: Vec<Option<DraftBlock>> = vec![None; reqs.len()];
        for (i, r) in reqs.iter().enumerate() {
            if r.k == 0 {
                out[i] = Some(DraftBlock::default());
            }
        }
        self.drain_ready();
        self.cycle += 1;
        self.timed_out = false;
        self.declined.clear();
        let deadline = Instant::now() + self.timeout;
        // 1. Rounds prefetched for these requests (sent while the other micro-batch verified).
        // Only one drafted at a request's context now can give it drafts: one for another
        // micro-batch, or for contexts its requests have moved past (a cycle drafted by copy
        // runs, or with no drafts, came between), is not waited for (waiting would only
        // bring acknowledgements, and a slow one would stall its link). One with a request
        // of another micro-batch stays (for 16 cycles) for that one's `propose`; one whose
        // requests are all here, past its contexts, never matches again (contexts only grow):
        // done with if its reply is in (applied when drained), late (its acknowledgements
        // applied when it comes) if not.
        let ids: HashMap<u64, usize> = reqs.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
        let mut wanted = Vec::new();
        let mut keep = Vec::new();
        for round in std::mem::take(&mut self.prefetched) {
            let current = round.sent.iter().any(|(id, s)| {
                ids.get(id)
                    .is_some_and(|&i| reqs[i].k > 0 && reqs[i].context.len() == s.0)
            });
            let elsewhere = round.sent.keys().any(|id| !ids.contains_key(id));
            if current {
                wanted.push(round);
            } else if elsewhere && round.cycle + 16 > self.cycle {
                keep.push(round);
            } else if round.ready.is_some() {
                // Applied already; its blocks have nowhere to go.
                self.forget(&round);
            } else {
                self.late.push(round);
            }
        }
        self.prefetched = keep;
        for mut round in wanted {
            // A stalled link's round is not waited for (a reply already in counts).
            let stalled = self
                .links
                .get(&round.addr)
                .is_some_and(|l| l.shared.is_stalled());
            let left = if stalled {
                Duration::ZERO
            } else {
                deadline.saturating_duration_since(Instant::now())
            };
            let rep = match round.ready.take() {
                Some(r) => Ok(r),
                None => round.rx.recv_timeout(left),
            };
            match rep {
                Ok(rep) => self.collect(&round, &rep, reqs, &ids, &mut out),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !stalled => self.stall(round),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => self.late.push(round),
                Err(_) => self.forget(&round),
            }
        }
        // 2. The rest: one round per draft worker now (a probe, not waited for, to a stalled
        // one due for another try).
        let missing: Vec<usize> = (0..reqs.len()).filter(|&i| out[i].is_none()).collect();
        if !missing.is_empty() {
            let mut sub_groups: Vec<(String, Vec<usize>)> = Vec::new();
            for (addr, idx) in self.groups(reqs) {
                let v: Vec<usize> = idx
                    .into_iter()
                    .filter(|&i| out[i].is_none() && !self.declined.contains(&reqs[i].id))
                    .collect();
                if !v.is_empty() {
                    sub_groups.push((addr, v));
                }
            }
            let due = self.probe_due(&sub_groups);
            let mut rounds = Vec::new();
            for (addr, idx) in sub_groups {
                if let Some(r) = self.send_round(&addr, reqs, &idx) {
                    if due.contains(&addr) {
                        self.probe(r);
                    } else {
                        rounds.push(r);
                    }
                }
            }
            for round in rounds {
                let left = deadline.saturating_duration_since(Instant::now());
                match round.rx.recv_timeout(left) {
                    Ok(rep) => self.collect(&round, &rep, reqs, &ids, &mut out),
                    // Late only if it had most of the timeout (the deadline was set before the
                    // round was built and sent): a round sent after another link's prefetched
                    // one used up the cycle's time had little or none, and its link is not to
                    // blame (it would draft locally for `STALL_RETRY`). Either way the cycle
                    // waited out a timeout, not a drafting cost, and the reply's
                    // acknowledgements still count when it comes.
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                        if deadline.saturating_duration_since(round.t0) >= self.timeout / 2 =>
                    {
                        self.stall(round)
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        tracing::debug!(
                            draft = round.addr,
                            step = round.step,
                            "draft round out of time this cycle"
                        );
                        self.timed_out = true;
                        self.late.push(round);
                    }
                    Err(_) => {
                        tracing::debug!(draft = round.addr, step = round.step, "draft round lost");
                        self.forget(&round);
                    }
                }
            }
        }
        // 3. Local drafting for whatever the draft workers did not cover this cycle.
        let missing: Vec<usize> = (0..reqs.len()).filter(|&i| out[i].is_none()).collect();
        if !missing.is_empty() {
            let mut sub: Vec<ProposeReq<'_>> = Vec::with_capacity(missing.len());
            let mut mi = missing.iter().peekable();
            for (i, r) in reqs.iter_mut().enumerate() {
                if mi.peek() == Some(&&i) {
                    mi.next();
                    sub.push(ProposeReq {
                        id: r.id,
                        context: r.context,
                        k: r.k,
                        params: r.params,
                        rng: &mut *r.rng,
                    });
                }
            }
            let blocks = self.fallback.propose(&mut sub)?;
            for (&i, b) in missing.iter().zip(blocks) {
                self.stat(reqs[i].id, |s| s.fallback_cycles += 1);
                self.local.insert(reqs[i].id, reqs[i].context.len());
                out[i] = Some(b);
            }
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// How far a q row's mass may be from 1: f32 rows normalized in f64 (as `probs` does) are far
/// closer over any vocabulary here, while acceptance reads q as given, so a row off by more
/// would bias a sampled request's output.
const Q_MASS_TOLERANCE: f64 = 1e-3;

/// The mass of a row when it is 1 within [`Q_MASS_TOLERANCE`] (summed in f64).
fn q_mass(probs: impl Iterator<Item = f32>) -> Option<f64> {
    let mass: f64 = probs.map(f64::from).sum();
    ((mass - 1.0).abs() <= Q_MASS_TOLERANCE).then_some(mass)
}

/// A row scaled to its mass: the drafter drew its token in proportion to the row (sampling
/// scales by the total), while acceptance reads q as given; a row off by 1e-3 would bias the
/// output by as much.
fn normalized(row: impl Iterator<Item = f32>, mass: f64) -> impl Iterator<Item = f32> {
    row.map(move |p| (f64::from(p) / mass) as f32)
}

/// The first `n` rows of a dense q from the wire, up to the first unusable one: a probability
/// that is negative or not finite, a drafted token the row gives q = 0, or a row whose mass is
/// not 1. Row k depends only on the tokens before it, so cutting the block there keeps
/// whether a token is verified independent of the token itself. `None`: the block is
/// unusable whole (another width, too few values, or its first row unusable).
fn dense_rows(b: &dspark_proto::DraftBlock, n: usize, vocab: usize) -> Option<Vec<Dist>> {
    let t = b.q.as_ref()?;
    // Rows of another width (a draft worker whose model pads the same tokenizer's vocabulary
    // to another size) read at this width would be shifted rows: their mass can still be 1,
    // and acceptance would read the wrong q.
    if t.shape.len() != 2 || t.shape[1] as usize != vocab {
        return None;
    }
    let q = t.to_f32().ok()?;
    if vocab == 0 || q.len() < n.checked_mul(vocab)? || b.tokens.len() < n {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for (row, &drafted) in q.chunks_exact(vocab).zip(&b.tokens).take(n) {
        let mass = Some(())
            .filter(|_| row.iter().all(|p| p.is_finite() && *p >= 0.0))
            .filter(|_| row.get(drafted as usize).is_some_and(|&p| p > 0.0))
            .and_then(|_| q_mass(row.iter().copied()));
        let Some(mass) = mass else { break };
        out.push(Dist::Dense(normalized(row.iter().copied(), mass).collect()));
    }
    (!out.is_empty()).then_some(out)
}

/// The first `n` rows of a sparse q from the wire, up to the first unusable one (as
/// [`dense_rows`]): its length past the end, a token outside the vocabulary or listed twice
/// in it, a probability that is negative or not finite, a drafted token the row gives q = 0
/// (it could not have been drawn from it), or a mass that is not 1 (every token it leaves out
/// has q = 0, so its entries are the whole distribution). `None`: the block is unusable whole
/// (ids and probabilities of different lengths, too few row lengths, or its first row
/// unusable).
fn sparse_rows(b: &dspark_proto::DraftBlock, n: usize, vocab: usize) -> Option<Vec<Dist>> {
    if b.q_lens.len() < n || b.q_ids.len() != b.q_probs.len() || b.tokens.len() < n {
        return None;
    }
    let mut seen = vec![u32::MAX; vocab];
    let mut at = 0usize;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let len = b.q_lens[i] as usize;
        let row = (|| {
            let end = at.checked_add(len).filter(|&e| e <= b.q_ids.len())?;
            let mut row = Vec::with_capacity(len);
            for (&t, &p) in b.q_ids[at..end].iter().zip(&b.q_probs[at..end]) {
                let slot = seen.get_mut(t as usize)?;
                if *slot == i as u32 || !p.is_finite() || p < 0.0 {
                    return None;
                }
                *slot = i as u32;
                row.push((t, p));
            }
            let drafted = b.tokens[i];
            if !row.iter().any(|&(t, p)| t == drafted && p > 0.0) {
                return None;
            }
            let mass = q_mass(row.iter().map(|&(_, p)| p))?;
            at = end;
            Some(
                row.iter()
                    .map(|&(t, p)| (t, (f64::from(p) / mass) as f32))
                    .collect::<Vec<_>>(),
            )
        })();
        let Some(row) = row else { break };
        out.push(Dist::Sparse(row));
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A draft worker asking for layers the target lacks, the same layer twice or too many
    /// is refused before its link opens (a forward asked for them would fail every request).
    #[test]
    fn feature_layers_outside_the_target_refuse_the_link() {
        assert!(check_feature_layers(&[], 30).is_ok());
        assert!(check_feature_layers(&[5, 15, 28], 30).is_ok());
        let e = check_feature_layers(&[5, 30], 30).unwrap_err();
        assert!(e.contains("30"), "{e}");
        assert!(
            check_feature_layers(&[3, 3], 30)
                .unwrap_err()
                .contains("twice")
        );
        let many: Vec<u32> = (0..MAX_FEATURE_LAYERS as u32 + 1).collect();
        assert!(check_feature_layers(&many, 64).is_err());
        assert!(check_feature_layers(&vec![0; 10_000_000], 30).is_err());
    }

    /// Sampled requests on SmolLM2 (49152 tokens) at γ = 7 bring back 1.4 MB of q each: a
    /// round for all 32 on one link (44 MB) is past the 16 MiB message limit, so rounds are
    /// cut at half of it, per link, in order.
    #[test]
    fn drafting_rounds_stay_under_the_message_limit() {
        let per = 7 * (16 + 4 * 49_152) + 64;
        let items: Vec<(String, u64, usize)> =
            (0..32).map(|i| (format!("d{}", i % 2), per, i)).collect();
        let rounds = pack_rounds(items, ROUND_BYTES);
        assert!(rounds.len() > 2, "{}", rounds.len());
        let mut seen: Vec<usize> = Vec::new();
        for (addr, idx) in &rounds {
            assert!(idx.len() as u64 * per <= ROUND_BYTES, "{idx:?}");
            assert!(idx.iter().all(|i| format!("d{}", i % 2) == *addr));
            assert!(idx.windows(2).all(|w| w[0] < w[1]));
            seen.extend(idx);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..32).collect::<Vec<_>>());
        // Greedy requests bring back token ids only: one round per link.
        let small: Vec<(String, u64, usize)> =
            (0..32).map(|i| (format!("d{}", i % 2), 200, i)).collect();
        assert_eq!(pack_rounds(small, ROUND_BYTES).len(), 2);
        // One item past the limit still goes, alone.
        let r = pack_rounds(
            vec![
                ("a".into(), 10, 0),
                ("a".into(), ROUND_BYTES + 1, 1),
                ("a".into(), 10, 2),
            ],
            ROUND_BYTES,
        );
        assert_eq!(
            r,
            [
                ("a".into(), vec![0]),
                ("a".into(), vec![1]),
                ("a".into(), vec![2])
            ]
        );
    }

    fn block(
        tokens: Vec<u32>,
        ids: Vec<u32>,
        probs: Vec<f32>,
        lens: Vec<u32>,
    ) -> dspark_proto::DraftBlock {
        dspark_proto::DraftBlock {
            tokens,
            q_kind: QKind::Sparse as i32,
            q_ids: ids,
            q_probs: probs,
            q_lens: lens,
            ..Default::default()
        }
    }

    fn test_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// A remote proposer for a 4-layer target of width 4 and `vocab` tokens, whose fallback
    /// drafts nothing.
    fn test_proposer(
        rt: &tokio::runtime::Runtime,
        shared: Arc<RemoteShared>,
        vocab: usize,
    ) -> RemoteProposer {
        let hello = Hello {
            worker: "t".into(),
            model: "m".into(),
            vocab_hash: "h".into(),
            n_layers: 4,
            auth: Default::default(),
        };
        RemoteProposer::new(
            rt.handle().clone(),
            shared,
            hello,
            Box::new(specdec::proposer::NoProposer),
            Duration::from_millis(10),
            Dtype::F16,
            4,
            vocab,
        )
    }

    #[test]
    fn copy_runs_published_by_a_draft_worker_are_drafted_locally_for_free() {
        let rt = test_runtime();
        let shared = Arc::new(RemoteShared::default());
        let mut p = test_proposer(&rt, shared.clone(), 100);
        // Request 1 is placed on a draft worker that is up and published its rates (a link
        // to nowhere: only its shared state matters here).
        let addr = "127.0.0.1:9".to_string();
        if let Ok(mut a) = shared.assign.lock() {
            a.insert(1, addr.clone());
            a.insert(2, addr.clone());
        }
        assert!(
            p.copy_runs_for(1).0.is_empty(),
            "nothing known before the link is up"
        );
        assert!(!p.has_free_drafts());
        let link = &p.links[&addr];
        link.shared.up.store(true, Ordering::SeqCst);
        *link.shared.info.lock().expect("info") = Some(WorkerInfo {
            copy_runs: vec![0.3, 0.6, 0.7],
            ..Default::default()
        });
        assert!(p.has_free_drafts());
        // "5 6 7 8 5 6" repeats: a match of length 2 (rate 0.6) proposes 7, then 8 (length 3).
        let ctx = [5u32, 6, 7, 8, 5, 6];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let sampled = kernels::sampling::SamplingParams {
            temperature: 1.0,
            ..greedy.clone()
        };
        let (mut r1, mut r2) = (kernels::rng::Rng::new(1), kernels::rng::Rng::new(2));
        let mut reqs = vec![
            ProposeReq {
                id: 1,
                context: &ctx,
                k: 2,
                params: &greedy,
                rng: &mut r1,
            },
            ProposeReq {
                id: 2,
                context: &ctx,
                k: 2,
                params: &sampled,
                rng: &mut r2,
            },
        ];
        let out = p.propose_free(&mut reqs).expect("free drafts");
        assert_eq!(out[0].tokens, vec![7, 8]);
        assert_eq!(out[0].confidence.as_deref(), Some(&[0.6f32, 0.7][..]));
        assert!(matches!(out[0].dists[..], [Dist::OneHot, Dist::OneHot]));
        assert!(
            out[0].fitted_rates,
            "the engine recalibrates copy-run rates apart"
        );
        // Sampled requests get none (a copy run is a greedy draft).
        assert!(out[1].tokens.is_empty());
        // With a published head, its confidences: σ(bias) here, the weights being zero.
        *p.links[&addr].shared.info.lock().expect("info") = Some(WorkerInfo {
            copy_runs: vec![0.3, 0.6, 0.7],
            copy_head: [0.0; drafter::proposer::COPY_HEAD_INPUTS]
                .into_iter()
                .chain([0.0, 2.0])
                .collect(),
            copy_head_inputs: drafter::proposer::COPY_HEAD_SPEC.into(),
            ..Default::default()
        });
        let out = p.propose_free(&mut reqs).expect("free drafts");
        assert_eq!(out[0].tokens, vec![7, 8]);
        let c = out[0].confidence.clone().unwrap_or_default();
        assert!(
            (c[0] - 0.5).abs() < 1e-6 && (c[1] - 1.0 / (1.0 + (-2f32).exp())).abs() < 1e-6,
            "{c:?}"
        );
        // An untagged head is "copy-v1" (draft workers released before the tag) and is read;
        // one over another release's inputs is not: the rates serve.
        for (tag, head_read) in [("", true), ("copy-v0", false)] {
            if let Some(i) = p.links[&addr].shared.info.lock().expect("info").as_mut() {
                i.copy_head_inputs = tag.into();
            }
            let out = p.propose_free(&mut reqs).expect("free drafts");
            let rates = out[0].confidence.as_deref() == Some(&[0.6f32, 0.7][..]);
            assert_eq!(rates, !head_read, "tag {tag:?}: {:?}", out[0].confidence);
        }
        // A link that went down: its rates are not used.
        p.links[&addr].shared.up.store(false, Ordering::SeqCst);
        assert!(!p.has_free_drafts());
        assert!(
            p.propose_free(&mut reqs).expect("free drafts")[0]
                .tokens
                .is_empty()
        );
    }

    #[test]
    fn sparse_q_rows_round_trip_and_bad_ones_are_refused() {
        let b = block(vec![3, 7], vec![3, 5, 7], vec![0.6, 0.4, 1.0], vec![2, 1]);
        let rows = sparse_rows(&b, 2, 10).expect("a valid block");
        assert!(matches!(&rows[0], Dist::Sparse(r) if r == &vec![(3, 0.6), (5, 0.4)]));
        assert!(matches!(&rows[1], Dist::Sparse(r) if r == &vec![(7, 1.0)]));
        // Only the rows asked for are read.
        assert_eq!(sparse_rows(&b, 1, 10).map(|r| r.len()), Some(1));
        let bad = [
            block(vec![3], vec![3, 5], vec![0.6, 0.4], vec![3]), // lengths past the end
            block(vec![3], vec![3, 5], vec![0.6], vec![2]),      // ids and probs differ
            block(vec![3], vec![3, 12], vec![0.6, 0.4], vec![2]), // outside the vocabulary
            block(vec![3], vec![3, 3], vec![0.6, 0.4], vec![2]), // listed twice
            block(vec![3], vec![3, 5], vec![f32::NAN, 0.4], vec![2]), // not finite
            block(vec![3], vec![3, 5], vec![-0.1, 0.4], vec![2]), // negative
            block(vec![4], vec![3, 5], vec![0.6, 0.4], vec![2]), // drafted token has q = 0
            block(vec![3], vec![3, 5], vec![0.6, 0.4], vec![]),  // no row lengths
            block(vec![3], vec![3, 5], vec![0.6, 0.2], vec![2]), // mass 0.8
            block(vec![3], vec![3, 5], vec![0.6, 0.6], vec![2]), // mass 1.2
        ];
        for (i, b) in bad.iter().enumerate() {
            assert!(sparse_rows(b, 1, 10).is_none(), "case {i} accepted");
        }
        // An unusable later row cuts the block there (whether token 1 is verified must not
        // depend on the row token 1 leads to); rows are scaled to mass 1.
        let b = block(
            vec![3, 7],
            vec![3, 5, 7],
            vec![0.6, 0.4006, 0.9],
            vec![2, 1],
        );
        let rows = sparse_rows(&b, 2, 10).expect("the first row");
        assert_eq!(rows.len(), 1);
        let Dist::Sparse(r) = &rows[0] else {
            panic!("{rows:?}")
        };
        let mass: f64 = r.iter().map(|&(_, p)| f64::from(p)).sum();
        assert!((mass - 1.0).abs() < 1e-6, "{mass}");
        assert!((r[0].1 - 0.6 / 1.0006).abs() < 1e-6, "{r:?}");
    }

    /// Drafts whose q kind is unspecified or unknown are unusable (the request drafts
    /// locally), never read as one-hot; an explicit one-hot kind is.
    #[test]
    fn only_an_explicit_one_hot_kind_reads_as_one_hot() {
        let rt = test_runtime();
        let p = test_proposer(&rt, Arc::new(RemoteShared::default()), 10);
        let with_kind = |q_kind: i32| dspark_proto::DraftBlock {
            seq: 1,
            tokens: vec![3, 4],
            q_kind,
            ..Default::default()
        };
        for kind in [QKind::Unspecified as i32, 7] {
            assert!(
                p.block_from_wire(&with_kind(kind), 2).is_none(),
                "q kind {kind} read"
            );
            // No drafts: nothing to misread.
            let empty = dspark_proto::DraftBlock {
                tokens: Vec::new(),
                ..with_kind(kind)
            };
            assert!(
                p.block_from_wire(&empty, 2)
                    .is_some_and(|b| b.tokens.is_empty())
            );
        }
        let b = p
            .block_from_wire(&with_kind(QKind::OneHot as i32), 2)
            .expect("one-hot drafts");
        assert_eq!(b.tokens, vec![3, 4]);
        assert!(matches!(b.dists[..], [Dist::OneHot, Dist::OneHot]));
    }

    fn dense(tokens: Vec<u32>, q: &[f32], vocab: usize) -> dspark_proto::DraftBlock {
        dspark_proto::DraftBlock {
            q_kind: QKind::Dense as i32,
            q: Some(dspark_proto::Tensor::from_f32(
                q,
                &[q.len() / vocab, vocab],
                Dtype::F32,
            )),
            tokens,
            ..Default::default()
        }
    }

    /// Acceptance reads q as given: a dense row whose mass is not 1 (within rounding) would
    /// bias a sampled request's output, and is refused like any other unusable row.
    #[test]
    fn dense_q_rows_must_be_distributions() {
        let good = dense(vec![1, 2], &[0.25, 0.75, 0.0, 0.0, 0.0, 1.0], 3);
        let rows = dense_rows(&good, 2, 3).expect("a valid block");
        assert!(matches!(&rows[1], Dist::Dense(r) if r == &vec![0.0, 0.0, 1.0]));
        // Rounding in f32 is within the tolerance.
        let near = dense(vec![1], &[0.3, 0.7 + 1e-6, 0.0], 3);
        assert!(dense_rows(&near, 1, 3).is_some());
        let bad = [
            dense(vec![1], &[0.25, 0.5, 0.0], 3),     // mass 0.75
            dense(vec![1], &[0.5, 0.75, 0.0], 3),     // mass 1.25
            dense(vec![1], &[1.0, 0.0, 0.0], 3),      // drafted token has q = 0
            dense(vec![1], &[-0.5, 1.5, 0.0], 3),     // negative
            dense(vec![1, 2], &[0.25, 0.75, 0.0], 3), // fewer rows than tokens
        ];
        for (i, b) in bad.iter().enumerate() {
            let n = b.tokens.len();
            assert!(dense_rows(b, n, 3).is_none(), "case {i} accepted");
        }
        // A bad second row (mass 0.9) leaves a one-token block, its row scaled to mass 1.
        let cut = dense(vec![1, 2], &[0.3, 0.7009, 0.0, 0.0, 0.0, 0.9], 3);
        let rows = dense_rows(&cut, 2, 3).expect("the first row");
        assert_eq!(rows.len(), 1);
        let Dist::Dense(r) = &rows[0] else {
            panic!("{rows:?}")
        };
        assert!((r[0] - (0.3 / 1.0009) as f32).abs() < 1e-7, "{r:?}");
        assert!((r.iter().map(|&p| f64::from(p)).sum::<f64>() - 1.0).abs() < 1e-6);
    }

    /// A proposer (10 tokens) with request 1 placed on draft worker `a` and request 2 on `b`,
    /// both links up (links to nowhere: only their shared state is used).
    fn two_links(rt: &tokio::runtime::Runtime, a: &str, b: &str) -> RemoteProposer {
        let shared = Arc::new(RemoteShared::default());
        let mut p = test_proposer(rt, shared.clone(), 10);
        if let Ok(mut m) = shared.assign.lock() {
            m.insert(1, a.to_string());
            m.insert(2, b.to_string());
        }
        let (_, _) = (p.link_for(1), p.link_for(2));
        for addr in [a, b] {
            p.links[addr].shared.up.store(true, Ordering::SeqCst);
        }
        p
    }

    /// Requests 1 and 2 at `ctx`, k = 2.
    fn two_reqs<'a>(
        ctx: &'a [u32],
        params: &'a kernels::sampling::SamplingParams,
        rngs: &'a mut [kernels::rng::Rng; 2],
    ) -> Vec<ProposeReq<'a>> {
        let [r1, r2] = rngs;
        vec![
            ProposeReq {
                id: 1,
                context: ctx,
                k: 2,
                params,
                rng: r1,
            },
            ProposeReq {
                id: 2,
                context: ctx,
                k: 2,
                params,
                rng: r2,
            },
        ]
    }

    /// A round sent to "a" at `step` in cycle 0, with what each request's item covered
    /// (context length, feature rows, k, tokens synced from) and the verdicts they carried.
    fn test_round(
        step: u64,
        sent: &[(u64, (usize, usize, usize, usize))],
        verdicts: &[(u64, (usize, usize))],
    ) -> Round {
        Round {
            addr: "a".into(),
            generation: 0,
            step,
            cycle: 0,
            rx: std::sync::mpsc::channel().1,
            t0: Instant::now(),
            sent: sent.iter().copied().collect(),
            verdicts: verdicts.iter().copied().collect(),
            ready: None,
            drained: false,
            probe: false,
        }
    }

    /// A reply's unusable block costs only its own request a remote draft (it drafts
    /// locally); a refused round still records what the draft worker acknowledged.
    #[test]
    fn unusable_blocks_and_refused_rounds_keep_the_others_acknowledged() {
        let rt = test_runtime();
        let mut p = test_proposer(&rt, Arc::new(RemoteShared::default()), 10);
        let round = test_round(1, &[(1, (4, 0, 2, 0)), (2, (4, 0, 2, 0))], &[]);
        let ctx = [1u32, 2, 3, 4];
        let sampled = kernels::sampling::SamplingParams {
            temperature: 1.0,
            ..kernels::sampling::SamplingParams::greedy()
        };
        let (mut r1, mut r2) = (kernels::rng::Rng::new(1), kernels::rng::Rng::new(2));
        let reqs = vec![
            ProposeReq {
                id: 1,
                context: &ctx,
                k: 2,
                params: &sampled,
                rng: &mut r1,
            },
            ProposeReq {
                id: 2,
                context: &ctx,
                k: 2,
                params: &sampled,
                rng: &mut r2,
            },
        ];
        let ids: HashMap<u64, usize> = HashMap::from([(1, 0), (2, 1)]);
        let rep = DraftReply {
            step: 1,
            blocks: vec![
                // Request 1's q row has mass 0.8: unusable.
                dspark_proto::DraftBlock {
                    seq: 1,
                    ..block(vec![3], vec![3, 5], vec![0.6, 0.2], vec![2])
                },
                dspark_proto::DraftBlock {
                    seq: 2,
                    ..block(vec![3], vec![3, 5], vec![0.6, 0.4], vec![2])
                },
            ],
            ..Default::default()
        };
        let reset = |p: &mut RemoteProposer| {
            for id in [1, 2] {
                p.reqs.insert(id, ReqSync::new("a".into(), 0, 0));
            }
        };
        reset(&mut p);
        let mut out: Vec<Option<DraftBlock>> = vec![None, None];
        p.apply(
            &round,
            &(rep.clone(), Instant::now()),
            &reqs,
            &ids,
            &mut out,
        );
        assert!(out[0].is_none(), "request 1 drafts locally");
        assert_eq!(out[1].as_ref().map(|b| b.tokens.clone()), Some(vec![3]));
        assert_eq!(p.reqs[&1].tokens_acked, 4);
        assert_eq!(p.reqs[&2].tokens_acked, 4);
        // And backs off: it is not sent to the draft worker for the next cycles.
        assert_eq!((p.reqs[&1].refusals, p.reqs[&2].refusals), (1, 0));
        assert!(p.reqs[&1].skip_until > p.cycle && p.reqs[&2].skip_until <= p.cycle);
        // The same reply with the round's error: no drafts, but the acknowledgements hold.
        reset(&mut p);
        let refused = DraftReply {
            error: "drafting failed: test".into(),
            ..rep
        };
        let mut out: Vec<Option<DraftBlock>> = vec![None, None];
        p.apply(&round, &(refused, Instant::now()), &reqs, &ids, &mut out);
        assert!(out.iter().all(Option::is_none));
        assert_eq!(p.reqs[&1].tokens_acked, 4);
        assert_eq!(p.reqs[&2].tokens_acked, 4);
        // Both back off: the failing drafter is not asked every step.
        assert_eq!((p.reqs[&1].refusals, p.reqs[&2].refusals), (1, 1));
        assert!(p.reqs[&2].skip_until > p.cycle);
        // An empty block where drafts were asked for (the remote drafter sat it out) leaves
        // the request to the local drafter, without backing off.
        reset(&mut p);
        let empty = DraftReply {
            step: 1,
            blocks: vec![dspark_proto::DraftBlock {
                seq: 2,
                ..block(vec![], vec![], vec![], vec![])
            }],
            ..Default::default()
        };
        let mut out: Vec<Option<DraftBlock>> = vec![None, None];
        p.apply(&round, &(empty, Instant::now()), &reqs, &ids, &mut out);
        assert!(out[1].is_none(), "request 2 drafts locally");
        assert_eq!((p.reqs[&2].tokens_acked, p.reqs[&2].refusals), (4, 0));
        // need_sync from a worker that holds what the round synced from is a refusal (backs
        // off, doubling); from one that holds less, lost state (resent, no back-off).
        reset(&mut p);
        let synced = test_round(2, &[(1, (4, 0, 2, 0)), (2, (4, 0, 2, 3))], &[]);
        let need_sync = |seq: u64| dspark_proto::DraftBlock {
            seq,
            need_sync: true,
            have_tokens: 0,
            ..Default::default()
        };
        let rep = DraftReply {
            step: 2,
            blocks: vec![need_sync(1), need_sync(2)],
            ..Default::default()
        };
        for twice in [1, 2] {
            let mut out: Vec<Option<DraftBlock>> = vec![None, None];
            p.apply(
                &synced,
                &(rep.clone(), Instant::now()),
                &reqs,
                &ids,
                &mut out,
            );
            assert_eq!(p.reqs[&1].refusals, twice);
            assert_eq!(p.reqs[&1].skip_until, p.cycle + (1 << twice));
            assert_eq!(p.reqs[&2].refusals, 0, "lost state is no refusal");
        }
        // A prefetched round's reply is applied when drained (acknowledgements) and again when
        // its blocks are collected: the refusal counts once.
        let drained = Round {
            drained: true,
            ..synced
        };
        let mut out: Vec<Option<DraftBlock>> = vec![None, None];
        p.apply(
            &drained,
            &(rep.clone(), Instant::now()),
            &reqs,
            &ids,
            &mut out,
        );
        assert_eq!(p.reqs[&1].refusals, 2);
        // A dense q row of another width is refused even when its mass is 1.
        let wide = dense(vec![1], &[0.25, 0.75, 0.0, 0.0], 4);
        assert!(dense_rows(&wide, 1, 4).is_some());
        assert!(dense_rows(&wide, 1, 3).is_none());
    }

    /// Request 1's next item (greedy, k = 2) at `ctx`, on stream `generation` of "a".
    fn item_at(
        p: &mut RemoteProposer,
        ctx: &[u32],
        generation: u64,
        rng: &mut kernels::rng::Rng,
    ) -> (DraftItem, usize, usize) {
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut r = ProposeReq {
            id: 1,
            context: ctx,
            k: 2,
            params: &greedy,
            rng,
        };
        p.build_item("a", generation, &[], &mut r)
    }

    /// The draft worker learns, with the request's next item, how many drafts of its previous
    /// block the engine verified: what the verify policy left of a block of its that landed,
    /// none of one the engine never verified (a block made here instead, a step without
    /// drafts); once, and nothing about blocks of an earlier stream.
    #[test]
    fn the_next_item_says_how_many_of_the_remote_drafts_were_verified() {
        let rt = test_runtime();
        let mut p = test_proposer(&rt, Arc::new(RemoteShared::default()), 10);
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rng = kernels::rng::Rng::new(1);
        // The first item: no block before it, no verdict.
        let ctx = [1u32, 2, 3, 4];
        let mut r = ProposeReq {
            id: 1,
            context: &ctx,
            k: 2,
            params: &greedy,
            rng: &mut rng,
        };
        let (item, _, acked) = p.build_item("a", 0, &[], &mut r);
        assert_eq!(acked, 0);
        assert_eq!((item.verified_at, item.verified), (0, None));
        // Its block lands (drafted at context length 4) and the policy verifies 1 of its 2.
        let round = test_round(1, &[(1, (4, 0, 2, 0))], &[]);
        let rep = DraftReply {
            step: 1,
            blocks: vec![dspark_proto::DraftBlock {
                seq: 1,
                tokens: vec![3, 5],
                q_kind: QKind::OneHot as i32,
                ..Default::default()
            }],
            ..Default::default()
        };
        let reqs = vec![r];
        let ids: HashMap<u64, usize> = HashMap::from([(1, 0)]);
        let mut out: Vec<Option<DraftBlock>> = vec![None];
        p.apply(&round, &(rep, Instant::now()), &reqs, &ids, &mut out);
        assert_eq!(out[0].as_ref().map(|b| b.tokens.clone()), Some(vec![3, 5]));
        drop(reqs);
        p.verified(1, 4, 1);
        // The next item carries it.
        let ctx = [1u32, 2, 3, 4, 3, 7];
        let mut r = ProposeReq {
            id: 1,
            context: &ctx,
            k: 2,
            params: &greedy,
            rng: &mut rng,
        };
        let (item, _, acked) = p.build_item("a", 0, &[], &mut r);
        assert_eq!(acked, 4, "the round acknowledged the context");
        assert_eq!((item.verified_at, item.verified), (4, Some(1)));
        // The draft worker answers that item need_sync (it refused the request): the verdict
        // it did not apply goes again with the next item.
        let refused = test_round(2, &[(1, (6, 0, 2, 4))], &[(1, (4, 1))]);
        let rep = DraftReply {
            step: 2,
            blocks: vec![dspark_proto::DraftBlock {
                seq: 1,
                need_sync: true,
                have_tokens: 6,
                ..Default::default()
            }],
            ..Default::default()
        };
        let reqs = vec![r];
        let mut out: Vec<Option<DraftBlock>> = vec![None];
        p.apply(&refused, &(rep, Instant::now()), &reqs, &ids, &mut out);
        assert!(out[0].is_none());
        drop(reqs);
        // The local fallback drafts instead, and the engine says how much of its block it
        // verified: not the draft worker's business.
        p.verified(1, 6, 2);
        let (item, _, _) = item_at(&mut p, &ctx, 0, &mut rng);
        assert_eq!((item.verified_at, item.verified), (4, Some(1)));
        // This block (drafted at 6) is not the one verified (a late reply: the fallback's
        // was): none of its drafts verified, said once.
        p.verified(1, 6, 2);
        let ctx = [1u32, 2, 3, 4, 3, 7, 7, 8, 9];
        let (item, _, _) = item_at(&mut p, &ctx, 0, &mut rng);
        assert_eq!((item.verified_at, item.verified), (6, Some(0)));
        // A step without drafts verified nothing of the block drafted at 9 either, although
        // the engine said nothing.
        let ctx = [1u32, 2, 3, 4, 3, 7, 7, 8, 9, 9];
        let (item, _, _) = item_at(&mut p, &ctx, 0, &mut rng);
        assert_eq!((item.verified_at, item.verified), (9, Some(0)));
        // A new stream (the draft worker reconnected) holds none of the old blocks: nothing
        // about them goes, and the context is resent whole.
        p.verified(1, 10, 2);
        let ctx = [1u32, 2, 3, 4, 3, 7, 7, 8, 9, 9, 4];
        let (item, _, acked) = item_at(&mut p, &ctx, 1, &mut rng);
        assert_eq!(acked, 0);
        assert_eq!((item.verified_at, item.verified), (0, None));
    }

    /// Finished ids piled up on a link (its draft worker was slow) leave a few thousand a
    /// round, the rest with the next rounds: a draft worker refuses a round with more than its
    /// limit whole, and the ids it carried were lost with it.
    #[test]
    fn finished_ids_leave_in_rounds_a_draft_worker_takes() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:9".to_string(), "127.0.0.1:10".to_string());
        let mut p = two_links(&rt, &a, &b);
        let (tx, mut calls) = tokio::sync::mpsc::channel::<DraftCall>(8);
        *p.links[&a].shared.calls.lock().expect("calls") = Some(tx);
        let piled = FINISHED_PER_ROUND as u64 + 100;
        p.links.get_mut(&a).expect("link").finished = (1000..1000 + piled).collect();
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let mut got = Vec::new();
        for _ in 0..2 {
            let mut reqs = two_reqs(&ctx, &greedy, &mut rngs);
            p.send_round(&a, &mut reqs, &[0]).expect("sent");
            let call = calls.try_recv().expect("a call");
            assert!(call.finished.len() <= FINISHED_PER_ROUND);
            got.extend(call.finished);
        }
        assert_eq!(got, (1000..1000 + piled).collect::<Vec<_>>());
        assert!(p.links[&a].finished.is_empty());
    }

    /// A round sent after another link's prefetched round used up the cycle's time is not its
    /// link's fault: that link is not stalled (its requests would draft locally for
    /// `STALL_RETRY`); the late one is. Both stay for their replies' acknowledgements; rounds
    /// that can no longer be applied leave no reply slot behind.
    #[test]
    fn a_round_given_no_time_does_not_stall_its_link() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:9".to_string(), "127.0.0.1:10".to_string());
        let mut p = two_links(&rt, &a, &b);
        // "b" takes calls and never answers; "a" has a prefetched round for request 1 that
        // never comes back.
        let (tx, _calls) = tokio::sync::mpsc::channel::<DraftCall>(8);
        *p.links[&b].shared.calls.lock().expect("calls") = Some(tx);
        let (_reply_tx, rx) = std::sync::mpsc::channel();
        p.prefetched.push(Round {
            addr: a.clone(),
            rx,
            ..test_round(99, &[(1, (4, 0, 2, 0))], &[])
        });
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let mut reqs = two_reqs(&ctx, &greedy, &mut rngs);
        p.propose(&mut reqs).expect("propose");
        assert!(p.links[&a].shared.is_stalled(), "the late link is stalled");
        assert!(
            !p.links[&b].shared.is_stalled(),
            "a round with no time left is not the link's fault"
        );
        let late: Vec<&str> = p.late.iter().map(|r| r.addr.as_str()).collect();
        assert_eq!(late, [a.as_str(), b.as_str()]);
        assert_eq!(p.links[&b].shared.pending.lock().expect("pending").len(), 1);
        // A prefetched round whose requests all finished frees its reply slot.
        let (_tx2, rx2) = std::sync::mpsc::channel();
        p.links[&b]
            .shared
            .pending
            .lock()
            .expect("pending")
            .insert(7, std::sync::mpsc::channel().0);
        p.prefetched.push(Round {
            addr: b.clone(),
            rx: rx2,
            ..test_round(7, &[(2, (4, 0, 2, 0))], &[])
        });
        p.finish(2);
        assert!(p.prefetched.is_empty());
        assert!(
            p.links[&b]
                .shared
                .pending
                .lock()
                .expect("pending")
                .is_empty()
        );
    }

    /// Each link's draft worker described as reading these target layers.
    fn layered(p: &RemoteProposer, links: &[(&String, Vec<u32>)]) {
        for (addr, layers) in links {
            *p.links[*addr].shared.info.lock().expect("info") = Some(WorkerInfo {
                feature_layers: layers.clone(),
                ..Default::default()
            });
        }
    }

    /// Draft workers whose drafters read different target layers (a rolling update): the
    /// layers captured are one link's, the same whichever order the links are stored in, and
    /// the other link's requests are not sent rounds (its drafter would read the wrong
    /// layers' features).
    #[test]
    fn draft_workers_reading_other_layers_get_no_rounds() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:10".to_string(), "127.0.0.1:9".to_string());
        let mut p = two_links(&rt, &a, &b);
        layered(&p, &[(&a, vec![0, 1]), (&b, vec![2, 3])]);
        // "127.0.0.1:10" < "127.0.0.1:9" as strings: the first by address is `a`.
        assert_eq!(p.feature_layers(), vec![0, 1]);
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let reqs = two_reqs(&ctx, &greedy, &mut rngs);
        let groups = p.groups(&reqs);
        assert_eq!(groups, vec![(a.clone(), vec![0])]);
        // Once the pool agrees, both draft remotely.
        if let Some(i) = p.links[&b].shared.info.lock().expect("info").as_mut() {
            i.feature_layers = vec![0, 1];
        }
        let mut groups = p.groups(&reqs);
        groups.sort();
        assert_eq!(groups, vec![(a.clone(), vec![0]), (b.clone(), vec![1])]);
        // A drafter that reads no features (a draft model) takes any and sets none, first by
        // address or not.
        for (none, other) in [(&a, &b), (&b, &a)] {
            for (addr, layers) in [(none, vec![]), (other, vec![2, 3])] {
                if let Some(i) = p.links[addr].shared.info.lock().expect("info").as_mut() {
                    i.feature_layers = layers;
                }
            }
            assert_eq!(p.feature_layers(), vec![2, 3]);
            let mut groups = p.groups(&reqs);
            groups.sort();
            assert_eq!(groups, vec![(a.clone(), vec![0]), (b.clone(), vec![1])]);
        }
    }

    /// A link goes down between the forward that captured features and their hand-over:
    /// the rows are kept as rows of the layers captured, not of those the links give now
    /// (another drafter's, which would read them as features of its own layers).
    #[test]
    fn observed_rows_keep_the_layers_the_forward_captured() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:10".to_string(), "127.0.0.1:9".to_string());
        let mut p = two_links(&rt, &a, &b);
        layered(&p, &[(&a, vec![0, 1]), (&b, vec![2, 3])]);
        let captured = p.feature_layers();
        assert_eq!(captured, vec![0, 1]);
        take_down(&p, &a, Duration::ZERO);
        assert_eq!(p.feature_layers(), vec![2, 3], "`b`'s layers now");
        let rl = captured.len() * p.d_model;
        p.observe_captured(2, 0, &captured, &vec![0.5; 3 * rl])
            .expect("observe");
        let rs = &p.reqs[&2];
        assert_eq!(rs.feat_layers, vec![0, 1]);
        assert_eq!(rs.rows_of(rl), 3);
    }

    /// Takes `addr`'s link down, as if it went down `ago` ago.
    fn take_down(p: &RemoteProposer, addr: &str, ago: Duration) {
        let s = &p.links[addr].shared;
        s.up.store(false, Ordering::SeqCst);
        *s.down_since.lock().expect("down_since") =
            Some(Instant::now().checked_sub(ago).expect("a clock past `ago`"));
    }

    /// Brings `addr`'s link up (to nowhere: only its shared state is used), its drafter
    /// reading `layers`, and returns what is sent on it.
    fn up_with(
        p: &mut RemoteProposer,
        addr: &str,
        layers: Vec<u32>,
    ) -> tokio::sync::mpsc::Receiver<DraftCall> {
        if !p.links.contains_key(addr) {
            let l = spawn_link(&p.rt, addr.to_string(), p.hello.clone());
            p.links.insert(addr.to_string(), l);
        }
        let s = &p.links[addr].shared;
        *s.info.lock().expect("info") = Some(WorkerInfo {
            feature_layers: layers,
            ..Default::default()
        });
        let (tx, rx) = tokio::sync::mpsc::channel::<DraftCall>(8);
        *s.calls.lock().expect("calls") = Some(tx);
        *s.down_since.lock().expect("down_since") = None;
        s.up.store(true, Ordering::SeqCst);
        rx
    }

    /// Requests `ids` at `ctx`, k = 2, greedy.
    fn reqs_at<'a>(
        ids: &[u64],
        ctx: &'a [u32],
        params: &'a kernels::sampling::SamplingParams,
        rngs: &'a mut [kernels::rng::Rng],
    ) -> Vec<ProposeReq<'a>> {
        ids.iter()
            .zip(rngs.iter_mut())
            .map(|(&id, rng)| ProposeReq {
                id,
                context: ctx,
                k: 2,
                params,
                rng,
            })
            .collect()
    }

    /// A draft pod replaced at a new address (a rolling update of the draft pool): its
    /// requests move, past the grace, to the up draft workers that would take their rounds,
    /// least loaded first (ties by address), and start there from scratch — their whole
    /// context and the feature rows kept — rather than with what the gone one acknowledged.
    /// Its pending round is dropped, and so is its link once nothing uses it.
    #[test]
    fn requests_of_a_gone_draft_worker_move_to_the_least_loaded_up_one_in_full() {
        let rt = test_runtime();
        let shared = Arc::new(RemoteShared::default());
        let mut p = test_proposer(&rt, shared.clone(), 10);
        let (gone, busy, idle) = ("127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11");
        // Least loaded of all, but not taking rounds: another drafter's layers, or stalled.
        let (other, late) = ("127.0.0.1:12", "127.0.0.1:13");
        if let Ok(mut m) = shared.assign.lock() {
            for (id, addr) in [(1, gone), (5, gone), (2, busy), (3, busy), (4, idle)] {
                m.insert(id, addr.to_string());
            }
        }
        let mut calls = HashMap::new();
        for (addr, layers) in [
            (gone, vec![0, 1]),
            (busy, vec![0, 1]),
            (idle, vec![0, 1]),
            (other, vec![2, 3]),
            (late, vec![0, 1]),
        ] {
            calls.insert(addr, up_with(&mut p, addr, layers));
        }
        *p.links[late].shared.stalled.lock().expect("stalled") = Some(Instant::now());
        assert_eq!(p.feature_layers(), vec![0, 1]);
        let rl = 2 * 4;
        p.observe(1, 0, &[0.5; 4 * 8]).expect("observe");
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(5)];
        // Requests 1 and 5 draft on `gone`, which acknowledges their context.
        let ctx = [1u32, 2, 3, 4];
        let mut reqs = reqs_at(&[1, 5], &ctx, &greedy, &mut rngs);
        assert_eq!(p.groups(&reqs), vec![(gone.to_string(), vec![0, 1])]);
        let round = p.send_round(gone, &mut reqs, &[0, 1]).expect("sent");
        let rep = DraftReply {
            step: round.step,
            blocks: [1, 5]
                .map(|seq| dspark_proto::DraftBlock {
                    seq,
                    tokens: vec![3],
                    q_kind: QKind::OneHot as i32,
                    ..Default::default()
                })
                .to_vec(),
            ..Default::default()
        };
        let ids = HashMap::from([(1, 0), (5, 1)]);
        let mut out = vec![None, None];
        p.apply(&round, &(rep, Instant::now()), &reqs, &ids, &mut out);
        assert_eq!((p.reqs[&1].tokens_acked, p.reqs[&1].feats_acked), (4, 4));
        drop(reqs);
        // One more committed token; a round for it is in flight when `gone` goes.
        let ctx = [1u32, 2, 3, 4, 5];
        p.observe(1, 4, &[0.25; 8]).expect("observe");
        let mut reqs = reqs_at(&[1, 5], &ctx, &greedy, &mut rngs);
        p.prefetch(&mut reqs);
        assert_eq!(p.prefetched.len(), 1);
        let gone_rx = calls.get_mut(gone).expect("gone's calls");
        let first = gone_rx.try_recv().expect("the first round");
        assert_eq!(first.items[0].sync_from, 0);
        let next = gone_rx.try_recv().expect("the prefetched round");
        assert_eq!((next.items[0].sync_from, next.items[0].feat_from), (4, 4));
        take_down(&p, gone, REPAIR_GRACE + Duration::from_secs(1));
        // 1 goes to `idle` (1 request against 2), then 5 to `busy` (2 each: first by address).
        let mut groups = p.groups(&reqs);
        groups.sort();
        assert_eq!(
            groups,
            vec![(busy.to_string(), vec![1]), (idle.to_string(), vec![0])]
        );
        let assign = shared.assign.lock().expect("assign").clone();
        assert_eq!((assign[&1].as_str(), assign[&5].as_str()), (idle, busy));
        assert!(
            p.prefetched.is_empty(),
            "the gone stream's round is dropped"
        );
        assert!(!p.links.contains_key(gone), "the gone link stops redialing");
        // Its first round on `idle` carries everything, as for a new request.
        p.send_round(idle, &mut reqs, &[0]).expect("sent");
        let call = calls
            .get_mut(idle)
            .expect("idle's calls")
            .try_recv()
            .expect("a call");
        let item = &call.items[0];
        assert_eq!((item.seq, item.sync_from), (1, 0));
        assert_eq!(item.tokens, ctx.to_vec());
        assert!(
            item.sampling.is_some(),
            "sampling parameters go with a new request"
        );
        assert_eq!(item.verified, None, "no verdict on another worker's block");
        assert_eq!(item.feat_from, 0);
        let rows = item.features.as_ref().expect("feature rows");
        assert_eq!(rows.shape, vec![5, rl as u32]);
        assert_eq!(p.reqs[&1].link, idle);
    }

    /// The captured layers change part way through a request (a rolling update between
    /// drafters reading different layers): the rows kept at the old width are dropped, never
    /// mixed with rows of the new one nor sent as rows of it, and what the draft worker
    /// acknowledged of features is forgotten, so the rows kept go from the first.
    #[test]
    fn a_change_of_feature_layers_drops_the_rows_of_the_old_width() {
        let rt = test_runtime();
        let shared = Arc::new(RemoteShared::default());
        let mut p = test_proposer(&rt, shared.clone(), 10);
        let a = "127.0.0.1:9";
        if let Ok(mut m) = shared.assign.lock() {
            m.insert(1, a.to_string());
            m.insert(2, a.to_string());
        }
        let _calls = up_with(&mut p, a, vec![0, 1]);
        let set_layers = |p: &RemoteProposer, layers: Vec<u32>| {
            if let Some(i) = p.links[a].shared.info.lock().expect("info").as_mut() {
                i.feature_layers = layers;
            }
        };
        // Request 1: 4 rows of 2 layers × 4 floats, acknowledged.
        p.observe(1, 0, &[0.5; 4 * 8]).expect("observe");
        p.reqs.get_mut(&1).expect("request 1").feats_acked = 4;
        // The drafters now read one layer: the next row is 4 floats.
        set_layers(&p, vec![1]);
        p.observe(1, 4, &[0.25; 4]).expect("observe");
        let rs = &p.reqs[&1];
        assert_eq!(rs.feats, vec![0.25; 4], "no row of the old width kept");
        assert_eq!((rs.feat_base, rs.feats_acked), (4, 0));
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rng = kernels::rng::Rng::new(1);
        let ctx = [1u32, 2, 3, 4, 5, 6];
        let mut r = ProposeReq {
            id: 1,
            context: &ctx,
            k: 2,
            params: &greedy,
            rng: &mut rng,
        };
        let (item, feat_end, _) = p.build_item(a, 0, &[1], &mut r);
        let f = item.features.as_ref().expect("the row kept");
        assert_eq!(
            (item.feat_from, f.shape.clone(), feat_end),
            (4, vec![1, 4], 5)
        );
        // Request 2: 3 rows of 4 floats; the layers change back before another row comes:
        // its rows are not sent as rows of 8.
        p.observe(2, 0, &[0.5; 3 * 4]).expect("observe");
        set_layers(&p, vec![0, 1]);
        let mut r = ProposeReq { id: 2, ..r };
        let (item, feat_end, _) = p.build_item(a, 0, &[0, 1], &mut r);
        assert!(item.features.is_none(), "{:?}", item.features);
        assert_eq!((feat_end, p.reqs[&2].feats_acked), (0, 0));
        assert!(p.reqs[&2].feats.is_empty());
        // Request 1 again, its rows of layer 1 acknowledged: a drafter reading layer 0 (as
        // many floats a row) is not sent them either.
        p.reqs.get_mut(&1).expect("request 1").feats_acked = 5;
        set_layers(&p, vec![0]);
        p.observe(1, 5, &[0.75; 4]).expect("observe");
        let rs = &p.reqs[&1];
        assert_eq!(rs.feats, vec![0.75; 4], "no row of the other layer kept");
        assert_eq!((rs.feat_base, rs.feats_acked), (5, 0));
    }

    /// A reply of an earlier stream than the request's now (sent before a reconnect or a
    /// re-pairing, applied after) acknowledges nothing on the current stream and backs it off
    /// for nothing: the draft worker there would be sent tokens and rows from another offset.
    /// A block it carries for the current context is still drafts, but the verdict on it is
    /// not for the current stream's drafter.
    #[test]
    fn a_reply_of_an_earlier_stream_acknowledges_nothing_on_the_current_one() {
        let rt = test_runtime();
        let mut p = test_proposer(&rt, Arc::new(RemoteShared::default()), 10);
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let reqs = two_reqs(&ctx, &greedy, &mut rngs);
        let ids: HashMap<u64, usize> = HashMap::from([(1, 0), (2, 1)]);
        // Sent on stream 0 of "a"; since then request 1 is on stream 1 of "a" (a reconnect)
        // and request 2 on "b" (re-paired), neither holding anything there.
        let both =
            |step, from| test_round(step, &[(1, (4, 4, 2, from)), (2, (4, 4, 2, from))], &[]);
        p.reqs.insert(1, ReqSync::new("a".into(), 1, 0));
        p.reqs.insert(2, ReqSync::new("b".into(), 0, 0));
        let blocks = |need_sync: bool| {
            [1, 2]
                .map(|seq| dspark_proto::DraftBlock {
                    seq,
                    tokens: if need_sync { vec![] } else { vec![3] },
                    q_kind: QKind::OneHot as i32,
                    need_sync,
                    have_tokens: 4,
                    ..Default::default()
                })
                .to_vec()
        };
        let rep = DraftReply {
            step: 1,
            blocks: blocks(false),
            ..Default::default()
        };
        let mut out: Vec<Option<DraftBlock>> = vec![None, None];
        p.apply(
            &both(1, 0),
            &(rep.clone(), Instant::now()),
            &reqs,
            &ids,
            &mut out,
        );
        for id in [1, 2] {
            let rs = &p.reqs[&id];
            assert_eq!((rs.tokens_acked, rs.feats_acked), (0, 0), "request {id}");
            assert_eq!(rs.used_at, None, "request {id}");
        }
        assert!(
            out.iter()
                .all(|b| b.as_ref().is_some_and(|b| b.tokens == [3])),
            "{out:?}"
        );
        // Its refusals (need_sync from a worker holding all the round synced from) and its
        // failed rounds back nothing off and acknowledge nothing.
        let refusal = DraftReply {
            step: 2,
            blocks: blocks(true),
            ..Default::default()
        };
        let failed = DraftReply {
            step: 3,
            error: "drafting failed: test".into(),
            ..rep.clone()
        };
        for (step, rep) in [(2, refusal), (3, failed)] {
            let mut out: Vec<Option<DraftBlock>> = vec![None, None];
            p.apply(
                &both(step, 4),
                &(rep, Instant::now()),
                &reqs,
                &ids,
                &mut out,
            );
            for id in [1, 2] {
                let rs = &p.reqs[&id];
                assert_eq!((rs.refusals, rs.skip_until), (0, 0), "step {step}");
                assert_eq!((rs.tokens_acked, rs.verdict), (0, None), "step {step}");
            }
        }
        // The same reply on request 1's stream is its own.
        let current = Round {
            generation: 1,
            ..both(1, 0)
        };
        let mut out: Vec<Option<DraftBlock>> = vec![None, None];
        p.apply(&current, &(rep, Instant::now()), &reqs, &ids, &mut out);
        let rs = &p.reqs[&1];
        assert_eq!(
            (rs.tokens_acked, rs.feats_acked, rs.used_at),
            (4, 4, Some(4))
        );
        assert_eq!(p.reqs[&2].tokens_acked, 0);
    }

    /// A link down for less than the grace (a blip: the worker reconnects at the same
    /// address) keeps its requests, which draft locally meanwhile; past it, they move.
    #[test]
    fn a_draft_worker_down_within_the_grace_keeps_its_requests() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:9".to_string(), "127.0.0.1:10".to_string());
        let mut p = two_links(&rt, &a, &b);
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let reqs = two_reqs(&ctx, &greedy, &mut rngs);
        take_down(&p, &a, REPAIR_GRACE / 4);
        assert_eq!(p.groups(&reqs), vec![(b.clone(), vec![1])]);
        assert_eq!(p.shared.assign.lock().expect("assign")[&1], a);
        assert!(p.links.contains_key(&a));
        take_down(&p, &a, REPAIR_GRACE + Duration::from_millis(100));
        assert_eq!(p.groups(&reqs), vec![(b.clone(), vec![0, 1])]);
        assert_eq!(p.shared.assign.lock().expect("assign")[&1], b);
    }

    /// With no other draft worker taking rounds (down, or stalled), a request whose draft
    /// worker is gone keeps its pairing and drafts locally while its link redials; the first
    /// one that answers takes it.
    #[test]
    fn with_no_other_draft_worker_up_a_request_stays_and_drafts_locally() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:9".to_string(), "127.0.0.1:10".to_string());
        let mut p = two_links(&rt, &a, &b);
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let mut reqs = two_reqs(&ctx, &greedy, &mut rngs);
        take_down(&p, &a, REPAIR_GRACE * 2);
        take_down(&p, &b, REPAIR_GRACE * 2);
        p.propose(&mut reqs).expect("propose");
        let fallback =
            |p: &RemoteProposer| p.shared.stats.lock().expect("stats")[&1].fallback_cycles;
        assert_eq!(fallback(&p), 1);
        assert_eq!(p.shared.assign.lock().expect("assign")[&1], a);
        assert!(p.links.contains_key(&a), "its link keeps redialing");
        // `b` is up but stalled: it takes no rounds, so no requests either.
        let _b_calls = up_with(&mut p, &b, vec![]);
        *p.links[&b].shared.stalled.lock().expect("stalled") = Some(Instant::now());
        p.propose(&mut reqs).expect("propose");
        assert_eq!(fallback(&p), 2);
        assert_eq!(p.shared.assign.lock().expect("assign")[&1], a);
        // It answers again: request 1 moves there.
        *p.links[&b].shared.stalled.lock().expect("stalled") = None;
        assert_eq!(p.groups(&reqs), vec![(b.clone(), vec![0, 1])]);
        assert_eq!(p.shared.assign.lock().expect("assign")[&1], b);
    }

    /// A draft worker behind `addr`'s link (brought up, its drafter reading no layers), on a
    /// thread: it answers each round `delay` ms after taking it (changeable while it runs)
    /// with k drafts of token 3 for every item, hands the reply over as `run_link` does, then
    /// passes the call on.
    fn fake_worker(
        p: &mut RemoteProposer,
        addr: &str,
        delay: Arc<AtomicU64>,
    ) -> std::sync::mpsc::Receiver<DraftCall> {
        let mut calls = up_with(p, addr, vec![]);
        let link = Arc::downgrade(&p.links[addr].shared);
        let (seen, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            while let Some(call) = calls.blocking_recv() {
                std::thread::sleep(Duration::from_millis(delay.load(Ordering::SeqCst)));
                let blocks = call
                    .items
                    .iter()
                    .map(|it| dspark_proto::DraftBlock {
                        seq: it.seq,
                        tokens: vec![3; it.k as usize],
                        q_kind: QKind::OneHot as i32,
                        have_tokens: it.sync_from + it.tokens.len() as u32,
                        ..Default::default()
                    })
                    .collect();
                let Some(l) = link.upgrade() else { break };
                let _ = l.deliver(DraftReply {
                    step: call.step,
                    blocks,
                    ..Default::default()
                });
                drop(l);
                if seen.send(call).is_err() {
                    break;
                }
            }
        });
        rx
    }

    /// A draft worker that answers just past the timeout: its late reply still acknowledges
    /// what it holds (and ends no stall), and the next try is a probe the engine does not
    /// wait for, carrying only what the worker lacks; a probe answered in time ends the stall.
    #[test]
    fn a_late_reply_acknowledges_and_a_stalled_link_is_probed_without_waiting() {
        let rt = test_runtime();
        let a = "127.0.0.1:9";
        let timeout = Duration::from_millis(100);
        let (_, mut p) = assigned(&rt, a, timeout);
        let delay = Arc::new(AtomicU64::new(250));
        let seen = fake_worker(&mut p, a, Arc::clone(&delay));
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1)];
        let ctx = [1u32, 2, 3, 4];
        let mut reqs = reqs_at(&[1], &ctx, &greedy, &mut rngs);
        p.propose(&mut reqs).expect("propose");
        assert!(p.timed_out());
        assert!(p.links[a].shared.is_stalled());
        drop(reqs);
        let call = seen.recv_timeout(Duration::from_secs(2)).expect("answered");
        assert_eq!(call.items[0].sync_from, 0);
        p.drain_ready();
        assert_eq!(p.reqs[&1].tokens_acked, 4, "the late reply acknowledges");
        assert!(p.links[a].shared.is_stalled(), "a late reply ends no stall");
        let due = |p: &RemoteProposer| {
            *p.links[a].shared.stalled.lock().expect("stalled") =
                Some(Instant::now() - STALL_RETRY - Duration::from_millis(1));
        };
        // Due for another try: a probe with the two new tokens only, not waited for.
        due(&p);
        let ctx = [1u32, 2, 3, 4, 5, 6];
        let mut reqs = reqs_at(&[1], &ctx, &greedy, &mut rngs);
        let t = Instant::now();
        let out = p.propose(&mut reqs).expect("propose");
        assert!(t.elapsed() < timeout, "waited {:?}", t.elapsed());
        assert!(!p.timed_out());
        assert!(out[0].tokens.is_empty(), "drafted locally meanwhile");
        drop(reqs);
        let call = seen
            .recv_timeout(Duration::from_secs(2))
            .expect("the probe");
        assert_eq!(
            (call.items[0].sync_from, call.items[0].tokens.clone()),
            (4, vec![5, 6])
        );
        p.drain_ready();
        assert_eq!(p.reqs[&1].tokens_acked, 6);
        assert!(p.links[a].shared.is_stalled(), "the probe was late too");
        // A probe answered within the timeout: the link takes rounds again.
        delay.store(0, Ordering::SeqCst);
        due(&p);
        let ctx = [1u32, 2, 3, 4, 5, 6, 7];
        let mut reqs = reqs_at(&[1], &ctx, &greedy, &mut rngs);
        p.propose(&mut reqs).expect("propose");
        drop(reqs);
        let call = seen
            .recv_timeout(Duration::from_secs(2))
            .expect("the probe");
        assert_eq!(call.items[0].sync_from, 6);
        p.drain_ready();
        assert!(p.links[a].shared.stalled.lock().expect("stalled").is_none());
        assert!(p.late.is_empty());
    }

    /// A round prefetched at a context the request has since moved past (a cycle drafted by
    /// copy runs, or with none, came between) can give it no drafts: it is not waited for,
    /// does not stall its link, and — its requests all here, so it never matches again — goes
    /// to the late rounds, whose acknowledgements are applied when the reply comes (one whose
    /// reply is in already is done with, its reply slot freed); the request drafts remotely.
    /// A round with a request of the other micro-batch stays for that one's `propose`.
    #[test]
    fn a_prefetched_round_for_a_context_moved_past_is_not_waited_for() {
        let rt = test_runtime();
        let a = "127.0.0.1:9";
        let timeout = Duration::from_millis(500);
        let (_, mut p) = assigned(&rt, a, timeout);
        let _seen = fake_worker(&mut p, a, Arc::new(AtomicU64::new(0)));
        // Drafted at context length 4; its reply never comes.
        let (_never, rx) = std::sync::mpsc::channel();
        p.prefetched.push(Round {
            addr: a.to_string(),
            rx,
            ..test_round(0, &[(1, (4, 0, 2, 0))], &[])
        });
        // Drafted at 4 too, its reply in (drained) and its slot still held.
        let (_tx5, rx5) = std::sync::mpsc::channel();
        p.links[a]
            .shared
            .pending
            .lock()
            .expect("pending")
            .insert(5, std::sync::mpsc::channel().0);
        p.prefetched.push(Round {
            addr: a.to_string(),
            rx: rx5,
            ready: Some((DraftReply::default(), Instant::now())),
            drained: true,
            ..test_round(5, &[(1, (4, 0, 2, 0))], &[])
        });
        // With request 2 of the other micro-batch.
        let (_tx6, rx6) = std::sync::mpsc::channel();
        p.prefetched.push(Round {
            addr: a.to_string(),
            rx: rx6,
            ..test_round(6, &[(1, (4, 0, 2, 0)), (2, (4, 0, 2, 0))], &[])
        });
        p.step = 10;
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1)];
        let ctx = [1u32, 2, 3, 4, 5, 6];
        let mut reqs = reqs_at(&[1], &ctx, &greedy, &mut rngs);
        let t = Instant::now();
        let out = p.propose(&mut reqs).expect("propose");
        assert!(t.elapsed() < timeout, "waited {:?}", t.elapsed());
        assert_eq!(out[0].tokens, vec![3, 3], "drafted remotely");
        assert!(!p.links[a].shared.is_stalled());
        assert!(!p.timed_out());
        let steps = |l: &[Round]| l.iter().map(|r| r.step).collect::<Vec<_>>();
        assert_eq!(steps(&p.prefetched), [6], "kept for the other micro-batch");
        assert_eq!(steps(&p.late), [0], "its acknowledgements still count");
        assert!(
            !p.links[a]
                .shared
                .pending
                .lock()
                .expect("pending")
                .contains_key(&5)
        );
    }

    /// A round refused at the door (no stream, or its channel full) put nothing on the wire:
    /// it counts no bytes to the draft worker.
    #[test]
    fn a_round_not_sent_counts_no_bytes() {
        let rt = test_runtime();
        let (a, b) = ("127.0.0.1:9".to_string(), "127.0.0.1:10".to_string());
        let mut p = two_links(&rt, &a, &b);
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1), kernels::rng::Rng::new(2)];
        let sent = |p: &RemoteProposer| {
            p.shared
                .stats
                .lock()
                .expect("stats")
                .get(&1)
                .map_or(0, |s| s.bytes_to_draft)
        };
        let mut reqs = two_reqs(&ctx, &greedy, &mut rngs);
        assert!(p.send_round(&a, &mut reqs, &[0]).is_none(), "no stream");
        assert_eq!(sent(&p), 0);
        let (tx, mut calls) = tokio::sync::mpsc::channel::<DraftCall>(1);
        *p.links[&a].shared.calls.lock().expect("calls") = Some(tx);
        assert!(p.send_round(&a, &mut reqs, &[0]).is_some());
        let first = sent(&p);
        let call = calls.try_recv().expect("a call");
        assert_eq!(first, call.items[0].encoded_len() as u64);
        // The channel full: refused.
        assert!(p.send_round(&a, &mut reqs, &[0]).is_some());
        assert!(p.send_round(&a, &mut reqs, &[0]).is_none(), "channel full");
        assert_eq!(
            sent(&p) - first,
            calls.try_recv().expect("a call").items[0].encoded_len() as u64
        );
    }

    /// A draft worker up with no request paired with it (one it drafted for finished) does
    /// not decide the layers captured — its drafter's may differ from the draft workers' in
    /// use, whose requests would get no rounds — but its link stays: a request paired with it
    /// again finds its layers known at once (its prefill captures them).
    #[test]
    fn idle_draft_workers_do_not_decide_the_layers() {
        let rt = test_runtime();
        let shared = Arc::new(RemoteShared::default());
        let mut p = test_proposer(&rt, shared.clone(), 10);
        // "127.0.0.1:10" < "127.0.0.1:9" as strings: `a` is first by address.
        let (a, b) = ("127.0.0.1:10".to_string(), "127.0.0.1:9".to_string());
        shared.assign.lock().expect("assign").insert(2, b.clone());
        let _ca = up_with(&mut p, &a, vec![2, 3]);
        let _cb = up_with(&mut p, &b, vec![0, 1]);
        assert_eq!(p.feature_layers(), vec![0, 1]);
        let ctx = [1u32, 2, 3, 4];
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(2)];
        let reqs = reqs_at(&[2], &ctx, &greedy, &mut rngs);
        assert_eq!(p.groups(&reqs), vec![(b.clone(), vec![0])]);
        drop(reqs);
        // Both stay open, `a` idle: it still does not decide.
        p.forget_idle_links(None);
        assert!(p.links.contains_key(&a) && p.links.contains_key(&b));
        assert_eq!(p.feature_layers(), vec![0, 1]);
        // Paired with a request again, it counts (first by address), with nothing redialed.
        shared.assign.lock().expect("assign").insert(1, a.clone());
        assert_eq!(p.feature_layers(), vec![2, 3]);
    }

    /// The reply of `step` for request 1: drafts of token 3 (k = 2), the draft worker holding
    /// `have` tokens, or need_sync.
    fn reply_for_1(step: u64, have: u32, need_sync: bool) -> (DraftReply, Instant) {
        let mut block = dspark_proto::DraftBlock {
            seq: 1,
            need_sync,
            have_tokens: have,
            ..Default::default()
        };
        if !need_sync {
            block.tokens = vec![3, 3];
            block.q_kind = QKind::OneHot as i32;
        }
        let rep = DraftReply {
            step,
            blocks: vec![block],
            ..Default::default()
        };
        (rep, Instant::now())
    }

    /// A proposer whose request 1 is paired with `a`'s link (never up) on its stream 0.
    /// A proposer (vocabulary 10, drafting `timeout`) with request 1 paired with `a`.
    fn assigned(
        rt: &tokio::runtime::Runtime,
        a: &str,
        timeout: Duration,
    ) -> (Arc<RemoteShared>, RemoteProposer) {
        let shared = Arc::new(RemoteShared::default());
        let mut p = test_proposer(rt, shared.clone(), 10);
        p.timeout = timeout;
        shared
            .assign
            .lock()
            .expect("assign")
            .insert(1, a.to_string());
        (shared, p)
    }

    fn paired_with(rt: &tokio::runtime::Runtime, a: &str) -> RemoteProposer {
        let (_, mut p) = assigned(rt, a, Duration::from_millis(10));
        assert_eq!(p.link_for(1).as_deref(), Some(a));
        p.reqs.insert(1, ReqSync::new(a.to_string(), 0, 0));
        p
    }

    /// Two rounds on one link: the first given up on (late), its reply "acknowledged at 4"
    /// coming just before the second's, collected in time, "need_sync, holds 2" (the draft
    /// worker lost the state in between). The late one is applied first, so what is recorded
    /// is what the worker holds (2), never the older acknowledgement over it (the next round
    /// would sync from 4, which the worker does not have).
    #[test]
    fn a_late_acknowledgement_never_overrides_a_newer_need_sync() {
        let rt = test_runtime();
        let a = "127.0.0.1:9";
        let mut p = paired_with(&rt, a);
        p.timeout = Duration::from_secs(2);
        // Step 1, at context length 4, synced from 0: late.
        let (tx1, rx1) = std::sync::mpsc::channel();
        p.late.push(Round {
            addr: a.to_string(),
            rx: rx1,
            ..test_round(1, &[(1, (4, 0, 2, 0))], &[])
        });
        // Step 2, at 6, synced from 4: prefetched for this cycle.
        let (tx2, rx2) = std::sync::mpsc::channel();
        p.prefetched.push(Round {
            addr: a.to_string(),
            rx: rx2,
            ..test_round(2, &[(1, (6, 0, 2, 4))], &[])
        });
        p.step = 2;
        // Both replies come, in order, while the engine waits for step 2.
        let worker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            tx1.send(reply_for_1(1, 4, false)).expect("step 1's reply");
            tx2.send(reply_for_1(2, 2, true)).expect("step 2's reply");
        });
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1)];
        let ctx = [1u32, 2, 3, 4, 5, 6];
        let mut reqs = reqs_at(&[1], &ctx, &greedy, &mut rngs);
        let out = p.propose(&mut reqs).expect("propose");
        worker.join().expect("worker");
        assert!(out[0].tokens.is_empty(), "need_sync: drafted locally");
        assert!(
            p.late.is_empty(),
            "the late reply was applied, before step 2's"
        );
        assert_eq!(p.reqs[&1].tokens_acked, 2);
        p.drain_ready();
        assert_eq!(p.reqs[&1].tokens_acked, 2, "what the draft worker holds");
    }

    /// A prefetched round drained before it is collected had its acknowledgements applied
    /// then, in send order: a newer reply of its link applied since ("need_sync, holds 2")
    /// stands when the round's blocks are collected, and the blocks are drafts still.
    #[test]
    fn a_drained_round_collected_later_gives_only_its_blocks() {
        let rt = test_runtime();
        let a = "127.0.0.1:9";
        let mut p = paired_with(&rt, a);
        // Step 2 at context length 6, prefetched: "acknowledged at 6", with drafts.
        let (tx2, rx2) = std::sync::mpsc::channel();
        tx2.send(reply_for_1(2, 6, false)).expect("step 2's reply");
        p.prefetched.push(Round {
            addr: a.to_string(),
            rx: rx2,
            ..test_round(2, &[(1, (6, 0, 2, 0))], &[])
        });
        // Step 3 at 6, synced from 6, late: "need_sync, holds 2".
        let (tx3, rx3) = std::sync::mpsc::channel();
        tx3.send(reply_for_1(3, 2, true)).expect("step 3's reply");
        p.late.push(Round {
            addr: a.to_string(),
            rx: rx3,
            ..test_round(3, &[(1, (6, 0, 2, 6))], &[])
        });
        p.step = 3;
        p.drain_ready();
        assert_eq!(p.reqs[&1].tokens_acked, 2);
        assert!(p.prefetched.iter().all(|r| r.drained && r.ready.is_some()));
        let greedy = kernels::sampling::SamplingParams::greedy();
        let mut rngs = [kernels::rng::Rng::new(1)];
        let ctx = [1u32, 2, 3, 4, 5, 6];
        let mut reqs = reqs_at(&[1], &ctx, &greedy, &mut rngs);
        let out = p.propose(&mut reqs).expect("propose");
        assert_eq!(out[0].tokens, vec![3, 3], "its blocks are drafts");
        assert_eq!(p.reqs[&1].tokens_acked, 2, "not acknowledged again at 6");
        assert!(p.prefetched.is_empty() && p.late.is_empty());
    }
}
