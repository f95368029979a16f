"""One model's continuous-batching engine on a background thread (library: nothing starts on
import; the thread runs from ``start()`` to ``stop()``).

    loop = EngineLoop(engine, slots=8)          # engine: utils.generation.engine.Engine
    loop.start()
    seq = loop.submit(Sequence(ids, params, tok=tok, sink=fn))   # from any thread
    loop.cancel(seq)                            # from any thread: it leaves at the next step
    loop.stop()                                 # running and waiting sequences are cancelled

The thread steps the :class:`~utils.generation.engine.Batcher` while any sequence waits or
runs and sleeps on a condition otherwise (no polling). Each sequence's ``sink`` is called on
the loop thread with every :class:`~utils.generation.engine.Event`: a sink must be quick and
must not block (``serve`` hands events to its asyncio loop with ``call_soon_threadsafe``).
A step that raises (out of memory, a bug) finishes every sequence in the batch with
``finish == "error"`` and the message in ``error``; the loop goes on with new requests.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from utils.generation.engine import Engine, Event, Sequence


class EngineLoop:
    def __init__(self, engine: Engine, slots: int, capacity: Optional[int] = None,
                 log: Callable[[str], None] = lambda s: None, name: str = "engine"):
        self.engine = engine
        self.batcher = engine.batcher(slots, capacity)
        self.log = log
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.active = 0                 # sequences submitted and not finished (read for limits)

    @property
    def capacity(self) -> int:
        return self.batcher.capacity

    def start(self) -> "EngineLoop":
        self.engine.model.eval()
        self._thread.start()
        return self

    def check(self, seq: Sequence) -> None:
        """ValueError if the batcher would refuse ``seq`` (thread-safe: reads no batch state)."""
        V = self.engine.model.args.vocab_size
        bad = seq.params.problems()
        if not seq.prompt:
            bad.append("the prompt is empty")
        elif min(seq.prompt) < 0 or max(seq.prompt) >= V:
            bad.append(f"the prompt holds a token id outside the vocabulary (0..{V - 1})")
        elif len(seq.prompt) >= self.capacity:
            bad.append(f"the prompt has {len(seq.prompt)} tokens; the context holds {self.capacity}")
        if bad:
            raise ValueError("; ".join(bad))

    def submit(self, seq: Sequence) -> Sequence:
        self.check(seq)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is stopping")
            self.active += 1
            self._inbox.append(seq)
            self._cond.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        with self._cond:
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread
    def _run(self) -> None:
        b = self.batcher
        while True:
            with self._cond:
                while not self._inbox and not b.has_work() and not self._stopping:
                    self._cond.wait()
                new, self._inbox = self._inbox, []
                stopping = self._stopping
            for seq in new:
                b.add(seq)
            if stopping:
                for seq in list(b.waiting) + list(b.running):
                    seq.cancelled = True
            try:
                with torch.no_grad():
                    events = b.step()
            except Exception as e:          # noqa: BLE001 (reported to every request in the batch)
                events = self._fail_all(f"{type(e).__name__}: {e}")
            self._count(events)
            if stopping and not b.has_work():
                return

    def _count(self, events: list[Event]) -> None:
        done = sum(1 for e in events if e.finish is not None)
        if done:
            with self._cond:
                self.active -= done

    def _fail_all(self, message: str) -> list[Event]:
        self.log(f"engine step failed, its {len(self.batcher.running) + len(self.batcher.waiting)} "
                 f"sequences end with an error: {message}")
        b = self.batcher
        events = []
        for seq in list(b.running) + list(b.waiting):
            seq.finish, seq.error = "error", message
            e = Event(seq, None, finish="error")
            events.append(e)
            if seq.sink is not None:
                seq.sink(e)
        b.running.clear()
        b.waiting.clear()
        return events
