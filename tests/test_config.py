"""EngineConfig: size parsing, validation messages, env overrides."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from tiered_kv.config import EngineConfig, format_size, parse_size
from tiered_kv.errors import ConfigError, TieredKVError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


# -- parse_size ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1, 1),
        (123456789, 123456789),
        ("0", 0),
        ("4096", 4096),
        ("8GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("512 MiB", 512 * MiB),
        ("  512MiB  ", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("2KiB", 2 * KiB),
        ("1TiB", TiB),
        ("3KB", 3000),
        ("3k", 3000),
        ("7MB", 7_000_000),
        ("2T", 2 * 1000**4),
        ("100B", 100),
        ("100 b", 100),
        ("0.5GiB", GiB // 2),
    ],
)
def test_parse_size_accepts(value: int | str, expected: int) -> None:
    result = parse_size(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # Decimal sizes that are a whole number of bytes must parse exactly, not one byte short
        # (binary floating point gives 4.1 * 10**6 == 4099999.9999999995).
        ("4.1MB", 4_100_000),
        ("8.2GB", 8_200_000_000),
        ("1.005KB", 1005),
        # Plain integers given as strings are byte counts and must not lose precision.
        ("9007199254740993", 2**53 + 1),
    ],
)
def test_parse_size_is_exact_for_whole_byte_counts(value: str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", "abc", "GiB", "8 GiBs", "8XB", "-1", "-1GiB", "1e9", "1,5GB", "8 G iB", "0x10", "1..5GB"],
)
def test_parse_size_rejects_bad_strings_naming_the_field(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, name="l1_size")
    message = str(info.value)
    assert message.startswith("l1_size:")
    assert repr(value) in message


@pytest.mark.parametrize("value", [-1, -(2**40)])
def test_parse_size_rejects_negative_ints(value: int) -> None:
    with pytest.raises(ConfigError, match=r"^l2_size: size must be >= 0"):
        parse_size(value, name="l2_size")


@pytest.mark.parametrize("value", [True, False])
def test_parse_size_rejects_bools(value: bool) -> None:
    with pytest.raises(ConfigError, match=r"^l1_size: expected a size"):
        parse_size(value, name="l1_size")


@pytest.mark.parametrize("value", [1.5, None, b"8GiB", [1]])
def test_parse_size_rejects_other_types(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^l1_size: expected int or str"):
        parse_size(value, name="l1_size")  # type: ignore[arg-type]


def test_config_error_is_a_tiered_kv_error_and_a_value_error() -> None:
    with pytest.raises(TieredKVError):
        parse_size("nope")
    with pytest.raises(ValueError):
        parse_size("nope")


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536 * MiB, "1.5 GiB"),
        (5 * TiB, "5.0 TiB"),
    ],
)
def test_format_size(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


# -- EngineConfig validation ---------------------------------------------------------------
def test_defaults_are_normalized_to_ints() -> None:
    config = EngineConfig()
    assert config.chunk_size == 256
    assert config.l1_size == GiB
    assert config.l2_size == 16 * GiB
    assert config.l1_bytes == GiB
    assert config.l2_bytes == 16 * GiB
    assert config.l2_path is None
    assert config.l3_url is None
    assert config.pin_memory is None


def test_sizes_given_as_strings_are_stored_as_ints() -> None:
    config = EngineConfig(l1_size="512 MiB", l2_size="2GB")
    assert config.l1_size == 512 * MiB
    assert config.l2_size == 2_000_000_000


def test_config_is_frozen() -> None:
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunk_size = 16  # type: ignore[misc]


@pytest.mark.parametrize("chunk_size", [1, 16, 256, 1 << 20])
def test_chunk_size_in_bounds(chunk_size: int) -> None:
    assert EngineConfig(chunk_size=chunk_size).chunk_size == chunk_size


@pytest.mark.parametrize("chunk_size", [0, -1, (1 << 20) + 1])
def test_chunk_size_out_of_bounds(chunk_size: int) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(chunk_size=chunk_size)
    message = str(info.value)
    assert message.startswith("chunk_size:")
    assert "[1, 1048576]" in message
    assert str(chunk_size) in message


@pytest.mark.parametrize("chunk_size", [True, 16.0, "16", None])
def test_chunk_size_wrong_type(chunk_size: object) -> None:
    with pytest.raises(ConfigError, match=r"^chunk_size: expected int"):
        EngineConfig(chunk_size=chunk_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("l1_size", [0, "0", "0GiB"])
def test_l1_size_zero(l1_size: int | str) -> None:
    with pytest.raises(ConfigError, match=r"^l1_size: must be > 0"):
        EngineConfig(l1_size=l1_size)


def test_bad_sizes_name_their_field() -> None:
    with pytest.raises(ConfigError, match=r"^l1_size: cannot parse size 'lots'"):
        EngineConfig(l1_size="lots")
    with pytest.raises(ConfigError, match=r"^l2_size: size must be >= 0"):
        EngineConfig(l2_size=-5)


def test_l2_size_zero_is_allowed() -> None:
    assert EngineConfig(l2_size=0).l2_size == 0


@pytest.mark.parametrize("queue", [0, -3])
def test_lower_write_queue_below_one(queue: int) -> None:
    with pytest.raises(ConfigError, match=rf"^lower_write_queue: must be >= 1, got {queue}$"):
        EngineConfig(lower_write_queue=queue)


@pytest.mark.parametrize("queue", [True, 2.0, "4"])
def test_lower_write_queue_wrong_type(queue: object) -> None:
    with pytest.raises(ConfigError, match=r"^lower_write_queue: expected int"):
        EngineConfig(lower_write_queue=queue)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379",
        "rediss://:pw@cache:6380/1",
        "valkey://localhost",
        "redis+cluster://10.0.0.1:7000",
        "tkv://127.0.0.1:7000",
    ],
)
def test_l3_url_is_accepted(url: str) -> None:
    assert EngineConfig(l3_url=url).l3_url == url


def test_lower_write_queue_bounds_every_lower_tier_and_has_no_other_name() -> None:
    assert EngineConfig().lower_write_queue == 4096
    assert EngineConfig(lower_write_queue=9).lower_write_queue == 9
    assert EngineConfig.from_env({"TIERED_KV_LOWER_WRITE_QUEUE": "11"}).lower_write_queue == 11
    with pytest.raises(TypeError, match="l2_write_queue"):
        EngineConfig(l2_write_queue=7)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "url", ["", "memcached://h:1", "tkv://127.0.0.1", "tkv://:7000", "redis://h:notaport"]
)
def test_bad_l3_url_is_refused(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(l3_url=url)
    message = str(info.value)
    assert message.startswith("l3_url:")
    assert repr(url) in message


def test_l3_options_validate_and_come_from_env() -> None:
    with pytest.raises(ConfigError, match=r"^l3_timeout_s:"):
        EngineConfig(l3_timeout_s=0)
    with pytest.raises(ConfigError, match=r"^l3_ttl_s:"):
        EngineConfig(l3_ttl_s=-1)
    with pytest.raises(ConfigError, match=r"^l3_pool_size:"):
        EngineConfig(l3_pool_size=0)
    config = EngineConfig.from_env(
        {
            "TIERED_KV_L3_URL": "tkv://h:1",
            "TIERED_KV_L3_TIMEOUT_S": "0.5",
            "TIERED_KV_L3_TTL_S": "60",
            "TIERED_KV_L3_POOL_SIZE": "2",
            "TIERED_KV_L3_KEY_PREFIX": "p",
            "TIERED_KV_L3_TOKEN_FILE": "/t",
        }
    )
    assert (config.l3_timeout_s, config.l3_ttl_s, config.l3_pool_size) == (0.5, 60.0, 2)
    assert (config.l3_key_prefix, config.l3_token_file) == ("p", "/t")
    assert EngineConfig().l3_pool_size is None  # sized from the machine by the connector
    assert EngineConfig.from_env({"TIERED_KV_L3_POOL_SIZE": "auto"}).l3_pool_size is None
    with pytest.raises(ConfigError, match=r"^l3_pool_size: expected None or an int"):
        EngineConfig(l3_pool_size="4")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["namespace", "fingerprint"])
def test_namespace_and_fingerprint_must_be_str(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: expected str"):
        EngineConfig(**{field: 7})


@pytest.mark.parametrize("timeout", [-0.1, float("nan")])
def test_close_timeout_must_be_non_negative(timeout: float) -> None:
    with pytest.raises(ConfigError, match=r"^close_timeout_s: must be >= 0"):
        EngineConfig(close_timeout_s=timeout)


def test_l2_path_accepts_path_like(tmp_path: pathlib.Path) -> None:
    config = EngineConfig(l2_path=tmp_path)  # type: ignore[arg-type]
    assert config.l2_path == str(tmp_path)
    assert isinstance(config.l2_path, str)


# -- from_env --------------------------------------------------------------------------------
def test_from_env_empty_environ_gives_defaults() -> None:
    assert EngineConfig.from_env({}) == EngineConfig()


def test_from_env_ignores_unrelated_variables() -> None:
    environ = {"PATH": "/bin", "TIERED_KV": "x", "TIERED_KV_UNKNOWN_KNOB": "1"}
    assert EngineConfig.from_env(environ) == EngineConfig()


def test_from_env_reads_sizes_and_ints() -> None:
    environ = {
        "TIERED_KV_L1_SIZE": "8GiB",
        "TIERED_KV_L2_SIZE": "1.5GB",
        "TIERED_KV_CHUNK_SIZE": "64",
        "TIERED_KV_LOWER_WRITE_QUEUE": " 12 ",
        "TIERED_KV_CLOSE_TIMEOUT_S": "2.5",
        "TIERED_KV_NAMESPACE": "tenant-a",
        "TIERED_KV_FINGERPRINT": "v3",
        "TIERED_KV_L2_PATH": "/var/cache/tkv",
    }
    config = EngineConfig.from_env(environ)
    assert config.l1_size == 8 * GiB
    assert config.l2_size == 1_500_000_000
    assert config.chunk_size == 64
    assert config.lower_write_queue == 12
    assert config.close_timeout_s == 2.5
    assert config.namespace == "tenant-a"
    assert config.fingerprint == "v3"
    assert config.l2_path == "/var/cache/tkv"


def test_from_env_empty_l2_path_disables_l2() -> None:
    assert EngineConfig.from_env({"TIERED_KV_L2_PATH": ""}).l2_path is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("auto", None),
        ("AUTO", None),
        ("", None),
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("on", True),
        ("false", False),
        (" FALSE ", False),
        ("0", False),
        ("no", False),
        ("off", False),
    ],
)
def test_from_env_pin_memory(raw: str, expected: bool | None) -> None:
    assert EngineConfig.from_env({"TIERED_KV_PIN_MEMORY": raw}).pin_memory is expected


@pytest.mark.parametrize("raw", ["none", "batched", "per_write"])
def test_from_env_l2_durability(raw: str) -> None:
    config = EngineConfig.from_env({"TIERED_KV_L2_DURABILITY": raw})
    assert config.l2_durability == raw


def test_l2_durability_and_its_interval_are_checked() -> None:
    assert EngineConfig().l2_durability == "batched"
    with pytest.raises(ConfigError, match=r"l2_durability: expected one of .*'fsync'"):
        EngineConfig(l2_durability="fsync")  # type: ignore[arg-type]
    for bad in (0, -1.0, True, "0.1"):
        with pytest.raises(ConfigError, match="l2_sync_interval_s: expected a number > 0"):
            EngineConfig(l2_sync_interval_s=bad)  # type: ignore[arg-type]
    assert EngineConfig.from_env({"TIERED_KV_L2_SYNC_INTERVAL_S": "0.5"}).l2_sync_interval_s == 0.5


def test_from_env_bad_bool() -> None:
    with pytest.raises(
        ConfigError, match=r"^TIERED_KV_PIN_MEMORY: expected true/false, got 'maybe'"
    ):
        EngineConfig.from_env({"TIERED_KV_PIN_MEMORY": "maybe"})


@pytest.mark.parametrize("name", ["CHUNK_SIZE", "LOWER_WRITE_QUEUE"])
@pytest.mark.parametrize("raw", ["abc", "1.5", "", "12k"])
def test_from_env_bad_ints(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_env({f"TIERED_KV_{name}": raw})
    message = str(info.value)
    assert message.startswith(f"TIERED_KV_{name}: expected an int")
    assert repr(raw) in message


def test_from_env_bad_float() -> None:
    with pytest.raises(ConfigError, match=r"^TIERED_KV_CLOSE_TIMEOUT_S: expected a number"):
        EngineConfig.from_env({"TIERED_KV_CLOSE_TIMEOUT_S": "soon"})


def test_from_env_bad_size_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^l1_size: cannot parse size '8 gigs'"):
        EngineConfig.from_env({"TIERED_KV_L1_SIZE": "8 gigs"})


def test_from_env_values_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"^chunk_size: must be in"):
        EngineConfig.from_env({"TIERED_KV_CHUNK_SIZE": "0"})
    with pytest.raises(ConfigError, match=r"^l3_url:"):
        EngineConfig.from_env({"TIERED_KV_L3_URL": "redis:/x"})


def test_from_env_empty_l3_url_means_none() -> None:
    assert EngineConfig.from_env({"TIERED_KV_L3_URL": ""}).l3_url is None


def test_overrides_beat_env() -> None:
    environ = {
        "TIERED_KV_L1_SIZE": "8GiB",
        "TIERED_KV_CHUNK_SIZE": "64",
        "TIERED_KV_PIN_MEMORY": "true",
        "TIERED_KV_NAMESPACE": "from-env",
    }
    config = EngineConfig.from_env(
        environ, l1_size="2GiB", chunk_size=32, pin_memory=False, namespace="explicit"
    )
    assert config.l1_size == 2 * GiB
    assert config.chunk_size == 32
    assert config.pin_memory is False
    assert config.namespace == "explicit"


def test_overrides_without_env_vars_apply() -> None:
    config = EngineConfig.from_env({}, lower_write_queue=3)
    assert config.lower_write_queue == 3
    assert config.l1_size == GiB


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERED_KV_CHUNK_SIZE", "48")
    monkeypatch.setenv("TIERED_KV_L1_SIZE", "3MiB")
    config = EngineConfig.from_env()
    assert config.chunk_size == 48
    assert config.l1_size == 3 * MiB


def test_layerwise_is_auto_by_default_and_read_from_the_environment() -> None:
    assert EngineConfig().layerwise is None
    assert EngineConfig.from_env({"TIERED_KV_LAYERWISE": "off"}).layerwise is False
    assert EngineConfig.from_env({"TIERED_KV_LAYERWISE": "on"}).layerwise is True
    assert EngineConfig.from_env({"TIERED_KV_LAYERWISE": "auto"}).layerwise is None
    with pytest.raises(ConfigError, match="layerwise"):
        EngineConfig(layerwise="yes")  # type: ignore[arg-type]
