// EMCL's per-element math (SPEC section 2), once, for the CPU and the CUDA kernels.
//
// Every function is a template over the value type V: float or double on the GPU and in scalar
// CPU code, at::vec::Vectorized<float|double> in the vectorized CPU kernel (define
// EMCL_MATH_AT_VEC before including this header, after at::vec's CPU_CAPABILITY, to get the
// Vectorized overloads of emcl_abs/emcl_clamp).
// The arithmetic follows emcl_kernels/reference.py term by term, in the same order, so the
// backends agree with the oracle to rounding.
//
// Symbols (SPEC section 1):
//   θ theta (param)   g grad   θ₀ theta0 (anchor)   h importance   α alpha (meta_lrs state)
//   β inner_lr   λ reg   γ gamma   η decay   α₀ meta_lr   r lr_scale
#ifndef EMCL_MATH_H_
#define EMCL_MATH_H_

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define EMCL_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Inlined into the kernel loop whatever the size of the caller: on the CPU the Vectorized
// values then stay in registers instead of going through the stack at every call.
#define EMCL_HD inline __attribute__((always_inline))
#else
#define EMCL_HD inline
#endif

namespace emcl {

// Which update a kernel does: the inner step, the meta step, or both in one pass.
enum class Op : int { kInner = 0, kMeta = 1, kInnerMeta = 2 };
// How the importance sample Ω is taken (eq. 13, or the EMCL-SI ablation).
enum class Importance : int { kTaylor = 0, kSI = 1 };
// How the meta learning rate α is formed (eq. 8 recurrent, inverse in h, or constant α₀).
enum class LrMode : int { kRecurrent = 0, kInverse = 1, kConstant = 2 };

constexpr bool has_inner(Op op) { return op != Op::kMeta; }
constexpr bool has_meta(Op op) { return op != Op::kInner; }

// ---------------------------------------------------------------------------------------------
// The few non-arithmetic functions the math needs, for every value type.
// ---------------------------------------------------------------------------------------------
// (The Vectorized overloads are at the end of this file, found by argument-dependent lookup.)
EMCL_HD float emcl_abs(float x) { return fabsf(x); }
EMCL_HD double emcl_abs(double x) { return fabs(x); }
// min that lets NaN through (x NaN -> NaN), like torch.clamp(max=).
EMCL_HD float emcl_min(float x, float hi) { return x > hi ? hi : x; }
EMCL_HD double emcl_min(double x, double hi) { return x > hi ? hi : x; }
// clamp that lets NaN through, like torch.clamp.
EMCL_HD float emcl_clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
EMCL_HD double emcl_clamp(double x, double lo, double hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// ---------------------------------------------------------------------------------------------
// The hyper-parameters, pre-combined on the host exactly as reference.py combines its Python
// floats (e.g. γ·λ is one scalar there too), then held in the compute type V.
// ---------------------------------------------------------------------------------------------
template <typename V>
struct Hyper {
  V one;             // 1
  V inner_lr;        // β
  V gamma_reg;       // γ·λ
  V reg;             // λ
  V decay;           // η
  V one_minus_decay; // 1 − η
  V lr_scale;        // r                  (recurrent)
  V base_rate;       // α₀·r               (inverse)
  V meta_lr;         // α₀                 (constant)
  V lr_min, lr_max;  // clip bounds of α
  V eps;             // ε
  V max_finite;      // the largest finite value of the compute type
  V grad_scale;      // gradients are divided by it when `scaled`
  bool scaled;

  // The same hyper-parameters in another value type (e.g. broadcast into a Vectorized).
  template <typename W>
  Hyper<W> as() const {
    return Hyper<W>{W(one),   W(inner_lr),     W(gamma_reg), W(reg),    W(decay),
                    W(one_minus_decay), W(lr_scale), W(base_rate), W(meta_lr),
                    W(lr_min), W(lr_max), W(eps),    W(max_finite), W(grad_scale), scaled};
  }
};

// The hyper-parameters as the host receives them (Python floats are doubles).
struct StepArgs {
  Op op;
  bool prox;
  Importance importance;
  LrMode lr_mode;
  double inner_lr, meta_lr, reg, gamma, decay, lr_scale, lr_min, lr_max, eps;

  // Combined in double like the Python reference, then rounded once to the compute type T.
  // The upper clip of α is at most T's largest finite value (see meta_update).
  template <typename T>
  Hyper<T> hyper(double grad_scale, bool scaled) const {
    const double max_finite = static_cast<double>(std::numeric_limits<T>::max());
    return Hyper<T>{T(1),
                    T(inner_lr),
                    T(gamma * reg),
                    T(reg),
                    T(decay),
                    T(1.0 - decay),
                    T(lr_scale),
                    T(meta_lr * lr_scale),
                    T(meta_lr),
                    T(lr_min),
                    T(lr_max < max_finite ? lr_max : max_finite),
                    T(eps),
                    T(max_finite),
                    T(grad_scale),
                    scaled};
  }
};

// ---------------------------------------------------------------------------------------------
// The updates.
// ---------------------------------------------------------------------------------------------

// Inner step on the regularized inner loss (eq. 6): returns the new fast weight θ.
template <bool kProx, typename V>
EMCL_HD V inner_update(const V& theta, const V& g, const V& theta0, const V& h,
                       const Hyper<V>& hp) {
  if constexpr (kProx) {
    const V theta_hat = theta - hp.inner_lr * g;    // eq. 14: gradient step on the risk
    const V c = emcl_min(hp.gamma_reg * h, hp.max_finite);  // γ·λ·h (an overflow: the max)
    // eq. 19, prox of (λ/2)·h·(θ − θ₀)²: (θ̂ + c·θ₀)/(1 + c) as θ̂ − w·(θ̂ − θ₀), w = c/(1 + c)
    // in [0, 1]: no intermediate grows past |θ̂| and |θ₀|, and c = 0 leaves θ̂ as it is
    const V w = c / (hp.one + c);
    return theta_hat - w * (theta_hat - theta0);
  } else {
    // ablation: plain gradient step on eq. 6
    return theta - hp.inner_lr * (g + hp.reg * h * (theta - theta0));
  }
}

// Meta step: updates h (eq. 7), α (eq. 8, recurrent mode only) and θ₀ (eq. 10) in place.
template <Importance kImp, LrMode kLr, typename V>
EMCL_HD void meta_update(const V& theta, const V& g, V& theta0, V& h, V& alpha,
                         const Hyper<V>& hp) {
  V omega;
  if constexpr (kImp == Importance::kTaylor) {
    omega = emcl_abs(g * theta0);                       // eq. 13: |∂L/∂θ₀ · θ₀|
  } else {
    omega = emcl_abs(g * (theta - theta0));             // EMCL-SI: gradient times the update
  }
  h = hp.decay * h + hp.one_minus_decay * omega;    // eq. 7: moving average of Ω

  V rate;                                           // α
  if constexpr (kLr == LrMode::kRecurrent) {
    alpha = emcl_clamp(alpha * hp.lr_scale / (h + hp.eps), hp.lr_min, hp.lr_max);  // eq. 8
    rate = alpha;
  } else if constexpr (kLr == LrMode::kInverse) {
    rate = emcl_clamp(hp.base_rate / (h + hp.eps), hp.lr_min, hp.lr_max);  // α ∝ 1 / h
  } else {
    rate = hp.meta_lr;                              // no modulation
  }
  // eq. 10, ∇θ₀ = λ·H²·(θ₀ − θ_k), with α·h formed first (at most α₀·r in inverse mode)
  theta0 = theta0 - (rate * h) * hp.reg * (theta0 - theta);
}

// One element of one step, in the compute type: reads θ, g, θ₀, h (and α); leaves in the
// references what the step writes (θ for the inner step; θ, θ₀, h, α for the meta steps, with
// θ ← θ₀). The fast weight between the inner and the meta update of kInnerMeta stays in V.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename V>
EMCL_HD void step(V& theta, const V& grad, V& theta0, V& h, V& alpha, const Hyper<V>& hp) {
  V g = grad;
  if (hp.scaled) g = g / hp.grad_scale;
  if constexpr (has_inner(kOp)) {
    theta = inner_update<kProx>(theta, g, theta0, h, hp);
  }
  if constexpr (has_meta(kOp)) {
    meta_update<kImp, kLr>(theta, g, theta0, h, alpha, hp);
    theta = theta0;                                 // the next batch starts from θ₀
  }
}

}  // namespace emcl
#endif  // EMCL_MATH_H_

// at::vec overloads, in at::vec's own (CPU_CAPABILITY) namespace so that the templates above
// find them by argument-dependent lookup. Included once per capability-specific file.
#if defined(EMCL_MATH_AT_VEC) && !defined(EMCL_MATH_AT_VEC_H_)
#define EMCL_MATH_AT_VEC_H_
#include <ATen/cpu/vec/vec.h>
namespace at::vec {
inline namespace CPU_CAPABILITY {
template <typename T>
inline Vectorized<T> emcl_abs(const Vectorized<T>& x) {
  return x.abs();
}
template <typename T>
inline Vectorized<T> emcl_min(const Vectorized<T>& x, const Vectorized<T>& hi) {
  return clamp_max(x, hi);
}
template <typename T>
inline Vectorized<T> emcl_clamp(const Vectorized<T>& x, const Vectorized<T>& lo,
                                const Vectorized<T>& hi) {
  return clamp(x, lo, hi);
}
}  // namespace CPU_CAPABILITY
}  // namespace at::vec
#endif
