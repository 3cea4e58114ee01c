"""The attention block (projections, q/k norm, RoPE) and the local core attention it calls.

The split is the plug point for context parallelism: ``Attention`` computes q, k, v as
[batch, seq, heads, head_dim] and calls ``self.core_attention(q, k, v, cu_seqlens=..., max_seqlen=...)``
(causal, k/v may have fewer heads, v may have its own head dim), adding ``sinks=`` (the layer's
parameter) and ``window=`` when the layer has them. ``LocalAttention`` is the single-device default;
RingAttention / UlyssesAttention / ContextParallelAttention (xorl.nn) replace ``core_attention``
with the same forward signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xorl.models.layers import apply_rotary
from xorl.models.spec import ModelSpec
from xorl.nn.attention_backends import attention_backend
from xorl.nn.linear import Linear
from xorl.nn.lora import lora_spec
from xorl.nn.rms_norm import RMSNorm


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> None:
    """Packed documents live in one row: cu_seqlens = [0, len_0, len_0+len_1, ..., seq_len]."""
    if batch != 1:
        raise ValueError(
            f"cu_seqlens given with batch={batch}: pack the documents into one row "
            "(batch=1, seq=total tokens)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1], got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        # Value checks would read the device three times per layer; the loader built these
        # boundaries on the host (xorl/data), where the checks below ran on CPU tests. Under
        # torch.compile a host read would break the block's graph.
        return
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != seq_len or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at seq_len={seq_len}; "
            f"got {cu_seqlens.tolist()}"
        )


def causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    cu_seqlens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Plain-torch causal attention (SDPA with a boolean mask); block-diagonal when cu_seqlens is given.

    q [b, s, h, d], k [b, s, h_kv, d], v [b, s, h_kv, d_v] with h % h_kv == 0 -> [b, s, h, d_v].
    ``window``: a query at position p (inside its document) sees keys p - window < k <= p.
    ``sinks`` [h]: one more logit per head in every row's softmax denominator (gpt-oss); SDPA has
    no such input, so with sinks the softmax is written out (same mask, O(s²) memory like SDPA's).
    """
    b, s, h, _ = q.shape
    h_kv = k.shape[2]
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    if h_kv != h:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    positions = torch.arange(s, device=q.device)
    mask = positions[None, :] <= positions[:, None]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, b, s)
        doc_ids = torch.searchsorted(cu_seqlens[1:].to(q.device), positions, right=True)
        mask = mask & (doc_ids[:, None] == doc_ids[None, :])
    if window is not None:  # within one document index differences are position differences
        mask = mask & (positions[:, None] - positions[None, :] < window)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale)
        return out.transpose(1, 2)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(vh.dtype), vh).transpose(1, 2)


def _xorl_flash_attn():
    """xorl_kernels.attention.op, or None while that op is not in the tree."""
    try:
        from xorl_kernels.attention.op import flash_attn
    except ModuleNotFoundError as error:
        if error.name != "xorl_kernels.attention.op":
            raise
        return None
    return flash_attn


def _flash_attn_package(q, k, v, softmax_scale, cu_seqlens, max_seqlen):
    """The flash-attn pip package (Dao et al.), for comparison runs; CUDA fp16/bf16 only."""
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise RuntimeError(
            "attn_implementation='flash_attn' needs the flash-attn package (pip install flash-attn); "
            "use 'xorl' for xorl's own kernel"
        ) from error
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True)
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    out = flash_attn_varlen_func(
        q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen, softmax_scale=softmax_scale, causal=True
    )
    return out.unsqueeze(0)


class LocalAttention(nn.Module):
    """Causal single-device core attention with GQA and optional varlen (packed documents).

    backend (the names of xorl/nn/attention_backends.py): "auto": xorl_kernels.flash_attn on CUDA
    tensors, plain torch (SDPA) on CPU; "sdpa": always plain torch; "xorl": always
    xorl_kernels.flash_attn (which itself runs torch's CPU flash kernel on CPU); "flash_attn":
    the flash-attn pip package.

    Per call, as for the context-parallel attentions that replace it: ``sinks`` [heads] (the
    attention layer's parameter) and ``window`` (causal sliding window). v may be narrower or
    wider than q/k (MLA). The flash-attn package takes neither sinks nor windows here (refused;
    config_rules refuses the combination before start).
    """

    def __init__(self, softmax_scale: float | None = None, backend: str = "auto"):
        super().__init__()
        if backend not in ("auto", "sdpa", "xorl", "flash_attn"):
            raise ValueError(f"backend={backend!r}: use 'auto', 'sdpa', 'xorl' or 'flash_attn'")
        self.softmax_scale = softmax_scale
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
            raise ValueError(f"sinks must be [heads_q] = [{q.shape[2]}], got {tuple(sinks.shape)}")
        if window is not None and window < 1:
            raise ValueError(f"window={window}: a sliding window sees at least the query itself (>= 1)")
        if self.backend == "flash_attn":
            if sinks is not None or window is not None:
                raise ValueError(
                    "attn_implementation='flash_attn' (the flash-attn package) is not wired for attention "
                    "sinks or sliding windows; use attn_implementation: xorl (or sdpa)"
                )
            return _flash_attn_package(q, k, v, scale, cu_seqlens, max_seqlen)
        if self.backend == "xorl" or (self.backend == "auto" and q.is_cuda):
            flash_attn = _xorl_flash_attn()
            if flash_attn is None and self.backend == "xorl":
                raise RuntimeError("attn_implementation='xorl' but xorl_kernels.attention.op is not available")
            if flash_attn is not None:
                extra = {}  # only when set: the call without them is today's, on any kernel version
                if sinks is not None:
                    extra["sinks"] = sinks
                if window is not None:
                    extra["window"] = int(window)
                return flash_attn(
                    q, k, v, causal=True, softmax_scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                    **extra,
                )
        return causal_attention_reference(q, k, v, scale, cu_seqlens, sinks, window)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


