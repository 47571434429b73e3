//! The tensor-parallel communicator's collectives (NCCL, and the custom all-reduce over
//! peer memory) against the host, and their latency at the model's message sizes (2+ GPUs).

use super::*;
use crate::backend::cuda::CudaTensor;
use crate::communicator::nccl::{CustomAllReduceMode, CUSTOM_ALL_REDUCE_MAX_BYTES};

/// Runs `f(rank, backend)` on one thread per GPU, the backends joined in one group.
fn on_gpus<T: Send>(
    n: usize,
    mode: CustomAllReduceMode,
    f: impl Fn(usize, &CudaBackend) -> T + Sync,
) -> Vec<T> {
    let id = crate::communicator::NcclCommunicator::unique_id().expect("NCCL unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, id) = (&f, &id);
                s.spawn(move || {
                    let mut b = CudaBackend::new(rank as u32, DType::BF16).expect("backend");
                    b.join_group(id, rank as u32, n as u32, mode).expect("join");
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
    let results = on_gpus(n, CustomAllReduceMode::Disabled, |rank, b| {
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

/// A rank whose part of the custom all-reduce's setup fails (its allocation, or opening a
/// peer's buffer: IPC refused in a container) must not leave the others waiting or on a
/// half-built group: every rank comes out unavailable, and NCCL serves on. The failures
/// are real driver calls: the opening one takes a peer in this process for one in another
/// (its record's first 8 bytes, the process id), so its handle is opened where it was made.
#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn custom_all_reduce_setup_failure_leaves_every_rank_on_nccl() {
    use vllm_kernels::cuda::{CustomAllReduce, CustomAllReduceSetup};
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    for failure in ["allocation", "opening"] {
        let failing = n - 1;
        let outcomes = on_gpus(n, CustomAllReduceMode::Disabled, |rank, b| {
            let comm = b.communicator().expect("joined");
            let local = if failure == "allocation" && rank == failing {
                Err(anyhow::anyhow!("no memory (the test's failure)"))
            } else {
                CustomAllReduce::allocate(&b.dev, &b.ops, rank, n, 1 << 20)
            };
            let setup = CustomAllReduce::connect(local, rank, n, |bytes| {
                let mut all = comm.all_gather_bytes(bytes)?;
                if failure == "opening" && rank == failing && bytes.len() > n {
                    let peer = (rank + 1) % n * (all.len() / n);
                    all[peer..peer + 8].copy_from_slice(&1u64.to_le_bytes());
                }
                Ok(all)
            })
            .expect("the exchanges themselves succeed");
            // NCCL still serves the group afterwards.
            let len = 4096;
            let mut x = b
                .upload(&HostTensor::new(vec![1, len], rank_values(rank, len)))
                .expect("up");
            comm.all_reduce(&mut x).expect("all-reduce");
            let why = match setup {
                CustomAllReduceSetup::Ready(_) => None,
                CustomAllReduceSetup::Unavailable(why) => Some(why),
            };
            (why, b.to_host(&x).expect("x").data)
        });
        let sum: Vec<f32> = (0..4096)
            .map(|i| (0..n).map(|r| rank_values(r, 4096)[i]).sum())
            .collect();
        for (rank, (why, x)) in outcomes.iter().enumerate() {
            let why = why.as_ref().unwrap_or_else(|| {
                panic!("{failure} failure on rank {failing}: rank {rank} set the group up")
            });
            println!(
                "CUSTOM-ALLREDUCE-SETUP {failure} failure on rank {failing}: rank {rank}: {why}"
            );
            assert_eq!(
                x, &sum,
                "rank {rank}: NCCL's all-reduce after the failed setup"
            );
        }
    }
}

/// Elements of `a` and `b` whose bits differ (a length difference counts too).
fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    let differ = a
        .iter()
        .zip(b)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count();
    differ + a.len().abs_diff(b.len())
}

/// Elements of NCCL's all-reduce (`got`) off the exact sum of `inputs` by more than its
/// bf16 roundings allow. NCCL adds in bf16 in its ring's order, rounding after every add:
/// at two ranks that is the one rounding of the custom kernel, bit for bit; at more, each
/// of the n - 1 roundings errs by at most half a bf16 step (2^-8 of the value: 8 bits of
/// precision) of a partial sum, and no partial sum exceeds the sum of the magnitudes.
fn nccl_sum_errors(got: &[f32], inputs: &[Vec<f32>]) -> usize {
    let (mut worst, mut bad) = (0.0f64, 0);
    for (i, &g) in got.iter().enumerate() {
        let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
        let magnitude: f64 = inputs.iter().map(|v| v[i].abs() as f64).sum();
        // In half bf16 steps of the magnitude; 1% over n - 1 for the errors' errors.
        let steps = (g as f64 - exact).abs() / magnitude * 256.0;
        worst = worst.max(steps);
        bad += usize::from(steps > (inputs.len() - 1) as f64 * 1.01);
    }
    println!("NCCL sum: worst error {worst:.2} half bf16 steps of the magnitudes");
    bad
}

/// Random values of one rank and call, as bf16 holds them (poison: nothing here is zero
/// or exact in a sum).
fn random_bf16(rank: usize, call: usize, n: usize) -> Vec<f32> {
    let seed = (rank * 1000 + call) as u64;
    (0..n as u64)
        .map(|i| {
            // splitmix64 of (seed, i), its top 24 bits as a uniform in [-4, 4).
            let mut z = (seed << 32 ^ i).wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let u = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32;
            half::bf16::from_f32(u * 8.0 - 4.0).to_f32()
        })
        .collect()
}

#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn custom_all_reduce_matches_the_host() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    let hidden = 4096;
    // Sizes change from call to call, so that a block's chunks move between calls while
    // the slots alternate, and calls switch between the low-latency lines (up to 16
    // tokens, 128 KiB) and the staged buffers; the last size is past the kernel (NCCL:
    // bit for bit only at two ranks, where it too rounds once).
    let tokens = [1usize, 256, 3, 16, 17, 8, 256, 1, 64, 1, 2, 513];
    let results = on_gpus(n, CustomAllReduceMode::Auto, |rank, b| {
        let comm = b.communicator().expect("joined");
        assert!(
            comm.custom_all_reduce_on(),
            "the custom all-reduce is off on GPUs that should reach each other"
        );
        tokens
            .iter()
            .enumerate()
            .map(|(call, &t)| {
                let v = random_bf16(rank, call, t * hidden);
                let mut x = b.upload(&HostTensor::new(vec![t, hidden], v)).expect("up");
                comm.all_reduce(&mut x).expect("all-reduce");
                b.to_host(&x).expect("x").data
            })
            .collect::<Vec<_>>()
    });
    for (call, &t) in tokens.iter().enumerate() {
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| random_bf16(r, call, t * hidden)).collect();
        // The kernel's sum: f32 in rank order, rounded once.
        let want: Vec<f32> = (0..t * hidden)
            .map(|i| {
                let s: f32 = inputs.iter().map(|v| v[i]).sum();
                half::bf16::from_f32(s).to_f32()
            })
            .collect();
        let got = &results[0][call];
        let bad = if t * hidden * 2 <= CUSTOM_ALL_REDUCE_MAX_BYTES || n == 2 {
            bits_differ(got, &want)
        } else {
            nccl_sum_errors(got, &inputs)
        };
        assert_eq!(
            bad, 0,
            "call {call} ({t} tokens): {bad} elements differ from the host"
        );
        for (rank, other) in results.iter().enumerate().skip(1) {
            let differ = bits_differ(&other[call], got);
            assert_eq!(differ, 0, "call {call}: rank {rank} differs from rank 0");
        }
    }
    println!(
        "CUSTOM-ALLREDUCE-CHECK {n} GPUs: {} calls of 1-256 tokens equal the host bit for bit; \
         513 tokens (NCCL) within its bf16 roundings",
        tokens.len() - 1
    );
}

/// A peer that never joins (a dead rank): the watchdog's abort must free the waiting
/// kernel, and the communicator must refuse further work, instead of hanging the rank.
#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn custom_all_reduce_leaves_when_aborted() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    // The other ranks keep their buffers (which rank 0's kernel writes into) until it is done.
    let done = std::sync::Barrier::new(n);
    let waited = on_gpus(n, CustomAllReduceMode::Auto, |rank, b| {
        let comm = b.communicator().expect("joined");
        assert!(comm.custom_all_reduce_on(), "the custom all-reduce is off");
        if rank != 0 {
            done.wait(); // never joins the all-reduce
            return None;
        }
        let mut x = b
            .upload(&HostTensor::new(vec![1, 4096], rank_values(0, 4096)))
            .expect("up");
        let abort = comm.abort_handle();
        let watchdog = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            abort.abort();
        });
        let t = std::time::Instant::now();
        comm.all_reduce(&mut x).expect("the launch itself succeeds");
        b.dev.synchronize().expect("the kernel leaves once aborted");
        let waited = t.elapsed();
        watchdog.join().expect("watchdog thread");
        let err = comm
            .all_reduce(&mut x)
            .expect_err("an aborted group refuses work");
        assert!(format!("{err:#}").contains("aborted"), "{err:#}");
        done.wait();
        Some(waited)
    });
    let waited = waited[0].expect("rank 0 waited");
    assert!(
        waited < std::time::Duration::from_secs(10),
        "rank 0 waited {waited:?} for a peer that never came"
    );
    println!("CUSTOM-ALLREDUCE-ABORT-CHECK: a missing peer's all-reduce left {waited:?} after it began (abort at 500 ms)");
}

