"""Sampled tokens → user-facing `RequestOutput`s: detokenization, stop strings, logprobs, n > 1.

A user request with n samples becomes n engine requests ("<id>#<i>"); this module folds their
results back into one `RequestOutput` whose `outputs[i]` is sample i. Stop strings are found here
(they need text), and the engine is told to finish those requests through `finish_fn`.

Two output kinds: final-only (offline `LLM`: one cumulative output when every sample is done) and
delta (serving: every step that advanced a request yields only what is new — text delta, new
token ids and their logprobs — for the samples that advanced).

An exception while processing one request's token (its logprobs, text, stop strings, output) is
caught per request: that request is left out of the step's outputs and reported (`take_failures`);
the engine ends it with an error (`fail`), and every other request is processed as if it were not there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pagoda.frontend.detokenizer import IncrementalDetokenizer, single_token_decoder
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from pagoda.request import Request, RequestStatus


@dataclass(eq=False)
class _Sample:
    parent: _Parent
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    output: CompletionOutput | None = None  # set once finished
    num_emitted_tokens: int = 0  # delta mode: tokens already sent to the caller
    num_emitted_logprobs: int = 0
    advanced: bool = False  # got a token (or finished) in the call being processed
    request: Request | None = None  # the engine request, while `advanced`


@dataclass(eq=False)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_samples: int
    delta: bool  # emit what is new every step, not one final output
    samples: list[_Sample] = field(default_factory=list)
    num_cached_tokens: int = 0
    queue_time: float | None = None


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self._token_text = single_token_decoder(tokenizer) if tokenizer is not None else None
        self._samples: dict[str, _Sample] = {}
        self._parents: dict[str, _Parent] = {}
        self.failures: list[tuple[str, Request, Exception]] = []  # see take_failures

    def add_request(
        self, parent_id: str, prompt: str | None, children: list[Request], delta: bool, detokenize: bool = True
    ) -> None:
        """detokenize=False: the caller decodes the token ids itself (outputs carry empty text); stop
        strings still need the text here, so a request with any is detokenized regardless."""
        parent = _Parent(parent_id, prompt, children[0].prompt_token_ids, len(children), delta)
        for index, child in enumerate(children):
            params = child.sampling_params
            detok = None
            if self.tokenizer is not None and (detokenize or params.stop):
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    child.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=cast(list[str], params.stop),  # a list after SamplingParams.__post_init__
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            wants_logprobs = params.logprobs is not None
            sample = _Sample(parent, index, detok, [] if wants_logprobs else None, 0.0 if wants_logprobs else None)
            parent.samples.append(sample)
            self._samples[child.request_id] = sample
        self._parents[parent_id] = parent

    def has_request(self, parent_id: str) -> bool:
        return parent_id in self._parents

    def process(
        self,
        updated: list[Request],
        logprobs: dict[str, TokenLogprobs],
        finish_fn: Callable[[str, RequestStatus, str], None],
        accepted_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[RequestOutput]:
        """Handle the requests that got a token this step; returns outputs to hand to callers.

        O(requests updated): runs every step for every decoding request, so the common case
        (n = 1) is a straight line with no per-step dicts or searches."""
        samples = self._samples
        outputs: list[Any] = []  # RequestOutputs, and a parent with n > 1 where its output goes
        multi = False
        num_failures = len(self.failures)
        for request in updated:
            sample = samples.get(request.request_id)
            if sample is None:
                continue
            try:  # free unless it raises; inline, not a call per request (every step, every request)
                token = request.output_token_ids[-1]
                n = request.num_new_tokens  # 1 but after verified speculative proposals
                if n != 1:
                    request.num_new_tokens = 1
                first = len(request.output_token_ids) - n  # this step's tokens start here
                detok = sample.detokenizer
                if detok is not None:
                    stop = detok.update_one(token) if n == 1 else _update_tokens(detok, request, n)
                    if stop is not None:
                        if request.status.is_finished:  # e.g. hit max_tokens on the same token
                            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                        else:
                            finish_fn(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
                if sample.logprobs is not None:
                    lp = logprobs.get(request.request_id)
                    earlier = accepted_logprobs.get(request.request_id) if accepted_logprobs else None
                    if lp is not None and earlier is None:
                        self._append_logprobs(sample, token, lp)
                    elif lp is not None and earlier is not None:  # verified proposals, then the row's own
                        for new, entry in zip(request.output_token_ids[first:], [*earlier, lp]):  # as many as kept
                            self._append_logprobs(sample, new, entry)
                if request.status.is_finished:
                    self._finish_sample(sample, request)
                parent = sample.parent
                if parent.num_samples == 1:
                    if parent.delta:
                        outputs.append(self._single_delta_output(parent, sample, request))
                    elif sample.output is not None:
                        outputs.append(self._final_output(parent))
                    continue
                if not any(s.advanced for s in parent.samples):
                    outputs.append(parent)
                    multi = True
                sample.advanced = True
                sample.request = request
            except Exception as exc:  # noqa: BLE001 - this request fails (the engine calls `fail`), others go on
                self.failures.append((sample.parent.request_id, request, exc))
        if len(self.failures) > num_failures:
            failed = {parent_id for parent_id, _, _ in self.failures[num_failures:]}
            for out in outputs:
                if isinstance(out, _Parent) and out.request_id in failed:
                    for s in out.samples:
                        s.advanced, s.request = False, None
            outputs = [out for out in outputs if out.request_id not in failed]
        if multi:
            outputs = [self._fold(out) if isinstance(out, _Parent) else out for out in outputs]
            outputs = [out for out in outputs if out is not None]
        return outputs

    def take_failures(self) -> list[tuple[str, Request, Exception]]:
        """(user request id, the engine request, exception) of each request whose output processing
        raised since the last call; the engine ends them with `fail`."""
        failures, self.failures = self.failures, []
        return failures

    def parent_of(self, request_id: str) -> str | None:
        """The user request an unfinished engine request (a sample) belongs to."""
        sample = self._samples.get(request_id)
        return None if sample is None else sample.parent.request_id

    def fail(self, parent_id: str, message: str, requests: dict[str, Request]) -> RequestOutput:
        """End a user request whose processing raised: its final output, every sample not already
        reported ending with finish_reason "error" and `message` as its stop_reason (the API turns
        that into an error response). `requests`: the engine requests of its samples, where known
        (for their tokens). Its state here is dropped whatever it was."""
        parent = self._parents.pop(parent_id, None)
        if parent is None:  # it raised while emitting its last output: still end it
            return RequestOutput(parent_id, None, [], [CompletionOutput(0, "", [], None, None, "error", message)], True)
        outputs = []
        for sample in parent.samples:
            self._samples.pop(child_request_id(parent_id, sample.index, parent.num_samples), None)
            sample.advanced, sample.request = False, None
            if sample.output is not None and not parent.delta:
                outputs.append(sample.output)
                continue
            request = requests.get(child_request_id(parent_id, sample.index, parent.num_samples))
            tokens = (
                list(request.output_token_ids[sample.num_emitted_tokens if parent.delta else 0 :])
                if request is not None
                else []
            )
            outputs.append(
                CompletionOutput(sample.index, "", tokens, sample.cumulative_logprob, None, "error", message)
            )
        return RequestOutput(
            parent_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            True,
            parent.num_cached_tokens,
            parent.queue_time,
        )

    def _fold(self, parent: _Parent) -> RequestOutput | None:
        """The output of a parent with n > 1 whose samples advanced in this call (flags cleared)."""
        out = self._delta_output(parent) if parent.delta else self._final_output(parent)
        for s in parent.samples:
            s.advanced, s.request = False, None
        return out

    def finish_aborted(self, requests: list[Request]) -> list[RequestOutput]:
        touched: dict[str, _Parent] = {}
        for request in requests:
            sample = self._samples.get(request.request_id)
            if sample is not None and sample.output is None:
                self._finish_sample(sample, request)
                touched[sample.parent.request_id] = sample.parent
                sample.advanced = True
                sample.request = request
        outputs = [self._fold(parent) for parent in touched.values()]
        return [out for out in outputs if out is not None]

    def child_ids(self, parent_id: str) -> list[str]:
        """Engine request ids of a user request's samples that are not finished yet."""
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        return [child_request_id(parent_id, s.index, parent.num_samples) for s in parent.samples if s.output is None]

    def _append_logprobs(self, sample: _Sample, token: int, lp: TokenLogprobs) -> None:
        entry: dict[int, Logprob] = {}
        ranks = {tid: rank for rank, (tid, _) in enumerate(lp.top, start=1)}
        entry[token] = Logprob(lp.sampled_logprob, ranks.get(token), self._decode_one(token))
        for tid, value in lp.top:
            if tid not in entry:
                entry[tid] = Logprob(value, ranks[tid], self._decode_one(tid))
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        sample.logprobs.append(entry)
        sample.cumulative_logprob += lp.sampled_logprob

    def _decode_one(self, token: int) -> str | None:
        return None if self._token_text is None else self._token_text(token)

    def _finish_sample(self, sample: _Sample, request: Request) -> None:
        if sample.detokenizer is not None and sample.detokenizer.stop_str is None:
            sample.detokenizer.finish()
        sample.output = self._completion(sample, request)
        del self._samples[request.request_id]
        parent = sample.parent
        parent.num_cached_tokens = max(parent.num_cached_tokens, request.num_cached_tokens)
        if request.first_scheduled_time is not None:
            waited = request.first_scheduled_time - request.arrival_time
            parent.queue_time = waited if parent.queue_time is None else max(parent.queue_time, waited)

    def _completion(self, sample: _Sample, request: Request) -> CompletionOutput:
        text = sample.detokenizer.output_text if sample.detokenizer is not None else ""
        return CompletionOutput(
            sample.index,
            text,
            list(request.output_token_ids),
            sample.cumulative_logprob,
            sample.logprobs,
            request.status.finish_reason,
            request.stop_reason,
        )

    def _final_output(self, parent: _Parent) -> RequestOutput | None:
        if not all(s.output is not None for s in parent.samples):
            return None
        del self._parents[parent.request_id]
        outputs = [s.output for s in parent.samples if s.output is not None]
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            True,
            parent.num_cached_tokens,
            parent.queue_time,
        )

    def _single_delta_output(self, parent: _Parent, sample: _Sample, request: Request) -> RequestOutput:
        """`_delta_output` of a parent with one sample, without the search over samples."""
        new_tokens = request.output_token_ids[sample.num_emitted_tokens :]
        sample.num_emitted_tokens = len(request.output_token_ids)
        new_logprobs = None
        if sample.logprobs is not None:
            new_logprobs = sample.logprobs[sample.num_emitted_logprobs :]
            sample.num_emitted_logprobs = len(sample.logprobs)
        text = sample.detokenizer.get_delta() if sample.detokenizer is not None else ""
        reason = request.status.finish_reason
        done = sample.output is not None
        if done:
            del self._parents[parent.request_id]
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            [
                CompletionOutput(
                    sample.index, text, new_tokens, sample.cumulative_logprob, new_logprobs, reason, request.stop_reason
                )
            ],
            done,
            parent.num_cached_tokens,
            parent.queue_time if done else None,
        )

    def _delta_output(self, parent: _Parent) -> RequestOutput:
        """What is new for the samples flagged `advanced`, in sample order."""
        outputs = []
        for sample in parent.samples:
            if not sample.advanced:
                continue
            request = sample.request
            assert request is not None  # set while `advanced`
            new_tokens = request.output_token_ids[sample.num_emitted_tokens :]
            sample.num_emitted_tokens = request.num_output_tokens
            new_logprobs = None
            if sample.logprobs is not None:
                new_logprobs = sample.logprobs[sample.num_emitted_logprobs :]
                sample.num_emitted_logprobs = len(sample.logprobs)
            text = sample.detokenizer.get_delta() if sample.detokenizer is not None else ""
            outputs.append(
                CompletionOutput(
                    sample.index,
                    text,
                    new_tokens,
                    sample.cumulative_logprob,
                    new_logprobs,
                    request.status.finish_reason,
                    request.stop_reason,
                )
            )
        done = all(s.output is not None for s in parent.samples)
        if done:
            del self._parents[parent.request_id]
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            done,
            parent.num_cached_tokens,
            parent.queue_time if done else None,
        )


def _update_tokens(detok: Any, request: Request, n: int) -> str | None:
    """The last `n` tokens of the request, appended in one step (verified proposals), fed one by one; on a
    stop string the tokens after the one that completed it are dropped from the request."""
    output = request.output_token_ids
    first = len(output) - n
    for i, token in enumerate(output[first:]):
        stop = detok.update_one(token)
        if stop is not None:
            del output[first + i + 1 :]
            return stop
    return None
