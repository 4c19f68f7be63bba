//! `dspark bench serve`: a load generator against the router's OpenAI API. Open loop (Poisson
//! arrivals at --rate) or closed loop (--concurrency users, each sending its next request when
//! the last one ends), streaming, with `include_usage` to read the speculative statistics.

use clap::Args;
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model name sent in requests (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// chat | code | math | all
    #[arg(long, default_value = "chat")]
    pub prompts: String,
    /// Open loop: Poisson arrivals per second.
    #[arg(long, conflicts_with = "concurrency", allow_negative_numbers = true, value_parser = crate::config::positive)]
    pub rate: Option<f64>,
    /// Closed loop: users sending back to back.
    #[arg(long, value_parser = crate::config::at_least_one)]
    pub concurrency: Option<usize>,
    /// Seconds of load (requests in flight at the end are awaited and counted).
    #[arg(long, default_value_t = 30.0, value_parser = crate::config::seconds)]
    pub duration: f64,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = crate::config::non_negative)]
    pub temperature: f64,
    /// Label stored with the result (e.g. the arm's name).
    #[arg(long, default_value = "")]
    pub label: String,
    #[arg(long, env = "DSPARK_API_KEY")]
    pub api_key: Option<String>,
    /// Requests sent one at a time before the measured load and not counted (connections,
    /// first allocations and caches warm, the same for every arm).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Default, Clone, Debug)]
struct Sample {
    ok: bool,
    error: String,
    /// Seconds to the first token; `None` when no token came (an immediate end).
    ttft: Option<f64>,
    e2e: f64,
    /// Gaps between successive network reads that brought tokens (one per read: chunks that
    /// arrive in one read arrive together).
    itl: Vec<f64>,
    /// Per token after the first: its read's gap shared among the read's tokens (0 for tokens
    /// that came in the first token's read).
    itl_token: Vec<f64>,
    /// Tokens were counted by the chunks' `token_ids` (else one per chunk with text).
    counted_ids: bool,
    tokens: u64,
    usage: Value,
}

/// A streamed response, read by read.
#[derive(Default)]
struct StreamParse {
    buf: String,
    s: Sample,
    /// When the last read that brought tokens came (seconds since the request was sent).
    last: Option<f64>,
}

impl StreamParse {
    /// One network read's bytes, received `at` seconds after the request was sent. True once
    /// `[DONE]` came (the sample is then complete).
    fn read(&mut self, at: f64, bytes: &[u8]) -> bool {
        let s = &mut self.s;
        self.buf.push_str(&String::from_utf8_lossy(bytes));
        let mut tokens = 0u64;
        let mut done = false;
        while let Some(p) = self.buf.find("\n\n") {
            let ev: String = self.buf.drain(..p + 2).collect();
            let Some(data) = ev.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                s.error = v["error"]["message"]
                    .as_str()
                    .unwrap_or("error")
                    .to_string();
                continue;
            }
            if !v["usage"].is_null() {
                s.tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                s.usage = v["usage"].clone();
            }
            // A token shows as text or as a tool call's delta; `token_ids` (asked for) count
            // a chunk's tokens, also those whose text is held back.
            let delta = &v["choices"][0]["delta"];
            let has_text = delta["content"].as_str().is_some_and(|t| !t.is_empty())
                || delta["tool_calls"]
                    .as_array()
                    .is_some_and(|c| !c.is_empty());
            match v["choices"][0]["token_ids"].as_array() {
                Some(ids) => {
                    s.counted_ids = true;
                    tokens += ids.len() as u64;
                }
                // A server without `token_ids`: one token per chunk with text. Once chunks
                // carried them, chunks without (tool calls parsed out, held-back text at the
                // end) bring no new tokens.
                None if has_text && !s.counted_ids => tokens += 1,
                None => {}
            }
        }
        if tokens > 0 {
            match self.last {
                None => {
                    s.ttft = Some(at);
                    s.itl_token
                        .extend(std::iter::repeat_n(0.0, tokens as usize - 1));
                }
                Some(l) => {
                    let gap = at - l;
                    s.itl.push(gap);
                    s.itl_token
                        .extend(std::iter::repeat_n(gap / tokens as f64, tokens as usize));
                }
            }
            self.last = Some(at);
        }
        if done {
            // Without the usage chunk (asked for) the tokens are unknown: not a success.
            if s.error.is_empty() && s.usage.is_null() {
                s.error = "no usage chunk before [DONE]".into();
            }
            s.ok = s.error.is_empty();
            s.e2e = at;
        }
        done
    }
}

