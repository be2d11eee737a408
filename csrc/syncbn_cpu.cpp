// CPU kernels of the syncbn_lab ops (schemas in syncbn.cpp).
//
// Two loop shapes cover every layout (see syncbn.h):
//   planes: ChannelsFirst with S >= kPlaneMin. One task per (slice, channel) sees its n
//           planes as n rows of S columns (row stride C * S), in blocks of kColumnBlock
//           columns, and merges the columns at the end.
//   rows:   ChannelsLast (rows of W = C values) and ChannelsFirst with small S (a sample is a
//           row of W = C*S "virtual channels", merged per channel at the end). Tasks take
//           chunks of rows.
// Either way every column has its own accumulator, and the reductions run over bands of 8
// rows with the accumulators of 16 columns in one vector register (see welford_rows), so
// Welford's divisions happen once per band and memory is touched once per band, not per row.
// The hot loops are leaf functions compiled for x86-64-v4, -v3 and baseline with GCC's
// target_clones (the loader picks one at run time), so a build is fast and portable.
// setup.py compiles this file with -ffp-contract=off, so no clone fuses a multiply and an
// add into an fma: every clone, and the single-pass and two-pass paths, round alike.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "syncbn.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(SYNCBN_LAB_NO_CLONES)
#define SYNCBN_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SYNCBN_CLONES
#endif

namespace syncbn_lab {
namespace {

using at::Tensor;

constexpr int64_t kColumnBlock = 2048;  // columns per pass of a plane task (L1-sized)
constexpr int64_t kPlaneMin = 32;  // S from which ChannelsFirst uses the plane loops
constexpr int64_t kMinChunkRows = 16;
constexpr int64_t kElemGrain = 1 << 15;  // elements per parallel task in elementwise loops

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

// ---------------------------------------------------------------------------------------
// Conversions of the element type T to the accumulation type A and back
// ---------------------------------------------------------------------------------------

// widen<A>(t) and narrow<T>(a) are static_cast, except for bfloat16, whose c10 conversions
// GCC does not vectorise (the NaN test of c10's rounding is a branch per element). These are
// bit for bit c10's (the top 16 bits of the float; round to nearest even, NaN -> 0x7FC0),
// written without a branch: bf16 channels_last loops at C = 16 ran 2x slower than float32.
template <typename A, typename T>
__attribute__((always_inline)) inline A widen(T v) {
  return static_cast<A>(v);
}
template <>
__attribute__((always_inline)) inline float widen<float, c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T, typename A>
__attribute__((always_inline)) inline T narrow(A v) {
  return static_cast<T>(v);
}
template <>
__attribute__((always_inline)) inline c10::BFloat16 narrow<c10::BFloat16, float>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000);
  return c10::BFloat16(static_cast<uint16_t>(nan ? UINT32_C(0x7FC0) : rounded),
                       c10::BFloat16::from_bits());
}

// ---------------------------------------------------------------------------------------
// Welford statistics
// ---------------------------------------------------------------------------------------

template <typename A>
struct Welford {
  A n = 0, mean = 0, m2 = 0;
  // Chan et al.: the count-weighted merge of two partial results.
  void merge(A nb, A mb, A m2b) {
    const A total = n + nb;
    if (nb == A(0)) return;
    const A delta = mb - mean;
    const A fb = nb / total;
    mean += delta * fb;
    m2 += m2b + delta * delta * n * fb;
    n = total;
  }
};

// The column-wise reductions below work on bands of a few rows and chunks of kLanes
// columns whose accumulators stay in registers for the whole band (one vector register of
// float32 on AVX-512); only between bands do they touch memory. Accumulating in memory row
// by row ran at about half the read bandwidth of a plain sum.
constexpr int kLanes = 16;
constexpr int64_t kWelfordBand = 8;  // rows per Welford band
constexpr int64_t kSumBand = 8;  // rows per band of the gradient sums (2 tensors: 16 streams)

// L accumulators of type A as one GCC vector value, so that they live in registers (plain
// arrays were kept on the stack, a store-to-load round trip per row).
template <typename A, int L>
struct Lanes {
  typedef A type __attribute__((vector_size(L * sizeof(A))));
};

// L values of T from p (unaligned), converted to A.
template <int L, typename T, typename A>
__attribute__((always_inline)) inline typename Lanes<A, L>::type load_lanes(const T* p) {
  typename Lanes<A, L>::type v;
  if constexpr (std::is_same_v<T, A>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int j = 0; j < L; ++j) v[j] = widen<A>(p[j]);
  }
  return v;
}

// One band (nb rows spaced ld apart) of L columns merged into the columns' running (mean,
// m2) of x - pivot: the band's mean and M2 in two passes over it (in L1), then Chan's merge
// with weight f = nb / (n + nb) and n * f.
template <int L, typename T, typename A, bool SHARED>
__attribute__((always_inline)) inline void welford_band(const T* __restrict__ band, int64_t nb,
                                                        int64_t ld, const A* __restrict__ pivot,
                                                        A* __restrict__ mean, A* __restrict__ m2,
                                                        A inv_nb, A f, A nf) {
  using V = typename Lanes<A, L>::type;
  const V p = SHARED ? V{} + pivot[0] : load_lanes<L, A, A>(pivot);
  V s = {}, q = {};
  for (int64_t r = 0; r < nb; ++r) s += load_lanes<L, T, A>(band + r * ld) - p;
  s *= inv_nb;
  for (int64_t r = 0; r < nb; ++r) {
    const V d = load_lanes<L, T, A>(band + r * ld) - p - s;
    q += d * d;
  }
  const V delta = s - load_lanes<L, A, A>(mean);
  const V new_mean = load_lanes<L, A, A>(mean) + delta * f;
  const V new_m2 = load_lanes<L, A, A>(m2) + (q + delta * delta * nf);
  std::memcpy(mean, &new_mean, sizeof(V));
  std::memcpy(m2, &new_m2, sizeof(V));
}

// Column-wise Welford over `rows` rows of W values spaced `ld` apart, of x - pivot[w]
// (SHARED: of x - pivot[0], one pivot for all columns); mean and m2 start at zero and end
// as the mean of x - pivot and the sum of squared deviations of each column.
template <typename T, typename A, bool SHARED = false>
SYNCBN_CLONES void welford_rows(const T* __restrict__ x, int64_t rows, int64_t W, int64_t ld,
                                const A* __restrict__ pivot, A* __restrict__ mean,
                                A* __restrict__ m2) {
  A n = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += kWelfordBand) {
    const int64_t nb = std::min(kWelfordBand, rows - r0);
    const A total = n + A(nb), f = A(nb) / total, nf = n * f, inv_nb = A(1) / A(nb);
    const T* __restrict__ band = x + r0 * ld;
    int64_t w = 0;
    for (; w + kLanes <= W; w += kLanes) {
      welford_band<kLanes, T, A, SHARED>(band + w, nb, ld, pivot + (SHARED ? 0 : w), mean + w,
                                         m2 + w, inv_nb, f, nf);
    }
    for (; w < W; ++w) {
      welford_band<1, T, A, SHARED>(band + w, nb, ld, pivot + (SHARED ? 0 : w), mean + w,
                                    m2 + w, inv_nb, f, nf);
    }
    n = total;
  }
}

