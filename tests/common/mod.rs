//! Helpers the integration tests share: create options, u8 buffers and
//! their patterns, a two-client job in one process, receipts and bounded
//! waits on a receive's outcome. Each test file uses a part of them.
#![allow(dead_code)]

use std::sync::Arc;

use pjrt_crosshost::api::buffer::{Buffer, HostArray};
use pjrt_crosshost::api::client::Client;
use pjrt_crosshost::api::device::Device;
use pjrt_crosshost::api::element_type::{ElementType, Shape};
use pjrt_crosshost::api::options::{ClientOptions, OptionValue};
use pjrt_crosshost::api::transfers::ReceiveSpec;
use pjrt_crosshost::kv::RawKvCallbacks;
use pjrt_crosshost::status::{Outcome, Result};
use pjrt_crosshost::sync::Future;
use pjrt_crosshost::transfer::{PendingReceive, Receipt};

/// How long a receive's outcome may take in a passing run; a hang fails the
/// test instead of blocking CI.
pub const OUTCOME_PATIENCE: std::time::Duration = std::time::Duration::from_secs(20);

/// The receipt a sender writes for a buffer it delivered.
pub fn ok(nonce: u64) -> Vec<u8> {
    Receipt::Ok { nonce }.encode()
}

/// The outcome of `future`, within `OUTCOME_PATIENCE`.
pub fn wait(future: &Future) -> Outcome {
    future
        .wait_timeout(OUTCOME_PATIENCE)
        .expect("outcome within OUTCOME_PATIENCE")
}

/// The receive's retirement outcome (its keys deleted, its waiter gone).
pub fn wait_retired(rx: &PendingReceive) -> Outcome {
    wait(&rx.retired())
}

pub fn options(pairs: &[(&str, OptionValue)]) -> ClientOptions {
    let owned: Vec<(String, OptionValue)> = pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.clone()))
        .collect();
    ClientOptions::parse(&owned).expect("valid options")
}

pub fn s(v: &str) -> OptionValue {
    OptionValue::Str(v.into())
}

/// A one-dimensional u8 shape of `bytes` elements.
pub fn u8_shape(bytes: usize) -> Shape {
    Shape::new(
        ElementType::from_raw(6, "t").unwrap(),
        vec![bytes as i64],
        "t",
    )
    .unwrap()
}

pub fn pattern(bytes: usize, seed: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| ((i * 31 + seed * 7) % 251) as u8)
        .collect()
}

pub fn upload(client: &Client, device: &Arc<Device>, data: &[u8]) -> Result<Arc<Buffer>> {
    let host = HostArray {
        bytes: data,
        origin: 0,
        byte_strides: None,
    };
    client.buffer_from_host(&host, u8_shape(data.len()), device, "test")
}

/// Nodes 0 and 1 of one job, created at once (creation waits for the
/// other); `extra` options for both, `callbacks` shared when given.
pub fn two_clients(
    extra: &[(&str, OptionValue)],
    callbacks: Option<Arc<dyn RawKvCallbacks>>,
) -> Result<(Arc<Client>, Arc<Client>)> {
    let make = |node: i64| {
        let mut pairs: Vec<(&str, OptionValue)> = extra.to_vec();
        pairs.push(("node_id", OptionValue::Int(node)));
        pairs.push(("num_nodes", OptionValue::Int(2)));
        let options = options(&pairs);
        let callbacks = callbacks.clone();
        std::thread::spawn(move || Client::create_with_callbacks(options, callbacks))
    };
    let (a, b) = (make(0), make(1));
    let a = a.join().expect("client 0 panicked")?;
    let b = b.join().expect("client 1 panicked")?;
    Ok((a, b))
}

/// One u8 receive per size from `peer`, under transfer keys `first_key`,
/// `first_key + 1`, ...
pub fn u8_receive_specs(sizes: &[usize], peer: i32, first_key: i64) -> Vec<ReceiveSpec> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| ReceiveSpec {
            shape: u8_shape(n),
            peer_global_device_id: peer,
            transfer_key: first_key + i as i64,
        })
        .collect()
}

/// `pattern(size, i)` for each size, in order.
pub fn patterns(sizes: &[usize]) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i))
        .collect()
}
