"""Chat templates sent in a request body (`chat_template`, allowed by `--trust-request-chat-template`).

Such a template is client code that runs in the server. It is rendered here, not by transformers:

  * in a jinja2 `ImmutableSandboxedEnvironment` (no private attributes, no mutation of the inputs),
    with the globals and filters chat templates use (raise_exception, strftime_now, namespace,
    tojson without HTML escaping, the `{% generation %}` tag), so it renders what transformers would;
  * with a budget: every loop iteration, call, filter and output value checks a wall-clock deadline
    (`TIME_LIMIT_S`); `range()` has at most `MAX_RANGE` items; neither the prompt nor any value the
    template builds may exceed `MAX_CHARS` characters, checked *before* the operations that multiply
    sizes (`*`, `+`, `~`, `%`, join, replace, indent, format, tojson, ...), so `"x" * 2**30` fails
    without allocating; integer arguments of filters and methods (widths, counts) are at most
    `MAX_INT_ARG`, integers at most `MAX_INT_BITS` bits;
  * in a small pool of worker threads, so the event loop (and /health) keeps running; a render that
    ran out of budget stops itself at its next check and the request gets a 400.

These bounds stop runaway templates (a loop that never ends, a gigabyte string); they do not make
the flag safe on a server open to hostile clients (a template can still spend its whole time and
a few hundred MB per render): keep it off there, as vLLM advises for its flag of the same name.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from pagoda.errors import InvalidRequest

TIME_LIMIT_S = 2.0
MAX_CHARS = 4 * 1024 * 1024  # ~1M tokens: more than any context window
MAX_RANGE = 100_000
MAX_INT_ARG = 1_000_000
MAX_INT_BITS = 100_000
MAX_TEMPLATE_CHARS = 64 * 1024  # the largest chat templates in use are ~20 KB; compiling 64 KiB takes ~1 s
MAX_QUADRATIC_WORK = 50_000_000  # element copies of sum() over lists
MAX_BUILT_CHARS = 16 * MAX_CHARS  # all strings a render builds, garbage included
WORKERS = 2

_FLAG = "--trust-request-chat-template"
_ITER_GUARD = "__pagoda_iter_guard"
_CONCAT_GUARD = "__pagoda_concat_guard"
_CONTINUE_MARK = "\x00pagoda-continue-final-message\x00"


class TemplateBudgetExceeded(InvalidRequest):
    """A request's chat template needed more time or memory than its budget."""

    def __init__(self, what: str):
        super().__init__(
            f"The request's chat_template was stopped: {what}. Simplify the template, or leave "
            "chat_template out of the request to use the model's.",
            "chat_template",
        )


# ---------------------------------------------------------------------------------------------
# The budget of the render running in this thread


class _Budget:
    __slots__ = ("deadline", "cancelled", "built")

    def __init__(self, deadline: float, cancelled: threading.Event | None):
        self.deadline = deadline
        self.cancelled = cancelled
        self.built = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(f"it ran longer than {TIME_LIMIT_S:g} s")
        if self.cancelled is not None and self.cancelled.is_set():
            raise TemplateBudgetExceeded("the request was already answered")

    def charge(self, value: Any) -> Any:
        """Count a string the template built: each one is within MAX_CHARS, but a loop could build
        many of them (kept in a list, say) faster than the deadline comes."""
        if isinstance(value, str):
            self.built += len(value)
            if self.built > MAX_BUILT_CHARS:
                raise TemplateBudgetExceeded(f"it built more than {MAX_BUILT_CHARS} characters of strings")
        return value


class _NoBudget(_Budget):
    """Outside a render (jinja folding constants while compiling elsewhere): nothing to count."""

    def tick(self) -> None:
        pass

    def charge(self, value: Any) -> Any:
        return value


_UNLIMITED = _NoBudget(float("inf"), None)
_local = threading.local()


def _budget() -> _Budget:
    return getattr(_local, "budget", None) or _UNLIMITED


def _measure(value: Any, limit: int = MAX_CHARS) -> int:
    """About how many characters `str(value)` has (shared sub-values counted each time they occur),
    walking no further than `limit`."""
    total = steps = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        steps += 1
        if not steps & 0xFFFF:
            _budget().tick()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += 2 + 2 * len(v)
            if total <= limit:
                stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, range):
            total += 8 * len(v)
        else:
            total += 8
    return total


def _check_size(value: Any, what: str = "a value") -> Any:
    size = _measure(value)
    if size > MAX_CHARS:
        raise TemplateBudgetExceeded(f"{what} would exceed {MAX_CHARS} characters")
    return value


