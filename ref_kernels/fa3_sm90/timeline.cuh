// Timeline marks of kernel.cu's consumers, for experiments only (experiments/timeline.py).
// kernel.cu includes this inside namespace fa3, after params.cuh.
#pragma once

// experiments/timeline.py builds the kernel with CUIR_TIMELINE_PTR (a device address compiled in)
// to see where a consumer's time goes: thread 0 of each consumer warpgroup of the first
// CUIR_TIMELINE_CTAS CTAs writes clock64() << 8 | event into its own stretch of that buffer.
// Product builds leave it undefined, and every mark compiles to nothing.
enum TimelineEvent { kTlTile = 1, kTlTurnWait, kTlTurnGot, kTlIssued, kTlScores, kTlSoftmax, kTlPv,
                     kTlEpilogue, kTlEpilogueDone, kTlKReady, kTlQkIssued, kTlVReady };
#ifdef CUIR_TIMELINE_PTR
#ifndef CUIR_TIMELINE_CTAS
#define CUIR_TIMELINE_CTAS 4
#endif
#ifndef CUIR_TIMELINE_LEN
#define CUIR_TIMELINE_LEN 4096
#endif
struct TimelineMark {
  unsigned long long* out;
  int n;
  __device__ __forceinline__ void operator()(int ev) {
    if (out != nullptr && n < CUIR_TIMELINE_LEN) out[n++] = (static_cast<unsigned long long>(clock64()) << 8) | ev;
  }
};
__device__ __forceinline__ TimelineMark timeline_for(int c, int wg_thread) {
  const bool on = wg_thread == 0 && blockIdx.x < CUIR_TIMELINE_CTAS;
  unsigned long long* base = reinterpret_cast<unsigned long long*>(CUIR_TIMELINE_PTR);
  return TimelineMark{on ? base + (size_t(blockIdx.x) * kConsumers + c) * CUIR_TIMELINE_LEN : nullptr, 0};
}
#else
struct TimelineMark {
  __device__ __forceinline__ void operator()(int) const {}
};
__device__ __forceinline__ TimelineMark timeline_for(int, int) { return TimelineMark{}; }
#endif
