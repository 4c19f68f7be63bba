use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-target-worker");
    target_worker::run(target_worker::TargetArgs::parse()).await?;
    Ok(())
}
