// The single-launch NMS of up to 4096 boxes per image: one CTA of 1024 threads does everything in shared memory.
//
// Plan (issue 40). The tiled chain (nms_tiled.h) costs, at 1k boxes, about ten host-side torch ops and four
// launches around 58 us of GPU work; here, per image, one CTA runs every step and the host issues the output
// allocation, the launch and (nms, batched_nms) the read of the kept count:
//   1. keys: the scores in the compute type (NaN as -inf: such an image is an error anyway), index i; padded to a
//      power of two with (-inf, i >= n), which sort after every real box;
//   2. a bitonic sort of (score, index) in shared memory, descending score, ties lower index first: the order of
//      the reference's stable sort, since the (score, index) keys are all distinct. log2(S) (log2(S) + 1) / 2
//      phases of S / 2 compare-exchanges (S <= 4096: 78 phases, 2 per thread);
//   3. the boxes loaded by rank into shared memory (over the sort's scores, no longer read), the non-finite flags,
//      a padding box (score -inf, padded form) marked suppressed, and the extent of the other boxes (shared
//      atomic min/max);
//   4. per 64-row block w, in order (5 phases): (a) `cols`, the earlier open rows of the block that suppress each
//      open row (16 threads per row, 4 columns each, ORed in with a shared atomic); (b) warp 0 resolves the block
//      in rounds of ballots (resolve_block of nms_tiled.h, unchanged); (c) the block's kept rows enter a hashed
//      grid of cells (below); (d) every later open row is tested against the kept rows in the cells it covers
//      (one thread per row, 4 rows per thread at 4096, stopping at the first hit), unless it has more than
//      kDeferAbove candidates: then it is deferred to (e), which tests each deferred row against the block's
//      kept rows with one thread per (row, kept row) pair. Only kept rows suppress, and a suppressed row is never
//      tested again. Without the grid, (d) was (kept rows) x (open later rows) IoU tests on one SM, n^2 / 2 when
//      nearly all boxes are kept, and it set the time at 1k boxes on an H200 (uniform boxes 0.31 ms, clustered
//      ones 0.14 ms). Without (e), one large later row (every kept row of the block a candidate) set the deepest
//      thread of (d), and the phase waits for its deepest thread; the cost model reports the critical path
//      (test_nms_small.py bounds it);
//   5. compaction: each kept row's output slot is the popcount of the kept rows before it; the slots after the
//      last kept box get -1; thread 0 writes the counters (kept, flags) and, for the padded form, num_kept (or -1
//      and a row of -1 for an image with a non-finite value). No global scratch, nothing zero-filled by the host.
// The grid of step 4 (a uniform grid over the image's extent, hashed into kSmallCells words, one bit per kept row
// of the block). A coordinate's cell key is its position in the extent in 2^20 steps, computed in float32
// (cell_key): a monotone function of the coordinate, so two intervals that intersect share a key, and cutting
// keys into cells (key >> level) keeps that. A box's level is the smallest at which its intervals [x1, x2 + offset]
// and [y1, y2 + offset] span at most 2 cells each; the block's grid is at the coarsest level of its open rows, so
// most kept rows enter at most 2 x 2 cells, and a later row reads the cells it spans (at most 5 x 5, else it takes
// every kept row). In nms a box wider or taller than 1/8 of the extent (big_level) does not set the level, so one
// large box does not coarsen the cells: as a kept row it enters the cells it spans when they are at most 3 x 3
// (kMaxInsertSpan), else the word `big`, whose rows are candidates for every later row. batched_nms hashes the
// class into the cell, so there even coarse cells separate the boxes: every open row sets the level. Exact, not a
// heuristic: a box that suppresses another intersects it (inter > 0 in the rounded arithmetic of `suppresses`
// gives max(x1) <= x2 + offset, rounded, for both boxes, and the same in y), so both span the cell of the larger
// x1 and the larger y1; hash collisions and coarse cells only add candidates. A box whose interval is inverted
// (x2 + offset < x1) intersects nothing and is skipped. The grid is used only when the block keeps more than 8
// rows (grid_level). It costs one phase per block and 4 KiB; (e) one phase per block that defers a row, and the
// deferred rows' indices, 512 bytes (past kDeferredRows in a block, a row is tested in (d) as before).
// Shared memory: kSmallGridWords words (the block state and the grid), the boxes (4 values per box, at least the
// sort's S scores), the sort's S int32 indices, and for batched_nms the int64 classes: float32 4096 boxes 86 KiB
// (118 KiB with classes), float64 150 KiB (182 KiB). Over the 48 KiB static limit, so it is dynamic shared
// memory, opted in with cudaFuncSetAttribute; the CUDA driver takes this path only when `small_shared_bytes` fits
// the device's opt-in limit (227 KiB on sm_90 and sm_100: all of them; 163 KiB on sm_80: all but float64 with
// classes above 3,608 boxes; 99 KiB on sm_86/89: float32 up to 4096 boxes, 3,283 with classes, float64 2,462 and
// 2,048; 64 KiB on sm_75), else the tiled chain. The emulation models sm_90's limit.
//
// Written once for the device and the host, against a `Cta`:
//   Cta::kThreads: the threads of the CTA (kSmallThreads);
//   cta.each(f): every thread t runs f(t), then a barrier (__syncthreads);
//   cta.warp0(out, f): warp 0 runs f(warp) (a `Warp` of nms_tiled.h), lane 0 stores the result in *out, then a
//   barrier.
// The device's Cta (cuda/nms_kernel.cu) is one thread of the real CTA, the host's (cpu/nms_tiled_schedule.cpp)
// runs the threads of a phase one after another and adds the deepest thread's serial steps (LB_COST) plus one for
// the barrier to the critical path. Every loop around the phases depends on n only (CTA-uniform), so every thread
// reaches every barrier.

