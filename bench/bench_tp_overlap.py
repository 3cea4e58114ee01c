"""TP overlap on one device: what decomposing a TP projection into P chunks costs, and what it hides.

For the projections of Llama-3-8B (hidden 4096, ffn 14336) and Llama-3-70B (hidden 8192, ffn
28672) at 8192 tokens and TP degree P = 2, 4, 8, on this rank's weight shard:

* column layers (qkv, gate+up; all-gather -> matmul): P GEMMs [T/P, in] x [in, out/P] written into
  one output, vs one GEMM [T, in] x [in, out/P];
* row layers (o, down; matmul -> reduce-scatter): P GEMMs [T/P, in/P] x [in/P, out], vs one GEMM.

1. "chunked GEMMs vs one GEMM": the price of the decomposition alone (target <= 1.05x).
2. The same chunk loop with a simulated transfer: a device-to-device copy of each chunk's bytes on
   a side stream, issued as the ring issues its exchanges (chunk i+1 travels while chunk i is
   multiplied; for row layers the partial of step i travels while step i+1 multiplies, then is
   added). Reported: the exposed transfer time (pipelined minus chunked GEMMs alone) as a fraction
   of the transfer time alone (target <= 10%), and the pipelined time against the plain
   "transfer everything, then one GEMM" sequence (the collective-then-matmul path).

A same-GPU copy is a stand-in for NVLink: it moves the same bytes but faster than a real link and
it competes with the GEMM for HBM, so it is a conservative test of the hiding and an optimistic
one of the absolute transfer time. On CPU (or ctx.quick) the shapes are tiny and only the chunked
vs full GEMM figure is produced (no streams): a smoke test, not a performance figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.context import BenchContext, Result


@dataclass(frozen=True)
class Projection:
    model: str
    name: str
    kind: str  # "column" (all-gather -> matmul) or "row" (matmul -> reduce-scatter)
    in_features: int  # full (unsharded) sizes
    out_features: int


def _llama_projections(model: str, hidden: int, ffn: int, heads: int, kv_heads: int) -> list[Projection]:
    head_dim = hidden // heads
    return [
        Projection(model, "qkv_proj", "column", hidden, (heads + 2 * kv_heads) * head_dim),
        Projection(model, "o_proj", "row", heads * head_dim, hidden),
        Projection(model, "gate_up_proj", "column", hidden, 2 * ffn),
        Projection(model, "down_proj", "row", ffn, hidden),
    ]


GPU_PROJECTIONS = (_llama_projections("Llama-3-8B", 4096, 14336, 32, 8)
                   + _llama_projections("Llama-3-70B", 8192, 28672, 64, 8))
CPU_PROJECTIONS = _llama_projections("tiny", 64, 128, 8, 8)
GPU_TOKENS, CPU_TOKENS = 8192, 64
TP_DEGREES = (2, 4, 8)


class _Case:
    """Tensors and closures of one projection at one TP degree."""

    def __init__(self, proj: Projection, tp: int, tokens: int, device, dtype):
        self.tp, self.kind = tp, proj.kind
        self.chunk = tokens // tp
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

        if proj.kind == "column":
            k, n = proj.in_features, proj.out_features // tp
            self.x = rand(tokens, k)  # the gathered input
            self.out = torch.empty(tokens, n, device=device, dtype=dtype)
            self.transfer_shape = (self.chunk, k)  # one gathered chunk travels per step
        else:
            k, n = proj.in_features // tp, proj.out_features
            self.x = rand(tokens, k)
            self.out = torch.empty(tokens, n, device=device, dtype=dtype)
            self.partials = [torch.empty(self.chunk, n, device=device, dtype=dtype) for _ in range(2)]
            self.transfer_shape = (self.chunk, n)  # one partial sum travels per step
        self.w_t = (rand(n, k) / k**0.5).t()  # nn.Linear weight [out, in], used transposed
        self.send = rand(*self.transfer_shape)
        self.recv = [torch.empty(self.transfer_shape, device=device, dtype=dtype) for _ in range(2)]
        self.flops = 2.0 * tokens * k * n
        self.transfer_bytes = (tp - 1) * self.send.numel() * self.send.element_size()

    def full_gemm(self):
        torch.mm(self.x, self.w_t, out=self.out)

    def _chunk_gemm(self, step: int):
        rows = self.x[step * self.chunk:(step + 1) * self.chunk]
        if self.kind == "column":
            torch.mm(rows, self.w_t, out=self.out[step * self.chunk:(step + 1) * self.chunk])
            return None
        partial = self.partials[step % 2]
        torch.mm(rows, self.w_t, out=partial)
        return partial

    def chunked_gemms(self):
        for step in range(self.tp):
            self._chunk_gemm(step)

    def transfers_alone(self):
        for step in range(self.tp - 1):
            self.recv[step % 2].copy_(self.send)

    def sequential(self):
        """Everything transferred first, then one GEMM: the collective-then-matmul path."""
        self.transfers_alone()
        self.full_gemm()

    def pipelined(self, side: torch.cuda.Stream):
        """The ring's schedule, with a same-device copy standing in for each exchange."""
        main = torch.cuda.current_stream()
        pending = None
        for step in range(self.tp):
            if self.kind == "column":
                if step < self.tp - 1:  # chunk step+1 travels while chunk step is multiplied
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        self.recv[step % 2].copy_(self.send)
                    pending = torch.cuda.Event()
                    pending.record(side)
                self._chunk_gemm(step)
                if pending is not None:
                    main.wait_event(pending)
                    pending = None
            else:
                partial = self._chunk_gemm(step)  # runs while the previous partial travels
                if pending is not None:
                    main.wait_event(pending)
                    partial += self.recv[(step - 1) % 2]
                    pending = None
                if step < self.tp - 1:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        self.recv[step % 2].copy_(partial)
                    pending = torch.cuda.Event()
                    pending.record(side)


