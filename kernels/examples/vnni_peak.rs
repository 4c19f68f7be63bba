//! How fast this core retires `vpdpbusd` (AVX-512 VNNI, 64 byte products each) with nothing
//! else in the way: twelve independent accumulators in registers. The grouped kernels spend
//! two of them per 4 weights × 16 rows × token (15-bit activations in two halves), so this
//! bounds what each verified token can cost: `cargo run --release -p kernels --example
//! vnni_peak -- [WEIGHTS_IN_MILLIONS] [THREADS]` (default SmolLM2-135M's 134.5 M, 2 threads).
#[cfg(target_arch = "x86_64")]
fn main() {
    let mut args = std::env::args().skip(1);
    let weights_m: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(134.5);
    let threads: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(2.0);
    if !std::arch::is_x86_feature_detected!("avx512vnni") {
        println!("this CPU has no AVX-512 VNNI");
        return;
    }
    let iters: u64 = 50_000_000;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        // SAFETY: the CPU has AVX-512 VNNI (checked above); the loop touches only the named
        // registers.
        unsafe { peak(iters) };
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let rate = (12 * iters) as f64 / best;
    let per_token = 2.0 * weights_m * 1e6 / 64.0;
    println!("vpdpbusd zmm: {:.2} G/s on one core", rate / 1e9);
    println!(
        "{weights_m} M weights: {:.2} M vpdpbusd a token, at least {:.3} ms a token on {threads} \
         such cores",
        per_token / 1e6,
        per_token / (rate * threads) * 1e3
    );
}

/// `12 · iters` dependent-free `vpdpbusd`s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn peak(iters: u64) {
    use std::arch::asm;
    // SAFETY: the caller checked the features; registers only.
    unsafe {
        asm!(
            "vpxord zmm0, zmm0, zmm0",
            "vpxord zmm1, zmm1, zmm1",
            "2:",
            "vpdpbusd zmm2, zmm1, zmm0",
            "vpdpbusd zmm3, zmm1, zmm0",
            "vpdpbusd zmm4, zmm1, zmm0",
            "vpdpbusd zmm5, zmm1, zmm0",
            "vpdpbusd zmm6, zmm1, zmm0",
            "vpdpbusd zmm7, zmm1, zmm0",
            "vpdpbusd zmm8, zmm1, zmm0",
            "vpdpbusd zmm9, zmm1, zmm0",
            "vpdpbusd zmm10, zmm1, zmm0",
            "vpdpbusd zmm11, zmm1, zmm0",
            "vpdpbusd zmm12, zmm1, zmm0",
            "vpdpbusd zmm13, zmm1, zmm0",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iters => _,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
            out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
            out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _,
            options(nostack, nomem)
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("an x86-64 measurement");
}
