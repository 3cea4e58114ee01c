"""validate_config: every rule that ties config fields together and to the world size.

Runs before any process group exists. Every problem is collected and raised together as one
ConfigError; each line names the field(s) and the fix. The size-only rules (sizes multiply to
world_size, PP microbatches, schedules, EP folding, sequence parallel) live with ParallelConfig in
xorl/distributed/parallel_config.py; the rules here add what the model and data sections decide.

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
- export_hf writes a transformers config, which has no sigmoid router and no shared expert: such
  models are refused up front rather than after training (the DCP checkpoints keep their weights).
"""

from __future__ import annotations

import math
import os
from typing import Any

from xorl.config_error import ConfigError
from xorl.distributed.parallel_config import PIPELINE_SCHEDULES, ParallelConfig
from xorl.models.schema import DENSE as DENSE_FAMILIES


def validate_config(config: Any, world_size: int) -> None:
    """Raise ConfigError naming every problem of ``config`` on ``world_size`` ranks."""
    parallel = ParallelConfig.from_config(config, world_size)
    problems = parallel.problems()
    problems += _model_problems(config.model)
    problems += _attention_problems(config.model)
    problems += _router_problems(config.model)
    problems += _data_problems(config.data, config.model)
    problems += _eval_problems(config.data, config.train)
    problems += _train_problems(config.train)
    problems += _export_problems(config.model, config.train)
    problems += _compile_problems(config.train, config.model)
    problems += _fp8_problems(config.train, config.model)
    problems += _lora_problems(config.model, config.train)
    problems += _training_loop_problems(config.train, config.data)
    if not problems:
        from xorl.model_path import model_path_conflicts

        problems += model_path_conflicts(config.model)
    if not parallel._basic_problems():
        try:
            parallel.dp_shard  # noqa: B018 - resolves -1; raises when the sizes do not fit
        except ConfigError:
            pass  # already reported by parallel.problems()
        else:
            problems += _parallel_model_problems(config.model, parallel)
            problems += _parallel_data_problems(config.data, parallel)
            problems += _moe_token_split_problems(config.model, config.data, parallel)
            problems += _data_parallel_mode_problems(config.train, parallel)
            problems += _selective_checkpointing_problems(config.model, config.train, parallel)
    if problems:
        raise ConfigError(problems)


# -- model ---------------------------------------------------------------------------------
def _attention_problems(m: Any) -> list[str]:
    from xorl.nn.attention_backends import FLASH_ATTN, attention_backend, missing_package

    problems = []
    package = missing_package(m.attn_implementation)
    if package is not None:
        pip_name = package.replace("_", "-")
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} but the {pip_name} package is not installed; "
            f"use attn_implementation: xorl (our Triton kernels) or pip install {pip_name}"
        )
    # Sinks and sliding windows run on xorl's kernels and on sdpa (plain torch), not on the package.
    features = _attention_features(m)
    if features and attention_backend(m.attn_implementation).local == FLASH_ATTN:
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} with model_type={m.model_type!r}: the "
            f"flash-attn package is not wired for its {' and '.join(features)}; use attn_implementation: "
            "xorl (or sdpa)"
        )
    return problems


def _attention_features(m: Any) -> list[str]:
    """What the model's attention needs beyond plain causal softmax: sinks (a family trait), windows."""
    from xorl.models.families import MODEL_TYPES, family

    features = []
    if m.model_type in MODEL_TYPES and getattr(family(m.model_type), "attention_sinks", False):
        features.append("attention sinks")
    if getattr(m, "sliding_window", None) is not None:
        features.append("sliding windows")
    return features


def _model_problems(m: Any) -> list[str]:
    """The schema's shape rules (xorl/models/schema.py: the same ones ModelSpec raises)."""
    from xorl.models.families import family
    from xorl.models.schema import apply_family, field_values, shape_problems

    values = field_values(m)
    values["head_dim"], values["rope_scaling"] = m.head_dim, m.rope_scaling
    fam = family(m.model_type)
    return apply_family(values, fam) + shape_problems(values, fam)


