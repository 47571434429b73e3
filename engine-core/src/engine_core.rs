//! `EngineCoreProc`: the engine-core process. It connects to the frontend, starts the
//! workers through the [`Executor`], and then runs the busy loop of DESIGN §4: drain
//! inputs → schedule → execute → update → push outputs. With nothing to do it blocks on its
//! input socket instead of spinning.
//!
//! With async scheduling (`--async-scheduling`, vLLM's) the loop keeps one step queued
//! behind the one the workers run: it sends step N+1 before it waits for step N's output,
//! so scheduling, updating and the IPC leave the workers' critical path. The scheduler
//! plans N+1 on output placeholders for N's tokens (see `scheduler`).
//!
//! When a worker dies, every unfinished request is failed with the reason, the frontend is
//! told (`EngineCoreEvent::Dead`), the other workers are stopped and the process exits
//! non-zero.

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use tokio::sync::mpsc;
use vllm_protocol::{
    EngineCoreEvent, EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineReady, Register,
    SchedulerOutput, UtilityCall, UtilityMethod, UtilityOutput, UtilityResult, PROTOCOL_VERSION,
};
use zeromq::{DealerSocket, PushSocket, Socket};

use crate::config::EngineCoreConfig;
use crate::executor::{Executor, WorkersReady};
use crate::scheduler::Scheduler;
use crate::transport::{ipc_endpoint, recv, send};

/// Entry point of `vllm-rs engine-core`. Returns the process's exit code.
pub async fn run_engine_core(cfg: EngineCoreConfig) -> anyhow::Result<i32> {
    // The grace lets a lost frontend's closed socket stop the loop, which shuts the workers
    // down in order; past it they are killed and reaped, and this process exits.
    crate::process::exit_when_parent_dies_after("engine-core", Duration::from_millis(500));
    let mut input = DealerSocket::new();
    input
        .connect(&ipc_endpoint(&cfg.run_dir, "input.sock"))
        .await
        .context("connecting to the frontend")?;
    let mut output = PushSocket::new();
    output
        .connect(&ipc_endpoint(&cfg.run_dir, "output.sock"))
        .await
        .context("connecting to the frontend")?;
    send(
        &mut input,
        &EngineCoreEvent::Register(Register {
            protocol_version: PROTOCOL_VERSION,
            rank: 0,
        }),
    )
    .await?;

    let (mut executor, ready) = match Executor::start(&cfg).await {
        Ok(started) => started,
        Err(e) => {
            let why = format!("{e:#}");
            tracing::error!("engine startup failed: {why}");
            send(&mut output, &EngineCoreEvent::StartupFailed(why)).await?;
            return Ok(1);
        }
    };
    let sc = scheduler_config(&cfg, &ready);
    if let Err(e) = send(
        &mut output,
        &EngineCoreEvent::Ready(engine_ready(&sc, &ready)),
    )
    .await
    {
        executor.kill().await;
        return Err(e);
    }
    let scheduler = Scheduler::new(sc);

    let (tx, inputs) = mpsc::channel(4096);
    tokio::spawn(forward_inputs(input, tx));
    let mut core = EngineCore {
        scheduler,
        executor: &mut executor,
        inputs,
        output,
        in_flight: VecDeque::new(),
    };
    match core.run().await {
        Ok(()) => {
            executor.shutdown().await;
            Ok(0)
        }
        Err(e) => {
            let why = format!("{e:#}");
            tracing::error!("engine-core stopping: {why}");
            // Reap the workers first: the frontend may be gone, and a send to it must not
            // delay them (or, blocked, leave them to init when this process is ended).
            core.executor.kill().await;
            let notify = core.fail_everything(&why);
            let _ = tokio::time::timeout(Duration::from_secs(2), notify).await;
            Ok(1)
        }
    }
}

fn scheduler_config(
    cfg: &EngineCoreConfig,
    ready: &WorkersReady,
) -> crate::scheduler::SchedulerConfig {
    let model_len = ready.profile.model.max_model_len;
    let mut sc = cfg.scheduler.clone();
    sc.max_model_len = cfg.max_model_len_override.unwrap_or(model_len);
    sc.num_gpu_blocks = ready.num_gpu_blocks;
    sc
}

fn engine_ready(sc: &crate::scheduler::SchedulerConfig, ready: &WorkersReady) -> EngineReady {
    EngineReady {
        protocol_version: PROTOCOL_VERSION,
        num_gpu_blocks: ready.num_gpu_blocks,
        block_size: sc.block_size,
        max_model_len: sc.max_model_len,
        model: ready.profile.model.clone(),
        device: ready.profile.device.clone(),
    }
}

/// Decodes frames from the frontend into a channel, so the loop can drain it without
/// waiting. The channel closes when the frontend's socket does.
async fn forward_inputs(mut input: DealerSocket, tx: mpsc::Sender<EngineCoreInput>) {
    while let Ok(msg) = recv::<_, EngineCoreInput>(&mut input, "engine input").await {
        if tx.send(msg).await.is_err() {
            break;
        }
    }
}

struct EngineCore<'a> {
    scheduler: Scheduler,
    executor: &'a mut Executor,
    inputs: mpsc::Receiver<EngineCoreInput>,
    output: PushSocket,
    /// Steps sent to the workers whose output is not in yet, oldest first.
    in_flight: VecDeque<SentStep>,
}

/// A step the workers have, kept until its output is applied.
struct SentStep {
    so: SchedulerOutput,
    /// How long the scheduler took to plan it.
    schedule: Duration,
    /// When it was sent to the workers.
    submitted: Instant,
}

