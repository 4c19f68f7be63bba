use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-draft-worker");
    let r = draft_worker::run(draft_worker::DraftArgs::parse()).await;
    dspark_scheduler::finish_run(r).await?;
    Ok(())
}
