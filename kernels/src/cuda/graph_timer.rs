//! The time of a short kernel sequence as a step's CUDA graph runs it: `f` captured
//! GRAPH_RUNS times back to back, the graph replayed. Timing eager launches measures the
//! host, whose launch costs about as much as one of these kernels (a first version of
//! the GEMM tuning chose on that noise and lost in the graphs).

use std::sync::Arc;

use anyhow::{anyhow, Result};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaStream;

use super::device::driver_error;

/// Runs of `f` in its timing graph, and timed replays of that graph.
const GRAPH_RUNS: usize = 10;
const TIMED_REPLAYS: usize = 2;

/// Mean µs of one `f` on `stream`, after a warm-up replay. One call runs first outside the
/// capture: it does a first call's setup, and an `f` that refuses its operands fails
/// there. Synchronises the stream; never call it while a graph is being captured.
pub fn mean_us_in_graph(
    stream: &Arc<CudaStream>,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f32> {
    f()?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| driver_error("beginning a capture", e))?;
    let enqueued = (0..GRAPH_RUNS).try_for_each(|_| f());
    // End the capture whatever happened, so the stream is usable again.
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(|e| driver_error("ending a capture", e));
    enqueued?;
    let graph = graph?.ok_or_else(|| anyhow!("timing kernels captured an empty graph"))?;
    let launch = || {
        graph
            .launch()
            .map_err(|e| driver_error("replaying a graph", e))
    };
    let event = || {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_error("recording an event", e))
    };
    launch()?;
    let start = event()?;
    for _ in 0..TIMED_REPLAYS {
        launch()?;
    }
    let end = event()?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(|e| driver_error("timing events", e))?;
    Ok(ms * 1000.0 / (GRAPH_RUNS * TIMED_REPLAYS) as f32)
}
