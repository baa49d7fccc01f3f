// The memory node's data plane in native code (lamina/memnode/native.py): ATTEND messages taken
// off a peer's receive ring, their K/V appended to the pool, paged attention run, and the RESULT
// written into the ring of the replica named by reply_to, all without the GIL and without a
// Python object per message.
//
// Python (memnode/node.py MemoryNode, memnode/server.py NodeServer) stays the reference and the
// control plane: it prepares steps and registers them here (add_step), and handles every message
// this loop does not take. serve() hands a message back untouched (HANDOFF) unless it is an
// ATTEND that the Python path would answer with a RESULT computed by the same C++ kernel: a
// registered step, a known layer not attended yet, works that continue the layer, shapes that
// match, dtypes the C++ kernel takes, a registered reply peer with room for the RESULT. So every
// error reply, and every reply the kernel dispatcher would compute otherwise, comes from Python,
// and a reply from here is the one Python would send (the span's times aside).
//
// Shared state, guarded by the plane's mutex (lock()/unlock(), which Python holds while its
// control plane touches the node): the step table, the peers, and each step's progress array,
// int64 [L + 1] (progress[i]: the next work of pool layer i, -1 once attended; progress[L]: the
// layers left), which Python's MemoryNode.attend reads and moves too. A step whose last layer
// is attended here is listed by finished() (Python then ends it: MemoryNode.sync); its tensors
// are released there, with the GIL.
#include <torch/extension.h>

#include <immintrin.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "exchange.h"
#include "mailbox_io.h"
#include "ring_io.h"

namespace py = pybind11;

namespace {

using namespace lamina_ring;

using AttentionFn = std::tuple<at::Tensor, at::Tensor> (*)(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, double,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&);
using StoreFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&);
using MergeFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&);

// serve() results
constexpr int64_t kIdle = 0;     // nothing arrived within the spin (or the time budget passed)
constexpr int64_t kHandoff = 1;  // the next message is Python's; it is still in the ring

struct LayerSpec {  // an AttentionSpec, by pool layer
  int64_t layer, heads, kv_heads, dim;
  double scale;
  int64_t window;  // 0: none
  double softcap;  // 0: none
};

struct KeyIndex {  // memnode/plan.py KernelIndex
  at::Tensor indptr, indices, start_pos;
};

struct Cascade {  // memnode/cascade.py Cascade: the second pass of a step over shared prefixes
  KeyIndex suffix;  // every work's own keys (a grouped one's from its prefix's end)
  at::Tensor rows, qo_indptr, q_positions;  // the groups' query rows, as kernel requests
  KeyIndex prefix;  // each group's shared keys
};

struct Step {  // memnode/plan.py StepState, what ATTEND needs of it
  int64_t works;
  at::Tensor q_indptr, a_indptr, q_positions, append_slots, progress;
  std::unordered_map<int64_t, KeyIndex> kv;  // window (0: none) -> key indices
  std::optional<Cascade> cascade;            // layers without a window, whole-step ATTENDs
};

struct Peer {  // the ring this node writes a replica's RESULTs into
  Ring ring;
  int64_t* head;  // the channel's Writer.head
  int bell;       // its data doorbell's fd (-1: none)
};

// Parses meta that is exactly json.dumps({"works": [a, b]}, separators=(",", ":")).
bool parse_works(const std::string& meta, int64_t* a, int64_t* b) {
  long long x = 0, y = 0;
  int used = 0;
  if (std::sscanf(meta.c_str(), "{\"works\":[%lld,%lld]}%n", &x, &y, &used) != 2) return false;
  if (used != static_cast<int>(meta.size())) return false;
  char canon[64];  // only the canonical spelling (no spaces, no leading zeros or '+')
  std::snprintf(canon, sizeof(canon), "{\"works\":[%lld,%lld]}", x, y);
  if (meta != canon) return false;
  *a = x, *b = y;
  return true;
}

const DType* float_dtype(int code) {
  const DType* d = by_code(code);
  if (!d) return nullptr;
  return (d->type == at::kFloat || d->type == at::kBFloat16 || d->type == at::kHalf) ? d : nullptr;
}

