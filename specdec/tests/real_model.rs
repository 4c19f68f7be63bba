//! Engine tests on the default real model (SmolLM2-135M, fetched on first use).

use dspark_runtime::generate::{GenerateParams, generate};
use dspark_runtime::{LoadOptions, Model, Tokenizer};
use kernels::sampling::SamplingParams;
use specdec::engine::CostModel;
use specdec::proposer::{NgramProposer, NoProposer};
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
        (
            Arc::new(
                Model::load(
                    &path,
                    &LoadOptions {
                        threads: 2,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
            Arc::new(Tokenizer::load(&path).unwrap()),
        )
    })
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

fn engine(p: Box<dyn Proposer>, gamma: usize, max_running: usize) -> Engine {
    let (m, t) = real();
    let cfg = EngineConfig {
        gamma,
        gate: false,
        max_running,
        max_batch_tokens: 2048,
        kv_tokens: 64 * 1024,
        ..Default::default()
    };
    Engine::with_cost(
        m.clone(),
        Some(t.clone()),
        p,
        cfg,
        CostModel::flat(gamma + 1),
    )
    .unwrap()
}

/// Greedy parity on 50 prompts from the shipped prompt sets (chat, code, math), with max_tokens
/// landing mid-block, under continuous batching.
#[test]
fn greedy_parity_on_50_real_prompts_with_ngram() {
    let (m, t) = real();
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(t).unwrap();
    let sets = [
        include_str!("../../prompts/chat.txt"),
        include_str!("../../prompts/code.txt"),
        include_str!("../../prompts/math.txt"),
    ];
    let prompts: Vec<&str> = sets
        .iter()
        .flat_map(|s| s.lines().filter(|l| !l.trim().is_empty()))
        .step_by(2)
        .take(50)
        .collect();
    assert_eq!(prompts.len(), 48.max(prompts.len()).min(50));
    let mut e = engine(Box::new(NgramProposer::default()), 4, 16);
    let mut want = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = t
            .encode(
                &tmpl
                    .render(&[dspark_runtime::chat::Message::new("user", p)], true)
                    .unwrap(),
            )
            .unwrap();
        let max = 17 + (i * 5) % 19;
        want.push(
            generate(
                m,
                t,
                &ids,
                &GenerateParams {
                    max_tokens: max,
                    ..Default::default()
                },
                &mut |_| {},
            )
            .unwrap()
            .token_ids,
        );
        e.add(Request::new(i as u64, ids, max)).unwrap();
    }
    let got = outputs(e.run_to_completion().unwrap());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(
            got.get(&(i as u64)).cloned().unwrap_or_default(),
            *w,
            "prompt {i}: {}",
            prompts[i]
        );
    }
    assert!(
        e.totals().accepted_tokens > 0,
        "ngram never accepted: the test would not exercise speculation"
    );
    e.check_kv().unwrap();
}

/// Sampling: the first and second output tokens with prompt-lookup speculation on have the same
/// distribution as with it off. Bound (99.9 %, two independent n-sample histograms over m cells):
/// TV < √(m/n) + 2·√(ln 1000 / 2n).
#[test]
fn sampled_distribution_matches_with_speculation_on_the_real_model() {
    let (_, t) = real();
    let prompt = t.encode("1 2 3 4 1 2 3 4 1 2").unwrap();
    let n = 600u64;
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 10,
        ..Default::default()
    };
    let mut hists = Vec::new();
    let mut accepted = 0;
    for spec in [false, true] {
        let p: Box<dyn Proposer> = if spec {
            Box::new(NgramProposer::default())
        } else {
            Box::new(NoProposer)
        };
        let mut e = engine(p, 3, 128);
        for seed in 0..n {
            // max_tokens 4: the cycle after the first token may draft (K ≤ remaining − 1).
            let mut r = Request::new(seed, prompt.clone(), 4);
            r.params = params.clone();
            r.seed = 1_000_003 * seed + 17;
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
        "no draft was accepted: the test would not exercise acceptance"
    );
    for j in 0..2 {
        let (tv, bound) = specdec::stats::tv_with_bound(&hists[0][j], &hists[1][j]);
        assert!(tv < bound, "token {}: TV {tv} ≥ {bound}", j + 1);
    }
}

