//! Readers of the two tokenizer files: `tiktoken.model` (ranks) and `tokenizer_config.json`
//! (added tokens). Every malformed input is an error naming the file and, for the vocabulary, the
//! line; every length is bounded before allocating.

use std::path::Path;

use base64::Engine as _;

use super::bpe::RankMap;
use super::error::TokError;

/// Largest accepted `tiktoken.model` (the real one is 2.8 MB).
pub const MAX_VOCAB_FILE: u64 = 64 << 20;
/// Largest accepted `tokenizer_config.json`.
pub const MAX_CONFIG_FILE: u64 = 16 << 20;
/// Longest accepted base64 field (the real vocabulary's longest token is 256 bytes).
const MAX_BASE64_LEN: usize = 4096;
/// Number of added-token slots after the ranks (ids `n_ranks..n_ranks + 256`).
pub const N_SPECIAL_SLOTS: u32 = 256;

/// Reads a whole file after checking its size.
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, TokError> {
    let io = |e: std::io::Error| TokError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > max {
        return Err(TokError::Format {
            path: path.to_path_buf(),
            line: None,
            msg: format!("file is {len} bytes, more than the {max}-byte limit"),
        });
    }
    std::fs::read(path).map_err(io)
}

/// The parsed vocabulary: token bytes by rank (dense `0..n`) and the reverse map.
#[derive(Debug)]
pub struct Vocab {
    /// Concatenated token bytes; token `r` is `bytes[offsets[r]..offsets[r + 1]]`.
    pub bytes: Vec<u8>,
    pub offsets: Vec<u32>,
    pub map: RankMap,
}

/// Parses `tiktoken.model`: one `<base64 of token bytes> <rank>` per line (a trailing `\r` is
/// tolerated, blank lines are skipped as tiktoken's loader does). Ranks must be exactly
/// `0..n` once each and token byte strings distinct: the rank is the token id.
pub fn parse_vocab(path: &Path, data: &[u8]) -> Result<Vocab, TokError> {
    let err = |line: usize, msg: String| TokError::Format {
        path: path.to_path_buf(),
        line: Some(line),
        msg,
    };
    let lines: Vec<(usize, &[u8])> = data
        .split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix(b"\r").unwrap_or(l)))
        .filter(|(_, l)| !l.is_empty())
        .collect();
    let n = lines.len();
    if n == 0 {
        return Err(TokError::Format {
            path: path.to_path_buf(),
            line: None,
            msg: "no entries".into(),
        });
    }
    // Bounded by the file size: at most one entry per 3 bytes.
    let mut by_rank: Vec<Option<(usize, Vec<u8>)>> = Vec::new();
    by_rank.resize_with(n, || None);
    let engine = base64::engine::general_purpose::STANDARD;
    for &(lineno, line) in &lines {
        let text =
            std::str::from_utf8(line).map_err(|_| err(lineno, "line is not ASCII text".into()))?;
        let mut fields = text.split(' ');
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(err(
                lineno,
                format!("expected `<base64> <rank>` separated by one space, found {text:?}"),
            ));
        };
        if b64.is_empty() || b64.len() > MAX_BASE64_LEN {
            return Err(err(
                lineno,
                format!(
                    "token field is {} characters (must be 1..={MAX_BASE64_LEN})",
                    b64.len()
                ),
            ));
        }
        let token = engine
            .decode(b64)
            .map_err(|e| err(lineno, format!("invalid base64 {b64:?}: {e}")))?;
        if token.is_empty() {
            return Err(err(lineno, "token decodes to zero bytes".into()));
        }
        if rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err(
                lineno,
                format!("rank {rank:?} is not a non-negative decimal integer"),
            ));
        }
        let r: usize = rank.parse().unwrap_or(usize::MAX);
        if r >= n {
            return Err(err(
                lineno,
                format!(
                    "rank {rank} out of range: the file has {n} entries, so ranks must be 0..{n}"
                ),
            ));
        }
        if let Some((first, _)) = &by_rank[r] {
            return Err(err(
                lineno,
                format!("rank {r} already given on line {first}"),
            ));
        }
        by_rank[r] = Some((lineno, token));
    }
    let mut bytes = Vec::with_capacity(data.len());
    let mut offsets = Vec::with_capacity(n + 1);
    let mut map = RankMap::default();
    map.reserve(n);
    offsets.push(0u32);
    for (r, slot) in by_rank.into_iter().enumerate() {
        // Every slot is filled (n distinct ranks in 0..n); kept as an error, not a panic.
        let Some((lineno, token)) = slot else {
            return Err(TokError::Format {
                path: path.to_path_buf(),
                line: None,
                msg: format!("rank {r} missing"),
            });
        };
        bytes.extend_from_slice(&token);
        offsets.push(
            u32::try_from(bytes.len()).map_err(|_| err(lineno, "vocabulary too large".into()))?,
        );
        let rank = u32::try_from(r).map_err(|_| err(lineno, "too many ranks".into()))?;
        if let Some(prev) = map.insert(token.into_boxed_slice(), rank) {
            return Err(err(
                lineno,
                format!("token bytes repeat those of rank {prev}"),
            ));
        }
    }
    Ok(Vocab {
        bytes,
        offsets,
        map,
    })
}

