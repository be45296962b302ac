"""MkDocs hook: list every ``docs/results/*.md`` page under "Reproductions" in the nav.

Result pages are written by the experiments (one per reproduction) and may arrive after the
nav was last edited; listing them here keeps ``mkdocs build --strict`` green either way.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["on_config"]


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
