//! How our kernels are launched: `cuLaunchKernelEx` with programmatic dependent launch
//! (PDL) on Hopper and later.
//!
//! A decode step at small batch is a chain of short kernels, and between two of them the
//! GPU idles while the second is launched. With PDL a kernel may be scheduled while the
//! one before it on the stream still runs: every kernel of ours begins with `pdl_enter()`
//! (csrc/common.cuh), which waits until the kernel before it has completed and its writes
//! are visible, then lets the next one be scheduled. A kernel launched without the
//! attribute, or after a copy or a library kernel, waits for nothing there, so the wait is
//! always safe, and every launch can carry the attribute.
//!
//! A batch-1 Qwen3-0.6B step on the H100: eager 2.0 -> 1.45 ms; in a CUDA graph, whose
//! kernels take their buffers from the capture arena so that kernel follows kernel
//! (capture_arena.rs), 1.42 -> 1.27 ms (docs/BENCHMARKS.md).
//!
//! The arguments are collected here rather than by cudarc's `LaunchArgs`, which launches
//! through `cuLaunchKernel` only. The context does not track events (`device.rs`), so no
//! argument has events to wait on or record; `launch` refuses a context that does.

use std::ffi::c_void;
use std::marker::PhantomData;

use super::capture_arena::DeviceBuf;
use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DriverError,
    LaunchConfig,
};

/// One kernel argument: a value the kernel receives by copy, or a device pointer.
pub(crate) enum KernelArg<'a> {
    Value(*const c_void, PhantomData<&'a ()>),
    Pointer(sys::CUdeviceptr),
}

/// The types a kernel takes by value (scalars and `#[repr(C)]` argument structs). A marker
/// of our own, so that its references and the device buffers' can both be arguments.
///
/// # Safety
/// The type must have the layout the kernel's parameter has (cudarc's `DeviceRepr`).
pub(crate) unsafe trait ByValue {}

macro_rules! by_value {
    ($($t:ty),+) => { $(unsafe impl ByValue for $t {})+ };
}
by_value!(i32, u32, i64, u64, f32, f64);

/// A launch being assembled: the function, its stream and its arguments in order.
pub(crate) struct KernelLaunch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    args: Vec<KernelArg<'a>>,
}

pub(crate) trait IntoKernelArg<'a> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a>;
}

impl<'a, T: ByValue> IntoKernelArg<'a> for &'a T {
    fn into_arg(self, _: &CudaStream) -> KernelArg<'a> {
        KernelArg::Value(self as *const T as *const c_void, PhantomData)
    }
}

/// A device buffer's address; the guard `device_ptr` returns does nothing without event
/// tracking.
fn pointer<P: DevicePtr<T>, T>(p: &P, stream: &CudaStream) -> KernelArg<'static> {
    KernelArg::Pointer(p.device_ptr(stream).0)
}

impl<'a, T> IntoKernelArg<'a> for &'a CudaSlice<T> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a> {
        pointer(self, stream)
    }
}

impl<'a, T> IntoKernelArg<'a> for &'a mut CudaSlice<T> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a> {
        pointer(&*self, stream)
    }
}

impl<'a, T> IntoKernelArg<'a> for &'a CudaView<'_, T> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a> {
        pointer(self, stream)
    }
}

impl<'a, T> IntoKernelArg<'a> for &'a mut CudaViewMut<'_, T> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a> {
        pointer(&*self, stream)
    }
}

impl<'a, T> IntoKernelArg<'a> for &'a DeviceBuf<T> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a> {
        pointer(&**self, stream)
    }
}

impl<'a, T> IntoKernelArg<'a> for &'a mut DeviceBuf<T> {
    fn into_arg(self, stream: &CudaStream) -> KernelArg<'a> {
        pointer(&**self, stream)
    }
}

impl<'a> KernelLaunch<'a> {
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction) -> Self {
        Self {
            stream,
            func,
            args: Vec::with_capacity(16),
        }
    }

    pub fn arg(&mut self, arg: impl IntoKernelArg<'a>) -> &mut Self {
        let arg = arg.into_arg(self.stream);
        self.args.push(arg);
        self
    }

    /// Enqueues the kernel, with PDL when `pdl`.
    ///
    /// # Safety
    /// The arguments must be those the kernel declares, in order, and every buffer must
    /// hold what the kernel indexes (the caller's checks, stated at the call site).
    pub unsafe fn launch(&self, cfg: LaunchConfig, pdl: bool) -> Result<(), DriverError> {
        unsafe { self.launch_in_clusters(cfg, pdl, 1) }
    }

    /// `launch` in thread-block clusters of `cluster` blocks along x (1: none).
    ///
    /// # Safety
    /// As `launch`; the grid's x is a multiple of `cluster`, which the kernel allows.
    pub unsafe fn launch_in_clusters(
        &self,
        cfg: LaunchConfig,
        pdl: bool,
        cluster: u32,
    ) -> Result<(), DriverError> {
        assert!(
            !self.stream.context().is_managing_stream_synchronization(),
            "KernelLaunch passes no events: the context must not track them (device.rs)"
        );
        self.stream.context().bind_to_thread()?;
        // A pointer argument is passed as the address of the `CUdeviceptr` held in
        // `self.args`, which does not move while `self` is borrowed.
        let mut params: Vec<*mut c_void> = (self.args.iter())
            .map(|a| match a {
                KernelArg::Value(v, _) => *v as *mut c_void,
                KernelArg::Pointer(p) => p as *const sys::CUdeviceptr as *mut c_void,
            })
            .collect();
        let mut attrs = Vec::with_capacity(2);
        if pdl {
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: Default::default(),
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            });
        }
        if cluster > 1 {
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: Default::default(),
                value: sys::CUlaunchAttributeValue {
                    clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                        x: cluster,
                        y: 1,
                        z: 1,
                    },
                },
            });
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: `params` points at one value per kernel parameter (the caller's), each
        // alive until this returns: the launch copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
