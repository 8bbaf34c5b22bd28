"""The corpora of the acceptance benchmark: chat prompts made of real English
text that a fresh ``make install`` ships, nothing downloaded.

* ``train.jsonl``: passages of the installed third-party packages' own
  documentation: the long descriptions of their ``METADATA`` (their READMEs),
  their modules' docstrings and the ``.md``/``.rst``/``.txt`` files their wheels
  ship.
* ``eval.jsonl``: passages of CPython's language reference as ``help()`` shows it
  (``pydoc_data.topics``), a source training never sees: a training passage that
  shares text with any help topic is dropped.

Each passage becomes one user turn asking to explain, summarize, rewrite, list
the key points of, ... it; the rows carry no answer: the verifier writes it
(``hsx run --generate``), as EAGLE-3's recipe regenerates answers. Which
passages are taken, and which request each gets, follows from hashes of the
passage and the seed, never from the order packages are found in: another
version of a package changes its own passages and, through them, few others.

    python -m bench.acceptance_corpus OUT_DIR [--train N] [--eval N] [--seed S]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import inspect
import json
import os
import re
import statistics
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pydoc_data.topics

MAX_PASSAGE_CHARS = 600
"""Short enough for a 135M model's answer to stay about the passage, and for the
prompt to stay under ~200 tokens."""
MIN_PASSAGE_CHARS = 120
"""Shorter pieces are mostly captions and one-line notes: little to explain."""
MAX_PER_DOCUMENT = 24
"""So no one long document (a README with its changelog, Newton's *Opticks*
shipped as a test file) makes up much of a set."""
SHINGLE_WORDS = 5
NEAR_DUPLICATE = 0.3
"""The share of a passage's 5-word shingles already taken (or in the evaluation
source) that makes it a near-duplicate: READMEs of one family of packages that
differ by a name, a passage one package quotes from another."""
EXCLUDED_DISTRIBUTIONS = frozenset({"hsx"})
"""hsx's own README describes the system under test and changes with every
commit; the corpus should change with the environment only."""
SHIPPED_SUFFIXES = (".md", ".rst", ".txt")
DOCSTRING_BYTES = 16384
"""How much of a Python file is read for its docstring: nearly every module
docstring fits, and reading whole files would take seconds."""
MODULE_DOCSTRING = re.compile(rb'\A(?:[ \t]*(?:#[^\n]*)?\r?\n)*[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.DOTALL)
"""Blank and comment lines (shebang, encoding, licence header), then a triple-quoted string."""
NOT_PROSE_FILE = re.compile(
    r"licen[cs]e|copying|notice|copyright|authors|requirements|vendor|version|sources|entry_points|top_level|"
    r"cmakelists|dependency_links|namespace_packages", re.IGNORECASE)
"""Names of shipped files that hold legal text or lists, not prose."""

TASKS: dict[str, str] = {
    "explain": "Explain the following passage in simple terms:\n\n{passage}",
    "summarize": "Summarize this text in two or three sentences.\n\n{passage}",
    "key_points": "{passage}\n\nList the key points of the text above.",
    "rewrite": "Rewrite the following paragraph so that it is easier to read:\n\n{passage}",
    "main_idea": "What is the main idea of this passage?\n\n{passage}",
    "beginner": "I'm new to programming. Can you explain what this means?\n\n\"{passage}\"",
    "one_sentence": "Give a one-sentence summary of the following:\n\n{passage}",
    "questions": "{passage}\n\nWrite three questions a reader could answer from this passage, with their answers.",
    "title": "Suggest a short title for this passage and say why it fits.\n\n{passage}",
    "audience": "{passage}\n\nWho is this text written for, and what does it want them to know?",
    "example": "Read this and give a concrete example of what it describes:\n\n{passage}",
    "plain_words": "{passage}\n\nCan you say the same thing in plain words, in fewer sentences?",
}
"""The requests a passage is turned into, named (the name goes into the row's
metadata); the template decides whether the passage comes first or last."""

STOPWORDS = frozenset(
    "a an the and or but if of to in on at by for with from as is are was were be been being it its this that these "
    "those there their they them you your we our he she his her not no can may will would should could do does did "
    "has have had which who what when where how than then so such also only into over under about all any each more "
    "most other some one two".split())
"""English function words: prose uses many, code, tables and other languages few."""
MIN_STOPWORD_SHARE = 0.2
MAX_SYMBOL_SHARE = 0.05
MAX_FOREIGN_SHARE = 0.02
"""Of the letters, those outside ASCII: a name or a borrowed word, not a text in
another script."""
WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")
LETTER = re.compile(r"[^\W\d_]")
FOREIGN_LETTER = re.compile(r"[^\W\d_A-Za-z]")
SYMBOLS = "{}[]()<>=;_\\|@#$%^&*~`+/"
CODE_LINE = re.compile(
    r"^\s*(>>>|\$ |\.\.\. |(pip|conda|uv) install|import \w|from [\w.]+ import |def \w|class \w+[:(]|@\w)",
    re.MULTILINE)
BOILERPLATE = ("license", "licence", "copyright", "warrant", "redistribut", "all rights reserved", "liabilit", "spdx")
"""Words of legal text, lowercase."""
URL = re.compile(r"://|\bwww\.")
REFERENCE = re.compile(r"#\d+|(?<![\w.])@[\w-]+")
"""Issue numbers and user names: two or more make a changelog's credits, not prose."""

