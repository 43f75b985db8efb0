"""`pagoda router --workers N`: N router processes serving one listening socket.

One router process relays every stream event on one event loop, so at a few hundred streams a new request's
setup queues behind the relaying. The parent here binds the socket once (so a bind error is one line before
anything starts) and starts N workers (`python -c ...worker_main()`, the socket's descriptor inherited); each
worker runs the usual app on its own uvloop and accepts from the shared socket (uvicorn `Server.run(sockets=)`).
The kernel hands each new connection to one worker; a keep-alive connection stays with it.

What is per worker: health probes (each worker probes every backend every interval, so a backend is ejected
by every worker within interval x fail_threshold (+ timeout) of going down), circuit breakers, in-flight counts
(bounded load compares a worker's own counts), round-robin position, the long-request queue (each worker has
`long_request_concurrency` slots), and config reloads (each worker polls the file). Routing by session is
the same in every worker: the ring is built from the backends' names (md5, same points), so a session maps
to the same backend whichever worker takes the request, as long as the workers agree on which backends are
available. Metrics and /usage add up all workers through prometheus_client's multiprocess mode, in a private
temporary PROMETHEUS_MULTIPROC_DIR removed on exit (router.metrics explains the gauges).

The parent does no request work. The workers are started and watched by `pagoda.processes.Supervisor` (the one
`pagoda serve` uses too): SIGTERM/SIGINT go to every worker (graceful: open streams get --shutdown-timeout s; a
second signal is passed on as SIGINT, which makes uvicorn stop at once); a worker that exits on its own stops
the others and the router exits 1 (a supervisor such as systemd restarts the whole router). Workers run in
their own session (signals come from the parent only) and die with the parent, so none is left behind even if
the parent is killed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from typing import Any

from pagoda.errors import ConfigError
from pagoda.processes.sockets import listen_socket
from pagoda.processes.supervisor import Supervisor
from pagoda.tools.router.app import make_server
from pagoda.tools.router.config import build_config, overrides_from, parse_file

logger = logging.getLogger("pagoda.tools.router")


def run_workers(ns: argparse.Namespace, config: Any) -> int:
    n = config.workers
    try:
        sock = listen_socket(config.host, config.port)
    except OSError as exc:
        print(
            f"pagoda router: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    supervisor = Supervisor(metrics_prefix="pagoda-router-metrics-")
    supervisor.catch_signals()
    args = argparse.Namespace(
        **{k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    )
    try:
        workers = []
        for index in range(n):
            if supervisor.stopping:
                break
            workers.append(
                supervisor.start(
                    f"pagoda-router-{index}",
                    worker_main,
                    (args, sock, index, supervisor.metrics_dir),
                    index=index,
                    new_session=True,
                )
            )
        logger.info(
            "pagoda router on http://%s:%d: %d workers (pids %s), %d backends (%s), policy %s%s",
            config.host,
            config.port,
            n,
            " ".join(str(w.pid) for w in workers),
            len(config.backends),
            ", ".join(b.name for b in config.backends),
            config.policy,
            f", config {ns.config} (reloaded on change)" if ns.config else "",
        )
        status = 0
        dead = supervisor.wait(workers)
        if dead is not None:
            code = dead.exitcode or 0
            what = f"signal {-code}" if code < 0 else f"status {code}"
            print(
                f"pagoda router: error: worker {dead.index} (pid {dead.pid}) exited with {what}; stopping the router",
                file=sys.stderr,
            )
            status = 1
        supervisor.stop(workers, grace=ns.shutdown_timeout + 10, again=signal.SIGINT)  # a 2nd signal: stop at once
        # Failed while stopping (uvicorn re-raises the SIGTERM it caught: exit code -15 is normal).
        if any((w.exitcode or 0) > 0 for w in workers if w is not dead):
            status = 1
        return status
    finally:
        sock.close()
        supervisor.close()


def worker_main(ns: argparse.Namespace, sock: socket.socket, index: int, metrics_dir: str) -> int:
    """One worker (started by the Supervisor, the listening socket inherited)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s[w{index}]: %(message)s", stream=sys.stderr)
    try:
        config = build_config(parse_file(ns.config) if ns.config else None, overrides_from(ns))
    except ConfigError as exc:  # the file changed between the parent's read and ours
        print(f"pagoda router: error: worker {index}: {exc.message}", file=sys.stderr)
        return 2
    server = make_server(ns, config, multiprocess_dir=metrics_dir, worker_index=index)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a SIGINT sent to the worker itself: uvicorn stopped, then re-raised it
        pass
    return 0 if server.started else 1
