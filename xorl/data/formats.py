"""Row formats (``data.format``): what a row holds and which of its tokens are trained on.

- ``text``: ``{text_key: str}`` (or a .txt document): every token is a target (pretraining).
- ``messages``: ``{"messages": [{"role", "content"}, ...]}``, rendered with the tokenizer's chat
  template (xorl/data/chat.py); ``data.train_on: assistant`` (default) trains on the assistant
  tokens only, ``all`` on every token.
- ``prompt_completion``: ``{"prompt": str, "completion": str}``: the prompt's tokens, then the
  completion's and the end-of-text token; the loss is on the completion (``train_on: all``: both).
- ``input_ids``: pre-tokenised ``{"input_ids": [int], "labels": [int]?}``; labels follow Hugging
  Face's convention (aligned with input_ids, -100 = not a target; absent: every token).

``auto`` (default) looks at the first row and names its choice in the log; every later row must
have the same shape (an error names its file and line otherwise). A row becomes a Document
(xorl/data/packing.py); one with no target token is counted and left out.
"""

from __future__ import annotations

from xorl.data.chat import ChatRenderer, check_messages
from xorl.data.corpus import DataError, TextDocument, _json_kind, text_of
from xorl.data.corpus import _text as _string
from xorl.data.packing import IGNORE_INDEX, DataCounts, Document, trains_on_something

FORMATS = ("text", "messages", "prompt_completion", "input_ids")
_KEYS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "input_ids": ("input_ids",)}


def detect_format(row, text_key: str) -> str | None:
    """The format a row's shape says, or None when it fits none."""
    if isinstance(row, TextDocument):
        return "text"
    if not isinstance(row, dict):
        return None
    for fmt, keys in _KEYS.items():
        if all(k in row for k in keys):
            return fmt
    return "text" if text_key in row else None


