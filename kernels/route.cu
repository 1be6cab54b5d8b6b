// The two ends of a routed expert group (``expert_group_routed``): the packed rows each expert
// reads, and the per-token weighted sum of the experts' outputs. Both are pure data movement
// next to the expert kernels, one launch each.

// xp[p, :] = x[src[p], :] for packed rows p < n. grid (ceil(d / (4 * 256)), n), block 256.
__global__ void route_gather(float *__restrict__ xp, const float *__restrict__ x,
                             const int *__restrict__ src, int d) {
    const int p = blockIdx.y;
    const float *xr = x + (size_t)src[p] * d;
    float *o = xp + (size_t)p * d;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if ((d & 3) == 0) {
        if (c < d) *reinterpret_cast<float4 *>(o + c) = *reinterpret_cast<const float4 *>(xr + c);
        return;
    }
    for (int j = c; j < min(c + 4, d); ++j) o[j] = xr[j];
}

// y[t, :] = sum over j < k, in order, of w[t, j] * yp[pos[t * k + j], :]: the same bits on
// every call. grid (ceil(d / 256), t), block 256.
__global__ void route_combine(float *__restrict__ y, const float *__restrict__ yp,
                              const int *__restrict__ pos, const float *__restrict__ w, int k,
                              int d) {
    const int t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    float acc = 0.f;
    for (int j = 0; j < k; ++j)
        acc = fmaf(w[t * k + j], yp[(size_t)pos[t * k + j] * d + c], acc);
    y[(size_t)t * d + c] = acc;
}
