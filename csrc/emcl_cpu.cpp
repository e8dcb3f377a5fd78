// The "cpu" backend: [note: the step call] of emcl_kernels/interface.py for CPU tensors. The
// host part of a call (argument checks, the counters, the meta-step counts) is here; the passes
// over the elements (the finite check and the update, vectorized with at::vec over the math of
// emcl_math.h and spread over torch's intra-op threads) are in emcl_cpu_kernels.h.
//
// Three copies of the kernels are built: this file's, with the portable at::vec of the default
// compiler flags (runs on any CPU), emcl_cpu_avx2.cpp's, compiled for AVX2+FMA, and
// emcl_cpu_avx512.cpp's, compiled for AVX-512. The copy that runs is the widest one the CPU has
// and torch's own kernels use: AVX-512 where torch's CPU capability is AVX512 (so the step runs
// vectors as wide as torch's fused Adam), else AVX2 where the CPU has AVX2, FMA and F16C, else
// the portable one. ATEN_CPU_CAPABILITY (torch's own switch) lowers both: "avx2" gives at most
// the AVX2 copy, "default" the portable one.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/Version.h>
#include <torch/library.h>

#define EMCL_CPU_NS portable
#include "emcl_cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMCL_HAVE_AVX2 1
namespace emcl {
namespace avx2 {
bool any_nonfinite(at::TensorList grads);
void runs_nonfinite(at::TensorList grads, int64_t runs, uint8_t* found);
void update(const Lists& lists, Op which, bool prox, Importance importance, LrMode lr_mode,
            const double* hyper, const float* grad_scale, int64_t runs, const uint8_t* skip);
void stream_probe(float* a, const float* b, float* c, float* d, int64_t n, StreamProbe kind);
void stream_probe_bf16(at::BFloat16* a, const at::BFloat16* b, float* c, float* d, int64_t n,
                      bool step);
}  // namespace avx2
namespace avx512 {
bool any_nonfinite(at::TensorList grads);
void runs_nonfinite(at::TensorList grads, int64_t runs, uint8_t* found);
void update(const Lists& lists, Op which, bool prox, Importance importance, LrMode lr_mode,
            const double* hyper, const float* grad_scale, int64_t runs, const uint8_t* skip);
void stream_probe(float* a, const float* b, float* c, float* d, int64_t n, StreamProbe kind);
void stream_probe_bf16(at::BFloat16* a, const at::BFloat16* b, float* c, float* d, int64_t n,
                      bool step);
}  // namespace avx512
}  // namespace emcl
#endif

