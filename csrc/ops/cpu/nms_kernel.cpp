// CPU kernels of lightning_balanced::nms and lightning_balanced::batched_nms.
//
// Semantics (identical to lightning_balanced/ops/nms_reference.py, which the tests use as oracle):
//   * boxes are (x1, y1, x2, y2); float16/bfloat16 are computed in float32, float32 in float32,
//     float64 in float64 (the "compute type" below);
//   * area = ((x2 - x1) + offset) * ((y2 - y1) + offset);
//     w = max((min(x2a, x2b) - max(x1a, x1b)) + offset, 0), h likewise, inter = w * h;
//     union = (area_a + area_b) - inter;
//   * box b is suppressed by a kept, higher-scoring box a when union > 0 && inter > thr * union,
//     with thr = iou_threshold rounded to the compute type (IoU is 0 when union <= 0);
//   * output: int64 indices of kept boxes by decreasing score, equal scores keep the lower index first.
//
// Speed comes from the greedy formulation "compare each candidate with the boxes kept so far, stop at
// the first suppressor" (which is equivalent to the classic "each kept box suppresses the later ones"),
// with the kept boxes stored as structure-of-arrays blocks of 8 lanes in a multi-level spatial grid:
// one uniform grid per box-size class (largest side within a factor of 2), so boxes of any mix of sizes
// cover at most about 2 x 2 cells of their own level. A candidate visits, in each level, the cells it
// overlaps (a box can only be suppressed by a box it intersects, inter > 0), and skips the levels whose
// areas are too different for IoU > threshold. Scores are ordered with a stable LSD radix sort.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/nms_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) || defined(__clang__)
#define LB_ALWAYS_INLINE inline __attribute__((always_inline))
#define LB_HAVE_VECTOR_EXT 1
#else
#define LB_ALWAYS_INLINE inline
#define LB_HAVE_VECTOR_EXT 0
#endif

#if LB_HAVE_VECTOR_EXT && (defined(__x86_64__) || defined(__i386__))
#define LB_X86_DISPATCH 1
#else
#define LB_X86_DISPATCH 0
#endif

namespace {

constexpr int kLanes = 8;               // boxes per block (one AVX register of float32)
constexpr int64_t kNoGridBelow = 48;    // segments with fewer active boxes scan one kept list
constexpr int32_t kNone = -1;

// ----------------------------------------------------------------------------------------------
// Stable ordering by decreasing score (ties: lower index first).
// ----------------------------------------------------------------------------------------------

// Monotone map of a finite float/double to an unsigned key, then inverted so that ascending keys
// mean descending scores. -0.0 and +0.0 map to the same key (they compare equal).
LB_ALWAYS_INLINE uint64_t desc_key(double v) {
  v = v + 0.0;  // -0.0 -> +0.0
  uint64_t u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u >> 63) ? ~u : (u | (uint64_t{1} << 63));
  return ~u;
}
LB_ALWAYS_INLINE uint32_t desc_key(float v) {
  v = v + 0.0f;
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u >> 31) ? ~u : (u | (uint32_t{1} << 31));
  return ~u;
}

// Stable LSD radix sort of (key, index) by key, 11-bit digits; skips digits shared by all keys.
template <typename K>
void radix_sort(std::vector<K>& keys, std::vector<int32_t>& idx) {
  constexpr int kBits = 11;
  constexpr int kBuckets = 1 << kBits;
  constexpr int kPasses = (sizeof(K) * 8 + kBits - 1) / kBits;
  const size_t n = keys.size();
  std::vector<uint32_t> hist(static_cast<size_t>(kPasses) * kBuckets, 0);
  for (size_t i = 0; i < n; ++i) {
    K k = keys[i];
    for (int p = 0; p < kPasses; ++p) {
      ++hist[p * kBuckets + ((k >> (p * kBits)) & (kBuckets - 1))];
    }
  }
  std::vector<K> keys2(n);
  std::vector<int32_t> idx2(n);
  for (int p = 0; p < kPasses; ++p) {
    uint32_t* h = hist.data() + p * kBuckets;
    const K first_digit = (keys[0] >> (p * kBits)) & (kBuckets - 1);
    if (h[first_digit] == n) continue;  // every key has this digit: the pass would not move anything
    uint32_t sum = 0;
    for (int b = 0; b < kBuckets; ++b) {
      const uint32_t c = h[b];
      h[b] = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; ++i) {
      const size_t dst = h[(keys[i] >> (p * kBits)) & (kBuckets - 1)]++;
      keys2[dst] = keys[i];
      idx2[dst] = idx[i];
    }
    keys.swap(keys2);
    idx.swap(idx2);
  }
}

