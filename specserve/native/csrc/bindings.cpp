// The Python module: the kernel families' entry points (their *_py.inc files, compiled here in
// one translation unit, since every file that includes torch's extension headers costs ~40 s of
// the build), the native model's classes (model.cpp) and the native EAGLE-3 drafter (eagle3.cpp).
#include <torch/extension.h>

#include "common.h"
#include "layer_ops_py.inc"
#include "qgemm_py.inc"

namespace specserve {
void register_model(pybind11::module_& m);
void register_eagle3(pybind11::module_& m);
}

namespace {

std::vector<std::string> compiled_levels() {
  std::vector<std::string> out = {"generic"};
  if (specserve::kX86) {
    out.insert(out.end(), {"avx2", "avx512", "avx512_vnni"});
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specserve native CPU kernels";
  m.def("compiled_levels", &compiled_levels, "CPU levels this build has kernels for");
  specserve::register_gemm(m);
  specserve::register_layer_ops(m);
  specserve::register_model(m);
  specserve::register_eagle3(m);
}
