"""Activation checkpointing modes (train.activation_checkpointing): none, full, selective, full every n.

Each mode must give the losses and gradients of no checkpointing exactly (the same ops on the
same values, recomputed), and trade memory for FLOPs as documented: full recomputes every
checkpointed block's forward; selective keeps matmul and attention outputs and recomputes only
element-wise ops, so it recomputes no matmul FLOPs (FlopCounterMode counts matmuls and attention)
and keeps fewer activation bytes than none but more than full.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from xorl.config import ModelConfig
from xorl.models import build_model
from xorl.plans.data_parallel import apply_activation_checkpointing


class LiveActivations(TorchDispatchMode):
    """Records every op output; ``alive_bytes()`` sums the storages still referenced (kept for backward)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append(weakref.ref(t))
        return out

    def alive_bytes(self) -> int:
        storages = {}
        for ref in self.outputs:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def _model_config(model_type: str) -> ModelConfig:
    m = ModelConfig(model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    if model_type == "qwen3_moe":
        m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size = 4, 2, 32
    return m


def _run(model, ids, labels, cu):
    with LiveActivations() as live:
        out = model(ids, labels=labels, cu_seqlens=cu)
        kept = live.alive_bytes()
    with FlopCounterMode(display=False) as flops:
        out.loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), grads, kept, flops.get_total_flops()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_modes_give_identical_gradients_and_trade_flops_for_memory(model_type):
    torch.manual_seed(0)
    base = build_model(_model_config(model_type))
    with torch.no_grad():  # O(1) activations, so a wrong recompute would show
        for p in base.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    ids = torch.randint(0, 96, (1, 96))
    labels = torch.randint(0, 96, (1, 96))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    runs = {}
    for mode, every in [("none", 1), ("full", 1), ("selective", 1), ("full", 2)]:
        model = copy.deepcopy(base)
        if mode != "none":
            apply_activation_checkpointing(model, mode, every)
        runs[(mode, every)] = _run(model, ids, labels, cu)
    ref_loss, ref_grads, kept_none, flops_none = runs[("none", 1)]
    for key, (loss, grads, _, _) in runs.items():
        assert torch.equal(loss, ref_loss), key
        assert grads.keys() == ref_grads.keys(), key
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), (key, name)
    _, _, kept_full, flops_full = runs[("full", 1)]
    _, _, kept_sel, flops_sel = runs[("selective", 1)]
    _, _, kept_half, flops_half = runs[("full", 2)]
    # Selective recomputes no matmul / attention FLOPs; full recomputes every block's forward.
    assert flops_sel == flops_none < flops_half < flops_full, (flops_none, flops_sel, flops_half, flops_full)
    assert kept_full < kept_half < kept_none and kept_full < kept_sel < kept_none, (
        kept_none, kept_sel, kept_half, kept_full)
