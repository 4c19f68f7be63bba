//! Engine tests on tiny seeded models: greedy parity with plain decoding for every proposer
//! (including EOS, stop strings and max_tokens landing mid-block, alone and under continuous
//! batching), the sampled distribution with speculation on vs off, KV hygiene and bad input.

use dspark_runtime::generate::{GenerateOutput, GenerateParams, generate};
use dspark_runtime::json::Format;
use dspark_runtime::tiny::{TinySpec, tiny_model_path};
use dspark_runtime::{KvDtype, LoadOptions, Model, Tokenizer};
use kernels::sampling::SamplingParams;
use specdec::engine::CostModel;
use specdec::proposer::{DraftModelProposer, NgramProposer, NoProposer};
use specdec::{Engine, EngineConfig, Event, FinishReason, Proposer, Request};
use std::collections::HashMap;
use std::sync::Arc;

struct Fixture {
    target: Arc<Model>,
    draft: Arc<Model>,
    tok: Arc<Tokenizer>,
    draft_tok: Tokenizer,
}

fn fixture() -> Fixture {
    fixture_scaled(1.0)
}

/// Target and draft share the tokenizer. With `embed_scale` 1 the draft is a different
/// (other-seed) model and the next-token distributions are peaked (greedy tests); near 0.15
/// they are spread.
fn fixture_scaled(embed_scale: f32) -> Fixture {
    let (t, d) = if embed_scale == 1.0 {
        ("engine-target".to_string(), "engine-draft".to_string())
    } else {
        (
            format!("engine-target-{embed_scale}"),
            format!("engine-draft-{embed_scale}"),
        )
    };
    let tp = tiny_model_path(
        &TinySpec {
            embed_scale,
            ..TinySpec::llama(11)
        },
        &t,
    )
    .unwrap();
    // Spread: the draft is the target's first layer (same seed, same embedding and head), so
    // it agrees with the target often but not always, and rejections and the residual draw
    // shape what comes out.
    let ds = if embed_scale == 1.0 {
        TinySpec {
            n_layers: 1,
            ..TinySpec::llama(12)
        }
    } else {
        TinySpec {
            n_layers: 1,
            embed_scale,
            ..TinySpec::llama(11)
        }
    };
    let dp = tiny_model_path(&ds, &d).unwrap();
    let opts = LoadOptions {
        threads: 1,
        ..Default::default()
    };
    Fixture {
        target: Arc::new(Model::load(&tp, &opts).unwrap()),
        draft: Arc::new(Model::load(&dp, &opts).unwrap()),
        tok: Arc::new(Tokenizer::load(&tp).unwrap()),
        draft_tok: Tokenizer::load(&dp).unwrap(),
    }
}

/// Greedy answers that vary: a separate (untied) output head, so the argmax does not echo
/// the last token (the tied fixtures' greedy answers repeat one token, at `embed_scale` 1 a
/// whitespace one). The draft model is the target's first layer (same seed: same embedding,
/// head and first layer), so its drafts are right at some positions and wrong at others, and
/// so are the n-gram drafter's on these answers: accepts and rejections both run.
fn fixture_varied() -> Fixture {
    let tp = tiny_model_path(
        &TinySpec {
            separate_head: true,
            ..TinySpec::llama(11)
        },
        "engine-target-varied",
    )
    .unwrap();
    let dp = tiny_model_path(
        &TinySpec {
            n_layers: 1,
            separate_head: true,
            ..TinySpec::llama(11)
        },
        "engine-draft-varied",
    )
    .unwrap();
    let opts = LoadOptions {
        threads: 1,
        ..Default::default()
    };
    Fixture {
        target: Arc::new(Model::load(&tp, &opts).unwrap()),
        draft: Arc::new(Model::load(&dp, &opts).unwrap()),
        tok: Arc::new(Tokenizer::load(&tp).unwrap()),
        draft_tok: Tokenizer::load(&dp).unwrap(),
    }
}

fn proposers(f: &Fixture) -> Vec<(&'static str, Box<dyn Proposer>)> {
    vec![
        ("none", Box::new(NoProposer)),
        ("ngram", Box::new(NgramProposer::default())),
        ("draft-model", Box::new(draft_model(f, 4096))),
    ]
}

/// The fixture's draft model as a proposer, its KV cache `kv` tokens.
fn draft_model(f: &Fixture, kv: usize) -> DraftModelProposer {
    DraftModelProposer::new(
        f.draft.clone(),
        &f.draft_tok,
        &f.tok,
        f.target.cfg.vocab_size,
        kv,
        "draft-model:tiny",
    )
    .unwrap()
}

/// Plain greedy decoding of `p` for `max_tokens` tokens: what every engine run must equal.
fn plain_greedy(f: &Fixture, p: &[u32], max_tokens: usize) -> Vec<u32> {
    plain(
        f,
        p,
        GenerateParams {
            max_tokens,
            ..Default::default()
        },
    )
    .token_ids
}

/// Plain decoding of `p` with `params` (no engine).
fn plain(f: &Fixture, p: &[u32], params: GenerateParams) -> GenerateOutput {
    generate(&f.target, &f.tok, p, &params, &mut |_| {}).unwrap()
}

fn prompts(f: &Fixture, n: usize) -> Vec<Vec<u32>> {
    let words = [
        "the", "theater", "in", "there", "inner", "rather", "then", "bit", "tin",
    ];
    (0..n)
        .map(|i| {
            let mut s = String::new();
            for j in 0..(3 + i % 7) {
                s.push_str(words[(i * 7 + j * 3) % words.len()]);
                s.push(' ');
            }
            f.tok.encode(&s).unwrap()
        })
        .collect()
}

/// `n` prompts that start with the same system prompt of `words` words; and that prompt.
fn shared_system_prompts(f: &Fixture, n: usize, words: usize) -> (String, Vec<Vec<u32>>) {
    let system: String = (0..words)
        .map(|i| ["the ", "theater ", "inner ", "rather "][i % 4])
        .collect();
    let ps = prompts(f, n)
        .iter()
        .map(|p| {
            let mut s = f.tok.encode(&system).unwrap();
            s.extend_from_slice(p);
            s
        })
        .collect();
    (system, ps)
}

fn collect(events: Vec<Event>) -> HashMap<u64, (Vec<u32>, String, FinishReason)> {
    let mut out: HashMap<u64, (Vec<u32>, String, FinishReason)> = HashMap::new();
    for e in events {
        match e {
            Event::Tokens {
                id, tokens, text, ..
            } => {
                let ent =
                    out.entry(id)
                        .or_insert((Vec::new(), String::new(), FinishReason::Cancelled));
                ent.0.extend(tokens);
                ent.1.push_str(&text);
            }
            Event::Finished { id, reason, .. } => {
                out.entry(id)
                    .or_insert((Vec::new(), String::new(), FinishReason::Cancelled))
                    .2 = reason;
            }
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
        }
    }
    out
}

/// One forward of the target over `tokens` with logits at every position.
fn logits_all(m: &Model, tokens: &[u32]) -> dspark_runtime::model::ForwardOutput {
    use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
    let mut c = m.new_cache(1024, 16).unwrap();
    let seq = c.new_seq();
    m.forward(
        &mut c,
        &[SeqInput {
            seq,
            tokens,
            logits: LogitsMode::All,
        }],
        &ForwardOptions::default(),
    )
    .unwrap()
}

fn cfg(gamma: usize) -> EngineConfig {
    EngineConfig {
        gamma,
        kv_tokens: 8192,
        max_batch_tokens: 256,
        gate: false,
        ..Default::default()
    }
}

/// Runs `ps` (each to `max_tokens`) batched through an engine of `proposer` and `config`, and
/// checks that each answer is `want`'s and that the KV cache is whole after.
fn assert_batched_parity(
    f: &Fixture,
    proposer: Box<dyn Proposer>,
    config: EngineConfig,
    ps: &[Vec<u32>],
    max_tokens: usize,
    want: &[Vec<u32>],
) {
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        proposer,
        config,
        CostModel::flat(4),
    )
    .unwrap();
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), max_tokens))
            .unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[&(i as u64)].0, w, "prompt {i}");
    }
    e.check_kv().unwrap();
}

/// Plain greedy decoding of every prompt (prompt `i` for `max_tokens(i)` tokens), then each
/// (proposer, γ) of `runs` with everything queued at once (continuous batching, admitted as
/// room allows), and, if `alone`, once more with one request at a time (each run to the end
/// before the next is added): token for token the same outputs, and every cache block back.
/// Returns the plain answers and [`first_drafts`] of each proposer run.
fn assert_greedy_parity<'a>(
    f: &Fixture,
    ps: &[Vec<u32>],
    max_tokens: impl Fn(usize) -> usize,
    runs: &[(&'a str, usize)],
    alone: bool,
) -> (Vec<Vec<u32>>, HashMap<&'a str, (usize, usize)>) {
    let want: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| plain_greedy(f, p, max_tokens(i)))
        .collect();
    let reqs: Vec<Request> = (0..ps.len())
        .map(|i| Request::new(i as u64, ps[i].clone(), max_tokens(i)))
        .collect();
    let answers: Vec<&[u32]> = want.iter().map(|w| &w[..]).collect();
    let mut all_firsts = HashMap::new();
    for &(name, gamma) in runs {
        let firsts = *all_firsts
            .entry(name)
            .or_insert_with(|| first_drafts(f, name, &reqs, &answers));
        for one_at_a_time in [false, true] {
            if one_at_a_time && !alone {
                continue;
            }
            let how = if one_at_a_time { "alone" } else { "batched" };
            let mut e = Engine::with_cost(
                f.target.clone(),
                Some(f.tok.clone()),
                proposer_clone(f, name),
                cfg(gamma),
                CostModel::flat(gamma + 1),
            )
            .unwrap();
            let mut got = HashMap::new();
            for (i, p) in ps.iter().enumerate() {
                e.add(Request::new(i as u64, p.clone(), max_tokens(i)))
                    .unwrap();
                if one_at_a_time {
                    got.extend(collect(e.run_to_completion().unwrap()));
                }
            }
            got.extend(collect(e.run_to_completion().unwrap()));
            for (i, w) in want.iter().enumerate() {
                assert_eq!(&got[&(i as u64)].0, w, "{name} γ={gamma} {how} prompt {i}");
            }
            assert_speculated(e.totals(), name, gamma, firsts);
            e.check_kv().unwrap();
            assert_eq!(e.kv_free_blocks(), 8192 / 16);
        }
    }
    (want, all_firsts)
}

/// Where `name`'s drafts could be right on these answers and where wrong: at every answer
/// position a block can start at (after the first, which the prefill gives, and before the
/// last of `max_tokens`), what a fresh proposer drafts first from the prompt and the answer
/// before it (`(right, wrong)`, positions counted). The first draft of every block the engine
/// verifies is one of these, so where none is right no draft can be accepted, and where none
/// is wrong no block's first draft is rejected.
fn first_drafts(f: &Fixture, name: &str, reqs: &[Request], want: &[&[u32]]) -> (usize, usize) {
    let mut p = proposer_clone(f, name);
    let (mut right, mut wrong) = (0, 0);
    let mut id = 1u64 << 32;
    for (r, w) in reqs.iter().zip(want) {
        // No block is drafted where one token is left (the verifying forward gives it).
        for j in 1..w.len().min(r.max_tokens.saturating_sub(1)) {
            let mut context = r.prompt.clone();
            context.extend_from_slice(&w[..j]);
            let mut rng = kernels::rng::Rng::new(r.seed);
            let block = p
                .propose(&mut [specdec::proposer::ProposeReq {
                    id,
                    context: &context,
                    k: 1,
                    params: &r.params,
                    rng: &mut rng,
                }])
                .unwrap();
            p.finish(id);
            id += 1;
            match block[0].tokens.first() {
                Some(&t) if t == w[j] => right += 1,
                Some(_) => wrong += 1,
                None => {}
            }
        }
    }
    (right, wrong)
}

/// Parity says something only where the run speculated: every proposer but "none" drafted,
/// some drafts were accepted and some rejected (rollback ran). The last two where
/// [`first_drafts`] (`firsts`) shows they can hold. Where no first draft is right nothing can
/// be accepted (the n-gram drafter under penalties against the repeats it copies, a choice
/// whose forced answer neither drafter knows, a draft model unrelated to the target as in the
/// 8-bit cache test): checked to be so. Where none is wrong rejections are not required (the
/// default fixture's target and draft model both answer every prompt with spaces only).
fn assert_speculated(
    t: &specdec::RequestMetrics,
    name: &str,
    gamma: usize,
    (right, wrong): (usize, usize),
) {
    let (drafted, accepted) = (t.drafted_tokens, t.accepted_tokens);
    let what = format!(
        "{name} γ={gamma}: {accepted} of {drafted} drafts accepted; first drafts right at \
         {right} positions, wrong at {wrong}"
    );
    if name == "none" {
        assert_eq!(drafted, 0, "{what}");
        return;
    }
    assert!(drafted > 0, "nothing drafted: {what}");
    if right > 0 {
        assert!(accepted > 0, "no draft accepted: {what}");
    } else {
        assert_eq!(accepted, 0, "{what}");
    }
    if wrong > 0 {
        assert!(accepted < drafted, "no draft rejected: {what}");
    }
}

/// On answers that vary (the varied fixture), so both drafters are right at some positions
/// and wrong at others: every run must accept drafts and reject some (`assert_speculated`),
/// which an engine that, say, verified against the wrong logits row or rolled back one token
/// too few would turn into a token mismatch. Batched (50 requests queued at once) and alone.
#[test]
fn greedy_output_equals_plain_greedy_for_every_proposer_alone_and_batched() {
    let f = fixture_varied();
    let ps = prompts(&f, 50);
    let mut runs = vec![("none", 1)];
    for name in ["ngram", "draft-model"] {
        runs.extend([1, 3, 4].map(|gamma| (name, gamma)));
    }
    // max_tokens values that land mid-block for every gamma.
    let (want, firsts) = assert_greedy_parity(&f, &ps, |i| 5 + (i * 7) % 23, &runs, true);
    // The answers vary: none is whitespace only, each has at least two distinct tokens, and
    // most have five or more (was: one whitespace token repeated, in every answer).
    let blank = whitespace_tokens(&f);
    let distinct = |w: &Vec<u32>| w.iter().collect::<std::collections::HashSet<_>>().len();
    for (i, w) in want.iter().enumerate() {
        assert!(
            distinct(w) >= 2 && !w.iter().all(|t| blank.contains(t)),
            "prompt {i}: answer {w:?}"
        );
    }
    let varied = want.iter().filter(|w| distinct(w) >= 5).count();
    assert!(
        varied >= want.len() / 2,
        "{varied} answers of 5+ distinct tokens"
    );
    // Both drafters are right at some first-draft positions and wrong at others, so the
    // accept-and-reject checks of every run above held (not skipped).
    for name in ["ngram", "draft-model"] {
        let (right, wrong) = firsts[name];
        assert!(
            right > 0 && wrong > 0,
            "{name}: first drafts right {right}, wrong {wrong}"
        );
    }
}

