//! The router: OpenAI-compatible HTTP in front of the cluster.
//!
//! It tokenizes (and renders chat templates), validates, applies admission control, asks the
//! scheduler for a placement (or uses its last cluster view), and streams the target worker's
//! committed tokens back as JSON or server-sent events. A target worker that fails mid-stream
//! is replaced: the request continues on another worker from the tokens already delivered.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod cluster;
pub mod metrics;
pub mod openai;
pub mod tool_parser;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use dspark_proto::{GenerateRequest, SpecStats, WorkerInfo, generate_event};
use dspark_runtime::Tokenizer;
use dspark_runtime::chat::{ChatTemplate, Message};
use metrics::Metrics;
use openai::{ApiError, ChatRequest, CompletionRequest, GenSettings, MAX_PROMPTS, Prompt};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio_stream::StreamExt;
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Runtime(#[from] dspark_runtime::RuntimeError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "dspark-router",
    about = "OpenAI-compatible router of a dspark cluster"
)]
pub struct RouterArgs {
    /// HTTP listen address.
    #[arg(long, env = "DSPARK_ROUTER_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Model served (name or path): its tokenizer and chat template live here.
    #[arg(long, env = "DSPARK_MODEL", default_value = "smollm2-135m")]
    pub model: String,
    /// Name clients use in `model` (default: --model).
    #[arg(long, env = "DSPARK_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Scheduler URL (placement and cluster view).
    #[arg(long, env = "DSPARK_SCHEDULER")]
    pub scheduler: Option<String>,
    /// Static target workers (host:port, comma-separated) when running without a scheduler.
    #[arg(long, env = "DSPARK_TARGETS", value_delimiter = ',')]
    pub targets: Vec<String>,
    /// Static draft workers (host:port, comma-separated).
    #[arg(long, env = "DSPARK_DRAFTS", value_delimiter = ',')]
    pub drafts: Vec<String>,
    /// Require `Authorization: Bearer KEY` on /v1/*. (`--help` never shows the key the
    /// environment holds.)
    #[arg(long, env = "DSPARK_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest max_tokens a request may ask for.
    #[arg(long, env = "DSPARK_MAX_TOKENS_LIMIT", default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// max_tokens when a completion request gives none (chat: 512, or the room left in the
    /// context when less; at most --max-tokens-limit either way).
    #[arg(long, env = "DSPARK_DEFAULT_MAX_TOKENS", default_value_t = 16)]
    pub default_max_tokens: usize,
    /// Requests in flight before 429 (0 = the sum of target worker capacities).
    #[arg(long, env = "DSPARK_MAX_INFLIGHT", default_value_t = 0)]
    pub max_inflight: usize,
    /// Milliseconds a request admitted here waits for room when every target worker reads
    /// full, before it is refused with 429: placement's counts run ahead of the workers' load
    /// reports for a moment after requests end, and other routers share the workers. At most
    /// 600000; 0 refuses at once.
    #[arg(long, env = "DSPARK_FULL_WAIT_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub full_wait_ms: u64,
    #[arg(long, env = "DSPARK_HOME")]
    pub home: Option<PathBuf>,
    #[arg(long, env = "DSPARK_PYTHON", default_value = "python3")]
    pub python: String,
    /// On SIGTERM or Ctrl-C: seconds to keep accepting requests while `/ready` already reads
    /// 503, so a load balancer stops sending here before the listener closes (Kubernetes
    /// removes a terminating pod's endpoint asynchronously).
    #[arg(long, env = "DSPARK_SHUTDOWN_DELAY_S", default_value_t = 0)]
    pub shutdown_delay_s: u64,
    /// Then, seconds the requests in flight get to finish before the router exits.
    #[arg(long, env = "DSPARK_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Parse tool calls from the model's own output (`hermes`: `<tool_call>{…}</tool_call>`
    /// blocks, as Qwen2.5's and Hermes' templates ask for), which enables `tool_choice:
    /// "auto"` (as vLLM's `--enable-auto-tool-choice --tool-call-parser hermes`).
    #[arg(long, env = "DSPARK_TOOL_CALL_PARSER", value_parser = ["hermes"])]
    pub tool_call_parser: Option<String>,
    /// Milliseconds a stream's next event may wait for its client to read before the request
    /// ends as if the client had left (its admission places and worker slot go back). Only
    /// tests set it shorter; 1..=3600000.
    #[arg(long, hide = true, env = "DSPARK_CLIENT_WRITE_TIMEOUT_MS",
          default_value_t = CLIENT_WRITE_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub client_write_timeout_ms: u64,
    /// Milliseconds a request's body may take to arrive whole (from when its headers were
    /// read) before it is answered 408 and its connection closed. Only tests set it shorter;
    /// 1..=3600000.
    #[arg(long, hide = true, env = "DSPARK_CLIENT_BODY_TIMEOUT_MS",
          default_value_t = CLIENT_BODY_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub client_body_timeout_ms: u64,
    /// Seconds a connection may wait for a request's headers, idle kept-alive connections
    /// included, before it is closed: above the upstream idle timeout of a proxy in front
    /// (ingress-nginx and AWS ALB: 60 s), so the proxy closes first and never sends a request
    /// on a connection being closed (a 502). 1..=3600.
    #[arg(long, env = "DSPARK_IDLE_TIMEOUT_S", default_value_t = IDLE_TIMEOUT_S,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub idle_timeout_s: u64,
    /// Shared cluster token: calls to the scheduler and target workers carry
    /// `authorization: Bearer TOKEN` (at least 16 bytes of visible ASCII; none when unset).
    /// Not the API key clients send: set it as the scheduler's and workers'.
    #[arg(long, env = "DSPARK_CLUSTER_TOKEN", hide_env_values = true)]
    pub cluster_token: Option<String>,
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
}

/// How long a stream waits for a client that stopped reading (its socket and the body's
/// channel full) before ending the request as if it had left. Without a limit a few such
/// clients would hold their admission places for ever, and the cluster would answer 429 to
/// everyone else; a client that reads at all (even slowly) never waits this long.
const CLIENT_WRITE_TIMEOUT_MS: u64 = 30_000;

/// How long a request's body may take to arrive whole. Without a limit a client could send
/// most of a body (up to `MAX_BODY`) and stall, holding that memory and its connection for as
/// long as it likes. Only the body is timed: a response (a stream) may run for minutes.
const CLIENT_BODY_TIMEOUT_MS: u64 = 30_000;

/// How long a connection may take to send a request's headers (hyper's header deadline, which
/// also closes a kept-alive connection idle that long). Without a limit a client could open
/// connections and trickle header bytes (or send none) for as long as it likes, each one a
/// task and a socket; axum's own `serve` sets no timer, so hyper's deadline never ran.
/// Longer than the 60 s proxies keep idle upstream connections.
const IDLE_TIMEOUT_S: u64 = 75;

pub struct App {
    pub tok: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The name the API serves (`--served-model-name`, else the model).
    pub name: String,
    /// The model the workers load and register under: what placement asks the scheduler for.
    pub model: String,
    pub cluster: Arc<cluster::Cluster>,
    pub metrics: Metrics,
    pub api_key: Option<String>,
    pub max_tokens_limit: usize,
    pub default_max_tokens: usize,
    pub max_inflight: usize,
    /// How long a request waits for room when the cluster reads full (`--full-wait-ms`).
    pub full_wait: Duration,
    /// A stop was asked for: `/ready` reads 503 while what is in flight finishes.
    pub draining: std::sync::atomic::AtomicBool,
    /// `tool_choice: "auto"` is served (a tool-call parser is configured).
    pub auto_tools: bool,
    /// How long a stream waits for its client to read (`--client-write-timeout-ms`).
    pub client_write_timeout: Duration,
    /// How long a request's body may take to arrive (`--client-body-timeout-ms`).
    pub client_body_timeout: Duration,
    seq: AtomicU64,
    /// When this router started (Unix seconds): the model card's `created`.
    pub created: u64,
}

/// Failovers per request before giving up.
const MAX_FAILOVERS: usize = 2;

/// Before a request goes back to the worker whose engine just failed it (no other is up): a
/// link lost and back, say, has a moment to come back.
const SAME_WORKER_PAUSE: Duration = Duration::from_millis(100);

/// max_tokens of a chat request that gives none (less when the context has less room).
const CHAT_DEFAULT_MAX_TOKENS: usize = 512;
/// Largest request body.
const MAX_BODY: usize = 8 * 1024 * 1024;

pub fn random_u64() -> u64 {
    static CTR: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut r = kernels::rng::Rng::new(t ^ CTR.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed));
    r.next_u64()
}

/// A tool call's id, as OpenAI's.
fn new_call_id() -> String {
    format!("call_{:016x}{:08x}", random_u64(), random_u64() as u32)
}

/// `--max-tokens-limit` at least 1 and `--default-max-tokens` within 1..=it, checked before
/// the model loads: otherwise every request relying on the default would be refused.
fn check_token_limits(default: usize, limit: usize) -> Result<(), String> {
    if limit == 0 {
        return Err("--max-tokens-limit 0: a request makes at least one token".into());
    }
    if default == 0 || default > limit {
        return Err(format!(
            "--default-max-tokens {default} out of range 1..={limit} (--max-tokens-limit)"
        ));
    }
    Ok(())
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl App {
    pub fn new(args: &RouterArgs) -> Result<Arc<Self>, RouterError> {
        check_token_limits(args.default_max_tokens, args.max_tokens_limit)
            .map_err(RouterError::Config)?;
        let auth = dspark_scheduler::ClusterAuth::new(args.cluster_token.as_deref())
            .map_err(RouterError::Config)?;
        let home = dspark_runtime::fetch::dspark_home(args.home.as_deref());
        let path = dspark_runtime::fetch::resolve(&args.model, &home, &args.python, &mut |m| {
            eprintln!("{m}")
        })?;
        let tok = Arc::new(Tokenizer::load(&path)?);
        let template = ChatTemplate::from_tokenizer(&tok).ok();
        let mut statics = Vec::new();
        for (role, list) in [("target", &args.targets), ("draft", &args.drafts)] {
            for (i, a) in list.iter().enumerate() {
                // An IP address or a host name (`localhost:50051`, a Kubernetes service).
                if !dspark_scheduler::discovery::is_dialable(a) {
                    return Err(RouterError::Config(format!("`{a}` is not host:port")));
                }
                statics.push(WorkerInfo {
                    id: format!("{role}-{i}"),
                    role: role.into(),
                    address: a.clone(),
                    model: args.model.clone(),
                    vocab_hash: tok.vocab_hash(),
                    capacity: 16,
                    max_context: 0,
                    ..Default::default()
                });
            }
        }
        if args.scheduler.is_none() && args.targets.is_empty() {
            return Err(RouterError::Config(
                "the router needs --scheduler URL or --targets host:port,...".into(),
            ));
        }
        let cluster = cluster::Cluster::with_auth(args.scheduler.clone(), statics, auth);
        cluster.spawn_refresh(Duration::from_millis(500));
        cluster.spawn_static_info(Duration::from_secs(10));
        Ok(Arc::new(Self {
            tok,
            template,
            name: args
                .served_model_name
                .clone()
                .unwrap_or_else(|| args.model.clone()),
            model: args.model.clone(),
            cluster,
            metrics: Metrics::default(),
            api_key: args.api_key.clone(),
            max_tokens_limit: args.max_tokens_limit,
            default_max_tokens: args.default_max_tokens,
            max_inflight: args.max_inflight,
            full_wait: Duration::from_millis(args.full_wait_ms),
            draining: std::sync::atomic::AtomicBool::new(false),
            auto_tools: args.tool_call_parser.is_some(),
            client_write_timeout: Duration::from_millis(args.client_write_timeout_ms),
            client_body_timeout: Duration::from_millis(args.client_body_timeout_ms),
            seq: AtomicU64::new(0),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }))
    }

    fn next_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:012x}{:04x}",
            random_u64() >> 16,
            self.seq.fetch_add(1, Ordering::Relaxed) & 0xffff
        )
    }
}

pub fn app(state: Arc<App>) -> Router {
    // Route layers run inside out: the key is checked before any of the body is read, and
    // the body is read (whole, within its deadline) before the handler runs.
    let key = axum::middleware::from_fn_with_state(Arc::clone(&state), require_key);
    let body = axum::middleware::from_fn_with_state(Arc::clone(&state), read_body);
    let generation = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(body.clone())
        .route_layer(key.clone())
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            count_outcome,
        ));
    let keyed = Router::new()
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(body)
        .route_layer(key);
    // /health, /ready and /metrics take no key and read no body.
    Router::new()
        .merge(generation)
        .merge(keyed)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(json_errors))
        .with_state(state)
}

