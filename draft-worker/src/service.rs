//! `dspark.v1.DraftWorker`: one bidirectional stream per target worker.

use crate::drafting::{DraftHost, Drafting, Job, check_finished};
use crate::metrics::DraftMetrics;
use dspark_proto::draft_worker_server::DraftWorker;
use dspark_proto::{DraftCall, DraftReply, InfoRequest, WorkerInfo};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone)]
pub struct DraftService {
    jobs: std::sync::mpsc::Sender<Job>,
    info: WorkerInfo,
    streams: Arc<AtomicU64>,
    load: Arc<AtomicUsize>,
    metrics: Arc<DraftMetrics>,
}

impl DraftService {
    /// Starts the drafting thread.
    pub fn start(host: DraftHost, info: WorkerInfo) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let load = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(DraftMetrics::default());
        let (l2, m2) = (Arc::clone(&load), Arc::clone(&metrics));
        std::thread::Builder::new()
            .name("drafting".into())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| Drafting::new(host).run(rx, l2, &m2));
                // A worker whose drafting thread is gone would stay registered and refuse every
                // round: it exits instead, so its registration ends and it is restarted.
                if std::panic::catch_unwind(run).is_err() {
                    tracing::error!("the drafting thread panicked; exiting");
                    std::process::exit(70);
                }
            })?;
        Ok(Self {
            jobs: tx,
            info,
            streams: Arc::new(AtomicU64::new(0)),
            load,
            metrics,
        })
    }

    pub fn metrics(&self) -> Arc<DraftMetrics> {
        Arc::clone(&self.metrics)
    }

    /// Requests with draft state (reported as load).
    pub fn load_counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.load)
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<DraftReply, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl DraftWorker for DraftService {
    type DraftStream = ReplyStream;

    async fn draft(
        &self,
        req: Request<Streaming<DraftCall>>,
    ) -> Result<Response<Self::DraftStream>, Status> {
        let stream_no = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        let mut calls = req.into_inner();
        let jobs = self.jobs.clone();
        let info = self.info.clone();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<DraftReply, Status>>(16);
        let metrics = Arc::clone(&self.metrics);
        DraftMetrics::add(&metrics.streams, 1);
        tokio::spawn(async move {
            let mut last_step: Option<u64> = None;
            let mut first = true;
            loop {
                let call = match calls.next().await {
                    Some(Ok(c)) => c,
                    Some(Err(s)) => {
                        // e.g. an oversized message: the caller learns why its stream ended.
                        if matches!(
                            s.code(),
                            tonic::Code::OutOfRange
                                | tonic::Code::InvalidArgument
                                | tonic::Code::ResourceExhausted
                        ) {
                            tracing::warn!(
                                stream = stream_no,
                                "draft stream refused: {}",
                                s.message()
                            );
                        } else {
                            tracing::debug!(
                                stream = stream_no,
                                "draft stream ended: {}",
                                s.message()
                            );
                        }
                        let _ = tx.send(Err(s)).await;
                        break;
                    }
                    None => break,
                };
                if first {
                    first = false;
                    // Without the target's vocabulary hash the token ids it sends cannot be
                    // known to mean what the drafter reads them as: refused, not assumed.
                    if call.vocab_hash.is_empty() {
                        tracing::warn!(
                            stream = stream_no,
                            target = call.target_worker,
                            "draft stream refused: no vocabulary hash"
                        );
                        let _ = tx
                            .send(Err(Status::invalid_argument(format!(
                                "the first message of a draft stream must carry the target's \
                                 vocab_hash (this draft worker serves vocabulary {}, model {})",
                                info.vocab_hash, info.model
                            ))))
                            .await;
                        break;
                    }
                    if call.vocab_hash != info.vocab_hash {
                        let _ = tx
                            .send(Err(Status::failed_precondition(format!(
                                "draft worker serves vocabulary {} (model {}), the target has {}",
                                info.vocab_hash, info.model, call.vocab_hash
                            ))))
                            .await;
                        break;
                    }
                    tracing::info!(
                        stream = stream_no,
                        target = call.target_worker,
                        "target worker connected"
                    );
                    // Its requests count against its target's quota, over all its streams.
                    if jobs
                        .send(Job::Open {
                            stream: stream_no,
                            target: call.target_worker.clone(),
                        })
                        .is_err()
                    {
                        let _ = tx
                            .send(Err(Status::unavailable("drafting thread gone")))
                            .await;
                        break;
                    }
                }
                // Refused before its finished ids reach the drafting thread (a stale round's
                // are freed too), unbounded otherwise.
                if let Err(error) = check_finished(&call) {
                    tracing::warn!(stream = stream_no, "draft round refused: {error}");
                    // Answered, with an error: counted as the drafting thread counts its own.
                    DraftMetrics::add(&metrics.rounds, 1);
                    DraftMetrics::add(&metrics.round_errors, 1);
                    let rep = DraftReply {
                        step: call.step,
                        error,
                        ..Default::default()
                    };
                    if tx.send(Ok(rep)).await.is_err() {
                        break;
                    }
                    continue;
                }
                if let Some(last) = last_step.filter(|&l| call.step <= l) {
                    // Its drafting is refused; the requests it says are finished are freed. The
                    // stream waits until they are, as for a round: stale rounds sent faster than
                    // the drafting thread works wait their turn instead of queueing without end.
                    if !call.finished.is_empty() {
                        let (done, applied) = tokio::sync::oneshot::channel();
                        let sent = jobs.send(Job::Finish {
                            stream: stream_no,
                            seqs: call.finished,
                            done,
                        });
                        if sent.is_err() || applied.await.is_err() {
                            let _ = tx
                                .send(Err(Status::unavailable("drafting thread gone")))
                                .await;
                            break;
                        }
                    }
                    DraftMetrics::add(&metrics.rounds, 1);
                    DraftMetrics::add(&metrics.round_errors, 1);
                    let rep = DraftReply {
                        step: call.step,
                        error: format!("stale or reordered step {} (last {last})", call.step),
                        ..Default::default()
                    };
                    if tx.send(Ok(rep)).await.is_err() {
                        break;
                    }
                    continue;
                }
                last_step = Some(call.step);
                let (rtx, rrx) = tokio::sync::oneshot::channel();
                if jobs
                    .send(Job::Round {
                        stream: stream_no,
                        call,
                        reply: rtx,
                    })
                    .is_err()
                {
                    let _ = tx
                        .send(Err(Status::unavailable("drafting thread gone")))
                        .await;
                    break;
                }
                let Ok(rep) = rrx.await else {
                    let _ = tx
                        .send(Err(Status::internal("drafting thread dropped a round")))
                        .await;
                    break;
                };
                if tx.send(Ok(rep)).await.is_err() {
                    break;
                }
            }
            let _ = jobs.send(Job::Drop { stream: stream_no });
            metrics.streams.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        let mut i = self.info.clone();
        i.load = self.load.load(Ordering::Relaxed) as u32;
        Ok(Response::new(i))
    }
}
