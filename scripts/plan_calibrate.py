"""Calibrate xorl-plan's memory and step-time models: predicted vs measured, and refit the efficiencies.

    python scripts/plan_calibrate.py                 # on a GPU machine (one rank, no torchrun)
    python scripts/plan_calibrate.py --predict-only  # anywhere: the predictions alone
    python scripts/plan_calibrate.py --out bench/results/plan-calibration.json
    python scripts/plan_calibrate.py --cpu-activations   # anywhere: 2 gloo ranks, the allocator's peak
    python scripts/plan_calibrate.py --refit bench/results/GPU.json --peak-tflops 989 --hbm-gbps 3350 \
        --write xorl/planner/efficiency.json          # new efficiency curves from a GPU bench run

--refit reads a `python -m bench` result file from a GPU: the measured large-matmul peak
(peaks.matmul_tflops) over the datasheet --peak-tflops becomes gemm.max_fraction; the flash_attn
rows (forward, and forward+backward at 3.5x the forward FLOPs) give attention.fwd_fraction and
bwd_fraction; the grouped-GEMM rows (xorl_kernels' grouped GEMM against dense cuBLAS at equal
FLOPs) give grouped_gemm.by_tokens_per_expert; peaks.hbm_gbps over --hbm-gbps gives hbm_fraction;
bench_fp8's GEMM rows (``fp8 linear RECIPE gemm``, operands quantised beforehand) over the FP8 peak
(--fp8-peak-tflops, default 2 x --peak-tflops) and fp8.by_min_dim at their size give fp8.max_fraction.
Entries it has no rows for keep their value and source.

--cpu-activations trains one step of a small Llama and a small MoE at FSDP 2, TP 2 + SP and
ring 2, with none / selective / full recompute (the fused loss; `none` also with the unfused
loss), on two gloo ranks, and compares the peak the
allocator saw above the step's start (xorl/planner/measure.py: torch's profiler's running total of
CPU allocations) with the planner's modelled peak moment (Memory.step_peak, less the GPU kernel
workspace a CPU run does not allocate).

For a few dense and MoE model sizes, sequence lengths and both recompute policies, it trains two
steps of the real Trainer (bf16 compute, fp32 master weights, FSDP2 on one rank, 2 microbatches so
gradients live across microbatches) and compares, on the second step:
  steady    torch.cuda.memory_allocated() between steps (parameters + Adam state; the planner's
            params + optimizer, exact by construction) against the prediction;
  peak      torch.cuda.max_memory_allocated() over the step against the predicted total
            (params + grads + optimizer + activations + other); the goal is < 10% error;
  time      the step's wall time against the roofline prediction (a lower bound; the ratio is the
            fraction of the roofline reached).
Errors above 10% point at the activation terms (xorl/planner/activations.py) or the other
buffers (xorl/planner/memory.py) to refit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DENSE = {"model_type": "llama", "vocab_size": 32000, "num_key_value_heads": 8, "rope_theta": 500000.0,
         "max_position_embeddings": 16384}
SIZES = {
    "dense-0.2B": {**DENSE, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                   "num_attention_heads": 16},
    "dense-1B": {**DENSE, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
                 "num_attention_heads": 16},
    "dense-2.6B": {**DENSE, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 8, "num_attention_heads": 32},
    "moe-0.9B": {"model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                 "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                 "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "max_position_embeddings": 16384},
}
RUNS = [(name, seq, ac) for name in SIZES for seq in (4096, 8192) for ac in (True, False)]


def config_for(name: str, seq: int, checkpointing: bool):
    from xorl.config import Config

    return Config.from_dict({
        "model": SIZES[name],
        "data": {"seq_len": seq, "micro_batch_size": 1},
        "train": {"data_parallel_mode": "fsdp2", "dtype": "bfloat16", "activation_checkpointing": checkpointing,
                  "gradient_accumulation_steps": 2, "max_steps": 2, "warmup_steps": 1, "save_steps": 0,
                  "output_dir": "outputs/plan_calibrate"},
    })


def predict(config) -> dict:
    from xorl.planner.guide import Options, evaluate

    c = evaluate(config, Options(1))
    mem = c.memory.as_dict()
    return {"steady": mem["params"] + mem["optimizer"], "peak": mem["total"], "time": c.time.total,
            "split": {k: v for k, v in mem.items() if k != "total"}}


def measure(config) -> dict:
    import torch

    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()  # creates the Adam state
    torch.cuda.synchronize()
    steady = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train_step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return {"steady": steady, "peak": peak, "time": elapsed}


def refit(bench_path: str, peak_tflops: float, hbm_gbps: float, base_path: str | None = None,
          fp8_peak_tflops: float | None = None) -> dict:
    """New efficiency.json contents from a GPU bench result file (see the module docstring)."""
    import statistics

    from xorl.planner.efficiency import DEFAULT_PATH

    with open(bench_path) as f:
        bench = json.load(f)
    with open(base_path or DEFAULT_PATH) as f:
        eff = json.load(f)
    if bench.get("device", {}).get("type", "cuda") == "cpu" or "cpu" in os.path.basename(bench_path):
        raise SystemExit(f"plan_calibrate: {bench_path} is a CPU run; refit needs a GPU bench result")
    peaks, rows, where = bench.get("peaks", {}), bench.get("results", []), f"refit from {bench_path}"
    if peaks.get("matmul_tflops"):
        eff["gemm"]["max_fraction"] = round(peaks["matmul_tflops"] / peak_tflops, 4)
        eff["gemm"]["source"] = f"max_fraction {where} (peaks.matmul_tflops); " + eff["gemm"]["source"]
    if peaks.get("copy_gbps"):
        eff["hbm_fraction"] = round(peaks["copy_gbps"] / hbm_gbps, 4)
        eff["hbm_source"] = f"{where} (peaks.copy_gbps)"
    attn = {}
    for r in rows:
        name = r.get("name", "")
        if r.get("unit") == "TFLOP/s" and name.startswith("flash_attn ") and "GQA" not in name and "vs" not in name:
            attn.setdefault(name.split()[1], []).append(r["value"])
    if "fwd" in attn and "fwd+bwd" in attn:
        fwd, both = statistics.median(attn["fwd"]), statistics.median(attn["fwd+bwd"])
        bwd = 2.5 / (3.5 / both - 1 / fwd)  # the backward's TFLOP/s from the two timings' FLOPs
        eff["attention"].update(fwd_fraction=round(fwd / peak_tflops, 4), bwd_fraction=round(bwd / peak_tflops, 4),
                                source=f"{where} (bench_flash_attn, median over sequence lengths)")
    grouped = {}
    for r in rows:
        params = r.get("params", {})
        if r.get("name", "").startswith("grouped_gemm fwd") and r.get("anchor_value") and params.get("groups"):
            per_expert = params["tokens"] * params.get("top_k", 1) / params["groups"]
            grouped.setdefault(per_expert, []).append(r["value"] / r["anchor_value"])
    if grouped:
        eff["grouped_gemm"]["by_tokens_per_expert"] = [[x, round(min(1.0, statistics.median(v)), 4)]
                                                      for x, v in sorted(grouped.items())]
        eff["grouped_gemm"]["source"] = f"{where} (bench_grouped_gemm forward, against dense cuBLAS at equal FLOPs)"
    _refit_fp8(eff, rows, fp8_peak_tflops or 2 * peak_tflops, where)
    eff["fitted_by"] = where
    return eff


def _refit_fp8(eff: dict, rows: list, fp8_peak_tflops: float, where: str) -> None:
    """fp8.max_fraction per recipe from bench_fp8's dense GEMM rows (xorl/planner/fp8_time.py prices with it)."""
    import statistics

    from xorl.planner.efficiency import interpolate

    curve = tuple(tuple(x) for x in eff["fp8"]["by_min_dim"])
    fits = {}
    for r in rows:
        params = r.get("params", {})
        if r.get("name", "").startswith("fp8 linear ") and " gemm " in r["name"] and params.get("recipe"):
            size = min(params["M"], params["N"], params["K"])
            fits.setdefault(params["recipe"], []).append(r["value"] / fp8_peak_tflops / interpolate(curve, size))
    for recipe, values in fits.items():
        eff["fp8"]["max_fraction"][recipe] = round(statistics.median(values), 4)
    if fits:
        eff["fp8"]["source"] = (f"max_fraction of {', '.join(sorted(fits))} {where} (bench_fp8 GEMM rows over "
                                f"{fp8_peak_tflops:g} TFLOP/s); " + eff["fp8"]["source"])


