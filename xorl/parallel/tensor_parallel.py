"""The tensor-parallel plan: shard attention and MLP projections of an xorl causal LM (xorl/models).

    record = apply_tensor_parallel(model, tp_mesh, sequence_parallel=True, overlap=True)

On every present ``model.model.layers[i]`` (entries may be None under pipeline parallelism):

* Latent attention (DeepSeek, xorl/models/mla.py): ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` ->
  ColumnParallelLinear (whole heads), ``o_proj`` -> RowParallelLinear, the down-projections
  ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their norms replicated (``_parallelize_latent_attention``).
* ``self_attn.{q,k,v}_proj`` -> ColumnParallelLinear (heads split over TP; the attention module
  reshapes with -1 heads, so it needs no head count of its own), sharing one
  gathered input; or, with merge_qkv, ``self_attn.qkv_proj`` -> one ColumnParallelLinear: its rows
  are grouped by KV head (xorl/models/attention.py), so the plain column split hands each rank its
  whole groups, q, k and v, and each overlap chunk runs one GEMM instead of three.
  ``self_attn.o_proj`` -> RowParallelLinear.
* ``mlp.{gate,up}_proj`` -> ColumnParallelLinear (sharing one gathered input), or with
  merge_gate_up ``mlp.gate_up_proj`` -> one ColumnParallelLinear (its rows alternate gate and up
  units, so a column split keeps them paired: one GEMM per chunk); ``mlp.down_proj`` ->
  RowParallelLinear.
* ``model.embed_tokens`` -> VocabParallelEmbedding and ``lm_head`` -> VocabParallelLMHead when the
  vocabulary divides by TP (each rank holds vocab/P rows; logits stay sharded for the
  vocabulary-parallel loss, xorl/nn/cross_entropy.py); otherwise both stay replicated.
* Width q/k norms (OLMoE, ``WidthRMSNorm``: one RMSNorm over all heads of a token) split their
  weight with the heads (``Shard(0)``, as ``sinks``) and all-reduce their sums of squares over TP.
* Everything else stays replicated and becomes a ``Replicate()`` DTensor on the TP mesh
  (``replicate_on_tp`` in xorl/nn/tensor_parallel.py): norms, per-head q/k norms.

Sequence parallel (SP) region = from the embedding's output to the lm_head's input: the
vocabulary-parallel embedding reduce-scatters into this rank's sequence shard, the decoder layers
and the final norm run on the shard, and the lm_head gathers the sequence as any column layer
does. Under pipelining the activations between stages are therefore sequence shards. Inside the
region the norms and residual adds run on the shard; the column layers all-gather along the
sequence, the row layers reduce-scatter along it. Replicated parameters used inside the region on
a shard of the data have partial gradients: the decoder and final norms under SP, per-head q/k
norms always (each rank normalises only its own heads). They are listed in the returned record's
``partial_grads``, and the step sums them over TP once per optimizer step
(``xorl.nn.tp_replicated.sum_tp_partial_grads``: one all-reduce; xorl/parallel/step_plan.py's StepPlan).

MoE models: attention is tensor-parallel, and each MoE block runs on this TP rank's token shard,
its experts split over the TP ranks by expert parallelism (EP folds over dp_shard x CP x TP, see
xorl/distributed/parallel_config.py): no TP rank computes another's tokens. Under SP the block's
input already is the rank's sequence shard; without SP it keeps its chunk of the replicated
sequence and gathers the outputs again. The router and shared-expert parameters then see a
share of the tokens on each TP rank: their gradients are listed with the partial ones.

Communication record: ``xorl.nn.tp_comm.overlap_report(model)`` after a step, keyed by module path:
``model.layers.{i}.self_attn.qkv_proj`` / ``.o_proj`` and ``model.layers.{i}.mlp.gate_up_proj`` /
``.down_proj`` (shared-input groups report under the group's name), and OLMoE's
``model.layers.{i}.self_attn.q_norm`` / ``.k_norm`` (one all-reduce forward, one backward).

Requirements: query and KV head counts divisible by TP,
intermediate size divisible by TP, every rank holding the same full weights before the call
(same seed or the same checkpoint), and under SP every sequence length divisible by TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from xorl.models.layers import WidthRMSNorm
from xorl.models.mla import LatentAttention
from xorl.nn.moe import MoE
from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL, TPGroup
from xorl.nn.tp_linear import ColumnParallelLinear, RowParallelLinear, SharedInputColumnGroup
from xorl.nn.tp_replicated import TPPartialGrads, replicate_on_tp
from xorl.nn.tp_vocab import ReplicatedEmbedding, ReplicatedLMHead, VocabParallelEmbedding, VocabParallelLMHead


@dataclass
class TensorParallelRecord:
    """What ``apply_tensor_parallel`` did, for the step (xorl/parallel/step_plan.py's StepPlan)."""

    tp: TPGroup
    sequence_parallel: bool  # activations between layers (and pipeline stages) are sequence shards
    partial_grads: TPPartialGrads  # replicated parameters whose gradients the step sums over TP
    moe_on_token_shards: bool  # MoE blocks route this rank's tokens: router losses differ per TP rank

    @property
    def sequence_shards(self) -> int:
        """Into how many shards a rank's sequence is split between layers (1 without SP)."""
        return self.tp.size if self.sequence_parallel else 1


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True, overlap: bool = True, *,
                          overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL,
                          share_gathered_inputs: bool = True) -> TensorParallelRecord:
    """Shard ``model`` in place over the 1-D ``tp_mesh``; returns what was done. TP size 1: unchanged."""
    tp = TPGroup.from_mesh(tp_mesh)
    partial = TPPartialGrads(tp)
    if tp.size == 1:
        return TensorParallelRecord(tp, False, partial, False)
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            "apply_tensor_parallel expects an HF-style causal LM (model.model.layers[i].self_attn / .mlp); "
            f"got {type(model).__name__}"
        )
    overlap = bool(overlap)
    linear_kw = {"sequence_parallel": bool(sequence_parallel), "overlap": overlap,
                 "overlap_min_numel": int(overlap_min_numel)}
    memo: dict[int, nn.Parameter] = {}
    moe_blocks = 0
    present = [(i, layer) for i, layer in enumerate(layers) if layer is not None]
    for i, layer in present:
        prefix = f"model.layers.{i}"
        _parallelize_attention(layer.self_attn, tp_mesh, tp, f"{prefix}.self_attn", linear_kw, memo,
                               share_gathered_inputs, partial)
        if not _parallelize_dense_mlp(layer.mlp, tp_mesh, tp, f"{prefix}.mlp", linear_kw, share_gathered_inputs,
                                      partial):
            _moe_on_token_shards(layer, tp, sequence_parallel, partial)
            moe_blocks += 1
        for norm in ("input_layernorm", "post_attention_layernorm"):
            replicate_on_tp(getattr(layer, norm), tp_mesh, memo, partial if sequence_parallel else None)
    _parallelize_vocabulary(model, decoder, tp_mesh, tp, sequence_parallel, overlap, memo, partial)
    _check_every_parameter_placed(model)
    return TensorParallelRecord(tp, bool(sequence_parallel), partial, moe_blocks > 0)