class Attention(nn.Module):
    """GQA self-attention with HF names: q_proj/k_proj/v_proj (or one fused qkv_proj), o_proj,
    and q_norm/k_norm before RoPE (Qwen3: per head; OLMoE: over the whole projection).

    merge_qkv: ``qkv_proj`` rows are grouped by KV head (Megatron's layout, ``QKV_LAYOUT``): for
    each of the hkv groups, its hq/hkv query heads, then its key head, then its value head. Why not
    [q; k; v]: tensor parallelism splits the heads by whole KV groups, and in this layout a group is
    a contiguous block of rows, so the column split (``Shard(0)``) of the one weight gives every TP
    rank exactly its q, k and v heads, whatever the TP size (a checkpoint resumes on any TP), and
    each rank runs one GEMM for all three. HF files keep q_proj / k_proj / v_proj (hf_reader converts)."""

    def __init__(self, spec: ModelSpec, layer_idx: int = 0):
        super().__init__()
        self.head_dim = spec.head_dim
        self.num_heads, self.num_key_value_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.merge_qkv = spec.merge_qkv
        q_size = spec.num_attention_heads * spec.head_dim
        kv_size = spec.num_key_value_heads * spec.head_dim
        bias = spec.attention_bias
        if spec.merge_qkv:
            self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=bias, fp8=spec.fp8)
            self.q_per_group = spec.num_attention_heads // spec.num_key_value_heads
        else:
            self.q_proj = Linear(spec.hidden_size, q_size, bias=bias, fp8=spec.fp8, lora=lora_spec(spec.lora, "q_proj"))
            self.k_proj = Linear(spec.hidden_size, kv_size, bias=bias, fp8=spec.fp8,
                                 lora=lora_spec(spec.lora, "k_proj"))
            self.v_proj = Linear(spec.hidden_size, kv_size, bias=bias, fp8=spec.fp8,
                                 lora=lora_spec(spec.lora, "v_proj"))
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_proj_bias, fp8=spec.fp8,
                             lora=lora_spec(spec.lora, "o_proj"))
        # "head": RMSNorm over head_dim of each head (Qwen3); "width": over the whole q / k
        # projection, all heads at once (OLMoE), so it needs every head of the token (the TP layout
        # gives it the whole width's statistics: xorl/models/tp_layout.py, width_norm).
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "width":
            self.q_norm = RMSNorm(q_size, eps=spec.rms_norm_eps)
            self.k_norm = RMSNorm(kv_size, eps=spec.rms_norm_eps)
        elif spec.qk_norm == "head":
            self.q_norm = RMSNorm(spec.head_dim, eps=spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, eps=spec.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        # attn_implementation -> kernel: xorl/nn/attention_backends.py (the context-parallel plan
        # replaces this module and takes the ring-step kernel from the same table).
        backend = attention_backend(spec.attn_implementation).local
        self.core_attention: nn.Module = LocalAttention(softmax_scale=spec.head_dim**-0.5, backend=backend)
        # ``sinks`` (a learned logit per query head, gpt-oss; HF name ``sinks``) and this layer's
        # sliding ``window`` go to the core attention in every call; a family that has them sets
        # them here. Under tensor parallelism the sinks split with the heads (the layout's ``heads``
        # style), and forward sees this rank's block. Under context parallelism each rank's sinks
        # gradient covers its own query rows and the FSDP / DDP reduction over dp_cp sums them, like
        # any replicated parameter.
        # gpt-oss (family trait attention_sinks; its layer_types say which layers slide).
        self.sinks: nn.Parameter | None = (nn.Parameter(torch.empty(spec.num_attention_heads))
                                           if spec.family.attention_sinks else None)
        self.window: int | None = spec.attention_window(layer_idx)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        if self.merge_qkv:  # [..., groups (this rank's under TP), q_per_group + 2 heads, head_dim]
            qkv = self.qkv_proj(hidden)
            qkv = qkv.view(*qkv.shape[:-1], -1, self.q_per_group + 2, self.head_dim)
            q, k, v = qkv.split((self.q_per_group, 1, 1), dim=-2)
            q, k, v = (t.flatten(-3) for t in (q, k, v))
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        # Shapes come from the projections, not from ``hidden``: under tensor parallelism they hold only
        # this rank's heads (-1), and under sequence parallelism ``hidden`` is this rank's sequence shard
        # while q/k/v cover the whole sequence.
        batch, seq = q.shape[:2]
        if self.qk_norm == "width":
            q, k = self.q_norm(q), self.k_norm(k)
        heads_shape = (batch, seq, -1, self.head_dim)
        q, k, v = q.view(heads_shape), k.view(heads_shape), v.view(heads_shape)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        extra = {}
        if self.sinks is not None:  # one per query head this module computes
            extra["sinks"] = self.sinks
        if self.window is not None:
            extra["window"] = self.window
        out = self.core_attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **extra)
        return self.o_proj(out.reshape(batch, seq, -1))
