//! `dspark tp-shard`: one of ranks 1.. of a tensor-parallel target worker. It loads its slice
//! of the target (its heads and FFN columns, [`dspark_runtime::tp`]), binds its port at start
//! and listens on it once loaded, and computes its share of every forward the target worker
//! (rank 0, started with `--tp-peers`) sends it. It holds no requests: on SIGTERM it keeps
//! serving while its rank 0 is still connected (draining), up to `--drain-timeout-s`.

use crate::{Result, TargetError};
use clap::Parser;
use dspark_runtime::tp::{self, ShardState, TpOptions};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug, Clone)]
#[command(name = "tp-shard", about = "dspark tensor-parallel shard rank")]
pub struct ShardArgs {
    /// Target model (name or path): the same checkpoint as its target worker.
    #[arg(long, env = "DSPARK_MODEL", default_value = "smollm2-135m")]
    pub model: String,
    /// This rank (1 .. size-1; rank 0 is the target worker).
    #[arg(long, env = "DSPARK_TP_RANK")]
    pub tp_rank: usize,
    /// Ranks in the group, the target worker included.
    #[arg(long, env = "DSPARK_TP_SIZE")]
    pub tp_size: usize,
    /// Where rank 0 dials this rank (port 0 picks a free one; the bound address is printed).
    #[arg(long, env = "DSPARK_TP_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Compute threads (0 = all cores).
    #[arg(long, env = "DSPARK_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Force a kernel path, as `dspark --isa` (default: the fastest this CPU has).
    #[arg(long, env = "DSPARK_ISA", value_parser = kernels::Isa::parse)]
    pub isa: Option<kernels::Isa>,
    /// On SIGTERM or Ctrl-C: keep serving while rank 0 is connected (it drains its requests)
    /// for up to this many seconds.
    #[arg(long, env = "DSPARK_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    #[arg(long, env = "DSPARK_HOME")]
    pub home: Option<PathBuf>,
    #[arg(long, env = "DSPARK_PYTHON", default_value = "python3")]
    pub python: String,
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
}

pub async fn run(a: ShardArgs) -> Result<()> {
    if a.tp_size < 2 || a.tp_rank == 0 || a.tp_rank >= a.tp_size {
        return Err(TargetError::Config(format!(
            "--tp-rank {} of --tp-size {}: shard ranks are 1 .. size-1 (rank 0 is the target worker)",
            a.tp_rank, a.tp_size
        )));
    }
    // Bound now, before the model loads (minutes): the port (`dspark up` picked it free) is
    // this rank's from the start. Listening only once loaded: until then connections are
    // refused, so a probe on the port reads "not ready".
    let socket = if a.listen.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(a.listen)?;
    let isa = a.isa;
    let home = dspark_runtime::fetch::dspark_home(a.home.as_deref());
    // File IO, maybe a download through Python (minutes): off the async runtime, as the load.
    let (model, python) = (a.model.clone(), a.python.clone());
    let path = tokio::task::spawn_blocking(move || {
        dspark_runtime::fetch::resolve(&model, &home, &python, &mut |m| eprintln!("{m}"))
    })
    .await
    .map_err(|e| TargetError::Config(format!("resolver: {e}")))?
    .map_err(|e| TargetError::Config(format!("model: {e}")))?;
    let opts = dspark_runtime::LoadOptions {
        threads: a.threads,
        isa,
        tp: Some(TpOptions::shard(a.tp_rank, a.tp_size)),
        ..Default::default()
    };
    let model = tokio::task::spawn_blocking(move || dspark_runtime::Model::load(&path, &opts))
        .await
        .map_err(|e| TargetError::Config(format!("loader: {e}")))?
        .map_err(|e| TargetError::Config(format!("model: {e}")))?;
    // The accept loop runs on a thread of its own and blocks.
    let listener = socket.listen(1024)?.into_std()?;
    listener.set_nonblocking(false)?;
    println!(
        "tensor-parallel rank {} of {} ({}, {}) listening on {}",
        a.tp_rank,
        a.tp_size,
        a.model,
        model.weights_desc,
        listener.local_addr()?
    );
    let state = Arc::new(ShardState::default());
    let st = Arc::clone(&state);
    let model = Arc::new(model);
    std::thread::Builder::new()
        .name("tp-accept".into())
        .spawn(move || {
            if let Err(e) = tp::serve_with(model, listener, st) {
                tracing::error!("tensor-parallel rank stopped: {e}");
                std::process::exit(1);
            }
        })?;
    dspark_scheduler::stop_requested(a.exit_on_stdin_eof).await;
    let limit = Duration::from_secs(a.drain_timeout_s);
    dspark_scheduler::drain("rank 0's link", limit, || state.connected() as usize).await;
    tracing::info!(forwards = state.forwards(), "tensor-parallel rank stopping");
    dspark_scheduler::exit_after(Duration::ZERO);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resolving the model (file IO, maybe a download through Python) leaves the async
    /// runtime free: its cached copy's marker is a FIFO here, so the resolve blocks until a
    /// thread writes to it, a second later, while a task on the runtime's one thread ticks.
    #[test]
    fn resolving_the_model_leaves_the_async_runtime_free() {
        let home =
            std::env::temp_dir().join(format!("dspark-shard-resolve-{}", std::process::id()));
        let models = home.join("models");
        std::fs::create_dir_all(&models).expect("models dir");
        let spec = dspark_runtime::fetch::spec("smollm2-135m").expect("a known model");
        let dest = dspark_runtime::fetch::model_path(&home, &spec);
        std::fs::write(&dest, b"").expect("cached copy");
        let marker = dest.with_extension("gguf.verified");
        let _ = std::fs::remove_file(&marker);
        let made = std::process::Command::new("mkfifo")
            .arg(&marker)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let writer = marker.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            let _ = std::fs::write(writer, b"not the checksum");
        });
        let args = ShardArgs::try_parse_from([
            "tp-shard",
            "--model",
            "smollm2-135m",
            "--tp-rank",
            "1",
            "--tp-size",
            "2",
            "--home",
            home.to_str().expect("utf-8 path"),
            // The copy is not the model's: a fetch follows, and fails at once.
            "--python",
            "false",
        ])
        .expect("args");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let ticks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let t = Arc::clone(&ticks);
        let res = rt.block_on(async move {
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    t.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            });
            run(args).await
        });
        let _ = std::fs::remove_dir_all(&home);
        assert!(
            matches!(&res, Err(TargetError::Config(m)) if m.starts_with("model:")),
            "the fetch fails: {res:?}"
        );
        let n = ticks.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            n >= 20,
            "the runtime ticked {n} times while the model resolved"
        );
    }
}
