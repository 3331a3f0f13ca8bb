"""The README and the docs/ pages are what newcomers and dashboards rely on: keep them true to the code.

The README is the front page; the reference material lives in docs/*.md. What must be documented somewhere is
checked across all of them, so moving a section between pages keeps the checks.
"""

from __future__ import annotations

import re
from pathlib import Path

from iotmon.cli import build_parser
from iotmon.config import describe_settings
from iotmon.schema import ALERTS_SCHEMA, ANOMALIES_SCHEMA, BRONZE_SCHEMA, DEVICES_SCHEMA, QUARANTINE_SCHEMA
from tests.support import PROJECT_ROOT

README_PATH = PROJECT_ROOT / "README.md"
README = README_PATH.read_text()
DOCS = sorted((PROJECT_ROOT / "docs").glob("*.md"))
PAGES = {path: path.read_text() for path in [README_PATH, *DOCS]}
ALL_TEXT = "\n".join(PAGES.values())
README_LIMIT_BYTES = 12_000

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def subcommands() -> set[str]:
    return set(build_parser()._subparsers._group_actions[0].choices)


def outside_code_blocks(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in outside_code_blocks(text):
        if heading := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def relative_links(text: str) -> list[str]:
    return [
        target
        for line in outside_code_blocks(text)
        for target in LINK.findall(line)
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_every_setting_is_in_the_configuration_table() -> None:
    documented = set(re.findall(r"^\| `(IOTMON_[A-Z_]+)` \|", ALL_TEXT, re.M))
    assert documented == {variable for variable, _, _ in describe_settings()}


def test_every_command_the_docs_mention_exists() -> None:
    mentioned = set(re.findall(r"`iotmon ([a-z]+)", ALL_TEXT))
    assert set(re.findall(r"`iotmon ([a-z]+)", README))
    assert mentioned and mentioned <= subcommands()


def test_the_readme_lists_every_command_once() -> None:
    listed = re.findall(r"^\| `iotmon ([a-z]+)", README, re.M)
    assert sorted(listed) == sorted(subcommands())


def test_every_table_column_is_documented() -> None:
    for schema in (BRONZE_SCHEMA, QUARANTINE_SCHEMA, DEVICES_SCHEMA, ANOMALIES_SCHEMA, ALERTS_SCHEMA):
        for field in schema:
            assert f"`{field.name}`" in ALL_TEXT, field.name


def test_the_readme_is_a_front_page() -> None:
    size = len(README.encode())
    assert size < README_LIMIT_BYTES, f"README.md is {size:,} bytes: move reference material into docs/"


def test_the_readme_links_every_docs_page_and_each_link_exists() -> None:
    linked = {(PROJECT_ROOT / target.split("#")[0]).resolve() for target in relative_links(README)}
    assert DOCS and {path.resolve() for path in DOCS} <= linked, "a docs page the README does not link"
    for path in linked:
        assert path.exists(), f"README.md links {path.relative_to(PROJECT_ROOT)}, which does not exist"


def test_every_relative_link_and_anchor_resolves() -> None:
    for page, text in PAGES.items():
        for target in relative_links(text):
            file, _, anchor = target.partition("#")
            destination = (page.parent / file).resolve() if file else page
            assert destination.exists(), f"{page.name} links {target}: no such file"
            if anchor:
                assert anchor in anchors(Path(destination).read_text()), f"{page.name} links {target}: no such heading"
