"""Packed documents cut into fixed-size chunks that never cross a document boundary.

The chunked kernels of the linear-attention ops (gated_delta/, short_conv/) give one program to one
chunk of one document: the gated delta rule resets its state at every document start and the
causal convolution must not read across one, so a chunk that straddled two documents would need
per-row document logic in every kernel. Instead each document of length L gets ceil(L / C) chunks
(the last one partial) and the kernels read, per chunk, where it starts and ends and which document
it belongs to; the sequential state scan reads, per document, its range of chunks.

Batched inputs [batch, seq, ...] are the packed form with ``batch`` documents of length ``seq``
(built without reading anything from the device). Packed inputs give ``cu_seqlens`` (int32/int64,
[docs + 1], from 0 to the total, non-decreasing); it is read on the host once (one device sync
per call, as the grid size depends on it) and checked there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DocChunks(NamedTuple):
    cu_seqlens: torch.Tensor  # int32 [docs + 1]
    chunk_start: torch.Tensor  # int32 [chunks]: first token of the chunk
    chunk_end: torch.Tensor  # int32 [chunks]: one past its last token (<= chunk_start + chunk_size)
    chunk_doc: torch.Tensor  # int32 [chunks]: the document it belongs to
    doc_chunk_offsets: torch.Tensor  # int32 [docs + 1]: the chunks of document n are [off[n], off[n + 1])
    num_docs: int
    num_chunks: int


def check_cu_seqlens(op: str, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens on the host as int64, after the checks (1-D, starts at 0, ends at total, non-decreasing)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{op}: cu_seqlens must be 1-D [docs + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    host = cu_seqlens.detach().to("cpu", torch.int64)
    if int(host[0]) != 0 or int(host[-1]) != total:
        raise ValueError(f"{op}: cu_seqlens must run from 0 to the number of tokens ({total}), "
                         f"got {int(host[0])} .. {int(host[-1])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing")
    return host


def doc_chunks(op: str, cu_seqlens: torch.Tensor | None, batch: int, seq_len: int, chunk_size: int,
               device: torch.device) -> DocChunks:
    """The chunk tables for ``batch`` rows of ``seq_len`` tokens (cu_seqlens None) or for the packed
    documents of ``cu_seqlens`` (then batch must be 1 and seq_len is the total)."""
    if cu_seqlens is None:
        per_doc = -(-seq_len // chunk_size)
        host_cu = torch.arange(0, batch + 1, dtype=torch.int64) * seq_len
        lengths = torch.full((batch,), seq_len, dtype=torch.int64)
        counts = torch.full((batch,), per_doc, dtype=torch.int64)
    else:
        if batch != 1:
            raise ValueError(f"{op}: with cu_seqlens the batch dim must be 1 (packed documents), got {batch}")
        host_cu = check_cu_seqlens(op, cu_seqlens, seq_len)
        lengths = host_cu[1:] - host_cu[:-1]
        counts = -(-lengths // chunk_size)
    num_docs = lengths.numel()
    offsets = torch.zeros(num_docs + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    num_chunks = int(offsets[-1])
    doc = torch.repeat_interleave(torch.arange(num_docs), counts, output_size=num_chunks)
    start = host_cu[doc] + (torch.arange(num_chunks) - offsets[doc]) * chunk_size
    end = torch.minimum(start + chunk_size, host_cu[doc + 1])

    def dev(t):
        return t.to(torch.int32).to(device)

    return DocChunks(dev(host_cu), dev(start), dev(end), dev(doc), dev(offsets), num_docs, num_chunks)
