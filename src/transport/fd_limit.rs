//! The process's open-file limit. Each peer a process talks to costs it a
//! few descriptors (a control link each way, UCX's sockets, kept TCP
//! connections), and the common soft limit of 1,024 is far below the usual
//! hard limit (524,288 or more): a process of a large job would run out at
//! its soft limit while the kernel would let it have more, and UCX aborts a
//! process whose accept fails for want of descriptors. So a client of a
//! multi-process job raises the soft limit to the hard one, once per
//! process, and says so (`PJRT_CROSSHOST_RAISE_FD_LIMIT=0` leaves it as it
//! is). Only the soft limit moves, within what the hard limit allows; the
//! hard one, a ceiling set by whoever started the process, stays.
use std::sync::Once;

/// Turns the raise off when set to `0`.
pub const RAISE_ENV: &str = "PJRT_CROSSHOST_RAISE_FD_LIMIT";

/// The soft and hard limits on open files.
pub fn current() -> std::io::Result<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((limit.rlim_cur, limit.rlim_max))
}

/// Raises the soft limit to the hard one; `Ok(Some((old, new)))` when it
/// moved.
pub fn raise_soft_to_hard() -> std::io::Result<Option<(u64, u64)>> {
    let (soft, hard) = current()?;
    if soft >= hard {
        return Ok(None);
    }
    let limit = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: a valid rlimit; raising the soft limit up to the hard one
    // needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Some((soft, hard)))
}

/// `raise_soft_to_hard` once per process, unless turned off; logged.
pub fn raise_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var(RAISE_ENV).as_deref() == Ok("0") {
            log::debug!("open-file limit left as it is ({RAISE_ENV}=0)");
            return;
        }
        match raise_soft_to_hard() {
            Ok(Some((old, new))) => log::info!(
                "raised this process's soft limit on open files from {old} to its hard limit \
                 {new}: each peer of the job costs a few descriptors ({RAISE_ENV}=0 leaves it)"
            ),
            Ok(None) => {}
            Err(e) => log::warn!("cannot raise the soft limit on open files: {e}"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHILD_ENV: &str = "PJRT_CROSSHOST_TEST_FD_LIMIT_CHILD";

    /// Run as a child process: lowers its own soft limit, raises it back.
    #[test]
    #[ignore = "helper run as a child process by the test below"]
    fn child_lowers_then_raises_its_soft_limit() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        let (_, hard) = current().unwrap();
        let low = libc::rlimit {
            rlim_cur: 256.min(hard),
            rlim_max: hard,
        };
        // SAFETY: a valid rlimit, lowering our own soft limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
        let raised = raise_soft_to_hard().unwrap();
        if hard > 256 {
            assert_eq!(raised, Some((256, hard)));
        }
        assert_eq!(current().unwrap(), (hard, hard));
        assert_eq!(
            raise_soft_to_hard().unwrap(),
            None,
            "already at the hard limit"
        );
    }

    #[test]
    fn the_soft_limit_rises_to_the_hard_one_and_no_further() {
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transport::fd_limit::tests::child_lowers_then_raises_its_soft_limit",
                "--ignored",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
    }
}