/// Prefix caching on the real model: chat requests sharing a system prompt, and the next
/// turn of one of them, take most of their prompt from the cache and still answer exactly as
/// plain greedy decoding does (f16 KV written by other batches and chunk shapes).
#[test]
fn prefix_cache_keeps_greedy_parity_on_real_chats() {
    let (m, t) = real();
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(t).unwrap();
    let system = "You are a careful assistant for a team of engineers. Answer in plain \
        English, keep answers short, show the steps of any arithmetic, name the units of every \
        quantity, and when you are not sure of something, say so instead of guessing. Prefer \
        concrete examples to general advice and never invent references.";
    let questions = [
        "What is the capital of France?",
        "How many minutes are there in a day?",
        "Write a Python function that reverses a string.",
        "What is 17 times 23?",
        "Name three primary colours.",
    ];
    let render = |msgs: &[(&str, &str)]| {
        let m: Vec<_> = msgs
            .iter()
            .map(|(r, c)| dspark_runtime::chat::Message::new(r, c))
            .collect();
        t.encode(&tmpl.render(&m, true).unwrap()).unwrap()
    };
    let plain = |p: &[u32], n: usize| {
        generate(
            m,
            t,
            p,
            &GenerateParams {
                max_tokens: n,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap()
        .token_ids
    };
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| render(&[("system", system), ("user", q)]))
        .collect();
    let cached_of = |events: &[Event]| -> HashMap<u64, usize> {
        events
            .iter()
            .filter_map(|ev| match ev {
                Event::Finished { id, metrics, .. } => Some((*id, metrics.cached_tokens)),
                _ => None,
            })
            .collect()
    };
    let mut e = {
        Engine::with_cost(
            m.clone(),
            Some(t.clone()),
            Box::new(NgramProposer::default()),
            EngineConfig {
                gamma: 3,
                gate: false,
                max_running: 8,
                max_batch_tokens: 2048,
                kv_tokens: 64 * 1024,
                prefix_caching: true,
                ..Default::default()
            },
            CostModel::flat(4),
        )
        .unwrap()
    };
    e.add(Request::new(0, prompts[0].clone(), 24)).unwrap();
    let ev = e.run_to_completion().unwrap();
    assert_eq!(cached_of(&ev)[&0], 0);
    let first = outputs(ev)[&0].clone();
    assert_eq!(first, plain(&prompts[0], 24));
    for (i, p) in prompts.iter().enumerate().skip(1) {
        e.add(Request::new(i as u64, p.clone(), 24)).unwrap();
    }
    let ev = e.run_to_completion().unwrap();
    let cached = cached_of(&ev);
    let got = outputs(ev);
    for (i, p) in prompts.iter().enumerate().skip(1) {
        assert!(
            cached[&(i as u64)] >= 48,
            "prompt {i}: {cached:?} of {}",
            p.len()
        );
        assert_eq!(got[&(i as u64)], plain(p, 24), "prompt {i}");
    }
    // The next turn of the first chat.
    let answer = t.decode(&first, true).unwrap();
    let turn = render(&[
        ("system", system),
        ("user", questions[0]),
        ("assistant", answer.trim()),
        ("user", "And of Germany?"),
    ]);
    e.add(Request::new(9, turn.clone(), 24)).unwrap();
    let ev = e.run_to_completion().unwrap();
    let cached = cached_of(&ev);
    assert!(cached[&9] >= prompts[0].len() - 16, "{cached:?}");
    assert_eq!(outputs(ev)[&9], plain(&turn, 24));
    e.check_kv().unwrap();
}
