"""G1a: a request body read by difference from the last one is read exactly as the whole
reading reads it — the same body, key order and value types included, the same digest, the
same refusal — whatever the order of bodies (docs/design/gateway.md)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime._boundary._bodies import NEW_NESTING, RequestBodies
from runtime._boundary._stream import request_digest
from runtime._pi._pijson import loads


def whole(raw: bytes) -> tuple[str, Any, str] | tuple[str, type[BaseException]]:
    """What the gateway read before G1a: ``loads`` then ``request_digest``."""
    try:
        body = loads(raw, deep=False)
        digest = request_digest(body) if isinstance(body, dict) else ""
    except (ValueError, RecursionError) as error:
        return ("refused", type(error))
    return ("read", _typed(body), digest)


def by_difference(
    reader: RequestBodies, raw: bytes
) -> tuple[str, Any, str] | tuple[str, type[BaseException]]:
    try:
        body, digest = reader.read(raw)
    except (ValueError, RecursionError) as error:
        return ("refused", type(error))
    return ("read", _typed(body), digest)


def _typed(value: Any) -> str:
    """``value`` as text that tells 1, 1.0 and true apart and keeps every key order, written
    without recursing (a body may nest as deep as the decoder reads)."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Token):
            out.append(item.text)
        elif isinstance(item, dict):
            stack.append(_Token("}"))
            for key, child in reversed(list(item.items())):
                stack.extend([child, _Token(json.dumps(key) + ":")])
            stack.append(_Token("{"))
        elif isinstance(item, list):
            stack.append(_Token("]"))
            stack.extend(reversed(item))
            stack.append(_Token("["))
        else:
            out.append(f"{type(item).__name__}:{json.dumps(item)},")
    return "".join(out)


class _Token:
    def __init__(self, text: str) -> None:
        self.text = text


