//! The `dspark` command line: `fetch-model`, `generate`, `bench verify-curve`, `bench decode`.

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

/// `println!` that returns the write's `io::Result` instead of panicking: a reader that closes
/// the pipe early (`dspark … | head`) ends the command quietly (see [`run`]).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($t)*)
    }};
}

pub mod bench;
pub mod config;
pub mod draft_bench;
pub mod eval;
pub mod frontier;
pub mod generate;
pub mod plan;
pub mod plot;
pub mod prefix_bench;
pub mod profile;
pub mod serve_bench;
pub mod spec;
pub mod tp_bench;
pub mod train;
pub mod up;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "dspark",
    version,
    about = "Disaggregated speculative-decoding LLM serving"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: config::GlobalArgs,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Download a known model into the cache (idempotent) and print its path.
    FetchModel {
        /// smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b
        name: String,
        /// Also the draft model this drafter loads beside NAME (`draft-model[:MODEL]`; other
        /// drafters load none): what an init container fetches for a draft worker.
        #[arg(long)]
        drafter: Option<String>,
    },
    /// List the models `fetch-model` knows.
    Models,
    /// Autoregressive generation, streamed to the terminal.
    Generate(generate::GenerateArgs),
    /// Train a DSpark drafter for a target on CPU.
    TrainDrafter(train::TrainArgs),
    /// Evaluate a DSpark drafter against its parallel-only ablation, n-gram and the draft model.
    EvalDrafter(eval::EvalArgs),
    /// Replay the online recalibration on an `eval-drafter --blocks` file, for other half-lives.
    RecalReplay(eval::ReplayArgs),
    /// Drafter training text: the target's own answers to a prompt file, chat-rendered.
    GenData(train::GenDataArgs),
    /// Fit the drafter's per-position confidence temperatures (STS) on held-out prompts.
    CalibrateDrafter(train::CalibrateArgs),
    /// Restrict a drafter to the most frequent target tokens of some text (its draft vocabulary).
    DrafterVocab(train::VocabArgs),
    /// Benchmarks (write JSON with --json FILE).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Profile SPS(B), the steps per second at each total batch size, for the scheduler.
    Profile(profile::ProfileArgs),
    /// Capacity planner: target and draft workers (and their ratio) that meet an SLO for a
    /// traffic mix, simulated over measured SPS(B), drafting cost and recorded verifications.
    Plan(plan::PlanArgs),
    /// Start the whole cluster on loopback: scheduler, draft and target workers, router.
    Up(up::UpArgs),
    /// One cluster piece: `dspark scheduler|target-worker|tp-shard|draft-worker|router --help`.
    #[command(external_subcommand)]
    Service(Vec<String>),
}

/// Parses a command line as [`run`] does, refusing global flags given before a role name
/// (`dspark --home /data router`): a role parses its own flags, those after its name, so
/// these would be dropped without a word.
pub fn parse_from<I, T>(argv: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::{CommandFactory, FromArgMatches};
    let mut cmd = Cli::command();
    let m = cmd.try_get_matches_from_mut(argv)?;
    let cli = Cli::from_arg_matches(&m).map_err(|e| e.format(&mut cmd))?;
    if let Command::Service(role) = &cli.cmd {
        let role = role.first().cloned().unwrap_or_default();
        // Only what the command line gave: the same settings from the environment reach the
        // role, which reads them itself.
        let given: Vec<String> = cmd
            .get_arguments()
            .filter(|a| a.is_global_set())
            .filter(|a| {
                m.value_source(a.get_id().as_str()) == Some(clap::parser::ValueSource::CommandLine)
            })
            .map(|a| format!("--{}", a.get_long().unwrap_or(a.get_id().as_str())))
            .collect();
        if let Some(first) = given.first() {
            let msg = format!(
                "{} before the role name `{role}` would be ignored: put {first} after the role: \
                 dspark {role} {first} ...",
                given.join(", ")
            );
            return Err(cmd.error(clap::error::ErrorKind::ArgumentConflict, msg));
        }
    }
    Ok(cli)
}

