"""The house rules, held at the source level (AST / text, no process groups):

* the training step names no parallelism: the Trainer's files mention no parallel size, group or mesh by
  name (it asks xorl/parallel/step_plan.py's StepPlan);
* the plans (xorl/parallel/, xorl/parallel/parallelize.py) set no undeclared attribute on a module: an
  attribute they assign is one a module class in xorl/ declares in its ``__init__`` (a submodule
  they replace), and they write no ``__dict__`` except where docs/architecture.md's list names it;
* neither the plans nor the xorl/nn code they reach (tests/support/nn_reach.py) change a module from
  outside (another module's attribute, parameter slot, submodule or class) except in the functions
  docs/architecture.md's list names;
* no ``.forward =`` anywhere in xorl/ except the compile step and xorl.hf's tensor-parallel styles (a
  ``tp_plan`` style's contract in transformers is to replace the module's forward: xorl/hf/tensor_parallel.py);
* no forward hook in xorl/parallel/ except in the functions docs/architecture.md's list names;
* no function of ``xorl_kernels`` shares its name with a folder of it (it would hide the package);
* every module of xorl/, xorl_kernels/, bench/ and scripts/ stays readable at a sitting (a line cap).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import nn_reach
from tests.support.paths import REPO

ROOT = REPO
XORL = ROOT / "xorl"
PLAN_FILES = sorted((XORL / "parallel").glob("*.py"))
HOOKS = ("register_forward_hook", "register_forward_pre_hook")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _functions(tree: ast.Module):
    """(function name, node) for every function, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node


def _enclosing(tree: ast.Module) -> dict[int, str]:
    """id(node) -> the name of the outermost module-level function (or class.method) it sits in."""
    owner: dict[int, str] = {}
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(top):
                owner[id(node)] = top.name
        elif isinstance(top, ast.ClassDef):
            for item in top.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(item):
                        owner[id(node)] = f"{top.name}.{item.name}"
    return owner


MECHANISMS_HEADING = "### Where a plan reaches into a module from outside"


def _readme_named(kind: str) -> set[tuple[str, str]]:
    """("parallel/x.py", "function") pairs that docs/architecture.md's list of the mechanisms through
    which a plan reaches into a module (the section under MECHANISMS_HEADING, up to the next heading)
    names for ``kind``: items ``- `xorl/path.py:function`: why`` whose text has ``kind`` as a word
    ("hook" matches "a forward hook", not "FSDP's hooks stay outside")."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index(MECHANISMS_HEADING) + len(MECHANISMS_HEADING):]
    section = section[:section.index("\n#")] if "\n#" in section else section
    items: list[str] = []  # the list items, continuation lines joined
    for line in section.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        elif not line.strip():
            items.append("")
    named = set()
    for item in items:
        # a word, not part of one ("hook", not "hooks"); ".forward" may follow a name ("layer.forward")
        before = r"(?<!\w)" if kind[:1].isalnum() else ""
        after = r"(?!\w)" if kind[-1:].isalnum() else ""
        if re.search(before + re.escape(kind) + after, item):
            named.update(re.findall(r"^- `xorl/([\w/]+\.py):([\w.]+)`", item))
    return named


# -- trainer.py names no parallelism ----------------------------------------------------------------
PARALLEL_NAMES = re.compile(
    r"\b(?:\w*_)?(?:tp|cp|ep|pp|sp|ring|ulysses)_(?:size|group|mesh|rank)\b"
    r"|\b(?:tensor|context|expert|pipeline|sequence)_parallel\w*"
    r"|\bis_(?:first|last)_stage\b|\bring_attention\b|\bzigzag\b"
)


TRAINER_FILES = ("trainer/trainer.py", "trainer/step.py")  # the Trainer and its optimizer step


def test_trainer_names_no_parallelism():
    for name in TRAINER_FILES:
        text = (XORL / name).read_text()
        found = sorted({m.group(0) for m in PARALLEL_NAMES.finditer(text)})
        assert found == [], f"{name} names parallel sizes / groups {found}; ask the StepPlan instead"


def test_the_trainer_check_can_fail():
    assert PARALLEL_NAMES.search("if state.tp_size > 1: dist.all_reduce(x, group=state.pp_group)")
    assert PARALLEL_NAMES.search("config.train.sequence_parallel")
    assert PARALLEL_NAMES.search("self.state.dp_cp_tp_group")
    assert not PARALLEL_NAMES.search("plan.after_backward(loss_sum, aux_sum)")


# -- plans set no undeclared attribute --------------------------------------------------------------
_targets = nn_reach.flat_targets  # tuples unpacked: ``a.x, b.y = ...`` writes two attributes


def _declared_module_attributes() -> set[str]:
    """Names a class in xorl/ declares: assigned as ``self.<name>`` in its ``__init__``, or a class-level
    annotated field (dataclasses)."""
    declared = set()
    for path in XORL.rglob("*.py"):
        tree = _tree(path)
        for name, fn in _functions(tree):
            if name != "__init__":
                continue
            for node in ast.walk(fn):
                for t in _targets(node):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        declared.add(t.attr)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            declared.update(item.target.id for item in cls.body
                            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    return declared


def _root_name(node) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _string_constants(node, scopes) -> set[str] | None:
    """The strings an expression can take: literals in it, or in the value a Name is bound to (in the
    enclosing function or at module level); None when some part is not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        parts = [_string_constants(e, scopes) for e in node.elts]
        return None if any(p is None for p in parts) else set().union(*parts)
    if isinstance(node, ast.IfExp):
        a, b = _string_constants(node.body, scopes), _string_constants(node.orelse, scopes)
        return None if a is None or b is None else a | b
    if isinstance(node, ast.Name):
        for scope in scopes:
            for stmt in ast.walk(scope):
                if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id
                                                        for t in stmt.targets):
                    return _string_constants(stmt.value, scopes)
                if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and stmt.target.id == node.id:
                    return _string_constants(stmt.iter, scopes)
    return None


