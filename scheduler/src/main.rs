use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dspark_scheduler::init_tracing("dspark-scheduler");
    let args = dspark_scheduler::SchedulerArgs::parse();
    let eof = args.exit_on_stdin_eof;
    let r = dspark_scheduler::serve(args, dspark_scheduler::shutdown_signal(eof)).await;
    dspark_scheduler::finish_run(r).await?;
    Ok(())
}
