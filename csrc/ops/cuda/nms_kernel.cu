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
// allocations and the launch. Not yet run on a GPU (issue 40): checked through the emulation and compiled only.
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
#include <torch/library.h>

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
// shared memory.
template <typename T, typename scalar_t>
__global__ void __launch_bounds__(kSmallThreads) small_kernel(SmallArgs<T, scalar_t> args) {
  extern __shared__ __align__(16) unsigned char small_smem[];
  small_nms(args, blockIdx.y, small_smem, DeviceCta{static_cast<int>(threadIdx.x)});
}

// Step 1 of one tile (one CTA of kRows threads per image): load, then for each 64-row block in order, warp 0
// resolves the block in rounds and every thread ORs its kept row's suppression of later blocks into
// `suppressed` (a warp-wide OR, then one shared atomic per warp); then each row is marked decided and the kept
// rows are written out. Two barriers per block; no thread runs a loop over the rows.
template <typename T, int kRows>
__global__ void __launch_bounds__(kRows) tile_kernel(Image<T> batch, int64_t first, int rows) {
  constexpr int kWords = kRows / kWordBits;
  __shared__ uint64_t cols[kRows];
  __shared__ uint64_t suppressed[kWords];
  __shared__ uint64_t kept[kWords];
  __shared__ int64_t base;
  const Image<T> im = image_at(batch, blockIdx.y, kRows);
  const int t = threadIdx.x;
  if (t < kWords) suppressed[t] = 0;
  if (t == 0) base = im.counters[kKept];
  __syncthreads();
  const TileState tile{kRows, rows, cols, suppressed, kept, base};
  uint64_t m[kWords];
  load_tile_thread(im, tile, first, t, m);
  __syncthreads();
  const int used = tile_words(rows);
#pragma unroll
  for (int w = 0; w < kWords; ++w) {  // unrolled, so m[w] stays in registers
    if (w < used) {  // the same for every thread
      if (t < 32) {
        const uint64_t k = resolve_block(cols + w * kWordBits, open_rows(suppressed[w], rows - w * kWordBits),
                                         DeviceWarp{t});
        if (t == 0) kept[w] = k;
      }
      __syncthreads();
      const uint64_t bits = warp_or(kept_row_suppression(tile, w, t, m));
      if (t % 32 == 0 && bits != 0) or_word(&suppressed[t / kWordBits], bits);
      __syncthreads();
    }
  }
  finish_tile_row(im, tile, first, t);
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

  template <typename T>
  static void tile(const Image<T>& batch_image, int64_t batch, int tile_rows, int64_t first, int rows) {
    TORCH_INTERNAL_ASSERT(tile_rows == kTileRows);
    const dim3 grid(1, static_cast<unsigned>(batch));
    tile_kernel<T, kTileRows><<<grid, kTileRows, 0, c10::cuda::getCurrentCUDAStream()>>>(batch_image, first,
                                                                                                 rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

at::Tensor cuda_tiled_nms(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& classes,
                          double iou_threshold, int64_t offset) {
  TORCH_CHECK_VALUE(boxes.is_cuda(), op, ": the CUDA kernel got tensors on ", boxes.device());
  c10::cuda::CUDAGuard device_guard(boxes.device());
  return tiled_nms<CudaLaunch>(op, boxes, scores, classes, iou_threshold, offset, kTileRows, kPropagateWarps);
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
  return padded_nms<CudaLaunch>(input, op, kTileRows, kPropagateWarps);
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CUDA, m) {
  m.impl("nms", &nms_cuda);
  m.impl("batched_nms", &batched_nms_cuda);
  m.impl("batched_nms_padded", &batched_nms_padded_cuda);
}
