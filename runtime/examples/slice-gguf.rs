//! Cuts a GGUF checkpoint to its first N layers (`dspark_runtime::tiny::slice_gguf`):
//! `cargo run --release -p dspark-runtime --example slice-gguf -- SRC DST N`.
//! `scripts/gpu-check.sh prepare` uses it to carry real weights to a GPU machine without network.

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [src, dst, n] = args.as_slice() else {
        anyhow::bail!("usage: slice-gguf SRC DST LAYERS");
    };
    let layers: usize = n.parse()?;
    dspark_runtime::tiny::slice_gguf(src.as_ref(), dst.as_ref(), layers)?;
    println!("{dst}: first {layers} layers of {src}");
    Ok(())
}
