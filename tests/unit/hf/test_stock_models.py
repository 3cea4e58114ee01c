"""xorl's attention and experts inside stock transformers models (xorl/hf): every family xorl has,
loaded by transformers' own class from a checkpoint that class saved, with
``attn_implementation="xorl", experts_implementation="xorl"``, against the same class in eager:
logits and every parameter's gradient within 1e-5 (fp32), and xorl's kernels counted as the ones
that ran. Packed rows (transformers' DataCollatorWithFlattening, both of its forms) give each
document the logits it has alone; padded batches (left and right) the logits of the unpadded
rows; generation with a KV cache the eager model's tokens. Importing xorl.hf replaces nothing: it adds
"xorl" to the attention, mask, experts and EP-implementation registries and "xorl_colwise" /
"xorl_rowwise" to the parallel styles, and changes no other entry, class or function."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import xorl.hf  # noqa: E402
import xorl.hf.attention as hf_attention  # noqa: E402
import xorl.hf.experts as hf_experts  # noqa: E402
from tests.support.paths import REPO_ROOT  # noqa: E402
from tests.unit.models.test_families import FAMILIES, SMALL, hf_checkpoint, rel_err  # noqa: E402

TOL = 1e-5
MOE = {"mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v3-no-q_lora",
       "deepseek_v2", "deepseek_v2-lite-greedy", "gpt_oss"}


def _load(name, folder, **kw):
    cls = getattr(transformers, FAMILIES[name][0])
    return cls.from_pretrained(folder, dtype=torch.float32, **kw)


def _xorl(name, folder):
    return _load(name, folder, attn_implementation="xorl", experts_implementation="xorl")


class _Counted:
    """Counts the calls of a function the xorl/hf modules call (a test spy; xorl itself is unchanged)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_stock_model_on_xorl_kernels_matches_eager_logits_and_gradients(name, tmp_path, monkeypatch):
    hf_checkpoint(name, tmp_path, seed=1)
    ref, ours = _load(name, tmp_path, attn_implementation="eager"), _xorl(name, tmp_path)
    attn, gemm = _Counted(hf_attention.flash_attn), _Counted(hf_experts.grouped_gemm)
    monkeypatch.setattr(hf_attention, "flash_attn", attn)
    monkeypatch.setattr(hf_experts, "grouped_gemm", gemm)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (ref, ours):
        model.train()
        logits = model(ids).logits
        (logits.square().mean() + logits[:, :, 3].sum()).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_logits, ref_grads), (logits, grads) = results
    assert rel_err(logits, ref_logits) <= TOL
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    worst = max((rel_err(grads[n], g), n) for n, g in ref_grads.items())
    assert worst[0] <= TOL, worst
    assert attn.calls == ours.config.num_hidden_layers
    # Each MoE layer runs two grouped GEMMs (gate_up, down); dense layers none.
    moe_layers = sum(1 for m in ours.modules() if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3)
    assert gemm.calls == 2 * moe_layers and (moe_layers > 0) == (name in MOE)


