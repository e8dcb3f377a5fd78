// The CPU kernels, included twice: by emcl_cpu.cpp with torch's portable at::vec (any CPU) and
// by emcl_cpu_avx2.cpp compiled for AVX2+FMA, where at::vec uses AVX2 intrinsics.
// EMCL_CPU_NS names the namespace of each copy; emcl_cpu.cpp picks one at run time.
//
// Work is cut into pieces of at most kPieceSize elements across all tensors of the call, so one
// parallel region covers the whole list (many small tensors parallelize as well as one big
// one). Parameters in bf16/fp16 are widened to fp32 vectors, updated in fp32 and rounded once
// on store; fp32 and fp64 parameters are updated in their own precision.
#pragma once
#ifndef EMCL_CPU_NS
#error "define EMCL_CPU_NS before including emcl_cpu_kernels.h"
#endif

#define EMCL_MATH_AT_VEC
#include "emcl_math.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "emcl_ops.h"

namespace emcl {
namespace EMCL_CPU_NS {
namespace {

constexpr int64_t kPieceSize = 32768;     // elements per parallel work item
constexpr int64_t kSerialBelow = 131072;  // a call with fewer elements runs on one thread

// One work item: elements [begin, end) of tensor `tensor`.
struct Piece {
  int64_t tensor, begin, end;
};

// The data pointers of one tensor's lists; `alpha` is null unless lr_mode is "recurrent".
template <typename scalar_t, typename acc_t>
struct Pointers {
  scalar_t* param;
  const scalar_t* grad;
  acc_t* anchor;
  acc_t* importance;
  acc_t* alpha;
};

// Whole vectors take the fixed-size load/store (inlined); only a tensor's tail takes the
// counted one (a memcpy of variable size).
template <typename V>
V load(const typename V::value_type* ptr, int64_t count) {
  return count == V::size() ? V::loadu(ptr) : V::loadu(ptr, count);
}

template <typename V>
void store(const V& v, typename V::value_type* ptr, int64_t count) {
  if (count == V::size()) {
    v.store(ptr);
  } else {
    v.store(ptr, static_cast<int>(count));
  }
}

// Updates elements [begin, end) of one tensor whose parameter dtype is its compute dtype
// (fp32, fp64): Vectorized<acc_t> loads, the math, stores of what the op writes.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename acc_t>
void update_full(const Pointers<acc_t, acc_t>& t, int64_t begin, int64_t end,
                 const Hyper<at::vec::Vectorized<acc_t>>& hp) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  for (int64_t i = begin; i < end; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), end - i);
    Vec theta = load<Vec>(t.param + i, n);
    Vec theta0 = load<Vec>(t.anchor + i, n);
    Vec h = load<Vec>(t.importance + i, n);
    Vec alpha = kAlpha ? load<Vec>(t.alpha + i, n) : Vec(acc_t(0));
    step<kOp, kProx, kImp, kLr>(theta, load<Vec>(t.grad + i, n), theta0, h, alpha, hp);
    store(theta, t.param + i, n);
    if constexpr (has_meta(kOp)) {
      store(theta0, t.anchor + i, n);
      store(h, t.importance + i, n);
      if constexpr (kAlpha) store(alpha, t.alpha + i, n);
    }
  }
}

