// C ABI of the solrl-engine CUDA kernels: what torch_bindings.cpp calls. Plain pointers, sizes and
// a cudaStream_t passed as an integer, so the bindings need no CUDA headers and the kernels no torch.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

// dtype codes for the quantize input
enum SolrlDtype { SOLRL_F32 = 0, SOLRL_BF16 = 1, SOLRL_F16 = 2 };

// NVFP4 quantize with fused amax (docs/design.md section 4; bit-exact with solrl_engine.quant.nvfp4).
// x: rows x cols contiguous, cols % 16 == 0. Writes packed codes q [rows, cols/2], E4M3 block scales
// s ([rows, cols/16] row-major, or the 128x4 swizzled layout when `swizzle`, padded with zeros) and
// the FP32 decode scale g (1/S_enc). amax: the tensor amax when `static_amax` is null; then the
// kernel computes it itself (one cooperative launch, a grid barrier between the two phases).
// `scratch` is one uint32 of device memory. Returns 0, or a cudaError_t code.
int solrl_nvfp4_quantize(const void* x, int dtype, int64_t rows, int64_t cols, uint8_t* q, uint8_t* s,
                         float* g, const float* static_amax, uint32_t* scratch, int swizzle, int64_t stream);

// Blackwell block-scaled NVFP4 GEMM (CUTLASS sm100): D[m, n] = alpha * (A[m, k] B[n, k]^T) + bias[n].
// A, B packed E2M1 (K-major), sfa/sfb swizzled E4M3 scales, alpha a device FP32 scalar (the product of
// the two global decode scales), bias BF16 [n] or null, D BF16. Returns 0, -1 when this build has no
// sm100 kernel, -2 when CUTLASS cannot implement the problem (alignment), -3 when the launch failed,
// -4 when initialization failed (e.g. no sm_100a image for this GPU), or a cudaError_t code.
int solrl_nvfp4_gemm_sm100(const uint8_t* a, const uint8_t* sfa, const uint8_t* b, const uint8_t* sfb,
                           const float* alpha, const void* bias, void* d, int m, int n, int k, void* workspace,
                           size_t workspace_bytes, int64_t stream);
size_t solrl_nvfp4_gemm_sm100_workspace(int m, int n, int k);
}
