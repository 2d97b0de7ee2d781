import pytest

from osdp_jax import format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9), ("1.5 GiB", 3 * 2**29), ("2G", 2 * 2**30),
    ("100", 100), (4096, 4096), ("1e3kB", 10**6),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["8 parsecs", "", "-1GB", "GB", 0, True, 0.5, "0.5B", float("nan"), float("inf")])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(12) == "12 B"
