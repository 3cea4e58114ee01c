"""xorl's RMSNorm and RoPE through transformers' kernel mapping (the ``kernels`` package's ``kernelize``).

transformers marks the modules a kernel may stand in for: ``@use_kernel_forward_from_hub("RMSNorm")``
on the RMSNorm classes, and ``@use_kernel_forward_from_hub("rotary_pos_emb")`` on the module-level
``apply_rotary_pos_emb``, which ``@use_kernelized_func`` hands each attention instance as a private
wrapper (``attention._kernel_funcs["rotary_pos_emb"]``). ``kernels.kernelize`` with a mapping from
those names to a layer class sets the layer's ``forward`` on the instance it is given and records
the repository in the instance's ``_kernel_repo``; nothing global changes (the mapping is scoped by
``use_kernel_mapping``). xorl's layers come from ``_InProcessRepository`` (kernels' repository
protocol: ``load()`` returns the layer class; no Hub, no download).

One name may cover different formulas ("rotary_pos_emb" is transformers' rotate-half in Llama and
gpt-oss's split halves, with half-width cos / sin, in gpt-oss), so each marked module's code is read
(xorl/hf/forms.py) and the mapping names the layer for that form; a marked module whose code is no
form xorl knows is refused (``XorlApplyError``): the mark promises a kernel may stand in, but xorl's
would change its numbers. Layers follow kernels' rules: no ``__init__``, no members beyond
``forward`` and the ``can_torch_compile`` / ``has_backward`` flags, the marked forward's signature.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from xorl.hf import forms
from xorl_kernels.rmsnorm.op import rms_norm
from xorl_kernels.rope.op import apply_rotary

NORM_MARK, ROPE_MARK = "RMSNorm", "rotary_pos_emb"
DEVICES = ("cpu", "cuda", "rocm")  # where xorl_kernels dispatch runs (the reference on CPU, Triton on GPUs)


class XorlApplyError(ValueError):
    """xorl.hf.apply was asked for something it cannot do exactly on this model."""


class XorlRMSNorm(nn.Module):
    """transformers' Llama-form RMSNorm (``weight * normed.to(input dtype)``) on ``xorl_kernels.rms_norm``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """transformers' q / k [batch, heads, seq, dim] (unsqueeze_dim 1) or [batch, seq, heads, dim] (2)
    on the kernel's [batch, seq, heads, dim]; cos / sin [batch or 1, seq, head_dim]."""
    if unsqueeze_dim not in (1, 2) or cos.dim() != 3:
        raise XorlApplyError(f"xorl's RoPE: unsqueeze_dim={unsqueeze_dim} with cos {tuple(cos.shape)}; it takes "
                             "cos / sin [batch, seq, dim] and q / k with heads at dim 1 or 2")
    if cos.shape[-1] != x.shape[-1]:  # the stock formula would not broadcast either
        raise XorlApplyError(f"xorl's RoPE: cos / sin width {cos.shape[-1]} != head_dim {x.shape[-1]}")
    if unsqueeze_dim == 1:
        return apply_rotary(x.transpose(1, 2), cos, sin).transpose(1, 2)
    return apply_rotary(x, cos, sin)


class XorlRotaryRotateHalf(nn.Module):
    """transformers' ``apply_rotary_pos_emb`` (rotate-half, whole head) on ``xorl_kernels.apply_rotary``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _rotate(q, cos, sin, unsqueeze_dim), _rotate(k, cos, sin, unsqueeze_dim)


class XorlRotaryGptOss(nn.Module):
    """gpt-oss's ``apply_rotary_pos_emb``: halves [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] with cos / sin
    [..., head_dim / 2], which is rotate-half with the tables repeated: the same products and sums."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return _rotate(q, cos, sin, unsqueeze_dim), _rotate(k, cos, sin, unsqueeze_dim)


class _InProcessRepository:
    """kernels' repository protocol for a layer class defined here: ``load()`` returns it."""

    def __init__(self, layer: type[nn.Module]):
        self.layer, self.layer_name = layer, layer.__name__

    def load(self) -> type[nn.Module]:
        return self.layer

    def __eq__(self, other) -> bool:
        return isinstance(other, _InProcessRepository) and other.layer is self.layer

    def __hash__(self) -> int:
        return hash(self.layer)

    def __str__(self) -> str:
        return f"xorl ({self.layer_name})"


def norm_layer_for(cls: type) -> type[nn.Module] | None:
    return XorlRMSNorm if forms.method_form(cls) == forms.NORM_LLAMA else None


def rope_layer_for(kernel_func: nn.Module) -> tuple[type[nn.Module] | None, str]:
    """The layer for a "rotary_pos_emb" wrapper, and the function it wraps (``module.name``).

    kernels makes one wrapper class per decorated function and names it after the function's
    module; the function is the module global whose value is an instance of that class."""
    module_name = type(kernel_func).__module__
    module = sys.modules.get(module_name)
    names = [k for k, v in vars(module).items() if type(v) is type(kernel_func)] if module else []
    if len(names) != 1:
        return None, f"{module_name}.<unknown>"
    name = names[0]
    form = forms.function_form(module_name, name)
    if form == forms.ROPE_ROTATE_HALF and forms.function_form(module_name, "rotate_half") == forms.ROTATE_HALF:
        return XorlRotaryRotateHalf, f"{module_name}.{name}"
    if form == forms.ROPE_GPT_OSS and (forms.function_form(module_name, "_apply_rotary_emb")
                                       == forms.APPLY_ROTARY_EMB_GPT_OSS):
        return XorlRotaryGptOss, f"{module_name}.{name}"
    return None, f"{module_name}.{name}"


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    if param is None or param.device.type in ("cpu", "meta"):
        return "cpu"
    if param.device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    return param.device.type


