// Thin torch bindings of the C ABI in solrl_kernels.h (the vLLM pattern: kernels per file, one
// bindings file). Streams arrive as integers (torch.cuda.current_stream().cuda_stream), so this file
// needs no CUDA headers and is syntax-checked in CI against the CPU PyTorch headers.
#include <c10/core/DeviceGuard.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "solrl_kernels.h"

namespace {

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

int dtype_code(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return SOLRL_F32;
    case at::kBFloat16:
      return SOLRL_BF16;
    case at::kHalf:
      return SOLRL_F16;
    default:
      TORCH_CHECK(false, "NVFP4 quantize takes float32, bfloat16 or float16; got ", x.scalar_type());
  }
}

int64_t ceil_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// x [..., K] -> (qdata uint8 [..., K/2], scales uint8 [..., K/16] or flat swizzled, g fp32 0-dim)
std::vector<at::Tensor> nvfp4_quantize(const at::Tensor& x, const std::optional<at::Tensor>& amax, bool swizzle,
                                       int64_t stream) {
  check_cuda(x, "x");
  const c10::DeviceGuard guard(x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 16 == 0, "the last dimension must be a multiple of 16; got ",
              x.sizes());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  auto qshape = x.sizes().vec();
  qshape.back() = cols / 2;
  auto sshape = x.sizes().vec();
  sshape.back() = cols / 16;
  auto opts = x.options().dtype(at::kByte);
  at::Tensor q = at::empty(qshape, opts);
  at::Tensor s = swizzle ? at::empty({ceil_to(rows, 128) * ceil_to(cols / 16, 4)}, opts) : at::empty(sshape, opts);
  at::Tensor g = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor scratch = at::empty({1}, x.options().dtype(at::kInt));
  const float* amax_ptr = nullptr;
  if (amax.has_value()) {
    check_cuda(*amax, "amax");
    TORCH_CHECK(amax->device() == x.device(), "amax must be on the same device as x");
    TORCH_CHECK(amax->scalar_type() == at::kFloat && amax->numel() == 1, "amax must be one float32 value");
    amax_ptr = amax->data_ptr<float>();
  }
  if (rows == 0) {
    g.fill_(1.0);  // as the reference: no elements -> amax 0 -> S_enc 1
  } else {
    const int rc = solrl_nvfp4_quantize(x.data_ptr(), dtype_code(x), rows, cols, q.data_ptr<uint8_t>(),
                                        s.data_ptr<uint8_t>(), g.data_ptr<float>(), amax_ptr,
                                        reinterpret_cast<uint32_t*>(scratch.data_ptr<int32_t>()), swizzle, stream);
    TORCH_CHECK(rc == 0, "solrl_nvfp4_quantize failed (CUDA error ", rc, ")");
  }
  return {q, s, g};
}

// D = alpha (A B^T) + bias, BF16 out; A [M, K/2], B [N, K/2] packed, scales swizzled (see the .cu).
at::Tensor nvfp4_gemm_sm100(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb,
                            const at::Tensor& alpha, const std::optional<at::Tensor>& bias, int64_t stream) {
  for (auto* t : {&a, &sfa, &b, &sfb, &alpha}) {
    check_cuda(*t, "operand");
    TORCH_CHECK(t->device() == a.device(), "all operands must be on one device");
  }
  const c10::DeviceGuard guard(a.device());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "A [M, K/2] and B [N, K/2] must share K");
  const int m = int(a.size(0)), n = int(b.size(0)), k = int(a.size(1) * 2);
  at::Tensor d = at::empty({m, n}, a.options().dtype(at::kBFloat16));
  if (m == 0 || n == 0) return d;
  const int64_t kb = ceil_to(k / 16, 4);
  TORCH_CHECK(sfa.numel() == ceil_to(m, 128) * kb && sfb.numel() == ceil_to(n, 128) * kb,
              "block scales must be the swizzled layout (rows padded to 128, K/16 padded to 4)");
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_cuda(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "bias must be bfloat16 [N]");
    bias_ptr = bias->data_ptr();
  }
  const size_t ws_bytes = solrl_nvfp4_gemm_sm100_workspace(m, n, k);
  at::Tensor ws = at::empty({int64_t(ws_bytes) + 1}, a.options().dtype(at::kByte));
  const int rc = solrl_nvfp4_gemm_sm100(a.data_ptr<uint8_t>(), sfa.data_ptr<uint8_t>(), b.data_ptr<uint8_t>(),
                                        sfb.data_ptr<uint8_t>(), alpha.data_ptr<float>(), bias_ptr, d.data_ptr(), m,
                                        n, k, ws.data_ptr(), ws_bytes, stream);
  TORCH_CHECK(rc != -1, "this build of solrl_engine._C has no sm_100a GEMM (rebuild with CUTLASS on CUDA >= 12.8)");
  TORCH_CHECK(rc != -2, "CUTLASS cannot run this problem (M=", m, ", N=", n, ", K=", k, "): check K % 32 == 0 and N % 8 == 0");
  TORCH_CHECK(rc != -3, "the CUTLASS sm100 GEMM failed to launch");
  TORCH_CHECK(rc != -4, "the CUTLASS sm100 GEMM could not initialize on this GPU (it is built for sm_100a only)");
  TORCH_CHECK(rc == 0, "solrl_nvfp4_gemm_sm100 failed (CUDA error ", rc, ")");
  return d;
}

}  // namespace

// The ops are registered with the dispatcher (TORCH_LIBRARY), not as plain Python functions, so that
// torch.compile sees them as ops with a schema (their fake implementations, for tracing, are in
// solrl_engine/kernels/dispatch.py) and calls them as torch.ops.solrl_C.<name>.
TORCH_LIBRARY(solrl_C, m) {
  m.def("nvfp4_quantize(Tensor x, Tensor? amax, bool swizzle, int stream) -> Tensor[]");
  m.def("nvfp4_gemm_sm100(Tensor a, Tensor sfa, Tensor b, Tensor sfb, Tensor alpha, Tensor? bias, int stream) -> Tensor");
}

TORCH_LIBRARY_IMPL(solrl_C, CUDA, m) {
  m.impl("nvfp4_quantize", &nvfp4_quantize);
  m.impl("nvfp4_gemm_sm100", &nvfp4_gemm_sm100);
}

// Importing solrl_engine._C loads the library and runs the registrations above; it defines nothing else.
PYBIND11_MODULE(_C, m) {
  m.doc() = "solrl-engine CUDA kernels, registered as torch.ops.solrl_C (NVFP4 quantize, CUTLASS sm100 GEMM)";
}
