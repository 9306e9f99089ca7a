"""A Hugging Face fast tokenizer rebuilt from the vocabulary a GGUF file keeps in its metadata.

A GGUF has no `tokenizer.json`: llama.cpp stores the tokens, their types and scores, the merges and the
special token ids under `tokenizer.ggml.*`. We assemble the tokenizer those describe with the `tokenizers`
library, so that it gives the same ids as transformers' own GGUF loader for the same file.
"""

from __future__ import annotations

import logging

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.text.errors import ModelLoadError
from services.text.gguf_metadata import required, value

log = logging.getLogger(__name__)

_SPM_SPACE = "\u2581"  # SentencePiece writes a space as this visible character

# How byte-level vocabularies cut text into words before merging, by `tokenizer.ggml.pre`: the regexes
# llama.cpp applies, in order, each one cutting the pieces the one before left.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_BY_DIGIT = (r"\p{N}", _GPT2_SPLIT)
_SPLITS = {
    "gpt-2": (_GPT2_SPLIT,),
    "default": (_GPT2_SPLIT,),
    "smollm": _DIGIT_BY_DIGIT,
    "starcoder": _DIGIT_BY_DIGIT,
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
# An unknown pre type falls back to GPT-2's split (llama.cpp would refuse the file): the merges still apply,
# but words may be cut where the model's own tokenizer would not, so ids can drift on digits and whitespace.
_FALLBACK_SPLIT = (_GPT2_SPLIT,)

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(reader: gguf.GGUFReader) -> PreTrainedTokenizerFast:
    """The tokenizer the file describes, with its special tokens, BOS/EOS policy and chat template."""
    kind = value(reader, "tokenizer.ggml.model")
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise ModelLoadError(f"cannot build a tokenizer for GGUF vocabulary {kind!r}; supported: {sorted(_BUILDERS)}")
    tokens = required(reader, "tokenizer.ggml.tokens")
    backend = builder(reader, tokens)
    _match_whole(backend, tokens, value(reader, "tokenizer.ggml.token_type", []))
    special = {name: tokens[token_id] for name, key in _SPECIAL_TOKEN_KEYS.items()
               if (token_id := value(reader, key)) is not None}
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise, and to nothing else.
    add_bos = value(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=value(reader, "tokenizer.chat_template"),
        add_bos_token=bool(add_bos) and "bos_token" in special,
        add_eos_token=bool(value(reader, "tokenizer.ggml.add_eos_token", False)) and "eos_token" in special,
        **special,
    )


def _byte_level(reader: gguf.GGUFReader, tokens: list[str]) -> Tokenizer:
    """GPT-2 style BPE: tokens are spelled in the byte-to-unicode alphabet and the file lists the merges."""
    # "a b": tokens spell a space as "Ġ", so the one real space is the separator (llama.cpp cuts there too)
    merges = [tuple(merge.split(" ", 1)) for merge in required(reader, "tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    pre = value(reader, "tokenizer.ggml.pre", "default")
    splits = _SPLITS.get(pre)
    if splits is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting words as GPT-2 does", pre)
        splits = _FALLBACK_SPLIT
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        # the regexes already cut the words: ByteLevel only respells their bytes
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(reader: gguf.GGUFReader, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE: "▁" for spaces, `<0xNN>` tokens for bytes no token covers, and no merges in the file."""
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = value(reader, "tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE(
        vocab,
        _merges_by_score(tokens, required(reader, "tokenizer.ggml.scores")),
        unk_token=None if unk_id is None else tokens[unk_id],
        fuse_unk=True,
        byte_fallback=True,
    ))
    prefix = bool(value(reader, "tokenizer.ggml.add_space_prefix", True))
    # As transformers does: only the start of the text gets the prefix space, not text after a special token
    # (llama.cpp prefixes both), and not a text already starting with a space (sentencepiece and llama.cpp do).
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's encoding, which repeatedly joins the adjacent pair that makes
    the best-scoring token: every way to cut a token into two tokens, ranked by that token's score."""
    known = set(tokens)
    ranked = [
        (-score, token[:cut], token[cut:])
        for token, score in zip(tokens, scores, strict=True)
        for cut in range(1, len(token))
        if token[:cut] in known and token[cut:] in known
    ]
    ranked.sort(key=lambda merge: merge[0])  # stable: ties keep vocabulary order
    return [(left, right) for _, left, right in ranked]


def _match_whole(backend: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens (`<|im_start|>`) and user-defined ones (`<think>`) are found whole in the text, as
    llama.cpp does, instead of being cut into pieces; only control tokens are special (dropped on decode)."""
    control, user_defined = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False) if kind == control
    ])
    backend.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False) if kind == user_defined
    ])


_BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}
