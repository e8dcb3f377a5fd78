// The "cuda" backend: EMCL's steps as small functors over emcl_math.h, run over a whole tensor
// list by the multi-tensor launcher (multi_tensor.cuh): one launch per call (per kMaxTensors
// tensors past the kernel-argument limit).
//
// Every mode is a template parameter, so each (dtype, op, mode) is its own kernel with no
// runtime branches on the mode. Parameters in bf16/fp16 are widened to fp32 in registers and
// rounded once on store; the state (θ₀, h, α) is fp32 (fp64 for fp64 parameters).
// grad_scale and found_inf are read on the device, inside the kernel.
#include "emcl_math.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "emcl_ops.h"
#include "multi_tensor.cuh"

namespace emcl {
namespace cuda {
namespace {

// N elements of T, loaded and stored with 16-byte vector instructions (one or two per pack).
template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* ptr) {
  return *reinterpret_cast<const Pack<T, N>*>(ptr);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* ptr, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(ptr) = pack;
}

// The per-element work of one step over lists (θ, g, θ₀, h[, α]).
template <typename scalar_t, Op kOp, bool kProx, Importance kImp, LrMode kLr>
struct StepFunctor {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  static constexpr int kDepth = kAlpha ? 5 : 4;
  // Elements per vector: one 16-byte load of θ (and of g); the state takes one or two.
  static constexpr int kVec = static_cast<int>(kVectorBytes / sizeof(scalar_t));
  static_assert(kVec * sizeof(acc_t) % kVectorBytes == 0, "state packs must be whole vectors");

  Hyper<acc_t> hp;
  const float* grad_scale;  // null unless the gradients are scaled

  __device__ __forceinline__ void operator()(const TensorListMeta<kDepth>& meta, int t,
                                             int64_t begin, int64_t end) const {
    auto* __restrict__ param = static_cast<scalar_t*>(meta.addresses[0][t]);
    const auto* __restrict__ grad = static_cast<const scalar_t*>(meta.addresses[1][t]);
    auto* __restrict__ anchor = static_cast<acc_t*>(meta.addresses[2][t]);
    auto* __restrict__ importance = static_cast<acc_t*>(meta.addresses[3][t]);
    acc_t* __restrict__ alpha = nullptr;
    if constexpr (kAlpha) alpha = static_cast<acc_t*>(meta.addresses[kDepth - 1][t]);

    Hyper<acc_t> h = hp;
    if (grad_scale != nullptr) h.grad_scale = static_cast<acc_t>(*grad_scale);

    if (meta.aligned) {
      const int64_t nvec = (end - begin) / kVec;
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        const int64_t i = begin + v * kVec;
        Pack<scalar_t, kVec> p = load_pack<scalar_t, kVec>(param + i);
        const Pack<scalar_t, kVec> g = load_pack<scalar_t, kVec>(grad + i);
        Pack<acc_t, kVec> a = load_pack<acc_t, kVec>(anchor + i);
        Pack<acc_t, kVec> s = load_pack<acc_t, kVec>(importance + i);
        Pack<acc_t, kVec> r;
        if constexpr (kAlpha) r = load_pack<acc_t, kVec>(alpha + i);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          acc_t theta = static_cast<acc_t>(p.v[j]);
          acc_t rate = kAlpha ? r.v[j] : acc_t(0);
          step<kOp, kProx, kImp, kLr>(theta, static_cast<acc_t>(g.v[j]), a.v[j], s.v[j], rate,
                                      h);
          p.v[j] = static_cast<scalar_t>(theta);
          if constexpr (kAlpha) r.v[j] = rate;
        }
        store_pack(param + i, p);
        if constexpr (has_meta(kOp)) {
          store_pack(anchor + i, a);
          store_pack(importance + i, s);
          if constexpr (kAlpha) store_pack(alpha + i, r);
        }
      }
      begin += nvec * kVec;  // the tail (fewer than kVec elements) goes the scalar way
    }
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      acc_t theta = static_cast<acc_t>(param[i]);
      acc_t theta0 = anchor[i];
      acc_t imp = importance[i];
      acc_t rate = kAlpha ? alpha[i] : acc_t(0);
      step<kOp, kProx, kImp, kLr>(theta, static_cast<acc_t>(grad[i]), theta0, imp, rate, h);
      param[i] = static_cast<scalar_t>(theta);
      if constexpr (has_meta(kOp)) {
        anchor[i] = theta0;
        importance[i] = imp;
        if constexpr (kAlpha) alpha[i] = rate;
      }
    }
  }
};

template <typename scalar_t, Op kOp, bool kProx, Importance kImp, LrMode kLr>
void launch_step(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
                 const float* noop) {
  using Functor = StepFunctor<scalar_t, kOp, kProx, kImp, kLr>;
  using acc_t = typename Functor::acc_t;
  const bool scaled = grad_scale.has_value();
  const Functor functor{args.hyper<acc_t>(1.0, scaled),
                        scaled ? grad_scale->data_ptr<float>() : nullptr};
  auto count = [] { g_launch_count.fetch_add(1, std::memory_order_relaxed); };
  if constexpr (Functor::kDepth == 5) {
    multi_tensor_apply<5>({l.params, l.grads, l.anchors, l.importances, l.meta_lrs}, functor,
                          noop, count);
  } else {
    multi_tensor_apply<4>({l.params, l.grads, l.anchors, l.importances}, functor, noop, count);
  }
}

void run_cuda(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
              const OptTensor& found_inf) {
  if (l.params.empty()) return;
  const float* noop = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, l.params[0].scalar_type(), "emcl_cuda", [&] {
        dispatch_op(args.op, [&](auto op) {
          dispatch_modes<decltype(op)::value>(args, [&](auto prox, auto imp, auto lr) {
            launch_step<scalar_t, decltype(op)::value, decltype(prox)::value,
                        decltype(imp)::value, decltype(lr)::value>(l, args, grad_scale, noop);
          });
        });
      });
}

}  // namespace
}  // namespace cuda
}  // namespace emcl

TORCH_LIBRARY_IMPL(emcl, CUDA, m) {
  m.impl("inner_step_", &emcl::inner_step_op<emcl::cuda::run_cuda>);
  m.impl("meta_step_", &emcl::meta_step_op<emcl::cuda::run_cuda>);
  m.impl("inner_meta_step_", &emcl::inner_meta_step_op<emcl::cuda::run_cuda>);
}