# Filters whose integer arguments are sizes (a width, a count of slices, rounding digits): capped.
_SIZED_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "round", "format"})


def _check_args(args: tuple, kwargs: dict[str, Any], first_capped: int | None = None) -> None:
    """Every argument within MAX_CHARS; when `first_capped` is set, integers from that position on
    (widths, counts: not a filter's input value) within MAX_INT_ARG."""
    for i, arg in enumerate((*args, *kwargs.values())):
        if first_capped is not None and i >= first_capped and type(arg) is int and abs(arg) > MAX_INT_ARG:
            raise TemplateBudgetExceeded(f"an argument of {arg} is over the limit of {MAX_INT_ARG}")
        _check_size(arg, "an argument")


def _bounded_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise TemplateBudgetExceeded(f"range() of {len(rng)} items is over the limit of {MAX_RANGE}")
    return rng


_WIDTH = re.compile(r"\d+")


def _format_bound(fmt: str, args: Any) -> int:
    """An upper bound of the length of `fmt` formatted (str.format, % or the format filter): every
    field may be as wide as the largest number in the format string or among the arguments."""
    numbers = [int(d) if len(d) <= 12 else 10**13 for d in _WIDTH.findall(fmt)]
    values = args.values() if isinstance(args, dict) else args if isinstance(args, (list, tuple)) else (args,)
    numbers += [abs(a) for a in values if type(a) is int]
    fields = fmt.count("{") + fmt.count("%")
    return len(fmt) + _measure(args) + fields * max(numbers, default=0)


def _join_bound(separator: Any, items: list[Any]) -> int:
    return _measure(items) + _measure(separator) * max(len(items) - 1, 0)


def _replace_bound(text: str, old: Any, new: Any, count: Any = None) -> int:
    if not isinstance(text, str) or not isinstance(old, str):
        return _measure(text)
    hits = len(text) + 1 if old == "" else text.count(old)
    if type(count) is int and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * _measure(new)


# ---------------------------------------------------------------------------------------------
# Template globals and filters


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(Namespace):
    """`namespace()`, refusing underscore names (no path to the object's internals) and printing
    short (its repr would otherwise repeat every value it holds, unmeasured)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    def __repr__(self) -> str:
        return "<namespace>"

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with an underscore")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    width = indent if type(indent) is int else len(indent) if isinstance(indent, str) else 0
    if width:
        nodes_, depth = _shape(value)
        if _measure(value) + nodes_ * depth * (width + 1) > MAX_CHARS:
            raise TemplateBudgetExceeded(f"tojson(indent={indent!r}) would exceed {MAX_CHARS} characters")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _shape(value: Any) -> tuple[int, int]:
    """(number of containers and items, deepest nesting), walking at most MAX_CHARS nodes."""
    count, deepest = 0, 0
    stack = [(value, 1)]
    while stack and count <= MAX_CHARS:
        v, depth = stack.pop()
        count += 1
        if not count & 0xFFFF:
            _budget().tick()
        deepest = max(deepest, depth)
        if isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
    return count, deepest


def _guard_iter(iterable: Any) -> Any:
    """What a `{% for %}` loop iterates: the same items, one budget check each."""
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _guard_concat(values: list[Any]) -> str:
    """The `~` operator, with the result's size checked before it is built."""
    budget = _budget()
    budget.tick()
    total = sum(_measure(v) for v in values)
    if total > MAX_CHARS:
        raise TemplateBudgetExceeded(f"a string built with ~ would exceed {MAX_CHARS} characters")
    return budget.charge("".join(str(v) for v in values))


_PASSED = (jinja2.Environment, Context, EvalContext)


