// CUDA kernels of lightning_balanced::nms, batched_nms and batched_nms_padded.
//
// The algorithm is the tiled NMS of ops/nms_tiled.h (tiles of 1024 boxes in score order resolved by one CTA in
// rounds of warp ballots, the kept boxes of a tile suppressing later boxes through a spatial index of 64-box
// blocks, in warp-level work), run by the step sequence of ops/nms_tiled_driver.h; this file launches the steps
// and gives the warp-level code its real warp (DeviceWarp). The same steps run on the CPU in the
// private op `_nms_tiled_schedule` (cpu/nms_tiled_schedule.cpp), which the tests compare with the reference.
//
// Up to 4096 boxes per image (when the device's opt-in shared memory holds them), one launch instead: small_kernel,
// one CTA of 1024 threads per image sorting, resolving and compacting in shared memory (ops/nms_small.h); nms and
// batched_nms then issue one allocation, that launch and the read of the kept count, batched_nms_padded two
// allocations and the launch. Run on an H200 (2026-11-28): exact; 1k boxes in 0.14-0.31 ms, before step 4's grid
// of cells and its deferred rows (nms_small.h), which have not run on a GPU yet.
//
// Above one tile (1024 boxes per image or class row), the per-tile launches: a tile launch, then its propagation
// launch, per 1024 boxes. Opt-in (LIGHTNING_BALANCED_NMS_CHAIN=1, chain_opted_in below: measured slower on an H200),
// the persistent chain (issue 40): after the prepare and place
// launches, ONE cooperative launch of chain_kernel runs the bounds, the masks and every tile's resolve and
// propagation, its phases separated by grid barriers (run_chain of ops/nms_tiled_driver.h): 3 launches per call
// at any N, against 2 per tile. CudaLaunch::chain falls back to the per-tile launches (step_kernel,
// tile_kernel, warp_kernel, unchanged) when the device has no cooperative launch, when the current stream is being
// captured into a CUDA graph (batched_nms_padded in a graph keeps its plain launches: whether a cooperative launch
// may be captured, and replayed with its co-residency guarantee, is not something we could check without a GPU),
// or when the cooperative launch reports the grid too large. Run on an H200 (2026-11-28): exact, no deadlock, slower.
// The risks it was checked for:
//   - co-residency: a grid barrier with a CTA not resident deadlocks. The grid is min(CTAs with work, occupancy
//     calculator's CTAs per SM x SMs), launched only by cudaLaunchCooperativeKernel, which refuses a grid that
//     cannot be co-resident instead of running it; ptxas gives chain_kernel 64 registers per thread (sm_90), so one
//     CTA of 1024 threads per SM;
//   - memory order across CTAs: plain stores of one phase (tile_kept, counters, the tile masks, the bounds) are read
//     by other CTAs after the barrier; cooperative_groups' grid sync fences (__threadfence) before arriving and after
//     leaving, as the memory model requires for plain loads after it to see them (no L1-stale reads). `removed`'s
//     ORs are atomic; its plain reads in the propagation may be stale, which costs work only, as before;
//   - every grid barrier is reached by every thread: the loops around them depend on the kernel's arguments only;
//     the __syncthreads of the tile resolve sit in a CTA-uniform loop over the CTA's images; the grid-stride loops
//     of the other phases hold no barrier, and the propagation's loop is warp-uniform for its ballots;
//   - spills: 400 bytes per thread (sm_90, float32), in L1-cached local memory; a cost, not a fault;
//   - stream and memory: the current torch stream, scratch from torch's caching allocator as before, no new host
//     sync (the one read of the kept count stays after the launches).
//
// Same semantics and arithmetic as the CPU kernel (cpu/nms_kernel.cpp); every operation uses the
// round-to-nearest intrinsics, so the result matches the float32/float64 reference bit for bit. The keep
// pass runs on the device: nms reads back one small array of counters (its only sync), batched_nms also the
// class sizes (tiled_nms in ops/nms_tiled_driver.h), batched_nms_padded nothing at all, so it can be captured in a
// CUDA graph.
// Includes c10/cuda headers only (not ATen/cuda/CUDAContext.h), so it also compiles against CPU wheels.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "ops/nms_checks.h"
#include "ops/nms_tiled_driver.h"

