"""The rules that tie the parallel layout to the model and the data (the size-only rules live with
ParallelConfig in xorl/distributed/parallel_config.py). Run only once the sizes fit the world.

Decisions worth knowing:
- TP splits whole heads: num_attention_heads and num_key_value_heads must both be multiples of TP
  (no KV-head replication across TP ranks).
- Ulysses splits the heads a TP rank holds: (heads / TP) % ulysses == 0. KV heads fewer than the
  Ulysses size are replicated, which needs ulysses % (kv_heads / TP) == 0; more must divide evenly.
- Context parallelism shards data.seq_len: with ring attention every row is zig-zag split into
  2 x ringattn chunks and each chunk over the Ulysses ranks, so seq_len % (2 x ring x ulysses) == 0
  (seq_len % ulysses for Ulysses alone). Packing does not lift this: the packed row still has
  seq_len tokens; the data loader pads each packed document to a multiple of 2 x ring (never
  truncates it), which keeps every document splittable.
- DDP all-reduces plain gradients, so it cannot hold the DTensor shards of TP or EP: use fsdp2.
"""

from __future__ import annotations

from typing import Any

from xorl.config.rules.common import next_multiple
from xorl.distributed.parallel_config import ParallelConfig
from xorl.models.schema import DENSE as DENSE_FAMILIES


def parallel_model_problems(m: Any, p: ParallelConfig) -> list[str]:
    problems = []
    heads, kv_heads = m.num_attention_heads, m.num_key_value_heads
    if heads < 1 or kv_heads < 1:
        return problems  # reported by model_problems
    tp_divides_heads = heads % p.tp == 0 and kv_heads % p.tp == 0
    if p.tp > 1:
        if not tp_divides_heads:
            problems.append(
                f"model.num_attention_heads={heads} and num_key_value_heads={kv_heads} must both be "
                f"multiples of train.tensor_parallel_size={p.tp} (TP gives each rank whole query and KV heads); "
                f"use a tensor_parallel_size dividing {kv_heads}"
            )
        # Any dense SwiGLU layer: a dense family, or an MoE family's dense layers (mlp_only_layers,
        # decoder_sparse_step, GLM / DeepSeek's first_k_dense_replace), all intermediate_size wide.
        dense_mlp = (m.model_type in DENSE_FAMILIES or m.mlp_only_layers or m.decoder_sparse_step > 1
                     or m.first_k_dense_replace > 0)
        if dense_mlp and m.intermediate_size % p.tp:
            problems.append(
                f"model.intermediate_size={m.intermediate_size} must be a multiple of "
                f"train.tensor_parallel_size={p.tp} (TP splits the dense MLP's columns); use a tensor_parallel_size "
                f"dividing {m.intermediate_size}"
            )
    if p.ulysses > 1 and tp_divides_heads:
        local_heads, local_kv = heads // p.tp, kv_heads // p.tp
        if local_heads % p.ulysses:
            problems.append(
                f"model.num_attention_heads={heads} must be a multiple of "
                f"train.ulysses_parallel_size={p.ulysses}"
                + (f" x tensor_parallel_size={p.tp}" if p.tp > 1 else "")
                + " (Ulysses gives each rank whole heads); choose ulysses_parallel_size dividing "
                f"{local_heads}, or use ringattn_parallel_size for the rest of the context parallelism"
            )
        elif local_kv >= p.ulysses and local_kv % p.ulysses:
            problems.append(
                f"model.num_key_value_heads={kv_heads}"
                + (f" / tensor_parallel_size={p.tp}" if p.tp > 1 else "")
                + f" = {local_kv} KV heads per rank is not divisible by train.ulysses_parallel_size="
                f"{p.ulysses}; choose an ulysses_parallel_size dividing {local_kv}"
            )
        elif local_kv < p.ulysses and p.ulysses % local_kv:
            problems.append(
                f"train.ulysses_parallel_size={p.ulysses} must be a multiple of the {local_kv} KV heads per "
                "rank (model.num_key_value_heads / tensor_parallel_size) so that each KV head is replicated "
                "evenly; change ulysses_parallel_size"
            )
    dense = m.num_experts == 0 or m.model_type == "llama"
    if p.ep > 1 and dense:
        problems.append(
            f"train.expert_parallel_size={p.ep} on a dense model (model_type={m.model_type!r}, "
            f"num_experts={m.num_experts}): there are no experts to distribute; set expert_parallel_size: 1"
        )
    elif p.ep > 1 and m.num_experts % p.ep:
        sizes = [d for d in range(1, p.ep_fold + 1) if p.ep_fold % d == 0 and m.num_experts % d == 0]
        problems.append(
            f"model.num_experts={m.num_experts} must be a multiple of train.expert_parallel_size={p.ep} "
            f"(each EP rank holds the same number of experts); use expert_parallel_size one of {sizes}"
        )
    if p.pp > 1:
        stages = p.pp * p.virtual_pipeline_stages
        if m.num_hidden_layers < stages:
            problems.append(
                f"model.num_hidden_layers={m.num_hidden_layers} is fewer than the {stages} pipeline stages "
                f"(pipeline_parallel_size={p.pp} x virtual_pipeline_stages={p.virtual_pipeline_stages}); "
                "every stage needs at least one layer: add layers or use fewer stages"
            )
    return problems


