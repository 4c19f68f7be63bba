//! The NEON kernels on 64-bit Arm, from an x86 machine: `scripts/test-aarch64.sh` cross-builds
//! this crate's unit tests and runs them under qemu-user as two CPUs (with and without the
//! dot-product extension). On an Arm machine the unit tests run natively instead.
//!
//! Skipped with a message when the cross toolchain or qemu is missing, unless
//! `DSPARK_REQUIRE_AARCH64=1` (CI installs them and sets it), so that CI cannot skip it silently.

use std::path::Path;
use std::process::Command;

fn have(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn neon_kernels_pass_their_unit_tests_under_qemu() {
    if !cfg!(target_arch = "x86_64") {
        eprintln!("not an x86_64 host: the unit tests run natively here");
        return;
    }
    let target_installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("aarch64-unknown-linux-gnu"));
    let missing: Vec<&str> = [
        (!target_installed).then_some("rustup target aarch64-unknown-linux-gnu"),
        (!have("aarch64-linux-gnu-gcc", "--version")).then_some("aarch64-linux-gnu-gcc"),
        (!have("qemu-aarch64", "--version")).then_some("qemu-aarch64"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !missing.is_empty() {
        assert!(
            std::env::var_os("DSPARK_REQUIRE_AARCH64").is_none(),
            "DSPARK_REQUIRE_AARCH64 is set but these are missing: {missing:?}"
        );
        eprintln!("skipping the aarch64 kernel tests: missing {missing:?}");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/test-aarch64.sh"))
        .current_dir(&root)
        .output()
        .expect("run scripts/test-aarch64.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "scripts/test-aarch64.sh failed:\n{text}"
    );
    // Both CPUs ran, and ran tests.
    let runs: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("test result: ok."))
        .collect();
    assert_eq!(runs.len(), 2, "{text}");
    assert!(runs.iter().all(|l| !l.contains("ok. 0 passed")), "{text}");
    eprintln!("{}", runs.join("\n"));
}