pub fn run() -> ExitCode {
    let cli = match parse_from(std::env::args_os()) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if matches!(cli.cmd, Command::Service(_)) {
        // Services log at info by default (their own subscriber).
        return match dispatch(cli) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSPARK_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`| head`): what it wanted, it has.
        Err(e) if broken_pipe(&e) => ExitCode::SUCCESS,
        // An answer, not a failure: scripts tell it apart from bad input.
        Err(e) if e.downcast_ref::<plan::NoPlan>().is_some() => {
            eprintln!("error: {e:#}");
            ExitCode::from(plan::NoPlan::EXIT)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether an error is stdout's reader having closed the pipe.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Runs a service subcommand (its own flags, parsed by its crate).
fn service(argv: Vec<String>) -> anyhow::Result<()> {
    let name = argv.first().cloned().unwrap_or_default();
    let rt = tokio::runtime::Runtime::new()?;
    // The OTLP exporter's gRPC channel lives on this runtime.
    let _guard = rt.enter();
    dspark_scheduler::init_tracing(&format!("dspark-{name}"));
    let ran = run_service(&rt, &name, &argv);
    // What the exporter batched during the drain, sent while its runtime still runs (not
    // after a failure: a forced exit could cut its report short).
    if ran.is_ok() {
        dspark_scheduler::flush_spans(std::time::Duration::from_secs(2));
    }
    ran
}

fn run_service(rt: &tokio::runtime::Runtime, name: &str, argv: &[String]) -> anyhow::Result<()> {
    use clap::Parser;
    match name {
        "scheduler" => {
            let a =
                dspark_scheduler::SchedulerArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
            let eof = a.exit_on_stdin_eof;
            rt.block_on(dspark_scheduler::serve(
                a,
                dspark_scheduler::shutdown_signal(eof),
            ))?;
        }
        "target-worker" => {
            let a = target_worker::TargetArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
            rt.block_on(target_worker::run(a))?;
        }
        "tp-shard" => {
            let a =
                target_worker::shard::ShardArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
            rt.block_on(target_worker::shard::run(a))?;
        }
        "draft-worker" => {
            let a = draft_worker::DraftArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
            rt.block_on(draft_worker::run(a))?;
        }
        "router" => {
            let a = router::RouterArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
            rt.block_on(router::run(a))?;
        }
        other => anyhow::bail!(
            "unknown command `{other}` (see `dspark --help`; services: scheduler, target-worker, tp-shard, draft-worker, router)"
        ),
    }
    Ok(())
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    if let Command::Service(argv) = cli.cmd {
        return service(argv);
    }
    let g = cli.global.validate()?;
    match cli.cmd {
        Command::FetchModel {
            name,
            drafter: kind,
        } => {
            // The drafter first: a bad kind is refused before a download.
            let draft = match kind.as_deref().filter(|d| !d.is_empty()) {
                Some(k) => {
                    match specdec::ProposerKind::parse(k, drafter::build::default_draft_for(&name))?
                    {
                        specdec::ProposerKind::DraftModel(d) => Some(d),
                        _ => None,
                    }
                }
                None => None,
            };
            let spec = dspark_runtime::fetch::spec(&name).ok_or_else(|| {
                let names: Vec<&str> = dspark_runtime::fetch::known_models()
                    .iter()
                    .map(|m| m.name)
                    .collect();
                anyhow::anyhow!("unknown model `{name}` (known: {})", names.join(", "))
            })?;
            let p =
                dspark_runtime::fetch::fetch(&spec, &g.home, &g.python, &mut |m| eprintln!("{m}"))?;
            out!("{}", p.display())?;
            if let Some(d) = draft {
                out!("{}", g.resolve_model(&d)?.display())?;
            }
            Ok(())
        }
        Command::Models => {
            for m in dspark_runtime::fetch::known_models() {
                out!(
                    "{:<20} {:>6} MB  {}",
                    m.name,
                    m.bytes / 1_000_000,
                    m.description
                )?;
            }
            Ok(())
        }
        Command::Generate(a) => generate::run(&g, a),
        Command::Bench(b) => bench::run(&g, b),
        Command::TrainDrafter(a) => train::run(&g, a),
        Command::CalibrateDrafter(a) => train::calibrate(&g, a),
        Command::DrafterVocab(a) => train::drafter_vocab(&g, a),
        Command::GenData(a) => train::gen_data(&g, a),
        Command::EvalDrafter(a) => eval::run(&g, a),
        Command::RecalReplay(a) => eval::recal_replay(a),
        Command::Up(a) => up::run(&g, a),
        Command::Profile(a) => profile::run(&g, a),
        Command::Plan(a) => plan::run(a),
        Command::Service(_) => anyhow::bail!("service commands are dispatched above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_flags_before_a_role_name_are_refused() {
        let e = parse_from(["dspark", "--threads", "2", "target-worker"])
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("dspark target-worker --threads"), "{e}");
        let e = parse_from(["dspark", "--home", "/data", "router"])
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("dspark router --home"), "{e}");
        // After the role name they are the role's own flags.
        let c = parse_from(["dspark", "target-worker", "--threads", "2"]).expect("parsed");
        assert!(
            matches!(&c.cmd, Command::Service(v) if v == &["target-worker", "--threads", "2"]),
            "{:?}",
            c.cmd
        );
        // Before any other command they apply to it.
        let c = parse_from(["dspark", "--threads", "2", "models"]).expect("parsed");
        assert_eq!(c.global.threads, 2);
    }

    /// The README's promise: in a container every serving flag can be set from the
    /// environment (hidden test-only flags aside).
    #[test]
    fn every_serving_flag_has_an_environment_fallback() {
        use clap::CommandFactory;
        let roles = [
            ("scheduler", dspark_scheduler::SchedulerArgs::command()),
            ("target-worker", target_worker::TargetArgs::command()),
            ("tp-shard", target_worker::shard::ShardArgs::command()),
            ("draft-worker", draft_worker::DraftArgs::command()),
            ("router", router::RouterArgs::command()),
        ];
        let mut missing = Vec::new();
        for (role, cmd) in roles {
            for a in cmd.get_arguments() {
                let builtin = matches!(a.get_id().as_str(), "help" | "version");
                if a.get_long().is_some() && !a.is_hide_set() && !builtin && a.get_env().is_none() {
                    missing.push(format!("{role} --{}", a.get_id()));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "flags without an env fallback: {missing:?}"
        );
    }
}