def _documents(gen, lengths):
    return [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("name", ["llama3.1-rope-llama3", "mistral-window", "qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_rows_give_each_document_its_own_logits(name, flash_kwargs, tmp_path):
    hf_checkpoint(name, tmp_path, seed=3)
    model = _xorl(name, tmp_path).eval()
    ref = _load(name, tmp_path, attn_implementation="eager").eval()
    docs = _documents(torch.Generator().manual_seed(4), [7, 13, 1, 10])
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    if flash_kwargs:
        assert "cu_seq_lens_q" in batch
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = torch.cat([ref(d[None]).logits[0] for d in docs])
    assert rel_err(packed, alone) <= TOL


@pytest.mark.parametrize("name", ["llama3.1-rope-llama3", "qwen2", "gpt_oss", "deepseek_v2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_its_unpadded_logits(name, side, tmp_path):
    hf_checkpoint(name, tmp_path, seed=5)
    model, ref = _xorl(name, tmp_path).eval(), _load(name, tmp_path, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(6)
    lengths, width = [9, 14, 5], 14
    docs = _documents(gen, lengths)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        cols = slice(width - len(d), width) if side == "left" else slice(0, len(d))
        ids[i, cols], mask[i, cols] = d, 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        for i, d in enumerate(docs):
            cols = slice(width - len(d), width) if side == "left" else slice(0, len(d))
            positions = torch.arange(len(d))[None]
            alone = ref(d[None], position_ids=positions).logits[0]
            assert rel_err(out[i, cols], alone) <= TOL, (i, side)


@pytest.mark.parametrize("name", ["llama3.1-rope-llama3", "qwen3_moe", "gpt_oss"])
def test_generation_with_a_kv_cache_gives_the_eager_tokens(name, tmp_path):
    hf_checkpoint(name, tmp_path, seed=7)
    ours, ref = _xorl(name, tmp_path).eval(), _load(name, tmp_path, attn_implementation="eager").eval()
    prompt = torch.randint(0, SMALL["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert ours.generate(prompt, **kw).tolist() == ref.generate(prompt, **kw).tolist()
        step = ours(prompt, use_cache=True)
        nxt = step.logits[:, -1:].argmax(-1)
        cached = ours(nxt, cache=step.past_key_values).logits
        full = ref(torch.cat([prompt, nxt], 1)).logits[:, -1:]
    assert rel_err(cached, full) <= TOL


def test_what_xorl_cannot_honour_is_refused_by_name(tmp_path):
    hf_checkpoint("llama3.1-rope-llama3", tmp_path, seed=9)
    model = _load("llama3.1-rope-llama3", tmp_path, attn_implementation="xorl", attention_dropout=0.1).train()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 8))
    with pytest.raises(xorl.hf.XorlAttentionError, match="attention dropout 0.1.*attention_dropout to 0.0"):
        model(ids)
    model.eval()
    model(ids)  # no dropout in eval: computed
    custom = torch.zeros(1, 1, 8, 8)
    with pytest.raises(xorl.hf.XorlAttentionError, match="4-D attention mask"):
        model(ids, attention_mask=custom)
    with pytest.raises(xorl.hf.XorlAttentionError, match="output_attentions"):
        model(ids, output_attentions=True)


def test_importing_xorl_hf_registers_its_names_and_replaces_nothing():
    probe = """
import json, transformers
from transformers import AttentionInterface
from transformers.integrations.moe import ExpertsInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.distributed import expert_parallel as ep, tensor_parallel as tp
from transformers.distributed.expert_parallel import EPImplementationInterface
from transformers.distributed.parallel_utils import ParallelInterface
from transformers.models.llama import modeling_llama as ml
from transformers.models.qwen3_moe import modeling_qwen3_moe as mq
def snap():
    maps = {n: {k: id(v) for k, v in c._global_mapping.items()}
            for n, c in (("attn", AttentionInterface), ("experts", ExpertsInterface), ("mask", AttentionMaskInterface),
                         ("ep", EPImplementationInterface), ("styles", ParallelInterface))}
    mods = (ml, mq, ep, tp)
    classes = {f"{m.__name__}.{k}": {a: id(v) for a, v in vars(c).items()} for m in mods
               for k, c in vars(m).items() if isinstance(c, type) and c.__module__ == m.__name__}
    funcs = {f"{m.__name__}.{k}": id(v) for m in mods for k, v in vars(m).items() if callable(v)}
    return maps, classes, funcs
before = snap()
import xorl.hf
after = snap()
print(json.dumps([before, after]))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    (maps0, classes0, funcs0), (maps1, classes1, funcs1) = json.loads(out.stdout.strip().splitlines()[-1])
    assert classes1 == classes0 and funcs1 == funcs0
    added = {"attn": {"xorl"}, "experts": {"xorl"}, "mask": {"xorl"}, "ep": {"xorl"},
             "styles": {"xorl_colwise", "xorl_rowwise"}}
    for kind, names in added.items():
        assert set(maps1[kind]) - set(maps0[kind]) == names
        assert {k: v for k, v in maps1[kind].items() if k not in names} == maps0[kind]
