"""Which format a source's rows are read in: the column options, a source's default, or known column names.

``resolve_format`` chooses the kind of example and its columns, lets the kind check the options
given for it (``kinds.py``), and returns the ``ExampleFormat`` the build records and encodes with.
"""

from __future__ import annotations

from pipeline.config import NO_PROMPT_COLUMN, PackConfig, TruncateSide
from pipeline.errors import ConfigError, InputError
from pipeline.read.kinds import DEFAULT_PROMPT_TEMPLATE, ExampleFormat, kind_type
from pipeline.read.templates import ALPACA, SYSTEM_FIELD, AlpacaTemplate, PromptTemplate, parse_template
from schemas import ExampleKind

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "ExampleFormat", "resolve_format", "split_prompt_template"]


def split_prompt_template(template: str) -> tuple[str, str, str]:
    """The text before ``{prompt}``, between it and ``{response}``, and after ``{response}``.

    ``\\n`` and ``\\t`` written literally (as shells pass ``'{prompt}\\n{response}'``) mean a newline and a tab.

    >>> split_prompt_template("Q: {prompt}\\nA: {response}")
    ('Q: ', '\\nA: ', '')
    """
    parsed = PromptTemplate.parse(template)
    if parsed.fields != ("prompt", "response"):
        raise ConfigError(
            f"--prompt-template {template!r} must hold {{prompt}} once, then {{response}} once, "
            "e.g. '{prompt}\\n\\n{response}'"
        )
    before, between, after = parsed.pieces
    return before, between, after

# Tried in order when no column option is given.
_AUTODETECT = (
    (ExampleKind.PROMPT_RESPONSE, ("prompt", "response")),
    (ExampleKind.PROMPT_RESPONSE, ("question", "answer")),
    (ExampleKind.PROMPT_RESPONSE, ("inputs", "targets")),
    (ExampleKind.PROMPT_RESPONSE, ("instruction", "input", "output")),
    (ExampleKind.PROMPT_RESPONSE, ("instruction", "output")),
    (ExampleKind.CHAT, ("messages",)),
    (ExampleKind.CHAT, ("conversations",)),
    (ExampleKind.TEXT, ("text",)),
)


def _named_template(config: PackConfig) -> ExampleFormat | None:
    """The format a ``--prompt-template`` naming its own columns (``{instruction}``, ``alpaca``) reads, else None."""
    if config.prompt_template is None:
        return None
    template = parse_template(config.prompt_template)
    if set(template.fields) <= {"prompt", "response", SYSTEM_FIELD}:
        return None
    if config.messages_column is not None or config.text_column is not None:
        raise ConfigError("--prompt-template joins prompt/response columns; it does not go with --messages-column or --text-column")
    columns = template.columns(config.prompt_column, config.response_column)
    fields = [name for name in template.fields if name != SYSTEM_FIELD]
    for column in columns:
        if columns.count(column) > 1:
            both = " and ".join(f"{{{name}}}" for name, read in zip(fields, columns) if read == column)
            option = "--prompt-column" if column == config.prompt_column else "--response-column"
            raise ConfigError(
                f"--prompt-template {config.prompt_template!r}: {both} both read column {column!r} ({option} {column}); "
                "name each column once"
            )
    return ExampleFormat(ExampleKind.PROMPT_RESPONSE, columns, prompt_template=config.prompt_template)


def _from_options(config: PackConfig) -> ExampleFormat | None:
    """The format the column options (or a template of named columns) choose, else None."""
    named = _named_template(config)
    if named is not None:
        return named
    if config.prompt_column is not None:
        return ExampleFormat(ExampleKind.PROMPT_RESPONSE, (config.prompt_column, config.response_column))
    if config.messages_column is not None:
        return ExampleFormat(ExampleKind.CHAT, (config.messages_column,))
    if config.text_column is not None:
        return ExampleFormat(ExampleKind.TEXT, (config.text_column,))
    return None


