// reshape_and_cache: each new token's K and V row ([num_kv_heads * head_dim]) goes to its
// slot of the paged cache [num_blocks * block_size, kv_row]; negative slots are padding.
// One block per token.

extern "C" __global__ void reshape_and_cache(const scalar_t* __restrict__ key,
                                             const scalar_t* __restrict__ value,
                                             scalar_t* __restrict__ key_cache,
                                             scalar_t* __restrict__ value_cache,
                                             const int* __restrict__ slot_mapping, int kv_row) {
    pdl_enter();
    const long long t = blockIdx.x;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const scalar_t* ks = key + t * kv_row;
    const scalar_t* vs = value + t * kv_row;
    scalar_t* kd = key_cache + (long long)slot * kv_row;
    scalar_t* vd = value_cache + (long long)slot * kv_row;
    for (int i = threadIdx.x; i < kv_row; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}
