//! Discovery: how workers become visible to the scheduler.
//!
//! - Static (local runs): each worker calls `Scheduler.Register` as a heartbeat; a worker that
//!   stops calling expires after its TTL.
//! - etcd: each worker holds a lease and puts its `WorkerInfo` under `/dspark/workers/<id>`; the
//!   scheduler watches the prefix. Lease expiry deletes the key, which removes the worker.

use crate::{Result, SchedError};
use dspark_proto::WorkerInfo;
use dspark_proto::scheduler_client::SchedulerClient;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use prost::Message;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const ETCD_PREFIX: &str = "/dspark/workers/";

/// Where workers register.
#[derive(Clone, Debug)]
pub enum Discovery {
    /// `Scheduler.Register` at this URL (http://host:port), with the cluster token.
    Static(String, crate::ClusterAuth),
    /// etcd endpoints.
    Etcd(Vec<String>),
}

impl Discovery {
    /// `--etcd` wins over `--scheduler`; at least one is needed.
    /// `auth` goes with every call to the scheduler (etcd is not behind the cluster token).
    pub fn from_args(
        scheduler: Option<&str>,
        etcd: Option<&str>,
        auth: crate::ClusterAuth,
    ) -> Result<Self> {
        match (etcd, scheduler) {
            (Some(e), _) if !e.trim().is_empty() => Ok(Self::Etcd(etcd_endpoints(e)?)),
            (_, Some(s)) if !s.is_empty() => Ok(Self::Static(normalize_url(s), auth)),
            _ => Err(SchedError::Config(
                "a worker needs --scheduler URL or --etcd URL to register".into(),
            )),
        }
    }
}

/// The endpoints of a comma-separated `--etcd` list, trimmed, without empty entries (`a,,b`, a
/// trailing comma): an empty one would make the etcd client dial nothing. A list with none
/// left is a configuration error.
pub fn etcd_endpoints(list: &str) -> Result<Vec<String>> {
    let eps: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if eps.is_empty() {
        return Err(SchedError::Config(format!(
            "--etcd `{list}` names no endpoint (expected URL[,URL…])"
        )));
    }
    Ok(eps)
}

/// The address a worker publishes for peers to dial: `--advertise HOST[:PORT]` when given (a
/// bare host takes the bound port), else the bound address. A wildcard bind (`0.0.0.0`, `::`)
/// without `--advertise` is refused: published as is, no peer could reach it (in Kubernetes,
/// advertise the pod IP from the downward API).
pub fn advertised_address(bound: std::net::SocketAddr, advertise: Option<&str>) -> Result<String> {
    let adv = advertise.map(str::trim).filter(|a| !a.is_empty());
    let Some(a) = adv else {
        if bound.ip().is_unspecified() {
            return Err(SchedError::Config(format!(
                "listening on {bound}, which peers cannot dial: pass --advertise HOST[:PORT] \
                 (DSPARK_ADVERTISE; in Kubernetes the pod IP)"
            )));
        }
        return Ok(bound.to_string());
    };
    if a.contains("://") || a.contains('/') || a.chars().any(char::is_whitespace) {
        return Err(SchedError::Config(format!(
            "--advertise `{a}`: expected HOST or HOST:PORT, without a scheme or path"
        )));
    }
    let wildcard = |ip: std::net::IpAddr| {
        if ip.is_unspecified() {
            Err(SchedError::Config(format!(
                "--advertise `{a}`: a wildcard address cannot be dialed; give this host's address"
            )))
        } else {
            Ok(())
        }
    };
    if let Ok(sa) = a.parse::<std::net::SocketAddr>() {
        wildcard(sa.ip())?;
        return port_ok(a, sa.port()).map(|_| sa.to_string());
    }
    let bare = a
        .strip_prefix('[')
        .and_then(|x| x.strip_suffix(']'))
        .unwrap_or(a);
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        wildcard(ip)?;
        return Ok(std::net::SocketAddr::new(ip, bound.port()).to_string());
    }
    let (host, port) = match a.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => {
            let p: u16 = port.parse().map_err(|_| {
                SchedError::Config(format!("--advertise `{a}`: port `{port}` is not a number"))
            })?;
            port_ok(a, p)?;
            (host, p)
        }
        Some(_) => {
            return Err(SchedError::Config(format!(
                "--advertise `{a}`: an IPv6 address takes brackets, e.g. [::1]:50051"
            )));
        }
        None => (a, bound.port()),
    };
    if !is_host_name(host) {
        return Err(SchedError::Config(format!(
            "--advertise `{a}`: `{host}` is neither an IP address nor a host name"
        )));
    }
    Ok(format!("{host}:{port}"))
}

