"""JAX 0.10.2 loads the plugin in one process: backend and devices, device_put
/ np.asarray round trips for every dtype on both devices, device-to-device
copies, compute failing with the documented UNIMPLEMENTED error without harm,
create options, and the installed package working with no environment.

Each scenario (jax_single_process_scenarios.py) runs in a child process with
a timeout. Skipped only when JAX cannot be imported.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from jax_harness import HERE, PACKAGE_DIR, child_env, library_path, run_python, skip_unless_jax

pytestmark = skip_unless_jax()

SCENARIOS = HERE / "jax_single_process_scenarios.py"


def run_scenario(name: str, *, timeout: float = 120, env: dict | None = None) -> str:
    code, out = run_python([str(SCENARIOS), name], timeout=timeout, env=env)
    assert code == 0 and f"{name} OK" in out, f"scenario {name} failed (exit {code}):\n{out}"
    return out


def test_backend_initializes_and_lists_both_devices():
    run_scenario("devices")


def test_round_trips_every_dtype_and_shape_on_both_devices():
    out = run_scenario("round_trips", timeout=300)
    assert "448 round trips" in out, out


def test_device_to_device_put():
    run_scenario("device_to_device", timeout=300)


def test_compute_raises_unimplemented_and_later_calls_work():
    run_scenario("compute_unimplemented")


def test_create_options_from_environment():
    run_scenario(
        "options_from_env", env=child_env({"PJRT_CROSSHOST_CREATE_OPTIONS": "num_devices=4"})
    )


def test_create_options_from_initialize_signature():
    run_scenario("options_from_initialize")


def test_crosshost_default_beside_cpu_for_compute():
    run_scenario("crosshost_beside_cpu", env=child_env({"JAX_PLATFORMS": "crosshost,cpu"}))


def _pip_install_target(src, target) -> None:
    base = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
    attempts = [base + [str(src)], base + ["--no-build-isolation", str(src)]]
    outputs = []
    for cmd in attempts:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode == 0:
            return
        outputs.append(f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    pytest.fail("pip could not install the package:\n" + "\n".join(outputs))


def test_installed_package_needs_no_environment(tmp_path):
    # What scripts/install-python-plugin.sh does, into a private target
    # directory instead of site-packages.
    src = tmp_path / "python"
    shutil.copytree(PACKAGE_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "*.so"))
    shutil.copy2(library_path(), src / "jax_plugins" / "crosshost" / "libpjrt_crosshost.so")
    site = tmp_path / "site"
    _pip_install_target(src, site)
    assert (site / "jax_plugins" / "crosshost" / "libpjrt_crosshost.so").is_file()
    env = child_env(use_repo_package=False)
    del env["JAX_PLATFORMS"]
    env["PYTHONPATH"] = str(site)
    run_scenario("installed_package", env=env)
