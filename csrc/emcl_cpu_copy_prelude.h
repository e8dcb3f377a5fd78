// The part every vector copy of the CPU kernels (emcl_cpu_avx2.cpp, emcl_cpu_avx512.cpp)
// starts with, before its `#pragma GCC target`: contraction off for the whole translation unit
// ([note: no FMA contraction] in emcl_cpu_avx2.cpp), the general torch headers as baseline code
// ([note: AVX2 copy]), and the feature macros of AVX2 that every copy's target includes (the
// pragma does not define the macros that at::vec and sleef.h test; what follows the pragma is
// compiled for these features). Include it only from such a copy, inside its x86-64 GCC guard.
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <ATen/Dispatch.h>
#include <ATen/NumericUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>

#include "emcl_ops.h"

#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
