"""Rows from Hugging Face ``datasets``: save_to_disk folders, local .json / .csv / .arrow files and hub
datasets (where a network is reachable), in memory (``Dataset``) or streamed (``IterableDataset``).

The library does the reading; xorl adds where each row came from (``name[split] row n``) for its
errors. Local .jsonl / .txt / .parquet files stay on xorl's own readers (xorl/data/corpus.py), whose
errors name the file and line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from xorl.data.errors import DataError

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow", ".parquet": "parquet"}


def is_saved_dataset(path: str) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def _datasets():
    try:
        import datasets
    except ImportError as err:
        raise ImportError("data.dataset: this source is read by Hugging Face datasets: pip install datasets") from err
    datasets.disable_progress_bars()  # one line per step in the log, not a bar per file
    return datasets


def _pick_split(loaded, name: str, split: str | None, default: str):
    """A DatasetDict's split (``split``, else ``default``); a plain Dataset has none to pick."""
    datasets = _datasets()
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        split = split or default
        if split not in loaded:
            raise DataError(f"data.split={split!r}: {name!r} has the splits {sorted(loaded)}; set data.split "
                            "(data.eval_split for data.eval_dataset) to one of them")
        return loaded[split]
    if split is not None:
        raise DataError(f"data.split={split!r}: {name!r} holds one dataset, not a DatasetDict of splits; remove "
                        "data.split (data.eval_split for data.eval_dataset)")
    return loaded


def load(source: str, split: str | None, streaming: bool = False, default: str = "train"):
    """The ``datasets`` Dataset (or IterableDataset when ``streaming``) of a save_to_disk folder, a
    local file ``datasets`` reads, or a hub name."""
    datasets = _datasets()
    try:
        if is_saved_dataset(source):
            loaded = _pick_split(datasets.load_from_disk(source), source, split, default)
            return loaded.to_iterable_dataset() if streaming else loaded
        if os.path.isfile(source):
            builder = _BUILDERS.get(os.path.splitext(source)[1])
            if builder is None:
                raise DataError(f"data.dataset: {source!r} is not a file type datasets reads ({sorted(_BUILDERS)})")
            return datasets.load_dataset(builder, data_files=source, split="train", streaming=streaming)
        split = split or default
        return datasets.load_dataset(source, split=split, streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's error, on one line naming the source
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.dataset={source!r}: datasets cannot load it: {first}") from None


def _rows(dataset, name: str) -> Iterator[tuple[dict, str]]:
    for i, row in enumerate(dataset):
        yield row, f"{name} row {i}"


def saved_dataset_rows(path: str, split: str | None, default: str = "train") -> Iterator[tuple[dict, str]]:
    # A DatasetDict's rows are named with the split read, also the default one: the train and eval data of
    # one folder must not both read "folder row 0" in the log and in errors.
    is_dict = os.path.isfile(os.path.join(path, "dataset_dict.json"))
    yield from _rows(load(path, split, default=default), f"{path}[{split or default}]" if split or is_dict else path)


def file_rows(path: str) -> Iterator[tuple[dict, str]]:
    yield from _rows(load(path, None), path)


def hub_rows(name: str, split: str | None, default: str = "train") -> Iterator[tuple[dict, str]]:
    yield from _rows(load(name, split, default=default), f"{name}[{split or default}]")
