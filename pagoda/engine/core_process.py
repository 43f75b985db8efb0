"""The engine core in its own process: a tight loop of drain inputs → step → send outputs.

Why a process: at high stream counts the HTTP event loop and the engine loop fighting over one GIL
is where servers stall. The API process owns HTTP, tokenization and chat
templates, and detokenization of requests without stop strings (`AddRequest.detokenize`); this
process owns the model, the KV cache and the text of requests with stop strings.

Wire protocol (pickled dataclasses over ZMQ PUSH/PULL pipes), the same for N >= 1 API processes:
  API process i → core (one PULL the core binds): AddRequest | AbortRequests | AddLoRA | RemoveLoRA (tagged with i)
  | Shutdown
  core → API process i (a PULL it binds): Outputs of the requests it submitted, EngineStats | LoRAAdded | CoreDied
  core → launcher (control pipe): Ready | StartupFailed (once), CoreDied

A request's outputs go only to the process that submitted it (`AddRequest.client_index`), `EngineStats` to
all of them. The core remembers which process owns each live request id, so an abort from another
process (whose duplicate id the core rejected) cannot abort the owner's request.

The launcher's side is `CoreProcess`: it makes the pipes' addresses, starts this process through the
`processes.Supervisor`, waits for Ready and hands each API process its `CoreClient`. It also watches the
core's heartbeat (`CoreHeartbeat`): a core that stops beating is hung, and is ended like a dead one.

`Outputs` carries each request's delta as a plain tuple (`wire_output`), not a pickled `RequestOutput`:
every streamed token crosses this pipe, and unpickling dataclasses (plus the prompt's token ids, resent
with every delta) cost the API process several times what the tuple costs
(benchmarks/profile/api_overhead.py). The API side
already knows each request's prompt; `AsyncEngine` rebuilds `RequestOutput`s from the tuples.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import logging
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.engine.core_trace import TraceWindow, traced
from pagoda.errors import ConfigError, PagodaError
from pagoda.outputs import CompletionOutput, EngineStats, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.serving_gc import prepare_gc_for_serving

logger = logging.getLogger("pagoda.core")


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    delta: bool
    arrival_time: float
    mm_inputs: Any = None  # multimodal.inputs.MultiModalInputs (pixels travel pickled)
    client_index: int = 0  # which API process sent it (several API processes only)
    # False: the API process turns this request's tokens into text itself, so its outputs carry
    # token ids and empty text (the core still detokenizes any request with stop strings: it must
    # see the text to stop). Detokenizing every stream was a large share of the core's host work per
    # step at 256 streams (benchmarks/profile/host_overhead.py).
    detokenize: bool = True
    cache_salt: str | None = None  # prefix-cache blocks are shared only with the same salt
    priority: int = 0  # lower first under --scheduling-policy priority
    lora_request: Any = None  # lora.request.LoRARequest: the adapter it runs with


@dataclass
class AbortRequests:
    request_ids: list[str]
    client_index: int = 0


@dataclass
class AddLoRA:
    """Read and check an adapter now (/v1/load_lora_adapter): its weights against the model, as `--lora-modules`
    ones are at startup. The core answers the sending process with a `LoRAAdded` of the same `call_id`."""

    call_id: str
    lora_request: Any  # lora.request.LoRARequest
    client_index: int = 0


@dataclass
class RemoveLoRA:
    """An adapter unloaded (/v1/unload_lora_adapter): the core frees its host copy and device slot once no request
    uses it (`LLMEngine.release_lora`). No answer: the API process stopped serving its name already."""

    lora_int_id: int
    client_index: int = 0


@dataclass
class LoRAAdded:
    """The answer to `AddLoRA`: error is None once the adapter is read (a later request naming it waits for no
    file), else the line that says what is wrong with it."""

    call_id: str
    error: str | None = None


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    num_blocks: int
    block_size: int
    max_concurrency: float


@dataclass
class StartupFailed:
    message: str


# One request's delta on the wire (core → API), see `wire_output`:
#   (request_id, finished, completions, num_prompt_tokens, num_cached_tokens, queue_time)
# and each of its completions:
#   (index, text, token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob)
WireOutput = tuple


def wire_output(out: RequestOutput) -> WireOutput:
    return (
        out.request_id,
        out.finished,
        [
            (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
            for c in out.outputs
        ],
        len(out.prompt_token_ids),
        out.num_cached_tokens,
        out.queue_time,
    )


def from_wire(wire: WireOutput, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """The `RequestOutput` a wire tuple stands for, given the request's prompt (which the API side keeps)."""
    request_id, finished, completions, _, num_cached_tokens, queue_time = wire
    return RequestOutput(
        request_id,
        prompt,
        prompt_token_ids,
        [
            CompletionOutput(index, text, token_ids, cumulative, logprobs, reason, stop)
            for index, text, token_ids, reason, stop, logprobs, cumulative in completions
        ],
        finished,
        num_cached_tokens,
        queue_time,
    )