def _detected(available: tuple[str, ...] | None, where: str) -> ExampleFormat:
    """The first known column names among ``available``; Alpaca's instruction, input and output with its template."""
    if available is None:
        raise InputError(f"{where}: pass --prompt-column and --response-column, --messages-column or --text-column")
    for kind, columns in _AUTODETECT:
        if set(columns) <= set(available):
            template = ALPACA if columns == AlpacaTemplate().fields else DEFAULT_PROMPT_TEMPLATE
            return ExampleFormat(kind, columns, prompt_template=template)
    raise InputError(
        f"{where}: cannot tell which columns to use (columns: {', '.join(available) or 'none'}); "
        "pass --prompt-column and --response-column, --messages-column or --text-column"
    )


def _preference_format(config: PackConfig, available: tuple[str, ...] | None) -> ExampleFormat:
    """Preference pairs: prompt, chosen and rejected texts where there is a prompt column (``--prompt-column``, else
    ``prompt`` when the source has it), else chosen and rejected message lists (also with ``--prompt-column none``)."""
    completions = (config.chosen_column, config.rejected_column)
    prompt = config.prompt_column
    if prompt is None and available is not None and "prompt" in available:
        prompt = "prompt"
    _check_one_role_per_column(config, prompt)
    if prompt is None or prompt == NO_PROMPT_COLUMN:
        return ExampleFormat(ExampleKind.PREFERENCE_CHAT, completions)
    return ExampleFormat(ExampleKind.PREFERENCE, (prompt, *completions))


def _check_one_role_per_column(config: PackConfig, prompt: str | None) -> None:
    """Raise ConfigError naming the options when one column is named for two parts of a pair."""
    options = {"--chosen-column": config.chosen_column, "--rejected-column": config.rejected_column}
    if prompt is not None and prompt != NO_PROMPT_COLUMN:
        found = "" if config.prompt_column is not None else " (the source's own 'prompt' column)"
        options = {f"--prompt-column{found}": prompt, **options}
    for column in dict.fromkeys(options.values()):
        named = [option for option, value in options.items() if value == column]
        if len(named) > 1:
            raise ConfigError(
                f"{', '.join(named[:-1])} and {named[-1]} name the same column {column!r}, but a column holds one part "
                "of a pair; name a different column with each"
            )


def _check_columns(chosen: ExampleFormat, available: tuple[str, ...] | None, where: str) -> None:
    """Raise InputError naming the first column of ``chosen`` the source lacks."""
    if available is None:
        return
    missing = [c for c in chosen.columns if c not in available and c.split(".")[0] not in available]
    if missing:
        options = "--prompt-column/--response-column, --messages-column or --text-column"
        if chosen.kind in (ExampleKind.PREFERENCE, ExampleKind.PREFERENCE_CHAT):
            options = "--prompt-column (none: message lists), --chosen-column and --rejected-column"
        raise InputError(f"{where}: no column {missing[0]!r} (columns: {', '.join(available) or 'none'}); choose columns with {options}")


def resolve_format(
    config: PackConfig,
    available: tuple[str, ...] | None,
    where: str,
    default: ExampleFormat | None = None,
    chat_template: str | None = None,
) -> ExampleFormat:
    """The example format from the column options, else ``default``, else the first known column names.

    ``available`` lists the source's columns (None when unknown); a missing column raises
    InputError naming ``where`` and the columns that exist.
    """
    if config.is_preference:
        chosen = _preference_format(config, available)
    else:
        chosen = _from_options(config) or default or _detected(available, where)
    _check_columns(chosen, available, where)
    kind = kind_type(chosen.kind, config.as_chat)
    kind.check(config, chosen, where, chat_template)
    return ExampleFormat(
        chosen.kind,
        chosen.columns,
        train_on_prompt=config.train_on_prompt,
        chat_template=chat_template if kind.is_chat else None,
        prompt_template=config.prompt_template or chosen.prompt_template,
        as_chat=kind.as_chat,
        system_prompt=config.system_prompt,
        keep_response=config.truncate_side == TruncateSide.LEFT,
        drop_dangling_turns=config.drop_dangling_turns,
    )
