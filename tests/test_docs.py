"""The README is an entry point (at most 200 lines) and every relative link in it and in docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_link_finder_sees_relative_links_only():
    text = "[a](docs/cli.md) [b](https://x.org/y) [c](../z.md#part) [d](mailto:a@b)"
    assert relative_links(text) == ["docs/cli.md", "../z.md"]


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; the manual belongs in docs/"


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{p.relative_to(ROOT)}: {t}" for p in pages for t in relative_links(p.read_text())
              if not (p.parent / t).exists()]
    assert len(pages) > 5 and not broken, broken
