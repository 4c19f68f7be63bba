//! Tensor parallelism over real TCP links: shard ranks served on loopback, rank 0's forwards
//! against the same model in one piece.

use candle_core::quantized::GgmlDType;
use dspark_runtime::model::{ForwardOptions, ForwardOutput, LogitsMode, SeqInput};
use dspark_runtime::tiny::{TinySpec, tiny_model_path};
use dspark_runtime::tp::{self, TpOptions};
use dspark_runtime::{KvCache, KvDtype, LoadOptions, Model, RuntimeError, SeqId};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn opts(tp: Option<TpOptions>) -> LoadOptions {
    LoadOptions {
        threads: 1,
        tp,
        ..Default::default()
    }
}

/// Starts ranks 1.. of `world` on loopback; their addresses.
fn start_ranks(path: &Path, world: usize) -> Vec<String> {
    start_ranks_with(path, world, opts)
}

/// Starts ranks 1.. of `world` on loopback, each loaded with `o(its shard)`; their addresses.
fn start_ranks_with(
    path: &Path,
    world: usize,
    o: impl Fn(Option<TpOptions>) -> LoadOptions,
) -> Vec<String> {
    (1..world)
        .map(|r| {
            let m = Arc::new(Model::load(path, &o(Some(TpOptions::shard(r, world)))).unwrap());
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let a = l.local_addr().unwrap().to_string();
            std::thread::spawn(move || tp::serve(m, l));
            a
        })
        .collect()
}

fn leader(path: &Path, peers: Vec<String>) -> Result<Model, RuntimeError> {
    lead_with(path, peers, opts)
}

/// Rank 0 over `peers`, loaded with `o(its leader options)`.
fn lead_with(
    path: &Path,
    peers: Vec<String>,
    o: impl Fn(Option<TpOptions>) -> LoadOptions,
) -> Result<Model, RuntimeError> {
    let mut t = TpOptions::leader(peers);
    t.connect_timeout = Duration::from_secs(10);
    t.io_timeout = Duration::from_secs(20);
    Model::load(path, &o(Some(t)))
}

fn fwd(m: &Model, c: &mut KvCache, batch: &[(SeqId, &[u32])]) -> ForwardOutput {
    let inputs: Vec<SeqInput<'_>> = batch
        .iter()
        .map(|&(seq, tokens)| SeqInput {
            seq,
            tokens,
            logits: LogitsMode::All,
        })
        .collect();
    m.forward(c, &inputs, &ForwardOptions::default()).unwrap()
}

