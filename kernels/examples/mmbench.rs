//! Matmul micro-benchmark: ms per call for one weight shape at several token counts.
use kernels::quant::{BlockQ4, BlockQ8};
use kernels::rng::Rng;
use kernels::{Isa, QMatrix, QWeights};
use std::time::Instant;
fn main() {
    let mut rng = Rng::new(1);
    let shapes = [
        (1536usize, 576usize),
        (576, 1536),
        (49152, 576),
        (8960, 1536),
    ];
    for (rows, cols) in shapes {
        let n = rows * cols / 32;
        let q4 = QMatrix::new(
            rows,
            cols,
            QWeights::Q4(
                (0..n)
                    .map(|_| BlockQ4 {
                        d: 0.01,
                        m: -0.05,
                        qs: [(rng.next_u64() & 0xff) as u8; 16],
                    })
                    .collect(),
            ),
        )
        .unwrap();
        let q8 = QMatrix::new(
            rows,
            cols,
            QWeights::Q8(
                (0..n)
                    .map(|_| BlockQ8 {
                        d: [0.01, 0.02],
                        qs: [3; 32],
                    })
                    .collect(),
            ),
        )
        .unwrap();
        for (name, mat) in [("q4", &q4), ("q8", &q8)] {
            for isa in Isa::available().into_iter().skip(1) {
                let mut line = format!("{rows}x{cols} {name} {:?}:", isa);
                for m in [1usize, 8, 16, 64, 256] {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.normal() as f32).collect();
                    let mut out = vec![0f32; m * rows];
                    mat.matmul(&x, m, &mut out, isa);
                    let reps = 20;
                    let t0 = Instant::now();
                    for _ in 0..reps {
                        mat.matmul(&x, m, &mut out, isa);
                    }
                    let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
                    line += &format!("  m={m}: {us:.0}us");
                }
                println!("{line}");
            }
        }
    }
}
