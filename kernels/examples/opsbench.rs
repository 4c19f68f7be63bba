//! Times SiLU·mul, RoPE and RMSNorm at SmolLM2's shapes for 8 tokens, the greedy argmax of
//! one SmolLM2 logits row (the two-pass one and the one-pass scan it replaced), and one
//! sampled position at temperature 1 (softmax and draw) over SmolLM2's vocabulary and over
//! its drafter's; and the activations' quantization before a matmul (rows × columns, on a
//! team of two threads as in a forward).
//! `cargo run --release -p kernels --example opsbench`
use kernels::Isa;
use kernels::ops::*;

fn main() {
    let isa = Isa::detect();
    let team = kernels::par::Team::new(2, "opsbench").expect("a team of two threads");
    team.install(|| {
        for (m, cols) in [
            (1usize, 576usize),
            (8, 576),
            (8, 1536),
            (32, 576),
            (32, 1536),
        ] {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0)
                .collect();
            let reps = 20_000;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                let q = kernels::grouped::quantize_rows(std::hint::black_box(&x), m, cols, isa);
                std::hint::black_box(q);
            }
            println!(
                "quantize_rows {m} × {cols}: {:.2} us",
                t0.elapsed().as_secs_f64() * 1e6 / reps as f64
            );
        }
    });
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
    // The maximum three quarters of the way in: the second pass reads that far.
    let mut logits: Vec<f32> = (0..49_152)
        .map(|i| ((i * 7919 % 10007) as f32) * 1e-3)
        .collect();
    logits[36_000] = 100.0;
    let argmaxes: [(&str, fn(&[f32]) -> u32); 2] = [
        ("argmax", kernels::sampling::argmax),
        ("argmax_scan", kernels::sampling::argmax_scan),
    ];
    for (name, f) in argmaxes {
        let t0 = std::time::Instant::now();
        let mut at = 0;
        for _ in 0..1000 {
            at = f(std::hint::black_box(&logits));
        }
        println!(
            "{name} 49 152 logits: {:.2} us (index {at})",
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    let p = kernels::sampling::SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let mut rng = kernels::rng::Rng::new(1);
    for n in [49_152usize, 8_192] {
        let row: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 10007) as f32) * 1e-3 - 5.0)
            .collect();
        let t0 = std::time::Instant::now();
        let mut last = 0;
        for _ in 0..1000 {
            let pr = kernels::sampling::probs(std::hint::black_box(&row), &[], &p);
            last = kernels::sampling::sample(&pr, &mut rng);
        }
        println!(
            "probs + sample, T = 1, {n} logits: {:.2} us (last draw {last})",
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}
