"""coli_copy (copy.cu) on the CPU, no GPU needed (CI runs it): its CUDA source under g++ through
fibers.h (one fiber per CUDA thread), for sizes that end inside a 16-byte lane and grids that
leave each thread 1, 2, 3, 4 or more lanes (the four-wide loop, then the last up to three lanes
loaded together), every byte of [0, n) copied and nothing past it written; and the phase stamps
(each block's start and end by a counting clock, the last block writing the first start and the
last end and resetting the record for the next launch). The GPU tests of the same kernel:
``test_copy.py``."""

from __future__ import annotations

import shutil

import pytest
from _emulate import build_and_run, without_ptx

from coliworker.kernels import sources

_SHIM = r"""
#include "fibers.h"
inline void __threadfence_system() {}
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) {
    const unsigned long long o = *p; if (v < o) *p = v; return o;
}
inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v) {
    const unsigned long long o = *p; if (v > o) *p = v; return o;
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    const unsigned long long o = *p; *p += v; return o;
}
unsigned long long g_clock = 1000;  // %globaltimer: later on every read
inline unsigned long long copy_now() { return g_clock++; }
#include "kernel.inc"

int check(long long n, int grid, bool stamped, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<uint4> src((n + 15) / 16 + 8), dst((n + 15) / 16 + 8);
    unsigned char *s = reinterpret_cast<unsigned char *>(src.data());
    unsigned char *d = reinterpret_cast<unsigned char *>(dst.data());
    for (size_t i = 0; i < src.size() * 16; ++i) s[i] = rng() & 255;
    for (size_t i = 0; i < dst.size() * 16; ++i) d[i] = 0xA5;
    CopyStamp st{~0ull, 0, 0};
    unsigned long long out[2] = {0, 0};
    const unsigned long long t0 = g_clock;
    launch({(unsigned)grid, 1, 1}, 1, 256, [&] {
        coli_copy(dst.data(), src.data(), stamped ? &st : nullptr, stamped ? out : nullptr, n);
    });
    for (long long i = 0; i < n; ++i)
        if (d[i] != s[i]) {
            std::printf("n %lld grid %d: byte %lld not copied\n", n, grid, i);
            return 1;
        }
    for (size_t i = n; i < dst.size() * 16; ++i)
        if (d[i] != 0xA5) {
            std::printf("n %lld grid %d: byte %zu past n written\n", n, grid, i);
            return 1;
        }
    if (stamped) {
        // every block's thread 0 read the clock twice (start, end): first is the first
        // block's start, last the last block's end
        if (!(out[0] >= t0 && out[1] == g_clock - 1 && out[0] < out[1])) {
            std::printf("stamps %llu %llu (clock %llu .. %llu)\n", out[0], out[1], t0, g_clock);
            return 1;
        }
        if (st.first != ~0ull || st.last != 0 || st.done != 0) {
            std::printf("the stamp record was not reset\n");
            return 1;
        }
    }
    return 0;
}

int main() {
    // (bytes, blocks): 256 threads a block; lanes of 16 bytes per thread below 1, 1, 2, 3,
    // exactly 4, 4 and some, 7, many
    const long long sizes[] = {1, 15, 16, 17, 4096, 6000, 8192, 12288, 24577, 40000, 65536,
                               196608};
    const int grids[] = {1, 2, 3, 6, 12};
    int bad = 0;
    unsigned seed = 1;
    for (long long n : sizes)
        for (int g : grids) bad |= check(n, g, false, seed++);
    bad |= check(24577, 2, true, seed++);
    bad |= check(24577, 2, true, seed++);  // the record as the first launch left it
    bad |= check(65536, 6, true, seed++);
    return bad;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_coli_copy_moves_every_byte_for_any_grid(tmp_path):
    src = without_ptx(sources.source("copy.cu"), ("copy_now",))
    build_and_run(tmp_path, _SHIM, src, timeout=300)
