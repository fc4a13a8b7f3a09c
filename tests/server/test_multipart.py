"""server.voices.parse_multipart: form uploads read with python-multipart, within the server's limits."""

from __future__ import annotations

import random

import httpx
import pytest

from mizuoto.server.errors import ApiError
from mizuoto.server.voices import parse_multipart

B = "b0undary"
CT = f"multipart/form-data; boundary={B}"


def _part(name: str | None, value: bytes, filename: str | None = None, boundary: str = B) -> bytes:
    disposition = "form-data" + (f'; name="{name}"' if name is not None else "") + \
        (f'; filename="{filename}"' if filename is not None else "")
    return f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def _form(*parts: bytes, boundary: str = B) -> bytes:
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def _refused(body: bytes, content_type: str = CT, **limits) -> str:
    with pytest.raises(ApiError) as e:
        parse_multipart(body, content_type, **limits)
    assert e.value.status == 400
    return e.value.message


def test_a_form_as_http_clients_send_it():
    """What httpx (like curl -F and browsers) sends: text fields and a file, bytes kept exactly."""
    wav = bytes(range(256)) * 4 + b"\r\n"
    request = httpx.Request("POST", "http://h/", data={"id": "bob", "text": "hello"},
                            files={"file": ("ref.wav", wav, "audio/wav")})
    fields, files = parse_multipart(request.read(), request.headers["content-type"])
    assert fields == {"id": "bob", "text": "hello"} and files == {"file": wav}


def test_unicode_fields_and_invalid_utf8():
    body = _form(_part("text", "こんにちは, ünïcode 🎤".encode()), _part("名前", b"v"), _part("bad", b"a\xff\xfeb"))
    fields, _ = parse_multipart(body, CT)
    assert fields == {"text": "こんにちは, ünïcode 🎤", "名前": "v", "bad": "a\ufffd\ufffdb"}  # replaced, as before


def test_the_part_limit_counts_fields_and_files():
    parts = [_part("id", b"x"), _part("text", b"y"), _part("file", b"z", "a.wav")]
    assert parse_multipart(_form(*parts), CT, max_parts=3) == ({"id": "x", "text": "y"}, {"file": b"z"})
    message = _refused(_form(*parts, _part("model", b"m")), max_parts=3)
    assert "more than 3 parts" in message
    # thousands of tiny parts are refused at the first one too many, not parsed to the end
    assert "16 parts" in _refused(_form(*[_part(f"f{i}", b"x") for i in range(50_000)]))


def test_a_part_over_its_limit_is_refused():
    body = _form(_part("file", b"\0" * 1000, "a.wav"))
    assert parse_multipart(body, CT, max_file_bytes=1000)[1] == {"file": b"\0" * 1000}
    assert "'file'" in (message := _refused(body, max_file_bytes=999)) and "999 bytes" in message
    body = _form(_part("text", b"t" * 100))  # text fields have their own, smaller limit
    assert parse_multipart(body, CT, max_field_bytes=100)[0] == {"text": "t" * 100}
    assert "'text'" in (message := _refused(body, max_field_bytes=99, max_file_bytes=10**9)) and "99" in message
    assert "'file'" in _refused(_form(_part("file", b"\0" * (33 << 20), "big.wav")))  # the default: 32 MiB


@pytest.mark.parametrize("content_type", ["multipart/form-data", "multipart/form-data; boundary=",
                                          "multipart/form-data; charset=utf-8", "", "multipart/form-data; b=é☃"])
def test_no_boundary(content_type):
    assert "no boundary" in _refused(_form(_part("id", b"x")), content_type)


def test_a_wrong_boundary():
    assert "boundary" in _refused(_form(_part("id", b"x")), "multipart/form-data; boundary=other")
    assert "boundary" in _refused(_form(_part("id", b"x")), f"multipart/form-data; boundary={B}x")


