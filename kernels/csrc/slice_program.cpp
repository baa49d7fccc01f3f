// A dense slice run as a program in C++ (lamina issue 42, build 2): no Python between its ops.
//
// A CPU slice is an FX graph of a few dozen calls a layer: the packed linear layers and fused
// small ops of this extension, and ATen ops (views, adds, an embedding). Run from its generated
// Python code, each call costs its trip through the interpreter and the argument parsing of a
// binding, several microseconds each on a small CPU: most of a batch-1 pass that is not the
// weight stream. lamina/computenode/native_slice.py translates the graph, once, into the
// instructions below; SliceProgram::run executes them with the GIL released:
//
// * ATEN: an ATen operator called boxed through the dispatcher (the same kernel the binding
//   reaches: same results, bit for bit), its arguments in schema order;
// * SIZE: t.size(dim) (``aten.sym_size.int``);  GETITEM: element i of a tuple result;
// * this extension's kernels called directly: PACKED_LINEAR, QUANT_LINEAR, QUANT_LINEAR_Q8,
//   RMS_NORM, SILU_MUL, ROPE, ADD_RMS_NORM (a tuple: GETITEM takes it apart), HEADS, and
//   GGUF_LINEAR / GGUF_Q8_LINEAR (the choice
//   lamina/computenode/gguf_linear.py's wrappers make, made here the same way); the groups of
//   linear layers that read one x (lamina/computenode/linear_groups.py), PACKED_LINEAR_GROUP
//   and GGUF_Q8_LINEAR_GROUP, whose list of outputs GETITEM takes apart.
//
// Values live in registers (c10::IValue): the slice's inputs first, then its constants, then
// one per instruction. An argument is a register or a constant decoded once from the tagged
// tuples the translator passes. A register is released after its last use, as the generated
// code's ``x = None`` does, so a long prompt's activations do not pile up.
//
// A StepProgram chains the programs of every slice of a model with each layer's attention
// answered by a memory node's plane in this process (exchange.h): a lone micro-batch's step in
// one call.
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/python.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "exchange.h"

namespace py = pybind11;

