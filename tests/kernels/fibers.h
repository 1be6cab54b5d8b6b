// CUDA blocks on the CPU, for the tests that run a kernel's own source under g++
// (test_attention_cpu.py, test_attention_flash_cpu.py, test_gemv_stream_cpu.py,
// test_prefill_tc_cpu.py): one fiber (ucontext) per CUDA thread, run in turn until each reaches a
// barrier (the block's, a warp's, a named one, the cluster's) or yields in a wait loop; the CUDA
// types and built-ins those kernels use; a scheduler tick for asynchronous work (copies that land
// later); the warp's slot exchange and mma sums the stand-ins of warp-wide PTX are built on. Each
// test adds its stand-ins for the kernel's inline PTX. A run that stops making progress ends the
// program with status 3 (a deadlock).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>
#include <ucontext.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __shared__ static
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct dim3 { int x, y, z; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T __ldcg(const T *p) { return *p; }
inline void __threadfence() {}
inline void __nanosleep(unsigned) {}
inline int atomicAdd(int *p, int v) { const int o = *p; *p += v; return o; }
inline size_t __cvta_generic_to_shared(const void *p) { return (size_t)p; }
using std::max; using std::min;
dim3 gridDim, blockDim;
struct Bar {
    int need, arrived = 0;
    unsigned gen = 0;
    explicit Bar(int n) : need(n) {}
    void arrive_and_wait();
};
// A block: its barrier, the named barrier 1 (``named`` threads of launch), its shared memory.
struct Blk { Bar *bar, *named; float4 *smem; };
struct Warp { Bar *bar; unsigned u[32][8]; float f[32]; };
struct Fiber {
    Bar *wb = nullptr;  // the barrier it waits at, and that barrier's generation then
    unsigned wg = 0;
    ucontext_t ctx;
    std::vector<char> stack;
    bool done = false;
    dim3 tid, bid;
    Blk *blk;
    Warp *warp;
    std::function<void()> fn;
};
Fiber *cur;
ucontext_t sched_ctx;
long g_steps;  // fiber switches since the last progress (a barrier passed, async work done)
inline void yield_() { swapcontext(&cur->ctx, &sched_ctx); }
void Bar::arrive_and_wait() {
    const unsigned g = gen;
    g_steps = 0;
    if (++arrived == need) { arrived = 0; ++gen; return; }
    cur->wb = this; cur->wg = g;
    while (gen == g) yield_();
    cur->wb = nullptr;
}
#define threadIdx (cur->tid)
#define blockIdx (cur->bid)
#define tl_blk (cur->blk)
#define tl_warp (cur->warp)
Blk *g_blocks;
Bar *g_cbar;
// Called once per scheduler round: asynchronous work (returns whether it did any).
std::function<bool()> g_tick;
static void tramp() { cur->fn(); cur->done = true; swapcontext(&cur->ctx, &sched_ctx); }
inline float4 *cur_smem() { return tl_blk->smem; }
inline void __syncthreads() { tl_blk->bar->arrive_and_wait(); }
inline void __syncwarp() { tl_warp->bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int lane = threadIdx.x & 31;
    tl_warp->f[lane] = v;
    tl_warp->bar->arrive_and_wait();
    const float r = tl_warp->f[lane ^ o];
    tl_warp->bar->arrive_and_wait();
    return r;
}
// Lane src's value (__shfl_sync) and lane + d's (__shfl_down_sync: its own past lane 31),
// through the same slots.
inline float shfl_at(float v, int src) {
    const int lane = threadIdx.x & 31;
    tl_warp->f[lane] = v;
    tl_warp->bar->arrive_and_wait();
    const float r = tl_warp->f[src & 31];
    tl_warp->bar->arrive_and_wait();
    return r;
}
inline int __shfl_sync(unsigned, int v, int src) {
    float f;
    std::memcpy(&f, &v, 4);
    f = shfl_at(f, src);
    std::memcpy(&v, &f, 4);
    return v;
}
inline float __shfl_down_sync(unsigned, float v, int d) {
    const int lane = threadIdx.x & 31;
    return shfl_at(v, lane + d < 32 ? lane + d : lane);
}
inline int __all_sync(unsigned, int pred) {  // a vote through the warp's float slots
    const int lane = threadIdx.x & 31;
    tl_warp->f[lane] = pred ? 1.f : 0.f;
    tl_warp->bar->arrive_and_wait();
    int all = 1;
    for (int i = 0; i < 32; ++i) all &= tl_warp->f[i] != 0.f;
    tl_warp->bar->arrive_and_wait();
    return all;
}
inline int __shfl_xor_sync(unsigned m, int v, int o) {  // the float one's slots, bit for bit
    float f;
    std::memcpy(&f, &v, 4);
    f = __shfl_xor_sync(m, f, o);
    std::memcpy(&v, &f, 4);
    return v;
}
// The warp's lanes trade values through their slots (Warp::u), as the stand-ins of warp-wide
// instructions (mma, ldmatrix) do: this lane leaves the bytes at mine in its slot, the warp
// meets, read(u) reads any lane l's slot u[l], the warp meets again (the slots free for reuse).
template <class F> inline void warp_exchange(const void *mine, size_t bytes, F read) {
    Warp *w = tl_warp;
    std::memcpy(w->u[threadIdx.x & 31], mine, bytes);
    w->bar->arrive_and_wait();
    read(w->u);
    w->bar->arrive_and_wait();
}
// One mma.m16n8kK by the warp, each lane's registers a0..a3, b0, b1 (in) left in its slot: this
// lane's four sums s[e] over k < K of A(u, r, k) * B(u, k, n), its outputs' rows r = lane / 4
// + 8 (e / 2) and columns n = 2 (lane % 4) + e % 2, A and B reading an operand from the slots u
// by the instruction's fragment layout; summed in Acc from 0, the accumulator added by the caller.
template <int K, class Acc, class FA, class FB>
inline void warp_mma(Acc (&s)[4], const unsigned (&in)[6], FA A, FB B) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    warp_exchange(in, sizeof in, [&](const unsigned (*u)[8]) {
        for (int e = 0; e < 4; ++e) {
            const int r = gid + 8 * (e >> 1), n = 2 * t + (e & 1);
            Acc acc = 0;
            for (int k = 0; k < K; ++k) acc += A(u, r, k) * B(u, k, n);
            s[e] = acc;
        }
    });
}

