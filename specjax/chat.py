"""Chat prompts: a model's own chat template (its tokenizer_config.json's or GGUF file's
Jinja template) rendered over a conversation, as transformers' `apply_chat_template`
renders it, so an instruct model is prompted the way it was trained and served.

Rendered here with jinja2 rather than through transformers, which the library does not
depend on. What transformers sets around jinja2 is part of the templates' contract,
and published templates rely on it: blocks trimmed (`trim_blocks`, `lstrip_blocks`),
loop controls, a sandbox, `raise_exception` and `strftime_now` as globals, `tojson`
without HTML escaping, the special tokens as variables, `tools` and `documents` defined
(None unless given), `{% generation %}` blocks (which mark the assistant's tokens for
training masks; here they render their body), and messages without their None-valued
keys, their reasoning under each name templates read it by (as transformers 5 does).
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from specjax.model import Model

Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": ...}
# the names templates read a message's reasoning under (gpt-oss's `thinking` among them)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """`template` compiled once in the sandboxed jinja2 environment chat templates are
    written for (a chat loop renders the same template at every turn)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _check(model: "Model", template: str | None, messages: Sequence[Message]) -> None:
    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer, so it has no chat format")
    if not template:
        raise ValueError("the model has no chat template (none in its tokenizer_config.json "
                         "or GGUF metadata 'tokenizer.chat_template'); pass a template= "
                         "or prompt it with plain text")
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, "
                         f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]={m!r} must be a dict with a 'role' string and "
                             "its 'content'")


def _template_messages(messages: Sequence[Message]) -> list[dict]:
    """The messages as transformers hands them to a template: keys whose value is None
    left out (APIs return `content=None` beside tool calls, which templates would print as
    "None" or trip on), and a message's reasoning under each name templates read it by."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# appended to the message a chat continues, to find where its text ends once rendered
# (transformers' own tag, so a template that tests for it behaves the same)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _continued(messages: list[dict]) -> list[dict]:
    """The messages with the tag after the last one's text, which the chat continues."""
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise ValueError("continue_final_message needs a last message whose 'content' is "
                         "text (the start of the answer to continue)")
    return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] +
                             _CONTINUE_TAG}]


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to where the continued message's text ends."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last "
                         "message's text as given, so the chat cannot continue it")
    # a template that trims the message's text trims the tag's trailing space too
    return text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()


def apply_chat_template(model: "Model", messages: Sequence[Message], *,
                        add_generation_prompt: bool | None = None,
                        continue_final_message: bool = False, tokenize: bool = True,
                        template: str | None = None, **context: Any) -> list[int] | str:
    """The conversation `messages` in `model`'s chat format: its token ids (tokenize=True,
    special tokens only where the template writes them, as transformers encodes a chat),
    or the text. add_generation_prompt: end with the assistant's turn opened, so the
    model answers (None: unless continue_final_message); continue_final_message: end
    inside the last message, so the model continues its text (an answer's start, e.g.
    a code block opened); template: another Jinja template than the model's; context:
    more variables the template reads (`tools`, `enable_thinking`, ...).
    Raises ValueError naming what is missing or malformed, and what the template's
    `raise_exception` says."""
    import jinja2

    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt opens a new turn and continue_final_message "
                         "continues the last one: ask for one of them")
    template = model.chat_template if template is None else template
    _check(model, template, messages)
    shown = _template_messages(messages)
    if continue_final_message:
        shown = _continued(shown)
    try:
        # `tools` and `documents` are defined (None) unless given, as transformers renders
        text = _compiled(template).render(
            messages=shown, add_generation_prompt=add_generation_prompt,
            **{**model.special_token_text(), "tools": None, "documents": None, **context})
    except jinja2.exceptions.TemplateError as e:  # its own message (`raise_exception`) or syntax
        raise ValueError(f"chat template: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError) as e:  # the messages' shape
        raise ValueError(f"chat template: {type(e).__name__}: {e} (rendering these messages)"
                         ) from e
    if continue_final_message:
        text = _cut_at_tag(text)
    if not tokenize:
        return text
    return model.tokenizer.encode(text, add_special_tokens=False).ids
