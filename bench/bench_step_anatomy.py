"""The anatomy of one training step: collectives, bytes sent, host syncs and FLOPs per rank (exact, CPU).

Every layout of examples/*.yaml is scaled down to the tiny model of tests/support/parity_runs.py (hidden
32, 4 layers, vocab 272; the MoE layouts 8 experts, top-2) and its parallel dims to 2 (expert
parallel in proportion), and runs the real Trainer on gloo ranks. After one warm-up step, ONE step
(``Trainer.train_step``) is measured on every rank:

- collectives, by kind, with the bytes this rank sends. Every torch.distributed call reaches a
  ``ProcessGroup`` method (FSDP2's ``all_gather_single`` / ``reduce_scatter_single``, xorl's ring
  ``batch_isend_irecv``, the all_to_alls inside xorl's custom ops, ...); those methods are wrapped
  for the step. Functional collectives (DTensor redistributions, the EP dispatch of the hidden
  rows) call the process group from C++: a TorchDispatchMode counts the ``_c10d_functional`` ops.
  Bytes sent, per kind (the payload convention, not a wire model; each event also records its
  group size, from which ring wire bytes follow):

  ========================  ===========================================================
  all_reduce                the tensor's bytes
  all_gather                the input (this rank's shard)
  reduce_scatter            the input (the full unreduced buffer)
  all_to_all                the input rows sent to other ranks (own split excluded)
  p2p_send / p2p_recv       the sent tensor's bytes / 0 (a receive sends nothing)
  broadcast                 the tensor's bytes on the root, 0 elsewhere
  barrier, other            0 / the input's bytes
  ========================  ===========================================================

- host reads of device values (tests/support/host_reads.py's TorchFunctionMode): from the first forward
  to the first optimizer step, and after the last optimizer step to the end of the step (the
  step's one read of its results); the optimizer steps themselves read CPU step counters only.
  Reads that cost nothing on a GPU (checks that return early for CUDA tensors, CPU reference
  kernels) are left out, as tests/multirank/test_host_syncs.py does. The anchor is the minimum: the end
  read plus expert parallelism's split sizes, one per MoE layer per microbatch forward.
- FLOPs (torch.utils.flop_counter.FlopCounterMode around the step): matmuls (aten mm / bmm /
  addmm ...) and xorl's grouped expert GEMMs (a formula registered here: 2 x rows x in x out per
  product). The attention core runs in xorl custom ops (flash_attn, ring_attention) and is not
  counted: its balance under context parallelism is measured exactly in bench_context_parallel.
  The ideal per rank is the same config's single-process FLOPs of the same global batch divided
  by the world size (every dim splits the work); the ratio shows padding, recompute differences,
  pipeline stage imbalance and expert load imbalance.

Rows per layout: each kind's collectives per step (max over ranks; anchor: decoder layers on the
rank x microbatches, so the ratio is the count per layer per microbatch) and bytes sent (anchor:
the model's fp32 parameter bytes), the host reads, and FLOPs max-rank / ideal. Targets:

- lm_head FLOPs per TP rank against 1/TP of the lm_head FLOPs of its data (vocab-parallel head);
- all-reduces of replicated-parameter gradients under TP (``sum_tp_partial_grads``): 1 per step;
- expert-parallel dispatch bytes (the hidden rows) against the deduplicated minimum: a token
  routed to several experts on one destination rank sent there once (from the router's expert ids
  and the expert -> rank map, own rank excluded); target <= 1.05. The 24 bytes of metadata per
  routing slot that travel beside the rows are reported separately, against their exact count.

Counts and bytes are exact on any device (fp32 here; bf16 compute on a GPU halves FSDP's
all-gather and the activation bytes). ``python bench/bench_step_anatomy.py`` is ``python -m bench --only
step_anatomy``: the rows printed, and the results file written to bench/results/ (bench/runner.py).

Here: the layouts and the rows; the counting of collectives is bench/anatomy_comm.py, one measured
step on a rank bench/anatomy_step.py.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, for bench and xorl
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.anatomy_comm import KINDS  # noqa: E402
from bench.anatomy_step import measure_step, reference_flops  # noqa: E402
from bench.context import BenchContext, Result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SCALED_DIM = 2  # every parallel dim above 1 becomes 2
MICROBATCHES = 2  # gradient accumulation steps per data-parallel rank
MOE_EXPERTS, MOE_TOP_K = 8, 2


# ----------------------------------------------------------------------------------------------
# The example layouts, scaled down
# ----------------------------------------------------------------------------------------------
_DIMS = ("data_parallel_replicate_size", "data_parallel_shard_size", "tensor_parallel_size",
         "pipeline_parallel_size", "ulysses_parallel_size", "ringattn_parallel_size")
_EP_FOLD = ("data_parallel_shard_size", "ulysses_parallel_size", "ringattn_parallel_size", "tensor_parallel_size")
_KEPT = ("data_parallel_mode", "sequence_parallel", "pipeline_parallel_schedule", "virtual_pipeline_stages",
         "activation_checkpointing", "fsdp_reshard_after_forward")


@dataclass
class Layout:
    name: str  # the example's file name, without .yaml
    model_type: str
    world: int
    train: dict[str, Any]  # the scaled parallel sizes and the example's other parallel settings
    original: dict[str, int] = field(default_factory=dict)  # the example's sizes

    @property
    def dp(self) -> int:
        return self.train["data_parallel_replicate_size"] * self.train["data_parallel_shard_size"]

    def label(self) -> str:
        short = {"data_parallel_replicate_size": "rep", "data_parallel_shard_size": "fsdp",
                 "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "ulysses_parallel_size": "ulysses",
                 "ringattn_parallel_size": "ring", "expert_parallel_size": "ep"}
        dims = [f"{short[k]}{self.train[k]}" for k in short if self.train.get(k, 1) > 1]
        if self.train.get("sequence_parallel") and self.train["tensor_parallel_size"] > 1:
            dims[dims.index(f"tp{self.train['tensor_parallel_size']}")] += "+sp"
        if self.train["pipeline_parallel_size"] > 1:
            dims.append(self.train["pipeline_parallel_schedule"])
        return " x ".join(dims) or "one rank"


def make_layout(name: str, model_type: str, **sizes) -> Layout:
    """A layout by hand (tests): the given parallel sizes and settings, the rest at their defaults."""
    train = {k: 1 for k in _DIMS}
    train.update(data_parallel_mode="fsdp2", sequence_parallel=False, pipeline_parallel_schedule="1F1B",
                 virtual_pipeline_stages=1, activation_checkpointing=False, fsdp_reshard_after_forward="default")
    train.update(sizes)
    train["gradient_accumulation_steps"] = MICROBATCHES
    return Layout(name, model_type, math.prod(train[k] for k in _DIMS), train, {})


def scale_example(path: Path) -> Layout:
    """The example's layout with every parallel dim above 1 set to 2 (EP in proportion to its fold)."""
    from xorl.config import load_config

    t = load_config(str(path)).train
    original = {k: getattr(t, k) for k in (*_DIMS, "expert_parallel_size")}
    train = {k: (SCALED_DIM if original[k] > 1 else 1) for k in _DIMS}
    if original["expert_parallel_size"] > 1:
        fold = math.prod(original[k] for k in _EP_FOLD)
        scaled_fold = math.prod(train[k] for k in _EP_FOLD)
        ep = original["expert_parallel_size"] * scaled_fold // fold
        if ep < 2 or scaled_fold % ep:
            raise ValueError(f"{path.name}: expert_parallel_size {original['expert_parallel_size']} does not scale")
        train["expert_parallel_size"] = ep
    train.update({k: getattr(t, k) for k in _KEPT})
    train["gradient_accumulation_steps"] = MICROBATCHES
    model_type = load_config(str(path)).model.model_type
    return Layout(path.stem, model_type, math.prod(train[k] for k in _DIMS), train, original)


