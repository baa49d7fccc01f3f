// Python bindings of lamina's C++ CPU kernels (loaded by lamina/kernels/cpp_ext.py).
#include <ATen/ATen.h>
#include <torch/python.h>

#include "cpu_kernels.h"

namespace py = pybind11;

// slice_program.cpp
void bind_slice_program(py::module_& m);

// The kernels touch no Python object: they run without the GIL, so the role's receiver
// threads can take messages in while its main thread computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "lamina C++ CPU kernels (see lamina/kernels/cpp_ext.py)";
  m.def("paged_attention", &paged_attention,
        "paged_attention(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, q_positions, "
        "kv_start_pos, scale, window, softcap, k_scale=None, v_scale=None) -> (o, lse); "
        "window <= 0 / softcap <= 0: none; k_scale / v_scale[S, Hkv] float32 for 8-bit pools",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("qo_indptr"),
        py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("q_positions"),
        py::arg("kv_start_pos"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), nogil);
  m.def("kv_store", &kv_store,
        "kv_store(data[S, Hkv, D] int8|float8_e4m3fn, scale[S, Hkv] float32, slots[n], "
        "x[n, Hkv, D]): x quantised into the slots (lamina.kernels.kv_format's bytes)", nogil);
  m.def("simd_features", &simd_features, "SIMD paths compiled in");
  // for native callers in this process (the memory node's ATTEND loop): the kernel itself
  m.attr("paged_attention_fn") = py::capsule(reinterpret_cast<void*>(&paged_attention),
                                             "lamina.paged_attention/2");
  m.attr("kv_store_fn") = py::capsule(reinterpret_cast<void*>(&kv_store), "lamina.kv_store");
  m.attr("merge_rows_fn") = py::capsule(reinterpret_cast<void*>(&merge_rows), "lamina.merge_rows");
  m.def("read_kv_rows", &read_kv_rows,
        "read_kv_rows(k_pool, v_pool, kv_indices) -> a fold of the rows: the KV read alone "
        "(the kernel bench's ceiling)", nogil);
  m.def("pack_linear_weight", &pack_linear_weight,
        "pack_linear_weight(w[N,K] float32|bfloat16) -> panels[ceil(N/NR), steps(K), NR, L] (AVX2: NR 6, L 8; bfloat16 with AMX: NR 32, L 2, steps a multiple of 16; else NR 32, L 1; steps = ceil(K/L) unless noted)", nogil);
  m.def("skinny_linear", &skinny_linear,
        "skinny_linear(x[M,K] float32|bfloat16, panels, N, bias[N]|None) -> y[M,N] in x's dtype (float32 math)", nogil);
  m.def("packed_linear", &packed_linear,
        "packed_linear(x[..., K], weight[N, K], bias|None, panels, max_rows, max_rows_same) -> "
        "F.linear(x, weight, bias): skinny_linear on the panels up to max_rows rows of float32 x "
        "(max_rows_same of x in the weight's dtype), at::linear otherwise", nogil);
  m.def("skinny_linear_group", &skinny_linear_group,
        "skinny_linear_group(x[M,K] float32, panels, Ns) -> [y_i[M,N_i]]: float32 weights that "
        "read the same x, packed back to back (every N_i a multiple of NR), in one call; each "
        "y_i as skinny_linear(x, its own panels, N_i, None) computes it", nogil);
  m.def("packed_linear_group", &packed_linear_group,
        "packed_linear_group(x[..., K], weights[N_i, K], panels, max_rows) -> [F.linear(x, w_i)]: "
        "skinny_linear_group on the panels up to max_rows rows of float32 x, at::linear "
        "otherwise", nogil);
  m.def("quant_linear", &quant_linear,
        "quant_linear(x[..., K] float32, blocks[N, K/32 * bytes] uint8, ggml type (Q4_0 2, "
        "Q4_1 3, Q8_0 8), bias) -> y[..., N] float32", nogil);
  m.def("quantize_q8", &quantize_q8,
        "quantize_q8(x[..., K] float32) -> (q int8 [M, K], d [M, K/32], s [M, K/32]): x per "
        "block of 32 as ggml's Q8_1 (d = amax / 127, q = round(x / d), s = d * sum q)", nogil);
  m.def("pack_q8_weight", &pack_q8_weight,
        "pack_q8_weight(blocks[N, K/32 * bytes] uint8, ggml type) -> packed uint8: 8 rows "
        "interleaved per block (quant_linear_q8's layout)", nogil);
  m.def("quant_linear_q8", &quant_linear_q8,
        "quant_linear_q8(x[..., K] float32, packed, N, ggml type, bias) -> y[..., N] float32: "
        "quant_linear with x quantised to 8 bits per block of 32 and integer dot products", nogil);
  m.def("quant_linear_q8_group", &quant_linear_q8_group,
        "quant_linear_q8_group(x[..., K] float32, packed, Ns, ggml type) -> [y_i[..., N_i]]: "
        "weights of one type packed back to back (the rows' blocks concatenated, then "
        "pack_q8_weight; every N_i a multiple of 8), x quantised once", nogil);
  bind_slice_program(m);
  m.def("rms_norm", &rms_norm, "rms_norm(x[..., D], w[D], eps) -> w * (x * rsqrt(mean(x^2, -1) + eps))", nogil);
  m.def("silu_mul", &silu_mul, "silu_mul(a, b) -> silu(a) * b", nogil);
  m.def("rope", &rope,
        "rope(x[B, H, T, D], pos[B, T] int64, inv_freq[D/2], scale, half) -> x * cos + cat(-x[..., half:], x[..., :half]) * sin "
        "(cos/sin of cat(f, f) times scale, f = pos * inv_freq); float32 result laid out [B, T, H, D]", nogil);
  m.def("add_rms_norm", &add_rms_norm,
        "add_rms_norm(a, b, w[D], eps) -> (s, rms_norm(s, w, eps)), s = a + b", nogil);
  m.def("heads", &heads, py::arg("x"), py::arg("sizes"), py::arg("pos"), py::arg("inv_freq"),
        py::arg("scale"), py::arg("half"),
        "heads(x, sizes, pos, inv_freq, scale, half) -> transpose(select(r(transpose(view(x, "
        "sizes), 1, 2)), 0, 0), 0, 1), r = rope(., pos, inv_freq, scale, half) or nothing "
        "(pos and inv_freq None): a projection's [1, T, H * D] as q/k/v [T, H, D]", nogil);
  m.def("merge_rows", &merge_rows,
        "merge_rows(o[T, H, D], lse[T, H], rows[n] int64, og[n, H, D], lg[n, H]), float32: "
        "rows `rows` of (o, lse) merged in place with (og, lg) by log-sum-exp", nogil);
}
