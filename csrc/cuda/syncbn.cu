// CUDA kernels of the syncbn_lab ops (schemas in ../syncbn.cpp, CPU twins in ../syncbn_cpu.cpp).
//
// Every launch goes on the current stream (c10::cuda::getCurrentCUDAStream(), the function
// at::cuda::getCurrentCUDAStream names). Reductions run in two stages:
//   1. a grid of blocks, each reducing a chunk of one (slice, channel-block) with per-thread
//      Welford over groups of values (or plain sums), merged with warp shuffles and then
//      across the block's warps through shared memory, writes partials (slices, chunks, W);
//   2. a small kernel merges the chunks (Chan's count-weighted formula, or sums).
// Loop shapes, as on the CPU (see syncbn.h for the layouts):
//   planes: ChannelsFirst with S >= kPlaneMin; grid (chunks, C, slices), a 2-D block walks
//           samples (y) and the contiguous spatial plane (x).
//   rows:   ChannelsLast rows of W = C values, or ChannelsFirst rows of W = C * S values with a
//           small S; grid (W / tx, chunks, slices), threads of a warp read consecutive columns.
// Welford runs on x - pivot, the pivot being the first value of the channel in the slice, so
// the running means stay near zero where float32 resolves the spread (mean 1e4, std 0.1).
// Elementwise kernels are grid-stride loops with 16-byte vector loads where alignment allows.
// The forward's affine map is one explicit fma (rounded once), whatever nvcc contracts.
// ATen/cuda/CUDAContext.h is avoided on purpose: it includes the cuBLAS/cuSPARSE headers,
// which a bare CUDA toolkit (nvcc + cudart only) lacks.
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../syncbn.h"

namespace syncbn_lab {
namespace {

using at::Tensor;

constexpr int kThreads = 256;  // threads per block, a multiple of the warp size
constexpr int kWarp = 32;
constexpr int kWarps = kThreads / kWarp;
constexpr int64_t kPlaneMin = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename A>
struct WelfordData {
  A n, mean, m2;
};

template <typename A>
__device__ __forceinline__ WelfordData<A> combine(const WelfordData<A>& a,
                                                  const WelfordData<A>& b) {
  if (b.n == A(0)) return a;
  if (a.n == A(0)) return b;
  const A n = a.n + b.n;
  const A delta = b.mean - a.mean;
  const A fb = b.n / n;
  return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.n * fb};
}

template <typename A>
__device__ __forceinline__ WelfordData<A> shfl_xor(const WelfordData<A>& v, int offset) {
  return {__shfl_xor_sync(kFullMask, v.n, offset), __shfl_xor_sync(kFullMask, v.mean, offset),
          __shfl_xor_sync(kFullMask, v.m2, offset)};
}

// The count, mean and M2 of G values in registers, in two passes over them (G is a power of
// two, so the scaling by 1 / G is exact). The stats kernels merge such groups into their
// running Welford state with combine(): one division per G values, where a Welford update
// per value divides once per value, a chain of dependent divisions that left those kernels
// compute-bound rather than bound by memory (the CPU kernels do the same per band of rows).
template <int G, typename A>
__device__ __forceinline__ WelfordData<A> group_stats(const A (&v)[G]) {
  static_assert((G & (G - 1)) == 0, "G must be a power of two");
  A sum = 0;
#pragma unroll
  for (int k = 0; k < G; ++k) sum += v[k];
  const A mean = sum * (A(1) / A(G));
  A m2 = 0;
#pragma unroll
  for (int k = 0; k < G; ++k) m2 += (v[k] - mean) * (v[k] - mean);
  return {A(G), mean, m2};
}

__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) {
  return __fma_rn(a, b, c);
}
__device__ __forceinline__ float sqrt_rn(float v) { return __fsqrt_rn(v); }
__device__ __forceinline__ double sqrt_rn(double v) { return __dsqrt_rn(v); }
__device__ __forceinline__ float abs_of(float v) { return fabsf(v); }
__device__ __forceinline__ double abs_of(double v) { return fabs(v); }

// (x - mean) * scale + shift, rounded once: the forward output.
template <typename A>
__device__ __forceinline__ A affine(A x, A mean, A scale, A shift) {
  return fma_rn(x - mean, scale, shift);
}

__device__ __forceinline__ int linear_tid() { return threadIdx.y * blockDim.x + threadIdx.x; }

// Reduces a value of every thread of the block (all for one target); the result is valid in
// thread 0. `shared` holds kWarps entries.
template <typename A>
__device__ WelfordData<A> block_welford(WelfordData<A> v, WelfordData<A>* shared) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = combine(v, shfl_xor(v, offset));
  const int tid = linear_tid(), lane = tid % kWarp, warp = tid / kWarp;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? shared[lane] : WelfordData<A>{A(0), A(0), A(0)};
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = combine(v, shfl_xor(v, offset));
  }
  return v;
}

template <typename A>
__device__ A block_sum(A v, A* shared) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  const int tid = linear_tid(), lane = tid % kWarp, warp = tid / kWarp;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? shared[lane] : A(0);
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
      v += __shfl_xor_sync(kFullMask, v, offset);
    }
  }
  return v;
}

// VEC consecutive values, loaded or stored as one 16-byte (or narrower) access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// ----------------------------------------------------------------------------------------
// Statistics
// ----------------------------------------------------------------------------------------
//
// The reductions are bound by the bytes each thread has in flight (one 4-byte load per
// thread kept them at 26-37 % of the H200's copy bandwidth), so every thread loads VEC
// consecutive values at once (16 bytes) wherever the row length and alignment allow, and
// several planes or rows at once (in_groups).

// Planes or rows a thread of the reductions loads at once: at most 16 values. The rows
// statistics kernel's __launch_bounds__ then holds it to 64 registers, so the 4 blocks of
// 256 threads per SM that reduce_plan sizes the grid for are resident at once (for 8-value
// vectors of the 16-bit types at the cost of a few bytes of spills; 4 such rows took 80
// registers).
constexpr int load_group(int vec) { return vec >= 8 ? 2 : 4; }

// Calls f(std::integral_constant<int, R>{}, i) on this thread's items i = first, first +
// step, ... below n: R items at a time while R remain (f loads them all before it uses
// any, so R loads are in flight per thread, not one), then one at a time.
template <int R, typename F>
__device__ __forceinline__ void in_groups(int64_t first, int64_t step, int64_t n, F&& f) {
  int64_t i = first;
  for (; i + (R - 1) * step < n; i += R * step) f(std::integral_constant<int, R>{}, i);
  for (; i < n; i += step) f(std::integral_constant<int, 1>{}, i);
}

