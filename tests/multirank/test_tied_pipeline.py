"""Tied embeddings under pipeline parallelism (the parity rows are in test_parity_matrix.py).

A tied Llama (3.2 1B / 3B style) trained on 2 pipeline stages: its checkpoint resumes in one process
and continues as one process's own run does, and its HF export, loaded by transformers'
LlamaForCausalLM (tie_word_embeddings=True), gives the trained model's logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.support.parity_runs import max_rel_diff, tiny_config, train_and_report, weights_rel_diff
from xorl.checkpoint.hf_export import full_state_dict

STEPS = 4


def train_export_and_report(config, folder: str) -> dict:
    """Train, export to ``folder``; rank 0 returns the losses, grad norms and final full weights."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    results = trainer.train()
    trainer.export_hf(folder)
    full = full_state_dict(trainer.parts, trainer.state.pp_group)
    if dist.get_rank() != 0:
        return {}
    return {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "weights": {k: v.detach().cpu().clone() for k, v in full.items()}}


@pytest.fixture(scope="module")
def runs(gloo_world, tmp_path_factory):
    """One process and pp2 x fsdp2, tied, STEPS steps with a checkpoint every 2; pp2 also exported."""
    one = str(tmp_path_factory.mktemp("one"))
    ref = gloo_world(1).run(train_and_report, tiny_config(one, "llama-tied", max_steps=STEPS, save_steps=2,
                                                          gradient_accumulation_steps=4))[0]
    pp = str(tmp_path_factory.mktemp("pp"))
    config = tiny_config(pp, "llama-tied", max_steps=STEPS, save_steps=2, gradient_accumulation_steps=2,
                         pipeline_parallel_size=2, data_parallel_shard_size=2)
    got = gloo_world(4).run(train_export_and_report, config, os.path.join(pp, "hf"), timeout_s=900)[0]
    return {"ref": ref, "pp": got, "pp_dir": pp, "one_dir": one}


def test_pp_run_matches_one_process_and_keeps_the_copies_equal(runs):
    ref, got = runs["ref"], runs["pp"]
    assert ref["losses"][-1] < ref["losses"][0]
    assert max_rel_diff(got["losses"], ref["losses"]) <= 1e-5
    assert max_rel_diff(got["grad_norms"][:1], ref["grad_norms"][:1]) <= 1e-6  # the weight counted once
    assert max_rel_diff(got["grad_norms"], ref["grad_norms"]) <= 1e-4
    assert weights_rel_diff(got["weights"], ref["weights"]) <= 1e-5
    # The last stage's lm_head and the first stage's embedding took the same updates.
    assert torch.equal(got["weights"]["lm_head.weight"], got["weights"]["model.embed_tokens.weight"])


def test_pp_checkpoint_resumes_in_one_process(runs, gloo_world, tmp_path):
    checkpoint = os.path.join(runs["pp_dir"], "checkpoints", "step_00000002")
    config = tiny_config(str(tmp_path), "llama-tied", max_steps=STEPS, gradient_accumulation_steps=4,
                         resume=checkpoint)
    resumed = gloo_world(1).run(train_and_report, config)[0]
    ref = runs["ref"]
    assert len(resumed["losses"]) == STEPS - 2
    assert max_rel_diff(resumed["losses"], ref["losses"][2:]) <= 1e-5, (resumed["losses"], ref["losses"])
    assert weights_rel_diff(resumed["weights"], ref["weights"]) <= 1e-5


def test_pp_export_loads_tied_in_transformers_with_the_same_logits(runs):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from xorl.models import build_model

    folder = os.path.join(runs["pp_dir"], "hf")
    assert json.load(open(os.path.join(folder, "config.json")))["tie_word_embeddings"] is True
    written = {k for f in os.listdir(folder) if f.endswith(".safetensors")
               for k in load_file(os.path.join(folder, f))}
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written  # saved once
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    # The trained model in one process, from the weights the pp2 run holds (not through the export).
    ours = build_model(tiny_config("", "llama-tied").model)
    ours.load_state_dict(runs["pp"]["weights"])
    ids = torch.randint(0, ours.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ours(ids).logits.double()
        logits = hf(ids).logits.double()
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("layout", ["pp2 x fsdp2", pytest.param("zbv pp2", marks=pytest.mark.zero_bubble)])
def test_one_process_checkpoint_resumes_on_pp(layout, runs, gloo_world, tmp_path):
    """The other way: one process's tied checkpoint (one optimizer state for the weight) into pp2 x
    fsdp2, and into ZBV, whose rank 0 holds both copies (each with its own optimizer state)."""
    checkpoint = os.path.join(runs["one_dir"], "checkpoints", "step_00000002")
    train = (dict(pipeline_parallel_size=2, data_parallel_shard_size=2, gradient_accumulation_steps=2)
             if layout == "pp2 x fsdp2" else
             dict(pipeline_parallel_size=2, data_parallel_shard_size=1, gradient_accumulation_steps=4,
                  pipeline_parallel_schedule="ZBVZeroBubble", virtual_pipeline_stages=2))
    config = tiny_config(str(tmp_path), "llama-tied", max_steps=STEPS, resume=checkpoint, **train)
    world = 4 if layout == "pp2 x fsdp2" else 2
    resumed = gloo_world(world).run(train_and_report, config, timeout_s=900)[0]
    ref = runs["ref"]
    assert max_rel_diff(resumed["losses"], ref["losses"][2:]) <= 1e-5, (resumed["losses"], ref["losses"])
    assert weights_rel_diff(resumed["weights"], ref["weights"]) <= 1e-5


def test_pp_starts_from_a_tied_hf_folder_with_both_copies_equal(runs, gloo_world, tmp_path):
    """model_path: a tied HF folder (no lm_head.weight in it) loads on pp2 x fsdp2, the last stage's
    lm_head filled from the folder's embedding; the whole model is the folder's."""
    from safetensors.torch import load_file

    from tests.support.parity_runs import initial_weights

    folder = os.path.join(runs["pp_dir"], "hf")
    config = tiny_config(str(tmp_path), "llama-tied", gradient_accumulation_steps=2, pipeline_parallel_size=2,
                         data_parallel_shard_size=2)
    config.model.model_path = folder
    start = gloo_world(4).run(initial_weights, config, timeout_s=900)[0]
    embedding = load_file(os.path.join(folder, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(start["lm_head.weight"], embedding) and torch.equal(start["model.embed_tokens.weight"],
                                                                           embedding)
    assert weights_rel_diff(start, runs["pp"]["weights"]) == 0.0
