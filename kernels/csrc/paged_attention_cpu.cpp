// Paged attention on CPU (lamina issue 19): the C++ kernel behind lamina.kernels.cpp_ext.
//
// Contract: lamina/kernels/reference.py (paged_attention_ref). q[T,H,D] (float32, bfloat16 or
// float16), k_pool/v_pool[S,Hkv,D] (last dim contiguous) in one of lamina's KV formats
// (lamina/kernels/kv_format.py): (K, V) float32, bfloat16, int8, float8_e4m3fn, or bfloat16 K with
// int8 V; an 8-bit pool comes with k_scale / v_scale[S,Hkv] float32 (value = element * scale),
// which the kernel applies to the scores (K) and the softmax weights (V), never per element. CSR
// qo_indptr[R+1] / kv_indptr[R+1] / kv_indices[N] (int32 or int64), q_positions[T],
// kv_start_pos[R]. Returns o[T,H,D] in q's dtype and lse[T,H] float32 (natural log); a query
// that sees no key gets o = 0 and lse = -inf. A query at position p sees the request's keys at
// positions kv_start_pos[r] + j <= p and, with a window w, p - (kv_start_pos[r] + j) < w.
//
// Work items are (request, KV head, query tile[, KV split]). An item holds every query vector
// of its tile that shares its KV head (the GQA group of each of up to kMaxTile / G query rows),
// so each K/V row is read from memory once per tile, and walks the visible keys in blocks of
// kBlock with an online softmax (running max and sum, float32 accumulation). Items are handed
// out dynamically (an atomic counter, largest first) inside one at::parallel_for, so
// torch.set_num_threads governs the thread count. When there are fewer items than threads can
// share well, long items are split along the keys and merged by log-sum-exp afterwards.
//
// An item with at least kTileMin query vectors per KV head (prefill chunks, a cascade's shared
// prefix) runs the tile kernels of attention_tile.h: per block, scores and the weighted sum of V
// as two register-blocked matrix products, the online softmax down whole vectors of queries.
// Fewer (a decode step's GQA group) run the per-query kernels below.
//
// SIMD: lamina_simd::Vec (simd.h), the widest vector the compiler targets (-march=native):
// AVX-512 (16 lanes) or AVX2 + FMA (8 lanes), for head_dim a multiple of the lane count; the
// same blocking sized to each one's registers. Otherwise plain loops that the compiler
// vectorises for whatever -march allows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_tile.h"
#include "simd.h"

namespace {

constexpr int kBlock = 32;         // keys per online-softmax block
constexpr int kMaxTile = 96;     // query vectors per tile (a tile holds at least one GQA group)
constexpr int kGroup = 4;        // query vectors per register group in the inner kernels
constexpr int64_t kSplitMin = 256;  // fewest keys in one KV split
constexpr int64_t kRowBytes = 2048;  // most bytes of a token row (per pool) one item reads
#ifndef LAMINA_TILE_MIN  // (-DLAMINA_TILE_MIN=n: a build for comparing the two paths)
#define LAMINA_TILE_MIN 12
#endif
constexpr int64_t kTileMin = LAMINA_TILE_MIN;  // fewest query vectors per KV head for the tiles
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------------
// Element loads (pool dtype -> float32)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// 8-bit pool elements carry a float32 scale per token and KV head (lamina/kernels/kv_format.py).
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

// s[m * kBlock + j] *= scale[j][head] for the m < M rows of one KV head and the block's nb keys
// (scale[j]: key j's row of [Hkv] scales): a scaled key's score is q . k_raw * scale, a scaled
// value's weight p * scale.
inline void scale_block(float* s, int M, int nb, const float* const* scale, int64_t head) {
  float f[kBlock];
  for (int j = 0; j < nb; ++j) f[j] = scale[j][head];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < nb; ++j) s[m * kBlock + j] *= f[j];
}

#if LAMINA_SIMD
using lamina_simd::Vec;

// Pads s[n : n rounded up to W) with -inf, so the loops below read whole vectors (s holds kBlock
// entries, a multiple of W).
inline int pad_block(float* s, int n) {
  const int np = (n + Vec::W - 1) / Vec::W * Vec::W;
  std::fill(s + n, s + np, kNegInf);
  return np;
}
static_assert(kBlock % Vec::W == 0, "a block is whole vectors");
static_assert(kBlock <= lamina_tile::kRowsMax, "a block fits the tile kernels' rows");
#endif

inline float block_max(float* s, int n) {
#if LAMINA_SIMD
  const int np = pad_block(s, n);
  Vec::R mx = Vec::set1(kNegInf);
  for (int i = 0; i < np; i += Vec::W) mx = Vec::max(mx, Vec::load(s + i));
  return Vec::hmax(mx);
#else
  float mx = kNegInf;
  for (int i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
#endif
}

// p[i] = exp(s[i] - mx) for i < n (p is written up to n rounded up to the vector width);
// returns sum(p[0:n]). s entries may be -inf (p = 0).
inline float exp_sum(float* s, float mx, float* p, int n) {
#if LAMINA_SIMD
  const int np = pad_block(s, n);
  const Vec::R m = Vec::set1(mx);
  Vec::R acc = Vec::zero();
  for (int i = 0; i < np; i += Vec::W) {
    const Vec::R e = Vec::exp_nonpos(Vec::sub(Vec::load(s + i), m));
    Vec::store(p + i, e);
    acc = Vec::add(acc, e);
  }
  return Vec::hsum(acc);
#else
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    p[i] = s[i] == kNegInf ? 0.f : std::exp(s[i] - mx);
    sum += p[i];
  }
  return sum;
#endif
}

// ------------------------------------------------------------------------------------------
// Prefetch of the next block's K and V rows into L2, paced over this block's work.
//
// Measured on Zen 4, one thread, 16-token slabs in random order: rows fetched whole (all KV
// heads of a token: contiguous bytes) with prefetcht1 stream at ~22 GB/s against ~15 GB/s
// without software prefetch, ~10-12 GB/s reading one head's part of each row. On Zen 3 (AVX2),
// batch 32 x 1024 float32: ~1.7x faster with these prefetches than without. Issuing many
// prefetches at once stalls on the miss queue and leaves memory idle during the arithmetic, so
// the next block's cache lines are handed out evenly over this block's inner-kernel calls, and
// each call issues its share one line per inner iteration (PrefetchSpan).

