"""Hugging Face checkpoint names and layouts <-> xorl's: what each xorl tensor is made of when a
folder is read (the recipes, ``_plan``) and which HF tensors it becomes when one is written
(``hf_pieces``). Reading is xorl/models/hf_reader.py, writing xorl/models/hf_writer.py.

Name / layout conversions (everything else keeps its name):
- MoE experts: HF files hold one Linear per expert, ``...mlp.experts.{j}.{gate,up,down}_proj.weight``
  [out, in]; xorl holds them stacked as ``...mlp.experts.gate_up_proj`` [E, H, 2I] (each expert's
  gate columns, then its up columns) and ``...mlp.experts.down_proj`` [E, I, H] ([E, in, out]).
  transformers v5's in-memory fused layout (``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I]) is also accepted when loading.
- merge_qkv: xorl's ``self_attn.qkv_proj`` rows are grouped by KV head (per group: its query heads,
  its key head, its value head; xorl/models/attention.py); HF files always hold ``q_proj`` /
  ``k_proj`` / ``v_proj``.
- merge_gate_up: the dense MLP's ``mlp.gate_up_proj`` rows alternate gate and up units (row 2i
  gate i, row 2i + 1 up i; xorl/models/layers.py); HF files hold ``gate_proj`` / ``up_proj``.
- tie_word_embeddings: ``lm_head.weight`` is not written (as in HF) and ignored when loading.
- gpt-oss (``Family.experts_interleaved``): HF files hold the experts stacked [E, in, out] with gate
  and up columns interleaved, with per-expert biases, in bf16 or MXFP4 blocks and scales
  (xorl/models/mxfp4.py reads them box by box, dequantising only the boxes a rank holds); export
  writes the dense interleaved layout.
- Block-quantised FP8 folders (DeepSeek-V3's release: ``X.weight`` float8 with ``X.weight_scale_inv``)
  are read dequantised, box by box (xorl/models/fp8_blocks.py); the scales are not sources of their own.
- A family's own spelling (``Family.weight_names``: Mixtral's ``block_sparse_moe.experts.{j}.w1``,
  GLM's ``mlp.shared_experts``) is applied last when writing and first when reading
  (``FileNames``); everything above works on the common names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch

from xorl.distributed.shard_box import ShardBox
from xorl.models.spec import ModelSpec

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_STACKED_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp)\.gate_up_proj\.(?P<kind>weight|bias)$")
_QKV = re.compile(r"^(?P<prefix>.*\.self_attn)\.qkv_proj\.(?P<kind>weight|bias)$")


class FileNames:
    """A family's HF file names <-> the common names (Qwen / Llama spelling) the recipes use."""

    def __init__(self, spec: ModelSpec | None):
        family = spec.family if spec is not None else None
        pairs = family.weight_names if family is not None else ()
        self.ignore_layers_from = spec.num_hidden_layers if family is not None and family.ignore_extra_layers else None

        def rule(src: str, dst: str):
            pattern = re.compile(r"\." + re.escape(src).replace(re.escape("{j}"), r"(\d+)"))
            return pattern, "." + dst.replace("{j}", r"\1")

        self.to_file = [rule(a, b) for a, b in pairs]
        self.from_file = [rule(b, a) for a, b in pairs]

    @staticmethod
    def _apply(rules, name: str) -> str:
        for pattern, repl in rules:
            name, count = pattern.subn(repl, name, count=1)
            if count:
                break
        return name

    def file_name(self, name: str) -> str:
        return self._apply(self.to_file, name)

    def common_name(self, name: str) -> str:
        return self._apply(self.from_file, name)

    def ignored(self, name: str) -> bool:
        """Layers past num_hidden_layers that the family's files hold but the model never builds."""
        if self.ignore_layers_from is None or not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) >= self.ignore_layers_from



