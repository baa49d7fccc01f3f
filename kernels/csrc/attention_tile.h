// Multi-query tiles of the CPU paged attention kernel (paged_attention_cpu.cpp): the inner loops
// of a work item whose KV head serves many query vectors (a prefill chunk's rows, a cascade's
// shared prefix read for a whole group of requests), written as two small matrix products per
// block of keys instead of one dot product per (query, key).
//
// Layout: a head's query vectors are packed once per item, transposed, as qt[D][ld] (ld: the
// head's mh query vectors rounded up to whole vectors, padding columns zero). A block's scores
// are st[j][c] = k_j . q_c, one row per key, so the online softmax runs down the columns with
// whole vectors (W queries at a time) and the weights st[j][c] are read back by broadcast.
//   scores:  KJ keys x QV vectors of queries accumulate in registers over d (each K element
//            broadcast once, each q vector loaded once per KJ keys);
//   values:  MB queries x DV vectors of the head dim accumulate over the block's keys (each V
//            vector loaded once per MB queries).
// Both are fused-multiply-add bound, not load bound, where the per-query kernels
// (paged_attention_cpu.cpp's Simd) pay a load per FMA and a horizontal reduction per score.
// K and V rows that are not float32 are widened into a float32 block once per block and head.
//
// Arithmetic: float32 throughout, sums over d in order (one FMA chain per score); an 8-bit
// pool's key scale multiplies its scores and its value scale the softmax weights, after the sum
// (as the per-query kernels do). Softcapping is not handled here (the caller keeps those items
// on the per-query path).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

#if LAMINA_SIMD
namespace lamina_tile {

using lamina_simd::Vec;

constexpr int kKJ = Vec::kRegs >= 32 ? 12 : 6;  // keys per scores tile, queries per values tile
constexpr int kQV = 2;                           // vectors of queries (scores) / of d (values)
constexpr int kRowsMax = 32;  // most keys of one block (paged_attention_cpu.cpp's kBlock)

// Brings the D floats at row into L1 (asm volatile: GCC drops prefetch builtins it deems pure).
inline void prefetch_row(const float* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * int64_t(sizeof(float)); b += 64)
    asm volatile("prefetcht0 %0" : : "m"(p[b]));
}

// st[jj * ld + v * W + i] = k[jj] . qt[:, v * W + i] for jj < KJ, v < QV (k[jj]: D floats).
template <int KJ, int QV>
inline void qk_tile(const float* const* k, const float* qt, int64_t D, int64_t ld, float* st) {
  Vec::R acc[KJ][QV];
  for (int jj = 0; jj < KJ; ++jj)
    for (int v = 0; v < QV; ++v) acc[jj][v] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    Vec::R q[QV];
    for (int v = 0; v < QV; ++v) q[v] = Vec::load(qt + d * ld + v * Vec::W);
    for (int jj = 0; jj < KJ; ++jj) {
      const Vec::R kb = Vec::set1(k[jj][d]);
      for (int v = 0; v < QV; ++v) acc[jj][v] = Vec::fmadd(kb, q[v], acc[jj][v]);
    }
  }
  for (int jj = 0; jj < KJ; ++jj)
    for (int v = 0; v < QV; ++v) Vec::store(st + jj * ld + v * Vec::W, acc[jj][v]);
}

// Scores of KJ keys against every column of qt.
template <int KJ>
inline void qk_rows(const float* const* k, const float* qt, int64_t D, int64_t ld, float* st) {
  int64_t c = 0;
  for (; c + kQV * Vec::W <= ld; c += kQV * Vec::W) qk_tile<KJ, kQV>(k, qt + c, D, ld, st + c);
  for (; c < ld; c += Vec::W) qk_tile<KJ, 1>(k, qt + c, D, ld, st + c);
}

// The last n < KJ keys of a block (N counts down to n at compile time).
template <int N = kKJ - 1>
inline void qk_tail(int n, const float* const* k, const float* qt, int64_t D, int64_t ld,
                    float* st) {
  if constexpr (N >= 1) {
    if (n == N) return qk_rows<N>(k, qt, D, ld, st);
    qk_tail<N - 1>(n, k, qt, D, ld, st);
  }
}

// o[mm * D + x] = a[mm] * o[mm * D + x] + sum_j p[j * ld + mm] * vrow[j][x], x = v * W + i,
// mm < MB, v < DV, j < nb (a[mm]: the block's rescale of query mm's earlier sum).
template <int MB, int DV>
inline void pv_tile(const float* p, int64_t ld, const float* const* vrow, int nb, float* o,
                    int64_t D, const float* a) {
  Vec::R acc[MB][DV];
  for (int mm = 0; mm < MB; ++mm) {
    const Vec::R am = Vec::set1(a[mm]);
    for (int v = 0; v < DV; ++v) acc[mm][v] = Vec::mul(Vec::load(o + mm * D + v * Vec::W), am);
  }
  for (int j = 0; j < nb; ++j) {
    Vec::R x[DV];
    for (int v = 0; v < DV; ++v) x[v] = Vec::load(vrow[j] + v * Vec::W);
    for (int mm = 0; mm < MB; ++mm) {
      const Vec::R pb = Vec::set1(p[j * ld + mm]);
      for (int v = 0; v < DV; ++v) acc[mm][v] = Vec::fmadd(pb, x[v], acc[mm][v]);
    }
  }
  for (int mm = 0; mm < MB; ++mm)
    for (int v = 0; v < DV; ++v) Vec::store(o + mm * D + v * Vec::W, acc[mm][v]);
}

