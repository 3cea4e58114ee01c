"""Host memory at scale (CPU, exact): a 0.54 GB model on 4 gloo ranks under FSDP.

Per rank, start-up from a Hugging Face folder (transformers ``save_pretrained``, 4 files) and the
seeded start peak at most 0.35 x the model's bytes above a tiny model's run (0.36 from a folder,
whose read overlaps the packed data: see its test; a rank's own fp32 shards are 0.25 x); the
export at the end of training and ``xorl-export`` (one process) peak at most 0.35 x above the
resident bytes before them. Before this, every rank peaked at 1.1-1.3 x.

Costly by nature (3-4 minutes on 2 loaded cores; marked slow): one model folder and two fresh 4-rank worlds
for the whole module (a process's peak only grows, so measured runs cannot reuse the shared worlds).
"""

from __future__ import annotations

import filecmp
import json
import os

import pytest

from bench.bench_host_memory import measure_host_memory

LIMIT = 0.35
FOLDER_LIMIT = 0.36  # see test_start_from_a_hf_folder_reads_only_each_ranks_shards
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    pytest.importorskip("transformers")
    return measure_host_memory(str(tmp_path_factory.mktemp("host-memory")))


def _assert_within(figures: dict, case: str, limit: float = LIMIT) -> None:
    ratios = figures[case]
    assert figures["model_bytes"] >= 0.5e9
    assert len(ratios) == (1 if case == "xorl_export" else figures["ranks"])
    assert max(ratios) <= limit, f"{case}: per-rank peak / model bytes {ratios} (limit {limit})"


def test_start_from_a_hf_folder_reads_only_each_ranks_shards(figures):
    # Since in-memory training data is read before start-up (xorl/run/preflight.py: a bad row is refused
    # before any process group), a rank holds its packed data while the weights load: measured +0.013
    # of the model's bytes here (0.333 -> 0.346 max over ranks, the same bench with that read moved
    # back: 0.333), which the run holds from then on anyway. Hence 0.36 for this case alone.
    _assert_within(figures, "start_from_folder", limit=FOLDER_LIMIT)
    folder = figures["paths"]["folder"]
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) >= 3  # the folder really is sharded
    # Each rank holds its quarter: a peak below it would mean the measure missed the weights.
    assert min(figures["start_from_folder"]) >= 0.2


def test_seeded_start_draws_only_each_ranks_shards(figures):
    _assert_within(figures, "seeded_init")
    assert min(figures["seeded_init"]) >= 0.2


def test_export_at_the_end_of_training_is_streamed(figures):
    _assert_within(figures, "export")


def test_xorl_export_is_streamed_and_writes_what_the_training_export_wrote(figures):
    _assert_within(figures, "xorl_export")
    trained, standalone = os.path.join(figures["paths"]["seeded"], "hf"), figures["paths"]["cli_wide"]
    names = sorted(os.listdir(trained))
    assert names == sorted(os.listdir(standalone)) and "model.safetensors" in names
    match, mismatch, errors = filecmp.cmpfiles(trained, standalone, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