// Fills `order` with the positions 0..n-1 sorted by decreasing score, ties by increasing position.
template <typename acc_t>
void order_by_score(const std::vector<acc_t>& score, std::vector<int32_t>& order) {
  const int32_t n = static_cast<int32_t>(score.size());
  order.resize(n);
  for (int32_t i = 0; i < n; ++i) order[i] = i;
  if (n <= 16) {  // insertion sort: stable, no allocation
    for (int32_t i = 1; i < n; ++i) {
      const int32_t cur = order[i];
      int32_t j = i;
      while (j > 0 && score[order[j - 1]] < score[cur]) {
        order[j] = order[j - 1];
        --j;
      }
      order[j] = cur;
    }
    return;
  }
  if (n <= 1024) {  // below this, the radix histograms cost more than comparisons
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
    return;
  }
  using K = std::conditional_t<std::is_same_v<acc_t, double>, uint64_t, uint32_t>;
  std::vector<K> keys(n);
  for (int32_t i = 0; i < n; ++i) keys[i] = desc_key(score[i]);
  radix_sort(keys, order);
}

// ----------------------------------------------------------------------------------------------
// The suppression test on blocks of 8 kept boxes.
// ----------------------------------------------------------------------------------------------

template <typename T>
struct alignas(64) Block {
  T x1[kLanes];
  T y1[kLanes];
  T x2[kLanes];
  T y2[kLanes];
  T area[kLanes];
  int32_t next;
};

template <typename T>
struct Candidate {
  T x1, y1, x2, y2, area, thr, off;
};

#if LB_HAVE_VECTOR_EXT
template <typename T>
struct VecTypes;
template <>
struct VecTypes<float> {
  typedef float V __attribute__((vector_size(kLanes * sizeof(float))));
  typedef int32_t M __attribute__((vector_size(kLanes * sizeof(float))));
};
template <>
struct VecTypes<double> {
  typedef double V __attribute__((vector_size(kLanes * sizeof(double))));
  typedef int64_t M __attribute__((vector_size(kLanes * sizeof(double))));
};
#endif

