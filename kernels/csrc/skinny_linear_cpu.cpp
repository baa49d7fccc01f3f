// Linear layers for decode-sized batches on CPU (lamina issue 19): y[M,N] = x[M,K] @ w[N,K]^T.
//
// A decode step multiplies a few rows (one per request of a micro-batch) by every weight of the
// model, so it streams the weights from memory once per step and does little work per byte.
// BLAS libraries tune for square-ish problems; at M <= 64 they reach a fraction of what either
// memory bandwidth or the FMA units allow. Two register-blocked kernels, one per instruction
// set, both reading every weight from memory once per call:
//
// * AVX-512 (and the plain loops): the BLIS/GotoBLAS broadcast shape.
//   pack_linear_weight(w[N,K]) -> panels[P, K, 32, 1] (P = ceil(N / 32), zero-padded rows past
//   N): panel p holds rows 32p .. 32p+31 of w, transposed. For each block of up to 12 rows of
//   x, 12 x 32 float32 accumulators live in registers; each step over k loads one panel row and
//   broadcasts one x value per row. The panel (K * 128 bytes) stays in L2 while the row blocks
//   reuse it. The first row block prefetches the weight stream 8 KB ahead (the hardware
//   prefetcher alone restarts at every 4 KB page).
// * AVX2 + FMA: the dot-product shape (on the AVX2 machines measured, a broadcast from memory
//   issues about once per two cycles, which held the broadcast shape far below FMA peak).
//   pack_linear_weight -> panels[P, KG, 6, 8] (P = ceil(N / 6), KG = ceil(K / 8), zeros past N
//   and K): panel p holds rows 6p .. 6p+5 of w, eight k at a time, so a panel is one sequential
//   stream. For each block of 2 rows of x, 2 x 6 accumulators hold 8 partial sums each; a step
//   loads 8 k of both x rows and of the 6 weight rows and does 12 FMAs, no broadcasts; the sums
//   are reduced across lanes once per block. With several row blocks the kernel prefetches the
//   next panel while it computes this one (spread over the blocks' steps), so the weight stream
//   overlaps the arithmetic instead of alternating with it.
//
// skinny_linear(x[M,K], panels, N, bias?) -> y[M,N] in x's dtype, float32 or bfloat16 (the
// math is float32 either way; a bfloat16 result is rounded once at the end; x must have the packed
// weight's K; the AVX2 layout only records ceil(K / 8) and the AMX one ceil(K / 32), so they
// cannot tell K from K rounded up, where the weight's padding is zeros); threads split the panels
// (at::parallel_for). float32 or bfloat16 panels (bfloat16: half the bytes, widened to float32
// exactly in registers). Accumulation is float32; the order of the additions differs from
// MKL/oneDNN (and between the two shapes), so results differ by float rounding only.
// * AMX-BF16 (TDPBF16PS), bfloat16 weights where the CPU has AMX and the OS grants the tile
//   state: pack_linear_weight -> panels[P, KG, 32, 2] (KG = ceil(K / 2) rounded up to 16):
//   pairs of k, so 16 steps of a panel half are one B tile. x is rounded to bfloat16 once per
//   call (round to nearest even: exact for a bfloat16 model's activations); for each block of
//   up to 16 rows two tiles accumulate the panel's 32 outputs in float32 (denormals flushed,
//   as the instruction does). Widening bfloat16 in registers is compute-bound from a few rows
//   on; AMX stays near the weight stream's read time to 16-32 rows (README, "bfloat16 on CPU";
//   AVX512-BF16's vdpbf16ps on the broadcast shape measured slower than widening).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "linear_outputs.h"
#include "simd.h"