def example_layouts() -> list[Layout]:
    return [scale_example(p) for p in sorted(EXAMPLES.glob("*.yaml"))]


def model_config(out: str, model_type: str, **train):
    from tests.support.parity_runs import tiny_config

    config = tiny_config(out, model_type, max_steps=2, warmup_steps=0, **train)
    if model_type == "qwen3_moe":
        config.model.num_experts, config.model.num_experts_per_tok = MOE_EXPERTS, MOE_TOP_K
    return config


def reference_config(out: str, layout: Layout):
    """One process, the same model, checkpointing and global batch."""
    train = {k: 1 for k in _DIMS}
    train.update(activation_checkpointing=layout.train["activation_checkpointing"],
                 gradient_accumulation_steps=MICROBATCHES * layout.dp)
    return model_config(out, layout.model_type, **train)


# ----------------------------------------------------------------------------------------------
# Running every layout, and the rows
# ----------------------------------------------------------------------------------------------
def measure_layout(layout: Layout, work_dir: str, world_of, references: dict | None = None) -> dict:
    """One layout: every rank's anatomy and the single-process reference FLOPs. ``world_of(n)``
    gives an n-rank GlooWorld (tests pass their shared worlds); ``references`` caches the
    single-process runs by (model, checkpointing, data ranks)."""
    references = {} if references is None else references
    key = (layout.model_type, layout.train["activation_checkpointing"], layout.dp)
    if key not in references:
        ref_dir = os.path.join(work_dir, f"ref-{len(references)}")
        references[key] = world_of(1).run(reference_flops, reference_config(ref_dir, layout))[0]
    config = model_config(os.path.join(work_dir, f"layout-{layout.name}"), layout.model_type, **layout.train)
    ranks = world_of(layout.world).run(measure_step, config)
    return {"layout": layout, "ranks": ranks, "reference": references[key]}