// grid (chunks, C, slices); partials (slices, chunks, C). S % VEC == 0, planes aligned.
template <typename T, typename A, int VEC>
__global__ void stats_planes_kernel(const T* __restrict__ x, int64_t n, int64_t C, int64_t S,
                                    A* __restrict__ pn, A* __restrict__ pmean,
                                    A* __restrict__ pm2) {
  __shared__ WelfordData<A> shared[kWarps];
  const int64_t p = blockIdx.x, c = blockIdx.y, d = blockIdx.z;
  const int64_t chunks = gridDim.x;
  const A pivot = static_cast<A>(x[(d * n * C + c) * S]);  // first value of (d, c)
  WelfordData<A> w{A(0), A(0), A(0)};
  const int64_t step = chunks * blockDim.y;
  // R planes at a time; their values at one position make one Welford group.
  in_groups<load_group(VEC)>(p * blockDim.y + threadIdx.y, step, n, [&](auto r_c, int64_t i) {
    constexpr int R = decltype(r_c)::value;
    const Vec<T, VEC>* plane[R];
#pragma unroll
    for (int u = 0; u < R; ++u) {
      plane[u] = reinterpret_cast<const Vec<T, VEC>*>(x + ((d * n + i + u * step) * C + c) * S);
    }
    for (int64_t s = threadIdx.x; s < S / VEC; s += blockDim.x) {
      Vec<T, VEC> in[R];
#pragma unroll
      for (int u = 0; u < R; ++u) in[u] = plane[u][s];
      A v[R * VEC];
#pragma unroll
      for (int u = 0; u < R; ++u) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[u * VEC + k] = static_cast<A>(in[u].v[k]) - pivot;
      }
      w = combine(w, group_stats(v));
    }
  });
  w = block_welford(w, shared);
  if (linear_tid() == 0) {
    const int64_t j = (d * chunks + p) * C + c;
    pn[j] = w.n;
    pmean[j] = w.mean;
    pm2[j] = w.m2;
  }
}

// Cross-row reduction of a (tx, ty) block in which the threads of one column share
// threadIdx.x: warp shuffles over the lanes of a column, then the warps through shared
// memory. The results of column threadIdx.x are valid in the threads with linear id < tx.
template <typename A>
__device__ WelfordData<A> column_welford(WelfordData<A> v, WelfordData<A>* shared) {
  const int tx = blockDim.x;  // a power of two <= kWarp
  for (int offset = kWarp / 2; offset >= tx; offset >>= 1) v = combine(v, shfl_xor(v, offset));
  const int tid = linear_tid(), lane = tid % kWarp, warp = tid / kWarp;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane < tx) shared[warp * tx + lane] = v;
  __syncthreads();
  if (tid < tx) {
    v = shared[tid];
    for (int k = 1; k < kWarps; ++k) v = combine(v, shared[k * tx + tid]);
  }
  return v;
}

template <typename A>
__device__ A column_sum(A v, A* shared) {
  const int tx = blockDim.x;
  for (int offset = kWarp / 2; offset >= tx; offset >>= 1) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  const int tid = linear_tid(), lane = tid % kWarp, warp = tid / kWarp;
  __syncthreads();
  if (lane < tx) shared[warp * tx + lane] = v;
  __syncthreads();
  if (tid < tx) {
    v = shared[tid];
    for (int k = 1; k < kWarps; ++k) v += shared[k * tx + tid];
  }
  return v;
}

// grid (ceil(W / VEC / tx), chunks, slices); partials (slices, chunks, W). A thread reduces
// the VEC columns wv * VEC + k of its rows (W % VEC == 0, rows aligned); column w belongs
// to channel w / per.
template <typename T, typename A, int VEC>
__global__ void __launch_bounds__(kThreads, 4)
    stats_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t W, int64_t C,
                      A* __restrict__ pn, A* __restrict__ pmean, A* __restrict__ pm2) {
  __shared__ WelfordData<A> shared[kThreads];
  const int64_t wv = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t p = blockIdx.y, d = blockIdx.z, chunks = gridDim.y;
  const int64_t WV = W / VEC;
  WelfordData<A> acc[VEC];
  A pivot[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = WelfordData<A>{A(0), A(0), A(0)};
  if (wv < WV) {
    const int64_t per = W / C;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {  // the first value of (d, c) for each column's channel
      pivot[k] = static_cast<A>(x[d * rows * W + ((wv * VEC + k) / per) * per]);
    }
    const auto* __restrict__ base = reinterpret_cast<const Vec<T, VEC>*>(x + d * rows * W) + wv;
    // R rows at a time; each column merges its R values as one group.
    const int64_t step = chunks * blockDim.y;
    in_groups<load_group(VEC)>(p * blockDim.y + threadIdx.y, step, rows, [&](auto r_c, int64_t r) {
      constexpr int R = decltype(r_c)::value;
      Vec<T, VEC> in[R];
#pragma unroll
      for (int u = 0; u < R; ++u) in[u] = base[(r + u * step) * WV];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        A v[R];
#pragma unroll
        for (int u = 0; u < R; ++u) v[u] = static_cast<A>(in[u].v[k]) - pivot[k];
        acc[k] = combine(acc[k], group_stats(v));
      }
    });
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const WelfordData<A> col = column_welford(acc[k], shared);
    if (linear_tid() < static_cast<int>(blockDim.x) && wv < WV) {
      const int64_t j = (d * chunks + p) * W + wv * VEC + k;
      pn[j] = col.n;
      pmean[j] = col.mean;
      pm2[j] = col.m2;
    }
  }
}

// With `invstd` set, merge_kernel writes the variance m2 / count and 1 / sqrt(var + eps) (as
// the CPU kernels) instead of m2: the forward of batch_norm_train in one launch less than four.
template <typename A>
struct Finalize {
  A* invstd = nullptr;  // nullptr: write m2
  A count = 1;          // values per row, at least 1 (an empty row has variance 0)
  A eps = 0;
};

// The merges below give each output a group of `lanes` consecutive lanes of a warp (a power
// of two <= 32, at most the output's entry count): the lanes stride over the entries, then
// combine inside the group with shuffles. One thread per output merging hundreds of chunk
// partials in turn (channels_last input makes that many) took tens of microseconds.
struct MergeGroups {
  int64_t group, groups, rounds;  // this thread's group, all groups, rounds over the outputs
  int lane, lanes;