/// Added tokens read from `tokenizer_config.json`.
#[derive(Debug)]
pub struct AddedTokens {
    /// Content of ids `n_ranks + k`, `k < N_SPECIAL_SLOTS`.
    pub contents: Vec<String>,
    pub bos: Option<String>,
    pub eos: Option<String>,
}

/// Reads `added_tokens_decoder` like `tokenization_kimi.py`: every id in
/// `n_ranks..n_ranks + 256` is a special token, named by the file or else
/// `<|reserved_token_{id}|>`. Ids outside that block, empty or repeated contents are errors.
pub fn parse_config(path: &Path, data: &[u8], n_ranks: u32) -> Result<AddedTokens, TokError> {
    let err = |msg: String| TokError::Format {
        path: path.to_path_buf(),
        line: None,
        msg,
    };
    let v: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let decoder = v
        .get("added_tokens_decoder")
        .ok_or_else(|| err("no `added_tokens_decoder` object".into()))?
        .as_object()
        .ok_or_else(|| err("`added_tokens_decoder` is not an object".into()))?;
    let mut named: Vec<Option<String>> = vec![None; N_SPECIAL_SLOTS as usize];
    for (key, val) in decoder {
        let id: u32 = key
            .parse()
            .map_err(|_| err(format!("added token key {key:?} is not a decimal id")))?;
        if id < n_ranks || id - n_ranks >= N_SPECIAL_SLOTS {
            return Err(err(format!(
                "added token id {id} is outside the special block {n_ranks}..{}",
                n_ranks + N_SPECIAL_SLOTS
            )));
        }
        let content = val
            .get("content")
            .and_then(|c| c.as_str())
            .ok_or_else(|| err(format!("added token {id} has no string `content`")))?;
        if content.is_empty() {
            return Err(err(format!("added token {id} has empty content")));
        }
        named[(id - n_ranks) as usize] = Some(content.to_string());
    }
    let contents: Vec<String> = named
        .into_iter()
        .enumerate()
        .map(|(k, c)| c.unwrap_or_else(|| format!("<|reserved_token_{}|>", n_ranks + k as u32)))
        .collect();
    let mut seen = std::collections::HashMap::new();
    for (k, c) in contents.iter().enumerate() {
        if let Some(first) = seen.insert(c.as_str(), k) {
            return Err(err(format!(
                "ids {} and {} have the same content {c:?}",
                n_ranks + first as u32,
                n_ranks + k as u32
            )));
        }
    }
    let token_name = |field: &str| -> Result<Option<String>, TokError> {
        match v.get(field) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(o) => match o.get("content").and_then(|c| c.as_str()) {
                Some(s) => Ok(Some(s.to_string())),
                None => Err(err(format!(
                    "`{field}` is neither a string nor {{content}}"
                ))),
            },
        }
    };
    Ok(AddedTokens {
        contents,
        bos: token_name("bos_token")?,
        eos: token_name("eos_token")?,
    })
}
