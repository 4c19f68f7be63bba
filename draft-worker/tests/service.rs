//! The draft service over a real gRPC stream: what a target worker sees.

use draft_worker::drafting::DraftHost;
use draft_worker::service::DraftService;
use dspark_proto::draft_worker_client::DraftWorkerClient;
use dspark_proto::draft_worker_server::DraftWorkerServer;
use dspark_proto::{DraftCall, DraftItem, DraftReply, WorkerInfo};
use specdec::Proposer;
use specdec::proposer::{Dist, ProposeReq};
use tonic::Streaming;

const HASH: &str = "vocab-1";

/// Drafts k copies of token 1.
struct Ones;
impl Proposer for Ones {
    fn name(&self) -> &str {
        "ones"
    }
    fn propose(
        &mut self,
        reqs: &mut [ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
        Ok(reqs
            .iter()
            .map(|r| specdec::proposer::DraftBlock {
                tokens: vec![1; r.k],
                dists: vec![Dist::OneHot; r.k],
                ..Default::default()
            })
            .collect())
    }
}

/// A draft worker on a free local port; its URL.
async fn serve() -> String {
    serve_with(Box::new(Ones)).await
}

/// A draft worker drafting with `proposer` on a free local port; its URL.
async fn serve_with(proposer: Box<dyn Proposer>) -> String {
    serve_counted(proposer).await.0
}

/// As [`serve_with`], with the worker's metrics.
async fn serve_counted(
    proposer: Box<dyn Proposer>,
) -> (String, std::sync::Arc<draft_worker::metrics::DraftMetrics>) {
    let host = DraftHost {
        proposer,
        drafter: "ones".into(),
        vocab: 10,
        vocab_hash: HASH.into(),
        feature_layers: Vec::new(),
        row_len: 0,
        max_gamma: 4,
        copy_runs: Vec::new(),
        copy_head: Vec::new(),
    };
    let info = WorkerInfo {
        vocab_hash: HASH.into(),
        model: "test".into(),
        ..Default::default()
    };
    let svc = DraftService::start(host, info).expect("drafting thread");
    let metrics = svc.metrics();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DraftWorkerServer::new(svc))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), metrics)
}

/// Opens a draft stream; the sender for its calls and the replies.
async fn open(url: &str) -> (tokio::sync::mpsc::Sender<DraftCall>, Streaming<DraftReply>) {
    let mut dc = DraftWorkerClient::connect(url.to_string())
        .await
        .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let replies = dc
        .draft(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    (tx, replies)
}

fn item(seq: u64, tokens: Vec<u32>) -> DraftItem {
    DraftItem {
        seq,
        tokens,
        k: 3,
        ..Default::default()
    }
}

/// A stream whose first message names no vocabulary is refused with INVALID_ARGUMENT, never
/// served on the assumption that the ids mean the same on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_a_vocabulary_hash_is_refused() {
    let url = serve().await;
    let (tx, mut replies) = open(&url).await;
    tx.send(DraftCall {
        step: 1,
        items: vec![item(1, vec![2, 3])],
        ..Default::default()
    })
    .await
    .expect("send");
    let e = replies.message().await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("vocab_hash"), "{e:?}");

    // Another vocabulary: FAILED_PRECONDITION, as before.
    let (tx, mut replies) = open(&url).await;
    tx.send(DraftCall {
        step: 0,
        vocab_hash: "other".into(),
        ..Default::default()
    })
    .await
    .expect("send");
    let e = replies.message().await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
}

