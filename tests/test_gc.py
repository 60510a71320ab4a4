"""What stays alive per pending delivery is invisible to the cycle collector (docs/design/
performance.md "Garbage collection in the serving path"): each such object is checked with
``gc.is_tracked``, after a collection where CPython untracks lazily."""

from __future__ import annotations

import gc

import msgspec

from runtime import _records
from runtime._records import Admission, Fingerprints, ModelRequestIntent
from runtime._rooms._admission import parse_delivery
from runtime._rooms._pending import Pending

REQUEST = {
    "delivery_id": "d1",
    "room": "dm:1",
    "author": {"id": "u1", "name": "Ann"},
    "message_id": "m1",
    "text": "hello",
    "history": [{"author": {"id": "u2", "name": "Bo"}, "text": "earlier"}],
}


def test_records_and_deliveries_are_untracked_structs() -> None:
    delivery = parse_delivery(REQUEST)
    assert not gc.is_tracked(delivery)
    assert not gc.is_tracked(delivery.author)
    assert delivery.history is not None
    assert not gc.is_tracked(delivery.history[0])
    admission = Admission(
        delivery_id="d1",
        lane="room:dm:1",
        request=REQUEST,
        fingerprints=Fingerprints(request="r", authority="a", settings="s"),
        rendered_prompt="hello",
        admitted_ms=1,
    )
    decoded = msgspec.json.decode(msgspec.json.encode(admission), type=_records.Record)
    assert decoded == admission
    for record in (admission, decoded, admission.fingerprints):
        assert not gc.is_tracked(record)
    # every record type inherits it
    record_types: list[type[msgspec.Struct]] = [ModelRequestIntent]
    record_types += _records._Record.__subclasses__()
    for record_type in record_types:
        assert record_type.__struct_config__.gc is False, record_type


def test_a_pending_delivery_holds_no_container_of_its_own_but_its_request() -> None:
    delivery = parse_delivery(REQUEST)
    pending = Pending(delivery=delivery, admission=None, grants=frozenset(), privileged=False)  # type: ignore[arg-type]
    assert pending.absorbed == ()
    assert not hasattr(pending, "__dict__")
    known = ("f" * len(REQUEST), delivery.room)  # the admission index's entry, built at run time
    assert gc.is_tracked(known)
    gc.collect()
    assert not gc.is_tracked(known)  # an exact tuple of strings: untracked by the first pass
