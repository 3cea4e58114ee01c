"""xorl-plan's FP8 model (xorl/planner/fp8_time.py) held to the code it prices.

- the GEMMs it prices in FP8 per recipe are the modules a model built with that train.fp8 runs in FP8
  (their fp8 attributes, as the start-up line reads them), with the same shapes;
- the bytes and launches of each quantisation are those the fused Triton casts move (xorl_kernels/fp8/
  triton_quantize.py, run under the interpreter with every load, store and atomic counted as it runs,
  the torch ops around them by a TorchDispatchMode), per recipe, operand role (transposed ones read in
  place), dtype and shape;
- a large GEMM speeds up by the stated factor (FP8 peak ratio x the efficiency ratio), the casts eat
  more of it the smaller the GEMM, and small ones lose;
- fp8: none adds nothing (the published rows, tests/unit/planner/test_published_dense.py, hold as before).

Sanity, not asserted: the planner's rows of tests/unit/planner/test_published_dense.py with train.fp8 set (Grand Teton
flags), FP8 / bf16 tokens/s, against torchtitan's compiled bf16 -> compiled Float8 speed-ups
(benchmarks/llama3_h100_202412_torchtitan.md, asyncTP_llama3_h100_2025-06_torchtitan.md). Until the FP8
GEMMs became custom ops xorl refused fp8 with compile, so its FP8 run was eager against the compiled bf16
row ("before", with the fused casts; with the eager casts before them 0.59, 0.46, 0.38 tensorwise); now
both compile, as torchtitan's runs did (selective every-other also reruns k, o and up in FP8 now, where
the casts of every linear ran again before); and under TP + SP each column op now casts its input shard
once and gathers float8 (xorl/nn/tp_fp8.py), where each of q, k, v (gate, up) quantised the gathered
input again, every ring chunk re-cast the weight, and the gather moved bf16:
                                 torchtitan                       FP8 eager         both compiled     TP shard cast
                                                                  (tensor/row/block)
  8B FSDP 8 (selective every-other) 1.28x tensorwise              0.90/0.87/0.82    1.09/1.04/1.08    (no TP)
  70B FSDP 32 x TP 8 vanilla (full AC) 1.36x tensorwise, 1.00x row 0.94/0.91/0.95    1.01/0.98/1.03    1.24/1.19/1.19
  70B FSDP 32 x TP 8 async TP       1.44x tensorwise, 0.96x row                     0.96/0.93/0.99    1.15/1.10/1.11
  8B FSDP 8 x TP 8 (64 GPUs)        1.16x tensorwise, 0.85x row   0.81/0.79/0.84    0.90/0.88/0.94    1.08/1.05/1.08
  8B FSDP 8 x TP 8 async TP         1.16x tensorwise, 0.81x row                     0.85/0.83/0.90    1.02/0.99/1.02
(torchao's Float8ColwiseParallel, the cast before the gather, "currently assumes tensorwise scaling":
torchao/float8/float8_tensor_parallel.py; so torchtitan's rowwise rows are no target for xorl's.)
Beside the casts' bytes the model prices what xorl does differently from that run: the weights are
quantised again in backward, and
no cast is fused into a neighbouring element-wise op (torchao's compiled Float8 traces its casts and fuses
them; xorl's FP8 GEMMs are custom ops, so under train.compile too the casts stay these kernels, each paying
its own launch, and compile fuses the element-wise work around them: step_time's compiled branch).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.support.paths import REPO
from xorl.planner.fp8_time import (
    FP8_PEAK_RATIO,
    Fp8Gemm,
    Fp8Pricer,
    fp8_gemms,
    group_tiles_cost,
    quantize_cost,
    token_tiles_cost,
)

RECIPES = ("tensorwise", "rowwise", "blockwise")
_FACTORIES = {"new_zeros", "new_empty", "new_full", "new_ones", "empty_like", "zeros_like", "ones_like", "full_like",
              "empty", "zeros", "ones", "full"}


class _Traffic(TorchDispatchMode):
    """Every dispatched op's bytes: each tensor argument read once (a broadcast one: its storage), the
    outputs written; views and aliases move nothing; factories only write; in-place ops read and write."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        storages = {x.untyped_storage().data_ptr() for x in ins}
        mutable = func._schema.is_mutable
        if not mutable and outs and all(o.untyped_storage().data_ptr() in storages for o in outs):
            return out  # a view or alias
        name = func._schema.name.split("::")[-1]
        read = 0 if name in _FACTORIES else sum(min(x.numel() * x.element_size(), x.untyped_storage().nbytes())
                                                for x in ins)
        self.ops.append((name, read + sum(x.numel() * x.element_size() for x in outs)))
        return out


