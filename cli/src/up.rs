//! `dspark up`: the whole cluster on loopback — scheduler, draft workers, target workers and
//! the router as child processes of this one — and `dspark scheduler|target-worker|draft-worker|
//! router` to run one piece.

use crate::config::Global;
use clap::Args;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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
    /// Draft workers (default 1; with --in-process-drafter none start, so it takes none).
    #[arg(long)]
    pub draft_workers: Option<usize>,
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
    #[arg(long, env = "DSPARK_ETCD")]
    pub etcd: Option<String>,
    /// Router port (a fixed one: `up` prints the router's URL and waits for it there).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Router listen address: an IP address (IPv6 with or without brackets).
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
    /// Require this bearer token on /v1/* (handed to the router in its environment, never on
    /// a command line that `ps` shows).
    #[arg(long, env = "DSPARK_API_KEY")]
    pub api_key: Option<String>,
    /// Shared cluster token every process's gRPC calls carry and require (at least 16 bytes
    /// of visible ASCII); without it `up` makes a fresh random one per run. Handed to the
    /// children in their environment, never printed.
    #[arg(long, env = "DSPARK_CLUSTER_TOKEN", hide_env_values = true)]
    pub cluster_token: Option<String>,
    /// Seconds to wait for the cluster to come up.
    #[arg(long, default_value_t = 600)]
    pub startup_timeout: u64,
}

/// Settings of one process, not of a cluster (listen and published addresses, metrics ports,
/// drafter, peers): left in `up`'s environment they would reach every child, so none gets
/// them and `up` passes what it needs explicitly. The API key too: the router alone gets it.
const PER_INSTANCE_ENV: [&str; 12] = [
    "DSPARK_TARGET_LISTEN",
    "DSPARK_DRAFT_LISTEN",
    "DSPARK_TARGET_METRICS_LISTEN",
    "DSPARK_DRAFT_METRICS_LISTEN",
    "DSPARK_ADVERTISE",
    "DSPARK_LOCAL_DRAFTER",
    "DSPARK_DRAFT_WORKER",
    "DSPARK_TARGETS",
    "DSPARK_DRAFTS",
    "DSPARK_TP_PEERS",
    "DSPARK_API_KEY",
    // `up` reads it as its own --etcd and hands it on explicitly.
    "DSPARK_ETCD",
];

/// The processes started, and the cluster token each gets in `DSPARK_CLUSTER_TOKEN`.
struct Children(Vec<(String, Child)>, String);

/// A fresh cluster token: 32 hex digits from the kernel's random source.
fn fresh_token() -> anyhow::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .map_err(|e| anyhow::anyhow!("cannot make a cluster token (/dev/urandom): {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

impl Children {
    /// Starts `dspark ARGS` with `env` on top of this process's environment, less
    /// [`PER_INSTANCE_ENV`], and with the cluster token.
    fn spawn(&mut self, name: &str, args: &[String], env: &[(&str, &str)]) -> anyhow::Result<()> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .arg("--exit-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit());
        for k in PER_INSTANCE_ENV {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().copied());
        cmd.env("DSPARK_CLUSTER_TOKEN", &self.1);
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

    /// SIGTERM, then SIGKILL after a grace period ([`UP_DRAIN_S`] plus room), in waves: the
    /// router and target workers drain first, while the draft workers they draft with and the
    /// scheduler they deregister from are still up; then the draft workers; then the
    /// scheduler. `nap` sleeps up to the time given and says whether another stop signal came
    /// meanwhile: then what is still running is killed at once, and this returns true.
    fn stop(&mut self, nap: &mut dyn FnMut(Duration) -> bool) -> bool {
        let wave = |n: &str| {
            if n.starts_with("scheduler") {
                2
            } else if n.starts_with("draft-worker") {
                1
            } else {
                0
            }
        };
        let mut forced = false;
        'waves: for w in 0..=2 {
            let t0 = Instant::now();
            for (n, c) in &mut self.0 {
                // Only a child not reaped yet: its pid is still its own, not a reused one.
                if wave(n) == w
                    && matches!(c.try_wait(), Ok(None))
                    && let Ok(pid) = i32::try_from(c.id())
                {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGTERM,
                    );
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
                            note(&format!("{n} did not stop; killing it"));
                            kill_group(c);
                            let _ = c.kill();
                            let _ = c.wait();
                            break;
                        }
                        _ => {}
                    }
                    if nap(Duration::from_millis(50)) {
                        forced = true;
                        break 'waves;
                    }
                }
            }
        }
        if forced {
            note("second stop signal: killing the cluster's processes now");
            // Each child leads its own process group: what it started goes too. Nothing is
            // sent to a child already reaped (its pid may be another's by now).
            for (_, c) in &mut self.0 {
                kill_group(c);
                let _ = c.kill();
            }
            for (_, c) in &mut self.0 {
                let _ = c.wait();
            }
        }
        self.0.clear();
        forced
    }
}

