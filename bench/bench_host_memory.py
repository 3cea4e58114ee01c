"""Peak host memory per rank / the model's fp32 bytes: start-up, seeded init, export, xorl-export.

Exact on CPU (the kernel's resident-memory high-water mark, no timing). A wide Llama-style model
is written as a Hugging Face folder by transformers' ``save_pretrained`` (several files), then
started by the real trainer on ``ranks`` gloo ranks under FSDP. Each figure is a rank's peak minus
the same rank's peak in the same run of a tiny model (imports, process groups and data are the
same in both), divided by the model's bytes; the anchor is 1/ranks, a rank's own fp32 shards.

- start from the folder, and seeded init: ``startup.json`` (peak with the weights in place);
- export at the end of training (``export_hf: true``; the seeded run, after one step): ``export.json``,
  the peak during the export, with the checkpoint it saves first, above the training steady state
  (the resident bytes before it);
- ``xorl-export CHECKPOINT OUT_DIR`` in one process: its peak during the export above its resident
  bytes before it (torch imported).

The same measurement backs tests/multirank/test_scale_memory.py (target <= 0.35 per rank). Quick (CPU): a
0.54 GB model; full: 2.2 GB. Each case starts fresh processes, since a peak only grows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from bench.context import BenchContext, Result


@dataclass(frozen=True)
class WideModel:
    hidden: int
    intermediate: int
    layers: int

    @property
    def heads(self) -> int:
        return self.hidden // 128


QUICK_MODEL = WideModel(hidden=1024, intermediate=4096, layers=8)  # 134.8M parameters, 0.54 GB in fp32
FULL_MODEL = WideModel(hidden=2048, intermediate=8192, layers=8)
VOCAB = 272  # the byte tokenizer's ids fit


def write_hf_folder(folder: str, shape: WideModel, max_shard_size: str = "150MB") -> None:
    """The model as transformers writes it: config.json, model-0000i-of-0000n.safetensors + index."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.heads, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=max_shard_size)


def run_config(output_dir: str, ranks: int, shape: WideModel | None, model_path: str | None = None):
    """The trainer config: FSDP over ``ranks``, one step, export at the end (``shape`` None: tiny)."""
    from xorl.config import Config

    config = Config()
    m, t = config.model, config.train
    m.model_type, m.vocab_size = "llama", VOCAB
    if shape is not None:
        m.hidden_size, m.intermediate_size, m.num_hidden_layers = shape.hidden, shape.intermediate, shape.layers
        m.num_attention_heads = m.num_key_value_heads = shape.heads
        m.max_position_embeddings = 256  # as write_hf_folder's config.json says (the folder defines it)
    m.model_path = model_path
    config.data.seq_len, config.data.micro_batch_size = 32, 1
    t.data_parallel_shard_size, t.gradient_accumulation_steps = ranks, 1
    t.max_steps, t.warmup_steps, t.save_steps, t.export_hf = 1, 0, 0, True
    t.output_dir = output_dir
    return config


def train_and_export(config) -> None:
    from xorl.trainer.trainer import run_training

    run_training(config)


def start_only(config) -> None:
    from xorl.trainer.trainer import Trainer

    Trainer(config)


def xorl_export_report(checkpoint_dir: str, out_dir: str) -> dict:
    """Run ``xorl-export`` in a fresh process; its report (``--report``: peak host memory, seconds)."""
    report = out_dir + ".report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "xorl.cli.export", checkpoint_dir, out_dir, "--report", report],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"xorl-export failed ({done.returncode}): {done.stderr[-2000:]}")
    return _read(report)


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def measure_host_memory(work_dir: str, shape: WideModel = QUICK_MODEL, ranks: int = 4,
                        timeout_s: float = 1200) -> dict:
    """Every case's per-rank peaks; ratios are (peak - tiny peak) / model bytes, max over ranks."""
    from xorl.testing.multirank import GlooWorld

    folder = os.path.join(work_dir, "hf-wide")
    write_hf_folder(folder, shape)
    tiny, seeded, wide = (os.path.join(work_dir, name) for name in ("tiny", "seeded", "wide"))
    with GlooWorld(ranks, timeout_s=timeout_s) as world:  # the tiny run first: a peak only grows
        world.run(start_only, run_config(tiny, ranks, None))
        world.run(start_only, run_config(wide, ranks, shape, model_path=folder))
    with GlooWorld(ranks, timeout_s=timeout_s) as world:
        world.run(train_and_export, run_config(seeded, ranks, shape))
    startup = {name: _read(os.path.join(d, "startup.json")) for name, d in (("tiny", tiny), ("seeded", seeded),
                                                                          ("wide", wide))}
    export = _read(os.path.join(seeded, "export.json"))
    model_bytes = startup["wide"]["model_bytes"]
    baseline = [r["peak_host_bytes"] for r in startup["tiny"]["ranks"]]

    def above_tiny(report: dict) -> list[float]:
        return [(r["peak_host_bytes"] - b) / model_bytes for r, b in zip(report["ranks"], baseline)]

    cli = xorl_export_report(seeded, os.path.join(work_dir, "cli-wide"))["ranks"][0]
    return {
        "model_bytes": model_bytes,
        "ranks": ranks,
        "start_from_folder": above_tiny(startup["wide"]),
        "seeded_init": above_tiny(startup["seeded"]),
        "export": [(r["peak_host_bytes"] - r["host_bytes_before"]) / model_bytes for r in export["ranks"]],
        "xorl_export": [(cli["peak_host_bytes"] - cli["host_bytes_before"]) / model_bytes],
        "startup_seconds": max(r["seconds"] for r in startup["wide"]["ranks"]),
        "paths": {"folder": folder, "seeded": seeded, "tiny": tiny, "cli_wide": os.path.join(work_dir, "cli-wide")},
    }


CASES = {
    "start_from_folder": "start from a HF folder",
    "seeded_init": "seeded init",
    "export": "export at the end of training",
    "xorl_export": "xorl-export (one process)",
}


def run(ctx: BenchContext) -> list[Result]:
    shape = QUICK_MODEL if ctx.quick else FULL_MODEL
    ranks = 4
    with tempfile.TemporaryDirectory(prefix="xorl-bench-host-memory-") as work_dir:
        figures = measure_host_memory(work_dir, shape, ranks)
    return [
        Result(
            name=f"peak host bytes per rank / model bytes: {label}, FSDP over {ranks} gloo ranks",
            value=max(figures[case]),
            unit="x model bytes",
            anchor="1/ranks (a rank's own fp32 shards)",
            anchor_value=1.0 / ranks,
            higher_is_better=False,
            params={"model_bytes": figures["model_bytes"], "per_rank": [round(v, 4) for v in figures[case]],
                    "hidden": shape.hidden, "intermediate": shape.intermediate, "layers": shape.layers},
        )
        for case, label in CASES.items()
    ]
