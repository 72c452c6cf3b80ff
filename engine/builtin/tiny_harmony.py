"""The tokenizer of ``builtin:tiny-gpt-oss``: the tiny models' byte-level BPE with gpt-oss's
harmony special tokens added after the trained vocabulary (special, as in gpt-oss's own
tokenizer), its harmony chat template, and its tokenizer files. Generation stops at
``<|return|>`` (the end of a final answer) and ``<|call|>`` (the end of a tool call), as
gpt-oss's ``generation_config`` says.

The template (``HARMONY_CHAT_TEMPLATE``, whose comment lists what each message renders)
renders OpenAI chat messages in the harmony format, written here from OpenAI's published
specification (openai/harmony ``docs/format.md``): the ``openai-harmony`` package downloads its
o200k encoding at run time, and this tokenizer is not o200k, so neither it nor its renderer is
used. A prompt is a list of messages ``<|start|>{header}<|message|>{content}<|end|>`` without
separators.

Template variables beside ``messages`` and ``tools``: ``reasoning_effort`` (low, medium, high;
medium by default; the chat request's field), ``model_identity`` and ``current_date`` (today,
``strftime_now``, by default).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.builtin.tiny_tokenizer import (
    IM_END_TOKEN,
    IM_START_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
    declare_special_tokens,
    write_tokenizer,
)

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
# Added after the trained vocabulary in this order.
HARMONY_TOKEN_IDS: dict[str, int] = {
    token: TOKENIZER_VOCAB_SIZE + i for i, token in enumerate(HARMONY_TOKENS)
}
HARMONY_VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(HARMONY_TOKENS)
# gpt-oss's generation_config stops at these two.
HARMONY_STOP_TOKEN_IDS: tuple[int, ...] = (HARMONY_TOKEN_IDS[RETURN], HARMONY_TOKEN_IDS[CALL])

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


def build_harmony_tokenizer() -> Tokenizer:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS]
    )
    got = {t: tokenizer.token_to_id(t) for t in HARMONY_TOKENS}
    if got != HARMONY_TOKEN_IDS:
        raise RuntimeError(f"the harmony tokens got ids {got}, expected {HARMONY_TOKEN_IDS}")
    return tokenizer


def write_harmony_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """The tiny tokenizer's files with the harmony tokens declared special and the harmony chat
    template."""
    write_tokenizer(tokenizer, out)
    declare_special_tokens(
        out,
        HARMONY_TOKEN_IDS,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN, *HARMONY_TOKENS],
        chat_template=HARMONY_CHAT_TEMPLATE,
    )
