"""Slurm's compressed host lists, expanded: ``node[01-03,07]`` -> node01 node02 node03 node07.

The grammar (Slurm's ``hostlist`` syntax, as in ``SLURM_JOB_NODELIST`` and
``scontrol show hostnames``)::

    list  := host ("," host)*                 commas inside brackets do not split hosts
    host  := (text | group)+                  text: any characters but "[],"
    group := "[" item ("," item)* "]"
    item  := digits | digits "-" digits       lo <= hi; numbers printed at least as wide
                                              as ``lo`` is written (zero padding)

Several groups in one host multiply, the first varying slowest (``rack[1-2]-n[8-9]`` is
rack1-n8, rack1-n9, rack2-n8, rack2-n9), as Slurm's own expansion orders them. Order and
repeats are kept as written. Anything else is a :class:`ValueError` that quotes the text
and says where it went wrong.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_nodelist", "MAX_HOSTS"]

#: A list that expands to more hosts than this is refused (a typo such as
#: ``n[0-99999999]`` must not fill the memory); Slurm clusters stay far below it.
MAX_HOSTS = 1 << 20

_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


def expand_nodelist(text: str) -> list[str]:
    """Every host name of the Slurm host list ``text``, in order.

    >>> expand_nodelist("node[01-03,07]")
    ['node01', 'node02', 'node03', 'node07']
    >>> expand_nodelist("a[1-2],b3")
    ['a1', 'a2', 'b3']
    >>> expand_nodelist("rack[1-2]-n[8-9]")
    ['rack1-n8', 'rack1-n9', 'rack2-n8', 'rack2-n9']

    Two ranks under ``srun -N 2 -n 2`` read the same ``SLURM_STEP_NODELIST`` (say
    ``gpu-a[001-002]-ib``) and both meet at its first host, ``gpu-a001-ib``.
    """
    if not isinstance(text, str):
        raise TypeError(f"expand_nodelist: text must be a str, got {type(text).__name__}")
    body = text.strip()
    if not body:
        raise ValueError(f"expand_nodelist: empty host list {text!r}")
    hosts: list[str] = []
    for start, host in _split_hosts(body):
        hosts += _expand_host(host, body, start, MAX_HOSTS - len(hosts))
    return hosts


def _split_hosts(body: str) -> list[tuple[int, str]]:
    """``(offset, text)`` of each host expression: split at the commas outside brackets."""
    pieces: list[tuple[int, str]] = []
    depth, start = 0, 0
    for i, char in enumerate(body):
        if char == "[":
            if depth:
                raise _error(body, i, "nested '['")
            depth = 1
        elif char == "]":
            if not depth:
                raise _error(body, i, "']' without '['")
            depth = 0
        elif char == "," and not depth:
            pieces.append((start, body[start:i]))
            start = i + 1
    if depth:
        raise _error(body, body.rindex("["), "'[' is never closed")
    pieces.append((start, body[start:]))
    for offset, piece in pieces:
        if not piece.strip():
            raise _error(body, offset, "empty host name (two commas, or one at an end)")
        if piece != piece.strip() or any(c.isspace() for c in piece):
            raise _error(body, offset, "white space inside a host name")
    return pieces


def _expand_host(host: str, body: str, offset: int, room: int) -> list[str]:
    """The names of one host expression (no top-level commas, brackets balanced)."""
    parts: list[list[str]] = []   # each part: the choices at that place, in order
    pos = 0
    while pos < len(host):
        if host[pos] != "[":
            end = host.find("[", pos)
            end = len(host) if end < 0 else end
            parts.append([host[pos:end]])
            pos = end
            continue
        end = host.index("]", pos)
        parts.append(_expand_group(host[pos + 1:end], body, offset + pos))
        pos = end + 1
    count = 1
    for choices in parts:
        count *= len(choices)
    if count > room:
        raise _error(body, offset, f"expands to more than {MAX_HOSTS} hosts in all")
    return ["".join(names) for names in itertools.product(*parts)]


def _expand_group(group: str, body: str, offset: int) -> list[str]:
    """The numbers of one bracket group (the text between ``[`` and ``]``)."""
    if not group:
        raise _error(body, offset, "empty brackets '[]'")
    numbers: list[str] = []
    for item in group.split(","):
        match = _ITEM.fullmatch(item)
        if not match:
            raise _error(body, offset, f"{item!r} in brackets is not a number or a range "
                                       f"lo-hi of numbers")
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise _error(body, offset, f"range {item!r} runs backwards")
        if hi - lo >= MAX_HOSTS:
            raise _error(body, offset, f"range {item!r} has more than {MAX_HOSTS} numbers")
        width = len(lo_text)
        numbers += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return numbers


def _error(body: str, offset: int, what: str) -> ValueError:
    return ValueError(f"expand_nodelist: malformed Slurm host list {body!r} at character "
                      f"{offset}: {what}")
