"""The release of this package: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), so the installed metadata
(``importlib.metadata.version("collectives")``) and ``collectives.__version__`` agree.
"""

__version__ = "0.1.0"
