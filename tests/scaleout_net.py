"""Listening sockets of a process tree, from /proc (Linux), for the loopback assertions.

Imports nothing heavy: the pytest process uses it without importing JAX or Ray.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct


def descendants(root: int) -> set[int]:
  """Process ids of `root` and every process below it."""
  parents = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        continue
  tree, grew = {root}, True
  while grew:
    grew = False
    for pid, parent in parents.items():
      if parent in tree and pid not in tree:
        tree.add(pid)
        grew = True
  return tree


def _address(hex_address: str, family: int) -> str:
  host, port = hex_address.split(":")
  raw = bytes.fromhex(host)
  if family == socket.AF_INET:
    raw = struct.pack("<I", struct.unpack(">I", raw)[0])
  else:  # /proc stores IPv6 as four little-endian 32-bit words.
    raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
  return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def _listening() -> dict[int, str]:
  """socket inode -> local address of every listening TCP socket."""
  out = {}
  for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    try:
      with open(path) as f:
        lines = f.readlines()[1:]
    except OSError:
      continue
    for line in lines:
      fields = line.split()
      if fields[3] == "0A":  # TCP_LISTEN
        out[int(fields[9])] = _address(fields[1], family)
  return out


def listening_addresses(pids) -> set[str]:
  """host:port of every TCP socket the processes `pids` listen on."""
  listening, found = _listening(), set()
  for pid in pids:
    try:
      fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
      continue
    for fd in fds:
      try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
      except OSError:
        continue
      if target.startswith("socket:[") and int(target[8:-1]) in listening:
        found.add(listening[int(target[8:-1])])
  return found


def is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0]
  ip = ipaddress.ip_address(host)
  if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
    ip = ip.ipv4_mapped
  return ip.is_loopback