// Sum of v[0, W) in 16 interleaved partial sums, so that it vectorises (a single running
// sum is a chain of dependent additions the compiler may not reorder).
template <typename A>
SYNCBN_CLONES A lane_sum(const A* __restrict__ v, int64_t W) {
  A lanes[16] = {};
  int64_t w = 0;
  for (; w + 16 <= W; w += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] += v[w + j];
  }
  for (int j = 0; w < W; ++w, ++j) lanes[j] += v[w];
  A total = 0;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}

// Sum of (v[w] - mu)^2 over [0, W), vectorised as lane_sum.
template <typename A>
SYNCBN_CLONES A lane_spread(const A* __restrict__ v, int64_t W, A mu) {
  A lanes[16] = {};
  int64_t w = 0;
  for (; w + 16 <= W; w += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] += (v[w + j] - mu) * (v[w + j] - mu);
  }
  for (int j = 0; w < W; ++w, ++j) lanes[j] += (v[w] - mu) * (v[w] - mu);
  A total = 0;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}

// Merges W columns of statistics that each hold n values into `total`: Chan's formula for
// equal counts, i.e. the mean of the column means, and the columns' m2 plus n times the
// spread of their means around it (two vectorised passes instead of W divisions).
template <typename A>
void merge_columns(Welford<A>& total, A n, const A* mean, const A* m2, int64_t W) {
  const A mu = lane_sum(mean, W) / A(W);
  total.merge(n * A(W), mu, lane_sum(m2, W) + n * lane_spread(mean, W, mu));
}

// Statistics of one plane task: n planes of S values spaced ld apart (one channel of one
// slice), Welford around its first value in column blocks of cmean.size(). Returns (mean,
// m2) with the mean in x's coordinates.
template <typename T, typename A>
std::pair<A, A> plane_stats(const T* base, int64_t n, int64_t S, int64_t ld,
                            std::vector<A>& cmean, std::vector<A>& cm2) {
  const A pivot = static_cast<A>(base[0]);
  const int64_t block = static_cast<int64_t>(cmean.size());
  Welford<A> total;
  for (int64_t s0 = 0; s0 < S; s0 += block) {
    const int64_t W = std::min(block, S - s0);
    std::fill_n(cmean.begin(), W, A(0));
    std::fill_n(cm2.begin(), W, A(0));
    welford_rows<T, A, true>(base + s0, n, W, ld, &pivot, cmean.data(), cm2.data());
    merge_columns(total, A(n), cmean.data(), cm2.data(), W);
  }
  return {pivot + total.mean, total.m2};
}

// Offset of plane task i's first value (slice i / C, channel i % C) in ChannelsFirst x.
inline int64_t plane_offset(const Geometry& g, int64_t i) {
  return ((i / g.C) * g.n * g.C + i % g.C) * g.S;
}

// How the rows of one slice are cut into chunks for the row loops.
struct RowPlan {
  int64_t W = 0;               // values per row
  int64_t rows_per_slice = 0;  // rows in one slice
  int64_t chunks = 1;          // chunks per slice
  int64_t first_row(int64_t chunk) const { return chunk * rows_per_slice / chunks; }
};

RowPlan row_plan(const Geometry& g, Layout layout, int64_t slices) {
  RowPlan plan;
  plan.W = layout == Layout::ChannelsLast ? g.C : g.C * g.S;
  plan.rows_per_slice = (layout == Layout::ChannelsLast ? g.S : 1) * (g.N / slices);
  const int64_t want = (4 * at::get_num_threads() + slices - 1) / slices;
  plan.chunks = std::max<int64_t>(1, std::min(want, plan.rows_per_slice / kMinChunkRows));
  return plan;
}

bool use_planes(const Geometry& g, Layout layout) {
  return layout == Layout::ChannelsFirst && g.S >= kPlaneMin;
}

std::tuple<Tensor, Tensor, Tensor> local_stats_cpu(const Tensor& x_in, int64_t devices) {
  check_floating(x_in, "local_stats");
  const Geometry g = geometry_of(x_in, devices, "local_stats");
  const Layout layout = layout_of(x_in);
  const Tensor x = as_layout(x_in, layout);
  const auto acc = acc_dtype(x.scalar_type());
  const auto opts = x.options().dtype(acc);
  Tensor count = at::full({g.slices}, static_cast<double>(g.n * g.S), opts);
  Tensor mean = at::zeros({g.slices, g.C}, opts);
  Tensor m2 = at::zeros({g.slices, g.C}, opts);
  if (x.numel() == 0) return {count, mean, m2};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "local_stats_cpu",
                                  [&] {
    using A = typename AccOf<scalar_t>::type;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    A* mp = mean.mutable_data_ptr<A>();
    A* m2p = m2.mutable_data_ptr<A>();
    const int64_t C = g.C, S = g.S, n = g.n;
    // Welford runs on x - pivot, the pivot being the first value of the channel in the
    // slice: the running means then stay near zero, where float32 resolves the spread of
    // the values even when their mean is large (mean 1e4, std 0.1).
    if (use_planes(g, layout)) {
      at::parallel_for(0, g.slices * C, 1, [&](int64_t begin, int64_t end) {
        const int64_t block = std::min(S, kColumnBlock);
        std::vector<A> cmean(block), cm2(block);
        for (int64_t i = begin; i < end; ++i) {
          std::tie(mp[i], m2p[i]) = plane_stats(xp + plane_offset(g, i), n, S, C * S, cmean, cm2);
        }
      });
      return;
    }
    const RowPlan plan = row_plan(g, layout, g.slices);
    const int64_t W = plan.W, T = plan.chunks, per_channel = W / C;
    std::vector<A> pivots(g.slices * W);  // the channel's pivot in each of its W / C columns
    for (int64_t d = 0; d < g.slices; ++d) {
      const scalar_t* first_row = xp + d * plan.rows_per_slice * W;
      for (int64_t w = 0; w < W; ++w) {
        pivots[d * W + w] = static_cast<A>(first_row[(w / per_channel) * per_channel]);
      }
    }
    std::vector<A> pmean(g.slices * T * W, A(0)), pm2(g.slices * T * W, A(0));
    at::parallel_for(0, g.slices * T, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t d = task / T, t = task % T;
        const int64_t r0 = plan.first_row(t), r1 = plan.first_row(t + 1);
        welford_rows<scalar_t, A>(xp + (d * plan.rows_per_slice + r0) * W, r1 - r0, W, W,
                                  pivots.data() + d * W, pmean.data() + task * W,
                                  pm2.data() + task * W);
      }
    });
    // Merge the chunks, then (ChannelsFirst) the S virtual channels of every channel; all
    // share the channel's pivot, so the merge stays in shifted coordinates.
    at::parallel_for(0, g.slices * C, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t d = i / C, c = i % C;
        Welford<A> total;
        for (int64_t v = 0; v < per_channel; ++v) {
          const int64_t w = c * per_channel + v;
          for (int64_t t = 0; t < T; ++t) {
            const A rows = A(plan.first_row(t + 1) - plan.first_row(t));
            total.merge(rows, pmean[(d * T + t) * W + w], pm2[(d * T + t) * W + w]);
          }
        }
        mp[i] = pivots[d * W + c * per_channel] + total.mean;
        m2p[i] = total.m2;
      }
    });
  });
  return {count, mean, m2};
}

