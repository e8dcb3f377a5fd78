// The fused glance of an MLP on the CPU (emcl_kernels/glance.py): per run, n one-sample inner
// steps in order, each the forward pass, the cross-entropy backward and EMCL's inner update with
// the outer-product gradient formed element by element inside the update. One work item of
// at::parallel_for per run; a run's steps are sequential.
//
// The order of every sum and product is [note: glance order] in emcl_kernels/glance.py, which
// its reference (reference_glance_) repeats with torch ops, so that the two agree bit for bit:
// no fused multiply-add (the vector copy below is built for AVX2 without FMA; torch compiles
// with -std=c++NN, an ISO mode, in which GCC does not contract a*b + c, and clang is told so
// here), the forward dot products in 16 partial sums.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "emcl_glance.h"

namespace emcl {
namespace glance {
namespace {

#if defined(__GNUC__) || defined(__clang__)
#define EMCL_GLANCE_INLINE inline __attribute__((always_inline))
#else
#define EMCL_GLANCE_INLINE inline
#endif

// One run's tensors for one call: per layer its weight, bias and their state.
struct RunTensors {
  std::vector<float*> w, b;
  std::vector<const float*> w0, b0, hw, hb;
  std::vector<float*> kw, kb;  // the update's coefficients ([note: glance coefficient])
};

struct Hyper {
  float beta, reg, cs;  // β, λ and c_s = γ·λ, combined in fp64 and rounded once
};

// z = W a + b for one row: 16 lanes, input j to lane j % 16, the lanes summed as a tree.
EMCL_GLANCE_INLINE float dot_row(const float* w, const float* a, int64_t n) {
  float acc[kLanes];
  for (int k = 0; k < kLanes; ++k) acc[k] = 0.0f;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] = acc[k] + w[j + k] * a[j + k];
  }
  for (int k = 0; j + k < n; ++k) acc[k] = acc[k] + w[j + k] * a[j + k];
  for (int s = kLanes / 2; s > 0; s /= 2) {
    for (int k = 0; k < s; ++k) acc[k] = acc[k] + acc[k + s];
  }
  return acc[0];
}

// min(c, FLT_MAX) on the bits ([note: glance order]): as signed integers the floats from 0 up
// to +inf (and NaN) order as their values, and an integer min vectorizes where a float compare
// does not (GCC keeps a float select as control flow). +inf and NaN become FLT_MAX.
EMCL_GLANCE_INLINE float clamp_max(float c) {
  int32_t bits;
  std::memcpy(&bits, &c, sizeof bits);
  const int32_t top = 0x7f7fffff;  // FLT_MAX
  bits = bits < top ? bits : top;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// [note: glance coefficient] What the update needs of h is one coefficient per element,
// which h (changed by the meta step only) and the hyper-parameters fix for the whole glance:
// prox, w = c/(1 + c) with c = min(c_s·h, FLT_MAX); else λ·h. It is computed once per glance
// into a scratch buffer, so a step reads θ, θ₀ and the coefficient (the bytes of θ, θ₀, h) and
// divides nothing; the values are those of computing it at every step.
template <bool kProx>
EMCL_GLANCE_INLINE void coefficients(float* __restrict__ k, const float* __restrict__ h,
                                     int64_t n, const Hyper& hp) {
  const float reg = hp.reg, cs = hp.cs;
  for (int64_t j = 0; j < n; ++j) {
    if (kProx) {
      const float c = clamp_max(cs * h[j]);
      k[j] = c / (1.0f + c);
    } else {
      k[j] = reg * h[j];
    }
  }
}

// The inner update of one element with gradient g and coefficient k.
template <bool kProx>
EMCL_GLANCE_INLINE float updated(float t, float g, float t0, float k, float beta) {
  if (kProx) {
    const float that = t - beta * g;
    return that - k * (that - t0);
  }
  return t - beta * (g + k * (t - t0));
}

// θ ← the inner update of one weight row, whose gradient is d·a[j].
template <bool kProx>
EMCL_GLANCE_INLINE void update_row(float* __restrict__ th, const float* __restrict__ th0,
                                   const float* __restrict__ k, const float* __restrict__ a,
                                   float d, int64_t n, float beta) {
  for (int64_t j = 0; j < n; ++j) th[j] = updated<kProx>(th[j], d * a[j], th0[j], k[j], beta);
}

// θ ← the inner update of a bias, whose gradient is d.
template <bool kProx>
EMCL_GLANCE_INLINE void update_bias(float* __restrict__ th, const float* __restrict__ th0,
                                    const float* __restrict__ k, const float* __restrict__ d,
                                    int64_t n, float beta) {
  for (int64_t j = 0; j < n; ++j) th[j] = updated<kProx>(th[j], d[j], th0[j], k[j], beta);
}

EMCL_GLANCE_INLINE bool finite_max_abs(const float* v, int64_t n, float* out) {
  float m = 0.0f;
  bool ok = true;
  for (int64_t j = 0; j < n; ++j) {
    ok = ok && std::isfinite(v[j]);
    const float a = std::fabs(v[j]);
    m = a > m ? a : m;
  }
  *out = m;
  return ok;
}

// One step of one run. acts[0] is the sample; acts[l] (l >= 1) and deltas[l] are scratch.
// Returns whether the step was skipped for a non-finite gradient ([note: glance skips]).
//
// [note: next forward] The first layer holds most of the weights (78,400 of the paper MLP's
// 89,610), and the next step's forward pass reads each of its rows right after this step's
// update wrote it. So the update of row i also takes the row's dot product with the next
// sample (`next_x`) while the row is in L1, into `dots` (`*dots_ready` then says so), and the
// next step's forward pass adds the bias to it instead of reading the row again. The same
// products and sums in the same order: the values are those of the forward pass.
template <bool kProx>
EMCL_GLANCE_INLINE bool step(const RunTensors& rt, const Shape& s, std::vector<const float*>& acts,
                             std::vector<float*>& act_buf, std::vector<float*>& deltas,
                             float* logits, int64_t label, const bool* mask, const Hyper& hp,
                             bool check_finite, float* loss, const float* next_x, float* dots,
                             bool* dots_ready) {
  const int64_t L = s.layers;
  const bool have_dots = *dots_ready;
  *dots_ready = false;
  // forward
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in = s.widths[l], out = s.widths[l + 1];
    const float* a = acts[l];
    const float* w = rt.w[l];
    const float* b = rt.b[l];
    float* z = (l + 1 < L) ? act_buf[l + 1] : logits;
    if (l == 0 && have_dots) {
      for (int64_t i = 0; i < out; ++i) z[i] = dots[i] + b[i];
    } else {
      for (int64_t i = 0; i < out; ++i) z[i] = dot_row(w + i * in, a, in) + b[i];
    }
    if (l + 1 < L) {
      for (int64_t i = 0; i < out; ++i) z[i] = z[i] <= 0.0f ? 0.0f : z[i];  // ReLU, NaN kept
    }
  }
  // softmax cross-entropy in fp64
  const int64_t C = s.widths[L];
  double m = -INFINITY;
  bool any = false;
  for (int64_t k = 0; k < C; ++k) {
    if (mask && mask[k]) continue;
    const double z = logits[k];
    if (!any || z > m) m = z;
    any = true;
  }
  double sum = 0.0;
  for (int64_t k = 0; k < C; ++k) {
    if (mask && mask[k]) continue;
    sum += std::exp(static_cast<double>(logits[k]) - m);
  }
  const double lse = std::log(sum);
  float* dL = deltas[L - 1];
  for (int64_t k = 0; k < C; ++k) {
    if (mask && mask[k]) {
      dL[k] = 0.0f;
      continue;
    }
    const double p = std::exp((static_cast<double>(logits[k]) - m) - lse);
    dL[k] = static_cast<float>(p - (k == label ? 1.0 : 0.0));
  }
  *loss = static_cast<float>((lse + m) - static_cast<double>(logits[label]));
  // backward signals with the weights before the update
  for (int64_t l = L - 1; l >= 1; --l) {
    const int64_t in = s.widths[l], out = s.widths[l + 1];
    const float* w = rt.w[l];
    const float* d = deltas[l];
    float* back = deltas[l - 1];
    for (int64_t j = 0; j < in; ++j) back[j] = 0.0f;
    for (int64_t i = 0; i < out; ++i) {
      const float di = d[i];
      const float* wi = w + i * in;
      for (int64_t j = 0; j < in; ++j) back[j] = back[j] + wi[j] * di;
    }
    const float* a = acts[l];
    for (int64_t j = 0; j < in; ++j) back[j] = a[j] > 0.0f ? back[j] : 0.0f;
  }
  if (check_finite) {
    for (int64_t l = 0; l < L; ++l) {
      float md, ma;
      const bool ok_d = finite_max_abs(deltas[l], s.widths[l + 1], &md);
      const bool ok_a = finite_max_abs(acts[l], s.widths[l], &ma);
      if (!ok_d || !ok_a || !std::isfinite(md * ma)) return true;
    }
  }
  // the update, the gradient formed in place
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in = s.widths[l], out = s.widths[l + 1];
    const float* a = acts[l];
    const float* d = deltas[l];
    for (int64_t i = 0; i < out; ++i) {
      float* row = rt.w[l] + i * in;
      update_row<kProx>(row, rt.w0[l] + i * in, rt.kw[l] + i * in, a, d[i], in, hp.beta);
      if (l == 0 && next_x) dots[i] = dot_row(row, next_x, in);  // [note: next forward]
    }
    update_bias<kProx>(rt.b[l], rt.b0[l], rt.kb[l], d, out, hp.beta);
  }
  *dots_ready = next_x != nullptr;
  return false;
}

