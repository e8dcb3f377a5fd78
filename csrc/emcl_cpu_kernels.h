// The CPU kernels, included three times: by emcl_cpu.cpp with torch's portable at::vec (any
// CPU), by emcl_cpu_avx2.cpp compiled for AVX2+FMA, where at::vec uses AVX2 intrinsics, and by
// emcl_cpu_avx512.cpp compiled for AVX-512, where at::vec uses AVX-512 intrinsics.
// EMCL_CPU_NS names the namespace of each copy; emcl_cpu.cpp picks one at run time and does the
// host-side part of a call (checks, counters, steps) itself.
//
// Each copy has two passes over tensor lists:
// - any_nonfinite(grads): the read-only finite check (any parameter dtype per tensor);
// - update(...): the step of SPEC section 2 for a resolved op (kInner, kMeta, kInnerMeta);
// and, for the benchmarks only, stream_probe(...): the memory roof's probes
// ([note: stream probes] at the end of this file).
// A pass sees the call's tensors as one flat index space (tensor k holds elements
// [offsets[k], offsets[k + 1])) cut into pieces of at most kPiece elements, which torch's
// intra-op threads take in one at::parallel_for: thread t starts with piece t, then each claims
// the next unclaimed piece ([note: pieces]; many small tensors parallelize as well as one big
// one, and a thread that the machine slows down leaves its share to the others); a call with
// fewer than kGrain elements runs on the calling thread. Pieces start at multiples of kAlign
// elements. Every element's result depends only
// on its own inputs, computed by the same vector instructions whichever thread and lane does
// it: the results are bitwise the same at any thread count. Parameters in bf16/fp16 are widened
// to fp32 vectors, updated in fp32 and rounded once on store; fp32 and fp64 parameters are
// updated in their own precision.
#pragma once
#ifndef EMCL_CPU_NS
#error "define EMCL_CPU_NS before including emcl_cpu_kernels.h"
#endif

#define EMCL_MATH_AT_VEC
#include "emcl_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "emcl_ops.h"

