//! The router against target workers that misbehave on purpose (a fake of the gRPC service,
//! which the real worker's tests cannot make fail on cue): an engine that fails every request,
//! one that answers, one that never says anything.

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use dspark_proto::target_worker_server::{TargetWorker, TargetWorkerServer};
use dspark_proto::{
    Finished, GenerateEvent, GenerateRequest, InfoRequest, SpecStats, TokenChunk, WorkerInfo,
    generate_event,
};
use serde_json::{Value, json};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio_stream::Stream;
use tonic::{Request as GrpcRequest, Response, Status};
use tower::ServiceExt;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Accepts the request, then its engine fails it (gRPC `INTERNAL`, as a failed step).
    Fails,
    /// Two tokens, then finished.
    Answers,
    /// Accepts the request and never sends an event.
    Hangs,
    /// Tokens without end, as fast as they are read.
    Floods,
    /// Finished at once, before any token (the end of sequence sampled first).
    Ends,
    /// Answers `UNKNOWN` (as a connection broken mid-call reads: a worker the request crashed).
    Breaks,
    /// Three tokens, then the stream breaks (`UNAVAILABLE`): a worker lost mid-answer.
    Cuts,
    /// Answers its first call as `Answers`; refuses every later one (`INVALID_ARGUMENT`).
    AnswersOnce,
}

struct Fake {
    mode: Mode,
    calls: Arc<AtomicUsize>,
}

type Events = Pin<Box<dyn Stream<Item = Result<GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl TargetWorker for Fake {
    type GenerateStream = Events;

    async fn generate(&self, _: GrpcRequest<GenerateRequest>) -> Result<Response<Events>, Status> {
        let nth = self.calls.fetch_add(1, Ordering::SeqCst);
        let mode = match self.mode {
            Mode::AnswersOnce if nth > 0 => {
                return Err(Status::invalid_argument("refused after the first"));
            }
            Mode::AnswersOnce => Mode::Answers,
            m => m,
        };
        let s: Events = match mode {
            Mode::Fails => Box::pin(tokio_stream::iter(vec![Err(Status::internal(
                "engine: the step failed",
            ))])),
            Mode::Answers => {
                let tokens = GenerateEvent {
                    kind: Some(generate_event::Kind::Tokens(TokenChunk {
                        ids: vec![104, 105],
                        text: "hi".into(),
                        finish_reason: "length".into(),
                        ..Default::default()
                    })),
                };
                let done = GenerateEvent {
                    kind: Some(generate_event::Kind::Finished(Finished {
                        reason: "length".into(),
                        // Its first token from the prefill, the second from one verify forward.
                        stats: Some(SpecStats {
                            verify_forwards: 1,
                            first_tokens: 1,
                            ..Default::default()
                        }),
                    })),
                };
                Box::pin(tokio_stream::iter(vec![Ok(tokens), Ok(done)]))
            }
            Mode::Hangs => Box::pin(tokio_stream::pending()),
            Mode::Breaks | Mode::AnswersOnce => return Err(Status::unknown("connection reset")),
            Mode::Cuts => Box::pin(tokio_stream::iter(vec![
                Ok(GenerateEvent {
                    kind: Some(generate_event::Kind::Tokens(TokenChunk {
                        ids: vec![97, 98, 99],
                        text: "abc".into(),
                        ..Default::default()
                    })),
                }),
                Err(Status::unavailable("worker lost")),
            ])),
            Mode::Ends => Box::pin(tokio_stream::iter(vec![Ok(GenerateEvent {
                kind: Some(generate_event::Kind::Finished(Finished {
                    reason: "stop".into(),
                    stats: Some(SpecStats::default()),
                })),
            })])),
            Mode::Floods => Box::pin(tokio_stream::iter(std::iter::repeat_with(|| {
                Ok(GenerateEvent {
                    kind: Some(generate_event::Kind::Tokens(TokenChunk {
                        ids: vec![104],
                        text: "h".into(),
                        ..Default::default()
                    })),
                })
            }))),
        };
        Ok(Response::new(s))
    }

    async fn info(&self, _: GrpcRequest<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(WorkerInfo {
            role: "target".into(),
            capacity: 4,
            max_context: 64,
            ..Default::default()
        }))
    }
}

