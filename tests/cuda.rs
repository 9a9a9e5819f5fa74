//! CUDA backend tests. They need a CUDA driver and at least one device; where
//! there is none, each GPU test prints
//! `SKIPPED: no CUDA driver/device: <reason>` and the run ends with a count
//! of the skips. What can be checked without a GPU (the `backend=cuda` error,
//! `backend=auto` falling back to host) runs everywhere.
//!
//! Own harness (`harness = false` in Cargo.toml) so that the SKIPPED lines
//! and the summary are always printed, not captured.
use std::sync::Arc;
use std::time::{Duration, Instant};

use pjrt_crosshost::api::buffer::Buffer;
use pjrt_crosshost::api::client::Client;
use pjrt_crosshost::api::device::Device;
use pjrt_crosshost::api::options::{ClientOptions, OptionValue};
use pjrt_crosshost::backend::cuda::CudaBackend;
use pjrt_crosshost::backend::Backend;
use pjrt_crosshost::status::{self, Code};
use pjrt_crosshost::transfer::cuda_path;

mod common;
use common::{options, pattern, patterns, s, u8_receive_specs, u8_shape};

const PATIENCE: Duration = Duration::from_secs(30);

enum Verdict {
    Passed,
    Skipped(String),
}

type TestResult = Result<Verdict, String>;
type TestFn = fn() -> TestResult;

/// The CUDA backend, or the reason there is none.
fn cuda() -> Result<Arc<CudaBackend>, String> {
    CudaBackend::get().map_err(|e| e.message)
}

macro_rules! require_cuda {
    () => {
        match cuda() {
            Ok(backend) => backend,
            Err(reason) => return Ok(Verdict::Skipped(format!("no CUDA driver/device: {reason}"))),
        }
    };
}

macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

fn cuda_client() -> Result<Arc<Client>, String> {
    Client::create(options(&[("backend", s("cuda"))])).map_err(|e| e.to_string())
}

fn upload(client: &Client, device: &Arc<Device>, data: &[u8]) -> Result<Arc<Buffer>, String> {
    common::upload(client, device, data).map_err(|e| e.to_string())
}

fn download(buffer: &Buffer) -> Result<Vec<u8>, String> {
    buffer
        .definition()
        .wait_timeout(PATIENCE)
        .ok_or("buffer never became ready")?
        .map_err(|e| e.to_string())?;
    let mut out = vec![0u8; buffer.byte_size()];
    buffer
        .allocation("test")
        .and_then(|a| a.read(0, &mut out))
        .map_err(|e| e.to_string())?;
    Ok(out)
}

