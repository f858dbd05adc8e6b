"""The front door: the README's "Use it" snippet runs as written, the README stays short, every relative link in the
README and docs/ resolves, and no process history (issue numbers, dated diaries) sits in the docs or the code."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_use_it_snippet_runs_as_written(capsys):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md (Use it)", "exec"), namespace)
    result, model = namespace["result"], namespace["model"]
    assert torch.isfinite(torch.tensor(result.loss))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert "prompt_state_bytes" in capsys.readouterr().out


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor in the same page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert len(_pages()) >= 9 and not broken, broken


def test_no_process_history_in_docs_or_code():
    """Code and docs say what and why; process history (numbered tasks, dated runs, earlier runs) belongs in git."""
    # The phrases are split so that this file does not itself contain what it looks for.
    history = re.compile("|".join(("is" "sue [0-9]", "prev" "ious run", "this sess" "ion", "last sess" "ion",
                                   "sess" "ion's")))
    files = [*_pages(), *ROOT.glob("src/longstraw/**/*.py"), *ROOT.glob("tests/**/*.py")]
    found = [f"{f.relative_to(ROOT)}:{i + 1}" for f in files
             for i, line in enumerate(f.read_text().splitlines()) if history.search(line)]
    assert len(files) > 100 and not found, found


def test_one_name_for_the_plan():
    """`plan` everywhere: no `mode=` keyword, `MODES` or `--mode(s)` flag left in the code, tests or docs."""
    old = re.compile(r"\bMODES\b|--modes?\b|[(, ]mode=")
    files = [*_pages(), *ROOT.glob("src/longstraw/**/*.py"), *ROOT.glob("tests/**/*.py"), ROOT / "Makefile"]
    found = [f"{f.relative_to(ROOT)}:{i + 1}" for f in files if f.name != os.path.basename(__file__)
             for i, line in enumerate(f.read_text().splitlines())
             if old.search(line) and "the old name: refused" not in line]
    assert not found, found


def test_layout_rows_that_list_modules_list_every_one():
    """A row of the README's layout table that names a folder's modules names all of them, and only ones that
    exist."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `src/longstraw/")]
    assert rows
    for row in rows:
        folder = ROOT / re.match(r"\| `([^`]+)`", row).group(1)
        named = set(re.findall(r"`(\w+\.py)`", row)) - {"__init__.py"}
        if not named:
            continue
        modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        assert named <= modules, f"{folder}: {sorted(named - modules)} named but absent"
        assert modules <= named, f"{folder}: {sorted(modules - named)} not in the README's layout table"
