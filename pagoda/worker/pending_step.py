"""A launched step's sampled tokens, read when the caller needs them (`PendingStep.result`); a step whose
sampling itself waits until then (`DeferredStep`, pipeline micro-batches: `worker/pipeline_link.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.outputs import StepOutput, TokenLogprobs
from pagoda.worker.request_states import RunnerRequestState


class PendingStep:
    """A launched step's sampled tokens (and logprobs): device → pinned host copies queued right
    after sampling, an event after them. `result()` waits for that event only — not for a later
    step queued behind it — then appends the tokens to the request states, once."""

    def __init__(
        self,
        request_ids: list[str],
        states: list[RunnerRequestState],
        out=None,
        done: StepOutput | None = None,
        verified=None,
    ):
        """verified: a speculative step's `worker.spec_rows.Verified` (its rows' proposals that held)."""
        self.request_ids, self.states = request_ids, states
        self._output = done
        self._event = None
        self._verified = verified is not None
        if out is None:
            return
        cuda = out.sampled_token_ids.is_cuda
        tensors = (
            out.sampled_token_ids,
            out.sampled_logprobs,
            out.top_logprobs,
            out.top_token_ids,
            out.chosen_logprobs,
            None if verified is None else verified.tokens,
            None if verified is None else verified.counts,
            *(verified.logprobs if verified is not None and verified.logprobs is not None else (None, None, None)),
        )
        # non_blocking device→host copies land in pinned memory; plain CPU tensors pass through.
        self._host = [t.to("cpu", non_blocking=True) if t is not None and cuda else t for t in tensors]
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def speculative(self) -> bool:  # it verified proposals: the rows' kept ones are appended by `result()`
        return self._verified

    @property
    def done(self) -> bool:
        return self._output is not None

    def result(self) -> StepOutput:
        if self._output is not None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        tokens, sampled_lp, top_lp, top_ids, chosen_lp, verified, counts, *spec_lp = self._host
        sampled = tokens.tolist()
        result = StepOutput(dict(zip(self.request_ids, sampled)))
        if sampled_lp is not None:
            sampled_lp = sampled_lp.tolist()
            top_lp = top_lp.tolist() if top_lp is not None else None
            top_ids = top_ids.tolist() if top_ids is not None else None
            chosen_lp = chosen_lp.tolist() if chosen_lp is not None else None
            for row, (rid, s) in enumerate(zip(self.request_ids, self.states)):
                k = s.sampling_params.logprobs
                if k is None:
                    continue
                chosen = s.sampling_params.logprob_token_ids
                if chosen and chosen_lp is not None:  # the request's own tokens instead of the top k
                    top = list(zip(chosen, chosen_lp[row][: len(chosen)]))
                else:
                    top = list(zip(top_ids[row][:k], top_lp[row][:k])) if top_ids is not None and k else []
                result.logprobs[rid] = TokenLogprobs(sampled_lp[row], top)
        if self._verified:
            self._take_verified(result, verified.tolist(), counts.tolist(), spec_lp)
        for s, token in zip(self.states, sampled):
            s.token_ids.append(token)
            s.output_token_ids.append(token)
            s.num_pending -= 1
        self._output = result
        return result

    def _take_verified(self, result: StepOutput, tokens: list[list[int]], counts: list[int], logprobs: list) -> None:
        """Rows whose proposals held: those tokens (and their logprobs, for rows that asked) go before the row's
        own. (The computed count moves back over the rest with the scheduler's, which the next step's diff
        carries.)"""
        chosen, top_lp, top_ids = logprobs
        for row, (rid, s) in enumerate(zip(self.request_ids, self.states)):
            accepted = counts[row] - 1
            if accepted > 0:
                held = tokens[row][:accepted]
                s.token_ids.extend(held)
                s.output_token_ids.extend(held)
                result.accepted_token_ids[rid] = held
                k = s.sampling_params.logprobs
                if k is not None and chosen is not None:
                    lps, tops, ids = chosen[row].tolist(), top_lp[row].tolist(), top_ids[row].tolist()
                    result.accepted_logprobs[rid] = [
                        TokenLogprobs(lps[j], list(zip(ids[j][:k], tops[j][:k]))) for j in range(accepted)
                    ]


class DeferredStep:
    """A launched step whose sampling waits for `result()` (the micro-batch path). `read` runs the sampling
    (the driver's tensor-parallel runner replaces it: it posts `finish_step` to the ranks first, and a rank
    lost meanwhile is named by its watch)."""

    def __init__(self, sample: Callable[[], PendingStep]):
        self._sample = sample
        self._step: PendingStep | None = None
        self.read: Callable[[Callable[[], PendingStep]], PendingStep] = lambda sample: sample()

    def result(self) -> StepOutput:
        if self._step is None:
            self._step = self.read(self._sample)
        return self._step.result()


LaunchedStep = PendingStep | DeferredStep  # what `ModelRunner.launch` returns
NO_TOKENS = StepOutput({})  # a step that samples nothing