/// A DNS name: letters, digits, '-', '.' (an unexpanded `$(POD_IP)` is not one).
fn is_host_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host
            .split('.')
            .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
}

/// Whether `addr` is what [`advertised_address`] publishes: an IP socket address, or a host
/// name and a port (`tw-0.tw.ns.svc:50051`).
pub fn is_dialable(addr: &str) -> bool {
    if addr.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    match addr.rsplit_once(':') {
        Some((host, port)) => is_host_name(host) && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

/// What a worker publishes: [`advertised_address`] when it registers somewhere (`disc`), the
/// bound address otherwise (then nothing is published). The error is the message of the
/// worker's configuration error.
pub fn published_address(
    disc: Option<&Discovery>,
    bound: std::net::SocketAddr,
    advertise: Option<&str>,
) -> std::result::Result<String, String> {
    match disc {
        Some(_) => advertised_address(bound, advertise).map_err(|e| match e {
            SchedError::Config(m) => m,
            e => e.to_string(),
        }),
        None => Ok(bound.to_string()),
    }
}

fn port_ok(a: &str, p: u16) -> Result<()> {
    if p == 0 {
        return Err(SchedError::Config(format!(
            "--advertise `{a}`: port 0 cannot be dialed"
        )));
    }
    Ok(())
}

/// A worker's `--ttl-ms` in milliseconds, held to the TTLs the scheduler grants
/// ([`MIN_TTL`](crate::service::MIN_TTL)..=[`MAX_TTL`](crate::service::MAX_TTL)): outside them
/// the scheduler grants another TTL than the one the worker paces its heartbeats by. The error
/// is the message of the worker's configuration error.
pub fn check_ttl_ms(ttl_ms: u64, etcd: bool) -> std::result::Result<u32, String> {
    // An etcd lease takes whole seconds (at least one) and any length.
    let (lo, hi) = if etcd {
        (1, u128::from(u32::MAX))
    } else {
        (
            crate::service::MIN_TTL.as_millis(),
            crate::service::MAX_TTL.as_millis(),
        )
    };
    if !(lo..=hi).contains(&u128::from(ttl_ms)) {
        return Err(format!(
            "--ttl-ms {ttl_ms}: the scheduler accepts registration TTLs of {lo}..={hi} ms"
        ));
    }
    u32::try_from(ttl_ms).map_err(|_| format!("--ttl-ms {ttl_ms}: too large"))
}

/// The id a worker takes without `--id`: `ROLE-HOST-PORT` from its published address, in
/// `[A-Za-z0-9._-]`. The host is part of it because ports repeat across hosts, and the
/// scheduler refuses a second live worker under one id.
/// A random identity for this process start, for [`WorkerInfo::instance`]: a restart keeps its
/// id and address (same pod, same IP) but gets a new instance, so placement forgets what it
/// placed on the old process.
pub fn instance_id() -> String {
    format!("{:016x}", dspark_runtime::tp::random_id())
}

pub fn default_worker_id(role: &str, address: &str) -> String {
    let mut id = String::with_capacity(role.len() + address.len() + 1);
    id.push_str(role);
    id.push('-');
    for c in address.chars() {
        let c = if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
            c
        } else {
            '-'
        };
        // `[fd00::1]:9` reads `fd00-1-9`, not `-fd00--1--9`.
        if c != '-' || !id.ends_with('-') {
            id.push(c);
        }
    }
    if id.ends_with('-') {
        id.pop();
    }
    id
}

/// `host:port` → `http://host:port`.
pub fn normalize_url(s: &str) -> String {
    if s.starts_with("http://") || s.starts_with("https://") {
        s.to_string()
    } else {
        format!("http://{s}")
    }
}

/// Asks a worker's registrar for its next heartbeat now, because its load changed (a request
/// started or ended): placement counts what it placed since the last load report, so a report
/// that waits for the next beat (a third of the TTL) lets back-to-back requests read a free
/// worker as full. Nudged heartbeats come at most one per [`MIN_NUDGE_GAP`]
/// ([`ETCD_NUDGE_GAP`] with etcd).
#[derive(Clone, Default)]
pub struct Nudge(Arc<tokio::sync::Notify>);

impl Nudge {
    /// Callable from any thread (the engine loop's too); a nudge during a heartbeat is kept.
    pub fn nudge(&self) {
        self.0.notify_one();
    }
}

/// Least time between a heartbeat and a nudged one (bounds the reports of a busy worker).
pub const MIN_NUDGE_GAP: Duration = Duration::from_millis(50);
/// The same with etcd, where each report is a put that waits for etcd's disk and reaches every
/// watcher.
pub const ETCD_NUDGE_GAP: Duration = Duration::from_millis(200);

/// A worker's registration, kept fresh by a task until [`Registration::leave`].
pub struct Registration {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Leaves placement at once (a drain's first step), instead of waiting for a TTL or a
    /// lease to run out: the heartbeat in flight is answered first, then the worker is
    /// deregistered (static) or its lease revoked (etcd), so a late heartbeat cannot put it
    /// back. Bounded to a few seconds; a scheduler or etcd that does not answer expires it.
    pub async fn leave(self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(Duration::from_secs(4), self.task)
            .await
            .is_err()
        {
            tracing::warn!("leaving placement timed out; the registration will expire");
        }
    }
}

/// Keeps a worker registered until [`Registration::leave`] (or the task aborted).
/// `info` is called before every heartbeat so load reports stay fresh; `nudge` brings the next
/// one forward.
pub fn spawn_registrar(
    disc: Discovery,
    ttl: Duration,
    info: Arc<dyn Fn() -> WorkerInfo + Send + Sync>,
    nudge: Nudge,
) -> Registration {
    let (stop, mut rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let beat = (ttl / 3).max(Duration::from_millis(100));
        loop {
            let r = match &disc {
                Discovery::Static(url, auth) => {
                    register_static(url, auth, ttl, beat, &info, &mut rx, &nudge).await
                }
                Discovery::Etcd(eps) => register_etcd(eps, ttl, beat, &info, &mut rx, &nudge).await,
            };
            match r {
                Ok(()) => return, // left
                Err(e) if *rx.borrow() => {
                    // Asked to leave while the connection was down: one direct attempt.
                    tracing::warn!("registration: {e}");
                    let i = info();
                    let id = i.id;
                    match deregister(&disc, &id, &i.address).await {
                        Ok(()) => tracing::info!(worker = id, "left placement"),
                        Err(e) => tracing::warn!(worker = id, "{e} (its TTL will expire it)"),
                    }
                    return;
                }
                Err(e) => tracing::warn!("registration: {e}; retrying"),
            }
            if !pause(beat, &mut rx, None).await {
                continue; // asked to leave: the next attempt leaves
            }
        }
    });
    Registration { stop, task }
}

/// Sleeps `d`, or until nudged (but at least the gap given with the nudge); false if asked to
/// leave meanwhile. A [`Registration`] dropped without leaving keeps the heartbeat going at its
/// pace (its sender gone, `changed` fails at once: sleep anyway, nudges unheard).
async fn pause(
    d: Duration,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    nudge: Option<(&Nudge, Duration)>,
) -> bool {
    if *stop.borrow() {
        return false;
    }
    let start = tokio::time::Instant::now();
    let nudged = async {
        match nudge {
            Some((n, gap)) => {
                n.0.notified().await;
                tokio::time::sleep_until(start + gap.min(d)).await;
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = nudged => true,
        r = stop.changed() => {
            if r.is_err() {
                tokio::time::sleep(d).await;
                return true;
            }
            !*stop.borrow()
        }
    }
}

/// Heartbeats until asked to leave (then deregisters: Ok) or the scheduler fails (Err).
async fn register_static(
    url: &str,
    auth: &crate::ClusterAuth,
    ttl: Duration,
    beat: Duration,
    info: &Arc<dyn Fn() -> WorkerInfo + Send + Sync>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    nudge: &Nudge,
) -> Result<()> {
    // A scheduler that vanished without closing the connection (its node gone) must not hold a
    // heartbeat forever: each call gets a TTL, then the worker reconnects, to a replacement too.
    let limit = ttl.max(Duration::from_secs(1));
    let ch = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| SchedError::Discovery(format!("scheduler {url}: {e}")))?
        .connect_timeout(limit)
        .timeout(limit)
        .connect()
        .await
        .map_err(|e| SchedError::Discovery(format!("scheduler {url}: {e}")))?;
    let mut c = SchedulerClient::new(auth.channel(ch));
    loop {
        let mut i = info();
        if *stop.borrow() {
            // On the same connection, after the last heartbeat was answered.
            return match c
                .deregister(dspark_proto::WorkerId {
                    id: i.id.clone(),
                    address: i.address.clone(),
                })
                .await
            {
                Ok(_) => {
                    tracing::info!(worker = i.id, "left placement");
                    Ok(())
                }
                Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
                Err(s) => Err(SchedError::Discovery(format!(
                    "deregister: {}",
                    s.message()
                ))),
            };
        }
        i.ttl_ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
        let granted = c
            .register(i)
            .await
            .map_err(|e| SchedError::Discovery(format!("register: {}", e.message())))?
            .into_inner()
            .ttl_ms;
        // A scheduler that grants a shorter TTL than asked (its own limits) expires a worker
        // that beats at a third of what it asked for.
        let beat = match granted {
            0 => beat,
            g => beat.min((Duration::from_millis(g.into()) / 3).max(MIN_NUDGE_GAP)),
        };
        pause(beat, stop, Some((nudge, MIN_NUDGE_GAP))).await;
    }
}

/// Holds a lease and keeps the worker's key under it until asked to leave (then revokes the
/// lease, which deletes the key and refuses any later put under it: Ok) or etcd fails (Err).
async fn register_etcd(
    eps: &[String],
    ttl: Duration,
    beat: Duration,
    info: &Arc<dyn Fn() -> WorkerInfo + Send + Sync>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    nudge: &Nudge,
) -> Result<()> {
    let mut c = etcd_connect(eps).await?;
    let lease = c
        .lease_grant(lease_secs(ttl), None)
        .await
        .map_err(etcd_err)?;
    // etcd may grant more (its minimum) or, by policy, less: renewals keep to a third of it.
    let beat = match u64::try_from(lease.ttl()) {
        Ok(g) if g > 0 => beat.min((Duration::from_secs(g) / 3).max(ETCD_NUDGE_GAP)),
        _ => beat,
    };
    let (mut keeper, mut acks) = c.lease_keep_alive(lease.id()).await.map_err(etcd_err)?;
    // The lease is renewed at the heartbeat's pace; a nudged report only puts.
    let mut renewed: Option<tokio::time::Instant> = None;
    loop {
        let mut i = info();
        if *stop.borrow() {
            c.lease_revoke(lease.id()).await.map_err(etcd_err)?;
            tracing::info!(worker = i.id, "left placement (lease revoked)");
            return Ok(());
        }
        i.ttl_ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
        let key = format!("{ETCD_PREFIX}{}", i.id);
        // Renewal alongside the put, not after it: a put waits for etcd's disk (fsync), and one
        // slow write on a busy disk must not let the lease run out.
        let put = c.put(
            key,
            i.encode_to_vec(),
            Some(PutOptions::new().with_lease(lease.id())),
        );
        let due = renewed.is_none_or(|t| t.elapsed() >= beat);
        let renew = async {
            if !due {
                return Ok(());
            }
            keeper.keep_alive().await.map_err(etcd_err)?;
            match acks.message().await.map_err(etcd_err)? {
                Some(a) if a.ttl() > 0 => Ok(()),
                _ => Err(SchedError::Discovery("lease expired".into())),
            }
        };
        let t = tokio::time::Instant::now();
        // Bounded by the lease: past it the key is gone anyway, and a fresh lease is the way
        // back (an etcd that stopped answering without closing the connection).
        let (put, renew) = tokio::time::timeout(ttl.max(beat), async { tokio::join!(put, renew) })
            .await
            .map_err(|_| SchedError::Discovery("etcd: no answer within the lease".into()))?;
        put.map_err(etcd_err)?;
        renew?;
        if due {
            renewed = Some(t);
        }
        // Until the next renewal is due, not a whole beat: after a nudged put the renewal
        // would otherwise wait up to two beats, and the lease lapse under a healthy worker.
        let wait = until_renewal(renewed, beat, tokio::time::Instant::now());
        pause(wait, stop, Some((nudge, ETCD_NUDGE_GAP))).await;
    }
}

/// The lease asked for `ttl`, in etcd's whole seconds: rounded up (2.9 s down to 2 s left
/// a renewal every 0.97 s too little room), at least 1.
fn lease_secs(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000).max(1)).unwrap_or(i64::MAX)
}

