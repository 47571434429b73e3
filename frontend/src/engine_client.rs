//! `EngineCoreClient`: the frontend's side of the engine-core. It starts the engine-core
//! process in a private run directory, waits for its READY (or prints its startup error),
//! then sends requests and aborts through one sender task and routes each
//! `EngineCoreOutput` to the stream of the request it belongs to.
//!
//! It also watches the engine: when the engine-core reports a dead worker or dies itself,
//! every in-flight request fails with the reason and [`EngineCoreClient::dead`] says why.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use vllm_engine_core::config::EngineCoreConfig;
use vllm_engine_core::process::{describe_exit, ChildProcess};
use vllm_engine_core::transport::{ipc_endpoint, recv, recv_from, send_to};
use vllm_protocol::{
    EngineCoreEvent, EngineCoreInput, EngineCoreOutput, EngineCoreRequest, EngineReady,
    SchedulerStats, UtilityCall, UtilityMethod, UtilityOutput, PROTOCOL_VERSION,
};
use zeromq::{PullSocket, RouterSocket, Socket};

type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<EngineCoreOutput>>>>;
type PendingCalls = Arc<Mutex<HashMap<u64, oneshot::Sender<UtilityOutput>>>>;

/// A handle to a running engine-core. Cheap to share behind an `Arc`.
pub struct EngineCoreClient {
    pub ready: EngineReady,
    to_engine: mpsc::UnboundedSender<EngineCoreInput>,
    routes: Routes,
    pending_calls: PendingCalls,
    next_call_id: AtomicU64,
    stats: Arc<Mutex<SchedulerStats>>,
    dead: watch::Receiver<Option<String>>,
    engine: Arc<tokio::sync::Mutex<ChildProcess>>,
    /// Holds the socket files; removed when the client is dropped.
    _run_dir: tempfile::TempDir,
}

/// The stream of outputs of one request. Dropping it before the request finished aborts the
/// request in the engine, which frees its KV blocks.
pub struct RequestStream {
    pub request_id: String,
    rx: mpsc::UnboundedReceiver<EngineCoreOutput>,
    finished: bool,
    to_engine: mpsc::UnboundedSender<EngineCoreInput>,
    routes: Routes,
}

impl RequestStream {
    /// Registers the route of `request_id` and returns its stream. From here on the
    /// stream owns the route: the engine's final output, `abort` or dropping the stream
    /// removes it, so the map holds only requests in flight.
    fn open(
        request_id: String,
        routes: &Routes,
        to_engine: &mpsc::UnboundedSender<EngineCoreInput>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(routes).insert(request_id.clone(), tx);
        RequestStream {
            request_id,
            rx,
            finished: false,
            to_engine: to_engine.clone(),
            routes: routes.clone(),
        }
    }

    /// The next output; `None` once the request has finished.
    pub async fn next(&mut self) -> Option<EngineCoreOutput> {
        if self.finished {
            return None;
        }
        let out = self.rx.recv().await;
        match &out {
            Some(o) if o.finish_reason.is_none() => {}
            _ => self.finished = true,
        }
        out
    }

    /// Aborts the request now (a stop string matched, or the caller gave up).
    pub fn abort(&mut self) {
        if !self.finished {
            self.finished = true;
            self.routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.request_id);
            let _ = self
                .to_engine
                .send(EngineCoreInput::Abort(vec![self.request_id.clone()]));
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.abort();
    }
}