#if defined(__x86_64__) && defined(__GNUC__)
// asm volatile: GCC drops __builtin_prefetch calls from inlined helpers it deems pure.
inline void prefetch_line(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }
#else
inline void prefetch_line(const char* p) { __builtin_prefetch(p, 0, 2); }
#endif

// Byte offsets (from a token's base pointer) of the cache lines an item reads from one pool.
inline std::vector<int64_t> row_lines(int64_t h0, int64_t nh, int64_t stride, int64_t D,
                                      int64_t elt) {
  std::vector<int64_t> lines;
  for (int64_t h = h0; h < h0 + nh; ++h) {
    const int64_t lo = h * stride * elt, hi = lo + D * elt;  // [lo, hi) bytes of head h
    for (int64_t b = lo & ~int64_t(63); b < hi; b += 64)
      if (lines.empty() || lines.back() != b) lines.push_back(b);
  }
  return lines;
}

struct PrefetchSpan {
  const char* const* p;
  int n;
  inline void one(int& i) const { if (i < n) prefetch_line(p[i++]); }
  inline void rest(int i) const { for (; i < n; ++i) prefetch_line(p[i]); }
};

class Prefetcher {
 public:
  Prefetcher(const int64_t* klines, int nk, const int64_t* vlines, int nv)
      : lines_(size_t(kBlock) * (nk + nv)), kl_(klines), vl_(vlines), nk_(nk), nv_(nv) {}
  // Starts on the next block (token bases k[0:n], v[0:n], n <= kBlock): lists its cache lines
  // (each token's K row, then its V row), to be handed out over `steps` calls of take().
  void start(const void* const* k, const void* const* v, int n, int64_t steps) {
    flush();
    const char** out = lines_.data();
    for (int t = 0; t < n; ++t) {
      const char* kb = static_cast<const char*>(k[t]);
      for (int i = 0; i < nk_; ++i) *out++ = kb + kl_[i];
      const char* vb = static_cast<const char*>(v[t]);
      for (int i = 0; i < nv_; ++i) *out++ = vb + vl_[i];
    }
    units_ = static_cast<int>(out - lines_.data()), next_ = 0, done_ = 0;
    steps_ = std::max<int64_t>(1, steps);
  }
  // This step's share of the lines, for an inner kernel to issue one per iteration (a counter
  // in a register, not a store-to-load chain through this object on every key).
  PrefetchSpan take() {
    ++done_;
    const int end = static_cast<int>(units_ * std::min(done_, steps_) / steps_);
    PrefetchSpan sp{lines_.data() + next_, end - next_};
    next_ = end;
    return sp;
  }
  // Issues whatever of the block is left (before starting the next, or all at once).
  void flush() {
    PrefetchSpan{lines_.data() + next_, units_ - next_}.rest(0);
    next_ = units_;
  }

 private:
  std::vector<const char*> lines_;
  const int64_t* kl_;
  const int64_t* vl_;
  int nk_, nv_;
  int units_ = 0, next_ = 0;
  int64_t steps_ = 1, done_ = 0;
};

// ------------------------------------------------------------------------------------------
// Inner kernels over a block of nb keys for a register group of MG query vectors.
// q: [MG][D] float32 (pre-scaled), row stride D. s/p: [MG][kBlock]. o: [MG][D] float32.
// Key j's row is rows[j] + off.

// Plain loops: any D, any -march.
struct Generic {
  template <int MG, typename KT>
  static void scores(const float* q, int64_t D, const KT* const* rows, int64_t off, int nb,
                     float* s, PrefetchSpan pf) {
    pf.rest(0);
    for (int j = 0; j < nb; ++j) {
      const KT* k = rows[j] + off;
      for (int m = 0; m < MG; ++m) {
        const float* qm = q + m * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qm[d] * to_float(k[d]);
        s[m * kBlock + j] = acc;
      }
    }
  }
  template <int MG, typename KT>
  static void accumulate(float* o, int64_t D, const KT* const* rows, int64_t off, int nb,
                         const float* p, PrefetchSpan pf) {
    pf.rest(0);
    for (int j = 0; j < nb; ++j) {
      const KT* v = rows[j] + off;
      for (int m = 0; m < MG; ++m) {
        const float pm = p[m * kBlock + j];
        float* om = o + m * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) om[d] += pm * to_float(v[d]);
      }
    }
  }
};

#if LAMINA_SIMD
// Vec (W float32 lanes), D = W * NC (NC = 0: taken from D at run time).
template <int NC>
struct Simd {
  static constexpr int kKeys = Vec::W / kGroup;  // keys per step of scores (AVX-512 4, AVX2 2)

  // Scores of MG queries against the W keys rows[0:W], one query at a time: W accumulators
  // (independent FMA chains over the D chunks, K read from memory operands), then one
  // transposing reduction leaves the W scores in one vector, stored whole at s[m * kBlock].
  // Measured on Zen 3 (AVX2) with the one-query-at-a-time accumulate below: the kernel's
  // arithmetic (KV in L2) ~1.25x faster than 2 keys x MG queries per reduction. float32 rows
  // only: bfloat16 ones would be converted once per query instead of once per chunk (the
  // kKeys path below measured ~1.1x faster for them).
  template <int MG, typename KT>
  static void scores_wide(const float* q, int64_t D, const KT* const* rows, int64_t off,
                          float* s, PrefetchSpan pf, int& pi) {
    const int nc = NC > 0 ? NC : static_cast<int>(D / Vec::W);
    const KT* k[Vec::W];
    for (int t = 0; t < Vec::W; ++t) k[t] = rows[t] + off;
    for (int m = 0; m < MG; ++m) {
      Vec::R acc[Vec::W];
      for (int t = 0; t < Vec::W; ++t) acc[t] = Vec::zero();
      for (int c = 0; c < nc; ++c) {
        pf.one(pi);
        const Vec::R qc = Vec::load(q + m * D + Vec::W * c);
        for (int t = 0; t < Vec::W; ++t)
          acc[t] = Vec::fmadd(qc, Vec::load(k[t] + Vec::W * c), acc[t]);
      }
      Vec::store(s + m * kBlock, Vec::reduce(acc));
    }
  }