def _parallel_model_problems(m: Any, p: ParallelConfig) -> list[str]:
    problems = []
    heads, kv_heads = m.num_attention_heads, m.num_key_value_heads
    if heads < 1 or kv_heads < 1:
        return problems  # reported by _model_problems
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
        problems.append(
            f"model.num_experts={m.num_experts} must be a multiple of train.expert_parallel_size={p.ep} "
            "(each EP rank holds the same number of experts)"
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


# -- data ----------------------------------------------------------------------------------
def _data_problems(d: Any, m: Any) -> list[str]:
    problems = _at_least("data", d, 2, "seq_len")  # one input and its next-token label
    problems += _at_least("data", d, 1, "micro_batch_size")
    problems += _at_least("data", d, 0, "num_workers")
    if d.seq_len > m.max_position_embeddings:
        problems.append(
            f"data.seq_len={d.seq_len} is longer than model.max_position_embeddings="
            f"{m.max_position_embeddings}; use seq_len <= {m.max_position_embeddings}"
        )
    problems += _dataset_problems(d.dataset, "data.dataset")
    if d.eval_dataset is not None:
        problems += _dataset_problems(d.eval_dataset, "data.eval_dataset")
    problems += _split_problems(d)
    if d.streaming and not problems:
        from xorl.data.corpus import DataError
        from xorl.data.stream import stream_files, streams_through_datasets

        if not streams_through_datasets(d.dataset):
            try:
                stream_files(d.dataset)
            except DataError as e:
                problems.append(str(e))
    problems += _tokenizer_problems(d.tokenizer, m.vocab_size)
    if not problems:
        problems += _format_problems(d)
    if m.model_path is not None and not os.path.isfile(os.path.join(m.model_path, "config.json")):
        problems.append(
            f"model.model_path={m.model_path!r} has no config.json; point it at a local HF model folder"
        )
    return problems


def _dataset_problems(dataset: str, name: str) -> list[str]:
    """A local file or folder xorl or datasets reads, 'builtin', or a hub name (checked when loaded)."""
    from xorl.data.corpus import DATASETS_SUFFIXES, READABLE_SUFFIXES, dataset_files, is_saved_dataset

    if dataset == "builtin":
        return []
    kinds = "/".join(READABLE_SUFFIXES + DATASETS_SUFFIXES)
    if not os.path.exists(dataset):
        if _looks_like_hub_name(dataset):
            return []
        return [f"{name}={dataset!r}: no such file; use 'builtin', a local {kinds} file or folder, a save_to_disk "
                "folder or a Hugging Face hub dataset name"]
    if os.path.isdir(dataset):
        if not is_saved_dataset(dataset) and not dataset_files(dataset):
            return [f"{name}={dataset!r}: the folder holds no {'/'.join(READABLE_SUFFIXES)} files, no "
                    f"{'/'.join(DATASETS_SUFFIXES)} files for datasets, and is no save_to_disk folder"]
    elif not dataset.endswith(READABLE_SUFFIXES + DATASETS_SUFFIXES):
        return [f"{name}={dataset!r}: unknown file type; xorl reads {kinds} (or 'builtin')"]
    return []


def _looks_like_hub_name(dataset: str) -> bool:
    """``name`` or ``owner/name`` with no file suffix (a missing local file is reported as missing)."""
    import re

    from xorl.data.corpus import DATASETS_SUFFIXES, READABLE_SUFFIXES

    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", dataset)) and not dataset.endswith(
        READABLE_SUFFIXES + DATASETS_SUFFIXES + (".yaml", ".yml")) and not dataset.startswith(".")


def _split_problems(d: Any) -> list[str]:
    """A split names a part of a hub dataset or a save_to_disk DatasetDict; a plain file has none."""
    from xorl.data.corpus import is_saved_dataset

    problems = []
    for field, source in (("split", d.dataset), ("eval_split", d.eval_dataset)):
        split = getattr(d, field)
        if split is None or source is None:
            continue
        if source == "builtin" or (os.path.exists(source) and not is_saved_dataset(source)):
            problems.append(f"data.{field}={split!r}: {source!r} is not split (splits belong to hub datasets and "
                            f"save_to_disk DatasetDicts); remove data.{field}")
    if d.eval_split is not None and d.eval_dataset is None:
        problems.append(f"data.eval_split={d.eval_split!r} without data.eval_dataset; set eval_dataset (or remove "
                        "eval_split)")
    return problems


