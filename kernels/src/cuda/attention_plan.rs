//! Host-side plan of one paged-attention step: which sequences go to the decode kernel
//! (one query token; `csrc/attention_decode.cu`), how the other query tokens are grouped
//! into tiles (`csrc/attention_prefill.cu` on tensor cores for 16-bit dtypes, the CUDA-core
//! `csrc/attention.cu` for f32), and how keys are split over blocks when too few blocks
//! would fill the GPU.
//!
//! A step of decodes only gets a *fixed grid*: its partition count depends on the batch's
//! bucket ([`decode_bucket`]) alone, and only the keys per partition (read by the kernel
//! from device memory) follow the sequences' lengths. A CUDA graph captured for a bucket
//! therefore replays any such step, and the eager path runs the very same launches, so
//! `--enforce-eager` and graphs give identical results. Partitions past a sequence's end
//! exit at once; at least [`DEC_MIN_PARTITION`] keys per partition.

use anyhow::{ensure, Result};

/// Query rows per tile of the CUDA-core kernel (`ATT_ROWS` in attention.cu).
pub const ATT_ROWS: usize = 16;
/// Threads per CUDA-core attention block (`ATT_THREADS`).
pub const ATT_THREADS: u32 = 128;
/// A CUDA-core split covers a multiple of this many keys (`ATT_KEYS`).
pub const ATT_KEYS: usize = 32;
/// Query rows per tile of the tensor-core prefill kernel (`PF_ROWS`).
pub const PF_ROWS: usize = 64;
/// Threads per tensor-core prefill block (`PF_THREADS`).
pub const PF_THREADS: u32 = 128;
/// Threads per decode block (`DEC_THREADS`).
pub const DEC_THREADS: u32 = 128;
/// Widest GQA group the decode kernel handles (its `_g8` entry points).
pub const DEC_MAX_GROUP: usize = 8;
/// Warps of a decode block (`DEC_WARPS`).
pub const DEC_WARPS: usize = 4;
/// Keys per decode partition, the starting point (vLLM's 512).
pub const DEC_PARTITION: usize = 512;
/// The shortest decode partition. On an H100 a batch-1 decode of 384 keys (Qwen3-0.6B)
/// took 8.9 µs with attention and combine at 32 keys a partition, 10.9 at 64 and 15.1 at
/// 128 (`cuda_bench decode_attention`, docs/BENCHMARKS.md): at batch 1 more, shorter
/// partitions beat fewer blocks with a longer walk each.
pub const DEC_MIN_PARTITION: usize = 32;
/// The longest decode partition: when the batch fills the GPU several times over, longer
/// partitions save the partials and their combine.
pub const DEC_MAX_PARTITION: usize = 2048;
/// The fewest partitions of a fixed decode grid: they set its reach (the longest
/// sequence it covers, `DecodeGrid::max_keys`), so that a batch of long sequences keeps
/// its CUDA graph.
pub const DEC_MIN_GRID_PARTITIONS: usize = 4;
/// The most partitions of a fixed decode grid.
const DEC_MAX_GRID_PARTITIONS: usize = 64;
/// Dynamic shared memory a decode block may take: every group's longest partition under
/// it fills the SM as far as the kernel's registers allow, and is the one 48 KB gave
/// with 8-byte offsets (2,048 keys up to a group of 2, 1,024 at 4, 512 at 8).
const DEC_MAX_SHARED: usize = 36 * 1024;
/// The widest (padded) group whose decode blocks keep i32 slots (attention_decode.cu,
/// `KeySlots`).
const DEC_COMPACT_MAX_GROUP: usize = 2;
/// The fewest decode sequences (by their bucket, so that a graph and the eager step of
/// the same batch agree) for which blocks of 8 q heads (a group of 5 to 8, where
/// `decode_q_split` leaves it whole) at head size 128 run their kernel capped
/// at four blocks an SM (`_d128_g8_occ4`: 128 registers and a 32-byte stack, against 163
/// and three blocks). One layer of 64 q / 8 kv heads on an H100 (`cuda_bench
/// decode_attention_late`, µs, uncapped → capped): 192 × 947 keys 479 → 432, 32 × 1,617
/// 170 → 149, 8 × 1,699 62 → 45, but 4 × 1,318 24.6 → 27.7 and one sequence 3–6 % slower.
const DEC_G8_FOUR_BLOCKS_MIN_BUCKET: usize = 8;
/// The most (sequence, kv head) pairs of a bucket at which a group of 4 or 8 splits into
/// blocks of two q heads (`decode_q_split`).
const DEC_SPLIT_MAX_PAIRS: usize = 32;
/// Head sizes with a compiled kernel.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Which attention kernels a backend uses: `--attention-backend cuda-core` (the first,
/// CUDA-core kernel for every token) or `flash` (the decode kernel for one-token
/// sequences and the tensor-core prefill for the rest, where the dtype has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionKernels {
    pub decode: bool,
    pub tensor_core_prefill: bool,
}

impl AttentionKernels {
    pub const CUDA_CORE: Self = Self {
        decode: false,
        tensor_core_prefill: false,
    };

    /// The flash kernels; tensor cores only for 16-bit dtypes.
    pub const fn flash(sixteen_bit: bool) -> Self {
        Self {
            decode: true,
            tensor_core_prefill: sixteen_bit,
        }
    }
}

