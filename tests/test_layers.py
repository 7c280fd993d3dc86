"""The package's shape: no import cycle anywhere in ``zoo``, the library never imports the checkout tooling, and
the CLI treats only the zoo's own errors as user errors.

The import graph is built from the source with :mod:`ast`, function-local imports included: a cycle hidden
inside a function is still a cycle (it is how ``python -m zoo.cli bundle`` once got a second ``UsageError``).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "zoo"


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the zoo it imports`` (any ``import``/``from ... import`` anywhere in the file)."""
    mods = module_names()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # "from zoo.x import y" imports zoo.x.y when y is a module, else zoo.x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t == "zoo" or t.startswith("zoo."):
                    o = owner(t)
                    if o and o != mod:
                        graph[mod].add(o)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_builder_sees_function_local_imports_and_cycles():
    """The checker itself: a cycle through a function-local import is found (so the next test can fail)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "zoo.errors" in graph["zoo.cli"]          # a top-level import
    assert "zoo.models._compiled" in graph["zoo.cli.build_ext"]  # an import inside a function


def test_no_import_cycle_in_zoo():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_never_imports_checkout_tooling():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith("zoo.tools")) for m, ts in graph.items()
           if not m.startswith("zoo.tools")}
    assert not {m: ts for m, ts in bad.items() if ts}


#: ``zoo serve``'s modules, lowest first: a module imports only modules of the layers before its own.
SERVE_LAYERS = (("config", "probe", "front_door", "supervise"), ("archive", "keys"), ("health", "launch"),
                ("lifecycle",), ("cli",))


def test_serve_package_imports_only_downward():
    """Every module of zoo.tools.serve has a layer (a new one must be placed), imports only lower layers, and the
    package's ``__init__`` imports none of them (each name is imported from the module that owns it)."""
    graph, pkg = import_graph(), "zoo.tools.serve"
    layer = {f"{pkg}.{m}": i for i, mods in enumerate(SERVE_LAYERS) for m in mods}
    assert {m for m in graph if m.startswith(pkg + ".")} == set(layer)
    assert not {t for t in graph[pkg] if t.startswith(pkg)}
    upward = {m: sorted(t for t in graph[m] if t in layer and layer[t] >= layer[m]) for m in layer}
    assert not {m: ts for m, ts in upward.items() if ts}


#: The CLI package's shared helpers; every other module of ``zoo.cli`` is one command.
CLI_HELPERS = {"zoo.cli", "zoo.cli.__main__", "zoo.cli.parser", "zoo.cli.inputs", "zoo.cli.options"}


def test_the_cli_sits_at_the_top_of_the_library():
    """Nothing in the library imports the CLI (it is above scoring, generation, backends and export; checkout
    tooling reaches it through the entry point), and within it the helpers never import a command, nor one
    command another (each command is a module of its own)."""
    graph = import_graph()
    cli = {m for m in graph if m == "zoo.cli" or m.startswith("zoo.cli.")}
    assert {"zoo.cli.score", "zoo.cli.train", "zoo.cli.inputs"} <= cli  # (the package the test knows)
    assert {m: sorted(graph[m] & cli) for m in graph if m not in cli and graph[m] & cli} == {}
    commands = cli - CLI_HELPERS
    offenders = {m: sorted(graph[m] & commands) for m in cli if m != "zoo.cli" and graph[m] & commands}
    assert offenders == {}, "only zoo.cli (the parser's assembly) imports the command modules"
    assert "zoo.cli" in graph["zoo.cli.__main__"] and graph["zoo.cli"] >= commands


def _defining_module(parser) -> str:
    """The module of the function a sub-parser runs (for a command with sub-commands, its first one's)."""
    while parser.get_default("func") is None and parser._subparsers is not None:
        parser = next(iter(parser._subparsers._group_actions[0].choices.values()))
    return parser.get_default("func").__module__


def test_every_command_is_listed_with_the_module_that_defines_it():
    """``zoo.cli.COMMANDS`` and ``CHECKOUT_COMMANDS`` are the one listing of where each command lives (as
    huggingface_hub's ``hf.py``): every sub-command of ``zoo`` is in it, and its module is the one whose function
    runs it."""
    from zoo import cli

    parser = cli.build_parser()
    for add in cli._plugin_commands():
        add(parser.subparsers)
    listed = {**{n: m.__name__ for n, m in cli.COMMANDS.items()}, **cli.CHECKOUT_COMMANDS}
    assert {n: _defining_module(sp) for n, sp in parser.subparsers.choices.items()} == listed
    assert list(parser.subparsers.choices)[:len(cli.COMMANDS)] == list(cli.COMMANDS)
    assert all(m.startswith("zoo.cli.") for m in map(lambda m: m.__name__, cli.COMMANDS.values()))


