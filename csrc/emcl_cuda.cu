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
#include "emcl_math.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

#include "emcl_interface.h"
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
// flight per thread.
template <typename T>
__device__ __forceinline__ bool range_nonfinite(const void* data, bool aligned, int64_t begin,
                                                int64_t end) {
  using U = typename Bits<T>::U;
  constexpr U kExp = Bits<T>::kExp;
  constexpr int kVec = static_cast<int>(kVectorBytes / sizeof(U));
  constexpr int kILP = 4;
  const U* __restrict__ x = static_cast<const U*>(data);
  bool bad = false;
  if (aligned) {
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

struct CheckFunctor {
  int64_t* counters;

  __device__ __forceinline__ void operator()(const TensorListMeta<1>& meta) const {
    bool bad = false;
    for_each_chunk(meta, [&](int t, int64_t begin, int64_t end) {
      const void* data = meta.addresses[0][t];
      const bool aligned = meta.aligned(t);
      switch (meta.dtype(t)) {  // uniform across the block
        case kCodeFloat:
          bad |= range_nonfinite<float>(data, aligned, begin, end);
          break;
        case kCodeDouble:
          bad |= range_nonfinite<double>(data, aligned, begin, end);
          break;
        case kCodeBFloat16:
          bad |= range_nonfinite<c10::BFloat16>(data, aligned, begin, end);
          break;
        default:
          bad |= range_nonfinite<c10::Half>(data, aligned, begin, end);
          break;
      }
    });
    // Every writer writes the same 1; the update launch that reads it comes after this one on
    // the stream.
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      atomicExch(reinterpret_cast<unsigned long long*>(counters + counter::kFound), 1ull);
    }
  }
};

void launch_check(at::TensorList grads, int64_t* counters, int device, cudaStream_t stream) {
  pack_tensor_lists<1>({grads}, resident_grid<1, CheckFunctor>(device), /*launch_empty=*/false,
                       [&](const TensorListMeta<1>& meta, bool, int grid) {
                         multi_tensor_kernel<1, CheckFunctor>
                             <<<grid, kBlockSize, 0, stream>>>(meta, CheckFunctor{counters});
                         C10_CUDA_KERNEL_LAUNCH_CHECK();
                         g_launch_count.fetch_add(1, std::memory_order_relaxed);
                       });
}

// ---------------------------------------------------------------------------------------------
// The update.
// ---------------------------------------------------------------------------------------------

// The device pointers and the scalars of one step call (kernel arguments; no float value).
struct StepArgs {
  const double* hyper;      // hyper::kCount raw values
  int64_t* counters;        // counter::kCount
  const float* grad_scale;  // null: not scaled
  const float* found_inf;   // null: not given
  float* steps;             // null: not counted
  Op op;                    // as passed (kCadence resolved per block)
  int64_t meta_every;
  bool finalize;            // this launch is the last of a finalizing call
};

// What every block reads once, at its start (thread 0 reads, the block shares).
template <typename acc_t>
struct BlockState {
  Hyper<acc_t> hp;
  int64_t found, calls;
  Op which;
  bool skip;
};

// [note: finalize] The bookkeeping of a call (counters[CALLS] += 1 for the cadence,
// counters[SKIPPED] += 1 when FOUND is set, FOUND = 0) must not happen before every block of the
// call has read FOUND and CALLS, and blocks of one launch run in any order, some only after
// others have finished. The last-block pattern orders it without another launch or a host sync:
// thread 0 of each block (the thread that read the counters at the block's start) passes a
// __syncthreads (the block's work is done), a __threadfence, then atomicAdd(&DONE, 1). The
// block whose atomicAdd returns gridDim.x - 1 is the last: every other block's atomicAdd is
// before its own in DONE's modification order. Each block's fence-then-atomic is a release
// and the last block's atomic-then-fence an acquire (PTX memory model: fence.sc + a relaxed
// RMW on the same location synchronize), so every other block's read of FOUND/CALLS
// happens-before the last block's writes and cannot observe them. The last block then writes
// the counters from the values it read itself (no block of this launch writes FOUND or CALLS, so
// all blocks read the same values) and resets DONE to 0; the next call's kernels see all of it
// because they run after this one on the stream. With several launches per call only the last
// launch finalizes; the earlier ones finished before it started.
__device__ __forceinline__ void finalize_call(int64_t* counters, int64_t found, int64_t calls,
                                              Op op) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  auto* done = reinterpret_cast<unsigned long long*>(counters + counter::kDone);
  if (atomicAdd(done, 1ull) != static_cast<unsigned long long>(gridDim.x) - 1) return;
  __threadfence();
  volatile int64_t* c = counters;
  if (op == Op::kCadence) c[counter::kCalls] = calls + 1;
  if (found != 0) c[counter::kSkipped] = c[counter::kSkipped] + 1;
  c[counter::kFound] = 0;
  c[counter::kDone] = 0;
}

