"""Structured output: grammars that constrain generation (JSON schema, regex, choice, EBNF), through
xgrammar.

`grammars` turns a request's `StructuredOutputsParams` into an xgrammar `Grammar` (tokenizer-free, so
the API process checks a request with it before anything reaches the engine); `vocabulary` describes a
tokenizer's tokens as bytes for the grammar engine; `manager.GrammarManager` (engine core) compiles
grammars off the engine loop, keeps one matcher per constrained sequence, and fills the token bitmasks
the sampler applies.
"""
