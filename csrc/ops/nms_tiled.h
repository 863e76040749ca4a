// The tiled NMS algorithm of the CUDA kernels, written once for the device and the host.
//
// Every function here is compiled by nvcc for the GPU (cuda/nms_kernel.cu) and by the C++ compiler for the
// CPU emulation (cpu/nms_tiled_schedule.cpp, the private op `_nms_tiled_schedule`), which runs the same steps
// in the same order as the kernels, one "thread" after another. The tests compare that emulation with the
// reference on CPU, so the algorithm the GPU runs is checked on every CI run, with or without a GPU.
//
// The greedy NMS (boxes by decreasing score; a box is kept unless a kept, higher-scoring box suppresses it)
// runs over tiles of `rows` consecutive boxes in score order (1024 on the GPU):
//   1. resolve the tile. Before the first tile, each row's masks within its tile are computed for all tiles at
//      once: the later rows of each 64-row block of the tile that it suppresses, and, for its own block, the
//      earlier rows that suppress it (the column). The tile kernel then takes the tile's 64-row blocks in order;
//      warp 0 resolves a block in rounds of two ballots (a row none of whose open or kept suppressors remains is
//      kept, a row with a kept suppressor is suppressed; rounds follow the longest chain of suppressions, at most
//      64), and every thread whose row was kept ORs its suppression of the later blocks into them (an OR over the
//      warp, one shared atomic per warp). No thread runs a loop over the rows;
//   2. propagate: the tile's kept rows mark, in the `removed` bitmask of all boxes, the boxes they suppress. The
//      boxes are indexed there in a spatial order (Morton order of the box centres), in blocks of 64 (one word of
//      `removed`) and super-blocks of up to 64 blocks, each with the bounding region of its boxes and the range of
//      their classes. The step's warps take the pairs (kept row, super-block) 32 at a time, one per lane; for a
//      pair that may overlap, the warp tests the super-block's blocks in one ballot, then each open block that may
//      overlap, 2 boxes per lane. Rows of the tile are marked decided at the end of step 1.
// A box is suppressed by a kept, higher-scoring box exactly when the sequential greedy pass says so: the
// earlier tiles' kept boxes reach it through `removed` (step 2), the same tile's through step 1. Bits set for
// boxes already decided are never read again, so the propagation needs no score-order test. Memory is linear in
// the number of boxes (no N x N/64 mask) and the work follows the overlaps, not N^2. On the GPU, the steps of all
// tiles run in one persistent kernel, phases separated by grid barriers (run_chain of nms_tiled_driver.h); without
// cooperative launch, or under graph capture, two launches per tile.
//
// The same functions run in the CPU emulation, threads one after another and a warp's lanes in a loop (`Warp`
// below); there each loop iteration also counts a serial step (LB_COST), the emulation's cost model.
//
// Arithmetic: exactly that of the CPU kernel and the reference (cpu/nms_kernel.cpp), each operation rounded
// to nearest (__fadd_rn, ... on the device so nvcc cannot contract them into FMAs; the host build uses
// -ffp-contract=off).

#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __CUDACC__
#define LB_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LB_HOST_DEVICE inline
#endif

