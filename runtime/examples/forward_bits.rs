//! Prints the fingerprint of a model's bits on one kernel path over a fixed scenario
//! ([`dspark_runtime::tiny::scenario_bits`]: a prefill, then a verification window):
//!
//! ```sh
//! cargo run --example forward_bits -- MODEL.gguf ISA [logits]   # → "ISA WORDS FINGERPRINT"
//! ```
//!
//! `runtime/tests/aarch64.rs` runs it for Arm under qemu-user (`scripts/test-aarch64.sh
//! forward-bits`) and compares with the x86 paths' bits.

use anyhow::Context;
use dspark_runtime::tiny::{fingerprint, scenario_bits};
use dspark_runtime::{LoadOptions, Model};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: forward_bits MODEL.gguf ISA [logits]";
    let path = args.next().context(usage)?;
    let isa = kernels::Isa::parse(&args.next().context(usage)?)?;
    let logits = args.next().as_deref() == Some("logits");
    let m = Model::load(
        std::path::Path::new(&path),
        &LoadOptions {
            threads: 2,
            isa: Some(isa),
            ..Default::default()
        },
    )?;
    let bits = scenario_bits(&m, logits)?;
    println!("{} {} {:016x}", isa.name(), bits.len(), fingerprint(&bits));
    Ok(())
}
