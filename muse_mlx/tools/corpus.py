"""The tiny model's corpus: the prose of the Python documentation, as Debian packages it.

Source: Debian 12's `python3.11-doc` package (the CPython 3.11 documentation; the Python
Software Foundation License 2, the documentation's own licence; `docs/tiny-model.md`), whose
reStructuredText sources sit under `usr/share/doc/python3.11/html/_sources/`. Nothing is
downloaded at run time: `build` reads an unpacked copy of the package
(`apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb DIR`).

`build` turns each .rst.txt page into plain prose -- section underlines, directive lines,
literal (code) blocks, doctest sessions and option lists dropped, inline roles reduced to their
text, paragraphs joined onto one line -- and splits the pages, whole, into a training and a
held-out set (every `HELD_OUT_EVERY`-th page in path order is held out). The result is
deterministic for a given package: `manifest.json` records the package, the page lists and
the SHA-256 of both texts.

    python -m muse_mlx.tools.corpus DIR OUTDIR   # -> OUTDIR/train.txt, heldout.txt, manifest.json
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

SOURCES = "usr/share/doc/python3.11/html/_sources"
# Every page of prose about Python; left out are the licence, copyright, "about", bug-reporting and
# table-of-contents pages.
SECTIONS = ("tutorial", "library", "reference", "howto", "faq", "using", "extending", "installing",
            "distributing", "whatsnew", "c-api", "distutils", "install", "glossary.rst.txt")
SKIP = ()
HELD_OUT_EVERY = 20
DOCUMENT_SEPARATOR = "\n\x1e\n"   # between pages in train.txt / heldout.txt (ASCII record separator)

# Directives whose indented body is prose worth keeping (the rest -- code, tables of contents,
# index entries, metadata -- goes with its body).
PROSE_DIRECTIVES = {
    "function", "method", "class", "attribute", "data", "exception", "decorator", "decoratormethod",
    "classmethod", "staticmethod", "abstractmethod", "describe", "note", "warning", "seealso",
    "versionadded", "versionchanged", "deprecated", "deprecated-removed", "impl-detail", "tip",
    "important", "admonition", "attention", "caution", "hint", "topic", "sidebar", "glossary",
    "opcode", "cmdoption", "option", "envvar", "pdbcommand", "rubric", "availability",
}

_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+.:_<>])\1{3,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::(.*)$")
_COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")
_FIELD = re.compile(r"^\s*:[\w -]+:")
_ROLE_WITH_TARGET = re.compile(r":[\w:+-]+:`([^`<]*?)\s*<[^`>]*>`")
_ROLE = re.compile(r":[\w:+-]+:`!?~?([^`]*)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`__?")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"`([^`]+)`")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_EMPHASIS = re.compile(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])")
_SUBST = re.compile(r"\|(\w+)\|")


def inline(text: str) -> str:
    """reST inline markup -> its text."""
    text = _ROLE_WITH_TARGET.sub(r"\1", text)
    text = _ROLE.sub(lambda m: m.group(1).lstrip("~!."), text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\1", text)
    text = _SUBST.sub(r"\1", text)
    return text.replace("\\ ", "").replace("\\", "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def page_prose(rst: str) -> str:
    """One documentation page -> paragraphs of prose separated by blank lines."""
    lines = rst.expandtabs(8).splitlines()
    paragraphs, current = [], []
    skip_deeper_than = None   # drop lines indented deeper than this (a dropped block's body)
    literal_next = False      # the paragraph just ended with '::': the indented block is code

    def flush():
        if current:
            text = inline(" ".join(s.strip() for s in current))
            text = re.sub(r"\s+", " ", text).strip()
            if text.endswith(" ::"):
                text = text[:-3]
            elif text.endswith("::"):
                text = text[:-1]
            if len(text) > 1 and not text.startswith((">>>", "$ ", "% ", "+--", "|")):
                paragraphs.append(text)
            current.clear()

    skip_to_blank = False     # a doctest session: dropped up to the next blank line
    for line in lines:
        stripped = line.strip()
        if skip_to_blank:
            skip_to_blank = bool(stripped)
            continue
        if skip_deeper_than is not None:
            if not stripped or _indent(line) > skip_deeper_than:
                continue
            skip_deeper_than = None
        if not stripped:
            flush()
            continue
        if literal_next:
            literal_next = False
            base = _indent(current[0]) if current else 0
            flush()
            if _indent(line) > base:
                skip_deeper_than = base
                continue
        if _ADORNMENT.match(line):
            current.clear() if len(current) == 1 and len(current[0].strip()) <= len(stripped) else flush()
            flush()
            continue
        m = _DIRECTIVE.match(line)
        if m:
            flush()
            if m.group(2).split(":")[-1] not in PROSE_DIRECTIVES:
                skip_deeper_than = len(m.group(1))
            continue
        if _COMMENT.match(line):
            flush()
            skip_deeper_than = _indent(line)
            continue
        if _FIELD.match(line) and not current:
            continue
        if stripped.startswith((">>>", "...")) and not current:
            skip_to_blank = True
            continue
        if current and _indent(line) > _indent(current[0]) + 1 and not stripped.startswith(("*", "-", "#.")):
            current.append(line)
            continue
        if stripped.startswith(("* ", "- ", "#. ")) or re.match(r"^\d+\. ", stripped):
            flush()
        current.append(line)
        if stripped.endswith("::"):
            literal_next = True
    flush()
    return "\n\n".join(paragraphs)


def pages(root: Path) -> list[Path]:
    src = Path(root) / SOURCES
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a folder: unpack python3.11-doc there first")
    found = []
    for section in SECTIONS:
        p = src / section
        found += [p] if p.is_file() else sorted(p.rglob("*.rst.txt"))
    return [p for p in found if str(p.relative_to(src)) not in SKIP]


def build(root, out) -> dict:
    """Unpacked python3.11-doc at `root` -> out/train.txt, out/heldout.txt, out/manifest.json."""
    root, out = Path(root), Path(out)
    src = root / SOURCES
    found = pages(root)
    out.mkdir(parents=True, exist_ok=True)
    train, held = [], []
    names = {"train": [], "heldout": []}
    for i, page in enumerate(found):
        text = page_prose(page.read_text(encoding="utf-8"))
        if len(text) < 200:
            continue
        split = "heldout" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"
        (held if split == "heldout" else train).append(text)
        names[split].append(str(page.relative_to(src)))
    manifest = {"source": "Debian 12 package python3.11-doc (3.11.2-6+deb12u8), " + SOURCES,
                "license": "Python Software Foundation License Version 2 (the CPython documentation's licence)",
                "held_out_every": HELD_OUT_EVERY, "pages": names}
    for split, docs in (("train", train), ("heldout", held)):
        text = DOCUMENT_SEPARATOR.join(docs) + "\n"
        (out / f"{split}.txt").write_text(text, encoding="utf-8")
        manifest[f"{split}_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        manifest[f"{split}_chars"] = len(text)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def documents(text: str) -> list[str]:
    return [d.strip("\n") for d in text.split(DOCUMENT_SEPARATOR) if d.strip()]


def _command(argv=None) -> int:
    from ..cli import Parser
    from ..errors import MuseError

    ap = Parser(prog="python -m muse_mlx.tools.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("package_dir", help="an unpacked python3.11-doc (dpkg-deb -x)")
    ap.add_argument("out", help="the folder for train.txt, heldout.txt, manifest.json")
    args = ap.parse_args(argv)
    try:
        m = build(args.package_dir, args.out)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise MuseError(str(exc)) from None
    print(f"train {m['train_chars']:,} chars ({len(m['pages']['train'])} pages), "
          f"held out {m['heldout_chars']:,} chars ({len(m['pages']['heldout'])} pages)")
    return 0


if __name__ == "__main__":
    from .. import cli

    raise SystemExit(cli.run(_command))
