// Helpers of the kernels over GGUF (ggml) blocks: quant_linear_cpu.cpp (dequantised, exact) and
// quant_dot_cpu.cpp (integer dot products).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace lamina_ggml {

// The fewest weight bytes a thread's task of a linear kernel reads (at::parallel_for's grain):
// small enough that a decode step's 576 x 576 projections are split between the threads too.
constexpr int64_t kTaskBytes = 32 << 10;

// A block's float16 scale, stored little-endian at p, as float32 (exact).
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

}  // namespace lamina_ggml
