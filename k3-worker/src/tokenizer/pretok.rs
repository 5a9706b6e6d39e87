//! Kimi's pre-tokenizer: cuts text into the pieces that tiktoken's `find_iter` over
//! [`kimi_pattern`] produces, with a hand-written scanner.
//!
//! The pattern (SPEC.md §5.2, `tokenization_kimi.py`'s `pat_str`) is an alternation tried in
//! order at each position, with backtracking (leftmost-first) semantics:
//!
//! ```text
//! 1  [\p{Han}]+
//! 2  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//! 3  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//! 4  \p{N}{1,3}
//! 5   ?[^\s\p{L}\p{N}]+[\r\n]*
//! 6  \s*[\r\n]+
//! 7  \s+(?!\S)
//! 8  \s+
//! ```
//!
//! The scanner resolves each alternative's backtracking in closed form (derivations at each
//! function). Its character classes are not hand-written: they are the pattern's own bracket
//! expressions, resolved to code-point ranges by `regex-syntax` (the same crate, and in this
//! workspace the same version, that resolves them inside `fancy-regex` and inside tiktoken), so the
//! Unicode tables cannot drift from the reference regex. The reference itself stays available as
//! [`RegexSplitter`]; unit tests compare the two on randomised text and the Python parity test
//! compares both with the `tiktoken` package.
//!
//! Every character starts a piece (the classes below partition the code points: Han, letters in
//! `UPPER`/`LOWER`, `\p{N}`, `\s`, or `[^\s\p{L}\p{N}]`), so `find_iter` never skips text and the
//! pieces tile the input; a test checks the partition over all of Unicode.

use regex_syntax::hir::{Class, HirKind};

/// The eight alternatives of Kimi's `pat_str`, in order.
pub const KIMI_PATTERN_PARTS: [&str; 8] = [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
];

/// Kimi's full pre-tokenizer pattern (`"|".join(...)` of [`KIMI_PATTERN_PARTS`]).
pub fn kimi_pattern() -> String {
    KIMI_PATTERN_PARTS.join("|")
}

// One bit per bracket expression of the pattern.
/// `[\p{Han}]`
const HAN: u8 = 1 << 0;
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]` (the "upper" run of alternatives 2 and 3)
const UPPER: u8 = 1 << 1;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]` (the "lower" run)
const LOWER: u8 = 1 << 2;
/// `[^\r\n\p{L}\p{N}]` (the optional one-character prefix of alternatives 2 and 3)
const PREFIX: u8 = 1 << 3;
/// `\p{N}`
const NUM: u8 = 1 << 4;
/// `[^\s\p{L}\p{N}]` (alternative 5)
const PUNCT: u8 = 1 << 5;
/// `\s` (Unicode `White_Space`)
const SPACE: u8 = 1 << 6;
/// `[\r\n]`
const NEWLINE: u8 = 1 << 7;

