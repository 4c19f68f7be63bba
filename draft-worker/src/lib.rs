//! The draft worker: hosts one drafter and serves `dspark.v1.DraftWorker`.
//!
//! Each target worker holds one long-lived bidirectional stream; every message is one drafting
//! round for a batch of its requests. A single drafting thread batches the rounds of every
//! stream that are waiting, so requests of several target workers share one drafter forward.
//! Per request the worker keeps the committed tokens (and, for DSpark, the target's context
//! features) in step with the target: each round carries only what changed since the last
//! round the target saw acknowledged, and a worker that lost a request's state (restart, new
//! stream) says so and gets it resent in full.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod drafting;
pub mod metrics;
pub mod service;

use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Drafter(#[from] drafter::DrafterError),
    #[error(transparent)]
    Spec(#[from] specdec::SpecError),
    #[error(transparent)]
    Runtime(#[from] dspark_runtime::RuntimeError),
    #[error(transparent)]
    Sched(#[from] dspark_scheduler::SchedError),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = DraftError> = std::result::Result<T, E>;

#[derive(Parser, Debug, Clone)]
#[command(name = "draft-worker", about = "dspark draft worker")]
pub struct DraftArgs {
    /// Target model the drafts are for (name or path): its tokenizer, and for DSpark its
    /// embedding and LM head.
    #[arg(long, env = "DSPARK_TARGET", default_value = "smollm2-135m")]
    pub target: String,
    /// ngram | draft-model[:NAME] | dspark[:DIR] (default: the shipped DSpark drafter, else ngram).
    #[arg(long, env = "DSPARK_DRAFTER")]
    pub drafter: Option<String>,
    /// gRPC listen address (port 0 picks a free port; the bound address is registered).
    #[arg(long, env = "DSPARK_DRAFT_LISTEN", default_value = "127.0.0.1:0")]
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
    /// Worker id (default: draft-<host>-<port> of the published address).
    #[arg(long, env = "DSPARK_WORKER_ID")]
    pub id: Option<String>,
    /// Registration TTL in milliseconds (200..=60000, what the scheduler grants).
    #[arg(long, env = "DSPARK_TTL_MS", default_value_t = 3000)]
    pub ttl_ms: u64,
    /// Requests this worker drafts for at once (placement capacity).
    #[arg(long, env = "DSPARK_DRAFT_CAPACITY", default_value_t = 256)]
    pub capacity: u32,
    #[arg(long, env = "DSPARK_HOME")]
    pub home: Option<PathBuf>,
    #[arg(long, env = "DSPARK_PYTHON", default_value = "python3")]
    pub python: String,
    /// Compute threads (0 = all cores).
    #[arg(long, env = "DSPARK_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Force a kernel path, as `dspark --isa` (default: the fastest this CPU has).
    #[arg(long, env = "DSPARK_ISA", value_parser = kernels::Isa::parse)]
    pub isa: Option<kernels::Isa>,
    /// Serve Prometheus metrics (`GET /metrics`: requests held, streams, rounds, draft
    /// tokens, drafting-call times) on this address; off when unset.
    #[arg(long, env = "DSPARK_DRAFT_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Shared cluster token: gRPC calls without `authorization: Bearer TOKEN` are refused, and
    /// registration with the scheduler carries it (at least 16 bytes of visible ASCII; off when
    /// unset). `dspark up` and the Helm chart set it.
    #[arg(long, env = "DSPARK_CLUSTER_TOKEN", hide_env_values = true)]
    pub cluster_token: Option<String>,
    /// Exit when stdin closes (set by `dspark up` so children never outlive it).
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
}

/// Loads the drafter, binds, registers, serves until a shutdown signal.
pub async fn run(args: DraftArgs) -> Result<()> {
    let isa = args.isa;
    let ttl_ms = dspark_scheduler::discovery::check_ttl_ms(args.ttl_ms, args.etcd.is_some())
        .map_err(DraftError::Config)?;
    let token = dspark_scheduler::auth::cluster_token(args.cluster_token.as_deref())
        .map_err(DraftError::Config)?;
    let auth = dspark_scheduler::ClusterAuth::new(args.cluster_token.as_deref())
        .map_err(DraftError::Config)?;
    let disc = dspark_scheduler::discovery::Discovery::from_args(
        args.scheduler.as_deref(),
        args.etcd.as_deref(),
        auth,
    )
    .ok();
    // Refuse an address peers cannot dial before loading the drafter.
    let advertise = |a: std::net::SocketAddr| {
        dspark_scheduler::discovery::published_address(disc.as_ref(), a, args.advertise.as_deref())
            .map_err(DraftError::Config)
    };
    advertise(args.listen)?;
    let hub = drafter::build::ModelHub {
        home: dspark_runtime::fetch::dspark_home(args.home.as_deref()),
        python: args.python.clone(),
        opts: dspark_runtime::LoadOptions {
            threads: args.threads,
            isa,
            ..Default::default()
        },
    };
    let (a2, hub2) = (args.clone(), hub.clone());
    let host = tokio::task::spawn_blocking(move || drafting::DraftHost::load(&hub2, &a2))
        .await
        .map_err(|e| DraftError::Config(format!("loader: {e}")))??;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| DraftError::Config(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener.local_addr()?;
    let advertised = advertise(addr)?;
    let id = args.id.clone().unwrap_or_else(|| {
        dspark_scheduler::discovery::default_worker_id(
            dspark_scheduler::placement::ROLE_DRAFT,
            &advertised,
        )
    });
    let info = dspark_proto::WorkerInfo {
        id: id.clone(),
        role: dspark_scheduler::placement::ROLE_DRAFT.into(),
        address: advertised.clone(),
        model: args.target.clone(),
        vocab_hash: host.vocab_hash.clone(),
        capacity: args.capacity,
        load: 0,
        drafter: host.drafter.clone(),
        max_context: 0,
        ttl_ms,
        feature_layers: host.feature_layers.iter().map(|&l| l as u32).collect(),
        max_gamma: host.max_gamma as u32,
        copy_runs: host.copy_runs.clone(),
        copy_head: host.copy_head.clone(),
        copy_head_inputs: if host.copy_head.is_empty() {
            String::new()
        } else {
            drafter::proposer::COPY_HEAD_SPEC.into()
        },
        instance: dspark_scheduler::discovery::instance_id(),
        ..Default::default()
    };
    let svc = service::DraftService::start(host, info.clone())?;
    let load = svc.load_counter();
    if let Some(a) = args.metrics_listen {
        let l = tokio::net::TcpListener::bind(a)
            .await
            .map_err(|e| DraftError::Config(format!("cannot listen on {a}: {e}")))?;
        println!("draft worker metrics at http://{}/metrics", l.local_addr()?);
        let m = svc.metrics();
        tokio::spawn(dspark_scheduler::prom::serve(
            l,
            std::sync::Arc::new(move || m.render()),
        ));
    }
    let registrar = disc.map(|disc| {
        let info2 = info.clone();
        dspark_scheduler::discovery::spawn_registrar(
            disc,
            std::time::Duration::from_millis(ttl_ms.into()),
            std::sync::Arc::new(move || {
                let mut i = info2.clone();
                i.load = load.load(std::sync::atomic::Ordering::Relaxed) as u32;
                i
            }),
            dspark_scheduler::discovery::Nudge::default(),
        )
    });
    // Leaving placement first keeps new requests from pairing with a worker about to go; the
    // requests paired with it draft locally once its link closes (speed, never output, changes).
    let stop = {
        let eof = args.exit_on_stdin_eof;
        async move {
            dspark_scheduler::stop_requested(eof).await;
            if let Some(r) = registrar {
                r.leave().await;
            }
            dspark_scheduler::exit_after(std::time::Duration::from_secs(2));
        }
    };
    println!("draft worker {id} ({}) listening on {addr}", info.drafter);
    dspark_scheduler::grpc_server(token)
        .add_service(
            dspark_proto::draft_worker_server::DraftWorkerServer::new(svc)
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
