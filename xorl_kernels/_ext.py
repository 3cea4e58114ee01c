"""The compiled CUDA extension ``xorl_kernels._C`` and thin, checked wrappers around its kernels.

The kernels (csrc/) take raw device pointers, sizes and a CUDA stream, so the extension does not
depend on the torch ABI. Everything torch-shaped happens here: device, dtype, shape and contiguity
checks (each error names the argument and the fix), output allocation, the current stream and a
device guard. The wrappers never read a device value on the host.

``has_cuda_ext()`` says whether the extension was built and imports; ``use_cuda_ext(*tensors)``
is the dispatch test the op files use (extension built, every tensor on CUDA, and
XORL_FORCE_REFERENCE not set). The op files (zigzag_gather.py, routing_metadata.py,
ulysses_transpose.py, permute.py) hold the plain-torch references and the documented layouts.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

try:
    from xorl_kernels import _C
except ImportError as _err:  # not built: pure-Python install, or built for another Python
    _C = None
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None

_COMBINE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ID_DTYPES = (torch.int32, torch.int64)


def has_cuda_ext() -> bool:
    """True when ``xorl_kernels._C`` imports (it was built at install time with nvcc)."""
    return _C is not None


def cuda_ext_import_error() -> ImportError | None:
    """Why ``xorl_kernels._C`` did not import (None when it did)."""
    return _IMPORT_ERROR


def force_reference() -> bool:
    """XORL_FORCE_REFERENCE=1 sends every op to its plain-torch reference (debugging)."""
    return os.environ.get("XORL_FORCE_REFERENCE", "0") not in ("", "0")


def use_cuda_ext(*tensors: torch.Tensor | None) -> bool:
    """Dispatch test: the extension is built and can run on the tensors' GPU, every given tensor is
    on CUDA, and no reference is forced."""
    if _C is None or force_reference():
        return False
    devices = {t.device for t in tensors if t is not None}
    if not devices or any(d.type != "cuda" for d in devices):
        return False
    return all(cuda_ext_runs_on(d) for d in devices)


# The kernels are compiled for sm_80 (SASS + PTX, so later GPUs JIT it) and sm_90a.
_MIN_CAPABILITY = (8, 0)
_RUNS_ON: dict[int, bool] = {}


def cuda_ext_runs_on(device: torch.device) -> bool:
    """Whether the extension can launch on ``device``: its runtime talks to the driver (a runtime
    newer than the driver cannot) and the GPU is sm_80 or newer. Checked once per device; when it
    cannot, a warning says why and the ops fall back to their Triton / torch paths."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _RUNS_ON:
        status, message = _C.cuda_probe()
        capability = torch.cuda.get_device_capability(index)
        reason = None
        if status != 0:
            reason = f"its CUDA runtime {_C.cuda_runtime_version()} cannot use this driver ({message})"
        elif capability < _MIN_CAPABILITY:
            reason = f"the GPU is sm_{capability[0]}{capability[1]}, the kernels need sm_80 or newer"
        if reason is not None:
            warnings.warn(
                f"xorl_kernels._C is built but not used on cuda:{index}: {reason}; ops fall back to Triton / torch",
                stacklevel=2,
            )
        _RUNS_ON[index] = reason is None
    return _RUNS_ON[index]


# ---------------------------------------------------------------------------------------------
# Checks and launch
# ---------------------------------------------------------------------------------------------


def _require_ext(op: str):
    if _C is None:
        raise RuntimeError(
            f"{op}: the CUDA extension xorl_kernels._C is not available ({_IMPORT_ERROR}); reinstall xorl "
            "with nvcc on the PATH (pip install -e .) or call the op's plain-torch reference"
        )
    return _C