/// `--api-key` checked from the headers alone, before the body is read: a client without the
/// key cannot have the router hold (up to `MAX_BODY` of) a body it sends slowly.
async fn require_key(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match auth(&app, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// Reads the request's body whole (within `DefaultBodyLimit`, as the handler's `Bytes` would)
/// before the handler runs, and answers 408 when it has not arrived within
/// `--client-body-timeout-ms`: what was read is dropped and the connection closed.
async fn read_body(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::extract::FromRequest;
    let (parts, body) = req.into_parts();
    let whole = axum::extract::Request::from_parts(parts.clone(), body);
    match tokio::time::timeout(app.client_body_timeout, Bytes::from_request(whole, &())).await {
        Ok(Ok(bytes)) => {
            let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
            next.run(req).await
        }
        // Over the limit (413) or broken off: `json_errors` gives it the OpenAI body.
        Ok(Err(rejection)) => rejection.into_response(),
        Err(_) => {
            let limit = app.client_body_timeout.as_millis();
            let mut resp = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!("the request body did not arrive whole within {limit} ms"),
            )
            .into_response();
            // The rest of the body is never read: the connection cannot serve another request.
            resp.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            resp
        }
    }
}

/// How a generation request ended, counted in one place whatever refused it: 429 (the
/// cluster full) as rejected, any other 4xx or 5xx as an error. A stream that fails after its
/// 200 is counted where it fails.
async fn count_outcome(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    // Counted here, as the outcomes are: every request that reached the route, refused or not.
    Metrics::add(&app.metrics.requests, 1);
    let resp = next.run(req).await;
    let status = resp.status();
    if status == StatusCode::TOO_MANY_REQUESTS {
        Metrics::add(&app.metrics.rejected, 1);
    } else if status.is_client_error() || status.is_server_error() {
        Metrics::add(&app.metrics.errors, 1);
    }
    resp
}

/// Every error leaves with the OpenAI error body. axum answers some requests itself before
/// a handler runs: a wrong method (405, empty body) and a body over the limit (413, plain
/// text). Clients parse `error.message` on every 4xx and 5xx, so those are rewritten here;
/// the status and the other headers stay.
async fn json_errors(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let method = req.method().clone();
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = match status {
        // axum adds `Allow` outside this layer, so the methods are not named here.
        StatusCode::METHOD_NOT_ALLOWED => {
            format!("method {method} is not allowed on this route (see the Allow header)")
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            format!("the request body is over this server's limit of {MAX_BODY} bytes")
        }
        _ if !text.is_empty() => text,
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let mut out = ApiError::new(status, kind, message).into_response();
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_TYPE
            && name != axum::http::header::CONTENT_LENGTH
            && !value.is_empty()
        {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    out
}

pub async fn run(args: RouterArgs) -> Result<(), RouterError> {
    let a2 = args.clone();
    let state = tokio::task::spawn_blocking(move || App::new(&a2))
        .await
        .map_err(|e| RouterError::Config(e.to_string()))??;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| RouterError::Config(format!("cannot listen on {}: {e}", args.listen)))?;
    println!("router listening on http://{}", listener.local_addr()?);
    let stop = {
        let app = Arc::clone(&state);
        let delay = Duration::from_secs(args.shutdown_delay_s);
        let limit = Duration::from_secs(args.drain_timeout_s);
        let eof = args.exit_on_stdin_eof;
        async move {
            dspark_scheduler::stop_requested(eof).await;
            app.draining.store(true, Ordering::SeqCst);
            dspark_scheduler::exit_after(delay + limit);
            if !delay.is_zero() {
                tracing::info!("not ready; still accepting for {} s", delay.as_secs());
                tokio::time::sleep(delay).await;
            }
            // From here the listener is closed and open connections finish what they serve.
            let n = app.metrics.inflight.load(Ordering::Relaxed);
            tracing::info!("draining: {n} requests in flight");
        }
    };
    let headers = Duration::from_secs(args.idle_timeout_s);
    serve_http(listener, app(state), headers, stop).await;
    Ok(())
}

/// Serves `app` on `listener` over HTTP/1.1 (as vLLM's uvicorn; OpenAI clients speak it)
/// until `stop` completes, then stops accepting and waits for open connections to finish what
/// they serve. Unlike `axum::serve` it gives hyper a timer, so a connection that does not send
/// a request's headers within `header_timeout` is closed. (HTTP/2 is not offered: hyper's
/// HTTP/2 has no header deadline, and its protocol sniffing waits for first bytes untimed.)
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let (socket, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                continue;
            }
            Err(e) => {
                // Out of descriptors and the like: wait instead of spinning (as axum does).
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Err(e) = socket.set_nodelay(true) {
            tracing::debug!("no TCP_NODELAY for {peer}: {e}");
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(socket), service));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection from {peer} ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such route")
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    // One view of the cluster for both counts (two reads could straddle a refresh).
    let workers = app.cluster.workers();
    let listed = workers
        .iter()
        .filter(|w| w.role == dspark_scheduler::placement::ROLE_TARGET)
        .count();
    // Static `--targets` count once they answer (down or loading, they would take nothing).
    let targets = app.cluster.ready_targets(&workers);
    let draining = app.draining.load(Ordering::SeqCst);
    let ok = targets > 0 && !draining;
    let mut body = json!({"ready": ok, "target_workers": targets,
        "draft_workers": workers.len() - listed});
    if draining {
        body["draining"] = json!(true);
    }
    let code = if !ok {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, Json(body)).into_response()
}

async fn metrics_text(State(app): State<Arc<App>>) -> String {
    app.metrics.render()
}

/// The served model's card, with vLLM's fields: `max_model_len` (the context a request must
/// fit, once a target worker published one) and `root` (the model the workers load).
async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    let ctx = app.cluster.context_for(&app.model);
    let max_len = if ctx > 0 { json!(ctx) } else { Value::Null };
    Json(json!({"object": "list", "data": [
        {"id": app.name, "object": "model", "created": app.created, "owned_by": "dspark",
         "root": app.model, "parent": null, "max_model_len": max_len, "permission": []}]}))
}

/// `/tokenize` (as vLLM serves it): a `prompt`, or chat `messages` rendered with the
/// template, as the model's token ids.
async fn tokenize(State(app): State<Arc<App>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    // Off the async threads, as chat's: rendering and tokenizing run up to the body limit.
    blocking(move || tokenize_body(&app, &body)).await.map(Json)
}

fn tokenize_body(app: &App, body: &Bytes) -> Result<Value, ApiError> {
    let r: openai::TokenizeRequest = parse_body(body)?;
    if r.model.is_some() {
        check_model(app, &r.model)?;
    }
    // As the completions and chat endpoints tokenize them.
    let templating = r.template.checked()?;
    let tools = r
        .tools
        .as_ref()
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
    let (text, plain) = match (&r.prompt, &r.messages) {
        (Some(p), None) => (p.clone(), Vec::new()),
        (None, Some(_)) => render_chat(app, &r.messages, tools, &templating)?,
        _ => {
            return Err(ApiError::bad(
                "give either `prompt` or `messages`",
                Some("prompt"),
            ));
        }
    };
    let special = r.add_special_tokens.unwrap_or(r.prompt.is_some());
    let ids = if r.prompt.is_some() {
        app.tok.encode(&text)
    } else {
        app.tok.encode_with_plain(&text, &plain)
    }
    .map(|ids| with_special(app, ids, special))
    .map_err(|e| ApiError::bad(format!("tokenization: {e}"), Some("prompt")))?;
    let max_len = app.cluster.context_for(&app.model);
    Ok(json!({"count": ids.len(), "max_model_len": max_len, "tokens": ids}))
}

/// `/detokenize`: token ids back to text.
async fn detokenize(State(app): State<Arc<App>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    blocking(move || detokenize_body(&app, &body))
        .await
        .map(Json)
}

fn detokenize_body(app: &App, body: &Bytes) -> Result<Value, ApiError> {
    let r: openai::DetokenizeRequest = parse_body(body)?;
    if r.model.is_some() {
        check_model(app, &r.model)?;
    }
    if let Some(&t) = r
        .tokens
        .iter()
        .find(|&&t| t as usize >= app.tok.vocab_size())
    {
        return Err(ApiError::bad(
            format!("token id {t} outside the vocabulary"),
            Some("tokens"),
        ));
    }
    let text = app
        .tok
        .decode(&r.tokens, false)
        .map_err(|e| ApiError::bad(format!("detokenization: {e}"), Some("tokens")))?;
    Ok(json!({ "prompt": text }))
}

fn auth(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    let got = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compared in constant time (as the cluster token): timing the answers gives no prefix away.
    if got.is_some_and(|g| dspark_scheduler::auth::same_token(g.as_bytes(), key.as_bytes())) {
        Ok(())
    } else {
        let mut e = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key (Authorization: Bearer KEY)",
        );
        e.code = Some("invalid_api_key");
        Err(e)
    }
}

fn parse_body<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad(format!("the request body is not valid UTF-8: {e}"), None))?;
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::bad(
            "the request body must be a JSON object",
            None,
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad(format!("invalid request: {e}"), None))
}

/// The request's `model` is the one served; left out (or null), it is that one, as vLLM reads
/// it (OpenAI requires the field; curl scripts written for vLLM leave it out).
fn check_model(app: &App, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if *m == app.name => Ok(()),
        Some(m) => {
            let mut e = ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model `{}` does not exist; this server serves `{}`",
                    openai::clip(m),
                    app.name
                ),
            );
            e.param = Some("model");
            e.code = Some("model_not_found");
            Err(e)
        }
    }
}

/// The caller's W3C trace context, if it sent a well-formed one. None is invented: a parent
/// that no collector ever receives would leave the router's span hanging off nothing; without
/// one the router's span starts the trace.
fn traceparent(headers: &HeaderMap) -> String {
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() == 55 && v.split('-').count() == 4)
        .map(str::to_string)
        .unwrap_or_default()
}

/// Decrements the in-flight gauge however the request ends.
struct Inflight(Arc<App>);

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn admit(app: &Arc<App>) -> Result<Inflight, ApiError> {
    let cap = if app.max_inflight > 0 {
        app.max_inflight
    } else {
        app.cluster.capacity()
    };
    let n = app.metrics.inflight.fetch_add(1, Ordering::Relaxed) as usize;
    let guard = Inflight(Arc::clone(app));
    if cap > 0 && n >= cap {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("the cluster is full ({cap} requests in flight); retry shortly"),
        );
        e.retry_after = Some(1);
        return Err(e);
    }
    Ok(guard)
}

/// What the generation task hands the HTTP side.
enum Piece {
    /// Text, token ids, per-token log-probabilities when asked for, and in the first piece
    /// the prompt's when echoed.
    Text(
        String,
        Vec<u32>,
        Vec<dspark_proto::TokenLogprob>,
        Vec<dspark_proto::TokenLogprob>,
    ),
    Done {
        reason: String,
        stats: SpecStats,
        target: String,
    },
    Error(ApiError),
}

struct Job {
    prompt: Vec<u32>,
    settings: GenSettings,
    traceparent: String,
    request_id: String,
    /// When the HTTP request arrived (latency metrics count from here).
    arrived: Instant,
}

fn status_to_api(s: &tonic::Status) -> ApiError {
    match s.code() {
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange => ApiError::bad(s.message(), None),
        tonic::Code::ResourceExhausted => {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                s.message(),
            );
            e.retry_after = Some(1);
            e
        }
        // The worker answered: its engine failed the request.
        tonic::Code::Internal => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("target worker: {}", s.message()),
        ),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("target worker: {}", s.message()),
        ),
    }
}

/// A target worker's event stream, counted on that worker (local placement's load) for as
/// long as it lives: dropped anywhere (finished, failed over, its client gone half way
/// through opening a batch), the count goes back.
struct EventStream {
    inner: tonic::Streaming<dspark_proto::GenerateEvent>,
    _counted: Tracked,
}

impl futures::Stream for EventStream {
    type Item = Result<dspark_proto::GenerateEvent, tonic::Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// An opened request: its worker, its event stream, and the first event.
type Opened = (WorkerInfo, EventStream, Option<dspark_proto::GenerateEvent>);

/// Workers tried per opening when they cannot take the request (draining, stopped,
/// unreachable, the connection broken before the first event)...
const MAX_OPEN_TRIES: usize = 4;

/// ...or as many as fail within this time: a refused connection costs a millisecond, and a
/// view naming several dead workers (kept while the scheduler is away) must not use up a
/// request's tries on them.
const OPEN_RETRY_WINDOW: Duration = Duration::from_secs(1);

/// Places the job and opens the target's stream; the first event is awaited so that a refusal
/// becomes an HTTP error before any response is sent. A worker that cannot take it (draining
/// for a rolling update, or gone since the last cluster view) costs a placement elsewhere, not
/// the request. A `failover` (the request was running on a worker that died) is placed
/// even where every target reads full: it was admitted already, the worker queues what it
/// cannot run yet, and refusing it would cost its client the answer half way.
async fn open(
    app: &App,
    job: &Job,
    prompt: Vec<u32>,
    max_tokens: usize,
    exclude: &[String],
    prompt_logprobs: bool,
    failover: bool,
) -> Result<Opened, ApiError> {
    let mut skip = exclude.to_vec();
    let started = Instant::now();
    // Connections that broke after the request was sent (not refused, not a draining answer):
    // a worker killed while the request waited, or one the request itself crashes. One more
    // worker is tried, not every one (a request that kills workers must not take the pool).
    let mut broken = 0;
    loop {
        let opened = open_once(
            app,
            job,
            prompt.clone(),
            max_tokens,
            &skip,
            prompt_logprobs,
            failover,
        );
        match opened.await {
            Err(Unopened::Unavailable(target, s)) => {
                app.cluster.suspect(&target.address);
                let refused = s.code() == tonic::Code::Unavailable;
                broken += usize::from(!refused);
                let more = broken <= 1
                    && (skip.len() < exclude.len() + MAX_OPEN_TRIES
                        || (refused && started.elapsed() < OPEN_RETRY_WINDOW));
                if !more {
                    return Err(status_to_api(&s));
                }
                tracing::info!(
                    request_id = job.request_id,
                    target = target.id,
                    "target worker unavailable, placing elsewhere: {}",
                    s.message()
                );
                skip.push(target.id);
            }
            Err(Unopened::Refused(e)) => return Err(e),
            Ok(o) => return Ok(o),
        }
    }
}

/// A request waiting for room asks for a placement again after 50 ms, then twice as long each
/// time up to 400 ms, each pause stretched by up to a quarter at random so that waiting
/// requests do not ask together. (The scheduler's `full` placements count these asks.)
const FULL_POLL: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(400));

