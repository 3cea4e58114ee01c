"""The docs held to the code (text and AST, nothing imported from xorl):

* every repository path that README.md or docs/*.md names (``xorl/...``, ``xorl_kernels/...``,
  ``tests/...``, ``bench/...``, ``scripts/...``, ``examples/...``, ``csrc/...``, ``docs/...``) and
  every relative link they hold exists, and every
  ``xorl/path.py:name`` names a function, class or value defined in that file, so the docs cannot
  drift from a move;
* the README stays a front page (at most 200 lines; the detail lives in docs/) and keeps the two
  commands that scripts/ and CI run;
* docs/architecture.md's walks from a config field to its collective are real (each file imports the
  next or is imported by it, the first declares the field, the last calls the torch collective the
  walk names) and at most 6 files long.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tests.support.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ARCHITECTURE = REPO / "docs" / "architecture.md"
README_MAX_LINES = 200
WALK_MAX_FILES = 6

# A path as the docs write them, from the repository root: it ends before a space, backtick, comma,
# colon or bracket; a trailing full stop is the sentence's.
PATH = re.compile(r"(?<![\w./-])((?:xorl_kernels|xorl|tests|bench|scripts|examples|csrc|docs)/[\w.*/-]*[\w*/])")
LINK = re.compile(r"\]\(([^)#:\s]+)\)")  # a relative markdown link: from the file that holds it
NAMED_DEFINITION = re.compile(r"`(xorl/[\w/]+\.py):([\w.]+)`")


def named_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def path_exists(path: str) -> bool:
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def defined_names(path: Path) -> set[str]:
    """Module-level functions, classes and assigned names of ``path``, and ``Class.method`` for methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_the_docs_name_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in named_paths(text) if not path_exists(p))
    missing += sorted(f"link {link}" for link in LINK.findall(text) if not (doc.parent / link).exists())
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_function_is_defined_where_the_docs_say(doc):
    wrong = [f"{path}:{name}" for path, name in NAMED_DEFINITION.findall(doc.read_text())
             if (REPO / path).exists() and name not in defined_names(REPO / path)]
    assert wrong == [], f"{doc.relative_to(REPO)} names what its file does not define: {wrong}"


def test_the_path_checks_can_fail():
    text = ("`xorl/parallel/parallelize.py`, xorl/nn/tensor_parallel.py. `tests/multirank/test_parity_matrix*.py`,"
            " `tests/test_parity_matrix*.py` and bench/results/<device>.json; output_dir/hf; [runs](docs/runs.md)")
    found = named_paths(text)
    assert found == {"xorl/parallel/parallelize.py", "xorl/nn/tensor_parallel.py", "bench/results/",
                     "tests/multirank/test_parity_matrix*.py", "tests/test_parity_matrix*.py", "docs/runs.md"}
    assert LINK.findall(text) == ["docs/runs.md"] and LINK.findall("[x](https://a.b/c) [y](#z)") == []
    assert sorted(p for p in found if not path_exists(p)) == ["tests/test_parity_matrix*.py",
                                                             "xorl/nn/tensor_parallel.py"]
    names = defined_names(REPO / "xorl/parallel/pipeline_parallel.py")
    assert "_install_stage_hooks" in names and "_install_stage_hook" not in names
    assert "StepPlan.after_backward" in defined_names(REPO / "xorl/parallel/step_plan.py")


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into docs/")
    text = "\n".join(lines)
    assert "bash scripts/train.sh" in text and "bash scripts/test.sh" in text
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text(), "CI runs the README's test command"


# -- the walks from a config field to its collective ------------------------------------------------
# An item of docs/architecture.md's walk section: "- `field` (what, optional): `file` (...) -> `file`
# (...) -> ..., N files". Each segment between arrows names its file first; what follows in brackets
# is commentary (names in it are not files of the walk).
WALK_ITEM = re.compile(r"^- `(\w+)`(?: \(([^)]*)\))?: (.*?), (\d+) files\b", re.S)
# Walks known to be longer than the cap, with why; the test fails (strict) once they are shortened,
# so the docs and this set are updated together.
OVER_THE_CAP = {
    ("tensor_parallel_size", "the column / row linears"):
        "9 files: the layout's style (tp_styles) -> tp_linear -> tp_linear_ops -> tp_matmul -> tp_comm, each one job",
    ("tensor_parallel_size", "the vocabulary-split embedding"):
        "7 files: the layout's style (tp_styles) -> tp_vocab -> tp_regions",
}
HAND_OFF = REPO / "xorl/trainer/trainer.py"  # hands the ParallelState to parallelize.py


