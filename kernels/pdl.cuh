// Programmatic dependent launch (kernels/launch.py, PDL): a kernel launched with it may start
// while the kernel before it in the stream is still finishing, so every kernel a call's work
// lists waits here, before it reads or writes anything, until that kernel has completed and
// its writes are visible. Without PDL the wait returns at once: the same kernel either way.
// sm_90 and up only; nothing elsewhere (and on the host, where the CPU tests compile the
// sources).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define COLI_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define COLI_PDL_WAIT() ((void)0)
#endif
