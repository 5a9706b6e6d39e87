//! The CPU's name for `k3-ctl doctor` and the kernel figures: `/proc/cpuinfo`'s `model name`
//! (x86-64 Linux); on aarch64 Linux, whose `/proc/cpuinfo` names no model, each core's
//! `CPU implementer` and `CPU part` (its MIDR fields) looked up in Arm's and the vendors'
//! published part numbers, cores of one kind counted (`Cortex-A76 ×4 + Cortex-A55 ×4`); on macOS
//! `machdep.cpu.brand_string` ("Apple M2 Max").

/// The name of this machine's CPU, or "unknown".
pub fn cpu_model() -> String {
    #[cfg(target_vendor = "apple")]
    if let Some(b) = k3_store::sys::cpu_brand() {
        return b;
    }
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| from_cpuinfo(&s))
        .unwrap_or_else(|| "unknown".into())
}

/// The model named by a `/proc/cpuinfo` text: its first `model name`, else its cores' MIDR
/// implementer/part pairs named and counted in order of first appearance.
pub fn from_cpuinfo(s: &str) -> Option<String> {
    let field = |l: &str, key: &str| -> Option<String> {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    };
    if let Some(m) = s.lines().find_map(|l| field(l, "model name")) {
        return Some(m);
    }
    let mut kinds: Vec<(String, usize)> = Vec::new();
    let mut implementer = None;
    for l in s.lines() {
        if let Some(v) = field(l, "CPU implementer") {
            implementer = parse_hex(&v);
        } else if let Some(v) = field(l, "CPU part") {
            let (Some(i), Some(p)) = (implementer.take(), parse_hex(&v)) else {
                continue;
            };
            let name = midr_name(i, p);
            match kinds.iter_mut().find(|(n, _)| *n == name) {
                Some((_, c)) => *c += 1,
                None => kinds.push((name, 1)),
            }
        }
    }
    if kinds.is_empty() {
        return None;
    }
    let parts: Vec<String> = kinds
        .iter()
        .map(|(n, c)| {
            if *c > 1 {
                format!("{n} ×{c}")
            } else {
                n.clone()
            }
        })
        .collect();
    Some(parts.join(" + "))
}

fn parse_hex(v: &str) -> Option<u32> {
    u32::from_str_radix(v.trim().trim_start_matches("0x"), 16).ok()
}

/// The name of an aarch64 core from its MIDR implementer and part number.
pub fn midr_name(implementer: u32, part: u32) -> String {
    let known = match (implementer, part) {
        (0x41, 0xd03) => "Arm Cortex-A53",
        (0x41, 0xd04) => "Arm Cortex-A35",
        (0x41, 0xd05) => "Arm Cortex-A55",
        (0x41, 0xd07) => "Arm Cortex-A57",
        (0x41, 0xd08) => "Arm Cortex-A72",
        (0x41, 0xd09) => "Arm Cortex-A73",
        (0x41, 0xd0a) => "Arm Cortex-A75",
        (0x41, 0xd0b) => "Arm Cortex-A76",
        (0x41, 0xd0c) => "Arm Neoverse N1",
        (0x41, 0xd0d) => "Arm Cortex-A77",
        (0x41, 0xd40) => "Arm Neoverse V1",
        (0x41, 0xd41) => "Arm Cortex-A78",
        (0x41, 0xd44) => "Arm Cortex-X1",
        (0x41, 0xd46) => "Arm Cortex-A510",
        (0x41, 0xd47) => "Arm Cortex-A710",
        (0x41, 0xd48) => "Arm Cortex-X2",
        (0x41, 0xd49) => "Arm Neoverse N2",
        (0x41, 0xd4a) => "Arm Neoverse E1",
        (0x41, 0xd4d) => "Arm Cortex-A715",
        (0x41, 0xd4e) => "Arm Cortex-X3",
        (0x41, 0xd4f) => "Arm Neoverse V2",
        (0x41, 0xd80) => "Arm Cortex-A520",
        (0x41, 0xd81) => "Arm Cortex-A720",
        (0x41, 0xd82) => "Arm Cortex-X4",
        (0x41, 0xd84) => "Arm Neoverse V3",
        (0x41, 0xd8e) => "Arm Neoverse N3",
        (0x46, 0x001) => "Fujitsu A64FX",
        (0x48, 0xd01) => "HiSilicon Kunpeng 920",
        (0x61, 0x022) => "Apple M1 (Icestorm)",
        (0x61, 0x023) => "Apple M1 (Firestorm)",
        (0x61, 0x032) => "Apple M2 (Blizzard)",
        (0x61, 0x033) => "Apple M2 (Avalanche)",
        (0xc0, 0xac3) => "AmpereOne",
        _ => "",
    };
    if !known.is_empty() {
        return known.to_string();
    }
    let vendor = match implementer {
        0x41 => "Arm",
        0x42 => "Broadcom",
        0x43 => "Cavium",
        0x46 => "Fujitsu",
        0x48 => "HiSilicon",
        0x4e => "NVIDIA",
        0x50 => "Applied Micro",
        0x51 => "Qualcomm",
        0x61 => "Apple",
        0xc0 => "Ampere",
        _ => "aarch64",
    };
    format!("{vendor} core (implementer {implementer:#04x}, part {part:#05x})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x86_model_name_wins() {
        let s = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n";
        assert_eq!(from_cpuinfo(s).as_deref(), Some("AMD EPYC 9R14"));
    }

    /// A Graviton3-like text (every core a Neoverse V1) and a big.LITTLE phone-like one: the
    /// parts named and counted per kind, in order of first appearance.
    #[test]
    fn aarch64_cores_are_named_from_their_midr_fields() {
        let core = |i: usize, imp: &str, part: &str| {
            format!(
                "processor\t: {i}\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm\n\
                 CPU implementer\t: {imp}\nCPU architecture: 8\nCPU variant\t: 0x1\n\
                 CPU part\t: {part}\nCPU revision\t: 1\n\n"
            )
        };
        let g3: String = (0..4).map(|i| core(i, "0x41", "0xd40")).collect();
        assert_eq!(from_cpuinfo(&g3).as_deref(), Some("Arm Neoverse V1 ×4"));
        let bl: String = (0..4)
            .map(|i| core(i, "0x41", "0xd05"))
            .chain((4..6).map(|i| core(i, "0x41", "0xd0b")))
            .collect();
        assert_eq!(
            from_cpuinfo(&bl).as_deref(),
            Some("Arm Cortex-A55 ×4 + Arm Cortex-A76 ×2")
        );
        let odd = core(0, "0x51", "0x801");
        assert_eq!(
            from_cpuinfo(&odd).as_deref(),
            Some("Qualcomm core (implementer 0x51, part 0x801)")
        );
        assert_eq!(midr_name(0x41, 0xd4f), "Arm Neoverse V2");
        assert_eq!(from_cpuinfo("processor\t: 0\n"), None);
    }
}
