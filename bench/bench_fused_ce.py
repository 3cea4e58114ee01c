"""Fused linear cross-entropy vs the unfused path (logits, then xorl.nn.cross_entropy): peak memory
and time of one forward + backward of the loss.

- CPU (also what tests/unit/kernels/test_fused_linear_ce.py holds): the peak bytes the loss's forward + backward
  allocates above what was held when it began, read from torch's CPU allocator through its profiler
  (xorl/planner/measure.py ``profiled_peak``, the instrument the planner's calibration uses). The
  inputs (hidden [T, H], lm_head weight [V, H], labels) exist before; the figure covers everything
  the loss allocates: the logits (or the fused kernel's chunk buffers and temporaries) and the
  gradients d_hidden and d_weight. Only torch's own allocations count, so the figure does not move
  with what the process ran before (thread pools, imported libraries), as a resident-memory
  high-water mark did (issue 22: 1/4.9 inside the full xdist suite against 1/15-1/40 alone).
- GPU: ``torch.cuda.max_memory_allocated`` above the inputs, and the median time (CUDA events).

``python -m bench.bench_fused_ce --measure fused|unfused TOKENS VOCAB HIDDEN [--dtype float32]``
prints one JSON line (the CPU measurement); ``run(ctx)`` is the ``python -m bench`` entry.
"""

from __future__ import annotations

import argparse
import json

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


def measure_cpu(path: str, tokens: int, vocab: int, hidden: int, dtype: torch.dtype = torch.float32) -> dict:
    """Peak bytes one loss forward + backward allocates above its inputs, from the CPU allocator.

    CPU tensors always take the op's plain-torch reference (xorl_kernels.dispatch), whatever
    TRITON_INTERPRET says, so this measures the CPU path's buffers, never the interpreter's."""
    from xorl.planner.measure import profiled_peak

    fn = loss_fn(path)
    h, w, labels = _inputs(tokens, vocab, hidden, dtype, "cpu")
    out = {}

    def step():
        loss = fn(h, w, labels)
        loss.backward()  # d_hidden and d_weight are allocated inside the step and counted in its peak
        out["loss"] = loss.item()
        h.grad = w.grad = None  # so each step starts from the inputs alone

    peak = profiled_peak(step)
    grads = (h.numel() + w.numel()) * h.element_size()
    return {"path": path, "peak_above_inputs": peak, "grad_bytes": grads, "loss": out["loss"],
            "shape": [tokens, vocab, hidden], "dtype": str(dtype).removeprefix("torch.")}


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
            name=f"fused linear CE peak memory T{shape[0]} V{shape[1]} H{shape[2]} fp32 (cpu allocator)",
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
    print(json.dumps(measure_cpu(path, *map(int, dims), getattr(torch, args.dtype))))
