//! The parent's line-based link to its child process (stdin commands,
//! stdout answers), shared by the benchmarks.
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout};
use std::time::Duration;

use crate::ffi_client::Result;

pub struct ChildLink {
    child: Child,
    reader: BufReader<ChildStdout>,
}

impl ChildLink {
    /// Takes over a child spawned with piped stdin and stdout.
    pub fn new(mut child: Child) -> Result<ChildLink> {
        let reader = BufReader::new(child.stdout.take().ok_or("no child stdout")?);
        Ok(ChildLink { child, reader })
    }

    pub fn send(&mut self, line: &str) -> Result<()> {
        let stdin = self.child.stdin.as_mut().ok_or("child stdin closed")?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("to child: {e}"))
    }

    /// Reads one answer line, which must start with `word`; the rest of it.
    pub fn expect(&mut self, word: &str) -> Result<String> {
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let rest = line
            .trim_end()
            .strip_prefix(word)
            .ok_or_else(|| format!("child said {line:?}, expected {word} (see its stderr)"))?;
        Ok(rest.trim().to_string())
    }
}

impl Drop for ChildLink {
    /// Asks the child to quit; kills it if it has not exited within 5 s.
    fn drop(&mut self) {
        let _ = self.send("quit");
        for _ in 0..500 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            // Polling a child's exit: there is no blocking wait with a timeout.
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!("child did not exit; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
