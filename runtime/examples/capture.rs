//! Does capturing intermediate layers' hidden states (what a drafter conditions on) make a
//! forward dearer? Decode steps of B requests × 1 token at ctx 100 (or, with N > 1, prefill
//! chunks of N tokens each, logits at the last), with and without three captured layers,
//! interleaved so both arms see the same machine: `capture MODEL.gguf [B] [REPS] [N]`.
use dspark_runtime::model::*;
use dspark_runtime::{LoadOptions, Model};
fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let p = std::path::PathBuf::from(args.next().ok_or_else(|| anyhow::anyhow!("MODEL.gguf"))?);
    let b: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(8);
    let reps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(300);
    let n: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1)
        .max(1);
    let m = Model::load(&p, &LoadOptions::default())?;
    let n_layers = m.cfg.n_layers;
    let layers = vec![n_layers / 6, n_layers / 2, n_layers - 2];
    let mut c = m.new_cache((128 + n) * b + 64, 16)?;
    let ctx = 100;
    let seqs: Vec<_> = (0..b).map(|_| c.new_seq()).collect();
    for (i, &s) in seqs.iter().enumerate() {
        let prompt: Vec<u32> = (0..ctx as u32).map(|t| 1000 + t * 7 + i as u32).collect();
        let inp = [SeqInput {
            seq: s,
            tokens: &prompt,
            logits: LogitsMode::None,
        }];
        m.forward(&mut c, &inp, &ForwardOptions::default())?;
    }
    let toks: Vec<Vec<u32>> = (0..b as u32)
        .map(|i| (0..n as u32).map(|j| 2000 + i + 13 * j).collect())
        .collect();
    let mut times = [Vec::new(), Vec::new()];
    for r in 0..2 * reps {
        let arm = (r + r / 2) % 2;
        let inputs: Vec<SeqInput<'_>> = seqs
            .iter()
            .zip(&toks)
            .map(|(&s, t)| SeqInput {
                seq: s,
                tokens: t,
                logits: if n > 1 {
                    LogitsMode::Last
                } else {
                    LogitsMode::All
                },
            })
            .collect();
        let opts = ForwardOptions {
            layers: if arm == 1 { layers.clone() } else { Vec::new() },
            ..Default::default()
        };
        let t0 = std::time::Instant::now();
        let o = m.forward(&mut c, &inputs, &opts)?;
        times[arm].push(t0.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(&o);
        for &s in &seqs {
            c.truncate(s, ctx)?;
        }
    }
    for (arm, t) in times.iter_mut().enumerate() {
        t.sort_by(f64::total_cmp);
        println!(
            "{}: median {:.3} ms  p10 {:.3}  p90 {:.3}  (B = {b} × {n}, {} forwards)",
            if arm == 1 { "capture" } else { "plain  " },
            t[t.len() / 2],
            t[t.len() / 10],
            t[t.len() * 9 / 10],
            t.len()
        );
    }
    Ok(())
}