/// A round with one request of bad input still drafts the others: the bad one is asked to
/// resync (its target drafts it locally), and the round carries no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_request_leaves_the_round_drafting() {
    let url = serve().await;
    let (tx, mut replies) = open(&url).await;
    tx.send(DraftCall {
        step: 0,
        target_worker: "t".into(),
        vocab_hash: HASH.into(),
        ..Default::default()
    })
    .await
    .expect("hello");
    let hello = replies.message().await.expect("reply").expect("open");
    assert!(hello.error.is_empty(), "{hello:?}");
    tx.send(DraftCall {
        step: 1,
        items: vec![
            item(1, vec![2, 3, 4]),
            item(2, vec![2, u32::MAX]),
            item(3, vec![5, 6]),
        ],
        ..Default::default()
    })
    .await
    .expect("send");
    let r = replies.message().await.expect("reply").expect("open");
    assert_eq!(r.step, 1);
    assert!(r.error.is_empty(), "{r:?}");
    assert_eq!(r.blocks.len(), 3, "{r:?}");
    assert_eq!(r.blocks[0].tokens, vec![1, 1, 1]);
    assert!(
        r.blocks[1].need_sync && r.blocks[1].tokens.is_empty(),
        "{r:?}"
    );
    assert_eq!(r.blocks[1].have_tokens, 0);
    assert_eq!(r.blocks[2].tokens, vec![1, 1, 1]);
    assert_eq!(r.blocks[2].have_tokens, 2);
}

/// A finished list longer than any worker holds is refused with the round, a stale one too
/// (whose finished ids would otherwise be freed): the requests it names stay held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_finishing_too_many_requests_is_refused() {
    let url = serve().await;
    let (tx, mut replies) = open(&url).await;
    tx.send(DraftCall {
        step: 1,
        target_worker: "t".into(),
        vocab_hash: HASH.into(),
        items: vec![item(1, vec![2, 3, 4])],
        ..Default::default()
    })
    .await
    .expect("send");
    let r = replies.message().await.expect("reply").expect("open");
    assert_eq!(r.blocks[0].tokens, vec![1, 1, 1]);
    // A stale step, finishing request 1 among too many.
    tx.send(DraftCall {
        step: 1,
        finished: (1..=draft_worker::drafting::MAX_REQUESTS as u64 + 1).collect(),
        ..Default::default()
    })
    .await
    .expect("send");
    let r = replies.message().await.expect("reply").expect("open");
    assert!(r.error.contains("finished"), "{r:?}");
    tx.send(DraftCall {
        step: 2,
        items: vec![DraftItem {
            sync_from: 3,
            ..item(1, Vec::new())
        }],
        ..Default::default()
    })
    .await
    .expect("send");
    let r = replies.message().await.expect("reply").expect("open");
    assert!(r.error.is_empty(), "{r:?}");
    assert!(!r.blocks[0].need_sync, "request 1 freed: {r:?}");
    assert_eq!(r.blocks[0].tokens, vec![1, 1, 1]);
}

/// Drafts like [`Ones`], but each `propose` says it started and waits to be let go: the
/// drafting thread busy as long as a test wants.
struct Gated {
    started: tokio::sync::mpsc::UnboundedSender<()>,
    go: std::sync::mpsc::Receiver<()>,
}
impl Proposer for Gated {
    fn name(&self) -> &str {
        "gated"
    }
    fn propose(
        &mut self,
        reqs: &mut [ProposeReq<'_>],
    ) -> specdec::Result<Vec<specdec::proposer::DraftBlock>> {
        let _ = self.started.send(());
        let _ = self.go.recv();
        Ones.propose(reqs)
    }
}

/// Opens a stream for `target` and sends its hello; the stream once the hello is answered.
async fn hello(
    url: &str,
    target: &str,
) -> (tokio::sync::mpsc::Sender<DraftCall>, Streaming<DraftReply>) {
    let (tx, mut replies) = open(url).await;
    tx.send(DraftCall {
        step: 1,
        target_worker: target.into(),
        vocab_hash: HASH.into(),
        ..Default::default()
    })
    .await
    .expect("hello");
    let r = replies.message().await.expect("reply").expect("open");
    assert!(r.error.is_empty(), "{r:?}");
    (tx, replies)
}

/// A stale round's finished ids are applied before it is answered, as a round is: while the
/// drafting thread is busy, a stream sending stale rounds gets no answer (so sends no more)
/// instead of queueing work for the drafting thread without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_rounds_finished_ids_wait_for_the_drafting_thread() {
    let (started, mut busy) = tokio::sync::mpsc::unbounded_channel();
    let (go, gate) = std::sync::mpsc::channel();
    let url = serve_with(Box::new(Gated { started, go: gate })).await;
    let (tx_a, mut rep_a) = hello(&url, "a").await;
    let (tx_b, mut rep_b) = hello(&url, "b").await;
    // Stream a's round keeps the drafting thread busy.
    tx_a.send(DraftCall {
        step: 2,
        items: vec![item(1, vec![2, 3])],
        ..Default::default()
    })
    .await
    .expect("send");
    busy.recv().await.expect("drafting");
    // Stream b's stale round (step 1 again) finishing requests is not answered meanwhile.
    tx_b.send(DraftCall {
        step: 1,
        finished: (1..=draft_worker::drafting::MAX_REQUESTS as u64).collect(),
        ..Default::default()
    })
    .await
    .expect("send");
    let early = tokio::time::timeout(std::time::Duration::from_millis(300), rep_b.message()).await;
    assert!(
        early.is_err(),
        "answered while the drafting thread was busy: {early:?}"
    );
    go.send(()).expect("let go");
    let r = rep_a.message().await.expect("reply").expect("open");
    assert_eq!(r.blocks[0].tokens, vec![1, 1, 1]);
    let r = rep_b.message().await.expect("reply").expect("open");
    assert!(r.error.contains("stale"), "{r:?}");
    drop(go);
}

