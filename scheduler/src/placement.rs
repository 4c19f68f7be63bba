//! The cluster view and placement: pure data, no I/O.
//!
//! Workers appear by registration (static mode) or an etcd lease (discovery mode) and vanish when
//! their TTL passes. A new request goes to the least-loaded target worker of its model that has
//! room, paired with the least-loaded draft worker of the same model and vocabulary.
//!
//! **Prefix affinity.** Target workers cache the KV of the 16-token blocks their requests
//! started with. The router sends the chained hashes of a prompt's leading blocks
//! ([`prefix_hashes`]); the scheduler remembers, per target worker, the hashes of what it placed
//! there, and sends a request to the worker that holds the longest run of its blocks, as long
//! as that worker's load (relative to its capacity) is within a slack of the least-loaded one.
//! Otherwise, or when nothing matches, load decides alone. What a worker remembers is a
//! bounded, least-recently-placed set: an estimate of its cache, as SGLang's router keeps.
//!
//! Time the scheduler itself did not run (SIGSTOP, a paused VM, a starved process) is not held
//! against workers: their heartbeats could not be heard then, so a sweep that finds the previous
//! one far behind gives every worker a fresh TTL to check in instead of dropping them all.

use dspark_proto::WorkerInfo;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

pub const ROLE_TARGET: &str = "target";
pub const ROLE_DRAFT: &str = "draft";

/// Tokens per hashed block: the target workers' KV block size.
pub const PREFIX_BLOCK: usize = 16;
/// Leading blocks of a prompt hashed for placement (1024 tokens).
pub const PREFIX_BLOCKS_MAX: usize = 64;
/// Block hashes remembered per target worker.
const PREFIX_MEMORY: usize = 16 * 1024;
/// Default slack of [`Cluster::set_affinity_slack`]: a quarter of a worker's capacity.
pub const DEFAULT_AFFINITY_SLACK: f64 = 0.25;

/// Chained hashes of `tokens`' leading whole blocks (at most [`PREFIX_BLOCKS_MAX`]): entry i
/// names blocks 0..=i together. FNV-1a, fixed across processes and versions.
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    tokens
        .chunks_exact(PREFIX_BLOCK)
        .take(PREFIX_BLOCKS_MAX)
        .map(|block| {
            for t in block {
                for b in t.to_le_bytes() {
                    h ^= b as u64;
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
            }
            h
        })
        .collect()
}

/// The block hashes placed on one worker, forgetting the least recently placed.
#[derive(Debug, Default)]
struct PrefixMemory {
    last: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    tick: u64,
}

impl PrefixMemory {
    /// Leading hashes of `prefix` this worker holds.
    fn matched(&self, prefix: &[u64]) -> usize {
        prefix
            .iter()
            .take_while(|h| self.last.contains_key(h))
            .count()
    }