def _attribute_writes(path: Path):
    """(line, attribute names (None: unresolved), text, enclosing function) of the attribute writes onto
    objects other than ``self`` (autograd ``ctx`` and torch's own config aside)."""
    tree = _tree(path)
    owner = _enclosing(tree)
    functions = {name: fn for name, fn in _functions(tree)}
    for node in ast.walk(tree):
        where = owner.get(id(node), "<module>")
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _root_name(t) not in ("self", "ctx", "torch"):
                yield node.lineno, {t.attr}, ast.unparse(t), where
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            fn = functions.get(where.rpartition(".")[2])
            scopes = [fn, tree] if fn is not None else [tree]
            yield node.lineno, _string_constants(node.args[1], scopes), ast.unparse(node), where


def test_plans_set_only_declared_attributes():
    declared = _declared_module_attributes()
    bad = []
    for path in PLAN_FILES:
        rel = str(path.relative_to(XORL))
        for line, attrs, text, _ in _attribute_writes(path):
            if attrs is None:
                bad.append(f"{rel}:{line}: {text} (a name the check cannot resolve)")
            elif attrs - declared - {"forward"}:  # forward: test_no_forward_assignment_outside_the_compile_step
                bad.append(f"{rel}:{line}: {text} ({sorted(attrs - declared)} declared by no xorl class)")
    assert bad == [], "plans set attributes no module declares:\n" + "\n".join(bad)


def test_the_attribute_check_can_fail(tmp_path):
    sample = tmp_path / "plan.py"
    sample.write_text("NAMES = ('o_proj', 'tp_partial_grads')\n"
                      "def apply(model, tp, layer, n):\n"
                      "    model.tp_partial_grads = tp\n"
                      "    model.lm_head = None\n"
                      "    for name in NAMES:\n"
                      "        setattr(layer, name, None)\n"
                      "    setattr(layer, n.rpartition('.')[2], None)\n")
    declared = _declared_module_attributes()
    writes = [(sorted(a) if a is not None else None, a is not None and a <= declared)
              for _, a, _, _ in _attribute_writes(sample)]
    assert sorted(writes, key=str) == sorted([(["tp_partial_grads"], False), (["lm_head"], True),
                                              (["o_proj", "tp_partial_grads"], False), (None, False)], key=str)


# -- no module changed from outside, by the plans or the nn code they reach ------------------------
NN_FILES = sorted((XORL / "nn").glob("*.py"))