  __device__ MergeGroups(int64_t outputs, int lanes_) : lanes(lanes_) {
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    group = tid / lanes;
    lane = static_cast<int>(tid % lanes);
    groups = static_cast<int64_t>(gridDim.x) * blockDim.x / lanes;
    rounds = (outputs + groups - 1) / groups;  // the same for every lane: uniform shuffles
  }
};

int merge_lanes(int64_t entries) {
  int lanes = 1;
  while (lanes < kWarp && lanes < entries) lanes <<= 1;
  return lanes;
}

// Merges entries (b, p, c * per + v) over p < P and v < per into (b, c); the count of an
// entry is cnt[b * cb + p * cp + (c * per + v) * cw]. Entry means are relative to the pivot
// x[b * pivot_b + c * pivot_c] (none when x is null), added back at the end.
template <typename T, typename A>
__global__ void merge_kernel(const A* __restrict__ cnt, int64_t cb, int64_t cp, int64_t cw,
                             const A* __restrict__ mean, const A* __restrict__ m2, int64_t B,
                             int64_t P, int64_t C, int64_t per, const T* __restrict__ x,
                             int64_t pivot_b, int64_t pivot_c, A* __restrict__ out_mean,
                             A* __restrict__ out_m2, Finalize<A> fin, int lanes) {
  const int64_t W = C * per, entries = P * per;
  const MergeGroups mg(B * C, lanes);
  for (int64_t r = 0; r < mg.rounds; ++r) {
    const int64_t i = mg.group + r * mg.groups;
    const int64_t b = i / C, c = i % C;
    WelfordData<A> acc{A(0), A(0), A(0)};
    for (int64_t e = mg.lane; i < B * C && e < entries; e += lanes) {
      const int64_t p = e / per, w = c * per + e % per;
      const int64_t j = (b * P + p) * W + w;
      acc = combine(acc, WelfordData<A>{cnt[b * cb + p * cp + w * cw], mean[j], m2[j]});
    }
    for (int offset = lanes / 2; offset > 0; offset >>= 1) {
      acc = combine(acc, shfl_xor(acc, offset));
    }
    if (i >= B * C || mg.lane != 0) continue;
    out_mean[i] = (x ? static_cast<A>(x[b * pivot_b + c * pivot_c]) : A(0)) + acc.mean;
    if (fin.invstd) {
      const A var = acc.m2 / fin.count;
      out_m2[i] = var;
      fin.invstd[i] = A(1) / sqrt_rn(var + fin.eps);
    } else {
      out_m2[i] = acc.m2;
    }
  }
}

// Sums entries (b, p, c * per + v) over p and v of both gradient partials in one launch:
// out_dy = the sums of in_dy, out_dyx = the sums of in_dyx times invstd (b, c).
template <typename A>
__global__ void sum_partials_kernel(const A* __restrict__ in_dy, const A* __restrict__ in_dyx,
                                    int64_t B, int64_t P, int64_t C, int64_t per,
                                    const A* __restrict__ invstd, A* __restrict__ out_dy,
                                    A* __restrict__ out_dyx, int lanes) {
  const int64_t W = C * per, entries = P * per;
  const MergeGroups mg(B * C, lanes);
  for (int64_t r = 0; r < mg.rounds; ++r) {
    const int64_t i = mg.group + r * mg.groups;
    const int64_t b = i / C, c = i % C;
    A sdy = 0, sdyx = 0;
    for (int64_t e = mg.lane; i < B * C && e < entries; e += lanes) {
      const int64_t j = (b * P + e / per) * W + c * per + e % per;
      sdy += in_dy[j];
      sdyx += in_dyx[j];
    }
    for (int offset = lanes / 2; offset > 0; offset >>= 1) {
      sdy += __shfl_xor_sync(kFullMask, sdy, offset);
      sdyx += __shfl_xor_sync(kFullMask, sdyx, offset);
    }
    if (i >= B * C || mg.lane != 0) continue;
    out_dy[i] = sdy;
    out_dyx[i] = sdyx * invstd[i];
  }
}

// The eager bookkeeping of a training step in one single-block launch (contract in
// ../syncbn.cpp, CPU twin in ../syncbn_cpu.cpp): `coarse` = some |mean * invstd| of the
// (G, C) rows exceeds mean_limit (0: no check); unless coarse, the running statistics (when
// rm is set) move by w towards row 0's mean and variance * unbias, with the CPU kernel's
// lerp: fma(w, end - start, start) for |w| < 0.5, else fma(w - 1, end - start, end).
template <typename A, typename R, typename O>
__global__ void running_stats_kernel(const A* __restrict__ mean, const A* __restrict__ var,
                                     const A* __restrict__ invstd, int64_t total, int64_t C,
                                     double mean_limit, A unbias, O w, R* __restrict__ rm,
                                     R* __restrict__ rv, bool* __restrict__ coarse_out) {
  int coarse = 0;
  for (int64_t i = threadIdx.x; mean_limit > 0 && i < total; i += blockDim.x) {
    coarse |= static_cast<double>(abs_of(mean[i] * invstd[i])) > mean_limit;
  }
  coarse = __syncthreads_or(coarse);
  if (threadIdx.x == 0) *coarse_out = coarse != 0;
  if (coarse || rm == nullptr) return;
  const bool small = abs_of(w) < O(0.5);
  const O wk = small ? w : w - O(1);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const O m0 = static_cast<O>(rm[c]), m1 = static_cast<O>(static_cast<R>(mean[c]));
    rm[c] = static_cast<R>(fma_rn(wk, m1 - m0, small ? m0 : m1));
    const O v0 = static_cast<O>(rv[c]), v1 = static_cast<O>(static_cast<R>(var[c] * unbias));
    rv[c] = static_cast<R>(fma_rn(wk, v1 - v0, small ? v0 : v1));
  }
}

int sm_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

unsigned grid_1d(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, sm_count() * 8)));
}

