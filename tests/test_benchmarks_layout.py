"""The benchmarks' layout: benchmarks/RESULTS.md stays a short index whose links all resolve, and every
`benchmarks/...` path that README.md and docs/*.md name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "benchmarks" / "RESULTS.md"
IGNORED = ("benchmarks/.cache", "benchmarks/.vllm")  # git-ignored folders the scripts create


def named_paths(text: str) -> set[str]:
    return {m.rstrip(".,:;)`'\"") for m in re.findall(r"benchmarks/[\w./-]*", text)}


def test_the_results_index_is_short():
    assert len(INDEX.read_text().splitlines()) <= 400


def test_every_file_the_results_index_links_to_exists():
    links = re.findall(r"\]\(([^)#\s]+)", INDEX.read_text())
    assert links
    missing = [link for link in links if not (INDEX.parent / link).exists()]
    assert missing == []


def test_every_benchmarks_path_in_the_readme_and_docs_exists():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in named_paths(doc.read_text()):
            if not path.startswith(IGNORED) and not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert missing == []
