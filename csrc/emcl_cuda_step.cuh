// The update of the "cuda" backend (see emcl_cuda.cu): the step functor and its launch,
// compiled once per parameter dtype in emcl_cuda_f32.cu, emcl_cuda_f64.cu, emcl_cuda_bf16.cu and
// emcl_cuda_f16.cu. [note: one file per dtype] The 48 update kernels (4 dtypes x 12 modes) took
// nvcc ~100 s in one file, the longest step of a build; four files compile in parallel. Each
// dtype's file defines EMCL_CUDA_STEP_DEFINE before including this header and instantiates
// launch_step_modes for its dtype; emcl_cuda.cu sees only the declarations.
#pragma once

#include "emcl_math.h"

#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>

#include "emcl_interface.h"
#include "emcl_ops.h"
#include "multi_tensor.cuh"

namespace emcl {
namespace cuda {

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

// The device pointers and the scalars of one step call (kernel arguments; no float value).
struct StepArgs {
  const double* hyper;      // hyper::kCount raw values per run
  int64_t* counters;        // counters_size(runs)
  const float* grad_scale;  // null: not scaled
  const float* found_inf;   // null: not given
  float* steps;             // null: not counted; else runs per parameter, param-major
  Op op;                    // as passed (kCadence resolved per block)
  int64_t meta_every;
  int64_t runs;             // an array of runs ([note: runs on the GPU]); 1: a single run
  bool finalize;            // this launch is the last of a finalizing call
};

// The update launch(es) of one step call whose parameters are scalar_t, for its modes.
template <typename scalar_t>
void launch_step_modes(const Lists& l, const StepArgs& args, bool prox, Importance importance,
                       LrMode lr_mode, int device, cudaStream_t stream);

#ifdef EMCL_CUDA_STEP_DEFINE
namespace {

// ---------------------------------------------------------------------------------------------
// The update.
// ---------------------------------------------------------------------------------------------


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

// finalize_call for an array of `runs` runs: the same last-block pattern, and the last block's
// threads then add each run's found flag to its skip count and clear the flag. Every block's
// threads read the run flags before the barrier at the top (the update's skips, block 0's
// steps); thread 0's fence-then-atomic after that barrier is cumulative over them (the same
// argument as the Triton kernel's [note: last program]), and the last block's other threads
// write after its thread 0's atomic-then-fence, through the second barrier.
__device__ __forceinline__ void finalize_runs(int64_t* counters, int64_t found, int64_t calls,
                                              Op op, int64_t runs) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    auto* done = reinterpret_cast<unsigned long long*>(counters + counter::kDone);
    last = atomicAdd(done, 1ull) == static_cast<unsigned long long>(gridDim.x) - 1;
    if (last) {
      __threadfence();
      volatile int64_t* c = counters;
      if (op == Op::kCadence) c[counter::kCalls] = calls + 1;
      if (found != 0) c[counter::kSkipped] = c[counter::kSkipped] + 1;
      c[counter::kFound] = 0;
      c[counter::kDone] = 0;
    }
  }
  __syncthreads();
  if (!last) return;
  volatile int64_t* flags = counters + counter::kRunFound;
  volatile int64_t* skipped = counters + counter::kRunFound + runs;
  for (int64_t r = threadIdx.x; r < runs; r += kBlockSize) {
    if (flags[r] != 0) skipped[r] = skipped[r] + 1;
    flags[r] = 0;
  }
}

// [note: runs on the GPU] An array of runs ([note: runs] in emcl_kernels/interface.py) is the
// same single launch over the same table of tensors and chunks; kArray (a template parameter,
// so that a single run's kernels are the ones they were) switches the functor to: each chunk
// cut at the run boundaries of its tensor (run r owns elements [r * n, (r + 1) * n) of a tensor
// of runs * n elements; the cut is uniform across the block), each part skipped when its run's
// found flag is set, else updated with Hyper made by every thread from its run's row of
// `hyper` (nine loads the block shares in L1, no barrier) by the same per-element code; a part
// that starts inside a vector runs its first elements on the scalar path (kPeel). Block 0
// counts each run's meta steps after its flag, and the last block clears the flags into the
// skip counts (finalize_runs). Registers (CUDA 13.0, sm_90, cuobjdump -res-usage): the single
// run's kernels as before (fp32 118-128, bf16 98-120, fp16 110-121, fp64 76-100); the array
// kernels fp32 128-162, bf16 128-164, fp16 128-154, fp64 118-128, some with 16-64 bytes of
// stack: one 256-thread block per SM where a single run's kernels have two, which still keeps
// 4 x 16 bytes per thread and stream in flight (see kILP). Capping them at 128 registers
// (__launch_bounds__(256, 2)) spilled 308 bytes in the fp32 kernel. To be measured on a GPU.

template <typename scalar_t, bool kProx, Importance kImp, LrMode kLr, bool kArray>
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
    if constexpr (kArray) {
      step_runs(meta);
    } else {
      step_one(meta);
    }
  }

  // An array of runs ([note: runs on the GPU]).
  __device__ __forceinline__ void step_runs(const Meta& meta) const {
    __shared__ BlockState<acc_t> shared;  // (its hp is not used: one per run, per part)
    if (threadIdx.x == 0) {
      BlockState<acc_t> s;
      s.found = args.counters[counter::kFound];
      s.calls = args.counters[counter::kCalls];
      s.skip = s.found != 0 || (args.found_inf != nullptr && *args.found_inf != 0.f);
      s.which = resolve_op(args.op, s.calls, args.meta_every);
      shared.found = s.found;
      shared.calls = s.calls;
      shared.skip = s.skip;
      shared.which = s.which;
    }
    __syncthreads();
    const int64_t runs = args.runs;
    const int64_t* run_found = args.counters + counter::kRunFound;
    if (!shared.skip) {
      const Op which = shared.which;
      switch (which) {  // uniform across the launch
        case Op::kInner:
          for_each_chunk(meta, [&](int t, int64_t b, int64_t e) {
            update_runs<Op::kInner>(meta, t, b, e);
          });
          break;
        case Op::kMeta:
          for_each_chunk(meta, [&](int t, int64_t b, int64_t e) {
            update_runs<Op::kMeta>(meta, t, b, e);
          });
          break;
        default:
          for_each_chunk(meta, [&](int t, int64_t b, int64_t e) {
            update_runs<Op::kInnerMeta>(meta, t, b, e);
          });
          break;
      }
      // The meta-step counts of this launch's parameters, every run that did not skip
      // (element i * runs + r), by one block.
      if (blockIdx.x == 0 && has_meta(which) && args.steps != nullptr) {
        float* steps = args.steps + static_cast<int64_t>(meta.first_param) * runs;
        const int64_t count = static_cast<int64_t>(meta.num_params) * runs;
        for (int64_t j = threadIdx.x; j < count; j += kBlockSize) {
          if (run_found[j % runs] == 0) steps[j] += 1.f;
        }
      }
    }
    if (args.finalize) finalize_runs(args.counters, shared.found, shared.calls, args.op, runs);
  }

  // Elements [begin, end) of table tensor t of an array: cut at its run boundaries, each part
  // updated with its run's hyper-parameters unless its run skips.
  template <Op kOp>
  __device__ __forceinline__ void update_runs(const Meta& meta, int t, int64_t begin,
                                              int64_t end) const {
    const int64_t n = meta.numel[t] / args.runs;  // > 0: the chunk is not empty
    const bool scaled = args.grad_scale != nullptr;
    for (int64_t r = begin / n; begin < end; ++r) {
      const int64_t stop = end < (r + 1) * n ? end : (r + 1) * n;
      if (args.counters[counter::kRunFound + r] == 0) {
        const Hyper<acc_t> hp = make_hyper<acc_t>(
            args.hyper + r * hyper::kCount,
            scaled ? static_cast<acc_t>(*args.grad_scale) : acc_t(1), scaled);
        update_range<kOp, true>(meta, t, begin, stop, hp);
      }
      begin = stop;
    }
  }

  // A single run: the block's state read once by thread 0 and shared.
  __device__ __forceinline__ void step_one(const Meta& meta) const {
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
  // kPeel: `begin` may fall inside a vector (a part of an array's chunk): the elements before
  // the next multiple of kVec go one at a time first.
  template <Op kOp, bool kPeel = false>
  __device__ __forceinline__ void update_range(const Meta& meta, int t, int64_t begin,
                                               int64_t end, const Hyper<acc_t>& hp) const {
    constexpr bool kReadsAlpha = has_meta(kOp) && kAlpha;
    auto* __restrict__ param = static_cast<scalar_t*>(meta.addresses[0][t]);
    const auto* __restrict__ grad = static_cast<const scalar_t*>(meta.addresses[1][t]);
    auto* __restrict__ anchor = static_cast<acc_t*>(meta.addresses[2][t]);
    auto* __restrict__ importance = static_cast<acc_t*>(meta.addresses[3][t]);
    acc_t* __restrict__ alpha = nullptr;
    if constexpr (kAlpha) alpha = static_cast<acc_t*>(meta.addresses[kDepth - 1][t]);
    auto one = [&](int64_t i) {  // element i alone
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
    };

    if (meta.aligned(t)) {
      if constexpr (kPeel) {
        const int64_t head_end = (begin + kVec - 1) / kVec * kVec;
        const int64_t head = head_end < end ? head_end : end;
        for (int64_t i = begin + threadIdx.x; i < head; i += kBlockSize) one(i);
        begin = head;
      }
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
    for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) one(i);
  }
};

template <typename scalar_t, bool kProx, Importance kImp, LrMode kLr, bool kArray>
void launch_step(const Lists& l, const StepArgs& args, int device, cudaStream_t stream) {
  using Functor = StepFunctor<scalar_t, kProx, kImp, kLr, kArray>;
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

}  // namespace

template <typename scalar_t>
void launch_step_modes(const Lists& l, const StepArgs& args, bool prox, Importance importance,
                       LrMode lr_mode, int device, cudaStream_t stream) {
  dispatch_modes(prox, importance, lr_mode, [&](auto p, auto imp, auto lr) {
    if (args.runs > 1) {
      launch_step<scalar_t, decltype(p)::value, decltype(imp)::value, decltype(lr)::value,
                  true>(l, args, device, stream);
    } else {
      launch_step<scalar_t, decltype(p)::value, decltype(imp)::value, decltype(lr)::value,
                  false>(l, args, device, stream);
    }
  });
}
#endif  // EMCL_CUDA_STEP_DEFINE

}  // namespace cuda
}  // namespace emcl
