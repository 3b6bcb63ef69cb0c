"""Tokenizers for the CLI: the byte-level fallback (UTF-8 bytes are ids 0..255)."""

from __future__ import annotations


class ByteTokenizer:
    """Text <-> UTF-8 byte ids. Ids >= 256 (not bytes) decode as `<id>`."""

    name = "byte-level fallback"

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"the byte-level tokenizer needs a vocabulary of >= 256 ids, model has {vocab_size}")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= int(i) < 256:
                pending.append(int(i))
            else:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
                out.append(f"<{int(i)}>")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)
