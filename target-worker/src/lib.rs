//! The target worker: the speculative engine (continuous batching, lossless verification) behind
//! `dspark.v1.TargetWorker`, drafting through remote draft workers ([`remote`]) or in-process.
//!
//! The engine runs on its own thread; the gRPC service only validates and queues. Requests carry
//! the draft worker placement paired them with; when that worker is gone or late the request
//! drafts locally for the cycle and nothing is lost.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod engine_loop;
pub mod remote;
pub mod service;
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
    #[error("io: {0}")]
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
    /// Scheduler URL for static registration.
    #[arg(long, env = "DSPARK_SCHEDULER")]
    pub scheduler: Option<String>,
    /// etcd endpoints (comma-separated); registration through an etcd lease instead.
    #[arg(long, env = "DSPARK_ETCD")]
    pub etcd: Option<String>,
    /// Worker id (default: target-<port>).
    #[arg(long, env = "DSPARK_WORKER_ID")]
    pub id: Option<String>,
    #[arg(long, env = "DSPARK_TTL_MS", default_value_t = 3000)]
    pub ttl_ms: u64,
    /// Default draft length.
    #[arg(long, env = "DSPARK_GAMMA", default_value_t = 4)]
    pub gamma: usize,
    /// Requests decoded at once.
    #[arg(long, env = "DSPARK_MAX_RUNNING", default_value_t = 16)]
    pub max_running: usize,
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
    #[arg(long)]
    pub no_gate: bool,
    #[arg(long, env = "DSPARK_HOME")]
    pub home: Option<PathBuf>,
    #[arg(long, env = "DSPARK_PYTHON", default_value = "python3")]
    pub python: String,
    /// Compute threads (0 = all cores).
    #[arg(long, env = "DSPARK_THREADS", default_value_t = 0)]
    pub threads: usize,
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
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
    if args.gamma > specdec::MAX_GAMMA {
        return Err(TargetError::Config(format!(
            "--gamma {} out of range 0..={}",
            args.gamma,
            specdec::MAX_GAMMA
        )));
    }
    let fallback_kind = specdec::ProposerKind::parse(&args.fallback, None)?;
    if !matches!(
        fallback_kind,
        specdec::ProposerKind::Ngram | specdec::ProposerKind::None
    ) {
        return Err(TargetError::Config("--fallback is ngram or none".into()));
    }
    let disc = dspark_scheduler::discovery::Discovery::from_args(
        args.scheduler.as_deref(),
        args.etcd.as_deref(),
    )
    .ok();
    let hub = drafter::build::ModelHub {
        home: dspark_runtime::fetch::dspark_home(args.home.as_deref()),
        python: args.python.clone(),
        opts: dspark_runtime::LoadOptions {
            threads: args.threads,
            ..Default::default()
        },
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let id = args
        .id
        .clone()
        .unwrap_or_else(|| format!("target-{}", addr.port()));
    let shared = Arc::new(remote::RemoteShared::default());
    let rt = tokio::runtime::Handle::current();
    let (a2, sh2, id2) = (args.clone(), Arc::clone(&shared), id.clone());
    let (engine, vocab_hash, vocab, max_ctx, local) = tokio::task::spawn_blocking(move || {
        build_engine(&hub, &a2, sh2, rt, &id2, feature_dtype, fallback_kind)
    })
    .await
    .map_err(|e| TargetError::Config(format!("loader: {e}")))??;
    let load = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let el = engine_loop::EngineLoop {
        engine,
        shared,
        load: Arc::clone(&load),
    };
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || el.run(rx))?;
    let info = dspark_proto::WorkerInfo {
        id: id.clone(),
        role: dspark_scheduler::placement::ROLE_TARGET.into(),
        address: addr.to_string(),
        model: args.model.clone(),
        vocab_hash,
        capacity: args.max_running as u32,
        load: 0,
        drafter: args.local_drafter.clone().unwrap_or_default(),
        max_context: max_ctx as u32,
        ttl_ms: args.ttl_ms as u32,
        feature_layers: Vec::new(),
        max_gamma: args.gamma as u32,
    };
    if let Some(disc) = disc {
        let (info2, l2) = (info.clone(), Arc::clone(&load));
        dspark_scheduler::discovery::spawn_registrar(
            disc,
            Duration::from_millis(args.ttl_ms),
            Arc::new(move || {
                let mut i = info2.clone();
                i.load = l2.load(Ordering::Relaxed) as u32;
                i
            }),
        );
    }
    let svc = service::TargetService {
        cmds: std::sync::Mutex::new(tx),
        info,
        load,
        next_id: AtomicU64::new(0),
        vocab,
        max_ctx,
        default_draft: args.draft_worker.clone(),
        local_drafting: local,
    };
    println!("target worker {id} ({}) listening on {addr}", args.model);
    tonic::transport::Server::builder()
        .add_service(
            dspark_proto::target_worker_server::TargetWorkerServer::new(svc)
                .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(dspark_proto::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            dspark_scheduler::shutdown_signal(args.exit_on_stdin_eof),
        )
        .await?;
    Ok(())
}

type Built = (specdec::Engine, String, usize, usize, bool);

fn build_engine(
    hub: &drafter::build::ModelHub,
    a: &TargetArgs,
    shared: Arc<remote::RemoteShared>,
    rt: tokio::runtime::Handle,
    id: &str,
    feature_dtype: dspark_proto::Dtype,
    fallback_kind: specdec::ProposerKind,
) -> Result<Built> {
    let target = hub.load(&a.model)?;
    let vocab_hash = target.tok.vocab_hash();
    let vocab = target.model.cfg.vocab_size;
    let max_ctx = target.model.cfg.max_ctx;
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
    let cfg = drafter::build::engine_config(&target.model, gamma, !a.no_gate, a.max_running);
    let engine = specdec::Engine::new(
        target.model.clone(),
        Some(target.tok.clone()),
        proposer,
        cfg,
    )?;
    Ok((engine, vocab_hash, vocab, max_ctx, local))
}
