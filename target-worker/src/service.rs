//! `dspark.v1.TargetWorker`: validates a request, hands it to the engine thread, streams back.

use crate::engine_loop::Cmd;
use dspark_proto::target_worker_server::TargetWorker;
use dspark_proto::{GenerateEvent, GenerateRequest, InfoRequest, WorkerInfo};
use dspark_runtime::json::Format;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub struct TargetService {
    /// Central / local budget step counters (scheduler policy only).
    pub counters: Option<(
        Arc<std::sync::atomic::AtomicU64>,
        Arc<std::sync::atomic::AtomicU64>,
    )>,
    pub cmds: Mutex<std::sync::mpsc::Sender<Cmd>>,
    pub info: WorkerInfo,
    /// Requests taken and not yet ended, counted here, before the engine thread adds them
    /// (that waits for its current step): the load reports placement relies on.
    pub load: Arc<AtomicUsize>,
    /// Tells the registrar the load changed (the report comes before the next heartbeat).
    pub room: dspark_scheduler::discovery::Nudge,
    pub next_id: AtomicU64,
    pub vocab: usize,
    pub max_ctx: usize,
    /// Draft worker for requests placement did not pair (from --draft-worker).
    pub default_draft: Option<String>,
    /// Requests running and queued at most (`--max-running` + `--max-queued`); a request past
    /// it is refused unless the router admitted it before (a failover).
    pub max_requests: usize,
    /// Formats compiled for earlier requests.
    pub formats: FormatCache,
    /// Requests never go to a remote drafter (the drafter runs in-process).
    pub local_drafting: bool,
    /// Set once a stop was asked for: new requests are refused (`UNAVAILABLE`, which the router
    /// places elsewhere) while the ones in flight finish.
    pub draining: Arc<AtomicBool>,
    /// Generate streams open now (what a drain waits for).
    pub streams: Arc<AtomicUsize>,
}

