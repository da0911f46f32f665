"""Engine processes for the workers of `ftengine serve --workers N --engine-processes K`
(`--shared-engine` is K = 1).

Without them each worker process holds its own engine: its tokenizer and batching threads take
the worker's one GIL in turns with the event loop that parses HTTP. With them, K processes
(started by the service's supervisor before the workers) each load the models and run their
engines, and each worker uses one of them (its slot, claim_slot, modulo K). A worker keeps its
own copy of the models' host side (tokenizer, config, labels: what /tokenize, /info and the
replies read) and sends its requests' inputs, joined per event-loop turn as before
(serve_join.py), to its engine process over a local socket (multiprocessing.connection, with a
random key from a private file). A worker's submission is one message; its answer (rows, tokens)
or error (TooLongError with its index, InputError, DeviceError) comes back as another, and a
cancelled submission is dropped there too. A token classifier (/ner) runs its own batches and
stays in each worker. K = N (an engine process beside each worker) serves the most requests/s;
K = 1 holds the models once on the device, at about half the requests/s of an engine per worker,
that process's one GIL being the limit (docs/service.md).

An engine process ignores SIGINT and SIGTERM: the supervisor stops it once every worker has
drained (and it ends when the supervisor goes). If it dies, every waiting and later request of
its workers' models fails with a DeviceError (503) naming it."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import signal
import threading
import time
from concurrent.futures import Future
from functools import partial

from .errors import DeviceError, FtengineError, InputError, TooLongError

log = logging.getLogger("ftengine.serve")
START_SECONDS = 600  # loading and warming the models: NVRTC on a cold cache takes a while
STOP_SECONDS = 60    # finishing the work queued when the workers have drained (there is none, normally)


def hosted(specs: list) -> list:
    """The [name, path, task] specs whose models the engine process runs (all but /ner's)."""
    return [s for s in specs if s[2] != "ner"]


def engine_of(model):
    """The Encoder whose engine runs a served model's batches."""
    return getattr(model, "_encoder", model)


# ------------------------------------------------------------ errors across the socket

def _error_message(error: BaseException) -> tuple:
    if isinstance(error, TooLongError):
        return "TooLongError", str(error), {"index": error.index, "max_length": error.max_length,
                                            "length": error.length}
    if isinstance(error, InputError):
        return "InputError", str(error), {}
    if isinstance(error, FtengineError):
        return "DeviceError", str(error), {}
    return "DeviceError", f"the engine process failed: {type(error).__name__}: {error}", {}


def _error_from(kind: str, message: str, attrs: dict) -> FtengineError:
    if kind == "TooLongError":
        return TooLongError(message, **attrs)
    return InputError(message) if kind == "InputError" else DeviceError(message)


# ------------------------------------------------------------ the engine process

class EngineHost:
    """The supervisor's handle on one engine process: launch() then wait_ready() load and warm
    the models there (raising their FtengineError if one fails), stop() finishes the work queued
    and ends it."""

    def __init__(self, specs: list, options: dict, folder: str, index: int = 0):
        import multiprocessing
        self.address = os.path.join(folder, f"engine-{index}.sock")
        self.authkey = secrets.token_bytes(32)
        # to the workers through a private file, not their environment (as the API key goes)
        self.key_file = os.path.join(folder, f"engine-{index}-key")
        with open(os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(self.authkey)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        # the batch metrics labelled by model as the workers label theirs: where the service has several
        self._process = context.Process(target=_host_main, args=(hosted(specs), len(specs) > 1, options,
                                                                 self.address, self.authkey, child),
                                        name=f"ftengine-engine-{index}")
        self._child = child

    def launch(self):
        """Start the process; wait_ready() waits for its models."""
        self._process.start()
        self._child.close()

    def wait_ready(self):
        if not self._conn.poll(START_SECONDS):
            self._process.kill()
            raise DeviceError(f"the engine process did not start within {START_SECONDS} s")
        try:
            status, message = self._conn.recv()
        except EOFError:
            raise DeviceError(f"the engine process ended while loading (exit code {self._process.exitcode})") \
                from None
        if status != "ready":
            self._process.join()
            raise FtengineError(message)
        log.info("engine process %d ready: %s", self._process.pid, self.address)

    def stop(self):
        """Finish the work queued (for up to STOP_SECONDS), then end the process."""
        if self._process.pid is None:  # never launched
            return
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self._process.join(STOP_SECONDS)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %d s: killed", STOP_SECONDS)
            self._process.kill()
            self._process.join()

    def link_settings(self) -> dict:
        """What each worker needs to reach the engine process (JSON)."""
        return {"address": self.address, "key_file": self.key_file, "pid": self._process.pid}


def start_hosts(specs: list, options: dict, folder: str, count: int) -> list:
    """`count` engine processes, loading their models side by side; if one cannot start, the
    others are stopped and its error raised."""
    hosts = [EngineHost(specs, options, folder, i) for i in range(count)]
    try:
        for host in hosts:
            host.launch()
        for host in hosts:
            host.wait_ready()
    except BaseException:
        for host in hosts:
            host.stop()
        raise
    return hosts


_slot_locks = []  # the lock files of this process's slot, open for its life


def claim_slot(folder: str, workers: int) -> int:
    """This worker's slot among `workers` (which engine process it uses: slot mod their count): the
    first whose lock file no live worker holds. The lock goes with the process, so a worker that
    uvicorn restarts in place of a dead one takes the dead one's slot."""
    import fcntl
    for slot in range(workers):
        fd = os.open(os.path.join(folder, f"worker-slot-{slot}"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _slot_locks.append(fd)
        return slot
    return os.getpid() % workers


def _host_main(specs: list, per_model: bool, options: dict, address: str, authkey: bytes, parent):
    from multiprocessing.connection import Listener
    from .serve import LOG_FORMAT, warm_up_model
    from .serve_metrics import Metrics
    from .serve_process import load_models
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor ends this process once the workers have drained
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        loaded = load_models(specs, **options)
        for _, model in loaded:
            warm_up_model(model, options["batch_tokens"])
    except FtengineError as e:
        parent.send(("failed", str(e)))
        return
    metrics = Metrics(per_model=per_model) if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
    engines = []
    for name, model in loaded:
        engine = engine_of(model)._engine
        if metrics is not None:
            engine.on_batch = partial(metrics.observe_batch, name)
        engines.append(engine)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    threading.Thread(target=_accept, args=(listener, engines), name="ftengine-engine-accept", daemon=True).start()
    parent.send(("ready", None))
    try:
        parent.recv()  # "stop", or EOF when the supervisor has gone
    except EOFError:
        pass
    for _, model in loaded:
        model.close()  # the work already queued is finished first


def _accept(listener, engines: list):
    while True:
        try:
            conn = listener.accept()
        except Exception:  # noqa: BLE001 - a client without the key, or gone during the exchange: not a worker
            time.sleep(0.01)
            continue
        threading.Thread(target=_serve_worker, args=(conn, engines), name="ftengine-engine-link",
                         daemon=True).start()


def _serve_worker(conn, engines: list):
    """One worker's submissions: each to its model's engine, each answer back when it is done (by
    a sender thread: the engine's threads never wait on a worker's socket)."""
    outbox = queue.SimpleQueue()
    futures = {}

    def sender():
        while (message := outbox.get()) is not None:
            try:
                conn.send(message)
            except OSError:
                pass  # the worker has gone; its reader fails what it waited for

    def answer(ident, future):
        futures.pop(ident, None)
        if future.cancelled():
            return
        error = future.exception()
        outbox.put(("done", ident, future.result()) if error is None else ("error", ident, *_error_message(error)))

    threading.Thread(target=sender, name="ftengine-engine-sender", daemon=True).start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            for future in list(futures.values()):
                future.cancel()
            outbox.put(None)
            return
        if message[0] == "cancel":
            future = futures.get(message[1])
            if future is not None:
                future.cancel()
            continue
        _, ident, index, texts, options, keywords = message
        try:
            future = engines[index].submit(texts, options, **keywords)
        except Exception as e:  # noqa: BLE001 - the submission's answer
            outbox.put(("error", ident, *_error_message(e)))
            continue
        futures[ident] = future
        future.add_done_callback(partial(answer, ident))


# ------------------------------------------------------------ a worker's side

class _Link:
    """A worker's connection to the engine process, shared by its models: submissions out, their
    answers back on a reader thread."""

    def __init__(self, address: str, authkey: bytes):
        from multiprocessing.connection import Client
        self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        self._lock = threading.Lock()
        self._pending = {}
        self._ids = itertools.count()
        self._broken = None
        threading.Thread(target=self._read, name="ftengine-engine-reader", daemon=True).start()

    def submit(self, index: int, texts: list, options, keywords: dict) -> Future:
        future = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            ident = next(self._ids)
            self._pending[ident] = future
            self._conn.send(("submit", ident, index, texts, options, keywords))
        future.add_done_callback(partial(self._cancelled, ident))
        return future

    def _cancelled(self, ident: int, future: Future):
        if future.cancelled() and self._pending.pop(ident, None) is not None:
            with self._lock:
                if self._broken is None:
                    self._conn.send(("cancel", ident))

    def _read(self):
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._fail(DeviceError("the engine process has ended: this service cannot answer any more "
                                       "(restart it)"))
                return
            future = self._pending.pop(message[1], None)
            if future is None or not future.set_running_or_notify_cancel():
                continue
            if message[0] == "done":
                future.set_result(message[2])
            else:
                future.set_exception(_error_from(*message[2:]))

    @property
    def failed(self) -> DeviceError | None:
        return self._broken

    def _fail(self, error: DeviceError):
        with self._lock:
            self._broken = error
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def close(self):
        with self._lock:
            if self._broken is None:
                self._broken = DeviceError("this service's link to the engine process is closed")
            self._conn.close()


class RemoteEngine:
    """Stands in for a worker's EncodeEngine: submissions go to the engine process (the same
    future: an EncodeResult, or the engine's error). progress is called once, with every row,
    when the answer has come."""

    def __init__(self, link: _Link, index: int):
        self._link, self._index = link, index
        self.on_batch = None  # batches are observed in the engine process
        self._closed = False

    def submit(self, texts, options, *, truncate: bool = True, first: int = 1, progress=None, tokens=None,
               pairs: bool = False, requests: int = 1) -> Future:
        if self._closed:
            raise InputError("this encoder is closed")
        future = self._link.submit(self._index, list(texts), options,
                                   {"truncate": truncate, "first": first, "tokens": tokens, "pairs": pairs,
                                    "requests": requests})
        if progress is not None:
            future.add_done_callback(lambda f: progress(len(f.result().embeddings))
                                     if not f.cancelled() and f.exception() is None else None)
        return future

    def close(self, *, cancel: bool = False):
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> FtengineError | None:
        """The error every submission now fails with (the engine process has ended), or None."""
        return self._link.failed


def connect(loaded: list, settings: dict) -> _Link:
    """Point the engines of a worker's models at the engine process (settings: link_settings());
    the link, to close when the worker ends."""
    with open(settings["key_file"], "rb") as f:
        link = _Link(settings["address"], f.read())
    index = 0
    for _, model in loaded:
        encoder = engine_of(model)
        if not hasattr(encoder, "_engine"):  # a token classifier: its own batches, here
            continue
        encoder._engine.close()
        encoder._engine = RemoteEngine(link, index)
        index += 1
    return link
