// AVX-512 levels of the quantized products: BW/VL/DQ with vpmaddubsw, and VNNI with vpdpbusd.
// Nothing here runs unless the dispatch in qgemm.cpp found the level (see native/__init__.py
// for why these files use intrinsics and plain arrays only).
#include <cstdint>
#include <cstring>

#include "qgemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
namespace specserve::avx512 {
#define QG_VNNI 0
#include "qgemm_avx512.inc"
#undef QG_VNNI
}  // namespace specserve::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")
namespace specserve::avx512_vnni {
#define QG_VNNI 1
#include "qgemm_avx512.inc"
#undef QG_VNNI
}  // namespace specserve::avx512_vnni
#pragma GCC pop_options

namespace specserve {

const GemmKernels& gemm_kernels_avx512() {
  static const GemmKernels k = make_gemm_kernels(avx512::quantize, avx512::kGemms, avx512::kNumGemms);
  return k;
}

const GemmKernels& gemm_kernels_avx512_vnni() {
  static const GemmKernels k =
      make_gemm_kernels(avx512_vnni::quantize, avx512_vnni::kGemms, avx512_vnni::kNumGemms);
  return k;
}

}  // namespace specserve
#endif