namespace {

enum Op : int {
  ATEN = 0, SIZE, GETITEM, PACKED_LINEAR, QUANT_LINEAR, QUANT_LINEAR_Q8, RMS_NORM, SILU_MUL,
  ROPE, GGUF_LINEAR, GGUF_Q8_LINEAR, PACKED_LINEAR_GROUP, GGUF_Q8_LINEAR_GROUP, ADD_RMS_NORM,
  HEADS, NUM_OPS
};

// An argument: a register, a constant, or a list built from registers and constants.
struct Arg {
  enum Kind { REG, CONST, INT_LIST, TENSOR_LIST, OPT_TENSOR_LIST } kind = CONST;
  int64_t reg = -1;
  c10::IValue value;
  std::vector<Arg> items;  // list kinds
};

Arg decode(const py::handle& h) {
  const auto t = h.cast<py::tuple>();
  const std::string tag = t[0].cast<std::string>();
  Arg a;
  if (tag == "r") {
    a.kind = Arg::REG, a.reg = t[1].cast<int64_t>();
  } else if (tag == "n") {
    a.value = c10::IValue();
  } else if (tag == "i") {
    a.value = t[1].cast<int64_t>();
  } else if (tag == "f") {
    a.value = t[1].cast<double>();
  } else if (tag == "b") {
    a.value = t[1].cast<bool>();
  } else if (tag == "s") {
    a.value = t[1].cast<std::string>();
  } else if (tag == "t") {
    a.value = t[1].cast<at::Tensor>();
  } else if (tag == "w") {  // a Python number where the schema wants a Tensor: as Python wraps it
    const py::handle v = t[1];
    at::Tensor w = py::isinstance<py::bool_>(v)  ? at::scalar_to_tensor(v.cast<bool>())
                   : py::isinstance<py::int_>(v) ? at::scalar_to_tensor(v.cast<int64_t>())
                                                 : at::scalar_to_tensor(v.cast<double>());
    w.unsafeGetTensorImpl()->set_wrapped_number(true);
    a.value = std::move(w);
  } else if (tag == "il" || tag == "tl" || tag == "otl") {
    a.kind = tag == "il" ? Arg::INT_LIST : tag == "tl" ? Arg::TENSOR_LIST : Arg::OPT_TENSOR_LIST;
    for (const auto& item : t[1].cast<py::list>()) a.items.push_back(decode(item));
  } else {
    TORCH_CHECK(false, "SliceProgram: unknown argument tag '", tag, "'");
  }
  return a;
}

struct Instr {
  int op = ATEN;
  std::vector<Arg> args;
  std::optional<c10::OperatorHandle> handle;  // ATEN
  int64_t n_out = 1;                          // ATEN: values it returns
  std::vector<int64_t> release;               // registers last used here
};

class SliceProgram {
 public:
  // instrs: (op, aten name, overload, args, release) per instruction, writing register
  // n_inputs + len(constants) + i; outputs: registers returned, in order.
  SliceProgram(int64_t n_inputs, std::vector<at::Tensor> constants, const py::list& instrs,
               std::vector<int64_t> outputs)
      : n_inputs_(n_inputs), constants_(std::move(constants)), outputs_(std::move(outputs)) {
    for (const auto& h : instrs) {
      const auto t = h.cast<py::tuple>();
      Instr in;
      in.op = t[0].cast<int>();
      TORCH_CHECK(in.op >= 0 && in.op < NUM_OPS, "SliceProgram: unknown op ", in.op);
      if (in.op == ATEN) {
        in.handle = c10::Dispatcher::singleton().findSchemaOrThrow(
            t[1].cast<std::string>().c_str(), t[2].cast<std::string>().c_str());
        in.n_out = static_cast<int64_t>(in.handle->schema().returns().size());
      }
      for (const auto& a : t[3].cast<py::list>()) in.args.push_back(decode(a));
      in.release = t[4].cast<std::vector<int64_t>>();
      instrs_.push_back(std::move(in));
    }
    n_regs_ = n_inputs_ + static_cast<int64_t>(constants_.size() + instrs_.size());
    for (int64_t r : outputs_)
      TORCH_CHECK(r >= 0 && r < n_regs_, "SliceProgram: output register ", r, " out of range");
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == n_inputs_, "SliceProgram: ", n_inputs_,
                " inputs expected, got ", inputs.size());
    std::vector<c10::IValue> regs(n_regs_);
    for (int64_t i = 0; i < n_inputs_; ++i) regs[i] = inputs[i];
    const int64_t base = n_inputs_ + static_cast<int64_t>(constants_.size());
    for (size_t i = 0; i < constants_.size(); ++i) regs[n_inputs_ + i] = constants_[i];
    for (size_t i = 0; i < instrs_.size(); ++i) {
      const Instr& in = instrs_[i];
      regs[base + i] = step(in, regs);
      for (int64_t r : in.release) regs[r] = c10::IValue();
    }
    std::vector<at::Tensor> out;
    out.reserve(outputs_.size());
    for (int64_t r : outputs_) {
      TORCH_CHECK(regs[r].isTensor(), "SliceProgram: output register ", r, " is not a tensor");
      out.push_back(regs[r].toTensor());
    }
    return out;
  }

  int64_t size() const { return static_cast<int64_t>(instrs_.size()); }

 private:
  static c10::IValue value(const Arg& a, const std::vector<c10::IValue>& regs) {
    switch (a.kind) {
      case Arg::REG: return regs[a.reg];
      case Arg::CONST: return a.value;
      case Arg::INT_LIST: {
        c10::List<int64_t> l;
        l.reserve(a.items.size());
        for (const Arg& x : a.items) l.push_back(value(x, regs).toInt());
        return l;
      }
      case Arg::TENSOR_LIST: {
        c10::List<at::Tensor> l;
        l.reserve(a.items.size());
        for (const Arg& x : a.items) l.push_back(value(x, regs).toTensor());
        return l;
      }
      case Arg::OPT_TENSOR_LIST: {
        c10::List<std::optional<at::Tensor>> l;
        l.reserve(a.items.size());
        for (const Arg& x : a.items) {
          const c10::IValue v = value(x, regs);
          l.push_back(v.isNone() ? std::optional<at::Tensor>() : v.toTensor());
        }
        return l;
      }
    }
    return c10::IValue();
  }

  static const at::Tensor& tensor(const Arg& a, const std::vector<c10::IValue>& regs) {
    TORCH_CHECK(a.kind == Arg::REG || (a.kind == Arg::CONST && a.value.isTensor()),
                "SliceProgram: a tensor argument expected");
    return a.kind == Arg::REG ? regs[a.reg].toTensor() : a.value.toTensor();
  }

