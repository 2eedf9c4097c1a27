"""Reading MNIST-style IDX files and loading MNIST for the examples.

The repository ships a 5,000-digit MNIST subset in ``examples/data/mnist``
(see the README there for its sources, licences and split). The full MNIST set
uses the same file names and format, so pointing ``load_mnist`` at a folder
holding it, gzip-compressed or not, works without other changes.

IDX format (http://yann.lecun.com/exdb/mnist/): a 4-byte magic number
``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` big-endian uint32 sizes, then
the values in C order, big-endian.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_DATA_DIR",
    "MNIST_MEAN",
    "MNIST_STD",
    "IdxFormatError",
    "load_mnist",
    "read_idx",
]

#: The MNIST subset bundled with the repository (``examples/data/mnist``).
DEFAULT_DATA_DIR: Path = Path(__file__).resolve().parent.parent / "data" / "mnist"

#: Mean and standard deviation of the full MNIST training set's pixels in
#: [0, 1]; the usual normalisation constants.
MNIST_MEAN: float = 0.1307
MNIST_STD: float = 0.3081

_GZIP_MAGIC = b"\x1f\x8b"

# IDX dtype code -> (numpy dtype as stored, i.e. big-endian, readable name).
_IDX_DTYPES: dict[int, tuple[np.dtype, str]] = {
    0x08: (np.dtype("u1"), "uint8"),
    0x09: (np.dtype("i1"), "int8"),
    0x0B: (np.dtype(">i2"), "int16"),
    0x0C: (np.dtype(">i4"), "int32"),
    0x0D: (np.dtype(">f4"), "float32"),
    0x0E: (np.dtype(">f8"), "float64"),
}

# File name stems per split; each may be found as ``stem`` or ``stem + ".gz"``.
_SPLIT_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

_IMAGE_SHAPE = (28, 28)
_NUM_CLASSES = 10


class IdxFormatError(ValueError):
    """An IDX file is malformed, or does not hold what MNIST should.

    The message starts with the file's path and says what is wrong.
    """


def _read_bytes(path: Path) -> tuple[bytes, bool]:
    """Return the file's (decompressed) contents and whether it was gzipped."""
    data = path.read_bytes()
    if not data.startswith(_GZIP_MAGIC):
        return data, False
    try:
        return gzip.decompress(data), True
    except (OSError, EOFError, zlib.error) as exc:
        raise IdxFormatError(f"{path}: corrupt gzip data ({exc})") from exc


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file into a numpy array.

    The file may be gzip-compressed (recognised by the gzip magic bytes, not
    by its name) or raw. Supported IDX dtype codes: 0x08 uint8, 0x09 int8,
    0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64 (all big-endian on
    disk).

    Args:
        path: the file to read.

    Returns:
        A writable array in native byte order whose shape is the header's
        dimensions and whose dtype is the one the header names.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        IdxFormatError: the header is malformed (magic's first two bytes not
            zero, unknown dtype code, no dimensions, header cut short), the
            payload is shorter or longer than the dimensions call for, or the
            gzip data is corrupt. The message names the file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"IDX file not found: {p}")

    data, gzipped = _read_bytes(p)
    what = "decompressed file" if gzipped else "file"

    if len(data) < 4:
        raise IdxFormatError(
            f"{p}: {what} is {len(data)} bytes long, too short for the 4-byte IDX magic number"
        )
    zero0, zero1, code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0:
        raise IdxFormatError(
            f"{p}: bad IDX magic number 0x{data[:4].hex()}: the first two bytes must be zero"
            + ("" if gzipped else " (is it an IDX file?)")
        )
    if code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02X} {name}" for c, (_, name) in _IDX_DTYPES.items())
        raise IdxFormatError(f"{p}: unknown IDX dtype code 0x{code:02X} (known: {known})")
    if ndim < 1:
        raise IdxFormatError(f"{p}: IDX header gives 0 dimensions; at least 1 is required")

    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise IdxFormatError(
            f"{p}: {what} is {len(data)} bytes long, too short for the {header_len}-byte "
            f"header of a {ndim}-dimensional IDX array"
        )
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype, dtype_name = _IDX_DTYPES[code]

    count = math.prod(dims)
    expected = count * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        shape_txt = " x ".join(str(d) for d in dims)
        if dtype.itemsize == 1:
            says = f"{shape_txt} = {expected} bytes of {dtype_name}"
        else:
            says = f"{shape_txt} = {count} values of {dtype_name} = {expected} bytes"
        problem = "truncated" if actual < expected else f"{actual - expected} trailing bytes"
        raise IdxFormatError(
            f"{p}: header says {says}, {what} holds {actual} bytes after the "
            f"{header_len}-byte header ({problem})"
        )

    array = np.frombuffer(data, dtype=dtype, count=count, offset=header_len)
    return array.reshape(dims).astype(dtype.newbyteorder("="), copy=True)