/// Waits until `m` links its ranks again (up to 10 s): a rank refuses a leader it was taken
/// from while the leader that took it is linked, so this also waits for that one to be gone.
fn relink(m: &Model) {
    let t0 = std::time::Instant::now();
    loop {
        match m.tp_redial() {
            Ok(_) if m.tp_links().is_some_and(|l| l.up()) => return,
            r => assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the ranks were not linked again: {r:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Another leader takes the ranks at `peers` over and runs a forward through them; it, its
/// cache and its sequence.
fn take_over(path: &Path, peers: Vec<String>) -> (Model, KvCache, SeqId) {
    let other = leader(path, peers).unwrap();
    let mut c = other.new_cache(64, 8).unwrap();
    let s = c.new_seq();
    fwd(&other, &mut c, &[(s, &[9])]);
    (other, c, s)
}

/// Waits (up to 10 s) until `m`'s idle check sees its links gone.
fn wait_down(m: &Model) {
    let t0 = std::time::Instant::now();
    while m.tp_links().is_some_and(|l| l.up()) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the lost link never showed"
        );
        m.tp_check();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One sequence's step, last position's logits.
fn last(
    m: &Model,
    c: &mut KvCache,
    seq: SeqId,
    tokens: &[u32],
) -> Result<ForwardOutput, RuntimeError> {
    m.forward(
        c,
        &[SeqInput {
            seq,
            tokens,
            logits: LogitsMode::Last,
        }],
        &ForwardOptions::default(),
    )
}

/// A serving-like run: two prompts prefilled together, verification windows, rollbacks, a fork
/// in the middle of a block (copy-on-write) and prefix-cache reuse. Returns every logits row.
fn scenario(m: &Model) -> Vec<Vec<f32>> {
    let mut c = m.new_cache(256, 8).unwrap();
    c.set_prefix_caching(true);
    let mut rows = Vec::new();
    let a = c.new_seq();
    let b = c.new_seq();
    let pa: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 200).collect();
    let pb: Vec<u32> = (0..5).map(|i| (i * 11 + 1) % 200).collect();
    rows.push(fwd(m, &mut c, &[(a, &pa), (b, &pb)]).logits);
    for step in 0..4u32 {
        let wa: Vec<u32> = (0..4).map(|j| (step * 13 + j * 5) % 200).collect();
        rows.push(fwd(m, &mut c, &[(a, &wa), (b, &[step + 9])]).logits);
        // Keep 2 of the 4 verified tokens.
        let len = c.len(a).unwrap();
        c.truncate(a, len - 2).unwrap();
    }
    // Fork `a` mid-block and extend both: the shared tail block is copied.
    let len = c.len(a).unwrap();
    assert!(!len.is_multiple_of(8));
    let f = c.fork(a, len).unwrap();
    rows.push(fwd(m, &mut c, &[(f, &[42, 43]), (a, &[44])]).logits);
    // A finished prompt's blocks are found again by a new sequence.
    c.register(b, &[pb.clone(), (9..13).collect::<Vec<u32>>()].concat())
        .unwrap();
    c.remove(b).unwrap();
    let mut again = pb.clone();
    again.extend(9..13u32);
    again.extend([50, 51, 52]);
    let (s, hit) = c.new_seq_with_prefix(&again, 64);
    assert!(hit > 0, "the prefix cache found nothing");
    rows.push(fwd(m, &mut c, &[(s, &again[hit..])]).logits);
    c.check().unwrap();
    rows
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    worst
}

fn argmaxes(rows: &[Vec<f32>], vocab: usize) -> Vec<u32> {
    rows.iter()
        .flat_map(|r| r.chunks(vocab))
        .map(kernels::sampling::argmax)
        .collect()
}

#[test]
fn split_forwards_match_the_whole_model() {
    let q80_qwen = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::qwen2(5)
    };
    // Degree 4 on 2 KV heads: each KV head replicated on two ranks.
    for (spec, name, degree) in [
        (TinySpec::llama(3), "tp-llama", 2),
        (q80_qwen.clone(), "tp-qwen2-q80", 2),
        (q80_qwen, "tp-qwen2-q80", 4),
        // K-quant blocks of 256 cut at 128 columns: each rank holds the whole blocks.
        (TinySpec::qwen2(5), "tp-qwen2-k", 2),
    ] {
        let path = tiny_model_path(&spec, name).unwrap();
        let mut runs = Vec::new();
        for dense in [true, false] {
            let o = |tp| LoadOptions { dense, ..opts(tp) };
            let whole = Model::load(&path, &o(None)).unwrap();
            let want = scenario(&whole);
            let peers = start_ranks_with(&path, degree, o);
            let m = lead_with(&path, peers, o).unwrap();
            assert_eq!(m.tp_degree(), degree);
            let got = scenario(&m);
            // Shares are added in rank order: the same forward twice is the same bits.
            assert_eq!(scenario(&m), got, "{name}: not deterministic");
            assert_eq!(
                argmaxes(&got, whole.cfg.vocab_size),
                argmaxes(&want, whole.cfg.vocab_size),
                "{name}"
            );
            runs.push((max_rel_diff(&got, &want), want, got));
        }
        let (dense_diff, dense_want, _) = &runs[0];
        let (quant_diff, quant_want, quant_got) = &runs[1];
        let noise = max_rel_diff(quant_want, dense_want);
        let split_noise = max_rel_diff(quant_got, dense_want);
        eprintln!(
            "{name} over {degree}: split vs whole {dense_diff:.2e} in f32, {quant_diff:.2e} \
             quantized; against the f32 weights: whole {noise:.2e}, split {split_noise:.2e}"
        );
        // In f32 the split only adds partial sums in another order.
        assert!(
            *dense_diff < 1e-5,
            "{name}: f32 logits differ by {dense_diff}"
        );
        // The integer kernels set activation scales and outliers per 256-wide neighbourhood of
        // a row, which a split of the inputs moves: the split model stays as close to the f32
        // weights as the whole one (measured here: 0.91 to 1.0 times its distance).
        assert!(
            split_noise <= 1.5 * noise,
            "{name}: the split is {split_noise} from the f32 weights, the whole model {noise}"
        );
    }
}

/// 8-bit values (`int8v`), and 8-bit rotated keys (`int8`): each rank quantizes the rows of
/// its own heads as the whole model does (a row's scale is its own, the rotation is per
/// head), so the split forward matches the whole one: only the shares' order of addition
/// differs, as with a float cache, and with 8-bit keys a code on a rounding boundary. For `int8` the model's keys carry a large constant
/// channel, so the key offsets matter: rank 0 estimates them with every rank at load and hands
/// each rank its share with each new cache; a rank without them would round its heads' keys
/// differently from the whole model.
#[test]
fn split_forwards_match_the_whole_model_with_8_bit_values() {
    for dtype in [KvDtype::Int8V, KvDtype::Int8] {
        // The spike only for `int8`: with f16 keys of about 150, the last bits in which the
        // split's keys differ cross f16 rounding steps often enough to move logits by 10⁻⁵.
        let spec = TinySpec {
            k_bias_spike: if dtype == KvDtype::Int8 { 150.0 } else { 0.0 },
            ..TinySpec::qwen2(5)
        };
        let path = tiny_model_path(&spec, &format!("tp-qwen2-k-{dtype:?}")).unwrap();
        let o = |tp| LoadOptions {
            dense: true,
            kv_dtype: Some(dtype),
            ..opts(tp)
        };
        let whole = Model::load(&path, &o(None)).unwrap();
        assert_eq!(whole.kv_dtype(), dtype);
        let want = scenario(&whole);
        let peers = start_ranks_with(&path, 2, o);
        let m = lead_with(&path, peers, o).unwrap();
        assert_eq!((m.tp_degree(), m.kv_dtype()), (2, dtype));
        if dtype == KvDtype::Int8 {
            // Rank 0's offsets are the whole model's for its heads (the first half of each
            // layer's), found by the split forward.
            let all = whole.key_offsets().expect("offsets of the whole model");
            let own = m.key_offsets().expect("offsets of rank 0");
            let kvd = whole.cfg.n_kv_heads * whole.cfg.head_dim;
            let mine: Vec<f32> = all
                .chunks_exact(kvd)
                .flat_map(|l| l[..kvd / 2].to_vec())
                .collect();
            // The split's keys differ from the whole model's in the last bits; a mean that sat
            // on a rounding boundary could round the other way.
            assert_eq!(own.len(), mine.len());
            assert!(
                own.iter()
                    .zip(&mine)
                    .all(|(a, b)| (a - b).abs() <= 1.0 / 16.0)
            );
            assert!(all.iter().any(|x| x.abs() > 100.0));
        } else {
            assert!(m.key_offsets().is_none());
        }
        let got = scenario(&m);
        let v = whole.cfg.vocab_size;
        assert_eq!(argmaxes(&got, v), argmaxes(&want, v), "{dtype:?}");
        let d = max_rel_diff(&got, &want);
        // 8-bit keys: a key element whose rotated value sits on a rounding boundary can take
        // the next code in one forward and not the other (the split adds its shares in
        // another order), which moves a score by a step of that row (6·10⁻⁵ measured). Ranks
        // without their key offsets read 2·10⁻² here.
        let bound = if dtype == KvDtype::Int8 { 1e-3 } else { 1e-5 };
        assert!(d < bound, "{dtype:?}: split logits differ by {d}");
    }
}

#[test]
fn ranks_refuse_what_they_cannot_serve() {
    let spec = TinySpec::llama(3);
    let path = tiny_model_path(&spec, "tp-llama").unwrap();
    // A degree that does not divide the KV heads.
    let e = Model::load(&path, &opts(Some(TpOptions::shard(1, 3)))).unwrap_err();
    assert!(e.to_string().contains("must divide"), "{e}");
    // Another checkpoint at rank 1.
    let other = tiny_model_path(&TinySpec::llama(4), "tp-llama-other").unwrap();
    let e = leader(&path, start_ranks(&other, 2)).unwrap_err();
    assert!(e.to_string().contains("another checkpoint"), "{e}");
    // The same model quantized otherwise at rank 1 (same configuration and norms).
    let q8 = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::llama(3)
    };
    let other = tiny_model_path(&q8, "tp-llama-q8").unwrap();
    let e = leader(&path, start_ranks(&other, 2)).unwrap_err();
    assert!(e.to_string().contains("another checkpoint"), "{e}");
    // Rank 1 of 2 dialled as rank 1 of 4 (a wrong peer list).
    let four = TinySpec {
        d_model: 128,
        n_kv_heads: 4,
        ..TinySpec::llama(3)
    };
    let path4 = tiny_model_path(&four, "tp-llama-kv4").unwrap();
    let peers = start_ranks(&path4, 2);
    let e = leader(&path4, vec![peers[0].clone(); 3]).unwrap_err();
    assert!(e.to_string().contains("this is rank 1 of 2"), "{e}");
    // Forwards run on rank 0 only, and a cache of the wrong shape is refused, not indexed.
    let r1 = Model::load(&path, &opts(Some(TpOptions::shard(1, 2)))).unwrap();
    let mut c = r1.new_cache(64, 8).unwrap();
    let s = c.new_seq();
    let e = last(&r1, &mut c, s, &[1]).unwrap_err();
    assert!(e.to_string().contains("forwards run on rank 0"), "{e}");
    // A shard holds neither the embedding nor the head: half the layers' bytes and no more.
    let e = r1.head_logits(&[0.0; 64], 1).unwrap_err();
    assert!(e.to_string().contains("no embedding or LM head"), "{e}");
    let whole = Model::load(&path, &opts(None)).unwrap();
    assert!(r1.weight_bytes() < whole.weight_bytes() / 2);
    let mut c = whole.new_cache(64, 8).unwrap();
    let s = c.new_seq();
    let m = leader(&path, start_ranks(&path, 2)).unwrap();
    let e = last(&m, &mut c, s, &[1]).unwrap_err();
    assert!(e.to_string().contains("KV cache of"), "{e}");
}

#[test]
fn a_lost_link_fails_forwards_then_reconnects_and_starts_over() {
    let spec = TinySpec::llama(3);
    let path = tiny_model_path(&spec, "tp-llama").unwrap();
    let whole = Model::load(&path, &opts(None)).unwrap();
    let peers = start_ranks(&path, 2);
    let m = leader(&path, peers.clone()).unwrap();
    let mut c = m.new_cache(128, 8).unwrap();
    c.set_prefix_caching(true);
    let a = c.new_seq();
    let first: Vec<u32> = (1..=17).collect();
    fwd(&m, &mut c, &[(a, &first)]);
    c.register(a, &first).unwrap();
    // A port probe (or anything that does not say hello) changes nothing for the leader.
    {
        use std::io::Write;
        let mut probe = std::net::TcpStream::connect(&peers[0]).unwrap();
        let _ = probe.write_all(b"GET / HTTP/1.0\r\n\r\n");
    }
    std::thread::sleep(Duration::from_millis(200));
    let b0 = c.new_seq();
    fwd(&m, &mut c, &[(b0, &[7, 8, 9])]);
    c.remove(b0).unwrap();
    // A second leader takes rank 1 over (as a restarted target worker would): the first
    // one's link is cut.
    let (other, c2, _) = take_over(&path, peers);
    let step = |c: &mut KvCache, seq: SeqId, t: &[u32]| last(&m, c, seq, t);
    let e = step(&mut c, a, &[6]).unwrap_err();
    assert!(matches!(e, RuntimeError::Tp(_)), "{e}");
    // The prefix cache no longer offers blocks the ranks lost, nor takes new ones.
    let (p, hit) = c.new_seq_with_prefix(&first, 64);
    assert_eq!(hit, 0);
    c.remove(p).unwrap();
    // While the second leader holds the rank, the first does not take it back.
    let e = step(&mut c, a, &[6]).unwrap_err();
    assert!(e.to_string().contains("taken over"), "{e}");
    drop(c2);
    drop(other);
    relink(&m);
    // Reconnected, but rank 1 no longer holds `a`'s KV: refused rather than computed wrong.
    let e = step(&mut c, a, &[6]).unwrap_err();
    assert!(e.to_string().contains("must start over"), "{e}");
    c.register(a, &first).unwrap();
    // Once the sequence is gone the cache serves again, and correctly.
    c.remove(a).unwrap();
    let (b, hit) = c.new_seq_with_prefix(&first, 64);
    assert_eq!(hit, 0, "a block registered while the ranks had lost it");
    c.remove(b).unwrap();
    let b = c.new_seq();
    let got = step(&mut c, b, &[1, 2, 3, 4, 5, 6]).unwrap();
    let mut wc = whole.new_cache(64, 8).unwrap();
    let wb = wc.new_seq();
    let want = last(&whole, &mut wc, wb, &[1, 2, 3, 4, 5, 6]).unwrap();
    assert!(max_rel_diff(&[got.logits], &[want.logits]) < 1e-4);
}

/// Ranks lost and relinked while the worker is idle (the target worker's redial thread) hold
/// none of the cache's blocks: `tp_sync`, which the engine calls before admitting, drops the
/// prefix cache, so the next request computes its prompt instead of adopting those blocks and
/// failing its forward.
#[test]
fn ranks_relinked_while_idle_leave_no_prefix_blocks_to_adopt() {
    let spec = TinySpec::llama(3);
    let path = tiny_model_path(&spec, "tp-llama").unwrap();
    let whole = Model::load(&path, &opts(None)).unwrap();
    let peers = start_ranks(&path, 2);
    let m = leader(&path, peers.clone()).unwrap();
    let mut c = m.new_cache(128, 8).unwrap();
    c.set_prefix_caching(true);
    let first: Vec<u32> = (1..=17).collect();
    let a = c.new_seq();
    fwd(&m, &mut c, &[(a, &first)]);
    c.register(a, &first).unwrap();
    c.remove(a).unwrap();
    // Synced and linked: the blocks stay offered.
    m.tp_sync(&mut c);
    let (p, hit) = c.new_seq_with_prefix(&first, 64);
    assert!(hit > 0);
    c.remove(p).unwrap();
    // Another leader takes rank 1 over; the idle check sees the link gone and the redial
    // relinks (a new epoch), as the target worker's redial thread does between requests.
    let (other, c2, _) = take_over(&path, peers);
    wait_down(&m);
    drop(c2);
    drop(other);
    relink(&m);
    m.tp_sync(&mut c);
    let (b, hit) = c.new_seq_with_prefix(&first, 64);
    assert_eq!(
        hit, 0,
        "prefix blocks the relinked ranks do not hold were offered"
    );
    let got = last(&m, &mut c, b, &first).unwrap();
    let mut wc = whole.new_cache(64, 8).unwrap();
    let wb = wc.new_seq();
    let want = last(&whole, &mut wc, wb, &first).unwrap();
    assert!(max_rel_diff(&[got.logits], &[want.logits]) < 1e-4);
}

/// A TCP relay in front of a rank that can hang: while shut it cuts the links it relayed,
/// and the connections it accepts then are held open and never answered.
struct Relay {
    addr: String,
    open: Arc<std::sync::atomic::AtomicBool>,
    relayed: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    held: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

fn relay(to: String) -> Relay {
    use std::net::{Shutdown, TcpStream};
    use std::sync::atomic::Ordering;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let r = Relay {
        addr: l.local_addr().unwrap().to_string(),
        open: Arc::new(true.into()),
        relayed: Arc::default(),
        held: Arc::default(),
    };
    let (open, relayed, held) = (r.open.clone(), r.relayed.clone(), r.held.clone());
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            if !open.load(Ordering::SeqCst) {
                held.lock().unwrap().push(s);
                continue;
            }
            let Ok(up) = TcpStream::connect(&to) else {
                continue;
            };
            for (mut from, mut to) in [
                (s.try_clone().unwrap(), up.try_clone().unwrap()),
                (up.try_clone().unwrap(), s.try_clone().unwrap()),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(Shutdown::Both);
                });
            }
            relayed.lock().unwrap().extend([s, up]);
        }
    });
    r
}

