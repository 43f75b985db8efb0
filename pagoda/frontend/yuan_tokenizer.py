"""Yuan2.0 tokenizer and chat format (docs/models.md, Yuan2: chat format).

Yuan2.0 ships a SentencePiece BPE model (134,953 pieces, byte fallback, dummy prefix) that the
official code loads as a *slow* ``LlamaTokenizer`` in legacy mode with no BOS/EOS added,
``eos_token='<eod>'`` and 15 extra tokens registered as special. We reproduce that tokenizer on
top of transformers' ``SentencePieceBackend`` (the encoding is done by the ``sentencepiece``
library itself, so ids are exactly the SentencePiece ones, including its tie-breaking between the
~58k equal-score pieces, which a converted ``tokenizers`` BPE cannot guarantee) and re-implement
the legacy Llama decoding rules (transformers 4.34–4.36), which the golden fixtures were made with:

  * the first piece of a decoded run loses its leading ``▁`` (SentencePiece dummy prefix);
  * a special token that is a SentencePiece piece (``<eod>``, ``<sep>``, ...) is pasted in
    verbatim, preceded by one space unless it is the first token or follows another special;
  * a special token appended after the SentencePiece vocabulary (``<mask>``, ``<predict>``,
    ``<FIM_*>``) splits the text into parts joined with a space
    (``spaces_between_special_tokens=True``, the default) or with nothing.

`frontend/tokenizer.py` loads this tokenizer for every `model_type: "yuan"` checkpoint (no code from
the checkpoint runs), with ``newline_token_as_text``: the chat models emit the ``<n>`` piece (77186)
for a line break, which the official servers turn into "\n"; so does our decoding then.
"""

from __future__ import annotations

import json
import os
from typing import Any, cast, overload

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

# Chat format of the Yuan2 chat checkpoints (e.g. Yuan2-2B-Janus-hf), with the ``<sep>`` token
# written out rather than taken from ``sep_token``: system -> content.strip() + "\n";
# user/assistant -> content.strip() + ("<sep>" if last message else the literal text "<n>").
# There is no role marker and no generation prompt beyond the trailing <sep>.
YUAN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'].strip() + '\\n' }}"
    "{% elif message['role'] == 'user' or message['role'] == 'assistant' %}"
    "{{ message['content'].strip() + ('<sep>' if loop.last else '<n>') }}"
    "{% endif %}"
    "{% endfor %}"
)

# Registered as special with add_tokens(..., special_tokens=True), in the official order: the
# ones not in the SentencePiece vocabulary (<mask> <predict> <FIM_*>) get ids 134953-134957.
YUAN_EXTRA_SPECIAL_TOKENS = (
    "<sep>",
    "<pad>",
    "<mask>",
    "<predict>",
    "<FIM_SUFFIX>",
    "<FIM_PREFIX>",
    "<FIM_MIDDLE>",
    "<commit_before>",
    "<commit_msg>",
    "<commit_after>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<empty_output>",
)

YUAN_EOD_TOKEN = "<eod>"
YUAN_EOD_TOKEN_ID = 77185
# The model may emit the "<n>" piece (77186) for a newline; the official servers map it to "\n".
YUAN_NEWLINE_TOKEN = "<n>"

_SPIECE_UNDERLINE = "\u2581"
_NEWLINE_BYTE_PIECE = "<0x0A>"


