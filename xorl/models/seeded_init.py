"""Seeded initialisation that any rank can compute for its own shards alone.

The numbers of a parameter are a function of (seed, parameter name, global shape) only:
its rows are cut into fixed blocks (``BLOCK_ELEMENTS`` elements, decided by the shape), and
block b is drawn by a CPU generator seeded from a hash of (seed, name, b). So

- every layout (FSDP, TP, PP, EP and their mixes) starts from the numbers of one process, and a
  rank draws only the blocks its shard touches (a pipeline rank never draws another stage's
  parameters, an expert-parallel rank only its experts);
- peak host memory is this rank's shards plus one block, never a full parameter or the model.

Rules (as transformers' ``_init_weights`` for these models): RMSNorm weights 1, biases and
buffers 0, every other weight normal(0, initializer_range); LoRA adapters as peft draws them
(A uniform, B zero). A tied ``lm_head.weight`` takes the
numbers of ``model.embed_tokens.weight``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from xorl.distributed.shard_box import ShardBox, local_tensor, parameter_box
from xorl.models.param_names import clean_name
from xorl.nn.lora import ADAPTER_NAMES, adapter_bounds
from xorl.nn.rms_norm import RMSNorm

# 1 Mi elements (4 MiB in fp32) per block: small next to any shard of a large model, large enough
# that seeding a generator per block costs nothing measurable.
BLOCK_ELEMENTS = 1 << 20


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def block_rows(global_shape: tuple[int, ...]) -> int:
    row = int(torch.Size(global_shape[1:]).numel())
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _draw(shape, std: float, bound: float | None, gen: torch.Generator) -> torch.Tensor:
    if bound is not None:
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def fill_seeded_normal_(dest: torch.Tensor, box: ShardBox, seed: int, name: str, std: float,
                        bound: float | None = None) -> None:
    """Write the ``box`` of parameter ``name``'s seeded normal(0, std) numbers into ``dest``
    (``bound``: uniform(-bound, bound) instead, for LoRA adapters)."""
    if not box.global_shape:  # a scalar: one block
        gen = torch.Generator().manual_seed(block_seed(seed, name, 0))
        dest.copy_(_draw((), std, bound, gen))
        return
    if box.numel == 0:
        return
    rows = block_rows(box.global_shape)
    first, last = box.offset[0], box.offset[0] + box.shape[0]
    inner = box.slices[1:]
    for block in range(first // rows, (last + rows - 1) // rows):
        b0 = block * rows
        b1 = min(b0 + rows, box.global_shape[0])
        gen = torch.Generator().manual_seed(block_seed(seed, name, block))
        values = _draw((b1 - b0, *box.global_shape[1:]), std, bound, gen)
        lo, hi = max(first, b0), min(last, b1)
        dest[lo - first : hi - first].copy_(values[(slice(lo - b0, hi - b0), *inner)])


def init_rule(model: nn.Module, raw_name: str, is_buffer: bool) -> str | float:
    """"ones", "zeros" or "normal" for the tensor ``raw_name`` of ``model``; a float: uniform(-it, it)
    (LoRA adapters, peft's initialisation: xorl.nn.lora.adapter_bounds)."""
    module_name, _, leaf = raw_name.rpartition(".")
    owner = model.get_submodule(module_name) if module_name else model
    if leaf in ADAPTER_NAMES:
        bound = adapter_bounds(owner.lora, owner.in_features)[leaf]
        return "zeros" if bound is None else bound
    if is_buffer or leaf == "bias" or leaf.endswith("_bias"):  # gpt-oss experts: gate_up_proj_bias, down_proj_bias
        return "zeros"
    if isinstance(owner, RMSNorm):
        return "ones"
    return "normal"


def seed_name(name: str, tie_word_embeddings: bool) -> str:
    """Whose numbers a tensor takes: a tied lm_head the embedding's."""
    return "model.embed_tokens.weight" if tie_word_embeddings and name == "lm_head.weight" else name


@torch.no_grad()
def seeded_init_(model: nn.Module, seed: int, std: float, adapters_only: bool = False) -> None:
    """Initialise every parameter and buffer of ``model`` (plain, or sharded by any plan) in place.

    ``model`` must be materialised (``to_empty``); each rank writes only its own shards.
    ``adapters_only``: only the LoRA adapters (a base model loaded from a folder).
    """
    tied = bool(getattr(getattr(model, "spec", None), "tie_word_embeddings", False))
    tensors = [(n, t, False) for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [(n, t, True) for n, t in model.named_buffers(remove_duplicate=False)]
    for raw, tensor, is_buffer in tensors:
        if adapters_only and raw.rpartition(".")[2] not in ADAPTER_NAMES:
            continue
        dest = local_tensor(tensor)
        rule = init_rule(model, raw, is_buffer)
        if rule == "zeros":
            dest.zero_()
        elif rule == "ones":
            dest.fill_(1.0)
        else:
            fill_seeded_normal_(dest, parameter_box(model, raw, tensor), seed, seed_name(clean_name(raw), tied), std,
                                bound=None if rule == "normal" else rule)
