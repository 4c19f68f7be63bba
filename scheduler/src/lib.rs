//! The scheduler: cluster view (from registrations or etcd), placement of new requests on a
//! target worker paired with a draft worker. Placement never sits on a worker's step: workers run
//! on their own and the router falls back to its last cluster view when the scheduler is away.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod discovery;
pub mod placement;
pub mod planner;
pub mod prom;
pub mod service;
pub mod sps;

use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;

pub use auth::{AuthChannel, ClusterAuth, ClusterGate};

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("discovery: {0}")]
    Discovery(String),
    #[error("state lock poisoned")]
    Poisoned,
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = SchedError> = std::result::Result<T, E>;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "dspark-scheduler",
    about = "dspark scheduler: cluster view and placement"
)]
pub struct SchedulerArgs {
    /// gRPC listen address.
    #[arg(
        long,
        env = "DSPARK_SCHEDULER_LISTEN",
        default_value = "127.0.0.1:8100"
    )]
    pub listen: SocketAddr,
    /// etcd endpoints (comma-separated); without it workers register over gRPC.
    #[arg(long, env = "DSPARK_ETCD")]
    pub etcd: Option<String>,
    /// How much busier (load over capacity) than the least-loaded target worker the one that
    /// holds the longest cached run of a prompt's leading blocks may be and still get the
    /// request (prefix-affinity placement); 0 places by load alone.
    #[arg(long, env = "DSPARK_PREFIX_AFFINITY_SLACK", default_value_t = placement::DEFAULT_AFFINITY_SLACK)]
    pub prefix_affinity_slack: f64,
    /// Serve Prometheus metrics (`GET /metrics`: workers by role, target capacity and load,
    /// placements by outcome, budgets) on this address; off when unset.
    #[arg(long, env = "DSPARK_SCHEDULER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Shared cluster token: gRPC calls without `authorization: Bearer TOKEN` are refused
    /// (at least 16 bytes of visible ASCII; off when unset). `dspark up` and the Helm chart set
    /// it.
    #[arg(long, env = "DSPARK_CLUSTER_TOKEN", hide_env_values = true)]
    pub cluster_token: Option<String>,
    /// Exit when stdin closes (set by `dspark up`).
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
}

/// Serves until `shutdown` resolves; prints `listening on ADDR` once bound.
pub async fn serve(
    args: SchedulerArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    if !(args.prefix_affinity_slack.is_finite() && args.prefix_affinity_slack >= 0.0) {
        return Err(SchedError::Config(format!(
            "--prefix-affinity-slack takes a value ≥ 0, not {}",
            args.prefix_affinity_slack
        )));
    }
    let token = auth::cluster_token(args.cluster_token.as_deref()).map_err(SchedError::Config)?;
    let etcd = args
        .etcd
        .as_deref()
        .filter(|e| !e.trim().is_empty())
        .map(discovery::etcd_endpoints)
        .transpose()?;
    let svc = service::SchedulerService::default();
    if let Ok(mut c) = svc.cluster.lock() {
        c.set_affinity_slack(args.prefix_affinity_slack);
    }
    svc.spawn_sweeper();
    if let Some(eps) = etcd {
        discovery::spawn_etcd_watcher(eps, Arc::clone(&svc.cluster));
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", args.listen))
        })?;
    let addr = listener.local_addr()?;
    if let Some(a) = args.metrics_listen {
        let l = tokio::net::TcpListener::bind(a)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {a}: {e}")))?;
        println!("scheduler metrics at http://{}/metrics", l.local_addr()?);
        let s = svc.clone();
        tokio::spawn(prom::serve(l, Arc::new(move || s.render_metrics())));
    }
    println!("scheduler listening on {addr}");
    grpc_server(token)
        .add_service(
            dspark_proto::scheduler_server::SchedulerServer::new(svc)
                .max_decoding_message_size(dspark_proto::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await?;
    Ok(())
}

/// A gRPC server builder with keepalives: a peer that vanished without closing its connection
/// (a node lost, a partition) is noticed within about half a minute, so its streams end and
/// what the server holds for them is freed, instead of waiting forever on a dead socket.
/// With a `token` ([`auth::cluster_token`]) every call must carry `authorization: Bearer TOKEN`
/// ([`ClusterGate`]); without one nothing is checked.
pub fn grpc_server(token: Option<Arc<str>>) -> GrpcServer {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .tcp_keepalive(Some(std::time::Duration::from_secs(30)))
        .layer(auth::GateLayer::new(ClusterGate::new(token)))
}

/// What [`grpc_server`] builds: a server with the cluster token's gate in front.
pub type GrpcServer =
    tonic::transport::Server<tower_layer::Stack<auth::GateLayer, tower_layer::Identity>>;

/// Resolves on Ctrl-C, SIGTERM, or (with `stdin_eof`) when the parent closes our stdin. Once it
/// fired, the process exits on its own after a short grace period even if long-lived streams
/// (draft links) keep the server from draining.
pub async fn shutdown_signal(stdin_eof: bool) {
    stop_requested(stdin_eof).await;
    exit_after(std::time::Duration::from_secs(2));
}

/// Resolves on the first Ctrl-C, SIGTERM, or (with `stdin_eof`) when the parent closes our
/// stdin; the caller drains, then calls [`exit_after`].
pub async fn stop_requested(stdin_eof: bool) {
    let eof = async {
        if stdin_eof {
            // A plain thread: a blocked read must not keep the runtime from shutting down.
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            std::thread::spawn(move || {
                let mut sink = [0u8; 256];
                while let Ok(n) = std::io::Read::read(&mut std::io::stdin(), &mut sink) {
                    if n == 0 {
                        break;
                    }
                }
                let _ = tx.send(());
            });
            let _ = rx.await;
        } else {
            futures::future::pending::<()>().await
        }
    };
    tokio::select! {
        _ = signal() => {},
        _ = eof => {},
    }
    tracing::info!("shutting down");
    // From now on a second Ctrl-C or SIGTERM exits at once, whatever is draining: an operator
    // who asks twice does not want to wait.
    tokio::spawn(async {
        signal().await;
        tracing::warn!("second stop signal: exiting now");
        flush_spans(std::time::Duration::from_millis(500));
        std::process::exit(130);
    });
}

/// Ctrl-C or SIGTERM.
async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => futures::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Exits the process `grace` from now, whatever is still open (a second stop signal already
/// exits at once: [`stop_requested`]).
pub fn exit_after(grace: std::time::Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(grace);
        flush_spans(std::time::Duration::from_millis(500));
        std::process::exit(0);
    });
}

