"""xorl.hf.apply on stock transformers models (xorl/hf/apply.py): every family's checkpoint, saved by
transformers' own class, loaded with ``attn_implementation="xorl", experts_implementation="xorl"`` and
patched by ``apply()`` (norm, rope, mlp, loss), against the same class in eager: the loss (with
``num_items_in_batch``), the logits and every parameter's gradient within 1e-5 (fp32), xorl's kernels
counted as the ones that ran. ``remove()`` gives back the model bit for bit; what xorl cannot compute
exactly is refused and the refusal changes nothing; a patched decoder layer compiles without a graph
break."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("kernels")

import xorl.hf  # noqa: E402
import xorl.hf.instance as hf_instance  # noqa: E402
import xorl.hf.layers as hf_layers  # noqa: E402
import xorl.hf.loss as hf_loss  # noqa: E402
from tests.unit.hf.test_stock_models import MOE, _Counted, _load  # noqa: E402
from tests.unit.models.test_families import FAMILIES, SMALL, hf_checkpoint, rel_err  # noqa: E402

TOL = 1e-5
# Attention classes that call their RoPE function directly: transformers gives them no kernel hook.
NO_ROPE_HOOK = {"glm4_moe", "deepseek_v3", "deepseek_v3-no-q_lora", "deepseek_v2", "deepseek_v2-lite-greedy"}
DENSE_MLP_FREE = {"mixtral", "olmoe", "qwen3_moe", "gpt_oss"}  # every layer routed, no shared expert


def _spies(monkeypatch) -> dict[str, _Counted]:
    spies = {"rms_norm": _Counted(hf_layers.rms_norm), "rms_norm_instance": _Counted(hf_instance.rms_norm),
             "rope": _Counted(hf_layers.apply_rotary), "swiglu": _Counted(hf_instance.swiglu),
             "flce": _Counted(hf_loss.fused_linear_cross_entropy)}
    monkeypatch.setattr(hf_layers, "rms_norm", spies["rms_norm"])
    monkeypatch.setattr(hf_instance, "rms_norm", spies["rms_norm_instance"])
    monkeypatch.setattr(hf_layers, "apply_rotary", spies["rope"])
    monkeypatch.setattr(hf_instance, "swiglu", spies["swiglu"])
    monkeypatch.setattr(hf_loss, "fused_linear_cross_entropy", spies["flce"])
    return spies


def _batch(seed: int, rows: int = 2, width: int = 24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (rows, width), generator=gen)
    labels = ids.clone()
    labels[torch.rand(rows, width, generator=gen) < 0.3] = -100
    count = (labels[..., 1:] != -100).sum()  # HF Trainer's num_items_in_batch for a causal LM
    return ids, labels, count + 7  # as if other micro-batches of the step held 7 more


def _train_pass(model, ids, labels, num_items):
    model.train()
    out = model(ids, labels=labels, num_items_in_batch=num_items)
    lazy = type(out.logits) is hf_loss.LazyLogits
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, lazy


@pytest.mark.parametrize("name", list(FAMILIES))
def test_apply_matches_eager_loss_logits_and_gradients(name, tmp_path, monkeypatch):
    hf_checkpoint(name, tmp_path, seed=1)
    ref = _load(name, tmp_path, attn_implementation="eager")
    ours = _load(name, tmp_path, attn_implementation="xorl", experts_implementation="xorl")
    patches = xorl.hf.apply(ours)
    spies = _spies(monkeypatch)
    ids, labels, num_items = _batch(2)
    ref_loss, ref_logits, ref_grads, _ = _train_pass(ref, ids, labels, num_items)
    loss, logits, grads, lazy = _train_pass(ours, ids, labels, num_items)

    assert rel_err(loss, ref_loss) <= TOL
    assert lazy  # the training forward never formed the logits: they were computed when read above
    assert rel_err(logits, ref_logits) <= TOL
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    worst = max((rel_err(grads[n], g), n) for n, g in ref_grads.items())
    assert worst[0] <= TOL, worst

    layers = ours.config.num_hidden_layers
    norms = [m for m in ours.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(patches.applied["norm"]) == len(norms) >= 2 * layers + 1
    # Each norm ran once, on its own kernel or inside its block's fused residual add.
    assert spies["rms_norm"].calls + spies["rms_norm_instance"].calls == len(norms)
    fused_adds = 0 if name == "gpt_oss" else layers  # gpt-oss's norm rounds after the weight product
    assert len(patches.applied["residual_add"]) == fused_adds
    rope_layers = 0 if name in NO_ROPE_HOOK else layers
    assert len(patches.applied["rope"]) == rope_layers and spies["rope"].calls == 2 * rope_layers  # q and k
    assert sum("RoPE left stock" in why for why in patches.skipped.values()) == layers - rope_layers
    dense = sum(1 for m in ours.modules() if hasattr(m, "gate_proj") and hasattr(m, "act_fn"))
    assert len(patches.applied["mlp"]) == dense == spies["swiglu"].calls and (dense == 0) == (name in DENSE_MLP_FREE)
    assert spies["flce"].calls == 1
    assert (name in MOE) == any(hasattr(m, "gate_up_proj") for m in ours.modules())


def _snapshot(model) -> dict:
    """Every module's identity, class and instance dict (containers by their entries' identities),
    and each kernels wrapper's: what apply may touch."""
    def entries(obj):
        out = {}
        for key, value in vars(obj).items():
            if isinstance(value, dict):
                out[key] = tuple((k, id(v)) for k, v in value.items())
            elif isinstance(value, (bool, int, float, str, type(None))):
                out[key] = value
            else:
                out[key] = id(value)
        return out

    snap = {}
    for name, module in model.named_modules(remove_duplicate=False):
        snap[name] = (id(module), type(module), entries(module))
        for key, func in vars(module).get("_kernel_funcs", {}).items():
            snap[f"{name}#{key}"] = (id(func), type(func), entries(func))
    return snap


