"""The compiled (C++) inference loops: built on first use, cached, and optional.

Why a C++ extension: at the batch sizes of scoring and generation (1 to 8 rows), an aLSTM or HyperLSTM
step is dozens of tiny tensor operations whose Python dispatch costs more than their arithmetic (see
``benchmarks/cells.py --profile``). ``zoo/models/csrc/*.cpp`` runs the same loop in C++; the matrix
products stay ATen calls, so the numbers agree with the Python path to float rounding
(``tests/test_fast_paths.py`` checks it).

Building: ``torch.utils.cpp_extension.load`` compiles the source with the system C++ compiler the first
time it is needed (under a minute per loop) into a cache folder keyed by what changes the binary: the source's
hash, the flags, the torch install, the Python and the compiler (its ``--version``) (``$ZOO_EXTENSIONS_DIR``,
default ``~/.cache/alstm-zoo/extensions``). Later processes import the built library directly, in well under a
second, without asking the build tool: torch's ``load`` runs ``ninja`` even when the library exists, and two
ninja versions (a venv's 1.13, the system's 1.11) each consider the other's build log stale, so every switch
rebuilt the loop (~27 s), once inside a freshly started server's first request. ``make`` builds the loops at
install time (``zoo build-ext``), so neither the demo nor the server pays the compile on a request.

Optional by design: without a compiler, or with ``ZOO_NO_EXTENSIONS=1``, everything runs the Python fast
path (same numbers, slower); :func:`status` says which is in use and why.

Shipped built: a platform wheel (``zoo/tools/wheel_build.py``, the way PyTorch extensions ship) carries the loops
compiled at wheel-build time in ``zoo/models/_prebuilt/`` with ``build.json``, what they were built for (torch,
Python, flags, platform: :func:`build_key`). Where all of it matches they are imported as they are, so the wheel
needs no compiler at first use; where it does not (another torch), the first use builds, as the pure-Python
wheel does, and says why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = {"alstm_infer": _CSRC / "alstm_infer.cpp", "hyper_infer": _CSRC / "hyper_infer.cpp"}
#: What each loop is, for the messages.
TITLES = {"alstm_infer": "the aLSTM's C++ inference loop", "hyper_infer": "the HyperLSTM's C++ inference loop"}
#: Where a platform wheel carries its built loops (absent in a checkout and in the pure-Python wheel).
PREBUILT = Path(__file__).resolve().parent / "_prebuilt"


def _cflags() -> list[str]:
    """``-O3``, plus the vector ISA PyTorch itself dispatches to on this CPU (the elementwise loops then
    use 256-bit registers); part of the cache key, so a cache shared between machines stays correct."""
    flags = ["-O3"]
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


CFLAGS = _cflags()

_lock = threading.Lock()
_python_only = False  # set by python_only(): benchmarks time the Python loop in the same process
_loaded: dict[str, ModuleType | None] = {}
_info: dict[str, dict[str, Any]] = {}


def disabled() -> bool:
    return os.environ.get("ZOO_NO_EXTENSIONS", "") not in ("", "0")


def get(name: str) -> ModuleType | None:
    """The compiled module for a caller about to use it: None under :func:`python_only`, else :func:`load`."""
    return None if _python_only else load(name)


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """Within this block the callers run their Python loops (``benchmarks/cells.py`` times both)."""
    global _python_only
    previous, _python_only = _python_only, True
    try:
        yield
    finally:
        _python_only = previous


def cache_dir() -> Path:
    root = os.environ.get("ZOO_EXTENSIONS_DIR") or Path.home() / ".cache" / "alstm-zoo" / "extensions"
    return Path(root)


@functools.cache
def compiler_id() -> str:
    """The C++ compiler torch builds with and its ``--version`` (another compiler makes another binary)."""
    from torch.utils import cpp_extension

    cxx = cpp_extension.get_cxx_compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unavailable"
    return f"{cxx} {version.strip()}"


def _build_dir(name: str) -> tuple[Path, str]:
    """The build folder and module name of ``name``: keyed by what changes the binary: the source, the flags,
    this torch install (its version and location: the build's include paths point into it, so two venvs must not
    share one), the Python and the compiler; never the build tool (ninja), which changes nothing in it."""
    src = SOURCES[name]
    key = hashlib.sha256(src.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()
                         + str(Path(torch.__file__).resolve()).encode() + sys.version.encode()
                         + compiler_id().encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}", f"zoo_{name}_{key}"


def _import_built(build_dir: Path, module_name: str) -> ModuleType | None:
    """The already-built library, imported directly (no build tool consulted), or None when there is none or it
    does not import (a build killed mid-link: then it is rebuilt)."""
    path = build_dir / f"{module_name}.so"
    spec = importlib.util.spec_from_file_location(module_name, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        return None
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError):
        return None
    return mod


def _library_mtime(build_dir: Path) -> float | None:
    libs = list(build_dir.glob("*.so"))
    return max(p.stat().st_mtime for p in libs) if libs else None


def load(name: str, verbose: bool = False) -> ModuleType | None:
    """The compiled module ``name`` (building it if needed), or None when it cannot be had; the reason
    is in :func:`status` and, the first time, a warning."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if disabled():
            _info[name] = {"available": False, "reason": "disabled by ZOO_NO_EXTENSIONS"}
            _loaded[name] = None
            return None
        start = time.perf_counter()
        mod, why_not = _prebuilt(name)
        if mod is not None:
            _info[name] = {"available": True, "path": str(PREBUILT), "compiled_now": False, "prebuilt": True,
                           "seconds": time.perf_counter() - start}
            _loaded[name] = mod
            return mod
        build_dir, module_name = _build_dir(name)
        before = _library_mtime(build_dir)
        try:
            from torch.utils import cpp_extension

            _ninja_on_path()
            build_dir.mkdir(parents=True, exist_ok=True)
            if before is None and not verbose:
                print(f"zoo: {why_not + '; ' if why_not else ''}compiling {TITLES[name]} ({name}) once, usually 1 "
                      f"to 4 minutes (cached in {build_dir}; a platform wheel ships it built: see the install guide)",
                      file=sys.stderr)
            with _build_lock(build_dir):
                mod = _import_built(build_dir, module_name) or cpp_extension.load(
                    module_name, [str(SOURCES[name])], extra_cflags=CFLAGS, build_directory=str(build_dir),
                    verbose=verbose)
        except Exception as e:  # no compiler, no ninja, a read-only cache dir: fall back, say so once
            _info[name] = {"available": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            warnings.warn(f"zoo: the compiled {name!r} loop is unavailable ({_info[name]['reason']}); "
                          "using the Python path (same numbers, slower)", RuntimeWarning, stacklevel=2)
            _loaded[name] = None
            return None
        _info[name] = {"available": True, "path": str(build_dir), "compiled_now": _library_mtime(build_dir) != before,
                       "seconds": time.perf_counter() - start}
        _loaded[name] = mod
        return mod


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder per folder across processes, with a lock the kernel releases when its holder dies.

    torch's own lock (a ``lock`` file it creates and deletes) is left behind by a process killed mid-build, and
    every later process then waits for it forever. Under this ``flock`` no other zoo process can be building, so
    a torch lock file found here is such a leftover and is removed.
    """
    import fcntl

    with open(build_dir / "zoo-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_on_path() -> None:
    """torch builds with ``ninja`` from ``PATH``; the ``ninja`` wheel puts it beside this interpreter, which
    is not on ``PATH`` when the venv is not activated (``.venv/bin/python ...``)."""
    if shutil.which("ninja") is None:
        here = str(Path(sys.executable).parent)
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def cached_weights(stack: Any, params: list[torch.Tensor],
                   build: Callable[[], tuple[list[int], list[torch.Tensor]]]) -> tuple[list[int], list[torch.Tensor]]:
    """A compiled loop's ``(sizes, weights)`` for ``stack``, from ``build()`` once and then from a cache on the
    stack while its parameters are unchanged (same storage, same in-place version, so an optimiser step or
    ``load_state_dict`` invalidates it): inference calls, often a few tokens long in the demo and the
    server, then skip the transposed copies. A fused optimiser (``torch.optim.Adam(fused=True)``) writes the
    weights without counting a version: its caller bumps them (``torch.autograd.graph.increment_version``,
    as the trainer does)."""
    key = tuple((p.data_ptr(), p._version, tuple(p.shape)) for p in params)
    cached = stack.__dict__.get("_compiled_weights_cache")
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    cfg, flat_w = build()
    stack.__dict__["_compiled_weights_cache"] = (key, cfg, flat_w)
    return cfg, flat_w


def build_key() -> dict[str, Any]:
    """What a built loop must match to be imported as it is: torch (its C++ ABI), Python, the flags (the vector ISA
    of this CPU) and the platform."""
    return {"torch": torch.__version__, "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "cflags": CFLAGS,
            "platform": sysconfig.get_platform()}


def _prebuilt(name: str) -> tuple[ModuleType | None, str | None]:
    """The wheel's built loop ``name`` and ``None``, or ``None`` and why it cannot be used (``None``: no such
    wheel)."""
    meta_file = PREBUILT / "build.json"
    if not meta_file.is_file():
        return None, None
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    built = meta.get("key", {})
    differ = [f"{k} {built.get(k)} (here {v})" for k, v in build_key().items() if built.get(k) != v]
    if differ:
        return None, f"the wheel's built loops are for {', '.join(differ)}"
    module = meta.get("modules", {}).get(name)
    mod = _import_built(PREBUILT, module) if module else None
    return mod, None if mod is not None else f"the wheel's built {name} does not import"


def write_prebuilt(target: Path) -> list[Path]:
    """Build every loop (or take it from the cache) and copy it into ``target`` with ``build.json``: a platform
    wheel's ``build_py`` (``zoo/tools/wheel_build.py``) calls this. Raises ``RuntimeError`` when one cannot be
    built (no compiler): the wheel is then the pure-Python one."""
    target.mkdir(parents=True, exist_ok=True)
    modules = {}
    for name in SOURCES:
        if load(name) is None:
            raise RuntimeError(f"{name}: {_info[name]['reason']}")
        build_dir, module_name = _build_dir(name)
        if _info[name].get("prebuilt"):  # (building a wheel from an environment that has one installed)
            build_dir = PREBUILT
        shutil.copyfile(build_dir / f"{module_name}.so", target / f"{module_name}.so")
        modules[name] = module_name
    (target / "build.json").write_text(json.dumps({"key": build_key(), "modules": modules}, indent=1) + "\n",
                                       encoding="utf-8")
    return sorted(target.iterdir())


def status() -> dict[str, dict[str, Any]]:
    """Per extension: ``available``, and either where it was loaded from, whether this process compiled it
    and how long loading took (``seconds``: the compile time when ``compiled_now``), or why it is not."""
    return {name: dict(_info.get(name, {"available": None, "reason": "not loaded yet"})) for name in SOURCES}


def build_all(verbose: bool = False) -> int:
    """Build every extension now (``zoo build-ext``); exit status 0 when all are available."""
    ok = True
    for name in SOURCES:
        mod = load(name, verbose=verbose)
        info = _info[name]
        if mod is None:
            ok = False
            print(f"{name}: unavailable: {info['reason']}")
        else:
            what = "compiled" if info["compiled_now"] else "the wheel's built copy, loaded" if info.get("prebuilt") \
                else "already built, loaded"
            print(f"zoo: {TITLES[name]} ({name}): {what} in {info['seconds']:.1f} s ({info['path']})")
    return 0 if ok else 1