  // Scores of MG <= kGroup queries against keys rows[0:nb]: W keys at a time (scores_wide),
  // then kKeys at a time: MG * kKeys accumulators summed across lanes by one transposing
  // reduction, then one by one. Issues pf one line per inner iteration.
  template <int MG, typename KT>
  static void scores(const float* q, int64_t D, const KT* const* rows, int64_t off, int nb,
                     float* s, PrefetchSpan pf) {
    int pi = 0;
    static_assert(MG <= kGroup, "MG * kKeys accumulators must fit in one reduction");
    const int nc = NC > 0 ? NC : static_cast<int>(D / Vec::W);
    int j = 0;
    if constexpr (std::is_same_v<KT, float>)  // bfloat16 rows are converted once per chunk below
      for (; j + Vec::W <= nb; j += Vec::W) scores_wide<MG>(q, D, rows + j, off, s + j, pf, pi);
    for (; j + kKeys <= nb; j += kKeys) {
      const KT* k[kKeys];
      for (int t = 0; t < kKeys; ++t) k[t] = rows[j + t] + off;
      Vec::R acc[Vec::W];
      for (int i = 0; i < Vec::W; ++i) acc[i] = Vec::zero();
      for (int c = 0; c < nc; ++c) {
        pf.one(pi);
        Vec::R kc[kKeys];
        for (int t = 0; t < kKeys; ++t) kc[t] = Vec::load(k[t] + Vec::W * c);
        for (int m = 0; m < MG; ++m) {
          const Vec::R qc = Vec::load(q + m * D + Vec::W * c);
          for (int t = 0; t < kKeys; ++t)
            acc[m * kKeys + t] = Vec::fmadd(qc, kc[t], acc[m * kKeys + t]);
        }
      }
      alignas(64) float sums[Vec::W];  // lane m * kKeys + t: query m . key j + t
      Vec::store(sums, Vec::reduce(acc));
      for (int m = 0; m < MG; ++m)
        for (int t = 0; t < kKeys; ++t) s[m * kBlock + j + t] = sums[m * kKeys + t];
    }
    for (; j < nb; ++j) {
      const KT* k = rows[j] + off;
      Vec::R acc[MG];
      for (int m = 0; m < MG; ++m) acc[m] = Vec::zero();
      for (int c = 0; c < nc; ++c) {
        const Vec::R kc = Vec::load(k + Vec::W * c);
        for (int m = 0; m < MG; ++m)
          acc[m] = Vec::fmadd(Vec::load(q + m * D + Vec::W * c), kc, acc[m]);
      }
      for (int m = 0; m < MG; ++m) s[m * kBlock + j] = Vec::hsum(acc[m]);
    }
    pf.rest(pi);
  }
  // o[m] += sum_j p[m][j] * v_j. float32 rows, D in 3/4 of the registers (NC chunks): one query at
  // a time over the whole head dim, NC independent accumulators, one broadcast per key, the V
  // rows re-read from L1 per query. Otherwise CB W-wide chunks of every query at a time
  // (key-major inside a pass: MG * CB accumulators in half the registers, each V row read once
  // per pass). Issues pf one line per key.
  static constexpr int chunks_per_pass(int mg) {
    int cb = NC > 0 ? NC : 1;
    while (cb > 1 && (mg * cb > Vec::kRegs / 2 || NC % cb)) --cb;
    return cb;
  }
  template <int MG, typename KT>
  static void accumulate(float* o, int64_t D, const KT* const* rows, int64_t off, int nb,
                         const float* p, PrefetchSpan pf) {
    int pi = 0;
    if constexpr (std::is_same_v<KT, float> && NC > 0 && NC <= Vec::kRegs * 3 / 4) {
      const KT* v[kBlock];  // nb <= kBlock
      for (int j = 0; j < nb; ++j) v[j] = rows[j] + off;
      for (int m = 0; m < MG; ++m) {
        Vec::R acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = Vec::load(o + m * D + Vec::W * c);
        for (int j = 0; j < nb; ++j) {
          pf.one(pi);
          const Vec::R pj = Vec::set1(p[m * kBlock + j]);
          for (int c = 0; c < NC; ++c)
            acc[c] = Vec::fmadd(pj, Vec::load(v[j] + Vec::W * c), acc[c]);
        }
        for (int c = 0; c < NC; ++c) Vec::store(o + m * D + Vec::W * c, acc[c]);
      }
      pf.rest(pi);
      return;
    }
    constexpr int CB = chunks_per_pass(MG);
    const int nc = NC > 0 ? NC : static_cast<int>(D / Vec::W);
    for (int c0 = 0; c0 < nc; c0 += CB) {
      Vec::R acc[MG][CB];
      for (int m = 0; m < MG; ++m)
        for (int c = 0; c < CB; ++c) acc[m][c] = Vec::load(o + m * D + Vec::W * (c0 + c));
      for (int j = 0; j < nb; ++j) {
        pf.one(pi);
        const KT* v = rows[j] + off + Vec::W * c0;
        Vec::R pj[MG];
        for (int m = 0; m < MG; ++m) pj[m] = Vec::set1(p[m * kBlock + j]);
        for (int c = 0; c < CB; ++c) {
          const Vec::R vc = Vec::load(v + Vec::W * c);
          for (int m = 0; m < MG; ++m) acc[m][c] = Vec::fmadd(pj[m], vc, acc[m][c]);
        }
      }
      for (int m = 0; m < MG; ++m)
        for (int c = 0; c < CB; ++c) Vec::store(o + m * D + Vec::W * (c0 + c), acc[m][c]);
    }
    pf.rest(pi);
  }
};
#endif

// Kernel::scores / accumulate over M query vectors in register groups of up to kGroup.
template <class Kernel, typename KT>
void scores_all(const float* q, int M, int64_t D, const KT* const* rows, int64_t off, int nb,
                float* s, PrefetchSpan pf) {
  for (int m = 0; m < M; m += kGroup, pf.n = 0) {
    const float* qm = q + m * D;
    float* sm = s + m * kBlock;
    switch (std::min(kGroup, M - m)) {
      case 4: Kernel::template scores<4>(qm, D, rows, off, nb, sm, pf); break;
      case 3: Kernel::template scores<3>(qm, D, rows, off, nb, sm, pf); break;
      case 2: Kernel::template scores<2>(qm, D, rows, off, nb, sm, pf); break;
      default: Kernel::template scores<1>(qm, D, rows, off, nb, sm, pf);
    }
  }
}

