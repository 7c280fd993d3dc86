"""The package's shape: no import cycle anywhere in ``zoo``, the library never imports the checkout tooling, and
the CLI treats only the zoo's own errors as user errors.

The import graph is built from the source with :mod:`ast`, function-local imports included: a cycle hidden
inside a function is still a cycle (it is how ``python -m zoo.cli bundle`` once got a second ``UsageError``).
"""

from __future__ import annotations

import ast
import os
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


#: The library's layers, bottom up, following the data (text -> tokens -> model -> scoring/generation -> backends ->
#: servers): a module imports only from its own layer or below. A module is placed by the longest prefix that
#: names it; a new module must fall under one (the test says which is missing). The checkout tooling (zoo.tools)
#: sits above all of them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("zoo.errors", "zoo.files", "zoo.formatting", "zoo.version", "zoo.validate", "zoo.device",
                    "zoo.precision", "zoo.captured_step", "zoo.captured_inference")),
    ("text", ("zoo.datasets", "zoo.data")),
    ("tokens", ("zoo.tokenizer",)),
    ("model", ("zoo.registry", "zoo.models", "zoo.lm", "zoo.checkpoint")),
    ("scoring and generation", ("zoo.scoring", "zoo.dynamic", "zoo.generation", "zoo.adaptation")),
    ("backends, loading and training", ("zoo.export", "zoo.backends", "zoo.catalog", "zoo.hub", "zoo.pretrained",
                                        "zoo.model_cache", "zoo.hf", "zoo.training", "zoo")),
    ("services", ("zoo.service", "zoo.corpus", "zoo.completions", "zoo.scheduler", "zoo.lm_eval_plugin",
                  "zoo.lm_eval_tasks")),
    ("command line", ("zoo.cli",)),
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for level, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            under = module == p or (p != "zoo" and module.startswith(p + "."))   # "zoo": the package's own __init__
            if under and (best is None or len(p) > best[1]):
                best = (level, len(p))
    return best[0] if best else None


def test_every_library_module_has_a_layer():
    missing = [m for m in module_names() if not m.startswith("zoo.tools") and layer_of(m) is None]
    assert not missing, f"place these in LAYERS: {missing}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a (layer) imports b (layer)`` for each import of a library module from a higher layer."""
    return [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
            for m, targets in sorted(graph.items()) if not m.startswith("zoo.tools")
            for t in sorted(targets) if not t.startswith("zoo.tools") and layer_of(t) > layer_of(m)]


def test_the_layer_checker_refuses_an_upward_import():
    assert layer_of("zoo.scoring") < layer_of("zoo.service") < layer_of("zoo.cli.score")
    assert layer_of("zoo.models.alstm") == layer_of("zoo.lm")
    assert upward_imports({"zoo.scoring": {"zoo.service"}, "zoo.service": {"zoo.scoring"}}) == [
        "zoo.scoring (scoring and generation) imports zoo.service (services)"]


def test_the_library_imports_only_downward():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


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