/// Counts an open Generate stream until the stream is dropped (finished, or its caller gone).
struct StreamGuard(Arc<AtomicUsize>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Longest request id accepted (they are logged and echoed).
const MAX_ID_LEN: usize = 256;
/// Logit biases and held ids per request (the router allows 1024 biases; held ids are the
/// end tokens `min_tokens` holds back).
const MAX_BIASES: usize = 1024;
const MAX_HELD_IDS: usize = 1024;
/// A failover (`admitted`) is taken past the queue limit up to this many times it: bounded,
/// so that a caller setting the flag cannot queue without end.
const ADMITTED_HEADROOM: usize = 2;
/// Compiled formats kept for requests that repeat a schema or regex (the `n` sequences of one
/// request, which arrive together and wait for one compile; a client sending one schema again
/// and again). Few: a schema's automata may hold 4 MiB. Texts longer than
/// `FORMAT_CACHE_KEY_BYTES` are compiled each time (the cache holds its keys).
const FORMAT_CACHE: usize = 8;
const FORMAT_CACHE_KEY_BYTES: usize = 64 << 10;
/// Stop strings per request, and bytes each.
const MAX_STOPS: usize = 16;
const MAX_STOP_LEN: usize = 256;

impl TargetService {
    fn check(&self, r: &GenerateRequest) -> Result<(), Status> {
        let bad = |m: String| Err(Status::invalid_argument(m));
        if r.request_id.len() > MAX_ID_LEN {
            return bad(format!("request_id longer than {MAX_ID_LEN} bytes"));
        }
        if r.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return bad(format!(
                "token id {t} outside the vocabulary ({})",
                self.vocab
            ));
        }
        if r.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if r.prompt.len() + r.max_tokens as usize > self.max_ctx {
            return bad(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the context of {} tokens",
                r.prompt.len(),
                r.max_tokens,
                self.max_ctx
            ));
        }
        if let Some(s) = &r.sampling
            && (s.logit_bias.len() > MAX_BIASES || s.held_ids.len() > MAX_HELD_IDS)
        {
            return bad(format!(
                "at most {MAX_BIASES} logit biases and {MAX_HELD_IDS} held ids"
            ));
        }
        if r.top_logprobs as usize > specdec::MAX_TOP_LOGPROBS {
            return bad(format!(
                "top_logprobs {} out of range 0..={}",
                r.top_logprobs,
                specdec::MAX_TOP_LOGPROBS
            ));
        }
        if r.gamma as usize > specdec::MAX_GAMMA {
            return bad(format!(
                "gamma {} out of range 0..={}",
                r.gamma,
                specdec::MAX_GAMMA
            ));
        }
        if r.stop.len() > MAX_STOPS
            || r.stop
                .iter()
                .any(|s| s.is_empty() || s.len() > MAX_STOP_LEN)
        {
            return bad(format!(
                "at most {MAX_STOPS} stop strings of 1..={MAX_STOP_LEN} bytes"
            ));
        }
        // As registrations take it: an IP or a host name, and a port.
        if !r.draft_worker.is_empty() && !dspark_scheduler::discovery::is_dialable(&r.draft_worker)
        {
            return bad(format!(
                "draft_worker `{}` is not host:port",
                r.draft_worker
            ));
        }
        Ok(())
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<GenerateEvent, Status>> + Send + 'static>>;

/// A request's regex (when given) or JSON schema, compiled.
fn compile_format(regex: &str, schema: &str) -> Result<dspark_runtime::json::Format, Status> {
    if !regex.is_empty() {
        let p = dspark_runtime::json_schema::Pattern::full_match(regex)
            .map_err(|e| Status::invalid_argument(format!("regex: {e}")))?;
        return Ok(dspark_runtime::json::Format::Regex(std::sync::Arc::new(p)));
    }
    let v: serde_json::Value = serde_json::from_str(schema)
        .map_err(|e| Status::invalid_argument(format!("json_schema: {e}")))?;
    let schema = dspark_runtime::json_schema::Schema::compile(&v)
        .map_err(|e| Status::invalid_argument(format!("json_schema: {e}")))?;
    Ok(dspark_runtime::json::Format::Schema(std::sync::Arc::new(
        schema,
    )))
}

/// A request counted in the worker's load; given back when its last holder drops it unless
/// [`LoadSlot::keep`] handed it to the engine loop (which gives it back when the request
/// ends). Shared with the request's format compile: a cancelled request's compile runs on
/// in the blocking pool, and stays counted until it ends, so the request limit bounds the
/// compiles running too (a client cancelling fast would otherwise fill the pool).
struct LoadSlot {
    load: Arc<AtomicUsize>,
    kept: AtomicBool,
}

impl LoadSlot {
    fn keep(&self) {
        self.kept.store(true, Ordering::SeqCst);
    }
}

impl Drop for LoadSlot {
    fn drop(&mut self) {
        if !self.kept.load(Ordering::SeqCst) {
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl TargetService {
    /// Counts a request in the load unless the worker holds its limit already
    /// (`--max-running` + `--max-queued`; a failover the router admitted before, up to
    /// [`ADMITTED_HEADROOM`] times it).
    fn take_slot(&self, admitted: bool) -> Result<Arc<LoadSlot>, Status> {
        let limit = if admitted {
            self.max_requests.saturating_mul(ADMITTED_HEADROOM)
        } else {
            self.max_requests
        };
        match self
            .load
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            }) {
            Ok(_) => Ok(Arc::new(LoadSlot {
                load: Arc::clone(&self.load),
                kept: AtomicBool::new(false),
            })),
            Err(n) => Err(Status::resource_exhausted(format!(
                "target worker {} holds {n} requests, its limit (--max-running + --max-queued); \
                 retry shortly or elsewhere",
                self.info.id
            ))),
        }
    }
}

/// Compiled formats by their (regex, schema) text, the [`FORMAT_CACHE`] most recently used.
/// A slot is handed out before its format is compiled, so requests arriving together share
/// one compile.
#[derive(Default)]
pub struct FormatCache(Mutex<std::collections::VecDeque<((String, String), FormatSlot)>>);

type FormatSlot = Arc<tokio::sync::OnceCell<Format>>;

impl FormatCache {
    /// The slot of `key`, now the most recently used; a new one where none is kept (a key
    /// past the size bound gets one of its own each time).
    fn slot(&self, key: &(String, String)) -> FormatSlot {
        if key.0.len() + key.1.len() > FORMAT_CACHE_KEY_BYTES {
            return FormatSlot::default();
        }
        let Ok(mut c) = self.0.lock() else {
            return FormatSlot::default();
        };
        let slot = match c.iter().position(|(k, _)| k == key) {
            Some(i) => c.remove(i).map(|(_, s)| s).unwrap_or_default(),
            None => FormatSlot::default(),
        };
        c.push_front((key.clone(), Arc::clone(&slot)));
        c.truncate(FORMAT_CACHE);
        slot
    }
}

#[tonic::async_trait]
impl TargetWorker for TargetService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        // Counted before the drain flag is read: a drain that sets the flag and then reads no
        // stream open cannot miss one that slipped past the flag.
        self.streams.fetch_add(1, Ordering::SeqCst);
        let guard = StreamGuard(Arc::clone(&self.streams));
        if self.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable(format!(
                "target worker {} is draining (shutting down); place the request elsewhere",
                self.info.id
            )));
        }
        let r = req.into_inner();
        self.check(&r)?;
        let params = match &r.sampling {
            Some(s) => s
                .to_params()
                .map_err(|e| Status::invalid_argument(e.to_string()))?,
            None => kernels::sampling::SamplingParams::greedy(),
        };
        if !r.regex.is_empty() && (r.json || !r.json_schema.is_empty()) {
            return Err(Status::invalid_argument(
                "a request takes one of json, json_schema and regex",
            ));
        }
        // Counted before the format is compiled: a request past the limit costs no compiling,
        // and a compiled format is held only by a request the worker took.
        let slot = self.take_slot(r.admitted)?;
        let json = if !r.regex.is_empty() || !r.json_schema.is_empty() {
            let key = (r.regex.clone(), r.json_schema.clone());
            let cell = self.formats.slot(&key);
            let held = Arc::clone(&slot);
            let f = cell
                .get_or_try_init(|| async move {
                    // Building the automaton is CPU work (up to the state caps): off the async
                    // runtime, which also carries the draft links' replies. The compile holds
                    // the request's load until it ends, even if the request is gone by then.
                    let (regex, schema) = key;
                    tokio::task::spawn_blocking(move || {
                        let _held = held;
                        compile_format(&regex, &schema)
                    })
                    .await
                    .map_err(|e| Status::internal(format!("compiling the format: {e}")))?
                })
                .await?;
            Some(f.clone())
        } else {
            r.json.then_some(dspark_runtime::json::Format::Object)
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        // Open until the request's stream ends (it moves into the stream below), so the span
        // covers the request's time in the engine, not only its submission.
        let span = tracing::info_span!("generate", request_id = r.request_id, engine_id = id);
        dspark_scheduler::set_parent(&span, &r.traceparent);
        span.in_scope(|| {
            tracing::info!(
                request_id = r.request_id,
                engine_id = id,
                traceparent = r.traceparent,
                prompt_tokens = r.prompt.len(),
                "generate"
            )
        });
        let req = specdec::Request {
            id,
            prompt: r.prompt,
            params,
            max_tokens: r.max_tokens as usize,
            stop: r.stop,
            include_stop: r.include_stop,
            seed: r.seed,
            gamma: (r.gamma > 0).then_some(r.gamma as usize),
            logprobs: r.logprobs.then_some(r.top_logprobs as usize),
            prompt_logprobs: r.prompt_logprobs.then_some(r.top_logprobs as usize),
            ignore_eos: r.ignore_eos,
            min_tokens: r.min_tokens as usize,
            stop_token_ids: r.stop_token_ids,
            json,
            resumed: r.resumed as usize,
        };
        let draft = if self.local_drafting {
            None
        } else if r.draft_worker.is_empty() {
            self.default_draft.clone()
        } else {
            Some(r.draft_worker)
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let sent = match self.cmds.lock() {
            Ok(c) => c
                .send(Cmd::Add {
                    req,
                    draft,
                    events: tx,
                    span: span.clone(),
                })
                .map_err(|_| Status::unavailable("the engine thread stopped")),
            Err(_) => Err(Status::internal("engine channel poisoned")),
        };
        sent?;
        // The engine loop takes the count back when the request ends or is refused.
        slot.keep();
        self.room.nudge();
        let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(
            events,
            move |e| {
                let _open = (&guard, &span);
                e
            },
        ))))
    }

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        let mut i = self.info.clone();
        i.load = self.load.load(Ordering::Relaxed) as u32;
        if let Some((c, l)) = &self.counters {
            i.central_budget_steps = c.load(Ordering::Relaxed);
            i.local_budget_steps = l.load(Ordering::Relaxed);
        }
        Ok(Response::new(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_formats_are_reused_most_recent_first_and_bounded() {
        let c = FormatCache::default();
        let key = |i: usize| (format!("a{{{i}}}"), String::new());
        let f = compile_format("a{1}", "").expect("compiles");
        let s0 = c.slot(&key(0));
        assert!(s0.set(f.clone()).is_ok());
        let again = c.slot(&key(0));
        assert!(Arc::ptr_eq(&s0, &again), "one slot a text");
        assert!(matches!(again.get(), Some(Format::Regex(_))));
        for i in 1..FORMAT_CACHE {
            c.slot(&key(i));
        }
        // Key 0, used before the others came, is the least recently used now: it goes first.
        let s1 = c.slot(&key(1));
        c.slot(&key(FORMAT_CACHE));
        assert!(!Arc::ptr_eq(&c.slot(&key(0)), &s0), "key 0 left");
        assert!(Arc::ptr_eq(&c.slot(&key(1)), &s1), "key 1 kept");
        // Texts past the key bound are not kept.
        let long = ("x".repeat(FORMAT_CACHE_KEY_BYTES + 1), String::new());
        assert!(!Arc::ptr_eq(&c.slot(&long), &c.slot(&long)));
    }

    /// A service of `max_requests` over a vocabulary of 100 whose engine thread is
    /// `cmds`'s receiver.
    fn service(max_requests: usize, cmds: std::sync::mpsc::Sender<Cmd>) -> TargetService {
        TargetService {
            counters: None,
            cmds: Mutex::new(cmds),
            info: WorkerInfo::default(),
            load: Arc::default(),
            room: Default::default(),
            next_id: AtomicU64::new(0),
            vocab: 100,
            max_ctx: 64,
            default_draft: None,
            max_requests,
            formats: FormatCache::default(),
            local_drafting: true,
            draining: Arc::default(),
            streams: Arc::default(),
        }
    }

    /// A request whose caller gives up while its format compiles keeps its place in the load
    /// until the compile ends: the request limit bounds the compiles a client cancelling
    /// fast can leave running in the blocking pool. The pool's one thread is held, so the
    /// compile waits for it as long as the test says.
    #[test]
    fn a_cancelled_request_stays_counted_until_its_format_compile_ends() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(1)
            .build()
            .expect("runtime");
        let (tx, _rx) = std::sync::mpsc::channel();
        let svc = service(1, tx);
        let req = |regex: &str| GenerateRequest {
            prompt: vec![1, 2, 3],
            max_tokens: 4,
            regex: regex.into(),
            ..Default::default()
        };
        rt.block_on(async {
            let (release, held) = std::sync::mpsc::channel::<()>();
            let busy = tokio::task::spawn_blocking(move || held.recv());
            let gave_up = tokio::time::timeout(
                std::time::Duration::from_millis(20),
                svc.generate(Request::new(req("(a|b)*c{3}"))),
            )
            .await;
            assert!(gave_up.is_err(), "the compile waits for the pool");
            assert_eq!(svc.load.load(Ordering::SeqCst), 1, "the compile is counted");
            let refused = svc
                .generate(Request::new(req("")))
                .await
                .map(|_| ())
                .expect_err("past the limit");
            assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
            release.send(()).expect("release");
            busy.await.expect("join").expect("released");
            let t0 = std::time::Instant::now();
            while svc.load.load(Ordering::SeqCst) != 0 {
                assert!(
                    t0.elapsed().as_secs() < 10,
                    "the compile gives its load back"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
    }
}
