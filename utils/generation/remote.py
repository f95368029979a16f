"""The engine loop (utils/generation/loop.py) in a process of its own, as vLLM runs its engine:
the caller's threads (serve's HTTP event loop) and the engine's no longer share one
interpreter lock (library: nothing starts on import; the process runs from ``start()`` to
``stop()``).

    loop = RemoteLoop(log=say).start()          # python -P -m utils.generation.remote, a socket pair
    lane, info = loop.open(opener, *args)       # in the engine process: opener(worker, *args)
    seq = lane.submit(Sequence(ids, params, tok=tok, sink=fn))   # from any thread, as a Lane
    lane.cancel(seq)
    lane.call(fn, *args)                        # fn(engine, *args) on the engine thread, its result here
    loop.stop()                                 # running and waiting sequences are cancelled

``opener`` is a module-level function (sent by reference) run on the engine process's engine
thread as ``opener(worker, *args) -> (engine, tok, slots, capacity, info)``; ``worker.log`` is
the caller's ``log`` and ``worker.cache`` a dict that lives as long as the process (openers
share loaded tokenizers through it). ``info`` (with ``tok``) is sent back, pickled: it must
not hold the model. A :class:`RemoteLane` is used as a :class:`~utils.generation.loop.Lane`
is: ``submit``, ``cancel``, ``check``, ``active``, ``running``, ``slots``, ``capacity``,
``bytes_per_slot``, ``prefix_cache`` (its stats as of the engine's last pass). The caller's
:class:`~utils.generation.engine.Sequence` is a mirror: the engine process runs its own copy
(same prompt, parameters and text options) and sends each pass's events back in one message;
a receiving thread here appends the tokens, sets ``finish`` / ``error`` / ``prompt_logprobs``
and calls the sequence's sink with an :class:`~utils.generation.engine.Event` of the mirror,
as a Lane's thread would.

Why: with the engine on a thread of the HTTP process, each event-loop wake-up (parsing a
request, writing a chunk) held the interpreter lock the engine's next step waited for; in two
processes they run side by side, which raises the aggregate at many concurrent streams and
changes nothing measurable at one (docs/performance.md, Serving). The cost: a message's events
are pickled once and written to a socket, a request's submit is one message, and the process
starts once with its own imports (torch), beside the HTTP process's.

The engine process runs in a session of its own (a terminal's Ctrl-C reaches the caller
alone), ignores SIGINT and SIGTERM (its parent owns the shutdown: ``stop()``) and ends when its
socket closes, so it never outlives a parent that was killed. If it dies, every
sequence still under way finishes with ``finish == "error"`` and new submits raise
RuntimeError, as on a stopped loop.
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional

from utils.generation.engine import Event, Sequence
from utils.generation.loop import EngineLoop, check_sequence

ROOT = Path(__file__).resolve().parents[2]


class EngineGone(RuntimeError):
    """The engine process ended without being asked to (killed, out of memory, a crash)."""


def _ended(code: int) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"the engine process {how}"


def _send(conn: Connection, msg) -> None:
    """One message to the other process (pickled whole before the write: a part that will not
    pickle raises here, with nothing sent)."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _portable(e: BaseException) -> tuple:
    """An exception as (class, args, attributes): rebuilt without calling ``__init__``, so one
    whose constructor takes other arguments than its ``args`` (most of ours) crosses too."""
    return type(e), e.args, dict(getattr(e, "__dict__", {}))


def _rebuilt(cls, args, attrs) -> BaseException:
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(attrs)
    return e


class RemoteLane:
    """One model's lane in the engine process (see the module docstring)."""

    def __init__(self, loop: "RemoteLoop", index: int, vocab_size: int, capacity: int, slots: int,
                 bytes_per_slot: int, prefix_cache: Optional[dict] = None):
        self.loop, self.index = loop, index
        self.vocab_size, self.capacity, self.slots, self.bytes_per_slot = vocab_size, capacity, slots, bytes_per_slot
        self.active = 0                 # submitted and not finished (the finishing event leaves it first)
        self.running = 0                # in the batch, as of the engine's last pass
        self.prefix_cache = prefix_cache    # its stats (None: off), as of the engine's last pass

    def check(self, seq: Sequence) -> None:
        check_sequence(seq, self.vocab_size, self.capacity)

    def submit(self, seq: Sequence) -> Sequence:
        self.check(seq)
        return self.loop._submit(self, seq)

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self.loop._cancel(seq)

    def call(self, fn: Callable, *args):
        """``fn(engine, *args)`` on the engine process's engine thread, between two steps (a
        module-level function, sent by reference; its result and exception pickled back):
        serve loads and unloads LoRA adapters so."""
        return self.loop._call(("call", self.index, fn, args)).result()


