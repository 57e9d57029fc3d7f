// NVFP4 quantize with fused amax: one cooperative launch does both passes over the tensor.
//
// Phase 1 (dynamic scaling only): every block reduces |x| over finite elements of a grid-stride
// share, one atomicMax per block (non-negative floats order like their bit patterns). A grid barrier
// (cooperative groups) then makes the amax visible to all blocks. Phase 2: one thread per 16-element
// block computes the scale and the codes exactly as the reference (solrl_engine/quant/nvfp4.py):
// S_enc = 2688 / amax, s = RNE_e4m3(min(blk_amax * (S_enc * (1/6)), 448)), g = 1 / S_enc,
// mult = min(1 / (s * g), FP32_MAX), codes = RNE_e2m1(clamp(x * mult, -6, 6)); a block holding
// NaN/Inf gets the NaN scale 0x7F and zero codes. Every fp32 op is spelled with __f*_rn so nvcc
// cannot contract it into an FMA. The extension builds it for sm_80, sm_90a, sm_100a and PTX for
// newer GPUs (CMakeLists.txt).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "solrl_kernels.h"

namespace cg = cooperative_groups;

namespace {

constexpr float kFp32Max = 3.4028234663852886e38f;
constexpr int kThreads = 256;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

__device__ __forceinline__ bool finite(float v) { return fabsf(v) <= kFp32Max; }

// E2M1 code of v (already clamped to [-6, 6]), round to nearest even; NaN -> 0.
__device__ __forceinline__ uint32_t e2m1_encode(float v) {
  const float a = fabsf(v);
  uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return mag | (v < 0.0f ? 8u : 0u);
}

__device__ __forceinline__ float e4m3_value(uint8_t code) {
  __nv_fp8_e4m3 f;
  f.__x = code;
  return float(f);
}

__device__ __forceinline__ int64_t swizzled_offset(int64_t r, int64_t c, int64_t tiles_per_row) {
  const int64_t tile = (r / 128) * tiles_per_row + c / 4;
  return tile * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
}

// The 16 values of block b, with 16-byte vector loads when the input is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_block(const T* __restrict__ x, int64_t b, bool aligned, float (&v)[16]) {
  const T* p = x + b * 16;
  if (aligned) {
    constexpr int kPer = 16 / sizeof(T);  // elements per 16-byte vector
    T tmp[16];
#pragma unroll
    for (int i = 0; i < 16 / kPer; ++i) reinterpret_cast<uint4*>(tmp)[i] = reinterpret_cast<const uint4*>(p)[i];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = to_f32(tmp[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = to_f32(p[j]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, uint8_t* __restrict__ q,
                    uint8_t* __restrict__ s, float* __restrict__ g_out, const float* __restrict__ static_amax,
                    uint32_t* __restrict__ amax_bits, int swizzle, int aligned) {
  const int64_t n = rows * cols;
  const int64_t n_blocks = n / 16;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;

  float amax;
  if (static_amax == nullptr) {
    float local = 0.0f;
    for (int64_t i = tid; i < n; i += stride) {
      const float v = fabsf(to_f32(x[i]));
      if (v <= kFp32Max) local = fmaxf(local, v);
    }
    for (int off = 16; off > 0; off >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, off));
    __shared__ float warp_max[kThreads / 32];
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = local;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
      atomicMax(amax_bits, __float_as_uint(m));
    }
    cg::this_grid().sync();
    amax = __uint_as_float(*reinterpret_cast<volatile uint32_t*>(amax_bits));
  } else {
    amax = *static_amax;
  }

  float s_enc = amax == 0.0f ? 1.0f : fminf(__fdiv_rn(2688.0f, amax), kFp32Max);
  const float g = __fdiv_rn(1.0f, s_enc);
  if (tid == 0) *g_out = g;
  const float enc_over_6 = __fmul_rn(s_enc, 1.0f / 6.0f);
  const int64_t cblocks = cols / 16;
  const int64_t tiles_per_row = (cblocks + 3) / 4;

  for (int64_t b = tid; b < n_blocks; b += stride) {
    float v[16];
    load_block(x, b, aligned != 0, v);
    bool all_finite = true;
    float bmax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      all_finite = all_finite && finite(v[j]);
      bmax = fmaxf(bmax, fabsf(v[j]));
    }
    uint8_t scode;
    uint32_t lo = 0, hi = 0;
    if (all_finite) {
      const float sf = fminf(__fmul_rn(bmax, enc_over_6), 448.0f);
      scode = __nv_cvt_float_to_fp8(sf, __NV_SATFINITE, __NV_E4M3);
      const float sval = e4m3_value(scode);
      const float mult = fminf(__fdiv_rn(1.0f, __fmul_rn(sval, g)), kFp32Max);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float t = fminf(fmaxf(__fmul_rn(v[j], mult), -6.0f), 6.0f);
        const uint32_t c = e2m1_encode(t);
        if (j < 8) lo |= c << (4 * j);
        else hi |= c << (4 * (j - 8));
      }
    } else {
      scode = 0x7F;  // NaN scale; codes stay 0
    }
    reinterpret_cast<uint2*>(q)[b] = make_uint2(lo, hi);
    const int64_t r = b / cblocks, c = b % cblocks;
    s[swizzle ? swizzled_offset(r, c, tiles_per_row) : b] = scode;
  }
}

