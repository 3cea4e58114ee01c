"""xorl.hf.ContextParallel in a plain torch loop (no Trainer): each rank its own batch, the loss
normalised by the step's global token count (``count_label_tokens``) times the world size, the
gradients averaged over the ranks as DDP averages them. Against one process on the union of the
batches: the loss and every gradient within 1e-5 (fp32), for packed rows, padded rows and
plain rows; refusals by name (generation, 4-D masks, heads that do not divide over Ulysses); and
``handle.remove()`` gives the model back as it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from tests.unit.models.test_families import FAMILIES, SMALL, hf_checkpoint, rel_err  # noqa: E402

TOL = 1e-5


def _docs(seed, count):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 19, (count,), generator=gen).tolist()
    return [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in lengths]


def _batch(docs, form):
    if form == "packed":
        return transformers.DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], labels[i, : len(d)], mask[i, : len(d)] = d, d, 1
    if form == "padded":
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    same = [d[: min(len(x) for x in docs)] for d in docs]  # plain: equal rows, no mask
    stacked = torch.stack(same)
    return {"input_ids": stacked, "labels": stacked.clone()}


def _load(folder, name):
    import xorl.hf  # noqa: F401  (registers "xorl")

    cls = getattr(transformers, FAMILIES[name][0])
    return cls.from_pretrained(folder, attn_implementation="xorl", experts_implementation="xorl", dtype=torch.float32)


def _step(model, batch, world):
    from xorl.hf import count_label_tokens

    n = count_label_tokens(batch)
    loss = model(**batch, num_items_in_batch=n).loss * world
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            if world > 1:
                dist.all_reduce(g)
                g /= world
            grads[name] = g
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
        total /= world
    return total, grads


def _cp_run(folder, name, ring, ulysses, form, seed):
    import xorl.hf

    rank, world = dist.get_rank(), dist.get_world_size()
    all_docs = _docs(seed, 4 * world)
    mine = all_docs[4 * rank: 4 * rank + 4]
    model = _load(folder, name).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = xorl.hf.ContextParallel.from_sizes(ring=ring, ulysses=ulysses).apply(model)
    loss, grads = _step(model, _batch(mine, form), world)
    refusals = {}
    for what, call in (("cache", lambda: model(mine[0][None], past_key_values=object())),
                       ("4-D mask", lambda: model(mine[0][None], attention_mask=torch.ones(1, 1, 3, 3)))):
        try:
            call()
        except ValueError as e:
            refusals[what] = str(e)
    handle.remove()
    restored = model.config._attn_implementation == "xorl" and not model._forward_pre_hooks and all(
        torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return loss, grads, refusals, restored


@pytest.mark.parametrize("name,ring,ulysses,form", [
    ("llama3.1-rope-llama3", 2, 1, "packed"), ("llama3.1-rope-llama3", 1, 2, "padded"),
    ("qwen3_moe", 2, 2, "packed"), ("gpt_oss", 2, 1, "plain"),
])
def test_a_plain_loop_with_context_parallelism_equals_one_process(name, ring, ulysses, form, gloo_world, tmp_path):
    folder = str(tmp_path / name)
    hf_checkpoint(name, folder, seed=1)
    world = ring * ulysses
    results = gloo_world(world).run(_cp_run, folder, name, ring, ulysses, form, 5)
    model = _load(folder, name).train()
    docs = _docs(5, 4 * world)
    if form == "plain":  # each rank's rows were cut to its own shortest document
        docs = [d[: min(len(x) for x in docs[4 * r: 4 * r + 4])] for r in range(world) for d in docs[4 * r: 4 * r + 4]]
    # One process: every rank's documents, packed (each attends only to itself, as under CP).
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    ref_loss, ref_grads = _step(model, batch, 1)
    for loss, grads, refusals, restored in results:
        assert rel_err(loss, ref_loss) <= TOL
        assert grads.keys() == ref_grads.keys()
        worst = max((rel_err(grads[k], g), k) for k, g in ref_grads.items())
        assert worst[0] <= TOL, worst
        assert "KV cache" in refusals["cache"] and "4-D" in refusals["4-D mask"]
        assert restored


def _ulysses_refusal(folder):
    import xorl.hf

    model = _load(folder, "llama3.1-rope-llama3")
    try:
        xorl.hf.ContextParallel.from_sizes(ring=1, ulysses=4).apply(model)
    except ValueError as e:
        return str(e)
    return None


def test_heads_that_do_not_divide_over_ulysses_are_refused(gloo_world, tmp_path):
    folder = str(tmp_path / "llama")
    hf_checkpoint("llama3.1-rope-llama3", folder, seed=1)  # 6 heads
    for message in gloo_world(4).run(_ulysses_refusal, folder):
        assert message is not None and "6 attention heads do not split over 4 Ulysses ranks" in message
