"""mkdocs hooks: the docs site shows files that live outside ``docs/`` without a second copy of them in git.

* ``<!-- include: PATH -->`` on a line of its own is replaced by the repository file ``PATH`` (its YAML front matter
  removed), so ``serving/README.md``, ``exports/README.md`` and the model cards stay written once, where their own
  tools and branches edit them;
* a relative link or image that leaves ``docs/`` for a repository file (written so that it also works on a code
  host, ``../../model_cards/x.png``) is pointed at that file's place in the site: the page that includes it (a
  README, a card) or the file itself, added to the site (figures, the server's configuration files, the ONNX
  example). Anything else is left alone, so ``mkdocs build --strict`` still reports it.

Named in ``mkdocs.yml`` (``hooks:``); checkout tooling, not part of the library.
"""

from __future__ import annotations

import logging
import posixpath
import re
from fnmatch import fnmatch
from pathlib import Path

from mkdocs.structure.files import File, Files

#: Repository files (outside docs/) the site carries as they are, for the links of the pages that include them.
STATIC = ("model_cards/*.png", "serving/*.cfg", "serving/*.yaml", "serving/*.properties", "serving/*.xml",
          "serving/*.py", "exports/*.py")
_INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.M)
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
_state: dict[str, object] = {"repo": Path("."), "included": {}}
log = logging.getLogger("mkdocs.plugins.zoo.hooks")


def on_files(files: Files, config) -> Files:
    repo = Path(config["config_file_path"]).resolve().parent
    included: dict[str, str] = {}  # repository path of an included file -> the docs page that includes it
    for page in files.documentation_pages():
        for m in _INCLUDE.finditer(Path(page.abs_src_path).read_text(encoding="utf-8")):
            included[m[1]] = page.src_uri
    _state.update(repo=repo, included=included)
    for pattern in STATIC:
        for path in sorted(repo.glob(pattern)):
            files.append(File(path.relative_to(repo).as_posix(), src_dir=str(repo), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    here = page.file.src_uri
    markdown = _relink(markdown, posixpath.dirname(f"docs/{here}"), here)

    def include(m: re.Match) -> str:
        text = (_state["repo"] / m[1]).read_text(encoding="utf-8")
        if text.startswith("---\n"):  # a card's metadata for the Hub, not for readers
            text = text[text.index("\n---\n", 4) + 5:]
        return _relink(text, posixpath.dirname(m[1]), here)

    return _INCLUDE.sub(include, markdown)


def _relink(text: str, base: str, page: str) -> str:
    """Links in ``text`` (written relative to the repository folder ``base``) made relative to the docs ``page``."""
    included: dict[str, str] = _state["included"]  # type: ignore[assignment]

    def fix(m: re.Match) -> str:
        target = m[2]
        if re.match(r"[a-zA-Z][a-zA-Z+.-]*:|#|/", target):
            return m[0]
        path, _, anchor = target.partition("#")
        rel = posixpath.normpath(posixpath.join(base, path))
        if rel.startswith("docs/"):
            site = rel.removeprefix("docs/")
        elif rel in included:
            site = included[rel]
        elif any(fnmatch(rel, p) for p in STATIC) and (_state["repo"] / rel).is_file():
            site = rel
        else:
            return m[0]
        new = posixpath.relpath(site, posixpath.dirname(page) or ".")
        return f"{m[1]}{new}{'#' + anchor if anchor else ''}{m[3]}"

    return _LINK.sub(fix, text)


#: A Sphinx role left as text in a rendered page (``:meth:`x``` shown literally): the docstrings' style and the
#: API reference's renderer disagree again (zoo/tools/griffe_roles.py turns roles into cross-references).
_RAW_ROLE = re.compile(r":(?:py:)?(?:meth|class|func|mod|attr|data|exc|obj|const):(?:`|<code>)")


def on_page_content(html: str, page, config, files) -> str:
    for m in _RAW_ROLE.finditer(html):
        log.warning("%s shows a raw Sphinx role %r: docstrings name objects with roles that "
                    "zoo/tools/griffe_roles.py rewrites, or Markdown cross-references", page.file.src_uri,
                    html[m.start():m.end() + 30])
        break
    return html