namespace {

using namespace lightning_balanced::nms_tiled;

// Rows per tile, one thread each; step 2 runs over at most kPropagateWarps warps per image.
constexpr int kTileRows = 1024;
constexpr int kStepThreads = 256;  // a multiple of 32: whole warps
constexpr int64_t kPropagateWarps = 8192;  // 262144 threads: about one wave of an H100

template <typename F>
__global__ void step_kernel(F step, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) step(blockIdx.y, i);
}

__device__ uint64_t warp_or(uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The `Warp` of nms_tiled.h on a real warp: every lane of it calls each operation (warp-uniform control flow).
struct DeviceWarp {
  int lane;
  template <typename Pred>
  __device__ uint64_t ballot32(const Pred& pred) const {
    return __ballot_sync(0xffffffffu, pred(lane));
  }
  template <typename Pred>
  __device__ uint64_t ballot64(const Pred& pred) const {
    const uint64_t low = __ballot_sync(0xffffffffu, pred(lane));
    const uint64_t high = __ballot_sync(0xffffffffu, pred(lane + 32));
    return low | (high << 32);
  }
  template <typename Value>
  __device__ uint64_t any_or(const Value& value) const {
    return warp_or(value(lane));
  }
  __device__ void leader_or(uint64_t* word, uint64_t bits) const {
    if (lane == 0) or_word(word, bits);
  }
};

// A warp-level step: warp w of `warps` (per image) runs step(image, w, warp).
template <typename F>
__global__ void warp_kernel(F step, int64_t warps) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i / 32 < warps) step(blockIdx.y, i / 32, DeviceWarp{static_cast<int>(i % 32)});  // whole warps only
}

// The `Cta` of nms_small.h on the real CTA: this thread's index; each phase ends in a barrier that every thread
// reaches (the phases are called CTA-uniformly).
struct DeviceCta {
  static constexpr int kThreads = kSmallThreads;
  int t;
  template <typename F>
  __device__ void each(const F& f) const {
    f(t);
    __syncthreads();
  }
  template <typename F>
  __device__ void warp0(uint64_t* out, const F& f) const {
    if (t < 32) {
      const uint64_t value = f(DeviceWarp{t});
      if (t == 0) *out = value;
    }
    __syncthreads();
  }
};

// The single-launch NMS (nms_small.h): one CTA of kSmallThreads per image (blockIdx.y), everything in dynamic
// shared memory. At least 1 CTA per SM, which allows 64 registers a thread: with the maximum block size alone,
// ptxas 13 gave the float instantiations 32 registers and spills on sm_90 (54 and none with it).
template <typename T, typename scalar_t>
__global__ void __launch_bounds__(kSmallThreads, 1) small_kernel(SmallArgs<T, scalar_t> args) {
  extern __shared__ __align__(16) unsigned char small_smem[];
  small_nms(args, blockIdx.y, small_smem, DeviceCta{static_cast<int>(threadIdx.x)});
}

// The tile resolve's shared memory (one CTA of kRows threads).
template <int kRows>
struct TileShared {
  static constexpr int kWords = kRows / kWordBits;
  uint64_t cols[kRows];
  uint64_t suppressed[kWords];
  uint64_t kept[kWords];
  int64_t base;
};

