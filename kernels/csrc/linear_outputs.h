// Where a decode-sized linear kernel writes the outputs of its weight panels (skinny_linear_cpu.cpp,
// quant_dot_cpu.cpp): one y[M, N], or, for a group of weights that read the same x and were
// packed back to back (q, k and v; gate and up), y_i[M, N_i] from panel first[i] on. Every N_i
// is a whole number of panels, so no panel straddles two outputs, and each output is computed
// exactly as a call of its own weight would (same panel data, x and arithmetic): one parallel
// region, one pass over x's preparation, instead of one per weight. float32, row-major.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lamina_linear {

struct Outputs {
  std::vector<float*> y;
  std::vector<int64_t> n, first;  // each output's columns and first panel
  const float* bias = nullptr;    // one output only: [N]

  struct At {
    float* y;        // row 0, column 0 of the panel
    int64_t ld, nc;  // the output's row stride; the panel's valid columns
    const float* bias;
  };
  // Panel p's place (panels of nr output columns).
  At at(int64_t p, int64_t nr) const {
    size_t i = 0;
    while (i + 1 < first.size() && p >= first[i + 1]) ++i;
    const int64_t c = (p - first[i]) * nr;
    return {y[i] + c, n[i], std::min(nr, n[i] - c), bias ? bias + c : nullptr};
  }
  // One output y[M, N] of ``panels`` panels (with bias or nullptr).
  static Outputs one(float* y, int64_t n, const float* bias) { return {{y}, {n}, {0}, bias}; }
  // A group's outputs, fresh float32 [M, N_i] in ``ys``, for nr-column panels; the panels the
  // Ns cover (the caller checks it against the packed weights).
  int64_t add_group(const std::vector<int64_t>& ns, int64_t M, int64_t nr,
                    std::vector<at::Tensor>& ys, const at::TensorOptions& opts) {
    int64_t panels = 0;
    for (const int64_t n_i : ns) {
      TORCH_CHECK(n_i > 0 && n_i % nr == 0, "a linear group's every N must be a multiple of ",
                  nr, " (got ", n_i, ")");
      ys.push_back(at::empty({M, n_i}, opts));
      y.push_back(ys.back().data_ptr<float>());
      n.push_back(n_i);
      first.push_back(panels);
      panels += n_i / nr;
    }
    return panels;
  }
};

}  // namespace lamina_linear