class BoxReader(Protocol):
    """What a recipe reads from (xorl/models/hf_reader.py's ``_SliceReader``): a box of a checkpoint
    tensor by its common name, and the tensor's global shape."""

    def __call__(self, key: str, index: tuple[slice, ...]) -> torch.Tensor: ...

    def shape(self, key: str) -> tuple[int, ...]: ...


# -- reading: the recipes --------------------------------------------------------------------------
#
# Each rank reads only the box of each checkpoint tensor that its own shards need (safetensors'
# lazy ``get_slice``), converted to xorl's layout on the way: a rank never holds a full copy of
# the model, and at most one expert's or one projection's box of it beyond its own shards.


class _Recipe:
    """How one xorl tensor is made from checkpoint tensors: its global shape, and any box of it."""

    def __init__(self, sources: list[str]):
        self.sources = sources

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        raise NotImplementedError

    def fill(self, read: BoxReader, dest: torch.Tensor, box: ShardBox) -> None:
        raise NotImplementedError


class _Identity(_Recipe):
    def shape(self, shapes):
        return shapes[self.sources[0]]

    def fill(self, read, dest, box):
        dest.copy_(read(self.sources[0], box.slices))


class _GroupedQKV(_Recipe):
    """merge_qkv: ``qkv_proj`` rows in KV-head groups [q heads of group g; k_g; v_g] from HF's q/k/v.
    A box (a TP rank's whole groups, an FSDP row range) reads only the head rows it covers."""

    def __init__(self, sources: list[str], q_per_group: int, head_dim: int):
        super().__init__(sources)
        self.q_per_group, self.head_dim = q_per_group, head_dim

    def shape(self, shapes):
        parts = [shapes[s] for s in self.sources]
        return (sum(p[0] for p in parts), *parts[0][1:])

    def _source_row(self, segment: int) -> tuple[str, int]:
        """The HF tensor and first row of the ``segment``-th head (head_dim rows) of qkv_proj."""
        group, i = divmod(segment, self.q_per_group + 2)
        if i < self.q_per_group:
            return self.sources[0], (group * self.q_per_group + i) * self.head_dim
        return self.sources[1 if i == self.q_per_group else 2], group * self.head_dim

    def fill(self, read, dest, box):
        first, last = box.offset[0], box.offset[0] + box.shape[0]
        hd = self.head_dim
        for segment in range(first // hd, (last - 1) // hd + 1):
            lo, hi = max(first, segment * hd), min(last, (segment + 1) * hd)
            source, row = self._source_row(segment)
            start = row + lo - segment * hd
            dest[lo - first:hi - first].copy_(read(source, (slice(start, start + hi - lo), *box.slices[1:])))


class _InterleavedRows(_Recipe):
    """merge_gate_up: ``gate_up_proj`` rows [g_0, u_0, g_1, u_1, ...] from HF's gate and up; a box
    reads only the gate and up rows it covers."""

    def shape(self, shapes):
        gate = shapes[self.sources[0]]
        return (2 * gate[0], *gate[1:])

    def fill(self, read, dest, box):
        first, last = box.offset[0], box.offset[0] + box.shape[0]
        rest = box.slices[1:]
        for source, parity in zip(self.sources, (0, 1)):  # rows 2i + parity hold unit i of the source
            lo, hi = (first - parity + 1) // 2, (last - parity + 1) // 2
            if lo < hi:
                dest[2 * lo + parity - first::2].copy_(read(source, (slice(lo, hi), *rest)))


class _StackTransposed(_Recipe):
    """Per-expert HF Linears [out, in] -> stacked [E, in, out]; a box reads only its experts."""

    def shape(self, shapes):
        out_features, in_features = shapes[self.sources[0]]
        return (len(self.sources), in_features, out_features)

    def fill(self, read, dest, box):
        experts, rows, cols = box.slices
        for j in range(experts.start, experts.stop):
            dest[j - experts.start].copy_(read(self.sources[j], (cols, rows)).t())


class _StackGateUp(_Recipe):
    """Per-expert HF gate and up Linears [I, H] -> stacked ``gate_up_proj`` [E, H, 2I]; a box reads
    only its experts, and of each only the gate and / or up columns it covers."""

    def __init__(self, gates: list[str], ups: list[str]):
        super().__init__([*gates, *ups])
        self.gates, self.ups = gates, ups

    def shape(self, shapes):
        inter, hidden = shapes[self.gates[0]]
        return (len(self.gates), hidden, 2 * inter)

    def fill(self, read, dest, box):
        experts, rows, cols = box.slices
        inter = read.shape(self.gates[0])[0]
        for j in range(experts.start, experts.stop):
            for sources, shift in ((self.gates, 0), (self.ups, inter)):
                lo, hi = max(cols.start, shift), min(cols.stop, shift + inter)
                if lo < hi:
                    part = read(sources[j], (slice(lo - shift, hi - shift), rows)).t()
                    dest[j - experts.start, :, lo - cols.start:hi - cols.start].copy_(part)


class _Transposed12(_Recipe):
    """transformers v5 ``down_proj`` [E, H, I] -> [E, I, H], ``gate_up_proj`` [E, 2I, H] -> [E, H, 2I]."""

    def shape(self, shapes):
        experts, hidden, inter = shapes[self.sources[0]]
        return (experts, inter, hidden)

    def fill(self, read, dest, box):
        experts, inter, hidden = box.slices
        dest.copy_(read(self.sources[0], (experts, hidden, inter)).transpose(1, 2))


def _per_expert(prefix: str, proj: str, sources: set[str], count: int = 0) -> list[str]:
    """``{prefix}.{j}.{proj}.weight`` for j up to the highest index present (at least ``count``):
    listing every index makes a gap show up as a missing key."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.{proj}\.weight$")
    top = max((int(m[1]) for s in sources if (m := pattern.match(s))), default=0)
    return [f"{prefix}.{j}.{proj}.weight" for j in range(max(top + 1, count))]


def _plan(targets: list[str], sources: set[str], tied: bool, spec: ModelSpec | None = None) -> dict[str, _Recipe]:
    """One recipe per target name, decided from the names alone (before reading any data); ``spec``
    gives merge_qkv's head grouping."""
    from xorl.models import mxfp4

    interleaved = spec is not None and spec.family.experts_interleaved
    recipes: dict[str, _Recipe] = {}
    for name in targets:
        if interleaved and (gpt_oss := mxfp4.EXPERT_TENSOR.match(name)):
            recipes[name] = mxfp4.ExpertRecipe(gpt_oss["prefix"], gpt_oss["proj"], bool(gpt_oss["bias"]), sources)
            continue
        qkv = _QKV.match(name)
        expert = _STACKED_EXPERT.match(name)
        gate_up = _GATE_UP.match(name)
        if tied and name == "lm_head.weight":  # HF files do not hold a tied head: it is the embedding
            recipes[name] = _Identity(["model.embed_tokens.weight"])
        elif qkv:
            p, kind = qkv["prefix"], qkv["kind"]
            if spec is None:
                raise ValueError(f"{name}: loading a merged qkv_proj needs the model's spec (its head counts)")
            recipes[name] = _GroupedQKV([f"{p}.{x}_proj.{kind}" for x in "qkv"],
                                        spec.num_attention_heads // spec.num_key_value_heads, spec.head_dim)
        elif gate_up:
            p, kind = gate_up["prefix"], gate_up["kind"]
            recipes[name] = _InterleavedRows([f"{p}.gate_proj.{kind}", f"{p}.up_proj.{kind}"])
        elif expert and f"{expert['prefix']}.gate_up_proj" in sources:  # transformers v5 fused layout
            recipes[name] = _Transposed12([f"{expert['prefix']}.{expert['proj']}"])
        elif expert and f"{expert['prefix']}.0.down_proj.weight" in sources:  # per-expert Linears
            p = expert["prefix"]
            if expert["proj"] == "down_proj":
                recipes[name] = _StackTransposed(_per_expert(p, "down_proj", sources))
            else:
                n = max(len(_per_expert(p, "gate_proj", sources)), len(_per_expert(p, "up_proj", sources)))
                recipes[name] = _StackGateUp(_per_expert(p, "gate_proj", sources, n),
                                             _per_expert(p, "up_proj", sources, n))
        else:
            recipes[name] = _Identity([name])
    return recipes



# -- writing: the pieces ---------------------------------------------------------------------------

def hf_pieces(name: str, shape: tuple[int, ...], spec: ModelSpec) -> list[tuple[str, Callable]]:
    """The HF tensors that xorl tensor ``name`` (of global ``shape``) becomes: (HF name, function
    from the xorl tensor to that HF tensor, a view). Empty for a tied lm_head. Decided from the
    name and shape alone, so an export can plan its files before reading any data."""
    names = FileNames(spec)
    return [(names.file_name(hf_name), take) for hf_name, take in _common_pieces(name, shape, spec)]


def _common_pieces(name: str, shape: tuple[int, ...], spec: ModelSpec) -> list[tuple[str, Callable]]:
    from xorl.nn.lora import is_adapter_name

    # A LoRA adapter is not part of the base model's folder (xorl/checkpoint/peft_adapter.py writes it in peft's
    # format; an export merges it into the base weight, xorl/checkpoint/hf_export.py).
    if (spec.tie_word_embeddings and name == "lm_head.weight") or is_adapter_name(name):
        return []
    if spec.family.experts_interleaved:
        from xorl.models.mxfp4 import EXPERT_TENSOR, interleave_gate_up

        if (gpt_oss := EXPERT_TENSOR.match(name)) and gpt_oss["proj"] == "gate_up_proj":
            return [(name, interleave_gate_up)]
        if gpt_oss:
            return [(name, lambda t: t)]
    qkv = _QKV.match(name)
    expert = _STACKED_EXPERT.match(name)
    gate_up = _GATE_UP.match(name)
    if gate_up:  # rows alternate gate and up
        return [(f"{gate_up['prefix']}.{x}_proj.{gate_up['kind']}", lambda t, s=s: t[s::2])
                for x, s in (("gate", 0), ("up", 1))]
    if qkv:
        groups, hd = spec.num_key_value_heads, spec.head_dim
        per = spec.num_attention_heads // groups  # query heads per KV group
        if shape[0] != groups * (per + 2) * hd:
            raise ValueError(
                f"{name} has {shape[0]} rows, expected q+k+v = {groups * (per + 2) * hd}: "
                "save the full tensor (gather a tensor-parallel one with full_tensor())"
            )

        def part(t: torch.Tensor, heads: slice) -> torch.Tensor:  # KV-head groups -> HF's [heads * hd, ...]
            blocks = t.view(groups, per + 2, hd, *t.shape[1:])[:, heads]
            return blocks.reshape(-1, *t.shape[1:])

        parts = {"q": slice(0, per), "k": slice(per, per + 1), "v": slice(per + 1, per + 2)}
        return [(f"{qkv['prefix']}.{x}_proj.{qkv['kind']}", lambda t, s=s: part(t, s)) for x, s in parts.items()]
    if expert:
        if shape[0] != spec.num_experts:
            raise ValueError(
                f"{name} holds {shape[0]} experts, the model has {spec.num_experts}: gather the "
                "expert-parallel slices into full tensors before saving"
            )
        p = expert["prefix"]
        if expert["proj"] == "down_proj":
            return [(f"{p}.{j}.down_proj.weight", lambda t, j=j: t[j].t()) for j in range(shape[0])]
        inter = shape[2] // 2  # gate_up_proj [E, H, 2I]: gate columns, then up
        return [piece for j in range(shape[0]) for piece in (
            (f"{p}.{j}.gate_proj.weight", lambda t, j=j: t[j, :, :inter].t()),
            (f"{p}.{j}.up_proj.weight", lambda t, j=j: t[j, :, inter:].t()))]
    return [(name, lambda t: t)]
