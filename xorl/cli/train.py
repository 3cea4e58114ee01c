"""`xorl-train [CONFIG.yaml] [--section.key=value ...]`, launched with torchrun for many ranks.

Without a config file the built-in default runs: a small MoE model on the built-in corpus, on CPU
with 4 gloo ranks (FSDP 2 x ring attention 2, experts split over EP 2), which is what
`bash scripts/train.sh` starts.

`xorl-train CONFIG --check [--world-size=N]` checks the config, the run folder and the checkpoint
to resume for N ranks (default: $WORLD_SIZE or 1) and exits: 0 when the run can start, else 2.
scripts/train.sh runs it before torchrun, so a bad config is one message, not one per rank.

What a user sees when the run cannot start: one message on stderr, printed by rank 0 only, no
traceback, exit code 2 (config and data errors) or 1 (a checkpoint that does not load). Under
torchrun, torchrun then prints its own failure summary (its stack and one block per failed rank,
exit code 1); each worker's error file makes that block point at the message instead of saying
"To enable traceback see ...". A busy output_dir is refused before torch is imported (in a
second); the config rules then import the model families (and torch) before any process group
starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

# The CUDA caching allocator with expandable segments (torchtitan's launch script sets the same): a
# step allocates and frees buffers of very different sizes (a layer's working set, then the loss's
# [tokens, vocab] buffers, then the backward's), and fixed segments cached for one size cannot hold the
# next, so without it reserved memory grows well past what is allocated (fragmentation) and a layout
# that fits by xorl-setup's count can run out. Read once, when torch initialises CUDA: set before
# torch is imported (nothing above imports it); a user's own setting, under either name, wins.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"

from xorl.config import load_config  # noqa: E402
from xorl.config.errors import ConfigError  # noqa: E402
from xorl.data.corpus import DataError  # noqa: E402
from xorl.run.preflight import prepare_run  # noqa: E402
from xorl.run.watchdog import exit_with_launcher  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "default_config.yaml")
CONFIG_ERROR_EXIT = 2
RANK0_REPORT_GRACE_S = 30.0


USAGE = """usage: xorl-train [CONFIG.yaml] [--section.key=value ...] [--check [--world-size=N]]
       torchrun --nproc_per_node=N -m xorl.cli.train [CONFIG.yaml] [--section.key=value ...]

Trains the model that CONFIG.yaml's model:, data: and train: sections describe (no CONFIG: the
built-in default run); each --section.key=value overrides one key (e.g. --train.lr=3e-4).
--check checks the config, the run folder and the checkpoint to resume for N ranks and exits
(0: the run can start, 2: it cannot). The keys, with their defaults and meanings:
"""


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        from xorl.config import config_help

        print(USAGE + "\n" + config_help())
        return
    exit_with_launcher()
    check_only, world_size, args = _launcher_options(args)
    path = DEFAULT_CONFIG
    if args and not args[0].startswith("--"):
        path = args.pop(0)
    elif any(arg.startswith("--model.model_path") for arg in args):
        # The built-in default is a demo run (its own model shape, 4 ranks): with a model folder and no
        # config file, the folder defines the model and xorl.config's defaults the rest.
        path = None
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = load_config(path, args)
        setup = prepare_run(config, world_size)
    except ConfigError as e:
        _fail(str(e), CONFIG_ERROR_EXIT, rank)
    if rank == 0:
        if path is None:
            print("xorl: no config file; the model from model.model_path, every other key xorl.config's default "
                  "plus the command-line overrides", flush=True)
        elif not any(origin == path for origin in config.origins.values()):
            print(f"xorl: {path} sets no field; training with the defaults of xorl.config "
                  "(a tiny dense model on the built-in corpus) plus the command-line overrides", flush=True)
        for note in setup.notes:
            print(f"xorl: {note}", flush=True)
    if setup.finished:
        return
    if check_only:
        if rank == 0:
            print(f"xorl: {path or 'the command-line config'} can start on {world_size} rank(s)", flush=True)
        return

    import torch.distributed as dist

    from xorl.checkpoint.state import CheckpointError
    from xorl.run.fatal import collective_timeout, exit_fatal
    from xorl.run.preemption import Preempted
    from xorl.trainer.step import NonFiniteLossError
    from xorl.trainer.trainer import run_training

    try:
        results = run_training(config, setup)
    except (ConfigError, DataError) as e:  # after the process group started: one rank may be alone in it
        exit_fatal(str(e), CONFIG_ERROR_EXIT)
    except (CheckpointError, NonFiniteLossError) as e:  # its message says what to do: no traceback
        exit_fatal(str(e), 1)
    except Preempted as e:  # the checkpoint is saved; exit 75 so the scheduler may requeue the job
        e.exit()
    except Exception as e:  # noqa: BLE001 - any other fatal error ends the whole job, shown once
        timed_out = collective_timeout(e, config.train.collective_timeout_s)
        if timed_out:
            exit_fatal(timed_out, 1)
        exit_fatal(f"{type(e).__name__}: {e}", 1, with_traceback=True)
    if dist.is_initialized():
        if dist.get_rank() == 0 and results:
            first, last = results[0], results[-1]
            print(f"done: step {last.step + 1}, loss {first.loss:.4f} -> {last.loss:.4f}, "
                  f"metrics in {os.path.join(config.train.output_dir, 'metrics.jsonl')}")
        dist.destroy_process_group()


def _launcher_options(args: list[str]) -> tuple[bool, int, list[str]]:
    """Take ``--check`` and ``--world-size=N`` out of ``args`` (they are not config overrides)."""
    check_only, world_size, rest = False, int(os.environ.get("WORLD_SIZE", "1")), []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--check":
            check_only = True
        elif arg.startswith("--world-size"):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            i += 0 if "=" in arg else 1
            if not value.isdigit() or int(value) < 1:
                _fail(f"--world-size needs a positive number of ranks, got {value!r}", CONFIG_ERROR_EXIT, 0)
            world_size = int(value)
        else:
            rest.append(arg)
        i += 1
    return check_only, world_size, rest


def _fail(message: str, code: int, rank: int) -> NoReturn:
    """One message (rank 0 prints it), a pointer to it in torchrun's error file, exit without a traceback."""
    if rank != 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every worker as soon as one exits, which could be before rank 0 has printed:
        # the others wait for that stop. If it does not come (rank 0 saw no problem), they speak.
        time.sleep(RANK0_REPORT_GRACE_S)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node, not one per rank
            print(f"xorl-train (rank {rank}): {message}", file=sys.stderr, flush=True)
    if rank == 0:
        print(f"xorl-train: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # torchrun's failure summary shows this per failed rank instead of "To enable traceback see ...";
        # one line that points at the full message keeps it from repeating once per rank.
        pointer = f"{message.splitlines()[0].rstrip(':')} (printed in full above by rank 0)"
        record = {"message": {"message": pointer, "extraInfo": {"py_callstack": pointer,
                                                                "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(record, f)
        except OSError:
            pass
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
