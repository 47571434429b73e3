//! One decode-only attention shape (sequences, caches, block tables) and the step inputs
//! its plan reads, shared by the attention and layer benchmarks.

use super::*;

/// The step inputs an `AttentionPlan` reads, on the device.
pub(crate) struct PlanInputs {
    pub(crate) seq_lens: CudaSlice<i32>,
    pub(crate) query_start_loc: CudaSlice<i32>,
    pub(crate) tile_seq: CudaSlice<i32>,
    pub(crate) tile_token: CudaSlice<i32>,
    pub(crate) decode_seqs: CudaSlice<i32>,
    pub(crate) step_dims: CudaSlice<i32>,
    max_blocks_per_seq: usize,
}

impl PlanInputs {
    /// The inputs of `plan` over sequences of `seq_lens` keys whose query tokens start at
    /// `query_start_loc`, their block tables `max_blocks_per_seq` wide.
    pub(crate) fn new(
        dev: &CudaDevice,
        seq_lens: &[i32],
        query_start_loc: &[i32],
        max_blocks_per_seq: usize,
        plan: &AttentionPlan,
    ) -> Self {
        let ints = |v: &[i32]| dev.stream.clone_htod(v).expect("upload");
        Self {
            seq_lens: ints(seq_lens),
            query_start_loc: ints(query_start_loc),
            tile_seq: ints(&plan.tile_seq),
            tile_token: ints(&plan.tile_token),
            decode_seqs: ints(&plan.decode_seqs),
            step_dims: ints(&plan.step_dims(max_blocks_per_seq)),
            max_blocks_per_seq,
        }
    }

    /// The attention metadata of `plan` over the block tables `table`.
    pub(crate) fn meta<'a>(
        &'a self,
        table: &'a CudaSlice<i32>,
        plan: &'a AttentionPlan,
    ) -> AttentionMeta<'a> {
        AttentionMeta {
            block_tables: table,
            max_blocks_per_seq: self.max_blocks_per_seq,
            seq_lens: &self.seq_lens,
            query_start_loc: &self.query_start_loc,
            tile_seq: &self.tile_seq,
            tile_token: &self.tile_token,
            decode_seqs: &self.decode_seqs,
            step_dims: &self.step_dims,
            plan,
        }
    }
}

/// One decode-only attention shape for `decode_attention`: `copies` caches of `seqs`
/// sequences of `keys` keys each (blocks spread over the cache), so that the calls of a
/// small shape cycle through more bytes than the 50 MB L2 holds.
pub(crate) struct DecodeShape {
    pub(crate) seqs: usize,
    pub(crate) keys: usize,
    pub(crate) hq: usize,
    /// The kv heads the kernels are told of (`HKV` unless set): fewer read the same
    /// caches' rows at a shorter stride, the bytes a block reads unchanged. The copies are
    /// sized for `HKV`, so fewer heads cycle through fewer bytes: at 2 kv heads one
    /// sequence of 384 keys reads 25 MB over its 64 copies, within an H100's L2.
    pub(crate) hkv: usize,
    pub(crate) blocks_per_seq: usize,
    pub(crate) q: CudaSlice<u8>,
    pub(crate) key_cache: CudaSlice<u8>,
    pub(crate) value_cache: CudaSlice<u8>,
    /// One block table per copy of the cache.
    pub(crate) tables: Vec<CudaSlice<i32>>,
    pub(crate) seq_lens: Vec<i32>,
    pub(crate) qsl: Vec<i32>,
}

impl DecodeShape {
    /// Decode sequences of the given lengths.
    pub(crate) fn new(dev: &CudaDevice, seq_lens: Vec<i32>) -> Self {
        let (seqs, keys) = (
            seq_lens.len(),
            seq_lens.iter().copied().max().unwrap_or(1) as usize,
        );
        let blocks_per_seq = keys.div_ceil(BS);
        let per_copy = seqs * blocks_per_seq;
        let bytes = per_copy * BS * HKV * D * 2 * 2;
        let copies = ((256 << 20) / bytes).clamp(1, 64);
        let num_blocks = per_copy * copies;
        let kv = num_blocks * BS * HKV * D;
        let tables = (0..copies)
            .map(|c| {
                let t: Vec<i32> = (0..per_copy)
                    .map(|i| (c * per_copy + (i * 7919) % per_copy) as i32)
                    .collect();
                dev.stream.clone_htod(&t).expect("upload")
            })
            .collect();
        Self {
            seqs,
            keys,
            hq: 0,
            hkv: HKV,
            blocks_per_seq,
            q: random(dev, 1, 3),
            key_cache: random(dev, kv, 1),
            value_cache: random(dev, kv, 2),
            tables,
            seq_lens,
            qsl: (0..=seqs as i32).collect(),
        }
    }

