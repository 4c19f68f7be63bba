//! The target worker: the speculative engine (continuous batching, lossless verification) behind
//! `dspark.v1.TargetWorker`, drafting through remote draft workers ([`remote`]) or in-process.
//!
//! The engine runs on its own thread; the gRPC service only validates and queues. Requests carry
//! the draft worker placement paired them with; when that worker is gone or late the request
//! drafts locally for the cycle and nothing is lost.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod engine_loop;
pub mod metrics;
pub mod remote;
pub mod service;
pub mod shard;
pub mod sps;

use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Drafter(#[from] drafter::DrafterError),
    #[error(transparent)]
    Spec(#[from] specdec::SpecError),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = TargetError> = std::result::Result<T, E>;

#[derive(Parser, Debug, Clone)]
#[command(name = "target-worker", about = "dspark target worker")]
pub struct TargetArgs {
    /// Target model (name or path).
    #[arg(long, env = "DSPARK_MODEL", default_value = "smollm2-135m")]
    pub model: String,
    /// gRPC listen address (port 0 picks a free port; the bound address is registered).
    #[arg(long, env = "DSPARK_TARGET_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Address peers dial, HOST[:PORT], published with the registration (default: the bound
    /// address; required when listening on a wildcard such as 0.0.0.0, e.g. the pod IP).
    #[arg(long, env = "DSPARK_ADVERTISE")]
    pub advertise: Option<String>,
    /// Scheduler URL for static registration.
    #[arg(long, env = "DSPARK_SCHEDULER")]
    pub scheduler: Option<String>,
    /// etcd endpoints (comma-separated); registration through an etcd lease instead.
    #[arg(long, env = "DSPARK_ETCD")]
    pub etcd: Option<String>,
    /// Worker id (default: target-<host>-<port> of the published address).
    #[arg(long, env = "DSPARK_WORKER_ID")]
    pub id: Option<String>,
    /// Registration TTL in milliseconds (200..=60000, what the scheduler grants).
    #[arg(long, env = "DSPARK_TTL_MS", default_value_t = 3000)]
    pub ttl_ms: u64,
    /// Default draft length.
    #[arg(long, env = "DSPARK_GAMMA", default_value_t = 4)]
    pub gamma: usize,
    /// Requests decoded at once.
    #[arg(long, env = "DSPARK_MAX_RUNNING", default_value_t = 16)]
    pub max_running: usize,
    /// Requests waiting beyond `--max-running` before new ones are refused
    /// (`RESOURCE_EXHAUSTED`, which the router answers by waiting for room). The router's
    /// placement keeps within the running capacity; this bounds what direct gRPC clients queue.
    /// A failover the router admitted before is taken past it.
    #[arg(long, env = "DSPARK_MAX_QUEUED", default_value_t = 256)]
    pub max_queued: usize,
    /// Draft worker (host:port) for requests that arrive without one.
    #[arg(long, env = "DSPARK_DRAFT_WORKER")]
    pub draft_worker: Option<String>,
    /// Draft in-process with this drafter instead of through draft workers
    /// (none | ngram | draft-model[:NAME] | dspark[:DIR]).
    #[arg(long, env = "DSPARK_LOCAL_DRAFTER")]
    pub local_drafter: Option<String>,
    /// Drafting while no draft worker answers: ngram | none.
    #[arg(long, env = "DSPARK_FALLBACK", default_value = "ngram")]
    pub fallback: String,
    /// How long a cycle waits for its draft worker before drafting locally.
    #[arg(long, env = "DSPARK_DRAFT_TIMEOUT_MS", default_value_t = 1000)]
    pub draft_timeout_ms: u64,
    /// Context features on the wire: f32 | f16 | bf16.
    #[arg(long, env = "DSPARK_FEATURE_DTYPE", default_value = "f16")]
    pub feature_dtype: String,
    /// Turn off the per-request speculation gate.
    #[arg(long, env = "DSPARK_NO_GATE")]
    pub no_gate: bool,
    /// Verify two micro-batches in ping-pong so drafting rounds travel while the other
    /// micro-batch verifies (pays when the drafting hop costs more than an extra weight pass).
    #[arg(long, env = "DSPARK_PINGPONG")]
    pub pingpong: bool,
    /// Do not reuse the KV of earlier requests' prompts and answers (automatic prefix
    /// caching, on by default: whole 16-token blocks a new prompt starts with are not
    /// computed again; output is the same either way).
    #[arg(long, env = "DSPARK_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// Verified positions after which a verdict weighs half in the online recalibration of
    /// the drafter's confidences (0: serve them as the drafter reports them).
    #[arg(long, env = "DSPARK_CALIBRATION_HALF_LIFE", default_value_t = specdec::recal::DEFAULT_HALF_LIFE)]
    pub calibration_half_life: f64,
    /// How verification lengths are chosen: `gate` (per request, from its acceptance rate and
    /// the forward-cost curve) or `scheduler` (hardware-aware admission over the batch from
    /// calibrated confidences and the profiled SPS(B) table, budgets from the central scheduler
    /// when it answers in time).
    #[arg(long, env = "DSPARK_VERIFY_POLICY", default_value = "gate")]
    pub verify_policy: String,
    /// Steps between the confidences a budget is computed from and the step it applies to
    /// (0..=8; 0: each step decides on its own drafts, with no central budgets).
    #[arg(long, env = "DSPARK_BUDGET_LAG", default_value_t = 2)]
    pub budget_lag: usize,
    /// SPS(B) profiling grid (total batch tokens) when no cached profile matches.
    #[arg(long, env = "DSPARK_SPS_GRID", value_delimiter = ',',
          default_values_t = sps::DEFAULT_GRID.to_vec())]
    pub sps_grid: Vec<usize>,
    /// SPS(B) profiling context lengths.
    #[arg(long, env = "DSPARK_SPS_CTX", value_delimiter = ',',
          default_values_t = sps::DEFAULT_CTXS.to_vec())]
    pub sps_ctx: Vec<usize>,
    #[arg(long, env = "DSPARK_HOME")]
    pub home: Option<PathBuf>,
    #[arg(long, env = "DSPARK_PYTHON", default_value = "python3")]
    pub python: String,
    /// Compute threads (0 = all cores).
    #[arg(long, env = "DSPARK_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Seconds one engine step may run before the worker takes its engine for wedged and exits
    /// (code 70; the router resumes its requests elsewhere and the process is restarted). A
    /// step is one prefill chunk and one verification window per request (and, with an
    /// in-process draft model, its prefill of new requests' contexts): seconds, rarely
    /// minutes. 0: never.
    #[arg(long, env = "DSPARK_STEP_TIMEOUT_S", default_value_t = 600)]
    pub step_timeout_s: u64,
    /// Tensor parallelism: the addresses of this worker's other ranks (`dspark tp-shard`),
    /// rank 1 first, comma-separated. This worker is rank 0 of a group of one more than
    /// listed; each rank holds its share of the heads and FFN columns.
    #[arg(long, env = "DSPARK_TP_PEERS", value_delimiter = ',')]
    pub tp_peers: Vec<String>,
    /// How long to wait at start for the other ranks to come up.
    #[arg(long, env = "DSPARK_TP_CONNECT_TIMEOUT_S", default_value_t = 600)]
    pub tp_connect_timeout_s: u64,
    /// Seconds one exchange with a tensor-parallel rank (one read or write on its link) may
    /// take before the link counts as lost and is dialled again: a rank that hangs (stopped,
    /// swapping) holds the engine this long. Above the slowest layer of the largest prefill
    /// chunk on a rank.
    #[arg(long, env = "DSPARK_TP_IO_TIMEOUT_S", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub tp_io_timeout_s: u64,
    /// KV cache element type: f16 (half the bytes attention reads), f32, int8v (f16 keys,
    /// 8-bit values: 77 % of f16's bytes) or int8 (8-bit keys, rotated, and values: 53 %).
    #[arg(long, env = "DSPARK_KV_CACHE_DTYPE", default_value = "f16")]
    pub kv_cache_dtype: String,
    /// Force a kernel path, as `dspark --isa`: scalar | avx2 | avx2vnni | avx512 | avx512bf16
    /// | neon | neondot (default: the fastest this CPU has).
    #[arg(long, env = "DSPARK_ISA", value_parser = kernels::Isa::parse)]
    pub isa: Option<kernels::Isa>,
    /// Serve Prometheus metrics (`GET /metrics`: batch, queue, KV cache, prefix cache,
    /// acceptance per position, step times) on this address; off when unset.
    #[arg(long, env = "DSPARK_TARGET_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// On SIGTERM or Ctrl-C: leave placement, refuse new requests, and let the ones in flight
    /// finish for up to this many seconds before stopping (the router continues any still
    /// running on another worker). Keep it below Kubernetes' terminationGracePeriodSeconds.
    #[arg(long, env = "DSPARK_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Shared cluster token: gRPC calls without `authorization: Bearer TOKEN` are refused, and
    /// calls to the scheduler and draft workers carry it (at least 16 bytes of visible ASCII;
    /// off when unset). `dspark up` and the Helm chart set it.
    #[arg(long, env = "DSPARK_CLUSTER_TOKEN", hide_env_values = true)]
    pub cluster_token: Option<String>,
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
}

