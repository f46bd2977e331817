// The Python module: the kernel families' entry points (their *_py.inc files, compiled here in
// one translation unit, since every file that includes torch's extension headers costs ~40 s of
// the build), the native model's classes (model.cpp) and the native EAGLE-3 drafter (eagle3.cpp).
#include <torch/extension.h>

#include "common.h"
#include "layer_ops_py.inc"
#include "qgemm_py.inc"
#include "race_py.inc"

namespace specserve {
void register_model(pybind11::module_& m);
void register_eagle3(pybind11::module_& m);
}

namespace {

std::vector<std::string> compiled_levels() {
  std::vector<std::string> out = {"generic"};
  if (specserve::kX86) {
    out.insert(out.end(), {"avx2", "avx512", "avx512_vnni", "amx"});
  }
  return out;
}

// The highest level whose kernels this process can run, whatever the CPU has: AMX needs the
// kernel's grant of the tile state as well (see hardware.native_level).
int64_t top_level() {
#if defined(__x86_64__) || defined(_M_X64)
  return specserve::amx_permitted() ? specserve::LEVEL_AMX : specserve::LEVEL_AVX512_BF16;
#else
  return specserve::LEVEL_GENERIC;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specserve native CPU kernels";
  m.def("compiled_levels", &compiled_levels, "CPU levels this build has kernels for");
  m.def("top_level", &top_level, "the highest CPU level this process may run (AMX: if Linux grants the tiles)");
  specserve::register_gemm(m);
  specserve::register_layer_ops(m);
  specserve::register_race(m);
  specserve::register_model(m);
  specserve::register_eagle3(m);
}