#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn custom_all_reduce_norm_equals_the_two_ops() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    // (rows, hidden): 33 rows is past the fused kernel (the plain one and the norm's).
    let shapes = [
        (1usize, 4096usize),
        (5, 4096),
        (32, 4096),
        (3, 1024),
        (2, 8192),
        (33, 4096),
    ];
    let results = on_gpus(n, CustomAllReduceMode::Auto, |rank, b| {
        let comm = b.communicator().expect("joined");
        let mut out = Vec::new();
        for (call, &(rows, hidden)) in shapes.iter().enumerate() {
            let up =
                |v: Vec<f32>, shape: Vec<usize>| b.upload(&HostTensor::new(shape, v)).expect("up");
            let x = random_bf16(rank, call, rows * hidden);
            // The residual and the weight are the same on every rank, as in the model.
            let res = random_bf16(100, call, rows * hidden);
            let w = up(random_bf16(200, call, hidden), vec![hidden]);
            let (mut x1, mut r1) = (
                up(x.clone(), vec![rows, hidden]),
                up(res.clone(), vec![rows, hidden]),
            );
            b.all_reduce_add_rms_norm(&mut x1, &mut r1, &w, 1e-6)
                .expect("fused");
            let (mut x2, mut r2) = (up(x, vec![rows, hidden]), up(res, vec![rows, hidden]));
            comm.all_reduce(&mut x2).expect("all-reduce");
            b.fused_add_rms_norm(&mut x2, &mut r2, &w, 1e-6)
                .expect("norm");
            let host = |t: &CudaTensor| b.to_host(t).expect("down").data;
            out.push([host(&x1), host(&r1), host(&x2), host(&r2)]);
        }
        out
    });
    for (call, &(rows, hidden)) in shapes.iter().enumerate() {
        for (rank, r) in results.iter().enumerate() {
            let [x1, r1, x2, r2] = &r[call];
            assert!(
                x1.iter().all(|v| v.is_finite()),
                "rank {rank}, {rows} x {hidden}: non-finite output"
            );
            assert_eq!(
                bits_differ(x1, x2),
                0,
                "rank {rank}, {rows} x {hidden}: normed x differs"
            );
            assert_eq!(
                bits_differ(r1, r2),
                0,
                "rank {rank}, {rows} x {hidden}: residual differs"
            );
            assert_eq!(
                bits_differ(x1, &results[0][call][0]),
                0,
                "rank {rank} differs from rank 0"
            );
        }
    }
    println!(
        "CUSTOM-ALLREDUCE-NORM-CHECK {n} GPUs: fused all-reduce + add + RMSNorm equals the two ops bit for bit ({} shapes)",
        shapes.len()
    );
}