def marked_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if getattr(type(m), "kernel_layer_name", None) == NORM_MARK]


def marked_rotaries(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(attention module name, its private "rotary_pos_emb" wrapper) for every attention that has one."""
    return [(n, m.__dict__["_kernel_funcs"][ROPE_MARK]) for n, m in model.named_modules()
            if ROPE_MARK in m.__dict__.get("_kernel_funcs", {})]


def _kernelized_state(model: nn.Module) -> dict:
    """What kernelize (ours or transformers') may set: each marked module's and wrapper's instance
    ``forward`` / ``_kernel_repo``, and the model's kernel attributes; absent entries stay absent."""
    keys = ("forward", "_kernel_repo")
    objects = [m for _, m in model.named_modules() if hasattr(type(m), "kernel_layer_name")]
    objects += [f for _, m in model.named_modules() for f in m.__dict__.get("_kernel_funcs", {}).values()]
    state = {id(o): (o, {k: o.__dict__[k] for k in keys if k in o.__dict__}) for o in objects}
    state["model"] = (model, {k: model.__dict__[k] for k in _MODEL_KEYS if k in model.__dict__})
    return state


_MODEL_KEYS = ("kernel_config", "_use_kernels", "_kernels_mode")


def _restore(state: dict) -> None:
    for key, (obj, entries) in state.items():
        for name in _MODEL_KEYS if key == "model" else ("forward", "_kernel_repo"):
            obj.__dict__.pop(name, None)
        obj.__dict__.update(entries)


def kernelize_marked(model: nn.Module, norm: bool, rope: bool, undo: list) -> tuple[list[str], list[str]]:
    """xorl's RMSNorm / RoPE on every module transformers marks "RMSNorm" / "rotary_pos_emb" (the
    module docstring), through one kernel mapping set as the model's ``kernel_config``: transformers
    kernelizes a from_pretrained model again on ``train()`` / ``eval()`` (``use_kernels``) from that
    config, so xorl's layers stay. The mapping holds xorl's layers only (no Hub entries, no download):
    other marked layers run transformers' own code. An unknown form is refused before anything changes."""
    norms = marked_norms(model) if norm else []
    rotaries = marked_rotaries(model) if rope else []
    for name, module in norms:
        if norm_layer_for(type(module)) is None:
            raise XorlApplyError(f"{name} ({type(module).__name__}) carries transformers' RMSNorm kernel mark but "
                                 "computes a formula xorl's rms_norm does not; pass norm=False")
    rope_layers = {}
    for name, func in rotaries:
        layer, where = rope_layer_for(func)
        if layer is None:
            raise XorlApplyError(f"{name}: its rotary_pos_emb kernel mark wraps {where}, a formula xorl's RoPE "
                                 "does not compute; pass rope=False")
        rope_layers[layer] = where
    if len(rope_layers) > 1:  # one name, one layer per mapping
        raise XorlApplyError(f"the model's rotary_pos_emb marks wrap {sorted(rope_layers.values())}, of different "
                             "forms; xorl's kernel mapping takes one per model: pass rope=False")
    mapping = {}
    if norms:
        mapping[NORM_MARK] = {d: _InProcessRepository(XorlRMSNorm) for d in DEVICES}
    if rotaries:
        mapping[ROPE_MARK] = {d: _InProcessRepository(next(iter(rope_layers))) for d in DEVICES}
    if not mapping:  # also where kernels is not installed: transformers then marks nothing
        return [], []
    from kernels import KernelizeFallback, Mode, kernelize, use_kernel_mapping
    from transformers import KernelConfig

    state = _kernelized_state(model)
    undo.append(lambda: _restore(state))
    model.kernel_config = KernelConfig(kernel_mapping=mapping, inherit_mapping=False)
    mode = (Mode.TRAINING if model.training else Mode.INFERENCE) | Mode.TORCH_COMPILE
    # Quiet: kernels warns of every other marked layer (SiLU, ...) that it keeps transformers' code.
    kernels_log = logging.getLogger("kernels._internals.layer.layer")
    level = kernels_log.level
    kernels_log.setLevel(logging.ERROR)
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(model, mode=mode, device=_device_type(model), use_fallback=KernelizeFallback.ALL)
    finally:
        kernels_log.setLevel(level)
    layers = {id(m): XorlRMSNorm for _, m in norms} | {id(f): next(iter(rope_layers)) for _, f in rotaries}
    for name, module in norms + rotaries:  # kernels falls back silently where a mapping does not fit
        bound = module.__dict__.get("forward")
        if getattr(bound, "__func__", None) is not layers[id(module)].forward:
            raise XorlApplyError(f"kernels did not put xorl's layer into {name} (device {_device_type(model)}); "
                                 "pass norm=False / rope=False")
    return [name for name, _ in norms], [name for name, _ in rotaries]