// pool[slots[i]] = x[i] for a pool layer [S, Hkv, D] (MemoryNode's ``index_copy_``): one
// memcpy a row where x has the pool's dtype and both hold rows contiguously and every slot is in
// range (a decode step's few rows: index_copy_'s TensorIterator costs ~5 us a call), else
// index_copy_ itself (which converts, or raises on a bad slot).
void put_rows(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& x) {
  const int64_t n = x.size(0), S = pool.size(0), row = pool.size(1) * pool.size(2);
  const bool flat = x.scalar_type() == pool.scalar_type() && x.is_contiguous() &&
                    pool.stride(2) == 1 && pool.stride(1) == pool.size(2) &&
                    slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                    slots.numel() == n;
  if (flat) {
    const int64_t* sl = slots.data_ptr<int64_t>();
    bool in_range = true;
    for (int64_t i = 0; i < n; ++i) in_range = in_range && sl[i] >= 0 && sl[i] < S;
    if (in_range) {
      const int64_t bytes = row * x.element_size(), stride = pool.stride(0) * x.element_size();
      const char* src = static_cast<const char*>(x.data_ptr());
      char* dst = static_cast<char*>(pool.data_ptr());
      for (int64_t i = 0; i < n; ++i) std::memcpy(dst + sl[i] * stride, src + i * bytes, bytes);
      return;
    }
  }
  pool.index_copy_(0, slots, x.to(pool.scalar_type()));
}

class AttendPlane {
 public:
  // k_cache / v_cache: the pool's [L, S, Hkv, D] CPU tensors in the kernel's dtypes (KVPool.k);
  // k_scale / v_scale: an 8-bit part's [L, S, Hkv] float32 scales (else None); specs: per pool
  // layer (layer, heads, kv_heads, dim, scale, window or 0, softcap or 0); kernel / store: the
  // C++ kernels' capsules (lamina.kernels.cpp_ext paged_attention_fn, kv_store_fn, merge_rows_fn);
  // limits: the receive side's WireLimits tuple; attend / result: the wire codes of ATTEND and
  // RESULT.
  AttendPlane(at::Tensor k_cache, at::Tensor v_cache, c10::optional<at::Tensor> k_scale,
              c10::optional<at::Tensor> v_scale,
              const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, double, int64_t,
                                           double>>& specs,
              py::capsule kernel, py::capsule store, py::capsule merge,
              const std::vector<int64_t>& limits, int64_t attend, int64_t result)
      : k_(std::move(k_cache)), v_(std::move(v_cache)),
        ks_(k_scale.value_or(at::Tensor())), vs_(v_scale.value_or(at::Tensor())), lim_(limits),
        attend_(attend), result_(result) {
    TORCH_CHECK(std::string(kernel.name()) == "lamina.paged_attention/2" &&
                    std::string(store.name()) == "lamina.kv_store" &&
                    std::string(merge.name()) == "lamina.merge_rows",
                "not the kernels' capsules");
    kernel_ = reinterpret_cast<AttentionFn>(kernel.get_pointer());
    store_ = reinterpret_cast<StoreFn>(store.get_pointer());
    merge_ = reinterpret_cast<MergeFn>(merge.get_pointer());
    TORCH_CHECK(k_.device().is_cpu() && k_.dim() == 4 && k_.sizes() == v_.sizes(),
                "a CPU pool [L, S, Hkv, D]");
    for (const auto& s : specs) {
      const auto [layer, heads, kv_heads, dim, scale, window, softcap] = s;
      layer_index_[layer] = static_cast<int64_t>(specs_.size());
      specs_.push_back({layer, heads, kv_heads, dim, scale, window, softcap});
    }
    TORCH_CHECK(static_cast<int64_t>(specs_.size()) == k_.size(0), "a spec per pool layer");
  }

  // -- the control plane's calls (Python holds lock()) -------------------------------------
  void add_step(int64_t id, int64_t works, at::Tensor q_indptr, at::Tensor a_indptr,
                at::Tensor q_positions, at::Tensor append_slots, at::Tensor progress,
                const std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor>>& kv) {
    TORCH_CHECK(progress.dtype() == at::kLong && progress.is_contiguous() &&
                    progress.numel() == static_cast<int64_t>(specs_.size()) + 1,
                "progress: int64 [L + 1]");
    Step s{works, q_indptr, a_indptr, q_positions, append_slots, progress, {}, std::nullopt};
    for (const auto& [window, indptr, indices, start] : kv) s.kv[window] = {indptr, indices, start};
    steps_[id] = std::move(s);
  }

