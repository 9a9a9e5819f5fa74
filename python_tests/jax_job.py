"""What the two-process JAX workers share: joining the job, and the array
each process holds for a cross-process device_put."""

from __future__ import annotations


def join(process_id: int, port: int):
    """Joins the two-process jax.distributed job on 127.0.0.1:`port` (JAX
    must run on crosshost); returns JAX's distributed client (the KV store
    and barriers) and the devices of process 0 and of process 1."""
    import jax
    from jax._src import distributed

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.default_backend() == "crosshost", jax.default_backend()
    devices = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    return distributed.global_state.client, devices[0], devices[1]


def source_array(process_id: int, expected, src):
    """The array on `src` (a device of process 0): process 0 puts `expected`
    there; process 1 describes the same array, which it cannot address."""
    import jax
    from jax.sharding import SingleDeviceSharding

    if process_id == 0:
        return jax.device_put(expected, src)
    return jax.make_array_from_single_device_arrays(
        expected.shape, SingleDeviceSharding(src), [], dtype=expected.dtype
    )
