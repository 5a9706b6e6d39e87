//! Issue 47, item 6, with real processes: a `k3-ctl pack-trunk` (trunk or draft) stopped by
//! SIGTERM or SIGINT removes its temporary files and exits 1; one killed by SIGKILL leaves them,
//! and the next pack into the directory removes them (their writer is dead).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k3_tests::{path_str, send_signal, tiny_model, Run, Sandbox};

/// The files in `dir` (sorted names).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Start `pack-trunk MODEL OUT extra…` and stop it (SIGSTOP) the moment its temporary data file
/// exists, mid-pack; `None` if it finished first (a pack of the tiny model takes ~0.1 s, and the
/// file is watched without sleeping, so that is rare).
fn stopped_mid_pack(
    sb: &Sandbox,
    out: &Path,
    extra: &[&str],
    bin: &str,
) -> Option<(u32, k3_tests::Spawned)> {
    let model = tiny_model();
    let mut args = vec!["pack-trunk", path_str(&model), path_str(out)];
    args.extend_from_slice(extra);
    let p = sb.spawn("k3-ctl", &args);
    let pid = p.pid();
    let tmp: PathBuf = out.join(format!(".{bin}.{pid}.tmp"));
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if tmp.exists() {
            send_signal(pid, "STOP");
            return Some((pid, p));
        }
        if std::fs::metadata(format!("/proc/{pid}")).is_err() {
            break;
        }
    }
    let r = p.wait(Duration::from_secs(30));
    assert_eq!(r.code, 0, "{r:?}");
    None
}

/// `pack-trunk` interrupted by `sig`, in a fresh directory: exit 1, "interrupted", nothing
/// left (no temporary, no half trunk). Tries until the signal lands mid-pack.
fn interrupted(sb: &Sandbox, tag: &str, sig: &str, extra: &[&str], bin: &str) -> Run {
    for attempt in 0..20 {
        let out = sb.dir.join(format!("{tag}-{attempt}"));
        let Some((pid, p)) = stopped_mid_pack(sb, &out, extra, bin) else {
            continue;
        };
        send_signal(pid, sig);
        send_signal(pid, "CONT");
        let r = p.wait(Duration::from_secs(60));
        let left: Vec<String> = names(&out)
            .into_iter()
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{tag}: SIG{sig} left {left:?}: {r:?}");
        if r.code == 0 {
            // The signal came after the last check, as the files were renamed into place:
            // a finished pack, nothing temporary left. Try again.
            continue;
        }
        assert_eq!(r.code, 1, "{tag}: {r:?}");
        assert!(
            r.stderr.contains(&format!("interrupted by SIG{sig}")),
            "{tag}: {}",
            r.stderr
        );
        assert!(names(&out).is_empty(), "{tag}: {:?}", names(&out));
        return r;
    }
    panic!("{tag}: SIG{sig} never landed mid-pack in 20 attempts");
}

#[test]
fn a_signalled_pack_removes_its_temporaries_and_a_killed_ones_are_removed_next_time() {
    let sb = Sandbox::new("pack-interrupt");
    for (sig, extra, bin) in [
        ("TERM", &["--codec", "int4"][..], "trunk.bin"),
        ("INT", &["--codec", "raw"][..], "trunk.bin"),
        ("TERM", &["--draft", "int8"][..], "draft.bin"),
    ] {
        interrupted(&sb, &format!("{bin}-{sig}"), sig, extra, bin);
    }

    // SIGKILL: the temporaries stay (nothing can run), and the next pack removes them.
    let out = sb.dir.join("killed");
    let (pid, p) = loop {
        if let Some(x) = stopped_mid_pack(&sb, &out, &["--codec", "int8"], "trunk.bin") {
            break x;
        }
    };
    let r = p.kill9();
    assert_eq!(r.code, -1, "{r:?}");
    let tmp = format!(".trunk.bin.{pid}.tmp");
    assert!(names(&out).contains(&tmp), "{:?}", names(&out));
    let model = tiny_model();
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            path_str(&model),
            path_str(&out),
            "--codec",
            "int8",
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(names(&out), vec!["trunk.bin", "trunk.json"], "{r:?}");
    assert!(
        r.stderr.contains(&tmp),
        "the removal is logged: {}",
        r.stderr
    );
}