namespace emcl {
namespace EMCL_CPU_NS {

// The entry points of this copy (see the top of this file). For an array of `runs` runs
// ([note: runs] in emcl_kernels/interface.py): runs_nonfinite sets found[r] = 1 when run r's
// elements of the gradients hold an inf or a NaN; update reads `hyper` as `runs` rows of
// hyper::kCount values and leaves run r alone where skip[r] != 0 (`skip` may be null for
// runs == 1). See [note: runs on the CPU].
bool any_nonfinite(at::TensorList grads);
void runs_nonfinite(at::TensorList grads, int64_t runs, uint8_t* found);
void update(const Lists& lists, Op which, bool prox, Importance importance, LrMode lr_mode,
            const double* hyper, const float* grad_scale, int64_t runs, const uint8_t* skip);
void stream_probe(float* a, const float* b, float* c, float* d, int64_t n, StreamProbe kind);
void stream_probe_bf16(at::BFloat16* a, const at::BFloat16* b, float* c, float* d, int64_t n,
                      bool step);

namespace {

// A call with fewer elements runs on one thread.
// Measured on the 2-core test machine (one fp32 inner+meta step with the check, one tensor,
// medians of 300 interleaved calls, load 1.0): 2 threads over 1 took 0.68x of the time at
// 89,610 elements (the MLP 784-100-100-10; 97 -> 66 us), 0.59x at 300,000, 0.50x at 2**20.
// Only with OpenMP: without it at::parallel_for never splits anything (see [note: OpenMP] in
// setup.py).
constexpr int64_t kGrain = 65536;
// [note: pieces] The index space is cut into pieces of kPiece elements (fewer for small calls:
// at least kMinPiecesPerThread per thread), handed out by an atomic counter. The split was one
// equal contiguous share per thread (at::parallel_for's static split): on the shared 2-core
// test machine one of two threads usually shares its core with another job, and the step then
// waited for the slowed thread's whole half, so 2 threads took as long as 1 (GPT-2 fp32, no
// check: 111 ms at 2 threads against 108 at 1), while a piece at a time lets the
// unslowed thread take most of the work. One fp32 piece is 256 KiB per stream: a claim (one
// atomic add) per 1.8 MB moved, and the prefetch ramps up again once per piece.
constexpr int64_t kPiece = 65536;
constexpr int64_t kMinPiecesPerThread = 4;
constexpr int64_t kAlign = 64;           // pieces start at multiples of this
constexpr int64_t kCheckBlock = 1 << 20;  // the finite check looks for an early exit this often

// The call's tensors as one index space: offsets[k] is the first flat index of tensor k and
// offsets[count] the total. Kept in a buffer reused by every call of this thread (no allocation
// once it has grown).
template <typename NumelOf>
const std::vector<int64_t>& flat_offsets(size_t count, NumelOf numel_of) {
  thread_local std::vector<int64_t> offsets;
  offsets.resize(count + 1);
  int64_t total = 0;
  for (size_t k = 0; k < count; ++k) {
    offsets[k] = total;
    total += numel_of(k);
  }
  offsets[count] = total;
  return offsets;
}

// Calls body(k, begin, end) for elements [begin, end) of tensor k, over every element of the
// index space, in pieces shared by the threads for big calls (see the top of this file and
// [note: pieces]).
template <typename Body>
void for_each_range(const std::vector<int64_t>& offsets, const Body& body) {
  const int64_t total = offsets.back();
  g_cpu_threads_mask.store(0, std::memory_order_relaxed);
  if (total == 0) return;
  // elements [begin, end) of the index space, tensor by tensor
  auto run = [&](int64_t begin, int64_t end) {
    // the tensor holding `begin` (the last k with offsets[k] <= begin; empty tensors skipped)
    size_t k = static_cast<size_t>(
        std::upper_bound(offsets.begin(), offsets.end() - 1, begin) - offsets.begin() - 1);
    while (begin < end) {
      const int64_t stop = std::min(end, offsets[k + 1]);
      if (stop > begin) body(k, begin - offsets[k], stop - offsets[k]);
      begin = std::max(begin, stop);
      ++k;
    }
  };
  const int64_t threads = total < kGrain ? 1 : at::get_num_threads();
  if (threads <= 1) {
    g_cpu_threads_mask.fetch_or(uint64_t{1} << std::min(at::get_thread_num(), 63),
                                std::memory_order_relaxed);
    run(0, total);
    return;
  }
  const int64_t piece = std::max(
      kAlign, std::min(kPiece, total / (threads * kMinPiecesPerThread) / kAlign * kAlign));
  const int64_t pieces = (total + piece - 1) / piece;
  std::atomic<int64_t> next{threads};  // pieces [0, threads) are the threads' first ones
  auto run_piece = [&](int64_t p) { run(p * piece, std::min(total, (p + 1) * piece)); };
  // One index per thread: at::parallel_for gives thread t the range [t, t + 1).
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    const int tid = std::min(at::get_thread_num(), 63);
    g_cpu_threads_mask.fetch_or(uint64_t{1} << tid, std::memory_order_relaxed);
    for (int64_t p = first; p < std::min(last, pieces); ++p) run_piece(p);
    for (int64_t p = next.fetch_add(1, std::memory_order_relaxed); p < pieces;
         p = next.fetch_add(1, std::memory_order_relaxed)) {
      run_piece(p);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Reading ahead. One core of the 2-core AMD EPYC (Zen 3) test machine fetches from DRAM at
// about 10-15 GB/s on read-only streams and about 17-22 GB/s on the update's four read streams
// when it relies on the hardware prefetcher alone: a core keeps only so many cache-line misses
// in flight. A software prefetch a fixed distance ahead of every stream lets it keep more.
// Tuning measurements (2**26 elements, one thread, medians of 7 interleaved runs, the machine
// shared with other jobs): a stand-alone AVX2 copy of the fp32 update ran at 17-18 GB/s
// without and 19.5-22 GB/s with a prefetch 512-2048 bytes ahead (4096 was worse; non-temporal
// stores were 2.5x slower); in this kernel the fp32 inner+meta update went from 104-144 ms to
// 78-98 ms (Adam fused 87-122 ms in the same processes) and the bf16 one from 98-133 to
// 74-112 ms. The prefetch is a hint: it never faults, and past the end of a range it is not
// issued.
// Measured against Adam fused in the same processes (its kernel has no
// software prefetch), with the prefetch knobs below, GPT-2-124M fp32, processes alternating,
// medians of 5 interleaved steps, load 1.5-2.7: at one thread the update with the prefetch
// 1 KiB ahead took 1.21-1.24x Adam fused's time (no check; 1.38-1.46x with the check), without
// any software prefetch 1.05-1.06x (1.18-1.33x); at two threads 140-154 ms with, 112 ms without;
// ResNet-18 fp32 at one thread 1.18x with, 1.05x without. The update's four read streams are
// better left to the hardware prefetcher: the default is no software prefetch.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kPrefetchBytes = 0;  // how far ahead of the update's streams (default: none)
constexpr int64_t kProbePrefetchBytes = 1024;  // the roof's prefetching probes, always
constexpr int64_t kCheckPrefetchBytes = 512;  // how far ahead of the check's streams

// [note: prefetch knobs] For measuring, read once per process: EMCL_CPU_PREFETCH_BYTES, how far
// ahead of the update's streams the software prefetch reads (0, the default: no software
// prefetch, the hardware prefetcher alone, as torch's kernels run), and
// EMCL_CPU_PREFETCH_WRITE=1, prefetch the streams the update writes for writing (prefetchw: the
// line arrives owned; the roof's probes take this one too, and always prefetch 1 KiB ahead).
struct PrefetchPlan {
  int64_t bytes;
  bool write;
};
inline const PrefetchPlan& prefetch_plan() {
  static const PrefetchPlan plan = [] {
    PrefetchPlan p{kPrefetchBytes, false};
    if (const char* env = std::getenv("EMCL_CPU_PREFETCH_BYTES")) p.bytes = std::atoll(env);
    if (const char* env = std::getenv("EMCL_CPU_PREFETCH_WRITE")) p.write = std::atoi(env) != 0;
    p.bytes = std::max<int64_t>(0, p.bytes);
    return p;
  }();
  return plan;
}
constexpr int kCheckStreams = 8;  // a check range is read as this many interleaved streams

template <typename T>
inline void prefetch(const T* ptr) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(static_cast<const void*>(ptr), 0 /* read */, 3 /* keep in all levels */);
#else
  (void)ptr;
#endif
}

template <typename T>
inline void prefetch_for_write(const T* ptr) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(static_cast<const void*>(ptr), 1 /* write */, 3);
#else
  (void)ptr;
#endif
}

// Prefetches the element `ahead` elements after element i of x, when it is before `end`.
template <typename T>
inline void prefetch_ahead(const T* x, int64_t i, int64_t ahead, int64_t end) {
  if (i + ahead < end) prefetch(x + i + ahead);
}

// The same for a stream the update writes: for writing when `write`.
template <typename T>
inline void prefetch_ahead(const T* x, int64_t i, int64_t ahead, int64_t end, bool write) {
  if (i + ahead < end) {
    if (write) {
      prefetch_for_write(x + i + ahead);
    } else {
      prefetch(x + i + ahead);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The finite check. fp32/fp64: x − x is 0 for a finite x and NaN for ±inf and NaN, and a sum of
// zeros stays 0 until it meets a NaN, so two vector ops per vector decide a range.
// bf16/fp16: an element is inf or NaN exactly when all its exponent bits are set, tested on the
// raw 16-bit words (and, compare, or): widening to fp32 first made the reduced check
// compute-bound (2**26 bf16: 11-15 ms before, 8-11 ms after). A range is read as
// kCheckStreams interleaved streams (its equal parts) with a prefetch ahead of each: on the
// stand-alone copy one stream ran at 8-9 GB/s, four at 11-13, eight with the prefetch at
// 14-15; in this kernel the fp32 check stayed at 16-23 ms for 2**26 elements, within the
// machine's noise of the four-stream version. Every bad value is found wherever it sits
// (tests/test_cpu_backend.py, test_check_finite_finds_one_bad_value_anywhere).
// ---------------------------------------------------------------------------------------------
template <typename T>
bool lanes_nonzero(const at::vec::Vectorized<T>& acc) {
  alignas(64) T lanes[at::vec::Vectorized<T>::size()];
  acc.store(lanes);
  for (int64_t j = 0; j < at::vec::Vectorized<T>::size(); ++j) {
    if (lanes[j] != T(0)) return true;  // NaN != 0 too
  }
  return false;
}

// What the check reads a scalar_t as: itself for fp32/fp64, its raw bits for bf16/fp16; the
// mask of the bits that are all set in an inf or a NaN (reduced types only).
template <typename scalar_t>
struct CheckWord {
  using type = scalar_t;
};
template <>
struct CheckWord<at::BFloat16> {
  using type = int16_t;
  static constexpr int16_t kExponent = 0x7F80;
};
template <>
struct CheckWord<at::Half> {
  using type = int16_t;
  static constexpr int16_t kExponent = 0x7C00;
};

template <typename scalar_t>
bool range_nonfinite(const scalar_t* data, int64_t n) {
  using word_t = typename CheckWord<scalar_t>::type;
  using Vec = at::vec::Vectorized<word_t>;
  constexpr bool kBits = !std::is_same_v<word_t, scalar_t>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t S = kCheckStreams;
  constexpr int64_t kAhead = kCheckPrefetchBytes / sizeof(word_t);
  constexpr int64_t kLine = 64 / sizeof(word_t);  // elements per cache line
  const auto* x = reinterpret_cast<const word_t*>(data);
  const int64_t q = n / (S * W) * W;  // elements per stream
  Vec acc[S];
  for (int64_t s = 0; s < S; ++s) acc[s] = Vec(word_t(0));
  [[maybe_unused]] Vec mask(word_t(0));
  if constexpr (kBits) mask = Vec(CheckWord<scalar_t>::kExponent);
  for (int64_t i = 0; i < q; i += W) {
    for (int64_t s = 0; s < S; ++s) {
      const word_t* xs = x + s * q;
      if (i % kLine == 0) prefetch_ahead(xs, i, kAhead, q);
      const Vec v = Vec::loadu(xs + i);
      if constexpr (kBits) {
        acc[s] = acc[s] | ((v & mask) == mask);  // all-ones lanes where the exponent is full
      } else {
        acc[s] = acc[s] + (v - v);
      }
    }
  }
  for (int64_t i = S * q; i < n; ++i) {
    if (!std::isfinite(static_cast<at::opmath_type<scalar_t>>(data[i]))) return true;
  }
  Vec total = acc[0];
  for (int64_t s = 1; s < S; ++s) total = kBits ? (total | acc[s]) : (total + acc[s]);
  return lanes_nonzero(total);
}

// ---------------------------------------------------------------------------------------------
// The update.
// ---------------------------------------------------------------------------------------------

// The data pointers of one tensor's lists; `alpha` is null unless lr_mode is recurrent.
template <typename scalar_t, typename acc_t>
struct Pointers {
  scalar_t* param;
  const scalar_t* grad;
  acc_t* anchor;
  acc_t* importance;
  acc_t* alpha;
};

// Whole vectors take the fixed-size load/store; only a tensor's tail takes the counted one (a
// memcpy of variable size). Forced inline: GCC kept the bf16 load out of line, a call per
// vector in the update loop.
template <typename V>
EMCL_HD V load(const typename V::value_type* ptr, int64_t count) {
  return count == V::size() ? V::loadu(ptr) : V::loadu(ptr, count);
}

template <typename V>
EMCL_HD void store(const V& v, typename V::value_type* ptr, int64_t count) {
  if (count == V::size()) {
    v.store(ptr);
  } else {
    v.store(ptr, static_cast<int>(count));
  }
}

// [note: whole vectors] Each update below is a loop over whole vectors and at most one partial
// vector for the tail of a range. The per-vector body is one always-inlined function called with
// the element count: a literal Vec::size() in the loop, so that every count test of load/store
// folds away there (a counted load or store is a memcpy), and the count of the tail after it.

// One vector (n <= Vec::size() elements from i) of a tensor whose parameter dtype is its compute
// dtype (fp32, fp64): Vectorized<acc_t> loads, the math, stores of what the op writes.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename acc_t>
EMCL_HD void update_full_vector(const Pointers<acc_t, acc_t>& t, int64_t i, int64_t n,
                                const Hyper<at::vec::Vectorized<acc_t>>& hp) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  Vec theta = load<Vec>(t.param + i, n);
  Vec theta0 = load<Vec>(t.anchor + i, n);
  Vec h = load<Vec>(t.importance + i, n);
  Vec alpha = kAlpha ? load<Vec>(t.alpha + i, n) : Vec(acc_t(0));
  step<kOp, kProx, kImp, kLr>(theta, load<Vec>(t.grad + i, n), theta0, h, alpha, hp);
  store(theta, t.param + i, n);
  if constexpr (has_meta(kOp)) {
    store(theta0, t.anchor + i, n);
    store(h, t.importance + i, n);
    if constexpr (kAlpha) store(alpha, t.alpha + i, n);
  }
}

// Updates elements [begin, end) of one such tensor, prefetching ahead of every stream.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename acc_t>
void update_full(const Pointers<acc_t, acc_t>& ptrs, int64_t begin, int64_t end,
                 const Hyper<at::vec::Vectorized<acc_t>>& hyper) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t V = Vec::size();
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  // Local copies: the stores below go through acc_t pointers, which may alias the fields of a
  // struct the compiler cannot see the origin of, forcing a reload per vector (of the hyper
  // vectors, and of the five data pointers: objdump showed them reloaded per vector once this
  // function stopped being inlined into the pass's lambda; 5 of ~54 instructions per vector).
  const Hyper<Vec> hp = hyper;
  const Pointers<acc_t, acc_t> t = ptrs;
  // The plan read once into locals: a call to prefetch_plan() inside the loop (GCC kept it out
  // of line) spilled and reloaded every hyper vector around it, once per cache line.
  const int64_t ahead = prefetch_plan().bytes / static_cast<int64_t>(sizeof(acc_t));
  const bool wp = prefetch_plan().write;  // θ is written by every op
  const bool w = has_meta(kOp) && wp;     // the meta steps write θ₀, h (α)
  constexpr int64_t kLine = 64 / sizeof(acc_t);  // elements per cache line
  const int64_t whole_end = begin + (end - begin) / V * V;
  for (int64_t i = begin; i < whole_end; i += V) {
    if (ahead > 0 && (i - begin) % kLine == 0) {  // once per cache line of every stream
      prefetch_ahead(t.param, i, ahead, end, wp);
      prefetch_ahead(t.grad, i, ahead, end);
      prefetch_ahead(t.anchor, i, ahead, end, w);
      prefetch_ahead(t.importance, i, ahead, end, w);
      if constexpr (kAlpha) prefetch_ahead(t.alpha, i, ahead, end, w);
    }
    update_full_vector<kOp, kProx, kImp, kLr>(t, i, V, hp);
  }
  if (whole_end < end) update_full_vector<kOp, kProx, kImp, kLr>(t, whole_end, end - whole_end, hp);
}

// One vector of bf16/fp16 parameters (n <= bVec::size() elements from i): one
// Vectorized<scalar_t> of θ (and of g) holds two Vectorized<float> of state; θ and g are
// widened, the math runs in fp32, θ is rounded on store.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename scalar_t>
EMCL_HD void update_reduced_vector(const Pointers<scalar_t, float>& t, int64_t i, int64_t n,
                                   const Hyper<at::vec::Vectorized<float>>& hp) {
  using fVec = at::vec::Vectorized<float>;
  using bVec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t W = fVec::size();
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  static_assert(bVec::size() == 2 * W, "a reduced-precision vector holds two float vectors");
  const int64_t n0 = std::min(n, W), n1 = n - n0;
  auto [theta_lo, theta_hi] = at::vec::convert_to_float<scalar_t>(load<bVec>(t.param + i, n));
  auto [g_lo, g_hi] = at::vec::convert_to_float<scalar_t>(load<bVec>(t.grad + i, n));
  fVec a_lo = load<fVec>(t.anchor + i, n0);
  fVec h_lo = load<fVec>(t.importance + i, n0);
  fVec al_lo = kAlpha ? load<fVec>(t.alpha + i, n0) : fVec(0.f);
  step<kOp, kProx, kImp, kLr>(theta_lo, g_lo, a_lo, h_lo, al_lo, hp);
  fVec a_hi(0.f), h_hi(0.f), al_hi(0.f);
  if (n1 > 0) {
    a_hi = load<fVec>(t.anchor + i + W, n1);
    h_hi = load<fVec>(t.importance + i + W, n1);
    if constexpr (kAlpha) al_hi = load<fVec>(t.alpha + i + W, n1);
    step<kOp, kProx, kImp, kLr>(theta_hi, g_hi, a_hi, h_hi, al_hi, hp);
  }
  store(at::vec::convert_from_float<scalar_t>(theta_lo, theta_hi), t.param + i, n);
  if constexpr (has_meta(kOp)) {
    store(a_lo, t.anchor + i, n0);
    store(h_lo, t.importance + i, n0);
    if constexpr (kAlpha) store(al_lo, t.alpha + i, n0);
    if (n1 > 0) {
      store(a_hi, t.anchor + i + W, n1);
      store(h_hi, t.importance + i + W, n1);
      if constexpr (kAlpha) store(al_hi, t.alpha + i + W, n1);
    }
  }
}

// Updates elements [begin, end) of one tensor of bf16/fp16 parameters.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename scalar_t>
void update_reduced(const Pointers<scalar_t, float>& ptrs, int64_t begin, int64_t end,
                    const Hyper<at::vec::Vectorized<float>>& hyper) {
  using bVec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t V = bVec::size();
  constexpr bool kAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  const Hyper<at::vec::Vectorized<float>> hp = hyper;  // see update_full
  const Pointers<scalar_t, float> t = ptrs;
  // One vector of V elements reads V floats of θ₀ and h (and α) and V halves of θ and g: with
  // V = 16 (AVX2) a cache line of the first and half of one of the second, with V = 32
  // (AVX-512) two of the first and one of the second. A range may start anywhere in a line, so
  // the phase is counted from `begin`.
  // in elements, fp32 streams' bytes
  const int64_t ahead = prefetch_plan().bytes / static_cast<int64_t>(sizeof(float));
  const bool wp = prefetch_plan().write;  // see update_full
  const bool w = has_meta(kOp) && wp;
  constexpr int64_t kFloatLine = 64 / sizeof(float), kHalfLine = 64 / sizeof(scalar_t);
  const int64_t whole_end = begin + (end - begin) / V * V;
  for (int64_t i = begin; i < whole_end; i += V) {
    for (int64_t j = 0; j < V; j += kFloatLine) {  // every fp32 line this vector reads
      if (ahead > 0 && (i + j - begin) % kFloatLine == 0) {
        prefetch_ahead(t.anchor, i + j, ahead, end, w);
        prefetch_ahead(t.importance, i + j, ahead, end, w);
        if constexpr (kAlpha) prefetch_ahead(t.alpha, i + j, ahead, end, w);
      }
    }
    if (ahead > 0 && (i - begin) % kHalfLine == 0) {
      prefetch_ahead(t.param, i, ahead, end, wp);
      prefetch_ahead(t.grad, i, ahead, end);
    }
    update_reduced_vector<kOp, kProx, kImp, kLr>(t, i, V, hp);
  }
  if (whole_end < end) {
    update_reduced_vector<kOp, kProx, kImp, kLr>(t, whole_end, end - whole_end, hp);
  }
}

// [note: runs on the CPU] An array of runs is one pass like a single run's: the same index
// space, the same pieces and threads. Each range a thread takes is cut at the run boundaries of
// its tensor (run r owns elements [r * n, (r + 1) * n) of a tensor of runs * n elements), and
// each part is updated with its run's Hyper (one per run, made once per call) by the same
// per-element code, or left alone when its run skips. The result of an element depends only on
// its own inputs and its run's hyper-parameters, so run r's elements come out bitwise as in a
// call over run r's slices alone (tests/test_runs_kernels.py). runs == 1 takes the path it took
// before arrays existed: no cut, one Hyper.
template <Op kOp, bool kProx, Importance kImp, LrMode kLr, typename scalar_t>
void update_typed(const Lists& l, const double* raw, const float* grad_scale, int64_t runs,
                  const uint8_t* skip) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool kReadsAlpha = has_meta(kOp) && kLr == LrMode::kRecurrent;
  const bool scaled = grad_scale != nullptr;
  const acc_t scale = scaled ? static_cast<acc_t>(*grad_scale) : acc_t(1);

  const auto& offsets =
      flat_offsets(l.params.size(), [&](size_t k) { return l.params[k].numel(); });
  if (runs == 1) {  // the single run's pass, written out as before arrays existed
    const Hyper<Vec> hp = make_hyper<acc_t>(raw, scale, scaled).template as<Vec>();
    for_each_range(offsets, [&](size_t k, int64_t begin, int64_t end) {
      // data_ptr() once per range: a few loads from the TensorImpl.
      const Pointers<scalar_t, acc_t> ptrs{
          static_cast<scalar_t*>(l.params[k].data_ptr()),
          static_cast<const scalar_t*>(l.grads[k].data_ptr()),
          static_cast<acc_t*>(l.anchors[k].data_ptr()),
          static_cast<acc_t*>(l.importances[k].data_ptr()),
          kReadsAlpha ? static_cast<acc_t*>(l.meta_lrs[k].data_ptr()) : nullptr};
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        update_full<kOp, kProx, kImp, kLr>(ptrs, begin, end, hp);
      } else {
        update_reduced<kOp, kProx, kImp, kLr>(ptrs, begin, end, hp);
      }
    });
    return;
  }
  // Elements [begin, end) of tensor k with the hyper-parameters hp (an array's parts).
  auto update_range = [&](size_t k, int64_t begin, int64_t end, const Hyper<Vec>& hp) {
    const Pointers<scalar_t, acc_t> ptrs{
        static_cast<scalar_t*>(l.params[k].data_ptr()),
        static_cast<const scalar_t*>(l.grads[k].data_ptr()),
        static_cast<acc_t*>(l.anchors[k].data_ptr()),
        static_cast<acc_t*>(l.importances[k].data_ptr()),
        kReadsAlpha ? static_cast<acc_t*>(l.meta_lrs[k].data_ptr()) : nullptr};
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      update_full<kOp, kProx, kImp, kLr>(ptrs, begin, end, hp);
    } else {
      update_reduced<kOp, kProx, kImp, kLr>(ptrs, begin, end, hp);
    }
  };
  // Run r's hyper-parameters, from row r of `hyper`, kept as scalars and broadcast into vectors
  // per part of a range, on the stack: a std::vector of Hyper<Vec> is not allocated at the
  // alignment of AVX-512 vectors here (the aligned copy in update_full faulted).
  std::vector<Hyper<acc_t>> hps;
  hps.reserve(static_cast<size_t>(runs));
  for (int64_t r = 0; r < runs; ++r) {
    hps.push_back(make_hyper<acc_t>(raw + r * hyper::kCount, scale, scaled));
  }
  for_each_range(offsets, [&](size_t k, int64_t begin, int64_t end) {
    const int64_t n = l.params[k].numel() / runs;  // > 0: the range is not empty
    for (int64_t r = begin / n; begin < end; ++r) {
      const int64_t stop = std::min(end, (r + 1) * n);
      if (skip == nullptr || skip[r] == 0) {
        const Hyper<Vec> hp = hps[r].template as<Vec>();
        update_range(k, begin, stop, hp);
      }
      begin = stop;
    }
  });
}

}  // namespace

