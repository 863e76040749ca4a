// The Python module `_C` of lightning_balanced and its operator library.
//
// Importing `lightning_balanced._C` loads this shared library; its static initializers register the
// library below, the schemas of each op (ops/<op>.cpp, TORCH_LIBRARY_FRAGMENT) and their kernels
// (ops/cpu/, ops/cuda/, ops/autocast/, TORCH_LIBRARY_IMPL). There is no pybind11 surface: Python calls
// the operators through `torch.ops.lightning_balanced.*` (model: pytorch/extension-cpp).
//
// Adding an op means adding its own files only: setup.py compiles every source under ops/, and
// lightning_balanced/ops/_loader.py reads the ops and their kernels from the dispatcher.

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

// The namespace is defined once here; each op adds its schemas with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(lightning_balanced, m) {}
