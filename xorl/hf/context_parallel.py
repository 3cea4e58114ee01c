"""Context parallelism for a stock transformers model: zig-zag ring, Ulysses, or both, under any training loop.

    import xorl.hf
    cp = xorl.hf.ContextParallel.from_sizes(ring=2, ulysses=1)   # under torchrun (builds the mesh)
    handle = cp.apply(model)          # the model's attention becomes xorl's CP attention
    Trainer(model, args, data_collator=DataCollatorWithFlattening(), ...).train()   # as usual
    handle.remove()                   # the model as it was

The batch side is xorl's, not the user's. Every rank's data loader yields its own batch, as HF
Trainer, TRL and accelerate shard data over all ranks; the ranks of one context-parallel group then
train on the union of their batches as ONE packed sequence, each rank computing its zig-zag shard:

1. a forward pre-hook on the model (``model(**batch)``, whatever calls it) reads the rank's documents
   from its batch: packed rows (``position_ids`` that restart, or ``cu_seq_lens_q``), padded rows
   (``attention_mask``), or one document per row;
2. the CP group all-gathers them (token ids and labels: a few KB a step) into one sequence of
   documents in rank order, the labels shifted for next-token prediction BEFORE sharding (no shard
   boundary pairs a token with a wrong target), every document padded to the 2 x ring x Ulysses
   multiple with padding that is never a target (xorl/distributed/zigzag.py
   ``prepare_context_parallel_batch``);
3. the model is called on this rank's zig-zag shard (``input_ids``, true ``position_ids`` for RoPE,
   ``shift_labels``), and its attention layers run ``ContextParallelAttention`` (xorl/nn: Ulysses
   all-to-all around the zig-zag ring) over the GLOBAL document boundaries.

Every token is in exactly one shard, so the loss is right when it is normalised by the token count of
the whole step over every rank, which is what HF Trainer does (``num_items_in_batch``, counted before
the forward over every rank, and the loss times the world size that DDP / FSDP then averages away).
A plain loop does the same: ``loss = model(**batch, num_items_in_batch=n_global).loss * world_size``
(``count_label_tokens``). Data is neither repeated nor skipped; the gradients of one process's step.

Refused by name (never ignored): a KV cache / generation, a 4-D attention mask, heads that do not
divide over the Ulysses ranks, and what xorl's attention refuses anyway (dropout, soft-cap).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from xorl.distributed.zigzag import prepare_context_parallel_batch
from xorl.hf.attention import check_attention_call
from xorl.nn.ulysses_attention import ContextParallelAttention

_names = itertools.count()


def count_label_tokens(batch: dict, group=None) -> torch.Tensor:
    """The targets of a step's batch summed over ``group`` (None: every rank): the ``num_items_in_batch``
    HF Trainer computes (labels != -100 after the shift). One all-reduce of a device scalar."""
    labels = batch.get("shift_labels")
    labels = batch["labels"][..., 1:] if labels is None else labels
    count = (labels != -100).sum()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


@dataclass
class _Step:
    """What the pre-hook worked out for the current forward, read by the attention layers."""

    cu_seqlens: torch.Tensor  # the global (padded) document boundaries
    max_seqlen: int


class ContextParallel:
    """Zig-zag ring x Ulysses context parallelism of a stock transformers model (module docstring).

    ``state``: an ``xorl.distributed.ParallelState`` (its ``ring_group``, ``ulysses_group`` and
    ``cp_group``); ``from_sizes`` builds one over the default process group."""

    def __init__(self, state, pad_token_id: int = 0):
        self.state = state
        self.pad_token_id = pad_token_id
        self.name = f"xorl_cp_{next(_names)}"
        self._attention: dict[float | None, ContextParallelAttention] = {}
        self._step: _Step | None = None

    @classmethod
    def from_sizes(cls, ring: int = 1, ulysses: int = 1, **kwargs) -> ContextParallel:
        from xorl.distributed.parallel_config import ParallelConfig
        from xorl.distributed.parallel_state import init_parallel_state

        if not dist.is_initialized():
            raise RuntimeError("ContextParallel.from_sizes needs torch.distributed.init_process_group() first "
                               "(torchrun, or HF Trainer's TrainingArguments, which starts it)")
        config = ParallelConfig(ringattn_parallel_size=ring, ulysses_parallel_size=ulysses,
                                data_parallel_mode="ddp", world_size=dist.get_world_size())
        return cls(init_parallel_state(config), **kwargs)

    # -- set-up -----------------------------------------------------------------------------
    def apply(self, model: nn.Module) -> _Handle:
        """Run ``model``'s attention as CP attention and shard its batches (module docstring)."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

        config = model.config
        heads = getattr(config, "num_attention_heads", None)
        if heads is not None and heads % self.state.ulysses_size:
            raise ValueError(f"xorl.hf.ContextParallel: {heads} attention heads do not split over "
                             f"{self.state.ulysses_size} Ulysses ranks; choose a Ulysses size that divides them")
        previous = config._attn_implementation
        AttentionInterface.register(self.name, self._attention_forward)
        AttentionMaskInterface.register(self.name, flash_attention_mask)
        model.set_attn_implementation(self.name)
        hook = model.register_forward_pre_hook(self._shard_batch, with_kwargs=True)
        return _Handle(self, model, previous, hook)

    # -- per forward ------------------------------------------------------------------------
    def _shard_batch(self, model, args, kwargs):
        if args:
            kwargs = {**dict(zip(("input_ids", "attention_mask", "position_ids"), args)), **kwargs}
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ValueError("xorl.hf.ContextParallel: a KV cache (generation) under context parallelism is not "
                             "supported; call handle.remove() before generate()")
        input_ids = kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("xorl.hf.ContextParallel: the model must be called with input_ids (inputs_embeds "
                             "under context parallelism is not supported)")
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and mask.dim() != 2:
            raise ValueError("xorl.hf.ContextParallel: a 4-D (custom) attention mask cannot be honoured; pass a "
                             "padding mask, packed position_ids, or neither")
        labels = kwargs.pop("labels", None)
        kwargs.pop("shift_labels", None)
        position_ids = kwargs.pop("position_ids", None)
        cu = kwargs.pop("cu_seq_lens_q", None)
        for key in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(key, None)
        docs = _documents(input_ids, labels, mask, position_ids, cu)
        ids, targets, lengths = _gather(docs, self.state.cp_group, input_ids.device)
        cu_global = torch.tensor([0, *itertools.accumulate(lengths)])
        shard = prepare_context_parallel_batch(
            ids[None], targets[None], None, cu_global, ring=self.state.ring_group, ulysses=self.state.ulysses_group,
            pad_token_id=self.pad_token_id, shift_labels=True)
        self._step = _Step(shard.cu_seqlens.to(input_ids.device), int(shard.max_seqlen))
        kwargs.update(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
        if labels is not None:
            kwargs.update(labels=shard.labels, shift_labels=shard.labels)
        return (), kwargs

    def _attention_forward(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
        check_attention_call(module, dropout, softcap, kwargs)
        if self._step is None:
            raise RuntimeError("xorl.hf.ContextParallel: the attention ran without the model's pre-hook "
                               "(call the model itself, not its inner modules)")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            raise ValueError("xorl.hf.ContextParallel: non-causal attention under context parallelism is not "
                             "supported")
        attention = self._attention.get(scaling)
        if attention is None:
            attention = ContextParallelAttention(self.state.ring_group, self.state.ulysses_group,
                                                 softmax_scale=scaling)
            self._attention[scaling] = attention
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [1, local seq, heads, dim]
        out = attention(q, k, v, cu_seqlens=self._step.cu_seqlens, max_seqlen=self._step.max_seqlen,
                        sinks=s_aux, window=sliding_window)
        return out, None


class _Handle:
    """Undoes ``ContextParallel.apply``: the hook, the attention implementation, the registrations."""

    def __init__(self, cp: ContextParallel, model: nn.Module, previous: str, hook):
        self.cp, self.model, self.previous, self.hook = cp, model, previous, hook

    def remove(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.hook.remove()
        self.model.set_attn_implementation(self.previous)
        for interface in (AttentionInterface, AttentionMaskInterface):
            interface._global_mapping.pop(self.cp.name, None)


def _documents(input_ids, labels, mask, position_ids, cu) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's documents as (token ids, labels) pairs (labels in transformers' convention: label t
    is the target of the prediction made at t - 1; -100 ignored). One host read of the boundaries."""
    labels = input_ids if labels is None else labels
    rows, width = input_ids.shape
    flat_ids, flat_labels = input_ids.reshape(-1), labels.reshape(-1)
    if cu is not None:
        bounds = cu.tolist()
        return [(flat_ids[a:b], flat_labels[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if mask is not None:
        keep = mask.bool()
        return [(input_ids[r][keep[r]], labels[r][keep[r]]) for r in range(rows) if bool(keep[r].any())]
    if position_ids is not None:
        pos = position_ids.expand(rows, -1)
        starts = torch.diff(pos, prepend=pos[:, :1] - 1, dim=1) != 1
        starts[:, 0] = True
        where = starts.reshape(-1).nonzero().flatten().tolist() + [rows * width]
        return [(flat_ids[a:b], flat_labels[a:b]) for a, b in zip(where[:-1], where[1:])]
    return [(input_ids[r], labels[r]) for r in range(rows)]


def _gather(docs, group, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every CP rank's documents, in rank order: (token ids, labels, document lengths)."""
    ids = torch.cat([d for d, _ in docs]).to(device)
    labels = torch.cat([lab for _, lab in docs]).to(device)
    lengths = torch.tensor([len(d) for d, _ in docs], device=device, dtype=torch.long)
    size = dist.get_world_size(group)
    counts = torch.tensor([ids.numel(), lengths.numel()], device=device, dtype=torch.long)
    all_counts = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(all_counts, counts, group=group)
    tokens, ndocs = zip(*(c.tolist() for c in all_counts))  # the host read the shapes need

    def gather(t, n_max, sizes):
        padded = torch.zeros(n_max, dtype=t.dtype, device=device)
        padded[: t.numel()] = t
        out = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(out, padded, group=group)
        return torch.cat([o[:n] for o, n in zip(out, sizes)])

    all_ids = gather(ids, max(tokens), tokens)
    all_labels = gather(labels, max(tokens), tokens)
    all_lengths = gather(lengths, max(ndocs), ndocs).tolist()
    return all_ids, all_labels, all_lengths
