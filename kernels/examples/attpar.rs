//! One layer's attention tasks (SmolLM2's shape: 3 KV heads × 3 query heads, 17 blocks of 16
//! f16 positions) run serially, on rayon's pool and on a `kernels::par::Team`, each after a
//! serial gap of `GAP` µs, as a forward's loops follow its norms and RoPE. Rayon's idle
//! worker sleeps during gaps of about 10 µs or more and the loop after pays its wake-up.
//! `cargo run --release -p kernels --example attpar`
use half::f16;
use kernels::Isa;
use kernels::ops::*;
use kernels::par::{self, Team};
use rayon::prelude::*;

fn main() {
    let (hd, n_kv, bs, nb) = (64usize, 3usize, 16usize, 17usize);
    let kpool = vec![f16::from_f32(0.01); nb * bs * n_kv * hd];
    let vpool = vec![f16::from_f32(0.02); nb * bs * n_kv * hd];
    let blocks: Vec<u32> = (0..nb as u32).collect();
    let isa = Isa::detect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("rayon pool");
    let team = Team::new(2, "attpar").expect("team");
    for gap in [0.0f64, 10.0, 40.0] {
        for k in [2usize, 8] {
            // One task per (KV head, token): 3 query rows each.
            let tasks: Vec<(usize, usize)> = (0..n_kv)
                .flat_map(|g| (0..k).map(move |_| (g, 1)))
                .collect();
            let run = |&(g, nt): &(usize, usize)| -> Vec<f32> {
                let r = nt * 3;
                let lims: Vec<usize> = (0..r).map(|i| 250 + i / 3).collect();
                let q = vec![0.1f32; r * hd];
                let args = AttendArgs {
                    q: &q,
                    lims: &lims,
                    kpool: &kpool,
                    vpool: &vpool,
                    kscale: &[],
                    vscale: &[],
                    blocks: &blocks,
                    bs,
                    n_kv,
                    g,
                    hd,
                    scale: 0.125,
                };
                let mut sc = Vec::new();
                let mut out = vec![0f32; r * hd];
                attend(isa, &args, &mut sc, &mut out);
                out
            };
            for mode in ["serial", "rayon", "team"] {
                let mut tot = 0.0;
                let reps = 2000;
                let body = || {
                    for _ in 0..reps {
                        let tg = std::time::Instant::now();
                        while tg.elapsed().as_secs_f64() * 1e6 < gap {}
                        let t0 = std::time::Instant::now();
                        let r: Vec<Vec<f32>> = match mode {
                            "serial" => tasks.iter().map(run).collect(),
                            "rayon" => tasks.par_iter().map(run).collect(),
                            _ => par::map(tasks.len(), |i| run(&tasks[i])),
                        };
                        std::hint::black_box(r);
                        tot += t0.elapsed().as_secs_f64() * 1e6;
                    }
                };
                match mode {
                    "team" => team.install(body),
                    _ => pool.install(body),
                }
                println!(
                    "gap {gap:>4} us, k = {k}, {mode:>6}: mean {:.1} us",
                    tot / reps as f64
                );
            }
        }
    }
}
