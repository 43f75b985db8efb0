"""`pagoda serve`'s launcher once its checks have passed: it starts the engine core and the API processes and
watches them (`Launcher`), in a process image that holds nothing else.

The checks (`cli/serve.prepare`: configs, preflight, tokenizer, chat template) load transformers, FastAPI and a
tokenizer, ~100 MB of resident memory that the launcher never uses again and that freeing gives back only in
part (imported modules stay). So on POSIX the launcher replaces its own image once they pass (`launch`):
the `LaunchPlan` is pickled into an unlinked temporary file and the process execs `python -m
pagoda.launch.supervise FD -- pagoda <the original arguments>`, which reads it back and supervises. The PID, the
session, the environment, resource limits and the terminal stay the process's own, so signals, process
managers, `ps` and `pkill -f "pagoda serve"` (the original arguments follow `--`) see one launcher throughout. Switch:
`PAGODA_LAUNCHER_EXEC=0` supervises in the checking image instead (also what non-POSIX systems do).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing import reduction

from pagoda import envs
from pagoda.child_process import package_env
from pagoda.config import EngineConfig
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.engine.core_process import CoreProcess, Ready
from pagoda.errors import ConfigError
from pagoda.processes.sockets import listen_socket
from pagoda.processes.supervisor import Child, Supervisor
from pagoda.serving_gc import return_freed_memory

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs of the checks' results: the configs the children get, the `--lora-modules`
    adapters (parsed and checked), and the served names for the startup log."""

    server: ServerConfig
    config: EngineConfig
    multimodal: MultiModalConfig
    loras: tuple  # LoRARequest, numbered as the API processes number them
    names: tuple[str, ...]

    def log_startup(self, ready: Ready) -> None:
        config, server = self.config, self.server
        logger.info(
            "model=%s served as %s dtype=%s device=%s",
            config.model.model,
            ", ".join(self.names),
            config.model.dtype,
            config.device.device,
        )
        logger.info(
            "KV cache (%s): %d blocks of %d tokens; maximum concurrency for %d-token requests: %.2fx",
            config.kv_cache_dtype_name,
            ready.num_blocks,
            ready.block_size,
            config.model.max_model_len,
            ready.max_concurrency,
        )
        extra = f" ({server.api_server_count} API server processes)" if server.api_server_count > 1 else ""
        logger.info("Serving on http://%s:%d (OpenAI API under /v1)%s", server.host, server.port, extra)


def launch(plan: LaunchPlan) -> int:
    """Supervise the server described by `plan` until it stops; the exit code. Execs a fresh image first where
    it can (module docstring): then this call does not return, the new image exits with the code."""
    if os.name == "posix" and envs.LAUNCHER_EXEC.value:
        _exec_supervisor(plan)
    gc.collect()  # supervising here: at least the checks' tokenizer goes back to the system
    return_freed_memory()
    return Launcher(plan).run()


def _exec_supervisor(plan: LaunchPlan) -> None:
    held = tempfile.TemporaryFile()  # unlinked already: gone when its last descriptor closes
    pickle.dump(plan, held)
    held.flush()
    held.seek(0)
    fd = held.fileno()
    os.set_inheritable(fd, True)
    env = package_env()  # the new image imports this same Pagoda (a checkout run in place too)
    sys.stdout.flush()
    sys.stderr.flush()
    # After "--" the command as the user typed it, for `ps` and `pkill -f "pagoda serve"` (`main` ignores it).
    argv = [sys.executable, "-m", "pagoda.launch.supervise", str(fd), "--", "pagoda", *sys.argv[1:]]
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:  # no runnable interpreter at sys.executable (an embedding): supervise here
        logger.warning("Supervising in the checking process (could not exec %s: %s)", sys.executable, exc)
        held.close()


def main(argv: list[str]) -> int:
    """The exec'd image: argv = [FD, "--", "pagoda", original arguments...]."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    with os.fdopen(int(argv[0]), "rb") as held:
        plan = pickle.load(held)
    return Launcher(plan).run()


def run_api_process(*args: object) -> None:
    """An API process's entry point, by name from this light module: the launcher never imports the API
    server's modules (FastAPI, transformers), only the API processes do."""
    from pagoda.server.api_process import run_api_server  # lazy: FastAPI, transformers (see above)

    run_api_server(*args)  # type: ignore[arg-type]


