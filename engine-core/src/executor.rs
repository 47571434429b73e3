//! The executor: starts one worker process per rank, brings them through the startup
//! handshake, broadcasts every `SchedulerOutput` to all ranks and collects rank 0's
//! `ModelRunnerOutput`; a step is submitted and its output awaited apart, so the engine can
//! queue the next step while one runs (async scheduling). It also watches the workers: a rank that dies or reports a failure
//! surfaces as an error from [`Executor::wait_for_output`] naming that rank.

use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use bytes::Bytes;
use tokio::sync::mpsc;
use vllm_protocol::{
    DistributedInit, InitializeKvCache, ModelRunnerOutput, SchedulerOutput, WorkerEvent,
    WorkerInput, WorkerProfile, PROTOCOL_VERSION,
};
use zeromq::{PullSocket, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket};

use crate::config::EngineCoreConfig;
use crate::process::{describe_exit, ChildProcess};
use crate::transport::{ipc_endpoint, recv, recv_from, send_to};

/// Something a worker said, or the news that one died.
enum ExecutorEvent {
    Worker(WorkerEvent),
    Registered(Bytes, vllm_protocol::Register),
    Died(String),
}

pub struct Executor {
    to_workers: RouterSendHalf,
    /// Routing identity of each rank's DEALER, indexed by rank.
    identities: Vec<Bytes>,
    events: mpsc::Receiver<ExecutorEvent>,
    /// The worker processes; shared with the watcher task, killed on drop.
    workers: std::sync::Arc<tokio::sync::Mutex<Vec<ChildProcess>>>,
    /// How long a step may take before the workers count as hung. A little over the
    /// workers' own collective timeout, so that their error (which names the rank) wins.
    step_deadline: Duration,
    /// Steps submitted and not yet answered (id, when sent), oldest first.
    in_flight: std::collections::VecDeque<(u64, tokio::time::Instant)>,
    /// When the last step's output arrived: the next queued step started then.
    last_output_at: tokio::time::Instant,
}

/// What the workers reported at startup, once every rank is ready.
pub struct WorkersReady {
    pub profile: WorkerProfile,
    pub num_gpu_blocks: u32,
}

impl Executor {
    /// Starts the workers and runs the handshake: register, profile, allocate the KV cache.
    pub async fn start(cfg: &EngineCoreConfig) -> anyhow::Result<(Self, WorkersReady)> {
        let mut router = RouterSocket::new();
        router
            .bind(&ipc_endpoint(&cfg.run_dir, "worker-in.sock"))
            .await?;
        let mut pull = PullSocket::new();
        pull.bind(&ipc_endpoint(&cfg.run_dir, "worker-out.sock"))
            .await?;

        let mut workers = Vec::new();
        for rank in 0..cfg.world_size {
            let args = worker_args(cfg, rank);
            workers.push(ChildProcess::spawn(
                format!("worker rank {rank}"),
                &cfg.exe,
                &args,
            )?);
        }
        let workers = std::sync::Arc::new(tokio::sync::Mutex::new(workers));
        let (tx, events) = mpsc::channel(1024);
        let (to_workers, from_router) = router.split();
        spawn_forwarders(&tx, pull, from_router);
        spawn_watcher(tx, workers.clone());

        let mut executor = Self {
            to_workers,
            identities: Vec::new(),
            events,
            workers,
            step_deadline: Duration::from_secs_f64(cfg.execute_model_timeout_s)
                + Duration::from_secs(2),
            in_flight: std::collections::VecDeque::new(),
            last_output_at: tokio::time::Instant::now(),
        };
        match executor.handshake(cfg).await {
            Ok(ready) => Ok((executor, ready)),
            Err(e) => {
                // Reap every rank before the error goes up: none is left a zombie or running.
                executor.kill().await;
                Err(e)
            }
        }
    }

    /// Register every rank, hand them rank 0's `DistributedInit`, collect the profiles,
    /// then size the KV cache by the smallest rank and wait until every rank allocated it.
    async fn handshake(&mut self, cfg: &EngineCoreConfig) -> anyhow::Result<WorkersReady> {
        let init = self.register_ranks(cfg.world_size as usize).await?;
        self.broadcast(&WorkerInput::InitDistributed(init)).await?;
        let profiles = self.collect_profiles().await?;
        let num_gpu_blocks = cfg.num_gpu_blocks_override.unwrap_or_else(|| {
            profiles
                .iter()
                .map(|p| p.num_available_blocks)
                .min()
                .unwrap_or(0)
        });
        if num_gpu_blocks == 0 {
            bail!("no memory is left for the KV cache after loading the model: lower --max-model-len or --max-num-batched-tokens, or raise the memory budget");
        }
        tracing::info!(
            num_gpu_blocks,
            per_rank = ?profiles.iter().map(|p| p.num_available_blocks).collect::<Vec<_>>(),
            "KV cache blocks (the smallest rank's)"
        );
        self.broadcast(&WorkerInput::InitializeKvCache(InitializeKvCache {
            num_blocks: num_gpu_blocks,
        }))
        .await?;
        let mut ready = 0;
        while ready < self.identities.len() {
            match self.next_event().await? {
                ExecutorEvent::Worker(WorkerEvent::KvCacheReady(_)) => ready += 1,
                _ => tracing::warn!("unexpected worker message while allocating the KV cache"),
            }
        }
        let profile = profiles.into_iter().next().context("no worker ranks")?;
        Ok(WorkersReady {
            profile,
            num_gpu_blocks,
        })
    }

