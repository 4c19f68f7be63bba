//! Tensor parallelism across processes (Megatron-style), so one target worker can serve a model
//! larger than one machine's (or one device's) memory.
//!
//! A group of `world` ranks splits every layer: rank r holds KV heads `r·H_kv/world ..` (and
//! their query heads), the matching rows of `q`, `k`, `v` and columns of the output projection,
//! and FFN columns `r·F/world ..` (rows of `gate`/`up`, columns of `down`). Each rank's share of
//! an output projection is a partial sum; the shares add up to the whole. Rank 0 is the engine:
//! embedding, norms, LM head, sampling and the paged KV cache's bookkeeping stay there. Per
//! layer it sends the normalized rows to the other ranks, computes its own share while they
//! compute theirs, and adds their shares in rank order (so a forward is deterministic), twice
//! per layer: 4·n·d floats per rank and layer each way.
//!
//! The other ranks ([`serve`]) hold only K/V blocks for their heads. Block tables, positions
//! and copy-on-write copies come from rank 0 with each forward, so rollback, forks and prefix
//! sharing need no message of their own. A rank that restarts has lost its blocks: rank 0
//! reconnects at the next forward, and a cache that still holds sequences computed before is
//! refused once (its requests fail and are continued elsewhere) and then starts over.
//!
//! An `int8` cache subtracts fixed key offsets before it rounds (see `kv::QPool`). Rank 0
//! estimates them at load with one forward over tokens spread over the vocabulary, in which every rank
//! returns the mean keys of its heads; rank 0 keeps them and sends each rank its share with
//! every new `int8` cache, so a rank that restarts gets them back with its next cache.
//!
//! The link is TCP (Nagle off) with a small framed protocol, as gloo's CPU collectives are;
//! on GPUs the same split would run over NCCL.

use crate::config::ModelConfig;
use crate::gguf::RawTensor;
use crate::kv::{KvCache, KvConfig, KvDtype};
use crate::model::{Clock, ForwardProfile, Model};
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bumped whenever the frames below change; ranks of different versions refuse each other.
/// 3: the leader claims its ranks (CLAIM) once every one answered its hello, and always sends
/// its identity.
pub const PROTOCOL_VERSION: u32 = 3;

const HELLO: u8 = 1;
const OK: u8 = 2;
const ERR: u8 = 3;
const BEGIN: u8 = 4;
const DATA: u8 = 5;
/// After every rank answered its hello: the leader's session starts. Until then a rank keeps
/// serving the leader it has, so a leader that reaches some ranks and not the others takes none.
const CLAIM: u8 = 6;
/// Largest frame either side accepts (a prefill chunk of 64k tokens × d 4096 fits).
const MAX_FRAME: usize = 1 << 30;
/// Largest hello (read before the peer is known).
const MAX_HELLO: usize = 1 << 16;
/// Most tokens one forward may carry.
const MAX_TOKENS: usize = 1 << 18;
/// Most sequences one forward may carry.
const MAX_SEQS: usize = 1 << 20;
/// Most slots (blocks × block size) of one KV cache on a rank.
const MAX_CACHE_SLOTS: usize = 1 << 28;
/// KV caches one shard rank keeps for its leader (the engine's, plus profiling and benches).
/// Rank 0 refuses to start one more while this many are live, so a rank never has to drop one
/// it still uses.
const MAX_CACHES: usize = 4;

/// This rank and the size of its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Self { rank: 0, world: 1 }
    }
}

/// One rank's slice of the heads and the FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub head0: usize,
    pub kv_head0: usize,
    pub ffn0: usize,
}

impl Local {
    pub fn q_dim(&self, head_dim: usize) -> usize {
        self.heads * head_dim
    }
    pub fn kv_dim(&self, head_dim: usize) -> usize {
        self.kv_heads * head_dim
    }
}

impl Shard {
    /// This rank's slice of `cfg`. The degree divides the KV heads (each rank holds whole KV
    /// groups), or is a multiple of them that divides the query heads (each KV head is
    /// replicated on `degree / kv_heads` ranks, each with its share of that head's query
    /// heads, as vLLM does); either way it divides the FFN width.
    pub fn local(&self, cfg: &ModelConfig) -> Result<Local> {
        let w = self.world;
        if w == 0 || self.rank >= w {
            return Err(RuntimeError::Config(format!(
                "tensor-parallel rank {} of {w}",
                self.rank
            )));
        }
        if !Self::fits(cfg, w) {
            return Err(RuntimeError::Config(format!(
                "tensor-parallel degree {w} must divide the KV heads ({}) or be a multiple of \
                 them dividing the query heads ({}), and divide the FFN width ({}); degrees \
                 that do: {:?}",
                cfg.n_kv_heads,
                cfg.n_heads,
                cfg.ffn_dim,
                Self::degrees(cfg)
            )));
        }
        let heads = cfg.n_heads / w;
        let f = cfg.ffn_dim / w;
        let (kv, kv_head0) = if cfg.n_kv_heads.is_multiple_of(w) {
            (cfg.n_kv_heads / w, self.rank * cfg.n_kv_heads / w)
        } else {
            // Ranks r·kv/w share a KV head: its query heads are split among them.
            (1, self.rank * cfg.n_kv_heads / w)
        };
        Ok(Local {
            heads,
            kv_heads: kv,
            ffn: f,
            head0: self.rank * heads,
            kv_head0,
            ffn0: self.rank * f,
        })
    }

    fn fits(cfg: &ModelConfig, w: usize) -> bool {
        let heads_split = cfg.n_kv_heads.is_multiple_of(w)
            || (w.is_multiple_of(cfg.n_kv_heads) && cfg.n_heads.is_multiple_of(w));
        w >= 1 && heads_split && cfg.ffn_dim.is_multiple_of(w)
    }

    /// The degrees `cfg` splits into (block alignment of quantized weights aside).
    pub fn degrees(cfg: &ModelConfig) -> Vec<usize> {
        (1..=cfg.n_heads).filter(|&w| Self::fits(cfg, w)).collect()
    }
}

/// [`TpOptions::io_timeout`] unless set.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How a tensor-parallel rank loads and links.
#[derive(Clone, Debug)]
pub struct TpOptions {
    pub rank: usize,
    pub world: usize,
    /// On rank 0: the other ranks' addresses (`host:port`), rank 1 first.
    pub peers: Vec<String>,
    /// How long rank 0 waits at load for the other ranks to come up (they load the same
    /// checkpoint at the same time).
    pub connect_timeout: Duration,
    /// How long one exchange (one read or write on a link) may take before the link counts as
    /// lost: a rank that hangs (stopped, swapping) holds rank 0's forward, and the engine
    /// waiting on it, this long. Not zero.
    pub io_timeout: Duration,
}

