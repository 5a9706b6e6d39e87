//! What some systems answer through a file and others only through a system call (macOS has no
//! `/proc`): one function per question, each a small wrapper with its own `SAFETY` argument.

/// Bytes of memory the system could hand out now without swapping: free pages, speculative
/// (read-ahead) pages, purgeable pages and file-backed pages it can drop (`vm.page_free_count`,
/// `vm.page_speculative_count`, `vm.page_purgeable_count`, `vm.page_pageable_external_count`,
/// times `vm.pagesize`) — the counterpart of Linux's `MemAvailable`. Compressed and wired memory
/// is not counted.
#[cfg(target_vendor = "apple")]
pub fn mem_available() -> std::io::Result<u64> {
    let pages = [
        "vm.page_free_count",
        "vm.page_speculative_count",
        "vm.page_purgeable_count",
        "vm.page_pageable_external_count",
    ]
    .into_iter()
    .map(sysctl_uint)
    .sum::<std::io::Result<u64>>()?;
    pages
        .checked_mul(sysctl_uint("vm.pagesize")?)
        .ok_or_else(|| std::io::Error::other("memory counters overflow"))
}

/// An unsigned integer sysctl (4 or 8 bytes, native order).
#[cfg(target_vendor = "apple")]
pub fn sysctl_uint(name: &str) -> std::io::Result<u64> {
    let cname = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    let mut buf = [0u8; 8];
    let len = sysctl_bytes(&cname, &mut buf)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{name}: {e}")))?;
    match len {
        4 => Ok(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as u64),
        8 => Ok(u64::from_ne_bytes(buf)),
        n => Err(std::io::Error::other(format!("{name}: {n}-byte value"))),
    }
}

/// The CPU's name as the system gives it (`machdep.cpu.brand_string`, e.g. "Apple M2 Max").
#[cfg(target_vendor = "apple")]
pub fn cpu_brand() -> Option<String> {
    let mut buf = [0u8; 256];
    let len = sysctl_bytes(c"machdep.cpu.brand_string", &mut buf).ok()?;
    let s = &buf[..len.min(buf.len())];
    let s = s.split(|&b| b == 0).next().unwrap_or(s);
    Some(String::from_utf8_lossy(s).trim().to_string()).filter(|s| !s.is_empty())
}

/// Reads sysctl `name` into `buf`; returns the bytes written.
#[cfg(target_vendor = "apple")]
fn sysctl_bytes(name: &std::ffi::CStr, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut len: libc::size_t = buf.len();
    // SAFETY: `name` is NUL-terminated; `buf` has `len` writable bytes and the kernel writes at
    // most `len` of them, updating `len`; no new value is set (null, 0).
    let r = unsafe {
        libc::sysctlbyname(
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(len)
}