BREAK = "\x00"
"""Stands where something that is not prose (code, a heading, a table) was, so
that no passage reads across it."""
UNDERLINE = re.compile(r"^([=\-~^*#+\"'`])\1{2,}\s*$")
HEADING_OR_TABLE = re.compile(r"^(#{1,6}\s|\s*[|+][-=+|:\s]|\s*\||\.\. |\s*\[[^\]]+\]:\s)")
"""Markdown headings, table rows, reST directives and targets, link definitions."""
LIST_ITEM = re.compile(r"^([-*+]|\d+[.)])\s+")
INLINE_MARKUP: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"!\[[^\]]*\]\([^)]*\)"), ""),  # images and badges
    (re.compile(r"\[\s*\]\([^)]*\)"), ""),  # a link left empty by its badge
    (re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"),  # [text](url)
    (re.compile(r"\[([^\]]+)\]\[[^\]]*\]"), r"\1"),  # [text][ref]
    (re.compile(r"`([^`<]+?)\s*<[^>]+>`__?"), r"\1"),  # `text <url>`_
    (re.compile(r":[\w:.-]+:`[~!]?([^`]+)`"), r"\1"),  # :role:`target`
    (re.compile(r"`+([^`]+?)`+_{0,2}"), r"\1"),  # ``code``, `code`, `ref`_
    (re.compile(r"(?<!\w)([A-Za-z][\w-]*?)_(?!\w)"), r"\1"),  # reST's ref_
    (re.compile(r"</?[A-Za-z][^>]*>"), ""),  # HTML tags
    (re.compile(r"\*\*(\S(?:.*?\S)?)\*\*"), r"\1"),  # **bold**
    (re.compile(r"(?<![\w*])\*(?!\s)([^*\n]+?)(?<!\s)\*(?![\w*])"), r"\1"),  # *italic*
]
FOOTNOTE = re.compile(r" ?\[\d+\]")
LITERAL_BLOCK_MARKER = re.compile(r"::$", re.MULTILINE)
"""reST's "as follows::" before a literal block; what it introduces is not kept."""
SENTENCE_CLOSERS = (".", "!", "?", ")", '"', "'", "\u201d")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


SOURCES = {
    "train": "installed third-party packages (METADATA descriptions, module docstrings, shipped .md/.rst/.txt files)",
    "eval": "CPython help topics (pydoc_data.topics)",
}


class CorpusTooSmall(RuntimeError):
    """Fewer distinct passages than the rows asked for."""


@dataclass(frozen=True)
class Document:
    """One text of a source: ``source`` names what ships it (a package, or
    ``pydoc_data.topics``), ``name`` the text itself."""

    source: str
    name: str
    text: str
    markup: bool
    """Markdown or reST (inline markup to strip), rather than plain text."""


@dataclass(frozen=True)
class Passage:
    """A piece of a document that becomes one prompt."""

    source: str
    document: str
    text: str


