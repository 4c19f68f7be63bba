//! Paged KV cache owned by the caller (the engine), not by the model.
//!
//! Storage is a pool of fixed-size blocks per layer; each sequence has a block table. Speculative
//! decoding appends k+1 positions per verification and keeps only the accepted prefix, so
//! [`KvCache::truncate`] returns every block past the new length to the free list at once. Shared
//! prefixes are forked by reference count; a write into a shared block copies it first
//! (copy-on-write), so forks never see each other's tokens. [`KvCache::check`] verifies that every
//! block is either free or referenced exactly `refcount` times: no leaks, ever.
//!
//! **Prefix caching** ([`KvCache::set_prefix_caching`]): a full block whose tokens are known can be
//! registered under (its parent block, its tokens), so a later sequence with the same leading
//! tokens attaches those blocks instead of computing them again (a shared system prompt, the
//! earlier turns of a chat). Keys are exact token lists, not hashes: a collision cannot hand a
//! sequence another prompt's keys and values. A registered block nobody references stays
//! cached and counts as free. When an allocation finds the free list empty it evicts a cached
//! leaf (a block nothing is registered under), least recently used first: a prefix goes only
//! after the tails that hang from it, and evicting a block never takes a more recently used one
//! along (unregistering a block unregisters what is keyed under it). A cached block can have a
//! tail in use that its sequence chained under it without holding it (see
//! [`KvCache::register`]); it is no leaf then, and goes only once no leaf is cached (see
//! `KvCache::pinned_victim`). A registered block is never written again: growing into one that
//! is shared copies it (as for a fork), and one that is not is unregistered first.
//!
//! Layout per layer: K is `[block][kv_head][head_dim][block_size]` (each block transposed, so
//! attention scores a whole block with vertical FMAs), V is `[block][block_size][kv_dim]`. Both
//! keep a block contiguous, so copy-on-write copies one range.
//!
//! Elements are f16 by default ([`KvDtype`]): a decode reads every cached K and V once per layer,
//! and at long contexts those bytes outweigh the model's (SmolLM2 at ctx 2048: 94 MB in f32).
//! The f32 reference forward keeps f32. `int8v` keeps f16 keys and 8-bit values, `int8` 8-bit
//! keys (rotated, see [`QPool`]) and values.

use crate::RuntimeError;
use half::f16;
use kernels::ops::KvElem;
use std::collections::{BTreeMap, HashMap};

/// Parent of a sequence's first block in the prefix index.
const ROOT: u32 = u32::MAX;

/// Key of a registered block: its parent block (or [`ROOT`]) and its tokens.
type PrefixKey = (u32, Box<[u32]>);

/// Index of registered blocks (prefix caching).
#[derive(Default)]
struct PrefixIndex {
    enabled: bool,
    map: HashMap<PrefixKey, u32>,
    /// Per block: its key while registered.
    key: Vec<Option<PrefixKey>>,
    /// Per block: registered blocks keyed under it.
    children: Vec<Vec<u32>>,
    /// Registered blocks with no reference (cached), by last use.
    idle: BTreeMap<u64, u32>,
    /// The blocks of `idle` with no registered children, by last use (eviction order).
    leaves: BTreeMap<u64, u32>,
    /// Per block: when it was last released (key into `idle` and `leaves` while there).
    last_use: Vec<u64>,
    tick: u64,
    /// Prompt tokens looked up and found, since start (metrics).
    queried_tokens: u64,
    hit_tokens: u64,
}

/// Element type of the K and V pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
    /// f16 keys, 8-bit values with an f32 scale per row ([`QPool`]): 77 % of f16's bytes at
    /// head_dim 64.
    Int8V,
    /// 8-bit keys (each row rotated by a Walsh–Hadamard transform first) and values, an f32
    /// scale per row each ([`QPool`]): 53 % of f16's bytes at head_dim 64.
    Int8,
}

impl KvDtype {
    /// `f16`, `f32`, `int8v` or `int8` (`--kv-cache-dtype`).
    pub fn parse(s: &str) -> Result<Self, RuntimeError> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            "int8v" => Ok(KvDtype::Int8V),
            "int8" => Ok(KvDtype::Int8),
            o => Err(RuntimeError::Config(format!(
                "KV cache dtype `{o}`: expected f16, f32, int8v or int8"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Int8V => "int8v",
            KvDtype::Int8 => "int8",
        }
    }
}

/// One layer's K and V pools, borrowed for attention.
pub enum LayerKv<'a> {
    F16(&'a [f16], &'a [f16]),
    F32(&'a [f32], &'a [f32]),
    /// f16 keys, 8-bit value codes and their scales (see [`QPool`]).
    Int8V {
        k: &'a [f16],
        v: &'a [i8],
        vscale: &'a [f32],
    },
    /// 8-bit key codes of the rotated keys, value codes, and their scales (see [`QPool`]):
    /// queries must be rotated alike ([`kernels::ops::hadamard`]) before attention.
    Int8 {
        k: &'a [i8],
        kscale: &'a [f32],
        v: &'a [i8],
        vscale: &'a [f32],
    },
}

/// 8-bit values with f16 keys (`--kv-cache-dtype int8v`, `K` = `f16`) or 8-bit keys
/// (`int8`, `K` = `i8`). Each value row (one position, one head) is quantized on its own: codes `[slot][kv_dim]` in the float layout, one scale per
/// `[block][head][position]` (the row's largest |v| over 127), which attention folds into the
/// row's weight. A row's codes depend on that row alone, so rolling back rejected drafts
/// leaves every kept position as plain decoding would have written it, and speculative
/// decoding stays lossless against plain decoding on the same cache.
///
/// Keys quantized per position as they come (a scale per 32 channels) lose too much:
/// Qwen2.5-0.5B's top-1 agreement with the reference fell to 0.951, since a few channels of its keys are tens of times larger
/// than the rest and a row's scale follows them. Per channel within a block (KIVI, Liu et al.
/// 2024) agreement held, but a channel's scale then depends on every position written into
/// the block, drafts that are later rejected included, so rolled-back positions would differ
/// from plain decoding's. `int8` keys (`K` = `i8`) are rotated first, each head's row by the
/// normalized Walsh–Hadamard transform ([`kernels::ops::hadamard`]), which spreads the large
/// channels over the whole row; then quantized per row like the values, in the transposed
/// key layout, one scale per `[block][head][position]`. The rotation is orthogonal, so
/// attention rotates the queries alike and the scores are unchanged. A row still depends on
/// itself alone.
///
/// The largest key channels are near constants: on Qwen2.5-0.5B channel 62 of layer 0's first
/// head averages 145 with a standard deviation of 0.3 over a text, and a rotation spreads that
/// constant over the whole row, whose scale then follows it. Subtracting a fixed vector μ from
/// every key of a head changes each query's scores by the same q·μ, which the softmax cancels:
/// the cache stores H(k − μ) and attention is unchanged. [`KvCache::set_key_offsets`] sets μ
/// per layer and head (the model estimates it once at load, see [`key_means`]). It is the same
/// for every position, so a row still depends on itself alone. Keys are stored after RoPE, so
/// a channel is a constant only where its pair turns slowly: the model keeps μ where the
/// pair turns by at most half a radian over the whole context (the constant then shrinks at
/// least twofold at every position) and sets the rest to 0.
struct QPool<K: KvElem> {
    k: Vec<Vec<K>>,
    /// With `i8` keys, per layer `[block][head][position]`; empty otherwise.
    kscale: Vec<Vec<f32>>,
    /// With `i8` keys and offsets set, per layer the rotated offsets H·μ, `[head][head_dim]`;
    /// empty otherwise (μ = 0).
    koff: Vec<Vec<f32>>,
    v: Vec<Vec<i8>>,
    vscale: Vec<Vec<f32>>,
}

/// The scale of an 8-bit row (its largest |x| over 127) and its codes. A NaN makes the scale
/// NaN, so attention over the row is NaN as with a float cache, rather than a silent 0.
fn quantize_row(row: &[f32], codes: &mut [i8]) -> f32 {
    let m = row.iter().fold(0f32, |a, &x| {
        if x.abs() > a || x.is_nan() {
            x.abs()
        } else {
            a
        }
    });
    let s = m / 127.0;
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    for (e, &x) in codes.iter_mut().zip(row) {
        *e = i8::from_f32(x * inv);
    }
    s
}

impl<K: KvElem> QPool<K> {
    fn new(cfg: &KvConfig) -> Self {
        let (nb, bs, nkv, hd) = (cfg.num_blocks, cfg.block_size, cfg.n_kv_heads, cfg.head_dim);
        let layers = cfg.n_layers;
        let scales =
            |on: bool| (0..layers).map(move |_| vec![0.0; if on { nb * nkv * bs } else { 0 }]);
        Self {
            k: (0..layers)
                .map(|_| vec![K::from_f32(0.0); nb * bs * nkv * hd])
                .collect(),
            kscale: scales(K::I8).collect(),
            koff: Vec::new(),
            v: (0..layers).map(|_| vec![0; nb * bs * nkv * hd]).collect(),
            vscale: scales(true).collect(),
        }
    }