def test_library_holds_no_repository_relative_path():
    """Outside zoo.tools, nothing resolves a path above the package (the repository's folders)."""
    offenders = []
    for mod, path in module_names().items():
        if mod.startswith("zoo.tools"):
            continue
        text = path.read_text(encoding="utf-8")
        for needle in ("parent.parent.parent", "parents[2]", "parents[3]", '"shared"', '"model_cards"', '"serving"'):
            if needle in text:
                offenders.append(f"{mod}: {needle}")
    assert not offenders


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "ZOO_DEBUG"}
    return subprocess.run([sys.executable, "-m", "zoo.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**base, **env}, timeout=120)


def test_cli_user_error_is_one_line_exit_2_even_under_dash_m(tmp_path):
    """``python -m zoo.cli bundle`` on a folder that is not a run: the bug of the import cycle (a second
    ``UsageError`` class under ``-m``) printed a traceback and exited 1."""
    res = _cli("bundle", str(tmp_path / "missing-run"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("zoo: error:")


def test_zoo_debug_shows_the_traceback_of_a_user_error(tmp_path):
    res = _cli("bundle", str(tmp_path / "missing-run"), ZOO_DEBUG="1")
    assert res.returncode == 1 and "Traceback" in res.stderr


def test_a_bug_is_not_disguised_as_a_user_error(capsys, monkeypatch):
    """An exception that is not a ZooError (here a ValueError from inside the library) keeps its traceback."""
    from zoo import cli

    def broken(args):
        raise ValueError("a bug inside the library")

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), broken))
    with pytest.raises(ValueError, match="a bug inside the library"):
        cli.main(["list"])


def _with_func(parser, func):
    parser.subparsers.choices["list"].set_defaults(func=func)
    return parser


def test_checkout_commands_come_from_the_entry_point():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="alstm_zoo.commands")}
    assert eps.get("checkout") == "zoo.tools.commands:add"
    res = _cli("--help")
    assert res.returncode == 0 and all(c in res.stdout for c in ("serve", "bundle", "publish", "download"))


#: The library's floors, bottom up, following the data (text -> tokens -> model -> scoring/generation -> backends ->
#: servers), one per floor the code really has: a module imports only from floors below its own, never from a
#: sibling on its floor (a module, or a package, placed beside it); inside a package the order is
#: :data:`PACKAGE_FLOORS`'. A module is placed by the longest prefix that names it; a new module must fall under
#: one (the test says which is missing). The checkout tooling (zoo.tools) sits above all of them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("zoo.errors", "zoo.files", "zoo.formatting", "zoo.version")),
    ("runtime: device, precision, argument checks, CUDA graphs of inference",
     ("zoo.device", "zoo.precision", "zoo.validate", "zoo.captured_inference")),
    ("text: the datasets' registry", ("zoo.datasets",)),
    ("text: corpora", ("zoo.data",)),
    ("tokens", ("zoo.tokenizer",)),
    ("model: architectures", ("zoo.models",)),
    ("model: the architecture registry", ("zoo.registry",)),
    ("model: the language model", ("zoo.lm",)),
    ("model: checkpoints", ("zoo.checkpoint",)),
    ("dynamic evaluation", ("zoo.dynamic",)),
    ("scoring", ("zoo.scoring", "zoo.adaptation")),
    ("generation", ("zoo.generation",)),
    ("training", ("zoo.training",)),
    ("exports", ("zoo.export",)),
    ("backends", ("zoo.backends",)),
    ("the catalogue", ("zoo.catalog",)),
    ("the Hub", ("zoo.hub",)),
    ("ready-to-use models", ("zoo.zoo_model",)),
    ("the package and its adapters", ("zoo", "zoo.model_cache", "zoo.hf")),
    ("the wire", ("zoo.api",)),
    ("the harness: the model", ("zoo.lm_eval_plugin",)),
    ("the harness: its tasks", ("zoo.lm_eval_tasks",)),
    ("corpus jobs", ("zoo.corpus",)),
    ("command line", ("zoo.cli",)),
]

