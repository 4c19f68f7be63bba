//! The router's view of the cluster: placement through the scheduler, with the last known view
//! as a fallback so a slow or absent scheduler never stops traffic.

use dspark_proto::scheduler_client::SchedulerClient;
use dspark_proto::target_worker_client::TargetWorkerClient;
use dspark_proto::{ClusterRequest, InfoRequest, PlaceRequest, WorkerInfo};
use dspark_scheduler::{AuthChannel, ClusterAuth};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tonic::transport::Endpoint;

const SCHEDULER_TIMEOUT: Duration = Duration::from_millis(300);

#[derive(Debug)]
pub enum PlaceError {
    /// No target worker known.
    NoTarget,
    /// Every target worker is at capacity.
    Full,
}

pub struct Cluster {
    scheduler: Option<String>,
    /// Static workers (`--targets`, `--drafts`) when there is no scheduler.
    view: RwLock<Vec<WorkerInfo>>,
    /// Channels by URL, each call carrying the cluster token.
    channels: Mutex<HashMap<String, AuthChannel>>,
    auth: ClusterAuth,
    /// Requests this router has in flight per target address (local placement).
    local_load: Mutex<HashMap<String, u32>>,
    /// After the scheduler failed to answer, placement skips it until then (a stalled
    /// scheduler must not add its timeout to every request).
    skip_scheduler_until: Mutex<Option<std::time::Instant>>,
    /// Without a scheduler: the static targets (ids) that answered an `Info`, with how many
    /// they missed since. The list names addresses, not live workers; readiness counts those
    /// that answered and missed fewer than [`STATIC_MISSES`] in a row.
    answering: Mutex<HashMap<String, u32>>,
    /// Target addresses that failed to take a request (unreachable, connection broken,
    /// draining), until when local placement tries them last. A view kept while the scheduler
    /// is away (or a static list) can name workers that are gone; without this every request
    /// tried them first, each costing a connect, and enough of them used up its tries.
    suspect: Mutex<HashMap<String, std::time::Instant>>,
}

/// How long a target that failed to take a request is tried last by local placement.
const SUSPECT_FOR: Duration = Duration::from_secs(10);

/// `Info` calls in a row a static target may miss (a slow answer under load) and still count
/// as ready.
const STATIC_MISSES: u32 = 3;

/// How long placement stays local after the scheduler failed to answer.
const SCHEDULER_BACKOFF: Duration = Duration::from_secs(2);

impl Cluster {
    pub fn new(scheduler: Option<String>, statics: Vec<WorkerInfo>) -> Arc<Self> {
        Self::with_auth(scheduler, statics, ClusterAuth::default())
    }

    /// As [`Cluster::new`], every call to the scheduler and the workers carrying `auth`.
    pub fn with_auth(
        scheduler: Option<String>,
        statics: Vec<WorkerInfo>,
        auth: ClusterAuth,
    ) -> Arc<Self> {
        Arc::new(Self {
            scheduler: scheduler.map(|s| dspark_scheduler::discovery::normalize_url(&s)),
            view: RwLock::new(statics),
            channels: Mutex::new(HashMap::new()),
            auth,
            local_load: Mutex::new(HashMap::new()),
            skip_scheduler_until: Mutex::new(None),
            answering: Mutex::new(HashMap::new()),
            suspect: Mutex::new(HashMap::new()),
        })
    }

    /// Target workers that can take requests, as far as this router knows: those the
    /// scheduler lists (registered, heartbeating), or without one the static targets that
    /// answered their last `Info` (a `--targets` list whose workers are down or still loading
    /// read ready before).
    /// `workers` is one read of the view ([`Cluster::workers`]). A static target that stops
    /// answering reads not ready after [`STATIC_MISSES`] calls (up to 30 s).
    pub fn ready_targets(&self, workers: &[WorkerInfo]) -> usize {
        let targets = workers
            .iter()
            .filter(|w| w.role == dspark_scheduler::placement::ROLE_TARGET);
        if self.scheduler.is_some() {
            return targets.count();
        }
        let Ok(a) = self.answering.lock() else {
            return 0;
        };
        targets
            .filter(|t| a.get(&t.id).is_some_and(|&m| m < STATIC_MISSES))
            .count()
    }