    fn copy_block(&mut self, cfg: &KvConfig, from: usize, to: usize) {
        let n = cfg.block_size * cfg.kv_dim();
        let ns = cfg.n_kv_heads * cfg.block_size;
        for l in 0..cfg.n_layers {
            self.k[l].copy_within(from * n..(from + 1) * n, to * n);
            self.v[l].copy_within(from * n..(from + 1) * n, to * n);
            self.vscale[l].copy_within(from * ns..(from + 1) * ns, to * ns);
            if K::I8 {
                self.kscale[l].copy_within(from * ns..(from + 1) * ns, to * ns);
            }
        }
    }

    fn write(&mut self, cfg: &KvConfig, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (bs, hd, nkv) = (cfg.block_size, cfg.head_dim, cfg.n_kv_heads);
        let (b, off) = (slot / bs, slot % bs);
        let d = nkv * hd;
        if K::I8 {
            let (kp, ksc) = (&mut self.k[layer], &mut self.kscale[layer]);
            let mut row = [0f32; MAX_INT8_HEAD_DIM];
            let mut codes = [0i8; MAX_INT8_HEAD_DIM];
            for (h, src) in k[..d].chunks_exact(hd).enumerate() {
                let row = &mut row[..hd];
                row.copy_from_slice(src);
                kernels::ops::hadamard(row);
                if let Some(mu) = self.koff.get(layer) {
                    for (x, o) in row.iter_mut().zip(&mu[h * hd..(h + 1) * hd]) {
                        *x -= o;
                    }
                }
                ksc[(b * nkv + h) * bs + off] = quantize_row(row, &mut codes[..hd]);
                let base = (b * nkv + h) * hd * bs + off;
                for (i, &c) in codes[..hd].iter().enumerate() {
                    kp[base + i * bs] = K::from_f32(c as f32);
                }
            }
        } else {
            write_k(&mut self.k[layer], cfg, slot, k);
        }
        let (vp, vsc) = (&mut self.v[layer], &mut self.vscale[layer]);
        for (h, row) in v[..d].chunks_exact(hd).enumerate() {
            vsc[(b * nkv + h) * bs + off] = quantize_row(row, &mut vp[slot * d + h * hd..][..hd]);
        }
    }

    /// K of one position: the codes times their scale, plus the offset, rotated back.
    fn read_k(&self, cfg: &KvConfig, layer: usize, slot: usize) -> Vec<f32> {
        let mut k = read_k(&self.k[layer], cfg, slot);
        if K::I8 {
            let (bs, hd, nkv) = (cfg.block_size, cfg.head_dim, cfg.n_kv_heads);
            let (b, off) = (slot / bs, slot % bs);
            for (h, row) in k.chunks_exact_mut(hd).enumerate().take(nkv) {
                let s = self.kscale[layer][(b * nkv + h) * bs + off];
                row.iter_mut().for_each(|x| *x *= s);
                if let Some(o) = self.koff.get(layer) {
                    for (x, o) in row.iter_mut().zip(&o[h * hd..(h + 1) * hd]) {
                        *x += o;
                    }
                }
                kernels::ops::hadamard(row);
            }
        }
        k
    }

    fn read_v(&self, cfg: &KvConfig, layer: usize, slot: usize) -> Vec<f32> {
        let (bs, hd, nkv) = (cfg.block_size, cfg.head_dim, cfg.n_kv_heads);
        let (b, off) = (slot / bs, slot % bs);
        let d = nkv * hd;
        (0..d)
            .map(|c| {
                self.v[layer][slot * d + c] as f32
                    * self.vscale[layer][(b * nkv + c / hd) * bs + off]
            })
            .collect()
    }
}

/// Writes one position's keys into the transposed blocks of `kp`, a head's row converted at a
/// time.
fn write_k<E: KvElem>(kp: &mut [E], cfg: &KvConfig, slot: usize, k: &[f32]) {
    let (bs, hd, nkv) = (cfg.block_size, cfg.head_dim, cfg.n_kv_heads);
    let (b, off) = (slot / bs, slot % bs);
    let mut row = [E::from_f32(0.0); 256];
    for h in 0..nkv {
        let base = (b * nkv + h) * hd * bs + off;
        let src = &k[h * hd..(h + 1) * hd];
        if hd <= row.len() {
            E::from_f32_slice(src, &mut row[..hd]);
            for (i, &e) in row[..hd].iter().enumerate() {
                kp[base + i * bs] = e;
            }
        } else {
            for (i, &x) in src.iter().enumerate() {
                kp[base + i * bs] = E::from_f32(x);
            }
        }
    }
}

/// Keys of one position, gathered from the transposed block.
fn read_k<E: KvElem>(kp: &[E], cfg: &KvConfig, slot: usize) -> Vec<f32> {
    let (bs, hd, nkv) = (cfg.block_size, cfg.head_dim, cfg.n_kv_heads);
    let (b, off) = (slot / bs, slot % bs);
    let mut out = vec![0f32; nkv * hd];
    for h in 0..nkv {
        for i in 0..hd {
            out[h * hd + i] = kp[(b * nkv + h) * hd * bs + i * bs + off].to_f32();
        }
    }
    out
}

/// Per-layer K and V storage of one element type.
struct Pool<E> {
    k: Vec<Vec<E>>,
    v: Vec<Vec<E>>,
}

impl<E: KvElem> Pool<E> {
    fn new(layers: usize, per_layer: usize) -> Self {
        let zero = E::from_f32(0.0);
        Self {
            k: (0..layers).map(|_| vec![zero; per_layer]).collect(),
            v: (0..layers).map(|_| vec![zero; per_layer]).collect(),
        }
    }

    fn copy(&mut self, f: usize, t: usize, n: usize) {
        for (k, v) in self.k.iter_mut().zip(self.v.iter_mut()) {
            k.copy_within(f..f + n, t);
            v.copy_within(f..f + n, t);
        }
    }

    fn write(&mut self, cfg: &KvConfig, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = cfg.kv_dim();
        write_k(&mut self.k[layer], cfg, slot, k);
        E::from_f32_slice(v, &mut self.v[layer][slot * d..(slot + 1) * d]);
    }

    fn read_v(&self, cfg: &KvConfig, layer: usize, slot: usize) -> Vec<f32> {
        let d = cfg.kv_dim();
        self.v[layer][slot * d..(slot + 1) * d]
            .iter()
            .map(|x| x.to_f32())
            .collect()
    }
}

enum Pools {
    F16(Pool<f16>),
    F32(Pool<f32>),
    Int8V(QPool<f16>),
    Int8(QPool<i8>),
}

/// Per layer and channel, the mean key over `slots` of `cache`, rounded to a multiple of 1/16
/// (`n_layers × kv_dim` floats): the offsets an `int8` cache subtracts
/// ([`KvCache::set_key_offsets`]). Any offset keeps attention exact; a good one shrinks what
/// the 8-bit rows must span. Rounding makes a tensor-parallel rank, whose keys differ from
/// the whole model's in the last bits, arrive at the same offsets.
pub fn key_means(cache: &KvCache, slots: &[usize]) -> Vec<f32> {
    let (layers, d) = (cache.cfg.n_layers, cache.cfg.kv_dim());
    let mut out = vec![0f32; layers * d];
    if slots.is_empty() {
        return out;
    }
    for (l, o) in out.chunks_exact_mut(d).enumerate() {
        let mut sum = vec![0f64; d];
        for &s in slots {
            for (a, x) in sum.iter_mut().zip(cache.read_k(l, s)) {
                *a += x as f64;
            }
        }
        for (o, a) in o.iter_mut().zip(sum) {
            let m = a / slots.len() as f64;
            *o = if m.is_finite() {
                ((m * 16.0).round() / 16.0) as f32
            } else {
                0.0
            };
        }
    }
    out
}

/// Largest head_dim of an `int8` cache (the rotation takes powers of two).
const MAX_INT8_HEAD_DIM: usize = 256;

/// Opaque sequence handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

