// The Python module: each kernel family registers its functions here.
#include <torch/extension.h>

#include "common.h"

namespace specserve {
void register_gemm(pybind11::module_& m);
void register_layer_ops(pybind11::module_& m);
void register_model(pybind11::module_& m);
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
}