def _bench_case(ctx: BenchContext, proj: Projection, tp: int, tokens: int, dtype) -> list[Result]:
    case = _Case(proj, tp, tokens, ctx.device, dtype)
    iters = 20 if ctx.on_gpu else 5
    t_full = ctx.time(case.full_gemm, iters=iters)
    t_chunks = ctx.time(case.chunked_gemms, iters=iters)
    params = {"model": proj.model, "projection": proj.name, "kind": proj.kind, "tp": tp, "tokens": tokens,
              "in_features": proj.in_features, "out_features": proj.out_features,
              "dtype": str(dtype).removeprefix("torch."), "gemm_flops": case.flops}
    label = f"tp_overlap {proj.model} {proj.name} P={tp}"
    peak = ctx.peaks.get("matmul_tflops")
    results = [Result(
        name=f"{label} chunked GEMMs", value=t_chunks * 1e3, unit="ms", higher_is_better=False,
        anchor="one full GEMM (cuBLAS)" if ctx.on_gpu else "one full GEMM (CPU)", anchor_value=t_full * 1e3,
        peak_fraction=(case.flops / t_chunks / 1e12) / peak if peak else None, params=params,
    )]
    if not ctx.on_gpu:
        return results
    side = torch.cuda.Stream(device=ctx.device)
    t_transfer = ctx.time(case.transfers_alone, iters=iters)
    t_pipe = ctx.time(lambda: case.pipelined(side), iters=iters)
    t_seq = ctx.time(case.sequential, iters=iters)
    exposed = max(0.0, t_pipe - t_chunks)
    params = {**params, "transfer_bytes": case.transfer_bytes, "transfer_ms": t_transfer * 1e3,
              "chunked_gemms_ms": t_chunks * 1e3, "pipelined_ms": t_pipe * 1e3,
              "exposed_fraction_of_transfer": exposed / t_transfer if t_transfer else None,
              "exposed_fraction_of_gemms": exposed / t_chunks}
    results.append(Result(
        name=f"{label} exposed simulated transfer", value=exposed * 1e3, unit="ms", higher_is_better=False,
        anchor="the transfers alone (D2D copy of the same bytes)", anchor_value=t_transfer * 1e3, params=params,
    ))
    results.append(Result(
        name=f"{label} pipelined", value=t_pipe * 1e3, unit="ms", higher_is_better=False,
        anchor="transfer everything, then one GEMM", anchor_value=t_seq * 1e3, params=params,
    ))
    return results


def run(ctx: BenchContext) -> list[Result]:
    small = ctx.quick or not ctx.on_gpu
    projections, tokens = (CPU_PROJECTIONS, CPU_TOKENS) if small else (GPU_PROJECTIONS, GPU_TOKENS)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = []
    for proj in projections:
        for tp in TP_DEGREES:
            results += _bench_case(ctx, proj, tp, tokens, dtype)
            if ctx.on_gpu:
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    context = BenchContext(device=device, peaks={}, quick=not torch.cuda.is_available())
    for result in run(context):
        print(f"{result.name:60s} {result.value:9.3f} {result.unit}  x{result.ratio:5.2f} vs {result.anchor}")