  static c10::optional<at::Tensor> opt_tensor(const Arg& a, const std::vector<c10::IValue>& regs) {
    const c10::IValue& v = a.kind == Arg::REG ? regs[a.reg] : a.value;
    return v.isNone() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(v.toTensor());
  }

  static std::vector<at::Tensor> tensors(const Arg& a, const std::vector<c10::IValue>& regs) {
    TORCH_CHECK(a.kind == Arg::TENSOR_LIST, "SliceProgram: a list of tensors expected");
    std::vector<at::Tensor> out;
    out.reserve(a.items.size());
    for (const Arg& x : a.items) out.push_back(tensor(x, regs));
    return out;
  }

  static int64_t integer(const Arg& a, const std::vector<c10::IValue>& regs) {
    return (a.kind == Arg::REG ? regs[a.reg] : a.value).toInt();
  }

  static double real(const Arg& a, const std::vector<c10::IValue>& regs) {
    const c10::IValue& v = a.kind == Arg::REG ? regs[a.reg] : a.value;
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  }

  // x, weight, bias, panels, max_rows, max_rows_same: the first six arguments of every linear op
  static at::Tensor panels_linear(const std::vector<Arg>& g, const std::vector<c10::IValue>& r) {
    return packed_linear(tensor(g[0], r), tensor(g[1], r), opt_tensor(g[2], r), tensor(g[3], r),
                         integer(g[4], r), integer(g[5], r));
  }

  static c10::IValue step(const Instr& in, const std::vector<c10::IValue>& r) {
    const std::vector<Arg>& g = in.args;
    switch (in.op) {
      case ATEN: {
        torch::jit::Stack stack;
        stack.reserve(std::max<size_t>(g.size(), static_cast<size_t>(in.n_out)));
        for (const Arg& a : g) stack.push_back(value(a, r));
        in.handle->callBoxed(&stack);
        if (in.n_out == 1) return std::move(stack[0]);
        return c10::ivalue::Tuple::create(std::move(stack));
      }
      case SIZE: return tensor(g[0], r).size(integer(g[1], r));
      case GETITEM: {
        const c10::IValue& v = g[0].kind == Arg::REG ? r[g[0].reg] : g[0].value;
        const int64_t i = integer(g[1], r);
        if (v.isTuple()) return v.toTupleRef().elements().at(i);
        return v.toList().get(i);
      }
      case PACKED_LINEAR: return panels_linear(g, r);
      case QUANT_LINEAR:  // x, blocks, kind, bias
        return quant_linear(tensor(g[0], r), tensor(g[1], r), integer(g[2], r), opt_tensor(g[3], r));
      case QUANT_LINEAR_Q8:  // x, packed, N, kind, bias
        return quant_linear_q8(tensor(g[0], r), tensor(g[1], r), integer(g[2], r),
                               integer(g[3], r), opt_tensor(g[4], r));
      case RMS_NORM: return rms_norm(tensor(g[0], r), tensor(g[1], r), real(g[2], r));
      case SILU_MUL: return silu_mul(tensor(g[0], r), tensor(g[1], r));
      case ROPE:
        return rope(tensor(g[0], r), tensor(g[1], r), tensor(g[2], r), real(g[3], r),
                    integer(g[4], r));
      case ADD_RMS_NORM: {  // a, b, w, eps
        auto [s, y] = add_rms_norm(tensor(g[0], r), tensor(g[1], r), tensor(g[2], r),
                                   real(g[3], r));
        return c10::ivalue::Tuple::create(std::move(s), std::move(y));
      }
      case HEADS:  // x, sizes, pos, inv_freq, scale, half
        return heads(tensor(g[0], r), value(g[1], r).toIntVector(), opt_tensor(g[2], r),
                     opt_tensor(g[3], r), real(g[4], r), integer(g[5], r));
      case GGUF_LINEAR: {  // panels_linear's six, blocks, kind, quant_rows
        const at::Tensor& x = tensor(g[0], r);
        if (x.scalar_type() == at::kFloat && x.numel() <= integer(g[8], r) * x.size(-1))
          return quant_linear(x, tensor(g[6], r), integer(g[7], r), opt_tensor(g[2], r));
        return panels_linear(g, r);
      }
      case PACKED_LINEAR_GROUP:  // x, weights, panels, max_rows
        return c10::List<at::Tensor>(packed_linear_group(tensor(g[0], r), tensors(g[1], r),
                                                         tensor(g[2], r), integer(g[3], r)));
      case GGUF_Q8_LINEAR_GROUP: {  // packed_linear_group's four, packed, kind
        const at::Tensor& x = tensor(g[0], r);
        const std::vector<at::Tensor> ws = tensors(g[1], r);
        if (x.scalar_type() != at::kFloat)
          return c10::List<at::Tensor>(packed_linear_group(x, ws, tensor(g[2], r),
                                                           integer(g[3], r)));
        std::vector<int64_t> ns;
        for (const at::Tensor& w : ws) ns.push_back(w.size(0));
        return c10::List<at::Tensor>(
            quant_linear_q8_group(x, tensor(g[4], r), ns, integer(g[5], r)));
      }
      case GGUF_Q8_LINEAR: {  // panels_linear's six, packed, kind
        const at::Tensor& x = tensor(g[0], r);
        if (x.scalar_type() == at::kFloat)
          return quant_linear_q8(x, tensor(g[6], r), tensor(g[1], r).size(0), integer(g[7], r),
                                 opt_tensor(g[2], r));
        return panels_linear(g, r);
      }
    }
    TORCH_CHECK(false, "SliceProgram: unknown op ", in.op);
  }