template <class Kernel, typename KT>
void accumulate_all(float* o, int M, int64_t D, const KT* const* rows, int64_t off, int nb,
                    const float* p, PrefetchSpan pf) {
  for (int m = 0; m < M; m += kGroup, pf.n = 0) {
    float* om = o + m * D;
    const float* pm = p + m * kBlock;
    switch (std::min(kGroup, M - m)) {
      case 4: Kernel::template accumulate<4>(om, D, rows, off, nb, pm, pf); break;
      case 3: Kernel::template accumulate<3>(om, D, rows, off, nb, pm, pf); break;
      case 2: Kernel::template accumulate<2>(om, D, rows, off, nb, pm, pf); break;
      default: Kernel::template accumulate<1>(om, D, rows, off, nb, pm, pf);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Work items and the per-item loop

struct Item {
  int64_t r;          // request
  int64_t h0, nh;     // KV heads [h0, h0 + nh)
  int64_t t0, t1;     // query rows [t0, t1) of the tile
  int64_t j0, j1;     // key range [j0, j1) of the request's keys this item walks
  int64_t part;       // -1: writes o/lse; else index of its partial state
  int64_t cost;
  // Its query vectors: G per query row and KV head (the scratch's rows).
  int64_t vectors(int64_t G) const { return (t1 - t0) * G * nh; }
};

struct Args {
  const void* q;
  int64_t T, H, Hkv, G, D;
  const void* k;  // pool bases
  const void* v;
  const float* ksc;  // scale bases [S, Hkv] of 8-bit pools (else nullptr)
  const float* vsc;
  int64_t ks0, ks1, vs0, vs1;  // strides in elements
  int64_t S;
  const int64_t* qo;
  const int64_t* kvp;
  const void* idx;
  const int64_t* qpos;
  const int64_t* kstart;
  float qscale;   // scale (or scale / softcap)
  float softcap;  // 0: none
  int64_t window;  // 0: none
  int64_t rows_per_tile, heads_per_item;
};

// Token slot's row of [Hkv] scales; its cache line is prefetched unless it is `last`'s (a slab's
// consecutive slots share lines). rows() runs a block ahead, so the scales are in cache when the
// block's scores and weights take them (measured: without it, scale misses took ~1/4 of an int8
// call).
inline const float* scale_row(const float* base, int64_t slot, int64_t Hkv, const char*& last) {
  const float* row = base + slot * Hkv;
  const char* line = reinterpret_cast<const char*>(
      reinterpret_cast<uintptr_t>(row) & ~static_cast<uintptr_t>(63));
  if (line != last) {
    prefetch_line(line);
    last = line;
  }
  return row;
}

// Visible key range [lo, hi) (indices into the request's keys) of a query at position p.
inline void visible_range(const Args& a, int64_t r, int64_t p, int64_t* lo, int64_t* hi) {
  const int64_t start = a.kstart[r], n = a.kvp[r + 1] - a.kvp[r];
  int64_t l = 0, h = std::min(n, p - start + 1);
  if (a.window > 0) l = std::max<int64_t>(0, p - a.window + 1 - start);
  *lo = l;
  *hi = std::max(h, l);
}

// A vector whose sized construction leaves its elements as they come: the kernels write every
// scratch element before they read it, so zeroing a scratch sized for the call's largest item,
// on every thread of every call, was work for nothing.
template <class T>
struct NoInit : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = NoInit<U>;
  };
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <class T>
using Buf = std::vector<T, NoInit<T>>;

// Query vectors of an item, in order (head, row, group member): m = ((h-h0)*rows + t-t0)*G + g.
struct Scratch {
  Buf<float> q, o, s, p, m, l;
  Buf<int64_t> lo, hi;
#if LAMINA_SIMD
  lamina_tile::Tile tile;  // items of many query vectors per KV head (attention_tile.h)
#endif
  explicit Scratch(int64_t M, int64_t D)
      : q(M * D), o(M * D), s(M * kBlock), p(M * kBlock), m(M), l(M), lo(M), hi(M) {}
};

template <typename QT>
inline void load_queries(const Args& a, const Item& it, Scratch& sc) {
  const QT* q = static_cast<const QT*>(a.q);
  int64_t m = 0;
  for (int64_t h = it.h0; h < it.h0 + it.nh; ++h) {
    for (int64_t t = it.t0; t < it.t1; ++t) {
      int64_t lo, hi;
      visible_range(a, it.r, a.qpos[t], &lo, &hi);
      for (int64_t g = 0; g < a.G; ++g, ++m) {
        const QT* src = q + (t * a.H + h * a.G + g) * a.D;
        float* dst = sc.q.data() + m * a.D;
        for (int64_t d = 0; d < a.D; ++d) dst[d] = to_float(src[d]) * a.qscale;
        sc.lo[m] = lo;
        sc.hi[m] = hi;
      }
    }
  }
}

// Online-softmax update of query vector m with the block's scores s[0:nb] (masked as needed);
// leaves its probabilities in p[0:nb].
inline void softmax_update(const Args& a, Scratch& sc, int m, int64_t j, int nb, bool masked,
                           float* s, float* p) {
  if (a.softcap > 0.f) {  // before the mask: tanh(-inf) is not -inf
    for (int i = 0; i < nb; ++i) s[i] = a.softcap * std::tanh(s[i]);
  }
  if (masked) {
    for (int i = 0; i < nb; ++i)
      if (j + i < sc.lo[m] || j + i >= sc.hi[m]) s[i] = kNegInf;
  }
  const float bmax = block_max(s, nb);
  if (bmax == kNegInf) {  // this query sees none of the block
    std::fill(p, p + nb, 0.f);
    return;
  }
  const float mnew = std::max(sc.m[m], bmax);
  const float sum = exp_sum(s, mnew, p, nb);
  if (sc.m[m] != mnew) {
    const float alpha = sc.m[m] == kNegInf ? 0.f : std::exp(sc.m[m] - mnew);
    float* om = sc.o.data() + m * a.D;
    for (int64_t d = 0; d < a.D; ++d) om[d] *= alpha;
    sc.l[m] *= alpha;
    sc.m[m] = mnew;
  }
  sc.l[m] += sum;
}

// Walks keys [it.j0, it.j1) for the item's M query vectors; leaves (o unnormalised, running
// max, running sum) in sc. Returns false when a slot lies outside the pool.
template <class Kernel, typename KT, typename VT, typename IT>
bool attend_item(const Args& a, const Item& it, Scratch& sc, int M) {
  const int64_t D = a.D, per_head = (it.t1 - it.t0) * a.G;
  const IT* idx = static_cast<const IT*>(a.idx) + a.kvp[it.r];
  const KT* kb = static_cast<const KT*>(a.k);
  const VT* vb = static_cast<const VT*>(a.v);
  std::fill(sc.o.begin(), sc.o.begin() + M * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + M, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + M, 0.f);
  int64_t all_lo = 0, all_hi = std::numeric_limits<int64_t>::max();  // keys every query sees
  for (int m = 0; m < M; ++m) {
    all_lo = std::max(all_lo, sc.lo[m]);
    all_hi = std::min(all_hi, sc.hi[m]);
  }
  const KT* krow[2][kBlock];  // token bases of this block and the next
  const VT* vrow[2][kBlock];
  const float* kscl[2][kBlock];  // the block's rows of scales (8-bit pools)
  const float* vscl[2][kBlock];
  const char* kline = nullptr;  // the scale line last prefetched
  const char* vline = nullptr;
  auto rows = [&](int64_t j, int nb, int buf) -> bool {
    for (int i = 0; i < nb; ++i) {
      const int64_t slot = static_cast<int64_t>(idx[j + i]);
      if (slot < 0 || slot >= a.S) return false;
      krow[buf][i] = kb + slot * a.ks0;
      vrow[buf][i] = vb + slot * a.vs0;
      if constexpr (kScaled<KT>) kscl[buf][i] = scale_row(a.ksc, slot, a.Hkv, kline);
      if constexpr (kScaled<VT>) vscl[buf][i] = scale_row(a.vsc, slot, a.Hkv, vline);
    }
    return true;
  };
  const std::vector<int64_t> kl = row_lines(it.h0, it.nh, a.ks1, D, sizeof(KT));
  const std::vector<int64_t> vl = row_lines(it.h0, it.nh, a.vs1, D, sizeof(VT));
  Prefetcher pf(kl.data(), static_cast<int>(kl.size()), vl.data(), static_cast<int>(vl.size()));
#if LAMINA_SIMD
  // Many query vectors per KV head: the tile kernels (attention_tile.h), not softcapped.
  const bool tile = !std::is_same_v<Kernel, Generic> && per_head >= kTileMin &&
                    a.softcap == 0.f && D % Vec::W == 0;
  if (tile) sc.tile.begin(sc.q.data(), it.nh, per_head, D);
#endif
  int buf = 0;
  if (it.j1 > it.j0) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, it.j1 - it.j0));
    if (!rows(it.j0, nb, 0)) return false;
    pf.start(reinterpret_cast<const void* const*>(krow[0]),
             reinterpret_cast<const void* const*>(vrow[0]), nb, 0);
    pf.flush();
  }
  for (int64_t j = it.j0; j < it.j1; j += kBlock, buf ^= 1) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, it.j1 - j));
    const int64_t jn = j + kBlock;
    const int nn = jn < it.j1 ? static_cast<int>(std::min<int64_t>(kBlock, it.j1 - jn)) : 0;
    if (nn && !rows(jn, nn, buf ^ 1)) return false;
    // The next block's lines go out over this block's 2 * nh inner-kernel calls, one line per
    // inner iteration: spread thin, so the miss buffers stay busy while the arithmetic runs
    // (on Zen 3, batch 32 x 1024 float32, one thread: this kernel with each call's share issued
    // at once before the call ran 0.88x the previous kernel; spread, 1.28x).
    int64_t pf_steps = 2 * it.nh;  // the inner-kernel calls (or tile steps) of this block
