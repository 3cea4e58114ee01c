"""xorl-plan: choose a parallel layout for a model on N GPUs and predict its memory per GPU.

    xorl-plan MODEL --gpus N [--gpus-per-node 8] [--gpu-memory-gb 80] [--seq-len S]
              [--global-batch-tokens T] [--layout field=size,...] [--precision fp32-master|fp16]
              [--peak-tflops F] [--fp8-peak-tflops F] [--hbm-gbps B] [--nvlink-gbps B] [--nic-gbps B]
              [--nics-per-node K] [--fp8 none|tensorwise|rowwise|blockwise] [--efficiency FILE.json] [--top K]
              [--json] [--write-config OUT.yaml]

MODEL: an xorl YAML, a local Hugging Face folder (its config.json), or a parameter count such as
70B (even-split state arithmetic only). Without --layout the valid layouts are ranked (the first
is the recommendation); --layout evaluates one (a bare --layout: the YAML's own). Memory per GPU
is the peak pipeline rank's: parameters, gradients and optimizer state exactly as the trainer
shards them, activations and other buffers from a stated model (xorl/planner/memory.py); the
step time is a roofline with the link bandwidths given (xorl/planner/step_time.py), its GEMMs in FP8
where train.fp8 (or --fp8) puts them (xorl/planner/fp8_time.py).
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from xorl.config import load_config
from xorl.config.errors import ConfigError
from xorl.planner.guide import RECIPE_FIELDS, Candidate, Options, evaluate, evaluate_count, with_layout
from xorl.planner.memory import PRECISIONS
from xorl.planner.search import apply_simple_rule, default_global_batch, fitting_simple_layout, plan
from xorl.planner.source import read_model_source
from xorl.planner.step_time import Hardware


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    hw = Hardware()
    ap = argparse.ArgumentParser(prog="xorl-plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", metavar="MODEL", help="xorl YAML, local Hugging Face folder, or a count like 70B")
    ap.add_argument("--gpus", type=int, required=True, help="world size")
    ap.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    ap.add_argument("--gpu-memory-gb", type=float, default=hw.gpu_memory_gb, help="per GPU, GiB (80: H100 80GB)")
    ap.add_argument("--seq-len", type=int, help="data.seq_len (default: the config's)")
    ap.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (default: the config's)")
    ap.add_argument("--layout", nargs="?", const="", help="evaluate field=size,... (bare: the YAML's own layout)")
    ap.add_argument("--precision", choices=list(PRECISIONS), default="fp32-master",
                    help="bytes per parameter: fp32-master 4/4/8 (xorl-train), fp16 2/2/4 (published tables)")
    ap.add_argument("--peak-tflops", type=float, default=hw.peak_tflops, help="dense bf16 TFLOP/s per GPU")
    ap.add_argument("--fp8-peak-tflops", type=float,
                    help="dense FP8 TFLOP/s per GPU, for train.fp8 (default: 2 x --peak-tflops, Hopper's ratio)")
    ap.add_argument("--fp8", choices=["none", "tensorwise", "rowwise", "blockwise"],
                    help="train.fp8 to plan with (default: the config's; a HF folder or count: none)")
    ap.add_argument("--hbm-gbps", type=float, default=hw.hbm_gbps)
    ap.add_argument("--nvlink-gbps", type=float, default=hw.nvlink_gbps, help="per GPU, inside a node")
    ap.add_argument("--nic-gbps", "--ib-gbps", dest="nic_gbps", type=float, default=hw.nic_gbps,
                    help="GB/s per network NIC (400 Gb/s: 50)")
    ap.add_argument("--nics-per-node", type=int, default=hw.nics_per_node, help="network NICs per node")
    ap.add_argument("--efficiency", metavar="FILE.json",
                    help="kernel / link efficiencies (default: xorl/planner/efficiency.json; "
                         "scripts/plan_calibrate.py writes a refit one)")
    ap.add_argument("--top", type=int, default=8, help="rows of the table (--json lists every layout)")
    ap.add_argument("--json", action="store_true", help='print {"candidates": [...]}')
    ap.add_argument("--write-config", metavar="OUT.yaml", help="write the first candidate as an xorl-train config")
    return ap.parse_args(argv)


def _check_numbers(args: argparse.Namespace) -> None:
    problems = [f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0"
                for name in ("gpus", "gpus_per_node", "gpu_memory_gb", "peak_tflops", "fp8_peak_tflops", "hbm_gbps",
                             "nvlink_gbps", "nic_gbps", "nics_per_node", "top", "seq_len", "global_batch_tokens")
                if getattr(args, name) is not None and not getattr(args, name) > 0]
    if problems:
        raise ConfigError(problems)


def fp8_what(recipe: str) -> str:
    """Which GEMMs the step time prices in FP8 under ``recipe`` (xorl/planner/fp8_time.py)."""
    from xorl.nn.moe_experts import experts_run_fp8

    experts = ", routed experts" if experts_run_fp8(recipe) else ""
    return (f"attention and dense MLP linears{experts}, forward, dgrad and wgrad, with their casts; lm_head, "
            "router and shared expert in train.dtype")


def parse_layout(text: str) -> dict:
    layout = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--layout item {item!r} must be field=value, e.g. tensor_parallel_size=4")
        layout[key.strip()] = yaml.safe_load(value) if value.strip() else value
    return layout


def run(args: argparse.Namespace) -> tuple[list[Candidate], dict]:
    _check_numbers(args)
    hw = Hardware(args.gpus_per_node, args.gpu_memory_gb, args.peak_tflops, args.hbm_gbps, args.nvlink_gbps,
                  args.nic_gbps, args.nics_per_node, args.efficiency, args.fp8_peak_tflops)
    opts = Options(args.gpus, hw, args.global_batch_tokens, args.precision)
    source = read_model_source(args.model)
    layout = parse_layout(args.layout) if args.layout else {}
    if source.config is None:
        if args.layout is None:
            raise ConfigError(f"MODEL={args.model!r} is a parameter count: ranking needs the model's shapes; "
                              "evaluate a layout with --layout field=size,... or pass an xorl YAML / HF folder")
        return [evaluate_count(source.num_params, layout, opts)], {"model": source.label}
    config = source.config
    notes = list(source.notes)
    if args.fp8 is not None:
        config = with_layout(config, {"fp8": args.fp8}, "--fp8")
    if args.seq_len:
        config.data.seq_len = args.seq_len
        if args.seq_len > config.model.max_position_embeddings:
            # The question is "how would this model train at S tokens": a run would need the longer
            # position table too (RoPE extended); the estimate takes it, and says so.
            notes.append(f"model.max_position_embeddings raised from {config.model.max_position_embeddings} to "
                         f"--seq-len {args.seq_len}; a run needs that too")
            config.model.max_position_embeddings = args.seq_len
    tokens = opts.global_batch_tokens or default_global_batch(config, args.gpus)
    header = {"model": source.label, "gpus": args.gpus, "seq_len": config.data.seq_len,
              "global_batch_tokens": tokens, "fp8": config.train.fp8, "notes": notes}
    if args.layout is None:
        return plan(config, opts), header
    if layout and "data_parallel_shard_size" not in layout:
        layout["data_parallel_shard_size"] = -1  # the ranks the other sizes leave
    config = with_layout(config, layout)
    if "gradient_accumulation_steps" not in layout:  # the same global batch as the ranking would train
        config = with_layout(config, {"gradient_accumulation_steps": _microbatches(config, args.gpus, tokens)})
    candidate = evaluate(config, opts)
    apply_simple_rule([candidate], config, fitting_simple_layout(config, opts, tokens), candidate.time.total)
    candidate.why = "the layout asked for"
    return [candidate], header


def _microbatches(config, gpus: int, tokens: int) -> int:
    from xorl.distributed.parallel_config import ParallelConfig

    d, dp = config.data, ParallelConfig.from_config(config, gpus).dp
    per_step = d.micro_batch_size * d.seq_len * dp
    if tokens % per_step:
        raise ConfigError(f"--global-batch-tokens={tokens} is not a multiple of micro_batch_size x seq_len x dp = "
                          f"{per_step}; use {max(1, round(tokens / per_step)) * per_step}")
    return tokens // per_step


# the FSDP2 recipe in the layout column, when not "default"
RECIPE_SHORT = {("fsdp_reshard_after_forward", "never"): "keep", ("fsdp_reshard_after_forward", "always"): "reshard",
                ("pipeline_grad_sync", "per_step"): "sync:step", ("pipeline_grad_sync", "per_microbatch"): "sync:mb"}


def short_layout(layout: dict) -> str:
    """e.g. ``hsdp:2x4 tp:4+sp pp:4x2 ring:2 ep:8 keep sync:step ac ga:16`` (field sizes; pp:PxV = V stages
    per rank; keep: fsdp_reshard_after_forward never; sync:step: pipeline_grad_sync per_step)."""
    mode, rep, shard = (layout[k] for k in ("data_parallel_mode", "data_parallel_replicate_size",
                                            "data_parallel_shard_size"))
    parts = [f"hsdp:{rep}x{shard}" if rep > 1 and mode == "fsdp2" else
             f"{ {'fsdp2': 'fsdp', 'ddp': 'ddp', 'none': 'dp'}[mode]}:{rep * shard}"]
    if layout["tensor_parallel_size"] > 1:
        parts.append(f"tp:{layout['tensor_parallel_size']}" + ("+sp" if layout["sequence_parallel"] else ""))
    if layout["pipeline_parallel_size"] > 1:
        v = layout.get("virtual_pipeline_stages", 1)
        parts.append(f"pp:{layout['pipeline_parallel_size']}" + (f"x{v}" if v > 1 else ""))
    for key, name in (("ringattn_parallel_size", "ring"), ("ulysses_parallel_size", "uly"),
                      ("expert_parallel_size", "ep")):
        if layout[key] > 1:
            parts.append(f"{name}:{layout[key]}")
    parts += [RECIPE_SHORT[key, layout[key]] for key in RECIPE_FIELDS if (key, layout.get(key)) in RECIPE_SHORT]
    if layout["activation_checkpointing"] not in (False, "none"):
        parts.append("ac")
    parts.append(f"ga:{layout['gradient_accumulation_steps']}")
    return " ".join(parts)


def table(candidates: list[Candidate], top: int) -> str:
    head = (f"{'#':>2}  {'layout':<48} {'params':>6} {'grads':>6} {'optim':>6} {'act':>6} {'other':>6} "
            f"{'total':>6} {'fits':<4} {'step s':>7} {'comp':>6} {'comm':>6} {'bubble':>6}  why")
    rows = [head, "    (memory per GPU in GB; step time split into compute / exposed communication / bubble)"]
    for i, c in enumerate(candidates[:top], 1):
        mem = c.memory.as_dict()
        gb = [f"{mem[k] / 1e9:6.2f}" if mem[k] is not None else f"{'-':>6}"
              for k in ("params", "grads", "optimizer", "activations", "other", "total")]
        split = [f"{v:6.2f}" for v in c.time.as_dict().values()] if c.time else [f"{'-':>6}"] * 3
        step = f"{c.time.total:7.2f}" if c.time else f"{'-':>7}"
        rows.append(f"{i:>2}  {short_layout(c.layout):<48} {' '.join(gb)} {'yes' if c.fits else 'no':<4} {step} "
                    f"{' '.join(split)}  {c.why}")
    if len(candidates) > top:
        rows.append(f"    ... {len(candidates) - top} more (--top, or --json for every layout)")
    return "\n".join(rows)


def write_config(candidate: Candidate, path: str, header: dict) -> None:
    if candidate.config is None:
        raise ConfigError("--write-config needs the model's shapes: pass an xorl YAML or a HF folder as MODEL")
    gpus = header["gpus"]
    nodes = max(1, gpus // 8)
    launch = (f"torchrun --nproc_per_node={gpus}" if gpus <= 8 else
              f"torchrun --nnodes={nodes} --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500")
    with open(path, "w") as f:
        f.write(f"# Written by xorl-plan for {header['model']} on {gpus} GPUs: {short_layout(candidate.layout)}\n"
                f"# world_size: {gpus}\n# {launch} -m xorl.cli.train {path}\n")
        for note in header.get("notes", []):
            f.write(f"# note: {note}\n")
        f.write(candidate.config.to_yaml())
    load_config(path).validate(gpus, local=False)  # what xorl-train will check of it (bar this machine's files)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        candidates, header = run(args)
        if not candidates:
            raise ConfigError(f"no layout of {args.model} is valid on {args.gpus} GPUs; try another --gpus")
        if args.write_config:
            write_config(candidates[0], args.write_config, header)
    except ConfigError as e:
        print(f"xorl-plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**header, "candidates": [c.as_json() for c in candidates]}, indent=1))
        return 0
    gpus = header.get("gpus", args.gpus)
    print(f"xorl-plan {args.model} on {gpus} GPUs ({args.gpus_per_node} per node, {args.gpu_memory_gb:g} GiB each), "
          f"precision {args.precision}" + (f", seq_len {header['seq_len']}, {header['global_batch_tokens']} tokens per "
                                            "step" if "seq_len" in header else "")
          + (f", GEMMs priced in FP8 {header['fp8']} ({fp8_what(header['fp8'])})" if header.get("fp8", "none") != "none"
             else ""))
    for note in header.get("notes", []):
        print(f"note: {note}")
    print(table(candidates, args.top))
    first = candidates[0]
    for warning in first.deviations + first.warnings:
        print(f"#1: {warning}")
    if args.write_config:
        print(f"wrote {args.write_config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