def parallel_data_problems(d: Any, p: ParallelConfig) -> list[str]:
    if not isinstance(d.seq_len, int) or d.seq_len < 1:
        return []
    problems = []
    if p.cp > 1:
        divisor = (2 * p.ring if p.ring > 1 else 1) * p.ulysses
        if d.seq_len % divisor:
            parts = [f"2 x ringattn_parallel_size={p.ring}"] if p.ring > 1 else []
            parts += [f"ulysses_parallel_size={p.ulysses}"] if p.ulysses > 1 else []
            how = " x ".join(parts)
            zigzag = " into zig-zag chunks" if p.ring > 1 else ""
            problems.append(
                f"data.seq_len={d.seq_len} must be divisible by {how} = {divisor}: context parallelism "
                f"splits each row{zigzag} across the ranks (packed documents are padded to fit, never "
                f"truncated); use seq_len {next_multiple(d.seq_len, divisor)}"
            )
    if p.sequence_parallel and p.tp > 1:
        local = d.seq_len // p.cp
        if d.seq_len % p.cp == 0 and local % p.tp:
            problems.append(
                f"data.seq_len={d.seq_len}: sequence_parallel splits the {local} tokens each "
                f"context-parallel rank holds across tensor_parallel_size={p.tp}; use seq_len "
                f"{next_multiple(d.seq_len, p.cp * p.tp)}"
            )
    return problems


def moe_token_split_problems(m: Any, d: Any, p: ParallelConfig) -> list[str]:
    """Under TP the MoE blocks run on each TP rank's share of the tokens (parallel/tensor_parallel.py)."""
    if not m.num_experts or p.tp == 1 or p.sequence_parallel or not isinstance(d.seq_len, int):
        return []  # under sequence parallel the rule above already asks for it
    local = d.seq_len // p.cp
    if d.seq_len % p.cp == 0 and local % p.tp:
        return [
            f"data.seq_len={d.seq_len}: the MoE blocks split the {local} tokens each context-parallel rank "
            f"holds across tensor_parallel_size={p.tp}; use seq_len {next_multiple(d.seq_len, p.cp * p.tp)}"
        ]
    return []


def data_parallel_mode_problems(t: Any, p: ParallelConfig) -> list[str]:
    if t.data_parallel_mode != "ddp" or (p.tp == 1 and p.ep == 1):
        return []
    which = " and ".join(
        f"{name}={size}" for name, size in (("tensor_parallel_size", p.tp), ("expert_parallel_size", p.ep))
        if size > 1
    )
    return [
        f"train.data_parallel_mode='ddp' with {which}: DDP all-reduces whole gradients and cannot reduce "
        "the tensor- or expert-parallel shards; use data_parallel_mode: fsdp2"
    ]


def selective_checkpointing_problems(m: Any, t: Any, p: ParallelConfig) -> list[str]:
    """Selective recompute replays a block's ops against the ones its forward saved; the experts'
    own FSDP unit (EP or TP > 1 under fsdp2: xorl/parallel/data_parallel.py) runs FSDP hooks inside
    the block whose recompute differs from the forward, which torch's checkpoint rejects mid-step."""
    nested_experts = m.num_experts and t.data_parallel_mode == "fsdp2" and (p.ep > 1 or p.tp > 1)
    if t.activation_checkpointing == "selective" and nested_experts:
        return [
            f"train.activation_checkpointing='selective' with an MoE model under expert_parallel_size={p.ep}, "
            f"tensor_parallel_size={p.tp}: the experts are an FSDP unit of their own inside each block, whose "
            "hooks do not replay the same way in the recompute; use activation_checkpointing: full (or none)"
        ]
    return []