#if LAMINA_SIMD
    if (tile) pf_steps = it.nh * sc.tile.steps(nb);
#endif
    pf.start(reinterpret_cast<const void* const*>(krow[buf ^ 1]),
             reinterpret_cast<const void* const*>(vrow[buf ^ 1]), nn, pf_steps);
    const bool masked = j < all_lo || j + nb > all_hi;
    const int mh = static_cast<int>(per_head);
#if LAMINA_SIMD
    if (tile) {
      for (int64_t h = 0; h < it.nh; ++h) {
        const int64_t m0 = h * per_head, head = it.h0 + h;
        sc.tile.block(h, krow[buf], head * a.ks1, vrow[buf], head * a.vs1, nb,
                      kScaled<KT> ? kscl[buf] : nullptr, kScaled<VT> ? vscl[buf] : nullptr,
                      head, j, masked, sc.lo.data() + m0, sc.hi.data() + m0,
                      sc.o.data() + m0 * D, [&pf] { pf.take().rest(0); });
      }
      continue;
    }
#endif
    for (int64_t h = 0; h < it.nh; ++h) {
      const int64_t m0 = h * per_head;
      scores_all<Kernel>(sc.q.data() + m0 * D, mh, D, krow[buf], (it.h0 + h) * a.ks1, nb,
                         sc.s.data() + m0 * kBlock, pf.take());
      if constexpr (kScaled<KT>)
        scale_block(sc.s.data() + m0 * kBlock, mh, nb, kscl[buf], it.h0 + h);
    }
    for (int m = 0; m < M; ++m)
      softmax_update(a, sc, m, j, nb, masked, sc.s.data() + m * kBlock, sc.p.data() + m * kBlock);
    for (int64_t h = 0; h < it.nh; ++h) {
      const int64_t m0 = h * per_head;
      if constexpr (kScaled<VT>)  // after the softmax summed p: only o takes the scales
        scale_block(sc.p.data() + m0 * kBlock, mh, nb, vscl[buf], it.h0 + h);
      accumulate_all<Kernel>(sc.o.data() + m0 * D, mh, D, vrow[buf], (it.h0 + h) * a.vs1, nb,
                             sc.p.data() + m0 * kBlock, pf.take());
    }
  }
