// The sequence of steps of the tiled NMS (nms_tiled.h) over a batch of images, written once for the CUDA
// kernels and for their CPU emulation. `Launch` runs a step over every (image, index) pair: cuda/nms_kernel.cu
// launches one kernel per step, cpu/nms_tiled_schedule.cpp loops, one index after another. `Launch::warps`
// runs a warp-level step (see `Warp` in nms_tiled.h) once per warp. Above one tile, `Launch::chain` runs every step
// after the spatial placement, all tiles included, as the phases of one persistent kernel (run_chain, issue 40):
// 3 launches per call at any N; it returns false where it cannot (no cooperative launch, graph capture), and
// the per-tile launches run.
//
// Fixed shapes and no host sync: the number of tiles depends on N only, the counts stay on the device, and
// the kept indices go to a [B, capacity] output filled with -1. The unpadded ops read the counts back once
// (tiled_nms); batched_nms also reads the class sizes before.
//
// Up to `small_rows` boxes per image (4096 on the GPU, when its shared memory allows: nms_small.h), one launch
// does everything instead (run_small): the host allocates the output, launches, and (nms, batched_nms) reads the
// kept count. `Launch::library` marks each host-side torch op (an allocation, a sort, a gather, a read to the
// host), so the cost model counts them next to the launches.

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/_unique2.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/isinf.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "ops/nms_small.h"
#include "ops/nms_tiled.h"

