// Host-side pieces shared by the CPU and CUDA implementations of the emcl:: operators (the op
// interface of emcl_kernels/interface.py, [note: the step call]): the argument checks, the
// runtime-to-compile-time mode dispatch, and the launch counter.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include "emcl_interface.h"
#include "emcl_math.h"

namespace emcl {

using OptTensor = std::optional<at::Tensor>;

// The tensor lists of one step call; `meta_lrs` is empty unless lr_mode is recurrent.
struct Lists {
  at::TensorList params, grads, anchors, importances, meta_lrs;
};

// The scalar arguments of one step call, checked and decoded.
struct StepCall {
  Op op;              // as passed: kInner, kMeta, kInnerMeta or kCadence
  bool prox;
  Importance importance;
  LrMode lr_mode;
  int64_t meta_every;
  bool alpha;         // meta_lrs are passed (lr_mode is recurrent)
  at::Device device;  // of every tensor of the call
  at::ScalarType dtype;  // of params and grads (kFloat when there are no params)
  int64_t runs;       // runs of an array ([note: runs] in emcl_kernels/interface.py); 1: none
};

// The length of a device's `counters` for a call over `runs` runs: the counter::kCount fields,
// and for runs > 1 a found flag and a skip count per run (interface.counters_size).
inline int64_t counters_size(int64_t runs) {
  return counter::kCount + (runs > 1 ? 2 * runs : 0);
}

// Checks every argument of a step_ call against the interface (emcl_kernels/interface.py) and
// returns the decoded scalars; throws before anything is written. A direct torch.ops.emcl call
// with bad arguments gets a ValueError (counts, shapes, values), a TypeError (dtypes) or a
// RuntimeError (devices, layouts), never a crash. Costs a few comparisons per tensor: no
// allocation, no message formatting unless a check fails. For an array of `runs` runs it also
// checks that `hyper` holds runs rows, `counters` the per-run slots, `steps` runs entries per
// parameter and that every tensor's numel is a multiple of `runs`.
StepCall check_step_call(const Lists& lists, const at::Tensor& steps, const at::Tensor& hyper,
                         const at::Tensor& counters, int64_t op, bool prox, int64_t importance,
                         int64_t lr_mode, int64_t meta_every, const OptTensor& grad_scale,
                         const OptTensor& found_inf, int64_t runs);

// The same for check_finite_(grads, counters, runs): grads of any parameter dtypes, dense and
// non-overlapping, on the device of `counters` (of counters_size(runs) elements), each with a
// numel that is a multiple of `runs`. Returns that device.
at::Device check_finite_call(at::TensorList grads, const at::Tensor& counters, int64_t runs);

// Which update the call does: `op`, or for kCadence kInnerMeta when (calls + 1) % meta_every
// == 0, else kInner (`calls` is counters[kCalls] as the call finds it).
EMCL_HD Op resolve_op(Op op, int64_t calls, int64_t meta_every) {
  if (op != Op::kCadence) return op;
  return (calls + 1) % meta_every == 0 ? Op::kInnerMeta : Op::kInner;
}

// Kernel launches done by the CUDA backend since the library was loaded, both kinds (the
// finite check and the update); read by the tests through torch.ops.emcl.launch_count.
extern std::atomic<int64_t> g_launch_count;

// One bit per intra-op thread (at::get_thread_num(), the 64th bit for any higher one) that ran a
// piece of the last pass of the CPU kernels (the finite check or the update); read by the tests
// through torch.ops.emcl.cpu_threads_used, which proves that a pass really is spread over the
// threads (see [note: OpenMP] in setup.py).
extern std::atomic<uint64_t> g_cpu_threads_mask;

// The CPU memory probes of the benchmarks' roof ([note: stream probes] in emcl_cpu_kernels.h).
enum class StreamProbe : int64_t {
  kScaleInplace = 0,
  kAxpyInplace = 1,
  kUpdatePattern = 2,
  kInnerPattern = 3,
  kReadPattern = 4,
  kStepPattern = 5,
  kStepPatternBf16 = 6,
  kInnerPatternBf16 = 7,
};

// Calls f(std::integral_constant<bool, prox>, std::integral_constant<Importance, ...>,
// std::integral_constant<LrMode, ...>) with the call's modes as compile-time constants.
template <typename F>
void dispatch_modes(bool prox, Importance importance, LrMode lr_mode, F&& f) {
  auto with_lr = [&](auto p, auto imp) {
    switch (lr_mode) {
      case LrMode::kRecurrent:
        return f(p, imp, std::integral_constant<LrMode, LrMode::kRecurrent>{});
      case LrMode::kInverse:
        return f(p, imp, std::integral_constant<LrMode, LrMode::kInverse>{});
      case LrMode::kConstant:
        return f(p, imp, std::integral_constant<LrMode, LrMode::kConstant>{});
    }
  };
  auto with_imp = [&](auto p) {
    if (importance == Importance::kTaylor) {
      with_lr(p, std::integral_constant<Importance, Importance::kTaylor>{});
    } else {
      with_lr(p, std::integral_constant<Importance, Importance::kSI>{});
    }
  };
  if (prox) {
    with_imp(std::true_type{});
  } else {
    with_imp(std::false_type{});
  }
}

// The same with only the modes that `kOp` reads dispatched (the others fixed): the inner step
// is instantiated twice (prox or not), the meta step six times, the fused step twelve times.
template <Op kOp, typename F>
void dispatch_modes_of(bool prox, Importance importance, LrMode lr_mode, F&& f) {
  constexpr auto kFixedImp = std::integral_constant<Importance, Importance::kTaylor>{};
  constexpr auto kFixedLr = std::integral_constant<LrMode, LrMode::kConstant>{};
  if constexpr (!has_meta(kOp)) {
    if (prox) {
      f(std::true_type{}, kFixedImp, kFixedLr);
    } else {
      f(std::false_type{}, kFixedImp, kFixedLr);
    }
  } else if constexpr (!has_inner(kOp)) {
    dispatch_modes(true, importance, lr_mode, [&](auto, auto imp, auto lr) {
      f(std::true_type{}, imp, lr);
    });
  } else {
    dispatch_modes(prox, importance, lr_mode, f);
  }
}

// Calls f(std::integral_constant<Op, op>) for a resolved op (kInner, kMeta, kInnerMeta).
template <typename F>
void dispatch_op(Op op, F&& f) {
  switch (op) {
    case Op::kInner:
      return f(std::integral_constant<Op, Op::kInner>{});
    case Op::kMeta:
      return f(std::integral_constant<Op, Op::kMeta>{});
    case Op::kInnerMeta:
      return f(std::integral_constant<Op, Op::kInnerMeta>{});
    case Op::kCadence:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "dispatch_op: the cadence is resolved before the dispatch");
}

}  // namespace emcl
