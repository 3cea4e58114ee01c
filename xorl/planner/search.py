"""Enumerate the layouts of a model on N GPUs and rank them; the first is the recommendation.

Enumerated (powers of two): tensor_parallel_size up to the GPUs of a node; pipeline_parallel_size
up to 16 and the layer count, with 1F1B and Interleaved1F1B (2 stages per rank); context
parallelism cp with at least 1024 tokens per rank, split as Ulysses first (as many heads as a node
holds) and the rest ring, or all ring; data_parallel_replicate_size 1, or one node per FSDP group
(HSDP); for MoE expert_parallel_size 1, the largest inside a node and the largest;
activation checkpointing on and off; sequence_parallel whenever TP > 1; the FSDP2 recipe
(recipe_choices): train.fsdp_reshard_after_forward default (ZeRO-3) or never (each block's gathered
parameters kept to its backward) and, with PP > 1, train.pipeline_grad_sync default (per
microbatch) or per_step, each unless the YAML fixed it (not "default"): kept, as the YAML's fp8,
compile and other fields outside the layout are (a YAML's sizes are searched over). A pipeline_grad_sync
the YAML fixed applies to pipelines only, so the layouts without one are then refused. Each
layout must pass the checks of xorl/planner/guide.py; the rest are dropped.

Ranking: layouts that fit first, then fewer guide deviations, then the shorter predicted step
(a non-default recipe deviates where the same layout's default recipe fits within SIMPLE_SLOWDOWN);
layouts that do not fit follow, smallest first. Every layout trains the same global batch
(gradient_accumulation_steps = tokens / (micro_batch_size x seq_len x dp); layouts for which
that is not a whole number are skipped), so step times compare throughput.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from xorl.config import Config
from xorl.config.errors import ConfigError
from xorl.distributed.parallel_config import ParallelConfig
from xorl.planner.guide import RECIPE_FIELDS, Candidate, Options, evaluate, is_simple, with_layout
from xorl.planner.shapes import model_shapes

MAX_PP = 16
MIN_TOKENS_PER_RANK = 1024
# FSDP2 alone is recommended when it fits and is at most this much slower than the fastest layout:
# room for full recompute's extra forward (4/3), which FSDP alone often needs, and for the TP
# costs a roofline does not see (smaller matmuls, communication not fully hidden).
SIMPLE_SLOWDOWN = 1.4


def default_global_batch(config: Config, gpus: int) -> int:
    """The config's own batch when its layout is valid on ``gpus``; else one row per GPU."""
    d = config.data
    try:
        config.validate(gpus, local=False)
    except ConfigError:
        return d.micro_batch_size * d.seq_len * gpus
    p = ParallelConfig.from_config(config, gpus)
    return config.train.gradient_accumulation_steps * d.micro_batch_size * d.seq_len * p.dp


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def candidate_layouts(config: Config, opts: Options, tokens: int) -> Iterator[dict[str, Any]]:
    m, d, per_node = config.model, config.data, opts.hardware.gpus_per_node
    n = opts.gpus
    for tp in _powers(min(per_node, n)):
        for pp in _powers(min(MAX_PP, m.num_hidden_layers)):
            for cp in _powers(max(1, d.seq_len // MIN_TOKENS_PER_RANK)):
                if n % (tp * pp * cp):
                    continue
                dp = n // (tp * pp * cp)
                if tokens % (d.micro_batch_size * d.seq_len * dp):
                    continue
                ga = tokens // (d.micro_batch_size * d.seq_len * dp)
                for ring, ulysses in _cp_splits(cp, tp, m.num_attention_heads, per_node):
                    for replicate in sorted({1, max(1, dp * tp * cp // per_node)}):
                        if dp % replicate:
                            continue
                        shard = dp // replicate
                        for ep in _ep_sizes(m.num_experts, shard * cp, tp, per_node):
                            for schedule in (("1F1B", 1), ("Interleaved1F1B", 2)) if pp > 1 else (("1F1B", 1),):
                                for checkpointing in (True, False):
                                    layout = {
                                        "data_parallel_mode": "fsdp2", "data_parallel_replicate_size": replicate,
                                        "data_parallel_shard_size": shard, "tensor_parallel_size": tp,
                                        "sequence_parallel": tp > 1, "pipeline_parallel_size": pp,
                                        "pipeline_parallel_schedule": schedule[0],
                                        "virtual_pipeline_stages": schedule[1], "ringattn_parallel_size": ring,
                                        "ulysses_parallel_size": ulysses, "expert_parallel_size": ep,
                                        "gradient_accumulation_steps": ga, "activation_checkpointing": checkpointing,
                                    }
                                    for recipe in recipe_choices(layout, config):
                                        yield {**layout, **recipe}


def recipe_choices(layout: dict[str, Any], config: Config) -> list[dict[str, str]]:
    """The FSDP2 recipes tried with ``layout``: fsdp_reshard_after_forward default / never under
    fsdp2, and pipeline_grad_sync default / per_step when PP > 1 too (xorl/config/rules/train.py refuses
    either elsewhere). A field the YAML set to anything but "default" is the user's choice: kept.
    ("always" is not tried: on the schedules searched it reshards as "default" does; per_microbatch
    is "default" there too.)"""
    t = config.train
    if layout["data_parallel_mode"] != "fsdp2":
        return [{}]
    reshard = [t.fsdp_reshard_after_forward] if t.fsdp_reshard_after_forward != "default" else ["default", "never"]
    sync = ["default", "per_step"] if t.pipeline_grad_sync == "default" and layout["pipeline_parallel_size"] > 1 \
        else [t.pipeline_grad_sync]
    return [{"fsdp_reshard_after_forward": r, "pipeline_grad_sync": g} for r in reshard for g in sync]


def _cp_splits(cp: int, tp: int, heads: int, per_node: int) -> list[tuple[int, int]]:
    """(ring, ulysses): Ulysses over as many ranks as hold whole heads inside a node, the rest ring; all ring."""
    ulysses = 1
    while ulysses * 2 <= cp and tp * ulysses * 2 <= per_node and (heads // tp) % (ulysses * 2) == 0:
        ulysses *= 2
    return sorted({(cp // ulysses, ulysses), (cp, 1)})


def _ep_sizes(experts: int, fold: int, tp: int, per_node: int) -> list[int]:
    if not experts:
        return [1]
    largest = math.gcd(experts, fold)
    in_node = max(x for x in _powers(largest) if largest % x == 0 and tp * x <= per_node) if tp <= per_node else 1
    return sorted({1, in_node, largest})


def plan(config: Config, opts: Options) -> list[Candidate]:
    """Every valid enumerated layout, ranked (the first is the recommendation). When none is valid,
    a ConfigError with what refused them: the problems every layout shares (the config's own,
    whatever the layout), else the most frequent."""
    tokens = opts.global_batch_tokens or default_global_batch(config, opts.gpus)
    shapes = model_shapes(config.model)
    candidates, refused = [], []
    for layout in candidate_layouts(config, opts, tokens):
        try:
            candidates.append(evaluate(with_layout(config, layout, "layout"), opts, shapes))
        except ConfigError as e:
            refused.append(e.problems)  # not a layout xorl can run here
    if not candidates and refused:
        raise ConfigError(_why_none(refused, opts.gpus))
    return rank(candidates, config, opts)


def _why_none(refused: list[list[str]], gpus: int) -> list[str]:
    shared = [p for p in refused[0] if all(p in problems for problems in refused[1:])]
    if shared:  # the config's own problems: the same message xorl-train gives
        return shared
    counts: dict[str, int] = {}
    for problems in refused:
        for p in problems:
            counts[p] = counts.get(p, 0) + 1
    common = sorted(counts, key=lambda p: -counts[p])[:3]
    reasons = "; ".join(f"{p} ({counts[p]} of {len(refused)} layouts)" for p in common)
    return [f"no layout is valid on {gpus} GPUs (try another --gpus); the most frequent reasons: {reasons}"]


def fitting_simple_layout(config: Config, opts: Options, tokens: int) -> Candidate | None:
    """The fastest FSDP2-alone layout that fits (one FSDP group, or HSDP with a node per group;
    MoE: EP over all of it; with or without checkpointing), or None."""
    d, m, per_node = config.data, config.model, opts.hardware.gpus_per_node
    if tokens % (d.micro_batch_size * d.seq_len * opts.gpus):
        return None
    fitting = []
    for replicate in sorted({1, max(1, opts.gpus // per_node)}):
        if opts.gpus % replicate:
            continue
        shard = opts.gpus // replicate
        layout = {"data_parallel_mode": "fsdp2", "data_parallel_replicate_size": replicate,
                  "data_parallel_shard_size": shard, "tensor_parallel_size": 1, "sequence_parallel": False,
                  "pipeline_parallel_size": 1, "ringattn_parallel_size": 1, "ulysses_parallel_size": 1,
                  "expert_parallel_size": math.gcd(m.num_experts, shard) if m.num_experts else 1,
                  "gradient_accumulation_steps": tokens // (d.micro_batch_size * d.seq_len * opts.gpus)}
        for checkpointing in (False, True):
            try:
                c = evaluate(with_layout(config, {**layout, "activation_checkpointing": checkpointing}, "layout"), opts)
            except ConfigError:
                continue
            if c.fits:
                fitting.append(c)
    return min(fitting, key=lambda c: c.time.total, default=None)


def preferred(simple: Candidate | None, fastest_s: float) -> bool:
    """Whether the simpler choice (it fits) is close enough to the fastest to be the one recommended."""
    return simple is not None and simple.time.total <= SIMPLE_SLOWDOWN * fastest_s


def apply_simple_rule(candidates: list[Candidate], config: Config, simple: Candidate | None,
                      fastest_s: float) -> None:
    """The guide's first rule: FSDP2 alone, when it fits and its step is within SIMPLE_SLOWDOWN of the
    fastest that fits, is the recommendation; the other layouts deviate."""
    if not preferred(simple, fastest_s):
        return
    for c in candidates:
        if is_simple(c.layout, config):
            c.deviations = []
        else:
            c.deviations.insert(0, f"guide: FSDP2 alone fits ({_short(simple.layout)}, {simple.memory.total / 1e9:.1f} "
                                   f"GB, step {simple.time.total:.2f} s); prefer it")


def apply_recipe_rule(candidates: list[Candidate]) -> None:
    """The same rule for the FSDP2 recipe: where a layout's default recipe fits and its step is within
    SIMPLE_SLOWDOWN of the fastest fitting recipe of that layout, the other recipes deviate (they
    hold more memory, or gathered parameters and unsharded gradients, for too little)."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        base = tuple(sorted((k, v) for k, v in c.layout.items() if k not in RECIPE_FIELDS))
        groups.setdefault(base, []).append(c)
    for group in groups.values():
        fitting = [c for c in group if c.fits]
        default = next((c for c in fitting if _default_recipe(c)), None)
        if len(fitting) < 2 or not preferred(default, min(c.time.total for c in fitting)):
            continue
        for c in group:
            if not _default_recipe(c):
                c.deviations.append(f"guide: the default FSDP2 recipe fits this layout "
                                    f"({default.memory.total / 1e9:.1f} GB, step {default.time.total:.2f} s); "
                                    "prefer it")


def _default_recipe(c: Candidate) -> bool:
    return all(c.layout.get(k, "default") == "default" for k in RECIPE_FIELDS)


def _short(layout: dict) -> str:
    rep, shard = layout["data_parallel_replicate_size"], layout["data_parallel_shard_size"]
    return f"HSDP {rep} x {shard}" if rep > 1 else f"data_parallel_shard_size={shard}"


def rank(candidates: list[Candidate], config: Config, opts: Options) -> list[Candidate]:
    fitting = [c for c in candidates if c.fits]
    if fitting:
        simple = [c for c in fitting if is_simple(c.layout, config)]
        apply_simple_rule(candidates, config, min(simple, key=lambda c: c.time.total, default=None),
                          min(c.time.total for c in fitting))
    apply_recipe_rule(candidates)  # after the simple rule, which clears a simple layout's deviations

    def key(c: Candidate):
        return (0, len(c.deviations), c.time.total) if c.fits else (1, c.memory.total, 0.0)

    ranked = sorted(candidates, key=key)
    for i, c in enumerate(ranked):
        c.why = _why(i, c, ranked[0], opts)
    return ranked


def _why(index: int, c: Candidate, best: Candidate, opts: Options) -> str:
    total, usable = c.memory.total / 1e9, opts.usable_bytes / 1e9
    if not c.fits:
        return f"does not fit: {total:.1f} GB > {usable:.1f} GB usable" + (" (the smallest)" if index == 0 else "")
    if index == 0:
        guide = ("follows the guide" if not c.deviations else
                 f"no fitting layout follows the guide; fewest deviations ({c.deviations[0]})")
        return f"fits ({total:.1f} of {usable:.1f} GB); {guide}; fastest predicted step of those"
    ratio = c.time.total / best.time.total
    mine, theirs = c.time.as_dict(), best.time.as_dict()
    part = max(mine, key=lambda k: mine[k] - theirs[k])
    why = f"{ratio:.2f}x #1's step"
    if ratio > 1 and mine[part] > theirs[part]:
        why += f" (+{mine[part] - theirs[part]:.2f} s {part.replace('_', ' ')})"
    return why + "; " + ("follows the guide" if not c.deviations else c.deviations[0])
