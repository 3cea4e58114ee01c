"""The loss of a stock transformers causal LM three ways, one training step each (the whole model's
forward + backward): stock (logits, then transformers' ForCausalLMLoss), ``xorl.hf.apply(loss=True)``
(xorl's fused linear cross-entropy, lazy logits), and Liger-Kernel's fused linear cross-entropy
(``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, model=...)``, its patch of that one
model's forward). Same model, same batch, same ``num_items_in_batch``; the figures are ratios to stock.

- CPU: the peak bytes the step allocates above what it began with, torch's CPU allocator read through
  its profiler (xorl/planner/measure.py ``profiled_peak``, as bench/bench_fused_ce.py and
  tests/unit/hf/test_fused_loss.py). Each path runs in a process of its own: Liger's kernels are Triton,
  and on CPU tensors they run only under the Triton interpreter, which must be chosen
  (``TRITON_INTERPRET=1``) before triton is imported. The interpreter's own numpy buffers are not
  torch allocations, so Liger's figure counts what it allocates through torch (its chunk logits and
  gradients); on a GPU its kernels' working set is registers and shared memory, so that is the
  comparable figure. Liger is not a dependency: ``pip install liger-kernel`` (the row is left out, and
  says so, where it is not importable).
- GPU: ``torch.cuda.max_memory_allocated`` above the step's start and the median step time, bf16.

``python -m bench.bench_hf_loss --measure stock|xorl|liger [--tokens N --vocab V --hidden H]`` prints one
JSON line; ``run(ctx)`` is the ``python -m bench`` entry.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from bench.context import BenchContext, Result

CPU_SHAPE = (4096, 32000, 32)  # tokens (2 rows of 2048), vocab, hidden: the CPU figure
GPU_SHAPE = (16384, 128256, 1024)  # 4 rows of 4096, Llama-3's vocabulary
PATHS = ("stock", "xorl", "liger")


def _model(vocab: int, hidden: int, dtype: torch.dtype, device):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device, dtype).train()


def _patched(path: str, model):
    if path == "xorl":
        import xorl.hf

        xorl.hf.apply(model, norm=False, rope=False, mlp=False, loss=True)
    elif path == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
    elif path != "stock":
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return model


def _batch(tokens: int, vocab: int, device):
    rows = 2 if tokens <= 4096 else 4
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, tokens // rows), generator=gen)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=gen) < 0.1] = -100
    return ids.to(device), labels.to(device), (labels[..., 1:] != -100).sum().to(device)


def measure(path: str, tokens: int, vocab: int, hidden: int, device: str = "cpu") -> dict:
    """One path's step: its peak bytes above the step's start, the loss, and (GPU) the step time."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = _patched(path, _model(vocab, hidden, dtype, device))
    ids, labels, num_items = _batch(tokens, vocab, device)
    out = {}

    def step():
        loss = model(ids, labels=labels, num_items_in_batch=num_items).loss
        loss.backward()
        out["loss"] = loss.item()
        model.zero_grad(set_to_none=True)

    row = {"path": path, "shape": [tokens, vocab, hidden], "dtype": str(dtype).removeprefix("torch.")}
    if device == "cpu":
        from xorl.planner.measure import profiled_peak

        row["peak_above_start"] = profiled_peak(step, steady=True)
    else:
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        row["seconds"] = BenchContext(torch.device(device), {}).time(step, warmup=1, iters=5)
        row["peak_above_start"] = torch.cuda.max_memory_allocated() - base
    row["loss"] = out["loss"]
    return row


def _liger_importable() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def measure_in_subprocess(path: str, shape) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if path == "liger":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "bench.bench_hf_loss", "--measure", path, "--tokens", str(shape[0]),
           "--vocab", str(shape[1]), "--hidden", str(shape[2])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _results(rows: dict, unit_note: str, params: dict) -> list[Result]:
    stock = rows["stock"]
    out = []
    for path in ("xorl", "liger"):
        if path not in rows:
            continue
        row = rows[path]
        extra = {"loss": row["loss"], "stock_loss": stock["loss"], **params}
        out.append(Result(name=f"{path} fused loss step peak memory {unit_note}", value=row["peak_above_start"] / 2**20,
                          unit="MiB", anchor="stock logits + ForCausalLMLoss",
                          anchor_value=stock["peak_above_start"] / 2**20, higher_is_better=False, params=extra))
        if "seconds" in row:
            out.append(Result(name=f"{path} fused loss step time {unit_note}", value=row["seconds"] * 1e3, unit="ms",
                              anchor="stock logits + ForCausalLMLoss", anchor_value=stock["seconds"] * 1e3,
                              higher_is_better=False, params=extra))
    return out


def run(ctx: BenchContext) -> list[Result]:
    paths = PATHS if _liger_importable() else PATHS[:2]
    params = {} if "liger" in paths else {"liger": "not installed (pip install liger-kernel): its row left out"}
    if not ctx.on_gpu:
        rows = {p: measure_in_subprocess(p, CPU_SHAPE) for p in paths}
        note = (f"T{CPU_SHAPE[0]} V{CPU_SHAPE[1]} H{CPU_SHAPE[2]} fp32 "
                "(cpu allocator; liger under the Triton interpreter)")
        return _results(rows, note, params)
    rows = {p: measure(p, *GPU_SHAPE, device="cuda") for p in paths}
    return _results(rows, f"T{GPU_SHAPE[0]} V{GPU_SHAPE[1]} H{GPU_SHAPE[2]} bf16", params)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", choices=PATHS, required=True)
    parser.add_argument("--tokens", type=int, default=CPU_SHAPE[0])
    parser.add_argument("--vocab", type=int, default=CPU_SHAPE[1])
    parser.add_argument("--hidden", type=int, default=CPU_SHAPE[2])
    args = parser.parse_args()
    print(json.dumps(measure(args.measure, args.tokens, args.vocab, args.hidden)))


if __name__ == "__main__":
    _main()
