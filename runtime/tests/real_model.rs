//! Tests on the default real model (SmolLM2-135M, fetched on first use; `.ci/run` fetches it).

use dspark_runtime::chat::{ChatTemplate, Message};
use dspark_runtime::generate::{GenerateParams, generate};
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use dspark_runtime::{LoadOptions, Model, Tokenizer};
use kernels::Isa;
use std::path::PathBuf;
use std::sync::OnceLock;

fn model_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let home = dspark_runtime::fetch::dspark_home(
            std::env::var_os("DSPARK_HOME")
                .map(PathBuf::from)
                .as_deref(),
        );
        dspark_runtime::fetch::resolve("smollm2-135m", &home, "python3", &mut |m| eprintln!("{m}"))
            .expect("smollm2-135m must be fetchable (run `dspark fetch-model smollm2-135m`)")
    })
    .clone()
}

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        Model::load(
            &model_path(),
            &LoadOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap()
    })
}

/// The same weights dequantized to f32: the reference forward.
fn dense_reference() -> Model {
    Model::load(
        &model_path(),
        &LoadOptions {
            threads: 2,
            dense: true,
            ..Default::default()
        },
    )
    .unwrap()
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::load(&model_path()).unwrap())
}

#[test]
fn smollm2_answers_paris_in_chat_mode() {
    let t = tokenizer();
    let prompt = ChatTemplate::from_tokenizer(t)
        .unwrap()
        .render(
            &[Message::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    let ids = t.encode(&prompt).unwrap();
    let out = generate(
        model(),
        t,
        &ids,
        &GenerateParams {
            max_tokens: 24,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert!(out.text.contains("Paris"), "answer: {:?}", out.text);
}

#[test]
fn quantized_forward_matches_f32_dequantized_reference_on_512_positions() {
    let t = tokenizer();
    let text = include_str!("data/eval_text.txt");
    let ids = t.encode(text).unwrap();
    assert!(ids.len() >= 512, "eval text has only {} tokens", ids.len());
    let ids = &ids[..512];
    let reference = dense_reference();
    let run = |m: &Model| {
        let mut c = m.new_cache(600, 16).unwrap();
        let s = c.new_seq();
        m.forward(
            &mut c,
            &[SeqInput {
                seq: s,
                tokens: ids,
                logits: LogitsMode::All,
            }],
            &ForwardOptions::default(),
        )
        .unwrap()
    };
    let (q, d) = (run(model()), run(&reference));
    let v = q.vocab;
    let mut agree = 0usize;
    let mut kl = 0f64;
    for p in 0..ids.len() {
        let (a, b) = (&d.logits[p * v..(p + 1) * v], &q.logits[p * v..(p + 1) * v]);
        agree += (kernels::sampling::argmax(a) == kernels::sampling::argmax(b)) as usize;
        let (mut pa, mut pb) = (a.to_vec(), b.to_vec());
        kernels::ops::softmax(&mut pa);
        kernels::ops::softmax(&mut pb);
        kl += pa
            .iter()
            .zip(&pb)
            .filter(|(x, _)| **x > 0.0)
            .map(|(x, y)| *x as f64 * ((*x as f64).ln() - (y.max(1e-30) as f64).ln()))
            .sum::<f64>();
    }
    let top1 = agree as f64 / ids.len() as f64;
    let mean_kl = kl / ids.len() as f64;
    eprintln!(
        "smollm2-135m vs f32 reference: top-1 {:.4}, mean KL {:.6} ({})",
        top1,
        mean_kl,
        model().isa().name()
    );
    assert!(top1 >= 0.99, "top-1 agreement {top1}");
    assert!(mean_kl < 0.01, "mean KL {mean_kl}");
}

#[test]
fn tokenization_equals_llama_cpp_on_the_corpus() {
    let v: serde_json::Value =
        serde_json::from_str(include_str!("data/tokenizer_ref_smollm2.json")).unwrap();
    let t = tokenizer();
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(t.encode(text).unwrap(), want, "text: {text:?}");
    }
}

#[test]
fn varlen_batch_equals_separate_forwards_on_the_real_model() {
    let m = model();
    let t = tokenizer();
    let texts = [
        "def add(a, b):\n    return a + b\n",
        "The weather today is",
        "1, 2, 3, 4, 5, 6, 7, 8",
    ];
    let ids: Vec<Vec<u32>> = texts.iter().map(|s| t.encode(s).unwrap()).collect();
    let mut want = Vec::new();
    for i in &ids {
        let mut c = m.new_cache(64, 16).unwrap();
        let s = c.new_seq();
        want.push(
            m.forward(
                &mut c,
                &[SeqInput {
                    seq: s,
                    tokens: i,
                    logits: LogitsMode::All,
                }],
                &ForwardOptions::default(),
            )
            .unwrap()
            .logits,
        );
    }
    let mut c = m.new_cache(256, 16).unwrap();
    let seqs: Vec<_> = ids.iter().map(|_| c.new_seq()).collect();
    let ins: Vec<SeqInput<'_>> = seqs
        .iter()
        .zip(&ids)
        .map(|(&s, i)| SeqInput {
            seq: s,
            tokens: i,
            logits: LogitsMode::All,
        })
        .collect();
    let o = m.forward(&mut c, &ins, &ForwardOptions::default()).unwrap();
    for (i, w) in want.iter().enumerate() {
        for (a, b) in o.rows_of(i).iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-3 * (1.0 + a.abs()),
                "seq {i}: {a} vs {b}"
            );
        }
    }
}

/// AVX2 CPUs (AMD Zen 2/3, older Intel; with AVX-VNNI, newer Intel clients and E-core Xeons)
/// run twins of the AVX-512 VNNI kernels that give the same bits: SmolLM2's logits, head
/// included, over a prefill and a verification window.
#[test]
fn avx2_kernels_give_smollm2_the_same_logits_bits_as_avx512() {
    // The default ISA against AVX2, and AVX2 with AVX-VNNI where this CPU has it (on an
    // AVX-VNNI CPU without AVX-512, the default is AVX-VNNI, compared with plain AVX2).
    let default = model();
    let avx2: Vec<Model> = Isa::available()
        .into_iter()
        .filter(|&i| matches!(i, Isa::Avx2 | Isa::Avx2Vnni) && i != default.isa())
        .map(|isa| {
            Model::load(
                &model_path(),
                &LoadOptions {
                    threads: 2,
                    isa: Some(isa),
                    ..Default::default()
                },
            )
            .unwrap()
        })
        .collect();
    if avx2.is_empty() || default.isa() == Isa::Scalar {
        eprintln!("skipped: this CPU has one x86 kernel set only");
        return;
    }
    let prompt = tokenizer()
        .encode("fn main() {\n    let x = vec![1, 2, 3];")
        .unwrap();
    let mut outs = Vec::new();
    for m in std::iter::once(default).chain(&avx2) {
        let mut c = m.new_cache(64, 16).unwrap();
        let s = c.new_seq();
        let mut bits = Vec::new();
        for toks in [&prompt[..], &[28, 253, 5, 9, 1000, 77, 3, 12]] {
            let o = m
                .forward(
                    &mut c,
                    &[SeqInput {
                        seq: s,
                        tokens: toks,
                        logits: LogitsMode::All,
                    }],
                    &ForwardOptions::default(),
                )
                .unwrap();
            bits.extend(o.logits.iter().map(|v| v.to_bits()));
        }
        outs.push(bits);
    }
    for (m, bits) in avx2.iter().zip(&outs[1..]) {
        assert!(
            &outs[0] == bits,
            "{:?} logits differ from {:?}",
            m.isa(),
            default.isa()
        );
    }
}

/// The device forward's operations (`dspark_runtime::device`), on the host backend, against the
/// f32-dequantized reference forward on real weights and text: the same check a GPU draw runs
/// with the CUDA backend (`scripts/gpu-check.sh`).
#[test]
fn device_forward_on_the_host_backend_matches_the_reference_on_smollm2() {
    use dspark_runtime::device::{CpuOps, DeviceForward, compare_logits, model_logits};
    let t = tokenizer();
    let ids = t.encode(include_str!("data/eval_text.txt")).unwrap();
    let ids = &ids[..64];
    let reference = dense_reference();
    let want = model_logits(&reference, ids).unwrap();
    let fwd = DeviceForward::new(CpuOps::new(), &reference).unwrap();
    let got = fwd.logits(ids).unwrap();
    let diff = compare_logits(&got, &want, reference.cfg.vocab_size);
    eprintln!("smollm2-135m device forward (host backend) vs reference: {diff:?}");
    assert_eq!(diff.positions, 64);
    assert!(diff.top1_agreement >= 0.99, "{diff:?}");
    assert!(diff.max_rel < 1e-3, "{diff:?}");
}

/// The mask's fast paths (plain tokens inside strings, the second-byte filter of large groups
/// outside them) allow exactly the tokens the validator allows, over SmolLM2's vocabulary, at
/// every prefix of a schema document and a JSON object.
#[test]
fn mask_fast_paths_equal_the_validator_on_the_real_vocabulary() {
    use dspark_runtime::json::{Format, JsonVocab};
    use dspark_runtime::json_schema::Schema;
    use std::sync::Arc;
    let tok = tokenizer();
    let jv = JsonVocab::new(tok);
    let schema = Schema::compile(&serde_json::json!({"type": "object",
        "required": ["name", "id", "age", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 6},
            "id": {"type": "string", "format": "uuid"},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}}))
    .unwrap();
    let cases = [
        (
            Format::Schema(Arc::new(schema)),
            "{ \"name\": \"Lu \\\"é\", \"id\": \"123e4567-e89b-12d3-a456-426614174000\", \"age\": 12 , \"tags\": [\"a b\", \"\"]}",
        ),
        (
            Format::Object,
            "{\"a\": [1.5e3, true, null, {\"b\": \"x y\"}] , \"c\": -0}",
        ),
    ];
    let n = tok.vocab_size();
    for (f, doc) in &cases {
        let d = f.start();
        for cut in 0..=doc.len() {
            if !doc.is_char_boundary(cut) {
                continue;
            }
            let mut d2 = d;
            assert!(f.feed(&mut d2, doc[..cut].as_bytes()), "{}", &doc[..cut]);
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            jv.mask_doc_with(f, &d2, &mut a, true);
            jv.mask_doc_with(f, &d2, &mut b, false);
            let diff = (0..n).find(|&t| a[t].is_finite() != b[t].is_finite());
            assert!(diff.is_none(), "at {:?}: token {diff:?}", &doc[..cut]);
        }
    }
}

