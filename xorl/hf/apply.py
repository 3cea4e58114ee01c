"""``xorl.hf.apply(model, ...)``: xorl's other kernels in one loaded stock transformers model, reversibly.

    import xorl.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="xorl", experts_implementation="xorl")
    patches = xorl.hf.apply(model, norm=True, rope=True, mlp=True, loss=True, fp8=None)
    ...                       # train with HF Trainer, TRL, accelerate or a plain loop
    xorl.hf.remove(model)     # or patches.remove(): the model is as it was loaded, bit for bit

What each switch puts in, and through which hook (xorl/hf/layers.py: transformers' kernel mapping;
xorl/hf/instance.py: the instance, where transformers marks nothing):

- ``norm``: xorl_kernels.rms_norm in every RMSNorm (the kernel mapping for the classes marked
  "RMSNorm", the instance for gpt-oss's unmarked one), and the residual add fused into each pre-norm
  block's second norm (the decoder layer's forward on the instance).
- ``rope``: xorl_kernels.apply_rotary in each attention's "rotary_pos_emb" wrapper (the kernel
  mapping). Attention classes that call their RoPE function directly (GLM-4.5, DeepSeek-V2/V3) have
  no hook and are left stock (listed in ``patches.skipped``).
- ``mlp``: xorl_kernels.swiglu in every gated SiLU MLP (dense layers, shared experts; the instance).
  Routed experts get theirs from ``experts_implementation="xorl"``.
- ``loss``: xorl_kernels.fused_linear_cross_entropy as the causal LM's loss, never forming the
  [tokens, vocab] logits in training (xorl/hf/loss.py says how and why); ``num_items_in_batch`` divides
  as transformers' ForCausalLMLoss does, so gradient accumulation under HF Trainer is unchanged; a
  trainable, tied or peft LoRA lm_head gets its gradients; under FSDP2 the head's weight is gathered.
- ``fp8="tensorwise" | "rowwise" | "blockwise"``: ``nn.Linear`` children become xorl's FP8 Linear
  (same parameters), chosen by ``fp8_filter(module, fqn)`` (default: not the lm_head, not a router,
  dims divisible by 16), as torchao's ``convert_to_float8_training``. Apply before FSDP / accelerate wrap.

Every kernel stands in only for code it computes exactly (xorl/hf/forms.py reads transformers' own
source); a module transformers marks for a kernel but whose formula xorl's does not compute (and an
unmarked RMSNorm of another form, like Gemma's ``1 + weight``) is refused with ``XorlApplyError``, and a
refusal leaves the model as it was. What is left stock for want of a hook is in ``patches.skipped``.
On a peft model, pass it or its base model: the patches go on the transformers model inside.
"""

from __future__ import annotations

import weakref

from torch import nn

from xorl.hf.instance import patch_decoder_layers, patch_loss, patch_mlps, patch_unmarked_norms, swap_fp8_linears
from xorl.hf.layers import XorlApplyError, kernelize_marked, marked_rotaries

_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transformers model -> its XorlPatches


class XorlPatches:
    """What ``apply`` put into one model: ``applied`` (kind -> module names), ``skipped`` (module name ->
    why it was left stock), and ``remove()``."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self.applied: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}
        self._undo: list = []

    def remove(self) -> None:
        """Undo every patch, last first; the model's modules are then as they were before ``apply``."""
        while self._undo:
            self._undo.pop()()
        model = self._model()
        if model is not None and _APPLIED.get(model) is self:
            del _APPLIED[model]

    def __repr__(self) -> str:
        done = ", ".join(f"{kind}: {len(names)}" for kind, names in self.applied.items())
        return f"XorlPatches({done}; {len(self.skipped)} left stock)"


def _transformers_model(model: nn.Module) -> nn.Module:
    """A peft model's transformers model (``get_base_model``), else the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply(model: nn.Module, *, norm: bool = True, rope: bool = True, mlp: bool = True, loss: bool = True,
          fp8: str | None = None, fp8_filter=None) -> XorlPatches:
    """Put xorl's kernels into ``model``; see the module docstring. Returns the patches (``.remove()``)."""
    target = _transformers_model(model)
    if target in _APPLIED:
        raise XorlApplyError("xorl.hf.apply already ran on this model; xorl.hf.remove(model) first")
    patches = XorlPatches(target)
    undo, skipped = patches._undo, patches.skipped
    try:
        if fp8 is not None:
            patches.applied["fp8"] = swap_fp8_linears(target, fp8, fp8_filter, undo)
        marked_norms, patches.applied["rope"] = kernelize_marked(target, norm, rope, undo)
        if norm:
            patches.applied["norm"] = marked_norms + patch_unmarked_norms(target, undo)
        if rope:
            hooked = {name for name, _ in marked_rotaries(target)}
            for name, module in target.named_modules():
                if type(module).__name__.endswith("Attention") and name not in hooked:
                    skipped[name] = (f"transformers gives {type(module).__name__} no rotary kernel hook (it calls its "
                                     "RoPE function directly): RoPE left stock")
        if mlp:
            patches.applied["mlp"] = patch_mlps(target, undo, skipped)
        if norm:
            patches.applied["residual_add"] = patch_decoder_layers(target, undo, skipped)
        if loss:
            patches.applied["loss"] = [patch_loss(target, undo)]
    except BaseException:
        patches.remove()
        raise
    _APPLIED[target] = patches
    return patches


def remove(model: nn.Module) -> None:
    """Undo ``apply`` on ``model`` (or its peft wrapper); an error if it holds no xorl patches."""
    patches = _APPLIED.get(_transformers_model(model))
    if patches is None:
        raise XorlApplyError("this model holds no xorl.hf.apply patches")
    patches.remove()