namespace emcl {
namespace {

// Which copy of the kernels runs (see the top of this file); decided once per process.
enum class Kernel { kPortable, kAvx2, kAvx512 };

Kernel kernel() {
#ifdef EMCL_HAVE_AVX2
  static const Kernel k = [] {
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    if (env != nullptr && (std::strcmp(env, "default") == 0 || std::strcmp(env, "DEFAULT") == 0))
      return Kernel::kPortable;
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c"))) {
      return Kernel::kPortable;
    }
    const bool avx512 = __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    // torch's capability already follows ATEN_CPU_CAPABILITY=avx2 and the CPU's features
    const bool torch_avx512 = at::get_cpu_capability() == "AVX512";
    return avx512 && torch_avx512 ? Kernel::kAvx512 : Kernel::kAvx2;
  }();
  return k;
#else
  return Kernel::kPortable;
#endif
}

bool any_nonfinite(at::TensorList grads) {
#ifdef EMCL_HAVE_AVX2
  if (kernel() == Kernel::kAvx512) return avx512::any_nonfinite(grads);
  if (kernel() == Kernel::kAvx2) return avx2::any_nonfinite(grads);
#endif
  return portable::any_nonfinite(grads);
}

void runs_nonfinite(at::TensorList grads, int64_t runs, uint8_t* found) {
#ifdef EMCL_HAVE_AVX2
  if (kernel() == Kernel::kAvx512) return avx512::runs_nonfinite(grads, runs, found);
  if (kernel() == Kernel::kAvx2) return avx2::runs_nonfinite(grads, runs, found);
#endif
  portable::runs_nonfinite(grads, runs, found);
}

void update(const Lists& l, Op which, const StepCall& call, const double* hyper,
            const float* grad_scale, const uint8_t* skip = nullptr) {
#ifdef EMCL_HAVE_AVX2
  if (kernel() == Kernel::kAvx512) {
    return avx512::update(l, which, call.prox, call.importance, call.lr_mode, hyper, grad_scale,
                          call.runs, skip);
  }
  if (kernel() == Kernel::kAvx2) {
    return avx2::update(l, which, call.prox, call.importance, call.lr_mode, hyper, grad_scale,
                        call.runs, skip);
  }
#endif
  portable::update(l, which, call.prox, call.importance, call.lr_mode, hyper, grad_scale,
                   call.runs, skip);
}

// The finite check of an array of runs: counters[kRunFound + r] = 1 for every run r whose
// gradients hold an inf or a NaN.
void check_runs(at::TensorList grads, int64_t* c, int64_t runs) {
  thread_local std::vector<uint8_t> found;
  found.assign(static_cast<size_t>(runs), 0);
  runs_nonfinite(grads, runs, found.data());
  for (int64_t r = 0; r < runs; ++r) {
    if (found[r] != 0) c[counter::kRunFound + r] = 1;
  }
}

// step_ of an array of runs ([note: runs] in emcl_kernels/interface.py): the five points of
// step_cpu with a found flag, a skip and a skip count per run, and one pass over the elements
// for every run ([note: runs on the CPU] in emcl_cpu_kernels.h).
void step_runs_cpu(const Lists& lists, const StepCall& call, const at::Tensor& steps,
                   const at::Tensor& hyper, int64_t* c, bool check, bool finalize,
                   const OptTensor& grad_scale, const OptTensor& found_inf) {
  const int64_t runs = call.runs;
  int64_t* run_found = c + counter::kRunFound;
  int64_t* run_skipped = c + counter::kRunFound + runs;
  // 1. the finite check, per run
  if (check) check_runs(lists.grads, c, runs);
  // 2. which runs skip
  const bool skip_all = c[counter::kFound] != 0 ||
                        (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f);
  thread_local std::vector<uint8_t> skip;
  skip.assign(static_cast<size_t>(runs), 0);
  bool any_update = false;
  for (int64_t r = 0; r < runs; ++r) {
    skip[r] = skip_all || run_found[r] != 0;
    any_update = any_update || skip[r] == 0;
  }
  // 3. which update
  const Op which = resolve_op(call.op, c[counter::kCalls], call.meta_every);
  // 4. the update of every run that does not skip, and its meta-step counts
  if (any_update) {
    update(lists, which, call, hyper.data_ptr<double>(),
           grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr, skip.data());
    if (has_meta(which) && steps.numel() > 0) {
      float* s = steps.data_ptr<float>();  // param-major: s[i * runs + r]
      for (int64_t i = 0; i < steps.numel(); ++i) {
        if (skip[i % runs] == 0) s[i] += 1.f;
      }
    }
  }
  // 5. the bookkeeping of the step's last call on this device
  if (finalize) {
    if (call.op == Op::kCadence) c[counter::kCalls] += 1;
    if (c[counter::kFound] != 0) c[counter::kSkipped] += 1;
    c[counter::kFound] = 0;
    for (int64_t r = 0; r < runs; ++r) {
      if (run_found[r] != 0) run_skipped[r] += 1;
      run_found[r] = 0;
    }
  }
}

// step_ on CPU tensors. On the CPU the counters, flags and hyper-parameters are host memory:
// reading them is free, so the call does the interface's five points in order, on the host.
void step_cpu(at::TensorList params, at::TensorList grads, at::TensorList anchors,
              at::TensorList importances, at::TensorList meta_lrs, const at::Tensor& steps,
              const at::Tensor& hyper, const at::Tensor& counters, int64_t op, bool prox,
              int64_t importance, int64_t lr_mode, int64_t meta_every, bool check,
              bool finalize, const OptTensor& grad_scale, const OptTensor& found_inf,
              int64_t runs) {
  const Lists lists{params, grads, anchors, importances, meta_lrs};
  const StepCall call = check_step_call(lists, steps, hyper, counters, op, prox, importance,
                                        lr_mode, meta_every, grad_scale, found_inf, runs);
  int64_t* c = counters.data_ptr<int64_t>();
  if (call.runs > 1) {
    return step_runs_cpu(lists, call, steps, hyper, c, check, finalize, grad_scale, found_inf);
  }
  // 1. the finite check over this call's gradients
  if (check && any_nonfinite(grads)) c[counter::kFound] = 1;
  // 2. skip?
  const bool skip = c[counter::kFound] != 0 ||
                    (found_inf.has_value() && *found_inf->data_ptr<float>() != 0.f);
  // 3. which update
  const Op which = resolve_op(call.op, c[counter::kCalls], call.meta_every);
  // 4. the update, and the meta-step counts
  if (!skip) {
    update(lists, which, call, hyper.data_ptr<double>(),
           grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr);
    if (has_meta(which) && steps.numel() > 0) {
      float* s = steps.data_ptr<float>();
      for (int64_t i = 0; i < steps.numel(); ++i) s[i] += 1.f;
    }
  }
  // 5. the bookkeeping of the step's last call on this device
  if (finalize) {
    if (call.op == Op::kCadence) c[counter::kCalls] += 1;
    if (c[counter::kFound] != 0) c[counter::kSkipped] += 1;
    c[counter::kFound] = 0;
  }
}

void check_finite_cpu(at::TensorList grads, const at::Tensor& counters, int64_t runs) {
  check_finite_call(grads, counters, runs);
  if (runs > 1) return check_runs(grads, counters.data_ptr<int64_t>(), runs);
  if (any_nonfinite(grads)) counters.data_ptr<int64_t>()[counter::kFound] = 1;
}

std::string cpu_kernel() {
  switch (kernel()) {
    case Kernel::kAvx512: return "avx512";
    case Kernel::kAvx2: return "avx2";
    default: return "portable";
  }
}

// torch.ops.emcl.stream_probe_: one memory probe of the benchmarks' roof ([note: stream probes]
// in emcl_cpu_kernels.h) over four distinct contiguous CPU tensors of one size: fp32, except a
// and b in bf16 for kinds 6 and 7 (the bf16 steps' streams).
void stream_probe_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                      const at::Tensor& d, int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= static_cast<int64_t>(StreamProbe::kInnerPatternBf16),
              "stream_probe_: kind must be 0 (scale in place), 1 (axpy in place), 2 (the "
              "update's pattern), 3 (the inner step's pattern), 4 (its reads alone), 5 (the "
              "update's pattern without a software prefetch), 6 or 7 (the step's and the inner "
              "step's pattern with bf16 a and b), got ", kind);
  const auto which = static_cast<StreamProbe>(kind);
  const bool bf16 =
      which == StreamProbe::kStepPatternBf16 || which == StreamProbe::kInnerPatternBf16;
  const at::Tensor* all[] = {&a, &b, &c, &d};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor* t = all[i];
    const auto want = bf16 && i < 2 ? at::kBFloat16 : at::kFloat;
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == want && t->is_contiguous(),
                "stream_probe_: a, b, c and d must be contiguous CPU tensors, fp32 (kinds 6 "
                "and 7: a and b bf16)");
    TORCH_CHECK(t->numel() == a.numel(), "stream_probe_: a, b, c and d must have as many "
                "elements");
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = i + 1; j < 4; ++j) {
      TORCH_CHECK(all[i]->data_ptr() != all[j]->data_ptr() || a.numel() == 0,
                  "stream_probe_: a, b, c and d must be different tensors");
    }
  }
  auto* pc = c.data_ptr<float>();
  auto* pd = d.data_ptr<float>();
  if (bf16) {
    auto* pa = a.data_ptr<at::BFloat16>();
    const auto* pb = b.data_ptr<at::BFloat16>();
    const bool step = which == StreamProbe::kStepPatternBf16;
    const int64_t n = a.numel();
#ifdef EMCL_HAVE_AVX2
    if (kernel() == Kernel::kAvx512) return avx512::stream_probe_bf16(pa, pb, pc, pd, n, step);
    if (kernel() == Kernel::kAvx2) return avx2::stream_probe_bf16(pa, pb, pc, pd, n, step);
#endif
    return portable::stream_probe_bf16(pa, pb, pc, pd, n, step);
  }
  auto* pa = a.data_ptr<float>();
  const auto* pb = b.data_ptr<float>();
