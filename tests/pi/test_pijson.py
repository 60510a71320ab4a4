"""JSON exactly as JavaScript writes it (runtime._pi._pijson). The encoder is invariant S2 of
docs/design/sessions.md, so the test names cite S2; the golden value is node's output."""

from __future__ import annotations

import pytest

from runtime._pi._pijson import loads, stringify

# JSON.stringify output of node v20 for the object built in test_s2_..._golden.
GOLDEN = (
    b'{"type":"custom","data":{"2":2,"10":3,"4294967294":7,"b":1,"01":4,"a":5,'
    b'"4294967295":6,"-1":8},"f":[0.1,0.30000000000000004,1e+21,1e-7,123456789012345680000,'
    b"1.5e+300,0,5e-324,100000000000000000000,0.000001,100,3.14,-2.5e-8,123.456,-1e-7,"
    b'1.7976931348623157e+308,9007199254740991],"s":"h\xc3\xa9llo \xe2\x9c\x93 \xf0\x9f\x98'
    b'\x80 \xe2\x80\xa8\xe2\x80\xa9 \\u0000\\u0001\\u0007\\b\\t\\n\\u000b\\f\\r\\u001f\x7f \\"'
    b'\\\\ / </script>","lone":"a\\ud800b\\udc00c\xf0\x9f\x98\x80"}'
)


def test_s2_encoder_matches_json_stringify_golden() -> None:
    """Unicode, control chars, U+2028, lone surrogates, JS number format, and the
    JavaScript key order (array-index keys first) all match node's JSON.stringify."""
    data = {"b": 1, "2": 2, "10": 3, "01": 4, "a": 5, "4294967295": 6, "4294967294": 7, "-1": 8}
    floats = [0.1, 0.1 + 0.2, 1e21, 1e-7, 1.2345678901234568e20, 1.5e300, -0.0, 5e-324, 1e20]
    floats += [0.000001, 100.0, 3.14, -2.5e-8, 123.456, -1e-7, 1.7976931348623157e308]
    text = "h\u00e9llo \u2713 \U0001f600 \u2028\u2029 \x00\x01\x07\b\t\n\x0b\f\r\x1f\x7f"
    obj = {
        "type": "custom",
        "data": data,
        "f": [*floats, 2**53 - 1],
        "s": text + ' "\\ / </script>',
        "lone": "a\ud800b\udc00c\ud83d\ude00",
    }
    assert stringify(obj) == GOLDEN
    assert stringify(loads(GOLDEN)) == GOLDEN


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), 2**53 + 1, 10**30, object(), {1: "x"}]
)
def test_s2_encoder_refuses_what_pi_cannot_write(value: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        stringify({"type": "custom", "data": value})
