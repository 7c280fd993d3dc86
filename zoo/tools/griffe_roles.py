"""A griffe extension for the API reference: the docstrings' Sphinx roles become mkdocstrings cross-references.

The zoo's docstrings name other objects the Sphinx way (``:func:`resolve```, ``:class:`LanguageModel```,
``:mod:`zoo.catalog```): short to write, and what Python developers read in source. mkdocstrings renders
Markdown, where such a role would show as raw text. This extension (named in ``mkdocs.yml``) rewrites each role,
when the docs are built, into an autorefs cross-reference to the object the name resolves to *in the scope of the
docstring* (its module's imports included), the way Sphinx resolves it: a link where the API reference renders
that object, its name in code font where it does not. A role that names nothing (a typo, a removed function) is
reported as a warning, which ``mkdocs build --strict`` turns into a failure; ``zoo/tools/mkdocs_hooks.py`` fails
the build on any role left in a rendered page. The parameter tables come from the docstrings' Google-style
``Args:`` sections (``docstring_style: google``).

Checkout tooling: the library never imports it.
"""

from __future__ import annotations

import html
import logging
import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(meth|class|func|mod|attr|data|exc|obj|const):`(~?)([^`<>]+)`")
logger = logging.getLogger("mkdocs.plugins.zoo.griffe_roles")


def _resolve(obj: Object, name: str) -> str | None:
    """The full path ``name`` means in ``obj``'s scope, or ``None`` (outside the package, or unknown)."""
    name = name.lstrip(".")
    head, _, rest = name.partition(".")
    if head == obj.package.name:
        return name if _exists(obj, name) else None
    scopes = [obj] if obj.is_class or obj.is_module else []
    scopes += list(_parents(obj))
    for scope in scopes:
        try:
            full = scope.resolve(head)
        except Exception:  # noqa: BLE001, S112 (griffe raises NameResolutionError or a subclass of it)
            continue
        full = f"{full}.{rest}" if rest else full
        inside = full.split(".")[0] == obj.package.name
        return None if inside and not _exists(obj, full) else full
    return None


def _exists(obj: Object, path: str) -> bool:
    """Whether ``path`` (inside ``obj``'s package) names a loaded object."""
    try:
        target = obj.package
        for part in path.split(".")[1:]:
            target = target.members[part]
            if target.is_alias:
                target = target.final_target
    except Exception:  # noqa: BLE001 (a missing member, or an alias that leads nowhere)
        return False
    return True


def _parents(obj: Object):
    parent = obj.parent
    while parent is not None:
        yield parent
        parent = parent.parent


def convert(obj: Object, text: str) -> str:
    """``text`` with every role turned into a cross-reference (or plain code, for names outside the zoo)."""

    def one(m: re.Match) -> str:
        tilde, name = m[2], m[3].strip()
        shown = name.rsplit(".", 1)[-1] if tilde else name
        full = _resolve(obj, name)
        code = f"<code>{html.escape(shown)}</code>"
        if full is None:
            if name.split(".")[0] == obj.package.name:
                logger.warning("%s: the docstring's %s names nothing in %s", obj.path, m[0], obj.package.name)
            return f"`{shown}`"
        if not full.startswith(obj.package.name + "."):
            return f"`{shown}`"  # an import from another package (torch, numpy): no page of ours to link
        return f'<autoref identifier="{html.escape(full)}" optional>{code}</autoref>'

    return ROLE.sub(one, text)


class SphinxRoles(Extension):
    """Rewrite roles in every docstring of the loaded package once it is loaded (names then resolve)."""

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        stack = [pkg]
        seen: set[str] = set()
        while stack:
            obj = stack.pop()
            if obj.path in seen or obj.is_alias:
                continue
            seen.add(obj.path)
            if obj.docstring is not None:
                obj.docstring.value = convert(obj, obj.docstring.value)
            stack.extend(m for m in obj.members.values() if not m.is_alias)
