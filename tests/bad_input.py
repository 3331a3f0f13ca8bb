"""Kafka records, good and bad, as hypothesis strategies, and an independent judge of what bronze may accept.

The parser's property tests and the end-to-end bad-input test draw from the same builders. Each record
says what the parser must make of it: a reading (``reading``), a reason code (``expected``), or, for
arbitrary bytes, any known reason unless ``acceptable_reading`` finds a valid reading in it.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ingest.bronze import PARSE_ERROR_CODES, PayloadRules
from iotmon.schema import DEVICE_ID, EVENT_TIME, METRIC_NAMES, REQUIRED_FIELDS, SEQ

ANY_REASON = "*"
"""``Record.expected`` of bytes nobody designed: any known reason will do (or a valid reading, if it is one)."""

DEVICE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# re.ASCII: Java's \d, which Spark uses, is ASCII only; Python's also takes other scripts' digits.
ISO_TIME_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|[+-]\d{2}:?\d{2})?", re.ASCII)
NUMBER_PATTERN = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", re.ASCII)
INTEGER_PATTERN = re.compile(r"\s*[+-]?\d{1,19}\s*", re.ASCII)
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Record:
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()
    expected: str | None = None
    """The reason code the parse error must contain; None: it is a good reading; ``ANY_REASON``: unknown."""
    reading: dict[str, Any] | None = field(default=None, compare=False)
    """A good record's typed values, as bronze must hold them."""


def reason_codes(parse_error: str) -> list[str]:
    """``"mistyped_field:seq, missing_field:humidity"`` -> ``["mistyped_field:seq", "missing_field:humidity"]``."""
    return parse_error.split(", ")


def is_known_reason(code: str) -> bool:
    """A code the parser documents, with a detail that makes sense for it."""
    name, _, detail = code.partition(":")
    if name not in PARSE_ERROR_CODES:
        return False
    if name in {"missing_field", "mistyped_field"}:
        return detail in REQUIRED_FIELDS
    if name == "non_finite":
        return detail in METRIC_NAMES
    if name == "oversized_payload":
        return detail.isdigit()
    return detail == ""


def iso(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _strict_json(value: bytes) -> Any:
    """The one JSON value ``value`` holds, or ValueError: no BOM, nothing after it, UTF-8 only."""
    text = value.decode("utf-8")
    return json.loads(text)  # rejects trailing data, a BOM, NUL bytes outside strings and unescaped inside


def acceptable_reading(value: bytes | None, kafka_ts: dt.datetime, rules: PayloadRules) -> dict[str, Any] | None:
    """The typed reading in ``value`` if bronze may accept it, else None: the contract, written out in Python."""
    if not value or len(value) > rules.max_payload_bytes:
        return None
    try:
        payload = _strict_json(value)
    except ValueError:
        return None
    if not isinstance(payload, dict) or any(payload.get(name) is None for name in REQUIRED_FIELDS):
        return None
    device_id, seq, event_time = payload[DEVICE_ID], payload[SEQ], payload[EVENT_TIME]
    if isinstance(device_id, bool | int):  # a JSON scalar's text, like numbers in strings below
        device_id = json.dumps(device_id)
    if not isinstance(device_id, str) or not DEVICE_ID_PATTERN.fullmatch(device_id):
        return None
    if isinstance(seq, bool) or not isinstance(seq, int | str) or not INTEGER_PATTERN.fullmatch(str(seq)):
        return None
    if not LONG_MIN <= int(seq) <= LONG_MAX:
        return None
    if not isinstance(event_time, str) or not ISO_TIME_PATTERN.fullmatch(event_time):
        return None
    try:
        moment = dt.datetime.fromisoformat(event_time)
    except ValueError:
        return None
    if moment.tzinfo is not None:
        moment = moment.astimezone(dt.UTC).replace(tzinfo=None)
    min_time = dt.datetime.fromisoformat(rules.min_event_time).astimezone(dt.UTC).replace(tzinfo=None)
    if moment < min_time or moment > kafka_ts + dt.timedelta(seconds=rules.max_clock_skew_seconds):
        return None
    reading: dict[str, Any] = {DEVICE_ID: device_id, SEQ: int(seq), EVENT_TIME: moment}
    for name in METRIC_NAMES:
        metric = payload[name]
        if isinstance(metric, bool) or not isinstance(metric, int | float | str):
            return None
        if isinstance(metric, str) and not NUMBER_PATTERN.fullmatch(metric):
            return None
        number = float(metric)
        if not math.isfinite(number):
            return None
        reading[name] = number
    return reading


# --- strategies ------------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
new_field_names = st.text(min_size=1, max_size=12).filter(lambda name: name.lower() not in REQUIRED_FIELDS)
device_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,24}\Z")
finite_metrics = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**6), 10**6)


