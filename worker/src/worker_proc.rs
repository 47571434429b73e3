//! The worker process (`vllm-rs worker --rank R …`): connects to the engine-core, joins its
//! tensor-parallel group (rank 0 proposes the group's `DistributedInit`, the engine-core
//! hands it to every rank), loads its shard of the model, reports its memory profile,
//! allocates the KV cache when told how many blocks, then executes one `SchedulerOutput`
//! after another. Only rank 0 answers with outputs.
//!
//! With `--async-scheduling` on CUDA a step may be deferred (`crate::overlap`): its output
//! is sent after the next step has been enqueued on the GPU, or, when no step comes before
//! its tokens are back, as soon as they are (the engine-core may be waiting for it to plan
//! the next one). A task reads the engine-core's socket so that the loop can wait on the
//! next input and the deferred step's event at once. Outputs always leave in step order.
//!
//! Any failure is sent to the engine-core as `WorkerEvent::Failed` with the reason, then
//! the process exits non-zero: the engine-core turns that into a clear error for the user.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::sync::mpsc;
use vllm_protocol::{
    DistributedInit, Register, WireMessage, WorkerEvent, WorkerInput, PROTOCOL_VERSION,
};
use zeromq::{DealerSocket, PushSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::communicator::NcclCommunicator;
use crate::model_runner::{DeviceRunner, GroupInit, WorkerConfig};
use crate::watchdog::StepWatchdog;

/// Where the worker finds its engine-core and who it is.
pub struct WorkerArgs {
    pub rank: u32,
    pub world_size: u32,
    pub run_dir: PathBuf,
    pub config: WorkerConfig,
}

/// Entry point of `vllm-rs worker`. Returns the process's exit code.
pub async fn run_worker(args: WorkerArgs) -> anyhow::Result<i32> {
    exit_when_parent_dies();
    let mut sockets = Sockets::connect(&args.run_dir).await?;
    sockets
        .send_dealer(&WorkerEvent::Register(Register {
            protocol_version: PROTOCOL_VERSION,
            rank: args.rank,
        }))
        .await?;
    match serve(&args, &mut sockets).await {
        Ok(()) => Ok(0),
        Err(e) => {
            let why = format!("worker rank {}: {e:#}", args.rank);
            tracing::error!("{why}");
            sockets.send(&WorkerEvent::Failed(why)).await?;
            // Let the frame leave before the process (and its socket) goes away.
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(1)
        }
    }
}

async fn serve(args: &WorkerArgs, sockets: &mut Sockets) -> anyhow::Result<()> {
    let group = join_group(args, sockets).await?;
    let mut runner = DeviceRunner::load(&args.config, &group)?;
    sockets
        .send(&WorkerEvent::Profiled(runner.profile()?))
        .await?;
    let watchdog = StepWatchdog::start(
        Duration::from_secs_f64(args.config.execute_model_timeout_s),
        runner.abort_handle(),
    );
    let mut inputs = sockets.forward_inputs()?;
    loop {
        // Time spent waiting for the next step: with async scheduling the engine-core has
        // usually queued it already, so this stays near zero while requests run.
        let idle = std::time::Instant::now();
        // While a step is deferred this wait lasts at most until its tokens are back: the
        // watchdog covers it, as it would cover the step's own read-back.
        let deferred = runner.pending_step_id();
        if let Some(step) = deferred {
            watchdog.begin(step);
        }
        let next = next_input(&mut inputs, &runner).await;
        if let Some(step) = deferred {
            watchdog.end().with_context(|| format!("step {step}"))?;
        }
        let input = match next? {
            Next::Input(input) => input,
            Next::TokensArrived => {
                // No step came before the deferred one's tokens: send its output now,
                // as the engine-core may be waiting for it to plan the next.
                let step = deferred.unwrap_or_default();
                let out = runner
                    .finish_pending()
                    .with_context(|| format!("step {step}"))?;
                if let (Some(out), 0) = (out, args.rank) {
                    sockets.send(&WorkerEvent::Output(out)).await?;
                }
                continue;
            }
        };
        let idle = idle.elapsed();
        match input {
            WorkerInput::InitializeKvCache(init) => {
                runner.initialize_kv_cache(init.num_blocks)?;
                sockets.send(&WorkerEvent::KvCacheReady(args.rank)).await?;
            }
            WorkerInput::Execute(so) => {
                let started = std::time::Instant::now();
                watchdog.begin(so.step_id);
                let outs = runner.execute_model_overlapped(&so);
                watchdog
                    .end()
                    .with_context(|| format!("step {}", so.step_id))?;
                let outs = outs.with_context(|| format!("step {}", so.step_id))?;
                let executed = started.elapsed();
                if args.rank == 0 {
                    for out in outs {
                        sockets.send(&WorkerEvent::Output(out)).await?;
                    }
                }
                tracing::debug!(
                    target: "vllm_worker::step",
                    rank = args.rank,
                    step = so.step_id,
                    tokens = so.total_num_scheduled_tokens,
                    seqs = so.num_scheduled_tokens.len(),
                    deferred = runner.pending_step_id() == Some(so.step_id),
                    idle_us = idle.as_micros() as u64,
                    execute_us = executed.as_micros() as u64,
                    "step executed"
                );
            }
            WorkerInput::InitDistributed(_) => {
                tracing::warn!("ignoring a second InitDistributed")
            }
            WorkerInput::Shutdown(()) => return Ok(()),
        }
    }
}

/// What the serve loop does next.
enum Next {
    Input(WorkerInput),
    /// The deferred step's tokens are on the host and no input is waiting.
    TokensArrived,
}

/// The next input; while a step is deferred (`crate::overlap`), whichever comes first of
/// the next input (preferred: the next step is then enqueued behind the deferred one)
/// and the deferred step's tokens.
async fn next_input(
    inputs: &mut mpsc::UnboundedReceiver<anyhow::Result<WorkerInput>>,
    runner: &DeviceRunner,
) -> anyhow::Result<Next> {
    let closed = || anyhow::anyhow!("the engine-core's input stream ended");
    if runner.pending_step_id().is_none() {
        return Ok(Next::Input(inputs.recv().await.ok_or_else(closed)??));
    }
    tokio::select! {
        biased;
        input = inputs.recv() => Ok(Next::Input(input.ok_or_else(closed)??)),
        arrived = tokens_arrived(runner) => arrived.map(|()| Next::TokensArrived),
    }
}

/// Polls the deferred step's event, yielding in between (a GPU step is a millisecond or
/// so: a timer would be coarser than that; the CUDA driver's own wait spins too).
async fn tokens_arrived(runner: &DeviceRunner) -> anyhow::Result<()> {
    while !runner.pending_is_ready()? {
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// Rank 0 proposes the group's `DistributedInit` (on CUDA with several ranks, a fresh
/// NCCL unique id); every rank then waits for the engine-core to hand it the same one.
async fn join_group(args: &WorkerArgs, sockets: &mut Sockets) -> anyhow::Result<GroupInit> {
    if args.rank == 0 {
        let nccl_unique_id = match (args.config.device.as_str(), args.world_size) {
            ("cuda", n) if n > 1 => Some(NcclCommunicator::unique_id()?),
            _ => None,
        };
        sockets
            .send(&WorkerEvent::DistributedInit(DistributedInit {
                nccl_unique_id,
            }))
            .await?;
    }
    let init = match sockets.recv().await? {
        WorkerInput::InitDistributed(init) => init,
        WorkerInput::Shutdown(()) => bail!("shut down before the group formed"),
        other => bail!("expected the group's InitDistributed first, got {other:?}"),
    };
    Ok(GroupInit {
        shm_path: args.run_dir.join("tensor-parallel.shm"),
        init,
    })
}

/// The worker's two sockets: a DEALER that receives the engine-core's broadcasts and a PUSH
/// for everything the worker reports. Once the worker serves steps, a task reads the
/// DEALER (`forward_inputs`), so that the serve loop can wait on it and on the GPU at once.
struct Sockets {
    dealer: Option<DealerSocket>,
    push: PushSocket,
}

impl Sockets {
    async fn connect(run_dir: &Path) -> anyhow::Result<Self> {
        let endpoint = |name: &str| format!("ipc://{}", run_dir.join(name).display());
        let mut dealer = DealerSocket::new();
        dealer
            .connect(&endpoint("worker-in.sock"))
            .await
            .context("connecting to the engine-core")?;
        let mut push = PushSocket::new();
        push.connect(&endpoint("worker-out.sock"))
            .await
            .context("connecting to the engine-core")?;
        Ok(Self {
            dealer: Some(dealer),
            push,
        })
    }

    fn dealer(&mut self) -> anyhow::Result<&mut DealerSocket> {
        self.dealer
            .as_mut()
            .context("the engine-core's inputs are read by their task")
    }

    async fn send(&mut self, msg: &WorkerEvent) -> anyhow::Result<()> {
        self.push.send(ZmqMessage::from(msg.encode()?)).await?;
        Ok(())
    }

    async fn send_dealer(&mut self, msg: &WorkerEvent) -> anyhow::Result<()> {
        self.dealer()?.send(ZmqMessage::from(msg.encode()?)).await?;
        Ok(())
    }

    /// The next well-formed input.
    async fn recv(&mut self) -> anyhow::Result<WorkerInput> {
        recv_input(self.dealer()?).await
    }

    /// Hands the DEALER to a task that forwards every input (or the error that ends them)
    /// to the returned channel, in order.
    fn forward_inputs(
        &mut self,
    ) -> anyhow::Result<mpsc::UnboundedReceiver<anyhow::Result<WorkerInput>>> {
        let mut dealer = self
            .dealer
            .take()
            .context("the engine-core's inputs are forwarded already")?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let input = recv_input(&mut dealer).await;
                let failed = input.is_err();
                if tx.send(input).is_err() || failed {
                    return;
                }
            }
        });
        Ok(rx)
    }
}

/// The next well-formed input of `dealer`; malformed frames are logged and dropped.
async fn recv_input(dealer: &mut DealerSocket) -> anyhow::Result<WorkerInput> {
    loop {
        let message = dealer.recv().await?;
        let Some(frame) = message.iter().last() else {
            continue;
        };
        match WorkerInput::decode(frame) {
            Ok(msg) => return Ok(msg),
            Err(e) => tracing::warn!("dropping malformed frame from the engine-core: {e}"),
        }
    }
}

/// Ends the worker when its engine-core dies, polling for re-parenting (see
/// `vllm_engine_core::process::exit_when_parent_dies`, which the worker cannot link).
fn exit_when_parent_dies() {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        if std::os::unix::process::parent_id() != parent {
            eprintln!("worker: engine-core process {parent} is gone; exiting");
            std::process::exit(1);
        }
    });
}
