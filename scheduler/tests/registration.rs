//! A worker's registration against a real scheduler service on loopback: heartbeats keep it in
//! the view, `leave` takes it out at once (long before its TTL), and one dropped without
//! leaving keeps heartbeating at its pace instead of spinning; a nudge brings the next load
//! report forward, so placement sees room as soon as a request ends; and a worker paces its
//! heartbeats by the TTL the scheduler granted.

use dspark_proto::WorkerInfo;
use dspark_proto::scheduler_client::SchedulerClient;
use dspark_proto::scheduler_server::{Scheduler, SchedulerServer};
use dspark_scheduler::discovery::{Discovery, MIN_NUDGE_GAP, Nudge, spawn_registrar};
use dspark_scheduler::service::SchedulerService;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

async fn scheduler() -> (String, SchedulerService) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let svc = SchedulerService::default();
    tokio::spawn(
        dspark_scheduler::grpc_server(None)
            .add_service(SchedulerServer::new(svc.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), svc)
}

async fn ids(url: &str) -> Vec<String> {
    let mut c = SchedulerClient::connect(url.to_string())
        .await
        .expect("connect");
    c.cluster(dspark_proto::ClusterRequest {})
        .await
        .expect("cluster")
        .into_inner()
        .workers
        .into_iter()
        .map(|w| w.id)
        .collect()
}

