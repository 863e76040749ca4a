// The private ops `_nms_tiled_schedule` (a batch, as batched_nms_padded) and `_nms_tiled` (as nms and
// batched_nms): the CUDA kernels' tiled NMS (ops/nms_tiled.h) run on the host by the same step sequence
// (ops/nms_tiled_driver.h), each kernel's threads one after another, a warp's lanes in a loop (HostWarp), and the
// tile kernel's phases separated as its __syncthreads() separate them. The tests compare them with the reference
// at small tile sizes (many tiles, many blocks), so the algorithm the GPU runs is checked on machines without
// one; both also return the cost model of the GPU's schedule (a row per launch: kind, width, serial depth).

#include <ATen/core/Tensor.h>
#include <ATen/ops/tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "ops/nms_checks.h"
#include "ops/nms_tiled_driver.h"

namespace {

using namespace lightning_balanced::nms_tiled;

// The cost model of one call: a row per launch the GPU would make, (kind, parallel width, serial depth), and a row
// per host-side torch op (an allocation, a sort, a gather, the read of the counters; width: its elements, depth 0).
enum StepKind : int64_t { kStepKernel = 0, kTileKernel = 1, kTorchOp = 2, kSmallKernel = 3, kChainKernel = 4 };
thread_local std::vector<int64_t>* recorded_steps = nullptr;
// Whether HostLaunch::chain runs the persistent chain (the op's `persistent` argument), or declines as the CUDA
// launcher does without cooperative launch or under graph capture, so the per-tile launches run.
thread_local bool persistent_chain = true;

// The persistent chain's modelled grid: the threads an H100 holds at once of chain_kernel (132 SMs x one CTA of 1024
// threads: its 64 registers per thread fill an SM's 65,536; ptxas -v, sm_90), in CTAs of tile_rows threads, and
// the cost of one grid barrier in serial steps (an atomic round trip to L2 and the spin on it, about a
// microsecond: some tens of IoU tests; a guess until measured on a GPU).
constexpr int64_t kModelResidentThreads = int64_t{132} * 1024;
constexpr int64_t kGridBarrierSteps = 32;

// The order in which a phase's threads run here (the op's `thread_order`): 0 by index, 1 reversed, k > 1 the
// bijection i -> (p * i + k) mod count, p a prime that does not divide count. The GPU runs them at once, so a
// result that depends on this order is a race within a phase: a thread reading what another writes before the
// barrier that separates them. Sequential threads cannot show a torn read-modify-write; the order shows the rest.
thread_local int64_t thread_order = 0;

template <typename F>
void in_thread_order(int64_t count, const F& thread) {
  if (thread_order == 0) {
    for (int64_t i = 0; i < count; ++i) thread(i);
  } else if (thread_order == 1) {
    for (int64_t i = count - 1; i >= 0; --i) thread(i);
  } else {
    constexpr int64_t primes[] = {7919, 104729, 1299709, 15485863};
    int64_t p = primes[thread_order % 4];
    for (int k = 0; k < 4 && count % p == 0; ++k) p = primes[(thread_order + k + 1) % 4];
    for (int64_t i = 0; i < count; ++i) thread((p * i + thread_order) % count);
  }
}

// The threads 0 .. count - 1 one after another (in_thread_order); returns the most serial steps one ran.
template <typename F>
int64_t deepest(int64_t count, const F& thread) {
  int64_t depth = 0;
  in_thread_order(count, [&](int64_t i) {
    serial_steps() = 0;
    thread(i);
    depth = std::max(depth, serial_steps());
  });
  return depth;
}

// One phase of a CTA (between two __syncthreads): its deepest thread, plus one step for the barrier.
template <typename F>
int64_t phase(int threads, const F& thread) {
  return deepest(threads, [&](int64_t t) { thread(static_cast<int>(t)); }) + 1;
}

void record(StepKind kind, int64_t width, int64_t depth) {
  if (recorded_steps != nullptr) recorded_steps->insert(recorded_steps->end(), {kind, width, depth});
}

// The `Warp` of nms_tiled.h, its 32 lanes (and 64 rows) one after another, in in_thread_order.
struct HostWarp {
  template <typename Pred>
  uint64_t ballot32(const Pred& pred) const {
    uint64_t bits = 0;
    in_thread_order(32, [&](int64_t lane) { bits |= uint64_t{pred(static_cast<int>(lane))} << lane; });
    return bits;
  }
  template <typename Pred>
  uint64_t ballot64(const Pred& pred) const {
    uint64_t bits = 0;
    in_thread_order(kWordBits, [&](int64_t r) { bits |= uint64_t{pred(static_cast<int>(r))} << r; });
    return bits;
  }
  template <typename Value>
  uint64_t any_or(const Value& value) const {
    uint64_t bits = 0;
    in_thread_order(32, [&](int64_t lane) { bits |= value(static_cast<int>(lane)); });
    return bits;
  }
  void leader_or(uint64_t* word, uint64_t bits) const { *word |= bits; }
};

// The `Cta` of nms_small.h: a phase runs its threads one after another and adds its deepest thread's serial steps,
// plus one for the barrier, to `depth`.
struct HostCta {
  static constexpr int kThreads = kSmallThreads;
  int64_t* depth;
  template <typename F>
  void each(const F& f) const {
    *depth += phase(kThreads, f);
  }
  template <typename F>
  void warp0(uint64_t* out, const F& f) const {
    serial_steps() = 0;
    *out = f(HostWarp{});
    *depth += serial_steps() + 1;
  }
};

struct HostLaunch {
  // The emulation models an H100's opt-in shared memory per block.
  static int64_t small_shared_limit() { return kSmallSharedLimitSm90; }