def _parallelize_latent_attention(attn: LatentAttention, tp_mesh, tp: TPGroup, prefix: str, linear_kw: dict,
                                  memo: dict, partial: TPPartialGrads) -> None:
    """MLA (xorl/models/mla.py): the per-head up-projections (q_proj or q_b_proj, kv_b_proj) split by
    heads, o_proj by rows; the low-rank down-projections (q_a_proj, kv_a_proj_with_mqa) and their
    norms replicated. Under SP those run on this rank's sequence shard (partial gradients, like the
    decoder norms); the column layers gather their latent input along the sequence, and the shared
    RoPE key enters the head region through the module (``shard_heads_over_tp``)."""
    heads = attn.kv_b_proj.out_features // (attn.qk_nope_head_dim + attn.v_head_dim)
    if heads % tp.size:
        raise ValueError(f"{prefix}: {heads} attention heads must be divisible by tensor_parallel_size={tp.size}")
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        if getattr(attn, name) is not None:
            setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), tp_mesh, name=f"{prefix}.{name}",
                                                                 **linear_kw))
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp_mesh, name=f"{prefix}.o_proj", **linear_kw)
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        if getattr(attn, name) is not None:
            replicate_on_tp(getattr(attn, name), tp_mesh, memo, partial if linear_kw["sequence_parallel"] else None)
    attn.shard_heads_over_tp(tp, linear_kw["sequence_parallel"])