impl TpOptions {
    /// Rank 0 of a group whose other ranks listen at `peers`.
    pub fn leader(peers: Vec<String>) -> Self {
        Self {
            rank: 0,
            world: peers.len() + 1,
            peers,
            connect_timeout: Duration::from_secs(600),
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }

    /// Rank `rank` of `world`, served with [`serve`].
    pub fn shard(rank: usize, world: usize) -> Self {
        Self {
            rank,
            world,
            peers: Vec::new(),
            connect_timeout: Duration::ZERO,
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }
}

/// Which part of a matrix (`rows × cols`, outputs × inputs) a rank loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Whole,
    Rows(usize, usize),
    Cols(usize, usize),
}

impl Part {
    pub(crate) fn rows(s: Shard, r: Range<usize>) -> Self {
        if s.world == 1 {
            Part::Whole
        } else {
            Part::Rows(r.start, r.end)
        }
    }
    pub(crate) fn cols(s: Shard, r: Range<usize>) -> Self {
        if s.world == 1 {
            Part::Whole
        } else {
            Part::Cols(r.start, r.end)
        }
    }
}

/// A column part widened to whole blocks of `be` values, and its start's offset in them.
pub(crate) fn block_aligned(part: Part, be: usize) -> (Part, usize) {
    match part {
        Part::Cols(a, b) if be > 1 => {
            let (a0, b0) = (a / be * be, b.div_ceil(be) * be);
            (Part::Cols(a0, b0), a - a0)
        }
        p => (p, 0),
    }
}

/// Cuts a rank's rows or columns out of a GGUF matrix before it is repacked. Quantized blocks
/// run along a row, so a column cut must fall on block boundaries ([`block_aligned`] widens
/// one that does not; the rank pads its input with zeros, and the weights stay as stored).
pub(crate) fn slice_raw(raw: RawTensor, part: Part, name: &str) -> Result<RawTensor> {
    if part == Part::Whole {
        return Ok(raw);
    }
    let (rows, cols) = match raw.dims.as_slice() {
        [r, c] => (*r, *c),
        d => {
            return Err(RuntimeError::Config(format!(
                "`{name}`: expected a matrix, got dims {d:?}"
            )));
        }
    };
    let (be, bb) = (raw.ty.block_elems(), raw.ty.block_bytes());
    if !cols.is_multiple_of(be) {
        return Err(RuntimeError::Config(format!(
            "`{name}`: {cols} columns are not whole {} blocks",
            raw.ty.name()
        )));
    }
    let row_bytes = cols / be * bb;
    match part {
        Part::Whole => Ok(raw),
        Part::Rows(a, b) => {
            if a > b || b > rows {
                return Err(RuntimeError::Config(format!(
                    "`{name}`: rows {a}..{b} of {rows}"
                )));
            }
            Ok(RawTensor {
                ty: raw.ty,
                dims: vec![b - a, cols],
                data: raw.data[a * row_bytes..b * row_bytes].to_vec(),
            })
        }
        Part::Cols(a, b) => {
            if a > b || b > cols {
                return Err(RuntimeError::Config(format!(
                    "`{name}`: columns {a}..{b} of {cols}"
                )));
            }
            if !a.is_multiple_of(be) || !b.is_multiple_of(be) {
                return Err(RuntimeError::Config(format!(
                    "`{name}`: columns {a}..{b} cut {} blocks of {be}",
                    raw.ty.name()
                )));
            }
            let (ba, bz) = (a / be * bb, b / be * bb);
            let mut data = Vec::with_capacity(rows * (bz - ba));
            for r in 0..rows {
                data.extend_from_slice(&raw.data[r * row_bytes + ba..r * row_bytes + bz]);
            }
            Ok(RawTensor {
                ty: raw.ty,
                dims: vec![rows, b - a],
                data,
            })
        }
    }
}

/// Where a forward's tokens sit: per sequence its first token in the flattened batch and its
/// count, its first position and its block table; per token its position and cache slot.
pub(crate) struct BatchMeta {
    pub(crate) seqs: Vec<(usize, usize)>,
    pub(crate) starts: Vec<usize>,
    pub(crate) blocks: Vec<Vec<u32>>,
    pub(crate) tok_pos: Vec<usize>,
    pub(crate) tok_slot: Vec<usize>,
}

impl BatchMeta {
    /// From each sequence's (first position, new tokens) and block table; the blocks must
    /// cover every new position (the caller reserved them).
    pub(crate) fn new(pos_len: Vec<(usize, usize)>, blocks: Vec<Vec<u32>>, bs: usize) -> Self {
        let mut m = BatchMeta {
            seqs: Vec::with_capacity(pos_len.len()),
            starts: Vec::with_capacity(pos_len.len()),
            blocks,
            tok_pos: Vec::new(),
            tok_slot: Vec::new(),
        };
        let mut t0 = 0;
        for (i, &(start, nt)) in pos_len.iter().enumerate() {
            m.seqs.push((t0, nt));
            m.starts.push(start);
            for p in start..start + nt {
                m.tok_pos.push(p);
                m.tok_slot.push(m.blocks[i][p / bs] as usize * bs + p % bs);
            }
            t0 += nt;
        }
        m
    }

    fn encode(&self, out: &mut Vec<u32>) {
        out.push(self.seqs.len() as u32);
        for (i, &(_, nt)) in self.seqs.iter().enumerate() {
            out.push(self.starts[i] as u32);
            out.push(nt as u32);
            out.push(self.blocks[i].len() as u32);
            out.extend_from_slice(&self.blocks[i]);
        }
    }

    /// Reads what [`BatchMeta::encode`] wrote, checking every index against the cache shape
    /// and the context, since it arrives over the wire.
    fn decode(w: &mut Words<'_>, bs: usize, num_blocks: usize, max_ctx: usize) -> Result<Self> {
        let n_seqs = w.next()? as usize;
        if n_seqs > MAX_SEQS {
            return Err(bad(format!("{n_seqs} sequences")));
        }
        let mut pos_len = Vec::with_capacity(n_seqs);
        let mut blocks = Vec::with_capacity(n_seqs);
        let mut total = 0usize;
        for _ in 0..n_seqs {
            let (start, nt, nb) = (w.next()? as usize, w.next()? as usize, w.next()? as usize);
            total += nt;
            if start + nt > max_ctx || total > MAX_TOKENS {
                return Err(bad(format!(
                    "positions {start}..{} past the context of {max_ctx}",
                    start + nt
                )));
            }
            if nb > num_blocks || nb * bs < start + nt {
                return Err(bad(format!(
                    "{nb} blocks for positions up to {}",
                    start + nt
                )));
            }
            let b = w.take(nb)?;
            if let Some(x) = b.iter().find(|&&x| x as usize >= num_blocks) {
                return Err(bad(format!("block {x} of a cache of {num_blocks}")));
            }
            pos_len.push((start, nt));
            blocks.push(b.to_vec());
        }
        Ok(Self::new(pos_len, blocks, bs))
    }
}

fn bad(what: String) -> RuntimeError {
    RuntimeError::Tp(format!("malformed forward from rank 0: {what}"))
}

/// A cursor over the words of a frame.
struct Words<'a>(&'a [u32]);