struct Call {
  const Shape* s;
  const std::vector<at::Tensor>* params;
  const std::vector<at::Tensor>* anchors;
  const std::vector<at::Tensor>* importances;
  const float* x;
  const int64_t* y;
  const bool* mask;
  const double* hyper;
  bool prox, check_finite;
  float* losses;
  int64_t* skipped;
};

// The glance of run r: every step in order.
EMCL_GLANCE_INLINE void run_glance(const Call& c, int64_t r) {
  const Shape& s = *c.s;
  const int64_t L = s.layers;
  RunTensors rt;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t wn = s.widths[l] * s.widths[l + 1], bn = s.widths[l + 1];
    rt.w.push_back((*c.params)[2 * l].data_ptr<float>() + r * wn);
    rt.b.push_back((*c.params)[2 * l + 1].data_ptr<float>() + r * bn);
    rt.w0.push_back((*c.anchors)[2 * l].data_ptr<float>() + r * wn);
    rt.b0.push_back((*c.anchors)[2 * l + 1].data_ptr<float>() + r * bn);
    rt.hw.push_back((*c.importances)[2 * l].data_ptr<float>() + r * wn);
    rt.hb.push_back((*c.importances)[2 * l + 1].data_ptr<float>() + r * bn);
  }
  int64_t scratch = s.widths[L] + s.widths[1];  // logits, the next forward's first dots
  for (int64_t l = 1; l <= L; ++l) scratch += 2 * s.widths[l];
  std::vector<float> buf(static_cast<size_t>(scratch));
  std::vector<float*> act_buf(L, nullptr), deltas(L, nullptr);
  float* p = buf.data();
  for (int64_t l = 1; l < L; ++l) {
    act_buf[l] = p;
    p += s.widths[l];
  }
  for (int64_t l = 0; l < L; ++l) {
    deltas[l] = p;
    p += s.widths[l + 1];
  }
  float* logits = p;
  float* dots = p + s.widths[L];
  bool dots_ready = false;
  std::vector<const float*> acts(L, nullptr);
  for (int64_t l = 1; l < L; ++l) acts[l] = act_buf[l];
  const double* hr = c.hyper + 3 * r;
  Hyper hp{static_cast<float>(hr[0]), static_cast<float>(hr[1]),
           static_cast<float>(hr[2] * hr[1])};
  const int64_t n = s.samples, C = s.widths[L], in0 = s.widths[0];
  int64_t skips = 0;
  if (n == 0) {
    c.skipped[r] = 0;
    return;
  }
  int64_t numel = 0;
  for (int64_t l = 0; l < L; ++l) numel += s.widths[l] * s.widths[l + 1] + s.widths[l + 1];
  thread_local std::vector<float> coef;
  if (static_cast<int64_t>(coef.size()) < numel) coef.resize(static_cast<size_t>(numel));
  float* q = coef.data();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t wn = s.widths[l] * s.widths[l + 1], bn = s.widths[l + 1];
    rt.kw.push_back(q);
    rt.kb.push_back(q + wn);
    if (c.prox) {
      coefficients<true>(q, rt.hw[l], wn, hp);
      coefficients<true>(q + wn, rt.hb[l], bn, hp);
    } else {
      coefficients<false>(q, rt.hw[l], wn, hp);
      coefficients<false>(q + wn, rt.hb[l], bn, hp);
    }
    q += wn + bn;
  }
  for (int64_t k = 0; k < n; ++k) {
    acts[0] = c.x + (r * n + k) * in0;
    const bool* mask = c.mask ? c.mask + (r * n + k) * C : nullptr;
    float* loss = c.losses + r * n + k;
    const float* next_x = k + 1 < n ? c.x + (r * n + k + 1) * in0 : nullptr;
    const bool skip =
        c.prox ? step<true>(rt, s, acts, act_buf, deltas, logits, c.y[r * n + k], mask, hp,
                            c.check_finite, loss, next_x, dots, &dots_ready)
               : step<false>(rt, s, acts, act_buf, deltas, logits, c.y[r * n + k], mask, hp,
                             c.check_finite, loss, next_x, dots, &dots_ready);
    skips += skip ? 1 : 0;
  }
  c.skipped[r] = skips;
}

