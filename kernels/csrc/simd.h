// SIMD helpers shared by lamina's C++ CPU kernels: one float32 vector type, `Vec`, for the
// widest instruction set the compiler targets (-march=native):
//
//   LAMINA_AVX512  AVX-512F + AVX-512BW: 16 lanes, 32 registers
//   LAMINA_AVX2    AVX2 + FMA (no AVX-512): 8 lanes, 16 registers
//   LAMINA_SIMD    either of them; 0: the kernels use plain loops that the compiler
//                  vectorises for whatever -march allows
//
// The kernels are written once against Vec (W lanes, kRegs registers), so each instruction set
// runs the same blocking, sized to its registers. Vec::load widens float32, bfloat16, int8 and
// float8 e4m3 (fn) elements to float32 exactly. fp8_as_half: an e4m3 byte S.EEEE.MMM placed as
// the float16 S.0EEEE.MMM0000000 is the same number times 2^-8 (float16's exponent bias is 15,
// e4m3's 7; subnormals line up too), which the F16C conversion widens and one multiply rescales.
// (e4m3fn's NaN, 0x7F, would read as 480: pools never hold it, quantisation clamps to 448.)
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LAMINA_AVX512 1
#define LAMINA_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define LAMINA_AVX512 0
#define LAMINA_AVX2 1
#include <immintrin.h>
#else
#define LAMINA_AVX512 0
#define LAMINA_AVX2 0
#endif
#define LAMINA_SIMD (LAMINA_AVX512 || LAMINA_AVX2)

namespace lamina_simd {

#if LAMINA_AVX512
struct Vec {
  using R = __m512;
  static constexpr int W = 16;      // float32 lanes
  static constexpr int kRegs = 32;  // vector registers
  static constexpr const char* kName = "avx512";
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const c10::BFloat16* p) {  // exact: bfloat16 is the top half of float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static R load(const int8_t* p) {  // exact
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static R load(const c10::Float8_e4m3fn* p) {  // exact: see fp8_as_half
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  }
  static void store(float* p, R a) { _mm512_storeu_ps(p, a); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static float hsum(R a) { return _mm512_reduce_add_ps(a); }
  static float hmax(R a) { return _mm512_reduce_max_ps(a); }

  // One vector whose lane i is the sum of the lanes of a[i], i < 16 (a transpose-and-add).
  static R reduce(const R* a) {
    R t[8], u[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3]
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit chunk: partial sums of a[4i .. 4i+3]
      u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const R v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const R v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // exp(x) for x <= 0; inputs below -87.3 (including -inf) give exactly 0. See exp_poly.
  static R exp_nonpos(R x);
};
#elif LAMINA_AVX2
struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  static constexpr const char* kName = "avx2";
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static R load(const int8_t* p) {  // exact
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static R load(const c10::Float8_e4m3fn* p) {  // exact: see fp8_as_half
#if defined(__F16C__)
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(f);
#endif
  }
  static void store(float* p, R a) { _mm256_storeu_ps(p, a); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static float hsum(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(R a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }

  // One vector whose lane i is the sum of the lanes of a[i], i < 8 (horizontal-add tree).
  static R reduce(const R* a) {
    const R t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const R t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const R u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  static R exp_nonpos(R x);
};
#endif

#if LAMINA_SIMD
// Cephes' expf polynomial (~1 ulp) on x <= 0, scaled by 2^n with n = round(x / ln 2) in
// [-126, 0]; lanes below -87.3 (including -inf, the masked scores) are set to exactly 0.
inline Vec::R exp_poly(Vec::R x, Vec::R* n_out) {
  x = Vec::max(x, Vec::set1(-87.3f));
#if LAMINA_AVX512
  const Vec::R n = _mm512_roundscale_ps(Vec::mul(x, Vec::set1(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec::R r = _mm512_fnmadd_ps(n, Vec::set1(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, Vec::set1(-2.12194440e-4f), r);
#else
  const Vec::R n = _mm256_round_ps(Vec::mul(x, Vec::set1(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec::R r = _mm256_fnmadd_ps(n, Vec::set1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, Vec::set1(-2.12194440e-4f), r);
#endif
  Vec::R y = Vec::set1(1.9875691500e-4f);
  y = Vec::fmadd(y, r, Vec::set1(1.3981999507e-3f));
  y = Vec::fmadd(y, r, Vec::set1(8.3334519073e-3f));
  y = Vec::fmadd(y, r, Vec::set1(4.1665795894e-2f));
  y = Vec::fmadd(y, r, Vec::set1(1.6666665459e-1f));
  y = Vec::fmadd(y, r, Vec::set1(5.0000001201e-1f));
  *n_out = n;
  return Vec::fmadd(y, Vec::mul(r, r), Vec::add(r, Vec::set1(1.0f)));
}

#if LAMINA_AVX512
inline Vec::R Vec::exp_nonpos(R x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, set1(-87.3f), _CMP_GT_OQ);
  R n;
  const R y = exp_poly(x, &n);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}
#else
inline Vec::R Vec::exp_nonpos(R x) {
  const R live = _mm256_cmp_ps(x, set1(-87.3f), _CMP_GT_OQ);
  R n;
  const R y = exp_poly(x, &n);
  // 2^n built in the exponent field (n >= -126: a normal number).
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, mul(y, _mm256_castsi256_ps(e)));
}
#endif
#endif  // LAMINA_SIMD

}  // namespace lamina_simd
