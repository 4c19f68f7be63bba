use kernels::Isa;
use kernels::ops::*;
fn main() {
    let mut v: Vec<f32> = (0..771).map(|i| (i as f32) * 0.01).collect();
    let t0 = std::time::Instant::now();
    for _ in 0..1000 {
        softmax(&mut v[..257]);
        softmax(&mut v[257..514]);
        softmax(&mut v[514..]);
    }
    println!("softmax 3x257: {:.2} us", t0.elapsed().as_secs_f64() * 1e3);
    let mut acc = 0f32;
    let t0 = std::time::Instant::now();
    for i in 0..771000 {
        acc += fast_exp(-(i % 100) as f32 * 0.1);
    }
    println!(
        "scalar fast_exp 771: {:.2} us {acc}",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let (hd, n_kv, bs, nb) = (64usize, 3usize, 16usize, 17usize);
    let kpool = vec![0.01f32; nb * bs * n_kv * hd];
    let vpool = vec![0.02f32; nb * bs * n_kv * hd];
    let blocks: Vec<u32> = (0..nb as u32).collect();
    for r in [3usize, 24] {
        let lims = vec![257usize; r];
        let q = vec![0.1f32; r * hd];
        for isa in [Isa::detect()] {
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
            let t0 = std::time::Instant::now();
            for _ in 0..1000 {
                attend(isa, &args, &mut sc, &mut out);
            }
            println!("R={r} {isa:?}: {:.1} us", t0.elapsed().as_secs_f64() * 1e3);
        }
    }
}
#[allow(dead_code)]
fn x() {}
