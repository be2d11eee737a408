// Shared declarations of the syncbn_lab ops: layouts, argument checks, dtypes.
//
// Every kernel (CPU in syncbn_cpu.cpp, CUDA in cuda/syncbn.cu) sees its input as
// x of logical shape (N, C, S), S = the product of the spatial sizes (1 for 2-D input),
// cut along N into `slices` equal device slices of n = N / slices samples each.
// Two memory layouts are handled natively:
//   ChannelsFirst: x.is_contiguous()                      -> memory [N][C][S]
//   ChannelsLast:  channels_last / channels_last_3d dense  -> memory [N][S][C]
// anything else is copied to ChannelsFirst first. Outputs shaped like x (y, dx) use the
// layout the kernel ran in; register_fake in ops.py applies the same rule.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace syncbn_lab {

enum class Layout { ChannelsFirst, ChannelsLast };

// True when every dimension of size > 1 has the stride of a dense (N, *spatial, C) tensor.
inline bool is_channels_last_dense(const at::Tensor& x) {
  if (x.dim() < 3) return false;
  const auto sizes = x.sizes();
  const auto strides = x.strides();
  int64_t expected = 1;
  if (sizes[1] != 1 && strides[1] != expected) return false;
  expected *= sizes[1];
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return sizes[0] == 1 || strides[0] == expected;
}

inline Layout layout_of(const at::Tensor& x) {
  if (x.is_contiguous()) return Layout::ChannelsFirst;
  if (is_channels_last_dense(x)) return Layout::ChannelsLast;
  return Layout::ChannelsFirst;  // after a copy, see as_layout()
}

inline std::vector<int64_t> channels_last_strides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t expected = 1;
  strides[1] = expected;
  expected *= sizes[1];
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 2; --d) {
    strides[d] = expected;
    expected *= sizes[d];
  }
  strides[0] = expected;
  return strides;
}

inline at::Tensor empty_in_layout(at::IntArrayRef sizes, const at::TensorOptions& options,
                                  Layout layout) {
  if (layout == Layout::ChannelsFirst) return at::empty(sizes, options);
  return at::empty_strided(sizes, channels_last_strides(sizes), options);
}

// t with exactly the strides of `layout` (a copy only when it has other strides).
inline at::Tensor as_layout(const at::Tensor& t, Layout layout) {
  if (layout == Layout::ChannelsFirst) return t.contiguous();
  if (is_channels_last_dense(t)) return t;
  auto out = empty_in_layout(t.sizes(), t.options(), layout);
  out.copy_(t);
  return out;
}

// (N, C, S) of an input of 2 to 5 dimensions, checked against the number of slices.
struct Geometry {
  int64_t N = 0, C = 0, S = 1, slices = 1, n = 0;  // n = N / slices samples per slice
};

inline Geometry geometry_of(const at::Tensor& x, int64_t slices, const char* op) {
  TORCH_CHECK(x.dim() >= 2 && x.dim() <= 5, "syncbn_lab::", op,
              ": expected a 2-D to 5-D input (N, C, *spatial), got ", x.dim(), "-D");
  TORCH_CHECK(slices >= 1, "syncbn_lab::", op, ": the number of device slices must be >= 1, got ",
              slices);
  Geometry g;
  g.N = x.size(0);
  g.C = x.size(1);
  g.S = 1;
  for (int64_t d = 2; d < x.dim(); ++d) g.S *= x.size(d);
  g.slices = slices;
  TORCH_CHECK(g.N % slices == 0, "syncbn_lab::", op, ": the batch size ", g.N,
              " is not divisible by the number of device slices ", slices);
  g.n = g.N / slices;
  return g;
}

inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_floating(const at::Tensor& x, const char* op) {
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
              "syncbn_lab::", op, ": expected a float32, float64, float16 or bfloat16 input, got ",
              t);
}

// The argument checks of the batch_norm_train kernels; returns the geometry of x cut into
// its devices / group_size statistic groups.
inline Geometry batch_norm_train_geometry(const at::Tensor& x, int64_t devices,
                                          int64_t group_size) {
  TORCH_CHECK(group_size >= 1 && devices % group_size == 0,
              "syncbn_lab::batch_norm_train: group_size must divide devices, got group_size=",
              group_size, " and devices=", devices);
  check_floating(x, "batch_norm_train");
  geometry_of(x, devices, "batch_norm_train");  // the batch splits into `devices` slices
  return geometry_of(x, devices / group_size, "batch_norm_train");
}

// Per-slice statistics (mean, invstd, sums) arrive as (G, C) or (C,) (one shared row);
// returns G and checks that it divides the batch.
inline int64_t slices_of_stats(const at::Tensor& x, const at::Tensor& stat, const char* what,
                               const char* op) {
  const int64_t C = x.size(1);
  TORCH_CHECK((stat.dim() == 1 && stat.size(0) == C) || (stat.dim() == 2 && stat.size(1) == C),
              "syncbn_lab::", op, ": ", what, " must have shape (C,) or (slices, C) with C = ", C,
              ", got ", stat.sizes());
  return stat.dim() == 1 ? 1 : stat.size(0);
}

