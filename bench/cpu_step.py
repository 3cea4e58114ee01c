"""One training step on the CPU, xorl against stock transformers (SDPA), same weights, one thread.

``python -m bench.cpu_step [--tokens 4096] [--out bench/results]`` writes a seeded Llama-style model
(hidden 512, 4 layers, 8 heads of 64 with 4 key/value heads, intermediate 1536, vocabulary 32,000,
untied, fp32) as a transformers folder, then runs each side in a fresh process with
``torch.set_num_threads(1)``:

- ``transformers-sdpa``: ``LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa")``;
- ``xorl``: ``xorl.models.from_pretrained(folder, dtype=float32)`` as a run builds it (CPU attention
  on torch's CPU flash kernel, xorl_kernels/attention/cpu_flash.py);
- ``xorl-reference``: the same under ``XORL_FORCE_REFERENCE=1`` (every op on its plain-torch
  reference: the attention that materialises each score matrix, what CPU runs took before).

A step is forward, the mean next-token loss over one row of ``--tokens`` tokens, backward, and the
gradients dropped (the step ends holding what it began with). Figures per side: seconds per step
(the median of ``--repeats`` steps after one warm-up), the bytes the step allocates above the model
(torch's CPU allocator through its profiler, xorl/planner/measure.py ``profiled_peak``: gradients,
activations, temporaries), the process's resident high-water mark above its resident bytes before
the first step (ru_maxrss: what the kernel saw, allocator caching included), the loss (the same
weights and tokens give the same loss on every side, to fp32 rounding), and the ops that took
most of the step's time (torch profiler, self time). Ratios are against transformers in the same
run, on the same machine. ``--measure SIDE FOLDER TOKENS REPEATS`` is one side's process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

SIDES = ("transformers-sdpa", "xorl", "xorl-reference")
MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)
OUT = Path(__file__).resolve().parent / "results"


def write_folder(folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(side: str, folder: str, tokens: int, repeats: int) -> dict:
    """One side's figures, in this process (call it in a fresh one: ru_maxrss only grows)."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, MODEL["vocab_size"], (1, tokens), generator=gen)
    if side == "transformers-sdpa":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)

        def loss_of():
            return model(input_ids=input_ids, labels=input_ids).loss  # shifts inside
    else:
        from xorl.models import from_pretrained

        model = from_pretrained(folder, dtype=torch.float32)
        labels = torch.full_like(input_ids, -100)
        labels[:, :-1] = input_ids[:, 1:]  # xorl takes labels aligned with the inputs

        def loss_of():
            return model(input_ids, labels=labels).loss
    model.train()
    losses = []

    def step():
        loss = loss_of()
        loss.backward()
        losses.append(loss.item())
        for p in model.parameters():
            p.grad = None

    rss_before = _rss_bytes()
    step()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before

    from torch.profiler import ProfilerActivity, profile

    from xorl.planner.measure import profiled_peak

    peak = profiled_peak(step, steady=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    top = [{"op": e.key, "share": round(e.self_cpu_time_total / total, 3)} for e in ops[:6]]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"side": side, "seconds_per_step": statistics.median(seconds), "seconds": seconds,
            "allocated_above_model_gib": peak / 2**30, "rss_above_start_gib": rss_peak / 2**30,
            "model_gib": model_bytes / 2**30, "loss": losses[-1], "top_ops_self_time": top}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_sides(tokens: int, repeats: int, sides=SIDES) -> dict:
    import torch
    import transformers

    load_at_start = os.getloadavg()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("XORL_FORCE_REFERENCE", None)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        write_folder(folder)
        for side in sides:
            side_env = {**env, "XORL_FORCE_REFERENCE": "1"} if side == "xorl-reference" else env
            proc = subprocess.run(
                [sys.executable, "-m", "bench.cpu_step", "--measure", side, folder, str(tokens), str(repeats)],
                capture_output=True, text=True, env=side_env, cwd=Path(__file__).resolve().parent.parent,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{side} failed:\n{proc.stderr[-4000:]}")
            results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{side:>18}: {results[side]['seconds_per_step']:.2f} s/step, "
                  f"{results[side]['allocated_above_model_gib']:.2f} GiB allocated above the model, "
                  f"loss {results[side]['loss']:.6f}", file=sys.stderr)
    anchor = results.get("transformers-sdpa")
    ratios = {}
    if anchor:
        for side, r in results.items():
            ratios[side] = {"time": r["seconds_per_step"] / anchor["seconds_per_step"],
                            "allocated": r["allocated_above_model_gib"] / anchor["allocated_above_model_gib"]}
    return {"what": "one training step (forward, loss, backward) on CPU, one thread, fp32", "model": MODEL,
            "tokens": tokens, "repeats": repeats, "git_commit": _git_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(), "results": results,
            "ratio_to_transformers_sdpa": ratios}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_step", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--measure", nargs=4, metavar=("SIDE", "FOLDER", "TOKENS", "REPEATS"))
    args = parser.parse_args(argv)
    if args.measure:
        side, folder, tokens, repeats = args.measure
        print(json.dumps(measure(side, folder, int(tokens), int(repeats))))
        return
    record = run_sides(args.tokens, args.repeats, args.sides)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"cpu-step-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
