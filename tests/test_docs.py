"""The documentation: the generated reference is current, and every relative link in the README and docs/ points
at a file that exists (a newcomer's two clicks must land somewhere)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_reference", ROOT / "docs" / "generate_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", ["config.md", "cli.md"])
def test_the_generated_reference_is_current(page):
    gen = _generator()
    committed = (ROOT / "docs" / "reference" / page).read_text()
    assert gen.PAGES[page]() == committed, f"docs/reference/{page} is stale: run python docs/generate_reference.py"


def test_the_config_reference_lists_every_key_with_its_default():
    from steadydiff.config import Config, resumable_keys

    text = (ROOT / "docs" / "reference" / "config.md").read_text()
    keys = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", text, re.M)
    flat = [f"{s}.{k}" for s, sec in Config().to_dict().items() for k in sec]
    assert keys == flat
    assert all(f"`{k}` |" in text for k in resumable_keys())
    assert "| `train.lr` | float | `0.0002` |" in text


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("doc", sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = [m.group(1) for m in LINK.finditer(doc.read_text())
              if not m.group(1).startswith(("http://", "https://", "mailto:"))
              and not (doc.parent / m.group(1)).resolve().exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_the_readme_is_a_landing_page():
    """README <= 8 KB opening with exactly the two commands, every guide reachable from it in two clicks."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 8192
    block = readme.split("```")[1].strip().splitlines()
    assert [line.split()[:2] for line in block] == [["make", "demo"], ["make", "test"]]
    index = (ROOT / "docs" / "README.md").read_text()
    assert "docs/README.md" in readme and "reports/README.md" in readme
    for guide in sorted((ROOT / "docs" / "guides").glob("*.md")):
        assert f"guides/{guide.name}" in index, f"docs/README.md does not link {guide.name}"