class RemoteLoop:
    def __init__(self, log: Callable[[str], None] = lambda s: None, name: str = "engine",
                 flush_interval: float = 0.0, on_death: Optional[Callable[[str], None]] = None):
        self.log, self.name = log, name
        self.flush_interval = flush_interval    # see _Worker.flush
        self.on_death = on_death                # called (receiving thread) if the process ends unasked
        self.lanes: list[RemoteLane] = []
        self._lock = threading.Lock()   # the tables below and the socket's sending end
        self._seqs: dict[int, tuple[RemoteLane, Sequence]] = {}
        self._uid_of: dict[int, int] = {}               # id(mirror) -> uid
        self._uids = itertools.count()
        self._calls: dict[int, cf.Future] = {}
        self._stopping = False
        self._gone: Optional[str] = None                # why the engine process is no more
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._receiver = threading.Thread(target=self._receive, name=f"{name}-events", daemon=True)

    def start(self) -> "RemoteLoop":
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        theirs_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *theirs_path])   # no empty entry: -P holds
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "utils.generation.remote", str(theirs.fileno()),
                 repr(float(self.flush_interval))],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=2, env=env,
                start_new_session=True)         # a terminal's Ctrl-C goes to the server alone
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._receiver.start()
        return self

    def open(self, opener: Callable, *args):
        """``opener(worker, *args)`` in the engine process (see the module docstring): its lane
        here and its ``info``; the opener's exception is raised here."""
        index, vocab, capacity, slots, per_slot, info, cached = self._call(("open", opener, args)).result()
        lane = RemoteLane(self, index, vocab, capacity, slots, per_slot, cached)
        self.lanes.append(lane)
        return lane, info

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs or waits (its events still arrive), end the engine process, and wait
        up to ``timeout`` seconds for it (then it is killed)."""
        with self._lock:
            self._stopping = True
            opening = bool(self._calls)
            if self._gone is None and not opening:
                try:
                    self._send(("stop",))
                except OSError:           # it is already gone: the receiver says why
                    pass
        if self._proc is None:
            return
        if opening:                       # a model still loading (Ctrl-C at start-up): nothing to keep
            self._proc.kill()
        self._receiver.join(timeout)
        try:
            self._proc.wait(timeout if self._receiver.is_alive() else 1.0)
        except subprocess.TimeoutExpired:
            self.log(f"the engine process did not stop within {timeout:g} s: killed")
            self._proc.kill()
            self._proc.wait()
        self._receiver.join(timeout)

    # -- the caller's side
    def _call(self, msg: tuple) -> cf.Future:
        """Send ``(kind, call id, *rest)`` for ``msg`` = ``(kind, *rest)``: the future of its reply."""
        future: cf.Future = cf.Future()
        with self._lock:
            self._check_alive()
            call = next(self._uids)
            self._calls[call] = future
            try:
                self._send((msg[0], call, *msg[1:]))
            except BaseException:
                del self._calls[call]
                raise
        return future

    def _check_alive(self) -> None:
        if self._gone is not None and not self._stopping:
            raise EngineGone(self._gone)
        if self._stopping or self._gone is not None:
            raise RuntimeError("the engine is stopping")

    def _send(self, msg) -> None:
        _send(self._conn, msg)

    def _submit(self, lane: RemoteLane, seq: Sequence) -> Sequence:
        with self._lock:
            self._check_alive()
            uid = next(self._uids)
            self._seqs[uid] = (lane, seq)
            self._uid_of[id(seq)] = uid
            lane.active += 1
            try:
                self._send(("submit", lane.index, uid, seq.prompt, seq.params, seq.continues, seq.lead,
                            seq.text_by_caller))
            except OSError as e:                # it died a moment ago; the receiver is about to say so
                del self._seqs[uid], self._uid_of[id(seq)]
                lane.active -= 1
                raise EngineGone(f"the engine process is gone ({e.strerror or e})") from None
        return seq

    def _cancel(self, seq: Sequence) -> None:
        with self._lock:
            uid = self._uid_of.get(id(seq))
            if uid is not None and self._gone is None:
                try:
                    self._send(("cancel", uid))
                except OSError:                 # it died: the receiver ends the sequence with an error
                    pass

    def _receive(self) -> None:
        """The receiving thread: events to the mirrors' sinks, open replies to their futures,
        log lines to ``log``; at the end (the socket closed), every sequence still under way
        finishes with an error."""
        bug = None
        while True:
            try:
                raw = self._conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                self._handle(pickle.loads(raw))
            except Exception as e:                      # noqa: BLE001 (a bug here: stop, loudly)
                bug = f"a bug handling a message of the engine process ({type(e).__name__}: {e})"
                self.log(f"{bug}:\n{traceback.format_exc()}")
                self._proc.kill()
                break
        try:
            code = self._proc.wait(30)                  # it closed its socket: it is exiting
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        with self._lock:
            self._gone = bug or (_ended(code) if not self._stopping else "the engine is stopping")
            left, self._seqs, self._uid_of = list(self._seqs.values()), {}, {}
            calls, self._calls = list(self._calls.values()), {}
        if not self._stopping:
            self.log(f"{self._gone}: its {len(left)} running or waiting sequences end with an error")
        for lane, seq in left:
            seq.finish, seq.error = "error", self._gone
            self._finished(lane, seq, Event(seq, None, finish="error"))
        for future in calls:
            future.set_exception(EngineGone(self._gone))
        self._conn.close()
        if not self._stopping and self.on_death is not None:
            self.on_death(self._gone)

    def _handle(self, msg) -> None:
        if msg[0] == "events":
            self._events(msg[1], msg[2])
        elif msg[0] == "reply":
            _, call, ok, value = msg
            future = self._calls.pop(call)
            future.set_result(value) if ok else future.set_exception(_rebuilt(*value))
        elif msg[0] == "log":
            self.log(msg[1])

    def _events(self, events: list, running: list) -> None:
        for index, n, cached in running:
            if index < len(self.lanes):             # a lane whose open() has not returned yet
                self.lanes[index].running, self.lanes[index].prefix_cache = n, cached
        for uid, token, text, logprob, top, finish, error, scored in events:
            with self._lock:
                lane, seq = self._seqs[uid] if finish is None else self._seqs.pop(uid)
                if finish is not None:
                    self._uid_of.pop(id(seq), None)
            if scored is not None:
                seq.prompt_logprobs = scored
            if token is not None:
                seq.tokens.append(token)
            e = Event(seq, token, text, logprob, top, finish)
            if finish is None:
                if seq.sink is not None:
                    seq.sink(e)
            else:
                seq.finish, seq.error = finish, error
                self._finished(lane, seq, e)

    def _finished(self, lane: RemoteLane, seq: Sequence, e: Event) -> None:
        with self._lock:
            lane.active -= 1
        if seq.sink is not None:
            seq.sink(e)


# --------------------------------------------------------------------------- the engine process
class _Worker:
    """The engine process: an EngineLoop whose passes' events go back over ``conn``; this
    (main) thread reads the caller's messages."""

    def __init__(self, conn: Connection, interval: float):
        self.conn, self.interval = conn, interval
        self.last = float("-inf")
        self.started: set[int] = set()                  # uids whose first event was sent
        self.cache: dict = {}
        self.toks: list = []
        self.seqs: dict[int, tuple] = {}                # uid -> (lane, Sequence)
        self.outbox: list = []
        self.sent_scores: set[int] = set()
        self._lock = threading.Lock()                  # outbox and the sending end
        self.loop = EngineLoop(log=self.log, name="engine", after_pass=self.flush,
                               on_crash=lambda: os._exit(1)).start()   # the caller sees us end

    def send(self, msg) -> None:
        with self._lock:
            _send(self.conn, msg)

    def log(self, text: str) -> None:
        self.send(("log", text))

    def run(self) -> None:
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):                # the caller is gone: stop with it
                self.loop.stop()
                return
            kind = msg[0]
            if kind == "submit":
                self.submit(*msg[1:])
            elif kind == "cancel":
                if (held := self.seqs.get(msg[1])) is not None:
                    held[0].cancel(held[1])
            elif kind == "open":
                _, call, opener, args = msg
                self.loop.call_soon(opener, self, *args).add_done_callback(lambda f, c=call: self.opened(c, f))
            elif kind == "call":
                _, call, index, fn, args = msg
                engine = self.loop.lanes[index].engine
                self.loop.call_soon(fn, engine, *args).add_done_callback(lambda f, c=call: self.called(c, f))
            elif kind == "stop":
                self.loop.stop()
                self.flush()
                return

    def opened(self, call: int, future: cf.Future) -> None:
        try:
            engine, tok, slots, capacity, info = future.result()
            lane = self.loop.add(engine, slots, capacity)
            self.toks.append(tok)
            value, ok = (len(self.toks) - 1, engine.model.args.vocab_size, lane.capacity, lane.slots,
                         lane.bytes_per_slot, info, lane.prefix_cache), True
        except Exception as e:                          # noqa: BLE001 (raised in the caller's open())
            e.add_note(f"(in the engine process)\n{''.join(traceback.format_exception(e))}")
            value, ok = _portable(e), False
        try:
            self.send(("reply", call, ok, value))
        except (pickle.PicklingError, TypeError, AttributeError) as why:   # a part that will not pickle
            what = "the opened model's details" if ok else f"{value[0].__name__}: {value[1]}"
            self.send(("reply", call, False, _portable(RuntimeError(f"{what} cannot be sent back ({why})"))))

    def called(self, call: int, future: cf.Future) -> None:
        try:
            value, ok = future.result(), True
        except Exception as e:                          # noqa: BLE001 (raised in the caller's call())
            value, ok = _portable(e), False
        try:
            self.send(("reply", call, ok, value))
        except (pickle.PicklingError, TypeError, AttributeError) as why:
            self.send(("reply", call, False, _portable(RuntimeError(f"the result cannot be sent back ({why})"))))

    def submit(self, index: int, uid: int, prompt, params, continues, lead, by_caller) -> None:
        lane = self.loop.lanes[index]
        try:
            seq = Sequence(prompt, params, tok=self.toks[index], sink=lambda e, u=uid: self.sink(u, e),
                           continues=continues, lead=lead, text_by_caller=by_caller)
            self.seqs[uid] = (lane, seq)
            lane.submit(seq)
        except (ValueError, RuntimeError) as e:         # checked by the caller first; stopping
            self.seqs.pop(uid, None)
            with self._lock:
                self.outbox.append((uid, None, "", None, None, "error", str(e), None))
            self.flush()

    def sink(self, uid: int, e: Event) -> None:         # on the engine thread
        seq = e.seq
        scored = None
        if seq.prompt_logprobs is not None and uid not in self.sent_scores:
            scored = seq.prompt_logprobs
            self.sent_scores.add(uid)
        if e.finish is not None:
            self.seqs.pop(uid, None)
            self.sent_scores.discard(uid)
        with self._lock:
            self.outbox.append((uid, e.token, e.text, e.logprob, e.top, e.finish,
                                seq.error if e.finish is not None else None, scored))

    def flush(self) -> None:
        """Send the outbox (on the engine thread, after each pass): at once when it holds a
        sequence's first or last event, else once ``interval`` seconds passed since the last
        send (a stream's reader groups tokens that close anyway: utils/serve/job.py Job)."""
        with self._lock:
            if not self.outbox:
                return
            now = time.monotonic()
            if now - self.last < self.interval and not any(
                    e[5] is not None or e[0] not in self.started for e in self.outbox):
                return
            self.last = now
            events, self.outbox = self.outbox, []
            for e in events:
                if e[5] is None:
                    self.started.add(e[0])
                else:
                    self.started.discard(e[0])
            running = [(i, lane.running, lane.prefix_cache) for i, lane in enumerate(self.loop.lanes)]
            _send(self.conn, ("events", events, running))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the parent stops us (stop(), or our socket closing)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _Worker(Connection(int(argv[0])), float(argv[1])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
