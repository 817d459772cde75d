"""Local training text: docstrings of a fixed list of standard-library modules (read with
``ast`` from the running Python's source files, nothing imported or downloaded) and
GLM-style chat samples built from them."""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

# Fixed order: the corpus (and so the model) depends only on this list and the stdlib text.
STDLIB_MODULES = (
    "argparse.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py",
    "functools.py", "collections/__init__.py", "pathlib.py", "string.py", "shutil.py",
    "subprocess.py", "logging/__init__.py", "datetime.py", "fractions.py", "statistics.py",
    "random.py", "heapq.py", "bisect.py", "csv.py", "difflib.py", "enum.py", "dataclasses.py",
    "contextlib.py", "tempfile.py", "threading.py", "queue.py", "inspect.py", "typing.py",
    "os.py", "glob.py", "fnmatch.py", "calendar.py", "pprint.py", "base64.py", "zipfile.py",
    "tarfile.py", "gzip.py", "socket.py", "ipaddress.py", "email/message.py", "http/client.py",
    "urllib/parse.py", "uuid.py", "decimal.py", "numbers.py", "abc.py", "copy.py", "weakref.py",
)
LICENSE_FILE = "LICENSE.txt"


def _docstrings(source: str, module: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) for the module, its classes and functions."""
    tree = ast.parse(source)
    out: list[tuple[str, str]] = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        out.append((module, doc))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > 40 and not node.name.startswith("_"):
                out.append((f"{module}.{node.name}", doc))
    return out


def stdlib_docs(stdlib: Path | None = None) -> list[tuple[str, str]]:
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, str]] = []
    for rel in STDLIB_MODULES:
        path = root / rel
        if path.is_file():
            module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            docs += _docstrings(path.read_text(encoding="utf-8", errors="replace"), module)
    if not docs:
        raise RuntimeError(f"no standard-library sources under {root}: cannot build the training text")
    lic = root / LICENSE_FILE
    if lic.is_file():
        docs.append(("LICENSE", lic.read_text(encoding="utf-8", errors="replace")[:20000]))
    return docs


def chat_sample(name: str, doc: str, rng: random.Random) -> str:
    """One conversation in the chat template's format, with a short thinking block."""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    question = rng.choice(["What does {} do?", "Explain {}.", "Tell me about {}.", "How do I use {}?"])
    think = f"<think>The user asks about {name}.</think>\n" if rng.random() < 0.5 else "<think></think>\n"
    return (f"[gMASK]<sop><|user|>\n{question.format(name)}<|assistant|>\n{think}{first}<|endoftext|>")


def build_corpus(seed: int, max_chars: int = 600_000) -> list[str]:
    """Documents (plain docstrings and chat samples), shuffled deterministically."""
    rng = random.Random(seed)
    docs = stdlib_docs()
    texts = [d for _, d in docs] + [chat_sample(n, d, rng) for n, d in docs if len(d) < 2000]
    rng.shuffle(texts)
    out, total = [], 0
    for t in texts:
        if total + len(t) > max_chars:
            break
        out.append(t)
        total += len(t)
    return out