class YuanTokenizer(SentencePieceBackend):
    """Slow (SentencePiece-library) tokenizer matching the official Yuan2 configuration."""

    model_input_names: list[str] = ["input_ids", "attention_mask"]
    # Decode the <n> piece as a line break (serving); False keeps the reference tokenizer's "<n>".
    newline_token_as_text: bool = False

    # -- no BOS / EOS is ever added ------------------------------------------------------------

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        return list(token_ids_0) + (list(token_ids_1) if token_ids_1 is not None else [])

    def get_special_tokens_mask(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None, already_has_special_tokens: bool = False
    ) -> list[int]:
        if already_has_special_tokens:
            special = set(self.all_special_ids)
            return [1 if t in special else 0 for t in token_ids_0 + (token_ids_1 or [])]
        return [0] * (len(token_ids_0) + len(token_ids_1 or []))

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return 0

    def get_vocab(self) -> dict[str, int]:
        """The base class's vocabulary (each id's token as `convert_ids_to_tokens` gives it, then the added tokens),
        with the SentencePiece pieces read in one call and kept: transformers asks for the whole vocabulary three
        times while the tokenizer loads, and 135k pieces one by one through Python took most of its load time."""
        pieces = self.__dict__.get("_pagoda_pieces")
        if pieces is None:
            pieces = self.sp_model.id_to_piece(list(range(self.sp_model.get_piece_size())))
            self.__dict__["_pagoda_pieces"] = pieces
        added = self._added_tokens_decoder
        vocab = {(added[i].content if i in added else piece): i for i, piece in enumerate(pieces)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    # -- legacy LlamaTokenizer decoding ----------------------------------------------------------

    def _decode_tables(self) -> tuple[frozenset[int], frozenset[str], frozenset[str]]:
        """(special ids, special tokens, added tokens past the SentencePiece vocabulary).

        transformers rebuilds `all_special_tokens` on every access and decode asked for it
        twice per call: with a window decoded twice per generated token that was most of a
        serving step's host time at 256 streams. Cached, and rebuilt whenever the added-token
        table changes size (adding special tokens adds them there too)."""
        key = len(self._added_tokens_decoder)
        cached = self.__dict__.get("_pagoda_decode_tables")
        if cached is None or cached[0] != key:
            base = self.sp_model.get_piece_size()
            cached = (
                key,
                frozenset(self.all_special_ids),
                frozenset(self.all_special_tokens),
                frozenset(tok for tok, idx in self._added_tokens_encoder.items() if idx >= base),
            )
            self.__dict__["_pagoda_decode_tables"] = cached
        return cached[1], cached[2], cached[3]

    def fast_decode(
        self, token_ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True
    ) -> str:
        """`decode(token_ids, ...)` without transformers' layers, for the detokenizer's short windows.

        A window of ordinary SentencePiece pieces (no special or added token: the common case) goes
        straight to sentencepiece the way `_decode` ends up sending it: the first piece's "▁" stripped
        (legacy decoding), <n> as the line-break byte piece when serving. Anything else takes `decode`.
        `tests/unit/test_yuan_tokenizer.py` checks the two agree on random windows."""
        _, special_tokens, _ = self._decode_tables()
        added = self._added_tokens_decoder
        base = self.sp_model.get_piece_size()
        to_piece = self.sp_model.IdToPiece
        pieces = []
        for i in token_ids:
            piece = to_piece(i) if 0 <= i < base and i not in added else None
            if piece is None or piece in special_tokens:
                return cast(
                    str,
                    self.decode(
                        token_ids,
                        skip_special_tokens=skip_special_tokens,
                        spaces_between_special_tokens=spaces_between_special_tokens,
                    ),
                )
            if piece == YUAN_NEWLINE_TOKEN and self.newline_token_as_text:
                piece = _NEWLINE_BYTE_PIECE
            pieces.append(piece)
        if not pieces:
            return ""
        if pieces[0].startswith(_SPIECE_UNDERLINE):
            pieces[0] = pieces[0][1:]
        return self.sp_model.decode(pieces)

    @overload
    def convert_ids_to_tokens(self, ids: int, skip_special_tokens: bool = False) -> str: ...

    @overload
    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]: ...

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return super().convert_ids_to_tokens(ids, skip_special_tokens)
        skip = self._decode_tables()[0] if skip_special_tokens else frozenset()
        added = self._added_tokens_decoder
        return [
            added[i].content if i in added else self._convert_id_to_token(i) for i in map(int, ids) if i not in skip
        ]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        tokens = list(tokens)
        if tokens[0].startswith(_SPIECE_UNDERLINE):
            tokens[0] = tokens[0][1:]
        special = self._decode_tables()[1]
        out: list[str] = []
        run: list[str] = []
        prev_is_special = False
        for i, token in enumerate(tokens):
            if token in special:
                if not prev_is_special and i != 0:
                    out.append(" ")
                out.append(self.sp_model.decode(run))
                out.append(token)
                run = []
                prev_is_special = True
            else:
                run.append(token)
                prev_is_special = False
        out.append(self.sp_model.decode(run))
        return "".join(out)

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        spaces_between_special_tokens: bool = True,
        **kwargs: Any,
    ) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        tokens = self.convert_ids_to_tokens(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.newline_token_as_text:
            # The byte-fallback piece for "\n" decodes to a line break through SentencePiece itself.
            tokens = [_NEWLINE_BYTE_PIECE if t == YUAN_NEWLINE_TOKEN else t for t in tokens]
        # Added tokens beyond the SentencePiece vocabulary are never given to sentencepiece.
        appended = self._decode_tables()[2]
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in appended:
                if run:
                    text = self.convert_tokens_to_string(run)
                    if text:
                        parts.append(text)
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self.convert_tokens_to_string(run))
        text = (" " if spaces_between_special_tokens else "").join(parts)
        if clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text