/// 8-bit values in the cache (`int8v`), and 8-bit keys as well (`int8`, each key row rotated
/// before it is quantized): each row's codes depend on that row alone, so rolling back
/// rejected drafts leaves every kept position as plain decoding writes it, and greedy parity
/// holds. Head dim 64, so attention takes the SIMD kernels' 8-bit paths.
#[test]
fn greedy_parity_holds_with_8_bit_values_in_the_cache() {
    for dtype in [KvDtype::Int8V, KvDtype::Int8] {
        let tp = tiny_model_path(&TinySpec::qwen2(21), "int8v-target").unwrap();
        let mut ds = TinySpec::qwen2(22);
        ds.n_layers = 1;
        let dp = tiny_model_path(&ds, "int8v-draft").unwrap();
        let opts = LoadOptions {
            threads: 1,
            kv_dtype: Some(dtype),
            ..Default::default()
        };
        let f = Fixture {
            target: Arc::new(Model::load(&tp, &opts).unwrap()),
            draft: Arc::new(Model::load(&dp, &opts).unwrap()),
            tok: Arc::new(Tokenizer::load(&tp).unwrap()),
            draft_tok: Tokenizer::load(&dp).unwrap(),
        };
        assert_eq!(f.target.kv_dtype(), dtype);
        assert_eq!(f.target.cfg.head_dim, 64);
        let ps = prompts(&f, 24);
        let runs = [
            ("ngram", 1),
            ("ngram", 4),
            ("draft-model", 1),
            ("draft-model", 4),
        ];
        assert_greedy_parity(&f, &ps, |i| 12 + (i * 7) % 23, &runs, false);
    }
}

fn proposer_clone(f: &Fixture, name: &str) -> Box<dyn Proposer> {
    proposers(f)
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, p)| p)
        .unwrap()
}

/// The n-gram drafter, failing every other drafting call (as a draft model past its cache),
/// and every other commit of request 5's context (as a drafter that cannot roll it back).
/// An engine over the fixture's target with `proposer`, γ = 4 and a flat cost model.
fn engine_with(f: &Fixture, proposer: Box<dyn Proposer>) -> Engine {
    Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        proposer,
        cfg(4),
        CostModel::flat(5),
    )
    .unwrap()
}

struct Flaky(NgramProposer, usize, usize);
impl Proposer for Flaky {
    fn commit(&mut self, id: u64, _context: &[u32]) -> specdec::Result<()> {
        if id != 5 {
            return Ok(());
        }
        self.2 += 1;
        if self.2 % 2 == 0 {
            return Err(specdec::SpecError::Invariant("cannot roll back".into()));
        }
        Ok(())
    }
    fn name(&self) -> &str {
        "flaky"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
        self.1 += 1;
        if self.1 % 2 == 0 {
            return Err(specdec::SpecError::Invalid("draft cache full".into()));
        }
        self.0.propose(reqs)
    }
}

/// A drafter that fails costs no request its answer: those steps verify without drafts, a
/// request whose drafting state it cannot keep decodes on (before, the whole step failed,
/// and every request in it), and greedy output stays plain decoding's.
#[test]
fn a_failing_drafter_leaves_every_request_served() {
    let f = fixture();
    let ps = prompts(&f, 12);
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(Flaky(NgramProposer::default(), 0, 0)),
        cfg(3),
        CostModel::flat(4),
    )
    .unwrap();
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), 30)).unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(got[&(i as u64)].0, plain_greedy(&f, p, 30), "prompt {i}");
    }
    assert!(
        e.draft_failures > 0,
        "the drafter never failed: the test checks nothing"
    );
    e.check_kv().unwrap();
}

/// The n-gram drafter, whose block for request 3 lacks a distribution and whose block for
/// request 4 holds a token outside the vocabulary (a proposer's bugs).
struct Broken(NgramProposer, usize);
impl Proposer for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
        let mut blocks = self.0.propose(reqs)?;
        for (r, b) in reqs.iter().zip(blocks.iter_mut()) {
            if r.k == 0 {
                continue;
            }
            if r.id == 3 {
                b.tokens = vec![1; r.k];
                b.dists = vec![specdec::proposer::Dist::OneHot; r.k - 1];
            } else if r.id == 4 {
                b.tokens = vec![self.1 as u32; r.k];
                b.dists = vec![specdec::proposer::Dist::OneHot; r.k];
            }
        }
        Ok(blocks)
    }
}

/// A block that cannot be verified costs its own request its drafts, not the step: every
/// request is served, greedy output stays plain decoding's, no block leaks.
#[test]
fn an_unusable_draft_block_costs_only_its_request_its_drafts() {
    let f = fixture();
    let ps = prompts(&f, 6);
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(Broken(NgramProposer::default(), f.target.cfg.vocab_size)),
        cfg(3),
        CostModel::flat(4),
    )
    .unwrap();
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), 24)).unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(got[&(i as u64)].0, plain_greedy(&f, p, 24), "prompt {i}");
    }
    assert!(
        e.draft_failures > 0,
        "no block was unusable: the test checks nothing"
    );
    e.check_kv().unwrap();
}

/// With a batch budget of two full windows, three decoders asking for long windows and a
/// prompt waiting: every decoder commits a token at every step and the prompt is prefilled
/// meanwhile (planned in order, the first two windows took the whole budget, step after step).
#[test]
fn every_request_moves_whatever_the_others_windows() {
    let f = fixture();
    let ps = prompts(&f, 4);
    let mut c = cfg(4);
    c.max_batch_tokens = 10;
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(draft_model(&f, 4096)),
        c,
        CostModel::flat(5),
    )
    .unwrap();
    let long = |i: usize| {
        let mut r = Request::new(i as u64, ps[i].clone(), 200);
        r.ignore_eos = true;
        r
    };
    for i in 0..3 {
        e.add(long(i)).unwrap();
    }
    // Until all three decode.
    let mut started = std::collections::HashSet::new();
    for _ in 0..100 {
        for ev in e.step().unwrap() {
            if let Event::Tokens { id, .. } = ev {
                started.insert(id);
            }
        }
        if started.len() == 3 {
            break;
        }
    }
    assert_eq!(started.len(), 3, "the three requests started");
    e.add(long(3)).unwrap();
    let mut steps_without: HashMap<u64, usize> = HashMap::new();
    let mut prompt_started = false;
    let mut finished = std::collections::HashSet::new();
    for _ in 0..40 {
        let evs = e.step().unwrap();
        let moved: std::collections::HashSet<u64> = evs
            .iter()
            .filter_map(|ev| match ev {
                Event::Tokens { id, tokens, .. } if !tokens.is_empty() => Some(*id),
                _ => None,
            })
            .collect();
        for ev in &evs {
            if let Event::Finished { id, .. } = ev {
                finished.insert(*id);
            }
        }
        for id in 0..3u64 {
            if !moved.contains(&id) && !finished.contains(&id) {
                *steps_without.entry(id).or_default() += 1;
            }
        }
        prompt_started |= moved.contains(&3);
    }
    assert!(
        steps_without.is_empty(),
        "steps without a token: {steps_without:?}"
    );
    assert!(prompt_started, "the waiting prompt was never prefilled");
    e.check_kv().unwrap();
}

/// How many of `tokens` a stop string `stop` lets out, and the text before it: tokens are
/// streamed (as the engine and plain decoding stream them), and once `min_tokens` are out the
/// first token whose text completes `stop` (an occurrence that ends in that token's text) is
/// the last one out. `None`: none does.
fn stop_cut(f: &Fixture, tokens: &[u32], stop: &str, min_tokens: usize) -> Option<(usize, String)> {
    let mut d = dspark_runtime::tokenizer::StreamDecoder::new();
    let mut text = String::new();
    for (k, &t) in tokens.iter().enumerate() {
        let Some(delta) = d.push(&f.tok, t).unwrap() else {
            continue;
        };
        let before = text.len();
        text.push_str(&delta);
        if k + 1 < min_tokens || text.len() < stop.len() {
            continue;
        }
        let from = (before + 1).saturating_sub(stop.len());
        if let Some(at) = (from..=text.len() - stop.len())
            .find(|&i| text.is_char_boundary(i) && text[i..].starts_with(stop))
        {
            return Some((k + 1, text[..at].to_string()));
        }
    }
    None
}

/// A stop string of three characters from the middle of `text` (from the fifth character
/// on, none U+FFFD) that first occurs there, not at its start: the cut leaves some text.
fn stop_from_middle(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    (4..chars.len().saturating_sub(3))
        .map(|i| chars[i..i + 3].iter().collect::<String>())
        .find(|w| !w.contains('\u{fffd}') && text.find(w.as_str()).is_some_and(|at| at > 0))
}

/// On the varied fixture's answers: two in three requests get a stop string that completes
/// mid-answer after some text, the others an end-of-sequence bias just strong enough that
/// plain greedy decoding ends by EOS after a few tokens. Every request's tokens, text and
/// finish reason are plain decoding's, cut where plain decoding's stream first contains the
/// stop string (the token that completes it the last one out).
#[test]
fn stop_strings_and_eos_cut_blocks_exactly_like_plain_decoding() {
    let f = fixture_varied();
    let ps = prompts(&f, 20);
    let eos = f.tok.stop_ids[0];
    let greedy_run = |p: &[u32], sampling: SamplingParams| {
        plain(
            &f,
            p,
            GenerateParams {
                max_tokens: 40,
                sampling,
                ..Default::default()
            },
        )
    };
    // Per request: its sampling params, stop strings and (tokens, text, reason) expected.
    let mut setups = Vec::new();
    let (mut cut_by_stop, mut cut_by_eos) = (0, 0);
    for (i, p) in ps.iter().enumerate() {
        if i % 3 == 2 {
            // The least EOS bias (whole logits) that ends the answer by EOS after 3+ tokens.
            let found = (1..=60).find_map(|b| {
                let mut sp = SamplingParams::greedy();
                sp.set_logit_bias([(eos, b as f32)]);
                let o = greedy_run(p, sp.clone());
                (o.finish_reason == "stop" && o.token_ids.len() >= 3).then_some((sp, o))
            });
            if let Some((sp, o)) = found {
                cut_by_eos += 1;
                setups.push((sp, Vec::new(), (o.token_ids, o.text, FinishReason::Stop)));
                continue;
            }
        }
        let full = greedy_run(p, SamplingParams::greedy());
        assert_eq!(full.finish_reason, "length", "prompt {i}");
        let Some(stop) = (i % 3 != 2).then(|| stop_from_middle(&full.text)).flatten() else {
            let want = (full.token_ids, full.text, FinishReason::Length);
            setups.push((SamplingParams::greedy(), Vec::new(), want));
            continue;
        };
        let (k, text) =
            stop_cut(&f, &full.token_ids, &stop, 0).expect("the stop string is streamed");
        assert!(!text.is_empty(), "prompt {i}: {stop:?} cuts nothing");
        cut_by_stop += (k < full.token_ids.len()) as usize;
        let want = (full.token_ids[..k].to_vec(), text, FinishReason::Stop);
        setups.push((SamplingParams::greedy(), vec![stop], want));
    }
    assert!(
        cut_by_stop >= 10 && cut_by_eos >= 4,
        "{cut_by_stop} answers cut by a stop string mid-answer, {cut_by_eos} by EOS"
    );
    for name in ["ngram", "draft-model"] {
        let mut e = engine_with(&f, proposer_clone(&f, name));
        for (i, (sp, stop, _)) in setups.iter().enumerate() {
            let mut r = Request::new(i as u64, ps[i].clone(), 40);
            r.params = sp.clone();
            r.stop = stop.clone();
            e.add(r).unwrap();
        }
        let got = collect(e.run_to_completion().unwrap());
        for (i, (_, stop, want)) in setups.iter().enumerate() {
            assert_eq!(&got[&(i as u64)], want, "{name} prompt {i} stop {stop:?}");
        }
        let t = e.totals();
        assert!(
            0 < t.accepted_tokens && t.accepted_tokens < t.drafted_tokens,
            "{name}: {} of {} drafts accepted",
            t.accepted_tokens,
            t.drafted_tokens
        );
        e.check_kv().unwrap();
    }
}

/// As vLLM's `min_tokens`: a stop string ends a request only from that many tokens on, on
/// text that arrives from then on. Each stop string is a character of the first 9 tokens'
/// text (without min_tokens it would end the answer there) that completes again after token
/// 10: the answer is plain decoding's cut right there (exact length, text, reason Stop).
#[test]
fn min_tokens_hold_stop_strings_back_too() {
    let f = fixture_varied();
    let ps = prompts(&f, 16);
    let mut e = engine_with(&f, proposer_clone(&f, "ngram"));
    let mut want = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        let full = plain(
            &f,
            p,
            GenerateParams {
                max_tokens: 30,
                min_tokens: 10,
                ..Default::default()
            },
        );
        // The text of the first 9 tokens, as streamed.
        let mut d = dspark_runtime::tokenizer::StreamDecoder::new();
        let early: String = full.token_ids[..9]
            .iter()
            .filter_map(|&t| d.push(&f.tok, t).unwrap())
            .collect();
        let Some((stop, (k, text))) = early.chars().filter(|&c| c != '\u{fffd}').find_map(|c| {
            let st = c.to_string();
            let cut = stop_cut(&f, &full.token_ids, &st, 10)?;
            (cut.0 < full.token_ids.len()).then_some((st, cut))
        }) else {
            continue;
        };
        // Without min_tokens it would have ended the answer within 9 tokens.
        assert!(stop_cut(&f, &full.token_ids, &stop, 0).unwrap().0 < 10);
        assert!(k >= 10, "prompt {i}");
        let mut r = Request::new(i as u64, p.clone(), 30);
        r.min_tokens = 10;
        r.stop = vec![stop.clone()];
        want.push((
            i as u64,
            stop,
            (full.token_ids[..k].to_vec(), text, FinishReason::Stop),
        ));
        e.add(r).unwrap();
    }
    assert!(
        want.len() >= 8,
        "{} prompts with a stop string to hold back",
        want.len()
    );
    let got = collect(e.run_to_completion().unwrap());
    for (id, stop, w) in want {
        assert_eq!(got[&id], w, "prompt {id} stop {stop:?}");
    }
    e.check_kv().unwrap();
}

