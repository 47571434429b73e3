//! The worker's step watchdog. A step that waits on a collective a peer never joins would
//! keep the GPU spinning and this process blocked for ever; after the
//! `--execute-model-timeout` the watchdog aborts the NCCL communicator from its own thread,
//! NCCL's kernels return, and the step ends in an error that names the hang. (The CPU
//! communicator times out by itself, and the engine-core has a watchdog of its own for a
//! rank that stops answering altogether.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::communicator::nccl::NcclAbort;

pub struct StepWatchdog {
    /// The step in flight and when it began.
    running: Arc<Mutex<Option<(u64, Instant)>>>,
    fired: Arc<AtomicBool>,
    timeout: Duration,
}

impl StepWatchdog {
    /// Watches steps; with no communicator to abort there is nothing to do, and no thread.
    pub fn start(timeout: Duration, abort: Option<Arc<NcclAbort>>) -> Self {
        let running = Arc::new(Mutex::new(None::<(u64, Instant)>));
        let fired = Arc::new(AtomicBool::new(false));
        if let Some(abort) = abort {
            let (running, fired) = (running.clone(), fired.clone());
            let tick = (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
            std::thread::spawn(move || loop {
                std::thread::sleep(tick);
                let hung = match *running.lock().unwrap_or_else(|p| p.into_inner()) {
                    Some((step, began)) if began.elapsed() > timeout => Some(step),
                    _ => None,
                };
                if let Some(step) = hung {
                    tracing::error!(
                        step,
                        "step hung for more than {timeout:?}: aborting the NCCL communicator"
                    );
                    fired.store(true, Ordering::SeqCst);
                    abort.abort();
                    return;
                }
            });
        }
        Self {
            running,
            fired,
            timeout,
        }
    }

    pub fn begin(&self, step: u64) {
        *self.running.lock().unwrap_or_else(|p| p.into_inner()) = Some((step, Instant::now()));
    }

    /// Ends the step; an error if the watchdog aborted it (its results are garbage then).
    pub fn end(&self) -> Result<()> {
        *self.running.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if self.fired.load(Ordering::SeqCst) {
            bail!(
                "a collective hung for more than {:?} (a peer rank stopped); the NCCL \
                 communicator was aborted",
                self.timeout
            );
        }
        Ok(())
    }
}
