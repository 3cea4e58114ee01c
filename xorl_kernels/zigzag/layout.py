"""Zig-zag context-parallel sharding: the layout (``zigzag_positions``) and the argument checks.

Layout. With ``world`` ranks, a document of L rows (L divisible by 2*world) is cut into 2*world
chunks of c = L / (2*world) rows; rank q holds chunk q followed by chunk 2*world-1-q, so every
rank gets the same amount of causal-attention work. A packed sequence (``cu_seqlens``: document
boundaries, int32/int64, [num_docs + 1], from 0 to seq_len) is sharded per document: the rank's
shard is its two chunks of document 0, then of document 1, ... Without ``cu_seqlens`` the whole
dimension is one document. A shard has seq_len / world rows.

``zigzag_gather(x, dim, rank, world, cu_seqlens=None)``: x with seq_len rows along ``dim`` ->
rank's shard. ``rank=None`` gives every rank's shard one after another (rank 0's, rank 1's, ...),
a permutation of x, e.g. what an all-gather of the shards returns.

``zigzag_scatter(y, dim, rank, world, cu_seqlens=None, out=None)``: the inverse. ``y`` is rank's
shard (or, with ``rank=None``, all shards one after another); its rows are written to their
zig-zag positions in ``out`` (seq_len = world * y.shape[dim], or y.shape[dim] with rank=None).
Without ``out`` a new tensor is returned: with rank=None every row is written; for one rank the
rows of the other ranks are zero. Both ops are differentiable when ``out`` is not given (the
backward of one is the other). Byte copies: any dtype, any trailing shape.

The dispatching, differentiable entry points are in zigzag/op.py (csrc kernel on CUDA, the
plain-torch references of zigzag/reference.py elsewhere). ``zigzag_positions`` is the one
definition of the layout's row order: xorl.distributed.zigzag (the data path's shards) and ring
attention (the causal mask's positions) use it too. Document lengths are validated on the host when ``cu_seqlens`` is on the CPU, and with a device-side
assert (no host synchronisation) when it is on the GPU.
"""


from __future__ import annotations

import torch


def check_args(name: str, t: torch.Tensor, dim: int, rank: int | None, world: int) -> int:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"{name}: world must be a positive int, got {world!r}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(
            f"{name}: rank must be an int in [0, world={world}) or None (all ranks), got {rank!r}"
        )
    if t.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with a sequence dimension, got a scalar")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{name}: dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def check_seq_len(name: str, seq_len: int, world: int, cu_seqlens: torch.Tensor | None) -> None:
    if cu_seqlens is None and seq_len % (2 * world) != 0:
        raise ValueError(
            f"{name}: sequence length {seq_len} is not divisible by 2*world = {2 * world}; pad it to a multiple "
            f"of {2 * world} first (xorl never truncates)"
        )


