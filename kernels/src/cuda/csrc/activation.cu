// SiLU-and-mul over the fused gate/up output: out[t, j] = silu(x[t, j]) * x[t, d + j].
// silu is rounded to the dtype before the multiply, as PyTorch's `act(gate) * up`.

extern "C" __global__ void silu_and_mul(const scalar_t* __restrict__ x,
                                        scalar_t* __restrict__ out, long long rows, int d) {
    pdl_enter();
    const long long stride = (long long)gridDim.x * blockDim.x;
    // Whole 16-byte chunks of gate, up and out where the rows allow (the launch sizes the
    // grid for them, silu_and_mul in ops.rs); else one element a step.
    if (d % VEC16 == 0 && aligned16(x, out, out)) {
        const int dv = d / VEC16;
        const long long n = rows * dv;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            const long long r = i / dv;
            const int j = (int)(i - r * dv);
            const uint4* row = reinterpret_cast<const uint4*>(x + r * 2 * d);
            float g[VEC16], u[VEC16];
            unpack16(row[j], g);
            unpack16(row[dv + j], u);
#pragma unroll
            for (int e = 0; e < VEC16; e++) g[e] = silu_mul(g[e], u[e]);
            reinterpret_cast<uint4*>(out)[i] = pack16(g);
        }
        return;
    }
    const long long n = rows * d;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long r = i / d;
        const int j = (int)(i - r * d);
        const float g = to_f32(x[r * 2 * d + j]);
        const float u = to_f32(x[r * 2 * d + d + j]);
        out[i] = from_f32(silu_mul(g, u));
    }
}

// silu_and_mul after a gate/up projection of the raw residual `src` (a deferred norm,
// norm.cu): each gate and up value times the 1 / RMS of its `src` row, rounded to the
// dtype as the projection's output is, then silu_and_mul's arithmetic. One block a row;
// the row's scale is worked out before the wait (the residual is two kernels back).
extern "C" __global__ void silu_and_mul_rms(const scalar_t* __restrict__ x,
                                            const scalar_t* __restrict__ src,
                                            scalar_t* __restrict__ out, int d, int hidden,
                                            float eps) {
    const long long r = blockIdx.x;
    const float inv = row_inv_rms(src + r * hidden, hidden, eps);
    pdl_enter();
    const scalar_t* row = x + r * 2 * d;
    scalar_t* o = out + r * d;
    if (d % VEC16 == 0 && aligned16(x, out, out)) {
        const int dv = d / VEC16;
        for (int j = threadIdx.x; j < dv; j += blockDim.x) {
            float g[VEC16], u[VEC16];
            unpack16(reinterpret_cast<const uint4*>(row)[j], g);
            unpack16(reinterpret_cast<const uint4*>(row)[dv + j], u);
#pragma unroll
            for (int e = 0; e < VEC16; e++) g[e] = silu_mul(round_t(g[e] * inv), round_t(u[e] * inv));
            reinterpret_cast<uint4*>(o)[j] = pack16(g);
        }
        return;
    }
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float g = round_t(to_f32(row[j]) * inv), u = round_t(to_f32(row[d + j]) * inv);
        o[j] = from_f32(silu_mul(g, u));
    }
}
