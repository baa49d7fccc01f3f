// The extension's C++ CPU kernels, as the bindings (bindings.cpp) and the slice program
// (slice_program.cpp) call them; each is defined in the source named above it.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

// paged_attention_cpu.cpp
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
    const at::Tensor& q_positions, const at::Tensor& kv_start_pos, double scale, int64_t window,
    double softcap, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale);
void kv_store(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& slots,
              const at::Tensor& x);
std::string simd_features();
double read_kv_rows(const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& kv_indices);
// skinny_linear_cpu.cpp
at::Tensor pack_linear_weight(const at::Tensor& w);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                         const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, const at::Tensor& panels,
                         int64_t max_rows, int64_t max_rows_same);
// a group of weights that read the same x, packed back to back (linear_outputs.h)
std::vector<at::Tensor> skinny_linear_group(const at::Tensor& x, const at::Tensor& panels,
                                            const std::vector<int64_t>& ns);
std::vector<at::Tensor> packed_linear_group(const at::Tensor& x,
                                            const std::vector<at::Tensor>& weights,
                                            const at::Tensor& panels, int64_t max_rows);

// quant_linear_cpu.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias);

// quant_dot_cpu.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x);
at::Tensor pack_q8_weight(const at::Tensor& blocks, int64_t kind);
at::Tensor quant_linear_q8(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           int64_t kind, const c10::optional<at::Tensor>& bias);
std::vector<at::Tensor> quant_linear_q8_group(const at::Tensor& x, const at::Tensor& packed,
                                              const std::vector<int64_t>& ns, int64_t kind);

// fused_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b);
at::Tensor rope(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& inv_freq,
                double scale, int64_t half);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& b,
                                                const at::Tensor& w, double eps);
at::Tensor heads(const at::Tensor& x, const std::vector<int64_t>& sizes,
                 const c10::optional<at::Tensor>& pos, const c10::optional<at::Tensor>& inv_freq,
                 double scale, int64_t half);
void merge_rows(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& rows,
                const at::Tensor& og, const at::Tensor& lg);
