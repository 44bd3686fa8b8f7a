import pytest

from kvtier.errors import ConfigError
from kvtier.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 2**30), ("1.5 GB", 1_500_000_000), ("512mib", 512 * 2**20), ("4096", 4096),
    (4096, 4096), ("1KiB", 1024), ("2TiB", 2 * 2**40), ("0", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["8 GiBs", "", "GiB", "-1", -5, 1.5, True, None, "1e3", "0.5", "0.9B"])
def test_parse_bytes_rejects_with_a_hint(bad):
    with pytest.raises(ConfigError, match="size|bytes"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(8 * 2**30) == "8.00 GiB"
