"""The parameter shapes of the model xorl builds, and each rank's exact share of them.

EXACT (equal, byte for byte, to what the trainer's sharded model holds on a rank; checked by
tests/unit/planner/test_memory.py, which builds the real parallel model of every example on the meta
device under torch's fake process group). xorl/planner/memory.py turns these counts into bytes.

  params     the local shards of the fp32 master weights. The parameter shapes come from the model
             xorl builds (meta device, MoE blocks swapped for xorl.nn.MoE as parallelize does); the
             plans then split them:
             TP   q/k/v/gate/up (and column biases) on dim 0, o/down on dim 1, over
                  tensor_parallel_size (xorl/parallel/tensor_parallel.py); MoE blocks stay whole;
             EP   stacked experts on dim 0 over expert_parallel_size;
             FSDP2 dim 0 of the resulting local tensor chunked like torch.chunk over the sharding
                  group (dp_shard x ring x ulysses; experts under EP: ep_fsdp), so sharding rank r
                  holds min(c, n - r*c) rows, c = ceil(n / group): rank 0 holds the most;
             PP   the layers of the stages this pipeline rank runs (xorl/parallel/pipeline_parallel.py), the
                  embedding on stage 0, final norm and lm_head on the last stage.
  LoRA       (model.lora) the adapters are parameters like any other (split by TP to match their
             base: B of a column layer on dim 0, A of a row layer on dim 1); grads and optimizer count
             only them, the frozen base holds weights alone, in the compute dtype (bf16 under
             fsdp2 + dtype bfloat16 on GPU: the trainer stores it so, xorl/nn/lora.py cast_frozen_).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from xorl.distributed.parallel_config import ParallelConfig
from xorl.nn.lora import is_adapter_name
from xorl.parallel.pipeline_parallel import layer_ranges, num_stages, stage_indices

# The vocabulary-parallel embedding and lm_head (xorl/parallel/tensor_parallel.py), when TP divides the vocabulary.
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")

# Parameter names inside a decoder layer that the TP plan shards, and the dim (xorl/parallel/tensor_parallel.py).
TP_SHARD_DIM = {
    **{f"self_attn.{x}_proj.{kind}": 0 for x in ("q", "k", "v", "qkv") for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": 1,
    "self_attn.sinks": 0,  # gpt-oss: one logit per query head, split with the heads
    "self_attn.q_b_proj.weight": 0, "self_attn.kv_b_proj.weight": 0,  # latent attention's per-head up-projections
    **{f"mlp.{x}_proj.{kind}": 0 for x in ("gate", "up", "gate_up") for kind in ("weight", "bias")},
    "mlp.down_proj.weight": 1,
    # LoRA adapters split to match their base (xorl/nn/tensor_parallel.py): B with a column base, A with a row base.
    **{f"self_attn.{x}_proj.lora_B": 0 for x in ("q", "k", "v")},
    **{f"mlp.{x}_proj.lora_B": 0 for x in ("gate", "up")},
    "self_attn.o_proj.lora_A": 1,
    "mlp.down_proj.lora_A": 1,
}
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                 "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias",  # gpt-oss: per-expert biases
                 # LoRA's per-expert adapters, [E, ...] and split like the experts (xorl/nn/lora.py)
                 *(f"mlp.experts.lora_{w}.lora_{x}" for w in ("gate_up_proj", "down_proj") for x in "AB"))


Params = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) pairs


@dataclass(frozen=True)
class ModelShapes:
    """Parameter shapes of the model xorl builds: per decoder layer, the embedding, the head.

    Layers with the same parameters share a kind (dense / MoE), so sums run once per kind.
    """

    kinds: tuple[Params, ...]  # distinct decoder-layer parameter sets
    layer_kind: tuple[int, ...]  # kind of each decoder layer
    first: Params  # stage 0: model.embed_tokens.*
    last: Params  # last stage: model.norm.*, lm_head.*
    num_params: int
    active_params: int  # per token: one top-k share of the experts
    # decoder-layer parameters that are xorl.nn.linear.Linear weights: what train.fp8 computes in FP8
    # and, with fp8_all_gather, what FSDP gathers in float8 (step_time)
    fp8_linear_weights: frozenset = frozenset()

    @property
    def layers(self) -> tuple[Params, ...]:
        return tuple(self.kinds[k] for k in self.layer_kind)

    def is_moe_kind(self, kind: int) -> bool:
        return any(name in EXPERT_PARAMS for name, _ in self.kinds[kind])


@functools.lru_cache(maxsize=8)
def _shapes(model_fields: tuple) -> ModelShapes:
    import torch

    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.models.spec import ModelSpec

    model_config = ModelConfig(**{k: dict(v[1]) if isinstance(v, tuple) and v[:1] == ("__dict__",) else v
                                  for k, v in model_fields})
    with torch.device("meta"):
        model = build_model(model_config)
    spec = ModelSpec.from_config(model_config)
    layers: list[list] = [[] for _ in range(spec.num_hidden_layers)]
    first, last = [], []
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            layers[int(index)].append((rest, tuple(p.shape)))
            experts += p.numel() if rest in EXPERT_PARAMS else 0
        else:
            (first if name.startswith("model.embed_tokens.") else last).append((name, tuple(p.shape)))
    from xorl.nn.linear import Linear

    linear_weights = frozenset(f"{name.split('.', 3)[3]}.weight" for name, module in model.named_modules()
                               if isinstance(module, Linear) and name.startswith("model.layers."))
    top_k_share = spec.num_experts_per_tok / spec.num_experts if spec.is_moe else 1.0
    kinds = list(dict.fromkeys(tuple(x) for x in layers))
    return ModelShapes(tuple(kinds), tuple(kinds.index(tuple(x)) for x in layers), tuple(first), tuple(last),
                       total, round(total - experts * (1 - top_k_share)), linear_weights)


def model_shapes(model_config) -> ModelShapes:
    def hashable(v):  # lru_cache keys: lists as tuples, dicts (rope_scaling, lora) as tagged item tuples
        if isinstance(v, dict):
            return ("__dict__", tuple(sorted((k, hashable(x)) for k, x in v.items())))
        return tuple(v) if isinstance(v, list) else v

    return _shapes(tuple(sorted((k, hashable(v)) for k, v in dataclasses.asdict(model_config).items())))


def local_numel(name: str, shape: tuple[int, ...], p: ParallelConfig, fsdp: bool, shard_rank: int) -> int:
    """Elements of this parameter on a rank at FSDP sharding index ``shard_rank`` (see the docstring)."""
    dims = list(shape)
    tp_dim = TP_SHARD_DIM.get(name)
    if tp_dim is not None and p.tp > 1:
        dims[tp_dim] //= p.tp
    if name in VOCAB_PARAMS and p.tp > 1 and dims[0] % p.tp == 0:
        dims[0] //= p.tp
    group, rank = p.dp_shard_cp, shard_rank
    if name in EXPERT_PARAMS and (p.ep > 1 or p.tp > 1):
        dims[0] //= p.ep
        # The EP mesh is (ep_fsdp, ep) over dp_shard x cp x tp (TP rank 0 of this sharding index). Under
        # TP without EP too, the experts (whole on every TP rank) are FSDP-sharded over ep_fsdp, the TP
        # ranks included (xorl/parallel/data_parallel.py experts_have_own_mesh).
        group, rank = p.ep_fsdp, shard_rank * p.tp // p.ep
    if fsdp and group > 1:
        chunk = -(-dims[0] // group)
        dims[0] = max(0, min(chunk, dims[0] - rank * chunk))
    return math.prod(dims)


def kind_numel(kind: Params, p: ParallelConfig) -> int:
    """Elements of one decoder layer after TP / EP, before FSDP: what FSDP2 all-gathers."""
    return sum(local_numel(n, s, p, False, 0) for n, s in kind)


@dataclass(frozen=True)
class RankParams:
    """Parameter counts of one pipeline rank at one sharding index."""

    local: int  # elements held (sharded)
    trainable: int  # of those, the ones with gradients and optimizer state (LoRA: the adapters alone)
    layers: tuple[int, ...]  # the decoder layers it runs
    stage_layers: tuple[int, ...]  # layers per stage it runs
    largest_layer_unsharded: int  # TP/EP-local elements of its largest layer (what FSDP all-gathers)
    root_unsharded: int  # embedding / final norm / lm_head elements (TP-local: vocabulary-parallel)
    stage_unsharded: int  # every TP/EP-local element it runs
    has_first: bool
    has_last: bool


def rank_params(shapes: ModelShapes, p: ParallelConfig, schedule: str, virtual: int, pp_rank: int,
                fsdp: bool, shard_rank: int = 0) -> RankParams:
    if p.pp > 1:
        total = num_stages(p.pp, virtual, schedule)
        ranges = layer_ranges(len(shapes.layers), total)
        ids = stage_indices(pp_rank, p.pp, virtual, schedule)
        stages = [range(*ranges[s]) for s in ids]
        has_first, has_last = 0 in ids, total - 1 in ids
    else:
        stages, has_first, has_last = [range(len(shapes.layers))], True, True
    layers = [i for stage in stages for i in stage]
    lora = any(is_adapter_name(n) for kind in shapes.kinds for n, _ in kind)

    def trains(name: str) -> bool:  # under LoRA only the adapters (the base is frozen: xorl/nn/lora.py)
        return not lora or is_adapter_name(name)

    per_kind = [(sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in kind), kind_numel(kind, p),
                 sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in kind if trains(n))) for kind in shapes.kinds]
    local = unsharded = largest = trainable = 0
    for i in layers:
        held, full, train = per_kind[shapes.layer_kind[i]]
        local += held
        unsharded += full
        trainable += train
        largest = max(largest, full)
    root = [*(shapes.first if has_first else ()), *(shapes.last if has_last else ())]
    root_local = sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in root)
    root_full = sum(local_numel(n, s, p, False, 0) for n, s in root)  # TP-local: vocab-parallel when TP divides V
    trainable += sum(local_numel(n, s, p, fsdp, shard_rank) for n, s in root if trains(n))
    return RankParams(local + root_local, trainable, tuple(layers), tuple(len(s) for s in stages), largest, root_full,
                      unsharded + root_full, has_first, has_last)