/// A fake worker on a loopback port: its address and its count of `Generate` calls.
async fn fake(mode: Mode) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = Fake {
        mode,
        calls: Arc::clone(&calls),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TargetWorkerServer::new(svc))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (addr, calls)
}

/// A router over `targets` (static, no scheduler) serving the tiny model's tokenizer, once
/// every target answered its first `Info` (the context limit comes from there).
async fn router(targets: &[String], extra: &[&str]) -> axum::Router {
    router::app(state(targets, extra).await)
}

/// The router's state for [`router`].
async fn state(targets: &[String], extra: &[&str]) -> Arc<router::App> {
    use clap::Parser;
    let spec = dspark_runtime::tiny::TinySpec::llama(7);
    let model = dspark_runtime::tiny::tiny_model_path(&spec, "router-fake").expect("tiny model");
    let mut argv = vec![
        "dspark-router".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--targets".into(),
        targets.join(","),
        "--full-wait-ms".into(),
        "0".into(),
        "--served-model-name".into(),
        "fake".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = router::RouterArgs::try_parse_from(argv).expect("args");
    let app = router::App::new(&args).expect("app");
    for _ in 0..100 {
        if app.cluster.context_for(&app.model) == 64 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        app.cluster.context_for(&app.model),
        64,
        "targets answered Info"
    );
    app
}

async fn post(app: &axum::Router, body: Value) -> (StatusCode, Value) {
    post_to(app, "/v1/completions", body).await
}

async fn post_to(app: &axum::Router, path: &str, mut body: Value) -> (StatusCode, Value) {
    if body.get("model").is_none() {
        body["model"] = json!("fake");
    }
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("response");
    let status = resp.status();
    let bytes: Bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A fresh request whose worker's engine fails it before its first token is placed again,
/// as the same failure a token later fails over: every request is answered.
#[tokio::test]
async fn a_request_failed_before_its_first_token_is_placed_again() {
    let (bad, bad_calls) = fake(Mode::Fails).await;
    let (good, good_calls) = fake(Mode::Answers).await;
    let app = router(&[bad, good], &[]).await;
    for i in 0..6 {
        let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
        assert_eq!(status, StatusCode::OK, "request {i}: {body}");
        assert_eq!(body["choices"][0]["text"], "hi", "request {i}: {body}");
    }
    assert!(
        bad_calls.load(Ordering::SeqCst) > 0,
        "the failing worker was tried"
    );
    assert_eq!(good_calls.load(Ordering::SeqCst), 6);
}

/// After a worker is lost mid-answer, `usage.dspark.tokens_per_forward` is the τ of the
/// forwards reported (the worker that finished): the lost worker's tokens, whose forwards
/// nobody reports, are not spread over them.
#[tokio::test]
async fn tokens_per_forward_after_a_failover_counts_only_reported_forwards() {
    let (cuts, cut_calls) = fake(Mode::Cuts).await;
    let (good, _) = fake(Mode::Answers).await;
    let app = router(&[cuts, good], &[]).await;
    let mut resumed = 0;
    for i in 0..6 {
        let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 8})).await;
        assert_eq!(status, StatusCode::OK, "request {i}: {body}");
        let text = body["choices"][0]["text"].as_str().unwrap_or_default();
        let usage = &body["usage"];
        if text == "abchi" {
            resumed += 1;
            assert_eq!(usage["completion_tokens"], 5, "{body}");
        } else {
            assert_eq!(text, "hi", "{body}");
        }
        // (2 tokens - 1 from the prefill) / 1 verify forward, failed over or not.
        assert_eq!(usage["dspark"]["tokens_per_forward"], 1.0, "{body}");
    }
    assert!(cut_calls.load(Ordering::SeqCst) > 0 && resumed > 0);
}