// Step 1 of one tile of image `im`, by the whole CTA of kRows threads (called CTA-uniformly): load, then for each
// 64-row block in order, warp 0 resolves the block in rounds and every thread ORs its kept row's suppression of
// later blocks into `suppressed` (a warp-wide OR, then one shared atomic per warp); then each row is marked decided
// and the kept rows are written out. Two barriers per block; no thread runs a loop over the rows. Ends without a
// barrier: a caller that reuses `s` for another image syncs first.
template <typename T, int kRows>
__device__ __forceinline__ void resolve_tile(const Image<T>& im, int64_t first, int rows, TileShared<kRows>& s) {
  constexpr int kWords = TileShared<kRows>::kWords;
  const int t = threadIdx.x;
  if (t < kWords) s.suppressed[t] = 0;
  if (t == 0) s.base = im.counters[kKept];
  __syncthreads();
  const TileState tile{kRows, rows, s.cols, s.suppressed, s.kept, s.base};
  uint64_t m[kWords];
  load_tile_thread(im, tile, first, t, m);
  __syncthreads();
  const int used = tile_words(rows);
#pragma unroll
  for (int w = 0; w < kWords; ++w) {  // unrolled, so m[w] stays in registers
    if (w < used) {  // the same for every thread
      if (t < 32) {
        const uint64_t k = resolve_block(s.cols + w * kWordBits, open_rows(s.suppressed[w], rows - w * kWordBits),
                                         DeviceWarp{t});
        if (t == 0) s.kept[w] = k;
      }
      __syncthreads();
      const uint64_t bits = warp_or(kept_row_suppression(tile, w, t, m));
      if (t % 32 == 0 && bits != 0) or_word(&s.suppressed[t / kWordBits], bits);
      __syncthreads();
    }
  }
  finish_tile_row(im, tile, first, t);
}

template <typename T, int kRows>
__global__ void __launch_bounds__(kRows) tile_kernel(Image<T> batch, int64_t first, int rows) {
  __shared__ TileShared<kRows> shared;
  resolve_tile<T, kRows>(image_at(batch, blockIdx.y, kRows), first, rows, shared);
}

// The `Grid` of run_chain (nms_tiled_driver.h) on the persistent kernel's grid of CTAs of kRows threads. Its loops
// depend on the kernel's arguments and the thread's (or warp's, or CTA's) index only: grid-stride loops whose
// trip counts differ between threads but never contain a barrier, and a CTA-uniform loop around resolve_tile.
template <typename T, int kRows>
struct DeviceGrid {
  const ChainArgs<T>& args;
  TileShared<kRows>& shared;

  // cooperative_groups' grid barrier: a CTA barrier, then one thread per CTA fences (__threadfence), arrives on a
  // counter in global memory and spins on it, fences again, then a CTA barrier. Valid in a cooperative launch only
  // (CudaLaunch::chain launches no other way). It orders memory as the end of a kernel launch would: the writes
  // before it (plain stores included) are visible to every thread after it.
  __device__ void sync() const { cooperative_groups::this_grid().sync(); }

  template <typename F>
  __device__ void each(int64_t images, int64_t count, const F& step) const {
    const int64_t total = images * count, stride = int64_t{gridDim.x} * kRows;
    for (int64_t i = int64_t{blockIdx.x} * kRows + threadIdx.x; i < total; i += stride) step(i / count, i % count);
  }

  template <typename F>
  __device__ void warps(int64_t images, int64_t warps, const F& step) const {
    // The loop is warp-uniform (its index is the warp's), so the warp's collectives see all 32 lanes.
    const int64_t total = images * warps, stride = int64_t{gridDim.x} * (kRows / 32);
    const DeviceWarp warp{static_cast<int>(threadIdx.x % 32)};
    for (int64_t i = (int64_t{blockIdx.x} * kRows + threadIdx.x) / 32; i < total; i += stride) {
      step(i / warps, i % warps, warp);
    }
  }

  __device__ void tile(int64_t first, int rows) const {
    for (int64_t b = blockIdx.x; b < args.images; b += gridDim.x) {  // CTA-uniform
      resolve_tile<T, kRows>(image_at(args.batch, b, kRows), first, rows, shared);
      __syncthreads();  // `shared` is reused by the next image
    }
  }
};

// The persistent chain (run_chain of nms_tiled_driver.h): every CTA stays for all phases. Launched cooperatively
// only, with at most the CTAs the device holds at once.
template <typename T, int kRows>
__global__ void __launch_bounds__(kRows) chain_kernel(ChainArgs<T> args) {
  __shared__ TileShared<kRows> shared;
  run_chain(args, DeviceGrid<T, kRows>{args, shared});
}