impl Relay {
    fn set(&self, open: bool) {
        self.open.store(open, std::sync::atomic::Ordering::SeqCst);
        for list in [&self.relayed, &self.held] {
            for c in list.lock().unwrap().drain(..) {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
    }
    fn held(&self) -> usize {
        self.held.lock().unwrap().len()
    }
}

/// The target worker's redial thread dials outside the links' lock: while it waits on a rank
/// that accepted and does not answer, admission (`tp_sync`) goes on and a forward fails after
/// a short wait (0.5 s), where before both waited for the dial's hello timeout (3 s here).
#[test]
fn a_redial_to_a_hung_rank_holds_up_neither_admission_nor_forwards() {
    let spec = TinySpec::llama(3);
    let path = tiny_model_path(&spec, "tp-llama").unwrap();
    let whole = Model::load(&path, &opts(None)).unwrap();
    let peers = start_ranks(&path, 2);
    let r = relay(peers[0].clone());
    let mut t = TpOptions::leader(vec![r.addr.clone()]);
    t.connect_timeout = Duration::from_secs(10);
    t.io_timeout = Duration::from_secs(3);
    let m = Arc::new(Model::load(&path, &opts(Some(t))).unwrap());
    let mut c = m.new_cache(64, 8).unwrap();
    let a = c.new_seq();
    fwd(&m, &mut c, &[(a, &[1, 2, 3])]);
    c.remove(a).unwrap();
    // The rank hangs.
    r.set(false);
    wait_down(&m);
    let t0 = std::time::Instant::now();
    let redial = {
        let m = Arc::clone(&m);
        std::thread::spawn(move || m.tp_redial())
    };
    while r.held() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the redial never dialled"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let t1 = std::time::Instant::now();
    m.tp_sync(&mut c);
    let b = c.new_seq();
    let e = last(&m, &mut c, b, &[4]).unwrap_err();
    assert!(
        t1.elapsed() < Duration::from_millis(1500),
        "admission and a forward waited {:?} for the redial",
        t1.elapsed()
    );
    assert!(e.to_string().contains("being dialled"), "{e}");
    // The hello went unanswered: the redial fails on its own time.
    let e = redial.join().unwrap().unwrap_err();
    assert!(matches!(e, RuntimeError::Tp(_)), "{e}");
    // The rank answers again: linked, and served.
    r.set(true);
    relink(&m);
    c.remove(b).unwrap();
    let b = c.new_seq();
    let got = last(&m, &mut c, b, &[1, 2, 3]).unwrap();
    let mut wc = whole.new_cache(64, 8).unwrap();
    let wb = wc.new_seq();
    let want = last(&whole, &mut wc, wb, &[1, 2, 3]).unwrap();
    assert!(max_rel_diff(&[got.logits], &[want.logits]) < 1e-4);
}

/// Two leaders given the same ranks do not take them from each other back and forth (each
/// failing the other's requests every second): the newer keeps them, the one they were taken
/// from is refused with the reason while it holds them, and links again once it is gone.
#[test]
fn a_leader_does_not_take_its_ranks_back_from_a_newer_one() {
    let spec = TinySpec::llama(3);
    let path = tiny_model_path(&spec, "tp-llama").unwrap();
    let peers = start_ranks(&path, 2);
    let m = leader(&path, peers.clone()).unwrap();
    let mut c = m.new_cache(64, 8).unwrap();
    let a = c.new_seq();
    fwd(&m, &mut c, &[(a, &[1, 2, 3])]);
    c.remove(a).unwrap();
    let (other, mut c2, s2) = take_over(&path, peers);
    wait_down(&m);
    for _ in 0..3 {
        let e = m.tp_redial().unwrap_err();
        assert!(
            e.to_string().contains("taken over by another leader"),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The newer leader kept the rank throughout.
    fwd(&other, &mut c2, &[(s2, &[10])]);
    assert_eq!(other.tp_links().unwrap().connects(), 1);
    drop(c2);
    drop(other);
    relink(&m);
    let b = c.new_seq();
    fwd(&m, &mut c, &[(b, &[1, 2, 3])]);
    assert_eq!(m.tp_links().unwrap().connects(), 2);
}

/// Int8 key offsets live with each cache on the ranks, sent by rank 0 with every new cache.
/// After a reconnect (a restarted rank, or one another leader took over) a rank holds none of
/// rank 0's caches, and the next cache must bring its offsets again: without them the keys of
/// this spiked model read 2·10⁻² off (see the split test above).
#[test]
fn a_reconnected_rank_gets_its_int8_key_offsets_with_the_next_cache() {
    let spec = TinySpec {
        k_bias_spike: 150.0,
        ..TinySpec::qwen2(5)
    };
    let path = tiny_model_path(&spec, "tp-qwen2-k-reconnect").unwrap();
    let o = |tp| LoadOptions {
        dense: true,
        kv_dtype: Some(KvDtype::Int8),
        ..opts(tp)
    };
    let whole = Model::load(&path, &o(None)).unwrap();
    let want = scenario(&whole);
    let peers = start_ranks_with(&path, 2, o);
    let lead = |peers: Vec<String>| lead_with(&path, peers, o).unwrap();
    let m = lead(peers.clone());
    assert!(m.key_offsets().is_some());
    // Another leader takes rank 1 over (its load calibrates through it): `m`'s link is cut.
    let other = lead(peers);
    let mut c = other.new_cache(64, 8).unwrap();
    let s = c.new_seq();
    fwd(&other, &mut c, &[(s, &[9])]);
    // `m`'s next forward finds the link gone; once the other leader is gone, `m` relinks, in
    // a new epoch.
    let mut c = m.new_cache(64, 8).unwrap();
    let s = c.new_seq();
    let e = last(&m, &mut c, s, &[1]).unwrap_err();
    assert!(matches!(e, RuntimeError::Tp(_)), "{e}");
    drop(c);
    drop(other);
    relink(&m);
    let got = scenario(&m);
    let v = whole.cfg.vocab_size;
    assert_eq!(argmaxes(&got, v), argmaxes(&want, v));
    let d = max_rel_diff(&got, &want);
    assert!(d < 1e-3, "after a reconnect, split logits differ by {d}");
}

/// A tiny Hugging Face checkpoint (config.json + bf16 matrices in two .safetensors shards),
/// random weights from `seed`; `norm_seed` sets the norms, which the configuration-level
/// fingerprint covers.
fn hf_checkpoint(name: &str, seed: u64) -> std::path::PathBuf {
    use candle_core::{DType, Device, Tensor};
    use std::collections::HashMap;
    let (d, kvh, hd, ffn, layers, vocab) = (64usize, 2usize, 16usize, 96usize, 2usize, 300usize);
    let mut rng = kernels::rng::Rng::new(seed);
    let mut mat = |r: usize, c: usize, s: f32| {
        let v: Vec<f32> = (0..r * c).map(|_| rng.normal() as f32 * s).collect();
        Tensor::from_vec(v, (r, c), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let norm = Tensor::from_vec(
        (0..d).map(|i| 1.0 + 0.01 * i as f32).collect::<Vec<f32>>(),
        d,
        &Device::Cpu,
    )
    .unwrap();
    let ws = 1.0 / (d as f32).sqrt();
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert("model.embed_tokens.weight".into(), mat(vocab, d, 1.0));
    t.insert("model.norm.weight".into(), norm.clone());
    for l in 0..layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        for (n, r, c) in [
            ("self_attn.q_proj.weight", d, d),
            ("self_attn.k_proj.weight", kvh * hd, d),
            ("self_attn.v_proj.weight", kvh * hd, d),
            ("self_attn.o_proj.weight", d, d),
            ("mlp.gate_proj.weight", ffn, d),
            ("mlp.up_proj.weight", ffn, d),
            ("mlp.down_proj.weight", d, ffn),
        ] {
            t.insert(p(n), mat(r, c, ws));
        }
        t.insert(p("input_layernorm.weight"), norm.clone());
        t.insert(p("post_attention_layernorm.weight"), norm.clone());
    }
    let dir = std::env::temp_dir().join(format!("dspark-tp-hf-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut names: Vec<String> = t.keys().cloned().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    for (part, file) in [(a, "model-1.safetensors"), (b, "model-2.safetensors")] {
        let shard: HashMap<String, Tensor> =
            part.iter().map(|n| (n.clone(), t[n].clone())).collect();
        candle_core::safetensors::save(&shard, dir.join(file)).unwrap();
    }
    std::fs::write(
        dir.join("config.json"),
        format!(r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":{d},"intermediate_size":{ffn},"num_hidden_layers":{layers},"num_attention_heads":4,"num_key_value_heads":{kvh},"vocab_size":{vocab},"rope_theta":10000.0,"rms_norm_eps":1e-5,"max_position_embeddings":256,"tie_word_embeddings":true}}"#),
    )
    .unwrap();
    dir
}

/// A Hugging Face checkpoint splits as a GGUF one does: each rank reads its rows or columns
/// of each matrix (never the whole checkpoint), the split forward matches the whole model,
/// and ranks holding another checkpoint of the same shape and norms are refused.
#[test]
fn hugging_face_checkpoints_split_and_ranks_check_their_matrices() {
    let path = hf_checkpoint("a", 5);
    let whole = Model::load(&path, &opts(None)).unwrap();
    let want = scenario(&whole);
    let m = leader(&path, start_ranks(&path, 2)).unwrap();
    assert_eq!(m.tp_degree(), 2);
    let got = scenario(&m);
    let diff = max_rel_diff(&got, &want);
    // Partial sums added in another order (a wrong slice would be off by O(1)).
    assert!(diff < 1e-4, "split vs whole: {diff}");
    assert_eq!(
        argmaxes(&got, whole.cfg.vocab_size),
        argmaxes(&want, whole.cfg.vocab_size)
    );
    let r1 = Model::load(&path, &opts(Some(TpOptions::shard(1, 2)))).unwrap();
    assert!(r1.weight_bytes() < whole.weight_bytes() / 2);
    // Same configuration and norms, other matrices: only the matrices' fingerprint tells.
    let other = hf_checkpoint("b", 6);
    let e = leader(&path, start_ranks(&other, 2)).unwrap_err();
    assert!(e.to_string().contains("another checkpoint"), "{e}");
    let _ = std::fs::remove_dir_all(&path);
    let _ = std::fs::remove_dir_all(&other);
}
