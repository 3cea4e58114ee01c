"""The fused linear cross-entropy inside a stock transformers causal LM, without its logits.

A causal LM's forward runs ``logits = self.lm_head(hidden_states)`` and then
``self.loss_function(logits=logits, labels=labels, vocab_size=..., **kwargs)`` (``num_items_in_batch``,
``ignore_index``, ``shift_labels`` among the kwargs, as HF Trainer passes them). transformers has no
hook between the two that sees the hidden states, so xorl.hf.apply(loss=True) (xorl/hf/instance.py)
acts on the instance at both ends:

- the lm_head's forward, while the model's forward has labels in training, returns ``LazyLogits``:
  a tensor with the logits' shape and dtype and no storage, holding the hidden states and the head;
- the model's ``loss_function`` (its instance setter, ``model.loss_function = fn``; the model's
  ``loss_type`` stays as it was, because HF Trainer reads it to count ``num_items_in_batch`` over the
  shifted labels) is ``causal_lm_loss``: given LazyLogits it calls the head again with the labels, and
  the head returns the summed loss of ``xorl_kernels.fused_linear_cross_entropy`` (chunked: no
  [tokens, vocab] buffer, gradients formed in the forward), divided as transformers' ForCausalLMLoss
  divides (by ``num_items_in_batch`` when given, else by the count of labelled tokens). That second
  call goes through the head module, so FSDP2 (a head sharded on its own) gathers its weight around it.
  Anything else gets ``ForCausalLMLoss`` itself.

Why a lazy tensor rather than ``logits=None`` (Liger's choice): code that reads the logits anyway (TRL's
token accuracy, a user's metric) gets them, computed then by the head's own forward with autograd;
only the loss skips them. Metadata reads (shape, dtype, device, ...) and casts to a dtype (accelerate's
fp32 conversion of outputs) stay lazy.

The head may be a trainable or frozen ``nn.Linear`` (tied to the embeddings or not) or a peft LoRA
``Linear`` around one: the loss then runs on ``W + sum(scaling * B @ A)`` over the active adapters
(``get_delta_weight``), which is the LoRA head's logits' weight, so A and B get their gradients through
it. Refused by name (``check_head``): a bias, LoRA dropout, a LoRA variant (DoRA), any other head type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from xorl.hf.layers import XorlApplyError
from xorl_kernels.fused_linear_ce.op import fused_linear_cross_entropy

_METADATA_PROPERTIES = ("shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn", "layout",
                        "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "grad")
_METADATA = {getattr(torch.Tensor, n).__get__ for n in _METADATA_PROPERTIES} | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor.__len__}


def _lora_linear_type():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # peft is optional
        return None
    return Linear


def check_head(head: nn.Module) -> None:
    """Refuses a head whose logits are not ``hidden @ weight^T`` for a weight ``head_weight`` forms."""
    lora = _lora_linear_type()
    if lora is not None and isinstance(head, lora):
        base = head.base_layer
        if type(base) is not nn.Linear or base.bias is not None:
            raise XorlApplyError(f"the fused loss needs the LoRA lm_head's base to be a bias-free nn.Linear, got "
                                 f"{type(base).__name__} (bias={base.bias is not None}); pass loss=False")
        for name in head.lora_A:
            if name in getattr(head, "lora_variant", {}):
                raise XorlApplyError(f"the fused loss cannot fold the LoRA variant of adapter {name!r} "
                                     f"({type(head.lora_variant[name]).__name__}) into one weight; pass loss=False")
            dropout = head.lora_dropout[name]
            if not isinstance(dropout, nn.Identity) and not (isinstance(dropout, nn.Dropout) and dropout.p == 0):
                raise XorlApplyError(f"the fused loss cannot fold LoRA dropout ({dropout}) on the lm_head into "
                                     "one weight; set lora_dropout=0 or pass loss=False")
        return
    if type(head) is not nn.Linear:
        raise XorlApplyError(f"the fused loss runs on an nn.Linear lm_head or a peft LoRA one, got "
                             f"{type(head).__name__}; pass loss=False")
    if head.bias is not None:
        raise XorlApplyError("the fused loss has no lm_head bias term; pass loss=False")


def head_weight(head: nn.Module) -> torch.Tensor:
    """The [vocab, hidden] weight whose product with the hidden states is the head's logits."""
    lora = _lora_linear_type()
    if lora is None or not isinstance(head, lora):
        return head.weight
    weight = head.base_layer.weight
    if head.disable_adapters or head.merged:
        return weight
    for name in head.active_adapters:
        if name in head.lora_A:
            weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight


def head_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed cross-entropy of the head's logits of ``hidden`` [tokens, H] against ``labels`` [tokens]."""
    weight = head_weight(head)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # as F.linear under autocast: both in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index)


def _vocab(head: nn.Module) -> int:
    return head.out_features if hasattr(head, "out_features") else head.base_layer.out_features


class LazyLogits(torch.Tensor):
    """The lm_head's logits of ``hidden``, not computed: the shape, dtype and device alone.

    Any torch operation on it other than a metadata read or a cast to a dtype computes the logits
    first (``head(hidden)``, the head's own forward, with autograd) and runs on them: reading them
    costs what the stock model costs, and is correct."""

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, head: nn.Module, dtype: torch.dtype | None = None):
        shape = (*hidden.shape[:-1], _vocab(head))
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or hidden.dtype, device=hidden.device)

    def __init__(self, hidden: torch.Tensor, head: nn.Module, dtype: torch.dtype | None = None):
        self.hidden, self.head = hidden, head

    def materialize(self) -> torch.Tensor:
        logits = self.head(self.hidden, xorl_logits=True)
        with torch._C.DisableTorchFunctionSubclass():
            dtype = torch.Tensor.dtype.__get__(self)
        return logits if logits.dtype == dtype else logits.to(dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        cast = _cast_only(func, args, kwargs)
        if cast is not None:
            return LazyLogits(args[0].hidden, args[0].head, dtype=cast)
        args, kwargs = tree_map_only(LazyLogits, LazyLogits.materialize, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Below autograd: computing the logits here would cut them off the graph. Every op is met in
        # __torch_function__ first; one that gets here was called with torch functions disabled.
        raise RuntimeError(f"LazyLogits reached {func} with torch functions disabled; read the logits "
                           "as a tensor first (e.g. logits.materialize())")

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _cast_only(func, args, kwargs) -> torch.dtype | None:
    """The dtype of ``t.float()`` / ``t.to(dtype)`` on one LazyLogits; None for anything else."""
    if not args or not isinstance(args[0], LazyLogits):
        return None
    if func is torch.Tensor.float and len(args) == 1 and not kwargs:
        return torch.float32
    if func is torch.Tensor.to:
        if len(args) == 2 and not kwargs:
            dtype = args[1]
        else:
            dtype = kwargs.get("dtype") if len(args) == 1 and set(kwargs) == {"dtype"} else None
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, **kwargs) -> torch.Tensor:
    """transformers' ForCausalLMLoss, fused where the logits are LazyLogits (see the module docstring)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if type(logits) is not LazyLogits:
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                               ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden = logits.hidden
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    total = logits.head(hidden, xorl_loss=(shift_labels, ignore_index))
    if num_items_in_batch is None:
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