/// The engine's settings checked before the model loads (the engine itself would refuse them
/// only after minutes of loading and profiling): `--gamma` in range, `--max-running` at least
/// 1, `--verify-policy` gate or scheduler. `dspark up` checks what it forwards with it too.
pub fn check_engine_args(
    gamma: usize,
    max_running: usize,
    verify_policy: &str,
) -> std::result::Result<(), String> {
    if gamma > specdec::MAX_GAMMA {
        return Err(format!(
            "--gamma {gamma} out of range 0..={}",
            specdec::MAX_GAMMA
        ));
    }
    if max_running == 0 {
        return Err("--max-running 0: a worker decodes at least one request at once".into());
    }
    if !matches!(verify_policy, "gate" | "scheduler") {
        return Err(format!(
            "--verify-policy `{verify_policy}` (gate, scheduler)"
        ));
    }
    Ok(())
}

/// Most steps a budget may lag its confidences: the central scheduler's answers are kept for
/// the last eight steps, and a budget decided from older confidences decides from stale ones.
pub const MAX_BUDGET_LAG: usize = 8;

/// `--budget-lag` within 0..=[`MAX_BUDGET_LAG`], checked before the model loads (a huge lag
/// was a queue of that many budgets allocated after it: an abort minutes into the start).
pub fn check_budget_lag(lag: usize) -> std::result::Result<(), String> {
    if lag > MAX_BUDGET_LAG {
        return Err(format!(
            "--budget-lag {lag} out of range 0..={MAX_BUDGET_LAG}"
        ));
    }
    Ok(())
}