bool any_nonfinite(at::TensorList grads) {
  const auto& offsets = flat_offsets(grads.size(), [&](size_t k) { return grads[k].numel(); });
  std::atomic<bool> found{false};
  for_each_range(offsets, [&](size_t k, int64_t begin, int64_t end) {
    const at::Tensor& g = grads[k];
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "emcl_check",
                                    [&] {
      const auto* x = static_cast<const scalar_t*>(g.data_ptr());
      for (int64_t b = begin; b < end; b += kCheckBlock) {
        if (found.load(std::memory_order_relaxed)) return;  // the answer is known
        if (range_nonfinite(x + b, std::min(kCheckBlock, end - b))) {
          found.store(true, std::memory_order_relaxed);
          return;
        }
      }
    });
  });
  return found.load();
}

// The check of an array of runs: the same pass, each range cut at its tensor's run boundaries
// ([note: runs on the CPU]); a run already found bad is not read further.
void runs_nonfinite(at::TensorList grads, int64_t runs, uint8_t* found_out) {
  const auto& offsets = flat_offsets(grads.size(), [&](size_t k) { return grads[k].numel(); });
  std::unique_ptr<std::atomic<bool>[]> found(new std::atomic<bool>[static_cast<size_t>(runs)]);
  for (int64_t r = 0; r < runs; ++r) found[r].store(false, std::memory_order_relaxed);
  for_each_range(offsets, [&](size_t k, int64_t begin, int64_t end) {
    const at::Tensor& g = grads[k];
    const int64_t n = g.numel() / runs;  // > 0: the range is not empty
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "emcl_check",
                                    [&] {
      const auto* x = static_cast<const scalar_t*>(g.data_ptr());
      for (int64_t r = begin / n; begin < end; ++r) {
        const int64_t stop = std::min(end, (r + 1) * n);
        for (int64_t b = begin; b < stop; b += kCheckBlock) {
          if (found[r].load(std::memory_order_relaxed)) break;  // this run is known bad
          if (range_nonfinite(x + b, std::min(kCheckBlock, stop - b))) {
            found[r].store(true, std::memory_order_relaxed);
            break;
          }
        }
        begin = stop;
      }
    });
  });
  for (int64_t r = 0; r < runs; ++r) {
    if (found[r].load(std::memory_order_relaxed)) found_out[r] = 1;
  }
}