namespace lightning_balanced::nms_tiled {

// Scratch is linear in the boxes. Per box, at its peak (the tile chain): the score order (8 bytes), the sorted and
// the spatial copies of the box (2 x 4 values), class ids by rank and by position (2 x 8), the position (8), the
// output (8) and the tile masks (8 per 64 rows of a tile); before it, the sorts' buffers (torch's) take less.
// Bounded here by 12 values and 48 + tile words x 8 bytes; a call that would need more than the limit is refused,
// naming it.
constexpr int64_t kMaxScratchBytes = int64_t{2} << 30;  // 2 GiB

inline int64_t scratch_bytes(int64_t boxes, int64_t value_bytes, int tile_rows) {
  return boxes * (12 * value_bytes + 48 + 8 * int64_t{tile_words(tile_rows)});
}

// The rows of the tiles covering n boxes.
LB_HOST_DEVICE int64_t padded_rows(int64_t n, int tile_rows) { return (n + tile_rows - 1) / tile_rows * tile_rows; }

// Image b's arrays within the batch's (each array holds B images back to back).
template <typename T>
LB_HOST_DEVICE Image<T> image_at(const Image<T>& batch, int64_t b, int tile_rows) {
  const int64_t n = batch.n, words = num_words(n), supers = num_supers(n, batch.super_blocks);
  auto shift = [b](auto* p, int64_t size) { return p == nullptr ? p : p + b * size; };
  Image<T> im = batch;
  im.order = shift(batch.order, n);
  im.sorted_boxes = shift(batch.sorted_boxes, 4 * n);
  im.sorted_classes = shift(batch.sorted_classes, n);
  im.padding = shift(batch.padding, n);
  im.codes = shift(batch.codes, n);
  im.spatial_order = shift(batch.spatial_order, n);
  im.position = shift(batch.position, n);
  im.boxes = shift(batch.boxes, 4 * n);
  im.classes = shift(batch.classes, n);
  im.block_region = shift(batch.block_region, 4 * words);
  im.block_classes = shift(batch.block_classes, 2 * words);
  im.super_region = shift(batch.super_region, 4 * supers);
  im.super_classes = shift(batch.super_classes, 2 * supers);
  im.removed = shift(batch.removed, words);
  im.tile_masks = shift(batch.tile_masks, padded_rows(n, tile_rows) * tile_words(tile_rows));
  im.counters = shift(batch.counters, int64_t{kCounters});
  im.tile_kept = shift(batch.tile_kept, int64_t{tile_rows});
  im.keep = shift(batch.keep, batch.capacity);
  return im;
}

// The steps as function objects (no device lambdas needed): each runs for one (image, index).
template <typename T, typename scalar_t>
struct PrepareStep {
  Image<T> batch;
  ImageInput<scalar_t> input;
  int64_t box_batch_stride, score_batch_stride;
  int tile_rows;
  LB_HOST_DEVICE void operator()(int64_t b, int64_t r) const {
    ImageInput<scalar_t> in = input;
    in.boxes += b * box_batch_stride;
    in.scores += b * score_batch_stride;
    if (in.classes != nullptr) in.classes += b * batch.n;
    prepare_rank(image_at(batch, b, tile_rows), in, r);
  }
};

template <typename T>
struct MaskStep {
  Image<T> batch;
  int tile_rows;
  T thr, off;
  LB_HOST_DEVICE void operator()(int64_t b, int64_t i) const {
    mask_word(image_at(batch, b, tile_rows), tile_rows, i, thr, off);
  }
};

template <typename T>
struct PlaceStep {
  Image<T> batch;
  int tile_rows;
  LB_HOST_DEVICE void operator()(int64_t b, int64_t p) const { place_position(image_at(batch, b, tile_rows), p); }
};

template <typename T>
struct BlockStep {
  Image<T> batch;
  int tile_rows;
  LB_HOST_DEVICE void operator()(int64_t b, int64_t blk) const { bound_block(image_at(batch, b, tile_rows), blk); }
};

template <typename T>
struct SuperStep {
  Image<T> batch;
  int tile_rows;
  LB_HOST_DEVICE void operator()(int64_t b, int64_t s) const { bound_super(image_at(batch, b, tile_rows), s); }
};

template <typename T>
struct PropagateStep {
  Image<T> batch;
  int tile_rows;
  int64_t first, warps;
  T thr, off;
  template <typename Warp>
  LB_HOST_DEVICE void operator()(int64_t b, int64_t w, const Warp& warp) const {
    propagate_kept(image_at(batch, b, tile_rows), first, w, warps, warp, thr, off);
  }
};

// ---- the persistent chain (issue 40) ------------------------------------------------------------------------------
// Above one tile, the work after the spatial order is placed runs in ONE kernel whose CTAs (kTileRows threads each)
// stay resident for the whole chain, its phases separated by grid-wide barriers (run_chain below):
//   phase 0: the block bounds and the tile masks (no dependence between them), spread over all threads;
//   phase 1: the super-block bounds (all threads), then tile 0 resolved, one CTA per image (images spread over the
//            CTAs, a CTA taking image b, b + CTAs, ...);
//   then, per later tile k: tile k - 1's kept rows propagated (the (image, warp) pairs of today's propagation launch
//            spread over all warps of the grid), a barrier, tile k resolved, a barrier.
// A grid barrier is valid only when every CTA of the grid is resident at once: the CUDA launcher sizes the grid by
// the occupancy calculator and launches it cooperatively (which fails rather than launch a grid that does not
// fit), and falls back to the per-tile launches when the device has no cooperative launch or the stream is being
// captured into a CUDA graph. Every loop around a barrier depends on the kernel's arguments only, so every thread
// of the grid reaches every barrier, and every `__syncthreads` of the tile resolve is reached by its whole CTA.
template <typename T>
struct ChainArgs {
  Image<T> batch;
  int64_t images, n, words, supers, mask_entries, step2_warps;
  int tile_rows;
  T thr, off;
};

// CTAs of `tile_rows` threads that have work in some phase, capped at the `resident` CTAs the device holds at once.
template <typename T>
LB_HOST_DEVICE int64_t chain_ctas(const ChainArgs<T>& a, int64_t resident) {
  const int64_t widest = max_of(a.mask_entries, a.step2_warps * 32);
  return min_of(resident, max_of(a.images, (a.images * widest + a.tile_rows - 1) / a.tile_rows));
}

// The phases, written once against a `Grid` (the kernel's in cuda/nms_kernel.cu, the emulation's in
// cpu/nms_tiled_schedule.cpp):
//   grid.each(images, count, step): step(b, i) for every image b and index i < count, spread over all threads;
//   grid.warps(images, warps, step): step(b, w, warp) for every image b and warp w < warps, over all warps;
//   grid.tile(first, rows): every image's tile of rows first .. first + rows - 1 resolved, one CTA per image;
//   grid.sync(): a grid-wide barrier; the writes before it are visible to every thread after it.
// No phase reads what another thread writes in the same phase, except `removed` in the propagation, whose ORs
// are atomic and whose stale reads only cost work (as between the per-tile launches).
template <typename T, typename Grid>
LB_HOST_DEVICE void run_chain(const ChainArgs<T>& a, const Grid& grid) {
  grid.each(a.images, a.words, BlockStep<T>{a.batch, a.tile_rows});
  grid.each(a.images, a.mask_entries, MaskStep<T>{a.batch, a.tile_rows, a.thr, a.off});
  grid.sync();
  grid.each(a.images, a.supers, SuperStep<T>{a.batch, a.tile_rows});
  for (int64_t first = 0;; first += a.tile_rows) {
    grid.tile(first, static_cast<int>(min_of(int64_t{a.tile_rows}, a.n - first)));
    if (first + a.tile_rows >= a.n) return;
    grid.sync();
    grid.warps(a.images, a.step2_warps, PropagateStep<T>{a.batch, a.tile_rows, first, a.step2_warps, a.thr, a.off});
    grid.sync();
  }
}

// The input in the kernels' layout: boxes [B, N, 4], scores [B, N], classes [B, N] int64 contiguous (or
// undefined), all on one device.
struct TiledInput {
  at::Tensor boxes, scores, classes;
  double iou_threshold;
  int64_t offset;
  bool padded;       // score -inf marks a padding box, never kept
  int64_t capacity;  // kept indices stored per image
};

// Step 2's warps take a full tile's (kept row, super-block) pairs in at most this many passes; chosen on the cost
// model (1M boxes of 2-200 px: 971k -> 529k serial steps against one pass).
constexpr int64_t kPairPasses = 16;

// Runs the tiled NMS with tiles of `tile_rows` rows (a multiple of 64) and step 2 over at most
// `propagate_warps` warps per image; returns the kept input indices [B, capacity] (by decreasing score, -1
// after the last) and the counters [B, kCounters] (int64).
template <typename Launch>
std::pair<at::Tensor, at::Tensor> run_tiled(const char* op, const TiledInput& in, int tile_rows,
                                            int64_t propagate_warps) {
  const int64_t batch = in.boxes.size(0), n = in.boxes.size(1);
  const bool is_double = in.boxes.scalar_type() == at::kDouble;
  const auto compute = is_double ? at::kDouble : at::kFloat;
  const int64_t bytes = scratch_bytes(batch * n, is_double ? 8 : 4, tile_rows);
  TORCH_CHECK_VALUE(bytes <= kMaxScratchBytes, op, ": ", batch * n, " boxes need ", (bytes >> 20),
                    " MiB of scratch memory, over the limit of ", (kMaxScratchBytes >> 20), " MiB per call (about ",
                    kMaxScratchBytes / scratch_bytes(1, is_double ? 8 : 4, tile_rows), " boxes); split the input");
  const auto longs = in.boxes.options().dtype(at::kLong);
  Launch::library(batch * in.capacity);  // the output, filled with -1
  at::Tensor keep = at::full({batch, in.capacity}, -1, longs);
  Launch::library(batch * kCounters);
  at::Tensor counters = at::zeros({batch, kCounters}, longs);
  if (n == 0 || batch == 0) return {keep, counters};

  Launch::library(batch * n);  // the stable sort by score
  const at::Tensor order = std::get<1>(in.scores.to(compute).sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));
  const bool by_class = in.classes.defined();
  const bool tiled = n > tile_rows;
  // Super-blocks as small as step 2's warps allow: their pairs with a full tile's kept rows, 32 per warp and pass,
  // in at most kPairPasses passes. The smaller, the fewer blocks a pair that overlaps makes a warp test; a pass
  // that finds no overlap costs one ballot.
  int super_blocks = 1;
  while (super_blocks < kMaxSuperBlocks &&
         tile_rows * num_supers(n, super_blocks) > kPairPasses * 32 * propagate_warps) {
    super_blocks *= 2;
  }
  const int64_t words = num_words(n), supers = num_supers(n, super_blocks);
  Launch::library(batch * n);  // sorted_boxes, tile_kept, and the optional arrays (sorted_classes, padding, codes)
  Launch::library(batch * tile_rows);
  for (const bool used : {by_class, in.padded, tiled}) {
    if (used) Launch::library(batch * n);
  }
  at::Tensor sorted_boxes = at::empty({batch, n, 4}, in.boxes.options().dtype(compute));
  at::Tensor sorted_classes = by_class ? at::empty({batch, n}, longs) : at::Tensor();
  at::Tensor padding = in.padded ? at::empty({batch, n}, longs.dtype(at::kByte)) : at::Tensor();
  at::Tensor codes = tiled ? at::empty({batch, n}, longs) : at::Tensor();
  at::Tensor tile_kept = at::empty({batch, tile_rows}, longs.dtype(at::kInt));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.boxes.scalar_type(), "lightning_balanced_nms_tiled", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    Image<T> im{};
    im.n = n;
    im.super_blocks = super_blocks;
    im.order = order.const_data_ptr<int64_t>();
    im.sorted_boxes = sorted_boxes.mutable_data_ptr<T>();
    im.sorted_classes = by_class ? sorted_classes.mutable_data_ptr<int64_t>() : nullptr;
    im.padding = in.padded ? padding.mutable_data_ptr<uint8_t>() : nullptr;
    im.codes = tiled ? codes.mutable_data_ptr<int64_t>() : nullptr;
    im.counters = counters.mutable_data_ptr<int64_t>();
    im.tile_kept = tile_kept.mutable_data_ptr<int32_t>();
    im.keep = keep.mutable_data_ptr<int64_t>();
    im.capacity = in.capacity;
    const ImageInput<scalar_t> input{in.boxes.const_data_ptr<scalar_t>(),
                                     in.boxes.stride(1),
                                     in.boxes.stride(2),
                                     in.scores.const_data_ptr<scalar_t>(),
                                     in.scores.stride(1),
                                     by_class ? in.classes.const_data_ptr<int64_t>() : nullptr,
                                     in.padded};
    Launch::each(batch, n, PrepareStep<T, scalar_t>{im, input, in.boxes.stride(0), in.scores.stride(0), tile_rows});

