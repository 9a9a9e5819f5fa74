//! What an authenticated TCP request holds (its claim of a destination, the
//! receipt it carries) and the answer once its bytes are in: shared by the
//! front door, which lands small payloads itself, and the handler threads,
//! which land the rest.
use std::sync::Arc;

use once_cell::sync::OnceCell;

use super::wire::Response;
use crate::transport::destination::WritableDestination;
use crate::transport::registry::{Landing, ReceiptSink};

/// A request whose token claimed `destination`; `offset + length` lies
/// inside it.
pub(super) struct Claim {
    pub destination: Arc<dyn WritableDestination>,
    pub offset: usize,
    pub length: usize,
    /// The completion key this process holds for the destination, when it
    /// was registered with one.
    pub landing: Option<Arc<Landing>>,
    /// Empty, or the value the sender asks to set that key to.
    pub receipt: Vec<u8>,
}

/// The answer to a request whose bytes are all in: its receipt, if it came
/// with one for a key held here, is set first, so the receiver's wait ends
/// without a trip back through the sender.
pub(super) fn landed(claim: &Claim, sink: &OnceCell<ReceiptSink>) -> Response {
    let receipt_applied = match &claim.landing {
        Some(landing) if !claim.receipt.is_empty() => {
            landing.apply_receipt(&claim.receipt, sink, "TCP")
        }
        _ => false,
    };
    Response {
        outcome: Ok(()),
        receipt_applied,
    }
}