/// The text sent is the whole decoding of the tokens sent, whatever the last one: a character
/// cut by the token limit (the tiny vocabulary's byte tokens split characters often when
/// sampled), or a token that decodes to U+FFFD, is released at the end, not held back.
#[test]
fn the_text_sent_is_the_decoding_of_the_tokens_whatever_the_last_one() {
    let f = fixture_scaled(0.15);
    let ps = prompts(&f, 24);
    let mut e = engine_with(&f, proposer_clone(&f, "ngram"));
    for (i, p) in ps.iter().enumerate() {
        let mut r = Request::new(i as u64, p.clone(), 2 + i % 9);
        r.params.temperature = 1.0;
        r.seed = 1000 + i as u64;
        e.add(r).unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    let mut cut = 0;
    for (id, (tokens, text, _)) in &got {
        let whole = f.tok.decode(tokens, true).unwrap();
        cut += usize::from(whole.ends_with('\u{fffd}'));
        assert_eq!(text, &whole, "request {id}: {tokens:?}");
    }
    assert!(
        cut >= 1,
        "no answer ended mid-character: the test shows nothing"
    );
    e.check_kv().unwrap();
}

/// A request resumed after its worker died mid-stream (the router sends the prompt plus the
/// tokens it received, `resumed` of them) goes on from the text its first worker held back:
/// at every cut, the text sent before it plus the text after it is the uninterrupted answer,
/// token for token; a stop string that straddles the cut still ends the answer where it
/// would have; a character whose bytes straddle it comes out whole.
#[test]
fn a_resumed_request_sends_the_text_its_first_worker_held_back() {
    let f = fixture();
    let ps = prompts(&f, 12);
    let engine = || {
        Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            Box::new(NoProposer),
            cfg(1),
            CostModel::flat(2),
        )
        .unwrap()
    };
    let request = |id: u64, prompt: Vec<u32>, max: usize, stop: Option<&String>| {
        let mut r = Request::new(id, prompt, max);
        r.stop = stop.into_iter().cloned().collect();
        r
    };
    let mut e = engine();
    for (i, p) in ps.iter().enumerate() {
        e.add(request(i as u64, p.clone(), 40, None)).unwrap();
    }
    let plain = collect(e.run_to_completion().unwrap());
    // The tiny model repeats itself: a stop string of its first character twice and one it
    // never writes is held back all along (two characters behind), one of the character
    // twice ends the answer at its second token, across a cut after the first.
    let stops: Vec<Option<String>> = (0..ps.len())
        .map(|i| {
            let c = plain[&(i as u64)].1.chars().next()?;
            Some(if i % 2 == 0 {
                format!("{c}{c}\u{7}")
            } else {
                format!("{c}{c}")
            })
        })
        .collect();
    assert!(
        stops.iter().filter(|s| s.is_some()).count() >= 4,
        "{stops:?}"
    );
    // The uninterrupted runs with the stop strings, event by event.
    let mut e = engine();
    for (i, p) in ps.iter().enumerate() {
        e.add(request(i as u64, p.clone(), 40, stops[i].as_ref()))
            .unwrap();
    }
    let mut steps: HashMap<u64, Vec<(Vec<u32>, String)>> = HashMap::new();
    let mut whole: HashMap<u64, FinishReason> = HashMap::new();
    for ev in e.run_to_completion().unwrap() {
        match ev {
            Event::Tokens {
                id, tokens, text, ..
            } => steps.entry(id).or_default().push((tokens, text)),
            Event::Finished { id, reason, .. } => {
                whole.insert(id, reason);
            }
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
        }
    }
    // Every cut between two events, resumed on a fresh engine.
    let mut e = engine();
    let mut cuts = Vec::new();
    let mut held = 0;
    for (i, p) in ps.iter().enumerate() {
        let ev = &steps[&(i as u64)];
        for j in 0..ev.len().saturating_sub(1) {
            let ids: Vec<u32> = ev[..=j].iter().flat_map(|s| s.0.clone()).collect();
            let sent: String = ev[..=j].iter().map(|s| s.1.as_str()).collect();
            if f.tok.decode(&ids, true).unwrap().len() > sent.len() {
                held += 1;
            }
            let mut prompt = p.clone();
            prompt.extend_from_slice(&ids);
            let id = (cuts.len() + 1000) as u64;
            let mut r = request(id, prompt, 40 - ids.len(), stops[i].as_ref());
            r.resumed = ids.len();
            e.add(r).unwrap();
            cuts.push((i, id, ids, sent));
        }
    }
    assert!(
        held > 0,
        "no cut found text held back: the test checks nothing"
    );
    let got = collect(e.run_to_completion().unwrap());
    let want = |i: usize| -> (Vec<u32>, String) {
        let ev = &steps[&(i as u64)];
        (
            ev.iter().flat_map(|s| s.0.clone()).collect(),
            ev.iter().map(|s| s.1.as_str()).collect(),
        )
    };
    for (i, id, ids, sent) in &cuts {
        let (rest_ids, rest, reason) = &got[id];
        let at = format!("prompt {i}, cut after {} tokens", ids.len());
        assert_eq!([&ids[..], &rest_ids[..]].concat(), want(*i).0, "{at}");
        assert_eq!(format!("{sent}{rest}"), want(*i).1, "{at}");
        assert_eq!(*reason, whole[&(*i as u64)], "{at}");
    }
    e.check_kv().unwrap();

    // "é" is two byte tokens: the first worker sent nothing for the first, its successor
    // sends the character with the second.
    let byte = |b: u8| {
        (0..f.tok.vocab_size() as u32)
            .find(|&t| f.tok.token_bytes(t) == [b])
            .unwrap()
    };
    let (lead, tail) = (byte(0xC3), byte(0xA9));
    let mut e = engine();
    let mut prompt = ps[0].clone();
    prompt.push(lead);
    let mut r = Request::new(1, prompt, 1);
    r.resumed = 1;
    r.params.set_logit_bias([(tail, 100.0)]);
    e.add(r).unwrap();
    let got = collect(e.run_to_completion().unwrap());
    assert_eq!(got[&1].0, vec![tail]);
    assert_eq!(got[&1].1, "é");
}

/// Tokens that are whitespace only (tests push them away: a tiny random model pads with them).
fn whitespace_tokens(f: &Fixture) -> Vec<u32> {
    (0..f.tok.vocab_size() as u32)
        .filter(|&t| {
            let b = f.tok.token_bytes(t);
            !b.is_empty() && b.iter().all(|c| c.is_ascii_whitespace())
        })
        .collect()
}

/// Runs `ps` through every proposer at γ 1 and 4 (each request set up by `setup`) and checks
/// the outputs against `want`, plain decoding's (and the finish reasons, if `reasons`).
fn greedy_parity_for_every_proposer(
    f: &Fixture,
    ps: &[Vec<u32>],
    want: &[dspark_runtime::generate::GenerateOutput],
    reasons: bool,
    setup: impl Fn(usize, &mut Request),
) {
    let reqs: Vec<Request> = (0..ps.len())
        .map(|i| {
            let mut r = Request::new(i as u64, ps[i].clone(), 1);
            setup(i, &mut r);
            r
        })
        .collect();
    let answers: Vec<&[u32]> = want.iter().map(|w| &w.token_ids[..]).collect();
    for (name, _) in proposers(f) {
        let firsts = first_drafts(f, name, &reqs, &answers);
        for gamma in [1usize, 4] {
            let mut e = Engine::with_cost(
                f.target.clone(),
                Some(f.tok.clone()),
                proposer_clone(f, name),
                cfg(gamma),
                CostModel::flat(gamma + 1),
            )
            .unwrap();
            for (i, p) in ps.iter().enumerate() {
                let mut r = Request::new(i as u64, p.clone(), 1);
                setup(i, &mut r);
                e.add(r).unwrap();
            }
            let got = collect(e.run_to_completion().unwrap());
            for (i, w) in want.iter().enumerate() {
                let g = &got[&(i as u64)];
                assert_eq!(g.0, w.token_ids, "{name} γ={gamma} prompt {i}");
                let reason = match g.2 {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    _ => "other",
                };
                if reasons {
                    assert_eq!(reason, w.finish_reason, "{name} γ={gamma} prompt {i}");
                }
            }
            assert_speculated(e.totals(), name, gamma, firsts);
            e.check_kv().unwrap();
        }
    }
}

/// Penalties: presence and frequency counted over the answer, repetition over prompt and
/// answer. Every proposer reproduces plain decoding under them, on models whose distributions
/// are spread enough that where counting starts changes the answers.
#[test]
fn greedy_parity_holds_under_penalties_counted_over_the_answer() {
    let f = fixture_scaled(0.15);
    let ps = prompts(&f, 12);
    let params = |i: usize| SamplingParams {
        presence_penalty: 2.0,
        frequency_penalty: 1.0 + (i % 3) as f32 * 0.5,
        repetition_penalty: 1.0 + (i % 2) as f32 * 0.3,
        ..SamplingParams::greedy()
    };
    let want: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let gp = GenerateParams {
                max_tokens: 24,
                sampling: params(i),
                ..Default::default()
            };
            generate(&f.target, &f.tok, p, &gp, &mut |_| {}).unwrap()
        })
        .collect();
    greedy_parity_for_every_proposer(&f, &ps, &want, true, |i, r| {
        r.max_tokens = 24;
        r.params = params(i);
    });
}

/// logit_bias, min_tokens and stop_token_ids change the target's greedy choice; every proposer
/// must still reproduce plain decoding under them token for token, and each option must have
/// done what it says (an end-of-sequence pushed to the front held back until min_tokens, a
/// stop token ending the output and kept in it, a bias moving choices).
#[test]
fn greedy_parity_holds_under_logit_bias_min_tokens_and_stop_token_ids() {
    let f = fixture();
    let ps = prompts(&f, 24);
    let eos = f.tok.stop_ids[0];
    let run = |p: &[u32], sampling: SamplingParams, min_tokens: usize, stops: Vec<u32>| {
        generate(
            &f.target,
            &f.tok,
            p,
            &GenerateParams {
                max_tokens: 30,
                sampling,
                min_tokens,
                stop_token_ids: stops,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap()
    };
    let plain: Vec<_> = ps
        .iter()
        .map(|p| run(p, SamplingParams::greedy(), 0, Vec::new()))
        .collect();
    // Every prompt: its plain second token suppressed, another token boosted a little. One in
    // three (not a multiple of 3, odd): end-of-sequence boosted to the top and min_tokens 12.
    // Multiples of 3: a stop token id, the seventh token of its output without one. Every
    // fourth: penalties, presence and frequency counted over the output only (the engine and
    // plain decoding must agree where the output starts), repetition over prompt and output.
    let eos_first = |i: usize| i % 2 == 1 && i % 3 != 0;
    let params = |i: usize| {
        let mut sp = SamplingParams::greedy();
        if i % 4 == 2 {
            sp.presence_penalty = 2.0;
            sp.frequency_penalty = 2.0;
            sp.repetition_penalty = 1.5;
        }
        let mut bias = vec![(((i * 37) % 200) as u32 + 5, 2.5)];
        if let Some(&t) = plain[i].token_ids.get(1) {
            bias.push((t, -100.0));
        }
        if eos_first(i) {
            bias.push((eos, 100.0));
        }
        sp.set_logit_bias(bias);
        sp
    };
    let min_tokens = |i: usize| if i % 3 == 0 { 0 } else { 12 };
    let stops: Vec<Vec<u32>> = (0..ps.len())
        .map(|i| {
            if i % 3 != 0 {
                return Vec::new();
            }
            let o = run(&ps[i], params(i), 0, Vec::new());
            o.token_ids.get(6).copied().into_iter().collect()
        })
        .collect();
    let want: Vec<_> = (0..ps.len())
        .map(|i| run(&ps[i], params(i), min_tokens(i), stops[i].clone()))
        .collect();
    let moved = (0..ps.len())
        .filter(|&i| want[i].token_ids != plain[i].token_ids)
        .count();
    assert!(
        moved >= ps.len() / 2,
        "the options changed only {moved} outputs"
    );
    for (i, w) in want.iter().enumerate() {
        if eos_first(i) {
            // EOS wins every position once it may: exactly min_tokens tokens.
            assert_eq!(
                (w.token_ids.len(), w.finish_reason),
                (12, "stop"),
                "prompt {i}"
            );
        }
        if let Some(&st) = stops[i].first() {
            assert_eq!(w.finish_reason, "stop", "prompt {i}");
            assert_eq!(w.token_ids.last(), Some(&st), "prompt {i}");
            assert!(w.token_ids.len() <= 7, "prompt {i}");
        }
    }
    greedy_parity_for_every_proposer(&f, &ps, &want, true, |i, r| {
        r.max_tokens = 30;
        r.params = params(i);
        r.min_tokens = min_tokens(i);
        r.stop_token_ids = stops[i].clone();
    });
}

/// JSON mode masks the target's distribution to tokens that continue one JSON object; every
/// proposer must reproduce plain decoding under the mask token for token (greedy), and what
/// comes out is JSON: complete objects where the request stopped, valid prefixes where it
/// ran out of tokens.
#[test]
fn json_mode_keeps_greedy_parity_and_yields_json() {
    let f = fixture();
    let ps = prompts(&f, 16);
    let close = f.tok.encode("}").unwrap();
    let run = |p: &[u32], sampling: SamplingParams| {
        generate(
            &f.target,
            &f.tok,
            p,
            &GenerateParams {
                max_tokens: 40,
                sampling,
                json: Some(Format::Object),
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap()
    };
    // Half the prompts lean toward closing the object and away from whitespace, so some
    // documents complete (a tiny random model otherwise pads with whitespace).
    let blank = whitespace_tokens(&f);
    // The other half open the object at once and lean toward a key, so their documents get
    // strings to verify drafts in.
    let open = f.tok.encode("{").unwrap();
    let quote = f.tok.encode("\"").unwrap();
    let params = |i: usize| {
        let mut sp = SamplingParams::greedy();
        if i % 2 == 1 {
            sp.set_logit_bias(
                close
                    .iter()
                    .map(|&t| (t, 4.0))
                    .chain(blank.iter().map(|&t| (t, -20.0))),
            );
        } else {
            sp.set_logit_bias(
                open.iter()
                    .map(|&t| (t, 30.0))
                    .chain(quote.iter().map(|&t| (t, 3.0)))
                    .chain(close.iter().map(|&t| (t, -100.0)))
                    .chain(blank.iter().map(|&t| (t, -100.0))),
            );
        }
        sp
    };
    let want: Vec<_> = (0..ps.len()).map(|i| run(&ps[i], params(i))).collect();
    let mut complete = 0;
    for (i, w) in want.iter().enumerate() {
        let mut st = dspark_runtime::json::JsonState::new();
        assert!(st.push_bytes(w.text.as_bytes()), "prompt {i}: {:?}", w.text);
        if w.finish_reason == "stop" {
            let v: serde_json::Value = serde_json::from_str(&w.text)
                .unwrap_or_else(|e| panic!("prompt {i}: {e}: {:?}", w.text));
            assert!(v.is_object(), "{v}");
            complete += 1;
        }
    }
    assert!(
        complete > 0,
        "no JSON document completed: {:?}",
        want.iter().map(|w| &w.text).collect::<Vec<_>>()
    );
    greedy_parity_for_every_proposer(&f, &ps, &want, false, |i, r| {
        r.max_tokens = 40;
        r.params = params(i);
        r.json = Some(Format::Object);
    });
    // A request continued after a failover: the output so far rides at the end of the prompt
    // and the document picks up where it was, so the rest equals the uninterrupted run.
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(NoProposer),
        cfg(1),
        CostModel::flat(2),
    )
    .unwrap();
    let cont = (0..ps.len())
        .filter(|&i| want[i].token_ids.len() > 6)
        .collect::<Vec<_>>();
    assert!(!cont.is_empty());
    for &i in &cont {
        let mut prompt = ps[i].clone();
        prompt.extend_from_slice(&want[i].token_ids[..5]);
        let mut r = Request::new(i as u64, prompt, 35);
        r.params = params(i);
        r.json = Some(Format::Object);
        r.resumed = 5;
        e.add(r).unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    for &i in &cont {
        assert_eq!(got[&(i as u64)].0, want[i].token_ids[5..], "prompt {i}");
    }
    // Resumed output that cannot start an object, or more of it than the prompt holds.
    let mut r = Request::new(1, ps[0].clone(), 10);
    r.json = Some(Format::Object);
    r.resumed = 2;
    assert!(e.add(r).unwrap_err().to_string().contains("JSON"));
    let mut r = Request::new(1, ps[0].clone(), 10);
    r.resumed = ps[0].len() + 1;
    assert!(e.add(r).unwrap_err().to_string().contains("resumed"));
    // JSON mode with min_tokens is refused (the two could leave nothing to sample).
    let mut r = Request::new(1, ps[0].clone(), 10);
    r.json = Some(Format::Object);
    r.min_tokens = 2;
    assert!(e.add(r).unwrap_err().to_string().contains("JSON"));
}

/// A JSON schema shapes the answer the same way: every proposer reproduces plain decoding
/// under the schema's mask, and finished answers are documents of the schema.
#[test]
fn json_schema_keeps_greedy_parity_and_yields_documents_of_the_schema() {
    let f = fixture();
    let ps = prompts(&f, 12);
    let schema = dspark_runtime::json_schema::Schema::compile(&serde_json::json!({
        "type": "object",
        "properties": {
            "kind": {"enum": ["x", "yz", 3]},
            "ok": {"type": "boolean"},
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}}
        },
        "required": ["kind", "ok", "n"]
    }))
    .unwrap();
    let format = Format::Schema(Arc::new(schema));
    // Whitespace pushed away (a tiny random model pads with it), and on odd prompts the
    // closing bracket and digits made likely so that documents finish.
    let blank = whitespace_tokens(&f);
    let ends: Vec<u32> = ["}", "]", "1", ","]
        .iter()
        .flat_map(|s| f.tok.encode(s).unwrap())
        .collect();
    let params = |i: usize| {
        let mut sp = SamplingParams::greedy();
        let mut bias: Vec<(u32, f32)> = blank.iter().map(|&t| (t, -100.0)).collect();
        if i % 2 == 1 {
            bias.extend(ends.iter().map(|&t| (t, 5.0)));
        }
        sp.set_logit_bias(bias);
        sp
    };
    let want: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            generate(
                &f.target,
                &f.tok,
                p,
                &GenerateParams {
                    max_tokens: 40,
                    sampling: params(i),
                    json: Some(format.clone()),
                    ..Default::default()
                },
                &mut |_| {},
            )
            .unwrap()
        })
        .collect();
    let mut complete = 0;
    for (i, w) in want.iter().enumerate() {
        if w.finish_reason == "stop" {
            let v: serde_json::Value = serde_json::from_str(&w.text)
                .unwrap_or_else(|e| panic!("prompt {i}: {e}: {:?}", w.text));
            assert!(
                [
                    serde_json::json!("x"),
                    serde_json::json!("yz"),
                    serde_json::json!(3)
                ]
                .contains(&v["kind"]),
                "{v}"
            );
            assert!(v["ok"].is_boolean() && v["n"].is_i64(), "{v}");
            complete += 1;
        }
    }
    assert!(
        complete > 0,
        "no document finished: {:?}",
        want.iter().map(|w| &w.text).collect::<Vec<_>>()
    );
    greedy_parity_for_every_proposer(&f, &ps, &want, false, |i, r| {
        r.max_tokens = 40;
        r.params = params(i);
        r.json = Some(format.clone());
    });
}

