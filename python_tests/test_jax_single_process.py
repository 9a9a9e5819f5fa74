"""JAX loads the plugin in one process, without a compute plugin (embedded)
and delegating to XLA's CPU plugin: backend and devices, device_put /
np.asarray round trips for every dtype on both devices, device-to-device
copies, create options, the installed package working with no environment;
embedded, compute fails with the documented UNIMPLEMENTED error without
harm; delegated, jnp ops, jit, grad, reductions and matmul give numpy's
results on both devices, on both CPU plugins.

Each scenario (jax_single_process_scenarios.py) runs in a child process with
a timeout. Skipped only when JAX cannot be imported.
"""

from __future__ import annotations

import shutil

import pytest

from jax_harness import (
    COMPUTE_PLUGINS,
    HERE,
    compute_plugin,
    PACKAGE_DIR,
    child_env,
    library_path,
    run_python,
    skip_unless_jax,
)

pytestmark = skip_unless_jax()

SCENARIOS = HERE / "jax_single_process_scenarios.py"


def run_scenario(name: str, *, timeout: float = 120, env: dict | None = None) -> str:
    code, out = run_python([str(SCENARIOS), name], timeout=timeout, env=env)
    assert code == 0 and f"{name} OK" in out, f"scenario {name} failed (exit {code}):\n{out}"
    return out


# Without a compute plugin, and delegating to the default CPU plugin.
MODES = [None, "fastatomstruct"]


@pytest.mark.parametrize("compute", MODES)
def test_backend_initializes_and_lists_both_devices(compute):
    run_scenario("devices", env=child_env(compute=compute))


@pytest.mark.parametrize("compute", MODES)
def test_round_trips_every_dtype_and_shape_on_both_devices(compute):
    out = run_scenario("round_trips", timeout=300, env=child_env(compute=compute))
    assert "448 round trips" in out, out


@pytest.mark.parametrize("compute", MODES)
def test_device_to_device_put(compute):
    run_scenario("device_to_device", timeout=300, env=child_env(compute=compute))


def test_compute_raises_unimplemented_and_later_calls_work():
    run_scenario("compute_unimplemented", env=child_env(compute=None))


@pytest.mark.parametrize("compute", COMPUTE_PLUGINS)
def test_compute_gives_numpys_results_on_both_devices(compute):
    run_scenario("compute", timeout=300, env=child_env(compute=compute))


@pytest.mark.parametrize("compute", COMPUTE_PLUGINS)
def test_an_error_inside_a_program_is_a_jax_error(compute):
    run_scenario("compute_errors", env=child_env(compute=compute))


@pytest.mark.parametrize("compute", MODES)
def test_create_options_from_environment(compute):
    run_scenario(
        "options_from_env",
        env=child_env({"PJRT_CROSSHOST_CREATE_OPTIONS": "num_devices=4"}, compute=compute),
    )


@pytest.mark.parametrize("compute", MODES)
def test_create_options_from_initialize_signature(compute):
    run_scenario("options_from_initialize", env=child_env(compute=compute))


def test_crosshost_default_beside_cpu_for_compute():
    run_scenario("crosshost_beside_cpu", env=child_env({"JAX_PLATFORMS": "crosshost,cpu"}))


def test_installed_package_needs_no_environment(tmp_path):
    # What the wheel installs (python_tests/test_wheel.py builds and installs
    # the real one), laid out on a private path with the library under test.
    site = tmp_path / "site"
    shutil.copytree(PACKAGE_DIR / "jax_plugins", site / "jax_plugins", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy2(library_path(), site / "jax_plugins" / "crosshost" / "libpjrt_crosshost.so")
    env = child_env(use_repo_package=False)
    del env["JAX_PLATFORMS"]
    # No compute plugin variable either: the package's default applies (the
    # CPU plugin of the [cpu] extra, installed by scripts/setup.sh).
    del env["PJRT_CROSSHOST_COMPUTE_PLUGIN"]
    env["CROSSHOST_TEST_MODE"] = "delegated" if compute_plugin() else "embedded"
    env["PYTHONPATH"] = str(site)
    run_scenario("installed_package", env=env)