    at::Tensor position, boxes, classes, block_region, block_classes, super_region, super_classes, removed;
    if (tiled) {
      Launch::library(batch * n);  // the sort by Morton code
      at::Tensor spatial_order = std::get<1>(codes.sort(/*stable=*/true, /*dim=*/1, /*descending=*/false));
      if (by_class) {  // class-major, Morton order within a class: a gather, a sort, a gather
        Launch::library(batch * n);
        Launch::library(batch * n);
        Launch::library(batch * n);
        const at::Tensor by_position = sorted_classes.gather(1, spatial_order);
        spatial_order = spatial_order.gather(1, std::get<1>(by_position.sort(true, 1, false)));
      }
      spatial_order = spatial_order.contiguous();
      codes.reset();  // freed before the tile masks, the largest array
      // position, boxes, classes, the block and super-block regions and classes, removed (zero-filled)
      for (int k = 0; k < (by_class ? 8 : 7); ++k) Launch::library(batch * n);
      position = at::empty({batch, n}, longs);
      boxes = at::empty({batch, n, 4}, sorted_boxes.options());
      classes = by_class ? at::empty({batch, n}, longs) : at::Tensor();
      block_region = at::empty({batch, words, 4}, sorted_boxes.options());
      block_classes = at::empty({batch, words, 2}, longs);
      super_region = at::empty({batch, supers, 4}, sorted_boxes.options());
      super_classes = at::empty({batch, supers, 2}, longs);
      removed = at::zeros({batch, words}, longs);
      im.spatial_order = spatial_order.const_data_ptr<int64_t>();
      im.position = position.mutable_data_ptr<int64_t>();
      im.boxes = boxes.mutable_data_ptr<T>();
      im.classes = by_class ? classes.mutable_data_ptr<int64_t>() : nullptr;
      im.block_region = block_region.mutable_data_ptr<T>();
      im.block_classes = block_classes.mutable_data_ptr<int64_t>();
      im.super_region = super_region.mutable_data_ptr<T>();
      im.super_classes = super_classes.mutable_data_ptr<int64_t>();
      im.removed = reinterpret_cast<uint64_t*>(removed.mutable_data_ptr<int64_t>());
      Launch::each(batch, n, PlaceStep<T>{im, tile_rows});
      im.spatial_order = nullptr;  // read by PlaceStep only; freed at the end of this block
    }
    const int64_t mask_entries = padded_rows(n, tile_rows) * tile_words(tile_rows);
    Launch::library(batch * mask_entries);
    const at::Tensor tile_masks = at::empty({batch, mask_entries}, longs);
    im.tile_masks = reinterpret_cast<uint64_t*>(tile_masks.mutable_data_ptr<int64_t>());
    const T thr = static_cast<T>(in.iou_threshold), off = static_cast<T>(in.offset);
    // Step 2's warps: one per 32 pairs (kept row, super-block) of a full tile, at most propagate_warps.
    const int64_t step2_warps = std::min<int64_t>(propagate_warps, (tile_rows * supers + 31) / 32);
    // Above one tile, the persistent chain: one launch for the bounds, the masks and every tile (run_chain), when
    // the launcher can keep its grid resident (else it returns false and the per-tile launches below run).
    if (tiled && Launch::template chain<T>(ChainArgs<T>{im, batch, n, words, supers, mask_entries, step2_warps,
                                                        tile_rows, thr, off})) {
      return;
    }
    if (tiled) {
      Launch::each(batch, words, BlockStep<T>{im, tile_rows});
      Launch::each(batch, supers, SuperStep<T>{im, tile_rows});
    }
    Launch::each(batch, mask_entries, MaskStep<T>{im, tile_rows, thr, off});
    for (int64_t first = 0; first < n; first += tile_rows) {
      const int rows = static_cast<int>(std::min<int64_t>(tile_rows, n - first));
      Launch::template tile<T>(im, batch, tile_rows, first, rows);
      if (first + tile_rows < n) {
        Launch::warps(batch, step2_warps, PropagateStep<T>{im, tile_rows, first, step2_warps, thr, off});
      }
    }
  });
  return {keep, counters};
}