#: The floors inside the packages, lowest first (``""``: the package's ``__init__``, its face, on top): a module
#: imports only modules of its package on lower floors. Every module of each package must be placed. (``zoo.cli``
#: and ``zoo.tools.serve`` have their own tests above.)
PACKAGE_FLOORS: dict[str, tuple[tuple[str, ...], ...]] = {
    "zoo.models": (("_gemm", "_fused", "_compiled", "_pnorm_gates"),            # kernels and the C++ loops' build
                   ("base", "adaptive_linear"),                                  # the protocol, the adaptive layer
                   ("_alstm_plan", "_fused_loss", "_gru_fast", "_hyper_fast"),   # fast paths
                   ("_alstm_infer", "_alstm_train"), ("_alstm_fast",),
                   ("lstm", "alstm", "hyperlstm", "pnorm_gru"),                  # the architectures
                   ("",)),
    "zoo.training": (("recipe", "callbacks", "captured_step", "distributed", "divergence", "evaluation", "loggers",
                      "signals"),
                     ("batches", "checkpoint_saver", "objective", "optimizers", "release"),
                     ("trainer",), ("",)),
    "zoo.export": (("common", "formats"), ("onnx_graphs", "torchscript", "verify"), ("onnx_runtime",), ("",)),
    "zoo.hf": (("configuration", "stopping"), ("modeling",), ("tokenization",), ("pipeline",), ("",)),
    "zoo.corpus": (("records", "output"), ("summary", "shard"), ("engines",), ("job", "datatrove_blocks"), ("",)),
    "zoo.api": (("http",), ("service",), ("dialects",), ("native", "completions"), ("scheduler",), ("",)),
    "zoo.tools.demo": (("guard", "render", "stats"), ("registry",), ("handlers",), ("ui",), ("launch",), ("",)),
    "zoo.tools.gpu": (("ferry",), ("runpack",), ("piece",), ("",)),
    "zoo.tools.release": (("cards",), ("bundle",), ("publish",), ("",)),
}


def placement(module: str) -> tuple[int, str] | None:
    """``(floor, prefix)`` of a library module: the floor of the longest prefix that names it, and that prefix."""
    best: tuple[int, str] | None = None
    for level, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            under = module == p or (p != "zoo" and module.startswith(p + "."))   # "zoo": the package's own __init__
            if under and (best is None or len(p) > len(best[1])):
                best = (level, p)
    return best


def layer_of(module: str) -> int | None:
    found = placement(module)
    return found[0] if found else None


