#!/usr/bin/env python3
"""Checks that every link of README.md resolves from the published package alone.

crates.io and docs.rs render the README without a repository to resolve relative links
against, so every link must be one of:

- an anchor of the README itself (`#features`), naming one of its headings as GitHub-style
  renderers (crates.io, docs.rs) make their ids;
- a page of the crate's rustdoc on docs.rs
  (`https://docs.rs/burstgate/latest/burstgate/layer/index.html#the-rate-limit-fields`): the
  page must be one `cargo doc` builds, and the anchor an id on it;
- a file of the package in docs.rs's source view
  (`https://docs.rs/crate/burstgate/latest/source/docs/DESIGN.md#34`): the file must be in the
  package, and an anchor is a line number (the only anchors that view has), which must be a
  heading whose text is the link's text, so that a line moved by an edit fails here instead of
  pointing at another section.

Reads the package's file list (`cargo package --list`) on standard input and the rustdoc of
the last `cargo doc --no-deps --all-features`; reaches no network. Prints every broken link and
exits 1 if there is one. Run from the repository's root; another file may be named as the one
argument, to try the check on it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

CRATE = "burstgate"
RUSTDOC = f"https://docs.rs/{CRATE}/latest/{CRATE}/"
SOURCE = f"https://docs.rs/crate/{CRATE}/latest/source/"

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
INLINE = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
AUTOLINK = re.compile(r"<(https?://[^>\s]+)>")
HTML_LINK = re.compile(r"(?:href|src)\s*=\s*\"([^\"]+)\"")
BARE = re.compile(r"https?://[^\s<>()\[\]`]+")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text):
    """The lines outside fenced code blocks, with their 1-based numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def plain(text):
    """A heading's or a link's text without its inline markup."""
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\*+|(?<!\w)_+|_+(?!\w)", "", text)
    return " ".join(text.split())


def slug(text):
    """The id a GitHub-style renderer gives a heading."""
    text = plain(text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def headings(text):
    """(line number, text) of each heading outside code blocks."""
    for number, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            yield number, m.group(1)


def readme_anchors(text):
    seen = {}
    anchors = set()
    for _, heading in headings(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def paragraphs(text):
    """Runs of non-blank lines outside code blocks, each joined into one line (a link's text
    may wrap), with the number of the line each character came from."""
    run = []
    last = None
    for number, line in prose_lines(text):
        if (not line.strip() or (last is not None and number != last + 1)) and run:
            yield run
            run = []
        if line.strip():
            run.append((number, line))
        last = number
    if run:
        yield run


def links(text):
    """(line number, link text or None, address) of every link a renderer would make."""
    for run in paragraphs(text):
        joined = " ".join(line for _, line in run)
        numbers = []
        for number, line in run:
            numbers.extend([number] * (len(line) + 1))
        # Code spans are text: nothing that starts in one is a link.
        taken = [m.span() for m in CODE_SPAN.finditer(joined)]

        def free(m):
            return not any(start <= m.start() < end for start, end in taken)

        found = [(m, plain(m.group(2)), m.group(3)) for m in INLINE.finditer(joined) if free(m)]
        for pattern in (AUTOLINK, HTML_LINK):
            found.extend((m, None, m.group(1)) for m in pattern.finditer(joined) if free(m))
        for m, link_text, address in found:
            taken.append(m.span())
            yield numbers[m.start()], link_text, address
        for number, line in run:
            m = DEFINITION.match(line)
            if m:
                yield number, None, m.group(1)
        for m in BARE.finditer(joined):
            if free(m):
                yield numbers[m.start()], None, m.group(0).rstrip(".,;:")


def target_dir():
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        check=True,
        stdout=subprocess.PIPE,
    ).stdout
    return Path(json.loads(meta)["target_directory"])


def main():
    packaged = {line.strip() for line in sys.stdin if line.strip()}
    name = sys.argv[1] if len(sys.argv) > 1 else "README.md"
    readme = Path(name).read_text(encoding="utf-8")
    doc = target_dir() / "doc" / CRATE
    if not (doc / "index.html").is_file():
        sys.exit(f"no rustdoc in {doc}: run `cargo doc --no-deps --all-features` first")
    anchors = readme_anchors(readme)
    broken = []
    checked = 0

    for number, text, address in links(readme):
        checked += 1
        where = f"{name}:{number}: {address}"
        path, _, fragment = address.partition("#")
        if address.startswith("#"):
            if fragment not in anchors:
                broken.append(f"{where}: no heading of the README has the id {fragment!r}")
        elif path.startswith(RUSTDOC) or path == RUSTDOC.rstrip("/"):
            page = path[len(RUSTDOC):]
            if page == "" or page.endswith("/"):
                page += "index.html"
            file = doc / page
            if not file.is_file():
                broken.append(f"{where}: `cargo doc` builds no page {page}")
            elif fragment:
                ids = set(re.findall(r'\sid="([^"]+)"', file.read_text(encoding="utf-8")))
                if fragment not in ids:
                    broken.append(f"{where}: {page} has no id {fragment!r}")
        elif path.startswith(SOURCE):
            file = path[len(SOURCE):]
            if file not in packaged:
                broken.append(f"{where}: the package does not hold {file}")
            elif fragment:
                if not fragment.isdigit():
                    broken.append(
                        f"{where}: docs.rs's source view has line anchors only (#<line>)"
                    )
                    continue
                lines = dict(headings(Path(file).read_text(encoding="utf-8")))
                heading = lines.get(int(fragment))
                if heading is None:
                    broken.append(f"{where}: line {fragment} of {file} is no heading")
                elif text is None or plain(heading).lower() != text.lower():
                    moved = [n for n, h in lines.items() if text and plain(h).lower() == text.lower()]
                    hint = f" (a heading {text!r} is on line {moved[0]})" if moved else ""
                    broken.append(
                        f"{where}: line {fragment} of {file} is the heading {heading!r}, "
                        f"and the link's text must name it{hint}"
                    )
        else:
            broken.append(
                f"{where}: neither an anchor of the README nor a docs.rs address of the package "
                f"({RUSTDOC}... or {SOURCE}...)"
            )

    for line in broken:
        print(line)
    if broken:
        sys.exit(1)
    print(f"{name}: {checked} links, each resolves from the package on crates.io and docs.rs")


if __name__ == "__main__":
    main()