/// SmolLM2 split over three ranks (3 KV heads; Q4_1 blocks of 32 cut the 192-wide head
/// groups and the 512-wide FFN slices cleanly), linked over loopback TCP: the chat answer is
/// the one-piece model's token for token.
#[test]
fn smollm2_split_three_ways_answers_like_the_whole_model() {
    use dspark_runtime::tp::{self, TpOptions};
    let peers = (1..3)
        .map(|r| {
            let m = Model::load(
                &model_path(),
                &LoadOptions {
                    threads: 1,
                    tp: Some(TpOptions::shard(r, 3)),
                    ..Default::default()
                },
            )
            .unwrap();
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let a = l.local_addr().unwrap().to_string();
            let m = std::sync::Arc::new(m);
            std::thread::spawn(move || tp::serve(m, l));
            a
        })
        .collect();
    let split = Model::load(
        &model_path(),
        &LoadOptions {
            threads: 1,
            tp: Some(TpOptions::leader(peers)),
            ..Default::default()
        },
    )
    .unwrap();
    let t = tokenizer();
    let prompt = ChatTemplate::from_tokenizer(t)
        .unwrap()
        .render(
            &[Message::new("user", "Write a haiku about the sea.")],
            true,
        )
        .unwrap();
    let ids = t.encode(&prompt).unwrap();
    let p = GenerateParams {
        max_tokens: 32,
        ..Default::default()
    };
    let want = generate(model(), t, &ids, &p, &mut |_| {}).unwrap();
    let got = generate(&split, t, &ids, &p, &mut |_| {}).unwrap();
    assert_eq!(
        got.token_ids, want.token_ids,
        "{:?} vs {:?}",
        got.text, want.text
    );
}
