// The "cpu" backend: EMCL's steps over lists of CPU tensors in one pass per element,
// vectorized with at::vec over the math of emcl_math.h and spread over torch's intra-op threads
// with at::parallel_for (the kernels: emcl_cpu_kernels.h).
//
// Two copies of the kernels are built: this file's, with the portable at::vec of the default
// compiler flags (runs on any CPU), and emcl_cpu_avx2.cpp's, compiled for AVX2+FMA. The AVX2
// copy runs when the CPU has AVX2, FMA and F16C, unless ATEN_CPU_CAPABILITY=default (torch's own
// switch) asks for the portable one.
#include <cstdlib>
#include <cstring>

#include <torch/library.h>

#define EMCL_CPU_NS portable
#include "emcl_cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMCL_HAVE_AVX2 1
namespace emcl {
namespace avx2 {
void run_cpu(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
             const OptTensor& found_inf);
}  // namespace avx2
}  // namespace emcl
#endif

namespace emcl {
namespace {

bool use_avx2() {
#ifdef EMCL_HAVE_AVX2
  static const bool yes = [] {
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    if (env != nullptr && (std::strcmp(env, "default") == 0 || std::strcmp(env, "DEFAULT") == 0))
      return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
#else
  return false;
#endif
}

void run_cpu(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
             const OptTensor& found_inf) {
#ifdef EMCL_HAVE_AVX2
  if (use_avx2()) return avx2::run_cpu(l, args, grad_scale, found_inf);
#endif
  portable::run_cpu(l, args, grad_scale, found_inf);
}

c10::string_view cpu_kernel_name() { return use_avx2() ? "avx2" : "portable"; }
std::string cpu_kernel() { return std::string(cpu_kernel_name()); }

}  // namespace
}  // namespace emcl

TORCH_LIBRARY_FRAGMENT(emcl, m) {
  // Which copy of the CPU kernels runs here: "avx2" or "portable".
  m.def("cpu_kernel() -> str", &emcl::cpu_kernel);
}

TORCH_LIBRARY_IMPL(emcl, CPU, m) {
  m.impl("inner_step_", &emcl::inner_step_op<emcl::run_cpu>);
  m.impl("meta_step_", &emcl::meta_step_op<emcl::run_cpu>);
  m.impl("inner_meta_step_", &emcl::inner_meta_step_op<emcl::run_cpu>);
}