fn eventually(what: &str, mut condition: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting until {what}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

// ------------------------------- no GPU needed -------------------------------

fn backend_cuda_without_a_driver_fails_client_creation_with_failed_precondition() -> TestResult {
    if cuda().is_ok() {
        return Ok(Verdict::Skipped(
            "CUDA is available here; this checks the no-driver error".into(),
        ));
    }
    let err = match cuda_client() {
        Ok(_) => return Err("backend=cuda succeeded without CUDA".into()),
        Err(e) => e,
    };
    check!(
        err.contains("FAILED_PRECONDITION") && err.contains("backend=cuda"),
        "unexpected error: {err}"
    );
    Ok(Verdict::Passed)
}

fn backend_auto_uses_cuda_when_present_and_host_otherwise() -> TestResult {
    let client = Client::create(options(&[("backend", s("auto"))])).map_err(|e| e.to_string())?;
    let expected = if cuda().is_ok() { "cuda" } else { "host" };
    check!(
        client.backend().name() == expected,
        "backend=auto chose {} (CUDA available: {})",
        client.backend().name(),
        cuda().is_ok()
    );
    Ok(Verdict::Passed)
}

fn default_backend_is_host_even_on_a_gpu_machine() -> TestResult {
    let client = Client::create(ClientOptions::default()).map_err(|e| e.to_string())?;
    check!(client.backend().is_host(), "default backend is not host");
    check!(client.devices().len() == 2, "host default has 2 devices");
    Ok(Verdict::Passed)
}

// ---------------------------------- GPU ---------------------------------------

fn cuda_client_reports_the_real_devices() -> TestResult {
    let backend = require_cuda!();
    let client = cuda_client()?;
    check!(
        client.devices().len() == backend.device_count(),
        "{} devices, driver shows {}",
        client.devices().len(),
        backend.device_count()
    );
    for (i, d) in client.devices().iter().enumerate() {
        check!(
            d.kind == backend.device_kind(i) && !d.kind.is_empty(),
            "device {i} kind {:?}",
            d.kind
        );
        let attributes = backend.device_attributes(i);
        check!(
            attributes.iter().any(|(n, _)| n == "compute_capability"),
            "no compute_capability attribute: {attributes:?}"
        );
        let info = d.driver_memory_info().ok_or("no driver memory info")?;
        check!(
            info.total_bytes > 0 && info.free_bytes <= info.total_bytes,
            "memory info {info:?}"
        );
    }
    check!(
        client.platform_version().contains("cuda"),
        "platform version {:?}",
        client.platform_version()
    );
    Ok(Verdict::Passed)
}

fn host_to_device_to_host_round_trips_preserve_bytes() -> TestResult {
    require_cuda!();
    let client = cuda_client()?;
    let device = client.devices()[0].clone();
    for (n, size) in [1usize, 4097, (1 << 20) + 3, 64 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(size, n);
        let buffer = upload(&client, &device, &data)?;
        let allocation = buffer.allocation("t").map_err(|e| e.to_string())?;
        check!(
            !allocation.is_host_memory(),
            "CUDA memory claims to be host memory"
        );
        check!(allocation.address() != 0, "null device pointer");
        check!(
            download(&buffer)? == data,
            "round trip of {size} bytes differs"
        );
        // A partial read at an offset, and an out-of-bounds write refused.
        let mut part = vec![0u8; size.min(100)];
        allocation
            .read(size - part.len(), &mut part)
            .map_err(|e| e.to_string())?;
        check!(part == data[size - part.len()..], "partial read differs");
        let refused = allocation.write(size, &[1]);
        check!(
            refused.as_ref().err().map(|e| e.code) == Some(Code::OutOfRange),
            "out-of-bounds write: {refused:?}"
        );
    }
    let before = client.devices()[0].counters.snapshot().bytes_in_use;
    {
        let _b = upload(&client, &device, &pattern(1 << 20, 9))?;
        let during = client.devices()[0].counters.snapshot().bytes_in_use;
        check!(
            during == before + (1 << 20),
            "counters {before} -> {during}"
        );
    }
    let after = client.devices()[0].counters.snapshot().bytes_in_use;
    check!(after == before, "buffer not freed: {before} -> {after}");
    Ok(Verdict::Passed)
}

fn device_to_device_copies_on_one_and_across_devices() -> TestResult {
    let backend = require_cuda!();
    let client = cuda_client()?;
    let devices = client.devices().to_vec();
    let data = pattern((8 << 20) + 5, 3);
    let source = upload(&client, &devices[0], &data)?;
    // On one device: the backend's device-to-device copy.
    let src = source.allocation("t").map_err(|e| e.to_string())?;
    let dst = client
        .allocate(&devices[0], data.len(), "t")
        .map_err(|e| e.to_string())?;
    backend.copy(&*src, &*dst).map_err(|e| e.to_string())?;
    let mut out = vec![0u8; data.len()];
    dst.read(0, &mut out).map_err(|e| e.to_string())?;
    check!(out == data, "same-device copy differs");
    // Across devices (when there are two): the client's buffer copy.
    if devices.len() > 1 {
        let target = devices[devices.len() - 1].clone();
        let copy = client
            .copy_buffer(&source, &target, "t")
            .map_err(|e| e.to_string())?;
        check!(
            download(&copy)? == data,
            "copy to device {} differs",
            target.global_id
        );
    }
    Ok(Verdict::Passed)
}

fn zero_sized_buffers_upload_copy_and_read() -> TestResult {
    let backend = require_cuda!();
    let client = cuda_client()?;
    let device = client.devices()[0].clone();
    let empty = upload(&client, &device, &[])?;
    check!(download(&empty)?.is_empty(), "zero-sized read");
    let src = empty.allocation("t").map_err(|e| e.to_string())?;
    let dst = client
        .allocate(&device, 0, "t")
        .map_err(|e| e.to_string())?;
    backend.copy(&*src, &*dst).map_err(|e| e.to_string())?;
    check!(
        dst.is_empty() && !dst.is_host_memory(),
        "zero-sized CUDA allocation"
    );
    Ok(Verdict::Passed)
}

/// Two clients of one job in this process (nodes 0 and 1, one named memory
/// store); creation blocks until both joined, so each is made on its own
/// thread.
fn two_clients(name: &str) -> Result<(Arc<Client>, Arc<Client>), String> {
    common::two_clients(
        &[
            ("backend", s("cuda")),
            ("kv_store", s(&format!("memory:{name}"))),
            ("session", s(name)),
            ("receive_timeout_ms", OptionValue::Int(30_000)),
            ("send_timeout_ms", OptionValue::Int(30_000)),
        ],
        None,
    )
    .map_err(|e| e.to_string())
}

fn v2_transfer_between_two_clients_in_one_process_lands_every_buffer() -> TestResult {
    require_cuda!();
    let (sender, receiver) = two_clients("cuda-v2")?;
    let src_device = sender.addressable_devices().next().unwrap().clone();
    let dst_device = receiver.addressable_devices().next().unwrap().clone();
    let before = cuda_path::local_destinations();
    let sizes = [(4 << 20) + 1, 0, 4096, 1];
    let data = patterns(&sizes);
    let specs = u8_receive_specs(&sizes, src_device.global_id, 100);
    let received: Vec<_> = receiver
        .cross_host_receive(&dst_device, specs, None, "t")
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter_map(|b| b.into_embedded())
        .collect();
    for b in &received {
        check!(
            !b.allocation("t").unwrap().is_host_memory(),
            "a CUDA receive destination is host memory"
        );
    }
    let sources = data
        .iter()
        .map(|d| upload(&sender, &src_device, d))
        .collect::<Result<Vec<_>, _>>()?;
    let keys: Vec<i64> = (0..sizes.len()).map(|i| 100 + i as i64).collect();
    let sent = sender
        .cross_host_send(
            sources.into_iter().map(Into::into).collect(),
            &vec![dst_device.global_id; sizes.len()],
            &keys,
            None,
            "t",
        )
        .map_err(|e| e.to_string())?;
    for (i, f) in sent.iter().enumerate() {
        f.wait_timeout(PATIENCE)
            .ok_or(format!("send {i} never finished"))?
            .map_err(|e| format!("send {i}: {e}"))?;
    }
    for (i, b) in received.iter().enumerate() {
        check!(download(b)? == data[i], "buffer {i} differs");
    }
    eventually("every receive is retired", || {
        receiver.transfers().outstanding_receives() == 0
    })?;
    eventually("no CUDA destination is left reachable", || {
        cuda_path::local_destinations() <= before
    })?;
    Ok(Verdict::Passed)
}

fn v1_receive_then_send_in_one_client_and_cancellation() -> TestResult {
    require_cuda!();
    let client = cuda_client()?;
    let device = client.devices()[0].clone();
    let data = pattern(3 << 20, 5);
    let (buffers, descriptors) = client
        .make_receive_buffers(&device, vec![u8_shape(data.len()), u8_shape(64)], "t")
        .map_err(|e| e.to_string())?;
    let buffers: Vec<_> = buffers
        .into_iter()
        .filter_map(|b| b.into_embedded())
        .collect();
    // Buffer 1 is cancelled: its event fails with the reason, at once.
    client
        .cancel_receive(&descriptors[1], status::cancelled("test cancels"), "t")
        .map_err(|e| e.to_string())?;
    let cancelled = buffers[1]
        .definition()
        .wait_timeout(PATIENCE)
        .ok_or("cancelled buffer never became ready")?;
    check!(
        cancelled.as_ref().err().map(|e| e.code) == Some(Code::Cancelled),
        "cancelled buffer: {cancelled:?}"
    );
    // Buffer 0 still receives.
    let source = upload(&client, &device, &data)?;
    let sent = client
        .send_to_descriptor(source.into(), &descriptors[0], "t")
        .map_err(|e| e.to_string())?;
    sent.wait_timeout(PATIENCE)
        .ok_or("send never finished")?
        .map_err(|e| e.to_string())?;
    check!(download(&buffers[0])? == data, "received bytes differ");
    // A send to the cancelled destination finds nothing to write into.
    let late = upload(&client, &device, &pattern(64, 1))?;
    let outcome = client
        .send_to_descriptor(late.into(), &descriptors[1], "t")
        .map_err(|e| e.to_string())?
        .wait_timeout(PATIENCE)
        .ok_or("late send never finished")?;
    check!(
        outcome.is_err(),
        "a send into a cancelled destination succeeded"
    );
    eventually("every receive is retired", || {
        client.transfers().outstanding_receives() == 0
    })?;
    Ok(Verdict::Passed)
}

/// The IPC handle of a CUDA buffer's memory.
fn ipc_handle_of(buffer: &Buffer) -> Result<Vec<u8>, String> {
    let allocation = buffer.allocation("t").map_err(|e| e.to_string())?;
    let cuda = allocation.as_cuda().ok_or("not CUDA memory")?;
    Ok(cuda.ipc_handle().map_err(|e| e.to_string())?.to_vec())
}

fn shelved_bytes(backend: &CudaBackend) -> Result<usize, String> {
    Ok(backend
        .device(0)
        .map_err(|e| e.to_string())?
        .shelved_receive_bytes())
}

/// One v1 receive of `data.len()` bytes on device 0, sent `data` or, with
/// `cancel`, cancelled instead; returns its memory's IPC handle once the
/// receive is retired (its buffer goes when this returns).
fn receive_once(client: &Client, data: &[u8], cancel: bool) -> Result<Vec<u8>, String> {
    let device = client.devices()[0].clone();
    let (buffers, descriptors) = client
        .make_receive_buffers(&device, vec![u8_shape(data.len())], "t")
        .map_err(|e| e.to_string())?;
    let buffer = buffers
        .into_iter()
        .find_map(|b| b.into_embedded())
        .ok_or("no receive buffer")?;
    let handle = ipc_handle_of(&buffer)?;
    if cancel {
        client
            .cancel_receive(&descriptors[0], status::cancelled("test cancels"), "t")
            .map_err(|e| e.to_string())?;
        let outcome = buffer
            .definition()
            .wait_timeout(PATIENCE)
            .ok_or("cancelled buffer never became ready")?;
        check!(outcome.is_err(), "a cancelled receive succeeded");
    } else {
        let source = upload(client, &device, data)?;
        client
            .send_to_descriptor(source.into(), &descriptors[0], "t")
            .map_err(|e| e.to_string())?
            .wait_timeout(PATIENCE)
            .ok_or("send never finished")?
            .map_err(|e| e.to_string())?;
        check!(download(&buffer)? == data, "received bytes differ");
    }
    eventually("the receive is retired", || {
        client.transfers().outstanding_receives() == 0
    })?;
    Ok(handle)
}

fn a_succeeded_receive_s_memory_is_reused_with_its_handle_and_a_cancelled_one_s_is_not(
) -> TestResult {
    let backend = require_cuda!();
    if std::env::var("PJRT_CROSSHOST_CUDA_REUSE_BYTES").as_deref() == Ok("0") {
        return Ok(Verdict::Skipped(
            "PJRT_CROSSHOST_CUDA_REUSE_BYTES=0 turns reuse off".into(),
        ));
    }
    let client = cuda_client()?;
    // Sizes no other test receives, so the shelf holds none of them yet.
    let (kept, cancelled) = ((3 << 20) + 7, (5 << 20) + 9);
    let before = shelved_bytes(&backend)?;
    let first = receive_once(&client, &pattern(kept, 1), false)?;
    eventually(
        "the received buffer's memory is on the receive shelf",
        || {
            shelved_bytes(&backend)
                .map(|b| b == before + kept)
                .unwrap_or(false)
        },
    )?;
    // The next receive of that size takes it, handle and all, and still gets
    // exactly the new bytes.
    let second = receive_once(&client, &pattern(kept, 2), false)?;
    check!(
        second == first,
        "a receive of the same size did not reuse the shelved memory"
    );
    eventually("the memory is back on the shelf", || {
        shelved_bytes(&backend)
            .map(|b| b == before + kept)
            .unwrap_or(false)
    })?;
    // A cancelled receive's memory is freed, never shelved: a late sender may
    // still write into it.
    let cancelled_handle = receive_once(&client, &pattern(cancelled, 3), true)?;
    check!(
        shelved_bytes(&backend)? == before + kept,
        "a cancelled receive's memory went on the shelf ({} bytes shelved)",
        shelved_bytes(&backend)?
    );
    let after = receive_once(&client, &pattern(cancelled, 4), false)?;
    check!(
        after != cancelled_handle,
        "a receive reused the memory of a cancelled one"
    );
    Ok(Verdict::Passed)
}

// ------------------- the cross-node path: staged (issue #38) -------------------

/// A GPU buffer's bytes through the pinned staging ring both ways: device
/// to host into pinned slots (a send), host to device out of them (a
/// receive), every byte checked, the copies asynchronous.
fn staged_copies_through_pinned_slots_round_trip() -> TestResult {
    use pjrt_crosshost::backend::cuda::{pinned_bytes_held, CudaMemory};
    use pjrt_crosshost::backend::{Allocation, MemoryCounters};
    use pjrt_crosshost::transport::staging::{
        CudaCopy, StagedDestination, Staging, StagingConfig, Stop,
    };
    let backend = require_cuda!();
    let device = backend.device(0).map_err(|e| e.to_string())?.clone();
    let len = (5 << 20) + 4097;
    let data = pattern(len, 11);
    let counters = Arc::new(MemoryCounters::default());
    let source: Allocation = Arc::new(
        CudaMemory::allocate(device.clone(), len, counters.clone()).map_err(|e| e.to_string())?,
    );
    source.write(0, &data).map_err(|e| e.to_string())?;
    let staging = Staging::new(StagingConfig {
        chunk_bytes: 1 << 20,
        ring_depth: 3,
        pinned: true,
        ..StagingConfig::default()
    })
    .map_err(|e| e.to_string())?;
    let copier = CudaCopy::new(source).map_err(|e| e.to_string())?;
    let mut sent = Vec::with_capacity(len);
    let chunks = staging
        .send(
            &copier,
            0,
            len,
            &mut |chunk: &[u8]| {
                sent.extend_from_slice(chunk);
                Ok(())
            },
            &Stop::new(),
            PATIENCE,
        )
        .map_err(|e| e.to_string())?;
    check!(chunks == 6, "{chunks} chunks sent");
    check!(sent == data, "the staged send's bytes differ");
    let target: Allocation =
        Arc::new(CudaMemory::allocate(device, len, counters).map_err(|e| e.to_string())?);
    let staged = StagedDestination::device(
        Arc::new(CudaCopy::new(target.clone()).map_err(|e| e.to_string())?),
        staging.clone(),
    );
    let mut at = 0;
    staged
        .receive(
            0,
            len,
            &mut |into: &mut [u8]| {
                into.copy_from_slice(&data[at..at + into.len()]);
                at += into.len();
                Ok(())
            },
            PATIENCE,
        )
        .map_err(|e| e.to_string())?;
    // `receive` returned: the last host-to-device copy completed.
    let mut back = vec![0u8; len];
    target.read(0, &mut back).map_err(|e| e.to_string())?;
    check!(back == data, "the staged receive's bytes differ");
    check!(
        staging.bytes_held() > 0 && staging.bytes_held() <= 2 * 3 * (1 << 20),
        "staging holds {} bytes",
        staging.bytes_held()
    );
    check!(
        pinned_bytes_held() >= staging.bytes_held(),
        "the slots are pinned"
    );
    Ok(Verdict::Passed)
}

/// Two clients of one job in this process, node 0 on `sender_backend` and
/// node 1 on `receiver_backend`, every transfer over `transport`.
fn two_clients_over(
    name: &str,
    transport: &str,
    sender_backend: &str,
    receiver_backend: &str,
) -> Result<(Arc<Client>, Arc<Client>), String> {
    let make = |node: i64, backend: &str| {
        let options = options(&[
            ("backend", s(backend)),
            ("num_devices", OptionValue::Int(1)),
            ("kv_store", s(&format!("memory:{name}"))),
            ("session", s(name)),
            ("transport", s(transport)),
            ("receive_timeout_ms", OptionValue::Int(30_000)),
            ("send_timeout_ms", OptionValue::Int(30_000)),
            ("node_id", OptionValue::Int(node)),
            ("num_nodes", OptionValue::Int(2)),
        ]);
        std::thread::spawn(move || Client::create(options))
    };
    let (a, b) = (make(0, sender_backend), make(1, receiver_backend));
    let a = a
        .join()
        .map_err(|_| "client 0 panicked")?
        .map_err(|e| e.to_string())?;
    let b = b
        .join()
        .map_err(|_| "client 1 panicked")?
        .map_err(|e| e.to_string())?;
    Ok((a, b))
}

/// A v2 transfer as from another node (`transport` forbids CUDA IPC):
/// every byte lands, every receive retires, and each nonzero buffer went
/// through the staging ring on each CUDA side.
fn staged_transfer(
    transport: &str,
    sender_backend: &str,
    receiver_backend: &str,
) -> Result<(), String> {
    let name = format!("cuda-staged-{transport}-{sender_backend}-{receiver_backend}");
    let (sender, receiver) = two_clients_over(&name, transport, sender_backend, receiver_backend)?;
    let src_device = sender.addressable_devices().next().unwrap().clone();
    let dst_device = receiver.addressable_devices().next().unwrap().clone();
    let sizes = [(4 << 20) + 1, 0, 4096, 1, 64 << 20];
    let data = patterns(&sizes);
    let specs = u8_receive_specs(&sizes, src_device.global_id, 500);
    let received: Vec<_> = receiver
        .cross_host_receive(&dst_device, specs, None, "t")
        .map_err(|e| format!("receive (no longer UNIMPLEMENTED): {e}"))?
        .into_iter()
        .filter_map(|b| b.into_embedded())
        .collect();
    let sources = data
        .iter()
        .map(|d| upload(&sender, &src_device, d))
        .collect::<Result<Vec<_>, _>>()?;
    let keys: Vec<i64> = (0..sizes.len()).map(|i| 500 + i as i64).collect();
    let sent = sender
        .cross_host_send(
            sources.into_iter().map(Into::into).collect(),
            &vec![dst_device.global_id; sizes.len()],
            &keys,
            None,
            "t",
        )
        .map_err(|e| e.to_string())?;
    for (i, f) in sent.iter().enumerate() {
        f.wait_timeout(PATIENCE)
            .ok_or(format!("send {i} never finished"))?
            .map_err(|e| format!("send {i}: {e}"))?;
    }
    for (i, b) in received.iter().enumerate() {
        check_bytes(download(b)?, &data[i], i)?;
    }
    eventually("every receive is retired", || {
        receiver.transfers().outstanding_receives() == 0
    })?;
    let route = if transport == "tcp" { 1 } else { 2 };
    let nonzero = sizes.iter().filter(|&&n| n > 0).count() as u64;
    for (side, client, backend) in [
        ("sender", &sender, sender_backend),
        ("receiver", &receiver, receiver_backend),
    ] {
        let staged = client.transfers().metrics().snapshot().routes[route].transfers_staged;
        if backend == "cuda" {
            check_staged(side, staged, nonzero)?;
        }
    }
    Ok(())
}

fn check_bytes(got: Vec<u8>, want: &[u8], i: usize) -> Result<(), String> {
    check!(got == want, "buffer {i} differs");
    Ok(())
}

fn check_staged(side: &str, staged: u64, at_least: u64) -> Result<(), String> {
    check!(
        staged >= at_least,
        "the {side} staged {staged} transfers, expected {at_least}"
    );
    Ok(())
}

fn a_gpu_buffer_from_another_node_lands_through_the_staging_ring_over_tcp() -> TestResult {
    require_cuda!();
    staged_transfer("tcp", "cuda", "cuda")?;
    Ok(Verdict::Passed)
}

fn a_gpu_buffer_from_another_node_lands_through_the_staging_ring_over_ucx() -> TestResult {
    require_cuda!();
    if let Err(e) = pjrt_crosshost::transport::ucx::load(None) {
        return Ok(Verdict::Skipped(format!("no UCX: {}", e.message)));
    }
    staged_transfer("ucx", "cuda", "cuda")?;
    Ok(Verdict::Passed)
}

fn host_to_gpu_and_gpu_to_host_across_nodes_stage_on_the_gpu_side() -> TestResult {
    require_cuda!();
    staged_transfer("tcp", "host", "cuda")?;
    staged_transfer("tcp", "cuda", "host")?;
    Ok(Verdict::Passed)
}

// --------------------------------- harness ------------------------------------

fn main() {
    let tests: &[(&str, TestFn)] = &[
        (
            "backend_cuda_without_a_driver_fails_client_creation_with_failed_precondition",
            backend_cuda_without_a_driver_fails_client_creation_with_failed_precondition,
        ),
        (
            "backend_auto_uses_cuda_when_present_and_host_otherwise",
            backend_auto_uses_cuda_when_present_and_host_otherwise,
        ),
        (
            "default_backend_is_host_even_on_a_gpu_machine",
            default_backend_is_host_even_on_a_gpu_machine,
        ),
        (
            "cuda_client_reports_the_real_devices",
            cuda_client_reports_the_real_devices,
        ),
        (
            "host_to_device_to_host_round_trips_preserve_bytes",
            host_to_device_to_host_round_trips_preserve_bytes,
        ),
        (
            "device_to_device_copies_on_one_and_across_devices",
            device_to_device_copies_on_one_and_across_devices,
        ),
        (
            "zero_sized_buffers_upload_copy_and_read",
            zero_sized_buffers_upload_copy_and_read,
        ),
        (
            "v2_transfer_between_two_clients_in_one_process_lands_every_buffer",
            v2_transfer_between_two_clients_in_one_process_lands_every_buffer,
        ),
        (
            "v1_receive_then_send_in_one_client_and_cancellation",
            v1_receive_then_send_in_one_client_and_cancellation,
        ),
        (
            "a_succeeded_receive_s_memory_is_reused_with_its_handle_and_a_cancelled_one_s_is_not",
            a_succeeded_receive_s_memory_is_reused_with_its_handle_and_a_cancelled_one_s_is_not,
        ),
        (
            "staged_copies_through_pinned_slots_round_trip",
            staged_copies_through_pinned_slots_round_trip,
        ),
        (
            "a_gpu_buffer_from_another_node_lands_through_the_staging_ring_over_tcp",
            a_gpu_buffer_from_another_node_lands_through_the_staging_ring_over_tcp,
        ),
        (
            "a_gpu_buffer_from_another_node_lands_through_the_staging_ring_over_ucx",
            a_gpu_buffer_from_another_node_lands_through_the_staging_ring_over_ucx,
        ),
        (
            "host_to_gpu_and_gpu_to_host_across_nodes_stage_on_the_gpu_side",
            host_to_gpu_and_gpu_to_host_across_nodes_stage_on_the_gpu_side,
        ),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let (mut passed, mut skipped, mut failed) = (0, 0, Vec::new());
    for (name, test) in tests {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let started = Instant::now();
        let verdict =
            std::panic::catch_unwind(test).unwrap_or_else(|_| Err("panicked".to_string()));
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match verdict {
            Ok(Verdict::Passed) => {
                passed += 1;
                println!("test {name} ... ok ({ms:.1} ms)");
            }
            Ok(Verdict::Skipped(reason)) => {
                skipped += 1;
                println!("test {name} ... SKIPPED: {reason}");
            }
            Err(e) => {
                println!("test {name} ... FAILED: {e}");
                failed.push(*name);
            }
        }
    }
    println!(
        "\ncuda tests: {passed} passed, {skipped} skipped, {} failed",
        failed.len()
    );
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        std::process::exit(1);
    }
}
