"""A `tokenizers.Tokenizer` rebuilt from GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys): a
GGUF file has no tokenizer.json, and this lets a .gguf checkpoint tokenize without transformers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

__all__ = ["GGUFTokenizer", "tokenizer_from_metadata"]

_KEY = "tokenizer.ggml."

# llama.cpp's token types (gguf.TokenType): NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4,
# UNUSED 5, BYTE 6.
_CONTROL, _USER_DEFINED = 3, 4

# The split regexes of the models' own tokenizer.json files, which llama.cpp re-implements per
# `tokenizer.ggml.pre` (llama-vocab.cpp) and transformers repeats in its GGUF integration.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # ByteLevel with use_regex=True applies GPT-2's own split regex.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder: every digit on its own first (llama.cpp's "\p{N}"), then GPT-2's regex.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return build


def _family(names: str, build: Callable[[], pre_tokenizers.PreTokenizer]) -> dict:
    return dict.fromkeys(names.split(), build)


# `tokenizer.ggml.pre` -> the pre-tokenizer of a byte-level ("gpt2") vocabulary. "default" (also
# what a missing key means) is GPT-2's regex, as transformers reads it; llama.cpp's own
# "default" is a guess it warns about.
BYTE_LEVEL_PRE: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **_family("default gpt-2 phi-2 mpt olmo", _gpt2_pre),
    **_family("smollm starcoder refact codeshell", _digits_then_gpt2_pre),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 dbrx smaug-bpe",
              _split_pre(_LLAMA3_SPLIT)),
    **_family("qwen2 deepseek-r1-qwen kormo megrez", _split_pre(_QWEN2_SPLIT)),
    **_family("qwen35", _split_pre(_QWEN35_SPLIT)),
    **_family("tekken", _split_pre(_TEKKEN_SPLIT)),
    **_family("gpt-4o llama4", _split_pre(_GPT4O_SPLIT)),
}
# Names whose vocabulary looks a whole word up before merging it (llama.cpp's ignore_merges; Llama
# 3's tokenizer.json says "ignore_merges": true). For the same names llama.cpp adds BOS when the
# file does not say (as it does for every "llama" vocabulary).
IGNORE_MERGES = frozenset(
    "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 tekken".split())
_BOS_BY_DEFAULT = IGNORE_MERGES

_MODELS = ("gpt2", "llama")


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer: "tokenizers.Tokenizer"
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    add_bos_token: bool


def tokenizer_from_metadata(metadata: Mapping[str, Any], source: str) -> GGUFTokenizer | None:
    """None when the metadata has no tokenizer (no tokenizer.ggml.model).

    `metadata` maps GGUF keys to plain Python values (`{k: f.contents() for k, f in
    gguf.GGUFReader(path).fields.items()}`); `source` names the file in error messages.
    Raises ValueError for a tokenizer model or pre-tokenizer this does not know, or a missing key.
    """
    model = metadata.get(_KEY + "model")
    if model is None:
        return None
    tokens = _strings(_required(metadata, _KEY + "tokens", source))
    if model == "gpt2":
        tokenizer, vocab = _byte_level_bpe(metadata, tokens, source)
        add_bos_default = _pre_name(metadata) in _BOS_BY_DEFAULT
    elif model == "llama":
        tokenizer, vocab = _sentencepiece_bpe(metadata, tokens, source)
        add_bos_default = True
    else:
        raise ValueError(f"{source}: {_KEY}model={model!r} is not supported; supported: "
                         f"{', '.join(_MODELS)}")

    ids = {name: _token_id(metadata, name, len(tokens), source)
           for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")}
    _add_special_tokens(tokenizer, metadata, tokens, vocab, ids.values(),
                        byte_level=model == "gpt2", source=source)

    bos, eos = ids["bos_token_id"], ids["eos_token_id"]
    add_bos = bool(metadata.get(_KEY + "add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(metadata.get(_KEY + "add_eos_token", False)) and eos is not None
    tokenizer.post_processor = _post_processor(tokens, bos if add_bos else None,
                                               eos if add_eos else None)
    return GGUFTokenizer(tokenizer=tokenizer, bos_token_id=bos, eos_token_id=eos,
                         chat_template=metadata.get("tokenizer.chat_template"),
                         add_bos_token=add_bos)


# --- byte-level BPE ("gpt2") ----------------------------------------------------------------------


def _pre_name(metadata: Mapping[str, Any]) -> str:
    return metadata.get(_KEY + "pre") or "default"


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str],
                    source: str) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    pre = _pre_name(metadata)
    if pre not in BYTE_LEVEL_PRE:
        raise ValueError(f"{source}: {_KEY}pre={pre!r} is not supported for a byte-level (gpt2) "
                         f"vocabulary; supported: {', '.join(sorted(BYTE_LEVEL_PRE))}")
    merges = _merges(_required(metadata, _KEY + "merges", source), source)
    vocab = {_byte_level_spelling(token): index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False, ignore_merges=pre in IGNORE_MERGES))
    tokenizer.pre_tokenizer = BYTE_LEVEL_PRE[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character table. tokenizers only exposes the alphabet
    # (ByteLevel.alphabet(), unordered), not the mapping, so it is written out here.
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


def _byte_level_spelling(token: str) -> str:
    # Tokens are stored in the byte alphabet, except some added ones llama.cpp writes as raw text:
    # respell those so the model can find them (as transformers does).
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_CHARS[byte] for byte in token.encode("utf-8"))


# --- SentencePiece-style vocabulary ("llama") -----------------------------------------------------


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str],
                       source: str) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    vocab = {token: index for index, token in enumerate(tokens)}
    if _KEY + "merges" in metadata:
        merges = _merges(metadata[_KEY + "merges"], source)
    else:
        scores = [float(s) for s in _required(metadata, _KEY + "scores", source)]
        if len(scores) != len(tokens):
            raise ValueError(f"{source}: {_KEY}scores has {len(scores)} entries for "
                             f"{len(tokens)} tokens")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk = _token_id(metadata, "unknown_token_id", len(tokens), source)
    tokenizer = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True,
        unk_token=tokens[unk] if unk is not None else None))
    # SentencePiece's dummy prefix: "▁" before the text (llama.cpp reads
    # tokenizer.ggml.add_space_prefix, default true) and spaces written as "▁".
    prefix = bool(metadata.get(_KEY + "add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, vocab


def _merges_from_scores(vocab: dict[str, int],
                        scores: dict[str, float]) -> list[tuple[str, str]]:
    # SentencePiece BPE merges the adjacent pair whose union scores best; tokenizers' BPE wants a
    # ranked merge list instead, and has no builder for one. Every cut of a token into two tokens
    # is a merge, ranked by that token's score; ties go as transformers' `generate_merges` breaks
    # them: longer left piece, then longer right piece, then vocabulary order (a stable sort).
    merges = [(token[:i], token[i:], score) for token, score in scores.items()
              for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


# --- shared ---------------------------------------------------------------------------------------


def _add_special_tokens(tokenizer: tokenizers.Tokenizer, metadata: Mapping[str, Any],
                        tokens: list[str], vocab: dict[str, int],
                        special_ids: Any, byte_level: bool, source: str) -> None:
    """Control tokens (and the bos/eos/unk/pad ids) become special added tokens and user-defined
    ones plain added tokens, so the text is matched against them whole before it is split."""
    types = list(metadata.get(_KEY + "token_type") or ())
    if types and len(types) != len(tokens):
        raise ValueError(f"{source}: {_KEY}token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    control = {i for i, t in enumerate(types) if t == _CONTROL}
    control |= {i for i in special_ids if i is not None}
    if byte_level:
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel of an
        # ordinary token (transformers skips these too).
        control = {i for i in control if set(tokens[i]) <= _BYTE_ALPHABET}
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(control)])
    user = [i for i, t in enumerate(types) if t == _USER_DEFINED and tokens[i] in vocab]
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])


def _post_processor(tokens: list[str], bos: int | None,
                    eos: int | None) -> processors.PostProcessor:
    """Adds BOS/EOS around each sequence as the file's add_bos_token/add_eos_token ask."""
    # The template names them "BOS"/"EOS" rather than by their text, which may hold spaces or ":".
    special = {name: i for name, i in (("BOS", bos), ("EOS", eos)) if i is not None}

    def template(seq: str, type_id: int) -> list[str]:
        names = ["BOS"] * ("BOS" in special) + [seq] + ["EOS"] * ("EOS" in special)
        return [f"{name}:{type_id}" for name in names]

    return processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + template("$B", 1),
        special_tokens=[{"id": name, "ids": [i], "tokens": [tokens[i]]}
                        for name, i in special.items()])


def _required(metadata: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in metadata or metadata[key] is None:
        raise ValueError(f"{source}: the GGUF tokenizer metadata has no {key!r}")
    return metadata[key]


def _strings(values: Sequence[Any]) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def _merges(values: Sequence[Any], source: str) -> list[tuple[str, str]]:
    merges = []
    for merge in _strings(values):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{source}: {_KEY}merges entry {merge!r} is not two tokens "
                             "separated by one space")
        merges.append((pair[0], pair[1]))
    return merges


def _token_id(metadata: Mapping[str, Any], name: str, n_tokens: int, source: str) -> int | None:
    value = metadata.get(_KEY + name)
    if value is None:
        return None
    if not 0 <= int(value) < n_tokens:
        raise ValueError(f"{source}: {_KEY}{name}={value} is outside the vocabulary "
                         f"(0..{n_tokens - 1})")
    return int(value)
