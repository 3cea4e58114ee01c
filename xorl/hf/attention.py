"""``attn_implementation="xorl"``: transformers' attention calls on xorl's flash attention.

transformers 5 calls ``fn(module, query, key, value, attention_mask, **kwargs) -> (out, None)`` for
every attention layer of a model loaded with ``attn_implementation="xorl"`` (its
``AttentionInterface``), with query [batch, heads_q, seq_q, head_dim] and key / value
[batch, heads_kv, seq_k, head_dim(_v)]; the output goes back as [batch, seq_q, heads_q, head_dim_v].
This function maps what the layer passes onto ``xorl_kernels.flash_attn``:

- GQA / MQA as they come (the kernel reads key head h // (heads_q / heads_kv)); d_qk != d_v (MLA);
- ``scaling`` -> the softmax scale; ``sliding_window`` -> ``window`` (the same convention:
  the last W keys, the query's own included); ``s_aux`` (gpt-oss's per-head sinks) -> ``sinks``;
- packed documents, as transformers' flash-attention path reads them: ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (``DataCollatorWithFlattening(
  return_flash_attn_kwargs=True)``), else ``position_ids`` that restart inside a row
  (``DataCollatorWithFlattening()``): each document attends only to itself;
- a padding mask: the model builds it with transformers' flash-attention mask function (the
  2-D [batch, kv] mask, or None when nothing is padded; registered for "xorl" in xorl/hf/__init__.py),
  and padded tokens are left out (their outputs are zero);
- a KV cache (generation): the queries sit at the end of the keys (bottom-right causal).

What it cannot honour is refused with one error naming it, never dropped: attention dropout in
training, a logit soft-cap, a 4-D (custom) mask, ``output_attentions``.
"""

from __future__ import annotations

import torch

from xorl_kernels.attention.op import flash_attn


class XorlAttentionError(ValueError):
    """A transformers attention call that attn_implementation="xorl" cannot compute exactly."""


def _refuse(module, what: str, fix: str) -> None:
    name = type(module).__name__
    raise XorlAttentionError(f'attn_implementation="xorl" ({name}): {what}; {fix}')


def check_attention_call(module, dropout: float, softcap: float | None, kwargs: dict) -> None:
    """Refuse what no xorl attention computes (here and under context parallelism)."""
    if dropout and module.training:
        _refuse(module, f"attention dropout {dropout} is not implemented by xorl's kernels",
                "set the config's attention_dropout to 0.0 (the usual fine-tuning value), or use sdpa")
    if softcap is not None:
        _refuse(module, f"a logit soft-cap ({softcap}) is not implemented", "use eager or sdpa for this model")
    if kwargs.get("output_attentions"):
        _refuse(module, "output_attentions=True needs the attention weights, which flash attention never forms",
                "use attn_implementation='eager' to read them")


def xorl_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    check_attention_call(module, dropout, softcap, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    q = query.transpose(1, 2)  # [batch, seq, heads, dim]: the kernel's layout
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if sliding_window is not None and not causal:
        _refuse(module, f"a sliding window ({sliding_window}) without causal attention", "use sdpa")
    common = dict(causal=causal, softmax_scale=scaling, sinks=s_aux, window=sliding_window)

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            _refuse(module, f"a {attention_mask.dim()}-D attention mask (a custom mask) cannot be honoured; xorl reads "
                    "only padding masks and packed documents", "pass a 2-D padding mask or packed position_ids")
        return _padded(q, k, v, attention_mask, q_len, k_len, common), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            _refuse(module, "only one of cu_seq_lens_q / cu_seq_lens_k was given", "pass both, or neither")
        return _packed(q, k, v, cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"), common), None

    position_ids = kwargs.get("position_ids")
    # Packed rows known only from their positions need a host read (do they restart?), which
    # torch.compile cannot trace; compiled, packed documents come as cu_seq_lens_q / _k (transformers'
    # own flash-attention path reads positions the same way and breaks its graph there too).
    if position_ids is not None and q_len == k_len and q_len > 1 and not torch.compiler.is_compiling():
        cu = _documents_from_positions(position_ids, batch, q_len)
        if cu is not None:
            return _packed(q, k, v, cu, cu, None, None, common), None

    if q_len != k_len and causal:
        # A KV cache: the q_len new queries are the last positions of the k_len keys.
        positions = torch.arange(k_len, device=q.device)
        out = flash_attn(q, k, v, q_positions=positions[k_len - q_len:], k_positions=positions, **common)
        return out, None
    return flash_attn(q, k, v, **common), None


def _documents_from_positions(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor | None:
    """The document boundaries (cu_seqlens over the flattened rows) where positions restart inside a
    row, as transformers' flash-attention path reads packed rows; None when no row restarts (then
    plain causal attention over each row is the same thing, and cheaper). One host read: the count
    of documents (the kernel's grid)."""
    pos = position_ids.expand(batch, -1).reshape(batch, seq)
    first = pos[:, :1] - 1
    starts = torch.diff(pos, prepend=first, dim=1) != 1  # a position that does not follow its left neighbour
    starts[:, 0] = True
    if not bool(starts[:, 1:].any()):
        return None
    flat = starts.reshape(-1).nonzero().flatten()
    end = torch.tensor([batch * seq], device=flat.device, dtype=flat.dtype)
    return torch.cat([flat, end]).to(torch.int32)


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, common) -> torch.Tensor:
    batch, seq = q.shape[:2]
    out = flash_attn(q.reshape(1, batch * seq, *q.shape[2:]), k.reshape(1, -1, *k.shape[2:]),
                     v.reshape(1, -1, *v.shape[2:]), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                     max_seqlen_q=max_q, max_seqlen_k=max_k, **common)
    return out.reshape(batch, seq, *out.shape[2:])


def _padded(q, k, v, mask, q_len, k_len, common) -> torch.Tensor:
    """Left- or right-padded rows: the kept tokens of each row form one document (the kernel's
    packed layout), keys and queries aligned at their ends (a KV cache's queries are the last
    tokens). Padded query rows come back as zeros."""
    batch = q.shape[0]
    keep_k = mask[:, -k_len:].bool()
    keep_q = keep_k[:, -q_len:]
    idx_k = keep_k.reshape(-1).nonzero().flatten()
    idx_q = keep_q.reshape(-1).nonzero().flatten()
    len_k = keep_k.sum(1)
    len_q = keep_q.sum(1)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_k = torch.cat([zero, len_k.cumsum(0).to(torch.int32)])
    cu_q = torch.cat([zero, len_q.cumsum(0).to(torch.int32)])
    # Positions inside each row's kept tokens; queries take the last len_q key positions.
    k_pos = (keep_k.cumsum(1) - 1).reshape(-1)[idx_k]
    q_pos = ((keep_q.cumsum(1) - 1) + (len_k - len_q)[:, None]).reshape(-1)[idx_q]
    out = flash_attn(q.reshape(batch * q_len, *q.shape[2:])[idx_q][None],
                     k.reshape(batch * k_len, *k.shape[2:])[idx_k][None],
                     v.reshape(batch * k_len, *v.shape[2:])[idx_k][None],
                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_positions=q_pos, k_positions=k_pos, **common)[0]
    full = out.new_zeros(batch * q_len, *out.shape[1:])
    full = full.index_copy(0, idx_q, out)
    return full.reshape(batch, q_len, *out.shape[1:])
