"""Saved state: sharded DCP checkpoints, their files, and the exports other tools read.

- ``state.py``: ``Checkpointer``, ``save_checkpoint`` / ``load_checkpoint`` (torch.distributed.checkpoint,
  saved atomically, verified on load).
- ``files.py``: what a save writes, byte by byte (CRC-32 per file, a full disk named).
- ``hf_export.py``: a checkpoint -> a Hugging Face safetensors folder (``xorl-export``).
- ``peft_adapter.py``: the LoRA adapter in peft's format.

(Activation checkpointing, recompute in backward, is part of the parallel layer:
xorl/parallel/activation_checkpointing.py.)
"""