void update(const Lists& l, Op which, bool prox, Importance importance, LrMode lr_mode,
            const double* hyper, const float* grad_scale, int64_t runs, const uint8_t* skip) {
  if (l.params.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, l.params[0].scalar_type(), "emcl_cpu", [&] {
        dispatch_op(which, [&](auto op) {
          constexpr Op kOp = decltype(op)::value;
          dispatch_modes_of<kOp>(prox, importance, lr_mode, [&](auto p, auto imp, auto lr) {
            update_typed<kOp, decltype(p)::value, decltype(imp)::value, decltype(lr)::value,
                         scalar_t>(l, hyper, grad_scale, runs, skip);
          });
        });
      });
}

// [note: stream probes] The benchmarks' memory roof (benchmarks/common.py) must bound every
// kernel that streams from memory. torch's own streaming ops (copy_, mul_, add_) read one or two
// streams and rely on the hardware prefetcher: on the 2-core test machine the update above, which
// reads four streams with a software prefetch, streamed 2-9 % faster than the best of them at one
// thread and up to 23 % faster at two (fastest repeats), i.e. "above the roof": one core keeps
// more cache-line fetches in flight over more streams. These probes are streaming kernels
// written the way the update is (same vectors, same thread split), so that the roof includes
// what such a reading pattern gets from memory. fp32, contiguous, n elements each:
// - with a software prefetch 1 KiB ahead: kScaleInplace a <- a·1 (8 B per element),
//   kAxpyInplace a <- a + s·b (12 B), kUpdatePattern the update's pattern without its math:
//   reads a, b, c, d, writes a <- a + s·b, c <- c + s·b, d <- d·1 (28 B, as the fp32 inner+meta
//   step);
// - without one, as the update runs: kStepPattern the same pattern as kUpdatePattern (θ, g, θ₀,
//   h read; θ, θ₀, h written: 28 B, the streams of the fp32 inner+meta step and of fp32 Adam);
//   kInnerPattern the inner step's pattern without its math:
//   reads a, b, c, d (θ, g, θ₀, h), writes a <- a + s·(b + c·d) (20 B, as the fp32 inner step);
//   kReadPattern its reads alone: reads a, b, c, d, writes nothing (16 B), the least time any
//   kernel that must read θ, g, θ₀ and h can take (a is written only if the sum of everything it
//   read is exactly -1, which keeps the reads from being optimised away and never happens for
//   the benchmarks' inputs in [0, 1)).
void stream_probe(float* a, const float* b, float* c, float* d, int64_t n, StreamProbe kind) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  const bool inner = kind == StreamProbe::kInnerPattern;
  if (inner || kind == StreamProbe::kReadPattern) {
    const Vec alpha(1e-6f);
    const auto& offsets = flat_offsets(1, [&](size_t) { return n; });
    for_each_range(offsets, [&](size_t, int64_t begin, int64_t end) {
      const int64_t whole_end = begin + (end - begin) / V * V;
      Vec acc0(0.0f), acc1(0.0f);
      for (int64_t i = begin; i < whole_end; i += V) {
        const Vec x = Vec::loadu(a + i), y = Vec::loadu(b + i);
        const Vec z = Vec::loadu(c + i), w = Vec::loadu(d + i);
        if (inner) {
          (x + alpha * (y + z * w)).store(a + i);
        } else {
          acc0 = acc0 + (x + y);
          acc1 = acc1 + (z + w);
        }
      }
      float sum = 0.0f;
      for (int64_t i = whole_end; i < end; ++i) {
        if (inner) {
          a[i] = a[i] + 1e-6f * (b[i] + c[i] * d[i]);
        } else {
          sum += (a[i] + b[i]) + (c[i] + d[i]);
        }
      }
      if (!inner) {
        alignas(64) float lanes[V];
        (acc0 + acc1).store(lanes);
        for (int64_t j = 0; j < V; ++j) sum += lanes[j];
        if (sum == -1.0f && begin < end) a[begin] = sum;
      }
    });
    return;
  }
  const bool four = kind == StreamProbe::kUpdatePattern || kind == StreamProbe::kStepPattern;
  const int64_t ahead = kind == StreamProbe::kStepPattern
                            ? 0
                            : kProbePrefetchBytes / static_cast<int64_t>(sizeof(float));
  const bool w = prefetch_plan().write;
  constexpr int64_t kLine = 64 / sizeof(float);
  const Vec one(1.0f), alpha(1e-6f);
  const bool reads_b = kind != StreamProbe::kScaleInplace;
  const auto& offsets = flat_offsets(1, [&](size_t) { return n; });
  for_each_range(offsets, [&](size_t, int64_t begin, int64_t end) {
    const int64_t whole_end = begin + (end - begin) / V * V;
    for (int64_t i = begin; i < whole_end; i += V) {
      if (ahead > 0 && (i - begin) % kLine == 0) {
        prefetch_ahead(a, i, ahead, end, w);
        if (reads_b) prefetch_ahead(b, i, ahead, end);
        if (four) {
          prefetch_ahead(c, i, ahead, end, w);
          prefetch_ahead(d, i, ahead, end, w);
        }
      }
      const Vec x = Vec::loadu(a + i);
      if (kind == StreamProbe::kScaleInplace) {
        (x * one).store(a + i);
        continue;
      }
      const Vec y = alpha * Vec::loadu(b + i);
      (x + y).store(a + i);
      if (four) {
        (Vec::loadu(c + i) + y).store(c + i);
        (Vec::loadu(d + i) * one).store(d + i);
      }
    }
    for (int64_t i = whole_end; i < end; ++i) {
      if (kind == StreamProbe::kScaleInplace) {
        a[i] = a[i] * 1.0f;
        continue;
      }
      const float y = 1e-6f * b[i];
      a[i] = a[i] + y;
      if (four) {
        c[i] = c[i] + y;
        d[i] = d[i] * 1.0f;
      }
    }
  });
}

