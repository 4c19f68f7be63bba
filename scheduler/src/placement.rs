//! The cluster view and placement: pure data, no I/O.
//!
//! Workers appear by registration (static mode) or an etcd lease (discovery mode) and vanish when
//! their TTL passes. A new request goes to the least-loaded target worker of its model that has
//! room, paired with the least-loaded draft worker of the same model and vocabulary.
//!
//! Time the scheduler itself did not run (SIGSTOP, a paused VM, a starved process) is not held
//! against workers: their heartbeats could not be heard then, so a sweep that finds the previous
//! one far behind gives every worker a fresh TTL to check in instead of dropping them all.

use dspark_proto::WorkerInfo;
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub const ROLE_TARGET: &str = "target";
pub const ROLE_DRAFT: &str = "draft";

#[derive(Clone, Debug)]
struct Entry {
    info: WorkerInfo,
    expires: Instant,
    ttl: Duration,
    /// Requests placed since the worker last reported its load (so bursts spread out).
    placed: u32,
}

#[derive(Default, Debug)]
pub struct Cluster {
    workers: HashMap<String, Entry>,
    /// When `expire` last ran (a sweeper calls it every [`SWEEP_PERIOD`]).
    last_sweep: Option<Instant>,
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
    pub fn upsert(&mut self, info: WorkerInfo, ttl: Duration, now: Instant) {
        self.workers.insert(
            info.id.clone(),
            Entry {
                info,
                expires: now + ttl,
                ttl,
                placed: 0,
            },
        );
    }

    pub fn remove(&mut self, id: &str) -> bool {
        self.workers.remove(id).is_some()
    }

    /// Drops workers whose TTL passed; returns their ids. After a stall (the previous sweep more
    /// than [`STALL_GAP`] ago) every worker first gets a fresh TTL: nobody could be heard then.
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
                for e in self.workers.values_mut() {
                    e.expires = e.expires.max(now + e.ttl);
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
        }
        gone
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        let mut v: Vec<WorkerInfo> = self
            .workers
            .values()
            .map(|e| {
                let mut i = e.info.clone();
                i.load += e.placed;
                i
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Places a request of `model` (empty = any): a target worker with room and, when one is up,
    /// a draft worker for the same model and vocabulary.
    pub fn place(
        &mut self,
        model: &str,
        exclude: &[String],
    ) -> Result<(WorkerInfo, Option<WorkerInfo>), PlaceError> {
        let pick = |role: &str, vocab: Option<&str>, need_room: bool| {
            self.workers
                .values()
                .filter(|e| e.info.role == role)
                .filter(|e| model.is_empty() || e.info.model == model)
                .filter(|e| vocab.is_none_or(|v| e.info.vocab_hash == v))
                .filter(|e| !exclude.contains(&e.info.id))
                .filter(|e| !need_room || e.info.load + e.placed < e.info.capacity.max(1))
                .min_by(|a, b| {
                    let la = (a.info.load + a.placed) as f64 / a.info.capacity.max(1) as f64;
                    let lb = (b.info.load + b.placed) as f64 / b.info.capacity.max(1) as f64;
                    la.total_cmp(&lb).then_with(|| a.info.id.cmp(&b.info.id))
                })
                .map(|e| e.info.id.clone())
        };
        let any_target = self
            .workers
            .values()
            .any(|e| e.info.role == ROLE_TARGET && (model.is_empty() || e.info.model == model));
        let Some(tid) = pick(ROLE_TARGET, None, true) else {
            return Err(if any_target {
                PlaceError::Full(model.to_string())
            } else {
                PlaceError::NoTarget(model.to_string())
            });
        };
        let vocab = self.workers[&tid].info.vocab_hash.clone();
        let did = pick(ROLE_DRAFT, Some(&vocab), false);
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
    fn least_loaded_target_with_room_and_a_draft() {
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut c = Cluster::default();
        assert_eq!(c.place("m", &[]), Err(PlaceError::NoTarget("m".into())));
        c.upsert(w("1", ROLE_TARGET, 4, 3), ttl, now);
        c.upsert(w("2", ROLE_TARGET, 4, 1), ttl, now);
        let (t, d) = c.place("m", &[]).unwrap();
        assert_eq!(t.id, "2");
        assert!(d.is_none());
        c.upsert(w("3", ROLE_DRAFT, 8, 0), ttl, now);
        let (t, d) = c.place("m", &[]).unwrap();
        assert_eq!(t.id, "2"); // 1+1 of 4 beats 3 of 4
        assert_eq!(d.unwrap().id, "3");
        // One slot left on each.
        let mut got = Vec::new();
        while let Ok((t, _)) = c.place("m", &[]) {
            got.push(t.id);
        }
        assert_eq!(c.place("m", &[]), Err(PlaceError::Full("m".into())));
        assert_eq!(got.len(), 2, "{got:?}");
        // Another model: no target.
        assert!(matches!(c.place("x", &[]), Err(PlaceError::NoTarget(_))));
        // A report of the real load resets the estimate.
        c.upsert(w("1", ROLE_TARGET, 4, 0), ttl, now);
        assert_eq!(c.place("m", &[]).unwrap().0.id, "1");
        // Excluded workers are skipped.
        assert!(c.place("m", &["1".to_string()]).is_err());
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
        assert_eq!(c.place("m", &[]).unwrap().0.id, "2");
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
        // Without a stall the TTL is not extended.
        let mut c = Cluster::default();
        c.upsert(w("1", ROLE_TARGET, 4, 0), ms(300), t0);
        let mut gone = Vec::new();
        for k in 1..=4 {
            gone.extend(c.expire(t0 + ms(100 * k)));
        }
        assert_eq!(gone, vec!["1".to_string()]);
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
        assert!(c.place("m", &[]).unwrap().1.is_none());
    }
}
