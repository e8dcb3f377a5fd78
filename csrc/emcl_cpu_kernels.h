// The CPU kernels, included twice: by emcl_cpu.cpp with torch's portable at::vec (any CPU) and
// by emcl_cpu_avx2.cpp compiled for AVX2+FMA, where at::vec uses AVX2 intrinsics.
// EMCL_CPU_NS names the namespace of each copy; emcl_cpu.cpp picks one at run time and does the
// host-side part of a call (checks, counters, steps) itself.
//
// Each copy has two passes over tensor lists:
// - any_nonfinite(grads): the read-only finite check (any parameter dtype per tensor);
// - update(...): the step of SPEC section 2 for a resolved op (kInner, kMeta, kInnerMeta).
// A pass sees the call's tensors as one flat index space (tensor k holds elements
// [offsets[k], offsets[k + 1])) and gives each of torch's intra-op threads one contiguous,
// equal share of it in one at::parallel_for (many small tensors parallelize as well as one big
// one, and one big tensor among small ones does not unbalance the threads); a call with fewer
// than kGrain elements runs on the calling thread, and every thread gets at least about
// kGrain / 2. Shares start at multiples of kAlign elements. Every element's result depends only
// on its own inputs, computed by the same vector instructions whichever thread and lane does
// it: the results are bitwise the same at any thread count. Parameters in bf16/fp16 are widened
// to fp32 vectors, updated in fp32 and rounded once on store; fp32 and fp64 parameters are
// updated in their own precision.
#pragma once
#ifndef EMCL_CPU_NS
#error "define EMCL_CPU_NS before including emcl_cpu_kernels.h"
#endif

#define EMCL_MATH_AT_VEC
#include "emcl_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
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

// The entry points of this copy (see the top of this file).
bool any_nonfinite(at::TensorList grads);
void update(const Lists& lists, Op which, bool prox, Importance importance, LrMode lr_mode,
            const double* hyper, const float* grad_scale);

namespace {

// A call with fewer elements runs on one thread; a thread gets at least about half of it.
// Not tuned on a quiet machine: on the loaded 2-core test machine an MLP 784-100-100-10 step
// (89,610 elements, 30-70 us of one core's work) took as long split in two as on one thread.
constexpr int64_t kGrain = 65536;
constexpr int64_t kAlign = 64;           // thread shares start at multiples of this
constexpr int64_t kCheckBlock = 65536;   // the finite check looks for an early exit this often

// The call's tensors as one index space: offsets[k] is the first flat index of tensor k and
// offsets[count] the total. Kept in a buffer reused by every call of this thread (no allocation
// once it has grown).
template <typename NumelOf>
const std::vector<int64_t>& flat_offsets(size_t count, NumelOf numel_of) {
  thread_local std::vector<int64_t> offsets;
  offsets.resize(count + 1);
  int64_t total = 0;
  for (size_t k = 0; k < count; ++k) {
    offsets[k] = total;
    total += numel_of(k);
  }
  offsets[count] = total;
  return offsets;
}

// Calls body(k, begin, end) for elements [begin, end) of tensor k, over every element of the
// index space, in parallel for big calls (see the top of this file).
template <typename Body>
void for_each_range(const std::vector<int64_t>& offsets, const Body& body) {
  const int64_t total = offsets.back();
  if (total == 0) return;
  auto run = [&](int64_t begin, int64_t end) {
    // The same rounding of every split point: the shares still cover [0, total) exactly once.
    begin = begin == 0 ? 0 : std::min(total, (begin + kAlign - 1) / kAlign * kAlign);
    end = end == total ? total : std::min(total, (end + kAlign - 1) / kAlign * kAlign);
    if (begin >= end) return;
    // the tensor holding `begin` (the last k with offsets[k] <= begin; empty tensors skipped)
    size_t k = static_cast<size_t>(
        std::upper_bound(offsets.begin(), offsets.end() - 1, begin) - offsets.begin() - 1);
    while (begin < end) {
      const int64_t stop = std::min(end, offsets[k + 1]);
      if (stop > begin) body(k, begin - offsets[k], stop - offsets[k]);
      begin = std::max(begin, stop);
      ++k;
    }
  };
  if (total < kGrain) {
    run(0, total);
  } else {
    at::parallel_for(0, total, kGrain, run);
  }
}

// ---------------------------------------------------------------------------------------------
// The finite check: x − x is 0 for a finite x and NaN for ±inf and NaN, and a sum of zeros
// stays 0 until it meets a NaN, so two vector ops per vector decide a range. A range is read as
// four interleaved streams (its four quarters): one core then keeps more cache-line fetches in
// flight than on one stream (a tuning measurement on the 2-core AMD EPYC test machine, 47 MB of
// fp32 from DRAM: 10 GB/s on one stream, 14 GB/s on four).
// ---------------------------------------------------------------------------------------------
template <typename T>
bool lanes_nonzero(const at::vec::Vectorized<T>& acc) {
  alignas(64) T lanes[at::vec::Vectorized<T>::size()];
  acc.store(lanes);
  for (int64_t j = 0; j < at::vec::Vectorized<T>::size(); ++j) {
    if (lanes[j] != T(0)) return true;  // NaN != 0 too
  }
  return false;
}

// x − x added into acc, for one load of scalar_t (one or two Vectorized<acc_t>).
template <typename scalar_t, typename Vec>
void accumulate(const scalar_t* x, Vec& acc) {
  if constexpr (std::is_same_v<scalar_t, typename Vec::value_type>) {
    const Vec v = Vec::loadu(x);
    acc = acc + (v - v);
  } else {
    auto [a, b] = at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(x));
    acc = acc + (a - a);
    acc = acc + (b - b);
  }
}