def _eval_problems(d: Any, t: Any) -> list[str]:
    """Validation: one eval source, evaluated every train.eval_steps (xorl/evaluate.py)."""
    problems = _at_least("train", t, 0, "eval_steps", "eval_batches")
    if not 0 <= d.eval_fraction < 1:
        problems.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1) (the share of rows held out)")
    has_eval = d.eval_dataset is not None or d.eval_fraction > 0
    if d.eval_dataset is not None and d.eval_fraction > 0:
        problems.append("data.eval_dataset and data.eval_fraction are both set; use one eval source")
    if t.eval_steps > 0 and not has_eval:
        problems.append(f"train.eval_steps={t.eval_steps} but there is no eval data; set data.eval_dataset or "
                        "data.eval_fraction (or eval_steps: 0)")
    if has_eval and t.eval_steps == 0:
        problems.append("eval data is set (data.eval_dataset / eval_fraction) but train.eval_steps is 0, so it would "
                        "never be evaluated; set train.eval_steps (or remove the eval data)")
    schedule = PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule)
    if t.eval_steps > 0 and t.pipeline_parallel_size > 1 and schedule is not None and schedule.split_backward:
        problems.append(
            f"train.eval_steps={t.eval_steps} with pipeline_parallel_schedule: {t.pipeline_parallel_schedule}: "
            "validation runs the schedule's forward-only eval, and torch.distributed.pipelining's zero-bubble "
            "schedules still run their backward actions there (it fails); use 1F1B, GPipe or Interleaved1F1B for "
            "a run with validation, or eval_steps: 0")
    if d.eval_fraction > 0 and d.streaming:
        problems.append("data.eval_fraction with data.streaming: the held-out rows would need a full read of the "
                        "stream before the first step; use data.eval_dataset")
    return problems


def _format_problems(d: Any) -> list[str]:
    """messages rows need a chat template; the first row decides under format auto (local data only)."""
    if d.train_on != "assistant" and d.format in ("text", "input_ids"):
        return [f"data.train_on={d.train_on!r} applies to messages and prompt_completion rows; data.format "
                f"{d.format} trains on {'every token' if d.format == 'text' else 'its labels'}: remove train_on"]
    fmt = d.format
    if fmt == "auto" and d.dataset != "builtin" and os.path.exists(d.dataset) and not d.streaming:
        from xorl.data.corpus import DataError
        from xorl.data.formats import detect_format
        from xorl.data.loader import source_rows

        try:
            first = next(source_rows(d.dataset, d.split, d.seed), None)
        except (DataError, OSError, ImportError):
            return []  # the reader names the problem at start-up, with its line
        fmt = detect_format(first[0], d.text_key) if first is not None else None
    if fmt != "messages":
        return []
    from xorl.data.tokenizer import build_tokenizer

    try:
        hf = getattr(build_tokenizer(d.tokenizer), "hf", None)
    except (OSError, ValueError, ImportError):
        return []  # reported by _tokenizer_problems
    if hf is None or not getattr(hf, "chat_template", None):
        how = "data.format: messages" if d.format == "messages" else f"the rows of {d.dataset!r} are 'messages'"
        return [f"{how}, which are rendered with the tokenizer's chat template, and data.tokenizer={d.tokenizer!r} has "
                "none (tokenizer_config.json 'chat_template' or chat_template.jinja); use a model folder that ships "
                "one, or give the rows as 'text' or 'prompt' + 'completion'"]
    return []


def _tokenizer_problems(tokenizer: str, vocab_size: int) -> list[str]:
    from xorl.data.tokenizer import build_tokenizer

    if tokenizer not in ("byte", "") and not os.path.exists(tokenizer):
        return [f"data.tokenizer={tokenizer!r}: no such file; use 'byte' or a local tokenizer.json"]
    try:
        size = build_tokenizer(tokenizer).vocab_size
    except (OSError, ValueError, ImportError) as e:
        return [f"data.tokenizer={tokenizer!r}: cannot load it: {e}"]
    if vocab_size < size:
        return [
            f"model.vocab_size={vocab_size} is too small for data.tokenizer={tokenizer!r}, which has {size} "
            f"tokens; use vocab_size >= {size} (e.g. {_next_multiple(size, 16)}: a multiple of 16 is faster)"
        ]
    return []