#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "ops/nms_tiled.h"

namespace lightning_balanced::nms_tiled {

constexpr int kSmallThreads = 1024;      // the CTA
constexpr int64_t kSmallMaxRows = 4096;  // boxes per image, at most (64 blocks of 64: one word of kept blocks)
constexpr int64_t kSmallSharedLimitSm90 = 227 * 1024;  // the opt-in limit the emulation models
constexpr int kSmallCells = 512;         // words of the hashed grid of step 4 (4 KiB)
constexpr int kCellKeyBits = 20;         // a coordinate's cell key: 0 .. 2^20 - 1
constexpr uint32_t kMaxInsertSpan = 3;  // a kept row enters at most 3 x 3 cells of step 4's grid, else it is big
constexpr int kDeferAbove = 24;         // a later row with more candidates is tested in step 4 (e)
constexpr int kDeferredRows = 256;      // the rows step 4 (e) takes per block, at most (uint16 indices)
// suppressed, kept, cols, cells, levels, big, extent, the deferred count, the deferred rows (uint16)
constexpr int kSmallGridWords = 3 * 64 + kSmallCells + 6 + kDeferredRows / 4;

// ---- the cells of step 4 -----------------------------------------------------------------------------------------
// The extent is kept as ordered_bits (nms_tiled.h) for the atomic min and max below.
// `*word = min(*word, k)` (or max), atomically on the device.
LB_HOST_DEVICE void min_bits(uint32_t* word, uint32_t k) {
#ifdef __CUDA_ARCH__
  atomicMin(word, k);
#else
  *word = min_of(*word, k);
#endif
}

LB_HOST_DEVICE void max_bits(uint32_t* word, uint32_t k) {
#ifdef __CUDA_ARCH__
  atomicMax(word, k);
#else
  *word = max_of(*word, k);
#endif
}

// `*word += 1`, atomically on the device; the old value.
LB_HOST_DEVICE uint32_t increment(uint32_t* word) {
#ifdef __CUDA_ARCH__
  return atomicAdd(word, 1u);
#else
  return (*word)++;
#endif
}

LB_HOST_DEVICE int bit_length(uint32_t x) {
#ifdef __CUDA_ARCH__
  return 32 - __clz(static_cast<int>(x));
#else
  return x == 0 ? 0 : 32 - __builtin_clz(x);
#endif
}

// The image's extent, [min x1, max x2 + off] x [min y1, max y2 + off] as ordered bits, cut into 2^20 cell keys per
// axis: key(v) = clamp(floor((v - lo) * scale), 0, 2^20 - 1) in float32. Monotone in v (each operation rounds to
// nearest, which is monotone, and scale >= 0), so v <= u gives key(v) <= key(u): what exactness needs, whatever the
// extent (an image with a NaN or infinite value, an error anyway, gets scale 0: one cell).
struct CellScale {
  float lo_x, scale_x, lo_y, scale_y;
};

LB_HOST_DEVICE float cell_scale_of(float lo, float hi) {
  const float span = sub_rn(hi, lo);
  const float scale = static_cast<float>(1 << kCellKeyBits) / span;
  return span > 0.0f && is_finite(scale) ? scale : 0.0f;
}

LB_HOST_DEVICE CellScale cell_scale(const uint32_t* extent) {
  const float lo_x = from_ordered_bits(extent[0]), lo_y = from_ordered_bits(extent[1]);
  return {lo_x, cell_scale_of(lo_x, from_ordered_bits(extent[2])), lo_y,
          cell_scale_of(lo_y, from_ordered_bits(extent[3]))};
}

LB_HOST_DEVICE uint32_t cell_key(float v, float lo, float scale) {
  const float k = mul_rn(sub_rn(v, lo), scale);
  constexpr float top = static_cast<float>((1 << kCellKeyBits) - 1);
  if (!(k > 0.0f)) return 0;  // NaN too
  return k >= top ? static_cast<uint32_t>(top) : static_cast<uint32_t>(k);  // k >= 0: truncation is floor
}

// A box's intervals [x1, x2 + off] and [y1, y2 + off] as cell keys (x2 + off rounded as `suppresses` rounds it,
// then converted to float32, rounding to nearest: monotone).
struct CellBox {
  uint32_t x1, y1, x2, y2;
};

template <typename T>
LB_HOST_DEVICE CellBox cell_box(const T* b, T off, const CellScale& g) {
  return {cell_key(static_cast<float>(b[0]), g.lo_x, g.scale_x), cell_key(static_cast<float>(b[1]), g.lo_y, g.scale_y),
          cell_key(static_cast<float>(add_rn(b[2], off)), g.lo_x, g.scale_x),
          cell_key(static_cast<float>(add_rn(b[3], off)), g.lo_y, g.scale_y)};
}

// An inverted interval (x2 + off < x1): the box intersects no box, so it suppresses none and none suppresses it.
LB_HOST_DEVICE bool intersects_nothing(const CellBox& c) { return c.x2 < c.x1 || c.y2 < c.y1; }

// The smallest level (cells of 2^level keys) at which both intervals span at most 2 cells.
LB_HOST_DEVICE int cell_level(const CellBox& c) { return bit_length(max_of(c.x2 - c.x1, c.y2 - c.y1)); }

// A box above this level (wider or taller than 1/8 of the image's extent) does not set the grid's level in nms, so
// one large box does not make the cells coarse; as a kept row it enters the cells it spans, or `big` (step 4 (c)).
// batched_nms hashes the class into the cell, so there even coarse cells separate the boxes: every box sets it.
LB_HOST_DEVICE int big_level(bool by_class) { return by_class ? kCellKeyBits : kCellKeyBits - 3; }

// The level of the block's grid: the coarsest level of its open rows up to big_level (`levels`, a bit each), or
// -1 when the grid would not pay: at most 8 kept rows (testing them all is as cheap), or no such row. The same in
// every thread (shared values).
LB_HOST_DEVICE int grid_level(uint64_t kept, uint64_t levels) {
  constexpr int kMinKept = 8;
  return popcount(kept) > kMinKept ? bit_length(static_cast<uint32_t>(levels)) - 1 : -1;
}

// The grid word of cell (cx, cy) of class `cls` (0 for nms): a hash (collisions only add candidates).
LB_HOST_DEVICE int cell_word(uint32_t cx, uint32_t cy, int64_t cls) {
  const uint64_t c = static_cast<uint64_t>(cls);
  uint32_t h = (cx * 0x9E3779B1u) ^ (cy * 0x85EBCA77u) ^ (static_cast<uint32_t>(c) * 0xC2B2AE3Du) ^
               (static_cast<uint32_t>(c >> 32) * 0x27D4EB2Fu);
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return static_cast<int>(h & (kSmallCells - 1));
}

// The sort's size: the power of two at or above n.
LB_HOST_DEVICE int64_t small_sort_size(int64_t n) {
  int64_t s = 1;
  while (s < n) s <<= 1;
  return s;
}

LB_HOST_DEVICE int64_t round_up8(int64_t bytes) { return (bytes + 7) / 8 * 8; }

LB_HOST_DEVICE int64_t small_box_values(int64_t n) { return max_of(4 * n, small_sort_size(n)); }

// The dynamic shared memory of one image's CTA.
LB_HOST_DEVICE int64_t small_shared_bytes(int64_t n, int64_t value_bytes, bool by_class) {
  return kSmallGridWords * 8 + round_up8(small_box_values(n) * value_bytes) + (by_class ? 8 * n : 0) +
         round_up8(4 * small_sort_size(n)) + 8;
}

// The shared arrays, carved out of one buffer in the order of small_shared_bytes (8-byte aligned).
template <typename T>
struct SmallShared {
  uint64_t* suppressed;     // [64]: rows suppressed (or padding), by rank
  uint64_t* kept;           // [64]: kept rows, block by block
  uint64_t* cols;           // [64]: the current block's `cols`
  uint64_t* cells;          // [kSmallCells]: the hashed grid of the current block's kept rows
  uint64_t* levels;         // [2]: by block parity, the levels (cell_level) of the block's open rows, a bit each
  uint64_t* big;            // [1]: the block's kept rows that span more than 3 x 3 cells, outside the grid
  uint32_t* extent;         // [4]: min x1, min y1, max x2 + off, max y2 + off, as ordered_bits
  uint32_t* deferred;       // [2]: the rows step 4 (d) deferred to (e) (may exceed kDeferredRows), spare
  uint16_t* deferred_rows;  // [kDeferredRows]: those rows
  T* boxes;                 // [n, 4] by rank; before that, the sort's scores [S]
  int64_t* classes;         // [n] by rank, or nullptr
  int32_t* order;           // [S]: rank -> input index
  int32_t* flags;           // [2]: a non-finite score, a non-finite coordinate
};

template <typename T>
LB_HOST_DEVICE SmallShared<T> small_shared(unsigned char* base, int64_t n, bool by_class) {
  SmallShared<T> s{};
  s.suppressed = reinterpret_cast<uint64_t*>(base);
  s.kept = s.suppressed + 64;
  s.cols = s.kept + 64;
  s.cells = s.cols + 64;
  s.levels = s.cells + kSmallCells;
  s.big = s.levels + 2;
  s.extent = reinterpret_cast<uint32_t*>(s.big + 1);
  s.deferred = s.extent + 4;
  s.deferred_rows = reinterpret_cast<uint16_t*>(s.deferred + 2);
  unsigned char* p = base + kSmallGridWords * 8;
  s.boxes = reinterpret_cast<T*>(p);
  p += round_up8(small_box_values(n) * static_cast<int64_t>(sizeof(T)));
  s.classes = by_class ? reinterpret_cast<int64_t*>(p) : nullptr;
  p += by_class ? 8 * n : 0;
  s.order = reinterpret_cast<int32_t*>(p);
  p += round_up8(4 * small_sort_size(n));
  s.flags = reinterpret_cast<int32_t*>(p);
  return s;
}

// One call: B images of n boxes; image b's input at the batch strides, its output row at keep + b * keep_stride.
template <typename T, typename scalar_t>
struct SmallArgs {
  int64_t n, capacity;
  ImageInput<scalar_t> input;  // image 0; classes [B, n] contiguous, or nullptr
  int64_t box_batch_stride, score_batch_stride;
  int64_t* keep;  // [B, keep_stride]: the first `capacity` slots of a row are written
  int64_t keep_stride;
  int64_t* counters;  // [B, kCounters], or nullptr
  int64_t* num_kept;  // [B], or nullptr; when set (the padded op), an image with a non-finite value gets -1 and -1s
  T thr, off;
};

// Rank order: x before y (decreasing score, then increasing index). Keys are distinct, so this is a strict order.
template <typename T>
LB_HOST_DEVICE bool ranks_before(const T* keys, const int32_t* order, int64_t x, int64_t y) {
  return keys[x] > keys[y] || (keys[x] == keys[y] && order[x] < order[y]);
}

// The whole NMS of image b, by one CTA; `smem` holds small_shared_bytes(n, sizeof(T), classes != nullptr).
template <typename T, typename scalar_t, typename Cta>
LB_HOST_DEVICE void small_nms(const SmallArgs<T, scalar_t>& a, int64_t b, unsigned char* smem, const Cta& cta) {
  constexpr int threads = Cta::kThreads;
  const int64_t n = a.n;
  ImageInput<scalar_t> in = a.input;
  in.boxes += b * a.box_batch_stride;
  in.scores += b * a.score_batch_stride;
  if (in.classes != nullptr) in.classes += b * n;
  const bool by_class = in.classes != nullptr;
  const SmallShared<T> s = small_shared<T>(smem, n, by_class);
  const int64_t sort = small_sort_size(n);
  const int words = static_cast<int>(num_words(n));
  const T inf = std::numeric_limits<T>::infinity();
  T* keys = s.boxes;  // the sort's scores, overwritten by the boxes in step 3

  // 1. keys, and the block state zeroed.
  cta.each([&](int t) {
    if (t < 64) s.suppressed[t] = s.kept[t] = s.cols[t] = 0;
    if (t < 2) s.flags[t] = 0;
    if (t < 2) s.levels[t] = 0;
    if (t < 4) s.extent[t] = t < 2 ? ~uint32_t{0} : 0;
    for (int64_t p = t; p < sort; p += threads) {
      LB_COST(1);
      T v = p < n ? static_cast<T>(in.scores[p * in.score_stride]) : -inf;
      if (!(v == v)) v = -inf;  // NaN: the image is an error; any order will do, and pads stay last
      keys[p] = v;
      s.order[p] = static_cast<int32_t>(p);
    }
  });

  // 2. the bitonic sort.
  for (int64_t k = 2; k <= sort; k <<= 1) {
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      cta.each([&](int t) {
        for (int64_t p = t; p < sort / 2; p += threads) {
          LB_COST(1);
          const int64_t i = p / j * 2 * j + p % j, l = i + j;
          const bool swap = (i & k) == 0 ? ranks_before(keys, s.order, l, i) : ranks_before(keys, s.order, i, l);
          if (swap) {
            const T key = keys[i];
            keys[i] = keys[l];
            keys[l] = key;
            const int32_t idx = s.order[i];
            s.order[i] = s.order[l];
            s.order[l] = idx;
          }
        }
      });
    }
  }

