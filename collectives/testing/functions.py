"""How a user's function reaches worker processes: by reference, scripts included.

Workers of a :class:`~collectives.testing.WorldPool` receive their tasks pickled, and
pickle sends a function by its qualified name. A function defined in a script run as
``python my_check.py`` is ``__main__.fn`` there, which names a different module in a worker
(``multiprocessing``'s spawned workers import the script as ``__mp_main__``; workers that
``mpiexec`` started run ``collectives.testing.mpi_launch`` as their ``__main__``).

:class:`FunctionRef` travels instead: the module name and qualified name, plus the
script's path when the function lives in ``__main__``. A worker imports the module, or
loads the script the way ``multiprocessing`` does (as ``__mp_main__``, so the script's
``if __name__ == "__main__":`` block does not run again), and looks the function up. No
code travels, only names: the workers must see the same files (they run on this host).

Two ranks: ``pool.call(FunctionRef.of(my_check), 3)`` runs ``my_check(group, 3)`` on both
ranks even when ``my_check`` is defined in the script that created ``pool``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

#: The name a script is loaded under in a worker (as ``multiprocessing`` does).
SCRIPT_MODULE = "__mp_main__"


@dataclass(frozen=True)
class FunctionRef:
    """A top-level function by name: ``module`` and ``qualname``, and ``path`` (the script
    file) when the function was defined in ``__main__``. Calling it calls the function.

    >>> import os.path
    >>> ref = FunctionRef.of(os.path.join)
    >>> ref.module, ref.qualname, ref("a", "b")
    ('posixpath', 'join', 'a/b')
    """

    module: str
    qualname: str
    path: Optional[str] = None

    @classmethod
    def of(cls, fn: Any, where: str = "collectives.testing", arg: str = "fn") -> "FunctionRef":
        """The reference of ``fn``; ``TypeError`` naming ``where`` and ``arg`` when a worker
        could not find it by name (a lambda, a nested function, a function of an
        interactive session)."""
        if isinstance(fn, FunctionRef):
            return fn
        if not callable(fn):
            raise TypeError(f"{where}: argument `{arg}` must be a function, got "
                            f"{type(fn).__name__} {fn!r}")
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise TypeError(f"{where}: argument `{arg}` ({qualname or fn!r}) must be defined "
                            f"at the top level of a module or script: worker processes find "
                            f"it by name (not a lambda, nor a function defined inside another)")
        path = None
        if module in ("__main__", SCRIPT_MODULE):
            main = sys.modules.get(module)
            spec = getattr(main, "__spec__", None)
            if spec is not None and spec.name not in ("__main__", SCRIPT_MODULE):
                module = spec.name  # `python -m pkg.mod`: importable by its own name
            else:
                path = getattr(main, "__file__", None)
                if path is None:
                    raise TypeError(f"{where}: argument `{arg}` ({qualname}) was defined in an "
                                    f"interactive session; worker processes cannot import it: "
                                    f"define it in a module or a script file")
                path = os.path.abspath(path)
        ref = cls(module, qualname, path)
        if ref.load() is not fn:
            raise TypeError(f"{where}: argument `{arg}`: {module}.{qualname} does not name "
                            f"this function (was it redefined or decorated?)")
        return ref

    def load(self) -> Callable[..., Any]:
        """The function itself (importing its module or loading its script once)."""
        target: Any = _script(self.path) if self.path else importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.path or self.module}:{self.qualname}"


def as_task(fn: Any) -> Any:
    """``fn`` ready to be pickled for a worker: a ``"module:function"`` string or a
    :class:`FunctionRef` as they are; a function defined in ``__main__`` as its
    :class:`FunctionRef`; anything else unchanged (pickled by name as usual)."""
    if isinstance(fn, (str, FunctionRef)) or fn is None:
        return fn
    if getattr(fn, "__module__", None) in ("__main__", SCRIPT_MODULE):
        return FunctionRef.of(fn, where="WorldPool", arg="task")
    return fn


def _script(path: str) -> ModuleType:
    """The module of the script at ``path``: ``__main__`` or ``__mp_main__`` when one of
    them is that file already (the process that runs the script; a ``multiprocessing``
    worker), otherwise the file loaded now as ``__mp_main__``."""
    for name in ("__main__", SCRIPT_MODULE):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file is not None and os.path.abspath(file) == path:
            return module  # type: ignore[return-value]
    spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"collectives.testing: cannot load the script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[SCRIPT_MODULE] = module
    # As `python script.py` would: the script's own folder first, for its sibling modules.
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(SCRIPT_MODULE, None)
        raise
    return module
