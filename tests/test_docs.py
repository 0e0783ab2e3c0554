"""The docs check: the README stays short and true.

- Every fenced ``bash`` block of README.md is read command by command: a ``run.py`` invocation (under any launcher),
  ``python -m recipe.*`` or a ``scripts/`` program may only use flags its own ``--help`` lists, ``make`` only
  Makefile targets, and every repository path a command names must exist.
- A block preceded by ``<!-- docs-check: run -->`` is run as it stands (bash, the venv's python first on PATH,
  ``runs/`` redirected to a temporary folder) and must exit 0.
- Every relative link in README.md and docs/ resolves (file and ``#anchor``), and every module path they name
  (``recipe/train/loop.py``, ``recipe.train.loop``, ``recipe.config.load_run_config``) exists.
- A table introduced by a paragraph that links a committed result (``results/*.json``) quotes that JSON: every
  number in its cells is one of the JSON's values as the docs print them (GiB to 0.1, tokens in k = 1024, as is).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
RUN_MARK = "<!-- docs-check: run -->"
MAX_README_LINES = 250

HELP_FLAGS = r"""
import contextlib, io, json, runpy, sys
out = {}
for key in json.loads(sys.argv[1]):
    kind, target, *sub = key.split(" ")
    sys.argv = [target, *sub, "--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        (runpy.run_module if kind == "module" else runpy.run_path)(target, run_name="__main__")
    out[key] = buf.getvalue()
print(json.dumps(out))
"""


def fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """``(language, body, marked runnable)`` of every fenced block of ``text``."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        marked = i > 0 and lines[i - 1].strip() == RUN_MARK
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        blocks.append((m.group(1), "\n".join(lines[i + 1:end]), marked))
        i = end + 1
    return blocks


def shell_commands(body: str) -> list[list[str]]:
    """The commands of a bash block as token lists (continuation lines joined, comments dropped)."""
    commands = []
    for line in body.replace("\\\n", " ").split("\n"):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote inside a comment
            tokens = shlex.split(line.split(" #")[0])
        if tokens:
            commands.append(tokens)
    return commands


def program_of(tokens: list[str]) -> tuple[str, list[str]] | None:
    """``("script run.py", args)``, ``("module recipe.x [sub]", args)``, ``("make", targets)`` or None (not ours)."""
    if tokens[0] == "make":
        return "make", tokens[1:]
    for i, tok in enumerate(tokens):
        if tok.endswith("run.py") or re.fullmatch(r"scripts/\w+\.py", tok):
            return f"script {tok}", tokens[i + 1:]
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1].split(".")[0] in ("recipe", "kernels"):
            module, rest = tokens[i + 1], tokens[i + 2:]
            if module == "recipe.bench" and rest and not rest[0].startswith("-"):
                return f"module {module} {rest[0]}", rest[1:]
            return f"module {module}", rest
    return None


def readme_commands() -> list[tuple[str, list[str]]]:
    found = []
    for lang, body, _ in fenced_blocks(README.read_text()):
        if lang in ("bash", "sh"):
            found += [p for tokens in shell_commands(body) if (p := program_of(tokens))]
    return found


