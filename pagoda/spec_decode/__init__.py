"""Speculative decoding: propose several next tokens cheaply, verify them in one forward pass of the model.

Pieces, each usable and tested on its own:
- `config.py`: `SpeculativeConfig`, parsed from vLLM's `--speculative-config` JSON (same keys), refusing the
  methods and keys not implemented in one line naming what is.
- `ngram.py`: prompt lookup — the longest suffix of a request's tokens (prompt + output) seen earlier in
  them proposes the tokens that followed it there. No model, no state beyond the tokens.
- `suffix.py`: suffix decoding — the continuation most occurrences of the longest matching suffix agree on,
  in the request's own tokens or in finished requests' outputs (a bigram-indexed store, oldest evicted).
- `rejection.py`: verification. Greedy rows keep the proposals up to the first that differs from the
  model's argmax, then the model's token; sampled rows use the standard rejection scheme (accept a proposal
  x with probability min(1, p(x) / q(x)), else draw from the normalised max(p - q, 0)), so the output
  distribution is exactly the model's. Proposers without a distribution (n-gram, suffix) count as q = one-hot.

A draft model (`engine/speculation.py: DraftModelProposer`) runs as an engine of its own and answers each
request's known tokens with its greedy continuation. Where EAGLE/MTP heads would plug in: a proposer run by
the worker after a step's sampling on the hidden states it already holds, its proposals returned with the
step's tokens into `Request.spec_token_ids`; the scheduler schedules 1 + k tokens for a row with k proposals
and the runner verifies them with `rejection.py` (passing the head's probabilities as `draft_probs`).
"""