@st.composite
def good_payloads(draw: st.DrawFn, kafka_ts: dt.datetime, rules: PayloadRules) -> dict[str, Any]:
    """A valid reading, perhaps with new fields and numbers sent as strings, event time up to 30 days old."""
    lead = draw(st.integers(-30 * 86_400_000, rules.max_clock_skew_seconds * 1000 - 1000))
    payload: dict[str, Any] = {
        DEVICE_ID: draw(device_ids),
        SEQ: draw(st.integers(0, LONG_MAX)),
        EVENT_TIME: iso(kafka_ts + dt.timedelta(milliseconds=lead)),
    }
    for name in METRIC_NAMES:
        number = draw(finite_metrics)
        payload[name] = str(number) if draw(st.booleans()) else number
    payload.update(draw(st.dictionaries(new_field_names, json_values, max_size=3)))
    return payload


def _typed(payload: dict[str, Any]) -> dict[str, Any]:
    moment = dt.datetime.fromisoformat(payload[EVENT_TIME]).astimezone(dt.UTC).replace(tzinfo=None)
    return {
        DEVICE_ID: payload[DEVICE_ID],
        SEQ: int(payload[SEQ]),
        EVENT_TIME: moment,
        **{name: float(payload[name]) for name in METRIC_NAMES},
    }


def encode(payload: Any, ascii_only: bool = True) -> bytes:
    return json.dumps(payload, ensure_ascii=ascii_only).encode("utf-8")


WRONG_TYPES: dict[str, st.SearchStrategy[Any]] = {
    DEVICE_ID: st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    | st.text(max_size=20).filter(lambda text: not DEVICE_ID_PATTERN.fullmatch(text)),
    SEQ: st.sampled_from(["abc", "7.5", "", "1e3", "0x7", "7L", 7.5, True, [7], {"n": 7}, 2**64, -(2**64)]),
    EVENT_TIME: st.integers()
    | st.booleans()
    | st.sampled_from(["yesterday", "", "2026-13-45T00:00:00Z", "22/11/2026 01:00", "2026-11-22T25:00:00Z"]),
}
WRONG_METRIC = st.sampled_from(["hot", "", "21.5d", "0x10", "1,5", "7L", "--1", True, False, [1.0], {"v": 1}])
NON_FINITE = st.sampled_from(["NaN", "Infinity", "-Infinity", "inf", "-inf"])