def measure_layouts(layouts: list[Layout], work_dir: str, timeout_s: float = 900) -> dict[str, dict]:
    """Every layout, on worlds started here (one per world size) and closed at the end."""
    from xorl.testing.multirank import GlooWorld

    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    worlds: dict[int, GlooWorld] = {}

    def world_of(n: int) -> GlooWorld:
        if n not in worlds:
            worlds[n] = GlooWorld(n, timeout_s=timeout_s, env=env)
        return worlds[n]

    references: dict[tuple, dict] = {}
    try:
        return {layout.name: measure_layout(layout, work_dir, world_of, references) for layout in layouts}
    finally:
        for world in worlds.values():
            world.close()


def _per_layer_mb(values: list[int], anchors: list[int]) -> float | None:
    """The count per decoder layer per microbatch, where every rank's divides evenly."""
    if all(a and v % a == 0 for v, a in zip(values, anchors)) and len({v // a for v, a in zip(values, anchors)}) == 1:
        return values[0] // anchors[0]
    return None


def layout_results(name: str, data: dict) -> list[Result]:
    layout: Layout = data["layout"]
    ranks, ref = data["ranks"], data["reference"]
    label = f"{name} [{layout.label()}]"
    first = ranks[0]
    model_bytes = first["num_parameters"] * 4
    anchors = [r["layers"] * r["microbatches"] for r in ranks]
    common = {"layout": layout.label(), "world": layout.world, "example_sizes": layout.original, "exact": True,
              "microbatches_per_rank": MICROBATCHES, "model_type": layout.model_type,
              "activation_checkpointing": layout.train["activation_checkpointing"]}
    results = []
    for kind in KINDS:
        counts = [r["collectives"][kind] for r in ranks]
        if not any(counts):
            continue
        sent = [r["bytes"][kind] for r in ranks]
        sites = {s: n for s, n in first["sites"].items() if s.startswith(kind + " ")}
        results.append(Result(
            name=f"{label}: {kind} per step", value=max(counts), unit="collectives",
            anchor="decoder layers on the rank x microbatches", anchor_value=max(anchors), higher_is_better=False,
            params={**common, "per_rank": counts, "per_layer_per_microbatch": _per_layer_mb(counts, anchors),
                    "rank0_sites": sites}))
        if any(sent):
            results.append(Result(
                name=f"{label}: {kind} bytes sent per step", value=max(sent), unit="bytes",
                anchor="model fp32 parameter bytes", anchor_value=model_bytes, higher_is_better=False,
                params={**common, "per_rank": sent}))
    flops = [r["flops"] for r in ranks]
    ideal = ref["flops"] / layout.world
    results.append(Result(
        name=f"{label}: matmul FLOPs per rank (max)", value=max(flops), unit="FLOP",
        anchor="single-process FLOPs of the global batch / world size", anchor_value=ideal, higher_is_better=False,
        params={**common, "per_rank": flops, "per_rank_over_ideal": [round(f / ideal, 4) for f in flops],
                "single_process": ref["flops"]}))
    moe = layout.model_type == "qwen3_moe" and layout.train.get("expert_parallel_size", 1) > 1
    # Activation checkpointing recomputes each MoE block's forward in backward, dispatch included,
    # so its split sizes are read again there: 2 reads per MoE layer per microbatch.
    from xorl.parallel.activation_checkpointing import checkpointing_mode

    passes = 1 if checkpointing_mode(layout.train["activation_checkpointing"]) == "none" else 2
    needed = [1 + (r["layers"] * r["microbatches"] * passes if moe else 0) for r in ranks]
    reads = [r["host_reads"] for r in ranks]
    results.append(Result(
        name=f"{label}: host reads per step", value=max(reads), unit="reads",
        anchor="the step's end read + EP split sizes (1 per MoE layer per microbatch forward, recompute included)",
        anchor_value=max(needed),
        higher_is_better=False,
        params={**common, "per_rank": reads, "ep_split_reads": [r["ep_split_reads"] for r in ranks],
                "rank0_where": first["host_reads_where"]}))
    if layout.train["tensor_parallel_size"] > 1:
        tp = layout.train["tensor_parallel_size"]
        head = [r["lm_head_flops"] for r in ranks if r["has_lm_head"]]
        data_ranks = first["sizes"]["dp_cp"]
        results.append(Result(
            name=f"{label}: lm_head FLOPs per TP rank", value=max(head), unit="FLOP",
            anchor="1/TP of the single-process lm_head FLOPs of the rank's data", higher_is_better=False,
            anchor_value=ref["lm_head_flops"] / data_ranks / tp,
            params={**common, "per_rank_with_head": head, "single_process": ref["lm_head_flops"], "tp": tp}))
        partial = [r["tp_partial_all_reduces"] for r in ranks]
        results.append(Result(
            name=f"{label}: replicated-gradient all-reduces over TP per step", value=max(partial),
            unit="collectives", anchor="one per step (sum_tp_partial_grads)", anchor_value=1, higher_is_better=False,
            params={**common, "per_rank": partial, "all_on_tp_group": all(r["tp_partial_on_tp"] for r in ranks)}))
    if moe:
        d = [r["dispatch"] for r in ranks]
        measured = sum(x["measured_bytes"] for x in d)
        results.append(Result(
            name=f"{label}: EP dispatch bytes (all ranks)", value=measured, unit="bytes",
            anchor="deduplicated minimum (each token once per destination rank)",
            anchor_value=sum(x["dedup_min_bytes"] for x in d), higher_is_better=False,
            params={**common, "per_rank": d, "topk_rows_bytes": sum(x["topk_rows_bytes"] for x in d),
                    "experts": MOE_EXPERTS, "top_k": MOE_TOP_K, "ep": layout.train["expert_parallel_size"]}))
        results.append(Result(
            name=f"{label}: EP dispatch metadata bytes (all ranks)", value=sum(x["metadata_bytes"] for x in d),
            unit="bytes", anchor="24 bytes per routing slot sent to another rank (weight, local expert, pair index)",
            anchor_value=sum(x["metadata_expected_bytes"] for x in d), higher_is_better=False,
            params={**common, "hidden_rows_bytes": measured}))
    return results


def run(ctx: BenchContext, layouts: list[Layout] | None = None, raw: dict | None = None) -> list[Result]:
    """Every example layout, scaled down, on gloo ranks (CPU; the figures are exact on any device)."""
    layouts = example_layouts() if layouts is None else layouts
    with tempfile.TemporaryDirectory(prefix="xorl-bench-step-anatomy-") as work_dir:
        measured = measure_layouts(layouts, work_dir)
    if raw is not None:
        raw.update(measured)
    return [r for name, data in measured.items() for r in layout_results(name, data)]


def main(argv: list[str] | None = None) -> int:
    """``python bench/bench_step_anatomy.py [--out DIR]``: this benchmark through bench's runner,
    which prints the rows and writes the usual results file."""
    from bench.runner import main as bench_main

    return bench_main(["--only", "step_anatomy", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
