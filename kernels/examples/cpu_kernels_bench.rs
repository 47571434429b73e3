//! Times the fast CPU kernels on the shapes of one SmolLM2-135M forward pass (30 layers,
//! hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49,152): the GEMMs of a
//! decode step (m = 1) and of a prefill (m = `--m`), and the attention of both.
//!
//! `cargo run --release -p vllm-kernels --example cpu_kernels_bench -- [--m 512]
//! [--threads N] [--isa avx512|avx2|scalar] [--dtype f32|bf16|f16]`

use std::time::Instant;

use vllm_kernels::cpu::attention::PagedAttentionShape;
use vllm_kernels::cpu::fast::{attention, matmul, Isa, PackedMatrix, ThreadPool};
use vllm_kernels::cuda::DType;

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const MLP: usize = 1536;
const VOCAB: usize = 49152;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn weight(rows: usize, cols: usize, dtype: DType, seed: usize, isa: Isa) -> PackedMatrix {
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| (((i + seed) * 2_654_435_761) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let layout = matmul::bf16_layout_for(isa);
    PackedMatrix::from_le_bytes(
        &DType::F32.encode(&w),
        DType::F32,
        dtype,
        rows,
        cols,
        layout,
    )
}

/// Best of `reps` runs of `f`, in seconds.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let m: usize = arg("--m").map_or(512, |v| v.parse().expect("--m"));
    let threads: usize = arg("--threads")
        .map_or_else(vllm_kernels::cpu::fast::default_threads, |v| {
            v.parse().expect("--threads")
        });
    let isa = arg("--isa").map_or_else(Isa::detect, |v| Isa::from_name(&v).expect("--isa"));
    let dtype = match arg("--dtype").as_deref().unwrap_or("bf16") {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => panic!("--dtype {other}"),
    };
    let pool = ThreadPool::new(threads);
    println!("isa {isa:?}, {threads} threads, weights {dtype:?}, prefill m = {m}");

    // One layer's weights per layer, so that a decode step streams all of them from memory.
    let layers: Vec<[PackedMatrix; 4]> = (0..LAYERS)
        .map(|l| {
            [
                weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, dtype, 4 * l, isa),
                weight(HIDDEN, HEADS * HEAD_DIM, dtype, 4 * l + 1, isa),
                weight(2 * MLP, HIDDEN, dtype, 4 * l + 2, isa),
                weight(HIDDEN, MLP, dtype, 4 * l + 3, isa),
            ]
        })
        .collect();
    let lm_head = weight(VOCAB, HIDDEN, dtype, 999, isa);
    let bytes: usize = layers
        .iter()
        .flatten()
        .map(PackedMatrix::bytes)
        .sum::<usize>()
        + lm_head.bytes();

    let (pool, layers) = (&pool, &layers);
    let forward = |rows: usize| {
        let x = vec![0.01f32; rows * MLP];
        let mut y = vec![0f32; rows * 2 * MLP];
        move || {
            for [qkv, o, gate_up, down] in layers {
                matmul::linear(
                    &x[..rows * HIDDEN],
                    rows,
                    qkv,
                    None,
                    &mut y[..rows * qkv.rows()],
                    pool,
                    isa,
                );
                matmul::linear(
                    &x[..rows * HIDDEN],
                    rows,
                    o,
                    None,
                    &mut y[..rows * HIDDEN],
                    pool,
                    isa,
                );
                matmul::linear_silu_and_mul(
                    &x[..rows * HIDDEN],
                    rows,
                    gate_up,
                    &mut y[..rows * MLP],
                    pool,
                    isa,
                );
                matmul::linear(
                    &x[..rows * MLP],
                    rows,
                    down,
                    None,
                    &mut y[..rows * HIDDEN],
                    pool,
                    isa,
                );
            }
        }
    };
    let mut lm_out = vec![0f32; VOCAB];
    let x1 = vec![0.01f32; HIDDEN];
    let t_head = time(10, || {
        matmul::linear(&x1, 1, &lm_head, None, &mut lm_out, pool, isa)
    });
    let t_decode = time(10, forward(1)) + t_head;
    println!(
        "decode GEMMs (30 layers + LM head): {:.2} ms, {:.1} GB/s over {:.0} MB (LM head {:.2} ms)",
        t_decode * 1e3,
        bytes as f64 / t_decode / 1e9,
        bytes as f64 / 1e6,
        t_head * 1e3
    );
    let t_prefill = time(2, forward(m));
    let flops = 2.0 * m as f64 * (bytes - lm_head.bytes()) as f64 / dtype.size() as f64;
    println!(
        "prefill GEMMs, m = {m}: {:.1} ms, {:.1} GFLOP/s, {:.0} tok/s",
        t_prefill * 1e3,
        flops / t_prefill / 1e9,
        m as f64 / t_prefill
    );

    // Attention of all layers: a decode token at context `m`, and a prefill of `m` tokens.
    let block_size = 16;
    let blocks = m.div_ceil(block_size) + 1;
    let kv = blocks * block_size * KV_HEADS * HEAD_DIM;
    let kc: Vec<f32> = (0..kv).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
    let vc = kc.clone();
    let tables: Vec<i32> = (0..blocks as i32).collect();
    let shape = PagedAttentionShape {
        num_q_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size,
        max_blocks_per_seq: blocks,
    };
    let row = HEADS * HEAD_DIM;
    let q = vec![0.05f32; m * row];
    let mut out = vec![0f32; m * row];
    let t_att_decode = time(10, || {
        for _ in 0..LAYERS {
            attention::paged_attention(
                &q[..row],
                &kc,
                &vc,
                &tables,
                &[m as i32],
                &[0, 1],
                &shape,
                0.125,
                &mut out[..row],
                pool,
                isa,
            );
        }
    });
    let t_att_prefill = time(2, || {
        for _ in 0..LAYERS {
            attention::paged_attention(
                &q,
                &kc,
                &vc,
                &tables,
                &[m as i32],
                &[0, m as i32],
                &shape,
                0.125,
                &mut out,
                pool,
                isa,
            );
        }
    });
    println!(
        "attention, 30 layers: decode at context {m}: {:.2} ms; prefill of {m}: {:.1} ms",
        t_att_decode * 1e3,
        t_att_prefill * 1e3
    );
}
