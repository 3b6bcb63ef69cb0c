"""Tokenizers for the CLI: Kimi's tiktoken BPE from a checkpoint directory, else the byte-level fallback (UTF-8 bytes are ids 0..255)."""

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


TIKTOKEN_FILE = "tiktoken.model"  # Kimi's BPE ranks file in the Hugging Face checkpoint directory
# Kimi's pre-tokenisation pattern (tokenization_kimi.py of the Kimi checkpoints).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256


class TiktokenTokenizer:
    """Kimi's tiktoken BPE (`tiktoken.model` in the checkpoint directory; needs PyPI `tiktoken`).

    Special tokens follow the base vocabulary: names from tokenizer_config.json's
    `added_tokens_decoder` when present, `<|reserved_token_i|>` otherwise. Ids it does not hold
    decode as `<id>`, as in ByteTokenizer.
    """

    name = "tiktoken (Kimi)"

    def __init__(self, model_file: str, vocab_size: int, tokenizer_config: dict | None = None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(model_file)
        named = {int(i): t["content"] for i, t in ((tokenizer_config or {}).get("added_tokens_decoder") or {}).items()}
        base = len(ranks)
        if base > vocab_size:
            raise ValueError(f"{model_file}: tokenizer has {base} BPE ids but the model's vocabulary is {vocab_size}")
        # K3: 163584 BPE ids + 256 special = 163840 = vocab_size; smaller vocabularies keep what fits.
        n_special = min(NUM_RESERVED_SPECIAL, vocab_size - base)
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + n_special)}
        self.encoding = tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=special)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        """Ids the encoding does not hold (past its specials, below the model's vocabulary) decode as `<id>`."""
        out, run = [], []
        for i in map(int, ids):
            if 0 <= i < self.encoding.n_vocab:
                run.append(i)
            else:
                out += [self.encoding.decode(run), f"<{i}>"]
                run = []
        return "".join(out) + self.encoding.decode(run)


def tokenizer_for(checkpoint_dir: str | None, vocab_size: int):
    """Kimi's tiktoken tokenizer when the checkpoint directory has `tiktoken.model` (and PyPI
    tiktoken is installed), else the byte-level fallback."""
    import json
    import logging
    import os
    if checkpoint_dir and os.path.isfile(os.path.join(checkpoint_dir, TIKTOKEN_FILE)):
        try:
            import tiktoken  # noqa: F401
        except ImportError:
            logging.getLogger("k3jax").warning("%s has %s but tiktoken is not installed (pip install "
                                               "'k3jax[tokenizer]'); using the byte-level fallback",
                                               checkpoint_dir, TIKTOKEN_FILE)
            return ByteTokenizer(vocab_size)
        config_path = os.path.join(checkpoint_dir, "tokenizer_config.json")
        config = None
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        return TiktokenTokenizer(os.path.join(checkpoint_dir, TIKTOKEN_FILE), vocab_size, config)
    return ByteTokenizer(vocab_size)
