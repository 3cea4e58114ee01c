"""Zig-zag sequence sharding for context parallelism (ring × Ulysses), and its inverse.

The layout (defined once, as ``xorl_kernels.zigzag.layout.zigzag_positions``; the data path, the
attention modules and the tests use it):

1. Ring level (``ring_size = P``). Every document of the packed sequence (the whole sequence when
   there is no ``cu_seqlens``) is cut into ``2P`` equal chunks; ring rank ``r`` holds chunks ``r``
   and ``2P-1-r`` of every document. Its ring-local sequence is, document after document, its two
   chunks of that document. Why: under a causal mask chunk ``r`` is cheap and chunk ``2P-1-r`` is
   expensive, so every ring rank does the same attention work at every ring step. With ``P == 1``
   the layout is the identity and documents need no particular length.
2. Ulysses level (``ulysses_size = U``). The ring-local sequence is split into ``U`` contiguous,
   equal pieces; Ulysses rank ``u`` holds piece ``u``. Why contiguous: the Ulysses all-to-all
   concatenates the pieces in rank order, which rebuilds the ring-local sequence exactly.

A context-parallel rank is ``(ring_rank, ulysses_rank)``; in the mesh Ulysses is the inner
dimension (see DESIGN.md), so the flat CP rank is ``ring_rank * U + ulysses_rank``.

``cu_seqlens`` always means the GLOBAL document boundaries of the unsharded (padded) sequence,
identical on every rank. Requirements: every document length divisible by ``2P`` (when P > 1) and
the total length divisible by ``2P·U`` (``U`` when P == 1). :func:`prepare_context_parallel_batch`
pads documents to meet them (pad tokens get ``ignore_index`` labels and continuing position ids),
shifts labels on the full sequence first, and returns the new global ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from xorl_kernels.zigzag.layout import zigzag_positions
from xorl_kernels.zigzag.op import zigzag_gather


# ----------------------------------------------------------------------------------------------
# group specs
# ----------------------------------------------------------------------------------------------
def group_rank_size(group, name: str = "group") -> tuple[int, int]:
    """``(rank, size)`` of a ProcessGroup, a ``(rank, size)`` tuple, or ``None`` (= no parallelism)."""
    if group is None:
        return 0, 1
    if isinstance(group, tuple):
        if len(group) != 2:
            raise ValueError(f"{name} must be a ProcessGroup, a (rank, size) tuple or None, got {group!r}")
        rank, size = int(group[0]), int(group[1])
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{name}=(rank={rank}, size={size}) needs size >= 1 and 0 <= rank < size")
        return rank, size
    return dist.get_rank(group), dist.get_world_size(group)


def _min_lengths(ring_size: int, ulysses_size: int) -> tuple[int, int]:
    """(every document length must divide by, the total length must divide by)."""
    doc_multiple = 2 * ring_size if ring_size > 1 else 1
    return doc_multiple, doc_multiple * ulysses_size


def _as_int_list(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(v) for v in cu_seqlens.detach().cpu().tolist()]
    return [int(v) for v in cu_seqlens]


def _check_cu_seqlens(cu: list[int], total_len: int) -> None:
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total_len:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the sequence length {total_len} (the GLOBAL boundaries "
            f"of the unsharded packed sequence), got {cu[:4]}...{cu[-2:]}"
        )
    if any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")


# ----------------------------------------------------------------------------------------------
# the layout: which global tokens a rank holds
# ----------------------------------------------------------------------------------------------
def ring_local_indices(total_len: int, cu_seqlens, ring_rank: int, ring_size: int) -> torch.Tensor:
    """Global token indices held by ring rank ``ring_rank``, in its local order (CPU int64).

    The row order is ``xorl_kernels.zigzag.layout.zigzag_positions``, the layout's one definition;
    this adds the host-side checks with messages that name the padding helper.
    """
    cu = [0, total_len] if cu_seqlens is None else _as_int_list(cu_seqlens)
    _check_cu_seqlens(cu, total_len)
    if ring_size == 1:
        return torch.arange(total_len)
    for start, end in zip(cu[:-1], cu[1:]):
        length = end - start
        if length % (2 * ring_size):
            raise ValueError(
                f"document [{start}, {end}) has length {length}, not divisible by 2 × ring size = "
                f"{2 * ring_size}; pad it with xorl.distributed.zigzag.prepare_context_parallel_batch "
                "(documents are padded, never truncated)"
            )
    return zigzag_positions(total_len, ring_rank, ring_size, torch.tensor(cu, dtype=torch.int64))


def zigzag_local_indices(
    total_len: int, cu_seqlens, ring: tuple[int, int], ulysses: tuple[int, int] = (0, 1)
) -> torch.Tensor:
    """Global token indices held by CP rank ``(ring_rank, ulysses_rank)``, in local order (CPU int64)."""
    (ring_rank, ring_size), (ulysses_rank, ulysses_size) = ring, ulysses
    _, total_multiple = _min_lengths(ring_size, ulysses_size)
    if total_len % total_multiple:
        raise ValueError(
            f"sequence length {total_len} is not divisible by {total_multiple} (2 × ring size {ring_size} "
            f"× ulysses size {ulysses_size}); pad with prepare_context_parallel_batch"
        )
    ring_local = ring_local_indices(total_len, cu_seqlens, ring_rank, ring_size)
    piece = ring_local.numel() // ulysses_size
    return ring_local[ulysses_rank * piece : (ulysses_rank + 1) * piece]


# ----------------------------------------------------------------------------------------------
# shard / unshard
# ----------------------------------------------------------------------------------------------
def zigzag_shard(x, dim: int = 1, group=None, cu_seqlens=None, ulysses=None):
    """This rank's zig-zag shard of ``x`` along ``dim`` (see the module docstring for the layout).

    ``x``: a tensor or a list/tuple of tensors with the same length along ``dim`` (tokens, labels,
    position ids...), returned in the same structure. ``group``: the ring ProcessGroup, a
    ``(rank, size)`` tuple, or None (size 1); ``ulysses``: the same for the Ulysses group.
    ``cu_seqlens``: global document boundaries (host data; this is a data-path function).
    """
    tensors = list(x) if isinstance(x, (list, tuple)) else [x]
    if not tensors:
        return x
    total_len = tensors[0].shape[dim]
    for t in tensors:
        if t.shape[dim] != total_len:
            raise ValueError(f"all tensors must have the same length along dim={dim}: {t.shape[dim]} vs {total_len}")
    ring_rank, ring_size = group_rank_size(group, "group")
    ulysses_rank, ulysses_size = group_rank_size(ulysses, "ulysses")
    _, total_multiple = _min_lengths(ring_size, ulysses_size)
    if total_len % total_multiple:
        raise ValueError(
            f"sequence length {total_len} is not divisible by {total_multiple} (2 × ring size {ring_size} "
            f"× ulysses size {ulysses_size}); pad with prepare_context_parallel_batch"
        )
    cu = None if cu_seqlens is None else torch.as_tensor(_as_int_list(cu_seqlens), dtype=torch.long)
    if cu is not None:
        _check_cu_seqlens(cu.tolist(), total_len)
    piece = total_len // (ring_size * ulysses_size)
    out = []
    for t in tensors:
        # Ring level: the zig-zag gather kernel (csrc on GPU, index_select on CPU); Ulysses: a slice.
        local = zigzag_gather(t, dim, ring_rank, ring_size, cu) if ring_size > 1 else t
        out.append(local.narrow(dim, ulysses_rank * piece, piece).contiguous())
    return type(x)(out) if isinstance(x, (list, tuple)) else out[0]


def zigzag_unshard_from_shards(
    shards: Sequence[torch.Tensor], dim: int, ring_size: int, cu_seqlens=None, ulysses_size: int = 1
) -> torch.Tensor:
    """Rebuild the full sequence from every CP rank's shard, given in flat CP rank order
    (``ring_rank * ulysses_size + ulysses_rank``)."""
    if len(shards) != ring_size * ulysses_size:
        raise ValueError(
            f"need {ring_size * ulysses_size} shards (ring {ring_size} × ulysses {ulysses_size}), got {len(shards)}"
        )
    total_len = sum(s.shape[dim] for s in shards)
    out = shards[0].new_empty(*shards[0].shape[:dim], total_len, *shards[0].shape[dim + 1 :])
    for flat, shard in enumerate(shards):
        ring_rank, ulysses_rank = divmod(flat, ulysses_size)
        index = zigzag_local_indices(total_len, cu_seqlens, (ring_rank, ring_size), (ulysses_rank, ulysses_size))
        out.index_copy_(dim, index.to(out.device), shard)
    return out


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "zigzag_unshard needs ProcessGroups (or None for size 1) to gather the shards; to rebuild "
            "from a list of shards use zigzag_unshard_from_shards"
        )
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def zigzag_unshard(x, dim: int = 1, group=None, cu_seqlens=None, ulysses=None):
    """Inverse of :func:`zigzag_shard`: all-gathers the shards over the ring and Ulysses groups and
    returns the full sequence on every rank (same structure as ``x``). Not differentiable: it is
    for outputs, metrics and tests."""
    tensors = list(x) if isinstance(x, (list, tuple)) else [x]
    _, ring_size = group_rank_size(group, "group")
    _, ulysses_size = group_rank_size(ulysses, "ulysses")
    out = []
    for t in tensors:
        # Gather over Ulysses first (contiguous pieces), then over the ring: flat order ring-major.
        ulysses_parts = _all_gather(t, ulysses) if ulysses_size > 1 else [t]
        ring_local = torch.cat(ulysses_parts, dim=dim)
        ring_parts = _all_gather(ring_local, group) if ring_size > 1 else [ring_local]
        out.append(zigzag_unshard_from_shards(ring_parts, dim, ring_size, cu_seqlens, 1))
    return type(x)(out) if isinstance(x, (list, tuple)) else out[0]


# ----------------------------------------------------------------------------------------------
# data path: shift labels, pad documents, shard — in one call
# ----------------------------------------------------------------------------------------------
@dataclass
class ContextParallelBatch:
    """This rank's shard of a batch plus the global (padded) document boundaries."""

    input_ids: torch.Tensor  # [batch, local_len]
    labels: torch.Tensor  # [batch, local_len], already shifted: labels[t] is the target of token t
    position_ids: torch.Tensor  # [batch, local_len], within-document positions
    cu_seqlens: torch.Tensor  # int32, GLOBAL boundaries of the padded packed sequence
    max_seqlen: int  # longest padded document
    num_pad_tokens: int  # padding added over the whole sequence (its labels are ignore_index)
    token_mask: torch.Tensor | None = None  # [batch, local_len] bool, False on the padding added here


