"""`specjax.apply_chat_template`: a model's chat template rendered and encoded as
transformers' `apply_chat_template` renders and encodes it (the real SmolLM2 file's
template: tests/test_gguf_tokenizer.py)."""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import specjax
from specjax.config import tiny_llama

SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]

# Llama 3's layout, with what published templates lean on: bos_token, a header per turn,
# raise_exception, tojson on tool schemas, loop controls and a {% generation %} block.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Tools: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{% if message['content'] == '' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that reverses a list."}],
    [{"role": "system", "content": "You answer in Python only."},
     {"role": "user", "content": "  Sort <these> & 'those'  "},
     {"role": "assistant", "content": "sorted(xs)"},
     {"role": "user", "content": ""},
     {"role": "user", "content": "Now héllo wörld, ünïcode: 日本語"}],
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama whose byte-level BPE adds BOS itself (as Llama 3's does), with
    the template above, and transformers' tokenizer read from its saved directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"def f{i}(xs):\n    return sorted(xs)[{i}] # héllo wörld 日本語" for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    cfg = dataclasses.replace(tiny_llama(vocab_size=tok.get_vocab_size()), bos_token_id=0,
                              eos_token_id=1)
    ours = dataclasses.replace(specjax.init_model(cfg, seed=0), tokenizer=tok,
                               chat_template=TEMPLATE)
    path = tmp_path_factory.mktemp("chat_model")
    specjax.save_hf(ours, path)
    return ours, transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_text_and_ids_match_transformers(model, conversation, generation_prompt):
    ours, hf = model
    messages = CONVERSATIONS[conversation]
    kw = dict(add_generation_prompt=generation_prompt)
    text = specjax.apply_chat_template(ours, messages, tokenize=False, **kw)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kw)
    ids = specjax.apply_chat_template(ours, messages, **kw)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    # the template writes BOS; the tokenizer's own BOS is not added on top of it
    assert ids[0] == 0 and ids[1] != 0
    assert text.endswith("assistant<|end_header_id|>\n\n") == generation_prompt


def test_context_variables_reach_the_template(model):
    """Extra variables (here `tools`, as a list of schemas) render as transformers renders
    them: tojson without HTML escaping, non-ASCII kept."""
    ours, hf = model
    tools = [{"name": "run", "description": "runs <code> & returns 'ok' — ünïcode"}]
    messages = CONVERSATIONS[0]
    text = specjax.apply_chat_template(ours, messages, tokenize=False, tools=tools)
    assert text == hf.apply_chat_template(messages, tokenize=False, tools=tools,
                                          add_generation_prompt=True)
    assert "<code> & returns 'ok' — ünïcode" in text


# a template laid out on lines, as most are written: a block tag's newline and its
# line's indentation are not output (jinja2's trim_blocks and lstrip_blocks)
MULTILINE = """{% for m in messages %}
    {% if m.role == 'user' %}
        [{{ m.content }}]
    {% else %}
        ({{ m.content }})
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    >
{% endif %}
"""


def test_another_template(model):
    ours, hf = model
    for messages in CONVERSATIONS:
        got = specjax.apply_chat_template(ours, messages, tokenize=False, template=MULTILINE)
        assert got == hf.apply_chat_template(messages, tokenize=False, chat_template=MULTILINE,
                                             add_generation_prompt=True)
    assert got.startswith("        (You answer in Python only.)\n        [  Sort")


# what transformers 5 hands a template besides the messages' text: None-valued keys left
# out, reasoning under each name, `tools` and `documents` defined (None) when not given
FIELDS = ("{% for m in messages %}[{{ m.role }}:"
          "{% if m.content is defined %}{{ m.content }}{% else %}-{% endif %}"
          "|{{ m.thinking if m.thinking is defined else '' }}"
          "|{{ m.reasoning_content if m.reasoning_content is defined else '' }}]{% endfor %}"
          "{% if tools is defined %}T{{ tools | tojson }}{% endif %}"
          "{% if documents is defined %}D{% endif %}")


def test_messages_reach_the_template_as_transformers_hands_them(model):
    ours, hf = model
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "reasoning": "look it up",
                 "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
                {"role": "tool", "content": "sunny", "name": None}]
    got = specjax.apply_chat_template(ours, messages, tokenize=False, template=FIELDS)
    assert got == hf.apply_chat_template(messages, tokenize=False, chat_template=FIELDS,
                                         add_generation_prompt=True)
    assert got == "[user:weather?||][assistant:-|look it up|look it up][tool:sunny||]TnullD"
    assert messages[1]["content"] is None  # the caller's messages are left as they were