def traffic(fn) -> tuple[int, int, list]:
    mode = _Traffic()
    with mode:
        fn()
    return sum(b for _, b in mode.ops), len(mode.ops), mode.ops


# -- which GEMMs -----------------------------------------------------------------------------------
TINY_DENSE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
MODELS = {
    "llama": TINY_DENSE,
    "llama merged": {**TINY_DENSE, "merge_qkv": True, "merge_gate_up": True},
    "qwen2 bias": {**TINY_DENSE, "model_type": "qwen2"},
    "qwen3_moe": {**TINY_DENSE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "mlp_only_layers": [0]},
    "qwen2_moe shared": {**TINY_DENSE, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "deepseek_v3 latent": {**TINY_DENSE, "model_type": "deepseek_v3", "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                           "first_k_dense_replace": 1, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
                           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 24},
}


def _built_fp8_modules(model_fields: dict, recipe: str) -> dict[int, dict[str, tuple]]:
    """Per decoder layer: {module name: (out features, in features)} of what runs in FP8 in a model
    built with train.fp8 = recipe (the modules' own fp8 attributes: xorl/nn/linear.py, moe_experts.py)."""
    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.nn.linear import Linear
    from xorl.nn.moe_experts import GroupedExperts, experts_run_fp8

    with torch.device("meta"):
        model = build_model(ModelConfig(**model_fields), fp8=recipe)
    found = {}
    for name, module in model.named_modules():
        runs_fp8 = (isinstance(module, Linear) and module.fp8 != "none") or (
            isinstance(module, GroupedExperts) and experts_run_fp8(module.fp8))
        if not runs_fp8:
            assert getattr(module, "fp8", "none") == "none" or isinstance(module, GroupedExperts), name
            continue
        assert name.startswith("model.layers."), f"{name} runs FP8 outside the decoder layers"
        layer, rest = name[len("model.layers."):].split(".", 1)
        if isinstance(module, Linear):
            found.setdefault(int(layer), {})[rest] = (module.out_features, module.in_features)
        else:
            for w in ("gate_up_proj", "down_proj"):  # [experts, in, out]
                shape = getattr(module, w).shape
                found.setdefault(int(layer), {})[f"{rest}.{w}"] = (shape[2], shape[1])
    return found


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_fp8_gemms_are_the_modules_a_built_model_runs_in_fp8(model, recipe):
    from xorl.config import ModelConfig
    from xorl.models.spec import ModelSpec

    fields = MODELS[model]
    spec = ModelSpec.from_config(ModelConfig(**fields))
    built = _built_fp8_modules(fields, recipe)
    for layer in range(spec.num_hidden_layers):
        planned = {name: (n, g.k) for g in fp8_gemms(spec, spec.is_moe_layer(layer), recipe, 1, 1, 128)
                   for name, n, _ in g.modules}
        assert planned == built.get(layer, {}), (model, recipe, layer)
    if spec.is_moe:  # the experts only under blockwise; router and shared expert never
        moe_layer = next(i for i in range(spec.num_hidden_layers) if spec.is_moe_layer(i))
        assert any(".experts." in n for n in built[moe_layer]) == (recipe == "blockwise")


def test_no_fp8_no_gemms():
    from xorl.config import ModelConfig
    from xorl.models.spec import ModelSpec

    assert fp8_gemms(ModelSpec.from_config(ModelConfig(**TINY_DENSE)), False, "none", 1, 1, 128) == []
    assert _built_fp8_modules(TINY_DENSE, "none") == {}


# -- the casts' bytes ------------------------------------------------------------------------------
# On a GPU the casts are the Triton kernels of xorl_kernels/fp8/triton_quantize.py. Here they run under
# the interpreter (tests/conftest.py) with every cast routed to them, and their bytes are counted as
# they run: each element a kernel loads or stores (masked lanes move nothing), an atomic read and
# written; the torch ops around them (the amax's zero fill) by the dispatch trace, allocations moving
# nothing. Launches: the kernels' grids and the dispatched ops that run a kernel.
_EMPTY = {"empty", "empty_like", "new_empty", "empty_strided"}


class _KernelTraffic(_Traffic):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in _EMPTY:
            return func(*args, **(kwargs or {}))
        if func.namespace == "xorl":  # an FP8 GEMM op (xorl::fp8_linear ...): count what its kernel runs
            from torch._library.custom_ops import _maybe_get_opdef

            with self:  # its Python kernel, with this mode on again: its ops and the Triton casts inside
                return _maybe_get_opdef(func._schema.name)._init_fn(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def kernel_traffic(fn, monkeypatch) -> tuple[int, int, list]:
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter

    from xorl_kernels.dispatch import TRITON, triton_interpreting
    from xorl_kernels.fp8 import quantize

    if not triton_interpreting():  # a GPU machine runs the kernels compiled: nothing to trace
        pytest.skip("counts the kernels' loads and stores under the Triton interpreter (CPU)")
    mode = _KernelTraffic()
    builder, grid = interpreter.InterpreterBuilder, interpreter.GridExecutor
    load, store, atomic, launch = (builder.create_masked_load, builder.create_masked_store,
                                   builder.create_atomic_rmw, grid.__call__)

    def counted_load(self, ptrs, mask, *args):
        out = load(self, ptrs, mask, *args)
        mode.ops.append(("tl.load", int(mask.data.sum()) * out.data.itemsize))
        return out

    def counted_store(self, ptrs, value, mask, *args):
        mode.ops.append(("tl.store", int(mask.data.sum()) * value.data.itemsize))
        return store(self, ptrs, value, mask, *args)

    def counted_atomic(self, op, ptr, val, mask, *args):
        mode.ops.append(("tl.atomic", 2 * int(mask.data.sum()) * val.data.itemsize))
        return atomic(self, op, ptr, val, mask, *args)

    def counted_launch(self, *args, **kwargs):
        mode.launches.append(self.fn.__name__)
        with _disable_current_modes():  # the interpreter's own host copies are no traffic of the kernel
            return launch(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(quantize, "_backend", lambda x, backend: backend or TRITON)
        m.setattr(builder, "create_masked_load", counted_load)
        m.setattr(builder, "create_masked_store", counted_store)
        m.setattr(builder, "create_atomic_rmw", counted_atomic)
        m.setattr(grid, "__call__", counted_launch)
        mode.launches = []
        with mode:
            fn()
    torch_ops = [op for op, _ in mode.ops if not op.startswith("tl.")]
    return sum(b for _, b in mode.ops), len(mode.launches) + len(torch_ops), mode.ops


SHAPES = [(256, 384), (200, 300), (64, 130), (70, 100)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantisation_bytes_are_what_the_kernels_move(recipe, shape, dtype, monkeypatch):
    from xorl_kernels.fp8.linear import OPERANDS, quantize_operand

    a = torch.finfo(dtype).bits // 8
    for role, (block, _) in OPERANDS[recipe].items():
        transposed = role in ("w_t", "dy_t", "x_t")  # the GEMMs pass views of transposes (linear.py)
        x = torch.randn(shape[::-1] if transposed else shape, dtype=dtype)
        operand = x.t() if transposed else x
        cast = lambda operand=operand, role=role: quantize_operand(operand, recipe, role)  # noqa: E731
        nbytes, launches, ops = kernel_traffic(cast, monkeypatch)
        assert (nbytes, launches) == quantize_cost(*shape, block, a), (role, ops)


def test_the_modelled_cast_bytes_per_element():
    # The docstring's figures on a Llama-8B-sized activation (8192 tokens x 4096) in bf16, per element:
    # ~3 bytes block-local (read 2, write 1), rowwise's long rows read twice (5), tensorwise 5 (amax pass
    # + cast); the scales and per-tile scalars add under 1%.
    n = 8192 * 4096
    per_element = {name: quantize_cost(8192, 4096, block, 2)[0] / n
                   for name, block in (("tile", (1, 128)), ("block", (128, 128)), ("row", (1, None)),
                                       ("tensor", (None, None)))}
    assert 3.0 < per_element["tile"] < 3.04 and 3.0 < per_element["block"] < 3.001
    assert 5.0 < per_element["row"] < 5.001 and 5.0 < per_element["tensor"] < 5.003


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_experts_quantisation_bytes_are_what_the_kernels_move(dtype, monkeypatch):
    # fp8_grouped_gemm (xorl_kernels/fp8/grouped.py): the stacked weights in 128 x 128 blocks, and the
    # wgrad's token tiles over experts of uneven sizes (one empty, one not a multiple of 128).
    from xorl_kernels.fp8.quantize import BLOCK, E4M3, group_token_tiles, quantize_blocks, quantize_token_tiles

    a = torch.finfo(dtype).bits // 8
    w = torch.randn(3, 256, 384, dtype=dtype)
    assert kernel_traffic(lambda: quantize_blocks(w, BLOCK, BLOCK, E4M3), monkeypatch)[:2] == \
        quantize_cost(256, 384, (128, 128), a, lead=3)
    sizes = torch.tensor([300, 0, 129, 211])  # int64, as permute_tokens' tokens_per_expert
    rows = int(sizes.sum())
    assert traffic(lambda: group_token_tiles(sizes, rows))[:2] == group_tiles_cost(rows, 4)
    tile_of_row, _, _, tiles = group_token_tiles(sizes, rows)
    x = torch.randn(rows, 192, dtype=dtype)
    assert tiles == math.ceil(rows / 128) + 4
    assert kernel_traffic(lambda: quantize_token_tiles(x, sizes, tile_of_row, tiles), monkeypatch)[:2] == \
        token_tiles_cost(rows, 192, 4, a)


def _cost(a: int = 2, peak: float = 989.0, hbm: float = 3350.0):
    from xorl.planner.efficiency import load
    from xorl.planner.step_time import Hardware, _Cost

    return _Cost(Hardware(peak_tflops=peak, hbm_gbps=hbm), a, load())


@pytest.mark.parametrize("bias", [False, True])
def test_a_tensorwise_linear_moves_the_modelled_bytes_beside_its_gemms(bias, monkeypatch):
    # The whole op (xorl_kernels/fp8/linear.py fp8_linear) forward and backward on bf16, its casts on the
    # kernels: every op but the GEMMs and the bias gradient (which bf16's F.linear runs too) is the model's
    # casts and extras.
    from xorl_kernels.fp8.linear import fp8_linear

    m, k, n = 256, 384, 128
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, dtype=torch.bfloat16, requires_grad=True) if bias else None
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    nbytes, launches, ops = kernel_traffic(lambda: fp8_linear(x, w, b, "tensorwise").backward(dy), monkeypatch)
    beside = [(op, b_) for op, b_ in ops if op in ("_scaled_mm", "sum")]
    nbytes -= sum(b_ for _, b_ in beside)
    launches -= len(beside)
    price = Fp8Pricer(_cost(), "tensorwise", 1, False, False)
    g = Fp8Gemm((("proj", n, bias),), m, k, "plain")
    work = [price.forward_casts(g), price.dgrad_casts(g), price.wgrad_casts(g)]
    assert (nbytes, launches) == (sum(w_[0] for w_ in work), sum(w_[1] for w_ in work)), ops


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("role", ["x", "x_t"])
def test_a_tp_column_op_casts_its_input_shard_once_as_the_kernels_move(recipe, role, monkeypatch):
    # xorl/nn/tp_fp8.py input_shard on a TP 4 rank's [2, 256, 384] bf16 shard (the ring's own-scale cast,
    # and the plain path's where its scales are the shard's: every recipe's "x" but tensorwise, 1 x 128
    # x^T on whole tiles), its Triton kernels traced: the bytes and launches the pricer gives the group's
    # input cast, once however many members it has.
    import types

    from xorl.nn.tp_fp8 import input_shard

    tp, x = 4, torch.randn(2, 256, 384, dtype=torch.bfloat16)
    cfg = types.SimpleNamespace(fp8=recipe, tp=None, stats=None)  # no collective on this path
    nbytes, launches, _ = kernel_traffic(lambda: input_shard(cfg, x, role, whole=False), monkeypatch)
    price = Fp8Pricer(_cost(), recipe, tp, True, False, sp=True)
    group = [Fp8Gemm(tuple((f"m{j}", 96, False) for j in range(members)), tp * 512, 384, "column")
             for members in (1, 3)]
    assert price._input(group[0], role) == (nbytes, launches)
    casts = price.forward_casts if role == "x" else price.wgrad_casts
    one, three = casts(group[0]), casts(group[1])
    member = (one[0] - nbytes, one[1] - launches)  # a member's own casts (weight, dy^T) and extras
    assert three == (nbytes + 3 * member[0], launches + 3 * member[1])


# -- speed-ups -------------------------------------------------------------------------------------
def _linear_times(recipe: str, size: int, casts: bool = True) -> tuple[float, float]:
    """(bf16, FP8) seconds of a [size, size] x [size, size] linear's forward + backward."""
    c = _cost()
    price = Fp8Pricer(c, recipe, 1, False, False)
    g = Fp8Gemm((("proj", size, False),), size, size, "plain")
    fp8 = price.forward(g) + price.dgrad(g) + price.wgrad(g)
    if not casts:
        fp8 -= sum(c.elementwise(*w) for w in (price.forward_casts(g), price.dgrad_casts(g), price.wgrad_casts(g)))
    return 3 * price.bf16(g), fp8


@pytest.mark.parametrize("recipe", RECIPES)
def test_large_gemms_speed_up_by_the_stated_factor_and_casts_take_more_of_smaller_ones(recipe):
    from xorl.planner.efficiency import load

    eff = load()
    stated = FP8_PEAK_RATIO * dict(eff.fp8_max)[recipe] / eff.gemm_max  # both curves at 1.0 from 8192
    bf16, fp8 = _linear_times(recipe, 16384, casts=False)
    assert bf16 / fp8 == pytest.approx(stated, rel=1e-9)
    # m = n = k = 2^8 ... 2^17 (H100, the fused casts: tensorwise 0.14x up to 1024, launch-bound, then 0.53,
    # 1.01 at 4096, 1.29 at 8192, 1.47, 1.59, 1.65, 1.69; the GEMMs alone 1.72x. The eager casts before:
    # 0.03x, 0.14, 0.35 at 4096, 0.57 at 8192, ... 1.53)
    speedups = [(lambda t: t[0] / t[1])(_linear_times(recipe, 2**e)) for e in range(8, 18)]
    assert all(x <= y for x, y in zip(speedups, speedups[1:])), speedups  # the casts' share shrinks with size
    assert all(x < y for x, y in zip(speedups[3:], speedups[4:])), speedups  # once they are bandwidth-bound
    assert 0.85 * stated < speedups[-1] < stated  # 2^17: near the GEMMs' own factor
    assert speedups[0] < speedups[3] < 1  # small ones lose: the casts' launches and passes exceed the saving


def test_the_fp8_peak_is_twice_the_bf16_peak_unless_given():
    from xorl.planner.efficiency import load as eff_load
    from xorl.planner.step_time import Hardware, _Cost

    g = Fp8Gemm((("proj", 8192, False),), 8192, 8192, "plain")
    default = Fp8Pricer(_Cost(Hardware(peak_tflops=500.0), 2, eff_load()), "tensorwise", 1, False, False)
    given = Fp8Pricer(_Cost(Hardware(peak_tflops=500.0, fp8_peak_tflops=2000.0), 2, eff_load()), "tensorwise", 1,
                      False, False)
    assert default.flops == 1000e12 and given.flops == 2000e12
    assert given.forward(g) < default.forward(g)


# -- in step_time ----------------------------------------------------------------------------------
def _config(train: dict, model: dict | None = None):
    from xorl.config import Config

    return Config.from_dict({"model": model or {**TINY_DENSE, "vocab_size": 4096, "hidden_size": 1024,
                                                "intermediate_size": 3584, "num_attention_heads": 8,
                                                "num_key_value_heads": 4, "max_position_embeddings": 4096},
                             "data": {"seq_len": 4096, "micro_batch_size": 1},
                             "train": {"data_parallel_mode": "fsdp2", "dtype": "bfloat16", **train}})


def test_the_bf16_gemms_it_replaces_are_the_ones_step_time_priced():
    # A dense layer's GEMMs are all FP8 modules: what fp8_time subtracts is step_time's whole GEMM sum.
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.spec import ModelSpec
    from xorl.planner.step_time import _layer

    for tp, model in ((1, None), (2, None), (2, {**MODELS["deepseek_v3 latent"], "first_k_dense_replace": 2})):
        config = _config({"tensor_parallel_size": tp, "sequence_parallel": tp > 1}, model)
        p, spec, c = ParallelConfig.from_config(config, 2 * tp), ModelSpec.from_config(config.model), _cost()
        layer = _layer(spec, False, p, c, 4096, 4096, tp > 1, "none", False)
        price = Fp8Pricer(c, "tensorwise", tp, False, False)
        assert sum(price.bf16(g) for g in fp8_gemms(spec, False, "tensorwise", tp, 1, 4096)) == \
            pytest.approx(layer.gemm, rel=1e-12)


def test_fp8_none_adds_nothing_and_a_recipe_changes_the_step():
    from xorl.planner.guide import Options, evaluate

    times = {fp8: evaluate(_config({"fp8": fp8}), Options(2)).time for fp8 in ("none", *RECIPES)}
    none = times.pop("none")
    config = _config({})
    assert evaluate(config, Options(2)).time == none  # the default is none
    for recipe, t in times.items():
        assert t.compute != none.compute and t.exposed_comm == none.exposed_comm, recipe


def test_a_compiled_fp8_run_keeps_its_casts_and_compiles_the_elementwise_work_around_them():
    # train.fp8 with train.compile plans (no refusal). The FP8 GEMMs are custom ops, their casts Triton
    # kernels inside them: compile changes what FP8 adds to a layer by nothing, and the element-wise work
    # between the ops is priced compiled (step_time's elementwise_forward), as for bf16.
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.spec import ModelSpec
    from xorl.planner.guide import Options, evaluate
    from xorl.planner.step_time import _layer

    for recipe in RECIPES:
        eager, compiled = (evaluate(_config({"fp8": recipe, "compile": c}), Options(2)).time for c in (False, True))
        assert compiled.compute < eager.compute, recipe
    for tp, mode in ((1, "selective"), (2, "full")):
        config = _config({"tensor_parallel_size": tp, "sequence_parallel": tp > 1})
        p, spec, c = ParallelConfig.from_config(config, 2 * tp), ModelSpec.from_config(config.model), _cost()
        layers = {(fp8, compiled): _layer(spec, False, p, c, 4096, 4096, tp > 1, mode, compiled, True, fp8)
                  for fp8 in ("none", *RECIPES) for compiled in (False, True)}
        for recipe in RECIPES:
            for part in ("forward", "backward", "recompute"):
                added = [getattr(layers[(recipe, on)], part) - getattr(layers[("none", on)], part)
                         for on in (False, True)]
                assert added[0] != 0 and added[1] == pytest.approx(added[0], rel=1e-12), (tp, recipe, part)
            assert layers[(recipe, True)].forward < layers[(recipe, False)].forward


def test_selective_keeps_the_fp8_ops_and_every_other_matmul_reruns_its_units_in_fp8():
    # Every FP8 GEMM is one op that selective checkpointing keeps (xorl::fp8_linear, xorl::fp8_grouped_gemm,
    # the TP linear ops): nothing FP8 runs again. every_other_matmul recomputes the units it recomputes in
    # bf16 (a Llama block's k, o and up; under TP, o alone), each now in FP8: its casts and FP8 GEMM in
    # place of the bf16 GEMM step_time priced.
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.spec import ModelSpec
    from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL
    from xorl.planner.fp8_time import fp8_layer

    t = 4096
    for tp, recomputed in ((1, {"self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"}), (2, {"self_attn.o_proj"})):
        config = _config({"tensor_parallel_size": tp, "sequence_parallel": tp > 1})
        p, spec, c = ParallelConfig.from_config(config, 2 * tp), ModelSpec.from_config(config.model), _cost()
        for recipe in RECIPES:
            none = fp8_layer(spec, False, p, c, t, tp > 1, "none", False, recipe)
            selective = fp8_layer(spec, False, p, c, t, tp > 1, "selective", False, recipe)
            every_other = fp8_layer(spec, False, p, c, t, tp > 1, "selective", True, recipe)
            assert none.recompute == selective.recompute == 0, recipe
            ring = tp > 1 and p.tp_overlap and t * spec.hidden_size >= DEFAULT_OVERLAP_MIN_NUMEL  # as fp8_layer
            price = Fp8Pricer(c, recipe, tp, ring, False)
            modules = [Fp8Gemm((module,), g.m, g.k, g.kind) for g in fp8_gemms(spec, False, recipe, tp, 1, t)
                       for module in g.modules if module[0] in recomputed]
            assert {g.modules[0][0] for g in modules} == recomputed
            expected = sum(price.forward(g) - price.bf16(g) for g in modules)
            assert every_other.recompute == pytest.approx(expected, rel=1e-12), (tp, recipe)


def test_lora_has_no_wgrad():
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.spec import ModelSpec
    from xorl.planner.fp8_time import fp8_layer

    config = _config({})
    p, c = ParallelConfig.from_config(config, 2), _cost()
    spec = ModelSpec.from_config(config.model)
    full = fp8_layer(spec, False, p, c, 4096, False, "none", False, "tensorwise")
    frozen = dataclasses.replace(spec, lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj"]})
    lora = fp8_layer(frozen, False, p, c, 4096, False, "none", False, "tensorwise")
    assert lora.forward == full.forward and lora.backward < full.backward


def test_the_cli_says_the_recipe_it_priced(tmp_path, capsys):
    import json

    from xorl.cli.plan import main

    path = tmp_path / "run.yaml"
    path.write_text(_config({"fp8": "rowwise"}).to_yaml())
    assert main([str(path), "--gpus", "2", "--layout", "", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fp8"] == "rowwise" and out["candidates"][0]["fp8"] == "rowwise"
    assert main([str(path), "--gpus", "2", "--layout", "", "--fp8", "blockwise"]) == 0
    assert "GEMMs priced in FP8 blockwise" in capsys.readouterr().out
    assert main([str(path), "--gpus", "2", "--layout", "", "--fp8", "none"]) == 0
    assert "FP8" not in capsys.readouterr().out


def test_refit_learns_the_fp8_fractions_from_bench_fp8_rows(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from plan_calibrate import refit

    from xorl.planner.efficiency import DEFAULT_PATH

    rows = [{"name": "fp8 linear tensorwise gemm 8192^3", "value": 1200.0, "unit": "TFLOP/s",
             "params": {"M": 8192, "K": 8192, "N": 8192, "recipe": "tensorwise", "dtype": "bfloat16"}},
            {"name": "fp8 linear tensorwise fwd+bwd incl. quantisation 8192^3", "value": 300.0, "unit": "TFLOP/s",
             "params": {"M": 8192, "K": 8192, "N": 8192, "recipe": "tensorwise", "dtype": "bfloat16"}}]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"device": {"type": "cuda"}, "peaks": {}, "results": rows}))
    eff = refit(str(path), 989.0, 3350.0)
    with open(DEFAULT_PATH) as f:
        shipped = json.load(f)["fp8"]["max_fraction"]
    assert eff["fp8"]["max_fraction"] == {**shipped, "tensorwise": round(1200 / 1978, 4)}
    assert refit(str(path), 989.0, 3350.0, fp8_peak_tflops=2400.0)["fp8"]["max_fraction"]["tensorwise"] == 0.5
