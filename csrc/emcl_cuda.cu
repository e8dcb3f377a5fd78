// The "cuda" backend: [note: the step call] of emcl_kernels/interface.py for CUDA tensors, as
// two small functors run over whole tensor lists by the multi-tensor launcher
// (multi_tensor.cuh):
//
// - CheckFunctor: the finite check, a read-only pass over the gradients (any parameter dtype,
//   per tensor) that sets counters[FOUND] when it meets an inf or a NaN;
// - StepFunctor: the update. Each block reads the call's state once, on the device (the fp64
//   hyper-parameters, combined in fp64 and rounded once to the compute type; counters[FOUND],
//   counters[CALLS], found_inf, grad_scale), then updates its chunks; block 0 counts the meta
//   steps; with `finalize`, the call's last block does the counters' bookkeeping
//   ([note: finalize]).
//
// A call is one update launch, preceded by one check launch when `check` is set (more only past
// the kernel-argument limit), stream-ordered on the current stream. Nothing is read back to the
// host, nothing is allocated and no float hyper-parameter is a kernel argument, so a call can be
// captured in a CUDA graph and its replays read the current hyper-parameters and counters.
//
// [note: what is a template parameter] The dtype and the modes (prox, importance, lr_mode) are
// template parameters: they decide the arithmetic of every element, and a call's modes do not
// change between calls. The op (inner, meta, inner+meta) is a uniform runtime branch per block:
// op=cadence picks it from counters[CALLS] on the device, so the cadence kernel must hold both
// the inner and the fused body anyway, and one kernel per (dtype, modes) with all three bodies
// is 48 kernels where op as a template parameter would be 4 dtypes x 32 = 128 (a cadence kernel
// holding two bodies). The register count of a kernel is that of its largest body (the fused
// one), which the inner-only kernel of the other design would not pay; every body is
// memory-bound, so occupancy only has to keep enough bytes in flight (see kILP).
// Measured with CUDA 13.0 (cuobjdump -res-usage, -O3): sm_90: fp32 118-128 registers, bf16
// 98-120, fp16 110-121, fp64 79-100, the check 32, no spills; sm_80 the same ranges within a
// few registers, and one fp64 kernel (no prox, SI, inverse) spills 8 bytes. At <= 128
// registers two 256-thread blocks are resident per SM, with 16 vectors of 16 bytes per thread
// in flight (fp32), far more than the ~20 KB per SM that hides DRAM latency on an H100.
//
// The update's functor and launch are in emcl_cuda_step.cuh, compiled per dtype in
// emcl_cuda_<dtype>.cu ([note: one file per dtype]); this file holds the check, the op's entry
// points and their registration.
#include "emcl_math.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

#include "emcl_cuda_step.cuh"
#include "emcl_interface.h"
#include "emcl_ops.h"
#include "multi_tensor.cuh"

