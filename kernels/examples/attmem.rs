//! One decode's attention task (3 query rows of one KV head against 257 f16 keys and values,
//! SmolLM2's shape) with the cache blocks in cache, then spread over 32 requests × 30 layers
//! (188 MB, as a 32-request decoding step at ctx 256 reads them): what streaming the cache
//! from memory costs against the arithmetic.
//! `cargo run --release -p kernels --example attmem`
use half::f16;
use kernels::Isa;
use kernels::ops::*;

fn main() {
    let (hd, n_kv, bs, nb) = (64usize, 3usize, 16usize, 17usize);
    let tasks = 30 * 32;
    let elems = tasks * nb * bs * n_kv * hd;
    let kpool = vec![f16::from_f32(0.25); elems];
    let vpool = vec![f16::from_f32(0.5); elems];
    let isa = Isa::detect();
    let r = 3;
    let lims = vec![257usize; r];
    let q = vec![0.1f32; r * hd];
    for spread in [false, true] {
        let (mut sc, mut out) = (Vec::new(), vec![0f32; r * hd]);
        let mut n = 0;
        let t0 = std::time::Instant::now();
        for _ in 0..3 {
            for t in 0..tasks {
                let base = if spread { t * nb } else { 0 } as u32;
                let blocks: Vec<u32> = (base..base + nb as u32).collect();
                for g in 0..n_kv {
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
                    attend(isa, &args, &mut sc, &mut out);
                    n += 1;
                }
            }
        }
        let what = if spread {
            "spread over 188 MB"
        } else {
            "in cache"
        };
        println!(
            "{what}: {:.2} us a task",
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        );
    }
}
