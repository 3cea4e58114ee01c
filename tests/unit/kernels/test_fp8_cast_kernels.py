"""The fused FP8 casts (xorl_kernels/fp8/triton_quantize.py) against the plain-torch casts they replace
(xorl_kernels/fp8/quantize.py ``*_reference``, torchao's scale arithmetic): q bit for bit, scales equal.

Every recipe and operand role (linear.OPERANDS; the transposed roles read as views of a transpose, as
the GEMMs pass them), bf16 and fp32 inputs, shapes with partial blocks, zero blocks, e4m3 and e5m2,
amaxes in every binade's window where torch's float32 log2 rounds up (the scale then saturates
values), stacked expert weights, the FSDP shard cast with the whole weight's amax, the experts' token
tiles; then the whole FP8 linear / grouped paths and a small model step with every cast on the
kernels, equal to the reference casts' run. On CPU the kernels run under the Triton interpreter
(tests/conftest.py), whose float8 downcast is not torch's: the kernels round in software there (the
module docstring of triton_quantize.py), on a GPU with the hardware conversion.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.triton_helpers import to_triton
from xorl_kernels.dispatch import REFERENCE, TRITON
from xorl_kernels.fp8 import quantize
from xorl_kernels.fp8.linear import OPERANDS, RECIPES, fp8_linear
from xorl_kernels.fp8.quantize import (
    E4M3,
    E5M2,
    cast_with_amax,
    cast_with_amax_reference,
    group_token_tiles,
    quantize_blocks,
    quantize_blocks_reference,
    quantize_token_tiles,
    quantize_token_tiles_reference,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="FP8 needs torchao (pip install -e .[fp8])")
TRANSPOSED = ("w_t", "dy_t", "x_t")


def operand(rows: int, cols: int, dtype: torch.dtype, seed: int, transposed: bool = False) -> torch.Tensor:
    """[rows, cols] of magnitudes spread over 4 decades per row, a zero 128 x 128 block and a zero row
    (zero amax), as a view of a transpose when ``transposed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows)[torch.randperm(rows, generator=g)][:, None]
    x[: min(128, rows), 128:256] = 0.0
    x[rows // 2] = 0.0
    x = x.to(dtype)
    return x.t().contiguous().t() if transposed else x


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


@pytest.fixture
def poisoned(monkeypatch):
    """Every tensor the kernels' launchers allocate starts as NaN bytes (0xFF: NaN in both fp8 formats and
    float32), so an element or scale a kernel fails to write shows."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        t.view(torch.uint8).fill_(0xFF) if t.numel() else None
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def assert_same_cast(got, ref):
    (q, s), (q_ref, s_ref) = got, ref
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.is_contiguous()
    assert torch.equal(bits(q), bits(q_ref))
    assert s.shape == s_ref.shape and torch.equal(s.cpu(), s_ref)


SHAPES = [(200, 300), (130, 70), (64, 129)]  # partial 128-blocks and 64-row tiles; rowwise both one- and multi-chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_and_role_casts_bit_for_bit(recipe, shape, dtype, poisoned):
    for i, (role, (block, fp8)) in enumerate(OPERANDS[recipe].items()):
        x = operand(*shape, dtype, seed=100 + i, transposed=role in TRANSPOSED)
        got = quantize_blocks(to_triton(x), *block, fp8, backend="triton")
        assert_same_cast(got, quantize_blocks_reference(x, *block, fp8))


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(None, None), (1, None), (1, 128), (128, 128)])
def test_both_fp8_formats_on_every_block_shape_and_stacked_experts(block, fp8, poisoned):
    for transposed in (False, True):
        x = operand(200, 300, torch.bfloat16, seed=7, transposed=transposed)
        assert_same_cast(quantize_blocks(to_triton(x), *block, fp8, backend="triton"),
                         quantize_blocks_reference(x, *block, fp8))
    w = torch.stack([operand(150, 140, torch.float32, seed=s) for s in (1, 2, 3)])  # [experts, K, N]
    assert_same_cast(quantize_blocks(to_triton(w), *block, fp8, backend="triton"),
                     quantize_blocks_reference(w, *block, fp8))
    w_t = w.transpose(1, 2)  # a strided view, as the experts' dgrad would read it
    assert_same_cast(quantize_blocks(to_triton(w_t), *block, fp8, backend="triton"),
                     quantize_blocks_reference(w_t, *block, fp8))


def window_amaxes(fp8: torch.dtype) -> torch.Tensor:
    """float32 amaxes around fmax / 2^(k+1) for every k a finite amax reaches: r = fmax / amax then lies
    up to ~120 ulps below or above 2^(k+1), through the window where float32 log2(r) rounds up to k + 1
    (the scale is then 2^(k+1) > r and the block's largest values saturate); plus 0, below and at the
    1e-12 floor, and near float32's largest."""
    fmax = torch.finfo(fp8).max
    values = []
    for k in range(-126, 60):
        a0 = fmax * 2.0 ** -(k + 1)
        if 1e-30 < a0 < 3e38:
            values += [a0 * (1 + i * 2.0**-23) for i in range(61)] + [a0 * (1 - i * 2.0**-24) for i in range(1, 61)]
    return torch.cat([torch.tensor(values, dtype=torch.float64).float(), torch.tensor([0.0, 1e-13, 1e-12, 3.3e38])])


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scales_in_the_log2_rounding_windows_and_saturation(fp8, poisoned):
    amax = window_amaxes(fp8)
    g = torch.Generator().manual_seed(3)
    x = torch.rand(amax.numel(), 128, generator=g) * amax[:, None]
    x[:, 5] = -amax  # the row's amax, negative: saturates to -fmax where the scale rounded up
    x[:, 9] = amax * (1 - 2.0**-20)
    r = (torch.finfo(fp8).max / amax.double().clamp(min=1e-12)).float()
    rounded_up = torch.exp2(torch.floor(torch.log2(r))) > r  # torchao's scale exceeds fmax / amax
    assert int(rounded_up.sum()) > 1000  # the windows are really exercised
    got = quantize_blocks(to_triton(x), 1, 128, fp8, backend="triton")
    ref = quantize_blocks_reference(x, 1, 128, fp8)
    assert_same_cast(got, ref)
    saturated = bits(ref[0])[:, 5] == bits(torch.tensor([-torch.finfo(fp8).max]).to(fp8))[0]
    assert bool(saturated[rounded_up].all())


def test_cast_with_amax_casts_a_shard_as_the_whole(poisoned):
    # xorl/nn/fp8_all_gather.py: each rank casts its row shard with the all-reduced amax of the whole weight.
    w = operand(75, 40, torch.bfloat16, seed=11)
    amax = w.abs().amax().float()
    whole = cast_with_amax_reference(w, amax, E4M3)
    shards = [cast_with_amax(to_triton(part), to_triton(amax), E4M3, backend="triton") for part in w.split(38)]
    assert torch.equal(torch.cat([bits(q) for q, _ in shards]), bits(whole[0]))
    assert all(s.shape == whole[1].shape and torch.equal(s.cpu(), whole[1]) for _, s in shards)
    # an amax the shard's own values exceed (another rank's weight is larger here: it never is in FSDP)
    small = amax / 1000
    assert_same_cast(cast_with_amax(to_triton(w), to_triton(small), E5M2, backend="triton"),
                     cast_with_amax_reference(w, small, E5M2))


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_with_a_per_row_amax_casts_a_shard_of_the_transpose_as_the_whole(fp8, poisoned):
    # xorl/nn/tp_fp8.py, rowwise x^T under TP: each rank casts its token shard of x^T [C, tokens] (a view
    # of a transpose) with each channel's amax over every rank's tokens; rows of 64 + a partial tile.
    x = operand(150, 70, torch.bfloat16, seed=12, transposed=True)  # [150 channels, 70 tokens], a view
    amax = x.abs().amax(dim=1, keepdim=True).float()
    whole = cast_with_amax_reference(x, amax, fp8)
    shards = [cast_with_amax(to_triton(part), to_triton(amax), fp8, backend="triton") for part in x.split(33, dim=1)]
    assert torch.equal(torch.cat([bits(q) for q, _ in shards], dim=1), bits(whole[0]))
    assert all(s.shape == (150, 1) and torch.equal(s.cpu(), whole[1]) for _, s in shards)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_token_tiles_cast_bit_for_bit(dtype, poisoned):
    # an empty expert, experts over several tiles with a partial last one; the bound's unused tiles get
    # the scale of amax 0 in both
    sizes = torch.tensor([300, 0, 7, 129, 60])
    m = int(sizes.sum())
    x = operand(m, 72, dtype, seed=21)
    tile_of_row, _, _, tiles = group_token_tiles(sizes, m)
    ref = quantize_token_tiles_reference(x, tile_of_row, tiles)
    tx, tsizes, ttile = to_triton(x, sizes.to(torch.int32), tile_of_row)
    assert_same_cast(quantize_token_tiles(tx, tsizes, ttile, tiles, backend="triton"), ref)


def test_cpu_tensors_dispatch_to_the_reference_and_cuda_ones_to_the_kernels(monkeypatch):
    import xorl_kernels.fp8.triton_quantize as kernels

    x = operand(40, 50, torch.float32, seed=1)
    calls = []
    monkeypatch.setattr(kernels, "quantize_blocks_triton", lambda *a: calls.append(a) or ("q", "s"))
    assert quantize_blocks(x, 1, 128)[0].dtype == E4M3 and not calls  # CPU: the reference
    monkeypatch.setattr(type(x), "is_cuda", property(lambda t: True))
    assert quantize_blocks(x, 1, 128) == ("q", "s") and len(calls) == 1
    monkeypatch.setenv("XORL_FORCE_REFERENCE", "1")
    assert quantize_blocks(x, 1, 128)[0].dtype == E4M3 and len(calls) == 1


# -- the FP8 paths with every cast on the kernels -----------------------------------------------------
# Each test runs the path on triton_device() (CUDA, or the CPU under the interpreter) twice: every
# automatic cast pick (quantize.py ``_backend``) routed to the reference casts, then to the Triton
# kernels; the GEMMs are the same both times, so the results are equal, not close.
def casts_on(monkeypatch, backend: str, picks: list | None = None) -> None:
    def pick(x, requested):
        if picks is not None:
            picks.append(tuple(x.shape))
        return requested or backend

    monkeypatch.setattr(quantize, "_backend", pick)


def _linear_run(recipe: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(4)
    x, w, b, dy = to_triton(torch.randn(2, 37, 200, generator=g).to(dtype),
                            (torch.randn(72, 200, generator=g) / 14).to(dtype),
                            torch.randn(72, generator=g).to(dtype), torch.randn(2, 37, 72, generator=g).to(dtype))
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = fp8_linear(x, w, b, recipe)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_forward_and_gradients_equal_with_the_kernel_casts(recipe, monkeypatch):
    casts_on(monkeypatch, REFERENCE)
    ref = _linear_run(recipe, torch.float32)
    picks = []
    casts_on(monkeypatch, TRITON, picks)
    got = _linear_run(recipe, torch.float32)
    assert len(picks) == 6  # two operands of each of the three GEMMs
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_fp8_grouped_gemm_forward_and_gradients_equal_with_the_kernel_casts(monkeypatch):
    from xorl_kernels.fp8.grouped import fp8_grouped_gemm

    g = torch.Generator().manual_seed(8)
    sizes, x0, w0, dy = to_triton(torch.tensor([129, 0, 21, 9]), torch.randn(159, 200, generator=g),
                                  torch.randn(4, 200, 136, generator=g) / 14, torch.randn(159, 136, generator=g))

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_grouped_gemm(x, w, sizes, backend="reference")  # the GEMM's formula; the casts picked
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    casts_on(monkeypatch, REFERENCE)
    ref = run()
    picks = []
    casts_on(monkeypatch, TRITON, picks)
    assert all(torch.equal(a, b) for a, b in zip(run(), ref))
    assert len(picks) == 2 + 2 + 2  # forward x, w; dgrad dy, w; wgrad's token tiles of x, dy


def _model_step(model_type: str, recipe: str) -> tuple[float, dict]:
    from xorl.config import ModelConfig
    from xorl.models.registry import build_model

    m = ModelConfig(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    if model_type == "qwen3_moe":
        m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob = 4, 2, 32, True
    model = build_model(m, fp8=recipe)
    model.init_weights(seed=1)
    model.to(to_triton(torch.zeros(())).device)
    rows = to_triton(torch.randint(0, m.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2)))
    out = model(rows[:, :-1], labels=rows[:, 1:])
    (out.loss if out.router_loss is None else out.loss + out.router_loss).backward()
    return float(out.loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type,recipe", [("llama", r) for r in RECIPES] + [("qwen3_moe", "blockwise")])
def test_a_model_step_with_the_kernel_casts_equals_the_reference_casts(model_type, recipe, monkeypatch):
    casts_on(monkeypatch, REFERENCE)
    ref_loss, ref_grads = _model_step(model_type, recipe)
    picks = []
    casts_on(monkeypatch, TRITON, picks)
    loss, grads = _model_step(model_type, recipe)
    # the casts of every FP8 GEMM ran on the kernels: 2 layers x (4 attention + 3 MLP / 2 expert) GEMMs
    # x 3 passes x 2 operands (+ the experts' dgrad re-casts w; the token tiles are one pick per operand)
    assert len(picks) >= 2 * (4 + (2 if model_type == "qwen3_moe" else 3)) * 3 * 2, len(picks)
    assert loss == ref_loss and grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), [n for n in grads
                                                                      if not torch.equal(grads[n], ref_grads[n])]
