"""HF Trainer on a stock transformers model with xorl's kernels and xorl's context parallelism.

    torchrun --nproc_per_node 2 examples/hf/train_trainer.py --ring 2                 # CPU: gloo, a tiny model
    torchrun --nproc_per_node 8 examples/hf/train_trainer.py --model /data/Llama-3.1-8B \\
        --data train.jsonl --ring 4 --ulysses 2 --bf16                                 # 8 GPUs, unchanged
    torchrun --nproc_per_node 4 examples/hf/train_trainer.py --model QWEN3_MOE --ep 2   # EP 2 x FSDP2 over 4
    torchrun --nproc_per_node 2 examples/hf/train_trainer.py --fsdp                     # FSDP2 alone

What xorl adds to a plain Trainer script is three lines: ``import xorl.hf``, the model loaded with
``attn_implementation="xorl", experts_implementation="xorl"``, and ``ContextParallel.apply(model)``;
for expert / tensor parallelism and FSDP2 instead, ``distributed_config=xorl.hf.distributed_config(
folder, tp=..., ep=...)`` in ``from_pretrained`` (transformers shards the model as it loads it).
Everything else is the Trainer's: its data loader (each rank its own batches; the ranks of one
context-parallel group train on the union of theirs as one packed sequence), gradient accumulation,
``num_items_in_batch``, checkpoints and resume, evaluation loss.

``--model``: a Hugging Face folder (default: a tiny random Llama-style model written to
OUTPUT/model, with xorl's byte tokenizer); ``--data``: a JSON-lines file of ``{"text": ...}`` or
``{"input_ids": [...]}`` rows (default: xorl's built-in corpus). ``--history FILE`` writes the
Trainer's log history (loss, grad_norm, eval_loss) as JSON on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

import xorl.hf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from examples_hf_common import tiny_model_folder  # noqa: E402  (examples/hf/, beside this file)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face model folder (default: a tiny random model)")
    p.add_argument("--data", default=None, help="JSON lines of {'text': ...} or {'input_ids': [...]}")
    p.add_argument("--eval-data", default=None, help="the same format, for evaluation loss")
    p.add_argument("--output", default="outputs/hf_trainer")
    p.add_argument("--ring", type=int, default=1, help="ring attention ranks (zig-zag)")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses all-to-all ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (xorl's TP linears through tp_plan; "
                   "GPUs: on CPU HF Trainer refuses a TP model, docs/hf.md)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (xorl's dispatch; FSDP2 over the rest)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over every rank (implied by --tp / --ep: the "
                   "data-parallel ranks)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (per_device_train_batch_size)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq-len", type=int, default=256, help="longest document kept (longer ones are cut)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from, or 'last' (OUTPUT/run's newest)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--history", default=None, help="write the log history here (JSON, rank 0)")
    return p.parse_args(argv)


def read_rows(path: str | None, model_folder: str, seq_len: int) -> list[dict]:
    """Token ids per document: pre-tokenised rows as they are, text through the model's tokenizer
    (xorl's byte tokenizer for the tiny default model)."""
    if path is None:
        from xorl.data.corpus import builtin_documents

        texts, ids = builtin_documents(400), None
    else:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        ids = [r["input_ids"] for r in rows if "input_ids" in r]
        texts = [r["text"] for r in rows if "input_ids" not in r]
    if ids is None or texts:
        if os.path.exists(os.path.join(model_folder, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_folder)
            encoded = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
        else:
            from xorl.data.tokenizer import ByteTokenizer

            encoded = [ByteTokenizer().encode(t) for t in texts]
        ids = (ids or []) + encoded
    return [{"input_ids": row[:seq_len]} for row in ids if len(row) > 1]


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=os.path.join(a.output, "run"), per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=a.batch, gradient_accumulation_steps=a.grad_accum, max_steps=a.max_steps,
        learning_rate=a.lr, logging_steps=1, report_to=[], use_cpu=not cuda, bf16=a.bf16, seed=0,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        eval_strategy="steps" if a.eval_data else "no", eval_steps=max(1, a.max_steps // 2),
        prediction_loss_only=True, dataloader_drop_last=True,
        ddp_backend="gloo" if not cuda and "WORLD_SIZE" in os.environ else None, remove_unused_columns=False)
    # (TrainingArguments has started the process group under torchrun.)
    folder = a.model
    if folder is None:
        folder = os.path.join(a.output, "model")
        if args.process_index == 0:
            tiny_model_folder(folder)
        if dist.is_initialized():
            dist.barrier()
    # Expert / tensor parallelism and FSDP2: transformers shards the model as it loads it, on xorl's styles.
    sharded = a.tp * a.ep > 1 or a.fsdp
    if sharded and a.ring * a.ulysses > 1:
        raise SystemExit("--tp / --ep / --fsdp and --ring / --ulysses are not combined in this example")
    layout = xorl.hf.distributed_config(folder, tp=a.tp, ep=a.ep) if sharded else None
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="xorl", experts_implementation="xorl",
        dtype=torch.bfloat16 if a.bf16 else torch.float32, distributed_config=layout)
    if a.ring * a.ulysses > 1:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        xorl.hf.ContextParallel.from_sizes(ring=a.ring, ulysses=a.ulysses, pad_token_id=pad).apply(model)
    trainer = Trainer(model=model, args=args, train_dataset=read_rows(a.data, folder, a.seq_len),
                      eval_dataset=read_rows(a.eval_data, folder, a.seq_len) if a.eval_data else None,
                      data_collator=DataCollatorWithFlattening())
    trainer.train(resume_from_checkpoint=True if a.resume == "last" else a.resume)
    history = trainer.state.log_history
    if a.history and args.process_index == 0:
        with open(a.history, "w") as f:
            json.dump(history, f)
    return history


if __name__ == "__main__":
    main()
