"""The README and docs/ as a user meets them: every Python block marked `<!-- runs -->` runs
as written, as a fresh interpreter would from the repository's root (forked from the
suite's zygote: a user copies it, and it must not need names it does not define); every
link to a file of the repository leads to one; the README stays a front door (at most
16,000 bytes, no commit named, every docs/ page linked); docs/cli.md's reference is the
parser's."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
_BLOCK = re.compile(r"<!-- runs -->\s*\n```python\n(.*?)```", re.DOTALL)
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _blocks() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(ROOT)}#{i}", code) for page in PAGES
            for i, code in enumerate(_BLOCK.findall(page.read_text()), 1)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "code"), _blocks(), ids=[w for w, _ in _blocks()])
def test_a_block_marked_runs_runs_as_written(where: str, code: str) -> None:
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": os.environ.get("HOME", "/tmp")}
    done = zygote.shared().run([], code=code, cwd=ROOT, capture_output=True, text=True,
                               timeout=110, env=env)
    assert done.returncode == 0, (where, done.stderr[-3000:])


@pytest.mark.timeout(30)
def test_every_link_to_a_file_of_the_repository_leads_to_one() -> None:
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES
              for target in _LINK.findall(page.read_text())
              if "://" not in target and not target.startswith("mailto:")
              and not (page.parent / target).exists()]
    assert broken == []


@pytest.mark.timeout(30)
def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 16_000
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, page.name
    # No commit named: history lives in git log. (A hex word with a digit and a letter.)
    for page in PAGES:
        named = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text())
                 if re.search(r"[a-f]", w) and re.search(r"[0-9]", w)]
        assert named == [], page.name


@pytest.mark.timeout(30)
def test_the_command_line_reference_is_the_parser_s() -> None:
    """docs/cli.md's reference is printed from the one declaration of the options."""
    from tensorbus.run import flags

    page = (ROOT / "docs" / "cli.md").read_text()
    begin = "<!-- reference: python -m tensorbus.run.flags -->\n"
    held = page[page.index(begin) + len(begin):page.index("<!-- end of reference -->")]
    assert held == flags.reference(), "run `python -m tensorbus.run.flags` into docs/cli.md"