  // small_kernel of cuda/nms_kernel.cu: one CTA per image, its shared memory a host buffer.
  template <typename T, typename scalar_t>
  static void small(const SmallArgs<T, scalar_t>& args, int64_t batch, int64_t shared_bytes) {
    if (batch == 0) return;
    std::vector<uint64_t> shared(static_cast<size_t>(shared_bytes + 7) / 8);
    int64_t depth = 0;
    for (int64_t b = 0; b < batch; ++b) {
      int64_t image_depth = 0;
      small_nms(args, b, reinterpret_cast<unsigned char*>(shared.data()), HostCta{&image_depth});
      depth = std::max(depth, image_depth);
    }
    record(kSmallKernel, batch * kSmallThreads, depth);
  }

  template <typename F>
  static void each(int64_t batch, int64_t count, const F& step) {
    if (count == 0 || batch == 0) return;
    int64_t depth = 0;
    for (int64_t b = 0; b < batch; ++b) depth = std::max(depth, deepest(count, [&](int64_t i) { step(b, i); }));
    record(kStepKernel, batch * count, depth);
  }

  // A warp-level step: each warp one after another, its lanes together (HostWarp); the depth is the warp's.
  template <typename F>
  static void warps(int64_t batch, int64_t warps, const F& step) {
    if (warps == 0 || batch == 0) return;
    int64_t depth = 0;
    for (int64_t b = 0; b < batch; ++b) {
      depth = std::max(depth, deepest(warps, [&](int64_t w) { step(b, w, HostWarp{}); }));
    }
    record(kStepKernel, batch * warps * 32, depth);
  }

  // A torch op (a sort, a gather): its launches and depth are torch's, not modelled.
  static void library(int64_t elements) { record(kTorchOp, elements, 0); }

  // tile_kernel of cuda/nms_kernel.cu with `tile_rows` threads, phase by phase (the phases its __syncthreads()
  // separate); warp 0's ballots over the rows of a block, one row after another.
  template <typename T>
  static void tile(const Image<T>& batch_image, int64_t batch, int tile_rows, int64_t first, int rows) {
    int64_t depth = 0;
    for (int64_t b = 0; b < batch; ++b) {
      depth = std::max(depth, resolve_tile(image_at(batch_image, b, tile_rows), tile_rows, first, rows));
    }
    record(kTileKernel, batch * tile_rows, depth);
  }

  // resolve_tile of cuda/nms_kernel.cu for one image (its CTA's shared memory a host buffer); returns its depth.
  template <typename T>
  static int64_t resolve_tile(const Image<T>& im, int tile_rows, int64_t first, int rows) {
    const int words = tile_words(tile_rows), used = tile_words(rows);
    std::vector<uint64_t> cols(tile_rows), suppressed(words), kept(words), m(static_cast<size_t>(tile_rows) * words);
    const TileState tile{tile_rows, rows, cols.data(), suppressed.data(), kept.data(), im.counters[kKept]};
    int64_t depth = phase(tile_rows, [&](int t) { load_tile_thread(im, tile, first, t, &m[t * words]); });
    for (int w = 0; w < used; ++w) {
      depth += phase(1, [&](int) {
        kept[w] = resolve_block(&cols[w * kWordBits], open_rows(suppressed[w], rows - w * kWordBits), HostWarp{});
      });
      depth += phase(tile_rows, [&](int t) {
        LB_COST(kWarpReduceSteps);  // the kernel's OR over the warp
        suppressed[t / kWordBits] |= kept_row_suppression(tile, w, t, &m[t * words]);
      });
    }
    return depth + phase(tile_rows, [&](int t) { finish_tile_row(im, tile, first, t); });
  }

