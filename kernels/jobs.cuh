// Job records and weight geometry shared by gemv.cu, gemv_tc.cu and prefill_tc.cu (the host
// writes the records as defined in kernels/records.py; tests/kernels/test_records.py checks
// these structs against it), and the persistent tile queue of their expert-group kernels
// (moe, moe_tc, moe_pf).
#pragma once

#define GEMV_WARPS 8

// Per-launch geometry of one weight tensor in the resident layout.
struct WGeom {
    int in_features, in_padded, ld, ngp, gs, gs_shift;
};

struct GemvJob {
    unsigned long long w0, s0;  // weights (resident layout) and scales of the matrix
    unsigned long long w1, s1;  // unused (kept for the 64-byte record)
    unsigned long long x, y;    // float32 activations in [rows, x_stride], out [rows, y_stride]
    int rows;                   // activation rows of this job
    int out_rows;               // O of this job (rows of W it uses)
    int x_stride, y_stride;     // in elements
};

struct MoeJob {
    unsigned long long wg, sg, wu, su, wd, sd;  // gate, up, down: resident weights and scales
    unsigned long long x, h, y;  // float32 x [rows, D], hidden h [rows, ie], out y [rows, dout]
    int rows, ie, dout, pad;     // activation rows, hidden size (gate rows), output size
};

// A whole expert group in one persistent launch. Work is a queue of tiles taken with one
// atomicAdd each: first every gate+up tile (phase A: ROWS_A hidden rows x SROWS activation rows
// of one expert, silu(gate x) * (up x) into the hidden buffer h), then every down tile (phase B:
// ROWS_B output rows of one expert, h -> y). A phase-A tile bumps its expert's done counter
// after its stores are fenced; a phase-B tile waits until its expert's counter is complete. No
// deadlock: a B tile is taken only after every A tile has been taken, by a block that is running
// and never waits.
//
// ctr: int32 [1 + n_jobs], zero at launch: [0] the tile queue, [1 + e] expert e's A tiles done.
// ga: geometry of gate and up (identical), gb: of down. tile_a and tile_b run one tile, called
// with the trailing arguments of block_rows, tc_block and pf_block: (x, x_stride, y, y_stride,
// rows, srow0, out_rows, row0, w0, sc0, w1, sc1, g); tile_a is DUAL (gate and up), tile_b gets
// nullptr for w1 and sc1 and must begin with a barrier (those three stage x first). All threads
// of the block call it; it inlines into its kernel, s_tile included.
template <int ROWS_A, int ROWS_B, int SROWS, class TileA, class TileB>
__device__ __forceinline__ void moe_queue(const MoeJob *__restrict__ jobs, int *ctr, int n_jobs,
                                          int ntiles_a_row, int ntiles_b_row, int nz,
                                          const WGeom &ga, const WGeom &gb, TileA tile_a,
                                          TileB tile_b) {
    __shared__ int s_tile;
    const int per_a = ntiles_a_row * nz, per_b = ntiles_b_row * nz;
    const int total_a = per_a * n_jobs, total = total_a + per_b * n_jobs;
    for (;;) {
        if (threadIdx.x == 0) s_tile = atomicAdd(ctr, 1);
        __syncthreads();
        const int tile = s_tile;
        if (tile >= total) break;
        if (tile < total_a) {
            const int e = tile / per_a, rem = tile - e * per_a;
            const int z = rem / ntiles_a_row, rt = rem - z * ntiles_a_row;
            const MoeJob &j = jobs[e];
            const int row0 = rt * ROWS_A, srow0 = z * SROWS;
            if (row0 < j.ie && srow0 < j.rows)
                tile_a(reinterpret_cast<const float *>(j.x), ga.in_features,
                       reinterpret_cast<float *>(j.h), j.ie, j.rows, srow0, j.ie, row0,
                       reinterpret_cast<const unsigned char *>(j.wg),
                       reinterpret_cast<const float *>(j.sg),
                       reinterpret_cast<const unsigned char *>(j.wu),
                       reinterpret_cast<const float *>(j.su), ga);
            __threadfence();  // this thread's h stores are visible device-wide ...
            __syncthreads();  // ... before thread 0 publishes the whole tile
            if (threadIdx.x == 0) atomicAdd(ctr + 1 + e, 1);
        } else {
            const int tb = tile - total_a;
            const int e = tb / per_b, rem = tb - e * per_b;
            const int z = rem / ntiles_b_row, rt = rem - z * ntiles_b_row;
            const MoeJob &j = jobs[e];
            const int row0 = rt * ROWS_B, srow0 = z * SROWS;
            if (row0 < j.dout && srow0 < j.rows) {
                if (threadIdx.x == 0) {
                    const volatile int *done = ctr + 1 + e;
                    while (*done < per_a) __nanosleep(128);
                    __threadfence();
                }
                // tile_b begins with a barrier: every thread waits for thread 0's spin.
                tile_b(reinterpret_cast<const float *>(j.h), j.ie,
                       reinterpret_cast<float *>(j.y), j.dout, j.rows, srow0, j.dout, row0,
                       reinterpret_cast<const unsigned char *>(j.wd),
                       reinterpret_cast<const float *>(j.sd),
                       static_cast<const unsigned char *>(nullptr),
                       static_cast<const float *>(nullptr), gb);
            }
        }
        __syncthreads();  // s_tile and shared memory are free for the next tile
    }
}
