"""Synthetic low-entropy corpus for the testbed models.

Why synthetic: the testbed target must be tiny (trained on 2 CPU cores in about a minute) yet its
greedy continuations must be predictable, so an EAGLE-3 draft can reach an accept length well above
1 and a miswired draft visibly cannot. Every document is a few templated segments whose
continuation is (almost) fully determined by a short prefix: counting, cyclic sequences, fixed
facts, and a copy task (``repeat``) that needs attention over the context, so the draft has to use
the target's hidden states and cannot get by on the current token alone.

Two distributions:
* domain ``train`` (documents for the target, the draft data, and held-out prompts drawn with
  another seed), and
* domain ``other`` (count-downs, backward cycles, colour cycles): a different prompt distribution
  for drift tests. The target sees a little of it; the draft data never does.

All text is space-separated words; the tokenizer (:mod:`hs_tracer_testbed.tokenizer`) is
word-level, so one word is one token.
"""

from __future__ import annotations

import random
from collections.abc import Callable

NUMBERS = [str(i) for i in range(200)]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = [
    "january", "february", "march", "april", "may", "june",
    "july", "august", "september", "october", "november", "december",
]  # fmt: skip
COLORS = ["red", "orange", "yellow", "green", "blue", "indigo", "violet"]
# animal -> (food, home, sound): fixed facts the target memorises.
ANIMALS = {
    "cow": ("grass", "barn", "moo"),
    "dog": ("meat", "kennel", "woof"),
    "cat": ("fish", "house", "meow"),
    "horse": ("hay", "stable", "neigh"),
    "bird": ("seeds", "nest", "tweet"),
    "pig": ("corn", "sty", "oink"),
    "sheep": ("clover", "field", "baa"),
    "duck": ("bread", "pond", "quack"),
}
REPEAT_WORDS = ["apple", "stone", "river", "cloud", "tree", "moon", "sun", "star", "lamp", "door",
                "book", "cup", "ship", "road", "hill", "rain"]  # fmt: skip
FUNCTION_WORDS = ["count", "from", "evens", "days", "after", "before", "months", "letters", "repeat",
                  "the", "eats", "lives", "in", "a", "says", "countdown", "colors", "back", "and",
                  "then", ":", ".", ";", ","]  # fmt: skip


def all_words() -> list[str]:
    """Every word any generator can emit, in a fixed order (the tokenizer's vocabulary)."""
    words: list[str] = []
    for group in (FUNCTION_WORDS, NUMBERS, LETTERS, DAYS, MONTHS, COLORS, list(ANIMALS), REPEAT_WORDS):
        words.extend(group)
    for facts in ANIMALS.values():
        words.extend(facts)
    seen: set[str] = set()
    return [w for w in words if not (w in seen or seen.add(w))]


def _cycle(items: list[str], start: int, n: int, step: int = 1) -> list[str]:
    return [items[(start + step * i) % len(items)] for i in range(n)]


def _count(rng: random.Random) -> str:
    a = rng.randrange(0, 150)
    n = rng.randrange(10, 24)
    return " ".join(["count", "from", str(a), ":", *NUMBERS[a : a + n]])


def _evens(rng: random.Random) -> str:
    a = 2 * rng.randrange(0, 60)
    n = rng.randrange(8, 18)
    return " ".join(["evens", "from", str(a), ":", *[str(a + 2 * (i + 1)) for i in range(n)]])


def _days(rng: random.Random) -> str:
    s = rng.randrange(7)
    return " ".join(["days", "after", DAYS[s], ":", *_cycle(DAYS, s + 1, rng.randrange(6, 16))])


def _months(rng: random.Random) -> str:
    s = rng.randrange(12)
    return " ".join(["months", "after", MONTHS[s], ":", *_cycle(MONTHS, s + 1, rng.randrange(6, 16))])


def _letters(rng: random.Random) -> str:
    s = rng.randrange(20)
    n = rng.randrange(6, 26 - s + 1) if 26 - s > 6 else 26 - s
    return " ".join(["letters", "from", LETTERS[s], ":", *LETTERS[s : s + n]])


def _facts(rng: random.Random) -> str:
    animal = rng.choice(list(ANIMALS))
    food, home, sound = ANIMALS[animal]
    return (
        f"the {animal} eats {food} . the {animal} lives in a {home} . the {animal} says {sound} "
        f"{sound} {sound} ."
    )


def _repeat(rng: random.Random) -> str:
    unit = rng.sample(REPEAT_WORDS, rng.randrange(2, 5))
    reps = rng.randrange(4, 7)
    return " ".join(["repeat", ":", *([*unit, ";"] * reps)])


def _countdown(rng: random.Random) -> str:
    a = rng.randrange(20, 200)
    n = rng.randrange(10, 20)
    return " ".join(["countdown", "from", str(a), ":", *[str(a - i - 1) for i in range(min(n, a))]])


def _days_back(rng: random.Random) -> str:
    s = rng.randrange(7)
    return " ".join(["days", "before", DAYS[s], ":", *_cycle(DAYS, s - 1, rng.randrange(6, 14), step=-1)])


def _letters_back(rng: random.Random) -> str:
    s = rng.randrange(8, 26)
    n = rng.randrange(6, s + 1)
    return " ".join(["letters", "back", "from", LETTERS[s], ":", *LETTERS[s - 1 :: -1][:n]])


def _colors(rng: random.Random) -> str:
    s = rng.randrange(7)
    return " ".join(["colors", ":", *_cycle(COLORS, s, rng.randrange(8, 18))])


Generator = Callable[[random.Random], str]
TRAIN_GENERATORS: tuple[Generator, ...] = (_count, _evens, _days, _months, _letters, _facts, _repeat)
OTHER_GENERATORS: tuple[Generator, ...] = (_countdown, _days_back, _letters_back, _colors)


def _document(rng: random.Random, generators: tuple[Generator, ...]) -> str:
    segments = [rng.choice(generators)(rng) for _ in range(rng.randrange(2, 4))]
    return " . ".join(segments)


def documents(seed: int, n: int, domain: str = "train") -> list[str]:
    """``n`` documents of ``domain`` (``train`` or ``other``), fully determined by ``seed``."""
    gens = {"train": TRAIN_GENERATORS, "other": OTHER_GENERATORS}.get(domain)
    if gens is None:
        raise ValueError(f"unknown corpus domain {domain!r}; use 'train' or 'other'")
    rng = random.Random(f"hs_tracer-corpus-{domain}-{seed}")
    return [_document(rng, gens) for _ in range(n)]


def prompts(seed: int, n: int, domain: str = "train", min_words: int = 6) -> list[str]:
    """Prompts: a prefix of each document (about a third of it, at least ``min_words`` words).

    Use a seed different from the training seed for held-out prompts of the same domain.
    """
    rng = random.Random(f"hs_tracer-prompts-{domain}-{seed}")
    out = []
    for doc in documents(seed, n, domain):
        words = doc.split(" ")
        cut = max(min_words, int(len(words) * rng.uniform(0.2, 0.45)))
        out.append(" ".join(words[:cut]))
    return out