impl<'a> Words<'a> {
    fn next(&mut self) -> Result<u32> {
        let (&x, rest) = self
            .0
            .split_first()
            .ok_or_else(|| bad("frame ends early".into()))?;
        self.0 = rest;
        Ok(x)
    }
    fn take(&mut self, n: usize) -> Result<&'a [u32]> {
        if n > self.0.len() {
            return Err(bad("frame ends early".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
}

#[derive(Serialize, Deserialize)]
struct Hello {
    version: u32,
    rank: usize,
    world: usize,
    config: ModelConfig,
    fingerprint: u64,
    /// This leader's identity, random per group and never 0 (0: none sent, which a rank
    /// refuses): a rank that another leader took from this one refuses it back while that
    /// other is linked.
    #[serde(default)]
    leader: u64,
}

/// How long a rank has to answer a leader's hello: it answers from its accept loop at once,
/// so one that does not within this is hung, whatever the exchanges' timeout. Well above
/// [`HANDSHAKE_TIMEOUT`], which one silent connection ahead in the rank's accept loop may take.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rank gives a connection to send its whole hello (a leader sends it at once), not
/// per read: one that trickles it in holds up the rank's accept loop no longer than this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a rank waits, after it answered a leader's hello, for that leader's claim: the
/// leader sends it once every other rank answered too, each within its connect and hello
/// timeouts.
const CLAIM_TIMEOUT: Duration = Duration::from_secs(120);
/// How a rank's refusal of a leader it was taken from begins: a wait, not a mismatch, so the
/// leader goes on trying (at load too) instead of giving up.
const TAKEN_OVER: &str = "taken over:";

/// TCP keep-alive on a link, so a peer whose host vanished (no FIN, no RST) shows as gone in
/// about 25 s, however long the link sits idle: a rank otherwise counts such a leader as
/// holding it for ever, and an idle leader would only learn at its next forward's timeout.
fn keep_alive(s: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(s).set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keep-alive not set: {e}");
    }
}

/// What dialling the ranks takes, apart from the links: the redial thread dials with a copy,
/// without holding the group's lock, so a rank that accepts and never answers holds up
/// neither forwards nor admission while it is dialled.
#[derive(Clone)]
pub(crate) struct Dialer {
    opts: TpOptions,
    hello: Vec<Vec<u8>>,
}

impl Dialer {
    /// Connects every other rank and checks it holds the same checkpoint in the same place.
    pub(crate) fn dial(&self) -> Result<Vec<TcpStream>> {
        let mut buf = Vec::new();
        let mut links = Vec::with_capacity(self.opts.peers.len());
        for (i, addr) in self.opts.peers.iter().enumerate() {
            let rank = i + 1;
            let unreachable = |e: String| RuntimeError::Tp(format!("rank {rank} at {addr}: {e}"));
            // `host:port` written wrong will not resolve later either.
            if !crate::tp::is_host_port(addr) {
                return Err(RuntimeError::Config(format!(
                    "tensor-parallel rank {rank}: `{addr}` is not HOST:PORT"
                )));
            }
            // Every address the name resolves to, in order (`localhost` may give ::1 first
            // to a rank listening on 127.0.0.1), as `TcpStream::connect` would.
            let addrs: Vec<std::net::SocketAddr> = addr
                .to_socket_addrs()
                .map_err(|e| unreachable(e.to_string()))?
                .collect();
            let mut last = unreachable("no address".into());
            let mut conn = None;
            for sa in &addrs {
                match TcpStream::connect_timeout(sa, Duration::from_secs(5)) {
                    Ok(s) => {
                        conn = Some(s);
                        break;
                    }
                    Err(e) => last = unreachable(e.to_string()),
                }
            }
            let Some(mut s) = conn else {
                return Err(last);
            };
            s.set_nodelay(true)?;
            keep_alive(&s);
            let answer_by = Instant::now() + self.opts.io_timeout.min(HELLO_TIMEOUT);
            s.set_write_timeout(Some(self.opts.io_timeout))?;
            write_frame(&mut s, HELLO, &self.hello[i], &mut buf)
                .map_err(|e| unreachable(e.to_string()))?;
            // The answer is a hello's size: whatever else listens at a stale address (an HTTP
            // port answers `HTTP/1.1 400`, read as a frame of 790 MB) is refused unread.
            let answer = read_frame_by(&mut s, &mut buf, MAX_HELLO, answer_by).map_err(|e| {
                unreachable(if e.kind() == std::io::ErrorKind::InvalidData {
                    format!("answered the hello with {e}: not a `dspark tp-shard` port?")
                } else {
                    e.to_string()
                })
            })?;
            match answer {
                OK => {
                    s.set_read_timeout(Some(self.opts.io_timeout))?;
                    links.push(s)
                }
                ERR => {
                    let why = String::from_utf8_lossy(&buf);
                    let msg = format!("tensor-parallel rank {rank} at {addr} refused: {why}");
                    return Err(if why.starts_with(TAKEN_OVER) {
                        RuntimeError::Tp(msg)
                    } else {
                        RuntimeError::Config(msg)
                    });
                }
                k => return Err(unreachable(format!("answered frame {k} to hello"))),
            }
        }
        // Every rank answered: only now do they drop the leader they serve for this one.
        for (i, s) in links.iter_mut().enumerate() {
            write_frame(s, CLAIM, &[], &mut buf).map_err(|e| {
                RuntimeError::Tp(format!("rank {} at {}: {e}", i + 1, self.opts.peers[i]))
            })?;
        }
        Ok(links)
    }
}

/// A random identity for a leader (no two groups share one, across processes and restarts).
fn leader_id() -> u64 {
    random_id()
}

/// A random, nonzero 64-bit identity (this process, this instant, a randomly keyed hash): for
/// identities that must differ across processes and restarts, not for secrets.
pub fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish().max(1)
}

fn write_frame(
    s: &mut TcpStream,
    kind: u8,
    payload: &[u8],
    buf: &mut Vec<u8>,
) -> std::io::Result<()> {
    buf.clear();
    buf.push(kind);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(buf)
}

fn write_f32s(s: &mut TcpStream, x: &[f32], buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    buf.push(DATA);
    buf.extend_from_slice(&((x.len() * 4) as u32).to_le_bytes());
    for v in x {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(buf)
}

fn words_bytes(w: &[u32], out: &mut Vec<u8>) {
    out.clear();
    for x in w {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

fn bytes_words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Reads one frame into `buf`; returns its kind.
fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<u8> {
    read_frame_max(s, buf, MAX_FRAME)
}

fn read_frame_max(s: &mut TcpStream, buf: &mut Vec<u8>, max: usize) -> std::io::Result<u8> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let len = frame_len(&h, max)?;
    buf.resize(len, 0);
    s.read_exact(buf)?;
    Ok(h[0])
}

/// A frame header's length, refused past `max`.
fn frame_len(h: &[u8; 5], max: usize) -> std::io::Result<usize> {
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (at most {max} here)"),
        ));
    }
    Ok(len)
}

/// [`read_frame_max`] by `deadline`, however slowly the bytes come (each read waits only what
/// is left); leaves the stream's read timeout set.
fn read_frame_by(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    max: usize,
    deadline: Instant,
) -> std::io::Result<u8> {
    let mut h = [0u8; 5];
    read_exact_by(s, &mut h, deadline)?;
    let len = frame_len(&h, max)?;
    buf.resize(len, 0);
    read_exact_by(s, buf, deadline)?;
    Ok(h[0])
}

