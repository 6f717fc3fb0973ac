//! What this node and its processes are: the host name and process id a
//! writer's lease carries, and whether the process holding a lease on
//! this host is still alive. The engine knows nothing of processes; the
//! lease asks this through `LeaseConfig::alive`.

use arbor_engine::head::LeaseConfig;
use std::sync::Arc;
use std::time::Duration;

/// How long a writer's claim on its branch lives without renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(60);

/// This process's claim: this host, this pid, a one-minute lease, and a
/// holder in this boot and PID namespace judged by whether its process is
/// alive (elsewhere, by watching its lease).
pub fn lease() -> LeaseConfig {
    LeaseConfig {
        host: hostname(),
        pid: std::process::id(),
        pid_scope: pid_scope(),
        ttl: LEASE_TTL,
        alive: Some(Arc::new(pid_alive)),
        take_over: false,
    }
}

/// The boot and PID namespace this process's pid is read in:
/// `<boot id>/<pid namespace>`, or empty if either is unknown (then no
/// holder is judged by its pid). Two containers on one host with their own
/// PID namespaces have different scopes, so neither takes the other's pid
/// for a dead process.
pub fn pid_scope() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|b| b.trim().to_string());
    let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.to_string_lossy().into_owned());
    match (boot, ns) {
        (Ok(b), Ok(n)) if !b.is_empty() && !n.is_empty() => format!("{b}/{n}"),
        _ => String::new(),
    }
}

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Whether process `pid` is alive on this host. A zombie is not: it has
/// exited and closed everything, and only waits for its parent to collect
/// its status, which a container's first process may never do (a mount
/// killed with -9 there would otherwise hold its branch for good).
pub fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 checks existence and permission only.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    let exists = rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !matches!(process_state(pid), Some('Z' | 'X'))
}

/// The state letter of `/proc/PID/stat` (after the parenthesised name,
/// which may itself hold spaces and parentheses).
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_that_exited_counts_as_gone_before_its_parent_collects_it() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id();
        assert!(pid_alive(pid), "a running process");
        child.kill().expect("kill");
        // Not waited for yet: a zombie until `wait` below.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while process_state(pid) != Some('Z') && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(process_state(pid), Some('Z'));
        assert!(!pid_alive(pid), "a zombie holds nothing");
        child.wait().expect("wait");
        assert!(!pid_alive(pid));
        assert!(pid_alive(std::process::id()), "this process");
    }

    #[test]
    fn a_lease_held_on_this_host_lives_as_long_as_its_process() {
        use arbor_engine::head::Lease;
        let me = lease();
        assert!(!me.pid_scope.is_empty(), "this machine has a boot id and a PID namespace");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        // Expired long ago by its clock, yet its process runs: still held.
        let held = Lease {
            writer: 1,
            host: me.host.clone(),
            pid: child.id(),
            expires: 0,
            pid_scope: me.pid_scope.clone(),
            ttl_ms: 60_000,
            renewal: 1,
        };
        assert_eq!(held.judged_here(Some(&me)), Some(true));
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(held.judged_here(Some(&me)), Some(false), "a dead holder in this PID scope holds nothing");
        // Another PID namespace on this host (a container), or another
        // host: its pid means nothing here, whatever its clock says.
        let container = Lease { pid_scope: "other-boot/pid:[1]".into(), ..held.clone() };
        assert_eq!(container.judged_here(Some(&me)), None);
        let far = Lease { host: "elsewhere".into(), ..held };
        assert_eq!(far.judged_here(Some(&me)), None);
    }
}