// The persistent chain is opt-in: LIGHTNING_BALANCED_NMS_CHAIN=1 in the environment, read at each call (a getenv,
// no stream operation). On one H200 in one run (torch 2.11, 2026-11-28, bench_nms_cuda.py's `chain_ab` lines) it
// was exact but slower than the per-tile launches: 1.32x their time at 20k boxes, 1.30x at 100k, 1.50x at 1M. Its
// one resident grid of 1024-thread CTAs (64 registers each, one CTA per SM) runs the propagation on half the warps
// the separate launches get, and at 64 registers it spills (ptxas -v, CUDA 13, sm_90: a 248-byte stack frame, 400
// bytes of spill stores and 804 of loads for float). So the per-tile launches are the default.
bool chain_opted_in() {
  const char* value = std::getenv("LIGHTNING_BALANCED_NMS_CHAIN");
  return value != nullptr && value[0] == '1' && value[1] == '\0';
}

// The single-launch path's limit in boxes per image: LIGHTNING_BALANCED_NMS_SMALL_ROWS in the environment, an
// integer in [0, 4096] (0: always the tiles), read at each call like the chain's switch; 4096 when unset or empty.
// For timing the two paths against each other on one GPU (bench_nms_cuda.py's `small_ab` lines: the single
// launch has not been timed between 2k and 4k boxes).
int64_t small_rows_from_env() {
  const char* value = std::getenv("LIGHTNING_BALANCED_NMS_SMALL_ROWS");
  if (value == nullptr || value[0] == '\0') return kSmallMaxRows;
  char* end = nullptr;
  errno = 0;
  const long long rows = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && errno == 0 && rows >= 0 && rows <= kSmallMaxRows,
                    "LIGHTNING_BALANCED_NMS_SMALL_ROWS must be an integer in [0, ", kSmallMaxRows, "], got '", value,
                    "'");
  return rows;
}

struct CudaLaunch {
  static void library(int64_t) {}  // a torch op: only the emulation counts it

  // The current device's opt-in limit of dynamic shared memory per block (227 KiB on sm_90, 163 KiB on sm_80,
  // 99 KiB on sm_86/89): a host query of a device attribute, no stream operation.
  static int64_t small_shared_limit() {
    int device = 0, limit = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return limit;
  }

