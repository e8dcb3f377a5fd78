// The CPU kernels of emcl_cpu_kernels.h compiled for AVX-512 (F, BW, VL, DQ) with FMA and F16C
// (at::vec's AVX512 Vectorized: 16 floats per vector). emcl_cpu.cpp calls them only on a CPU
// that has these features and where torch's own kernels run AVX-512 (torch's CPU capability is
// AVX512: torch.backends.cpu.get_cpu_capability()), so that the step and torch's fused Adam run
// vectors of the same width.
//
// Built like emcl_cpu_avx2.cpp ([note: AVX2 copy], [note: no FMA contraction]): the general torch
// headers first, as baseline code, then the target pragma, then at::vec and the kernels. Every
// element is computed with the same IEEE operations in the same order as in the other copies
// (no contraction), so the three copies give bitwise the same results.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include "emcl_cpu_copy_prelude.h"

#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq")
// the AVX-512 feature macros (the prelude defines AVX2's)
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define EMCL_CPU_NS avx512
#include "emcl_cpu_kernels.h"

#endif
