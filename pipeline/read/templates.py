"""Prompt templates: how the columns of one source row are joined into the text of one example.

A template is text with named fields, ``{prompt}``, ``{response}`` or any column (``{instruction}``,
``{input}``); ``{system}`` is the ``--system-prompt``. The last field is the response, trained on;
everything before it is the prompt. ``alpaca`` names Stanford Alpaca's two templates, the one with
an input section chosen for rows whose ``input`` is not empty.

>>> template = PromptTemplate.parse("Q: {question}\\nA: {answer}")
>>> template.fields, template.response_field
(('question', 'answer'), 'answer')
>>> import pyarrow as pa
>>> prompts, responses = template.render(pa.table({"question": ["2 + 3?"], "answer": ["5"]}))
>>> prompts.to_pylist(), responses.to_pylist()
(['Q: 2 + 3?\\nA: '], ['5'])
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import ConfigError

SYSTEM_FIELD = "system"
ALPACA = "alpaca"
# Stanford Alpaca's PROMPT_DICT (train.py), with and without the input section.
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
)
ALPACA_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n{output}"
)
_FIELD_NAME = re.compile(r"[\w.-]+")


def unescape(template: str) -> str:
    """``\\n`` and ``\\t`` written literally (as shells pass ``'{prompt}\\n{response}'``) as a newline and a tab."""
    return template.replace("\\n", "\n").replace("\\t", "\t")


@dataclass(frozen=True)
class PromptTemplate:
    """Literal text and named fields in turn: ``pieces[0] {fields[0]} pieces[1] ... {fields[-1]} pieces[-1]``."""

    pieces: tuple[str, ...]
    fields: tuple[str, ...]

    @classmethod
    def parse(cls, template: str) -> PromptTemplate:
        """The template of ``--prompt-template`` text; raises ConfigError naming the option."""
        text = unescape(template)
        pieces, fields = [""], []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as err:
            raise ConfigError(f"--prompt-template {template!r}: {err}; write a literal brace as {{{{ or }}}}") from err
        for literal, name, spec, conversion in parsed:
            pieces[-1] += literal
            if name is None:
                continue
            if not _FIELD_NAME.fullmatch(name) or spec or conversion:
                raise ConfigError(f"--prompt-template {template!r}: {{{name}}} is not a column name")
            fields.append(name)
            pieces.append("")
        response = [name for name in fields if name != SYSTEM_FIELD]
        if len(response) < 2 or len(set(fields)) != len(fields):
            raise ConfigError(
                f"--prompt-template {template!r} must name each field once, at least one for the prompt and the "
                "response last, e.g. '{prompt}\\n\\n{response}' or '{instruction}\\n{input}\\n{output}'"
            )
        if "response" in fields and fields[-1] != "response":
            raise ConfigError(
                f"--prompt-template {template!r}: the last field is the response, so it must hold {{prompt}} once, "
                "then {response} once, at the end"
            )
        if fields[-1] == SYSTEM_FIELD:
            raise ConfigError(f"--prompt-template {template!r}: {{system}} cannot be the response; end with the response")
        return cls(tuple(pieces), tuple(fields))

    @property
    def response_field(self) -> str:
        return self.fields[-1]

    def columns(self, prompt: str | None = None, response: str | None = None) -> tuple[str, ...]:
        """The source columns the fields read: ``{prompt}`` and ``{response}`` mean the chosen prompt and response columns."""
        aliases = {"prompt": prompt or "prompt", "response": response or "response"}
        return tuple(aliases.get(name, name) for name in self.fields if name != SYSTEM_FIELD)

    def render(self, table: pa.Table, system: str = "") -> tuple[pa.Array, pa.Array]:
        """The prompt part and the response part of each row; ``table`` holds the fields' columns in order."""
        values = iter(table.columns)
        parts: list = [self.pieces[0]]
        for name, piece in zip(self.fields, self.pieces[1:]):
            parts.append(system if name == SYSTEM_FIELD else next(values))
            parts.append(piece)
        response_parts = parts[-2:]
        prompt = pc.binary_join_element_wise(*parts[:-2], "")
        if system and SYSTEM_FIELD not in self.fields:
            prompt = pc.binary_join_element_wise(system, prompt, "\n\n")
        return _as_array(prompt, table.num_rows), _as_array(pc.binary_join_element_wise(*response_parts, ""), table.num_rows)


def _as_array(values, rows: int) -> pa.Array:
    """A column of ``rows`` strings, whether ``values`` is a chunked array, an array or one scalar."""
    if isinstance(values, pa.Scalar):
        return pa.array([values.as_py()] * rows, pa.string())
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


@dataclass(frozen=True)
class AlpacaTemplate:
    """Stanford Alpaca's layout: instruction, the input when it is not empty, then output."""

    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.instruction, self.input, self.output)

    @property
    def response_field(self) -> str:
        return self.output

    def columns(self, prompt: str | None = None, response: str | None = None) -> tuple[str, ...]:
        return self.fields

    def render(self, table: pa.Table, system: str = "") -> tuple[pa.Array, pa.Array]:
        """Each row rendered with the input section where its ``input`` holds text, else without it."""
        with_input = PromptTemplate.parse(ALPACA_WITH_INPUT).render(table, system)
        without = PromptTemplate.parse(ALPACA_WITHOUT_INPUT).render(table.select([0, 2]), system)
        has_input = pc.fill_null(pc.greater(pc.binary_length(table.column(1)), 0), False)
        prompt = pc.if_else(has_input, with_input[0], without[0])
        return _as_array(prompt, table.num_rows), with_input[1]


def parse_template(template: str) -> PromptTemplate | AlpacaTemplate:
    """``alpaca``, or a template of named fields."""
    return AlpacaTemplate() if template == ALPACA else PromptTemplate.parse(template)
