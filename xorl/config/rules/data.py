"""The data section's rules: lengths, the dataset and its splits, validation data, the row format
and the tokenizer (against model.vocab_size)."""

from __future__ import annotations

import os
from typing import Any

from xorl.config.rules.common import at_least, next_multiple
from xorl.distributed.parallel_config import PIPELINE_SCHEDULES


def data_problems(d: Any, m: Any, local: bool = True) -> list[str]:
    """``local``: also the data, eval data and tokenizer files on this machine (validate_config)."""
    problems = at_least("data", d, 2, "seq_len")  # one input and its next-token label
    problems += at_least("data", d, 1, "micro_batch_size")
    problems += at_least("data", d, 0, "num_workers")
    if d.seq_len > m.max_position_embeddings:
        problems.append(
            f"data.seq_len={d.seq_len} is longer than model.max_position_embeddings="
            f"{m.max_position_embeddings}; use seq_len <= {m.max_position_embeddings}"
        )
    if local:
        problems += _local_data_problems(d, m)
    if m.model_path is not None and not os.path.isfile(os.path.join(m.model_path, "config.json")):
        problems.append(
            f"model.model_path={m.model_path!r} has no config.json; point it at a local HF model folder"
        )
    return problems


def _local_data_problems(d: Any, m: Any) -> list[str]:
    """The data, eval data and tokenizer as this machine has them."""
    problems = _dataset_problems(d.dataset, "data.dataset")
    if d.eval_dataset is not None:
        problems += _dataset_problems(d.eval_dataset, "data.eval_dataset")
    problems += _split_problems(d)
    if d.streaming and not problems:
        from xorl.data.corpus import DataError
        from xorl.data.stream import stream_files, streams_through_datasets

        if not streams_through_datasets(d.dataset):
            try:
                stream_files(d.dataset)
            except DataError as e:
                problems.append(str(e))
    problems += _tokenizer_problems(d.tokenizer, m.vocab_size)
    if not problems:
        problems += _format_problems(d)
    return problems


def _dataset_problems(dataset: str, name: str) -> list[str]:
    """A local file or folder xorl or datasets reads, 'builtin', or a hub name (checked when loaded)."""
    from xorl.data.corpus import DATASETS_SUFFIXES, READABLE_SUFFIXES, dataset_files, is_saved_dataset

    if dataset == "builtin":
        return []
    kinds = "/".join(READABLE_SUFFIXES + DATASETS_SUFFIXES)
    if not os.path.exists(dataset):
        if _looks_like_hub_name(dataset):
            return []
        return [f"{name}={dataset!r}: no such file; use 'builtin', a local {kinds} file or folder, a save_to_disk "
                "folder or a Hugging Face hub dataset name"]
    if os.path.isdir(dataset):
        if not is_saved_dataset(dataset) and not dataset_files(dataset):
            return [f"{name}={dataset!r}: the folder holds no {'/'.join(READABLE_SUFFIXES)} files, no "
                    f"{'/'.join(DATASETS_SUFFIXES)} files for datasets, and is no save_to_disk folder"]
    elif not dataset.endswith(READABLE_SUFFIXES + DATASETS_SUFFIXES):
        return [f"{name}={dataset!r}: unknown file type; xorl reads {kinds} (or 'builtin')"]
    return []


def _looks_like_hub_name(dataset: str) -> bool:
    """``name`` or ``owner/name`` with no file suffix (a missing local file is reported as missing)."""
    import re

    from xorl.data.corpus import DATASETS_SUFFIXES, READABLE_SUFFIXES

    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", dataset)) and not dataset.endswith(
        READABLE_SUFFIXES + DATASETS_SUFFIXES + (".yaml", ".yml")) and not dataset.startswith(".")


def _split_problems(d: Any) -> list[str]:
    """A split names a part of a hub dataset or a save_to_disk DatasetDict; a plain file has none."""
    from xorl.data.corpus import is_saved_dataset

    problems = []
    for field, source in (("split", d.dataset), ("eval_split", d.eval_dataset)):
        split = getattr(d, field)
        if split is None or source is None:
            continue
        if source == "builtin" or (os.path.exists(source) and not is_saved_dataset(source)):
            problems.append(f"data.{field}={split!r}: {source!r} is not split (splits belong to hub datasets and "
                            f"save_to_disk DatasetDicts); remove data.{field}")
    if d.eval_split is not None and d.eval_dataset is None:
        problems.append(f"data.eval_split={d.eval_split!r} without data.eval_dataset; set eval_dataset (or remove "
                        "eval_split)")
    return problems


