//! The engine thread: owns the [`Engine`], takes new requests from the gRPC service, steps, and
//! streams each request's committed tokens back. A request whose caller went away is cancelled.

use crate::metrics::{Snapshot, WorkerMetrics};
use crate::remote::RemoteShared;
use dspark_proto::{Finished, GenerateEvent, SpecStats, TokenChunk, generate_event};
use specdec::{Engine, Event};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

pub type EventTx = UnboundedSender<Result<GenerateEvent, Status>>;

pub enum Cmd {
    Add {
        req: specdec::Request,
        draft: Option<String>,
        events: EventTx,
        /// The request's span: each engine cycle links to the spans of the requests it
        /// holds, so a trace backend leads from a slow cycle to its requests.
        span: tracing::Span,
    },
}

/// When the engine step in progress started, for [`spawn_watchdog`]: a step is bounded (a
/// prefill chunk, a verification window per request), so one that runs for minutes is a
/// wedged engine, which nothing else notices (the gRPC side answers, heartbeats go on).
#[derive(Clone)]
pub struct StepClock {
    base: std::time::Instant,
    /// Milliseconds since `base` at the step's start, plus one; 0 between steps.
    started: Arc<AtomicU64>,
}

impl Default for StepClock {
    fn default() -> Self {
        Self {
            base: std::time::Instant::now(),
            started: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl StepClock {
    pub fn begin(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.started.store(ms.saturating_add(1), Ordering::Relaxed);
    }

    pub fn end(&self) {
        self.started.store(0, Ordering::Relaxed);
    }

    /// How long the step in progress has run; `None` between steps.
    pub fn running_for(&self) -> Option<Duration> {
        match self.started.load(Ordering::Relaxed) {
            0 => None,
            t => {
                let now = self.base.elapsed().as_millis() as u64;
                Some(Duration::from_millis(now.saturating_sub(t - 1)))
            }
        }
    }
}

/// Looks at `clock` every `period`; once a step has run past `limit`, calls `on_stuck` with its
/// duration and stops. The worker exits there: its streams fail over in the router, and the
/// process is restarted (a wedged engine would hold its requests for ever).
pub fn spawn_watchdog(
    clock: StepClock,
    limit: Duration,
    period: Duration,
    on_stuck: impl FnOnce(Duration) + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("engine-watchdog".into())
        .spawn(move || {
            loop {
                std::thread::sleep(period);
                if let Some(d) = clock.running_for()
                    && d > limit
                {
                    on_stuck(d);
                    return;
                }
            }
        })
}

pub struct EngineLoop {
    /// Marks each step's start and end for the watchdog.
    pub clock: StepClock,
    pub engine: Engine,
    pub shared: Arc<RemoteShared>,
    pub load: Arc<AtomicUsize>,
    /// Told when a request ends, so placement hears of the room before the next heartbeat (it
    /// counts its own placements only until then).
    pub room: dspark_scheduler::discovery::Nudge,
    pub metrics: Arc<WorkerMetrics>,
    /// Spans of the requests held (see [`Cmd::Add`]).
    pub spans: HashMap<u64, tracing::Span>,
}

impl EngineLoop {
    pub fn run(mut self, rx: std::sync::mpsc::Receiver<Cmd>) {
        let mut senders: HashMap<u64, EventTx> = HashMap::new();
        loop {
            if self.engine.is_idle() {
                self.metrics.publish(Snapshot::of(&self.engine));
                match rx.recv() {
                    Ok(c) => self.handle(c, &mut senders),
                    Err(_) => return,
                }
            }
            while let Ok(c) = rx.try_recv() {
                self.handle(c, &mut senders);
            }
            // Callers that went away: cancel, free their KV.
            let gone: Vec<u64> = senders
                .iter()
                .filter(|(_, tx)| tx.is_closed())
                .map(|(id, _)| *id)
                .collect();
            for id in gone {
                let _ = self.engine.cancel(id);
                self.metrics.finished("cancelled");
                self.end(id, &mut senders);
            }
            if self.engine.is_idle() {
                continue;
            }
            // Info, as the exporter passes (per-cycle spans are part of what it promises).
            let span = tracing::info_span!(
                "cycle",
                step = self.engine.steps,
                requests = self.spans.len()
            );
            for s in self.spans.values() {
                span.follows_from(s.id());
            }
            let _g = span.enter();
            let t0 = std::time::Instant::now();
            self.clock.begin();
            let stepped = self.engine.step();
            self.clock.end();
            self.metrics
                .step_seconds
                .observe(t0.elapsed().as_secs_f64());
            match stepped {
                Ok(events) => {
                    // Published before the events go out: a caller that saw its request end
                    // and then scrapes finds it counted.
                    self.metrics.publish(Snapshot::of(&self.engine));
                    let ending = ending(&events);
                    for ev in events {
                        self.dispatch(ev, &ending, &mut senders);
                    }
                }
                Err(e) => {
                    tracing::error!("engine step failed: {e}; failing its requests");
                    let ids: Vec<u64> = senders.keys().copied().collect();
                    for id in ids {
                        let _ = self.engine.cancel(id);
                        self.metrics.finished("error");
                        if let Some(tx) = senders.get(&id) {
                            let _ = tx.send(Err(Status::internal(format!("engine: {e}"))));
                        }
                        self.end(id, &mut senders);
                    }
                }
            }
        }
    }

    fn end(&mut self, id: u64, senders: &mut HashMap<u64, EventTx>) {
        if senders.remove(&id).is_some() {
            self.load.fetch_sub(1, Ordering::Relaxed);
            self.room.nudge();
        }
        if let Ok(mut a) = self.shared.assign.lock() {
            a.remove(&id);
        }
        // Every ending's drafting cycles count (a cancelled or failed request's too, as its
        // drafted and accepted tokens do).
        if let Some(w) = self
            .shared
            .stats
            .lock()
            .ok()
            .and_then(|mut s| s.remove(&id))
        {
            self.metrics
                .remote_cycles
                .fetch_add(w.remote_cycles as u64, Ordering::Relaxed);
            self.metrics
                .fallback_cycles
                .fetch_add(w.fallback_cycles as u64, Ordering::Relaxed);
        }
        self.spans.remove(&id);
    }

    fn handle(&mut self, c: Cmd, senders: &mut HashMap<u64, EventTx>) {
        match c {
            Cmd::Add {
                req,
                draft,
                events,
                span,
            } => {
                let id = req.id;
                if let Some(d) = draft {
                    if let Ok(mut a) = self.shared.assign.lock() {
                        a.insert(id, d);
                    }
                }
                match self.engine.add(req) {
                    // Counted in `load` when the service took it.
                    Ok(()) => {
                        senders.insert(id, events);
                        self.spans.insert(id, span);
                    }
                    Err(e) => {
                        self.load.fetch_sub(1, Ordering::Relaxed);
                        self.room.nudge();
                        let _ = events.send(Err(Status::invalid_argument(e.to_string())));
                        if let Ok(mut a) = self.shared.assign.lock() {
                            a.remove(&id);
                        }
                    }
                }
            }
        }
    }

    fn dispatch(
        &mut self,
        ev: Event,
        ending: &HashMap<u64, &'static str>,
        senders: &mut HashMap<u64, EventTx>,
    ) {
        match ev {
            Event::Tokens {
                id,
                tokens,
                text,
                logprobs,
                prompt_logprobs,
            } => {
                let wire = |l: Vec<specdec::TokenLogprob>| -> Vec<dspark_proto::TokenLogprob> {
                    l.into_iter()
                        .map(|l| dspark_proto::TokenLogprob {
                            logprob: l.logprob,
                            top_ids: l.top.iter().map(|x| x.0).collect(),
                            top_logprobs: l.top.iter().map(|x| x.1).collect(),
                        })
                        .collect()
                };
                if let Some(tx) = senders.get(&id) {
                    let m = GenerateEvent {
                        kind: Some(generate_event::Kind::Tokens(TokenChunk {
                            ids: tokens,
                            text,
                            logprobs: wire(logprobs),
                            prompt_logprobs: wire(prompt_logprobs),
                            finish_reason: ending
                                .get(&id)
                                .map(|r| r.to_string())
                                .unwrap_or_default(),
                        })),
                    };
                    if tx.send(Ok(m)).is_err() {
                        let _ = self.engine.cancel(id);
                        self.metrics.finished("cancelled");
                        self.end(id, senders);
                    }
                }
            }
            Event::Finished {
                id,
                reason,
                metrics,
            } => {
                let w = self
                    .shared
                    .stats
                    .lock()
                    .ok()
                    .and_then(|s| s.get(&id).cloned())
                    .unwrap_or_default();
                if let Some(tx) = senders.get(&id) {
                    // Counted here only: a caller gone in this same step was counted as
                    // cancelled already.
                    self.metrics.finished(reason.as_str());
                    let stats = SpecStats {
                        prompt_tokens: metrics.prompt_tokens as u32,
                        cached_tokens: metrics.cached_tokens as u32,
                        completion_tokens: metrics.completion_tokens as u32,
                        first_tokens: u32::from(metrics.completion_tokens > 0),
                        verify_forwards: metrics.target_calls as u32,
                        drafted_tokens: metrics.drafted_tokens as u32,
                        accepted_tokens: metrics.accepted_tokens as u32,
                        remote_draft_cycles: w.remote_cycles,
                        fallback_draft_cycles: w.fallback_cycles,
                        ttft_ms: metrics.ttft_s * 1e3,
                        bytes_to_draft: w.bytes_to_draft,
                        bytes_from_draft: w.bytes_from_draft,
                        draft_rtt_ms: w.rtt_us as f64 / 1e3,
                        draft_compute_ms: w.compute_us as f64 / 1e3,
                    };
                    let _ = tx.send(Ok(GenerateEvent {
                        kind: Some(generate_event::Kind::Finished(Finished {
                            reason: reason.as_str().to_string(),
                            stats: Some(stats),
                        })),
                    }));
                }
                self.end(id, senders);
            }
            Event::Failed { id, error } => {
                // This request only: the router resumes it from the tokens it has.
                if let Some(tx) = senders.get(&id) {
                    self.metrics.finished("error");
                    let _ = tx.send(Err(Status::internal(format!("engine: {error}"))));
                }
                self.end(id, senders);
            }
        }
    }
}

/// The requests a step's events finish, with their reasons. Their last token chunk carries
/// the reason too: a worker that dies between that chunk and `Finished` (sent back to back)
/// leaves the router a whole answer rather than a request to resume past its end.
fn ending(events: &[Event]) -> HashMap<u64, &'static str> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Finished { id, reason, .. } => Some((*id, reason.as_str())),
            Event::Tokens { .. } | Event::Failed { .. } => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{Duration, StepClock, ending, spawn_watchdog};
    use specdec::{Event, FinishReason, RequestMetrics};

    #[test]
    fn only_requests_finished_in_the_step_are_ending() {
        let tokens = |id| Event::Tokens {
            id,
            tokens: vec![1],
            text: "a".into(),
            logprobs: vec![],
            prompt_logprobs: vec![],
        };
        let done = |id, reason| Event::Finished {
            id,
            reason,
            metrics: RequestMetrics::default(),
        };
        let events = vec![
            tokens(1),
            tokens(2),
            done(2, FinishReason::Stop),
            tokens(3),
            done(3, FinishReason::Length),
            done(4, FinishReason::Cancelled),
        ];
        let e = ending(&events);
        assert_eq!(e.get(&1), None);
        assert_eq!(e.get(&2), Some(&"stop"));
        assert_eq!(e.get(&3), Some(&"length"));
        assert_eq!(e.get(&4), Some(&"cancelled"));
        assert_eq!(e.len(), 3);
    }

    /// A step that runs past the limit is reported once, with its duration; steps that end in
    /// time, and the time between steps, never are.
    #[test]
    fn the_watchdog_reports_a_step_that_never_ends() {
        let clock = StepClock::default();
        assert_eq!(clock.running_for(), None);
        let (tx, rx) = std::sync::mpsc::channel();
        spawn_watchdog(
            clock.clone(),
            Duration::from_millis(400),
            Duration::from_millis(10),
            move |d| {
                let _ = tx.send(d);
            },
        )
        .unwrap();
        // Short steps and idle time: nothing.
        for _ in 0..20 {
            clock.begin();
            std::thread::sleep(Duration::from_millis(5));
            clock.end();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(rx.try_recv().is_err(), "a step in time was reported");
        // A step that does not end.
        clock.begin();
        let d = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the stuck step reported");
        assert!(d > Duration::from_millis(400), "{d:?}");
        assert!(clock.running_for().is_some_and(|r| r >= d));
    }
}