async fn one(client: &reqwest::Client, a: &ServeArgs, model: &str, prompt: &str) -> Sample {
    let t0 = Instant::now();
    let mut s = Sample::default();
    let body = json!({"model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": a.max_tokens, "temperature": a.temperature, "stream": true,
        "stream_options": {"include_usage": true}, "return_token_ids": true});
    let mut req = client
        .post(format!("{}/v1/chat/completions", a.url))
        .json(&body);
    if let Some(k) = &a.api_key {
        req = req.bearer_auth(k);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            s.error = error_chain(&e);
            return s;
        }
    };
    if !resp.status().is_success() {
        s.error = format!("HTTP {}", resp.status());
        return s;
    }
    // Timed once per network read: the events of one read arrived together.
    let mut stream = resp.bytes_stream();
    let mut p = StreamParse::default();
    while let Some(chunk) = stream.next().await {
        let at = t0.elapsed().as_secs_f64();
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                p.s.error = format!("stream broke: {}", error_chain(&e));
                return p.s;
            }
        };
        if p.read(at, &chunk) {
            return p.s;
        }
    }
    p.s.error = "stream ended without [DONE]".into();
    p.s
}

/// An error and its causes on one line (`error sending request: …: connection refused`), each
/// cause left out where the message before already holds it.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cause = c.source();
    }
    s
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Whether `url` names this machine (`localhost`, 127.0.0.0/8, `::1`): such requests must
/// not go through a proxy.
fn is_loopback_url(url: &str) -> bool {
    let Some(host) = reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_ascii_lowercase))
    else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = host.strip_suffix('.').unwrap_or(host);
    host == "localhost"
        || host.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.duration > 0.0, "--duration must be positive");
    crate::config::check_outputs(&[a.json.as_deref()])?;
    let prompts = crate::bench::prompt_set(&a.prompts)?;
    let rt = tokio::runtime::Runtime::new()?;
    let out = rt.block_on(async {
        let mut client = reqwest::Client::builder().timeout(Duration::from_secs(600));
        // A router on this machine is reached directly, as `dspark up` reaches it: a proxy
        // from HTTP_PROXY or ALL_PROXY would not reach it, or would add its own latency to
        // every figure. A router elsewhere may need the proxy the environment names.
        if is_loopback_url(&a.url) {
            client = client.no_proxy();
        }
        let client = client.build()?;
        let model = match &a.model {
            Some(m) => m.clone(),
            None => {
                let mut r = client.get(format!("{}/v1/models", a.url));
                if let Some(k) = &a.api_key {
                    r = r.bearer_auth(k);
                }
                let v: Value = r.send().await?.json().await?;
                v["data"][0]["id"]
                    .as_str()
                    .ok_or_else(|| anyhow::anyhow!("{}/v1/models lists no model", a.url))?
                    .to_string()
            }
        };
        for i in 0..a.warmup {
            let w = one(&client, &a, &model, &prompts[i % prompts.len()]).await;
            anyhow::ensure!(w.error.is_empty(), "warm-up request failed: {}", w.error);
        }
        let (a2, client, model) = (Arc::new(a.clone()), Arc::new(client), Arc::new(model));
        let prompts = Arc::new(prompts);
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs_f64(a.duration);
        let mut tasks = Vec::new();
        let mode;
        if let Some(rate) = a.rate {
            anyhow::ensure!(rate > 0.0, "--rate must be positive");
            mode = json!({"mode": "open", "rate": rate});
            let mut rng = kernels::rng::Rng::new(7);
            let mut next = Instant::now();
            let mut i = 0usize;
            while next < end {
                tokio::time::sleep_until(next.into()).await;
                let (a, c, m, p) = (a2.clone(), client.clone(), model.clone(), prompts.clone());
                let k = i % p.len();
                tasks.push(tokio::spawn(
                    async move { vec![one(&c, &a, &m, &p[k]).await] },
                ));
                i += 1;
                let u = rng.uniform().max(1e-12);
                next += Duration::from_secs_f64(-u.ln() / rate);
            }
        } else {
            let c = a.concurrency.unwrap_or(1);
            mode = json!({"mode": "closed", "concurrency": c});
            for u in 0..c {
                let (a, cl, m, p) = (a2.clone(), client.clone(), model.clone(), prompts.clone());
                tasks.push(tokio::spawn(async move {
                    let mut v = Vec::new();
                    let mut i = u;
                    while Instant::now() < end {
                        v.push(one(&cl, &a, &m, &p[i % p.len()]).await);
                        i += c;
                    }
                    v
                }));
            }
        }
        let mut samples = Vec::new();
        for t in tasks {
            samples.extend(t.await?);
        }
        let wall = t0.elapsed().as_secs_f64();
        anyhow::Ok(summarize(&a, &model, mode, samples, wall))
    })?;
    out!("{}", serde_json::to_string_pretty(&out)?)?;
    crate::bench::write_json(&a.json, &out)?;
    // A run in which nothing was served measured nothing (a wrong URL, a refused key).
    if out["ok"].as_u64() == Some(0) {
        anyhow::bail!(
            "no request succeeded ({} failed); see `first_errors` above",
            out["errors"]
        );
    }
    Ok(())
}

