// Linear layers over GGUF blocks with integer dot products, as llama.cpp runs them (lamina issue
// 42, build 3; the ``gguf-q8`` linear kernel choice). quant_linear_cpu.cpp dequantises each block
// to float32 and multiplies exactly; this file instead quantises each row of x per block of 32
// to int8, as ggml's Q8_1 does:
//
//   d = max|x_j| / 127,  q_j = round-half-even(x_j * (127 / max|x_j|)),  s = d * sum_j q_j
//
// and multiplies 8-bit integers (vpdpbusd on 256-bit vectors with AVX512-VNNI, else AVX2's
// vpmaddubsw + vpmaddwd; plain loops without AVX2):
//
//   Q4_0  w = dw * (u - 8)      sum_j w_j x_j ~= dw * d * sum_j u_j q_j - 8 * dw * s
//   Q4_1  w = dw * u + m        sum_j w_j x_j ~= dw * d * sum_j u_j q_j + m * s
//   Q8_0  w = dw * v (signed)   sum_j w_j x_j ~= dw * d * sum_j |v_j| * (sign(v_j) q_j)
//   Q4_K  w = ds * u - dm       (per 32 of a super-block of 256: ds = d * sc, dm = dmin * m)
//                               sum_j w_j x_j ~= ds * d * sum_j u_j q_j - dm * s
//
// (u: the 4-bit quants, 0..15; v: int8; |v| <= 128 and |q| <= 127 keep vpmaddubsw's int16 pair
// sums from saturating). The integer sums are exact; rounding x to 8 bits is the cost in
// accuracy (bench/gguf_accuracy.py measures it). The weights are first repacked, once, by
// pack_q8_weight (8 output rows interleaved, below) so that the kernel needs no horizontal sums.
//
// pack_q8_weight(blocks[N, K/32 * bytes] uint8, kind) -> packed uint8 [ceil(N/8), K/32 * pb]
// quant_linear_q8(x[..., K] float32, packed, N, kind, bias?) -> y[..., N] float32
// quantize_q8(x[..., K] float32) -> (q int8 [M,K], d float32 [M,K/32], s float32 [M,K/32]):
//   the activations' quantisation alone (the tests' reference uses it).
// Threads split the groups of 8 output rows (at::parallel_for); up to kMR rows of x share each
// load of a weight block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ggml_blocks.h"
#include "linear_outputs.h"

namespace {

using lamina_linear::Outputs;

constexpr int64_t kQK = 32;  // weights per block
constexpr int kMR = 4;       // rows of x per pass over a weight row

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
    case 12: return 18;  // Q4_K: 144 bytes per super-block of 256
  }
  TORCH_CHECK(false, "quant_linear_q8: ggml type ", kind, " is not supported (Q4_0 = 2, "
              "Q4_1 = 3, Q8_0 = 8, Q4_K = 12)");
  return 0;
}

using lamina_ggml::half;

// One row of x (K values) as K/32 blocks: q (int8), d, s.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kQK; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.f, id = db != 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));
      q[b * kQK + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = db;
    s[b] = db * static_cast<float>(sum);
  }
}

// Packed layout: the weights of kNR = 8 output rows interleaved, so that one 32-byte vector
// holds four consecutive quants of each of the 8 rows and a vpdpbusd against four bytes of x
// broadcast leaves row i's partial dot product in int32 lane i: after a block's 32 weights, the
// lanes are 8 rows' dot products, scaled by 8 scales at once, with no horizontal sums. Per row
// group (8 rows, zero rows padding the last) and block kb of 32 weights, `packed_bytes(kind)`:
//
//   d[8] half | Q4_1: m[8] half | quants
//   Q4_0 / Q4_1 quants: 4 chunks of 32 bytes; byte p of chunk t holds, for row p / 4, weight
//                       4t + p % 4 in its low nibble and weight 4(t + 4) + p % 4 in its high one
//   Q8_0 quants:        8 chunks of 32 bytes; byte p of chunk g: row p / 4, weight 4g + p % 4
constexpr int kNR = 8;

constexpr int64_t packed_bytes(int64_t kind) {
  return kind == 8 ? 16 + 256 : kind == 3 ? 32 + 128 : kind == 12 ? 64 + 128 : 16 + 128;
}

