"""The host side of the ring the fused kernel writes: which launch is which step, which rows have
landed, and the step digests from the programs' partial sums, without CUDA events.

Launch number ``L`` (1-based, counted on the device, see ``kernel.RingTarget``) fills row ``L % R``:
two header words (rows read, programs) and four words per program (sum, sum of squares, absmax,
non-finite count), every 8-byte word tagged with ``L``'s low 32 bits in its upper half. A row is
complete when every word it expects carries the tag of the launch the reader expects; a word with an
older tag is still to come, one with a newer tag means the row was reused. The host adds the
programs' partials up (float64) into the ``[K, 5]`` digest.

The producer (the scheduler thread) calls :meth:`DigestRing.note` just before each launch, storing
``step_id``, ``tokens`` and then ``L`` for that row in three int64 columns (memoryview stores: the
step path allocates nothing). The consumer (any one thread at a time) calls :meth:`drain_block`: it
copies the rows due, then checks their tags and that each row's bookkeeping still names that launch,
with a fixed number of array operations whatever the number of rows. Since the note for launch
``L + R`` is stored before that launch is enqueued (its launch number cleared first, set last), an
unchanged note proves the copy was taken before anything could overwrite the row. Rows overwritten
before they were read (the consumer more than R launches behind) are counted in :attr:`dropped`.

A launch recorded into someone else's CUDA graph (the target model's) runs before the producer can
note it: the note follows the launch. The device may then be up to ``lead`` launches past the last
note, so rows within ``lead`` of being reused count as lost, and :meth:`device_ahead` tells how far
past the notes the device's launches have got (more than ``lead``: launches nobody noted).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hs_tracer.fingerprint.stats import DIGEST_WIDTH

HEADER_WORDS = 2  # rows read, programs
PROGRAM_WORDS = 4  # sum, sum of squares, absmax, non-finite count
_TAG = 1 << 32


def row_words(programs: int) -> int:
    """Words of a ring row for launches of at most ``programs`` programs (an even count: rows stay
    16-byte aligned, as the kernel is compiled for)."""
    words = HEADER_WORDS + PROGRAM_WORDS * programs
    return words + words % 2


def _age(tags: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per row: 0 if every tag is the launch expected, 1 if any is newer, -1 if any is older
    (32-bit tags compared modulo 2**32)."""
    diff = (tags.astype(np.int64) - expected.astype(np.int64) + _TAG // 2) % _TAG - _TAG // 2
    return np.where((diff > 0).any(axis=1), 1, np.where((diff < 0).any(axis=1), -1, 0))


def reduce_rows(words: np.ndarray, launches: np.ndarray, num_slots: int,
                hidden: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``words [n, W]`` (int64, as the kernel wrote them) read for ``launches [n]``: their age
    (0: complete; < 0: some word still from an older launch; > 0: some word from a newer one), the
    rows each read, and the raw digests ``[n, K, 5]`` float32 (count, sum, sumsq, absmax,
    non-finite; valid where the age is 0). Partials are added in float64, in program order. The
    recorder calls this for every batch of steps: a few array operations per distinct program count
    (one while the batch size stays in one tier), whatever the number of rows."""
    n = words.shape[0]
    halves = words.view(np.uint32).reshape(n, -1, 2)  # little-endian: [..., 0] value, [..., 1] tag
    values, tags = halves[:, :, 0], halves[:, :, 1]
    expected = (launches % _TAG).astype(np.uint32)[:, None]
    rows = values[:, 0].view(np.int32).astype(np.int64)
    programs = np.where((tags[:, :HEADER_WORDS] == expected).all(axis=1), values[:, 1].view(np.int32), 0)
    age = np.zeros(n, dtype=np.int64)
    raw = np.zeros((n, num_slots, DIGEST_WIDTH), dtype=np.float32)
    for p in set(programs.tolist()) - {0}:
        sel = np.flatnonzero(programs == p)
        end = HEADER_WORDS + PROGRAM_WORDS * p
        done = (tags[sel, :end] == expected[sel]).all(axis=1)
        if not done.all():
            late = sel[~done]
            age[late] = _age(tags[late, :end], expected[late])
        parts = values[sel, HEADER_WORDS:end].view(np.float32).reshape(sel.size, num_slots, -1, PROGRAM_WORDS)
        bad = parts[..., 3].sum(axis=2, dtype=np.float64)
        raw[sel, :, 0] = rows[sel, None] * hidden - bad
        raw[sel, :, 1] = parts[..., 0].sum(axis=2, dtype=np.float64)
        raw[sel, :, 2] = parts[..., 1].sum(axis=2, dtype=np.float64)
        raw[sel, :, 3] = parts[..., 2].max(axis=2)
        raw[sel, :, 4] = bad
    head = np.flatnonzero(programs == 0)
    if head.size:
        age[head] = _age(tags[head, :HEADER_WORDS], expected[head])
    return age, rows, raw


class DigestRing:
    """``size`` rows of tagged partial sums (``row_words(programs)`` int64 each) of launches over
    ``[N, num_slots * hidden]``, in pinned host
    memory when ``pinned`` (the GPU writes them over the bus), and the device-side launch counter.
    ``size`` is a power of two, so row ``L % size`` stays the device's after its 32-bit launch tags
    wrap around."""

    def __init__(self, num_slots: int, hidden: int, size: int, device: torch.device, pinned: bool,
                 programs: int, lead: int = 0) -> None:
        if size < 1 or size & (size - 1) or not 0 <= lead < size:
            raise ValueError(f"ring size must be a power of two and lead in [0, size), got {size}, {lead}")
        self.num_slots = num_slots
        self.hidden = hidden
        self.size = size
        self.lead = lead
        self.records = torch.zeros((size, row_words(programs)), dtype=torch.int64, pin_memory=pinned)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        self._words = self.records.numpy()
        # the row's bookkeeping: launch number (0: none yet), step id, tokens
        self._note_seq = np.zeros(size, np.int64)
        self._note_step = np.zeros(size, np.int64)
        self._note_tokens = np.zeros(size, np.int64)
        self._w_seq, self._w_step = memoryview(self._note_seq), memoryview(self._note_step)
        self._w_tokens = memoryview(self._note_tokens)
        self.launched = 0  # launch number of the last noted launch (the device counter, once it ran)
        self._next = 1  # next launch number to read
        self._read_lock = threading.Lock()
        self.dropped = 0

    def note(self, step_id: int, tokens: int) -> None:
        """Producer: the next launch fingerprints ``step_id`` (``tokens`` rows). Call right before it."""
        seq = self.launched + 1
        row = seq % self.size
        self._w_seq[row] = 0  # a reader in the middle of this row's check sees it as overwritten
        self._w_step[row] = step_id
        self._w_tokens[row] = tokens
        self._w_seq[row] = seq
        self.launched = seq

    def unnote(self) -> None:
        """Producer: take back the last :meth:`note`; its launch did not happen."""
        self._w_seq[self.launched % self.size] = 0
        self.launched -= 1

    def skip_launched(self) -> None:
        """Forget every launch so far (e.g. a warm-up launch): drain starts after them."""
        with self._read_lock:
            self._next = self.launched + 1

    def drain(self) -> list[tuple[int, int, np.ndarray]]:
        """Consumer: ``(step_id, tokens, raw [K, 5])`` of the launches that landed since the last call,
        oldest first (:meth:`drain_block`, one tuple per launch)."""
        steps, tokens, raws = self.drain_block()
        return list(zip(steps.tolist(), tokens.tolist(), raws, strict=True))

    def drain_block(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Consumer: the launches that landed since the last call, oldest first, stopping at the first
        that has not, as arrays: step ids ``[n]``, tokens ``[n]`` (int64) and raw sums ``[n, K, 5]``
        (float32). Never waits. The tags of all rows due are compared at once and the landed rows
        copied in one go (a batch of steps costs about what one did)."""
        with self._read_lock:
            last, nxt, size = self.launched, self._next, self.size
            safe = size - self.lead  # rows not yet due for reuse by a launch the device may have run
            if last - nxt + 1 > safe:  # rows already reused by later launches (or about to be)
                self.dropped += last - safe + 1 - nxt
                nxt = last - safe + 1
            if nxt > last:
                return _EMPTY_IDS, _EMPTY_IDS, np.zeros((0, self.num_slots, DIGEST_WIDTH), dtype=np.float32)
            seqs = np.arange(nxt, last + 1, dtype=np.int64)
            rows = seqs % size
            words = self._words[rows]  # copied before the notes are checked (see module doc)
            age, _read, raws = reduce_rows(words, seqs, self.num_slots, self.hidden)
            early = np.flatnonzero(age < 0)
            n = int(early[0]) if early.size else seqs.size  # landed in order up to the first that has not
            rows, raws = rows[:n], raws[:n]
            steps, tokens = self._note_step[rows], self._note_tokens[rows]
            # a row overwritten by launch seq + size before we read it fails one of the two checks
            ok = (self._note_seq[rows] == seqs[:n]) & (age[:n] == 0)
            kept = int(np.count_nonzero(ok))
            self.dropped += n - kept
            self._next = nxt + n
        if kept == n:
            return steps, tokens, raws
        return steps[ok], tokens[ok], raws[ok]

    def pending(self) -> int:
        """Launches noted and not landed when the consumer last looked."""
        return self.launched - self._next + 1

    def device_ahead(self) -> int:
        """How many launches the device has written past the last note (the newest row's launch
        minus the last launch number noted; negative while noted launches are still to run)."""
        tags = (self._words[:, 0].view(np.uint64) >> np.uint64(32)).astype(np.int64)  # each row's first tag
        return int(((tags - self.launched + _TAG // 2) % _TAG - _TAG // 2).max())


_EMPTY_IDS = np.zeros(0, dtype=np.int64)
