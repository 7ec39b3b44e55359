"""A built-in English corpus that needs no download: Python's own documentation.

Every CPython install ships ``pydoc_data.topics`` (the language reference topics that ``help()``
shows) and docstrings in its standard library. ``gptrain data builtin`` exports them as JSONL, one
document per line, ``{"text": ...}``, in a fixed order.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Iterator

# standard-library modules whose import has no side effect and whose docstrings are prose
STDLIB_MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins calendar cmath codecs collections "
    "collections.abc colorsys concurrent.futures configparser contextlib copy csv dataclasses datetime "
    "decimal difflib dis email enum filecmp fnmatch fractions ftplib functools getopt gettext glob "
    "gzip hashlib heapq hmac html html.parser http.client http.server imaplib inspect io ipaddress "
    "itertools json keyword linecache locale logging lzma mailbox math mimetypes multiprocessing "
    "numbers operator optparse os pathlib pickle pkgutil platform plistlib poplib pprint queue "
    "quopri random re reprlib sched secrets selectors shelve shlex shutil signal smtplib socket "
    "socketserver sqlite3 statistics string stringprep struct subprocess symtable sysconfig tarfile "
    "tempfile textwrap threading timeit token tokenize trace traceback types typing unicodedata "
    "unittest urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom "
    "xml.etree.ElementTree zipfile zlib"
).split()
MIN_DOC_CHARS = 120


def _docstrings(module_name: str) -> Iterator[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # an optional module missing from this build (e.g. sqlite3) is simply skipped
        return
    seen: set[int] = set()

    def visit(obj, depth: int) -> Iterator[str]:
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= MIN_DOC_CHARS:
            yield doc
        if inspect.ismodule(obj) or inspect.isclass(obj):
            for name in sorted(vars(obj)):
                if name.startswith("_"):
                    continue
                member = vars(obj)[name]
                owner = getattr(member, "__module__", None)
                if (inspect.isclass(member) or inspect.isfunction(member)) and owner == module.__name__:
                    yield from visit(member, depth + 1)

    yield from visit(module, 0)


def builtin_documents() -> Iterator[str]:
    """The corpus's documents, in a fixed order: reference topics, then docstrings."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text
    for module_name in STDLIB_MODULES:
        yield from _docstrings(module_name)


# The corpus as built once and shipped: docstrings differ between Python versions (1126 documents
# on 3.11.7, 1138 on 3.12.1), so the shipped bytes make the data, and every number measured on it,
# the same everywhere. builtin_documents() builds it from the running Python where it is absent.
SHIPPED = Path(__file__).with_name("builtin_corpus.jsonl.xz")


def write_builtin_corpus(output: str | os.PathLike) -> tuple[int, int]:
    """Write the corpus as JSONL to ``output``; return (documents, bytes)."""
    output = Path(output)
    tmp = output.with_name(output.name + f".tmp-{os.getpid()}")
    count = 0
    if SHIPPED.is_file():
        import lzma

        with lzma.open(SHIPPED, "rb") as src, open(tmp, "wb") as f:
            for line in src:
                f.write(line)
                count += 1
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            for text in builtin_documents():
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                count += 1
    os.replace(tmp, output)
    return count, output.stat().st_size