/// Which kernel runs the tiles (the query tokens not handled by the decode kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileKernel {
    /// `paged_attention_prefill_d*`: bf16/fp16 only, never split; warpgroup MMAs (`wgmma`)
    /// on sm_90a at head sizes 64 and 128, mma.m16n8k16 elsewhere.
    TensorCore,
    /// `paged_attention_d*`: f32 math on CUDA cores, split over keys when needed.
    CudaCore,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Sequence of each tile.
    pub tile_seq: Vec<i32>,
    /// First query token (batch index) of each tile.
    pub tile_token: Vec<i32>,
    pub tokens_per_tile: usize,
    pub tile_kernel: TileKernel,
    /// Key splits of the tiles (CUDA-core kernel only).
    pub num_splits: usize,
    /// Keys per split (a multiple of ATT_KEYS; i32::MAX when not split).
    pub split_keys: usize,
    /// Sequences with one query token, run by the decode kernel.
    pub decode_seqs: Vec<i32>,
    /// The q heads of a decode block (its kv head's GQA group over `decode_q_split`),
    /// rounded up to a power of two: which decode kernel runs.
    pub decode_group: usize,
    /// Decode blocks per kv head (a power of two), each taking an equal run of the
    /// group's q heads.
    pub decode_q_split: usize,
    /// Keys per decode partition, and partitions of the longest decode sequence (the
    /// grid's partition count, past the longest sequence for a fixed grid).
    pub decode_partition: usize,
    pub decode_partitions: usize,
    /// The partition the decode kernel's shared memory is sized for: `decode_partition`,
    /// or the largest partition of a fixed grid.
    pub decode_smem_partition: usize,
}

/// The batch sizes CUDA graphs are captured for, and the buckets of the fixed decode
/// grid: 1, 2, 4, 8, then every multiple of 8 (vLLM's ladder).
pub fn decode_bucket(num_seqs: usize) -> usize {
    if num_seqs <= 8 {
        num_seqs.max(1).next_power_of_two()
    } else {
        num_seqs.div_ceil(8) * 8
    }
}

/// The fixed decode grid of one bucket: `partitions` blocks per (sequence, kv head), each
/// covering at most `max_partition` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeGrid {
    pub partitions: usize,
    pub max_partition: usize,
    /// The bucket's sequences alone fill every SM several times, so each sequence runs
    /// in as few partitions as the grid allows (`partition_for`).
    pub whole_sequences: bool,
    /// Blocks a split step aims for (`partition_for`), per kv head.
    target_blocks_per_head: usize,
}

/// The shared memory of a split grid's blocks, in keys; such a grid also takes twice the
/// partitions that 2,048-key partitions would need, whatever its GQA group fits.
/// - With 8-byte key offsets (before the compact layout of attention_decode.cu's
///   `KeySlots`), a grid sized for 2,048 keys held 5–6 blocks an SM (36.9 KB each)
///   whatever partition a step took; at 1,024 keys (20 KB) the registers' 7 fit.
///   Qwen3-0.6B TPOT on an H100 (`bench latency`, 256 output tokens): batch 16 × 1,500
///   prompt tokens 2.59 -> 2.28 ms, 8 × 2,000 2.38 -> 2.15, 64 × 1,000 4.85 -> 4.75,
///   32 × 1,500 3.77 -> 3.80; 512 keys did no better.
/// - A group of 4 fits 1,024 keys at most; the doubled partitions let its short
///   partitions fill the SMs. Qwen3-8B TPOT: 8 × 2,000 9.06 -> 8.38 ms, 4 × 1,300 7.05 ->
///   6.73 (docs/BENCHMARKS.md, "Decode attention in the later steps").
const DEC_SPLIT_SMEM_PARTITION: usize = 1024;

/// Blocks a split step aims for, an SM: about what the three-pass kernel holds at once.
const DEC_TARGET_BLOCKS_PER_SM: usize = 6;

impl DecodeGrid {
    /// The grid of `bucket` sequences: enough partitions that the blocks fill the SMs
    /// twice, and at least `DEC_MIN_GRID_PARTITIONS`, each up to the longest partition
    /// whose shared memory fits without opting in (sized for the largest head). A grid
    /// that splits sequences takes twice those partitions where the cap allows, sized for
    /// at most `DEC_SPLIT_SMEM_PARTITION` keys. None when the GQA group is too wide for the
    /// decode kernel.
    pub fn for_bucket(
        bucket: usize,
        num_q_heads: usize,
        num_kv_heads: usize,
        num_sms: usize,
    ) -> Option<Self> {
        let group = num_q_heads / num_kv_heads.max(1);
        if group == 0 || group > DEC_MAX_GROUP {
            return None;
        }
        let padded_group = group.next_power_of_two();
        let max_head_dim = HEAD_DIMS[HEAD_DIMS.len() - 1];
        let mut max_partition = DEC_MAX_PARTITION;
        while decode_shared_bytes(max_partition, padded_group, max_head_dim) > DEC_MAX_SHARED {
            max_partition /= 2;
        }
        let (num_sms, num_kv_heads) = (num_sms.max(1), num_kv_heads.max(1));
        let blocks = bucket.max(1) * num_kv_heads;
        let mut partitions = (2 * num_sms)
            .div_ceil(blocks)
            .clamp(DEC_MIN_GRID_PARTITIONS, DEC_MAX_GRID_PARTITIONS);
        let whole_sequences = blocks >= 4 * num_sms;
        // Split grids: as many partitions as shared memory for DEC_MAX_PARTITION keys would
        // have given (a wider group fits fewer keys, and its grid no fewer partitions).
        let more = DEC_MAX_PARTITION / DEC_SPLIT_SMEM_PARTITION;
        if !whole_sequences && partitions * more <= DEC_MAX_GRID_PARTITIONS {
            partitions *= more;
            max_partition = max_partition.min(DEC_SPLIT_SMEM_PARTITION);
        }
        Some(Self {
            partitions,
            max_partition,
            whole_sequences,
            target_blocks_per_head: (DEC_TARGET_BLOCKS_PER_SM * num_sms).div_ceil(num_kv_heads),
        })
    }