@lru_cache(maxsize=1)
def help_texts() -> dict[str, str]:
    """``--help`` of every program the README runs, in one interpreter (runpy)."""
    keys = sorted({key for key, _ in readme_commands() if key != "make"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", HELP_FLAGS, json.dumps(keys)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def repo_paths(tokens: list[str]) -> list[str]:
    """Tokens that name files of this repository (ds_configs/, scripts/, docs/, tests/, recipe/, kernels/)."""
    return [t for t in tokens if re.match(r"^(ds_configs|scripts|docs|tests|recipe|kernels)/[\w./-]+$", t)]


def test_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    first_lang, first_block, _ = fenced_blocks(text)[0]
    assert [c[:2] for c in shell_commands(first_block)] == [["make", "demo"], ["make", "test"]]


def test_readme_commands_name_real_make_targets_and_files():
    commands = readme_commands()
    assert {key.split(" ")[1] for key, _ in commands if key != "make"} >= {"run.py", "recipe.export", "recipe.eval"}
    makefile_targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    problems = []
    for key, args in commands:
        if key == "make":
            problems += [f"make {t}: no such Makefile target" for t in args if t not in makefile_targets]
        else:
            problems += [f"{key}: {p} does not exist" for p in repo_paths(args) if not (ROOT / p).exists()]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_readme_commands_use_real_flags():  # the programs' --help, in a fresh interpreter
    helps = help_texts()
    problems = []
    for key, args in readme_commands():
        if key == "make":
            continue
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", helps[key]))
        assert "--help" in known or "-h" in known, f"{key} --help printed no usage: {helps[key][:300]}"
        problems += [f"{key}: {arg.split('=')[0]} is not a flag of it" for arg in args
                     if arg.split("=")[0].startswith("--") and arg.split("=")[0] not in known]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_flag_the_program_lacks_is_caught():
    """The check above can fail: a made-up flag is not in run.py's help."""
    known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_texts()["script run.py"]))
    assert "--max-length" in known and "--ds_config" in known and "--max-lenght" not in known


GITHUB_ANCHOR_DROP = re.compile(r"[^\w\- ]")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces to dashes)."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {GITHUB_ANCHOR_DROP.sub("", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_in_readme_and_docs_resolve():
    problems = []
    for doc in DOC_FILES:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                problems.append(f"{doc.relative_to(ROOT)}: link {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{doc.relative_to(ROOT)}: link {target}: no heading #{anchor}")
    assert not problems, "\n".join(problems)