/// [`open`], waiting while every target reads full, until `deadline` or until `gone` (its
/// client left); then the last refusal stands.
async fn open_when_room(
    app: &App,
    job: &Job,
    max_tokens: usize,
    prompt_logprobs: bool,
    deadline: Instant,
    gone: impl Fn() -> bool,
) -> Result<Opened, ApiError> {
    let mut pause = FULL_POLL.0;
    loop {
        match open_fresh(app, job, max_tokens, prompt_logprobs).await {
            Err(e)
                if e.status == StatusCode::TOO_MANY_REQUESTS
                    && Instant::now() < deadline
                    && !gone() =>
            {
                let jitter = random_u64() % (pause.as_millis() as u64 / 4 + 1);
                tokio::time::sleep(pause + Duration::from_millis(jitter)).await;
                pause = (pause * 2).min(FULL_POLL.1);
            }
            r => return r,
        }
    }
}

/// [`open`] for a request not started yet. A worker whose engine fails it before its first
/// event (a failed step it shared with others) costs one more placement, as the same failure
/// a token later costs a failover: elsewhere, or, where no other worker is up, on the same one
/// after a pause. A second failure stands.
async fn open_fresh(
    app: &App,
    job: &Job,
    max_tokens: usize,
    prompt_logprobs: bool,
) -> Result<Opened, ApiError> {
    let prompt = || job.prompt.clone();
    let first = open(app, job, prompt(), max_tokens, &[], prompt_logprobs, false).await;
    let w = match &first {
        Err(e) if e.status == StatusCode::INTERNAL_SERVER_ERROR => match &e.worker {
            Some(w) => w.clone(),
            None => return first,
        },
        _ => return first,
    };
    tracing::warn!(
        request_id = job.request_id,
        target = w,
        "target worker failed the request before its first token; placing it again"
    );
    Metrics::add(&app.metrics.failovers, 1);
    let skip = [w];
    let again = match open(
        app,
        job,
        prompt(),
        max_tokens,
        &skip,
        prompt_logprobs,
        false,
    )
    .await
    {
        Err(e) if e.status == StatusCode::SERVICE_UNAVAILABLE => {
            tokio::time::sleep(SAME_WORKER_PAUSE).await;
            open(app, job, prompt(), max_tokens, &[], prompt_logprobs, false).await
        }
        r => r,
    };
    // The second try failing too (the worker now reads full, say: a rank of it died), the
    // first failure is the answer: it says what went wrong.
    again.or(first)
}

enum Unopened {
    /// The worker answered `UNAVAILABLE`, or could not be reached, or its connection broke
    /// before the first event: another may take the request.
    Unavailable(WorkerInfo, tonic::Status),
    Refused(ApiError),
}

async fn open_once(
    app: &App,
    job: &Job,
    prompt: Vec<u32>,
    max_tokens: usize,
    exclude: &[String],
    prompt_logprobs: bool,
    failover: bool,
) -> Result<Opened, Unopened> {
    let refused = Unopened::Refused;
    let (target, draft) = app
        .cluster
        .place(&app.model, exclude, &prompt, failover)
        .await
        .map_err(|e| match e {
            cluster::PlaceError::NoTarget => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "no target worker is up for this model",
            ),
            cluster::PlaceError::Full => {
                let mut e = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "every target worker is at capacity; retry shortly",
                );
                e.retry_after = Some(1);
                e
            }
        })
        .map_err(refused)?;
    // A defaulted max_tokens fits the context of the worker chosen (the router's view may not
    // have known it when the request was read).
    let max_tokens = if job.settings.max_tokens_defaulted && target.max_context > 0 {
        max_tokens
            .min((target.max_context as usize).saturating_sub(prompt.len()))
            .max(1)
    } else {
        max_tokens
    };
    if target.max_context > 0 && prompt.len() + max_tokens > target.max_context as usize {
        return Err(refused(too_long(
            prompt.len(),
            max_tokens,
            target.max_context as usize,
        )));
    }
    let mut client = app.cluster.target_client(&target.address).map_err(|e| {
        refused(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            e,
        ))
    })?;
    let prompt_len = prompt.len();
    let mut req = tonic::Request::new(GenerateRequest {
        request_id: job.request_id.clone(),
        prompt,
        max_tokens: max_tokens as u32,
        sampling: Some((&job.settings.sampling).into()),
        seed: job.settings.seed,
        stop: job.settings.stop.clone(),
        include_stop: job.settings.include_stop,
        gamma: job.settings.gamma,
        draft_worker: draft.map(|d| d.address).unwrap_or_default(),
        traceparent: job.traceparent.clone(),
        logprobs: job.settings.logprobs.is_some(),
        top_logprobs: job.settings.logprobs.unwrap_or(0) as u32,
        prompt_logprobs,
        ignore_eos: job.settings.ignore_eos,
        // After a failover the prompt holds what was generated before: it counts.
        min_tokens: job
            .settings
            .min_tokens
            .saturating_sub(prompt_len.saturating_sub(job.prompt.len())) as u32,
        stop_token_ids: job.settings.stop_token_ids.clone(),
        json: job.settings.json,
        json_schema: job.settings.json_schema.clone().unwrap_or_default(),
        regex: job.settings.regex.clone().unwrap_or_default(),
        resumed: prompt_len.saturating_sub(job.prompt.len()) as u32,
        admitted: failover,
    });
    if let Ok(v) = job.traceparent.parse()
        && !job.traceparent.is_empty()
    {
        req.metadata_mut().insert("traceparent", v);
    }
    // Counted until the stream is handed over; an opening dropped half way (its client gone)
    // gives the count back too.
    let tracked = Tracked::new(Arc::clone(&app.cluster), &target.address);
    let failed = |s: tonic::Status| {
        if gone_worker(&s) {
            Unopened::Unavailable(target.clone(), s)
        } else {
            let mut e = status_to_api(&s);
            if s.code() == tonic::Code::Internal {
                e.worker = Some(target.id.clone());
            }
            refused(e)
        }
    };
    let mut stream = match client.generate(req).await {
        Ok(s) => EventStream {
            inner: s.into_inner(),
            _counted: tracked,
        },
        Err(s) => return Err(failed(s)),
    };
    let first = match stream.next().await {
        Some(Ok(ev)) => Some(ev),
        Some(Err(s)) => return Err(failed(s)),
        None => None,
    };
    app.cluster.reachable(&target.address);
    Ok((target, stream, first))
}

/// A request whose prompt and answer do not fit the context, in the words of vLLM's (and
/// OpenAI's) error, which clients match ("maximum context length") to fall back to a model
/// with a longer one.
fn too_long(prompt: usize, max_tokens: usize, ctx: usize) -> ApiError {
    ApiError::bad(
        format!(
            "This model's maximum context length is {ctx} tokens. However, you requested {} \
             tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce \
             the length of the messages or completion.",
            prompt + max_tokens
        ),
        Some("max_tokens"),
    )
}

/// A status that says the worker could not take the request, not that it refused it: it is
/// draining or stopped (`UNAVAILABLE`), or the call never reached an answer: a worker killed
/// or its node lost while the request queued or prefilled breaks the connection, which tonic
/// reads as `UNKNOWN` (an I/O error, no HTTP/2 code) or `CANCELLED`. The worker itself sends
/// none of these but `UNAVAILABLE`; each costs a placement elsewhere, not the request.
fn gone_worker(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
            | tonic::Code::DeadlineExceeded
            | tonic::Code::DataLoss
    )
}

/// A request counted on a target worker (local placement's load) until dropped.
struct Tracked {
    cluster: Arc<cluster::Cluster>,
    addr: String,
}

impl Tracked {
    fn new(cluster: Arc<cluster::Cluster>, addr: &str) -> Self {
        cluster.track(addr, 1);
        Self {
            cluster,
            addr: addr.to_string(),
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.cluster.track(&self.addr, -1);
    }
}

/// Runs a job to the end, with failover, sending pieces to `tx`.
async fn drive(
    app: Arc<App>,
    job: Job,
    mut target: WorkerInfo,
    mut stream: EventStream,
    mut first: Option<dspark_proto::GenerateEvent>,
    tx: tokio::sync::mpsc::Sender<Piece>,
) {
    let mut generated: Vec<u32> = Vec::new();
    let mut stats = SpecStats::default();
    let mut failed: Vec<String> = Vec::new();
    // Where the current worker's part of `generated` starts: a worker lost mid-stream never
    // reports the forwards behind its tokens.
    let mut part_start = 0usize;
    let mut first_token = true;
    let mut ttft = 0.0f64;
    // Set when a chunk said it was the request's last.
    let mut said_done: Option<String> = None;
    loop {
        let ev = match first.take() {
            Some(e) => Some(Ok(e)),
            // A client that left is noticed while the worker says nothing (the request queued
            // or prefilling there), not at its next event: returning drops the stream, which
            // cancels the request on the worker.
            None => tokio::select! {
                biased;
                _ = tx.closed() => return,
                e = stream.next() => e,
            },
        };
        match ev {
            Some(Ok(e)) => match e.kind {
                Some(generate_event::Kind::Tokens(t)) => {
                    if first_token {
                        first_token = false;
                        ttft = job.arrived.elapsed().as_secs_f64();
                        app.metrics.ttft.observe(ttft);
                    }
                    generated.extend_from_slice(&t.ids);
                    if !t.finish_reason.is_empty() {
                        said_done = Some(t.finish_reason.clone());
                    }
                    if tx
                        .send(Piece::Text(t.text, t.ids, t.logprobs, t.prompt_logprobs))
                        .await
                        .is_err()
                    {
                        break; // client gone: dropping the stream cancels on the worker
                    }
                }
                Some(generate_event::Kind::Finished(f)) => {
                    let s = f.stats.unwrap_or_default();
                    merge(&mut stats, &s);
                    stats.prompt_tokens = job.prompt.len() as u32;
                    // What the worker that finished found cached (of its own prompt, which
                    // after a failover includes what was generated before).
                    stats.cached_tokens = s.cached_tokens.min(stats.prompt_tokens);
                    stats.completion_tokens = generated.len() as u32;
                    let e2e = job.arrived.elapsed().as_secs_f64();
                    app.metrics.e2e.observe(e2e);
                    if generated.len() > 1 {
                        app.metrics
                            .tpot
                            .observe((e2e - ttft) / (generated.len() - 1) as f64);
                    }
                    let _ = tx
                        .send(Piece::Done {
                            reason: f.reason,
                            stats: stats.clone(),
                            target: target.id.clone(),
                        })
                        .await;
                    break;
                }
                None => {}
            },
            other => {
                // The worker died or the stream broke: continue elsewhere.
                // `INTERNAL` is a live worker's engine failing the request (a step that failed
                // every request in it, or this request alone): it may take it again.
                let alive = matches!(&other, Some(Err(s)) if s.code() == tonic::Code::Internal);
                let why = match other {
                    Some(Err(s)) => s.message().to_string(),
                    _ => "stream ended without finishing".into(),
                };
                failed.push(target.id.clone());
                if !alive {
                    app.cluster.suspect(&target.address);
                }
                tracing::warn!(
                    request_id = job.request_id,
                    target = target.id,
                    "target worker failed mid-stream: {why}"
                );
                let left = job.settings.max_tokens.saturating_sub(generated.len());
                if let Some(reason) = whole_before_break(said_done.as_deref(), left) {
                    // As on a failover: the lost worker's forwards are never reported.
                    stats.first_tokens += (generated.len() - part_start) as u32;
                    stats.prompt_tokens = job.prompt.len() as u32;
                    stats.completion_tokens = generated.len() as u32;
                    app.metrics.e2e.observe(job.arrived.elapsed().as_secs_f64());
                    let _ = tx
                        .send(Piece::Done {
                            reason,
                            stats: stats.clone(),
                            target: target.id.clone(),
                        })
                        .await;
                    return;
                }
                if failed.len() > MAX_FAILOVERS {
                    let _ = tx
                        .send(Piece::Error(ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "server_error",
                            format!("target workers failed: {why}"),
                        )))
                        .await;
                    return;
                }
                Metrics::add(&app.metrics.failovers, 1);
                // The lost worker's tokens came from forwards nobody reports: counted with the
                // first tokens, so `tokens_per_forward` is the reporting workers' τ alone.
                stats.first_tokens += (generated.len() - part_start) as u32;
                part_start = generated.len();
                let mut prompt = job.prompt.clone();
                prompt.extend_from_slice(&generated);
                // The prompt's log-probabilities come with the first tokens: ask again only
                // when none arrived.
                let again = first_token && job.settings.echo && job.settings.logprobs.is_some();
                // A live worker whose engine failed the request: where no other worker is up
                // (a one-worker cluster) it is tried again, within the same failover budget,
                // rather than the request lost to what may have been one failed step.
                let mut live = alive.then(|| target.id.clone());
                let mut opened;
                loop {
                    // Opening waits for the new worker's prefill: a client that leaves
                    // meanwhile ends it (dropping the opening cancels it there).
                    opened = tokio::select! {
                        biased;
                        _ = tx.closed() => return,
                        o = open(&app, &job, prompt.clone(), left, &failed, again, true) => o,
                    };
                    if let Some(w) = &live
                        && matches!(&opened, Err(e) if e.status == StatusCode::SERVICE_UNAVAILABLE)
                    {
                        let others: Vec<String> =
                            failed.iter().filter(|f| *f != w).cloned().collect();
                        tokio::time::sleep(SAME_WORKER_PAUSE).await;
                        opened = tokio::select! {
                            biased;
                            _ = tx.closed() => return,
                            o = open(&app, &job, prompt.clone(), left, &others, again, true) => o,
                        };
                    }
                    // A worker whose engine fails the reopened request before its first event:
                    // one more failure, as mid-stream.
                    match &opened {
                        Err(e)
                            if e.status == StatusCode::INTERNAL_SERVER_ERROR
                                && failed.len() < MAX_FAILOVERS =>
                        {
                            let w = e.worker.clone().unwrap_or_default();
                            failed.push(w.clone());
                            Metrics::add(&app.metrics.failovers, 1);
                            live = Some(w);
                        }
                        _ => break,
                    }
                }
                match opened {
                    Ok((t, s, f)) => {
                        target = t;
                        stream = s;
                        first = f;
                        continue;
                    }
                    Err(e) => {
                        let _ = tx.send(Piece::Error(e)).await;
                        return;
                    }
                }
            }
        }
    }
}

