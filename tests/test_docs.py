"""README.md and docs/*.md: every relative link and every repository path they name exists in the tree, and the
README stays short. No model loads: this reads text files only."""
from __future__ import annotations

import glob
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Markdown links and images: [text](target) and ![alt](target), the target up to a space or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Paths in code spans or plain text that start at a top-level folder of the repository.
TOP = ("bench/", "docs/", "jax_offload/", "pallas_kernels/", "convert/", "tests/")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./*-]*)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _without_code_blocks(text: str) -> str:
    """Fenced code blocks hold commands with placeholders (DIR, $OUT); links never live there."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _exists(path: Path) -> bool:
    if any(ch in str(path) for ch in "*?["):
        return bool(glob.glob(str(path)))
    return path.exists()


def _links(page: Path) -> list[str]:
    return LINK.findall(_without_code_blocks(_text(page)))


def _paths(page: Path) -> list[str]:
    found = []
    for match in PATH.findall(_text(page)):
        path = match.split("::")[0].rstrip(".,;:")
        if path.rstrip("/") in {t.rstrip("/") for t in TOP} or "$" in path or "<" in path:
            continue
        found.append(path)
    return found


def test_pages_exist():
    assert (ROOT / "README.md").is_file()
    assert len(PAGES) > 1, "docs/*.md missing"


def test_readme_is_short():
    lines = _text(ROOT / "README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    missing = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        rel = unquote(target.split("#")[0])
        if not rel:
            continue
        if not _exists((page.parent / rel).resolve()):
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to nothing: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page: Path):
    """`bench/results/...`, `bench/...py`, `jax_offload/...`, `tests/...` and the like, wherever they are written
    (relative to the repository root, as the pages write them)."""
    missing = sorted({p for p in _paths(page) if not _exists(ROOT / p)})
    assert not missing, f"{page.relative_to(ROOT)}: names paths that do not exist: {missing}"


def test_results_paths_are_checked():
    """The path pattern sees the results files the pages cite (so the test above checks something)."""
    cited = [p for page in PAGES for p in _paths(page) if p.startswith("bench/results/")]
    linked = [t for page in PAGES for t in _links(page) if "bench/results/" in t]
    assert cited or linked