/// A whole-answer regex (vLLM's `guided_regex`) and a choice (`guided_choice`): every
/// proposer reproduces plain decoding under the mask, and finished answers match.
#[test]
fn regex_and_choice_keep_greedy_parity_and_match_the_whole_answer() {
    use dspark_runtime::json_schema::Pattern;
    let f = fixture();
    let ps = prompts(&f, 12);
    // At most 31 bytes: every answer ends within the token limit.
    let regex = r"(the|a) [a-z]{1,8}( [a-z]{1,8}){0,2}\.";
    let formats = [
        Format::Regex(Arc::new(Pattern::full_match(regex).unwrap())),
        Format::Regex(Arc::new(
            Pattern::one_of(&["the theater".into(), "there".into(), "then they".into()]).unwrap(),
        )),
    ];
    let check = regex::Regex::new(&format!("^(?:{regex})$")).unwrap();
    for (k, format) in formats.iter().enumerate() {
        let want: Vec<_> = ps
            .iter()
            .map(|p| {
                generate(
                    &f.target,
                    &f.tok,
                    p,
                    &GenerateParams {
                        max_tokens: 40,
                        json: Some(format.clone()),
                        ..Default::default()
                    },
                    &mut |_| {},
                )
                .unwrap()
            })
            .collect();
        let mut finished = 0;
        for w in &want {
            if w.finish_reason == "stop" {
                let ok = if k == 0 {
                    check.is_match(&w.text)
                } else {
                    ["the theater", "there", "then they"].contains(&w.text.as_str())
                };
                assert!(ok, "format {k}: {:?}", w.text);
                finished += 1;
            }
        }
        assert_eq!(finished, ps.len(), "format {k}: every answer ends");
        greedy_parity_for_every_proposer(&f, &ps, &want, false, |_, r| {
            r.max_tokens = 40;
            r.json = Some(format.clone());
        });
    }
}

/// An engine for the sampling-distribution tests: `name`'s proposer, γ = 3, 64 at once.
fn sampling_engine(f: &Fixture, name: &str) -> Engine {
    Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        proposer_clone(f, name),
        EngineConfig {
            max_running: 64,
            ..cfg(3)
        },
        CostModel::flat(4),
    )
    .unwrap()
}

/// Sampled with penalties, the target's p at each position of a verification window counts
/// the drafts accepted before it, as plain decoding counts the tokens before it. At this
/// spread the answers often repeat themselves (30–50 % of tokens from the fourth on), and a
/// presence penalty pushes a token just drawn away: a verifier that penalized only the
/// committed tokens let the window's drafts repeat (TV 0.07–0.10 at tokens 4–6; 0.01–0.03
/// when correct; the bound is 0.055). Compared, per position, through whether the token
/// repeats one earlier in the answer (a function of the output, so its distribution must
/// match), with the bound of `sampled_tokens_match_with_speculation_on_and_off` over 3 cells.
/// (The peaked fixture repeats whatever the penalty; the most spread one hardly repeats.)
#[test]
fn sampled_penalties_count_the_drafts_in_the_window() {
    let f = fixture_scaled(0.5);
    let prompt = f.tok.encode("the theater in there ").unwrap();
    const POSITIONS: usize = 6;
    let n = 10_000u64;
    let params = SamplingParams {
        temperature: 1.0,
        presence_penalty: 2.0,
        frequency_penalty: 0.5,
        repetition_penalty: 1.2,
        ..Default::default()
    };
    let mut hists = Vec::new();
    for name in ["none", "draft-model"] {
        let mut e = sampling_engine(&f, name);
        for seed in 0..n {
            let mut r = Request::new(seed, prompt.clone(), POSITIONS);
            r.params = params.clone();
            r.seed = seed * 7919 + 1;
            e.add(r).unwrap();
        }
        let got = collect(e.run_to_completion().unwrap());
        if name == "draft-model" {
            let t = e.totals();
            assert!(t.accepted_tokens > 0, "no draft accepted: nothing tested");
        }
        // Per position: [repeats an earlier token of the answer, does not, ended before].
        let mut at = vec![[0u64; 3]; POSITIONS];
        for (toks, _, _) in got.values() {
            for (i, c) in at.iter_mut().enumerate() {
                c[match toks.get(i) {
                    None => 2,
                    Some(t) if toks[..i].contains(t) => 0,
                    Some(_) => 1,
                }] += 1;
            }
        }
        hists.push(at);
        e.check_kv().unwrap();
    }
    let bound = (3.0 / n as f64).sqrt() + 2.0 * ((1000f64).ln() / (2.0 * n as f64)).sqrt();
    for i in 1..POSITIONS {
        let (a, b) = (hists[0][i], hists[1][i]);
        let tv: f64 = 0.5
            * a.iter()
                .zip(&b)
                .map(|(&x, &y)| (x as f64 - y as f64).abs() / n as f64)
                .sum::<f64>();
        assert!(
            tv < bound,
            "token {}: TV {tv} ≥ {bound} (repeats, not, ended: {a:?} vs {b:?})",
            i + 1
        );
    }
}

#[test]
fn sampled_tokens_match_with_speculation_on_and_off() {
    // Same prompt, many seeds: the empirical distribution of the token at each of the first
    // five output positions (or "ended before it") with the draft model on must match
    // speculation off. Five tokens at γ = 3: the first comes from the prefill, the next four
    // from a cycle that verifies three drafts, so acceptance, the residual draw and the bonus
    // token are all on the path (counted below). Bound: each empirical distribution of n draws
    // over m cells is within E[TV] ≤ ½√(m/n) of its own law; with McDiarmid at 99.9% each and
    // the triangle inequality, TV(a, b) < √(m/n) + 2√(ln(1000)/(2n)) when the laws are equal
    // (false alarm ≤ 0.2 % per position). The arms draw from disjoint seeds (independent
    // samples): measured TV 0.005–0.010 at n = 40,000 (bound 0.037) and 0.016–0.031 at
    // n = 4000 (bounds 0.098–0.116).
    // Also under min_p, a logit bias (one token pushed up, one forbidden) and min_tokens
    // holding end-of-sequence back for two tokens; and in JSON mode. Models of spread
    // distributions: the usual fixture's are so peaked that each position had one or two
    // tokens, and the test compared next to nothing.
    let f = fixture_scaled(0.15);
    let prompt = f.tok.encode("the theater in there ").unwrap();
    const POSITIONS: usize = 5;
    const ENDED: u32 = u32::MAX;
    let plain = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        ..Default::default()
    };
    let mut shaped = SamplingParams {
        temperature: 1.1,
        min_p: 0.05,
        ..Default::default()
    };
    let top = kernels::sampling::argmax(logits_all(&f.target, &prompt).row(0, prompt.len() - 1));
    shaped.set_logit_bias([(top, -100.0), (top + 1, 1.5)]);
    let json_mode = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    for (params, min_tokens, json, n) in [
        (plain, 0usize, false, 40_000u64),
        (shaped, 2, false, 4000),
        (json_mode, 0, true, 4000),
    ] {
        let mut hists = Vec::new();
        // The third run (speculation off, other seeds) only picks the cells compared: its 12
        // most frequent tokens, each a cell, the rest one. A partition fixed apart from the two
        // compared samples keeps the bound, and few cells give it power. With 40,000 draws a
        // verifier that drew rejected positions from p instead of the residual failed (TV
        // 0.053 against a bound of 0.037, measured when the arms shared seeds; with
        // independent arms a correct engine's TV is 0.005–0.010, so that bias should still
        // exceed the bound, by less: not re-measured); over all cells with
        // 4000 draws it passed (TV 0.16–0.18 under a bound of 0.3). The shaped and JSON runs
        // draw 4000 (bound 0.116, for the test's time): they catch gross errors only, and
        // the plain run is the one that holds the residual to account.
        // Each run draws from its own seeds: the two compared samples are independent (with
        // shared seeds the first token, sampled from the prefill, was the same in both by
        // construction, and the later ones correlated).
        let own = |k: u64, len: u64| (k << 32)..(k << 32) + len;
        for (name, seeds) in [
            ("none", own(0, n)),
            ("draft-model", own(1, n)),
            ("none", own(2, 4000)),
        ] {
            let mut e = sampling_engine(&f, name);
            for seed in seeds.clone() {
                let mut r = Request::new(seed, prompt.clone(), POSITIONS);
                r.params = params.clone();
                r.min_tokens = min_tokens;
                r.json = json.then_some(Format::Object);
                r.seed = seed * 7919 + 1;
                e.add(r).unwrap();
            }
            let got = collect(e.run_to_completion().unwrap());
            let mut at: Vec<HashMap<u32, u64>> = vec![HashMap::new(); POSITIONS];
            let got_two = got.values().all(|(toks, _, _)| toks.len() >= 2);
            for (_, (toks, _, _)) in got {
                for (i, h) in at.iter_mut().enumerate() {
                    *h.entry(toks.get(i).copied().unwrap_or(ENDED)).or_default() += 1;
                }
            }
            if name == "draft-model" {
                let t = e.totals();
                assert!(
                    t.accepted_tokens > 0 && t.accepted_tokens < t.drafted_tokens,
                    "drafts both accepted and rejected: {} of {}",
                    t.accepted_tokens,
                    t.drafted_tokens
                );
            }
            let (first, second) = (&at[0], &at[1]);
            if min_tokens > 0 {
                // Forbidden by its bias; end-of-sequence held back for both tokens.
                assert!(
                    !first.contains_key(&top),
                    "{name}: the forbidden token was drawn"
                );
                let eos = f.tok.stop_ids[0];
                assert!(!first.contains_key(&eos) && !second.contains_key(&eos));
                assert!(got_two, "{name}: an output ended before min_tokens");
            }
            if json {
                // Every first token opens the object or pads before it.
                for t in first.keys() {
                    let b = f.tok.token_bytes(*t);
                    assert!(
                        b.iter().all(|c| c.is_ascii_whitespace() || *c == b'{'),
                        "{name}: first token {b:?}"
                    );
                }
            }
            hists.push(at);
            e.check_kv().unwrap();
        }
        const CELLS: usize = 12;
        for which in 0..POSITIONS {
            let mut ranked: Vec<(u32, u64)> =
                hists[2][which].iter().map(|(&k, &c)| (k, c)).collect();
            ranked.sort_by_key(|&(k, c)| (std::cmp::Reverse(c), k));
            let kept: Vec<u32> = ranked.iter().take(CELLS).map(|x| x.0).collect();
            let cell = |k: u32| kept.iter().position(|&x| x == k).unwrap_or(CELLS);
            let coarse = |h: &HashMap<u32, u64>| {
                let mut c = [0u64; CELLS + 1];
                for (&k, &v) in h {
                    c[cell(k)] += v;
                }
                c
            };
            let (a, b) = (coarse(&hists[0][which]), coarse(&hists[1][which]));
            let tv: f64 = 0.5
                * a.iter()
                    .zip(&b)
                    .map(|(&x, &y)| (x as f64 - y as f64).abs() / n as f64)
                    .sum::<f64>();
            let m = (kept.len() + 1) as f64;
            let bound = (m / n as f64).sqrt() + 2.0 * ((1000f64).ln() / (2.0 * n as f64)).sqrt();
            assert!(
                tv < bound,
                "token {} TV {tv} ≥ {bound} over {m} cells",
                which + 1
            );
        }
    }
}

