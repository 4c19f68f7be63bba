//! `dspark up`: the whole cluster on loopback — scheduler, draft workers, target workers and
//! the router as child processes of this one — and `dspark scheduler|target-worker|draft-worker|
//! router` to run one piece.

use crate::config::Global;
use clap::Args;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Target model served.
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// Drafter hosted by the draft workers: ngram | draft-model[:NAME] | dspark[:DIR]
    /// (default: the shipped DSpark drafter for the target, else ngram).
    #[arg(long)]
    pub drafter: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub draft_workers: usize,
    #[arg(long, default_value_t = 1)]
    pub target_workers: usize,
    /// Tensor-parallel degree of each target worker: it runs as rank 0 with this many minus
    /// one `dspark tp-shard` processes, each holding its share of the heads and FFN columns
    /// (the degree must divide the model's KV heads: 3 for SmolLM2).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Run the drafter inside each target worker instead of in draft workers (for comparison).
    #[arg(long)]
    pub in_process_drafter: bool,
    /// etcd endpoints for discovery (default: workers register with the scheduler directly).
    #[arg(long)]
    pub etcd: Option<String>,
    /// Router port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Draft length.
    #[arg(long, default_value_t = 4)]
    pub gamma: usize,
    /// Requests each target worker decodes at once.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Verification lengths: `gate` (per request) or `scheduler` (hardware-aware admission from
    /// confidences and the profiled SPS(B) table; profiles once per machine and model).
    #[arg(long, default_value = "gate")]
    pub verify_policy: String,
    /// Target workers verify two micro-batches in ping-pong to hide the drafting hop.
    #[arg(long)]
    pub pingpong: bool,
    /// Require this bearer token on /v1/*.
    #[arg(long, env = "DSPARK_API_KEY")]
    pub api_key: Option<String>,
    /// Seconds to wait for the cluster to come up.
    #[arg(long, default_value_t = 600)]
    pub startup_timeout: u64,
}

struct Children(Vec<(String, Child)>);

impl Children {
    fn spawn(&mut self, name: &str, args: &[String]) -> anyhow::Result<()> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .arg("--exit-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit());
        // A process group of its own: a terminal's Ctrl-C reaches `up` alone, which stops the
        // children with one SIGTERM each, so they drain (a second signal would cut them).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let c = cmd.spawn()?;
        self.0.push((name.to_string(), c));
        Ok(())
    }