namespace emcl {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// The finite check.
// ---------------------------------------------------------------------------------------------

// The bits of one element of each parameter dtype, and the exponent mask that marks ±inf/NaN.
template <typename T> struct Bits;
template <> struct Bits<float> {
  using U = uint32_t;
  static constexpr U kExp = 0x7f800000u;
};
template <> struct Bits<double> {
  using U = unsigned long long;
  static constexpr U kExp = 0x7ff0000000000000ull;
};
template <> struct Bits<c10::BFloat16> {
  using U = uint16_t;
  static constexpr U kExp = 0x7f80u;
};
template <> struct Bits<c10::Half> {
  using U = uint16_t;
  static constexpr U kExp = 0x7c00u;
};

// Elements [begin, end) of a tensor of T at `data`: any inf or NaN? Integer tests on the raw
// bits (all exponent bits set), 16-byte loads when the tensor is aligned, kILP of them in
// flight per thread. kPeel: `begin` may fall inside a vector (a part of an array's chunk, [note:
// runs on the GPU]): the elements before the next multiple of kVec are tested one at a time.
template <typename T, bool kPeel = false>
__device__ __forceinline__ bool range_nonfinite(const void* data, bool aligned, int64_t begin,
                                                int64_t end) {
  using U = typename Bits<T>::U;
  constexpr U kExp = Bits<T>::kExp;
  constexpr int kVec = static_cast<int>(kVectorBytes / sizeof(U));
  constexpr int kILP = 4;
  const U* __restrict__ x = static_cast<const U*>(data);
  bool bad = false;
  if (aligned) {
    if constexpr (kPeel) {
      const int64_t head_end = (begin + kVec - 1) / kVec * kVec;
      const int64_t head = head_end < end ? head_end : end;
      for (int64_t i = begin + threadIdx.x; i < head; i += kBlockSize) {
        bad |= (x[i] & kExp) == kExp;
      }
      begin = head;
    }
    const int64_t nvec = (end - begin) / kVec;
    for (int64_t v0 = threadIdx.x; v0 < nvec; v0 += kILP * kBlockSize) {
      Pack<U, kVec> packs[kILP];
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        const int64_t v = v0 + k * kBlockSize;
        if (v < nvec) {
          packs[k] = load_pack<U, kVec>(x + begin + v * kVec);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) packs[k].v[j] = 0;
        }
      }
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) bad |= (packs[k].v[j] & kExp) == kExp;
      }
    }
    begin += nvec * kVec;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) bad |= (x[i] & kExp) == kExp;
  return bad;
}

// Elements [begin, end) of table tensor t of the check's table, by its dtype code.
template <bool kPeel>
__device__ __forceinline__ bool chunk_nonfinite(const TensorListMeta<1>& meta, int t,
                                                int64_t begin, int64_t end) {
  const void* data = meta.addresses[0][t];
  const bool aligned = meta.aligned(t);
  switch (meta.dtype(t)) {  // uniform across the block
    case kCodeFloat:
      return range_nonfinite<float, kPeel>(data, aligned, begin, end);
    case kCodeDouble:
      return range_nonfinite<double, kPeel>(data, aligned, begin, end);
    case kCodeBFloat16:
      return range_nonfinite<c10::BFloat16, kPeel>(data, aligned, begin, end);
    default:
      return range_nonfinite<c10::Half, kPeel>(data, aligned, begin, end);
  }
}

// kArray: an array of `runs` runs ([note: runs on the GPU] in emcl_cuda_step.cuh): each chunk
// is cut at the run boundaries of its tensor and a part with an inf or a NaN sets its run's
// flag, counters[kRunFound + r]; else counters[kFound].
template <bool kArray>
struct CheckFunctor {
  int64_t* counters;
  int64_t runs;

  __device__ __forceinline__ void operator()(const TensorListMeta<1>& meta) const {
    if constexpr (kArray) {
      for_each_chunk(meta, [&](int t, int64_t begin, int64_t end) {
        const int64_t n = meta.numel[t] / runs;  // > 0: the chunk is not empty
        for (int64_t r = begin / n; begin < end; ++r) {  // uniform across the block
          const int64_t stop = end < (r + 1) * n ? end : (r + 1) * n;
          const bool bad = chunk_nonfinite<true>(meta, t, begin, stop);
          if (__syncthreads_or(bad) && threadIdx.x == 0) {
            atomicExch(reinterpret_cast<unsigned long long*>(
                           counters + counter::kRunFound + r), 1ull);
          }
          begin = stop;
        }
      });
    } else {
      bool bad = false;
      for_each_chunk(meta, [&](int t, int64_t begin, int64_t end) {
        bad |= chunk_nonfinite<false>(meta, t, begin, end);
      });
      // Every writer writes the same 1; the update launch that reads it comes after this one
      // on the stream.
      if (__syncthreads_or(bad) && threadIdx.x == 0) {
        atomicExch(reinterpret_cast<unsigned long long*>(counters + counter::kFound), 1ull);
      }
    }
  }
};

