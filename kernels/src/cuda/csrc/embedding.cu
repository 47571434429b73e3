// Embedding gather: out[t] = table[ids[t] - vocab_start], zeros for ids outside the shard
// (tensor-parallel vocabulary shards; the all-reduce fills them in). One block per token.

extern "C" __global__ void embedding(const int* __restrict__ ids,
                                     const scalar_t* __restrict__ table,
                                     scalar_t* __restrict__ out, int hidden, int vocab_start,
                                     int shard_rows) {
    pdl_enter();
    const long long t = blockIdx.x;
    const int row = ids[t] - vocab_start;
    const bool inside = row >= 0 && row < shard_rows;
    const scalar_t* src = table + (long long)(inside ? row : 0) * hidden;
    scalar_t* dst = out + t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = inside ? src[i] : from_f32(0.f);
    }
}