template <typename T>
int launch(const void* x, int64_t rows, int64_t cols, uint8_t* q, uint8_t* s, float* g, const float* static_amax,
           uint32_t* scratch, int swizzle, cudaStream_t stream) {
  // Resident blocks per device, asked once per device and dtype (no driver queries per call).
  constexpr int kMaxDevices = 64;
  static int resident_cache[kMaxDevices] = {0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return int(err);
  int resident_blocks = device < kMaxDevices ? resident_cache[device] : 0;
  if (resident_blocks == 0) {
    int sms = 0, per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, quantize_kernel<T>, kThreads, 0);
    if (err != cudaSuccess) return int(err);
    resident_blocks = sms * (per_sm > 0 ? per_sm : 1);
    if (device < kMaxDevices) resident_cache[device] = resident_blocks;
  }
  if (swizzle) {
    const int64_t padded = ((rows + 127) / 128 * 128) * ((cols / 16 + 3) / 4 * 4);
    if ((err = cudaMemsetAsync(s, 0, size_t(padded), stream)) != cudaSuccess) return int(err);
  }
  if ((err = cudaMemsetAsync(scratch, 0, sizeof(uint32_t), stream)) != cudaSuccess) return int(err);
  const int64_t work = (rows * cols / 16 + kThreads - 1) / kThreads;
  const int64_t resident = resident_blocks;
  const unsigned grid = unsigned(work < resident ? (work > 0 ? work : 1) : resident);
  const T* xp = static_cast<const T*>(x);
  int aligned = (reinterpret_cast<uintptr_t>(x) % 16) == 0;
  void* args[] = {&xp, &rows, &cols, &q, &s, &g, &static_amax, &scratch, &swizzle, &aligned};
  err = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(quantize_kernel<T>), dim3(grid), dim3(kThreads), args, 0,
                                    stream);
  return int(err);
}

}  // namespace

extern "C" int solrl_nvfp4_quantize(const void* x, int dtype, int64_t rows, int64_t cols, uint8_t* q, uint8_t* s,
                                    float* g, const float* static_amax, uint32_t* scratch, int swizzle,
                                    int64_t stream) {
  if (cols % 16 != 0) return int(cudaErrorInvalidValue);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case SOLRL_F32:
      return launch<float>(x, rows, cols, q, s, g, static_amax, scratch, swizzle, st);
    case SOLRL_BF16:
      return launch<__nv_bfloat16>(x, rows, cols, q, s, g, static_amax, scratch, swizzle, st);
    case SOLRL_F16:
      return launch<__half>(x, rows, cols, q, s, g, static_amax, scratch, swizzle, st);
    default:
      return int(cudaErrorInvalidValue);
  }
}
