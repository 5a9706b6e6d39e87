//! Tests on the real Kimi vocabulary (`fixtures/tokenizer/`) and on small synthetic files.

use super::*;
use std::path::PathBuf;
use std::sync::OnceLock;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer")
}

fn kimi() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_dir(&fixture_dir()).expect("fixtures/tokenizer loads"))
}

#[test]
fn goldens() {
    // SPEC.md §5.2.
    let t = kimi();
    let cases: &[(&str, &[u32])] = &[
        ("The capital of France is", &[1008, 10484, 318, 15383, 387]),
        ("Hello world", &[19180, 2695]),
        ("你好世界", &[33845, 2243]),
        ("Hello, world!", &[19180, 11, 2695, 0]),
        ("1234567890", &[6694, 12972, 16242, 15]),
        ("中文English混合", &[16717, 44372, 13935]),
    ];
    for (text, want) in cases {
        assert_eq!(t.encode(text), *want, "encode {text:?}");
        assert_eq!(
            t.encode_with_special(text),
            *want,
            "encode_with_special {text:?}"
        );
        assert_eq!(t.decode(want).unwrap(), text.as_bytes(), "decode {text:?}");
    }
    let pieces: Vec<&str> = t.pieces("中文English混合").collect();
    assert_eq!(pieces, ["中文", "English", "混合"]);
}

#[test]
fn vocabulary_shape_and_added_tokens() {
    let t = kimi();
    assert_eq!(t.n_ranks(), 163_584);
    assert_eq!(t.vocab_size(), 163_840);
    let named = [
        ("[BOS]", 163_584),
        ("[EOS]", 163_585),
        ("<|end_of_msg|>", 163_586),
        ("<|open|>", 163_587),
        ("<|close|>", 163_588),
        ("<|sep|>", 163_589),
        ("[EOT]", 163_593),
        ("<|media_pad|>", 163_605),
        ("<osagent_mode>", 163_649),
        ("[UNK]", 163_838),
        ("[PAD]", 163_839),
        ("<|reserved_token_163592|>", 163_592),
        ("<|reserved_token_163837|>", 163_837),
    ];
    for (s, id) in named {
        assert_eq!(t.special_id(s), Some(id), "{s}");
        assert_eq!(t.token_bytes(id), Some(s.as_bytes()));
    }
    assert_eq!(t.special_id("<|im_end|>"), None);
    assert_eq!(t.bos_id(), Some(163_584));
    assert_eq!(t.eos_id(), Some(163_585));
    assert_eq!(t.token_bytes(163_840), None);
    // Rank order is file order: the first entries are the printable ASCII bytes.
    assert_eq!(t.token_bytes(0), Some(&b"!"[..]));
    assert_eq!(t.token_bytes(11), Some(&b","[..]));
}

#[test]
fn user_typed_special_strings_stay_text() {
    let t = kimi();
    let text = "a<|open|>b";
    let user = t.encode(text);
    assert!(
        !user.contains(&163_587),
        "user text produced a control id: {user:?}"
    );
    assert!(user.iter().all(|&id| id < t.n_ranks()));
    assert_eq!(t.decode(&user).unwrap(), text.as_bytes());
    let special = t.encode_with_special(text);
    assert_eq!(special.len(), 3, "{special:?}");
    assert_eq!(special[1], 163_587);
    assert_eq!(special[0], t.encode("a")[0]);
    assert_eq!(special[2], t.encode("b")[0]);
    assert_eq!(t.decode(&special).unwrap(), text.as_bytes());
    // Adjacent and overlapping-prefix cases: "<<|sep|>" has its token at offset 1.
    assert_eq!(
        t.encode_with_special("<|sep|><|sep|>"),
        vec![163_589, 163_589]
    );
    let v = t.encode_with_special("<<|sep|>");
    assert_eq!(v.last(), Some(&163_589));
    assert_eq!(t.decode(&v).unwrap(), b"<<|sep|>");
}