class RowEncoder:
    """Turns rows into Documents in one format (``auto``: the first row's)."""

    def __init__(self, data_config, tokenizer, counts: DataCounts | None = None, vocab_size: int | None = None):
        self.format = data_config.format
        self.text_key = data_config.text_key
        self.assistant_only = data_config.train_on == "assistant"
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size  # pre-tokenised ids may use the model's padded vocab
        self.tokenizer_name = data_config.tokenizer
        self.counts = counts if counts is not None else DataCounts()
        self.chosen_from: str | None = None  # the row auto-detection read (for the log)
        self._chat = None
        if self.format == "messages":
            self._chat = ChatRenderer(getattr(tokenizer, "hf", None), self.tokenizer_name)

    @property
    def supervised(self) -> bool:
        """Documents keep whole in packing (every format but text: xorl/data/packing.py)."""
        return self.format != "text"

    def resolve(self, row, where) -> str:
        """The format (auto: decided from this first row)."""
        if self.format == "auto":
            fmt = detect_format(row, self.text_key)
            if fmt is None:
                keys = sorted(row) if isinstance(row, dict) else _json_kind(row)
                raise DataError(
                    f"{where}: data.format auto cannot tell this row's format (keys: {keys}); rows need "
                    f"{self.text_key!r} (text, data.text_key), 'messages', 'prompt' + 'completion' or 'input_ids', "
                    f"or set data.format{_other_trainers_rows(row)}")
            self.format, self.chosen_from = fmt, str(where)
            if fmt == "messages":
                self._chat = ChatRenderer(getattr(self.tokenizer, "hf", None), self.tokenizer_name)
        return self.format

    def describe(self) -> str:
        """``messages (auto: the first row of data.jsonl:1)`` for the log."""
        how = f" (data.format auto, from the first row, {self.chosen_from})" if self.chosen_from else ""
        train_on = f", training on {'assistant tokens' if self.assistant_only else 'every token'}" \
            if self.format in ("messages", "prompt_completion") else ""
        return f"{self.format}{how}{train_on}"

    def encode(self, row, where) -> Document | None:
        """The row's Document, or None (counted) when it trains on no token."""
        fmt = self.resolve(row, where)
        self.counts.rows += 1
        doc = getattr(self, f"_{fmt}")(row, where)
        if not trains_on_something(doc):
            self.counts.untrained_rows += 1
            return None
        return doc

    def _need(self, row, where, keys: tuple[str, ...]) -> None:
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with {list(keys)} (data.format {self.format}), "
                            f"got a {_json_kind(row)}")
        missing = [k for k in keys if k not in row]
        if missing:
            how = " (detected from the first row)" if self.chosen_from else ""
            raise DataError(f"{where}: no key {missing[0]!r} (keys: {sorted(row)}); data.format is "
                            f"{self.format}{how}{_other_trainers_rows(row)}")

    def _text(self, row, where) -> Document:
        return self.tokenizer.encode(text_of(row, self.text_key, where)), None

    def _messages(self, row, where) -> Document:
        self._need(row, where, ("messages",))
        ids, mask = self._chat.encode(check_messages(row["messages"], where), where, self.assistant_only)
        if mask is None:
            return ids, None
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]

    def _prompt_completion(self, row, where) -> Document:
        self._need(row, where, ("prompt", "completion"))
        if isinstance(row["prompt"], list) and isinstance(row["completion"], list):  # TRL's conversational form
            return self._conversational(row, where)
        prompt = self.tokenizer.encode(_string(row["prompt"], f"{where}: 'prompt'"), add_eos=False)
        completion = self.tokenizer.encode(_string(row["completion"], f"{where}: 'completion'"), add_bos=False)
        ids = prompt + completion
        if not self.assistant_only:
            return ids, None
        return ids, [IGNORE_INDEX] * len(prompt) + completion

    def _conversational(self, row, where) -> Document:
        """``{"prompt": [messages], "completion": [messages]}``, rendered with the chat template; the loss on
        the completion (after the prompt's generation prompt), as TRL's conversational prompt-completion."""
        if self._chat is None:
            self._chat = ChatRenderer(getattr(self.tokenizer, "hf", None), self.tokenizer_name)
        prompt = check_messages(row["prompt"], where, "prompt")
        completion = check_messages(row["completion"], where, "completion")
        ids, mask = self._chat.encode_completion(prompt, completion, where, self.assistant_only)
        if mask is None:
            return ids, None
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]

    def _input_ids(self, row, where) -> Document:
        self._need(row, where, ("input_ids",))
        ids = _int_list(row["input_ids"], f"{where}: 'input_ids'")
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise DataError(f"{where}: 'input_ids' holds {bad}, outside the vocabulary's {vocab} tokens")
        labels = row.get("labels")
        if labels is None:
            return ids, None
        labels = _int_list(labels, f"{where}: 'labels'")
        if len(labels) != len(ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} entries and 'input_ids' {len(ids)}; they must "
                            "be aligned (Hugging Face's convention: -100 where a token is not a target)")
        return ids, labels


def _other_trainers_rows(row) -> str:
    """How to give xorl the row shapes other trainers read (axolotl's alpaca and ShareGPT types), which
    xorl does not guess: both would need a prompt wording or a role mapping xorl would make up."""
    if not isinstance(row, dict):
        return ""
    if "instruction" in row and "output" in row:
        return ("; these are alpaca rows (instruction / input / output): write each as 'prompt' (the "
                "instruction, and the input if any, in the prompt wording you want) + 'completion' (the output), "
                "or as 'messages' [{'role': 'user', ...}, {'role': 'assistant', ...}] for the chat template")
    if isinstance(row.get("conversations"), list):
        return ("; these are ShareGPT rows ('conversations' of {'from', 'value'}): write them as 'messages' of "
                "{'role', 'content'} ('human' -> 'user', 'gpt' -> 'assistant', 'system' stays)")
    return ""


def _int_list(value, where: str) -> list[int]:
    if hasattr(value, "tolist"):  # numpy / arrow arrays from parquet or datasets
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where} must be a list of integers")
    return value
