use super::*;
use crate::status::Code;
use crate::transport::claim::ClaimRange;

fn small_pool(max_segments: usize) -> ShmPool {
    ShmPool::new(ShmPoolConfig {
        segment_len: 64 << 10,
        max_segments,
    })
    .unwrap()
}

#[test]
fn leases_are_carved_page_aligned_from_one_segment() {
    let pool = small_pool(2);
    let a = pool.allocate(100).unwrap();
    let b = pool.allocate(5000).unwrap();
    assert_eq!(a.segment_name(), b.segment_name());
    // Data starts after the segment's claim table.
    let table = claim_table_len(64 << 10) as u64;
    assert_eq!(a.offset(), table);
    assert_eq!(b.offset(), table + 4096);
    assert_eq!(pool.stats().segments, 1);
    assert_eq!(pool.stats().leased_bytes, 4096 + 8192);
}

#[test]
fn a_sender_opening_the_lease_window_writes_into_it() {
    let pool = small_pool(1);
    let _first = pool.allocate(4096).unwrap();
    let lease = pool.allocate(300).unwrap();
    let window =
        SharedRegion::open(lease.segment_name(), lease.offset(), lease.len() as u64).unwrap();
    window.write_at(0, &[6u8; 300]).unwrap();
    let mut seen = [0u8; 300];
    lease.read_at(0, &mut seen).unwrap();
    assert_eq!(seen, [6u8; 300]);
    assert_eq!(
        lease.write_at(1, &[0; 300]).unwrap_err().code,
        Code::OutOfRange
    );
}

#[test]
fn released_ranges_are_recycled_and_coalesced() {
    let pool = small_pool(1);
    let leases: Vec<_> = (0..16).map(|_| pool.allocate(4096).unwrap()).collect();
    assert_eq!(pool.stats().leased_bytes, 64 << 10);
    let name = leases[0].segment_name().to_string();
    drop(leases);
    assert_eq!(pool.stats().leased_bytes, 0);
    // The whole segment is one free range again: a full-size lease fits.
    let whole = pool.allocate(64 << 10).unwrap();
    assert_eq!(whole.segment_name(), name);
    assert_eq!(whole.offset(), claim_table_len(64 << 10) as u64);
    assert_eq!(pool.stats().segments, 1);
    assert_eq!(pool.stats().dedicated_leases_made, 0);
}

#[test]
fn oversized_zero_sized_and_overflow_requests_get_dedicated_regions() {
    let pool = small_pool(1);
    let big = pool.allocate((64 << 10) + 1).unwrap();
    assert_eq!(big.offset(), claim_table_len((64 << 10) + 1) as u64);
    let empty = pool.allocate(0).unwrap();
    assert!(empty.is_empty());
    let full = pool.allocate(64 << 10).unwrap();
    let overflow = pool.allocate(10).unwrap();
    assert_eq!(pool.stats().dedicated_leases_made, 3);
    assert_ne!(overflow.segment_name(), full.segment_name());
}

#[test]
fn quarantined_ranges_are_never_reused() {
    let pool = small_pool(1);
    let lease = pool.allocate(64 << 10).unwrap();
    lease.quarantine();
    assert_eq!(pool.stats().quarantined_bytes, 64 << 10);
    assert_eq!(pool.stats().leased_bytes, 0);
    let next = pool.allocate(4096).unwrap();
    assert_eq!(pool.stats().dedicated_leases_made, 1);
    drop(next);
}

#[test]
fn dropping_the_pool_unlinks_segments_but_leases_stay_usable() {
    let pool = small_pool(1);
    pool.prewarm(3).unwrap();
    assert_eq!(pool.stats().segments, 1);
    let lease = pool.allocate(10).unwrap();
    let name = lease.segment_name().to_string();
    drop(pool);
    assert_eq!(
        SharedRegion::open(&name, 0, 1).unwrap_err().code,
        Code::NotFound
    );
    lease.write_at(0, b"still here").unwrap();
}

#[test]
fn bad_segment_sizes_are_rejected() {
    for segment_len in [0, 1000] {
        let error = ShmPool::new(ShmPoolConfig {
            segment_len,
            max_segments: 1,
        })
        .err()
        .unwrap();
        assert_eq!(error.code, Code::InvalidArgument);
    }
}

#[test]
fn every_lease_has_its_own_claim_slot_in_the_table() {
    let pool = small_pool(1);
    let a = pool.allocate(4096).unwrap();
    let b = pool.allocate(4096).unwrap();
    let dedicated = pool.allocate(0).unwrap();
    let range = |lease: &ShmLease, nonce| ClaimRange {
        nonce,
        offset: lease.offset(),
        len: lease.len() as u64,
    };
    a.claim_slot().arm(&range(&a, 1)).unwrap();
    b.claim_slot().arm(&range(&b, 2)).unwrap();
    dedicated.claim_slot().arm(&range(&dedicated, 3)).unwrap();
    // A sender mapping the whole object sees the same slots.
    let whole = SharedRegion::open_whole(a.segment_name()).unwrap();
    whole
        .claim_slot(a.offset())
        .unwrap()
        .claim(&range(&a, 1))
        .unwrap();
    assert!(whole
        .claim_slot(b.offset())
        .unwrap()
        .claim(&range(&b, 1))
        .is_err());
    whole
        .claim_slot(b.offset())
        .unwrap()
        .claim(&range(&b, 2))
        .unwrap();
    assert!(
        !a.claim_slot().close_unclaimed(&range(&a, 1)),
        "a's claim is visible to its owner"
    );
    // Offsets inside the table have no slot.
    assert!(whole.claim_slot(0).is_err());
}
