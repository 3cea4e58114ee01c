"""The fused linear cross-entropy in a stock transformers causal LM (xorl.hf.apply(loss=True); xorl/hf/loss.py)
against the same model's stock loss (transformers' ForCausalLMLoss on its logits), fp32, fresh random
inputs: 4 gradient-accumulation micro-batches with ``num_items_in_batch`` (as HF Trainer counts and
passes it) give the stock losses to 1e-6 and its gradients, for a trainable, tied or frozen lm_head and
a peft LoRA one; HF Trainer itself, accumulating 4 micro-batches, logs the stock losses and ends at the
stock weights; the logits, never formed by the training forward, are the stock ones when read; the
step's peak memory at 4096 tokens x vocab 32K (the CPU allocator, through torch's profiler) is at most
1/8 of the stock step's."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import xorl.hf  # noqa: E402
import xorl.hf.loss as hf_loss  # noqa: E402
from tests.unit.hf.test_stock_models import _Counted  # noqa: E402
from tests.unit.models.test_families import SMALL, randomize_, rel_err  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-6, 1e-6
LOSS_ONLY = dict(norm=False, rope=False, mlp=False, loss=True)


def _llama(seed: int = 0, **fields):
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 2, **fields}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    randomize_(model, seed)
    return model


def _micro_batches(seed: int, count: int = 4, rows: int = 2, width: int = 20):
    """``count`` micro-batches with different numbers of labelled tokens, and HF Trainer's
    num_items_in_batch for the step: the labelled tokens after the causal shift, over all of them."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(count):
        ids = torch.randint(0, SMALL["vocab_size"], (rows, width), generator=gen)
        labels = ids.clone()
        labels[torch.rand(rows, width, generator=gen) < 0.15 + 0.2 * i] = -100
        batches.append((ids, labels))
    return batches, sum((labels[..., 1:] != -100).sum() for _, labels in batches)


def _accumulate(model, batches, num_items):
    model.train()
    losses = []
    for ids, labels in batches:
        loss = model(ids, labels=labels, num_items_in_batch=num_items).loss
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ours, ref):
    (losses, grads), (ref_losses, ref_grads) = ours, ref
    assert rel_err(losses, ref_losses) <= LOSS_TOL and rel_err(losses.sum(), ref_losses.sum()) <= LOSS_TOL
    assert grads.keys() == ref_grads.keys()
    worst = max((rel_err(grads[n], g), n) for n, g in ref_grads.items())
    assert worst[0] <= GRAD_TOL, worst


@pytest.mark.parametrize("head", ["trainable", "tied", "frozen"])
def test_four_accumulation_steps_with_num_items_in_batch_give_the_stock_losses_and_gradients(head, monkeypatch):
    ref = _llama(1, tie_word_embeddings=head == "tied")
    if head == "frozen":
        ref.lm_head.weight.requires_grad_(False)
    ours = copy.deepcopy(ref)
    xorl.hf.apply(ours, **LOSS_ONLY)
    fused = _Counted(hf_loss.fused_linear_cross_entropy)
    monkeypatch.setattr(hf_loss, "fused_linear_cross_entropy", fused)
    batches, num_items = _micro_batches(2)
    result, expected = _accumulate(ours, batches, num_items), _accumulate(ref, batches, num_items)
    _assert_same(result, expected)
    assert fused.calls == len(batches)
    assert ("lm_head.weight" in result[1]) == (head == "trainable")

    # Without num_items_in_batch: the mean over each micro-batch's labelled tokens, as stock.
    ours.zero_grad(), ref.zero_grad()
    _assert_same(_accumulate(ours, batches[:2], None), _accumulate(ref, batches[:2], None))


def test_hf_trainer_with_gradient_accumulation_logs_the_stock_losses_and_ends_at_the_stock_weights(tmp_path):
    from transformers import Trainer, TrainingArguments

    batches, _ = _micro_batches(3, count=8, rows=1)
    rows = [{"input_ids": ids[0], "labels": labels[0]} for ids, labels in batches]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=4,
                             max_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    runs = {}
    for kind in ("stock", "xorl"):
        model = _llama(4)
        if kind == "xorl":
            xorl.hf.apply(model, **LOSS_ONLY)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs[kind] = (torch.tensor(losses), {n: p.detach().clone() for n, p in model.named_parameters()})
    (losses, params), (ref_losses, ref_params) = runs["xorl"], runs["stock"]
    assert len(losses) == 2 and rel_err(losses, ref_losses) <= LOSS_TOL
    assert max(rel_err(params[n], p) for n, p in ref_params.items()) <= LOSS_TOL
    start = _llama(4).state_dict()
    assert all(not torch.equal(start[n], p) for n, p in ref_params.items() if n in start)  # it trained


