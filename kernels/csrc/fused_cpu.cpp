// Fused small ops of a dense slice on CPU (lamina issue 42, build 2).
//
// A decode step runs each slice on a few rows, so its small ops (a norm, the rotary embedding,
// the gated activation) cost their call, not their arithmetic: ~60 op calls per LLaMA layer,
// each a trip through Python and the dispatcher with the caches cold after the weight stream.
// lamina/computenode/fused_ops.py finds the chains below in a slice's graph and calls one of
// these instead. Each computes what its chain computes, in the chain's order of roundings
// (fp-contract off: no fused multiply-adds where the chain rounds between ops), for float32
// rows; any other dtype runs the chain's own ATen ops here, so the result is the chain's:
//
// * rms_norm(x[..., D], w[D], eps) = w * (x * rsqrt(mean(x^2, -1) + eps));
// * silu_mul(a, b) = silu(a) * b = a / (1 + exp(-a)) * b;
// * rope(x[B, H, T, D], pos[B, T], inv_freq[D/2], scale, half): the rotate-half rotary
//   embedding, x * cos + cat(-x[..., half:], x[..., :half]) * sin with cos/sin =
//   cos/sin(cat(f, f)) * scale, f = pos * inv_freq (the kernel's case: half = D/2).
//
// And two folds of what surrounds them, each the same values as its chain, bit for bit:
//
// * add_rms_norm(a, b, w, eps) = (s, rms_norm(s, w, eps)) with s = a + b (a residual add and
//   the norm that reads it: the sum is computed here instead of by a TensorIterator call);
// * heads(x, sizes, pos, inv_freq, scale, half) = transpose(select(r(transpose(view(x, sizes),
//   1, 2)), 0, 0), 0, 1), r = rope(., pos, inv_freq, scale, half) or, with pos None, nothing:
//   a projection's output [1, T, H * D] as the attention side's q/k/v [T, H, D] (the five
//   view calls of the chain in one).
//
// And one of a memory node's (lamina/kernels/dispatch.py merge_rows): two partial attention
// states of the same queries merged by log-sum-exp in place (a cascade's prefix and suffix),
// as lamina/kernels/reference.py merge_rows_ref computes them.
//
// The sums of squares add in another order than torch's reduction, and exp (Cephes'
// polynomial, ~1 ulp) and cos/sin (the C library's) may differ from torch's vectorised ones in
// the last bit: results differ from the chain by float rounding only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "simd.h"

#pragma GCC optimize("fp-contract=off")

namespace {

#if LAMINA_SIMD
using lamina_simd::Vec;

// exp(x) for any float x, as exp_poly: inputs clamped to [-87.3, 88.3].
inline Vec::R exp_any(Vec::R x) {
  x = Vec::max(x, Vec::set1(-87.3f));
#if LAMINA_AVX512
  x = _mm512_min_ps(x, Vec::set1(88.3f));
  Vec::R n;
  const Vec::R y = lamina_simd::exp_poly(x, &n);
  return _mm512_scalef_ps(y, n);
#else
  x = _mm256_min_ps(x, Vec::set1(88.3f));
  Vec::R n;
  const Vec::R y = lamina_simd::exp_poly(x, &n);
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return Vec::mul(y, _mm256_castsi256_ps(e));
#endif
}

inline Vec::R div(Vec::R a, Vec::R b) {
#if LAMINA_AVX512
  return _mm512_div_ps(a, b);
#else
  return _mm256_div_ps(a, b);
#endif
}
#endif

void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t D,
                   float eps) {
  for (int64_t row = 0; row < rows; ++row, x += D, y += D) {
    int64_t i = 0;
    float ss = 0.f;
#if LAMINA_SIMD
    Vec::R acc = Vec::zero();
    for (; i + Vec::W <= D; i += Vec::W) {
      const Vec::R v = Vec::load(x + i);
      acc = Vec::add(acc, Vec::mul(v, v));
    }
    ss = Vec::hsum(acc);
#endif
    for (; i < D; ++i) ss += x[i] * x[i];
    const float mean = ss / static_cast<float>(D);
    const float r = 1.0f / std::sqrt(mean + eps);
    i = 0;
#if LAMINA_SIMD
    const Vec::R rv = Vec::set1(r);
    for (; i + Vec::W <= D; i += Vec::W)
      Vec::store(y + i, Vec::mul(Vec::load(w + i), Vec::mul(Vec::load(x + i), rv)));
#endif
    for (; i < D; ++i) y[i] = w[i] * (x[i] * r);
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat || !x.device().is_cpu() ||
      w.dim() != 1 || x.size(-1) != w.size(0))
    return w * (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps));
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t D = x.size(-1);
  rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(),
                D ? xc.numel() / D : 0, D, static_cast<float>(eps));
  return y;
}