#if LAMINA_SIMD
  if (tile)
    for (int64_t h = 0; h < it.nh; ++h)
      sc.tile.end(h, sc.m.data() + h * per_head, sc.l.data() + h * per_head);
#endif
  return true;
}

template <typename QT>
inline void write_output(const Args& a, const Item& it, const float* o, const float* mx,
                         const float* l, QT* out, float* lse) {
  int64_t m = 0;
  for (int64_t h = it.h0; h < it.h0 + it.nh; ++h) {
    for (int64_t t = it.t0; t < it.t1; ++t) {
      for (int64_t g = 0; g < a.G; ++g, ++m) {
        const int64_t row = t * a.H + h * a.G + g;
        if (l[m] > 0.f) {  // else: left at o = 0, lse = -inf
          const float inv = 1.f / l[m];
          for (int64_t d = 0; d < a.D; ++d)
            out[row * a.D + d] = static_cast<QT>(o[m * a.D + d] * inv);
          lse[row] = mx[m] + std::log(l[m]);
        }
      }
    }
  }
}

// Items of one call: (request, query tile, KV-head chunk), split along the keys when there are
// too few for the threads to share well; sorted by cost, largest first.
std::vector<Item> plan(const Args& a, int64_t R, int threads, int64_t* parts) {
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q0 = a.qo[r], q1 = a.qo[r + 1];
    if (q1 <= q0 || a.kvp[r + 1] <= a.kvp[r]) continue;
    for (int64_t t0 = q0; t0 < q1; t0 += a.rows_per_tile) {
      const int64_t t1 = std::min(q1, t0 + a.rows_per_tile);
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t t = t0; t < t1; ++t) {
        int64_t l, h;
        visible_range(a, r, a.qpos[t], &l, &h);
        if (h > l) {
          lo = std::min(lo, l);
          hi = std::max(hi, h);
        }
      }
      if (hi <= lo) continue;  // no query of the tile sees a key
      for (int64_t h0 = 0; h0 < a.Hkv; h0 += a.heads_per_item) {
        const int64_t nh = std::min(a.heads_per_item, a.Hkv - h0);
        const int64_t cost = (hi - lo) * nh * ((t1 - t0) * a.G + 8);  // dots + memory
        items.push_back({r, h0, nh, t0, t1, lo, hi, -1, cost});
        total += cost;
      }
    }
  }
  *parts = 0;
  if (threads > 1 && !items.empty()) {
    const int64_t target = std::max<int64_t>(1, total / (4 * threads));
    std::vector<Item> split;
    for (const Item& it : items) {
      const int64_t n = it.j1 - it.j0;
      const int64_t k = std::min((it.cost + target - 1) / target, n / kSplitMin);
      if (k <= 1) {
        split.push_back(it);
        continue;
      }
      for (int64_t i = 0; i < k; ++i) {
        Item s = it;
        s.j0 = it.j0 + n * i / k;
        s.j1 = it.j0 + n * (i + 1) / k;
        s.cost = it.cost / k;
        s.part = (*parts)++;
        split.push_back(s);
      }
    }
    items.swap(split);
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

template <class Kernel, typename KT, typename VT, typename IT, typename QT>
void run(const Args& a, int64_t R, QT* out, float* lse) {
  const int threads = std::max(1, at::get_num_threads());
  int64_t nparts = 0;
  std::vector<Item> items = plan(a, R, threads, &nparts);
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items == 0) return;
  // Most query vectors of an item: the scratch's size. A decode item holds a GQA group per
  // head, far fewer than a full tile, and zeroing a tile-sized scratch cost more than the
  // attention of a short call.
  int64_t MT = 0;
  for (const Item& it : items) MT = std::max(MT, it.vectors(a.G));
  std::vector<float> part_o(nparts * MT * a.D), part_m(nparts * MT), part_l(nparts * MT);
  std::vector<int64_t> part_item(nparts);
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad{false};
  at::parallel_for(0, std::min<int64_t>(threads, n_items), 1, [&](int64_t, int64_t) {
    Scratch sc(MT, a.D);
    for (int64_t i = next++; i < n_items && !bad.load(std::memory_order_relaxed); i = next++) {
      const Item& it = items[i];
      const int M = static_cast<int>(it.vectors(a.G));
      load_queries<QT>(a, it, sc);
      if (!attend_item<Kernel, KT, VT, IT>(a, it, sc, M)) {
        bad = true;
        break;
      }
      if (it.part < 0) {
        write_output<QT>(a, it, sc.o.data(), sc.m.data(), sc.l.data(), out, lse);
      } else {
        std::copy(sc.o.begin(), sc.o.begin() + M * a.D, part_o.begin() + it.part * MT * a.D);
        std::copy(sc.m.begin(), sc.m.begin() + M, part_m.begin() + it.part * MT);
        std::copy(sc.l.begin(), sc.l.begin() + M, part_l.begin() + it.part * MT);
        part_item[it.part] = i;
      }
    }
  });
  TORCH_CHECK_INDEX(!bad, "paged_attention: kv_indices hold slots outside the pool [0, ", a.S,
                    ")");
  if (nparts == 0) return;
  // The splits of one item have consecutive part numbers: merge them by log-sum-exp.
  std::vector<int64_t> first;
  for (int64_t pi = 0; pi < nparts; ++pi) {
    const Item& it = items[part_item[pi]];
    const Item* prev = pi ? &items[part_item[pi - 1]] : nullptr;
    if (!prev || it.r != prev->r || it.h0 != prev->h0 || it.t0 != prev->t0) first.push_back(pi);
  }
  first.push_back(nparts);
  at::parallel_for(0, static_cast<int64_t>(first.size()) - 1, 1, [&](int64_t b, int64_t e) {
    std::vector<float> o(MT * a.D), mx(MT), l(MT);
    for (int64_t g = b; g < e; ++g) {
      const Item& it = items[part_item[first[g]]];
      const int64_t M = it.vectors(a.G);
      for (int64_t m = 0; m < M; ++m) {
        float mm = kNegInf;
        for (int64_t pi = first[g]; pi < first[g + 1]; ++pi)
          mm = std::max(mm, part_m[pi * MT + m]);
        mx[m] = mm;
        l[m] = 0.f;
        std::fill(o.begin() + m * a.D, o.begin() + (m + 1) * a.D, 0.f);
        if (mm == kNegInf) continue;
        for (int64_t pi = first[g]; pi < first[g + 1]; ++pi) {
          const float pm = part_m[pi * MT + m];
          if (pm == kNegInf) continue;
          const float w = std::exp(pm - mm);
          l[m] += w * part_l[pi * MT + m];
          const float* po = part_o.data() + (pi * MT + m) * a.D;
          for (int64_t d = 0; d < a.D; ++d) o[m * a.D + d] += w * po[d];
        }
      }
      write_output<QT>(a, it, o.data(), mx.data(), l.data(), out, lse);
    }
  });
}