    fn exited(&mut self) -> Option<String> {
        for (n, c) in &mut self.0 {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(format!("{n} exited ({st})"));
            }
        }
        None
    }

    /// SIGTERM (through `kill`), then SIGKILL after a grace period ([`UP_DRAIN_S`] plus room),
    /// in waves: the router and target workers drain first, while the draft workers they draft
    /// with and the scheduler they deregister from are still up; then the draft workers; then
    /// the scheduler.
    fn stop(&mut self) {
        let wave = |n: &str| {
            if n.starts_with("scheduler") {
                2
            } else if n.starts_with("draft-worker") {
                1
            } else {
                0
            }
        };
        for w in 0..=2 {
            let t0 = Instant::now();
            for (n, c) in &mut self.0 {
                if wave(n) == w {
                    let _ = Command::new("kill")
                        .args(["-TERM", &c.id().to_string()])
                        .stderr(Stdio::null())
                        .status();
                }
            }
            for (n, c) in &mut self.0 {
                if wave(n) != w {
                    continue;
                }
                loop {
                    match c.try_wait() {
                        Ok(Some(_)) => break,
                        _ if t0.elapsed() > Duration::from_secs(5) => {
                            eprintln!("{n} did not stop; killing it");
                            let _ = c.kill();
                            let _ = c.wait();
                            break;
                        }
                        _ => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            }
        }
        self.0.clear();
    }
}

/// How long the router and target workers `up` starts drain when it stops them.
const UP_DRAIN_S: &str = "3";

impl Drop for Children {
    fn drop(&mut self) {
        self.stop();
    }
}

/// SIGINT (Ctrl-C) and SIGTERM, registered once (created inside the runtime).
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub fn run(g: &Global, a: UpArgs) -> anyhow::Result<()> {
    if a.draft_workers == 0 && !a.in_process_drafter {
        eprintln!("no draft workers: target workers decode with their local fallback drafter");
    }
    anyhow::ensure!(a.target_workers >= 1, "--target-workers must be at least 1");
    anyhow::ensure!(a.tp >= 1, "--tp must be at least 1");
    // Fetch once here so the children do not race for the download.
    g.resolve_model(&a.target)?;
    let drafter = a
        .drafter
        .clone()
        .unwrap_or_else(|| drafter::build::default_kind_for(&a.target).label());
    // And the draft model a draft-model drafter loads (each draft worker would fetch it).
    if let specdec::ProposerKind::DraftModel(d) =
        specdec::ProposerKind::parse(&drafter, drafter::build::default_draft_for(&a.target))?
    {
        g.resolve_model(&d)?;
    }
    let mut common = vec![
        "--python".to_string(),
        g.python.clone(),
        "--home".into(),
        g.home.display().to_string(),
    ];
    let disc: Vec<String> = match &a.etcd {
        Some(e) => vec!["--etcd".into(), e.clone()],
        None => Vec::new(),
    };
    let sport = free_port()?;
    let sched_url = format!("http://127.0.0.1:{sport}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // From the first child on, Ctrl-C or SIGTERM stops the cluster cleanly, while it is still
    // starting too (the default action would leave the children to notice stdin closing).
    let mut signals = rt.block_on(async { Signals::new() })?;
    let mut kids = Children(Vec::new());
    let mut s = vec![
        "scheduler".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{sport}"),
    ];
    s.extend(disc.clone());
    kids.spawn("scheduler", &s)?;
    let reg: Vec<String> = if a.etcd.is_some() {
        disc.clone()
    } else {
        vec!["--scheduler".into(), sched_url.clone()]
    };
    common.extend(["--threads".into(), g.threads.to_string()]);
    let drafts = if a.in_process_drafter {
        0
    } else {
        a.draft_workers
    };
    for i in 0..drafts {
        let mut d = vec![
            "draft-worker".to_string(),
            "--target".into(),
            a.target.clone(),
            "--drafter".into(),
            drafter.clone(),
            "--id".into(),
            format!("draft-{i}"),
        ];
        d.extend(reg.clone());
        d.extend(common.clone());
        kids.spawn(&format!("draft-worker {i}"), &d)?;
    }
    // A split target's ranks compute at the same time: they share the cores.
    let mut tcommon = common.clone();
    if a.tp > 1 {
        let n = tcommon.len();
        tcommon[n - 1] = (g.effective_threads() / a.tp).max(1).to_string();
    }
    for i in 0..a.target_workers {
        let mut t = vec![
            "target-worker".to_string(),
            "--model".into(),
            a.target.clone(),
            "--id".into(),
            format!("target-{i}"),
            "--gamma".into(),
            a.gamma.to_string(),
            "--max-running".into(),
            a.max_running.to_string(),
            "--verify-policy".into(),
            a.verify_policy.clone(),
            // Stopping `up` stops everything within its 5 s grace: drains stay shorter.
            "--drain-timeout-s".into(),
            UP_DRAIN_S.into(),
        ];
        if a.in_process_drafter {
            t.extend(["--local-drafter".into(), drafter.clone()]);
        }
        if a.pingpong {
            t.push("--pingpong".into());
        }
        let mut peers = Vec::new();
        for rank in 1..a.tp {
            let listen = format!("127.0.0.1:{}", free_port()?);
            let mut s = vec![
                "tp-shard".to_string(),
                "--model".into(),
                a.target.clone(),
                "--tp-rank".into(),
                rank.to_string(),
                "--tp-size".into(),
                a.tp.to_string(),
                "--listen".into(),
                listen.clone(),
                // Outlasts its target worker's drain (it stops as soon as that one has left).
                "--drain-timeout-s".into(),
                "4".into(),
            ];
            s.extend(tcommon.clone());
            kids.spawn(&format!("target-worker {i} rank {rank}"), &s)?;
            peers.push(listen);
        }
        if !peers.is_empty() {
            t.extend(["--tp-peers".into(), peers.join(",")]);
        }
        t.extend(reg.clone());
        t.extend(tcommon.clone());
        kids.spawn(&format!("target-worker {i}"), &t)?;
    }
    let listen = format!("{}:{}", a.host, a.port);
    let mut r = vec![
        "router".to_string(),
        "--listen".into(),
        listen.clone(),
        "--model".into(),
        a.target.clone(),
        "--scheduler".into(),
        sched_url,
        "--drain-timeout-s".into(),
        UP_DRAIN_S.into(),
    ];
    if let Some(k) = &a.api_key {
        r.extend(["--api-key".into(), k.clone()]);
    }
    r.extend(common[..4].iter().cloned());
    kids.spawn("router", &r)?;
    // Ready when the router sees every worker.
    let url = format!("http://{listen}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let t0 = Instant::now();
    loop {
        if let Some(e) = kids.exited() {
            anyhow::bail!("cluster failed to start: {e}");
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(a.startup_timeout),
            "cluster not ready after {} s",
            a.startup_timeout
        );
        let check = async {
            let r = http.get(format!("{url}/ready")).send().await.ok()?;
            let v: serde_json::Value = r.json().await.ok()?;
            Some(
                v["target_workers"].as_u64()? as usize >= a.target_workers
                    && v["draft_workers"].as_u64()? as usize >= drafts,
            )
        };
        let ready = rt.block_on(async {
            tokio::select! {
                _ = signals.recv() => None,
                r = async {
                    let r = check.await;
                    if r != Some(true) {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    r
                } => Some(r),
            }
        });
        match ready {
            None => {
                eprintln!("stopping the cluster (it was still starting)");
                kids.stop();
                return Ok(());
            }
            Some(Some(true)) => break,
            Some(_) => {}
        }
    }
    out!(
        "\ndspark cluster up in {:.1} s: router {url} · {} target worker(s){} · {} draft worker(s) ({drafter}{})",
        t0.elapsed().as_secs_f64(),
        a.target_workers,
        if a.tp > 1 {
            format!(" of {} tensor-parallel ranks", a.tp)
        } else {
            String::new()
        },
        drafts,
        if a.in_process_drafter {
            ", in-process"
        } else {
            ""
        }
    )?;
    out!(
        "try:\n  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'\nCtrl-C stops the cluster.",
        a.target
    )?;
    let stop = rt.block_on(async {
        loop {
            tokio::select! {
                _ = signals.recv() => return None,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    if let Some(e) = kids.exited() { return Some(e); }
                }
            }
        }
    });
    eprintln!("stopping the cluster");
    kids.stop();
    match stop {
        Some(e) => anyhow::bail!("a cluster process died: {e}"),
        None => Ok(()),
    }
}
