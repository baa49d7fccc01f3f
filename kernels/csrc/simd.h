// SIMD helpers shared by lamina's C++ CPU kernels. LAMINA_AVX512 is 1 when the compiler targets
// AVX-512F and AVX-512BW (-march=native on such a CPU), else 0 and the kernels use plain loops
// that the compiler vectorises for whatever -march allows.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LAMINA_AVX512 1
#include <immintrin.h>
#else
#define LAMINA_AVX512 0
#endif

namespace lamina_simd {

#if LAMINA_AVX512
// 16 consecutive elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // exact: bfloat16 is the top half of float32
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace lamina_simd
