// Autocast registrations of nms and batched_nms: under torch.autocast (CUDA or CPU), half-precision
// boxes and scores are cast to float32 before the kernel runs, so the op computes in float32.
// (The kernels already compute float16/bfloat16 in float32, so results are the same as without autocast.)

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

at::Tensor to_float32(const at::Tensor& t) {
  const auto dt = t.scalar_type();
  return (dt == at::kHalf || dt == at::kBFloat16) ? t.to(at::kFloat) : t;
}

at::Tensor nms_autocast(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold, int64_t offset) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_balanced::nms", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t)>();
  return op.call(to_float32(boxes), to_float32(scores), iou_threshold, offset);
}

at::Tensor batched_nms_autocast(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                                double iou_threshold, int64_t offset) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_balanced::batched_nms", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>();
  return op.call(to_float32(boxes), to_float32(scores), idxs, iou_threshold, offset);
}

std::tuple<at::Tensor, at::Tensor> batched_nms_padded_autocast(const at::Tensor& boxes, const at::Tensor& scores,
                                                               const std::optional<at::Tensor>& idxs,
                                                               double iou_threshold, int64_t max_output,
                                                               int64_t offset) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_balanced::batched_nms_padded", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const std::optional<at::Tensor>&, double, int64_t,
                                                                 int64_t)>();
  return op.call(to_float32(boxes), to_float32(scores), idxs, iou_threshold, max_output, offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, Autocast, m) {
  m.impl("nms", &nms_autocast);
  m.impl("batched_nms", &batched_nms_autocast);
  m.impl("batched_nms_padded", &batched_nms_padded_autocast);
}

TORCH_LIBRARY_IMPL(lightning_balanced, AutocastCPU, m) {
  m.impl("nms", &nms_autocast);
  m.impl("batched_nms", &batched_nms_autocast);
  m.impl("batched_nms_padded", &batched_nms_padded_autocast);
}
