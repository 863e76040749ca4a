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
//      a padding box (score -inf, padded form) marked suppressed;
//   4. per 64-row block w, in order (3 phases): (a) `cols`, the earlier open rows of the block that suppress each
//      open row (16 threads per row, 4 columns each, ORed in with a shared atomic); (b) warp 0 resolves the block
//      in rounds of ballots (resolve_block of nms_tiled.h, unchanged); (c) every later open row is tested against
//      the block's kept rows (one thread per row, 4 rows per thread at 4096, stopping at the first hit). Only kept
//      rows suppress, and a suppressed row is never tested again. Work: (kept rows) x (open later rows), bounded
//      by n^2 / 2 IoU tests on one SM; the cost model reports its critical path (test_nms_small.py bounds it);
//   5. compaction: each kept row's output slot is the popcount of the kept rows before it; the slots after the
//      last kept box get -1; thread 0 writes the counters (kept, flags) and, for the padded form, num_kept (or -1
//      and a row of -1 for an image with a non-finite value). No global scratch, nothing zero-filled by the host.
// Shared memory: 3 x 64 words, the boxes (4 values per box, at least the sort's S scores), the sort's S int32
// indices, and for batched_nms the int64 classes: float32 4096 boxes 81.5 KiB (113.5 KiB with classes), float64
// 145.5 KiB (177.5 KiB). Over the 48 KiB static limit, so it is dynamic shared memory, opted in with
// cudaFuncSetAttribute; the CUDA driver takes this path only when `small_shared_bytes` fits the device's opt-in
// limit (227 KiB on sm_90 and sm_100: all of them; 163 KiB on sm_80: all but float64 with classes at the top;
// 99 KiB on sm_86/89; 64 KiB on sm_75), else the tiled chain. The emulation models sm_90's limit.
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
  return 3 * 64 * 8 + round_up8(small_box_values(n) * value_bytes) + (by_class ? 8 * n : 0) +
         round_up8(4 * small_sort_size(n)) + 8;
}

// The shared arrays, carved out of one buffer in the order of small_shared_bytes (8-byte aligned).
template <typename T>
struct SmallShared {
  uint64_t* suppressed;  // [64]: rows suppressed (or padding), by rank
  uint64_t* kept;        // [64]: kept rows, block by block
  uint64_t* cols;        // [64]: the current block's `cols`
  T* boxes;              // [n, 4] by rank; before that, the sort's scores [S]
  int64_t* classes;      // [n] by rank, or nullptr
  int32_t* order;        // [S]: rank -> input index
  int32_t* flags;        // [2]: a non-finite score, a non-finite coordinate
};

template <typename T>
LB_HOST_DEVICE SmallShared<T> small_shared(unsigned char* base, int64_t n, bool by_class) {
  SmallShared<T> s{};
  s.suppressed = reinterpret_cast<uint64_t*>(base);
  s.kept = s.suppressed + 64;
  s.cols = s.kept + 64;
  unsigned char* p = base + 3 * 64 * 8;
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

  // 3. the boxes by rank (keys are not read from here on), flags, padding.
  cta.each([&](int t) {
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
      if (pad) or_word(&s.suppressed[r >> 6], uint64_t{1} << (r & 63));
    }
  });

  const auto same_class = [&](int64_t x, int64_t y) { return !by_class || s.classes[x] == s.classes[y]; };
  // 4. the blocks in order.
  for (int w = 0; w < words; ++w) {
    const int64_t first = int64_t{w} * kWordBits;
    const int rows = static_cast<int>(min_of(int64_t{kWordBits}, n - first));
    // (a) cols: thread t takes row t % 64 and its columns [t / 64 * per, + per).
    cta.each([&](int t) {
      constexpr int per = kWordBits / (threads / kWordBits);
      const int row = t % kWordBits, begin = t / kWordBits * per;
      const uint64_t open = open_rows(s.suppressed[w], rows);
      if (((open >> row) & 1) == 0 || begin >= row) return;
      const T* box = s.boxes + 4 * (first + row);
      const T area = area_of(box, a.off);
      uint64_t bits = 0;
      const int end = min_of(begin + per, row);
      LB_COST(end - begin);
      for (int c = begin; c < end; ++c) {
        if (((open >> c) & 1) == 0 || !same_class(first + c, first + row)) continue;
        const T* other = s.boxes + 4 * (first + c);
        if (suppresses(other, area_of(other, a.off), box, area, a.thr, a.off)) bits |= uint64_t{1} << c;
      }
      if (bits != 0) or_word(&s.cols[row], bits);
    });
    // (b) warp 0 resolves the block.
    cta.warp0(&s.kept[w], [&](const auto& warp) {
      return resolve_block(s.cols, open_rows(s.suppressed[w], rows), warp);
    });
    // (c) the block's kept rows suppress the later open rows; cols cleared for the next block.
    cta.each([&](int t) {
      if (t < kWordBits) s.cols[t] = 0;
      const uint64_t kept = s.kept[w];
      if (kept == 0) return;
      for (int64_t r = first + kWordBits + t; r < n; r += threads) {
        LB_COST(1);
        if (test_bit(s.suppressed, r)) continue;  // only this thread sets bit r from here on
        const T* box = s.boxes + 4 * r;
        const T area = area_of(box, a.off);
        bool hit = false;
        for (uint64_t left = kept; left != 0 && !hit;) {
          LB_COST(1);
          const int64_t q = first + pop_lowest(left);
          const T* other = s.boxes + 4 * q;
          hit = same_class(q, r) && suppresses(other, area_of(other, a.off), box, area, a.thr, a.off);
        }
        if (hit) or_word(&s.suppressed[r >> 6], uint64_t{1} << (r & 63));
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