void run_portable(const Call& c, int64_t r) { run_glance(c, r); }

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define EMCL_GLANCE_AVX2 1
// The same code for AVX2 registers (8 floats); no FMA, so the arithmetic is the portable one's.
__attribute__((target("avx2"))) void run_avx2(const Call& c, int64_t r) { run_glance(c, r); }
#endif

bool use_avx2() {
#ifdef EMCL_GLANCE_AVX2
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

void mlp_glance_cpu(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& anchors,
                    const std::vector<at::Tensor>& importances, const at::Tensor& x,
                    const at::Tensor& y, const c10::optional<at::Tensor>& mask,
                    const at::Tensor& hyper, bool prox, bool check_finite,
                    const at::Tensor& losses, const at::Tensor& skipped) {
  const Shape s = check_call(params, anchors, importances, x, y, mask, hyper, losses, skipped);
  TORCH_CHECK(params[0].device().is_cpu(), "mlp_glance_ (CPU): the tensors are on ",
              params[0].device());
  const bool has_mask = mask.has_value() && mask->defined();
  const int64_t C = s.widths.back();
  const int64_t* yp = y.data_ptr<int64_t>();
  const bool* mp = has_mask ? mask->data_ptr<bool>() : nullptr;
  for (int64_t i = 0; i < s.runs * s.samples; ++i) {  // every label, before anything is written
    TORCH_CHECK(yp[i] >= 0 && yp[i] < C, "mlp_glance_: label ", yp[i], " is outside [0, ", C,
                ")");
    if (mp) {
      TORCH_CHECK(!mp[i * C + yp[i]], "mlp_glance_: a sample's label ", yp[i],
                  " is a masked class");
      bool live = false;
      for (int64_t k = 0; k < C; ++k) live = live || !mp[i * C + k];
      TORCH_CHECK(live, "mlp_glance_: a sample's mask excludes every class");
    }
  }
  for (int64_t r = 0; r < s.runs; ++r) {
    const double* hr = hyper.data_ptr<double>() + 3 * r;
    for (int q = 0; q < 3; ++q) {
      TORCH_CHECK(std::isfinite(hr[q]) && hr[q] >= 0.0, "mlp_glance_: hyper[", r, ", ", q,
                  "] must be finite and >= 0, got ", hr[q]);
    }
  }
  Call c{&s, &params, &anchors, &importances, x.data_ptr<float>(), yp, mp,
         hyper.data_ptr<double>(), prox, check_finite, losses.data_ptr<float>(),
         skipped.data_ptr<int64_t>()};
  const bool avx2 = use_avx2();
  at::parallel_for(0, s.runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#ifdef EMCL_GLANCE_AVX2
      if (avx2) {
        run_avx2(c, r);
        continue;
      }
#endif
      run_portable(c, r);
    }
  });
  (void)avx2;
}

std::string glance_cpu_kernel() { return use_avx2() ? "avx2" : "portable"; }

}  // namespace
}  // namespace glance
}  // namespace emcl

TORCH_LIBRARY_FRAGMENT(emcl, m) {
  m.def(emcl::glance::kSchema);
  // Which copy of the glance's CPU kernel runs here: "avx2" or "portable".
  m.def("glance_cpu_kernel() -> str", &emcl::glance::glance_cpu_kernel);
}

TORCH_LIBRARY_IMPL(emcl, CPU, m) { m.impl("mlp_glance_", &emcl::glance::mlp_glance_cpu); }