// MB queries' rows of o over the whole head dim.
template <int MB>
inline void pv_rows(const float* p, int64_t ld, const float* const* vrow, int nb, float* o,
                    int64_t D, const float* a) {
  const float* v[kRowsMax];
  int64_t d = 0;
  for (; d + kQV * Vec::W <= D; d += kQV * Vec::W) {
    for (int j = 0; j < nb; ++j) v[j] = vrow[j] + d;
    pv_tile<MB, kQV>(p, ld, v, nb, o + d, D, a);
  }
  for (; d < D; d += Vec::W) {
    for (int j = 0; j < nb; ++j) v[j] = vrow[j] + d;
    pv_tile<MB, 1>(p, ld, v, nb, o + d, D, a);
  }
}

template <int N = kKJ - 1>
inline void pv_tail(int n, const float* p, int64_t ld, const float* const* vrow, int nb,
                    float* o, int64_t D, const float* a) {
  if constexpr (N >= 1) {
    if (n == N) return pv_rows<N>(p, ld, vrow, nb, o, D, a);
    pv_tail<N - 1>(n, p, ld, vrow, nb, o, D, a);
  }
}

// Rows of float32 for a block: a float32 pool's own rows, or the block widened into `pack`;
// out[j] for nb <= j < nbp points at `zero` (D zeros).
template <typename T>
inline void float_rows(const T* const* rows, int64_t off, int nb, int nbp, int64_t D,
                       float* pack, const float* zero, const float** out) {
  for (int j = 0; j < nb; ++j) {
    const T* r = rows[j] + off;
    if constexpr (std::is_same_v<T, float>) {
      out[j] = r;
    } else {
      float* dst = pack + j * D;
      for (int64_t d = 0; d < D; d += Vec::W) Vec::store(dst + d, Vec::load(r + d));
      out[j] = dst;
    }
  }
  for (int j = nb; j < nbp; ++j) out[j] = zero;
}

// One item's tile state: per KV head h, qt[h] ([D][ld]), the running max and sum of each column.
struct Tile {
  int64_t D = 0, ld = 0, mh = 0;
  std::vector<float> qt, mx, l, alpha, st, kpack, vpack, zero;
  std::vector<const float*> krows, vrows;

  static constexpr int kRowsPad = (kRowsMax + kKJ - 1) / kKJ * kKJ;

