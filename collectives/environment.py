"""Numeric settings read from environment variables, with one clear error for a bad one."""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, TypeVar

N = TypeVar("N", int, float)


def env_number(name: str, default: Optional[N], *, kind: Callable[[str], N] = int,
               env: Optional[Mapping[str, str]] = None) -> Optional[N]:
    """``kind(env[name])``, or ``default`` when the variable is unset or blank.

    >>> env_number("COLLECTIVES_SHM_SPIN_US", 5, env={"COLLECTIVES_SHM_SPIN_US": "20"})
    20
    """
    value = (os.environ if env is None else env).get(name, "").strip()
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"environment variable {name}={value!r} is not {what}") from None


def first_env_int(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` that is set (and not blank), as an int; None if none is.

    >>> first_env_int({"PMI_RANK": "3"}, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    3
    """
    for name in names:
        value = env_number(name, None, env=env)
        if value is not None:
            return value
    return None
