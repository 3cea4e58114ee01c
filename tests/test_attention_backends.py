"""attn_implementation maps in one place (xorl/nn/attention_backends.py) to the local kernel and
the ring-step kernel; the model, the context-parallel plan and the config rules all read it."""

import types

import pytest
import torch

from xorl.nn.attention_backends import ATTENTION_BACKENDS, attention_backend, missing_package


def _tiny(attn: str):
    from xorl.models.registry import build_model

    config = types.SimpleNamespace(
        model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation=attn, max_position_embeddings=64,
    )
    return build_model(config)


@pytest.mark.parametrize("name", sorted(k for k in ATTENTION_BACKENDS if k))
def test_the_model_builds_the_local_kernel_the_table_names(name):
    model = _tiny(name)
    assert model.model.layers[0].self_attn.core_attention.backend == attention_backend(name).local


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"attn_implementation='flash3' is not known; use one of \['auto', "):
        attention_backend("flash3")
    with pytest.raises(ValueError, match="is not known"):
        _tiny("flash3")


def test_the_context_parallel_plan_takes_the_ring_step_kernel_from_the_table(monkeypatch):
    """parallelize_model hands apply_context_parallel the table's ring-step kernel."""
    import xorl.plans.context_parallel as cp_plan
    from xorl.parallelize import parallelize_model

    seen = []
    monkeypatch.setattr(cp_plan, "apply_context_parallel", lambda model, **kw: seen.append(kw["attn_backend"]))
    state = types.SimpleNamespace(tp_size=1, cp_size=2, ring_group=None, ulysses_group=None, ep_size=1)
    for name in ("xorl", "sdpa", "flash_attn"):
        config = types.SimpleNamespace(
            model=types.SimpleNamespace(attn_implementation=name, num_experts=0),
            train=types.SimpleNamespace(activation_checkpointing="none", compile=False, data_parallel_mode="ddp"),
        )
        parallelize_model(torch.nn.Module(), state, config)
    assert seen == [None, None, "flash_attn"]


def test_the_package_check_reads_the_table(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    assert missing_package("flash_attention_2") == "flash_attn"
    assert missing_package("xorl") is None and missing_package("sdpa") is None