// ---------------------------------------------------------------------------------------
// Elementwise forward: y = (x - mean) * scale + shift, scale = weight * invstd, shift = bias
// ---------------------------------------------------------------------------------------

// Per (slice, channel) coefficients of the elementwise passes, forward and backward.
template <typename A>
struct Coefficients {
  int64_t slices = 1, C = 0;
  std::vector<A> mean, scale, invstd;  // (slices, C)
  std::vector<A> shift;                // (C)
};

template <typename A>
Coefficients<A> coefficients(const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                             const Tensor& bias, int64_t slices, int64_t C) {
  Coefficients<A> k;
  k.slices = slices;
  k.C = C;
  const A* mp = mean.const_data_ptr<A>();
  const A* ip = invstd.const_data_ptr<A>();
  const A* wp = weight.defined() ? weight.const_data_ptr<A>() : nullptr;
  const A* bp = bias.defined() ? bias.const_data_ptr<A>() : nullptr;
  k.mean.assign(mp, mp + slices * C);
  k.invstd.assign(ip, ip + slices * C);
  k.scale.resize(slices * C);
  for (int64_t i = 0; i < slices * C; ++i) k.scale[i] = wp ? wp[i % C] * ip[i] : ip[i];
  k.shift.assign(C, A(0));
  if (bp) std::copy(bp, bp + C, k.shift.begin());
  return k;
}

// Expands per-channel values of one slice to the W = C * S virtual channels of a row.
template <typename A>
std::vector<A> expand(const A* per_channel, int64_t C, int64_t per) {
  std::vector<A> out(C * per);
  for (int64_t c = 0; c < C; ++c) std::fill_n(out.begin() + c * per, per, per_channel[c]);
  return out;
}

// The elementwise kernels loop over many rows per call: a row can be as short as C values,
// and a call through target_clones' resolver costs about as much as a short row.

// `planes` runs of S values spaced `ld` apart (in x and y), one set of coefficients.
template <typename T, typename A>
SYNCBN_CLONES void affine_planes(const T* __restrict__ x, T* __restrict__ y, int64_t planes,
                                 int64_t S, int64_t ld, A mean, A scale, A shift) {
  for (int64_t p = 0; p < planes; ++p) {
    const T* __restrict__ xr = x + p * ld;
    T* __restrict__ yr = y + p * ld;
    for (int64_t s = 0; s < S; ++s) {
      yr[s] = narrow<T>((widen<A>(xr[s]) - mean) * scale + shift);
    }
  }
}

// `rows` rows of W values spaced `ld` apart (in x and y), coefficients per column.
template <typename T, typename A>
SYNCBN_CLONES void affine_rows(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                               int64_t W, int64_t ld, const A* __restrict__ mean,
                               const A* __restrict__ scale, const A* __restrict__ shift) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict__ xr = x + r * ld;
    T* __restrict__ yr = y + r * ld;
    for (int64_t w = 0; w < W; ++w) {
      yr[w] = narrow<T>((widen<A>(xr[w]) - mean[w]) * scale[w] + shift[w]);
    }
  }
}

// Calls f(slice, first_row, rows) for pieces of [begin, end) that stay within one slice and
// hold at most kPieceBytes of the inputs (row_bytes: all inputs' bytes per row), in order
// within a piece for the prefetchers. An elementwise pass follows a reduction over the same
// rows (local_stats, backward_reduce), which leaves the rows it read last in the cache. When
// the range holds at most kWalkBackBytes, the pieces go from the end of the range back to
// its start, so that the pass starts on those rows; bigger ranges go front to back, as the
// cached share is small and the backward walk cost more than it saved. Measured interleaved
// in one process on the CPU of csrc/README.md: the module step on (32,256,8,8)
// channels_last 4-5 % faster walking back, on (64,64,32,32) channels_last 5 % faster
// walking forward.
constexpr int64_t kPieceBytes = 1 << 16;
constexpr int64_t kWalkBackBytes = 4 << 20;

template <typename F>
void for_slice_pieces(int64_t begin, int64_t end, int64_t rows_per_slice, int64_t row_bytes,
                      const F& f) {
  const int64_t piece = std::max<int64_t>(1, kPieceBytes / std::max<int64_t>(row_bytes, 1));
  if ((end - begin) * row_bytes > kWalkBackBytes) {
    for (int64_t r = begin; r < end;) {
      const int64_t d = r / rows_per_slice;
      const int64_t stop = std::min({end, (d + 1) * rows_per_slice, r + piece});
      f(d, r, stop - r);
      r = stop;
    }
    return;
  }
  for (int64_t hi = end; hi > begin;) {
    const int64_t d = (hi - 1) / rows_per_slice;
    const int64_t lo = std::max({begin, hi - piece, d * rows_per_slice});
    f(d, lo, hi - lo);
    hi = lo;
  }
}

template <typename scalar_t, typename A>
void forward_loops(const Prepared& p, const Coefficients<A>& k, Tensor& y) {
  const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
  scalar_t* yp = y.mutable_data_ptr<scalar_t>();
  const Geometry& g = p.g;
  const int64_t C = g.C, S = g.S;
  if (use_planes(g, p.layout)) {
    at::parallel_for(0, g.slices * C, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t c = i % C, off = plane_offset(g, i), ld = C * S;
        affine_planes<scalar_t, A>(xp + off, yp + off, g.n, S, ld, k.mean[i], k.scale[i],
                                   k.shift[c]);
      }
    });
    return;
  }
  const RowPlan plan = row_plan(g, p.layout, g.slices);
  const int64_t W = plan.W, per = W / C;
  std::vector<A> mean = k.mean, scale = k.scale, shift = k.shift;
  if (per > 1) {
    std::vector<A> em, es;
    for (int64_t d = 0; d < g.slices; ++d) {
      auto m = expand(k.mean.data() + d * C, C, per);
      auto s = expand(k.scale.data() + d * C, C, per);
      em.insert(em.end(), m.begin(), m.end());
      es.insert(es.end(), s.begin(), s.end());
    }
    mean.swap(em);
    scale.swap(es);
    shift = expand(k.shift.data(), C, per);
  }
  const int64_t rows = g.slices * plan.rows_per_slice;
  const int64_t grain = std::max<int64_t>(1, kElemGrain / std::max<int64_t>(W, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const auto piece = [&](int64_t d, int64_t r, int64_t count) {
      affine_rows<scalar_t, A>(xp + r * W, yp + r * W, count, W, W, mean.data() + d * W,
                               scale.data() + d * W, shift.data());
    };
    for_slice_pieces(begin, end, plan.rows_per_slice, W * p.x.element_size(), piece);
  });
}

