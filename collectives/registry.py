"""Backends by name: built-in ones imported lazily, third-party ones through the
entry-point group ``collectives.backends``.

A factory takes ``(rendezvous: collectives.launch.Rendezvous, timeout: float)`` and
returns a connected :class:`~collectives.backend.Backend` (a Backend subclass itself is
such a factory when its constructor takes those two arguments);
:func:`collectives.init_process_group` wraps it in a ``ProcessGroup``. Choosing ``shm``
imports only ``backends.shm``: never ``mpi4py``, ``zmq`` or ``torch.distributed``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from typing import Any, Callable, Union

Factory = Callable[..., "object"]

ENTRY_POINT_GROUP = "collectives.backends"

# name -> ("module:attribute", the third-party module it needs, or None)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "shm": ("backends.shm:create", None),
    "zmq": ("backends.zeromq:create", "zmq"),
    "mpi": ("backends.mpi:create", "mpi4py"),
    "gloo": ("backends.torchdist.backend:create_gloo", "torch"),
    "nccl": ("backends.torchdist.nccl:create_nccl", "torch"),
    "torch": ("backends.torchdist.nccl:create_auto", "torch"),
    # ours again, driven through torch.distributed's "collectives" backend (as gloo is
    # driven through torch's gloo): shm underneath, hier across hosts, or COLLECTIVES_BACKEND
    "collectives": ("backends.torchdist.bridge:create_collectives", "torch"),
    # shm inside each host, zmq (or COLLECTIVES_HIER_NET) between hosts
    "hier": ("backends.hier:create", "zmq"),
}

_INSTALL_HINT = {"zmq": "pip install 'collectives[zmq]'", "mpi": "pip install 'collectives[mpi]'"}

_registered: dict[str, Union[str, Factory]] = {}
_entry_points_loaded = False

#: Prefix that runs a backend with the default send/recv algorithms only: ``p2p:shm``.
P2P_ONLY_PREFIX = "p2p:"


def register_backend(name: str, factory: Union[str, Factory], *, replace: bool = False) -> None:
    """Register ``factory`` (a callable or a lazy ``"module:attribute"`` string) as ``name``.

    >>> register_backend("loopback", "mypkg.loopback:create")   # doctest: +SKIP
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_backend: name must be a non-empty string without ':', "
                         f"got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"register_backend: factory for {name!r} must be callable or a "
                        f"'module:attribute' string, got {factory!r}")
    _load_entry_points()
    if not replace and (name in _registered or name in _BUILTIN):
        raise ValueError(f"register_backend: a backend named {name!r} is already registered; "
                         f"pass replace=True to override it")
    _registered[name] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTIN or ep.name in _registered:
            raise ValueError(f"entry point {ep.value!r} in group {ENTRY_POINT_GROUP!r} "
                             f"registers backend {ep.name!r}, which already exists")
        _registered[ep.name] = ep.value


def _resolve(spec: Union[str, Factory], name: str) -> Factory:
    if callable(spec):
        return spec
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = _INSTALL_HINT.get(name)
        raise ImportError(f"backend {name!r} could not be imported ({exc})"
                          + (f"; install it with: {hint}" if hint else "")) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TypeError(f"backend {name!r}: {spec!r} is not a callable factory")
    return factory


def check_backend_name(name: object, *, where: str = "get_backend",
                       what: str = "argument `name`") -> str:
    """``name`` if it names a backend (built in, registered, or ``p2p:`` one of those),
    without importing it; otherwise ``TypeError`` (not a str) or ``ValueError`` listing the
    backends available here, both naming the call ``where`` and ``what`` was wrong.

    >>> check_backend_name("p2p:shm")
    'p2p:shm'
    """
    if not isinstance(name, str):
        raise TypeError(f"{where}: {what} must be a backend name (a str), got "
                        f"{type(name).__name__} {name!r}")
    inner = name.removeprefix(P2P_ONLY_PREFIX)
    _load_entry_points()
    if inner not in _registered and inner not in _BUILTIN:
        known = ", ".join(sorted(set(_BUILTIN) | set(_registered)))
        raise ValueError(f"{where}: {what}: unknown backend {name!r}; available here: "
                         f"{', '.join(available_backends())} (known backends: {known}; "
                         f"'{P2P_ONLY_PREFIX}NAME' runs NAME with the default send/recv "
                         f"algorithms)")
    return name


def get_backend(name: str, *, where: str = "get_backend",
                what: str = "argument `name`") -> Factory:
    """The factory of backend ``name`` (imported now); ``TypeError``/``ValueError`` naming
    ``where`` and the backends available here if ``name`` is not one (see
    :func:`check_backend_name`)."""
    check_backend_name(name, where=where, what=what)
    if name.startswith(P2P_ONLY_PREFIX):
        inner = get_backend(name[len(P2P_ONLY_PREFIX):], where=where, what=what)
        from .p2p_only import wrap_factory
        return wrap_factory(inner)
    if name in _registered:
        return _resolve(_registered[name], name)
    return _resolve(_BUILTIN[name][0], name)


def create_backend(name: str, rendezvous: Any, timeout: float, *, where: str,
                   what: str = "argument `backend`") -> Any:
    """Connect through backend ``name``'s factory (:func:`get_backend`): the
    :class:`~collectives.Backend` it made, or ``TypeError`` naming ``where`` when the
    factory returned something else."""
    from .backend import Backend     # (the registry itself imports no backend machinery)
    made = get_backend(name, where=where, what=what)(rendezvous, timeout)
    if not isinstance(made, Backend):
        raise TypeError(f"{where}: the factory of backend {name!r} returned "
                        f"{type(made).__name__}, not a collectives.Backend (a backend "
                        f"subclasses collectives.Backend; see collectives/backend.py)")
    return made


def available_backends() -> list[str]:
    """Names of the backends that can be used here (their libraries exist), found without
    importing any of them: a bad ``--backend`` is reported in a fraction of a second."""
    _load_entry_points()
    names = []
    for name, (spec, needs) in _BUILTIN.items():
        # (find_spec of "a.b.c" would import the packages a and a.b: torch, for gloo's)
        if importlib.util.find_spec(spec.partition(".")[0]) is None:
            continue
        if needs is not None and importlib.util.find_spec(needs) is None:
            continue
        if name == "nccl" and not _cuda_available():
            continue
        names.append(name)
    return names + sorted(_registered)


def _cuda_available() -> bool:
    """Whether CUDA can be used: torch's answer where torch is imported already, else
    whether an NVIDIA driver is loaded (torch is not imported only to ask)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return os.path.exists("/proc/driver/nvidia/version")
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken torch means no CUDA here
        return False
