// The private op `_nms_tiled_schedule`: the CUDA kernels' tiled NMS (ops/nms_tiled.h) run on the host by the
// same step sequence (ops/nms_tiled_driver.h), each kernel's threads one after another and the tile kernel's
// phases separated as its __syncthreads() separate them. The tests compare it with the reference at small tile
// sizes (many tiles, many blocks), so the algorithm the GPU runs is checked on machines without one.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "ops/nms_checks.h"
#include "ops/nms_tiled_driver.h"

namespace {

using namespace lightning_balanced::nms_tiled;

struct HostLaunch {
  template <typename F>
  static void each(int64_t batch, int64_t count, const F& step) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < count; ++i) step(b, i);
    }
  }

  // tile_kernel of cuda/nms_kernel.cu with `tile_rows` threads, phase by phase.
  template <typename T>
  static void tile(const Image<T>& batch_image, int64_t batch, int tile_rows, int64_t first, int rows) {
    const int words = tile_words(tile_rows);
    std::vector<uint64_t> decided(words), suppressed(words), mask(static_cast<size_t>(tile_rows) * words);
    for (int64_t b = 0; b < batch; ++b) {
      const Image<T> im = image_at(batch_image, b, tile_rows);
      const Tile tile{rows, decided.data(), mask.data(), suppressed.data()};
      for (int t = 0; t < words; ++t) decided[t] = 0;
      for (int t = 0; t < tile_rows; ++t) load_tile_row(im, tile, tile_rows, first, t);
      resolve_tile(im, tile, first);
      for (int t = 0; t < tile_rows; ++t) mark_tile_row(im, tile, first, t);
    }
  }
};

std::tuple<at::Tensor, at::Tensor> nms_tiled_schedule_cpu(const at::Tensor& boxes, const at::Tensor& scores,
                                                          const std::optional<at::Tensor>& idxs, double iou_threshold,
                                                          int64_t offset, bool padded, int64_t capacity,
                                                          int64_t tile_rows) {
  constexpr const char* op = "_nms_tiled_schedule";
  lightning_balanced::check_padded_args(op, boxes, scores, idxs, iou_threshold, capacity, offset);
  TORCH_CHECK_VALUE(boxes.device().is_cpu(), op, ": the CPU kernel got tensors on ", boxes.device());
  TORCH_CHECK_VALUE(tile_rows > 0 && tile_rows % kWordBits == 0 && tile_rows <= 4096, op,
                    ": tile_rows must be a multiple of 64 in [64, 4096], got ", tile_rows);
  const TiledInput input{boxes,
                         scores,
                         idxs.has_value() ? lightning_balanced::idxs_as_int64(*idxs).contiguous() : at::Tensor(),
                         iou_threshold,
                         offset,
                         padded,
                         capacity};
  const auto [keep, counters] = run_tiled<HostLaunch>(op, input, static_cast<int>(tile_rows));
  return {keep, counters};
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CPU, m) { m.impl("_nms_tiled_schedule", &nms_tiled_schedule_cpu); }
