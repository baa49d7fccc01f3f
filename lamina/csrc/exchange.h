// The contract between a whole-step program (kernels/csrc/slice_program.cpp StepProgram) and
// whatever answers its layers' attention without Python: memnode/csrc/attend_plane.cpp (a memory
// node in this process) and lamina/transport/csrc/shm_ring.cpp (the ring to a node's process).
// The answering side exports a capsule named kExchangeCapsule holding an ExchangeFn, and a
// capsule of the object it takes as `self`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Attend layer `layer` of step `step_id` for every work of the step: q[T, H, D], k/v[Ta, Hkv, D]
// in plan order (float CPU tensors). Returns
// * kAnswered with *o = o[T, H, D] (q's dtype, contiguous): the attention output of all T rows,
//   complete (the node saw every key);
// * kDeclined: nothing was sent and the step has not moved; the caller sends this layer's ATTEND
//   the Python way (the node answers or raises there);
// * kSentOnly: the ATTEND is out but its RESULT was not taken (not the next message, or not
//   here within one wait); the caller receives it the Python way.
// Called without the GIL.
constexpr int kDeclined = 0, kAnswered = 1, kSentOnly = 2;
using ExchangeFn = int (*)(void* self, int64_t step_id, int64_t layer, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, at::Tensor* o);

constexpr const char* kExchangeCapsule = "lamina.exchange/2";