async fn until(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

async fn place(
    c: &mut SchedulerClient<tonic::transport::Channel>,
) -> Result<tonic::Response<dspark_proto::Placement>, tonic::Status> {
    c.place(dspark_proto::PlaceRequest::default()).await
}

fn worker(id: &str, beats: Arc<AtomicUsize>) -> Arc<dyn Fn() -> WorkerInfo + Send + Sync> {
    let id = id.to_string();
    Arc::new(move || {
        beats.fetch_add(1, Ordering::SeqCst);
        WorkerInfo {
            id: id.clone(),
            role: "target".into(),
            address: "127.0.0.1:1".into(),
            capacity: 4,
            ..Default::default()
        }
    })
}

#[tokio::test]
async fn leaving_takes_a_worker_out_at_once_and_a_dropped_handle_keeps_its_pace() {
    let (url, svc) = scheduler().await;
    let ttl = Duration::from_secs(30);
    let beats = Arc::new(AtomicUsize::new(0));
    let r = spawn_registrar(
        Discovery::Static(url.clone(), Default::default()),
        ttl,
        worker("w1", beats.clone()),
        Nudge::default(),
    );
    until("registration", Duration::from_secs(5), async || {
        ids(&url).await == ["w1"]
    })
    .await;
    // The scheduler's metrics see it, and count a placement on it.
    let mut c = SchedulerClient::connect(url.clone())
        .await
        .expect("connect");
    c.place(dspark_proto::PlaceRequest::default())
        .await
        .expect("placed");
    let page = svc.render_metrics();
    dspark_scheduler::prom::well_formed(&page).expect("exposition");
    for want in [
        "dspark_scheduler_workers{role=\"target\"} 1\n",
        "dspark_scheduler_target_capacity 4\n",
        "dspark_scheduler_target_load 1\n",
        "dspark_scheduler_placements_total{outcome=\"placed\"} 1\n",
    ] {
        assert!(page.contains(want), "missing {want:?} in\n{page}");
    }
    let t0 = Instant::now();
    r.leave().await;
    assert!(ids(&url).await.is_empty(), "gone as soon as leave returns");
    assert!(
        svc.render_metrics()
            .contains("dspark_scheduler_workers{role=\"target\"} 0\n")
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // Nothing puts it back: no heartbeat after leaving.
    let after = beats.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(ids(&url).await.is_empty());
    assert!(beats.load(Ordering::SeqCst) <= after + 1);

    // A handle dropped without leaving: still registered, heartbeating every ttl/3, not spinning.
    let beats = Arc::new(AtomicUsize::new(0));
    let ttl = Duration::from_millis(600);
    drop(spawn_registrar(
        Discovery::Static(url.clone(), Default::default()),
        ttl,
        worker("w2", beats.clone()),
        Nudge::default(),
    ));
    until("registration", Duration::from_secs(5), async || {
        ids(&url).await == ["w2"]
    })
    .await;
    let b0 = beats.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let n = beats.load(Ordering::SeqCst) - b0;
    assert!(
        (2..=8).contains(&n),
        "{n} heartbeats in 1 s at a 200 ms beat"
    );
    assert_eq!(ids(&url).await, ["w2"]);
}

#[tokio::test]
async fn a_nudge_reports_room_before_the_next_heartbeat() {
    let (url, _svc) = scheduler().await;
    // A 30 s TTL: the next regular heartbeat is 10 s away.
    let (beats, load) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU32::new(0)));
    let info = {
        let (beats, load) = (beats.clone(), load.clone());
        let base = worker("w", Arc::new(AtomicUsize::new(0)));
        Arc::new(move || {
            beats.fetch_add(1, Ordering::SeqCst);
            let mut i = base();
            i.load = load.load(Ordering::SeqCst);
            i
        })
    };
    let nudge = Nudge::default();
    let _r = spawn_registrar(
        Discovery::Static(url.clone(), Default::default()),
        Duration::from_secs(30),
        info,
        nudge.clone(),
    );
    until("registration", Duration::from_secs(5), async || {
        ids(&url).await == ["w"]
    })
    .await;
    let mut c = SchedulerClient::connect(url.clone())
        .await
        .expect("connect");
    // Four placements fill its capacity of 4 (the worker has not reported them yet).
    for _ in 0..4 {
        place(&mut c).await.expect("room");
        load.fetch_add(1, Ordering::SeqCst);
    }
    let full = place(&mut c).await.expect_err("full");
    assert_eq!(full.code(), tonic::Code::ResourceExhausted);
    // Two requests end: the worker nudges, and placement has room again well before 10 s.
    load.fetch_sub(2, Ordering::SeqCst);
    nudge.nudge();
    let waited = until("the nudged report", Duration::from_secs(2), async || {
        place(&mut c).await.is_ok()
    })
    .await;
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    // One more fits (2 reported + 2 placed), then it is full again.
    place(&mut c).await.expect("room for the second");
    assert_eq!(
        place(&mut c).await.expect_err("full").code(),
        tonic::Code::ResourceExhausted
    );
    // A burst of nudges is paced: at most one heartbeat per MIN_NUDGE_GAP.
    let b0 = beats.load(Ordering::SeqCst);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(500) {
        nudge.nudge();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let n = beats.load(Ordering::SeqCst) - b0;
    let most = (500 / MIN_NUDGE_GAP.as_millis() + 2) as usize;
    assert!(
        (2..=most).contains(&n),
        "{n} heartbeats for 500 ms of nudges"
    );
}

/// Registrations too large for every router and worker to read back with each cluster view
/// are refused with a message; a load at u32::MAX and a budget report of u32::MAX tokens are
/// served, not a panic that would poison the cluster view for everyone.
#[tokio::test]
async fn oversized_registrations_are_refused_and_extreme_counts_answer() {
    let (url, _svc) = scheduler().await;
    let mut c = SchedulerClient::connect(url.clone())
        .await
        .expect("connect");
    let base = || WorkerInfo {
        id: "w".into(),
        role: "target".into(),
        address: "127.0.0.1:1".into(),
        capacity: 4,
        ..Default::default()
    };
    let oversized = [
        WorkerInfo {
            copy_head: vec![0.0; 100_000],
            ..base()
        },
        WorkerInfo {
            feature_layers: vec![0; 100_000],
            ..base()
        },
        WorkerInfo {
            model: "m".repeat(100_000),
            ..base()
        },
        WorkerInfo {
            instance: "i".repeat(2048),
            ..base()
        },
        WorkerInfo {
            sps: vec![dspark_proto::SpsStep::default(); 100_000],
            ..base()
        },
    ];
    for w in oversized {
        let e = c.register(w).await.expect_err("oversized registration");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("at most"), "{e:?}");
    }
    assert!(ids(&url).await.is_empty());
    // A table no budget can be priced from is refused at registration, with why.
    let step = |b: u32, s: f64| dspark_proto::SpsStep {
        batch_tokens: b,
        steps_per_s: s,
    };
    for (table, why) in [
        (vec![step(64, f64::NAN)], "NaN steps/s"),
        (vec![step(64, 0.0)], "zero steps/s"),
        (
            vec![step(16, 50.0), step(64, 100.0)],
            "steps/s rising with B",
        ),
    ] {
        let e = c
            .register(WorkerInfo {
                sps: table,
                ..base()
            })
            .await
            .expect_err(why);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{why}: {e:?}");
        assert!(e.message().starts_with("sps:"), "{why}: {e:?}");
    }
    assert!(ids(&url).await.is_empty());

    // A draft worker reporting u32::MAX load, a target to pair it with, and placements.
    let sps = vec![dspark_proto::SpsStep {
        batch_tokens: 64,
        steps_per_s: 100.0,
    }];
    c.register(WorkerInfo {
        sps,
        vocab_hash: "v".into(),
        ..base()
    })
    .await
    .expect("target");
    c.register(WorkerInfo {
        id: "d".into(),
        role: "draft".into(),
        load: u32::MAX,
        vocab_hash: "v".into(),
        ..base()
    })
    .await
    .expect("draft");
    for _ in 0..2 {
        place(&mut c).await.expect("placed");
    }
    let view = c
        .cluster(dspark_proto::ClusterRequest {})
        .await
        .expect("the view is served");
    let d = view.into_inner().workers.into_iter().find(|w| w.id == "d");
    assert_eq!(d.map(|d| d.load), Some(u32::MAX));
    let r = c
        .budget(dspark_proto::BudgetRequest {
            worker_id: "w".into(),
            step: u64::MAX,
            rows: vec![dspark_proto::ConfRow { c: vec![0.9; 4] }],
            other_tokens: u32::MAX,
            kv_headroom: u32::MAX,
            max_batch_tokens: u32::MAX,
            max_k: u32::MAX,
            plain_requests: u32::MAX,
            ..Default::default()
        })
        .await
        .expect("budget")
        .into_inner();
    assert_eq!(r.k_total, 0, "no room in a batch already past the table");
    assert_eq!(r.for_step, u64::MAX);
}

