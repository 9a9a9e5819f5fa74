//! A framework's process reports (PJRT_Client_UpdateGlobalProcessInfo) fail
//! the receives waiting on a lost or restarted peer at once, not at the
//! receive deadline.
use std::sync::Arc;
use std::time::Duration;

use pjrt_crosshost::api::client::Client;
use pjrt_crosshost::api::element_type::{ElementType, Shape};
use pjrt_crosshost::api::options::{ClientOptions, StoreChoice};
use pjrt_crosshost::api::transfers::{ProcessReport, ReceiveSpec};
use pjrt_crosshost::status::Code;

fn job(name: &str) -> (Arc<Client>, Arc<Client>) {
    let options = |node| ClientOptions {
        num_devices: 1,
        node_id: node,
        num_nodes: 2,
        session: name.into(),
        store: StoreChoice::NamedMemory(name.into()),
        receive_timeout: Duration::from_secs(600),
        ..ClientOptions::default()
    };
    let other = std::thread::spawn({
        let o = options(1);
        move || Client::create(o).unwrap()
    });
    let first = Client::create(options(0)).unwrap();
    (first, other.join().unwrap())
}

fn pending_receive(receiver: &Client, key: i64) -> pjrt_crosshost::sync::Future {
    let device = receiver.addressable_devices().next().unwrap().clone();
    let spec = ReceiveSpec {
        shape: Shape::new(ElementType::F32, vec![4], "t").unwrap(),
        peer_global_device_id: 0,
        transfer_key: key,
    };
    let buffers = receiver
        .cross_host_receive(&device, vec![spec], None, "t")
        .unwrap();
    buffers
        .into_iter()
        .next()
        .and_then(|b| b.into_embedded())
        .unwrap()
        .definition()
}

#[test]
fn a_peer_reported_lost_fails_its_pending_receives_at_once() {
    let (_sender, receiver) = job("reports-lost");
    let ready = pending_receive(&receiver, 1);
    assert!(!ready.is_ready());
    receiver.observe_processes(&[ProcessReport {
        task: 0,
        incarnation: 5,
        lost: false,
    }]);
    assert!(!ready.is_ready(), "a healthy report must not fail anything");
    receiver.observe_processes(&[ProcessReport {
        task: 0,
        incarnation: 5,
        lost: true,
    }]);
    let outcome = ready
        .wait_timeout(Duration::from_secs(10))
        .expect("failed at once, not at the deadline");
    assert_eq!(outcome.unwrap_err().code, Code::Unavailable);
}

#[test]
fn a_peer_with_a_new_incarnation_aborts_its_pending_receives() {
    let (_sender, receiver) = job("reports-restart");
    receiver.observe_processes(&[ProcessReport {
        task: 0,
        incarnation: 7,
        lost: false,
    }]);
    let ready = pending_receive(&receiver, 2);
    receiver.observe_processes(&[ProcessReport {
        task: 0,
        incarnation: 8,
        lost: false,
    }]);
    let outcome = ready
        .wait_timeout(Duration::from_secs(10))
        .expect("aborted at once");
    assert_eq!(outcome.unwrap_err().code, Code::Aborted);
}
