// The generic multi-tensor launcher: one kernel launch works on a whole list of tensors.
//
//   pack_tensor_lists<kDepth>(lists, launch_empty, [&](const TensorListMeta<kDepth>& meta,
//                                                      bool last, int grid) { ...launch... });
//   multi_tensor_kernel<kDepth, Functor><<<grid, kBlockSize, 0, stream>>>(meta, functor);
//
// `lists` holds kDepth tensor lists of equal length (list d, tensor t). The addresses and sizes
// of the non-empty tensors go into the kernel's arguments (TensorListMeta, see [note: argument
// limit]); a new table (a new launch) starts only when one is full, and the caller is told which
// launch is the call's last. Every block of a launch walks the chunks of the whole table with
// for_each_chunk: chunk c belongs to the tensor t with chunk_start[t] <= c < chunk_start[t + 1]
// (a binary search over the arguments), so one launch covers any number of elements. Chunks
// start at multiples of the chunk size ([note: chunk size]), so a chunk keeps the alignment of
// its tensor, and indices are 64-bit: a tensor past 2**31 elements is worked on whole.
//
// The functor does everything else (apex's launcher/functor split):
//
//   __device__ void operator()(const TensorListMeta<kDepth>& meta) const;
//
// typically: read what the block needs once, for_each_chunk(meta, per-chunk work), then any
// per-launch bookkeeping. Per tensor the table carries a tag: whether every one of its kDepth
// addresses is kVectorBytes-aligned (the vector path is decided per tensor, so one odd tensor
// does not put the others on the scalar path) and a dtype code (for lists of mixed dtypes).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

namespace emcl {
namespace cuda {

constexpr int kBlockSize = 256;        // threads per block
constexpr int64_t kChunkSize = 16384;  // elements a block works on before it moves on
constexpr int64_t kMinChunkSize = 2048;  // the smallest chunk of a call with few elements
constexpr int64_t kVectorBytes = 16;   // width of a vector load/store

// Per-tensor tag bits.
constexpr uint8_t kTagAligned = 1;     // every address of the tensor is kVectorBytes-aligned
constexpr int kTagDtypeShift = 1;      // bits 1-2: the dtype code (dtype_code)

// The dtype codes of the tags (only the finite check reads them; a step's lists have one dtype).
constexpr uint8_t kCodeFloat = 0, kCodeDouble = 1, kCodeBFloat16 = 2, kCodeHalf = 3;

inline uint8_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return kCodeDouble;
    case at::kBFloat16:
      return kCodeBFloat16;
    case at::kHalf:
      return kCodeHalf;
    default:
      return kCodeFloat;
  }
}

// [note: argument limit] Kernel arguments are limited to 4 KiB on every CUDA version and
// driver (12.1+ allows 32 KiB on new drivers only). TensorListMeta uses at most kMetaBytes and
// leaves the rest to the functor (device pointers and a few scalars).
constexpr int kMetaBytes = 3584;

// [note: chunk size] A call's chunks are kChunkSize elements, unless that gives fewer chunks
// than `max_grid` (the blocks that can be resident at once): then the chunk is halved, down to
// kMinChunkSize, so that a mid-size step still spreads over every SM (2**20 elements in
// 16,384-element chunks are 64 blocks for the H100's 132 SMs; in 2,048-element chunks, 512).
// A power of two of at least 2,048 elements keeps every chunk of an aligned tensor aligned.
inline int64_t chunk_size_for(int64_t total_numel, int max_grid) {
  int64_t chunk = kChunkSize;
  while (chunk > kMinChunkSize && (total_numel + chunk - 1) / chunk < max_grid) chunk /= 2;
  return chunk;
}

template <int kDepth>
struct TensorListMeta {
  // Per tensor: kDepth addresses, the size, the first chunk (one extra entry at the end), a tag.
  static constexpr int kMaxTensors = (kMetaBytes - 32) / (kDepth * 8 + 8 + 8 + 1);
  void* addresses[kDepth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t chunk_start[kMaxTensors + 1];
  int64_t chunk_size;   // elements per chunk ([note: chunk size])
  int32_t ntensors;     // tensors in the tables (the non-empty ones)
  int32_t first_param;  // index in the call's lists of the first parameter this launch covers
  int32_t num_params;   // parameters this launch covers, empty ones included
  uint8_t tag[kMaxTensors];

  __host__ __device__ bool aligned(int t) const { return (tag[t] & kTagAligned) != 0; }
  __host__ __device__ int dtype(int t) const { return tag[t] >> kTagDtypeShift; }
  __host__ __device__ int64_t num_chunks() const { return chunk_start[ntensors]; }
};

// Calls f(t, begin, end) for every chunk of the table that this block owns (chunks
// blockIdx.x, blockIdx.x + gridDim.x, ...): elements [begin, end) of table tensor t. The loop
// is uniform across the block.
template <int kDepth, typename F>
__device__ __forceinline__ void for_each_chunk(const TensorListMeta<kDepth>& meta, F&& f) {
  const int64_t nchunks = meta.num_chunks();
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int lo = 0, hi = meta.ntensors - 1;  // the last tensor whose first chunk is <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (meta.chunk_start[mid] <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t begin = (c - meta.chunk_start[lo]) * meta.chunk_size;
    const int64_t end =
        begin + meta.chunk_size < meta.numel[lo] ? begin + meta.chunk_size : meta.numel[lo];
    f(lo, begin, end);
  }
}

