"""ColumnParallelLinear and RowParallelLinear: Megatron-style TP linears with sequence parallel.

Activations are ``[batch, seq, hidden]`` or ``[seq, hidden]``; the sequence dim is dim -2 (dim 1
for ``[b, s, h]``). Under ``sequence_parallel`` the activations between TP regions hold this
rank's ``s/P`` rows: the column layer all-gathers its input along the sequence, the row layer
reduce-scatters its output along it. Without it, the column layer takes the replicated input
(identity forward, all-reduce of the input gradient) and the row layer all-reduces its output.

Weights are DTensors on the 1-D TP mesh, ``Shard(0)`` for column (weight [out, in]) and
``Shard(1)`` for row, so FSDP2 ``fully_shard`` on a dp mesh composes on top (2-D), clip-grad sees
the whole norm and DCP checkpoints save the full logical tensor. The forward multiplies the local
shards (``to_local()``) in one dispatcher op per layer (``xorl.nn.tp_linear_ops``, math in
``xorl.nn.tp_matmul``), which decompose the gather / scatter into TP chunks so each chunk's
transfer hides behind the previous chunk's GEMM (``overlap=True``, above ``overlap_min_numel``
gathered elements). Gradients land on the DTensor parameters (local shard grads wrapped with
the parameter's placements).

Row bias is replicated (added once, after the reduction); under sequence parallel its gradient is
summed over the TP ranks in backward (each rank sees only its own tokens).

``SharedInputColumnGroup`` lets several column layers that read the same input (q/k/v, gate/up)
gather it once: the first member called computes every member's output in one fused call.

LoRA adapters (``lora=LoRASpec``, xorl/nn/lora.py), split to match the base, so each rank computes
exactly its part of one process's ``scaling * x A^T B^T`` and only rank-wide (r-column) tensors travel:

* column (W [out, in] split by output rows): B [out, r] split by rows the same way (``Shard(0)``),
  A [r, in] replicated. Every rank forms the same ``x A^T`` [s, r] (under SP: from its sequence
  shard, all-gathered along the sequence, whose backward reduce-scatters the summed gradient;
  without SP: the replicated input, whose backward all-reduces), then its own output columns
  ``(x A^T) B_r^T``: the rows of B it holds are the output columns its base shard computes, so the
  sum ``x W_r^T + s (x A^T) B_r^T`` is one process's output, column block r. Under SP each rank's A
  gradient covers its own tokens: A is listed as a partial gradient (summed over TP per step).
* row (W split by input columns, partial outputs summed over TP): A [r, in] split by columns the
  same way (``Shard(1)``), B [out, r] replicated. ``x A^T = sum_r x_r A_r^T`` is a sum over input
  column blocks, exactly as the base's ``x W^T`` is, so the rank-r partials are summed over TP
  (all-reduce; under SP reduce-scatter to the sequence shard, r columns instead of out) and B is
  applied once after the sum. By linearity this equals summing the partial ``x_r A_r^T B^T`` the
  way the base's partials are summed, only cheaper. Under SP B's gradient covers this rank's tokens
  (a partial gradient).
Dropout on the adapter's input: column layers under SP and row layers drop their own elements; a
column layer without SP would drop the replicated input differently on each rank, so the config
refuses LoRA dropout with TP > 1 and sequence_parallel off (xorl/config/validate.py).

The vocabulary-split and whole embedding / lm_head are xorl/nn/tp_vocab.py; the parameters TP does
not shard (norms, ...) xorl/nn/tp_replicated.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from xorl.nn.linear import check_fp8
from xorl.nn.lora import adapter_bounds, adapter_input, make_adapters
from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL, TPGroup
from xorl.nn.tp_linear_ops import column_parallel_linear, row_parallel_linear, with_compiled_twin
from xorl.nn.tp_matmul import TPMatmulConfig
from xorl.nn.tp_regions import (
    copy_to_region,
    gather_from_shards,
    gather_summing_grads,
    split_to_shard,
    sum_partials,
    sum_partials_to_shard,
)


def check_tp_divisible(value: int, tp: TPGroup, arg: str, layer: str) -> int:
    if value % tp.size:
        raise ValueError(
            f"{layer}: {arg}={value} is not divisible by the TP mesh size {tp.size}; "
            f"choose tensor_parallel_size dividing {arg}"
        )
    return value // tp.size


def _check_plain_input(x, layer: str) -> None:
    if isinstance(x, DTensor):
        raise TypeError(f"{layer} takes a plain (local) torch.Tensor, got a DTensor; pass x.to_local()")
    if x.dim() < 2:
        raise ValueError(f"{layer} expects [batch, seq, hidden] or [seq, hidden], got shape {tuple(x.shape)}")


def dtensor_parameter(local: torch.Tensor, mesh, placement, requires_grad: bool = True) -> nn.Parameter:
    return nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False),
                        requires_grad=requires_grad)


def _linear_init_(full_weight: torch.Tensor, full_bias: torch.Tensor | None) -> None:
    """nn.Linear's default init on the full (unsharded) tensors."""
    nn.init.kaiming_uniform_(full_weight, a=math.sqrt(5))
    if full_bias is not None:
        bound = 1 / math.sqrt(full_weight.shape[1]) if full_weight.shape[1] > 0 else 0
        nn.init.uniform_(full_bias, -bound, bound)