Tensor forward_elemt_cpu(const Tensor& x_in, const Tensor& mean, const Tensor& invstd,
                         const std::optional<Tensor>& weight,
                         const std::optional<Tensor>& bias) {
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "forward_elemt");
  Tensor y = empty_in_layout(p.x.sizes(), p.x.options(), p.layout);
  if (p.x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "forward_elemt_cpu", [&] {
    using A = typename AccOf<scalar_t>::type;
    const auto k = coefficients<A>(p.mean, p.invstd, p.weight, p.bias, p.g.slices, p.g.C);
    forward_loops<scalar_t, A>(p, k, y);
  });
  return y;
}

// ---------------------------------------------------------------------------------------
// Backward: sums of dy and dy * (x - mean), then dx
// ---------------------------------------------------------------------------------------

// One band (nb rows spaced ld apart) of L columns: sums of dy and dy * (x - mean) added
// to sdy and sdyx.
template <int L, typename T, typename A, bool SHARED>
__attribute__((always_inline)) inline void grad_sums_band(const T* __restrict__ dy,
                                                          const T* __restrict__ x, int64_t nb,
                                                          int64_t ld, const A* __restrict__ mean,
                                                          A* __restrict__ sdy,
                                                          A* __restrict__ sdyx) {
  using V = typename Lanes<A, L>::type;
  const V mu = SHARED ? V{} + mean[0] : load_lanes<L, A, A>(mean);
  V a = {}, b = {};
  for (int64_t r = 0; r < nb; ++r) {
    const V xm = load_lanes<L, T, A>(x + r * ld) - mu;
    const V g = load_lanes<L, T, A>(dy + r * ld);
    a += g;
    b += g * xm;
  }
  const V new_a = load_lanes<L, A, A>(sdy) + a;
  const V new_b = load_lanes<L, A, A>(sdyx) + b;
  std::memcpy(sdy, &new_a, sizeof(V));
  std::memcpy(sdyx, &new_b, sizeof(V));
}

// Column-wise sums of dy and dy * (x - mean) over `rows` rows of W values spaced `ld`
// apart, added to sdy and sdyx; a mean per column (SHARED: element 0 for all).
template <typename T, typename A, bool SHARED = false>
SYNCBN_CLONES void grad_sums_rows(const T* __restrict__ dy, const T* __restrict__ x, int64_t rows,
                                  int64_t W, int64_t ld, const A* __restrict__ mean,
                                  A* __restrict__ sdy, A* __restrict__ sdyx) {
  for (int64_t r0 = 0; r0 < rows; r0 += kSumBand) {
    const int64_t nb = std::min(kSumBand, rows - r0), off = r0 * ld;
    int64_t w = 0;
    for (; w + kLanes <= W; w += kLanes) {
      const int64_t k = SHARED ? 0 : w;
      grad_sums_band<kLanes, T, A, SHARED>(dy + off + w, x + off + w, nb, ld, mean + k, sdy + w,
                                           sdyx + w);
    }
    for (; w < W; ++w) {
      const int64_t k = SHARED ? 0 : w;
      grad_sums_band<1, T, A, SHARED>(dy + off + w, x + off + w, nb, ld, mean + k, sdy + w,
                                      sdyx + w);
    }
  }
}

// Gradient sums of one plane task (coefficient row i, channel c; layout as plane_stats),
// in column blocks of sdy.size(): (sum dy, sum dy * xhat).
template <typename T, typename A>
std::pair<A, A> plane_grad_sums(const T* dy, const T* x, int64_t n, int64_t S, int64_t ld,
                                const Coefficients<A>& k, int64_t i, std::vector<A>& sdy,
                                std::vector<A>& sdyx) {
  const int64_t block = static_cast<int64_t>(sdy.size());
  A total_dy = 0, total_dyx = 0;
  for (int64_t s0 = 0; s0 < S; s0 += block) {
    const int64_t W = std::min(block, S - s0);
    std::fill_n(sdy.begin(), W, A(0));
    std::fill_n(sdyx.begin(), W, A(0));
    grad_sums_rows<T, A, true>(dy + s0, x + s0, n, W, ld, &k.mean[i], sdy.data(), sdyx.data());
    total_dy += lane_sum(sdy.data(), W);
    total_dyx += lane_sum(sdyx.data(), W);
  }
  return {total_dy, total_dyx * k.invstd[i]};
}

template <typename scalar_t, typename A>
void backward_reduce_loops(const Prepared& p, const Tensor& dy, const Coefficients<A>& k,
                           A* sum_dy, A* sum_dy_xhat) {
  const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
  const scalar_t* gp = dy.const_data_ptr<scalar_t>();
  const Geometry& g = p.g;
  const int64_t C = g.C, S = g.S, n = g.n;
  if (use_planes(g, p.layout)) {
    at::parallel_for(0, g.slices * C, 1, [&](int64_t begin, int64_t end) {
      const int64_t block = std::min(S, kColumnBlock);
      std::vector<A> sdy(block), sdyx(block);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t off = plane_offset(g, i);
        std::tie(sum_dy[i], sum_dy_xhat[i]) =
            plane_grad_sums(gp + off, xp + off, n, S, C * S, k, i, sdy, sdyx);
      }
    });
    return;
  }
  const RowPlan plan = row_plan(g, p.layout, g.slices);
  const int64_t W = plan.W, T = plan.chunks, per = W / C;
  std::vector<A> mean(g.slices * W);
  for (int64_t d = 0; d < g.slices; ++d) {
    for (int64_t w = 0; w < W; ++w) mean[d * W + w] = k.mean[d * C + w / per];
  }
  std::vector<A> psdy(g.slices * T * W, A(0)), psdyx(g.slices * T * W, A(0));
  at::parallel_for(0, g.slices * T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / T, t = task % T;
      const int64_t r0 = plan.first_row(t), r1 = plan.first_row(t + 1);
      const int64_t off = (d * plan.rows_per_slice + r0) * W;
      grad_sums_rows<scalar_t, A>(gp + off, xp + off, r1 - r0, W, W, mean.data() + d * W,
                                  psdy.data() + task * W, psdyx.data() + task * W);
    }
  });
  for (int64_t d = 0; d < g.slices; ++d) {
    for (int64_t c = 0; c < C; ++c) {
      A a = 0, b = 0;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t v = 0; v < per; ++v) {
          a += psdy[(d * T + t) * W + c * per + v];
          b += psdyx[(d * T + t) * W + c * per + v];
        }
      }
      sum_dy[d * C + c] = a;
      sum_dy_xhat[d * C + c] = b * k.invstd[d * C + c];
    }
  }
}