  // The cascade of step id (after add_step): suffix and prefix as (indptr, indices, start_pos),
  // the groups' query rows, qo_indptr and q_positions (memnode/cascade.py Cascade).
  void add_cascade(int64_t id, at::Tensor s_indptr, at::Tensor s_indices, at::Tensor s_start,
                   at::Tensor rows, at::Tensor qo_indptr, at::Tensor q_positions,
                   at::Tensor p_indptr, at::Tensor p_indices, at::Tensor p_start) {
    auto it = steps_.find(id);
    TORCH_CHECK(it != steps_.end(), "add_cascade: step ", id, " is not registered");
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows: int64");
    it->second.cascade = Cascade{{s_indptr, s_indices, s_start}, rows, qo_indptr, q_positions,
                                 {p_indptr, p_indices, p_start}};
  }

  void drop_step(int64_t id) { steps_.erase(id); }

  // Ids of the steps whose last layer was attended here since the last call (their state is
  // released now, with the GIL held).
  std::vector<int64_t> finished() {
    std::vector<int64_t> out;
    out.swap(finished_);
    retired_.clear();
    return out;
  }

  void add_peer(int64_t id, int64_t ctl, int64_t data, int64_t cap, int64_t head_addr, int bell) {
    peers_.insert_or_assign(id, Peer{Ring(ctl, data, cap), reinterpret_cast<int64_t*>(head_addr),
                                     bell});
  }

  void remove_peer(int64_t id) { peers_.erase(id); }

  void lock() { mu_.lock(); }  // bound without the GIL
  void unlock() { mu_.unlock(); }

  int64_t attend_ns() const { return attend_ns_; }
  int64_t served() const { return served_; }

  // -- the data plane ----------------------------------------------------------------------
  // Serves the receive ring (ctl, data, cap; tail_addr: the channel's Reader.tail; data_bell /
  // space_bell: its doorbells' fds or -1) without the GIL, ATTEND after ATTEND, until a message
  // is Python's (kHandoff: still in the ring) or budget_ns passed (kIdle). Between messages it
  // polls spin_ns (yield_every > 0: sched_yield every that many rounds of 64 polls), then, with
  // a data doorbell and yield_every == 0, sleeps on it as RingChannel's receivers do.
  int64_t serve(int64_t ctl, int64_t data, int64_t cap, int64_t tail_addr, int data_bell,
                int space_bell, int64_t spin_ns, int64_t yield_every, int64_t budget_ns) {
    const Ring rx(ctl, data, cap);
    int64_t* tail = reinterpret_cast<int64_t*>(tail_addr);
    return without_gil([&]() -> int64_t {
      const int64_t end = now_ns() + budget_ns;
      for (;;) {
        while (!arrived(rx, *tail, spin_ns, yield_every)) {
          if (data_bell < 0 || yield_every > 0 || now_ns() >= end || closed(rx)) return kIdle;
          sleep_until_data(rx, *tail, data_bell, end - now_ns());
        }
        {
          std::lock_guard<std::mutex> guard(mu_);
          bool done = false;
          try {
            done = attend_one(rx, tail, space_bell);
          } catch (...) {  // nothing taken: Python takes the message and reports what it finds
          }
          if (!done) return kHandoff;
        }
        if (now_ns() >= end || closed(rx)) return kIdle;
      }
    });
  }

