"""Two kv_both vLLM instances share KV through Mooncake Store (a real ``mooncake_master``, see
tests/mooncake_fixtures.py), with greedy outputs identical to a run without the connector.

The instances run one after the other and lend no segment (``segment=0``): what the first one
stores lies in a pool node's segment (``mooncake_client``), which outlives it. An engine's own
segment leaves the pool with it (docs/remote.md, "Mooncake Store").
"""

from __future__ import annotations

import pathlib

import pytest

from tests.mooncake_fixtures import MooncakeMaster, mooncake_master, stop_process  # noqa: F401
from tests.vllm.test_vllm_connector import _cached, _connector, _outputs, _prompt, run_vllm

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

MOONCAKE_SHARED = _prompt(41, 130)  # chunks [0, 64), [64, 128) whole, then 2 tokens


def test_two_kv_both_instances_share_through_mooncake(
    model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    mooncake_master: MooncakeMaster,  # noqa: F811 - the fixture
) -> None:
    baseline = run_vllm(
        model_dir, tmp_path, "mooncake-baseline", [[MOONCAKE_SHARED]], connector=None
    )
    node = mooncake_master.start_pool_node("256MB")
    try:
        connector = _connector(None, l3_url=mooncake_master.url(segment="0"), l3_timeout_s=5.0)
        first = run_vllm(
            model_dir, tmp_path, "share-mooncake-a", [[MOONCAKE_SHARED]], connector=connector
        )
        second = run_vllm(
            model_dir, tmp_path, "share-mooncake-b", [[MOONCAKE_SHARED]], connector=connector
        )
    finally:
        stop_process(node)
    assert _outputs(first) == _outputs(second) == _outputs(baseline)
    assert (_cached(first), _cached(second)) == ([0], [128])
    assert first["engine_stats"]["l3"]["puts"] >= 2
    assert second["engine_stats"]["storage"]["hits_l3"] >= 2
    assert second["engine_stats"]["host"]["loaded_tokens"] == 128
    assert second["failures"] == 0