// True when one of the 8 boxes of `b` suppresses the candidate. Padding lanes hold
// x1 = y1 = +inf, x2 = y2 = -inf, area = 0: their w is clamped to 0, so they never suppress.
template <typename T>
LB_ALWAYS_INLINE bool block_suppresses(const Block<T>& b, const Candidate<T>& c) {
#if LB_HAVE_VECTOR_EXT
  using V = typename VecTypes<T>::V;
  using M = typename VecTypes<T>::M;
  V bx1, by1, bx2, by2, ba;
  std::memcpy(&bx1, b.x1, sizeof(V));
  std::memcpy(&by1, b.y1, sizeof(V));
  std::memcpy(&bx2, b.x2, sizeof(V));
  std::memcpy(&by2, b.y2, sizeof(V));
  std::memcpy(&ba, b.area, sizeof(V));
  const V zero = V{} + T(0);
  const V cx1 = V{} + c.x1, cy1 = V{} + c.y1, cx2 = V{} + c.x2, cy2 = V{} + c.y2;
  const V off = V{} + c.off, carea = V{} + c.area, thr = V{} + c.thr;
  const V ix1 = bx1 > cx1 ? bx1 : cx1;
  const V iy1 = by1 > cy1 ? by1 : cy1;
  const V ix2 = bx2 < cx2 ? bx2 : cx2;
  const V iy2 = by2 < cy2 ? by2 : cy2;
  V w = (ix2 - ix1) + off;
  V h = (iy2 - iy1) + off;
  w = w > zero ? w : zero;
  h = h > zero ? h : zero;
  const V inter = w * h;
  const V uni = (ba + carea) - inter;
  const M hit = (uni > zero) & (inter > uni * thr);
  uint64_t words[sizeof(M) / sizeof(uint64_t)];
  std::memcpy(words, &hit, sizeof(M));
  uint64_t any = 0;
  for (size_t k = 0; k < sizeof(M) / sizeof(uint64_t); ++k) any |= words[k];
  return any != 0;
#else
  bool any = false;
  for (int l = 0; l < kLanes; ++l) {
    T w = (std::min(b.x2[l], c.x2) - std::max(b.x1[l], c.x1)) + c.off;
    T h = (std::min(b.y2[l], c.y2) - std::max(b.y1[l], c.y1)) + c.off;
    w = w > T(0) ? w : T(0);
    h = h > T(0) ? h : T(0);
    const T inter = w * h;
    const T uni = (b.area[l] + c.area) - inter;
    any |= (uni > T(0)) && (inter > uni * c.thr);
  }
  return any;
#endif
}

// A singly linked list of blocks in a shared pool.
struct List {
  int32_t head = kNone;
  int32_t tail = kNone;
  int32_t fill = kLanes;  // lanes used in the tail block
};

// One level of the multi-level grid: the active boxes of one size class (largest side within a factor
// of 2), in a uniform grid whose cells are about twice that class's largest width and height, so a box
// of the level covers at most 2 x 2 cells; a dense level (e.g. many long thin boxes) gets smaller cells.
// Cells of all levels live in Workspace::cells from `cell_base` on.
struct Level {
  int64_t count = 0;        // active boxes assigned to this level
  double max_w = 0.0, max_h = 0.0;
  double min_area = std::numeric_limits<double>::infinity();
  double max_area = -std::numeric_limits<double>::infinity();
  bool gridable = false;    // false for boxes with an infinite side
  bool grid = false;        // false: the level is scanned through `all` only
  int64_t nx = 1, ny = 1;
  double inv_cw = 0.0, inv_ch = 0.0;
  int64_t cell_base = 0;
  List all;                 // every kept box of this level
  int64_t all_blocks = 0;   // blocks in `all`
};

template <typename T>
struct Workspace {
  std::vector<Block<T>> pool;
  std::vector<List> cells;
  std::vector<Level> levels;
  std::vector<int32_t> active_levels;  // ids of non-empty levels
  std::vector<int32_t> level_of;       // level of each box of the segment (kInactive: degenerate)
  // SoA copies of one segment, in decreasing score order.
  std::vector<T> x1, y1, x2, y2, area;
};

constexpr int32_t kInactive = -1;
constexpr int kMaxClasses = 24;     // size classes per axis, by factors of 2; the smallest ones share class 0
constexpr double kCellScale = 2.0;     // cell side / largest box side of the level
constexpr double kCellsPerBox = 2.0;   // a level has at most max(64, kCellsPerBox * count) cells ...
constexpr double kBoxesPerCell = 8.0;  // ... and at least count / kBoxesPerCell (dense levels get smaller cells)

