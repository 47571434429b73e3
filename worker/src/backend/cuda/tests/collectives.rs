//! NCCL collectives of the tensor-parallel communicator against the host, and their
//! latency at the model's message sizes (2+ GPUs).

use super::*;

/// Runs `f(rank, backend)` on one thread per GPU, the backends joined in one NCCL group.
fn on_gpus<T: Send>(n: usize, f: impl Fn(usize, &CudaBackend) -> T + Sync) -> Vec<T> {
    let id = crate::communicator::NcclCommunicator::unique_id().expect("NCCL unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, id) = (&f, &id);
                s.spawn(move || {
                    let mut b = CudaBackend::new(rank as u32, DType::BF16).expect("backend");
                    b.join_group(id, rank as u32, n as u32).expect("join");
                    f(rank, &b)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// Values that differ per rank and element, exact in bf16 and in their sums.
fn rank_values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 5) % 61) as f32 * 0.25 - 7.0)
        .collect()
}

fn gpus_for_collectives() -> Option<usize> {
    let n = libs::device_count();
    if n >= 2 {
        return Some(n.min(8));
    }
    assert!(
        std::env::var_os("VLLM_REQUIRE_GPUS").is_none(),
        "VLLM_REQUIRE_GPUS is set but {n} GPU(s) are usable"
    );
    eprintln!("SKIPPED: NCCL collectives need 2 GPUs, found {n}");
    None
}

#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn nccl_collectives_match_the_host() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    let len = 3 * 4096 + 5;
    let results = on_gpus(n, |rank, b| {
        let comm = b.communicator().expect("joined");
        let mut x = b
            .upload(&HostTensor::new(vec![1, len], rank_values(rank, len)))
            .expect("up");
        comm.all_reduce(&mut x).expect("all-reduce");
        let g = comm
            .all_gather(
                &b.upload(&HostTensor::new(vec![1, 3], vec![rank as f32; 3]))
                    .expect("up"),
            )
            .expect("all-gather");
        let mut c = b
            .upload(&HostTensor::new(vec![4], vec![rank as f32 + 1.0; 4]))
            .expect("up");
        comm.broadcast(&mut c, n - 1).expect("broadcast");
        (
            b.to_host(&x).expect("x").data,
            b.to_host(&g).expect("g").data,
            b.to_host(&c).expect("c").data,
        )
    });
    let sum: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| rank_values(r, len)[i]).sum())
        .collect();
    let gathered: Vec<f32> = (0..n).flat_map(|r| [r as f32; 3]).collect();
    for (rank, (x, g, c)) in results.iter().enumerate() {
        assert_eq!(x, &sum, "rank {rank}: all-reduce");
        assert_eq!(g, &gathered, "rank {rank}: all-gather");
        assert_eq!(
            c,
            &vec![n as f32; 4],
            "rank {rank}: broadcast from the last rank"
        );
    }
    println!("NCCL-CHECK {n} GPUs: all-reduce, all-gather, broadcast equal the host");
}

/// All-reduce latency at the model's message sizes (hidden 4096 bf16 × tokens), through
/// the communicator the model uses, as `BENCH allreduce` lines.
#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn nccl_all_reduce_bench() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    let hidden = 4096;
    let rows = on_gpus(n, |rank, b| {
        let comm = b.communicator().expect("joined");
        let mut out = Vec::new();
        for tokens in [1usize, 8, 32, 128, 256, 1024, 4096] {
            let mut x = b
                .upload(&HostTensor::new(
                    vec![tokens, hidden],
                    rank_values(rank, tokens * hidden),
                ))
                .expect("upload");
            for _ in 0..20 {
                comm.all_reduce(&mut x).expect("warm-up");
            }
            b.dev.synchronize().expect("sync");
            let iters = if tokens <= 256 { 500 } else { 100 };
            let t = std::time::Instant::now();
            for _ in 0..iters {
                comm.all_reduce(&mut x).expect("all-reduce");
            }
            b.dev.synchronize().expect("sync");
            out.push((tokens, t.elapsed().as_secs_f64() / iters as f64));
        }
        out
    });
    for (i, &(tokens, _)) in rows[0].iter().enumerate() {
        let secs = rows.iter().map(|r| r[i].1).fold(0.0, f64::max);
        let bytes = (tokens * hidden * 2) as f64;
        // nccl-tests' bus bandwidth of an all-reduce: bytes · 2(n-1)/n over the time.
        let busbw = bytes * 2.0 * (n - 1) as f64 / n as f64 / secs / 1e9;
        println!(
            "BENCH allreduce ranks={n} tokens={tokens} bytes={bytes:.0} time={:.2}us busbw={busbw:.1}GB/s",
            secs * 1e6
        );
    }
}
