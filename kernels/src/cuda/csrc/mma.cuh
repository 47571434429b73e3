// Tensor-core building blocks of the bf16 and fp16 builds: `mma.m16n8k16` with f32
// accumulation, `ldmatrix` fragments from shared memory, and `cp.async` copies into it.

#if !defined(VLLM_DTYPE_F32)

// c[16x8] += a[16x16] · b[16x8]: a is row-major (four registers of two elements), b is
// column-major (two registers), c four f32 (PTX ISA, "mma.m16n8k16").
#if defined(VLLM_DTYPE_F16)
#define MMA_AB_TYPE "f16"
#else
#define MMA_AB_TYPE "bf16"
#endif
__device__ __forceinline__ void mma_16816(float* c, const unsigned int* a, unsigned int b0,
                                          unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB_TYPE "." MMA_AB_TYPE
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 matrices of 16-bit elements: lane l gives the shared address (`smem_addr`) of
// row l % 8 of matrix l / 8, and receives in r[i] its fragment of matrix i (row l / 4,
// elements 2(l % 4), +1). A shared address, not a generic pointer: a loop's loads are
// then one base register plus constant offsets.
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The same with each matrix transposed: lane l receives elements (2(l % 4), l / 4) and
// (2(l % 4) + 1, l / 4) of matrix i, the B fragment of a row-major [k][n] tile.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes from global to shared memory without a register round trip; `src_bytes` of 0
// fills the destination with zeros (rows past the end of a matrix).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

// 16 bytes to a shared address (`smem_addr`), all of them read.
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

#endif
