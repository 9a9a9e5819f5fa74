use super::*;
use crate::transport::shm_owner::ShmOwner;

const CHILD_ENV: &str = "PJRT_CROSSHOST_TEST_SHM_NAME";

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn names_are_unguessable_and_validated() {
    let a = SharedRegion::create(1).unwrap();
    let b = SharedRegion::create(1).unwrap();
    assert_ne!(a.name(), b.name());
    validate_shm_name(a.name()).unwrap();
    let hex = "0123456789abcdef0123456789abcdef";
    for bad in [
        String::new(),
        "/crosshost-".into(),
        "/crosshost-../../etc/passwd".into(),
        "/crosshost-1-2-3-../../etc/passwd".into(),
        format!("/other-1-2-3-{hex}"),
        format!("/pjrt-crosshost-{hex}"),
        format!("crosshost-1-2-3-{hex}"),
        format!("/crosshost-{hex}"),
        format!("/crosshost-1-2-{hex}"),
        format!("/crosshost-1-2-3-4-{hex}"),
        format!("/crosshost-1-2-3-{}", hex.to_uppercase()),
        format!("/crosshost-1-2-3-{hex}0"),
        format!("/crosshost-1-2-3-{}", &hex[1..]),
        format!("/crosshost-1-2-3-{hex}/"),
        format!("/crosshost--2-3-{hex}"),
        format!("/crosshost-1--3-{hex}"),
        format!("/crosshost-1-2--{hex}"),
        format!("/crosshost-01-2-3-{hex}"),
        format!("/crosshost-1-02-3-{hex}"),
        format!("/crosshost-1-2-03-{hex}"),
        format!("/crosshost-+1-2-3-{hex}"),
        format!("/crosshost-1-2- 3-{hex}"),
        format!("/crosshost-0-2-3-{hex}"),
        format!("/crosshost-1-0-3-{hex}"),
        format!("/crosshost-1-2147483648-3-{hex}"),
        format!("/crosshost-1-2-18446744073709551616-{hex}"),
        format!("/crosshost-1-2-123456789012345678901-{hex}"),
    ] {
        assert_eq!(
            validate_shm_name(&bad).unwrap_err().code,
            status::Code::InvalidArgument,
            "{bad:?}"
        );
        let error = SharedRegion::open(&bad, 0, 0).unwrap_err();
        assert_eq!(error.code, status::Code::InvalidArgument, "{bad:?}");
    }
    for good in [
        format!("/crosshost-1-2-0-{hex}"),
        format!("/crosshost-4026531836-2147483647-18446744073709551615-{hex}"),
    ] {
        validate_shm_name(&good).unwrap();
    }
}

