"""Check functions for the fine-tuning tests (chat data, validation) that run the real Trainer on
every rank of a gloo world. Module-level so they travel to the ranks by pickle."""

from __future__ import annotations

import torch.distributed as dist

from tests.support.parity_runs import tiny_config
from xorl.checkpoint.hf_export import full_state_dict
from xorl.config import Config


def chat_config(output_dir: str, tokenizer: str, dataset: str, model: str = "llama", eval_dataset: str | None = None,
                eval_steps: int = 0, **train) -> Config:
    """The parity matrix's tiny model trained on a messages dataset (assistant tokens only)."""
    config = tiny_config(output_dir, model, **train)
    d = config.data
    d.dataset, d.tokenizer, d.seq_len, d.format = dataset, tokenizer, 64, "messages"
    d.eval_dataset = eval_dataset
    config.train.eval_steps = eval_steps
    return config


def train_with_eval(config: Config) -> dict:
    """The eval loss before any step, then train (evaluating every train.eval_steps); rank 0 returns the
    losses, the metrics rows, and the final weights."""
    import json
    import os

    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    before = trainer.evaluator.run(trainer) if trainer.evaluator is not None else None
    results = trainer.train()
    full = full_state_dict(trainer.parts, trainer.state.pp_group)
    if dist.get_rank() != 0:
        return {}
    with open(os.path.join(config.train.output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"eval_before": before, "losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "rows": rows, "weights": {k: v.detach().clone() for k, v in full.items()}}
