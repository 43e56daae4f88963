"""megarl's modules in the layers docs/design.md writes down ("## Layers"): no import, at module level or
inside a function, runs from a lower layer to a higher one, no chain of imports comes back to where it started
(a circle, within a layer too), and every module of megarl/ is in a layer. Why: the document's section.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

# The layers, lowest first, as docs/design.md writes them down (its "## Layers" section, the one place).
DESIGN = ROOT / "docs" / "design.md"


def read_layers(path: Path = DESIGN) -> list[tuple[str, list[str]]]:
    """[(layer, [module entries])] from the fenced block of the document's "## Layers" section, one
    `layer: entry entry ...` line per layer (indented lines go on with the one above)."""
    text = path.read_text()
    section = text[text.index("\n## Layers\n"):]
    block = section[section.index("```text\n") + len("```text\n"):]
    block = block[:block.index("```")]
    layers = []
    for line in block.strip().splitlines():
        if line[:1].isspace():  # an indented line goes on with the layer above
            layers[-1][1].extend(line.split())
            continue
        name, _, entries = line.partition(":")
        layers.append((name.strip(), entries.split()))
    return layers


LAYERS = read_layers()


def module_files(package_dir: Path) -> dict[str, Path]:
    """{dotted module name: file} for every .py under `package_dir` (a package's name for its __init__)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]):
    """(line, imported module) for every import in the file, at any depth, of a module in `modules`:
    `from p import x` is the module p.x when there is one, else p."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = known(target)
            if resolved and resolved != name:
                yield node.lineno, resolved


def layer_index(layers) -> dict[str, int]:
    return {entry: rank for rank, (_, entries) in enumerate(layers) for entry in entries}


def layer_of(name: str, index: dict[str, int], root: str) -> int | None:
    entries = [entry for entry in index if name == entry or (entry != root and name.startswith(entry + "."))]
    return index[max(entries, key=len)] if entries else None


def violations(package_dir: Path, layers) -> list[str]:
    """One line per upward import ("file:line: a (layer) imports b (layer)"), per module in no layer,
    and per layer entry that names no module."""
    modules = module_files(package_dir)
    index, names, root = layer_index(layers), [layer for layer, _ in layers], package_dir.name
    problems = [f"layer entry {entry!r} names no module under {package_dir.name}/" for entry in index
                if not any(module == entry or module.startswith(entry + ".") for module in modules)]
    for name, path in modules.items():
        rank = layer_of(name, index, root)
        if rank is None:
            problems.append(f"{path.relative_to(package_dir.parent)}: {name} is in no layer "
                            "(add it to docs/design.md's Layers)")
            continue
        for line, target in imports_of(name, path, modules):
            target_rank = layer_of(target, index, root)
            if target_rank is not None and target_rank > rank:
                problems.append(f"{path.relative_to(package_dir.parent)}:{line}: {name} ({names[rank]}) imports "
                                f"{target} ({names[target_rank]})")
    return problems


def circles(package_dir: Path) -> list[str]:
    """One line per circle of imports among the package's modules ("a -> b -> a"), at any depth (imports inside
    functions count: a circle made lazy is still two modules that cannot be understood apart), each circle once.
    A package loading its own submodules (a registry's __init__ importing the built-in entries, which import
    the registry to register) is not counted: the package is those modules."""
    modules = module_files(package_dir)
    graph = {name: sorted({target for _, target in imports_of(name, path, modules) if not target.startswith(name + ".")})
             for name, path in modules.items()}
    found, done = set(), set()

    def walk(name: str, trail: list[str]):
        if name in trail:
            circle = trail[trail.index(name):]
            start = circle.index(min(circle))  # one rotation per circle
            found.add(" -> ".join(circle[start:] + circle[:start] + [min(circle)]))
            return
        if name in done:
            return
        for target in graph.get(name, ()):
            walk(target, trail + [name])
        done.add(name)

    for name in graph:
        walk(name, [])
    return sorted(found)


def test_no_circle_of_imports():
    found = circles(ROOT / "megarl")
    assert not found, "\n".join(found)


def test_the_circle_check_finds_a_lazy_circle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import thing\n")
    (package / "c.py").write_text("from pkg import a\n")
    (package / "reg").mkdir()
    (package / "reg" / "__init__.py").write_text("from pkg.reg import entry\n")  # a registry loading its entries
    (package / "reg" / "entry.py").write_text("from pkg.reg import thing\n")
    assert circles(package) == ["pkg.a -> pkg.b -> pkg.a"]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    problems = violations(ROOT / "megarl", LAYERS)
    assert not problems, "\n".join(problems)


def test_the_check_reports_each_upward_import_by_file_and_line(tmp_path):
    """The checker on a small package: an upward import inside a function and a relative one are
    found at their lines, a downward and a same-layer one are not, and so is an unplaced module."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "util.py").write_text("import os\n\n\ndef f():\n    from pkg import high\n    return high\n")
    (package / "low" / "other.py").write_text("from . import util\nfrom ..high import thing\n")
    (package / "high.py").write_text("from pkg.low import util\nthing = 1\n")
    (package / "stray.py").write_text("")
    layers = [("low", ["pkg", "pkg.low"]), ("high", ["pkg.high"])]
    assert violations(package, layers) == [
        "pkg/low/other.py:2: pkg.low.other (low) imports pkg.high (high)",
        "pkg/low/util.py:5: pkg.low.util (low) imports pkg.high (high)",
        "pkg/stray.py: pkg.stray is in no layer (add it to docs/design.md's Layers)",
    ]
    assert violations(package, layers + [("gone", ["pkg.gone"])])[0] == "layer entry 'pkg.gone' names no module under pkg/"