#[derive(Clone, Debug)]
pub struct KvConfig {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

#[derive(Clone, Debug, Default)]
struct Table {
    blocks: Vec<u32>,
    len: usize,
}

pub struct KvCache {
    cfg: KvConfig,
    /// Per layer: num_blocks × block_size × kv_dim.
    pools: Pools,
    refcount: Vec<u32>,
    free: Vec<u32>,
    seqs: HashMap<SeqId, Table>,
    next_id: u64,
    prefix: PrefixIndex,
    /// Tensor parallelism ([`crate::tp`]): the peer generation and id under which the shard
    /// ranks hold their part of this cache, once a leader has synced it.
    tp: Option<(u64, u64)>,
    /// Block copies (copy-on-write) since the last forward, for the shard ranks to repeat;
    /// recorded only while `tp` is set.
    copies: Vec<(u32, u32)>,
    /// The shard ranks lost what this cache held: nothing is registered in or served from the
    /// prefix cache until the sequences computed before are gone and the cache is synced anew.
    tp_lost: bool,
    /// Held while a leader has this cache synced; the leader keeps a weak reference, and tells
    /// the shard ranks to free their part once it is dropped.
    tp_alive: Option<std::sync::Arc<()>>,
}

impl KvConfig {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

impl KvCache {
    pub fn new(cfg: KvConfig) -> Result<Self, RuntimeError> {
        if cfg.block_size == 0 || cfg.num_blocks == 0 || cfg.kv_dim() == 0 {
            return Err(RuntimeError::Config(
                "KV cache needs block_size, num_blocks and kv_dim > 0".into(),
            ));
        }
        let per_layer = cfg.num_blocks * cfg.block_size * cfg.kv_dim();
        if cfg.dtype == KvDtype::Int8
            && !(cfg.head_dim.is_power_of_two() && cfg.head_dim <= MAX_INT8_HEAD_DIM)
        {
            return Err(RuntimeError::Config(format!(
                "an int8 KV cache needs a head_dim that is a power of two up to \
                 {MAX_INT8_HEAD_DIM} (this model's is {}): use int8v",
                cfg.head_dim
            )));
        }
        Ok(Self {
            pools: match cfg.dtype {
                KvDtype::F16 => Pools::F16(Pool::new(cfg.n_layers, per_layer)),
                KvDtype::Int8V => Pools::Int8V(QPool::new(&cfg)),
                KvDtype::Int8 => Pools::Int8(QPool::new(&cfg)),
                KvDtype::F32 => Pools::F32(Pool::new(cfg.n_layers, per_layer)),
            },
            refcount: vec![0; cfg.num_blocks],
            free: (0..cfg.num_blocks as u32).rev().collect(),
            seqs: HashMap::new(),
            next_id: 0,
            tp: None,
            copies: Vec::new(),
            tp_lost: false,
            tp_alive: None,
            prefix: PrefixIndex {
                key: vec![None; cfg.num_blocks],
                children: vec![Vec::new(); cfg.num_blocks],
                last_use: vec![0; cfg.num_blocks],
                ..Default::default()
            },
            cfg,
        })
    }

    /// Turns prefix caching on or off; off drops every cached block that nobody references.
    pub fn set_prefix_caching(&mut self, on: bool) {
        self.prefix.enabled = on;
        if !on {
            self.clear_prefix_cache();
        }
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix.enabled
    }

    /// Forgets every registered block (the unreferenced ones return to the free list).
    pub fn clear_prefix_cache(&mut self) {
        for b in 0..self.cfg.num_blocks as u32 {
            if self.prefix.key[b as usize].is_some() {
                self.unregister(b);
            }
        }
    }

    /// Blocks held only by the prefix cache (free for allocation, evicted on demand).
    pub fn cached_blocks(&self) -> usize {
        self.prefix.idle.len()
    }

    /// Prompt tokens looked up in the prefix cache and tokens found there, since start.
    pub fn prefix_stats(&self) -> (u64, u64) {
        (self.prefix.queried_tokens, self.prefix.hit_tokens)
    }

    /// A new sequence starting with the longest cached prefix of `tokens` in whole blocks, at
    /// most `max_tokens` long; returns it and the tokens it already holds (0 when prefix
    /// caching is off or nothing matches).
    pub fn new_seq_with_prefix(&mut self, tokens: &[u32], max_tokens: usize) -> (SeqId, usize) {
        let id = self.new_seq();
        if !self.prefix.enabled || self.tp_lost {
            return (id, 0);
        }
        let bs = self.cfg.block_size;
        let mut blocks = Vec::new();
        let mut parent = ROOT;
        for chunk in tokens[..max_tokens.min(tokens.len())].chunks_exact(bs) {
            let key: PrefixKey = (parent, chunk.into());
            let Some(&b) = self.prefix.map.get(&key) else {
                break;
            };
            blocks.push(b);
            parent = b;
        }
        self.prefix.queried_tokens += tokens.len() as u64;
        self.prefix.hit_tokens += (blocks.len() * bs) as u64;
        self.prefix.tick += 1;
        for &b in &blocks {
            let rc = &mut self.refcount[b as usize];
            if *rc == 0 {
                let t = self.prefix.last_use[b as usize];
                self.prefix.idle.remove(&t);
                self.prefix.leaves.remove(&t);
            }
            *rc += 1;
        }
        let len = blocks.len() * bs;
        if let Some(t) = self.seqs.get_mut(&id) {
            *t = Table { blocks, len };
        }
        (id, len)
    }

    /// What [`KvCache::new_seq_with_prefix`] would adopt, without adopting it: the cached
    /// blocks that match (whole blocks of `tokens[..max_tokens]`) and how many of those nobody
    /// references now (adopting them takes them off the evictable list, so admission counts
    /// them as taken).
    pub fn prefix_match(&self, tokens: &[u32], max_tokens: usize) -> (usize, usize) {
        if !self.prefix.enabled || self.tp_lost {
            return (0, 0);
        }
        let bs = self.cfg.block_size;
        let (mut matched, mut idle) = (0, 0);
        let mut parent = ROOT;
        for chunk in tokens[..max_tokens.min(tokens.len())].chunks_exact(bs) {
            let key: PrefixKey = (parent, chunk.into());
            let Some(&b) = self.prefix.map.get(&key) else {
                break;
            };
            matched += 1;
            if self.refcount[b as usize] == 0 {
                idle += 1;
            }
            parent = b;
        }
        (matched, idle)
    }

    /// Blocks some sequence references (every block that is neither free nor an evictable
    /// cached one).
    pub fn held_blocks(&self) -> usize {
        self.cfg.num_blocks - self.free_blocks()
    }

    /// Registers `seq`'s full blocks whose tokens are `tokens[..]` (positions written so far,
    /// at most `tokens.len()`), so later sequences can share them. No-op when caching is off.
    /// Where a prefix is cached already under another block (an equal one computed alongside),
    /// the blocks after it are registered under that block, which `seq` does not hold.
    pub fn register(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), RuntimeError> {
        if !self.prefix.enabled || self.tp_lost {
            return Ok(());
        }
        let bs = self.cfg.block_size;
        let t = self.table(seq)?;
        let n = t.len.min(tokens.len()) / bs;
        let blocks: Vec<u32> = t.blocks[..n].to_vec();
        let mut parent = ROOT;
        for (i, &b) in blocks.iter().enumerate() {
            let key: PrefixKey = (parent, tokens[i * bs..(i + 1) * bs].into());
            if let Some(&have) = self.prefix.map.get(&key) {
                // This prefix is cached already (this block, or an equal one computed
                // alongside): chain what follows under the cached one.
                parent = have;
                continue;
            }
            if self.prefix.key[b as usize].is_some() {
                // Registered under another prefix: cannot be this one's block.
                return Ok(());
            }
            if parent != ROOT {
                let p = parent as usize;
                // A cached parent (the equal block computed alongside, which this sequence
                // does not hold) stops being a leaf.
                if self.refcount[p] == 0 && self.prefix.children[p].is_empty() {
                    self.prefix.leaves.remove(&self.prefix.last_use[p]);
                }
                self.prefix.children[p].push(b);
            }
            self.prefix.map.insert(key.clone(), b);
            self.prefix.key[b as usize] = Some(key);
            parent = b;
        }
        Ok(())
    }

    /// Removes `b` and every block keyed under it from the index; those nobody references
    /// return to the free list. `b`'s parent becomes a leaf if `b` was its last child.
    fn unregister(&mut self, b: u32) {
        let mut stack = vec![b];
        while let Some(x) = stack.pop() {
            let Some(key) = self.prefix.key[x as usize].take() else {
                continue;
            };
            if key.0 != ROOT {
                // Only `b`'s parent is still registered: the others were unregistered first.
                let p = key.0 as usize;
                let siblings = &mut self.prefix.children[p];
                siblings.retain(|&c| c != x);
                let last_child = siblings.is_empty();
                if last_child && self.refcount[p] == 0 && self.prefix.key[p].is_some() {
                    self.prefix.leaves.insert(self.prefix.last_use[p], key.0);
                }
            }
            self.prefix.map.remove(&key);
            stack.append(&mut self.prefix.children[x as usize]);
            if self.refcount[x as usize] == 0 {
                let t = self.prefix.last_use[x as usize];
                self.prefix.leaves.remove(&t);
                if self.prefix.idle.remove(&t).is_some() {
                    self.free.push(x);
                }
            }
        }
    }

    /// The cached block to evict when no cached block is a leaf, which happens only while
    /// tails that sequences chained under cached blocks they do not hold are in use (see
    /// [`KvCache::register`]): walking down from the least recently used cached block to the
    /// least recently used cached block below it, the first with none below. Evicting it frees
    /// it alone, so nothing more recently used goes with it; the blocks keyed under it (all in
    /// use) leave the index. `None` when nothing is cached.
    fn pinned_victim(&self) -> Option<u32> {
        let mut x = *self.prefix.idle.first_key_value()?.1;
        loop {
            let mut below: Option<(u64, u32)> = None;
            let mut stack = self.prefix.children[x as usize].clone();
            while let Some(c) = stack.pop() {
                let t = self.prefix.last_use[c as usize];
                // A registered block nobody references is cached.
                if self.refcount[c as usize] == 0 && below.is_none_or(|(bt, _)| t < bt) {
                    below = Some((t, c));
                }
                stack.extend_from_slice(&self.prefix.children[c as usize]);
            }
            match below {
                Some((_, c)) => x = c,
                None => return Some(x),
            }
        }
    }

    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// Blocks an allocation can take: free ones and cached ones nobody references.
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.prefix.idle.len()
    }