@st.composite
def bad_payloads(draw: st.DrawFn, kafka_ts: dt.datetime, rules: PayloadRules) -> tuple[bytes | None, str]:
    """A corrupted reading and the reason code it must be quarantined with."""
    payload = draw(good_payloads(kafka_ts, rules))
    name = draw(st.sampled_from(REQUIRED_FIELDS))
    kind = draw(
        st.sampled_from(
            [
                "missing",
                "null",
                "mistyped",
                "non_finite",
                "past",
                "future",
                "encoding",
                "nul",
                "truncated",
                "trailing",
                "not_an_object",
                "oversized",
                "empty",
            ]
        )
    )
    if kind == "missing":
        del payload[name]
        return encode(payload), f"missing_field:{name}"
    if kind == "null":
        payload[name] = None
        return encode(payload), f"missing_field:{name}"
    if kind == "mistyped":
        payload[name] = draw(WRONG_TYPES.get(name, WRONG_METRIC))
        return encode(payload), f"mistyped_field:{name}"
    if kind == "non_finite":
        metric = draw(st.sampled_from(METRIC_NAMES))
        token = draw(NON_FINITE)
        if draw(st.booleans()):
            payload[metric] = token  # as a JSON string
            return encode(payload), f"non_finite:{metric}"
        payload[metric] = "@@"  # replaced by a bare token (NaN, 1e999) that JSON has no string for
        bare = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]))
        return encode(payload).replace(b'"@@"', bare.encode()), f"non_finite:{metric}"
    if kind in {"past", "future"}:
        if kind == "past":
            moment = draw(st.datetimes(dt.datetime(1, 1, 1), dt.datetime(1999, 12, 31)))
        else:
            earliest = kafka_ts + dt.timedelta(seconds=rules.max_clock_skew_seconds + 1)
            moment = draw(st.datetimes(earliest, dt.datetime(9999, 12, 31)))
        payload[EVENT_TIME] = moment.replace(microsecond=0).isoformat() + "Z"
        return encode(payload), "absurd_event_time"
    if kind == "encoding":
        text = json.dumps(payload)[:-1] + ', "note": "café ☕"}'  # ASCII but for the note
        codec, reason = draw(
            st.sampled_from(
                [
                    ("utf-16", "invalid_utf8"),  # with its BOM, FF FE
                    ("utf-32", "invalid_utf8"),
                    ("utf-16-be", "invalid_utf8"),  # é is 00 E9: not UTF-8
                    ("latin-1", "invalid_utf8"),
                    ("utf-8-sig", "invalid_json"),  # a UTF-8 BOM is valid UTF-8 but no JSON
                ]
            )
        )
        if codec == "latin-1":
            text = text.replace("☕", "")
        return text.encode(codec), reason
    if kind == "nul":
        raw = encode(payload)
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + b"\x00" + raw[at:], "invalid_json"
    if kind == "truncated":
        raw = encode(payload)
        return raw[: draw(st.integers(1, len(raw) - 1))], "invalid_json"
    if kind == "trailing":
        raw = encode(payload)
        junk = draw(
            st.sampled_from([raw, b"\n" + raw, b",{}", b"]", b"}", b"] x", b"}}", b" x", b"null", b"[]"])
            | st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=5).map(str.encode)
        )
        return raw + draw(st.sampled_from([b"", b" ", b"\n"])) + junk, "invalid_json"
    if kind == "not_an_object":
        other = draw(st.sampled_from([[payload], [payload, payload], "text", 42, None, True, []]))
        return encode(other), "invalid_json"
    if kind == "oversized":
        raw = encode(payload)
        padding = rules.max_payload_bytes - len(raw) + draw(st.integers(1, 4096))
        value = raw[:-1] + b" " * max(padding, 1) + b"}"
        return value, f"oversized_payload:{len(value)}"
    return draw(st.sampled_from([b"", None])), "empty_payload"


keys_for = {
    "none": st.none(),
    "text": st.text(max_size=30).map(str.encode),
    "binary": st.binary(max_size=30),
}
headers = st.lists(st.tuples(st.text(min_size=1, max_size=10), st.none() | st.binary(max_size=20)), max_size=3).map(
    tuple
)


RECORD_KINDS = ("good", "bad", "bad", "bytes")
"""A good reading, a designed corruption (twice as likely), random bytes."""


@st.composite
def records(
    draw: st.DrawFn, kafka_ts: dt.datetime, rules: PayloadRules, kinds: tuple[str, ...] = RECORD_KINDS
) -> Record:
    """One Kafka record of one of ``kinds``: by default a quarter good readings, most of the rest designed
    corruptions, some random bytes."""
    kind = draw(st.sampled_from(kinds))
    key_kind = draw(st.sampled_from(["device", "none", "text", "binary"]))
    header_list = draw(headers)
    if kind == "bytes":
        value = draw(st.binary(max_size=200))
        return Record(draw(keys_for["binary"]), value, header_list, ANY_REASON)
    if kind == "bad":
        value, reason = draw(bad_payloads(kafka_ts, rules))
        if value is not None and len(value) > rules.max_payload_bytes:  # size is checked first
            reason = f"oversized_payload:{len(value)}"
        key = draw(keys_for["none"] if key_kind == "none" else keys_for["text"] | keys_for["binary"])
        return Record(key, value, header_list, reason)
    payload = draw(good_payloads(kafka_ts, rules))
    key = payload[DEVICE_ID].encode() if key_kind == "device" else draw(keys_for[key_kind])
    value = encode(payload, ascii_only=draw(st.booleans()))
    return Record(key, value, header_list, None, _typed(payload))


def draw_records(strategy: st.SearchStrategy[Record], count: int, derandomize: bool = False) -> list[Record]:
    """``count`` records drawn by hypothesis, to be parsed in one Spark job (planning costs seconds a job).

    Hypothesis draws them one per example: its buffers are too small for lists of hundreds.
    ``derandomize`` draws the same records every run.
    """
    drawn: list[Record] = []

    @settings(
        max_examples=count,
        derandomize=derandomize,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(record: Record) -> None:
        drawn.append(record)

    collect()
    return drawn