/// One token's row-parallel projection with its all-reduce and norm
/// (`linear_all_reduce_add_rms_norm`: where the custom kernels take it, the gemv sends its
/// outputs to the ranks) against the three ops (the gemv, the all-reduce, the norm), bit
/// for bit. The calls alternate with the custom all-reduce's other calls and with shapes
/// it does not take, over enough calls that both slots of the row lines come round twice.
#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn gemv_all_reduce_norm_equals_the_three_ops() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    // (rows of x, k, outputs, taken by the fused kernels): Qwen3-8B's TP=4 o_proj and
    // down_proj, the 70B's TP=4 o_proj, a narrow model's; then shapes they do not take
    // (rows split over warps; two tokens; a row past the fused norm).
    let shapes = [
        (1usize, 1024usize, 4096usize, true),
        (1, 3072, 4096, true),
        (1, 2048, 8192, true),
        (1, 1024, 1024, true),
        (1, 2048, 1024, false),
        (2, 1024, 4096, false),
        (1, 1024, 12288, false),
    ];
    let calls: Vec<_> = (0..3).flat_map(|_| shapes.iter().copied()).collect();
    let results = on_gpus(n, CustomAllReduceMode::Auto, |rank, b| {
        let comm = b.communicator().expect("joined");
        let up = |v: Vec<f32>, shape: Vec<usize>| b.upload(&HostTensor::new(shape, v)).expect("up");
        let host = |t: &CudaTensor| b.to_host(t).expect("down").data;
        let mut out = Vec::new();
        for (call, &(m, k, d, fused)) in calls.iter().enumerate() {
            if m == 1 {
                let taken = comm.custom_gemv_norm(&b.ops, k, d).expect("live").is_some();
                assert_eq!(taken, fused, "{k} -> {d}: the fused kernels taken: {taken}");
            }
            // Each rank's own input and weight (its shard); the residual and the norm's
            // weight are the same on every rank, as in the model.
            let x = up(random_bf16(rank, call, m * k), vec![m, k]);
            let w = up(random_bf16(300 + rank, call, d * k), vec![d, k]);
            let res = random_bf16(100, call, m * d);
            let nw = up(random_bf16(200, call, d), vec![d]);
            let mut r1 = up(res.clone(), vec![m, d]);
            let y1 = b
                .linear_all_reduce_add_rms_norm(&x, &w, &mut r1, &nw, 1e-6)
                .expect("fused");
            let mut r2 = up(res, vec![m, d]);
            let mut y2 = b.linear(&x, &w).expect("gemv");
            comm.all_reduce(&mut y2).expect("all-reduce");
            b.fused_add_rms_norm(&mut y2, &mut r2, &nw, 1e-6)
                .expect("norm");
            out.push([host(&y1), host(&r1), host(&y2), host(&r2)]);
        }
        out
    });
    for (call, &(m, k, d, _)) in calls.iter().enumerate() {
        for (rank, r) in results.iter().enumerate() {
            let [y1, r1, y2, r2] = &r[call];
            let what = format!("call {call}, rank {rank}, [{m}x{k}] -> {d}");
            assert!(
                y1.iter().all(|v| v.is_finite()),
                "{what}: non-finite output"
            );
            assert_eq!(bits_differ(y1, y2), 0, "{what}: normed sum differs");
            assert_eq!(bits_differ(r1, r2), 0, "{what}: residual differs");
            assert_eq!(
                bits_differ(y1, &results[0][call][0]),
                0,
                "{what}: differs from rank 0"
            );
        }
    }
    println!(
        "GEMV-ALLREDUCE-NORM-CHECK {n} GPUs: one token's projection, all-reduce and norm equal the three ops bit for bit ({} calls)",
        calls.len()
    );
}