std::tuple<Tensor, Tensor> backward_reduce_cpu(const Tensor& dy_in, const Tensor& x_in,
                                               const Tensor& mean, const Tensor& invstd,
                                               const std::optional<Tensor>& weight,
                                               const std::optional<Tensor>& bias) {
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "syncbn_lab::backward_reduce: dy must have the shape and dtype of x, got ",
              dy_in.sizes(), " ", dy_in.scalar_type(), " and ", x_in.sizes(), " ",
              x_in.scalar_type());
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "backward_reduce");
  const Tensor dy = as_layout(dy_in, p.layout);
  Tensor sum_dy = at::zeros(mean.sizes(), p.x.options().dtype(p.acc));
  Tensor sum_dy_xhat = at::zeros(mean.sizes(), p.x.options().dtype(p.acc));
  if (p.x.numel() == 0) return {sum_dy, sum_dy_xhat};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "backward_reduce_cpu", [&] {
    using A = typename AccOf<scalar_t>::type;
    const auto k = coefficients<A>(p.mean, p.invstd, p.weight, p.bias, p.g.slices, p.g.C);
    A* s1 = sum_dy.mutable_data_ptr<A>();
    A* s2 = sum_dy_xhat.mutable_data_ptr<A>();
    backward_reduce_loops<scalar_t, A>(p, dy, k, s1, s2);
  });
  return {sum_dy, sum_dy_xhat};
}

// dx = scale * dy - kx * (x - mean) - k0, with kx = scale * invstd * sum_dy_xhat / m and
// k0 = scale * sum_dy / m: the formula of docs/batchnorm.md regrouped per channel.
// (kx, k0) of coefficient row i from its global sums over m values (inv_m = 1 / m): the one
// place the three dx loops take them from, so that they agree bit for bit.
template <typename A>
std::pair<A, A> dx_coefficients(const Coefficients<A>& k, int64_t i, A sum_dy, A sum_dy_xhat,
                                A inv_m) {
  return {k.scale[i] * k.invstd[i] * sum_dy_xhat * inv_m, k.scale[i] * sum_dy * inv_m};
}

template <typename T, typename A>
SYNCBN_CLONES void dx_planes(const T* __restrict__ dy, const T* __restrict__ x,
                             T* __restrict__ dx, int64_t planes, int64_t S, int64_t ld, A mean,
                             A scale, A kx, A k0) {
  for (int64_t p = 0; p < planes; ++p) {
    const T* __restrict__ xr = x + p * ld;
    const T* __restrict__ gr = dy + p * ld;
    T* __restrict__ outr = dx + p * ld;
    for (int64_t s = 0; s < S; ++s) {
      const A xm = widen<A>(xr[s]) - mean;
      const A g = widen<A>(gr[s]);
      outr[s] = narrow<T>(g * scale - kx * xm - k0);
    }
  }
}

template <typename T, typename A>
SYNCBN_CLONES void dx_rows(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                           int64_t rows, int64_t W, int64_t ld, const A* __restrict__ mean,
                           const A* __restrict__ scale, const A* __restrict__ kx,
                           const A* __restrict__ k0) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict__ xr = x + r * ld;
    const T* __restrict__ gr = dy + r * ld;
    T* __restrict__ outr = dx + r * ld;
    for (int64_t w = 0; w < W; ++w) {
      const A xm = widen<A>(xr[w]) - mean[w];
      const A g = widen<A>(gr[w]);
      outr[w] = narrow<T>(g * scale[w] - kx[w] * xm - k0[w]);
    }
  }
}

template <typename scalar_t, typename A>
void backward_elemt_loops(const Prepared& p, const Tensor& dy, const Coefficients<A>& k,
                          const std::vector<A>& kx, const std::vector<A>& k0, Tensor& dx) {
  const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
  const scalar_t* gp = dy.const_data_ptr<scalar_t>();
  scalar_t* op = dx.mutable_data_ptr<scalar_t>();
  const Geometry& g = p.g;
  const int64_t C = g.C, S = g.S;
  if (use_planes(g, p.layout)) {
    at::parallel_for(0, g.slices * C, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t off = plane_offset(g, i), ld = C * S;
        dx_planes<scalar_t, A>(gp + off, xp + off, op + off, g.n, S, ld, k.mean[i],
                               k.scale[i], kx[i], k0[i]);
      }
    });
    return;
  }
  const RowPlan plan = row_plan(g, p.layout, g.slices);
  const int64_t W = plan.W, per = W / C;
  std::vector<A> mean(g.slices * W), scale(g.slices * W), ekx(g.slices * W), ek0(g.slices * W);
  for (int64_t d = 0; d < g.slices; ++d) {
    for (int64_t w = 0; w < W; ++w) {
      const int64_t j = d * C + w / per;
      mean[d * W + w] = k.mean[j];
      scale[d * W + w] = k.scale[j];
      ekx[d * W + w] = kx[j];
      ek0[d * W + w] = k0[j];
    }
  }
  const int64_t rows = g.slices * plan.rows_per_slice;
  const int64_t grain = std::max<int64_t>(1, kElemGrain / std::max<int64_t>(W, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const auto piece = [&](int64_t d, int64_t r, int64_t count) {
      const int64_t o = r * W, w = d * W;
      dx_rows<scalar_t, A>(gp + o, xp + o, op + o, count, W, W, mean.data() + w,
                           scale.data() + w, ekx.data() + w, ek0.data() + w);
    };
    for_slice_pieces(begin, end, plan.rows_per_slice, 2 * W * p.x.element_size(), piece);
  });
}

Tensor backward_elemt_cpu(const Tensor& dy_in, const Tensor& x_in, const Tensor& mean,
                          const Tensor& invstd, const std::optional<Tensor>& weight,
                          const std::optional<Tensor>& bias, const Tensor& sum_dy,
                          const Tensor& sum_dy_xhat, const Tensor& count) {
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "syncbn_lab::backward_elemt: dy must have the shape and dtype of x, got ",
              dy_in.sizes(), " ", dy_in.scalar_type(), " and ", x_in.sizes(), " ",
              x_in.scalar_type());
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "backward_elemt");
  TORCH_CHECK(sum_dy.sizes() == mean.sizes() && sum_dy_xhat.sizes() == mean.sizes(),
              "syncbn_lab::backward_elemt: sum_dy and sum_dy_xhat must have the shape of mean ",
              mean.sizes(), ", got ", sum_dy.sizes(), " and ", sum_dy_xhat.sizes());
  TORCH_CHECK(count.numel() == 1 || count.numel() == p.g.slices,
              "syncbn_lab::backward_elemt: count must hold 1 or ", p.g.slices,
              " values (one per slice), got ", count.numel());
  const Tensor dy = as_layout(dy_in, p.layout);
  Tensor dx = empty_in_layout(p.x.sizes(), p.x.options(), p.layout);
  if (p.x.numel() == 0) return dx;
  const Tensor s1 = stat_as(sum_dy, x_in, p.acc);
  const Tensor s2 = stat_as(sum_dy_xhat, x_in, p.acc);
  const Tensor m = stat_as(count, x_in, p.acc).reshape({-1});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "backward_elemt_cpu", [&] {
    using A = typename AccOf<scalar_t>::type;
    const auto k = coefficients<A>(p.mean, p.invstd, p.weight, p.bias, p.g.slices, p.g.C);
    const A* s1p = s1.const_data_ptr<A>();
    const A* s2p = s2.const_data_ptr<A>();
    const A* mp = m.const_data_ptr<A>();
    const int64_t C = p.g.C;
    std::vector<A> kx(p.g.slices * C), k0(p.g.slices * C);
    for (int64_t i = 0; i < p.g.slices * C; ++i) {
      const A total = mp[m.numel() == 1 ? 0 : i / C];
      const A inv_m = total > A(0) ? A(1) / total : A(0);
      std::tie(kx[i], k0[i]) = dx_coefficients(k, i, s1p[i], s2p[i], inv_m);
    }
    backward_elemt_loops<scalar_t, A>(p, dy, k, kx, k0, dx);
  });
  return dx;
}

