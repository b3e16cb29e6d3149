// Hopper (sm_90a) building blocks shared by the TMA + wgmma kernels (gemm_gated.cu,
// engines/stream_wgmma_fp8.cuh): mbarriers with transaction counts, 2-D TMA loads, wgmma
// shared-memory descriptors and fences, and the driver's tensor-map encoder (looked up at run time:
// libcuda is not linked) with the 2-D, 128-byte-swizzle maps they read through.
//
// The device helpers exist only in the sm_90a compile (FMLP_SM90A); the portable (sm_80 + PTX)
// compile of a kernel that uses them must stub its body out, and its supports() must require
// compute capability 9.0.
#pragma once
#include <cuda.h>          // CUtensorMap and its enums (types only)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.hpp"
#include "fusedmlp/fusedmlp.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FMLP_SM90A 1
#endif

namespace fmlp::cuda::sm90 {

// cuTensorMapEncodeTiled from the driver, or nullptr when the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A tensor of `rank` dimensions (dims innermost first, byte strides of dims 1.. in strides) read in
// boxes of box[] elements with 128-byte swizzle (box[0] x the element size must be 128 bytes),
// zeros outside; the error names the kernel and the operand.
inline fmlp_status_t make_tma_map(CUtensorMap* map, const char* kernel, const char* what,
                                  CUtensorMapDataType elem, const void* p, uint32_t rank,
                                  const cuuint64_t* dims, const cuuint64_t* strides,
                                  const cuuint32_t* box) {
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const auto encode = encode_tiled();
  const CUresult r =
      encode == nullptr
          ? CUDA_ERROR_NOT_SUPPORTED
          : encode(map, elem, rank, const_cast<void*>(p), dims, strides, box, elem_strides,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return fmlp::detail::fail(FMLP_ERROR_CUDA,
                              "{}: encoding the {}-d TMA descriptor of {} (dims {} x {}, second "
                              "stride {} bytes) failed (CUresult {})",
                              kernel, rank, what, dims[0], dims[1], strides[0], int(r));
  return FMLP_SUCCESS;
}

// A [rows, cols] row-major matrix of `elem` values (rows ld_bytes apart) read in boxes of box_rows
// x box_cols with 128-byte swizzle, zeros outside.
inline fmlp_status_t make_tma_map_2d(CUtensorMap* map, const char* kernel, const char* what,
                                     CUtensorMapDataType elem, const void* p, int64_t rows,
                                     int64_t cols, int64_t ld_bytes, uint32_t box_cols,
                                     uint32_t box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld_bytes)};
  const cuuint32_t box[2] = {box_cols, box_rows};
  return make_tma_map(map, kernel, what, elem, p, 2, dims, strides, box);
}

// mbarrier helpers: plain sm_90 PTX, also used outside the sm_90a kernels (softmax_sm90_cluster).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Spins until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
#endif

#ifdef FMLP_SM90A

// One box of a tensor map (inner coordinate k, outer coordinate row) into shared memory; the
// bytes count against bar's transaction count.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int k,
                                         int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(smem_u32(bar))
      : "memory");
}

// One box of a 5-d tensor map (coordinates innermost first).
__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4, %5, %6}], [%7];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
      "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// wgmma shared-memory descriptor of a K-major operand in 128-byte swizzle: start address >> 4
// (bits 0-13), leading byte offset (bits 16-29; unused for swizzled K-major, 1 by convention),
// stride byte offset 1024 >> 4 (bits 32-45: the distance between 8-row atoms), base offset 0
// (bits 49-51), layout 1 = 128-byte swizzle (bits 62-63). Stepping k by 32 bytes inside the
// atom adds 32 to the start address (+2 in the descriptor).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#endif  // FMLP_SM90A

}  // namespace fmlp::cuda::sm90
