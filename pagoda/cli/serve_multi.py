"""`pagoda serve --api-server-count N` (N > 1): N API processes in front of one engine core.

```
launcher (this process: no HTTP)
  ├─ engine core (spawned first; loads the model once)   binds ipc://…/in, pushes to ipc://…/out{i}
  └─ API process i = 0..N-1 (spawned once the core is Ready)
        the same FastAPI app on the launcher's one listening socket (the kernel hands each new
        connection to whichever process accepts it first), its own AsyncEngine attached as client i
```

The launcher validates everything a single API process would (flags, preflight, tokenizer, chat
template) before the core starts, binds the port once the core is Ready, and then only watches:
SIGTERM/SIGINT → SIGTERM to every API process (each drains its in-flight requests for
`--shutdown-timeout`), then Shutdown to the core, exit 0. If the core dies, every API process is told
(CoreDied: in-flight requests fail, /health answers 503), they are stopped and the launcher exits 1
with one line; likewise if an API process dies. Metrics use prometheus_client's multiprocess mode
in a temporary folder; it and the ZeroMQ folder are removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from pagoda.engine.async_engine import CoreClient
from pagoda.errors import ConfigError
from pagoda.launch.sockets import listen_socket

logger = logging.getLogger("pagoda")


def serve_multi(ns: argparse.Namespace) -> int:
    from pagoda.cli.serve import ServeSetup

    setup = ServeSetup(ns)                  # every one-line startup error, before the model loads
    launcher = _Launcher(ns, setup)
    try:
        return launcher.run()
    finally:
        launcher.cleanup()


class _Launcher:
    def __init__(self, ns: argparse.Namespace, setup: Any):
        import multiprocessing

        import zmq

        self.ns, self.setup = ns, setup
        self.count: int = ns.api_server_count
        self.folder = tempfile.mkdtemp(prefix="pagoda-")
        self.metrics_folder = tempfile.mkdtemp(prefix="pagoda-metrics-")
        self.input_address = f"ipc://{self.folder}/in"
        self.control_address = f"ipc://{self.folder}/control"
        self.client_addresses = [f"ipc://{self.folder}/out{i}" for i in range(self.count)]
        self.mp = multiprocessing.get_context("spawn")
        self.zmq = zmq.Context()
        self.control = self.zmq.socket(zmq.PULL)
        self.control.bind(self.control_address)
        self.core: Any = None
        self.apis: list[Any] = []
        self.stopping = False

    # ---- startup ------------------------------------------------------------------------------
    def run(self) -> int:
        from pagoda.engine.core_process import Ready, StartupFailed, run_engine_core

        self.core = self.mp.Process(target=run_engine_core, name="pagoda-engine-core", daemon=True,
                                    args=(self.setup.config, self.input_address, self.control_address,
                                          self.client_addresses))
        self.core.start()
        while not self.control.poll(500):
            if not self.core.is_alive():
                raise ConfigError(f"The engine process exited during startup (exit code {self.core.exitcode}).")
        first = self.control.recv_pyobj()
        if isinstance(first, StartupFailed):
            self.core.join(5)
            raise ConfigError(first.message)
        assert isinstance(first, Ready)
        sock = _listen_socket(self.ns.host, self.ns.port)
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_folder     # read by the API processes at import
        try:
            for index in range(self.count):
                client = CoreClient(index, self.input_address, self.client_addresses[index], self.core.pid, first)
                process = self.mp.Process(target=run_api_server, name=f"pagoda-api-{index}", daemon=True,
                                          args=(self.ns, self.setup.config, client, sock, os.getpid()))
                process.start()
                self.apis.append(process)
        finally:
            if previous is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
            sock.close()         # each API process holds its own copy; closing them all frees the port
        self.setup.log_startup(first)
        return self._watch()

    # ---- running ------------------------------------------------------------------------------
    def _watch(self) -> int:
        from pagoda.engine.core_process import CoreDied

        def on_signal(signum: int, frame: Any) -> None:
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        died_message: str | None = None
        while not self.stopping:
            if self.control.poll(200):
                message = self.control.recv_pyobj()
                if isinstance(message, CoreDied):
                    died_message = message.message
            if not self.core.is_alive():
                if died_message:
                    logger.error("Engine core failed:\n%s", died_message)
                reason = f"the engine core process died (exit code {self.core.exitcode})"
                self._tell_core_died(reason)
                self._stop_apis(grace=5.0)
                print(f"pagoda: error: {reason}; the API servers were stopped.", file=sys.stderr)
                return 1
            for index, process in enumerate(self.apis):
                if not process.is_alive():
                    self._stop_apis(grace=5.0)
                    self._stop_core()
                    print(f"pagoda: error: API server {index} exited unexpectedly (exit code {process.exitcode}); "
                          "the server was stopped.", file=sys.stderr)
                    return 1
        logger.info("Shutting down: draining in-flight requests (up to %.0f s)", self.ns.shutdown_timeout)
        self._stop_apis(grace=self.ns.shutdown_timeout + 10.0)
        self._stop_core()
        return 0

    def _tell_core_died(self, reason: str) -> None:
        """Every API process marks its engine dead now (in-flight requests fail, /health answers 503),
        rather than waiting for its own check of the core's pid."""
        import zmq

        from pagoda.engine.core_process import CoreDied

        for address in self.client_addresses:
            push = self.zmq.socket(zmq.PUSH)
            push.connect(address)
            try:
                push.send_pyobj(CoreDied(reason), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            push.close(linger=500)
        time.sleep(0.5)

    def _stop_apis(self, grace: float) -> None:
        for process in self.apis:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self.apis:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)

    def _stop_core(self) -> None:
        import zmq

        from pagoda.engine.core_process import Shutdown

        if self.core is None or not self.core.is_alive():
            return
        push = self.zmq.socket(zmq.PUSH)
        push.connect(self.input_address)
        try:
            push.send_pyobj(Shutdown(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.core.join(10)
        if self.core.is_alive():
            self.core.kill()
            self.core.join(5)
        push.close(linger=0)

    def cleanup(self) -> None:
        """Whatever is still running (an error during startup, a second signal): stop it, remove the folders."""
        for process in self.apis:
            if process.is_alive():
                process.kill()
                process.join(5)
        if self.core is not None and self.core.is_alive():
            self.core.kill()
            self.core.join(5)
        self.zmq.destroy(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self.metrics_folder, ignore_errors=True)


def _listen_socket(host: str, port: int) -> socket.socket:
    try:
        return listen_socket(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                          f"(is another server using port {port}?)") from None


# ---- one API process (spawned) ------------------------------------------------------------------
def run_api_server(ns: argparse.Namespace, config: Any, client: CoreClient, sock: socket.socket,
                   launcher_pid: int) -> None:
    # The launcher decides when to stop (it forwards SIGTERM); a terminal's Ctrl-C reaches the whole
    # process group and must not start a second, uncoordinated shutdown here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    asyncio.run(_api_main(ns, config, client, sock, launcher_pid))


async def _api_main(ns: argparse.Namespace, config: Any, client: CoreClient, sock: socket.socket,
                    launcher_pid: int) -> None:
    import uvicorn

    from pagoda.cli.serve import STREAM_END_GRACE_S, ServeSetup
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.serving_gc import prepare_gc_for_serving

    setup = ServeSetup(ns, check=False, config=config)
    engine = AsyncEngine(config, client)
    await engine.start()
    try:
        metrics = setup.metrics(multiprocess=True, count_engine_totals=client.index == 0)
        app = setup.app(engine, metrics)
        prepare_gc_for_serving()
        server = _api_server_class()(uvicorn.Config(
            app, log_level=ns.uvicorn_log_level, timeout_graceful_shutdown=ns.shutdown_timeout + STREAM_END_GRACE_S,
            access_log=False, **setup.http_limits.uvicorn_args()))
        server.engine, server.deadline_s = engine, ns.shutdown_timeout
        orphan_check = asyncio.create_task(_exit_with_launcher(server, launcher_pid))
        try:
            await server.serve(sockets=[sock])
        finally:
            orphan_check.cancel()
    finally:
        await engine.shutdown()


async def _exit_with_launcher(server: Any, launcher_pid: int) -> None:
    while os.getppid() == launcher_pid:
        await asyncio.sleep(1.0)
    server.should_exit = True          # the launcher was killed: do not linger as an orphan


def _api_server_class():  # type: ignore[no-untyped-def]
    import contextlib

    import uvicorn

    from pagoda.cli.serve import EndStreamsAtDeadline

    class ApiServer(EndStreamsAtDeadline, uvicorn.Server):
        """SIGTERM (from the launcher) starts uvicorn's graceful shutdown; it is not re-raised afterwards,
        so the process exits 0. SIGINT stays ignored."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            original = signal.signal(signal.SIGTERM, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(signal.SIGTERM, original)

    return ApiServer

