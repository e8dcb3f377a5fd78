// The fused glance of an MLP on a GPU (emcl_kernels/glance.py): one thread block per run, the
// run's n one-sample inner steps in order inside that block, one launch per call. Per step:
// the forward pass (a warp per output row), the cross-entropy backward (softmax in fp64 by one
// thread: the classes are few), the backward signals (a thread per input column, the rows
// summed in order), the finite check of the gradient's factors ([note: glance skips]) and the
// update of every weight and bias with its gradient δ_l[i]·a_{l-1}[j] formed in registers.
// The activations and backward signals live in shared memory; the parameters and their state
// are read from global memory (358 KB for the paper's MLP: L2-resident across the steps).
//
// The sums run in another order than the CPU kernel's (warp shuffles in the forward pass), so
// this kernel is compared with the reference within fp32 tolerance, not bit for bit. A label
// outside [0, classes) (which the Python entry refuses before the launch) skips its step here.
#include <cfloat>
#include <cstdint>

#include <string>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "emcl_glance.h"

namespace emcl {
namespace glance {
namespace {

constexpr int kMaxLayers = 8;
constexpr int kThreads = 256;

struct Layers {
  float* w[kMaxLayers];
  float* b[kMaxLayers];
  const float* w0[kMaxLayers];
  const float* b0[kMaxLayers];
  const float* hw[kMaxLayers];
  const float* hb[kMaxLayers];
  int64_t widths[kMaxLayers + 1];
  int layers;
};

// Non-negative floats order as their bit patterns do: atomicMax on the bits is a float max.
__device__ __forceinline__ void atomic_max_abs(unsigned int* slot, float v) {
  atomicMax(slot, __float_as_uint(fabsf(v)));
}

template <bool kProx>
__device__ __forceinline__ float updated(float t, float g, float t0, float h, float beta,
                                         float reg, float cs) {
  if (kProx) {
    const float that = __fsub_rn(t, __fmul_rn(beta, g));
    const float c = fminf(__fmul_rn(cs, h), FLT_MAX);  // +inf and NaN: FLT_MAX, as on the CPU
    const float w = __fdiv_rn(c, __fadd_rn(1.0f, c));
    return __fsub_rn(that, __fmul_rn(w, __fsub_rn(that, t0)));
  }
  return __fsub_rn(t, __fmul_rn(beta, __fadd_rn(g, __fmul_rn(__fmul_rn(reg, h),
                                                            __fsub_rn(t, t0)))));
}

template <bool kProx>
__global__ void __launch_bounds__(kThreads)
    glance_kernel(Layers t, const float* __restrict__ x, const int64_t* __restrict__ y,
                  const bool* __restrict__ mask, const double* __restrict__ hyper, int64_t n,
                  bool check_finite, float* __restrict__ losses, int64_t* __restrict__ skipped) {
  extern __shared__ float smem[];
  const int64_t r = blockIdx.x;
  const int L = t.layers;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  // shared layout: hidden activations, backward signals, logits, then the maxima and flags
  float* act[kMaxLayers];
  float* delta[kMaxLayers];
  float* p = smem;
  for (int l = 1; l < L; ++l) {
    act[l] = p;
    p += t.widths[l];
  }
  for (int l = 0; l < L; ++l) {
    delta[l] = p;
    p += t.widths[l + 1];
  }
  float* logits = p;
  p += t.widths[L];
  unsigned int* max_d = reinterpret_cast<unsigned int*>(p);
  unsigned int* max_a = max_d + kMaxLayers;
  int* skip_flag = reinterpret_cast<int*>(max_a + kMaxLayers);

  const double* hr = hyper + 3 * r;
  const float beta = static_cast<float>(hr[0]);
  const float reg = static_cast<float>(hr[1]);
  const float cs = static_cast<float>(hr[2] * hr[1]);
  const int64_t C = t.widths[L], in0 = t.widths[0];
  int64_t skips = 0;

  for (int64_t k = 0; k < n; ++k) {
    const float* a0 = x + (r * n + k) * in0;
    const bool* mk = mask ? mask + (r * n + k) * C : nullptr;
    const int64_t label = y[r * n + k];
    // forward: a warp per output row
    for (int l = 0; l < L; ++l) {
      const int64_t in = t.widths[l], out = t.widths[l + 1];
      const float* a = l == 0 ? a0 : act[l];
      const float* w = t.w[l] + r * in * out;
      const float* b = t.b[l] + r * out;
      float* z = (l + 1 < L) ? act[l + 1] : logits;
      for (int64_t i = warp; i < out; i += warps) {
        float acc = 0.0f;
        for (int64_t j = lane; j < in; j += 32) acc = __fadd_rn(acc, __fmul_rn(w[i * in + j], a[j]));
        for (int s = 16; s > 0; s >>= 1) acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, s));
        if (lane == 0) {
          const float v = __fadd_rn(acc, b[i]);
          z[i] = (l + 1 < L) ? (v <= 0.0f ? 0.0f : v) : v;
        }
      }
      __syncthreads();
    }
    // softmax cross-entropy, fp64, one thread
    if (tid == 0) {
      *skip_flag = (label < 0 || label >= C) ? 1 : 0;
      double m = -INFINITY;
      bool any = false;
      for (int64_t c = 0; c < C; ++c) {
        if (mk && mk[c]) continue;
        const double z = logits[c];
        if (!any || z > m) m = z;
        any = true;
      }
      double sum = 0.0;
      for (int64_t c = 0; c < C; ++c) {
        if (mk && mk[c]) continue;
        sum += exp(static_cast<double>(logits[c]) - m);
      }
      const double lse = log(sum);
      for (int64_t c = 0; c < C; ++c) {
        const bool live = !(mk && mk[c]);
        const double pc = live ? exp((static_cast<double>(logits[c]) - m) - lse) : 0.0;
        delta[L - 1][c] = live ? static_cast<float>(pc - (c == label ? 1.0 : 0.0)) : 0.0f;
      }
      if (!*skip_flag) {
        losses[r * n + k] = static_cast<float>((lse + m) - static_cast<double>(logits[label]));
      } else {
        losses[r * n + k] = NAN;
      }
      for (int l = 0; l < L; ++l) max_d[l] = max_a[l] = 0u;
    }
    __syncthreads();
    // backward signals with the weights before the update: a thread per input column
    for (int l = L - 1; l >= 1; --l) {
      const int64_t in = t.widths[l], out = t.widths[l + 1];
      const float* w = t.w[l] + r * in * out;
      for (int64_t j = tid; j < in; j += blockDim.x) {
        float back = 0.0f;
        for (int64_t i = 0; i < out; ++i) back = __fadd_rn(back, __fmul_rn(w[i * in + j], delta[l][i]));
        delta[l - 1][j] = act[l][j] > 0.0f ? back : 0.0f;
      }
      __syncthreads();
    }
    int bad = 0;
    if (check_finite) {
      for (int l = 0; l < L; ++l) {
        const float* a = l == 0 ? a0 : act[l];
        for (int64_t j = tid; j < t.widths[l]; j += blockDim.x) {
          bad |= !isfinite(a[j]);
          atomic_max_abs(&max_a[l], a[j]);
        }
        for (int64_t i = tid; i < t.widths[l + 1]; i += blockDim.x) {
          bad |= !isfinite(delta[l][i]);
          atomic_max_abs(&max_d[l], delta[l][i]);
        }
      }
    }
    __syncthreads();
    if (check_finite && tid == 0) {
      for (int l = 0; l < L; ++l) {
        const float prod = __fmul_rn(__uint_as_float(max_d[l]), __uint_as_float(max_a[l]));
        bad |= !isfinite(prod);
      }
    }
    bad = __syncthreads_or(bad || *skip_flag);
    if (bad) {
      skips += 1;
      continue;
    }
    // the update, the gradient formed in registers
    for (int l = 0; l < L; ++l) {
      const int64_t in = t.widths[l], out = t.widths[l + 1];
      const float* a = l == 0 ? a0 : act[l];
      const int64_t off = r * in * out;
      float* w = t.w[l] + off;
      const float* w0 = t.w0[l] + off;
      const float* hw = t.hw[l] + off;
      for (int64_t e = tid; e < in * out; e += blockDim.x) {
        const int64_t i = e / in, j = e - i * in;
        w[e] = updated<kProx>(w[e], __fmul_rn(delta[l][i], a[j]), w0[e], hw[e], beta, reg, cs);
      }
      float* b = t.b[l] + r * out;
      const float* b0 = t.b0[l] + r * out;
      const float* hb = t.hb[l] + r * out;
      for (int64_t i = tid; i < out; i += blockDim.x) {
        b[i] = updated<kProx>(b[i], delta[l][i], b0[i], hb[i], beta, reg, cs);
      }
    }
    __syncthreads();
  }
  if (tid == 0) skipped[r] = skips;
}

void mlp_glance_cuda(const std::vector<at::Tensor>& params,
                     const std::vector<at::Tensor>& anchors,
                     const std::vector<at::Tensor>& importances, const at::Tensor& x,
                     const at::Tensor& y, const c10::optional<at::Tensor>& mask,
                     const at::Tensor& hyper, bool prox, bool check_finite,
                     const at::Tensor& losses, const at::Tensor& skipped) {
  const Shape s = check_call(params, anchors, importances, x, y, mask, hyper, losses, skipped);
  TORCH_CHECK(params[0].is_cuda(), "mlp_glance_ (CUDA): the tensors are on ", params[0].device());
  TORCH_CHECK(s.layers <= kMaxLayers, "mlp_glance_ (CUDA): at most ", kMaxLayers,
              " layers, got ", s.layers);
  Layers t{};
  t.layers = static_cast<int>(s.layers);
  int64_t floats = s.widths.back();
  for (int64_t l = 0; l < s.layers; ++l) {
    t.w[l] = params[2 * l].data_ptr<float>();
    t.b[l] = params[2 * l + 1].data_ptr<float>();
    t.w0[l] = anchors[2 * l].data_ptr<float>();
    t.b0[l] = anchors[2 * l + 1].data_ptr<float>();
    t.hw[l] = importances[2 * l].data_ptr<float>();
    t.hb[l] = importances[2 * l + 1].data_ptr<float>();
    floats += s.widths[l + 1] + (l + 1 < s.layers ? s.widths[l + 1] : 0);
  }
  for (int64_t l = 0; l <= s.layers; ++l) t.widths[l] = s.widths[l];
  const size_t shared = static_cast<size_t>(floats) * sizeof(float) +
                        2 * kMaxLayers * sizeof(unsigned int) + sizeof(int);
  TORCH_CHECK(shared <= 48 * 1024, "mlp_glance_ (CUDA): the hidden widths need ", shared,
              " bytes of shared memory, more than 48 KiB");
  if (s.runs == 0) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const bool has_mask = mask.has_value() && mask->defined();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool* mp = has_mask ? mask->data_ptr<bool>() : nullptr;
  const dim3 grid(static_cast<unsigned int>(s.runs));
  if (prox) {
    glance_kernel<true><<<grid, kThreads, shared, stream>>>(
        t, x.data_ptr<float>(), y.data_ptr<int64_t>(), mp, hyper.data_ptr<double>(), s.samples,
        check_finite, losses.data_ptr<float>(), skipped.data_ptr<int64_t>());
  } else {
    glance_kernel<false><<<grid, kThreads, shared, stream>>>(
        t, x.data_ptr<float>(), y.data_ptr<int64_t>(), mp, hyper.data_ptr<double>(), s.samples,
        check_finite, losses.data_ptr<float>(), skipped.data_ptr<int64_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace glance
}  // namespace emcl

TORCH_LIBRARY_IMPL(emcl, CUDA, m) { m.impl("mlp_glance_", &emcl::glance::mlp_glance_cuda); }
