"""Fine-tuning on chat data: the trainer's loss is over exactly the assistant tokens (against a float64
reference written here), masked tokens change no gradient, the validation loss is the same on every
layout as in one process, and an evaluation changes no training state."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.chat_data import conversations, make_chat_tokenizer, reference_encoder, write_jsonl
from tests.support.parity_runs import max_rel_diff, weights_rel_diff
from tests.support.sft_runs import chat_config, train_with_eval
from xorl.data.packing import IGNORE_INDEX


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = make_chat_tokenizer(root / "tok")
    # Two turns each, with a system prompt on some: several masked spans per conversation.
    chats = conversations(300, seed=0, turns=1)
    for i in range(0, len(chats), 3):
        chats[i] = [{"role": "system", "content": "add"}] + chats[i]
    train = write_jsonl(root / "train.jsonl", [{"messages": m} for m in chats])
    evals = write_jsonl(root / "eval.jsonl", [{"messages": m} for m in conversations(10, seed=99, turns=2)])
    return {"tok": tok, "train": train, "eval": evals, "root": root}


def _reference_loss(config, chats: list[list[dict]]) -> float:
    """Sum of float64 cross-entropies over the assistant tokens of each conversation (run alone, not
    packed; the mask from the ChatML rule written out here) / their number."""
    from tests.multirank.test_sharded_start import initial_state_dict
    from xorl.models.registry import build_model

    encode, special = reference_encoder()
    model = build_model(config.model)
    model.load_state_dict(initial_state_dict(config))
    model = model.double()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for messages in chats:
        ids, trained = [], []
        for m in messages:
            head = [special["<|im_start|>"]] + encode(f"{m['role']}\n")
            body = encode(m["content"]) + [special["<|im_end|>"]] + encode("\n")
            ids += head + body
            trained += [False] * len(head) + [m["role"] == "assistant"] * len(body)
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x, position_ids=torch.arange(len(ids))[None]).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(len(ids) - 1):
            if trained[t + 1]:  # position t predicts token t + 1
                total -= logp[t, ids[t + 1]]
                count += 1
    return float(total / count)


def test_chat_loss_is_the_float64_loss_over_exactly_the_assistant_tokens(gloo_world, tmp_path):
    tok = make_chat_tokenizer(tmp_path / "tok")
    chats = conversations(3, seed=7, turns=2) + [[{"role": "system", "content": "sum"}] + conversations(1, 8)[0]]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    # packing off and 4 sequences a step: step 1 is exactly these four conversations, before any update
    config = chat_config(str(tmp_path / "out"), tok, data, max_steps=1, gradient_accumulation_steps=4)
    config.data.packing = False
    config.model.fused_loss = True  # the fused linear cross-entropy path (the default)
    got = gloo_world(1).run(train_with_eval, config)[0]
    ref = _reference_loss(config, chats)
    assert abs(got["losses"][0] - ref) <= 1e-6 * ref, (got["losses"][0], ref)
    config.model.fused_loss = False  # the plain logits path
    config.train.output_dir = str(tmp_path / "out-unfused")
    got = gloo_world(1).run(train_with_eval, config)[0]
    assert abs(got["losses"][0] - ref) <= 1e-6 * ref, (got["losses"][0], ref)


def _gradients(config, rows: list[dict]) -> dict[str, torch.Tensor]:
    """One process's gradients of the token-weighted loss on one microbatch of ``rows`` (the trainer's maths)."""
    from tests.multirank.test_sharded_start import initial_state_dict
    from xorl.data.loader import PackedDataset
    from xorl.data.packing import collate
    from xorl.models.registry import build_model

    path = write_jsonl(config.train.output_dir + ".jsonl", rows)
    config.data.dataset = path
    ds = PackedDataset(config.data, vocab_size=config.model.vocab_size)
    mb = collate(ds.sequences)
    model = build_model(config.model)
    model.load_state_dict(initial_state_dict(config))
    out = model(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                max_seqlen=mb["max_seqlen"], labels=mb["labels"])
    (out.loss_sum / (mb["labels"] != IGNORE_INDEX).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_changed_masked_tokens_leave_the_gradients_unchanged(tmp_path, train_on):
    """A user turn after the last reply is masked and, being last, is no context of any trained token:
    rewriting it (other words, another length) must not move a gradient. With train_on: all it is
    trained on, and the gradients move (the check can fail)."""
    tok = make_chat_tokenizer(tmp_path / "tok")
    chats = conversations(4, seed=5)
    one = [{"messages": m + [{"role": "user", "content": "thanks"}]} for m in chats]
    two = [{"messages": m + [{"role": "user", "content": f"and {i} more, please?"}]} for i, m in enumerate(chats)]
    config = chat_config(str(tmp_path / "out"), tok, "unused")
    config.data.train_on, config.data.packing = train_on, False
    a, b = _gradients(config, one), _gradients(config, two)
    diff = max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)
    if train_on == "assistant":
        assert diff <= 1e-6, diff
    else:
        assert diff > 1e-3, diff


# -- validation ----------------------------------------------------------------------------------------
EVAL_LAYOUTS = [
    ("fsdp2", 2, "llama", dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)),
    ("tp2", 2, "llama", dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True,
                             gradient_accumulation_steps=4)),
    ("ring2", 2, "llama", dict(data_parallel_shard_size=1, ringattn_parallel_size=2, gradient_accumulation_steps=4)),
    ("pp2", 2, "llama", dict(data_parallel_shard_size=1, pipeline_parallel_size=2, gradient_accumulation_steps=4)),
    ("moe ep2", 2, "qwen3_moe", dict(data_parallel_shard_size=2, expert_parallel_size=2,
                                     gradient_accumulation_steps=2)),
]


@pytest.fixture(scope="module")
def eval_reference(gloo_world, chat_files):
    """model type -> the one-process run (eval before training, after steps 2 and 4), computed once."""
    cache = {}

    def get(model: str) -> dict:
        if model not in cache:
            config = chat_config(str(chat_files["root"] / f"ref-{model}"), chat_files["tok"], chat_files["train"],
                                 model=model, eval_dataset=chat_files["eval"], eval_steps=2, max_steps=4,
                                 gradient_accumulation_steps=4)
            cache[model] = gloo_world(1).run(train_with_eval, config)[0]
        return cache[model]

    return get


def _eval_losses(result) -> list[float]:
    return [result["eval_before"]["eval_loss"]] + [r["eval_loss"] for r in result["rows"] if "eval_loss" in r]


@pytest.mark.parametrize("name,world_size,model,train", EVAL_LAYOUTS, ids=[x[0] for x in EVAL_LAYOUTS])
def test_eval_loss_is_the_same_on_every_layout(name, world_size, model, train, gloo_world, chat_files, eval_reference,
                                               tmp_path):
    config = chat_config(str(tmp_path / "out"), chat_files["tok"], chat_files["train"], model=model,
                         eval_dataset=chat_files["eval"], eval_steps=2, max_steps=4, **train)
    got = gloo_world(world_size).run(train_with_eval, config, timeout_s=600)[0]
    reference = eval_reference(model)
    ref = _eval_losses(reference)
    assert len(ref) == 3 and ref[-1] < ref[0]  # before training, after steps 2 and 4; it learns
    assert max_rel_diff(_eval_losses(got)[:1], ref[:1]) <= 1e-6, (_eval_losses(got), ref)  # the same weights
    assert max_rel_diff(_eval_losses(got), ref) <= 1e-6, (_eval_losses(got), ref)
    assert max_rel_diff(got["losses"], reference["losses"]) <= 1e-5
    row = next(r for r in got["rows"] if "eval_loss" in r)
    assert abs(row["eval_ppl"] - math.exp(row["eval_loss"])) <= 1e-12 * row["eval_ppl"]


NO_STATE_CHANGE = [
    ("one process", 1, "llama", dict(gradient_accumulation_steps=4), {}),
    ("pp2", 2, "llama", EVAL_LAYOUTS[3][3], {}),
    ("pp2 interleaved", 2, "llama", dict(EVAL_LAYOUTS[3][3], pipeline_parallel_schedule="Interleaved1F1B",
                                          virtual_pipeline_stages=2), {}),
    # the routers' selection bias moves by the load the training forwards saw, not the eval's
    ("moe expert bias, one process", 1, "qwen3_moe", dict(gradient_accumulation_steps=4),
     dict(router_expert_bias=True, router_bias_update_rate=0.001)),
]


@pytest.mark.parametrize("name,world_size,model,train,model_options", NO_STATE_CHANGE,
                         ids=[x[0] for x in NO_STATE_CHANGE])
def test_an_evaluation_changes_no_training_state(name, world_size, model, train, model_options, gloo_world,
                                                 chat_files, tmp_path):
    """Evaluating after every step: the losses, gradient norms and final weights are bitwise those of the
    run that never evaluates."""
    with_eval = chat_config(str(tmp_path / "eval"), chat_files["tok"], chat_files["train"], model=model,
                            eval_dataset=chat_files["eval"], eval_steps=1, max_steps=3, **train)
    without = chat_config(str(tmp_path / "plain"), chat_files["tok"], chat_files["train"], model=model, max_steps=3,
                          **train)
    for config in (with_eval, without):
        for key, value in model_options.items():
            setattr(config.model, key, value)
    a = gloo_world(world_size).run(train_with_eval, with_eval, timeout_s=600)[0]
    b = gloo_world(world_size).run(train_with_eval, without, timeout_s=600)[0]
    assert sum("eval_loss" in r for r in a["rows"]) == 3 and not any("eval_loss" in r for r in b["rows"])
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"])
    assert weights_rel_diff(a["weights"], b["weights"]) == 0.0


@pytest.mark.parametrize("streaming", [False, True], ids=["in memory", "streamed"])
def test_a_chat_run_from_a_saved_dataset_resumes_exactly(streaming, gloo_world, chat_files, tmp_path):
    """A save_to_disk folder of chat rows (datasets; an IterableDataset when streamed): 4 steps at once,
    or 2 steps, stop, resume from the checkpoint: the same losses."""
    datasets = pytest.importorskip("datasets")
    import json as _json

    from tests.support.parity_runs import train_losses

    with open(chat_files["train"]) as f:
        rows = [_json.loads(line) for line in f]
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_list(rows).save_to_disk(saved)

    def config(out, **train):
        c = chat_config(str(tmp_path / out), chat_files["tok"], saved, max_steps=4, gradient_accumulation_steps=4,
                        **train)
        c.data.streaming = streaming
        return c

    whole = gloo_world(1).run(train_losses, config("whole"))[0]
    first = gloo_world(1).run(train_losses, config("stopped", save_steps=2), 2)[0]
    rest = gloo_world(1).run(train_losses, config("stopped", resume=True))[0]
    assert len(first) == 2 and len(rest) == 2 and whole[-1] < whole[0]
    assert first + rest == whole