def compact(value: Any) -> bytes:
    """As JavaScript's ``JSON.stringify`` writes it (Pi's bodies)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"
    )


def message(n: int, text: str = "x") -> dict[str, Any]:
    if n % 2:
        return {"role": "tool", "tool_call_id": f"call_{n}", "content": text * 50}
    function = {"name": "read", "arguments": json.dumps({"path": f"f{n}"})}
    call = {"id": f"call_{n}", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def body_of(messages: list[Any], **top: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "stream": True, "tools": [{"t": 1}], **top}


def test_g1a_appended_messages_are_read_by_difference_and_read_alike() -> None:
    reader = RequestBodies()
    messages = [message(0)]
    first_raw = compact(body_of(messages))
    first, _ = reader.read(first_raw)
    for n in range(1, 8):
        messages = [*messages, message(n)]
        raw = compact(body_of(messages))
        assert by_difference(reader, raw) == whole(raw)
    body, _ = reader.read(compact(body_of([*messages, message(9)])))
    # read by difference: the first message's value is the one decoded first, not again
    assert body["messages"][0] is first["messages"][0]


def test_g1a_the_same_body_again_is_the_same_step() -> None:
    reader = RequestBodies()
    raw = compact(body_of([message(0), message(1)]))
    assert by_difference(reader, raw) == whole(raw)
    assert by_difference(reader, raw) == whole(raw)


@pytest.mark.parametrize(
    "after",
    [
        # a second "messages" key after the array: the last one is the body's
        lambda raw: raw[:-1] + b',"messages":[{"role":"user","content":"other"}]}',
        # a trailing comma in the array: no JSON
        lambda raw: raw.replace(b"]]", b"],]", 1) if b"]]" in raw else raw[:-1] + b",]}",
        # whitespace where the array grows
        lambda raw: raw.replace(b'],"stream"', b' ,{"role":"user","content":"a"}],"stream"'),
        # a message that is no JSON, one with a lone surrogate as JavaScript writes it,
        # one nested deeper than read by difference, one deeper than the decoder reads
        lambda raw: raw.replace(b'],"stream"', b',{"role":}],"stream"'),
        lambda raw: raw.replace(b'],"stream"', b',{"content":"\\ud83d"}],"stream"'),
        lambda raw: raw.replace(
            b'],"stream"',
            b"," + b"[" * (NEW_NESTING + 1) + b"]" * (NEW_NESTING + 1) + b'],"stream"',
        ),
        lambda raw: raw.replace(b'],"stream"', b"," + b"[" * 5000 + b"]" * 5000 + b'],"stream"'),
        # another top-level value changed, the body cut short, a body that is no object
        lambda raw: raw.replace(b'"model":"m"', b'"model":"n"'),
        lambda raw: raw[:-7],
        lambda raw: b"[" + raw + b"]",
    ],
)
def test_g1a_a_body_that_only_looks_like_the_last_one_grown_is_read_whole(after: Any) -> None:
    reader = RequestBodies()
    raw = compact(body_of([message(0), message(1)]))
    reader.read(raw)
    changed = after(raw)
    assert changed != raw
    assert by_difference(reader, changed) == whole(changed)
    grown = compact(body_of([message(0), message(1), message(2)]))  # and the next is right
    assert by_difference(reader, grown) == whole(grown)


@pytest.mark.parametrize(
    "bodies",
    [
        # the array's end is another key's twin: the last "messages" is the body's
        [b'{"messages":[1],"x":1,"messages":[2]}', b'{"messages":[1,3],"x":1,"messages":[2]}'],
        # a trailing comma; a value with no comma before it
        [b'{"messages":[1],"x":1}', b'{"messages":[1,],"x":1}'],
        [b'{"messages":[1],"x":1}', b'{"messages":[11],"x":1}'],
        [b'{"messages":[1],"x":1}', b'{"messages":[1 2],"x":1}'],
        # space after the grown array's end, then a second bracket where the space was
        [
            b'{"messages":[1],"x":1}',
            b'{"messages":[1,2] ,"x":1}',
            b'{"messages":[1,2]],"x":1}',
        ],
    ],
)
def test_g1a_bodies_crafted_against_the_difference_are_read_whole(bodies: list[bytes]) -> None:
    reader = RequestBodies()
    for raw in bodies:
        assert by_difference(reader, raw) == whole(raw)


def test_g1a_a_new_message_nested_deeper_than_the_bound_is_read_whole() -> None:
    """New messages nested up to :data:`NEW_NESTING` levels (their list counted) are read by
    difference — the first message is the value decoded before; one level more, the body is
    read whole, so that no depth the whole reading refuses is ever read by difference."""
    base = b'{"messages":[{"a":1}],"x":1}'
    for nested, shared in ((NEW_NESTING - 1, True), (NEW_NESTING, False)):
        reader = RequestBodies()
        first, _ = reader.read(base)
        grown = base.replace(b"}]", b"}," + b"[" * nested + b"]" * nested + b"]")
        body, _ = reader.read(grown)
        assert (body["messages"][0] is first["messages"][0]) is shared, nested
        assert ("read", _typed(body)) == whole(grown)[:2]


def test_g1a_a_body_too_deep_for_the_whole_reading_is_refused_however_it_grew() -> None:
    """G19: a message nested just deeper than the whole reading reads (its decoder's
    recursion) is refused — read alone, as a new message, it would decode."""
    base = b'{"messages":[1],"x":1}'

    def grown(depth: int) -> bytes:
        return base.replace(b"[1]", b"[1," + b"[" * depth + b"]" * depth + b"]")

    refused = [d for d in range(1, 1200) if whole(grown(d))[0] == "refused"]
    assert refused, "the whole reading refuses nothing: the decoder's depth is unbounded"
    limit = refused[0]
    for depth in range(limit - 3, limit + 2):
        reader = RequestBodies()
        reader.read(base)
        assert by_difference(reader, grown(depth)) == whole(grown(depth))


def test_g1a_forget_keeps_nothing_of_the_last_body() -> None:
    reader = RequestBodies()
    first, _ = reader.read(compact(body_of([message(0)])))
    reader.forget()
    body, _ = reader.read(compact(body_of([message(0), message(1)])))
    assert body["messages"][0] is not first["messages"][0]


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
_keys = st.sampled_from(["model", "messages", "max_tokens", "stream", "tools", "a", "z", "é", ""])
_edits = st.one_of(
    st.tuples(st.just("append"), st.lists(_values, min_size=0, max_size=3)),
    st.tuples(st.just("set"), _keys, _values),
    st.tuples(st.just("drop"), st.integers(min_value=0, max_value=5)),
    st.tuples(st.just("spaced"), st.booleans()),
    st.tuples(st.just("cut"), st.integers(min_value=1, max_value=40)),
    st.tuples(st.just("twice"), _values),
)


@settings(max_examples=300, deadline=None)
@given(
    start=st.dictionaries(_keys, _values, max_size=4),
    first=st.lists(_values, min_size=0, max_size=4),
    edits=st.lists(_edits, min_size=1, max_size=10),
)
def test_g1a_any_sequence_of_bodies_is_read_as_the_whole_reading_reads_it(
    start: dict[str, Any], first: list[Any], edits: list[Any]
) -> None:
    """Whatever the bodies' order — grown, shrunk, another value, whitespace, cut short, a key
    twice — each is read as the whole reading reads it."""
    reader = RequestBodies()
    body: dict[str, Any] = {**start, "messages": first}
    raw = compact(body)
    assert by_difference(reader, raw) == whole(raw)
    for edit in edits:
        kind = edit[0]
        if kind == "append":
            messages = body.get("messages")
            body = {
                **body,
                "messages": [*(messages if isinstance(messages, list) else []), *edit[1]],
            }
            raw = compact(body)
        elif kind == "set":
            body = {**body, edit[1]: edit[2]}
            raw = compact(body)
        elif kind == "drop":
            messages = body.get("messages")
            if isinstance(messages, list):
                body = {**body, "messages": messages[: edit[1]]}
            raw = compact(body)
        elif kind == "spaced":
            raw = json.dumps(body, ensure_ascii=edit[1], indent=1).encode("utf-8", "surrogatepass")
        elif kind == "cut":
            raw = raw[: -edit[1]]
        else:  # a second "messages" key, written after the first
            raw = (
                raw[:-1] + b',"messages":' + compact(edit[1]) + b"}" if raw.endswith(b"}") else raw
            )
        assert by_difference(reader, raw) == whole(raw)


def test_g1a_bodies_are_json_as_msgspec_reads_it() -> None:
    """The oracle's premise: the whole reading of a compact body is msgspec's."""
    raw = compact(body_of([message(0)]))
    assert loads(raw, deep=False) == msgspec.json.decode(raw)