  int64_t n_inputs_;
  std::vector<at::Tensor> constants_;
  std::vector<Instr> instrs_;
  std::vector<int64_t> outputs_;
  int64_t n_regs_ = 0;
};

// A step of a lone micro-batch run whole: every slice's program in turn, each layer's attention
// answered by an ExchangeFn (exchange.h), so that no Python runs between the slices. Values pass
// between slices in slots (one per value name; Python numbers them: native_slice.step_program):
// slice k reads inputs[k] and writes outputs[k]; the layer's q, k, v are slots qkv, its attention
// output goes to slot attn_out.
class StepProgram {
 public:
  StepProgram(const py::list& programs, std::vector<std::vector<int64_t>> inputs,
              std::vector<std::vector<int64_t>> outputs, int64_t n_slots,
              std::vector<int64_t> qkv, int64_t attn_out)
      : inputs_(std::move(inputs)), outputs_(std::move(outputs)), n_slots_(n_slots),
        qkv_(std::move(qkv)), attn_out_(attn_out) {
    for (const auto& p : programs) {
      owners_.push_back(py::reinterpret_borrow<py::object>(p));
      programs_.push_back(p.cast<const SliceProgram*>());
    }
    const size_t n = programs_.size();
    TORCH_CHECK(n > 0 && inputs_.size() == n && outputs_.size() == n && qkv_.size() == 3,
                "StepProgram: inputs and outputs per slice, three q/k/v slots");
    auto in_range = [&](int64_t s) { return s >= 0 && s < n_slots_; };
    for (size_t k = 0; k < n; ++k)
      for (const auto* slots : {&inputs_[k], &outputs_[k]})
        for (int64_t s : *slots) TORCH_CHECK(in_range(s), "StepProgram: slot ", s, " out of range");
    TORCH_CHECK(in_range(attn_out_) && in_range(qkv_[0]) && in_range(qkv_[1]) && in_range(qkv_[2]),
                "StepProgram: slot out of range");
  }

