//! The `dspark.v1.Scheduler` gRPC service over the cluster view.

use crate::placement::{Cluster, PlaceError};
use dspark_proto::scheduler_server::Scheduler;
use dspark_proto::{
    BudgetReply, BudgetRequest, ClusterRequest, ClusterView, PlaceRequest, Placement,
    RegisterReply, WorkerId, WorkerInfo,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// TTL granted when a worker asks for none (and the bounds on what it may ask for).
pub const DEFAULT_TTL: Duration = Duration::from_secs(3);
pub const MIN_TTL: Duration = Duration::from_millis(200);
pub const MAX_TTL: Duration = Duration::from_secs(60);

#[derive(Clone)]
pub struct SchedulerService {
    pub cluster: Arc<Mutex<Cluster>>,
    started: Instant,
    /// The longest TTL granted since the start (milliseconds): the static warm-up lasts one of
    /// its heartbeats.
    longest_ttl_ms: Arc<AtomicU64>,
    /// The static warm-up has ended (for good: a long-TTL worker joining later does not
    /// start it again).
    warmed: Arc<std::sync::atomic::AtomicBool>,
    /// Placements by outcome (`placed`, `full`, `no_target`) and budgets computed.
    pub counts: Arc<Counts>,
}

#[derive(Default)]
pub struct Counts {
    pub placed: AtomicU64,
    pub full: AtomicU64,
    pub no_target: AtomicU64,
    pub budgets: AtomicU64,
}

impl Default for SchedulerService {
    fn default() -> Self {
        Self {
            cluster: Arc::default(),
            started: Instant::now(),
            longest_ttl_ms: Arc::default(),
            warmed: Arc::default(),
            counts: Arc::default(),
        }
    }
}

impl SchedulerService {
    /// The scheduler's Prometheus page: the cluster view (workers by role, target capacity and
    /// load) and what placement and budgeting did.
    pub fn render_metrics(&self) -> String {
        use crate::prom::names::*;
        use crate::prom::{labelled, sample};
        let workers = self.lock().map(|c| c.workers()).unwrap_or_default();
        let role = |r: &str| workers.iter().filter(|w| w.role == r).count();
        let targets = workers
            .iter()
            .filter(|w| w.role == crate::placement::ROLE_TARGET);
        let (cap, load) = targets.fold((0u64, 0u64), |(c, l), w| {
            (c + w.capacity as u64, l + w.load as u64)
        });
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut s = String::new();
        labelled(
            &mut s,
            S_WORKERS,
            "gauge",
            "Workers in the cluster view, by role.",
            "role",
            [
                ("target", role(crate::placement::ROLE_TARGET)),
                ("draft", role(crate::placement::ROLE_DRAFT)),
            ],
        );
        sample(
            &mut s,
            S_TARGET_CAPACITY,
            "gauge",
            "Requests the target workers can hold.",
            cap,
        );
        sample(
            &mut s,
            S_TARGET_LOAD,
            "gauge",
            "Requests the target workers hold (last reports plus placements since).",
            load,
        );
        labelled(
            &mut s,
            S_PLACEMENTS_TOTAL,
            "counter",
            "Placement requests, by outcome.",
            "outcome",
            [
                ("placed", g(&self.counts.placed)),
                ("full", g(&self.counts.full)),
                ("no_target", g(&self.counts.no_target)),
            ],
        );
        sample(
            &mut s,
            S_BUDGETS_TOTAL,
            "counter",
            "Central verification budgets computed.",
            g(&self.counts.budgets),
        );
        s
    }
}

/// Static registration: after a (re)start, workers need up to one heartbeat to register again
/// (a third of their TTL), plus a second of slack for the call itself. The warm-up lasts at
/// least [`WARMUP_MIN`], while no worker has checked in at most one heartbeat of the longest
/// TTL allowed ([`WARMUP_MAX`]), and once workers are back one heartbeat of the longest TTL
/// they were granted: workers on the default TTL end it at 3 s, long-TTL ones extend it.
const WARMUP_MIN: Duration = Duration::from_secs(3);
const WARMUP_MAX: Duration = Duration::from_millis(MAX_TTL.as_millis() as u64 / 3 + 1000);

impl SchedulerService {
    /// Sweeps the view every [`crate::placement::SWEEP_PERIOD`], so that expiry happens on time
    /// (not only when a call arrives) and a gap between sweeps marks a stall of this process.
    pub fn spawn_sweeper(&self) {
        let cluster = Arc::clone(&self.cluster);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::placement::SWEEP_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Ok(mut c) = cluster.lock() else { return };
                expire_now(&mut c);
            }
        });
    }

    /// With etcd, until a snapshot is read and while the watch is down (a snapshot holds every
    /// leased worker, so no time is needed); statically, until every worker has had a
    /// heartbeat's time to check in.
    fn warming(&self, c: &Cluster) -> bool {
        match c.etcd_live() {
            Some(live) => !live,
            None => {
                if self.warmed.load(Ordering::Relaxed) {
                    return false;
                }
                let t = self.started.elapsed();
                let beat =
                    Duration::from_millis(self.longest_ttl_ms.load(Ordering::Relaxed) / 3 + 1000);
                let warming = t < WARMUP_MIN || (t < WARMUP_MAX && (c.is_empty() || t < beat));
                if !warming {
                    self.warmed.store(true, Ordering::Relaxed);
                }
                warming
            }
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Cluster>, Status> {
        let mut c = self
            .cluster
            .lock()
            .map_err(|_| Status::internal("cluster view poisoned"))?;
        expire_now(&mut c);
        Ok(c)
    }
}

/// Drops the workers whose TTL passed (the sweeper's tick and every call do it).
fn expire_now(c: &mut Cluster) {
    for id in c.expire(Instant::now()) {
        tracing::info!(worker = id, "worker expired");
    }
}

/// Most workers one scheduler keeps: a registration past it is refused.
pub const MAX_WORKERS: usize = 4096;
/// Longest string field of a registration, and most entries of its lists: every router and
/// worker reads these back with each cluster view.
const MAX_FIELD_BYTES: usize = 1024;
const MAX_SPS_STEPS: usize = 8192;
const MAX_COPY_FLOATS: usize = 1024;
/// Most prefix hashes a placement request may carry: routers send at most
/// [`crate::placement::PREFIX_BLOCKS_MAX`]; each is remembered per worker.
pub const MAX_PREFIX_HASHES: usize = 4 * crate::placement::PREFIX_BLOCKS_MAX;

pub(crate) fn check_info(i: &WorkerInfo) -> Result<(), Status> {
    if i.id.is_empty() || i.id.len() > 256 {
        return Err(Status::invalid_argument("worker id must be 1..=256 bytes"));
    }
    for (name, v) in [
        ("model", &i.model),
        ("vocab_hash", &i.vocab_hash),
        ("drafter", &i.drafter),
        ("sps_key", &i.sps_key),
        ("copy_head_inputs", &i.copy_head_inputs),
        ("instance", &i.instance),
    ] {
        if v.len() > MAX_FIELD_BYTES {
            return Err(Status::invalid_argument(format!(
                "{name} is {} bytes (at most {MAX_FIELD_BYTES})",
                v.len()
            )));
        }
    }
    for (name, len, max) in [
        ("feature_layers", i.feature_layers.len(), 64),
        ("sps", i.sps.len(), MAX_SPS_STEPS),
        ("copy_runs", i.copy_runs.len(), MAX_COPY_FLOATS),
        ("copy_head", i.copy_head.len(), MAX_COPY_FLOATS),
    ] {
        if len > max {
            return Err(Status::invalid_argument(format!(
                "{name} has {len} entries (at most {max})"
            )));
        }
    }
    // A table that cannot price a budget (empty steps/s, NaN, rising with B) is refused at
    // registration: accepted, it failed every budget call later, the worker left on local
    // budgets with nothing said why.
    if !i.sps.is_empty() {
        crate::admission::SpsTable::new(
            i.sps
                .iter()
                .map(|s| (s.batch_tokens, s.steps_per_s))
                .collect(),
        )
        .map_err(|e| Status::invalid_argument(format!("sps: {e}")))?;
    }
    if i.role != crate::placement::ROLE_TARGET && i.role != crate::placement::ROLE_DRAFT {
        return Err(Status::invalid_argument(format!(
            "role must be `target` or `draft`, not `{}`",
            i.role
        )));
    }
    if !crate::discovery::is_dialable(&i.address) {
        return Err(Status::invalid_argument(format!(
            "address `{}` is not host:port",
            i.address
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl Scheduler for SchedulerService {
    async fn register(&self, req: Request<WorkerInfo>) -> Result<Response<RegisterReply>, Status> {
        let info = req.into_inner();
        check_info(&info)?;
        let ttl = if info.ttl_ms == 0 {
            DEFAULT_TTL
        } else {
            Duration::from_millis(info.ttl_ms as u64).clamp(MIN_TTL, MAX_TTL)
        };
        let mut c = self.lock()?;
        // Default ids (`target-<port>`) repeat across hosts: a live worker's entry must not be
        // taken over by another's heartbeats. Expired entries are gone (`lock`), and a restart
        // on the same address is the same worker.
        // A worker that restarted at another address (a pod with a new IP) takes its id over
        // once the old entry has missed a heartbeat (a third of its TTL, and a second).
        if let Some((old, silent)) = c.address_of(&info.id)
            && old != info.address
            && silent <= c.ttl_of(&info.id).unwrap_or(DEFAULT_TTL) / 3 + Duration::from_secs(1)
        {
            return Err(Status::already_exists(format!(
                "worker id `{}` is registered by {old}, which heartbeats, not by {}: give each \
                 worker its own --id",
                info.id, info.address
            )));
        }
        self.longest_ttl_ms
            .fetch_max(ttl.as_millis() as u64, Ordering::Relaxed);
        let new = !c.contains(&info.id);
        if new && c.len() >= MAX_WORKERS {
            return Err(Status::resource_exhausted(format!(
                "{} workers registered already (at most {MAX_WORKERS})",
                c.len()
            )));
        }
        if new {
            tracing::info!(
                worker = info.id,
                role = info.role,
                address = info.address,
                "worker joined"
            );
        }
        c.upsert(info, ttl, Instant::now());
        Ok(Response::new(RegisterReply {
            ttl_ms: ttl.as_millis() as u32,
        }))
    }

    async fn deregister(&self, req: Request<WorkerId>) -> Result<Response<RegisterReply>, Status> {
        let WorkerId { id, address } = req.into_inner();
        // Only the worker at the registered address takes a registration away: a caller
        // naming ids alone could empty placement.
        if address.is_empty() {
            return Err(Status::invalid_argument(format!(
                "deregistering `{id}` needs the worker's address"
            )));
        }
        let mut c = self.lock()?;
        // A worker refused for another's id (ALREADY_EXISTS) leaves too: not with the live one.
        if let Some((other, _)) = c.address_of(&id)
            && other != address
        {
            return Err(Status::not_found(format!(
                "worker `{id}` is registered by {other}, not {address}"
            )));
        }
        if !c.remove(&id) {
            return Err(Status::not_found(format!("unknown worker `{id}`")));
        }
        tracing::info!(worker = id, "worker left");
        Ok(Response::new(RegisterReply { ttl_ms: 0 }))
    }

    async fn place(&self, req: Request<PlaceRequest>) -> Result<Response<Placement>, Status> {
        let r = req.into_inner();
        // Under the router's request span when it sent its context (no await below: the
        // guard is never held across one).
        let span = tracing::info_span!(
            "place",
            model = %r.model,
            target = tracing::field::Empty,
            draft = tracing::field::Empty
        );
        crate::set_parent(&span, &r.traceparent);
        let _g = span.enter();
        if r.prefix_hashes.len() > MAX_PREFIX_HASHES {
            return Err(Status::invalid_argument(format!(
                "{} prefix hashes (at most {MAX_PREFIX_HASHES})",
                r.prefix_hashes.len()
            )));
        }
        let mut c = self.lock()?;
        // Routers place from their own view on Unavailable, which beats a view that fills up
        // with dead workers' placements.
        if c.etcd_live() == Some(false) {
            return Err(Status::unavailable(
                "scheduler view stale: etcd unreachable",
            ));
        }
        let placed = c.place(&r.model, &[], &r.prefix_hashes);
        let warming = self.warming(&c);
        drop(c);
        let count = match &placed {
            Ok(_) => &self.counts.placed,
            Err(PlaceError::Full(_)) => &self.counts.full,
            Err(PlaceError::NoTarget(_)) => &self.counts.no_target,
        };
        count.fetch_add(1, Ordering::Relaxed);
        match placed {
            Ok((t, d)) => {
                span.record("target", t.id.as_str());
                if let Some(d) = &d {
                    span.record("draft", d.id.as_str());
                }
                Ok(Response::new(Placement {
                    target: Some(t),
                    draft: d,
                }))
            }
            Err(PlaceError::NoTarget(_)) if warming => Err(Status::unavailable(
                "scheduler warming up (workers are registering)",
            )),
            Err(PlaceError::NoTarget(m)) => Err(Status::unavailable(format!(
                "no target worker serves model `{m}`"
            ))),
            Err(PlaceError::Full(m)) => Err(Status::resource_exhausted(format!(
                "every target worker for `{m}` is at capacity"
            ))),
        }
    }

    async fn budget(&self, req: Request<BudgetRequest>) -> Result<Response<BudgetReply>, Status> {
        let r = req.into_inner();
        let info = self
            .lock()?
            .get(&r.worker_id)
            .ok_or_else(|| Status::not_found(format!("unknown worker `{}`", r.worker_id)))?;
        let sps = crate::admission::SpsTable::new(
            info.sps
                .iter()
                .map(|s| (s.batch_tokens, s.steps_per_s))
                .collect(),
        )
        .map_err(|e| Status::failed_precondition(format!("worker `{}`: {e}", r.worker_id)))?;
        if r.rows.len() > crate::admission::MAX_REQUESTS {
            return Err(Status::invalid_argument("too many requests in one report"));
        }
        if r.spec_step_s.len() > crate::admission::MAX_PRICED {
            return Err(Status::invalid_argument(format!(
                "{} step prices in one report (at most {})",
                r.spec_step_s.len(),
                crate::admission::MAX_PRICED
            )));
        }
        let rows: Vec<&[f32]> = r.rows.iter().map(|x| x.c.as_slice()).collect();
        let max_k = r.max_k.min(u8::MAX as u32) as u8;
        let step = crate::admission::StepLimits {
            max_batch_tokens: r.max_batch_tokens,
            kv_headroom: r.kv_headroom,
            other_tokens: r.other_tokens,
            plain_requests: r.plain_requests,
        };
        // The worker's measured prices weigh its drafting, which the table does not price.
        let prices = crate::admission::StepPrices {
            plain_s: r.plain_step_s,
            spec_s: r.spec_step_s,
        };
        let mut adm = crate::admission::Admission::default();
        let (k_total, judged) =
            crate::admission::central_budget(&mut adm, &rows, max_k, step, &sps, &prices);
        if adm.clamped > 0 {
            tracing::debug!(
                worker = r.worker_id,
                clamped = adm.clamped,
                "confidences clamped into (0, 1)"
            );
        }
        if judged.is_none() && !prices.spec_s.is_empty() {
            tracing::debug!(
                worker = r.worker_id,
                k_total,
                "step prices do not price the budget; the table alone decides"
            );
        }
        self.counts.budgets.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(BudgetReply {
            for_step: r
                .step
                .saturating_add(if r.lag == 0 { 2 } else { u64::from(r.lag) }),
            k_total,
        }))
    }

    async fn cluster(&self, _: Request<ClusterRequest>) -> Result<Response<ClusterView>, Status> {
        let c = self.lock()?;
        Ok(Response::new(ClusterView {
            workers: c.workers(),
            warming: self.warming(&c),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::ROLE_TARGET;

    fn target(id: &str, address: &str) -> WorkerInfo {
        WorkerInfo {
            id: id.into(),
            role: ROLE_TARGET.into(),
            address: address.into(),
            capacity: 1,
            ..Default::default()
        }
    }

    fn started_ago(secs: u64) -> SchedulerService {
        SchedulerService {
            started: Instant::now()
                .checked_sub(Duration::from_secs(secs))
                .expect("a clock that far back"),
            ..Default::default()
        }
    }

    /// A worker with a long TTL heartbeats every 10 s: a scheduler restarted 5 s ago (past
    /// the old 3 s warm-up) may not have heard it yet, so routers must keep their views; once
    /// workers on the default TTL are back, 3 s is enough.
    #[tokio::test]
    async fn static_warm_up_outlasts_the_longest_heartbeat() {
        let empty = Cluster::default();
        assert!(started_ago(2).warming(&empty));
        assert!(started_ago(5).warming(&empty), "nobody back yet");
        assert!(started_ago(19).warming(&empty));
        assert!(!started_ago(22).warming(&empty));
        let back = |ttl_ms: u32, ago: u64| async move {
            let svc = started_ago(ago);
            svc.register(Request::new(WorkerInfo {
                ttl_ms,
                ..target("t", "127.0.0.1:5")
            }))
            .await
            .expect("registered");
            let c = svc.cluster.lock().expect("lock");
            svc.warming(&c)
        };
        assert!(back(0, 2).await);
        assert!(!back(0, 5).await, "default TTL: heard within 3 s");
        assert!(back(30_000, 5).await, "a 10 s heartbeat may not have come");
        assert!(!back(30_000, 12).await);
        // Once over, a long-TTL worker joining later does not start it again (routers would
        // keep departed workers in their views meanwhile).
        let svc = started_ago(5);
        svc.register(Request::new(target("a", "127.0.0.1:5")))
            .await
            .expect("registered");
        assert!(!svc.warming(&svc.cluster.lock().expect("lock")));
        svc.register(Request::new(WorkerInfo {
            ttl_ms: 60_000,
            ..target("b", "127.0.0.1:6")
        }))
        .await
        .expect("registered");
        assert!(!svc.warming(&svc.cluster.lock().expect("lock")));
    }

    /// With etcd, a view without a snapshot (not yet, or the watch lost) is stale: placement
    /// defers to the routers (Unavailable) instead of reading dead workers' placements as full,
    /// and the cluster view says warming so routers keep theirs. A snapshot makes it live.
    #[tokio::test]
    async fn a_stale_etcd_view_defers_placement_and_reads_warming() {
        let svc = started_ago(60);
        let watcher = crate::discovery::spawn_etcd_watcher(
            vec!["127.0.0.1:1".into()],
            Arc::clone(&svc.cluster),
        );
        {
            let mut c = svc.cluster.lock().expect("lock");
            // Capacity 1, one placement already: full until a load report, which never comes.
            c.upsert(
                target("t", "127.0.0.1:5"),
                Duration::from_secs(3600),
                Instant::now(),
            );
            assert!(c.place("", &[], &[]).is_ok());
        }
        for _ in 0..2 {
            let e = svc
                .place(Request::new(PlaceRequest::default()))
                .await
                .expect_err("stale");
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
            assert!(e.message().contains("etcd unreachable"), "{e:?}");
            let v = svc
                .cluster(Request::new(ClusterRequest {}))
                .await
                .expect("view")
                .into_inner();
            assert!(v.warming, "no snapshot read");
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        watcher.abort();
        // A snapshot (here its effect: the view live, the worker's load report read).
        {
            let mut c = svc.cluster.lock().expect("lock");
            c.upsert(
                target("t", "127.0.0.1:5"),
                Duration::from_secs(3600),
                Instant::now(),
            );
            c.set_etcd_live(true);
        }
        assert!(
            svc.place(Request::new(PlaceRequest::default()))
                .await
                .is_ok()
        );
        let v = svc
            .cluster(Request::new(ClusterRequest {}))
            .await
            .expect("view")
            .into_inner();
        assert!(!v.warming);
    }

    /// Routers send at most PREFIX_BLOCKS_MAX hashes; far more is refused, not remembered.
    #[tokio::test]
    async fn placements_with_too_many_prefix_hashes_are_refused() {
        let svc = SchedulerService::default();
        svc.register(Request::new(WorkerInfo {
            capacity: 8,
            ..target("t", "127.0.0.1:5")
        }))
        .await
        .expect("registered");
        let place = |n: usize| PlaceRequest {
            prefix_hashes: (0..n as u64).collect(),
            ..Default::default()
        };
        let e = svc
            .place(Request::new(place(MAX_PREFIX_HASHES + 1)))
            .await
            .expect_err("too many");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(
            e.message()
                .contains(&format!("at most {MAX_PREFIX_HASHES}")),
            "{e:?}"
        );
        svc.place(Request::new(place(crate::placement::PREFIX_BLOCKS_MAX)))
            .await
            .expect("what a router sends");
    }

    /// Two workers on different hosts with the same default id: the second is refused while the
    /// first is live; the first may restart on its address, and once its entry expired the id
    /// is free.
    #[tokio::test]
    async fn a_live_id_is_not_taken_over_from_another_address() {
        let svc = SchedulerService::default();
        let (a, b) = ("10.0.0.1:50051", "10.0.0.2:50051");
        svc.register(Request::new(target("target-50051", a)))
            .await
            .expect("first");
        let e = svc
            .register(Request::new(target("target-50051", b)))
            .await
            .expect_err("taken");
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
        for want in ["target-50051", a, b, "--id"] {
            assert!(e.message().contains(want), "{want}: {e:?}");
        }
        let addr = |svc: &SchedulerService| {
            svc.lock()
                .expect("lock")
                .address_of("target-50051")
                .map(|(a, _)| a.to_string())
        };
        assert_eq!(addr(&svc).as_deref(), Some(a));
        // The refused one, stopped, leaves: not with the live one's entry.
        let e = svc
            .deregister(Request::new(WorkerId {
                id: "target-50051".into(),
                address: b.into(),
            }))
            .await
            .expect_err("not b's");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        assert_eq!(addr(&svc).as_deref(), Some(a));
        // Nor by id alone.
        let e = svc
            .deregister(Request::new(WorkerId {
                id: "target-50051".into(),
                address: String::new(),
            }))
            .await
            .expect_err("no address");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert_eq!(addr(&svc).as_deref(), Some(a));
        svc.register(Request::new(target("target-50051", a)))
            .await
            .expect("a restart on the same address");
        // Silent for more than a heartbeat (a third of its 3 s TTL, and a second): a restart
        // at a new address (a pod with a new IP) takes the id over without waiting for the
        // TTL.
        {
            let mut c = svc.cluster.lock().expect("lock");
            let past = Instant::now()
                .checked_sub(Duration::from_millis(2500))
                .expect("a clock that far back");
            c.upsert(target("target-50051", a), Duration::from_secs(3), past);
        }
        svc.register(Request::new(target("target-50051", b)))
            .await
            .expect("a missed heartbeat frees the id");
        assert_eq!(addr(&svc).as_deref(), Some(b));
        {
            let mut c = svc.cluster.lock().expect("lock");
            let past = Instant::now()
                .checked_sub(Duration::from_secs(10))
                .expect("a clock that far back");
            c.upsert(target("target-50051", a), Duration::from_secs(3), past);
        }
        svc.register(Request::new(target("target-50051", a)))
            .await
            .expect("the expired id is free");
        assert_eq!(addr(&svc).as_deref(), Some(a));
    }
}
