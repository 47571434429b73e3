//! `vllm-rs`: one binary for every role. `serve` and `generate` are the launchers; they
//! start this same binary as `engine-core`, which starts it as `worker` once per rank.

use clap::Parser;
use vllm_frontend::cli::{Cli, Command};

fn main() {
    bound_malloc_arenas();
    let cli = Cli::parse();
    init_tracing();
    let code = match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

/// glibc gives each thread that allocates an arena of its own (up to 8 per core) and keeps
/// what a burst freed in each. On a 16-core host the frontend's RSS climbed for minutes
/// after warm-up (137 → 167 MiB in a 400 s soak) while its live heap stayed flat; with 16
/// tokio threads on 2 cores it grew +20% with 64 arenas, +10% with 4, and stayed flat
/// with 1, at the same request rate (docs/RELIABILITY.md). So one arena, as
/// `MALLOC_ARENA_MAX=1` would give; a `MALLOC_ARENA_MAX` in the environment wins.
fn bound_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before any thread
        // starts.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

fn run(mut command: Command) -> anyhow::Result<i32> {
    // A Hub id becomes its local snapshot folder here, once, before anything reads the
    // model; the engine-core and workers are started with that folder.
    if let Some(engine) = command.engine_args_mut() {
        vllm_frontend::hub::resolve_model_args(engine)?;
    }
    match command {
        Command::Serve(args) => runtime()?.block_on(vllm_frontend::server::serve(args)),
        Command::Generate(args) => runtime()?.block_on(vllm_frontend::generate::generate(args)),
        Command::Bench(args) => runtime()?.block_on(vllm_frontend::bench::bench(args)),
        Command::MakeTinyModel(args) => vllm_frontend::generate::make_tiny_model(&args).map(|()| 0),
        Command::CompileKernels(args) => vllm_frontend::compile_kernels::run(&args).map(|()| 0),
        Command::EngineCore { config_json } => {
            let config = serde_json::from_str(&config_json)?;
            runtime()?.block_on(vllm_engine_core::engine_core::run_engine_core(config))
        }
        Command::Worker {
            rank,
            world_size,
            run_dir,
            config_json,
        } => {
            let mut config: vllm_worker::model_runner::WorkerConfig =
                serde_json::from_str(&config_json)?;
            config.rank = rank;
            config.world_size = world_size;
            let args = vllm_worker::worker_proc::WorkerArgs {
                rank,
                world_size,
                run_dir,
                config,
            };
            // The model step blocks its thread; one runtime thread is all the sockets need.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(vllm_worker::worker_proc::run_worker(args))
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Logs go to stderr; `RUST_LOG` filters them (default: info).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
