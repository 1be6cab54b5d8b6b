// A call's small copies between its arena's pinned host half and its device half, as a kernel
// rather than a copy-engine transfer (kernels/copy.py says when). The pinned buffers are
// mapped into the device's address space (unified addressing), so a kernel reads and writes
// them with their host pointers; for a few hundred KB this costs less than a memcpy node in
// a CUDA graph, whose copy engine takes several microseconds to start.
//
// dst[0, n) = src[0, n). Both 16-byte aligned (arena offsets are 256-aligned). grid: enough
// blocks of 256 threads for n / 16 lanes of 16 bytes, four per thread, at most COPY_BLOCKS;
// every thread has up to four loads in flight; the tail below 16 bytes by the first threads.
// A copy into host memory is fenced system-wide before the kernel ends, so the event after it
// sees every byte.
//
// Phase stamps (a call's H2D and D2H copies, in place of timing events; null: none): stamp is
// a CopyStamp in device memory, {~0, 0, 0} between launches, and out two u64 in mapped host
// memory. Each block's thread 0 takes %globaltimer as the block starts (atomicMin into first)
// and once every thread of the block has copied (atomicMax into last); the block that counts
// last writes (first, last) to out, fenced system-wide, and resets the CopyStamp for the next
// launch, so a launch that runs at all leaves it as it found it. The D2H copy's last (nonzero)
// is what the host polls for the call's end (server/cupy_calls.py, ``wait``): every block has
// fenced its output bytes before it counts, and first is fenced before last.
struct CopyStamp {
    unsigned long long first, last, done;
};

__device__ __forceinline__ unsigned long long copy_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void coli_copy(uint4 *__restrict__ dst, const uint4 *__restrict__ src,
                          CopyStamp *stamp, unsigned long long *out, long long n) {
    if (stamp != nullptr && threadIdx.x == 0) atomicMin(&stamp->first, copy_now());
    const long long n16 = n >> 4;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {  // four loads in flight per thread
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride],
                    d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    // At most three lanes of this thread are left. Their loads go out together: from pinned
    // host memory each load is a round trip over the link, and one after another three of
    // them (a call's 24 KB of x over 2 blocks) cost three.
    if (i < n16) {
        const bool h1 = i + stride < n16, h2 = i + 2 * stride < n16;
        const uint4 a = src[i];
        uint4 b, c;
        if (h1) b = src[i + stride];
        if (h2) c = src[i + 2 * stride];
        dst[i] = a;
        if (h1) dst[i + stride] = b;
        if (h2) dst[i + 2 * stride] = c;
    }
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < (n & 15)) {
        reinterpret_cast<unsigned char *>(dst)[n16 * 16 + t] =
            reinterpret_cast<const unsigned char *>(src)[n16 * 16 + t];
    }
    __threadfence_system();
    if (stamp == nullptr) return;
    __syncthreads();  // every thread of the block has copied
    if (threadIdx.x != 0) return;
    atomicMax(&stamp->last, copy_now());
    __threadfence();
    if (atomicAdd(&stamp->done, 1ull) != gridDim.x - 1) return;
    __threadfence();  // the last block: every block's first and last are in
    out[0] = atomicAdd(&stamp->first, 0ull);
    __threadfence_system();  // first before last: the host may read both once last is in
    out[1] = atomicAdd(&stamp->last, 0ull);
    stamp->first = ~0ull;
    stamp->last = 0;
    stamp->done = 0;
    __threadfence_system();
}
