//! Checkpoints the forward would serve wrong — biases it does not add, matrices and biases
//! larger than the config — are refused at load, with the tensor named; the same models
//! without them load, whole and as a tensor-parallel rank's slice.

use candle_core::quantized::gguf_file;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use dspark_runtime::tiny::{TinySpec, tiny_model_path};
use dspark_runtime::tp::TpOptions;
use dspark_runtime::{LoadOptions, Model};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn opts(tp: Option<TpOptions>) -> LoadOptions {
    LoadOptions {
        threads: 1,
        tp,
        ..Default::default()
    }
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dspark-loadchk-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The load error of `path` (whole, or as rank 1 of 2), as text.
fn load_err(path: &Path, tp: bool) -> String {
    let o = opts(tp.then(|| TpOptions::shard(1, 2)));
    match Model::load(path, &o) {
        Ok(_) => panic!("{} loaded (tp: {tp})", path.display()),
        Err(e) => e.to_string(),
    }
}

fn loads(path: &Path, tp: bool) {
    let o = opts(tp.then(|| TpOptions::shard(1, 2)));
    if let Err(e) = Model::load(path, &o) {
        panic!("{} (tp: {tp}): {e}", path.display());
    }
}

/// `src` (a GGUF file) rewritten to `dst` with `edit` applied to its tensors.
fn rewritten(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, QTensor)>)) {
    let mut f = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut ts: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    edit(&mut ts);
    let md_ref: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts_ref: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut out, &md_ref, &ts_ref).unwrap();
}

fn f32_vector(n: usize) -> QTensor {
    let t = Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    QTensor::quantize(&t, GgmlDType::F32).unwrap()
}

fn q8_matrix(rows: usize, cols: usize) -> QTensor {
    let t = Tensor::ones((rows, cols), DType::F32, &Device::Cpu).unwrap();
    QTensor::quantize(&t, GgmlDType::Q8_0).unwrap()
}

fn add(name: &str, t: QTensor) -> impl FnOnce(&mut Vec<(String, QTensor)>) {
    let name = name.to_string();
    move |ts| ts.push((name, t))
}

fn replace(name: &str, t: QTensor) -> impl FnOnce(&mut Vec<(String, QTensor)>) {
    let name = name.to_string();
    move |ts| {
        let slot = ts.iter_mut().find(|e| e.0 == name).unwrap();
        slot.1 = t;
    }
}

