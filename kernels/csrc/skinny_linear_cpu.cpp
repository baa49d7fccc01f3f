// Linear layers for decode-sized batches on CPU (lamina issue 19): y[M,N] = x[M,K] @ w[N,K]^T.
//
// A decode step multiplies a few rows (one per request of a micro-batch) by every weight of the
// model, so it streams the weights from memory once per step and does little work per byte.
// BLAS libraries tune for square-ish problems; at M <= 64 they reach a fraction of what either
// memory bandwidth or the FMA units allow. This kernel is the BLIS/GotoBLAS micro-kernel shape
// specialised for that case:
//
// * pack_linear_weight(w[N,K]) -> panels[P, K, kNR] (P = ceil(N / kNR), zero-padded rows past
//   N): panel p holds rows p*kNR .. p*kNR+kNR-1 of w, transposed, so the kernel reads every
//   panel front to back, one cache line per k. float32 or bfloat16 (kept as bfloat16: half the
//   bytes; widened to float32 exactly in registers).
// * skinny_linear(x[M,K] float32, panels, N, bias?) -> y[M,N] float32: for each panel (threads
//   split the panels: at::parallel_for), for each block of up to kMaxMR rows of x (12 with
//   AVX-512, 2 with AVX2), kMR x kNR float32 accumulators live in registers; each step over k
//   loads one panel row (kNR weights) and broadcasts one x value per row. The panel
//   (K * kNR * 4 bytes <= 256 KB for K <= 2048) stays in L2 while the row blocks reuse it, so
//   memory traffic is the weights once.
//
// Accumulation is float32 in k order per output, as a naive loop would: results differ from
// MKL/oneDNN only by float rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

constexpr int64_t kNR = 32;   // output columns per panel (two AVX-512 / four AVX2 vectors)

#if LAMINA_SIMD
using lamina_simd::Vec;
constexpr int kNV = kNR / Vec::W;  // vectors per panel row
// Rows of x per register block: MR * kNV accumulators, plus the panel row and x broadcasts.
constexpr int kMaxMR = Vec::kRegs == 32 ? 12 : 2;

// y[m, 0:ncols] (+)= sum_k x[m, k] * panel[k, 0:ncols] for m < MR.
template <int MR, typename W>
inline void block(const float* x, int64_t ldx, const W* panel, int64_t K, float* y, int64_t ldy,
                  int64_t ncols, const float* bias) {
  Vec::R acc[MR][kNV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) acc[m][v] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    const W* w = panel + k * kNR;
    Vec::R wv[kNV];
    for (int v = 0; v < kNV; ++v) {
      wv[v] = Vec::load(w + v * Vec::W);
      // In a register, once: left alone, GCC folds the load into every row's FMA, and the
      // loads, not the FMAs, then bound the loop.
      asm("" : "+x"(wv[v]));
    }
    for (int m = 0; m < MR; ++m) {
      const Vec::R xv = Vec::set1(x[m * ldx + k]);
      for (int v = 0; v < kNV; ++v) acc[m][v] = Vec::fmadd(xv, wv[v], acc[m][v]);
    }
  }
  alignas(64) float b[kNR] = {};
  if (bias != nullptr) std::copy(bias, bias + ncols, b);
  for (int m = 0; m < MR; ++m) {
    if (ncols == kNR) {
      for (int v = 0; v < kNV; ++v)
        Vec::store(y + m * ldy + v * Vec::W, Vec::add(acc[m][v], Vec::load(b + v * Vec::W)));
    } else {  // the last panel: only ncols columns exist
      alignas(64) float row[kNR];
      for (int v = 0; v < kNV; ++v) Vec::store(row + v * Vec::W, acc[m][v]);
      for (int64_t j = 0; j < ncols; ++j) y[m * ldy + j] = row[j] + b[j];
    }
  }
}
#else
constexpr int kMaxMR = 12;

template <int MR, typename W>
inline void block(const float* x, int64_t ldx, const W* panel, int64_t K, float* y, int64_t ldy,
                  int64_t ncols, const float* bias) {
  float acc[MR][kNR] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* w = panel + k * kNR;
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < kNR; ++j) acc[m][j] += xv * static_cast<float>(w[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < ncols; ++j) y[m * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}
#endif

template <typename W, int MR = kMaxMR>
inline void block_dispatch(int mr, const float* x, int64_t ldx, const W* panel, int64_t K,
                           float* y, int64_t ldy, int64_t ncols, const float* bias) {
  if constexpr (MR >= 1) {
    if (mr == MR) return block<MR, W>(x, ldx, panel, K, y, ldy, ncols, bias);
    return block_dispatch<W, MR - 1>(mr, x, ldx, panel, K, y, ldy, ncols, bias);
  }
}

template <typename W>
void run(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* bias,
         at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const float* xp = x.data_ptr<float>();
  const W* pp = panels.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  // Row blocks of (nearly) equal size, at most kMaxMR rows each.
  const int64_t nblocks = (M + kMaxMR - 1) / kMaxMR;
  const int64_t base = M / nblocks, extra = M % nblocks;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR, ncols = std::min(kNR, N - n0);
      int64_t m0 = 0;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int mr = static_cast<int>(base + (b < extra ? 1 : 0));
        block_dispatch<W>(mr, xp + m0 * K, K, pp + p * K * kNR, K, yp + m0 * N + n0, N, ncols,
                          bias ? bias + n0 : nullptr);
        m0 += mr;
      }
    }
  });
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: weight must be [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "pack_linear_weight: weight must be float32 or bfloat16");
  TORCH_CHECK(w.device().is_cpu(), "pack_linear_weight: weight must be on the CPU");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kNR - 1) / kNR;
  at::Tensor padded = at::zeros({P * kNR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [P, kNR, K] -> [P, K, kNR]
  return padded.view({P, kNR, K}).transpose(1, 2).contiguous();
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "skinny_linear: x must be a float32 CPU matrix [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kNR && panels.is_contiguous(),
              "skinny_linear: panels must come from pack_linear_weight");
  TORCH_CHECK(panels.size(1) == x.size(1), "skinny_linear: x has ", x.size(1),
              " columns, the weight ", panels.size(1));
  TORCH_CHECK(N > (panels.size(0) - 1) * kNR && N <= panels.size(0) * kNR,
              "skinny_linear: N does not match the packed weight");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat,
                "skinny_linear: bias must be float32 [N]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  switch (panels.scalar_type()) {
    case at::kFloat: run<float>(xc, panels, N, bp, y); break;
    case at::kBFloat16: run<c10::BFloat16>(xc, panels, N, bp, y); break;
    default: TORCH_CHECK(false, "skinny_linear: packed weight must be float32 or bfloat16");
  }
  return y;
}
