"""xorl-plan's search over the FSDP2 recipe (xorl/planner/search.py recipe_choices, apply_recipe_rule):
train.fsdp_reshard_after_forward and, under PP, train.pipeline_grad_sync are tried with each layout
where xorl-train's rules accept them, a YAML's own choice is kept, the default recipe is preferred
within the guide's margin (SIMPLE_SLOWDOWN), and --write-config writes the chosen recipe so that
xorl-train's checks accept it.

GPT-OSS-120B on 64 H100s at 4K tokens, 1280 sequences a step (Megatron-Bridge's published recipe,
tests/unit/planner/test_published_moe.py): there the per-microbatch sync re-gathers and reduce-scatters every
expert block every microbatch over the network, and per_step with the stage kept gathered is the
recommendation.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from tests.support.cli_runs import xorl_train
from tests.support.paths import REPO_ROOT
from xorl.cli.plan import main, short_layout
from xorl.config import load_config
from xorl.planner.guide import RECIPE_FIELDS, Options, with_layout
from xorl.planner.search import SIMPLE_SLOWDOWN, plan, recipe_choices

EXAMPLES = os.path.join(REPO_ROOT, "examples")
GPT_OSS = os.path.join(EXAMPLES, "gpt_oss_120b.yaml")
LLAMA_8B = os.path.join(EXAMPLES, "llama3_8b_fsdp.yaml")


def _base(layout: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in layout.items() if k not in RECIPE_FIELDS))


def _is_default(layout: dict) -> bool:
    return all(layout.get(k, "default") == "default" for k in RECIPE_FIELDS)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The ranking of GPT-OSS-120B on 64 GPUs and the config written for its first layout."""
    path = str(tmp_path_factory.mktemp("plan") / "gpt_oss_pp.yaml")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([GPT_OSS, "--gpus", "64", "--seq-len", "4096", "--global-batch-tokens", str(1280 * 4096),
                     "--json", "--write-config", path]) == 0
    return json.loads(out.getvalue()), path


def test_per_step_is_recommended_on_a_pipeline_where_it_fits_and_is_faster(gpt_oss):
    candidates = gpt_oss[0]["candidates"]
    first = candidates[0]
    assert first["fits"] and first["layout"]["pipeline_parallel_size"] > 1
    assert first["layout"]["pipeline_grad_sync"] == "per_step"
    assert "sync:step" in short_layout(first["layout"])
    # the same layout with the default recipe: it does not fit, or is slower than the guide's margin allows
    default = next(c for c in candidates if _base(c["layout"]) == _base(first["layout"]) and _is_default(c["layout"]))
    assert not default["fits"] or default["step_time_s"] > SIMPLE_SLOWDOWN * first["step_time_s"]
    # and faster than every layout run with the default recipe
    fastest_default = min(c["step_time_s"] for c in candidates if c["fits"] and _is_default(c["layout"]))
    assert first["step_time_s"] < fastest_default


@pytest.mark.slow  # starts processes (runs xorl-train --check): the full suite's, not the quick tier's
def test_written_pipeline_config_keeps_the_recipe_and_passes_the_trainers_checks(gpt_oss):
    out, path = gpt_oss
    written = load_config(path, [])
    written.validate(64, local=False)  # what xorl-train --check runs (bar this machine's data files)
    for key, value in out["candidates"][0]["layout"].items():
        assert getattr(written.train, key) == value, key
    assert written.train.pipeline_grad_sync == "per_step" and written.train.pipeline_parallel_size > 1
    check = xorl_train(path, "--check", "--world-size=64", cwd=os.path.dirname(path))
    assert check.code == 0 and "can start on 64 rank(s)" in check.out + check.err, check


def test_recipe_is_tried_only_where_the_rules_accept_it():
    config = load_config(LLAMA_8B)
    layout = {"data_parallel_mode": "fsdp2", "pipeline_parallel_size": 1}
    assert recipe_choices(layout, config) == [{"fsdp_reshard_after_forward": r, "pipeline_grad_sync": "default"}
                                              for r in ("default", "never")]
    piped = recipe_choices({**layout, "pipeline_parallel_size": 4}, config)
    assert {c["pipeline_grad_sync"] for c in piped} == {"default", "per_step"} and len(piped) == 4
    assert recipe_choices({**layout, "data_parallel_mode": "ddp", "pipeline_parallel_size": 4}, config) == [{}]
    # the ranking without PP: no layout syncs per step, FSDP alone is tried with and without keeping
    candidates = plan(config, Options(16))
    assert not [c for c in candidates if c.layout["pipeline_parallel_size"] == 1 and "pipeline_grad_sync" in c.layout]
    simple = [c.layout["fsdp_reshard_after_forward"] for c in candidates if c.layout["pipeline_parallel_size"] == 1]
    assert set(simple) == {"default", "never"}


def test_a_recipe_the_yaml_fixed_is_kept():
    config = with_layout(load_config(LLAMA_8B), {"fsdp_reshard_after_forward": "never",
                                                 "pipeline_grad_sync": "per_microbatch"})
    assert recipe_choices({"data_parallel_mode": "fsdp2", "pipeline_parallel_size": 2}, config) == \
        [{"fsdp_reshard_after_forward": "never", "pipeline_grad_sync": "per_microbatch"}]
    candidates = plan(config, Options(16))
    assert candidates
    for c in candidates:  # per_microbatch applies to pipelines only: the layouts without one are refused
        assert c.layout["pipeline_parallel_size"] > 1, c.layout
        assert (c.layout["fsdp_reshard_after_forward"], c.layout["pipeline_grad_sync"]) == ("never", "per_microbatch")


def test_default_recipe_is_preferred_within_the_guides_margin():
    candidates = plan(load_config(LLAMA_8B), Options(16))
    first = candidates[0]
    assert _is_default(first.layout)
    groups: dict[tuple, list] = {}
    for c in candidates:
        groups.setdefault(_base(c.layout), []).append(c)
    checked = 0
    for group in groups.values():
        fitting = [c for c in group if c.fits]
        default = next((c for c in fitting if _is_default(c.layout)), None)
        if default is None or len(fitting) < 2:
            continue
        within = default.time.total <= SIMPLE_SLOWDOWN * min(c.time.total for c in fitting)
        for c in group:
            if not _is_default(c.layout):
                assert any("default FSDP2 recipe fits" in d for d in c.deviations) == within, c.layout
                checked += within
    assert checked  # the rule was exercised
