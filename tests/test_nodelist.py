"""collectives.launch.expand_nodelist: Slurm's compressed host lists.

Besides the cases of the issue, a hypothesis round-trip: a reference compressor written
here (host names -> Slurm syntax, the way ``scontrol show hostlistsorted`` writes them,
but keeping order) and a generator of structured lists whose expansion is known without
parsing (``itertools.product`` of the groups) must both come back unchanged.
"""

from __future__ import annotations

import doctest
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import nodelist
from collectives.launch import expand_nodelist


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-a[001-002]-ib", ["gpu-a001-ib", "gpu-a002-ib"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("vm", ["vm"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),              # widths grow without padding
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[3,1-2]", ["n3", "n1", "n2"]),                      # order as written
    ("x[1-2],y[1-2]z,w", ["x1", "x2", "y1z", "y2z", "w"]),
    ("n1.cluster.org,[1-2]rack", ["n1.cluster.org", "1rack", "2rack"]),
    ("  n[1-2]\n", ["n1", "n2"]),                          # as read from a file
])
def test_expand_nodelist_cases(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, where", [
    ("", "empty host list"),
    ("   ", "empty host list"),
    ("n[", "never closed"),
    ("n[1-2", "never closed"),
    ("n]", "without '['"),
    ("n[]", "empty brackets"),
    ("n[1,]", "not a number"),
    ("n[a-b]", "not a number"),
    ("n[1-2-3]", "not a number"),
    ("n[-1]", "not a number"),
    ("n[5-3]", "runs backwards"),
    ("n[1[2]]", "nested"),
    ("a,,b", "empty host name"),
    ("a,", "empty host name"),
    ("a b", "white space"),
    ("n[0-99999999]", "more than"),
    ("a[1-1024]b[1-1024]c[1-2]", "more than"),
])
def test_malformed_lists_are_value_errors_that_quote_the_text(text, where):
    with pytest.raises(ValueError, match="expand_nodelist") as info:
        expand_nodelist(text)
    assert where in str(info.value)
    if text.strip():
        assert repr(text.strip()) in str(info.value)


def test_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="expand_nodelist: text must be a str"):
        expand_nodelist(["n1"])  # type: ignore[arg-type]


def test_docstring_examples():
    failed, tried = doctest.testmod(nodelist)
    assert tried >= 3 and failed == 0


# ------------------------------------------------------------- the reference compressor
_HOST = re.compile(r"(.*?)(\d+)([^\d]*)")


def compress(hosts: list[str]) -> str:
    """Slurm syntax for ``hosts``, order kept: consecutive hosts that differ only in their
    last number (of the same printed width) share one bracket group, and runs of
    consecutive numbers become ranges. A reference independent of the parser."""
    pieces: list[str] = []
    i = 0
    while i < len(hosts):
        match = _HOST.fullmatch(hosts[i])
        if not match:
            pieces.append(hosts[i])
            i += 1
            continue
        prefix, _, suffix = match.groups()
        numbers: list[str] = []
        while i < len(hosts):
            m = _HOST.fullmatch(hosts[i])
            if not m or (m.group(1), m.group(3)) != (prefix, suffix):
                break
            numbers.append(m.group(2))
            i += 1
        items: list[str] = []
        j = 0
        while j < len(numbers):
            k = j
            while (k + 1 < len(numbers) and len(numbers[k + 1]) == len(numbers[j])
                   and int(numbers[k + 1]) == int(numbers[k]) + 1):
                k += 1
            items.append(numbers[j] if k == j else f"{numbers[j]}-{numbers[k]}")
            j = k + 1
        pieces.append(f"{prefix}[{','.join(items)}]{suffix}")
    return ",".join(pieces)


_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-._", min_size=1, max_size=6)
_DIGITS = st.integers(0, 1200).flatmap(
    lambda n: st.integers(len(str(n)), 5).map(lambda width: str(n).zfill(width)))


@st.composite
def host_names(draw) -> str:
    """A host name: words and numbers, ending in a number or not."""
    parts = draw(st.lists(st.one_of(_WORD, _DIGITS), min_size=1, max_size=4))
    name = "".join(parts)
    return name


@settings(max_examples=300, deadline=None)
@given(st.lists(host_names(), min_size=1, max_size=30))
def test_expand_inverts_the_reference_compressor(hosts):
    text = compress(hosts)
    assert expand_nodelist(text) == hosts, text


@st.composite
def structured_lists(draw) -> tuple[str, list[str]]:
    """Slurm syntax with several bracket groups per host and ranges of several widths,
    and its expansion computed without parsing."""
    text_parts: list[str] = []
    expected: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        segments: list[str] = []
        choices: list[list[str]] = []
        for _ in range(draw(st.integers(1, 3))):
            word = draw(_WORD)
            segments.append(word)
            choices.append([word])
            items, numbers = [], []
            for _ in range(draw(st.integers(1, 3))):
                width = draw(st.integers(1, 4))
                lo = draw(st.integers(0, 10 ** width - 1))
                hi = lo + draw(st.integers(0, 4))
                items.append(str(lo).zfill(width) if hi == lo else
                             f"{str(lo).zfill(width)}-{str(hi).zfill(width)}")
                numbers += [str(n).zfill(width) for n in range(lo, hi + 1)]
            segments.append(f"[{','.join(items)}]")
            choices.append(numbers)
        text_parts.append("".join(segments))
        expected += ["".join(p) for p in itertools.product(*choices)]
    return ",".join(text_parts), expected


@settings(max_examples=200, deadline=None)
@given(structured_lists())
def test_several_groups_multiply_the_first_varying_slowest(case):
    text, expected = case
    assert expand_nodelist(text) == expected


@settings(max_examples=200, deadline=None)
@given(structured_lists())
def test_compressing_an_expansion_gives_the_same_hosts(case):
    text, expected = case
    assert expand_nodelist(compress(expand_nodelist(text))) == expected
