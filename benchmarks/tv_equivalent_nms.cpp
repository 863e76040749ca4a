// Benchmark baseline: the classic CPU NMS loop that torchvision.ops.nms runs (torch's stable sort by
// decreasing score, then for each box not yet suppressed: keep it and compare it with every later box,
// setting a suppressed flag; IoU by division). Written for the benchmark, compiled at run time by
// benchmarks/bench_nms.py with torch.utils.cpp_extension.load. Not part of the package.
//
// The loop is quadratic, so it takes an optional time budget (max_seconds > 0): past it, the kernel stops and
// returns an empty tensor, which the benchmark reports as "greedy took longer than the budget".

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>

namespace {

template <typename scalar_t>
at::Tensor classic_nms(const at::Tensor& dets, const at::Tensor& scores, double iou_threshold, double max_seconds) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t n = dets.size(0);
  const at::Tensor x1_t = dets.select(1, 0).contiguous();
  const at::Tensor y1_t = dets.select(1, 1).contiguous();
  const at::Tensor x2_t = dets.select(1, 2).contiguous();
  const at::Tensor y2_t = dets.select(1, 3).contiguous();
  const at::Tensor areas_t = (x2_t - x1_t) * (y2_t - y1_t);
  const at::Tensor order_t = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  at::Tensor suppressed_t = at::zeros({n}, dets.options().dtype(at::kByte));
  at::Tensor keep_t = at::zeros({n}, dets.options().dtype(at::kLong));

  const scalar_t* x1 = x1_t.const_data_ptr<scalar_t>();
  const scalar_t* y1 = y1_t.const_data_ptr<scalar_t>();
  const scalar_t* x2 = x2_t.const_data_ptr<scalar_t>();
  const scalar_t* y2 = y2_t.const_data_ptr<scalar_t>();
  const scalar_t* areas = areas_t.const_data_ptr<scalar_t>();
  const int64_t* order = order_t.const_data_ptr<int64_t>();
  uint8_t* suppressed = suppressed_t.mutable_data_ptr<uint8_t>();
  int64_t* keep = keep_t.mutable_data_ptr<int64_t>();

  int64_t kept = 0;
  for (int64_t a = 0; a < n; ++a) {
    const int64_t i = order[a];
    if (suppressed[i]) continue;
    if (max_seconds > 0 && (kept & 255) == 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > max_seconds) {
      return at::empty({0}, dets.options().dtype(at::kLong));  // over budget
    }
    keep[kept++] = i;
    const scalar_t ix1 = x1[i], iy1 = y1[i], ix2 = x2[i], iy2 = y2[i], iarea = areas[i];
    for (int64_t b = a + 1; b < n; ++b) {
      const int64_t j = order[b];
      if (suppressed[j]) continue;
      const scalar_t w = std::max(scalar_t(0), std::min(ix2, x2[j]) - std::max(ix1, x1[j]));
      const scalar_t h = std::max(scalar_t(0), std::min(iy2, y2[j]) - std::max(iy1, y1[j]));
      const scalar_t inter = w * h;
      const scalar_t ovr = inter / (iarea + areas[j] - inter);
      if (ovr > iou_threshold) suppressed[j] = 1;
    }
  }
  return keep_t.narrow(0, 0, kept);
}

at::Tensor nms_cpu(const at::Tensor& dets, const at::Tensor& scores, double iou_threshold, double max_seconds) {
  TORCH_CHECK(dets.dim() == 2 && dets.size(1) == 4, "dets must be (N, 4)");
  if (dets.size(0) == 0) return at::empty({0}, dets.options().dtype(at::kLong));
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(dets.scalar_type(), "classic_nms", [&] {
    out = classic_nms<scalar_t>(dets, scores, iou_threshold, max_seconds);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tv_equivalent, m) { m.def("nms(Tensor dets, Tensor scores, float iou_threshold, float max_seconds=0) -> Tensor"); }

TORCH_LIBRARY_IMPL(tv_equivalent, CPU, m) { m.impl("nms", &nms_cpu); }