// How a reduction over one layout is launched.
struct ReducePlan {
  bool planes = false;
  int vec = 1;       // values per load (16 bytes where every plane or row allows it)
  int64_t W = 0;     // columns of the partials (C for planes, C or C*S for rows)
  int64_t rows = 0;  // rows per slice (rows loop) or samples per slice (planes)
  int64_t chunks = 1;
  dim3 grid, block;
};

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// The plan for inputs of `elem_size` bytes at `ptrs` (x, and dy in the backward).
ReducePlan reduce_plan(const Geometry& g, Layout layout, int64_t elem_size,
                       std::initializer_list<const void*> ptrs) {
  ReducePlan plan;
  const int64_t target_blocks = 4 * static_cast<int64_t>(sm_count());
  // Channels go to gridDim.y in the plane shape (at most 65535); more channels take the rows
  // shape, which is correct for ChannelsFirst input too. Slices go to gridDim.z in both.
  TORCH_CHECK(g.slices <= 65535, "syncbn_lab (CUDA): at most 65535 slices, got ", g.slices);
  plan.planes = layout == Layout::ChannelsFirst && g.S >= kPlaneMin && g.C <= 65535;
  plan.W = plan.planes || layout == Layout::ChannelsLast ? g.C : g.C * g.S;
  // A vector never crosses a plane (planes) or a row (rows): each then starts aligned.
  const int64_t run = plan.planes ? g.S : plan.W;
  plan.vec = static_cast<int>(16 / elem_size);
  for (const void* ptr : ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) plan.vec = 1;
  }
  if (run % plan.vec != 0) plan.vec = 1;
  if (plan.planes) {
    // The block reduces all its threads together, so tx may be below a warp: with 16-byte
    // loads a short plane (S = 64 floats: 16 vectors) keeps every lane busy.
    const int64_t tx = std::min<int64_t>(kThreads, next_pow2(g.S / plan.vec));
    const int64_t ty = kThreads / tx;
    plan.rows = g.n;
    const int64_t want = (target_blocks + g.C * g.slices - 1) / (g.C * g.slices);
    plan.chunks = std::max<int64_t>(1, std::min<int64_t>({want, (g.n + ty - 1) / ty, 65535}));
    plan.grid = dim3(plan.chunks, g.C, g.slices);
    plan.block = dim3(tx, ty);
    return plan;
  }
  plan.rows = (layout == Layout::ChannelsLast ? g.S : 1) * g.n;
  const int64_t vec_cols = plan.W / plan.vec;
  const int64_t tx = std::min<int64_t>(kWarp, next_pow2(vec_cols));
  const int64_t ty = kThreads / tx;
  const int64_t col_blocks = (vec_cols + tx - 1) / tx;
  const int64_t want = (target_blocks + col_blocks * g.slices - 1) / (col_blocks * g.slices);
  plan.chunks = std::max<int64_t>(1, std::min<int64_t>({want, (plan.rows + ty - 1) / ty, 65535}));
  plan.grid = dim3(col_blocks, plan.chunks, g.slices);
  plan.block = dim3(tx, ty);
  return plan;
}

