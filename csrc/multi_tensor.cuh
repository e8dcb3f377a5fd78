// The generic multi-tensor launcher: one kernel launch updates a whole list of tensors.
//
//   multi_tensor_apply<kDepth>(lists, functor, noop_flag)
//
// `lists` holds kDepth tensor lists of equal length (list k, tensor t); the addresses and sizes
// of all tensors go into the kernel's arguments (TensorListMeta) and every block walks the
// chunks of the whole list: chunk c of the launch belongs to the tensor t with
// chunk_start[t] <= c < chunk_start[t + 1] (a binary search over the arguments), so one launch
// covers any number of elements; a new launch starts only when the argument struct is full
// (kMaxTensors tensors, see [note: argument limit]). The functor does the per-element work:
//
//   __device__ void operator()(const TensorListMeta<kDepth>& meta, int t,
//                              int64_t begin, int64_t end) const;
//
// for elements [begin, end) of tensor t (begin is a multiple of kChunkSize, so a chunk keeps
// the alignment of its tensor). Indices are 64-bit: a tensor past 2**31 elements is updated
// whole. When `noop_flag` is non-null and *noop_flag != 0 the kernel writes nothing (the
// found_inf of torch.amp), read on the device so the host never waits.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace emcl {
namespace cuda {

constexpr int kBlockSize = 256;            // threads per block
constexpr int64_t kChunkSize = 16384;      // elements a block handles before moving on
constexpr int kBlocksPerSM = 8;            // resident blocks per SM the grid is sized for
constexpr int64_t kVectorBytes = 16;       // width of a vector load/store

// [note: argument limit] Kernel arguments are limited to 4 KiB on every CUDA version and
// driver (12.1+ allows 32 KiB on new drivers only). TensorListMeta uses at most kMetaBytes and
// leaves the rest to the functor's hyper-parameters and the flag pointer.
constexpr int kMetaBytes = 3584;

template <int kDepth>
struct TensorListMeta {
  // Per tensor: kDepth addresses, the size, and the first chunk (one extra entry at the end).
  static constexpr int kMaxTensors =
      (kMetaBytes - 2 * 8 - 8) / (kDepth * 8 + 8 + 8);
  void* addresses[kDepth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t chunk_start[kMaxTensors + 1];
  int ntensors;
  bool aligned;  // every address is kVectorBytes-aligned: the functor may use vector loads
};

template <int kDepth, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(const TensorListMeta<kDepth> meta, const Functor functor,
                        const float* noop_flag) {
  if (noop_flag != nullptr && *noop_flag != 0.f) return;
  const int64_t nchunks = meta.chunk_start[meta.ntensors];
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int lo = 0, hi = meta.ntensors - 1;  // the last tensor whose first chunk is <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (meta.chunk_start[mid] <= c) lo = mid; else hi = mid - 1;
    }
    const int64_t begin = (c - meta.chunk_start[lo]) * kChunkSize;
    const int64_t end =
        begin + kChunkSize < meta.numel[lo] ? begin + kChunkSize : meta.numel[lo];
    functor(meta, lo, begin, end);
  }
}

inline int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) device = 0;
  if (counts[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device] = n > 0 ? n : 1;
  }
  return counts[device];
}

// Launches `functor` over the tensors of `lists` (all on one device, the current stream):
// one launch, or one per kMaxTensors tensors. Empty tensors are skipped. `on_launch` is called
// once per launch (the launch counter of the tests).
template <int kDepth, typename Functor, typename OnLaunch>
void multi_tensor_apply(const std::array<at::TensorList, kDepth>& lists, const Functor& functor,
                        const float* noop_flag, OnLaunch&& on_launch) {
  using Meta = TensorListMeta<kDepth>;
  static_assert(sizeof(Meta) <= kMetaBytes, "TensorListMeta outgrew its share of the arguments");
  static_assert(sizeof(Meta) + sizeof(Functor) + sizeof(void*) <= 4096,
                "kernel arguments past the 4 KiB limit, see [note: argument limit]");
  const at::TensorList& first = lists[0];
  if (first.empty()) return;
  const c10::cuda::CUDAGuard guard(first[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int max_grid = sm_count(first[0].get_device()) * kBlocksPerSM;

  Meta meta;
  auto reset = [&] {
    meta.ntensors = 0;
    meta.chunk_start[0] = 0;
    meta.aligned = true;
  };
  auto launch = [&] {
    const int64_t nchunks = meta.chunk_start[meta.ntensors];
    if (nchunks == 0) return;
    const int grid = static_cast<int>(std::min<int64_t>(nchunks, max_grid));
    multi_tensor_kernel<kDepth, Functor><<<grid, kBlockSize, 0, stream>>>(meta, functor,
                                                                           noop_flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    on_launch();
  };
  reset();
  for (size_t t = 0; t < first.size(); ++t) {
    const int64_t numel = first[t].numel();
    if (numel == 0) continue;
    const int k = meta.ntensors;
    for (int d = 0; d < kDepth; ++d) {
      void* ptr = lists[d][t].data_ptr();
      meta.addresses[d][k] = ptr;
      meta.aligned = meta.aligned && reinterpret_cast<uintptr_t>(ptr) % kVectorBytes == 0;
    }
    meta.numel[k] = numel;
    meta.chunk_start[k + 1] = meta.chunk_start[k] + (numel + kChunkSize - 1) / kChunkSize;
    meta.ntensors = k + 1;
    if (meta.ntensors == Meta::kMaxTensors) {
      launch();
      reset();
    }
  }
  if (meta.ntensors > 0) launch();
}

}  // namespace cuda
}  // namespace emcl