  // 3. the boxes by rank (keys are not read from here on), flags, padding, the extent of the boxes (not padding).
  cta.each([&](int t) {
    uint32_t lo_x = ~uint32_t{0}, lo_y = ~uint32_t{0}, hi_x = 0, hi_y = 0;
    bool any = false;
    for (int64_t r = t; r < n; r += threads) {
      LB_COST(1);
      const int64_t i = s.order[r];
      const T score = static_cast<T>(in.scores[i * in.score_stride]);
      T box[4];
      bool finite = true;
      for (int c = 0; c < 4; ++c) {
        box[c] = static_cast<T>(in.boxes[i * in.box_stride + c * in.coord_stride]);
        finite = finite && is_finite(box[c]);
      }
      const bool pad = in.padded && !is_finite(score) && score < T(0);
      if (!pad && !is_finite(score)) s.flags[0] = 1;  // every writer writes 1
      if (!pad && !finite) s.flags[1] = 1;
      for (int c = 0; c < 4; ++c) s.boxes[4 * r + c] = box[c];
      if (by_class) s.classes[r] = in.classes[i];
      if (pad) {
        or_word(&s.suppressed[r >> 6], uint64_t{1} << (r & 63));
        continue;
      }
      any = true;
      lo_x = min_of(lo_x, ordered_bits(static_cast<float>(box[0])));
      lo_y = min_of(lo_y, ordered_bits(static_cast<float>(box[1])));
      hi_x = max_of(hi_x, ordered_bits(static_cast<float>(add_rn(box[2], a.off))));
      hi_y = max_of(hi_y, ordered_bits(static_cast<float>(add_rn(box[3], a.off))));
    }
    if (!any) return;
    min_bits(&s.extent[0], lo_x);
    min_bits(&s.extent[1], lo_y);
    max_bits(&s.extent[2], hi_x);
    max_bits(&s.extent[3], hi_y);
  });
  const CellScale scale = cell_scale(s.extent);  // the same in every thread

