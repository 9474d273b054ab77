"""Data step for the default model: English text from Debian packages, cleaned and split.

Owns: fetching the source packages with ``apt-get download`` (no root side effects: nothing is
installed, each ``.deb`` is unpacked with ``dpkg -x`` into the work folder), turning each source into
plain-text documents, and the fixed train / held-out split. Leaves tokenizing and training to
``tokenizer.py`` and ``train_model.py``.

Sources (Debian bookworm):
- ``bible-kjv-text`` (+ the ``bible-kjv`` reader, run from the unpacked package): one document per chapter.
- ``fortunes-min`` and ``fortunes``: one document per fortune.
- ``python3.11-doc``: the Python manual in GNU info form, one document per info node.

Training-only sources (more text to train on; none of it held out, so the held-out set and its perplexities stay
comparable with the three sources above alone):
- ``perl-doc``: the Perl manual's POD pages, one document per ``=head1`` section, formatting codes dropped.
- ``postgresql-doc-15``: the PostgreSQL manual's HTML pages, one document per page, navigation dropped.
- ``dict-foldoc``, ``dict-jargon``, ``dict-devil``: the Free On-line Dictionary of Computing, the Jargon File and
  Bierce's Devil's Dictionary (dictd databases), one document per entry.

Split rule: within each held-out source, document number ``i`` (in the order the source gives them) is held out
when ``i % 20 == 19``; everything else is training text.

Writes into ``--out``: ``train.jsonl`` and ``heldout.jsonl`` (one ``{"source", "text"}`` per line),
``heldout.txt`` (the held-out documents as plain text, separated by blank lines), ``heldout-sample.txt``
(every 10th held-out document, for perplexity on a CPU) and ``manifest.json``
(package versions and file hashes, document and character counts).

    python train/data.py --out .gpu/data
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import re
import subprocess
import unicodedata
from html.parser import HTMLParser
from pathlib import Path

PACKAGES = ("bible-kjv-text", "bible-kjv", "fortunes-min", "fortunes", "python3.11-doc", "perl-doc",
            "postgresql-doc-15", "dict-foldoc", "dict-jargon", "dict-devil")
HELDOUT_EVERY = 20
SAMPLE_EVERY = 10
MIN_DOC_CHARS = 40

_UNDERLINE = re.compile(r"^\s*([=*\-.~^#_+])\1{2,}\s*$")
_MENU_ITEM = re.compile(r"^\* .*::|^\* [^:]+: .*\.( \(line +\d+\))?$|^\* Menu:")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# Info cross-references: "*note LABEL: 1a2." (Sphinx anchor ids) or "*note LABEL::".
_XREF = re.compile(r"\*[Nn]ote\s+([^:*]{1,120}?)(?::\s*[0-9a-f]+([.,])|::)")
_SENTENCE_END = re.compile(r"\s*\n\n|\s*$|\s+[A-Z]")


def fetch_packages(work: Path) -> dict[str, dict[str, str]]:
    """Download the packages into ``work/debs`` and unpack each into ``work/root``."""
    debs, root = work / "debs", work / "root"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True, capture_output=True)
    found: dict[str, dict[str, str]] = {}
    for deb in sorted(debs.glob("*.deb")):
        name, version = deb.name.split("_")[:2]
        if name not in PACKAGES:
            continue
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        found[name] = {"file": deb.name, "version": version, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest()}
    missing = sorted(set(PACKAGES) - set(found))
    if missing:
        raise RuntimeError(f"apt-get download did not deliver: {', '.join(missing)}")
    return found


def normalize(text: str) -> str:
    """NFC, tabs expanded, control characters dropped, trailing spaces and runs of blank lines removed."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").expandtabs(4)
    text = _CONTROL.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def bible_documents(root: Path) -> list[str]:
    """One document per chapter: the chapter title, then one verse per line (verse numbers dropped)."""
    reader = root / "usr/bin/bible"
    out = subprocess.run(
        [str(reader), "-p", str(root / "usr/lib"), "-d", "bible.data", "-l", "100000", "Gen1:1-Rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    docs: list[list[str]] = []
    for line in out.split("\n"):
        verse = re.match(r"^\s+\d+ (.*)$", line)
        if verse:
            docs[-1].append(verse.group(1))
        elif line.strip():
            docs.append([line.strip(), ""])
    return [normalize("\n".join(doc)) for doc in docs]


def fortune_documents(root: Path) -> list[str]:
    """One document per fortune, files in name order; ``.dat`` indexes and ``.u8`` links skipped."""
    folder = root / "usr/share/games/fortunes"
    docs: list[str] = []
    for path in sorted(folder.iterdir()):
        if path.suffix in (".dat", ".u8") or path.is_symlink() or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        docs.extend(normalize(chunk) for chunk in re.split(r"\n%\n", "\n" + text + "\n"))
    return docs


def _strip_xrefs(text: str) -> str:
    """Keep a reference's label; keep its closing '.' only where it also ends a sentence."""

    def label(m: re.Match) -> str:
        end = m.group(2) or ""
        if end == "." and not _SENTENCE_END.match(text, m.end()):
            end = ""
        return " ".join(m.group(1).split()) + end

    return _XREF.sub(label, text)


def python_doc_documents(root: Path) -> list[str]:
    """One document per info node of the Python manual, without node headers, menus and rule lines."""
    raw = gzip.decompress((root / "usr/share/info/python3.11.info.gz").read_bytes()).decode("utf-8", "replace")
    docs: list[str] = []
    for node in raw.split("\x1f")[1:]:
        lines = node.split("\n")
        if not lines or not lines[1].startswith("File: "):
            continue  # tag tables and indirect tables, not prose
        kept = [line for line in lines[2:] if not _UNDERLINE.match(line) and not _MENU_ITEM.match(line)]
        docs.append(normalize(_strip_xrefs("\n".join(kept))))
    return docs


_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}
_POD_WIDE = re.compile(r"([BCIFSLEXZ])(<{2,})\s")


def _pod_code(kind: str, text: str) -> str:
    """What the formatting code ``kind<text>`` (its text resolved already) reads as."""
    if kind in "XZ":
        return ""
    if kind == "E":  # a named escape, an HTML entity name, or a decimal number (0x: hex, 0: octal)
        if text in _POD_ESCAPES:
            return _POD_ESCAPES[text]
        if text[:1].isdigit():
            return chr(int(text, 16 if text.startswith("0x") else 8 if text.startswith("0") else 10))
        return html.unescape(f"&{text};")
    if kind == "L":  # "text|target" -> text; "page/section" -> section
        text = text.split("|", 1)[0] if "|" in text else text.rsplit("/", 1)[-1].strip('"')
    return text


def _pod_codes(s: str, i: int = 0, close: str = "") -> tuple[str, int]:
    """``s`` from ``i`` with its formatting codes resolved, up to ``close`` (a code's end: ``>``, or ``>>`` after a
    space for ``C<< ... >>``); the text and the index after ``close``."""
    out = []
    while i < len(s):
        if close and s.startswith(close, i) and (close == ">" or s[i - 1].isspace()):
            return "".join(out).strip() if close != ">" else "".join(out), i + len(close)
        wide = _POD_WIDE.match(s, i)
        if wide:
            text, i = _pod_codes(s, wide.end(), ">" * len(wide.group(2)))
            out.append(_pod_code(wide.group(1), text))
        elif s[i] in "BCIFSLEXZ" and s.startswith("<", i + 1):
            kind = s[i]
            text, i = _pod_codes(s, i + 2, ">")
            out.append(_pod_code(kind, text))
        else:
            out.append(s[i])
            i += 1
    return "".join(out), i


def pod_text(pod: str) -> str:
    """A POD page as plain text: headings and items as paragraphs of their own, formatting codes resolved, commands
    without text (``=over``, ``=cut``) and ``=begin`` ... ``=end`` blocks dropped."""
    out, skipping = [], False
    for block in re.split(r"\n\s*\n", pod):
        command = re.match(r"^=(\w+)\s*(.*)", block, re.S)
        if command:
            name, rest = command.groups()
            skipping = name == "begin" or (skipping and name != "end")
            if skipping or not (name.startswith("head") or name == "item"):
                continue
            block = rest.strip()
        if skipping or not block.strip():
            continue
        out.append(block if block[:1].isspace() else _pod_codes(block)[0])  # verbatim paragraphs as they are
    return "\n\n".join(out)


def perl_doc_documents(root: Path) -> list[str]:
    """One document per ``=head1`` section of every page of the Perl manual, pages in name order."""
    docs: list[str] = []
    for path in sorted(root.glob("usr/share/perl/*/pod/*.pod")):
        pod = path.read_text(encoding="utf-8", errors="replace")
        sections = re.split(r"\n(?==head1 )", "\n" + pod)
        docs.extend(normalize(pod_text(section)) for section in sections if section.strip())
    return docs


class _HtmlText(HTMLParser):
    """The text of a DocBook HTML page: paragraphs and block elements on lines of their own, runs of spaces
    collapsed outside ``<pre>``, the navigation header and footer dropped."""

    BLOCKS = {"p", "div", "pre", "li", "dt", "dd", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "table", "br", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0  # > 0 inside a navigation div (counting the divs nested in it)
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if tag == "div" and (self.skip_depth or dict(attrs).get("class") in ("navheader", "navfooter")):
            self.skip_depth += 1
        elif tag in ("script", "style", "head"):
            self.skip_depth += 1
        self.pre += tag == "pre"
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if (tag == "div" and self.skip_depth) or (tag in ("script", "style", "head") and self.skip_depth):
            self.skip_depth -= 1
        self.pre -= tag == "pre" and self.pre > 0
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if self.skip_depth:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip()
        self.parts.append(data)


def html_text(page: str) -> str:
    parser = _HtmlText()
    parser.feed(page)
    parser.close()
    return "".join(parser.parts)


def postgres_doc_documents(root: Path) -> list[str]:
    """One document per page of the PostgreSQL manual, pages in name order."""
    pages = sorted(root.glob("usr/share/doc/postgresql-doc-*/html/*.html"))
    return [normalize(html_text(p.read_text(encoding="utf-8", errors="replace"))) for p in pages]


_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def dictd_documents(root: Path, name: str) -> list[str]:
    """One document per entry of the dictd database ``name``, in its index's order (the database's own
    ``00-database-*`` entries left out)."""
    raw = gzip.decompress((root / f"usr/share/dictd/{name}.dict.dz").read_bytes())
    docs: list[str] = []
    for line in (root / f"usr/share/dictd/{name}.index").read_text(encoding="utf-8", errors="replace").splitlines():
        word, offset, length = line.split("\t")[:3]
        if word.startswith("00database") or word.startswith("00-database"):
            continue
        start, size = (sum(_B64[c] << 6 * i for i, c in enumerate(reversed(v))) for v in (offset, length))
        docs.append(normalize(raw[start : start + size].decode("utf-8", errors="replace")))
    return list(dict.fromkeys(docs))  # an entry indexed under several headwords, once


SOURCES = {
    "bible": bible_documents,
    "fortunes": fortune_documents,
    "python-doc": python_doc_documents,
}
TRAIN_ONLY_SOURCES = {
    "perl-doc": perl_doc_documents,
    "postgresql-doc": postgres_doc_documents,
    "foldoc": lambda root: dictd_documents(root, "foldoc"),
    "jargon": lambda root: dictd_documents(root, "jargon"),
    "devil": lambda root: dictd_documents(root, "devil"),
}


def split_documents(docs: list[str], held_out: bool = True) -> tuple[list[str], list[str]]:
    """The fixed rule: document ``i`` is held out when ``i % HELDOUT_EVERY == HELDOUT_EVERY - 1`` (``held_out``:
    the source gives held-out text; else all of it trains)."""
    docs = [d for d in docs if len(d) >= MIN_DOC_CHARS]
    held = [held_out and i % HELDOUT_EVERY == HELDOUT_EVERY - 1 for i in range(len(docs))]
    return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


def build(out: Path) -> dict:
    packages = fetch_packages(out)
    manifest: dict = {"packages": packages, "heldout_every": HELDOUT_EVERY, "sources": {}}
    train_rows: list[dict] = []
    heldout_rows: list[dict] = []
    for name, extract in {**SOURCES, **TRAIN_ONLY_SOURCES}.items():
        train, heldout = split_documents(extract(out / "root"), held_out=name in SOURCES)
        if not train or (name in SOURCES and not heldout):
            raise RuntimeError(f"source {name} gave no documents")
        train_rows += [{"source": name, "text": t} for t in train]
        heldout_rows += [{"source": name, "text": t} for t in heldout]
        manifest["sources"][name] = {
            "train_docs": len(train),
            "heldout_docs": len(heldout),
            "train_chars": sum(map(len, train)),
            "heldout_chars": sum(map(len, heldout)),
        }
    for fname, rows in (("train.jsonl", train_rows), ("heldout.jsonl", heldout_rows)):
        with open(out / fname, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "heldout.txt").write_text("\n\n".join(r["text"] for r in heldout_rows) + "\n", encoding="utf-8")
    # A tenth of the held-out documents (every 10th, all sources), for perplexity runs on a CPU.
    sample = heldout_rows[::SAMPLE_EVERY]
    (out / "heldout-sample.txt").write_text("\n\n".join(r["text"] for r in sample) + "\n", encoding="utf-8")
    for fname in ("train.jsonl", "heldout.jsonl", "heldout.txt", "heldout-sample.txt"):
        manifest[fname] = hashlib.sha256((out / fname).read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu/data"), help="work folder (git-ignored)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(build(args.out), indent=2))


if __name__ == "__main__":
    main()