// The same for bf16/fp16 parameters: one Vectorized<scalar_t> of θ (and of g) holds two
// Vectorized<float> of state; θ and g are widened, the math runs in fp32, θ is rounded on store.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename scalar_t>
void update_reduced(const Pointers<scalar_t, float>& t, int64_t begin, int64_t end,
                    const Hyper<at::vec::Vectorized<float>>& hp) {
  using fVec = at::vec::Vectorized<float>;
  using bVec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t W = fVec::size();
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  static_assert(bVec::size() == 2 * W, "a reduced-precision vector holds two float vectors");
  for (int64_t i = begin; i < end; i += bVec::size()) {
    const int64_t n = std::min<int64_t>(bVec::size(), end - i);
    const int64_t n0 = std::min(n, W), n1 = n - n0;
    auto [theta_lo, theta_hi] = at::vec::convert_to_float<scalar_t>(load<bVec>(t.param + i, n));
    auto [g_lo, g_hi] = at::vec::convert_to_float<scalar_t>(load<bVec>(t.grad + i, n));
    fVec a_lo = load<fVec>(t.anchor + i, n0);
    fVec h_lo = load<fVec>(t.importance + i, n0);
    fVec al_lo = kAlpha ? load<fVec>(t.alpha + i, n0) : fVec(0.f);
    step<kOp, kProx, kImp, kLr>(theta_lo, g_lo, a_lo, h_lo, al_lo, hp);
    fVec a_hi(0.f), h_hi(0.f), al_hi(0.f);
    if (n1 > 0) {
      a_hi = load<fVec>(t.anchor + i + W, n1);
      h_hi = load<fVec>(t.importance + i + W, n1);
      if constexpr (kAlpha) al_hi = load<fVec>(t.alpha + i + W, n1);
      step<kOp, kProx, kImp, kLr>(theta_hi, g_hi, a_hi, h_hi, al_hi, hp);
    }
    store(at::vec::convert_from_float<scalar_t>(theta_lo, theta_hi), t.param + i, n);
    if constexpr (has_meta(kOp)) {
      store(a_lo, t.anchor + i, n0);
      store(h_lo, t.importance + i, n0);
      if constexpr (kAlpha) store(al_lo, t.alpha + i, n0);
      if (n1 > 0) {
        store(a_hi, t.anchor + i + W, n1);
        store(h_hi, t.importance + i + W, n1);
        if constexpr (kAlpha) store(al_hi, t.alpha + i + W, n1);
      }
    }
  }
}

template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename scalar_t>
void run_typed(const Lists& l, const StepArgs& args, double grad_scale, bool scaled) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const Hyper<Vec> hp = args.hyper<acc_t>(grad_scale, scaled).template as<Vec>();
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;

  std::vector<Pointers<scalar_t, acc_t>> ptrs;
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (size_t k = 0; k < l.params.size(); ++k) {
    const int64_t numel = l.params[k].numel();
    if (numel == 0) continue;
    ptrs.push_back({l.params[k].data_ptr<scalar_t>(), l.grads[k].data_ptr<scalar_t>(),
                    l.anchors[k].data_ptr<acc_t>(), l.importances[k].data_ptr<acc_t>(),
                    kAlpha ? l.meta_lrs[k].data_ptr<acc_t>() : nullptr});
    const int64_t idx = static_cast<int64_t>(ptrs.size()) - 1;
    for (int64_t b = 0; b < numel; b += kPieceSize) {
      pieces.push_back({idx, b, std::min(numel, b + kPieceSize)});
    }
    total += numel;
  }
  if (pieces.empty()) return;
  const int64_t npieces = static_cast<int64_t>(pieces.size());
  const int64_t grain = total < kSerialBelow ? npieces : 1;
  at::parallel_for(0, npieces, grain, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Piece& piece = pieces[k];
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        update_full<kOp, kProx, kImp, kLr>(ptrs[piece.tensor], piece.begin, piece.end, hp);
      } else {
        update_reduced<kOp, kProx, kImp, kLr>(ptrs[piece.tensor], piece.begin, piece.end, hp);
      }
    }
  });
}

void run_all(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
             const OptTensor& found_inf) {
  if (l.params.empty()) return;
  // On the CPU reading the flags is free (no device to synchronize with).
  if (found_inf.has_value() && found_inf->item<float>() != 0.f) return;
  const bool scaled = grad_scale.has_value();
  const double scale = scaled ? static_cast<double>(grad_scale->item<float>()) : 1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, l.params[0].scalar_type(), "emcl_cpu", [&] {
        dispatch_op(args.op, [&](auto op) {
          dispatch_modes<decltype(op)::value>(args, [&](auto prox, auto imp, auto lr) {
            run_typed<decltype(op)::value, decltype(prox)::value, decltype(imp)::value,
                      decltype(lr)::value, scalar_t>(l, args, scale, scaled);
          });
        });
      });
}

}  // namespace

// The CPU runner of this copy of the kernels (see emcl_ops.h, Runner).
void run_cpu(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
             const OptTensor& found_inf) {
  run_all(l, args, grad_scale, found_inf);
}

}  // namespace EMCL_CPU_NS
}  // namespace emcl
