//! Where a forward's time goes at k = 1, 2, 4 and 8 (ctx 256, batch 1).
//! `cargo run --release -p dspark-runtime --example profile -- MODEL.gguf [ISA]`
use dspark_runtime::model::*;
use dspark_runtime::{LoadOptions, Model};
fn main() {
    let p = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    // Optional second argument: the ISA (`avx2`, `avx512`, ...), as `--isa` sets it.
    let isa = std::env::args()
        .nth(2)
        .map(|s| kernels::Isa::parse(&s).unwrap());
    let m = Model::load(
        &p,
        &LoadOptions {
            isa,
            ..Default::default()
        },
    )
    .unwrap();
    let mut c = m.new_cache(400, 16).unwrap();
    let s = c.new_seq();
    let prompt: Vec<u32> = (0..256).map(|i| 1000 + i * 7).collect();
    m.forward(
        &mut c,
        &[SeqInput {
            seq: s,
            tokens: &prompt,
            logits: LogitsMode::None,
        }],
        &ForwardOptions::default(),
    )
    .unwrap();
    for k in [1usize, 2, 4, 8] {
        let toks: Vec<u32> = (0..k as u32).map(|i| 2000 + i).collect();
        let mut best: Option<(f64, ForwardProfile)> = None;
        for _ in 0..10 {
            let t0 = std::time::Instant::now();
            let o = m
                .forward(
                    &mut c,
                    &[SeqInput {
                        seq: s,
                        tokens: &toks,
                        logits: LogitsMode::All,
                    }],
                    &ForwardOptions {
                        profile: true,
                        ..Default::default()
                    },
                )
                .unwrap();
            let dt = t0.elapsed().as_secs_f64();
            c.truncate(s, 256).unwrap();
            if best.as_ref().is_none_or(|b| dt < b.0) {
                best = o.profile.map(|p| (dt, p));
            }
        }
        let (dt, p) = best.unwrap();
        println!(
            "k={k}: total {:.2} ms  matmul {:.2}  head {:.2}  attention {:.2}  other {:.2}",
            dt * 1e3,
            p.matmul_s * 1e3,
            p.head_s * 1e3,
            p.attention_s * 1e3,
            p.other_s * 1e3
        );
    }
}
