"""The README is a front door, and the docs hold together.

- README.md fits on a couple of screens (≤ 160 lines), with `make demo` and `make test` first;
- every relative markdown link in README.md and docs/*.md names a file that exists here (and a heading of it,
  where the link has an anchor into a markdown file);
- the README's list of checked and refused SGLang paths is the registry's (``kvguard.sglang.paths.PATHS``;
  ``python tests/test_docs.py`` regenerates it);
- every row of the README's headline table carries its command and a link to its raw results.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted([README, *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = ("http://", "https://", "mailto:")


def unfenced(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (where a `[x](y)` is code, not a link)."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def slugs(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (duplicates get -1, -2, ...)."""
    found, seen = set(), {}
    for line in unfenced(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move detail to docs/"
    first_block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block.startswith("make demo") and "\nmake test" in first_block
    assert README.read_text().index("```bash\nmake demo") < README.read_text().index("\n## ")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in slugs(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert broken == [], f"{doc.relative_to(REPO)}: {broken}"


def test_link_checker_sees_links_and_anchors(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Top: the `x` part\n[ok](a.md#top-the-x-part) [no](b.md) `[code](c.md)`\n```\n[c](d.md)\n```\n")
    assert LINK.findall(prose(doc.read_text())) == ["a.md#top-the-x-part", "b.md"]
    assert slugs(doc) == {"top-the-x-part"}


BEGIN, END = "<!-- paths: generated from kvguard.sglang.paths.PATHS by `python tests/test_docs.py` -->", "<!-- /paths -->"


def render_paths() -> str:
    """The README's list of checked and refused paths, from the registry (wrapped at 112 columns)."""
    import textwrap

    from kvguard.sglang.paths import CHECKED, PATHS, REFUSED

    groups = [("Checked", [p for p in PATHS if p.status == CHECKED], ""),
              ("Refused at start", [p for p in PATHS if p.status == REFUSED and not p.per_request], ""),
              ("Refused per request", [p for p in PATHS if p.per_request],
               " (each such request is turned away, HTTP 400, before any of its KV is written; the others are served)")]
    items = [textwrap.fill(f"- **{label}:** " + ", ".join(f"`{p.name}`" for p in paths) + tail + ".", width=112,
                           subsequent_indent="  ", break_on_hyphens=False) for label, paths, tail in groups]
    return "\n".join([BEGIN, *items, END])


def test_readme_path_list_is_the_registry():
    text = README.read_text()
    assert BEGIN in text and END in text
    current = BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    assert current == render_paths(), "the registry changed: regenerate the README's list with python tests/test_docs.py"


def test_every_headline_figure_carries_its_command_and_raw_results():
    section = README.read_text().split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| figure")]
    assert len(rows) >= 5
    commands = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        figure, command, raw = cells[0], cells[-2], cells[-1]
        assert command, f"{figure}: no command"
        if command != "the same run":
            assert command.startswith("`") and command.endswith("`"), f"{figure}: {command}"
            commands.append(command)
        else:
            assert commands, f"{figure}: 'the same run' with no run above it"
        assert re.fullmatch(r"\[[^\]]+\]\(bench/results/[^)]+\)", raw), f"{figure}: raw results {raw!r}"
    for needed in ("overlap off", "overlap on", "detection"):
        assert any(needed in row.split("|")[1] for row in rows), needed


def test_the_measurement_log_lives_in_docs():
    log = (REPO / "docs" / "measurements.md").read_text()
    for heading in ("## Measured", "### Headline: kvguard in a real SGLang 0.5.23 server on an H200",
                    "### Fault matrix on CPU", "### Long runs on CPU", "## Real bugs, replayed"):
        assert f"\n{heading}\n" in log, heading
    assert "\n## Measured\n" not in README.read_text()


if __name__ == "__main__":  # python tests/test_docs.py: rewrite the README's generated list of paths
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    README.write_text(head + render_paths() + rest.split(END, 1)[1])
