// CPU kernel of lightning_balanced::batched_nms_padded: per image, the padding boxes (score -inf) are dropped,
// an image with another NaN or infinite value gets num_kept = -1, and the rest goes to the CPU kernel of nms
// or batched_nms (cpu/nms_kernel.cpp), whose kept indices are mapped back and truncated to max_output. So
// each image's result is exactly batched_nms on its boxes, as on CUDA.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "ops/nms_checks.h"

namespace {

std::tuple<at::Tensor, at::Tensor> batched_nms_padded_cpu(const at::Tensor& boxes, const at::Tensor& scores,
                                                          const std::optional<at::Tensor>& idxs, double iou_threshold,
                                                          int64_t max_output, int64_t offset) {
  constexpr const char* op = "batched_nms_padded";
  lightning_balanced::check_padded_args(op, boxes, scores, idxs, iou_threshold, max_output, offset);
  TORCH_CHECK_VALUE(boxes.device().is_cpu(), op, ": the CPU kernel got tensors on ", boxes.device());
  static auto nms = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("lightning_balanced::nms", "")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t)>();
  static auto batched_nms =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lightning_balanced::batched_nms", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>();
  const int64_t batch = boxes.size(0);
  at::Tensor keep = at::full({batch, max_output}, -1, boxes.options().dtype(at::kLong));
  at::Tensor num_kept = at::empty({batch}, boxes.options().dtype(at::kLong));
  int64_t* counts = num_kept.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor image_scores = scores[b];
    const at::Tensor real = image_scores.isneginf().logical_not();
    const bool finite = image_scores.isfinite().logical_or(real.logical_not()).all().item<bool>() &&
                        boxes[b].isfinite().all(1).logical_or(real.logical_not()).all().item<bool>();
    if (!finite) {
      counts[b] = -1;
      continue;
    }
    const at::Tensor index = real.nonzero().squeeze(1);
    const at::Tensor image_boxes = boxes[b].index_select(0, index);
    const at::Tensor real_scores = image_scores.index_select(0, index);
    const at::Tensor kept =
        idxs.has_value()
            ? batched_nms.call(image_boxes, real_scores, (*idxs)[b].index_select(0, index), iou_threshold, offset)
            : nms.call(image_boxes, real_scores, iou_threshold, offset);
    const int64_t count = std::min(kept.size(0), max_output);
    keep[b].narrow(0, 0, count).copy_(index.index_select(0, kept.narrow(0, 0, count)));
    counts[b] = count;
  }
  return {keep, num_kept};
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CPU, m) { m.impl("batched_nms_padded", &batched_nms_padded_cpu); }