    /// Waits until all `n` ranks have registered and rank 0 has proposed the group's
    /// `DistributedInit`.
    async fn register_ranks(&mut self, n: usize) -> anyhow::Result<DistributedInit> {
        let mut identities = vec![None; n];
        let mut init = None;
        while identities.iter().any(Option::is_none) || init.is_none() {
            match self.next_event().await? {
                ExecutorEvent::Registered(id, reg) => {
                    if reg.protocol_version != PROTOCOL_VERSION {
                        bail!(
                            "worker rank {} speaks protocol v{}, this engine-core v{}: the binaries differ; run one vllm-rs build",
                            reg.rank, reg.protocol_version, PROTOCOL_VERSION
                        );
                    }
                    let slot = identities
                        .get_mut(reg.rank as usize)
                        .context("worker registered with an unknown rank")?;
                    *slot = Some(id);
                }
                ExecutorEvent::Worker(WorkerEvent::DistributedInit(i)) => init = Some(i),
                ExecutorEvent::Worker(other) => {
                    tracing::warn!("unexpected worker message at startup: {other:?}")
                }
                ExecutorEvent::Died(_) => unreachable!("next_event turns deaths into errors"),
            }
        }
        self.identities = identities.into_iter().flatten().collect();
        init.context("no DistributedInit from rank 0")
    }

    /// Every rank's profile, in rank order.
    async fn collect_profiles(&mut self) -> anyhow::Result<Vec<WorkerProfile>> {
        let mut profiles: Vec<Option<WorkerProfile>> = vec![None; self.identities.len()];
        while profiles.iter().any(Option::is_none) {
            match self.next_event().await? {
                ExecutorEvent::Worker(WorkerEvent::Profiled(p)) => {
                    let rank = p.rank as usize;
                    *profiles
                        .get_mut(rank)
                        .context("profile from an unknown rank")? = Some(p);
                }
                _ => tracing::warn!("unexpected worker message while loading the model"),
            }
        }
        Ok(profiles.into_iter().flatten().collect())
    }

    /// Sends one step to every rank without waiting for it: the ranks queue it behind the
    /// steps they are running (they run steps in the order sent). Its output is awaited
    /// with [`Executor::wait_for_output`]; an error if a rank cannot be reached. The step
    /// comes back, for the caller to update from once its output arrives.
    pub async fn submit(&mut self, so: SchedulerOutput) -> anyhow::Result<SchedulerOutput> {
        let step_id = so.step_id;
        let msg = WorkerInput::Execute(so);
        self.broadcast(&msg).await?;
        self.in_flight
            .push_back((step_id, tokio::time::Instant::now()));
        match msg {
            WorkerInput::Execute(so) => Ok(so),
            _ => unreachable!("built as Execute above"),
        }
    }

    /// Rank 0's output of the oldest step submitted; an error if a rank dies, fails, or
    /// gives no answer within the step deadline (a hang). The deadline runs from when the
    /// step could start: its submission, or the previous step's output if that came later
    /// (a step queued behind another does not run while that one does).
    pub async fn wait_for_output(&mut self) -> anyhow::Result<ModelRunnerOutput> {
        let (step_id, submitted_at) = self
            .in_flight
            .front()
            .copied()
            .context("waiting for the output of a step that was never submitted")?;
        let deadline = submitted_at.max(self.last_output_at) + self.step_deadline;
        loop {
            let event = tokio::time::timeout_at(deadline, self.next_event())
                .await
                .map_err(|_| {
                    anyhow!(
                        "step {step_id}: no answer from the workers within {:.0} s \
                         (--execute-model-timeout): a worker hangs",
                        self.step_deadline.as_secs_f64()
                    )
                })?;
            match event? {
                ExecutorEvent::Worker(WorkerEvent::Output(out)) if out.step_id == step_id => {
                    self.in_flight.pop_front();
                    self.last_output_at = tokio::time::Instant::now();
                    return Ok(out);
                }
                ExecutorEvent::Worker(WorkerEvent::Output(out)) => {
                    tracing::warn!(
                        "dropping stale output of step {} (waiting for {step_id})",
                        out.step_id
                    )
                }
                _ => tracing::warn!("unexpected worker message during a step"),
            }
        }
    }