@dataclass
class Outputs:
    outputs: list[WireOutput]  # `wire_output` of each RequestOutput of the step
    stats: EngineStats
    rejected: dict[str, str] = field(default_factory=dict)  # request id → error message (validation in core)
    # AddRequests taken from this API process so far, counted into `stats`: the API side counts the
    # ones it sent beyond this as waiting (`--max-waiting-requests` holds against a burst sent while
    # the core was in a long step; `AsyncEngine.num_unreported`).
    received: int = 0


@dataclass
class CoreDied:
    message: str


@dataclass(frozen=True)
class CoreClient:
    """How API process `index` reaches the core: what `AsyncEngine` attaches through."""

    index: int
    input_address: str  # the core's input pipe (bound by the core)
    output_address: str  # this process's output pipe (bound by the API process, the core connects)
    core_pid: int
    ready: Ready


# ---- the core's heartbeat -----------------------------------------------------------------------
HEARTBEAT_INTERVAL_S = 0.5
# A gap this long between two of the watcher's own checks means the watcher was not running (stopped
# with the whole process group by Ctrl-Z, or starved): the core's silence over it is not the core's.
WATCHER_STALL_S = 2.0


class CoreHeartbeat:
    """Tells a hung engine core from one in a long step.

    The core's loop thread can legitimately spend many seconds in one step (a 20 s CPU step, a prefill of
    a long prompt on a loaded CPU, a grammar compile it waits on), so the loop's own progress says nothing
    about whether the process is alive. A separate thread of the core (`beat`) stamps `shared[0]` with
    time.monotonic() every HEARTBEAT_INTERVAL_S, and with it `shared[1]`, the last time the loop went
    around (`progress`, once per pass). That thread needs only to be scheduled and to get the GIL, which a
    long step hands over (torch's ops and the compilers release it; Python code yields it every few ms).
    So the beats stop only when the whole process stops: SIGSTOP, a frozen cgroup, or a call that holds
    the GIL for longer than the timeout (itself a hang). The loop's progress goes into the line for the
    diagnosis.

    `shared`: two doubles in shared memory (multiprocessing's RawArray), made by the launcher and handed to
    the core at spawn; CLOCK_MONOTONIC is one clock for every process of the machine."""

    def __init__(self, shared: Any):
        self.shared = shared
        self._progress = time.monotonic()
        # The watcher's side (`silence`): its last check, and when the core's timeout (re)started.
        self._last_check: float | None = None
        self._grace_from = 0.0

    # ---- in the engine core
    def progress(self) -> None:
        self._progress = time.monotonic()

    def start(self) -> None:
        threading.Thread(target=self._beat, name="pagoda-core-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            self.shared[1] = self._progress
            self.shared[0] = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL_S)

    # ---- in the launcher
    def silence(self, pid: int) -> str | None:
        """None while the core beats; the one line that says it is hung once it has not beaten for
        PAGODA_CORE_HEARTBEAT_TIMEOUT_S. Called every fraction of a second. A core that has never beaten
        (a stand-in core) is never hung."""
        now = time.monotonic()
        if self._last_check is None or now - self._last_check > WATCHER_STALL_S:
            self._grace_from = now
        self._last_check = now
        beat, progress = self.shared[0], self.shared[1]
        limit = envs.CORE_HEARTBEAT_TIMEOUT_S.value
        if not beat or now - max(beat, self._grace_from) <= limit:
            return None
        return (
            f"the engine core process (pid {pid}) is hung: no heartbeat for {now - beat:.1f} s "
            f"(PAGODA_CORE_HEARTBEAT_TIMEOUT_S={limit:g}; its engine loop last moved {now - progress:.1f} s ago)"
        )


