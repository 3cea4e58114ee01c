"""Parameter names without the segments wrappers insert (shared by checkpoint I/O and seeded init).

A module of its own so that xorl/models/seeded_init.py need not import hf_writer (which imports the
model registry, which imports the families, which import decoder.py, which imports seeded_init:
an import cycle).
"""

from __future__ import annotations

# Wrappers (activation checkpointing, torch.compile, FSDP1) insert these into parameter names.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name
