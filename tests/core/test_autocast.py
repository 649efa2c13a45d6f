"""The core computes in fp32 accumulation whatever autocast region it is called from: under CPU autocast to
bf16 the CPU path's scores and gradients match the float64 reference to fp32 accuracy."""

import pytest
import torch

import flash_maxsim
from flash_maxsim.ops import force_backend


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_cpu_path_ignores_autocast_forward_and_backward(smooth_tau):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 8, 64, generator=g, requires_grad=True)
    d = torch.randn(5, 20, 64, generator=g, requires_grad=True)
    q64 = q.detach().double().requires_grad_()
    d64 = d.detach().double().requires_grad_()
    want = flash_maxsim.reference.maxsim(q64, d64, smooth_tau=smooth_tau)
    with force_backend("torch"), torch.autocast("cpu", dtype=torch.bfloat16):
        got = flash_maxsim.maxsim(q, d, smooth_tau=smooth_tau)
        got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(d.grad.double(), d64.grad, rtol=1e-4, atol=1e-4)
