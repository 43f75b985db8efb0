"""A tokenizer's vocabulary as the grammar engine sees it: the bytes each token id stands for.

Fast (tokenizers-backed) tokenizers go through xgrammar's own reader, which tells byte-level BPE
(Qwen2, Llama 3, SmolLM2) from byte-fallback SentencePiece. Yuan2's slow SentencePiece tokenizer is
read here: pieces with "▁" for a space and "<0xNN>" byte pieces (byte fallback), its `<n>` piece as a
line break (it decodes to one: `yuan_tokenizer.newline_token_as_text`), and every special token as
empty, which xgrammar never allows inside a grammar (a special token would vanish from the text the
client sees, so the text would no longer match the grammar). EOS ids end the grammar.
"""

from __future__ import annotations

from typing import Any


def grammar_tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """xgrammar `TokenizerInfo` over `vocab_size` ids (the logits' width: ids past the tokenizer's
    own are never allowed)."""
    import xgrammar as xgr  # lazy: the grammar engine
    from transformers import PreTrainedTokenizerFast  # lazy: transformers

    stop = sorted(eos_token_ids)
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or ())
    newline = tokenizer.convert_tokens_to_ids("<n>") if getattr(tokenizer, "newline_token_as_text", False) else None
    encoded = []
    for token_id, piece in enumerate(pieces):
        if token_id == newline:
            encoded.append("\n")
        elif token_id in special or piece is None:
            encoded.append("")
        else:
            encoded.append(piece)
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.BYTE_FALLBACK, vocab_size=vocab_size, stop_token_ids=stop, add_prefix_space=True
    )
