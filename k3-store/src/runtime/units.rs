//! Byte counts as people read them (`12.34 GB`, `17.55 MB`): the plan, the stream and the
//! expert cache print them alike.

/// Bytes in a GB (decimal, as the presets and the flags count).
pub const GB: f64 = 1e9;

/// `12.34 GB`.
pub fn fmt_gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / GB)
}

/// `12.34 GB` from 1 GB up, else `17.55 MB`.
pub fn fmt_bytes(b: u64) -> String {
    if b as f64 >= GB {
        fmt_gb(b)
    } else {
        fmt_mb(b)
    }
}

/// `17.55 MB`.
pub fn fmt_mb(b: u64) -> String {
    format!("{:.2} MB", b as f64 / 1e6)
}
