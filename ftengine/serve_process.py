"""Running the service (serve.py's routes): uvicorn in this process, or with `workers` > 1 that
many processes on one listening socket, each with its own engine and copy of the model: HTTP
parsing and JSON encoding (most of the host time per request, all under one GIL in a single
process) then run in parallel, and the Prometheus metrics are summed over the processes
(prometheus_client's multiprocess mode); with engine_processes, the models run in that many
processes of their own, the workers shared out among them (serve_engine_host.py). Loading the
model a service runs."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

from .errors import FtengineError
from .serve import LOG_FORMAT, Service, ServeLimits
from .serve_engine_host import claim_slot, connect, hosted, start_hosts

WORKER_ENV = "FTENGINE_SERVE_WORKER"  # a worker process's settings (JSON), set by serve_workers
SHUTDOWN_GRACE_SECONDS = 60  # after SIGTERM / SIGINT, requests still open after this are cut off


def _log_to_stderr():
    """The service's log lines, LOG_FORMAT to stderr. Its records skip looking up their thread and
    process, which the format does not print (the per-request line's cost, under the GIL)."""
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


def _uvicorn_config(app, **options):
    import uvicorn
    from .serve_http import KEEP_ALIVE_SECONDS
    return uvicorn.Config(app, access_log=False, log_level="info", timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
                          timeout_keep_alive=KEEP_ALIVE_SECONDS, http="ftengine.serve_http:GuardedHttpToolsProtocol",
                          **options)


def build_app(loaded: list, limits: ServeLimits):
    """The application of the (name, model) pairs: one model's Service, or a Gateway over several
    (each its own engine, batches and limits; metrics labelled by model), its POST routes
    dispatched ahead of Starlette's stack."""
    from .serve_dispatch import PostDispatch
    if len(loaded) == 1:
        name, model = loaded[0]
        return PostDispatch(Service(model, model_name=name, limits=limits).app())
    from .serve_metrics import Metrics
    from .serve_gateway import Gateway
    metrics = Metrics(per_model=True)
    return PostDispatch(Gateway([Service(model, model_name=name, limits=limits, metrics=metrics)
                                 for name, model in loaded]).app())


def serve(loaded: list, *, host: str, port: int, limits: ServeLimits):
    """Run the service of the (name, model) pairs until SIGTERM/SIGINT: then stop accepting,
    answer every request already accepted (for up to SHUTDOWN_GRACE_SECONDS), close the engines
    and return (the process exits 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after its graceful shutdown, which would end
            # the process "killed by SIGTERM"; the shutdown was orderly, so exit normally
            getattr(self, "_captured_signals", []).clear()

    _log_to_stderr()
    Server(_uvicorn_config(build_app(loaded, limits), host=host, port=port)).run()


@dataclass(frozen=True)
class WorkerSettings:
    """What each worker process of serve_workers needs to load its own copy of the models."""
    models: list               # [name, path (None: the default model), task (reranker.model_task)] each
    device: str
    dtype: str | None
    max_length: int | None
    limits: ServeLimits
    tokenizer: str = "auto"
    engine_processes: int = 0  # processes that run the models for the workers (serve_engine_host.py); 0: each its own


def serve_workers(settings: WorkerSettings, *, host: str, port: int, workers: int) -> bool:
    """Run `workers` service processes on one socket (uvicorn's supervisor) until SIGTERM/SIGINT,
    which each worker answers as `serve` does. False if a worker could not start (its error is in
    the log). max_concurrent_requests is shared out among the workers. With
    settings.engine_processes, the engine processes start first (an FtengineError raised if one
    cannot) and stop once the workers have drained."""
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess
    # rounded up: the kernel spreads connections unevenly, and a worker at 1 would refuse what another could take
    per_worker = -(-settings.limits.max_concurrent_requests // workers)
    limits = asdict(settings.limits) | {"max_concurrent_requests": per_worker, "api_key": None}
    _log_to_stderr()
    with tempfile.TemporaryDirectory(prefix="ftengine-metrics-") as metrics:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics)
        key_file = None
        if settings.limits.api_key is not None:  # to the workers through a private file, not their environment
            key_file = os.path.join(metrics, "api-key")
            with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(settings.limits.api_key)
        hosts = []
        if settings.engine_processes and hosted(settings.models):
            hosts = start_hosts(settings.models, dict(device=settings.device, dtype=settings.dtype,
                                                      max_length=settings.max_length,
                                                      batch_tokens=settings.limits.max_batch_tokens,
                                                      tokenizer=settings.tokenizer), metrics,
                                settings.engine_processes)
        os.environ[WORKER_ENV] = json.dumps(asdict(settings) | {
            "limits": limits, "key_file": key_file, "workers": workers, "folder": metrics,
            "engines": [h.link_settings() for h in hosts]})
        try:
            config = _uvicorn_config("ftengine.serve_process:worker_app", factory=True, host=host, port=port,
                                     workers=workers)
            supervisor = Multiprocess(config, sockets=[config.bind_socket()])
            supervisor.run()
        finally:
            for h in hosts:
                h.stop()
    return not any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes)


def worker_app():
    """The application of one worker process of serve_workers (uvicorn calls it as a factory)."""
    from uvicorn.config import STARTUP_FAILURE
    _log_to_stderr()
    settings = json.loads(os.environ[WORKER_ENV])
    limits = ServeLimits(**settings["limits"])
    if settings.get("key_file"):
        with open(settings["key_file"]) as f:
            limits = ServeLimits(**(asdict(limits) | {"api_key": f.read()}))
    # with engine processes a worker tokenises no batch (/tokenize and /decode run on the CPU
    # tokenizer anyway): no GPU tokenizer to build in each, its tables and kernels at every cold start
    tokenizer = "cpu" if settings["engines"] else settings["tokenizer"]
    try:
        loaded = load_models(settings["models"], device=settings["device"], dtype=settings["dtype"],
                             max_length=settings["max_length"], batch_tokens=limits.max_batch_tokens,
                             tokenizer=tokenizer)
    except FtengineError as e:
        print(f"ftengine: {e}", file=sys.stderr, flush=True)
        sys.exit(STARTUP_FAILURE)
    if settings["engines"]:  # their batches run in one of the engine processes
        engines = settings["engines"]
        engine = engines[claim_slot(settings["folder"], settings["workers"]) % len(engines)]
        connect(loaded, engine)
        logging.getLogger("ftengine.serve").info("process %d: the models run in engine process %d", os.getpid(),
                                                 engine["pid"])
    return build_app(loaded, limits)


def load_models(specs: list, **options) -> list:
    """(name, model) of each [name, path, task] (load_model's options); on a failure the ones
    loaded are closed and the error raised."""
    loaded = []
    try:
        for name, path, kind in specs:
            loaded.append((name, load_model(kind, path, **options)))
    except FtengineError:
        for _, model in loaded:
            model.close()
        raise
    return loaded


def load_model(task: str, path, *, device: str, dtype, max_length, batch_tokens, tokenizer: str = "auto"):
    """The Encoder (task "embed"), Reranker ("rerank"), Classifier ("classify") or TokenClassifier
    ("ner", which tokenises on the CPU: it needs the tokens' offsets) a service runs, its options
    checked."""
    from .classifier import Classifier
    from .encoder import Encoder
    from .reranker import Reranker
    if task == "ner":  # runs its own batches, not the engine's (no batch_tokens to check)
        from .token_classifier import TokenClassifier
        return TokenClassifier.from_pretrained(path, device=device, dtype=dtype, max_length=max_length)
    if task in ("rerank", "classify"):
        model = (Reranker if task == "rerank" else Classifier).from_pretrained(path, device=device, dtype=dtype,
                                                                                max_length=max_length,
                                                                                tokenizer=tokenizer)
        engine = model._encoder
    else:
        model = engine = Encoder.from_pretrained(path, device=device, dtype=dtype, max_length=max_length,
                                                 tokenizer=tokenizer)
    try:
        engine.check_options(batch_tokens=batch_tokens)  # refused now, not at the first request
    except FtengineError:
        model.close()
        raise
    return model