/// How long the registrar may sleep before the lease's renewal (every `beat`) is due.
fn until_renewal(
    renewed: Option<tokio::time::Instant>,
    beat: Duration,
    now: tokio::time::Instant,
) -> Duration {
    renewed.map_or(Duration::ZERO, |t| {
        (t + beat).saturating_duration_since(now)
    })
}

/// Takes a worker out of placement at once (a drain's first step), instead of waiting for its
/// TTL or lease to run out. Stop its registrar first, or the next heartbeat puts it back.
pub async fn deregister(disc: &Discovery, id: &str, address: &str) -> Result<()> {
    let limit = Duration::from_secs(2);
    let work = async {
        match disc {
            Discovery::Static(url, auth) => {
                let ch = tonic::transport::Endpoint::from_shared(url.to_string())
                    .map_err(|e| SchedError::Discovery(format!("scheduler {url}: {e}")))?
                    .connect_timeout(limit)
                    .connect()
                    .await
                    .map_err(|e| SchedError::Discovery(format!("scheduler {url}: {e}")))?;
                match SchedulerClient::new(auth.channel(ch))
                    .deregister(dspark_proto::WorkerId {
                        id: id.to_string(),
                        address: address.to_string(),
                    })
                    .await
                {
                    // Already gone (expired, or a scheduler that restarted): the same outcome.
                    Ok(_) => Ok(()),
                    Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
                    Err(s) => Err(SchedError::Discovery(format!(
                        "deregister: {}",
                        s.message()
                    ))),
                }
            }
            Discovery::Etcd(eps) => {
                let mut c = etcd_connect(eps).await?;
                c.delete(format!("{ETCD_PREFIX}{id}"), None)
                    .await
                    .map_err(etcd_err)?;
                Ok(())
            }
        }
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| SchedError::Discovery("deregister: timed out".into()))?
}

