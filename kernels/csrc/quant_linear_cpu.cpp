// Linear layers over GGUF-quantised weights, as the file ships them (lamina issue 42, build 3):
// y[M,N] = x[M,K] @ w[N,K]^T with w in ggml blocks of 32 weights along K, row after row:
//
//   Q4_0 (ggml type 2): half d, 16 bytes of nibbles         w = d * (q - 8)        18 bytes
//   Q4_1 (ggml type 3): half d, half m, 16 bytes of nibbles w = (d * q) + m        20 bytes
//   Q8_0 (ggml type 8): half d, 32 int8                     w = q * d              34 bytes
//
// (nibbles: byte j holds weight j in its low half and weight j + 16 in its high half). Each
// block is dequantised in registers to exactly the float32 values gguf-py's dequantize gives
// (so exactly the weights transformers loads from the same file: separate multiply and add,
// the pragma below keeps the compiler from fusing them), then multiplied into up to kMR rows
// of x with fused multiply-adds. A row of w is read once per kMR rows of x; at decode sizes the
// kernel streams 0.56 (Q4_0), 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight where float32 reads
// 4. Accumulation is float32 in lanes, summed once per output: results differ from F.linear
// over the dequantised weights by float rounding only.
//
// quant_linear(x[M,K] float32, blocks[N, K/32 * bytes] uint8, kind, bias?) -> y[M,N] float32.
// Threads split the output rows (at::parallel_for). KMR_ROWS (default 8, LAMINA_CPP_CFLAGS
// -DKMR_ROWS=n for an A/B) rows of x share one dequantisation of a weight row.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"
#include "simd.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

#ifndef KMR_ROWS
#define KMR_ROWS 8
#endif
constexpr int64_t kQK = 32;  // weights per block
constexpr int kMR = KMR_ROWS;  // rows of x per pass over a weight row

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
  }
  TORCH_CHECK(false, "quant_linear: ggml type ", kind, " is not supported (Q4_0 = 2, Q4_1 = 3, "
              "Q8_0 = 8)");
  return 0;
}

using lamina_ggml::half;

// The 32 weights of one block as gguf-py computes them (the oracle of the vector paths).
template <int KIND>
inline void dequant_scalar(const uint8_t* b, float* w) {
  if (KIND == 8) {
    const float d = half(b);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  } else {
    const float d = half(b);
    const float m = KIND == 3 ? half(b + 2) : 0.f;
    const uint8_t* qs = b + (KIND == 3 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      if (KIND == 3) {
        w[j] = d * static_cast<float>(lo) + m;
        w[j + 16] = d * static_cast<float>(hi) + m;
      } else {
        w[j] = d * static_cast<float>(lo - 8);
        w[j + 16] = d * static_cast<float>(hi - 8);
      }
    }
  }
}

#if LAMINA_SIMD
using lamina_simd::Vec;
constexpr int kNV = kQK / Vec::W;  // vectors per block: 2 (AVX-512) or 4 (AVX2)

// Eight or sixteen bytes, widened to int32 lanes (signed for Q8_0).
template <bool SIGNED>
inline Vec::R widen(__m128i bytes) {
#if LAMINA_AVX512
  const __m512i i = SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  return _mm512_cvtepi32_ps(i);
#else
  const __m256i i = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  return _mm256_cvtepi32_ps(i);
#endif
}

// q values (as floats) of one block, in weight order, kNV vectors.
template <int KIND>
inline void quants(const uint8_t* b, Vec::R (&q)[kNV]) {
  if (KIND == 8) {
    for (int v = 0; v < kNV; ++v)
      q[v] = widen<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + v * Vec::W)));
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (KIND == 3 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
#if LAMINA_AVX512
  q[0] = widen<false>(lo);
  q[1] = widen<false>(hi);
#else
  q[0] = widen<false>(lo);
  q[1] = widen<false>(_mm_srli_si128(lo, 8));
  q[2] = widen<false>(hi);
  q[3] = widen<false>(_mm_srli_si128(hi, 8));
#endif
}

template <int KIND>
inline void dequant(const uint8_t* b, Vec::R (&w)[kNV]) {
#if LAMINA_AVX512
  if (KIND != 8) {  // a block's 16 possible weights as a table, looked up by nibble (vpermps
    // reads the low 4 bits of each index: no masking); the same products and sums as below
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec::R d = Vec::set1(half(b));
    const Vec::R table = KIND == 3 ? Vec::add(Vec::mul(d, iota), Vec::set1(half(b + 2)))
                                   : Vec::mul(d, Vec::sub(iota, Vec::set1(8.f)));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (KIND == 3 ? 4 : 2)));
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(raw), table);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(raw, 4)), table);
    return;
  }