# A small Llama and a small MoE, 2 gloo ranks: (model, layout) x recompute policies.
CPU_MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
             "max_position_embeddings": 4096}
CPU_MOE = {**CPU_MODEL, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128, "norm_topk_prob": True}
CPU_LAYOUTS = {"fsdp2": {"data_parallel_shard_size": 2},
               "tp2+sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
               "ring2": {"ringattn_parallel_size": 2}}
# (model, layout, recompute, fused_loss): every policy with the fused loss (the default), and `none`
# once more with the unfused loss, whose logits the trainer's loop holds through the backward.
CPU_RUNS = [(model, layout, mode, fused) for model in ("llama", "moe") for layout in CPU_LAYOUTS
            for mode, fused in (("none", True), ("selective", True), ("full", True), ("none", False))]


def cpu_config(model: str, layout: str, mode: str, output_dir: str, fused_loss: bool = True):
    """``fused_loss``: model.fused_loss (default on: the chunked linear cross-entropy); False holds the
    planner's unfused loss term (logits, log-softmax and their gradients) to the allocator."""
    from xorl.config import Config

    model_fields = {**(CPU_MODEL if model == "llama" else CPU_MOE), "fused_loss": fused_loss}
    return Config.from_dict({
        "model": model_fields, "data": {"seq_len": 512, "micro_batch_size": 2},
        "train": {"data_parallel_mode": "fsdp2", "activation_checkpointing": mode, "gradient_accumulation_steps": 1,
                  "max_steps": 3, "warmup_steps": 1, "save_steps": 0, "output_dir": output_dir,
                  **CPU_LAYOUTS[layout]},
    })