def _find_file(data_dir: Path, stem: str) -> Path:
    """Return ``data_dir/stem.gz`` or ``data_dir/stem``, whichever exists (gzip first)."""
    for name in (stem + ".gz", stem):
        candidate = data_dir / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"MNIST file not found in {data_dir}: expected {stem}.gz or {stem} "
        f"(standard MNIST file names: "
        + ", ".join(f"{s}[.gz]" for pair in _SPLIT_FILES.values() for s in pair)
        + ")"
    )


def load_mnist(
    data_dir: str | os.PathLike[str] | None = None, split: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
    """Load one split of MNIST (or the bundled subset) from IDX files.

    Looks in ``data_dir`` for ``train-images-idx3-ubyte`` and
    ``train-labels-idx1-ubyte`` (split ``"train"``) or
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (split
    ``"test"``), each either gzip-compressed with a ``.gz`` suffix or raw
    (the ``.gz`` name is used when both exist).

    Args:
        data_dir: folder holding the files; ``None`` means the bundled subset,
            ``DEFAULT_DATA_DIR``.
        split: ``"train"`` or ``"test"``.

    Returns:
        ``(images, labels)``: images as a float32 array of shape ``(N, 784)``,
        pixels scaled to [0, 1] then normalised as
        ``(x - MNIST_MEAN) / MNIST_STD``; labels as an int64 array of shape
        ``(N,)`` with values 0..9.

    Raises:
        ValueError: ``split`` is neither ``"train"`` nor ``"test"``.
        FileNotFoundError: ``data_dir`` or one of the files is missing; the
            message names the folder and the expected file names.
        IdxFormatError: a file is malformed, the images are not N x 28 x 28
            uint8, the labels are not N uint8 values in 0..9, or the two
            counts differ.
    """
    if split not in _SPLIT_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    directory = DEFAULT_DATA_DIR if data_dir is None else Path(data_dir).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(
            f"MNIST data folder not found: {directory} (it should hold "
            + ", ".join(f"{s}[.gz]" for s in _SPLIT_FILES[split])
            + ")"
        )

    image_stem, label_stem = _SPLIT_FILES[split]
    image_path = _find_file(directory, image_stem)
    label_path = _find_file(directory, label_stem)
    images = read_idx(image_path)
    labels = read_idx(label_path)

    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != _IMAGE_SHAPE:
        raise IdxFormatError(
            f"{image_path}: expected uint8 images of shape N x 28 x 28, got "
            f"{images.dtype} of shape {' x '.join(map(str, images.shape))}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise IdxFormatError(
            f"{label_path}: expected a 1-D array of uint8 labels, got "
            f"{labels.dtype} of shape {' x '.join(map(str, labels.shape))}"
        )
    if images.shape[0] != labels.shape[0]:
        raise IdxFormatError(
            f"{image_path} holds {images.shape[0]} images but {label_path} holds "
            f"{labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) >= _NUM_CLASSES:
        bad = np.flatnonzero(labels >= _NUM_CLASSES)
        raise IdxFormatError(
            f"{label_path}: {bad.size} label(s) outside 0..9, the first {int(labels[bad[0]])} "
            f"at index {int(bad[0])}"
        )

    x = images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(255.0)
    x -= np.float32(MNIST_MEAN)
    x /= np.float32(MNIST_STD)
    return x, labels.astype(np.int64)