@pytest.mark.parametrize("body", [
    b"",
    b"garbage",
    b"\r\n\r\n",
    _form(_part("id", b"x"))[:-12],  # cut short: no closing boundary
    _part("id", b"x"),  # no closing boundary at all
    f"--{B}\r\nContent-Disposition form-data\r\n\r\nx\r\n--{B}--\r\n".encode(),  # a header without a colon
    f"--{B}\r\nBad Header: x\r\n\r\nx\r\n--{B}--\r\n".encode(),
    f"--{B}\nContent-Disposition: form-data; name=\"id\"\n\nx\n--{B}--\n".encode(),  # LF line ends
    f"--{B}\r\nContent-Disposition: form-data; name=\"id\"\r\n".encode(),  # ends in the headers
    f"--{B}\r\n".encode() + b"X-Pad: " + b"a" * 10_000 + b"\r\n\r\nx\r\n" + f"--{B}--\r\n".encode(),  # a huge header
    f"--{B}\r\n".encode() + b"".join(b"X-%d: a\r\n" % i for i in range(100)) + f"\r\nx\r\n--{B}--\r\n".encode(),
    f"--{B}xyz\r\n\r\nx\r\n--{B}--\r\n".encode(),  # the boundary runs on
])
def test_a_malformed_body(body):
    _refused(body)


def test_a_boundary_longer_than_python_multipart_takes():
    long = "b" * 300
    assert "parsed" in _refused(_form(_part("id", b"x", boundary=long), boundary=long),
                                f"multipart/form-data; boundary={long}")


def test_crlf_and_boundary_look_alikes_inside_a_part_are_data():
    """Only CRLF--boundary ends a part: CRs, LFs, dashes and the boundary's prefixes inside it are kept."""
    tricky = [b"", b"\r\n", b"\r\n\r\n", b"\r", b"\n", b"--", f"\r\n--{B[:-1]}".encode(), f"x--{B}".encode(),
              f"a\r\n-{B}\r\n".encode(), f"x\r\n--{B[:-1]}\r\n".encode(), b"\r\n--\r\n", f"\n--{B}".encode()]
    for value in tricky:
        fields, files = parse_multipart(_form(_part("f", value, "f.bin"), _part("t", value)), CT)
        assert files == {"f": value} and fields == {"t": value.decode()}, value


def test_framing_variants_clients_send():
    """Leading CRLFs, a quoted boundary, padding after a delimiter and an epilogue are accepted."""
    body = _form(_part("id", b"x"), _part("file", b"", ""))  # an empty filename still makes it a file
    assert parse_multipart(b"\r\n" + body + b"epilogue\r\n", f'multipart/form-data; boundary="{B}"') == \
        ({"id": "x"}, {"file": b""})
    padded = body.replace(f"--{B}\r\nContent-Disposition: form-data; name=\"file\"".encode(),
                          f"--{B}  \r\nContent-Disposition: form-data; name=\"file\"".encode())
    assert parse_multipart(padded, CT) == ({"id": "x"}, {"file": b""})


def test_parts_without_a_name_are_skipped():
    body = _form(_part(None, b"x"), _part("", b"y"), f"--{B}\r\nContent-Type: text/plain\r\n\r\nz\r\n".encode(),
                 _part("id", b"kept"))
    assert parse_multipart(body, CT) == ({"id": "kept"}, {})


def test_random_parts_round_trip():
    """Parts made of CRs, LFs, dashes and prefixes of the delimiter come back exactly, as files and as fields."""
    rng = random.Random(7)
    pieces = [b"\r", b"\n", b"-", b"--", b"x", b"\xff"] + [f"\r\n--{B}"[:n].encode() for n in range(13)]
    for _ in range(500):
        value = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
        if f"\r\n--{B}".encode() in value or value.startswith(f"--{B}".encode()):
            continue  # a client picks a boundary its data does not hold
        fields, files = parse_multipart(_form(_part("t", value), _part("f", value, "f.bin")), CT)
        assert files == {"f": value} and fields == {"t": value.decode("utf-8", "replace")}, value


@pytest.mark.parametrize("content_type", [f"multipart/form-data; boundary*=utf-8''{B}",
                                          f"multipart/form-data; boundary*=''{B}"])
def test_an_rfc2231_boundary_is_no_boundary(content_type):
    """The RFC 2231 form of the parameter (which once let a body past the part count) is refused outright."""
    parts = _form(*[_part(f"f{i}", b"x") for i in range(1000)])
    assert "no boundary" in _refused(parts, content_type)


def test_a_nested_multipart_part_is_only_data():
    """A multipart/mixed body inside a part is not parsed again: it is that part's bytes, under its limit."""
    inner = _form(*[_part(f"n{i}", b"y" * 100, boundary="inner") for i in range(2000)], boundary="inner")
    body = _form(_part("file", b"Content-Type: multipart/mixed; boundary=inner\r\n\r\n" + inner, "a.bin"))
    fields, files = parse_multipart(body, CT)
    assert fields == {} and files["file"].endswith(inner)
    assert "'file'" in _refused(body, max_file_bytes=len(inner) // 2)