// ---------------------------------------------------------------------------------------
// batch_norm_train and its backward: single pass from memory. Each task reduces one piece of
// the input and then, while it is still in cache, writes y (or dx), which saves a pass over
// x in the forward and over x and dy in the backward.
//   planes: one task per (group, channel).
//   rows:   one task per (group, block of whole channels) when the group's rows fit in
//           kBlockBytes (see block_width), and for the backward of NCHW planes shorter than
//           a page (see column_block_width); otherwise the CPU primitives are called one
//           after the other (see for_slice_pieces for how the second pass finds some of the
//           rows in cache).
// ---------------------------------------------------------------------------------------

constexpr int64_t kBlockBytes = 1 << 20;  // input bytes of a single-pass rows group (in L2)
constexpr int64_t kPageBytes = 4096;  // shortest run of a row a column block may read
constexpr int64_t kColumnBlockBytes = 1 << 18;  // input bytes of one column block (in L2)

// Columns per block of the single-pass rows loops, 0 when they do not apply. A block is
// whole rows of a group (narrower blocks read each row in pieces a row apart, which the
// hardware prefetchers follow badly: measured slower than two passes), so the group's
// rows of all `inputs` tensors must fit in kBlockBytes; with several threads the rows are
// cut into blocks of whole channels, at least a cache line wide, one per task.
int64_t block_width(const RowPlan& plan, int64_t per, int64_t slices, int64_t element_size,
                    int64_t inputs) {
  const int64_t W = plan.W;
  if (W == 0 || plan.rows_per_slice * W * element_size * inputs > kBlockBytes) return 0;
  const int64_t line = std::max<int64_t>(1, 64 / element_size);
  const int64_t narrowest = std::min(W, per * ((line + per - 1) / per));
  const int64_t blocks_wanted = (2 * at::get_num_threads() + slices - 1) / slices;
  const int64_t width = (W + blocks_wanted - 1) / blocks_wanted;
  return std::max(narrowest, width / per * per);
}

// The exception to the rule above: the single-pass backward of ChannelsFirst input whose
// planes are shorter than a page (NCHW, small spatial sizes) takes blocks of whole channels
// that are at least a page wide, so that each row piece is one page-long run (the planes of
// adjacent channels of a sample), and hold at most kColumnBlockBytes; 0 when none fits or
// one block would hold the whole group. A plane task of that backward reads 2n runs a plane
// apart at once (dy and x of n samples), more than the prefetchers follow: the column
// blocks made the module step on (32,256,8,8) and (64,128,8,8) NCHW 6 % faster. For the
// forward (one input) the planes were faster than any column block.
int64_t column_block_width(const RowPlan& plan, int64_t per, int64_t element_size,
                           int64_t inputs) {
  const int64_t column_bytes = std::max<int64_t>(1, plan.rows_per_slice * element_size * inputs);
  const int64_t page = (kPageBytes / element_size + per - 1) / per * per;
  const int64_t fit = kColumnBlockBytes / column_bytes / per * per;
  return fit >= page && fit < plan.W ? fit : 0;
}

// How batch_norm_train (1 input) and its backward (2) run: as planes, in one pass over rows
// in blocks of `width` columns, or (neither) as the two-pass composite of the primitives.
struct SinglePass {
  bool planes = false;
  RowPlan plan;
  int64_t width = 0;
};

SinglePass single_pass(const Geometry& g, Layout layout, int64_t element_size, int64_t inputs) {
  SinglePass sp;
  sp.planes = use_planes(g, layout);
  sp.plan = row_plan(g, layout, g.slices);
  const int64_t per = sp.plan.W / std::max<int64_t>(g.C, 1);
  if (!sp.planes) {
    sp.width = block_width(sp.plan, per, g.slices, element_size, inputs);
  } else if (inputs == 2 && g.S * element_size < kPageBytes) {
    sp.width = column_block_width(sp.plan, per, element_size, inputs);
    sp.planes = sp.width == 0;
  }
  return sp;
}

// Where the single-pass forwards write their statistics, and the one place that turns a
// group's (mean, m2) into var, invstd and the affine coefficients of y.
template <typename A>
struct ForwardStats {
  const A* weight;  // null: 1
  const A* bias;    // null: 0
  A *mean, *var, *invstd;
  A count, eps;

  ForwardStats(const Tensor& w, const Tensor& b, Tensor& mean_out, Tensor& var_out,
               Tensor& invstd_out, int64_t values, double epsilon)
      : weight(w.defined() ? w.const_data_ptr<A>() : nullptr),
        bias(b.defined() ? b.const_data_ptr<A>() : nullptr),
        mean(mean_out.mutable_data_ptr<A>()),
        var(var_out.mutable_data_ptr<A>()),
        invstd(invstd_out.mutable_data_ptr<A>()),
        count(std::max(A(values), A(1))),  // an empty group has variance 0
        eps(static_cast<A>(epsilon)) {}

  // Stores row i (channel c) and returns its scale; the shift is shift_of(c).
  A finish(int64_t i, int64_t c, A mu, A m2) const {
    const A v = m2 / count;
    const A inv = A(1) / std::sqrt(v + eps);
    mean[i] = mu;
    var[i] = v;
    invstd[i] = inv;
    return weight ? weight[c] * inv : inv;  // as coefficients() computes it
  }
  A shift_of(int64_t c) const { return bias ? bias[c] : A(0); }
};

template <typename scalar_t, typename A>
void fused_forward_rows(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const Geometry& g, const RowPlan& plan, int64_t width, double eps,
                        Tensor& y, Tensor& mean, Tensor& var, Tensor& invstd) {
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* yp = y.mutable_data_ptr<scalar_t>();
  const int64_t C = g.C, W = plan.W, per = W / C, rows = plan.rows_per_slice;
  const int64_t blocks = (W + width - 1) / width;
  const ForwardStats<A> out(weight, bias, mean, var, invstd, rows * per, eps);
  at::parallel_for(0, g.slices * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> pivots(width), cmean(width), cm2(width), scale(width), shift(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / blocks, w0 = (task % blocks) * width;
      const int64_t B = std::min(width, W - w0);
      const int64_t off = d * rows * W + w0;
      // The pivot of a channel is its first value in the group, as in local_stats_cpu.
      for (int64_t w = 0; w < B; ++w) pivots[w] = static_cast<A>(xp[off + (w / per) * per]);
      std::fill_n(cmean.begin(), B, A(0));
      std::fill_n(cm2.begin(), B, A(0));
      welford_rows<scalar_t, A>(xp + off, rows, B, W, pivots.data(), cmean.data(), cm2.data());
      for (int64_t w = 0; w < B; w += per) {
        const int64_t c = (w0 + w) / per, i = d * C + c;
        Welford<A> total;
        for (int64_t v = 0; v < per; ++v) total.merge(A(rows), cmean[w + v], cm2[w + v]);
        const A mu = pivots[w] + total.mean;
        std::fill_n(scale.begin() + w, per, out.finish(i, c, mu, total.m2));
        std::fill_n(cmean.begin() + w, per, mu);
        std::fill_n(shift.begin() + w, per, out.shift_of(c));
      }
      affine_rows<scalar_t, A>(xp + off, yp + off, rows, B, W, cmean.data(), scale.data(),
                               shift.data());
    }
  });
}

