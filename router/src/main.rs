use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-router");
    router::run(router::RouterArgs::parse()).await?;
    Ok(())
}
