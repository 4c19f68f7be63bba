//! 64-bit Arm from an x86 machine, under qemu-user (`scripts/test-aarch64.sh`):
//! - the kernels' unit tests built for aarch64, run as two CPUs (with and without the
//!   dot-product extension), which hold the NEON kernels to the portable mirror's bits;
//! - a whole forward (prefill, then a verification window) on NEON and NEON + dot product
//!   against this machine's x86 paths: the same hidden-state bits on a tiny llama and qwen2,
//!   and the same logits, head included, on SmolLM2, so a request can move between Arm and
//!   x86 workers without changing a token.
//!
//! On an Arm machine the kernels' unit tests run natively instead. Skipped with a message when
//! the cross toolchain or qemu is missing, unless `DSPARK_REQUIRE_AARCH64=1` (CI installs them
//! and sets it), so that CI cannot skip it silently.

use dspark_runtime::tiny::{fingerprint, scenario_bits, scenario_specs, tiny_model_path};
use dspark_runtime::{LoadOptions, Model};
use kernels::Isa;
use std::path::{Path, PathBuf};
use std::process::Command;

fn have(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether the cross toolchain and qemu are here (else skip, or fail under CI's flag).
fn cross_tools() -> bool {
    if !cfg!(target_arch = "x86_64") {
        eprintln!("not an x86_64 host: the unit tests run natively here");
        return false;
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
        eprintln!("skipping the aarch64 tests: missing {missing:?}");
        return false;
    }
    true
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs the script; its stdout (and stderr, in the message if it fails), after asserting it
/// succeeded.
fn script(args: &[&str]) -> (String, String) {
    let out = Command::new("bash")
        .arg(root().join("scripts/test-aarch64.sh"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run scripts/test-aarch64.sh");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "scripts/test-aarch64.sh {args:?} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

// One test, so that the two cross builds never wait on each other's lock.
#[test]
fn arm_kernels_pass_their_unit_tests_and_a_forward_gives_the_x86_bits() {
    if !cross_tools() {
        return;
    }
    let (text, _) = script(&[]);
    // Both CPUs ran, and ran tests.
    let runs: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("test result: ok."))
        .collect();
    assert_eq!(runs.len(), 2, "{text}");
    assert!(runs.iter().all(|l| !l.contains("ok. 0 passed")), "{text}");
    eprintln!("{}", runs.join("\n"));

    let mut models: Vec<(PathBuf, &str, bool)> = scenario_specs()
        .into_iter()
        .map(|(spec, name)| (tiny_model_path(&spec, name).unwrap(), name, false))
        .collect();
    // The real model with its logits: its head is Q8_0 with a multiple of 16 rows, so it
    // takes the grouped kernels too (the tiny heads take the f32 kernels, whose order differs).
    let home = dspark_runtime::fetch::dspark_home(
        std::env::var_os("DSPARK_HOME")
            .map(PathBuf::from)
            .as_deref(),
    );
    let smollm2 =
        dspark_runtime::fetch::resolve("smollm2-135m", &home, "python3", &mut |m| eprintln!("{m}"))
            .expect("smollm2-135m must be fetchable (run `dspark fetch-model smollm2-135m`)");
    models.push((smollm2, "smollm2-135m", true));
    for (p, name, logits) in models {
        let path = p.to_str().expect("utf-8 path");
        // This machine's grouped paths (all the same bits: runtime/tests/runtime.rs).
        let Some(&isa) = Isa::available()
            .iter()
            .rfind(|&&i| kernels::grouped::native(i) && i != Isa::Avx512Bf16)
        else {
            eprintln!("no x86 path with grouped kernels on this CPU (no AVX2): nothing to compare");
            return;
        };
        let m = Model::load(
            &p,
            &LoadOptions {
                threads: 2,
                isa: Some(isa),
                ..Default::default()
            },
        )
        .unwrap();
        let bits = scenario_bits(&m, logits).unwrap();
        let want = format!("{} {:016x}", bits.len(), fingerprint(&bits));
        for arm in ["neon", "neondot"] {
            let mut args = vec!["forward-bits", path, arm];
            if logits {
                args.push("logits");
            }
            let (out, err) = script(&args);
            let line = out.lines().last().unwrap_or_default();
            assert_eq!(
                line,
                format!("{arm} {want}"),
                "{name}: {arm} under qemu against {isa:?} here\n{out}\n{err}"
            );
        }
    }
}