    /// The longest sequence the grid covers.
    pub fn max_keys(&self) -> usize {
        self.partitions * self.max_partition
    }

    /// Keys per partition for `num_seqs` sequences, the longest of `max_keys`: a power of
    /// two from `DEC_MIN_PARTITION` up, None past the grid's reach. The partitions past a
    /// sequence's end exit at once.
    ///
    /// A grid of `whole_sequences` takes the longest partition: a sequence that fits in
    /// one is written by its block directly, and the combine passes over it. On an H100,
    /// 256 sequences of 100 to 1,023 keys (Qwen3-0.6B, `cuda_bench decode_attention`,
    /// blocks longest sequence first) took 204.1 µs in one partition of up to 1,024 keys
    /// against 213.8 µs in 4 of 256 with their combine; the Qwen3-8B shape 225.0 against
    /// 250.4 µs. (Before the grid started the longest sequences first, 4 of 256 won:
    /// 233.6 against 247.8 µs, as the step waited on long sequences that started last.)
    ///
    /// Otherwise the longest partition whose blocks still reach the target (about six an
    /// SM), else the shortest that covers the longest sequence: on an H100 8 sequences of
    /// 1,500-2,000 keys took 26.8 µs a layer in partitions of 256, against 33.0 in 512
    /// (`cuda_bench decode_attention_late`, Qwen3-0.6B).
    pub fn partition_for(&self, max_keys: usize, num_seqs: usize) -> Option<usize> {
        let shortest = max_keys
            .div_ceil(self.partitions)
            .max(DEC_MIN_PARTITION)
            .next_power_of_two();
        if shortest > self.max_partition {
            return None;
        }
        if self.whole_sequences {
            return Some(self.max_partition);
        }
        let blocks = |p: usize| num_seqs * max_keys.div_ceil(p);
        let mut p = self.max_partition;
        while p > shortest && blocks(p) < self.target_blocks_per_head {
            p /= 2;
        }
        Some(p)
    }
}

impl AttentionPlan {
    pub fn num_tiles(&self) -> usize {
        self.tile_seq.len()
    }

    /// The tensor-core tiles by the keys their last token sees, most first (ties in batch
    /// order): a causal prompt's tiles grow along it, and in prompt order each kv head's
    /// longest tiles started last, in the grid's last wave. The kernel places each output
    /// by its tile's sequence and token, so the order changes no value.
    fn order_tiles_longest_first(&mut self, query_start_loc: &[i32], seq_lens: &[i32]) {
        let tile_keys = |&(s, t): &(i32, i32)| {
            let (s, end) = (s as usize, query_start_loc[s as usize + 1]);
            let last = (t + self.tokens_per_tile as i32).min(end);
            seq_lens[s] - (end - last)
        };
        let mut tiles: Vec<(i32, i32)> = self
            .tile_seq
            .iter()
            .copied()
            .zip(self.tile_token.iter().copied())
            .collect();
        tiles.sort_by_key(|tile| std::cmp::Reverse(tile_keys(tile)));
        (self.tile_seq, self.tile_token) = tiles.into_iter().unzip();
    }