/// Connects with HTTP/2 pings, so an etcd member that vanishes without closing the connection
/// (a partition, a dead node) fails the watch and the registrar's calls instead of leaving them
/// waiting forever; and with a leader required, so a member cut off from its cluster cancels
/// the watch rather than serving a stale view.
async fn etcd_connect(eps: &[String]) -> Result<Client> {
    // Pings only while a stream is open: etcd answers pings on an idle connection (the other
    // endpoints' of a list) with GOAWAY, and takes none more often than every 5 s.
    let opts = ConnectOptions::new()
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(false)
        .with_connect_timeout(Duration::from_secs(5))
        .with_require_leader(true);
    Client::connect(eps, Some(opts)).await.map_err(etcd_err)
}

/// A worker entry read from etcd, held to what `Register` accepts: anyone who can write the
/// prefix reaches placement through it. The id must be the key's, since a delete names the key.
pub fn etcd_entry(key: &[u8], value: &[u8]) -> std::result::Result<WorkerInfo, String> {
    let key = String::from_utf8_lossy(key);
    let i =
        WorkerInfo::decode(value).map_err(|e| format!("undecodable worker entry {key}: {e}"))?;
    crate::service::check_info(&i).map_err(|s| format!("worker entry {key}: {}", s.message()))?;
    if key.strip_prefix(ETCD_PREFIX) != Some(i.id.as_str()) {
        return Err(format!("worker entry {key} names worker `{}`", i.id));
    }
    Ok(i)
}

