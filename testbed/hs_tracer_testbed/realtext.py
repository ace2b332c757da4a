"""Real text for the real-model testbed, from what a fresh install already holds (no download).

Why: a real model's activations depend on real text, and the training text must come from
somewhere deterministic and reachable. Each domain is a list of documents in a fixed order:

* ``docs`` (the draft's training domain): the Python language reference's topics
  (``pydoc_data.topics``, part of the standard library), split into paragraph-packed chunks;
* ``code``: standard-library source files (a fixed list of pure-Python modules);
* ``prose``: the license texts shipped in the installed (pinned) packages' ``dist-info``;
* ``chat``: user questions in the target's chat template, ending at the assistant turn.

``docs`` is split by topic: every eighth topic is held out (``docs_heldout``), for prompts the draft
never saw. The standard library's texts change with the Python minor version, which is why the
real-model recipe records it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
from pathlib import Path

DOMAINS = ("docs", "docs_heldout", "code", "prose", "chat")
# Pure-Python standard-library modules whose source is the ``code`` domain.
CODE_MODULES = ("textwrap", "heapq", "bisect", "fractions", "string", "shlex", "fnmatch", "calendar",
                "json.decoder", "json.encoder", "dataclasses", "functools", "statistics", "pprint")
# Packages of the pinned install whose license texts are the ``prose`` domain.
PROSE_PACKAGES = ("torch", "numpy", "transformers", "safetensors", "tokenizers", "accelerate", "pydantic",
                  "aiohttp", "requests", "jinja2")
HELDOUT_EVERY = 8


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _chunks(text: str, chars: int) -> list[str]:
    """Paragraph-packed chunks of about ``chars`` characters (a paragraph is never split unless it
    alone is longer)."""
    out: list[str] = []
    cur = ""
    for para in (p.strip("\n") for p in text.split("\n\n")):
        if not para.strip():
            continue
        while len(para) > chars:
            if cur:
                out.append(cur)
                cur = ""
            out.append(para[:chars])
            para = para[chars:]
        if cur and len(cur) + 2 + len(para) > chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return out


def _docs(heldout: bool, chars: int) -> list[str]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    picked = [n for i, n in enumerate(names) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]
    return [c for n in picked for c in _chunks(topics[n], chars)]


def _code(chars: int) -> list[str]:
    import importlib

    return [c for m in CODE_MODULES for c in _chunks(inspect.getsource(importlib.import_module(m)), chars)]


def _license_text(package: str) -> str:
    dist = importlib.metadata.distribution(package)
    names = sorted(str(f) for f in dist.files or ())
    files = [f for f in names if "licen" in f.lower() or "copying" in f.lower()]
    texts = []
    for f in files:
        path = Path(str(dist.locate_file(f)))
        if path.is_file() and path.stat().st_size < 200_000:
            texts.append(path.read_text(errors="replace"))
    return "\n\n".join(texts)


def _prose(chars: int) -> list[str]:
    out: list[str] = []
    for pkg in PROSE_PACKAGES:
        try:
            out.extend(_chunks(_license_text(pkg), chars))
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


_QUESTIONS = (
    "What does the {} part of Python do? Explain briefly.",
    "Can you give me an example of {} in Python?",
    "I am confused about {}. How does it work?",
    "Write a short note about {} for a beginner.",
)


def _chat() -> list[str]:
    """User questions about the reference topics in SmolLM2's chat template (its default system
    prompt), ending where the assistant's answer starts."""
    from pydoc_data.topics import topics

    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    out = []
    for i, name in enumerate(sorted(topics)):
        q = _QUESTIONS[i % len(_QUESTIONS)].format(name.replace("-", " "))
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                   "<|im_start|>assistant\n")
    return out


def documents(domain: str, chars: int = 1200) -> list[str]:
    """Every document of ``domain`` (one of :data:`DOMAINS`), in a fixed order."""
    if domain == "docs":
        return _docs(False, chars)
    if domain == "docs_heldout":
        return _docs(True, chars)
    if domain == "code":
        return _code(chars)
    if domain == "prose":
        return _prose(chars)
    if domain == "chat":
        return _chat()
    raise ValueError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)}")