impl EngineCoreClient {
    /// Starts the engine-core (which starts the workers) and waits until it is ready.
    /// `config.run_dir` is replaced by a fresh private directory.
    pub async fn start(mut config: EngineCoreConfig) -> anyhow::Result<Self> {
        let run_dir = tempfile::Builder::new()
            .prefix("vllm-rs-")
            .tempdir()
            .context("creating the run directory")?;
        config.run_dir = run_dir.path().to_path_buf();
        let mut router = RouterSocket::new();
        router
            .bind(&ipc_endpoint(run_dir.path(), "input.sock"))
            .await?;
        let mut pull = PullSocket::new();
        pull.bind(&ipc_endpoint(run_dir.path(), "output.sock"))
            .await?;

        let args = vec![
            "engine-core".to_string(),
            "--config-json".to_string(),
            serde_json::to_string(&config)?,
        ];
        let mut engine = ChildProcess::spawn("engine-core".into(), &config.exe, &args)?;
        let started = async {
            let engine_id = tokio::select! {
                id = register(&mut router) => id?,
                status = wait_exit(&mut engine) => bail!("engine-core exited during startup ({status})"),
            };
            let ready = tokio::select! {
                ready = wait_ready(&mut pull) => ready?,
                status = wait_exit(&mut engine) => bail!("engine-core exited during startup ({status})"),
            };
            Ok::<_, anyhow::Error>((engine_id, ready))
        }
        .await;
        let (engine_id, ready) = match started {
            Ok(started) => started,
            Err(e) => {
                // The engine-core exits after reporting a failed startup: reap it (or end it).
                engine.wait_or_kill(Duration::from_secs(10)).await;
                return Err(e);
            }
        };
        // The engine-core is connected on both sockets; nothing else may connect. Unbinding
        // now also lets zeromq remove the socket files while the run directory exists:
        // left to the sockets' drop, its listener tasks ran after the directory was gone
        // and warned that they could not delete them.
        let mut unbind_errors = router.unbind_all().await;
        unbind_errors.extend(pull.unbind_all().await);
        for err in unbind_errors {
            tracing::debug!("unbinding the engine sockets: {err}");
        }
        tracing::info!(
            "engine ready: {} on {}, {} KV blocks of {} tokens, max model len {}",
            ready.model.architecture,
            ready.device,
            ready.num_gpu_blocks,
            ready.block_size,
            ready.max_model_len
        );

        let (to_engine, from_client) = mpsc::unbounded_channel();
        let (send_half, _recv_half) = router.split();
        tokio::spawn(send_inputs(send_half, engine_id, from_client));
        let (dead_tx, dead) = watch::channel(None);
        let client = Self {
            ready,
            to_engine,
            routes: Arc::default(),
            pending_calls: Arc::default(),
            next_call_id: AtomicU64::new(1),
            stats: Arc::default(),
            dead,
            engine: Arc::new(tokio::sync::Mutex::new(engine)),
            _run_dir: run_dir,
        };
        let dead_tx = Arc::new(dead_tx);
        tokio::spawn(dispatch_outputs(
            pull,
            client.routes.clone(),
            client.pending_calls.clone(),
            client.stats.clone(),
            dead_tx.clone(),
        ));
        tokio::spawn(watch_engine(
            client.engine.clone(),
            client.routes.clone(),
            dead_tx,
        ));
        Ok(client)
    }

    /// Sends a request to the engine and returns the stream of its outputs.
    pub fn add_request(&self, req: EngineCoreRequest) -> anyhow::Result<RequestStream> {
        if let Some(why) = self.dead_reason() {
            bail!("the engine is dead: {why}");
        }
        // The stream exists before the send, so a failed send drops it and its route
        // with it instead of leaving an entry that nothing would remove.
        let stream = RequestStream::open(req.request_id.clone(), &self.routes, &self.to_engine);
        self.to_engine
            .send(EngineCoreInput::Add(req))
            .map_err(|_| anyhow!("the engine is gone"))?;
        Ok(stream)
    }

    /// Ends every request in flight with the error `why` and aborts them in the engine,
    /// which frees their blocks (a shutdown past its timeout).
    pub fn fail_in_flight(&self, why: &str) {
        let ids: Vec<String> = lock(&self.routes)
            .drain()
            .map(|(id, tx)| {
                let _ = tx.send(EngineCoreOutput::failed(id.clone(), why.to_string()));
                id
            })
            .collect();
        if !ids.is_empty() {
            let _ = self.to_engine.send(EngineCoreInput::Abort(ids));
        }
    }

