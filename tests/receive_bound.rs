//! The receive bound's default (create option `max_receive_bytes`).
use pjrt_crosshost::api::client::Client;
use pjrt_crosshost::api::options::OptionValue;

mod common;

#[test]
fn a_client_bounds_its_received_buffers_by_default_to_half_the_machine() {
    // The default applies without the option; the bound itself (a receive
    // past it fails at once with RESOURCE_EXHAUSTED) is tested with a small
    // explicit bound (python_tests/test_transfers_v2.py), never by asking
    // for half the machine's memory.
    let client = Client::create(common::options(&[])).unwrap();
    assert_eq!(
        client.transfers().max_receive_bytes(),
        pjrt_crosshost::transfer::memory_budget::default_max_receive_bytes()
    );
    let bounded = Client::create(common::options(&[(
        "max_receive_bytes",
        OptionValue::Int(1 << 20),
    )]))
    .unwrap();
    assert_eq!(bounded.transfers().max_receive_bytes(), 1 << 20);
}
