//! Paged attention (prefill tiles and split decode) against the CPU's.

use super::*;

/// One attention scenario: sequences (context_len, query_len), GQA shape, block size.
fn attention_case(
    c: &Ctx,
    r: &mut Lcg,
    seqs: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
    bs: usize,
) {
    let sixteen_bit = c.dtype != DType::F32;
    attention_case_with(c, r, seqs, hq, hkv, d, bs, AttentionKernels::CUDA_CORE);
    let flash = AttentionKernels::flash(sixteen_bit);
    attention_case_with(c, r, seqs, hq, hkv, d, bs, flash);
}

#[allow(clippy::too_many_arguments)]
fn attention_case_with(
    c: &Ctx,
    r: &mut Lcg,
    seqs: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
    bs: usize,
    kernels: AttentionKernels,
) {
    let num_seqs = seqs.len();
    let max_len = seqs.iter().map(|(c, q)| c + q).max().unwrap();
    let max_blocks = max_len.div_ceil(bs);
    let num_blocks = max_blocks * num_seqs + 3;
    // Shuffled block ids for every sequence.
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.below(i + 1));
    }
    let block_tables: Vec<i32> = (0..num_seqs)
        .flat_map(|s| ids[s * max_blocks..(s + 1) * max_blocks].to_vec())
        .collect();
    let kv_row = hkv * d;
    let kc = c.round(&r.vec(num_blocks * bs * kv_row, 1.0));
    let vc = c.round(&r.vec(num_blocks * bs * kv_row, 1.0));
    let mut qsl = vec![0i32];
    let mut seq_lens = Vec::new();
    for &(ctx, q) in seqs {
        qsl.push(qsl.last().unwrap() + q as i32);
        seq_lens.push((ctx + q) as i32);
    }
    let t = *qsl.last().unwrap() as usize;
    let q = c.round(&r.vec(t * hq * d, 2.0));
    let shape = PagedAttentionShape {
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        max_blocks_per_seq: max_blocks,
    };
    let scale = 1.0 / (d as f32).sqrt();
    let mut want = vec![f32::NAN; t * hq * d];
    cpu::paged_attention(
        &q,
        &kc,
        &vc,
        &block_tables,
        &seq_lens,
        &qsl,
        &shape,
        scale,
        &mut want,
    );
    let plan = AttentionPlan::new(&qsl, &seq_lens, hq, hkv, c.ops.num_sms, kernels).unwrap();
    let case = AttentionCase {
        q: c.upload(&q),
        key_cache: c.upload(&kc),
        value_cache: c.upload(&vc),
        block_tables: c.ints(&block_tables),
        max_blocks_per_seq: max_blocks,
        seq_lens: c.ints(&seq_lens),
        query_start_loc: c.ints(&qsl),
        dims: AttentionDims {
            num_tokens: t,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            block_size: bs,
        },
        scale,
        what: format!("paged_attention seqs {seqs:?} hq {hq} hkv {hkv} d {d} bs {bs}"),
    };
    check_plan(c, &case, &plan, &want);
    // The decodes again with each kv head's group whole or split over other numbers of
    // blocks than the plan's.
    let group = hq / hkv;
    for split in [1, 2, 4, 8] {
        let other = split != plan.decode_q_split && group.is_multiple_of(split);
        if !plan.decode_seqs.is_empty() && other {
            let mut split_plan = plan.clone();
            split_plan.split_decode_group(group, split).unwrap();
            check_plan(c, &case, &split_plan, &want);
        }
    }
}

/// One attention scenario's inputs on the device, shared by every plan run over it.
struct AttentionCase {
    q: CudaSlice<u8>,
    key_cache: CudaSlice<u8>,
    value_cache: CudaSlice<u8>,
    block_tables: CudaSlice<i32>,
    max_blocks_per_seq: usize,
    seq_lens: CudaSlice<i32>,
    query_start_loc: CudaSlice<i32>,
    dims: AttentionDims,
    scale: f32,
    /// The scenario, for a failure's message.
    what: String,
}

