"""TRL's SFTTrainer (packing on) on a stock transformers model with xorl's kernels and context parallelism.

    torchrun --nproc_per_node 2 examples/hf/train_trl_sft.py --ring 2                 # CPU: gloo, a tiny model
    torchrun --nproc_per_node 8 examples/hf/train_trl_sft.py --model /data/Qwen3-8B \\
        --data chats.jsonl --ring 4 --ulysses 2 --bf16                                 # 8 GPUs, unchanged

The same three lines as examples/hf/train_trainer.py (``import xorl.hf``, the model loaded with
``attn_implementation="xorl", experts_implementation="xorl"``, ``ContextParallel.apply``); TRL packs
the rows (``packing=True``: best-fit packing into ``--seq-len`` rows with position ids that restart
at every document, which xorl's attention and its context-parallel batch both read).

``--data``: JSON lines of ``{"text": ...}`` (language modelling) or ``{"prompt": ..., "completion": ...}``
(the loss on the completion only), tokenised by the model folder's tokenizer. Without ``--model``, a
tiny random Llama-style model with a byte-level tokenizer (examples/hf/examples_hf_common.py: no
download) and, without ``--data``, xorl's built-in corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import xorl.hf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from examples_hf_common import tiny_model_folder  # noqa: E402  (examples/hf/, beside this file)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--output", default="outputs/trl_sft")
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="packed rows per rank per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--history", default=None)
    return p.parse_args(argv)


def _dataset(path):
    from datasets import Dataset

    if path is None:
        from xorl.data.corpus import builtin_documents

        return Dataset.from_list([{"text": text} for text in builtin_documents(400)])
    with open(path, encoding="utf-8") as f:
        return Dataset.from_list([json.loads(line) for line in f if line.strip()])


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=os.path.join(a.output, "run"), per_device_train_batch_size=a.batch, max_steps=a.max_steps,
        learning_rate=a.lr, logging_steps=1, report_to=[], use_cpu=not cuda, bf16=a.bf16, seed=0,
        save_strategy="no", packing=True, max_length=a.seq_len, dataloader_drop_last=True,
        ddp_backend="gloo" if not cuda and "WORLD_SIZE" in os.environ else None)
    folder = a.model
    if folder is None:
        folder = os.path.join(a.output, "model")
        if args.process_index == 0:
            tiny_model_folder(folder)
        if dist.is_initialized():
            dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="xorl", experts_implementation="xorl",
        dtype=torch.bfloat16 if a.bf16 else torch.float32)
    if a.ring * a.ulysses > 1:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        xorl.hf.ContextParallel.from_sizes(ring=a.ring, ulysses=a.ulysses, pad_token_id=pad).apply(model)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_dataset(a.data),
                         processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    history = trainer.state.log_history
    if a.history and args.process_index == 0:
        with open(a.history, "w") as f:
            json.dump(history, f)
    return history


if __name__ == "__main__":
    main()
