"""The tensor-parallel styles: how one module of a TP layout is laid out over the TP ranks.

A layout (xorl/models/tp_layout.py) maps module paths to the names below;
``xorl.parallel.tensor_parallel.apply_tensor_parallel`` walks it and calls the style of each
present module as ``style(module, path, ctx)``. A style returns the module that takes the old one's
place (the plan puts it there with ``nn.Module.set_submodule``), or None when the module stays and
is changed only through its own explicit methods or ``put_params_on_tp`` (xorl/nn/tp_replicated.py).
``ctx`` (``StyleContext``) carries the mesh, the sequence-parallel and overlap settings, and what the
styles hand the step: the parameters whose gradients are partial sums over TP.

    column            ColumnParallelLinear: weight rows (output features) split, Shard(0)
    row               RowParallelLinear: weight columns (input features) split, Shard(1); output summed
    heads             an attention block: its query and KV head counts must divide by TP (each rank
                      computes whole heads); its own per-head parameters (gpt-oss's sinks) split with them
    replicated        held whole on every rank (Replicate()); inside the sequence-parallel region it runs
                      on this rank's sequence shard, so under SP its gradients are partial sums
    per_head_replicated  held whole; each rank applies it to its own heads (Qwen3's per-head q/k norm),
                      so its gradients are always partial sums
    width_norm        an RMSNorm over all heads of a projection (OLMoE's q/k norm): weight split with
                      the heads, the sums of squares all-reduced (WidthRMSNormOverTP)
    enter_heads       where one activation meets every rank's heads (MLA's shared RoPE key): all-gathered
                      along the sequence under SP, its gradient summed over TP (ToHeadParallel)
    token_shards      an MoE block (xorl.nn.MoE) routes only this rank's share of the tokens; its experts
                      are left to expert parallelism and FSDP; router and shared-expert gradients partial
    vocab_embedding   VocabParallelEmbedding when the vocabulary divides by TP (the SP region starts at
                      its output), else ReplicatedEmbedding
    vocab_lm_head     VocabParallelLMHead (vocabulary-sharded logits for the loss-parallel cross-entropy;
                      tied to the embedding when the model ties them), else ReplicatedLMHead
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from xorl.nn.moe import MoE
from xorl.nn.tp_comm import TPGroup
from xorl.nn.tp_linear import ColumnParallelLinear, RowParallelLinear
from xorl.nn.tp_norms import WidthRMSNormOverTP
from xorl.nn.tp_regions import ToHeadParallel
from xorl.nn.tp_replicated import TPPartialGrads, replicate_on_tp, split_with_heads
from xorl.nn.tp_vocab import ReplicatedEmbedding, ReplicatedLMHead, VocabParallelEmbedding, VocabParallelLMHead


@dataclass
class StyleContext:
    """What the styles of one ``apply_tensor_parallel`` call share."""

    tp_mesh: object
    tp: TPGroup
    sequence_parallel: bool
    overlap: bool
    overlap_min_numel: int
    partial: TPPartialGrads  # replicated parameters whose gradients the step sums over TP
    # id(original parameter) -> its TP parameter: a parameter two modules share (tied embedding and
    # lm_head) stays one parameter.
    memo: dict[int, nn.Parameter] = field(default_factory=dict)
    plain: list[str] = field(default_factory=list)  # paths whose parameters stay plain tensors (MoE blocks)

    @property
    def linear_kw(self) -> dict:
        return {"sequence_parallel": self.sequence_parallel, "overlap": self.overlap,
                "overlap_min_numel": self.overlap_min_numel}

    def partial_under_sp(self) -> TPPartialGrads | None:
        return self.partial if self.sequence_parallel else None


def column(linear: nn.Linear, path: str, ctx: StyleContext) -> nn.Module:
    layer = ColumnParallelLinear.from_linear(linear, ctx.tp_mesh, name=path, **ctx.linear_kw)
    _list_lora_partial_grads(layer, ctx)
    return layer


def row(linear: nn.Linear, path: str, ctx: StyleContext) -> nn.Module:
    layer = RowParallelLinear.from_linear(linear, ctx.tp_mesh, name=path, **ctx.linear_kw)
    _list_lora_partial_grads(layer, ctx)
    return layer


def _list_lora_partial_grads(layer: ColumnParallelLinear | RowParallelLinear, ctx: StyleContext) -> None:
    """LoRA adapters whose gradient is a per-rank partial sum (xorl/nn/tp_linear.py, LoRA)."""
    ctx.partial.slots += [(layer, leaf) for leaf in layer.lora_partial_grads()]


def heads(attn: nn.Module, path: str, ctx: StyleContext) -> None:
    """``attn`` declares ``num_heads`` and ``num_key_value_heads`` (xorl/models/attention.py, mla.py)."""
    q_heads, kv_heads, size = attn.num_heads, attn.num_key_value_heads, ctx.tp.size
    if q_heads % size or kv_heads % size:
        raise ValueError(
            f"{path}: {q_heads} query heads and {kv_heads} key/value heads must both be divisible by "
            f"tensor_parallel_size={size}; use a tensor_parallel_size dividing {kv_heads}"
        )
    split_with_heads(attn, ctx.tp_mesh)  # its own parameters: per query head (sinks), or none


def replicated(module: nn.Module, path: str, ctx: StyleContext) -> None:
    replicate_on_tp(module, ctx.tp_mesh, ctx.memo, ctx.partial_under_sp())


def per_head_replicated(module: nn.Module, path: str, ctx: StyleContext) -> None:
    replicate_on_tp(module, ctx.tp_mesh, ctx.memo, ctx.partial)


def width_norm(norm: nn.Module, path: str, ctx: StyleContext) -> nn.Module:
    return WidthRMSNormOverTP.from_norm(norm, ctx.tp_mesh, name=path)


def enter_heads(identity: nn.Module, path: str, ctx: StyleContext) -> nn.Module:
    if not isinstance(identity, nn.Identity):
        raise TypeError(f"{path}: enter_heads takes the model's nn.Identity plug point, got {type(identity).__name__}")
    return ToHeadParallel(ctx.tp, ctx.sequence_parallel)


def token_shards(moe: nn.Module, path: str, ctx: StyleContext) -> None:
    if not isinstance(moe, MoE):
        raise ValueError(
            f"apply_tensor_parallel: {path} is a {type(moe).__name__}, not an xorl.nn.MoE block; "
            "build the model from xorl.models"
        )
    for name, _ in moe.named_parameters():
        if not name.startswith("experts."):  # router, shared expert: a share of the tokens here
            owner_name, _, leaf = name.rpartition(".")
            ctx.partial.slots.append((moe.get_submodule(owner_name) if owner_name else moe, leaf))
    moe.run_on_token_shards(ctx.tp, ctx.sequence_parallel)
    ctx.plain.append(path)


def vocab_embedding(embed: nn.Embedding, path: str, ctx: StyleContext) -> nn.Module:
    """Vocabulary-parallel: each rank holds vocab/P rows and the partial embeddings are summed (under
    SP reduce-scattered straight into the sequence shard). A vocabulary that does not divide by TP
    stays whole; under SP its output is then split to the shard."""
    if embed.num_embeddings % ctx.tp.size:
        return ReplicatedEmbedding(embed, ctx.tp_mesh, ctx.sequence_parallel, ctx.memo)
    layer = VocabParallelEmbedding.from_embedding(embed, ctx.tp_mesh, ctx.sequence_parallel)
    ctx.memo[id(embed.weight)] = layer.weight  # a tied lm_head takes this parameter
    return layer


def vocab_lm_head(head: nn.Linear, path: str, ctx: StyleContext) -> nn.Module:
    """Vocabulary-parallel logits (1/P of the lm_head's FLOPs per rank), the SP region's end (its input
    gathered along the sequence, as any column layer does); whole when the vocabulary does not divide."""
    tied = ctx.memo.get(id(head.weight))  # the embedding this head shares its weight with, placed already
    vocab_parallel = head.out_features % ctx.tp.size == 0 and head.bias is None
    if tied is not None and vocab_parallel != tied.placements[0].is_shard():
        raise ValueError(f"{path}: tied to an embedding laid out differently ({tied.placements})")
    if not vocab_parallel:
        return ReplicatedLMHead(head, ctx.tp_mesh, ctx.sequence_parallel, ctx.memo)
    return VocabParallelLMHead.from_linear(head, ctx.tp_mesh, sequence_parallel=ctx.sequence_parallel,
                                           overlap=ctx.overlap, name=path, weight=tied)


TP_STYLES: dict[str, Callable[[nn.Module, str, StyleContext], nn.Module | None]] = {
    "column": column, "row": row, "heads": heads, "replicated": replicated,
    "per_head_replicated": per_head_replicated, "width_norm": width_norm, "enter_heads": enter_heads,
    "token_shards": token_shards, "vocab_embedding": vocab_embedding, "vocab_lm_head": vocab_lm_head,
}