/// A request of several sequences, run one after another (a window of one), whose second
/// sequence fails to open ends without leaving its last sequence's task waiting for a place
/// that nothing would give back (it held the router's state, the prompts and the span).
#[tokio::test]
async fn a_failed_later_sequence_leaves_no_task_waiting() {
    let (once, calls) = fake(Mode::AnswersOnce).await;
    let st = state(&[once], &["--max-inflight", "2"]).await;
    let app = router::app(Arc::clone(&st));
    let baseline = Arc::strong_count(&st);
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2, "n": 3})).await;
    assert!(status.is_client_error(), "{status} {body}");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one after another");
    let mut held = Arc::strong_count(&st);
    for _ in 0..100 {
        if held <= baseline {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        held = Arc::strong_count(&st);
    }
    assert!(
        held <= baseline,
        "{held} holders of the state, {baseline} before"
    );
}

/// The router's `/metrics` value of an unlabelled sample.
async fn metric(app: &axum::Router, name: &str) -> f64 {
    let req = Request::get("/metrics")
        .body(Body::empty())
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("response");
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    String::from_utf8_lossy(&bytes)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing"))
}

/// A request cut short (its only worker lost after three tokens, so it fails) still counts
/// its prompt and the tokens it got in the router's token counters, as the workers count the
/// work; they counted only answers that completed.
#[tokio::test]
async fn tokens_of_a_request_cut_short_are_counted() {
    let (cuts, _) = fake(Mode::Cuts).await;
    let app = router(&[cuts], &[]).await;
    for stream in [false, true] {
        let (prompt0, done0) = (
            metric(&app, "dspark_router_prompt_tokens_total").await,
            metric(&app, "dspark_router_completion_tokens_total").await,
        );
        let body = json!({"model": "fake", "prompt": "hello", "max_tokens": 8, "stream": stream});
        if stream {
            let events = sse(&app, "/v1/completions", body).await;
            assert!(
                events.iter().any(|e| e.get("error").is_some()),
                "{events:?}"
            );
        } else {
            let (status, body) = post(&app, body).await;
            assert!(status.is_server_error(), "{status} {body}");
        }
        let prompt = metric(&app, "dspark_router_prompt_tokens_total").await - prompt0;
        let done = metric(&app, "dspark_router_completion_tokens_total").await - done0;
        assert!(prompt > 0.0, "stream {stream}: prompt tokens {prompt}");
        assert_eq!(done, 3.0, "stream {stream}: the three tokens sent");
    }
}

/// A request of two prompts run one after the other whose second fails to open counts the
/// prompt tokens of the first alone: the second was never prefilled.
#[tokio::test]
async fn a_prompt_never_started_is_not_counted() {
    let prompt_tokens = "dspark_router_prompt_tokens_total";
    // What "hello" counts, answered whole.
    let (good, _) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let hello = metric(&app, prompt_tokens).await;
    assert!(hello > 0.0);
    let (once, _) = fake(Mode::AnswersOnce).await;
    let app = router(&[once], &["--max-inflight", "2"]).await;
    let (status, body) = post(&app, json!({"prompt": ["hello", "world"], "max_tokens": 2})).await;
    assert!(status.is_client_error(), "{status} {body}");
    assert_eq!(metric(&app, prompt_tokens).await, hello);
}

