"""The shifted stream of ``bench.loop``: requests for code, which the chat-trained
draft never saw. Each asks for one function of Python's standard library by its
signature and the first paragraph of its docstring ("Write a Python function
``dedent(text)`` that ..."), then, past the functions, for one method of its
public classes ("Write the Python method ``TextWrapper.wrap(self, text)`` ..."):
what the installed Python ships, nothing downloaded. Which ones, and in what
order, follows from hashes of their names and the seed, never from the order
modules list them; the functions come first, so a longer stream begins as a
shorter one. A function another import replaced at run time (its ``__module__``
no longer the module's: torch wraps ``inspect.getfile``) is left out, so the
stream is the one ``bench.loop`` builds after its own imports.
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
REQUEST = ("Write a Python {kind} `{name}{signature}` that does the following:\n\n{summary}\n\n"
           "Reply with the code only.")


def functions() -> dict[str, str]:
    """Every public pure-Python function of :data:`MODULES` with a usable
    docstring: its request, keyed by its qualified name."""
    requests: dict[str, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__:
                _add(requests, f"{obj.__module__}.{name}", "function", name, obj)
    return requests


def methods() -> dict[str, str]:
    """Every public method, with a usable docstring, of the public classes
    :data:`MODULES` define: its request, keyed by its qualified name."""
    requests: dict[str, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for class_name, cls in vars(module).items():
            if class_name.startswith("_") or not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            for name, obj in vars(cls).items():
                if not name.startswith("_") and inspect.isfunction(obj):
                    _add(requests, f"{cls.__module__}.{class_name}.{name}", "method", f"{class_name}.{name}", obj)
    return requests


def _add(requests: dict[str, str], key: str, kind: str, name: str, obj: object) -> None:
    """``obj``'s request under ``key``, where its docstring says enough and its
    signature reads the same in every process."""
    summary = " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())
    if not MIN_SUMMARY_CHARS <= len(summary) <= MAX_SUMMARY_CHARS:
        return
    try:
        signature = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return
    if " at 0x" in signature:  # a default's repr with this process's address: not the same prompt twice
        return
    requests[key] = REQUEST.format(kind=kind, name=name, signature=signature, summary=summary)


def build(path: Path, count: int, seed: int = 0) -> dict[str, object]:
    """Write ``count`` requests to ``path`` (prompt events, one user turn each);
    what it holds. ``ValueError`` when the library has fewer functions."""
    def shuffled(requests: dict[str, str]) -> list[str]:
        return sorted(requests, key=lambda name: hashlib.sha256(f"{seed}:{name}".encode()).hexdigest())

    asked, offered = functions(), methods()
    available = {**asked, **offered}
    if len(available) < count:
        raise ValueError(f"{count} code requests asked, but this Python's library gives {len(available)} functions "
                         "and methods")
    order = (shuffled(asked) + shuffled(offered))[:count]
    events = [{"request_id": f"loop-code-{i:05d}", "messages": [{"role": "user", "content": available[name]}],
               "metadata": {"function": name}} for i, name in enumerate(order)]
    data = "".join(json.dumps(e) + "\n" for e in events).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"rows": count, "sha256": hashlib.sha256(data).hexdigest(), "python": sys.version.split()[0],
            "functions_available": len(asked), "methods_available": len(offered)}
