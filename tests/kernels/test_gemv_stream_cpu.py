"""gemv_st (gemv_stream.cuh) on the CPU, no GPU needed (CI runs it): its CUDA source under g++
through fibers.h (one fiber per CUDA thread), with its inline PTX replaced by models: the
mbarriers (arrivals, transaction bytes, phases), bulk copies that land a scheduler round or
more after they are issued (a stage read before its bytes arrive, or refilled while it is
read, gives wrong sums), named barrier 1, and the tensor-core pieces of tc.cuh (bf16 rounding,
prmt, the nibble magic, mma.m16n8k16 by the PTX manual's fragment layout with the sum in
float64). Ragged job tables, shared and separate activations, K ending inside a 1024-byte
piece, rings smaller than a block's stages, plain and DUAL (gate and up: silu(gate) * up)
jobs, fmt 2 (per-row scales) and fmt 4 (grouped scales streamed beside the weights), against
float64: every output written, nothing else touched, within 1e-5. The GPU tests
of the same kernel: ``test_gemv_splitk.py`` and ``test_expert_group.py``."""

from __future__ import annotations

import shutil

import pytest
from _emulate import build_and_run, without_ptx

from coliworker.kernels import sources

_ASM = ("tc_bf16", "tc_nib2", "tc_quad", "tc_mma", "tc_mma_q8", "st_smem", "st_prmt",
        "st_bar_init", "st_arrive", "st_arrive_tx", "st_wait", "st_copy",
        "st_math_sync")  # fmt: skip