// Small per-channel/per-slice tensors as contiguous acc-typed tensors on x's device.
inline at::Tensor stat_as(const at::Tensor& t, const at::Tensor& x, at::ScalarType acc) {
  TORCH_CHECK(t.device() == x.device(), "syncbn_lab: expected all tensors on ", x.device(),
              ", got one on ", t.device());
  return t.to(acc).contiguous();
}

inline at::Tensor optional_param(const std::optional<at::Tensor>& p, const at::Tensor& x,
                                 at::ScalarType acc, const char* what, const char* op) {
  if (!p.has_value() || !p->defined()) return at::Tensor();
  TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(1), "syncbn_lab::", op, ": ", what,
              " must have shape (C,) with C = ", x.size(1), ", got ", p->sizes());
  return stat_as(*p, x, acc);
}

// Inputs of the elementwise/backward ops (forward_elemt, backward_reduce, backward_elemt,
// batch_norm_train_backward) after their checks: x and its statistics and parameters in one
// layout and the accumulation dtype. Shared by the CPU and CUDA kernels (cuda/syncbn.cu
// checks the device first).
struct Prepared {
  Geometry g;
  Layout layout = Layout::ChannelsFirst;
  at::Tensor x, mean, invstd, weight, bias;
  at::ScalarType acc = at::kFloat;
};

inline Prepared prepare(const at::Tensor& x_in, const at::Tensor& mean, const at::Tensor& invstd,
                        const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, const char* op) {
  check_floating(x_in, op);
  Prepared p;
  const int64_t slices = slices_of_stats(x_in, mean, "mean", op);
  TORCH_CHECK(invstd.sizes() == mean.sizes(), "syncbn_lab::", op,
              ": invstd must have the shape of mean ", mean.sizes(), ", got ", invstd.sizes());
  p.g = geometry_of(x_in, slices, op);
  p.layout = layout_of(x_in);
  p.x = as_layout(x_in, p.layout);
  p.acc = acc_dtype(x_in.scalar_type());
  p.mean = stat_as(mean, x_in, p.acc);
  p.invstd = stat_as(invstd, x_in, p.acc);
  p.weight = optional_param(weight, x_in, p.acc, "weight", op);
  p.bias = optional_param(bias, x_in, p.acc, "bias", op);
  return p;
}

// Argument checks of update_running_stats (contract in syncbn.cpp), shared by its kernels;
// returns mean, var and invstd as contiguous tensors in the statistics' acc dtype, on mean's
// device.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> update_running_stats_inputs(
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const at::Tensor& mean, const at::Tensor& var, const at::Tensor& invstd) {
  TORCH_CHECK(mean.dim() == 2 && var.sizes() == mean.sizes() && invstd.sizes() == mean.sizes(),
              "syncbn_lab::update_running_stats: mean, var and invstd must be (G, C), got ",
              mean.sizes(), ", ", var.sizes(), " and ", invstd.sizes());
  TORCH_CHECK(running_mean.has_value() == running_var.has_value(),
              "syncbn_lab::update_running_stats: give both running statistics or neither");
  const auto acc = acc_dtype(mean.scalar_type());
  return {stat_as(mean, mean, acc), stat_as(var, mean, acc), stat_as(invstd, mean, acc)};
}

// The running statistics an update_running_stats kernel is about to move: (C,), contiguous,
// one dtype, on the statistics' device, and count > 1 values behind the variance.
inline void check_running_buffers(const at::Tensor& running_mean, const at::Tensor& running_var,
                                  const at::Tensor& mean, int64_t count) {
  const int64_t C = mean.size(1);
  TORCH_CHECK(count > 1, "syncbn_lab::update_running_stats: count must be > 1, got ", count);
  TORCH_CHECK(running_mean.numel() == C && running_var.numel() == C &&
                  running_mean.is_contiguous() && running_var.is_contiguous(),
              "syncbn_lab::update_running_stats: running statistics must be contiguous (C,)");
  TORCH_CHECK(running_var.scalar_type() == running_mean.scalar_type(),
              "syncbn_lab::update_running_stats: running statistics of different dtypes");
  TORCH_CHECK(running_mean.device() == mean.device() && running_var.device() == mean.device(),
              "syncbn_lab::update_running_stats: running statistics must be on ", mean.device());
}

// The result of batch_norm_train_backward from dx and the per-row sums (G, C): d(weight) and
// d(bias) are the sums over the rows.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> with_param_grads(
    at::Tensor dx, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xhat) {
  if (sum_dy.size(0) == 1) return {std::move(dx), sum_dy_xhat.view({-1}), sum_dy.view({-1})};
  return {std::move(dx), sum_dy_xhat.sum(0), sum_dy.sum(0)};
}

// The device-generic compositions of the primitives (syncbn.cpp), for kernels that take a
// faster path only for some inputs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_composite(
    const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, int64_t devices, int64_t group_size, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_train_backward_composite(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& invstd,
    bool input_grad);

}  // namespace syncbn_lab
