//! The DSpark proposer in the engine: greedy output equals plain greedy decoding (lossless with
//! any drafter weights), features stay in step with the committed tokens, KV stays clean.

use drafter::DsparkProposer;
use drafter::model::{DrafterConfig, DsparkDrafter, target_tensors};
use dspark_runtime::generate::{GenerateParams, generate};
use dspark_runtime::tiny::{TinySpec, tiny_model_path};
use dspark_runtime::{LoadOptions, Model, Tokenizer};
use specdec::engine::CostModel;
use specdec::{Engine, EngineConfig, Event, Request};
use std::sync::Arc;

/// A tiny seeded target and the config of a γ = 4 drafter for it (with its frozen tensors).
fn fixture() -> (
    Arc<Model>,
    Arc<Tokenizer>,
    DrafterConfig,
    candle_core::Tensor,
    candle_core::Tensor,
) {
    let p = tiny_model_path(&TinySpec::llama(31), "dspark-engine").unwrap();
    let m = Arc::new(
        Model::load(
            &p,
            &LoadOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let tok = Arc::new(Tokenizer::load(&p).unwrap());
    let (e, h) = target_tensors(&m).unwrap();
    let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, 1, 16);
    cfg.feature_layers = vec![0, 1];
    cfg.context = 8;
    (m, tok, cfg, e, h)
}

#[test]
fn dspark_greedy_parity_on_a_tiny_target() {
    greedy_parity(None);
}

#[test]
fn dspark_greedy_parity_with_a_draft_vocabulary() {
    // The drafter may propose every third token only (from 1: it holds one of the answers'
    // tokens, so some drafts can be right): whatever it proposes, the output is the target's.
    let (m, ..) = fixture();
    let ids: Vec<u32> = (1..m.cfg.vocab_size as u32).step_by(3).collect();
    greedy_parity(Some(ids));
}

fn greedy_parity(vocab: Option<Vec<u32>>) {
    let (m, tok, cfg, e, h) = fixture();
    let mut dr = DsparkDrafter::new(cfg, e, h, 9).unwrap();
    dr.set_draft_vocab(vocab).unwrap();
    let ecfg = EngineConfig {
        gamma: 4,
        gate: false,
        kv_tokens: 4096,
        ..Default::default()
    };
    let mut eng = Engine::with_cost(
        m.clone(),
        Some(tok.clone()),
        Box::new(DsparkProposer::new(dr, "dspark:test").unwrap()),
        ecfg,
        CostModel::flat(5),
    )
    .unwrap();
    let prompts = [
        "the theater in",
        "there then rather inner",
        "bit tin the",
        "in in in the the",
    ];
    let mut want = Vec::new();
    for (i, t) in prompts.iter().enumerate() {
        let ids = tok.encode(t).unwrap();
        let max = 9 + 4 * i;
        // Odd prompts: a logit bias (tokens in and out of a draft vocabulary of every third
        // token) and min_tokens, which move the drafter off its draft-vocabulary path.
        let mut sampling = kernels::sampling::SamplingParams::greedy();
        let min_tokens = if i % 2 == 1 {
            sampling.set_logit_bias([(1, 3.0), (4, 2.0), (7, -100.0), (9, 1.0)]);
            3
        } else {
            0
        };
        want.push(
            generate(
                &m,
                &tok,
                &ids,
                &GenerateParams {
                    max_tokens: max,
                    sampling: sampling.clone(),
                    min_tokens,
                    ..Default::default()
                },
                &mut |_| {},
            )
            .unwrap()
            .token_ids,
        );
        let mut r = Request::new(i as u64, ids, max);
        r.params = sampling;
        r.min_tokens = min_tokens;
        eng.add(r).unwrap();
    }
    let mut got = vec![Vec::new(); prompts.len()];
    let mut drafted = 0;
    for ev in eng.run_to_completion().unwrap() {
        match ev {
            Event::Tokens { id, tokens, .. } => got[id as usize].extend(tokens),
            Event::Finished { metrics, .. } => drafted += metrics.drafted_tokens,
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
        }
    }
    assert_eq!(got, want);
    assert!(drafted > 0, "the drafter was never asked");
    // Parity means something only where drafts were both taken and refused (rollback ran):
    // this seeded drafter agrees with the target at times (28 of 96 drafts accepted with the
    // whole vocabulary, 4 of 174 with the draft vocabulary, which holds prompt 0's answer
    // token 259 but not 257 or 260).
    let t = eng.totals();
    assert_eq!(t.drafted_tokens, drafted);
    assert!(
        0 < t.accepted_tokens && t.accepted_tokens < t.drafted_tokens,
        "{} of {} drafts accepted",
        t.accepted_tokens,
        t.drafted_tokens
    );
    eng.check_kv().unwrap();
}

#[test]
fn gamma_larger_than_trained_is_refused() {
    let (m, tok, cfg, e, h) = fixture();
    let make = || {
        Box::new(
            DsparkProposer::new(
                DsparkDrafter::new(cfg.clone(), e.clone(), h.clone(), 9).unwrap(),
                "dspark:test",
            )
            .unwrap(),
        )
    };
    let ecfg = |gamma| EngineConfig {
        gamma,
        gate: false,
        kv_tokens: 4096,
        ..Default::default()
    };
    let err = Engine::with_cost(
        m.clone(),
        Some(tok.clone()),
        make(),
        ecfg(6),
        CostModel::flat(7),
    )
    .err()
    .expect("γ 6 > trained 4 refused");
    assert!(err.to_string().contains("at most 4"), "{err}");
    let mut eng = Engine::with_cost(
        m.clone(),
        Some(tok.clone()),
        make(),
        ecfg(4),
        CostModel::flat(5),
    )
    .unwrap();
    let mut r = Request::new(0, tok.encode("the theater").unwrap(), 4);
    r.gamma = Some(5);
    let err = eng.add(r).err().expect("per-request γ 5 > 4 refused");
    assert!(err.to_string().contains("0..=4"), "{err}");
}
