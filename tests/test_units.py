import pytest

from sonar.units import (
    AUTO_MAX_MODEL_LEN,
    format_memory_size,
    parse_human_int,
    parse_max_model_len,
    parse_memory_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("8192", 8192),
        (" 4096 ", 4096),
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25_600),
        ("32k", 32_000),
        ("32K", 32_768),
        ("1m", 1_000_000),
        ("1M", 1_048_576),
        ("2M", 2_097_152),
        ("1.5m", 1_500_000),
        ("1g", 1_000_000_000),
        ("1G", 1_073_741_824),
        ("0.5g", 500_000_000),
        ("2t", 2 * 10**12),
        ("1T", 2**40),
        (1234, 1234),
    ],
)
def test_parse_human_int(text: str | int, expected: int) -> None:
    assert parse_human_int(text) == expected


def test_decimal_suffix_is_exact() -> None:
    # 25.6 * 1000 in binary floating point is 25599.999...; the parser must not truncate.
    assert parse_human_int("25.6k") == 25_600
    assert parse_human_int("0.3k") == 300
    assert parse_human_int("1.001m") == 1_001_000


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "invalid human-readable integer ''"),
        ("abc", "'abc'"),
        ("1.5K", "did you mean '1.5k'"),
        ("1.0M", "fractions are allowed only with decimal suffixes"),
        ("1.0005k", "not a whole number"),
        ("1.5", "a fraction needs a suffix"),
        ("-5", "'-5'"),
        ("1kb", "'1kb'"),
        ("1 k", "'1 k'"),
        ("1e3", "'1e3'"),
        ("k", "'k'"),
    ],
)
def test_parse_human_int_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="invalid") as info:
        parse_human_int(text)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value", [-1, True, 1.5, None])
def test_parse_human_int_rejects_non_strings(value: object) -> None:
    with pytest.raises(ValueError, match="invalid"):
        parse_human_int(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", AUTO_MAX_MODEL_LEN),
        ("AUTO", AUTO_MAX_MODEL_LEN),
        ("-1", AUTO_MAX_MODEL_LEN),
        (-1, AUTO_MAX_MODEL_LEN),
        ("32768", 32_768),
        ("32k", 32_000),
        ("32K", 32_768),
        ("25.6k", 25_600),
        (4096, 4096),
    ],
)
def test_parse_max_model_len(text: str | int, expected: int) -> None:
    assert parse_max_model_len(text) == expected


@pytest.mark.parametrize("text", ["0", 0, "-2", -2, "lots", "1.5K"])
def test_parse_max_model_len_rejects(text: str | int) -> None:
    with pytest.raises(ValueError, match="max model length") as info:
        parse_max_model_len(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 2**30),
        (2**30, 2**30),
        ("2G", 2 * 2**30),
        ("2g", 2 * 10**9),
        ("512M", 512 * 2**20),
        ("1.5GiB", 1_610_612_736),
        ("1.5 GiB", 1_610_612_736),
        ("1.5gib", 1_610_612_736),
        ("8GB", 8 * 10**9),
        ("8 gb", 8 * 10**9),
        ("64KiB", 65_536),
        ("64kb", 64_000),
        ("100B", 100),
        ("2TiB", 2 * 2**40),
        ("1.5G", 1_610_612_736),
        ("25.6k", 25_600),
        ("0.5KiB", 512),
        ("1.1GiB", 1_181_116_006),
    ],
)
def test_parse_memory_size(text: str | int, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["1K", "1k", "32K", "25.6k", "2M", "1g", "4096"])
def test_memory_size_agrees_with_human_int(text: str) -> None:
    assert parse_memory_size(text) == parse_human_int(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("2GX", "unknown unit 'GX'"),
        ("two gigs", "'two gigs'"),
        ("-1G", "'-1G'"),
        ("", "''"),
        ("GiB", "'GiB'"),
    ],
)
def test_parse_memory_size_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="invalid memory size") as info:
        parse_memory_size(text)
    assert fragment in str(info.value)


def test_parse_memory_size_rejects_negative_int() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        parse_memory_size(-1)


def test_format_memory_size() -> None:
    assert format_memory_size(1_610_612_736) == "1.50 GiB"
    assert format_memory_size(512 * 2**20) == "512.00 MiB"
    assert format_memory_size(100) == "100 B"
    assert parse_memory_size(format_memory_size(3 * 2**30).replace(" ", "")) == 3 * 2**30
