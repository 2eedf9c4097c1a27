"""Tests for examples/common/mnist.py and the bundled MNIST subset."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from examples.common.mnist import (
    DEFAULT_DATA_DIR,
    MNIST_MEAN,
    MNIST_STD,
    IdxFormatError,
    load_mnist,
    read_idx,
)

_CODES = {
    np.dtype("u1"): 0x08,
    np.dtype("i1"): 0x09,
    np.dtype("i2"): 0x0B,
    np.dtype("i4"): 0x0C,
    np.dtype("f4"): 0x0D,
    np.dtype("f8"): 0x0E,
}


def idx_bytes(array: np.ndarray, code: int | None = None) -> bytes:
    """Encode ``array`` as IDX (big-endian), optionally forcing the dtype code."""
    code = _CODES[array.dtype.newbyteorder("=")] if code is None else code
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, payload: bytes, gz: bool) -> Path:
    path.write_bytes(gzip.compress(payload) if gz else payload)
    return path


# ---------------------------------------------------------------- read_idx


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([-128, -1, 0, 1, 127], dtype=np.int8),
        np.array([[-32768, 258], [32767, -2]], dtype=np.int16),
        np.array([-(2**31), 2**31 - 1, 16909060], dtype=np.int32),
        np.array([[1.5, -2.25, np.inf]], dtype=np.float32),
        np.array([np.pi, -1e300, 0.0], dtype=np.float64),
        np.zeros((0, 28, 28), dtype=np.uint8),
    ],
    ids=["uint8", "int8", "int16", "int32", "float32", "float64", "empty"],
)
def test_read_idx_round_trip(tmp_path: Path, array: np.ndarray, gz: bool) -> None:
    # Deliberately misleading name for the gzip case: detection must go by content.
    path = write(tmp_path / "data.idx", idx_bytes(array), gz)
    out = read_idx(path)
    assert out.dtype == array.dtype
    assert out.dtype.isnative
    assert out.shape == array.shape
    np.testing.assert_array_equal(out, array)
    assert out.flags.writeable


def test_read_idx_accepts_str_path(tmp_path: Path) -> None:
    array = np.array([7, 8, 9], dtype=np.uint8)
    path = write(tmp_path / "x-idx1-ubyte", idx_bytes(array), gz=False)
    np.testing.assert_array_equal(read_idx(str(path)), array)


def _assert_error(path: Path, match: str) -> None:
    with pytest.raises(IdxFormatError, match=match) as info:
        read_idx(path)
    assert path.name in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_truncated_payload(tmp_path: Path, gz: bool) -> None:
    full = idx_bytes(np.zeros((10, 28, 28), dtype=np.uint8))
    path = write(tmp_path / "train-images-idx3-ubyte", full[:-5], gz)
    _assert_error(path, r"10 x 28 x 28 = 7840 bytes of uint8.*holds 7835 bytes.*truncated")


def test_truncated_payload_multibyte(tmp_path: Path) -> None:
    full = idx_bytes(np.zeros((2, 3), dtype=np.int32))
    path = write(tmp_path / "ints.idx", full[:-1], gz=False)
    _assert_error(path, r"2 x 3 = 6 values of int32 = 24 bytes.*holds 23 bytes")


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_trailing_bytes(tmp_path: Path, gz: bool) -> None:
    full = idx_bytes(np.zeros(4, dtype=np.uint8))
    path = write(tmp_path / "labels-idx1-ubyte", full + b"\x00\x00\x00", gz)
    _assert_error(path, r"3 trailing bytes")


def test_truncated_header(tmp_path: Path) -> None:
    path = write(tmp_path / "short.idx", bytes([0, 0, 8, 3]) + b"\x00\x00\x00\x02", gz=False)
    _assert_error(path, r"too short for the 16-byte header")
    path = write(tmp_path / "tiny.idx", b"\x00\x00", gz=False)
    _assert_error(path, r"too short")


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_bad_magic(tmp_path: Path, gz: bool) -> None:
    data = bytearray(idx_bytes(np.zeros(3, dtype=np.uint8)))
    data[1] = 0x01
    path = write(tmp_path / "bad-magic-idx1-ubyte", bytes(data), gz)
    _assert_error(path, r"magic")


def test_text_file_is_not_idx(tmp_path: Path) -> None:
    path = write(tmp_path / "notes.txt", b"hello world\n", gz=False)
    _assert_error(path, r"magic")


def test_unknown_dtype_code(tmp_path: Path) -> None:
    path = write(tmp_path / "odd.idx", idx_bytes(np.zeros(3, dtype=np.uint8), code=0x0A), gz=False)
    _assert_error(path, r"unknown IDX dtype code 0x0A")


def test_zero_dims(tmp_path: Path) -> None:
    path = write(tmp_path / "scalar.idx", bytes([0, 0, 8, 0]) + b"\x05", gz=False)
    _assert_error(path, r"0 dimensions")


def test_corrupt_gzip(tmp_path: Path) -> None:
    blob = gzip.compress(idx_bytes(np.arange(100, dtype=np.uint8)))
    path = tmp_path / "broken.gz"
    path.write_bytes(blob[: len(blob) // 2])
    _assert_error(path, r"corrupt gzip")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere-idx3-ubyte.gz"
    with pytest.raises(FileNotFoundError, match="nowhere-idx3-ubyte.gz"):
        read_idx(path)


# --------------------------------------------------------------- load_mnist


def make_mnist_dir(
    root: Path,
    n: int = 6,
    gz: bool = True,
    prefix: str = "train",
    labels: np.ndarray | None = None,
    images: np.ndarray | None = None,
) -> Path:
    rng = np.random.default_rng(0)
    if images is None:
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    if labels is None:
        labels = (np.arange(n) % 10).astype(np.uint8)
    suffix = ".gz" if gz else ""
    write(root / f"{prefix}-images-idx3-ubyte{suffix}", idx_bytes(images), gz)
    write(root / f"{prefix}-labels-idx1-ubyte{suffix}", idx_bytes(labels), gz)
    return root


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
@pytest.mark.parametrize("split,prefix", [("train", "train"), ("test", "t10k")])
def test_load_mnist_tiny(tmp_path: Path, gz: bool, split: str, prefix: str) -> None:
    images = np.zeros((3, 28, 28), dtype=np.uint8)
    images[1] = 255
    images[2, 0, 0] = 51
    labels = np.array([0, 9, 4], dtype=np.uint8)
    make_mnist_dir(tmp_path, gz=gz, prefix=prefix, labels=labels, images=images)
    x, y = load_mnist(tmp_path, split=split)
    assert x.dtype == np.float32 and x.shape == (3, 784)
    assert y.dtype == np.int64 and y.shape == (3,)
    np.testing.assert_array_equal(y, [0, 9, 4])
    np.testing.assert_allclose(x[0], -MNIST_MEAN / MNIST_STD, rtol=1e-6)
    np.testing.assert_allclose(x[1], (1.0 - MNIST_MEAN) / MNIST_STD, rtol=1e-6)
    np.testing.assert_allclose(x[2, 0], (51 / 255 - MNIST_MEAN) / MNIST_STD, rtol=1e-6)


def test_load_mnist_str_dir(tmp_path: Path) -> None:
    make_mnist_dir(tmp_path)
    x, y = load_mnist(str(tmp_path))
    assert x.shape == (6, 784) and y.shape == (6,)


def test_load_mnist_bad_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split"):
        load_mnist(tmp_path, split="validation")


def test_load_mnist_label_out_of_range(tmp_path: Path) -> None:
    make_mnist_dir(tmp_path, labels=np.array([0, 1, 2, 10, 4, 5], dtype=np.uint8))
    with pytest.raises(IdxFormatError, match=r"train-labels-idx1-ubyte.gz.*outside 0\.\.9"):
        load_mnist(tmp_path)


def test_load_mnist_count_mismatch(tmp_path: Path) -> None:
    make_mnist_dir(tmp_path, n=6, labels=np.arange(5, dtype=np.uint8))
    with pytest.raises(IdxFormatError, match=r"6 images.*5 labels") as info:
        load_mnist(tmp_path)
    assert "train-images-idx3-ubyte.gz" in str(info.value)
    assert "train-labels-idx1-ubyte.gz" in str(info.value)


def test_load_mnist_wrong_image_shape(tmp_path: Path) -> None:
    make_mnist_dir(tmp_path, images=np.zeros((6, 32, 32), dtype=np.uint8))
    with pytest.raises(IdxFormatError, match=r"train-images-idx3-ubyte.gz.*28 x 28"):
        load_mnist(tmp_path)


def test_load_mnist_wrong_dtype(tmp_path: Path) -> None:
    make_mnist_dir(tmp_path, labels=np.arange(6, dtype=np.int32))
    with pytest.raises(IdxFormatError, match=r"train-labels-idx1-ubyte.gz.*uint8"):
        load_mnist(tmp_path)


def test_load_mnist_missing_file(tmp_path: Path) -> None:
    make_mnist_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg
    assert "train-labels-idx1-ubyte" in msg
    # The test split's files are absent altogether.
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        load_mnist(tmp_path, split="test")


def test_load_mnist_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_mnist(tmp_path / "does-not-exist")


# ------------------------------------------------------------ bundled data


def test_bundled_files_present() -> None:
    names = {p.name for p in DEFAULT_DATA_DIR.iterdir()}
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert stem + ".gz" in names
    size = sum(p.stat().st_size for p in DEFAULT_DATA_DIR.glob("*.gz"))
    assert size <= 1_600_000


def test_bundled_raw_idx() -> None:
    images = read_idx(DEFAULT_DATA_DIR / "train-images-idx3-ubyte.gz")
    assert images.dtype == np.uint8 and images.shape == (4000, 28, 28)
    assert images.max() == 255 and images.min() == 0
    labels = read_idx(DEFAULT_DATA_DIR / "t10k-labels-idx1-ubyte.gz")
    assert labels.dtype == np.uint8 and labels.shape == (1000,)


@pytest.mark.parametrize("split,n", [("train", 4000), ("test", 1000)])
def test_bundled_load(split: str, n: int) -> None:
    x, y = load_mnist(split=split)
    assert x.shape == (n, 784) and x.dtype == np.float32
    assert y.shape == (n,) and y.dtype == np.int64
    # Stratified split: every class appears exactly n / 10 times.
    np.testing.assert_array_equal(np.bincount(y, minlength=10), [n // 10] * 10)
    assert abs(float(x.mean())) < 0.05
    assert 0.9 < float(x.std()) < 1.1
    assert np.isclose(x.min(), -MNIST_MEAN / MNIST_STD, rtol=1e-5)
    assert np.isclose(x.max(), (1 - MNIST_MEAN) / MNIST_STD, rtol=1e-5)


def test_bundled_splits_disjoint() -> None:
    x_train, _ = load_mnist(split="train")
    x_test, _ = load_mnist(split="test")
    train_rows = {row.tobytes() for row in x_train}
    assert not any(row.tobytes() in train_rows for row in x_test)
