"""OLMoE's width q/k RMSNorm on a tensor-parallel shard of the heads (xorl/nn/tp_norms.py
``WidthRMSNormOverTP``, built from the model's ``RMSNorm`` over the whole width): each of 2 gloo
ranks holds a contiguous block of the width and its block of the weight; outputs and the gradients
of input and weight must be the unsharded norm's blocks.

Reference: the norm written out in float64 plain torch on the whole width (y = w x / sqrt(mean(x^2)
+ eps)), differentiated by autograd; fresh random x, weight and upstream gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def sharded_width_norm_check(width: int, dtype_name: str, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from xorl.nn.rms_norm import RMSNorm
    from xorl.nn.tp_comm import TPGroup
    from xorl.nn.tp_norms import WidthRMSNormOverTP

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)  # the same numbers on every rank
    x = torch.randn(2, 5, width, generator=gen, dtype=torch.float64) * 3
    weight = torch.randn(width, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 5, width, generator=gen, dtype=torch.float64)
    eps = 1e-6

    # Reference: the whole width, float64.
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y_ref = w_ref * (x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + eps))
    (y_ref * dy).sum().backward()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    tp = TPGroup.from_mesh(mesh)
    whole_norm = RMSNorm(width, eps=eps).to(dtype)
    with torch.no_grad():
        whole_norm.weight.copy_(weight.to(dtype))
    norm = WidthRMSNormOverTP.from_norm(whole_norm, mesh, name="q_norm")
    assert isinstance(norm.weight, DTensor) and norm.weight.placements == (Shard(0),)
    assert tuple(norm.weight.shape) == (width,)
    block = slice(tp.rank * width // tp.size, (tp.rank + 1) * width // tp.size)
    x_local = x[..., block].to(dtype).clone().requires_grad_()
    y_local = norm(x_local)
    (y_local * dy[..., block].to(dtype)).sum().backward()
    from xorl.nn.tp_comm import overlap_report

    # One all-reduce of the [rows, 1] sums of squares forward, one of the cross term backward.
    assert overlap_report(norm)["q_norm"]["collectives"] == 2
    out = {
        "y": _rel(y_local, y_ref[..., block].detach()),
        "dx": _rel(x_local.grad, x_ref.grad[..., block]),
        "dw": _rel(norm.weight.grad.to_local(), w_ref.grad[block]),
        "dw_full": _rel(norm.weight.grad.full_tensor(), w_ref.grad),
    }
    # fp32: the sharded path against the unsharded module (the fused rms_norm op) on the same numbers.
    if dtype == torch.float32:
        whole = RMSNorm(width, eps=eps)
        with torch.no_grad():
            whole.weight.copy_(weight.float())
        out["vs_unsharded_fp32"] = _rel(y_local, whole(x.float())[..., block].detach())
    return out


def test_sharded_width_norm_matches_the_whole_width_in_float64(gloo_world):
    results = gloo_world(2).run(sharded_width_norm_check, 24, "float64", 3)
    for rank, res in enumerate(results):
        for key, err in res.items():
            assert err <= 1e-12, (rank, key, err)


def test_sharded_width_norm_fp32_matches_the_unsharded_op(gloo_world):
    results = gloo_world(2).run(sharded_width_norm_check, 32, "float32", 4)
    for rank, res in enumerate(results):
        for key, err in res.items():
            assert err <= 1e-6, (rank, key, err)
