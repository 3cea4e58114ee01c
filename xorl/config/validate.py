"""validate_config: every rule that ties config fields together and to the world size.

Runs before any process group exists. Every problem is collected and raised together as one
ConfigError; each line names the field(s) and the fix. The size-only rules (sizes multiply to
world_size, PP microbatches, schedules, EP folding, sequence parallel) live with ParallelConfig in
xorl/distributed/parallel_config.py; the rules here add what the model and data sections decide,
one file per section in xorl/config/rules/:

- model.py: the schema's shape rules, the attention backend, the router;
- data.py: lengths, datasets and splits, validation data, row format, tokenizer;
- parallel.py: the layout against the model and the data (heads over TP / Ulysses, seq_len over
  CP, experts over EP, DDP, selective checkpointing), checked once the sizes fit the world;
- train.py: optimiser, checkpoints and run folder, compile, export_hf, schedule / logs / profiler;
- fp8.py, lora.py: train.fp8 and model.lora.
"""

from __future__ import annotations

from typing import Any

from xorl.config.errors import ConfigError
from xorl.config.rules.data import data_problems, eval_problems
from xorl.config.rules.fp8 import fp8_problems
from xorl.config.rules.lora import lora_problems
from xorl.config.rules.model import attention_problems, model_problems, router_problems
from xorl.config.rules.parallel import (
    data_parallel_mode_problems,
    moe_token_split_problems,
    parallel_data_problems,
    parallel_model_problems,
    selective_checkpointing_problems,
)
from xorl.config.rules.train import compile_problems, export_problems, train_problems, training_loop_problems
from xorl.distributed.parallel_config import ParallelConfig


def validate_config(config: Any, world_size: int, *, local: bool = True) -> None:
    """Raise ConfigError naming every problem of ``config`` on ``world_size`` ranks.

    ``local``: also what this machine must have for the run (the data and tokenizer files, the
    packages the config names: torchao, flash-attn, the logging sinks). xorl-plan passes False: it
    judges a layout for a cluster from a laptop, where the files and packages may live elsewhere
    (the model folder's config.json it reads itself, so model.model_path is still checked)."""
    parallel = ParallelConfig.from_config(config, world_size)
    problems = parallel.problems()
    problems += model_problems(config.model)
    problems += attention_problems(config.model, local)
    problems += router_problems(config.model)
    problems += data_problems(config.data, config.model, local)
    problems += eval_problems(config.data, config.train)
    problems += train_problems(config.train)
    problems += export_problems(config.model, config.train)
    problems += compile_problems(config.train, config.model)
    problems += fp8_problems(config.train, config.model, local)
    problems += lora_problems(config.model, config.train)
    problems += training_loop_problems(config.train, config.data, local)
    if not problems and local:
        from xorl.config.model_path import model_path_conflicts

        problems += model_path_conflicts(config.model)
    if not parallel._basic_problems():
        try:
            parallel.dp_shard  # noqa: B018 - resolves -1; raises when the sizes do not fit
        except ConfigError:
            pass  # already reported by parallel.problems()
        else:
            problems += parallel_model_problems(config.model, parallel)
            problems += parallel_data_problems(config.data, parallel)
            problems += moe_token_split_problems(config.model, config.data, parallel)
            problems += data_parallel_mode_problems(config.train, parallel)
            problems += selective_checkpointing_problems(config.model, config.train, parallel)
    if problems:
        raise ConfigError(problems)