template <typename scalar_t, typename A>
void fused_backward_rows(const Prepared& p, const Tensor& dy, const Coefficients<A>& k,
                         const RowPlan& plan, int64_t width, bool input_grad, Tensor& dx,
                         A* sum_dy, A* sum_dy_xhat) {
  const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
  const scalar_t* gp = dy.const_data_ptr<scalar_t>();
  scalar_t* op = input_grad ? dx.mutable_data_ptr<scalar_t>() : nullptr;
  const int64_t C = p.g.C, W = plan.W, per = W / C, rows = plan.rows_per_slice;
  const int64_t blocks = (W + width - 1) / width;
  const A inv_m = A(1) / A(rows * per);
  // A channel's sum over its per columns (1 for channels_last, S for NCHW column blocks).
  const auto channel_sum = [per](const A* v) { return per == 1 ? v[0] : lane_sum(v, per); };
  at::parallel_for(0, p.g.slices * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> mean(width), scale(width), sdy(width), sdyx(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / blocks, w0 = (task % blocks) * width;
      const int64_t B = std::min(width, W - w0);
      const int64_t off = d * rows * W + w0;
      for (int64_t w = 0; w < B; ++w) {
        const int64_t c = (w0 + w) / per;
        mean[w] = k.mean[d * C + c];
        scale[w] = k.scale[d * C + c];
      }
      std::fill_n(sdy.begin(), B, A(0));
      std::fill_n(sdyx.begin(), B, A(0));
      grad_sums_rows<scalar_t, A>(gp + off, xp + off, rows, B, W, mean.data(), sdy.data(),
                                  sdyx.data());
      for (int64_t w = 0; w < B; w += per) {
        const int64_t i = d * C + (w0 + w) / per;
        sum_dy[i] = channel_sum(sdy.data() + w);
        sum_dy_xhat[i] = channel_sum(sdyx.data() + w) * k.invstd[i];
        // The column sums are spent: their buffers now hold dx's coefficients per column.
        const auto [kx, k0] = dx_coefficients(k, i, sum_dy[i], sum_dy_xhat[i], inv_m);
        std::fill_n(sdyx.begin() + w, per, kx);
        std::fill_n(sdy.begin() + w, per, k0);
      }
      if (!input_grad) continue;
      const A* kx = sdyx.data();
      const A* k0 = sdy.data();
      dx_rows<scalar_t, A>(gp + off, xp + off, op + off, rows, B, W, mean.data(), scale.data(),
                           kx, k0);
    }
  });
}

