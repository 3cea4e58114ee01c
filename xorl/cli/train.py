"""`xorl-train [CONFIG.yaml] [--section.key=value ...]`, launched with torchrun for many ranks.

Without a config file the built-in default runs: a small MoE model on the built-in corpus, on CPU
with 4 gloo ranks (FSDP 2 x ring attention 2, experts split over EP 2), which is what
`bash scripts/train.sh` starts.
"""

from __future__ import annotations

import os
import sys

from xorl.config import load_config

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "default_config.yaml")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    path = DEFAULT_CONFIG
    if args and not args[0].startswith("--"):
        path = args.pop(0)
    config = load_config(path, args)
    from xorl.trainer import run_training

    results = run_training(config)
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_rank() == 0 and results:
            first, last = results[0], results[-1]
            print(f"done: step {last.step + 1}, loss {first.loss:.4f} -> {last.loss:.4f}, "
                  f"metrics in {os.path.join(config.train.output_dir, 'metrics.jsonl')}")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