// The single-launch path (nms_small.h): B images of n boxes (n <= kSmallMaxRows), one CTA each. The caller
// allocates the outputs: keep [B, keep_stride] (its first `capacity` slots of a row are written), and optionally
// counters [B, kCounters] and num_kept [B] (the padded op's result, -1 for an image with a non-finite value).
template <typename Launch>
void run_small(const TiledInput& in, at::Tensor& keep, int64_t keep_stride, int64_t* counters, int64_t* num_kept) {
  const int64_t batch = in.boxes.size(0), n = in.boxes.size(1);
  const bool by_class = in.classes.defined();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.boxes.scalar_type(), "lightning_balanced_nms_small", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const SmallArgs<T, scalar_t> args{n,
                                      in.capacity,
                                      ImageInput<scalar_t>{in.boxes.const_data_ptr<scalar_t>(), in.boxes.stride(1),
                                                           in.boxes.stride(2), in.scores.const_data_ptr<scalar_t>(),
                                                           in.scores.stride(1),
                                                           by_class ? in.classes.const_data_ptr<int64_t>() : nullptr,
                                                           in.padded},
                                      in.boxes.stride(0),
                                      in.scores.stride(0),
                                      keep.mutable_data_ptr<int64_t>(),
                                      keep_stride,
                                      counters,
                                      num_kept,
                                      static_cast<T>(in.iou_threshold),
                                      static_cast<T>(in.offset)};
    Launch::template small<T, scalar_t>(args, batch, small_shared_bytes(n, sizeof(T), by_class));
  });
}