  // Packs the nh heads' query vectors q[(h * mh + c) * D + d] (pre-scaled float32).
  void begin(const float* q, int64_t nh, int64_t mh_, int64_t D_) {
    D = D_, mh = mh_, ld = (mh + Vec::W - 1) / Vec::W * Vec::W;
    qt.resize(nh * D * ld);  // every element written below: rows in order, padding zero
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t d = 0; d < D; ++d) {
        float* row = qt.data() + (h * D + d) * ld;
        const float* src = q + h * mh * D + d;
        for (int64_t c = 0; c < mh; ++c) row[c] = src[c * D];
        std::fill(row + mh, row + ld, 0.f);
      }
    mx.assign(nh * ld, -std::numeric_limits<float>::infinity());
    l.assign(nh * ld, 0.f);
    alpha.resize(ld);
    st.resize(kRowsPad * ld);
    kpack.resize(kRowsPad * D);
    vpack.resize(kRowsPad * D);
    zero.assign(D, 0.f);
    krows.resize(kRowsPad);
    vrows.resize(kRowsPad);
  }

  // One block of nb keys for head h: k/v rows (+ off), their scales (8-bit pools, else
  // nullptr: ksc[j][head]), the key index j0 of row 0 and, when `masked`, each column's visible
  // range [lo[c], hi[c]); o: the head's mh rows of [D] (unnormalised, rescaled here);
  // step(): called steps(nb) times, spread over the block's work (the caller prefetches a share
  // of the next block's lines each time: in one burst they stall on the miss buffers).
  int steps(int nb) const { return (nb + kKJ - 1) / kKJ + static_cast<int>((mh + kKJ - 1) / kKJ); }

  template <typename KT, typename VT, typename Step>
  void block(int64_t h, const KT* const* k, int64_t koff, const VT* const* v, int64_t voff,
             int nb, const float* const* ksc, const float* const* vsc, int64_t head, int64_t j0,
             bool masked, const int64_t* lo, const int64_t* hi, float* o, Step&& step) {
    const int nbp = (nb + kKJ - 1) / kKJ * kKJ;
    float_rows(k, koff, nb, nbp, D, kpack.data(), zero.data(), krows.data());
    const float* q = qt.data() + h * D * ld;
    float* s = st.data();
    int j = 0;
    for (; j + kKJ <= nb; j += kKJ) {  // the next keys' rows come into L1 meanwhile
      for (int r = j + kKJ; r < std::min(j + 2 * kKJ, nb); ++r) prefetch_row(krows[r], D);
      step();
      qk_rows<kKJ>(krows.data() + j, q, D, ld, s + j * ld);
    }
    if (j < nb) {
      step();
      qk_tail(nb - j, krows.data() + j, q, D, ld, s + j * ld);
    }
    if (ksc)
      for (int r = 0; r < nb; ++r) scale_row(s + r * ld, ksc[r][head]);
    if (masked)
      for (int r = 0; r < nb; ++r)
        for (int64_t c = 0; c < mh; ++c)
          if (j0 + r < lo[c] || j0 + r >= hi[c])
            s[r * ld + c] = -std::numeric_limits<float>::infinity();
    float_rows(v, voff, nb, nb, D, vpack.data(), zero.data(), vrows.data());
    // A float32 pool's V rows come into L1 during the softmax (a widened block is there).
    softmax(nb, mx.data() + h * ld, l.data() + h * ld, std::is_same_v<VT, float>);
    if (vsc)
      for (int r = 0; r < nb; ++r) scale_row(s + r * ld, vsc[r][head]);
    int64_t c = 0;
    for (; c + kKJ <= mh; c += kKJ) {
      step();
      pv_rows<kKJ>(s + c, ld, vrows.data(), nb, o + c * D, D, alpha.data() + c);
    }
    if (c < mh) {
      step();
      pv_tail(static_cast<int>(mh - c), s + c, ld, vrows.data(), nb, o + c * D, D,
              alpha.data() + c);
    }
  }

  // The running max and sum of head h's columns, into mx_out[c], l_out[c] (c < mh).
  void end(int64_t h, float* mx_out, float* l_out) const {
    std::copy(mx.begin() + h * ld, mx.begin() + h * ld + mh, mx_out);
    std::copy(l.begin() + h * ld, l.begin() + h * ld + mh, l_out);
  }

 private:
  void scale_row(float* row, float f) const {
    const Vec::R fv = Vec::set1(f);
    for (int64_t c = 0; c < ld; c += Vec::W) Vec::store(row + c, Vec::mul(Vec::load(row + c), fv));
  }

  // Online softmax down the columns of st[0:nb][0:ld]: st becomes the weights
  // exp(s - max); mx, l are updated and alpha holds each column's rescale of its earlier sum.
  // fetch_v: the V rows (vrows) are prefetched into L1 meanwhile, one row per key.
  // A column that has seen only -inf keeps max -inf and weights 0 (its base is -FLT_MAX).
  void softmax(int nb, float* m, float* lsum, bool fetch_v) {
    int64_t c = 0;
    for (; c + 4 * Vec::W <= ld; c += 4 * Vec::W) columns<4>(nb, c, m, lsum, fetch_v && c == 0);
    for (; c < ld; c += Vec::W) columns<1>(nb, c, m, lsum, fetch_v && c == 0);
  }

  // softmax() on the NV column vectors from c: NV independent max and sum chains (each column's
  // sum still runs down its rows in order).
  template <int NV>
  void columns(int nb, int64_t c, float* m, float* lsum, bool fetch_v) {
    float* s = st.data() + c;
    Vec::R bmax[NV], mnew[NV], base[NV], sum[NV];
    for (int v = 0; v < NV; ++v) bmax[v] = Vec::set1(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < nb; ++r) {
      if (fetch_v) prefetch_row(vrows[r], D);
      for (int v = 0; v < NV; ++v) bmax[v] = Vec::max(bmax[v], Vec::load(s + r * ld + v * Vec::W));
    }
    for (int v = 0; v < NV; ++v) {
      mnew[v] = Vec::max(Vec::load(m + c + v * Vec::W), bmax[v]);
      base[v] = Vec::max(mnew[v], Vec::set1(-FLT_MAX));
      sum[v] = Vec::zero();
    }
    for (int r = 0; r < nb; ++r)
      for (int v = 0; v < NV; ++v) {
        const Vec::R p = Vec::exp_nonpos(Vec::sub(Vec::load(s + r * ld + v * Vec::W), base[v]));
        Vec::store(s + r * ld + v * Vec::W, p);
        sum[v] = Vec::add(sum[v], p);
      }
    for (int v = 0; v < NV; ++v) {
      const int64_t cv = c + v * Vec::W;
      const Vec::R a = Vec::exp_nonpos(Vec::sub(Vec::load(m + cv), base[v]));
      Vec::store(alpha.data() + cv, a);
      Vec::store(lsum + cv, Vec::fmadd(Vec::load(lsum + cv), a, sum[v]));
      Vec::store(m + cv, mnew[v]);
    }
  }
};

}  // namespace lamina_tile
#endif  // LAMINA_SIMD