#endif
  quants<KIND>(b, w);
  const Vec::R d = Vec::set1(half(b));
  if (KIND == 3) {
    const Vec::R m = Vec::set1(half(b + 2));
    for (int v = 0; v < kNV; ++v) w[v] = Vec::add(Vec::mul(d, w[v]), m);
  } else if (KIND == 2) {
    const Vec::R eight = Vec::set1(8.f);  // q - 8 is exact in float32
    for (int v = 0; v < kNV; ++v) w[v] = Vec::mul(d, Vec::sub(w[v], eight));
  } else {
    for (int v = 0; v < kNV; ++v) w[v] = Vec::mul(w[v], d);
  }
}

// y[m, n] for the MR rows of x at x (row stride ldx) and weight row wrow (KB blocks).
template <int KIND, int MR>
inline void row_dot(const float* x, int64_t ldx, const uint8_t* wrow, int64_t KB, int64_t bb,
                    float* y, int64_t ldy, float bias) {
  Vec::R acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* b = wrow + kb * bb;
    _mm_prefetch(reinterpret_cast<const char*>(b) + 1024, _MM_HINT_T0);
    Vec::R w[kNV];
    dequant<KIND>(b, w);
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < kNV; ++v)
        acc[m] = Vec::fmadd(w[v], Vec::load(x + m * ldx + kb * kQK + v * Vec::W), acc[m]);
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = Vec::hsum(acc[m]) + bias;
}
#else
template <int KIND, int MR>
inline void row_dot(const float* x, int64_t ldx, const uint8_t* wrow, int64_t KB, int64_t bb,
                    float* y, int64_t ldy, float bias) {
  float acc[MR] = {};
  float w[kQK];
  for (int64_t kb = 0; kb < KB; ++kb) {
    dequant_scalar<KIND>(wrow + kb * bb, w);
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kQK; ++j) acc[m] += w[j] * x[m * ldx + kb * kQK + j];
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = acc[m] + bias;
}
#endif

// row_dot for the last r < kMR rows (R counts down to the matching instantiation).
template <int KIND, int R>
inline void tail(int64_t r, const float* x, int64_t ldx, const uint8_t* wrow, int64_t KB,
                 int64_t bb, float* y, int64_t ldy, float bias) {
  if constexpr (R > 0) {
    if (r == R) return row_dot<KIND, R>(x, ldx, wrow, KB, bb, y, ldy, bias);
    tail<KIND, R - 1>(r, x, ldx, wrow, KB, bb, y, ldy, bias);
  }
}

template <int KIND>
void run(const float* x, int64_t M, int64_t K, const uint8_t* wq, int64_t N, const float* bias,
         float* y) {
  const int64_t bb = block_bytes(KIND), KB = K / kQK, row_bytes = KB * bb;
  // threads get whole, contiguous runs of rows
  const int64_t grain =
      std::max<int64_t>(1, lamina_ggml::kTaskBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = wq + n * row_bytes;
      const float b = bias ? bias[n] : 0.f;
      int64_t m = 0;
      for (; m + kMR <= M; m += kMR) row_dot<KIND, kMR>(x + m * K, K, wrow, KB, bb, y + m * N + n, N, b);
      if (m < M) tail<KIND, kMR - 1>(M - m, x + m * K, K, wrow, KB, bb, y + m * N + n, N, b);
    }
  });
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "quant_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_linear: x must be float32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "quant_linear: blocks must be contiguous uint8 [N, K / 32 * block bytes]");
  const int64_t bb = block_bytes(kind);
  const int64_t K = x.size(-1), N = blocks.size(0);
  TORCH_CHECK(K % kQK == 0 && blocks.size(1) == K / kQK * bb, "quant_linear: x has ", K,
              " inputs; blocks rows hold ", blocks.size(1), " bytes (", bb, " per 32 weights)");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  c10::optional<at::Tensor> bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: bias must have N = ", N, " values");
    bc = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bc ? bc->data_ptr<float>() : nullptr;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (M > 0 && N > 0) {
    if (kind == 2) run<2>(xp, M, K, wp, N, bp, yp);
    else if (kind == 3) run<3>(xp, M, K, wp, N, bp, yp);
    else run<8>(xp, M, K, wp, N, bp, yp);
  }
  return y.view(shape);
}