// Whether B images of n boxes take the single-launch path: at most `small_rows` boxes, and the CTA's shared memory
// within what the device grants (Launch::small_shared_limit).
template <typename Launch>
bool takes_small_path(const TiledInput& in, int64_t small_rows) {
  const int64_t n = in.boxes.size(1);
  const int64_t value_bytes = in.boxes.scalar_type() == at::kDouble ? 8 : 4;
  return n > 0 && in.boxes.size(0) > 0 && n <= small_rows && n <= kSmallMaxRows &&
         small_shared_bytes(n, value_bytes, in.classes.defined()) <= Launch::small_shared_limit();
}

// The unpadded ops' result: the kept indices of the single image, after one read of its counters (the only
// sync), or the error of a NaN or infinite value.
inline at::Tensor kept_indices(const char* op, const at::Tensor& keep, const at::Tensor& counters) {
  const at::Tensor host = counters[0].to(at::kCPU);  // the callers count this read as a host-side op
  const int64_t* c = host.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(c[kBadScore] == 0, op, ": scores must be finite (no NaN or infinity)");
  TORCH_CHECK_VALUE(c[kBadBox] == 0, op, ": box coordinates must be finite (no NaN or infinity)");
  return keep[0].narrow(0, 0, c[kKept]);
}

// nms (classes undefined) or batched_nms on boxes [N, 4], scores [N], classes [N] int64, with the tiled NMS;
// returns the kept indices by decreasing score (ties: lower index first).
//
// batched_nms runs its classes as independent chains at the same time when that costs little memory: the boxes
// of each class become one row of a [C, M] padded batch (M = the largest class, -inf scores after its boxes, in
// index order within the row), which run_tiled resolves side by side, one CTA and one set of warps per class:
// the serial chain of tiles is M / tile_rows long instead of N / tile_rows. Taken when C * M <= 2 N + 4096 and
// C <= kMaxImages; otherwise one chain over all boxes, the class ids pruning the propagation. The kept boxes are
// put back in the global score order by sorts on the device. Two reads from the device: the class sizes (C and
// M shape the batch) and, at the end, the counters.
constexpr int64_t kMaxImages = 65535;  // a CUDA grid's y dimension: one row of images per launch

