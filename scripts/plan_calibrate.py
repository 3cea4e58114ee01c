"""Calibrate xorl-plan's memory and step-time models on one GPU: predicted vs measured.

    python scripts/plan_calibrate.py                 # on a GPU machine (one rank, no torchrun)
    python scripts/plan_calibrate.py --predict-only  # anywhere: the predictions alone
    python scripts/plan_calibrate.py --out bench/results/plan-calibration.json

For a few dense and MoE model sizes, sequence lengths and both recompute policies, it trains two
steps of the real Trainer (bf16 compute, fp32 master weights, FSDP2 on one rank, 2 microbatches so
gradients live across microbatches) and compares, on the second step:
  steady    torch.cuda.memory_allocated() between steps (parameters + Adam state; the planner's
            params + optimizer, exact by construction) against the prediction;
  peak      torch.cuda.max_memory_allocated() over the step against the predicted total
            (params + grads + optimizer + activations + other); the goal is < 10% error;
  time      the step's wall time against the roofline prediction (a lower bound; the ratio is the
            fraction of the roofline reached).
Errors above 10% point at the activation / other terms of xorl/planner/memory.py to refit.
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

    from xorl.trainer import Trainer

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
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
