"""JSON-schema grammars whose length-bounded strings are JSON strings (xgrammar 0.2.8 workaround).

xgrammar 0.2.8 lowers a string with ``minLength``/``maxLength`` (and ``propertyNames`` bounds)
to a bounded repetition of one bare character class::

    root_prop_0_characters ::= (([^\\"\\\\\\r\\n]))       repeated {min, max}

That class admits raw U+0000-U+001F except CR and LF, which RFC 8259 forbids inside strings
(a TAB there makes ``json.loads`` fail), and it has no escape branch, so ``\\"``, ``\\n`` or
``\\uXXXX`` cannot be written at all (upstream: mlc-ai/xgrammar issue 800). Every other string
production (plain strings, ``pattern``, ``format``) is already right.

``json_schema_grammar`` converts the schema as xgrammar does, then rewrites each such rule so
that one repetition is exactly one character of the decoded string, spelled as JSON allows
(``JSON_STRING_CHARACTER`` lists the branches), so ``maxLength`` still counts what JSON
Schema counts (code points), the grammar admits no invalid JSON, and it now admits the
escaped strings it used to refuse. A lone surrogate escape stays refused (valid JSON text,
but no code point). The rewrite only matches the 0.2.8 rule body, so a fixed xgrammar release
makes it a no-op; the strict xfails in tests/engine/core/test_structured_output.py watch upstream.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from engine.core.xgrammar_lib import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

# A rule whose whole body is the bounded-string class, as Grammar.__str__ prints it.
_BOUNDED_STRING_CHAR_RULE = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_HEX = "[0-9a-fA-F]"
# One JSON-string character, in xgrammar's EBNF, one branch per way JSON spells it:
#
#     an unescaped code point      [^\0-\x1f"\\]
#     a short escape               \" \\ \/ \b \f \n \r \t
#     a \uXXXX escape              any code point outside the surrogates
#     a surrogate pair             \uD800-\uDBFF then \uDC00-\uDFFF (one code point)
JSON_STRING_CHARACTER = " | ".join(
    [
        r'[^\0-\x1f"\\]',
        r'"\\" ["\\/bfnrt]',
        rf'"\\u" [0-9a-cA-Ce-fE-F] {_HEX} {_HEX} {_HEX}',
        rf'"\\u" [dD] [0-7] {_HEX} {_HEX}',
        rf'"\\u" [dD] [89abAB] {_HEX} {_HEX} "\\u" [dD] [c-fC-F] {_HEX} {_HEX}',
    ]
)


def json_schema_grammar(schema: str | dict[str, Any], **options: Any) -> xgr.Grammar:
    """``xgr.Grammar.from_json_schema(schema, **options)`` with every length-bounded string's
    character rule replaced by ``JSON_STRING_CHARACTER``; the unchanged grammar when it has
    none."""
    grammar = xgrammar().Grammar.from_json_schema(schema, **options)
    ebnf = str(grammar)
    fixed, count = _BOUNDED_STRING_CHAR_RULE.subn(
        lambda match: f"{match.group(1)} ::= {JSON_STRING_CHARACTER}", ebnf
    )
    if count == 0:
        return grammar
    return xgrammar().Grammar.from_ebnf(fixed, root_rule_name="root")