#ifdef EMCL_HAVE_AVX2
  if (kernel() == Kernel::kAvx512) return avx512::stream_probe(pa, pb, pc, pd, a.numel(), which);
  if (kernel() == Kernel::kAvx2) return avx2::stream_probe(pa, pb, pc, pd, a.numel(), which);
#endif
  portable::stream_probe(pa, pb, pc, pd, a.numel(), which);
}

}  // namespace
}  // namespace emcl

TORCH_LIBRARY_FRAGMENT(emcl, m) {
  // Which copy of the CPU kernels runs here: "avx512", "avx2" or "portable".
  m.def("cpu_kernel() -> str", &emcl::cpu_kernel);
  // A memory probe of the benchmarks' roof: kind 0 a <- a·1, kind 1 a <- a + 1e-6·b, kind 2
  // the update's pattern (reads a, b, c, d; writes a, c, d); fp32 CPU tensors, read the way the
  // update kernels read.
  m.def("stream_probe_(Tensor(a!) a, Tensor b, Tensor(c!) c, Tensor(d!) d, int kind) -> ()");
}

TORCH_LIBRARY_IMPL(emcl, CPU, m) {
  m.impl("step_", &emcl::step_cpu);
  m.impl("check_finite_", &emcl::check_finite_cpu);
  m.impl("stream_probe_", &emcl::stream_probe_cpu);
}
