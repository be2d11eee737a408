// Op schemas of the syncbn_lab library (declared once, here) and the composite
// batch_norm_train, built from the primitives for every device.
// Kernels: syncbn_cpu.cpp (CPU), cuda/syncbn.cu (CUDA). How to add an op: README.md.
#include <Python.h>
#include <torch/library.h>

#include "syncbn.h"

extern "C" {
// `import syncbn_lab._C` only has to load this library so that its TORCH_LIBRARY blocks
// run; the ops are then reached as torch.ops.syncbn_lab.*. No Python bindings, so the
// module is built against the stable ABI (py_limited_api).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "syncbn_lab's fused BatchNorm ops; use torch.ops.syncbn_lab or syncbn_lab.nn.ops.",
      -1,    // size of per-interpreter state
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}

namespace syncbn_lab {

using at::Tensor;

// The composite calls the primitives through the dispatcher, so it runs on any device
// that implements them. The CPU and CUDA register kernels of their own (syncbn_cpu.cpp,
// cuda/syncbn.cu); the CUDA ones call this composite for empty input.
std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_train_composite(
    const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
    int64_t devices, int64_t group_size, double eps) {
  TORCH_CHECK(devices >= 1, "syncbn_lab::batch_norm_train: devices must be >= 1, got ", devices);
  TORCH_CHECK(group_size >= 1 && devices % group_size == 0,
              "syncbn_lab::batch_norm_train: group_size must divide devices, got group_size=",
              group_size, " and devices=", devices);
  static auto local_stats_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn_lab::local_stats", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, int64_t)>();
  static auto forward_elemt_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn_lab::forward_elemt", "")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                        const std::optional<Tensor>&)>();

  TORCH_CHECK(x.dim() >= 1 && x.size(0) % devices == 0,
              "syncbn_lab::batch_norm_train: the batch size ", x.dim() >= 1 ? x.size(0) : 0,
              " is not divisible by the number of device slices ", devices);
  // A group's statistics in one pass over its slices (the slices of a group are consecutive).
  auto [count, mean, m2] = local_stats_op.call(x, devices / group_size);
  // An empty slice has count 0 and m2 0: its variance is 0, never NaN.
  auto var = m2.div(count.clamp_min(1).unsqueeze(-1));
  auto invstd = var.add(eps).rsqrt_();
  auto y = forward_elemt_op.call(x, mean, invstd, weight, bias);
  return {y, mean, var, invstd};
}

// The backward of batch_norm_train in one op, so that its C++ autograd node
// (syncbn_autograd.cpp) makes a single call and a compiled backward graph holds one node:
// dx (empty when not `input_grad`), d(weight) and d(bias) summed over the statistic rows, in
// the statistics' dtype.
std::tuple<Tensor, Tensor, Tensor> batch_norm_train_backward_composite(
    const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias, const Tensor& mean, const Tensor& invstd,
    bool input_grad) {
  static auto backward_reduce_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn_lab::backward_reduce", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, const std::optional<Tensor>&,
                                            const std::optional<Tensor>&)>();
  static auto backward_elemt_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn_lab::backward_elemt", "")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const std::optional<Tensor>&, const std::optional<Tensor>&,
                        const Tensor&, const Tensor&, const Tensor&)>();
  TORCH_CHECK(mean.dim() == 2, "syncbn_lab::batch_norm_train_backward: mean must be (G, C)");
  auto [sum_dy, sum_dy_xhat] = backward_reduce_op.call(dy, x, mean, invstd, weight, bias);
  Tensor dx;
  if (input_grad) {
    const int64_t rows = mean.size(0);
    const int64_t count = x.numel() / std::max<int64_t>(1, x.size(1) * rows);
    dx = backward_elemt_op.call(dy, x, mean, invstd, weight, bias, sum_dy, sum_dy_xhat,
                                at::scalar_tensor(static_cast<double>(count), mean.options()));
  } else {
    dx = at::empty({0}, x.options());
  }
  return with_param_grads(dx, sum_dy, sum_dy_xhat);
}

TORCH_LIBRARY(syncbn_lab, m) {
  // Shapes: x (N, C, *spatial); `devices` equal slices along N; stats in float32
  // (float64 for float64 input). See README.md for the full contract of each op.
  m.def("local_stats(Tensor x, int devices) -> (Tensor count, Tensor mean, Tensor m2)");
  m.def(
      "forward_elemt(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) "
      "-> Tensor");
  m.def(
      "backward_reduce(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, "
      "Tensor? bias) -> (Tensor sum_dy, Tensor sum_dy_xhat)");
  m.def(
      "backward_elemt(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, "
      "Tensor? bias, Tensor sum_dy, Tensor sum_dy_xhat, Tensor count) -> Tensor");
  m.def(
      "batch_norm_train(Tensor x, Tensor? weight, Tensor? bias, int devices, int group_size, "
      "float eps) -> (Tensor y, Tensor mean, Tensor var, Tensor invstd)");
  m.def(
      "batch_norm_train_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor invstd, bool input_grad) "
      "-> (Tensor dx, Tensor dweight, Tensor dbias)");
  // update_running_stats has a kernel per device (CPU and CUDA), no composite.
  m.def(
      "update_running_stats(Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor mean, "
      "Tensor var, Tensor invstd, float factor, int count, float mean_limit) "
      "-> Tensor too_coarse");
}

TORCH_LIBRARY_IMPL(syncbn_lab, CompositeExplicitAutograd, m) {
  m.impl("batch_norm_train", &batch_norm_train_composite);
  m.impl("batch_norm_train_backward", &batch_norm_train_backward_composite);
}

}  // namespace syncbn_lab
