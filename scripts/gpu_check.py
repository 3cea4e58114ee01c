"""The checks of scripts/gpu_check.sh that need a GPU: training smoke runs, torch.compile, host syncs.

    python scripts/gpu_check.py smoke --model dense|moe --out FILE.json
    python scripts/gpu_check.py compile --model dense|moe --out FILE.json
    python scripts/gpu_check.py sync --model dense|moe --out FILE.json
    python scripts/gpu_check.py fp8 --model dense|moe --out FILE.json

``smoke``: bf16 training on one GPU through xorl's kernels (Triton flash attention; for MoE the
csrc permute / unpermute and the grouped GEMM); the loss must fall and stay finite; reports
tokens per second and peak memory. ``compile``: the smoke run eager, then with ``train.compile: true``
(inductor, each decoder block); reports tokens per second of both and the speed-up (compilation is in
the warm-up steps, not timed); both losses must fall, stay finite and start equal to bf16 precision.
``fp8``: the smoke run with ``train.fp8: none`` (the anchor), then each recipe (dense: tensorwise,
tensorwise + fp8_all_gather, rowwise, blockwise; MoE: blockwise, whose experts run the FP8 grouped
GEMM); tokens per second of each and its ratio to the anchor; every loss must fall, stay finite and
start within 2 % of the bf16 run's.
``sync``: one training step (after a warm-up step) with
``torch.cuda.set_sync_debug_mode("warn")`` on from the first forward to the optimizer step's end,
every warning recorded; any synchronising call there fails the check (the step's one read of the
loss and norm comes after the optimizer step). Under EP the split sizes are one sync per MoE layer
per microbatch by design; the check counts them apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch


def _config(model: str, steps: int, out_dir: str, extra: tuple[str, ...] = ()):
    from xorl.cli.train import DEFAULT_CONFIG
    from xorl.config import load_config

    overrides = [
        "--model.vocab_size=32000", "--model.hidden_size=2048", "--model.num_hidden_layers=4",
        "--model.num_attention_heads=16", "--model.num_key_value_heads=4", "--model.head_dim=128",
        "--model.intermediate_size=5632", "--model.attn_implementation=xorl",
        "--model.max_position_embeddings=4096",
        "--data.seq_len=4096", "--data.micro_batch_size=1",
        "--train.data_parallel_shard_size=1", "--train.ringattn_parallel_size=1",
        "--train.gradient_accumulation_steps=2", "--train.dtype=bfloat16", "--train.lr=1e-3",
        "--train.warmup_steps=2", f"--train.max_steps={steps}", "--train.save_steps=0",
        f"--train.output_dir={out_dir}",
    ]
    if model == "moe":
        overrides += ["--model.model_type=qwen3_moe", "--model.num_experts=16", "--model.num_experts_per_tok=4",
                      "--model.moe_intermediate_size=1024", "--train.expert_parallel_size=1"]
    else:
        overrides += ["--model.model_type=llama", "--model.num_experts=0", "--train.expert_parallel_size=1"]
    return load_config(DEFAULT_CONFIG, overrides + list(extra))


def _timed_run(config, steps: int) -> dict:
    """Train ``steps`` steps; losses, tokens per second after 5 warm-up steps, peak memory."""
    from xorl.trainer.trainer import Trainer

    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(config)
    losses, times, tokens = [], [], 0
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = trainer.train_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(result.loss)
        tokens = result.tokens
    timed = times[5:]  # warm-up: Triton autotuning, allocator growth, torch.compile
    return {
        "loss_first": losses[0], "loss_last": losses[-1], "tokens_per_step": tokens,
        "tokens_per_s": tokens * len(timed) / sum(timed), "warmup_s": sum(times[:5]),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "ok": all(map(_finite, losses)) and losses[-1] < losses[0] - 0.5,
    }


def smoke(model: str, out_dir: str, steps: int = 30) -> dict:
    run = _timed_run(_config(model, steps, out_dir), steps)
    run.pop("warmup_s")
    return {"model": model, "steps": steps, **run}


def compile_check(model: str, out_dir: str, steps: int = 20) -> dict:
    eager = _timed_run(_config(model, steps, f"{out_dir}/eager"), steps)
    compiled = _timed_run(_config(model, steps, f"{out_dir}/compiled", ("--train.compile=true",)), steps)
    same_start = abs(compiled["loss_first"] - eager["loss_first"]) <= 2e-2 * abs(eager["loss_first"])
    return {
        "model": model, "steps": steps, "eager": eager, "compiled": compiled,
        "eager_tokens_per_s": eager["tokens_per_s"], "compiled_tokens_per_s": compiled["tokens_per_s"],
        "speedup": compiled["tokens_per_s"] / eager["tokens_per_s"],
        "ok": eager["ok"] and compiled["ok"] and same_start,
    }


def fp8_recipes(model: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, the overrides) of each FP8 run of the fp8 check."""
    if model == "moe":
        return [("blockwise", ("--train.fp8=blockwise",))]
    return [("tensorwise", ("--train.fp8=tensorwise",)),
            ("tensorwise+all_gather", ("--train.fp8=tensorwise", "--train.fp8_all_gather=true")),
            ("rowwise", ("--train.fp8=rowwise",)), ("blockwise", ("--train.fp8=blockwise",))]


def fp8_check(model: str, out_dir: str, steps: int = 20) -> dict:
    anchor = _timed_run(_config(model, steps, f"{out_dir}/none"), steps)
    report = {"model": model, "steps": steps, "none": anchor, "ok": anchor["ok"]}
    for name, extra in fp8_recipes(model):
        run = _timed_run(_config(model, steps, f"{out_dir}/{name}", extra), steps)
        run["speedup"] = run["tokens_per_s"] / anchor["tokens_per_s"]
        same_start = abs(run["loss_first"] - anchor["loss_first"]) <= 2e-2 * abs(anchor["loss_first"])
        report[name] = run
        report["ok"] = report["ok"] and run["ok"] and same_start
    return report


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def sync(model: str, out_dir: str) -> dict:
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(_config(model, 4, out_dir))
    trainer.train_step()  # warm-up: autotuning and lazy initialisation may synchronise
    state = {"active": False}

    def start(module, args, kwargs):
        if not state["active"]:
            state["active"] = True
            torch.cuda.set_sync_debug_mode("warn")

    def stop(optimizer, args, kwargs):
        torch.cuda.set_sync_debug_mode(0)

    hooks = [part.register_forward_pre_hook(start, with_kwargs=True, prepend=True) for part in trainer.parts]
    hooks += [trainer.optimizers[-1].register_step_post_hook(stop)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_step()
    torch.cuda.set_sync_debug_mode(0)
    for hook in hooks:
        hook.remove()
    syncs = [str(w.message).splitlines()[0] + " @ " + f"{w.filename}:{w.lineno}" for w in caught
             if "synchroniz" in str(w.message)]
    ep_splits = [s for s in syncs if "ep_dispatch.py" in s]  # EP split sizes: xorl/nn/ep_dispatch.py
    others = [s for s in syncs if "ep_dispatch.py" not in s]
    return {"model": model, "syncs": others, "ep_split_syncs": len(ep_splits), "ok": not others}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py")
    parser.add_argument("check", choices=["smoke", "compile", "sync", "fp8"])
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--out", required=True, help="JSON file for the report")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = f"/tmp/xorl-gpu-check-{args.check}-{args.model}"
    checks = {"smoke": smoke, "compile": compile_check, "sync": sync, "fp8": fp8_check}
    report = checks[args.check](args.model, out_dir)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
