"""Protobuf wire framing by hand, for messages assembled from parts encoded once and shared
(the control plane's responses, the EDS view's assignments): a varint and a
length-delimited field (wire type 2), as protobuf's encoding doc defines them
(protobuf.dev/programming-guides/encoding). Parsers accept fields in any order, and a
repeated field is just the field repeated, so a message is the concatenation of its
fields' frames."""

from __future__ import annotations

__all__ = ["len_field", "len_header", "varint"]


def varint(n: int) -> bytes:
    """A non-negative int as a base-128 varint."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    """Field `number` with wire type 2 (bytes, string, embedded message) holding `payload`."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def len_header(number: int, length: int) -> bytes:
    """What goes before `length` bytes of field `number` (wire type 2): the payload can
    then follow as a part of its own, not copied."""
    return varint(number << 3 | 2) + varint(length)