template <typename KT, typename VT, typename IT, typename QT>
void run_dispatch_simd(const Args& a, int64_t R, QT* out, float* lse) {
#if LAMINA_SIMD
  if (a.D == 64) return run<Simd<64 / Vec::W>, KT, VT, IT, QT>(a, R, out, lse);
  if (a.D == 128) return run<Simd<128 / Vec::W>, KT, VT, IT, QT>(a, R, out, lse);
  if (a.D % Vec::W == 0) return run<Simd<0>, KT, VT, IT, QT>(a, R, out, lse);
#endif
  run<Generic, KT, VT, IT, QT>(a, R, out, lse);
}

template <typename KT, typename VT, typename IT>
void run_dispatch_q(const Args& a, int64_t R, const at::Tensor& o, float* lse) {
  switch (o.scalar_type()) {
    case at::kFloat: return run_dispatch_simd<KT, VT, IT>(a, R, o.data_ptr<float>(), lse);
    case at::kBFloat16:
      return run_dispatch_simd<KT, VT, IT>(a, R, o.data_ptr<c10::BFloat16>(), lse);
    case at::kHalf: return run_dispatch_simd<KT, VT, IT>(a, R, o.data_ptr<c10::Half>(), lse);
    default: TORCH_CHECK(false, "paged_attention: q must be float32, bfloat16 or float16");
  }
}

template <typename KT, typename VT>
void run_dispatch_idx(const Args& a, int64_t R, at::ScalarType it, const at::Tensor& o,
                      float* lse) {
  if (it == at::kInt) return run_dispatch_q<KT, VT, int32_t>(a, R, o, lse);
  run_dispatch_q<KT, VT, int64_t>(a, R, o, lse);
}

// The (K, V) pool dtypes of lamina's KV formats: float32, bfloat16, int8, fp8_e4m3 and k16v8.
void run_dispatch_pools(const Args& a, int64_t R, at::ScalarType kt, at::ScalarType vt,
                        at::ScalarType it, const at::Tensor& o, float* lse) {
  using F8 = c10::Float8_e4m3fn;
  if (kt == at::kFloat && vt == at::kFloat) return run_dispatch_idx<float, float>(a, R, it, o, lse);
  if (kt == at::kBFloat16 && vt == at::kBFloat16)
    return run_dispatch_idx<c10::BFloat16, c10::BFloat16>(a, R, it, o, lse);
  if (kt == at::kChar && vt == at::kChar) return run_dispatch_idx<int8_t, int8_t>(a, R, it, o, lse);
  if (kt == at::kFloat8_e4m3fn && vt == at::kFloat8_e4m3fn)
    return run_dispatch_idx<F8, F8>(a, R, it, o, lse);
  if (kt == at::kBFloat16 && vt == at::kChar)
    return run_dispatch_idx<c10::BFloat16, int8_t>(a, R, it, o, lse);
  TORCH_CHECK(false, "paged_attention (C++): pools (K, V) must be (float32, float32), (bfloat16, "
              "bfloat16), (int8, int8), (float8_e4m3fn, float8_e4m3fn) or (bfloat16, int8), got (",
              kt, ", ", vt, ")");
}

bool scaled_type(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }

// The scales of an 8-bit pool: float32 [S, Hkv], contiguous; nullptr for a float pool.
const float* scale_base(const at::Tensor& pool, const c10::optional<at::Tensor>& scale,
                        const char* name) {
  if (!scaled_type(pool.scalar_type())) {
    TORCH_CHECK(!scale.has_value() || !scale->defined(), "paged_attention: ", name,
                " given for a ", pool.scalar_type(), " pool");
    return nullptr;
  }
  TORCH_CHECK(scale.has_value() && scale->defined(), "paged_attention: an ",
              pool.scalar_type(), " pool needs ", name);
  const at::Tensor& s = *scale;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == 2 &&
                  s.size(0) == pool.size(0) && s.size(1) == pool.size(1) && s.is_contiguous(),
              "paged_attention: ", name, " must be contiguous float32 [S, Hkv]");
  return s.data_ptr<float>();
}

