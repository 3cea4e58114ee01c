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
from pathlib import Path

import torch

try:
    from xorl_kernels import _C
except ImportError as _err:  # not built: pure-Python install, or built for another Python
    _C = None
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None


def _warn_if_stale() -> None:
    """In a source checkout, say so when csrc/ changed after the extension was built: an editable
    install does not rebuild it by itself."""
    built = Path(_C.__file__)
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    if not csrc.is_dir():
        return
    sources = [p for p in csrc.iterdir() if p.suffix in (".cu", ".cuh", ".cpp", ".h")]
    newer = sorted(p.name for p in sources if p.stat().st_mtime > built.stat().st_mtime)
    if newer:
        warnings.warn(
            f"xorl_kernels._C is older than csrc/{', csrc/'.join(newer)}; rebuild it with "
            "`pip install -e . --no-deps` or `python setup.py build_ext --inplace`",
            stacklevel=2,
        )


if _C is not None:
    try:
        _warn_if_stale()
    except OSError:
        pass

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
    host: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if host and t.is_cuda:
        raise ValueError(f"{op}: host emulation runs on CPU tensors, got {name} on {t.device}")
    if not host and not t.is_cuda:
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
    out: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    op: str,
    host: bool = False,
) -> None:
    _check(out, "out", op, device=device, dtypes=[dtype], host=host)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")