/// A request that can never fit the context is a 400 (`max_tokens`), even while the cluster
/// is full: a 429 would have its client retry it for ever.
#[tokio::test]
async fn a_request_that_cannot_fit_is_400_even_when_the_cluster_is_full() {
    let (slow, slow_calls) = fake(Mode::Hangs).await;
    let app = router(&[slow], &["--max-inflight", "1"]).await;
    let held = {
        let app = app.clone();
        tokio::spawn(async move { post(&app, json!({"prompt": "hello", "max_tokens": 2})).await })
    };
    for _ in 0..100 {
        if slow_calls.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        slow_calls.load(Ordering::SeqCst),
        1,
        "the first request is held"
    );
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 100})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "max_tokens", "{body}");
    // So is a list of too many prompts, however long each is.
    let many = vec!["a"; 257];
    let (status, body) = post(&app, json!({"prompt": many, "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    held.abort();
}

/// A streaming client that stops reading (its response body never polled, so the channel to
/// it fills) gives its admission place back after `--client-write-timeout-ms`, as one that
/// left: otherwise a few such clients would have the cluster answer 429 for ever.
#[tokio::test]
async fn a_stream_whose_client_stops_reading_gives_its_place_back() {
    let (flood, _) = fake(Mode::Floods).await;
    let app = router(
        &[flood],
        &["--max-inflight", "1", "--client-write-timeout-ms", "300"],
    )
    .await;
    let stream = json!({"model": "fake", "prompt": "hello", "max_tokens": 40, "stream": true});
    let req = |body: &Value| {
        Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request")
    };
    // Its body is held and never read.
    let stalled = app.clone().oneshot(req(&stream)).await.expect("response");
    assert_eq!(stalled.status(), StatusCode::OK);
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let mut freed = None;
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let resp = app.clone().oneshot(req(&stream)).await.expect("response");
        if resp.status() == StatusCode::OK {
            freed = Some(resp);
            break;
        }
    }
    assert!(
        freed.is_some(),
        "the stalled stream still holds its place after 5 s"
    );
    drop(stalled);
}

/// More than 4096 chat messages are refused before any is rendered (each holding a special
/// token would otherwise cost a scan of the whole prompt), on chat and on /tokenize.
#[tokio::test]
async fn too_many_chat_messages_are_a_400() {
    let (good, calls) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let many = vec![json!({"role": "user", "content": "<|im_end|>"}); 4097];
    for path in ["/v1/chat/completions", "/tokenize"] {
        let (status, body) = post_to(&app, path, json!({"messages": many, "max_tokens": 2})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        assert_eq!(body["error"]["param"], "messages", "{path}: {body}");
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("at most 4096"), "{path}: {msg}");
    }
    // As many as allowed still render (to /tokenize, which places nothing).
    let (status, body) = post_to(&app, "/tokenize", json!({"messages": many[..4096]})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// The text of a `/tokenize` answer's tokens, through `/detokenize`.
async fn rendered(app: &axum::Router, body: Value) -> (StatusCode, String, Value) {
    let (status, got) = post_to(app, "/tokenize", body).await;
    if status != StatusCode::OK {
        return (status, String::new(), got);
    }
    let (status, text) = post_to(app, "/detokenize", json!({"tokens": got["tokens"]})).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    (
        status,
        text["prompt"].as_str().unwrap_or_default().to_string(),
        got,
    )
}

/// Hugging Face's template options, as vLLM takes them: `continue_final_message` ends the
/// prompt where the last message's text ends (a prefilled answer), `add_generation_prompt:
/// false` leaves the assistant's turn unopened; both true, a request's own template, kwargs
/// that are not an object or that name the server's variables, and parameters that change
/// the answer and are not implemented (beam search, allowed or bad words) are refused by
/// name, not dropped.
#[tokio::test]
async fn template_options_shape_the_prompt_and_unknown_answer_changers_are_refused() {
    let (good, calls) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let msgs = json!([{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "My name is"}]);
    let (_, plain, _) = rendered(&app, json!({"messages": msgs})).await;
    assert!(
        plain.ends_with("My name is<|im_end|>\n<|im_start|>assistant\n"),
        "{plain:?}"
    );
    let (_, closed, _) = rendered(
        &app,
        json!({"messages": msgs, "add_generation_prompt": false}),
    )
    .await;
    assert!(closed.ends_with("My name is<|im_end|>\n"), "{closed:?}");
    let (_, cont, _) = rendered(
        &app,
        json!({"messages": msgs, "continue_final_message": true}),
    )
    .await;
    assert!(
        cont.ends_with("<|im_start|>assistant\nMy name is"),
        "{cont:?}"
    );
    // Chat renders as /tokenize does: the continued prompt is shorter than the opened one.
    let (_, both, _) = rendered(
        &app,
        json!({"messages": msgs, "continue_final_message": true, "add_generation_prompt": true}),
    )
    .await;
    assert!(both.is_empty());
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "continue_final_message": true,
                   "add_generation_prompt": true}),
            "continue_final_message",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "chat_template": "{{ messages }}"}),
            "chat_template",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "chat_template_kwargs": [1]}),
            "chat_template_kwargs",
        ),
        (
            "/tokenize",
            json!({"messages": msgs, "chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "use_beam_search": true}),
            "use_beam_search",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "allowed_token_ids": [5]}),
            "allowed_token_ids",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "bad_words": ["x"]}),
            "bad_words",
        ),
    ] {
        let (status, got) = post_to(&app, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {param}: {got}");
        assert_eq!(got["error"]["param"], param, "{got}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // Served: a continued chat and empty or defaulted values of the refused parameters.
    let (status, got) = post_to(
        &app,
        "/v1/chat/completions",
        json!({"messages": msgs, "continue_final_message": true, "max_tokens": 2,
               "chat_template_kwargs": {"enable_thinking": false},
               "use_beam_search": false, "allowed_token_ids": [], "bad_words": null}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A streamed request's events (the JSON of each `data:` line but `[DONE]`).
async fn sse(app: &axum::Router, path: &str, body: Value) -> Vec<Value> {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("event JSON"))
        .collect()
}

/// A streamed echo whose answer ends before its first token still sends the prompt (it went
/// out only with the first token's chunk), with the prompt's tokens when log-probabilities
/// are asked for, as the same request unstreamed answers.
#[tokio::test]
async fn a_streamed_echo_that_ends_at_once_still_sends_its_prompt() {
    let (ends, _) = fake(Mode::Ends).await;
    let app = router(&[ends], &[]).await;
    for logprobs in [None, Some(0)] {
        let mut body = json!({"model": "fake", "prompt": "hello", "max_tokens": 4,
                              "echo": true, "stream": true});
        if let Some(l) = logprobs {
            body["logprobs"] = json!(l);
        }
        let events = sse(&app, "/v1/completions", body.clone()).await;
        let text: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(text, "hello", "{events:?}");
        let last = events.last().expect("events");
        assert_eq!(last["choices"][0]["finish_reason"], "stop", "{events:?}");
        body["stream"] = json!(false);
        let (status, whole) = post(&app, body).await;
        assert_eq!(status, StatusCode::OK, "{whole}");
        assert_eq!(whole["choices"][0]["text"], "hello", "{whole}");
        if logprobs.is_some() {
            let tokens: String = events
                .iter()
                .filter_map(|e| e["choices"][0]["logprobs"]["tokens"].as_array())
                .flatten()
                .filter_map(|t| t.as_str())
                .collect();
            assert_eq!(tokens, "hello", "{events:?}");
        }
    }
}

/// `stream_options.continuous_usage_stats` puts the usage so far on every chunk (and the final
/// usage chunk follows, as `stream_options` given turns it on); a request without `model` is
/// served by the model the server serves, as vLLM's.
#[tokio::test]
async fn usage_on_every_chunk_and_the_model_may_be_left_out() {
    let (good, calls) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let events = sse(
        &app,
        "/v1/completions",
        json!({"prompt": "hello", "max_tokens": 2, "stream": true,
               "stream_options": {"continuous_usage_stats": true}}),
    )
    .await;
    let text = events
        .iter()
        .position(|e| e["choices"][0]["text"] == "hi")
        .expect("the text chunk");
    assert_eq!(events[text]["usage"]["completion_tokens"], 2, "{events:?}");
    assert_eq!(
        events[text]["usage"]["total_tokens"],
        events[text]["usage"]["prompt_tokens"].as_u64().unwrap_or(0) + 2,
        "{events:?}"
    );
    let last = events.last().expect("events");
    assert_eq!(last["choices"], json!([]), "{events:?}");
    assert_eq!(last["usage"]["completion_tokens"], 2, "{events:?}");
    let (status, body) = post_to(
        &app,
        "/v1/completions",
        json!({"model": null, "prompt": "hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], "fake", "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A prompt and answer that do not fit the context are refused in vLLM's words (clients match
/// "maximum context length" to fall back to a longer-context model); the model card says the
/// context, as vLLM's `max_model_len`.
#[tokio::test]
async fn the_context_is_on_the_card_and_in_the_refusal() {
    let (good, calls) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 100})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.starts_with("This model's maximum context length is 64 tokens. However, you requested"),
        "{msg}"
    );
    assert!(msg.contains("100 in the completion"), "{msg}");
    let card = app
        .clone()
        .oneshot(
            Request::get("/v1/models")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("response");
    let bytes = axum::body::to_bytes(card.into_body(), 1 << 20)
        .await
        .expect("body");
    let card: Value = serde_json::from_slice(&bytes).expect("json");
    let m = &card["data"][0];
    assert_eq!(m["id"], "fake", "{card}");
    assert_eq!(m["max_model_len"], 64, "{card}");
    assert!(m["created"].as_u64().unwrap_or(0) > 1_700_000_000, "{card}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// With `continuous_usage_stats`, every chat chunk that carries a choice carries that choice's
/// usage so far (the role chunk first, at 0 tokens), as vLLM's.
#[tokio::test]
async fn continuous_usage_is_on_every_chat_chunk() {
    let (good, _) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let events = sse(
        &app,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
               "stream": true, "stream_options": {"continuous_usage_stats": true}}),
    )
    .await;
    let with_choices: Vec<&Value> = events
        .iter()
        .filter(|e| e["choices"].as_array().is_some_and(|c| !c.is_empty()))
        .collect();
    assert!(with_choices.len() >= 4, "{events:?}");
    for e in &with_choices {
        let u = &e["usage"];
        assert!(u["prompt_tokens"].as_u64().unwrap_or(0) > 0, "{e}");
        let c = u["completion_tokens"].as_u64().expect("completion_tokens");
        assert!(c <= 2, "per choice, not summed: {e}");
        if e["choices"][0]["delta"]["role"] == "assistant" {
            assert_eq!(c, 0, "{e}");
        }
    }
    let last = events.last().expect("events");
    assert_eq!(last["usage"]["completion_tokens"], 4, "{last}");
}

/// More than 256 sequences (prompts × n) are a 400 before admission.
#[tokio::test]
async fn more_than_256_sequences_are_a_400() {
    let (good, calls) = fake(Mode::Answers).await;
    let app = router(&[good], &[]).await;
    let prompts = vec!["a"; 17];
    let (status, body) = post(&app, json!({"prompt": prompts, "n": 16, "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "n", "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// An error repeats at most ~128 bytes of what the client sent (a megabyte model name is
/// not sent back whole); the API key is checked (a key of the right length but wrong bytes
/// is refused) and `--help` never shows the key from the environment.
#[tokio::test]
async fn errors_clip_what_they_echo_and_the_key_is_checked() {
    use clap::CommandFactory;
    let (good, _) = fake(Mode::Answers).await;
    let app = router(&[good], &["--api-key", "sekrit-key"]).await;
    let get = |key: &str| {
        Request::get("/v1/models")
            .header("authorization", format!("Bearer {key}"))
            .body(Body::empty())
            .expect("request")
    };
    for (key, want) in [
        ("sekrit-key", StatusCode::OK),
        ("sekrit-kez", StatusCode::UNAUTHORIZED),
        ("sekrit-ke", StatusCode::UNAUTHORIZED),
        ("sekrit-key-", StatusCode::UNAUTHORIZED),
        ("", StatusCode::UNAUTHORIZED),
    ] {
        let resp = app.clone().oneshot(get(key)).await.expect("response");
        assert_eq!(resp.status(), want, "key {key:?}");
    }
    let long = "m".repeat(10_000);
    let req = Request::post("/v1/completions")
        .header("content-type", "application/json")
        .header("authorization", "Bearer sekrit-key")
        .body(Body::from(
            json!({"model": long, "prompt": "hello", "max_tokens": 2}).to_string(),
        ))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    let body: Value = serde_json::from_slice(&bytes).expect("json");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.len() < 400, "{} bytes: {msg:.200}", msg.len());
    assert!(msg.contains(&"m".repeat(128)), "{msg}");
    let cmd = router::RouterArgs::command();
    let key = cmd
        .get_arguments()
        .find(|a| a.get_id() == "api_key")
        .expect("the api_key arg");
    assert!(key.is_hide_env_values_set());
}

/// `app` served on a loopback port (a real connection, as a client that stalls would hold).
async fn listen(app: axum::Router) -> std::net::SocketAddr {
    listen_with(app, std::time::Duration::from_secs(30)).await
}

/// The router's own HTTP server (`router::serve_http`) with a header deadline.
async fn listen_with(app: axum::Router, headers: std::time::Duration) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(router::serve_http(
        listener,
        app,
        headers,
        std::future::pending(),
    ));
    addr
}

/// A connection that sends part of a request's headers, or nothing, is closed once the header
/// deadline passes (a slow-headers client held its socket and task for ever before); one that
/// sends its request in time is served on the same server.
#[tokio::test]
async fn a_connection_that_stalls_in_its_headers_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (good, calls) = fake(Mode::Answers).await;
    let deadline = std::time::Duration::from_millis(300);
    let addr = listen_with(router(&[good], &[]).await, deadline).await;
    for sent in [
        "",
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-",
    ] {
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let started = std::time::Instant::now();
        conn.write_all(sent.as_bytes()).await.expect("write");
        let mut buf = [0u8; 1024];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), conn.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("{sent:?}: the connection is still open after 5 s"));
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "{sent:?}: an answer instead of a close: {read:?}"
        );
        assert!(
            started.elapsed() >= deadline,
            "{sent:?}: {:?}",
            started.elapsed()
        );
    }
    // A request sent whole within the deadline is answered over the same server.
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = json!({"model": "fake", "prompt": "hello", "max_tokens": 2}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_to_end(&mut answer),
    )
    .await
    .expect("an answer within 10 s")
    .expect("read");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"hi\""), "{text}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Sends a completion request's headers saying `Content-Length: 8000000` (under the body
/// limit) and a few bytes of the body, then stalls. Returns the answer's status and JSON
/// body, how long it took, and whether the router then closed the connection (within 2 s).
async fn stalled_body(
    addr: std::net::SocketAddr,
    key: Option<&str>,
    wait: std::time::Duration,
) -> (u16, Value, std::time::Duration, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         {auth}content-length: 8000000\r\n\r\n{{\"model\": \"fake\", \"prompt\": \"aaaa"
    );
    let started = std::time::Instant::now();
    conn.write_all(head.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // Until the whole answer (its headers, then `content-length` bytes) is in.
    let answer = tokio::time::timeout(wait, async {
        loop {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed without an answer");
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got).into_owned();
            if let Some(end) = text.find("\r\n\r\n") {
                let len = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length: ")
                            .map(|v| v.trim().parse::<usize>().expect("length"))
                    })
                    .expect("content-length");
                if got.len() >= end + 4 + len {
                    let status = text[9..12].parse::<u16>().expect("status");
                    let body = serde_json::from_slice(&got[end + 4..end + 4 + len]).expect("json");
                    return (status, body);
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no answer within {wait:?}"));
    let elapsed = started.elapsed();
    let closed = matches!(
        tokio::time::timeout(std::time::Duration::from_secs(2), conn.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    );
    (answer.0, answer.1, elapsed, closed)
}

/// With `--api-key`, a request without the key is refused from its headers: a body that never
/// arrives is not waited for (the body deadline here is 20 s; the answer comes at once).
#[tokio::test]
async fn a_request_without_the_key_is_refused_before_its_body_is_read() {
    let (good, calls) = fake(Mode::Answers).await;
    let app = router(
        &[good],
        &[
            "--api-key",
            "sekrit-key",
            "--client-body-timeout-ms",
            "20000",
        ],
    )
    .await;
    let addr = listen(app).await;
    for key in [None, Some("wrong-key!")] {
        let (status, body, elapsed, _) =
            stalled_body(addr, key, std::time::Duration::from_secs(5)).await;
        assert_eq!(status, 401, "{key:?}: {body}");
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
        assert!(elapsed < std::time::Duration::from_secs(2), "{elapsed:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// Five listed targets that are gone (their ports refuse) ahead of one that answers: the
/// request is served by the live one (it used up its four tries on the dead before), and the
/// next goes there first.
#[tokio::test]
async fn dead_targets_listed_first_do_not_cost_the_request() {
    let mut all: Vec<String> = (0..5)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
        })
        .collect(); // each listener dropped: its port refuses
    let (good, calls) = fake(Mode::Answers).await;
    all.push(good);
    let app = router(&all, &[]).await;
    for n in 1..=2 {
        let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            body["usage"]["dspark"]["target_worker"], "target-5",
            "{body}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), n);
    }
}

/// A request whose workers' connections all break before its first event (it may be crashing
/// them) is tried on two workers, not on every one in the cluster, then refused with a 503.
#[tokio::test]
async fn a_request_that_breaks_its_workers_is_tried_on_two() {
    let mut all = Vec::new();
    let mut counts = Vec::new();
    for _ in 0..6 {
        let (addr, calls) = fake(Mode::Breaks).await;
        all.push(addr);
        counts.push(calls);
    }
    let app = router(&all, &[]).await;
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let calls: usize = counts.iter().map(|c| c.load(Ordering::SeqCst)).sum();
    assert_eq!(calls, 2, "{body}");
}

/// A TCP relay to `to` whose connections all close when the returned sender says so: a
/// worker killed (or its node lost) while requests wait on it, as the router sees it.
async fn relay(to: String) -> (String, tokio::sync::watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (cut, cut_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((mut a, _)) = listener.accept().await {
            let mut cut = cut_rx.clone();
            let to = to.clone();
            tokio::spawn(async move {
                let Ok(mut b) = tokio::net::TcpStream::connect(&to).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
                    _ = cut.wait_for(|c| *c) => {}
                }
            });
        }
    });
    (addr, cut)
}

/// A target whose connection breaks while the request waits for its first event (queued or
/// prefilling there; tonic reads the broken connection as `UNKNOWN`, not `UNAVAILABLE`): the
/// request is placed on another target and answered, not refused with a 503.
#[tokio::test]
async fn a_target_lost_before_the_first_token_costs_a_placement_not_the_answer() {
    let (silent, silent_calls) = fake(Mode::Hangs).await;
    let (via, cut) = relay(silent).await;
    let (good, calls) = fake(Mode::Answers).await;
    // Listed first and alike in load: placement picks the relayed one (ties go by id).
    let app = router(&[via, good], &[]).await;
    let asked =
        tokio::spawn(async move { post(&app, json!({"prompt": "hello", "max_tokens": 2})).await });
    for _ in 0..100 {
        if silent_calls.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        silent_calls.load(Ordering::SeqCst),
        1,
        "placed on the relayed target"
    );
    cut.send(true).expect("cut");
    let (status, body) = tokio::time::timeout(std::time::Duration::from_secs(10), asked)
        .await
        .expect("answered within 10 s")
        .expect("joined");
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["text"], "hi", "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A body that does not arrive whole within `--client-body-timeout-ms` is answered 408 (a
/// JSON error) and its connection closed, with the right key and with none configured.
#[tokio::test]
async fn a_body_that_stalls_is_a_408_and_its_connection_is_closed() {
    let (good, calls) = fake(Mode::Answers).await;
    let deadline = std::time::Duration::from_millis(300);
    for (extra, key) in [
        (vec!["--client-body-timeout-ms", "300"], None),
        (
            vec!["--client-body-timeout-ms", "300", "--api-key", "sekrit-key"],
            Some("sekrit-key"),
        ),
    ] {
        let addr = listen(router(&[good.clone()], &extra).await).await;
        let (status, body, elapsed, closed) =
            stalled_body(addr, key, std::time::Duration::from_secs(5)).await;
        assert_eq!(status, 408, "{key:?}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("300 ms"), "{msg}");
        assert!(elapsed >= deadline, "{elapsed:?}");
        assert!(closed, "the connection stays open after the 408");
    }
    // The deadline is the body's only: a request whose body arrives is served.
    let app = router(&[good], &["--client-body-timeout-ms", "300"]).await;
    let (status, body) = post(&app, json!({"prompt": "hello", "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