/// A scheduler that grants every worker `ttl_ms`, whatever it asked for (one with tighter
/// limits than the worker's).
struct Granting(SchedulerService, u32);

#[tonic::async_trait]
impl Scheduler for Granting {
    async fn register(
        &self,
        req: tonic::Request<WorkerInfo>,
    ) -> Result<tonic::Response<dspark_proto::RegisterReply>, tonic::Status> {
        let mut r = self.0.register(req).await?;
        r.get_mut().ttl_ms = self.1;
        Ok(r)
    }
    async fn deregister(
        &self,
        req: tonic::Request<dspark_proto::WorkerId>,
    ) -> Result<tonic::Response<dspark_proto::RegisterReply>, tonic::Status> {
        self.0.deregister(req).await
    }
    async fn place(
        &self,
        req: tonic::Request<dspark_proto::PlaceRequest>,
    ) -> Result<tonic::Response<dspark_proto::Placement>, tonic::Status> {
        self.0.place(req).await
    }
    async fn cluster(
        &self,
        req: tonic::Request<dspark_proto::ClusterRequest>,
    ) -> Result<tonic::Response<dspark_proto::ClusterView>, tonic::Status> {
        self.0.cluster(req).await
    }
    async fn budget(
        &self,
        req: tonic::Request<dspark_proto::BudgetRequest>,
    ) -> Result<tonic::Response<dspark_proto::BudgetReply>, tonic::Status> {
        self.0.budget(req).await
    }
}

/// A worker granted a shorter TTL than it asked for heartbeats at a third of the grant, not of
/// its own TTL (which would let the scheduler expire it between beats).
#[tokio::test]
async fn heartbeats_follow_the_granted_ttl() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(
        dspark_scheduler::grpc_server(None)
            .add_service(SchedulerServer::new(Granting(
                SchedulerService::default(),
                600,
            )))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let beats = Arc::new(AtomicUsize::new(0));
    // Asks for 30 s: its own beat is 10 s away.
    let _r = spawn_registrar(
        Discovery::Static(url.clone(), Default::default()),
        Duration::from_secs(30),
        worker("w", beats.clone()),
        Nudge::default(),
    );
    until("registration", Duration::from_secs(5), async || {
        ids(&url).await == ["w"]
    })
    .await;
    let b0 = beats.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let n = beats.load(Ordering::SeqCst) - b0;
    assert!(
        (3..=8).contains(&n),
        "{n} heartbeats in 1 s for a 600 ms grant"
    );
}