def _growth_check(name: str, value: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, tuple]:
    """Before a filter runs whose output can be far larger than its input: its bound, checked.
    Returns (value, args) to call it with (a join's or sum's items made a list, to count them)."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    bound = None
    if name == "join":  # join(value, d="", attribute=None)
        value = list(value)
        bound = _join_bound(arg(0, "d", ""), value)
    elif name == "replace" and len(args) >= 2:  # replace(s, old, new, count=None)
        bound = _replace_bound(value, args[0], args[1], arg(2, "count"))
    elif name == "indent":  # indent(s, width=4, first=False, blank=False)
        width = arg(0, "width", 4)
        prefix = len(width) if isinstance(width, str) else width if type(width) is int else 0
        text = value if isinstance(value, str) else str(value)
        bound = len(text) + (text.count("\n") + 1) * max(prefix, 0)
    elif name == "wordwrap":  # wordwrap(s, width=79, break_long_words=True, wrapstring=None, ...)
        bound = _measure(value) * (1 + _measure(arg(2, "wrapstring") or "\n"))
    elif name == "format":  # format(value, *args, **kwargs)
        bound = _format_bound(str(value), kwargs or args)
    elif name == "sum" and isinstance(arg(1, "start", 0), (list, tuple, str)):  # sum(iterable, attribute, start)
        value = list(value)
        bound = _measure(value) + _measure(arg(1, "start"))
        if bound * len(value) > MAX_QUADRATIC_WORK:
            raise TemplateBudgetExceeded("sum() over that many lists is too slow")
    if bound is not None and bound > MAX_CHARS:
        raise TemplateBudgetExceeded(f"the {name} filter would produce more than {MAX_CHARS} characters")
    return value, args


def _bounded_filter(name: str, fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        lead = 1 if args and isinstance(args[0], _PASSED) else 0  # the environment or context jinja passes
        _check_args(args, kwargs, lead + 1 if name in _SIZED_FILTERS else None)
        if len(args) > lead:
            value, rest = _growth_check(name, args[lead], args[lead + 1 :], kwargs)
            args = (*args[:lead], value, *rest)
        return budget.charge(_check_size(fn(*args, **kwargs), f"the result of {name}"))

    return bounded


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training): the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Guards(NodeTransformer):
    """Routes every loop's items and every `~` through the budget checks."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _ITER_GUARD, [], [], None, None, lineno=node.iter.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(
            nodes.List(node.nodes, lineno=node.lineno), _CONCAT_GUARD, [], [], None, None, lineno=node.lineno
        )


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag], finalize=self._finalize
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.filters[_ITER_GUARD] = _guard_iter
        self.filters[_CONCAT_GUARD] = _guard_concat
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs; no chat template needs it
        self.globals.update(
            range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace
        )

    @staticmethod
    def _finalize(value: Any) -> Any:
        _budget().tick()
        return _check_size(value, "an output value")

    def concat(self, pieces: Any) -> str:
        # Joins what a macro, a {% set %} block or a call block wrote: count it before joining.
        pieces = list(pieces)
        budget = _budget()
        budget.tick()
        if sum(len(p) for p in pieces) > MAX_CHARS:
            raise TemplateBudgetExceeded(f"a block's text would exceed {MAX_CHARS} characters")
        return budget.charge("".join(pieces))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.tick()
        # The integer arguments of str methods are widths and positions (center, zfill...): capped.
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        _check_args(args, kwargs, 0 if isinstance(owner, (str, bytes)) else None)
        if (
            getattr(getattr(__obj, "__wrapped__", __obj), "__name__", "") == "join"
            and args
            and not isinstance(args[0], (list, tuple, str, dict))
        ):
            args = (list(args[0]), *args[1:])  # str.join(generator): count the items first
        bound = _method_bound(__obj, args, kwargs)
        if bound is not None and bound > MAX_CHARS:
            raise TemplateBudgetExceeded(
                f"{getattr(__obj, '__name__', 'a call')}() would produce more than {MAX_CHARS} characters"
            )
        return budget.charge(_check_size(super().call(__context, __obj, *args, **kwargs), "a call's result"))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if operator == "*":
            _check_product(left, right)
        elif operator == "**":
            if (
                type(left) is int
                and type(right) is int
                and right > 0
                and abs(left) > 1
                and left.bit_length() * right > MAX_INT_BITS
            ):
                raise TemplateBudgetExceeded(f"{left} ** {right} is over {MAX_INT_BITS} bits")
        elif operator == "+":
            if (
                isinstance(left, (str, list, tuple))
                and isinstance(right, (str, list, tuple))
                and _measure(left) + _measure(right) > MAX_CHARS
            ):
                raise TemplateBudgetExceeded(f"a + would build a value of more than {MAX_CHARS} characters")
        elif operator == "%" and isinstance(left, str):
            if _format_bound(left, right) > MAX_CHARS:
                raise TemplateBudgetExceeded(f"%-formatting would produce more than {MAX_CHARS} characters")
        return budget.charge(_check_size(super().call_binop(context, operator, left, right), "a value"))


def _check_product(left: Any, right: Any) -> None:
    if type(left) is int and type(right) is int:
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBudgetExceeded(f"a product over {MAX_INT_BITS} bits")
        return
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and type(times) is int:
            if times > 0 and _measure(seq) * times > MAX_CHARS:
                raise TemplateBudgetExceeded(f"repeating a value {times} times would exceed {MAX_CHARS} characters")