    fn insert(&mut self, prefix: &[u64]) {
        for &h in prefix {
            self.tick += 1;
            self.last.insert(h, self.tick);
            self.order.push_back((h, self.tick));
        }
        // Drop stale queue entries and the least recently placed hashes beyond the bound.
        while self.order.len() > 2 * PREFIX_MEMORY || self.last.len() > PREFIX_MEMORY {
            let Some((h, t)) = self.order.pop_front() else {
                break;
            };
            if self.last.get(&h) == Some(&t) {
                self.last.remove(&h);
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    info: WorkerInfo,
    expires: Instant,
    ttl: Duration,
    /// Requests placed since the worker last reported its load (so bursts spread out).
    placed: u32,
    /// Given a fresh TTL after a stall and not heard from since: the next stall only adds its
    /// own length (a scheduler stalling every few seconds would otherwise keep a dead worker
    /// for ever).
    graced: bool,
}

#[derive(Debug)]
pub struct Cluster {
    workers: HashMap<String, Entry>,
    /// When `expire` last ran (a sweeper calls it every [`SWEEP_PERIOD`]).
    last_sweep: Option<Instant>,
    /// Per target worker: the prompt blocks placed there (kept across heartbeats).
    prefixes: HashMap<String, PrefixMemory>,
    affinity_slack: f64,
    /// etcd discovery: whether the view mirrors etcd (a snapshot read, the watch up); None
    /// with static registration. A stale mirror keeps dead workers and the placement counts
    /// that only a watched load report resets.
    etcd_live: Option<bool>,
}

impl Default for Cluster {
    fn default() -> Self {
        Self {
            workers: HashMap::new(),
            last_sweep: None,
            prefixes: HashMap::new(),
            affinity_slack: DEFAULT_AFFINITY_SLACK,
            etcd_live: None,
        }
    }
}

/// How often the service sweeps for expired workers.
pub const SWEEP_PERIOD: Duration = Duration::from_millis(100);
/// A gap between sweeps longer than this means the scheduler was not running.
pub const STALL_GAP: Duration = Duration::from_millis(500);

#[derive(Debug, PartialEq, Eq)]
pub enum PlaceError {
    NoTarget(String),
    Full(String),
}

impl Cluster {
    /// Adds or refreshes a worker; its reported load replaces the placement estimate.
    /// Whether a worker of this id is registered.
    pub fn contains(&self, id: &str) -> bool {
        self.workers.contains_key(id)
    }

    /// One worker's record, its load counting what was placed on it since it reported.
    pub fn get(&self, id: &str) -> Option<WorkerInfo> {
        self.workers.get(id).map(|e| {
            let mut i = e.info.clone();
            i.load = i.load.saturating_add(e.placed);
            i
        })
    }

    /// Marks the view an etcd mirror, current or not (the etcd watcher does).
    pub fn set_etcd_live(&mut self, live: bool) {
        self.etcd_live = Some(live);
    }

    /// Whether the etcd mirror is current; None with static registration.
    pub fn etcd_live(&self) -> Option<bool> {
        self.etcd_live
    }

    /// The address worker `id` registered with.
    /// The address a worker registered, and how long it has not been heard from.
    pub fn address_of(&self, id: &str) -> Option<(&str, Duration)> {
        self.workers.get(id).map(|e| {
            let heard = e.expires.checked_sub(e.ttl).unwrap_or(e.expires);
            (e.info.address.as_str(), heard.elapsed())
        })
    }

    /// Registered workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    pub fn upsert(&mut self, info: WorkerInfo, ttl: Duration, now: Instant) {
        // The same id at another address, or with another instance, is another process (a pod
        // restarted with a new IP, or in place): the prefixes placed on the old one are not in
        // its cache.
        if self.workers.get(&info.id).is_some_and(|e| {
            e.info.address != info.address
                || (!info.instance.is_empty() && e.info.instance != info.instance)
        }) {
            self.prefixes.remove(&info.id);
        }
        self.workers.insert(
            info.id.clone(),
            Entry {
                info,
                expires: now + ttl,
                ttl,
                placed: 0,
                graced: false,
            },
        );
    }

    /// The TTL `id` was added with (which discovery path holds it).
    pub fn ttl_of(&self, id: &str) -> Option<Duration> {
        self.workers.get(id).map(|e| e.ttl)
    }

    /// Removes `id` if it was added with `ttl` (one discovery path leaves another's alone).
    pub fn remove_with_ttl(&mut self, id: &str, ttl: Duration) -> bool {
        if self.workers.get(id).is_some_and(|e| e.ttl == ttl) {
            return self.remove(id);
        }
        false
    }

    /// Drops the workers registered with `ttl` whose ids `keep` lacks, with what placement
    /// remembers of them; returns their ids. An etcd snapshot taken on reconnecting is the
    /// truth: a key deleted while the watch was down sent no event.
    pub fn forget_missing(
        &mut self,
        ttl: Duration,
        keep: &std::collections::HashSet<String>,
    ) -> Vec<String> {
        let gone: Vec<String> = self
            .workers
            .iter()
            .filter(|(id, e)| e.ttl == ttl && !keep.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.remove(id);
        }
        gone
    }

    pub fn remove(&mut self, id: &str) -> bool {
        self.prefixes.remove(id);
        self.workers.remove(id).is_some()
    }

    /// How much busier (load over capacity) than the least-loaded target a worker holding a
    /// request's prefix may be and still get it; 0 turns prefix affinity off.
    pub fn set_affinity_slack(&mut self, slack: f64) {
        self.affinity_slack = if slack.is_finite() {
            slack.max(0.0)
        } else {
            0.0
        };
    }

    /// Drops workers whose TTL passed; returns their ids. After a stall (the previous sweep more
    /// than [`STALL_GAP`] ago) every worker first gets a fresh TTL: nobody could be heard then.
    /// Once: a worker not heard from since its last grace gets only the stall's length.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        if let Some(prev) = self.last_sweep {
            let gap = now.saturating_duration_since(prev);
            if gap > STALL_GAP {
                if !self.workers.is_empty() {
                    tracing::warn!(
                        gap_ms = gap.as_millis() as u64,
                        "scheduler was not running; workers get a TTL to check in again"
                    );
                }
                let lost = gap.saturating_sub(SWEEP_PERIOD);
                for e in self.workers.values_mut() {
                    if e.graced {
                        e.expires += lost;
                    } else {
                        e.expires = e.expires.max(now + e.ttl);
                        e.graced = true;
                    }
                }
            }
        }
        self.last_sweep = Some(self.last_sweep.map_or(now, |p| p.max(now)));
        let gone: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, e)| e.expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.workers.remove(id);
            self.prefixes.remove(id);
        }
        gone
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        let mut v: Vec<WorkerInfo> = self
            .workers
            .values()
            .map(|e| {
                let mut i = e.info.clone();
                i.load = i.load.saturating_add(e.placed);
                i
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Places a request of `model` (empty = any): a target worker with room and, when one is up,
    /// a draft worker for the same model and vocabulary. `prefix` is the prompt's
    /// [`prefix_hashes`] (empty: by load alone).
    pub fn place(
        &mut self,
        model: &str,
        exclude: &[String],
        prefix: &[u64],
    ) -> Result<(WorkerInfo, Option<WorkerInfo>), PlaceError> {
        let ratio =
            |e: &Entry| (e.info.load as f64 + e.placed as f64) / e.info.capacity.max(1) as f64;
        let eligible = |e: &&Entry, role: &str| {
            e.info.role == role
                && (model.is_empty() || e.info.model == model)
                && !exclude.contains(&e.info.id)
        };
        let targets: Vec<&Entry> = self
            .workers
            .values()
            .filter(|e| eligible(e, ROLE_TARGET))
            .filter(|e| e.info.load.saturating_add(e.placed) < e.info.capacity.max(1))
            .collect();
        let least = targets
            .iter()
            .min_by(|a, b| {
                ratio(a)
                    .total_cmp(&ratio(b))
                    .then_with(|| a.info.id.cmp(&b.info.id))
            })
            .copied();
        let Some(least) = least else {
            let any_target = self
                .workers
                .values()
                .any(|e| e.info.role == ROLE_TARGET && (model.is_empty() || e.info.model == model));
            return Err(if any_target {
                PlaceError::Full(model.to_string())
            } else {
                PlaceError::NoTarget(model.to_string())
            });
        };
        let mut tid = least.info.id.clone();
        if self.affinity_slack > 0.0 && !prefix.is_empty() {
            let floor = ratio(least) + self.affinity_slack;
            let matched = |e: &Entry| {
                self.prefixes
                    .get(&e.info.id)
                    .map_or(0, |m| m.matched(prefix))
            };
            if let Some((m, e)) = targets
                .iter()
                .filter(|e| ratio(e) <= floor)
                .map(|e| (matched(e), e))
                .filter(|(m, _)| *m > 0)
                .max_by(|(ma, a), (mb, b)| {
                    ma.cmp(mb)
                        .then_with(|| ratio(b).total_cmp(&ratio(a)))
                        .then_with(|| b.info.id.cmp(&a.info.id))
                })
            {
                tracing::debug!(worker = %e.info.id, blocks = m, "placed by prefix");
                tid = e.info.id.clone();
            }
        }
        let vocab = self.workers[&tid].info.vocab_hash.clone();
        let did = self
            .workers
            .values()
            .filter(|e| eligible(e, ROLE_DRAFT))
            .filter(|e| e.info.vocab_hash == vocab)
            // A full draft worker is not paired: the target drafts locally instead.
            .filter(|e| e.info.load.saturating_add(e.placed) < e.info.capacity.max(1))
            .min_by(|a, b| {
                ratio(a)
                    .total_cmp(&ratio(b))
                    .then_with(|| a.info.id.cmp(&b.info.id))
            })
            .map(|e| e.info.id.clone());
        if !prefix.is_empty() {
            self.prefixes.entry(tid.clone()).or_default().insert(prefix);
        }
        let Some(t) = self.workers.get_mut(&tid) else {
            return Err(PlaceError::NoTarget(model.to_string()));
        };
        t.placed += 1;
        let target = t.info.clone();
        let draft = did.and_then(|d| {
            let e = self.workers.get_mut(&d)?;
            e.placed += 1;
            Some(e.info.clone())
        });
        Ok((target, draft))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: &str, role: &str, cap: u32, load: u32) -> WorkerInfo {
        WorkerInfo {
            id: id.into(),
            role: role.into(),
            address: format!("127.0.0.1:1{id}"),
            model: "m".into(),
            vocab_hash: "v".into(),
            capacity: cap,
            load,
            ..Default::default()
        }
    }

    #[test]
    fn a_snapshot_forgets_the_workers_it_lacks_of_its_own_kind_only() {
        let now = Instant::now();
        let (etcd, heartbeat) = (Duration::from_secs(3600), Duration::from_secs(5));
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), etcd, now);
        c.upsert(w("2", ROLE_TARGET, 4, 0), etcd, now);
        c.upsert(w("3", ROLE_TARGET, 4, 0), heartbeat, now);
        c.place("m", &[], &[7, 8]).unwrap();
        let keep = ["1".to_string()].into_iter().collect();
        assert_eq!(c.forget_missing(etcd, &keep), vec!["2".to_string()]);
        let ids: Vec<String> = c.workers().into_iter().map(|w| w.id).collect();
        assert_eq!(ids, ["1", "3"]);
        assert!(!c.prefixes.contains_key("2"));
    }

    #[test]
    fn least_loaded_target_with_room_and_a_draft() {
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut c = Cluster::default();
        assert_eq!(
            c.place("m", &[], &[]),
            Err(PlaceError::NoTarget("m".into()))
        );
        c.upsert(w("1", ROLE_TARGET, 4, 3), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 4, 1), ttl, now);
        let (t, d) = c.place("m", &[], &[]).unwrap();
        assert_eq!(t.id, "2");
        assert!(d.is_none());
        c.upsert(w("3", ROLE_DRAFT, 8, 0), ttl, now);
        let (t, d) = c.place("m", &[], &[]).unwrap();
        assert_eq!(t.id, "2"); // 1+1 of 4 beats 3 of 4
        assert_eq!(d.unwrap().id, "3");
        // One slot left on each.
        let mut got = Vec::new();
        while let Ok((t, _)) = c.place("m", &[], &[]) {
            got.push(t.id);
        }
        assert_eq!(c.place("m", &[], &[]), Err(PlaceError::Full("m".into())));
        assert_eq!(got.len(), 2, "{got:?}");
        // Another model: no target.
        assert!(matches!(
            c.place("x", &[], &[]),
            Err(PlaceError::NoTarget(_))
        ));
        // A report of the real load resets the estimate.
        c.upsert(w("1", ROLE_TARGET, 4, 0), ttl, now);
        assert_eq!(c.place("m", &[], &[]).unwrap().0.id, "1");
        // Excluded workers are skipped.
        assert!(c.place("m", &["1".to_string()], &[]).is_err());
    }

    #[test]
    fn expiry_removes_workers() {
        let now = Instant::now();
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), Duration::from_millis(100), now);
        c.upsert(w("2", ROLE_TARGET, 4, 0), Duration::from_secs(10), now);
        assert!(c.expire(now).is_empty());
        // Swept on time (a late sweep would read as a stall of the scheduler itself).
        let gone: Vec<String> = (1..=10)
            .flat_map(|k| c.expire(now + Duration::from_millis(100 * k)))
            .collect();
        assert_eq!(gone, vec!["1".to_string()]);
        assert_eq!(c.workers().len(), 1);
        assert_eq!(c.place("m", &[], &[]).unwrap().0.id, "2");
    }

    #[test]
    fn a_stalled_scheduler_does_not_drop_workers_it_could_not_hear() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), ms(1000), t0);
        c.upsert(w("2", ROLE_DRAFT, 4, 0), ms(300), t0);
        assert!(c.expire(t0 + ms(100)).is_empty());
        // Five seconds without a sweep: both TTLs passed while nothing ran.
        assert!(c.expire(t0 + ms(5100)).is_empty(), "a stall is not a death");
        assert_eq!(c.workers().len(), 2);
        // Swept on time from here: whoever does not check in within its TTL goes.
        let mut gone = Vec::new();
        for k in 1..=11 {
            gone.extend(c.expire(t0 + ms(5100 + 100 * k)));
            if k == 2 {
                assert!(gone.is_empty(), "a TTL of grace: {gone:?}");
            }
        }
        gone.sort();
        assert_eq!(gone, vec!["1".to_string(), "2".to_string()]);
        // A scheduler that keeps stalling (600 ms every second) grants one fresh TTL; after
        // that a worker that never checks in goes, late by the stalls only.
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), ms(3000), t0);
        let mut at = t0;
        let mut gone_at = None;
        for _ in 0..20 {
            for step in [100, 100, 100, 100, 700] {
                at += ms(step);
                if !c.expire(at).is_empty() {
                    gone_at.get_or_insert(at - t0);
                }
            }
        }
        let gone_at = gone_at.expect("a dead worker leaves despite the stalls");
        assert!(
            gone_at > ms(3600),
            "one fresh TTL after the first stall: {gone_at:?}"
        );
        assert!(gone_at <= ms(9000), "{gone_at:?}");
        // Without a stall the TTL is not extended.
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), ms(300), t0);
        let mut gone = Vec::new();
        for k in 1..=4 {
            gone.extend(c.expire(t0 + ms(100 * k)));
        }
        assert_eq!(gone, vec!["1".to_string()]);
    }

    /// A draft worker at capacity (reported load plus placements since) is not paired again;
    /// the target then drafts locally (no draft in the placement).
    #[test]
    fn full_draft_workers_are_not_paired() {
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 8, 0), ttl, now);
        c.upsert(w("2", ROLE_DRAFT, 2, 1), ttl, now);
        assert_eq!(
            c.place("m", &[], &[]).unwrap().1.map(|d| d.id),
            Some("2".to_string())
        );
        assert!(
            c.place("m", &[], &[]).unwrap().1.is_none(),
            "1 reported + 1 placed of 2"
        );
        // Another draft worker with room takes the pairing; capacity 0 counts as 1.
        c.upsert(w("3", ROLE_DRAFT, 0, 0), ttl, now);
        assert_eq!(
            c.place("m", &[], &[]).unwrap().1.map(|d| d.id),
            Some("3".to_string())
        );
        assert!(c.place("m", &[], &[]).unwrap().1.is_none());
        // A load report with room pairs it again.
        c.upsert(w("2", ROLE_DRAFT, 2, 0), ttl, now);
        assert_eq!(
            c.place("m", &[], &[]).unwrap().1.map(|d| d.id),
            Some("2".to_string())
        );
    }

    #[test]
    fn drafts_must_share_the_vocabulary() {
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), ttl, now);
        let mut d = w("2", ROLE_DRAFT, 4, 0);
        d.vocab_hash = "other".into();
        c.upsert(d, ttl, now);
        assert!(c.place("m", &[], &[]).unwrap().1.is_none());
    }

    #[test]
    fn prefix_hashes_name_whole_leading_blocks_in_a_chain() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (prefix_hashes(&a), prefix_hashes(&b));
        // Two whole blocks; the partial third is not hashed.
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // Entry 1 names blocks 0 and 1 together: the same second block after another first
        // one is another prefix.
        let mut c = a.clone();
        c[0] = 7;
        assert_ne!(prefix_hashes(&c)[1], ha[1]);
        assert!(prefix_hashes(&a[..15]).is_empty());
        let long: Vec<u32> = (0..5000).collect();
        assert_eq!(prefix_hashes(&long).len(), PREFIX_BLOCKS_MAX);
    }

    #[test]
    fn prompts_follow_their_cached_prefix_within_the_load_slack() {
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 8, 0), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        let sys: Vec<u32> = (0..64).collect();
        let with = |tail: u32| {
            let mut p = sys.clone();
            p.extend(std::iter::repeat_n(tail, 20));
            prefix_hashes(&p)
        };
        let other: Vec<u64> = prefix_hashes(&(1000..1064).collect::<Vec<u32>>());
        // The first goes by load (tie: the lower id); the next ones with the same system
        // prompt follow it while "1" is at most a quarter of its capacity busier than "2".
        assert_eq!(c.place("m", &[], &with(1)).unwrap().0.id, "1");
        assert_eq!(c.place("m", &[], &with(2)).unwrap().0.id, "1");
        // Another prompt goes by load.
        assert_eq!(c.place("m", &[], &other).unwrap().0.id, "2");
        assert_eq!(c.place("m", &[], &with(3)).unwrap().0.id, "1");
        // "1" holds 3 of 8, "2" 1 of 8: 0.375 is within 0.125 + 0.25; at 4 of 8 load wins.
        assert_eq!(c.place("m", &[], &with(4)).unwrap().0.id, "1");
        assert_eq!(c.place("m", &[], &with(5)).unwrap().0.id, "2");
        // Now both hold the system prompt; the longer match wins: "1" has seen tail 1.
        assert_eq!(c.place("m", &[], &with(1)).unwrap().0.id, "1");
        // A heartbeat (fresh load report) keeps what was placed; leaving forgets it.
        c.upsert(w("1", ROLE_TARGET, 8, 0), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        assert_eq!(c.place("m", &[], &other).unwrap().0.id, "2");
        assert!(c.remove("2"));
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        c.upsert(w("1", ROLE_TARGET, 8, 1), ttl, now);
        assert_eq!(c.place("m", &[], &other).unwrap().0.id, "2");
        assert_eq!(c.place("m", &[], &with(9)).unwrap().0.id, "1");
        // A full worker is never chosen for its prefix; slack 0 places by load alone.
        c.upsert(w("1", ROLE_TARGET, 8, 8), ttl, now);
        assert_eq!(c.place("m", &[], &with(1)).unwrap().0.id, "2");
        c.upsert(w("1", ROLE_TARGET, 8, 1), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        c.set_affinity_slack(0.0);
        assert_eq!(c.place("m", &[], &with(1)).unwrap().0.id, "2");
        c.set_affinity_slack(f64::NAN);
        assert_eq!(c.affinity_slack, 0.0);
        // The same id back at another address (a restarted pod) holds none of its prefixes:
        // prompts that followed it go by load again.
        c.set_affinity_slack(0.25);
        let fresh = prefix_hashes(&(5000..5084).collect::<Vec<u32>>());
        c.upsert(w("1", ROLE_TARGET, 8, 0), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        assert_eq!(c.place("m", &[], &fresh).unwrap().0.id, "1");
        c.upsert(w("1", ROLE_TARGET, 8, 1), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        assert_eq!(c.place("m", &[], &fresh).unwrap().0.id, "1");
        let moved = WorkerInfo {
            address: "127.0.0.1:29".into(),
            ..w("1", ROLE_TARGET, 8, 1)
        };
        c.upsert(moved, ttl, now);
        c.upsert(w("2", ROLE_TARGET, 8, 0), ttl, now);
        assert_eq!(c.place("m", &[], &fresh).unwrap().0.id, "2");
        // Restarted in place (same id, same address, a new instance): forgotten too. A
        // heartbeat of the same instance keeps them.
        let run = |instance: &str, load| WorkerInfo {
            instance: instance.into(),
            ..w("2", ROLE_TARGET, 8, load)
        };
        c.upsert(run("a", 0), ttl, now);
        c.upsert(w("1", ROLE_TARGET, 8, 1), ttl, now);
        assert_eq!(c.place("m", &[], &fresh).unwrap().0.id, "2");
        c.upsert(run("a", 1), ttl, now);
        c.upsert(w("1", ROLE_TARGET, 8, 0), ttl, now);
        assert_eq!(c.place("m", &[], &fresh).unwrap().0.id, "2");
        c.upsert(run("b", 1), ttl, now);
        c.upsert(w("1", ROLE_TARGET, 8, 0), ttl, now);
        assert_eq!(c.place("m", &[], &fresh).unwrap().0.id, "1");
    }

    #[test]
    fn prefix_memory_forgets_the_least_recently_placed() {
        let mut m = PrefixMemory::default();
        let first: Vec<u64> = (0..10).collect();
        m.insert(&first);
        assert_eq!(m.matched(&first), 10);
        for i in 0..(PREFIX_MEMORY as u64 / 10 + 1) {
            let p: Vec<u64> = (0..10).map(|j| 1_000_000 + i * 10 + j).collect();
            m.insert(&p);
        }
        assert_eq!(m.matched(&first), 0);
        assert!(m.last.len() <= PREFIX_MEMORY && m.order.len() <= 2 * PREFIX_MEMORY);
        // Placing a prefix again refreshes it.
        m.insert(&first);
        for i in 0..(PREFIX_MEMORY as u64 / 20) {
            m.insert(&[5_000_000 + i]);
        }
        assert_eq!(m.matched(&first), 10);
    }
}