    /// Decode sequences, tiles and splits for one step with the given kernels.
    pub fn new(
        query_start_loc: &[i32],
        seq_lens: &[i32],
        num_q_heads: usize,
        num_kv_heads: usize,
        num_sms: usize,
        kernels: AttentionKernels,
    ) -> Result<Self> {
        ensure!(
            num_kv_heads > 0 && num_q_heads.is_multiple_of(num_kv_heads),
            "attention: {num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads"
        );
        let group = num_q_heads / num_kv_heads;
        let (tile_kernel, tile_rows) = if kernels.tensor_core_prefill {
            (TileKernel::TensorCore, PF_ROWS)
        } else {
            (TileKernel::CudaCore, ATT_ROWS)
        };
        ensure!(
            group <= tile_rows,
            "attention: GQA group of {group} q heads per kv head exceeds the kernel's {tile_rows}"
        );
        ensure!(
            query_start_loc.len() == seq_lens.len() + 1,
            "attention: query_start_loc has {} entries for {} sequences",
            query_start_loc.len(),
            seq_lens.len()
        );
        let decode_kernel = kernels.decode && group <= DEC_MAX_GROUP;
        let tokens_per_tile = (tile_rows / group).max(1);
        let mut plan = Self {
            tile_seq: Vec::new(),
            tile_token: Vec::new(),
            tokens_per_tile,
            tile_kernel,
            num_splits: 1,
            split_keys: i32::MAX as usize,
            decode_seqs: Vec::new(),
            decode_group: group.next_power_of_two(),
            decode_q_split: 1,
            decode_partition: DEC_PARTITION,
            decode_partitions: 0,
            decode_smem_partition: DEC_PARTITION,
        };
        let mut max_tile_keys = 0usize;
        let mut max_decode_keys = 0usize;
        for (s, w) in query_start_loc.windows(2).enumerate() {
            let (start, end) = (w[0], w[1]);
            ensure!(
                start <= end && end - start <= seq_lens[s],
                "attention: sequence {s} queries {} tokens of {}",
                end - start,
                seq_lens[s]
            );
            let keys = seq_lens[s].max(0) as usize;
            if decode_kernel && end - start == 1 {
                plan.decode_seqs.push(s as i32);
                max_decode_keys = max_decode_keys.max(keys);
                continue;
            }
            if end > start {
                max_tile_keys = max_tile_keys.max(keys);
            }
            let mut t = start;
            while t < end {
                plan.tile_seq.push(s as i32);
                plan.tile_token.push(t);
                t += tokens_per_tile as i32;
            }
        }
        // Longest first: the decode grid starts its blocks in this order (the sequence is
        // its slowest dimension), so a batch of mixed lengths does not end waiting on the
        // blocks of a long sequence that started last. The kernels place each output by
        // sequence, so the order changes no value.
        plan.decode_seqs
            .sort_by_key(|&s| std::cmp::Reverse(seq_lens[s as usize]));
        if tile_kernel == TileKernel::TensorCore {
            plan.order_tiles_longest_first(query_start_loc, seq_lens);
        }
        if tile_kernel == TileKernel::CudaCore {
            (plan.num_splits, plan.split_keys) =
                cuda_core_splits(plan.num_tiles() * num_kv_heads, max_tile_keys, num_sms);
        }
        if plan.decode_seqs.is_empty() {
            return Ok(plan);
        }
        let bucket = decode_bucket(plan.decode_seqs.len());
        plan.split_decode_group(group, decode_q_split(group, bucket, num_kv_heads))?;
        if plan.tile_seq.is_empty() {
            let grid = DecodeGrid::for_bucket(bucket, num_q_heads, num_kv_heads, num_sms);
            if let Some((grid, p)) = grid
                .and_then(|g| Some((g, g.partition_for(max_decode_keys, plan.decode_seqs.len())?)))
            {
                plan.decode_partition = p;
                plan.decode_partitions = grid.partitions;
                plan.decode_smem_partition = grid.max_partition;
                return Ok(plan);
            }
        }
        let blocks = plan.decode_seqs.len() * num_kv_heads * plan.decode_q_split;
        let mut partition = DEC_PARTITION;
        // Halve the partition while the blocks would leave SMs idle (few, long decodes).
        while partition > DEC_MIN_PARTITION
            && blocks * max_decode_keys.div_ceil(partition) < 2 * num_sms
            && max_decode_keys > partition
        {
            partition /= 2;
        }
        // Double it while the batch alone fills every SM several times (the largest
        // head size bounds the shared memory).
        let max_head_dim = HEAD_DIMS[HEAD_DIMS.len() - 1];
        while blocks >= 4 * num_sms
            && max_decode_keys > partition
            && partition < DEC_MAX_PARTITION
            && decode_shared_bytes(2 * partition, plan.decode_group, max_head_dim) <= DEC_MAX_SHARED
        {
            partition *= 2;
        }
        plan.decode_partition = partition;
        plan.decode_partitions = max_decode_keys.div_ceil(partition).max(1);
        plan.decode_smem_partition = partition;
        Ok(plan)
    }

    /// Dynamic shared memory of a decode block: the keys' cache offsets, the scores and
    /// the cross-warp reduction.
    pub fn decode_shared_bytes(&self, head_dim: usize) -> usize {
        decode_shared_bytes(self.decode_smem_partition, self.decode_group, head_dim)
    }

    /// Whether the decode kernel at `head_dim` is the group of 8's capped at four blocks an
    /// SM (built, and measured, at head size 128 only).
    pub fn decode_four_blocks_an_sm(&self, head_dim: usize) -> bool {
        self.decode_group == 8
            && head_dim == 128
            && decode_bucket(self.decode_seqs.len()) >= DEC_G8_FOUR_BLOCKS_MIN_BUCKET
    }

    /// Index of the decode kernel for `decode_group` (1, 2, 4, 8 → 0..3).
    pub fn decode_group_index(&self) -> usize {
        self.decode_group.trailing_zeros() as usize
    }

    /// The step's two i32s the attention kernels read from device memory
    /// (`AttentionMeta::step_dims`): the decode partition and the block tables' row width.
    pub fn step_dims(&self, max_blocks_per_seq: usize) -> [i32; 2] {
        [self.decode_partition as i32, max_blocks_per_seq as i32]
    }

    /// Runs each kv head's group of `group` q heads as `split` blocks of `group / split`
    /// (the kernel and its shared memory are those of the smaller group).
    pub fn split_decode_group(&mut self, group: usize, split: usize) -> Result<()> {
        ensure!(
            split.is_power_of_two() && group.is_multiple_of(split),
            "attention: a group of {group} q heads does not split into {split}"
        );
        self.decode_q_split = split;
        self.decode_group = (group / split).next_power_of_two();
        Ok(())
    }
}