def _lora(model, dropout: float = 0.0):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], lora_dropout=dropout,
                             init_lora_weights=False)  # random A and B, so the adapters change the logits
    torch.manual_seed(5)
    return peft.get_peft_model(model, config)


def test_a_peft_lora_lm_head_gets_the_stock_gradients(monkeypatch):
    ref = _lora(_llama(6))
    ours = _lora(_llama(6))
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    patches = xorl.hf.apply(ours, **LOSS_ONLY)
    assert patches.applied["loss"] == ["lm_head"]
    fused = _Counted(hf_loss.fused_linear_cross_entropy)
    monkeypatch.setattr(hf_loss, "fused_linear_cross_entropy", fused)
    batches, num_items = _micro_batches(7, count=2)
    result, expected = _accumulate(ours, batches, num_items), _accumulate(ref, batches, num_items)
    _assert_same(result, expected)
    assert fused.calls == 2 and {n for n in result[1]} == {n for n, p in ref.named_parameters() if p.requires_grad}
    assert any("lm_head.lora_A" in n for n in result[1]) and any("lm_head.lora_B" in n for n in result[1])

    with pytest.raises(xorl.hf.XorlApplyError, match="LoRA dropout"):
        xorl.hf.apply(_lora(_llama(6), dropout=0.1), **LOSS_ONLY)


def test_the_logits_are_lazy_in_training_and_the_stock_ones_when_read():
    ref = _llama(8)
    ours = copy.deepcopy(ref)
    xorl.hf.apply(ours, **LOSS_ONLY)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(9))
    ref.train(), ours.train()
    out, ref_out = ours(ids, labels=ids), ref(ids, labels=ids)
    logits = out.logits
    assert type(logits) is hf_loss.LazyLogits
    assert logits.shape == ref_out.logits.shape and logits.dtype == ref_out.logits.dtype and logits.dim() == 3
    assert type(logits.float()) is hf_loss.LazyLogits and type(logits.to(torch.float64)) is hf_loss.LazyLogits
    # Read as a tensor: the head's own forward, with autograd to the hidden states and the weights.
    extra = logits.logsumexp(-1).mean()
    ref_extra = ref_out.logits.logsumexp(-1).mean()
    (out.loss + extra).backward()
    (ref_out.loss + ref_extra).backward()
    assert rel_err(extra, ref_extra) <= LOSS_TOL
    assert rel_err(logits.to(torch.float64)[0, 3], ref_out.logits.double()[0, 3]) <= GRAD_TOL
    worst = max(rel_err(p.grad, q.grad) for p, q in zip(ours.parameters(), ref.parameters()))
    assert worst <= GRAD_TOL
    # No labels, or eval: the head's logits as stock.
    assert type(ours(ids).logits) is torch.Tensor
    ours.eval()
    assert type(ours(ids, labels=ids).logits) is torch.Tensor


@pytest.mark.slow  # a 2 GB stock step, profiled twice; ~1 min of one core
def test_the_fused_step_peak_memory_at_4096_tokens_and_vocab_32k_is_at_most_an_eighth_of_stock():
    from xorl.planner.measure import profiled_peak

    def measure(model, ids):
        out = {}

        def step():
            loss = model(ids, labels=ids).loss
            loss.backward()
            out["loss"] = loss.detach()
            model.zero_grad(set_to_none=True)

        return profiled_peak(step), out["loss"]

    fields = dict(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, attn_implementation="sdpa")
    config = transformers.LlamaConfig(**{**SMALL, **fields})
    torch.manual_seed(10)
    ref = transformers.LlamaForCausalLM(config).train()
    ours = copy.deepcopy(ref)
    xorl.hf.apply(ours, **LOSS_ONLY)
    ids = torch.randint(0, fields["vocab_size"], (2, 2048), generator=torch.Generator().manual_seed(11))
    (peak, loss), (ref_peak, ref_loss) = measure(ours, ids), measure(ref, ids)
    logits_bytes = ids.numel() * fields["vocab_size"] * 4
    assert ref_peak >= logits_bytes  # the stock step holds [tokens, vocab] fp32 at least once
    assert peak * 8 <= ref_peak, (peak, ref_peak)
    assert rel_err(loss, ref_loss) <= LOSS_TOL
