// Job records and weight geometry shared by gemv.cu and gemv_tc.cu (mirrored by JOB_DTYPE and
// MOE_DTYPE in matmul.py and the structs in tables.py).
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
