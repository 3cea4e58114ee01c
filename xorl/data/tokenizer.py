"""Tokenizers: a byte-level default that needs nothing, and a local Hugging Face tokenizer.json."""

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

    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < self.num_bytes).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local `tokenizer.json` (the `tokenizers` library); no hub access."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as err:  # pragma: no cover - tokenizers ships with transformers
            raise ImportError("data.tokenizer=<path> needs `tokenizers`: pip install tokenizers") from err
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"data.tokenizer: no tokenizer.json at {path!r}")
        self._tok = Tokenizer.from_file(file)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self._special(["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"])
        self.pad_id = self._special(["<pad>", "<|pad|>", "[PAD]"], default=self.eos_id)

    def _special(self, names: list[str], default: int | None = None) -> int:
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        if default is not None:
            return default
        raise ValueError(f"tokenizer has none of the end-of-text tokens {names}; add one to tokenizer.json")

    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def build_tokenizer(spec: str):
    """`"byte"` (default) or a path to a local tokenizer.json / a folder holding one."""
    if spec in ("byte", "", None):
        return ByteTokenizer()
    return HFTokenizer(spec)