/// Adds or refreshes an etcd worker, unless its entry is refused or the view is full (then an
/// earlier entry of that key leaves: the key no longer says it). The id placed, if any.
fn upsert_etcd(cl: &mut crate::placement::Cluster, key: &[u8], value: &[u8]) -> Option<String> {
    match etcd_entry(key, value) {
        // A worker that registers through `Register` keeps its own entry (and TTL).
        Ok(i) if cl.ttl_of(&i.id).is_some_and(|t| t != ETCD_LOCAL_TTL) => {
            tracing::warn!(
                worker = i.id,
                "etcd: also registered through Register; ignored"
            );
            None
        }
        Ok(i) if cl.contains(&i.id) || cl.len() < crate::service::MAX_WORKERS => {
            let id = i.id.clone();
            cl.upsert(i, ETCD_LOCAL_TTL, Instant::now());
            Some(id)
        }
        Ok(i) => {
            tracing::warn!(
                worker = i.id,
                "etcd: {} workers known already (at most {}); ignored",
                cl.len(),
                crate::service::MAX_WORKERS
            );
            None
        }
        Err(e) => {
            tracing::warn!("etcd: {e}; ignored");
            // An earlier entry of this key leaves (not a worker registered by `Register`).
            if let Some(id) = String::from_utf8_lossy(key).strip_prefix(ETCD_PREFIX) {
                cl.remove_with_ttl(id, ETCD_LOCAL_TTL);
            }
            None
        }
    }
}

