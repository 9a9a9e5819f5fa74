//! Small UCX processes for the tests that attack a process's UCX workers
//! from outside the job (python_tests/test_ucx_strangers.py): a victim that
//! holds a destination, a stranger that connects, sends one message and
//! dies at once (in the middle of its connection's wire-up), and a friend
//! that sends real bytes afterwards. Each speaks one JSON line at a time on
//! stdout. Uses the plugin's own UCX transport through the library's public
//! API, so the stranger speaks the plugin's wire format, as an attacker
//! reading this source would.
//!
//!   crosshost-ucx-stranger victim
//!       raises its soft open-file limit to the hard one (as a client's
//!       creation does), prints {"addresses": [...]}, then reads commands on
//!       stdin:
//!       `peer <process> <addresses>` (a process it may answer),
//!       `expect <token hex> <len>` (a destination for that token),
//!       `report` (prints {"rejected": n, "fds": open fds, "destinations":
//!       {token: "zero" | "pattern" | "other"}}); exits 0 at end of input.
//!   crosshost-ucx-stranger stranger <victim addresses> <delay µs> [process]
//!       sends 64 bytes under a random token, waits `delay`, `_exit(0)`.
//!   crosshost-ucx-stranger friend <victim addresses> <token hex> <len>
//!       prints {"addresses": [...]}, waits for a line on stdin, sends `len`
//!       pattern bytes under the token, prints {"outcome": "OK" | error}.
//!
//! Addresses are the workers' addresses in hex, comma-separated.
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use pjrt_crosshost::status::Result;
use pjrt_crosshost::transport::auth_token::AuthToken;
use pjrt_crosshost::transport::destination::HeapDestination;
use pjrt_crosshost::transport::hex;
use pjrt_crosshost::transport::ucx::{load, Payload, UcxTransport};

const VICTIM: u32 = 0;
const FRIEND: u32 = 1;
const STRANGER: u32 = 7;
const SEND_TIMEOUT: Duration = Duration::from_secs(20);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let outcome = match args.first().map(String::as_str) {
        Some("victim") => victim(),
        Some("stranger") if args.len() >= 3 => stranger(&args[1], &args[2], args.get(3)),
        Some("friend") if args.len() == 4 => friend(&args[1], &args[2], &args[3]),
        _ => {
            eprintln!(
                "usage: crosshost-ucx-stranger victim | stranger <addresses> <delay µs> [process] \
                 | friend <addresses> <token hex> <len>"
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = outcome {
        eprintln!("crosshost-ucx-stranger: {e}");
        std::process::exit(1);
    }
}

fn addresses_of(text: &str) -> Vec<Vec<u8>> {
    text.split(',')
        .map(|a| hex::decode(a).unwrap_or_else(|| panic!("not hex: {a}")))
        .collect()
}

fn token_of(text: &str) -> AuthToken {
    let bytes = hex::decode(text).expect("a hex token");
    AuthToken::from_bytes(bytes.try_into().expect("a token's length"))
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn start(me: u32) -> Result<UcxTransport> {
    let loaded = load(None)?;
    UcxTransport::with_workers(&loaded, me, 2)
}

fn say_addresses(transport: &UcxTransport) {
    let list: Vec<String> = transport
        .addresses()
        .iter()
        .map(|a| format!("\"{}\"", hex::encode(a)))
        .collect();
    say(format!(
        "{{\"addresses\": [{}], \"version\": \"{}\"}}",
        list.join(", "),
        transport.version()
    ));
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 + 1).collect()
}

fn victim() -> Result<()> {
    // As a multi-process client does at creation.
    pjrt_crosshost::transport::fd_limit::raise_once();
    let transport = start(VICTIM)?;
    say_addresses(&transport);
    let mut peers: HashMap<u32, Vec<Vec<u8>>> = HashMap::from([(VICTIM, transport.addresses())]);
    let mut destinations: Vec<(String, Arc<HeapDestination>)> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| pjrt_crosshost::status::internal(e.to_string()))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["peer", process, addresses] => {
                peers.insert(process.parse().expect("a process"), addresses_of(addresses));
                transport.set_peers(&peers);
                say("{\"ok\": true}".into());
            }
            ["expect", token, len] => {
                let destination = Arc::new(HeapDestination::new(len.parse().expect("a length")));
                transport
                    .registry()
                    .register(token_of(token), destination.clone())?;
                destinations.push((token.to_string(), destination));
                say("{\"ok\": true}".into());
            }
            ["report"] => {
                let seen: Vec<String> = destinations
                    .iter()
                    .map(|(token, d)| {
                        let bytes = d.to_vec();
                        let what = if bytes.iter().all(|b| *b == 0) {
                            "zero"
                        } else if bytes == pattern(bytes.len()) {
                            "pattern"
                        } else {
                            "other"
                        };
                        format!("\"{token}\": \"{what}\"")
                    })
                    .collect();
                let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
                say(format!(
                    "{{\"rejected\": {}, \"fds\": {fds}, \"destinations\": {{{}}}}}",
                    transport.rejected_messages(),
                    seen.join(", ")
                ));
            }
            _ => say(format!("{{\"error\": \"unknown command {line:?}\"}}")),
        }
    }
    Ok(())
}

fn stranger(victim: &str, delay_us: &str, process: Option<&String>) -> Result<()> {
    let me = process.map_or(STRANGER, |p| p.parse().expect("a process"));
    let transport = start(me)?;
    let peers = HashMap::from([(VICTIM, addresses_of(victim)), (me, transport.addresses())]);
    transport.set_peers(&peers);
    transport.send(
        VICTIM,
        AuthToken::generate()?,
        0,
        Payload::owned(vec![0xee; 64]),
        None,
        SEND_TIMEOUT,
        Box::new(|_| {}),
        0,
    );
    std::thread::sleep(Duration::from_micros(delay_us.parse().expect("a delay")));
    // Gone in the middle of whatever the connection was doing: no close, no
    // flush, no destructor.
    // SAFETY: _exit ends the process at once; nothing runs after it.
    unsafe { libc::_exit(0) }
}

fn friend(victim: &str, token: &str, len: &str) -> Result<()> {
    let transport = start(FRIEND)?;
    say_addresses(&transport);
    let mut go = String::new();
    let _ = std::io::stdin().lock().read_line(&mut go);
    let peers = HashMap::from([
        (VICTIM, addresses_of(victim)),
        (FRIEND, transport.addresses()),
    ]);
    transport.set_peers(&peers);
    let (tx, rx) = crossbeam_channel::bounded(1);
    transport.send(
        VICTIM,
        token_of(token),
        0,
        Payload::owned(pattern(len.parse().expect("a length"))),
        None,
        SEND_TIMEOUT,
        Box::new(move |outcome| {
            let _ = tx.send(outcome);
        }),
        0,
    );
    let outcome = match rx.recv_timeout(SEND_TIMEOUT + Duration::from_secs(5)) {
        Ok(Ok(_)) => "OK".to_string(),
        Ok(Err(e)) => e.to_string().replace('"', "'"),
        Err(_) => "never answered".into(),
    };
    say(format!("{{\"outcome\": \"{outcome}\"}}"));
    Ok(())
}