namespace lightning_balanced::nms_tiled {

constexpr int kWordBits = 64;    // boxes per block = bits per word of a bitmask
constexpr int kMaxSuperBlocks = 64;  // blocks per super-block, at most (one ballot of a warp)
constexpr int kWarpReduceSteps = 5;  // the shuffles of an OR over a warp of 32

// ---- arithmetic, rounded to nearest ------------------------------------------------------------------------------
#ifdef __CUDA_ARCH__
#define LB_ROUNDED(device, host) return device
#else
#define LB_ROUNDED(device, host) return host
#endif
LB_HOST_DEVICE float add_rn(float a, float b) { LB_ROUNDED(__fadd_rn(a, b), a + b); }
LB_HOST_DEVICE double add_rn(double a, double b) { LB_ROUNDED(__dadd_rn(a, b), a + b); }
LB_HOST_DEVICE float sub_rn(float a, float b) { LB_ROUNDED(__fsub_rn(a, b), a - b); }
LB_HOST_DEVICE double sub_rn(double a, double b) { LB_ROUNDED(__dsub_rn(a, b), a - b); }
LB_HOST_DEVICE float mul_rn(float a, float b) { LB_ROUNDED(__fmul_rn(a, b), a * b); }
LB_HOST_DEVICE double mul_rn(double a, double b) { LB_ROUNDED(__dmul_rn(a, b), a * b); }
#undef LB_ROUNDED

template <typename T>
LB_HOST_DEVICE T min_of(T a, T b) {
  return a < b ? a : b;
}
template <typename T>
LB_HOST_DEVICE T max_of(T a, T b) {
  return a > b ? a : b;
}

// ---- cost model (host emulation only) ------------------------------------------------------------------------------
// Each loop iteration a thread runs (a box compared, a block or super-block visited, a round) adds one serial step;
// the emulation records, per launch, the largest count of any thread (cpu/nms_tiled_schedule.cpp). On the device
// the counting compiles to nothing.
#ifdef __CUDA_ARCH__
#define LB_COST(steps) ((void)0)
#else
inline int64_t& serial_steps() {
  static thread_local int64_t steps = 0;
  return steps;
}
#define LB_COST(steps) (::lightning_balanced::nms_tiled::serial_steps() += (steps))
#endif

// `*word |= bits`, atomically on the device (other threads OR into the same word).
LB_HOST_DEVICE void or_word(uint64_t* word, uint64_t bits) {
#ifdef __CUDA_ARCH__
  atomicOr(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(bits));
#else
  *word |= bits;
#endif
}

LB_HOST_DEVICE bool test_bit(const uint64_t* words, int64_t i) { return (words[i >> 6] >> (i & 63)) & 1; }

// ---- boxes ------------------------------------------------------------------------------------------------------
// A box is 4 values (x1, y1, x2, y2); so is a bounding region (min x1, min y1, max x2, max y2) of a group.
template <typename T>
LB_HOST_DEVICE T area_of(const T* b, T off) {
  return mul_rn(add_rn(sub_rn(b[2], b[0]), off), add_rn(sub_rn(b[3], b[1]), off));
}

// Box a suppresses box b: union > 0 && inter > thr * union, in the exact operation order of the reference.
template <typename T>
LB_HOST_DEVICE bool suppresses(const T* a, T area_a, const T* b, T area_b, T thr, T off) {
  T w = add_rn(sub_rn(min_of(a[2], b[2]), max_of(a[0], b[0])), off);
  T h = add_rn(sub_rn(min_of(a[3], b[3]), max_of(a[1], b[1])), off);
  w = max_of(w, T(0));
  h = max_of(h, T(0));
  const T inter = mul_rn(w, h);
  const T uni = sub_rn(add_rn(area_a, area_b), inter);
  return uni > T(0) && inter > mul_rn(uni, thr);
}

// False only when box a suppresses no box inside `region`: the intersection width (or height) of a with any
// box inside is at most that with the region (min/max and rounding are monotone), so when the region's is
// <= 0, every inter is 0 and `inter > thr * union` fails. Exact, not a heuristic.
template <typename T>
LB_HOST_DEVICE bool may_overlap(const T* a, const T* region, T off) {
  const T w = add_rn(sub_rn(min_of(a[2], region[2]), max_of(a[0], region[0])), off);
  const T h = add_rn(sub_rn(min_of(a[3], region[3]), max_of(a[1], region[1])), off);
  return w > T(0) && h > T(0);
}

LB_HOST_DEVICE uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
#endif
}

LB_HOST_DEVICE float float_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

