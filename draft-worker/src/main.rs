use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-draft-worker");
    let r = draft_worker::run(draft_worker::DraftArgs::parse()).await;
    // What the exporter batched during the drain, sent while its runtime still runs (not
    // after a failure: a forced exit could cut its report short).
    if r.is_ok() {
        let _ = tokio::task::spawn_blocking(|| {
            dspark_scheduler::flush_spans(std::time::Duration::from_secs(2))
        })
        .await;
    }
    r?;
    Ok(())
}
