// CUDA kernels of lightning_balanced::nms and lightning_balanced::batched_nms.
//
// Same semantics and arithmetic as the CPU kernel (see cpu/nms_kernel.cpp); every operation uses the
// round-to-nearest intrinsics (__fadd_rn, __fmul_rn, ...), so nvcc cannot contract it into FMAs and the
// result matches the float32/float64 reference bit for bit.
//
// Algorithm (the classic bitmask NMS): sort by decreasing score (stable), then one 64-thread block per
// (row block, column block) of 64 x 64 box pairs writes, for each row box i, a 64-bit mask of the column
// boxes j > i that i would suppress. The greedy pass over the masks runs on the host.
// Includes c10/cuda headers only (not ATen/cuda/CUDAContext.h), so it also compiles against CPU wheels.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "ops/nms_checks.h"

namespace {

constexpr int kBlock = 64;  // boxes per block = bits per mask word
constexpr int64_t kMaxBoxes = int64_t{65535} * kBlock;  // gridDim.y limit

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <typename T>
__device__ __forceinline__ T area_of(const T* b, T off) {
  return mul_rn(add_rn(sub_rn(b[2], b[0]), off), add_rn(sub_rn(b[3], b[1]), off));
}

// union > 0 && inter > thr * union, in the exact operation order of the reference.
template <typename T>
__device__ __forceinline__ bool suppresses(const T* a, T area_a, const T* b, T area_b, T thr, T off) {
  T w = add_rn(sub_rn(a[2] < b[2] ? a[2] : b[2], a[0] > b[0] ? a[0] : b[0]), off);
  T h = add_rn(sub_rn(a[3] < b[3] ? a[3] : b[3], a[1] > b[1] ? a[1] : b[1]), off);
  w = w > T(0) ? w : T(0);
  h = h > T(0) ? h : T(0);
  const T inter = mul_rn(w, h);
  const T uni = sub_rn(add_rn(area_a, area_b), inter);
  return uni > T(0) && inter > mul_rn(uni, thr);
}

template <typename T>
__global__ void nms_mask_kernel(int64_t n, int64_t col_blocks, const T* __restrict__ boxes,
                                const int64_t* __restrict__ classes, T thr, T off,
                                unsigned long long* __restrict__ mask) {
  const int64_t row_block = blockIdx.y;
  const int64_t col_block = blockIdx.x;
  if (row_block > col_block) return;  // box i only suppresses boxes j > i
  const int row_size = static_cast<int>(min(n - row_block * kBlock, int64_t{kBlock}));
  const int col_size = static_cast<int>(min(n - col_block * kBlock, int64_t{kBlock}));

  __shared__ T col_boxes[kBlock * 4];
  __shared__ T col_areas[kBlock];
  __shared__ int64_t col_classes[kBlock];
  const int t = threadIdx.x;
  if (t < col_size) {
    const T* b = boxes + (col_block * kBlock + t) * 4;
    for (int k = 0; k < 4; ++k) col_boxes[t * 4 + k] = b[k];
    col_areas[t] = area_of(b, off);
    col_classes[t] = classes == nullptr ? 0 : classes[col_block * kBlock + t];
  }
  __syncthreads();

  if (t < row_size) {
    const int64_t i = row_block * kBlock + t;
    const T* bi = boxes + i * 4;
    const T area_i = area_of(bi, off);
    const int64_t class_i = classes == nullptr ? 0 : classes[i];
    unsigned long long bits = 0;
    for (int j = (row_block == col_block) ? t + 1 : 0; j < col_size; ++j) {
      if (col_classes[j] == class_i && suppresses(bi, area_i, col_boxes + j * 4, col_areas[j], thr, off)) {
        bits |= 1ULL << j;
      }
    }
    mask[i * col_blocks + col_block] = bits;
  }
}

at::Tensor nms_cuda_impl(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
                         double iou_threshold, int64_t offset) {
  TORCH_CHECK_VALUE(boxes.is_cuda(), op, ": the CUDA kernel got tensors on ", boxes.device());
  const int64_t n = boxes.size(0);
  TORCH_CHECK_VALUE(n <= kMaxBoxes, op, ": the CUDA kernel supports at most ", kMaxBoxes, " boxes, got ", n);
  c10::cuda::CUDAGuard device_guard(boxes.device());
  if (n == 0) return at::empty({0}, boxes.options().dtype(at::kLong));

  // float16/bfloat16 are computed in float32 (like the CPU kernel and the reference).
  const bool is_double = boxes.scalar_type() == at::kDouble;
  const auto compute = is_double ? at::kDouble : at::kFloat;
  const at::Tensor boxes_c = boxes.to(compute);
  const at::Tensor scores_c = scores.to(compute);
  TORCH_CHECK_VALUE(at::isfinite(scores_c).all().item<bool>(), op, ": scores must be finite (no NaN or infinity)");
  TORCH_CHECK_VALUE(at::isfinite(boxes_c).all().item<bool>(), op,
                    ": box coordinates must be finite (no NaN or infinity)");

  const at::Tensor order = std::get<1>(scores_c.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  const at::Tensor sorted_boxes = boxes_c.index_select(0, order).contiguous();
  at::Tensor sorted_classes;
  if (idxs != nullptr) sorted_classes = idxs->index_select(0, order).contiguous();

  const int64_t col_blocks = (n + kBlock - 1) / kBlock;
  at::Tensor mask = at::empty({n, col_blocks}, boxes.options().dtype(at::kLong));
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(col_blocks));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(compute, "lightning_balanced_nms_cuda", [&] {
    nms_mask_kernel<scalar_t><<<grid, kBlock, 0, stream>>>(
        n, col_blocks, sorted_boxes.const_data_ptr<scalar_t>(),
        idxs == nullptr ? nullptr : sorted_classes.const_data_ptr<int64_t>(), static_cast<scalar_t>(iou_threshold),
        static_cast<scalar_t>(offset), reinterpret_cast<unsigned long long*>(mask.mutable_data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  // Greedy pass on the host: box i is kept unless a kept box before it set its bit.
  const at::Tensor mask_cpu = mask.to(at::kCPU);
  const auto* bits = reinterpret_cast<const unsigned long long*>(mask_cpu.const_data_ptr<int64_t>());
  std::vector<unsigned long long> removed(col_blocks, 0);
  at::Tensor keep = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  int64_t* keep_ptr = keep.mutable_data_ptr<int64_t>();
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = i / kBlock;
    if (removed[block] & (1ULL << (i % kBlock))) continue;
    keep_ptr[kept++] = i;
    const unsigned long long* row = bits + i * col_blocks;
    for (int64_t j = block; j < col_blocks; ++j) removed[j] |= row[j];
  }
  return order.index_select(0, keep.narrow(0, 0, kept).to(order.device(), /*non_blocking=*/false));
}

at::Tensor nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold, int64_t offset) {
  lightning_balanced::check_nms_args("nms", boxes, scores, iou_threshold, offset);
  return nms_cuda_impl("nms", boxes, scores, nullptr, iou_threshold, offset);
}

at::Tensor batched_nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                            double iou_threshold, int64_t offset) {
  if (lightning_balanced::batched_nms_input_is_empty(boxes, iou_threshold, offset)) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  lightning_balanced::check_nms_args("batched_nms", boxes, scores, iou_threshold, offset);
  lightning_balanced::check_idxs_arg(boxes, idxs);
  const at::Tensor classes = lightning_balanced::idxs_as_int64(idxs);
  return nms_cuda_impl("batched_nms", boxes, scores, &classes, iou_threshold, offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_balanced, CUDA, m) {
  m.impl("nms", &nms_cuda);
  m.impl("batched_nms", &batched_nms_cuda);
}
