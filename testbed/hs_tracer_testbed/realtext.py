"""Real text for the real-model testbed, from what a fresh install already holds (no download).

Why: a real model's activations depend on real text, and the training text must come from
somewhere deterministic and reachable. Each domain is a list of documents in a fixed order:

* ``docs`` (the draft's training domain): the Python language reference's topics
  (``pydoc_data.topics``, part of the standard library), split into paragraph-packed chunks;
* ``code``: standard-library source files (a fixed list of pure-Python modules);
* ``prose``: the license texts shipped in the installed (pinned) packages' ``dist-info``;
* ``chat``: user questions in the target's chat template, ending at the assistant turn;
* ``instruct`` (the self-distilled draft's training prompts) and ``instruct_heldout``: chat-template
  questions about the language reference's topics and the standard library's modules (named by
  their docstrings' first sentences), several phrasings each;
* ``instruct_members`` (more training prompts, for variety): questions about the public functions
  and classes the training-side modules define, several phrasings each.

``docs`` and ``instruct`` are split by subject: every eighth topic (and module) is held out
(``docs_heldout``, ``instruct_heldout``), for prompts the draft never saw. The standard library's
texts change with the Python minor version, which is why the real-model recipe records it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
from pathlib import Path

DOMAINS = ("docs", "docs_heldout", "code", "prose", "chat", "instruct", "instruct_heldout",
           "instruct_members")
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


_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_prompt(question: str) -> str:
    """``question`` in SmolLM2's chat template (its default system prompt), ending where the
    assistant's answer starts."""
    return (f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def question_of(prompt: str) -> str:
    """The user's question in a :func:`chat_prompt` (other text as it is): what a person reads."""
    head = "<|im_start|>user\n"
    if head not in prompt:
        return prompt
    return prompt.split(head, 1)[1].split("<|im_end|>", 1)[0]


def _chat() -> list[str]:
    """User questions about the reference topics, one phrasing each."""
    from pydoc_data.topics import topics

    return [chat_prompt(_QUESTIONS[i % len(_QUESTIONS)].format(name.replace("-", " ")))
            for i, name in enumerate(sorted(topics))]


_MODULE_QUESTIONS = (
    "What is the Python module {name} for? Its documentation says: \"{summary}\"",
    "Show me how to use the {name} module in Python.",
    "Explain the {name} module of the Python standard library to a beginner.",
)


# Modules with side effects on import (a browser, a printed poem) or a GUI.
_SKIP_MODULES = ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle")


def _first_sentence(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring on one line, cut to 160 characters."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())[:160]


def _module_summaries() -> list[tuple[str, str]]:
    """(name, first docstring sentence) of the public standard-library modules that import cleanly
    and have a docstring, sorted by name."""
    import importlib
    import warnings

    out = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in _SKIP_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # platform-specific modules fail to import in many ways
            continue
        first = _first_sentence(module)
        if first:
            out.append((name, first))
    return out


def _instruct(heldout: bool) -> list[str]:
    """Instructions about reference topics (every phrasing) and standard-library modules, split by
    subject so held-out prompts ask about subjects the draft never saw."""
    from pydoc_data.topics import topics

    out = []
    for i, name in enumerate(sorted(topics)):
        if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout:
            out += [chat_prompt(q.format(name.replace("-", " "))) for q in _QUESTIONS]
    for i, (name, summary) in enumerate(_module_summaries()):
        if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout:
            out += [chat_prompt(q.format(name=name, summary=summary)) for q in _MODULE_QUESTIONS]
    return out


_MEMBER_QUESTIONS = (
    "What does {qual} do in Python? Its documentation says: \"{summary}\"",
    "Show me a short example that uses {qual} from the {module} module.",
    "When would I use {qual} in Python, and what should I watch out for?",
)


def _members() -> list[str]:
    """Questions about the public functions and classes each training-side module defines (members
    of held-out modules never appear), several phrasings each: thousands of subjects, so the draft
    learns the domain rather than a few hundred answers."""
    out = []
    for i, (module, _) in enumerate(_module_summaries()):
        if i % HELDOUT_EVERY == HELDOUT_EVERY - 1:
            continue
        for attr, obj in sorted(vars(sys.modules[module]).items()):
            kind_ok = inspect.isroutine(obj) or inspect.isclass(obj)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module or not kind_ok:
                continue
            summary = _first_sentence(obj)
            if summary:
                qual = f"{module}.{attr}"
                out += [chat_prompt(q.format(qual=qual, module=module, summary=summary))
                        for q in _MEMBER_QUESTIONS]
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
    if domain in ("instruct", "instruct_heldout"):
        return _instruct(domain == "instruct_heldout")
    if domain == "instruct_members":
        return _members()
    raise ValueError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)}")
