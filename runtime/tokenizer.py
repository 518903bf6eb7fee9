"""Tokenizer and chat template from an engine folder: `tokenizers` + jinja2, no transformers
(the template rendered as transformers renders it: runtime/chat_template.py)."""

from __future__ import annotations

import functools
import json
import re
import secrets
from pathlib import Path

from jinja2 import TemplateError
from tokenizers import Tokenizer as HFTokenizer

from trt_spec.runtime import chat_template as templates
from trt_spec.runtime.manifest import contained


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (the inverse of bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class Tokenizer:
    def __init__(self, folder: str | Path, template_file: str | Path | None = None):
        """template_file: a --chat-template file, in place of the folder's template."""
        folder = Path(folder)
        # an engine folder reads only its own files (no symlink out: runtime/manifest.py)
        self._tok = HFTokenizer.from_file(str(contained(folder, "tokenizer.json", str(folder))))
        cfg_path = contained(folder, "tokenizer_config.json", str(folder))
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        # a tokenizer with named templates ([{"name", "template"}]): each by its name, and
        # chat_template the default (`template_text` picks as transformers does)
        self.named_templates: dict[str, str] = {}
        if isinstance(self.chat_template, list):
            self.named_templates = {t["name"]: t["template"] for t in self.chat_template
                                    if isinstance(t, dict) and "name" in t}
            self.chat_template = templates.named_template(self.named_templates, None)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.unk_token = _token_text(cfg.get("unk_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._templates: dict[str, object] = {}  # template text -> compiled
        self._max_token_bytes: int | None = None
        self._special: frozenset[int] | None = None
        self._kept: frozenset[int] = frozenset()  # special tokens decoded all the same
        # special tokens written in user text (a prompt string, a message's content) are read
        # as plain text, never as control tokens (RuntimeConfig.escape_special_tokens; a
        # chat template's own special tokens stay special: encode_chat)
        self.escape_special = False
        if template_file is not None:
            self.use_template_file(template_file)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its own from)."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a
        character), special tokens included: OpenAI's logprobs `bytes`."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self._tok.decoder).__name__ == "ByteLevel":
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @property
    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids (what decoding skips: <|im_end|>, <eos>, ...)."""
        if self._special is None:
            self._special = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items()
                                      if t.special)
        return self._special

    def piece(self, token_id: int) -> str | None:
        """The token as the vocabulary spells it (byte-level: "Ġthe"), as transformers'
        convert_ids_to_tokens; None for an id outside it."""
        return self._tok.id_to_token(token_id)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes any one token stands for: a prompt of b bytes has at least
        b / max_token_bytes tokens (the server refuses a huge prompt before tokenizing it)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(1, max(len(self.token_bytes(i))
                                               for i in range(self.vocab_size)))
        return self._max_token_bytes

    @property
    def normalizes(self) -> bool:
        """A normalizer may shrink text (then the bound above does not hold)."""
        return self._tok.normalizer is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True,
               escape: bool | None = None) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long prompt tokenized on a
        # server thread does not stall the event loop or the scheduler
        return self.encode_batch([text], add_special_tokens, escape)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True,
                     escape: bool | None = None) -> list[list[int]]:
        """The ids of each text, tokenized in parallel. escape: special tokens written in the
        texts are read as plain text (None: as self.escape_special says; text a chat
        template rendered passes False)."""
        tok = self._plain if (self.escape_special if escape is None else escape) else self._tok
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    @functools.cached_property
    def _plain(self) -> HFTokenizer:
        """A copy of the tokenizer that splits a special token's text like any other text (its
        own, not a flag flipped on the shared one: encodes run on several threads)."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (no special tokens added) and each token's [start, end) characters."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def marker_ids(self, tokens) -> dict[str, int]:
        """{text: id} of those of `tokens` that are special tokens of this tokenizer."""
        ids = {t: self._tok.token_to_id(t) for t in tokens}
        return {t: i for t, i in ids.items() if i is not None and i in self.special_ids}

    def keep_special(self, tokens) -> None:
        """These special tokens (by their text) stay in decoded text even where special tokens
        are skipped: the markers a model's tool calls start with ([TOOL_CALLS],
        <|python_tag|>), which the call parser reads."""
        self._kept = frozenset(self.marker_ids(tokens).values())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._kept:  # the special tokens but the kept ones
            special = self.special_ids
            ids = [i for i in ids if i not in special or i in self._kept]
            return self._tok.decode(ids, skip_special_tokens=False)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set, as transformers gives them to a template."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in named.items() if v is not None}

    def use_template_file(self, path: str | Path) -> None:
        """--chat-template: the file's template in place of the folder's (ValueError quoting
        the path where it cannot be read or does not compile)."""
        self.chat_template = templates.read_template_file(path)
        self.named_templates = {}

    def template_text(self, tools=None) -> str | None:
        """The template to render: the tokenizer's, or of its named ones the one
        transformers picks ("tool_use" with tools, else "default")."""
        if self.named_templates:
            return templates.named_template(self.named_templates, tools)
        return self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables) -> str:
        """The chat as text, as transformers' apply_chat_template(tokenize=False) renders it
        (runtime/chat_template.py). variables: more of the template's variables (tools,
        enable_thinking, ...). continue_final_message: the text ends with the last
        message's content, left open (templates.open_final_message)."""
        text = self.template_text(variables.get("tools"))
        if not text:
            raise ValueError("this model's tokenizer has no chat template; pass a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} is {m!r}: expected {{'role': ..., 'content': ...}}")
        if text not in self._templates:
            self._templates[text] = templates.compile_template(text)
        try:
            rendered = templates.render(self._templates[text], messages, add_generation_prompt,
                                        self.special_tokens(), variables)
            return templates.open_final_message(rendered, messages) \
                if continue_final_message else rendered
        except templates.Refused as e:  # raise_exception's, saying why
            raise ValueError(f"chat template: {e}") from None
        except (TemplateError, TypeError, LookupError, AttributeError, ArithmeticError,
                RecursionError, ValueError) as e:
            # what the template does with the request's messages, tools and variables is
            # the request's: the template cannot render them (the caller's 400)
            raise ValueError(f"the chat template cannot render this request: "
                             f"{type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **variables) -> list[int]:
        """As transformers' apply_chat_template(tokenize=True): the template writes the special
        tokens itself, so none are added. With escape_special, each message's content is read
        as plain text (`escaped_chat`)."""
        if self.escape_special and any(isinstance(m.get("content"), str) and m["content"]
                                       for m in messages):
            return self.escaped_chat(messages, add_generation_prompt, variables)
        return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                    **variables),
                           add_special_tokens=False, escape=False)

    def escaped_chat(self, messages: list[dict], add_generation_prompt: bool,
                     variables: dict) -> list[int]:
        """The chat rendered with a unique mark in place of each message's content; the
        template's text between the marks is tokenized as it is (its special tokens stay
        special), each content with special tokens as plain text. A template that rewrites
        content (drops a message's, splits it, shows it twice) leaves a mark missing or
        repeated: that chat cannot be escaped, and a ValueError says so."""
        nonce = secrets.token_hex(8)
        marks = {}  # mark -> the content it stands for
        shown = []
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str) and m["content"]:
                mark = f"\ue000{nonce}.{i}\ue001"
                marks[mark] = m["content"]
                m = {**m, "content": mark}
            if m.get("reasoning_content"):  # plain text too, where the template shows it
                mark = f"\ue000{nonce}.r{i}\ue001"
                marks[mark] = m["reasoning_content"]
                m = {**m, "reasoning_content": mark}
            shown.append(m)
        text = self.apply_chat_template(shown, add_generation_prompt, **variables)
        pieces = re.split(f"(\ue000{nonce}\\.r?\\d+\ue001)", text)
        found = pieces[1::2]
        # every content shown once; a reasoning at most once (a template may drop it)
        shown_once = [k for k in marks if ".r" not in k] + \
            [k for k in set(found) if ".r" in k]
        if sorted(found) != sorted(shown_once):
            raise ValueError("this model's chat template rewrites message content (it drops, "
                             "splits or repeats it), so special tokens written in it cannot "
                             "be read as plain text (--escape-special-tokens); send the "
                             "request to a server without that option")
        ids = []
        for j, piece in enumerate(pieces):
            if piece:
                ids += self.encode(marks[piece] if j % 2 else piece, add_special_tokens=False,
                                   escape=bool(j % 2))
        return ids
