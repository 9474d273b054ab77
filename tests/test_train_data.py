"""``train/data.py``'s training-only sources, on small files in their packages' formats (no download): a POD page
split by ``=head1`` with its formatting codes resolved, a DocBook HTML page without its navigation, dictd entries
located through the index's base-64 offsets; and their documents go to training only, so the held-out set is the
three held-out sources' alone."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parent.parent / "train"


def _data():
    spec = importlib.util.spec_from_file_location("train_data", TRAIN / "data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_data"] = module
    spec.loader.exec_module(module)
    return module


POD = """=head1 NAME

perlfoo - the I<foo> of C<Perl>

=head1 DESCRIPTION

Use B<C<< $x->bar >>> with L<perlfunc/open> or L<the manual|perltoc>; E<lt>tagE<gt> costs E<0x41>E<65> E<eacute>.
X<index entry>Read it.

=over 4

=item * first

A point.

=back

=begin html

<p>dropped</p>

=end html

    verbatim code stays

=cut
"""

HTML = """<html><head><title>2.6. Joins</title></head><body>
<div class="navheader"><table><tr><th>2.6. Joins</th></tr><tr><td><a href="p.html">Prev</a></td></tr></table></div>
<div class="sect1"><h2 class="title">2.6. Joins Between Tables</h2><p>
    Thus far, our queries   have only
    accessed one table &amp; at a time.</p><pre class="programlisting">
SELECT *
  FROM weather;
</pre></div>
<div class="navfooter"><a href="n.html">Next</a></div></body></html>"""


def _b64(n: int) -> str:
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = digits[n % 64] + out
        n //= 64
        if not n:
            return out


def test_pod_page_split_by_head1_with_codes_resolved(tmp_path):
    data = _data()
    pod = tmp_path / "usr/share/perl/5.36.0/pod/perlfoo.pod"
    pod.parent.mkdir(parents=True)
    pod.write_text(POD)
    name, description = data.perl_doc_documents(tmp_path)
    assert name == "NAME\n\nperlfoo - the foo of Perl"
    assert description.split("\n\n") == [
        "DESCRIPTION",
        "Use $x->bar with open or the manual; <tag> costs AA \u00e9.\nRead it.",
        "* first", "A point.", "    verbatim code stays"]


def test_html_page_without_navigation(tmp_path):
    data = _data()
    page = tmp_path / "usr/share/doc/postgresql-doc-15/html/tutorial-join.html"
    page.parent.mkdir(parents=True)
    page.write_text(HTML)
    (doc,) = data.postgres_doc_documents(tmp_path)
    assert doc == ("2.6. Joins Between Tables\n\nThus far, our queries have only accessed one table & at a time.\n\n"
                   "SELECT *\n  FROM weather;")


def test_dictd_entries_by_their_index(tmp_path):
    data = _data()
    entries = ["00-database-info\nthe database's own entry\n", "Abjure\n   To renounce upon oath.\n",
               "FORK, n.  An instrument used chiefly for the purpose of putting dead\nanimals into the mouth.\n"]
    raw = "".join(entries).encode()
    folder = tmp_path / "usr/share/dictd"
    folder.mkdir(parents=True)
    (folder / "demo.dict.dz").write_bytes(gzip.compress(raw))
    index, offset = [], 0
    for word, entry in zip(("00-database-info", "abjure", "fork"), entries):
        index.append(f"{word}\t{_b64(offset)}\t{_b64(len(entry.encode()))}")
        offset += len(entry.encode())
    index.append(f"renounce\t{_b64(len(entries[0]))}\t{_b64(len(entries[1]))}")  # one entry, two headwords
    (folder / "demo.index").write_text("\n".join(index) + "\n")
    assert data.dictd_documents(tmp_path, "demo") == [entries[1].strip(), entries[2].strip()]


def test_training_only_sources_hold_nothing_out(tmp_path, monkeypatch):
    data = _data()
    monkeypatch.setattr(data, "fetch_packages", lambda out: {})
    docs = [f"document number {i} " * 4 for i in range(40)]
    monkeypatch.setattr(data, "SOURCES", {"held": lambda root: docs})
    monkeypatch.setattr(data, "TRAIN_ONLY_SOURCES", {"extra": lambda root: docs})
    manifest = data.build(tmp_path)
    assert manifest["sources"]["held"]["heldout_docs"] == 2 and manifest["sources"]["extra"]["heldout_docs"] == 0
    assert manifest["sources"]["extra"]["train_docs"] == 40
    assert (tmp_path / "heldout.txt").read_text().count("document number") == 2 * 4