def _reach_ins(plan_files: list[Path], nn_files: list[Path], declared: set[str]) -> list[tuple[str, str, int, str]]:
    """(file under xorl/, owner, line, text) of each change to a module from outside, in the plans and in
    the xorl/nn code they reach."""
    found = []
    for path in plan_files:
        for node in _tree(path).body:
            for owner, line, text in nn_reach.reach_ins_by_owner(node, declared):
                found.append((str(path.relative_to(XORL)), owner, line, text))
    files = {nn_reach.module_name(ROOT, p): p for p in nn_files}
    for (module, _), node in nn_reach.reached_from(plan_files, nn_files, ROOT).items():
        for owner, line, text in nn_reach.reach_ins_by_owner(node, declared):
            found.append((str(files[module].relative_to(XORL)), owner, line, text))
    return found


def test_plans_and_the_nn_code_they_reach_change_modules_only_where_the_readme_names_it():
    named = _readme_named("")
    declared = nn_reach.module_declared_attributes(sorted(XORL.rglob("*.py")))
    found = _reach_ins(PLAN_FILES, NN_FILES, declared)
    bad = [f"{rel}:{line} in {owner}: {text}" for rel, owner, line, text in found if (rel, owner) not in named]
    assert bad == [], ("changes to a module from outside that docs/architecture.md's list does not name "
                       "(make it a constructor argument or an explicit method of the module):\n" + "\n".join(bad))
    other_mechanisms = _readme_named("hook") | _readme_named("__dict__") | _readme_named(".forward")
    gone = named - other_mechanisms - {(rel, owner) for rel, owner, _, _ in found}
    assert gone == set(), f"docs/architecture.md names changes from outside that are gone: {sorted(gone)}"


def test_the_reach_in_check_can_fail(tmp_path):
    """A plan calling an nn helper that swaps a weight, which calls one that sets a submodule's slot; the
    helper's own method on ``self`` and a helper no plan reaches pass."""
    xorl_dir = tmp_path / "xorl"
    (xorl_dir / "parallel").mkdir(parents=True)
    (xorl_dir / "nn").mkdir()
    (xorl_dir / "parallel" / "plan.py").write_text(
        "from xorl.nn.helpers import swap_weight\n"
        "def apply(model):\n"
        "    model.lm_head.weight = model.model.embed_tokens.weight\n"
        "    model.set_submodule('lm_head', None)\n"
        "    swap_weight(model.lm_head)\n")
    (xorl_dir / "nn" / "helpers.py").write_text(
        "from .slots import put\n"
        "class Norm:\n"
        "    def own(self, w):\n"
        "        self.weight = w\n"
        "        setattr(self, 'weight', w)\n"
        "def swap_weight(linear):\n"
        "    linear.weight, linear.bias = None, None\n"
        "    put(linear, Norm())\n"
        "def unreached(linear):\n"
        "    linear.weight = None\n")
    (xorl_dir / "nn" / "slots.py").write_text(
        "def put(module, value):\n"
        "    module._parameters['weight'] = value\n"
        "    setattr(module, 'bias', value)\n"
        "    module.__class__ = type(value)\n")
    plans, nn_files = [xorl_dir / "parallel" / "plan.py"], sorted((xorl_dir / "nn").glob("*.py"))
    reached = nn_reach.reached_from(plans, nn_files, tmp_path)
    assert sorted(reached) == [("xorl.nn.helpers", "Norm"), ("xorl.nn.helpers", "swap_weight"),
                               ("xorl.nn.slots", "put")]
    found = sorted((owner, text) for node in [*_tree(plans[0]).body, *reached.values()]
                   for owner, _, text in nn_reach.reach_ins_by_owner(node, {"weight", "bias"}))
    assert found == sorted([
        ("apply", "model.lm_head.weight"), ("apply", "model.set_submodule('lm_head', None)"),
        ("swap_weight", "linear.weight"), ("swap_weight", "linear.bias"),
        ("put", "module._parameters['weight']"), ("put", "setattr(module, 'bias', value)"),
        ("put", "module.__class__"),
    ]), found


def test_plans_write_no_module_dict_except_where_named():
    named = _readme_named("__dict__")
    bad = []
    for path in PLAN_FILES:
        tree = _tree(path)
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "__dict__":
                where = (str(path.relative_to(XORL)), owner.get(id(node), "<module>"))
                if where not in named:
                    bad.append(f"{where[0]}:{node.lineno} in {where[1]}")
    assert bad == [], f"__dict__ writes the README does not name: {bad}"


