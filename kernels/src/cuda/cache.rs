//! The on-disk kernel cache: CUBINs keyed by a hash of the source, the architecture, the
//! compile options and the NVRTC version, so a second start compiles nothing.
//!
//! Folder: `$VLLM_RS_KERNEL_CACHE`, else `$XDG_CACHE_HOME/vllm-rs/kernels`, else
//! `~/.cache/vllm-rs/kernels`. Entries are written to a temporary name and renamed, so
//! concurrent workers never read half a file. An unreadable cache only costs a compile.

use std::path::{Path, PathBuf};

/// 64-bit FNV-1a: stable across Rust versions and runs, unlike `DefaultHasher`.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separator, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("VLLM_RS_KERNEL_CACHE").filter(|s| !s.is_empty()) {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("vllm-rs").join("kernels")
}

/// The cache file of one (source, arch, options, nvrtc version).
pub fn entry_path(dir: &Path, label: &str, key: u64) -> PathBuf {
    dir.join(format!("{label}-{key:016x}.cubin"))
}

pub fn load(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok().filter(|b| !b.is_empty())
}

/// Writes an entry (and its folder). The caller decides what a failure costs: a server
/// only logs it, `vllm-rs compile-kernels` fails, since filling the cache is its job.
pub fn store(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"abc"]), fnv1a(&[b"abc"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn store_then_load_round_trips() {
        let dir = std::env::temp_dir().join(format!("vllm-rs-cache-test-{}", std::process::id()));
        let path = entry_path(&dir, "t", 42);
        store(&path, b"cubin").expect("store");
        assert_eq!(load(&path).as_deref(), Some(&b"cubin"[..]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn store_under_a_file_is_an_error() {
        let file = std::env::temp_dir().join(format!("vllm-rs-cache-file-{}", std::process::id()));
        std::fs::write(&file, b"not a folder").expect("write");
        let path = entry_path(&file, "t", 42);
        assert!(store(&path, b"cubin").is_err());
        assert_eq!(load(&path), None);
        let _ = std::fs::remove_file(&file);
    }
}
