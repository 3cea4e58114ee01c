"""A stock transformers Llama with xorl's attention and ``xorl.hf.apply`` (fused norms, RoPE, SwiGLU and
the fused loss), FSDP2 (``fully_shard`` per decoder layer, the lm_head in the root's group or a unit of
its own, then the root) on a 2-rank gloo world, trains 3 SGD steps to the losses and weights of one
process running the stock eager model on the whole batch: each rank holds half the rows, the loss is
divided by the step's global ``num_items_in_batch`` (as HF Trainer under data parallel counts it) and
the fused loss gathers the head's weight through FSDP2's own hooks, never forming the logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

TOL = 1e-5
ROWS, WIDTH, STEPS, LR = 4, 16, 3, 0.5


def _llama(attn: str):
    import transformers

    from tests.unit.models.test_families import SMALL, randomize_

    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 2}, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomize_(model, 0)
    return model


def _batch(step: int):
    from tests.unit.models.test_families import SMALL

    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, SMALL["vocab_size"], (ROWS, WIDTH), generator=gen)
    labels = ids.clone()
    labels[torch.rand(ROWS, WIDTH, generator=gen) < 0.3] = -100
    return ids, labels, (labels[..., 1:] != -100).sum()


def check_fsdp_training_with_the_fused_loss(head_unit: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import xorl.hf
    import xorl.hf.loss as hf_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _llama("eager")
    model = _llama("xorl")
    patches = xorl.hf.apply(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if head_unit:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    fused_calls = [0]
    original = hf_loss.fused_linear_cross_entropy

    def counted(*args, **kwargs):
        fused_calls[0] += 1
        return original(*args, **kwargs)

    hf_loss.fused_linear_cross_entropy = counted
    losses, ref_losses, lazy = [], [], []
    try:
        model.train(), ref.train()
        for step in range(STEPS):
            ids, labels, num_items = _batch(step)
            rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
            out = model(ids[rows], labels=labels[rows], num_items_in_batch=num_items)
            lazy.append(type(out.logits) is hf_loss.LazyLogits)
            # FSDP2 averages gradients over the ranks; each rank's loss is its share of the global sum.
            (out.loss * world).backward()
            opt.step(), opt.zero_grad()
            total = out.loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
            ref_loss = ref(ids, labels=labels, num_items_in_batch=num_items).loss
            ref_loss.backward()
            ref_opt.step(), ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
    finally:
        hf_loss.fused_linear_cross_entropy = original
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    worst = max((((full[n] - p).norm() / p.norm()).item(), n) for n, p in ref_params.items())
    moved = min(((p - _llama("eager").state_dict()[n]).norm() / p.norm()).item() for n, p in ref_params.items())
    return {"losses": losses, "ref_losses": ref_losses, "worst": worst, "moved": moved, "lazy": lazy,
            "fused_calls": fused_calls[0], "norms": len(patches.applied["norm"])}


@pytest.mark.parametrize("head_unit", [False, True], ids=["head_in_root", "head_own_unit"])
def test_fsdp2_with_xorl_hf_apply_trains_to_one_process(gloo_world, head_unit):
    for rank, out in enumerate(gloo_world(2).run(check_fsdp_training_with_the_fused_loss, head_unit)):
        losses, ref = torch.tensor(out["losses"]), torch.tensor(out["ref_losses"])
        assert ((losses - ref).norm() / ref.norm()).item() <= TOL, (rank, out)
        assert out["worst"][0] <= TOL, (rank, out["worst"])
        assert out["moved"] > 1e-3  # every parameter trained
        assert all(out["lazy"]) and out["fused_calls"] == STEPS and out["norms"] == 5
