// Blackwell (sm_100a) block-scaled NVFP4 GEMM from CUTLASS's collective builders (headers from the
// nvidia-cutlass wheel): D = alpha * (A B^T) + bias, A [m, k] and B [n, k] packed E2M1 (K-major),
// 16-element E4M3 block scales in the 128x4 swizzled layout (the layout solrl_nvfp4_quantize writes
// with swizzle=1 and solrl_engine.quant.nvfp4.swizzle_scales produces), FP32 accumulate, alpha read
// from device memory (the product of the two global decode scales: no host sync), per-column BF16
// bias fused in the epilogue, BF16 out. Numerics: the epilogue is fma(alpha, acc, bias) with the bias
// in BF16 (the reference multiplies, then adds an FP32 bias): within one BF16 rounding of it.
//
// Status: compile-checked for sm_100a in CI; never executed (no Blackwell GPU here). Its numerics
// contract is the same as the reference nvfp4_linear. On other architectures the entry point
// returns -1 and Python uses cuBLASLt (torch._scaled_mm) or the Triton GEMM.
#include <cuda_runtime.h>

#include "solrl_kernels.h"

#if defined(SOLRL_WITH_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#endif

#if defined(SOLRL_WITH_CUTLASS) && defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED)
namespace {
using namespace cute;

using ElementA = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using ElementB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using ElementD = cutlass::bfloat16_t;
using ElementBias = cutlass::bfloat16_t;
using ElementAcc = float;
constexpr int kAlignAB = 32;  // 16 bytes of E2M1
constexpr int kAlignD = 8;    // 16 bytes of BF16

using MmaTile = Shape<_256, _256, _256>;  // 2-SM MMA tile
using Cluster = Shape<_2, _1, _1>;

// D = alpha * acc + bias[n] (no C operand: beta is unused)
using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, ElementAcc, ElementBias, ElementD, ElementAcc>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, MmaTile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc, void, cutlass::layout::RowMajor,
    kAlignD, ElementD, cutlass::layout::RowMajor, kAlignD, cutlass::epilogue::collective::EpilogueScheduleAuto,
    Fusion>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementA, cutlass::layout::RowMajor, kAlignAB,
    ElementB, cutlass::layout::ColumnMajor, kAlignAB, ElementAcc, MmaTile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, void>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using BlkScaledConfig = typename Mainloop::Sm1xxBlkScaledConfig;

typename Gemm::Arguments make_args(const uint8_t* a, const uint8_t* sfa, const uint8_t* b, const uint8_t* sfb,
                                   const float* alpha, const void* bias, void* d, int m, int n, int k) {
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;
  auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, {m, k, 1});
  auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});
  auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, {m, n, 1});
  auto layout_sfa = BlkScaledConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  auto layout_sfb = BlkScaledConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {reinterpret_cast<const typename ElementA::DataType*>(a), stride_a,
       reinterpret_cast<const typename ElementB::DataType*>(b), stride_b,
       reinterpret_cast<const typename ElementA::ScaleFactorType*>(sfa), layout_sfa,
       reinterpret_cast<const typename ElementB::ScaleFactorType*>(sfb), layout_sfb},
      {{}, nullptr, stride_d, reinterpret_cast<ElementD*>(d), stride_d}};
  auto& fusion = args.epilogue.thread;
  fusion.alpha_ptr = alpha;
  fusion.beta = 0.0f;
  fusion.bias_ptr = reinterpret_cast<const ElementBias*>(bias);
  return args;
}
}  // namespace

extern "C" size_t solrl_nvfp4_gemm_sm100_workspace(int m, int n, int k) {
  return Gemm::get_workspace_size(make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k));
}

extern "C" int solrl_nvfp4_gemm_sm100(const uint8_t* a, const uint8_t* sfa, const uint8_t* b, const uint8_t* sfb,
                                      const float* alpha, const void* bias, void* d, int m, int n, int k,
                                      void* workspace, size_t workspace_bytes, int64_t stream) {
  auto args = make_args(a, sfa, b, sfb, alpha, bias, d, m, n, k);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return -2;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return int(cudaErrorInvalidValue);
  if (gemm.initialize(args, workspace, reinterpret_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return -4;
  // run() checks and clears the launch error itself: its status is the only report of a failure
  if (gemm.run(reinterpret_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return -3;
  return 0;
}

#else  // no CUTLASS headers, or not compiling for sm_100a

extern "C" size_t solrl_nvfp4_gemm_sm100_workspace(int, int, int) { return 0; }

extern "C" int solrl_nvfp4_gemm_sm100(const uint8_t*, const uint8_t*, const uint8_t*, const uint8_t*, const float*,
                                      const void*, void*, int, int, int, void*, size_t, int64_t) {
  return -1;
}

#endif
