// Neox rotary embedding (rotate halves) of q and k in place, from the cos/sin table
// [max_position, rotary_dim] (cos half then sin half; llama3 scaling is already in the
// table's frequencies). One block per token. Each product is rounded to the activation
// dtype before the sum, as HF's `q * cos + rotate_half(q) * sin` on bf16 tensors does
// (a no-op in the f32 build).

__device__ __forceinline__ void rotate_pair(scalar_t* head, int j, int half, float c, float s) {
    const float a = to_f32(head[j]), b = to_f32(head[j + half]);
    head[j] = from_f32(round_t(a * c) + round_t(-b * s));
    head[j + half] = from_f32(round_t(b * c) + round_t(a * s));
}

extern "C" __global__ void rotary_embedding_neox(const int* __restrict__ positions,
                                                 scalar_t* __restrict__ q,
                                                 scalar_t* __restrict__ k,
                                                 const scalar_t* __restrict__ cos_sin,
                                                 int num_q_heads, int num_k_heads,
                                                 int head_dim, int rotary_dim) {
    pdl_enter();
    const long long t = blockIdx.x;
    const scalar_t* cs = cos_sin + (long long)positions[t] * rotary_dim;
    const int half = rotary_dim / 2;
    const int total = (num_q_heads + num_k_heads) * half;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int h = i / half, j = i - h * half;
        scalar_t* head = h < num_q_heads
                             ? q + (t * num_q_heads + h) * head_dim
                             : k + (t * num_k_heads + (h - num_q_heads)) * head_dim;
        rotate_pair(head, j, half, to_f32(cs[j]), to_f32(cs[half + j]));
    }
}