/// The finish reason of a request whose stream broke when no other worker is needed: its last
/// chunk said it had ended (the worker died before `Finished`), or it has every token it
/// asked for. `None`: resume it elsewhere.
fn whole_before_break(said_done: Option<&str>, left: usize) -> Option<String> {
    match said_done {
        Some(reason) => Some(reason.to_string()),
        None if left == 0 => Some("length".into()),
        None => None,
    }
}

fn merge(a: &mut SpecStats, b: &SpecStats) {
    a.verify_forwards += b.verify_forwards;
    a.first_tokens += b.first_tokens;
    a.drafted_tokens += b.drafted_tokens;
    a.accepted_tokens += b.accepted_tokens;
    a.remote_draft_cycles += b.remote_draft_cycles;
    a.fallback_draft_cycles += b.fallback_draft_cycles;
    a.bytes_to_draft += b.bytes_to_draft;
    a.bytes_from_draft += b.bytes_from_draft;
    a.draft_rtt_ms += b.draft_rtt_ms;
    a.draft_compute_ms += b.draft_compute_ms;
    if a.ttft_ms == 0.0 {
        a.ttft_ms = b.ttft_ms;
    }
}

/// Completion tokens per verify forward, after each sequence's first token (its prefill's, no
/// verify forward's): the engine's τ, over every choice and resumed part the usage covers.
fn tokens_per_forward(s: &SpecStats) -> f64 {
    if s.verify_forwards == 0 {
        return 0.0;
    }
    // A worker of an earlier release reports no first tokens: one per answer with tokens.
    let firsts = if s.first_tokens > 0 {
        s.first_tokens
    } else {
        u32::from(s.completion_tokens > 0)
    };
    s.completion_tokens.saturating_sub(firsts) as f64 / s.verify_forwards as f64
}

fn usage(stats: &SpecStats, target: &str) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "dspark": {
            "target_worker": target,
            "verify_forwards": stats.verify_forwards,
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "tokens_per_forward": tokens_per_forward(stats),
            "remote_draft_cycles": stats.remote_draft_cycles,
            "fallback_draft_cycles": stats.fallback_draft_cycles,
            "bytes_to_draft": stats.bytes_to_draft,
            "bytes_from_draft": stats.bytes_from_draft,
            "draft_rtt_ms": stats.draft_rtt_ms,
            "draft_compute_ms": stats.draft_compute_ms,
            "ttft_ms": stats.ttft_ms,
        }
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// Runs a request's CPU work (parsing, tokenizing, rendering templates, compiling formats, up
/// to the caps on each) off the async runtime, which carries every stream's events.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            format!("preparing the request: {e}"),
        )
    })?
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    // Latency counts from here, with the prompt's tokenizing (a long prompt's, or one queued
    // behind others for the blocking pool, is part of what the client waits for).
    let arrived = Instant::now();
    let a = Arc::clone(&app);
    let (prompts, texts, settings) = blocking(move || completion_request(&a, &body)).await?;
    let req = (prompts, texts, settings, Kind::Completion);
    serve(app, headers, req, arrived).await
}

/// A completion request's prompts (token ids, and the text of those given as text, which an
/// echo repeats as given) and settings.
#[allow(clippy::type_complexity)]
fn completion_request(
    app: &App,
    body: &Bytes,
) -> Result<(Vec<Vec<u32>>, Vec<Option<String>>, GenSettings), ApiError> {
    let r: CompletionRequest = parse_body(body)?;
    check_model(app, &r.common.model)?;
    let settings = r.common.settings(
        app.default_max_tokens,
        app.max_tokens_limit,
        app.tok.vocab_size(),
    )?;
    // Counted before anything is encoded: a list of a million prompts is refused at once,
    // not after a million tokenizer calls.
    let count = match &r.prompt {
        Some(Prompt::Texts(v)) => v.len(),
        Some(Prompt::TokenLists(v)) => v.len(),
        _ => 1,
    };
    if count == 0 || count > MAX_PROMPTS {
        return Err(ApiError::bad(
            format!("between 1 and {MAX_PROMPTS} prompts per request"),
            Some("prompt"),
        ));
    }
    let special = r.common.add_special_tokens.unwrap_or(true);
    let (prompts, texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match r.prompt {
        None => return Err(ApiError::bad("`prompt` is required", Some("prompt"))),
        Some(Prompt::Text(s)) => (vec![encode(app, &s, special)?], vec![Some(s)]),
        Some(Prompt::Texts(v)) => {
            let ids = v
                .iter()
                .map(|s| encode(app, s, special))
                .collect::<Result<_, _>>()?;
            (ids, v.into_iter().map(Some).collect())
        }
        Some(Prompt::Tokens(t)) => (vec![t], vec![None]),
        Some(Prompt::TokenLists(v)) => {
            let n = v.len();
            (v, vec![None; n])
        }
    };
    Ok((prompts, texts, settings))
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    // As in `completions`: the template's rendering and tokenizing count.
    let arrived = Instant::now();
    let a = Arc::clone(&app);
    let (prompt, settings) = blocking(move || chat_request(&a, &body)).await?;
    let req = (vec![prompt], Vec::new(), settings, Kind::Chat);
    serve(app, headers, req, arrived).await
}

/// A chat request's prompt (the rendered template, tokenized) and settings.
fn chat_request(app: &App, body: &Bytes) -> Result<(Vec<u32>, GenSettings), ApiError> {
    let r: ChatRequest = parse_body(body)?;
    check_model(app, &r.common.model)?;
    let mode = r.tool_mode(app.auto_tools)?;
    // `tool_choice: "none"` means plain text: a template shown the tools would tell the model
    // how to call them.
    let tools = match mode {
        openai::ToolMode::None => None,
        _ => r.tools.as_ref(),
    };
    let templating = r.template.checked()?;
    let (text, plain) = render_chat(app, &r.messages, tools, &templating)?;
    let prompt = app
        .tok
        .encode_with_plain(&text, &plain)
        .map(|ids| with_special(app, ids, r.common.add_special_tokens.unwrap_or(false)))
        .map_err(|e| ApiError::bad(format!("tokenization: {e}"), Some("messages")))?;
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty", Some("messages")));
    }
    // Without max_tokens, chat answers may run to CHAT_DEFAULT_MAX_TOKENS (trimmed to the room
    // left in the context in `serve`): a target worker reserves KV for the whole answer when
    // it admits a request, so a default of the whole context would cut how many run at once.
    let mut settings = r.common.settings(
        app.max_tokens_limit.min(CHAT_DEFAULT_MAX_TOKENS),
        app.max_tokens_limit,
        app.tok.vocab_size(),
    )?;
    if let openai::ToolMode::Auto(names) = &mode {
        settings.auto_tools = Some(names.clone());
    }
    if let openai::ToolMode::Forced(f) = mode {
        if settings.json || settings.json_schema.is_some() || settings.regex.is_some() {
            return Err(ApiError::bad(
                "response_format cannot be combined with a forced tool call (the call's \
                 arguments already follow the function's parameters schema)",
                Some("response_format"),
            ));
        }
        if r.common.ignore_eos {
            // The arguments end the answer: past them only the end may follow.
            return Err(ApiError::bad(
                "ignore_eos cannot be combined with a forced tool call",
                Some("ignore_eos"),
            ));
        }
        settings.json_schema = Some(f.parameters.to_string());
        settings.tool_call = Some(f.name);
    }
    if settings.echo {
        return Err(ApiError::bad(
            "echo is supported on /v1/completions only",
            Some("echo"),
        ));
    }
    if r.common.logprobs.as_ref().is_some_and(|v| v.is_number()) {
        return Err(ApiError::bad(
            "chat takes `logprobs: true` and `top_logprobs: N`",
            Some("logprobs"),
        ));
    }
    Ok((prompt, settings))
}

/// The chat template rendered over `messages` (with the assistant's turn opened) and `tools`.
/// An assistant turn's `tool_calls` reach the template as they are; a template that does not
/// render them (SmolLM2's) gets them as the turn's text, so the model still sees its calls.
///
/// Also the byte ranges of the prompt that are a message's text holding a special-token
/// string (`<|im_end|>`…): they are tokenized as characters, so a user cannot end their turn
/// and write the system's. Tools and past calls holding one are refused.
fn render_chat(
    app: &App,
    messages: &Option<Vec<openai::ChatMessage>>,
    tools: Option<&Value>,
    templating: &openai::Templating,
) -> Result<(String, Vec<std::ops::Range<usize>>), ApiError> {
    let msgs = match messages {
        Some(m) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::bad(
                "`messages` must be a non-empty list",
                Some("messages"),
            ));
        }
    };
    if msgs.len() > openai::MAX_MESSAGES {
        return Err(ApiError::bad(
            format!(
                "`messages` holds {} messages; at most {} are served per request",
                msgs.len(),
                openai::MAX_MESSAGES
            ),
            Some("messages"),
        ));
    }
    let mut conv = Vec::with_capacity(msgs.len());
    for m in msgs {
        if !["system", "user", "assistant", "developer", "tool"].contains(&m.role.as_str()) {
            return Err(ApiError::bad(
                format!("unknown role `{}`", openai::clip(&m.role)),
                Some("messages"),
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let mut msg = Message::new(role, &m.text()?);
        match &m.tool_calls {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) if m.role == "assistant" => {
                // OpenAI sends `arguments` as a JSON string; templates (Qwen2.5, Llama 3,
                // Hermes) render them with `tojson`, as Hugging Face passes them: objects.
                let mut calls = calls.clone();
                for c in &mut calls {
                    if let Some(a) = c.pointer_mut("/function/arguments")
                        && let Some(v) = a
                            .as_str()
                            .and_then(|t| serde_json::from_str::<Value>(t).ok())
                            .filter(Value::is_object)
                    {
                        *a = v;
                    }
                }
                msg.tool_calls = Some(Value::Array(calls));
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "`tool_calls` is a list, on assistant messages",
                    Some("messages"),
                ));
            }
        }
        msg.tool_call_id = m.tool_call_id.clone();
        conv.push(msg);
    }
    let tpl = app.template.as_ref().ok_or_else(|| {
        ApiError::bad("this model has no chat template; use /v1/completions", None)
    })?;
    if !tpl.renders_tool_calls() {
        for m in conv.iter_mut() {
            if let Some(c) = m.tool_calls.take() {
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str(&c.to_string());
            }
        }
    }
    let typed = tools.map(openai::typed_tools);
    let tools = typed
        .as_ref()
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
    let special = |what: &str, v: &Value| match app.tok.special_in(&v.to_string()) {
        Some(s) => Err(ApiError::bad(
            format!("{what} holds the special token `{s}`"),
            Some(if what == "tools" { "tools" } else { "messages" }),
        )),
        None => Ok(()),
    };
    if let Some(t) = tools {
        special("tools", t)?;
    }
    for c in conv.iter().filter_map(|m| m.tool_calls.as_ref()) {
        special("a message's tool_calls", c)?;
    }
    for m in &conv {
        if let Some(s) = m
            .tool_call_id
            .as_deref()
            .and_then(|t| app.tok.special_in(t))
        {
            return Err(ApiError::bad(
                format!("a tool_call_id holds the special token `{s}`"),
                Some("messages"),
            ));
        }
    }
    let last = conv.last().map(|m| m.content.clone()).unwrap_or_default();
    let (mut text, mut spans) = render_kept_apart(tpl, conv, tools, templating, |t| {
        app.tok.special_in(t).is_some()
    })
    .map_err(|e| ApiError::bad(e, Some("messages")))?;
    if templating.continue_final_message {
        // As Hugging Face's `continue_final_message`: the prompt ends where the last message's
        // text (or, for a template that trims it, its trimmed text) last appears.
        let end = [last.as_str(), last.trim()]
            .into_iter()
            .find_map(|t| text.rfind(t).map(|i| i + t.len()))
            .filter(|_| !last.trim().is_empty())
            .ok_or_else(|| {
                ApiError::bad(
                    "continue_final_message: the last message's text does not appear in the \
                     rendered chat (an empty message, or a template that rewrites it)",
                    Some("continue_final_message"),
                )
            })?;
        text.truncate(end);
        spans.retain(|r| r.start < end);
        for r in &mut spans {
            r.end = r.end.min(end);
        }
    }
    Ok((text, spans))
}

