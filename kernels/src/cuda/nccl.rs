//! NCCL, loaded at run time: the few entry points tensor parallelism uses, looked up with
//! `dlopen` so that the binary builds and runs where NCCL is absent, and a missing library
//! is one clear error at `--tensor-parallel-size N` start-up, not a panic.
//!
//! Why not cudarc's NCCL module: its loader tries `libnccl.so` and `libnccl.so.<CUDA
//! major>`, but NCCL's soname is `libnccl.so.2`, and runtime-only installs (Debian's and
//! NVIDIA's `libnccl2`) ship that name alone.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Result};

/// `ncclUniqueId`: what every rank needs to join the group (made by one rank).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

impl UniqueId {
    pub fn to_bytes(&self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let internal: [u8; 128] = bytes
            .try_into()
            .map_err(|_| anyhow!("NCCL unique id of {} bytes (expected 128)", bytes.len()))?;
        Ok(Self {
            internal: internal.map(|b| b as c_char),
        })
    }
}

/// An opaque `ncclComm_t`.
pub type RawComm = *mut c_void;

/// `ncclDataType_t` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum DataType {
    Uint8 = 1,
    Float16 = 6,
    Float32 = 7,
    Bfloat16 = 9,
}

const NCCL_SUM: c_int = 0;

type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    *mut c_void,
) -> c_int;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, *mut c_void) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    *mut c_void,
) -> c_int;
type CommFn = unsafe extern "C" fn(RawComm) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The NCCL entry points, resolved once per process.
pub struct Nccl {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    all_gather: AllGather,
    broadcast: Broadcast,
    comm_abort: CommFn,
    comm_destroy: CommFn,
    error_string: ErrorString,
    /// NCCL's version code (e.g. 22703 for 2.27.3).
    pub version: i32,
}

const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

impl Nccl {
    /// The process's NCCL, or why it cannot be loaded.
    pub fn get() -> Result<&'static Nccl> {
        static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
        NCCL.get_or_init(|| Self::load().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("{e}"))
    }

    fn load() -> Result<Nccl> {
        let handle = LIBRARY_NAMES
            .iter()
            .find_map(|name| {
                let c = CString::new(*name).ok()?;
                // SAFETY: dlopen by name; the handle stays open for the process's life.
                let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
                (!h.is_null()).then_some(h)
            })
            .ok_or_else(|| {
                anyhow!(
                    "NCCL ({}) not found: tensor parallelism on CUDA needs NCCL 2; install it \
                     or add the folder holding libnccl.so.2 to LD_LIBRARY_PATH",
                    LIBRARY_NAMES[0]
                )
            })?;
        let sym = |name: &str| -> Result<*mut c_void> {
            let c = CString::new(name)?;
            // SAFETY: dlsym on a handle dlopen returned.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if p.is_null() {
                bail!("NCCL library lacks {name}: it is too old (need NCCL 2.x)");
            }
            Ok(p)
        };
        // SAFETY: each symbol is NCCL's public C function of exactly this signature
        // (nccl.h); the transmutes only give the pointers their types.
        let nccl = unsafe {
            Nccl {
                get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(sym(
                    "ncclGetUniqueId",
                )?),
                comm_init_rank: std::mem::transmute::<*mut c_void, CommInitRank>(sym(
                    "ncclCommInitRank",
                )?),
                all_reduce: std::mem::transmute::<*mut c_void, AllReduce>(sym("ncclAllReduce")?),
                all_gather: std::mem::transmute::<*mut c_void, AllGather>(sym("ncclAllGather")?),
                broadcast: std::mem::transmute::<*mut c_void, Broadcast>(sym("ncclBroadcast")?),
                comm_abort: std::mem::transmute::<*mut c_void, CommFn>(sym("ncclCommAbort")?),
                comm_destroy: std::mem::transmute::<*mut c_void, CommFn>(sym("ncclCommDestroy")?),
                error_string: std::mem::transmute::<*mut c_void, ErrorString>(sym(
                    "ncclGetErrorString",
                )?),
                version: 0,
            }
        };
        let get_version =
            // SAFETY: as above.
            unsafe { std::mem::transmute::<*mut c_void, GetVersion>(sym("ncclGetVersion")?) };
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { get_version(&mut version) };
        Ok(Nccl { version, ..nccl })
    }

    fn check(&self, what: &str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let text = unsafe { CStr::from_ptr((self.error_string)(code)) };
        bail!(
            "NCCL {what} failed: {} (code {code})",
            text.to_string_lossy()
        )
    }

    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes one ncclUniqueId.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    /// Joins the group of `world_size` ranks as `rank`; blocks until every rank has joined.
    /// The calling thread's current CUDA context picks the GPU.
    pub fn comm_init_rank(&self, id: UniqueId, rank: usize, world_size: usize) -> Result<RawComm> {
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: writes one ncclComm_t.
        let code =
            unsafe { (self.comm_init_rank)(&mut comm, world_size as c_int, id, rank as c_int) };
        self.check("ncclCommInitRank", code)?;
        Ok(comm)
    }

    /// # Safety
    /// `send` and `recv` hold `count` elements of `dtype` on the comm's device, valid until
    /// the stream reaches this operation; `stream` is a CUstream of that device.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce_sum(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        comm: RawComm,
        stream: *mut c_void,
    ) -> Result<()> {
        let code = (self.all_reduce)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dtype as c_int,
            NCCL_SUM,
            comm,
            stream,
        );
        self.check("ncclAllReduce", code)
    }

    /// # Safety
    /// As `all_reduce_sum`, with `recv` holding `count · world_size` elements.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        comm: RawComm,
        stream: *mut c_void,
    ) -> Result<()> {
        let code = (self.all_gather)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dtype as c_int,
            comm,
            stream,
        );
        self.check("ncclAllGather", code)
    }

    /// # Safety
    /// As `all_reduce_sum`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        root: usize,
        comm: RawComm,
        stream: *mut c_void,
    ) -> Result<()> {
        let code = (self.broadcast)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dtype as c_int,
            root as c_int,
            comm,
            stream,
        );
        self.check("ncclBroadcast", code)
    }

    /// Aborts every operation of `comm` in flight and frees it. Safe to call from another
    /// thread while the owner waits on the GPU (the watchdog does that).
    ///
    /// # Safety
    /// `comm` came from `comm_init_rank` and is used by no one after this.
    pub unsafe fn comm_abort(&self, comm: RawComm) -> Result<()> {
        self.check("ncclCommAbort", (self.comm_abort)(comm))
    }

    /// # Safety
    /// As `comm_abort`.
    pub unsafe fn comm_destroy(&self, comm: RawComm) -> Result<()> {
        self.check("ncclCommDestroy", (self.comm_destroy)(comm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let bytes: Vec<u8> = (0..128u32).map(|i| (i * 37 % 256) as u8).collect();
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes(), bytes);
        assert!(UniqueId::from_bytes(&bytes[..100]).is_err());
    }

    #[test]
    fn a_missing_library_is_one_clear_error() {
        // CI machines have no NCCL; where one is installed this checks that it loads.
        match Nccl::get() {
            Ok(n) => assert!(n.version >= 20000, "NCCL version code {}", n.version),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("NCCL") && e.contains("LD_LIBRARY_PATH"), "{e}");
                assert!(!e.contains('\n'));
            }
        }
    }
}