  // The persistent chain (chain_kernel of cuda/nms_kernel.cu), unless the op's `persistent` is false (then it
  // declines, as the CUDA launcher does without cooperative launch or under graph capture). The same phases
  // (run_chain), a grid barrier emulated by running every thread of a phase before the next phase starts. One
  // launch in the cost model: its width the modelled resident grid, its depth the sum over the phases of each
  // phase's deepest physical thread (a thread of the grid-stride loops runs indices i, i + grid threads, ...; a CTA
  // resolves images b, b + CTAs, ...) plus kGridBarrierSteps per barrier.
  template <typename T>
  static bool chain(const ChainArgs<T>& args) {
    if (!persistent_chain) return false;
    const int64_t ctas = chain_ctas(args, kModelResidentThreads / args.tile_rows);
    HostGrid<T> grid{args, ctas, ctas * args.tile_rows};
    run_chain(args, grid);
    record(kChainKernel, ctas * args.tile_rows, grid.depth + grid.phase);
    return true;
  }

  // The `Grid` of run_chain, run on the host one index after another.
  template <typename T>
  struct HostGrid {
    const ChainArgs<T>& args;
    int64_t ctas, threads;
    mutable int64_t depth = 0;  // the phases before the current one, barriers included
    mutable int64_t phase = 0;  // the current phase (an upper bound: its parts' deepest threads added)

    // Adds the deepest of `units` physical units, unit u running the items u, u + units, ... (their steps summed).
    template <typename F>
    void spread(int64_t items, int64_t units, const F& item) const {
      std::vector<int64_t> load(static_cast<size_t>(std::max<int64_t>(0, std::min(items, units))), 0);
      in_thread_order(items, [&](int64_t i) {
        serial_steps() = 0;
        item(i);
        load[i % units] += serial_steps();
      });
      phase += load.empty() ? 0 : *std::max_element(load.begin(), load.end());
    }
    template <typename F>
    void each(int64_t images, int64_t count, const F& step) const {
      spread(images * count, threads, [&](int64_t i) { step(i / count, i % count); });
    }
    template <typename F>
    void warps(int64_t images, int64_t warps, const F& step) const {
      spread(images * warps, threads / 32, [&](int64_t i) { step(i / warps, i % warps, HostWarp{}); });
    }
    void tile(int64_t first, int rows) const {
      spread(args.images, ctas, [&](int64_t b) {
        const int64_t d = resolve_tile(image_at(args.batch, b, args.tile_rows), args.tile_rows, first, rows);
        serial_steps() = d + 1;  // and the CTA barrier before the next image
      });
    }
    void sync() const {
      depth += phase + kGridBarrierSteps;
      phase = 0;
    }
  };
};

void check_schedule_sizes(const char* op, int64_t tile_rows, int64_t propagate_warps, int64_t small_rows,
                          int64_t order) {
  TORCH_CHECK_VALUE(order >= 0, op, ": thread_order must be >= 0, got ", order);
  TORCH_CHECK_VALUE(small_rows >= 0 && small_rows <= kSmallMaxRows, op, ": small_rows must be in [0, ",
                    kSmallMaxRows, "], got ", small_rows);
  TORCH_CHECK_VALUE(tile_rows > 0 && tile_rows % kWordBits == 0 && tile_rows <= 4096, op,
                    ": tile_rows must be a multiple of 64 in [64, 4096], got ", tile_rows);
  TORCH_CHECK_VALUE(propagate_warps > 0, op, ": propagate_warps must be positive, got ", propagate_warps);
}

// Records the cost model while it lives (one call of an op); `steps()`: [launches, 3] (kind, width, depth).
class Recording {
 public:
  Recording(bool persistent, int64_t order) {
    recorded_steps = &steps_;
    persistent_chain = persistent;
    thread_order = order;
  }
  ~Recording() {
    recorded_steps = nullptr;
    persistent_chain = true;
    thread_order = 0;
  }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
  at::Tensor steps() const {
    return at::tensor(steps_, at::kLong).reshape({static_cast<int64_t>(steps_.size()) / 3, 3});
  }