fn parse_dtype(s: &str) -> Result<dspark_proto::Dtype> {
    match s {
        "f32" => Ok(dspark_proto::Dtype::F32),
        "f16" => Ok(dspark_proto::Dtype::F16),
        "bf16" => Ok(dspark_proto::Dtype::Bf16),
        o => Err(TargetError::Config(format!(
            "--feature-dtype `{o}` (f32, f16, bf16)"
        ))),
    }
}

pub async fn run(args: TargetArgs) -> Result<()> {
    let feature_dtype = parse_dtype(&args.feature_dtype)?;
    let kv_dtype = dspark_runtime::KvDtype::parse(&args.kv_cache_dtype)
        .map_err(|e| TargetError::Config(format!("--kv-cache-dtype: {e}")))?;
    let isa = args.isa;
    check_engine_args(args.gamma, args.max_running, &args.verify_policy)
        .map_err(TargetError::Config)?;
    check_budget_lag(args.budget_lag).map_err(TargetError::Config)?;
    // Before the model loads (minutes): a typo must not cost a load per restart.
    if let Some(k) = &args.local_drafter {
        specdec::ProposerKind::parse(k, drafter::build::default_draft_for(&args.model))
            .map_err(|e| TargetError::Config(format!("--local-drafter: {e}")))?;
    }
    specdec::recal::RecalConfig::with_half_life(args.calibration_half_life)
        .map_err(|e| TargetError::Config(format!("--calibration-half-life: {e}")))?;
    // An empty value (`DSPARK_DRAFT_WORKER=` in a compose file) is none; a URL is dialed
    // as its host:port.
    if let Some(d) = &args.draft_worker
        && !d.is_empty()
        && !dspark_scheduler::discovery::is_dialable(
            d.strip_prefix("http://").unwrap_or(d).trim_end_matches('/'),
        )
    {
        return Err(TargetError::Config(format!(
            "--draft-worker `{d}` is not host:port"
        )));
    }
    sps::check_grid(&args.sps_grid, &args.sps_ctx).map_err(TargetError::Config)?;
    let token = dspark_scheduler::auth::cluster_token(args.cluster_token.as_deref())
        .map_err(TargetError::Config)?;
    let auth = dspark_scheduler::ClusterAuth::new(args.cluster_token.as_deref())
        .map_err(TargetError::Config)?;
    let ttl_ms = dspark_scheduler::discovery::check_ttl_ms(args.ttl_ms, args.etcd.is_some())
        .map_err(TargetError::Config)?;
    let fallback_kind = specdec::ProposerKind::parse(&args.fallback, None)?;
    if !matches!(
        fallback_kind,
        specdec::ProposerKind::Ngram | specdec::ProposerKind::None
    ) {
        return Err(TargetError::Config("--fallback is ngram or none".into()));
    }
    if let Some(p) = args
        .tp_peers
        .iter()
        .find(|p| !dspark_runtime::tp::is_host_port(p))
    {
        return Err(TargetError::Config(format!(
            "--tp-peers: `{p}` is not HOST:PORT (a bracketed IPv6 address, a name or an IPv4 one)"
        )));
    }
    let disc = dspark_scheduler::discovery::Discovery::from_args(
        args.scheduler.as_deref(),
        args.etcd.as_deref(),
        auth.clone(),
    )
    .ok();
    // Refuse an address peers cannot dial before spending minutes loading the model.
    let advertise = |a: SocketAddr| {
        dspark_scheduler::discovery::published_address(disc.as_ref(), a, args.advertise.as_deref())
            .map_err(TargetError::Config)
    };
    advertise(args.listen)?;
    let hub = drafter::build::ModelHub {
        home: dspark_runtime::fetch::dspark_home(args.home.as_deref()),
        python: args.python.clone(),
        opts: dspark_runtime::LoadOptions {
            threads: args.threads,
            isa,
            kv_dtype: Some(kv_dtype),
            ..Default::default()
        },
    };
    // Bound now (the worker's id and published address name its port), listening only once
    // the engine is built: until then connections are refused, so a TCP probe (Kubernetes)
    // reads "not ready" while the model loads and profiles.
    let socket = if args.listen.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(args.listen).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", args.listen))
    })?;
    let addr = socket.local_addr()?;
    let advertised = advertise(addr)?;
    let id = args.id.clone().unwrap_or_else(|| {
        dspark_scheduler::discovery::default_worker_id(
            dspark_scheduler::placement::ROLE_TARGET,
            &advertised,
        )
    });
    let shared = Arc::new(remote::RemoteShared::default());
    let rt = tokio::runtime::Handle::current();
    let (a2, sh2, id2) = (args.clone(), Arc::clone(&shared), id.clone());
    let (engine, vocab_hash, vocab, max_ctx, local, handles) =
        tokio::task::spawn_blocking(move || {
            build_engine(&hub, &a2, sh2, rt, &id2, feature_dtype, fallback_kind)
        })
        .await
        .map_err(|e| TargetError::Config(format!("loader: {e}")))??;
    let listener = socket.listen(1024)?;
    let load = Arc::new(AtomicUsize::new(0));
    let draining = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut wm = metrics::WorkerMetrics::new(
        Arc::clone(&draining),
        handles
            .as_ref()
            .map(|h| (Arc::clone(&h.central), Arc::clone(&h.local))),
    );
    wm.tp = engine
        .model()
        .tp_links()
        .map(|l| (engine.model().tp_degree(), l));
    let metrics = Arc::new(wm);
    if let Some(a) = args.metrics_listen {
        let l = tokio::net::TcpListener::bind(a)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {a}: {e}")))?;
        println!(
            "target worker metrics at http://{}/metrics",
            l.local_addr()?
        );
        let m = Arc::clone(&metrics);
        tokio::spawn(dspark_scheduler::prom::serve(
            l,
            Arc::new(move || m.render()),
        ));
    }
    let room = dspark_scheduler::discovery::Nudge::default();
    let tp_links = engine.model().tp_links();
    if let Some(links) = tp_links.clone() {
        let model = Arc::clone(engine.model());
        let room = room.clone();
        // A rank that restarts is linked again within a second, not at the next request. The
        // only redialler: were it gone, a rank that went down would leave the worker full for
        // good, so a panic in it exits (as the engine thread's does) and the worker restarts.
        spawn_or_exit(
            "tp-redial",
            move || {
                let mut last = String::new();
                let mut was_up = links.up();
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                    model.tp_check();
                    // Placement hears at once that the worker went full (a rank down) or has
                    // room again.
                    if links.up() != was_up {
                        was_up = links.up();
                        room.nudge();
                    }
                    if !links.up() {
                        match model.tp_redial() {
                            Ok(true) => {
                                tracing::info!("tensor-parallel ranks linked again");
                                last.clear();
                                was_up = true;
                                room.nudge();
                            }
                            Ok(false) => {}
                            // Said once per cause, not every second.
                            Err(e) if e.to_string() != last => {
                                last = e.to_string();
                                tracing::warn!("tensor-parallel ranks still down: {last}");
                            }
                            Err(_) => {}
                        }
                    }
                }
            },
            || {
                tracing::error!("the tensor-parallel redial thread panicked; exiting");
                std::process::exit(70)
            },
        )?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let clock = engine_loop::StepClock::default();
    if args.step_timeout_s > 0 {
        let limit = Duration::from_secs(args.step_timeout_s);
        engine_loop::spawn_watchdog(clock.clone(), limit, Duration::from_secs(1), move |d| {
            tracing::error!(
                "an engine step has run for {:.0} s (--step-timeout-s {}): the engine is \
                 wedged; exiting so that its requests resume elsewhere",
                d.as_secs_f64(),
                limit.as_secs()
            );
            std::process::exit(70)
        })?;
    }
    let el = engine_loop::EngineLoop {
        clock,
        engine,
        shared,
        load: Arc::clone(&load),
        room: room.clone(),
        metrics,
        spans: Default::default(),
    };
    // A worker whose engine thread is gone would stay registered (heartbeats go on, its load
    // frozen, placement still choosing it) and refuse every request: it exits instead, so its
    // registration ends and it is restarted. The streams it held fail over in the router.
    spawn_or_exit(
        "engine",
        move || el.run(rx),
        || {
            tracing::error!("the engine thread panicked; exiting");
            std::process::exit(70)
        },
    )?;
    let info = dspark_proto::WorkerInfo {
        id: id.clone(),
        role: dspark_scheduler::placement::ROLE_TARGET.into(),
        address: advertised.clone(),
        model: args.model.clone(),
        vocab_hash,
        capacity: args.max_running as u32,
        load: 0,
        drafter: args.local_drafter.clone().unwrap_or_default(),
        max_context: max_ctx as u32,
        ttl_ms,
        feature_layers: Vec::new(),
        max_gamma: args.gamma as u32,
        sps: handles
            .as_ref()
            .map(|h| {
                h.table
                    .iter()
                    .map(|&(b, s)| dspark_proto::SpsStep {
                        batch_tokens: b,
                        steps_per_s: s,
                    })
                    .collect()
            })
            .unwrap_or_default(),
        sps_key: handles.as_ref().map(|h| h.key.clone()).unwrap_or_default(),
        central_budget_steps: 0,
        local_budget_steps: 0,
        copy_runs: Vec::new(),
        copy_head: Vec::new(),
        copy_head_inputs: String::new(),
        instance: dspark_scheduler::discovery::instance_id(),
    };
    let counters = handles
        .as_ref()
        .map(|h| (Arc::clone(&h.central), Arc::clone(&h.local)));
    if let Some(h) = handles {
        if let Some(url) = args.scheduler.clone() {
            spawn_budget_client(url, auth.clone(), id.clone(), h.reports, h.budget);
        }
    }
    let registrar = disc.map(|disc| {
        let (info2, l2) = (info.clone(), Arc::clone(&load));
        dspark_scheduler::discovery::spawn_registrar(
            disc,
            Duration::from_millis(ttl_ms.into()),
            Arc::new({
                let counters = counters.clone();
                let tp_links = tp_links.clone();
                move || {
                    let mut i = info2.clone();
                    i.load = l2.load(Ordering::Relaxed) as u32;
                    // A worker whose tensor-parallel ranks are down fails every step: it reads
                    // full, so placement sends requests elsewhere until they are linked again.
                    if tp_links.as_ref().is_some_and(|l| !l.up()) {
                        i.load = i.load.max(i.capacity.max(1));
                    }
                    if let Some((c, l)) = &counters {
                        i.central_budget_steps = c.load(Ordering::Relaxed);
                        i.local_budget_steps = l.load(Ordering::Relaxed);
                    }
                    i
                }
            }),
            room.clone(),
        )
    });
    let streams = Arc::new(AtomicUsize::new(0));
    let stop = {
        let (draining, streams) = (Arc::clone(&draining), Arc::clone(&streams));
        let limit = Duration::from_secs(args.drain_timeout_s);
        let eof = args.exit_on_stdin_eof;
        async move {
            dspark_scheduler::stop_requested(eof).await;
            // Refuse new work first, then leave placement, then let what runs finish.
            draining.store(true, Ordering::SeqCst);
            if let Some(r) = registrar {
                r.leave().await;
            }
            let done =
                dspark_scheduler::drain("requests", limit, || streams.load(Ordering::SeqCst)).await;
            // Past the limit the engine would go on generating: stop now, so what is still
            // open fails over at once instead of finishing late here.
            dspark_scheduler::exit_after(if done {
                Duration::from_secs(2)
            } else {
                Duration::ZERO
            });
        }
    };
    let svc = service::TargetService {
        counters,
        cmds: std::sync::Mutex::new(tx),
        info,
        load,
        room: room.clone(),
        next_id: AtomicU64::new(0),
        vocab,
        max_ctx,
        default_draft: args.draft_worker.clone().filter(|d| !d.is_empty()),
        max_requests: args.max_running.saturating_add(args.max_queued),
        formats: Default::default(),
        local_drafting: local,
        draining,
        streams,
    };
    println!("target worker {id} ({}) listening on {addr}", args.model);
    dspark_scheduler::grpc_server(token)
        .add_service(
            dspark_proto::target_worker_server::TargetWorkerServer::new(svc)
                .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(dspark_proto::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            stop,
        )
        .await?;
    Ok(())
}

