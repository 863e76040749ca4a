// Operator schemas of lightning_balanced and the (empty) Python module `_C`.
//
// Importing `lightning_balanced._C` loads this shared library; its static initializers
// (TORCH_LIBRARY / TORCH_LIBRARY_IMPL) register the schemas below and the kernels of
// cpu/, cuda/ and autocast/. There is no pybind11 surface: Python calls the operators
// through `torch.ops.lightning_balanced.*` (model: pytorch/extension-cpp).

#include <Python.h>

#include <torch/library.h>

extern "C" {
// An empty module: `import lightning_balanced._C` only has to run the registrations.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "Compiled operators of lightning_balanced (registered in torch.ops.lightning_balanced).",
      -1,       // no per-interpreter state
      nullptr,  // no methods
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(lightning_balanced, m) {
  // Greedy non-maximum suppression; returns int64 indices of kept boxes by decreasing score.
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold, int offset=0) -> Tensor");
  // Per-class NMS (boxes of different `idxs` never suppress each other) on the original
  // coordinates, without the coordinate-offset trick; same output convention as nms.
  m.def("batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold, int offset=0) -> Tensor");
}