/// Runs `plan` over `case` and checks the output against the CPU's `want`.
fn check_plan(c: &Ctx, case: &AttentionCase, plan: &AttentionPlan, want: &[f32]) {
    let meta = AttentionMeta {
        block_tables: &case.block_tables,
        max_blocks_per_seq: case.max_blocks_per_seq,
        seq_lens: &case.seq_lens,
        query_start_loc: &case.query_start_loc,
        tile_seq: &c.ints(&plan.tile_seq),
        tile_token: &c.ints(&plan.tile_token),
        decode_seqs: &c.ints(&plan.decode_seqs),
        step_dims: &c.ints(&plan.step_dims(case.max_blocks_per_seq)),
        plan,
    };
    let mut out = c.poisoned(want.len());
    c.ops
        .paged_attention(
            &case.q,
            &case.key_cache,
            &case.value_cache,
            &meta,
            case.dims,
            case.scale,
            &mut out,
        )
        .unwrap();
    let what = format!(
        "{} tiles {:?} splits {} decode partitions {}×{} q split {}",
        case.what,
        plan.tile_kernel,
        plan.num_splits,
        plan.decode_partitions,
        plan.decode_partition,
        plan.decode_q_split
    );
    // Outputs are convex combinations of V rows (|v| <= 1): an absolute bound.
    let t = match c.dtype {
        DType::F32 => Tol {
            abs: 2e-5,
            rel: 0.0,
        },
        dt => tol(dt, 2.0),
    };
    assert_close(&what, c.dtype, &c.download(&out, want.len()), want, t);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn paged_attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(8);
        // A mixed step: fresh prefill, chunk over a cached prefix crossing blocks,
        // decodes (one with a single key), a prefill longer than several tiles.
        let mixed = [(0, 37), (45, 20), (100, 1), (0, 1), (16, 16), (3, 70)];
        attention_case(&c, &mut r, &mixed, 16, 8, 128, 16); // Qwen3-0.6B's group
        attention_case(&c, &mut r, &mixed, 14, 2, 64, 16); // Qwen2.5-0.5B's group of 7
        attention_case(&c, &mut r, &mixed, 32, 8, 64, 16); // Llama 3.2 1B's group of 4
        attention_case(&c, &mut r, &mixed, 4, 2, 16, 4); // the tiny models
        attention_case(&c, &mut r, &mixed, 8, 8, 32, 5); // MHA, odd block size
                                                         // Long decodes of few sequences: the split (flash-decoding) path.
        attention_case(&c, &mut r, &[(3000, 1), (1234, 1)], 16, 8, 128, 16);
        attention_case(&c, &mut r, &[(4099, 1)], 32, 8, 64, 16);
        // Decodes only, as a padded graph batch has them: a single key beside long ones
        // (most partitions of the fixed grid lie past their sequence's end).
        attention_case(&c, &mut r, &[(0, 1), (2000, 1), (5, 1)], 16, 8, 128, 16);
        // A full decode batch of mixed lengths (two 512-key partitions, some sequences
        // ending in the first), and long prefills over cached prefixes (many key tiles,
        // the causal edge inside a tile).
        let batch: Vec<(usize, usize)> = (0..64).map(|i| (13 * i + i * i % 700, 1)).collect();
        attention_case(&c, &mut r, &batch, 16, 8, 128, 16);
        attention_case(
            &c,
            &mut r,
            &[(300, 200), (0, 129), (1000, 3)],
            16,
            8,
            128,
            16,
        );
        attention_case(&c, &mut r, &[(77, 150), (0, 65)], 14, 2, 64, 16);
        // A batch that fills the SMs several times: long single-partition decode blocks.
        let wide: Vec<(usize, usize)> = (0..140).map(|i| ((i * 97) % 1300 + 600, 1)).collect();
        attention_case(&c, &mut r, &wide, 8, 4, 64, 16);
        // The same at Qwen3-8B's heads: partitions of 1,024 keys, so that the sequences
        // that fit are written whole by their block and the longer ones are combined.
        attention_case(&c, &mut r, &wide, 32, 8, 128, 16);
        // Qwen3-8B's group of 4 and Llama-3.1-70B's of 8 at head size 128 (the decode
        // kernels' tuning variants exist there only): decodes of mixed lengths, split too.
        let decodes = [(600, 1), (0, 1), (1500, 1), (37, 1)];
        attention_case(&c, &mut r, &decodes, 32, 8, 128, 16);
        attention_case(&c, &mut r, &decodes, 64, 8, 128, 16);
        attention_case(&c, &mut r, &[(2500, 1)], 32, 8, 128, 16);
        // Batches of 8 and more at the group of 8 and Qwen3-14B's group of 5 (padded to 8)
        // take the kernel capped at four blocks an SM (`decode_four_blocks_an_sm`); the
        // forced rounds below also run the group of 8 split.
        attention_case(&c, &mut r, &batch[..12], 64, 8, 128, 16);
        attention_case(&c, &mut r, &batch, 40, 8, 128, 16);
        // One sequence short enough for batch 1's shortest partitions (32 keys), at groups
        // 4 and 8 and an odd block size.
        attention_case(&c, &mut r, &[(700, 1)], 32, 8, 128, 16);
        attention_case(&c, &mut r, &[(300, 1)], 64, 8, 128, 16);
        attention_case(&c, &mut r, &[(200, 1)], 8, 8, 32, 5);
        // A long decode beside a prefill at one kv head: hundreds of 32-key partitions
        // to combine, more than any fixed grid has.
        attention_case(&c, &mut r, &[(9000, 1), (0, 5)], 8, 1, 64, 16);
        // A group of 16: decodes fall back to tiles.
        attention_case(&c, &mut r, &[(50, 1), (10, 30)], 16, 1, 64, 16);
    }
}