def _parallel_data_problems(d: Any, p: ParallelConfig) -> list[str]:
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
                f"truncated); use seq_len {_next_multiple(d.seq_len, divisor)}"
            )
    if p.sequence_parallel and p.tp > 1:
        local = d.seq_len // p.cp
        if d.seq_len % p.cp == 0 and local % p.tp:
            problems.append(
                f"data.seq_len={d.seq_len}: sequence_parallel splits the {local} tokens each "
                f"context-parallel rank holds across tensor_parallel_size={p.tp}; use seq_len "
                f"{_next_multiple(d.seq_len, p.cp * p.tp)}"
            )
    return problems


def _moe_token_split_problems(m: Any, d: Any, p: ParallelConfig) -> list[str]:
    """Under TP the MoE blocks run on each TP rank's share of the tokens (plans/tensor_parallel.py)."""
    if not m.num_experts or p.tp == 1 or p.sequence_parallel or not isinstance(d.seq_len, int):
        return []  # under sequence parallel the rule above already asks for it
    local = d.seq_len // p.cp
    if d.seq_len % p.cp == 0 and local % p.tp:
        return [
            f"data.seq_len={d.seq_len}: the MoE blocks split the {local} tokens each context-parallel rank "
            f"holds across tensor_parallel_size={p.tp}; use seq_len {_next_multiple(d.seq_len, p.cp * p.tp)}"
        ]
    return []


def _data_parallel_mode_problems(t: Any, p: ParallelConfig) -> list[str]:
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


def _selective_checkpointing_problems(m: Any, t: Any, p: ParallelConfig) -> list[str]:
    """Selective recompute replays a block's ops against the ones its forward saved; the experts'
    own FSDP unit (EP or TP > 1 under fsdp2: xorl/plans/data_parallel.py) runs FSDP hooks inside
    the block whose recompute differs from the forward, which torch's checkpoint rejects mid-step."""
    nested_experts = m.num_experts and t.data_parallel_mode == "fsdp2" and (p.ep > 1 or p.tp > 1)
    if t.activation_checkpointing == "selective" and nested_experts:
        return [
            f"train.activation_checkpointing='selective' with an MoE model under expert_parallel_size={p.ep}, "
            f"tensor_parallel_size={p.tp}: the experts are an FSDP unit of their own inside each block, whose "
            "hooks do not replay the same way in the recompute; use activation_checkpointing: full (or none)"
        ]
    return []


def _export_problems(m: Any, t: Any) -> list[str]:
    if not t.export_hf:
        return []
    if m.model_type != "qwen3_moe":  # whatever the family's transformers class cannot hold
        from xorl.models.registry import to_hf_config_dict

        try:
            to_hf_config_dict(m)
        except ValueError as e:
            return [f"train.export_hf=true: {e}; set export_hf: false (the checkpoints keep the weights)"]
        return []
    problems = []
    if m.router_scoring != "softmax":
        problems.append(
            f"train.export_hf=true with model.router_scoring={m.router_scoring!r}: transformers' "
            "Qwen3MoeForCausalLM routes with softmax only, so the export could not be loaded as this model; "
            "set export_hf: false (the checkpoints keep the weights) or router_scoring: softmax"
        )
    if m.shared_expert_intermediate_size:
        problems.append(
            f"train.export_hf=true with model.shared_expert_intermediate_size="
            f"{m.shared_expert_intermediate_size}: transformers' Qwen3MoeForCausalLM has no shared expert; "
            "set export_hf: false (the checkpoints keep the weights) or shared_expert_intermediate_size: 0"
        )
    if m.router_expert_bias:
        problems.append(
            "train.export_hf=true with model.router_expert_bias=true: transformers' Qwen3MoeForCausalLM has no "
            "expert selection bias, so the export would route differently; set export_hf: false or "
            "router_expert_bias: false"
        )
    return problems


