"""xorl.models.hf_reader / hf_writer / hf_layout: HF-format safetensors load/save (shards, index, name
and layout conversions, errors), without transformers: the files are inspected directly and loads
are compared bitwise."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.support.moe_reference import ReferenceMoE
from xorl.models import build_model, load_hf_weights, save_hf_weights
from xorl.nn.moe_experts import GroupedExperts


def model_config(model_type: str, **overrides):
    fields = dict(
        model_type=model_type,
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=None,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
        num_experts=4 if model_type == "qwen3_moe" else 0,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        router_z_loss_coef=0.0,
        router_scoring="softmax",
        shared_expert_intermediate_size=0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        merge_qkv=False,
        model_path=None,
        attn_implementation="sdpa",
        initializer_range=0.3,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def fresh_model(config, seed: int):
    torch.manual_seed(seed)
    return build_model(config).eval()


def file_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize(
    "model_type, overrides",
    [("llama", {"merge_qkv": True, "merge_gate_up": True, "tie_word_embeddings": True, "attention_bias": True}),
     ("qwen3_moe", {})],
)
def test_sharded_save_has_hf_layout_and_loads_back_exactly(model_type, overrides, tmp_path):
    config = model_config(model_type, **overrides)
    source = fresh_model(config, seed=0)
    save_hf_weights(source, str(tmp_path), config, max_shard_bytes=8_000)

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2 and shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == shard_files
    tensors = file_tensors(tmp_path)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for file in shard_files:  # no shard is over the limit unless it holds a single tensor
        with safe_open(tmp_path / file, framework="pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 8_000 or len(sizes) == 1

    state = source.state_dict()
    assert not any("qkv_proj" in k for k in tensors)
    assert ("lm_head.weight" in tensors) == (not config.tie_word_embeddings)
    if config.merge_qkv:
        # qkv_proj rows by KV-head group: 2 groups of [2 query heads, 1 key head, 1 value head] x head_dim 8.
        qkv = state["model.layers.1.self_attn.qkv_proj.weight"].view(2, 4, 8, 32)
        assert torch.equal(tensors["model.layers.1.self_attn.q_proj.weight"], qkv[:, :2].reshape(32, 32))
        assert torch.equal(tensors["model.layers.1.self_attn.k_proj.weight"], qkv[:, 2].reshape(16, 32))
        assert torch.equal(tensors["model.layers.1.self_attn.v_proj.weight"], qkv[:, 3].reshape(16, 32))
        qkv_bias = state["model.layers.1.self_attn.qkv_proj.bias"].view(2, 4, 8)
        assert torch.equal(tensors["model.layers.1.self_attn.v_proj.bias"], qkv_bias[:, 3].reshape(16))
    if getattr(config, "merge_gate_up", False):  # rows alternate gate and up
        gate_up = state["model.layers.1.mlp.gate_up_proj.weight"]
        assert gate_up.shape == (80, 32)
        assert torch.equal(tensors["model.layers.1.mlp.gate_proj.weight"], gate_up[0::2])
        assert torch.equal(tensors["model.layers.1.mlp.up_proj.weight"], gate_up[1::2])
    if model_type == "qwen3_moe":
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in tensors)
        for j in range(4):
            gate = tensors[f"model.layers.1.mlp.experts.{j}.gate_proj.weight"]
            up = tensors[f"model.layers.1.mlp.experts.{j}.up_proj.weight"]
            down = tensors[f"model.layers.1.mlp.experts.{j}.down_proj.weight"]
            assert gate.shape == up.shape == (24, 32) and down.shape == (32, 24)  # HF Linear [out, in]
            gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][j]  # [H, 2I]: gate columns, then up
            assert torch.equal(gate, gate_up[:, :24].t()) and torch.equal(up, gate_up[:, 24:].t())
            assert torch.equal(down, state["model.layers.1.mlp.experts.down_proj"][j].t())

    hf_config = json.loads((tmp_path / "config.json").read_text())
    expected_arch = "LlamaForCausalLM" if model_type == "llama" else "Qwen3MoeForCausalLM"
    assert hf_config["architectures"] == [expected_arch] and hf_config["dtype"] == "float32"

    target = fresh_model(config, seed=1)
    assert not torch.equal(target.model.embed_tokens.weight, source.model.embed_tokens.weight)
    load_hf_weights(target, str(tmp_path))
    assert_same_state(target, source)
    if config.tie_word_embeddings:
        assert target.lm_head.weight is target.model.embed_tokens.weight


def test_merge_qkv_loads_from_separate_projections(tmp_path):
    separate = model_config("qwen3_moe")
    source = fresh_model(separate, seed=2)
    save_hf_weights(source, str(tmp_path), separate)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "model.safetensors.index.json").exists()
    merged = fresh_model(model_config("qwen3_moe", merge_qkv=True), seed=3)
    load_hf_weights(merged, str(tmp_path))
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)


def test_loads_transformers_v5_fused_expert_layout(tmp_path):
    """transformers v5 keeps experts in memory as gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    config = model_config("qwen3_moe")
    source = fresh_model(config, seed=4)
    fused = {}
    for name, tensor in source.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> [E, out, in]
            fused[name] = tensor.transpose(1, 2)
        else:
            fused[name] = tensor
    save_file({k: v.contiguous() for k, v in fused.items()}, str(tmp_path / "model.safetensors"))
    target = fresh_model(config, seed=5)
    load_hf_weights(target, str(tmp_path))
    assert_same_state(target, source)