at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat || !a.device().is_cpu() ||
      a.sizes() != b.sizes())
    return at::silu(a) * b;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor y = at::empty_like(ac);
  const float* pa = ac.data_ptr<float>();
  const float* pb = bc.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t n = ac.numel();
  int64_t i = 0;
#if LAMINA_SIMD
  const Vec::R one = Vec::set1(1.0f), zero = Vec::zero();
  for (; i + Vec::W <= n; i += Vec::W) {
    const Vec::R v = Vec::load(pa + i);
    const Vec::R s = div(v, Vec::add(one, exp_any(Vec::sub(zero, v))));
    Vec::store(py + i, Vec::mul(s, Vec::load(pb + i)));
  }
#endif
  for (; i < n; ++i) py[i] = pa[i] / (1.0f + std::exp(-pa[i])) * pb[i];
  return y;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& inv_freq,
                double scale, int64_t half) {
  const bool fast = x.scalar_type() == at::kFloat && x.dim() == 4 && x.device().is_cpu() &&
                    inv_freq.scalar_type() == at::kFloat && inv_freq.dim() == 1 &&
                    x.size(3) == 2 * inv_freq.size(0) && half == inv_freq.size(0) &&
                    pos.dim() == 2 &&
                    pos.size(0) == x.size(0) && pos.size(1) == x.size(2) &&
                    pos.scalar_type() == at::kLong;
  if (!fast) {  // the chain itself, op for op
    const at::Tensor f = pos.unsqueeze(2).to(at::kFloat) * inv_freq;
    const at::Tensor e = at::cat({f, f}, -1);
    const at::Tensor c = (e.cos() * scale).unsqueeze(1), s = (e.sin() * scale).unsqueeze(1);
    const at::Tensor rot = at::cat({-x.slice(3, half), x.slice(3, 0, half)}, -1);
    return x * c + rot * s;
  }
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), h = D / 2;
  const at::Tensor xs = x.stride(3) == 1 ? x : x.contiguous();
  const at::Tensor pc = pos.contiguous(), fc = inv_freq.contiguous();
  // [B, T, H, D] in memory (what the attention side reads as q/k[T, H, D]), seen as [B, H, T, D]
  at::Tensor y = at::empty({B, T, H, D}, x.options()).transpose(1, 2);
  const float sc = static_cast<float>(scale);
  const float* fr = fc.data_ptr<float>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const float* px = xs.data_ptr<float>();
  float* py = y.data_ptr<float>();
  std::vector<float> cs(2 * h);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float p = static_cast<float>(pp[b * pc.stride(0) + t * pc.stride(1)]);
      for (int64_t i = 0; i < h; ++i) {
        const float a = p * fr[i];
        cs[i] = std::cos(a) * sc;
        cs[h + i] = std::sin(a) * sc;
      }
      for (int64_t hd = 0; hd < H; ++hd) {
        const float* xi = px + b * xs.stride(0) + hd * xs.stride(1) + t * xs.stride(2);
        float* yi = py + b * y.stride(0) + hd * y.stride(1) + t * y.stride(2);
        for (int64_t i = 0; i < h; ++i) {
          const float c = cs[i], s = cs[h + i];
          const float lo = xi[i] * c, rlo = -xi[h + i] * s;
          const float hi = xi[h + i] * c, rhi = xi[i] * s;
          yi[i] = lo + rlo;
          yi[h + i] = hi + rhi;
        }
      }
    }
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& b,
                                                const at::Tensor& w, double eps) {
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat || !a.device().is_cpu() ||
      !b.device().is_cpu() || a.sizes() != b.sizes()) {
    at::Tensor s = a + b;
    return {s, rms_norm(s, w, eps)};
  }
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor s = at::empty_like(ac);
  const float* pa = ac.data_ptr<float>();
  const float* pb = bc.data_ptr<float>();
  float* ps = s.data_ptr<float>();
  const int64_t n = ac.numel();
  int64_t i = 0;