fn etcd_err(e: etcd_client::Error) -> SchedError {
    SchedError::Discovery(format!("etcd: {e}"))
}

/// Mirrors the etcd worker prefix into the cluster view (reconnecting on errors). The view is
/// marked live ([`Cluster::set_etcd_live`](crate::placement::Cluster::set_etcd_live)) once a
/// snapshot is in it, and stale from now on and whenever the watch fails, until the next
/// snapshot: meanwhile it misses every put and delete (load reports, lease expiries).
pub fn spawn_etcd_watcher(
    eps: Vec<String>,
    cluster: Arc<Mutex<crate::placement::Cluster>>,
) -> tokio::task::JoinHandle<()> {
    // Before the first call can be served: no snapshot yet.
    if let Ok(mut c) = cluster.lock() {
        c.set_etcd_live(false);
    }
    tokio::spawn(async move {
        loop {
            let r = watch_etcd(&eps, &cluster).await;
            if let Ok(mut c) = cluster.lock()
                && c.etcd_live() == Some(true)
            {
                c.set_etcd_live(false);
                tracing::warn!("etcd watch lost: placement defers to the routers' views");
            }
            if let Err(e) = r {
                tracing::warn!("etcd watch: {e}; retrying");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

/// Workers seen through etcd never expire locally: etcd's lease does that.
const ETCD_LOCAL_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

async fn watch_etcd(eps: &[String], cluster: &Arc<Mutex<crate::placement::Cluster>>) -> Result<()> {
    let mut c = etcd_connect(eps).await?;
    let snap = c
        .get(ETCD_PREFIX, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(etcd_err)?;
    {
        let mut cl = cluster.lock().map_err(|_| SchedError::Poisoned)?;
        // Who left goes first, so the worker cap counts what etcd holds now.
        let keys: std::collections::HashSet<String> = snap
            .kvs()
            .iter()
            .filter_map(|kv| {
                String::from_utf8_lossy(kv.key())
                    .strip_prefix(ETCD_PREFIX)
                    .map(str::to_string)
            })
            .collect();
        for id in cl.forget_missing(ETCD_LOCAL_TTL, &keys) {
            tracing::info!(
                worker = id,
                "worker left (etcd key gone while not watching)"
            );
        }
        for kv in snap.kvs() {
            upsert_etcd(&mut cl, kv.key(), kv.value());
        }
        // Under the lock, so no placement reads the view half-updated as live.
        if cl.etcd_live() != Some(true) {
            cl.set_etcd_live(true);
            tracing::info!(workers = cl.len(), "etcd view current");
        }
    }
    let rev = snap.header().map(|h| h.revision() + 1).unwrap_or(0);
    let mut stream = c
        .watch(
            ETCD_PREFIX,
            Some(WatchOptions::new().with_prefix().with_start_revision(rev)),
        )
        .await
        .map_err(etcd_err)?;
    while let Some(msg) = stream.message().await.map_err(etcd_err)? {
        // etcd ends a watch it can no longer serve (its start revision compacted away, the
        // member without a leader) with a message, not by closing the stream: list again.
        if msg.canceled() || msg.compact_revision() > 0 {
            return Err(SchedError::Discovery(format!(
                "watch cancelled by etcd (compacted to {}): {}",
                msg.compact_revision(),
                msg.cancel_reason()
            )));
        }
        let mut cl = cluster.lock().map_err(|_| SchedError::Poisoned)?;
        for ev in msg.events() {
            let Some(kv) = ev.kv() else { continue };
            match ev.event_type() {
                EventType::Put => {
                    upsert_etcd(&mut cl, kv.key(), kv.value());
                }
                EventType::Delete => {
                    let key = String::from_utf8_lossy(kv.key());
                    if let Some(id) = key.strip_prefix(ETCD_PREFIX)
                        && cl.remove_with_ttl(id, ETCD_LOCAL_TTL)
                    {
                        tracing::info!(worker = id, "worker left (etcd lease gone)");
                    }
                }
            }
        }
    }
    Err(SchedError::Discovery("watch stream ended".into()))
}

#[cfg(test)]
mod tests {
    use super::{
        Discovery, ETCD_NUDGE_GAP, ETCD_PREFIX, advertised_address, check_ttl_ms,
        default_worker_id, etcd_endpoints, etcd_entry, is_dialable, lease_secs, until_renewal,
    };
    use dspark_proto::WorkerInfo;
    use prost::Message;
    use std::time::Duration;

    #[test]
    fn etcd_lists_drop_empty_entries_and_refuse_an_empty_one() {
        assert_eq!(
            etcd_endpoints(" http://a:2379,, http://b:2379 ,").unwrap(),
            ["http://a:2379", "http://b:2379"]
        );
        assert!(etcd_endpoints(",").is_err());
        assert!(etcd_endpoints(" , ,").is_err());
        match Discovery::from_args(None, Some("http://a:2379,"), Default::default()).unwrap() {
            Discovery::Etcd(eps) => assert_eq!(eps, ["http://a:2379"]),
            d => panic!("{d:?}"),
        }
        assert!(Discovery::from_args(Some("http://s:1"), Some(","), Default::default()).is_err());
        // An empty flag is no flag.
        assert!(matches!(
            Discovery::from_args(Some("http://s:1"), Some(""), Default::default()),
            Ok(Discovery::Static(..))
        ));
    }

    /// What a worker advertises, and only that, is an address others accept (the target
    /// worker's check of a request's draft worker among them).
    #[test]
    fn dialable_addresses_are_what_workers_advertise() {
        for ok in [
            "127.0.0.1:5",
            "[::1]:5",
            "tw-0.tw.ns.svc:50051",
            "localhost:9",
        ] {
            assert!(is_dialable(ok), "{ok}");
        }
        for bad in [
            "nowhere",
            "host:0",
            "host:port",
            "a b:5",
            ":5",
            "$(POD_IP):5",
            "h:70000",
        ] {
            assert!(!is_dialable(bad), "{bad}");
        }
    }

    /// What etcd holds is checked as a registration is: a bad or mislabelled entry never
    /// reaches placement.
    #[test]
    fn etcd_entries_are_held_to_registration_rules() {
        let good = WorkerInfo {
            id: "t-1".into(),
            role: crate::placement::ROLE_TARGET.into(),
            address: "127.0.0.1:5000".into(),
            ..Default::default()
        };
        let key = |id: &str| format!("{ETCD_PREFIX}{id}").into_bytes();
        let got = etcd_entry(&key("t-1"), &good.encode_to_vec()).expect("a good entry");
        assert_eq!(got.id, "t-1");
        // A host name is an address a worker may advertise (`--advertise tw-0.tw.ns.svc`).
        let named = WorkerInfo {
            address: "tw-0.tw.ns.svc:50051".into(),
            ..good.clone()
        };
        assert!(etcd_entry(&key("t-1"), &named.encode_to_vec()).is_ok());
        // The key names another worker: a later delete of `t-10` would leave `t-1` behind.
        let e = etcd_entry(&key("t-10"), &good.encode_to_vec()).unwrap_err();
        assert!(e.contains("names worker `t-1`"), "{e}");
        let e = etcd_entry(&key("t-1"), b"\xff\xff\xff").unwrap_err();
        assert!(e.contains("undecodable"), "{e}");
        for (bad, says) in [
            (
                WorkerInfo {
                    role: "boss".into(),
                    ..good.clone()
                },
                "role",
            ),
            (
                WorkerInfo {
                    address: "nowhere".into(),
                    ..good.clone()
                },
                "address",
            ),
            (
                WorkerInfo {
                    id: String::new(),
                    ..good.clone()
                },
                "worker id",
            ),
            (
                WorkerInfo {
                    sps: vec![Default::default(); 100_000],
                    ..good.clone()
                },
                "sps",
            ),
        ] {
            let e = etcd_entry(&key(&bad.id), &bad.encode_to_vec()).unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
        }
    }

    /// A TTL the scheduler would clamp is refused up front, and none is truncated to 32 bits
    /// (2^32 + 3000 ms once read as 3 s).
    #[test]
    fn registration_ttls_are_what_the_scheduler_grants() {
        assert_eq!(check_ttl_ms(100, true), Ok(100));
        assert_eq!(check_ttl_ms(300_000, true), Ok(300_000));
        assert!(check_ttl_ms(0, true).is_err());
        assert_eq!(check_ttl_ms(200, false), Ok(200));
        assert_eq!(check_ttl_ms(3000, false), Ok(3000));
        assert_eq!(check_ttl_ms(60_000, false), Ok(60_000));
        for bad in [0, 199, 60_001, (1 << 32) + 3000, u64::MAX] {
            let e = check_ttl_ms(bad, false).unwrap_err();
            assert!(
                e.contains("--ttl-ms") && e.contains("200..=60000"),
                "{bad}: {e}"
            );
        }
    }

    /// Default ids name the host too (ports repeat across hosts), in characters any id takes.
    #[test]
    fn default_ids_name_host_and_port() {
        assert_eq!(
            default_worker_id("target", "10.0.0.1:50051"),
            "target-10.0.0.1-50051"
        );
        assert_ne!(
            default_worker_id("target", "10.0.0.1:50051"),
            default_worker_id("target", "10.0.0.2:50051")
        );
        assert_eq!(
            default_worker_id("draft", "tw-0.tw.ns.svc:9"),
            "draft-tw-0.tw.ns.svc-9"
        );
        assert_eq!(default_worker_id("draft", "[fd00::1]:9"), "draft-fd00-1-9");
    }

    #[test]
    fn advertised_address_is_dialable() {
        let wild: std::net::SocketAddr = "0.0.0.0:50051".parse().unwrap();
        let lo: std::net::SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(advertised_address(lo, None).unwrap(), "127.0.0.1:4000");
        assert_eq!(
            advertised_address(lo, Some("  ")).unwrap(),
            "127.0.0.1:4000"
        );
        let e = advertised_address(wild, None).unwrap_err().to_string();
        assert!(
            e.contains("--advertise") && e.contains("0.0.0.0:50051"),
            "{e}"
        );
        // A bare host takes the bound port; an explicit port wins.
        assert_eq!(
            advertised_address(wild, Some("10.1.2.3")).unwrap(),
            "10.1.2.3:50051"
        );
        assert_eq!(
            advertised_address(wild, Some("10.1.2.3:7")).unwrap(),
            "10.1.2.3:7"
        );
        assert_eq!(
            advertised_address(wild, Some("tw-0.tw.ns.svc")).unwrap(),
            "tw-0.tw.ns.svc:50051"
        );
        assert_eq!(
            advertised_address(wild, Some("fd00::1")).unwrap(),
            "[fd00::1]:50051"
        );
        assert_eq!(
            advertised_address(wild, Some("[fd00::1]:9")).unwrap(),
            "[fd00::1]:9"
        );
        assert_eq!(
            advertised_address(wild, Some("[fd00::1]")).unwrap(),
            "[fd00::1]:50051"
        );
        for bad in [
            "0.0.0.0",
            "0.0.0.0:5",
            "::",
            "[::]:5",
            "$(POD_IP)",
            "$(POD_IP):5",
            "bad_host:5",
            ":5",
            "http://10.0.0.1:1",
            "host:port",
            "host:0",
            "a b",
            "host:1/x",
            "fd00::1:zz",
        ] {
            let e = advertised_address(wild, Some(bad)).unwrap_err().to_string();
            assert!(e.contains("--advertise"), "{bad}: {e}");
        }
    }

    /// The etcd registrar's pace: a lease rounded up to whole seconds, and a renewal every
    /// beat even when nudged puts keep waking the loop just before one is due (it then slept a
    /// whole beat more: renewals up to two beats apart, past a 2 s lease).
    #[test]
    fn renewals_keep_their_beat_under_nudges_and_the_lease_rounds_up() {
        assert_eq!(lease_secs(Duration::from_millis(2900)), 3);
        assert_eq!(lease_secs(Duration::from_millis(3000)), 3);
        assert_eq!(lease_secs(Duration::from_millis(1)), 1);
        // The loop with its clock simulated: a pass renews when due, then sleeps for
        // `until_renewal` or until the next nudge (a nudge every 950 ms, past the nudge gap).
        let beat = Duration::from_millis(966);
        let start = tokio::time::Instant::now();
        let nudges = |from: tokio::time::Instant| {
            let k = (from - start).as_millis() / 950 + 1;
            start + Duration::from_millis((k * 950) as u64)
        };
        let (mut now, mut renewed, mut widest) = (start, None, Duration::ZERO);
        while now - start < Duration::from_secs(60) {
            if renewed.is_none_or(|t| now - t >= beat) {
                if let Some(t) = renewed {
                    widest = widest.max(now - t);
                }
                renewed = Some(now);
            }
            let wait = until_renewal(renewed, beat, now);
            let nudged = nudges(now).max(now + ETCD_NUDGE_GAP.min(wait));
            now = (now + wait).min(nudged);
        }
        assert!(widest <= beat, "renewals {widest:?} apart, beat {beat:?}");
    }
}