/// The engine, vocabulary hash and size, context, local drafting, and the scheduler policy's
/// handles (SPS table, external budget slot, counters) when it is on.
type Built = (
    specdec::Engine,
    String,
    usize,
    usize,
    bool,
    Option<PolicyHandles>,
);

pub struct PolicyHandles {
    pub table: Vec<(u32, f64)>,
    pub key: String,
    pub budget: Arc<std::sync::Mutex<dspark_scheduler::admission::ExternalBudget>>,
    pub reports: tokio::sync::mpsc::Receiver<dspark_scheduler::admission::ConfReport>,
    pub central: Arc<std::sync::atomic::AtomicU64>,
    pub local: Arc<std::sync::atomic::AtomicU64>,
}

fn build_engine(
    hub: &drafter::build::ModelHub,
    a: &TargetArgs,
    shared: Arc<remote::RemoteShared>,
    rt: tokio::runtime::Handle,
    id: &str,
    feature_dtype: dspark_proto::Dtype,
    fallback_kind: specdec::ProposerKind,
) -> Result<Built> {
    let target = if a.tp_peers.is_empty() {
        hub.load(&a.model)?
    } else {
        let mut tp = dspark_runtime::tp::TpOptions::leader(a.tp_peers.clone());
        tp.connect_timeout = Duration::from_secs(a.tp_connect_timeout_s);
        tp.io_timeout = Duration::from_secs(a.tp_io_timeout_s);
        let mut h = hub.clone();
        h.opts.tp = Some(tp);
        let t = h.load(&a.model)?;
        tracing::info!(
            degree = t.model.tp_degree(),
            peers = ?a.tp_peers,
            "tensor-parallel ranks connected"
        );
        t
    };
    let vocab_hash = target.tok.vocab_hash();
    let vocab = target.model.cfg.vocab_size;
    let max_ctx = target.model.cfg.max_ctx;
    tracing::info!(
        model = %a.model,
        isa = target.model.isa().name(),
        kv_cache_dtype = target.model.kv_dtype().name(),
        max_ctx,
        "target model loaded"
    );
    let mut drafts = drafter::build::DraftCache::default();
    let (proposer, local): (Box<dyn specdec::Proposer>, bool) = match &a.local_drafter {
        Some(k) => {
            let kind =
                specdec::ProposerKind::parse(k, drafter::build::default_draft_for(&a.model))?;
            (
                drafter::build::build_proposer(hub, &kind, &target, &mut drafts)?,
                true,
            )
        }
        None => {
            let fallback =
                drafter::build::build_proposer(hub, &fallback_kind, &target, &mut drafts)?;
            (
                Box::new(remote::RemoteProposer::new(
                    rt,
                    shared,
                    remote::Hello {
                        worker: id.to_string(),
                        model: a.model.clone(),
                        vocab_hash: vocab_hash.clone(),
                        n_layers: target.model.cfg.n_layers,
                        auth: dspark_scheduler::ClusterAuth::new(a.cluster_token.as_deref())
                            .map_err(TargetError::Config)?,
                    },
                    fallback,
                    Duration::from_millis(a.draft_timeout_ms),
                    feature_dtype,
                    target.model.cfg.d_model,
                    vocab,
                )),
                false,
            )
        }
    };
    let gamma = if local && proposer.name() == "none" {
        0
    } else {
        a.gamma
    };
    let mut cfg = drafter::build::engine_config(&target.model, gamma, !a.no_gate, a.max_running);
    cfg.pingpong = a.pingpong;
    cfg.prefix_caching = !a.no_prefix_caching;
    cfg.recal = specdec::recal::RecalConfig::with_half_life(a.calibration_half_life)?;
    let max_batch = cfg.max_batch_tokens;
    let mut engine = specdec::Engine::new(
        target.model.clone(),
        Some(target.tok.clone()),
        proposer,
        cfg,
    )?;
    let handles = match a.verify_policy.as_str() {
        "gate" => None,
        "scheduler" => {
            let path = hub.resolve(&a.model)?;
            let key = sps::key_for(&a.model, &path, &target.model, &a.sps_grid, &a.sps_ctx);
            let key_s = serde_json::to_string(&key).unwrap_or_default();
            let (table, cached) = sps::load_or_profile(&hub.home, key, &target.model)?;
            tracing::info!(cached, stairs = table.points.len(), "SPS(B) table ready");
            let mut p = dspark_scheduler::admission::ConfidencePolicy::new(
                table.clone(),
                dspark_scheduler::admission::Rule::Argmax,
                a.budget_lag,
                max_batch as u32,
                gamma.min(u8::MAX as usize) as u8,
            );
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let budget = Arc::new(std::sync::Mutex::new(Default::default()));
            // Without a central scheduler nothing reads the reports: the engine does not
            // build them (a copy of every confidence row and the step's prices, each step).
            if a.scheduler.is_some() {
                p.report = Some(tx);
                p.external = Some(Arc::clone(&budget));
            }
            let h = PolicyHandles {
                table: table.points.clone(),
                key: key_s,
                budget,
                reports: rx,
                central: Arc::clone(&p.central_steps),
                local: Arc::clone(&p.local_steps),
            };
            engine.set_policy(Some(Box::new(p)));
            Some(h)
        }
        o => {
            return Err(TargetError::Config(format!(
                "--verify-policy `{o}` (gate, scheduler)"
            )));
        }
    };
    Ok((engine, vocab_hash, vocab, max_ctx, local, handles))
}