@pytest.mark.parametrize("name", ["llama3.2-tied-linear", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_remove_gives_back_the_model_bit_for_bit(name, tmp_path):
    hf_checkpoint(name, tmp_path, seed=3)
    model = _load(name, tmp_path, attn_implementation="xorl", experts_implementation="xorl")
    ids, labels, num_items = _batch(4)
    before_loss, before_logits, before_grads, _ = _train_pass(model, ids, labels, num_items)
    model.zero_grad(set_to_none=True)
    snap, state = _snapshot(model), {k: v.clone() for k, v in model.state_dict().items()}

    patches = xorl.hf.apply(model, fp8="rowwise", fp8_filter=lambda module, fqn: "self_attn" in fqn)
    assert patches.applied["fp8"] and all(patches.applied[k] for k in ("norm", "loss"))
    assert _snapshot(model) != snap
    _train_pass(model, ids, labels, num_items)
    model.zero_grad(set_to_none=True)
    xorl.hf.remove(model)

    assert _snapshot(model) == snap
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    loss, logits, grads, lazy = _train_pass(model, ids, labels, num_items)
    assert not lazy and torch.equal(loss, before_loss) and torch.equal(logits, before_logits)
    assert all(torch.equal(grads[n], g) for n, g in before_grads.items())
    with pytest.raises(xorl.hf.XorlApplyError, match="no xorl.hf.apply patches"):
        xorl.hf.remove(model)


def _tiny_llama(**fields):
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 2, **fields})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _OnePlusWeightNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """A norm that inherits transformers' RMSNorm kernel mark but computes Gemma's (1 + weight)."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).type_as(hidden_states)


def test_what_xorl_cannot_compute_exactly_is_refused_and_the_model_is_left_as_it_was():
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**{**SMALL, "num_hidden_layers": 2,
                                                                      "head_dim": 8}))
    snap = _snapshot(gemma)
    with pytest.raises(xorl.hf.XorlApplyError, match=r"GemmaRMSNorm.*1 \+ weight.*norm=False"):
        xorl.hf.apply(gemma)
    assert _snapshot(gemma) == snap
    patches = xorl.hf.apply(gemma, norm=False)  # the rest stands: its MLP is GELU, so left stock
    assert not patches.applied["mlp"] and all("not SiLU" in patches.skipped[n] for n in ("model.layers.0.mlp",))
    patches.remove()

    llama = _tiny_llama()
    llama.model.norm.__class__ = _OnePlusWeightNorm  # marked "RMSNorm", another formula
    snap = _snapshot(llama)
    with pytest.raises(xorl.hf.XorlApplyError, match=r"model.norm \(_OnePlusWeightNorm\).*kernel mark"):
        xorl.hf.apply(llama)
    assert _snapshot(llama) == snap

    biased = _tiny_llama()
    biased.lm_head = torch.nn.Linear(SMALL["hidden_size"], SMALL["vocab_size"])
    with pytest.raises(xorl.hf.XorlApplyError, match="no lm_head bias"):
        xorl.hf.apply(biased)
    xorl.hf.apply(biased, loss=False).remove()

    twice = _tiny_llama()
    xorl.hf.apply(twice)
    with pytest.raises(xorl.hf.XorlApplyError, match="already ran"):
        xorl.hf.apply(twice)
    xorl.hf.remove(twice)

    patched = _tiny_llama()
    patched.model.layers[0].mlp.forward = lambda x: x  # someone else's instance patch
    with pytest.raises(xorl.hf.XorlApplyError, match="model.layers.0.mlp .*forward of its own"):
        xorl.hf.apply(patched)
    assert "forward" not in vars(patched.model.layers[1].mlp) and "forward" not in vars(patched.model.norm)


@pytest.mark.parametrize("name", ["llama3.1-rope-llama3", "qwen3_moe"])
def test_a_patched_decoder_layer_compiles_without_a_graph_break(name, tmp_path):
    """With xorl's attention and experts too: compiled, the attention reads packed documents from the
    cu_seq_lens kwargs only (no host read of the positions), so the layer is one graph."""
    hf_checkpoint(name, tmp_path, seed=5)
    model = _load(name, tmp_path, attn_implementation="xorl", experts_implementation="xorl")
    xorl.hf.apply(model)
    layer = model.model.layers[0]
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 16, SMALL["hidden_size"], generator=gen, requires_grad=True)
    positions = torch.arange(16)[None]
    kwargs = dict(attention_mask=None, position_embeddings=model.model.rotary_emb(hidden, positions),
                  position_ids=positions)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(hidden, **kwargs)
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert explained.graph_break_count == 0, explained.break_reasons
    assert {"xorl.add_rms_norm", "xorl.rms_norm", "xorl.rope", "xorl.flash_attn"} <= ops
    assert ("xorl.swiglu" in ops) == (name not in MOE)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    out = compiled(hidden, **kwargs)
    (grad,) = torch.autograd.grad(out.square().sum(), hidden)
    ref = layer(hidden, **kwargs)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), hidden)
    assert rel_err(out, ref) <= TOL and rel_err(grad, ref_grad) <= TOL