namespace {

using lamina_linear::Outputs;

#if LAMINA_AVX2
// ---- AVX2: the dot-product shape (see the top of the file) ----------------------------------
using lamina_simd::Vec;
constexpr int64_t kLanes = Vec::W;  // k per step
constexpr int64_t kNR = 6;          // weight rows per panel
constexpr int kMR = 2;              // rows of x per block: 2 x 6 accumulators, 2 x, 1 weight

// acc[m][n] += x[m, k:k+8] * w[n, k:k+8] for one step (w: the step's kNR x kLanes weights).
template <int MR, typename W>
inline void step(Vec::R (&acc)[MR][kNR], const Vec::R (&xv)[MR], const W* w) {
  for (int n = 0; n < kNR; ++n) {
    Vec::R wv = Vec::load(w + n * kLanes);
    // In a register, once: left alone, GCC folds the load into every row's FMA, and the
    // loads, not the FMAs, then bound the loop.
    asm("" : "+x"(wv));
    for (int m = 0; m < MR; ++m) acc[m][n] = Vec::fmadd(xv[m], wv, acc[m][n]);
  }
}

// y[m, 0:nc] = x[m] . panel rows (+ bias) for m < MR. Issues up to lpi prefetches per step
// from pf (advanced) while pf < pf_end.
template <int MR, typename W>
inline void block(const float* x, int64_t ldx, int64_t K, const W* panel, int64_t KG, float* y,
                  int64_t ldy, int nc, const float* bias, const char*& pf_io, const char* pf_end,
                  int lpi) {
  Vec::R acc[MR][kNR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n) acc[m][n] = Vec::zero();
  const int64_t full = K / kLanes;  // steps with kLanes columns of x
  const char* pf = pf_io;
  for (int64_t g = 0; g < full; ++g) {
    Vec::R xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = Vec::load(x + m * ldx + g * kLanes);
    for (int i = 0; i < lpi; ++i) {
      if (pf < pf_end) {
        _mm_prefetch(pf, _MM_HINT_T0);
        pf += 64;
      }
    }
    step<MR, W>(acc, xv, panel + g * kNR * kLanes);
  }
  pf_io = pf;
  if (full < KG) {  // the last step is partial: x padded with zeros (the panel already is)
    Vec::R xv[MR];
    alignas(64) float t[kLanes];
    for (int m = 0; m < MR; ++m) {
      for (int64_t i = 0; i < kLanes; ++i)
        t[i] = full * kLanes + i < K ? x[m * ldx + full * kLanes + i] : 0.f;
      xv[m] = Vec::load(t);
    }
    step<MR, W>(acc, xv, panel + full * kNR * kLanes);
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < nc; ++n) y[m * ldy + n] = Vec::hsum(acc[m][n]) + (bias ? bias[n] : 0.f);
}

template <typename W>
void run(const at::Tensor& x, const at::Tensor& panels, const Outputs& out) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), KG = panels.size(1);
  const float* xp = x.data_ptr<float>();
  const W* pp = panels.data_ptr<W>();
  const int64_t nblocks = (M + kMR - 1) / kMR, panel_elems = KG * kNR * kLanes;
  // With one block the weight stream is all there is: the hardware prefetcher keeps up.
  // With several, the next panel's lines are spread over all the steps of this panel.
  const int64_t lines = nblocks > 1 ? panel_elems * static_cast<int64_t>(sizeof(W)) / 64 : 0;
  const int lpi = static_cast<int>((lines + nblocks * KG - 1) / (nblocks * KG));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = pp + p * panel_elems;
      const Outputs::At o = out.at(p, kNR);
      const int nc = static_cast<int>(o.nc);
      const char* pf = reinterpret_cast<const char*>(panel + panel_elems);
      const char* pf_end = p + 1 < p1 ? pf + lines * 64 : pf;
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const float* xb = xp + m0 * K;
        float* yb = o.y + m0 * o.ld;
        if (M - m0 >= kMR)
          block<kMR, W>(xb, K, K, panel, KG, yb, o.ld, nc, o.bias, pf, pf_end, lpi);
        else
          block<1, W>(xb, K, K, panel, KG, yb, o.ld, nc, o.bias, pf, pf_end, lpi);
      }
    }
  });
}
#else
// ---- AVX-512 and the plain loops: the broadcast shape -----------------------------------------
constexpr int64_t kLanes = 1;  // k per step
constexpr int64_t kNR = 32;    // output columns per panel (two AVX-512 vectors)

#if LAMINA_AVX512
using lamina_simd::Vec;
constexpr int kNV = kNR / Vec::W;  // vectors per panel row
// Rows of x per register block: MR * kNV accumulators, plus the panel row and x broadcasts.
constexpr int kMaxMR = 12;
// The first row block of a panel prefetches the weight stream this many bytes ahead, into L2.
// Intel's L2 streamer stops at every 4 KB page, so alone it refetches each page's first lines on
// demand; 8 KB ahead keeps the stream going across pages and panels. One pass over SmolLM2's
// weights at 8 rows (Xeon, AVX-512, 1 thread): 60 -> 36 ms, the plain read of the same bytes
// (15 GB/s); at 16 rows 74 -> 49 ms. 2 or 4 KB ahead, or into L1 (T0): 39-41 ms; 16 KB: 36.
constexpr int64_t kPrefetchBytes = 8192;