  template <typename T, typename scalar_t>
  static void small(const SmallArgs<T, scalar_t>& args, int64_t batch, int64_t shared_bytes) {
    if (batch == 0) return;
    const auto kernel = small_kernel<T, scalar_t>;
    if (shared_bytes > 48 * 1024) {  // over the default limit: opt in (a function attribute, not a stream operation)
      C10_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
    }
    const dim3 grid(1, static_cast<unsigned>(batch));
    kernel<<<grid, kSmallThreads, static_cast<size_t>(shared_bytes), c10::cuda::getCurrentCUDAStream()>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename F>
  static void each(int64_t batch, int64_t count, const F& step) {
    if (count == 0 || batch == 0) return;
    const dim3 grid(static_cast<unsigned>((count + kStepThreads - 1) / kStepThreads), static_cast<unsigned>(batch));
    step_kernel<<<grid, kStepThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(step, count);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename F>
  static void warps(int64_t batch, int64_t warps, const F& step) {
    if (warps == 0 || batch == 0) return;
    const int64_t threads = warps * 32;
    const dim3 grid(static_cast<unsigned>((threads + kStepThreads - 1) / kStepThreads), static_cast<unsigned>(batch));
    warp_kernel<<<grid, kStepThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(step, warps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // The persistent chain, when the device can run it: a cooperative launch of chain_kernel on the current stream,
  // its grid the CTAs with work, at most what the occupancy calculator says is resident at once. Returns false
  // (nothing launched; the caller runs the per-tile launches) when the device has no cooperative launch, when the
  // current stream is being captured into a CUDA graph (batched_nms_padded's graphs keep the plain launches), or
  // when not one CTA fits an SM. Host queries only, no sync.
  template <typename T>
  static bool chain(const ChainArgs<T>& args) {
    TORCH_INTERNAL_ASSERT(args.tile_rows == kTileRows);
    if (!chain_opted_in()) return false;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return false;
    int device = 0, cooperative = 0, sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
    if (cooperative == 0) return false;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const auto kernel = chain_kernel<T, kTileRows>;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kTileRows, 0));
    if (per_sm <= 0 || sms <= 0) return false;
    const int64_t ctas = chain_ctas(args, int64_t{per_sm} * sms);
    ChainArgs<T> arg = args;
    void* params[] = {&arg};
    const cudaError_t launched = cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(kernel), dim3(static_cast<unsigned>(ctas)), dim3(kTileRows), params, 0, stream);
    if (launched == cudaErrorCooperativeLaunchTooLarge) {  // fewer SMs than reported (MPS limits): not launched
      (void)cudaGetLastError();                            // clear it; the per-tile launches run instead
      return false;
    }
    C10_CUDA_CHECK(launched);
    return true;
  }

  template <typename T>
  static void tile(const Image<T>& batch_image, int64_t batch, int tile_rows, int64_t first, int rows) {
    TORCH_INTERNAL_ASSERT(tile_rows == kTileRows);
    const dim3 grid(1, static_cast<unsigned>(batch));
    tile_kernel<T, kTileRows><<<grid, kTileRows, 0, c10::cuda::getCurrentCUDAStream()>>>(batch_image, first, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

at::Tensor cuda_tiled_nms(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& classes,
                          double iou_threshold, int64_t offset) {
  TORCH_CHECK_VALUE(boxes.is_cuda(), op, ": the CUDA kernel got tensors on ", boxes.device());
  c10::cuda::CUDAGuard device_guard(boxes.device());
  return tiled_nms<CudaLaunch>(op, boxes, scores, classes, iou_threshold, offset, kTileRows, kPropagateWarps,
                               small_rows_from_env());
}

at::Tensor nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold, int64_t offset) {
  lightning_balanced::check_nms_args("nms", boxes, scores, iou_threshold, offset);
  return cuda_tiled_nms("nms", boxes, scores, at::Tensor(), iou_threshold, offset);
}

at::Tensor batched_nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                            double iou_threshold, int64_t offset) {
  if (lightning_balanced::batched_nms_input_is_empty(boxes, iou_threshold, offset)) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  lightning_balanced::check_nms_args("batched_nms", boxes, scores, iou_threshold, offset);
  lightning_balanced::check_idxs_arg(boxes, idxs);
  return cuda_tiled_nms("batched_nms", boxes, scores, lightning_balanced::idxs_as_int64(idxs), iou_threshold, offset);
}

std::tuple<at::Tensor, at::Tensor> batched_nms_padded_cuda(const at::Tensor& boxes, const at::Tensor& scores,
                                                           const std::optional<at::Tensor>& idxs,
                                                           double iou_threshold, int64_t max_output, int64_t offset) {
  constexpr const char* op = "batched_nms_padded";
  lightning_balanced::check_padded_args(op, boxes, scores, idxs, iou_threshold, max_output, offset);
  TORCH_CHECK_VALUE(boxes.is_cuda(), op, ": the CUDA kernel got tensors on ", boxes.device());
  TORCH_CHECK_VALUE(boxes.size(0) <= kMaxImages, op, ": the CUDA kernel takes at most ", kMaxImages,
                    " images per call, got ", boxes.size(0));
  c10::cuda::CUDAGuard device_guard(boxes.device());
  const TiledInput input{boxes,
                         scores,
                         idxs.has_value() ? lightning_balanced::idxs_as_int64(*idxs).contiguous() : at::Tensor(),
                         iou_threshold,
                         offset,
                         /*padded=*/true,
                         max_output};
  return padded_nms<CudaLaunch>(input, op, kTileRows, kPropagateWarps, small_rows_from_env());
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CUDA, m) {
  m.impl("nms", &nms_cuda);
  m.impl("batched_nms", &batched_nms_cuda);
  m.impl("batched_nms_padded", &batched_nms_padded_cuda);
}
