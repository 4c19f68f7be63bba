//! Key statistics per layer and KV head over a text, and what rotated 8-bit rows lose with and
//! without the channel means subtracted (what `--kv-cache-dtype int8`'s key offsets do):
//! `kstats MODEL.gguf TEXT [N]`. Per head: the largest |k|, the channel with the largest mean
//! and its standard deviation, and the rounding error over the keys' total variance.
use dspark_runtime::model::*;
use dspark_runtime::{KvDtype, LoadOptions, Model, Tokenizer};
fn q8err(row: &[f32]) -> f64 {
    let mut r = row.to_vec();
    kernels::ops::hadamard(&mut r);
    let m = r.iter().fold(0f32, |a, x| a.max(x.abs()));
    let s = m / 127.0;
    r.iter()
        .map(|x| {
            let c = (x / s).round().clamp(-127.0, 127.0) * s;
            ((c - x) as f64).powi(2)
        })
        .sum()
}
fn main() -> anyhow::Result<()> {
    let mut a = std::env::args().skip(1);
    let p = std::path::PathBuf::from(
        a.next()
            .ok_or_else(|| anyhow::anyhow!("MODEL.gguf TEXT [N]"))?,
    );
    let text = std::fs::read_to_string(a.next().ok_or_else(|| anyhow::anyhow!("TEXT"))?)?;
    let n: usize = a.next().map(|s| s.parse()).transpose()?.unwrap_or(512);
    let tok = Tokenizer::load(&p)?;
    let mut ids = tok.encode(&text)?;
    ids.truncate(n);
    let m = Model::load(
        &p,
        &LoadOptions {
            kv_dtype: Some(KvDtype::F32),
            max_ctx: Some(n + 16),
            ..Default::default()
        },
    )?;
    let mut c = m.new_cache(n + 16, 16)?;
    let s = c.new_seq();
    for ch in ids.chunks(128) {
        m.forward(
            &mut c,
            &[SeqInput {
                seq: s,
                tokens: ch,
                logits: LogitsMode::None,
            }],
            &ForwardOptions::default(),
        )?;
    }
    let (nkv, hd) = (m.cfg.n_kv_heads, m.cfg.head_dim);
    let n = ids.len();
    for l in 0..m.cfg.n_layers {
        for h in 0..nkv {
            let mut rows: Vec<Vec<f32>> = Vec::with_capacity(n);
            for pos in 0..n {
                let k = c.read_k(l, c.slot(s, pos)?);
                rows.push(k[h * hd..(h + 1) * hd].to_vec());
            }
            let mut mean = vec![0f64; hd];
            for r in &rows {
                for (m, x) in mean.iter_mut().zip(r) {
                    *m += *x as f64 / n as f64;
                }
            }
            let mut var = vec![0f64; hd];
            for r in &rows {
                for ((v, x), m) in var.iter_mut().zip(r).zip(&mean) {
                    *v += (*x as f64 - m).powi(2) / n as f64;
                }
            }
            let maxabs = rows
                .iter()
                .flat_map(|r| r.iter())
                .fold(0f32, |a, x| a.max(x.abs()));
            let tvar: f64 = var.iter().sum();
            let e0: f64 = rows.iter().map(|r| q8err(r)).sum::<f64>() / n as f64;
            let e1: f64 = rows
                .iter()
                .map(|r| {
                    let c: Vec<f32> = r.iter().zip(&mean).map(|(x, m)| x - *m as f32).collect();
                    q8err(&c)
                })
                .sum::<f64>()
                / n as f64;
            let (jmax, mmax) = mean.iter().enumerate().fold((0, 0f64), |b, (j, m)| {
                if m.abs() > b.1 { (j, m.abs()) } else { b }
            });
            println!(
                "L{l:2} h{h} max|k| {maxabs:7.1} |mean|max {mmax:7.1}@{jmax:3} sd@that {:6.2} total var {tvar:9.1}  q8 err/var plain {:.2e} centered {:.2e}",
                var[jmax].sqrt(),
                e0 / tvar,
                e1 / tvar
            );
        }
    }
    Ok(())
}
