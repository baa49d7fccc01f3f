// The contract between a whole-step program (slice_program.cpp StepProgram) and whatever answers
// its layers' attention without Python (memnode/csrc/attend_plane.cpp: a memory node in this
// process). The answering side exports a capsule named kExchangeCapsule holding an ExchangeFn,
// and a capsule of the object it takes as `self`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Attend layer `layer` of step `step_id` for every work of the step: q[T, H, D], k/v[Ta, Hkv, D]
// in plan order (float CPU tensors). True with *o = o[T, H, D] (q's dtype, contiguous): the
// attention output of all T rows, complete (the node saw every key). False where the caller must
// send this layer's ATTEND the Python way (the step has not moved; the node answers or raises
// there).
// Called without the GIL.
using ExchangeFn = bool (*)(void* self, int64_t step_id, int64_t layer, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, at::Tensor* o);

constexpr const char* kExchangeCapsule = "lamina.exchange/1";
