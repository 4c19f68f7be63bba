//! Times SiLU·mul, RoPE and RMSNorm at SmolLM2's shapes for 8 tokens.
//! `cargo run --release -p kernels --example opsbench`
use kernels::Isa;
use kernels::ops::*;

fn main() {
    let isa = Isa::detect();
    let n = 8;
    let gu: Vec<f32> = (0..n * 3072)
        .map(|i| ((i % 97) as f32 - 48.0) * 0.05)
        .collect();
    let mut act = vec![0f32; n * 1536];
    let t0 = std::time::Instant::now();
    for _ in 0..1000 {
        for t in 0..n {
            silu_mul(
                isa,
                &gu[t * 3072..(t + 1) * 3072],
                &mut act[t * 1536..(t + 1) * 1536],
            );
        }
    }
    println!(
        "silu_mul 8 × 1536: {:.2} us",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let rope = Rope::new(64, 10000.0, 2048, false);
    let mut q = vec![0.3f32; 9 * 64];
    let t0 = std::time::Instant::now();
    for i in 0..1000 {
        for _ in 0..n {
            rope.apply(&mut q, 256 + i % 8);
        }
    }
    println!(
        "rope 8 tokens × 9 heads: {:.2} us",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let x = vec![0.3f32; 576];
    let w = vec![1.0f32; 576];
    let mut o = vec![0f32; 576];
    let t0 = std::time::Instant::now();
    for _ in 0..1000 {
        for _ in 0..n {
            rms_norm(isa, &x, &w, 1e-5, &mut o);
        }
    }
    println!(
        "rms_norm 8 × 576: {:.2} us",
        t0.elapsed().as_secs_f64() * 1e3
    );
}