/// The prompt, with the byte ranges of messages that hold a control-token string
/// (`special`): each is rendered as a marker of its own, which must come out once, and its
/// text goes where the marker is, to be tokenized as characters. The template must write
/// those texts as they are: rendered with them, the prompt is the same (a template that
/// trims, escapes or cuts such a message is refused).
fn render_kept_apart(
    tpl: &dspark_runtime::chat::ChatTemplate,
    mut conv: Vec<Message>,
    tools: Option<&Value>,
    templating: &openai::Templating,
    special: impl Fn(&str) -> bool,
) -> Result<(String, Vec<std::ops::Range<usize>>), String> {
    let nonce = random_u64();
    let mut held = Vec::new();
    let mut held_at = Vec::new();
    for (n, m) in conv.iter_mut().enumerate() {
        if special(&m.content) {
            // One width for every marker: `splice_texts` finds them all in one pass.
            let marker = format!("\u{E000}{nonce:016x}-{n:016x}\u{E001}");
            held_at.push(n);
            held.push((marker.clone(), std::mem::replace(&mut m.content, marker)));
        }
    }
    let render = |conv: &[Message]| {
        tpl.render_with_kwargs(
            conv,
            tools,
            templating.add_generation_prompt,
            templating.kwargs.as_ref(),
        )
        .map_err(|e| format!("chat template: {e}"))
    };
    let (spliced, spans) = splice_texts(&render(&conv)?, &held)?;
    if !held.is_empty() {
        for (&n, (_, original)) in held_at.iter().zip(&held) {
            conv[n].content = original.clone();
        }
        if render(&conv)? != spliced {
            return Err(
                "a message holds a special-token string (such as `<|im_end|>`), and \
                        this model's chat template does not write that message as it is, so \
                        it cannot be kept apart from the template's own tokens"
                    .into(),
            );
        }
    }
    Ok((spliced, spans))
}

/// The rendered prompt with each `(marker, text)` marker replaced by its text, and where those
/// texts lie in the result. A marker the template did not write exactly once (it dropped,
/// repeated or rewrote the message) is refused: that text's control tokens could not be kept
/// apart from the template's.
///
/// One pass over `rendered` whatever the number of markers (a request may hold thousands):
/// only where the markers' common prefix starts is a marker looked up, by its few lengths.
fn splice_texts(
    rendered: &str,
    held: &[(String, String)],
) -> Result<(String, Vec<std::ops::Range<usize>>), String> {
    let refused = || {
        "a message holds a special-token string (such as `<|im_end|>`), and this model's chat \
         template does not write that message once as it is, so it cannot be kept apart from \
         the template's own tokens"
            .to_string()
    };
    let Some((first, _)) = held.first() else {
        return Ok((rendered.to_string(), Vec::new()));
    };
    let by_marker: std::collections::HashMap<&str, usize> = held
        .iter()
        .enumerate()
        .map(|(k, (m, _))| (m.as_str(), k))
        .collect();
    let mut lengths: Vec<usize> = held.iter().map(|(m, _)| m.len()).collect();
    lengths.sort_unstable();
    lengths.dedup();
    // The markers' longest common prefix, cut at a character.
    let mut common = first.len();
    for (m, _) in held {
        common = common.min(
            first
                .bytes()
                .zip(m.bytes())
                .take_while(|(a, b)| a == b)
                .count(),
        );
    }
    while !first.is_char_boundary(common) {
        common -= 1;
    }
    let prefix = &first[..common];
    let mut at: Vec<Option<usize>> = vec![None; held.len()];
    let mut from = 0;
    while from < rendered.len() {
        let Some(i) = rendered[from..].find(prefix).map(|i| from + i) else {
            break;
        };
        for &len in &lengths {
            if let Some(&k) = rendered.get(i..i + len).and_then(|c| by_marker.get(c))
                && at[k].replace(i).is_some()
            {
                return Err(refused());
            }
        }
        // On by one character: markers that overlap a prefix match are still seen.
        from = i + rendered[i..].chars().next().map_or(1, char::len_utf8);
    }
    let mut order: Vec<(usize, usize)> = Vec::with_capacity(held.len());
    for (k, i) in at.into_iter().enumerate() {
        order.push((i.ok_or_else(refused)?, k));
    }
    order.sort_unstable();
    let mut out = String::with_capacity(rendered.len());
    let mut spans = Vec::with_capacity(order.len());
    let mut from = 0;
    for (i, k) in order {
        let (marker, text) = &held[k];
        // Markers that overlap cannot both be replaced.
        if i < from {
            return Err(refused());
        }
        out.push_str(&rendered[from..i]);
        spans.push(out.len()..out.len() + text.len());
        out.push_str(text);
        from = i + marker.len();
    }
    out.push_str(&rendered[from..]);
    Ok((out, spans))
}

/// `ids` with the model's BOS first where its tokenizer adds one and `yes` (a request's
/// `add_special_tokens`), as Hugging Face's `add_special_tokens=True` encodes text.
fn with_special(app: &App, mut ids: Vec<u32>, yes: bool) -> Vec<u32> {
    if yes
        && app.tok.add_bos
        && let Some((b, _)) = &app.tok.bos
        && ids.first() != Some(b)
    {
        ids.insert(0, *b);
    }
    ids
}

fn encode(app: &App, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    let ids = app
        .tok
        .encode(text)
        .map(|ids| with_special(app, ids, special))
        .map_err(|e| ApiError::bad(format!("tokenization: {e}"), Some("prompt")))?;
    if ids.is_empty() {
        return Err(ApiError::bad("the prompt is empty", Some("prompt")));
    }
    Ok(ids)
}

/// Refuses, before admission, a request whose answer is too large to hold: more than
/// [`openai::MAX_SEQUENCES`] sequences (prompts × n), or, unless it streams, more than
/// [`openai::MAX_LOGPROB_ENTRIES`] log-probability entries (a non-streamed answer keeps every
/// choice's text, ids and log-probabilities until the end; 256 prompts × 16 choices × echoed
/// logprobs with 20 alternatives would be gigabytes of JSON). Counted from what was asked
/// (max_tokens, not what will be made): a request either fits or never does.
fn check_answer_size(
    prompt_lens: impl Iterator<Item = usize>,
    settings: &GenSettings,
) -> Result<(), ApiError> {
    let n = settings.n.max(1) as u64;
    let mut sequences = 0u64;
    let mut entries = 0u64;
    // Without logprobs a choice keeps its text and ids only (bounded by max_tokens).
    let per_entry = settings.logprobs.map_or(0, |top| top as u64 + 1);
    let echoed = settings.echo && settings.logprobs.is_some();
    for len in prompt_lens {
        sequences += n;
        let tokens = if echoed { len as u64 } else { 0 } + settings.max_tokens as u64;
        entries = entries.saturating_add(n.saturating_mul(tokens).saturating_mul(per_entry));
    }
    if sequences > openai::MAX_SEQUENCES as u64 {
        return Err(ApiError::bad(
            format!(
                "prompts × n is {sequences}; at most {} sequences are served per request",
                openai::MAX_SEQUENCES
            ),
            Some("n"),
        ));
    }
    if !settings.stream && entries > openai::MAX_LOGPROB_ENTRIES {
        return Err(ApiError::bad(
            format!(
                "this request asks for up to {entries} log-probability entries (prompts × n × \
                 (echoed prompt tokens + max_tokens) × (logprobs + 1)), over the {} a \
                 non-streamed answer may hold; ask for fewer prompts, choices, tokens or \
                 alternatives, or set `stream: true` to receive them as they are made",
                openai::MAX_LOGPROB_ENTRIES
            ),
            Some("logprobs"),
        ));
    }
    Ok(())
}