#[test]
fn cancellation_and_bad_input() {
    let f = fixture();
    let mut e = engine_with(&f, Box::new(NgramProposer::default()));
    let p = f.tok.encode("the theater in").unwrap();
    assert!(e.add(Request::new(1, vec![], 5)).is_err());
    assert!(e.add(Request::new(1, p.clone(), 0)).is_err());
    let mut r = Request::new(1, p.clone(), 5);
    r.params.temperature = -1.0;
    assert!(e.add(r).is_err());
    let mut r = Request::new(1, p.clone(), 5);
    r.params.top_p = 1.5;
    assert!(e.add(r).is_err());
    let vocab = f.target.cfg.vocab_size as u32;
    let mut r = Request::new(1, p.clone(), 5);
    r.params.set_logit_bias([(vocab, 1.0)]);
    assert!(e.add(r).unwrap_err().to_string().contains("logit_bias"));
    let mut r = Request::new(1, p.clone(), 5);
    r.params.min_p = 2.0;
    assert!(e.add(r).unwrap_err().to_string().contains("min_p"));
    let mut r = Request::new(1, p.clone(), 5);
    r.stop_token_ids = vec![vocab + 3];
    assert!(e.add(r).unwrap_err().to_string().contains("stop token"));
    let mut r = Request::new(1, p.clone(), 5);
    r.stop_token_ids = vec![1; 100_000];
    assert!(e.add(r).unwrap_err().to_string().contains("at most"));
    let mut r = Request::new(1, p.clone(), 5);
    r.min_tokens = 6;
    assert!(e.add(r).unwrap_err().to_string().contains("min_tokens"));
    let mut r = Request::new(1, p.clone(), 5);
    r.gamma = Some(1000);
    assert!(e.add(r).is_err());
    assert!(e.add(Request::new(1, vec![999_999], 5)).is_err());
    assert!(
        EngineConfig {
            gamma: 99,
            ..Default::default()
        }
        .validate()
        .is_err()
    );
    // Cancel mid-stream frees the KV.
    e.add(Request::new(7, p.clone(), 50)).unwrap();
    e.add(Request::new(8, p.clone(), 50)).unwrap();
    assert!(
        e.add(Request::new(8, p.clone(), 50)).is_err(),
        "duplicate id"
    );
    e.step().unwrap();
    e.step().unwrap();
    let before = e.totals().clone();
    let Some(Event::Finished {
        reason: FinishReason::Cancelled,
        metrics,
        ..
    }) = e.cancel(7).unwrap()
    else {
        panic!("request 7 cancelled");
    };
    assert!(metrics.completion_tokens > 0 && metrics.target_calls > 0);
    // What was done for it counts in the totals (the workers' token counters).
    let after = e.totals();
    assert_eq!(
        after.completion_tokens,
        before.completion_tokens + metrics.completion_tokens
    );
    assert_eq!(
        after.target_calls,
        before.target_calls + metrics.target_calls
    );
    assert!(e.cancel(7).is_err());
    e.run_to_completion().unwrap();
    e.check_kv().unwrap();
    assert_eq!(e.kv_free_blocks(), 8192 / 16);
}

#[test]
fn incompatible_draft_vocabulary_is_refused() {
    let f = fixture();
    let mut s = TinySpec::llama(13);
    s.vocab_variant = 1;
    let p = tiny_model_path(&s, "engine-other-vocab").unwrap();
    let other = Arc::new(
        Model::load(
            &p,
            &LoadOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let other_tok = Tokenizer::load(&p).unwrap();
    let e = DraftModelProposer::new(
        other,
        &other_tok,
        &f.tok,
        f.target.cfg.vocab_size,
        1024,
        "x",
    );
    assert!(e.is_err());
}

#[test]
fn metrics_count_what_happened() {
    let f = fixture();
    let mut e = engine_with(&f, proposer_clone(&f, "draft-model"));
    let p = f.tok.encode("the theater in there").unwrap();
    e.add(Request::new(1, p, 30)).unwrap();
    let events = e.run_to_completion().unwrap();
    let m = events
        .iter()
        .find_map(|ev| {
            if let Event::Finished { metrics, .. } = ev {
                Some(metrics.clone())
            } else {
                None
            }
        })
        .unwrap();
    assert_eq!(m.completion_tokens, 30);
    assert!(m.target_calls >= 30 / 5 && m.target_calls < 30);
    assert_eq!(m.accepted_tokens + m.wasted_tokens, m.drafted_tokens);
    assert_eq!(m.prefix_hist.iter().sum::<usize>(), m.spec_calls);
    assert!(m.committed_per_call() >= 1.0);
    assert!(m.ttft_s > 0.0 && m.e2e_s >= m.ttft_s);
}

/// A proposer that asks for pipelining and drafts from whatever `prefetch` saw last: exactly
/// what a remote drafter does, without the network.
struct Prefetching {
    inner: DraftModelProposer,
    ready: HashMap<u64, (usize, specdec::DraftBlock)>,
    prefetches: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    hits: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The longest block a prefetch asked for.
    longest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Proposer for Prefetching {
    fn name(&self) -> &str {
        "prefetching"
    }
    fn pipelined(&self) -> bool {
        true
    }
    fn prefetch(&mut self, reqs: &mut [specdec::proposer::ProposeReq<'_>]) {
        self.prefetches
            .fetch_add(reqs.len(), std::sync::atomic::Ordering::Relaxed);
        for r in reqs.iter() {
            self.longest
                .fetch_max(r.k, std::sync::atomic::Ordering::Relaxed);
        }
        let lens: Vec<(u64, usize)> = reqs.iter().map(|r| (r.id, r.context.len())).collect();
        if let Ok(blocks) = self.inner.propose(reqs) {
            for ((id, n), b) in lens.into_iter().zip(blocks) {
                self.ready.insert(id, (n, b));
            }
        }
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        let mut out = Vec::new();
        for r in reqs.iter_mut() {
            match self.ready.remove(&r.id) {
                Some((n, b)) if n == r.context.len() && b.tokens.len() >= r.k => {
                    self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    out.push(b);
                }
                _ => {
                    let mut one = [specdec::proposer::ProposeReq {
                        id: r.id,
                        context: r.context,
                        k: r.k,
                        params: r.params,
                        rng: &mut *r.rng,
                    }];
                    out.extend(self.inner.propose(&mut one)?);
                }
            }
        }
        Ok(out)
    }
    fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
        self.inner.commit(id, context)
    }
    fn finish(&mut self, id: u64) {
        self.ready.remove(&id);
        self.inner.finish(id)
    }
}

#[test]
fn pipelined_ping_pong_keeps_greedy_parity_and_uses_prefetched_drafts() {
    let f = fixture();
    let ps = prompts(&f, 12);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_greedy(&f, p, 20)).collect();
    let prefetches = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let p = Prefetching {
        inner: draft_model(&f, 1 << 16),
        ready: HashMap::new(),
        prefetches: prefetches.clone(),
        hits: hits.clone(),
        longest: Default::default(),
    };
    let config = EngineConfig {
        pingpong: true,
        ..cfg(3)
    };
    assert_batched_parity(&f, Box::new(p), config, &ps, 20, &want);
    assert!(prefetches.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert!(
        hits.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "a micro-batch's drafts were prefetched while the other verified"
    );
}

/// A drafter whose every call takes `sleep` (as a remote one waiting out its timeout does),
/// reporting it as a timeout or not.
struct Sleepy {
    inner: DraftModelProposer,
    sleep: std::time::Duration,
    timed_out: bool,
}

impl Proposer for Sleepy {
    fn name(&self) -> &str {
        "sleepy"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        std::thread::sleep(self.sleep);
        self.inner.propose(reqs)
    }
    fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
        self.inner.commit(id, context)
    }
    fn finish(&mut self, id: u64) {
        self.inner.finish(id)
    }
    fn timed_out(&self) -> bool {
        self.timed_out
    }
}

/// Drafting calls that waited out a remote drafter's timeout do not price drafting: with
/// the wait read as drafting's cost, the gate turned speculation off (drafts that the target
/// accepts every time: the draft model is the target).
#[test]
fn a_drafting_timeout_is_not_read_as_drafting_cost() {
    let f = fixture();
    let ps = prompts(&f, 4);
    let drafted = |timed_out: bool| {
        let p = Sleepy {
            inner: DraftModelProposer::new(
                f.target.clone(),
                &f.tok,
                &f.tok,
                f.target.cfg.vocab_size,
                1 << 16,
                "draft",
            )
            .unwrap(),
            // Far above a forward of these tiny models even when a parallel test run slows
            // them (20 ms was not, once in a few full runs).
            sleep: std::time::Duration::from_millis(60),
            timed_out,
        };
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            Box::new(p),
            EngineConfig {
                gate: true,
                ..cfg(3)
            },
            CostModel::flat(4),
        )
        .unwrap();
        for (i, p) in ps.iter().enumerate() {
            e.add(Request::new(i as u64, p.clone(), 24)).unwrap();
        }
        e.run_to_completion().unwrap();
        e.totals().drafted_tokens
    };
    let (waited, slow) = (drafted(true), drafted(false));
    assert!(
        waited > 2 * slow,
        "{waited} drafted after timeouts, {slow} when slow"
    );
}

/// Plans a budget of 2 for its first `drafting` steps, then plain decoding for good; notes
/// how many drafts had been prefetched when it switched.
struct DraftsThenStops {
    drafting: usize,
    calls: usize,
    prefetches: Arc<std::sync::atomic::AtomicUsize>,
    at_switch: Arc<std::sync::atomic::AtomicUsize>,
}

impl specdec::VerifyPolicy for DraftsThenStops {
    fn name(&self) -> &str {
        "drafts-then-stops"
    }
    fn select(&mut self, conf: &[&[f32]], _other: usize, _plain: usize, _kv: usize) -> Vec<usize> {
        conf.iter().map(|c| c.len().min(2)).collect()
    }
    fn planned(&mut self) -> Option<usize> {
        self.calls += 1;
        if self.calls == self.drafting + 1 {
            self.at_switch.store(
                self.prefetches.load(std::sync::atomic::Ordering::Relaxed),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        Some(if self.calls <= self.drafting { 2 } else { 0 })
    }
    fn drafting_within(&self, steps: usize) -> bool {
        self.calls.saturating_add(steps) <= self.drafting + 1
    }
}

/// Under ping-pong the drafts of a micro-batch's next turn are prefetched after its step, as
/// the policy plans them: blocks capped at the planned budget, none once plain decoding is
/// planned (a remote draft pool drafted full blocks for every request on every plain step).
#[test]
fn prefetched_drafts_follow_the_planned_budget() {
    let f = fixture();
    let ps = prompts(&f, 8);
    let prefetches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let longest = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let p = Prefetching {
        inner: draft_model(&f, 1 << 16),
        ready: HashMap::new(),
        prefetches: prefetches.clone(),
        hits: Default::default(),
        longest: longest.clone(),
    };
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(p),
        EngineConfig {
            pingpong: true,
            ..cfg(3)
        },
        CostModel::flat(4),
    )
    .unwrap();
    let at_switch = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    e.set_policy(Some(Box::new(DraftsThenStops {
        drafting: 12,
        calls: 0,
        prefetches: prefetches.clone(),
        at_switch: at_switch.clone(),
    })));
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), 24)).unwrap();
    }
    e.run_to_completion().unwrap();
    e.check_kv().unwrap();
    let before = at_switch.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        before > 0 && before != usize::MAX,
        "drafts were prefetched: {before}"
    );
    assert_eq!(
        prefetches.load(std::sync::atomic::Ordering::Relaxed),
        before,
        "none once plain decoding was planned"
    );
    assert_eq!(longest.load(std::sync::atomic::Ordering::Relaxed), 2);
}

/// A pipelined drafter whose drafts the target all but never takes (each the token after the
/// one before): counts the requests it is asked to prefetch drafts for and to draft for.
struct Misses {
    vocab: u32,
    prefetched: Arc<std::sync::atomic::AtomicUsize>,
    proposed: Arc<std::sync::atomic::AtomicUsize>,
}

