//! Loading reads a Hugging Face checkpoint tensor by tensor: a tensor-parallel rank's peak
//! memory is its own part, not the checkpoint. (Alone in its process: the peak it measures,
//! `VmHWM`, is the process's.)

#![cfg(target_os = "linux")]

use dspark_runtime::tp::TpOptions;
use dspark_runtime::{LoadOptions, Model};
use std::io::Write;

/// Peak and current resident memory of this process, bytes.
fn memory() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb = |key: &str| -> u64 {
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/self/status"))
            * 1024
    };
    (kb("VmHWM:"), kb("VmRSS:"))
}

/// Writes a bf16 checkpoint tensor by tensor (never all of it in memory); its size.
fn write_checkpoint(dir: &std::path::Path) -> u64 {
    let (d, heads, kvh, ffn, layers, vocab) = (1024usize, 16, 4, 2816usize, 8, 1024usize);
    let hd = d / heads;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, d]),
        ("model.norm.weight".into(), vec![d]),
    ];
    for l in 0..layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![d, d]),
            ("self_attn.k_proj.weight", vec![kvh * hd, d]),
            ("self_attn.v_proj.weight", vec![kvh * hd, d]),
            ("self_attn.o_proj.weight", vec![d, d]),
            ("mlp.gate_proj.weight", vec![ffn, d]),
            ("mlp.up_proj.weight", vec![ffn, d]),
            ("mlp.down_proj.weight", vec![d, ffn]),
            ("input_layernorm.weight", vec![d]),
            ("post_attention_layernorm.weight", vec![d]),
        ] {
            shapes.push((p(n), s));
        }
    }
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (n, s) in &shapes {
        let bytes = s.iter().product::<usize>() * 2;
        header.insert(
            n.clone(),
            serde_json::json!({"dtype": "BF16", "shape": s, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(dir.join("model.safetensors")).unwrap());
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(h.as_bytes()).unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut row = Vec::new();
    for (n, s) in &shapes {
        let elems: usize = s.iter().product();
        row.clear();
        for _ in 0..elems {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Norms 1, matrices uniform in ±1/32.
            let v = if n.contains("norm") {
                1.0f32
            } else {
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) / 16.0
            };
            row.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
        f.write_all(&row).unwrap();
    }
    f.flush().unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!(r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":{d},"intermediate_size":{ffn},"num_hidden_layers":{layers},"num_attention_heads":{heads},"num_key_value_heads":{kvh},"vocab_size":{vocab},"rope_theta":10000.0,"rms_norm_eps":1e-5,"max_position_embeddings":256,"tie_word_embeddings":true}}"#),
    )
    .unwrap();
    (8 + h.len() + at) as u64
}

#[test]
fn a_tensor_parallel_rank_never_holds_the_whole_checkpoint() {
    let dir = std::env::temp_dir().join(format!("dspark-load-mem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let size = write_checkpoint(&dir);
    let (_, before) = memory();
    let opts = LoadOptions {
        threads: 1,
        tp: Some(TpOptions::shard(1, 4)),
        ..Default::default()
    };
    let m = Model::load(&dir, &opts).unwrap();
    let (peak, _) = memory();
    let grew = peak.saturating_sub(before);
    let own = m.weight_bytes() as u64;
    eprintln!(
        "checkpoint {} MB (bf16); rank 1 of 4 holds {} MB (f32); peak grew by {} MB",
        size >> 20,
        own >> 20,
        grew >> 20
    );
    // Its quarter of the layers in f32 is half the bf16 checkpoint: reading the checkpoint
    // whole as well (the old loader) peaked at one and a half times it.
    assert!(own < size * 6 / 10, "{own} of {size}");
    assert!(
        grew < size * 8 / 10,
        "peak grew by {grew} bytes loading rank 1 of 4 from a {size}-byte checkpoint"
    );
    drop(m);
    let _ = std::fs::remove_dir_all(&dir);
}