def _method_bound(obj: Any, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """For the str methods whose result can be far larger than the string: an upper bound of it."""
    wrapped = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format / format_map
    owner, name = getattr(wrapped, "__self__", None), getattr(wrapped, "__name__", "")
    if not isinstance(owner, str):
        return None
    if name == "join" and args and isinstance(args[0], (list, tuple, str, dict)):
        return _join_bound(owner, list(args[0]))
    if name == "replace" and len(args) >= 2:
        return _replace_bound(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"))
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(owner) + owner.count("\t") * (size if type(size) is int else 8)
    if name in ("format", "format_map"):
        return _format_bound(owner, args[0] if name == "format_map" and args else kwargs or args)
    return None


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedEnvironment:
    return _BoundedEnvironment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = _environment()
    tree = _Guards().visit(env.parse(source))
    return env.from_string(tree)


# ---------------------------------------------------------------------------------------------
# Rendering


def _plain(value: Any) -> Any:
    """The template's view of the inputs: JSON-like types only (anything else becomes a short
    placeholder), so no object with methods of its own reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidRequest("Each message must be an object.", "messages")
        message = {k: v for k, v in message.items() if v is not None}
        # Templates read a message's reasoning under either name.
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {
                "thinking": reasoning,
                **message,
                "reasoning_content": message.get("reasoning_content", reasoning),
            }
        out.append(message)
    return out


def _mark_final_message(messages: list[dict[str, Any]]) -> None:
    """continue_final_message: a mark after the final message's text, where the prompt is cut."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_MARK
        return
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] += _CONTINUE_MARK
                return
    raise InvalidRequest("continue_final_message needs a final message with text to continue.", "messages")


def _render_job(
    source: str,
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    cancelled: threading.Event,
) -> str:
    _local.budget = budget = _Budget(time.monotonic() + TIME_LIMIT_S, cancelled)
    try:
        budget.tick()  # a job that waited in the queue past its request's answer stops here
        template = _compile(source)
        chat = _messages_for_template(_plain(messages))
        if continue_final_message:
            _mark_final_message(chat)
        context = {**_plain(variables), "messages": chat, "add_generation_prompt": add_generation_prompt}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > MAX_CHARS:
                raise TemplateBudgetExceeded(f"the prompt would exceed {MAX_CHARS} characters")
            pieces.append(piece)
        text = "".join(pieces)
    except InvalidRequest:
        raise
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InvalidRequest(
            f"The request's chat_template has a syntax error (line {exc.lineno}): {exc.message}", "chat_template"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a template's errors (RecursionError, MemoryError...) are the request's
        detail = str(exc)
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        raise InvalidRequest(
            f"Could not render the request's chat_template: {type(exc).__name__}: {detail}", "chat_template"
        ) from None
    finally:
        _local.budget = None
    if continue_final_message:
        cut = text.rfind(_CONTINUE_MARK)
        if cut < 0:
            raise InvalidRequest(
                "continue_final_message: the request's chat_template does not write the final "
                "message's text as it is, so there is no place to continue it.",
                "messages",
            )
        text = text[:cut]
    return text


_pool_lock = threading.Lock()
_pool_instance: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    # Its own threads: renders that run out their time cannot hold up the default executor's work.
    global _pool_instance
    with _pool_lock:
        if _pool_instance is None:
            _pool_instance = ThreadPoolExecutor(WORKERS, thread_name_prefix="pagoda-request-template")
        return _pool_instance


async def render_request_template(
    source: str,
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
) -> str:
    """The prompt a request's own chat template renders, off the event loop and within budget.
    `variables` are the template variables besides messages (special tokens, chat_template_kwargs)."""
    if not isinstance(source, str) or not source.strip():
        raise InvalidRequest("chat_template must be a non-empty string.", "chat_template")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise InvalidRequest(
            f"The request's chat_template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS} are accepted.",
            "chat_template",
        )
    cancelled = threading.Event()
    loop = asyncio.get_running_loop()
    job = loop.run_in_executor(
        _pool(), _render_job, source, messages, variables, add_generation_prompt, continue_final_message, cancelled
    )
    try:
        # The job stops itself TIME_LIMIT_S after it starts; this also bounds a wait in the queue.
        return await asyncio.wait_for(job, timeout=2 * TIME_LIMIT_S + 1)
    except asyncio.TimeoutError:
        raise TemplateBudgetExceeded(
            f"it did not finish within {2 * TIME_LIMIT_S + 1:g} s (the server's template workers are busy)"
        ) from None
    finally:
        cancelled.set()


def refused_message() -> str:
    return (
        f"This request carries a chat_template, but the server runs without {_FLAG}: only the server's "
        "own template is used. Leave chat_template out, or start the server with the flag."
    )
