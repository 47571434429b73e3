//! `CudaDevice`: one GPU's context and the single stream every op of this process runs on,
//! plus the memory facts the KV-cache sizing needs.
//!
//! One stream (created here, non-blocking: the legacy default stream cannot be captured
//! into a CUDA graph) means every op is ordered by the stream itself, so cudarc's per-buffer event
//! tracking (made for several streams) is turned off: it would record events on every
//! launch for nothing. Allocations are stream-ordered (`cuMemAllocAsync`) from the
//! device's default pool, which is told to keep freed memory rather than return it at
//! every synchronisation, as PyTorch's caching allocator does.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use cudarc::driver::{result as dr, sys, CudaContext, CudaStream};

use super::libs;

pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    pub num_sms: usize,
    /// Bytes of L2 cache.
    pub l2_bytes: usize,
    pool: Option<Pool>,
}

/// The device's default memory pool handle.
#[derive(Clone, Copy)]
struct Pool(sys::CUmemoryPool);
// SAFETY: a CUmemoryPool is a driver handle usable from any thread of the process.
unsafe impl Send for Pool {}
// SAFETY: as above; the driver serialises attribute calls.
unsafe impl Sync for Pool {}

/// What a failed driver call means, in one line.
pub fn driver_error(what: &str, e: dr::DriverError) -> anyhow::Error {
    anyhow!("CUDA driver: {what} failed: {e:?}")
}

impl CudaDevice {
    /// Opens GPU `ordinal`, after checking that the CUDA libraries load.
    pub fn open(ordinal: usize) -> Result<Self> {
        libs::check_libraries()?;
        dr::init().map_err(|e| driver_error("cuInit", e))?;
        let count = dr::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
        if ordinal as i32 >= count {
            anyhow::bail!(
                "CUDA device {ordinal} requested but the driver reports {count} device(s)"
            );
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("creating a context", e))?;
        // SAFETY: this process uses one stream only (see the module docs).
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream: CUDA graphs cannot be
        // captured on that one.
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating a stream", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| driver_error("reading the compute capability", e))?;
        let num_sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("reading the SM count", e))? as usize;
        let l2_bytes = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| driver_error("reading the L2 size", e))? as usize;
        let pool = default_pool(&ctx);
        tracing::info!(
            ordinal,
            name,
            sm = format!("{}.{}", compute_capability.0, compute_capability.1),
            num_sms,
            l2_mib = l2_bytes >> 20,
            "opened CUDA device"
        );
        Ok(Self {
            ctx,
            stream,
            ordinal,
            name,
            compute_capability,
            num_sms,
            l2_bytes,
            pool,
        })
    }

    /// NVRTC's architecture flag value for this device: `sm_90a` for Hopper (its
    /// architecture-specific features, `wgmma`, are what thin_gemm.cu needs), else
    /// `sm_{major}{minor}`.
    pub fn arch(&self) -> String {
        match self.compute_capability {
            (9, 0) => "sm_90a".to_string(),
            (major, minor) => format!("sm_{major}{minor}"),
        }
    }

    /// (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| driver_error("cuMemGetInfo", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("synchronizing the stream", e))
            .context("a kernel failed (see above), or the GPU is in an error state")
    }

    /// Most bytes the stream-ordered pool has held since the last reset (0 without a pool).
    pub fn pool_reserved_high(&self) -> u64 {
        self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    }

    /// Bytes the pool holds now.
    pub fn pool_reserved(&self) -> u64 {
        self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Restarts the pool's high-water mark from its current size.
    pub fn reset_pool_high(&self) {
        if let Some(Pool(pool)) = self.pool {
            let mut zero: u64 = 0;
            // SAFETY: the default pool of our device; the attribute takes a u64.
            let _ = unsafe {
                dr::mem_pool::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                    &mut zero as *mut u64 as *mut _,
                )
            };
        }
    }

    fn pool_attr(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let Some(Pool(pool)) = self.pool else {
            return 0;
        };
        let mut v: u64 = 0;
        // SAFETY: the default pool of our device; these attributes are u64.
        match unsafe { dr::mem_pool::get_attribute(pool, attr, &mut v as *mut u64 as *mut _) } {
            Ok(()) => v,
            Err(_) => 0,
        }
    }
}

/// The device's default memory pool, told to keep what it has allocated (release
/// threshold = max) so steady-state steps allocate without touching the driver.
fn default_pool(ctx: &Arc<CudaContext>) -> Option<Pool> {
    if !ctx.has_async_alloc() {
        tracing::warn!("this GPU has no stream-ordered allocator; allocations will be slower");
        return None;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-parameter for our own device.
    let ok = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    if ok != sys::CUresult::CUDA_SUCCESS || pool.is_null() {
        return None;
    }
    let mut threshold: u64 = u64::MAX;
    // SAFETY: RELEASE_THRESHOLD takes a u64.
    let _ = unsafe {
        dr::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut _,
        )
    };
    Some(Pool(pool))
}