/// Seconds a call of `f`, queued `iters` times after 20 warm-up calls.
fn time_calls(b: &CudaBackend, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..20 {
        f();
    }
    b.dev.synchronize().expect("sync");
    let t = std::time::Instant::now();
    for _ in 0..iters {
        f();
    }
    b.dev.synchronize().expect("sync");
    t.elapsed().as_secs_f64() / iters as f64
}

/// All-reduce latency at the model's message sizes (hidden 4096 bf16 × tokens), through
/// the communicator the model uses, NCCL alone and then with the custom kernel, as
/// `BENCH allreduce` lines; then the all-reduce with the residual add and RMSNorm after
/// it (`all_reduce_add_rms_norm`: NCCL and the norm's kernel, or the fused kernel) at
/// decode sizes, as `BENCH allreduce+norm` lines.
#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn nccl_all_reduce_bench() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    let hidden = 4096;
    for (kind, mode) in [
        ("nccl", CustomAllReduceMode::Disabled),
        ("custom", CustomAllReduceMode::Auto),
    ] {
        let rows = on_gpus(n, mode, |rank, b| {
            let comm = b.communicator().expect("joined");
            let up = |v: Vec<f32>, shape: Vec<usize>| {
                b.upload(&HostTensor::new(shape, v)).expect("upload")
            };
            let mut out = Vec::new();
            for tokens in [1usize, 8, 16, 32, 64, 128, 256, 1024, 4096] {
                let mut x = up(rank_values(rank, tokens * hidden), vec![tokens, hidden]);
                let iters = if tokens <= 256 { 500 } else { 100 };
                let secs = time_calls(b, iters, || comm.all_reduce(&mut x).expect("all-reduce"));
                out.push(("allreduce", tokens, secs));
            }
            let w = up(random_bf16(200, 0, hidden), vec![hidden]);
            for tokens in [1usize, 8, 32] {
                let mut x = up(random_bf16(rank, 0, tokens * hidden), vec![tokens, hidden]);
                let mut r = up(random_bf16(100, 0, tokens * hidden), vec![tokens, hidden]);
                let secs = time_calls(b, 500, || {
                    b.all_reduce_add_rms_norm(&mut x, &mut r, &w, 1e-6)
                        .expect("all-reduce + norm")
                });
                out.push(("allreduce+norm", tokens, secs));
            }
            // One token's o_proj of Qwen3-8B at TP=4 (1024 -> 4096) with the sum and the
            // norm after it: the two kernels of `linear_all_reduce_add_rms_norm` where the
            // custom all-reduce runs, the gemv and NCCL's sum and the norm where not.
            let k = 1024;
            let x = up(random_bf16(rank, 1, k), vec![1, k]);
            let wo = up(random_bf16(300 + rank, 1, hidden * k), vec![hidden, k]);
            let mut r = up(random_bf16(100, 1, hidden), vec![1, hidden]);
            let secs = time_calls(b, 500, || {
                b.linear_all_reduce_add_rms_norm(&x, &wo, &mut r, &w, 1e-6)
                    .expect("gemv + all-reduce + norm");
            });
            out.push(("gemv+allreduce+norm", 1, secs));
            out
        });
        for (i, &(what, tokens, _)) in rows[0].iter().enumerate() {
            let secs = rows.iter().map(|r| r[i].2).fold(0.0, f64::max);
            let bytes = (tokens * hidden * 2) as f64;
            // nccl-tests' bus bandwidth of an all-reduce: bytes · 2(n-1)/n over the time.
            let busbw = bytes * 2.0 * (n - 1) as f64 / n as f64 / secs / 1e9;
            println!(
                "BENCH {what} kind={kind} ranks={n} tokens={tokens} bytes={bytes:.0} time={:.2}us busbw={busbw:.1}GB/s",
                secs * 1e6
            );
        }
    }
}
