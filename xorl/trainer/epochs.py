"""``train.num_epochs``: the run's length in passes over the data, turned into ``max_steps`` up front.

The in-memory data (``data.streaming: false``) is a fixed list of packed sequences, read in a seeded
shuffle that is drawn again for every pass (xorl/data/loader.py: ``order(epoch)`` from ``data.seed``
and the epoch), and the run's position is the number of sequences consumed. So a pass is exactly
``len(dataset)`` consecutive global sequences: nothing of an epoch is skipped or repeated, whatever
the global batch, and a resume mid-epoch continues at the next unseen sequence.

``max_steps`` is derived before any process group starts (prepare_run), by packing the data once,
the same way on every rank (the trainer then uses that very dataset, so the data is read once):
``ceil(num_epochs x sequences / global batch)``. When the global batch does not divide the total,
the last step is filled from the start of the next pass (a note says how many sequences), so no
sequence of the epochs asked for is left out. A resume with another global batch takes the steps
its sequences still need: ``step + ceil((total - consumed) / global batch)``.
"""

from __future__ import annotations

import math
from typing import Any

from xorl.config.errors import ConfigError


def total_sequences(num_epochs: float, data_sequences: int) -> int:
    """The sequences ``num_epochs`` passes over ``data_sequences`` take (a fractional pass rounds up)."""
    return math.ceil(num_epochs * data_sequences - 1e-9)  # 1e-9: 0.1 x 30 is 3.0000000000000004, not 4


def epoch_steps(num_epochs: float, data_sequences: int, global_batch: int, step: int = 0,
                consumed: int = 0) -> int:
    """max_steps for ``num_epochs`` passes, resumed at ``step`` having consumed ``consumed`` sequences."""
    left = max(0, total_sequences(num_epochs, data_sequences) - consumed)
    return step + math.ceil(left / global_batch)


def epoch_metrics(consumed: int, data_sequences: int) -> dict[str, float]:
    """``epoch``: the pass (1-based) the last sequence consumed belongs to; ``data_seen``: sequences
    consumed / sequences in the data (1.5: one pass and half of the next)."""
    return {"epoch": (max(consumed, 1) - 1) // data_sequences + 1, "data_seen": consumed / data_sequences}


def load_counted_dataset(config: Any, part: str = "train"):
    """The packed in-memory dataset of ``config`` (what the trainer trains on), its errors as ConfigError
    (one message, no traceback: this runs before start-up)."""
    from xorl.data.loader import PackedDataset

    try:
        return PackedDataset(config.data, vocab_size=config.model.vocab_size, part=part)
    except ValueError as e:  # DataError (a file:line), or a tokenizer larger than the model's vocabulary
        if config.train.num_epochs is None or part == "eval":  # read before start-up: the row's own message
            raise ConfigError(str(e)) from None
        raise ConfigError(f"train.num_epochs: counting the packed sequences of data.dataset="
                          f"{config.data.dataset!r}: {e}") from None


def resolve_num_epochs(config: Any, dataset, global_batch: int, step: int = 0, consumed: int = 0) -> str:
    """Set ``config.train.max_steps`` from ``num_epochs``; return the note rank 0 prints. Raises a
    ConfigError when the config also sets max_steps to another number: one of the two, not both. What
    passes: the derived number itself (the run folder's config.yaml records it), and a max_steps from a
    file whose num_epochs a command-line override changes (the later setting wins, as overrides do)."""
    t = config.train
    n = len(dataset)
    steps = epoch_steps(t.num_epochs, n, global_batch, step, consumed)
    if _sets_max_steps(config) and t.max_steps != steps:
        raise ConfigError(
            f"train.max_steps={t.max_steps} and train.num_epochs={t.num_epochs:g} are both set ({t.num_epochs:g} "
            f"epochs of {n} packed sequences at {global_batch} a step = {steps} steps); set one of them "
            "(--train.num_epochs=null counts the run in steps)")
    t.max_steps = steps
    total = total_sequences(t.num_epochs, n)
    extra = consumed + (steps - step) * global_batch - total
    tail = (f"; the last step's {extra} other sequence{'s' * (extra != 1)} open{'s' * (extra == 1)} the next pass"
            if extra > 0 else "")
    return (f"train.num_epochs={t.num_epochs:g}: {total} packed sequences ({n} in the data) at {global_batch} a "
            f"step = max_steps {steps}{tail}")


def _sets_max_steps(config: Any) -> bool:
    """Whether max_steps was chosen beside num_epochs (not left at its default, nor overridden by a
    later --train.num_epochs)."""
    origin = config.origins.get("train.max_steps")
    if origin is None:  # set in code, or not at all
        return config.train.max_steps != type(config.train)().max_steps
    epochs_origin = config.origins.get("train.num_epochs", "")
    return origin.startswith("--") or not epochs_origin.startswith("--")