    /// Tokens that could still be appended across all sequences (whole free blocks only).
    pub fn free_tokens(&self) -> usize {
        self.free_blocks() * self.cfg.block_size
    }

    pub fn new_seq(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, Table::default());
        id
    }

    pub fn len(&self, seq: SeqId) -> Result<usize, RuntimeError> {
        Ok(self.table(seq)?.len)
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    fn table(&self, seq: SeqId) -> Result<&Table, RuntimeError> {
        self.seqs.get(&seq).ok_or(RuntimeError::UnknownSeq(seq.0))
    }

    fn alloc(&mut self) -> Result<u32, RuntimeError> {
        if self.free.is_empty() {
            // Evict the least recently used cached leaf: nothing is keyed under it, so it
            // goes alone.
            let b = match self.prefix.leaves.first_key_value() {
                Some((_, &b)) => b,
                None => self.pinned_victim().ok_or(RuntimeError::KvFull)?,
            };
            self.unregister(b);
        }
        let b = self.free.pop().ok_or(RuntimeError::KvFull)?;
        debug_assert_eq!(self.refcount[b as usize], 0);
        self.refcount[b as usize] = 1;
        Ok(b)
    }

    fn release(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        debug_assert!(*rc > 0, "double free of block {b}");
        *rc -= 1;
        if *rc == 0 {
            if self.prefix.key[b as usize].is_some() {
                self.prefix.tick += 1;
                let t = self.prefix.tick;
                self.prefix.last_use[b as usize] = t;
                self.prefix.idle.insert(t, b);
                if self.prefix.children[b as usize].is_empty() {
                    self.prefix.leaves.insert(t, b);
                }
            } else {
                self.free.push(b);
            }
        }
    }

    fn copy_block(&mut self, from: u32, to: u32) {
        if self.tp.is_some() {
            self.copies.push((from, to));
        }
        let n = self.cfg.block_size * self.cfg.kv_dim();
        let (f, t) = (from as usize * n, to as usize * n);
        match &mut self.pools {
            Pools::F16(p) => p.copy(f, t, n),
            Pools::F32(p) => p.copy(f, t, n),
            Pools::Int8V(p) => p.copy_block(&self.cfg, from as usize, to as usize),
            Pools::Int8(p) => p.copy_block(&self.cfg, from as usize, to as usize),
        }
    }

    /// Blocks needed to grow `seq` to `new_len` (including a copy-on-write of a shared tail).
    pub fn blocks_needed(&self, seq: SeqId, new_len: usize) -> Result<usize, RuntimeError> {
        let t = self.table(seq)?;
        let bs = self.cfg.block_size;
        let have = t.blocks.len();
        let want = new_len.div_ceil(bs);
        let mut n = want.saturating_sub(have);
        if new_len > t.len && t.len % bs != 0 {
            let last = t.blocks[t.len / bs];
            if self.refcount[last as usize] > 1 {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Makes room for positions `len..new_len` of `seq` (allocation is all-or-nothing).
    /// The positions become valid only through [`KvCache::set_len`] after they are written.
    pub fn reserve(&mut self, seq: SeqId, new_len: usize) -> Result<(), RuntimeError> {
        let need = self.blocks_needed(seq, new_len)?;
        if need > self.free_blocks() {
            return Err(RuntimeError::KvFull);
        }
        let bs = self.cfg.block_size;
        let t = self.table(seq)?.clone();
        let mut blocks = t.blocks;
        if new_len > t.len && t.len % bs != 0 {
            let i = t.len / bs;
            let last = blocks[i];
            if self.refcount[last as usize] > 1 {
                let nb = self.alloc()?;
                self.copy_block(last, nb);
                self.release(last);
                blocks[i] = nb;
            } else if self.prefix.key[last as usize].is_some() {
                // Only this sequence holds it and its tail is about to be rewritten.
                self.unregister(last);
            }
        }
        while blocks.len() < new_len.div_ceil(bs) {
            let b = self.alloc()?;
            blocks.push(b);
        }
        if let Some(tb) = self.seqs.get_mut(&seq) {
            tb.blocks = blocks;
        }
        Ok(())
    }

    /// Marks positions `0..len` as written; `len` must be covered by reserved blocks.
    pub fn set_len(&mut self, seq: SeqId, len: usize) -> Result<(), RuntimeError> {
        let bs = self.cfg.block_size;
        let t = self
            .seqs
            .get_mut(&seq)
            .ok_or(RuntimeError::UnknownSeq(seq.0))?;
        if len > t.blocks.len() * bs {
            return Err(RuntimeError::Config(format!(
                "set_len {len} beyond reserved {}",
                t.blocks.len() * bs
            )));
        }
        // Shrinking here would keep blocks that may be shared or registered, and the next
        // `reserve` would write into them: shorter goes through `truncate`.
        if len < t.len {
            return Err(RuntimeError::Config(format!(
                "set_len {len} below the length {} (truncate shortens)",
                t.len
            )));
        }
        t.len = len;
        Ok(())
    }

    /// Rolls `seq` back to `len` tokens and frees every whole block past it.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), RuntimeError> {
        let bs = self.cfg.block_size;
        let t = self
            .seqs
            .get_mut(&seq)
            .ok_or(RuntimeError::UnknownSeq(seq.0))?;
        if len > t.len {
            return Err(RuntimeError::Config(format!(
                "truncate to {len} beyond length {}",
                t.len
            )));
        }
        t.len = len;
        let keep = len.div_ceil(bs);
        let dropped: Vec<u32> = t.blocks.drain(keep..).collect();
        for b in dropped.into_iter().rev() {
            self.release(b);
        }
        Ok(())
    }

    /// A new sequence sharing `seq`'s first `len` tokens (whole blocks by reference).
    pub fn fork(&mut self, seq: SeqId, len: usize) -> Result<SeqId, RuntimeError> {
        let t = self.table(seq)?;
        if len > t.len {
            return Err(RuntimeError::Config(format!(
                "fork at {len} beyond length {}",
                t.len
            )));
        }
        let blocks: Vec<u32> = t.blocks[..len.div_ceil(self.cfg.block_size)].to_vec();
        for &b in &blocks {
            self.refcount[b as usize] += 1;
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, Table { blocks, len });
        Ok(id)
    }

    /// Drops a sequence and releases its blocks.
    pub fn remove(&mut self, seq: SeqId) -> Result<(), RuntimeError> {
        let t = self
            .seqs
            .remove(&seq)
            .ok_or(RuntimeError::UnknownSeq(seq.0))?;
        // Last block first: a prefix counts as used no earlier than the tails that hang from
        // it (which eviction takes first in any case, leaves first).
        for b in t.blocks.into_iter().rev() {
            self.release(b);
        }
        Ok(())
    }

    /// Physical slot of `pos` in `seq` (block × block_size + offset).
    #[inline]
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<usize, RuntimeError> {
        let t = self.table(seq)?;
        let bs = self.cfg.block_size;
        let b = *t
            .blocks
            .get(pos / bs)
            .ok_or_else(|| RuntimeError::Config(format!("position {pos} not reserved")))?;
        Ok(b as usize * bs + pos % bs)
    }

    /// Slots of positions `0..n` (for attention reads).
    pub fn slots(&self, seq: SeqId, n: usize, out: &mut Vec<u32>) -> Result<(), RuntimeError> {
        let t = self.table(seq)?;
        let bs = self.cfg.block_size;
        if n > t.blocks.len() * bs {
            return Err(RuntimeError::Config(format!("position {n} not reserved")));
        }
        out.clear();
        for p in 0..n {
            out.push(t.blocks[p / bs] * bs as u32 + (p % bs) as u32);
        }
        Ok(())
    }

    /// Sets the key offsets μ of an `int8` cache (see [`QPool`]): `n_layers × kv_dim` floats,
    /// heads side by side as [`KvCache::write`] takes keys. Only before anything is written,
    /// since keys already stored were centred on the old offsets; other element types store
    /// keys as they come and refuse.
    pub fn set_key_offsets(&mut self, offsets: &[f32]) -> Result<(), RuntimeError> {
        let (layers, d, hd) = (self.cfg.n_layers, self.cfg.kv_dim(), self.cfg.head_dim);
        let Pools::Int8(p) = &mut self.pools else {
            return Err(RuntimeError::Config(format!(
                "key offsets are for an int8 cache, not {}",
                self.cfg.dtype.name()
            )));
        };
        if offsets.len() != layers * d || offsets.iter().any(|x| !x.is_finite()) {
            return Err(RuntimeError::Config(format!(
                "key offsets: {} floats (finite) for {layers} layers × {d}, got {}",
                layers * d,
                offsets.len()
            )));
        }
        // Any block in use (written, or reserved and about to be) or kept for prefix reuse.
        if self.refcount.iter().any(|&r| r > 0) || !self.prefix.map.is_empty() {
            return Err(RuntimeError::Config(
                "key offsets are set before a cache holds keys".into(),
            ));
        }
        p.koff = offsets
            .chunks_exact(d)
            .map(|l| {
                let mut l = l.to_vec();
                l.chunks_exact_mut(hd).for_each(kernels::ops::hadamard);
                l
            })
            .collect();
        Ok(())
    }

    /// Writes one position's K and V (each `kv_dim` floats, heads side by side), rounded to the
    /// cache's element type.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        match &mut self.pools {
            Pools::F16(p) => p.write(&self.cfg, layer, slot, k, v),
            Pools::F32(p) => p.write(&self.cfg, layer, slot, k, v),
            Pools::Int8V(p) => p.write(&self.cfg, layer, slot, k, v),
            Pools::Int8(p) => p.write(&self.cfg, layer, slot, k, v),
        }
    }

    /// K of one position (gathered from the transposed block), for tests and debugging.
    pub fn read_k(&self, layer: usize, slot: usize) -> Vec<f32> {
        match &self.pools {
            Pools::F16(p) => read_k(&p.k[layer], &self.cfg, slot),
            Pools::F32(p) => read_k(&p.k[layer], &self.cfg, slot),
            Pools::Int8V(p) => p.read_k(&self.cfg, layer, slot),
            Pools::Int8(p) => p.read_k(&self.cfg, layer, slot),
        }
    }

    /// V of one position, for tests and debugging.
    pub fn read_v(&self, layer: usize, slot: usize) -> Vec<f32> {
        match &self.pools {
            Pools::F16(p) => p.read_v(&self.cfg, layer, slot),
            Pools::F32(p) => p.read_v(&self.cfg, layer, slot),
            Pools::Int8V(p) => p.read_v(&self.cfg, layer, slot),
            Pools::Int8(p) => p.read_v(&self.cfg, layer, slot),
        }
    }

    /// The block table of `seq`.
    pub fn blocks(&self, seq: SeqId) -> Result<&[u32], RuntimeError> {
        Ok(&self.table(seq)?.blocks)
    }

    /// Read access to one layer's K and V pools (layout in the module docs).
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        match &self.pools {
            Pools::F16(p) => LayerKv::F16(&p.k[layer], &p.v[layer]),
            Pools::F32(p) => LayerKv::F32(&p.k[layer], &p.v[layer]),
            Pools::Int8V(p) => LayerKv::Int8V {
                k: &p.k[layer],
                v: &p.v[layer],
                vscale: &p.vscale[layer],
            },
            Pools::Int8(p) => LayerKv::Int8 {
                k: &p.k[layer],
                kscale: &p.kscale[layer],
                v: &p.v[layer],
                vscale: &p.vscale[layer],
            },
        }
    }