#[test]
fn gguf_biases_the_forward_does_not_add_are_refused() {
    let dir = tmp_dir("gguf-bias");
    // llama: width 64, FFN 128; no bias of any kind is loaded.
    let llama = tiny_model_path(&TinySpec::llama(1), "loadchk-llama").unwrap();
    loads(&llama, false);
    for (name, n, says) in [
        ("blk.0.attn_q.bias", 64, "attention biases"),
        ("blk.1.attn_v.bias", 32, "attention biases"),
        ("blk.1.attn_output.bias", 64, "attention biases"),
        ("blk.0.ffn_down.bias", 64, "MLP biases"),
        ("blk.0.ffn_up.bias", 128, "MLP biases"),
    ] {
        let p = dir.join(format!("llama-{name}.gguf"));
        rewritten(&llama, &p, add(name, f32_vector(n)));
        for tp in [false, true] {
            let e = load_err(&p, tp);
            assert!(e.contains(name) && e.contains(says), "{name}: {e}");
            assert!(e.contains("llama"), "{name}: {e}");
        }
    }
    // qwen2: width 256, FFN 512; its q/k/v biases load, and nothing else.
    let qwen = tiny_model_path(&TinySpec::qwen2(6), "loadchk-qwen2").unwrap();
    loads(&qwen, false);
    for (name, n) in [
        ("blk.0.attn_output.bias", 256),
        ("blk.1.ffn_gate.bias", 512),
    ] {
        let p = dir.join(format!("qwen2-{name}.gguf"));
        rewritten(&qwen, &p, add(name, f32_vector(n)));
        let e = load_err(&p, false);
        assert!(e.contains(name) && e.contains("qwen2"), "{name}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gguf_matrices_and_biases_larger_than_the_config_are_refused() {
    let dir = tmp_dir("gguf-shape");
    let llama = tiny_model_path(&TinySpec::llama(1), "loadchk-llama").unwrap();
    // Rank 1 of 2 takes columns 32..64 of the output projection: a stored matrix wider than
    // the config must be refused there too, not sliced.
    loads(&llama, true);
    for (name, rows, cols, want) in [
        ("blk.0.attn_output.weight", 64, 96, "[64, 64]"),
        ("blk.1.ffn_down.weight", 64, 160, "[64, 128]"),
        ("blk.0.attn_q.weight", 96, 64, "[64, 64]"),
        ("blk.1.ffn_gate.weight", 160, 64, "[128, 64]"),
    ] {
        let p = dir.join(format!("wide-{name}.gguf"));
        rewritten(&llama, &p, replace(name, q8_matrix(rows, cols)));
        for tp in [false, true] {
            let e = load_err(&p, tp);
            let got = format!("[{rows}, {cols}]");
            assert!(
                e.contains(name) && e.contains(&got) && e.contains(want),
                "{name} (tp: {tp}): {e}"
            );
        }
    }
    // qwen2's Q4_K output projection: rank 1's heads start mid-block (columns 128..256 of a
    // 256-wide block), so it holds the whole block and pads its input; that still loads.
    let qwen = tiny_model_path(&TinySpec::qwen2(6), "loadchk-qwen2").unwrap();
    loads(&qwen, true);
    // A q bias longer than the q projection's rows is refused, not cut.
    let p = dir.join("long-q-bias.gguf");
    rewritten(&qwen, &p, replace("blk.0.attn_q.bias", f32_vector(288)));
    for tp in [false, true] {
        let e = load_err(&p, tp);
        assert!(
            e.contains("blk.0.attn_q.bias") && e.contains("288") && e.contains("256"),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A one-layer Hugging Face llama directory (width 64, 4 heads, 2 KV heads, FFN 96, f32),
/// with `edit` applied to its tensors and `extra` added to its config.json.
fn hf_dir(name: &str, extra: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> PathBuf {
    let (d, heads, kvh, ffn, vocab) = (64usize, 4usize, 2usize, 96usize, 300usize);
    let kvd = kvh * d / heads;
    let dir = tmp_dir(name);
    let m = |r: usize, c: usize| Tensor::ones((r, c), DType::F32, &Device::Cpu).unwrap();
    let v = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    let mut ts: HashMap<String, Tensor> = HashMap::new();
    ts.insert("model.embed_tokens.weight".into(), m(vocab, d));
    ts.insert("model.norm.weight".into(), v(d));
    for (n, t) in [
        ("input_layernorm.weight", v(d)),
        ("post_attention_layernorm.weight", v(d)),
        ("self_attn.q_proj.weight", m(d, d)),
        ("self_attn.k_proj.weight", m(kvd, d)),
        ("self_attn.v_proj.weight", m(kvd, d)),
        ("self_attn.o_proj.weight", m(d, d)),
        ("mlp.gate_proj.weight", m(ffn, d)),
        ("mlp.up_proj.weight", m(ffn, d)),
        ("mlp.down_proj.weight", m(d, ffn)),
    ] {
        ts.insert(format!("model.layers.0.{n}"), t);
    }
    edit(&mut ts);
    candle_core::safetensors::save(&ts, dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!(
            r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":{d},"intermediate_size":{ffn},"num_hidden_layers":1,"num_attention_heads":{heads},"num_key_value_heads":{kvh},"vocab_size":{vocab},"rms_norm_eps":1e-5,"max_position_embeddings":256{extra}}}"#
        ),
    )
    .unwrap();
    dir
}

fn ones(shape: &[usize]) -> Tensor {
    Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn hugging_face_biases_and_wide_matrices_are_refused() {
    let good = hf_dir(
        "hf-good",
        r#","attention_bias":false,"mlp_bias":false"#,
        |_| {},
    );
    loads(&good, false);
    loads(&good, true);
    let o_proj = "model.layers.0.self_attn.o_proj.weight";
    let wide = hf_dir("hf-wide-o", "", |ts| {
        ts.insert(o_proj.into(), ones(&[64, 96]));
    });
    for tp in [false, true] {
        let e = load_err(&wide, tp);
        assert!(
            e.contains(o_proj) && e.contains("[64, 96]") && e.contains("[64, 64]"),
            "tp: {tp}: {e}"
        );
    }
    let down = "model.layers.0.mlp.down_proj.weight";
    let wide = hf_dir("hf-wide-down", "", |ts| {
        ts.insert(down.into(), ones(&[64, 128]));
    });
    let e = load_err(&wide, false);
    assert!(e.contains(down) && e.contains("[64, 128]"), "{e}");
    for (bias, n, says) in [
        (
            "model.layers.0.self_attn.q_proj.bias",
            64,
            "attention biases",
        ),
        (
            "model.layers.0.self_attn.o_proj.bias",
            64,
            "attention biases",
        ),
        ("model.layers.0.mlp.up_proj.bias", 96, "MLP biases"),
    ] {
        let dir = hf_dir(&format!("hf-{bias}"), "", |ts| {
            ts.insert(bias.into(), ones(&[n]));
        });
        let e = load_err(&dir, false);
        assert!(e.contains(bias) && e.contains(says), "{bias}: {e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    for key in ["attention_bias", "mlp_bias"] {
        let dir = hf_dir(
            &format!("hf-cfg-{key}"),
            &format!(r#","{key}":true"#),
            |_| {},
        );
        let e = load_err(&dir, false);
        assert!(e.contains(key), "{key}: {e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    for d in ["hf-good", "hf-wide-o", "hf-wide-down"] {
        let _ = std::fs::remove_dir_all(tmp_dir(d));
    }
}
