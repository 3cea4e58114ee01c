"""Test helper: context-parallel attention as a `transformers` attention implementation ("xorl_cp").

It lived in xorl/nn/hf_attention.py as a drop-in for stock transformers models, but only tests
reached it (with a process-wide registry of groups), so the drop-in was removed from the library;
tests/multirank/test_context_parallel.py keeps it to check xorl's ContextParallelAttention against a
transformers Llama computed by transformers' own code.

    register_xorl_attention(ring_group, ulysses_group)            # once per process, before building
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="xorl_cp")
    batch = prepare_context_parallel_batch(ids, cu_seqlens=cu, ring=ring_group, ulysses=ulysses_group)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                   cu_seq_lens_q=batch.cu_seqlens, max_length_q=batch.max_seqlen).logits

The model then sees only this rank's zig-zag shard of the tokens (and their true position ids,
so RoPE is right); attention runs ContextParallelAttention over the registered groups. Packed
documents: pass the GLOBAL boundaries as ``cu_seq_lens_q`` (the kwarg transformers forwards to
attention functions; ``cu_seq_lens_k`` must equal it if given) and ``max_length_q``. No attention
mask is built for this implementation (it is not in transformers' mask registry), so padding must
be expressed as documents/padding by ``prepare_context_parallel_batch``, not as a 2-D mask.
"""

from __future__ import annotations

import torch

from xorl.nn.ulysses_attention import ContextParallelAttention

ATTN_IMPLEMENTATION = "xorl_cp"
_REGISTERED: dict[str, tuple] = {}  # name -> (ring_group, ulysses_group, ring_options)


def xorl_cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature: q [b, hq, s, d], k/v [b, hkv, s, d] -> ([b, s, hq, d], None)."""
    name = kwargs.get("attn_implementation_name", ATTN_IMPLEMENTATION)
    if name not in _REGISTERED:
        raise RuntimeError(f"call tests.support.hf_cp_attention.register_xorl_attention(...) before using {name!r}")
    if dropout:
        raise ValueError(f"{name} does not implement attention dropout (got dropout={dropout}); set it to 0")
    if attention_mask is not None:
        raise ValueError(
            f"{name} takes no attention_mask: give packed-document boundaries as cu_seq_lens_q (global) "
            "and pad with prepare_context_parallel_batch"
        )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_k is not None and (cu_q is None or not torch.equal(torch.as_tensor(cu_q), torch.as_tensor(cu_k))):
        raise ValueError(f"{name} is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    ring_group, ulysses_group, options = _REGISTERED[name]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    attention = ContextParallelAttention(
        ring_group, ulysses_group, **{"causal": causal, "softmax_scale": scaling, **options}
    )
    out = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        cu_seqlens=cu_q, max_seqlen=kwargs.get("max_length_q"),
    )  # fmt: skip
    return out, None


def register_xorl_attention(ring_group=None, ulysses_group=None, name: str = ATTN_IMPLEMENTATION,
                            **ring_options) -> str:
    """Register ``name`` with transformers' AttentionInterface, bound to these CP groups.

    ``ring_options`` go to RingAttention (``dkv_comm_dtype``, ``attn_backend``). Re-registering the
    same name rebinds the groups. Returns the name to pass as ``attn_implementation``.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as error:  # transformers < 4.48 has no AttentionInterface
        raise ImportError(
            "register_xorl_attention needs transformers >= 4.48 (AttentionInterface); upgrade transformers"
        ) from error

    _REGISTERED[name] = (ring_group, ulysses_group, ring_options)
    if name == ATTN_IMPLEMENTATION:
        AttentionInterface.register(name, xorl_cp_attention_forward)
    else:

        def forward(*args, **kwargs):
            return xorl_cp_attention_forward(*args, attn_implementation_name=name, **kwargs)

        AttentionInterface.register(name, forward)
    return name