// y[m, 0:ncols] (+)= sum_k x[m, k] * panel[k, 0:ncols] for m < MR. PF: prefetch the weights
// kPrefetchBytes ahead (past the panel's end: the next panel, which follows it in memory).
template <int MR, bool PF, typename W>
inline void block(const float* x, int64_t ldx, const W* panel, int64_t K, float* y, int64_t ldy,
                  int64_t ncols, const float* bias) {
  constexpr int64_t kRowBytes = kNR * static_cast<int64_t>(sizeof(W));
  Vec::R acc[MR][kNV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) acc[m][v] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    const W* w = panel + k * kNR;
    if constexpr (PF) {
      const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
      for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    }
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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define LAMINA_AMX 1
// ---- AMX-BF16, bfloat16 panels (see the top of the file) -------------------------------------
// Per block of up to 16 rows of x and 16 pairs of k: one tile of x (A: rows x 16 pairs), two of
// the panel (B: 16 pairs x 16 columns, the panel's two halves), two float32 accumulators (C).
constexpr int64_t kPairLanes = 2;   // k per panel step: a bfloat16 pair
constexpr int kAmxRows = 16;        // rows of x per tile
constexpr int64_t kAmxPairs = 16;   // pairs of k per tile (pack pads KG to a multiple)
constexpr int64_t kPairRowBytes = kNR * kPairLanes * 2;  // one panel step: 128 bytes

struct alignas(64) TileConfig {  // the LDTILECFG layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands the tile state to a process that asks for it (arch_prctl, kernel >= 5.16); where
// it refuses, bfloat16 weights keep the widening layout and kernel.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

void configure_tiles(int mr) {  // C0, C1, A: mr rows of 64 bytes; B0, B1: 16 rows of 64 bytes
  TileConfig c;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 3 ? mr : kAmxPairs);
    c.colsb[t] = 64;
  }
  // GCC 12 does not count the intrinsic as reading c: where it inlined this pattern elsewhere, the
  // stores above were dropped and LDTILECFG faulted on a zero config
  asm volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
}

// x[M, K] (contiguous) -> bfloat16 pairs [M, KG] (zeros past K): pair g of row m holds
// x[m, 2g] low and x[m, 2g + 1] high. A bfloat16 x is copied as it is; a float32 one is rounded
// to nearest even (exact for a bfloat16 model's activations).
std::vector<uint32_t> to_pairs(const at::Tensor& x, int64_t KG) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<uint32_t> out(M * KG);  // zeros
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  if (x.scalar_type() == at::kBFloat16) {
    const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    for (int64_t m = 0; m < M; ++m) std::copy(src + m * K, src + (m + 1) * K, dst + m * KG * 2);
    return out;
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x.data_ptr<float>() + m * K;
    uint16_t* d = dst + m * KG * 2;
    int64_t k = 0;
#if defined(__AVX512BF16__)
    for (; k + 32 <= K; k += 32)  // 32 floats -> 32 bfloat16 in one instruction
      _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16),
                                                            _mm512_loadu_ps(src + k)));
#endif
    for (; k < KG * 2; ++k) d[k] = k < K ? c10::BFloat16(src[k]).x : 0;
  }
  return out;
}

// x: float32 or bfloat16, contiguous (a bfloat16 x goes straight into the pairs).
void run_amx(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* bias,
             at::Tensor& y) {
  const int64_t M = x.size(0), P = panels.size(0), KG = panels.size(1);
  const std::vector<uint32_t> xp = to_pairs(x, KG);
  const c10::BFloat16* pp = panels.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t nblocks = (M + kAmxRows - 1) / kAmxRows;
  const int64_t base = M / nblocks, extra = M % nblocks;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    int configured = 0;  // rows the tiles are configured for (per thread)
    alignas(64) float c[2][kAmxRows][16];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR, ncols = std::min(kNR, N - n0);
      const c10::BFloat16* panel = pp + p * KG * kNR * kPairLanes;
      int64_t m0 = 0;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int mr = static_cast<int>(base + (b < extra ? 1 : 0));
        if (mr != configured) configure_tiles(configured = mr);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t g = 0; g < KG; g += kAmxPairs) {
          const c10::BFloat16* w = panel + g * kNR * kPairLanes;
          if (b == 0) {  // the first block streams the panel: prefetch as block() does
            const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
            for (int64_t o = 0; o < kAmxPairs * kPairRowBytes; o += 64)
              _mm_prefetch(ahead + o, _MM_HINT_T1);
          }
          _tile_loadd(2, xp.data() + m0 * KG + g, KG * 4);
          _tile_loadd(3, w, kPairRowBytes);
          _tile_loadd(4, w + 16 * kPairLanes, kPairRowBytes);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        for (int m = 0; m < mr; ++m)
          for (int64_t j = 0; j < ncols; ++j)
            yp[(m0 + m) * N + n0 + j] = c[j / 16][m][j % 16] + (bias ? bias[n0 + j] : 0.f);
        m0 += mr;
      }
    }
    if (configured) _tile_release();
  });
}
#endif  // LAMINA_AMX
#else
constexpr int kMaxMR = 12;

