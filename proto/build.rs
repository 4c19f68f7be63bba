//! Compiles proto/dspark/v1/*.proto with protox (pure Rust; no system protoc needed).
fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["dspark/v1/dspark.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
