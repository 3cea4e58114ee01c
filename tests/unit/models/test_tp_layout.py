"""The decoder's TP layout (xorl/models/tp_layout.py) read against every family's real module tree,
without process groups (the multirank TP tests and the parity matrix run it):

* every parameter is placed by an entry: its module has a style that places its own parameters, or
  it lies in an MoE block the layout leaves to expert parallelism (``token_shards``);
* every entry whose module a family has names the kind of module its style takes;
* the families' traits pick their entries: a width q/k norm (OLMoE) is split over TP, a per-head
  one (Qwen3) replicated, latent attention's shared RoPE key enters the heads' region, a tied
  lm_head has no entry of its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.models.test_families import FAMILIES, SMALL
from xorl.models.tp_layout import decoder_tp_layout
from xorl.nn.moe import MoE
from xorl.nn.rms_norm import RMSNorm

transformers = pytest.importorskip("transformers")

# The styles that place the parameters of the module they name (xorl/nn/tp_styles.py); ``token_shards``
# leaves a whole block's to expert parallelism; ``enter_heads`` takes a module without parameters.
PLACES_OWN = {"column", "row", "heads", "replicated", "per_head_replicated", "width_norm", "vocab_embedding",
              "vocab_lm_head"}
TAKES = {"column": nn.Linear, "row": nn.Linear, "vocab_lm_head": nn.Linear, "vocab_embedding": nn.Embedding,
         "width_norm": RMSNorm, "enter_heads": nn.Identity, "token_shards": MoE}


def build(name: str) -> nn.Module:
    from xorl.models.registry import build_model

    _, config_name, fields = FAMILIES[name]
    with torch.device("meta"):
        return build_model(getattr(transformers, config_name)(**{**SMALL, **fields}))


def present(model: nn.Module, path: str) -> nn.Module | None:
    module = model
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def unplaced(model: nn.Module, styles: dict[str, str]) -> list[str]:
    """The parameters of ``model`` no entry of ``styles`` places."""
    plain = [path for path, style in styles.items() if style == "token_shards"]
    missing = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if styles.get(owner) in PLACES_OWN or any(name.startswith(f"{path}.") for path in plain):
            continue
        missing.append(name)
    return missing


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_layout_places_every_parameter_of_every_family(name):
    model = build(name)
    layout = decoder_tp_layout(model.spec)
    assert unplaced(model, layout.styles) == []
    for path, style in layout.styles.items():
        module = present(model, path)
        if module is not None and style in TAKES:
            assert isinstance(module, TAKES[style]), (path, style, type(module).__name__)
        if style == "heads":  # the style reads the head counts the attention modules declare
            assert isinstance(module.num_heads, int) and isinstance(module.num_key_value_heads, int), path
    norms = {layout.styles.get("model.layers.0.self_attn.q_norm")}
    assert norms == {{"width": "width_norm", "head": "per_head_replicated", "none": None}[model.spec.qk_norm]}
    if model.spec.is_mla:
        assert isinstance(present(model, "model.layers.0.self_attn.rope_key_to_heads"), nn.Identity)
    if model.spec.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # placed once, by the embedding


def test_an_unplaced_parameter_is_found():
    """A family that grew a parameter the layout does not name (one on the decoder layer itself) fails."""
    model = build("qwen3")
    layout = decoder_tp_layout(model.spec)
    assert unplaced(model, layout.styles) == []
    model.model.layers[1].register_parameter("layer_scale", nn.Parameter(torch.empty(3, device="meta")))
    assert unplaced(model, layout.styles) == ["model.layers.1.layer_scale"]
