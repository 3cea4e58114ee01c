"""The model's two ends under TP: the embedding and the lm_head, split over the vocabulary
(``VocabParallelEmbedding``, ``VocabParallelLMHead``, when TP divides it) or held whole on every TP
rank (``ReplicatedEmbedding``, ``ReplicatedLMHead``). Under sequence parallel the SP region starts
at the embedding's output and ends at the lm_head's input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from xorl.nn.tp_comm import TPGroup
from xorl.nn.tp_linear import ColumnParallelLinear, check_tp_divisible, dtensor_parameter
from xorl.nn.tp_regions import gather_from_shards, split_to_shard, sum_partials, sum_partials_to_shard
from xorl.nn.tp_replicated import replicated_param


class VocabParallelLMHead(ColumnParallelLinear):
    """The lm_head as a column layer over the vocabulary: each TP rank computes ``vocab / P`` logits.

    Returns a DTensor sharded on its last dim (``Shard(-1)``) over the TP mesh, the local logits
    inside: ``xorl.nn.cross_entropy.cross_entropy_sum`` computes the loss from the shards without
    gathering them (loss parallel). Under sequence parallel its input is this rank's sequence
    shard, gathered as for any column layer.

    ``weight``: the ``VocabParallelEmbedding``'s weight when the lm_head is tied to it
    (tie_word_embeddings): both are [vocab, hidden] split by rows (``Shard(0)``), so the one parameter
    serves both, with one gradient and one optimizer state, as in one process.
    """

    def __init__(self, *args, weight: nn.Parameter | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if weight is not None:
            placed = isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)
            if not placed or tuple(weight.shape) != (self.out_features, self.in_features):
                raise ValueError(
                    f"VocabParallelLMHead: a tied weight must be the vocabulary-parallel embedding's "
                    f"[{self.out_features}, {self.in_features}] Shard(0) DTensor, got "
                    f"{type(weight).__name__} {tuple(weight.shape)}"
                )
            self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(super().forward(x), self.tp_mesh, [Shard(-1)], run_check=False)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows (the vocabulary) sharded over TP: a ``Shard(0)`` DTensor weight.

    Each rank looks the ids up in its ``vocab / P`` rows (ids outside them give zeros), and the
    partial embeddings are summed over TP: all-reduced, or under sequence parallel reduce-scattered
    along the sequence, so the output is this rank's sequence shard (the SP region starts here).
    A tied lm_head (``VocabParallelLMHead``, also ``Shard(0)`` on [vocab, hidden]) shares the weight.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_mesh, sequence_parallel: bool = False, *,
                 device=None, dtype=None):
        super().__init__()
        self.tp_mesh = tp_mesh
        self.tp = TPGroup.from_mesh(tp_mesh)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = bool(sequence_parallel)
        rows = check_tp_divisible(num_embeddings, self.tp, "num_embeddings (vocab_size)", "VocabParallelEmbedding")
        local = torch.empty(rows, embedding_dim, device=device, dtype=dtype)
        self.weight = dtensor_parameter(local, tp_mesh, Shard(0))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, tp_mesh, sequence_parallel: bool = False):
        weight = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, tp_mesh, sequence_parallel,
                    device="meta" if weight.device.type == "meta" else weight.device, dtype=weight.dtype)
        if weight.device.type != "meta":
            layer.load_full_(weight.detach())
        layer.weight.requires_grad_(weight.requires_grad)
        return layer

    @torch.no_grad()
    def load_full_(self, full_weight: torch.Tensor) -> None:
        self.weight.to_local().copy_(full_weight.chunk(self.tp.size, 0)[self.tp.rank])

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """normal(0, std) on the full matrix, then this rank's rows (same values as one process)."""
        local = self.weight.to_local()
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=local.device, dtype=local.dtype)
        self.load_full_(torch.nn.init.normal_(full, mean=0.0, std=std))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local()
        start = self.tp.rank * weight.shape[0]
        local_ids = input_ids - start
        outside = (local_ids < 0) | (local_ids >= weight.shape[0])
        partial = F.embedding(local_ids.masked_fill(outside, 0), weight) * (~outside).unsqueeze(-1).to(weight.dtype)
        if self.sequence_parallel:
            return sum_partials_to_shard(partial, self.tp, -2)
        return sum_partials(partial, self.tp)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}, "
                f"sequence_parallel={self.sequence_parallel}")


class ReplicatedEmbedding(nn.Embedding):
    """An embedding every TP rank holds whole (a vocabulary that does not divide by TP): a
    ``Replicate()`` DTensor weight. Under sequence parallel its output is this rank's sequence shard
    (the SP region starts here, as with ``VocabParallelEmbedding``)."""

    def __init__(self, embedding: nn.Embedding, tp_mesh, sequence_parallel: bool, memo: dict[int, nn.Parameter]):
        weight = embedding.weight
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, padding_idx=embedding.padding_idx,
                         device="meta", dtype=weight.dtype)
        self.tp = TPGroup.from_mesh(tp_mesh)
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = replicated_param(weight, tp_mesh, memo)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight.to_local(), self.padding_idx)
        return split_to_shard(out, self.tp, -2) if self.sequence_parallel else out


class ReplicatedLMHead(nn.Linear):
    """An lm_head every TP rank holds whole (a vocabulary that does not divide by TP). Under sequence
    parallel its input is this rank's sequence shard, gathered first (the SP region ends here)."""

    def __init__(self, linear: nn.Linear, tp_mesh, sequence_parallel: bool, memo: dict[int, nn.Parameter]):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                         dtype=linear.weight.dtype)
        self.tp = TPGroup.from_mesh(tp_mesh)
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = replicated_param(linear.weight, tp_mesh, memo)
        if linear.bias is not None:
            self.bias = replicated_param(linear.bias, tp_mesh, memo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_shards(x, self.tp, -2)
        return F.linear(x, self.weight.to_local(), None if self.bias is None else self.bias.to_local())