def _router_problems(m: Any) -> list[str]:
    problems = []
    if m.router_expert_bias and m.num_experts == 0:
        problems.append("model.router_expert_bias=true needs an MoE model (num_experts > 0); remove it")
    if not m.router_bias_update_rate > 0:
        problems.append(f"model.router_bias_update_rate={m.router_bias_update_rate} must be > 0")
    return problems


# -- train ---------------------------------------------------------------------------------
def _train_problems(t: Any) -> list[str]:
    problems = _at_least("train", t, 0, "warmup_steps", "save_steps")
    problems += _at_least("train", t, 1, "max_steps", "log_steps")
    not_finite = [name for name in ("lr", "min_lr_ratio", "weight_decay", "adam_eps", "max_grad_norm",
                                    "collective_timeout_s", "heartbeat_s") if not math.isfinite(getattr(t, name))]
    not_finite += ["adam_betas"] if not all(math.isfinite(b) for b in t.adam_betas) else []
    problems += [f"train.{name}={getattr(t, name)!r} must be a finite number" for name in not_finite]
    if not t.lr > 0:
        problems.append(f"train.lr={t.lr} must be > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(
            f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1] (final lr = min_lr_ratio x lr)"
        )
    if not t.weight_decay >= 0:
        problems.append(f"train.weight_decay={t.weight_decay} must be >= 0")
    if not all(0 <= b < 1 for b in t.adam_betas):
        problems.append(f"train.adam_betas={list(t.adam_betas)} must each be in [0, 1)")
    if not t.adam_eps > 0:
        problems.append(f"train.adam_eps={t.adam_eps} must be > 0")
    if not t.max_grad_norm >= 0:
        problems.append(f"train.max_grad_norm={t.max_grad_norm} must be >= 0 (0 disables clipping)")
    if t.activation_checkpointing_every_n_layers < 1:
        problems.append(
            f"train.activation_checkpointing_every_n_layers={t.activation_checkpointing_every_n_layers} "
            "must be >= 1 (1: every decoder block)"
        )
    elif t.activation_checkpointing_every_n_layers > 1 and t.activation_checkpointing in ("selective", "none", False):
        problems.append(
            f"train.activation_checkpointing_every_n_layers={t.activation_checkpointing_every_n_layers} applies to "
            f"activation_checkpointing: full, not {t.activation_checkpointing!r}; set activation_checkpointing: full "
            "or activation_checkpointing_every_n_layers: 1"
        )
    if getattr(t, "selective_checkpoint", "matmuls") != "matmuls" and t.activation_checkpointing != "selective":
        problems.append(
            f"train.selective_checkpoint={t.selective_checkpoint!r} applies to activation_checkpointing: "
            f"selective, not {t.activation_checkpointing!r}; set activation_checkpointing: selective or "
            "selective_checkpoint: matmuls"
        )
    if t.fsdp_reshard_after_forward == "always" and t.pipeline_parallel_size > 1 and \
            getattr(PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule), "split_backward", False):
        problems.append(
            "train.fsdp_reshard_after_forward: always with pipeline_parallel_schedule: "
            f"{t.pipeline_parallel_schedule}: "
            "zero-bubble schedules run each microbatch's weight gradients in a later pass that needs the stage's "
            "parameters still gathered; use fsdp_reshard_after_forward: default (or never), or the 1F1B / "
            "Interleaved1F1B schedule"
        )
    if t.fsdp_reshard_after_forward != "default" and t.data_parallel_mode != "fsdp2":
        problems.append(
            f"train.fsdp_reshard_after_forward={t.fsdp_reshard_after_forward!r} needs data_parallel_mode: fsdp2 "
            f"(it is {t.data_parallel_mode!r}); remove the setting or use fsdp2"
        )
    if not t.collective_timeout_s > 0:
        problems.append(f"train.collective_timeout_s={t.collective_timeout_s} must be > 0 (seconds)")
    if not t.heartbeat_s >= 0:
        problems.append(f"train.heartbeat_s={t.heartbeat_s} must be >= 0 (0: no heartbeat lines)")
    if not t.preempt_grace_s > 0:
        problems.append(f"train.preempt_grace_s={t.preempt_grace_s} must be > 0 (seconds from a preemption "
                        "signal to the exit)")
    if isinstance(t.resume, str) and not os.path.exists(t.resume):
        problems.append(
            f"train.resume={t.resume!r}: no such checkpoint; use true (latest in output_dir) or false"
        )
    problems += _output_dir_problems(t.output_dir)
    return problems


