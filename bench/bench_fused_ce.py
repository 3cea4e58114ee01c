"""Fused linear cross-entropy vs the unfused path (logits, then xorl.nn.cross_entropy): peak memory
and time of one forward + backward of the loss.

- CPU (also what tests/test_fused_linear_ce.py holds): the peak resident memory of a fresh process
  (``ru_maxrss``, the kernel's high-water mark; tracemalloc does not see torch's allocations) minus
  its resident memory just before the loss, with the inputs (hidden [T, H], lm_head weight [V, H],
  labels) already allocated. So the figure covers everything the loss allocates: the logits (or
  the fused kernel's chunk buffers) and the gradients d_hidden and d_weight. Each path runs in its
  own process, since a high-water mark only grows.
- GPU: ``torch.cuda.max_memory_allocated`` above the inputs, and the median time (CUDA events).

``python -m bench.bench_fused_ce --measure fused|unfused TOKENS VOCAB HIDDEN [--dtype float32]``
prints one JSON line (the CPU measurement); ``run(ctx)`` is the ``python -m bench`` entry.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

from bench.context import BenchContext, Result

QUICK_SHAPE = (4096, 8192, 32)  # tokens, vocab, hidden: small enough for a CPU test
FULL_SHAPE = (16384, 128256, 1024)  # the shape (Llama-3 vocabulary); GPU


def _inputs(tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::7] = -100
    return h, w, labels.to(device)


def loss_fn(path: str):
    from xorl.nn.cross_entropy import cross_entropy_sum
    from xorl_kernels import fused_linear_cross_entropy

    if path == "fused":
        return lambda h, w, y: fused_linear_cross_entropy(h, w, y)
    if path == "unfused":
        return lambda h, w, y: cross_entropy_sum(h @ w.T, y)
    raise ValueError(f"path must be fused or unfused, got {path!r}")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_here(path: str, tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> dict:
    """In this (fresh) process: peak resident bytes of one loss forward + backward above the inputs."""
    fn = loss_fn(path)
    fn(*_inputs(64, 32, 8, dtype, "cpu")).backward()  # imports and first-call set-up are not the loss's
    h, w, labels = _inputs(tokens, vocab, hidden, dtype, "cpu")
    before = _resident_bytes()
    loss = fn(h, w, labels)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    grads = (h.numel() + w.numel()) * h.element_size()
    return {"path": path, "peak_above_inputs": peak - before, "grad_bytes": grads, "loss": loss.item()}


def measure_cpu(path: str, tokens: int, vocab: int, hidden: int, dtype: str = "float32") -> dict:
    """``measure_here`` in a fresh process (one thread)."""
    # The plain-torch path, whatever the calling process set (a test's TRITON_INTERPRET or forced
    # backend would measure the Triton interpreter's buffers instead).
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XORL_FORCE_REFERENCE")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_fused_ce", "--measure", path, str(tokens), str(vocab), str(hidden),
         "--dtype", dtype],
        check=True, capture_output=True, text=True, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gpu_case(ctx: BenchContext, path: str, shape, dtype) -> tuple[float, int]:
    torch.cuda.empty_cache()
    h, w, labels = _inputs(*shape, dtype, ctx.device)
    fn = loss_fn(path)

    def step():
        h.grad = w.grad = None
        fn(h, w, labels).backward()

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = ctx.time(step, warmup=1, iters=5)
    return seconds, torch.cuda.max_memory_allocated() - base


def run(ctx: BenchContext) -> list[Result]:
    if not ctx.on_gpu:
        shape = QUICK_SHAPE
        fused, unfused = (measure_cpu(p, *shape) for p in ("fused", "unfused"))
        return [Result(
            name=f"fused linear CE peak memory T{shape[0]} V{shape[1]} H{shape[2]} fp32 (cpu rss)",
            value=fused["peak_above_inputs"] / 2**20, unit="MiB", anchor="unfused logits + cross_entropy_sum",
            anchor_value=unfused["peak_above_inputs"] / 2**20, higher_is_better=False,
            params={"tokens": shape[0], "vocab": shape[1], "hidden": shape[2]},
        )]
    shape = (4096, 128256, 1024) if ctx.quick else FULL_SHAPE
    (t_f, m_f), (t_u, m_u) = (_gpu_case(ctx, p, shape, torch.bfloat16) for p in ("fused", "unfused"))
    params = {"tokens": shape[0], "vocab": shape[1], "hidden": shape[2], "dtype": "bfloat16"}
    name = f"fused linear CE T{shape[0]} V{shape[1]} H{shape[2]} bf16"
    return [
        Result(name=f"{name} fwd+bwd time", value=t_f * 1e3, unit="ms", anchor="unfused logits + cross_entropy_sum",
               anchor_value=t_u * 1e3, higher_is_better=False, params=params),
        Result(name=f"{name} peak memory", value=m_f / 2**20, unit="MiB", anchor="unfused logits + cross_entropy_sum",
               anchor_value=m_u / 2**20, higher_is_better=False, params=params),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", nargs=4, metavar=("PATH", "TOKENS", "VOCAB", "HIDDEN"), required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    path, *dims = args.measure
    print(json.dumps(measure_here(path, *map(int, dims), getattr(torch, args.dtype))))
