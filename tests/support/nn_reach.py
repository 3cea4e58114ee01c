"""Static reading for tests/architecture/test_house_rules.py: which xorl/nn functions and classes the
plans (xorl/parallel/) reach, and where code changes a module from outside.

Reach: every name a plan imports from an ``xorl.nn`` module (at the top or inside a function), then,
transitively, every top-level function or class of xorl/nn that a reached one names (a call, a base
class, a value passed on), through the imports of its own file. A class counts whole (its methods).
Names reached only through an attribute of an object (``self.experts.distribute_over``) are found
where the object's class is named (``GroupedExperts`` in ``MoE.__init__``).

Reaching into a module from outside, in the code read: an attribute assignment or ``setattr`` on an
object other than ``self`` itself (``self.child.x = ...`` counts: it is the child's attribute) whose
name a module class of xorl declares, or that the check cannot resolve; a ``__class__`` assignment;
a write into ``._parameters`` / ``._modules`` / ``._buffers`` of another object; a call of
``register_parameter`` / ``register_buffer`` / ``register_module`` / ``add_module`` / ``set_submodule``
on another object. ``ctx`` (autograd) and ``torch`` (its config) are not modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

NOT_MODULES = ("ctx", "torch")
SLOT_DICTS = ("_parameters", "_modules", "_buffers")
SLOT_CALLS = ("register_parameter", "register_buffer", "register_module", "add_module", "set_submodule")
TORCH_MODULES = ("Module", "Linear", "Embedding", "ModuleList", "ModuleDict", "Sequential", "Identity", "Dropout")


def module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _imports(tree: ast.AST, this: str) -> dict[str, tuple[str, str]]:
    """local name -> (module, name) for every ``from M import name [as local]`` in ``tree``."""
    package = this.rpartition(".")[0]
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found[alias.asname or alias.name] = (base, alias.name)
    return found


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level functions, classes and assignments (a table of functions, ``TP_STYLES``) by name."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:
        for t in flat_targets(node):
            if isinstance(t, ast.Name):
                defs.setdefault(t.id, node)
    return defs


def reached_from(plan_files: list[Path], nn_files: list[Path], root: Path) -> dict[tuple[str, str], ast.AST]:
    """(xorl.nn module, top-level name) -> its node, for everything the plans reach (module docstring)."""
    trees = {module_name(root, p): ast.parse(p.read_text(), filename=str(p)) for p in nn_files}
    defs = {m: _definitions(t) for m, t in trees.items()}
    imports = {m: _imports(t, m) for m, t in trees.items()}
    todo = []
    for plan in plan_files:
        todo += [target for target in _imports(ast.parse(plan.read_text()), module_name(root, plan)).values()
                 if target[0] in trees]
    reached: dict[tuple[str, str], ast.AST] = {}
    while todo:
        mod, name = todo.pop()
        node = defs.get(mod, {}).get(name)
        if node is None or (mod, name) in reached:
            continue
        reached[(mod, name)] = node
        for ref in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
            if ref in defs[mod]:
                todo.append((mod, ref))
            elif ref in imports[mod] and imports[mod][ref][0] in trees:
                todo.append(imports[mod][ref])
    return reached


def module_declared_attributes(files: list[Path]) -> set[str]:
    """Names a module class of xorl (an nn.Module subclass, by its bases' names) assigns as ``self.<name>``
    in its ``__init__``."""
    classes = [c for p in files for c in ast.walk(ast.parse(p.read_text())) if isinstance(c, ast.ClassDef)]
    modules, grew = set(TORCH_MODULES), True
    while grew:
        before = len(modules)
        modules |= {c.name for c in classes if any(ast.unparse(b).rpartition(".")[2] in modules for b in c.bases)}
        grew = len(modules) > before
    declared = set()
    for cls in classes:
        if cls.name not in modules or cls.name in TORCH_MODULES:
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                for node in ast.walk(fn):
                    for t in flat_targets(node):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            declared.add(t.attr)
    return declared


def flat_targets(node) -> list:
    """The assignment targets of ``node``, tuples and lists unpacked (``a.x, b.y = ...``)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    else:
        return []
    flat = []
    while targets:
        t = targets.pop(0)
        if isinstance(t, (ast.Tuple, ast.List)):
            targets[:0] = t.elts
        else:
            flat.append(t)
    return flat


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _root(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _strings(node) -> set[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    return None


def reach_ins(node: ast.AST, declared: set[str], attributes: bool = True):
    """(line, text) of every place in ``node`` that changes a module from outside (module docstring);
    ``attributes`` False: only the slot writes, slot calls and ``__class__`` (the plans' attribute
    assignments have a rule of their own)."""
    for sub in ast.walk(node):
        for t in flat_targets(sub):
            if isinstance(t, ast.Attribute) and not _is_self(t.value) and _root(t) not in NOT_MODULES:
                if t.attr == "__class__" or (attributes and t.attr in declared):
                    yield sub.lineno, ast.unparse(t)
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and \
                    t.value.attr in SLOT_DICTS and not _is_self(t.value.value):
                yield sub.lineno, ast.unparse(t)
        if not isinstance(sub, ast.Call):
            continue
        if attributes and isinstance(sub.func, ast.Name) and sub.func.id == "setattr" and len(sub.args) >= 2 \
                and not _is_self(sub.args[0]) and _root(sub.args[0]) not in NOT_MODULES:
            names = _strings(sub.args[1])
            if names is None or names & declared:
                yield sub.lineno, ast.unparse(sub)
        if isinstance(sub.func, ast.Attribute) and sub.func.attr in SLOT_CALLS and not _is_self(sub.func.value):
            yield sub.lineno, ast.unparse(sub)


def reach_ins_by_owner(node: ast.AST, declared: set[str], attributes: bool = True):
    """(owner, line, text) for a top-level function (owner: its name) or class (owner: "Class.method");
    a top-level assignment is read as "<module>"."""
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for line, text in reach_ins(item, declared, attributes):
                    yield f"{node.name}.{item.name}", line, text
    else:
        for line, text in reach_ins(node, declared, attributes):
            yield getattr(node, "name", "<module>"), line, text