def _output_dir_problems(output_dir: str) -> list[str]:
    """output_dir must be a folder this process can write, or creatable inside one."""
    if not output_dir:
        return ["train.output_dir is empty; name a folder for checkpoints and metrics"]
    path = os.path.abspath(output_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing == path and not os.path.isdir(path):
        return [f"train.output_dir={output_dir!r} is a file, not a folder; choose a folder"]
    if not os.path.isdir(existing):
        return [f"train.output_dir={output_dir!r} cannot be created: {existing!r} is a file"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"train.output_dir={output_dir!r}: {existing!r} is not writable; choose a folder you can write"]
    return []


# -- torch.compile -------------------------------------------------------------------------
def _compile_problems(t: Any, m: Any) -> list[str]:
    """The layouts whose code torch.compile cannot trace as one graph per block, refused before they
    fail mid-run (each decoder block is compiled with fullgraph=True: xorl/parallelize.py)."""
    if not t.compile:
        return []
    problems = []
    if t.tensor_parallel_size > 1:
        problems.append(
            f"train.compile with tensor_parallel_size={t.tensor_parallel_size}: the tensor-parallel layers "
            "overlap their collectives inside autograd Functions (async all_reduce, ring point-to-point: "
            "xorl/nn/tp_*.py), which torch.compile cannot trace; set compile: false or tensor_parallel_size: 1"
        )
    schedule = PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule)
    if t.pipeline_parallel_size > 1 and schedule is not None and schedule.split_backward:
        problems.append(
            f"train.compile with pipeline_parallel_schedule: {t.pipeline_parallel_schedule}: zero-bubble schedules "
            "split each block's backward into an input pass and a later weight pass, but a compiled block has one "
            "fused backward (which frees its buffers after the first pass); use 1F1B, Interleaved1F1B or GPipe, "
            "or compile: false"
        )
    if m.attn_implementation == "flash_attn" and t.ringattn_parallel_size * t.ulysses_parallel_size == 1:
        problems.append(
            "train.compile with model.attn_implementation: flash_attn (no context parallelism): the flash-attn "
            "package's functions trace only in the versions that register them as torch custom ops, and xorl has "
            "not verified any under compile; use attn_implementation: xorl (or sdpa), or compile: false"
        )
    return problems


# -- FP8 ----------------------------------------------------------------------------------
def _fp8_problems(t: Any, m: Any) -> list[str]:
    """train.fp8 (xorl_kernels/fp8): what it needs, and the combinations it does not cover.

    Every parallel layout composes: the FP8 GEMMs are local to each linear (TP shards quantise
    their own shards, the ring-overlapped TP paths each chunk), FSDP2 / HSDP gather the
    high-precision weights as before (or, with fp8_all_gather, their tensorwise float8 cast), and
    EP / PP / CP do not touch the linears' maths."""
    problems = _fp8_all_gather_problems(t) if t.fp8_all_gather else []
    if t.fp8 == "none":
        return problems
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        problems.append(
            f"train.fp8: {t.fp8} quantises with torchao's float8 scaling helpers, and torchao is not installed; "
            "pip install torchao (the 'fp8' extra), or set fp8: none"
        )
    if t.compile:
        problems.append(
            f"train.fp8: {t.fp8} with train.compile: the FP8 GEMMs are autograd Functions around torch._scaled_mm "
            "and a Triton kernel that are not registered as torch custom ops, so a compiled block would break "
            "its graph (and fullgraph is on); set compile: false, or fp8: none"
        )
    from xorl.models.families import MODEL_TYPES, family

    if t.fp8 == "blockwise" and m.model_type in MODEL_TYPES and family(m.model_type).expert_biases:
        problems.append(
            f"train.fp8: blockwise with model_type={m.model_type!r}: its experts add per-expert biases, and the "
            "FP8 grouped GEMM takes none; use fp8: rowwise or tensorwise (the experts then compute in train.dtype)"
        )
    return problems