// Calls f(std::integral_constant<int, V>{}) with the plan's vector width as a constant.
template <typename T, typename F>
void with_vec(const ReducePlan& plan, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  if (plan.vec == kVec) {
    f(std::integral_constant<int, kVec>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// Statistics of the g.slices rows of x (already in `layout`): the partial reductions and
// one merge launch, which writes every entry of mean and second (no fill launches). second
// receives m2, or the variance when `invstd` is defined (see Finalize; it receives
// 1 / sqrt(var + eps)).
void launch_stats(const Tensor& x, const Geometry& g, Layout layout, const Tensor& mean,
                  const Tensor& second, const Tensor& invstd, double eps) {
  const ReducePlan plan = reduce_plan(g, layout, x.element_size(), {x.const_data_ptr()});
  const auto opts = mean.options();
  Tensor pn = at::empty({g.slices, plan.chunks, plan.W}, opts);
  Tensor pmean = at::empty_like(pn);
  Tensor pm2 = at::empty_like(pn);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "local_stats_cuda",
                                  [&] {
    using A = at::acc_type<scalar_t, true>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    with_vec<scalar_t>(plan, [&](auto vec_c) {
      constexpr int V = decltype(vec_c)::value;
      if (plan.planes) {
        stats_planes_kernel<scalar_t, A, V><<<plan.grid, plan.block, 0, stream>>>(
            xp, g.n, g.C, g.S, pn.mutable_data_ptr<A>(), pmean.mutable_data_ptr<A>(),
            pm2.mutable_data_ptr<A>());
      } else {
        stats_rows_kernel<scalar_t, A, V><<<plan.grid, plan.block, 0, stream>>>(
            xp, plan.rows, plan.W, g.C, pn.mutable_data_ptr<A>(), pmean.mutable_data_ptr<A>(),
            pm2.mutable_data_ptr<A>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    Finalize<A> fin;
    if (invstd.defined()) {
      fin.invstd = invstd.mutable_data_ptr<A>();
      fin.count = std::max(static_cast<A>(g.n * g.S), A(1));
      fin.eps = static_cast<A>(eps);
    }
    // Pivot of (slice d, channel c): the channel's first value in the slice.
    const int64_t per = plan.W / g.C;
    const int64_t pivot_b = plan.planes ? g.n * g.C * g.S : plan.rows * plan.W;
    const int64_t pivot_c = plan.planes ? g.S : per;
    const int lanes = merge_lanes(plan.chunks * per);
    merge_kernel<scalar_t, A><<<grid_1d(g.slices * g.C * lanes), kThreads, 0, stream>>>(
        pn.const_data_ptr<A>(), plan.chunks * plan.W, plan.W, 1, pmean.const_data_ptr<A>(),
        pm2.const_data_ptr<A>(), g.slices, plan.chunks, g.C, per, xp, pivot_b, pivot_c,
        mean.mutable_data_ptr<A>(), second.mutable_data_ptr<A>(), fin, lanes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<Tensor, Tensor, Tensor> local_stats_cuda(const Tensor& x_in, int64_t devices) {
  check_floating(x_in, "local_stats");
  const Geometry g = geometry_of(x_in, devices, "local_stats");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Layout layout = layout_of(x_in);
  const Tensor x = as_layout(x_in, layout);
  const auto opts = x.options().dtype(acc_dtype(x.scalar_type()));
  Tensor count = at::full({g.slices}, static_cast<double>(g.n * g.S), opts);
  if (x.numel() == 0) {
    return {count, at::zeros({g.slices, g.C}, opts), at::zeros({g.slices, g.C}, opts)};
  }
  Tensor mean = at::empty({g.slices, g.C}, opts);
  Tensor m2 = at::empty({g.slices, g.C}, opts);
  launch_stats(x, g, layout, mean, m2, Tensor(), 0.0);
  return {count, mean, m2};
}

// ----------------------------------------------------------------------------------------
// Elementwise kernels
// ----------------------------------------------------------------------------------------

// Channel and slice of the element at flat index `idx` (first of a vector).
template <bool CL, typename I>
__device__ __forceinline__ void locate(I idx, I C, I S, I slice_elems, I& c, I& g) {
  c = CL ? idx % C : (idx / S) % C;
  g = idx / slice_elems;
}

// Per-element view of the parameters; absent weight/bias read as 1/0.
template <typename A>
struct Params {
  const A* mean;
  const A* invstd;
  const A* weight;  // nullptr: 1
  const A* bias;    // nullptr: 0
  __device__ __forceinline__ A scale(int64_t gc, int64_t c) const {
    return weight ? weight[c] * invstd[gc] : invstd[gc];
  }
  __device__ __forceinline__ A shift(int64_t c) const { return bias ? bias[c] : A(0); }
};

// The per-channel values behind the VEC elements of a vector that starts at channel c0 of
// statistic row g: one channel for all (ChannelsFirst), or VEC consecutive channels
// (ChannelsLast), read as one vector load per array instead of VEC scalar loads.
template <bool CL, int VEC, typename A, typename I>
__device__ __forceinline__ void per_lane(const A* __restrict__ values, I at, A (&out)[VEC]) {
  if constexpr (CL && VEC > 1) {
    const Vec<A, VEC> in = *reinterpret_cast<const Vec<A, VEC>*>(values + at);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = in.v[k];
  } else {
    const A v = values[at];
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = v;
  }
}

// mean, invstd, scale = weight * invstd and shift = bias of each element of the vector.
template <typename A, int VEC>
struct LaneParams {
  A mean[VEC], invstd[VEC], scale[VEC], shift[VEC];
};

template <bool CL, int VEC, typename A, typename I>
__device__ __forceinline__ LaneParams<A, VEC> lane_params(const Params<A>& prm, I g, I C, I c0) {
  LaneParams<A, VEC> lp;
  per_lane<CL, VEC>(prm.mean, g * C + c0, lp.mean);
  per_lane<CL, VEC>(prm.invstd, g * C + c0, lp.invstd);
  if (prm.weight) {
    per_lane<CL, VEC>(prm.weight, c0, lp.scale);
#pragma unroll
    for (int k = 0; k < VEC; ++k) lp.scale[k] = lp.scale[k] * lp.invstd[k];  // as Params::scale
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) lp.scale[k] = lp.invstd[k];
  }
  if (prm.bias) {
    per_lane<CL, VEC>(prm.bias, c0, lp.shift);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) lp.shift[k] = A(0);
  }
  return lp;
}

template <typename T, typename A, bool CL, int VEC, typename I>
__global__ void forward_kernel(const T* __restrict__ x, T* __restrict__ y, Params<A> prm, I total,
                               I C, I S, I slice_elems) {
  const I nvec = total / VEC;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I v = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec; v += stride) {
    const I base = v * VEC;
    I c0, g;
    locate<CL>(base, C, S, slice_elems, c0, g);  // a vector stays in one slice and row
    const LaneParams<A, VEC> lp = lane_params<CL, VEC>(prm, g, C, c0);
    const Vec<T, VEC> in = reinterpret_cast<const Vec<T, VEC>*>(x)[v];
    Vec<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      out.v[k] = static_cast<T>(affine(static_cast<A>(in.v[k]), lp.mean[k], lp.scale[k],
                                       lp.shift[k]));
    }
    reinterpret_cast<Vec<T, VEC>*>(y)[v] = out;
  }
}

template <typename T, typename A, bool CL, int VEC, typename I>
__global__ void backward_elemt_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      T* __restrict__ dx, Params<A> prm,
                                      const A* __restrict__ sum_dy,
                                      const A* __restrict__ sum_dy_xhat,
                                      const A* __restrict__ count, bool per_slice_count,
                                      A count_value, I total, I C, I S, I slice_elems) {
  const I nvec = total / VEC;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I v = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec; v += stride) {
    const I base = v * VEC;
    I c0, g;
    locate<CL>(base, C, S, slice_elems, c0, g);
    const A m = count ? count[per_slice_count ? g : 0] : count_value;  // values per row
    const A inv_m = m > A(0) ? A(1) / m : A(0);
    const LaneParams<A, VEC> lp = lane_params<CL, VEC>(prm, g, C, c0);
    A s1[VEC], s2[VEC];
    per_lane<CL, VEC>(sum_dy, g * C + c0, s1);
    per_lane<CL, VEC>(sum_dy_xhat, g * C + c0, s2);
    const Vec<T, VEC> xin = reinterpret_cast<const Vec<T, VEC>*>(x)[v];
    const Vec<T, VEC> gin = reinterpret_cast<const Vec<T, VEC>*>(dy)[v];
    Vec<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A scale = lp.scale[k], mu = lp.mean[k];
      const A xv = static_cast<A>(xin.v[k]);
      const A gv = static_cast<A>(gin.v[k]);
      const A kx = scale * lp.invstd[k] * s2[k] * inv_m;
      const A k0 = scale * s1[k] * inv_m;
      out.v[k] = static_cast<T>(gv * scale - kx * (xv - mu) - k0);
    }
    reinterpret_cast<Vec<T, VEC>*>(dx)[v] = out;
  }
}

// dy and dy * (x - mean) of one value added to the sums.
template <typename A>
__device__ __forceinline__ void grad_push(A& sdy, A& sdyx, A xv, A gv, A mu) {
  sdy += gv;
  sdyx += gv * (xv - mu);
}

// Sums of dy and dy * (x - mean) for the planes shape; partials (slices, chunks, C).
template <typename T, typename A, int VEC>
__global__ void grad_sums_planes_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                        Params<A> prm, int64_t n, int64_t C, int64_t S,
                                        A* __restrict__ psdy, A* __restrict__ psdyx) {
  __shared__ A shared[kWarps];
  const int64_t p = blockIdx.x, c = blockIdx.y, d = blockIdx.z;
  const int64_t chunks = gridDim.x;
  const int64_t gc = d * C + c;
  const A mu = prm.mean[gc];
  A sdy = 0, sdyx = 0;
  const int64_t step = chunks * blockDim.y;
  in_groups<load_group(VEC)>(p * blockDim.y + threadIdx.y, step, n, [&](auto r_c, int64_t i) {
    constexpr int R = decltype(r_c)::value;
    const Vec<T, VEC>* xs[R];
    const Vec<T, VEC>* gs[R];
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int64_t off = ((d * n + i + u * step) * C + c) * S;
      xs[u] = reinterpret_cast<const Vec<T, VEC>*>(x + off);
      gs[u] = reinterpret_cast<const Vec<T, VEC>*>(dy + off);
    }
    for (int64_t s = threadIdx.x; s < S / VEC; s += blockDim.x) {
      Vec<T, VEC> xin[R], gin[R];
#pragma unroll
      for (int u = 0; u < R; ++u) {
        xin[u] = xs[u][s];
        gin[u] = gs[u][s];
      }
#pragma unroll
      for (int u = 0; u < R; ++u) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          grad_push<A>(sdy, sdyx, static_cast<A>(xin[u].v[k]), static_cast<A>(gin[u].v[k]), mu);
        }
      }
    }
  });
  sdy = block_sum(sdy, shared);
  sdyx = block_sum(sdyx, shared);
  if (linear_tid() == 0) {
    psdy[(d * chunks + p) * C + c] = sdy;
    psdyx[(d * chunks + p) * C + c] = sdyx;
  }
}

