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
const MIN_TTL: Duration = Duration::from_millis(200);
const MAX_TTL: Duration = Duration::from_secs(60);

#[derive(Clone)]
pub struct SchedulerService {
    pub cluster: Arc<Mutex<Cluster>>,
    started: Instant,
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

/// After a (re)start, workers need up to a TTL to register again.
const WARMUP: Duration = Duration::from_secs(3);

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

    fn warming(&self) -> bool {
        self.started.elapsed() < WARMUP
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
        let id = req.into_inner().id;
        if !self.lock()?.remove(&id) {
            return Err(Status::not_found(format!("unknown worker `{id}`")));
        }
        tracing::info!(worker = id, "worker left");
        Ok(Response::new(RegisterReply { ttl_ms: 0 }))
    }

    async fn place(&self, req: Request<PlaceRequest>) -> Result<Response<Placement>, Status> {
        let r = req.into_inner();
        let placed = self.lock()?.place(&r.model, &[], &r.prefix_hashes);
        let count = match &placed {
            Ok(_) => &self.counts.placed,
            Err(PlaceError::Full(_)) => &self.counts.full,
            Err(PlaceError::NoTarget(_)) => &self.counts.no_target,
        };
        count.fetch_add(1, Ordering::Relaxed);
        match placed {
            Ok((t, d)) => Ok(Response::new(Placement {
                target: Some(t),
                draft: d,
            })),
            Err(PlaceError::NoTarget(_)) if self.warming() => Err(Status::unavailable(
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
            for_step: r.step.saturating_add(2),
            k_total,
        }))
    }

    async fn cluster(&self, _: Request<ClusterRequest>) -> Result<Response<ClusterView>, Status> {
        Ok(Response::new(ClusterView {
            workers: self.lock()?.workers(),
            warming: self.warming(),
        }))
    }
}
