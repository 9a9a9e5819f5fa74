//! Which programs a delegating client can run: those its compute plugin's
//! client can. A program whose device assignment reaches devices of other
//! processes (JAX's `jit` over a global mesh, `shard_map` + `psum`,
//! `multihost_utils.sync_global_devices`, `process_allgather`) needs a
//! compute plugin client that spans the job; the one behind this client holds
//! only this process's devices. Without this check the two processes of a
//! job failed with two different errors, neither saying why (the compute
//! plugin's "Multiprocess computations aren't implemented" on one, an
//! unmapped device id on the other). Every process reads the same
//! assignment, so every process gets the same message.
use std::collections::BTreeSet;

use super::client::Client;
use crate::status::{Code, Result, Status};

impl Client {
    /// OK when every device of `assigned` (global ids, from the program's
    /// compile options) is this process's; otherwise the one error that
    /// says what runs instead.
    pub fn check_program_runs_here(&self, assigned: &[i64], function: &str) -> Result<()> {
        let me = self.process_index();
        let process_of = |id: i64| {
            self.devices()
                .iter()
                .find(|d| d.global_id as i64 == id)
                .map(|d| d.process_index)
        };
        let devices: BTreeSet<i64> = assigned.iter().copied().collect();
        if let Some(unknown) = devices.iter().find(|&&id| process_of(id).is_none()) {
            return Err(crate::status::invalid_argument(format!(
                "{function}: the program's device assignment names device {unknown}, which is \
                 no device of this job"
            )));
        }
        let processes: BTreeSet<i32> = devices.iter().filter_map(|&id| process_of(id)).collect();
        if processes.iter().all(|&p| p == me) {
            return Ok(());
        }
        let list = |items: Vec<String>| items.join(", ");
        let compute = match self.compute() {
            Some(compute) => format!(
                "the compute plugin (platform {}, {})",
                compute.platform_name(),
                compute.plugin().path().display()
            ),
            None => "this client (no compute plugin)".to_string(),
        };
        Err(Status::new(
            Code::Unimplemented,
            format!(
                "{function}: this program runs on devices of {} processes (global devices {}, of \
                 processes {}), and {compute} cannot run a program across processes: its client \
                 holds only this process's devices. What runs: programs on one process's devices \
                 (jit of arrays on this process), with crosshost moving arrays between processes \
                 (jax.device_put onto another process's device); for SPMD programs across \
                 processes on CPU, JAX's own CPU backend (JAX_PLATFORMS=cpu)",
                processes.len(),
                list(devices.iter().map(|d| d.to_string()).collect()),
                list(processes.iter().map(|p| p.to_string()).collect()),
            ),
        ))
    }
}