def module_path_exists(dotted: str) -> bool:
    """``recipe.a.b`` names a module/package, or an attribute defined at top level of the longest module prefix."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[n:]
            if not rest:
                return True
            text = source.read_text()
            return bool(re.search(rf"^(?:def|class) {rest[0]}\b|^{rest[0]}\s*[:=]|^\s+def {rest[0]}\b|import .*\b"
                                  rf"{rest[0]}\b", text, flags=re.M))
    return False


def test_docs_name_no_stale_module_path():
    problems = []
    for doc in DOC_FILES:
        text = doc.read_text()
        pattern = r"(?<![\w./-])((?:recipe|kernels|scripts|ds_configs|tests)/[\w/]+\.(?:py|sh|json|sbatch))"
        for path in set(re.findall(pattern, text)):
            if not (ROOT / path).exists():
                problems.append(f"{doc.relative_to(ROOT)}: {path} does not exist")
        for dotted in set(re.findall(r"(?<![\w./-])((?:recipe|kernels)(?:\.[A-Za-z_]\w*)+)", text)):
            if not module_path_exists(dotted):
                problems.append(f"{doc.relative_to(ROOT)}: {dotted} names no module or attribute")
    assert not problems, "\n".join(sorted(problems))


def test_stale_path_check_can_fail():
    assert module_path_exists("recipe.config") and module_path_exists("recipe.config.load_run_config")
    assert not module_path_exists("recipe.model.no_such_module") and not module_path_exists("recipe.no_such_thing")


@pytest.mark.slow  # trains a few steps of the real SmolLM2 target
def test_runnable_readme_blocks_run(tmp_path, assets):
    blocks = [body for lang, body, marked in fenced_blocks(README.read_text()) if marked]
    assert blocks, f"README.md has no block marked {RUN_MARK}"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is the test's interpreter
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, "PYTHONPATH": str(ROOT)}
    for body in blocks:
        script = re.sub(r"(?<![\w/.])runs/", f"{tmp_path}/runs/", body)
        script = script.replace(".cache/recipe/", f"{assets.target.parent}/")  # $RECIPE_CACHE where it is set
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=900)
        assert result.returncode == 0, f"{body}\n--- stderr ---\n{result.stderr[-4000:]}"


GIB = 2 ** 30


def quoted_forms(data) -> set[str]:
    """Every number of a result JSON in the forms the docs print it: as is (``0.05``, ``7``), bytes in GiB to one
    decimal (``42.9``), bytes in MiB to one decimal, tokens in k = 1024 (``222k``) and in M = 1024·1000 tokens
    (``1.40M``), and any value to one, two or three decimals (τ and its standard error are printed to three)."""
    forms: set[str] = set()
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += list(item.values())
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            forms |= {f"{item:g}", f"{item:.1f}", f"{item:.2f}", f"{item:.3f}", f"{item / GIB:.1f}",
                      f"{item / GIB:.2f}", f"{item / 2 ** 20:.1f}"}
            if isinstance(item, float):
                forms.add(f"{item:.0f}")  # means of token counts, printed whole
            if isinstance(item, int):
                forms |= {f"{round(item / 1024)}k", f"{item / 1024 / 1000:.2f}M"}
    return forms


def cited_tables(doc: Path) -> list[tuple[int, Path, list[str]]]:
    """``(line, cited JSON, the table's cells)`` of every table of ``doc`` whose introducing paragraph (the one
    right above it) links one ``results/*.json``. Columns of ratios (a ``×`` in the header) are derived, not
    quoted, and left out."""
    lines, out, i = doc.read_text().split("\n"), [], 0
    while i < len(lines):
        if not (lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| ]+\|$", lines[i + 1])):
            i += 1
            continue
        stop = i
        while stop > 0 and not lines[stop - 1].strip():  # blank lines between the paragraph and its table
            stop -= 1
        start = stop
        while start > 0 and lines[start - 1].strip():
            start -= 1
        cited = {m for line in lines[start:stop] for m in re.findall(r"\]\(([^)\s]*\.json)\)", line)
                 if (doc.parent / m).resolve().parent.name == "results"}  # README/docs links and the pages' own
        end = i + 2
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        if len(cited) == 1:
            heads = [h.strip() for h in lines[i].strip().strip("|").split("|")]
            cells = [c.strip() for row in lines[i + 2:end]
                     for k, c in enumerate(row.strip().strip("|").split("|")) if k and "×" not in heads[k]]
            out.append((i + 1, (doc.parent / cited.pop()).resolve(), cells))
        i = end
    return out


def table_mismatches(doc: Path) -> list[str]:
    problems = []
    for line, cited, cells in cited_tables(doc):
        forms = quoted_forms(json.loads(cited.read_text()))
        for cell in cells:
            for number in re.findall(r"(?<![\w.])(\d+(?:\.\d+)?[kM]?)(?![\w.])", cell):
                if number not in forms:
                    problems.append(f"{doc.relative_to(ROOT)}:{line}: {number} ({cell!r}) is not in {cited.name}")
    return problems


def test_tables_quote_the_results_they_cite():
    checked = [t for doc in DOC_FILES for t in cited_tables(doc)]
    assert len(checked) >= 3  # the README's and parallelism.md's plan tables, recipes.md's
    problems = [p for doc in DOC_FILES for p in table_mismatches(doc)]
    assert not problems, "\n".join(problems)


def test_a_table_number_missing_from_its_json_is_caught(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(json.dumps({"rows": [{"total": 46065531269, "fit": 227328}]}))
    doc = tmp_path / "d.md"
    doc.write_text("Per GPU ([r.json](results/r.json)):\n\n| layout | GiB | longest |\n|---|---|---|\n"
                   "| 1 × 1 | 42.9 | 222k |\n| 2 × 1 | 43.0 | 222k |\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert table_mismatches(doc) == ["d.md:3: 43.0 ('43.0') is not in r.json"]
        page = tmp_path / "results" / "page.md"  # a results page links its JSON beside it
        page.write_text("τ ([r.json](r.json)):\n\n| arm | τ | tokens |\n|---|---|---|\n| a | 0.047 | 227328 |\n")
        assert table_mismatches(page) == ["results/page.md:3: 0.047 ('0.047') is not in r.json"]
    finally:
        ROOT = root
