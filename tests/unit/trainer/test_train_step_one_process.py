"""The quick tier's training step: the real Trainer, in this process, as a world of one.

Every other trainer test runs in a gloo world (marked `slow`); this one keeps a broken training step
(model build, plans for one process, loss, backward, clip, AdamW) from passing the quick tier.
The reference is the same run with torch SDPA as the attention (the xorl kernel's path is
independent code), and the MoE model's routed experts go through the grouped-GEMM kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.support.parity_runs import tiny_config


def _train(tmp_path, name: str, model_type: str, attn: str, monkeypatch) -> list:
    from xorl.trainer.trainer import Trainer

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    config = tiny_config(str(tmp_path / name), model_type, max_steps=3)
    config.model.attn_implementation = attn
    try:
        trainer = Trainer(config)
        before = {k: v.detach().clone() for k, v in trainer.parts[0].state_dict().items()}
        results = trainer.train()
        after = trainer.parts[0].state_dict()
        moved = sum(not torch.equal(before[k], after[k].detach()) for k in before)
        return [(r.loss, r.grad_norm) for r in results], moved, len(before)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_one_process_steps_match_sdpa_and_update_every_weight(tmp_path, model_type, monkeypatch):
    got, moved, total = _train(tmp_path, "xorl", model_type, "xorl", monkeypatch)
    ref, _, _ = _train(tmp_path, "sdpa", model_type, "sdpa", monkeypatch)
    assert len(got) == len(ref) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert math.isfinite(loss) and math.isfinite(norm)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    # A random 272-token model starts near ln(272) and AdamW moves every parameter it trains.
    assert abs(got[0][0] - math.log(272)) < 0.5
    assert moved == total