# ---- the launcher's handle on the core ------------------------------------------------------------
class CoreProcess:
    """Start the engine core through `supervisor` for `api_count` API processes; `wait_ready`, then give
    API process i `clients[i]`. `target`: the core's entry point (benchmarks pass a fake core); it gets
    `run_engine_core`'s arguments. `loras`: the `--lora-modules` adapters, read by the core before it is ready."""

    def __init__(self, supervisor: Any, config: EngineConfig, api_count: int, target: Any = None, loras: tuple = ()):
        self.folder = tempfile.mkdtemp(prefix="pagoda-")
        self.input_address = f"ipc://{self.folder}/in"
        self.control_address = f"ipc://{self.folder}/control"
        self.client_addresses = [f"ipc://{self.folder}/out{i}" for i in range(api_count)]
        self.zmq = zmq.Context()
        self.control = self.zmq.socket(zmq.PULL)
        self.control.bind(self.control_address)
        self.ready: Ready | None = None
        self.died_message: str | None = None  # the traceback or line a failing core sent (CoreDied)
        self.heartbeat = CoreHeartbeat(supervisor.mp.RawArray("d", 2))
        self.hung: str | None = None  # the line, once the core was found hung (and killed)
        self.child = supervisor.start(
            "pagoda-engine-core",
            target or functools.partial(run_engine_core, loras=loras),
            (config, self.input_address, self.control_address, self.client_addresses, self.heartbeat.shared),
            death_signal=signal.SIGKILL,
            daemon=False,  # it starts the tensor-parallel rank processes
        )  # it ignores SIGTERM (see run_engine_core)

    @property
    def clients(self) -> list[CoreClient]:
        assert self.ready is not None, "wait_ready first"
        return [
            CoreClient(i, self.input_address, address, self.child.pid, self.ready)
            for i, address in enumerate(self.client_addresses)
        ]

    def wait_ready(self, stop: Any = None) -> Ready | None:
        """Until the core has loaded the model (Ready); ConfigError with its one line if it could not.
        `stop()` true (a stop signal meanwhile): None at once."""
        while not self.control.poll(500):
            if stop is not None and stop():
                return None
            if not self.child.alive:
                raise ConfigError(f"The engine process exited during startup (exit code {self.child.exitcode}).")
        first = self.control.recv_pyobj()
        if isinstance(first, StartupFailed):
            self.child.process.join(5)
            raise ConfigError(first.message)
        assert isinstance(first, Ready), first
        self.ready = first
        return first

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` s for messages from the core (CoreDied: kept in `died_message`), then check
        its heartbeat: a core that has gone silent is hung. Then every API process is told (so they answer
        503 with that line) and the core is killed, so the watch sees it gone (its ranks die with it)."""
        wait = int(timeout * 1000)
        while self.control.poll(wait):
            wait = 0
            message = self.control.recv_pyobj()
            if isinstance(message, CoreDied):
                self.died_message = message.message
        if self.ready is None or self.hung is not None or not self.child.alive:
            return
        line = self.heartbeat.silence(self.child.pid)
        if line is not None:
            self.hung = line
            self.tell_core_died(line)
            self.child.process.kill()

    def tell_core_died(self, reason: str) -> None:
        """Every API process marks its engine dead now (in-flight requests fail, /health answers 503),
        rather than waiting for its own watch of the core's pid."""
        for address in self.client_addresses:
            push = self.zmq.socket(zmq.PUSH)
            push.connect(address)
            try:
                push.send_pyobj(CoreDied(reason), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            push.close(linger=500)
        time.sleep(0.5)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Shutdown to the core, which stops after its current step; SIGKILL if it has not in `timeout` s."""
        if not self.child.alive:
            return
        push = self.zmq.socket(zmq.PUSH)
        push.connect(self.input_address)
        try:
            push.send_pyobj(Shutdown(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.child.process.join(timeout)
        if self.child.alive:
            self.child.process.kill()
            self.child.process.join(5)
        push.close(linger=0)

    def close(self) -> None:
        self.zmq.destroy(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- the core process (spawned by the launcher) ----------------------------------------------------
def run_engine_core(
    config: EngineConfig,
    input_address: str,
    control_address: str,
    client_addresses: list[str],
    heartbeat: Any = None,
    loras: tuple = (),
) -> None:
    """Process entry point. Binds the input pipe (every API process pushes into it), reports Ready /
    StartupFailed / CoreDied on the launcher's control pipe, and pushes each API process's outputs to
    `client_addresses[AddRequest.client_index]` (CoreDied to them too). `heartbeat`: the shared doubles
    of `CoreHeartbeat`, beaten from the time it is Ready. `loras`: LoRARequests read (and checked against
    the model) before Ready: a first request does not wait for its adapter's file (while the host cache holds
    it), and a bad adapter stops the start with one line."""
    from pagoda.engine.llm_engine import LLMEngine  # lazy: torch and the model code (only the core process loads them)
    from pagoda.worker.rank_worker import gpu_serving_threads, share_cpu_threads

    # Ctrl-C reaches the whole process group, and SIGTERM may reach the whole group or cgroup (`timeout`,
    # systemd): the launcher stops the API processes first (they drain), then this one (Shutdown, or
    # SIGKILL if it must; also SIGKILL if the launcher dies: `Supervisor.start(death_signal=...)`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(input_address)
    control = ctx.socket(zmq.PUSH)
    control.connect(control_address)
    clients = []
    for address in client_addresses:  # connected before the API processes bind: messages queue
        clients.append(ctx.socket(zmq.PUSH))
        clients[-1].connect(address)
    ready = False

    def on_fatal(line: str) -> None:
        """A tensor-parallel rank is gone or hung (called from the rank watch's or the driver's thread, just
        before this process exits with os._exit): say so on sockets of that thread's own (ZMQ sockets are not
        thread-safe), in a context of their own, whose end waits (up to a second) until the line has left:
        closing a socket does not, and os._exit would drop it."""
        message = CoreDied(line) if ready else StartupFailed(line)
        own = zmq.Context()
        for address in [control_address, *(client_addresses if ready else [])]:
            box = own.socket(zmq.PUSH)
            box.connect(address)
            box.send_pyobj(message)
            box.close(linger=1000)
        own.term()

    try:
        if envs.CORE_TRACE.value:
            TraceWindow.parse(envs.CORE_TRACE.value)  # a malformed window: one line now, not a crash when serving
        if config.parallel.world_size == 1:  # served, the core computes on every core it may use (or --cpu-threads)
            share_cpu_threads(config)
        # One engine core: this LLMEngine, whose runner drives the other tensor-parallel ranks, if any.
        engine = LLMEngine(config, on_fatal)
        _read_adapters(engine, loras)
        gpu_serving_threads(config)
    except PagodaError as exc:
        control.send_pyobj(StartupFailed(exc.message))
        return
    except Exception as exc:  # noqa: BLE001 - a bug or a broken environment: still say why in one line
        control.send_pyobj(StartupFailed(f"{type(exc).__name__}: {exc}"))
        return
    layout = engine.kv_layout
    prepare_gc_for_serving()  # no full GC pass over the startup heap mid-serving (a ~0.2 s stall)
    beat = CoreHeartbeat(heartbeat) if heartbeat is not None else None
    if beat is not None:
        beat.start()
    control.send_pyobj(
        Ready(layout.num_blocks - 1, layout.block_size, layout.max_concurrency(config.model.max_model_len))
    )
    ready = True
    try:
        with profiled(envs.CORE_PROFILE.value), traced(envs.CORE_TRACE.value) as step_traced:
            _loop(engine, inbox, clients, beat, step_traced)
    except Exception:
        died = CoreDied(traceback.format_exc(limit=8))
        for box in [control, *clients]:
            box.send_pyobj(died)
        raise
    finally:
        engine.shutdown()
        for box in [control, *clients]:
            box.close(linger=1000)
        inbox.close(linger=0)


@contextlib.contextmanager
def profiled(path: str | None):
    """The block under cProfile, its pstats written to `path` when it ends, however it ends (None: no profiler).
    `PAGODA_CORE_PROFILE` puts the serving loop under it: where the core's host time goes in a served run, for
    `python -m pstats PATH` (the steps' GPU work shows only as the host time spent launching it)."""
    if not path:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        try:
            profiler.dump_stats(path)
            logger.info("engine core profile written to %s", path)
        except OSError as exc:
            logger.warning("PAGODA_CORE_PROFILE: could not write %s: %s", path, exc)


def _read_adapters(engine, loras: tuple) -> None:
    if not loras or engine.config.lora is None:
        return
    for lora in loras:  # each one checked; the host cache keeps the last --max-cpu-loras of them
        try:
            engine.add_lora(lora)
        except PagodaError as exc:
            raise ConfigError(f"--lora-modules {lora.lora_name}: {exc.message}", "lora_modules") from None
    kept = engine.config.lora.max_cpu_loras
    later = ""
    if len(loras) > kept:
        later = f" (the host keeps {kept}: --max-cpu-loras; the others are read again when asked for)"
    logger.info("LoRA adapters read: %s%s", ", ".join(lora.lora_name for lora in loras), later)


def _receive(engine, inbox) -> list | None:
    """The messages that arrived since the last step, in order: blocks (1 s at a time) while the
    engine is idle, only drains while it has work. None: stop (a Shutdown)."""
    timeout = 0 if engine.has_unfinished_requests() else 1000
    messages = []
    while inbox.poll(timeout):
        timeout = 0
        message = inbox.recv_pyobj()
        if isinstance(message, Shutdown):
            return None
        messages.append(message)
    return messages


def _add(engine, message: AddRequest) -> str | None:
    """Queue the request; the refusal's message if the engine refuses it."""
    try:
        engine.add_request(
            message.request_id,
            message.prompt_token_ids,
            message.params,
            prompt=message.prompt,
            delta=message.delta,
            arrival_time=message.arrival_time,
            mm_inputs=message.mm_inputs,
            detokenize=message.detokenize,
            cache_salt=message.cache_salt,
            priority=message.priority,
            lora_request=message.lora_request,
        )
    except PagodaError as exc:
        return exc.message
    except Exception as exc:  # noqa: BLE001 - a bug reached by this request must not end the core
        logger.exception("Request %s could not be added", message.request_id)
        return f"Internal error while adding the request: {type(exc).__name__}."
    return None


def _add_lora(engine, message: AddLoRA) -> LoRAAdded:
    """Read the adapter; the answer says why not if it cannot be served (the core carries on either way)."""
    try:
        engine.add_lora(message.lora_request)
    except PagodaError as exc:
        return LoRAAdded(message.call_id, exc.message)
    except Exception as exc:  # noqa: BLE001 - a bug reached by this adapter must not end the core
        logger.exception("LoRA adapter %r could not be read", getattr(message.lora_request, "lora_name", None))
        return LoRAAdded(message.call_id, f"Internal error while reading the adapter: {type(exc).__name__}.")
    return LoRAAdded(message.call_id)


def _loop(
    engine, inbox, clients: list, heartbeat: CoreHeartbeat | None = None, step_traced: Callable[[], None] | None = None
) -> None:
    """Drain inputs → step → send outputs, until Shutdown. Each output goes to the API process that owns its
    request (`clients[index]`), the stats to every process whenever they change (the first process also
    counts the engine's running totals into its metrics, so they must reach it every time they move).
    Nothing is sent while nothing changes. The start and the end of each pass are the loop's progress for
    `heartbeat` (at least once a second while idle: `_receive` waits 1 s at a time). `step_traced` is called
    after each pass that ran an engine step (`core_trace.traced`)."""
    owners: dict[str, int] = {}  # live request id → index of the API process that sent it
    count = len(clients)
    last_stats: EngineStats | None = None
    busy = cpu = 0.0
    received, reported = [0] * count, [0] * count  # AddRequests per API process: taken, last reported
    long_step = envs.TEST_LONG_STEP_S.value
    while (messages := _receive(engine, inbox)) is not None:
        if heartbeat is not None:
            heartbeat.progress()
        started, started_cpu = time.perf_counter(), time.thread_time()
        outputs: list[RequestOutput] = []
        rejected: list[dict[str, str]] = [{} for _ in range(count)]
        for message in messages:
            if isinstance(message, AbortRequests):
                # Only the owner may abort: another process's request with the same (rejected) id
                # sends an abort from its cleanup too.
                ids = [rid for rid in message.request_ids if owners.get(rid) == message.client_index]
                if ids:
                    outputs += engine.abort_request(ids)
            elif isinstance(message, AddRequest):
                received[message.client_index] += 1
                refused = _add(engine, message)
                if refused is not None:
                    rejected[message.client_index][message.request_id] = refused
                else:
                    owners[message.request_id] = message.client_index
            elif isinstance(message, AddLoRA):
                clients[message.client_index].send_pyobj(_add_lora(engine, message))
            elif isinstance(message, RemoveLoRA):
                engine.release_lora(message.lora_int_id)
        if engine.has_unfinished_requests():
            if long_step > 0:
                _busy(long_step)
                long_step = 0.0
            outputs += engine.step()
            if step_traced is not None:
                step_traced()
            # A request whose grammar failed to compile is answered as invalid (400), not as an error output.
            for request_id, message in engine.take_rejected():
                owner = owners.pop(request_id, None)
                if owner is not None:
                    rejected[owner][request_id] = message
                outputs = [out for out in outputs if out.request_id != request_id]
        per_client: list[list[WireOutput]] = [[] for _ in range(count)]
        for out in outputs:
            owner = owners.pop(out.request_id, None) if out.finished else owners.get(out.request_id)
            if owner is not None:
                per_client[owner].append(wire_output(out))
        # Report outputs, and also any change of state without outputs (a prefill chunk, a request
        # admitted): the gauges stay current.
        stats = engine.stats()
        stats.busy_seconds, stats.cpu_seconds = busy, cpu
        changed = _totals_changed(stats, last_stats)
        for index, box in enumerate(clients):
            if per_client[index] or rejected[index] or changed or received[index] != reported[index]:
                box.send_pyobj(Outputs(per_client[index], stats, rejected[index], received[index]))
                reported[index] = received[index]
        last_stats = stats
        busy += time.perf_counter() - started
        cpu += time.thread_time() - started_cpu
        if heartbeat is not None:
            heartbeat.progress()


def _busy(seconds: float) -> None:
    """Keep this thread on the CPU for `seconds` (PAGODA_TEST_LONG_STEP_S): a step that is long but not hung."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _totals_changed(stats: EngineStats, last: EngineStats | None) -> bool:
    # num_steps: the core's clock totals (busy, device wait) move with every step and process 0 counts them.
    if last is None:
        return True
    return _changed(stats, last) or (
        stats.num_preemptions,
        stats.prefix_cache_queries,
        stats.prefix_cache_hits,
        stats.num_steps,
    ) != (last.num_preemptions, last.prefix_cache_queries, last.prefix_cache_hits, last.num_steps)


def _changed(stats: EngineStats, last: EngineStats | None) -> bool:
    if last is None:
        return True
    return (stats.num_running, stats.num_waiting, stats.kv_cache_usage) != (
        last.num_running,
        last.num_waiting,
        last.kv_cache_usage,
    )
