//! CPU time of processes from `/proc/<pid>/stat` (user plus system time),
//! far steadier than latency on a shared machine: a benchmark reads it
//! before and after a window and divides the difference by the requests.
//! A process counts with its live descendants (a Python launcher's workers)
//! and the children it has waited for.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;

/// One process's `/proc/<pid>/stat` fields that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    ppid: u32,
    /// utime + stime + cutime + cstime, in clock ticks.
    ticks: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last `)`.
fn parse(line: &str) -> anyhow::Result<Stat> {
    let rest = line.rsplit_once(')').map(|(_, r)| r).context("no ')' after the command name")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (3), ppid (4), ..., utime (14), stime (15), cutime (16), cstime (17).
    let field = |n: usize| -> anyhow::Result<u64> {
        let text = fields.get(n - 3).with_context(|| format!("field {n} missing"))?;
        text.parse().with_context(|| format!("field {n} is {text:?}, not a number"))
    };
    Ok(Stat { ppid: u32::try_from(field(4)?)?, ticks: field(14)? + field(15)? + field(16)? + field(17)? })
}

fn stat(pid: u32) -> anyhow::Result<Stat> {
    let path = format!("/proc/{pid}/stat");
    parse(&std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?).with_context(|| format!("parsing {path}"))
}

/// Clock ticks per second, for turning ticks into time.
fn ticks_per_second() -> u64 {
    rustix::param::clock_ticks_per_second()
}

/// Every process's CPU time and parent at one moment.
pub struct Snapshot {
    all: HashMap<u32, Stat>,
}

impl Snapshot {
    /// Reads every process in `/proc`; processes that end meanwhile are left out.
    pub fn take() -> anyhow::Result<Self> {
        let mut all = HashMap::new();
        for entry in std::fs::read_dir("/proc")? {
            let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            if let Ok(s) = stat(pid) {
                all.insert(pid, s);
            }
        }
        Ok(Self { all })
    }

    /// CPU time used so far by `pid` alone (and the children it waited for).
    pub fn own(&self, pid: u32) -> anyhow::Result<Duration> {
        let s = self.all.get(&pid).with_context(|| format!("process {pid} is gone"))?;
        Ok(time(s.ticks))
    }

    /// CPU time used so far by `pid` with its live descendants.
    pub fn tree(&self, pid: u32) -> anyhow::Result<Duration> {
        let descendants: u64 = self.all.iter().filter(|&(&p, _)| p != pid && descends(&self.all, p, pid)).map(|(_, s)| s.ticks).sum();
        Ok(self.own(pid)? + time(descendants))
    }
}

fn time(ticks: u64) -> Duration {
    Duration::from_secs_f64(ticks as f64 / ticks_per_second() as f64)
}

/// Whether `pid`'s chain of parents reaches `root`.
fn descends(all: &HashMap<u32, Stat>, mut pid: u32, root: u32) -> bool {
    // A chain longer than the process table is a loop read mid-change.
    for _ in 0..all.len() {
        match all.get(&pid) {
            Some(s) if s.ppid == root => return true,
            Some(s) if s.ppid > 1 => pid = s.ppid,
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_past_odd_command_names() -> anyhow::Result<()> {
        let line = "4242 (a (b) c) S 17 4242 4242 0 -1 4194560 1 0 0 0 30 12 5 2 20 0 1 0 1 1 1";
        assert_eq!(parse(line)?, Stat { ppid: 17, ticks: 30 + 12 + 5 + 2 });
        assert!(parse("4242 (x) S 1 2").is_err(), "a short line is an error");
        assert!(parse("no name here").is_err());
        Ok(())
    }

    #[test]
    fn a_busy_process_uses_more_cpu_than_an_idle_one() -> anyhow::Result<()> {
        let spawn = |script: &str| std::process::Command::new("sh").args(["-c", script]).spawn();
        let mut busy = spawn("while :; do :; done")?;
        // `exec`: the shell becomes the sleep, so killing it leaves no orphan behind.
        let mut idle = spawn("exec sleep 30")?;
        let read = || -> anyhow::Result<[Duration; 2]> {
            let s = Snapshot::take()?;
            Ok([s.own(busy.id())?, s.own(idle.id())?])
        };
        let before = read()?;
        // Until the busy one has used 200 ms of CPU: no bound on wall time.
        let mut after = before;
        while after[0] - before[0] < Duration::from_millis(200) {
            std::thread::sleep(Duration::from_millis(20));
            after = read()?;
        }
        for c in [&mut busy, &mut idle] {
            c.kill()?;
            c.wait()?;
        }
        assert!(after[1] - before[1] < Duration::from_millis(100), "the sleeping process used {:?}", after[1] - before[1]);
        assert!(Snapshot::take()?.own(busy.id()).is_err(), "a process that is gone is an error");
        Ok(())
    }

    #[test]
    fn descendants_count_with_their_ancestor() -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt;
        // The shell itself waits; the CPU is burnt by its child, in the shell's own process group.
        let mut parent = std::process::Command::new("sh").args(["-c", "sh -c 'while :; do :; done' & wait"]).process_group(0).spawn()?;
        let before = Snapshot::take()?.tree(parent.id())?;
        let mut after = before;
        let start = std::time::Instant::now();
        while after - before < Duration::from_millis(200) && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
            after = Snapshot::take()?.tree(parent.id())?;
        }
        let own = Snapshot::take()?.own(parent.id())?;
        std::process::Command::new("kill").args(["--", &format!("-{}", parent.id())]).status()?;
        parent.wait()?;
        assert!(after - before >= Duration::from_millis(200), "the child's CPU was not counted: {:?}", after - before);
        assert!(own < Duration::from_millis(100), "the waiting shell itself used {own:?}");
        Ok(())
    }
}
