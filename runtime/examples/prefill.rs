//! Prefill throughput: one forward over N prompt tokens, time split by part.
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use dspark_runtime::{LoadOptions, Model};
fn main() {
    let p = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let m = Model::load(&p, &LoadOptions::default()).unwrap();
    for _ in 0..3 {
        let mut c = m.new_cache(n + 16, 16).unwrap();
        let s = c.new_seq();
        let toks: Vec<u32> = (0..n as u32).map(|i| 1000 + i * 7 % 40000).collect();
        let t0 = std::time::Instant::now();
        let o = m
            .forward(
                &mut c,
                &[SeqInput {
                    seq: s,
                    tokens: &toks,
                    logits: LogitsMode::Last,
                }],
                &ForwardOptions {
                    profile: true,
                    ..Default::default()
                },
            )
            .unwrap();
        let p = o.profile.unwrap();
        println!(
            "{n} tokens: {:.0} ms ({:.0} tok/s) matmul {:.0} attention {:.0} head {:.0} other {:.0}",
            t0.elapsed().as_secs_f64() * 1e3,
            n as f64 / t0.elapsed().as_secs_f64(),
            p.matmul_s * 1e3,
            p.attention_s * 1e3,
            p.head_s * 1e3,
            p.other_s * 1e3
        );
    }
}
