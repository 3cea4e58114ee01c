"""``attn_implementation`` -> the kernels that compute attention: the one place that maps the name.

Each name picks two kernels, and the package it needs:

- ``local``: ``LocalAttention``'s backend (xorl/models/attention.py), attention on one device;
- ``ring_step``: ``RingAttention``'s ``attn_backend`` (xorl/nn/ring_attention.py), the kernel of
  each zig-zag ring step. Under context parallelism every attention goes through it (Ulysses alone
  runs a ring of size 1 on the gathered sequence), so it must return the log-sum-exp that merges
  the steps;
- ``package``: a pip package the kernels import, checked before any process group starts
  (xorl/config_rules.py).

=============================  ===========================================  =========================
name                           local                                        ring step
=============================  ===========================================  =========================
``xorl`` (the default)         xorl_kernels.flash_attn (Triton on GPU,      xorl_kernels dispatch
                               its torch reference on CPU)
``sdpa``, ``eager``, ``torch`` torch SDPA                                   xorl_kernels dispatch:
                                                                            SDPA returns no
                                                                            log-sum-exp
``flash_attn``,                the flash-attn package                       the flash-attn package
``flash_attention_2``
``auto`` (or unset)            xorl on CUDA tensors, SDPA on CPU            xorl_kernels dispatch
=============================  ===========================================  =========================

(``sdpa``, ``eager``, ``flash_attention_2``: the names transformers uses, so a model folder's
setting means the same here.) No torch import: the config rules read this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionBackend:
    local: str  # LocalAttention(backend=...): "auto", "torch", "xorl" or "flash_attn"
    ring_step: str | None  # RingAttention(attn_backend=...): None (xorl_kernels dispatch) or "flash_attn"
    package: str | None = None  # the pip package the kernels import


_XORL = AttentionBackend(local="xorl", ring_step=None)
_SDPA = AttentionBackend(local="torch", ring_step=None)
_FLASH_ATTN = AttentionBackend(local="flash_attn", ring_step="flash_attn", package="flash_attn")

ATTENTION_BACKENDS: dict[str | None, AttentionBackend] = {
    "xorl": _XORL,
    "sdpa": _SDPA,
    "eager": _SDPA,
    "torch": _SDPA,
    "flash_attn": _FLASH_ATTN,
    "flash_attention_2": _FLASH_ATTN,
    "auto": AttentionBackend(local="auto", ring_step=None),
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