  // Whether row q suppresses row r, whose area is `area` (boxes and classes by rank).
  const auto suppresses_row = [&](int64_t q, int64_t r, T area) {
    const T* other = s.boxes + 4 * q;
    return (!by_class || s.classes[q] == s.classes[r]) &&
           suppresses(other, area_of(other, a.off), s.boxes + 4 * r, area, a.thr, a.off);
  };
  // 4. the blocks in order.
  for (int w = 0; w < words; ++w) {
    const int64_t first = int64_t{w} * kWordBits;
    const int rows = static_cast<int>(min_of(int64_t{kWordBits}, n - first));
    // (a) cols: thread t takes row t % 64 and its columns [t / 64 * per, + per). Also: the grid, `big` and the
    // deferred count cleared, and the levels of the block's open rows up to big_level noted.
    cta.each([&](int t) {
      for (int c = t; c < kSmallCells; c += threads) s.cells[c] = 0;
      if (t == 0) *s.big = *s.deferred = 0;
      constexpr int per = kWordBits / (threads / kWordBits);
      const int row = t % kWordBits, begin = t / kWordBits * per;
      const uint64_t open = open_rows(s.suppressed[w], rows);
      if (t < kWordBits && ((open >> t) & 1) != 0) {
        const CellBox c = cell_box(s.boxes + 4 * (first + t), a.off, scale);
        const int level = cell_level(c);
        if (!intersects_nothing(c) && level <= big_level(by_class)) or_word(&s.levels[w & 1], uint64_t{1} << level);
      }
      if (((open >> row) & 1) == 0 || begin >= row) return;
      const T area = area_of(s.boxes + 4 * (first + row), a.off);
      uint64_t bits = 0;
      const int end = min_of(begin + per, row);
      LB_COST(end - begin);
      for (int c = begin; c < end; ++c) {
        if (((open >> c) & 1) != 0 && suppresses_row(first + c, first + row, area)) bits |= uint64_t{1} << c;
      }
      if (bits != 0) or_word(&s.cols[row], bits);
    });
    // (b) warp 0 resolves the block.
    cta.warp0(&s.kept[w], [&](const auto& warp) {
      return resolve_block(s.cols, open_rows(s.suppressed[w], rows), warp);
    });
    // (c) the block's kept rows enter the grid at the block's level (the coarsest of its open rows up to
    // big_level, so at most 2 x 2 cells for those), the cells they span when at most 3 x 3, else `big`; only when
    // the grid is worth it (grid_level: shared values, so the same in every thread, and every thread reaches the
    // barrier or none does).
    const int level = grid_level(s.kept[w], s.levels[w & 1]);
    if (level >= 0) cta.each([&](int t) {
      if (t >= kWordBits || ((s.kept[w] >> t) & 1) == 0) return;
      const CellBox c = cell_box(s.boxes + 4 * (first + t), a.off, scale);
      if (intersects_nothing(c)) return;
      const uint32_t x1 = c.x1 >> level, x2 = c.x2 >> level, y1 = c.y1 >> level, y2 = c.y2 >> level;
      if (x2 - x1 >= kMaxInsertSpan || y2 - y1 >= kMaxInsertSpan) {  // big: a candidate for every later row
        or_word(s.big, uint64_t{1} << t);
        return;
      }
      const int64_t cls = by_class ? s.classes[first + t] : 0;
      LB_COST((x2 - x1 + 1) * (y2 - y1 + 1));
      for (uint32_t cy = y1; cy <= y2; ++cy) {
        for (uint32_t cx = x1; cx <= x2; ++cx) or_word(&s.cells[cell_word(cx, cy, cls)], uint64_t{1} << t);
      }
    });
    // (d) every later open row is tested against the kept rows in the cells it covers (every kept row when it
    // covers more than 5 x 5, or without the grid), or deferred to (e) when they are more than kDeferAbove; cols
    // and the next block's levels cleared.
    cta.each([&](int t) {
      if (t < kWordBits) s.cols[t] = 0;
      if (t == 0) s.levels[(w + 1) & 1] = 0;
      const uint64_t kept = s.kept[w], big = *s.big;
      if (kept == 0) return;
      for (int64_t r = first + kWordBits + t; r < n; r += threads) {
        LB_COST(1);
        if (test_bit(s.suppressed, r)) continue;  // only this thread sets bit r from here on
        const T* box = s.boxes + 4 * r;
        uint64_t candidates = kept;
        if (level >= 0) {
          const CellBox c = cell_box(box, a.off, scale);
          if (intersects_nothing(c)) continue;
          const uint32_t x1 = c.x1 >> level, x2 = c.x2 >> level, y1 = c.y1 >> level, y2 = c.y2 >> level;
          const int64_t cls = by_class ? s.classes[r] : 0;
          if (x2 - x1 <= 4 && y2 - y1 <= 4) {  // at most 5 x 5 cells, read until every kept row is a candidate
            candidates = big;
            for (uint32_t cy = y1; cy <= y2 && candidates != kept; ++cy) {
              for (uint32_t cx = x1; cx <= x2 && candidates != kept; ++cx) {
                LB_COST(1);
                candidates |= s.cells[cell_word(cx, cy, cls)];
              }
            }
          }
        }
        if (popcount(candidates & kept) > kDeferAbove) {
          LB_COST(1);
          const uint32_t slot = increment(s.deferred);
          if (slot < kDeferredRows) {
            s.deferred_rows[slot] = static_cast<uint16_t>(r);
            continue;
          }
        }
        const T area = area_of(box, a.off);
        bool hit = false;
        for (uint64_t left = candidates & kept; left != 0 && !hit;) {
          LB_COST(1);
          hit = suppresses_row(first + pop_lowest(left), r, area);
        }
        if (hit) or_word(&s.suppressed[r >> 6], uint64_t{1} << (r & 63));
      }
    });
    // (e) the deferred rows, each against every kept row of the block, one (row, kept row) pair per thread; only
    // when (d) deferred a row (a shared count, read by every thread after the barrier and reset in the next (a),
    // past this phase's barrier: every thread reaches it or none does).
    const int deferred = static_cast<int>(min_of(*s.deferred, static_cast<uint32_t>(kDeferredRows)));
    if (deferred > 0) cta.each([&](int t) {
      const uint64_t kept = s.kept[w];
      for (int p = t; p < deferred * kWordBits; p += threads) {
        LB_COST(1);
        const int c = p % kWordBits;
        const int64_t r = s.deferred_rows[p / kWordBits];
        if (((kept >> c) & 1) != 0 && suppresses_row(first + c, r, area_of(s.boxes + 4 * r, a.off))) {
          or_word(&s.suppressed[r >> 6], uint64_t{1} << (r & 63));
        }
      }
    });
  }