def _parallelize_attention(attn: nn.Module, tp_mesh, tp: TPGroup, prefix: str, linear_kw: dict,
                           memo: dict, share: bool, partial: TPPartialGrads) -> None:
    if isinstance(attn, LatentAttention):
        return _parallelize_latent_attention(attn, tp_mesh, tp, prefix, linear_kw, memo, partial)
    head_dim = attn.head_dim
    merged = getattr(attn, "qkv_proj", None) is not None
    if merged:  # rows in KV-head groups of q_per_group + 2 heads
        kv_heads = attn.qkv_proj.out_features // ((attn.q_per_group + 2) * head_dim)
        q_heads = kv_heads * attn.q_per_group
    else:
        q_heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    if q_heads % tp.size or kv_heads % tp.size:
        raise ValueError(
            f"{prefix}: {q_heads} query heads and {kv_heads} key/value heads must both be divisible by "
            f"tensor_parallel_size={tp.size}; use a tensor_parallel_size dividing {kv_heads}"
        )
    names = ("qkv_proj",) if merged else ("q_proj", "k_proj", "v_proj")
    for name in names:
        setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), tp_mesh, name=f"{prefix}.{name}",
                                                             **linear_kw))
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp_mesh, name=f"{prefix}.o_proj", **linear_kw)
    _list_lora_partial_grads(attn, (*names, "o_proj"), partial)
    if share and not merged:
        SharedInputColumnGroup([getattr(attn, n) for n in names], name=f"{prefix}.qkv_proj")
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:  # gpt-oss: one logit per query head, split with the heads (contiguous per rank)
        local = sinks.detach().chunk(tp.size)[tp.rank].clone()
        attn.sinks = nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False),
                                  requires_grad=sinks.requires_grad)
    for norm in ("q_norm", "k_norm"):
        module = getattr(attn, norm, None)
        if isinstance(module, WidthRMSNorm):  # OLMoE: over all heads; the weight splits with them
            module.shard_over_tp(tp, tp_mesh, name=f"{prefix}.{norm}")
        elif module is not None:  # per-head norms: replicated, each rank sees only its own heads
            replicate_on_tp(module, tp_mesh, memo, partial)


def _list_lora_partial_grads(owner: nn.Module, names, partial: TPPartialGrads) -> None:
    """LoRA adapters whose gradient is a per-rank partial sum (xorl/nn/tensor_parallel.py, LoRA)."""
    for name in names:
        layer = getattr(owner, name)
        partial.slots += [(layer, leaf) for leaf in layer.lora_partial_grads()]


def _parallelize_dense_mlp(mlp: nn.Module, tp_mesh, tp: TPGroup, prefix: str, linear_kw: dict,
                           share: bool, partial: TPPartialGrads) -> bool:
    """gate/up column, down row; False when ``mlp`` is not a plain SwiGLU MLP (e.g. a MoE block)."""
    # isinstance: the models' projections are xorl.nn.Linear (nn.Linear carrying the FP8 recipe).
    merged = isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear)
    columns = ("gate_up_proj",) if merged else ("gate_proj", "up_proj")
    if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in (*columns, "down_proj")):
        return False
    if mlp.down_proj.in_features % tp.size:
        raise ValueError(
            f"{prefix}: intermediate_size={mlp.down_proj.in_features} must be divisible by "
            f"tensor_parallel_size={tp.size}"
        )
    for name in columns:
        setattr(mlp, name, ColumnParallelLinear.from_linear(getattr(mlp, name), tp_mesh, name=f"{prefix}.{name}",
                                                            **linear_kw))
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp_mesh, name=f"{prefix}.down_proj", **linear_kw)
    _list_lora_partial_grads(mlp, (*columns, "down_proj"), partial)
    if share and not merged:
        SharedInputColumnGroup([mlp.gate_proj, mlp.up_proj], name=f"{prefix}.gate_up_proj")
    return True


