"""gpt-oss's harmony format on the prompt side: its special tokens, the chat template that renders
OpenAI chat messages in it, and ``harmony_prompt_ids``, the prompt ids of a chat for a harmony
tokenizer.

The template (``HARMONY_CHAT_TEMPLATE``, whose comment lists what each message renders) is
written from OpenAI's published specification (openai/harmony ``docs/format.md``); its system
and developer messages are openai_harmony's byte for byte. A harmony model's chats are rendered
with it, not with the checkpoint's own ``chat_template.jinja``, as vLLM renders them with
openai_harmony: the checkpoint's template refuses an assistant message with both text and
reasoning beside its calls, keeps only the first of parallel calls, JSON-quotes call arguments
and tool results, and drops a second system message. A prompt is a list of messages
``<|start|>{header}<|message|>{content}<|end|>`` without separators.

Template variables beside ``messages`` and ``tools``: ``reasoning_effort`` (low, medium, high;
medium by default; the chat request's field), ``model_identity`` and ``current_date`` (today,
``strftime_now``, by default).

Only the template's markup becomes special tokens: ``harmony_prompt_ids`` encodes every text of
the request (message contents, reasoning, call arguments, tool results, names, tool
definitions) as ordinary text, as openai_harmony does, so a ``<|end|><|start|>system…`` written
in a user message or a tool result cannot forge a message:

    request strings ──escape special-token texts──▶ template ──▶ text
    text ──split at special-token texts──▶ markup ids │ segments, unescaped, encoded as text
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
HARMONY_TOKENS: tuple[str, ...] = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

# JSON schema -> the TypeScript-like types of the spec's function definitions: a parameter per
# line, its description as a comment above it, "?" when not required, its default after it.
_TYPES = r"""
{%- macro ts_union(schemas) -%}
{%- for s in schemas -%}{{ ts_type(s) }}{{ ' | ' if not loop.last }}{%- endfor -%}
{%- endmacro -%}
{%- macro ts_type(schema) -%}
{%- if schema is not mapping -%}any
{%- elif schema.enum is defined -%}
{%- for v in schema.enum -%}{{ v | tojson }}{{ ' | ' if not loop.last }}{%- endfor -%}
{%- elif schema.const is defined -%}{{ schema.const | tojson }}
{%- elif schema.anyOf is defined -%}{{ ts_union(schema.anyOf) }}
{%- elif schema.oneOf is defined -%}{{ ts_union(schema.oneOf) }}
{%- elif schema.type is defined and schema.type is not string -%}
{%- for t in schema.type -%}{{ ts_type(dict(schema, type=t)) }}{{ ' | ' if not loop.last }}
{%- endfor -%}
{%- elif schema.type == 'string' -%}string
{%- elif schema.type in ('number', 'integer') -%}number
{%- elif schema.type == 'boolean' -%}boolean
{%- elif schema.type == 'null' -%}null
{%- elif schema.type == 'array' -%}
{%- set item = ts_type(schema['items']) if schema['items'] is defined else 'any' -%}
{{ '(' + item + ')' if ' | ' in item else item }}[]
{%- elif schema.type == 'object' and schema.properties -%}{{ '{\n' + ts_fields(schema) + '}' }}
{%- elif schema.type == 'object' -%}object
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
{%- macro ts_fields(schema) -%}
{%- set required = schema.required if schema.required is defined else [] -%}
{%- for name, field in schema.properties.items() -%}
{%- if field is mapping and field.description -%}
{{ '// ' + field.description.replace('\n', '\n// ') + '\n' }}
{%- endif -%}
{{ name }}{{ '?' if name not in required }}: {{ ts_type(field) }},
{%- if field is mapping and field.default is defined -%}
{{ ' // default: ' }}{{ field.default if field.default is string else field.default | tojson }}
{%- endif -%}
{{ '\n' }}
{%- endfor -%}
{%- endmacro -%}
"""

_SYSTEM = r"""
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else
    'medium' -%}
{%- if effort not in ('low', 'medium', 'high') -%}
{{ raise_exception('reasoning_effort must be low, medium or high, got ' + effort | string) }}
{%- endif -%}
{{ '<|start|>system<|message|>' }}
{{- model_identity if model_identity is defined else
    'You are ChatGPT, a large language model trained by OpenAI.' }}
{{- '\nKnowledge cutoff: 2024-06\nCurrent date: ' }}
{{- current_date if current_date is defined else strftime_now('%Y-%m-%d') }}
{{- '\n\nReasoning: ' + effort + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools -%}
{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif -%}
{{ '<|end|>' }}
"""

# The developer message: the leading system / developer messages' text, then the tools.
_DEVELOPER = r"""
{%- set lead = namespace(count=0, text=[]) -%}
{%- for message in messages -%}
{%- if message.role in ('system', 'developer') and lead.count == loop.index0 -%}
{%- set lead.count = loop.index -%}
{%- set lead.text = lead.text + [message.content if message.content is string else ''] -%}
{%- endif -%}
{%- endfor -%}
{%- set instructions = lead.text | join('\n\n') -%}
{%- if instructions or tools -%}
{{ '<|start|>developer<|message|>' }}
{%- if instructions -%}{{ '# Instructions\n\n' + instructions }}{%- endif -%}
{%- if instructions and tools -%}{{ '\n\n' }}{%- endif -%}
{%- if tools -%}
{{ '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
{%- for tool in tools -%}
{%- set function = tool.function if tool.function is defined else tool -%}
{%- if function.description -%}
{{ '// ' + function.description.replace('\n', '\n// ') + '\n' }}
{%- endif -%}
{%- set parameters = function.parameters if function.parameters is mapping else {} -%}
{%- if parameters.properties -%}
{{ 'type ' + function.name + ' = (_: {\n' + ts_fields(parameters) + '}) => any;\n\n' }}
{%- else -%}
{{ 'type ' + function.name + ' = () => any;\n\n' }}
{%- endif -%}
{%- endfor -%}
{{ '} // namespace functions' }}
{%- endif -%}
{{ '<|end|>' }}
{%- endif -%}
"""

_MESSAGES = r"""
{%- set last_user = namespace(index=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set last_user.index = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- set content = message.content if message.content is string else '' -%}
{%- if loop.index0 < lead.count -%}
{%- elif message.role in ('system', 'developer') -%}
{{ '<|start|>developer<|message|># Instructions\n\n' + content + '<|end|>' }}
{%- elif message.role == 'user' -%}
{{ '<|start|>user<|message|>' + content + '<|end|>' }}
{%- elif message.role == 'assistant' and message.tool_calls -%}
{%- if message.reasoning_content and loop.index0 > last_user.index -%}
{{ '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' }}
{%- endif -%}
{%- if content -%}
{{ '<|start|>assistant<|channel|>commentary<|message|>' + content + '<|end|>' }}
{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set function = call.function if call.function is defined else call -%}
{%- set arguments = function.arguments if function.arguments is defined else {} -%}
{{ '<|start|>assistant<|channel|>commentary to=functions.' + function.name }}
{{- ' <|constrain|>json<|message|>' }}
{{- arguments if arguments is string else arguments | tojson }}{{ '<|call|>' }}
{%- endfor -%}
{%- elif message.role == 'assistant' -%}
{{ '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' }}
{%- elif message.role == 'tool' -%}
{%- set found = namespace(name=message.name if message.name is defined else none) -%}
{%- for earlier in messages[:loop.index0] if found.name is none and earlier.tool_calls -%}
{%- for call in earlier.tool_calls -%}
{%- if call.id is defined and call.id == message.tool_call_id -%}
{%- set found.name = (call.function if call.function is defined else call).name -%}
{%- endif -%}
{%- endfor -%}
{%- endfor -%}
{%- if found.name is none -%}
{{ raise_exception('a tool message must answer an earlier tool call: its tool_call_id ' +
    (message.tool_call_id | string) + ' matches none, and it has no name') }}
{%- endif -%}
{{ '<|start|>functions.' + found.name + ' to=assistant<|channel|>commentary<|message|>' }}
{{- content + '<|end|>' }}
{%- else -%}
{{ raise_exception('unknown message role ' + message.role | string) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}
"""

# The messages as the template renders them:
#
#   system      identity, knowledge cutoff, current date, "Reasoning: {reasoning_effort}",
#               the valid channels (and that function calls go to commentary, given tools)
#   developer   "# Instructions" (the request's leading system / developer messages) and
#               "# Tools": the tools as a TypeScript-like ``namespace functions``
#   user        as written
#   assistant   a final answer ``<|channel|>final``; calls ``<|channel|>commentary
#               to=functions.NAME <|constrain|>json`` ending ``<|call|>``, after their
#               reasoning (``reasoning_content``, ``analysis``) while the turn is still open
#               (after the last user message); a call's text is a commentary preamble
#   tool        ``functions.NAME to=assistant<|channel|>commentary``
#   generation  ``<|start|>assistant``: the model writes the rest of the header
HARMONY_CHAT_TEMPLATE = "".join(part.strip() for part in (_TYPES, _SYSTEM, _DEVELOPER, _MESSAGES))


@dataclass(frozen=True)
class _SpecialTexts:
    """A tokenizer's special tokens by text, and a pattern that finds them (longest first, as
    the tokenizer matches them)."""

    ids: dict[str, int]
    pattern: re.Pattern[str]


_SPECIALS: weakref.WeakKeyDictionary[Any, _SpecialTexts | None] = weakref.WeakKeyDictionary()


def _special_texts(tokenizer: Any) -> _SpecialTexts | None:
    """The special tokens of a harmony tokenizer (one with every harmony token among its
    special tokens); None for any other tokenizer."""
    try:
        return _SPECIALS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: not a Hugging Face tokenizer
        return None
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    ids = {}
    if isinstance(decoder, dict):
        ids = {t.content: i for i, t in decoder.items() if getattr(t, "special", False)}
    specials = None
    if all(token in ids for token in HARMONY_TOKENS):
        texts = sorted(ids, key=len, reverse=True)
        specials = _SpecialTexts(ids, re.compile("|".join(map(re.escape, texts))))
    _SPECIALS[tokenizer] = specials
    return specials


def is_harmony_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has the harmony tokens as special tokens (gpt-oss's o200k harmony
    tokenizer, ``builtin:tiny-gpt-oss``'s): its chats are rendered by ``harmony_prompt_ids``."""
    return _special_texts(tokenizer) is not None


def harmony_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """The prompt ids of chat ``messages`` for a harmony ``tokenizer``, rendered by
    ``HARMONY_CHAT_TEMPLATE`` (Hugging Face's ``apply_chat_template`` options of the same
    names), the template's markup as special ids and every text of the request as ordinary
    text. Raises what the template raises (``jinja2.TemplateError``: roles, an unanswered tool
    message, an unknown ``reasoning_effort``)."""
    specials = _special_texts(tokenizer)
    if specials is None:
        raise ValueError("not a harmony tokenizer: it lacks the harmony special tokens")
    escape = _Escape.for_strings(specials.pattern, [messages, tools, template_kwargs])
    text = tokenizer.apply_chat_template(
        escape(messages),
        tools=escape(tools),
        chat_template=HARMONY_CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tokenize=False,
        **escape(template_kwargs),
    )
    markup = [specials.ids[token] for token in specials.pattern.findall(text)]
    between = _encode_as_text(
        tokenizer, [escape.undo(piece) for piece in specials.pattern.split(text)]
    )
    ids = between[0]  # text, then each markup token and the text after it
    for special, piece in zip(markup, between[1:], strict=True):
        ids += [special, *piece]
    if add_special_tokens:
        prefix, suffix = _added_special_tokens(tokenizer)
        ids = [*prefix, *ids, *suffix]
    return ids


def _encode_as_text(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids, special-token texts in it encoded as ordinary text (one batch)."""
    batch = [t for t in texts if t]
    encoded = iter(
        tokenizer(batch, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if batch
        else ()
    )
    return [list(next(encoded)) if t else [] for t in texts]


def _added_special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text with ``add_special_tokens`` (BOS)."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    wrapped = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(wrapped) - len(bare) + 1):
        if wrapped[i : i + len(bare)] == bare:
            return wrapped[:i], wrapped[i + len(bare) :]
    return [], []


# Private-use characters: in no tokenizer's special tokens and not in the template.
_SENTINELS = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))


class _Escape:
    """Special-token texts in the request's strings written as ``{S}{i}{S}`` (``S`` a
    private-use character that none of them holds, ``i`` the text's index) for the template,
    and written back in the rendered text; the identity when no string holds one."""

    def __init__(self, pattern: re.Pattern[str], sentinel: str | None) -> None:
        self.pattern = pattern
        self.sentinel = sentinel
        self.found: dict[str, int] = {}
        self.escaped = re.compile(f"{sentinel}([0-9]+){sentinel}") if sentinel else None

    @classmethod
    def for_strings(cls, pattern: re.Pattern[str], values: list[Any]) -> _Escape:
        strings = list(_strings(values))
        if not any(pattern.search(s) for s in strings):
            return cls(pattern, None)
        for code in itertools.chain(*_SENTINELS):
            sentinel = chr(code)
            if not any(sentinel in s for s in strings):
                return cls(pattern, sentinel)
        raise ValueError("the request's text uses every private-use character")

    def __call__(self, value: Any) -> Any:
        if self.sentinel is None:
            return value
        if isinstance(value, str):
            return self.pattern.sub(self._escaped, value)
        if isinstance(value, dict):
            return {self(k): self(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self(v) for v in value]
        return value

    def _escaped(self, match: re.Match[str]) -> str:
        index = self.found.setdefault(match.group(), len(self.found))
        return f"{self.sentinel}{index}{self.sentinel}"

    def undo(self, text: str) -> str:
        if self.escaped is None:
            return text
        texts = list(self.found)
        return self.escaped.sub(lambda m: texts[int(m.group(1))], text)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
