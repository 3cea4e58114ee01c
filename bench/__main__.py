"""``python -m bench [--quick] [--only NAME ...] [--out DIR]``; see bench/runner.py."""

import os
import sys

import torch

# Triton kernels run through the interpreter where there is no GPU; it must be chosen before import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.runner import main  # noqa: E402

sys.exit(main())