#if LAMINA_SIMD
  for (; i + Vec::W <= n; i += Vec::W)
    Vec::store(ps + i, Vec::add(Vec::load(pa + i), Vec::load(pb + i)));
#endif
  for (; i < n; ++i) ps[i] = pa[i] + pb[i];
  return {s, rms_norm(s, w, eps)};
}

at::Tensor heads(const at::Tensor& x, const std::vector<int64_t>& sizes,
                 const c10::optional<at::Tensor>& pos, const c10::optional<at::Tensor>& inv_freq,
                 double scale, int64_t half) {
  TORCH_CHECK(pos.has_value() == inv_freq.has_value(),
              "heads: pos and inv_freq go together (both or neither)");
  at::Tensor t = x.view(sizes).transpose(1, 2);
  if (pos.has_value()) t = rope(t, *pos, *inv_freq, scale, half);
  return t.select(0, 0).transpose(0, 1);
}

// merge_rows(o[T, H, D], lse[T, H], rows[n] int64, og[n, H, D], lg[n, H]), all float32 and
// contiguous: row rows[i] of (o, lse) becomes the merge of itself with (og[i], lg[i]):
// m = max(l, lg), w = exp(l - m), wg = exp(lg - m), o = (o w + og wg) / (w + wg),
// lse = m + log(w + wg); a row where both are -inf (no key seen) stays o = 0, lse = -inf.
void merge_rows(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& rows,
                const at::Tensor& og, const at::Tensor& lg) {
  TORCH_CHECK(o.dim() == 3 && og.dim() == 3 && lse.dim() == 2 && lg.dim() == 2 &&
                  rows.dim() == 1,
              "merge_rows: o[T, H, D], lse[T, H], rows[n], og[n, H, D], lg[n, H] expected");
  const int64_t T = o.size(0), H = o.size(1), D = o.size(2), n = rows.size(0);
  TORCH_CHECK(og.size(0) == n && og.size(1) == H && og.size(2) == D && lse.size(0) == T &&
                  lse.size(1) == H && lg.size(0) == n && lg.size(1) == H,
              "merge_rows: shapes do not agree");
  for (const at::Tensor* t : {&o, &lse, &og, &lg})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "merge_rows: contiguous float32 CPU tensors expected");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.device().is_cpu(),
              "merge_rows: rows must be contiguous int64 on the CPU");
  const int64_t* r = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < T, "merge_rows: row ", r[i], " out of range [0, ", T, ")");
  float* po = o.data_ptr<float>();
  float* pl = lse.data_ptr<float>();
  const float* pg = og.const_data_ptr<float>();
  const float* plg = lg.const_data_ptr<float>();
  at::parallel_for(0, n * H, 16384 / std::max<int64_t>(D, 1) + 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t i = j / H, h = j % H;
      float* x = po + (r[i] * H + h) * D;
      const float* y = pg + j * D;
      const float l1 = pl[r[i] * H + h], l2 = plg[j];
      const float m = std::max(l1, l2);
      if (m == -INFINITY) continue;
      const float w1 = std::exp(l1 - m), w2 = std::exp(l2 - m), total = w1 + w2;
      for (int64_t d = 0; d < D; ++d) x[d] = (x[d] * w1 + y[d] * w2) / total;
      pl[r[i] * H + h] = m + std::log(total);
    }
  });
}
