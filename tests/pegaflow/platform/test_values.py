"""pegaflow.platform.values: sizes, flags and the version as people write and read them."""

from __future__ import annotations

import pytest

from pegaflow.platform.errors import ConfigError
from pegaflow.platform.values import as_bool, as_float, as_int, format_size, package_version, parse_size, version_line


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("100B", 100),
    ("64KiB", 64 << 10), ("2TiB", 2 << 40), ("8kb", 8000), ("3 mib", 3 << 20), (" 7G ", 7 << 30),
    ("10B", 10), ("1.5KiB", 1536), ("0", 0), ("2MB", 2_000_000), ("3TB", 3 * 10**12), ("5M", 5 << 20),
])
def test_parse_size_units_give_bytes(text, expected):
    # 1. Binary (KiB, G) and decimal (GB, kb) units, any case, spaces around.
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 GiBs", "4XB", "-1GiB", "1e9", "4 G iB", "1,5GB", "0x10", "four"])
def test_parse_size_bad_text_raises_config_error(text):
    # 1. Anything else is refused with the offending text in the message.
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["512", " 64 ", "1.5", "4294967296"])
def test_parse_size_without_a_unit_is_refused_naming_the_units(text):
    # 1. `--pool-size 512` meant 512 of something: a 512-byte pool is never what was asked.
    with pytest.raises(ConfigError, match="has no unit") as refused:
        parse_size(text)
    # 2. The message spells out what to write instead, bytes included.
    number = text.strip()
    assert f"{number}MiB" in str(refused.value) and f"{number}B " in str(refused.value)


@pytest.mark.parametrize("text", ["-5GiB", "-1", "-0.5MiB", " -2 KiB"])
def test_parse_size_negative_is_refused_as_negative(text):
    with pytest.raises(ConfigError, match="is negative"):
        parse_size(text)


def test_parse_size_zero_needs_no_unit():
    # 1. 0 is 0 in any unit: "--pin-rate 0" (no limit) stays as it was.
    assert parse_size("0") == parse_size("0GiB") == parse_size("-0") == 0


@pytest.mark.parametrize("raw,value", [(2, 2), ("64", 64), (" 7 ", 7), ("-3", -3)])
def test_as_int_takes_whole_numbers(raw, value):
    assert as_int("k", raw) == value


@pytest.mark.parametrize("raw", [2.7, "2.7", 2.0, True, False, "true", "", "1e3", None, [1]])
def test_as_int_anything_else_is_refused_never_rounded(raw):
    # 1. 2.7 never becomes 2, nor true 1: the value is named once, with the key.
    with pytest.raises(ConfigError) as refused:
        as_int("num_load_slots", raw)
    assert str(refused.value) == f"num_load_slots={raw!r}: expected a whole number"


@pytest.mark.parametrize("raw,value", [(2, 2.0), (7.5, 7.5), ("7.5", 7.5), (" 1e3 ", 1000.0)])
def test_as_float_takes_finite_numbers(raw, value):
    assert as_float("k", raw) == value


@pytest.mark.parametrize("raw", [float("nan"), float("inf"), "nan", "-inf", "Infinity", True, "fast", None])
def test_as_float_nan_inf_and_non_numbers_are_refused(raw):
    with pytest.raises(ConfigError) as refused:
        as_float("lookup_timeout_ms", raw)
    assert str(refused.value).startswith(f"lookup_timeout_ms={raw!r}: expected a")
    assert str(refused.value).count(repr(raw)) == 1


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
    from pegaflow.platform.wire import WIRE_VERSION
    assert pegaflow.__version__ == package_version() != "0+unknown"
    assert version_line("prog") == f"prog {pegaflow.__version__} (wire protocol v{WIRE_VERSION})"