def eval_problems(d: Any, t: Any) -> list[str]:
    """Validation: one eval source, evaluated every train.eval_steps (xorl/trainer/evaluate.py)."""
    problems = at_least("train", t, 0, "eval_steps", "eval_batches")
    if not 0 <= d.eval_fraction < 1:
        problems.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1) (the share of rows held out)")
    has_eval = d.eval_dataset is not None or d.eval_fraction > 0
    if d.eval_dataset is not None and d.eval_fraction > 0:
        problems.append("data.eval_dataset and data.eval_fraction are both set; use one eval source")
    if t.eval_steps > 0 and not has_eval:
        problems.append(f"train.eval_steps={t.eval_steps} but there is no eval data; set data.eval_dataset or "
                        "data.eval_fraction (or eval_steps: 0)")
    if has_eval and t.eval_steps == 0:
        problems.append("eval data is set (data.eval_dataset / eval_fraction) but train.eval_steps is 0, so it would "
                        "never be evaluated; set train.eval_steps (or remove the eval data)")
    schedule = PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule)
    if t.eval_steps > 0 and t.pipeline_parallel_size > 1 and schedule is not None and schedule.split_backward:
        problems.append(
            f"train.eval_steps={t.eval_steps} with pipeline_parallel_schedule: {t.pipeline_parallel_schedule}: "
            "validation runs the schedule's forward-only eval, and torch.distributed.pipelining's zero-bubble "
            "schedules still run their backward actions there (it fails); use 1F1B, GPipe or Interleaved1F1B for "
            "a run with validation, or eval_steps: 0")
    if d.eval_fraction > 0 and d.streaming:
        problems.append("data.eval_fraction with data.streaming: the held-out rows would need a full read of the "
                        "stream before the first step; use data.eval_dataset")
    return problems


def _format_problems(d: Any) -> list[str]:
    """messages rows need a chat template; the first row decides under format auto (local data only)."""
    if d.train_on != "assistant" and d.format in ("text", "input_ids"):
        return [f"data.train_on={d.train_on!r} applies to messages and prompt_completion rows; data.format "
                f"{d.format} trains on {'every token' if d.format == 'text' else 'its labels'}: remove train_on"]
    fmt = d.format
    if fmt == "auto" and d.dataset != "builtin" and os.path.exists(d.dataset) and not d.streaming:
        from xorl.data.corpus import DataError
        from xorl.data.formats import detect_format
        from xorl.data.loader import source_rows

        try:
            first = next(source_rows(d.dataset, d.split, d.seed), None)
        except (DataError, OSError, ImportError):
            return []  # the reader names the problem at start-up, with its line
        fmt = detect_format(first[0], d.text_key) if first is not None else None
    if fmt != "messages":
        return []
    from xorl.data.tokenizer import build_tokenizer

    try:
        hf = getattr(build_tokenizer(d.tokenizer), "hf", None)
    except (OSError, ValueError, ImportError):
        return []  # reported by _tokenizer_problems
    if hf is None or not getattr(hf, "chat_template", None):
        how = "data.format: messages" if d.format == "messages" else f"the rows of {d.dataset!r} are 'messages'"
        return [f"{how}, which are rendered with the tokenizer's chat template, and data.tokenizer={d.tokenizer!r} has "
                "none (tokenizer_config.json 'chat_template' or chat_template.jinja); use a model folder that ships "
                "one, or give the rows as 'text' or 'prompt' + 'completion'"]
    return []


def _tokenizer_problems(tokenizer: str, vocab_size: int) -> list[str]:
    from xorl.data.tokenizer import build_tokenizer

    if tokenizer not in ("byte", "") and not os.path.exists(tokenizer):
        return [f"data.tokenizer={tokenizer!r}: no such file; use 'byte' or a local tokenizer.json"]
    try:
        size = build_tokenizer(tokenizer).vocab_size
    except (OSError, ValueError, ImportError) as e:
        return [f"data.tokenizer={tokenizer!r}: cannot load it: {e}"]
    if vocab_size < size:
        return [
            f"model.vocab_size={vocab_size} is too small for data.tokenizer={tokenizer!r}, which has {size} "
            f"tokens; use vocab_size >= {size} (e.g. {next_multiple(size, 16)}: a multiple of 16 is faster)"
        ]
    return []