def _check(
    t: torch.Tensor,
    name: str,
    op: str,
    *,
    device: torch.device | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    dim: int | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(
            f"{op}: {name} must be a CUDA tensor, got one on {t.device}; CPU tensors use the reference"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but the other inputs are on {device}; move it with .to()"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous; pass {name}.contiguous()")


def _check_out(
    out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device, op: str
) -> None:
    _check(out, "out", op, device=device, dtypes=[dtype])
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")


def _launch(device: torch.device, kernel, *args) -> None:
    """Run ``kernel(*args, stream)`` on ``device`` and its current torch stream."""
    with torch.cuda.device(device):
        kernel(*args, torch.cuda.current_stream(device).cuda_stream)


# ---------------------------------------------------------------------------------------------
# Zig-zag context-parallel shards (layout: zigzag_gather.py)
# ---------------------------------------------------------------------------------------------


def _zigzag_view(t: torch.Tensor, dim: int) -> tuple[int, int]:
    """(outer, row_bytes) of ``t`` viewed as [outer, t.shape[dim], row_bytes]."""
    outer = 1
    for size in t.shape[:dim]:
        outer *= size
    inner = 1
    for size in t.shape[dim + 1 :]:
        inner *= size
    return outer, inner * t.element_size()


def ext_zigzag_copy(
    full: torch.Tensor,
    local: torch.Tensor,
    dim: int,
    rank_begin: int,
    num_ranks: int,
    world: int,
    cu_seqlens: torch.Tensor | None,
    scatter: bool,
) -> None:
    """local <- full at the zig-zag rows of ranks [rank_begin, rank_begin+num_ranks) (or the inverse).

    ``full`` and ``local`` agree on every dim but ``dim``, where full has seq_len rows and local
    num_ranks * seq_len / world. ``cu_seqlens``: int64 on the same device, or None. The argument
    rules (divisibility, document lengths) are checked by zigzag_gather.py.
    """
    op = "zigzag_scatter" if scatter else "zigzag_gather"
    ext = _require_ext(op)
    _check(full, "full tensor", op)
    _check(local, "local shard", op, device=full.device, dtypes=[full.dtype], dim=full.dim())
    seq_len = full.shape[dim]
    expected = list(full.shape)
    expected[dim] = num_ranks * (seq_len // world)
    if list(local.shape) != expected:
        raise ValueError(f"{op}: the local shard must have shape {tuple(expected)}, got {tuple(local.shape)}")
    cu_ptr, num_docs = 0, 0
    if cu_seqlens is not None:
        _check(cu_seqlens, "cu_seqlens", op, device=full.device, dtypes=[torch.int64], dim=1)
        cu_ptr, num_docs = cu_seqlens.data_ptr(), cu_seqlens.numel() - 1
    outer, row_bytes = _zigzag_view(full, dim)
    _launch(
        full.device,
        ext.zigzag_copy,
        full.data_ptr(),
        local.data_ptr(),
        outer,
        seq_len,
        row_bytes,
        cu_ptr,
        num_docs,
        rank_begin,
        num_ranks,
        world,
        scatter,
    )


# ---------------------------------------------------------------------------------------------
# MoE routing metadata and the row movements it drives (definitions: routing_metadata.py)
# ---------------------------------------------------------------------------------------------


def ext_routing_metadata(expert_ids: torch.Tensor, num_experts: int):
    """(sorted_slots [T*K], row_map [T, K], tokens_per_expert [E], expert_offsets [E+1], sorted_tokens [T*K]).

    All int64, computed on the device with no host synchronisation. Ids outside [0, num_experts)
    are dropped slots: they sort after every expert and are not counted.
    """
    op = "routing_metadata"
    ext = _require_ext(op)
    _check(expert_ids, "expert_ids", op, dtypes=_ID_DTYPES, dim=2)
    if not 1 <= num_experts <= ext.routing_max_experts():
        raise ValueError(f"{op}: num_experts must be in [1, {ext.routing_max_experts()}], got {num_experts}")
    tokens, top_k = expert_ids.shape
    if top_k < 1:
        raise ValueError(
            f"{op}: expert_ids must have top_k >= 1 columns, got shape {tuple(expert_ids.shape)}"
        )
    num_slots = tokens * top_k
    dev = expert_ids.device
    workspace = torch.empty(
        ext.routing_workspace_elems(num_slots, num_experts), dtype=torch.int64, device=dev
    )
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=dev)
    expert_offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    row_map = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    sorted_slots = torch.empty(num_slots, dtype=torch.int64, device=dev)
    sorted_tokens = torch.empty(num_slots, dtype=torch.int64, device=dev)
    _launch(
        dev,
        ext.routing_metadata,
        expert_ids.data_ptr(),
        expert_ids.dtype == torch.int64,
        num_slots,
        top_k,
        num_experts,
        workspace.data_ptr(),
        tokens_per_expert.data_ptr(),
        expert_offsets.data_ptr(),
        row_map.data_ptr(),
        sorted_slots.data_ptr(),
        sorted_tokens.data_ptr(),
    )
    return sorted_slots, row_map, tokens_per_expert, expert_offsets, sorted_tokens


def ext_permute_rows(x: torch.Tensor, src_row: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = x[src_row[r]] for x [T, H] (any dtype), src_row [R] int64; an index outside [0, T) gives a zero row."""
    op = "permute_rows"
    ext = _require_ext(op)
    _check(x, "x", op, dim=2)
    _check(src_row, "src_row", op, device=x.device, dtypes=[torch.int64], dim=1)
    shape = (src_row.shape[0], x.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, shape, x.dtype, x.device, op)
    row_bytes = x.shape[1] * x.element_size()
    _launch(
        x.device,
        ext.permute_rows,
        x.data_ptr(),
        src_row.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        shape[0],
        row_bytes,
    )
    return out


def ext_unpermute_combine(
    y: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]] (fp32, k order, no atomics) in y's dtype.

    y [R, H] fp32/fp16/bf16; row_of_slot [T, K] int64; weights [T, K] fp32. A row index outside
    [0, R) contributes nothing (a dropped slot).
    """
    op = "unpermute_combine"
    ext = _require_ext(op)
    _check(y, "y", op, dtypes=list(_COMBINE_DTYPES), dim=2)
    _check(row_of_slot, "row_of_slot", op, device=y.device, dtypes=[torch.int64], dim=2)
    _check(weights, "weights", op, device=y.device, dtypes=[torch.float32], dim=2)
    if weights.shape != row_of_slot.shape:
        raise ValueError(
            f"{op}: weights must have row_of_slot's shape {tuple(row_of_slot.shape)}, got {tuple(weights.shape)}"
        )
    tokens, top_k = row_of_slot.shape
    shape = (tokens, y.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=y.dtype, device=y.device)
    else:
        _check_out(out, shape, y.dtype, y.device, op)
    _launch(
        y.device,
        ext.unpermute_combine,
        y.data_ptr(),
        row_of_slot.data_ptr(),
        weights.data_ptr(),
        out.data_ptr(),
        y.shape[0],
        tokens,
        top_k,
        y.shape[1],
        _COMBINE_DTYPES[y.dtype],
    )
    return out


# ---------------------------------------------------------------------------------------------
# Ulysses pack / unpack (layouts: ulysses_transpose.py)
# ---------------------------------------------------------------------------------------------


def _ulysses_inputs(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    if not 1 <= len(tensors) <= 4:
        raise ValueError(f"{op}: pass 1 to 4 tensors (e.g. q, k, v), got {len(tensors)}")
    _require_ext(op)
    first = tensors[0]
    for i, t in enumerate(tensors):
        _check(t, f"tensors[{i}]", op, device=first.device, dtypes=[first.dtype], dim=4)
    return first


def _ulysses_buffer(out, world, width, dtype, device, op) -> torch.Tensor:
    if out is None:
        return torch.empty(world, width, dtype=dtype, device=device)
    _check_out(out, (world, width), dtype, device, op)
    return out


def ulysses_piece_numels(shapes: Sequence[Sequence[int]], world: int, split_dim: int, op: str) -> list[int]:
    """Elements each packed tensor contributes to one destination's chunk, after checking the shapes.

    ``shapes`` are the [b, s, heads, head_dim] shapes given to the pack; ``split_dim`` is the dim
    the pack splits across ranks (2: heads, for ulysses_pack; 1: sequence, for ulysses_pack_reverse).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"{op}: world must be a positive int, got {world!r}")
    if not 1 <= len(shapes) <= 4:
        raise ValueError(f"{op}: pass 1 to 4 tensors/shapes (e.g. q, k, v), got {len(shapes)}")
    what = {1: "sequence length", 2: "number of heads"}[split_dim]
    numels = []
    for i, shape in enumerate(shapes):
        if len(shape) != 4:
            raise ValueError(
                f"{op}: tensor {i} must be [batch, seq, heads, head_dim], got shape {tuple(shape)}"
            )
        if shape[split_dim] % world != 0:
            raise ValueError(
                f"{op}: tensor {i} has {what} {shape[split_dim]}, not divisible by world={world}; "
                "pad it or replicate heads first"
            )
        b, s, h, d = shape
        numels.append(b * s * h * d // world)
    return numels


def _check_recv(recv: torch.Tensor, world: int, numels: list[int], op: str) -> None:
    _check(recv, "recv", op, dim=2)
    if tuple(recv.shape) != (world, sum(numels)):
        raise ValueError(
            f"{op}: recv must be [world, sum of piece sizes] = {(world, sum(numels))} for these shapes, "
            f"got {tuple(recv.shape)}; pass the shapes every rank packed"
        )


def _run_block_transpose(device: torch.device, segments: list[tuple]) -> None:
    ext = _require_ext("ulysses transpose")
    _launch(device, ext.block_transpose, segments)


def ext_ulysses_pack(
    tensors: Sequence[torch.Tensor], world: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Seq-sharded [b, s, H_t, d_t] tensors -> the all-to-all send buffer [world, D] (head group p to rank p)."""
    op = "ulysses_pack"
    first = _ulysses_inputs(tensors, op)
    shapes = [tuple(t.shape) for t in tensors]
    numels = ulysses_piece_numels(shapes, world, 2, op)
    buf = _ulysses_buffer(out, world, sum(numels), first.dtype, first.device, op)
    es = first.element_size()
    chunk_bytes = sum(numels) * es
    segments, offset = [], 0
    for t, (b, s, h, d), n in zip(tensors, shapes, numels):
        c = (h // world) * d * es  # one token's heads for one destination
        segments.append(
            (t.data_ptr(), buf.data_ptr() + offset, b * s, world, c, world * c, c, c, chunk_bytes)
        )
        offset += n * es
    _run_block_transpose(first.device, segments)
    return buf


def ext_ulysses_unpack(
    recv: torch.Tensor,
    world: int,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Received [world, D] -> [b, world*s, H_t/world, d_t] per segment; ``shapes``: what every rank packed."""
    op = "ulysses_unpack"
    numels = ulysses_piece_numels(shapes, world, 2, op)
    _check_recv(recv, world, numels, op)
    es = recv.element_size()
    chunk_bytes = sum(numels) * es
    outs = list(outs) if outs is not None else [None] * len(shapes)
    if len(outs) != len(shapes):
        raise ValueError(f"{op}: pass one out tensor per shape ({len(shapes)}), got {len(outs)}")
    results, segments, offset = [], [], 0
    for (b, s, h, d), n, out in zip(shapes, numels, outs):
        shape = (b, world * s, h // world, d)
        y = torch.empty(shape, dtype=recv.dtype, device=recv.device) if out is None else out
        _check_out(y, shape, recv.dtype, recv.device, op)
        run = s * (h // world) * d * es  # one batch row of one source's piece
        segments.append(
            (recv.data_ptr() + offset, y.data_ptr(), world, b, run, chunk_bytes, run, run, world * run)
        )
        results.append(y)
        offset += n * es
    _run_block_transpose(recv.device, segments)
    return results


def ext_ulysses_pack_reverse(
    tensors: Sequence[torch.Tensor], world: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Head-sharded [b, S, h_t, d_t] tensors -> the send buffer [world, D] (sequence chunk p to rank p)."""
    op = "ulysses_pack_reverse"
    first = _ulysses_inputs(tensors, op)
    shapes = [tuple(t.shape) for t in tensors]
    numels = ulysses_piece_numels(shapes, world, 1, op)
    buf = _ulysses_buffer(out, world, sum(numels), first.dtype, first.device, op)
    es = first.element_size()
    chunk_bytes = sum(numels) * es
    segments, offset = [], 0
    for t, (b, s, h, d), n in zip(tensors, shapes, numels):
        run = (s // world) * h * d * es
        segments.append(
            (t.data_ptr(), buf.data_ptr() + offset, world, b, run, run, world * run, chunk_bytes, run)
        )
        offset += n * es
    _run_block_transpose(first.device, segments)
    return buf


def ext_ulysses_unpack_reverse(
    recv: torch.Tensor,
    world: int,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Received [world, D] -> [b, S/world, world*h_t, d_t] per segment; ``shapes``: what every rank packed."""
    op = "ulysses_unpack_reverse"
    numels = ulysses_piece_numels(shapes, world, 1, op)
    _check_recv(recv, world, numels, op)
    es = recv.element_size()
    chunk_bytes = sum(numels) * es
    outs = list(outs) if outs is not None else [None] * len(shapes)
    if len(outs) != len(shapes):
        raise ValueError(f"{op}: pass one out tensor per shape ({len(shapes)}), got {len(outs)}")
    results, segments, offset = [], [], 0
    for (b, s, h, d), n, out in zip(shapes, numels, outs):
        shape = (b, s // world, world * h, d)
        x = torch.empty(shape, dtype=recv.dtype, device=recv.device) if out is None else out
        _check_out(x, shape, recv.dtype, recv.device, op)
        c = h * d * es  # one token's heads from one source
        segments.append(
            (recv.data_ptr() + offset, x.data_ptr(), b * (s // world), world, c, c, chunk_bytes, world * c, c)
        )
        results.append(x)
        offset += n * es
    _run_block_transpose(recv.device, segments)
    return results
