"""The README is the front page: its set-up block, its size, its links and its sample.

Its code blocks run in ``test_pages.py`` like every page's (the sample and its output,
the make targets). The samples it used to carry moved to the docs pages, with their
assertions: ``test_pages.py``'s ``CHECKS``.
"""

import re
import tomllib

from tests.docs._blocks import ROOT, blocks_of

README = ROOT / "README.md"
FIRST_BLOCK = """\
make demo    # fresh machine: creates .venv, installs touba[all,dev], runs `touba demo`
make test    # same install, then ruff, mypy --strict and the whole test suite
"""


def test_it_starts_with_the_two_commands_of_a_fresh_machine() -> None:
    text = README.read_text()
    assert text.startswith("# touba\n\n```sh\n" + FIRST_BLOCK + "```\n")
    assert blocks_of(README)[0].code == FIRST_BLOCK


def test_it_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= 400


def test_its_test_command_is_what_ci_runs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: lint typecheck pytest$", makefile, re.MULTILINE)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test") < ci.index("make docs") < ci.index("make peers")


def test_its_links_lead_somewhere() -> None:
    text = README.read_text()
    headings = {
        re.sub(r"[^\w\s-]", "", h.lower()).strip().replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    }
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        target, _, anchor = link.partition("#")
        if not target:
            assert anchor in headings, link
        else:
            assert (ROOT / target).exists(), link


def test_it_says_why_each_dependency_is_there() -> None:
    text = README.read_text()
    table = text.split("## Dependencies and why", 1)[1].split("\n## ", 1)[0]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in set(project["optional-dependencies"]) - {"all"}:
        assert f"`{extra}`" in table, extra
    for requirement in project["dependencies"]:
        name = re.match(r"[\w-]+", requirement)
        assert name is not None
        assert f"`{name.group(0)}`" in table, name.group(0)