// Quant j of block kb (32 weights) of a row in the file's layout (Q4: 0..15; Q8_0: -128..127).
// Q4_K: super-block kb / 8 (d, dmin half; 12 bytes of 6-bit scales and minimums; 128 bytes of
// quants, 32 per pair of blocks: the even block in the low nibbles, the odd one in the high).
inline int quant(const uint8_t* row, int64_t kind, int64_t kb, int j) {
  if (kind == 12) {
    const uint8_t* qs = row + (kb / 8) * 144 + 16 + 32 * ((kb % 8) / 2);
    return (qs[j] >> (4 * (kb % 2))) & 0x0F;
  }
  const uint8_t* b = row + kb * block_bytes(kind);
  if (kind == 8) return static_cast<int8_t>(b[2 + j]);
  const uint8_t* qs = b + (kind == 3 ? 4 : 2);
  return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
}

// Q4_K block kb's scale d * sc and offset -dmin * m (gguf-py's float32 products).
inline void q4k_scales(const uint8_t* row, int64_t kb, float* d, float* c) {
  const uint8_t* sb = row + (kb / 8) * 144;
  const uint8_t* s = sb + 4;
  const int j = static_cast<int>(kb % 8);
  const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
  const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  *d = half(sb) * static_cast<float>(sc);
  *c = -(half(sb + 2) * static_cast<float>(m));
}

#if defined(__AVX2__)
// acc + eight int32 lanes, each the sum of four products u8 * s8.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// y[m, 8 rows] for MR rows of x (quants xq, row stride K; scales xd / sums xs, stride KB) and
// the row group at wg; `valid` of the 8 outputs are stored.
template <int KIND, int MR>
inline void group_dot(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                      const uint8_t* wg, int64_t KB, float* y, int64_t ldy, const float* bias,
                      int valid) {
  constexpr int64_t PB = packed_bytes(KIND);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* p = wg + kb * PB;
    _mm_prefetch(reinterpret_cast<const char*>(p) + 4 * PB, _MM_HINT_T0);
    const __m256 dw = KIND == 12 ? _mm256_loadu_ps(reinterpret_cast<const float*>(p))
                                 : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const uint8_t* qs = p + (KIND == 12 ? 64 : KIND == 3 ? 32 : 16);
    __m256i dot[MR];
    for (int m = 0; m < MR; ++m) dot[m] = _mm256_setzero_si256();
    if (KIND == 8) {
      for (int g = 0; g < 8; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
        const __m256i u = _mm256_sign_epi8(w, w);  // |w|; -128 stays 0x80 = 128 unsigned
        for (int m = 0; m < MR; ++m)
          dot[m] = dot_u8s8(dot[m], u, _mm256_sign_epi8(bcast4(xq + m * K + kb * kQK + 4 * g), w));
      }
    } else {
      const __m256i mask = _mm256_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
        const __m256i lo = _mm256_and_si256(raw, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xb = xq + m * K + kb * kQK;
          dot[m] = dot_u8s8(dot[m], lo, bcast4(xb + 4 * t));
          dot[m] = dot_u8s8(dot[m], hi, bcast4(xb + 4 * (t + 4)));
        }
      }
    }
    // Q4_1: + m * s; Q4_K: - dmin * m * s; Q4_0: - 8 dw * s (the quants' offset of 8)
    const __m256 c = KIND == 12 ? _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32))
                     : KIND == 3 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))
                                 : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]),
                               _mm256_mul_ps(dw, _mm256_set1_ps(xd[m * KB + kb])), acc[m]);
      if (KIND != 8) acc[m] = _mm256_fmadd_ps(c, _mm256_set1_ps(xs[m * KB + kb]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(32) float out[kNR];
    _mm256_store_ps(out, acc[m]);
    for (int i = 0; i < valid; ++i) y[m * ldy + i] = out[i] + (bias ? bias[i] : 0.f);
  }
}
#else
template <int KIND, int MR>
inline void group_dot(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                      const uint8_t* wg, int64_t KB, float* y, int64_t ldy, const float* bias,
                      int valid) {
  const int64_t PB = packed_bytes(KIND);
  float acc[MR][kNR] = {};
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* p = wg + kb * PB;
    const uint8_t* qs = p + (KIND == 12 ? 64 : KIND == 3 ? 32 : 16);
    for (int i = 0; i < kNR; ++i) {
      float dw, c;
      if (KIND == 12) {
        std::memcpy(&dw, p + 4 * i, 4);
        std::memcpy(&c, p + 32 + 4 * i, 4);
      } else {
        dw = half(p + 2 * i);
        c = KIND == 3 ? half(p + 16 + 2 * i) : -8.f * dw;
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xb = xq + m * K + kb * kQK;
        int dot = 0;
        for (int j = 0; j < kQK; ++j) {
          const int g = j / 4, byte = 4 * i + j % 4;
          const int w = KIND == 8 ? static_cast<int8_t>(qs[32 * g + byte])
                        : g < 4 ? qs[32 * g + byte] & 0x0F : qs[32 * (g - 4) + byte] >> 4;
          dot += w * xb[j];
        }
        acc[m][i] += static_cast<float>(dot) * (dw * xd[m * KB + kb]);
        if (KIND != 8) acc[m][i] += c * xs[m * KB + kb];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < valid; ++i) y[m * ldy + i] = acc[m][i] + (bias ? bias[i] : 0.f);
}
#endif

template <int KIND, int R>
inline void tail(int64_t r, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                 const uint8_t* wg, int64_t KB, float* y, int64_t ldy, const float* bias,
                 int valid) {
  if constexpr (R > 0) {
    if (r == R) return group_dot<KIND, R>(xq, xd, xs, K, wg, KB, y, ldy, bias, valid);
    tail<KIND, R - 1>(r, xq, xd, xs, K, wg, KB, y, ldy, bias, valid);
  }
}

template <int KIND>
void run(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
         const uint8_t* packed, int64_t groups, const Outputs& out) {
  const int64_t KB = K / kQK, group_bytes = KB * packed_bytes(KIND);
  const int64_t grain =
      std::max<int64_t>(1, lamina_ggml::kTaskBytes / std::max<int64_t>(group_bytes, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = packed + g * group_bytes;
      const Outputs::At o = out.at(g, kNR);
      const int valid = static_cast<int>(o.nc);
      int64_t m = 0;
      for (; m + kMR <= M; m += kMR)
        group_dot<KIND, kMR>(xq + m * K, xd + m * KB, xs + m * KB, K, wg, KB, o.y + m * o.ld,
                             o.ld, o.bias, valid);
      if (m < M)
        tail<KIND, kMR - 1>(M - m, xq + m * K, xd + m * KB, xs + m * KB, K, wg, KB,
                            o.y + m * o.ld, o.ld, o.bias, valid);
    }
  });
}