impl Proposer for Misses {
    fn name(&self) -> &str {
        "misses"
    }
    fn pipelined(&self) -> bool {
        true
    }
    fn prefetch(&mut self, reqs: &mut [specdec::proposer::ProposeReq<'_>]) {
        self.prefetched
            .fetch_add(reqs.len(), std::sync::atomic::Ordering::Relaxed);
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        self.proposed
            .fetch_add(reqs.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(reqs
            .iter()
            .map(|r| {
                let last = r.context.last().copied().unwrap_or(0);
                let tokens: Vec<u32> = (1..=r.k as u32).map(|j| (last + j) % self.vocab).collect();
                specdec::DraftBlock {
                    dists: vec![specdec::proposer::Dist::OneHot; tokens.len()],
                    tokens,
                    ..Default::default()
                }
            })
            .collect())
    }
}

/// A request whose gate turned speculation off has no drafts prefetched for the steps it will
/// not draft in (a remote draft pool drafted a full block for it every step, for nothing):
/// only for the steps it drafts in, its gate's probes included.
#[test]
fn a_request_the_gate_switched_off_gets_no_drafts_prefetched() {
    let f = fixture();
    let ps = prompts(&f, 2);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_greedy(&f, p, 160)).collect();
    let prefetched = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let proposed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let p = Misses {
        vocab: f.target.cfg.vocab_size as u32,
        prefetched: prefetched.clone(),
        proposed: proposed.clone(),
    };
    let config = EngineConfig {
        gate: true,
        ..cfg(3)
    };
    assert_batched_parity(&f, Box::new(p), config, &ps, 160, &want);
    let (pre, pro) = (
        prefetched.load(std::sync::atomic::Ordering::Relaxed),
        proposed.load(std::sync::atomic::Ordering::Relaxed),
    );
    // The gate turned drafting off for most of the 2 × 160 steps, probing now and then.
    assert!(pro > 0 && pro < 160, "{pro} drafting calls");
    assert!(pre > 0, "drafts were prefetched");
    assert!(pre <= pro, "{pre} prefetched for {pro} drafting");
}

/// Draft-model drafting that asks for target layer 0, then layers 0 and 1, then 0… (its
/// answer changes at every call, as a remote proposer's does while draft workers come and
/// go), and checks that every hand-over is of the layers the forward captured.
struct Shifting {
    inner: Box<dyn Proposer>,
    d: usize,
    calls: std::sync::atomic::AtomicUsize,
    said: std::sync::Mutex<Vec<usize>>,
    handed: Arc<std::sync::atomic::AtomicUsize>,
}

impl Proposer for Shifting {
    fn name(&self) -> &str {
        "shifting"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        self.inner.propose(reqs)
    }
    fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
        self.inner.commit(id, context)
    }
    fn finish(&mut self, id: u64) {
        self.inner.finish(id)
    }
    fn feature_layers(&self) -> Vec<usize> {
        let n = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let layers = if n.is_multiple_of(2) {
            vec![0]
        } else {
            vec![0, 1]
        };
        *self.said.lock().unwrap() = layers.clone();
        layers
    }
    fn observe(&mut self, _id: u64, _start: usize, _rows: &[f32]) -> specdec::Result<()> {
        panic!("rows handed over without the layers they are of");
    }
    fn observe_captured(
        &mut self,
        _id: u64,
        _start: usize,
        layers: &[usize],
        rows: &[f32],
    ) -> specdec::Result<()> {
        // The proposer's answer has changed since, or not: the rows are of the forward's.
        assert_eq!(layers, self.said.lock().unwrap().as_slice());
        let rl = layers.len() * self.d;
        assert!(
            !rows.is_empty() && rows.len().is_multiple_of(rl),
            "{} floats",
            rows.len()
        );
        self.handed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

#[test]
fn target_features_are_handed_over_with_the_layers_they_were_captured_at() {
    let f = fixture();
    let ps = prompts(&f, 3);
    let handed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(Shifting {
            inner: proposer_clone(&f, "draft-model"),
            d: f.target.cfg.d_model,
            calls: Default::default(),
            said: Default::default(),
            handed: handed.clone(),
        }),
        cfg(3),
        CostModel::flat(4),
    )
    .unwrap();
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), 12)).unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(got[&(i as u64)].0, plain_greedy(&f, p, 12), "prompt {i}");
    }
    assert!(handed.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

/// Serves `ps` (`max_tokens` each) with the draft-model proposer at γ = 3 under `policy`: the
/// outputs and the engine's totals.
fn with_policy(
    f: &Fixture,
    ps: &[Vec<u32>],
    max_tokens: usize,
    policy: Option<Box<dyn specdec::VerifyPolicy>>,
) -> (
    HashMap<u64, (Vec<u32>, String, FinishReason)>,
    specdec::metrics::RequestMetrics,
) {
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        proposer_clone(f, "draft-model"),
        cfg(3),
        CostModel::flat(4),
    )
    .unwrap();
    e.set_policy(policy);
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), max_tokens))
            .unwrap();
    }
    let out = collect(e.run_to_completion().unwrap());
    (out, e.totals().clone())
}

/// A policy that plans zero-budget steps ahead except every third step, and counts the drafted
/// rows it is shown.
struct PlansZero {
    steps: usize,
    shown: Arc<std::sync::atomic::AtomicUsize>,
}

impl specdec::VerifyPolicy for PlansZero {
    fn name(&self) -> &str {
        "plans-zero"
    }
    fn select(&mut self, conf: &[&[f32]], _other: usize, _plain: usize, _kv: usize) -> Vec<usize> {
        self.shown
            .fetch_add(conf.len(), std::sync::atomic::Ordering::Relaxed);
        conf.iter().map(|c| c.len()).collect()
    }
    fn planned(&mut self) -> Option<usize> {
        self.steps += 1;
        (self.steps % 3 != 0).then_some(0)
    }
}

#[test]
fn a_zero_budget_planned_ahead_skips_drafting_and_keeps_greedy_parity() {
    let f = fixture();
    let ps = prompts(&f, 6);
    let run = |policy: Option<PlansZero>| {
        with_policy(
            &f,
            &ps,
            20,
            policy.map(|p| Box::new(p) as Box<dyn specdec::VerifyPolicy>),
        )
    };
    let (plain, _) = run(None);
    let shown = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (with, totals) = run(Some(PlansZero {
        steps: 0,
        shown: shown.clone(),
    }));
    for (id, (toks, _, _)) in &plain {
        assert_eq!(&with[id].0, toks, "request {id}");
    }
    // Only every third decode step drafted: far fewer verification calls than decode calls.
    assert!(totals.spec_calls > 0, "the unplanned steps drafted");
    assert!(
        totals.spec_calls * 2 < totals.target_calls,
        "{} of {} calls drafted",
        totals.spec_calls,
        totals.target_calls
    );
    assert!(shown.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

/// A policy that plans a small positive budget for every step and as many drafting requests,
/// logging how many requests drafted.
struct PlansSmall {
    budget: usize,
    widths: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl specdec::VerifyPolicy for PlansSmall {
    fn name(&self) -> &str {
        "plans-small"
    }
    fn select(&mut self, conf: &[&[f32]], _other: usize, _plain: usize, _kv: usize) -> Vec<usize> {
        if let Ok(mut w) = self.widths.lock() {
            w.push(conf.len());
        }
        conf.iter().map(|c| c.len()).collect()
    }
    fn planned(&mut self) -> Option<usize> {
        Some(self.budget)
    }
    fn draft_width(&self, k: usize) -> usize {
        k
    }
}

#[test]
fn a_planned_budget_drafts_for_as_many_requests_as_the_policy_says() {
    let f = fixture();
    let ps = prompts(&f, 6);
    let run = |policy: Option<PlansSmall>| {
        with_policy(
            &f,
            &ps,
            16,
            policy.map(|p| Box::new(p) as Box<dyn specdec::VerifyPolicy>),
        )
        .0
    };
    let plain = run(None);
    let widths = Arc::new(std::sync::Mutex::new(Vec::new()));
    let with = run(Some(PlansSmall {
        budget: 2,
        widths: widths.clone(),
    }));
    for (id, (toks, _, _)) in &plain {
        assert_eq!(&with[id].0, toks, "request {id}");
    }
    let w = widths.lock().unwrap().clone();
    // Six requests decode together; a budget of 2 drafts for two of them at a time.
    assert!(w.contains(&2), "{w:?}");
    assert!(w.iter().all(|&n| n <= 2), "{w:?}");
}

/// A policy that verifies none of the drafts on every other step and one on the others.
struct TrimsHard {
    calls: usize,
}

impl specdec::VerifyPolicy for TrimsHard {
    fn name(&self) -> &str {
        "trims-hard"
    }
    fn select(&mut self, conf: &[&[f32]], _other: usize, _plain: usize, _kv: usize) -> Vec<usize> {
        self.calls += 1;
        let keep = self.calls % 2;
        conf.iter().map(|c| c.len().min(keep)).collect()
    }
}

/// The draft model, recording each block it drafts (request, context length, drafts) and each
/// verdict the engine hands back (request, context length, drafts verified).
struct Verdicts {
    inner: DraftModelProposer,
    log: Arc<std::sync::Mutex<(Vec<(u64, usize, usize)>, Vec<(u64, usize, usize)>)>>,
}

impl Proposer for Verdicts {
    fn name(&self) -> &str {
        "verdicts"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        let blocks = self.inner.propose(reqs)?;
        if let Ok(mut l) = self.log.lock() {
            for (r, b) in reqs.iter().zip(&blocks) {
                l.0.push((r.id, r.context.len(), b.tokens.len()));
            }
        }
        Ok(blocks)
    }
    fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
        self.inner.commit(id, context)
    }
    fn verified(&mut self, id: u64, at: usize, k: usize) {
        if let Ok(mut l) = self.log.lock() {
            l.1.push((id, at, k));
        }
    }
    fn finish(&mut self, id: u64) {
        self.inner.finish(id)
    }
}

/// Every drafted block gets a verdict with how many of its drafts the policy left to verify
/// (here none or one of three): a drafter that infers its acceptance from the committed context
/// needs it not to count the rest as rejected. And a trimmed block costs the draft model
/// nothing on the next step.
#[test]
fn the_proposer_hears_how_many_drafts_of_each_block_were_verified() {
    let f = fixture();
    let ps = prompts(&f, 4);
    let log = Arc::new(std::sync::Mutex::new((Vec::new(), Vec::new())));
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        Box::new(Verdicts {
            inner: draft_model(&f, 4096),
            log: log.clone(),
        }),
        cfg(3),
        CostModel::flat(4),
    )
    .unwrap();
    e.set_policy(Some(Box::new(TrimsHard { calls: 0 })));
    for (i, p) in ps.iter().enumerate() {
        e.add(Request::new(i as u64, p.clone(), 20)).unwrap();
    }
    let got = collect(e.run_to_completion().unwrap());
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(got[&(i as u64)].0, plain_greedy(&f, p, 20), "prompt {i}");
    }
    let (drafted, verdicts) = log.lock().unwrap().clone();
    // Every block is drafted whole: after a block trimmed to none whose first draft the
    // target's token matched, the draft model's context ended inside what it had fed, and it
    // drafted nothing on the next step.
    assert!(drafted.iter().all(|d| d.2 > 0), "{drafted:?}");
    // One verdict per drafted block, in order, for the same request and context length.
    assert_eq!(drafted.len(), verdicts.len());
    for (d, v) in drafted.iter().zip(&verdicts) {
        assert_eq!((d.0, d.1), (v.0, v.1));
        assert!(v.2 <= d.2.min(1), "{d:?} {v:?}");
    }
    assert!(
        verdicts.iter().any(|v| v.2 == 0) && verdicts.iter().any(|v| v.2 == 1),
        "{drafted:?} {verdicts:?}"
    );
}

/// N-gram lookup that also offers its drafts as free ones, counting both kinds of call.
struct FreeLookup {
    inner: Box<dyn Proposer>,
    calls: Arc<std::sync::Mutex<(usize, usize)>>,
}

impl Proposer for FreeLookup {
    fn name(&self) -> &str {
        "free-lookup"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        if let Ok(mut c) = self.calls.lock() {
            c.0 += 1;
        }
        self.inner.propose(reqs)
    }
    fn has_free_drafts(&self) -> bool {
        true
    }
    fn propose_free(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        if let Ok(mut c) = self.calls.lock() {
            c.1 += 1;
        }
        self.inner.propose(reqs)
    }
}

#[test]
fn steps_planned_without_drafting_verify_free_drafts_and_keep_greedy_parity() {
    let f = fixture();
    let ps = prompts(&f, 6);
    let run = |proposer: Box<dyn Proposer>, policy: Option<PlansZero>| {
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            proposer,
            cfg(3),
            CostModel::flat(4),
        )
        .unwrap();
        e.set_policy(policy.map(|p| Box::new(p) as Box<dyn specdec::VerifyPolicy>));
        for (i, p) in ps.iter().enumerate() {
            e.add(Request::new(i as u64, p.clone(), 24)).unwrap();
        }
        let out = collect(e.run_to_completion().unwrap());
        (out, e.totals().clone())
    };
    let (plain, _) = run(Box::new(NoProposer), None);
    let plans = || PlansZero {
        steps: 0,
        shown: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
    };
    let (_, costly) = run(Box::new(NgramProposer::default()), Some(plans()));
    let calls = Arc::new(std::sync::Mutex::new((0, 0)));
    let (with, free) = run(
        Box::new(FreeLookup {
            inner: Box::new(NgramProposer::default()),
            calls: calls.clone(),
        }),
        Some(plans()),
    );
    for (id, (toks, _, _)) in &plain {
        assert_eq!(&with[id].0, toks, "request {id}");
    }
    let (full, cheap) = *calls.lock().unwrap();
    // Two steps in three are planned at zero: those ask for free drafts only.
    assert!(
        full > 0 && cheap > full,
        "{full} full calls, {cheap} free ones"
    );
    assert!(
        free.spec_calls > costly.spec_calls,
        "free drafts were verified on zero-planned steps ({} against {} verifying calls)",
        free.spec_calls,
        costly.spec_calls
    );
}

