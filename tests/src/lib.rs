//! Helpers for the end-to-end tests: the `dspark` binary as child processes on loopback.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The `dspark` binary next to this test's build (`cargo build --workspace --bins` makes it).
pub fn dspark_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps");
    let bin = dir.join("dspark");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        bin.display()
    );
    bin
}

/// A child process killed (SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub addr: String,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([format!("-{sig}"), self.pid().to_string()])
            .status();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits for `child` to exit on its own, up to `limit`; its status (killed and a panic past it).
pub async fn exits_within(
    child: &mut Child,
    what: &str,
    limit: Duration,
) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} did not stop within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A counter or gauge from a Prometheus `/metrics` page. A page that does not answer, or
/// lacks the sample, panics naming it: every service renders each of its metrics (counters
/// at 0 included) on every scrape, so a missing one is a down page or a renamed metric, which
/// must not read as a zero.
pub async fn metric(base: &str, name: &str) -> f64 {
    try_metric(base, name)
        .await
        .unwrap_or_else(|e| panic!("metric {name} from {base}/metrics: {e}"))
}

/// [`metric`], the failure returned: the page unreachable or not 200, the sample missing, or
/// its value not a number.
pub async fn try_metric(base: &str, name: &str) -> Result<f64, String> {
    let r = http()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .map_err(|e| format!("no answer: {e}"))?;
    let status = r.status();
    let text = r.text().await.map_err(|e| format!("no body: {e}"))?;
    if !status.is_success() {
        return Err(format!("status {status}: {text}"));
    }
    let v = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .ok_or_else(|| "no such sample on the page".to_string())?;
    v.trim().parse().map_err(|_| format!("not a number: {v:?}"))
}

/// The chunks of a server-sent-events response, as JSON.
pub struct SseChunks {
    stream: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<Vec<u8>>> + Send>>,
    buf: String,
}

impl SseChunks {
    /// POSTs `body` (which asks for `"stream": true`) and checks the response opened with 200.
    pub async fn open(url: &str, body: &serde_json::Value) -> Self {
        let r = http().post(url).json(body).send().await.expect("request");
        assert_eq!(r.status().as_u16(), 200, "streamed request refused");
        Self {
            stream: Box::pin(futures::StreamExt::map(r.bytes_stream(), |b| {
                b.map(|b| b.to_vec())
            })),
            buf: String::new(),
        }
    }

    /// The next chunk; None after `[DONE]` or the end of the stream.
    pub async fn next(&mut self) -> Option<serde_json::Value> {
        loop {
            if let Some(p) = self.buf.find("\n\n") {
                let ev: String = self.buf.drain(..p + 2).collect();
                let data = ev.trim().trim_start_matches("data: ").to_string();
                if data == "[DONE]" {
                    return None;
                }
                return Some(serde_json::from_str(&data).expect("chunk JSON"));
            }
            let b = futures::StreamExt::next(&mut self.stream).await?;
            self.buf
                .push_str(&String::from_utf8_lossy(&b.expect("stream")));
        }
    }
}

/// Starts `dspark ARGS...` and waits for its "listening on ADDR" line.
pub fn spawn(name: &str, args: &[&str]) -> Proc {
    spawn_env(name, args, &[])
}

/// [`spawn`] with extra environment variables.
pub fn spawn_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut child = Command::new(dspark_bin())
        .args(args)
        // `DSPARK_TEST_LOG` (a filter) shows more of the processes' logs when debugging.
        .env(
            "DSPARK_LOG",
            std::env::var("DSPARK_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(i) = line.find("listening on ") {
                let a = line[i + 13..]
                    .trim()
                    .trim_start_matches("http://")
                    .to_string();
                let _ = tx.send(a);
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(300))
        .unwrap_or_else(|_| panic!("{name} did not start listening"));
    Proc {
        name: name.to_string(),
        child,
        addr,
    }
}

/// Polls `cond` every 100 ms until it holds or `timeout` passes.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An HTTP client whose requests fail after five minutes: a hung server fails its test instead
/// of hanging CI. The servers are on loopback: no proxy from the environment is used.
fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("HTTP client")
}

/// GET/POST returning (status, JSON body).
pub async fn post(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let r = http()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("HTTP request");
    let st = r.status().as_u16();
    let v = r.json().await.unwrap_or(serde_json::Value::Null);
    (st, v)
}

pub async fn post_raw(url: &str, body: Vec<u8>) -> (u16, serde_json::Value) {
    let r = http()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("HTTP request");
    let st = r.status().as_u16();
    let v = r.json().await.unwrap_or(serde_json::Value::Null);
    (st, v)
}

pub async fn get(url: &str) -> (u16, serde_json::Value) {
    match http().get(url).send().await {
        Ok(r) => {
            let st = r.status().as_u16();
            (st, r.json().await.unwrap_or(serde_json::Value::Null))
        }
        Err(_) => (0, serde_json::Value::Null),
    }
}

/// The default model's path (fetched by `.ci/run`).
pub fn model_path() -> PathBuf {
    let home = dspark_runtime::fetch::dspark_home(
        std::env::var_os("DSPARK_HOME")
            .map(PathBuf::from)
            .as_deref(),
    );
    dspark_runtime::fetch::resolve("smollm2-135m", &home, "python3", &mut |m| eprintln!("{m}"))
        .expect("smollm2-135m must be fetchable (run `dspark fetch-model smollm2-135m`)")
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A started etcd (Debian's etcd-server), removed on drop.
pub struct Etcd {
    pub url: String,
    proc: Child,
    dir: PathBuf,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn start_etcd() -> Etcd {
    let (cp, pp) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("dspark-etcd-{}-{cp}", std::process::id()));
    let url = format!("http://127.0.0.1:{cp}");
    let peer = format!("http://127.0.0.1:{pp}");
    let proc = Command::new("etcd")
        .args([
            "--data-dir",
            &dir.display().to_string(),
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("default={peer}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd must be installed (Debian package etcd-server; .ci/run installs it)");
    let t0 = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", cp)).is_ok() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "etcd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Etcd { url, proc, dir }
}
