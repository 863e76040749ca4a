// Schemas of nms, batched_nms and batched_nms_padded; their kernels are in cpu/, cuda/ and autocast/,
// their argument checks in nms_checks.h.

#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lightning_balanced, m) {
  // Greedy non-maximum suppression; returns int64 indices of kept boxes by decreasing score.
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold, int offset=0) -> Tensor");
  // Per-class NMS (boxes of different `idxs` never suppress each other) on the original
  // coordinates, without the coordinate-offset trick; same output convention as nms.
  m.def("batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold, int offset=0) -> Tensor");
  // A batch of images of N boxes each, in fixed shapes and without a sync: keep [B, max_output] (input indices
  // by decreasing score, -1 after the last) and num_kept [B] (-1 for an image with a NaN or infinite value).
  // A score of -inf marks a padding box. With idxs, per-class NMS within each image.
  m.def(
      "batched_nms_padded(Tensor boxes, Tensor scores, Tensor? idxs, float iou_threshold, int max_output, "
      "int offset=0) -> (Tensor, Tensor)");
  // Private, CPU only: the CUDA kernels' tiled algorithm and step order run on the host (nms_tiled_driver.h),
  // for the tests. Returns the raw keep [B, capacity], counters [B, 4] (kept, tile kept, bad score, bad box) and
  // the cost model, a row per launch the GPU would make and per host-side torch op: (kind, parallel width, serial
  // depth). Images of at most small_rows boxes take the single-launch path (nms_small.h); 0 forces the tiles. Above
  // one tile, `persistent` runs the persistent chain (one launch, as the CUDA ops do when opted in with
  // LIGHTNING_BALANCED_NMS_CHAIN=1), false the per-tile launches (the CUDA default). `thread_order` is the order in
  // which the emulation runs a phase's threads (0 by index, 1 reversed, k > 1 a permutation): a result that
  // depends on it is a race the GPU would show (cpu/nms_tiled_schedule.cpp).
  m.def(
      "_nms_tiled_schedule(Tensor boxes, Tensor scores, Tensor? idxs, float iou_threshold, int offset, bool padded, "
      "int capacity, int tile_rows=1024, int propagate_warps=8192, int small_rows=4096, bool persistent=True, "
      "int thread_order=0) -> (Tensor, Tensor, Tensor)");
  // Private, CPU only: what the CUDA nms (idxs None) and batched_nms run, on the host; returns the kept indices
  // and the cost model.
  m.def(
      "_nms_tiled(Tensor boxes, Tensor scores, Tensor? idxs, float iou_threshold, int offset=0, int tile_rows=1024, "
      "int propagate_warps=8192, int small_rows=4096, bool persistent=True, int thread_order=0) -> (Tensor, Tensor)");
}
