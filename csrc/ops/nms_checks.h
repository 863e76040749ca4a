// Preconditions shared by the CPU and CUDA kernels of nms and batched_nms.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <optional>

namespace lightning_balanced {

// Argument checks of nms and batched_nms, the only copy of these rules for the compiled ops: the Python
// wrapper checks only what the dispatcher cannot see (that the arguments are tensors and numbers), and the
// fake kernels check nothing, so bad input raises the same ValueError/TypeError (TORCH_CHECK_VALUE /
// TORCH_CHECK_TYPE) in eager mode and under torch.compile, where these run when the compiled graph does.
// lightning_balanced/ops/_checks.py mirrors them for the pure-PyTorch reference.
inline void check_scalar_args(const char* op, double iou_threshold, int64_t offset) {
  TORCH_CHECK_VALUE(iou_threshold >= 0.0 && iou_threshold <= 1.0, op,
                    ": iou_threshold must be a number in [0, 1], got ", iou_threshold);
  TORCH_CHECK_VALUE(offset == 0 || offset == 1, op, ": offset must be 0 or 1, got ", offset);
}

// Boxes of a floating dtype, scores of the same dtype, both on one device.
inline void check_dtypes_and_devices(const char* op, const at::Tensor& boxes, const at::Tensor& scores) {
  const auto dt = boxes.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16, op,
                   ": boxes must be float16, bfloat16, float32 or float64, got ", dt);
  TORCH_CHECK_TYPE(scores.scalar_type() == dt, op, ": scores must have the dtype of boxes (", dt, "), got ",
                   scores.scalar_type());
  TORCH_CHECK_VALUE(boxes.device() == scores.device(), op, ": boxes and scores must be on the same device, got ",
                    boxes.device(), " and ", scores.device());
}

inline void check_nms_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
                           int64_t offset) {
  TORCH_CHECK_VALUE(boxes.dim() == 2 && boxes.size(1) == 4, op, ": boxes must have shape (N, 4), got ",
                    boxes.sizes());
  TORCH_CHECK_VALUE(scores.dim() == 1, op, ": scores must have shape (N,), got ", scores.sizes());
  TORCH_CHECK_VALUE(boxes.size(0) == scores.size(0), op, ": boxes and scores must have the same length N, got ",
                    boxes.size(0), " boxes and ", scores.size(0), " scores");
  check_dtypes_and_devices(op, boxes, scores);
  check_scalar_args(op, iou_threshold, offset);
  TORCH_CHECK_VALUE(boxes.size(0) <= std::numeric_limits<int32_t>::max(), op,
                    ": at most 2^31 - 1 boxes are supported, got ", boxes.size(0));
}

// As torchvision.ops.batched_nms: input with no box coordinates at all (boxes.numel() == 0, e.g. shape (0, 4)
// or (0,)) gives an empty result whatever the shapes and dtypes of scores and idxs.
inline bool batched_nms_input_is_empty(const at::Tensor& boxes, double iou_threshold, int64_t offset) {
  check_scalar_args("batched_nms", iou_threshold, offset);
  return boxes.numel() == 0;
}

// Class ids may have any integer dtype; the kernels read them as int64 (see idxs_as_int64).
inline void check_idxs_arg(const at::Tensor& boxes, const at::Tensor& idxs) {
  TORCH_CHECK_VALUE(idxs.dim() == 1 && idxs.size(0) == boxes.size(0),
                    "batched_nms: idxs must have shape (N,) with N = ", boxes.size(0), ", got ", idxs.sizes());
  TORCH_CHECK_TYPE(at::isIntegralType(idxs.scalar_type(), /*includeBool=*/false),
                   "batched_nms: idxs must have an integer dtype, got ", idxs.scalar_type());
  TORCH_CHECK_VALUE(idxs.device() == boxes.device(), "batched_nms: idxs must be on the device of boxes (",
                    boxes.device(), "), got ", idxs.device());
}

inline at::Tensor idxs_as_int64(const at::Tensor& idxs) { return idxs.to(at::kLong); }

// batched_nms_padded: boxes [B, N, 4], scores [B, N], idxs [B, N] (or none), max_output >= 0. Values are not
// checked here (that would need a sync): a NaN or infinite value gives the image num_kept = -1 instead.
inline void check_padded_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                              const std::optional<at::Tensor>& idxs, double iou_threshold, int64_t max_output,
                              int64_t offset) {
  TORCH_CHECK_VALUE(boxes.dim() == 3 && boxes.size(2) == 4, op, ": boxes must have shape (B, N, 4), got ",
                    boxes.sizes());
  TORCH_CHECK_VALUE(scores.dim() == 2 && scores.size(0) == boxes.size(0) && scores.size(1) == boxes.size(1), op,
                    ": scores must have shape (B, N) = (", boxes.size(0), ", ", boxes.size(1), "), got ",
                    scores.sizes());
  check_dtypes_and_devices(op, boxes, scores);
  if (idxs.has_value()) {
    TORCH_CHECK_VALUE(idxs->sizes() == scores.sizes(), op, ": idxs must have shape (B, N) = (", boxes.size(0), ", ",
                      boxes.size(1), "), got ", idxs->sizes());
    TORCH_CHECK_TYPE(at::isIntegralType(idxs->scalar_type(), /*includeBool=*/false), op,
                     ": idxs must have an integer dtype, got ", idxs->scalar_type());
    TORCH_CHECK_VALUE(idxs->device() == boxes.device(), op, ": idxs must be on the device of boxes (", boxes.device(),
                      "), got ", idxs->device());
  }
  check_scalar_args(op, iou_threshold, offset);
  TORCH_CHECK_VALUE(max_output >= 0, op, ": max_output must be >= 0, got ", max_output);
  TORCH_CHECK_VALUE(boxes.size(1) <= std::numeric_limits<int32_t>::max(), op,
                    ": at most 2^31 - 1 boxes per image are supported, got ", boxes.size(1));
}

}  // namespace lightning_balanced