  // An ATTEND in this process (NativePlane.attend, for MemoryNode.attend): the caller holds
  // lock() or is the node's only thread. The same checks, K/V append and kernel as serve()'s,
  // from tensors instead of a ring: (o, lse, t0, t1), or None where Python must answer (it then
  // computes or raises as usual). a < 0: the works from the layer's next one to the step's end.
  py::object attend(int64_t step_id, int64_t layer, int64_t a, int64_t b, const at::Tensor& q,
                    const at::Tensor& k, const at::Tensor& v) {
    at::Tensor o, lse;
    int64_t t0 = 0, t1 = 0;
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = attend_tensors(step_id, layer, a, b, q, k, v, &o, &lse, &t0, &t1);
    }
    if (!ok) return py::none();
    return py::make_tuple(o, lse, t0, t1);
  }

  // A step mailbox's SENDs for this node answered without the GIL (mailbox_io.h poll()):
  // layout int64 [slots, 9] of addresses (MailboxLoop's), seen int64 [slots] (updated); dims
  // (tokens, heads, kv_heads, dim, the wire dtype code of q/k/v/o). Each answer takes the lock.
  // Returns (SENDs answered, the slot whose SEND is Python's or -1).
  std::pair<int64_t, int64_t> serve_mailbox(const at::Tensor& layout, const at::Tensor& seen,
                                            const std::vector<int64_t>& dims, int64_t spin_ns,
                                            int64_t yield_every) {
    using namespace lamina_mailbox;
    TORCH_CHECK(layout.scalar_type() == at::kLong && layout.is_contiguous() && layout.dim() == 2 &&
                    layout.size(1) == kSlotFields && seen.scalar_type() == at::kLong &&
                    seen.is_contiguous() && seen.numel() == layout.size(0) && dims.size() == 5,
                "serve_mailbox: layout int64 [slots, 9], seen int64 [slots], 5 dims");
    const DType* dt = float_dtype(static_cast<int>(dims[4]));
    TORCH_CHECK(dt != nullptr, "serve_mailbox: q/k/v in float32, bfloat16 or float16");
    const Dims d{dims[0], dims[1], dims[2], dims[3], dt->type};
    const int64_t n = layout.size(0);
    std::vector<Slot> slots(n);
    const int64_t* a = layout.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i, a += kSlotFields)
      slots[i] = {reinterpret_cast<int64_t*>(a[0]), reinterpret_cast<int64_t*>(a[1]),
                  reinterpret_cast<int64_t*>(a[2]), reinterpret_cast<int64_t*>(a[3]),
                  reinterpret_cast<void*>(a[4]),    reinterpret_cast<void*>(a[5]),
                  reinterpret_cast<void*>(a[6]),    reinterpret_cast<void*>(a[7]),
                  reinterpret_cast<float*>(a[8])};
    int64_t* seen_at = seen.data_ptr<int64_t>();
    return without_gil([&]() {
      return poll(slots.data(), n, seen_at, d, spin_ns, yield_every,
                  [&](int64_t step, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, at::Tensor* o, at::Tensor* lse) {
                    std::lock_guard<std::mutex> guard(mu_);
                    int64_t t0, t1;
                    try {
                      return attend_tensors(step, layer, -1, -1, q, k, v, o, lse, &t0, &t1);
                    } catch (...) {  // Python attends again and reports what it finds
                      return false;
                    }
                  });
    });
  }

  // The plane as an ExchangeFn (exchange.h) for a whole-step program in this process, under the
  // same rule as attend(): the whole layer, one node holding every key of the step's requests.
  static int exchange(void* self, int64_t step_id, int64_t layer, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& v, at::Tensor* o,
                      const ExchangeExtra& extra) {
    at::Tensor lse;
    int64_t t0, t1;
    if (extra.idle != nullptr) extra.idle(extra.idle_arg);
    if (!static_cast<AttendPlane*>(self)->attend_tensors(step_id, layer, -1, -1, q, k, v, o, &lse,
                                                         &t0, &t1))
      return kDeclined;
    if (int64_t* st = extra.stamps; st != nullptr) st[0] = t0, st[1] = t0, st[2] = t1;
    return kAnswered;
  }

 private:
  // attend()'s work, without the GIL: false where Python must answer.
  bool attend_tensors(int64_t step_id, int64_t layer, int64_t a, int64_t b, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& v, at::Tensor* o, at::Tensor* lse,
                      int64_t* t0, int64_t* t1) {
    auto it = steps_.find(step_id);
    auto li_it = layer_index_.find(layer);
    if (it == steps_.end() || li_it == layer_index_.end()) return false;
    Step& step = it->second;
    const int64_t li = li_it->second, R = step.works;
    const int64_t first = step.progress.data_ptr<int64_t>()[li];
    if (first < 0) return false;
    if (a < 0) a = first, b = R;
    if (a != first || !((a < b && b <= R) || (a == b && b == R && R == 0))) return false;
    const LayerSpec& sp = specs_[li];
    const int64_t* qi = step.q_indptr.data_ptr<int64_t>();
    const int64_t* ai = step.a_indptr.data_ptr<int64_t>();
    auto is = [](const at::Tensor& x, int64_t n, int64_t h, int64_t dim) {
      const auto t = x.scalar_type();
      return x.device().is_cpu() && x.dim() == 3 && x.size(0) == n && x.size(1) == h &&
             x.size(2) == dim && x.is_contiguous() &&
             (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
    };
    const int64_t nq = qi[b] - qi[a], na = ai[b] - ai[a];
    if (!is(q, nq, sp.heads, sp.dim) || !is(k, na, sp.kv_heads, sp.dim) ||
        !is(v, na, sp.kv_heads, sp.dim))
      return false;
    *t0 = now_ns();
    if (!run(step, li, a, b, q, k, v, o, lse)) return false;
    advance(it, li, b);
    *t1 = now_ns();
    attend_ns_ += *t1 - *t0;
    ++served_;
    return true;
  }

  // this end (reader) or the peer (writer) closed the ring: back to Python, which raises
  static bool closed(const Ring& rx) {
    return rx.load(kReaderClosed) != 0 || rx.load(kWriterClosed) != 0;
  }

  static bool arrived(const Ring& rx, int64_t tail, int64_t spin_ns, int64_t yield_every) {
    const uint64_t t = static_cast<uint64_t>(tail);
    return spin([&] { return rx.load(kHead) != t; }, spin_ns, yield_every);
  }

  // A tensor of the message at stream count `at`: the ring's bytes in place, or a copy when
  // they wrap around the ring's end.
  static at::Tensor view(const Ring& rx, uint64_t at, const Desc& d) {
    const auto opts = at::TensorOptions().dtype(by_code(d.code)->type);
    const c10::IntArrayRef shape(d.shape, d.ndim);
    const int64_t pos = static_cast<int64_t>(at % rx.cap), n = static_cast<int64_t>(d.nbytes);
    if (pos + n <= rx.cap) return at::from_blob(rx.data + pos, shape, opts);
    at::Tensor x = at::empty(shape, opts);
    rx.get(at, x.data_ptr(), n);
    return x;
  }

  // The ATTEND at the tail, served (true), or left in the ring for Python (false).
  bool attend_one(const Ring& rx, int64_t* tail, int space_bell) {
    const uint64_t t = static_cast<uint64_t>(*tail);
    const int64_t avail = static_cast<int64_t>(rx.load(kHead) - t);
    if (avail < kHeaderBytes) return false;
    Header hd;
    rx.get(t, &hd, kHeaderBytes);
    const int64_t total = static_cast<int64_t>(hd.total);
    if (std::memcmp(hd.magic, kMagic, 4) != 0 || hd.version != kVersion || hd.kind != attend_ ||
        hd.num_tensors != 3 || hd.num_tensors > lim_.tensors || hd.meta_len > lim_.meta_bytes ||
        total > lim_.message_bytes || total > rx.cap || total > avail)
      return false;
    Desc descs[3];
    rx.get(t + kHeaderBytes, descs, 3 * kDescBytes);
    if (!well_formed(hd, descs, lim_)) return false;
    // the step, the layer, the works: what MemoryNode.attend checks, else Python raises
    auto it = steps_.find(hd.step_id);
    auto li_it = layer_index_.find(hd.layer);
    if (it == steps_.end() || li_it == layer_index_.end()) return false;
    Step& step = it->second;
    const int64_t li = li_it->second;
    const int64_t first = step.progress.data_ptr<int64_t>()[li], R = step.works;
    if (first < 0) return false;
    int64_t a = first, b = R;
    if (hd.meta_len) {
      std::string meta(hd.meta_len, '\0');
      rx.get(t + kHeaderBytes + 3 * kDescBytes, meta.data(), hd.meta_len);
      if (!parse_works(meta, &a, &b)) return false;
    }
    if (a != first || !((a < b && b <= R) || (a == b && b == R && R == 0))) return false;
    auto peer = peers_.find(hd.reply_to);
    if (peer == peers_.end()) return false;
    const LayerSpec& sp = specs_[li];
    const int64_t* qi = step.q_indptr.data_ptr<int64_t>();
    const int64_t* ai = step.a_indptr.data_ptr<int64_t>();
    const int64_t qa = qi[a], qb = qi[b], aa = ai[a], ab = ai[b];
    const Desc &dq = descs[0], &dk = descs[1], &dv = descs[2];
    auto is = [](const Desc& d, int64_t n, int64_t h, int64_t dim) {
      return d.ndim == 3 && d.shape[0] == n && d.shape[1] == h && d.shape[2] == dim;
    };
    if (!is(dq, qb - qa, sp.heads, sp.dim) || !is(dk, ab - aa, sp.kv_heads, sp.dim) ||
        !is(dv, ab - aa, sp.kv_heads, sp.dim) || !float_dtype(dq.code) ||
        !float_dtype(dk.code) || !float_dtype(dv.code))
      return false;
    // the RESULT must fit in the reply ring now (else Python streams it)
    const DType* qt = float_dtype(dq.code);
    const int64_t o_bytes = (qb - qa) * sp.heads * sp.dim * qt->size;
    const int64_t lse_bytes = (qb - qa) * sp.heads * 4;
    const int64_t reply_max = align(kHeaderBytes + 3 * kDescBytes) + align(o_bytes) +
                              align(lse_bytes) + align(2 * sizeof(int64_t));
    Peer& out = peer->second;
    if (out.ring.load(kReaderClosed) || reply_max > lim_.message_bytes ||
        reply_max > out.ring.cap - static_cast<int64_t>(static_cast<uint64_t>(*out.head) -
                                                        out.ring.load(kTail)))
      return false;

    const int64_t t0 = now_ns();
    uint64_t at = t + align(kHeaderBytes + 3 * kDescBytes + hd.meta_len);
    at::Tensor q = view(rx, at, dq);
    at += align(static_cast<int64_t>(dq.nbytes));
    at::Tensor k = view(rx, at, dk);
    at += align(static_cast<int64_t>(dk.nbytes));
    at::Tensor v = view(rx, at, dv);
    at::Tensor o, lse;
    if (!run(step, li, a, b, q, k, v, &o, &lse)) return false;
    advance(it, li, b);
    const int64_t t1 = now_ns();
    attend_ns_ += t1 - t0;
    ++served_;
    write_result(out, hd, o, lse, t0, t1);
    // the ATTEND's bytes are free once its RESULT is out (q/k/v were read in place)
    *tail = static_cast<int64_t>(t + total);
    rx.store(kTail, static_cast<uint64_t>(*tail));
    if (rx.flag_after_fence(kWriterWaits)) ring_bell(space_bell);
    return true;
  }

  // MemoryNode.attend for works [a, b) (already checked) of `step` at pool layer li: K/V
  // appended to the pool (quantised where the format says so), then the kernel over the view of
  // [a, b). False where Python must answer: no key indices for the layer's window, or the kernel
  // raised (Python attends again; the K/V written is harmless).
  bool run(Step& step, int64_t li, int64_t a, int64_t b, const at::Tensor& q, const at::Tensor& k,
           const at::Tensor& v, at::Tensor* o, at::Tensor* lse) {
    const LayerSpec& sp = specs_[li];
    const int64_t R = step.works;
    const int64_t* qi = step.q_indptr.data_ptr<int64_t>();
    const int64_t* ai = step.a_indptr.data_ptr<int64_t>();
    const int64_t qa = qi[a], qb = qi[b], aa = ai[a], ab = ai[b];
    const bool whole = a == 0 && b == R;
    const at::Tensor slots = whole ? step.append_slots : step.append_slots.slice(0, aa, ab);
    const int64_t window = sp.window > 0 ? sp.window : 0;
    auto key = step.kv.find(window);
    if (key == step.kv.end()) return false;
    const KeyIndex& ki = key->second;
    // a cascade (as MemoryNode.attend runs it: whole-step ATTENDs on layers without a window);
    // the merge here is float32's, so other query dtypes are Python's
    const Cascade* cas = whole && window == 0 && step.cascade ? &*step.cascade : nullptr;
    if (cas != nullptr && q.scalar_type() != at::kFloat) return false;
    try {
      c10::optional<at::Tensor> ks, vs;  // this layer's scales (8-bit parts)
      if (ks_.defined()) ks = ks_[li];
      if (vs_.defined()) vs = vs_[li];
      if (ks) store_(k_[li], *ks, slots, k);
      else put_rows(k_[li], slots, k);
      if (vs) store_(v_[li], *vs, slots, v);
      else put_rows(v_[li], slots, v);
      at::Tensor q_indptr = step.q_indptr, kv_indptr = ki.indptr, kv_indices = ki.indices,
                 q_pos = step.q_positions, kv_start = ki.start_pos;
      if (!whole) {
        const int64_t* kp = ki.indptr.data_ptr<int64_t>();
        q_indptr = step.q_indptr.slice(0, a, b + 1) - qa;
        kv_indptr = ki.indptr.slice(0, a, b + 1) - kp[a];
        kv_indices = ki.indices.slice(0, kp[a], kp[b]);
        q_pos = step.q_positions.slice(0, qa, qb);
        kv_start = ki.start_pos.slice(0, a, b);
      }
      if (cas != nullptr) {  // memnode/cascade.py attend_cascade
        const KeyIndex& sx = cas->suffix;
        const KeyIndex& px = cas->prefix;
        std::tie(*o, *lse) = kernel_(q, k_[li], v_[li], q_indptr, sx.indptr, sx.indices, q_pos,
                                     sx.start_pos, sp.scale, 0, sp.softcap, ks, vs);
        const auto [og, lg] = kernel_(q.index_select(0, cas->rows), k_[li], v_[li],
                                      cas->qo_indptr, px.indptr, px.indices, cas->q_positions,
                                      px.start_pos, sp.scale, 0, sp.softcap, ks, vs);
        merge_(*o, *lse, cas->rows, og, lg);
        return true;
      }
      std::tie(*o, *lse) = kernel_(q, k_[li], v_[li], q_indptr, kv_indptr, kv_indices, q_pos,
                                   kv_start, sp.scale, window, sp.softcap, ks, vs);
    } catch (const std::exception&) {
      return false;
    }
    return true;
  }

  // The step's layer li is attended up to work b; its last layer ends the step (finished()).
  void advance(std::unordered_map<int64_t, Step>::iterator it, int64_t li, int64_t b) {
    Step& step = it->second;
    int64_t* progress = step.progress.data_ptr<int64_t>();
    const int64_t L = static_cast<int64_t>(specs_.size());
    if (b < step.works) {
      progress[li] = b;
      return;
    }
    progress[li] = -1;
    if (--progress[L] == 0) {
      finished_.push_back(it->first);
      retired_.push_back(std::move(step));  // released by finished(), with the GIL
      steps_.erase(it);
    }
  }

  // RESULT: what codec.to_message(AttendResult) and Writer.send put in the ring.
  // The RESULT codec.to_message(AttendResult) writes: no meta; tensors o, lse and the span
  // [t0, t1] (int64), each padded to kAlign.
  void write_result(Peer& out, const Header& req, const at::Tensor& o, const at::Tensor& lse,
                    int64_t t0, int64_t t1) {
    const int64_t span[2] = {t0, t1};
    const at::Tensor oc = o.contiguous(), lc = lse.contiguous();
    const void* src[3] = {oc.data_ptr(), lc.data_ptr(), span};
    const at::Tensor* ts[2] = {&oc, &lc};
    Desc descs[3];
    std::memset(descs, 0, sizeof(descs));
    int64_t total = align(kHeaderBytes + 3 * kDescBytes);
    for (int i = 0; i < 3; ++i) {
      Desc& d = descs[i];
      if (i < 2) {
        const at::Tensor& x = *ts[i];
        const DType* dt = by_type(x.scalar_type());
        d.code = static_cast<uint8_t>(dt->code);
        d.ndim = static_cast<uint8_t>(x.dim());
        d.nbytes = static_cast<uint64_t>(x.numel() * dt->size);
        for (int64_t k = 0; k < x.dim(); ++k) d.shape[k] = x.size(k);
      } else {
        d.code = static_cast<uint8_t>(by_type(at::kLong)->code);
        d.ndim = 1;
        d.nbytes = sizeof(span);
        d.shape[0] = 2;
      }
      total += align(static_cast<int64_t>(d.nbytes));
    }
    Header hd;
    std::memcpy(hd.magic, kMagic, 4);
    hd.version = kVersion;
    hd.kind = static_cast<uint16_t>(result_);
    hd.step_id = req.step_id, hd.layer = req.layer, hd.reply_to = 0;
    hd.num_tensors = 3;
    hd.meta_len = 0;
    hd.total = static_cast<uint64_t>(total);
    const uint64_t h = static_cast<uint64_t>(*out.head);
    uint64_t at = h;
    out.ring.put(at, &hd, kHeaderBytes), at += kHeaderBytes;
    out.ring.put(at, descs, 3 * kDescBytes);
    at = h + align(kHeaderBytes + 3 * kDescBytes);
    for (int i = 0; i < 3; ++i) {
      if (descs[i].nbytes) out.ring.put(at, src[i], static_cast<int64_t>(descs[i].nbytes));
      at += align(static_cast<int64_t>(descs[i].nbytes));
    }
    *out.head = static_cast<int64_t>(h + total);
    out.ring.store(kHead, h + total);
    if (out.ring.flag_after_fence(kReaderWaits)) ring_bell(out.bell);
  }

  at::Tensor k_, v_, ks_, vs_;  // ks_ / vs_ undefined for float parts
  Limits lim_;
  int64_t attend_, result_;
  AttentionFn kernel_ = nullptr;
  StoreFn store_ = nullptr;
  MergeFn merge_ = nullptr;
  std::vector<LayerSpec> specs_;
  std::unordered_map<int64_t, int64_t> layer_index_;  // spec.layer -> pool layer
  std::unordered_map<int64_t, Step> steps_;
  std::unordered_map<int64_t, Peer> peers_;
  std::vector<int64_t> finished_;
  std::vector<Step> retired_;
  std::mutex mu_;
  int64_t attend_ns_ = 0, served_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lamina memory node's native ATTEND path (see lamina/memnode/native.py)";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<AttendPlane>(m, "AttendPlane")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, double,
                                                 int64_t, double>>&,
                    py::capsule, py::capsule, py::capsule, const std::vector<int64_t>&, int64_t,
                    int64_t>())
      .def("add_step", &AttendPlane::add_step)
      .def("add_cascade", &AttendPlane::add_cascade)
      .def("drop_step", &AttendPlane::drop_step)
      .def("finished", &AttendPlane::finished)
      .def("add_peer", &AttendPlane::add_peer)
      .def("remove_peer", &AttendPlane::remove_peer)
      .def("lock", &AttendPlane::lock, nogil)
      .def("unlock", &AttendPlane::unlock)
      .def("attend", &AttendPlane::attend,
           "attend(step_id, layer, a, b, q, k, v) -> (o, lse, t0, t1) | None: an ATTEND in "
           "this process (a < 0: the whole rest of the layer)")
      .def("handle",
           [](AttendPlane& p) { return py::capsule(static_cast<void*>(&p), "lamina.plane"); },
           "handle() -> the plane as exchange_fn's self (valid while the plane lives)")
      .def("serve", &AttendPlane::serve,
           "serve(ctl, data, cap, tail_addr, data_bell, space_bell, spin_ns, yield_every, "
           "budget_ns) -> IDLE | HANDOFF")
      .def("serve_mailbox", &AttendPlane::serve_mailbox,
           "serve_mailbox(layout, seen, dims, spin_ns, yield_every) -> (answered, slot | -1)")
      .def_property_readonly("attend_ns", &AttendPlane::attend_ns)
      .def_property_readonly("served", &AttendPlane::served);
  m.attr("exchange_fn") = py::capsule(reinterpret_cast<void*>(&AttendPlane::exchange),
                                       kExchangeCapsule);
  m.attr("IDLE") = kIdle;
  m.attr("HANDOFF") = kHandoff;
}