/// `texts`: per prompt, the text it was given as (an echo repeats it as given: decoding its
/// ids would show what tokenizing added, a BOS); empty or None: decoded.
#[allow(clippy::type_complexity)]
async fn serve(
    app: Arc<App>,
    headers: HeaderMap,
    (prompts, texts, mut settings, kind): (Vec<Vec<u32>>, Vec<Option<String>>, GenSettings, Kind),
    arrived: Instant,
) -> Result<Response, ApiError> {
    let n = settings.n.max(1);
    // Sequence i is choice i % n of prompt i / n (OpenAI's choice index), a request of its
    // own: placed, admitted and counted as one. A request of several sequences runs at most
    // `window` of them at once (half of what admission lets in), so a large batch waits for
    // room instead of being refused.
    let total = prompts.len() * n;
    let limit = if app.max_inflight > 0 {
        app.max_inflight
    } else {
        app.cluster.capacity()
    };
    let window = if total == 1 {
        1
    } else {
        total.min((limit / 2).max(1))
    };
    // Chat without max_tokens: what fits, up to the default cap. A max_tokens the request
    // gave is checked against the context below, never trimmed.
    if kind == Kind::Chat && settings.max_tokens_defaulted {
        let ctx = app.cluster.context_for(&app.model);
        if let Some(p) = prompts.first() {
            let room = (ctx as usize).saturating_sub(p.len());
            if room > 0 {
                settings.max_tokens = settings.max_tokens.min(room);
            }
        }
    }
    // Every prompt is non-empty and fits the context, or nothing starts: checked
    // before admission, so a request that can never fit is a 400 even when the cluster is full
    // (a 429 would have its client retry it for ever).
    if prompts.iter().any(|p| p.is_empty()) {
        return Err(ApiError::bad("the prompt is empty", Some("prompt")));
    }
    let ctx = app.cluster.context_for(&app.model);
    if ctx > 0 {
        if let Some(p) = prompts
            .iter()
            .find(|p| p.len() + settings.max_tokens > ctx as usize)
        {
            return Err(too_long(p.len(), settings.max_tokens, ctx as usize));
        }
    }
    check_answer_size(prompts.iter().map(Vec::len), &settings)?;
    // The first sequence must be admitted; the window takes as many more places as are free
    // now (at least one, so the rest still run one after another).
    let mut guards: Vec<Inflight> = vec![admit(&app)?];
    // Looked at first: a place taken and given back would read full to a request arriving
    // meanwhile.
    let free = || limit == 0 || (app.metrics.inflight.load(Ordering::Relaxed) as usize) < limit;
    while guards.len() < window && free() {
        match admit(&app) {
            Ok(g) => guards.push(g),
            Err(_) => break,
        }
    }
    let window = guards.len();
    let tp = traceparent(&headers);
    let id = app.next_id(if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    let span = tracing::info_span!("request", request_id = id, traceparent = tp);
    dspark_scheduler::set_parent(&span, &tp);
    // Workers' spans are children of this one (the caller's context when none is exported).
    let tp = Some(dspark_scheduler::traceparent_of(&span))
        .filter(|t| !t.is_empty())
        .unwrap_or(tp);
    // Choice c samples with seed + c (greedy choices are alike, as in vLLM).
    let echo_lps = settings.echo && settings.logprobs.is_some();
    let mut jobs: std::collections::VecDeque<(usize, Job)> = (0..total)
        .map(|i| {
            let mut s = settings.clone();
            s.seed = settings.seed.wrapping_add((i % n) as u64);
            let job = Job {
                prompt: prompts[i / n].clone(),
                settings: s,
                traceparent: tp.clone(),
                request_id: if total > 1 {
                    format!("{id}-{i}")
                } else {
                    id.clone()
                },
                arrived,
            };
            (i, job)
        })
        .collect();
    // The first window is placed and opened together before anything is answered, so a
    // refusal is one HTTP error; a full cluster refuses the request only if not even its
    // first sequence fits, and the others wait for room. Later sequences open as earlier
    // ones finish.
    let first_window: Vec<(usize, Job)> = (0..window).filter_map(|_| jobs.pop_front()).collect();
    let results = futures::future::join_all(first_window.iter().map(|(_, job)| {
        open_fresh(&app, job, settings.max_tokens, echo_lps).instrument(span.clone())
    }))
    .await;
    let mut opened = Vec::with_capacity(window);
    let mut failure = None;
    for ((i, job), r) in first_window.into_iter().zip(results) {
        match r {
            Ok((target, stream, first)) => opened.push((i, job, target, stream, first)),
            // Any sequence a full cluster turned away waits, the first too: which of the
            // window's concurrent placements found the cluster full is a race.
            Err(e) if e.status == StatusCode::TOO_MANY_REQUESTS => {
                jobs.push_back((i, job));
            }
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    // None fit: the first waits a little for room (`--full-wait-ms`) before the request is
    // refused, since the cluster may read full only until the workers' next load reports. (A
    // client that leaves meanwhile drops this handler, and the wait with it.)
    if opened.is_empty() && failure.is_none() && !app.full_wait.is_zero() {
        jobs.make_contiguous().sort_by_key(|(i, _)| *i);
        if let Some((i, job)) = jobs.pop_front() {
            let deadline = Instant::now() + app.full_wait;
            match open_when_room(&app, &job, settings.max_tokens, echo_lps, deadline, || {
                false
            })
            .instrument(span.clone())
            .await
            {
                Ok((target, stream, first)) => opened.push((i, job, target, stream, first)),
                Err(e) if e.status == StatusCode::TOO_MANY_REQUESTS => jobs.push_front((i, job)),
                Err(e) => failure = Some(e),
            }
        }
    }
    if let Some(e) = failure.or_else(|| {
        opened.is_empty().then(|| {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "every target worker is at capacity; retry shortly",
            );
            e.retry_after = Some(1);
            e
        })
    }) {
        // What did open is dropped: the workers cancel it, and its count goes back.
        drop(opened);
        return Err(e);
    }
    // Sequences deferred by a full cluster go in index order.
    jobs.make_contiguous().sort_by_key(|(i, _)| *i);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, Piece)>(64);
    // Permits for the sequences still waiting: the window's own places that did not open
    // (a full cluster turned them away; they wait for room on their own), and one more as each
    // running one ends.
    let room = Arc::new(tokio::sync::Semaphore::new(
        window.saturating_sub(opened.len()).min(jobs.len()),
    ));
    let run = {
        let (app, span, room) = (Arc::clone(&app), span.clone(), Arc::clone(&room));
        move |i: usize,
              job: Job,
              target: WorkerInfo,
              stream: EventStream,
              first: Option<dspark_proto::GenerateEvent>,
              tx: tokio::sync::mpsc::Sender<(usize, Piece)>| {
            let (txi, mut rxi) = tokio::sync::mpsc::channel::<Piece>(64);
            tokio::spawn(
                drive(Arc::clone(&app), job, target, stream, first, txi).instrument(span.clone()),
            );
            let room = Arc::clone(&room);
            // A client that went away closes `rx`: the forwarder stops at once (not at the
            // next piece), `drive` sees its channel closed and drops the worker's stream, which
            // cancels the request there.
            tokio::spawn(async move {
                loop {
                    let p = tokio::select! {
                        p = rxi.recv() => p,
                        _ = tx.closed() => None,
                    };
                    let Some(p) = p else { break };
                    if tx.send((i, p)).await.is_err() {
                        break;
                    }
                }
                room.add_permits(1);
            });
        }
    };
    for (i, job, target, stream, first) in opened {
        run(i, job, target, stream, first, tx.clone());
    }
    if !jobs.is_empty() {
        let (app, tx, room) = (Arc::clone(&app), tx.clone(), Arc::clone(&room));
        let max_tokens = settings.max_tokens;
        tokio::spawn(
            async move {
                while let Some((i, job)) = jobs.pop_front() {
                    // A client that left (or a request that failed) while no sequence runs
                    // gives no permit back: this waits on its channel too, or it waited for
                    // ever, holding the prompts and the request's span open.
                    let permit = tokio::select! {
                        biased;
                        _ = tx.closed() => return,
                        p = room.acquire() => p,
                    };
                    match permit {
                        Ok(p) => p.forget(),
                        Err(_) => return,
                    }
                    // Each opens on its own, so one prefill does not wait for another's.
                    let (app, tx, run) = (Arc::clone(&app), tx.clone(), run.clone());
                    let room = Arc::clone(&room);
                    tokio::spawn(async move {
                        // A full cluster (placement counts lag the workers' reports, other
                        // routers' requests hold room) is waited out, up to a limit.
                        let deadline = Instant::now() + Duration::from_secs(120);
                        let opening =
                            open_when_room(&app, &job, max_tokens, echo_lps, deadline, || {
                                tx.is_closed()
                            });
                        // A client that leaves ends the opening too (it waits for the
                        // worker's prefill).
                        let opened = tokio::select! {
                            biased;
                            _ = tx.closed() => None,
                            o = opening => Some(o),
                        };
                        match opened {
                            Some(Ok((target, stream, first))) => {
                                run(i, job, target, stream, first, tx)
                            }
                            // No sequence started: its place goes back (a running one gives
                            // it back as it ends).
                            Some(Err(e)) => {
                                let _ = tx.send((i, Piece::Error(e))).await;
                                room.add_permits(1);
                            }
                            None => room.add_permits(1),
                        }
                    });
                }
            }
            .instrument(span.clone()),
        );
    }
    drop(tx);
    let created = now_s();
    let model = app.name.clone();
    let object = if kind == Kind::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    let echoes: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if !settings.echo {
                String::new()
            } else if let Some(Some(t)) = texts.get(i) {
                t.clone()
            } else {
                app.tok.decode(p, false).unwrap_or_default()
            }
        })
        .collect();
    let prompt_tokens: u32 = prompts.iter().map(|p| p.len() as u32).sum();
    // A forced function call per choice, with an id as OpenAI's.
    let call_ids: Vec<String> = (0..total).map(|_| new_call_id()).collect();
    if !settings.stream {
        let mut text = vec![String::new(); total];
        let mut ids: Vec<Vec<u32>> = vec![Vec::new(); total];
        let mut lps: Vec<Vec<dspark_proto::TokenLogprob>> = vec![Vec::new(); total];
        let mut plps: Vec<Vec<dspark_proto::TokenLogprob>> = vec![Vec::new(); total];
        let mut ends: Vec<Option<(String, SpecStats, String)>> = vec![None; total];
        let mut tally = Tally::new(&app, n, &prompts, settings.score_only);
        while let Some((i, p)) = rx.recv().await {
            match p {
                Piece::Text(t, d, l, pl) => {
                    tally.tokens[i] += d.len();
                    plps[i].extend(pl);
                    if !settings.score_only {
                        text[i].push_str(&t);
                        ids[i].extend(d);
                        lps[i].extend(l);
                    }
                }
                Piece::Done {
                    reason,
                    stats,
                    target,
                } => {
                    tally.done[i] = Some(stats.clone());
                    ends[i] = Some((reason, stats, target));
                }
                Piece::Error(e) => return Err(e),
            }
        }
        let ends: Vec<(String, SpecStats, String)> =
            ends.into_iter().collect::<Option<_>>().ok_or_else(|| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "generation ended early",
                )
            })?;
        let stats = combine(
            ends.iter().map(|e| &e.1),
            n,
            prompt_tokens,
            settings.score_only,
        );
        tally.settle(&stats);
        let choices: Vec<Value> = (0..total)
            .map(|i| {
                let reason = if settings.score_only {
                    "length"
                } else {
                    finish(&ends[i].0)
                };
                let mut choice = if let Some(f) = &settings.tool_call {
                    let reason = call_finish(reason, &text[i]);
                    json!({"index": i, "message": {"role": "assistant", "content": null,
                        "tool_calls": [{"id": call_ids[i], "type": "function",
                            "function": {"name": f, "arguments": text[i]}}]},
                        "finish_reason": reason, "logprobs": null})
                } else if let (Kind::Chat, Some(tools)) = (kind, &settings.auto_tools) {
                    let (content, calls) = tool_parser::parse(&text[i], tools);
                    let mut message = json!({"role": "assistant", "content": content});
                    let reason = if calls.is_empty() {
                        reason
                    } else {
                        message["tool_calls"] = calls
                            .iter()
                            .map(|c| json!({"id": new_call_id(), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}))
                            .collect();
                        if reason == "stop" { "tool_calls" } else { reason }
                    };
                    json!({"index": i, "message": message, "finish_reason": reason, "logprobs": null})
                } else if kind == Kind::Chat {
                    json!({"index": i, "message": {"role": "assistant", "content": text[i]}, "finish_reason": reason, "logprobs": null})
                } else {
                    json!({"index": i, "text": format!("{}{}", echoes[i / n], text[i]), "finish_reason": reason, "logprobs": null})
                };
                if settings.return_token_ids {
                    choice["token_ids"] = json!(ids[i]);
                }
                if settings.logprobs.is_some() {
                    let echoed = settings.echo.then_some((&prompts[i / n][..], &plps[i][..]));
                    choice["logprobs"] =
                        logprobs_json(&app.tok, kind, &ids[i], &lps[i], 0, echoed);
                }
                choice
            })
            .collect();
        drop(guards);
        let mut r = Json(
            json!({"id": id, "object": object, "created": created, "model": model,
            "choices": choices, "usage": usage(&stats, &ends[0].2)}),
        )
        .into_response();
        if let Ok(v) = tp.parse()
            && !tp.is_empty()
        {
            r.headers_mut().insert("traceparent", v);
        }
        return Ok(r);
    }
    let chunk_obj = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let include_usage = settings.include_usage;
    let continuous_usage = settings.continuous_usage;
    let return_ids = settings.return_token_ids;
    let want_logprobs = settings.logprobs.is_some();
    let (echo, score_only) = (settings.echo, settings.score_only);
    let tool_call = settings.tool_call.clone();
    // `tool_choice: "auto"`: each choice's text goes through a parser that holds back what
    // may be a call.
    let mut parsers: Vec<Option<tool_parser::Stream>> = (0..total)
        .map(|_| {
            settings
                .auto_tools
                .clone()
                .filter(|_| kind == Kind::Chat)
                .map(tool_parser::Stream::new)
        })
        .collect();
    let app2 = Arc::clone(&app);
    let s = async_stream(move |out, read| async move {
        let _guards = guards;
        // Every event goes out through here: a client that stopped reading ends the request
        // (`return` drops its guards and the pieces' channel, which cancels the workers' side)
        // once one send waits past the limit. A client that left is noticed where it matters.
        let limit = app2.client_write_timeout;
        macro_rules! send {
            ($ev:expr) => {
                match send_to_client(&out, &read, $ev, limit).await {
                    Sent::Stalled => {
                        client_stalled(&app2, &id, limit);
                        return;
                    }
                    sent => sent,
                }
            };
        }
        // As OpenAI's chunks: every choice carries `logprobs` (null when not asked for), and
        // with `include_usage` every chunk carries `usage`, null until the last.
        let mk = |mut choices: Value, usage: Value| {
            if let Some(cs) = choices.as_array_mut() {
                for c in cs.iter_mut().filter_map(|c| c.as_object_mut()) {
                    c.entry("logprobs").or_insert(Value::Null);
                }
            }
            let mut v = json!({"id": id, "object": chunk_obj, "created": created, "model": model, "choices": choices});
            if include_usage || !usage.is_null() {
                v["usage"] = usage;
            }
            v.to_string()
        };
        // Per choice: its completion tokens so far (`continuous_usage_stats`, which reports
        // each chunk's choice with its prompt, as vLLM's).
        let mut completed = vec![0usize; total];
        let so_far = |i: usize, completed: &[usize]| {
            if continuous_usage {
                let (p, c) = (prompts[i / n].len(), completed[i]);
                json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
            } else {
                Value::Null
            }
        };
        if kind == Kind::Chat {
            for i in 0..total {
                // A forced call opens with its id and name; its arguments follow as deltas.
                let delta = match &tool_call {
                    Some(f) => json!({"role": "assistant", "content": null, "tool_calls": [
                        {"index": 0, "id": call_ids[i], "type": "function",
                         "function": {"name": f, "arguments": ""}}]}),
                    None => json!({"role": "assistant", "content": ""}),
                };
                send!(mk(
                    json!([{"index": i, "delta": delta, "finish_reason": null}]),
                    so_far(i, &completed),
                ));
            }
        }
        // Per choice: text offset of its next token (completions' `text_offset`).
        let mut offset = vec![0usize; total];
        // Per choice: a forced call's arguments so far.
        let mut args = vec![String::new(); total];
        let mut ends: Vec<Option<(SpecStats, String)>> = vec![None; total];
        let mut echoed = vec![!echo; total];
        // Counted however the stream ends (a client that left, a failed choice): whole, or
        // as far as it got.
        let mut tally = Tally::new(&app2, n, &prompts, score_only);
        loop {
            // A client that leaves is noticed at once, not at the next chunk sent: text held
            // back (a tool call being written, a possible stop string) sends none for a while.
            let next = tokio::select! {
                p = rx.recv() => p,
                _ = out.closed() => None,
            };
            let Some((i, p)) = next else { break };
            match p {
                Piece::Text(mut t, mut ids, mut lps, plps) => {
                    tally.tokens[i] += ids.len();
                    if score_only {
                        (t, ids, lps) = (String::new(), Vec::new(), Vec::new());
                    }
                    completed[i] += ids.len();
                    // The echoed prompt leads the choice's first chunk.
                    let lead = (!echoed[i]).then(|| {
                        echoed[i] = true;
                        (&prompts[i / n][..], plps)
                    });
                    if lead.is_some() {
                        t.insert_str(0, &echoes[i / n]);
                    }
                    // Calls parsed out of the text go out as their own chunks.
                    let mut calls = Vec::new();
                    let mut first_call = 0;
                    if let Some(p) = parsers[i].as_mut() {
                        first_call = p.calls;
                        let mut content = String::new();
                        for o in p.push(&t) {
                            match o {
                                tool_parser::Out::Content(c) => content.push_str(&c),
                                tool_parser::Out::Call(c) => calls.push(c),
                            }
                        }
                        t = content;
                    }
                    // They follow the piece's content (which precedes them in the text).
                    let call_chunks: Vec<Value> = calls
                        .into_iter()
                        .enumerate()
                        .map(|(j, c)| {
                            json!([{"index": i, "delta": {"tool_calls": [
                                {"index": first_call + j, "id": new_call_id(), "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}}]},
                                "finish_reason": null}])
                        })
                        .collect();
                    if t.is_empty() && !return_ids && !(want_logprobs && !ids.is_empty()) {
                        for chunk in call_chunks {
                            if send!(mk(chunk, so_far(i, &completed))) != Sent::Ok {
                                return;
                            }
                        }
                        continue;
                    }
                    let mut c = if tool_call.is_some() {
                        args[i].push_str(&t);
                        json!([{"index": i, "delta": {"tool_calls": [
                            {"index": 0, "function": {"arguments": t}}]}, "finish_reason": null}])
                    } else if kind == Kind::Chat {
                        json!([{"index": i, "delta": {"content": t}, "finish_reason": null}])
                    } else {
                        json!([{"index": i, "text": t, "finish_reason": null, "logprobs": null}])
                    };
                    if return_ids {
                        c[0]["token_ids"] = json!(ids);
                    }
                    if want_logprobs {
                        let lead_ids: &[u32] = lead.as_ref().map_or(&[], |l| l.0);
                        let lead = lead.as_ref().map(|(p, l)| (&p[..], &l[..]));
                        c[0]["logprobs"] =
                            logprobs_json(&app2.tok, kind, &ids, &lps, offset[i], lead);
                        offset[i] += lead_ids
                            .iter()
                            .chain(&ids)
                            .map(|&t| token_chars(&app2.tok, t))
                            .sum::<usize>();
                    }
                    if send!(mk(c, so_far(i, &completed))) != Sent::Ok {
                        return;
                    }
                    for chunk in call_chunks {
                        if send!(mk(chunk, so_far(i, &completed))) != Sent::Ok {
                            return;
                        }
                    }
                }
                Piece::Done {
                    reason,
                    stats,
                    target,
                } => {
                    // What a parser held back is text after all.
                    let held: String = parsers[i]
                        .as_mut()
                        .map(|p| {
                            p.finish()
                                .into_iter()
                                .filter_map(|o| match o {
                                    tool_parser::Out::Content(c) => Some(c),
                                    tool_parser::Out::Call(_) => None,
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    if !held.is_empty() {
                        let c = json!([{"index": i, "delta": {"content": held}, "finish_reason": null}]);
                        send!(mk(c, so_far(i, &completed)));
                    }
                    let called = parsers[i].as_ref().is_some_and(|p| p.calls > 0);
                    let reason = match (score_only, finish(&reason)) {
                        (true, _) => "length",
                        (_, r) if tool_call.is_some() => call_finish(r, &args[i]),
                        (_, "stop") if called => "tool_calls",
                        (_, r) => r,
                    };
                    if !echoed[i] {
                        // A choice that ended before any token (the end of sequence first)
                        // still leads with its prompt, as its non-streamed answer does.
                        echoed[i] = true;
                        let mut c = json!([{"index": i, "text": echoes[i / n],
                                            "finish_reason": null, "logprobs": null}]);
                        if return_ids {
                            c[0]["token_ids"] = json!([]);
                        }
                        if want_logprobs {
                            let lead = Some((&prompts[i / n][..], &[][..]));
                            c[0]["logprobs"] =
                                logprobs_json(&app2.tok, kind, &[], &[], offset[i], lead);
                        }
                        send!(mk(c, so_far(i, &completed)));
                    }
                    let c = if kind == Kind::Chat {
                        json!([{"index": i, "delta": {}, "finish_reason": reason}])
                    } else {
                        json!([{"index": i, "text": "", "finish_reason": reason, "logprobs": null}])
                    };
                    tally.done[i] = Some(stats.clone());
                    send!(mk(c, so_far(i, &completed)));
                    ends[i] = Some((stats, target));
                    if ends.iter().all(|e| e.is_some()) {
                        let stats = combine(
                            ends.iter().flatten().map(|e| &e.0),
                            n,
                            prompt_tokens,
                            score_only,
                        );
                        tally.settle(&stats);
                        if include_usage {
                            let target = ends[0].as_ref().map(|e| e.1.clone()).unwrap_or_default();
                            send!(mk(json!([]), usage(&stats, &target)));
                        }
                    }
                }
                Piece::Error(e) => {
                    Metrics::add(&app2.metrics.errors, 1);
                    send!(e.body().to_string());
                    break;
                }
            }
        }
        send!("[DONE]".to_string());
    });
    let mut r = Sse::new(s).keep_alive(KeepAlive::default()).into_response();
    if let Ok(v) = tp.parse()
        && !tp.is_empty()
    {
        r.headers_mut().insert("traceparent", v);
    }
    Ok(r)
}

/// What a send to a streaming client came to.
#[derive(PartialEq)]
enum Sent {
    Ok,
    /// The client closed the connection.
    Gone,
    /// The client is there but read nothing for the whole limit.
    Stalled,
}

/// A send waits while the client keeps taking events: it is stalled only when the response
/// took none for the whole limit (one large event, a long prompt's log-probabilities, may take
/// a slow reader a while, and the events behind it wait meanwhile).
/// The limit also grows by the time the largest event of the stream takes at
/// [`SLOW_CLIENT_BYTES_PER_S`]: while the response writes it out it takes no other.
async fn send_to_client(
    out: &tokio::sync::mpsc::Sender<Event>,
    read: &ClientRead,
    data: String,
    limit: Duration,
) -> Sent {
    let largest = read
        .largest
        .fetch_max(data.len() as u64, std::sync::atomic::Ordering::Relaxed)
        .max(data.len() as u64);
    let limit = limit + Duration::from_secs_f64(largest as f64 / SLOW_CLIENT_BYTES_PER_S);
    let permit = loop {
        match tokio::time::timeout(limit, out.reserve()).await {
            Ok(Ok(p)) => break p,
            Ok(Err(_)) => return Sent::Gone,
            Err(_) if read.since() < limit => continue,
            Err(_) => return Sent::Stalled,
        }
    };
    permit.send(Event::default().data(data));
    Sent::Ok
}

/// The slowest reading speed a streaming client is granted for a large event before it counts
/// as stalled.
const SLOW_CLIENT_BYTES_PER_S: f64 = 64.0 * 1024.0;

/// When the response last took an event from its stream (the client reading).
struct ClientRead {
    base: Instant,
    /// Milliseconds since `base`.
    at: AtomicU64,
    /// Bytes of the largest event sent.
    largest: AtomicU64,
}

impl ClientRead {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            at: AtomicU64::new(0),
            largest: AtomicU64::new(0),
        }
    }

    fn now(&self) {
        self.at.store(
            self.base.elapsed().as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    fn since(&self) -> Duration {
        let at = Duration::from_millis(self.at.load(std::sync::atomic::Ordering::Relaxed));
        self.base.elapsed().saturating_sub(at)
    }
}

/// A stream ended because its client stopped reading: counted as an error (the request did
/// not finish), and said why.
fn client_stalled(app: &App, id: &str, limit: Duration) {
    Metrics::add(&app.metrics.errors, 1);
    tracing::warn!(
        request_id = id,
        "client read nothing for {} ms; ending the stream and releasing its places",
        limit.as_millis()
    );
}

/// Usage of a request's sequences together (in index order, `n` choices per prompt): each
/// prompt counted once (`prompt_tokens` in all) with what its first choice found cached,
/// the rest summed; a scored-only echo generated nothing.
fn combine<'a>(
    all: impl Iterator<Item = &'a SpecStats>,
    n: usize,
    prompt_tokens: u32,
    score_only: bool,
) -> SpecStats {
    let mut out = SpecStats::default();
    let mut cached = 0;
    for (i, s) in all.enumerate() {
        if i == 0 {
            out = s.clone();
        } else {
            merge(&mut out, s);
            out.completion_tokens += s.completion_tokens;
        }
        if i % n.max(1) == 0 {
            cached += s.cached_tokens;
        }
    }
    out.prompt_tokens = prompt_tokens;
    out.cached_tokens = cached;
    if score_only {
        out.completion_tokens = 0;
    }
    out
}

/// A token as text: its bytes, with any part of a UTF-8 character as U+FFFD.
fn token_text(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&tok.token_bytes(id)).into_owned()
}

/// A token's length in `text_offset`: the characters of its text (`tokens[i]`), as OpenAI's
/// and vLLM's offsets count (Python string indices), not bytes; part of a character counts
/// as the one U+FFFD it shows as.
fn token_chars(tok: &Tokenizer, id: u32) -> usize {
    String::from_utf8_lossy(&tok.token_bytes(id))
        .chars()
        .count()
}

/// The `logprobs` of a choice (or chunk) for `ids`: chat's `{"content": [{token, logprob,
/// bytes, top_logprobs}]}` or completions' `{tokens, token_logprobs, top_logprobs,
/// text_offset}` with offsets counted from `offset`, led by the echoed prompt's tokens when
/// `echoed` holds them and their log-probabilities (from the second token on; the first has
/// none).
fn logprobs_json(
    tok: &Tokenizer,
    kind: Kind,
    ids: &[u32],
    lps: &[dspark_proto::TokenLogprob],
    offset: usize,
    echoed: Option<(&[u32], &[dspark_proto::TokenLogprob])>,
) -> Value {
    let entry = |id: u32, lp: f32| {
        let b = tok.token_bytes(id);
        json!({"token": String::from_utf8_lossy(&b), "logprob": lp, "bytes": b})
    };
    let pairs = |l: &dspark_proto::TokenLogprob| {
        l.top_ids
            .iter()
            .zip(&l.top_logprobs)
            .map(|(&i, &p)| (i, p))
            .collect::<Vec<_>>()
    };
    if kind == Kind::Chat {
        let content: Vec<Value> = ids
            .iter()
            .zip(lps)
            .map(|(&id, l)| {
                let mut e = entry(id, l.logprob);
                e["top_logprobs"] = pairs(l).into_iter().map(|(i, p)| entry(i, p)).collect();
                e
            })
            .collect();
        json!({ "content": content })
    } else {
        let (pids, plps) = echoed.unwrap_or((&[], &[]));
        // Prompt tokens after the first have one each (when they were computed).
        let plps: Vec<Option<&dspark_proto::TokenLogprob>> = (0..pids.len())
            .map(|k| k.checked_sub(1).and_then(|k| plps.get(k)))
            .collect();
        let all_ids = pids.iter().chain(ids.iter().take(lps.len()));
        let all_lps = plps.into_iter().chain(lps.iter().map(Some));
        let (mut at, mut tokens, mut offsets, mut values, mut top) =
            (offset, Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (&id, l) in all_ids.zip(all_lps) {
            // Offsets in characters of the tokens' texts (see `token_chars`).
            let t = String::from_utf8_lossy(&tok.token_bytes(id)).into_owned();
            offsets.push(at);
            at += t.chars().count();
            tokens.push(t);
            values.push(l.map_or(Value::Null, |l| json!(l.logprob)));
            top.push(l.map_or(Value::Null, |l| {
                let mut m = serde_json::Map::new();
                for (i, p) in pairs(l) {
                    m.insert(token_text(tok, i), json!(p));
                }
                // As vLLM's: the token itself is always among them (N + 1 entries when it is
                // not in the top N; `logprobs: 0` gives just it).
                m.entry(token_text(tok, id)).or_insert(json!(l.logprob));
                Value::Object(m)
            }));
        }
        json!({
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}

/// A forced call's finish reason: `tool_calls` once its arguments are a whole document (a
/// stop string or the length limit can cut them; then the reason says so).
fn call_finish(reason: &'static str, arguments: &str) -> &'static str {
    if reason == "stop" && serde_json::from_str::<Value>(arguments).is_ok() {
        "tool_calls"
    } else {
        reason
    }
}

fn finish(reason: &str) -> &'static str {
    match reason {
        "length" => "length",
        _ => "stop",
    }
}

/// A request's tokens, counted into the router's counters once: whole when its answer is
/// complete ([`Tally::settle`]), or, dropped unsettled (a client that left, a choice that
/// failed), as far as it got: the prompt, each ended choice's usage, the others' tokens sent.
/// Counted only for answers complete, the counters missed every request cut short, which the
/// workers count.
struct Tally {
    app: Arc<App>,
    n: usize,
    /// Per prompt: its tokens (counted, cut short, only where one of its choices started).
    prompts: Vec<u32>,
    score_only: bool,
    /// Per choice: tokens received.
    tokens: Vec<usize>,
    /// Per choice: its usage, once it ended.
    done: Vec<Option<SpecStats>>,
    settled: bool,
}

impl Tally {
    fn new(app: &Arc<App>, n: usize, prompts: &[Vec<u32>], score_only: bool) -> Self {
        let total = prompts.len() * n;
        Self {
            app: Arc::clone(app),
            n,
            prompts: prompts.iter().map(|p| p.len() as u32).collect(),
            score_only,
            tokens: vec![0; total],
            done: vec![None; total],
            settled: false,
        }
    }

    /// Counts the complete answer's usage.
    fn settle(&mut self, stats: &SpecStats) {
        account(&self.app, stats);
        self.settled = true;
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let ended: Vec<SpecStats> = self
            .done
            .iter()
            .zip(&self.tokens)
            .map(|(d, &t)| {
                d.clone().unwrap_or_else(|| SpecStats {
                    completion_tokens: t as u32,
                    ..Default::default()
                })
            })
            .collect();
        // A prompt none of whose choices started (a later sequence refused a place) was
        // never prefilled.
        let n = self.n.max(1);
        let prompt_tokens = self
            .prompts
            .iter()
            .enumerate()
            .filter(|(p, _)| {
                (p * n..(p + 1) * n).any(|i| self.tokens[i] > 0 || self.done[i].is_some())
            })
            .map(|(_, &len)| len)
            .sum();
        let s = combine(ended.iter(), self.n, prompt_tokens, self.score_only);
        account(&self.app, &s);
    }
}

fn account(app: &App, s: &SpecStats) {
    let m = &app.metrics;
    Metrics::add(&m.prompt_tokens, s.prompt_tokens as u64);
    Metrics::add(&m.cached_prompt_tokens, s.cached_tokens as u64);
    Metrics::add(&m.completion_tokens, s.completion_tokens as u64);
    Metrics::add(&m.drafted, s.drafted_tokens as u64);
    Metrics::add(&m.accepted, s.accepted_tokens as u64);
    Metrics::add(&m.forwards, s.verify_forwards as u64);
}

/// A stream of SSE events fed by an async producer, which learns when the response last took
/// one.
fn async_stream<F, Fut>(
    f: F,
) -> impl tokio_stream::Stream<Item = Result<Event, std::convert::Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Event>, Arc<ClientRead>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let read = Arc::new(ClientRead::new());
    tokio::spawn(f(tx, Arc::clone(&read)));
    tokio_stream::wrappers::ReceiverStream::new(rx).map(move |e| {
        read.now();
        Ok(e)
    })
}

#[cfg(test)]
mod tests {
    use super::{
        MAX_BODY, call_finish, check_answer_size, check_token_limits, combine, json_errors,
        render_kept_apart, splice_texts, tokens_per_forward, whole_before_break,
    };
    use dspark_proto::SpecStats;
    use std::time::{Duration, Instant};

    /// An idle kept-alive connection outlives a proxy's idle upstream connections (60 s for
    /// ingress-nginx and AWS ALB) by default: the proxy closes first, never sending a request
    /// on a connection the router is closing (a 502 for its client).
    #[test]
    fn idle_connections_outlive_a_proxys_by_default() {
        use clap::Parser;
        let a = super::RouterArgs::try_parse_from(["dspark-router"]).expect("defaults");
        assert!(a.idle_timeout_s > 60, "{}", a.idle_timeout_s);
    }

    /// The default templating: the assistant's turn opened, no kwargs.
    fn opened() -> crate::openai::Templating {
        crate::openai::Templating {
            add_generation_prompt: true,
            ..Default::default()
        }
    }

    /// Two choices of 10 tokens, each from its prefill and 9 verify forwards: one token per
    /// forward, not (20 − 1)/18.
    #[tokio::test]
    async fn a_stream_with_a_large_event_waits_longer_for_its_client() {
        use super::{ClientRead, Sent, send_to_client};
        let limit = Duration::from_millis(100);
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let read = ClientRead::new();
        assert!(send_to_client(&tx, &read, "a".into(), limit).await == Sent::Ok);
        // Nothing read: a small event stalls after the limit.
        let t0 = Instant::now();
        assert!(send_to_client(&tx, &read, "b".into(), limit).await == Sent::Stalled);
        assert!(t0.elapsed() >= limit);
        // After a 64 KiB event the client has a second more to take the next.
        let (tx, mut rx2) = tokio::sync::mpsc::channel(1);
        let read = ClientRead::new();
        let big = "x".repeat(64 * 1024);
        assert!(send_to_client(&tx, &read, big, limit).await == Sent::Ok);
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let got = rx2.recv().await;
            // Open until the send is through.
            (got, rx2)
        });
        assert!(send_to_client(&tx, &read, "c".into(), limit).await == Sent::Ok);
        assert!(reader.await.expect("joined").0.is_some());
        rx.close();
    }

    #[test]
    fn token_limits_are_checked_at_start() {
        assert!(check_token_limits(16, 4096).is_ok());
        assert!(check_token_limits(4096, 4096).is_ok());
        let e = check_token_limits(0, 4096).unwrap_err();
        assert!(e.contains("--default-max-tokens 0"), "{e}");
        let e = check_token_limits(5000, 4096).unwrap_err();
        assert!(e.contains("1..=4096"), "{e}");
        let e = check_token_limits(16, 0).unwrap_err();
        assert!(e.contains("--max-tokens-limit 0"), "{e}");
    }

    #[test]
    fn tokens_per_forward_leave_out_every_sequence_s_first_token() {
        let one = SpecStats {
            completion_tokens: 10,
            verify_forwards: 9,
            first_tokens: 1,
            ..Default::default()
        };
        let both = combine([&one, &one].into_iter(), 2, 5, false);
        assert_eq!(both.first_tokens, 2);
        assert_eq!(tokens_per_forward(&both), 1.0);
        // A worker that reports no first tokens: one per answer.
        let old = SpecStats {
            first_tokens: 0,
            ..one
        };
        assert_eq!(tokens_per_forward(&old), 1.0);
    }

    use axum::body::{Body, Bytes};
    use axum::http::{Request, StatusCode};
    use axum::routing::post;
    use tower::ServiceExt;

    /// A message with a control-token string is kept apart where the template writes it as
    /// it is, and refused where the template trims or escapes it.
    #[test]
    fn messages_with_control_tokens_are_kept_apart_or_refused() {
        use dspark_runtime::chat::{ChatTemplate, Message};
        let special = |t: &str| t.contains("<|im_end|>");
        let verbatim = ChatTemplate::new(
            "<|im_start|>system\nS<|im_end|>\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let conv = vec![
            Message::new("user", "<|im_end|>"),
            Message::new("user", "hi"),
        ];
        let (text, spans) = render_kept_apart(&verbatim, conv, None, &opened(), special).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<|im_end|><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
        assert_eq!(spans, vec![48..58]);
        assert_eq!(&text[spans[0].clone()], "<|im_end|>");
        for t in ["{{ m.content | trim }}", "{{ m.content | tojson }}"] {
            let tpl = ChatTemplate::new(
                &format!("{{% for m in messages %}}<|im_start|>{{{{ m.role }}}}\n{t}<|im_end|>{{% endfor %}}"),
                "",
                "",
            )
            .unwrap();
            let conv = vec![Message::new("user", " a\"<|im_end|> ")];
            assert!(
                render_kept_apart(&tpl, conv, None, &opened(), special).is_err(),
                "{t}"
            );
            // Without a control token, nothing is held and any template renders.
            let conv = vec![Message::new("user", " plain ")];
            assert!(
                render_kept_apart(&tpl, conv, None, &opened(), special).is_ok(),
                "{t}"
            );
        }
    }

    /// Each held text goes where its marker is, its span recorded; a marker missing or
    /// written twice is refused. (A user's `<|im_end|>` could otherwise be matched against the
    /// template's own system turn.)
    #[test]
    fn held_texts_go_where_their_markers_are() {
        let held = vec![
            ("#A#".to_string(), "<|im_end|>".to_string()),
            ("#B#".to_string(), "x<|im_end|>y".to_string()),
        ];
        let rendered = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n#B#<|im_end|>\n<|im_start|>user\n#A#<|im_end|>\n";
        let (text, spans) = splice_texts(rendered, &held).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nx<|im_end|>y<|im_end|>\n<|im_start|>user\n<|im_end|><|im_end|>\n"
        );
        assert_eq!(spans.len(), 2);
        assert_eq!(&text[spans[0].clone()], "x<|im_end|>y");
        assert_eq!(&text[spans[1].clone()], "<|im_end|>");
        assert!(spans[0].start > text.find("S<|im_end|>").unwrap());
        assert!(splice_texts("#A# and #A#", &held[..1]).is_err());
        assert!(splice_texts("none here", &held[..1]).is_err());
        assert_eq!(
            splice_texts("plain", &[]).unwrap(),
            ("plain".to_string(), vec![])
        );
    }

    /// Thousands of held texts splice in one pass, each where its marker is (markers of one
    /// width, as `render_kept_apart` writes them); a marker written twice is still refused.
    #[test]
    fn many_held_texts_splice_in_one_pass() {
        let n = 4096;
        let held: Vec<(String, String)> = (0..n)
            .map(|k| {
                (
                    format!("\u{E000}00ab-{k:016x}\u{E001}"),
                    format!("<|im_end|>{k}"),
                )
            })
            .collect();
        // A long prompt before the markers: a scan of it per marker would be 16 GB.
        let filler = "x".repeat(4 << 20);
        let rendered: String = std::iter::once(filler.clone())
            .chain(held.iter().rev().map(|(m, _)| format!("u:{m};")))
            .collect();
        let started = std::time::Instant::now();
        let (text, spans) = splice_texts(&rendered, &held).unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        assert_eq!(spans.len(), n);
        assert_eq!(&text[spans[0].clone()], format!("<|im_end|>{}", n - 1));
        assert_eq!(&text[spans[n - 1].clone()], "<|im_end|>0");
        assert!(text.starts_with(&filler));
        assert!(!text.contains('\u{E000}'));
        let twice = format!("{rendered}{}", held[7].0);
        assert!(splice_texts(&twice, &held).is_err());
    }

    /// The answer's size is refused before admission: more than 256 sequences always, more
    /// than 4M log-probability entries unless streamed; plain text is not counted as entries.
    #[test]
    fn an_answer_too_large_to_hold_is_refused() {
        let settings = |v: serde_json::Value| {
            let r: crate::openai::CompletionRequest = serde_json::from_value(v).unwrap();
            r.common.settings(16, 4096, 1000).unwrap()
        };
        let s = settings(serde_json::json!({"n": 16, "max_tokens": 1}));
        assert!(check_answer_size([3; 16].into_iter(), &s).is_ok());
        let e = check_answer_size([3; 17].into_iter(), &s).unwrap_err();
        assert_eq!(e.param, Some("n"));
        // 256 sequences × (1000 echoed + 4000) × 21: 26.9M entries.
        let big = serde_json::json!({"n": 16, "max_tokens": 4000, "echo": true, "logprobs": 20});
        let e = check_answer_size([1000; 16].into_iter(), &settings(big.clone())).unwrap_err();
        assert_eq!(e.param, Some("logprobs"));
        assert!(e.message.contains("stream"), "{}", e.message);
        let mut streamed = big.clone();
        streamed["stream"] = serde_json::json!(true);
        assert!(check_answer_size([1000; 16].into_iter(), &settings(streamed)).is_ok());
        // Just under the budget: 16 × 1 × (1000 + 4000) × 21 = 1.68M.
        let mut one = big.clone();
        one["n"] = serde_json::json!(1);
        assert!(check_answer_size([1000; 16].into_iter(), &settings(one)).is_ok());
        let plain = serde_json::json!({"n": 16, "max_tokens": 4096});
        assert!(check_answer_size([10; 16].into_iter(), &settings(plain)).is_ok());
    }

    /// A stream that breaks after the chunk that said "stop" ends the answer there; one that
    /// breaks with tokens still to come resumes elsewhere.
    #[test]
    fn a_stream_broken_after_its_last_chunk_is_not_resumed() {
        assert_eq!(whole_before_break(Some("stop"), 7).as_deref(), Some("stop"));
        assert_eq!(
            whole_before_break(Some("length"), 0).as_deref(),
            Some("length")
        );
        assert_eq!(whole_before_break(None, 0).as_deref(), Some("length"));
        assert_eq!(whole_before_break(None, 7), None);
    }

    /// axum's own rejections (wrong method, body over the limit) leave as JSON errors with
    /// their status and `Allow`; a handler's JSON error and a success pass untouched.
    #[tokio::test]
    async fn errors_axum_answers_itself_carry_the_openai_error_body() {
        let app = axum::Router::new()
            .route("/echo", post(|b: Bytes| async move { b }))
            .route(
                "/teapot",
                post(|| async { (StatusCode::IM_A_TEAPOT, "short and stout") }),
            )
            .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
            .layer(axum::middleware::from_fn(json_errors));
        let send = |req: Request<Body>| {
            let app = app.clone();
            async move {
                let r = app.oneshot(req).await.expect("infallible");
                let status = r.status();
                let allow = r.headers().get("allow").cloned();
                let ctype = r.headers().get("content-type").cloned();
                let body = axum::body::to_bytes(r.into_body(), 1 << 20)
                    .await
                    .expect("body");
                (status, allow, ctype, body)
            }
        };
        let json = |b: &Bytes| -> serde_json::Value {
            serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {b:?}"))
        };

        let req = Request::get("/echo").body(Body::empty()).expect("request");
        let (st, allow, _, body) = send(req).await;
        assert_eq!(st, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(allow.as_ref().and_then(|v| v.to_str().ok()), Some("POST"));
        let v = json(&body);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let m = v["error"]["message"].as_str().unwrap_or("");
        assert!(m.contains("GET"), "{v}");

        let req = Request::post("/echo")
            .body(Body::from(vec![b'a'; MAX_BODY + 1]))
            .expect("request");
        let (st, _, _, body) = send(req).await;
        assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
        let v = json(&body);
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(&MAX_BODY.to_string())),
            "{v}"
        );

        // Some other plain-text error keeps its words.
        let req = Request::post("/teapot")
            .body(Body::empty())
            .expect("request");
        let (st, _, _, body) = send(req).await;
        assert_eq!(st, StatusCode::IM_A_TEAPOT);
        assert_eq!(json(&body)["error"]["message"], "short and stout");

        // A success is not touched.
        let req = Request::post("/echo")
            .body(Body::from("hi"))
            .expect("request");
        let (st, _, ctype, body) = send(req).await;
        assert_eq!(st, StatusCode::OK);
        assert!(ctype.is_none_or(|v| !v.as_bytes().starts_with(b"application/json")));
        assert_eq!(&body[..], b"hi");
    }

    #[test]
    fn a_call_finishes_as_tool_calls_only_when_its_arguments_are_whole() {
        assert_eq!(call_finish("stop", "\n{\"city\": \"Paris\"}"), "tool_calls");
        // Cut by a stop string: the arguments do not parse, the reason says stop.
        assert_eq!(call_finish("stop", "{\"city\": \"Par"), "stop");
        assert_eq!(call_finish("length", "{\"city\": \"Paris\"}"), "length");
    }
}
