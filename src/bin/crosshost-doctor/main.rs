//! crosshost-doctor: what this process would use for a job (the library,
//! the compute plugin, the libucp and what it can do, the address it would
//! advertise and why) and, run on every process of a job, whether each
//! peer answers, with round-trip times. Exit status 0 when no problem was
//! found, 1 when one was (each printed with the option to change), 2 on a
//! usage error. The checks are the library's (`api::doctor`), the same
//! `python -m jax_plugins.crosshost doctor` runs.
//!
//! ```text
//! crosshost-doctor                                   this host only
//! crosshost-doctor --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 0   (on host a)
//! crosshost-doctor --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 1   (on host b)
//! crosshost-doctor --etcd etcd://10.0.0.9:2379 --num-processes 2 --process-id 0
//! ```
use std::process::ExitCode;

use pjrt_crosshost::api::doctor;

const USAGE: &str =
    "usage: crosshost-doctor [--coordinator HOST:PORT | --etcd etcd://HOST:PORT[,...]]
                        [--num-processes N --process-id I] [--advertise-address ADDRESS]
                        [--transport auto|tcp|ucx] [--ucx-library PATH] [--session NAME]
                        [--timeout SECONDS] [-o KEY=VALUE]... [--json]

  With no job, checks this host: the library, the compute plugin, the libucp it
  would load and what that can do, the address it would advertise and why.
  With a job, run it on every process (same store, process count and session,
  a distinct --process-id each): it also checks that every peer's control link
  and TCP data port answer, with round-trip times.
  --coordinator HOST:PORT   process 0 serves the job's store there (as JAX's
                            coordinator does); the others connect to it
  --etcd URL                the job's store is etcd (kv_store=URL)
  -o KEY=VALUE              any PJRT_Client_Create option (as in
                            PJRT_CROSSHOST_CREATE_OPTIONS)
  --timeout SECONDS         bound on each peer check (default 10)
  --json                    print the report as JSON
  PJRT_CROSSHOST_LOG=info   also log what the library does";

fn main() -> ExitCode {
    if let Ok(filter) = std::env::var("PJRT_CROSSHOST_LOG") {
        let _ = env_logger::Builder::new()
            .parse_filters(&filter)
            .format_timestamp_micros()
            .try_init();
    }
    let (request, json) = match request(std::env::args().skip(1).collect()) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("crosshost-doctor: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let report = doctor::run(&request);
    if json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The doctor's request (`key=value` lines) and whether to print JSON.
fn request(args: Vec<String>) -> Result<(String, bool), String> {
    let mut lines = Vec::new();
    let mut json = false;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_string(), Some(value.to_string()))
            }
            _ => (arg.clone(), None),
        };
        let mut value = || -> Result<String, String> {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Err("help".into()),
            "--json" => json = true,
            "--coordinator" => lines.push(format!("doctor.coordinator={}", value()?)),
            "--etcd" => lines.push(format!("kv_store={}", value()?)),
            "--num-processes" => lines.push(format!("num_nodes={}", value()?)),
            "--process-id" => lines.push(format!("node_id={}", value()?)),
            "--advertise-address" => lines.push(format!("advertise_address={}", value()?)),
            "--transport" => lines.push(format!("transport={}", value()?)),
            "--ucx-library" => lines.push(format!("ucx_library={}", value()?)),
            "--session" => lines.push(format!("session={}", value()?)),
            "--timeout" => {
                let seconds: f64 = value()?
                    .parse()
                    .map_err(|_| "--timeout takes seconds".to_string())?;
                lines.push(format!("doctor.timeout_ms={}", (seconds * 1e3) as u64));
            }
            "-o" | "--option" => {
                let option = value()?;
                if !option.contains('=') {
                    return Err(format!("-o takes KEY=VALUE, got {option:?}"));
                }
                lines.push(option);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok((lines.join("\n"), json))
}