def test_every_library_module_has_a_layer():
    missing = [m for m in module_names() if not m.startswith("zoo.tools") and layer_of(m) is None]
    assert not missing, f"place these in LAYERS: {missing}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a (floor) imports b (floor)`` for each import of a library module from a higher floor, or from a sibling
    on its own floor (another module or package placed on it)."""
    out = []
    for m, targets in sorted(graph.items()):
        if m.startswith("zoo.tools"):
            continue
        (lm, pm) = placement(m)
        for t in sorted(targets):
            if t.startswith("zoo.tools"):
                continue
            (lt, pt) = placement(t)
            if lt > lm or (lt == lm and pt != pm):
                out.append(f"{m} ({LAYERS[lm][0]}) imports {t} ({LAYERS[lt][0]})")
    return out


def test_the_layer_checker_refuses_an_upward_import():
    assert layer_of("zoo.scoring") < layer_of("zoo.api.service") < layer_of("zoo.cli.score")
    assert layer_of("zoo.models.alstm") < layer_of("zoo.registry") < layer_of("zoo.lm")
    assert upward_imports({"zoo.scoring": {"zoo.api.service"}, "zoo.api.service": {"zoo.scoring"}}) == [
        "zoo.scoring (scoring) imports zoo.api.service (the wire)"]
    assert upward_imports({"zoo.scoring": {"zoo.adaptation"}, "zoo.adaptation": set()}) == [
        "zoo.scoring (scoring) imports zoo.adaptation (scoring)"]           # a sibling on its floor
    assert upward_imports({"zoo.training.trainer": {"zoo.training.recipe"}, "zoo.training.recipe": set()}) == []


def test_the_library_imports_only_downward():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


def package_problems(graph: dict[str, set[str]], pkg: str, floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """What breaks :data:`PACKAGE_FLOORS` in ``pkg``: a module of it without a floor (or a floor naming no module),
    and an import of a module of the package on the same or a higher floor."""
    floor = {(f"{pkg}.{m}" if m else pkg): i for i, mods in enumerate(floors) for m in mods}
    members = {m for m in graph if m == pkg or m.rpartition(".")[0] == pkg}
    problems = [f"{m}: no floor in PACKAGE_FLOORS[{pkg!r}]" for m in sorted(members - set(floor))]
    problems += [f"{m}: placed in PACKAGE_FLOORS[{pkg!r}], but no such module" for m in sorted(set(floor) - members)]
    for m in sorted(members & set(floor)):
        problems += [f"{m} imports {t} (not below it in {pkg})" for t in sorted(graph[m])
                     if t in floor and floor[t] >= floor[m]]
    return problems


def test_the_package_checker_refuses_an_unplaced_module_and_a_sideways_import():
    graph = {"zoo.x": set(), "zoo.x.a": set(), "zoo.x.b": {"zoo.x.a"}, "zoo.x.c": {"zoo.x.b"}}
    assert package_problems(graph, "zoo.x", (("a",), ("b", "c"), ("",))) == [
        "zoo.x.c imports zoo.x.b (not below it in zoo.x)"]
    assert package_problems(graph, "zoo.x", (("a",), ("b",), ("",))) == ["zoo.x.c: no floor in PACKAGE_FLOORS['zoo.x']"]


@pytest.mark.parametrize("pkg", sorted(PACKAGE_FLOORS))
def test_each_package_is_ordered_inside(pkg):
    problems = package_problems(import_graph(), pkg, PACKAGE_FLOORS[pkg])
    assert not problems, "\n".join(problems)


#: The page that names every module (docs/develop/layout.md), kept current by the next tests.
LAYOUT_DOC = REPO / "docs" / "develop" / "layout.md"


def layout_problems(text: str, files: set[str]) -> list[str]:
    """What layout.md gets wrong about ``files`` (the modules and scripts under ``zoo/``, paths from the repository
    root): one it does not name, and a name of it that is no file. A table row names a file by its path, or by its
    file name when the row's first cell names the folder it is in (``| `zoo/api/` | ... `http.py` ... |``) or it is
    at the root; a package's ``__init__.py`` is named by its folder in a first cell."""
    named: set[str] = set()
    problems = []
    for row in (line for line in text.splitlines() if line.startswith("| `")):
        folders = [f for f in re.findall(r"`([^`]+)`", row.split("|")[1]) if f.endswith("/")]
        named.update(f + "__init__.py" for f in folders)
        for token in re.findall(r"`([^`\s]+\.(?:py|sh))`", row):
            candidates = [token] if "/" in token else [f + token for f in folders] + [token]  # (or at the root)
            hits = [c for c in candidates if c in files or (REPO / c).is_file()]
            named.update(hits)
            if not hits:
                problems.append(f"layout.md names {token}, which is no file (looked for {', '.join(candidates)})")
    problems += [f"{f}: not named in layout.md" for f in sorted(files - named)]
    return problems


def zoo_files() -> set[str]:
    return {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*") if p.suffix in (".py", ".sh")
            and "__pycache__" not in p.parts}


def test_the_layout_checker_finds_an_unnamed_module_and_a_stale_name():
    files = {"zoo/a/__init__.py", "zoo/a/b.py", "zoo/c.py"}
    assert layout_problems("| `zoo/a/`, `zoo/c.py` | `b.py` |", files) == []
    assert layout_problems("| `zoo/a/` | `b.py`, `gone.py` |", files) == [
        "layout.md names gone.py, which is no file (looked for zoo/a/gone.py, gone.py)",
        "zoo/c.py: not named in layout.md"]


def test_layout_md_names_every_module_and_only_modules_that_exist():
    problems = layout_problems(LAYOUT_DOC.read_text(encoding="utf-8"), zoo_files())
    assert not problems, "\n".join(problems)


def test_a_plain_install_names_where_the_checkout_commands_are(capsys, monkeypatch):
    """Without the checkout tooling (a wheel does not ship zoo.tools, so its entry point fails to import), the
    commands it would add answer in one line where to find them, and the library's commands still run."""
    import importlib.metadata

    from zoo import cli

    missing = importlib.metadata.EntryPoint(name="checkout", value="zoo.not_shipped:add", group=cli.COMMANDS_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [missing] if group == cli.COMMANDS_GROUP
                        else [])
    for command in cli.CHECKOUT_COMMANDS:
        assert cli.main([command, "--help"]) == 2
        err = capsys.readouterr().err
        assert err == (f"zoo: error: `zoo {command}` is checkout tooling (zoo.tools), not part of the installed "
                       "library: run it from a clone of the repository (`make venv`)\n")
    assert cli.main(["list", "--architectures", "--json"]) == 0
    assert "alstm" in capsys.readouterr().out
