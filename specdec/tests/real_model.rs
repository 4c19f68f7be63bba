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

/// False-alarm rate of each sampled-distribution test (two positions at half of it each).
const ALPHA: f64 = 0.001;

/// Sampling: the second and third output tokens with prompt-lookup speculation on have the same
/// distribution as with it off. Three tokens: the first comes from the prefill, so the cycle
/// after it verifies one draft (K ≤ remaining − 1) at position 2 — accepted, or rejected and
/// replaced by a residual sample — and position 3 is the bonus after an accepted draft. Here
/// the n-gram drafts "3" after "1 2 3 4 1 2 3 4 1 2 " (80 % of requests) and the target takes
/// it about 70 % of the time: of the 600 requests 335 accept and 141 reject a draft at
/// position 2 (both must be ≥ n/10). The arms draw from their own seeds (independent samples:
/// with shared seeds the first token was the same in both, and compared nothing).
///
/// Test: two-sample χ² homogeneity (`specdec::stats::chi_square_two_sample`) of each position's
/// token histogram, cells of expected count < 5 pooled, at α = 0.0005 per position. At n = 600
/// per arm the noncentrality against a total variation δ is ≥ 2nδ² however the difference
/// spreads over the cells, so any δ ≥ 0.17 is detected with power ≥ 0.9 (6–8 degrees of
/// freedom); a difference concentrated on a few cells far below that. A verifier that draws a
/// rejected position from p instead of the residual p − q (`specdec/tests/engine.rs`) puts
/// p(3)(2 − p(3)) on the drafted "3" (TV ≈ 0.16 at position 2, nearly all of it on one cell):
/// power ≈ 0.99, and that bug, built in, fails here with X² 48.6 against a critical 26.3. The
/// TV bound this replaced (√(m/n) + 0.15 ≈ 0.3) passed it.
///
/// The engines cache the prompt's first block once, so that the requests mostly skip prefill
/// (the same configuration in both arms; the prefix cache has its own test below).
#[test]
fn sampled_distribution_matches_with_speculation_on_the_real_model() {
    let (m, t) = real();
    let prompt = t.encode("1 2 3 4 1 2 3 4 1 2").unwrap();
    let n = 600u64;
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 10,
        ..Default::default()
    };
    let mut hists = Vec::new();
    for spec in [false, true] {
        let t0 = std::time::Instant::now();
        let p: Box<dyn Proposer> = if spec {
            Box::new(NgramProposer::default())
        } else {
            Box::new(NoProposer)
        };
        let cfg = EngineConfig {
            gamma: 3,
            gate: false,
            max_running: 128,
            max_batch_tokens: 2048,
            kv_tokens: 64 * 1024,
            prefix_caching: true,
            ..Default::default()
        };
        let mut e =
            Engine::with_cost(m.clone(), Some(t.clone()), p, cfg, CostModel::flat(4)).unwrap();
        e.add(Request::new(u64::MAX, prompt.clone(), 1)).unwrap();
        e.run_to_completion().unwrap();
        let seeds = if spec { 1 << 32 } else { 0 };
        for i in 0..n {
            let mut r = Request::new(i, prompt.clone(), 3);
            r.params = params.clone();
            r.seed = seeds + i;
            e.add(r).unwrap();
        }
        let events = e.run_to_completion().unwrap();
        // Drafts verified at position 2, accepted and rejected (a request has no other block).
        let (accepted, rejected) = specdec::stats::one_draft_verdicts(&events);
        if spec {
            eprintln!("position 2: {accepted} drafts accepted, {rejected} rejected");
            assert!(
                accepted >= n / 10 && rejected >= n / 10,
                "position 2 must see drafts accepted and rejected often: {accepted} and {rejected} of {n}"
            );
        }
        let out = outputs(events);
        assert_eq!(out.len() as u64, n);
        hists.push(specdec::stats::position_histograms_with_end(
            out.values(),
            3,
        ));
        e.check_kv().unwrap();
        eprintln!("speculation {spec}: {:.1} s", t0.elapsed().as_secs_f64());
    }
    for j in [1, 2] {
        let h = specdec::stats::chi_square_two_sample(&hists[0][j], &hists[1][j], ALPHA / 2.0);
        eprintln!("token {}: {h}", j + 1);
        assert!(h.df > 0 && h.passes(), "token {}: {h}", j + 1);
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