/// Rounds the service refuses before the drafting thread sees them (stale steps, bad finished
/// lists) count as rounds answered with an error, as the README's metrics say.
#[tokio::test]
async fn rounds_refused_by_the_service_are_counted() {
    use std::sync::atomic::Ordering::Relaxed;
    let (url, metrics) = serve_counted(Box::new(Ones)).await;
    let (tx, mut rep) = hello(&url, "a").await;
    let errors_before = metrics.round_errors.load(Relaxed);
    let rounds_before = metrics.rounds.load(Relaxed);
    for call in [
        // Stale: the hello's step again.
        DraftCall {
            step: 1,
            ..Default::default()
        },
        // A finished list longer than any round's.
        DraftCall {
            step: 5,
            finished: vec![3; draft_worker::drafting::MAX_REQUESTS + 1],
            ..Default::default()
        },
    ] {
        tx.send(call).await.expect("send");
        let r = rep.message().await.expect("reply").expect("open");
        assert!(!r.error.is_empty(), "{r:?}");
    }
    assert_eq!(metrics.round_errors.load(Relaxed) - errors_before, 2);
    assert_eq!(metrics.rounds.load(Relaxed) - rounds_before, 2);
}

/// The request quota is a target worker's over all its streams (named in each stream's first
/// message): a second stream of a target at its quota is refused new requests, another
/// target's stream is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_targets_quota_spans_its_streams() {
    use draft_worker::drafting::MAX_TARGET_REQUESTS;
    let url = serve().await;
    let (tx1, mut rep1) = hello(&url, "t").await;
    let (tx2, mut rep2) = hello(&url, "t").await;
    let (tx3, mut rep3) = hello(&url, "u").await;
    tx1.send(DraftCall {
        step: 2,
        items: (1..=MAX_TARGET_REQUESTS as u64)
            .map(|s| item(s, vec![2]))
            .collect(),
        ..Default::default()
    })
    .await
    .expect("send");
    let r = rep1.message().await.expect("reply").expect("open");
    assert!(r.blocks.iter().all(|b| !b.need_sync), "quota taken");
    let one = DraftCall {
        step: 2,
        items: vec![item(1, vec![2])],
        ..Default::default()
    };
    tx2.send(one.clone()).await.expect("send");
    let r = rep2.message().await.expect("reply").expect("open");
    assert!(
        r.blocks[0].need_sync && r.blocks[0].tokens.is_empty(),
        "{r:?}"
    );
    tx3.send(one).await.expect("send");
    let r = rep3.message().await.expect("reply").expect("open");
    assert_eq!(r.blocks[0].tokens, vec![1, 1, 1], "{r:?}");
    // Closing the first stream frees the target's quota for its second.
    drop((tx1, rep1));
    let mut freed = false;
    for step in 3..200 {
        tx2.send(DraftCall {
            step,
            items: vec![item(1, vec![2])],
            ..Default::default()
        })
        .await
        .expect("send");
        let r = rep2.message().await.expect("reply").expect("open");
        if !r.blocks[0].need_sync {
            freed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(freed, "the closed stream's requests still count");
}
