"""The docs stay walkable: relative links resolve (anchors too), and the module map in
docs/architecture.md names every file under cluster/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "helm/tandem/README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes; a repeated
    heading gets -1, -2, ..."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for heading in re.findall(r"^#+\s+(.*)$", _prose(path), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for link in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_module_map_names_every_cluster_file() -> None:
    files = subprocess.run(["git", "ls-files", "cluster"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:  # not a git checkout (an sdist): nothing to compare against
        return
    text = (ROOT / "docs/architecture.md").read_text()
    missing = [f for f in files if f"`{f.removeprefix('cluster/')}`" not in text]
    assert not missing, f"docs/architecture.md's module map lacks: {missing}"