#[test]
fn names_carry_their_creator() {
    let me = ShmOwner::current().unwrap();
    let region = SharedRegion::create(1).unwrap();
    assert_eq!(shm_name_owner(region.name()).unwrap(), me);
    let prefix = shm_name_prefix_of(&me);
    assert_eq!(
        prefix,
        format!(
            "/crosshost-{}-{}-{}-",
            me.pid_namespace, me.pid, me.start_time
        )
    );
    let random = region.name().strip_prefix(&prefix).unwrap();
    assert_eq!(random.len(), 32);
    assert!(random
        .bytes()
        .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
    let owner = ShmOwner {
        pid_namespace: 7,
        pid: 42,
        start_time: 0,
    };
    let name = shm_name(&owner, "00000000000000000000000000000000");
    assert_eq!(name, "/crosshost-7-42-0-00000000000000000000000000000000");
    assert_eq!(shm_name_owner(&name).unwrap(), owner);
}

#[test]
fn created_object_is_private_to_its_owner() {
    let region = SharedRegion::create(4096).unwrap();
    let metadata = std::fs::metadata(format!("/dev/shm{}", region.name())).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
    assert_eq!(metadata.len(), 4096);
}

#[test]
fn a_second_mapping_sees_writes_at_unaligned_offsets() {
    let region = SharedRegion::create(3 * 4096 + 100).unwrap();
    let offset = 4096 + 17;
    let window = SharedRegion::open(region.name(), offset as u64, 5000).unwrap();
    assert_eq!(window.len(), 5000);
    let bytes = pattern(5000, 3);
    window.write_at(0, &bytes).unwrap();
    let mut seen = vec![0u8; 5000];
    region.read_at(offset, &mut seen).unwrap();
    assert_eq!(seen, bytes);
    let mut before = [1u8; 17];
    region.read_at(4096, &mut before).unwrap();
    assert_eq!(before, [0u8; 17], "bytes before the window stay untouched");
}

#[test]
fn windows_outside_the_object_are_rejected() {
    let region = SharedRegion::create(1000).unwrap();
    let too_long = SharedRegion::open(region.name(), 0, 1001).unwrap_err();
    assert_eq!(too_long.code, status::Code::InvalidArgument);
    assert!(
        too_long.message.contains("1000 bytes"),
        "{}",
        too_long.message
    );
    let past_end = SharedRegion::open(region.name(), 999, 2).unwrap_err();
    assert_eq!(past_end.code, status::Code::InvalidArgument);
    let overflow = SharedRegion::open(region.name(), u64::MAX, 2).unwrap_err();
    assert_eq!(overflow.code, status::Code::InvalidArgument);
    SharedRegion::open(region.name(), 1000, 0).unwrap();
    let window = SharedRegion::open(region.name(), 10, 10).unwrap();
    assert_eq!(
        window.write_at(5, &[0u8; 6]).unwrap_err().code,
        status::Code::OutOfRange
    );
    assert_eq!(
        window.write_at(usize::MAX, &[0u8; 2]).unwrap_err().code,
        status::Code::OutOfRange
    );
}

#[test]
fn zero_length_regions_work() {
    let region = SharedRegion::create(0).unwrap();
    assert!(region.is_empty());
    assert!(!region.as_ptr().is_null());
    region.write_at(0, &[]).unwrap();
    let window = SharedRegion::open(region.name(), 0, 0).unwrap();
    assert!(window.is_empty());
    region.unlink().unwrap();
    assert_eq!(
        SharedRegion::open(region.name(), 0, 0).unwrap_err().code,
        status::Code::NotFound
    );
}

#[test]
fn unlink_is_idempotent_keeps_mappings_and_drop_unlinks() {
    let region = SharedRegion::create(64).unwrap();
    let name = region.name().to_string();
    let window = SharedRegion::open(&name, 0, 64).unwrap();
    assert_eq!(
        window.unlink().unwrap_err().code,
        status::Code::FailedPrecondition
    );
    region.unlink().unwrap();
    region.unlink().unwrap();
    assert_eq!(
        SharedRegion::open(&name, 0, 1).unwrap_err().code,
        status::Code::NotFound
    );
    window.write_at(0, b"still mapped").unwrap();
    let mut seen = [0u8; 12];
    region.read_at(0, &mut seen).unwrap();
    assert_eq!(&seen, b"still mapped");

    let dropped = SharedRegion::create(8).unwrap();
    let dropped_name = dropped.name().to_string();
    drop(dropped);
    assert!(!std::path::Path::new(&format!("/dev/shm{dropped_name}")).exists());
}

#[test]
fn prefaulted_regions_are_zeroed() {
    let region = SharedRegion::create_with(1 << 20, CreateOptions { prefault: true }).unwrap();
    let mut seen = vec![1u8; 1 << 20];
    region.read_at(0, &mut seen).unwrap();
    assert!(seen.iter().all(|&byte| byte == 0));
    let window = SharedRegion::open_with(region.name(), 4096, 8192, true).unwrap();
    window.write_at(0, &[9u8; 8192]).unwrap();
}

/// Runs in a child process (see the test below): opens the region it is
/// told about and writes a pattern.
#[test]
#[ignore = "helper run as a child process by another_process_writes_into_the_region"]
fn child_writes_into_shared_region() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (name, len) = spec.split_once(',').unwrap();
    let len: usize = len.parse().unwrap();
    let window = SharedRegion::open(name, 0, len as u64).unwrap();
    window.write_at(0, &pattern(len, 42)).unwrap();
}

#[test]
fn another_process_writes_into_the_region() {
    let len = 3 * 4096 + 5;
    let region = SharedRegion::create(len).unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "transport::shm::tests::child_writes_into_shared_region",
            "--ignored",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{},{len}", region.name()))
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let mut seen = vec![0u8; len];
    region.read_at(0, &mut seen).unwrap();
    assert_eq!(seen, pattern(len, 42));
}

/// /dev/shm is writable by every user: an object under one of our names
/// that another user owns is refused, never written into.
#[test]
fn an_object_of_another_user_is_refused() {
    let region = SharedRegion::create(4096).unwrap();
    let path = std::ffi::CString::new(format!("/dev/shm{}", region.name())).unwrap();
    // SAFETY: a valid path; plain syscall.
    if unsafe { libc::chown(path.as_ptr(), 65534, 65534) } != 0 {
        println!(
            "SKIPPED: chown needs root: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    for opened in [
        SharedRegion::open(region.name(), 0, 4096),
        SharedRegion::open_whole(region.name()),
    ] {
        let e = opened.unwrap_err();
        assert_eq!(e.code, crate::status::Code::PermissionDenied, "{e}");
        assert!(e.message.contains("belongs to uid 65534"), "{e}");
    }
}
