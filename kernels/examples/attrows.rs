//! One attention task (one KV head, f16 cache, 257 positions) for 3, 12 and 24 query rows:
//! `cargo run --release -p kernels --example attrows [REPS]`.
use half::f16;
use kernels::Isa;
use kernels::ops::*;
fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20000);
    let (hd, n_kv, bs, nb) = (64usize, 3usize, 16usize, 17usize);
    let mut s = 1u32;
    let mut rnd = || {
        s = s.wrapping_mul(1664525).wrapping_add(1013904223);
        (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    let kpool: Vec<f16> = (0..nb * bs * n_kv * hd)
        .map(|_| f16::from_f32(rnd()))
        .collect();
    let vpool: Vec<f16> = (0..nb * bs * n_kv * hd)
        .map(|_| f16::from_f32(rnd()))
        .collect();
    let blocks: Vec<u32> = (0..nb as u32).rev().collect();
    let isa = Isa::detect();
    for r in [3usize, 12, 24] {
        let lims: Vec<usize> = (0..r).map(|i| 250 + i / 3).collect();
        let q: Vec<f32> = (0..r * hd).map(|_| rnd()).collect();
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
            g: 1,
            hd,
            scale: 0.125,
        };
        let mut sc = Vec::new();
        let mut out = vec![0f32; r * hd];
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            for _ in 0..reps / 5 {
                attend(isa, &args, &mut sc, &mut out);
            }
            best = best.min(t0.elapsed().as_secs_f64() / (reps / 5) as f64);
        }
        println!(
            "rows {r:2} {isa:?}: {:.2} us (checksum {:.4})",
            best * 1e6,
            out.iter().sum::<f32>()
        );
    }
}