/// The class expressions, exactly as written in the pattern.
const CLASS_SOURCES: [(u8, &str); 8] = [
    (HAN, r"[\p{Han}]"),
    (UPPER, r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    (LOWER, r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    (PREFIX, r"[^\r\n\p{L}\p{N}]"),
    (NUM, r"\p{N}"),
    (PUNCT, r"[^\s\p{L}\p{N}]"),
    (SPACE, r"\s"),
    (NEWLINE, r"[\r\n]"),
];

/// The contraction suffix `(?i:'s|'t|'re|'ve|'m|'ll|'d)`, alternatives in order.
const CONTRACTIONS: [&str; 7] = ["s", "t", "re", "ve", "m", "ll", "d"];

/// Number of code points covered by the class table (all of Unicode).
const N_CODE_POINTS: usize = 0x11_0000;
/// Code points per block of the two-level class table.
const BLOCK: usize = 256;

/// Why the pre-tokenizer could not be set up (a bug of the pattern tables), or its reference
/// regex gave up.
#[derive(Debug, thiserror::Error)]
pub enum PretokError {
    /// A class expression does not parse.
    #[error("pre-tokenizer class {src:?} does not parse: {source}")]
    Parse {
        /// The expression.
        src: String,
        /// Why.
        source: Box<regex_syntax::Error>,
    },
    /// A class expression is not a Unicode class.
    #[error("pre-tokenizer class {src:?} did not resolve to a Unicode class: {kind}")]
    NotUnicode {
        /// The expression.
        src: String,
        /// What it resolved to.
        kind: String,
    },
    /// A class range outside Unicode.
    #[error("class {src:?} has an invalid range {lo:#x}..={hi:#x}")]
    Range {
        /// The expression.
        src: String,
        /// First code point.
        lo: usize,
        /// Last code point.
        hi: usize,
    },
    /// More distinct class blocks than a `u16` numbers.
    #[error("too many class blocks")]
    Blocks,
    /// Kimi's pattern does not compile.
    #[error("Kimi pattern does not compile: {0}")]
    Compile(#[source] Box<fancy_regex::Error>),
    /// The regex engine gave up on a text (backtrack limit).
    #[error("pre-tokenizer regex failed: {0}")]
    Regex(#[source] Box<fancy_regex::Error>),
}

/// Resolves one regex class expression to its code-point ranges with `regex-syntax`.
fn class_ranges(src: &str) -> Result<Vec<(u32, u32)>, PretokError> {
    let hir = (regex_syntax::ParserBuilder::new().build().parse(src)).map_err(|e| {
        PretokError::Parse {
            src: src.to_string(),
            source: Box::new(e),
        }
    })?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => Ok(c
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect()),
        other => Err(PretokError::NotUnicode {
            src: src.to_string(),
            kind: format!("{other:?}"),
        }),
    }
}

/// Character classes of the pattern, looked up per code point in a two-level table
/// (`index[cp / 256]` selects a deduplicated 256-entry block).
#[derive(Clone)]
struct CharClasses {
    /// ASCII fast path.
    ascii: [u8; 128],
    /// Block number per 256-code-point block.
    index: Vec<u16>,
    /// Deduplicated blocks, `BLOCK` bytes each.
    blocks: Vec<u8>,
}

impl CharClasses {
    fn new() -> Result<Self, PretokError> {
        let mut full = vec![0u8; N_CODE_POINTS];
        for (bit, src) in CLASS_SOURCES {
            for (lo, hi) in class_ranges(src)? {
                let (lo, hi) = (lo as usize, hi as usize);
                if lo > hi || hi >= N_CODE_POINTS {
                    return Err(PretokError::Range {
                        src: src.to_string(),
                        lo,
                        hi,
                    });
                }
                for v in &mut full[lo..=hi] {
                    *v |= bit;
                }
            }
        }
        let mut index = Vec::with_capacity(N_CODE_POINTS / BLOCK);
        let mut blocks: Vec<u8> = Vec::new();
        let mut seen: std::collections::HashMap<&[u8], u16> = std::collections::HashMap::new();
        for chunk in full.chunks(BLOCK) {
            let next = u16::try_from(seen.len()).map_err(|_| PretokError::Blocks)?;
            let id = *seen.entry(chunk).or_insert_with(|| {
                blocks.extend_from_slice(chunk);
                next
            });
            index.push(id);
        }
        let mut ascii = [0u8; 128];
        ascii.copy_from_slice(&full[..128]);
        Ok(CharClasses {
            ascii,
            index,
            blocks,
        })
    }

    #[inline]
    fn of(&self, cp: u32) -> u8 {
        if cp < 128 {
            return self.ascii[cp as usize];
        }
        let cp = cp as usize;
        let Some(&block) = self.index.get(cp / BLOCK) else {
            return 0;
        };
        self.blocks
            .get(usize::from(block) * BLOCK + cp % BLOCK)
            .copied()
            .unwrap_or(0)
    }
}

/// Decodes the code point starting at byte `i` of valid UTF-8 (bytes of a `&str`).
/// Returns the code point and its length in bytes; `None` at the end of the text.
#[inline]
fn decode(s: &[u8], i: usize) -> Option<(u32, usize)> {
    let b0 = *s.get(i)?;
    if b0 < 0x80 {
        return Some((u32::from(b0), 1));
    }
    let cont = |k: usize| s.get(i + k).map_or(0, |b| u32::from(b & 0x3F));
    if b0 < 0xE0 {
        Some(((u32::from(b0 & 0x1F) << 6) | cont(1), 2))
    } else if b0 < 0xF0 {
        Some(((u32::from(b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2), 3))
    } else {
        Some((
            (u32::from(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3),
            4,
        ))
    }
}

/// The hand-written scanner for Kimi's pattern.
#[derive(Clone)]
pub struct PreTokenizer {
    classes: CharClasses,
    /// For each letter of [`CONTRACTIONS`], the code points `(?i:x)` matches (simple case
    /// folding, e.g. `s` → `s S ſ`), resolved by `regex-syntax` like the classes.
    folds: Vec<(u8, Vec<u32>)>,
}

impl std::fmt::Debug for PreTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreTokenizer")
            .field("class_blocks", &(self.classes.blocks.len() / BLOCK))
            .finish()
    }
}

impl PreTokenizer {
    /// Builds the class tables from the pattern's own class expressions.
    pub fn new() -> Result<Self, PretokError> {
        let classes = CharClasses::new()?;
        let mut folds = Vec::new();
        for letter in b"strevmld" {
            let src = format!("(?i:{})", char::from(*letter));
            let mut cps = Vec::new();
            for (lo, hi) in class_ranges(&src)? {
                cps.extend(lo..=hi);
            }
            folds.push((*letter, cps));
        }
        Ok(PreTokenizer { classes, folds })
    }

    #[inline]
    fn class_at(&self, s: &[u8], i: usize) -> u8 {
        decode(s, i).map_or(0, |(c, _)| self.classes.of(c))
    }

    /// Byte offset after the longest run, from `i`, of characters whose class has a bit of `mask`.
    #[inline]
    fn run(&self, s: &[u8], mut i: usize, mask: u8) -> usize {
        while let Some((c, l)) = decode(s, i) {
            if self.classes.of(c) & mask == 0 {
                break;
            }
            i += l;
        }
        i
    }

    fn folds_to(&self, letter: u8, cp: u32) -> bool {
        self.folds
            .iter()
            .find(|(l, _)| *l == letter)
            .is_some_and(|(_, cps)| cps.contains(&cp))
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` at `e`: the end of the first alternative that matches,
    /// else `e` (the optional group is greedy and nothing follows it, so it never backtracks).
    fn contraction(&self, s: &[u8], e: usize) -> usize {
        if s.get(e) != Some(&b'\'') {
            return e;
        }
        'alt: for alt in CONTRACTIONS {
            let mut j = e + 1;
            for letter in alt.bytes() {
                match decode(s, j) {
                    Some((c, l)) if self.folds_to(letter, c) => j += l,
                    _ => continue 'alt,
                }
            }
            return j;
        }
        e
    }

    /// Alternative 2 after its optional prefix: `UPPER* LOWER+ contraction?` from `st`.
    ///
    /// `UPPER*` first takes the maximal run `b_0..b_k`; backtracking then offers `LOWER+` the
    /// positions `b_k, b_{k-1}, …, b_0` in that order. At `b_k` (a character outside `UPPER`) the
    /// greedy `LOWER+` takes the whole `LOWER` run. At `b_j`, `j < k`, it can take only one
    /// character: had `b_{j+1}` been in `LOWER`, the larger `j+1` would have been accepted first.
    /// So the match ends after the last `LOWER` character inside the `UPPER` run.
    fn letters_lower(&self, s: &[u8], st: usize) -> Option<usize> {
        let mut e = st;
        let mut last_lower_end = None;
        while let Some((c, l)) = decode(s, e) {
            let k = self.classes.of(c);
            if k & UPPER == 0 {
                break;
            }
            if k & LOWER != 0 {
                last_lower_end = Some(e + l);
            }
            e += l;
        }
        if self.class_at(s, e) & LOWER != 0 {
            let e = self.run(s, e, LOWER);
            return Some(self.contraction(s, e));
        }
        last_lower_end.map(|e| self.contraction(s, e))
    }

    /// Alternative 3 after its optional prefix: `UPPER+ LOWER* contraction?` from `st`. Both
    /// tails can match empty, so the greedy runs are final.
    fn letters_upper(&self, s: &[u8], st: usize) -> Option<usize> {
        let e = self.run(s, st, UPPER);
        if e == st {
            return None;
        }
        let e = self.run(s, e, LOWER);
        Some(self.contraction(s, e))
    }

    /// End (byte offset, `> i`) of the piece that starts at byte `i < s.len()` of `s`, where `s`
    /// is the whole text being split (lookahead `(?!\S)` sees the end of `s` as "no character").
    pub fn piece_end(&self, s: &[u8], i: usize) -> usize {
        let Some((c0, l0)) = decode(s, i) else {
            return s.len();
        };
        let k0 = self.classes.of(c0);
        // 1. [\p{Han}]+
        if k0 & HAN != 0 {
            return self.run(s, i + l0, HAN);
        }
        // 2. and 3.: the optional prefix is greedy, so each alternative is tried with the first
        // character as prefix, then without it.
        if k0 & PREFIX != 0 {
            if let Some(e) = self.letters_lower(s, i + l0) {
                return e;
            }
        }
        if let Some(e) = self.letters_lower(s, i) {
            return e;
        }
        if k0 & PREFIX != 0 {
            if let Some(e) = self.letters_upper(s, i + l0) {
                return e;
            }
        }
        if let Some(e) = self.letters_upper(s, i) {
            return e;
        }
        // 4. \p{N}{1,3}
        if k0 & NUM != 0 {
            let mut e = i + l0;
            for _ in 0..2 {
                match decode(s, e) {
                    Some((c, l)) if self.classes.of(c) & NUM != 0 => e += l,
                    _ => break,
                }
            }
            return e;
        }
        // 5.  ?[^\s\p{L}\p{N}]+[\r\n]*  (a space is not in PUNCT, so without the optional space
        // the run would have to start at the space and cannot)
        if c0 == u32::from(b' ') && self.class_at(s, i + 1) & PUNCT != 0 {
            let e = self.run(s, i + 1, PUNCT);
            return self.run(s, e, NEWLINE);
        }
        if k0 & PUNCT != 0 {
            let e = self.run(s, i + l0, PUNCT);
            return self.run(s, e, NEWLINE);
        }
        if k0 & SPACE != 0 {
            // The whitespace run b_0..b_k from i.
            let mut e = i;
            let mut last_char_start = i;
            let mut last_newline_end = None;
            let mut count = 0usize;
            while let Some((c, l)) = decode(s, e) {
                let k = self.classes.of(c);
                if k & SPACE == 0 {
                    break;
                }
                if k & NEWLINE != 0 {
                    last_newline_end = Some(e + l);
                }
                last_char_start = e;
                e += l;
                count += 1;
            }
            // 6. \s*[\r\n]+ : \s* backs off to the last \r or \n of the run, which [\r\n]+ takes
            // alone (a later one would have been accepted first).
            if let Some(end) = last_newline_end {
                return end;
            }
            // 7. \s+(?!\S) : the whole run if it ends the text, else all but its last character
            // (which is whitespace, so the lookahead holds), if that leaves at least one.
            if e == s.len() {
                return e;
            }
            if count >= 2 {
                return last_char_start;
            }
            // 8. \s+
            return e;
        }
        // Unreachable: the classes partition Unicode (tested). Advance one character so the
        // scanner always makes progress.
        i + l0
    }

    /// Iterator over the pieces of `text`.
    pub fn pieces<'a>(&'a self, text: &'a str) -> Pieces<'a> {
        Pieces {
            pre: self,
            text,
            pos: 0,
        }
    }
}

/// Iterator returned by [`PreTokenizer::pieces`].
#[derive(Debug)]
pub struct Pieces<'a> {
    pre: &'a PreTokenizer,
    text: &'a str,
    pos: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        if self.pos >= self.text.len() {
            return None;
        }
        let start = self.pos;
        let end = self.pre.piece_end(self.text.as_bytes(), start);
        self.pos = end;
        self.text.get(start..end)
    }
}

/// The reference splitter: `fancy-regex` running Kimi's pattern verbatim (what tiktoken runs).
#[derive(Debug)]
pub struct RegexSplitter {
    re: fancy_regex::Regex,
}

impl RegexSplitter {
    /// Compiles [`kimi_pattern`].
    pub fn new() -> Result<Self, PretokError> {
        let re = fancy_regex::Regex::new(&kimi_pattern())
            .map_err(|e| PretokError::Compile(Box::new(e)))?;
        Ok(RegexSplitter { re })
    }

    /// The pieces of `text` (`find_iter`); an error if the regex engine gives up (backtrack
    /// limit), which tiktoken would turn into a panic.
    pub fn pieces<'a>(&self, text: &'a str) -> Result<Vec<&'a str>, PretokError> {
        self.re
            .find_iter(text)
            .map(|m| {
                m.map(|m| m.as_str())
                    .map_err(|e| PretokError::Regex(Box::new(e)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanner_pieces<'a>(p: &'a PreTokenizer, t: &'a str) -> Vec<&'a str> {
        p.pieces(t).collect()
    }

    #[test]
    fn classes_partition_unicode() {
        // Every scalar value is Han, an UPPER/LOWER letter, a number, whitespace or PUNCT; this is
        // what makes every position the start of a match (no text is skipped).
        let c = CharClasses::new().unwrap();
        for cp in (0..0xD800u32).chain(0xE000..0x11_0000) {
            let k = c.of(cp);
            assert!(
                k & (HAN | UPPER | LOWER | NUM | SPACE | PUNCT) != 0,
                "code point {cp:#x} is in no class"
            );
        }
        // Spot checks of the Han subtraction and of categories.
        assert_eq!(c.of('中' as u32) & (HAN | UPPER | LOWER), HAN);
        assert_eq!(c.of('A' as u32) & (UPPER | LOWER), UPPER);
        assert_eq!(c.of('a' as u32) & (UPPER | LOWER), LOWER);
        assert_eq!(c.of('あ' as u32) & (UPPER | LOWER), UPPER | LOWER); // Lo
        assert_eq!(
            c.of(0x301) & (UPPER | LOWER | PREFIX),
            UPPER | LOWER | PREFIX
        ); // Mn
        assert_eq!(c.of(0x3007) & (HAN | NUM), HAN | NUM); // 〇 is Han and Nl
        assert_ne!(c.of(0x2F00) & HAN, 0); // Kangxi radical (So) is Han
        assert_ne!(c.of(0x2028) & SPACE, 0);
        assert_eq!(c.of(0x1C) & SPACE, 0); // Python isspace, but not \s
    }

    #[test]
    fn contraction_folds_include_long_s() {
        let p = PreTokenizer::new().unwrap();
        assert!(p.folds_to(b's', 0x17F));
        assert!(p.folds_to(b's', 'S' as u32));
        assert!(!p.folds_to(b't', 'S' as u32));
    }

    #[test]
    fn known_splits() {
        let p = PreTokenizer::new().unwrap();
        let cases: &[(&str, &[&str])] = &[
            ("中文English混合", &["中文", "English", "混合"]),
            ("\u{301}ABC", &["\u{301}", "ABC"]),
            ("HELLO'S world  x", &["HELLO'S", " world", " ", " x"]),
            ("it's  \n\n x", &["it's", "  \n\n", " x"]),
            ("a   ", &["a", "   "]),
            ("1234567", &["123", "456", "7"]),
            (" !!\r\n", &[" !!\r\n"]),
            ("a\u{17f}'\u{17f}", &["aſ'ſ"]),
            ("", &[]),
        ];
        for (text, want) in cases {
            assert_eq!(scanner_pieces(&p, text), *want, "pieces of {text:?}");
        }
    }

    /// Deterministic xorshift generator for randomised comparisons.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn scanner_equals_fancy_regex_on_random_text() {
        // An alphabet hitting every class boundary of the pattern: upper/lower/title letters,
        // modifier letters, Lo, marks, Han (incl. So radicals and Nl 〇), numbers of several
        // kinds, apostrophes and fold variants, spaces of several kinds, CR/LF, punctuation,
        // emoji with ZWJ and variation selectors, Python-only spaces.
        let alphabet: Vec<&str> = vec![
            "a",
            "b",
            "s",
            "t",
            "r",
            "e",
            "v",
            "m",
            "l",
            "d",
            "A",
            "S",
            "T",
            "R",
            "E",
            "L",
            "D",
            "\u{17f}",
            "\u{212a}",
            "ǅ",
            "ʰ",
            "ـ",
            "é",
            "\u{301}",
            "\u{308}",
            "\u{93f}",
            "あ",
            "ア",
            "ー",
            "한",
            "ᄀ",
            "中",
            "文",
            "\u{2f00}",
            "\u{3007}",
            "々",
            "0",
            "7",
            "٣",
            "Ⅻ",
            "½",
            "²",
            "'",
            "'",
            "'",
            "’",
            " ",
            " ",
            " ",
            "\t",
            "\u{a0}",
            "\u{3000}",
            "\u{2028}",
            "\u{85}",
            "\r",
            "\n",
            "\r\n",
            "\u{b}",
            "\u{c}",
            "\u{1c}",
            "!",
            ".",
            ",",
            "-",
            "(",
            "_",
            "<|open|>",
            "😀",
            "👍🏽",
            "\u{200d}",
            "\u{fe0f}",
            "👨‍👩‍👧",
            "\u{200b}",
            "€",
            "Ω",
            "ω",
            "Я",
            "я",
            "א",
            "ب",
            "ก",
            "\u{e31}",
            "\u{0}",
        ];
        let scanner = PreTokenizer::new().unwrap();
        let reference = RegexSplitter::new().unwrap();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for case in 0..4000 {
            let len = rng.below(24);
            let text: String = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect();
            let want = reference.pieces(&text).unwrap();
            let got = scanner_pieces(&scanner, &text);
            assert_eq!(got, want, "case {case}: text {text:?}");
        }
    }
}
