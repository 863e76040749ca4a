// Schemas of nms and batched_nms; their kernels are in cpu/, cuda/ and autocast/, their argument
// checks in nms_checks.h.

#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lightning_balanced, m) {
  // Greedy non-maximum suppression; returns int64 indices of kept boxes by decreasing score.
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold, int offset=0) -> Tensor");
  // Per-class NMS (boxes of different `idxs` never suppress each other) on the original
  // coordinates, without the coordinate-offset trick; same output convention as nms.
  m.def("batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold, int offset=0) -> Tensor");
}