template <typename T>
LB_ALWAYS_INLINE void list_append(std::vector<Block<T>>& pool, List& list, const Candidate<T>& c) {
  if (list.fill == kLanes) {
    const int32_t id = static_cast<int32_t>(pool.size());
    pool.emplace_back();
    Block<T>& blk = pool.back();
    const T inf = std::numeric_limits<T>::infinity();
    for (int l = 0; l < kLanes; ++l) {
      blk.x1[l] = inf;
      blk.y1[l] = inf;
      blk.x2[l] = -inf;
      blk.y2[l] = -inf;
      blk.area[l] = T(0);
    }
    blk.next = kNone;
    if (list.tail == kNone) {
      list.head = id;
    } else {
      pool[list.tail].next = id;
    }
    list.tail = id;
    list.fill = 0;
  }
  Block<T>& blk = pool[list.tail];
  const int l = list.fill++;
  blk.x1[l] = c.x1;
  blk.y1[l] = c.y1;
  blk.x2[l] = c.x2;
  blk.y2[l] = c.y2;
  blk.area[l] = c.area;
}

template <typename T>
LB_ALWAYS_INLINE bool list_suppresses(const std::vector<Block<T>>& pool, const List& list, const Candidate<T>& c) {
  for (int32_t b = list.head; b != kNone; b = pool[b].next) {
    if (block_suppresses(pool[b], c)) return true;
  }
  return false;
}

// Cell of coordinate v: monotone in v, so boxes whose [x1, x2 + offset] intervals intersect share a cell.
LB_ALWAYS_INLINE int64_t cell_of(double v, double origin, double inv, int64_t count) {
  const double f = std::floor((v - origin) * inv);
  return static_cast<int64_t>(std::min(std::max(f, 0.0), static_cast<double>(count - 1)));
}