template <typename scalar_t, typename A>
void fused_forward_planes(const Tensor& x, const Tensor& weight, const Tensor& bias,
                          const Geometry& g, double eps, Tensor& y, Tensor& mean, Tensor& var,
                          Tensor& invstd) {
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* yp = y.mutable_data_ptr<scalar_t>();
  const int64_t C = g.C, S = g.S, n = g.n;
  const ForwardStats<A> out(weight, bias, mean, var, invstd, n * S, eps);
  at::parallel_for(0, g.slices * C, 1, [&](int64_t begin, int64_t end) {
    const int64_t block = std::min(S, kColumnBlock);
    std::vector<A> cmean(block), cm2(block);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % C, off = plane_offset(g, i);
      const auto [mu, m2] = plane_stats(xp + off, n, S, C * S, cmean, cm2);
      const A scale = out.finish(i, c, mu, m2);
      affine_planes<scalar_t, A>(xp + off, yp + off, n, S, C * S, mu, scale,
                                 out.shift_of(c));
    }
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_train_cpu(
    const Tensor& x_in, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
    int64_t devices, int64_t group_size, double eps) {
  const Geometry g = batch_norm_train_geometry(x_in, devices, group_size);
  const Layout layout = layout_of(x_in);
  const auto [planes, plan, width] = single_pass(g, layout, x_in.element_size(), 1);
  if ((!planes && width == 0) || x_in.numel() == 0) {
    auto [count, mean, m2] = local_stats_cpu(x_in, g.slices);
    Tensor var = at::empty_like(m2);
    Tensor invstd = at::empty_like(m2);
    AT_DISPATCH_FLOATING_TYPES(m2.scalar_type(), "batch_norm_train_cpu_finalize", [&] {
      using A = scalar_t;
      const A* m2p = m2.const_data_ptr<A>();
      A* vp = var.mutable_data_ptr<A>();
      A* ip = invstd.mutable_data_ptr<A>();
      const A total = std::max(A(g.n * g.S), A(1));  // an empty slice has variance 0
      for (int64_t i = 0; i < m2.numel(); ++i) {
        vp[i] = m2p[i] / total;
        ip[i] = A(1) / std::sqrt(vp[i] + static_cast<A>(eps));
      }
    });
    Tensor y = forward_elemt_cpu(x_in, mean, invstd, weight, bias);
    return {y, mean, var, invstd};
  }
  const Tensor x = as_layout(x_in, layout);
  const auto acc = acc_dtype(x.scalar_type());
  const Tensor w = optional_param(weight, x, acc, "weight", "batch_norm_train");
  const Tensor b = optional_param(bias, x, acc, "bias", "batch_norm_train");
  Tensor y = empty_in_layout(x.sizes(), x.options(), layout);
  const auto opts = x.options().dtype(acc);
  Tensor mean = at::empty({g.slices, g.C}, opts);
  Tensor var = at::empty({g.slices, g.C}, opts);
  Tensor invstd = at::empty({g.slices, g.C}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "batch_norm_train_cpu", [&] {
    using A = typename AccOf<scalar_t>::type;
    if (planes) {
      fused_forward_planes<scalar_t, A>(x, w, b, g, eps, y, mean, var, invstd);
    } else {
      fused_forward_rows<scalar_t, A>(x, w, b, g, plan, width, eps, y, mean, var, invstd);
    }
  });
  return {y, mean, var, invstd};
}

template <typename scalar_t, typename A>
void fused_backward_planes(const Prepared& p, const Tensor& dy, const Coefficients<A>& k,
                           bool input_grad, Tensor& dx, A* sum_dy, A* sum_dy_xhat) {
  const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
  const scalar_t* gp = dy.const_data_ptr<scalar_t>();
  scalar_t* op = input_grad ? dx.mutable_data_ptr<scalar_t>() : nullptr;
  const Geometry& g = p.g;
  const int64_t C = g.C, S = g.S, n = g.n;
  const A inv_m = A(1) / A(n * S);
  at::parallel_for(0, g.slices * C, 1, [&](int64_t begin, int64_t end) {
    const int64_t block = std::min(S, kColumnBlock);
    std::vector<A> sdy(block), sdyx(block);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t off = plane_offset(g, i);
      std::tie(sum_dy[i], sum_dy_xhat[i]) =
          plane_grad_sums(gp + off, xp + off, n, S, C * S, k, i, sdy, sdyx);
      if (!input_grad) continue;
      const auto [kx, k0] = dx_coefficients(k, i, sum_dy[i], sum_dy_xhat[i], inv_m);
      dx_planes<scalar_t, A>(gp + off, xp + off, op + off, n, S, C * S, k.mean[i],
                             k.scale[i], kx, k0);
    }
  });
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_train_backward_cpu(
    const Tensor& dy_in, const Tensor& x_in, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias, const Tensor& mean, const Tensor& invstd,
    bool input_grad) {
  TORCH_CHECK(mean.dim() == 2, "syncbn_lab::batch_norm_train_backward: mean must be (G, C)");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "syncbn_lab::batch_norm_train_backward: dy must have the shape and dtype of x, "
              "got ", dy_in.sizes(), " ", dy_in.scalar_type(), " and ", x_in.sizes(), " ",
              x_in.scalar_type());
  const Prepared p = prepare(x_in, mean, invstd, weight, bias, "batch_norm_train_backward");
  const auto [planes, plan, width] = single_pass(p.g, p.layout, x_in.element_size(), 2);
  if ((!planes && width == 0) || x_in.numel() == 0) {
    auto [sum_dy, sum_dy_xhat] = backward_reduce_cpu(dy_in, x_in, mean, invstd, weight, bias);
    Tensor dx = at::empty({0}, x_in.options());
    if (input_grad) {
      const Tensor count = at::scalar_tensor(static_cast<double>(p.g.n * p.g.S), sum_dy.options());
      dx = backward_elemt_cpu(dy_in, x_in, mean, invstd, weight, bias, sum_dy, sum_dy_xhat,
                              count);
    }
    return with_param_grads(dx, sum_dy, sum_dy_xhat);
  }
  const Tensor dy = as_layout(dy_in, p.layout);
  Tensor dx = input_grad ? empty_in_layout(p.x.sizes(), p.x.options(), p.layout)
                         : at::empty({0}, p.x.options());
  const auto opts = p.x.options().dtype(p.acc);
  Tensor sum_dy = at::empty({p.g.slices, p.g.C}, opts);
  Tensor sum_dy_xhat = at::empty({p.g.slices, p.g.C}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.x.scalar_type(),
                                  "batch_norm_train_backward_cpu", [&] {
    using A = typename AccOf<scalar_t>::type;
    const auto k = coefficients<A>(p.mean, p.invstd, p.weight, p.bias, p.g.slices, p.g.C);
    A* s1 = sum_dy.mutable_data_ptr<A>();
    A* s2 = sum_dy_xhat.mutable_data_ptr<A>();
    if (planes) {
      fused_backward_planes<scalar_t, A>(p, dy, k, input_grad, dx, s1, s2);
    } else {
      fused_backward_rows<scalar_t, A>(p, dy, k, plan, width, input_grad, dx, s1, s2);
    }
  });
  return with_param_grads(dx, sum_dy, sum_dy_xhat);
}

// update_running_stats (contract in syncbn.cpp) without temporaries: on the CPU the eager
// step's bookkeeping then allocates one 0-dim tensor instead of a dozen small ones.
Tensor update_running_stats_cpu(const std::optional<Tensor>& running_mean,
                                const std::optional<Tensor>& running_var, const Tensor& mean_in,
                                const Tensor& var_in, const Tensor& invstd_in, double factor,
                                int64_t count, double mean_limit) {
  Tensor mean, var, invstd;  // named (not bound) so that the kernels' lambdas capture them
  std::tie(mean, var, invstd) =
      update_running_stats_inputs(running_mean, running_var, mean_in, var_in, invstd_in);
  const auto acc = mean.scalar_type();
  const int64_t C = mean.size(1);
  bool coarse = false;
  AT_DISPATCH_FLOATING_TYPES(acc, "update_running_stats_cpu", [&] {
    const scalar_t* mp = mean.const_data_ptr<scalar_t>();
    const scalar_t* ip = invstd.const_data_ptr<scalar_t>();
    for (int64_t i = 0; mean_limit > 0 && i < mean.numel(); ++i) {
      coarse = coarse || std::abs(mp[i] * ip[i]) > mean_limit;
    }
    if (coarse || !running_mean.has_value() || C == 0) return;
    check_running_buffers(*running_mean, *running_var, mean, count);
    const scalar_t* vp = var.const_data_ptr<scalar_t>();
    // As var[0].mul(count / (count - 1)) in the statistics' dtype.
    const scalar_t unbias = static_cast<scalar_t>(static_cast<double>(count) / (count - 1));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, running_mean->scalar_type(),
                                    "update_running_stats_cpu_buffers", [&] {
      scalar_t* rm = running_mean->mutable_data_ptr<scalar_t>();
      scalar_t* rv = running_var->mutable_data_ptr<scalar_t>();
      using R = at::opmath_type<scalar_t>;
      const R w = static_cast<R>(factor);
      // As torch.lerp's vectorised CPU kernel: fma(w, end - start, start) for |w| < 0.5,
      // else fma(w - 1, end - start, end) (bitwise equal; tested).
      const auto lerp = [w](scalar_t start, scalar_t end) {
        const R s0 = static_cast<R>(start), e = static_cast<R>(end);
        const bool small = std::abs(w) < R(0.5);
        return static_cast<scalar_t>(std::fma(small ? w : w - R(1), e - s0, small ? s0 : e));
      };
      for (int64_t c = 0; c < C; ++c) {
        rm[c] = lerp(rm[c], static_cast<scalar_t>(mp[c]));
        rv[c] = lerp(rv[c], static_cast<scalar_t>(vp[c] * unbias));
      }
    });
  });
  return at::scalar_tensor(coarse, mean_in.options().dtype(at::kBool));
}

}  // namespace

TORCH_LIBRARY_IMPL(syncbn_lab, CPU, m) {
  m.impl("local_stats", &local_stats_cpu);
  m.impl("forward_elemt", &forward_elemt_cpu);
  m.impl("backward_reduce", &backward_reduce_cpu);
  m.impl("backward_elemt", &backward_elemt_cpu);
  m.impl("batch_norm_train", &batch_norm_train_cpu);
  m.impl("batch_norm_train_backward", &batch_norm_train_backward_cpu);
  m.impl("update_running_stats", &update_running_stats_cpu);
}

}  // namespace syncbn_lab