def predicted_transient(config, world: int = 2) -> int:
    """What the planner says a step adds above its start: its modelled peak moment (Memory.step_peak)
    less the GPU kernel workspace, which a CPU run does not allocate."""
    from xorl.planner.guide import Options, evaluate
    from xorl.planner.memory import WORKSPACE_BYTES

    return evaluate(config, Options(world)).memory.step_peak - WORKSPACE_BYTES


def cpu_activations(world, runs, output_root: str) -> list[dict]:
    from xorl.config.errors import ConfigError
    from xorl.planner.measure import step_transient_peak

    rows = []
    for model, layout, mode, fused in runs:
        name = f"{model} {layout} {mode}" + ("" if fused else " unfused-loss")
        config = cpu_config(model, layout, mode, os.path.join(output_root, name.replace(" ", "-")), fused_loss=fused)
        try:
            config.validate(2)
        except ConfigError as e:  # a combination xorl-train refuses (e.g. selective with the MoE under TP)
            rows.append({"run": name, "refused": str(e)})
            continue
        measured = max(world.run(step_transient_peak, config))
        predicted = predicted_transient(config)
        rows.append({"run": name, "measured": measured, "predicted": predicted, "error": predicted / measured - 1})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--refit", metavar="BENCH.json", help="refit the efficiency curves from a GPU bench run")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="--refit: the device's datasheet bf16 peak")
    ap.add_argument("--fp8-peak-tflops", type=float, help="--refit: the dense FP8 peak (default 2 x --peak-tflops)")
    ap.add_argument("--hbm-gbps", type=float, default=3350.0, help="--refit: the device's datasheet HBM bandwidth")
    ap.add_argument("--write", metavar="EFFICIENCY.json", help="--refit: write here (default: print)")
    ap.add_argument("--cpu-activations", action="store_true", help="allocator peak vs prediction on 2 gloo ranks")
    args = ap.parse_args()
    if args.refit:
        eff = refit(args.refit, args.peak_tflops, args.hbm_gbps, fp8_peak_tflops=args.fp8_peak_tflops)
        text = json.dumps(eff, indent=1) + "\n"
        if args.write:
            with open(args.write, "w") as f:
                f.write(text)
        else:
            print(text)
        return 0
    if args.cpu_activations:
        import tempfile

        from xorl.testing.multirank import GlooWorld

        with tempfile.TemporaryDirectory() as root, GlooWorld(2, timeout_s=900) as world:
            rows = cpu_activations(world, CPU_RUNS, root)
        for r in rows:
            if "refused" in r:
                print(f"{r['run']:<36} refused by xorl-train: {r['refused'][:100]}")
                continue
            print(f"{r['run']:<36} measured {r['measured'] / 1e6:8.2f} MB  predicted {r['predicted'] / 1e6:8.2f} MB"
                  f"  {r['error']:+6.1%}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": "cpu (2 gloo ranks)", "rows": rows}, f, indent=1)
        return 0
    import torch

    measuring = not args.predict_only
    if measuring and not torch.cuda.is_available():
        print("plan_calibrate: no CUDA device; run on a GPU machine or pass --predict-only", file=sys.stderr)
        return 2
    rows = []
    print(f"{'run':<24} {'steady GB':>19} {'peak GB (pred/meas)':>21} {'err':>6} {'step s (pred/meas)':>19}")
    for name, seq, ac in RUNS:
        config = config_for(name, seq, ac)
        row = {"run": f"{name} seq{seq} {'ac' if ac else 'no-ac'}", "predicted": predict(config)}
        if measuring:
            try:
                row["measured"] = measure(config)
            except torch.OutOfMemoryError:
                row["measured"] = None
                gc.collect()
                torch.cuda.empty_cache()
        rows.append(row)
        p, m = row["predicted"], row.get("measured")
        if m:
            err = (p["peak"] - m["peak"]) / m["peak"]
            print(f"{row['run']:<24} {p['steady'] / 1e9:8.2f}/{m['steady'] / 1e9:<8.2f} "
                  f"{p['peak'] / 1e9:9.2f}/{m['peak'] / 1e9:<9.2f} {err:+6.1%} {p['time']:8.3f}/{m['time']:<8.3f}")
        else:
            status = "OOM" if measuring else ""
            print(f"{row['run']:<24} {p['steady'] / 1e9:8.2f}/{'-':<8} {p['peak'] / 1e9:9.2f}/{'-':<9} "
                  f"{status:>6} {p['time']:8.3f}/-")
    if measuring:
        errors = [abs(r["predicted"]["peak"] - r["measured"]["peak"]) / r["measured"]["peak"]
                  for r in rows if r.get("measured")]
        print(f"peak memory error: max {max(errors):.1%}, mean {sum(errors) / len(errors):.1%} (goal < 10%)")
    if args.out:
        device = torch.cuda.get_device_name() if measuring else "none"
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
