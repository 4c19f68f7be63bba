//! What one forward over k new tokens costs on a GPU, after a context of ctx tokens: the CUDA
//! device path (`dspark_runtime::device`, f32 weights, one sequence over its KV cache), with
//! each matmul kernel measured side by side in one run (per-token: a warp per output, so
//! every token of a window reads the weights again; token-tiled: a block per output row and
//! up to 8 tokens, so a window of up to 8 reads them once). Each timed forward includes what a
//! verifier pays around it: the embedding rows' upload and the download of k × vocab logits.
//!
//! The GPU machines this project is lent cannot receive a whole checkpoint (64 MiB carry
//! limit), and a forward's cost does not depend on the weights' values: the weights are random
//! with the model's shapes, taken from its GGUF header or from a config dumped here.
//!
//! ```text
//! gpu-verify-curve --dump-config MODEL.gguf            # the model's config, as JSON
//! gpu-verify-curve (--config CFG.json | --model MODEL.gguf) [--name NAME]
//!                  [--ctx 256,2048] [--k 1,2,4,8,16,32] [--reps 20] [--json FILE]
//!                  [--via TEXT]   # what ran it, recorded in the JSON
//! ```
//! `scripts/gpu-check.sh` runs it for SmolLM2-135M and Qwen2.5-Coder-1.5B.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use dspark_runtime::ModelConfig;
use dspark_runtime::device::{CudaOps, DeviceForward};
use dspark_runtime::gguf::GgufFile;
use kernels::cuda::MatmulKernel;
use kernels::rng::Rng;

fn list(s: &str) -> anyhow::Result<Vec<usize>> {
    s.split(',')
        .map(|v| {
            v.trim()
                .parse::<usize>()
                .with_context(|| format!("{v:?} in {s:?}"))
        })
        .collect()
}

fn config_of(path: &str) -> anyhow::Result<ModelConfig> {
    let g = GgufFile::open(path.as_ref()).with_context(|| format!("opening {path}"))?;
    Ok(ModelConfig::from_gguf(&g)?)
}

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let mut args = argv.iter().skip(1);
    let (mut cfg, mut name, mut json) = (None::<ModelConfig>, None::<String>, None::<PathBuf>);
    let mut via = None::<String>;
    let (mut ctxs, mut ks, mut reps) = (vec![256, 2048], vec![1, 2, 4, 8, 16, 32], 20usize);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--dump-config" => {
                println!("{}", serde_json::to_string_pretty(&config_of(val()?)?)?);
                return Ok(());
            }
            "--model" => {
                let p = val()?;
                cfg = Some(config_of(p)?);
                if name.is_none() {
                    name = PathBuf::from(p)
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned());
                }
            }
            "--config" => {
                let p = val()?;
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {p}"))?;
                cfg = Some(serde_json::from_str(&text).with_context(|| format!("parsing {p}"))?);
            }
            "--name" => name = Some(val()?.clone()),
            "--ctx" => ctxs = list(val()?)?,
            "--k" => ks = list(val()?)?,
            "--reps" => reps = val()?.parse()?,
            "--json" => json = Some(PathBuf::from(val()?)),
            "--via" => via = Some(val()?.clone()),
            other => bail!("unknown argument {other:?} (see the example's doc comment)"),
        }
    }
    let Some(cfg) = cfg else {
        bail!("give --model MODEL.gguf or --config CFG.json");
    };
    if ctxs.is_empty() || ks.is_empty() || reps == 0 || ks.contains(&0) {
        bail!("--ctx, --k and --reps need positive values");
    }
    let name = name.unwrap_or_else(|| "model".into());
    let started = Instant::now();
    let mut fwd = DeviceForward::random(CudaOps::new(0)?, &cfg, 7)?;
    let device = fwd.backend();
    println!(
        "{name} ({} layers, d {}, vocab {}) on {device}: weights ready in {:.1} s",
        cfg.n_layers,
        cfg.d_model,
        cfg.vocab_size,
        started.elapsed().as_secs_f64()
    );
    let arms = [
        ("per-token", MatmulKernel::PerToken),
        ("token-tiled", MatmulKernel::TokenTiled),
    ];
    let capacity = ctxs.iter().max().copied().unwrap_or(0) + ks.iter().max().copied().unwrap_or(0);
    let mut rng = Rng::new(11);
    let mut points = Vec::new();
    println!("| arm | ctx | k | ms median | ms min | T(k)/T(1) |");
    println!("|---|---|---|---|---|---|");
    for &ctx in &ctxs {
        let mut cache = fwd.new_cache(capacity)?;
        let context: Vec<u32> = (0..ctx).map(|_| rng.below(cfg.vocab_size) as u32).collect();
        for chunk in context.chunks(512) {
            fwd.forward(&mut cache, chunk)?;
        }
        let mut t1 = [f64::NAN; 2];
        for &k in &ks {
            let window: Vec<u32> = (0..k).map(|_| rng.below(cfg.vocab_size) as u32).collect();
            let mut times = vec![Vec::with_capacity(reps); arms.len()];
            // Warm-up, then the arms alternate rep by rep so drift hits both alike.
            for rep in 0..reps + 3 {
                for (i, (_, kernel)) in arms.iter().enumerate() {
                    fwd.ops_mut().set_matmul(*kernel);
                    let t = Instant::now();
                    let logits = fwd.forward(&mut cache, &window)?;
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    if logits.len() != k * cfg.vocab_size {
                        bail!("{} logits for {k} tokens", logits.len());
                    }
                    cache.truncate(ctx)?;
                    if rep >= 3 {
                        times[i].push(ms);
                    }
                }
            }
            for (i, (arm, _)) in arms.iter().enumerate() {
                let ts = &mut times[i];
                ts.sort_by(f64::total_cmp);
                let (median, min) = (ts[ts.len() / 2], ts[0]);
                if k == 1 {
                    t1[i] = median;
                }
                let ratio = median / t1[i];
                println!("| {arm} | {ctx} | {k} | {median:.3} | {min:.3} | {ratio:.2} |");
                points.push(serde_json::json!({
                    "arm": arm, "ctx": ctx, "k": k, "ms_median": median, "ms_min": min,
                    "t_over_t1": if ratio.is_finite() { Some(ratio) } else { None },
                }));
            }
        }
    }
    if let Some(path) = json {
        let out = serde_json::json!({
            "command": argv.join(" "),
            "via": via,
            "model": name,
            "device": device,
            "config": cfg,
            "weights": "random f32 of the model's shapes (a forward's cost does not depend on the values)",
            "path": "dspark_runtime::device (CUDA kernels via NVRTC; one sequence, its own KV cache)",
            "reps": reps,
            "points": points,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