template <int MR, bool PF, typename W>
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

template <typename W, bool PF, int MR = kMaxMR>
inline void block_dispatch(int mr, const float* x, int64_t ldx, const W* panel, int64_t K,
                           float* y, int64_t ldy, int64_t ncols, const float* bias) {
  if constexpr (MR >= 1) {
    if (mr == MR) return block<MR, PF, W>(x, ldx, panel, K, y, ldy, ncols, bias);
    return block_dispatch<W, PF, MR - 1>(mr, x, ldx, panel, K, y, ldy, ncols, bias);
  }
}

template <typename W>
void run(const at::Tensor& x, const at::Tensor& panels, const Outputs& out) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const float* xp = x.data_ptr<float>();
  const W* pp = panels.data_ptr<W>();
  // Row blocks of (nearly) equal size, at most kMaxMR rows each.
  const int64_t nblocks = (M + kMaxMR - 1) / kMaxMR;
  const int64_t base = M / nblocks, extra = M % nblocks;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Outputs::At o = out.at(p, kNR);
      int64_t m0 = 0;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int mr = static_cast<int>(base + (b < extra ? 1 : 0));
        // the first block streams the panel from memory; the others find it in cache
        (b == 0 ? block_dispatch<W, true> : block_dispatch<W, false>)(
            mr, xp + m0 * K, K, pp + p * K * kNR, K, o.y + m0 * o.ld, o.ld, o.nc, o.bias);
        m0 += mr;
      }
    }
  });
}

#endif  // LAMINA_AVX2

// k per panel step for weights of this dtype (bfloat16 pairs where AMX runs them).
int64_t lanes_for(at::ScalarType dtype) {
#ifdef LAMINA_AMX
  if (dtype == at::kBFloat16 && amx_permitted()) return kPairLanes;
#endif
  (void)dtype;
  return kLanes;
}

// Panel steps for K columns at ``lanes`` k per step (AMX panels hold whole tiles of k).
int64_t steps_for(int64_t lanes, int64_t K) {
  const int64_t KG = (K + lanes - 1) / lanes;
#ifdef LAMINA_AMX
  if (lanes == kPairLanes) return (KG + kAmxPairs - 1) / kAmxPairs * kAmxPairs;
#endif
  return KG;
}

// Every shape shares one layout: panels[P, KG, kNR, lanes] (P = ceil(N / kNR), KG = steps_for
// (lanes, K), zeros past N and K): panel p holds rows p*kNR .. p*kNR+kNR-1 of w, lanes k at a
// time (the broadcast shape: lanes = 1, i.e. the panel transposed; AMX: lanes = 2).
at::Tensor pack(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + kNR - 1) / kNR;
  const int64_t lanes = lanes_for(w.scalar_type()), KG = steps_for(lanes, K);
  at::Tensor padded = at::zeros({P * kNR, KG * lanes}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({P, kNR, KG, lanes}).transpose(1, 2).contiguous();
}

