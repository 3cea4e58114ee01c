"""attn_implementation maps in one place (xorl/nn/attention_backends.py) to the local kernel and
the ring-step kernel. These tests check what each name does, not what the table says: which
kernel runs, that it computes the same attention as a float64 SDPA model, and that a name whose
package is missing says so."""

import importlib.util
import types

import pytest
import torch

import xorl.models.attention as attention_module
import xorl_kernels.attention.op as xorl_attention_op
from xorl.nn.attention_backends import ATTENTION_BACKENDS, attention_backend, missing_package
from xorl.nn.ring_attention import RingAttention

NAMES = sorted(k for k in ATTENTION_BACKENDS if k)
SDPA_NAMES = {"sdpa", "eager", "torch", "auto"}  # "auto" is SDPA on CPU tensors
PACKAGE_NAMES = {"flash_attn", "flash_attention_2"}  # the flash-attn package, not installed here


def _tiny(attn: str, seed: int = 0):
    from xorl.models.registry import build_model

    config = types.SimpleNamespace(
        model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation=attn, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return build_model(config)


def _spy(monkeypatch):
    """Record which kernel each attention call ran: 'xorl' (xorl_kernels.flash_attn) or 'sdpa'."""
    ran = []
    xorl_kernel, sdpa = xorl_attention_op.flash_attn, attention_module.causal_attention_reference

    def xorl_spy(*args, **kwargs):
        ran.append("xorl")
        return xorl_kernel(*args, **kwargs)

    def sdpa_spy(*args, **kwargs):
        ran.append("sdpa")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(xorl_attention_op, "flash_attn", xorl_spy)
    monkeypatch.setattr(attention_module, "causal_attention_reference", sdpa_spy)
    return ran


@pytest.mark.parametrize("name", NAMES)
def test_each_name_runs_its_kernel_and_computes_the_float64_sdpa_model(name, monkeypatch):
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12])
    expected = _tiny("sdpa").double()(ids, cu_seqlens=cu, max_seqlen=7).logits
    model = _tiny(name)
    ran = _spy(monkeypatch)
    if name in PACKAGE_NAMES and importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(RuntimeError, match="needs the flash-attn package"):
            model(ids, cu_seqlens=cu, max_seqlen=7)
        assert ran == []  # neither xorl's kernel nor SDPA stood in for the package
        return
    logits = model(ids, cu_seqlens=cu, max_seqlen=7).logits
    assert ran == ["sdpa" if name in SDPA_NAMES else "xorl"]
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"attn_implementation='flash3' is not known; use one of \['auto', "):
        attention_backend("flash3")
    with pytest.raises(ValueError, match="is not known"):
        _tiny("flash3")


def _float64_attention(q, k, v):
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], dim=2))
    scores = scores * q.shape[-1] ** -0.5
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))


@pytest.mark.parametrize("name", NAMES)
def test_each_names_ring_step_computes_attention_with_its_lse_or_names_the_package(name):
    """Under context parallelism every name needs a ring step that returns the log-sum-exp: the
    SDPA names (SDPA returns none) run the xorl kernel; the flash-attn names need the package."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 8, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ring = RingAttention(None, attn_backend=attention_backend(name).ring_step)
    if name in PACKAGE_NAMES and importlib.util.find_spec("flash_attn") is None:
        with pytest.raises((ImportError, RuntimeError), match="flash-attn"):
            ring(q, k, v)
        return
    torch.testing.assert_close(ring(q, k, v), _float64_attention(q, k, v))


def test_the_package_check_reads_the_table(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    assert missing_package("flash_attention_2") == "flash_attn"
    assert missing_package("xorl") is None and missing_package("sdpa") is None