_SHIM = r"""
#include "fibers.h"
#include <map>
#include "tc_models.h"
inline unsigned st_prmt(unsigned a, unsigned b, unsigned sel) { return prmt(a, b, sel); }
// The mbarriers and the bulk-copy engine.
struct MBar { int count = 0, pending = 0; long tx = 0; unsigned phase = 0; };
std::map<const void *, MBar> g_mbar;
struct Copy { void *dst; const void *src; unsigned n; unsigned long long *bar; long round; };
std::vector<Copy> g_copies;
long g_round;
std::mt19937 g_lag(7);
inline void mb_check(MBar &m) {
    if (m.pending == 0 && m.tx == 0) { ++m.phase; m.pending = m.count; }
}
inline void st_bar_init(unsigned long long *b, unsigned count) {
    MBar &m = g_mbar[b]; m = MBar{}; m.count = m.pending = (int)count;
}
inline void st_arrive(unsigned long long *b) {
    MBar &m = g_mbar.at(b);
    if (--m.pending < 0) { std::printf("mbarrier: more arrivals than its count\n"); std::exit(4); }
    mb_check(m);
}
inline void st_arrive_tx(unsigned long long *b, unsigned bytes) {
    g_mbar.at(b).tx += bytes;
    st_arrive(b);
}
inline void st_wait(unsigned long long *b, unsigned parity) {
    while ((g_mbar.at(b).phase & 1u) == parity) yield_();
}
inline void st_copy(void *dst, const void *src, unsigned n, unsigned long long *b) {
    if (n % 16 || (size_t)dst % 16 || (size_t)src % 16) {
        std::printf("bulk copy: size or address not a multiple of 16\n");
        std::exit(4);
    }
    g_copies.push_back({dst, src, n, b, g_round + 1 + (long)(g_lag() % 3)});
}
template <int MW> inline void st_math_sync() { tl_blk->named->arrive_and_wait(); }
bool land() {  // copies whose round has come, in random order
    ++g_round;
    bool any = false;
    std::shuffle(g_copies.begin(), g_copies.end(), g_lag);
    for (size_t i = 0; i < g_copies.size();) {
        Copy &c = g_copies[i];
        if (c.round > g_round) { ++i; continue; }
        std::memcpy(c.dst, c.src, c.n);
        MBar &m = g_mbar.at(c.bar);
        m.tx -= c.n;
        mb_check(m);
        g_copies[i] = g_copies.back(); g_copies.pop_back();
        any = true;
    }
    return any;
}
#include "kernel.inc"


// Jobs of out_rows[j] rows and rows[j] activation rows (same_x: all jobs read one x), K inputs;
// DUAL: each job an expert's gate (w0, s0) and up (w1, s1), y = silu(gate x) * (up x).
// FMT 4: grouped scales of gs (a power of two), ngp = in_padded / gs per row.
template <int SB, bool DUAL, int FMT = 2, int MW = 8, bool Q8 = false>
int check(std::vector<int> outs, std::vector<int> rows, int K, bool same_x, int grid, int ns,
          int gs = 0, int pc = 1024) {
    constexpr int M = DUAL ? 2 : 1;
    std::mt19937 rng(K * 13 + grid + ns + M + gs);
    std::normal_distribution<float> nd;
    const int nj = (int)outs.size(), inp = (K + 1023) / 1024 * 1024, ld = inp / 2;
    const int ngp = FMT == 4 ? inp / gs : 1, shift = FMT == 4 ? __builtin_ctz(gs) : 2;
    const int max_out = *std::max_element(outs.begin(), outs.end());
    const int max_rows = *std::max_element(rows.begin(), rows.end());
    const int ntr = (max_out + 15) / 16, nz = (max_rows + SB - 1) / SB, pad = 3;
    std::vector<std::vector<unsigned char>> w(nj * M);
    std::vector<std::vector<float>> sc(nj * M), x(nj), y(nj);
    std::vector<GemvJob> jobs(nj);
    for (int j = 0; j < nj; ++j) {
        for (int m = 0; m < M; ++m) {
            w[j * M + m].resize((size_t)outs[j] * ld + 16);
            for (auto &b : w[j * M + m]) b = rng() & 255;
            sc[j * M + m].resize((size_t)outs[j] * ngp);
            for (auto &s : sc[j * M + m]) s = 0.001f + 0.01f * std::fabs(nd(rng));
        }
        x[j].resize((size_t)rows[j] * (K + pad));
        for (auto &v : x[j]) v = nd(rng);
        y[j].assign((size_t)rows[j] * (outs[j] + pad), NAN);
        if (same_x && rows[j] > rows[0]) return 1;  // one x: no job with more rows than it
        const float *xp = same_x ? x[0].data() : x[j].data();
        auto at = [](const auto &v) { return (unsigned long long)v.data(); };
        jobs[j] = {at(w[j * M]), at(sc[j * M]), DUAL ? at(w[j * M + 1]) : 0,
                   DUAL ? at(sc[j * M + 1]) : 0, (unsigned long long)xp, at(y[j]), rows[j],
                   outs[j], K + pad, outs[j] + pad};
    }
    g_tick = land;
    launch({grid, 1, 1}, 1, (MW + 1) * 32, [&] {
        gemv_st<FMT, SB, DUAL, MW, Q8>(jobs.data(), nj, ntr, nz, K, inp, ld, ngp,
                                       FMT == 4 ? gs : 4, shift, ns, pc); }, MW * 32);
    g_tick = nullptr;
    if (!g_copies.empty()) { std::printf("copies never landed\n"); return 1; }
    double md = 0, mx = 0;
    long unwritten = 0, touched = 0;
    for (int j = 0; j < nj; ++j) {
        const float *xp = same_x ? x[0].data() : x[j].data();
        for (int s = 0; s < rows[j]; ++s)
            for (int o = 0; o < outs[j] + pad; ++o) {
                const float got = y[j][(size_t)s * (outs[j] + pad) + o];
                if (o >= outs[j]) { touched += !std::isnan(got); continue; }
                double v[M];
                for (int m = 0; m < M; ++m) {
                    v[m] = 0;
                    const float *srow = &sc[j * M + m][(size_t)o * ngp];
                    for (int e = 0; e < K; ++e)
                        v[m] += (double)code(&w[j * M + m][(size_t)o * ld], e) *
                                xp[(size_t)s * (K + pad) + e] * (FMT == 4 ? srow[e / gs] : 1.f);
                    if (FMT == 2) v[m] *= srow[0];
                }
                const double ref = DUAL ? v[0] / (1 + std::exp(-v[0])) * v[M - 1] : v[0];
                if (std::isnan(got)) { ++unwritten; continue; }
                md = std::max(md, std::fabs(got - ref)); mx = std::max(mx, std::fabs(ref));
            }
    }
    std::printf("fmt %d gs %d SB %d DUAL %d MW %d Q8 %d K %d jobs %d grid %d ns %d piece %d: "
                "rel err %.2g, unwritten %ld, touched %ld\n", FMT, gs, SB, (int)DUAL, MW,
                (int)Q8, K, nj, grid, ns, pc, md / mx, unwritten, touched);
    return unwritten > 0 || touched > 0 || !(md <= 1e-5 * mx);
}

int main() {
    // ragged tables (the 3rd tile of a 17-row job skipped), K ending in a 512-byte piece,
    // one shared x, SB 4 with 3 and 4 rows, one piece per tile, more blocks than some jobs
    // have tiles, and rings of 3 stages refilled with whole 1024-byte pieces while other
    // stages are read (a stage released before its last step is read gives wrong sums); DUAL
    // (gate and up) likewise, one shared x as a routed token's experts have; fmt 4 with group
    // sizes 16 to 256 (a 512-byte last piece: 1024 / gs scales per row); 512-byte pieces;
    // 16 math warps (one step of each 1024-byte piece each; in a 512-byte last piece, half of
    // them idle but still release the stage)
    return check<1, false>({40, 17}, {1, 1}, 3000, false, 2, 3) +
           check<1, false>({33, 16, 5}, {1, 1, 1}, 700, true, 3, 4) +
           check<4, false>({20, 48}, {3, 4}, 2100, false, 3, 3) +
           check<1, false>({7}, {3}, 1030, false, 1, 6) +
           check<4, false>({64}, {4}, 5000, false, 5, 3) +
           check<1, false>({64, 48}, {1, 1}, 4096, false, 2, 3) +
           check<4, false>({40, 9}, {4, 2}, 4000, false, 1, 3) +
           check<1, true>({48, 20, 33}, {1, 1, 1}, 4096, true, 3, 3) +
           check<4, true>({32, 17}, {2, 4}, 3000, false, 2, 3) +
           check<1, false, 4>({40, 17}, {1, 1}, 3000, false, 2, 3, 64) +
           check<4, false, 4>({33}, {3}, 4096, false, 2, 3, 16) +
           check<1, true, 4>({48, 20}, {1, 1}, 2100, true, 2, 3, 256) +
           check<4, true, 4>({32, 9}, {4, 2}, 4096, false, 1, 3, 128) +
           check<4, true>({40, 17}, {4, 3}, 3000, true, 2, 3, 0, 512) +
           check<4, true, 4>({32}, {4}, 4096, false, 1, 3, 256, 512) +
           check<1, false, 4>({20}, {1}, 2100, false, 1, 4, 64, 512) +
           check<1, false, 2, 16>({40, 17}, {1, 1}, 3000, false, 2, 3) +
           check<4, false, 2, 16>({20, 48}, {3, 4}, 2100, false, 3, 3) +
           check<1, true, 2, 16>({48, 20, 33}, {1, 1, 1}, 4096, true, 3, 3) +
           check<4, true, 4, 16>({32, 9}, {4, 2}, 4096, false, 1, 3, 128) +
           check<1, false, 4, 16>({33}, {1}, 4096, false, 2, 4, 16) +
           // Q8 (fmt 2): the same tables, rings and row counts on the integer path
           check<1, false, 2, 8, true>({40, 17}, {1, 1}, 3000, false, 2, 3) +
           check<1, false, 2, 8, true>({33, 16, 5}, {1, 1, 1}, 700, true, 3, 4) +
           check<4, false, 2, 8, true>({20, 48}, {3, 4}, 2100, false, 3, 3) +
           check<1, true, 2, 8, true>({48, 20, 33}, {1, 1, 1}, 4096, true, 3, 3) +
           check<4, true, 2, 8, true>({40, 17}, {4, 3}, 3000, true, 2, 3, 0, 512) +
           check<1, false, 2, 16, true>({40, 17}, {1, 1}, 3000, false, 2, 3) +
           check<4, true, 2, 16, true>({32, 17}, {2, 4}, 3000, false, 2, 3) +
           // Q8 fmt 4 (group sizes 32 to 256: pairs of steps per mma)
           check<1, false, 4, 8, true>({40, 17}, {1, 1}, 3000, false, 2, 3, 64) +
           check<4, false, 4, 8, true>({33}, {3}, 4096, false, 2, 3, 32) +
           check<1, true, 4, 8, true>({48, 20}, {1, 1}, 2100, true, 2, 3, 256) +
           check<4, true, 4, 8, true>({32, 9}, {4, 2}, 4096, false, 1, 3, 128) +
           check<4, true, 4, 8, true>({32}, {4}, 4096, false, 1, 3, 256, 512) +
           check<1, false, 4, 8, true>({20}, {1}, 2100, false, 1, 4, 64, 512) +
           check<1, false, 4, 16, true>({33}, {1}, 4096, false, 2, 4, 32);
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_gemv_st_on_cpu(tmp_path):
    build_and_run(tmp_path, _SHIM, without_ptx(sources.source("gemv_tc.cu"), _ASM), 600)


@pytest.fixture
def stream_host(host_module, monkeypatch):
    """kernels/gemv_stream.py's pure host functions where CuPy is absent, STREAM on, and
    kernels/matmul.py (its WeightSpec)."""
    st, mm = host_module("gemv_stream"), host_module("matmul")
    monkeypatch.setattr(st, "STREAM", True)
    return st, mm


@pytest.mark.parametrize(
    "fmt,gs,k,rows,dual,warps,blocks,want",
    [
        (2, 0, 16384, 1, False, 8, 1, (1, 6, 1024, 8)),  # o_proj: x of 16384 beside 6 stages
        (2, 0, 6144, 1, True, 8, 1, (1, 5, 1024, 8)),  # a decode token's gate and up
        (2, 0, 6144, 4, True, 8, 1, (4, 3, 512, 8)),  # 4 rows: x takes 12 columns, 512 B pieces
        (4, 64, 6144, 4, True, 8, 1, (4, 3, 512, 8)),
        (4, 128, 2048, 1, False, 8, 1, (1, 6, 1024, 8)),  # a down projection
        (4, 48, 6144, 1, False, 8, 1, None),  # group size not a power of two
        (4, 512, 6144, 1, False, 8, 1, None),  # a piece's scales under 16 bytes
        (2, 0, 16384, 4, False, 8, 1, None),  # x of 4 rows x 16384 does not fit
        (1, 0, 6144, 1, False, 8, 1, None),  # int8: not on this path
        (2, 0, 6144, 5, False, 8, 1, None),  # more rows than decode
        (2, 0, 6144, 1, False, 16, 1, (1, 6, 1024, 16)),  # dense: 16 warps, 16 partials
        (2, 0, 6144, 1, False, 8, 2, (1, 4, 1024, 8)),  # two blocks: half the SM each
        (2, 0, 6144, 1, True, 16, 2, (1, 3, 512, 8)),  # gate and up: 512 B pieces, 8 warps
        (2, 0, 2048, 1, False, 16, 2, (1, 5, 1024, 16)),  # a down projection
        (4, 64, 6144, 1, False, 16, 2, (1, 3, 1024, 16)),
        (2, 0, 16384, 1, False, 16, 2, None),  # o_proj's x: over half an SM with 3 stages
        (2, 0, 6144, 4, True, 8, 2, None),  # x of 4 rows and 3 stages: over half an SM
    ],
)
def test_stream_geometry(stream_host, monkeypatch, fmt, gs, k, rows, dual, warps, blocks, want):
    """Where gemv_st serves a shape, and its SB, ring stages, piece size and math warps
    (ST_WARPS where pieces are 1024 bytes, 8 with 512) at ST_BLOCKS blocks per SM: each
    block's shared memory fits one block (227 KiB) and its share of the SM's, less the 1 KiB
    each reserves, with at least ST_STAGES[1] stages."""
    st, mm = stream_host
    monkeypatch.setattr(st, "ST_WARPS", warps)
    monkeypatch.setattr(st, "ST_BLOCKS", blocks)
    spec = mm.WeightSpec.of(fmt, k, gs)
    assert st.stream_eligible(spec, rows, dual) == (want is not None)
    if want is None:
        return
    sb, ns, pc, smem, mw = st._st_geometry(spec, rows, dual)
    assert (sb, ns, pc, mw) == want
    assert smem <= 227 * 1024 and ns >= st.ST_STAGES[1]
    assert blocks * (smem + 1024) <= st.ST_SMEM_SM
    partials = 4 * (2 if dual else 1) * mw * 16 * 8 * ((3 * sb + 7) // 8)
    assert smem >= ns * st._st_stage(spec, dual, pc) + partials + 6 * sb * spec.layout.in_padded


@pytest.mark.parametrize(
    "fmt,gs,k,rows,dual,taken",
    [
        (2, 0, 6144, 4, False, True),  # dense S=4: measured faster
        (2, 0, 6144, 2, False, True),
        (4, 64, 6144, 4, False, True),
        (2, 0, 6144, 1, False, False),  # one row: ties or loses
        (4, 128, 6144, 1, False, False),
        (2, 0, 512, 4, False, False),  # the value projection's small K
        (2, 0, 6144, 1, True, False),  # expert groups stay on moe_tc_f
        (2, 0, 6144, 4, True, False),
        (2, 0, 16384, 4, False, False),  # served nowhere: x does not fit
    ],
)
def test_stream_auto(stream_host, monkeypatch, fmt, gs, k, rows, dual, taken):
    """STREAM "auto" (the default) takes gemv_st only where the H200 measured it faster."""
    st, mm = stream_host
    monkeypatch.setattr(st, "STREAM", "auto")
    assert st.stream_eligible(mm.WeightSpec.of(fmt, k, gs), rows, dual) == taken