// Greedy NMS of one segment (boxes already in decreasing score order, in ws.x1 ... ws.area).
// Writes keep[i] = 1 for kept boxes and 0 for suppressed ones.
//
// Kept boxes are stored in a multi-level grid: one uniform grid per size class. A candidate looks, in each
// level, at the cells it overlaps, or at the level's whole list when that is fewer blocks. Two pruning rules
// skip levels whose boxes cannot suppress the candidate, both exact in floating point (see size_prunes).
template <typename T>
LB_ALWAYS_INLINE void nms_segment_impl(Workspace<T>& ws, int64_t n, T thr, T off, uint8_t* keep) {
  const T* x1 = ws.x1.data();
  const T* y1 = ws.y1.data();
  const T* x2 = ws.x2.data();
  const T* y2 = ws.y2.data();
  const T* area = ws.area.data();
  auto& pool = ws.pool;
  pool.clear();

  // Boxes whose own width or height ((x2 - x1) + offset) is <= 0 cannot intersect anything with
  // w > 0 (rounding is monotone), so they are always kept and never suppress: skip them.
  const double doff = static_cast<double>(off);
  const double inf = std::numeric_limits<double>::infinity();
  int64_t n_active = 0;
  double gx0 = inf, gy0 = inf, gx1 = -inf, gy1 = -inf;
  double min_side = inf, max_side = 0.0;  // largest side (w or h) of a box, over the finite ones
  auto& level_of = ws.level_of;
  level_of.assign(n, kInactive);
  for (int64_t i = 0; i < n; ++i) {
    const T w = (x2[i] - x1[i]) + off;
    const T h = (y2[i] - y1[i]) + off;
    if (w > T(0) && h > T(0)) {
      ++n_active;
      level_of[i] = 0;
      gx0 = std::min(gx0, static_cast<double>(x1[i]));
      gy0 = std::min(gy0, static_cast<double>(y1[i]));
      gx1 = std::max(gx1, static_cast<double>(x2[i]) + doff);
      gy1 = std::max(gy1, static_cast<double>(y2[i]) + doff);
      const double side = std::max(static_cast<double>(w), static_cast<double>(h));
      if (std::isfinite(side)) {
        min_side = std::min(min_side, side);
        max_side = std::max(max_side, side);
      }
    }
  }

  // Size classes: level k holds the boxes whose largest side is in (max_side / 2^(K-k), max_side / 2^(K-1-k)];
  // the smallest classes share level 0; boxes with an infinite side get level K, which has no grid.
  int num_classes = 1;
  if (n_active >= kNoGridBelow && max_side > 0.0) {
    const double ratio = max_side / min_side;
    num_classes = std::isfinite(ratio) ? static_cast<int>(std::ceil(std::log2(ratio))) + 1 : kMaxClasses;
    num_classes = std::max(1, std::min(kMaxClasses, num_classes));
  }
  const int num_levels = num_classes + 1;
  auto& levels = ws.levels;
  auto& active_levels = ws.active_levels;
  levels.assign(num_levels, Level{});
  for (int64_t i = 0; i < n; ++i) {
    if (level_of[i] == kInactive) continue;
    const double w = static_cast<double>((x2[i] - x1[i]) + off);
    const double h = static_cast<double>((y2[i] - y1[i]) + off);
    const double side = std::max(w, h);
    int lv = num_classes;
    if (std::isfinite(side)) {
      const double down = std::floor(std::log2(max_side / side));  // 0 for the largest class
      lv = num_classes - 1 - static_cast<int>(std::min(std::max(down, 0.0), static_cast<double>(num_classes - 1)));
    }
    level_of[i] = lv;
    Level& L = levels[lv];
    L.gridable = lv < num_classes;
    ++L.count;
    L.max_w = std::max(L.max_w, w);
    L.max_h = std::max(L.max_h, h);
    const double a = static_cast<double>(area[i]);
    L.min_area = std::min(L.min_area, a);
    L.max_area = std::max(L.max_area, a);
  }

  // Grid geometry of each level, over the bounding box of all active boxes.
  int64_t total_cells = 0;
  active_levels.clear();
  const double range_x = gx1 - gx0, range_y = gy1 - gy0;
  for (int lv = 0; lv < num_levels; ++lv) {
    Level& L = levels[lv];
    if (L.count == 0) continue;
    active_levels.push_back(lv);
    if (!L.gridable || n_active < kNoGridBelow) continue;
    double cw = L.max_w * kCellScale, ch = L.max_h * kCellScale;
    if (!(range_x > 0 && range_y > 0 && cw > 0 && ch > 0 && std::isfinite(range_x) && std::isfinite(range_y) &&
          std::isfinite(cw) && std::isfinite(ch))) {
      continue;
    }
    const double max_cells = std::max(64.0, kCellsPerBox * static_cast<double>(L.count));
    const double min_cells = static_cast<double>(L.count) / kBoxesPerCell;
    double fx = std::floor(range_x / cw) + 1.0, fy = std::floor(range_y / ch) + 1.0;
    if (fx * fy < min_cells) {  // dense level (e.g. many long thin boxes): smaller cells, about kBoxesPerCell each
      const double s = std::sqrt(fx * fy / min_cells);
      cw *= s;
      ch *= s;
      fx = std::floor(range_x / cw) + 1.0;
      fy = std::floor(range_y / ch) + 1.0;
    }
    if (fx * fy > max_cells) {
      const double s = std::sqrt(fx * fy / max_cells);
      cw *= s;
      ch *= s;
      fx = std::floor(range_x / cw) + 1.0;
      fy = std::floor(range_y / ch) + 1.0;
    }
    if (fx * fy <= 4.0 * max_cells && fx * fy > 1.0 && std::isfinite(1.0 / cw) && std::isfinite(1.0 / ch)) {
      L.grid = true;
      L.nx = static_cast<int64_t>(fx);
      L.ny = static_cast<int64_t>(fy);
      L.inv_cw = 1.0 / cw;
      L.inv_ch = 1.0 / ch;
      L.cell_base = total_cells;
      total_cells += L.nx * L.ny;
    }
  }
  auto& cells = ws.cells;
  cells.assign(static_cast<size_t>(total_cells), List{});

  // A box of area a_s can suppress one of area a_b >= a_s only if a_s > thr * a_b (IoU <= a_s / a_b). In the
  // kernel's rounding, inter <= a_s and union >= a_b * (1 - 3 eps), so requiring a margin of 1e-5 keeps the
  // rule exact; with thr = 0 nothing is pruned.
  const double dthr = static_cast<double>(thr);
  const double prune_thr = dthr * (1.0 - 1e-5);
  auto size_prunes = [&](const Level& L, double a) {
    return prune_thr > 0.0 && (L.max_area < prune_thr * a || a < prune_thr * L.min_area);
  };

  for (int64_t i = 0; i < n; ++i) {
    const int own = level_of[i];
    if (own == kInactive) {
      keep[i] = 1;
      continue;
    }
    const Candidate<T> c{x1[i], y1[i], x2[i], y2[i], area[i], thr, off};
    const double a = static_cast<double>(c.area);
    const double cx1d = static_cast<double>(c.x1), cy1d = static_cast<double>(c.y1);
    const double cx2d = static_cast<double>(c.x2) + doff, cy2d = static_cast<double>(c.y2) + doff;
    bool suppressed = false;
    // The candidate's own level first (the likeliest suppressors), then the others.
    for (size_t k = 0; k <= active_levels.size() && !suppressed; ++k) {
      const int lv = k == 0 ? own : active_levels[k - 1];
      if (k > 0 && lv == own) continue;
      const Level& L = levels[lv];
      if (L.all.head == kNone || size_prunes(L, a)) continue;
      if (!L.grid) {
        suppressed = list_suppresses(pool, L.all, c);
        continue;
      }
      const int64_t qx0 = cell_of(cx1d, gx0, L.inv_cw, L.nx), qx1 = cell_of(cx2d, gx0, L.inv_cw, L.nx);
      const int64_t qy0 = cell_of(cy1d, gy0, L.inv_ch, L.ny), qy1 = cell_of(cy2d, gy0, L.inv_ch, L.ny);
      if ((qx1 - qx0 + 1) * (qy1 - qy0 + 1) > L.all_blocks) {
        suppressed = list_suppresses(pool, L.all, c);
        continue;
      }
      for (int64_t cy = qy0; cy <= qy1 && !suppressed; ++cy) {
        const List* row = cells.data() + L.cell_base + cy * L.nx;
        for (int64_t cx = qx0; cx <= qx1 && !suppressed; ++cx) suppressed = list_suppresses(pool, row[cx], c);
      }
    }
    keep[i] = suppressed ? 0 : 1;
    if (suppressed) continue;
    Level& L = levels[own];
    if (L.all.fill == kLanes) ++L.all_blocks;
    list_append(pool, L.all, c);
    if (L.grid) {
      const int64_t qx0 = cell_of(cx1d, gx0, L.inv_cw, L.nx), qx1 = cell_of(cx2d, gx0, L.inv_cw, L.nx);
      const int64_t qy0 = cell_of(cy1d, gy0, L.inv_ch, L.ny), qy1 = cell_of(cy2d, gy0, L.inv_ch, L.ny);
      for (int64_t cy = qy0; cy <= qy1; ++cy) {
        List* row = cells.data() + L.cell_base + cy * L.nx;
        for (int64_t cx = qx0; cx <= qx1; ++cx) list_append(pool, row[cx], c);
      }
    }
  }
}