class _TPLinearBase(nn.Module):
    weight_placement: Shard
    bias_placement: Shard | Replicate

    # Placements of the LoRA adapters (see the module docstring).
    lora_placements: dict

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_mesh, sequence_parallel: bool,
                 overlap: bool, overlap_min_numel: int, device, dtype, fp8: str = "none", name: str | None = None,
                 lora=None, adapter_dtype=None):
        super().__init__()
        self.tp_mesh = tp_mesh
        self.tp = TPGroup.from_mesh(tp_mesh)
        self.in_features, self.out_features = in_features, out_features
        self.config = with_compiled_twin(TPMatmulConfig(
            self.tp, bool(sequence_parallel), bool(overlap), int(overlap_min_numel),
            name=name or f"{type(self).__name__}@{id(self):x}", fp8=check_fp8(fp8)))
        local_w = torch.empty(self._local_weight_shape(), device=device, dtype=dtype)
        self.weight = dtensor_parameter(local_w, tp_mesh, self.weight_placement)
        if bias:
            local_b = torch.empty(self._local_bias_shape(), device=device, dtype=dtype)
            self.bias = dtensor_parameter(local_b, tp_mesh, self.bias_placement)
        else:
            self.register_parameter("bias", None)
        self.lora = lora  # xorl.nn.lora.LoRASpec or None
        if lora is not None:
            shapes = self._lora_local_shapes(lora.rank)
            # adapter_dtype: the adapters keep fp32 master weights when the frozen base is stored in bf16.
            self.lora_A, self.lora_B, self.lora_dropout = make_adapters(
                lora, shapes["lora_A"], shapes["lora_B"], device, adapter_dtype or dtype,
                wrap=lambda n, t: DTensor.from_local(t, tp_mesh, [self.lora_placements[n]], run_check=False))
            for param in (self.weight, self.bias):  # the base is frozen under LoRA
                if param is not None:
                    param.requires_grad_(False)
        if local_w.device.type != "meta":
            self.reset_parameters()

    # The full weight is [out_features, in_features]; subclasses say which dim is sharded.
    def _local_weight_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def _local_bias_shape(self) -> tuple[int]:
        raise NotImplementedError

    def _lora_local_shapes(self, rank: int) -> dict[str, tuple[int, int]]:
        full = {"lora_A": (rank, self.in_features), "lora_B": (self.out_features, rank)}
        shapes = {}
        for name, shape in full.items():
            placement = self.lora_placements[name]
            shape = list(shape)
            if isinstance(placement, Shard):
                shape[placement.dim] //= self.tp.size
            shapes[name] = tuple(shape)
        return shapes

    def lora_partial_grads(self) -> list[str]:
        """The adapter parameters whose per-rank gradient is a partial sum over TP (see the module
        docstring): under sequence parallel, the replicated one (each rank sees its own tokens)."""
        if self.lora is None or not self.sequence_parallel:
            return []
        return [n for n, p in self.lora_placements.items() if isinstance(p, Replicate)]

    @torch.no_grad()
    def load_full_lora_(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of the full adapter tensors {"lora_A": [r, in], "lora_B": [out, r]}."""
        for name, tensor in full.items():
            placement = self.lora_placements[name]
            if isinstance(placement, Shard):
                tensor = tensor.chunk(self.tp.size, placement.dim)[self.tp.rank]
            getattr(self, name).to_local().copy_(tensor)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's initialisation of the full adapter (xorl.nn.lora.adapter_bounds), then this rank's shard."""
        full = {}
        for name, bound in adapter_bounds(self.lora, self.in_features).items():
            local = getattr(self, name).to_local()
            shape = (self.lora.rank, self.in_features) if name == "lora_A" else (self.out_features, self.lora.rank)
            tensor = torch.zeros(shape, device=local.device, dtype=local.dtype)
            full[name] = tensor if bound is None else tensor.uniform_(-bound, bound)
        self.load_full_lora_(full)

    @property
    def name(self) -> str:
        """Key of this layer in ``xorl.nn.tp_comm.overlap_report()`` (the constructor's ``name``: the
        plan passes the module path)."""
        return self.config.name

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel

    @property
    def overlap(self) -> bool:
        return self.config.overlap

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's init of the full matrix, then this rank's shard of it.

        Every rank must be at the same RNG state (the same seed), as for any replicated init.
        """
        local_w = self.weight.to_local()
        full_w = torch.empty(self.out_features, self.in_features, device=local_w.device, dtype=local_w.dtype)
        full_b = None if self.bias is None else torch.empty(self.out_features, device=local_w.device,
                                                           dtype=local_w.dtype)
        _linear_init_(full_w, full_b)
        self.load_full_(full_w, full_b)
        if self.lora is not None:
            self.reset_lora_parameters()

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """normal(0, std) weight and zero bias, as the models' ``init_weights`` does for nn.Linear.

        The full matrix is drawn, then sharded, so a model built on the meta device, made tensor
        parallel and initialised gets the same values as the same model initialised in one process.
        """
        local_w = self.weight.to_local()
        full_w = torch.empty(self.out_features, self.in_features, device=local_w.device, dtype=local_w.dtype)
        torch.nn.init.normal_(full_w, mean=0.0, std=std)
        full_b = None if self.bias is None else torch.zeros(self.out_features, device=local_w.device,
                                                            dtype=local_w.dtype)
        self.load_full_(full_w, full_b)

    @torch.no_grad()
    def load_full_(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of the full (unsharded) weight / bias into the parameters."""
        if tuple(full_weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"{type(self).__name__}.load_full_: full_weight has shape {tuple(full_weight.shape)}, "
                f"expected {(self.out_features, self.in_features)}"
            )
        dim = self.weight_placement.dim
        self.weight.to_local().copy_(full_weight.chunk(self.tp.size, dim)[self.tp.rank])
        if self.bias is not None:
            if full_bias is None:
                raise ValueError(f"{type(self).__name__}.load_full_: the layer has a bias; pass full_bias")
            local_b = self.bias.to_local()
            if isinstance(self.bias_placement, Shard):
                local_b.copy_(full_bias.chunk(self.tp.size, 0)[self.tp.rank])
            else:
                local_b.copy_(full_bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_mesh, **kwargs):
        """Shard an existing nn.Linear (same values on every rank) into a TP layer.

        On the meta device nothing is copied (materialise and load afterwards, as usual).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear expects an nn.Linear, got {type(linear).__name__}")
        device = linear.weight.device
        # An xorl.nn.Linear's FP8 recipe (fixed when the model was built) carries over to the TP layer.
        kwargs.setdefault("fp8", getattr(linear, "fp8", "none"))
        kwargs.setdefault("lora", getattr(linear, "lora", None))  # and its LoRA adapter, split to match
        if kwargs["lora"] is not None:
            kwargs.setdefault("adapter_dtype", linear.lora_A.dtype)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, tp_mesh=tp_mesh,
                    device="meta" if device.type == "meta" else device, dtype=linear.weight.dtype, **kwargs)
        if device.type != "meta":
            layer.load_full_(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
            if layer.lora is not None:
                layer.load_full_lora_({n: getattr(linear, n).detach() for n in ("lora_A", "lora_B")})
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:  # a frozen bias (a LoRA run's base) stays frozen
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp.size}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap}")


class ColumnParallelLinear(_TPLinearBase):
    """y = x @ W^T + b with W [out, in] sharded on out (Shard(0)); output features are local.

    Input: ``[..., s/P, in]`` under sequence parallel, else the replicated ``[..., s, in]``.
    Output: ``[..., s, out/P]`` (full sequence), or ``[..., s, out]`` with ``gather_output=True``.
    """

    weight_placement = Shard(0)
    bias_placement = Shard(0)
    lora_placements = {"lora_A": Replicate(), "lora_B": Shard(0)}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_mesh=None,
                 sequence_parallel: bool = False, overlap: bool = True, gather_output: bool = False, *,
                 overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL, device=None, dtype=None, fp8: str = "none",
                 name: str | None = None, lora=None, adapter_dtype=None):
        tp = TPGroup.from_mesh(tp_mesh)
        check_tp_divisible(out_features, tp, "out_features", "ColumnParallelLinear")
        super().__init__(in_features, out_features, bias, tp_mesh, sequence_parallel, overlap,
                         overlap_min_numel, device, dtype, fp8, name, lora, adapter_dtype)
        self.gather_output = bool(gather_output)
        self.shared_group: SharedInputColumnGroup | None = None

    def _local_weight_shape(self):
        return (self.out_features // self.tp.size, self.in_features)

    def _local_bias_shape(self):
        return (self.out_features // self.tp.size,)

    def share_input_with(self, group: SharedInputColumnGroup) -> None:
        """Compute through ``group`` (which gathers the shared input once for all its members)."""
        if self.shared_group is not None and self.shared_group is not group:
            raise ValueError(f"{self.name}: already computes through SharedInputColumnGroup "
                             f"{self.shared_group.config.name!r}")
        self.shared_group = group

    def local_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The local weight / bias shards as plain tensors (differentiable back to the DTensors)."""
        return self.weight.to_local(), None if self.bias is None else self.bias.to_local()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_plain_input(x, "ColumnParallelLinear")
        if self.shared_group is not None:
            y = self.shared_group.output_for(self, x)
        else:
            (y,) = column_parallel_linear(self.config, x, *([p] for p in self.local_params()))
        if self.lora is not None:
            y = y + self._lora_delta(x)
        if self.gather_output:
            y = gather_from_shards(y, self.tp, -1)
        return y

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * (x A^T) B_r^T: this rank's output columns of the adapter (module docstring)."""
        xa = F.linear(adapter_input(self, x), self.lora_A.to_local())
        xa = gather_summing_grads(xa, self.tp, -2) if self.sequence_parallel else copy_to_region(xa, self.tp)
        return F.linear(xa, self.lora_B.to_local()) * self.lora.scaling

    def extra_repr(self) -> str:
        return super().extra_repr() + (", gather_output=True" if self.gather_output else "")


class RowParallelLinear(_TPLinearBase):
    """y = x @ W^T + b with W [out, in] sharded on in (Shard(1)); the partial sums are reduced.

    Input: ``[..., s, in/P]`` (``input_is_parallel=True``) or the replicated ``[..., s, in]``.
    Output: ``[..., s/P, out]`` under sequence parallel (reduce-scatter), else ``[..., s, out]``.
    """

    weight_placement = Shard(1)
    bias_placement = Replicate()
    lora_placements = {"lora_A": Shard(1), "lora_B": Replicate()}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_mesh=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, overlap: bool = True, *,
                 overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL, device=None, dtype=None, fp8: str = "none",
                 name: str | None = None, lora=None, adapter_dtype=None):
        tp = TPGroup.from_mesh(tp_mesh)
        check_tp_divisible(in_features, tp, "in_features", "RowParallelLinear")
        super().__init__(in_features, out_features, bias, tp_mesh, sequence_parallel, overlap,
                         overlap_min_numel, device, dtype, fp8, name, lora, adapter_dtype)
        self.input_is_parallel = bool(input_is_parallel)

    def _local_weight_shape(self):
        return (self.out_features, self.in_features // self.tp.size)

    def _local_bias_shape(self):
        return (self.out_features,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_plain_input(x, "RowParallelLinear")
        if not self.input_is_parallel:
            x = split_to_shard(x, self.tp, -1)
        expected = self.in_features // self.tp.size
        if x.shape[-1] != expected:
            raise ValueError(
                f"RowParallelLinear: input has {x.shape[-1]} features, expected the local shard {expected} "
                f"(in_features={self.in_features} / tp={self.tp.size}); pass input_is_parallel=False for a "
                "replicated full input"
            )
        weight = self.weight.to_local()
        bias = None if self.bias is None else self.bias.to_local()
        y = row_parallel_linear(self.config, x, weight, bias)
        if self.lora is None:
            return y
        # sum_r x_r A_r^T over TP (to the sequence shard under SP), then B once (module docstring).
        xa = F.linear(adapter_input(self, x), self.lora_A.to_local())
        xa = sum_partials_to_shard(xa, self.tp, -2) if self.sequence_parallel else sum_partials(xa, self.tp)
        return y + F.linear(xa, self.lora_B.to_local()) * self.lora.scaling

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.input_is_parallel else ", input_is_parallel=False")


class SharedInputColumnGroup:
    """Column layers that read the same input tensor (q/k/v, gate/up): gather it once for all.

    The first member called with an input computes every member's output in one fused
    ``xorl::tp_column_linear`` op (one ring all-gather forward, one re-gather and one reduce-scatter
    backward, instead of one per member) and keeps the others' outputs until they are asked for
    with the same tensor object. A member called with a different tensor recomputes (correct,
    only slower), so code that passes copies still works.
    """

    def __init__(self, members: list[ColumnParallelLinear], name: str):
        if len(members) < 2:
            raise ValueError(f"SharedInputColumnGroup {name!r} needs at least 2 members, got {len(members)}")
        first = members[0]
        for m in members:
            if not isinstance(m, ColumnParallelLinear):
                raise TypeError(f"SharedInputColumnGroup {name!r}: {type(m).__name__} is not a ColumnParallelLinear")
            if m.tp.group is not first.tp.group or m.config.sequence_parallel != first.config.sequence_parallel \
                    or m.config.overlap != first.config.overlap or m.in_features != first.in_features \
                    or m.config.fp8 != first.config.fp8:
                raise ValueError(
                    f"SharedInputColumnGroup {name!r}: members must share TP group, sequence_parallel, overlap, "
                    "fp8 and in_features"
                )
            if m.shared_group is not None:
                raise ValueError(f"SharedInputColumnGroup {name!r}: a member already belongs to a group")
        self.members = list(members)
        self.config = with_compiled_twin(TPMatmulConfig(first.tp, first.config.sequence_parallel, first.config.overlap,
                                                        first.config.overlap_min_numel, name=name,
                                                        fp8=first.config.fp8))
        self._input: torch.Tensor | None = None
        self._ready: dict[int, torch.Tensor] = {}
        for m in members:
            m.share_input_with(self)

    def output_for(self, member: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        index = next(i for i, m in enumerate(self.members) if m is member)
        if self._input is x and index in self._ready:
            out = self._ready.pop(index)
            if not self._ready:
                self._input = None
            return out
        weights, biases = zip(*(m.local_params() for m in self.members))
        outs = column_parallel_linear(self.config, x, weights, biases)
        self._ready = {i: o for i, o in enumerate(outs) if i != index}
        self._input = x
        return outs[index]

    def clear(self) -> None:
        """Drop outputs kept for members that were not called (frees their memory)."""
        self._input, self._ready = None, {}
