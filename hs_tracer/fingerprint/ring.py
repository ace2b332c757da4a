"""The host side of the digest ring the fused kernel writes: which launch is which step, and which
rows have landed, without CUDA events.

Launch number ``seq`` (counted on the device, see ``kernel.RingTarget``) fills row ``seq % R`` and
stamps it with ``seq`` last. The producer (the scheduler thread) calls :meth:`DigestRing.note` just
before each launch, storing ``step_id``, ``tokens`` and then ``seq`` for that row in three int64
columns (memoryview stores: the step path allocates nothing). The consumer (any one thread at a
time) calls :meth:`drain_block`: a row is complete when its stamp equals the launch number
expected; it copies the rows and then checks that each row's bookkeeping still names that launch,
with a fixed number of array operations whatever the number of rows. Since the note for launch
``seq + R`` is stored before that launch is enqueued (its launch number cleared first, set last),
an unchanged note proves the copy was taken before anything could overwrite the row. Rows
overwritten before they were read (the consumer more than R launches behind) are counted in
:attr:`dropped`.

A launch recorded into someone else's CUDA graph (the target model's) runs before the producer can
note it: the note follows the launch. The device may then be up to ``lead`` launches past the last
note, so rows within ``lead`` of being reused count as lost, and :meth:`device_ahead` tells how far
past the notes the device's stamps have got (more than ``lead``: launches nobody noted).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hs_tracer.fingerprint.stats import DIGEST_WIDTH


class DigestRing:
    """``size`` rows of ``[K, 5]`` float32 digests plus int64 stamps, in pinned host memory when
    ``pinned`` (the GPU writes them over the bus), and the device-side launch counter."""

    def __init__(self, num_slots: int, size: int, device: torch.device, pinned: bool, lead: int = 0) -> None:
        if size < 1 or not 0 <= lead < size:
            raise ValueError(f"ring size must be positive and lead in [0, size), got {size}, {lead}")
        self.num_slots = num_slots
        self.size = size
        self.lead = lead
        width = num_slots * DIGEST_WIDTH
        # Rows padded to 16 bytes: every row has the alignment the kernel was compiled for.
        self.digests = torch.zeros((size, -(-width // 4) * 4), dtype=torch.float32, pin_memory=pinned)
        self.stamps = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        self._rows = self.digests.numpy()[:, :width].reshape(size, num_slots, DIGEST_WIDTH)
        self._stamps = self.stamps.numpy()
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
        (float32). Never waits. The stamps of all rows due are compared at once and the landed rows
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
            stamps = self._stamps[rows]
            early = np.flatnonzero(stamps < seqs)
            n = int(early[0]) if early.size else seqs.size  # landed in order up to the first that has not
            rows = rows[:n]
            raws = self._rows[rows].copy()  # copied before the notes are checked (see module doc)
            steps, tokens = self._note_step[rows], self._note_tokens[rows]
            # a row overwritten by launch seq + size before we read it fails one of the two checks
            ok = (self._note_seq[rows] == seqs[:n]) & (stamps[:n] == seqs[:n])
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
        """How many launches the device has stamped past the last note (the latest stamp minus the
        last launch number noted; negative while noted launches are still to run)."""
        return int(self._stamps.max()) - self.launched


_EMPTY_IDS = np.zeros(0, dtype=np.int64)