fn read_exact_by(s: &mut TcpStream, mut b: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    while !b.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer did not send a whole frame in time",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(b) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => b = &mut b[k..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // The read timeout (what was left) ran out.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the peer did not send a whole frame in time",
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads a DATA frame of exactly `out.len()` floats; an ERR frame's text becomes the error.
fn read_f32s(s: &mut TcpStream, buf: &mut Vec<u8>, out: &mut [f32], add: bool) -> Result<()> {
    let kind = read_frame(s, buf)?;
    if kind == ERR {
        return Err(RuntimeError::Tp(String::from_utf8_lossy(buf).into_owned()));
    }
    if kind != DATA || buf.len() != out.len() * 4 {
        return Err(RuntimeError::Tp(format!(
            "expected {} values, got frame {kind} of {} bytes",
            out.len(),
            buf.len()
        )));
    }
    for (o, c) in out.iter_mut().zip(buf.chunks_exact(4)) {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if add {
            *o += v;
        } else {
            *o = v;
        }
    }
    Ok(())
}

/// Rank 0's link state, readable without waiting for a forward (metrics, the redial loop).
#[derive(Debug, Default)]
pub struct LinkState {
    up: std::sync::atomic::AtomicBool,
    connects: std::sync::atomic::AtomicU64,
}

impl LinkState {
    /// Whether every other rank is linked.
    pub fn up(&self) -> bool {
        self.up.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// Successful (re)connections of the group, the first included.
    pub fn connects(&self) -> u64 {
        self.connects.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Rank 0's links to the other ranks.
pub(crate) struct Group {
    pub(crate) state: Arc<LinkState>,
    dialer: Dialer,
    /// A redial runs outside the lock ([`Self::start_redial`]): forwards fail at once meanwhile
    /// rather than dial too (a second dial would take the ranks from the first).
    dialing: bool,
    links: Vec<TcpStream>,
    /// Bumped at every (re)connection: caches synced under an older one are stale.
    epoch: u64,
    next_cache: u64,
    /// Caches synced in this epoch; a dead one is released on the ranks at the next forward.
    live: Vec<(u64, std::sync::Weak<()>)>,
    buf: Vec<u8>,
    words: Vec<u32>,
    /// Set for the calibration forward: every rank sends its heads' mean keys after it.
    pub(crate) calibrate: bool,
    /// Per other rank, the key offsets its new `int8` caches get (empty: none).
    pub(crate) key_offsets: Vec<Vec<f32>>,
    /// The model's width: a forward's frames carry `n × d_model` floats.
    d_model: usize,
}

impl Group {
    pub(crate) fn connect(t: &TpOptions, cfg: ModelConfig, fingerprint: u64) -> Result<Self> {
        if t.peers.len() + 1 != t.world {
            return Err(RuntimeError::Config(format!(
                "tensor-parallel degree {} needs {} peer addresses, got {}",
                t.world,
                t.world - 1,
                t.peers.len()
            )));
        }
        if t.io_timeout.is_zero() {
            return Err(RuntimeError::Config(
                "the tensor-parallel links' I/O timeout must be above zero".into(),
            ));
        }
        let d_model = cfg.d_model;
        let leader = leader_id();
        let hello = (1..t.world)
            .map(|rank| {
                serde_json::to_vec(&Hello {
                    version: PROTOCOL_VERSION,
                    rank,
                    world: t.world,
                    config: cfg.clone(),
                    fingerprint,
                    leader,
                })
                .map_err(|e| RuntimeError::Tp(e.to_string()))
            })
            .collect::<Result<_>>()?;
        let mut g = Group {
            state: Arc::default(),
            dialer: Dialer {
                opts: t.clone(),
                hello,
            },
            dialing: false,
            links: Vec::new(),
            epoch: 0,
            next_cache: 0,
            live: Vec::new(),
            buf: Vec::new(),
            words: Vec::new(),
            calibrate: false,
            key_offsets: Vec::new(),
            d_model,
        };
        let deadline = Instant::now() + t.connect_timeout;
        let mut said: Option<Instant> = None;
        loop {
            match g.dial() {
                Ok(()) => return Ok(g),
                // A refusal (another checkpoint, version or rank) will not go away.
                Err(e @ RuntimeError::Config(_)) => return Err(e),
                Err(e) if Instant::now() < deadline => {
                    if said.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::info!("waiting for the tensor-parallel ranks: {e}");
                        said = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Connects every other rank and checks it holds the same checkpoint in the same place.
    fn dial(&mut self) -> Result<()> {
        self.reset();
        let links = self.dialer.dial()?;
        self.install(links);
        Ok(())
    }

    /// Takes freshly dialled links: a new epoch.
    fn install(&mut self, links: Vec<TcpStream>) {
        self.links = links;
        self.epoch += 1;
        self.live.clear();
        self.state
            .connects
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.state
            .up
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Between forwards nothing may arrive on a link: a link that reads as closed, failed or
    /// holding data is dropped, so a rank lost while the worker is idle shows at once (and is
    /// redialled) instead of failing the next request.
    pub(crate) fn probe(&mut self) {
        let mut b = [0u8; 1];
        let dead = self.links.iter().any(|s| {
            if s.set_nonblocking(true).is_err() {
                return true;
            }
            let r = s.peek(&mut b);
            let back = s.set_nonblocking(false);
            !matches!(r, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock) || back.is_err()
        });
        if dead {
            tracing::warn!("a tensor-parallel rank's link closed while idle");
            self.reset();
        }
    }

    /// Whether the ranks hold `cache`'s part: linked, and in the epoch the cache was synced in.
    pub(crate) fn holds(&self, cache: &KvCache) -> bool {
        !self.links.is_empty() && cache.tp_tag().map(|(e, _)| e) == Some(self.epoch)
    }

    /// Begins a redial if the links are down and none is under way: the dialer to dial with,
    /// outside the lock, handing the result to [`Self::finish_redial`].
    pub(crate) fn start_redial(&mut self) -> Option<Dialer> {
        if !self.links.is_empty() || self.dialing {
            return None;
        }
        self.dialing = true;
        Some(self.dialer.clone())
    }

    /// Ends a redial: `Ok(true)` when it relinked (no cache is touched: the next forward
    /// syncs).
    pub(crate) fn finish_redial(&mut self, dialled: Result<Vec<TcpStream>>) -> Result<bool> {
        self.dialing = false;
        // (Links installed meanwhile, which nothing does, are dead now: the ranks took this
        // leader's new hello over them.)
        self.install(dialled?);
        Ok(true)
    }

    /// Whether a redial is under way outside the lock.
    pub(crate) fn dialing(&self) -> bool {
        self.dialing
    }

    /// Clears the dialling flag (a redial that did not finish: its dial panicked).
    pub(crate) fn abandon_redial(&mut self) {
        self.dialing = false;
    }

    /// Drops the links (a forward stopped half way: the ranks' frames are out of step).
    pub(crate) fn reset(&mut self) {
        self.links.clear();
        self.state
            .up
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Drops the links after a failed exchange (they are mid-frame); the next forward dials.
    fn broken(&mut self, e: RuntimeError) -> RuntimeError {
        self.reset();
        match e {
            RuntimeError::Io(io) => RuntimeError::Tp(format!("link to a shard rank lost: {io}")),
            e => e,
        }
    }

    /// Refuses a forward the ranks would refuse, before anything is sent: refused by a rank, it
    /// would cost the links and the KV every cache holds on the ranks, failing every request.
    fn check_fits(&self, cache: &KvCache, meta: &BatchMeta) -> Result<()> {
        let n = meta.tok_pos.len();
        let bytes = n.saturating_mul(self.d_model).saturating_mul(4);
        let kc = cache.config();
        let why = if n > MAX_TOKENS {
            format!(
                "{n} tokens in one forward; a tensor-parallel forward carries at most \
                 {MAX_TOKENS}: use smaller prefill chunks"
            )
        } else if bytes > MAX_FRAME {
            format!(
                "{n} rows of activations ({bytes} bytes) exceed a frame of {MAX_FRAME} bytes; \
                 use smaller prefill chunks"
            )
        } else if meta.seqs.len() > MAX_SEQS {
            format!(
                "{} sequences in one forward; a tensor-parallel forward carries at most \
                 {MAX_SEQS}",
                meta.seqs.len()
            )
        } else if kc.num_blocks == 0
            || kc.block_size == 0
            || kc.num_blocks.saturating_mul(kc.block_size) > MAX_CACHE_SLOTS
        {
            format!(
                "a KV cache of {} blocks of {}; a shard rank holds at most {MAX_CACHE_SLOTS} \
                 slots",
                kc.num_blocks, kc.block_size
            )
        } else {
            return Ok(());
        };
        Err(RuntimeError::Invalid(why))
    }

    /// Starts a forward on every rank: cache identity and shape, pending block copies, and the
    /// batch layout.
    pub(crate) fn begin(&mut self, cache: &mut KvCache, meta: &BatchMeta) -> Result<()> {
        self.check_fits(cache, meta)?;
        if self.links.is_empty() {
            let dialled = if self.dialing {
                Err(RuntimeError::Tp(
                    "the shard ranks are down and being dialled again".into(),
                ))
            } else {
                self.dial()
            };
            if let Err(e) = dialled {
                // Whatever the ranks held went with them: a reconnect starts a new epoch.
                cache.mark_tp_lost();
                return Err(e);
            }
        }
        let fresh = cache.tp_tag().map(|(e, _)| e) != Some(self.epoch);
        if fresh {
            if cache.has_content() {
                cache.mark_tp_lost();
                return Err(RuntimeError::Tp(
                    "the shard ranks reconnected and lost the KV this cache's sequences hold; \
                     those sequences must start over"
                        .into(),
                ));
            }
            // The ranks keep MAX_CACHES caches, dropping the least recently used one for a new
            // one: refused here instead, or the engine's could be the one dropped (and its
            // next forward would cost the links and every cache's KV).
            let live = self
                .live
                .iter()
                .filter(|(_, w)| w.strong_count() > 0)
                .count();
            if live >= MAX_CACHES {
                return Err(RuntimeError::Tp(format!(
                    "the shard ranks hold at most {MAX_CACHES} KV caches per leader, and \
                     {live} are in use: drop one before forwarding through another"
                )));
            }
            cache.clear_prefix_cache();
            self.next_cache += 1;
            let alive = Arc::new(());
            self.live.push((self.next_cache, Arc::downgrade(&alive)));
            cache.set_tp_tag((self.epoch, self.next_cache), alive);
        }
        let id = cache.tp_tag().map(|(_, id)| id).unwrap_or_default();
        let copies = cache.take_copies();
        let mut released = Vec::new();
        self.live.retain(|(id, w)| {
            let alive = w.strong_count() > 0;
            if !alive {
                released.push(*id);
            }
            alive
        });
        let kc = cache.config();
        self.words.clear();
        self.words.extend([
            id as u32,
            (id >> 32) as u32,
            fresh as u32,
            kc.block_size as u32,
            kc.num_blocks as u32,
            match kc.dtype {
                KvDtype::F16 => 0,
                KvDtype::F32 => 1,
                KvDtype::Int8V => 2,
                KvDtype::Int8 => 3,
            },
            self.calibrate as u32,
            copies.len() as u32,
        ]);
        for (f, t) in copies {
            self.words.extend([f, t]);
        }
        self.words.push(released.len() as u32);
        for r in released {
            self.words.extend([r as u32, (r >> 32) as u32]);
        }
        meta.encode(&mut self.words);
        let mut head = Vec::new();
        words_bytes(&self.words, &mut head);
        let mut payload = Vec::new();
        for i in 0..self.links.len() {
            // A new `int8` cache comes with the rank's key offsets.
            payload.clear();
            payload.extend_from_slice(&head);
            match self.key_offsets.get(i) {
                Some(o) if fresh && kc.dtype == KvDtype::Int8 => {
                    payload.extend_from_slice(&(o.len() as u32).to_le_bytes());
                    for x in o {
                        payload.extend_from_slice(&x.to_bits().to_le_bytes());
                    }
                }
                _ => payload.extend_from_slice(&0u32.to_le_bytes()),
            }
            if let Err(e) = write_frame(&mut self.links[i], BEGIN, &payload, &mut self.buf) {
                // The ranks that got it would wait for rows that never come.
                cache.mark_tp_lost();
                return Err(self.broken(e.into()));
            }
        }
        Ok(())
    }

    /// Sends rank 0's normalized rows to every other rank.
    pub(crate) fn broadcast(&mut self, x: &[f32]) -> Result<()> {
        if x.len() * 4 > MAX_FRAME {
            return Err(RuntimeError::Tp(format!(
                "{} rows of activations exceed a frame of {MAX_FRAME} bytes; use smaller \
                 prefill chunks",
                x.len()
            )));
        }
        for i in 0..self.links.len() {
            if let Err(e) = write_f32s(&mut self.links[i], x, &mut self.buf) {
                return Err(self.broken(e.into()));
            }
        }
        Ok(())
    }

    /// After a forward with [`Group::calibrate`] set: every other rank's mean keys
    /// (`n_layers × its kv_dim`), in rank order.
    pub(crate) fn key_means(&mut self, n: usize) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.links.len());
        for i in 0..self.links.len() {
            let mut m = vec![0f32; n];
            if let Err(e) = read_f32s(&mut self.links[i], &mut self.buf, &mut m, false) {
                return Err(self.broken(e));
            }
            // A rank's caches refuse non-finite offsets: none is better than a rank that
            // refuses every new cache.
            m.iter_mut()
                .filter(|x| !x.is_finite())
                .for_each(|x| *x = 0.0);
            out.push(m);
        }
        Ok(out)
    }

    /// Adds the other ranks' shares into `acc` (rank 0's own), in rank order.
    pub(crate) fn reduce_add(&mut self, acc: &mut [f32]) -> Result<()> {
        for i in 0..self.links.len() {
            if let Err(e) = read_f32s(&mut self.links[i], &mut self.buf, acc, true) {
                return Err(self.broken(e));
            }
        }
        Ok(())
    }
}

/// What a serving shard rank is doing, for its process to watch (drain, logs).
#[derive(Debug, Default)]
pub struct ShardState {
    leader: std::sync::atomic::AtomicBool,
    forwards: std::sync::atomic::AtomicU64,
}

impl ShardState {
    /// Whether a rank 0 is connected.
    pub fn connected(&self) -> bool {
        self.leader.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// Forwards served so far.
    pub fn forwards(&self) -> u64 {
        self.forwards.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Serves one shard rank (`model` loaded with [`TpOptions::shard`]) on `listener` until the
/// listener fails. One leader at a time: a new connection that passes the handshake (a
/// restarted target worker) and then claims the rank (once all its ranks answered) replaces
/// the one being served, and the leader it replaced is refused while the new one holds the
/// rank (two leaders given the same ranks would otherwise take them from each other every
/// second); one that does not pass (a port probe, another checkpoint) or never claims (a
/// leader that could not reach its other ranks) is refused and changes nothing.
pub fn serve(model: Arc<Model>, listener: TcpListener) -> Result<()> {
    serve_with(model, listener, Arc::default())
}

/// Who holds a serving rank: shared by its accept loop and the threads that wait for the
/// claims of the leaders it answered.
#[derive(Default)]
struct Holders {
    /// The last leader that claimed the rank: its link, identity, address and session.
    current: Option<(TcpStream, u64, String, u64)>,
    /// Leaders another leader took this rank from: they do not take it back while that one
    /// is linked, so two leaders given the same ranks do not take them from each other every
    /// second, failing each other's requests; the newer one keeps them.
    taken_from: std::collections::VecDeque<u64>,
    /// Sessions are numbered as claimed.
    sessions: u64,
}

impl Holders {
    /// The address of the leader other than `id` this rank serves, if its session (the
    /// compute thread finished those up to `ended`) goes on.
    fn holder(&self, id: u64, ended: u64) -> Option<String> {
        self.current
            .as_ref()
            .filter(|c| c.1 != id && ended < c.3)
            .map(|c| c.2.clone())
    }

    /// Why leader `id` may not have this rank now, if it may not.
    fn gate(&self, id: u64, ended: u64, rank: usize) -> Option<String> {
        if !self.taken_from.contains(&id) {
            return None;
        }
        self.holder(id, ended).map(|other| {
            format!(
                "{TAKEN_OVER} rank {rank} was taken over by another leader ({other}), which \
                 still holds it"
            )
        })
    }
}

fn lock_holders(h: &std::sync::Mutex<Holders>) -> std::sync::MutexGuard<'_, Holders> {
    h.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`serve`], reporting into `state`.
pub fn serve_with(model: Arc<Model>, listener: TcpListener, state: Arc<ShardState>) -> Result<()> {
    let shard = model.shard();
    if shard.rank == 0 {
        return Err(RuntimeError::Config(
            "rank 0 is the target worker itself; shard ranks are 1 and up".into(),
        ));
    }
    use std::sync::atomic::{AtomicU64, Ordering};
    // `ended` is the last session the compute thread finished.
    let (tx, rx) = std::sync::mpsc::channel::<(TcpStream, u64)>();
    let ended = Arc::new(AtomicU64::new(0));
    let m = Arc::clone(&model);
    let done = Arc::clone(&ended);
    let compute = std::thread::Builder::new()
        .name(format!("tp-rank-{}", shard.rank))
        .spawn(move || {
            for (s, session) in rx {
                let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                let keep = s.try_clone();
                state.leader.store(true, Ordering::SeqCst);
                let r = serve_leader(&m, s, &state.forwards);
                state.leader.store(false, Ordering::SeqCst);
                done.store(session, Ordering::SeqCst);
                // Closed for good, so a leader blocked on this link fails at once.
                if let Ok(k) = keep {
                    let _ = k.shutdown(Shutdown::Both);
                }
                match r {
                    Ok(()) => tracing::info!(%peer, "tensor-parallel leader left"),
                    Err(e) => tracing::warn!(%peer, "tensor-parallel link ended: {e}"),
                }
            }
        })?;
    let mut buf = Vec::new();
    let holders = Arc::new(std::sync::Mutex::new(Holders::default()));
    loop {
        let accepted = listener.accept();
        if compute.is_finished() {
            return Err(RuntimeError::Tp(
                "the shard's compute thread stopped".into(),
            ));
        }
        let mut s = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Aborted handshakes, a full descriptor table: wait and go on listening.
                tracing::warn!("accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let gate =
            |id: u64| lock_holders(&holders).gate(id, ended.load(Ordering::SeqCst), shard.rank);
        let id = match handshake(&model, &mut s, &mut buf, &gate) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(%peer, "tensor-parallel connection refused: {e}");
                continue;
            }
        };
        // The leader's claim comes once its other ranks answered too (seconds, for one that
        // dials a rank that is down): waited for aside, so this loop goes on answering.
        let (holders, ended, tx) = (Arc::clone(&holders), Arc::clone(&ended), tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("tp-claim-{}", shard.rank))
            .spawn(move || claim(s, id, peer, shard.rank, &holders, &ended, &tx));
        if let Err(e) = spawned {
            tracing::warn!("tensor-parallel leader dropped: no thread to wait for its claim: {e}");
        }
    }
}

/// Waits for the claim of a leader whose hello this rank answered, then serves it instead of
/// the one it serves: not before, so a leader that could not reach its other ranks takes this
/// one from nobody.
fn claim(
    mut s: TcpStream,
    id: u64,
    peer: String,
    rank: usize,
    holders: &std::sync::Mutex<Holders>,
    ended: &std::sync::atomic::AtomicU64,
    tx: &std::sync::mpsc::Sender<(TcpStream, u64)>,
) {
    use std::sync::atomic::Ordering;
    let mut buf = Vec::new();
    match read_frame_by(&mut s, &mut buf, MAX_HELLO, Instant::now() + CLAIM_TIMEOUT) {
        Ok(CLAIM) => {}
        Ok(k) => {
            let why = format!("expected the leader's claim, got frame {k}");
            let _ = write_frame(&mut s, ERR, why.as_bytes(), &mut buf);
            tracing::warn!(%peer, "tensor-parallel connection refused: {why}");
            return;
        }
        Err(e) => {
            tracing::info!(
                %peer,
                "a tensor-parallel leader did not claim this rank (one of its other ranks \
                 failed?): {e}"
            );
            return;
        }
    }
    // A forward may come after any idle time.
    if let Err(e) = s.set_read_timeout(None) {
        tracing::warn!(%peer, "tensor-parallel connection dropped: {e}");
        return;
    }
    let mut h = lock_holders(holders);
    let ended = ended.load(Ordering::SeqCst);
    // Checked again: another leader may have taken the rank since the hello.
    if let Some(why) = h.gate(id, ended, rank) {
        let _ = write_frame(&mut s, ERR, why.as_bytes(), &mut buf);
        tracing::warn!(%peer, "tensor-parallel connection refused: {why}");
        return;
    }
    let took_over = h.holder(id, ended).is_some();
    if let Some((old, old_id, old_peer, _)) = h.current.take() {
        if took_over {
            tracing::warn!(
                %peer,
                previous = %old_peer,
                "a new tensor-parallel leader connected; dropping the previous one"
            );
            if !h.taken_from.contains(&old_id) {
                // Bounded: a rank outlives any number of restarted leaders.
                if h.taken_from.len() >= 64 {
                    h.taken_from.pop_front();
                }
                h.taken_from.push_back(old_id);
            }
        }
        let _ = old.shutdown(Shutdown::Both);
    }
    h.taken_from.retain(|&t| t != id);
    keep_alive(&s);
    h.sessions += 1;
    let session = h.sessions;
    if let Ok(k) = s.try_clone() {
        h.current = Some((k, id, peer, session));
    }
    // Sent under the lock: the compute thread gets sessions in their order.
    if tx.send((s, session)).is_err() {
        tracing::error!("the shard's compute thread stopped");
    }
}

/// Reads and checks a leader's hello (all of it within [`HANDSHAKE_TIMEOUT`]), answering OK
/// or why not; the leader's identity. `gate` refuses a leader, saying why.
fn handshake(
    model: &Model,
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    gate: &dyn Fn(u64) -> Option<String>,
) -> Result<u64> {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    s.set_nodelay(true)?;
    // The answer is small, but a peer that reads nothing must not hold the accept loop either.
    s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut out = Vec::new();
    if read_frame_by(s, buf, MAX_HELLO, deadline)? != HELLO {
        return Err(RuntimeError::Tp("the first frame was not a hello".into()));
    }
    let refuse = |s: &mut TcpStream, why: String, out: &mut Vec<u8>| -> Result<u64> {
        write_frame(s, ERR, why.as_bytes(), out)?;
        Err(RuntimeError::Tp(why))
    };
    let h: Hello = match serde_json::from_slice(buf) {
        Ok(h) => h,
        Err(e) => return refuse(s, format!("unreadable hello: {e}"), &mut out),
    };
    let me = model.shard();
    if h.version != PROTOCOL_VERSION {
        return refuse(
            s,
            format!(
                "protocol version {} here, {} there",
                PROTOCOL_VERSION, h.version
            ),
            &mut out,
        );
    }
    // Every leader sends a nonzero identity, which the take-over fencing goes by.
    if h.leader == 0 {
        return refuse(
            s,
            "the leader sent no identity (an older build?); this rank needs one".into(),
            &mut out,
        );
    }
    if h.rank != me.rank || h.world != me.world {
        return refuse(
            s,
            format!(
                "this is rank {} of {}, the leader expected rank {} of {}",
                me.rank, me.world, h.rank, h.world
            ),
            &mut out,
        );
    }
    if h.config != model.cfg || h.fingerprint != model.fingerprint() {
        return refuse(
            s,
            "this rank holds another checkpoint (config or weights differ)".into(),
            &mut out,
        );
    }
    if let Some(why) = gate(h.leader) {
        return refuse(s, why, &mut out);
    }
    write_frame(s, OK, &[], &mut out)?;
    // Forwards may take longer to read than a handshake.
    s.set_write_timeout(None)?;
    Ok(h.leader)
}

/// One leader's session after its handshake: forwards until it leaves.
fn serve_leader(
    model: &Model,
    mut s: TcpStream,
    forwards: &std::sync::atomic::AtomicU64,
) -> Result<()> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let me = model.shard();
    let mut caches: Vec<(u64, KvCache, Instant)> = Vec::new();
    loop {
        let kind = match read_frame(&mut s, &mut buf) {
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if kind != BEGIN {
            let why = format!("expected a forward, got frame {kind}");
            let _ = write_frame(&mut s, ERR, why.as_bytes(), &mut out);
            return Err(RuntimeError::Tp(why));
        }
        let words = bytes_words(&buf);
        if let Err(e) = forward(model, &mut s, &words, &mut caches, &mut buf, &mut out) {
            // The leader is waiting for this rank's share: tell it why there is none.
            let _ = write_frame(
                &mut s,
                ERR,
                format!("rank {}: {e}", me.rank).as_bytes(),
                &mut out,
            );
            return Err(e);
        }
        forwards.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// This rank's part of one forward.
fn forward(
    model: &Model,
    s: &mut TcpStream,
    words: &[u32],
    caches: &mut Vec<(u64, KvCache, Instant)>,
    buf: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> Result<()> {
    let cfg = &model.cfg;
    let mut w = Words(words);
    let id = w.next()? as u64 | (w.next()? as u64) << 32;
    let fresh = w.next()? != 0;
    let (bs, nb) = (w.next()? as usize, w.next()? as usize);
    let dtype = match w.next()? {
        0 => KvDtype::F16,
        1 => KvDtype::F32,
        2 => KvDtype::Int8V,
        3 => KvDtype::Int8,
        x => return Err(bad(format!("KV element type {x}"))),
    };
    let calibrate = w.next()? != 0;
    let n_copies = w.next()? as usize;
    let copies: Vec<(u32, u32)> = w
        .take(n_copies.saturating_mul(2))?
        .chunks_exact(2)
        .map(|c| (c[0], c[1]))
        .collect();
    let n_released = w.next()? as usize;
    let released = w.take(n_released.saturating_mul(2))?;
    // Caches the leader dropped: their memory goes back now.
    for r in released.chunks_exact(2) {
        let r = r[0] as u64 | (r[1] as u64) << 32;
        caches.retain(|(i, _, _)| *i != r);
    }
    if nb == 0 || bs == 0 || nb.saturating_mul(bs) > MAX_CACHE_SLOTS {
        return Err(bad(format!("a cache of {nb} blocks of {bs}")));
    }
    let meta = BatchMeta::decode(&mut w, bs, nb, cfg.max_ctx)?;
    let n_off = w.next()? as usize;
    let key_offsets: Vec<f32> = w.take(n_off)?.iter().map(|&x| f32::from_bits(x)).collect();
    if fresh {
        caches.retain(|(i, _, _)| *i != id);
        if caches.len() >= MAX_CACHES
            && let Some(j) = (0..caches.len()).min_by_key(|&j| caches[j].2)
        {
            caches.swap_remove(j);
        }
        let mut c = KvCache::new(KvConfig {
            n_layers: cfg.n_layers,
            n_kv_heads: model.local.kv_heads,
            head_dim: cfg.head_dim,
            block_size: bs,
            num_blocks: nb,
            dtype,
        })?;
        if !key_offsets.is_empty() {
            c.set_key_offsets(&key_offsets)?;
        }
        caches.push((id, c, Instant::now()));
    }
    let Some((_, cache, used)) = caches.iter_mut().find(|(i, _, _)| *i == id) else {
        return Err(RuntimeError::Tp(format!(
            "no KV cache {id} here (this rank restarted or dropped it)"
        )));
    };
    *used = Instant::now();
    if cache.config().block_size != bs || cache.config().num_blocks != nb {
        return Err(bad("the cache's shape changed".into()));
    }
    cache.copy_blocks(&copies)?;
    let n = meta.tok_pos.len();
    let d = cfg.d_model;
    model.install(|| {
        let mut b = model.bufs(n);
        let mut clock = Clock::new(false);
        let mut prof = ForwardProfile::default();
        for li in 0..cfg.n_layers {
            read_f32s(s, buf, &mut b.xn[..n * d], false)?;
            model.attn_part(li, cache, &meta, &mut b, &mut clock, &mut prof)?;
            write_f32s(s, &b.proj, out)?;
            read_f32s(s, buf, &mut b.xn[..n * d], false)?;
            model.ffn_part(li, n, &mut b, &mut clock, &mut prof)?;
            write_f32s(s, &b.proj, out)?;
        }
        if calibrate {
            write_f32s(s, &crate::kv::key_means(cache, &meta.tok_slot), out)?;
        }
        Ok(())
    })
}

/// `HOST:PORT` with a port number: a name or IPv4 address, or a bracketed IPv6 one.
pub fn is_host_port(a: &str) -> bool {
    let Some((host, port)) = a.rsplit_once(':') else {
        return false;
    };
    let host_ok = if let Some(h) = host.strip_prefix('[') {
        h.strip_suffix(']')
            .is_some_and(|h| h.parse::<std::net::Ipv6Addr>().is_ok())
    } else {
        !host.is_empty() && !host.contains(':')
    };
    host_ok && port.parse::<u16>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_host_and_port() {
        for ok in [
            "127.0.0.1:7001",
            "rank-1.tp.ns.svc:7001",
            "[::1]:7001",
            "localhost:1",
        ] {
            assert!(is_host_port(ok), "{ok}");
        }
        for bad in [
            "host",
            "::1:7001",
            "[::1]",
            "host:",
            "host:99999",
            ":7001",
            "[x]:1",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
    }

    fn cfg(kv: usize, heads: usize, ffn: usize) -> ModelConfig {
        ModelConfig {
            arch: crate::Arch::Llama,
            n_layers: 1,
            d_model: 64,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: 16,
            ffn_dim: ffn,
            vocab_size: 10,
            rope_theta: 1e4,
            rms_eps: 1e-5,
            max_ctx: 64,
            qkv_bias: false,
            rope_interleaved: false,
        }
    }

    #[test]
    fn slices_cover_the_model_once() {
        let c = cfg(4, 8, 96);
        for w in Shard::degrees(&c) {
            let mut heads = 0;
            let mut ffn = 0;
            let mut kv_seen = Vec::new();
            for r in 0..w {
                let l = Shard { rank: r, world: w }.local(&c).unwrap();
                assert_eq!(l.head0, heads);
                assert_eq!(l.ffn0, ffn);
                // Every query head a rank holds belongs to a KV head it holds.
                for h in l.head0..l.head0 + l.heads {
                    let g = h / 2;
                    assert!(
                        (l.kv_head0..l.kv_head0 + l.kv_heads).contains(&g),
                        "{w} {r} {h}"
                    );
                }
                kv_seen.extend(l.kv_head0..l.kv_head0 + l.kv_heads);
                heads += l.heads;
                ffn += l.ffn;
            }
            assert_eq!((heads, ffn), (8, 96));
            kv_seen.dedup();
            assert_eq!(kv_seen, vec![0, 1, 2, 3], "degree {w}");
        }
        // 8: each KV head on two ranks, one query head each.
        assert_eq!(Shard::degrees(&c), vec![1, 2, 4, 8]);
        let l = Shard { rank: 5, world: 8 }.local(&c).unwrap();
        assert_eq!((l.heads, l.head0, l.kv_heads, l.kv_head0), (1, 5, 1, 2));
        let e = Shard { rank: 0, world: 3 }
            .local(&c)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("must divide") && e.contains("[1, 2, 4, 8]"),
            "{e}"
        );
        assert!(Shard { rank: 2, world: 2 }.local(&c).is_err());
    }

    #[test]
    fn raw_columns_cut_on_block_boundaries_only() {
        use kernels::GgmlType;
        // 2 rows × 64 columns of Q8_0 (blocks of 32 values, 34 bytes).
        let data: Vec<u8> = (0..4)
            .flat_map(|k| {
                let d = half::f16::from_f32(0.01 * (k + 1) as f32).to_le_bytes();
                d.into_iter()
                    .chain((0..32).map(move |j| (j as i8 - 16 + k as i8) as u8))
            })
            .collect();
        let raw = || RawTensor {
            ty: GgmlType::Q8_0,
            dims: vec![2, 64],
            data: data.clone(),
        };
        let c = slice_raw(raw(), Part::Cols(32, 64), "w").unwrap();
        assert_eq!(c.dims, vec![2, 32]);
        assert_eq!(c.data[..34], data[34..68]);
        assert_eq!(c.data[34..], data[102..136]);
        let r = slice_raw(raw(), Part::Rows(1, 2), "w").unwrap();
        assert_eq!((r.dims.clone(), &r.data[..]), (vec![1, 64], &data[68..]));
        let e = slice_raw(raw(), Part::Cols(16, 48), "w")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cut Q8_0 blocks"), "{e}");
        // Widened to whole blocks, with the offset of the rank's first column in them.
        assert_eq!(
            block_aligned(Part::Cols(16, 48), 32),
            (Part::Cols(0, 64), 16)
        );
        assert_eq!(
            block_aligned(Part::Cols(64, 96), 32),
            (Part::Cols(64, 96), 0)
        );
        assert_eq!(block_aligned(Part::Rows(1, 3), 32), (Part::Rows(1, 3), 0));
        assert!(slice_raw(raw(), Part::Rows(1, 3), "w").is_err());
    }

    #[test]
    fn batch_layout_round_trips_and_bad_indices_are_refused() {
        let m = BatchMeta::new(vec![(3, 2), (0, 1)], vec![vec![5, 1], vec![7]], 4);
        assert_eq!(m.tok_pos, vec![3, 4, 0]);
        assert_eq!(m.tok_slot, vec![5 * 4 + 3, 4, 7 * 4]);
        let mut w = Vec::new();
        m.encode(&mut w);
        let d = BatchMeta::decode(&mut Words(&w), 4, 8, 64).unwrap();
        assert_eq!((d.seqs, d.tok_slot), (m.seqs, m.tok_slot));
        // A block outside the cache, a table too short for the positions, past the context,
        // a truncated frame.
        assert!(BatchMeta::decode(&mut Words(&w), 4, 6, 64).is_err());
        let short = [1, 3, 2, 1, 5];
        assert!(BatchMeta::decode(&mut Words(&short), 4, 8, 64).is_err());
        assert!(BatchMeta::decode(&mut Words(&w), 4, 8, 4).is_err());
        assert!(BatchMeta::decode(&mut Words(&w[..w.len() - 1]), 4, 8, 64).is_err());
    }

    // Links over loopback: shard ranks served on threads, fake ranks and relays.

    use crate::model::{ForwardOptions, ForwardOutput, LogitsMode, SeqInput};
    use crate::tiny::{TinySpec, tiny_model_path};
    use crate::{LoadOptions, SeqId};
    use std::net::TcpListener;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn load(spec: &TinySpec, name: &str, tp: Option<TpOptions>) -> Model {
        let path = tiny_model_path(spec, name).unwrap();
        let o = LoadOptions {
            threads: 1,
            tp,
            ..Default::default()
        };
        Model::load(&path, &o).unwrap()
    }

    /// Ranks 1.. of `world` served on loopback: their addresses, and rank 1's model.
    fn ranks(spec: &TinySpec, name: &str, world: usize) -> (Vec<String>, Arc<Model>) {
        let mut first = None;
        let peers = (1..world)
            .map(|r| {
                let m = Arc::new(load(spec, name, Some(TpOptions::shard(r, world))));
                first.get_or_insert_with(|| Arc::clone(&m));
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let a = l.local_addr().unwrap().to_string();
                std::thread::spawn(move || serve(m, l));
                a
            })
            .collect();
        (peers, first.unwrap())
    }

    fn leader_opts(peers: Vec<String>) -> TpOptions {
        let mut t = TpOptions::leader(peers);
        t.connect_timeout = Duration::from_secs(10);
        t.io_timeout = Duration::from_secs(20);
        t
    }

    /// One new sequence's forward over `tokens` in `c`; the sequence is removed after.
    fn step(m: &Model, c: &mut KvCache, tokens: &[u32]) -> Result<ForwardOutput> {
        let seq: SeqId = c.new_seq();
        let r = m.forward(
            c,
            &[SeqInput {
                seq,
                tokens,
                logits: LogitsMode::Last,
            }],
            &ForwardOptions::default(),
        );
        c.remove(seq).unwrap();
        r
    }

    /// A rank that answers every hello OK and records the kinds of the frames that follow.
    fn fake_rank() -> (String, Arc<Mutex<Vec<u8>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let kinds: Arc<Mutex<Vec<u8>>> = Arc::default();
        let k = Arc::clone(&kinds);
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let k = Arc::clone(&k);
                std::thread::spawn(move || {
                    let (mut buf, mut out) = (Vec::new(), Vec::new());
                    if read_frame_max(&mut s, &mut buf, MAX_HELLO).is_err()
                        || write_frame(&mut s, OK, &[], &mut out).is_err()
                    {
                        return;
                    }
                    while let Ok(kind) = read_frame(&mut s, &mut buf) {
                        k.lock().unwrap().push(kind);
                    }
                });
            }
        });
        (addr, kinds)
    }

    /// A relay in front of a rank whose answers stop while `hung` is set (the rank stopped
    /// mid-forward: what it was sent arrives, nothing comes back).
    fn hanging_relay(to: String) -> (String, Arc<AtomicBool>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let hung = Arc::new(AtomicBool::new(false));
        let h = Arc::clone(&hung);
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { continue };
                let Ok(up) = TcpStream::connect(&to) else {
                    continue;
                };
                let pumps = [
                    (s.try_clone().unwrap(), up.try_clone().unwrap(), None),
                    (up, s, Some(Arc::clone(&h))),
                ];
                for (mut from, mut to, hold) in pumps {
                    std::thread::spawn(move || {
                        let mut b = vec![0u8; 1 << 16];
                        while let Ok(k @ 1..) = from.read(&mut b) {
                            while hold.as_ref().is_some_and(|h| h.load(Ordering::SeqCst)) {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            if to.write_all(&b[..k]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        (addr, hung)
    }

    /// A stale rank address now served by HTTP: the answer to the hello reads as a frame of
    /// 790 MB, refused at once instead of allocated.
    #[test]
    fn a_non_rank_answering_the_hello_is_refused_without_reading_its_frame() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let mut b = [0u8; 4096];
                let _ = s.read(&mut b);
                let _ = s.write_all(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                let _ = s.shutdown(Shutdown::Write);
                // Drained until the leader hangs up: closing with its bytes unread would reset
                // the connection before the leader reads the answer.
                let _ = std::io::copy(&mut s, &mut std::io::sink());
            }
        });
        let mut t = leader_opts(vec![addr]);
        t.connect_timeout = Duration::ZERO;
        let t0 = Instant::now();
        let e = Group::connect(&t, cfg(4, 8, 96), 0)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        let len = u32::from_le_bytes(*b"TTP/");
        assert!(e.contains(&format!("a frame of {len} bytes")), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    /// A rank that stops answering mid-forward fails the forward within the links' I/O
    /// timeout (30 s unless set), not two minutes later.
    #[test]
    fn a_hung_rank_fails_a_forward_within_the_io_timeout() {
        assert_eq!(
            TpOptions::leader(vec![]).io_timeout,
            Duration::from_secs(30)
        );
        let spec = TinySpec::llama(3);
        let (peers, _) = ranks(&spec, "tp-unit-llama", 2);
        let (addr, hung) = hanging_relay(peers[0].clone());
        let mut t = leader_opts(vec![addr]);
        t.io_timeout = Duration::from_secs(1);
        let m = load(&spec, "tp-unit-llama", Some(t));
        let mut c = m.new_cache(64, 8).unwrap();
        step(&m, &mut c, &[1, 2, 3]).unwrap();
        hung.store(true, Ordering::SeqCst);
        let t0 = Instant::now();
        let e = step(&m, &mut c, &[4, 5]).unwrap_err();
        let took = t0.elapsed();
        assert!(matches!(e, RuntimeError::Tp(_)), "{e}");
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(4),
            "the forward failed after {took:?}"
        );
        let mut t = leader_opts(vec!["127.0.0.1:1".into()]);
        t.io_timeout = Duration::ZERO;
        assert!(matches!(
            Group::connect(&t, cfg(4, 8, 96), 0).map(|_| ()),
            Err(RuntimeError::Config(_))
        ));
    }

    /// A forward too large for the links is refused before anything is sent: the links, and
    /// the KV the ranks hold for every cache, stay.
    #[test]
    fn an_oversized_forward_is_refused_before_it_is_sent() {
        let (addr, kinds) = fake_rank();
        let wide = ModelConfig {
            d_model: 4096,
            ..cfg(4, 8, 96)
        };
        let mut g = Group::connect(&leader_opts(vec![addr]), wide, 0).unwrap();
        let mut c = KvCache::new(KvConfig {
            n_layers: 1,
            n_kv_heads: 4,
            head_dim: 16,
            block_size: 16,
            num_blocks: 4,
            dtype: KvDtype::F16,
        })
        .unwrap();
        let meta = |n: usize| BatchMeta::new(vec![(0, n)], vec![vec![0; n.div_ceil(16)]], 16);
        // Past the tokens a forward carries; past a frame's bytes (n × 4096 floats).
        for n in [MAX_TOKENS + 1, MAX_FRAME / (4 * 4096) + 1] {
            let e = g.begin(&mut c, &meta(n)).unwrap_err();
            assert!(matches!(e, RuntimeError::Invalid(_)), "{e}");
            assert!(e.to_string().contains(&n.to_string()), "{e}");
        }
        assert!(c.tp_tag().is_none());
        assert_eq!((g.state.connects(), g.state.up()), (1, true));
        // The links still carry forwards.
        g.begin(&mut c, &meta(3)).unwrap();
        let t0 = Instant::now();
        while kinds.lock().unwrap().len() < 2 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*kinds.lock().unwrap(), vec![CLAIM, BEGIN]);
        assert_eq!(g.state.connects(), 1);
    }

    /// Rank 0 refuses a KV cache past the ranks' MAX_CACHES (they would drop the least
    /// recently used one, maybe the engine's, whose next forward would then reset the group):
    /// the others go on, and a cache dropped makes room.
    #[test]
    fn a_cache_past_what_the_ranks_keep_is_refused_and_the_others_go_on() {
        let spec = TinySpec::llama(3);
        let (peers, _) = ranks(&spec, "tp-unit-llama", 2);
        let m = load(&spec, "tp-unit-llama", Some(leader_opts(peers)));
        let mut caches: Vec<KvCache> = (0..MAX_CACHES)
            .map(|_| m.new_cache(64, 8).unwrap())
            .collect();
        for c in &mut caches {
            step(&m, c, &[1, 2]).unwrap();
        }
        let mut extra = m.new_cache(64, 8).unwrap();
        let e = step(&m, &mut extra, &[3]).unwrap_err().to_string();
        assert!(e.contains("at most 4 KV caches"), "{e}");
        // The engine's cache (the least recently used) is still on the ranks.
        for c in &mut caches {
            step(&m, c, &[4]).unwrap();
        }
        caches.pop();
        step(&m, &mut extra, &[3]).unwrap();
        step(&m, &mut caches[0], &[5]).unwrap();
        assert_eq!(m.tp_links().unwrap().connects(), 1);
    }

    /// A connection that trickles its hello in (a byte every 2 s, each within the read
    /// timeout) is dropped at the handshake's deadline: a leader behind it links in seconds.
    #[test]
    fn a_trickling_connection_does_not_hold_the_accept_loop() {
        let spec = TinySpec::llama(3);
        let (peers, rank) = ranks(&spec, "tp-unit-llama", 2);
        let mut slow = TcpStream::connect(&peers[0]).unwrap();
        std::thread::spawn(move || {
            for b in [HELLO, 100, 0, 0, 0].into_iter().chain([b' '; 100]) {
                if slow.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(2));
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        let t0 = Instant::now();
        let g = Group::connect(&leader_opts(peers), rank.cfg.clone(), rank.fingerprint());
        assert!(g.is_ok(), "{:?}", g.map(|_| ()).unwrap_err());
        assert!(
            t0.elapsed() < HANDSHAKE_TIMEOUT + Duration::from_secs(2),
            "linked after {:?}",
            t0.elapsed()
        );
    }

    /// A hello without a leader identity (builds before fencing sent none) is refused, or it
    /// would pass every take-over check and never be fenced.
    #[test]
    fn a_leader_without_an_identity_is_refused() {
        let spec = TinySpec::llama(3);
        let (peers, rank) = ranks(&spec, "tp-unit-llama", 2);
        let hello = |leader: u64| {
            serde_json::to_vec(&Hello {
                version: PROTOCOL_VERSION,
                rank: 1,
                world: 2,
                config: rank.cfg.clone(),
                fingerprint: rank.fingerprint(),
                leader,
            })
            .unwrap()
        };
        let answer = |h: Vec<u8>| {
            let mut s = TcpStream::connect(&peers[0]).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = Vec::new();
            write_frame(&mut s, HELLO, &h, &mut buf).unwrap();
            let k = read_frame_max(&mut s, &mut buf, MAX_HELLO).unwrap();
            (k, String::from_utf8_lossy(&buf).into_owned())
        };
        let (k, why) = answer(hello(0));
        assert_eq!(k, ERR);
        assert!(why.contains("no identity"), "{why}");
        // Nor does a hello leave the field out.
        let mut v: serde_json::Value = serde_json::from_slice(&hello(7)).unwrap();
        v.as_object_mut().unwrap().remove("leader");
        let (k, why) = answer(serde_json::to_vec(&v).unwrap());
        assert_eq!((k, why.contains("no identity")), (ERR, true), "{why}");
        assert_eq!(answer(hello(7)).0, OK);
    }

    /// A leader that reaches one of its ranks and not another takes neither: the leader
    /// serving them keeps its links while the other retries every 250 ms.
    #[test]
    fn a_leader_that_cannot_reach_every_rank_takes_none() {
        // Three ranks: six heads over three KV heads, an FFN of 3 × 64.
        let spec = TinySpec {
            d_model: 96,
            n_heads: 6,
            n_kv_heads: 3,
            ffn_dim: 192,
            ..TinySpec::llama(4)
        };
        let (peers, rank) = ranks(&spec, "tp-unit-llama3", 3);
        let a = load(&spec, "tp-unit-llama3", Some(leader_opts(peers.clone())));
        let mut c = a.new_cache(64, 8).unwrap();
        step(&a, &mut c, &[1, 2, 3]).unwrap();
        let closed = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let mut t = leader_opts(vec![peers[0].clone(), closed]);
        t.connect_timeout = Duration::from_secs(3);
        let (cfg, fp) = (rank.cfg.clone(), rank.fingerprint());
        let b = std::thread::spawn(move || Group::connect(&t, cfg, fp).map(|_| ()));
        let mut n = 0;
        while !b.is_finished() {
            step(&a, &mut c, &[4, 5]).unwrap();
            n += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(b.join().unwrap().is_err());
        assert!(n > 10, "{n} forwards");
        step(&a, &mut c, &[6]).unwrap();
        assert_eq!(a.tp_links().unwrap().connects(), 1);
    }
}
