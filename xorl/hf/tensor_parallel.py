"""``"xorl_colwise"`` / ``"xorl_rowwise"``: xorl's TP linears as styles in transformers' ``ParallelInterface``.

    tp_plan = xorl.hf.xorl_tp_plan(AutoConfig.from_pretrained(path))   # colwise / rowwise -> xorl's
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="xorl",
        distributed_config=DistributedConfig(tp_size=2, tp_plan=tp_plan))
    # or xorl.hf.distributed_config(path, tp=2), which checks the sizes first (xorl/hf/distributed.py)

transformers 5 applies a ``tp_plan`` by looking each rule's style up in ``ALL_PARALLEL_STYLES`` and
calling it on the module: ``shard_param`` wraps each parameter as a ``DTensor`` on the TP mesh before
the checkpoint is read (each rank then loads only its shard), ``install_forward`` makes the module
compute on its shards. Importing ``xorl.hf`` registers two styles there (xorl/hf/__init__.py):

- ``xorl_colwise``: the weight ``[out, in]`` and bias split by output rows (``Shard(0)``, as
  transformers' ``colwise``); the input is the replicated activation, the output this rank's output
  columns (a plain tensor, so the attention's ``view(..., -1, head_dim)`` sees its own heads). The
  layer runs xorl's ``column_parallel_linear`` (xorl/nn/tp_linear_ops.py, the math of
  ``xorl.nn.ColumnParallelLinear``): identity forward, and in backward the all-reduce of the input
  gradient started asynchronously and hidden behind the weight-gradient GEMM.
- ``xorl_rowwise``: the weight split by input columns (``Shard(1)``), the bias replicated and added
  once; xorl's ``row_parallel_linear``: the local GEMM, then the all-reduce of the partial sums.

Gradients land on the DTensor parameters (the local shard's gradient with the parameter's
placement), so transformers' FSDP2, clip-grad and checkpoint saving see whole tensors.

Where transformers has no hook: a style computes a module through ``install_forward``, whose contract
is to replace the module's ``forward`` (transformers' own styles do exactly that). Its pre / around /
post transforms can only reshape what goes into and out of the module's own ``nn.Linear.forward``,
which would multiply with torch's GEMM and synchronise the input gradient's all-reduce; xorl's op
computes the whole layer. So this file binds the instance's ``forward`` (``_bind``: the one place
xorl.hf does it for tensor parallelism), for the modules a plan names, never on a class.

Not here: sequence parallelism, where xorl's ring all-gather / reduce-scatter overlap lives. A stock
attention layer takes its view shape from its input (``hidden_states.shape[:-1]``), so a
sequence-sharded input to ``q_proj`` would be viewed with the wrong length; transformers has no hook
to tell the attention the gathered length (its own ``sequence_parallel`` style is "not wired up yet").
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL, TPGroup
from xorl.nn.tp_linear_ops import column_parallel_linear, row_parallel_linear, with_compiled_twin
from xorl.nn.tp_matmul import TPMatmulConfig

COLWISE, ROWWISE = "xorl_colwise", "xorl_rowwise"
# transformers' style -> xorl's, for the linears of a tp_plan (xorl/hf/distributed.py xorl_tp_plan).
XORL_STYLES = {"colwise": COLWISE, "rowwise": ROWWISE}


class XorlTPError(ValueError):
    """A tp_plan rule that xorl's TP linears cannot apply exactly."""


def _check_linear(module: nn.Module, mesh, split: str, fix: str) -> None:
    if not isinstance(module, nn.Linear):
        raise XorlTPError(f"xorl's TP styles shard nn.Linear layers; {type(module).__name__} is not one (use "
                          "transformers' own style for it)")
    size, width = mesh.size(), getattr(module, split)
    if width % size:
        raise XorlTPError(f"{type(module).__name__} with {split}={width} does not split over {size} TP ranks; {fix}")


def _local_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The activation as the plain tensor xorl's ops take: the replicated one (column), this rank's
    columns (row). transformers' styles hand plain tensors on (``use_local_output=True``); a DTensor's
    layout is not guessed."""
    if isinstance(x, DTensor):
        raise XorlTPError(f"{type(module).__name__} under xorl's TP style got a DTensor input ({x.placements}); "
                          "xorl's styles take the plain local tensors transformers' styles pass on (use_local_output)")
    return x


def _matmul_config(module: nn.Module, mesh, overlap: bool, overlap_min_numel: int) -> TPMatmulConfig:
    name = f"{type(module).__name__}@{id(module):x}"
    return with_compiled_twin(TPMatmulConfig(TPGroup.from_mesh(mesh), False, overlap, overlap_min_numel, name=name))


def _bind(module: nn.Module, forward) -> None:
    """The module computes through ``forward`` (the module docstring: why on the instance)."""
    if "forward" in module.__dict__:
        raise XorlTPError(f"{type(module).__name__} already has a forward of its own on the instance (another style "
                          "or a kernel patched it); a tp_plan names one style per module")
    module.forward = forward


def _column_forward(module: nn.Linear, config: TPMatmulConfig, x: torch.Tensor) -> torch.Tensor:
    bias = None if module.bias is None else module.bias.to_local()
    (y,) = column_parallel_linear(config, _local_input(module, x), [module.weight.to_local()], [bias])
    return y


def _row_forward(module: nn.Linear, config: TPMatmulConfig, x: torch.Tensor) -> torch.Tensor:
    bias = None if module.bias is None else module.bias.to_local()
    return row_parallel_linear(config, _local_input(module, x), module.weight.to_local(), bias)


class XorlColwiseParallel(ColwiseParallel):
    """``xorl_colwise`` (module docstring). ``shard_param`` is transformers' ``colwise`` one."""

    def __init__(self, overlap: bool = True, overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL):
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(-1))
        self.overlap, self.overlap_min_numel = overlap, overlap_min_numel

    def validate_param(self, module, param, mesh, parameter_name=None):
        _check_linear(module, mesh, "out_features", "choose a tp_size dividing it (attention heads, KV heads and "
                      "the MLP width), or transformers' 'colwise' style for this layer")

    def install_forward(self, module, mesh, *, config=None, mesh_manager=None):
        _check_linear(module, mesh, "out_features", "choose a tp_size dividing it")
        _bind(module, functools.partial(_column_forward, module,
                                        _matmul_config(module, mesh, self.overlap, self.overlap_min_numel)))
        return module


class XorlRowwiseParallel(RowwiseParallel):
    """``xorl_rowwise`` (module docstring). ``shard_param`` is transformers' ``rowwise`` one."""

    def __init__(self, overlap: bool = True, overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL):
        super().__init__(input_layouts=Shard(-1), output_layouts=Replicate())
        self.overlap, self.overlap_min_numel = overlap, overlap_min_numel

    def validate_param(self, module, param, mesh, parameter_name=None):
        _check_linear(module, mesh, "in_features", "choose a tp_size dividing it (attention heads and the MLP "
                      "width), or transformers' 'rowwise' style for this layer")

    def install_forward(self, module, mesh, *, config=None, mesh_manager=None):
        _check_linear(module, mesh, "in_features", "choose a tp_size dividing it")
        _bind(module, functools.partial(_row_forward, module,
                                        _matmul_config(module, mesh, self.overlap, self.overlap_min_numel)))
        return module