// The kernel f on grid g, clusters of C blocks along x run together, nt threads per block,
// named: the thread count of named barrier 1 (0: none), smem4: float4s of shared memory.
template <class F>
void launch(dim3 g, int C, int nt, F f, int named = 0, size_t smem4 = 16384 + 64) {
    gridDim = g; blockDim = {nt, 1, 1};
    for (int z = 0; z < g.z; ++z)
    for (int y = 0; y < g.y; ++y)
    for (int x0 = 0; x0 < g.x; x0 += C) {
        std::vector<std::vector<float4>> mem(C, std::vector<float4>(smem4));
        std::vector<Blk> blocks(C);
        std::vector<Warp> warps(C * (nt / 32));
        std::vector<Bar> bars;
        bars.reserve(2 * C + C * (nt / 32));
        for (int r = 0; r < C; ++r) {
            bars.emplace_back(nt);
            Bar *b = &bars.back();
            bars.emplace_back(named ? named : nt);
            blocks[r] = {b, &bars.back(), mem[r].data()};
        }
        for (auto &w : warps) { bars.emplace_back(32); w.bar = &bars.back(); }
        Bar cbar(C * nt);
        g_blocks = blocks.data(); g_cbar = &cbar;
        std::vector<Fiber> fs(C * nt);
        for (int r = 0; r < C; ++r)
            for (int t = 0; t < nt; ++t) {
                Fiber &fb = fs[r * nt + t];
                fb.stack.resize(96 * 1024);
                fb.tid = {t, 0, 0}; fb.bid = {x0 + r, y, z};
                fb.blk = &blocks[r]; fb.warp = &warps[r * (nt / 32) + t / 32];
                fb.fn = f;
                getcontext(&fb.ctx);
                fb.ctx.uc_stack.ss_sp = fb.stack.data();
                fb.ctx.uc_stack.ss_size = fb.stack.size();
                fb.ctx.uc_link = nullptr;
                makecontext(&fb.ctx, tramp, 0);
            }
        g_steps = 0;
        for (bool alive = true; alive;) {
            alive = false;
            for (auto &fb : fs) {
                if (fb.done) continue;
                if (fb.wb && fb.wb->gen == fb.wg) { alive = true; continue; }
                cur = &fb;
                swapcontext(&sched_ctx, &fb.ctx);
                alive |= !fb.done;
                if (fb.done) g_steps = 0;
                if (++g_steps > 50000000L) {
                    std::printf("deadlock: block (%d, %d, %d) makes no progress\n", x0, y, z);
                    std::exit(3);
                }
            }
            if (g_tick && g_tick()) { g_steps = 0; alive = true; }
        }
    }
}