// One generic and (on x86) one AVX2 build of the segment loop, chosen once at run time.
void nms_segment_generic_f32(Workspace<float>& ws, int64_t n, float thr, float off, uint8_t* keep) {
  nms_segment_impl<float>(ws, n, thr, off, keep);
}
void nms_segment_generic_f64(Workspace<double>& ws, int64_t n, double thr, double off, uint8_t* keep) {
  nms_segment_impl<double>(ws, n, thr, off, keep);
}
#if LB_X86_DISPATCH
__attribute__((target("avx2"))) void nms_segment_avx2_f32(Workspace<float>& ws, int64_t n, float thr, float off,
                                                          uint8_t* keep) {
  nms_segment_impl<float>(ws, n, thr, off, keep);
}
__attribute__((target("avx2"))) void nms_segment_avx2_f64(Workspace<double>& ws, int64_t n, double thr, double off,
                                                          uint8_t* keep) {
  nms_segment_impl<double>(ws, n, thr, off, keep);
}
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

void nms_segment(Workspace<float>& ws, int64_t n, float thr, float off, uint8_t* keep) {
#if LB_X86_DISPATCH
  if (cpu_has_avx2()) return nms_segment_avx2_f32(ws, n, thr, off, keep);
#endif
  nms_segment_generic_f32(ws, n, thr, off, keep);
}
void nms_segment(Workspace<double>& ws, int64_t n, double thr, double off, uint8_t* keep) {
#if LB_X86_DISPATCH
  if (cpu_has_avx2()) return nms_segment_avx2_f64(ws, n, thr, off, keep);
#endif
  nms_segment_generic_f64(ws, n, thr, off, keep);
}