template <typename scalar_t, bool kProx, Importance kImp, LrMode kLr>
struct StepFunctor {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kAlpha = kLr == LrMode::kRecurrent;  // meta_lrs are in the lists
  static constexpr int kDepth = kAlpha ? 5 : 4;
  using Meta = TensorListMeta<kDepth>;
  // Elements per vector: one 16-byte load of θ (and of g); the state takes one or two.
  static constexpr int kVec = static_cast<int>(kVectorBytes / sizeof(scalar_t));
  static_assert(kVec * sizeof(acc_t) % kVectorBytes == 0, "state packs must be whole vectors");
  // Vectors in flight per thread and stream: 4 for fp32 (16 elements, 256-320 B per thread);
  // 2 for bf16/fp16 (their state packs are two vectors each) and for fp64 (at 4 its recurrent
  // kernels spill). ptxas -v, sm_90: 98-128 registers, no spills (see the task report).
  static constexpr int kILP = sizeof(scalar_t) == 4 ? 4 : 2;

  StepArgs args;

  __device__ __forceinline__ void operator()(const Meta& meta) const {
    __shared__ BlockState<acc_t> shared;
    if (threadIdx.x == 0) {
      BlockState<acc_t> s;
      s.found = args.counters[counter::kFound];
      s.calls = args.counters[counter::kCalls];
      s.skip = s.found != 0 || (args.found_inf != nullptr && *args.found_inf != 0.f);
      s.which = resolve_op(args.op, s.calls, args.meta_every);
      const bool scaled = args.grad_scale != nullptr;
      s.hp = make_hyper<acc_t>(args.hyper, scaled ? static_cast<acc_t>(*args.grad_scale)
                                                  : acc_t(1), scaled);
      shared = s;
    }
    __syncthreads();
    if (!shared.skip) {
      const Op which = shared.which;
      const Hyper<acc_t> hp = shared.hp;
      switch (which) {  // uniform across the launch
        case Op::kInner:
          for_each_chunk(meta, [&](int t, int64_t b, int64_t e) {
            update_range<Op::kInner>(meta, t, b, e, hp);
          });
          break;
        case Op::kMeta:
          for_each_chunk(meta, [&](int t, int64_t b, int64_t e) {
            update_range<Op::kMeta>(meta, t, b, e, hp);
          });
          break;
        default:
          for_each_chunk(meta, [&](int t, int64_t b, int64_t e) {
            update_range<Op::kInnerMeta>(meta, t, b, e, hp);
          });
          break;
      }
      // The meta-step counts of this launch's parameters (empty ones included), by one block.
      if (blockIdx.x == 0 && has_meta(which) && args.steps != nullptr) {
        for (int i = threadIdx.x; i < meta.num_params; i += kBlockSize) {
          args.steps[meta.first_param + i] += 1.f;
        }
      }
    }
    if (args.finalize) finalize_call(args.counters, shared.found, shared.calls, args.op);
  }

  // Elements [begin, end) of table tensor t: 16-byte packs (kILP per thread in flight) when
  // the tensor is aligned, then the tail (fewer than kVec elements) one element at a time.
  template <Op kOp>
  __device__ __forceinline__ void update_range(const Meta& meta, int t, int64_t begin,
                                               int64_t end, const Hyper<acc_t>& hp) const {
    constexpr bool kReadsAlpha = has_meta(kOp) && kAlpha;
    auto* __restrict__ param = static_cast<scalar_t*>(meta.addresses[0][t]);
    const auto* __restrict__ grad = static_cast<const scalar_t*>(meta.addresses[1][t]);
    auto* __restrict__ anchor = static_cast<acc_t*>(meta.addresses[2][t]);
    auto* __restrict__ importance = static_cast<acc_t*>(meta.addresses[3][t]);
    acc_t* __restrict__ alpha = nullptr;
    if constexpr (kAlpha) alpha = static_cast<acc_t*>(meta.addresses[kDepth - 1][t]);

    if (meta.aligned(t)) {
      const int64_t nvec = (end - begin) / kVec;
      for (int64_t v0 = threadIdx.x; v0 < nvec; v0 += kILP * kBlockSize) {
        Pack<scalar_t, kVec> p[kILP], g[kILP];
        Pack<acc_t, kVec> a[kILP], s[kILP], r[kILP];
#pragma unroll
        for (int k = 0; k < kILP; ++k) {
          const int64_t i = begin + (v0 + k * kBlockSize) * kVec;
          if (v0 + k * kBlockSize < nvec) {
            p[k] = load_pack<scalar_t, kVec>(param + i);
            g[k] = load_pack<scalar_t, kVec>(grad + i);
            a[k] = load_pack<acc_t, kVec>(anchor + i);
            s[k] = load_pack<acc_t, kVec>(importance + i);
            if constexpr (kReadsAlpha) r[k] = load_pack<acc_t, kVec>(alpha + i);
          }
        }
#pragma unroll
        for (int k = 0; k < kILP; ++k) {
          const int64_t i = begin + (v0 + k * kBlockSize) * kVec;
          if (v0 + k * kBlockSize < nvec) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              acc_t theta = static_cast<acc_t>(p[k].v[j]);
              acc_t rate = acc_t(0);
              if constexpr (kReadsAlpha) rate = r[k].v[j];
              step<kOp, kProx, kImp, kLr>(theta, static_cast<acc_t>(g[k].v[j]), a[k].v[j],
                                          s[k].v[j], rate, hp);
              p[k].v[j] = static_cast<scalar_t>(theta);
              if constexpr (kReadsAlpha) r[k].v[j] = rate;
            }
            store_pack(param + i, p[k]);
            if constexpr (has_meta(kOp)) {
              store_pack(anchor + i, a[k]);
              store_pack(importance + i, s[k]);
              if constexpr (kReadsAlpha) store_pack(alpha + i, r[k]);
            }
          }
        }
      }
      begin += nvec * kVec;
    }
    for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
      acc_t theta = static_cast<acc_t>(param[i]);
      acc_t theta0 = anchor[i];
      acc_t h = importance[i];
      acc_t rate = acc_t(0);
      if constexpr (kReadsAlpha) rate = alpha[i];
      step<kOp, kProx, kImp, kLr>(theta, static_cast<acc_t>(grad[i]), theta0, h, rate, hp);
      param[i] = static_cast<scalar_t>(theta);
      if constexpr (has_meta(kOp)) {
        anchor[i] = theta0;
        importance[i] = h;
        if constexpr (kReadsAlpha) alpha[i] = rate;
      }
    }
  }
};

