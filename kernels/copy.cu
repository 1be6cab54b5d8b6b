// A call's small copies between its arena's pinned host half and its device half, as a kernel
// rather than a copy-engine transfer (kernels/copy.py says when). The pinned buffers are
// mapped into the device's address space (unified addressing), so a kernel reads and writes
// them with their host pointers; for a few hundred KB this costs less than a memcpy node in
// a CUDA graph, whose copy engine takes several microseconds to start.
//
// dst[0, n) = src[0, n). Both 16-byte aligned (arena offsets are 256-aligned). grid: enough
// blocks of 256 threads for n / 16 lanes of 16 bytes, at most COPY_BLOCKS; the tail below 16
// bytes by the first threads. A copy into host memory is fenced system-wide before the
// kernel ends, so the event after it sees every byte.
__global__ void coli_copy(uint4 *__restrict__ dst, const uint4 *__restrict__ src, long long n) {
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
    for (; i < n16; i += stride) dst[i] = src[i];
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < (n & 15)) {
        reinterpret_cast<unsigned char *>(dst)[n16 * 16 + t] =
            reinterpret_cast<const unsigned char *>(src)[n16 * 16 + t];
    }
    __threadfence_system();
}