def package_documents() -> list[Document]:
    """The training source: each installed third-party distribution's long
    description, its modules' docstrings and the documentation files its wheel
    ships, sorted by name. Only the environment's own site-packages are looked
    in, not ``sys.path``: importing some packages puts more folders there (setuptools
    adds its ``_vendor``), which would make the corpus depend on what the calling
    process imported before."""
    seen: set[str] = set()
    documents = []
    site_packages = list(dict.fromkeys(sysconfig.get_path(kind) for kind in ("purelib", "platlib")))
    for dist in metadata.distributions(path=site_packages):
        meta = dist.metadata
        name = re.sub(r"[-_.]+", "-", meta["Name"] if "Name" in meta else "").lower()
        # The first of two copies on the path is the one Python imports.
        if not name or name in seen or name in EXCLUDED_DISTRIBUTIONS:
            continue
        seen.add(name)
        # The body of METADATA (or, in Metadata 1.x, its dedented header) is the
        # long description.
        if "Description" in meta:
            documents.append(Document(name, f"{name}/METADATA", meta["Description"], markup=True))
        # RECORD read as plain CSV: ``dist.files`` builds a path object per file,
        # seconds over the tens of thousands installed.
        root = str(dist.locate_file(""))
        for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
            path = row[0] if row else ""
            stem, dot, suffix = path.rpartition(".")
            if (not dot or path.startswith("..") or ".dist-info/" in path or ".egg-info/" in path
                    or f".{suffix}" not in (".py", *SHIPPED_SUFFIXES)):
                continue
            location = os.path.join(root, path)
            if suffix == "py":
                text = module_docstring(location)
            elif NOT_PROSE_FILE.search(stem.rpartition("/")[2]):
                continue
            else:
                try:
                    with open(location, encoding="utf-8") as file:
                        text = file.read()
                except (OSError, UnicodeDecodeError):
                    continue  # listed in RECORD but absent, or not text: nothing to read
            # Most module docstrings are one line: too short to give a passage.
            if len(text) >= MIN_PASSAGE_CHARS:
                documents.append(Document(name, f"{name}:{path}", text, markup=suffix != "txt"))
    return sorted(documents, key=lambda d: d.name)


def module_docstring(path: str) -> str:
    """The docstring a Python file opens with, found in its first bytes without
    parsing the file (tens of thousands are installed)."""
    try:
        with open(path, "rb") as file:
            head = file.read(DOCSTRING_BYTES)
    except OSError:
        return ""
    match = MODULE_DOCSTRING.match(head)
    if not match:
        return ""
    try:
        return inspect.cleandoc(match.group(2).decode("utf-8"))
    except UnicodeDecodeError:
        return ""


def python_help_documents() -> list[Document]:
    """The evaluation source: the help topics of CPython's language reference."""
    return [Document("pydoc_data.topics", f"pydoc_data.topics:{topic}", text, markup=False)
            for topic, text in sorted(pydoc_data.topics.topics.items())]


def is_prose(text: str) -> bool:
    """English prose: not code, not a table or a list of names, not legal text,
    not another language. The cheap checks first: tens of thousands of
    paragraphs come through here."""
    lower = text.lower()
    if (any(word in lower for word in BOILERPLATE) or CODE_LINE.search(text) or URL.search(text)
            or sum(map(text.count, SYMBOLS)) > MAX_SYMBOL_SHARE * len(text)
            or len(REFERENCE.findall(text)) >= 2):
        return False
    if not text.isascii() and len(FOREIGN_LETTER.findall(text)) > MAX_FOREIGN_SHARE * len(LETTER.findall(text)):
        return False
    words = WORD.findall(lower)
    return len(words) >= 6 and sum(map(STOPWORDS.__contains__, words)) >= MIN_STOPWORD_SHARE * len(words)


