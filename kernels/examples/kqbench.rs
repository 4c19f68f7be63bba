//! K-quant matmul micro-benchmark: µs per call and weight GB/s for Qwen2.5-1.5B shapes.
use kernels::grouped::{GROUP_ROWS, Q4KGroup, Q6KGroup};
use kernels::rng::Rng;
use kernels::{Isa, QMatrix, QWeights};
use std::time::Instant;
fn main() {
    let mut rng = Rng::new(1);
    // `KQ_ISA=avx2` (or any `Isa` name) runs that path instead of the fastest.
    let isa = std::env::var("KQ_ISA")
        .map(|n| Isa::parse(&n).expect("KQ_ISA"))
        .unwrap_or_else(|_| Isa::detect());
    if std::env::var("KQ_STREAM").is_ok() {
        let mut rng = Rng::new(2);
        let (rows, cols) = (17920usize, 1536usize);
        let n = rows / GROUP_ROWS * cols / 256;
        let q6 = std::env::var("KQ_STREAM").is_ok_and(|v| v == "6");
        let mats: Vec<QMatrix> = (0..40)
            .map(|_| {
                let mut byte = || (rng.next_u64() & 0xff) as u8;
                let w = if q6 {
                    let g = Q6KGroup {
                        d: [0.01; 16],
                        sc: [[byte() as i8; 16]; 16],
                        q: [[byte(); 192]; 16],
                    };
                    QWeights::Q6K(vec![g; n])
                } else {
                    let g = Q4KGroup {
                        d: [0.01; 16],
                        dmin: [0.001; 16],
                        sc: [[byte() & 63; 16]; 8],
                        mn: [[byte() & 63; 16]; 8],
                        qs: [[byte(); 256]; 8],
                    };
                    QWeights::Q4K(vec![g; n])
                };
                QMatrix::new(rows, cols, w).expect("matrix")
            })
            .collect();
        let x: Vec<f32> = (0..cols).map(|_| rng.normal() as f32).collect();
        let mut out = vec![0f32; rows];
        for rep in 0..4 {
            let t0 = Instant::now();
            for m in &mats {
                m.matmul(&x, 1, &mut out, isa);
            }
            let s = t0.elapsed().as_secs_f64();
            let bytes: usize = mats.iter().map(|m| m.bytes()).sum();
            println!("stream rep {rep}: {:.1} GB/s", bytes as f64 / s / 1e9);
        }
        return;
    }
    let ms: Vec<usize> = match std::env::args().nth(1) {
        Some(a) => a.split(',').filter_map(|v| v.parse().ok()).collect(),
        None => vec![1, 4, 8, 16, 64],
    };
    for (rows, cols) in [(1536usize, 1536usize), (17920, 1536), (1536, 8960)] {
        let n = rows / GROUP_ROWS * cols / 256;
        let mut byte = || (rng.next_u64() & 0xff) as u8;
        let q4 = QMatrix::new(
            rows,
            cols,
            QWeights::Q4K(
                (0..n)
                    .map(|_| Q4KGroup {
                        d: [0.01; 16],
                        dmin: [0.001; 16],
                        sc: [[byte() & 63; 16]; 8],
                        mn: [[byte() & 63; 16]; 8],
                        qs: [[byte(); 256]; 8],
                    })
                    .collect(),
            ),
        )
        .expect("q4k");
        let q6 = QMatrix::new(
            rows,
            cols,
            QWeights::Q6K(
                (0..n)
                    .map(|_| Q6KGroup {
                        d: [0.01; 16],
                        sc: [[byte() as i8; 16]; 16],
                        q: [[byte(); 192]; 16],
                    })
                    .collect(),
            ),
        )
        .expect("q6k");
        for (name, mat) in [("q4k", &q4), ("q6k", &q6)] {
            let mut line = format!("{rows}x{cols} {name} {isa:?}:");
            for &m in &ms {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.normal() as f32).collect();
                let mut out = vec![0f32; m * rows];
                mat.matmul(&x, m, &mut out, isa);
                let reps = 200 / m;
                let t0 = Instant::now();
                for _ in 0..reps {
                    mat.matmul(&x, m, &mut out, isa);
                }
                let s = t0.elapsed().as_secs_f64() / reps as f64;
                line += &format!(
                    "  m={m}: {:.0}us ({:.1} GB/s)",
                    s * 1e6,
                    mat.bytes() as f64 / s / 1e9
                );
            }
            println!("{line}");
        }
    }
}
