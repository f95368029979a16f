"""The served models' continuous-batching engines on one background thread (library: nothing
starts on import; the thread runs from ``start()`` to ``stop()``).

    loop = EngineLoop().start()
    model = loop.call(load_model, path)         # torch work on the loop's thread, result returned
    lane = loop.add(Engine(model), slots=8)     # one model's queue and batcher
    seq = lane.submit(Sequence(ids, params, tok=tok, sink=fn))   # from any thread
    lane.cancel(seq)                            # from any thread: it leaves at the next step
    loop.stop()                                 # running and waiting sequences are cancelled

One thread does all of the models' tensor work, opening them included (``call``): an OpenMP
thread team belongs to the thread that starts it, and a second thread running parallel
regions next to the one that loaded the weights makes more OpenMP threads than cores, at
which libgomp stops spin-waiting between regions, and each region then waits for its threads
to wake (SmolLM2-135M in int8 decoded at about half speed so; docs/performance.md, Serving).
The thread steps each model's :class:`~utils.generation.engine.Batcher` in turn while any
sequence waits or runs, and sleeps on a condition otherwise (no polling).
Each sequence's ``sink`` is called on the loop thread with every
:class:`~utils.generation.engine.Event`: a sink must be quick and must not block (``serve``'s
engine process, utils/generation/remote.py, collects them; ``after_pass``, called after each
pass, sends them). A step that raises (out of memory, a bug) finishes every
sequence of that model's batch with ``finish == "error"`` and the message in ``error``; the
loop goes on with new requests.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import traceback
from typing import Callable, Optional

import torch

from utils.generation.engine import Engine, Event, Sequence


def check_sequence(seq: Sequence, vocab_size: int, capacity: int) -> None:
    """ValueError naming what a batcher of ``capacity`` positions would refuse in ``seq``."""
    bad = seq.params.problems()
    if not seq.prompt:
        bad.append("the prompt is empty")
    elif min(seq.prompt) < 0 or max(seq.prompt) >= vocab_size:
        bad.append(f"the prompt holds a token id outside the vocabulary (0..{vocab_size - 1})")
    elif len(seq.prompt) >= capacity:
        bad.append(f"the prompt has {len(seq.prompt)} tokens; the context holds {capacity}")
    if bad:
        raise ValueError("; ".join(bad))


class Lane:
    """One model's queue and batcher in an :class:`EngineLoop`."""

    def __init__(self, loop: "EngineLoop", engine: Engine, slots: int, capacity: Optional[int]):
        self.loop, self.engine = loop, engine
        self.batcher = engine.batcher(slots, capacity)
        self.inbox: list[Sequence] = []
        self.active = 0                 # sequences submitted and not finished (read for limits)

    @property
    def capacity(self) -> int:
        return self.batcher.capacity

    @property
    def slots(self) -> int:
        return self.batcher.slots

    @property
    def running(self) -> int:
        """Sequences in the batch now (read from any thread: a count, not a guarantee)."""
        return len(self.batcher.running)

    @property
    def bytes_per_slot(self) -> int:
        return self.batcher.bytes_per_slot

    @property
    def prefix_cache(self) -> Optional[dict]:
        """The engine's prefix-cache stats (utils/generation/prefix_cache.py), None when off."""
        store = self.engine.prefix_cache
        return None if store is None else store.stats()

    def check(self, seq: Sequence) -> None:
        """ValueError if the batcher would refuse ``seq`` (thread-safe: reads no batch state),
        an adapter it names that is not loaded included."""
        check_sequence(seq, self.engine.model.args.vocab_size, self.capacity)
        if seq.params.adapter is not None:
            self.engine.adapters.get(seq.params.adapter)

    def submit(self, seq: Sequence) -> Sequence:
        """Queue ``seq`` from any thread. It counts in ``active`` until its finishing event,
        which leaves the count before the sequence's own sink sees it: a client that sends its
        next request as soon as an answer ends never finds its own finished one still counted
        (a spurious 429 at serve.max_queue, a busy /health)."""
        self.check(seq)
        if seq.params.adapter is not None:      # bound now: an unload meanwhile lets it finish with it
            seq.lora = self.engine.adapters.get(seq.params.adapter)
        own = seq.sink

        def sink(e: Event) -> None:
            if e.finish is not None:
                with self.loop._cond:
                    self.active -= 1
            if own is not None:
                own(e)
        seq.sink = sink
        with self.loop._cond:
            if self.loop._stopping:
                raise RuntimeError("the engine is stopping")
            self.active += 1
            self.inbox.append(seq)
            self.loop._cond.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        with self.loop._cond:
            self.loop._cond.notify()

    def has_work(self) -> bool:
        return bool(self.inbox) or self.batcher.has_work()


