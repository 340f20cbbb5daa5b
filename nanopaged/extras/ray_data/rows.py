"""A row in, a row out: what a replica reads from a dataset's row and what it adds to it.

A row in holds one prompt, in one of three forms, and may hold its own sampling params:

    {"prompt": "text"}  or  {"messages": [{"role": ..., "content": ...}, ...]}  or  {"prompt_token_ids": [...]}
    "sampling_params": {"temperature": 0, "max_tokens": 64, ...}     SamplingParams' fields; else the config's

A row out is the row in, every column kept, plus

    generated_text, generated_tokens, num_input_tokens, num_generated_tokens, finish_reason
    error      None, or why this row was refused (a prompt past the context, a bad sampling value)
    replica    the replica that ran it: where (node, pid) and its engine's figures so far

A bad row is that row's error, never a failed dataset: one typo in a million rows must not cost the
other rows' work. Columns travel as Arrow tables (batch_format="pyarrow"), so nested values
(messages, sampling params) arrive as plain lists and dicts, with every key any row has (None where
this row has none: dropped here). So give a JSON schema as its text: as a dict, Arrow would merge
the schemas of all rows into one. `logit_bias` is a dict keyed by token ids as strings, as in OpenAI's
JSON ({"13": 5.0}: Arrow names a struct's fields by strings); a key only another row has arrives as
None and is dropped.
"""
from __future__ import annotations

from nanopaged.sampling_params import SamplingParams
from nanopaged.structured_output.params import StructuredOutputsParams

PROMPT_FORMS = ("prompt", "messages", "prompt_token_ids")
OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens",
                  "finish_reason", "error", "replica")


def rows_of(batch) -> list[dict]:
    """A batch (an Arrow table) as a list of plain row dicts."""
    return batch.to_pylist()


def table_of(rows: list[dict]):
    """Rows as an Arrow table, column by column: every key of every row is a column (Arrow's
    from_pylist would take the first row's keys as all of them)."""
    import pyarrow
    names = list(dict.fromkeys(key for row in rows for key in row))
    return pyarrow.table({name: [row.get(name) for row in rows] for name in names})


def prompt_of(row: dict):
    """(form, value): the row's one prompt. Arrow gives every row every column of the dataset, so
    a form a row does not use is None."""
    given = [form for form in PROMPT_FORMS if row.get(form) is not None]
    if len(given) != 1:
        raise ValueError(f"a row needs exactly one of {list(PROMPT_FORMS)}, got {given or 'none'}")
    form = given[0]
    value = row[form]
    if form == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt must be a string, got {type(value).__name__}")
    if form != "prompt" and (not isinstance(value, list) or not value):
        raise ValueError(f"{form} must be a non-empty list, got {value!r}")
    return form, value


def params_of(row: dict, default: dict | None) -> SamplingParams:
    """The row's SamplingParams: its own `sampling_params` (a dict), else the config's. A field Arrow
    filled with None (another row set it) means the default. One completion per row: repeat a row
    for more samples, so each sample is a row of its own in the output."""
    given = row.get("sampling_params")
    given = default if given is None else given
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"sampling_params must be a dict of SamplingParams fields, got {given!r}")
    fields = {k: v for k, v in (given or {}).items() if v is not None}
    if isinstance(fields.get("logit_bias"), dict):
        fields["logit_bias"] = {token: bias for token, bias in fields["logit_bias"].items() if bias is not None}
    if isinstance(fields.get("structured_outputs"), dict):
        fields["structured_outputs"] = StructuredOutputsParams(
            **{k: v for k, v in fields["structured_outputs"].items() if v is not None})
    params = SamplingParams(**fields)
    if params.n != 1:
        raise ValueError(f"sampling_params n={params.n}: a row gets one completion; repeat the row for more")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise ValueError(f"sampling_params {name}={getattr(params, name)}: a row out has no column for "
                             "logprobs, so they would be computed and dropped")
    return params


def result_row(row: dict, replica: dict, output=None, error: str | None = None) -> dict:
    """The row in, plus what generating it gave (an engine's RequestOutput, or a dict with the same
    fields from a server), or the error that refused it."""
    if error is not None:
        return {**row, "generated_text": None, "generated_tokens": None, "num_input_tokens": None,
                "num_generated_tokens": None, "finish_reason": None, "error": error, "replica": replica}
    return {**row, **output, "error": None, "replica": replica}


def engine_result(output) -> dict:
    """The output columns of an engine's final RequestOutput."""
    completion = output.outputs[0]
    return {"generated_text": completion.text, "generated_tokens": list(completion.token_ids),
            "num_input_tokens": len(output.prompt_token_ids), "num_generated_tokens": len(completion.token_ids),
            "finish_reason": completion.finish_reason}
