//! The Helm chart: lint, schema, strict Kubernetes validation, wiring against the binary's own
//! flags, and its pods started as loopback processes serving a chat request
//! (`scripts/helm-check.py --run`; needs `pip install helm-python-sdk kubernetes-validate`,
//! which .ci/run installs, and etcd).

use std::process::Command;

#[test]
fn helm_chart_renders_valid_objects_whose_pods_serve() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = dspark_tests::dspark_bin();
    let out = Command::new("python3")
        .arg(root.join("scripts/helm-check.py"))
        .arg("--bin")
        .arg(&bin)
        .arg("--run")
        .output()
        .expect("python3 runs scripts/helm-check.py");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "helm-check failed:\n{so}\n{se}");
    // Every stage reported, not skipped.
    for stage in [
        "lint: clean",
        "values sets accepted",
        "(strict)",
        "wiring consistent",
        "chat completion through the render's pods",
        "target worker metrics scraped as annotated",
        "draft worker metrics scraped as annotated",
        "scheduler metrics scraped as annotated",
    ] {
        assert!(so.contains(stage), "missing `{stage}` in:\n{so}");
    }
}