// ----------------------------------------------------------------------------------------------
// Driver: read (strided, any floating dtype), order, split by class, run segments, write indices.
// ----------------------------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
at::Tensor nms_cpu_typed(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
                         double iou_threshold, int64_t offset) {
  const int64_t n = boxes.size(0);
  const scalar_t* bp = boxes.const_data_ptr<scalar_t>();
  const scalar_t* sp = scores.const_data_ptr<scalar_t>();
  const int64_t bs0 = boxes.stride(0), bs1 = boxes.stride(1), ss = scores.stride(0);

  std::vector<acc_t> score(n);
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(sp[i * ss]);
    finite &= std::isfinite(v);
    score[i] = v;
  }
  TORCH_CHECK_VALUE(finite, op, ": scores must be finite (no NaN or infinity)");

  std::vector<int32_t> order;  // rank -> original index
  order_by_score(score, order);

  // seg_order: ranks grouped by class (stable, so still by decreasing score within a class).
  std::vector<int32_t> seg_order;
  std::vector<int64_t> seg_bounds{0};
  if (idxs == nullptr) {
    seg_bounds.push_back(n);
  } else {
    const int64_t* ip = idxs->const_data_ptr<int64_t>();
    const int64_t is = idxs->stride(0);
    std::vector<int64_t> cls(n);  // class of each rank
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
    for (int64_t r = 0; r < n; ++r) {
      const int64_t v = ip[static_cast<int64_t>(order[r]) * is];
      cls[r] = v;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    seg_order.resize(n);
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
    if (n > 0 && span < static_cast<uint64_t>(4 * n + 1024)) {  // counting sort on class - lo
      std::vector<int64_t> start(span + 2, 0);
      for (int64_t r = 0; r < n; ++r) ++start[static_cast<uint64_t>(cls[r] - lo) + 1];
      for (size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
      for (size_t b = 0; b + 1 < start.size(); ++b) {
        if (start[b + 1] > start[b]) seg_bounds.push_back(start[b + 1]);
      }
      for (int64_t r = 0; r < n; ++r) seg_order[start[static_cast<uint64_t>(cls[r] - lo)]++] = static_cast<int32_t>(r);
    } else {
      for (int64_t r = 0; r < n; ++r) seg_order[r] = static_cast<int32_t>(r);
      std::stable_sort(seg_order.begin(), seg_order.end(), [&](int32_t a, int32_t b) { return cls[a] < cls[b]; });
      for (int64_t k = 1; k < n; ++k) {
        if (cls[seg_order[k]] != cls[seg_order[k - 1]]) seg_bounds.push_back(k);
      }
      seg_bounds.push_back(n);
    }
  }

  Workspace<acc_t> ws;
  const acc_t off = static_cast<acc_t>(offset);
  const acc_t thr = static_cast<acc_t>(iou_threshold);
  std::vector<uint8_t> keep_rank(n, 0);
  std::vector<uint8_t> keep_seg;
  bool boxes_finite = true;
  for (size_t s = 0; s + 1 < seg_bounds.size(); ++s) {
    const int64_t begin = seg_bounds[s], m = seg_bounds[s + 1] - begin;
    ws.x1.resize(m);
    ws.y1.resize(m);
    ws.x2.resize(m);
    ws.y2.resize(m);
    ws.area.resize(m);
    for (int64_t k = 0; k < m; ++k) {
      const int64_t rank = idxs == nullptr ? k : seg_order[begin + k];
      const scalar_t* b = bp + static_cast<int64_t>(order[rank]) * bs0;
      const acc_t a = static_cast<acc_t>(b[0]), bb = static_cast<acc_t>(b[bs1]);
      const acc_t c = static_cast<acc_t>(b[2 * bs1]), d = static_cast<acc_t>(b[3 * bs1]);
      boxes_finite &= std::isfinite(a) & std::isfinite(bb) & std::isfinite(c) & std::isfinite(d);
      ws.x1[k] = a;
      ws.y1[k] = bb;
      ws.x2[k] = c;
      ws.y2[k] = d;
      ws.area[k] = ((c - a) + off) * ((d - bb) + off);
    }
    TORCH_CHECK_VALUE(boxes_finite, op, ": box coordinates must be finite (no NaN or infinity)");
    if (idxs == nullptr) {
      nms_segment(ws, m, thr, off, keep_rank.data());
    } else {
      keep_seg.assign(m, 0);
      nms_segment(ws, m, thr, off, keep_seg.data());
      for (int64_t k = 0; k < m; ++k) keep_rank[seg_order[begin + k]] = keep_seg[k];
    }
  }

  int64_t kept = 0;
  for (int64_t r = 0; r < n; ++r) kept += keep_rank[r];
  at::Tensor out = at::empty({kept}, boxes.options().dtype(at::kLong));
  int64_t* out_ptr = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0, k = 0; r < n; ++r) {
    if (keep_rank[r]) out_ptr[k++] = order[r];
  }
  return out;
}

