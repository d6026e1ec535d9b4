"""Where a redirected connection was going: SO_ORIGINAL_DST, and addresses in one canonical
form (IPv4-mapped IPv6 as IPv4) so the transparent listener can compare them.

SO_ORIGINAL_DST (80) is netfilter's getsockopt on SOL_IP returning a sockaddr_in, and
IP6T_SO_ORIGINAL_DST (80) the same on SOL_IPV6 returning a sockaddr_in6 (linux
include/uapi/linux/netfilter_ipv4.h and netfilter_ipv6/ip6_tables.h). Envoy's
original_dst listener filter reads it the same way and, like us, treats "original
destination == local address" as not redirected (envoyproxy/envoy
source/extensions/filters/listener/original_dst/original_dst.cc).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import sys
from typing import Any

SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
SOL_IPV6 = getattr(socket, "SOL_IPV6", 41)
_SOCKADDR_IN_LEN = 16
_SOCKADDR_IN6_LEN = 28

Address = tuple[str, int]


class NotRedirectedError(OSError):
    """The kernel has no NAT record for this socket: it was not redirected by iptables."""


def parse_sockaddr(raw: bytes) -> Address:
    """A kernel sockaddr_in / sockaddr_in6 (as getsockopt returns it) -> (ip, port).

    sa_family is in host byte order, the port in network order.
    """
    if len(raw) < 2:
        raise ValueError(f"sockaddr too short: {len(raw)} bytes")
    family = int.from_bytes(raw[:2], sys.byteorder)
    if family == socket.AF_INET:
        if len(raw) < 8:
            raise ValueError(f"sockaddr_in too short: {len(raw)} bytes")
        (port,) = struct.unpack_from("!H", raw, 2)
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    if family == socket.AF_INET6:
        if len(raw) < 24:
            raise ValueError(f"sockaddr_in6 too short: {len(raw)} bytes")
        (port,) = struct.unpack_from("!H", raw, 2)
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    raise ValueError(f"unsupported address family {family} in sockaddr")


def original_destination(sock: socket.socket) -> Address:
    """Where a connection accepted on `sock` was going before iptables redirected it.

    Raises NotRedirectedError when the kernel keeps no record (connection tracking not
    loaded, or a connection it does not track). A tracked connection that was not NATed
    returns the socket's own local address; TransparentListener (meshd/transparent.py)
    treats that as "made straight to the listener".
    """
    level, size = socket.SOL_IP, _SOCKADDR_IN_LEN
    # An IPv4 client on a dual-stack socket is tracked by the IPv4 conntrack table.
    if sock.family == socket.AF_INET6 and _mapped_v4(sock.getpeername()[0]) is None:
        level, size = SOL_IPV6, _SOCKADDR_IN6_LEN
    try:
        raw = sock.getsockopt(level, SO_ORIGINAL_DST, size)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOPROTOOPT):
            raise NotRedirectedError(
                exc.errno, f"no original destination ({exc.strerror}): not redirected by iptables"
            ) from exc
        raise
    return parse_sockaddr(raw)


def _mapped_v4(ip: str) -> str | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return None


def normalize_address(addr: Any) -> Address:
    """A socket address in one canonical form: IPv4-mapped IPv6 becomes IPv4."""
    ip, port = str(addr[0]), int(addr[1])
    mapped = _mapped_v4(ip)
    if mapped is not None:
        return mapped, port
    try:
        return ipaddress.ip_address(ip).compressed, port
    except ValueError:
        return ip, port