at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices_in,
    const at::Tensor& q_positions, const at::Tensor& kv_start_pos, double scale, int64_t window,
    double softcap, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q_in.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "paged_attention (C++): CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3,
              "paged_attention: q[T,H,D], k_pool/v_pool[S,Hkv,D]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "paged_attention: k_pool and v_pool differ in shape");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1,
              "paged_attention: pools need a contiguous last dimension");
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_pool.size(0), Hkv = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && Hkv > 0 && H % Hkv == 0,
              "paged_attention: head_dim / GQA mismatch between q and the pools");
  const int64_t R = qo_indptr.numel() - 1;
  TORCH_CHECK(R >= 0 && kv_indptr.numel() == R + 1 && kv_start_pos.numel() == R &&
                  q_positions.numel() == T,
              "paged_attention: index tensor lengths do not match");
  auto o = at::zeros_like(q);
  auto lse = at::full({T, H}, -std::numeric_limits<float>::infinity(),
                      q.options().dtype(at::kFloat));
  if (T == 0 || R == 0) return {o, lse};
  const at::Tensor qo = as_long(qo_indptr), kvp = as_long(kv_indptr);
  const at::Tensor qpos = as_long(q_positions), kst = as_long(kv_start_pos);
  at::Tensor idx = kv_indices_in;
  if (idx.scalar_type() != at::kInt && idx.scalar_type() != at::kLong) idx = idx.to(at::kLong);
  idx = idx.contiguous();
  const int64_t* qo_p = qo.data_ptr<int64_t>();
  const int64_t* kv_p = kvp.data_ptr<int64_t>();
  TORCH_CHECK(qo_p[0] == 0 && qo_p[R] == T, "paged_attention: qo_indptr must run from 0 to T");
  TORCH_CHECK(kv_p[0] >= 0 && kv_p[R] <= idx.numel(), "paged_attention: kv_indptr out of range");
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(qo_p[r + 1] >= qo_p[r] && kv_p[r + 1] >= kv_p[r],
                "paged_attention: indptr must be non-decreasing");

  Args a;
  a.q = q.data_ptr();
  a.T = T, a.H = H, a.Hkv = Hkv, a.G = H / Hkv, a.D = D, a.S = S;
  a.k = k_pool.data_ptr(), a.v = v_pool.data_ptr();
  a.ksc = scale_base(k_pool, k_scale, "k_scale");
  a.vsc = scale_base(v_pool, v_scale, "v_scale");
  a.ks0 = k_pool.stride(0), a.ks1 = k_pool.stride(1);
  a.vs0 = v_pool.stride(0), a.vs1 = v_pool.stride(1);
  a.qo = qo_p, a.kvp = kv_p, a.idx = idx.data_ptr();
  a.qpos = qpos.data_ptr<int64_t>(), a.kstart = kst.data_ptr<int64_t>();
  a.softcap = softcap > 0 ? static_cast<float>(softcap) : 0.f;
  a.qscale = static_cast<float>(softcap > 0 ? scale / softcap : scale);
  a.window = window > 0 ? window : 0;
  a.rows_per_tile = std::max<int64_t>(1, kMaxTile / a.G);
  // An item reads whole token rows (all KV heads: contiguous bytes, which the hardware
  // prefetchers stream well) up to kRowBytes per pool; wider rows are cut by heads.
  a.heads_per_item = std::clamp<int64_t>(kRowBytes / (D * k_pool.element_size()), 1, Hkv);
  run_dispatch_pools(a, R, k_pool.scalar_type(), v_pool.scalar_type(), idx.scalar_type(), o,
                     lse.data_ptr<float>());
  return {o, lse};
}

// Quantised append (oracle: KVPart.quantize in lamina/kernels/kv_format.py, same bytes): each
// row x[i, h, :] goes to data[slots[i], h, :] as int8 or float8 e4m3 with
// scale[slots[i], h] = amax / qmax; float32 arithmetic in the oracle's order.
void kv_store(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& slots,
              const at::Tensor& x_in) {
  const bool fp8 = data.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || data.scalar_type() == at::kChar, "kv_store: an int8 or float8_e4m3fn pool");
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 3 && data.is_contiguous(),
              "kv_store: a contiguous CPU pool layer [S, Hkv, D]");
  const int64_t S = data.size(0), Hkv = data.size(1), D = data.size(2);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == S && scale.size(1) == Hkv,
              "kv_store: scale must be contiguous float32 [S, Hkv]");
  const at::Tensor idx = as_long(slots);
  const int64_t n = idx.numel();
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(0) == n && x_in.size(1) == Hkv && x_in.size(2) == D,
              "kv_store: x must be [n, Hkv, D] for n slots");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < S, "kv_store: slot outside the pool");
  const float qmax = fp8 ? 448.f : 127.f;
  const float* xp = x.data_ptr<float>();
  float* sp = scale.data_ptr<float>();
  auto* i8 = static_cast<int8_t*>(data.data_ptr());
  auto* f8 = static_cast<c10::Float8_e4m3fn*>(data.data_ptr());
  at::parallel_for(0, n * Hkv, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t i = r / Hkv, h = r % Hkv, row = (ip[i] * Hkv + h);
      const float* src = xp + r * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(src[d]));
      const float inv = amax > 0.f ? qmax / amax : 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float y = src[d] * inv;
        if (fp8)
          f8[row * D + d] = c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, y)));
        else
          i8[row * D + d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(y))));
      }
      sp[row] = amax / qmax;
    }
  });
}

// The read ceiling bench/kernels.py compares the kernel with: reads (and folds by max, so
// nothing is optimised away) every K and V row of kv_indices[N] in order, whole rows,
// prefetching rows kAhead indices ahead as the kernel does; no attention arithmetic. One
// thread. Returns the max over the K rows' bytes read as float32 plus that over the V rows'
// (with SIMD: the rows' whole vectors; n = 0: -inf).
double read_kv_rows(const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& kv_indices) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.device().is_cpu(),
              "read_kv_rows: contiguous CPU pools [S, Hkv, D] of one shape");
  constexpr int64_t kAhead = 32;
  const at::Tensor idx = as_long(kv_indices);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel(), S = k_pool.size(0);
  const int64_t row = k_pool.stride(0) * k_pool.element_size();  // bytes
  const char* pools[2] = {static_cast<const char*>(k_pool.data_ptr()),
                          static_cast<const char*>(v_pool.data_ptr())};
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < S, "read_kv_rows: slot outside the pool");
  double total = 0.0;
  for (const char* base : pools) {
#if LAMINA_SIMD
    Vec::R acc = Vec::set1(kNegInf);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n)
        for (int64_t b = 0; b < row; b += 64) prefetch_line(base + ip[i + kAhead] * row + b);
      const float* r = reinterpret_cast<const float*>(base + ip[i] * row);
      for (int64_t e = 0; e + Vec::W <= row / 4; e += Vec::W) acc = Vec::max(acc, Vec::load(r + e));
    }
    total += Vec::hmax(acc);
#else
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) {
      const float* r = reinterpret_cast<const float*>(base + ip[i] * row);
      for (int64_t e = 0; e < row / 4; ++e) mx = std::max(mx, r[e]);
    }
    total += mx;
#endif
  }
  return total;
}

std::string simd_features() {
  std::string f;
#if LAMINA_SIMD
  f += Vec::kName;
#else
  f += "generic";
#endif
#if defined(__AVX512BF16__)
  f += " avx512bf16";
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  f += " avx512vnni";  // quant_dot_cpu.cpp's vpdpbusd (else AVX2's vpmaddubsw + vpmaddwd)
#endif
#if LAMINA_AVX512 && defined(__AMX_BF16__) && defined(__AMX_TILE__)
  f += " amx-bf16";  // the linear kernel's bfloat16 path, where the OS grants the tile state
#endif
#if defined(_OPENMP)
  f += " openmp";
#endif
  return f;
}