# -- no forward replaced ----------------------------------------------------------------------------
def test_no_forward_assignment_outside_the_compile_step():
    found = []
    for path in XORL.rglob("*.py"):
        tree = _tree(path)
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "forward":
                    found.append((str(path.relative_to(XORL)), owner.get(id(node), "<module>")))
    # xorl's own modules are built once with their final forward; the compile step and, on a loaded
    # stock transformers model, xorl.hf's instance patches (where transformers has no kernel hook, one
    # file, undone by remove(): xorl/hf/instance.py) and its tp_plan styles (transformers' TP styles
    # bind a linear's forward: xorl/hf/tensor_parallel.py) are the only places a forward is bound.
    assert sorted(found) == [("hf/instance.py", "_bind"), ("hf/tensor_parallel.py", "_bind"),
                             ("parallel/compile.py", "apply_compile")], found


# -- forward hooks only where the README names them -------------------------------------------------
def test_plan_hooks_only_where_the_readme_names_them():
    named = _readme_named("hook")
    assert named, "the README's What is where names no hook"
    seen, bad = set(), []
    for path in PLAN_FILES:
        tree = _tree(path)
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in HOOKS:
                where = (str(path.relative_to(XORL)), owner.get(id(node), "<module>"))
                seen.add(where)
                if where not in named:
                    bad.append(f"{where[0]}:{node.lineno} {node.attr} in {where[1]}")
    assert bad == [], f"forward hooks in the plans that the README does not name with why: {bad}"
    assert {w for w in named if w[0].startswith("parallel/")} <= seen, "the README names a hook that is gone"


# -- no function hides its package ------------------------------------------------------------------
def _shadowing(package) -> list[str]:
    """Names under which ``package`` binds a function while a subpackage folder has the same name."""
    folders = {p.parent.name for p in Path(package.__file__).parent.glob("*/__init__.py")}
    return sorted(name for name in folders if callable(getattr(package, name, None)))  # a module is not callable


def test_no_kernel_function_shadows_its_package():
    import xorl_kernels

    assert {"attention", "expert_gemm"} <= {p.parent.name for p in (ROOT / "xorl_kernels").glob("*/__init__.py")}
    assert _shadowing(xorl_kernels) == [], "a function of xorl_kernels hides a folder of the same name"


def test_the_shadowing_check_can_fail(tmp_path, monkeypatch):
    """The layout xorl_kernels had while its grouped GEMM folder was named grouped_gemm/."""
    (tmp_path / "shadow_demo" / "op").mkdir(parents=True)
    (tmp_path / "shadow_demo" / "op" / "__init__.py").write_text("def op():\n    pass\n")
    (tmp_path / "shadow_demo" / "__init__.py").write_text("from shadow_demo.op import op\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import shadow_demo

    assert _shadowing(shadow_demo) == ["op"]


# -- every module stays small ---------------------------------------------------------------------
# Files of 470-770 lines were split so that one file holds one concept. The cap holds every module,
# so none grows into another's job (split again, by concept, rather than raise it).
LINE_CAP = 450
CAPPED_FOLDERS = ("xorl", "xorl_kernels", "bench", "scripts")


def _over_the_cap(root: Path) -> dict[str, int]:
    lines = {str(path.relative_to(root)): len(path.read_text().splitlines())
             for folder in CAPPED_FOLDERS for path in sorted((root / folder).rglob("*.py"))}
    return {name: n for name, n in lines.items() if n > LINE_CAP}


def test_every_module_stays_under_the_line_cap():
    assert len(list((ROOT / "xorl").rglob("*.py"))) > 100  # the folders are where this test looks
    over = _over_the_cap(ROOT)
    assert over == {}, f"over {LINE_CAP} lines: {over}; split by concept"


def test_the_line_cap_check_can_fail(tmp_path):
    (tmp_path / "xorl" / "deep").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "xorl" / "deep" / "long.py").write_text("x = 1\n" * (LINE_CAP + 1))
    (tmp_path / "scripts" / "short.py").write_text("x = 1\n" * LINE_CAP)
    assert _over_the_cap(tmp_path) == {"xorl/deep/long.py": LINE_CAP + 1}
