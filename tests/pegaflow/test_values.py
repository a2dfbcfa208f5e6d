"""pegaflow.values: sizes, flags and the version as people write and read them."""

from __future__ import annotations

import pytest

from pegaflow.errors import ConfigError
from pegaflow.values import as_bool, format_size, package_version, parse_size, version_line


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("100", 100),
    ("64KiB", 64 << 10), ("2TiB", 2 << 40), ("8kb", 8000), ("3 mib", 3 << 20), (" 7G ", 7 << 30),
    ("10B", 10), ("1.5KiB", 1536), ("0", 0), ("2MB", 2_000_000), ("3TB", 3 * 10**12), ("5M", 5 << 20),
])
def test_parse_size_units_give_bytes(text, expected):
    # 1. Binary (KiB, G) and decimal (GB, kb) units, any case, spaces around.
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 GiBs", "4XB", "-1", "1e9", "4 G iB", "1,5GB", "0x10", "four"])
def test_parse_size_bad_text_raises_config_error(text):
    # 1. Anything else is refused with the offending text in the message.
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("num_bytes,text", [
    (0, "0 B"), (512, "512 B"), (1024, "1.0 KiB"), (3 << 20, "3.0 MiB"), (64 << 30, "64.0 GiB"),
    (5 << 40, "5.0 TiB"), (1536, "1.5 KiB"),
])
def test_format_size_picks_a_unit_that_shows_the_size(num_bytes, text):
    # A 3 MiB pool use reads "3.0 MiB", not "0.00 GiB"; a 1 KiB slab "1.0 KiB", not "0 MiB".
    assert format_size(num_bytes) == text


@pytest.mark.parametrize("text,value", [("1", True), ("On", True), ("yes", True), ("0", False),
                                        ("off", False), ("FALSE", False), (True, True)])
def test_as_bool_accepts_the_usual_spellings(text, value):
    assert as_bool("k", text) is value


def test_as_bool_anything_else_is_a_config_error():
    with pytest.raises(ConfigError, match="k='maybe'"):
        as_bool("k", "maybe")


def test_version_is_the_installed_release_and_names_the_wire_protocol():
    import pegaflow
    from pegaflow.wire import WIRE_VERSION
    assert pegaflow.__version__ == package_version() != "0+unknown"
    assert version_line("prog") == f"prog {pegaflow.__version__} (wire protocol v{WIRE_VERSION})"
