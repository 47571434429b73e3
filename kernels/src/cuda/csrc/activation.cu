// SiLU-and-mul over the fused gate/up output: out[t, j] = silu(x[t, j]) * x[t, d + j].
// silu is rounded to the dtype before the multiply, as PyTorch's `act(gate) * up`.

extern "C" __global__ void silu_and_mul(const scalar_t* __restrict__ x,
                                        scalar_t* __restrict__ out, long long rows, int d) {
    pdl_enter();
    const long long n = rows * d;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / d;
        const int j = (int)(i - r * d);
        const float g = to_f32(x[r * 2 * d + j]);
        const float u = to_f32(x[r * 2 * d + d + j]);
        out[i] = from_f32(round_t(g / (1.f + expf(-g))) * u);
    }
}