  // Slots 0.. hold `base`; the slices run from 0 with the GIL released. Returns (k, sent, slice
  // k's outputs): k the last slice (the step is done), or the layer whose exchange did not
  // answer: its ATTEND is the caller's to send (sent false) or, out already, its RESULT the
  // caller's to receive (sent true). fn / self: an ExchangeFn capsule and its object.
  // stamps (a timeline's, optional): int64 [slices, kStampCols], row j for slice j <= k:
  // exchange_clock_ns() when it began and ended, then its layer's exchange stamps (exchange.h)
  // and when the exchange returned (0 where it did not happen).
  std::tuple<int64_t, bool, std::vector<at::Tensor>> run(
      int64_t step_id, const std::vector<at::Tensor>& base, const py::capsule& fn,
      const py::capsule& self, const c10::optional<at::Tensor>& stamps) const {
    TORCH_CHECK(fn.name() != nullptr && std::string(fn.name()) == kExchangeCapsule,
                "StepProgram: fn is not a ", kExchangeCapsule, " capsule");
    TORCH_CHECK(static_cast<int64_t>(base.size()) <= n_slots_, "StepProgram: too many inputs");
    const int64_t last = static_cast<int64_t>(programs_.size()) - 1;
    int64_t* st = nullptr;
    if (stamps.has_value()) {
      const at::Tensor& t = *stamps;
      TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu() &&
                      t.dim() == 2 && t.size(0) == last + 1 && t.size(1) == kStampCols,
                  "StepProgram: stamps must be a contiguous CPU int64 [", last + 1, ", ",
                  kStampCols, "]");
      st = t.data_ptr<int64_t>();
      std::fill(st, st + t.numel(), int64_t{0});
    }
    const auto exchange = reinterpret_cast<ExchangeFn>(fn.get_pointer());
    void* obj = self.get_pointer();
    py::gil_scoped_release nogil;
    c10::InferenceMode inference;
    std::vector<at::Tensor> slots(base);
    slots.resize(n_slots_);
    std::vector<at::Tensor> args, dead;  // dead: values replaced, freed while the node attends
    ExchangeExtra extra;
    extra.idle = [](void* p) { static_cast<std::vector<at::Tensor>*>(p)->clear(); };
    extra.idle_arg = &dead;
    for (int64_t k = 0;; ++k) {
      int64_t* row = st != nullptr ? st + k * kStampCols : nullptr;
      if (row != nullptr) row[0] = exchange_clock_ns();
      dead.clear();
      args.clear();
      for (int64_t s : inputs_[k]) {
        TORCH_CHECK(slots[s].defined(), "StepProgram: slice ", k, " reads slot ", s,
                    " before it is written");
        args.push_back(slots[s]);
      }
      std::vector<at::Tensor> out = programs_[k]->run(args);
      if (row != nullptr) row[1] = exchange_clock_ns();
      if (k == last) return {k, false, std::move(out)};
      for (size_t j = 0; j < out.size(); ++j)
        dead.push_back(std::exchange(slots[outputs_[k][j]], out[j]));
      dead.push_back(std::move(slots[attn_out_]));
      for (at::Tensor& a : args) dead.push_back(std::move(a));
      at::Tensor o;
      extra.stamps = row != nullptr ? row + 2 : nullptr;
      const int status = exchange(obj, step_id, k, slots[qkv_[0]], slots[qkv_[1]],
                                  slots[qkv_[2]], &o, extra);
      if (row != nullptr) row[2 + kExchangeStamps] = exchange_clock_ns();
      if (status != kAnswered) return {k, status == kSentOnly, std::move(out)};
      slots[attn_out_] = std::move(o);
    }
  }

  static constexpr int64_t kStampCols = 3 + kExchangeStamps;

 private:
  std::vector<py::object> owners_;  // keep the programs alive
  std::vector<const SliceProgram*> programs_;
  std::vector<std::vector<int64_t>> inputs_, outputs_;
  int64_t n_slots_;
  std::vector<int64_t> qkv_;
  int64_t attn_out_;
};

}  // namespace

void bind_slice_program(py::module_& m) {
  py::class_<SliceProgram>(m, "SliceProgram",
                           "A dense slice's ops run in C++ (lamina/computenode/native_slice.py)")
      .def(py::init<int64_t, std::vector<at::Tensor>, const py::list&, std::vector<int64_t>>(),
           py::arg("n_inputs"), py::arg("constants"), py::arg("instrs"), py::arg("outputs"))
      .def("run", &SliceProgram::run, py::arg("inputs"),
           "run(inputs: list[Tensor]) -> list[Tensor], the slice's outputs (GIL released)",
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &SliceProgram::size);
  py::class_<StepProgram>(m, "StepProgram",
                          "A lone micro-batch's step, every slice in C++ "
                          "(lamina/computenode/native_slice.py step_program)")
      .def(py::init<const py::list&, std::vector<std::vector<int64_t>>,
                    std::vector<std::vector<int64_t>>, int64_t, std::vector<int64_t>, int64_t>(),
           py::arg("programs"), py::arg("inputs"), py::arg("outputs"), py::arg("n_slots"),
           py::arg("qkv"), py::arg("attn_out"))
      .def("run", &StepProgram::run, py::arg("step_id"), py::arg("base"), py::arg("fn"),
           py::arg("self"), py::arg("stamps") = py::none(),
           "run(step_id, base: list[Tensor], fn, self, stamps=None) -> (k, sent, list[Tensor]): "
           "slice k's outputs, k the last slice or the layer whose exchange did not answer "
           "(sent: its ATTEND is out) (GIL released inside); stamps: int64 [slices, "
           "STAMP_COLS], each slice's start, end, exchange stamps and return (clock ns)")
      .def_property_readonly_static("STAMP_COLS",
                                    [](py::object) { return StepProgram::kStampCols; });
}
