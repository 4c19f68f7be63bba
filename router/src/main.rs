use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-router");
    let r = router::run(router::RouterArgs::parse()).await;
    dspark_scheduler::finish_run(r).await?;
    Ok(())
}
