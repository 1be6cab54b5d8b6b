"""Assemble a worker: backend, servicer, gRPC server, metrics endpoint, health service."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc

from coliworker import __version__
from coliworker.server import upkeep, upload
from coliworker.server.auth import AuthInterceptor, check_exposure, server_credentials
from coliworker.server.backend import Backend
from coliworker.server.backends import create_backend
from coliworker.server.config import Config
from coliworker.server.guard import GuardInterceptor, backstop
from coliworker.server.memory import memory_limit_warnings
from coliworker.server.servicer import WorkerServicer
from coliworker.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class _Collected:
    """Stands in for the server while the generated code registers the handlers."""

    service = ""
    handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.handlers = service, dict(handlers)


def _add_servicer(server: grpc.Server, servicer: WorkerServicer) -> None:
    """The generated registration, except that the upload RPCs get their messages as bytes
    (``server/upload.py`` reads the data chunks in place, without protobuf)."""
    got = _Collected()
    pb_grpc.add_WorkerServicer_to_server(servicer, got)
    handlers = dict(got.handlers)
    for name in upload.RAW_METHODS:
        h = handlers[name]
        handlers[name] = grpc.stream_unary_rpc_method_handler(
            h.stream_unary, request_deserializer=None, response_serializer=h.response_serializer
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(got.service, handlers),))
    server.add_registered_method_handlers(got.service, handlers)


class WorkerServer:
    """A running (after ``start``) worker. ``port`` and ``metrics_port`` are the bound ports."""

    def __init__(
        self, config: Config, backend: Backend | None = None, handle_signals: bool = False
    ) -> None:
        self.config = config
        self.signalled = threading.Event()
        self.signal = 0
        if handle_signals:  # before anything listens: a SIGTERM from then on drains
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        self.backend = backend or create_backend(config.backend, devices=config.devices)
        self.metrics = None
        from coliworker.server.health import Health, enable_reflection

        self.health = Health()
        # Health/Watch first: served outside the other interceptors (no thread, own bound).
        interceptors: list[grpc.ServerInterceptor] = [self.health.interceptor()]
        hooks = None
        if config.metrics_port is not None:
            from coliworker.server.metrics import Metrics

            self.metrics = Metrics(version=__version__, backend=self.backend.name)
            interceptors.append(self.metrics.interceptor())
            hooks = self.metrics
        self.servicer = WorkerServicer(config, self.backend, hooks=hooks)
        check_exposure(config, authenticated=self.servicer.tokens is not None)
        if self.servicer.tokens is not None:
            interceptors.append(AuthInterceptor(self.servicer.tokens))
        interceptors.append(
            GuardInterceptor(
                self.servicer.instance_id,
                config.max_in_flight,
                self.servicer.idle,
                upload.RAW_METHODS,
            )
        )
        if self.metrics is not None:
            gpus = config.devices if self.backend.name == "cupy" else None
            self.metrics.bind(
                residency=self.servicer.usage,
                devices=self.backend.devices,
                memory_limit=config.memory_limit,
                gpus=gpus,
            )
        memory = "host" if self.backend.name == "numpy" else "GPU"
        for warning in memory_limit_warnings(config.memory_limit, self.backend.devices(), memory):
            log.warning("%s", warning)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="rpc"),
            interceptors=interceptors,
            options=options,
            maximum_concurrent_rpcs=backstop(config.max_in_flight),
        )
        _add_servicer(self.server, self.servicer)
        self.health.attach(self.server)
        enable_reflection(self.server)
        credentials = server_credentials(config)
        if credentials is not None:
            self.port = self.server.add_secure_port(f"{config.host}:{config.port}", credentials)
        else:
            self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        if config.unix_socket:
            self.server.add_insecure_port(f"unix:{config.unix_socket}")
        from coliworker.server.dataplane import DataPlane

        self.data = DataPlane(self.servicer, config)
        self.servicer.data_endpoint = self.data.endpoint
        from coliworker.server.shm_socket import AttachSocket

        self.servicer.sessions.attach_socket = AttachSocket()  # shared memory (same host)
        self.metrics_port: int | None = None
        self._stopped = threading.Event()
        dispatch = self.servicer.dispatch
        folds = [self.servicer.tensor_counts.fold]
        if self.metrics is not None:
            folds.append(self.metrics.tally.fold)
        self.upkeep = upkeep.Upkeep(lambda: dispatch.last, folds)  # (started with the server)

    def start(self) -> WorkerServer:
        self.server.start()
        self.data.start()
        self.servicer.sessions.attach_socket.start()
        if self.metrics is not None:
            host = self.config.metrics_host or self.config.host
            self.metrics_port = self.metrics.serve(host, self.config.metrics_port or 0)
        self.upkeep.start()
        self.health.set_serving()
        names = ", ".join(f"{d.id}:{d.name}" for d in self.backend.devices())
        log.info(
            "coliworker %s serving on %s:%d (backend %s, devices %s, metrics %s)",
            __version__,
            self.config.host,
            self.port,
            self.backend.name,
            names,
            f"port {self.metrics_port}" if self.metrics_port else "off",
        )
        if self.data.listeners:
            log.info(
                "data plane on %s%s%s",
                f"{self.config.host}:{self.data.port}" if self.data.port else "",
                f" unix:{self.data.unix_path}" if self.data.unix_path else "",
                " (TLS)" if self.data.tls is not None else "",
            )
        return self

    def stop(self, grace: float | None = None) -> None:
        """Drain: health turns NOT_SERVING, new calls are refused at once, calls in flight
        get ``grace`` seconds to finish (None: cancel them now)."""
        self.health.set_not_serving()
        stopping = self.server.stop(grace)
        self.data.stop(grace)
        self.servicer.sessions.attach_socket.stop()
        stopping.wait()
        if self.metrics is not None:
            self.metrics.stop()
        self.backend.close()
        self.upkeep.stop()
        self._stopped.set()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal = signum
        self.signalled.set()

    def wait_for_signal(self) -> int:
        """Block until SIGTERM or SIGINT (``handle_signals=True``); returns which. A signal
        that came while the server was still starting returns at once."""
        while not self.signalled.wait(0.25):  # wakes to run handlers on any thread's signal
            pass
        return self.signal

    @property
    def address(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"


def build_server(
    config: Config, backend: Backend | None = None, handle_signals: bool = False
) -> WorkerServer:
    """The worker of ``config``; ``handle_signals`` (the main thread of ``coliworker
    serve``) catches SIGTERM/SIGINT from before the port opens, for ``wait_for_signal``."""
    return WorkerServer(config, backend, handle_signals)
