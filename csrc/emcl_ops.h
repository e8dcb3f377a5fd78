// Host-side pieces shared by the CPU and CUDA implementations of the emcl:: operators:
// argument checking, the runtime-to-compile-time mode dispatch, and the launch counter.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "emcl_math.h"

namespace emcl {

// The tensor lists of one call; `meta_lrs` is empty unless lr_mode is "recurrent".
struct Lists {
  at::TensorList params, grads, anchors, importances, meta_lrs;
};

// Checks what the Python layer already guarantees (so a direct torch.ops.emcl call cannot
// crash a kernel): equal list lengths and sizes, one device, contiguous tensors, the parameter
// dtype on params/grads and its compute dtype on the state, 0-d fp32 flags on that device.
void check_call(const Lists& lists, const StepArgs& args,
                const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf);

StepArgs make_args(Op op, bool prox, c10::string_view importance, c10::string_view lr_mode,
                   double inner_lr, double meta_lr, double reg, double gamma, double decay,
                   double lr_scale, double lr_min, double lr_max, double eps);

// Kernel launches done by the CUDA backend since the library was loaded (read by tests through
// torch.ops.emcl.launch_count to check one launch per (device, dtype) group and step).
extern std::atomic<int64_t> g_launch_count;

// Calls f(std::integral_constant<bool, prox>, std::integral_constant<Importance, ...>,
// std::integral_constant<LrMode, ...>) with the call's modes as compile-time constants.
// Only the modes that the op reads are dispatched; the others are fixed, so the inner step is
// instantiated twice (prox or not), the meta step six times, the fused step twelve times.
template <Op kOp, typename F>
void dispatch_modes(const StepArgs& a, F&& f) {
  auto with_lr = [&](auto prox, auto imp) {
    if constexpr (!has_meta(kOp)) {
      f(prox, imp, std::integral_constant<LrMode, LrMode::kConstant>{});
    } else {
      switch (a.lr_mode) {
        case LrMode::kRecurrent:
          return f(prox, imp, std::integral_constant<LrMode, LrMode::kRecurrent>{});
        case LrMode::kInverse:
          return f(prox, imp, std::integral_constant<LrMode, LrMode::kInverse>{});
        case LrMode::kConstant:
          return f(prox, imp, std::integral_constant<LrMode, LrMode::kConstant>{});
      }
    }
  };
  auto with_imp = [&](auto prox) {
    if constexpr (!has_meta(kOp)) {
      with_lr(prox, std::integral_constant<Importance, Importance::kTaylor>{});
    } else if (a.importance == Importance::kTaylor) {
      with_lr(prox, std::integral_constant<Importance, Importance::kTaylor>{});
    } else {
      with_lr(prox, std::integral_constant<Importance, Importance::kSI>{});
    }
  };
  if constexpr (!has_inner(kOp)) {
    with_imp(std::true_type{});
  } else if (a.prox) {
    with_imp(std::true_type{});
  } else {
    with_imp(std::false_type{});
  }
}

// Calls f(std::integral_constant<Op, op>) for the runtime op.
template <typename F>
void dispatch_op(Op op, F&& f) {
  switch (op) {
    case Op::kInner:
      return f(std::integral_constant<Op, Op::kInner>{});
    case Op::kMeta:
      return f(std::integral_constant<Op, Op::kMeta>{});
    case Op::kInnerMeta:
      return f(std::integral_constant<Op, Op::kInnerMeta>{});
  }
}

// ---------------------------------------------------------------------------------------------
// The operator kernels, one template per op over the device's runner
//   void run(const Lists&, const StepArgs&, const std::optional<at::Tensor>& grad_scale,
//            const std::optional<at::Tensor>& found_inf);
// Their signatures follow the schemas of emcl_ops.cpp argument by argument.
// ---------------------------------------------------------------------------------------------
using OptTensor = std::optional<at::Tensor>;
using Runner = void (*)(const Lists&, const StepArgs&, const OptTensor&, const OptTensor&);

template <Runner run>
void inner_step_op(at::TensorList params, at::TensorList grads, at::TensorList anchors,
                   at::TensorList importances, double inner_lr, double reg, double gamma,
                   bool prox, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const StepArgs args = make_args(Op::kInner, prox, "taylor", "constant", inner_lr, 0.0, reg,
                                  gamma, 0.0, 1.0, 0.0, 0.0, 1.0);
  const Lists lists{params, grads, anchors, importances, {}};
  check_call(lists, args, grad_scale, found_inf);
  run(lists, args, grad_scale, found_inf);
}

template <Runner run>
void meta_step_op(at::TensorList params, at::TensorList grads, at::TensorList anchors,
                  at::TensorList importances, at::TensorList meta_lrs, double meta_lr,
                  double reg, double decay, double lr_scale, c10::string_view lr_mode,
                  double lr_min, double lr_max, double eps, c10::string_view importance,
                  const OptTensor& grad_scale, const OptTensor& found_inf) {
  const StepArgs args = make_args(Op::kMeta, true, importance, lr_mode, 0.0, meta_lr, reg, 0.0,
                                  decay, lr_scale, lr_min, lr_max, eps);
  const Lists lists{params, grads, anchors, importances, meta_lrs};
  check_call(lists, args, grad_scale, found_inf);
  run(lists, args, grad_scale, found_inf);
}

template <Runner run>
void inner_meta_step_op(at::TensorList params, at::TensorList grads, at::TensorList anchors,
                        at::TensorList importances, at::TensorList meta_lrs, double inner_lr,
                        double meta_lr, double reg, double gamma, double decay,
                        double lr_scale, c10::string_view lr_mode, double lr_min,
                        double lr_max, double eps, c10::string_view importance, bool prox,
                        const OptTensor& grad_scale, const OptTensor& found_inf) {
  const StepArgs args = make_args(Op::kInnerMeta, prox, importance, lr_mode, inner_lr, meta_lr,
                                  reg, gamma, decay, lr_scale, lr_min, lr_max, eps);
  const Lists lists{params, grads, anchors, importances, meta_lrs};
  check_call(lists, args, grad_scale, found_inf);
  run(lists, args, grad_scale, found_inf);
}

}  // namespace emcl