/// How long the router and target workers `up` starts drain when it stops them.
const UP_DRAIN_S: &str = "3";

impl Drop for Children {
    /// What is left after a panic (`run` stops the cluster itself otherwise).
    fn drop(&mut self) {
        self.stop(&mut |d: Duration| {
            std::thread::sleep(d);
            false
        });
    }
}

/// SIGINT (Ctrl-C), SIGTERM and SIGHUP (the terminal closed), registered once (created inside
/// the runtime).
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
            _ = self.hup.recv() => {}
        }
    }
}

/// Sleeps up to `d`, listening for a stop signal meanwhile: whether one came. The runtime
/// runs while it sleeps, so a signal that came earlier is seen too.
fn nap(rt: &tokio::runtime::Runtime, signals: &mut Signals, d: Duration) -> bool {
    rt.block_on(async {
        tokio::select! {
            _ = signals.recv() => true,
            _ = tokio::time::sleep(d) => false,
        }
    })
}

/// SIGKILL to a child's process group (each child leads its own: what it started goes too);
/// nothing to a child already reaped, whose pid may be another's by now.
fn kill_group(c: &mut Child) {
    if matches!(c.try_wait(), Ok(None))
        && let Ok(pid) = i32::try_from(c.id())
    {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// A line on stderr that cannot panic: after SIGHUP the terminal may be gone.
fn note(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The router's listen address: `--host` an IP address (IPv6 with or without brackets) and
/// `--port` a fixed port, since `up` prints the router's URL and probes it there.
fn router_listen(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
    anyhow::ensure!(
        port != 0,
        "--port 0: the router needs a fixed port (`up` prints its URL and waits for it there)"
    );
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ip: IpAddr = bare.parse().map_err(|_| {
        anyhow::anyhow!("--host `{host}` is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)")
    })?;
    Ok(SocketAddr::new(ip, port))
}

/// Fails when the router could not listen on `addr` (most often: another server, or another
/// cluster, has the port), before any process starts: otherwise the readiness probe could
/// take whatever answers there for this cluster.
fn check_free(addr: SocketAddr) -> anyhow::Result<()> {
    std::net::TcpListener::bind(addr).map_err(|e| {
        anyhow::anyhow!(
            "the router cannot listen on {addr}: {e} (is another server or cluster on port {}? \
             pick another with --port)",
            addr.port()
        )
    })?;
    Ok(())
}

/// Whether the model at `path` splits into `tp` tensor-parallel ranks, from its configuration
/// alone (no weights read).
fn check_tp(path: &std::path::Path, tp: usize) -> anyhow::Result<()> {
    let cfg = if path.is_dir() {
        let p = path.join("config.json");
        let text = std::fs::read_to_string(&p)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?;
        dspark_runtime::ModelConfig::from_hf_json(&text)?
    } else {
        dspark_runtime::ModelConfig::from_gguf(&dspark_runtime::gguf::GgufFile::open(path)?)?
    };
    dspark_runtime::tp::Shard { rank: 0, world: tp }
        .local(&cfg)
        .map_err(|e| anyhow::anyhow!("--tp {tp}: {e}"))?;
    Ok(())
}

pub fn run(g: &Global, a: UpArgs) -> anyhow::Result<()> {
    if let (true, Some(n @ 1..)) = (a.in_process_drafter, a.draft_workers) {
        anyhow::bail!(
            "--draft-workers {n} with --in-process-drafter: the drafter runs inside each target \
             worker, so no draft worker would start; give one or the other"
        );
    }
    if a.draft_workers == Some(0) && !a.in_process_drafter {
        eprintln!("no draft workers: target workers decode with their local fallback drafter");
    }
    anyhow::ensure!(a.target_workers >= 1, "--target-workers must be at least 1");
    anyhow::ensure!(a.tp >= 1, "--tp must be at least 1");
    anyhow::ensure!(
        a.startup_timeout >= 1,
        "--startup-timeout must be at least 1 second (the cluster needs time to load and start)"
    );
    // What the target workers would refuse, refused before anything is fetched or started.
    target_worker::check_engine_args(a.gamma, a.max_running, &a.verify_policy)
        .map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        a.api_key.as_deref() != Some(""),
        "--api-key is empty (leave it unset to serve without a key)"
    );
    // The user's token (checked as the children would), else a fresh one for this run.
    let token = match &a.cluster_token {
        Some(t) => {
            dspark_scheduler::auth::check_token(t).map_err(anyhow::Error::msg)?;
            t.clone()
        }
        None => fresh_token()?,
    };
    let listen = router_listen(&a.host, a.port)?;
    // Fetch once here so the children do not race for the download.
    let path = g.resolve_model(&a.target)?;
    // A degree the model does not split into, refused before any rank starts.
    if a.tp > 1 {
        check_tp(&path, a.tp)?;
    }
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
    check_free(listen)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // From the first child on, Ctrl-C, SIGTERM or SIGHUP stops the cluster cleanly, while it
    // is still starting too (the default action would leave the children to notice stdin
    // closing); a second one while it stops kills what is left.
    let mut signals = rt.block_on(async { Signals::new() })?;
    let mut kids = Children(Vec::new(), token);
    let ran = run_cluster(g, &a, &drafter, listen, &rt, &mut signals, &mut kids);
    if kids.stop(&mut |d: Duration| nap(&rt, &mut signals, d)) {
        if let Err(e) = &ran {
            note(&format!("error: {e:#}"));
        }
        // As a shell reports a process killed by SIGINT; the cluster was cut, not drained.
        std::process::exit(130);
    }
    ran
}

/// Starts the cluster and serves until a stop signal (`Ok`) or until one of its processes
/// exits (`Err`); the caller stops what it started.
fn run_cluster(
    g: &Global,
    a: &UpArgs,
    drafter: &str,
    listen: SocketAddr,
    rt: &tokio::runtime::Runtime,
    signals: &mut Signals,
    kids: &mut Children,
) -> anyhow::Result<()> {
    let home = vec![
        "--python".to_string(),
        g.python.clone(),
        "--home".into(),
        g.home.display().to_string(),
    ];
    // What a process that loads a model computes with: its threads, and the global --isa.
    let compute = |threads: usize| {
        let mut v = vec!["--threads".to_string(), threads.to_string()];
        if let Some(isa) = g.isa {
            v.extend(["--isa".to_string(), isa.name().to_string()]);
        }
        v
    };
    let disc: Vec<String> = match &a.etcd {
        Some(e) => vec!["--etcd".into(), e.clone()],
        None => Vec::new(),
    };
    let sport = free_port()?;
    let sched_url = format!("http://127.0.0.1:{sport}");
    let mut s = vec![
        "scheduler".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{sport}"),
    ];
    s.extend(disc.clone());
    kids.spawn("scheduler", &s, &[])?;
    let reg: Vec<String> = if a.etcd.is_some() {
        disc.clone()
    } else {
        vec!["--scheduler".into(), sched_url.clone()]
    };
    // Worker ids: on a shared etcd another `up`'s `target-0` would take this one's entry, so
    // there they name their run too (its scheduler's port, this machine's while it runs).
    let worker_id = |role: &str, i: usize| {
        if a.etcd.is_some() {
            format!("{role}-{i}-{sport}")
        } else {
            format!("{role}-{i}")
        }
    };
    let drafts = if a.in_process_drafter {
        0
    } else {
        a.draft_workers.unwrap_or(1)
    };
    for i in 0..drafts {
        let mut d = vec![
            "draft-worker".to_string(),
            "--target".into(),
            a.target.clone(),
            "--drafter".into(),
            drafter.to_string(),
            "--id".into(),
            worker_id("draft", i),
        ];
        d.extend(reg.clone());
        d.extend(home.clone());
        d.extend(compute(g.threads));
        kids.spawn(&format!("draft-worker {i}"), &d, &[])?;
    }
    // A split target's ranks compute at the same time: they share the cores.
    let tthreads = if a.tp > 1 {
        (g.effective_threads() / a.tp).max(1)
    } else {
        g.threads
    };
    for i in 0..a.target_workers {
        let mut t = vec![
            "target-worker".to_string(),
            "--model".into(),
            a.target.clone(),
            "--id".into(),
            worker_id("target", i),
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
        if let Some(kv) = g.kv_dtype {
            t.extend(["--kv-cache-dtype".to_string(), kv.name().to_string()]);
        }
        if a.in_process_drafter {
            t.extend(["--local-drafter".to_string(), drafter.to_string()]);
        }
        if a.pingpong {
            t.push("--pingpong".into());
        }
        let mut peers = Vec::new();
        for rank in 1..a.tp {
            let peer = format!("127.0.0.1:{}", free_port()?);
            let mut s = vec![
                "tp-shard".to_string(),
                "--model".into(),
                a.target.clone(),
                "--tp-rank".into(),
                rank.to_string(),
                "--tp-size".into(),
                a.tp.to_string(),
                "--listen".into(),
                peer.clone(),
                // Outlasts its target worker's drain (it stops as soon as that one has left).
                "--drain-timeout-s".into(),
                "4".into(),
            ];
            s.extend(home.clone());
            s.extend(compute(tthreads));
            kids.spawn(&format!("target-worker {i} rank {rank}"), &s, &[])?;
            peers.push(peer);
        }
        if !peers.is_empty() {
            t.extend(["--tp-peers".to_string(), peers.join(",")]);
        }
        t.extend(reg.clone());
        // Registered through etcd, a target worker still asks this scheduler for its central
        // verification budgets (`--verify-policy scheduler`): etcd wins for registration.
        if a.etcd.is_some() {
            t.extend(["--scheduler".to_string(), sched_url.clone()]);
        }
        t.extend(home.clone());
        t.extend(compute(tthreads));
        kids.spawn(&format!("target-worker {i}"), &t, &[])?;
    }
    let mut r = vec![
        "router".to_string(),
        "--listen".into(),
        listen.to_string(),
        "--model".into(),
        a.target.clone(),
        "--scheduler".into(),
        sched_url,
        // No delay before draining (a DSPARK_SHUTDOWN_DELAY_S in the environment would push
        // the router past `up`'s grace): nothing balances load in front of it here.
        "--shutdown-delay-s".into(),
        "0".into(),
        "--drain-timeout-s".into(),
        UP_DRAIN_S.into(),
    ];
    r.extend(home);
    let key: Vec<(&str, &str)> = a
        .api_key
        .as_deref()
        .map(|k| ("DSPARK_API_KEY", k))
        .into_iter()
        .collect();
    kids.spawn("router", &r, &key)?;
    // Ready when the router sees every worker; a wildcard listen address is dialed on loopback.
    let probe = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port())
        }
        _ => listen,
    };
    let url = format!("http://{probe}");
    // The router is on this machine: a proxy from HTTP_PROXY or ALL_PROXY would not reach it.
    let http = reqwest::Client::builder()
        .no_proxy()
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
                note("stopping the cluster (it was still starting)");
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
    // The key itself is never printed: the sample reads it from the shell's environment.
    let (with_key, auth) = if a.api_key.is_some() {
        (
            " (with the API key in DSPARK_API_KEY)",
            " \\\n    -H \"Authorization: Bearer $DSPARK_API_KEY\"",
        )
    } else {
        ("", "")
    };
    out!(
        "try{with_key}:\n  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n    -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'\nCtrl-C stops the cluster.",
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
    note("stopping the cluster");
    match stop {
        Some(e) => anyhow::bail!("a cluster process died: {e}"),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_run_makes_a_fresh_valid_cluster_token() {
        let (a, b) = (fresh_token().unwrap(), fresh_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(dspark_scheduler::auth::check_token(&a).is_ok());
        assert_ne!(a, b);
    }

    #[test]
    fn the_router_listens_on_an_ip_address_and_a_fixed_free_port() {
        let at = |h: &str| router_listen(h, 8000).map(|a| a.to_string());
        assert_eq!(at("127.0.0.1").unwrap(), "127.0.0.1:8000");
        assert_eq!(at("::1").unwrap(), "[::1]:8000");
        assert_eq!(at("[::1]").unwrap(), "[::1]:8000");
        assert!(at("localhost").is_err());
        let e = router_listen("127.0.0.1", 0).unwrap_err().to_string();
        assert!(e.contains("--port 0"), "{e}");
        // A port another server holds is refused before anything starts.
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = check_free(held.local_addr().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot listen"), "{e}");
    }
}
