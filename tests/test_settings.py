"""``collectives.settings``: the one table of ``COLLECTIVES_*`` variables, their parsing,
the warning for an unknown one, and the documentation page made from the table."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from collectives import settings

ROOT = Path(__file__).resolve().parent.parent


def test_every_row_is_a_collectives_variable_with_a_known_kind():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) and len(names) >= 38
    for s in settings.SETTINGS:
        assert s.name.startswith("COLLECTIVES_") and s.doc and s.scope
        assert s.kind == "choice" or s.kind in ("int", "float", "flag", "str", "path",
                                                "words"), s
        if s.choices:
            assert s.default is None or s.default in s.choices, s


def test_values_are_parsed_and_bad_ones_name_the_variable():
    env = {"COLLECTIVES_TIMEOUT": " 2.5 ", "COLLECTIVES_SHM_WAIT": "SLEEP",
           "COLLECTIVES_DEBUG": "yes", "COLLECTIVES_SHM_CHUNK_BYTES": "0x10000",
           "COLLECTIVES_MPIEXEC_ARGS": "-genv A 1"}
    assert settings.TIMEOUT.get(env) == 2.5
    assert settings.SHM_WAIT.get(env) == "sleep"
    assert settings.DEBUG.get(env) is True
    assert settings.SHM_CHUNK_BYTES.get(env) == 65536
    assert settings.MPIEXEC_ARGS.get(env) == ["-genv", "A", "1"]
    assert settings.TIMEOUT.get({}) == 300.0 and settings.BACKEND.get({"COLLECTIVES_BACKEND":
                                                                       " "}) is None
    for row, bad, why in ((settings.TIMEOUT, "soon", "is not a number"),
                          (settings.TIMEOUT, "0", "must be at least"),
                          (settings.SHM_WAIT, "spin", "must be one of futex, sleep"),
                          (settings.DEBUG, "maybe", "is not 0 or 1"),
                          (settings.FLIGHT_RECORDER, "-1", "must be at least 0")):
        with pytest.raises(ValueError, match=f"{row.name}={bad!r} {why}"):
            row.get({row.name: bad})


def test_an_unknown_variable_gives_one_warning_naming_the_nearest():
    env = {"COLLECTIVES_SHM_SPIN_USS": "5", "COLLECTIVES_TIMEOUT": "3",
           "COLLECTIVES_ZZZ": "1"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unknown = settings.check_environment(env, once=False)
    assert unknown == ["COLLECTIVES_SHM_SPIN_USS", "COLLECTIVES_ZZZ"]
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2 and "did you mean COLLECTIVES_SHM_SPIN_US?" in texts[0], texts
    assert "python -m collectives.settings" in texts[1], texts


def test_init_process_group_checks_the_environment_once(monkeypatch):
    import collectives
    monkeypatch.setattr(settings, "_checked", False)
    monkeypatch.setenv("COLLECTIVES_TIMOUT", "5")
    with pytest.warns(RuntimeWarning, match="COLLECTIVES_TIMOUT .*COLLECTIVES_TIMEOUT"):
        collectives.init_process_group().close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collectives.init_process_group().close()   # (once per process)


def test_the_documentation_page_is_generated_from_the_table():
    # The site builds docs/settings.md's table from SETTINGS (docs/_ext/collectives_docs/
    # settings_table.py), so it cannot drift; a hand-written copy would.
    page = (ROOT / "docs" / "settings.md").read_text()
    assert "```{collectives-settings}" in page
    assert "| `COLLECTIVES_" not in page, "docs/settings.md holds a hand-copied table"


def test_the_markdown_table_keeps_a_row_per_variable():
    # A choice's "a | b" must not split its cell: every row has the header's five cells.
    rows = settings.markdown_table().splitlines()
    assert len(rows) == 2 + len(settings.SETTINGS)
    for row in rows:
        assert row.replace("\\|", "").count("|") == 6, row
