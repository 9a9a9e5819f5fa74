//! A receive batch through the transfer service (`receive_v1` and
//! `receive_v2` of two in-process clients): each buffer is ready when its
//! own sender's bytes landed, in the order the senders send, never gated on
//! the buffers before it in the batch (the old batch barrier).
use std::sync::Arc;
use std::time::Duration;

use pjrt_crosshost::api::buffer::Buffer;
use pjrt_crosshost::api::client::Client;
use pjrt_crosshost::api::device::Device;
use pjrt_crosshost::api::options::OptionValue;

mod common;
use common::{pattern, patterns, s, u8_receive_specs, u8_shape};

const PATIENCE: Duration = Duration::from_secs(20);
/// Sent in this order: last first, then the middle, then the first.
const SEND_ORDER: [usize; 3] = [2, 1, 0];

fn two_clients(name: &str, transport: &str) -> (Arc<Client>, Arc<Client>) {
    common::two_clients(
        &[
            ("kv_store", s(&format!("memory:{name}"))),
            ("session", s(name)),
            ("transport", s(transport)),
            ("receive_timeout_ms", OptionValue::Int(30_000)),
            ("send_timeout_ms", OptionValue::Int(30_000)),
        ],
        None,
    )
    .expect("clients")
}

fn upload(client: &Client, device: &Arc<Device>, data: &[u8]) -> Arc<Buffer> {
    common::upload(client, device, data).unwrap()
}

fn contents(buffer: &Buffer) -> Vec<u8> {
    let mut out = vec![0u8; buffer.byte_size()];
    buffer.allocation("t").unwrap().read(0, &mut out).unwrap();
    out
}

/// Waits for each buffer in `SEND_ORDER` as `send(i)` sends it, checking
/// that the buffers not sent yet are still pending and the bytes are right.
fn check_ready_in_send_order(
    received: &[Arc<Buffer>],
    data: &[Vec<u8>],
    mut send: impl FnMut(usize),
) {
    for (step, &i) in SEND_ORDER.iter().enumerate() {
        send(i);
        let outcome = received[i].definition().wait_timeout(PATIENCE);
        assert_eq!(outcome, Some(Ok(())), "buffer {i} (sent at step {step})");
        assert_eq!(contents(&received[i]), data[i], "buffer {i}'s bytes");
        for &later in &SEND_ORDER[step + 1..] {
            assert!(
                !received[later].definition().is_ready(),
                "buffer {later} is ready before its sender sent: gated on buffer {i}?"
            );
        }
    }
}

fn v2_batch_in_send_order(transport: &str) {
    let (sender, receiver) = two_clients(&format!("batch-order-v2-{transport}"), transport);
    let src = sender.addressable_devices().next().unwrap().clone();
    let dst = receiver.addressable_devices().next().unwrap().clone();
    let sizes = [4096, 1 << 20, 17];
    let data = patterns(&sizes);
    let specs = u8_receive_specs(&sizes, src.global_id, 500);
    let received: Vec<Arc<Buffer>> = receiver
        .cross_host_receive(&dst, specs, None, "t")
        .unwrap()
        .into_iter()
        .map(|b| b.into_embedded().expect("embedded buffer"))
        .collect();
    check_ready_in_send_order(&received, &data, |i| {
        let source = upload(&sender, &src, &data[i]);
        let sent = sender
            .cross_host_send(
                vec![source.into()],
                &[dst.global_id],
                &[500 + i as i64],
                None,
                "t",
            )
            .unwrap();
        assert_eq!(sent[0].wait_timeout(PATIENCE), Some(Ok(())), "send {i}");
    });
}

#[test]
fn v2_batch_buffers_are_ready_in_the_order_their_senders_send_over_shared_memory() {
    v2_batch_in_send_order("auto");
}

#[test]
fn v2_batch_buffers_are_ready_in_the_order_their_senders_send_over_tcp() {
    v2_batch_in_send_order("tcp");
}

#[test]
fn v1_batch_buffers_are_ready_in_the_order_their_descriptors_are_sent_to() {
    let (sender, receiver) = two_clients("batch-order-v1", "auto");
    let src = sender.addressable_devices().next().unwrap().clone();
    let dst = receiver.addressable_devices().next().unwrap().clone();
    let sizes = [64, 300_000, 4096];
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, 9 + i))
        .collect();
    let (buffers, descriptors) = receiver
        .make_receive_buffers(&dst, sizes.iter().map(|&n| u8_shape(n)).collect(), "t")
        .unwrap();
    let received: Vec<Arc<Buffer>> = buffers
        .into_iter()
        .map(|b| b.into_embedded().expect("embedded buffer"))
        .collect();
    check_ready_in_send_order(&received, &data, |i| {
        let source = upload(&sender, &src, &data[i]);
        let sent = sender
            .send_to_descriptor(source.into(), &descriptors[i], "t")
            .unwrap();
        assert_eq!(sent.wait_timeout(PATIENCE), Some(Ok(())), "send {i}");
    });
}