/// The span exporter, kept so that an exit can send what it has batched: the process ends in
/// `exit`, which runs no destructors. Set once, by [`init_tracing`].
static SPAN_EXPORT: std::sync::OnceLock<opentelemetry_sdk::trace::SdkTracerProvider> =
    std::sync::OnceLock::new();

/// Sends the spans batched for export, waiting at most `wait` (a collector that does not
/// answer does not hold an exit up longer). Call it where the exporter's runtime still runs
/// and is not blocked (after a service's `run`, from `spawn_blocking`).
pub fn flush_spans(wait: std::time::Duration) {
    let Some(p) = SPAN_EXPORT.get().cloned() else {
        return;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = p.force_flush();
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(wait);
}

/// The end of a service binary's `main`: after a clean run, what the exporter batched during
/// the drain is sent while its runtime still runs (not after a failure: a forced exit could
/// cut its report short); then the run's result.
pub async fn finish_run<T, E>(r: std::result::Result<T, E>) -> std::result::Result<T, E> {
    if r.is_ok() {
        let _ =
            tokio::task::spawn_blocking(|| flush_spans(std::time::Duration::from_secs(2))).await;
    }
    r
}

/// The W3C `traceparent` that makes a callee's spans children of `span` (empty when no
/// exporter is configured: the span then has no context to pass on).
pub fn traceparent_of(span: &tracing::Span) -> String {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = span.context();
    let mut carrier = std::collections::HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier.remove("traceparent").unwrap_or_default()
}

/// How a draining service counts down: waits until `inflight()` reads 0 or `limit` passed,
/// logging what it waits for every few seconds; true when everything finished in time.
pub async fn drain(what: &str, limit: std::time::Duration, inflight: impl Fn() -> usize) -> bool {
    let start = std::time::Instant::now();
    let mut told: Option<std::time::Instant> = None;
    loop {
        let n = inflight();
        if n == 0 {
            tracing::info!("drained in {:.1} s", start.elapsed().as_secs_f64());
            return true;
        }
        if start.elapsed() >= limit {
            tracing::warn!(
                "drain timeout ({:.0} s): stopping with {n} {what} in flight",
                limit.as_secs_f64()
            );
            return false;
        }
        if told.is_none_or(|t| t.elapsed().as_secs() >= 5) {
            tracing::info!("draining: {n} {what} in flight");
            told = Some(std::time::Instant::now());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Logging for the service binaries (`DSPARK_LOG`, default info) and, when
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` names a collector, span
/// export over OTLP/gRPC as `OTEL_SERVICE_NAME`, else `service` (spans per request in the router
/// and target worker, per cycle in the engine loop).
pub fn init_tracing(service: &str) {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // Each layer has its own filter: quiet logs must not silence exported spans.
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("DSPARK_LOG").unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let var = |k: &str| std::env::var(k).ok();
    let otel = otlp_traces_endpoint(var).and_then(|ep| {
        match otlp_tracer(service, otel_service_name(var, service), &ep) {
            Ok(t) => Some(
                tracing_opentelemetry::layer()
                    .with_tracer(t)
                    .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
            ),
            Err(e) => {
                eprintln!("OpenTelemetry export disabled: {e}");
                None
            }
        }
    });
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init();
}

/// The collector the standard variables name, the traces-specific one first as the SDKs read
/// them: the endpoint we pass the exporter hides the variables from it.
fn otlp_traces_endpoint(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .find_map(|k| var(k).filter(|v| !v.trim().is_empty()))
}

/// `service` unless the deployment names the service (`OTEL_SERVICE_NAME`, or `service.name`
/// in `OTEL_RESOURCE_ATTRIBUTES`); then `None`, and the SDK's resource detectors apply it
/// (a name we set would override theirs).
fn otel_service_name(var: impl Fn(&str) -> Option<String>, service: &str) -> Option<String> {
    let named = var("OTEL_SERVICE_NAME").is_some_and(|v| !v.is_empty())
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| {
            a.split(',').any(|kv| {
                kv.split_once('=')
                    .is_some_and(|(k, _)| k.trim() == "service.name")
            })
        });
    (!named).then(|| service.to_string())
}

/// `name`: the service name to set on the resource, `None` to keep the detected one.
fn otlp_tracer(
    service: &str,
    name: Option<String>,
    endpoint: &str,
) -> std::result::Result<opentelemetry_sdk::trace::Tracer, String> {
    use opentelemetry::trace::TracerProvider;
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| e.to_string())?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if let Some(name) = name {
        resource = resource.with_service_name(name);
    }
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let tracer = provider.tracer(service.to_string());
    let _ = SPAN_EXPORT.set(provider.clone());
    opentelemetry::global::set_tracer_provider(provider);
    Ok(tracer)
}

/// Makes the W3C trace context in `traceparent` the parent of `span` (no-op when it is empty
/// or malformed, or when no exporter is configured).
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if traceparent.is_empty() {
        return;
    }
    let mut carrier = std::collections::HashMap::new();
    carrier.insert("traceparent".to_string(), traceparent.to_string());
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier));
    let _ = span.set_parent(cx);
}

#[cfg(test)]
mod tests {
    use super::{drain, otel_service_name, otlp_traces_endpoint};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    fn env<'a>(vars: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn otel_variables_pick_the_collector_and_may_name_the_service() {
        let both = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
        ];
        assert_eq!(
            otlp_traces_endpoint(env(&both)).as_deref(),
            Some("http://traces:4317")
        );
        let all = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
        ];
        assert_eq!(
            otlp_traces_endpoint(env(&all)).as_deref(),
            Some("http://all:4317")
        );
        assert_eq!(otlp_traces_endpoint(env(&[])), None);
        // Ours unless the deployment names the service; the SDK then applies its name.
        assert_eq!(
            otel_service_name(env(&[]), "dspark-router").as_deref(),
            Some("dspark-router")
        );
        assert_eq!(
            otel_service_name(env(&[("OTEL_SERVICE_NAME", "")]), "x").as_deref(),
            Some("x")
        );
        assert_eq!(
            otel_service_name(env(&[("OTEL_SERVICE_NAME", "edge-router")]), "x"),
            None
        );
        let attrs = [("OTEL_RESOURCE_ATTRIBUTES", "team=a, service.name=edge")];
        assert_eq!(otel_service_name(env(&attrs), "x"), None);
        let other = [("OTEL_RESOURCE_ATTRIBUTES", "team=a")];
        assert_eq!(otel_service_name(env(&other), "x").as_deref(), Some("x"));
    }

    #[tokio::test]
    async fn drain_waits_for_the_last_request_and_no_longer_than_its_limit() {
        let n = Arc::new(AtomicUsize::new(2));
        let n2 = Arc::clone(&n);
        tokio::spawn(async move {
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_millis(150)).await;
                n2.fetch_sub(1, Ordering::SeqCst);
            }
        });
        let t0 = Instant::now();
        assert!(
            drain("requests", Duration::from_secs(10), || n
                .load(Ordering::SeqCst))
            .await
        );
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(300), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // One that never finishes: the limit ends the wait.
        let t0 = Instant::now();
        assert!(!drain("requests", Duration::from_millis(200), || 1).await);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }
}
