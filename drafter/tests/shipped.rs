//! The shipped DSpark drafter for the default model (drafters/smollm2-135m) in the engine with
//! the hardware-aware scheduler in the loop (two-step lag, confidence-based truncation):
//! greedy output equals plain greedy decoding token for token on real prompts, and sampled
//! output keeps the target's distribution.

use drafter::DsparkProposer;
use drafter::model::{DsparkDrafter, target_tensors};
use dspark_runtime::{LoadOptions, Model, Tokenizer};
use dspark_scheduler::admission::{ConfidencePolicy, Rule, SpsTable};
use kernels::sampling::SamplingParams;
use specdec::engine::CostModel;
use specdec::proposer::NoProposer;
use specdec::{Engine, EngineConfig, Event, Proposer, Request};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

fn real() -> &'static (Arc<Model>, Arc<Tokenizer>) {
    static M: OnceLock<(Arc<Model>, Arc<Tokenizer>)> = OnceLock::new();
    M.get_or_init(|| {
        let home = dspark_runtime::fetch::dspark_home(
            std::env::var_os("DSPARK_HOME")
                .map(std::path::PathBuf::from)
                .as_deref(),
        );
        let path = dspark_runtime::fetch::resolve("smollm2-135m", &home, "python3", &mut |m| {
            eprintln!("{m}")
        })
        .expect("smollm2-135m fetchable");
        let opts = LoadOptions {
            threads: 2,
            ..Default::default()
        };
        (
            Arc::new(Model::load(&path, &opts).unwrap()),
            Arc::new(Tokenizer::load(&path).unwrap()),
        )
    })
}

fn shipped() -> Box<dyn Proposer> {
    let (m, t) = real();
    let dir = drafter::build::default_dspark_for("smollm2-135m").expect("shipped drafter");
    let (e, h) = target_tensors(m).unwrap();
    let dr = DsparkDrafter::load(&dir, &m.cfg, &t.vocab_hash(), e, h).unwrap();
    assert!(dr.is_markov());
    Box::new(
        DsparkProposer::new(dr, "dspark")
            .unwrap()
            .with_target_head(m.clone()),
    )
}

/// The scheduler with a staircase that makes room for about half of the drafted tokens of a
/// full batch (64 requests: verification is free up to 96 batch tokens, ten times dearer after),
/// so the lagged top-K selection truncates blocks by confidence; drafting cost left out.
fn policy(gamma: u8) -> Box<dyn specdec::VerifyPolicy> {
    let sps = SpsTable::new(vec![(96, 100.0), (4096, 10.0)]).unwrap();
    let mut p = ConfidencePolicy::new(sps, Rule::Argmax, 2, 4096, gamma);
    p.count_draft_cost = false;
    Box::new(p)
}

fn engine(p: Box<dyn Proposer>, gamma: usize, sched: bool) -> Engine {
    let (m, t) = real();
    let cfg = EngineConfig {
        gamma,
        gate: false,
        max_running: 64,
        max_batch_tokens: 4096,
        kv_tokens: 96 * 1024,
        ..Default::default()
    };
    let mut e = Engine::with_cost(
        m.clone(),
        Some(t.clone()),
        p,
        cfg,
        CostModel::flat(gamma + 1),
    )
    .unwrap();
    if sched {
        e.set_policy(Some(policy(gamma as u8)));
    }
    e
}

fn outputs(events: Vec<Event>) -> HashMap<u64, Vec<u32>> {
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    for e in events {
        if let Event::Tokens { id, tokens, .. } = e {
            out.entry(id).or_default().extend(tokens);
        }
    }
    out
}

const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "What is 17 times 23? Show your steps.",
    "Give me three tips for sleeping better.",
    "Write a Rust function that sums the even numbers in a slice of i32.",
    "Solve for x: 3x + 7 = 22.",
    "Explain why the sky is blue in two sentences.",
    "Write a bash script that counts the lines in every .txt file in a directory.",
];

#[test]
fn shipped_drafter_with_the_scheduler_keeps_greedy_parity() {
    let (_, t) = real();
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(t).unwrap();
    let ids: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| {
            t.encode(
                &tmpl
                    .render(&[dspark_runtime::chat::Message::new("user", p)], true)
                    .unwrap(),
            )
            .unwrap()
        })
        .collect();
    let run = |p: Box<dyn Proposer>, sched: bool| {
        let mut e = engine(p, 7, sched);
        for (i, x) in ids.iter().enumerate() {
            // max_tokens landing mid-block.
            e.add(Request::new(i as u64, x.clone(), 29 + 3 * i))
                .unwrap();
        }
        let out = outputs(e.run_to_completion().unwrap());
        e.check_kv().unwrap();
        (out, e.totals().clone())
    };
    let (plain, _) = run(Box::new(NoProposer), false);
    for sched in [false, true] {
        let (got, tot) = run(shipped(), sched);
        assert_eq!(got, plain, "scheduler {sched}");
        assert!(
            tot.accepted_tokens > 0,
            "scheduler {sched}: drafts were verified and accepted"
        );
    }
}

#[test]
fn shipped_drafter_with_the_scheduler_keeps_the_sampled_distribution() {
    let (_, t) = real();
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(t).unwrap();
    let prompt = t
        .encode(
            &tmpl
                .render(
                    &[dspark_runtime::chat::Message::new(
                        "user",
                        "Write a Python function that adds two numbers.",
                    )],
                    true,
                )
                .unwrap(),
        )
        .unwrap();
    let n = 600u64;
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 8,
        ..Default::default()
    };
    let mut hists = Vec::new();
    let mut accepted = 0;
    for spec in [false, true] {
        let p: Box<dyn Proposer> = if spec {
            shipped()
        } else {
            Box::new(NoProposer)
        };
        let mut e = engine(p, 4, spec);
        for seed in 0..n {
            // The second token comes from a verification cycle (K ≤ remaining − 1).
            let mut r = Request::new(seed, prompt.clone(), 4);
            r.params = params.clone();
            r.seed = 7_919 * seed + 3;
            e.add(r).unwrap();
        }
        let out = outputs(e.run_to_completion().unwrap());
        accepted += e.totals().accepted_tokens;
        let h = specdec::stats::position_histograms(out.values(), 2);
        hists.push(h);
        e.check_kv().unwrap();
    }
    assert!(
        accepted > 0,
        "drafts were accepted: acceptance was exercised"
    );
    for j in 0..2 {
        let (tv, bound) = specdec::stats::tv_with_bound(&hists[0][j], &hists[1][j]);
        assert!(tv < bound, "token {}: TV {tv} ≥ {bound}", j + 1);
    }
}