bool panels_match(const at::Tensor& panels, int64_t K) {
  const int64_t lanes = lanes_for(panels.scalar_type());
  return panels.dim() == 4 && panels.size(1) == steps_for(lanes, K) &&
         panels.size(2) == kNR && panels.size(3) == lanes;
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: weight must be [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "pack_linear_weight: weight must be float32 or bfloat16");
  TORCH_CHECK(w.device().is_cpu(), "pack_linear_weight: weight must be on the CPU");
  return pack(w);
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               x.scalar_type() == at::kBFloat16) && x.device().is_cpu(),
              "skinny_linear: x must be a float32 or bfloat16 CPU matrix [M, K]");
  TORCH_CHECK(panels.is_contiguous(),
              "skinny_linear: panels must come from pack_linear_weight");
  TORCH_CHECK(panels_match(panels, x.size(1)), "skinny_linear: x has ", x.size(1),
              " columns, which the packed weight ", panels.sizes(), " does not have");
  TORCH_CHECK(N > (panels.size(0) - 1) * kNR && N <= panels.size(0) * kNR,
              "skinny_linear: N does not match the packed weight");
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));  // float32 math
  if (x.size(0) == 0) return y.to(x.scalar_type());
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && (bias->scalar_type() == at::kFloat ||
                                       bias->scalar_type() == at::kBFloat16),
                "skinny_linear: bias must be float32 or bfloat16 [N]");
    bc = bias->to(at::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
  const Outputs out = Outputs::one(y.data_ptr<float>(), N, bp);
  switch (panels.scalar_type()) {
    case at::kFloat: run<float>(x.to(at::kFloat).contiguous(), panels, out); break;
    case at::kBFloat16:
#ifdef LAMINA_AMX
      if (panels.size(3) == kPairLanes) {  // packed for AMX (panels_match checked the layout)
        run_amx(x.contiguous(), panels, N, bp, y);
        break;
      }
#endif
      run<c10::BFloat16>(x.to(at::kFloat).contiguous(), panels, out);
      break;
    default: TORCH_CHECK(false, "skinny_linear: packed weight must be float32 or bfloat16");
  }
  return y.to(x.scalar_type());  // a bfloat16 x: rounded once, as F.linear rounds its sums
}

// F.linear(x[..., K], weight[N, K], bias) for a node whose weight is packed: the packed kernel
// for up to max_rows rows of float32 x (max_rows_same of x in the weight's own 16-bit dtype),
// ATen's linear for anything else (prefill chunks). One call from the slice: no Python between.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, const at::Tensor& panels,
                         int64_t max_rows, int64_t max_rows_same) {
  const int64_t K = x.size(-1), N = weight.size(0);
  const int64_t rows = K ? x.numel() / K : 0;
  const bool bias_ok = !bias.has_value() || !bias->defined() ||
                       bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16;
  const int64_t limit = x.scalar_type() == at::kFloat ? max_rows
                        : x.scalar_type() == weight.scalar_type() ? max_rows_same : 0;
  if (rows > 0 && rows <= limit && bias_ok && x.device().is_cpu()) {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = N;
    return skinny_linear(x.reshape({rows, K}), panels, N, bias).view(sizes);
  }
  return at::linear(x, weight, bias);
}

std::vector<at::Tensor> skinny_linear_group(const at::Tensor& x, const at::Tensor& panels,
                                            const std::vector<int64_t>& ns) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "skinny_linear_group: x must be a float32 CPU matrix [M, K]");
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == at::kFloat,
              "skinny_linear_group: panels must be float32 weights packed back to back");
  TORCH_CHECK(panels_match(panels, x.size(1)), "skinny_linear_group: x has ", x.size(1),
              " columns, which the packed weights ", panels.sizes(), " do not have");
  Outputs out;
  std::vector<at::Tensor> ys;
  const int64_t covered = out.add_group(ns, x.size(0), kNR, ys, x.options());
  TORCH_CHECK(covered == panels.size(0), "skinny_linear_group: the Ns (", covered,
              " panels) do not match the packed weights (", panels.size(0), " panels)");
  if (x.size(0) > 0) run<float>(x.contiguous(), panels, out);
  return ys;
}

std::vector<at::Tensor> packed_linear_group(const at::Tensor& x,
                                            const std::vector<at::Tensor>& weights,
                                            const at::Tensor& panels, int64_t max_rows) {
  const int64_t K = x.size(-1);
  const int64_t rows = K ? x.numel() / K : 0;
  std::vector<at::Tensor> ys;
  if (rows > 0 && rows <= max_rows && x.scalar_type() == at::kFloat && x.device().is_cpu()) {
    std::vector<int64_t> ns;
    for (const at::Tensor& w : weights) ns.push_back(w.size(0));
    ys = skinny_linear_group(x.reshape({rows, K}), panels, ns);
    std::vector<int64_t> sizes = x.sizes().vec();
    for (at::Tensor& y : ys) {
      sizes.back() = y.size(1);
      y = y.view(sizes);
    }
    return ys;
  }
  for (const at::Tensor& w : weights) ys.push_back(at::linear(x, w));
  return ys;
}