/// Decode blocks per kv head for a GQA group of `group` q heads at `bucket` sequences:
/// while the bucket has at most `DEC_SPLIT_MAX_PAIRS` (sequence, kv head) pairs, a group of
/// 4 or 8 runs as blocks of two q heads. There a block's latency, not the bytes, sets the
/// kernel's time, and a block of fewer heads runs shorter (fewer registers, fewer dots a
/// key); the second read of the keys mostly hits L2, a kv head's blocks being neighbours
/// in the grid. Chosen by the bucket, so that a graph and the eager step of a batch agree.
///
/// On an H100 (`cuda_bench decode_attention_q_split`, one layer, µs, whole → split;
/// docs/BENCHMARKS.md): the 70B's TP=4 rank (16 q / 2 kv heads) 1 × 384 keys 8.99 →
/// 5.94, 8 × 1,892 23.7 → 20.8; Qwen3-8B 1 × 384 7.57 → 6.70, 4 × 1,758 17.3 → 15.0; a
/// group of 8 over 8 kv heads 1 × 384 10.39 → 7.57. In the model, TP=4 on four H100s: the
/// 70B shape 14.06 → 13.83 ms a token, 19.48 against 20.17 at 8 × 1,000-token prompts;
/// Qwen3-8B 2.10 → 2.07.
///
/// Past that the kernel bench still gains at up to 64 sequences, but the model does not:
/// Qwen3-8B's TPOT at 8–64 × 1,000-token prompts was 2–5 % longer split, and the 70B
/// rank's even at 32 and 64 (blocks of 4). A group of 2 (Qwen3-0.6B) stays whole: split
/// it gained 0.4 µs at 1 × 384, nothing at 1 × 1,000 (TPOT 0.98 → 1.00 ms at 1,000-token
/// prompts), and lost 3–8 % from 8 sequences. Groups that are not powers of two stay
/// whole.
fn decode_q_split(group: usize, bucket: usize, num_kv_heads: usize) -> usize {
    match group {
        4 | 8 if bucket * num_kv_heads <= DEC_SPLIT_MAX_PAIRS => group / 2,
        _ => 1,
    }
}

fn decode_shared_bytes(partition: usize, group: usize, head_dim: usize) -> usize {
    let (scores, sums) = (group * partition, DEC_WARPS * group * head_dim);
    if group <= DEC_COMPACT_MAX_GROUP {
        // i32 slots, then the scores, whose memory the cross-warp sum reuses.
        partition * 4 + scores.max(sums) * 4
    } else {
        partition * 8 + (scores + sums) * 4
    }
}