// A float as an order-preserving unsigned integer (v <= w gives ordered_bits(v) <= ordered_bits(w), NaN aside),
// and back.
LB_HOST_DEVICE uint32_t ordered_bits(float v) {
  const uint32_t u = float_bits(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

LB_HOST_DEVICE float from_ordered_bits(uint32_t k) {
  return float_from_bits((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The top 16 bits of a float in an order-preserving unsigned form: buckets whose width is 1/128 of their
// binade, so the spatial order needs no extent of the input (no reduction before it).
LB_HOST_DEVICE uint32_t ordered_key16(float v) { return ordered_bits(v) >> 16; }

LB_HOST_DEVICE uint32_t spread_bits16(uint32_t x) {
  x &= 0xFFFFu;
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  x = (x | (x << 2)) & 0x33333333u;
  x = (x | (x << 1)) & 0x55555555u;
  return x;
}

// Morton code of the box centre (z-order curve): near codes are near boxes, so 64 consecutive boxes of the
// order have a small bounding region. Only the order depends on it, never a result.
template <typename T>
LB_HOST_DEVICE uint32_t morton_code(const T* b) {
  const float cx = static_cast<float>(b[0]) * 0.5f + static_cast<float>(b[2]) * 0.5f;
  const float cy = static_cast<float>(b[1]) * 0.5f + static_cast<float>(b[3]) * 0.5f;
  return spread_bits16(ordered_key16(cx)) | (spread_bits16(ordered_key16(cy)) << 1);
}

// ---- the spatial index of all boxes -------------------------------------------------------------------------------
// The boxes in spatial order (`boxes`, `classes`), the bounding region and class range of each block of 64 and
// each super-block of 64 blocks, and `removed`: one bit per box, set once the box is decided (kept or suppressed)
// or suppressed by a kept box; the bits past the last box are set from the start.
template <typename T>
struct SpatialIndex {
  int64_t n;
  const T* boxes;            // [n, 4]
  const int64_t* classes;    // [n], or nullptr (one class)
  const T* block_region;     // [blocks, 4]
  const int64_t* block_classes;  // [blocks, 2]: min, max
  const T* super_region;     // [supers, 4]
  const int64_t* super_classes;  // [supers, 2]
  uint64_t* removed;         // [blocks]
};

LB_HOST_DEVICE int64_t num_words(int64_t n) { return (n + kWordBits - 1) / kWordBits; }
LB_HOST_DEVICE int64_t num_supers(int64_t n, int super_blocks) {
  return (num_words(n) + super_blocks - 1) / super_blocks;
}


// The bits past the last box of the last word: decided from the start.
LB_HOST_DEVICE uint64_t padding_bits(int64_t n) {
  const int used = static_cast<int>(n % kWordBits);
  return used == 0 ? 0 : ~uint64_t{0} << used;
}

// Bounding region and class range of `count` groups starting at `first` (each a region of 4 values, or a box,
// and a class range of 2 values, or one class, or none): one block from its boxes, or one super-block from its
// blocks.
template <typename T>
LB_HOST_DEVICE void bound_groups(const T* regions, const int64_t* classes, int class_stride, int64_t first, int64_t count,
                                 T* region, int64_t* class_range) {
  const T* r = regions + first * 4;
  T x1 = r[0], y1 = r[1], x2 = r[2], y2 = r[3];
  LB_COST(count);
  for (int64_t k = 1; k < count; ++k) {
    r += 4;
    x1 = min_of(x1, r[0]);
    y1 = min_of(y1, r[1]);
    x2 = max_of(x2, r[2]);
    y2 = max_of(y2, r[3]);
  }
  region[0] = x1;
  region[1] = y1;
  region[2] = x2;
  region[3] = y2;
  if (classes == nullptr) return;
  const int64_t* c = classes + first * class_stride;
  int64_t lo = c[0], hi = c[class_stride - 1];
  for (int64_t k = 1; k < count; ++k) {
    c += class_stride;
    lo = min_of(lo, c[0]);
    hi = max_of(hi, c[class_stride - 1]);
  }
  class_range[0] = lo;
  class_range[1] = hi;
}

LB_HOST_DEVICE bool class_in(const int64_t* class_range, int64_t cls) {
  return class_range == nullptr || (class_range[0] <= cls && cls <= class_range[1]);
}

// ---- one tile: the greedy pass over 64-row blocks, in rounds of a warp ------------------------------------------
LB_HOST_DEVICE int tile_words(int rows) { return (rows + kWordBits - 1) / kWordBits; }

LB_HOST_DEVICE int popcount(uint64_t x) {
#ifdef __CUDA_ARCH__
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// The lowest set bit of x != 0, removed from x; returns its index.
LB_HOST_DEVICE int pop_lowest(uint64_t& x) {
#ifdef __CUDA_ARCH__
  const int i = __ffsll(static_cast<long long>(x)) - 1;
#else
  const int i = __builtin_ctzll(x);
#endif
  x &= x - 1;
  return i;
}

// Warp-level code (the tile pass, step 2) is written once against a `Warp`: the kernels' runs on the 32 lanes
// of a real warp (cuda/nms_kernel.cu), the emulation's runs the lanes one after another
// (cpu/nms_tiled_schedule.cpp). Its operations take a function of the lane (or row) and are collective:
//   ballot32(pred): the mask of the lanes l in [0, 32) with pred(l);
//   ballot64(pred): the mask of the rows r in [0, 64) with pred(r) (lane l evaluates rows l and l + 32);
//   any_or(value): the OR of value(l) over the lanes;
//   leader_or(word, bits): one lane ORs bits into *word, atomically.
// Everything outside those functions is the same on every lane (warp-uniform), so the collectives are safe.

// The rows of a 64-row block still open when its turn comes: those not decided before (`suppressed`), of the
// first `rows` rows.
LB_HOST_DEVICE uint64_t open_rows(uint64_t suppressed, int rows) {
  const uint64_t present = rows >= kWordBits ? ~uint64_t{0} : (uint64_t{1} << rows) - 1;
  return present & ~suppressed;
}

// The greedy pass over one 64-row block, in rounds. `cols[r]` holds the earlier rows of the block that suppress
// row r; `open` the rows not yet decided. In a round, an open row none of whose suppressors is open or kept is
// kept, and an open row with a kept suppressor (kept before or in this round) is suppressed. The lowest open row
// is decided in every round, so the rounds end, and each row gets the sequential pass's answer: it is kept
// exactly when no kept earlier row suppresses it. A round is two ballots of the warp (`ballot64`); the rounds
// follow the longest chain of suppressions in the block, not the rows. Returns the kept rows.
template <typename Warp>
LB_HOST_DEVICE uint64_t resolve_block(const uint64_t* cols, uint64_t open, const Warp& warp) {
  uint64_t kept = 0;
  while (open != 0) {
    LB_COST(2);
    const uint64_t undecided = open, before = kept;
    const uint64_t keep_now = warp.ballot64(
        [&](int r) { return ((undecided >> r) & 1) != 0 && (cols[r] & (undecided | before)) == 0; });
    const uint64_t kept_now = before | keep_now;
    const uint64_t lose_now =
        warp.ballot64([&](int r) { return ((undecided >> r) & 1) != 0 && (cols[r] & kept_now) != 0; });
    kept = kept_now;
    open &= ~(keep_now | lose_now);
  }
  return kept;
}

// ---- one image's arrays, and the steps over them ----------------------------------------------------------------
// Per image: the number of kept boxes (all of them, also past the output's capacity), the kept rows of the
// current tile, and whether a score or a coordinate was NaN or infinite (the host raises, or the padded form
// reports -1). A padding box's values are not checked.
enum Counter : int { kKept = 0, kTileKept = 1, kBadScore = 2, kBadBox = 3, kCounters = 4 };

template <typename T>
LB_HOST_DEVICE bool is_finite(T x) {
  return sub_rn(x, x) == T(0);  // inf - inf and NaN - NaN are NaN
}

// One image's (or the whole unbatched input's) scratch, in the compute type T. The spatial arrays are null when
// the image fits in one tile.
template <typename T>
struct Image {
  int64_t n;
  const int64_t* order;     // [n]: rank (position in the score order) -> input index
  T* sorted_boxes;          // [n, 4], by rank
  int64_t* sorted_classes;  // [n], by rank; nullptr: one class
  uint8_t* padding;         // [n], by rank: a padding box (score -inf, padded form), never kept
  int64_t* codes;           // [n], by rank: Morton code; nullptr: one tile
  const int64_t* spatial_order;  // [n]: position in the spatial order -> rank
  int64_t* position;        // [n]: rank -> position in the spatial order
  T* boxes;                 // [n, 4], by position
  int64_t* classes;         // [n], by position; nullptr: one class
  T* block_region;          // [words, 4]
  int64_t* block_classes;   // [words, 2]
  int super_blocks;         // blocks per super-block (1 to 64)
  T* super_region;          // [supers, 4]
  int64_t* super_classes;   // [supers, 2]
  uint64_t* removed;        // [words], by position
  uint64_t* tile_masks;     // [tiles, tile words, tile rows]: the rows' masks within their tile (step 1a)
  int64_t* counters;        // [kCounters]
  int32_t* tile_kept;       // [tile rows]: the kept rows of the current tile
  int64_t* keep;            // [capacity]: input indices of the kept boxes, by decreasing score
  int64_t capacity;

  LB_HOST_DEVICE SpatialIndex<T> index() const {
    return {n, boxes, classes, block_region, block_classes, super_region, super_classes, removed};
  }
};

// The input of one image, in its own dtype and strides.
template <typename scalar_t>
struct ImageInput {
  const scalar_t* boxes;  // element (i, k) at boxes[i * box_stride + k * coord_stride]
  int64_t box_stride, coord_stride;
  const scalar_t* scores;  // element i at scores[i * score_stride]
  int64_t score_stride;
  const int64_t* classes;  // [n] contiguous int64, or nullptr
  bool padded;             // score -inf marks a padding box (the padded form)
};

// Rank r: its box and class in score order, its padding flag and Morton code, and the non-finite flag.
template <typename T, typename scalar_t>
LB_HOST_DEVICE void prepare_rank(const Image<T>& im, const ImageInput<scalar_t>& in, int64_t r) {
  const int64_t i = im.order[r];
  const T score = static_cast<T>(in.scores[i * in.score_stride]);
  T* b = im.sorted_boxes + 4 * r;
  bool finite = true;
  for (int k = 0; k < 4; ++k) {
    b[k] = static_cast<T>(in.boxes[i * in.box_stride + k * in.coord_stride]);
    finite = finite && is_finite(b[k]);
  }
  const bool pad = in.padded && !is_finite(score) && score < T(0);
  if (!pad && !is_finite(score)) im.counters[kBadScore] = 1;  // every writer writes 1: no race on the value
  if (!pad && !finite) im.counters[kBadBox] = 1;
  if (im.sorted_classes != nullptr) im.sorted_classes[r] = in.classes[i];
  if (im.padding != nullptr) im.padding[r] = pad ? 1 : 0;
  if (im.codes != nullptr) im.codes[r] = morton_code(b);
}

// Position p of the spatial order: its box and class, and the bit of a padding box (and of the bits past the
// last box) in `removed`, which starts all zero.
template <typename T>
LB_HOST_DEVICE void place_position(const Image<T>& im, int64_t p) {
  const int64_t r = im.spatial_order[p];
  im.position[r] = p;
  if (im.padding != nullptr && im.padding[r]) {
    // Never compared, and its values may be anything (NaN): an empty box, which no region bound takes in.
    const T inf = std::numeric_limits<T>::infinity();
    im.boxes[4 * p] = im.boxes[4 * p + 1] = inf;
    im.boxes[4 * p + 2] = im.boxes[4 * p + 3] = -inf;
    or_word(&im.removed[p >> 6], uint64_t{1} << (p & 63));
  } else {
    for (int k = 0; k < 4; ++k) im.boxes[4 * p + k] = im.sorted_boxes[4 * r + k];
  }
  if (im.classes != nullptr) im.classes[p] = im.sorted_classes[r];
  if (p == 0 && padding_bits(im.n) != 0) or_word(&im.removed[num_words(im.n) - 1], padding_bits(im.n));
}

template <typename T>
LB_HOST_DEVICE void bound_block(const Image<T>& im, int64_t blk) {
  const int64_t count = min_of(int64_t{kWordBits}, im.n - blk * kWordBits);
  bound_groups(im.boxes, im.classes, 1, blk * kWordBits, count, im.block_region + 4 * blk, im.block_classes + 2 * blk);
}

template <typename T>
LB_HOST_DEVICE void bound_super(const Image<T>& im, int64_t s) {
  const int64_t count = min_of(int64_t{im.super_blocks}, num_words(im.n) - s * im.super_blocks);
  const int64_t* classes = im.classes == nullptr ? nullptr : im.block_classes;
  bound_groups(im.block_region, classes, 2, s * im.super_blocks, count, im.super_region + 4 * s,
               im.super_classes + 2 * s);
}

// The tile masks, for every tile at once (step 1a; no tile depends on another here). Per tile, a word-major
// [words, tile_rows] array (index `mask_index`): word w of row r holds, for w past r's own 64-row block, the
// rows of block w that r suppresses (later rows, so only w >= r's block is ever non-zero), and for w = r's own
// block the transposed relation, the earlier rows of the block that suppress r (the tile kernel's `cols`). Rows
// decided before their tile get bits too: the pass never reads a decided row, and bits for a decided column
// change nothing. Thread i writes entry i (consecutive threads, consecutive rows: coalesced).
LB_HOST_DEVICE int64_t mask_index(int tile_rows, int64_t r, int w) {
  const int64_t row = r % tile_rows;
  return (r - row) * tile_words(tile_rows) + int64_t{w} * tile_rows + row;
}

template <typename T>
LB_HOST_DEVICE void mask_word(const Image<T>& im, int tile_rows, int64_t i, T thr, T off) {
  const int64_t per_tile = int64_t{tile_words(tile_rows)} * tile_rows;
  const int64_t first = i / per_tile * tile_rows;
  const int w = static_cast<int>(i % per_tile / tile_rows);
  const int64_t r = first + i % tile_rows;
  const int64_t own = (r - first) / kWordBits;
  uint64_t bits = 0;
  if (r < im.n && w >= own) {
    const bool by_class = im.sorted_classes != nullptr;
    const T* a = im.sorted_boxes + 4 * r;
    const T area_a = area_of(a, off);
    const int64_t begin = first + int64_t{kWordBits} * w, end = min_of(im.n, begin + kWordBits);
    for (int64_t c = begin; c < (w == own ? r : end); ++c) {  // own block: the earlier rows suppressing r
      LB_COST(1);
      if (by_class && im.sorted_classes[c] != im.sorted_classes[r]) continue;
      const T* b = im.sorted_boxes + 4 * c;
      const bool hit = w == own ? suppresses(b, area_of(b, off), a, area_a, thr, off)
                                : suppresses(a, area_a, b, area_of(b, off), thr, off);
      if (hit) bits |= uint64_t{1} << (c & 63);
    }
  }
  im.tile_masks[i] = bits;
}

// The tile kernel's shared state (cuda/nms_kernel.cu): the tile's rows are boxes first .. first + rows - 1 of
// the score order, each row r a thread r (of tile_rows). Thread t also holds, in `m`, word t / 64 of the rows
// t % 64, 64 + t % 64, ... (one per 64-row block), the suppression it ORs in when its block's rows are kept.
struct TileState {
  int tile_rows, rows;
  uint64_t* cols;        // [tile_rows]: the earlier rows of its 64-row block that suppress row r
  uint64_t* suppressed;  // [words]: rows decided (before the tile, or suppressed by a kept row of the tile)
  uint64_t* kept;        // [words]: the kept rows, block by block
  int64_t base;          // kept boxes before the tile
};

// Phase 1, thread t: its masks, its row's column and whether its row is decided. `suppressed` must be zero.
template <typename T>
LB_HOST_DEVICE void load_tile_thread(const Image<T>& im, const TileState& tile, int64_t first, int t, uint64_t* m) {
  const int words = tile_words(tile.tile_rows), lane = t % kWordBits, word = t / kWordBits;
  LB_COST(words);
  for (int w = 0; w < words; ++w) {
    const int row = w * kWordBits + lane;
    m[w] = row < tile.rows ? im.tile_masks[mask_index(tile.tile_rows, first + row, word)] : 0;
  }
  if (t >= tile.rows) return;
  const int64_t r = first + t;
  tile.cols[t] = im.tile_masks[mask_index(tile.tile_rows, r, word)];
  const bool decided = (im.padding != nullptr && im.padding[r]) ||
                       (im.removed != nullptr && test_bit(im.removed, im.position[r]));
  if (decided) or_word(&tile.suppressed[word], uint64_t{1} << lane);
}

// Phase 2 of block w, thread t, after the block's rows are resolved: the bits of the later word t / 64 that
// its row w * 64 + t % 64 suppresses, when that row is kept (the kernel ORs them over a warp, then into
// `suppressed`).
LB_HOST_DEVICE uint64_t kept_row_suppression(const TileState& tile, int w, int t, const uint64_t* m) {
  const int lane = t % kWordBits, word = t / kWordBits;
  return word > w && ((tile.kept[w] >> lane) & 1) != 0 ? m[w] : 0;
}

// Last phase, thread t: its row is decided (step 2 and later tiles skip it); a kept row goes to the output (up
// to its capacity; all are counted) and to the tile's kept rows for step 2, in score order.
template <typename T>
LB_HOST_DEVICE void finish_tile_row(const Image<T>& im, const TileState& tile, int64_t first, int t) {
  const int words = tile_words(tile.rows);
  if (t == 0) {
    int total = 0;
    LB_COST(words);
    for (int w = 0; w < words; ++w) total += popcount(tile.kept[w]);
    im.counters[kKept] = tile.base + total;
    im.counters[kTileKept] = total;
  }
  if (t >= tile.rows) return;
  const int64_t r = first + t;
  if (im.removed != nullptr) {
    const int64_t p = im.position[r];
    or_word(&im.removed[p >> 6], uint64_t{1} << (p & 63));
  }
  const int word = t / kWordBits, lane = t % kWordBits;
  if (((tile.kept[word] >> lane) & 1) == 0) return;
  int k = popcount(tile.kept[word] & ((uint64_t{1} << lane) - 1));
  LB_COST(word);
  for (int w = 0; w < word; ++w) k += popcount(tile.kept[w]);
  im.tile_kept[k] = t;
  if (tile.base + k < im.capacity) im.keep[tile.base + k] = im.order[r];
}

// Step 2 for the tile starting at rank `first`, warp `w` of `warps`: the pairs (kept row of the tile,
// super-block), 32 at a time, one per lane, tested against the super-block's region and classes; for each pair
// that may overlap, the warp tests the super-block's blocks (a ballot) and, for each open block that may
// overlap, the block's 64 boxes (2 per lane), marking in `removed` the undecided boxes the kept row suppresses.
// Only kept rows suppress, and the spatial index prunes the pairs before any IoU is computed.
template <typename T, typename Warp>
LB_HOST_DEVICE void propagate_kept(const Image<T>& im, int64_t first, int64_t w, int64_t warps, const Warp& warp,
                                   T thr, T off) {
  const SpatialIndex<T> index = im.index();
  const int64_t kept = im.counters[kTileKept];
  const int64_t blocks = num_words(im.n), supers = num_supers(im.n, im.super_blocks), pairs = kept * supers;
  const bool by_class = index.classes != nullptr;
  // Pair p is (kept row p % kept, super-block p / kept): the 32 pairs of a warp are mostly 32 kept rows, which
  // lie apart in space, so the pairs that overlap spread over the warps.
  const auto kept_row = [&](int64_t pair) { return first + im.tile_kept[pair % kept]; };
  const auto class_of = [&](int64_t r) { return by_class ? im.sorted_classes[r] : int64_t{0}; };
  for (int64_t begin = w * 32; begin < pairs; begin += warps * 32) {
    LB_COST(1);
    uint64_t hits = warp.ballot32([&](int lane) {
      const int64_t pair = begin + lane;
      if (pair >= pairs) return false;
      const int64_t r = kept_row(pair), s = pair / kept;
      return may_overlap(im.sorted_boxes + 4 * r, index.super_region + 4 * s, off) &&
             (!by_class || class_in(index.super_classes + 2 * s, class_of(r)));
    });
    while (hits != 0) {
      LB_COST(1);
      const int64_t pair = begin + pop_lowest(hits);
      const int64_t r = kept_row(pair), s = pair / kept, cls = class_of(r);
      const T* a = im.sorted_boxes + 4 * r;
      const T area_a = area_of(a, off);
      uint64_t open = warp.ballot64([&](int k) {
        const int64_t blk = s * im.super_blocks + k;
        return k < im.super_blocks && blk < blocks && index.removed[blk] != ~uint64_t{0} &&
               may_overlap(a, index.block_region + 4 * blk, off) &&
               (!by_class || class_in(index.block_classes + 2 * blk, cls));
      });
      while (open != 0) {
        LB_COST(3 + kWarpReduceSteps);  // a ballot, 2 boxes per lane, the OR over the warp
        const int64_t blk = s * im.super_blocks + pop_lowest(open);
        const uint64_t bits = warp.any_or([&](int lane) {
          const uint64_t decided = index.removed[blk];  // a stale read only costs work
          uint64_t mine = 0;
          for (int k = lane; k < kWordBits; k += 32) {
            const int64_t j = blk * kWordBits + k;
            if (((decided >> k) & 1) != 0 || (by_class && index.classes[j] != cls)) continue;
            const T* b = index.boxes + 4 * j;
            if (suppresses(a, area_a, b, area_of(b, off), thr, off)) mine |= uint64_t{1} << k;
          }
          return mine;
        });
        if (bits != 0) warp.leader_or(&index.removed[blk], bits);
      }
    }
  }
}

}  // namespace lightning_balanced::nms_tiled
