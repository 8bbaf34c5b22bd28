"""The shifted stream of ``bench.loop``: requests for code, which the chat-trained
draft never saw. Each asks for one function of Python's standard library by its
signature and the first paragraph of its docstring ("Write a Python function
``dedent(text)`` that ..."): what the installed Python ships, nothing downloaded.
Which functions, and in what order, follows from hashes of their names and the
seed, never from the order modules list them.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path

MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest", "email.utils",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "functools", "genericpath", "getpass", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http.cookies", "imaplib", "inspect", "ipaddress",
    "json", "keyword", "linecache", "locale", "logging", "mailbox", "mimetypes", "ntpath", "numbers", "operator",
    "optparse", "os.path", "pathlib", "platform", "plistlib", "posixpath", "pprint", "pydoc", "quopri", "random", "re",
    "reprlib", "sched", "secrets", "shlex", "shutil", "smtplib", "socket", "ssl", "stat", "statistics", "string",
    "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "types", "typing", "unittest", "urllib.parse", "uuid", "warnings", "wave", "weakref", "webbrowser",
    "xml.dom.minidom", "zipfile",
)
MIN_SUMMARY_CHARS = 40
"""Shorter first paragraphs ("Return a copy.") say too little to write code from."""
MAX_SUMMARY_CHARS = 400
REQUEST = ("Write a Python function `{name}{signature}` that does the following:\n\n{summary}\n\n"
           "Reply with the code only.")


def functions() -> dict[str, str]:
    """Every public pure-Python function of :data:`MODULES` with a usable
    docstring: its request, keyed by its qualified name."""
    requests: dict[str, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            summary = " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())
            if not MIN_SUMMARY_CHARS <= len(summary) <= MAX_SUMMARY_CHARS:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            if " at 0x" in signature:  # a default's repr with this process's address: not the same prompt twice
                continue
            requests[f"{obj.__module__}.{name}"] = REQUEST.format(name=name, signature=signature, summary=summary)
    return requests


def build(path: Path, count: int, seed: int = 0) -> dict[str, object]:
    """Write ``count`` requests to ``path`` (prompt events, one user turn each);
    what it holds. ``ValueError`` when the library has fewer functions."""
    available = functions()
    if len(available) < count:
        raise ValueError(f"{count} code requests asked, but this Python's library gives {len(available)} functions")
    order = sorted(available, key=lambda name: hashlib.sha256(f"{seed}:{name}".encode()).hexdigest())[:count]
    events = [{"request_id": f"loop-code-{i:05d}", "messages": [{"role": "user", "content": available[name]}],
               "metadata": {"function": name}} for i, name in enumerate(order)]
    data = "".join(json.dumps(e) + "\n" for e in events).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"rows": count, "sha256": hashlib.sha256(data).hexdigest(), "python": sys.version.split()[0],
            "functions_available": len(available)}