#[test]
fn special_splitting_ends_the_segment_for_lookahead() {
    // "a  <|open|>": with specials the segment "a  " ends before the token, so `\s+(?!\S)`
    // takes both spaces; as user text the run is followed by '<' and splits " " + " <|...".
    let t = kimi();
    let with = t.encode_with_special("a  <|open|>");
    let a_sp = t.encode("a  ");
    assert_eq!(&with[..with.len() - 1], &a_sp[..]);
    assert_eq!(with.last(), Some(&163_587));
}

#[test]
fn decode_errors_name_the_id() {
    let t = kimi();
    match t.decode(&[1, 163_840]) {
        Err(TokError::UnknownId { id, position, .. }) => {
            assert_eq!((id, position), (163_840, 1));
        }
        other => panic!("expected UnknownId, got {other:?}"),
    }
    assert_eq!(t.decode(&[]).unwrap(), b"");
}

#[test]
fn invalid_utf8_is_refused_with_offset() {
    let t = kimi();
    match t.encode_bytes(b"ab\xffcd", false) {
        Err(TokError::InvalidUtf8 { offset }) => assert_eq!(offset, 2),
        other => panic!("expected InvalidUtf8, got {other:?}"),
    }
    // A truncated multi-byte sequence at the end.
    match t.encode_bytes("é".as_bytes().split_at(1).0, false) {
        Err(TokError::InvalidUtf8 { offset }) => assert_eq!(offset, 0),
        other => panic!("expected InvalidUtf8, got {other:?}"),
    }
    assert_eq!(t.encode_bytes(b"", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn tokens_that_split_utf8_decode_losslessly() {
    // Rare CJK / emoji fall back to byte tokens that hold partial UTF-8 sequences; the
    // concatenation must still be the exact input.
    let t = kimi();
    for text in ["𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "👨‍👩‍👧‍👦🏳️‍🌈", "\u{10ffff}\u{e000}", "𠀀𠀁"]
    {
        let ids = t.encode(text);
        assert_eq!(t.decode(&ids).unwrap(), text.as_bytes(), "{text:?}");
    }
}

#[test]
fn chunking_splits_long_runs_like_tokenization_kimi() {
    let mut chunks = Vec::new();
    let text = "a".repeat(60_000);
    kimi_chunks(&text, |c| chunks.push(c.len()));
    assert_eq!(chunks, vec![25_000, 25_000, 10_000]);

    // The run counter resets at each whitespace/non-whitespace change.
    let text = format!("{} {}", "b".repeat(25_000), "c".repeat(25_001));
    let mut chunks = Vec::new();
    kimi_chunks(&text, |c| chunks.push(c.len()));
    assert_eq!(chunks, vec![25_000 + 1 + 25_000, 1]);

    // Whitespace runs, with Python's isspace (U+001C counts as space there).
    let text = "\u{1c}".repeat(25_001);
    let mut chunks = Vec::new();
    kimi_chunks(&text, |c| chunks.push(c.chars().count()));
    assert_eq!(chunks, vec![25_000, 1]);

    // 400,000-character windows are counted in characters, not bytes.
    let text = "é ".repeat(250_000);
    let mut chunks = Vec::new();
    kimi_chunks(&text, |c| chunks.push(c.chars().count()));
    assert_eq!(chunks, vec![400_000, 100_000]);

    // A 25,001-letter run is not one piece: the tokens of the whole equal those of the halves.
    let t = kimi();
    let text = "x".repeat(25_001);
    let mut want = t.encode(&"x".repeat(25_000));
    want.extend(t.encode("x"));
    assert_eq!(t.encode(&text), want);
}

#[test]
fn py_isspace_matches_python() {
    // The 29 code points for which Python 3's str.isspace() is true.
    let python: [u32; 29] = [
        0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001,
        0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029,
        0x202f, 0x205f, 0x3000,
    ];
    let ours: Vec<u32> = (0..0x11_0000u32)
        .filter_map(char::from_u32)
        .filter(|&c| py_isspace(c))
        .map(u32::from)
        .collect();
    assert_eq!(ours, python);
}

#[test]
fn regex_reference_path_agrees_on_mixed_text() {
    let t = kimi();
    let re = pretok::RegexSplitter::new().unwrap();
    let text = "Hello, WORLD's 42nd\tday!\r\n  中文English混合 ünïcödé \u{301}ABC 👍🏽 <|open|> x  ";
    for allow in [false, true] {
        assert_eq!(
            t.encode_bytes_with_regex(&re, text.as_bytes(), allow)
                .unwrap(),
            t.encode_bytes(text.as_bytes(), allow).unwrap(),
            "allow_special={allow}"
        );
    }
}

// ---- malformed files ------------------------------------------------------------------------

/// A small valid vocabulary: the 256 bytes (rank = byte) plus "ab" (256).
fn toy_vocab() -> String {
    use base64::Engine as _;
    let e = base64::engine::general_purpose::STANDARD;
    let mut s = String::new();
    for b in 0..=255u8 {
        s += &format!("{} {b}\n", e.encode([b]));
    }
    s += &format!("{} 256\n", e.encode(b"ab"));
    s
}

fn toy_config(n_ranks: u32) -> String {
    format!(
        r#"{{"added_tokens_decoder": {{"{}": {{"content": "<|x|>", "special": true}}}}, "bos_token": "<|x|>"}}"#,
        n_ranks
    )
}

fn load(vocab: &str, config: &str) -> Result<Tokenizer, TokError> {
    Tokenizer::from_bytes(
        Path::new("tiktoken.model"),
        vocab.as_bytes(),
        Path::new("tokenizer_config.json"),
        config.as_bytes(),
    )
}

fn format_error(vocab: &str, config: &str) -> (Option<usize>, String) {
    match load(vocab, config) {
        Err(TokError::Format { line, msg, .. }) => (line, msg),
        other => panic!("expected a format error, got {other:?}"),
    }
}

#[test]
fn toy_files_load_and_encode() {
    let t = load(&toy_vocab(), &toy_config(257)).unwrap();
    assert_eq!(t.vocab_size(), 257 + 256);
    assert_eq!(t.encode("abc"), vec![256, u32::from(b'c')]);
    assert_eq!(t.special_id("<|x|>"), Some(257));
    assert_eq!(t.special_id("<|reserved_token_258|>"), Some(258));
    assert_eq!(t.bos_id(), Some(257));
    assert_eq!(t.encode_with_special("ab<|x|>"), vec![256, 257]);
}

#[test]
fn malformed_vocab_lines_are_reported_with_line_numbers() {
    let good = toy_vocab();
    let cfg = toy_config(257);
    let mut lines: Vec<String> = good.lines().map(str::to_string).collect();

    let with_line = |lines: &[String], k: usize, replacement: &str| -> String {
        let mut l = lines.to_vec();
        l[k] = replacement.to_string();
        l.join("\n") + "\n"
    };
    // Line numbers are 1-based.
    let cases = [
        (5, "QQ==", "expected `<base64> <rank>`"),
        (5, "QQ== 4 9", "expected `<base64> <rank>`"),
        (5, "!!!! 4", "invalid base64"),
        (5, "QQ== -4", "not a non-negative decimal integer"),
        (5, "QQ== 999", "out of range"),
        (5, "QQ== 3", "already given on line 4"),
        (5, "QUI= 4", ""),
    ];
    for (k, repl, want) in cases {
        let text = with_line(&lines, k - 1, repl);
        if want.is_empty() {
            // "AB" is a new token at rank 4, so byte 0x04 lost its rank.
            let (_, msg) = format_error(&text, &cfg);
            assert!(msg.contains("byte 0x04 has no rank"), "{msg}");
            continue;
        }
        let (line, msg) = format_error(&text, &cfg);
        assert_eq!(line, Some(k), "{repl:?}: {msg}");
        assert!(msg.contains(want), "{repl:?}: {msg}");
    }
    // Duplicate token bytes.
    lines.push(lines[97].replace(" 97", " 257"));
    let text = lines.join("\n") + "\n";
    let (line, msg) = format_error(&text, &toy_config(258));
    assert!(msg.contains("repeat those of rank 97"), "{msg}");
    assert!(line.is_some());
    // Empty file.
    let (_, msg) = format_error("", &cfg);
    assert!(msg.contains("no entries"), "{msg}");
    // CRLF line endings are accepted.
    let crlf = good.replace('\n', "\r\n");
    assert!(load(&crlf, &cfg).is_ok());
}

#[test]
fn malformed_configs_are_refused() {
    let v = toy_vocab();
    let bad = [
        ("not json", "invalid JSON"),
        ("{}", "no `added_tokens_decoder`"),
        (r#"{"added_tokens_decoder": []}"#, "not an object"),
        (
            r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#,
            "not a decimal id",
        ),
        (
            r#"{"added_tokens_decoder": {"256": {"content": "a"}}}"#,
            "outside the special block",
        ),
        (
            r#"{"added_tokens_decoder": {"513": {"content": "a"}}}"#,
            "outside the special block",
        ),
        (
            r#"{"added_tokens_decoder": {"257": {}}}"#,
            "no string `content`",
        ),
        (
            r#"{"added_tokens_decoder": {"257": {"content": ""}}}"#,
            "empty content",
        ),
        (
            r#"{"added_tokens_decoder": {"257": {"content": "q"}, "258": {"content": "q"}}}"#,
            "same content",
        ),
        (
            r#"{"added_tokens_decoder": {"257": {"content": "<|reserved_token_300|>"}}}"#,
            "same content",
        ),
        (
            r#"{"added_tokens_decoder": {}, "eos_token": "[EOS]"}"#,
            "is not an added token",
        ),
    ];
    for (cfg, want) in bad {
        let (_, msg) = format_error(&v, cfg);
        assert!(msg.contains(want), "{cfg}: {msg}");
    }
}

#[test]
fn missing_directory_is_an_io_error() {
    match Tokenizer::from_dir(Path::new("/nonexistent/k3-tokenizer")) {
        Err(TokError::Io { path, .. }) => assert!(path.ends_with("tiktoken.model")),
        other => panic!("expected Io, got {other:?}"),
    }
}

#[test]
fn scan_and_heap_merges_agree_on_the_real_vocabulary() {
    // Long pieces use the heap merge; check it against the scan merge on real pieces: Han runs,
    // Thai without spaces, letters, digits-free punctuation runs and emoji, at many lengths.
    let t = kimi();
    let sources = [
        "人工智能正在改变世界大型语言模型的推理需要大量内存和计算资源",
        "ภาษาไทยไม่มีช่องว่างระหว่างคำสวัสดีชาวโลก",
        "Pneumonoultramicroscopicsilicovolcanoconiosis",
        "👨‍👩‍👧‍👦🏳️‍🌈👋🏽🇫🇷❤️",
        "!!!???...---***###@@@((()))",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    ];
    let mut scratch = bpe::Scratch::default();
    for src in sources {
        let chars: Vec<char> = src.chars().collect();
        for len in 1..=chars.len() {
            for start in [0, chars.len() - len] {
                let piece: String = chars[start..start + len].iter().collect();
                let (mut a, mut b) = (Vec::new(), Vec::new());
                if piece.len() < 2 {
                    continue;
                }
                bpe::merge_scan(&t.ranks, piece.as_bytes(), &mut a, &mut scratch);
                bpe::merge_heap(&t.ranks, piece.as_bytes(), &mut b, &mut scratch);
                assert_eq!(a, b, "piece {piece:?}");
                assert_eq!(t.decode(&a).unwrap(), piece.as_bytes());
            }
        }
    }
}

#[test]
fn every_token_looks_up_its_own_rank() {
    // The lookup is split by length (byte table, pair table, packed 64/128-bit keys, byte-string
    // map); every token must find its rank, and strings with trailing NUL bytes must not alias
    // shorter ones.
    let t = kimi();
    for id in 0..t.n_ranks() {
        let b = t.token_bytes(id).unwrap();
        assert_eq!(t.ranks.rank(b), id, "token {id} {b:?}");
    }
    assert_eq!(t.ranks.rank(b"the\0"), bpe::NONE);
    assert_eq!(t.ranks.rank(b"\0\0\0\0\0\0\0\0\0"), bpe::NONE);
    assert_eq!(t.ranks.rank(b""), bpe::NONE);
}