def walk_items(text: str) -> list[str]:
    section = text[text.index("## From a config field to its collective"):]
    section = section[:section.index("\n## ", 1)]
    items = []
    for line in section.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        else:
            items.append("")
    return [item for item in items if item]


def parse_walk(item: str) -> tuple[str, str, list[str], str, int]:
    """(field, what, files in order, the last segment's text, the stated count)."""
    match = WALK_ITEM.match(item)
    assert match, f"a walk item not in the walk format: {item[:80]}"
    field, what, body, count = match.group(1), match.group(2) or "", match.group(3), int(match.group(4))
    segments = body.split(" -> ")
    files = []
    for segment in segments:
        first = PATH.search(segment)
        assert first and first.start() <= 1, f"a walk segment that does not start with its file: {segment!r}"
        files.append(first.group(1))
    return field, what, files, segments[-1], count


def imported_files(path: Path) -> set[str]:
    """Repository-relative files of the xorl modules ``path`` imports (at the top or in a function)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    files = set()
    for module in modules:
        stem = module.replace(".", "/")
        files.update(f for f in (f"{stem}.py", f"{stem}/__init__.py") if (REPO / f).exists())
    return files


def linked(a: str, b: str) -> bool:
    """b is the next file of a walk from a: one imports the other, or the trainer imports both."""
    if b in imported_files(REPO / a) or a in imported_files(REPO / b):
        return True
    return {a, b} <= imported_files(HAND_OFF)


def torch_collectives(segment: str) -> set[str]:
    names = set(re.findall(r"`(\w+)`", segment))
    return {n for n in names if callable(getattr(dist, n, None)) or callable(getattr(funcol, n, None))}


WALKS = walk_items(ARCHITECTURE.read_text())


def _walk_id(item: str) -> str:
    field, what = WALK_ITEM.match(item).group(1, 2)
    return f"{field} ({what})" if what else field


def test_the_three_fields_have_walks():
    fields = {WALK_ITEM.match(item).group(1) for item in WALKS}
    assert {"ringattn_parallel_size", "expert_parallel_size", "tensor_parallel_size"} <= fields


@pytest.mark.parametrize("item", WALKS, ids=_walk_id)
def test_each_walk_is_real(item):
    field, _, files, last_segment, count = parse_walk(item)
    assert count == len(files), f"the walk says {count} files and names {len(files)}: {files}"
    missing = [f for f in files if not (REPO / f).exists()]
    assert missing == [], f"walk files that do not exist: {missing}"
    assert re.search(rf"^\s+{field}\s*:", (REPO / files[0]).read_text(), re.M), f"{files[0]} declares no {field}"
    unlinked = [(a, b) for a, b in zip(files, files[1:]) if not linked(a, b)]
    assert unlinked == [], f"consecutive walk files that neither import each other nor meet in the trainer: {unlinked}"
    last = (REPO / files[-1]).read_text()
    called = {n for n in torch_collectives(last_segment) if re.search(rf"\b{n}\(", last)}
    assert called, f"{files[-1]} calls none of the torch collectives the walk names ({torch_collectives(last_segment)})"


def _cap_params():
    for item in WALKS:
        field, what = WALK_ITEM.match(item).group(1, 2)
        why = OVER_THE_CAP.get((field, what or ""))
        marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
        yield pytest.param(item, marks=marks, id=_walk_id(item))


@pytest.mark.parametrize("item", list(_cap_params()))
def test_each_walk_reaches_its_collective_within_the_cap(item):
    _, _, files, _, _ = parse_walk(item)
    assert len(files) <= WALK_MAX_FILES, f"{len(files)} files from the field to its collective: {files}"


def test_the_walk_checks_can_fail():
    item = ("- `tensor_parallel_size`: `xorl/distributed/parallel_config.py` -> `xorl/parallel/parallelize.py` -> "
            "`xorl/nn/ring_attention.py` (`batch_isend_irecv`), 4 files")
    field, _, files, last_segment, count = parse_walk(item)
    assert field == "tensor_parallel_size" and count == 4 and len(files) == 3
    assert linked("xorl/distributed/parallel_config.py", "xorl/distributed/parallel_state.py")  # state imports config
    assert linked("xorl/distributed/parallel_state.py", "xorl/parallel/parallelize.py")  # the trainer's hand-off
    assert not linked("xorl/parallel/parallelize.py", "xorl/nn/ring_attention.py")
    assert torch_collectives(last_segment) == {"batch_isend_irecv"}
    assert not re.search(r"\bbatch_isend_irecv\(", (REPO / files[-1]).read_text())  # it lives in p2p.py