/// Plans a zero budget on every step except every `every`-th (0: never), which is a probe
/// limited to one request; records (requests drafting, plain requests) of each drafting step.
struct ProbesOne {
    every: usize,
    steps: usize,
    probing: bool,
    widths: Arc<std::sync::Mutex<Vec<(usize, usize)>>>,
    drafted: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl specdec::VerifyPolicy for ProbesOne {
    fn name(&self) -> &str {
        "probes-one"
    }
    fn select(&mut self, conf: &[&[f32]], _other: usize, plain: usize, _kv: usize) -> Vec<usize> {
        if !conf.is_empty() {
            if let Ok(mut w) = self.widths.lock() {
                w.push((conf.len(), plain));
            }
            if let Ok(mut d) = self.drafted.lock() {
                d.extend(conf.iter().map(|c| c.len()));
            }
        }
        conf.iter().map(|c| c.len()).collect()
    }
    fn planned(&mut self) -> Option<usize> {
        self.steps += 1;
        self.probing = self.every > 0 && self.steps % self.every == 0;
        (!self.probing).then_some(0)
    }
    fn probe(&self) -> Option<(usize, usize)> {
        self.probing.then_some((1, 2))
    }
}

#[test]
fn a_zero_plan_leaves_the_token_budget_to_prefill_and_a_probe_drafts_a_short_block_for_one_request()
{
    let f = fixture();
    let ps = prompts(&f, 8);
    // A tight token budget: decoding requests that reserved room for γ drafts they will not
    // make would starve the prefill chunks (and the other decodes) of the step.
    let run = |p: Box<dyn Proposer>, gamma: usize, policy: Option<ProbesOne>| {
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            p,
            EngineConfig {
                max_batch_tokens: 24,
                max_running: 8,
                prefill_chunk: 8,
                ..cfg(gamma)
            },
            CostModel::flat(6),
        )
        .unwrap();
        e.set_policy(policy.map(|p| Box::new(p) as Box<dyn specdec::VerifyPolicy>));
        for (i, p) in ps.iter().enumerate() {
            e.add(Request::new(i as u64, p.clone(), 12)).unwrap();
        }
        let out = collect(e.run_to_completion().unwrap());
        (out, e.steps)
    };
    let policy = |every| ProbesOne {
        every,
        steps: 0,
        probing: false,
        widths: Arc::new(std::sync::Mutex::new(Vec::new())),
        drafted: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    let (plain, plain_steps) = run(Box::new(specdec::proposer::NoProposer), 0, None);
    let (zero, zero_steps) = run(proposer_clone(&f, "draft-model"), 5, Some(policy(0)));
    assert_eq!(
        zero_steps, plain_steps,
        "a zero plan must shape the batch exactly like plain decoding"
    );
    let p = policy(4);
    let widths = p.widths.clone();
    let drafted_log = p.drafted.clone();
    let (probed, probe_steps) = run(proposer_clone(&f, "draft-model"), 5, Some(p));
    let w = widths.lock().unwrap().clone();
    let drafted = drafted_log.lock().unwrap().clone();
    assert!(!w.is_empty(), "probes drafted");
    assert!(w.iter().all(|&(n, _)| n == 1), "probe widths {w:?}");
    assert!(
        drafted.iter().all(|&k| k <= 2) && drafted.contains(&2),
        "probe blocks {drafted:?}"
    );
    // While several requests decode, the probe's batch carries the others as plain requests.
    assert!(w.iter().any(|&(_, plain)| plain > 0), "{w:?}");
    assert!(
        probe_steps <= plain_steps + plain_steps / 4,
        "probing took {probe_steps} steps, plain decoding {plain_steps}"
    );
    // Free drafts on zero-planned steps take only the room the prefill chunks leave: the
    // batch keeps plain decoding's shape and verifies drafts on top, so no more steps.
    let free = Box::new(FreeLookup {
        inner: proposer_clone(&f, "draft-model"),
        calls: Arc::new(std::sync::Mutex::new((0, 0))),
    });
    let (freed, free_steps) = run(free, 5, Some(policy(0)));
    assert!(
        free_steps < plain_steps,
        "with free drafts {free_steps} steps, plain decoding {plain_steps}"
    );
    for (id, (toks, _, _)) in &plain {
        assert_eq!(&zero[id].0, toks, "request {id}");
        assert_eq!(&probed[id].0, toks, "request {id}");
        assert_eq!(&freed[id].0, toks, "request {id}");
    }
}

/// Draft-model drafting that also asks for the target's layer-0 features (window `window`),
/// logging every hand-over: (request, first position, rows), and every drafting call's
/// requests in `log`, in order with the hand-overs.
struct Watches {
    inner: Box<dyn Proposer>,
    window: usize,
    row: usize,
    seen: Arc<std::sync::Mutex<Vec<(u64, usize, usize)>>>,
    log: Arc<std::sync::Mutex<Vec<Watched>>>,
}

#[derive(Clone, Debug, PartialEq)]
enum Watched {
    Handed(u64),
    Drafted(Vec<u64>),
}

impl Proposer for Watches {
    fn name(&self) -> &str {
        "watches"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        if let Ok(mut l) = self.log.lock() {
            l.push(Watched::Drafted(reqs.iter().map(|r| r.id).collect()));
        }
        self.inner.propose(reqs)
    }
    fn feature_layers(&self) -> Vec<usize> {
        vec![0]
    }
    fn feature_window(&self) -> usize {
        self.window
    }
    fn observe(&mut self, id: u64, start: usize, rows: &[f32]) -> specdec::Result<()> {
        assert_eq!(rows.len() % self.row, 0);
        if let Ok(mut s) = self.seen.lock() {
            s.push((id, start, rows.len() / self.row));
        }
        if let Ok(mut l) = self.log.lock() {
            l.push(Watched::Handed(id));
        }
        Ok(())
    }
}

/// Plans zero budgets with a one-request probe every `every` steps; wants features only
/// within `window` steps of the next probe when `gates`, for the probe's request alone when
/// also `probe_only`.
struct ProbesEvery {
    every: usize,
    steps: usize,
    probing: bool,
    gates: bool,
    probe_only: bool,
    probe_steps: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl specdec::VerifyPolicy for ProbesEvery {
    fn name(&self) -> &str {
        "probes-every"
    }
    fn select(&mut self, conf: &[&[f32]], _other: usize, _plain: usize, _kv: usize) -> Vec<usize> {
        if !conf.is_empty()
            && let Ok(mut p) = self.probe_steps.lock()
        {
            p.push(self.steps);
        }
        conf.iter().map(|c| c.len()).collect()
    }
    fn planned(&mut self) -> Option<usize> {
        self.steps += 1;
        self.probing = self.steps % self.every == 0;
        (!self.probing).then_some(0)
    }
    fn probe(&self) -> Option<(usize, usize)> {
        self.probing.then_some((1, 2))
    }
    fn drafting_within(&self, steps: usize) -> bool {
        !self.gates || self.every - self.steps % self.every <= steps
    }
    fn probe_only_within(&self, steps: usize) -> Option<usize> {
        (self.gates && self.probe_only && self.drafting_within(steps)).then_some(1)
    }
}

#[test]
fn target_features_are_captured_only_where_the_policy_may_draft_soon() {
    let f = fixture();
    let ps = prompts(&f, 4);
    let (plain, _) = with_policy(&f, &ps, 24, None);
    let d = f.target.cfg.d_model;
    let run_w = |gates: bool, probe_only: bool, window: usize| {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let probe_steps = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            Box::new(Watches {
                inner: proposer_clone(&f, "draft-model"),
                window,
                row: d,
                seen: seen.clone(),
                log: log.clone(),
            }),
            cfg(3),
            CostModel::flat(4),
        )
        .unwrap();
        e.set_policy(Some(Box::new(ProbesEvery {
            every: 7,
            steps: 0,
            probing: false,
            gates,
            probe_only,
            probe_steps: probe_steps.clone(),
        })));
        for (i, p) in ps.iter().enumerate() {
            e.add(Request::new(i as u64, p.clone(), 24)).unwrap();
        }
        let out = collect(e.run_to_completion().unwrap());
        let seen = seen.lock().unwrap().clone();
        let log = log.lock().unwrap().clone();
        let probes = probe_steps.lock().unwrap().clone();
        (out, seen, probes, log)
    };
    let run = |gates: bool, probe_only: bool| run_w(gates, probe_only, 2);
    let rows = |s: &[(u64, usize, usize)]| s.iter().map(|x| x.2).sum::<usize>();
    let (all, seen_all, _, _) = run(false, false);
    let (gated, seen_gated, probes, _) = run(true, false);
    let (sentinel, seen_sentinel, _, log) = run(true, true);
    for (id, (toks, _, _)) in &plain {
        assert_eq!(&all[id].0, toks, "request {id}");
        assert_eq!(&gated[id].0, toks, "request {id}");
        assert_eq!(&sentinel[id].0, toks, "request {id}");
    }
    // Probes alone ahead: between two drafting calls one request (the sentinel) is handed
    // features, and the probe drafts for it while it decodes.
    let (mut handed, mut probes_on_sentinels) = (Vec::new(), 0);
    for w in &log {
        match w {
            Watched::Handed(id) => {
                if !handed.contains(id) {
                    handed.push(*id);
                }
            }
            Watched::Drafted(ids) => {
                assert!(handed.len() <= 1, "features for {handed:?} before {ids:?}");
                if !handed.is_empty() && ids == &handed {
                    probes_on_sentinels += 1;
                }
                handed.clear();
            }
        }
    }
    assert!(probes_on_sentinels >= 2, "{log:?}");
    // A proposer that states no window is handed every position, probes or not.
    let (unwindowed, seen_unwindowed, _, _) = run_w(true, true, usize::MAX);
    assert_eq!(rows(&seen_unwindowed), rows(&seen_all));
    for (id, (toks, _, _)) in &plain {
        assert_eq!(&unwindowed[id].0, toks, "request {id}");
    }
    assert!(
        rows(&seen_sentinel) * 2 < rows(&seen_gated),
        "{} rows to sentinels, {} to all",
        rows(&seen_sentinel),
        rows(&seen_gated)
    );
    // Without gating every committed position is handed over; gated, about 2 steps in 7.
    assert!(!probes.is_empty(), "probes drafted");
    assert!(
        rows(&seen_gated) * 2 < rows(&seen_all),
        "{} rows gated, {} always",
        rows(&seen_gated),
        rows(&seen_all)
    );
    // Gated or not, a request's positions arrive in order, never twice.
    for seen in [&seen_all, &seen_gated, &seen_sentinel] {
        let mut next: HashMap<u64, usize> = HashMap::new();
        for &(id, start, n) in seen.iter() {
            let at = next.entry(id).or_insert(0);
            assert!(start >= *at, "request {id}: rows from {start} after {at}");
            *at = start + n;
        }
    }
}

/// A proposer that claims every draft survives with probability 0.95, and spoils the first token
/// of two blocks in three (the tiny draft model alone agrees with the tiny target throughout).
struct OverConfident(DraftModelProposer, u64, usize);

impl Proposer for OverConfident {
    fn name(&self) -> &str {
        "over-confident"
    }
    fn propose(
        &mut self,
        reqs: &mut [specdec::proposer::ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::DraftBlock>> {
        let mut out = self.0.propose(reqs)?;
        for b in &mut out {
            self.1 += 1;
            if self.1 % 3 != 0
                && let Some(t) = b.tokens.first_mut()
            {
                *t = (*t + 1) % self.2 as u32;
            }
            b.confidence = Some(vec![0.95; b.tokens.len()]);
            b.conf_inputs = Some(vec![[0.0; specdec::proposer::CONF_INPUTS]; b.tokens.len()]);
        }
        Ok(out)
    }
    fn commit(&mut self, id: u64, context: &[u32]) -> specdec::Result<()> {
        self.0.commit(id, context)
    }
    fn finish(&mut self, id: u64) {
        self.0.finish(id)
    }
}

#[test]
fn served_confidences_learn_the_acceptance_the_verdicts_show() {
    let f = fixture();
    let ps = prompts(&f, 48);
    let run = |recal: Option<specdec::recal::RecalConfig>| {
        let inner = draft_model(&f, 4096);
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            Box::new(OverConfident(inner, 0, f.target.cfg.vocab_size)),
            EngineConfig {
                recal,
                max_running: 4,
                ..cfg(3)
            },
            CostModel::flat(4),
        )
        .unwrap();
        let mut blocks = Vec::new();
        let mut tokens = HashMap::new();
        for (i, p) in ps.iter().enumerate() {
            e.add(Request::new(i as u64, p.clone(), 40)).unwrap();
        }
        while !e.is_idle() {
            for ev in e.step().unwrap() {
                match ev {
                    Event::Finished { id, metrics, .. } => blocks.push((id, metrics.conf_blocks)),
                    Event::Tokens { id, tokens: t, .. } => {
                        tokens.entry(id).or_insert_with(Vec::new).extend(t)
                    }
                    Event::Failed { id, error } => panic!("request {id} failed: {error}"),
                }
            }
        }
        blocks.sort_by_key(|b| b.0);
        let blocks: Vec<_> = blocks.into_iter().flat_map(|b| b.1).collect();
        (blocks, tokens)
    };
    let (off, plain) = run(None);
    let (on, served_tokens) = run(Some(specdec::recal::RecalConfig::default()));
    // What is served never changes what is generated.
    assert_eq!(plain, served_tokens);
    for b in &off {
        assert_eq!(
            b.conf, b.base,
            "without recalibration the proposer's confidences are served"
        );
    }
    // Position 1 of the last half of the blocks: served confidence against the acceptance seen.
    let on: Vec<_> = on.into_iter().filter(|b| !b.conf.is_empty()).collect();
    let late = &on[on.len() / 2..];
    let rate = late.iter().filter(|b| b.accepted > 0).count() as f64 / late.len() as f64;
    let served = late.iter().map(|b| b.conf[0] as f64).sum::<f64>() / late.len() as f64;
    assert!(late.iter().all(|b| b.base[0] == 0.95));
    assert!(
        rate < 0.6,
        "the drafts are accepted at {rate}, far from the claimed 0.95"
    );
    assert!(
        (served - rate).abs() < 0.06,
        "served {served:.3} against an acceptance of {rate:.3} over {} blocks",
        late.len()
    );
}

/// Requests sharing a long prompt start, and the next turn of a finished one, reuse cached KV
/// blocks (reported per request), and every output is what plain decoding gives: greedy token
/// for token against `generate`, sampled token for token against the same engine without the
/// cache (same seeds); no block leaks, and the cache is allocatable.
#[test]
fn prefix_cache_reuses_shared_prompts_and_changes_no_output() {
    let f = fixture();
    let (_, mut ps) = shared_system_prompts(&f, 6, 40);
    assert!(ps[0].len() > 48, "prompt of {} tokens", ps[0].len());
    // Two prompts that differ from the others in one token of the system prompt: the last
    // of the first block (nothing may be shared), a middle one of the second (one block).
    let other = |at: usize| {
        let mut p = ps[1].clone();
        p[at] = if p[at] == 5 { 6 } else { 5 };
        p
    };
    let (a, b) = (other(15), other(20));
    ps.extend([a, b]);
    let n = ps.len();
    let plain = |p: &[u32], n: usize| plain_greedy(&f, p, n);
    for name in ["none", "ngram", "draft-model"] {
        let gamma = if name == "none" { 0 } else { 3 };
        let engine = |on: bool| {
            Engine::with_cost(
                f.target.clone(),
                Some(f.tok.clone()),
                proposer_clone(&f, name),
                EngineConfig {
                    prefix_caching: on,
                    ..cfg(gamma)
                },
                CostModel::flat(gamma + 1),
            )
            .unwrap()
        };
        let mut e = engine(true);
        let mut off = engine(false);
        let run = |e: &mut Engine, reqs: Vec<Request>| {
            for r in reqs {
                e.add(r).unwrap();
            }
            let events = e.run_to_completion().unwrap();
            let cached: HashMap<u64, usize> = events
                .iter()
                .filter_map(|ev| match ev {
                    Event::Finished { id, metrics, .. } => Some((*id, metrics.cached_tokens)),
                    _ => None,
                })
                .collect();
            (collect(events), cached)
        };
        // First one alone: nothing cached yet.
        let (got, cached) = run(&mut e, vec![Request::new(0, ps[0].clone(), 12)]);
        assert_eq!(cached[&0], 0, "{name}");
        assert_eq!(got[&0].0, plain(&ps[0], 12), "{name}");
        // The rest together: each finds the shared system prompt (whole blocks of it).
        let reqs: Vec<Request> = (1..ps.len())
            .map(|i| Request::new(i as u64, ps[i].clone(), 12))
            .collect();
        let (got, cached) = run(&mut e, reqs);
        for (i, p) in ps.iter().enumerate().skip(1) {
            let c = cached[&(i as u64)];
            match n - i {
                2 => assert_eq!(c, 0, "{name}"),
                1 => assert_eq!(c, 16, "{name}"),
                _ => assert!(c >= 32, "{name} prompt {i}: {cached:?}"),
            }
            assert_eq!(got[&(i as u64)].0, plain(p, 12), "{name} prompt {i}");
        }
        // The next turn of request 0: its prompt and answer come from the cache.
        let mut turn = ps[0].clone();
        turn.extend(plain(&ps[0], 12));
        turn.extend(f.tok.encode("then in there ").unwrap());
        let (got, cached) = run(&mut e, vec![Request::new(10, turn.clone(), 10)]);
        assert!(cached[&10] >= ps[0].len() - 16, "{name}: {cached:?}");
        assert_eq!(got[&10].0, plain(&turn, 10), "{name} next turn");
        // Sampled requests: the same tokens as without the cache.
        ps.push(turn);
        for (i, p) in ps.iter().enumerate() {
            let mut r = Request::new(100 + i as u64, p.clone(), 10);
            r.params.temperature = 0.9;
            r.seed = 7 + i as u64;
            let (a, _) = run(&mut e, vec![r.clone()]);
            let (b, cached) = run(&mut off, vec![r]);
            assert_eq!(cached[&(100 + i as u64)], 0);
            assert_eq!(
                a[&(100 + i as u64)].0,
                b[&(100 + i as u64)].0,
                "{name} sampled {i}"
            );
        }
        ps.pop();
        let (queried, hit) = e.prefix_cache_stats();
        assert!(hit > 0 && hit < queried, "{name}: {hit} of {queried}");
        e.check_kv().unwrap();
        assert_eq!(e.kv_free_blocks(), 8192 / 16);
        // Cleared, nothing is found any more.
        e.clear_prefix_cache();
        let (_, cached) = run(&mut e, vec![Request::new(20, ps[1].clone(), 4)]);
        assert_eq!(cached[&20], 0, "{name}");
        e.check_kv().unwrap();
    }
}

/// Admission charges a cached prompt prefix once: requests sharing a long system prompt run
/// side by side in a cache that holds one whole request and not two (charged whole, they ran
/// one at a time), with every allocation of the admitted ones succeeding, the same tokens as
/// plain greedy decoding, and every block back at the end.
#[test]
fn shared_prompt_prefixes_are_charged_once_at_admission() {
    let f = fixture();
    let (system, ps) = shared_system_prompts(&f, 6, 80);
    let max_tokens = 16;
    let want: Vec<Vec<u32>> = ps.iter().map(|p| plain_greedy(&f, p, max_tokens)).collect();
    for (name, gamma) in [("none", 0), ("ngram", 3), ("draft-model", 3)] {
        let bs = 16;
        let longest = ps.iter().map(|p| p.len()).max().unwrap();
        // The engine's footprint of the longest request, in blocks (a block of slack): the
        // cache holds one and a half of those, so no two requests fit charged whole.
        let whole = (longest + max_tokens + gamma + 1 + bs) / bs;
        let shared = f.tok.encode(&system).unwrap().len() / bs;
        assert!(shared >= whole / 2, "{shared} shared blocks of {whole}");
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            proposer_clone(&f, name),
            EngineConfig {
                prefix_caching: true,
                kv_tokens: (whole + whole / 2) * bs,
                block_size: bs,
                ..cfg(gamma)
            },
            CostModel::flat(gamma + 1),
        )
        .unwrap();
        for (i, p) in ps.iter().enumerate() {
            e.add(Request::new(i as u64, p.clone(), max_tokens))
                .unwrap();
        }
        let (mut events, mut most) = (Vec::new(), 0);
        while !e.is_idle() {
            events.extend(e.step().unwrap());
            most = most.max(e.num_running());
            e.check_invariants().unwrap();
        }
        assert!(most >= 3, "{name}: at most {most} ran at once");
        let cached: Vec<(u64, usize)> = events
            .iter()
            .filter_map(|ev| match ev {
                Event::Finished { id, metrics, .. } => Some((*id, metrics.cached_tokens)),
                _ => None,
            })
            .collect();
        assert!(
            cached.iter().filter(|c| c.1 >= bs).count() >= ps.len() - 1,
            "{name}: cached {cached:?}, whole {whole}, shared {shared}, lens {:?}",
            ps.iter().map(|p| p.len()).collect::<Vec<_>>()
        );
        let got = collect(events);
        for (i, w) in want.iter().enumerate() {
            assert_eq!(&got[&(i as u64)].0, w, "{name} prompt {i}");
        }
        e.check_kv().unwrap();
        assert_eq!(e.kv_free_blocks(), e.kv_total_blocks(), "{name}");
    }
}

/// The draft model's own cache holds a prompt prefix two requests share once: with room for
/// one context and a half, the second request drafts (the same tokens as with room to spare)
/// instead of failing its forward and sitting out.
#[test]
fn the_draft_models_cache_shares_prompt_prefixes() {
    let f = fixture();
    let (_, ps) = shared_system_prompts(&f, 2, 80);
    let longest = ps.iter().map(|p| p.len()).max().unwrap();
    let proposer = |kv: usize| draft_model(&f, kv);
    let (mut tight, mut roomy) = (proposer(longest * 3 / 2), proposer(1 << 16));
    let greedy = SamplingParams::greedy();
    let draft = |p: &mut DraftModelProposer, id: u64| {
        let mut rng = kernels::rng::Rng::new(id);
        let mut reqs = [specdec::proposer::ProposeReq {
            id,
            context: &ps[id as usize],
            k: 3,
            params: &greedy,
            rng: &mut rng,
        }];
        p.propose(&mut reqs).unwrap().remove(0).tokens
    };
    for id in [0, 1] {
        let (a, b) = (draft(&mut tight, id), draft(&mut roomy, id));
        assert_eq!(a.len(), 3, "request {id} drafted {a:?}");
        assert_eq!(a, b, "request {id}");
    }
    // Finished, a request's blocks stay cached for the next turn, and the cache is whole.
    tight.finish(0);
    tight.finish(1);
    assert_eq!(draft(&mut tight, 0).len(), 3);
    // Arriving in one call, the second waits a call for the first's blocks, then both draft
    // what they draft alone.
    let mut burst = proposer(longest * 3 / 2);
    let both = |p: &mut DraftModelProposer| {
        let (mut r0, mut r1) = (kernels::rng::Rng::new(0), kernels::rng::Rng::new(1));
        let mut reqs = [
            specdec::proposer::ProposeReq {
                id: 0,
                context: &ps[0],
                k: 3,
                params: &greedy,
                rng: &mut r0,
            },
            specdec::proposer::ProposeReq {
                id: 1,
                context: &ps[1],
                k: 3,
                params: &greedy,
                rng: &mut r1,
            },
        ];
        let b = p.propose(&mut reqs).unwrap();
        (b[0].tokens.clone(), b[1].tokens.clone())
    };
    let (a0, a1) = both(&mut burst);
    assert_eq!((a0.len(), a1.len()), (3, 0));
    let mut alone = proposer(1 << 16);
    assert_eq!(a0, draft(&mut alone, 0));
    let b1 = draft(&mut burst, 1);
    assert_eq!(b1.len(), 3);
    assert_eq!(b1, draft(&mut alone, 1));
}

/// Log-probabilities reported per output token are the target's raw log-softmax at that
/// position (checked against one forward over prompt + output), with the top alternatives in
/// order; greedy tokens are their position's most likely; speculation does not change them;
/// sampled tokens get theirs too; too many alternatives are refused.
#[test]
fn logprobs_are_the_targets_raw_log_softmax_with_or_without_speculation() {
    let f = fixture();
    let ps = prompts(&f, 6);
    let reference = |p: &[u32], out: &[u32]| -> Vec<specdec::TokenLogprob> {
        let mut all = p.to_vec();
        all.extend_from_slice(out);
        let o = logits_all(&f.target, &all);
        let v = o.vocab;
        out.iter()
            .enumerate()
            .map(|(i, &t)| {
                let r = p.len() - 1 + i;
                specdec::TokenLogprob::of(&o.logits[r * v..(r + 1) * v], t, 3)
            })
            .collect()
    };
    for (name, gamma) in [("none", 0usize), ("ngram", 3), ("draft-model", 3)] {
        let mut e = Engine::with_cost(
            f.target.clone(),
            Some(f.tok.clone()),
            proposer_clone(&f, name),
            cfg(gamma),
            CostModel::flat(gamma + 1),
        )
        .unwrap();
        for (i, p) in ps.iter().enumerate() {
            let mut r = Request::new(i as u64, p.clone(), 16);
            r.logprobs = Some(3);
            if i % 2 == 1 {
                r.params.temperature = 0.8;
            }
            e.add(r).unwrap();
        }
        // One without: nothing reported.
        e.add(Request::new(99, ps[0].clone(), 8)).unwrap();
        let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut lps: HashMap<u64, Vec<specdec::TokenLogprob>> = HashMap::new();
        for ev in e.run_to_completion().unwrap() {
            if let Event::Tokens {
                id,
                tokens,
                logprobs,
                ..
            } = ev
            {
                if id != 99 {
                    assert_eq!(logprobs.len(), tokens.len(), "{name}");
                } else {
                    assert!(logprobs.is_empty());
                }
                toks.entry(id).or_default().extend(tokens);
                lps.entry(id).or_default().extend(logprobs);
            }
        }
        for (i, p) in ps.iter().enumerate() {
            let (out, got) = (&toks[&(i as u64)], &lps[&(i as u64)]);
            let want = reference(p, out);
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g.logprob - w.logprob).abs() < 1e-3,
                    "{name} prompt {i} token {j}: {g:?} vs {w:?}"
                );
                assert_eq!(g.top.len(), 3);
                assert!(g.top.windows(2).all(|x| x[0].1 >= x[1].1));
                for ((_, gl), (_, wl)) in g.top.iter().zip(&w.top) {
                    assert!((gl - wl).abs() < 1e-3, "{name} {i}/{j}");
                }
                // The same alternatives, wherever no two are within rounding of each other.
                if w.top.windows(2).all(|x| x[0].1 - x[1].1 > 1e-3) {
                    let ids =
                        |t: &specdec::TokenLogprob| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
                    assert_eq!(ids(g), ids(w), "{name} {i}/{j}");
                }
                assert!(g.logprob <= 0.0 && g.logprob <= g.top[0].1 + 1e-6);
                if i % 2 == 0 {
                    // Greedy: the token is its position's most likely.
                    assert_eq!(g.top[0].0, out[j], "{name} {i}/{j}");
                    assert!((g.top[0].1 - g.logprob).abs() < 1e-6);
                }
            }
        }
        let mut r = Request::new(200, ps[0].clone(), 4);
        r.logprobs = Some(specdec::MAX_TOP_LOGPROBS + 1);
        assert!(e.add(r).is_err());
        e.check_kv().unwrap();
    }
}