def _find_model_file(folder_or_model_file: str) -> tuple[str, str | None]:
    """(path of tokenizer.model, folder holding it or None)."""
    if os.path.isdir(folder_or_model_file):
        path = os.path.join(folder_or_model_file, "tokenizer.model")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder_or_model_file!r} has no tokenizer.model")
        return path, folder_or_model_file
    if os.path.isfile(folder_or_model_file):
        return folder_or_model_file, None
    raise FileNotFoundError(f"No Yuan tokenizer at {folder_or_model_file!r}")


def _folder_chat_template(folder: str | None) -> str | None:
    """A non-empty chat template shipped in the folder (chat_template.jinja or tokenizer_config)."""
    if folder is None:
        return None
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            text = f.read()
        if text.strip():
            return text
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                value = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
            value = named.get("default") or next(iter(named.values()), None)
        if isinstance(value, str) and value.strip():
            return value
    return None


def load_yuan_tokenizer(
    folder_or_model_file: str | os.PathLike[str], newline_token_as_text: bool = False
) -> YuanTokenizer:
    """The Yuan2 tokenizer from a folder holding tokenizer.model, or from the file itself.

    Ignores the folder's BOS/EOS settings (the official code always overrides them): no BOS or
    EOS is added, eos is ``<eod>`` (77185), and the 15 extra tokens are special (len 134,958).
    Uses the folder's chat template when it has one, else ``YUAN_CHAT_TEMPLATE``.
    ``newline_token_as_text`` decodes the ``<n>`` piece (77186) as "\n", as the official servers do.
    """
    model_file, folder = _find_model_file(os.fspath(folder_or_model_file))
    tokenizer = YuanTokenizer(
        vocab_file=model_file,
        bos_token="<s>",
        eos_token=YUAN_EOD_TOKEN,
        unk_token="<unk>",
        pad_token=None,
        add_bos_token=False,
        add_eos_token=False,
        legacy=True,
        clean_up_tokenization_spaces=False,
        model_max_length=int(1e30),
    )
    tokenizer.add_tokens(list(YUAN_EXTRA_SPECIAL_TOKENS), special_tokens=True)
    # HF chat templates of the Yuan checkpoints refer to `sep_token`.
    tokenizer.sep_token = "<sep>"
    tokenizer.chat_template = _folder_chat_template(folder) or YUAN_CHAT_TEMPLATE
    tokenizer.newline_token_as_text = newline_token_as_text
    return tokenizer
