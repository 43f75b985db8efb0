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

The parent does no request work. SIGTERM/SIGINT go to every worker (graceful: open streams get
--shutdown-timeout s); a worker that exits on its own stops the others and the router exits 1 (a supervisor
such as systemd restarts the whole router). Workers die with the parent (PR_SET_PDEATHSIG), so none is left
behind even if the parent is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from pagoda.launch.sockets import listen_socket

logger = logging.getLogger("pagoda.tools.router")

_ENV = "PAGODA_ROUTER_WORKER"
_WORKER_CODE = "import sys; from pagoda.tools.router.workers import worker_main; sys.exit(worker_main())"


def run_workers(ns: argparse.Namespace, config: Any) -> int:
    n = config.workers
    try:
        sock = listen_socket(config.host, config.port)
    except OSError as exc:
        print(f"pagoda router: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="pagoda-router-metrics-")
    args = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    procs: list[subprocess.Popen] = []
    stopping: list[int] = []        # the signal that asked us to stop, once one did

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)   # _supervise passes it on to the workers

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for index in range(n):
            if stopping:
                break
            env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
                   _ENV: json.dumps({"fd": sock.fileno(), "index": index, "parent": os.getpid(), "args": args})}
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE],
                env=env, pass_fds=(sock.fileno(),), start_new_session=True))   # signals come from here only
        logger.info("pagoda router on http://%s:%d: %d workers (pids %s), %d backends (%s), policy %s%s",
                    config.host, config.port, n, " ".join(str(p.pid) for p in procs), len(config.backends),
                    ", ".join(b.name for b in config.backends), config.policy,
                    f", config {ns.config} (reloaded on change)" if ns.config else "")
        status = _supervise(procs, stopping, metrics_dir, ns.shutdown_timeout)
    finally:
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        for proc in procs:   # only after an error in the parent itself: nothing may outlive it
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


def _supervise(procs: list[subprocess.Popen], stopping: list[int], metrics_dir: str, shutdown_timeout: float) -> int:
    from prometheus_client import multiprocess

    status = 0
    deadline: float | None = None
    forwarded = 0
    live = {p.pid: (i, p) for i, p in enumerate(procs)}
    while live:
        if len(stopping) > forwarded:
            # the first stop: graceful (SIGTERM); a second signal: SIGINT, which makes uvicorn stop at once
            sig = signal.SIGTERM if forwarded == 0 else signal.SIGINT
            forwarded = len(stopping)
            for _, proc in live.values():
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
        time.sleep(0.1)
        for pid, (index, proc) in list(live.items()):
            code = proc.poll()
            if code is None:
                continue
            del live[pid]
            multiprocess.mark_process_dead(pid, metrics_dir)   # its live gauges no longer count
            if not stopping:
                what = f"signal {-code}" if code < 0 else f"status {code}"
                print(f"pagoda router: error: worker {index} (pid {pid}) exited with {what}; stopping the router",
                      file=sys.stderr)
                status = 1
                stopping.append(0)
            elif code > 0:   # failed while stopping (uvicorn re-raises the SIGTERM it caught: code -15 is normal)
                status = 1
        if stopping and deadline is None:
            deadline = time.monotonic() + shutdown_timeout + 10
        if deadline is not None and time.monotonic() > deadline:
            for _, proc in live.values():
                logger.warning("router worker pid %d did not stop in time: killed", proc.pid)
                proc.kill()
            for _, proc in live.values():
                proc.wait()
            break
    return status


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM when the parent goes away (even by SIGKILL), so no worker is ever orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:   # gone before the prctl
        sys.exit(1)


def worker_main() -> int:
    spec = json.loads(os.environ.pop(_ENV))
    _die_with_parent(spec["parent"])
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s[w{spec['index']}]: %(message)s",
                        stream=sys.stderr)
    from pagoda.errors import ConfigError
    from pagoda.tools.router.app import make_server
    from pagoda.tools.router.config import build_config, overrides_from, parse_file

    ns = argparse.Namespace(**spec["args"])
    sock = socket.socket(fileno=spec["fd"])
    try:
        config = build_config(parse_file(ns.config) if ns.config else None, overrides_from(ns))
    except ConfigError as exc:   # the file changed between the parent's read and ours
        print(f"pagoda router: error: worker {spec['index']}: {exc.message}", file=sys.stderr)
        return 2
    server = make_server(ns, config, multiprocess_dir=os.environ["PROMETHEUS_MULTIPROC_DIR"],
                         worker_index=spec["index"])
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:   # a SIGINT sent to the worker itself: uvicorn stopped, then re-raised it
        pass
    return 0 if server.started else 1
