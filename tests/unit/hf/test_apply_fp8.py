"""xorl.hf.apply(fp8=recipe): a stock transformers model's nn.Linear children become xorl's FP8 Linear
(xorl/hf/instance.py ``swap_fp8_linears``), as torchao's convert_to_float8_training does: the default
filter leaves out the lm_head, routers and dims FP8 GEMMs cannot take; the swapped layers hold the same
Parameter objects (state dict and optimizer state unchanged) and compute the recipe's float64 formula
(xorl_kernels/fp8/reference.py) in forward and both backward GEMMs; a filter ``(module, fqn)`` chooses
instead; remove() puts the nn.Linear modules back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import xorl.hf  # noqa: E402
from tests.unit.models.test_families import SMALL, randomize_, rel_err  # noqa: E402
from xorl.nn.linear import Linear  # noqa: E402
from xorl_kernels.fp8 import RECIPES  # noqa: E402
from xorl_kernels.fp8.reference import fp8_linear_reference  # noqa: E402

# Dims FP8 GEMMs take (multiples of 16) everywhere but the shared-expert gate (hidden -> 1).
DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(**{**SMALL, **DIMS}, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config)
    randomize_(model, 0)
    return model


def _linears(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_default_filter_swaps_every_projection_but_the_lm_head_and_routers(recipe):
    model = _qwen2_moe()
    before = _linears(model)
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patches = xorl.hf.apply(model, norm=False, rope=False, mlp=False, loss=False, fp8=recipe)

    swapped = set(patches.applied["fp8"])
    expected = {n for n in before if n != "lm_head" and not n.endswith("shared_expert_gate")}
    assert swapped == expected and len(swapped) == 2 * (4 + 3)  # per layer: q k v o + shared gate / up / down
    after = _linears(model)
    assert all(type(after[n]) is Linear and after[n].fp8 == recipe for n in swapped)
    assert type(model.lm_head) is nn.Linear and all(type(after[n]) is nn.Linear for n in set(before) - swapped)
    assert all(p is params[n] for n, p in model.named_parameters())  # the very same Parameters
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())

    # A swapped layer computes the recipe's formula (forward, input and weight gradients).
    layer = model.model.layers[1].self_attn.q_proj
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 64, generator=gen).requires_grad_()
    dy = torch.randn(2, 9, 64, generator=gen)
    y = layer(x)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = fp8_linear_reference(x.detach().reshape(-1, 64), layer.weight.detach(),
                                                 dy.reshape(-1, 64), recipe)
    assert rel_err(y.detach().reshape(-1, 64) - layer.bias.detach(), ref_y) <= 1e-6
    assert rel_err(x.grad.reshape(-1, 64), ref_dx) <= 1e-6 and rel_err(layer.weight.grad, ref_dw) <= 1e-6
    exact = x.detach().double().reshape(-1, 64) @ layer.weight.detach().double().t()
    assert 1e-3 < rel_err(ref_y, exact) < 0.1  # FP8: off the exact product by its rounding

    xorl.hf.remove(model)
    assert all(m is before[n] for n, m in _linears(model).items()) and _linears(model).keys() == before.keys()


def test_a_filter_chooses_and_the_fp8_model_trains_near_the_stock_loss():
    ref = _qwen2_moe()
    model = _qwen2_moe()
    patches = xorl.hf.apply(model, fp8="rowwise", fp8_filter=lambda module, fqn: fqn.endswith(("up_proj", "o_proj")))
    assert sorted(patches.applied["fp8"]) == sorted(n for n in _linears(model) if n.endswith(("up_proj", "o_proj")))
    ids = torch.randint(0, DIMS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    ref.train(), model.train()
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward(), ref_loss.backward()
    assert 0 < rel_err(loss, ref_loss) < 0.02  # FP8 rounding in 4 of 7 projections per layer, no more
    grad, ref_grad = (m.model.layers[0].self_attn.o_proj.weight.grad for m in (model, ref))
    assert 0 < rel_err(grad, ref_grad) < 0.3  # e4m3 gradients (3 mantissa bits) through two layers

    hooked = _qwen2_moe()
    hooked.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
    with pytest.raises(xorl.hf.XorlApplyError, match="q_proj has hooks.*before wrapping"):
        xorl.hf.apply(hooked, fp8="tensorwise")
    assert all(type(m) is nn.Linear for m in _linears(hooked).values())
    with pytest.raises(ValueError, match="fp8='mxfp8'"):
        xorl.hf.apply(_qwen2_moe(), fp8="mxfp8")
