use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-target-worker");
    let r = target_worker::run(target_worker::TargetArgs::parse()).await;
    dspark_scheduler::finish_run(r).await?;
    Ok(())
}