def prepare_cu_seqlens(
    name: str, cu_seqlens: torch.Tensor | None, seq_len: int, world: int, device: torch.device
) -> torch.Tensor | None:
    """Validate ``cu_seqlens`` and return it as contiguous int64 on ``device`` (None stays None)."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{name}: cu_seqlens must be 1-D with num_docs + 1 >= 2 entries, got {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if seq_len % (2 * world) != 0:
        raise ValueError(
            f"{name}: sequence length {seq_len} is not divisible by 2*world = {2 * world}, so some document is "
            f"not either; pad every document to a multiple of {2 * world} (xorl never truncates)"
        )
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if not cu_seqlens.is_cuda:
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != seq_len:
            raise ValueError(
                f"{name}: cu_seqlens must run from 0 to the sequence length {seq_len}, got "
                f"{int(cu_seqlens[0])} .. {int(cu_seqlens[-1])}"
            )
        bad = ((lengths < 0) | (lengths % (2 * world) != 0)).nonzero()
        if bad.numel():
            doc = int(bad[0, 0])
            raise ValueError(
                f"{name}: document {doc} has length {int(lengths[doc])}, not a non-negative multiple of "
                f"2*world = {2 * world}; pad every document to a multiple of {2 * world} (xorl never truncates)"
            )
    else:
        ok = (
            (cu_seqlens[0] == 0)
            & (cu_seqlens[-1] == seq_len)
            & ((lengths >= 0) & (lengths % (2 * world) == 0)).all()
        )
        torch._assert_async(
            ok,
            f"{name}: cu_seqlens must run from 0 to {seq_len} with every document length a "
            f"multiple of 2*world = {2 * world}",
        )
    return cu_seqlens.to(device=device, dtype=torch.int64).contiguous()


def zigzag_positions(
    seq_len: int,
    rank: int | None,
    world: int,
    cu_seqlens: torch.Tensor | None = None,
    device=None,
    *,
    within_document: bool = False,
) -> torch.Tensor:
    """int64 positions of the shard rows of ``rank`` (None: every rank's rows, rank after rank).

    ``seq_len`` and ``cu_seqlens`` describe the full (global) sequence. By default a position is the
    row's index in the full sequence (what gather/scatter move); with ``within_document`` it is
    the row's index inside its document (what a causal mask compares: ring attention's positions).
    Computed with tensor ops only, so a GPU ``cu_seqlens`` is never read on the host.
    """
    local_len = seq_len // world
    if cu_seqlens is None:
        cu = torch.tensor([0, seq_len], dtype=torch.int64, device=device)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
    ranks = range(world) if rank is None else [rank]
    t = torch.arange(local_len, dtype=torch.int64, device=cu.device)
    # Document of each local row: the first one whose local end lies beyond it (skips empty ones).
    doc = torch.searchsorted(cu[1:] // world, t, right=True)
    start = cu[doc]
    chunk = (cu[doc + 1] - start) // (2 * world)
    u = t - start // world
    base = 0 if within_document else start
    pieces = []
    for q in ranks:
        pieces.append(base + torch.where(u < chunk, q * chunk + u, (2 * world - 1 - q) * chunk + (u - chunk)))
    return torch.cat(pieces)


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2*world per document) that ``rank`` holds, in shard order."""
    return rank, 2 * world - 1 - rank


def zigzag_step_in_window(q_rank: int, k_rank: int, world: int, chunk: int, window: int) -> bool:
    """Whether any query of ``q_rank`` sees any key of ``k_rank`` under a causal sliding window.

    A query at position p sees keys p - window < k <= p of its document. Chunk a (query) and
    chunk b (key), each ``chunk`` rows, are closest at p - k = (a - b - 1)·chunk + 1 when b < a,
    and share keys with distance 0 when b == a. ``chunk`` is the SMALLEST chunk of any document
    in the batch (a shorter document only brings its chunks closer), so False means no document
    of this step has a visible key: the step may skip its compute.
    """
    for a in zigzag_chunks(q_rank, world):
        for b in zigzag_chunks(k_rank, world):
            if b == a or (b < a and (a - b - 1) * chunk + 1 <= window - 1):
                return True
    return False


def scatter_seq_len(y: torch.Tensor, dim: int, rank: int | None, world: int) -> int:
    return y.shape[dim] if rank is None else y.shape[dim] * world


def new_scatter_out(y: torch.Tensor, dim: int, rank: int | None, seq_len: int) -> torch.Tensor:
    shape = list(y.shape)
    shape[dim] = seq_len
    # With one rank's shard, the other ranks' rows are defined as zero; with all ranks, every row is written.
    return y.new_empty(shape) if rank is None else y.new_zeros(shape)


def check_scatter_out(out: torch.Tensor, y: torch.Tensor, dim: int, seq_len: int) -> None:
    shape = list(y.shape)
    shape[dim] = seq_len
    if list(out.shape) != shape or out.dtype != y.dtype or out.device != y.device:
        raise ValueError(
            f"zigzag_scatter: out must be {y.dtype} on {y.device} with shape {tuple(shape)}, got {out.dtype} on "
            f"{out.device} with shape {tuple(out.shape)}"
        )