def paragraphs(document: Document) -> list[str]:
    """The document's paragraphs as prose, markup stripped; :data:`BREAK` where
    anything else was."""
    text = document.text.replace("\r\n", "\n").expandtabs(4)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", f"\n\n{BREAK}\n\n", text, flags=re.DOTALL | re.MULTILINE)
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if UNDERLINE.match(line):
            lines[i] = f"\n{BREAK}\n"
            if i and lines[i - 1].strip():
                lines[i - 1] = ""  # the title above a reST underline
        elif HEADING_OR_TABLE.match(line):
            lines[i] = f"\n{BREAK}\n"
    text = "\n".join(lines)
    # On the whole text, not paragraph by paragraph: thousands of short calls
    # cost more than the matching.
    if document.markup:
        for pattern, replacement in INLINE_MARKUP:
            text = pattern.sub(replacement, text)
    text = FOOTNOTE.sub("", text)
    text = LITERAL_BLOCK_MARKER.sub(":", text)
    result = []
    for block in re.split(r"\n\s*\n", text):
        if not block.strip():
            continue
        # Indented blocks are code, grammar productions and literal blocks (reST,
        # the help topics, Markdown's indented code).
        if block.strip() == BREAK or block.startswith("  "):
            result.append(BREAK)
            continue
        items: list[str] = []
        for line in block.split("\n"):
            line = " ".join(line.split())
            if not items or LIST_ITEM.match(line):
                items.append(LIST_ITEM.sub(lambda m: "- " if m.group(1) in "-*+" else m.group(0), line))
            else:
                items[-1] += " " + line
        paragraph = "\n".join(items).strip()
        result.append(paragraph if is_prose(paragraph) else BREAK)
    return result


def _unfinished(paragraph: str) -> bool:
    """Ends by introducing something ("... as follows:") or breaking off (before
    a citation, a literal): what came next was not prose. A list item may end
    without a stop."""
    return paragraph.endswith(":") or not (
        paragraph.endswith(SENTENCE_CLOSERS) or LIST_ITEM.match(paragraph.rpartition("\n")[2]))


def passages(document: Document) -> list[Passage]:
    """Runs of consecutive prose paragraphs of ``MIN_PASSAGE_CHARS`` to
    ``MAX_PASSAGE_CHARS``; a longer paragraph is cut between sentences."""
    pieces: list[str] = []
    for paragraph in paragraphs(document):
        if len(paragraph) <= MAX_PASSAGE_CHARS:
            pieces.append(paragraph)
            continue
        chunk = ""
        for sentence in SENTENCE_END.split(paragraph):
            if len(sentence) > MAX_PASSAGE_CHARS:
                pieces += [chunk, BREAK] if chunk else [BREAK]
                chunk = ""
            elif chunk and len(chunk) + 1 + len(sentence) > MAX_PASSAGE_CHARS:
                # A paragraph's chunks stand apart: merged, they would read as two paragraphs.
                pieces += [chunk, BREAK]
                chunk = sentence
            else:
                chunk = f"{chunk} {sentence}" if chunk else sentence
        pieces += [chunk, BREAK] if chunk else [BREAK]
    result = []
    window: list[str] = []
    for piece in [*pieces, BREAK]:
        if piece != BREAK and len("\n\n".join([*window, piece])) <= MAX_PASSAGE_CHARS:
            window.append(piece)
            continue
        while window and _unfinished(window[-1]):
            window.pop()
        text = "\n\n".join(window)
        # Checked again as a whole: a sentence cut from a long paragraph can be
        # the code-heavy part the paragraph's share of prose hid.
        if len(text) >= MIN_PASSAGE_CHARS and is_prose(text):
            result.append(Passage(document.source, document.name, text))
        window = [] if piece == BREAK else [piece]
    return result