def _rewrite(folder, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_mismatches_are_errors_that_name_the_keys(tmp_path):
    config = model_config("qwen3_moe")
    model = fresh_model(config, seed=6)
    save_hf_weights(model, str(tmp_path), config)

    _rewrite(tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"1 missing keys \['model.layers.0.self_attn.k_norm.weight'\]"):
        load_hf_weights(model, str(tmp_path))

    save_hf_weights(model, str(tmp_path), config)
    _rewrite(tmp_path, lambda t: t.update({"model.extra.weight": torch.randn(3)}))
    with pytest.raises(ValueError, match=r"1 unexpected keys \['model.extra.weight'\]"):
        load_hf_weights(model, str(tmp_path))

    save_hf_weights(model, str(tmp_path), config)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.2.up_proj.weight"):
        load_hf_weights(model, str(tmp_path))

    save_hf_weights(model, str(tmp_path), config)
    _rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.randn(31)}))
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint \(31,\) vs model \(32,\)"):
        load_hf_weights(model, str(tmp_path))

    with torch.device("meta"):
        meta_model = build_model(config)
    save_hf_weights(model, str(tmp_path), config)
    with pytest.raises(ValueError, match="meta device"):
        load_hf_weights(meta_model, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_weights(model, str(tmp_path / "empty"))


def test_save_in_bf16_and_replace_a_previous_sharded_save(tmp_path):
    config = model_config("llama")
    model = fresh_model(config, seed=7)
    save_hf_weights(model, str(tmp_path), config, max_shard_bytes=10_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_hf_weights(model, str(tmp_path), config, dtype=torch.bfloat16)
    files = sorted(f for f in os.listdir(tmp_path) if "safetensors" in f)
    assert files == ["model.safetensors"]  # the old shards and index are gone
    tensors = file_tensors(tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    target = fresh_model(config, seed=8)
    load_hf_weights(target, str(tmp_path))
    for name, ref in model.state_dict().items():
        got = target.state_dict()[name]
        assert got.dtype == torch.float32
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, name


class _ExpertParallelStandIn(ReferenceMoE):
    """Full router, experts [2, 4) of 4: like xorl.nn.MoE on EP rank 1 of 2 (``local_expert_range``)."""

    local_expert_range = (2, 4)

    def __init__(self):
        super().__init__(hidden_size=32, num_experts=4, top_k=1, intermediate_size=24)
        self.experts = GroupedExperts(2, 32, 24)


def test_expert_parallel_block_gets_its_slice(tmp_path):
    config = model_config("qwen3_moe")
    full = fresh_model(config, seed=9)
    save_hf_weights(full, str(tmp_path), config)
    target = fresh_model(config, seed=10)
    target.model.layers[1].mlp = _ExpertParallelStandIn()
    load_hf_weights(target, str(tmp_path))
    for proj in ("gate_up_proj", "down_proj"):
        expected = getattr(full.model.layers[1].mlp.experts, proj)[2:4]
        assert torch.equal(getattr(target.model.layers[1].mlp.experts, proj), expected), proj
    assert torch.equal(target.model.layers[1].mlp.gate.weight, full.model.layers[1].mlp.gate.weight)


def _fsdp_load_and_save(folder: str, out_folder: str) -> list[str]:
    """On every rank: FSDP2-shard a model, load the HF folder into it, save it again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    config = model_config("qwen3_moe", merge_qkv=True)
    torch.manual_seed(100 + dist.get_rank())  # different initial weights per rank: the load must win
    model = build_model(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, DTensor)
    load_hf_weights(model, folder)
    save_hf_weights(model, out_folder, config)
    dist.barrier()
    return sorted(os.listdir(out_folder))


def test_fsdp2_sharded_model_loads_and_saves(gloo_world, tmp_path):
    config = model_config("qwen3_moe", merge_qkv=True)
    source = fresh_model(config, seed=11)
    save_hf_weights(source, str(tmp_path / "in"), config)
    gloo_world(2).run(_fsdp_load_and_save, str(tmp_path / "in"), str(tmp_path / "out"))
    saved, original = file_tensors(tmp_path / "out"), file_tensors(tmp_path / "in")
    assert saved.keys() == original.keys()
    for name in saved:
        assert torch.equal(saved[name], original[name]), name


def test_a_box_of_gate_up_reads_only_its_gate_and_up_columns():
    """A rank's box of experts.gate_up_proj [E, H, 2I] may hold gate columns, up columns or both."""
    from xorl.distributed.shard_box import ShardBox
    from xorl.models.hf_layout import _StackGateUp

    experts, hidden, inter = 3, 5, 4
    gen = torch.Generator().manual_seed(7)
    files = {f"e.{j}.{p}.weight": torch.randn(inter, hidden, generator=gen)
             for j in range(experts) for p in ("gate_proj", "up_proj")}
    reads = []

    class Reader:
        def shape(self, key):
            return tuple(files[key].shape)

        def __call__(self, key, index):
            reads.append(key)
            return files[key][index]

    recipe = _StackGateUp([f"e.{j}.gate_proj.weight" for j in range(experts)],
                          [f"e.{j}.up_proj.weight" for j in range(experts)])
    full = torch.stack([torch.cat([files[f"e.{j}.gate_proj.weight"].t(), files[f"e.{j}.up_proj.weight"].t()], 1)
                        for j in range(experts)])
    assert recipe.shape({k: v.shape for k, v in files.items()}) == full.shape
    for offset, shape in (((1, 0, 2), (2, 5, 4)), ((0, 1, 0), (1, 3, 3)), ((2, 2, 5), (1, 3, 3))):
        reads.clear()
        box = ShardBox(tuple(full.shape), offset, shape)
        dest = torch.empty(shape)
        recipe.fill(Reader(), dest, box)
        assert torch.equal(dest, full[box.slices]), (offset, shape)
        touched = {k.split(".")[2] for k in reads}
        assert touched == ({"gate_proj"} if offset[2] + shape[2] <= inter else {"up_proj"} if offset[2] >= inter
                           else {"gate_proj", "up_proj"})


def test_a_box_of_interleaved_gate_up_rows_reads_only_its_rows():
    """merge_gate_up: any row range of gate_up_proj [2I, H] (an FSDP or TP box) from gate and up."""
    from xorl.distributed.shard_box import ShardBox
    from xorl.models.hf_layout import _InterleavedRows

    gen = torch.Generator().manual_seed(8)
    files = {f"m.{x}_proj.weight": torch.randn(5, 3, generator=gen) for x in ("gate", "up")}

    class Reader:
        def shape(self, key):
            return tuple(files[key].shape)

        def __call__(self, key, index):
            return files[key][index]

    recipe = _InterleavedRows(["m.gate_proj.weight", "m.up_proj.weight"])
    full = torch.stack([files["m.gate_proj.weight"], files["m.up_proj.weight"]], dim=1).reshape(10, 3)
    assert recipe.shape({k: v.shape for k, v in files.items()}) == (10, 3)
    for first, last in ((0, 10), (3, 8), (4, 5), (1, 2), (7, 10)):
        box = ShardBox((10, 3), (first, 0), (last - first, 3))
        dest = torch.full((last - first, 3), float("nan"))
        recipe.fill(Reader(), dest, box)
        assert torch.equal(dest, full[first:last]), (first, last)
