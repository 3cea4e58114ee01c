"""Activation checkpointing modes (train.activation_checkpointing): none, full, selective, full every n.

Each mode must give the losses and gradients of no checkpointing exactly (the same ops on the
same values, recomputed), and trade memory for FLOPs as documented: full recomputes every
checkpointed block's forward; selective keeps matmul and attention outputs and recomputes only
element-wise ops, so it recomputes no matmul FLOPs (FlopCounterMode counts matmuls and attention)
and keeps fewer activation bytes than none but more than full. selective_checkpoint:
every_other_matmul (torchtitan's op SAC) keeps every other dense matmul's output: its cache holds
exactly those (and the planner's term is their bytes), with the same losses and gradients.
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
from xorl.parallel.activation_checkpointing import apply_activation_checkpointing


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


class _SavedOutputs:
    """Each checkpointed block call's selective-checkpoint cache (torch's SAC storage: op -> saved
    outputs in call order), captured by wrapping create_selective_checkpoint_contexts."""

    def __init__(self):
        self.storages: list[dict] = []

    def wrap(self, create):
        def contexts(policy):
            forward, recompute = create(policy)
            self.storages.append(forward.storage)
            return forward, recompute
        return contexts

    @staticmethod
    def entries(per_op) -> list:
        """One op's saved outputs in call order. torch 2.13 keeps a dict (call index -> outputs or a
        recompute marker); torch 2.11 (the GPU image) a list of the kept outputs alone."""
        return list(per_op.values()) if isinstance(per_op, dict) else list(per_op)

    @staticmethod
    def tensors(outputs) -> list[torch.Tensor]:
        from torch.utils._pytree import tree_leaves

        leaves = tree_leaves(outputs, is_leaf=lambda x: hasattr(x, "val"))
        leaves = [getattr(x, "val", x) for x in leaves]
        return [t for t in tree_leaves(leaves) if isinstance(t, torch.Tensor)]

    def matmul_widths(self, storage: dict) -> list[int]:
        """The kept dense-matmul outputs' widths, in the order the block ran them."""
        import xorl_kernels.fp8.linear  # noqa: F401  (registers xorl::fp8_linear)

        aten = torch.ops.aten
        outs = [(op, t) for op in (torch.ops.xorl.fp8_linear.default, aten.mm.default, aten.addmm.default)
                for out in self.entries(storage.get(op, {})) for t in self.tensors(out)]
        # each op in call order; a block runs its FP8 projections (FP8 runs) before its plain matmuls
        # (the router), and uses one of mm / addmm
        return [t.shape[-1] for _, t in outs]

    def kept_bytes(self, storage: dict) -> int:
        return sum(t.numel() * t.element_size() for out in storage.values() for saved in self.entries(out)
                   for t in self.tensors(saved))


@pytest.mark.parametrize("model_type,fp8", [("llama", "none"), ("qwen3_moe", "none"), ("llama", "rowwise"),
                                            ("qwen3_moe", "blockwise")])
def test_every_other_matmul_keeps_the_odd_matmuls_and_the_gradients(model_type, fp8, monkeypatch):
    # selective_checkpoint: every_other_matmul (torchtitan's op SAC, mm_count % 2): of a Llama block's
    # q, k, v, o, gate, up, down it keeps q, v, gate and down; of a Qwen3-MoE block's q, k, v, o and
    # router it keeps q, v and the router (the experts' grouped GEMMs are always kept). The cache
    # holds exactly those outputs, the planner's term (xorl/planner/activations.py) is their bytes to
    # the byte, and losses and gradients equal no checkpointing's exactly. With train.fp8 the same:
    # each FP8 projection is one op (xorl::fp8_linear) kept and counted as the matmul it replaces, the
    # blockwise experts' FP8 grouped GEMM kept as the bf16 one is.
    import torch.utils.checkpoint as torch_checkpoint

    from xorl.models.spec import ModelSpec
    from xorl.planner.activations import activation_bytes_per_token, selective_bytes_per_token

    torch.manual_seed(1)
    config = _model_config(model_type)
    base = build_model(config, fp8=fp8)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    ids, labels = torch.randint(0, 96, (1, 96)), torch.randint(0, 96, (1, 96))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    ref_loss, ref_grads, _, _ = _run(copy.deepcopy(base), ids, labels, cu)
    saved = _SavedOutputs()
    monkeypatch.setattr(torch_checkpoint, "create_selective_checkpoint_contexts",
                        saved.wrap(torch_checkpoint.create_selective_checkpoint_contexts))
    results = {}
    for policy in ("matmuls", "every_other_matmul"):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, "selective", 1, policy)
        saved.storages.clear()
        out = model(ids, labels=labels, cu_seqlens=cu)
        storages = list(saved.storages)
        assert len(storages) == config.num_hidden_layers
        results[policy] = ([saved.matmul_widths(s) for s in storages], [saved.kept_bytes(s) for s in storages])
        out.loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        assert torch.equal(out.loss.detach(), ref_loss), policy
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), (policy, name)
    spec = ModelSpec.from_config(config)
    h, hq, hkv, inter = 32, 32, 16, 64
    moe = model_type == "qwen3_moe"
    every_matmul = [hq, hkv, hkv, h] + ([spec.num_experts] if moe else [inter, inter, h])
    assert results["matmuls"][0] == [every_matmul] * 4
    assert results["every_other_matmul"][0] == [every_matmul[0::2]] * 4
    # The planner: the cache plus the block's input (which the checkpoint holds); the recomputed
    # outputs' bytes are the difference between the two policies.
    t, a = 96, 4
    dropped = 4 * t * sum(every_matmul[1::2])
    for matmuls, every_other in zip(*(results[p][1] for p in ("matmuls", "every_other_matmul"))):
        assert matmuls - every_other == dropped
        assert matmuls + a * h * t == selective_bytes_per_token(spec, moe, a, 1, False) * t
        predicted = selective_bytes_per_token(spec, moe, a, 1, False, every_other=True) * t
        assert every_other + a * h * t == predicted, (every_other + a * h * t, predicted)
        assert every_other < activation_bytes_per_token(spec, moe, a, 1, False) * t


def test_selective_checkpoint_without_selective_is_refused():
    from xorl.config import Config
    from xorl.config.errors import ConfigError

    def config(mode):
        return Config.from_dict({"model": {"model_type": "llama", "vocab_size": 272, "hidden_size": 32,
                                           "intermediate_size": 64, "num_hidden_layers": 2,
                                           "num_attention_heads": 4, "num_key_value_heads": 2},
                                 "train": {"activation_checkpointing": mode,
                                           "selective_checkpoint": "every_other_matmul"}})

    config("selective").validate(1)
    with pytest.raises(ConfigError, match="train.selective_checkpoint='every_other_matmul' applies to"):
        config("full").validate(1)