at::Tensor nms_cpu_dispatch(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
                            double iou_threshold, int64_t offset) {
  if (boxes.size(0) == 0) return at::empty({0}, boxes.options().dtype(at::kLong));
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "lightning_balanced_nms_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const char* op = idxs == nullptr ? "nms" : "batched_nms";
    out = nms_cpu_typed<scalar_t, acc_t>(op, boxes, scores, idxs, iou_threshold, offset);
  });
  return out;
}

at::Tensor nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold, int64_t offset) {
  lightning_balanced::check_nms_args("nms", boxes, scores, iou_threshold, offset);
  TORCH_CHECK_VALUE(boxes.device().is_cpu(), "nms: the CPU kernel got tensors on ", boxes.device());
  return nms_cpu_dispatch(boxes, scores, nullptr, iou_threshold, offset);
}

at::Tensor batched_nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                           double iou_threshold, int64_t offset) {
  if (lightning_balanced::batched_nms_input_is_empty(boxes, iou_threshold, offset)) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  lightning_balanced::check_nms_args("batched_nms", boxes, scores, iou_threshold, offset);
  lightning_balanced::check_idxs_arg(boxes, idxs);
  TORCH_CHECK_VALUE(boxes.device().is_cpu(), "batched_nms: the CPU kernel got tensors on ", boxes.device());
  const at::Tensor classes = lightning_balanced::idxs_as_int64(idxs);
  return nms_cpu_dispatch(boxes, scores, &classes, iou_threshold, offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CPU, m) {
  m.impl("nms", &nms_cpu);
  m.impl("batched_nms", &batched_nms_cpu);
}
