// The contract between a whole-step program (kernels/csrc/slice_program.cpp StepProgram) and
// whatever answers its layers' attention without Python: memnode/csrc/attend_plane.cpp (a memory
// node in this process) and lamina/transport/csrc/shm_ring.cpp (the ring to a node's process).
// The answering side exports a capsule named kExchangeCapsule holding an ExchangeFn, and a
// capsule of the object it takes as `self`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <ctime>

inline int64_t exchange_clock_ns() {  // the stamps' clock: time.perf_counter_ns's
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Attend layer `layer` of step `step_id` for every work of the step: q[T, H, D], k/v[Ta, Hkv, D]
// in plan order (float CPU tensors). Returns
// * kAnswered with *o = o[T, H, D] (q's dtype, contiguous): the attention output of all T rows,
//   complete (the node saw every key);
// * kDeclined: nothing was sent and the step has not moved; the caller sends this layer's ATTEND
//   the Python way (the node answers or raises there);
// * kSentOnly: the ATTEND is out but its RESULT was not taken (not the next message, or not
//   here within one wait); the caller receives it the Python way.
// Called without the GIL, with `extra` (each field optional):
struct ExchangeExtra {
  // The layer's times for a timeline (time.perf_counter_ns's clock), each written where known
  // (the caller zeroes them): [0] when the ATTEND was out (in this process: when the node
  // began), [1] / [2] when the node's append and kernel began / ended.
  int64_t* stamps = nullptr;
  // Called at most once, with idle_arg, once the ATTEND is out and before its RESULT is awaited
  // (in this process: before the node begins): the caller's tidying, off the critical path.
  void (*idle)(void*) = nullptr;
  void* idle_arg = nullptr;
};
constexpr int kDeclined = 0, kAnswered = 1, kSentOnly = 2;
constexpr int kExchangeStamps = 3;
using ExchangeFn = int (*)(void* self, int64_t step_id, int64_t layer, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, at::Tensor* o,
                           const ExchangeExtra& extra);

constexpr const char* kExchangeCapsule = "lamina.exchange/4";