// Rows shape, VEC columns per thread as in stats_rows_kernel; partials (slices, chunks, W).
template <typename T, typename A, int VEC>
__global__ void grad_sums_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      Params<A> prm, int64_t rows, int64_t W, int64_t C,
                                      A* __restrict__ psdy, A* __restrict__ psdyx) {
  __shared__ A shared[kThreads];
  const int64_t wv = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t p = blockIdx.y, d = blockIdx.z, chunks = gridDim.y;
  const int64_t WV = W / VEC;
  A sdy[VEC], sdyx[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) sdy[k] = sdyx[k] = A(0);
  if (wv < WV) {
    const int64_t per = W / C;
    A mu[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) mu[k] = prm.mean[d * C + (wv * VEC + k) / per];
    const auto* __restrict__ xs = reinterpret_cast<const Vec<T, VEC>*>(x + d * rows * W) + wv;
    const auto* __restrict__ gs = reinterpret_cast<const Vec<T, VEC>*>(dy + d * rows * W) + wv;
    for (int64_t r = p * blockDim.y + threadIdx.y; r < rows; r += chunks * blockDim.y) {
      const Vec<T, VEC> xin = xs[r * WV], gin = gs[r * WV];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        grad_push<A>(sdy[k], sdyx[k], static_cast<A>(xin.v[k]), static_cast<A>(gin.v[k]), mu[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const A col_dy = column_sum(sdy[k], shared);
    const A col_dyx = column_sum(sdyx[k], shared);
    if (linear_tid() < static_cast<int>(blockDim.x) && wv < WV) {
      psdy[(d * chunks + p) * W + wv * VEC + k] = col_dy;
      psdyx[(d * chunks + p) * W + wv * VEC + k] = col_dyx;
    }
  }
}

// prepare() (syncbn.h) for the CUDA kernels: x's dtype, then its device, then the rest.
Prepared prepare(const Tensor& x_in, const Tensor& mean, const Tensor& invstd,
                 const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                 const char* op) {
  check_floating(x_in, op);
  TORCH_CHECK(x_in.is_cuda(), "syncbn_lab::", op, ": expected a CUDA tensor");
  return syncbn_lab::prepare(x_in, mean, invstd, weight, bias, op);
}

template <typename A>
Params<A> params_of(const Prepared& p) {
  return Params<A>{p.mean.const_data_ptr<A>(), p.invstd.const_data_ptr<A>(),
                   p.weight.defined() ? p.weight.const_data_ptr<A>() : nullptr,
                   p.bias.defined() ? p.bias.const_data_ptr<A>() : nullptr};
}

// Elements per 16-byte vector when every vector stays within one (slice, channel row) and
// the tensors' pointers are 16-byte aligned; else 1. For ChannelsLast the per-channel arrays
// (`channel_ptrs`, nullptr for an absent one) are read as vectors too (lane_params): they
// must be aligned to a vector of their dtype A.
template <typename T, typename A>
int vector_width(const Prepared& p, std::initializer_list<const void*> ptrs,
                 std::initializer_list<const void*> channel_ptrs) {
  constexpr int vec = 16 / sizeof(T);
  const bool cl = p.layout == Layout::ChannelsLast;
  const int64_t run = cl ? p.g.C : p.g.S;
  if (vec <= 1 || run % vec != 0) return 1;
  for (const void* ptr : ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return 1;
  }
  for (const void* ptr : channel_ptrs) {
    if (cl && reinterpret_cast<uintptr_t>(ptr) % (sizeof(A) * vec) != 0) return 1;
  }
  return vec;
}

// Calls f(std::integral_constant<bool, CL>, ..VEC, index type) for the runtime choices.
template <int VEC, typename F>
void with_layout_and_index(bool cl, bool small, F&& f) {
  auto pick_index = [&](auto cl_c) {
    if (small) {
      f(cl_c, std::integral_constant<int, VEC>{}, int32_t{0});
    } else {
      f(cl_c, std::integral_constant<int, VEC>{}, int64_t{0});
    }
  };
  if (cl) {
    pick_index(std::true_type{});
  } else {
    pick_index(std::false_type{});
  }
}

// y of the prepared input, in its layout.
Tensor launch_forward(const Prepared& p) {
  Tensor y = empty_in_layout(p.x.sizes(), p.x.options(), p.layout);
  const int64_t total = p.x.numel();
  if (total == 0) return y;
  const bool cl = p.layout == Layout::ChannelsLast;
  const bool small = total < (int64_t{1} << 30);  // 32-bit indices, no overflow
  const int64_t slice_elems = p.g.n * p.g.C * p.g.S;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "forward_elemt_cuda", [&] {
    using A = at::acc_type<scalar_t, true>;
    constexpr int kVec = 16 / sizeof(scalar_t);
    const Params<A> prm = params_of<A>(p);
    const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    const int vec = vector_width<scalar_t, A>(p, {xp, yp},
                                              {prm.mean, prm.invstd, prm.weight, prm.bias});
    auto launch = [&](auto cl_c, auto vec_c, auto index) {
      using I = decltype(index);
      constexpr int V = decltype(vec_c)::value;
      forward_kernel<scalar_t, A, decltype(cl_c)::value, V, I>
          <<<grid_1d(total / V), kThreads, 0, stream>>>(xp, yp, prm, static_cast<I>(total),
                                                        static_cast<I>(p.g.C),
                                                        static_cast<I>(p.g.S),
                                                        static_cast<I>(slice_elems));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec == kVec) {
      with_layout_and_index<kVec>(cl, small, launch);
    } else {
      with_layout_and_index<1>(cl, small, launch);
    }
  });
  return y;
}

Tensor forward_elemt_cuda(const Tensor& x_in, const Tensor& mean, const Tensor& invstd,
                          const std::optional<Tensor>& weight,
                          const std::optional<Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  return launch_forward(prepare(x_in, mean, invstd, weight, bias, "forward_elemt"));
}

// dy has the shape, dtype and device of x; returns it in the layout the kernels run in.
Tensor checked_dy(const Tensor& dy, const Prepared& p, const Tensor& x_in, const char* op) {
  TORCH_CHECK(dy.sizes() == x_in.sizes() && dy.scalar_type() == x_in.scalar_type(),
              "syncbn_lab::", op, ": dy must have the shape and dtype of x, got ", dy.sizes(),
              " ", dy.scalar_type(), " and ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(dy.device() == x_in.device(), "syncbn_lab::", op, ": dy must be on ",
              x_in.device(), ", got ", dy.device());
  return as_layout(dy, p.layout);
}

// (sum_dy, sum_dy_xhat) of the prepared input, shaped `stat_sizes` ((G, C) or (C,)): the
// partial reductions and one launch that sums both (every entry written, no fill launches).
std::tuple<Tensor, Tensor> launch_backward_reduce(const Prepared& p, const Tensor& dy,
                                                  at::IntArrayRef stat_sizes) {
  const auto opts = p.x.options().dtype(p.acc);
  if (p.x.numel() == 0) return {at::zeros(stat_sizes, opts), at::zeros(stat_sizes, opts)};
  Tensor sum_dy = at::empty(stat_sizes, opts);
  Tensor sum_dy_xhat = at::empty(stat_sizes, opts);
  const Geometry& g = p.g;
  const ReducePlan plan =
      reduce_plan(g, p.layout, p.x.element_size(), {p.x.const_data_ptr(), dy.const_data_ptr()});
  Tensor psdy = at::empty({g.slices, plan.chunks, plan.W}, opts);
  Tensor psdyx = at::empty_like(psdy);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "backward_reduce_cuda", [&] {
    using A = at::acc_type<scalar_t, true>;
    const Params<A> prm = params_of<A>(p);
    const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    with_vec<scalar_t>(plan, [&](auto vec_c) {
      constexpr int V = decltype(vec_c)::value;
      if (plan.planes) {
        grad_sums_planes_kernel<scalar_t, A, V><<<plan.grid, plan.block, 0, stream>>>(
            gp, xp, prm, g.n, g.C, g.S, psdy.mutable_data_ptr<A>(), psdyx.mutable_data_ptr<A>());
      } else {
        grad_sums_rows_kernel<scalar_t, A, V><<<plan.grid, plan.block, 0, stream>>>(
            gp, xp, prm, plan.rows, plan.W, g.C, psdy.mutable_data_ptr<A>(),
            psdyx.mutable_data_ptr<A>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    const int64_t per = plan.W / g.C;
    const int lanes = merge_lanes(plan.chunks * per);
    sum_partials_kernel<A><<<grid_1d(g.slices * g.C * lanes), kThreads, 0, stream>>>(
        psdy.const_data_ptr<A>(), psdyx.const_data_ptr<A>(), g.slices, plan.chunks, g.C, per,
        prm.invstd, sum_dy.mutable_data_ptr<A>(), sum_dy_xhat.mutable_data_ptr<A>(), lanes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {sum_dy, sum_dy_xhat};
}

// dx of the prepared input. The values per statistic row come from `count` (1 or G values,
// acc dtype, contiguous) or, when it is undefined, are `count_value` for every row.
Tensor launch_backward_elemt(const Prepared& p, const Tensor& dy, const Tensor& sum_dy,
                             const Tensor& sum_dy_xhat, const Tensor& count,
                             double count_value) {
  Tensor dx = empty_in_layout(p.x.sizes(), p.x.options(), p.layout);
  const int64_t total = p.x.numel();
  if (total == 0) return dx;
  const bool per_slice_count = count.defined() && count.numel() != 1;
  const bool cl = p.layout == Layout::ChannelsLast;
  const bool small = total < (int64_t{1} << 30);  // 32-bit indices, no overflow
  const int64_t slice_elems = p.g.n * p.g.C * p.g.S;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "backward_elemt_cuda", [&] {
    using A = at::acc_type<scalar_t, true>;
    constexpr int kVec = 16 / sizeof(scalar_t);
    const Params<A> prm = params_of<A>(p);
    const A* mp = count.defined() ? count.const_data_ptr<A>() : nullptr;
    const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    scalar_t* op = dx.mutable_data_ptr<scalar_t>();
    const A* s1 = sum_dy.const_data_ptr<A>();
    const A* s2 = sum_dy_xhat.const_data_ptr<A>();
    const int vec = vector_width<scalar_t, A>(
        p, {xp, gp, op}, {prm.mean, prm.invstd, prm.weight, prm.bias, s1, s2});
    auto launch = [&](auto cl_c, auto vec_c, auto index) {
      using I = decltype(index);
      constexpr int V = decltype(vec_c)::value;
      backward_elemt_kernel<scalar_t, A, decltype(cl_c)::value, V, I>
          <<<grid_1d(total / V), kThreads, 0, stream>>>(
              gp, xp, op, prm, s1, s2, mp,
              per_slice_count, static_cast<A>(count_value), static_cast<I>(total),
              static_cast<I>(p.g.C), static_cast<I>(p.g.S), static_cast<I>(slice_elems));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec == kVec) {
      with_layout_and_index<kVec>(cl, small, launch);
    } else {
      with_layout_and_index<1>(cl, small, launch);
    }
  });
  return dx;
}

std::tuple<Tensor, Tensor> backward_reduce_cuda(const Tensor& dy_in, const Tensor& x_in,
                                                const Tensor& mean, const Tensor& invstd,
                                                const std::optional<Tensor>& weight,
                                                const std::optional<Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "backward_reduce");
  const Tensor dy = checked_dy(dy_in, p, x_in, "backward_reduce");
  return launch_backward_reduce(p, dy, mean.sizes());
}

Tensor backward_elemt_cuda(const Tensor& dy_in, const Tensor& x_in, const Tensor& mean,
                           const Tensor& invstd, const std::optional<Tensor>& weight,
                           const std::optional<Tensor>& bias, const Tensor& sum_dy,
                           const Tensor& sum_dy_xhat, const Tensor& count) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "backward_elemt");
  const Tensor dy = checked_dy(dy_in, p, x_in, "backward_elemt");
  TORCH_CHECK(sum_dy.sizes() == mean.sizes() && sum_dy_xhat.sizes() == mean.sizes(),
              "syncbn_lab::backward_elemt: sum_dy and sum_dy_xhat must have the shape of mean ",
              mean.sizes(), ", got ", sum_dy.sizes(), " and ", sum_dy_xhat.sizes());
  TORCH_CHECK(count.numel() == 1 || count.numel() == p.g.slices,
              "syncbn_lab::backward_elemt: count must hold 1 or ", p.g.slices,
              " values (one per slice), got ", count.numel());
  if (p.x.numel() == 0) return empty_in_layout(p.x.sizes(), p.x.options(), p.layout);
  return launch_backward_elemt(p, dy, stat_as(sum_dy, x_in, p.acc),
                               stat_as(sum_dy_xhat, x_in, p.acc),
                               stat_as(count, x_in, p.acc).reshape({-1}), 0.0);
}

// batch_norm_train in three launches (statistics, merge with var and invstd, elementwise)
// where the device-generic composite of ../syncbn.cpp takes eight: on a GPU a small layer's
// step is bound by the host's launches. Same checks and outputs as the CPU kernel.
std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_train_cuda(
    const Tensor& x_in, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
    int64_t devices, int64_t group_size, double eps) {
  const Geometry g = batch_norm_train_geometry(x_in, devices, group_size);
  if (x_in.numel() == 0) {
    return batch_norm_train_composite(x_in, weight, bias, devices, group_size, eps);
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto opts = x_in.options().dtype(acc_dtype(x_in.scalar_type()));
  Tensor mean = at::empty({g.slices, g.C}, opts);
  Tensor var = at::empty_like(mean);
  Tensor invstd = at::empty_like(mean);
  // Every argument check before the first launch. p.mean and p.invstd are mean and invstd
  // themselves (already in the acc dtype and contiguous): the forward reads what the merge
  // writes.
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "batch_norm_train");
  launch_stats(p.x, g, p.layout, p.mean, var, p.invstd, eps);
  return {launch_forward(p), p.mean, var, p.invstd};
}

// batch_norm_train_backward in three launches (partial sums, their merge, dx) where the
// composite takes seven or more.
std::tuple<Tensor, Tensor, Tensor> batch_norm_train_backward_cuda(
    const Tensor& dy_in, const Tensor& x_in, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias, const Tensor& mean, const Tensor& invstd,
    bool input_grad) {
  TORCH_CHECK(mean.dim() == 2, "syncbn_lab::batch_norm_train_backward: mean must be (G, C)");
  if (x_in.numel() == 0) {
    return batch_norm_train_backward_composite(dy_in, x_in, weight, bias, mean, invstd,
                                               input_grad);
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "batch_norm_train_backward");
  const Tensor dy = checked_dy(dy_in, p, x_in, "batch_norm_train_backward");
  auto [sum_dy, sum_dy_xhat] = launch_backward_reduce(p, dy, mean.sizes());
  Tensor dx = input_grad ? launch_backward_elemt(p, dy, sum_dy, sum_dy_xhat, Tensor(),
                                                 static_cast<double>(p.g.n * p.g.S))
                         : at::empty({0}, x_in.options());
  return with_param_grads(dx, sum_dy, sum_dy_xhat);
}

// update_running_stats in one launch; the caller's read of the flag is the step's one sync.
Tensor update_running_stats_cuda(const std::optional<Tensor>& running_mean,
                                 const std::optional<Tensor>& running_var, const Tensor& mean_in,
                                 const Tensor& var_in, const Tensor& invstd_in, double factor,
                                 int64_t count, double mean_limit) {
  const c10::cuda::CUDAGuard guard(mean_in.device());
  Tensor mean, var, invstd;  // named (not bound) so that the kernels' lambdas capture them
  std::tie(mean, var, invstd) =
      update_running_stats_inputs(running_mean, running_var, mean_in, var_in, invstd_in);
  const auto acc = mean.scalar_type();
  const int64_t C = mean.size(1);
  const bool track = running_mean.has_value() && mean.numel() > 0;
  // Checked before the launch: the CPU kernel checks them only when the guard passes.
  if (track) check_running_buffers(*running_mean, *running_var, mean, count);
  Tensor coarse = at::empty({}, mean.options().dtype(at::kBool));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(acc, "update_running_stats_cuda", [&] {
    using A = scalar_t;
    const A unbias = track ? static_cast<A>(static_cast<double>(count) / (count - 1)) : A(1);
    auto launch = [&](auto* rm, auto* rv) {
      using R = std::remove_pointer_t<decltype(rm)>;
      using O = at::opmath_type<R>;
      running_stats_kernel<A, R, O><<<1, kThreads, 0, stream>>>(
          mean.const_data_ptr<A>(), var.const_data_ptr<A>(), invstd.const_data_ptr<A>(),
          mean.numel(), C, mean_limit, unbias, static_cast<O>(factor), rm, rv,
          coarse.mutable_data_ptr<bool>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (!track) {
      launch(static_cast<A*>(nullptr), static_cast<A*>(nullptr));
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, running_mean->scalar_type(),
                                    "update_running_stats_cuda_buffers", [&] {
      launch(running_mean->mutable_data_ptr<scalar_t>(),
             running_var->mutable_data_ptr<scalar_t>());
    });
  });
  return coarse;
}

}  // namespace

TORCH_LIBRARY_IMPL(syncbn_lab, CUDA, m) {
  m.impl("local_stats", &local_stats_cuda);
  m.impl("forward_elemt", &forward_elemt_cuda);
  m.impl("backward_reduce", &backward_reduce_cuda);
  m.impl("backward_elemt", &backward_elemt_cuda);
  m.impl("batch_norm_train", &batch_norm_train_cuda);
  m.impl("batch_norm_train_backward", &batch_norm_train_backward_cuda);
  m.impl("update_running_stats", &update_running_stats_cuda);
}

}  // namespace syncbn_lab