 private:
  std::vector<int64_t> steps_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> nms_tiled_schedule_cpu(
    const at::Tensor& boxes, const at::Tensor& scores, const std::optional<at::Tensor>& idxs, double iou_threshold,
    int64_t offset, bool padded, int64_t capacity, int64_t tile_rows, int64_t propagate_warps, int64_t small_rows,
    bool persistent, int64_t order) {
  constexpr const char* op = "_nms_tiled_schedule";
  lightning_balanced::check_padded_args(op, boxes, scores, idxs, iou_threshold, capacity, offset);
  TORCH_CHECK_VALUE(boxes.device().is_cpu(), op, ": the CPU kernel got tensors on ", boxes.device());
  check_schedule_sizes(op, tile_rows, propagate_warps, small_rows, order);
  const TiledInput input{boxes,
                         scores,
                         idxs.has_value() ? lightning_balanced::idxs_as_int64(*idxs).contiguous() : at::Tensor(),
                         iou_threshold,
                         offset,
                         padded,
                         capacity};
  const Recording recording(persistent, order);
  if (takes_small_path<HostLaunch>(input, small_rows)) {
    // As padded_nms (nms_tiled_driver.h): the outputs keep and, padded, num_kept (host ops); the raw counters too,
    // for the tests, not counted. num_kept is checked against the counters here.
    const int64_t batch = boxes.size(0);
    const auto longs = boxes.options().dtype(at::kLong);
    HostLaunch::library(batch * capacity);
    at::Tensor keep = at::empty({batch, capacity}, longs);
    HostLaunch::library(batch);
    at::Tensor num_kept = at::empty({batch}, longs);
    at::Tensor counters = at::empty({batch, kCounters}, longs);
    run_small<HostLaunch>(input, keep, capacity, counters.mutable_data_ptr<int64_t>(),
                          padded ? num_kept.mutable_data_ptr<int64_t>() : nullptr);
    for (int64_t b = 0; b < batch && padded; ++b) {
      const int64_t* c = counters.const_data_ptr<int64_t>() + b * kCounters;
      const int64_t expected = c[kBadScore] + c[kBadBox] > 0 ? -1 : std::min(c[kKept], capacity);
      TORCH_INTERNAL_ASSERT(num_kept.const_data_ptr<int64_t>()[b] == expected, op, ": image ", b, " num_kept ",
                            num_kept.const_data_ptr<int64_t>()[b], ", expected ", expected);
    }
    return {keep, counters, recording.steps()};
  }
  const auto [keep, counters] = run_tiled<HostLaunch>(op, input, static_cast<int>(tile_rows), propagate_warps);
  return {keep, counters, recording.steps()};
}

// `_nms_tiled`: what the CUDA nms (idxs None) and batched_nms run, classes as independent chains included.
std::tuple<at::Tensor, at::Tensor> nms_tiled_cpu(const at::Tensor& boxes, const at::Tensor& scores,
                                                 const std::optional<at::Tensor>& idxs, double iou_threshold,
                                                 int64_t offset, int64_t tile_rows, int64_t propagate_warps,
                                                 int64_t small_rows, bool persistent, int64_t order) {
  constexpr const char* op = "_nms_tiled";
  lightning_balanced::check_nms_args(op, boxes, scores, iou_threshold, offset);
  TORCH_CHECK_VALUE(boxes.device().is_cpu(), op, ": the CPU kernel got tensors on ", boxes.device());
  check_schedule_sizes(op, tile_rows, propagate_warps, small_rows, order);
  at::Tensor classes;
  if (idxs.has_value()) {
    lightning_balanced::check_idxs_arg(boxes, *idxs);
    classes = lightning_balanced::idxs_as_int64(*idxs);
  }
  const Recording recording(persistent, order);
  const at::Tensor keep = tiled_nms<HostLaunch>(op, boxes, scores, classes, iou_threshold, offset,
                                                static_cast<int>(tile_rows), propagate_warps, small_rows);
  return {keep, recording.steps()};
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CPU, m) {
  m.impl("_nms_tiled_schedule", &nms_tiled_schedule_cpu);
  m.impl("_nms_tiled", &nms_tiled_cpu);
}
