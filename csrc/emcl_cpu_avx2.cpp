// The CPU kernels of emcl_cpu_kernels.h compiled for AVX2+FMA+F16C (at::vec's AVX2 Vectorized).
// emcl_cpu.cpp calls them only on a CPU that has both.
//
// [note: AVX2 copy] The build gives one set of flags to every C++ file, so AVX2 is switched on
// here with `#pragma GCC target` after the general torch headers are included: those inline
// functions stay baseline code (the linker may pick this file's copy of any inline function
// for the whole library), and only what follows (at::vec in its own CPU_CAPABILITY namespace,
// and the kernels) is compiled for AVX2.
//
// [note: no FMA contraction] GCC contracts a*b + c into one fused multiply-add wherever the
// target has FMA (its C++ default is -ffp-contract=fast), which rounds once instead of twice:
// the AVX2 copy would then differ from the portable copy (no FMA on baseline x86-64) in the
// last bit of about one element in ten. Contraction is off for this whole file, so both copies
// compute every element with the same roundings, the ones of reference.py (bitwise the same
// results, tests/test_cpu_backend.py). The update is memory-bound; the separate multiply costs
// nothing measurable.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include "emcl_cpu_copy_prelude.h"

#pragma GCC target("avx,avx2,fma,f16c,prfchw")
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define EMCL_CPU_NS avx2
#include "emcl_cpu_kernels.h"

#endif