/// Prompt log-probabilities (OpenAI `echo`): every prompt token after the first gets the
/// target's log-softmax at its position, gathered across prefill chunks and sent with the
/// request's first event; such a request computes its whole prompt even when it is cached,
/// and its output is plain greedy's.
#[test]
fn prompt_logprobs_cover_every_prompt_token_across_chunks() {
    let f = fixture();
    let mut prompt = prompts(&f, 9).concat();
    prompt.truncate(40);
    assert!(prompt.len() > 20);
    let mut e = Engine::with_cost(
        f.target.clone(),
        Some(f.tok.clone()),
        proposer_clone(&f, "ngram"),
        EngineConfig {
            prefill_chunk: 8,
            prefix_caching: true,
            ..cfg(3)
        },
        CostModel::flat(4),
    )
    .unwrap();
    // Cache the prompt first.
    e.add(Request::new(1, prompt.clone(), 4)).unwrap();
    e.run_to_completion().unwrap();
    let mut r = Request::new(2, prompt.clone(), 6);
    r.logprobs = Some(2);
    r.prompt_logprobs = Some(2);
    e.add(r).unwrap();
    let (mut out, mut lps, mut plps, mut firsts, mut cached) =
        (Vec::new(), Vec::new(), Vec::new(), 0, usize::MAX);
    for ev in e.run_to_completion().unwrap() {
        match ev {
            Event::Tokens {
                tokens,
                logprobs,
                prompt_logprobs,
                ..
            } => {
                if !prompt_logprobs.is_empty() {
                    firsts += 1;
                    assert!(out.is_empty(), "prompt log-probabilities come first");
                }
                out.extend(tokens);
                lps.extend(logprobs);
                plps.extend(prompt_logprobs);
            }
            Event::Finished { metrics, .. } => cached = metrics.cached_tokens,
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
        }
    }
    assert_eq!((firsts, cached), (1, 0));
    let plain = generate(
        &f.target,
        &f.tok,
        &prompt,
        &GenerateParams {
            max_tokens: 6,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap()
    .token_ids;
    assert_eq!(out, plain);
    // Against one forward over prompt + output.
    let mut all = prompt.clone();
    all.extend_from_slice(&out);
    let o = logits_all(&f.target, &all);
    let v = o.vocab;
    assert_eq!(plps.len(), prompt.len() - 1);
    assert_eq!(lps.len(), out.len());
    for (p, got) in plps.iter().chain(&lps).enumerate() {
        let want = specdec::TokenLogprob::of(&o.logits[p * v..(p + 1) * v], all[p + 1], 2);
        assert!((got.logprob - want.logprob).abs() < 1e-3, "position {p}");
        assert_eq!(got.top.len(), 2);
        assert!((got.top[0].1 - want.top[0].1).abs() < 1e-3, "position {p}");
    }
    e.check_kv().unwrap();
}

/// A request the draft model cannot hold (a context past its cache, or past its context
/// length) gets no drafts; the others in the same call get the drafts they get alone.
#[test]
fn a_request_the_draft_model_cannot_hold_costs_the_others_nothing() {
    let f = fixture();
    let greedy = SamplingParams::greedy();
    let mk = |kv: usize| draft_model(&f, kv);
    let small = prompts(&f, 3)[2].clone();
    let long = |n: usize| -> Vec<u32> { small.iter().copied().cycle().take(n).collect() };
    let alone = {
        let mut p = mk(64);
        let mut rng = kernels::rng::Rng::new(1);
        let mut one = [specdec::proposer::ProposeReq {
            id: 2,
            context: &small,
            k: 4,
            params: &greedy,
            rng: &mut rng,
        }];
        p.propose(&mut one).unwrap().remove(0).tokens
    };
    assert_eq!(alone.len(), 4);
    let max_ctx = f.draft.cfg.max_ctx;
    // 70 tokens in a 64-token cache; then a context past the model's.
    for (kv, big) in [(64, long(70)), (4096, long(max_ctx + 5))] {
        let mut p = mk(kv);
        let (mut r1, mut r2) = (kernels::rng::Rng::new(1), kernels::rng::Rng::new(1));
        let mut reqs = [
            specdec::proposer::ProposeReq {
                id: 1,
                context: &big,
                k: 4,
                params: &greedy,
                rng: &mut r1,
            },
            specdec::proposer::ProposeReq {
                id: 2,
                context: &small,
                k: 4,
                params: &greedy,
                rng: &mut r2,
            },
        ];
        let out = p
            .propose(&mut reqs)
            .expect("one request's trouble is not the call's");
        assert!(out[0].tokens.is_empty(), "kv {kv}: {:?}", out[0].tokens);
        assert_eq!(out[1].tokens, alone, "kv {kv}");
    }
    // A context that ends just short of the model's drafts only what fits.
    let mut p = mk(4096);
    let near = long(max_ctx - 1);
    let mut rng = kernels::rng::Rng::new(1);
    let mut one = [specdec::proposer::ProposeReq {
        id: 3,
        context: &near,
        k: 4,
        params: &greedy,
        rng: &mut rng,
    }];
    assert_eq!(p.propose(&mut one).unwrap()[0].tokens.len(), 2);
}