    /// Waits until a worker dies or fails, for an idle engine that must still notice.
    pub async fn failure(&mut self) -> anyhow::Error {
        loop {
            match self.next_event().await {
                Err(e) => return e,
                Ok(_) => tracing::warn!("unexpected worker message while idle"),
            }
        }
    }

    /// Asks every worker to exit, waits briefly, and kills those that do not.
    pub async fn shutdown(&mut self) {
        let _ = self.broadcast(&WorkerInput::Shutdown(())).await;
        for worker in self.workers.lock().await.iter_mut() {
            worker.wait_or_kill(Duration::from_secs(5)).await;
        }
    }

    /// After a failure: the surviving workers may be stuck (in a collective whose peer is
    /// gone, or stopped), so they are killed at once, and reaped.
    pub async fn kill(&mut self) {
        for worker in self.workers.lock().await.iter_mut() {
            worker.kill().await;
        }
    }

    async fn broadcast(&mut self, msg: &WorkerInput) -> anyhow::Result<()> {
        for rank in 0..self.identities.len() {
            if let Err(e) = send_to(&mut self.to_workers, &self.identities[rank], msg).await {
                return Err(self.unreachable(rank, e).await);
            }
        }
        Ok(())
    }

    /// Why rank `rank` could not be sent to. The socket forgets a peer as soon as it
    /// disconnects, often before the process watcher sees the exit: wait a moment for the
    /// watcher, whose report names the process and how it died.
    async fn unreachable(&mut self, rank: usize, e: anyhow::Error) -> anyhow::Error {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while let Ok(event) = tokio::time::timeout_at(deadline, self.next_event()).await {
            if let Err(why) = event {
                return why;
            }
        }
        anyhow!("worker rank {rank} cannot be reached: {e:#}")
    }

    /// The next event, with a worker's death or failure turned into an error.
    async fn next_event(&mut self) -> anyhow::Result<ExecutorEvent> {
        match self.events.recv().await {
            Some(ExecutorEvent::Died(why)) => Err(anyhow!(self.last_words(why).await)),
            Some(ExecutorEvent::Worker(WorkerEvent::Failed(why))) => Err(anyhow!(why)),
            Some(event) => Ok(event),
            None => Err(anyhow!("the worker sockets closed")),
        }
    }
}

impl Executor {
    /// A worker that fails sends its reason just before it exits, and the watcher may see
    /// the exit first: wait briefly for that reason, which says more than an exit code.
    async fn last_words(&mut self, death: String) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        while let Ok(Some(event)) = tokio::time::timeout_at(deadline, self.events.recv()).await {
            if let ExecutorEvent::Worker(WorkerEvent::Failed(why)) = event {
                return format!("{why} ({death})");
            }
        }
        death
    }
}

fn worker_args(cfg: &EngineCoreConfig, rank: u32) -> Vec<String> {
    vec![
        "worker".into(),
        "--rank".into(),
        rank.to_string(),
        "--world-size".into(),
        cfg.world_size.to_string(),
        "--run-dir".into(),
        cfg.run_dir.display().to_string(),
        "--config-json".into(),
        cfg.worker_config_json.clone(),
    ]
}

/// Forwards the PULL socket's events and the ROUTER's registrations into one channel.
fn spawn_forwarders(
    tx: &mpsc::Sender<ExecutorEvent>,
    mut pull: PullSocket,
    mut router: RouterRecvHalf,
) {
    let pull_tx = tx.clone();
    tokio::spawn(async move {
        while let Ok(event) = recv::<_, WorkerEvent>(&mut pull, "worker-out").await {
            if pull_tx.send(ExecutorEvent::Worker(event)).await.is_err() {
                break;
            }
        }
    });
    let router_tx = tx.clone();
    tokio::spawn(async move {
        while let Ok((id, event)) = recv_from::<_, WorkerEvent>(&mut router, "worker-in").await {
            let event = match event {
                WorkerEvent::Register(reg) => ExecutorEvent::Registered(id, reg),
                other => ExecutorEvent::Worker(other),
            };
            if router_tx.send(event).await.is_err() {
                break;
            }
        }
    });
}

/// Polls the worker processes; the first one found dead is reported once.
fn spawn_watcher(
    tx: mpsc::Sender<ExecutorEvent>,
    workers: std::sync::Arc<tokio::sync::Mutex<Vec<ChildProcess>>>,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut workers = workers.lock().await;
            if let Some(dead) = workers.iter_mut().find_map(|w| {
                let pid = w.pid();
                w.try_wait().map(|status| {
                    format!(
                        "{} (pid {}) died: {}",
                        w.name,
                        pid.unwrap_or(0),
                        describe_exit(status)
                    )
                })
            }) {
                let _ = tx.send(ExecutorEvent::Died(dead)).await;
                return;
            }
        }
    });
}