def _shingles(text: str) -> set[tuple[str, ...]]:
    """The runs of ``SHINGLE_WORDS`` words, case and punctuation ignored."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}


def _digest(seed: int, purpose: str, text: str) -> str:
    """A passage's hash for a seed and a purpose (independent across purposes),
    the same on every machine and Python, unlike ``hash``."""
    return hashlib.sha256(f"{seed}\x00{purpose}\x00{text}".encode()).hexdigest()


def select(candidates: list[Passage], count: int, seed: int, taken: set[tuple[str, ...]]) -> list[Passage]:
    """Up to ``count`` passages, taken in the seed's hash order, skipping
    near-duplicates of one taken before or of the text of ``taken``, and the
    passages of a document that has given ``MAX_PER_DOCUMENT``."""
    taken = set(taken)
    chosen: list[Passage] = []
    per_document: Counter[str] = Counter()
    for passage in sorted(candidates, key=lambda p: (_digest(seed, "select", p.text), p.document)):
        if len(chosen) == count:
            break
        shingles = _shingles(passage.text)
        if per_document[passage.document] >= MAX_PER_DOCUMENT or (
                len(shingles & taken) >= NEAR_DUPLICATE * len(shingles)):
            continue
        taken |= shingles
        per_document[passage.document] += 1
        chosen.append(passage)
    # In an order of their own: in selection order, a long document's passages
    # crowd the first rows until it reaches MAX_PER_DOCUMENT, and a prefix of the
    # file (``hsx run --limit``) should be a sample of the whole.
    return sorted(chosen, key=lambda p: (_digest(seed, "order", p.text), p.document))


def task_of(passage: Passage, seed: int) -> str:
    """The request a passage is turned into, by a hash of its own."""
    names = list(TASKS)
    return names[int(_digest(seed, "task", passage.text), 16) % len(names)]


def rows(split: str, chosen: list[Passage], seed: int) -> list[dict[str, object]]:
    """Prompt events of one user turn each, ids numbered in the given order."""
    return [{
        "request_id": f"acceptance-{split}-{i:05d}",
        "messages": [{"role": "user", "content": TASKS[task_of(p, seed)].format(passage=p.text)}],
        "metadata": {"split": split, "source": p.source, "document": p.document, "task": task_of(p, seed)},
    } for i, p in enumerate(chosen)]


def _candidates(documents: list[Document]) -> list[Passage]:
    """Every passage of the documents, in their order."""
    return [p for d in documents for p in passages(d)]


def build(out_dir: Path, train_size: int = 2400, eval_size: int = 120, seed: int = 0) -> dict[str, object]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl``; return what they
    hold. :class:`CorpusTooSmall`, before anything is written, when either source
    gives fewer distinct passages than asked."""
    evaluation = _candidates(python_help_documents())
    training = _candidates(package_documents())
    # Every passage of the evaluation source counts as taken for training (not
    # only the ones chosen), so no seed or size lets training see its text.
    eval_shingles: set[tuple[str, ...]] = set()
    for passage in evaluation:
        eval_shingles |= _shingles(passage.text)
    candidates = {"train": training, "eval": evaluation}
    chosen = {"train": select(training, train_size, seed, eval_shingles),
              "eval": select(evaluation, eval_size, seed, set())}
    for split, asked in (("train", train_size), ("eval", eval_size)):
        if len(chosen[split]) < asked:
            raise CorpusTooSmall(
                f"{split}: {asked} rows asked, but the {SOURCES[split]} give only {len(chosen[split])} distinct "
                f"passages ({len(candidates[split])} before removing near-duplicates, at most {MAX_PER_DOCUMENT} "
                f"per document); ask for fewer with --{split} N")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"seed": seed, "python": sys.version.split()[0]}
    for split, picked in chosen.items():
        events = rows(split, picked, seed)
        data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in events).encode()
        path = out_dir / f"{split}.jsonl"
        path.write_bytes(data)
        tasks = [task_of(p, seed) for p in picked]
        summary[split] = {
            "path": str(path),
            "rows": len(events),
            "sha256": hashlib.sha256(data).hexdigest(),
            "mean_prompt_chars": round(statistics.fmean(
                len(TASKS[t].format(passage=p.text)) for t, p in zip(tasks, picked)), 1),
            "mean_passage_chars": round(statistics.fmean(len(p.text) for p in picked), 1),
            "source": SOURCES[split],
            "candidate_passages": len(candidates[split]),
            "sources_used": len({p.source for p in picked}),
            "documents_used": len({p.document for p in picked}),
            "top_sources": dict(Counter(p.source for p in picked).most_common(10)),
            "tasks": dict(sorted(Counter(tasks).items())),
        }
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=2400, help="training rows (default 2400)")
    p.add_argument("--eval", type=int, default=120, help="evaluation rows (default 120)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        summary = build(args.out_dir, args.train, args.eval, args.seed)
    except CorpusTooSmall as exc:
        sys.exit(f"error: {exc}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
