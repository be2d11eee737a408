// Autograd of syncbn_lab::batch_norm_train, in C++ for every device.
//
// Registered under the Autograd dispatch key, so an eager training step pays no Python for
// the op's forward or backward (a sizeable part of a small layer's step), and
// torch.compile traces it like torchvision's C++-autograd ops: AOTAutograd runs this
// kernel on fake tensors, and the backward graph gets the batch_norm_train_backward op,
// whose fake kernel is registered in syncbn_lab/nn/ops.py.
#include <torch/autograd.h>
#include <torch/library.h>

namespace syncbn_lab {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<Tensor> optional_of(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

class BatchNormTrain : public torch::autograd::Function<BatchNormTrain> {
 public:
  // weight and bias are optional: apply() then makes them no input of the graph node.
  static variable_list forward(AutogradContext* ctx, const Tensor& x,
                               const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, int64_t devices,
                               int64_t group_size, double eps) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("syncbn_lab::batch_norm_train", "")
                         .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
                             const Tensor&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, int64_t, int64_t, double)>();
    // mean, var and invstd take no gradient: without this the engine would hand backward
    // three zero-filled (G, C) tensors per step (three fill launches on a GPU).
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, var, invstd] = op.call(x, weight, bias, devices, group_size, eps);
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), mean, invstd});
    ctx->mark_non_differentiable({mean, var, invstd});
    return {y, mean, var, invstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("syncbn_lab::batch_norm_train_backward", "")
                         .typed<std::tuple<Tensor, Tensor, Tensor>(
                             const Tensor&, const Tensor&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, const Tensor&, const Tensor&,
                             bool)>();
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& weight = saved[1];
    const Tensor& bias = saved[2];
    // needs_input_grad counts the tensor inputs that are present: x, [weight], [bias].
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_dweight = weight.defined() && ctx->needs_input_grad(1);
    const bool need_dbias = bias.defined() && ctx->needs_input_grad(weight.defined() ? 2 : 1);
    Tensor dy = grads[0];
    if (!dy.defined()) dy = at::zeros_like(x);  // y unused: the outputs' gradients are zero
    auto [dx, dweight, dbias] =
        op.call(dy, x, optional_of(weight), optional_of(bias), saved[3], saved[4], need_dx);
    return {need_dx ? dx : Tensor(),
            need_dweight ? dweight.to(weight.scalar_type()) : Tensor(),
            need_dbias ? dbias.to(bias.scalar_type()) : Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_train_autograd(
    const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
    int64_t devices, int64_t group_size, double eps) {
  auto out = BatchNormTrain::apply(x, weight, bias, devices, group_size, eps);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(syncbn_lab, Autograd, m) {
  m.impl("batch_norm_train", &batch_norm_train_autograd);
}

}  // namespace syncbn_lab