/// What handling the inputs decided.
#[derive(PartialEq)]
enum Flow {
    Continue,
    Shutdown,
}

impl EngineCore<'_> {
    async fn run(&mut self) -> anyhow::Result<()> {
        let max_in_flight = self.scheduler.config().max_steps_in_flight();
        loop {
            if self.drain_inputs().await? == Flow::Shutdown {
                return Ok(());
            }
            let started = Instant::now();
            let mut sent = false;
            if self.in_flight.len() < max_in_flight {
                let so = self.scheduler.schedule();
                if !so.is_empty() {
                    let schedule = started.elapsed();
                    let submitted = Instant::now();
                    let so = self.executor.submit(so).await?;
                    self.in_flight.push_back(SentStep {
                        so,
                        schedule,
                        submitted,
                    });
                    sent = true;
                }
            }
            // Time spent planning and sending the next step while the oldest one ran.
            let ahead = started.elapsed();
            let full = self.in_flight.len() >= max_in_flight;
            if full || (!sent && !self.in_flight.is_empty()) {
                self.finish_oldest_step(ahead).await?;
            } else if self.in_flight.is_empty() {
                // Requests are unfinished yet none could be scheduled (for example the
                // pool is full of finished-but-unreported work): wait for input briefly
                // rather than spin.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// Waits for the oldest step's output, applies it and pushes the outputs. The step log
    /// shows the overlap: `execute_us` is the round trip from sending the step to its
    /// output (queued behind the step before it, with async scheduling), `ahead_us` what
    /// the engine spent on the next step while this one ran (with a step `queued` behind
    /// it), `wait_us` how long it then still waited for the output.
    async fn finish_oldest_step(&mut self, ahead: Duration) -> anyhow::Result<()> {
        let Some(step) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let queued = self.in_flight.len();
        let waiting = Instant::now();
        let out = self.executor.wait_for_output().await?;
        let waited = waiting.elapsed();
        let execute = step.submitted.elapsed();
        let outputs = self.scheduler.update_from_output(&step.so, &out);
        self.push_outputs(outputs).await?;
        let so = &step.so;
        tracing::debug!(
            target: "vllm_engine_core::step",
            step = so.step_id,
            tokens = so.total_num_scheduled_tokens,
            seqs = so.num_scheduled_tokens.len(),
            queued,
            schedule_us = step.schedule.as_micros() as u64,
            execute_us = execute.as_micros() as u64,
            ahead_us = if queued > 0 { ahead.as_micros() as u64 } else { 0 },
            wait_us = waited.as_micros() as u64,
            update_us = (waiting.elapsed() - waited).as_micros() as u64,
            "engine step"
        );
        Ok(())
    }

    /// Handles every queued input; when the engine is idle, first waits for one.
    async fn drain_inputs(&mut self) -> anyhow::Result<Flow> {
        // A step still in flight must be collected even when every request has ended.
        if !self.scheduler.has_unfinished_requests() && self.in_flight.is_empty() {
            let msg = tokio::select! {
                msg = self.inputs.recv() => msg,
                failure = self.executor.failure() => return Err(failure),
            };
            match msg {
                Some(msg) => {
                    if self.handle_input(msg).await? == Flow::Shutdown {
                        return Ok(Flow::Shutdown);
                    }
                }
                None => return Ok(Flow::Shutdown),
            }
        }
        while let Ok(msg) = self.inputs.try_recv() {
            if self.handle_input(msg).await? == Flow::Shutdown {
                return Ok(Flow::Shutdown);
            }
        }
        Ok(Flow::Continue)
    }

    async fn handle_input(&mut self, msg: EngineCoreInput) -> anyhow::Result<Flow> {
        match msg {
            EngineCoreInput::Add(req) => {
                let id = req.request_id.clone();
                if let Err(why) = self.scheduler.add_request(req) {
                    self.push_outputs(vec![EngineCoreOutput::failed(id, why)])
                        .await?;
                }
            }
            EngineCoreInput::Abort(ids) => {
                self.scheduler.abort_requests(&ids);
                // Report the freed state at once: an idle engine sends nothing else.
                self.push_outputs(Vec::new()).await?;
            }
            EngineCoreInput::Utility(call) => self.answer_utility(call).await?,
            EngineCoreInput::Shutdown(()) => return Ok(Flow::Shutdown),
        }
        Ok(Flow::Continue)
    }

    async fn answer_utility(&mut self, call: UtilityCall) -> anyhow::Result<()> {
        let output = match call.method {
            UtilityMethod::GetStats => UtilityOutput::Stats(self.scheduler.stats()),
            UtilityMethod::ResetPrefixCache => match self.scheduler.reset_prefix_cache() {
                true => UtilityOutput::Done,
                false => UtilityOutput::Failed(
                    "blocks are still in use; the prefix cache was not reset".into(),
                ),
            },
        };
        send(
            &mut self.output,
            &EngineCoreEvent::Utility(UtilityResult {
                call_id: call.call_id,
                output,
            }),
        )
        .await
    }

    async fn push_outputs(&mut self, outputs: Vec<EngineCoreOutput>) -> anyhow::Result<()> {
        let msg = EngineCoreOutputs {
            outputs,
            scheduler_stats: Some(self.scheduler.stats()),
            timestamp: now(),
        };
        send(&mut self.output, &EngineCoreEvent::Outputs(msg)).await
    }

    /// Fails every unfinished request and tells the frontend the engine is dead.
    async fn fail_everything(&mut self, why: &str) {
        let failed = self.scheduler.fail_all(why);
        let _ = self.push_outputs(failed).await;
        let _ = send(&mut self.output, &EngineCoreEvent::Dead(why.to_string())).await;
    }
}

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
