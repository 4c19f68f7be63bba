//! The cluster view and placement: pure data, no I/O.
//!
//! Workers appear by registration (static mode) or an etcd lease (discovery mode) and vanish when
//! their TTL passes. A new request goes to the least-loaded target worker of its model that has
//! room, paired with the least-loaded draft worker of the same model and vocabulary.

use dspark_proto::WorkerInfo;
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub const ROLE_TARGET: &str = "target";
pub const ROLE_DRAFT: &str = "draft";

#[derive(Clone, Debug)]
struct Entry {
    info: WorkerInfo,
    expires: Instant,
    /// Requests placed since the worker last reported its load (so bursts spread out).
    placed: u32,
}

#[derive(Default, Debug)]
pub struct Cluster {
    workers: HashMap<String, Entry>,
}

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
                placed: 0,
            },
        );
    }

    pub fn remove(&mut self, id: &str) -> bool {
        self.workers.remove(id).is_some()
    }

    /// Drops workers whose TTL passed; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
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
        assert_eq!(
            c.expire(now + Duration::from_secs(1)),
            vec!["1".to_string()]
        );
        assert_eq!(c.workers().len(), 1);
        assert_eq!(c.place("m", &[]).unwrap().0.id, "2");
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