/// Sends each reported step's confidences to the central scheduler and stores the budget it
/// returns for the step two ahead. Off the engine's critical path: the engine never waits, a
/// late or missing answer just leaves it on its local (lagged) budget.
fn spawn_budget_client(
    url: String,
    auth: dspark_scheduler::ClusterAuth,
    worker: String,
    mut reports: tokio::sync::mpsc::Receiver<dspark_scheduler::admission::ConfReport>,
    slot: Arc<std::sync::Mutex<dspark_scheduler::admission::ExternalBudget>>,
) {
    tokio::spawn(async move {
        let url = dspark_scheduler::discovery::normalize_url(&url);
        let Ok(ep) = tonic::transport::Endpoint::from_shared(url) else {
            return;
        };
        let ch = ep
            .connect_timeout(Duration::from_millis(300))
            .tcp_nodelay(true)
            .connect_lazy();
        let mut client = dspark_proto::scheduler_client::SchedulerClient::new(auth.channel(ch));
        let mut refused = false;
        while let Some(mut r) = reports.recv().await {
            // Reports queued while the last call was out are stale: only the newest can
            // still get a budget in time.
            while let Ok(newer) = reports.try_recv() {
                r = newer;
            }
            let req = dspark_proto::BudgetRequest {
                worker_id: worker.clone(),
                step: r.step,
                lag: r.lag,
                rows: r
                    .rows
                    .into_iter()
                    .map(|c| dspark_proto::ConfRow { c })
                    .collect(),
                other_tokens: r.other_tokens,
                plain_requests: r.plain_requests,
                kv_headroom: r.kv_headroom,
                max_batch_tokens: r.max_batch_tokens,
                max_k: r.max_k as u32,
                plain_step_s: r.prices.as_ref().map_or(0.0, |p| p.plain_s),
                spec_step_s: r.prices.map(|p| p.spec_s).unwrap_or_default(),
            };
            match tokio::time::timeout(Duration::from_millis(200), client.budget(req)).await {
                Ok(Ok(b)) => {
                    let b = b.into_inner();
                    if let Ok(mut s) = slot.lock() {
                        s.set(b.for_step, b.k_total);
                    }
                }
                // The first refusal is said aloud: one that repeats leaves the worker on
                // local budgets for good.
                Ok(Err(e)) if !refused => {
                    refused = true;
                    tracing::warn!(
                        "central budget refused (local budgets meanwhile): {}",
                        e.message()
                    );
                }
                Ok(Err(e)) => tracing::debug!("central budget refused: {}", e.message()),
                Err(_) => tracing::debug!("central budget late"),
            }
        }
    });
}

