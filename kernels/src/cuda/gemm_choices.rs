//! The GEMM algorithm each shape chose (lt_matmul.rs), kept on disk beside the kernel cache
//! so that a second start times nothing: one text file per (GPU, cuBLAS version, dtype),
//! a line per shape, `m k n default` where cuBLAS's own GEMM won, else `m k n` and the
//! eight words of the `cublasLtMatmulAlgo_t`, which cuBLASLt documents as serializable for
//! use with the same library version. A line that does not parse is ignored (it is timed
//! again), and the caller checks a loaded algorithm against its shape before using it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::cache;

/// (m, k, n) of `y[m, n] = x[m, k] · w[n, k]ᵀ`.
pub type Mkn = (usize, usize, usize);

/// The cuBLASLt algorithm's words, or None where cuBLAS's own GEMM won.
pub type Choice = Option<[u64; 8]>;

/// The record's file in `dir` for this GPU, cuBLASLt version and dtype.
pub fn record_path(dir: &Path, gpu: &str, cublaslt_version: usize, dtype: &str) -> PathBuf {
    let key = cache::fnv1a(&[
        gpu.as_bytes(),
        cublaslt_version.to_string().as_bytes(),
        dtype.as_bytes(),
    ]);
    dir.join(format!("gemm-choices-{dtype}-{key:016x}.txt"))
}

/// The choices stored at `path`; empty when there is no readable file.
pub fn load(path: &Path) -> BTreeMap<Mkn, Choice> {
    cache::load(path)
        .map(|bytes| parse(&String::from_utf8_lossy(&bytes)))
        .unwrap_or_default()
}

/// Best effort, like the kernel cache: a failure is logged, never fatal.
pub fn store(path: &Path, choices: &BTreeMap<Mkn, Choice>) {
    if let Err(e) = cache::store(path, format(choices).as_bytes()) {
        tracing::warn!(path = %path.display(), "cannot write the GEMM choices: {e}");
    }
}

fn parse(text: &str) -> BTreeMap<Mkn, Choice> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<(Mkn, Choice)> {
    let mut fields = line.split_whitespace();
    let mut dim = || fields.next()?.parse::<usize>().ok();
    let mkn = (dim()?, dim()?, dim()?);
    let rest: Vec<&str> = fields.collect();
    let choice = match rest.as_slice() {
        ["default"] => None,
        words if words.len() == 8 => {
            let mut algo = [0u64; 8];
            for (slot, word) in algo.iter_mut().zip(words) {
                *slot = u64::from_str_radix(word, 16).ok()?;
            }
            Some(algo)
        }
        _ => return None,
    };
    Some((mkn, choice))
}

fn format(choices: &BTreeMap<Mkn, Choice>) -> String {
    let mut text = String::new();
    for (&(m, k, n), choice) in choices {
        let algo = match choice {
            None => "default".to_string(),
            Some(words) => words
                .iter()
                .map(|w| format!("{w:016x}"))
                .collect::<Vec<_>>()
                .join(" "),
        };
        text.push_str(&format!("{m} {k} {n} {algo}\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_round_trip_through_text() {
        let mut choices = BTreeMap::new();
        choices.insert(
            (256, 1024, 4096),
            Some([1, 2, 3, u64::MAX, 0, 7, 8, 0xdead_beef]),
        );
        choices.insert((16, 2048, 1024), None);
        assert_eq!(parse(&format(&choices)), choices);
    }

    #[test]
    fn lines_that_do_not_parse_are_skipped() {
        let text = "8 16 32 default\n\
                    garbage\n\
                    1 2 default\n\
                    1 2 3 4 5\n\
                    1 2 3 0 0 0 0 0 0 0 zz\n\
                    4 5 6 0 0 0 0 0 0 0 1\n";
        let want: BTreeMap<Mkn, Choice> = [
            ((8, 16, 32), None),
            ((4, 5, 6), Some([0, 0, 0, 0, 0, 0, 0, 1])),
        ]
        .into_iter()
        .collect();
        assert_eq!(parse(text), want);
    }

    #[test]
    fn record_paths_differ_by_gpu_version_and_dtype() {
        let dir = Path::new("/cache");
        let a = record_path(dir, "NVIDIA H100 80GB HBM3", 130_000, "bf16");
        assert!(a.starts_with(dir));
        assert_ne!(a, record_path(dir, "NVIDIA H200", 130_000, "bf16"));
        assert_ne!(
            a,
            record_path(dir, "NVIDIA H100 80GB HBM3", 130_100, "bf16")
        );
        assert_ne!(a, record_path(dir, "NVIDIA H100 80GB HBM3", 130_000, "f16"));
    }
}