template <typename Launch>
at::Tensor tiled_nms(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& classes,
                     double iou_threshold, int64_t offset, int tile_rows, int64_t propagate_warps,
                     int64_t small_rows = kSmallMaxRows) {
  const int64_t n = boxes.size(0);
  if (n == 0) return at::empty({0}, boxes.options().dtype(at::kLong));
  {  // up to small_rows boxes, classes or not: one allocation (the kept indices, then the counters), one launch,
     // one read of the counters
    const TiledInput input{boxes.unsqueeze(0),
                           scores.unsqueeze(0),
                           classes.defined() ? classes.unsqueeze(0).contiguous() : at::Tensor(),
                           iou_threshold,
                           offset,
                           /*padded=*/false,
                           /*capacity=*/n};
    if (takes_small_path<Launch>(input, small_rows)) {
      Launch::library(n + kCounters);
      at::Tensor out = at::empty({1, n + kCounters}, boxes.options().dtype(at::kLong));
      run_small<Launch>(input, out, n + kCounters, out.mutable_data_ptr<int64_t>() + n, nullptr);
      Launch::library(kCounters);  // the read of the counters, the one sync
      return kept_indices(op, out.narrow(1, 0, n), out.narrow(1, n, kCounters));
    }
  }
  const auto one_chain = [&] {
    const TiledInput input{boxes.unsqueeze(0),
                           scores.unsqueeze(0),
                           classes.defined() ? classes.unsqueeze(0).contiguous() : at::Tensor(),
                           iou_threshold,
                           offset,
                           /*padded=*/false,
                           /*capacity=*/n};
    const auto [keep, counters] = run_tiled<Launch>(op, input, tile_rows, propagate_warps);
    Launch::library(kCounters);  // the read of the counters, the one sync
    return kept_indices(op, keep, counters);
  };
  if (!classes.defined()) return one_chain();

  Launch::library(n);  // the class sizes
  const auto [ids, inverse, sizes] = at::_unique2(classes, /*sorted=*/true, /*return_inverse=*/true,
                                                  /*return_counts=*/true);
  const int64_t num_classes = ids.size(0);
  const int64_t largest = sizes.max().item<int64_t>();
  if (num_classes <= 1 || num_classes > kMaxImages || num_classes * largest > 2 * n + 4096) return one_chain();

  // Row c holds class c's boxes in index order (a stable sort by class), at slots 0 .. size - 1.
  Launch::library(n);
  const at::Tensor members = std::get<1>(inverse.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor row = inverse.index_select(0, members);
  const at::Tensor starts = sizes.cumsum(0).sub_(sizes);
  const at::Tensor flat = row.mul(largest).add_(at::arange(n, row.options())).sub_(starts.index_select(0, row));
  const int64_t slots = num_classes * largest;
  const at::Tensor index_of_slot = at::full({slots}, -1, row.options()).index_copy_(0, flat, members);
  const at::Tensor row_boxes =
      at::zeros({slots, 4}, boxes.options()).index_copy_(0, flat, boxes.index_select(0, members));
  const at::Tensor row_scores = at::full({slots}, -std::numeric_limits<double>::infinity(), scores.options())
                                    .index_copy_(0, flat, scores.index_select(0, members));
  const TiledInput input{row_boxes.view({num_classes, largest, 4}),
                         row_scores.view({num_classes, largest}),
                         at::Tensor(),
                         iou_threshold,
                         offset,
                         /*padded=*/true,
                         /*capacity=*/largest};
  const auto [keep, counters] = run_tiled<Launch>(op, input, tile_rows, propagate_warps);

  // Back to input indices, then to the global order: all boxes by decreasing score (stable), the kept first.
  const at::Tensor slot = keep.clamp_min(0).add_(at::arange(num_classes, keep.options()).mul_(largest).unsqueeze(1));
  const at::Tensor kept_index = at::where(keep.ge(0), index_of_slot.index_select(0, slot.flatten()).view_as(keep), n);
  const at::Tensor is_kept = at::zeros({n + 1}, keep.options().dtype(at::kByte))
                                 .index_fill_(0, kept_index.flatten(), 1)
                                 .narrow(0, 0, n);
  const auto compute = boxes.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Launch::library(n);
  const at::Tensor order = std::get<1>(scores.to(compute).sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  Launch::library(n);
  const at::Tensor kept_first =
      std::get<1>(is_kept.index_select(0, order).sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  // The classes' counters summed, read once; a real score of -inf, taken for padding above, counts as bad.
  const at::Tensor totals = counters.sum(0);
  totals.select(0, kBadScore).add_(at::isinf(scores).any());
  Launch::library(kCounters);  // the read of the counters
  return kept_indices(op, order.index_select(0, kept_first).unsqueeze(0), totals.unsqueeze(0));
}

// The padded op's result: keep [B, capacity] and num_kept [B] (the kept count up to the capacity, or -1 and an
// all -1 row for an image with a NaN or infinite value other than a padding score). Sync-free.
inline std::tuple<at::Tensor, at::Tensor> padded_result(at::Tensor keep, const at::Tensor& counters) {
  const at::Tensor bad = counters.select(1, kBadScore).add(counters.select(1, kBadBox)).gt(0);
  const at::Tensor num_kept = counters.select(1, kKept).clamp_max(keep.size(1)).masked_fill(bad, -1);
  keep.masked_fill_(bad.unsqueeze(1), -1);
  return {keep, num_kept};
}

// batched_nms_padded: (keep [B, capacity], num_kept [B]), sync-free. Up to small_rows boxes per image, one launch
// (one CTA per image) writes both outputs; the host allocates them and does nothing else. Above, the tiled chain.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor> padded_nms(const TiledInput& in, const char* op, int tile_rows,
                                              int64_t propagate_warps, int64_t small_rows = kSmallMaxRows) {
  if (takes_small_path<Launch>(in, small_rows)) {
    const int64_t batch = in.boxes.size(0);
    const auto longs = in.boxes.options().dtype(at::kLong);
    Launch::library(batch * in.capacity);
    at::Tensor keep = at::empty({batch, in.capacity}, longs);
    Launch::library(batch);
    at::Tensor num_kept = at::empty({batch}, longs);
    run_small<Launch>(in, keep, in.capacity, nullptr, num_kept.mutable_data_ptr<int64_t>());
    return {keep, num_kept};
  }
  const auto [keep, counters] = run_tiled<Launch>(op, in, tile_rows, propagate_warps);
  return padded_result(keep, counters);
}

}  // namespace lightning_balanced::nms_tiled