def _fp8_all_gather_problems(t: Any) -> list[str]:
    """train.fp8_all_gather (xorl/nn/fp8_all_gather.py): FSDP2 gathers tensorwise-cast weights."""
    if t.fp8 != "tensorwise":
        return [
            f"train.fp8_all_gather: true with train.fp8: {t.fp8}: only tensorwise scaling can be all-gathered in "
            "float8 (each shard cast with the whole weight's one scale; per-row or per-block scales computed on "
            "a shard are not the whole weight's under every shard layout); set fp8: tensorwise, or "
            "fp8_all_gather: false"
        ]
    problems = []
    if t.data_parallel_mode != "fsdp2":
        problems.append(
            f"train.fp8_all_gather: true with data_parallel_mode: {t.data_parallel_mode}: the float8 all-gather is "
            "FSDP2's weight all-gather; set data_parallel_mode: fsdp2, or fp8_all_gather: false"
        )
    if t.tensor_parallel_size > 1:
        problems.append(
            "train.fp8_all_gather: true with tensor_parallel_size > 1: the TP linears run their own GEMMs on "
            "their local shards and take no float8-gathered weight; set fp8_all_gather: false (TP's linears "
            "then gather in train.dtype), or tensor_parallel_size: 1"
        )
    return problems


def _lora_problems(m: Any, t: Any) -> list[str]:
    """model.lora: {rank >= 1, alpha > 0, dropout in [0, 1), target_modules: the family's projections}."""
    lora = m.lora
    if lora is None:
        return []
    from xorl.nn.lora import EXPERT_LORA_FAMILIES, LINEAR_TARGETS, LORA_KEYS

    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown or "rank" not in lora or "target_modules" not in lora:
        return [f"model.lora={lora!r}: give rank and target_modules (alpha, dropout, init_lora_weights optional)"
                + (f"; unknown keys {unknown}, the keys are {list(LORA_KEYS)}" if unknown else "")]
    problems = []
    rank, alpha, dropout = lora["rank"], lora.get("alpha", lora["rank"]), lora.get("dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"model.lora.rank={rank!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        problems.append(f"model.lora.alpha={alpha!r} must be a number > 0 (the scaling is alpha / rank)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"model.lora.dropout={dropout!r} must be in [0, 1)")
    if not isinstance(lora.get("init_lora_weights", True), bool):
        problems.append("model.lora.init_lora_weights must be true (B = 0, peft's default) or false")
    from xorl.models.schema import MLA

    if m.model_type in MLA:
        return problems + [f"model.lora with model_type={m.model_type!r}: adapters on multi-head latent attention "
                           "(xorl/models/mla.py) are not supported yet; fine-tune it without model.lora"]
    targets = lora["target_modules"]
    valid = list(LINEAR_TARGETS) + (["experts"] if m.num_experts else [])
    if not isinstance(targets, list) or not targets or not all(isinstance(x, str) for x in targets):
        return problems + [f"model.lora.target_modules={targets!r}: give a non-empty list of module names from "
                           f"{valid}"]
    if "experts" in targets and m.num_experts and m.model_type not in EXPERT_LORA_FAMILIES:
        problems.append(f"model.lora.target_modules: 'experts' with model_type={m.model_type!r}: per-expert adapters "
                        f"are checked against peft for {list(EXPERT_LORA_FAMILIES)} only; target the attention "
                        f"projections {list(LINEAR_TARGETS[:4])}")
    if "experts" in targets and dropout:
        problems.append(f"model.lora.dropout={dropout} with 'experts' targeted: peft's expert adapters take no "
                        "dropout (the delta is applied to the weight); set dropout: 0")
    wrong = [x for x in targets if x not in valid]
    if wrong:
        problems.append(f"model.lora.target_modules: {wrong} are not module names of model_type="
                        f"{m.model_type!r}; the valid names are {valid}")
    merged = [(flag, names) for flag, names in (("merge_qkv", ("q_proj", "k_proj", "v_proj")),
                                               ("merge_gate_up", ("gate_proj", "up_proj")))
              if getattr(m, flag) and set(names) & set(targets)]
    for flag, names in merged:
        problems.append(f"model.lora targets {sorted(set(names) & set(targets))} with model.{flag}=true: peft's "
                        f"adapters are per projection; set {flag}: false")
    dense_layers = m.num_experts == 0 or bool(m.mlp_only_layers) or m.first_k_dense_replace > 0 \
        or m.decoder_sparse_step > 1
    mlp = [x for x in targets if x in ("gate_proj", "up_proj", "down_proj")]
    if mlp and not dense_layers:
        problems.append(f"model.lora.target_modules {mlp}: this MoE model has no dense MLP layer, so they match no "
                        "module; target the attention projections (q_proj, k_proj, v_proj, o_proj)")
    if dropout and t.tensor_parallel_size > 1 and not t.sequence_parallel:
        problems.append(f"model.lora.dropout={dropout} with tensor_parallel_size={t.tensor_parallel_size} and "
                        "sequence_parallel=false: every TP rank would drop the replicated input differently; "
                        "set train.sequence_parallel: true or lora dropout: 0")
    return problems


# -- schedule, length, logs, profiling ------------------------------------------------------
def _training_loop_problems(t: Any, d: Any) -> list[str]:
    """lr_schedule and its knobs, num_epochs, the W&B / TensorBoard sinks and the profiler.

    A knob the chosen schedule does not use is refused when it differs from its default (never
    silently ignored); the default itself passes, so the run folder's config.yaml loads back."""
    from xorl.log_sinks import missing_logging_packages

    problems, default = [], type(t)()  # TrainConfig's defaults (xorl.config imports this module)
    if t.lr_schedule == "constant" and t.min_lr_ratio != default.min_lr_ratio:
        problems.append(f"train.min_lr_ratio={t.min_lr_ratio} has no effect with lr_schedule: constant (no decay); "
                        "remove it, or choose lr_schedule: cosine, linear or wsd")
    if not (math.isfinite(t.decay_fraction) and 0 < t.decay_fraction <= 1):
        problems.append(f"train.decay_fraction={t.decay_fraction} must be in (0, 1] (the fraction of max_steps, "
                        "at the end, that lr_schedule: wsd decays over)")
    elif t.lr_schedule != "wsd" and t.decay_fraction != default.decay_fraction:
        problems.append(f"train.decay_fraction={t.decay_fraction} applies to lr_schedule: wsd, not "
                        f"{t.lr_schedule}; set lr_schedule: wsd or remove decay_fraction")
    if t.num_epochs is not None:
        if not (math.isfinite(t.num_epochs) and t.num_epochs > 0):
            problems.append(f"train.num_epochs={t.num_epochs} must be a number > 0 (passes over the data)")
        if d.streaming:
            problems.append("train.num_epochs needs the data's length, and data.streaming reads the files as "
                            "training goes without counting them first; set train.max_steps instead, or "
                            "data.streaming: false")
    for name in ("wandb_run_name", "wandb_mode"):
        if getattr(t, name) is not None and t.wandb_project is None:
            problems.append(f"train.{name}={getattr(t, name)!r} has no effect without train.wandb_project; set "
                            f"wandb_project (the W&B project to log to) or remove {name}")
    problems += missing_logging_packages(t)
    steps = t.profile_steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        problems.append(f"train.profile_steps={steps} must be [start, end] with 1 <= start <= end (1-based steps, "
                        "as on the console), or [] for no profiling")
    elif steps and t.num_epochs is None and steps[1] > t.max_steps:
        problems.append(f"train.profile_steps={steps} ends after train.max_steps={t.max_steps}; end at "
                        f"{t.max_steps} or earlier")
    snapshot = t.memory_snapshot_step
    if snapshot is not None and (snapshot < 1 or (t.num_epochs is None and snapshot > t.max_steps)):
        problems.append(f"train.memory_snapshot_step={snapshot} must be a step from 1 to train.max_steps"
                        f"{'' if t.num_epochs is not None else f'={t.max_steps}'} (1-based, as on the console)")
    return problems


# -- helpers -------------------------------------------------------------------------------
def _at_least(section: str, obj: Any, low: int, *names: str) -> list[str]:
    too_small = [name for name in names if getattr(obj, name) < low]
    return [f"{section}.{name}={getattr(obj, name)!r} must be >= {low}" for name in too_small]


def _next_multiple(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor
