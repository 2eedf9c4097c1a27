"""Where the testing kit lets hypothesis keep its files: not in the user's current folder.

Hypothesis writes a ``.hypothesis/`` folder in the current directory: its example
database (failing examples, replayed first on the next run) and, whatever the database,
a cache of the constants it found in the code under test. A user who runs the README's
``check_backend`` snippet from their project would find that folder left behind. So
:func:`check_backend` and :func:`check_algorithm` run with:

- no example database unless asked (``database=None``, the default: the cases are drawn
  from a fixed seed anyway, ``derandomize=True``); ``database=".hypothesis/examples"``,
  any path, or a hypothesis ``ExampleDatabase`` keeps failing examples there;
- hypothesis's storage folder in the system's temporary folder
  (``<tmp>/collectives-hypothesis-<uid>``) for the length of the check, unless the user
  chose one (``HYPOTHESIS_STORAGE_DIRECTORY``, or ``set_hypothesis_home_dir``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Union

__all__ = ["Database", "example_database", "storage_outside_cwd", "storage_folder"]

#: What the ``database`` argument of the checks accepts: None (no database), a folder,
#: or a hypothesis ``ExampleDatabase``.
Database = Union[None, str, "os.PathLike[str]", Any]


def example_database(database: Database, where: str) -> Any:
    """The hypothesis database for ``database``: None, a ``DirectoryBasedExampleDatabase``
    for a path, or the ``ExampleDatabase`` given. ``TypeError`` naming ``where`` for
    anything else.

    >>> example_database(None, "check_backend") is None
    True
    """
    from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
    if database is None or isinstance(database, ExampleDatabase):
        return database
    if isinstance(database, (str, os.PathLike)):
        return DirectoryBasedExampleDatabase(os.fspath(database))
    raise TypeError(f"{where}: argument `database` must be None, a folder or a "
                    f"hypothesis ExampleDatabase, got {type(database).__name__}")


def storage_folder() -> Path:
    """The folder the kit gives hypothesis: ``<tmp>/collectives-hypothesis-<uid>``."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"collectives-hypothesis-{uid}"


def _current_home() -> Path:
    from hypothesis import configuration
    try:
        return Path(configuration.storage_directory(intent_to_write=False).home_directory)
    except TypeError:  # hypothesis before 6.100: storage_directory() is the home's Path
        return Path(configuration.storage_directory())


@contextlib.contextmanager
def storage_outside_cwd() -> Iterator[Path]:
    """For the length of the block, hypothesis's storage folder is :func:`storage_folder`
    where it would otherwise be ``./.hypothesis``; a folder the user chose is left alone.
    Yields the folder in use."""
    from hypothesis.configuration import set_hypothesis_home_dir
    home = _current_home()
    # hypothesis's default is <the folder it was imported in>/.hypothesis
    chosen = bool(os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY")) or home.name != ".hypothesis"
    if chosen:
        yield home
        return
    set_hypothesis_home_dir(storage_folder())
    try:
        yield storage_folder()
    finally:
        set_hypothesis_home_dir(home)