// kStepPatternBf16 / kInnerPatternBf16: the bf16 steps' streams without their math, no software
// prefetch, read the way update_reduced reads them (one vector of bf16 θ and g widened to two
// fp32 vectors beside two of θ₀ and h): reads a, b (bf16: θ, g), c, d (fp32: θ₀, h); the step's
// pattern writes a <- a + s·b (rounded to bf16), c <- c + s·b, d <- d·1 (22 B per element, as
// the bf16 inner+meta step), the inner step's a <- a + s·(b + c·d) alone (14 B).
void stream_probe_bf16(at::BFloat16* a, const at::BFloat16* b, float* c, float* d, int64_t n,
                       bool step) {
  using fVec = at::vec::Vectorized<float>;
  using bVec = at::vec::Vectorized<at::BFloat16>;
  constexpr int64_t W = fVec::size(), V = bVec::size();
  const fVec one(1.0f), alpha(1e-6f);
  const auto& offsets = flat_offsets(1, [&](size_t) { return n; });
  for_each_range(offsets, [&](size_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += V) {
      const int64_t m = std::min(V, end - i), m0 = std::min(m, W), m1 = m - m0;
      auto [x_lo, x_hi] = at::vec::convert_to_float<at::BFloat16>(load<bVec>(a + i, m));
      auto [y_lo, y_hi] = at::vec::convert_to_float<at::BFloat16>(load<bVec>(b + i, m));
      fVec z_lo = load<fVec>(c + i, m0), w_lo = load<fVec>(d + i, m0);
      fVec z_hi(0.f), w_hi(0.f);
      if (m1 > 0) {
        z_hi = load<fVec>(c + i + W, m1);
        w_hi = load<fVec>(d + i + W, m1);
      }
      if (step) {
        y_lo = alpha * y_lo;
        y_hi = alpha * y_hi;
        store(at::vec::convert_from_float<at::BFloat16>(x_lo + y_lo, x_hi + y_hi), a + i, m);
        store(z_lo + y_lo, c + i, m0);
        store(w_lo * one, d + i, m0);
        if (m1 > 0) {
          store(z_hi + y_hi, c + i + W, m1);
          store(w_hi * one, d + i + W, m1);
        }
      } else {
        store(at::vec::convert_from_float<at::BFloat16>(x_lo + alpha * (y_lo + z_lo * w_lo),
                                                        x_hi + alpha * (y_hi + z_hi * w_hi)),
              a + i, m);
      }
    }
  });
}

}  // namespace EMCL_CPU_NS
}  // namespace emcl