def _moe_on_token_shards(layer: nn.Module, tp: TPGroup, sequence_parallel: bool, partial: TPPartialGrads) -> None:
    """A non-dense MLP (an xorl MoE block) runs on this TP rank's tokens (see the module docstring)."""
    moe = layer.mlp
    if not isinstance(moe, MoE):
        raise ValueError(
            f"apply_tensor_parallel: {type(moe).__name__} is neither a SwiGLU MLP nor an xorl.nn.MoE block; "
            "build the model from xorl.models (or convert the block with MoE.from_block first)"
        )
    for name, _ in moe.named_parameters():
        if not name.startswith("experts."):  # router, shared expert: a share of the tokens here
            owner_name, _, leaf = name.rpartition(".")
            partial.slots.append((moe.get_submodule(owner_name) if owner_name else moe, leaf))
    moe.run_on_token_shards(tp, sequence_parallel)


def _parallelize_vocabulary(model: nn.Module, decoder: nn.Module, tp_mesh, tp: TPGroup, sequence_parallel: bool,
                            overlap: bool, memo: dict, partial: TPPartialGrads) -> None:
    """Embedding and lm_head over the vocabulary (when it divides by TP), final norm; the SP region.

    Vocabulary-parallel: each rank holds vocab/P rows of the embedding and computes vocab/P logits
    (loss parallel: xorl.nn.cross_entropy), so lm_head costs 1/P of its FLOPs per rank. The
    sequence-parallel region runs from the embedding's output to the lm_head's input: the
    embedding reduce-scatters its partial rows straight into the sequence shard, the final norm
    runs on the shard (partial gradients), and the lm_head gathers the sequence as any column
    layer does. So under pipelining the activations passed between stages are sequence shards.
    A vocabulary that does not divide by TP stays replicated: the embedding's output is split to
    the shard, and the final norm's output gathered again before the replicated lm_head.
    """
    embed, norm, head = getattr(decoder, "embed_tokens", None), getattr(decoder, "norm", None), \
        getattr(model, "lm_head", None)
    vocab = (embed.num_embeddings if embed is not None else head.out_features if head is not None else 0)
    vocab_parallel = vocab % tp.size == 0 and (embed is None or type(embed) is nn.Embedding) and \
        (head is None or (type(head) is nn.Linear and head.bias is None))
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        if vocab_parallel:
            decoder.embed_tokens = VocabParallelEmbedding.from_embedding(embed, tp_mesh, sequence_parallel)
        else:
            decoder.embed_tokens = ReplicatedEmbedding(embed, tp_mesh, sequence_parallel, memo)
    if norm is not None:
        replicate_on_tp(norm, tp_mesh, memo, partial if sequence_parallel else None)
    if head is not None:
        if vocab_parallel:
            model.lm_head = VocabParallelLMHead.from_linear(head, tp_mesh, sequence_parallel=sequence_parallel,
                                                            overlap=overlap, name="lm_head")
            if tied:
                model.lm_head.weight = decoder.embed_tokens.weight
        else:
            model.lm_head = ReplicatedLMHead(head, tp_mesh, sequence_parallel, memo)


def _check_every_parameter_placed(model: nn.Module) -> None:
    """Every parameter outside replicated MoE blocks must now be a DTensor on the TP mesh."""
    moe_prefixes = []
    for name, module in model.named_modules():
        if name.endswith(".mlp") and not isinstance(getattr(module, "down_proj", None), RowParallelLinear):
            moe_prefixes.append(name + ".")
    missing = [n for n, p in model.named_parameters()
               if not isinstance(p, DTensor) and not any(n.startswith(pre) for pre in moe_prefixes)]
    if missing:
        raise ValueError(
            f"apply_tensor_parallel does not know how to place these parameters: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; extend xorl/parallel/tensor_parallel.py for this module type"
        )
