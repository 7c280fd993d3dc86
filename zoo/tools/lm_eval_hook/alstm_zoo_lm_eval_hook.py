"""Makes the stock ``lm_eval --model zoo`` find the zoo's harness model, without patching lm_eval.

Why this exists: lm-evaluation-harness 0.4.x has no plugin entry point group for models. ``--model NAME`` is looked
up with ``lm_eval.api.registry.get_model``, which reads an in-process registry; when that registry is empty it
imports ``lm_eval.models``, whose import fills it with lazy ``"module:Object"`` placeholders for the harness's own
backends. Nothing from another package runs on the way. What the registry does accept is a placeholder from anyone
(``model_registry.register("zoo", target="zoo.lm_eval_plugin:ZooLM")``), materialised on first use, and
``register_model`` later upgrades that placeholder to the concrete class.

Where: this file and ``alstm_zoo_lm_eval_hook.pth`` are kept with the checkout tooling (``zoo/tools/lm_eval_hook/``,
not a package of the wheel); the wheel's ``build_py`` (``zoo/tools/wheel_build.py``) puts both at the root of
site-packages, and in the checkout ``make venv`` links both into ``.venv``'s site-packages. It is always imported
as the top-level module ``alstm_zoo_lm_eval_hook``, never as part of ``zoo.tools``.

How: Python runs the ``.pth``'s ``import`` line at start-up. The import puts :class:`Finder` on
``sys.meta_path``. It answers for one module only, ``lm_eval.models``: it lets the other finders locate it, then
wraps their loader so that right after the module has executed, the placeholder for ``zoo`` is added (if no ``zoo``
is registered yet). The hook is on ``lm_eval.models`` and not on ``lm_eval.api.registry`` on purpose: a registry that
is no longer empty would stop ``get_model`` from importing the harness's own models, and every built-in
``--model`` would then be unknown.

Cost: at start-up, importing this module (``os`` and ``sys`` only: no torch, no lm_eval, no zoo) and one string
comparison per module import that misses ``sys.modules``. Nothing of the zoo is imported until the harness actually
asks for the model ``zoo``.

Safety: a failure inside the hook never breaks Python's start-up nor lm_eval: the finder then steps aside, and a
failed registration is reported once as a ``RuntimeWarning`` (``zoo-lm-eval`` still works). Set
``ALSTM_ZOO_NO_LM_EVAL_HOOK=1`` (any value but empty or ``0``) to keep the hook off.

The same finder gives the harness's own ``--model hf`` the zoo's checkpoints: right after lm_eval's Hugging Face
backend (``lm_eval.models.huggingface``, which imports transformers) has executed, it imports ``zoo.hf``, which
registers the zoo's classes with transformers' Auto classes (no remote code). So
``lm_eval --model hf --model_args pretrained=<zoo checkpoint folder>`` works with the stock command; where this hook
is not installed, ``python -c 'import zoo.hf, lm_eval.__main__ as m; m.cli_evaluate()' --model hf ...`` does the
same. Nothing of the zoo is imported for any other backend.
"""

from __future__ import annotations

import os
import sys

#: Set (to anything but "" or "0") to keep the hook off.
OPT_OUT_ENV = "ALSTM_ZOO_NO_LM_EVAL_HOOK"
#: The module whose import triggers the registration.
TRIGGER = "lm_eval.models"
#: lm_eval's Hugging Face backend: after it, ``zoo.hf`` registers the zoo with transformers.
HF_TRIGGER = "lm_eval.models.huggingface"
HF_MODULE = "zoo.hf"
#: The harness model name and its lazy target (``zoo.lm_eval_plugin`` checks it names :class:`ZooLM`).
MODEL_NAME = "zoo"
TARGET = "zoo.lm_eval_plugin:ZooLM"

_warned = False


def _warn_once(what: str, exc: BaseException) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    try:
        import warnings

        warnings.warn(f"alstm-zoo: {what} ({type(exc).__name__}: {exc}); `lm_eval --model zoo` will not find the "
                      f"model, `zoo-lm-eval` still works (set {OPT_OUT_ENV}=1 to silence this)", RuntimeWarning,
                      stacklevel=2)
    except Exception:  # noqa: BLE001 - a warning must not raise either
        pass


def register() -> None:
    """Add the lazy placeholder ``zoo`` -> :data:`TARGET` to lm_eval's model registry unless ``zoo`` is there.
    Called right after ``lm_eval.models`` has executed, so the harness's own models are already registered."""
    try:
        from lm_eval.api.registry import model_registry

        if MODEL_NAME not in model_registry:
            model_registry.register(MODEL_NAME, target=TARGET)
    except Exception as exc:  # noqa: BLE001 - never break lm_eval (older lm_eval: no lazy registry)
        _warn_once("could not register the harness model 'zoo'", exc)


def register_hf() -> None:
    """Import :data:`HF_MODULE` (its import registers the zoo's classes with transformers). Called right after
    lm_eval's Hugging Face backend has executed. Without the zoo or transformers installed there is nothing to do."""
    try:
        import importlib

        importlib.import_module(HF_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in ("zoo", "transformers"):
            _warn_once("could not register the zoo with transformers", exc)
    except Exception as exc:  # noqa: BLE001 - never break lm_eval
        _warn_once("could not register the zoo with transformers", exc)


#: What runs right after each trigger module has executed.
ACTIONS = {TRIGGER: register, HF_TRIGGER: register_hf}


class _Loader:
    """Wraps the real loader of a trigger module to run its action (:data:`ACTIONS`) right after the module has
    executed. It hands the module back its real loader before executing it, and passes anything else through
    (``__getattr__``), so ``importlib.resources``, ``inspect`` and reloads see the harness's own loader."""

    def __init__(self, loader, then=register) -> None:
        self._loader = loader
        self._then = then

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._then()


class Finder:
    """A ``sys.meta_path`` finder that answers for the modules of :data:`ACTIONS` only: it asks the other finders
    for the real spec and wraps its loader in :class:`_Loader`. For every other module, and on any error, it returns
    ``None`` (Python goes on to the next finder, as if the hook were not there)."""

    def find_spec(self, fullname: str, path=None, target=None):
        then = ACTIONS.get(fullname)
        if then is None:
            return None
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or isinstance(finder, Finder) or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
            if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None
            spec.loader = _Loader(spec.loader, then)
            return spec
        except Exception as exc:  # noqa: BLE001 - fall back to the plain import
            _warn_once("the lm_eval import hook failed", exc)
            return None

    def invalidate_caches(self) -> None:
        pass


def enabled() -> bool:
    """Whether the environment allows the hook (:data:`OPT_OUT_ENV` unset, empty or ``0``)."""
    return os.environ.get(OPT_OUT_ENV, "") in ("", "0")


def install() -> bool:
    """Put :class:`Finder` first on ``sys.meta_path`` (once), unless opted out; if ``lm_eval.models`` is already
    imported, register right away. Returns whether the hook is on."""
    if not enabled():
        return False
    try:
        if not any(isinstance(f, Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, Finder())
        for name, then in ACTIONS.items():
            if name in sys.modules:
                then()
        return True
    except Exception as exc:  # noqa: BLE001 - never break start-up
        _warn_once("could not install the lm_eval import hook", exc)
        return False


install()