  // 5. compaction, counters.
  cta.each([&](int t) {
    int64_t total = 0;
    LB_COST(words);
    for (int w = 0; w < words; ++w) total += popcount(s.kept[w]);
    const bool bad = s.flags[0] != 0 || s.flags[1] != 0;
    const bool erase = bad && a.num_kept != nullptr;
    int64_t* keep = a.keep + b * a.keep_stride;
    for (int64_t r = t; r < n && !erase; r += threads) {
      const int word = static_cast<int>(r >> 6), lane = static_cast<int>(r & 63);
      if (((s.kept[word] >> lane) & 1) == 0) continue;
      int64_t slot = popcount(s.kept[word] & ((uint64_t{1} << lane) - 1));
      LB_COST(word + 1);
      for (int w = 0; w < word; ++w) slot += popcount(s.kept[w]);
      if (slot < a.capacity) keep[slot] = s.order[r];
    }
    const int64_t from = erase ? 0 : min_of(total, a.capacity);
    for (int64_t slot = from + t; slot < a.capacity; slot += threads) {
      LB_COST(1);
      keep[slot] = -1;
    }
    if (t != 0) return;
    if (a.counters != nullptr) {
      int64_t* c = a.counters + b * kCounters;
      c[kKept] = total;
      c[kTileKept] = 0;
      c[kBadScore] = s.flags[0];
      c[kBadBox] = s.flags[1];
    }
    if (a.num_kept != nullptr) a.num_kept[b] = bad ? -1 : min_of(total, a.capacity);
  });
}

}  // namespace lightning_balanced::nms_tiled