    /// Repeats block copies a tensor-parallel leader made in its cache (copy-on-write), in
    /// order; indices are checked, since they arrive over the wire.
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), RuntimeError> {
        let nb = self.cfg.num_blocks as u32;
        if let Some(&(f, t)) = pairs.iter().find(|&&(f, t)| f >= nb || t >= nb) {
            return Err(RuntimeError::Invalid(format!(
                "block copy {f} -> {t} outside a cache of {nb} blocks"
            )));
        }
        for &(f, t) in pairs {
            self.copy_block(f, t);
        }
        Ok(())
    }

    /// The tensor-parallel sync tag (see the field).
    pub(crate) fn tp_tag(&self) -> Option<(u64, u64)> {
        self.tp
    }

    /// Tags the cache as held by the shard ranks of generation `epoch` under `id` (alive
    /// while `alive` is); the copy log starts empty.
    pub(crate) fn set_tp_tag(&mut self, tag: (u64, u64), alive: std::sync::Arc<()>) {
        self.tp = Some(tag);
        self.tp_alive = Some(alive);
        self.tp_lost = false;
        self.copies.clear();
    }

    /// The shard ranks no longer hold this cache's part (a link failed mid-forward, a rank
    /// restarted): its prefix cache is emptied and stays off until the cache is synced again,
    /// so no new sequence adopts blocks the ranks lost.
    pub(crate) fn mark_tp_lost(&mut self) {
        self.tp = None;
        self.tp_alive = None;
        self.tp_lost = true;
        self.copies.clear();
        self.clear_prefix_cache();
    }

    /// The block copies since the last call (for the shard ranks).
    pub(crate) fn take_copies(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.copies)
    }

    /// Whether any sequence holds computed positions.
    pub fn has_content(&self) -> bool {
        self.seqs.values().any(|t| t.len > 0)
    }

    /// Checks the allocator invariants; an error names the first violation.
    pub fn check(&self) -> Result<(), RuntimeError> {
        let mut refs = vec![0u32; self.cfg.num_blocks];
        for t in self.seqs.values() {
            if t.blocks.len() < t.len.div_ceil(self.cfg.block_size) {
                return Err(RuntimeError::Invariant(
                    "sequence longer than its blocks".into(),
                ));
            }
            for &b in &t.blocks {
                refs[b as usize] += 1;
            }
        }
        let mut is_free = vec![false; self.cfg.num_blocks];
        for &b in &self.free {
            if is_free[b as usize] {
                return Err(RuntimeError::Invariant(format!(
                    "block {b} twice on the free list"
                )));
            }
            if self.prefix.key[b as usize].is_some() {
                return Err(RuntimeError::Invariant(format!(
                    "block {b} on the free list but registered"
                )));
            }
            is_free[b as usize] = true;
        }
        let mut leaves = 0;
        for (&t, &b) in &self.prefix.idle {
            if is_free[b as usize] {
                return Err(RuntimeError::Invariant(format!(
                    "block {b} both free and cached"
                )));
            }
            if self.prefix.key[b as usize].is_none() || self.prefix.last_use[b as usize] != t {
                return Err(RuntimeError::Invariant(format!(
                    "cached block {b} not registered under its last use"
                )));
            }
            if self.prefix.children[b as usize].is_empty() {
                leaves += 1;
                if self.prefix.leaves.get(&t) != Some(&b) {
                    return Err(RuntimeError::Invariant(format!(
                        "cached leaf {b} not in the eviction order"
                    )));
                }
            }
            is_free[b as usize] = true;
        }
        if leaves != self.prefix.leaves.len() {
            return Err(RuntimeError::Invariant(
                "eviction order holds a block that is no cached leaf".into(),
            ));
        }
        for (b, kids) in self.prefix.children.iter().enumerate() {
            for &c in kids {
                if self.prefix.key[b].is_none()
                    || self.prefix.key[c as usize].as_ref().map(|k| k.0) != Some(b as u32)
                {
                    return Err(RuntimeError::Invariant(format!(
                        "block {b} lists {c}, which is not registered under it"
                    )));
                }
            }
        }
        let mut registered = 0;
        for (b, key) in self.prefix.key.iter().enumerate() {
            let Some(key) = key else { continue };
            registered += 1;
            if self.prefix.map.get(key) != Some(&(b as u32)) {
                return Err(RuntimeError::Invariant(format!(
                    "registered block {b} missing from the prefix index"
                )));
            }
            if key.1.len() != self.cfg.block_size {
                return Err(RuntimeError::Invariant(format!(
                    "registered block {b} keyed by {} tokens",
                    key.1.len()
                )));
            }
            if key.0 != ROOT
                && (self.prefix.key[key.0 as usize].is_none()
                    || !self.prefix.children[key.0 as usize].contains(&(b as u32)))
            {
                return Err(RuntimeError::Invariant(format!(
                    "registered block {b} under a parent that does not list it"
                )));
            }
        }
        if registered != self.prefix.map.len() {
            return Err(RuntimeError::Invariant(
                "prefix index holds unregistered blocks".into(),
            ));
        }
        for b in 0..self.cfg.num_blocks {
            if refs[b] != self.refcount[b] {
                return Err(RuntimeError::Invariant(format!(
                    "block {b}: refcount {} but {} references",
                    self.refcount[b], refs[b]
                )));
            }
            if (refs[b] == 0) != is_free[b] {
                return Err(RuntimeError::Invariant(format!(
                    "block {b} leaked or used while free"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    fn cache(blocks: usize) -> KvCache {
        KvCache::new(KvConfig {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 2,
            block_size: 4,
            num_blocks: blocks,
            dtype: KvDtype::F32,
        })
        .unwrap()
    }

    #[test]
    fn f16_pools_round_to_half_precision_and_fork_copies_them() {
        let mut c = KvCache::new(KvConfig {
            dtype: KvDtype::F16,
            ..cache(4).cfg.clone()
        })
        .unwrap();
        let a = c.new_seq();
        c.reserve(a, 2).unwrap();
        let x = [1.0f32 / 3.0, -70000.0 / 7.0, 1e-3, 2.5];
        let s0 = c.slot(a, 0).unwrap();
        c.write(1, s0, &x, &x);
        c.set_len(a, 2).unwrap();
        // Shorter goes through truncate (which unshares what it keeps writing into).
        assert!(c.set_len(a, 1).is_err());
        let want: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(c.read_k(1, s0), want);
        assert_eq!(c.read_v(1, s0), want);
        assert!((want[0] - x[0]).abs() < 1e-3 && want[0] != x[0]);
        // Copy-on-write of a shared half-full block carries the f16 contents along.
        let b = c.fork(a, 2).unwrap();
        c.reserve(b, 3).unwrap();
        assert_ne!(c.slot(b, 0).unwrap(), s0);
        assert_eq!(c.read_k(1, c.slot(b, 0).unwrap()), want);
        assert!(matches!(c.layer(0), LayerKv::F16(..)));
        assert!(KvDtype::parse("bf16").is_err());
        c.check().unwrap();
    }

    #[test]
    fn int8v_pools_keep_f16_keys_and_8_bit_value_rows_and_fork_copies_their_scales() {
        let mut c = KvCache::new(KvConfig {
            dtype: KvDtype::parse("int8v").unwrap(),
            ..cache(4).cfg.clone()
        })
        .unwrap();
        let a = c.new_seq();
        c.reserve(a, 2).unwrap();
        let x = [1.0f32 / 3.0, -70000.0 / 7.0, 1e-3, 2.5];
        let y = [0.25f32, -0.5, 0.125, 0.0];
        let (s0, s1) = (c.slot(a, 0).unwrap(), c.slot(a, 1).unwrap());
        c.write(1, s0, &x, &x);
        c.write(1, s1, &y, &y);
        c.set_len(a, 2).unwrap();
        let keys: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(c.read_k(1, s0), keys);
        // One scale per row and head (head_dim 2 here): within half a step of the row's own
        // largest value over 127, whatever the other rows hold.
        let close = |got: Vec<f32>, want: &[f32]| {
            for (h, (g, w)) in got.chunks(2).zip(want.chunks(2)).enumerate() {
                let step = w.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (g, w) in g.iter().zip(w) {
                    assert!((g - w).abs() <= 0.5 * step * 1.0001, "head {h}: {g} vs {w}");
                }
            }
        };
        close(c.read_v(1, s0), &x);
        close(c.read_v(1, s1), &y);
        let LayerKv::Int8V { v, vscale, .. } = c.layer(1) else {
            panic!("int8v pools")
        };
        assert_eq!(v[s0 * 4 + 1], -127);
        // [block][head][position], head 0 of the first row: its largest |v| is 10000.
        let h0 = (s0 / 4 * 2) * 4 + s0 % 4;
        assert!((vscale[h0] * 127.0 - 70000.0 / 7.0).abs() < 1e-2);
        // Copy-on-write of a shared half-full block carries codes and scales along.
        let b = c.fork(a, 2).unwrap();
        c.reserve(b, 3).unwrap();
        let t0 = c.slot(b, 0).unwrap();
        assert_ne!(t0, s0);
        assert_eq!(c.read_v(1, t0), c.read_v(1, s0));
        assert_eq!(c.read_k(1, t0), keys);
        c.check().unwrap();
    }

    #[test]
    fn int8_pools_rotate_each_key_row_and_fork_copies_its_scales() {
        let cfg = KvConfig {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
            num_blocks: 4,
            dtype: KvDtype::parse("int8").unwrap(),
        };
        let mut c = KvCache::new(cfg.clone()).unwrap();
        let a = c.new_seq();
        c.reserve(a, 2).unwrap();
        // Head 0 has one channel 100 times the others (as some models' keys do); head 1 not.
        let x: Vec<f32> = (0..16)
            .map(|i| {
                if i == 3 {
                    50.0
                } else {
                    0.5 * ((i as f32) * 0.7).sin()
                }
            })
            .collect();
        let (s0, s1) = (c.slot(a, 0).unwrap(), c.slot(a, 1).unwrap());
        c.write(1, s0, &x, &x);
        c.write(1, s1, &[0.0; 16], &[0.0; 16]);
        c.set_len(a, 2).unwrap();
        let LayerKv::Int8 { k, kscale, .. } = c.layer(1) else {
            panic!("int8 pools")
        };
        // [block][head][dim][position] codes and a [block][head][position] scale per row: the
        // rotated row's largest |x| over 127. Rotated, head 0's large channel is spread
        // evenly (50 / √8 in every element, give or take the small ones).
        let (b, off) = (s0 / 4, s0 % 4);
        let mut hx = x[..8].to_vec();
        kernels::ops::hadamard(&mut hx);
        let m = hx.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(m < 50.0 / 8f32.sqrt() + 2.0, "{m}");
        let ks = kscale[b * 2 * 4 + off];
        assert!((ks * 127.0 - m).abs() < 1e-4, "{ks}");
        for (d, &h) in hx.iter().enumerate() {
            let code = k[(b * 2 * 8 + d) * 4 + off] as f32;
            assert!((code * ks - h).abs() <= 0.5 * ks * 1.0001, "dim {d}");
        }
        // Read back, rotated back: the error's norm is at most half a step per element.
        let back = c.read_k(1, s0);
        for h in 0..2 {
            let err: f32 = (0..8)
                .map(|d| (back[h * 8 + d] - x[h * 8 + d]).powi(2))
                .sum::<f32>()
                .sqrt();
            let step = kscale[(b * 2 + h) * 4 + off];
            assert!(err <= 0.5 * step * 8f32.sqrt() * 1.0001, "head {h}: {err}");
        }
        // A zero row has scale 0 and reads back as zeros.
        assert_eq!(c.read_k(1, s1), vec![0.0; 16]);
        // Copy-on-write of the shared half-full block carries key codes and scales along.
        let f = c.fork(a, 2).unwrap();
        c.reserve(f, 3).unwrap();
        let t0 = c.slot(f, 0).unwrap();
        assert_ne!(t0, s0);
        assert_eq!(c.read_k(1, t0), back);
        assert_eq!(c.read_v(1, t0), c.read_v(1, s0));
        c.check().unwrap();
        // A NaN key makes its row's scale NaN (attention over it is NaN, as with floats).
        let mut bad = x.clone();
        bad[9] = f32::NAN;
        c.write(0, s1, &bad, &x);
        assert!(c.read_k(0, s1)[8..].iter().all(|v| v.is_nan()));
        // The rotation takes powers of two only.
        let e = KvCache::new(KvConfig { head_dim: 6, ..cfg });
        assert!(matches!(e, Err(RuntimeError::Config(m)) if m.contains("int8v")));
    }

    #[test]
    fn key_offsets_centre_int8_keys_and_are_set_before_any_key() {
        let cfg = |dtype| KvConfig {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 64,
            block_size: 4,
            num_blocks: 8,
            dtype,
        };
        // Keys with a near-constant large channel per head (as Qwen2.5's), the rest N(0, 1).
        let mut rng = kernels::rng::Rng::new(11);
        let rows: Vec<Vec<f32>> = (0..20)
            .map(|_| {
                (0..128)
                    .map(|c| {
                        let spike = match c {
                            63 => 150.0,
                            127 => -90.0,
                            _ => 0.0,
                        };
                        spike + rng.normal() as f32 * if spike != 0.0 { 0.3 } else { 1.0 }
                    })
                    .collect()
            })
            .collect();
        let fill = |c: &mut KvCache| -> Vec<usize> {
            let s = c.new_seq();
            c.reserve(s, rows.len()).unwrap();
            let slots: Vec<usize> = (0..rows.len()).map(|p| c.slot(s, p).unwrap()).collect();
            for (r, &slot) in rows.iter().zip(&slots) {
                c.write(0, slot, r, r);
                c.write(1, slot, r, r);
            }
            c.set_len(s, rows.len()).unwrap();
            slots
        };
        let mut f = KvCache::new(cfg(KvDtype::F32)).unwrap();
        let fs = fill(&mut f);
        let mu = key_means(&f, &fs);
        assert_eq!(mu.len(), 2 * 128);
        // Means rounded to sixteenths, the spikes found.
        assert!(mu.iter().all(|m| (m * 16.0).fract() == 0.0));
        assert!((mu[63] - 150.0).abs() < 0.5 && (mu[128 + 127] + 90.0).abs() < 0.5);
        let err = |c: &KvCache, slots: &[usize]| -> f64 {
            let mut e = 0f64;
            for (r, &slot) in rows.iter().zip(slots) {
                for (a, b) in c.read_k(0, slot).iter().zip(r) {
                    e += ((a - b) as f64).powi(2);
                }
            }
            e
        };
        let mut plain = KvCache::new(cfg(KvDtype::Int8)).unwrap();
        let ps = fill(&mut plain);
        let mut centred = KvCache::new(cfg(KvDtype::Int8)).unwrap();
        centred.set_key_offsets(&mu).unwrap();
        let cs = fill(&mut centred);
        // Read back (offset added, rotated back): with the offsets the rows span only their
        // variable part, and the rounding error falls by far more than 10×.
        let (ep, ec) = (err(&plain, &ps), err(&centred, &cs));
        assert!(ec * 10.0 < ep, "centred {ec}, plain {ep}");
        // Values are untouched by key offsets.
        assert_eq!(plain.read_v(0, ps[3]), centred.read_v(0, cs[3]));
        // Refused: a cache that already holds keys, a wrong length, a non-finite offset, and
        // element types that store keys as they come.
        let e = centred.set_key_offsets(&mu).unwrap_err();
        assert!(e.to_string().contains("before a cache holds keys"), "{e}");
        let mut fresh = KvCache::new(cfg(KvDtype::Int8)).unwrap();
        assert!(fresh.set_key_offsets(&mu[..128]).is_err());
        let mut nan = mu.clone();
        nan[5] = f32::NAN;
        assert!(fresh.set_key_offsets(&nan).is_err());
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Int8V] {
            let e = KvCache::new(cfg(dtype))
                .unwrap()
                .set_key_offsets(&mu)
                .unwrap_err();
            assert!(e.to_string().contains("int8 cache"), "{e}");
        }
        // Blocks reserved for a forward that has not committed yet hold keys too.
        let mut reserved = KvCache::new(cfg(KvDtype::Int8)).unwrap();
        let s = reserved.new_seq();
        reserved.reserve(s, 3).unwrap();
        assert!(reserved.set_key_offsets(&mu).is_err());
        reserved.remove(s).unwrap();
        reserved.set_key_offsets(&mu).unwrap();
        fresh.set_key_offsets(&mu).unwrap();
        // So do blocks no sequence holds any more but the prefix cache keeps for reuse: a
        // later sequence would read their keys under the new offsets.
        let mut kept = KvCache::new(cfg(KvDtype::Int8)).unwrap();
        kept.set_prefix_caching(true);
        let s = kept.new_seq();
        kept.reserve(s, 8).unwrap();
        kept.set_len(s, 8).unwrap();
        kept.register(s, &(0..8).collect::<Vec<u32>>()).unwrap();
        kept.remove(s).unwrap();
        assert_eq!(kept.cached_blocks(), 2, "two full blocks kept for reuse");
        let e = kept.set_key_offsets(&mu).unwrap_err();
        assert!(e.to_string().contains("before a cache holds keys"), "{e}");
        kept.clear_prefix_cache();
        kept.set_key_offsets(&mu).unwrap();
    }

    #[test]
    fn append_truncate_returns_blocks() {
        let mut c = cache(8);
        let s = c.new_seq();
        c.reserve(s, 10).unwrap();
        c.set_len(s, 10).unwrap();
        assert_eq!(c.free_blocks(), 5);
        c.truncate(s, 5).unwrap();
        assert_eq!(c.free_blocks(), 6);
        c.truncate(s, 0).unwrap();
        assert_eq!(c.free_blocks(), 8);
        c.check().unwrap();
    }

    #[test]
    fn fork_is_copy_on_write() {
        let mut c = cache(8);
        let a = c.new_seq();
        c.reserve(a, 6).unwrap();
        for p in 0..6 {
            let s = c.slot(a, p).unwrap();
            c.write(0, s, &[p as f32; 4], &[p as f32; 4]);
        }
        c.set_len(a, 6).unwrap();
        let b = c.fork(a, 6).unwrap();
        assert_eq!(c.free_blocks(), 6);
        // b appends into the shared half-full block: it must get its own copy.
        c.reserve(b, 7).unwrap();
        let sb = c.slot(b, 6).unwrap();
        c.write(0, sb, &[99.0; 4], &[99.0; 4]);
        c.set_len(b, 7).unwrap();
        assert_ne!(c.slot(a, 5).unwrap(), c.slot(b, 5).unwrap());
        assert_eq!(c.read_k(0, c.slot(b, 5).unwrap()), vec![5.0; 4]);
        assert_eq!(c.read_v(0, c.slot(b, 6).unwrap()), vec![99.0; 4]);
        assert_eq!(c.slot(a, 0).unwrap(), c.slot(b, 0).unwrap());
        c.check().unwrap();
        c.remove(a).unwrap();
        c.remove(b).unwrap();
        assert_eq!(c.free_blocks(), 8);
        c.check().unwrap();
    }

    #[test]
    fn full_cache_is_an_error_not_a_partial_allocation() {
        let mut c = cache(2);
        let s = c.new_seq();
        assert!(matches!(c.reserve(s, 9), Err(RuntimeError::KvFull)));
        assert_eq!(c.free_blocks(), 2);
        assert!(c.reserve(SeqId(999), 1).is_err());
    }

    #[test]
    fn ten_thousand_random_commit_rollback_cycles_leak_nothing() {
        let mut c = cache(64);
        let mut rng = Rng::new(42);
        let mut live: Vec<SeqId> = Vec::new();
        for _ in 0..10_000 {
            match rng.below(10) {
                0 if live.len() < 12 => live.push(c.new_seq()),
                1 if !live.is_empty() => {
                    let s = live.swap_remove(rng.below(live.len()));
                    c.remove(s).unwrap();
                }
                2 if !live.is_empty() => {
                    let s = live[rng.below(live.len())];
                    let len = c.len(s).unwrap();
                    let at = rng.below(len + 1);
                    if let Ok(f) = c.fork(s, at) {
                        live.push(f);
                    }
                }
                _ if !live.is_empty() => {
                    // A verification cycle: append k+1, keep a random accepted prefix.
                    let s = live[rng.below(live.len())];
                    let len = c.len(s).unwrap();
                    let k = 1 + rng.below(9);
                    if c.reserve(s, len + k).is_ok() {
                        c.set_len(s, len + k).unwrap();
                        let keep = len + rng.below(k + 1);
                        c.truncate(s, keep).unwrap();
                    } else if len > 0 {
                        c.truncate(s, rng.below(len)).unwrap();
                    }
                }
                _ => {}
            }
            c.check().unwrap();
        }
        for s in live {
            c.remove(s).unwrap();
        }
        assert_eq!(c.free_blocks(), 64);
        c.check().unwrap();
    }

    /// What a position's K and V hold in the prefix tests: a function of every token up to it,
    /// as a real model's would be.
    fn prefix_value(tokens: &[u32]) -> f32 {
        let h = tokens.iter().fold(17u64, |h, &t| {
            h.wrapping_mul(1_000_003).wrapping_add(t as u64)
        });
        (h % 100_003) as f32
    }

    /// Appends `new` to `seq` (whose tokens are `tokens`), writing each position's value.
    fn append(c: &mut KvCache, seq: SeqId, tokens: &mut Vec<u32>, new: &[u32]) -> bool {
        let len = c.len(seq).unwrap();
        assert_eq!(len, tokens.len());
        if c.reserve(seq, len + new.len()).is_err() {
            return false;
        }
        for &t in new {
            tokens.push(t);
            let v = prefix_value(tokens);
            let slot = c.slot(seq, tokens.len() - 1).unwrap();
            for l in 0..2 {
                c.write(l, slot, &[v; 4], &[-v; 4]);
            }
        }
        c.set_len(seq, tokens.len()).unwrap();
        true
    }

    fn assert_contents(c: &KvCache, seq: SeqId, tokens: &[u32]) {
        for p in 0..c.len(seq).unwrap() {
            let slot = c.slot(seq, p).unwrap();
            let v = prefix_value(&tokens[..=p]);
            for l in 0..2 {
                assert_eq!(c.read_k(l, slot), vec![v; 4], "position {p}");
                assert_eq!(c.read_v(l, slot), vec![-v; 4], "position {p}");
            }
        }
    }

    #[test]
    fn prefix_cache_shares_whole_blocks_of_equal_prefixes_only() {
        let mut c = cache(16);
        c.set_prefix_caching(true);
        let prompt: Vec<u32> = (0..10).collect();
        let (a, hit) = c.new_seq_with_prefix(&prompt, 10);
        assert_eq!(hit, 0);
        let mut ta = Vec::new();
        assert!(append(&mut c, a, &mut ta, &prompt));
        c.register(a, &ta).unwrap();
        // Two full blocks (8 tokens) are registered; the half-full third is not.
        let (b, hit) = c.new_seq_with_prefix(&prompt, 10);
        assert_eq!(hit, 8);
        assert_eq!(c.blocks(b).unwrap(), &c.blocks(a).unwrap()[..2]);
        let mut tb = prompt[..8].to_vec();
        assert_contents(&c, b, &tb);
        // b continues differently: its own blocks, a's untouched.
        assert!(append(&mut c, b, &mut tb, &[50, 51, 52]));
        assert_contents(&c, a, &ta);
        assert_contents(&c, b, &tb);
        // A prefix that differs in its second block matches the first only; `max_tokens` caps.
        let mut other = prompt.clone();
        other[5] = 99;
        let (d, hit) = c.new_seq_with_prefix(&other, 10);
        assert_eq!(hit, 4);
        let (e, hit) = c.new_seq_with_prefix(&prompt, 7);
        assert_eq!(hit, 4);
        // The same tokens at another offset are another prefix.
        let shifted: Vec<u32> = (4..14).collect();
        let (f, hit) = c.new_seq_with_prefix(&shifted, 10);
        assert_eq!(hit, 0);
        c.check().unwrap();
        for s in [a, b, d, e, f] {
            c.remove(s).unwrap();
        }
        // Everything is allocatable again; the registered blocks stay cached.
        assert_eq!(c.free_blocks(), 16);
        assert_eq!(c.cached_blocks(), 2);
        c.check().unwrap();
        let (g, hit) = c.new_seq_with_prefix(&prompt, 10);
        assert_eq!(hit, 8);
        assert_contents(&c, g, &prompt[..8]);
        assert_eq!(c.prefix_stats(), (60, 24));
        c.remove(g).unwrap();
        // Off: the cache is dropped and nothing matches.
        c.set_prefix_caching(false);
        assert_eq!(c.cached_blocks(), 0);
        let (h, hit) = c.new_seq_with_prefix(&prompt, 10);
        assert_eq!(hit, 0);
        c.remove(h).unwrap();
        c.check().unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_used_tails_first() {
        let mut c = cache(6);
        c.set_prefix_caching(true);
        let p1: Vec<u32> = (0..8).collect();
        let p2: Vec<u32> = (100..108).collect();
        for p in [&p1, &p2] {
            let (s, _) = c.new_seq_with_prefix(p, 8);
            let mut t = Vec::new();
            assert!(append(&mut c, s, &mut t, p));
            c.register(s, &t).unwrap();
            c.remove(s).unwrap();
        }
        assert_eq!((c.cached_blocks(), c.free_blocks()), (4, 6));
        // Three blocks: the two free ones, then the least recently used cached one: p1's
        // second block (a sequence's blocks are released last first, so tails go before the
        // prefixes they hang from).
        let s = c.new_seq();
        c.reserve(s, 12).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (3, 3));
        c.check().unwrap();
        let (x, hit) = c.new_seq_with_prefix(&p1, 8);
        assert_eq!(hit, 4);
        assert_contents(&c, x, &p1[..4]);
        c.remove(x).unwrap();
        // x's release made p1's first block the most recently used: p2's blocks go next,
        // its second before its first, then p1's.
        c.reserve(s, 16).unwrap();
        let (y, hit) = c.new_seq_with_prefix(&p2, 8);
        assert_eq!(hit, 4);
        c.remove(y).unwrap();
        c.reserve(s, 20).unwrap();
        let (x, hit) = c.new_seq_with_prefix(&p1, 8);
        assert_eq!(hit, 0);
        c.remove(x).unwrap();
        let (y, hit) = c.new_seq_with_prefix(&p2, 8);
        assert_eq!(hit, 4);
        assert_contents(&c, y, &p2[..4]);
        c.remove(y).unwrap();
        c.reserve(s, 24).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (0, 0));
        // Referenced blocks are never evicted: the cache is full.
        assert!(matches!(c.reserve(s, 25), Err(RuntimeError::KvFull)));
        c.check().unwrap();
    }

    #[test]
    fn a_cached_block_is_never_evicted_with_a_colder_one() {
        // a and b start together with the same first block, so each computes its own copy;
        // b registers after a, so b's second block is registered under a's first block, which
        // b does not hold.
        let p: Vec<u32> = (0..8).collect();
        let q: [u32; 8] = [0, 1, 2, 3, 50, 51, 52, 53];
        let r: Vec<u32> = (100..104).collect();
        let start = |c: &mut KvCache| {
            c.set_prefix_caching(true);
            let (a, _) = c.new_seq_with_prefix(&p, 8);
            let (b, _) = c.new_seq_with_prefix(&q, 8);
            let (mut ta, mut tb) = (Vec::new(), Vec::new());
            assert!(append(c, a, &mut ta, &p));
            assert!(append(c, b, &mut tb, &q));
            c.register(a, &ta).unwrap();
            c.register(b, &tb).unwrap();
            let (a0, b1) = (c.blocks(a).unwrap()[0], c.blocks(b).unwrap()[1]);
            c.remove(a).unwrap();
            c.check().unwrap();
            (b, a0, b1)
        };
        let mut c = cache(5);
        let (b, a0, b1) = start(&mut c);
        // Cached by last use: a's second block, a's first, r's block, b's second (b's first
        // is not registered: a's equal one is).
        let (d, _) = c.new_seq_with_prefix(&r, 4);
        let mut td = Vec::new();
        assert!(append(&mut c, d, &mut td, &r));
        c.register(d, &td).unwrap();
        c.remove(d).unwrap();
        c.remove(b).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (4, 5));
        c.check().unwrap();
        // Three blocks: the free one, a's second block, then r's: a's first block still has
        // b's second hanging from it, which was used more recently than r's and stays
        // (evicting a's first block would unregister it too).
        let s = c.new_seq();
        c.reserve(s, 12).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (2, 2));
        c.check().unwrap();
        let (x, hit) = c.new_seq_with_prefix(&r, 4);
        assert_eq!(hit, 0);
        c.remove(x).unwrap();
        let (y, hit) = c.new_seq_with_prefix(&q, 8);
        assert_eq!(hit, 8);
        assert_eq!(c.blocks(y).unwrap(), &[a0, b1]);
        assert_contents(&c, y, &q);
        c.remove(y).unwrap();
        // Now b's second block goes first, then a's first, which has become a leaf.
        c.reserve(s, 16).unwrap();
        let (y, hit) = c.new_seq_with_prefix(&q, 8);
        assert_eq!(hit, 4);
        assert_eq!(c.blocks(y).unwrap(), &[a0]);
        c.remove(y).unwrap();
        c.reserve(s, 20).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (0, 0));
        c.check().unwrap();

        // While b still holds its second block, a's first is no leaf; it is evicted once no
        // leaf is left (it counts as free, so a reservation that counted on it succeeds), and
        // b's second block leaves the index with it.
        let mut c = cache(4);
        let (b, _, _) = start(&mut c);
        assert_eq!((c.cached_blocks(), c.free_blocks()), (2, 2));
        let s = c.new_seq();
        c.reserve(s, 8).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (0, 0));
        c.check().unwrap();
        let (y, hit) = c.new_seq_with_prefix(&q, 8);
        assert_eq!(hit, 0);
        c.remove(y).unwrap();
        c.remove(b).unwrap();
        assert_eq!((c.cached_blocks(), c.free_blocks()), (0, 2));
        c.check().unwrap();
    }

    #[test]
    fn a_registered_block_is_never_rewritten() {
        let mut c = cache(12);
        c.set_prefix_caching(true);
        let p: Vec<u32> = (0..8).collect();
        let (a, _) = c.new_seq_with_prefix(&p, 8);
        let mut ta = Vec::new();
        assert!(append(&mut c, a, &mut ta, &p));
        c.register(a, &ta).unwrap();
        // a rolls back into its registered second block and writes there: that block leaves
        // the index (only a holds it), so nobody is handed the new contents under the old key.
        c.truncate(a, 6).unwrap();
        ta.truncate(6);
        assert!(append(&mut c, a, &mut ta, &[77, 78]));
        let (b, hit) = c.new_seq_with_prefix(&p, 8);
        assert_eq!(hit, 4);
        // b shares the first block; rolling b into it copies the block first.
        c.truncate(b, 2).unwrap();
        let mut tb = p[..2].to_vec();
        assert!(append(&mut c, b, &mut tb, &[5, 6, 7]));
        assert_contents(&c, a, &ta);
        assert_contents(&c, b, &tb);
        let (d, hit) = c.new_seq_with_prefix(&p, 8);
        assert_eq!(hit, 4);
        assert_contents(&c, d, &p[..4]);
        c.check().unwrap();
    }

    #[test]
    fn random_prefix_sharing_keeps_every_sequence_contents_and_leaks_nothing() {
        let mut c = cache(40);
        c.set_prefix_caching(true);
        let mut rng = Rng::new(7);
        // A few shared "system prompts", each sequence one of them plus its own tokens.
        let systems: Vec<Vec<u32>> = (0..3)
            .map(|s| (0..4 + 5 * s).map(|i| (s * 50 + i) as u32).collect())
            .collect();
        let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
        let mut hits = 0;
        for _ in 0..5_000 {
            match rng.below(8) {
                0 if live.len() < 8 => {
                    let mut prompt = systems[rng.below(3)].clone();
                    prompt.extend((0..rng.below(6)).map(|_| 200 + rng.below(3) as u32));
                    let (s, hit) = c.new_seq_with_prefix(&prompt, prompt.len() - 1);
                    hits += hit;
                    let mut t = prompt[..hit].to_vec();
                    if append(&mut c, s, &mut t, &prompt[hit..]) {
                        c.register(s, &t).unwrap();
                        live.push((s, t));
                    } else {
                        c.remove(s).unwrap();
                    }
                }
                1 if !live.is_empty() => {
                    let (s, t) = live.swap_remove(rng.below(live.len()));
                    assert_contents(&c, s, &t);
                    c.register(s, &t).unwrap();
                    c.remove(s).unwrap();
                }
                _ if !live.is_empty() => {
                    // A verification cycle: append k + 1, keep a random accepted prefix.
                    let i = rng.below(live.len());
                    let (s, mut t) = live[i].clone();
                    let k = 1 + rng.below(5);
                    let new: Vec<u32> = (0..k).map(|_| 200 + rng.below(3) as u32).collect();
                    if append(&mut c, s, &mut t, &new) {
                        let keep = t.len() - k + rng.below(k + 1);
                        c.truncate(s, keep).unwrap();
                        t.truncate(keep);
                    }
                    live[i].1 = t;
                }
                _ => {}
            }
            c.check().unwrap();
        }
        assert!(hits > 1000, "prefix hits {hits}");
        for (s, t) in live {
            assert_contents(&c, s, &t);
            c.remove(s).unwrap();
        }
        assert_eq!(c.free_blocks(), 40);
        c.check().unwrap();
    }
}