/// Splits of the CUDA-core kernel: used when the tiles times the kv heads leave the SMs
/// idle and the sequences are long.
fn cuda_core_splits(blocks: usize, max_keys: usize, num_sms: usize) -> (usize, usize) {
    let target_blocks = 2 * num_sms.max(1);
    if blocks >= target_blocks || max_keys <= 512 {
        return (1, i32::MAX as usize);
    }
    let want = target_blocks
        .div_ceil(blocks.max(1))
        .min(max_keys.div_ceil(256))
        .clamp(1, 64);
    let split_keys = max_keys.div_ceil(want).div_ceil(ATT_KEYS) * ATT_KEYS;
    (max_keys.div_ceil(split_keys), split_keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLASH: AttentionKernels = AttentionKernels::flash(true);
    const FLASH_F32: AttentionKernels = AttentionKernels::flash(false);

    #[test]
    fn tiles_cover_every_prefill_token_once_and_decodes_go_to_the_decode_kernel() {
        // group 2 → 8 tokens per CUDA-core tile; sequences of 20, 1 and 8 query tokens.
        let p = AttentionPlan::new(&[0, 20, 21, 29], &[20, 5, 40], 16, 8, 132, FLASH_F32).unwrap();
        assert_eq!(p.tokens_per_tile, 8);
        assert_eq!(p.tile_seq, vec![0, 0, 0, 2]);
        assert_eq!(p.tile_token, vec![0, 8, 16, 21]);
        assert_eq!(p.decode_seqs, vec![1]);
        assert_eq!(p.num_splits, 1);
        let p = AttentionPlan::new(&[0, 20, 21, 29], &[20, 5, 40], 16, 8, 132, FLASH).unwrap();
        assert_eq!(p.tile_kernel, TileKernel::TensorCore);
        assert_eq!(p.tokens_per_tile, 32);
        // Longest first (`tensor_core_tiles_run_longest_first`): 40 keys, then 20.
        assert_eq!(p.tile_seq, vec![2, 0]);
        assert_eq!(p.tile_token, vec![21, 0]);
        // The CUDA-core kernels take every token, the decode too.
        let kernels = AttentionKernels::CUDA_CORE;
        let p = AttentionPlan::new(&[0, 20, 21, 29], &[20, 5, 40], 16, 8, 132, kernels).unwrap();
        assert_eq!(p.tile_seq, vec![0, 0, 0, 1, 2]);
        assert!(p.decode_seqs.is_empty());
    }

    #[test]
    fn decode_sequences_run_longest_first_and_prefills_keep_their_order() {
        // Decodes 0, 2, 3, 5 of 7, 300, 300 and 90 keys; 1 and 4 are prefills.
        let qsl = [0, 1, 5, 6, 7, 10, 11];
        let lens = [7, 4, 300, 300, 3, 90];
        let p = AttentionPlan::new(&qsl, &lens, 16, 8, 132, FLASH).unwrap();
        // Ties keep the batch order (a stable sort).
        assert_eq!(p.decode_seqs, vec![2, 3, 5, 0]);
        assert_eq!(p.tile_seq, vec![1, 4]);
    }

    #[test]
    fn tensor_core_tiles_run_longest_first() {
        // Group 2: 32 tokens a tile. A prompt of 70 tokens after 10 cached (tiles of 42, 74
        // and 80 keys) and a fresh one of 40 (32 and 40 keys); ties keep the batch order.
        let p = AttentionPlan::new(&[0, 70, 110], &[80, 40], 16, 8, 132, FLASH).unwrap();
        assert_eq!(p.tile_seq, vec![0, 0, 0, 1, 1]);
        assert_eq!(p.tile_token, vec![64, 32, 0, 102, 70]);
        // The CUDA-core tiles keep their order (their splits are planned over it).
        let p = AttentionPlan::new(&[0, 70, 110], &[80, 40], 16, 8, 132, FLASH_F32).unwrap();
        assert_eq!(p.tile_token[..3], [0, 8, 16]);
    }

    /// query_start_loc of `decodes` one-token sequences, then one prefill of 4 tokens.
    fn decodes_and_a_prefill(decodes: usize) -> Vec<i32> {
        let mut qsl: Vec<i32> = (0..=decodes as i32).collect();
        qsl.push(decodes as i32 + 4);
        qsl
    }

    #[test]
    fn long_decode_of_few_sequences_gets_small_partitions() {
        // Beside a prefill the decode partition follows the lengths.
        let p =
            AttentionPlan::new(&decodes_and_a_prefill(1), &[8000, 4], 16, 8, 132, FLASH).unwrap();
        assert_eq!(p.decode_seqs, vec![0]);
        assert!(p.decode_partition < DEC_PARTITION);
        assert_eq!(p.decode_partitions, 8000usize.div_ceil(p.decode_partition));
        assert_eq!(p.decode_smem_partition, p.decode_partition);
        // At one kv head (its group of 8 in four blocks), more partitions than any fixed
        // grid has (`cuda_kernels paged_attention_matches_cpu` runs this step).
        let p = AttentionPlan::new(&[0, 1, 6], &[9001, 5], 8, 1, 132, FLASH).unwrap();
        assert_eq!(p.decode_q_split, 4);
        assert_eq!((p.decode_partition, p.decode_partitions), (128, 71));
        // A batch that fills every SM several times runs each sequence in one block.
        let qsl = decodes_and_a_prefill(256);
        let lens = |n: i32| [vec![n; 256], vec![4]].concat();
        let p = AttentionPlan::new(&qsl, &lens(900), 16, 8, 132, FLASH).unwrap();
        assert_eq!((p.decode_partition, p.decode_partitions), (1024, 1));
        // ... up to DEC_MAX_PARTITION keys.
        let p = AttentionPlan::new(&qsl, &lens(9000), 16, 8, 132, FLASH).unwrap();
        assert_eq!(p.decode_partition, DEC_MAX_PARTITION);
        // A batch that fills the SMs only about once keeps vLLM's 512.
        let qsl = decodes_and_a_prefill(40);
        let lens = [vec![900; 40], vec![4]].concat();
        let p = AttentionPlan::new(&qsl, &lens, 16, 8, 132, FLASH).unwrap();
        assert_eq!((p.decode_partition, p.decode_partitions), (512, 2));
    }

    #[test]
    fn a_decode_only_step_gets_the_fixed_grid_of_its_bucket() {
        assert_eq!(
            [1, 2, 3, 5, 8, 9, 17, 256].map(decode_bucket),
            [1, 2, 4, 8, 8, 16, 24, 256]
        );
        let grid = DecodeGrid::for_bucket(1, 16, 8, 132).unwrap();
        assert_eq!(grid.partitions, 33); // 8 kv heads × 33 ≥ 2 × 132 SMs
                                         // The grid depends on the bucket only; the partition follows the longest sequence.
        for (n, len) in [(1usize, 8000), (1, 100), (1, 1)] {
            let qsl: Vec<i32> = (0..=n as i32).collect();
            let p = AttentionPlan::new(&qsl, &vec![len; n], 16, 8, 132, FLASH).unwrap();
            assert_eq!(p.decode_partitions, grid.partitions, "len {len}");
            assert_eq!(p.decode_smem_partition, grid.max_partition);
            assert!(p.decode_partition * p.decode_partitions >= len as usize);
            assert!(p.decode_partition >= DEC_MIN_PARTITION);
            assert!(p.decode_partition.is_power_of_two());
        }
        // 3 sequences share bucket 4's grid with 4 sequences.
        let three = AttentionPlan::new(&[0, 1, 2, 3], &[50, 700, 9], 16, 8, 132, FLASH).unwrap();
        let four =
            AttentionPlan::new(&[0, 1, 2, 3, 4], &[50, 700, 9, 1], 16, 8, 132, FLASH).unwrap();
        assert_eq!(
            (three.decode_partition, three.decode_partitions),
            (four.decode_partition, four.decode_partitions)
        );
        // A batch that fills the GPU many times runs each sequence in one partition of
        // the longest kind, while the grid's DEC_MIN_GRID_PARTITIONS keep its reach.
        let qsl: Vec<i32> = (0..=256).collect();
        let grid = DecodeGrid::for_bucket(256, 16, 8, 132).unwrap();
        assert!(grid.whole_sequences);
        assert_eq!(grid.partitions, DEC_MIN_GRID_PARTITIONS);
        assert_eq!(grid.max_keys(), DEC_MIN_GRID_PARTITIONS * DEC_MAX_PARTITION);
        let lens: Vec<i32> = (0..256).map(|i| 100 + (i * 379) % 924).collect();
        let p = AttentionPlan::new(&qsl, &lens, 16, 8, 132, FLASH).unwrap();
        assert_eq!(
            (p.decode_partitions, p.decode_partition),
            (4, DEC_MAX_PARTITION)
        );
        // Qwen3-8B's group of 4 takes more shared memory a key: partitions of 1,024.
        let p = AttentionPlan::new(&qsl, &lens, 32, 8, 132, FLASH).unwrap();
        assert_eq!((p.decode_partitions, p.decode_partition), (4, 1024));
        // Small buckets split a sequence to fill the SMs.
        assert!(
            !DecodeGrid::for_bucket(32, 16, 8, 132)
                .unwrap()
                .whole_sequences
        );
        // Past the grid's reach the partition follows the lengths again.
        let long = grid.max_keys() as i32 + 1;
        let p = AttentionPlan::new(&qsl, &[long; 256], 16, 8, 132, FLASH).unwrap();
        assert!(p.decode_partitions * p.decode_partition >= long as usize);
        assert_eq!(p.decode_smem_partition, p.decode_partition);
    }

    #[test]
    fn split_grids_keep_their_reach_in_smaller_partitions_chosen_by_blocks() {
        // Qwen3-0.6B (16 q / 8 kv heads) on 132 SMs. Batch 1 has no partitions to spare
        // (33, twice is past 64): as before. Batch 2's 17 of 2,048 become 34 of 1,024.
        let one = DecodeGrid::for_bucket(1, 16, 8, 132).unwrap();
        assert_eq!((one.partitions, one.max_partition), (33, DEC_MAX_PARTITION));
        let two = DecodeGrid::for_bucket(2, 16, 8, 132).unwrap();
        assert_eq!((two.partitions, two.max_partition), (34, 1024));
        // Bucket 8: 5 partitions of 2,048 became 10 of 1,024, the same reach.
        let eight = DecodeGrid::for_bucket(8, 16, 8, 132).unwrap();
        assert_eq!((eight.partitions, eight.max_partition), (10, 1024));
        assert_eq!(eight.max_keys(), 5 * DEC_MAX_PARTITION);
        // 8 × 1,699 keys: 512 would give 32 blocks a kv head, short of the 99 aimed for
        // (6 × 132 SMs / 8); 256 is the shortest that 10 partitions cover.
        assert_eq!(eight.partition_for(1699, 8), Some(256));
        // 32 sequences: 1,024 gives 64 blocks a head, 512 gives 128.
        let thirty_two = DecodeGrid::for_bucket(32, 16, 8, 132).unwrap();
        assert_eq!((thirty_two.partitions, thirty_two.max_partition), (8, 1024));
        assert_eq!(thirty_two.partition_for(1756, 32), Some(512));
        // 64 sequences reach the target at 1,024.
        let sixty_four = DecodeGrid::for_bucket(64, 16, 8, 132).unwrap();
        assert_eq!(sixty_four.partition_for(1256, 64), Some(1024));
        // Short sequences split until their blocks reach the target: 100 keys in 2 of 64.
        assert_eq!(sixty_four.partition_for(100, 64), Some(64));
        assert_eq!(
            sixty_four.partition_for(sixty_four.max_keys() + 1, 64),
            None
        );
        // Qwen3-8B's group of 4 fits 1,024 keys of shared memory at most: its split grids
        // double their partitions all the same (bucket 8: 5 of 1,024 became 10), so that
        // 8 × 1,699 keys take 256 a partition, not 512.
        let wide = DecodeGrid::for_bucket(8, 32, 8, 132).unwrap();
        assert_eq!((wide.partitions, wide.max_partition), (10, 1024));
        assert_eq!(wide.partition_for(1699, 8), Some(256));
        // Whole-sequence grids are as they were.
        let whole = DecodeGrid::for_bucket(256, 16, 8, 132).unwrap();
        assert_eq!(
            (whole.partitions, whole.max_partition),
            (4, DEC_MAX_PARTITION)
        );
        assert_eq!(whole.partition_for(700, 256), Some(DEC_MAX_PARTITION));
    }

    #[test]
    fn a_short_decode_fills_a_few_partitions_of_the_fixed_grid() {
        // Batch 1 of Qwen3-0.6B: 33 partitions per kv head, for sequences up to 33 × 2048
        // keys; a 384-key sequence takes 12 of DEC_MIN_PARTITION keys, the rest exit.
        let grid = DecodeGrid::for_bucket(1, 16, 8, 132).unwrap();
        assert_eq!(grid.partition_for(384, 1), Some(DEC_MIN_PARTITION));
        assert_eq!(grid.partition_for(1, 1), Some(DEC_MIN_PARTITION));
        assert_eq!(grid.partition_for(33 * 128, 1), Some(128));
        assert_eq!(grid.partition_for(33 * 128 + 1, 1), Some(256));
        assert_eq!(
            grid.partition_for(grid.max_keys(), 1),
            Some(grid.max_partition)
        );
        assert_eq!(grid.partition_for(grid.max_keys() + 1, 1), None);
        let p = AttentionPlan::new(&[0, 1], &[384], 16, 8, 132, FLASH).unwrap();
        assert_eq!((p.decode_partitions, p.decode_partition), (33, 32));
        assert_eq!(384usize.div_ceil(p.decode_partition), 12);
        // Beside a prefill (no fixed grid) a short sequence takes one partition, and a
        // long one is halved until its blocks fill the GPU twice (8 × 63 of 128 keys).
        let qsl = decodes_and_a_prefill(1);
        let p = AttentionPlan::new(&qsl, &[384, 4], 16, 8, 132, FLASH).unwrap();
        assert_eq!(p.decode_partitions, 1);
        let p = AttentionPlan::new(&qsl, &[8000, 4], 16, 8, 132, FLASH).unwrap();
        assert_eq!(p.decode_partition, 128);
    }

    #[test]
    fn decode_kernels_are_picked_by_padded_group_within_shared_memory() {
        let qsl: Vec<i32> = (0..=256).collect();
        for (hq, hkv, group) in [(16, 16, 1), (16, 8, 2), (14, 2, 8), (32, 8, 4), (32, 4, 8)] {
            let p = AttentionPlan::new(&qsl, &[9000; 256], hq, hkv, 132, FLASH).unwrap();
            assert_eq!(p.decode_group, group, "{hq}/{hkv}");
            assert_eq!(1 << p.decode_group_index(), group);
            for d in HEAD_DIMS {
                assert!(
                    p.decode_shared_bytes(d) <= DEC_MAX_SHARED,
                    "{hq}/{hkv} d {d}"
                );
            }
        }
    }

    #[test]
    fn blocks_of_eight_q_heads_take_the_capped_kernel_from_a_bucket_of_8() {
        let plan = |seqs: usize, hq| {
            let qsl: Vec<i32> = (0..=seqs as i32).collect();
            AttentionPlan::new(&qsl, &vec![1500; seqs], hq, 8, 132, FLASH).unwrap()
        };
        // Qwen3-14B's group of 5, padded to 8: five sequences pad to the bucket of 8, as
        // their graph does; four stay uncapped.
        assert!(!plan(4, 40).decode_four_blocks_an_sm(128));
        assert!(plan(5, 40).decode_four_blocks_an_sm(128));
        // No capped kernel at d64.
        assert!(!plan(200, 40).decode_four_blocks_an_sm(64));
        // A group of 8 runs in blocks of 2 q heads up to 4 sequences of 8 kv heads, then
        // whole, capped from the bucket of 8.
        assert!(!plan(4, 64).decode_four_blocks_an_sm(128));
        assert!(plan(5, 64).decode_four_blocks_an_sm(128));
        assert!(!plan(200, 32).decode_four_blocks_an_sm(128)); // a group of 4
    }

    #[test]
    fn groups_split_over_blocks_of_fewer_q_heads_at_small_buckets() {
        let split = |seqs: usize, hq, hkv| {
            let qsl: Vec<i32> = (0..=seqs as i32).collect();
            let p = AttentionPlan::new(&qsl, &vec![700; seqs], hq, hkv, 132, FLASH).unwrap();
            (p.decode_q_split, p.decode_group)
        };
        // Qwen3-0.6B's group of 2 stays whole.
        assert_eq!(split(1, 16, 8), (1, 2));
        // Qwen3-8B and Llama-3.1-8B: blocks of 2 while the bucket has at most 32
        // (sequence, kv head) pairs; at a TP=4 rank's 2 kv heads up to 16 sequences.
        assert_eq!(split(4, 32, 8), (2, 2));
        assert_eq!(split(5, 32, 8), (1, 4));
        assert_eq!(split(16, 8, 2), (2, 2));
        assert_eq!(split(17, 8, 2), (1, 4));
        // Llama-3.1-70B's TP=4 rank: blocks of 2 up to 16 sequences.
        assert_eq!(split(1, 16, 2), (4, 2));
        assert_eq!(split(16, 16, 2), (4, 2));
        assert_eq!(split(17, 16, 2), (1, 8));
        // Groups that are not powers of two stay whole (Qwen2.5-7B's 7, Qwen3-14B's 5).
        assert_eq!(split(1, 28, 4), (1, 8));
        assert_eq!(split(1, 40, 8), (1, 8));
        // A mixed step splits by its decodes' bucket too.
        let p = AttentionPlan::new(&[0, 1, 6], &[900, 5], 16, 2, 132, FLASH).unwrap();
        assert_eq!((p.decode_q_split, p.decode_group), (4, 2));
    }

    #[test]
    fn wide_groups_fall_back_to_tiles() {
        // A group of 16 is too wide for the decode kernel: its decodes become tiles.
        let p = AttentionPlan::new(&[0, 1], &[100], 16, 1, 132, FLASH).unwrap();
        assert!(p.decode_seqs.is_empty());
        assert_eq!(p.num_tiles(), 1);
        assert!(AttentionPlan::new(&[0, 1], &[1], 32, 1, 1, FLASH_F32).is_err());
    }

    #[test]
    fn long_cuda_core_prefill_of_few_tiles_is_split() {
        let p =
            AttentionPlan::new(&[0, 2], &[8000], 16, 8, 132, AttentionKernels::CUDA_CORE).unwrap();
        assert!(p.num_splits > 1);
        assert_eq!(p.split_keys % ATT_KEYS, 0);
        assert!(p.num_splits * p.split_keys >= 8000);
    }
}
