"""Tokenizers: a byte-level default that needs nothing, and a local Hugging Face tokenizer.

A model folder (tokenizer_config.json and / or tokenizer.json beside config.json) loads through
transformers' AutoTokenizer from the local files; its end-of-text token is the one the folder names
(tokenizer_config.json's eos_token, else config.json's eos_token_id). With ``model.model_path`` set
and ``data.tokenizer`` unset, the model folder is the tokenizer (xorl/config/model_path.py).
"""

from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; special tokens follow. Needs no files and no download."""

    num_bytes = 256

    def __init__(self) -> None:
        self.bos_id = 256
        self.eos_id = 257
        self.pad_id = 258
        self.vocab_size = 259

    bos_ids: list[int] = []  # a document is its bytes and the end-of-text token, nothing before them

    def encode(self, text: str, add_eos: bool = True, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < self.num_bytes).decode("utf-8", errors="replace")

    hf = None  # no transformers tokenizer: no chat template


class HFTokenizer:
    """A local Hugging Face tokenizer: a folder (AutoTokenizer, local files only) or a bare
    tokenizer.json (the ``tokenizers`` library); no hub access."""

    def __init__(self, path: str) -> None:
        self.path = path
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self._tok = None
            self.vocab_size = len(self._hf)
            eos = self._hf.eos_token_id
        else:
            try:
                from tokenizers import Tokenizer
            except ImportError as err:  # pragma: no cover - tokenizers ships with transformers
                raise ImportError("data.tokenizer=<path> needs `tokenizers`: pip install tokenizers") from err
            file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
            if not os.path.isfile(file):
                raise FileNotFoundError(f"data.tokenizer: no tokenizer.json at {path!r}")
            self._hf = None
            self._tok = Tokenizer.from_file(file)
            self.vocab_size = self._tok.get_vocab_size()
            eos = None
        config_ids = _config_token_ids(folder)
        if eos is None:
            eos = config_ids.get("eos_token_id")
        if eos is None and self._tok is not None:
            # A bare tokenizer.json names no end-of-text token; the common spellings are the only clue.
            eos = self._special(["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"])
        if eos is None:
            raise ValueError(f"tokenizer {path!r} names no end-of-text token: set eos_token in tokenizer_config.json "
                             "or eos_token_id in config.json")
        self.eos_id = int(eos)
        pad = self._hf.pad_token_id if self._hf is not None else None
        if pad is None:
            pad = config_ids.get("pad_token_id")
        self.pad_id = self.eos_id if pad is None else int(pad)
        self.bos_ids = self._leading_specials()

    def _raw(self, text: str, special: bool) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=special))
        return self._tok.encode(text, add_special_tokens=special).ids

    def _leading_specials(self) -> list[int]:
        """The tokens the tokenizer itself puts before a text (Llama 3's <|begin_of_text|>, Mistral's <s>;
        none for Qwen): a document starts with them, as ``tokenizer(text)`` and so inference start it.
        Read from the tokenizer's own post-processing of a probe text, not from a list of names."""
        plain, full = self._raw("a", False), self._raw("a", True)
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start]
        return []

    @property
    def hf(self):
        """The transformers tokenizer (chat template, offsets), or None for a bare tokenizer.json."""
        return self._hf

    def _special(self, names: list[str]) -> int | None:
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def encode(self, text: str, add_eos: bool = True, add_bos: bool = True) -> list[int]:
        """A document's ids: the tokenizer's leading special tokens (``add_bos``; not twice when the text
        already starts with them, e.g. a pre-rendered chat), the text's, then end-of-text (``add_eos``).
        A completion that continues a prompt passes add_bos=False."""
        ids = self._raw(text, False)
        bos = self.bos_ids if add_bos and ids[:len(self.bos_ids)] != self.bos_ids else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids))
        return self._tok.decode(list(ids))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab {self.vocab_size}, eos {self.eos_id})"


def _config_token_ids(folder: str) -> dict:
    """eos / pad_token_id from ``folder``'s config.json (a list of eos ids: the first)."""
    import json

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    ids = {}
    for key in ("eos_token_id", "pad_token_id"):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            ids[key] = value
    return ids


def has_tokenizer(folder: str) -> bool:
    """Whether a model folder ships its tokenizer."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def build_tokenizer(spec: str):
    """`"byte"` (default) or a path to a local tokenizer.json / a model folder holding its tokenizer."""
    if spec in ("byte", "", None):
        return ByteTokenizer()
    return HFTokenizer(spec)