def padded_document_lengths(doc_lens: Sequence[int], ring_size: int, ulysses_size: int = 1,
                            local_multiple: int = 1) -> list[int]:
    """Document lengths after padding: each up to a multiple of 2·ring (when ring > 1), then the
    last one further so the total divides by 2·ring·ulysses (x ``local_multiple``, so each CP rank's
    shard divides by it: the tensor-parallel size when the TP ranks split the shard's tokens)."""
    doc_multiple, total_multiple = _min_lengths(ring_size, ulysses_size)
    total_multiple *= local_multiple
    padded = [-(-n // doc_multiple) * doc_multiple for n in doc_lens]
    extra = -sum(padded) % total_multiple
    padded[-1] += extra
    return padded


def prepare_context_parallel_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens=None,
    ring=None,
    ulysses=None,
    ignore_index: int = -100,
    pad_token_id: int = 0,
    shift_labels: bool = True,
    pad_to: int | None = None,
    local_multiple: int = 1,
) -> ContextParallelBatch:
    """Shift labels on the full sequence, pad every document, then zig-zag shard everything.

    ``input_ids`` (and ``labels``/``position_ids`` if given): ``[batch, seq]`` unsharded; ``cu_seqlens``
    the global document boundaries shared by every row (None = one document per row). ``labels``
    default to ``input_ids``; with ``shift_labels`` the target of token t becomes label t+1 of the
    same document (the last token of each document gets ``ignore_index``) BEFORE sharding, so
    shard boundaries never pair a token with a wrong target. Padding goes at the end of each
    document: ``pad_token_id`` tokens, ``ignore_index`` labels, position ids continuing. Causal
    attention never lets a real token see a later pad token, so padding changes no real output.
    ``pad_to``: pad the row further to exactly this many tokens with a document of padding alone
    (pipeline stages need one shape for every microbatch of a step); a multiple of 2·ring·ulysses.
    ``local_multiple``: each rank's shard must divide by it (the TP size, when TP ranks split it).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    batch, total_len = input_ids.shape
    cu = [0, total_len] if cu_seqlens is None else _as_int_list(cu_seqlens)
    _check_cu_seqlens(cu, total_len)
    doc_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    labels = input_ids if labels is None else labels
    if position_ids is None:
        position_ids = torch.cat([torch.arange(n, device=input_ids.device) for n in doc_lens]).expand(batch, -1)
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must match input_ids {tuple(input_ids.shape)}")
    if shift_labels:
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        last_of_doc = torch.tensor([e - 1 for e in cu[1:] if e > 0], device=labels.device, dtype=torch.long)
        shifted[:, last_of_doc] = ignore_index
        labels = shifted

    _, ring_size = group_rank_size(ring, "ring")
    _, ulysses_size = group_rank_size(ulysses, "ulysses")
    padded = padded_document_lengths(doc_lens, ring_size, ulysses_size, local_multiple)
    if pad_to is not None:
        extra = pad_to - sum(padded)
        multiple = _min_lengths(ring_size, ulysses_size)[1] * local_multiple
        if extra < 0 or extra % multiple:
            raise ValueError(
                f"pad_to={pad_to}: the padded documents already take {sum(padded)} tokens, and pad_to must be a "
                f"multiple of {multiple} (2 x ring x ulysses x local_multiple)"
            )
        if extra:
            doc_lens, padded = doc_lens + [0], padded + [extra]
    pad_ids, pad_labels, pad_pos, real = [], [], [], []
    src = 0
    for n, p in zip(doc_lens, padded):
        sl = slice(src, src + n)
        last_pos = position_ids[:, src + n - 1 : src + n] if n else position_ids.new_full((batch, 1), -1)
        ramp = torch.arange(1, p - n + 1, device=position_ids.device)
        pad_ids += [input_ids[:, sl], input_ids.new_full((batch, p - n), pad_token_id)]
        pad_labels += [labels[:, sl], labels.new_full((batch, p - n), ignore_index)]
        pad_pos += [position_ids[:, sl], last_pos + ramp]
        real += [torch.ones(batch, n, dtype=torch.bool), torch.zeros(batch, p - n, dtype=torch.bool)]
        src += n
    new_cu = torch.tensor([0] + list(torch.tensor(padded).cumsum(0).tolist()), dtype=torch.int32)
    full = [torch.cat(pad_ids, 1), torch.cat(pad_labels, 1), torch.cat(pad_pos, 1),
            torch.cat(real, 1).to(input_ids.device)]
    ids, lab, pos, mask = zigzag_shard(full, 1, ring, new_cu, ulysses)
    return ContextParallelBatch(
        input_ids=ids,
        labels=lab,
        position_ids=pos,
        cu_seqlens=new_cu.to(input_ids.device),
        max_seqlen=max(padded),
        num_pad_tokens=(sum(padded) - total_len),
        # Where padding was added: layers whose result depends on which tokens exist (MoE
        # routing statistics) leave those tokens out, so every layout counts the same tokens.
        token_mask=mask if sum(padded) != total_len else None,
    )