template <bool kArray>
void launch_check_kernel(at::TensorList grads, int64_t* counters, int64_t runs, int device,
                         cudaStream_t stream) {
  using Functor = CheckFunctor<kArray>;
  pack_tensor_lists<1>({grads}, resident_grid<1, Functor>(device), /*launch_empty=*/false,
                       [&](const TensorListMeta<1>& meta, bool, int grid) {
                         multi_tensor_kernel<1, Functor>
                             <<<grid, kBlockSize, 0, stream>>>(meta, Functor{counters, runs});
                         C10_CUDA_KERNEL_LAUNCH_CHECK();
                         g_launch_count.fetch_add(1, std::memory_order_relaxed);
                       });
}

void launch_check(at::TensorList grads, int64_t* counters, int64_t runs, int device,
                  cudaStream_t stream) {
  if (runs > 1) {
    launch_check_kernel<true>(grads, counters, runs, device, stream);
  } else {
    launch_check_kernel<false>(grads, counters, 1, device, stream);
  }
}

void step_cuda(at::TensorList params, at::TensorList grads, at::TensorList anchors,
               at::TensorList importances, at::TensorList meta_lrs, const at::Tensor& steps,
               const at::Tensor& hyper, const at::Tensor& counters, int64_t op, bool prox,
               int64_t importance, int64_t lr_mode, int64_t meta_every, bool check,
               bool finalize, const OptTensor& grad_scale, const OptTensor& found_inf,
               int64_t runs) {
  const Lists lists{params, grads, anchors, importances, meta_lrs};
  const StepCall call = check_step_call(lists, steps, hyper, counters, op, prox, importance,
                                        lr_mode, meta_every, grad_scale, found_inf, runs);
  const c10::cuda::CUDAGuard guard(call.device);
  const int device = call.device.index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  int64_t* c = counters.data_ptr<int64_t>();
  if (check) launch_check(grads, c, call.runs, device, stream);
  const StepArgs args{hyper.data_ptr<double>(),
                      c,
                      grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr,
                      found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr,
                      steps.numel() > 0 ? steps.data_ptr<float>() : nullptr,
                      call.op,
                      call.meta_every,
                      call.runs,
                      finalize};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, call.dtype, "emcl_cuda", [&] {
    launch_step_modes<scalar_t>(lists, args, call.prox, call.importance, call.lr_mode, device,
                                stream);
  });
}

void check_finite_cuda(at::TensorList grads, const at::Tensor& counters, int64_t runs) {
  const at::Device device = check_finite_call(grads, counters, runs);
  const c10::cuda::CUDAGuard guard(device);
  launch_check(grads, counters.data_ptr<int64_t>(), runs, device.index(),
               c10::cuda::getCurrentCUDAStream(device.index()));
}

}  // namespace
}  // namespace cuda
}  // namespace emcl

namespace emcl {
namespace cuda {
namespace {

// torch.ops.emcl.cuda_launch_shape: [elements per chunk, chunks] of a call over tensors of
// `numels` elements when `max_grid` blocks can be resident ([note: chunk size]); host-only, so
// the tests read the launch shape on a machine without a GPU.
std::vector<int64_t> launch_shape(const std::vector<int64_t>& numels, int64_t max_grid) {
  TORCH_CHECK(max_grid > 0, "cuda_launch_shape: max_grid must be positive, got ", max_grid);
  int64_t total = 0;
  for (const int64_t n : numels) {
    TORCH_CHECK(n >= 0, "cuda_launch_shape: numels must be >= 0, got ", n);
    total += n;
  }
  const int64_t chunk = chunk_size_for(total, static_cast<int>(max_grid));
  int64_t chunks = 0;
  for (const int64_t n : numels) chunks += (n + chunk - 1) / chunk;
  return {chunk, chunks};
}

}  // namespace
}  // namespace cuda
}  // namespace emcl

TORCH_LIBRARY_FRAGMENT(emcl, m) {
  m.def("cuda_launch_shape(int[] numels, int max_grid) -> int[]", &emcl::cuda::launch_shape);
}

TORCH_LIBRARY_IMPL(emcl, CUDA, m) {
  m.impl("step_", &emcl::cuda::step_cuda);
  m.impl("check_finite_", &emcl::cuda::check_finite_cuda);
}
