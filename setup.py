"""Build of the optional compiled core of the shm backend (``backends.shm._native``).

Everything else is in pyproject.toml. The extension is optional: where it cannot be
compiled (no compiler, no Python headers, another platform) the build prints a warning
and goes on, and the shm backend uses its Python path (``backends/shm/native.py``).
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed compile into a warning (install still succeeds)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure means: no native core
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - CompileError, LinkError, OSError ...
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        print(f"WARNING: the compiled shm core (backends.shm._native) was not built "
              f"({type(exc).__name__}: {exc}); the shm backend will use its Python path",
              file=sys.stderr)


NATIVE = Extension(
    "backends.shm._native",
    sources=["backends/shm/_native.c"],
    # No -ffast-math: the reductions must round exactly as numpy does. No contraction
    # into FMA either, for the same reason.
    extra_compile_args=["-std=c11", "-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
    optional=True,
)

setup(ext_modules=[NATIVE], cmdclass={"build_ext": OptionalBuildExt})
