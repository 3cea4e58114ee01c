"""The strategy guide: which layouts xorl-plan refuses, warns about, or ranks lower; evaluate one.

Every layout evaluated passes xorl's own checks for that world size (validate_config and the
trainer's support check) and keeps TP inside a node; anything else is refused with the checks'
messages. The strategy guide, in xorl's field names (deviations are warnings that rank a layout
lower; pitfalls are warnings only):

  Dense, by parameters: below 1B data parallel only; 1-10B tensor_parallel_size 2-4; 10-100B
  TP 4-8 with pipeline_parallel_size 2-4; 100-500B TP 8 with PP 4-16; beyond, TP 8 with PP 8-32.
  MoE: TP sized like a dense model of its active parameters (or 1: xorl's TP leaves MoE blocks
  whole), expert_parallel_size as large as the experts and the dp_shard x CP ranks allow (the
  main scaling dimension), PP at most one stage per node (depth across nodes).
  Sequence length: up to 8K no context parallelism (sequence parallel with TP from 2K);
  8K-32K CP 2; 32K and beyond CP 4-8 (cp = ringattn x ulysses).
  If FSDP2 alone (or HSDP; for MoE with EP folded over it) fits and its predicted step is within
  40% of the fastest layout that fits (room for recompute), it is the recommendation and every
  other layout deviates. Likewise a layout's default FSDP2 recipe (RECIPE_FIELDS at "default"),
  when it fits and is within 40% of that layout's fastest fitting recipe: its other recipes deviate.
  Pitfalls: Ulysses or EP all-to-all across nodes, FSDP across nodes without HSDP, PP without
  interleaving (with its bubble fraction), TP on an MoE model (it splits attention only), TP
  without sequence parallel.

A layout fits when its total is at most 90% of --gpu-memory-gb GiB (the rest is the CUDA
context, NCCL communicators and allocator fragmentation). xorl/planner/search.py ranks.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from xorl.config import Config, validate_config
from xorl.config.errors import ConfigError
from xorl.config.sections import set_field
from xorl.distributed.parallel_config import ParallelConfig
from xorl.planner.memory import Memory, even_split_memory, peak_memory
from xorl.planner.shapes import ModelShapes, model_shapes
from xorl.planner.step_time import Hardware, StepTime, bubble_fraction, step_time

HEADROOM = 0.9
TIGHT = 0.9  # of the usable memory: warn, the estimated terms could take the rest
# (parameters below, TP sizes, PP sizes) of the dense-by-size rule
# train fields of the FSDP2 recipe that change a layout's memory and step time (config.py says what each does)
RECIPE_FIELDS = ("fsdp_reshard_after_forward", "pipeline_grad_sync")
SIZE_GUIDE = ((1e9, (1,), (1,)), (1e10, (2, 4), (1,)), (1e11, (4, 8), (2, 4)), (5e11, (8,), (4, 8, 16)),
              (math.inf, (8,), (8, 16, 32)))


@dataclass
class Options:
    gpus: int
    hardware: Hardware = field(default_factory=Hardware)
    global_batch_tokens: int | None = None
    precision: str = "fp32-master"

    @property
    def usable_bytes(self) -> float:
        return HEADROOM * self.hardware.gpu_memory_gb * 2**30


@dataclass
class Candidate:
    layout: dict[str, Any]
    config: Config | None
    memory: Memory
    time: StepTime | None
    fits: bool
    warnings: list[str]
    deviations: list[str] = field(default_factory=list)
    why: str = ""

    def as_json(self) -> dict:
        return {"layout": self.layout, "memory_per_gpu_bytes": self.memory.as_dict(),
                "memory_pp_rank": self.memory.pp_rank,
                "step_time_s": None if self.time is None else self.time.total,
                "step_time_split_s": None if self.time is None else self.time.as_dict(),
                "fp8": None if self.config is None else self.config.train.fp8,  # the recipe the step time priced
                "fits": self.fits, "warnings": self.deviations + self.warnings, "why": self.why}


def layout_of(config: Config, gpus: int) -> dict[str, Any]:
    t = config.train
    p = ParallelConfig.from_config(config, gpus)
    layout = {"data_parallel_mode": t.data_parallel_mode, "data_parallel_replicate_size": p.dp_replicate,
              "data_parallel_shard_size": p.dp_shard, "tensor_parallel_size": p.tp,
              "sequence_parallel": t.sequence_parallel, "pipeline_parallel_size": p.pp}
    if p.pp > 1:
        layout.update(pipeline_parallel_schedule=t.pipeline_parallel_schedule,
                      virtual_pipeline_stages=t.virtual_pipeline_stages)
    layout.update(ringattn_parallel_size=p.ring, ulysses_parallel_size=p.ulysses, expert_parallel_size=p.ep,
                  gradient_accumulation_steps=t.gradient_accumulation_steps,
                  activation_checkpointing=t.activation_checkpointing)
    # The FSDP2 recipe (xorl/planner/search.py tries both choices): priced in memory and step time alike.
    layout.update({key: getattr(t, key) for key in RECIPE_FIELDS if key != "pipeline_grad_sync" or p.pp > 1})
    return layout


def with_layout(config: Config, layout: dict[str, Any], source: str = "--layout") -> Config:
    """A copy of ``config`` with train fields set (each type-checked, unknown names refused)."""
    config = copy.deepcopy(config)
    for key, value in layout.items():
        set_field(config, "train", key, value, f"{source} {key}={value!r}")
    return config


def refusals(config: Config, opts: Options) -> list[str]:
    """Why this layout cannot run on ``opts.gpus`` GPUs (empty when it can)."""
    # Judge the layout, not this machine: the data, the tokenizer and packages such as flash-attn or
    # torchao may live on the cluster only (local=False).
    problems = []
    try:
        validate_config(config, opts.gpus, local=False)
    except ConfigError as e:
        problems += e.problems
    tp, per_node = config.train.tensor_parallel_size, opts.hardware.gpus_per_node
    if tp > per_node:
        problems.append(
            f"train.tensor_parallel_size={tp} spans nodes of {per_node} GPUs: TP communicates in every layer "
            f"and must stay on NVLink; use tensor_parallel_size <= {per_node} and pipeline or data parallelism "
            "across nodes"
        )
    return problems


def evaluate(config: Config, opts: Options, shapes: ModelShapes | None = None) -> Candidate:
    problems = refusals(config, opts)
    if problems:
        raise ConfigError(problems)
    shapes = shapes or model_shapes(config.model)
    p = ParallelConfig.from_config(config, opts.gpus)
    memory = peak_memory(config, p, shapes, opts.precision)
    fits = memory.total <= opts.usable_bytes
    warnings = [] if fits else [f"does not fit: {_gb(memory.total)} GB per GPU (pipeline rank {memory.pp_rank}) "
                                f"> {_gb(opts.usable_bytes)} GB usable"]
    if fits and memory.total > TIGHT * opts.usable_bytes:
        warnings.append(f"tight: {_gb(memory.total)} of {_gb(opts.usable_bytes)} GB usable, and activations and "
                        "other buffers are estimates (scripts/plan_calibrate.py measures them on a GPU)")
    warnings += pitfalls(config, p, opts.hardware, shapes)
    return Candidate(layout_of(config, opts.gpus), config, memory, step_time(config, p, shapes, opts.hardware),
                     fits, warnings, deviations(config, p, shapes, opts.hardware))


def evaluate_count(num_params: int, layout: dict[str, Any], opts: Options) -> Candidate:
    """A bare parameter count: the even-split state arithmetic only."""
    pp = layout.get("pipeline_parallel_size", 1)
    # Microbatches do not change the state arithmetic: enough of them for the schedule unless given.
    config = with_layout(_count_stand_in(), {"gradient_accumulation_steps": pp if isinstance(pp, int) else 1,
                                             **layout})
    try:  # xorl-train's own rules: what it refuses, the shorthand refuses
        validate_config(config, opts.gpus, local=False)
    except ConfigError as e:
        raise ConfigError(e.problems) from None
    p = ParallelConfig.from_config(config, opts.gpus)
    memory = even_split_memory(num_params, p, opts.precision)
    fits = memory.total <= opts.usable_bytes
    warnings = [] if fits else [f"does not fit: {_gb(memory.total)} GB per GPU > {_gb(opts.usable_bytes)} GB usable"]
    warnings.append("a parameter count has no shapes: activations, other buffers and step time are not estimated, "
                    "and parameters are split evenly over TP x PP (x FSDP shards); pass an xorl YAML or a HF folder")
    return Candidate(layout_of(config, opts.gpus), None, memory, None, fits, warnings)


def _count_stand_in() -> Config:
    """The config a bare parameter count is checked as: xorl's defaults, with a model and sequence whose
    every size divides by any power-of-two layout (heads, KV heads, layers, seq_len, vocabulary), so
    validate_config refuses exactly the layout rules (sizes, DDP with TP / EP, schedules, compile ...)
    and nothing about shapes a count does not have."""
    config = Config()
    for key, value in {"vocab_size": 2**16, "hidden_size": 2**12, "intermediate_size": 2**12,
                       "num_hidden_layers": 2**10, "num_attention_heads": 2**10, "num_key_value_heads": 2**10,
                       "head_dim": 2**2, "max_position_embeddings": 2**16}.items():
        set_field(config, "model", key, value, "a parameter count's stand-in shapes")
    set_field(config, "data", "seq_len", 2**16, "a parameter count's stand-in shapes")
    return config


# -- the guide -----------------------------------------------------------------------------
def pitfalls(config: Config, p: ParallelConfig, hw: Hardware, shapes: ModelShapes) -> list[str]:
    t, per_node, out = config.train, hw.gpus_per_node, []
    moe = config.model.num_experts > 0
    if p.ulysses > 1 and p.tp * p.ulysses > per_node:
        out.append(f"Ulysses all-to-alls cross nodes (tensor_parallel_size x ulysses_parallel_size = "
                   f"{p.tp * p.ulysses} > {per_node} GPUs per node): attention's all-to-alls run over IB")
    # EP groups are consecutive ranks of the dp_shard x CP x TP fold, TP innermost (ParallelConfig.ep_fold):
    # an EP group leaves the node only when it is larger than one, whatever TP is.
    if moe and p.ep > per_node:
        out.append(f"EP all-to-alls cross nodes (expert_parallel_size={p.ep} > {per_node} GPUs per node): "
                   "every MoE layer's dispatch and combine run over IB")
    if t.data_parallel_mode == "fsdp2" and p.dp_shard_cp > 1 and p.tp * p.dp_shard_cp > per_node:
        out.append(f"FSDP shards over {p.dp_shard_cp} ranks spanning nodes: every layer's all-gather and "
                   "reduce-scatter crosses IB (HSDP, data_parallel_replicate_size > 1, keeps them in a node)")
    if p.pp > 1:
        m, v = t.gradient_accumulation_steps, t.virtual_pipeline_stages
        bubble = bubble_fraction(p.pp, m, v)
        if t.pipeline_parallel_schedule in ("1F1B", "GPipe"):
            out.append(f"pipeline_parallel_schedule={t.pipeline_parallel_schedule} without interleaving: the bubble "
                       f"(p-1)/(m+p-1) is {bubble:.0%} of the step; Interleaved1F1B with virtual_pipeline_stages: 2 "
                       f"makes it {bubble_fraction(p.pp, m, 2):.0%}")
        else:
            out.append(f"pipeline bubble (p-1)/(v m+p-1) = {bubble:.0%} of the step")
    if moe and p.tp > 1:
        out.append(f"tensor_parallel_size={p.tp} on an MoE model: TP splits attention only; each MoE block runs on "
                   "its TP rank's token shard with the experts split by expert_parallel_size, which is the MoE "
                   "dimension to grow")
    if p.tp > 1 and not t.sequence_parallel and config.data.seq_len >= 2048:
        out.append("tensor_parallel_size > 1 without sequence_parallel: norms and residuals hold the full "
                   "sequence on every TP rank; set sequence_parallel: true")
    return out


def deviations(config: Config, p: ParallelConfig, shapes: ModelShapes, hw: Hardware) -> list[str]:
    """Where this layout departs from the guide (the module docstring), one line each."""
    moe, out = config.model.num_experts > 0, []
    sized = shapes.active_params if moe else shapes.num_params
    _, tps, pps = next(row for row in SIZE_GUIDE if sized < row[0])
    tps = (1, *tps) if moe else tps
    nodes = max(1, p.world_size // hw.gpus_per_node)
    pps = tuple(x for x in (1, 2, 4, 8, 16, 32) if x <= nodes) if moe else pps
    what = f"{sized / 1e9:.1f}B {'active parameters' if moe else 'parameters'}"
    if p.tp not in tps:
        out.append(f"guide: tensor_parallel_size {_choices(tps)} for {what}, not {p.tp}")
    if p.pp not in pps:
        why = f"{nodes} node(s): PP spans depth across nodes" if moe else what
        out.append(f"guide: pipeline_parallel_size {_choices(pps)} for {why}, not {p.pp}")
    seq = config.data.seq_len
    cps = (1,) if seq <= 8192 else (2,) if seq < 32768 else (4, 8)
    if p.cp not in cps:
        out.append(f"guide: context parallel (ringattn x ulysses) {_choices(cps)} at seq_len {seq}, not {p.cp}")
    if moe:
        best = math.gcd(config.model.num_experts, p.dp_shard_cp)
        if p.ep != best:
            out.append(f"guide: EP is the main MoE dimension: expert_parallel_size={best} "
                       f"(the most {config.model.num_experts} experts allow over {p.dp_shard_cp} ranks), not {p.ep}")
    return out


def is_simple(layout: dict[str, Any], config: Config) -> bool:
    """FSDP2 alone, or HSDP (for MoE, with EP folded over all of each FSDP group)."""
    shard = layout["data_parallel_shard_size"]
    experts = config.model.num_experts
    return (layout["data_parallel_mode"] == "fsdp2" and layout["tensor_parallel_size"] == 1
            and layout["pipeline_parallel_size"] == 1
            and layout["ringattn_parallel_size"] * layout["ulysses_parallel_size"] == 1
            and (not experts or layout["expert_parallel_size"] == math.gcd(experts, shard)))


def _choices(values: tuple[int, ...]) -> str:
    """The sizes the guide allows: one, a set such as {1, 4, 8}, never a range it does not mean."""
    values = tuple(sorted(set(values)))
    return str(values[0]) if len(values) == 1 else "{" + ", ".join(map(str, values)) + "}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f}"
