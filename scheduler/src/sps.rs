//! The SPS(B) artifact: a profiled staircase keyed by what it was measured on (model, dtype,
//! device and ISA, threads, TP degree, runtime version) and how (batch grid, contexts), stored
//! as versioned JSON, reused when the key matches and refused (with the reason) when it does not.

use crate::admission::{AdmissionError, SpsTable};
use serde::{Deserialize, Serialize};
use specdec::profile::SpsPoint;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// 2: the key names the grid and contexts, and each point is the fastest of passes
/// interleaved over the grid (version 1 took the median of consecutive forwards, which a
/// neighbour's busy spell of a few seconds skewed; such tables are measured again).
pub const ARTIFACT_VERSION: u32 = 2;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpsKey {
    pub model: String,
    /// Size of the weights file (distinguishes quantizations of the same name).
    pub model_bytes: u64,
    pub dtype: String,
    pub device: String,
    pub threads: usize,
    pub tp: usize,
    pub runtime: String,
    /// The batch-token counts and context lengths measured: a profile over a short grid (a
    /// test's) must not stand in for the full one.
    pub grid: Vec<usize>,
    pub ctxs: Vec<usize>,
}

impl SpsKey {
    /// A file name for the cache: readable model name plus a hash of the whole key.
    pub fn file_name(&self) -> String {
        let text = serde_json::to_string(self).unwrap_or_default();
        let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let name: String = self
            .model
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{name}-{h:016x}.json")
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpsArtifact {
    pub version: u32,
    pub key: SpsKey,
    /// The staircase: (B, steps/s), B increasing, steps/s non-increasing.
    pub table: Vec<(u32, f64)>,
    /// Every measurement behind it.
    pub points: Vec<SpsPoint>,
    pub command: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SpsError {
    #[error("SPS artifact {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("SPS artifact {path} was measured for {got}, this worker is {want}")]
    WrongKey {
        path: String,
        got: String,
        want: String,
    },
    #[error(transparent)]
    Table(#[from] AdmissionError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// An io error that names the file it was about (its kind kept).
fn at(e: std::io::Error, what: &str, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

impl SpsArtifact {
    pub fn save(&self, path: &Path) -> Result<(), SpsError> {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| at(e, "cannot create", d))?;
        }
        let text = serde_json::to_string_pretty(self).map_err(|e| SpsError::Invalid {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        // Written beside the target and renamed over it: workers sharing $DSPARK_HOME may
        // read the cache while another writes it, and must see the old file or the new one,
        // never a half-written one. The name is random as well as per process and call: pods
        // on one shared volume all run as process 1; and it is created only if new, so two
        // writers never share one.
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let random = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.finish()
        };
        let tmp = path.with_file_name(format!(
            ".{}.{}-{}-{random:016x}.tmp",
            name.as_deref().unwrap_or("sps"),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(at(e, "cannot write", path).into());
        }
        Ok(())
    }

    /// Reads and validates an artifact; with `want`, refuses one measured for another key.
    pub fn load(path: &Path, want: Option<&SpsKey>) -> Result<(Self, SpsTable), SpsError> {
        let bad = |reason: String| SpsError::Invalid {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| at(e, "cannot read", path))?;
        let a: SpsArtifact = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if a.version != ARTIFACT_VERSION {
            return Err(bad(format!(
                "version {} (this build reads {ARTIFACT_VERSION})",
                a.version
            )));
        }
        if let Some(w) = want {
            if &a.key != w {
                return Err(SpsError::WrongKey {
                    path: path.display().to_string(),
                    got: serde_json::to_string(&a.key).unwrap_or_default(),
                    want: serde_json::to_string(w).unwrap_or_default(),
                });
            }
        }
        let t = a.sps_table()?;
        Ok((a, t))
    }

    /// The scheduler's table: the staircase, with the decoding staircase at the shortest
    /// context that prices verified drafts ([`SpsTable::marginal`]).
    pub fn sps_table(&self) -> Result<SpsTable, SpsError> {
        Ok(SpsTable::new(self.table.clone())?
            .with_marginal(specdec::profile::marginal_staircase(&self.points)))
    }
}

/// Where profiles are cached: `$DSPARK_HOME/profiles/<model>-<keyhash>.json`.
pub fn cache_path(home: &Path, key: &SpsKey) -> PathBuf {
    home.join("profiles").join(key.file_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SpsKey {
        SpsKey {
            model: "m".into(),
            model_bytes: 1,
            dtype: "q4".into(),
            device: "cpu".into(),
            threads: 2,
            tp: 1,
            runtime: "0.1.0".into(),
            grid: vec![1, 8, 64],
            ctxs: vec![256],
        }
    }

    /// Saves replace the file whole: a reader racing writers sees a complete artifact every
    /// time, and no temporary file stays behind.
    #[test]
    fn saves_are_atomic_and_leave_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("dspark-sps-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("a.json");
        let pt = |b| SpsPoint {
            batch_tokens: b,
            ctx: 256,
            kind: "decode".into(),
            ms_median: 10.0,
            ms_min: 10.0,
            steps_per_s: 100.0,
        };
        let a = SpsArtifact {
            version: ARTIFACT_VERSION,
            key: key(),
            table: vec![(1, 100.0), (8, 90.0), (64, 20.0)],
            // A file of a few hundred KB, so a write in place is seen half done.
            points: (1..2000).map(pt).collect(),
            command: "test".into(),
        };
        a.save(&p).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        let torn = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut torn = 0;
                while !done.load(Ordering::Relaxed) {
                    torn += usize::from(SpsArtifact::load(&p, Some(&key())).is_err());
                }
                torn
            });
            let writers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..20 {
                            a.save(&p).unwrap();
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
            reader.join().unwrap()
        });
        assert_eq!(torn, 0, "reads of a half-written artifact");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["a.json"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn round_trip_and_refusals() {
        let dir = std::env::temp_dir().join(format!("dspark-sps-{}", std::process::id()));
        let p = dir.join("a.json");
        let a = SpsArtifact {
            version: ARTIFACT_VERSION,
            key: key(),
            table: vec![(1, 100.0), (8, 90.0), (64, 20.0)],
            points: vec![],
            command: "test".into(),
        };
        a.save(&p).unwrap();
        let (_, t) = SpsArtifact::load(&p, Some(&key())).unwrap();
        assert_eq!(t.sps(5), 90.0);
        // No measurements behind it: no short-context decoding staircase.
        assert!(t.marginal.is_empty());
        let pt = |kind: &str, ctx, b, ms: f64| SpsPoint {
            batch_tokens: b,
            ctx,
            kind: kind.into(),
            ms_median: ms,
            ms_min: ms,
            steps_per_s: 1e3 / ms,
        };
        let mut m = a.clone();
        m.points = vec![
            pt("decode", 256, 1, 10.0),
            pt("decode", 256, 8, 11.0),
            pt("decode", 256, 64, 50.0),
            pt("decode", 1024, 1, 12.0),
        ];
        m.save(&p).unwrap();
        let (_, t) = SpsArtifact::load(&p, Some(&key())).unwrap();
        assert_eq!(
            t.marginal.iter().map(|x| x.0).collect::<Vec<_>>(),
            [1, 8, 64]
        );
        assert!((t.marginal_ratio(8, 64).unwrap() - 50.0 / 11.0).abs() < 1e-9);
        let mut other = key();
        other.threads = 16;
        assert!(matches!(
            SpsArtifact::load(&p, Some(&other)),
            Err(SpsError::WrongKey { .. })
        ));
        // A profile over a shorter grid (or other contexts) is another key.
        let mut short = key();
        short.grid = vec![1, 8];
        assert!(matches!(
            SpsArtifact::load(&p, Some(&short)),
            Err(SpsError::WrongKey { .. })
        ));
        let mut b = a.clone();
        b.table = vec![(1, 10.0), (8, 90.0)];
        b.save(&p).unwrap();
        assert!(matches!(
            SpsArtifact::load(&p, None),
            Err(SpsError::Table(_))
        ));
        b.table = vec![];
        b.save(&p).unwrap();
        assert!(matches!(
            SpsArtifact::load(&p, None),
            Err(SpsError::Table(_))
        ));
        std::fs::write(&p, "{not json").unwrap();
        assert!(matches!(
            SpsArtifact::load(&p, None),
            Err(SpsError::Invalid { .. })
        ));
        assert_ne!(key().file_name(), other.file_name());
        assert_ne!(key().file_name(), short.file_name());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