at::Tensor rows_of(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, what,
              ": x must be a float32 CPU tensor");
  TORCH_CHECK(x.size(-1) % kQK == 0, what, ": x's last dimension (", x.size(-1),
              ") must be a multiple of 32");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

// x's rows quantised once per call (ggml's Q8_1 blocks), and the kernel run on them. Plain
// vectors, no tensors: a call costs ~2 us less.
struct Activations {
  int64_t M, K, KB;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  explicit Activations(const at::Tensor& xc)
      : M(xc.size(0)), K(xc.size(1)), KB(K / kQK), q(M * K), d(M * KB), s(M * KB) {
    for (int64_t m = 0; m < M; ++m)
      quantize_row(xc.data_ptr<float>() + m * K, K, q.data() + m * K, d.data() + m * KB,
                   s.data() + m * KB);
  }
  void apply(int64_t kind, const at::Tensor& packed, const Outputs& out) const {
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const int64_t groups = packed.size(0);
    if (kind == 2) run<2>(q.data(), d.data(), s.data(), M, K, wp, groups, out);
    else if (kind == 3) run<3>(q.data(), d.data(), s.data(), M, K, wp, groups, out);
    else if (kind == 12) run<12>(q.data(), d.data(), s.data(), M, K, wp, groups, out);
    else run<8>(q.data(), d.data(), s.data(), M, K, wp, groups, out);
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  const at::Tensor xc = rows_of(x, "quantize_q8");
  const int64_t M = xc.size(0), K = xc.size(1), KB = K / kQK;
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, KB}, xc.options()), s = at::empty({M, KB}, xc.options());
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xc.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K,
                 d.data_ptr<float>() + m * KB, s.data_ptr<float>() + m * KB);
  return {q, d, s};
}

