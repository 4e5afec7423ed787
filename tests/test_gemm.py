"""``fastdp.ops.gemm_tn``, the clipped sums' GEMM: ``x^T y`` by oneDNN's linear on CPU in float32, else torch.mm."""

from __future__ import annotations

import pytest
import torch

from fastdp._precision import exact_fp32
from fastdp.ops import gemm, gemm_tn


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 3, 5), (2048, 512, 192), (4096, 10, 128), (33, 1, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gemm_tn_is_x_transposed_times_y(shape, dtype):
    n, p, d = shape
    gen = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, p, generator=gen, dtype=dtype), torch.randn(n, d, generator=gen, dtype=dtype)
    exact = x.double().t() @ y.double()
    got = gemm_tn(x, y)
    assert got.dtype == dtype and got.shape == (p, d)
    # float32 rounding of a length-n dot product: within gamma_n of the sum of |terms|
    bound = n * torch.finfo(dtype).eps * (x.double().abs().t() @ y.double().abs())
    assert ((got.double() - exact).abs() <= bound).all()


def test_gemm_tn_takes_onednn_on_cpu_float32_unless_switched_off(monkeypatch):
    if not gemm._onednn_linear_works():
        pytest.skip("torch's oneDNN linear is not available here")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(gemm, "_linear", lambda *args: calls.append(1) or real(*args))
    x, y = torch.randn(64, 8), torch.randn(64, 5)
    gemm_tn(x, y)
    gemm_tn(x.double(), y.double())
    assert calls == [1]
    torch.backends.mkldnn.enabled = False
    try:
        torch.testing.assert_close(gemm_tn(x, y), x.t() @ y)
    finally:
        torch.backends.mkldnn.enabled = True
    assert calls == [1]


def test_gemm_tn_is_ieee_float32_inside_exact_fp32():
    """A reduced oneDNN matmul precision (bfloat16 passes) does not reach the clipped sums' GEMM inside exact_fp32."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2048, 512, generator=gen), torch.randn(2048, 192, generator=gen)
    want = gemm_tn(x, y)
    torch.set_float32_matmul_precision("medium")
    try:
        with exact_fp32():
            got = gemm_tn(x, y)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert torch.equal(got, want)
