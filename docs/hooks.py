"""MkDocs hooks of the documentation site.

* ``on_config``: list every ``docs/results/*.md`` page under "Reproductions" in the nav.
  Result pages are written by the experiments (one per reproduction) and may arrive after the
  nav was last edited; listing them here keeps ``mkdocs build --strict`` green either way.
* ``on_files``: ship MathJax with the site. The maths of the pages and docstrings
  (``pymdownx.arithmatex``, generic mode) is typeset in the browser by MathJax 3, copied from
  the ``django-static-mathjax`` package (a plain copy of MathJax's ``es5`` build, no Django
  needed; in the ``docs`` extra) into ``assets/mathjax/``. The build fetches nothing and the
  pages load no script or font from another site.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

__all__ = ["MATHJAX_DIR", "on_config", "on_files"]

# Where the bundled MathJax lands in the site; mkdocs.yml's extra_javascript points here.
MATHJAX_DIR = "assets/mathjax"
# The combined TeX-input, CommonHTML-output component with every TeX extension built in (so it
# never tries to load an extension from elsewhere), and the web fonts CommonHTML asks for,
# relative to the script's own folder.
_MATHJAX_FILES = ("tex-chtml-full.js",)
_MATHJAX_FONTS = "output/chtml/fonts/woff-v2"


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem.replace("_", " ").replace("-", " ").capitalize()


def on_config(config, **kwargs):
    docs = Path(config["docs_dir"])
    pages = sorted((docs / "results").glob("*.md"))
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Reproductions" in item:
            section = item["Reproductions"]
            listed = {next(iter(e.values())) if isinstance(e, dict) else e for e in section}
            for p in pages:
                rel = p.relative_to(docs).as_posix()
                if rel not in listed:
                    section.append({_title(p): rel})
    return config


def _mathjax_root() -> Path:
    spec = importlib.util.find_spec("mathjax")
    root = None
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax"
    if root is None or not (root / "es5" / _MATHJAX_FILES[0]).is_file():
        raise PluginError(
            "MathJax not found: the docs need the 'django-static-mathjax' package "
            "(pip install -e '.[docs]'), which ships MathJax 3 for the site's maths."
        )
    return root


def on_files(files, config, **kwargs):
    root = _mathjax_root()
    es5 = root / "es5"
    sources = [es5 / name for name in _MATHJAX_FILES]
    sources += sorted((es5 / _MATHJAX_FONTS).glob("*.woff"))
    for src in sources:
        rel = src.relative_to(es5).as_posix()
        files.append(File.generated(config, f"{MATHJAX_DIR}/{rel}", abs_src_path=str(src)))
    files.append(
        File.generated(config, f"{MATHJAX_DIR}/LICENSE", abs_src_path=str(root / "LICENSE"))
    )
    return files
