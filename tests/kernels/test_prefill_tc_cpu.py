"""gemv_pf and gemv_pf_sk (prefill_tc.cu) on the CPU, no GPU needed (CI runs it): their CUDA
source under g++ through fibers.h (one fiber per CUDA thread), tc.cuh's PTX by the models of
tc_models.h, and cluster.cuh's by those of cluster_models.h (the rank along x, the cluster
barrier, loads from another block's shared memory). Ragged job tables, K ending inside an int4
block and inside a K tile, activation rows that end inside an n-tile, both k-slice forms (KS 1
and 4), clusters of 2, 4 and 8 (ranks with no K at all among them), fmt 2 (per-row scales) and
fmt 4 (grouped scales), against float64: every output written, nothing else touched, within
1e-5; each cluster form against gemv_pf within the same bound. The GPU tests of the same
kernels: ``test_prefill_tc.py``."""

from __future__ import annotations

import shutil

import pytest
from _emulate import build_and_run, without_ptx

from coliworker.kernels import sources

_ASM = ("tc_bf16", "tc_nib2", "tc_quad", "tc_mma", "tc_mma_q8", "coli_cluster_rank",
        "coli_cluster_sync", "coli_cluster_wait_exit", "coli_remote", "coli_dsmem_load",
        "coli_dsmem_load4")  # fmt: skip

_SHIM = r"""
#include "fibers.h"
#include "tc_models.h"
#include "cluster_models.h"
#include "kernel.inc"


// Jobs of out_rows[j] weight rows and rows[j] activation rows, K inputs, through gemv_pf<FMT,
// KS> (C = 1) or gemv_pf_sk<FMT, KS, C>; FMT 4: grouped scales of gs. Checked against float64.
template <int FMT, int KS, int C>
int check(std::vector<int> outs, std::vector<int> rows, int K, int gs = 0) {
    std::mt19937 rng(K * 7 + KS * 3 + C + gs);
    std::normal_distribution<float> nd;
    const int nj = (int)outs.size(), inp = (K + 1023) / 1024 * 1024, ld = inp / 2;
    const int ngp = FMT == 4 ? inp / gs : 1, shift = FMT == 4 ? __builtin_ctz(gs) : 2;
    const int max_out = *std::max_element(outs.begin(), outs.end());
    const int max_rows = *std::max_element(rows.begin(), rows.end());
    const int tile = PfTile<PF_MR, KS>::ROWS, pad = 3;
    std::vector<std::vector<unsigned char>> w(nj);
    std::vector<std::vector<float>> sc(nj), x(nj), y(nj);
    std::vector<GemvJob> jobs(nj);
    for (int j = 0; j < nj; ++j) {
        w[j].resize((size_t)outs[j] * ld + 16);
        for (auto &b : w[j]) b = rng() & 255;
        sc[j].resize((size_t)outs[j] * ngp);
        for (auto &s : sc[j]) s = 0.001f + 0.01f * std::fabs(nd(rng));
        x[j].resize((size_t)rows[j] * (K + pad));
        for (auto &v : x[j]) v = nd(rng);
        y[j].assign((size_t)rows[j] * (outs[j] + pad), NAN);
        auto at = [](const auto &v) { return (unsigned long long)v.data(); };
        jobs[j] = {at(w[j]), at(sc[j]), 0, 0, at(x[j]), at(y[j]), rows[j], outs[j], K + pad,
                   outs[j] + pad};
    }
    g_cluster = C;
    const dim3 grid{(max_rows + PF_SROWS - 1) / PF_SROWS * C, (max_out + tile - 1) / tile, nj};
    const int gsa = FMT == 4 ? gs : 4;
    launch(grid, C, GEMV_WARPS * 32, [&] {
        if constexpr (C == 1) gemv_pf<FMT, KS>(jobs.data(), K, inp, ld, ngp, gsa, shift);
        else gemv_pf_sk<FMT, KS, C>(jobs.data(), K, inp, ld, ngp, gsa, shift);
    });
    double md = 0, mx = 0;
    long unwritten = 0, touched = 0;
    for (int j = 0; j < nj; ++j)
        for (int s = 0; s < rows[j]; ++s)
            for (int o = 0; o < outs[j] + pad; ++o) {
                const float got = y[j][(size_t)s * (outs[j] + pad) + o];
                if (o >= outs[j]) { touched += !std::isnan(got); continue; }
                double v = 0;
                const float *srow = &sc[j][(size_t)o * ngp];
                for (int e = 0; e < K; ++e)
                    v += (double)code(&w[j][(size_t)o * ld], e) *
                         x[j][(size_t)s * (K + pad) + e] * (FMT == 4 ? srow[e / gs] : 1.f);
                if (FMT == 2) v *= srow[0];
                if (std::isnan(got)) { ++unwritten; continue; }
                md = std::max(md, std::fabs(got - v)); mx = std::max(mx, std::fabs(v));
            }
    std::printf("fmt %d gs %d KS %d C %d K %d jobs %d: rel err %.2g, unwritten %ld, "
                "touched %ld\n", FMT, gs, KS, C, K, nj, md / mx, unwritten, touched);
    // bf16 hi + lo of each activation: ~16 bits (the GPU tests' bound is 1e-4)
    return unwritten > 0 || touched > 0 || !(md <= 1e-5 * mx);
}

int main() {
    // gemv_pf (C = 1) beside gemv_pf_sk: KS 1 (256-row tiles) and 4 (64-row tiles, k slices
    // meeting in shared memory); K = 2101 (the last int4 block and K tile partial; C = 4 and 8
    // give ranks no K); two jobs of other sizes (the second's rows end inside an n-tile and
    // its weight rows inside a tile); 33 rows (a second block of 32 activation rows)
    return check<2, 1, 1>({70, 300}, {5, 3}, 2101) + check<2, 1, 2>({70, 300}, {5, 3}, 2101) +
           check<2, 4, 4>({70, 300}, {5, 3}, 2101) + check<2, 1, 8>({40}, {9}, 2101) +
           check<2, 4, 2>({20}, {33}, 1100) + check<4, 1, 4>({70}, {6}, 3000, 64) +
           check<4, 4, 2>({33, 17}, {4, 7}, 2101, 16) + check<4, 4, 1>({33, 17}, {4, 7}, 2101, 16);
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_gemv_pf_on_cpu(tmp_path):
    build_and_run(tmp_path, _SHIM, without_ptx(sources.source("prefill_tc.cu"), _ASM), 900)