    /// Calls a utility method of the engine-core and waits for its answer.
    pub async fn call_utility(&self, method: UtilityMethod) -> anyhow::Result<UtilityOutput> {
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending_calls).insert(call_id, tx);
        self.to_engine
            .send(EngineCoreInput::Utility(UtilityCall { call_id, method }))
            .map_err(|_| anyhow!("the engine is gone"))?;
        let mut dead = self.dead.clone();
        tokio::select! {
            out = rx => out.map_err(|_| anyhow!("the engine stopped answering")),
            _ = dead.wait_for(Option::is_some) => Err(anyhow!("the engine is dead")),
        }
    }

    /// Fresh scheduler statistics from the engine (falls back to the last ones seen).
    pub async fn stats(&self) -> SchedulerStats {
        match self.call_utility(UtilityMethod::GetStats).await {
            Ok(UtilityOutput::Stats(stats)) => stats,
            _ => lock(&self.stats).clone(),
        }
    }

    /// Why the engine died, once it has.
    pub fn dead_reason(&self) -> Option<String> {
        self.dead.borrow().clone()
    }

    /// Resolves when the engine dies, with the reason.
    pub async fn wait_dead(&self) -> String {
        let mut dead = self.dead.clone();
        let reason = match dead.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "the engine watcher stopped".into(),
        };
        reason
    }

    /// Asks the engine-core to stop, and kills it if it does not within a few seconds.
    pub async fn shutdown(&self) {
        let _ = self.to_engine.send(EngineCoreInput::Shutdown(()));
        self.engine
            .lock()
            .await
            .wait_or_kill(Duration::from_secs(10))
            .await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn register(router: &mut RouterSocket) -> anyhow::Result<Bytes> {
    loop {
        let (id, event) = recv_from::<_, EngineCoreEvent>(router, "engine registration").await?;
        match event {
            EngineCoreEvent::Register(reg) if reg.protocol_version == PROTOCOL_VERSION => return Ok(id),
            EngineCoreEvent::Register(reg) => bail!(
                "the engine-core speaks protocol v{}, this frontend v{PROTOCOL_VERSION}: the binaries differ; run one vllm-rs build",
                reg.protocol_version
            ),
            other => tracing::warn!("unexpected message before registration: {other:?}"),
        }
    }
}

async fn wait_ready(pull: &mut PullSocket) -> anyhow::Result<EngineReady> {
    loop {
        match recv::<_, EngineCoreEvent>(pull, "engine output").await? {
            EngineCoreEvent::Ready(ready) => return Ok(ready),
            EngineCoreEvent::StartupFailed(why) => bail!("{why}"),
            other => tracing::warn!("unexpected message before READY: {other:?}"),
        }
    }
}

async fn wait_exit(engine: &mut ChildProcess) -> String {
    loop {
        if let Some(status) = engine.try_wait() {
            return describe_exit(status);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn send_inputs(
    mut socket: zeromq::RouterSendHalf,
    engine_id: Bytes,
    mut inputs: mpsc::UnboundedReceiver<EngineCoreInput>,
) {
    while let Some(msg) = inputs.recv().await {
        if let Err(e) = send_to(&mut socket, &engine_id, &msg).await {
            tracing::error!("cannot send to the engine-core: {e:#}");
        }
    }
}

/// Routes each output to its request; records stats; answers utility calls.
async fn dispatch_outputs(
    mut pull: PullSocket,
    routes: Routes,
    pending_calls: PendingCalls,
    stats: Arc<Mutex<SchedulerStats>>,
    dead: Arc<watch::Sender<Option<String>>>,
) {
    while let Ok(event) = recv::<_, EngineCoreEvent>(&mut pull, "engine output").await {
        match event {
            EngineCoreEvent::Outputs(outputs) => {
                if let Some(s) = outputs.scheduler_stats {
                    *lock(&stats) = s;
                }
                route(&routes, outputs.outputs);
            }
            EngineCoreEvent::Utility(result) => {
                if let Some(tx) = lock(&pending_calls).remove(&result.call_id) {
                    let _ = tx.send(result.output);
                }
            }
            EngineCoreEvent::Dead(why) => {
                tracing::error!("engine died: {why}");
                mark_dead(&dead, &routes, why);
            }
            other => tracing::warn!("unexpected engine message: {other:?}"),
        }
    }
}

fn route(routes: &Routes, outputs: Vec<EngineCoreOutput>) {
    let mut routes = lock(routes);
    for out in outputs {
        let finished = out.finish_reason.is_some();
        let id = out.request_id.clone();
        if let Some(tx) = routes.get(&id) {
            let _ = tx.send(out);
        }
        if finished {
            routes.remove(&id);
        }
    }
}

/// Records the first cause of death and fails every request still in flight.
fn mark_dead(dead: &watch::Sender<Option<String>>, routes: &Routes, why: String) {
    dead.send_if_modified(|d| {
        if d.is_none() {
            *d = Some(why.clone());
            true
        } else {
            false
        }
    });
    for (id, tx) in lock(routes).drain() {
        let _ = tx.send(EngineCoreOutput::failed(
            id,
            format!("the engine died: {why}"),
        ));
    }
}

async fn watch_engine(
    engine: Arc<tokio::sync::Mutex<ChildProcess>>,
    routes: Routes,
    dead: Arc<watch::Sender<Option<String>>>,
) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut engine = engine.lock().await;
        let pid = engine.pid();
        if let Some(status) = engine.try_wait() {
            // The engine-core reports a dead worker just before exiting; give that message,
            // which names the worker, time to arrive and win.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let why = format!(
                "engine-core (pid {}) exited: {}",
                pid.unwrap_or(0),
                describe_exit(status)
            );
            // A clean exit after a shutdown request is not a death worth reporting, but the
            // requests still in flight must not hang either way.
            mark_dead(&dead, &routes, why);
            return;
        }
    }
}

/// The `vllm-rs` binary to start children from: this process's own executable, unless
/// `VLLM_RS_EXE` names another (tests that embed the frontend library use it).
pub fn vllm_rs_exe() -> anyhow::Result<PathBuf> {
    match std::env::var_os("VLLM_RS_EXE") {
        Some(p) => Ok(PathBuf::from(p)),
        None => std::env::current_exe().context("cannot find the vllm-rs executable"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_protocol::FinishReason;

    fn finished(id: &str) -> EngineCoreOutput {
        EngineCoreOutput {
            finish_reason: Some(FinishReason::Stop),
            error: None,
            ..EngineCoreOutput::failed(id.to_string(), String::new())
        }
    }

    /// The route map is the frontend's only per-request state: the soak's RSS check
    /// catches a leak there only after minutes, this test at once. Every way a request
    /// ends must leave the map empty.
    #[tokio::test]
    async fn routes_are_removed_however_a_request_ends() {
        let routes: Routes = Arc::default();
        let (to_engine, mut sent) = mpsc::unbounded_channel();
        let mut done = RequestStream::open("done".into(), &routes, &to_engine);
        let dropped = RequestStream::open("dropped".into(), &routes, &to_engine);
        let mut aborted = RequestStream::open("aborted".into(), &routes, &to_engine);
        let _failed = RequestStream::open("failed".into(), &routes, &to_engine);
        assert_eq!(lock(&routes).len(), 4);

        route(&routes, vec![finished("done")]);
        assert!(done.next().await.is_some_and(|o| o.finish_reason.is_some()));
        assert!(done.next().await.is_none());
        drop(done);
        drop(dropped);
        aborted.abort();
        route(
            &routes,
            vec![EngineCoreOutput::failed("failed".into(), "oom".into())],
        );
        assert!(lock(&routes).is_empty(), "{:?}", lock(&routes).keys());

        // Only the requests the engine had not finished are aborted there.
        let mut aborts = Vec::new();
        while let Ok(input) = sent.try_recv() {
            if let EngineCoreInput::Abort(ids) = input {
                aborts.extend(ids);
            }
        }
        assert_eq!(aborts, ["dropped", "aborted"]);
    }
}