// The kernel of every launch: the table lives in the parameter space (__grid_constant__: no
// per-thread copy however it is indexed) and the functor does the work.
template <int kDepth, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(const __grid_constant__ TensorListMeta<kDepth> meta,
                        const Functor functor) {
  functor(meta);
}

// The grid of a launch of `multi_tensor_kernel<kDepth, Functor>` on `device`: as many blocks
// as can be resident at once (SMs x the occupancy of that kernel at kBlockSize threads), so
// every block starts at once and walks its share of the chunks; fewer when there are fewer
// chunks. Cached per kernel and device; safe during CUDA graph capture (no stream work).
template <int kDepth, typename Functor>
int resident_grid(int device) {
  static std::atomic<int> cache[64];
  std::atomic<int>* slot = device >= 0 && device < 64 ? &cache[device] : nullptr;
  int grid = slot != nullptr ? slot->load(std::memory_order_relaxed) : 0;
  if (grid == 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, multi_tensor_kernel<kDepth, Functor>, kBlockSize, 0));
    grid = std::max(1, sms) * std::max(1, per_sm);
    if (slot != nullptr) slot->store(grid, std::memory_order_relaxed);
  }
  return grid;
}

// Packs the tensors of `lists` (all on `device`) into tables and calls
// launch(meta, last, grid) once per table: a table is launched when it is full (with
// last = false) and the remaining one at the end (last = true). Empty tensors take no table
// entry but are covered by a table's [first_param, first_param + num_params) range. When no
// tensor has an element, the last (empty) table is launched only if `launch_empty` (the
// functor has bookkeeping to do); its grid is then one block. Grids are at most `max_grid`.
template <int kDepth, typename Launch>
void pack_tensor_lists(const std::array<at::TensorList, kDepth>& lists, int max_grid,
                       bool launch_empty, Launch&& launch) {
  using Meta = TensorListMeta<kDepth>;
  static_assert(sizeof(Meta) <= kMetaBytes, "TensorListMeta outgrew its share of the arguments");
  const at::TensorList& first = lists[0];
  const int32_t n = static_cast<int32_t>(first.size());
  int64_t total = 0;
  for (int32_t t = 0; t < n; ++t) total += first[t].numel();
  const int64_t chunk = chunk_size_for(total, max_grid);

  Meta meta;
  meta.chunk_size = chunk;
  auto reset = [&](int32_t first_param) {
    meta.ntensors = 0;
    meta.chunk_start[0] = 0;
    meta.first_param = first_param;
    meta.num_params = 0;
  };
  auto emit = [&](int32_t end_param, bool last) {
    meta.num_params = end_param - meta.first_param;
    const int64_t nchunks = meta.num_chunks();
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nchunks, max_grid)));
    launch(static_cast<const Meta&>(meta), last, grid);
  };
  reset(0);
  for (int32_t t = 0; t < n; ++t) {
    const int64_t numel = first[t].numel();
    if (numel == 0) continue;
    if (meta.ntensors == Meta::kMaxTensors) {  // full: launch it, start the next table here
      emit(t, false);
      reset(t);
    }
    const int k = meta.ntensors;
    bool aligned = true;
    for (int d = 0; d < kDepth; ++d) {
      void* ptr = lists[d][t].data_ptr();
      meta.addresses[d][k] = ptr;
      aligned = aligned && reinterpret_cast<uintptr_t>(ptr) % kVectorBytes == 0;
    }
    meta.tag[k] = static_cast<uint8_t>((aligned ? kTagAligned : 0) |
                                       (dtype_code(first[t].scalar_type()) << kTagDtypeShift));
    meta.numel[k] = numel;
    meta.chunk_start[k + 1] = meta.chunk_start[k] + (numel + chunk - 1) / chunk;
    meta.ntensors = k + 1;
  }
  if (meta.ntensors > 0 || launch_empty) emit(n, true);
}

}  // namespace cuda
}  // namespace emcl
