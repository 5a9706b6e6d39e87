//! What the ring streams ([`Runs`]) and which of its reads are checked ([`VerifyMode`]).

use crate::runtime::io::{align_up, ReadError};

/// Why a run could not be read into the ring (the ring tells the readers waiting for it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// The read failed (the message names the file and offset).
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The bytes read are not the run `trunk.json` records.
    #[error(transparent)]
    Checksum(#[from] ChecksumMismatch),
    /// The ring's memory refused the extent (a bug of the ring).
    #[error("trunk layer {layer}: {source}")]
    Extent {
        /// The run.
        layer: usize,
        /// Why.
        source: crate::runtime::arena::ArenaError,
    },
    /// The run would end past its extent (a bug of the layout).
    #[error("trunk layer {layer}: run outside its extent")]
    OutsideExtent {
        /// The run.
        layer: usize,
    },
}

/// A run whose bytes do not hash to the checksum `trunk.json` records (damage or a replaced
/// file; exit 2 before work, exit 1 during it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "trunk layer {layer}: checksum mismatch in {file}: its {bytes} bytes hash to xxh3 \
     {got:016x}, trunk.json records {want:016x} (damaged or replaced; `k3-ctl verify` checks \
     every layer, `k3-ctl pack-trunk` rewrites the trunk)"
)]
pub struct ChecksumMismatch {
    /// The layer.
    pub layer: usize,
    /// The file read.
    pub file: String,
    /// Bytes of the run.
    pub bytes: usize,
    /// What they hash to.
    pub got: u64,
    /// What `trunk.json` records.
    pub want: u64,
}

/// What the ring streams: numbered runs of bytes (the trunk's layers), each read from disk into
/// an aligned buffer. Whatever the bytes encode, a run is `run_len` bytes at the offset its read
/// returns.
pub trait Runs: Send + Sync {
    /// Number of runs (layers).
    fn count(&self) -> usize;
    /// Buffer bytes a read of run `l` needs ([`Runs::read`]).
    fn buf_len(&self, l: usize) -> u64;
    /// Bytes of run `l`.
    fn run_len(&self, l: usize) -> u64;
    /// True when run `l` can be read window by window ([`Runs::read_window`]).
    fn windowed(&self, l: usize) -> bool;
    /// Read run `l` into `dst` (aligned, at least [`Runs::buf_len`] bytes); where the run starts
    /// in `dst`.
    fn read(&self, l: usize, dst: &mut [u8]) -> Result<usize, ReadError>;
    /// The part `[at, at + dst.len())` of what [`Runs::read`] writes, into `dst`; where the run
    /// starts in the whole buffer.
    fn read_window(&self, l: usize, dst: &mut [u8], at: usize) -> Result<usize, ReadError>;
    /// Check run `l`'s bytes against its checksum (`Ok` when it has none). The message names the
    /// run.
    fn verify(&self, l: usize, run: &[u8]) -> Result<(), ChecksumMismatch>;
    /// The state of the file run `l` is read from ([`crate::runtime::io::DiskFile::stamp`]), or
    /// `None` when there is none to look at: `K3_TRUNK_VERIFY=first` checks a run again when
    /// its file's stamp differs from the one its last check saw.
    fn stamp(&self, _l: usize) -> Option<crate::runtime::io::FileStamp> {
        None
    }
}

/// Environment variable choosing which ring reads are checked against their checksums
/// ([`VerifyMode`]): `first` (the default), `every`, or `0`/`off`.
pub const VERIFY_ENV: &str = k3_proto::paths::env::K3_TRUNK_VERIFY;

/// Which ring reads are checked against the run's checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyMode {
    /// None (`K3_TRUNK_VERIFY=0`).
    Off,
    /// The first read of each layer in this process, and the first after the file changed (the
    /// default): damage at rest — flipped bits, a `trunk.bin` from another pack — is caught
    /// before the layer's bytes are first used, and a write into the open file (which changes
    /// its change time, [`Runs::stamp`]) makes every layer's next read checked again. Trusted
    /// without a check: a later read of an unchanged file (same inode, size, modification and
    /// change times) returning other bytes than the checked one — the disk failing silently
    /// between two reads, or a writer that resets the change time (which takes setting the
    /// system clock).
    First,
    /// Every read (`K3_TRUNK_VERIFY=every`): also catches bytes that change without the file's
    /// stamp changing, at a CPU cost of about a fifth of the read time (docs/RELIABILITY.md).
    Every,
}

impl VerifyMode {
    /// The mode [`VERIFY_ENV`] selects; `Err` names a value it does not know.
    pub fn from_env() -> Result<VerifyMode, k3_proto::paths::EnvError> {
        match std::env::var(VERIFY_ENV) {
            Err(_) => Ok(VerifyMode::First),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "1" | "first" | "on" | "yes" => Ok(VerifyMode::First),
                "every" | "all" => Ok(VerifyMode::Every),
                "0" | "off" | "no" | "false" => Ok(VerifyMode::Off),
                other => Err(k3_proto::paths::EnvError::Invalid {
                    name: VERIFY_ENV,
                    value: other.to_string(),
                    expected: "first (the default), every or off",
                }),
            },
        }
    }
}

/// Arena bytes run `l` of `runs` takes: its read buffer rounded up to the page.
pub fn extent_bytes(runs: &dyn Runs, l: usize) -> u64 {
    align_up(runs.buf_len(l)).unwrap_or(u64::MAX)
}
