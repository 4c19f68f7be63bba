//! The worker's SPS(B) table: loaded from the profile cache when its key matches this worker
//! (model file, dtype, device/ISA, threads, TP degree, runtime version, grid and contexts),
//! profiled otherwise.

use dspark_runtime::Model;
use dspark_scheduler::admission::SpsTable;
use dspark_scheduler::sps::{ARTIFACT_VERSION, SpsArtifact, SpsKey, cache_path};
use std::path::Path;

/// Total batch tokens the default profile covers: a geometric spread, and the token after
/// each multiple of 8 up to 65. The CPU kernels multiply up to 8 tokens per pass over the
/// weights, so the token after a multiple of 8 costs a whole pass (the 33rd 2.8 ms on a 43.7
/// ms step of SmolLM2 on 2 threads at context 256, the 32nd 0.03 ms), which a table that goes
/// from 32 to 48 spreads over 16 tokens.
pub const DEFAULT_GRID: &[usize] = &[
    1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 24, 25, 32, 33, 48, 49, 64, 65, 96, 128, 192, 256,
];
pub const DEFAULT_CTXS: &[usize] = &[256, 1024];

/// Refuses a grid or context list a profile cannot measure (before any forward runs).
pub fn check_grid(grid: &[usize], ctxs: &[usize]) -> Result<(), String> {
    if grid.is_empty() || grid.iter().any(|&b| !(1..=8192).contains(&b)) {
        return Err(format!(
            "SPS grid {grid:?}: batch-token counts must be in 1..=8192 (at least one)"
        ));
    }
    if ctxs.is_empty() || ctxs.contains(&0) {
        return Err(format!(
            "SPS contexts {ctxs:?}: context lengths must be positive (at least one)"
        ));
    }
    Ok(())
}

/// The key of a profile of `model` over `grid` × `ctxs` (both taken sorted, without
/// duplicates, as [`profile`] measures them).
pub fn key_for(name: &str, path: &Path, model: &Model, grid: &[usize], ctxs: &[usize]) -> SpsKey {
    let set = |v: &[usize]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.dedup();
        v
    };
    SpsKey {
        model: name.to_string(),
        model_bytes: model_bytes(path),
        dtype: if path.is_dir() {
            "hf".into()
        } else {
            "gguf".into()
        },
        // The CPU model too: the same instruction sets run at very different speeds on
        // different CPUs, and a profile copied with $DSPARK_HOME would otherwise be reused.
        device: format!(
            "cpu-{}{}-kv{}@{}",
            model.isa().name(),
            match kernels::grouped::GroupedKernels::for_isa(model.isa()) {
                Some(kernels::grouped::GroupedKernels::Vnni) => "-vnni",
                Some(kernels::grouped::GroupedKernels::Avx2) => "-grouped-avx2",
                Some(kernels::grouped::GroupedKernels::AvxVnni) => "-grouped-avx-vnni",
                Some(kernels::grouped::GroupedKernels::Neon) => "-grouped-neon",
                Some(kernels::grouped::GroupedKernels::NeonDot) => "-grouped-neon-dot",
                None => "",
            },
            model.kv_dtype().name(),
            kernels::cpu_model()
        ),
        threads: model.threads(),
        tp: model.tp_degree(),
        // The kernels' revision too: a profile measured before a kernel change is stale.
        runtime: format!("{}+{}", env!("CARGO_PKG_VERSION"), kernels::REVISION),
        grid: set(grid),
        ctxs: set(ctxs),
    }
}

/// The size of a model's weights and config: the file itself, or for a Hugging Face directory
/// the sum over its weight files (`*.safetensors`, `*.bin`, `*.gguf`) and `config.json`. A
/// directory's own size (4096 on most file systems) would let one checkpoint's profile stand
/// for another's. 0 when unreadable.
fn model_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name == "config.json"
                || [".safetensors", ".bin", ".gguf"]
                    .iter()
                    .any(|ext| name.ends_with(ext))
        })
        // Followed through links: a Hugging Face cache snapshot links its files to blobs.
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .fold(0u64, u64::saturating_add)
}

/// Measures the key's grid and contexts (`reps` interleaved passes) and builds the artifact.
pub fn profile(
    model: &Model,
    key: SpsKey,
    reps: usize,
    command: &str,
) -> specdec::Result<SpsArtifact> {
    let points = specdec::profile::measure(model, &key.grid, &key.ctxs, reps)?;
    Ok(SpsArtifact {
        version: ARTIFACT_VERSION,
        key,
        table: specdec::profile::staircase(&points),
        points,
        command: command.to_string(),
    })
}

/// The cached table for this key, or a fresh profile (saved to the cache).
pub fn load_or_profile(home: &Path, key: SpsKey, model: &Model) -> crate::Result<(SpsTable, bool)> {
    let path = cache_path(home, &key);
    match SpsArtifact::load(&path, Some(&key)) {
        Ok((_, t)) => return Ok((t, true)),
        Err(e) if path.exists() => tracing::warn!("{e}; profiling again"),
        Err(_) => {}
    }
    tracing::info!(
        "profiling SPS(B) for {} (once per key; cached in {})",
        key.model,
        path.display()
    );
    let a = profile(model, key, 3, "target-worker start")?;
    let t = a
        .sps_table()
        .map_err(|e| crate::TargetError::Config(format!("profiled SPS table: {e}")))?;
    if let Err(e) = a.save(&path) {
        tracing::warn!("could not cache the SPS profile: {e}");
    }
    Ok((t, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Hugging Face directory is sized by its weights and config, so two checkpoints in
    /// directories (both 4096 bytes as entries) get different profile keys.
    #[test]
    fn directory_models_are_sized_by_their_weights() {
        let dir = std::env::temp_dir().join(format!(
            "dspark-sps-bytes-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).expect("temp dir");
        let write = |name: &str, n: usize| {
            std::fs::write(dir.join(name), vec![0u8; n]).expect("write");
        };
        write("config.json", 10);
        write("model-00001-of-00002.safetensors", 1000);
        write("model-00002-of-00002.safetensors", 500);
        write("README.md", 7777);
        write("tokenizer.json", 3333);
        assert_eq!(model_bytes(&dir), 1510);
        // Another checkpoint of the same layout differs.
        write("model-00002-of-00002.safetensors", 501);
        assert_eq!(model_bytes(&dir), 1511);
        // A file is its own size; a missing path is 0.
        assert_eq!(model_bytes(&dir.join("README.md")), 7777);
        assert_eq!(model_bytes(&dir.join("missing")), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn grids_a_profile_cannot_measure_are_refused() {
        assert!(check_grid(DEFAULT_GRID, DEFAULT_CTXS).is_ok());
        for (g, c) in [
            (&[][..], &[256][..]),
            (&[0, 1][..], &[256][..]),
            (&[1, 9000][..], &[256][..]),
            (&[1, 2][..], &[][..]),
            (&[1, 2][..], &[0][..]),
        ] {
            let e = check_grid(g, c).unwrap_err();
            assert!(e.contains("SPS"), "{e}");
        }
    }
}
