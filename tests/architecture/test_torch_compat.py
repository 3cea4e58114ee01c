"""What xorl relies on that differs between the torch / triton of the GPU image (torch 2.11, triton
3.6) and of CI (torch 2.13, triton 3.9). scripts/compat_check.sh runs the quick tier under the
image's versions; these tests hold each fix in place under whichever torch runs them."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def test_model_output_tensors_are_pytree_leaves():
    """torch 2.11's FSDP2 registers the pre-backward hook that re-gathers a module's parameters on
    ``tree_flatten(output)``'s grad-requiring tensors. The root model returns a CausalLMOutput: were
    it one opaque leaf, backward would read the root's freed (resharded) parameters."""
    from xorl.models.decoder import CausalLMOutput

    loss = torch.randn((), requires_grad=True) * 2
    router = torch.randn(3, requires_grad=True).sum()
    leaves, _ = tree_flatten(CausalLMOutput(logits=None, loss=loss, loss_sum=loss * 5, router_loss=router,
                                            router_stats={"z_loss": torch.randn(2)}))
    grad_leaves = [t for t in leaves if torch.is_tensor(t) and t.requires_grad]
    assert len(grad_leaves) == 3 and any(t is loss for t in grad_leaves) and any(t is router for t in grad_leaves)


def test_cpu_scaled_mm_row_scales_match_the_formula_either_way():
    """Row / column scales on CPU: torch._scaled_mm itself where it takes them (2.13), else the
    unit-scaled product times the scales (2.11); both the formula in float64."""
    from xorl_kernels.fp8.linear import _scaled_mm
    from xorl_kernels.fp8.quantize import E4M3

    gen = torch.Generator().manual_seed(0)
    qa = (torch.randn(48, 64, generator=gen) * 50).to(E4M3)
    qb = (torch.randn(32, 64, generator=gen) * 50).to(E4M3)
    sa = torch.rand(48, 1, generator=gen) + 0.5
    sb = torch.rand(1, 32, generator=gen) + 0.5
    out = _scaled_mm(qa, qb.t(), sa, sb, torch.float32)
    ref = (qa.double() * sa.double()) @ (qb.double() * sb.double().t()).t()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_zero_bubble_schedules_are_refused_on_a_torch_that_breaks_them(monkeypatch):
    """torch 2.11's zero-bubble weight pass crashes on xorl's custom ops and trains off one process
    (xorl/config/rules/train.py): refused up front there, naming the schedule, the torch and the fix;
    accepted from 2.13. The installed version is read from package metadata (faked here)."""
    import pytest

    import xorl.config.rules.train as rules
    from xorl.config import ConfigError, load_config, validate_config

    config = load_config(None, ["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
                                "--train.pipeline_parallel_schedule=ZBVZeroBubble", "--train.virtual_pipeline_stages=2",
                                "--model.num_hidden_layers=4"])
    monkeypatch.setattr(rules, "installed_torch_text", lambda: "2.11.0+cu130")
    with pytest.raises(ConfigError, match=r"pipeline_parallel_schedule: ZBVZeroBubble with torch 2.11.0\+cu130.*"
                                          r"use 1F1B or Interleaved1F1B"):
        validate_config(config, 2)
    monkeypatch.setattr(rules, "installed_torch_text", lambda: "2.13.0+cpu")
    validate_config(config, 2)
    one_f_one_b = load_config(None, ["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
                                     "--model.num_hidden_layers=4"])
    monkeypatch.setattr(rules, "installed_torch_text", lambda: "2.11.0+cu130")
    validate_config(one_f_one_b, 2)
