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

// moe_queue with the next ticket taken one tile ahead (moe_tc_f): thread 0 asks for the next
// tile as soon as it knows the current one, so the atomic's round trip overlaps the current
// tile instead of standing between two tiles; tiles run in the same queue order (all A tiles,
// then all B tiles) and compute the same way, only which block runs which tile changes.
//
// The phase-B wait moves into the tile: tile_b gets `done` (its expert's counter) and `need`
// (per_a) and must let one thread spin until *done >= need, fence, and barrier before reading
// h (it may issue its weight loads first: they do not depend on h); tile_a gets nullptr, 0.
// Both get `next`: a callable that all threads may call once after their first barrier, to
// ask L2 for the first `pf_a` / `pf_b` bytes per weight row of the block's next tile.
//
// No deadlock, with any number of resident blocks (3 per SM here instead of 2): every A tile
// comes before every B tile in the queue and a block's tickets grow, so a block that holds an
// A tile (as its current or as its next ticket) runs only A tiles before it, and A tiles never
// wait: every A tile taken completes. A B tile is taken only after every A tile has been taken
// (queue order), so the counter it waits for completes. Blocks not yet resident take no
// tickets and hold nothing, so they cannot hold up a waiting one.
//
// Why not interleave the phases (B tiles of expert e right after the A tiles of e + 1): it is
// also deadlock free, but then B tiles would wait on A tiles taken a moment before them. In
// this order the B tiles of expert e come n_jobs - 1 - e experts' worth of B tiles after the
// last A tile, so they rarely wait, and the launch ends on the small down tiles (a 32-row
// down tile of a decode group reads 32 KB, a gate+up tile 192 KB): the short tail that
// interleaving was meant to give.
template <int ROWS_A, int ROWS_B, int SROWS, class TileA, class TileB>
__device__ __forceinline__ void moe_queue_la(const MoeJob *__restrict__ jobs, int *ctr,
                                             int n_jobs, int ntiles_a_row, int ntiles_b_row,
                                             int nz, const WGeom &ga, const WGeom &gb,
                                             int pf_a, int pf_b, TileA tile_a, TileB tile_b) {
    __shared__ int s_tile[2];
    const int per_a = ntiles_a_row * nz, per_b = ntiles_b_row * nz;
    const int total_a = per_a * n_jobs, total = total_a + per_b * n_jobs;
    if (threadIdx.x == 0) s_tile[0] = atomicAdd(ctr, 1);
    __syncthreads();
    for (int slot = 0;; slot ^= 1) {
        const int tile = s_tile[slot];
        if (tile >= total) break;
        // s_tile[slot ^ 1] was last read before the previous tile's closing barrier; it is
        // read again only after this tile's first barrier (next) or its closing one.
        if (threadIdx.x == 0) s_tile[slot ^ 1] = atomicAdd(ctr, 1);
        auto next = [&]() {
            const int nt = s_tile[slot ^ 1];
            if (nt >= total) return;
            const unsigned char *w0, *w1 = nullptr;
            int row0, nrows, ld, bytes, out_rows, srow0, rows;
            if (nt < total_a) {
                const int e = nt / per_a, rem = nt - e * per_a, rt = rem % ntiles_a_row;
                const MoeJob &j = jobs[e];
                srow0 = rem / ntiles_a_row * SROWS, rows = j.rows;
                w0 = reinterpret_cast<const unsigned char *>(j.wg);
                w1 = reinterpret_cast<const unsigned char *>(j.wu);
                row0 = rt * ROWS_A, nrows = ROWS_A, ld = ga.ld, out_rows = j.ie;
                bytes = min(pf_a, ga.in_padded >> 1);
            } else {
                const int tb = nt - total_a, e = tb / per_b, rem = tb - e * per_b;
                const int rt = rem % ntiles_b_row;
                const MoeJob &j = jobs[e];
                srow0 = rem / ntiles_b_row * SROWS, rows = j.rows;
                w0 = reinterpret_cast<const unsigned char *>(j.wd);
                row0 = rt * ROWS_B, nrows = ROWS_B, ld = gb.ld, out_rows = j.dout;
                bytes = min(pf_b, gb.in_padded >> 1);
            }
            if (row0 >= out_rows || srow0 >= rows) return;  // a tile that will be skipped
            const int lines = bytes >> 7, per_m = nrows * lines;
            for (int i = threadIdx.x; i < (w1 ? 2 : 1) * per_m; i += blockDim.x) {
                const int m = i >= per_m, k = i - m * per_m;
                const int r = min(row0 + k / lines, out_rows - 1);
                const unsigned char *p = (m ? w1 : w0) + (size_t)r * ld + (k % lines) * 128;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
            }
        };
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
                       reinterpret_cast<const float *>(j.su), ga,
                       static_cast<const int *>(nullptr), 0, next);
            __threadfence();  // this thread's h stores are visible device-wide ...
            __syncthreads();  // ... before thread 0 publishes the whole tile
            if (threadIdx.x == 0) atomicAdd(ctr + 1 + e, 1);
        } else {
            const int tb = tile - total_a;
            const int e = tb / per_b, rem = tb - e * per_b;
            const int z = rem / ntiles_b_row, rt = rem - z * ntiles_b_row;
            const MoeJob &j = jobs[e];
            const int row0 = rt * ROWS_B, srow0 = z * SROWS;
            if (row0 < j.dout && srow0 < j.rows)
                tile_b(reinterpret_cast<const float *>(j.h), j.ie,
                       reinterpret_cast<float *>(j.y), j.dout, j.rows, srow0, j.dout, row0,
                       reinterpret_cast<const unsigned char *>(j.wd),
                       reinterpret_cast<const float *>(j.sd),
                       static_cast<const unsigned char *>(nullptr),
                       static_cast<const float *>(nullptr), gb,
                       static_cast<const int *>(ctr + 1 + e), per_a, next);
        }
        __syncthreads();  // s_tile and shared memory are free for the next tile
    }
}