class EngineLoop:
    def __init__(self, log: Callable[[str], None] = lambda s: None, name: str = "engine",
                 after_pass: Optional[Callable[[], None]] = None,
                 on_crash: Optional[Callable[[], None]] = None):
        self.log = log
        self.after_pass = after_pass    # called on the loop's thread after each pass (its sinks' events)
        self.on_crash = on_crash        # called after the loop's own failure is logged (else it is raised)
        self.lanes: list[Lane] = []
        self._cond = threading.Condition()
        self._calls: list[tuple[Callable, cf.Future]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def call(self, fn: Callable, *args, **kw):
        """Run ``fn(*args, **kw)`` on the loop's thread and return its result (or raise its
        exception) here: model loading and quantizing go through it (see the module docstring)."""
        return self.call_soon(fn, *args, **kw).result()

    def call_soon(self, fn: Callable, *args, **kw) -> cf.Future:
        """``call`` without waiting: the future of ``fn(*args, **kw)`` run on the loop's thread."""
        future: cf.Future = cf.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("the engine loop is not running")
            self._calls.append((lambda: fn(*args, **kw), future))
            self._cond.notify()
        return future

    def add(self, engine: Engine, slots: int, capacity: Optional[int] = None) -> Lane:
        """A lane for ``engine``'s model (its model is put in eval mode)."""
        engine.model.eval()
        lane = Lane(self, engine, slots, capacity)
        with self._cond:
            self.lanes.append(lane)
        return lane

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread
    def _idle(self) -> bool:
        return not self._calls and not self._stopping and not any(lane.has_work() for lane in self.lanes)

    def _guarded(self) -> None:
        """The thread: a failure of the loop itself (not of a step: see ``_step``) would leave
        every sequence waiting forever; it is logged with its traceback, then ``on_crash``."""
        try:
            self._run()
        except BaseException:
            if self.on_crash is None:
                raise
            self.log(f"the engine loop failed:\n{traceback.format_exc()}")
            self.on_crash()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._idle():
                    self._cond.wait()
                calls, self._calls = self._calls, []
                stopping = self._stopping
                arrived = []
                for lane in self.lanes:
                    arrived.append(lane.inbox)
                    lane.inbox = []
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:        # noqa: BLE001 (handed to the caller of call())
                        future.set_exception(e)
            for lane, new in zip(self.lanes, arrived):
                for seq in new:
                    lane.batcher.add(seq)
                if stopping:
                    for seq in list(lane.batcher.waiting) + list(lane.batcher.running):
                        seq.cancelled = True
                if lane.batcher.has_work():
                    self._step(lane)
            if self.after_pass is not None:
                self.after_pass()
            if stopping and not any(lane.has_work() for lane in self.lanes):
                for fn, future in self._calls:
                    future.cancel()
                return

    def _step(self, lane: Lane) -> None:
        try:
            with torch.no_grad():
                events = lane.batcher.step()
        except Exception as e:          # noqa: BLE001 (reported to every request in the batch)
            self._fail_all(lane, f"{type(e).__name__}: {e}")

    def _fail_all(self, lane: Lane, message: str) -> list[Event]:
        b = lane.batcher
        self.log(f"engine step failed, its {len(b.running) + len(b.waiting)} sequences end with an error: "
                 f"{message}")
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