    /// The model's q heads (over the same caches: both models have 8 kv heads of 128).
    pub(crate) fn set_q_heads(&mut self, dev: &CudaDevice, hq: usize) {
        self.hq = hq;
        self.q = random(dev, self.seqs * hq * D, 3);
    }

    /// The model's q and kv heads, as a tensor-parallel rank's (`hkv` at most `HKV`).
    pub(crate) fn set_heads(&mut self, dev: &CudaDevice, hq: usize, hkv: usize) {
        assert!(hkv <= HKV, "the caches hold {HKV} kv heads");
        self.set_q_heads(dev, hq);
        self.hkv = hkv;
    }

    /// K and V bytes one call reads.
    pub(crate) fn bytes(&self) -> f64 {
        let keys: i32 = self.seq_lens.iter().sum();
        (keys as usize * self.hkv * D * 2 * 2) as f64
    }

    /// The flash plan; `partition` replaces its keys per partition: at batch 1 the
    /// fixed grid keeps its partition count (a different `DEC_MIN_PARTITION`), at larger
    /// batches the keys are split over just enough partitions, with shared memory for
    /// that partition.
    pub(crate) fn plan(&self, ops: &CudaOps, partition: Option<usize>) -> AttentionPlan {
        let kernels = AttentionKernels::flash(true);
        let mut plan = AttentionPlan::new(
            &self.qsl,
            &self.seq_lens,
            self.hq,
            self.hkv,
            ops.num_sms,
            kernels,
        )
        .unwrap();
        if let Some(p) = partition {
            plan.decode_partition = p;
            if self.seqs > 1 {
                plan.decode_partitions = self.keys.div_ceil(p);
                plan.decode_smem_partition = p;
            } else {
                plan.decode_smem_partition = plan.decode_smem_partition.max(p);
            }
        }
        plan
    }

    /// The step inputs `plan` reads, on the device.
    pub(crate) fn upload(&self, dev: &CudaDevice, plan: &AttentionPlan) -> PlanInputs {
        PlanInputs::new(dev, &self.seq_lens, &self.qsl, self.blocks_per_seq, plan)
    }

    pub(crate) fn dims(&self) -> AttentionDims {
        AttentionDims {
            num_tokens: self.seqs,
            num_q_heads: self.hq,
            num_kv_heads: self.hkv,
            head_dim: D,
            block_size: BS,
        }
    }

    /// Mean seconds of one call with `plan` (in a CUDA graph, cycling over the copies),
    /// and the output of the last call.
    pub(crate) fn run(
        &self,
        dev: &CudaDevice,
        ops: &CudaOps,
        plan: &AttentionPlan,
    ) -> (f64, Vec<f32>) {
        let inputs = self.upload(dev, plan);
        let metas: Vec<AttentionMeta> =
            self.tables.iter().map(|bt| inputs.meta(bt, plan)).collect();
        let dims = self.dims();
        let mut out = ops.alloc(self.seqs * self.hq * D).unwrap();
        let mut i = 0;
        let iters = if self.seqs > 1 { 10 } else { 200 };
        let s = time_graph(dev, iters, || {
            i = (i + 1) % metas.len();
            let (k, v) = (&self.key_cache, &self.value_cache);
            ops.paged_attention(&self.q, k, v, &metas[i], dims, 0.088, &mut out)
                .unwrap()
        });
        // The output of copy 0, comparable across kernels (each copy holds other values).
        ops.paged_attention(
            &self.q,
            &self.key_cache,
            &self.value_cache,
            &metas[0],
            dims,
            0.088,
            &mut out,
        )
        .unwrap();
        let bytes = dev.stream.clone_dtoh(&*out).expect("download");
        (s, DType::BF16.decode(&bytes))
    }
}