template <typename scalar_t>
bool range_nonfinite(const scalar_t* x, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = at::vec::Vectorized<scalar_t>::size();  // elements per load
  const int64_t q = n / (4 * W) * W;                             // elements per stream
  const scalar_t* s1 = x + q;
  const scalar_t* s2 = x + 2 * q;
  const scalar_t* s3 = x + 3 * q;
  Vec acc0(acc_t(0)), acc1(acc_t(0)), acc2(acc_t(0)), acc3(acc_t(0));
  for (int64_t i = 0; i < q; i += W) {
    accumulate(x + i, acc0);
    accumulate(s1 + i, acc1);
    accumulate(s2 + i, acc2);
    accumulate(s3 + i, acc3);
  }
  for (int64_t i = 4 * q; i < n; ++i) {
    if (!std::isfinite(static_cast<acc_t>(x[i]))) return true;
  }
  return lanes_nonzero((acc0 + acc1) + (acc2 + acc3));
}

// ---------------------------------------------------------------------------------------------
// The update.
// ---------------------------------------------------------------------------------------------

// The data pointers of one tensor's lists; `alpha` is null unless lr_mode is recurrent.
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
                 const Hyper<at::vec::Vectorized<acc_t>>& hyper) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  // A local copy: the stores below go through acc_t pointers, which may alias the Vectorized
  // fields of a struct the compiler cannot see the origin of, forcing a reload per vector.
  const Hyper<Vec> hp = hyper;
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
                    const Hyper<at::vec::Vectorized<float>>& hyper) {
  using fVec = at::vec::Vectorized<float>;
  using bVec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t W = fVec::size();
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  static_assert(bVec::size() == 2 * W, "a reduced-precision vector holds two float vectors");
  const Hyper<fVec> hp = hyper;  // see update_full
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
void update_typed(const Lists& l, const double* raw, const float* grad_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool kReadsAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  const bool scaled = grad_scale != nullptr;
  const Hyper<Vec> hp =
      make_hyper<acc_t>(raw, scaled ? static_cast<acc_t>(*grad_scale) : acc_t(1), scaled)
          .template as<Vec>();

  const auto& offsets =
      flat_offsets(l.params.size(), [&](size_t k) { return l.params[k].numel(); });
  for_each_range(offsets, [&](size_t k, int64_t begin, int64_t end) {
    // data_ptr() once per range: a few loads from the TensorImpl.
    const Pointers<scalar_t, acc_t> ptrs{
        static_cast<scalar_t*>(l.params[k].data_ptr()),
        static_cast<const scalar_t*>(l.grads[k].data_ptr()),
        static_cast<acc_t*>(l.anchors[k].data_ptr()),
        static_cast<acc_t*>(l.importances[k].data_ptr()),
        kReadsAlpha ? static_cast<acc_t*>(l.meta_lrs[k].data_ptr()) : nullptr};
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      update_full<kOp, kProx, kImp, kLr>(ptrs, begin, end, hp);
    } else {
      update_reduced<kOp, kProx, kImp, kLr>(ptrs, begin, end, hp);
    }
  });
}

}  // namespace

bool any_nonfinite(at::TensorList grads) {
  const auto& offsets = flat_offsets(grads.size(), [&](size_t k) { return grads[k].numel(); });
  std::atomic<bool> found{false};
  for_each_range(offsets, [&](size_t k, int64_t begin, int64_t end) {
    const at::Tensor& g = grads[k];
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "emcl_check",
                                    [&] {
      const auto* x = static_cast<const scalar_t*>(g.data_ptr());
      for (int64_t b = begin; b < end; b += kCheckBlock) {
        if (found.load(std::memory_order_relaxed)) return;  // the answer is known
        if (range_nonfinite(x + b, std::min(kCheckBlock, end - b))) {
          found.store(true, std::memory_order_relaxed);
          return;
        }
      }
    });
  });
  return found.load();
}

void update(const Lists& l, Op which, bool prox, Importance importance, LrMode lr_mode,
            const double* hyper, const float* grad_scale) {
  if (l.params.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, l.params[0].scalar_type(), "emcl_cpu", [&] {
        dispatch_op(which, [&](auto op) {
          constexpr Op kOp = decltype(op)::value;
          dispatch_modes_of<kOp>(prox, importance, lr_mode, [&](auto p, auto imp, auto lr) {
            update_typed<kOp, decltype(p)::value, decltype(imp)::value, decltype(lr)::value,
                         scalar_t>(l, hyper, grad_scale);
          });
        });
      });
}

}  // namespace EMCL_CPU_NS
}  // namespace emcl