fn summarize(a: &ServeArgs, model: &str, mode: Value, s: Vec<Sample>, wall: f64) -> Value {
    let ok: Vec<&Sample> = s.iter().filter(|x| x.ok).collect();
    let errors: Vec<&str> = s
        .iter()
        .filter(|x| !x.ok)
        .map(|x| x.error.as_str())
        .collect();
    let tokens: u64 = ok.iter().map(|x| x.tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|x| x.ttft).map(|t| t * 1e3).collect();
    let mut tpot: Vec<f64> = ok
        .iter()
        .filter(|x| x.tokens > 1)
        .filter_map(|x| Some((x.e2e - x.ttft?) / (x.tokens - 1) as f64 * 1e3))
        .collect();
    // Each request's first token came from its prefill, not a verifying forward.
    let firsts = ok.iter().filter(|x| x.tokens > 0).count() as u64;
    let mut itl: Vec<f64> = ok
        .iter()
        .flat_map(|x| x.itl.iter().map(|v| v * 1e3))
        .collect();
    let mut itl_token: Vec<f64> = ok
        .iter()
        .flat_map(|x| x.itl_token.iter().map(|v| v * 1e3))
        .collect();
    let itl_token_mean = if itl_token.is_empty() {
        0.0
    } else {
        itl_token.iter().sum::<f64>() / itl_token.len() as f64
    };
    // Per user, as `bench frontier` and `dspark plan` read it: the tokens after the first over
    // the time from the first token to the end (queueing and TTFT left out).
    let user: Vec<f64> = ok
        .iter()
        .filter(|x| x.tokens > 1)
        .filter_map(|x| {
            let dt = x.e2e - x.ttft?;
            (dt > 0.0).then(|| (x.tokens - 1) as f64 / dt)
        })
        .collect();
    // The load ran `duration` seconds; requests in flight at its end were awaited (the drain)
    // and their tokens counted, so `tok_s` is over both.
    let drain = (wall - a.duration).max(0.0);
    let u = |k: &str| -> f64 {
        ok.iter()
            .map(|x| x.usage["dspark"][k].as_f64().unwrap_or(0.0))
            .sum()
    };
    let cycles = u("remote_draft_cycles");
    json!({
        "command": crate::config::command_line(),
        "label": a.label, "url": a.url, "model": model, "prompts": a.prompts,
        "load": mode, "duration_s": wall, "load_s": a.duration, "drain_s": drain,
        "max_tokens": a.max_tokens, "temperature": a.temperature,
        "requests": s.len(), "ok": ok.len(), "errors": errors.len(),
        "first_errors": errors.iter().take(3).collect::<Vec<_>>(),
        "tok_s": tokens as f64 / wall,
        "tok_s_over": "duration_s = load_s + drain_s (requests in flight when the load ended are awaited and counted)",
        "user_tok_s": if user.is_empty() { 0.0 } else { user.iter().sum::<f64>() / user.len() as f64 },
        "user_tok_s_def": "mean over requests of (tokens - 1) / (end - first token)",
        "ttft_ms": {"p50": pct(&mut ttft, 0.5), "p99": pct(&mut ttft, 0.99)},
        "tpot_ms": {"p50": pct(&mut tpot, 0.5), "p99": pct(&mut tpot, 0.99)},
        "itl_ms": {"p50": pct(&mut itl, 0.5), "p99": pct(&mut itl, 0.99)},
        "itl_per_token_ms": {"p50": pct(&mut itl_token, 0.5), "p99": pct(&mut itl_token, 0.99), "mean": itl_token_mean,
            "counted_by": if ok.iter().any(|x| x.counted_ids) { "token_ids" } else { "chunks" }},
        "completion_tokens": tokens,
        "tokens_per_forward": if u("verify_forwards") > 0.0 { (tokens - firsts) as f64 / u("verify_forwards") } else { 0.0 },
        "wire": {
            "bytes_to_draft_per_token": if tokens > 0 { u("bytes_to_draft") / tokens as f64 } else { 0.0 },
            "bytes_from_draft_per_token": if tokens > 0 { u("bytes_from_draft") / tokens as f64 } else { 0.0 },
            "remote_draft_cycles": cycles,
            "fallback_draft_cycles": u("fallback_draft_cycles"),
            "rtt_ms_per_cycle": if cycles > 0.0 { u("draft_rtt_ms") / cycles } else { 0.0 },
            "grpc_overhead_ms_per_cycle": if cycles > 0.0 { (u("draft_rtt_ms") - u("draft_compute_ms")) / cycles } else { 0.0 },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    fn text(t: &str, ids: &[u32]) -> String {
        event(json!({"choices": [{"index": 0, "delta": {"content": t}, "token_ids": ids}]}))
    }

    fn usage(n: u64) -> String {
        event(json!({"choices": [], "usage": {"completion_tokens": n}}))
    }

    /// Requests to this machine's router skip any proxy the environment names; requests
    /// elsewhere keep it.
    #[test]
    fn loopback_urls_bypass_the_proxy() {
        for u in [
            "http://127.0.0.1:8000",
            "http://localhost:8000/",
            "http://LOCALHOST.:8000",
            "http://127.1.2.3",
            "http://[::1]:8000",
            "https://api.localhost/v1",
        ] {
            assert!(is_loopback_url(u), "{u}");
        }
        for u in [
            "http://10.0.0.5:8000",
            "https://example.com",
            "http://[::2]:80",
            "not a url",
        ] {
            assert!(!is_loopback_url(u), "{u}");
        }
    }

    #[test]
    fn gaps_are_timed_once_per_network_read() {
        let mut p = StreamParse::default();
        let role = event(
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        );
        assert!(!p.read(0.05, role.as_bytes()));
        assert!(p.s.ttft.is_none());
        // The prefill's token.
        assert!(!p.read(0.2, text("a", &[1]).as_bytes()));
        // Two cycles' chunks (2 tokens and 1) in one read: one gap, not a second one near 0.
        let two = text("bc", &[2, 3]) + &text("d", &[4]);
        assert!(!p.read(0.5, two.as_bytes()));
        // An event split over two reads arrives with the second.
        let e = text("e", &[5]);
        let (x, y) = e.split_at(10);
        assert!(!p.read(0.6, x.as_bytes()));
        assert!(!p.read(0.7, y.as_bytes()));
        assert!(p.read(0.75, (usage(5) + "data: [DONE]\n\n").as_bytes()));
        let s = &p.s;
        assert!(s.ok, "{}", s.error);
        assert_eq!((s.ttft, s.tokens, s.e2e), (Some(0.2), 5, 0.75));
        assert!(s.counted_ids);
        assert_eq!(s.itl.len(), 2, "{:?}", s.itl);
        assert!((s.itl[0] - 0.3).abs() < 1e-12 && (s.itl[1] - 0.2).abs() < 1e-12);
        // Per token after the first: the 0.3 s read's three tokens 0.1 s each, then 0.2 s.
        assert_eq!(s.itl_token.len(), 4);
        for (got, want) in s.itl_token.iter().zip([0.1, 0.1, 0.1, 0.2]) {
            assert!((got - want).abs() < 1e-12, "{:?}", s.itl_token);
        }
    }

    #[test]
    fn without_token_ids_each_chunk_with_text_counts_once() {
        let mut p = StreamParse::default();
        let chunk = |t: &str| event(json!({"choices": [{"index": 0, "delta": {"content": t}}]}));
        // Two chunks in the first read: the second token came with the first.
        assert!(!p.read(0.1, (chunk("a") + &chunk("b")).as_bytes()));
        // The last token, the usage and the end in one read.
        let end = chunk("c") + &usage(3) + "data: [DONE]\n\n";
        assert!(p.read(0.4, end.as_bytes()));
        let s = &p.s;
        assert!(s.ok && !s.counted_ids, "{}", s.error);
        assert_eq!(s.ttft, Some(0.1));
        assert_eq!(s.itl.len(), 1);
        assert!((s.itl[0] - 0.3).abs() < 1e-12);
        assert_eq!(s.itl_token.len(), 2);
        assert_eq!(s.itl_token[0], 0.0);
        assert!((s.itl_token[1] - 0.3).abs() < 1e-12);
    }

    #[test]
    fn a_request_that_cannot_connect_reports_the_cause() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let a = ServeArgs {
            url: format!("http://127.0.0.1:{port}"),
            model: None,
            prompts: "chat".into(),
            rate: None,
            concurrency: None,
            duration: 1.0,
            max_tokens: 4,
            temperature: 0.0,
            label: String::new(),
            api_key: None,
            warmup: 0,
            json: None,
        };
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let s = rt.block_on(one(&client, &a, "m", "hi"));
        assert!(
            !s.ok && s.error.to_lowercase().contains("refused"),
            "{}",
            s.error
        );
    }

    #[test]
    fn per_user_rate_leaves_out_the_wait_for_the_first_token() {
        let a = ServeArgs {
            url: "http://127.0.0.1:1".into(),
            model: None,
            prompts: "chat".into(),
            rate: None,
            concurrency: Some(2),
            duration: 10.0,
            max_tokens: 64,
            temperature: 0.0,
            label: String::new(),
            api_key: None,
            warmup: 0,
            json: None,
        };
        let done = |tokens, ttft, e2e| Sample {
            ok: true,
            ttft,
            e2e,
            tokens,
            ..Default::default()
        };
        // 11 tokens: the first at 1 s, the last at 3 s: 10 tokens in 2 s. One token alone has
        // no rate.
        let s = vec![done(11, Some(1.0), 3.0), done(1, Some(0.5), 0.5)];
        let v = summarize(&a, "m", json!({"mode": "closed"}), s, 12.0);
        assert_eq!(v["user_tok_s"].as_f64(), Some(5.0), "{v}");
        // The last request ended 2 s after the load: counted, over 12 s.
        assert_eq!(v["drain_s"].as_f64(), Some(2.0), "{v}");
        assert_eq!(v["tok_s"].as_f64(), Some(1.0), "{v}");
    }
}