template <typename scalar_t, bool kProx, Importance kImp, LrMode kLr>
void launch_step(const Lists& l, const StepArgs& args, int device, cudaStream_t stream) {
  using Functor = StepFunctor<scalar_t, kProx, kImp, kLr>;
  constexpr int kDepth = Functor::kDepth;
  static_assert(sizeof(TensorListMeta<kDepth>) + sizeof(Functor) <= 4096,
                "kernel arguments past the 4 KiB limit, see [note: argument limit]");
  std::array<at::TensorList, kDepth> lists;
  lists[0] = l.params;
  lists[1] = l.grads;
  lists[2] = l.anchors;
  lists[3] = l.importances;
  if constexpr (kDepth == 5) lists[4] = l.meta_lrs;
  // A launch with no elements still has bookkeeping when it finalizes or counts meta steps.
  const bool bookkeeping = args.finalize || (args.steps != nullptr && args.op != Op::kInner);
  pack_tensor_lists<kDepth>(lists, resident_grid<kDepth, Functor>(device), bookkeeping,
                            [&](const TensorListMeta<kDepth>& meta, bool last, int grid) {
                              Functor functor{args};
                              functor.args.finalize = args.finalize && last;
                              multi_tensor_kernel<kDepth, Functor>
                                  <<<grid, kBlockSize, 0, stream>>>(meta, functor);
                              C10_CUDA_KERNEL_LAUNCH_CHECK();
                              g_launch_count.fetch_add(1, std::memory_order_relaxed);
                            });
}

void step_cuda(at::TensorList params, at::TensorList grads, at::TensorList anchors,
               at::TensorList importances, at::TensorList meta_lrs, const at::Tensor& steps,
               const at::Tensor& hyper, const at::Tensor& counters, int64_t op, bool prox,
               int64_t importance, int64_t lr_mode, int64_t meta_every, bool check,
               bool finalize, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const Lists lists{params, grads, anchors, importances, meta_lrs};
  const StepCall call = check_step_call(lists, steps, hyper, counters, op, prox, importance,
                                        lr_mode, meta_every, grad_scale, found_inf);
  const c10::cuda::CUDAGuard guard(call.device);
  const int device = call.device.index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  int64_t* c = counters.data_ptr<int64_t>();
  if (check) launch_check(grads, c, device, stream);
  const StepArgs args{hyper.data_ptr<double>(),
                      c,
                      grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr,
                      found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr,
                      steps.numel() > 0 ? steps.data_ptr<float>() : nullptr,
                      call.op,
                      call.meta_every,
                      finalize};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, call.dtype, "emcl_cuda", [&] {
    dispatch_modes(call.prox, call.importance, call.lr_mode, [&](auto p, auto imp, auto lr) {
      launch_step<scalar_t, decltype(p)::value, decltype(imp)::value, decltype(lr)::value>(
          lists, args, device, stream);
    });
  });
}

void check_finite_cuda(at::TensorList grads, const at::Tensor& counters) {
  const at::Device device = check_finite_call(grads, counters);
  const c10::cuda::CUDAGuard guard(device);
  launch_check(grads, counters.data_ptr<int64_t>(), device.index(),
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