    /// Refreshes the view from the scheduler every `period` (no-op without one).
    pub fn spawn_refresh(self: &Arc<Self>, period: Duration) {
        let Some(url) = self.scheduler.clone() else {
            return;
        };
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                if let Ok(ch) = me.channel_for_url(&url) {
                    let mut c = SchedulerClient::new(ch)
                        .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES);
                    if let Ok(Ok(v)) =
                        tokio::time::timeout(SCHEDULER_TIMEOUT, c.cluster(ClusterRequest {})).await
                    {
                        let v = v.into_inner();
                        if let Ok(mut w) = me.view.write() {
                            if v.warming {
                                // Just restarted: keep what we knew until workers are back.
                                for n in v.workers {
                                    w.retain(|o| o.id != n.id);
                                    w.push(n);
                                }
                            } else {
                                *w = v.workers;
                            }
                        }
                        me.forget_departed(&url);
                    }
                }
                tokio::time::sleep(period).await;
            }
        });
    }

    /// Without a scheduler, asks each static target worker for its own description every
    /// `period` (at once, then again): its context and capacity (`max_running`) replace the
    /// placeholders a `--targets` entry starts with (no context known: chat answers were not
    /// trimmed to fit and too long a prompt reached the worker; capacity 16 whatever the
    /// worker runs). Its id, role and address stay the list's. Whether each answered is what
    /// readiness reads; while none has, it asks every half second.
    pub fn spawn_static_info(self: &Arc<Self>, period: Duration) {
        if self.scheduler.is_some() {
            return;
        }
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                for t in me.targets() {
                    let answered = match me.target_client(&t.address) {
                        Ok(mut c) => {
                            tokio::time::timeout(SCHEDULER_TIMEOUT, c.info(InfoRequest {})).await
                        }
                        Err(_) => {
                            me.set_answering(&t.id, false);
                            continue;
                        }
                    };
                    let Ok(Ok(i)) = answered else {
                        me.set_answering(&t.id, false);
                        continue;
                    };
                    me.set_answering(&t.id, true);
                    let i = i.into_inner();
                    if let Ok(mut w) = me.view.write()
                        && let Some(e) = w.iter_mut().find(|w| w.id == t.id)
                    {
                        e.max_context = i.max_context;
                        if i.capacity > 0 {
                            e.capacity = i.capacity;
                        }
                    }
                }
                let none = me
                    .answering
                    .lock()
                    .map(|a| a.values().all(|&m| m >= STATIC_MISSES))
                    .unwrap_or(true);
                let wait = if none {
                    period.min(Duration::from_millis(500))
                } else {
                    period
                };
                tokio::time::sleep(wait).await;
            }
        });
    }

    fn set_answering(&self, id: &str, yes: bool) {
        if let Ok(mut a) = self.answering.lock() {
            if yes {
                a.insert(id.to_string(), 0);
            } else if let Some(m) = a.get_mut(id) {
                *m = m.saturating_add(1);
            }
        }
    }

    /// Drops the channels and load counts of workers no longer in the view (pods come and go
    /// with every rollout, each at a new address; a router lives through many). Streams still
    /// open to a departed worker keep their own handle on its channel.
    fn forget_departed(&self, scheduler_url: &str) {
        let live: std::collections::HashSet<String> = self
            .workers()
            .iter()
            .map(|w| dspark_scheduler::discovery::normalize_url(&w.address))
            .collect();
        if let Ok(mut m) = self.channels.lock() {
            m.retain(|url, _| url == scheduler_url || live.contains(url));
        }
        if let Ok(mut l) = self.local_load.lock() {
            l.retain(|addr, n| {
                *n > 0 || live.contains(&dspark_scheduler::discovery::normalize_url(addr))
            });
        }
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.view.read().map(|v| v.clone()).unwrap_or_default()
    }

    pub fn targets(&self) -> Vec<WorkerInfo> {
        self.workers()
            .into_iter()
            .filter(|w| w.role == dspark_scheduler::placement::ROLE_TARGET)
            .collect()
    }

    /// The context a request for `model` must fit: the smallest among its target workers
    /// that published one (a prompt that fits it fits wherever it is placed), 0 when none did.
    pub fn context_for(&self, model: &str) -> u32 {
        self.targets()
            .iter()
            .filter(|w| model.is_empty() || w.model.is_empty() || w.model == model)
            .map(|w| w.max_context)
            .filter(|&c| c > 0)
            .min()
            .unwrap_or(0)
    }

    /// Sum of target capacities (admission control).
    pub fn capacity(&self) -> usize {
        self.targets().iter().map(|t| t.capacity as usize).sum()
    }

    fn channel_for_url(&self, url: &str) -> Result<AuthChannel, String> {
        let mut m = self.channels.lock().map_err(|_| "poisoned".to_string())?;
        if let Some(c) = m.get(url) {
            return Ok(c.clone());
        }
        let c = Endpoint::from_shared(url.to_string())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            // A worker whose node went away sends no reset: without pings its streams would
            // wait for tokens forever, and their requests never fail over.
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true)
            .tcp_keepalive(Some(Duration::from_secs(30)))
            .connect_lazy();
        let c = self.auth.channel(c);
        m.insert(url.to_string(), c.clone());
        Ok(c)
    }

    pub fn target_client(&self, addr: &str) -> Result<TargetWorkerClient<AuthChannel>, String> {
        let ch = self.channel_for_url(&dspark_scheduler::discovery::normalize_url(addr))?;
        Ok(TargetWorkerClient::new(ch)
            .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(dspark_proto::MAX_MESSAGE_BYTES))
    }

    /// A target (and draft) for a new request; `exclude` lists target ids that just failed. A
    /// `failover` goes to the least loaded target even when all read full (see
    /// [`Cluster::place_locally`]).
    pub async fn place(
        &self,
        model: &str,
        exclude: &[String],
        prompt: &[u32],
        failover: bool,
    ) -> Result<(WorkerInfo, Option<WorkerInfo>), PlaceError> {
        let skip = self
            .skip_scheduler_until
            .lock()
            .ok()
            .and_then(|g| *g)
            .is_some_and(|t| std::time::Instant::now() < t);
        // A failover is placed from the view (the scheduler would refuse it where every
        // target reads full).
        if exclude.is_empty() && !skip && !failover {
            if let Some(url) = &self.scheduler {
                if let Ok(ch) = self.channel_for_url(url) {
                    let mut c = SchedulerClient::new(ch)
                        .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES);
                    let r =
                        tokio::time::timeout(
                            SCHEDULER_TIMEOUT,
                            c.place(PlaceRequest {
                                model: model.to_string(),
                                prompt_tokens: prompt.len() as u32,
                                prefix_hashes: dspark_scheduler::placement::prefix_hashes(prompt),
                                // The placement's span goes under the request's.
                                traceparent: dspark_scheduler::traceparent_of(
                                    &tracing::Span::current(),
                                ),
                                ..Default::default()
                            }),
                        )
                        .await;
                    match r {
                        Ok(Ok(p)) => {
                            let p = p.into_inner();
                            if let Some(t) = p.target {
                                return Ok((t, p.draft));
                            }
                        }
                        Ok(Err(s)) if s.code() == tonic::Code::ResourceExhausted => {
                            return Err(PlaceError::Full);
                        }
                        Ok(Err(s))
                            if s.code() == tonic::Code::Unavailable
                                && s.message().starts_with("no target") =>
                        {
                            // A scheduler that just restarted knows no worker until they
                            // re-register; the last view (kept while it is warming) still does.
                            // A worker that is really gone has left the view at the next refresh.
                            return self.place_locally(model, exclude, failover);
                        }
                        _ => {
                            tracing::debug!("scheduler unavailable; placing from the last view");
                            if let Ok(mut g) = self.skip_scheduler_until.lock() {
                                *g = Some(std::time::Instant::now() + SCHEDULER_BACKOFF);
                            }
                        }
                    }
                }
            }
        }
        self.place_locally(model, exclude, failover)
    }

    /// The scheduler's choice made from the last view: workers of this model (a static
    /// `--targets` entry names none and serves any), the least loaded target with room, and
    /// a draft worker of its model and vocabulary. A failover takes the least loaded target
    /// whether it has room or not: its request was admitted before its worker died, and the
    /// target queues it behind what it runs (a busy cluster is when failovers are most needed).
    fn place_locally(
        &self,
        model: &str,
        exclude: &[String],
        failover: bool,
    ) -> Result<(WorkerInfo, Option<WorkerInfo>), PlaceError> {
        let serves = |w: &WorkerInfo| model.is_empty() || w.model.is_empty() || w.model == model;
        let view = self.workers();
        let load = self
            .local_load
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default();
        let targets: Vec<&WorkerInfo> = view
            .iter()
            .filter(|w| w.role == dspark_scheduler::placement::ROLE_TARGET)
            .filter(|w| serves(w))
            .filter(|w| !exclude.contains(&w.id))
            .collect();
        if targets.is_empty() {
            return Err(PlaceError::NoTarget);
        }
        let now = std::time::Instant::now();
        let suspect = self
            .suspect
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, until)| now < **until)
                    .map(|(a, _)| a.clone())
                    .collect::<std::collections::HashSet<String>>()
            })
            .unwrap_or_default();
        let t = targets
            .iter()
            .filter(|t| failover || load.get(&t.address).copied().unwrap_or(0) < t.capacity.max(1))
            .min_by_key(|t| {
                (
                    suspect.contains(&t.address),
                    load.get(&t.address).copied().unwrap_or(0),
                    t.id.clone(),
                )
            })
            .ok_or(PlaceError::Full)?;
        let d = view
            .iter()
            .filter(|w| w.role == dspark_scheduler::placement::ROLE_DRAFT)
            .filter(|w| serves(w))
            .filter(|w| w.vocab_hash == t.vocab_hash || w.vocab_hash.is_empty())
            .min_by_key(|w| (w.load, w.id.clone()))
            .cloned();
        Ok(((*t).clone(), d))
    }

    /// `addr` failed to take a request: local placement tries it last for a while.
    pub fn suspect(&self, addr: &str) {
        if let Ok(mut m) = self.suspect.lock() {
            let now = std::time::Instant::now();
            m.retain(|_, until| now < *until);
            m.insert(addr.to_string(), now + SUSPECT_FOR);
        }
    }

    /// `addr` took a request: it is no longer tried last.
    pub fn reachable(&self, addr: &str) {
        if let Ok(mut m) = self.suspect.lock()
            && !m.is_empty()
        {
            m.remove(addr);
        }
    }

    pub fn track(&self, addr: &str, delta: i32) {
        if let Ok(mut l) = self.local_load.lock() {
            let e = l.entry(addr.to_string()).or_insert(0);
            *e = (*e as i64 + delta as i64).max(0) as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspark_scheduler::placement::{ROLE_DRAFT, ROLE_TARGET};

    fn worker(id: &str, role: &str, model: &str) -> WorkerInfo {
        WorkerInfo {
            id: id.into(),
            role: role.into(),
            model: model.into(),
            address: format!("{id}:1"),
            capacity: 4,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn placing_from_the_view_keeps_to_the_model() {
        let c = Cluster::new(
            None,
            vec![
                worker("a-target", ROLE_TARGET, "a"),
                worker("b-target", ROLE_TARGET, "b"),
                worker("a-draft", ROLE_DRAFT, "a"),
                worker("b-draft", ROLE_DRAFT, "b"),
            ],
        );
        for m in ["a", "b"] {
            let (t, d) = c.place(m, &[], &[1, 2, 3], false).await.expect("placed");
            assert_eq!(t.id, format!("{m}-target"));
            assert_eq!(d.expect("a draft worker").id, format!("{m}-draft"));
        }
        assert!(matches!(
            c.place("c", &[], &[], false).await,
            Err(PlaceError::NoTarget)
        ));
        // A static `--targets` entry names no model and serves any.
        let s = Cluster::new(None, vec![worker("static", ROLE_TARGET, "")]);
        assert_eq!(
            s.place("c", &[], &[], false).await.expect("placed").0.id,
            "static"
        );
    }

    /// Every target at capacity: a new request is refused (429 upstream), a failover from a
    /// dead worker still goes to the least loaded survivor (before, it was refused too, and
    /// the client lost its answer half way).
    #[tokio::test]
    async fn a_failover_is_placed_when_every_target_reads_full() {
        let c = Cluster::new(
            None,
            vec![
                worker("dead", ROLE_TARGET, "a"),
                worker("x", ROLE_TARGET, "a"),
                worker("y", ROLE_TARGET, "a"),
            ],
        );
        for (addr, n) in [("x:1", 4), ("y:1", 5), ("dead:1", 4)] {
            for _ in 0..n {
                c.track(addr, 1);
            }
        }
        let gone = ["dead".to_string()];
        assert!(matches!(
            c.place("a", &gone, &[1], false).await,
            Err(PlaceError::Full)
        ));
        let (t, _) = c
            .place("a", &gone, &[1], true)
            .await
            .expect("failover placed");
        assert_eq!(t.id, "x");
    }

    /// A target that failed to take a request is tried after every other, even less loaded
    /// and first by id, until it takes one again; it is still placed when it is the only one.
    #[tokio::test]
    async fn a_target_that_failed_is_tried_last() {
        let c = Cluster::new(
            None,
            vec![worker("a", ROLE_TARGET, "m"), worker("b", ROLE_TARGET, "m")],
        );
        c.track("b:1", 1);
        assert_eq!(
            c.place("m", &[], &[1], false).await.expect("placed").0.id,
            "a"
        );
        c.suspect("a:1");
        assert_eq!(
            c.place("m", &[], &[1], false).await.expect("placed").0.id,
            "b"
        );
        let b = ["b".to_string()];
        assert_eq!(
            c.place("m", &b, &[1], false).await.expect("placed").0.id,
            "a"
        );
        c.reachable("a:1");
        assert_eq!(
            c.place("m", &[], &[1], false).await.expect("placed").0.id,
            "a"
        );
    }
}
