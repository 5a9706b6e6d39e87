//! Open-file limits (`RLIMIT_NOFILE`): the store and the worker raise their soft limit to the
//! hard one at start, count the descriptors they will hold, and refuse to start (exit 2, with
//! the number needed) when even the hard limit is too low — rather than fail a request later
//! with "Too many open files".
//!
//! What is counted ([`Needs`]): two descriptors per shard file and per packed trunk or draft
//! (a buffered and an `O_DIRECT` one, `runtime::io::DiskFile`), one per kept session (each is a
//! sealed memfd), two per store connection (its socket, and the read-only memfd a worker's
//! handshake reopens), and [`SLACK`] for the rest (standard streams, the log, the listener, the
//! segment, the tokenizer, report files, `/proc` reads).

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Descriptors kept for everything not counted one by one.
pub const SLACK: u64 = 16;

/// What a process will hold open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Shard files of the checkpoint.
    pub shards: u64,
    /// Packed trunk and draft trunk files.
    pub trunks: u64,
    /// Kept sessions (memfds).
    pub sessions: u64,
    /// Store connections served at once (with the places reserved for control clients).
    pub connections: u64,
    /// Anything else held one by one (a worker's socket and shared memory).
    pub other: u64,
}

impl Needs {
    /// Descriptors needed in all.
    pub fn total(&self) -> u64 {
        SLACK
            + 2 * self.shards
            + 2 * self.trunks
            + self.sessions
            + 2 * self.connections
            + self.other
    }

    /// What the total is made of (for the refusal).
    pub fn describe(&self) -> String {
        let mut parts = vec![format!(
            "{} for {} shard files",
            2 * self.shards,
            self.shards
        )];
        if self.trunks > 0 {
            parts.push(format!("{} for the packed trunk files", 2 * self.trunks));
        }
        if self.sessions > 0 {
            parts.push(format!("{} for kept sessions", self.sessions));
        }
        if self.connections > 0 {
            parts.push(format!(
                "{} for {} connections",
                2 * self.connections,
                self.connections
            ));
        }
        if self.other > 0 {
            parts.push(format!("{} for the store's socket and memory", self.other));
        }
        parts.push(format!("{SLACK} spare"));
        parts.join(", ")
    }
}

/// The limit after [`raise`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The soft limit found at start.
    pub was: u64,
    /// The soft limit now (the hard limit, when it could be raised).
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Raise the soft `RLIMIT_NOFILE` to the hard one (best effort: a failure leaves it as it was).
pub fn raise() -> Limit {
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return Limit {
            was: u64::MAX,
            soft: u64::MAX,
            hard: u64::MAX,
        };
    };
    let mut now = soft;
    // An unlimited hard limit is above what the kernel takes (`fs.nr_open`, 2^20 by default):
    // then the largest power of two it accepts.
    for target in std::iter::once(hard).chain((10..=30).rev().map(|b| 1u64 << b)) {
        if target <= now || target > hard {
            continue;
        }
        if setrlimit(Resource::RLIMIT_NOFILE, target, hard).is_ok() {
            now = target;
            break;
        }
    }
    Limit {
        was: soft,
        soft: now,
        hard,
    }
}

/// The open-file limit cannot hold what the process needs (a refusal, exit 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "{who} needs {n} open files ({what}), but its limit is {soft} (hard limit {hard}): raise it \
     (`ulimit -n {n}`, or LimitNOFILE= for a service){lower}",
    n = needs.total(),
    what = needs.describe(),
    lower = if needs.sessions > 0 || needs.connections > 0 { ", or lower --max-sessions" } else { "" }
)]
pub struct TooFewFiles {
    /// The process.
    pub who: &'static str,
    /// What it needs.
    pub needs: Needs,
    /// The soft limit.
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

impl Limit {
    /// `Err` (a refusal) naming the number needed when `needs` does not fit the limit.
    pub fn check(&self, who: &'static str, needs: &Needs) -> Result<(), TooFewFiles> {
        let n = needs.total();
        if n <= self.soft {
            return Ok(());
        }
        Err(TooFewFiles {
            who,
            needs: *needs,
            soft: self.soft,
            hard: self.hard,
        })
    }

    /// One log line: the limit, raised or not, and what is needed.
    pub fn describe(&self, needs: &Needs) -> String {
        let raised = if self.soft > self.was {
            format!(" (raised from {})", self.was)
        } else {
            String::new()
        };
        format!(
            "open files: limit {}{raised}, {} needed ({})",
            self.soft,
            needs.total(),
            needs.describe()
        )
    }
}

/// How many store connections fit `soft` descriptors besides `fixed` (the rest of the store's
/// needs), at two per connection, at most `max`.
pub fn connections_that_fit(soft: u64, fixed: &Needs, max: u64) -> u64 {
    (soft.saturating_sub(fixed.total()) / 2).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_refuses_with_the_number() {
        let n = Needs {
            shards: 96,
            trunks: 1,
            sessions: 64,
            connections: 264,
            other: 0,
        };
        assert_eq!(n.total(), SLACK + 192 + 2 + 64 + 528);
        let l = Limit {
            was: 256,
            soft: 256,
            hard: 256,
        };
        let e = l.check("k3-store", &n).unwrap_err().to_string();
        assert!(
            e.contains(&format!("needs {}", n.total())) && e.contains("256"),
            "{e}"
        );
        assert!(l.check("x", &Needs::default()).is_ok());
        let fixed = Needs {
            connections: 0,
            ..n
        };
        // Fewer than asked for fit: half of what the fixed needs leave (2 descriptors each).
        assert_eq!(
            connections_that_fit(600, &fixed, 264),
            (600 - fixed.total()) / 2
        );
        assert!((600 - fixed.total()) / 2 < 264);
        assert_eq!(connections_that_fit(100_000, &fixed, 264), 264);
        assert_eq!(connections_that_fit(10, &fixed, 264), 0);
    }

    #[test]
    fn raise_reaches_the_hard_limit() {
        let l = raise();
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!((l.soft, l.hard), (soft, hard));
        assert!(
            soft == hard || soft >= 1 << 20,
            "the soft limit was raised to the hard one"
        );
    }
}