class Launcher:
    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self.server: ServerConfig = plan.server
        self.supervisor = Supervisor()
        self.core: CoreProcess | None = None
        self.apis: list = []

    def run(self) -> int:
        try:
            return self._run()
        except ConfigError as exc:  # the port, found taken once the model loaded
            print(f"pagoda: error: {exc.message}", file=sys.stderr)
            return 2
        finally:
            self.supervisor.close()
            if self.core is not None:
                self.core.close()

    def _run(self) -> int:
        plan, server, supervisor = self.plan, self.server, self.supervisor
        supervisor.catch_signals()
        self.core = core = CoreProcess(supervisor, plan.config, server.api_server_count, loras=plan.loras)
        # The API processes start beside the core: their imports, tokenizer and app setup (seconds of one core)
        # overlap the model's load. Each then waits on its pipe for its `CoreClient` and the listening socket,
        # which exist once the core is Ready (the port stays closed until then, so a connection is refused
        # rather than left waiting while the model loads).
        pipes = []
        for index in range(server.api_server_count):
            ours, theirs = supervisor.mp.Pipe()  # duplex: a socket pair, which can carry a descriptor
            args = (server, plan.config, plan.multimodal, index, theirs)
            self.apis.append(supervisor.start(f"pagoda-api-{index}", run_api_process, args, index=index))
            theirs.close()  # the child has its own copy: a launcher gone before Ready ends its wait (EOF)
            pipes.append(ours)
        try:
            ready = core.wait_ready(stop=lambda: supervisor.stopping or self._api_died() is not None)
            dead = self._api_died()
            if dead is not None:
                print(
                    f"pagoda: error: API server {dead.index} exited during startup (exit code {dead.exitcode}); "
                    "the server was stopped.",
                    file=sys.stderr,
                )
                return 1
            if ready is None:  # SIGTERM/SIGINT while the model loaded
                return 0
            sock = _listen_socket(server.host, server.port)
            try:
                for child, pipe, client in zip(self.apis, pipes, core.clients, strict=True):
                    pipe.send(client)
                    reduction.send_handle(pipe, sock.fileno(), child.pid)
            finally:
                sock.close()  # each API process holds its own copy; closing them all frees the port
        finally:
            for pipe in pipes:
                pipe.close()
        plan.log_startup(ready)
        return self._watch()

    def _api_died(self) -> Child | None:
        return next((api for api in self.apis if not api.alive), None)

    def _watch(self) -> int:
        supervisor, core, server = self.supervisor, self.core, self.server
        assert core is not None
        dead = supervisor.wait([core.child, *self.apis], poll=core.poll)
        if dead is None:
            logger.info("Shutting down: draining in-flight requests (up to %.0f s)", server.shutdown_timeout)
            supervisor.stop(self.apis, grace=server.shutdown_timeout + 10.0)
            core.shutdown()
            return 0
        if dead is core.child:
            if core.hung is not None:  # found hung: the API processes were told, the core killed
                reason = f"{core.hung}; it was killed"
            else:
                core.poll(0.2)  # a last line it sent just before it exited
                reason = core_death(core.died_message, dead.pid, dead.exitcode)
                core.tell_core_died(reason)
            supervisor.stop(self.apis, grace=5.0)
            print(f"pagoda: error: {reason}; the API servers were stopped.", file=sys.stderr)
            return 1
        supervisor.stop([a for a in self.apis if a is not dead], grace=5.0)
        core.shutdown()
        print(
            f"pagoda: error: API server {dead.index} exited unexpectedly (exit code {dead.exitcode}); "
            "the server was stopped.",
            file=sys.stderr,
        )
        return 1


def core_death(message: str | None, pid: int, exitcode: int | None) -> str:
    """Why the core is gone, in one line: the one line it said (a lost tensor-parallel rank), else its exit
    (a traceback it sent goes to the log first)."""
    if message and "\n" not in message.strip():
        return f"the engine core process (pid {pid}) exited with code {exitcode}: {message.strip()}"
    if message:
        logger.error("Engine core failed:\n%s", message)
    return f"the engine core process died (pid {pid}, exit code {exitcode})"


def _listen_socket(host: str, port: int):  # type: ignore[no-untyped-def]
    """The one listening socket every API process accepts from; a bind error is one line."""
    try:
        return listen_socket(host, port)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server using port {port}?)"
        ) from None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