at::Tensor pack_q8_weight(const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
              blocks.is_contiguous(),
              "pack_q8_weight: blocks must be contiguous uint8 [N, K / 32 * block bytes]");
  const int64_t bb = block_bytes(kind), pb = packed_bytes(kind);
  const int64_t unit = kind == 12 ? 144 : bb;  // Q4_K: whole super-blocks of 256 weights
  TORCH_CHECK(blocks.size(1) % unit == 0, "pack_q8_weight: rows of ", blocks.size(1),
              " bytes are not whole blocks of ", unit);
  const int64_t N = blocks.size(0), KB = blocks.size(1) / bb, groups = (N + kNR - 1) / kNR;
  at::Tensor packed = at::zeros({groups, KB * pb}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kNR, i = n % kNR;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* row = src + n * KB * bb;
      uint8_t* p = dst + g * KB * pb + kb * pb;
      if (kind == 12) {  // float32 d * sc and -dmin * m
        float d, c;
        q4k_scales(row, kb, &d, &c);
        std::memcpy(p + 4 * i, &d, 4);
        std::memcpy(p + 32 + 4 * i, &c, 4);
      } else {
        const uint8_t* b = row + kb * bb;
        std::memcpy(p + 2 * i, b, 2);                          // d
        if (kind == 3) std::memcpy(p + 16 + 2 * i, b + 2, 2);  // m
      }
      uint8_t* qs = p + (kind == 12 ? 64 : kind == 3 ? 32 : 16);
      for (int j = 0; j < kQK; ++j) {
        const int chunk = j / 4, byte = 4 * static_cast<int>(i) + j % 4;
        const int q = quant(row, kind, kb, j);
        if (kind == 8) qs[32 * chunk + byte] = static_cast<uint8_t>(q);
        else if (chunk < 4) qs[32 * chunk + byte] |= static_cast<uint8_t>(q);
        else qs[32 * (chunk - 4) + byte] |= static_cast<uint8_t>(q << 4);
      }
    }
  }
  return packed;
}

at::Tensor quant_linear_q8(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           int64_t kind, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
              packed.is_contiguous(), "quant_linear_q8: packed must be pack_q8_weight's tensor");
  block_bytes(kind);  // a supported kind, or the error
  const int64_t pb = packed_bytes(kind);
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.size(0) == (N + kNR - 1) / kNR && packed.size(1) * kQK == K * pb,
              "quant_linear_q8: x has ", K, " inputs and N = ", N, "; packed is ",
              packed.sizes(), " (", pb, " bytes per 8 rows x 32 weights)");
  const Activations a(rows_of(x, "quant_linear_q8"));
  const int64_t M = a.M;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  c10::optional<at::Tensor> bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_q8: bias must have N = ", N, " values");
    bc = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bc ? bc->data_ptr<float>() : nullptr;
  if (M > 0 && N > 0)
    a.apply(kind, packed, Outputs::one(y.data_ptr<float>(), N, bp));
  return y.view(shape);
}

std::vector<at::Tensor> quant_linear_q8_group(const at::Tensor& x, const at::Tensor& packed,
                                              const std::vector<int64_t>& ns, int64_t kind) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
              packed.is_contiguous(),
              "quant_linear_q8_group: packed must be pack_q8_weight's tensor");
  block_bytes(kind);  // a supported kind, or the error
  const int64_t pb = packed_bytes(kind), K = x.size(-1);
  TORCH_CHECK(packed.size(1) * kQK == K * pb, "quant_linear_q8_group: x has ", K,
              " inputs; packed is ", packed.sizes());
  const Activations a(rows_of(x, "quant_linear_q8_group"));
  Outputs out;
  std::vector<at::Tensor> ys;
  const int64_t covered = out.add_group(ns, a.M, kNR, ys, x.options());
  TORCH_CHECK(covered == packed.size(0), "quant_linear_q8_group: the Ns (", covered,
              " groups of 8 rows) do not match the packed weights (", packed.size(0), ")");
  if (a.M > 0) a.apply(kind, packed, out);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  for (at::Tensor& y : ys) {
    shape.back() = y.size(1);
    y = y.view(shape);
  }
  return ys;
}