/// Spawns the thread `name` running `f`; a panic in it runs `on_panic` (which exits the
/// process in a worker) instead of leaving the process up without it.
pub fn spawn_or_exit(
    name: &str,
    f: impl FnOnce() + Send + 'static,
    on_panic: impl FnOnce() + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                on_panic();
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_settings_are_checked_before_the_model_loads() {
        assert!(check_engine_args(4, 16, "gate").is_ok());
        assert!(check_engine_args(0, 1, "scheduler").is_ok());
        let e = check_engine_args(4, 0, "gate").unwrap_err();
        assert!(e.contains("--max-running"), "{e}");
        let e = check_engine_args(4, 16, "sched").unwrap_err();
        assert!(e.contains("--verify-policy `sched`"), "{e}");
        let e = check_engine_args(specdec::MAX_GAMMA + 1, 16, "gate").unwrap_err();
        assert!(e.contains("--gamma"), "{e}");
        // Parsed arguments reach the same check in `run`, before anything loads.
        let a = TargetArgs::try_parse_from(["target-worker", "--max-running", "0"]).unwrap();
        assert!(check_engine_args(a.gamma, a.max_running, &a.verify_policy).is_err());
        // A lag past the kept budgets is refused; the usual ones pass.
        for ok in [0, 2, MAX_BUDGET_LAG] {
            assert!(check_budget_lag(ok).is_ok(), "{ok}");
        }
        let e = check_budget_lag(usize::MAX).unwrap_err();
        assert!(e.contains("--budget-lag"), "{e}");
    }

    #[test]
    fn a_panicking_critical_thread_runs_its_exit_hook_and_a_clean_one_does_not() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = tx.clone();
        spawn_or_exit(
            "panics",
            || panic!("engine bug"),
            move || {
                let _ = t.send("panicked");
            },
        )
        .expect("spawn")
        .join()
        .expect("join");
        spawn_or_exit(
            "returns",
            || {},
            move || {
                let _ = tx.send("returned");
            },
        )
        .expect("spawn")
        .join()
        .expect("join");
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), ["panicked"]);
    }
}