@pytest.mark.parametrize("template", [TEMPLATE, MULTILINE])
def test_a_chat_can_continue_its_last_message(model, template):
    """The text ends where the last message's does (the model continues it), as
    transformers cuts it: a template that keeps the text as given (MULTILINE) and one that
    trims it (TEMPLATE, `| trim`)."""
    ours, hf = model
    start = "```python\ndef rev(words):\n    "  # the answer so far, up to an indent
    messages = CONVERSATIONS[0] + [{"role": "assistant", "content": start}]
    got = specjax.apply_chat_template(ours, messages, tokenize=False, template=template,
                                      continue_final_message=True)
    assert got == hf.apply_chat_template(messages, tokenize=False, chat_template=template,
                                         continue_final_message=True)
    # kept as given, or trimmed with the text when the template trims it
    assert got.endswith(start if template == MULTILINE else start.rstrip())
    ids = specjax.apply_chat_template(ours, messages, template=template,
                                      continue_final_message=True)
    assert ids == hf.apply_chat_template(messages, chat_template=template, return_dict=False,
                                         continue_final_message=True)
    with pytest.raises(ValueError, match="ask for one of them"):
        specjax.apply_chat_template(ours, messages, continue_final_message=True,
                                    add_generation_prompt=True)
    with pytest.raises(ValueError, match="last message whose 'content' is text"):
        specjax.apply_chat_template(ours, messages[:-1] + [{"role": "assistant"}],
                                    continue_final_message=True)
    with pytest.raises(ValueError, match="does not write the last message's text"):
        specjax.apply_chat_template(ours, messages, continue_final_message=True,
                                    template="{% for m in messages %}{{ m.role }}{% endfor %}")


def test_special_tokens_are_the_checkpoints_own(model, tmp_path):
    """A config may list several EOS ids, the tokenizer's EOS not first (Llama 3): the
    template's `eos_token` is tokenizer_config.json's, read back from a saved directory
    (a plain string or an added token's "content"), as transformers renders it."""
    import json

    ours, _ = model
    tagged = dataclasses.replace(ours, config=dataclasses.replace(ours.config,
                                                                  eos_token_id=(2, 1)),
                                 special_tokens={"eos_token": "<|eot_id|>"})
    template = "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}"
    for form in ("string", "added token"):
        path = tmp_path / form.replace(" ", "_")
        specjax.save_hf(tagged, path)
        if form == "added token":
            cfg = json.loads((path / "tokenizer_config.json").read_text())
            cfg["eos_token"] = {"__type": "AddedToken", "content": cfg["eos_token"],
                                "lstrip": False, "rstrip": False, "special": True}
            (path / "tokenizer_config.json").write_text(json.dumps(cfg))
        loaded = specjax.load(path)
        assert loaded.special_tokens == {"bos_token": "<|begin_of_text|>",
                                         "eos_token": "<|eot_id|>"}
        hf = transformers.AutoTokenizer.from_pretrained(str(path))
        got = specjax.apply_chat_template(loaded, CONVERSATIONS[0], tokenize=False,
                                          template=template)
        assert got == hf.apply_chat_template(CONVERSATIONS[0], tokenize=False,
                                             chat_template=template, add_generation_prompt=True)
        assert got.startswith("<|begin_of_text|>|<|eot_id|>|")  # not the config's first EOS


def test_bad_input_gets_a_clear_error(model):
    ours, _ = model
    with pytest.raises(ValueError, match="Unknown role: tool"):  # the template's own message
        specjax.apply_chat_template(ours, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\]=.*'role'"):
        specjax.apply_chat_template(ours, [CONVERSATIONS[0][0], {"content": "no role"}])
    with pytest.raises(ValueError, match="must be a list.*got str"):
        specjax.apply_chat_template(ours, "hello")
    with pytest.raises(ValueError, match="no chat template"):
        specjax.apply_chat_template(dataclasses.replace(ours, chat_template=None),
                                    CONVERSATIONS[0])
    with pytest.raises(ValueError, match="no tokenizer"):
        specjax.apply_chat_template(dataclasses.replace(ours, tokenizer=None),
                                    CONVERSATIONS[0])
    with pytest.raises(ValueError, match="chat template: "):  # a template that does not parse
        specjax.apply_chat_template(ours, CONVERSATIONS[0], template="{% for m in %}")
    # a template that cannot render these messages (no tools given to iterate)
    with pytest.raises(ValueError, match="chat template: TypeError: .* these messages"):
        specjax.apply_chat_template(ours, CONVERSATIONS[0],
                                    template="{% for t in tools %}{{ t }}{% endfor %}")
