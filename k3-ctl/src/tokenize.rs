//! `k3-ctl tokenize` / `detokenize`: the Kimi K3 tokenizer on the command line.
//!
//! `tokenize` prints the ids as one comma-separated line (an empty input prints an empty line);
//! `detokenize` writes the exact bytes of the ids with nothing added. Input text must be UTF-8
//! (the tokenizer works on Unicode text, like tiktoken): other bytes are refused with the offset
//! of the first invalid byte. Usage errors, an unreadable tokenizer or input, and bad ids exit 2;
//! a failed write to stdout exits 1.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_proto::exit;
use k3_worker::tokenizer::{pretok::RegexSplitter, Tokenizer};

use crate::fail::Failed;

/// Arguments of `k3-ctl tokenize`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct TokenizeArgs {
    /// Tokenizer directory (holds `tiktoken.model` and `tokenizer_config.json`).
    #[arg(long, value_name = "DIR")]
    pub tok: PathBuf,
    /// Text to encode.
    #[arg(long, allow_hyphen_values = true)]
    pub text: Option<String>,
    /// File whose bytes (UTF-8) are encoded exactly, with no newline stripped.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Turn added-token strings such as `<|open|>` into their ids (default: user text, where
    /// they are ordinary characters).
    #[arg(long)]
    pub allow_special: bool,
    /// Print timings to stderr: tokenizer load and encode seconds (encode excludes reading the
    /// input and printing), bytes, tokens and encode MB/s.
    #[arg(long)]
    pub stats: bool,
    /// Pre-tokenize with the reference regex (fancy-regex running Kimi's pattern, as tiktoken
    /// does) instead of the scanner; for cross-checks and benchmarks.
    #[arg(long, hide = true)]
    pub regex_pretok: bool,
}

/// Arguments of `k3-ctl detokenize`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["ids", "ids_file"])))]
pub struct DetokenizeArgs {
    /// Tokenizer directory.
    #[arg(long, value_name = "DIR")]
    pub tok: PathBuf,
    /// Comma-separated ids, e.g. `19180,2695` (may be empty).
    #[arg(long, allow_hyphen_values = true)]
    pub ids: Option<String>,
    /// File holding comma-separated ids (for lists too long for the command line); one trailing
    /// newline is allowed.
    #[arg(long)]
    pub ids_file: Option<PathBuf>,
}

fn load(dir: &Path) -> Result<Tokenizer, Failed> {
    Tokenizer::from_dir(dir).map_err(|e| {
        Failed::with_code(
            format!("cannot load the tokenizer from {}", dir.display()),
            exit::REFUSED,
            e,
        )
    })
}

fn write_stdout(bytes: &[u8]) -> Result<i32, Failed> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .map_err(|e| Failed::with_code("cannot write to stdout", exit::FAILURE, e))?;
    Ok(exit::OK)
}

/// The bytes of `path`, or the refusal to read it.
fn read_input(path: &Path) -> Result<Vec<u8>, Failed> {
    std::fs::read(path)
        .map_err(|e| Failed::with_code(format!("cannot read {}", path.display()), exit::REFUSED, e))
}

/// Runs `k3-ctl tokenize`.
pub fn run_tokenize(a: TokenizeArgs) -> Result<i32, Failed> {
    let t0 = Instant::now();
    let tok = load(&a.tok)?;
    let load_s = t0.elapsed().as_secs_f64();
    let input: Vec<u8> = match (&a.text, &a.file) {
        (Some(t), _) => t.clone().into_bytes(),
        (None, Some(path)) => read_input(path)?,
        (None, None) => return Err(Failed::refused("give --text or --file")),
    };
    let splitter = if a.regex_pretok {
        Some(RegexSplitter::new().map_err(|e| Failed::coded(exit::FAILURE, e))?)
    } else {
        None
    };
    let t1 = Instant::now();
    let result = match &splitter {
        None => tok.encode_bytes(&input, a.allow_special),
        Some(s) => tok.encode_bytes_with_regex(s, &input, a.allow_special),
    };
    let encode_s = t1.elapsed().as_secs_f64();
    let ids = result.map_err(|e| Failed::coded(exit::REFUSED, e))?;
    if a.stats {
        let mb_s = if encode_s > 0.0 {
            input.len() as f64 / 1e6 / encode_s
        } else {
            0.0
        };
        eprintln!(
            "k3-ctl tokenize: pretokenizer={} load_s={load_s:.6} encode_s={encode_s:.6} bytes={} tokens={} encode_mb_per_s={mb_s:.2}",
            if splitter.is_some() { "regex" } else { "scanner" },
            input.len(),
            ids.len()
        );
    }
    let mut line = String::with_capacity(ids.len() * 7 + 1);
    for (k, id) in ids.iter().enumerate() {
        if k > 0 {
            line.push(',');
        }
        // Writing to a String cannot fail.
        let _ = write!(line, "{id}");
    }
    line.push('\n');
    write_stdout(line.as_bytes())
}

/// Parses a comma-separated id list; spaces around ids are allowed, empty items are not.
/// An id list item that is not an id (exit 2).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum IdError {
    /// Not a non-negative decimal integer.
    #[error("id #{index} {item:?} is not a non-negative decimal integer")]
    NotDecimal {
        /// Position in the list.
        index: usize,
        /// The item.
        item: String,
    },
    /// Larger than a u32.
    #[error("id #{index} {item} is too large")]
    TooLarge {
        /// Position in the list.
        index: usize,
        /// The item.
        item: String,
    },
}

fn parse_ids(text: &str) -> Result<Vec<u32>, IdError> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(',')
        .enumerate()
        .map(|(k, item)| {
            let item = item.trim();
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return Err(IdError::NotDecimal {
                    index: k,
                    item: item.to_string(),
                });
            }
            item.parse::<u32>().map_err(|_| IdError::TooLarge {
                index: k,
                item: item.to_string(),
            })
        })
        .collect()
}

/// Runs `k3-ctl detokenize`.
pub fn run_detokenize(a: DetokenizeArgs) -> Result<i32, Failed> {
    let text = match (&a.ids, &a.ids_file) {
        (Some(s), _) => s.clone(),
        (None, Some(path)) => std::fs::read_to_string(path).map_err(|e| {
            Failed::with_code(format!("cannot read {}", path.display()), exit::REFUSED, e)
        })?,
        (None, None) => return Err(Failed::refused("give --ids or --ids-file")),
    };
    let ids = parse_ids(&text).map_err(|e| Failed::coded(exit::REFUSED, e))?;
    let tok = load(&a.tok)?;
    let bytes = tok
        .decode(&ids)
        .map_err(|e| Failed::coded(exit::REFUSED, e))?;
    write_stdout(&bytes)
}

#[cfg(test)]
mod tests {
    use super::parse_ids;

    #[test]
    fn id_lists() {
        assert_eq!(parse_ids("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_ids("\n").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_ids("1,2, 3\n").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_ids("163839").unwrap(), vec![163_839]);
        for bad in ["1,,2", "1,", "-1", "0x10", "1 2", "4294967296", "a"] {
            assert!(parse_ids(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_ids("1,x").unwrap_err().to_string().contains("id #1"));
    }
}
