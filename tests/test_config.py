"""Settings: validation at construction, byte sizes, TRIOSERVE_* variables."""

from __future__ import annotations

import pytest

from trioserve.config import EngineConfig, parse_byte_size, settings_from_env


@pytest.mark.parametrize(("text", "value"), [("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1000", 1000), ("1.5KiB", 1536), ("3MB", 3_000_000)])
def test_byte_sizes(text, value):
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("text", ["", "12XB", "-5MiB", "0", "MiB"])
def test_bad_byte_sizes_say_what_is_expected(text):
    with pytest.raises(ValueError, match="must be"):
        parse_byte_size(text)


def test_engine_config_refuses_a_budget_that_cannot_hold_every_row():
    with pytest.raises(ValueError, match=r"prefill_budget \(8\) must exceed max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, prefill_budget=8)
    with pytest.raises(ValueError, match="max_queue must be positive, got 0"):
        EngineConfig(max_queue=0)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "250"])
def test_max_step_ms_is_a_number_of_milliseconds(value):
    with pytest.raises(ValueError, match=r"max_step_ms must be a number of milliseconds, 0 or more, got"):
        EngineConfig(max_step_ms=value)
    assert EngineConfig().max_step_ms == 0.0  # off
    assert settings_from_env({"TRIOSERVE_MAX_STEP_MS": "250"}).engine.max_step_ms == 250.0


def test_settings_from_env_reads_every_kind_of_value():
    s = settings_from_env(
        {
            "TRIOSERVE_MODEL": "/models/x.gguf",
            "TRIOSERVE_MAX_NUM_SEQS": "4",
            "TRIOSERVE_KV_CACHE_BYTES": "64MiB",
            "TRIOSERVE_API_KEY": "k",
            "TRIOSERVE_DRAIN_TIMEOUT": "2.5",
            "UNRELATED": "ignored",
        }
    )
    assert (s.engine.model, s.engine.max_num_seqs, s.engine.kv_cache_bytes) == ("/models/x.gguf", 4, 64 << 20)
    assert (s.api_key, s.drain_timeout_s) == (("k",), 2.5)  # the one key there is: a tuple, as --api-key may be given several times
    assert settings_from_env({}) == settings_from_env({"UNRELATED": "1"})


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"TRIOSERVE_MAX_NUM_SEQS": "many"}, "TRIOSERVE_MAX_NUM_SEQS: invalid literal"),
        ({"TRIOSERVE_KV_CACHE_BYTES": "lots"}, "TRIOSERVE_KV_CACHE_BYTES: must be a size"),
        ({"TRIOSERVE_MAX_NUM_SEQS": "600"}, "prefill_budget (512) must exceed max_num_seqs (600)"),
        ({"TRIOSERVE_MAX_STEP_MS": "soon"}, "TRIOSERVE_MAX_STEP_MS: could not convert string to float"),
    ],
)
def test_bad_env_values_name_the_variable(env, fragment):
    with pytest.raises(ValueError) as info:
        settings_from_env(env)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_timeouts_must_be_positive_finite_seconds(value):
    from trioserve.config import ServerSettings

    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        ServerSettings(drain_timeout_s=value)
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        ServerSettings(write_timeout_s=value)


def test_prefix_cache_flag_from_env():
    assert settings_from_env({"TRIOSERVE_PREFIX_CACHE": "off"}).engine.prefix_cache is False
    assert settings_from_env({}).engine.prefix_cache is True
    with pytest.raises(ValueError, match="TRIOSERVE_PREFIX_CACHE: must be true or false"):
        settings_from_env({"TRIOSERVE_PREFIX_CACHE": "maybe"})


def test_kv_huge_pages_from_flag_then_env_then_off():
    from trioserve.config import kv_huge_pages_setting

    assert settings_from_env({"TRIOSERVE_KV_HUGE_PAGES": "on"}).engine.kv_huge_pages is True
    assert settings_from_env({}).engine.kv_huge_pages is False
    assert kv_huge_pages_setting(None, {}) is False
    assert kv_huge_pages_setting(None, {"TRIOSERVE_KV_HUGE_PAGES": "yes"}) is True
    assert kv_huge_pages_setting(True, {"TRIOSERVE_KV_HUGE_PAGES": "no"}) is True
    with pytest.raises(ValueError, match="TRIOSERVE_KV_HUGE_PAGES: must be true or false, got 'big'"):
        kv_huge_pages_setting(None, {"TRIOSERVE_KV_HUGE_PAGES": "big"})


def test_prefix_cache_limit_is_the_fewer_blocks_of_count_and_bytes():
    from trioserve.config import EngineConfig
    from trioserve.engine import prefix_cache_blocks

    per_token = 1000  # bytes of KV per token; blocks of 16 tokens are 16000 bytes
    assert prefix_cache_blocks(EngineConfig(), per_token) is None
    assert prefix_cache_blocks(EngineConfig(prefix_cache_max_blocks=7), per_token) == 7
    assert prefix_cache_blocks(EngineConfig(prefix_cache_max_bytes=50_000), per_token) == 3
    assert prefix_cache_blocks(EngineConfig(prefix_cache_max_blocks=2, prefix_cache_max_bytes=50_000), per_token) == 2
    assert prefix_cache_blocks(EngineConfig(prefix_cache_max_bytes=100), per_token) == 0  # keeps no idle block
    s = settings_from_env({"TRIOSERVE_PREFIX_CACHE_BYTES": "1MiB"})
    assert s.engine.prefix_cache_max_bytes == 1 << 20
    with pytest.raises(ValueError, match="TRIOSERVE_PREFIX_CACHE_BYTES: must be a size"):
        settings_from_env({"TRIOSERVE_PREFIX_CACHE_BYTES": "plenty"})
