//! Where a decoding step's time goes with B sequences of C cached positions each, their own
//! (unshared) blocks, for one KV cache element type: the mean of 20 steps.
//! `cargo run --release -p dspark-runtime --example decode_profile -- MODEL.gguf f16|f32|int8v|int8 B C`
use anyhow::Context;
use dspark_runtime::model::*;
use dspark_runtime::{KvDtype, LoadOptions, Model};

fn main() -> anyhow::Result<()> {
    let usage = "usage: decode_profile MODEL.gguf f16|f32|int8v|int8 BATCH CTX";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, dtype, batch, ctx] = &args[..] else {
        anyhow::bail!(usage);
    };
    let dt = KvDtype::parse(dtype)?;
    let b: usize = batch.parse().context(usage)?;
    let ctx: usize = ctx.parse().context(usage)?;
    let m = Model::load(
        std::path::Path::new(path),
        &LoadOptions {
            kv_dtype: Some(dt),
            ..Default::default()
        },
    )?;
    let mut c = m.new_cache(b * (ctx + 64), 16)?;
    let seqs: Vec<_> = (0..b).map(|_| c.new_seq()).collect();
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| 1000 + i * 7).collect();
    for &s in &seqs {
        let input = SeqInput {
            seq: s,
            tokens: &prompt,
            logits: LogitsMode::None,
        };
        m.forward(&mut c, &[input], &ForwardOptions::default())?;
    }
    let tok = [2000u32];
    let mut tot = ForwardProfile::default();
    let mut wall = 0.0;
    let n = 20;
    for _ in 0..n {
        let inp: Vec<SeqInput> = seqs
            .iter()
            .map(|&s| SeqInput {
                seq: s,
                tokens: &tok,
                logits: LogitsMode::Last,
            })
            .collect();
        let t0 = std::time::Instant::now();
        let opts = ForwardOptions {
            profile: true,
            ..Default::default()
        };
        let o = m.forward(&mut c, &inp, &opts)?;
        wall += t0.elapsed().as_secs_f64();
        if let Some(p) = &o.profile {
            tot.matmul_s += p.matmul_s;
            tot.head_s += p.head_s;
            tot.attention_s += p.attention_s;
            tot.other_s += p.other_s;
        }
        m.recycle(o);
        for &s in &seqs {
            c.truncate(s, ctx)?;
        }
    }
    let f = 1e3 / n as f64;
    println!(
        "{} B={b} ctx={ctx}: step {:.2} ms  matmul {:.2}  head {:.2}  attention {:.2}  other {:.2}",
        dt.name(),
        wall * f,
        tot.matmul_s * f,
        tot.head_s * f,
        tot.attention_s * f,
        tot.other_s * f
    );
    Ok(())
}
