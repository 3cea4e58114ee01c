"""``attn_implementation`` -> the kernels that compute attention: the one place that maps the name.

One vocabulary for the attention kernels, here and in the modules that take them:
``"xorl"`` is xorl_kernels.flash_attn (which picks its own op backend, triton / torch_cpu / reference,
in xorl_kernels/dispatch.py: the only other backend names, one level down), ``"sdpa"`` is torch's
scaled_dot_product_attention, ``"flash_attn"`` is the flash-attn pip package, and ``"auto"``
(LocalAttention only) is xorl on CUDA tensors, SDPA on CPU.

Each name picks two kernels, and the package it needs:

- ``local``: ``LocalAttention``'s backend (xorl/models/attention.py), attention on one device;
- ``ring_step``: ``RingAttention``'s ``attn_backend`` (xorl/nn/ring_attention.py), the kernel of
  each zig-zag ring step. Under context parallelism every attention goes through it (Ulysses alone
  runs a ring of size 1 on the gathered sequence), so it must return the log-sum-exp that merges
  the steps;
- ``package``: a pip package the kernels import, checked before any process group starts
  (xorl/config/validate.py).

=============================  ===========================================  =========================
name                           local                                        ring step
=============================  ===========================================  =========================
``xorl`` (the default)         ``xorl``: xorl_kernels.flash_attn (Triton    ``xorl``
                               on GPU, torch's CPU flash kernel on CPU)
``sdpa``, ``eager``, ``torch`` ``sdpa``: torch SDPA                         ``xorl``: SDPA returns no
                                                                            log-sum-exp
``flash_attn``,                ``flash_attn``: the flash-attn package       ``flash_attn``
``flash_attention_2``
``auto`` (or unset)            ``auto``: xorl on CUDA tensors, SDPA on CPU  ``xorl``
=============================  ===========================================  =========================

(``sdpa``, ``eager``, ``flash_attention_2``: the names transformers uses, so a model folder's
setting means the same here.) No torch import: the config rules read this table.

Attention sinks, sliding windows and head_dim_v != head_dim_qk (per call: ``sinks=``, ``window=``):
``xorl`` runs all three in its kernels, locally and in every ring step (the ring applies the
sinks once after merging its steps); ``sdpa`` runs d_v natively and windows in its mask, and with
sinks writes the softmax out in plain torch (SDPA has no sink input); the flash-attn package is
not wired for sinks or windows (LocalAttention and RingAttention refuse them, config_rules
refuses the combination before start).
"""

from __future__ import annotations

from dataclasses import dataclass

XORL, SDPA, FLASH_ATTN, AUTO = "xorl", "sdpa", "flash_attn", "auto"
LOCAL_KERNELS = (AUTO, SDPA, XORL, FLASH_ATTN)  # LocalAttention(backend=...)
RING_STEP_KERNELS = (XORL, FLASH_ATTN)  # RingAttention(attn_backend=...): the step must return its lse


@dataclass(frozen=True)
class AttentionBackend:
    local: str  # one of LOCAL_KERNELS
    ring_step: str  # one of RING_STEP_KERNELS
    package: str | None = None  # the pip package the kernels import


_XORL = AttentionBackend(local=XORL, ring_step=XORL)
_SDPA = AttentionBackend(local=SDPA, ring_step=XORL)
_FLASH_ATTN = AttentionBackend(local=FLASH_ATTN, ring_step=FLASH_ATTN, package="flash_attn")

ATTENTION_BACKENDS: dict[str | None, AttentionBackend] = {
    "xorl": _XORL,
    "sdpa": _SDPA,
    "eager": _SDPA,
    "torch": _SDPA,
    "flash_attn": _FLASH_ATTN,
    "flash_attention_2": _FLASH_ATTN,
    "auto": AttentionBackend(local=AUTO, ring_step=XORL),
}
ATTENTION_BACKENDS[None] = ATTENTION_BACKENDS["auto"]


def attention_backend(name: str | None) -> AttentionBackend:
    """The kernels ``attn_implementation=name`` selects; ValueError naming the known names."""
    try:
        return ATTENTION_BACKENDS[name]
    except (KeyError, TypeError):
        known = sorted(k for k in ATTENTION_BACKENDS if k)
        raise ValueError(f"attn_implementation={name!r} is not known; use one of {known}") from None


def missing_package(name: str | None) -> str | None:
    """The pip package ``name`` needs when it is not installed here, else None."""
    import importlib.util

    package = attention_backend(name).package
    return package if package is not None and importlib.util.find_spec(package) is None else None
