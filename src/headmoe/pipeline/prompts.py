"""MAGI-2's prompt text before the tokenizer (MAGI2.md section 6.6).

1. `normalize_prompt`: a prompt that parses as a JSON object or list is rewritten to the
   "compact markdown" the model was trained on (`compact_markdown`); any other text is used
   byte for byte. Only objects with a ``global_layer`` entry (after empty entries are
   dropped) are rewritten; every other JSON prompt also stays as written.
2. `add_released_split`: the released tokenizer has one more pre-tokenizer in front of
   Qwen3.5's, a ``Split`` with `RELEASED_SPLIT_PATTERN`, behaviour "isolated". The pattern
   is the released raw string, malformed as released: the ``tokenizers`` engine reads
   ``\\U00020000`` as a literal ``U``, so besides the CJK / Hangul / kana / half-width
   blocks it isolates the digits, ``:;<=>?@`` and the capitals ``A``-``U``, and not CJK
   Extension B. The model was trained with that behaviour, so it is kept as is.

Judged by ``golden/magi2_pipeline/prompts.json`` (16 normalisations) and
``tokenization.json`` (ids and offsets of 11 prompts).

The compact markdown, line by line (empty values, ``None``, ``[]`` and ``{}`` are dropped
first, at every depth; every value is flattened to one line with single spaces; a line that
ends up blank is left out):

- ``context: <context>`` (or a bare ``context`` when there is only a description), then
  the description;
- ``aesthetics: style=..; mood=..; color=..`` from ``style``, ``mood_atmosphere``,
  ``color_scheme``;
- ``audio: language=..; speakers=a,b; ambience=..``;
- ``subjects:`` then `` - <id> | <description> (<position>; <orientation>) :: gender=..;
  age_group=..; ethnicity=..; clothing=..; appearance_details=..`` per subject;
- ``objects:`` then `` - <id> | <description> :: <shape_and_color>; <position>``;
- ``timeline:`` then `` - <timestamp range> <description>`` per segment, each followed by
  ``   - dialogue <speaker>: <text> (<timestamp>)``, ``   - action <id>: <primary>;
  <interaction>; <face>`` and ``   - objects <id>: <state change>; <motion>`` rows;
- the ``reference_layer`` lines as written (``str`` of each entry).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: the released extra pre-tokenizer pattern, character for character (103 characters; a
#: Python raw string: ``\\u`` and ``\\U`` reach the regex engine unescaped)
RELEASED_SPLIT_PATTERN = (
    r"([\u1100-\u11ff\u2e80-\ua4cf\ua840-\uD7AF"
    r"\uF900-\uFAFF\uFE30-\uFE4F\uFF65-\uFFDC\U00020000-\U0002FFFF])"
)

_AESTHETICS = (("style", "style"), ("mood", "mood_atmosphere"), ("color", "color_scheme"))
_VISUAL = ("gender", "age_group", "ethnicity", "clothing", "appearance_details")
_ACTION = ("primary_action", "interaction", "facial_expression")
_STATE = ("state_change", "motion_detail")


class FastTokenizer(Protocol):
    """What `add_released_split` uses of a ``transformers`` fast tokenizer."""

    @property
    def backend_tokenizer(self) -> Tokenizer: ...


def _is_empty(value: object) -> bool:
    return value is None or value == [] or value == {}


def _drop_empty(value: object) -> object:
    """``value`` without empty dict entries (None, [] or {} after this cleaning) and without
    None list items, at every depth."""
    if isinstance(value, dict):
        cleaned = ((k, _drop_empty(v)) for k, v in value.items())
        return {k: v for k, v in cleaned if not _is_empty(v)}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value if v is not None]
    return value


def _flat(value: object) -> str:
    """One line: ``str(value)`` with every whitespace run collapsed to one space."""
    return "" if value is None else " ".join(str(value).split())


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _items(value: object) -> list[object]:
    """The entries of a list-like field (a dict's keys, a string's characters, as
    iterated); nothing for other values."""
    return list(value) if isinstance(value, list | dict | str) else []


def _dicts(value: object) -> list[dict[str, object]]:
    """The dict entries of a list-like field (`_items`), in order."""
    return [x for x in _items(value) if isinstance(x, dict)]


def _present(*values: str) -> list[str]:
    return [v for v in values if v]


def _fields(entry: dict[str, object], keys: tuple[str, ...]) -> list[str]:
    return _present(*(_flat(entry.get(k)) for k in keys))


def _header_lines(glob: dict[str, object]) -> list[str]:
    context, description = _flat(glob.get("context")), _flat(glob.get("description"))
    lines = []
    if context or description:
        lines.append(f"context: {context}" if context else "context")
        lines += _present(description)
    looks = _dict(glob.get("aesthetics"))
    parts = [f"{label}={v}" for label, key in _AESTHETICS if (v := _flat(looks.get(key)))]
    if parts:
        lines.append("aesthetics: " + "; ".join(parts))
    sound = _dict(glob.get("audio_baseline"))
    talk = _dict(sound.get("dialogue"))
    given = talk.get("speaker_tags")
    tags = [] if given is None else given if isinstance(given, list) else [given]
    parts = [f"language={v}" for v in _present(_flat(talk.get("language")))]
    if tags:
        parts.append("speakers=" + ",".join(_flat(t) for t in tags))
    parts += [f"ambience={v}" for v in _present(_flat(sound.get("ambience")))]
    if parts:
        lines.append("audio: " + "; ".join(parts))
    return lines


def _subject_row(subject: dict[str, object]) -> str:
    row = " - " + " | ".join(_fields(subject, ("subject_id", "description")))
    place = "; ".join(_fields(subject, ("position", "orientation")))
    if place:
        row += f" ({place})"
    looks = _dict(subject.get("visual_attributes"))
    attrs = [f"{k}={v}" for k in _VISUAL if (v := _flat(looks.get(k)))]
    return row + (" :: " + "; ".join(attrs) if attrs else "")


def _object_row(item: dict[str, object]) -> str:
    row = " - " + " | ".join(_fields(item, ("object_id", "description")))
    details = "; ".join(_fields(item, ("shape_and_color", "position")))
    return row + (f" :: {details}" if details else "")


def _segment_lines(segment: dict[str, object]) -> list[str]:
    info = _dict(segment.get("segment_basic_info"))
    head = " ".join(["-", *_fields(info, ("timestamp_range", "segment_description"))])
    lines = [" " + head]
    for line in _dicts(_dict(segment.get("audio")).get("dialogue_lines")):
        text = _flat(line.get("text"))
        if text:
            who = _flat(line.get("speaker"))
            when = _flat(line.get("timestamp"))
            lines.append(f"   - dialogue{' ' + who if who else ''}: {text}"
                         + (f" ({when})" if when else ""))
    for alive in _dicts(segment.get("alive_subjects")):
        parts = _fields(_dict(alive.get("action")), _ACTION)
        if parts:
            lines.append(f"   - action {_flat(alive.get('subject_id'))}: " + "; ".join(parts))
    for item in _dicts(segment.get("objects")):
        parts = _fields(_dict(item.get("dynamic_state")), _STATE)
        if parts:
            lines.append(f"   - objects {_flat(item.get('object_id'))}: " + "; ".join(parts))
    return lines


#: one list entry -> its line (a subject, an object) or lines (a timeline segment)
Render = Callable[[dict[str, object]], str | list[str]]


def _listed(title: str, entries: object, render: Render) -> list[str]:
    """``title`` and one rendering per dict entry, for a non-empty list; else nothing."""
    if not isinstance(entries, list) or not entries:
        return []
    lines = [title]
    for entry in entries:
        if isinstance(entry, dict):
            rendered = render(entry)
            lines += rendered if isinstance(rendered, list) else [rendered]
    return lines


def compact_markdown(prompt: object) -> str | None:
    """The compact markdown of a parsed JSON prompt, or None when it has no
    ``global_layer`` (then the prompt is used as written)."""
    obj = _drop_empty(prompt)
    if not isinstance(obj, dict) or "global_layer" not in obj:
        return None
    glob, dyn = _dict(obj["global_layer"]), _dict(obj.get("dynamic_layer"))
    lines = _header_lines(glob)
    lines += _listed("subjects:", glob.get("alive_subjects_static"), _subject_row)
    lines += _listed("objects:", glob.get("objects_static"), _object_row)
    lines += _listed("timeline:", dyn.get("timeline_segments"), _segment_lines)
    refs = obj.get("reference_layer")
    if isinstance(refs, list):
        lines += [str(r) for r in refs]
    return "\n".join(line for line in lines if line.strip())


def normalize_prompt(prompt: str) -> str:
    """The text MAGI-2 tokenizes for ``prompt``: `compact_markdown` of a JSON object or list
    with a ``global_layer``, else ``prompt`` unchanged. JSON nested deeper than Python's
    recursion limit (where the release's code fails) is used as written too."""
    try:
        parsed = json.loads(prompt)
        if not isinstance(parsed, dict | list):
            return prompt
        rendered = compact_markdown(parsed)
    except (json.JSONDecodeError, TypeError, RecursionError):
        return prompt
    return prompt if rendered is None else rendered


def add_released_split(tokenizer: FastTokenizer) -> None:
    """Put the released extra pre-tokenizer (`RELEASED_SPLIT_PATTERN`, isolated) in front of
    the pre-tokenizer of ``tokenizer`` (a ``transformers`` fast tokenizer), in place."""
    from tokenizers import Regex, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    split = pre_tokenizers.Split(Regex(RELEASED_SPLIT_PATTERN), behavior="isolated")
    current = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [split] if current is None else [split, current])