def _launch(device: torch.device, kernel: str, host: bool, *args) -> None:
    """Run ``_C.<kernel>(*args, stream)`` on ``device`` and its current torch stream.

    ``host=True`` runs ``_C.<kernel>_host(*args)`` instead: the same index map on CPU memory, which
    is how the address arithmetic (here and in csrc) is tested on machines without a GPU.
    """
    if host:
        getattr(_C, f"{kernel}_host")(*args)
        return
    with torch.cuda.device(device):
        getattr(_C, kernel)(*args, torch.cuda.current_stream(device).cuda_stream)


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
    *,
    host_emulation: bool = False,
) -> None:
    """local <- full at the zig-zag rows of ranks [rank_begin, rank_begin+num_ranks) (or the inverse).

    ``full`` and ``local`` agree on every dim but ``dim``, where full has seq_len rows and local
    num_ranks * seq_len / world. ``cu_seqlens``: int64 on the same device, or None. The argument
    rules (divisibility, document lengths) are checked by zigzag_gather.py.
    ``host_emulation``: run the kernel's index map on CPU tensors (tests without a GPU).
    """
    op = "zigzag_scatter" if scatter else "zigzag_gather"
    _require_ext(op)
    host = host_emulation
    _check(full, "full tensor", op, host=host)
    _check(local, "local shard", op, device=full.device, dtypes=[full.dtype], dim=full.dim(), host=host)
    seq_len = full.shape[dim]
    if world < 1 or seq_len % (2 * world) != 0 or not 0 <= rank_begin <= rank_begin + num_ranks <= world:
        raise ValueError(
            f"{op}: need world >= 1 dividing seq_len / 2 and 0 <= rank_begin <= rank_begin + num_ranks <= world; "
            f"got seq_len={seq_len}, world={world}, rank_begin={rank_begin}, num_ranks={num_ranks}"
        )
    expected = list(full.shape)
    expected[dim] = num_ranks * (seq_len // world)
    if list(local.shape) != expected:
        raise ValueError(f"{op}: the local shard must have shape {tuple(expected)}, got {tuple(local.shape)}")
    cu_ptr, num_docs = 0, 0
    if cu_seqlens is not None:
        _check(cu_seqlens, "cu_seqlens", op, device=full.device, dtypes=[torch.int64], dim=1, host=host)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"{op}: cu_seqlens needs num_docs + 1 >= 2 entries, got {cu_seqlens.numel()}")
        cu_ptr, num_docs = cu_seqlens.data_ptr(), cu_seqlens.numel() - 1
    outer, row_bytes = _zigzag_view(full, dim)
    _launch(
        full.device,
        "zigzag_copy",
        host,
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
        "routing_metadata",
        False,
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


def ext_permute_rows(
    x: torch.Tensor,
    src_row: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """out[r] = x[src_row[r]] for x [T, H] (any dtype), src_row [R] int64; an index outside [0, T) gives a zero row."""
    op = "permute_rows"
    _require_ext(op)
    host = host_emulation
    _check(x, "x", op, dim=2, host=host)
    _check(src_row, "src_row", op, device=x.device, dtypes=[torch.int64], dim=1, host=host)
    shape = (src_row.shape[0], x.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, shape, x.dtype, x.device, op, host=host)
    row_bytes = x.shape[1] * x.element_size()
    _launch(
        x.device,
        "permute_rows",
        host,
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
    _require_ext(op)
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
        "unpermute_combine",
        False,
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


def _pack_inputs(tensors: Sequence[torch.Tensor], world: int, split_dim: int, op: str, host: bool):
    """(first tensor, per-destination element counts) after checking the tensors to pack."""
    _require_ext(op)
    numels = ulysses_piece_numels([tuple(t.shape) for t in tensors], world, split_dim, op)
    first = tensors[0]
    for i, t in enumerate(tensors):
        _check(t, f"tensors[{i}]", op, device=first.device, dtypes=[first.dtype], dim=4, host=host)
    return first, numels


def _pack_buffer(out, world, numels, like: torch.Tensor, op: str, host: bool) -> torch.Tensor:
    shape = (world, sum(numels))
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check_out(out, shape, like.dtype, like.device, op, host=host)
    return out


def _unpack_inputs(recv, world, shapes, split_dim, outs, op, host):
    """(per-source element counts, out tensors or Nones) after checking the received buffer."""
    _require_ext(op)
    numels = ulysses_piece_numels(shapes, world, split_dim, op)
    _check(recv, "recv", op, dim=2, host=host)
    if tuple(recv.shape) != (world, sum(numels)):
        raise ValueError(
            f"{op}: recv must be [world, sum of piece sizes] = {(world, sum(numels))} for these shapes, "
            f"got {tuple(recv.shape)}; pass the shapes every rank packed"
        )
    outs = list(outs) if outs is not None else [None] * len(shapes)
    if len(outs) != len(shapes):
        raise ValueError(f"{op}: pass one out tensor per shape ({len(shapes)}), got {len(outs)}")
    return numels, outs


def _unpack_output(out, shape, recv, op, host) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=recv.dtype, device=recv.device)
    _check_out(out, shape, recv.dtype, recv.device, op, host=host)
    return out


# Every segment below is (src, dst, a_count, b_count, bytes, src_stride_a, src_stride_b,
# dst_stride_a, dst_stride_b): `bytes` bytes move from src + a*src_stride_a + b*src_stride_b to
# dst + a*dst_stride_a + b*dst_stride_b (csrc/xorl_kernels.h). `chunk` is one destination's row
# of the [world, D] buffer in bytes; `offset` is where a tensor's piece starts inside that row.


def ext_ulysses_pack(
    tensors: Sequence[torch.Tensor],
    world: int,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """Seq-sharded [b, s, H_t, d_t] tensors -> the all-to-all send buffer [world, D] (head group p to rank p)."""
    op, host = "ulysses_pack", host_emulation
    first, numels = _pack_inputs(tensors, world, 2, op, host)
    buf = _pack_buffer(out, world, numels, first, op, host)
    es = first.element_size()
    chunk, offset, segments = sum(numels) * es, 0, []
    for t, n in zip(tensors, numels):
        b, s, h, d = t.shape
        c = (h // world) * d * es  # a = token (b*s of them), b = destination p: one token's head group
        segments.append((t.data_ptr(), buf.data_ptr() + offset, b * s, world, c, world * c, c, c, chunk))
        offset += n * es
    _launch(first.device, "block_transpose", host, segments)
    return buf


def ext_ulysses_unpack(
    recv: torch.Tensor,
    world: int,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor] | None = None,
    *,
    host_emulation: bool = False,
) -> list[torch.Tensor]:
    """Received [world, D] -> [b, world*s, H_t/world, d_t] per segment; ``shapes``: what every rank packed."""
    op, host = "ulysses_unpack", host_emulation
    numels, outs = _unpack_inputs(recv, world, shapes, 2, outs, op, host)
    es = recv.element_size()
    chunk, offset, segments, results = sum(numels) * es, 0, [], []
    for (b, s, h, d), n, out in zip(shapes, numels, outs):
        y = _unpack_output(out, (b, world * s, h // world, d), recv, op, host)
        run = s * (h // world) * d * es  # a = source p, b = batch row: one source's sequence chunk
        segments.append((recv.data_ptr() + offset, y.data_ptr(), world, b, run, chunk, run, run, world * run))
        results.append(y)
        offset += n * es
    _launch(recv.device, "block_transpose", host, segments)
    return results


def ext_ulysses_pack_reverse(
    tensors: Sequence[torch.Tensor],
    world: int,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """Head-sharded [b, S, h_t, d_t] tensors -> the send buffer [world, D] (sequence chunk p to rank p)."""
    op, host = "ulysses_pack_reverse", host_emulation
    first, numels = _pack_inputs(tensors, world, 1, op, host)
    buf = _pack_buffer(out, world, numels, first, op, host)
    es = first.element_size()
    chunk, offset, segments = sum(numels) * es, 0, []
    for t, n in zip(tensors, numels):
        b, s, h, d = t.shape
        run = (s // world) * h * d * es  # a = destination p, b = batch row: one sequence chunk
        segments.append((t.data_ptr(), buf.data_ptr() + offset, world, b, run, run, world * run, chunk, run))
        offset += n * es
    _launch(first.device, "block_transpose", host, segments)
    return buf


def ext_ulysses_unpack_reverse(
    recv: torch.Tensor,
    world: int,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor] | None = None,
    *,
    host_emulation: bool = False,
) -> list[torch.Tensor]:
    """Received [world, D] -> [b, S/world, world*h_t, d_t] per segment; ``shapes``: what every rank packed."""
    op, host = "ulysses_unpack_reverse", host_emulation
    numels, outs = _unpack_inputs(recv, world, shapes, 1, outs, op, host)
    es = recv.element_size()
    chunk, offset, segments, results = sum(numels) * es, 0, [], []
    for (b, s, h, d), n, out in zip(shapes, numels, outs):
        x = _unpack_output(out, (b, s // world, world * h, d), recv, op, host)
        c = h * d * es  # a = token (b*s/world of them), b = source p: one source's head group
        segments.append(
            (recv.data_ptr() + offset, x.data_ptr(), b * (s // world), world, c, c, chunk, world * c, c)
        )
        results.append(x)
        offset += n * es
    _launch(recv.device, "block_transpose", host, segments)
    return results
